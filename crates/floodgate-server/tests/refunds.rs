//! Refunds through the service (issue 46): Envoy's `is_negative_hits` over
//! gRPC and `/json`, a negative `hits` on `/v1/check`, on the in-memory
//! store, one Redis server and a Redis Cluster. Each algorithm's arithmetic
//! is checked against its reference model in floodgate-core's property
//! tests and, per store, in floodgate-redis's conformance suite; these
//! check the wiring: what a client sends is given back, never below zero,
//! whatever the request's other descriptors decide, and counted apart.

use envoy_types::pb::google::protobuf::UInt64Value;
use floodgate_redis::RedisConfig;
use floodgate_testing::{RedisCluster, RedisServer};
use serde_json::{Value, json};

use crate::server::{Server, ask, call, desc, http, req};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;

/// A descriptor that gives `hits` back (Envoy's `is_negative_hits`).
fn refund(
    entries: &[(&str, &str)],
    hits: u64,
) -> envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor {
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
async fn refunds_in_memory() {
    refunds_on(Server::start("refunds-mem", None).await).await;
}

#[tokio::test]
async fn refunds_on_redis() {
    let redis = RedisServer::start();
    let url = redis.url();
    refunds_on(Server::start_config("refunds-redis", |c| c.redis = Some(RedisConfig::new(url.parse().unwrap()))).await)
        .await;
}

#[tokio::test]
async fn refunds_on_a_redis_cluster() {
    let cluster = RedisCluster::start();
    let url = cluster.url();
    refunds_on(
        Server::start_config("refunds-cluster", |c| c.redis = Some(RedisConfig::new(url.parse().unwrap()))).await,
    )
    .await;
}
