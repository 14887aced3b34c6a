//! Concurrency limits through the service (issue 49), on the in-memory
//! store, Redis and Redis Cluster: the exact gRPC sequence Envoy sends (an
//! acquire at request time answering the lease in `dynamic_metadata`, and
//! the stream-end release carrying it back with `is_negative_hits`), a
//! denied request's stream end, releases that only release, the HTTP API
//! (acquire, release, extend), a crashed caller, a lease released through
//! another instance, and Redis killed with leases held. The lease
//! arithmetic is checked against its reference model in floodgate-core's
//! property tests, and Redis's against the memory store's in
//! floodgate-redis's conformance suite.

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::google::protobuf::{UInt64Value, value::Kind};
use floodgate_redis::RedisConfig;
use floodgate_testing::{RedisCluster, RedisServer};
use serde_json::{Value, json};

use crate::server::{Server, Unary, ask, call, desc, http, req};
use floodgate_server::protocol::budget_grpc::{Entry as PbEntry, PbDescriptor};
use floodgate_server::protocol::leases_grpc::{AcquireRequest, LeaseRequest, LeaseResponse};

/// A backend's tenants: 100 a minute and 2 in flight each.
const LEASES: &str = r#"
domain: backend
descriptors:
  - key: tenant
    rate_limits:
      - {unit: minute, requests_per_unit: 100, name: tenant_rate}
      - {concurrency: 2, lease_ttl: 30s, name: tenant_in_flight}
  - key: job
    rate_limit: {concurrency: 1, lease_ttl: 1s, name: job_slots}
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 5, name: user_rate}
"#;

/// A server with the lease rules, on the memory store or on `redis`.
async fn lease_server(name: &str, redis: Option<String>) -> Server {
    Server::start_config(name, |c| {
        if let floodgate_server::rules::reload::RulesSource::Dir(dir) = &c.rules {
            std::fs::write(dir.join("backend.yaml"), LEASES).unwrap();
        }
        c.redis = redis.map(|url| RedisConfig::new(url.parse().unwrap()));
    })
    .await
}

/// The lease id of an RLS answer's dynamic metadata (Envoy's filter keeps it
/// under `envoy.filters.http.ratelimit`; its `metadata` action reads it as
/// a string).
fn lease_of(r: &RateLimitResponse) -> Option<String> {
    let m = r.dynamic_metadata.as_ref()?;
    match m.fields.get("lease_id")?.kind.as_ref()? {
        Kind::StringValue(s) => Some(s.clone()),
        other => panic!("lease_id must be a string for Envoy's metadata action: {other:?}"),
    }
}

/// Envoy's stream-end descriptor: the request's entries, the lease id read
/// back from dynamic metadata (when there is one), one hit given back.
fn stream_end(
    tenant: &str,
    lease: Option<&str>,
) -> envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor {
    let mut d = desc(&[("tenant", tenant)]);
    if let Some(id) = lease {
        d.entries.push(Entry { key: "lease_id".into(), value: id.into() });
    }
    d.hits_addend = Some(UInt64Value { value: 1 });
    d.is_negative_hits = true;
    d
}

#[tokio::test]
async fn envoys_acquire_and_stream_end_release_over_grpc() {
    envoys_sequence_on(lease_server("leases-rls", None).await).await;
}

#[tokio::test]
async fn envoys_acquire_and_stream_end_release_on_redis() {
    let redis = RedisServer::start();
    envoys_sequence_on(lease_server("leases-rls-redis", Some(redis.url())).await).await;
}

#[tokio::test]
async fn envoys_acquire_and_stream_end_release_on_a_redis_cluster() {
    let cluster = RedisCluster::start();
    envoys_sequence_on(lease_server("leases-rls-cluster", Some(cluster.url())).await).await;
}

