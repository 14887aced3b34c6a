//! `floodgate serve --store redis://…` (and `floodgate proxy`) through the
//! real binary: several instances enforce one limit together, exactly, and
//! a Redis that dies under load costs no hang and no panic: each rule's
//! failure policy answers, and decisions are exact again once Redis is back.

use crate::cli;

use std::time::{Duration, Instant};

use cli::{Served, http, http_get, run};
use floodgate_testing::RedisServer;
use serde_json::Value;

/// One domain per exact algorithm, each `LIMIT` per hour (a test finishes
/// long before a gcra-family bucket refills one more unit: 72 s).
const LIMIT: u64 = 50;

fn rules() -> String {
    let algorithms = [
        ("fixed_window", ""),
        ("sliding_log", ""),
        ("sliding_buckets", "\n      granularity: 60"),
        ("token_bucket", ""),
        ("gcra", ""),
        ("leaky_bucket", ""),
    ];
    algorithms
        .iter()
        .map(|(a, extra)| {
            format!(
                "domain: {a}\ndescriptors:\n  - key: user\n    rate_limit:\n      algorithm: {a}\n      window: 1h\n      requests_per_unit: {LIMIT}{extra}\n"
            )
        })
        .collect::<Vec<_>>()
        .join("---\n")
}

const FAILURE_RULES: &str = "domain: open
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 1000000}
---
domain: closed
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 1000000, failure_mode: closed}
---
domain: local
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 40, failure_mode: local, local_share: 0.5}
";

/// `floodgate serve` on `store`, with a short Redis timeout.
fn served(name: &str, rules: &str, store: &str) -> Served {
    Served::start(name, rules, &["--store", store, "--redis-timeout", "200ms"])
}

/// `floodgate bench` against `server` for `duration`, one key; its report.
fn bench(server: &str, protocol: &str, domain: &str, duration: &str, concurrency: &str) -> Value {
    cli::bench(server, protocol, &["--domain", domain, "--duration", duration, "--concurrency", concurrency])
}

fn count(v: &Value, field: &str) -> u64 {
    v[field].as_u64().unwrap()
}

#[test]
fn two_instances_on_one_redis_admit_exactly_the_limit() {
    let redis = RedisServer::start();
    let rules = rules();
    let a = served("redis-a", &rules, &redis.url());
    let b = served("redis-b", &rules, &redis.url());
    for domain in ["fixed_window", "sliding_log", "sliding_buckets", "token_bucket", "gcra", "leaky_bucket"] {
        // Both instances hammer the same key at once, over both protocols.
        let (ra, rb) = std::thread::scope(|s| {
            let ja = s.spawn(|| bench(&a.grpc, "grpc", domain, "700ms", "16"));
            let jb = s.spawn(|| bench(&b.http, "json", domain, "700ms", "16"));
            (ja.join().unwrap(), jb.join().unwrap())
        });
        for r in [&ra, &rb] {
            assert_eq!(count(r, "errors"), 0, "{domain}: {r}");
        }
        let allowed = count(&ra, "allowed") + count(&rb, "allowed");
        let total = allowed + count(&ra, "denied") + count(&rb, "denied");
        assert!(total > 2 * LIMIT, "{domain}: the test must offer more than the limit ({total} requests)");
        assert_eq!(allowed, LIMIT, "{domain}: two instances admitted {allowed} of {total}, not exactly {LIMIT}");
    }
}

/// `floodgate check` against `server`: (exit code, stdout).
fn check(server: &str, domain: &str, user: &str) -> (Option<i32>, String) {
    let (code, out, _) =
        run(&["check", "--server", server, "--domain", domain, "--descriptor", &format!("user={user}")]);
    (code, out)
}

