//! Budgets through the service (issue 46), on the in-memory store, one
//! Redis server and a Redis Cluster:
//!
//! * refunds: Envoy's `is_negative_hits` over gRPC and `/json`, a negative
//!   `hits` on `/v1/check` — what a client sends is given back, never below
//!   zero, whatever the request's other descriptors decide, counted apart;
//! * charges after the work (`charge: after`): the exact gRPC sequence
//!   Envoy sends — a request-time peek (the gate), a stream-end charge
//!   (never denied, into debt), and the gate denied while the debt lasts.
//!
//! Each algorithm's arithmetic is checked against its reference model in
//! floodgate-core's property tests and, per store, in floodgate-redis's
//! conformance suite; these check the wiring.

use envoy_types::pb::google::protobuf::UInt64Value;
use floodgate_redis::RedisConfig;
use floodgate_testing::{RedisCluster, RedisServer};
use serde_json::{Value, json};

use crate::server::{Server, ask, call, desc, http, req};

/// A token budget charged after the work, beside an ordinary limit, in a
/// domain of its own.
const BUDGETS: &str = r#"
domain: llm
descriptors:
  - key: tenant
    rate_limit: {unit: hour, requests_per_unit: 1000, charge: after, name: tokens}
  - key: org
    rate_limit: {unit: minute, requests_per_unit: 2}
"#;

type Descriptor = envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;

/// A descriptor with its own `hits_addend` (Envoy's `hits_addend` on a
/// rate limit action: a number, or read from dynamic metadata at stream end).
fn hits(entries: &[(&str, &str)], n: u64) -> Descriptor {
    let mut d = desc(entries);
    d.hits_addend = Some(UInt64Value { value: n });
    d
}

/// Envoy's calls for an LLM request metered after the work: at request
/// time a peek of the tenant's budget (`hits_addend: 0`, the gate); at
/// stream end (`apply_on_stream_done`) the tokens the response used.
async fn charges_after_the_work_on(s: &Server) {
    let mut c = s.grpc().await;
    let gate = || req("llm", vec![hits(&[("tenant", "acme")], 0)], 0);
    let charge = |n: u64| req("llm", vec![hits(&[("tenant", "acme")], n)], 0);
    // Request 1: admitted with the whole budget; it used 700 tokens.
    let r = ask(&mut c, gate()).await;
    assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (Code::Ok as i32, 1000));
    let r = ask(&mut c, charge(700)).await;
    assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (Code::Ok as i32, 300));
    // Request 2: 300 left, admitted; it used 900: counted all the same.
    assert_eq!(ask(&mut c, gate()).await.overall_code, Code::Ok as i32);
    let r = ask(&mut c, charge(900)).await;
    assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (Code::Ok as i32, 0), "debt reads as 0 left");
    // Request 3: the budget is spent (1600 of 1000): the gate denies, and
    // the debt lasts into the next hour.
    let r = ask(&mut c, gate()).await;
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    let reset = r.statuses[0].duration_until_reset.unwrap().seconds;
    assert!(reset > 3600 && reset <= 7200, "the debt is paid off in the next hour: {reset} s");
    // A stream-end charge is never denied, even in debt, and never lost:
    // 50 more makes 1650, so a refund of 600 leaves 1050, still over.
    assert_eq!(ask(&mut c, charge(50)).await.overall_code, Code::Ok as i32);
    let mut back = hits(&[("tenant", "acme")], 600);
    back.is_negative_hits = true;
    assert_eq!(ask(&mut c, req("llm", vec![back.clone()], 0)).await.statuses[0].limit_remaining, 0);
    assert_eq!(ask(&mut c, gate()).await.overall_code, Code::OverLimit as i32);
    // Another 100 back: 950 used, the gate opens with 50 left.
    back.hits_addend = Some(UInt64Value { value: 100 });
    ask(&mut c, req("llm", vec![back], 0)).await;
    let r = ask(&mut c, gate()).await;
    assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (Code::Ok as i32, 50));
    // A late charge beside a denied ordinary limit keeps its hits: the
    // work it counts is done. (org: 2 a minute.)
    for _ in 0..2 {
        assert_eq!(ask(&mut c, req("llm", vec![desc(&[("org", "o")])], 1)).await.overall_code, Code::Ok as i32);
    }
    let both = req("llm", vec![hits(&[("tenant", "acme")], 40), desc(&[("org", "o")])], 1);
    assert_eq!(ask(&mut c, both).await.overall_code, Code::OverLimit as i32);
    assert_eq!(ask(&mut c, gate()).await.statuses[0].limit_remaining, 10);
    // Peeks elsewhere stay always allowed: org is used up, its peek is OK.
    let r = ask(&mut c, req("llm", vec![hits(&[("org", "o")], 0)], 0)).await;
    assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (Code::Ok as i32, 0));
    // Over HTTP: a late charge through /v1/check, then the gate.
    let h = http();
    let url = format!("http://{}/v1/check", s.http);
    let body = |n: i64| json!({"domain": "llm", "descriptors": [{"tenant": "http"}], "hits": n}).to_string();
    let (_, _, v) = call(&h, "POST", url.clone(), &body(5_000), None).await;
    assert_eq!((&v["allowed"], &v["descriptors"][0]["remaining"]), (&json!(true), &json!(0)), "{v}");
    let (st, _, v) = call(&h, "POST", url, &body(0), None).await;
    assert_eq!((st, &v["allowed"]), (200, &json!(false)), "{v}");
    let wait = v["retry_after_ms"].as_u64().unwrap();
    assert!(
        wait > 4 * 3_600_000 && wait <= 5 * 3_600_000,
        "5000 of 1000 an hour: paid off in the fifth hour: {wait} ms"
    );
}