async fn envoys_sequence_on(s: Server) {
    let mut c = s.grpc().await;
    let acquire = || req("backend", vec![desc(&[("tenant", "acme")])], 1);
    let a = ask(&mut c, acquire()).await;
    assert_eq!(a.overall_code, Code::Ok as i32);
    let lease_a = lease_of(&a).expect("an allowed request carries its lease");
    assert_eq!(lease_a.len(), 16, "{lease_a}");
    let b = ask(&mut c, acquire()).await;
    let lease_b = lease_of(&b).unwrap();
    assert_ne!(lease_a, lease_b);
    // Two in flight: the third is denied, with no lease (Envoy stores a
    // denied answer's metadata too: there must be nothing to send back),
    // and it takes no rate.
    let denied = ask(&mut c, acquire()).await;
    assert_eq!(denied.overall_code, Code::OverLimit as i32);
    assert_eq!(lease_of(&denied), None);
    // A peek: the descriptor's own hits_addend 0 (a request-level 0 counts
    // as 1, as Envoy's does).
    let peek = || {
        let mut d = desc(&[("tenant", "acme")]);
        d.hits_addend = Some(UInt64Value { value: 0 });
        req("backend", vec![d], 0)
    };
    // (A peek reports the most restrictive limit: the slots.)
    assert_eq!(ask(&mut c, peek()).await.statuses[0].limit_remaining, 0);
    // The denied request's stream ends: with the documented Envoy
    // configuration (`skip_if_absent` left false) its descriptor has no
    // lease id, so Envoy sends nothing. Stream A ends: its lease comes back
    // and only the slot is freed.
    let r = ask(&mut c, req("backend", vec![stream_end("acme", Some(&lease_a))], 0)).await;
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(lease_of(&r), None, "a release takes no lease");
    let c_req = ask(&mut c, acquire()).await;
    assert_eq!(c_req.overall_code, Code::Ok as i32, "A's slot is free again");
    let lease_c = lease_of(&c_req).unwrap();
    // A repeated (or late) release of A frees nobody else's slot.
    ask(&mut c, req("backend", vec![stream_end("acme", Some(&lease_a))], 0)).await;
    assert_eq!(ask(&mut c, acquire()).await.overall_code, Code::OverLimit as i32);
    // A release that lost its id (Envoy configured with skip_if_absent:
    // true) frees the earliest-expiring lease: B's.
    ask(&mut c, req("backend", vec![stream_end("acme", None)], 0)).await;
    let d = ask(&mut c, acquire()).await;
    assert_eq!(d.overall_code, Code::Ok as i32);
    // The rate kept every hit of the admitted requests (A, B, C, D) and none
    // of the releases or the refused ones: 96 of 100 left.
    let http = http();
    let (st, _, v) = call(
        &http,
        "POST",
        format!("http://{}/admin/v1/counters", s.admin),
        &json!({"domain": "backend", "descriptor": [{"key": "tenant", "value": "acme"}]}).to_string(),
        None,
    )
    .await;
    assert_eq!(st, 200, "{v}");
    let by_rule = |name: &str| v["limits"].as_array().unwrap().iter().find(|l| l["rule"] == name).unwrap().clone();
    assert_eq!(by_rule("tenant_rate")["remaining"], 96, "{v}");
    assert_eq!(by_rule("tenant_in_flight")["remaining"], 0, "C and D hold the slots: {v}");
    assert_eq!(by_rule("tenant_in_flight")["algorithm"], "concurrency");
    // C and D end.
    for lease in [lease_c, lease_of(&d).unwrap()] {
        ask(&mut c, req("backend", vec![stream_end("acme", Some(&lease))], 0)).await;
    }
    assert_eq!(ask(&mut c, peek()).await.statuses[0].limit_remaining, 2);
    // At request time a `lease_id` entry is an ordinary entry (only a
    // release takes it out).
    let plain = ask(&mut c, req("backend", vec![desc(&[("tenant", "acme"), ("lease_id", "not-hex")])], 1)).await;
    assert_eq!(plain.overall_code, Code::Ok as i32);
    // A malformed lease id in a release is refused, naming the entry.
    let bad = c.should_rate_limit(req("backend", vec![stream_end("acme", Some("not-hex"))], 0)).await.unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument);
    assert!(bad.message().contains("descriptors[0].lease_id"), "{}", bad.message());
    s.stop().await;
}