#[test]
fn a_dead_redis_gets_each_rules_failure_policy_then_exact_decisions_again() {
    let mut redis = RedisServer::start();
    let s = served("redis-fail", FAILURE_RULES, &redis.url());
    assert_eq!(check(&s.grpc, "closed", "u").0, Some(0), "Redis up: allowed");

    // Load while Redis dies: no request may hang past the timeout (bench
    // would report it in its max latency) and none errors.
    let load = std::thread::spawn({
        let grpc = s.grpc.clone();
        move || bench(&grpc, "grpc", "open", "2s", "8")
    });
    std::thread::sleep(Duration::from_millis(500));
    redis.kill();
    let r = load.join().unwrap();
    assert_eq!(count(&r, "errors"), 0, "{r}");
    assert_eq!(count(&r, "denied"), 0, "failure_mode open allows: {r}");
    let max_ms = r["latency_ms"]["max"].as_f64().unwrap();
    assert!(max_ms < 1_000.0, "a request waited {max_ms} ms: longer than the timeout allows");

    // Redis down: open allows, closed denies, local limits at its share.
    assert_eq!(check(&s.grpc, "open", "u").0, Some(0));
    assert_eq!(check(&s.grpc, "closed", "u").0, Some(1), "failure_mode closed denies");
    let local: Vec<Option<i32>> = (0..22).map(|_| check(&s.grpc, "local", "u").0).collect();
    assert_eq!(local.iter().filter(|c| **c == Some(0)).count(), 20, "local: 40 × 0.5 per instance: {local:?}");

    let (code, ready) = http_get(&s.http, "/readyz");
    assert_eq!(code, 503, "not ready while Redis is down: {ready}");
    let (_, metrics) = http_get(&s.http, "/metrics");
    assert!(metrics.contains("floodgate_redis_breaker_open 1"), "{metrics}");

    // Redis back (empty): within 3 s decisions come from it again, exactly.
    redis.restart();
    let deadline = Instant::now() + Duration::from_secs(10);
    while check(&s.grpc, "closed", "probe").0 != Some(0) {
        assert!(Instant::now() < deadline, "decisions did not recover within 10 s of Redis returning");
        std::thread::sleep(Duration::from_millis(100));
    }
    let (code, _) = http_get(&s.http, "/readyz");
    assert_eq!(code, 200);
    // The local fallback is no longer used: a fresh key gets the full 40.
    let allowed = (0..41).filter(|_| check(&s.grpc, "local", "fresh").0 == Some(0)).count();
    assert_eq!(allowed, 40, "Redis decides again, with the whole limit");
    let (_, metrics) = http_get(&s.http, "/metrics");
    assert!(metrics.contains("floodgate_redis_breaker_open 0"), "{metrics}");
}

const PROXY_RULES: &str = "domain: proxy
descriptors:
  - key: remote_address
    rate_limit: {unit: hour, requests_per_unit: 6, name: per_client}
---
domain: open
descriptors:
  - key: remote_address
    rate_limit: {unit: hour, requests_per_unit: 6}
---
domain: strict
descriptors:
  - key: remote_address
    rate_limit: {unit: hour, requests_per_unit: 6, failure_mode: closed}
";

#[test]
fn two_proxies_on_one_redis_share_each_clients_limit_and_a_dead_redis_gets_the_failure_policy() {
    let mut redis = RedisServer::start();
    let up = Served::start("proxy-redis-up", "domain: none\ndescriptors: []\n", &[]);
    let upstream = format!("http://{}", up.http);
    let proxy = |name, domain| {
        let args = ["--store", &redis.url(), "--redis-timeout", "200ms", "--domain", domain];
        Served::proxy(name, PROXY_RULES, &upstream, &args)
    };
    let (a, b) = (proxy("proxy-redis-a", "proxy"), proxy("proxy-redis-b", "proxy"));
    let (open, strict) = (proxy("proxy-redis-open", "open"), proxy("proxy-redis-strict", "strict"));
    // One client (127.0.0.1) through both: 6 in all, then 429s from either.
    let codes: Vec<u16> = [&a, &b].iter().cycle().take(10).map(|p| http_get(&p.proxy, "/healthz").0).collect();
    assert_eq!(codes, [200, 200, 200, 200, 200, 200, 429, 429, 429, 429]);
    for p in [&open, &strict] {
        assert_eq!(http_get(&p.proxy, "/healthz").0, 200, "Redis up: allowed");
    }

    // Redis gone: each answer within the timeout, by the rule's policy
    // (failure_mode open by default; closed denies).
    redis.kill();
    for (p, want) in [(&open, 200), (&strict, 429)] {
        let started = Instant::now();
        let (code, body) = http_get(&p.proxy, "/healthz");
        assert_eq!(code, want, "{body}");
        assert!(started.elapsed() < Duration::from_secs(2), "waited {:?} for a dead Redis", started.elapsed());
    }
    // A client already over its limit stays denied (the over-limit cache).
    assert_eq!(http_get(&a.proxy, "/healthz").0, 429);
}