/// A server with the budget rules beside the usual ones.
async fn budget_server(name: &str, redis: Option<String>) -> Server {
    Server::start_config(name, |c| {
        if let floodgate_server::rules::reload::RulesSource::Dir(dir) = &c.rules {
            std::fs::write(dir.join("llm.yaml"), BUDGETS).unwrap();
        }
        c.redis = redis.map(|url| RedisConfig::new(url.parse().unwrap()));
    })
    .await
}
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;

/// A descriptor that gives `hits` back (Envoy's `is_negative_hits`).
fn refund(entries: &[(&str, &str)], hits: u64) -> Descriptor {
    let mut d = desc(entries);
    d.hits_addend = Some(UInt64Value { value: hits });
    d.is_negative_hits = true;
    d
}

async fn refunds_on(s: Server) {
    let mut c = s.grpc().await;
    let user = |u: &str| vec![desc(&[("user", u)])];
    // user: 3 a minute. Take all three; the next is denied.
    assert_eq!(ask(&mut c, req("api", user("a"), 3)).await.overall_code, Code::Ok as i32);
    assert_eq!(ask(&mut c, req("api", user("a"), 1)).await.overall_code, Code::OverLimit as i32);
    // Give two back: allowed, and the answer counts them.
    let r = ask(&mut c, req("api", vec![refund(&[("user", "a")], 2)], 0)).await;
    assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (Code::Ok as i32, 2));
    assert_eq!(ask(&mut c, req("api", user("a"), 2)).await.overall_code, Code::Ok as i32);
    assert_eq!(ask(&mut c, req("api", user("a"), 1)).await.overall_code, Code::OverLimit as i32);
    // Never below zero: a refund of more than was taken leaves the limit full,
    // and a refund of a key never used takes nothing and creates nothing.
    let r = ask(&mut c, req("api", vec![refund(&[("user", "a")], 1_000)], 0)).await;
    assert_eq!(r.statuses[0].limit_remaining, 3);
    let r = ask(&mut c, req("api", vec![refund(&[("user", "fresh")], 5)], 0)).await;
    assert_eq!(r.statuses[0].limit_remaining, 3);
    assert_eq!(ask(&mut c, req("api", user("fresh"), 3)).await.overall_code, Code::Ok as i32);
    assert_eq!(ask(&mut c, req("api", user("fresh"), 1)).await.overall_code, Code::OverLimit as i32);
    // Without its own hits_addend, a refund gives back the request's.
    let mut bare = desc(&[("user", "fresh")]);
    bare.is_negative_hits = true;
    assert_eq!(ask(&mut c, req("api", vec![bare], 2)).await.statuses[0].limit_remaining, 2);
    // A refund beside a denied descriptor: the request is denied (tier=free
    // is used up), the refund still given back; the denied take took nothing.
    assert_eq!(ask(&mut c, req("api", vec![desc(&[("tier", "free")])], 1)).await.overall_code, Code::Ok as i32);
    let mixed = req("api", vec![refund(&[("user", "fresh")], 2), desc(&[("tier", "free")])], 1);
    let r = ask(&mut c, mixed).await;
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    assert_eq!((r.statuses[0].code, r.statuses[0].limit_remaining), (Code::Ok as i32, 3));

    // /json: the protobuf JSON mapping, isNegativeHits (or is_negative_hits).
    let h = http();
    let url = |p: &str| format!("http://{}{p}", s.http);
    let take = r#"{"domain":"api","descriptors":[{"entries":[{"key":"user","value":"j"}]}],"hitsAddend":3}"#;
    let (st, _, v) = call(&h, "POST", url("/json"), take, None).await;
    assert_eq!((st, v["overallCode"].as_str()), (200, Some("OK")));
    let back = r#"{"domain":"api","descriptors":[{"entries":[{"key":"user","value":"j"}],"hitsAddend":"1","isNegativeHits":true}]}"#;
    let (st, _, v) = call(&h, "POST", url("/json"), back, None).await;
    assert_eq!((st, v["statuses"][0]["limitRemaining"].as_u64()), (200, Some(1)), "{v}");
    let back = r#"{"domain":"api","descriptors":[{"entries":[{"key":"user","value":"j"}],"hits_addend":1,"is_negative_hits":true}]}"#;
    let (_, _, v) = call(&h, "POST", url("/json"), back, None).await;
    assert_eq!(v["statuses"][0]["limitRemaining"].as_u64(), Some(2), "{v}");

    // /v1/check: a negative `hits` gives that many back.
    let check = |hits: Value| json!({"domain": "api", "descriptors": [{"user": "v"}], "hits": hits}).to_string();
    let (_, _, v) = call(&h, "POST", url("/v1/check"), &check(json!(3)), None).await;
    assert_eq!(v["allowed"], json!(true));
    let (st, _, v) = call(&h, "POST", url("/v1/check"), &check(json!(-2)), None).await;
    assert_eq!((st, &v["allowed"], &v["descriptors"][0]["remaining"]), (200, &json!(true), &json!(2)), "{v}");
    // Past 2^53 - 1 either way: an error naming the field and the bound.
    for hits in [json!(-9_007_199_254_740_992_i64), json!(9_007_199_254_740_992_i64)] {
        let (st, _, v) = call(&h, "POST", url("/v1/check"), &check(hits), None).await;
        assert_eq!(st, 400, "{v}");
        let text = v.to_string();
        assert!(text.contains("hits") && text.contains("9007199254740991"), "{text}");
    }
    // The largest refund is accepted.
    let (st, _, v) = call(&h, "POST", url("/v1/check"), &check(json!(-9_007_199_254_740_991_i64)), None).await;
    assert_eq!((st, &v["descriptors"][0]["remaining"]), (200, &json!(3)), "{v}");

    // Counted apart from decisions of traffic.
    let (_, _, metrics) = call(&h, "GET", url("/metrics"), "", None).await;
    let metrics = metrics.as_str().unwrap_or_default().to_owned();
    let line = metrics
        .lines()
        .find(|l| l.starts_with("floodgate_decisions_total{domain=\"api\",rule=\"per_user\",result=\"refund\"}"))
        .unwrap_or_else(|| panic!("no refund series:\n{metrics}"));
    assert!(line.ends_with(" 9"), "{line}");
    s.stop().await;
}

#[tokio::test]
async fn budgets_in_memory() {
    let s = budget_server("budgets-mem", None).await;
    charges_after_the_work_on(&s).await;
    refunds_on(s).await;
}

#[tokio::test]
async fn budgets_on_redis() {
    let redis = RedisServer::start();
    let s = budget_server("budgets-redis", Some(redis.url())).await;
    charges_after_the_work_on(&s).await;
    refunds_on(s).await;
}

#[tokio::test]
async fn budgets_on_a_redis_cluster() {
    let cluster = RedisCluster::start();
    let s = budget_server("budgets-cluster", Some(cluster.url())).await;
    charges_after_the_work_on(&s).await;
    refunds_on(s).await;
}