#[tokio::test]
async fn the_http_api_acquires_releases_and_extends() {
    let s = lease_server("leases-http", None).await;
    let h = http();
    let post = |path: &str, body: Value| {
        let (h, url) = (h.clone(), format!("http://{}{path}", s.http));
        async move { call(&h, "POST", url, &body.to_string(), None).await }
    };
    let check = |hits: i64, lease: Option<&str>| {
        let mut b = json!({"domain": "backend", "descriptors": [{"tenant": "t"}], "hits": hits});
        if let Some(l) = lease {
            b["lease"] = json!(l);
        }
        b
    };
    let (_, _, one) = post("/v1/check", check(1, None)).await;
    assert_eq!(one["allowed"], true, "{one}");
    assert_eq!(one["lease"]["ttl_ms"], 30_000, "{one}");
    let id = one["lease"]["id"].as_str().unwrap().to_owned();
    let (_, _, two) = post("/v1/check", check(1, None)).await;
    assert_eq!(two["allowed"], true);
    // The metrics: two slots in flight of the rule's two per key.
    let text = s.metrics().await;
    assert!(text.contains("floodgate_leases_in_flight{domain=\"backend\",rule=\"tenant_in_flight\"} 2"), "{text}");
    assert!(text.contains("floodgate_leases_limit{domain=\"backend\",rule=\"tenant_in_flight\"} 2"), "{text}");
    assert!(text.contains("floodgate_leases_acquired_total{domain=\"backend\",rule=\"tenant_in_flight\"} 2"), "{text}");
    assert!(
        text.contains("floodgate_decisions_total{domain=\"backend\",rule=\"tenant_in_flight\",result=\"release\"} 0"),
        "{text}"
    );
    let (_, _, three) = post("/v1/check", check(1, None)).await;
    assert_eq!((&three["allowed"], three.get("lease")), (&json!(false), None), "{three}");
    // Extend, then release by id: the slot frees.
    let (st, _, ext) = post("/v1/extend", check(1, Some(&id))).await;
    assert_eq!((st, &ext["allowed"]), (200, &json!(true)), "{ext}");
    let (_, _, rel) = post("/v1/check", check(-1, Some(&id))).await;
    assert_eq!(rel["allowed"], true, "{rel}");
    let (_, _, again) = post("/v1/check", check(1, None)).await;
    assert_eq!(again["allowed"], true, "{again}");
    // The extend and the release are counted apart from traffic, on both limits.
    let text = s.metrics().await;
    for rule in ["tenant_rate", "tenant_in_flight"] {
        let line = format!("floodgate_decisions_total{{domain=\"backend\",rule=\"{rule}\",result=\"release\"}} 2");
        assert!(text.contains(&line), "{line}: {text}");
    }
    // A lease gone cannot be extended; an extend names its lease.
    let (_, _, gone) = post("/v1/extend", check(1, Some(&id))).await;
    assert_eq!(gone["allowed"], false, "{gone}");
    let (st, _, v) = post("/v1/extend", check(1, None)).await;
    assert_eq!(st, 400, "{v}");
    let (st, _, v) = post("/v1/check", check(-1, Some("zz"))).await;
    assert_eq!((st, &v["field"]), (400, &json!("lease")), "{v}");
    // An extend where no concurrency limit applies takes nothing (user: 3 a
    // minute in the api domain).
    let user = |lease: Option<&str>| {
        let mut b = json!({"domain": "api", "descriptors": [{"user": "u"}]});
        if let Some(l) = lease {
            b["lease"] = json!(l);
        }
        b
    };
    for _ in 0..3 {
        let (_, _, v) = post("/v1/extend", user(Some("00000000000000aa"))).await;
        assert_eq!(v["descriptors"][0]["remaining"], 3, "{v}");
    }
    // A reservation cannot hold a slot.
    let (st, _, v) =
        post("/v1/reserve", json!({"domain": "backend", "descriptors": [{"tenant": "t"}], "hits": 1})).await;
    assert_eq!(st, 400, "{v}");
    assert!(v["error"].as_str().unwrap().contains("concurrency limit, whose slot a reservation cannot hold"), "{v}");
    s.stop().await;
}

/// A caller that crashed mid-request never releases: its slot frees itself
/// when its lease ends (1 s here), and the metrics count it expired.
#[tokio::test]
async fn a_crashed_callers_slot_frees_when_its_lease_ends() {
    let s = lease_server("leases-crash", None).await;
    slot_frees_with_its_lease(&s).await;
    let text = s.metrics().await;
    assert!(text.contains("floodgate_leases_expired_total{domain=\"backend\",rule=\"job_slots\"} 1"), "{text}");
    assert!(text.contains("floodgate_leases_in_flight{domain=\"backend\",rule=\"job_slots\"} 1"), "{text}");
    s.stop().await;
}

