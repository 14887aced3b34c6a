//! `floodgate proxy` metering an OpenAI-compatible upstream (the fake of
//! `floodgate-testing`, started by the test): each request reserves its
//! estimate (`max_tokens`), its response settles the tokens and the money
//! its usage says, and the budgets are exact after every case — a JSON
//! body, a stream (the proxy asks for its usage), a slow stream, a stream
//! cut mid-way, an upstream error, a response without usage, a client that
//! goes away, a request denied by one dimension — on memory and on Redis.

use crate::cli;

use std::io::Read;
use std::time::Duration;

use cli::{Served, http};
use floodgate_testing::openai::FakeOpenAi;
use floodgate_testing::redis::RedisServer;

/// Four limits per tenant, each its own descriptor (so a peek reads each):
/// requests, total tokens, output tokens and money (micro-dollars at 0.15
/// per input token and 0.6 per output token).
const RULES: &str = "domain: llm
request_descriptors:
  - actions: [{request_headers: {header_name: x-tenant, descriptor_key: requests}}]
  - actions: [{request_headers: {header_name: x-tenant, descriptor_key: tokens}}]
  - actions: [{request_headers: {header_name: x-tenant, descriptor_key: output}}]
  - actions: [{request_headers: {header_name: x-tenant, descriptor_key: money}}]
descriptors:
  - key: requests
    rate_limit: {unit: hour, requests_per_unit: 1000}
  - key: tokens
    rate_limit:
      unit: hour
      requests_per_unit: 100000
      cost: {estimate: {body: [max_completion_tokens, max_tokens], default: 500}, actual: {usage: total_tokens}}
  - key: output
    rate_limit:
      unit: hour
      requests_per_unit: 100000
      cost: {estimate: {body: max_tokens, default: 500}, actual: {usage: completion_tokens}}
  - key: money
    rate_limit:
      unit: hour
      requests_per_unit: 1000000
      cost:
        estimate: {body: max_tokens, default: 500, times: 0.6, plus: 100}
        actual: {usage: {prompt_tokens: 0.15, completion_tokens: 0.6}}
";

/// What each budget has used, as the test expects it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Used {
    requests: u64,
    tokens: u64,
    output: u64,
    money: u64,
}

impl Used {
    /// A request whose usage was read: `prompt` and `completion` tokens.
    fn usage(&mut self, prompt: u64, completion: u64) {
        self.requests += 1;
        self.tokens += prompt + completion;
        self.output += completion;
        self.money += (150_000 * prompt + 600_000 * completion).div_ceil(1_000_000);
    }

    /// A request that kept its estimate (`max_tokens`).
    fn estimate(&mut self, max_tokens: u64) {
        self.requests += 1;
        self.tokens += max_tokens;
        self.output += max_tokens;
        self.money += (600_000 * max_tokens).div_ceil(1_000_000) + 100;
    }
}