#[test]
fn an_override_set_on_one_instance_reaches_the_other() {
    let redis = RedisServer::start();
    let rules = rules();
    let a = served("ovr-a", &rules, &redis.url());
    let b = served("ovr-b", &rules, &redis.url());
    let spec = r#"{"domain": "gcra", "descriptor": [{"key": "user", "value": "vip"}], "limits": {"unit": "hour", "requests_per_unit": 3}}"#;
    let (code, body) = http(&a.admin, "PUT", "/admin/v1/overrides", spec);
    assert_eq!(code, 200, "{body}");
    // B sees it (it polls every 250 ms; allow 10 s on a busy machine).
    let deadline = Instant::now() + Duration::from_secs(10);
    while !http_get(&b.admin, "/admin/v1/overrides").1.contains("vip") {
        assert!(Instant::now() < deadline, "instance B never saw the override");
        std::thread::sleep(Duration::from_millis(50));
    }
    // The override's counter is shared too: 3 in all, across both.
    let allowed: Vec<Option<i32>> = [&a, &b, &a, &b].iter().map(|s| check(&s.grpc, "gcra", "vip").0).collect();
    assert_eq!(allowed, [Some(0), Some(0), Some(0), Some(1)]);
    // Deleted on B: gone from A.
    let del = r#"{"domain": "gcra", "descriptor": [{"key": "user", "value": "vip"}]}"#;
    let (code, body) = http(&b.admin, "DELETE", "/admin/v1/overrides", del);
    assert_eq!(code, 200, "{body}");
    while http_get(&a.admin, "/admin/v1/overrides").1.contains("vip") {
        assert!(Instant::now() < deadline, "instance A never saw the deletion");
        std::thread::sleep(Duration::from_millis(50));
    }
    // With Redis down, a change fails and changes nothing.
    drop(redis);
    let (code, body) = http(&a.admin, "PUT", "/admin/v1/overrides", spec);
    assert_eq!(code, 503, "{body}");
    assert!(!http_get(&a.admin, "/admin/v1/overrides").1.contains("vip"));
}

/// Issue 23, defect 1: after Redis came back, a decision that landed on a
/// thread whose connection dated from before the restart got the failure
/// policy (`200 429 200` with `failure_mode: closed`). Every thread must
/// decide exactly once the breaker closed, with no request to warm it, and
/// the background probe must close the breaker with no traffic at all.
#[test]
fn regression_after_redis_returns_every_thread_decides_exactly() {
    let mut redis = RedisServer::start();
    // More deciding threads than the machine's cores, both kinds.
    let threads = ["--grpc-threads", "4", "--workers", "4"];
    let s = Served::start("redis-return", FAILURE_RULES, &[&["--store", &redis.url()][..], &threads].concat());
    let remaining = |user: &str| -> u64 {
        let body = format!(r#"{{"domain": "closed", "descriptors": [{{"user": "{user}"}}], "hits": 0}}"#);
        let (code, text) = http(&s.http, "POST", "/v1/check", &body);
        assert_eq!(code, 200, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        v["descriptors"][0]["remaining"].as_u64().unwrap()
    };
    // Every thread gets a connection: each `check` is a new gRPC connection
    // (handed out round-robin), each HTTP request a new one too.
    let decide_everywhere = |user: &str, n: usize| -> Vec<String> {
        let mut answers = Vec::new();
        for _ in 0..n {
            answers.push(format!("grpc:{:?}", check(&s.grpc, "closed", user).0));
            let body = format!(r#"{{"domain": "closed", "descriptors": [{{"user": "{user}"}}]}}"#);
            let (_, text) = http(&s.http, "POST", "/v1/check", &body);
            let v: Value = serde_json::from_str(&text).unwrap();
            answers.push(format!("http:{}", v["allowed"]));
        }
        answers
    };
    let all_allowed = |a: &[String]| a.iter().all(|x| x == "grpc:Some(0)" || x == "http:true");
    let warm = decide_everywhere("warm", 12);
    assert!(all_allowed(&warm), "{warm:?}");

    redis.kill();
    let down = decide_everywhere("down", 3);
    assert!(down.iter().all(|x| x == "grpc:Some(1)" || x == "http:false"), "closed denies: {down:?}");
    let (_, metrics) = http_get(&s.http, "/metrics");
    assert!(metrics.contains("floodgate_redis_breaker_open 1"), "{metrics}");

    redis.restart();
    // No decisions now: the probe alone must close the breaker.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !http_get(&s.http, "/metrics").1.contains("floodgate_redis_breaker_open 0") {
        assert!(Instant::now() < deadline, "the breaker did not close within 10 s of Redis returning");
        std::thread::sleep(Duration::from_millis(50));
    }
    // 3 × 8 threads' worth of requests, each on a new connection: every one
    // decided by Redis, and counted once.
    let back = decide_everywhere("back", 12);
    assert!(all_allowed(&back), "a thread's stale connection answered with the failure policy: {back:?}");
    assert_eq!(remaining("back"), 1_000_000 - 24, "each decision counted exactly once");
}