#[tokio::test]
async fn a_crashed_callers_slot_frees_when_its_lease_ends_on_redis() {
    let redis = RedisServer::start();
    let s = lease_server("leases-crash-redis", Some(redis.url())).await;
    slot_frees_with_its_lease(&s).await;
    // Its Redis keys went with the last lease (and the new holder's are
    // the only ones left).
    let keys = redis.cli(&["--scan", "--pattern", "*job*"]);
    assert_eq!(keys.lines().count(), 2, "one key's hash and sorted set: {keys}");
    // This instance's accounts: two acquired (the expired lease went with
    // its key, met by nobody: not counted); the slots held now are Redis's,
    // so no in-flight gauge.
    let text = s.metrics().await;
    assert!(text.contains("floodgate_leases_acquired_total{domain=\"backend\",rule=\"job_slots\"} 2"), "{text}");
    assert!(!text.contains("floodgate_leases_in_flight{"), "{text}");
    s.stop().await;
}

/// A job slot (1, a 1 s lease) whose holder never releases frees itself.
async fn slot_frees_with_its_lease(s: &Server) {
    let mut c = s.grpc().await;
    let job = || req("backend", vec![desc(&[("job", "nightly")])], 1);
    assert_eq!(ask(&mut c, job()).await.overall_code, Code::Ok as i32);
    // The caller is gone: no release comes.
    assert_eq!(ask(&mut c, job()).await.overall_code, Code::OverLimit as i32);
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        if ask(&mut c, job()).await.overall_code == Code::Ok as i32 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the slot did not free within its lease");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// Instances on one Redis share their leases: a slot acquired through one
/// counts in the other and is released through it (Envoy's stream-end call
/// may reach another instance than its request did).
#[tokio::test]
async fn instances_on_one_redis_share_leases() {
    let redis = RedisServer::start();
    let a = lease_server("leases-share-a", Some(redis.url())).await;
    let b = lease_server("leases-share-b", Some(redis.url())).await;
    let (mut ca, mut cb) = (a.grpc().await, b.grpc().await);
    let acquire = || req("backend", vec![desc(&[("tenant", "shared")])], 1);
    let first = lease_of(&ask(&mut ca, acquire()).await).unwrap();
    assert_eq!(ask(&mut cb, acquire()).await.overall_code, Code::Ok as i32);
    assert_eq!(ask(&mut ca, acquire()).await.overall_code, Code::OverLimit as i32, "two in flight across both");
    ask(&mut cb, req("backend", vec![stream_end("shared", Some(&first))], 0)).await;
    assert_eq!(ask(&mut ca, acquire()).await.overall_code, Code::Ok as i32, "released through the other instance");
    // Each instance counts what its own calls did.
    let text = b.metrics().await;
    assert!(text.contains("floodgate_leases_acquired_total{domain=\"backend\",rule=\"tenant_in_flight\"} 1"), "{text}");
    assert!(text.contains("floodgate_leases_released_total{domain=\"backend\",rule=\"tenant_in_flight\"} 1"), "{text}");
    a.stop().await;
    b.stop().await;
}

/// Redis killed with slots held: decisions fall to the rule's failure
/// policy (open here: admitted, no lease answered, nothing held), releases
/// sent meanwhile are lost, and a Redis that comes back empty holds none
/// of the old slots (the documented over-admission: up to `concurrency`
/// more until the old holders end). Nothing is counted twice: the rate's
/// count starts again with Redis's.
#[tokio::test]
async fn redis_killed_with_leases_held() {
    let mut redis = RedisServer::start();
    let s = lease_server("leases-redis-killed", Some(redis.url())).await;
    let mut c = s.grpc().await;
    let acquire = || req("backend", vec![desc(&[("tenant", "k")])], 1);
    let held = lease_of(&ask(&mut c, acquire()).await).unwrap();
    lease_of(&ask(&mut c, acquire()).await).unwrap();
    assert_eq!(ask(&mut c, acquire()).await.overall_code, Code::OverLimit as i32);
    redis.kill();
    let down = ask(&mut c, acquire()).await;
    assert_eq!(down.overall_code, Code::Ok as i32, "failure_mode open admits");
    assert_eq!(lease_of(&down), None, "no slot was taken: no lease to answer");
    let lost = ask(&mut c, req("backend", vec![stream_end("k", Some(&held))], 0)).await;
    assert_eq!(lost.overall_code, Code::Ok as i32, "a release the store cannot take is lost, answered open");
    redis.restart();
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    let back = loop {
        let r = ask(&mut c, acquire()).await;
        if lease_of(&r).is_some() {
            break r;
        }
        assert!(tokio::time::Instant::now() < deadline, "Redis did not come back: {r:?}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    assert_eq!(back.overall_code, Code::Ok as i32);
    // The empty Redis held none of the old slots: one more fits, then the
    // limit holds again; the old holders' releases free nothing.
    assert_eq!(ask(&mut c, acquire()).await.overall_code, Code::Ok as i32);
    assert_eq!(ask(&mut c, acquire()).await.overall_code, Code::OverLimit as i32);
    ask(&mut c, req("backend", vec![stream_end("k", Some(&held))], 0)).await;
    assert_eq!(ask(&mut c, acquire()).await.overall_code, Code::OverLimit as i32);
    s.stop().await;
}

/// floodgate's own gRPC API for leases (`floodgate.leases.v1.Leases`):
/// acquire, extend, release, on the memory store and on Redis.
async fn grpc_leases_on(s: Server) {
    let mut c = Unary::connect(&s).await;
    let d = || vec![PbDescriptor { entries: vec![PbEntry { key: "tenant".into(), value: "g".into() }], hits: None }];
    let acquire = AcquireRequest { domain: "backend".into(), descriptors: d(), hits: 0 };
    let lease = |id: &str| LeaseRequest { domain: "backend".into(), descriptors: d(), lease: id.into() };
    const ACQUIRE: &str = "/floodgate.leases.v1.Leases/Acquire";
    const RELEASE: &str = "/floodgate.leases.v1.Leases/Release";
    const EXTEND: &str = "/floodgate.leases.v1.Leases/Extend";
    let a: LeaseResponse = c.call(ACQUIRE, acquire.clone()).await.unwrap();
    assert!(a.allowed && a.lease.len() == 16 && a.lease_ttl_ms == 30_000, "{a:?}");
    let b: LeaseResponse = c.call(ACQUIRE, acquire.clone()).await.unwrap();
    assert!(b.allowed, "{b:?}");
    let full: LeaseResponse = c.call(ACQUIRE, acquire.clone()).await.unwrap();
    assert!(!full.allowed && full.lease.is_empty(), "{full:?}");
    assert_eq!(full.descriptors[0].name, "tenant_in_flight");
    let ext: LeaseResponse = c.call(EXTEND, lease(&a.lease)).await.unwrap();
    assert!(ext.allowed, "{ext:?}");
    let rel: LeaseResponse = c.call(RELEASE, lease(&a.lease)).await.unwrap();
    assert!(rel.allowed && rel.lease.is_empty(), "{rel:?}");
    // A release only releases: a rate beside it (another descriptor) keeps
    // its hits, even when no concurrency limit is met at all.
    let user = || PbDescriptor { entries: vec![PbEntry { key: "user".into(), value: "u".into() }], hits: None };
    let both = AcquireRequest { domain: "backend".into(), descriptors: vec![d().remove(0), user()], hits: 0 };
    let with_user: LeaseResponse = c.call(ACQUIRE, both).await.unwrap();
    assert!(with_user.allowed, "{with_user:?}");
    let release_both =
        LeaseRequest { domain: "backend".into(), descriptors: vec![d().remove(0), user()], lease: with_user.lease };
    let r: LeaseResponse = c.call(RELEASE, release_both).await.unwrap();
    assert_eq!(r.descriptors[1].remaining, 4, "{r:?}");
    let only_user = LeaseRequest { domain: "backend".into(), descriptors: vec![user()], lease: a.lease.clone() };
    let r: LeaseResponse = c.call(RELEASE, only_user).await.unwrap();
    assert_eq!(r.descriptors[0].remaining, 4, "{r:?}");
    let too_many = AcquireRequest { domain: "backend".into(), descriptors: d(), hits: 1 << 60 };
    let err = c.call::<_, LeaseResponse>(ACQUIRE, too_many).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    let again: LeaseResponse = c.call(ACQUIRE, acquire.clone()).await.unwrap();
    assert!(again.allowed, "A's slot is free again: {again:?}");
    let gone: LeaseResponse = c.call(EXTEND, lease(&a.lease)).await.unwrap();
    assert!(!gone.allowed, "a released lease cannot be extended: {gone:?}");
    let bad = c.call::<_, LeaseResponse>(RELEASE, lease("zz")).await.unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument);
    assert!(bad.message().starts_with("lease: "), "{}", bad.message());
    s.stop().await;
}

#[tokio::test]
async fn the_grpc_api_acquires_releases_and_extends() {
    grpc_leases_on(lease_server("leases-grpc", None).await).await;
}

#[tokio::test]
async fn the_grpc_api_acquires_releases_and_extends_on_redis() {
    let redis = RedisServer::start();
    grpc_leases_on(lease_server("leases-grpc-redis", Some(redis.url())).await).await;
}