/// What the budgets say they have used (a peek of each).
fn used(s: &Served, tenant: &str) -> Used {
    let body = format!(
        r#"{{"domain": "llm", "hits": 0, "descriptors": [{{"requests": "{tenant}"}}, {{"tokens": "{tenant}"}}, {{"output": "{tenant}"}}, {{"money": "{tenant}"}}]}}"#
    );
    let (code, text) = http(&s.http, "POST", "/v1/check", &body);
    assert_eq!(code, 200, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let left = |i: usize| v["descriptors"][i]["remaining"].as_u64().unwrap();
    Used { requests: 1000 - left(0), tokens: 100_000 - left(1), output: 100_000 - left(2), money: 1_000_000 - left(3) }
}

/// A chat completion through the proxy: (status, head, body).
fn chat(proxy: &str, tenant: &str, fake: &str, body: &str) -> (u16, String, String) {
    let extra = format!("x-tenant: {tenant}\r\nx-fake: {fake}\r\nx-fake-prompt: 10\r\nx-fake-completion: 20\r\n");
    cli::http_with(proxy, "POST", "/v1/chat/completions", body, &extra)
}

/// A request for tenant acme on a raw connection, its response left to
/// the caller (read whole, in part, or not at all).
fn request(proxy: &str, fake: &str, body: &str) -> std::net::TcpStream {
    cli::send(proxy, "POST", "/v1/chat/completions", body, &format!("x-tenant: acme\r\nx-fake: {fake}\r\n"))
}

fn metered(store: &[&str], name: &str) {
    let fake = FakeOpenAi::start();
    let s = Served::proxy(name, RULES, &fake.url(), &[&["--domain", "llm"], store].concat());
    let mut want = Used::default();
    // Settles happen as responses end: wait for each (with a deadline).
    let settled = |want: Used, what: &str| {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while used(&s, "acme") != want && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(used(&s, "acme"), want, "{what}");
    };

    // A JSON body: its usage settles every dimension.
    let (code, _, body) = chat(&s.proxy, "acme", "", r#"{"model": "m", "max_tokens": 100}"#);
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("\"total_tokens\":30"), "{body}");
    want.usage(10, 20);
    settled(want, "a JSON body settles at its usage");

    // A stream asking no usage: the proxy asks for it, and it settles.
    let (code, _, body) = chat(&s.proxy, "acme", "", r#"{"model": "m", "max_tokens": 100, "stream": true}"#);
    assert_eq!(code, 200);
    assert!(body.contains("data: [DONE]") && body.contains("\"usage\""), "{body}");
    let asked = fake.bodies().last().cloned().unwrap();
    assert!(asked.contains("\"include_usage\":true"), "the proxy asked for usage: {asked}");
    want.usage(10, 20);
    settled(want, "a stream settles at its usage chunk");

    // A slow stream: the same, once it ends.
    let (code, _, _) = chat(&s.proxy, "acme", "slow", r#"{"max_tokens": 100, "stream": true}"#);
    assert_eq!(code, 200);
    want.usage(10, 20);
    settled(want, "a slow stream settles at its usage");

    // A stream cut half-way: no usage came, the estimate stays.
    let mut c = request(&s.proxy, "cut", r#"{"max_tokens": 100, "stream": true}"#);
    let _ = c.read_to_end(&mut Vec::new());
    want.estimate(100);
    settled(want, "a cut stream keeps its estimate");

    // An upstream error: nothing served, the costs are given back (the
    // request still counts).
    let (code, _, _) = chat(&s.proxy, "acme", "error", r#"{"max_tokens": 100}"#);
    assert_eq!(code, 500);
    want.requests += 1;
    settled(want, "an upstream error settles at 0");

    // A body without usage: the estimate (max_completion_tokens first).
    let (code, _, _) = chat(&s.proxy, "acme", "no-usage", r#"{"max_completion_tokens": 40, "max_tokens": 100}"#);
    assert_eq!(code, 200);
    want.requests += 1;
    want.tokens += 40;
    want.output += 100;
    want.money += 160;
    settled(want, "no usage: the estimates");

    // A client that goes away mid-stream: the estimate stays.
    let mut c = request(&s.proxy, "slow", r#"{"max_tokens": 100, "stream": true}"#);
    let mut first = [0u8; 256];
    let n = c.read(&mut first).unwrap();
    assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"));
    drop(c);
    want.estimate(100);
    settled(want, "a client gone mid-stream leaves the estimate");

    // Denied by one dimension (the estimate does not fit the tokens):
    // nothing is reserved anywhere, the request is not counted.
    let (code, _, body) = chat(&s.proxy, "acme", "", r#"{"max_tokens": 200000}"#);
    assert_eq!(code, 429, "{body}");
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(used(&s, "acme"), want, "a denied request reserves nothing");
}

#[test]
fn the_proxy_meters_an_openai_upstream_in_memory() {
    metered(&[], "meter-mem");
}

#[test]
fn the_proxy_meters_an_openai_upstream_on_redis() {
    let redis = RedisServer::start();
    metered(&["--store", &redis.url()], "meter-redis");
}

/// A limit per model, the model read from the request's JSON body
/// (`body_field`): an OpenAI-style request names its model there, not in a
/// header. The big model's one request an hour is spent; the small model
/// and a request without a model (its descriptor left out) pass.
#[test]
fn the_proxy_limits_per_model_read_from_the_body() {
    let rules = "domain: llm
request_descriptors:
  - actions: [{body_field: {field: model, descriptor_key: model}}]
descriptors:
  - key: model
    value: big
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: model
    rate_limit: {unit: hour, requests_per_unit: 100}
";
    let fake = FakeOpenAi::start();
    let s = Served::proxy("meter-model", rules, &fake.url(), &["--domain", "llm"]);
    let ask = |body: &str| chat(&s.proxy, "acme", "", body).0;
    assert_eq!(ask(r#"{"model": "big", "max_tokens": 5}"#), 200);
    assert_eq!(ask(r#"{"model": "big", "max_tokens": 5}"#), 429, "the big model's hour is spent");
    assert_eq!(ask(r#"{"model": "small", "max_tokens": 5}"#), 200);
    assert_eq!(ask(r#"{"max_tokens": 5}"#), 200, "no model: no descriptor, nothing limits it");
    assert_eq!(ask(r#"{"model": "big", "stream": true}"#), 429, "streams too");
}

/// A tenant's rate and its slots (one in flight, leases of `lease_ttl`).
fn slot_rules(lease_ttl: &str) -> String {
    format!(
        "domain: llm
request_descriptors:
  - actions: [{{request_headers: {{header_name: x-tenant, descriptor_key: tenant}}}}]
descriptors:
  - key: tenant
    rate_limits:
      - {{unit: hour, requests_per_unit: 1000, name: tenant_rate}}
      - {{concurrency: 1, lease_ttl: {lease_ttl}, name: tenant_in_flight}}
"
    )
}

/// What tenant acme has used of `rule` (the admin API's counters).
fn used_of(admin: &str, rule: &str) -> u64 {
    let (code, _, body) = cli::http_full(
        admin,
        "POST",
        "/admin/v1/counters",
        r#"{"domain": "llm", "descriptor": [{"key": "tenant", "value": "acme"}]}"#,
    );
    assert_eq!(code, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let limit = v["limits"].as_array().unwrap().iter().find(|l| l["rule"] == rule);
    limit.and_then(|l| l["used"].as_u64()).unwrap_or_else(|| panic!("no {rule} in {v}"))
}

/// Issue 49: the proxy holds a tenant's slot from the request until the
/// upstream's response has been sent, or the client went away; a request
/// refused for concurrency never reaches the upstream and takes no rate.
#[test]
fn the_proxy_holds_a_slot_until_the_response_is_sent() {
    let rules = &slot_rules("60s");
    let fake = FakeOpenAi::start();
    let s = Served::proxy("leases-proxy", rules, &fake.url(), &["--domain", "llm"]);
    let quick = || chat(&s.proxy, "acme", "", r#"{"max_tokens": 5}"#).0;
    // A 40-token stream at 20 ms a token: its slot is held while it flows.
    let slow = r#"{"max_tokens": 40, "stream": true}"#;
    let head = |c: &mut std::net::TcpStream| {
        let mut buf = [0u8; 64];
        let n = c.read(&mut buf).unwrap();
        String::from_utf8_lossy(&buf[..n]).to_string()
    };
    let mut a = cli::send(
        &s.proxy,
        "POST",
        "/v1/chat/completions",
        slow,
        "x-tenant: acme\r\nx-fake: slow\r\nx-fake-completion: 40\r\n",
    );
    assert!(head(&mut a).starts_with("HTTP/1.1 200"));
    assert_eq!(quick(), 429, "one in flight");
    let upstream_before = fake.bodies().len();
    let mut rest = Vec::new();
    let _ = a.read_to_end(&mut rest);
    assert!(String::from_utf8_lossy(&rest).contains("[DONE]"));
    cli::eventually("the slot freed once the stream was sent", Duration::from_secs(5), || quick() == 200);
    assert_eq!(fake.bodies().len(), upstream_before + 1, "the refused request never reached the upstream");
    // A client that goes away mid-stream frees its slot.
    let mut b = cli::send(
        &s.proxy,
        "POST",
        "/v1/chat/completions",
        slow,
        "x-tenant: acme\r\nx-fake: slow\r\nx-fake-completion: 40\r\n",
    );
    assert!(head(&mut b).starts_with("HTTP/1.1 200"));
    assert_eq!(quick(), 429);
    drop(b);
    cli::eventually("the slot freed once the client went", Duration::from_secs(5), || quick() == 200);
    // The rate kept only the admitted requests (a, a quick one, b, a quick
    // one), and no slot is held.
    assert_eq!(used_of(&s.admin, "tenant_rate"), 4);
    assert_eq!(used_of(&s.admin, "tenant_in_flight"), 0);
}

/// Issue 49: a proxy killed (SIGKILL) mid-request never releases its slot;
/// on Redis the slot stays held for the instances that share it until the
/// lease ends (5 s here), then frees by itself; the killed request's rate
/// hit is counted once.
#[test]
fn a_killed_proxys_slot_frees_when_its_lease_ends_on_redis() {
    let rules = &slot_rules("5s");
    let redis = RedisServer::start();
    let fake = FakeOpenAi::start();
    let store = ["--store", &redis.url()];
    let proxy = Served::proxy("leases-proxy-killed", rules, &fake.url(), &[&["--domain", "llm"], &store[..]].concat());
    let mut stream = cli::send(
        &proxy.proxy,
        "POST",
        "/v1/chat/completions",
        r#"{"max_tokens": 200, "stream": true}"#,
        "x-tenant: acme\r\nx-fake: slow\r\nx-fake-completion: 200\r\n",
    );
    let mut buf = [0u8; 64];
    let n = stream.read(&mut buf).unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    drop(proxy); // SIGKILL mid-stream: no release is ever sent
    let mut rest = Vec::new();
    let _ = stream.read_to_end(&mut rest);
    assert!(!String::from_utf8_lossy(&rest).contains("[DONE]"), "the stream was cut");
    // Another instance on the same Redis sees the slot held, then free.
    let other = Served::start("leases-proxy-other", rules, &store);
    let check = |hits: i64| {
        let body = format!(r#"{{"domain": "llm", "descriptors": [{{"tenant": "acme"}}], "hits": {hits}}}"#);
        let (code, text) = cli::http(&other.http, "POST", "/v1/check", &body);
        assert_eq!(code, 200, "{text}");
        serde_json::from_str::<serde_json::Value>(&text).unwrap()
    };
    let held = check(0);
    let slots = held["descriptors"].as_array().unwrap();
    assert!(slots.iter().any(|d| d["remaining"] == 0), "the killed proxy's slot is still held: {held}");
    cli::eventually("the slot freed when its lease ended", Duration::from_secs(15), || {
        check(0)["descriptors"].as_array().unwrap().iter().all(|d| d["remaining"] != 0)
    });
    assert_eq!(used_of(&other.admin, "tenant_rate"), 1, "the killed request counted once");
    assert_eq!(used_of(&other.admin, "tenant_in_flight"), 0);
}

/// A tenant's tokens beside its slots in one request: the estimate is
/// reserved and the slot acquired in one call, and when the body ends the
/// tokens settle at the usage read and the slot is released.
fn cost_beside_a_slot(store: &[&str], name: &str) {
    let rules = "domain: llm
request_descriptors:
  - actions: [{request_headers: {header_name: x-tenant, descriptor_key: tenant}}]
descriptors:
  - key: tenant
    rate_limits:
      - unit: hour
        requests_per_unit: 100000
        name: tenant_tokens
        cost: {estimate: {body: max_tokens, default: 500}, actual: {usage: total_tokens}}
      - {concurrency: 1, lease_ttl: 60s, name: tenant_in_flight}
";
    let fake = FakeOpenAi::start();
    let s = Served::proxy(name, rules, &fake.url(), &[&["--domain", "llm"], store].concat());
    let used = |rule: &str| used_of(&s.admin, rule);
    for round in 1..=2u64 {
        let (code, _, body) = chat(&s.proxy, "acme", "", r#"{"max_tokens": 100}"#);
        assert_eq!(code, 200, "{body}");
        // 10 prompt + 20 completion tokens a response, not the 100 reserved.
        cli::eventually("the tokens settled at the usage", Duration::from_secs(5), || {
            used("tenant_tokens") == 30 * round
        });
        assert_eq!(used("tenant_in_flight"), 0, "the slot was released");
    }
}

#[test]
fn a_cost_beside_a_slot_settles_in_memory() {
    cost_beside_a_slot(&[], "cost-slot-mem");
}

#[test]
fn a_cost_beside_a_slot_settles_on_redis() {
    let redis = RedisServer::start();
    cost_beside_a_slot(&["--store", &redis.url()], "cost-slot-redis");
}
