//! Per-key entries through the service: an entry takes precedence over the
//! rules files, tiers apply by name and follow reloads, a reload that would
//! strand an entry's tier is refused, and a decision at once answers as an
//! awaited one; with the entries in Redis, each lookup is counted once.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use floodgate_core::rules::RuleSet;
use floodgate_perkey::{CacheOptions, KeySpec, Limits, PerKey};
use floodgate_redis::{RedisConfig, RedisStore};
use floodgate_testing::{RedisServer, TempDir};
use serde_json::json;

/// An entry of domain `api` as the admin API takes it: `user=<user>` with
/// `fields` (`limits` or `tier`).
fn entry(user: &str, fields: serde_json::Value) -> KeySpec {
    let mut v = json!({"domain": "api", "descriptor": [{"key": "user", "value": user}]});
    v.as_object_mut().unwrap().extend(fields.as_object().unwrap().clone());
    serde_json::from_value(v).unwrap()
}

fn tiered(user: &str, tier: &str) -> KeySpec {
    entry(user, json!({"tier": tier}))
}

/// Rules of domain `api` with tiers `free` (60/min) and `pro` (2 limits).
const TIERED: &str = "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 10}\ntiers:\n  free: {unit: minute, requests_per_unit: 60}\n  pro:\n    - {unit: second, requests_per_unit: 50}\n    - {unit: day, requests_per_unit: 1000000}\n";

/// A service over the in-memory store on one rules file for domain `api`,
/// with per-key entries (in `dir`) and its metrics.
fn memory_service(
    dir: &TempDir,
    rules_yaml: &str,
) -> (
    floodgate_server::service::Service<floodgate_core::MemoryStore>,
    std::sync::Arc<PerKey>,
    std::sync::Arc<floodgate_server::metrics::Metrics>,
) {
    use std::sync::Arc;

    use floodgate_core::MemoryStore;
    use floodgate_core::limiter::Limiter;
    use floodgate_core::rules::LoadOptions;
    use floodgate_server::metrics::Metrics;
    use floodgate_server::rules::reload::Rules;
    use floodgate_server::service::Service;

    std::fs::create_dir_all(dir.0.join("rules")).unwrap();
    std::fs::write(dir.0.join("rules/api.yaml"), rules_yaml).unwrap();
    let o = Arc::new(PerKey::open(dir.0.join("o.redb")).unwrap());
    let rules = Rules::load(dir.0.join("rules"), LoadOptions::default()).unwrap();
    let metrics = Arc::new(Metrics::new());
    let limiter = Limiter::new(MemoryStore::new(), MemoryStore::new());
    (Service::new(rules, Some(o.clone()), limiter, metrics.clone()), o, metrics)
}

/// The `(counter key, limit)` of every limit applying to the descriptor
/// `key=value` of domain `api`, taking nothing.
fn resolve(
    service: &floodgate_server::service::Service<floodgate_core::MemoryStore>,
    key: &str,
    value: &str,
) -> Vec<(String, u64)> {
    use floodgate_server::service::{Descriptor, Request};
    let req = Request {
        domain: "api".into(),
        descriptors: vec![Descriptor { entries: vec![(key.into(), value.into())], ..Descriptor::default() }],
        hits_addend: 0,
    };
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    rt.block_on(service.peek(&req))
        .unwrap()
        .into_iter()
        .filter_map(|p| Some((p.counter_key, p.counters?.ok()?.0.requests_per_unit)))
        .collect()
}

#[test]
fn an_override_takes_precedence_over_the_files() {
    let dir = TempDir::new("precedence");
    let (service, o, _) = memory_service(
        &dir,
        "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 10}\n",
    );
    let resolve = |k: &str, v: &str| resolve(&service, k, v);
    let before = resolve("user", "alice");
    assert_eq!(before.len(), 1);
    assert_eq!(before[0].1, 10, "from the files");
    o.set(entry("alice", json!({"limits": {"unit": "minute", "requests_per_unit": 1000}})), &RuleSet::default())
        .unwrap();
    let after = resolve("user", "alice");
    assert_eq!(after[0].1, 1000, "from the override");
    // The descriptor's own counter: another limit starts it afresh (the
    // stores key state by the limit's fingerprint).
    assert_eq!(after[0].0, before[0].0);
    // Other users still get the file's rule; a descriptor no file matches can
    // still be overridden.
    assert_eq!(resolve("user", "bob")[0].1, 10);
    assert!(resolve("ip", "1.2.3.4").is_empty());
    let ip = json!({"domain": "api", "descriptor": [{"key": "ip", "value": "1.2.3.4"}], "limits": {"unit": "second", "requests_per_unit": 0}});
    o.set(serde_json::from_value(ip).unwrap(), &RuleSet::default()).unwrap();
    assert_eq!(resolve("ip", "1.2.3.4")[0].1, 0);
    o.delete("api", &[("user", "alice")]).unwrap();
    assert_eq!(resolve("user", "alice")[0].1, 10);
}

#[test]
fn a_decision_at_once_answers_as_an_awaited_one_on_the_same_counters_overrides_and_metrics() {
    use floodgate_server::metrics::Protocol;
    use floodgate_server::service::{Descriptor, Request};
    use floodgate_testing::at_once;

    let dir = TempDir::new("decide-now");
    let (service, o, metrics) = memory_service(
        &dir,
        "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 4, name: per_user}\n",
    );
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let req = |user: &str| Request {
        domain: "api".into(),
        descriptors: vec![Descriptor { entries: vec![("user".into(), user.into())], ..Descriptor::default() }],
        hits_addend: 1,
    };
    // Alternating the two paths counts one limit down: 3, 2, 1, 0, denied.
    let mut seen = Vec::new();
    for i in 0..5 {
        let a = if i % 2 == 0 {
            at_once(service.decide(&req("alice"), Protocol::Proxy)).unwrap()
        } else {
            rt.block_on(service.decide(&req("alice"), Protocol::Proxy)).unwrap()
        }
        .answer;
        let headline = a.headline.clone().unwrap();
        let (info, d) = (&headline, headline.decision);
        assert_eq!(info.name.as_deref(), Some("per_user"));
        seen.push((a.allowed, d.remaining));
        assert_eq!(a.retry_after.is_some(), !a.allowed);
    }
    assert_eq!(seen, [(true, 3), (true, 2), (true, 1), (true, 0), (false, 0)]);
    // An override applies on the synchronous path too.
    o.set(entry("bob", json!({"limits": {"unit": "minute", "requests_per_unit": 1}})), &RuleSet::default()).unwrap();
    let first = at_once(service.decide(&req("bob"), Protocol::Proxy)).unwrap().answer;
    let second = at_once(service.decide(&req("bob"), Protocol::Proxy)).unwrap().answer;
    assert_eq!((first.allowed, second.allowed), (true, false));
    // Bad requests are refused the same way, and every decision is counted.
    let empty = Request { domain: "api".into(), descriptors: vec![], hits_addend: 1 };
    let sync_err = at_once(service.decide(&empty, Protocol::Proxy)).unwrap_err().to_string();
    let async_err = rt.block_on(service.decide(&empty, Protocol::Proxy)).unwrap_err().to_string();
    assert_eq!(sync_err, async_err);
    let mut text = String::new();
    metrics.render(&mut text);
    let proxy_requests: f64 = text
        .lines()
        .filter(|l| l.contains("protocol=\"proxy\"") && l.starts_with("floodgate_requests_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(proxy_requests, 9.0, "{text}");
}

#[test]
fn tiers_apply_by_name_and_follow_the_rules_file() {
    use floodgate_server::metrics::Protocol;
    use floodgate_server::service::{Descriptor, Request};

    let dir = TempDir::new("tiers");
    let (service, o, metrics) = memory_service(&dir, TIERED);
    let rules = service.rules().current();
    o.set(tiered("alice", "free"), &rules).unwrap();
    o.set(tiered("bob", "pro"), &rules).unwrap();
    let alice = resolve(&service, "user", "alice");
    assert_eq!(alice.len(), 1);
    assert!(!alice[0].0.contains('#'), "one limit: the descriptor's own counter key {alice:?}");
    assert_eq!(alice[0].1, 60);
    assert_eq!(resolve(&service, "user", "bob").iter().map(|r| r.1).collect::<Vec<_>>(), [50, 1_000_000]);
    assert_eq!(resolve(&service, "user", "carol")[0].1, 10, "no entry: the files' rule");
    assert_eq!(
        o.counts(),
        [("api".to_owned(), "free".to_owned(), 1), ("api".to_owned(), "pro".to_owned(), 1)],
        "counted per (domain, tier)"
    );
    // Editing the tier changes every key on it, with no per-key write.
    std::fs::write(dir.0.join("rules/api.yaml"), TIERED.replace("requests_per_unit: 60", "requests_per_unit: 120"))
        .unwrap();
    assert!(service.rules().reload().unwrap());
    assert_eq!(resolve(&service, "user", "alice")[0].1, 120);
    // Decisions under a tier are labelled by the tier, never by the key.
    let req = Request {
        domain: "api".into(),
        descriptors: vec![Descriptor { entries: vec![("user".into(), "alice".into())], ..Descriptor::default() }],
        hits_addend: 1,
    };
    assert!(floodgate_testing::at_once(service.decide(&req, Protocol::Proxy)).unwrap().answer.allowed);
    let mut text = String::new();
    metrics.render(&mut text);
    assert!(text.contains("tier:free"), "{text}");
    assert!(!text.contains("alice"), "{text}");
}

#[test]
fn a_reload_that_removes_a_used_tier_is_refused() {
    let dir = TempDir::new("tier-reload");
    let (service, o, _) = memory_service(&dir, TIERED);
    let (checker, rules) = (o.clone(), service.rules().clone());
    service.rules().add_check(move |set| checker.check_rules(set, &rules.current())).unwrap();
    o.set(tiered("alice", "free"), &service.rules().current()).unwrap();
    let without_free = TIERED.replace("  free: {unit: minute, requests_per_unit: 60}\n", "");
    std::fs::write(dir.0.join("rules/api.yaml"), &without_free).unwrap();
    let err = service.rules().reload().unwrap_err().to_string();
    assert!(err.contains("api.yaml:1:9: tiers.free: 1 per-key entries of domain `api` name tier `free`"), "{err}");
    assert_eq!(resolve(&service, "user", "alice")[0].1, 60, "the last good rules stay");
    // Once no entry names it, the tier may go.
    assert!(o.delete("api", &[("user", "alice")]).unwrap());
    assert!(service.rules().reload().unwrap());
    assert!(service.rules().current().domain("api").unwrap().tier("free").is_none());
}

#[test]
fn an_entry_whose_tier_is_gone_falls_back_to_the_files_rules() {
    use std::sync::atomic::Ordering::Relaxed;

    let dir = TempDir::new("tier-gone");
    let (service, o, _) = memory_service(&dir, TIERED);
    o.set(tiered("alice", "free"), &service.rules().current()).unwrap();
    // No check installed: the tier disappears under the entry (as when
    // another instance wrote it, or the file was edited while stopped).
    std::fs::write(dir.0.join("rules/api.yaml"), TIERED.replace("  free: {unit: minute, requests_per_unit: 60}\n", ""))
        .unwrap();
    assert!(service.rules().reload().unwrap());
    // Found so (as at startup): said, and no reload is refused for it.
    assert_eq!(o.missing_tiers(&service.rules().current()), [("api".into(), "free".into(), 1)]);
    let current = service.rules().current();
    assert!(o.check_rules(&current, &current).is_empty(), "a tier already missing does not refuse reloads");
    let got = resolve(&service, "user", "alice");
    assert_eq!(got[0].1, 10, "the files' rule: {got:?}");
    assert!(!got[0].0.contains('@'), "{got:?}");
    assert!(o.stats().unknown_tier.load(Relaxed) >= 1);
}

fn redis_store(url: &str) -> RedisStore {
    RedisStore::new(RedisConfig::new(url.parse().expect("a Redis URL"))).expect("a store")
}

/// Per-key entries kept in the Redis at `url`, once they follow its change
/// notices (a long time to live: only a notice refreshes an answer).
async fn in_redis(dir: &TempDir, url: &str) -> Arc<PerKey> {
    let cache = CacheOptions { entries: 1_000, ttl: Some(Duration::from_secs(600)) };
    let k = Arc::new(PerKey::open_with(dir.0.join("k.redb"), cache).unwrap());
    tokio::spawn(k.share(redis_store(url)));
    within(Duration::from_secs(10), "subscribed", || k.stats().subscribed.load(Relaxed) > 0).await;
    k
}

/// Wait up to `limit` for `cond`, failing with `what`.
async fn within(limit: Duration, what: &str, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + limit;
    while !cond() {
        assert!(Instant::now() < deadline, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A two-descriptor request, one cached and one not, through the service
/// (gRPC) and through the proxy's decider: each descriptor's lookup counts
/// once in the per-key hits and misses (the cached one was counted again
/// when the uncached one sent the request to the waiting path).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_with_a_cached_and_an_uncached_descriptor_counts_each_lookup_once() {
    use floodgate_core::MemoryStore;
    use floodgate_core::limiter::Limiter;
    use floodgate_core::rules::LoadOptions;
    use floodgate_server::metrics::{Metrics, Protocol};
    use floodgate_server::proxy::ServiceDecider;
    use floodgate_server::rules::reload::Rules;
    use floodgate_server::service::{Descriptor, Request, Service};
    use floodgate_tower::{Decide, RequestFacts};

    let redis = RedisServer::start();
    let dir = TempDir::new("pk-once");
    let k = in_redis(&dir, &redis.url()).await;
    // Each write seen by the instance's own subscription: it knows the
    // domain has entries (else it answers "no entry" without a lookup).
    let rules = RuleSet::from_yaml("api.yaml", TIERED).unwrap();
    for (user, tier) in [("alice", "free"), ("bob", "pro"), ("carol", "pro")] {
        let notices = k.stats().notices.load(Relaxed);
        k.put(tiered(user, tier), &rules, |_| None).await.unwrap();
        within(Duration::from_secs(5), "the write's own notice", || k.stats().notices.load(Relaxed) > notices).await;
    }
    // Two descriptors from two headers, for the proxy.
    let rules_yaml = format!(
        "{TIERED}request_descriptors:\n  - actions: [{{request_headers: {{header_name: x-a, descriptor_key: user}}}}]\n  - actions: [{{request_headers: {{header_name: x-b, descriptor_key: user}}}}]\n"
    );
    std::fs::create_dir_all(dir.0.join("rules")).unwrap();
    std::fs::write(dir.0.join("rules/api.yaml"), rules_yaml).unwrap();
    let rules = Rules::load(dir.0.join("rules"), LoadOptions::default()).unwrap();
    let limiter = Limiter::new(redis_store(&redis.url()), MemoryStore::new());
    let service = Arc::new(Service::new(rules, Some(k.clone()), limiter, Arc::new(Metrics::new())));
    let counts = || (k.stats().hits.get(), k.stats().misses.get());

    // alice cached, bob not.
    let alice = k.lookup("api", &[("user", "alice")]).await;
    assert!(matches!(&alice, Some(Limits::Tier(t)) if *t == "free"), "{alice:?}");
    let before = counts();
    let user = |u: &str| Descriptor { entries: vec![("user".into(), u.into())], ..Descriptor::default() };
    let req = Request { domain: "api".into(), descriptors: vec![user("alice"), user("bob")], hits_addend: 1 };
    assert!(service.decide(&req, Protocol::Grpc).await.unwrap().answer.allowed);
    assert_eq!(counts(), (before.0 + 1, before.1 + 1), "the service: alice one hit, bob one miss");

    // Through the proxy: bob cached now, carol not.
    let before = counts();
    let decider = ServiceDecider::new(service.clone(), "api".into());
    let mut headers = http::HeaderMap::new();
    headers.insert("x-a", "bob".parse().unwrap());
    headers.insert("x-b", "carol".parse().unwrap());
    let (method, uri) = (http::Method::GET, http::Uri::from_static("/"));
    let facts = RequestFacts { method: &method, uri: &uri, headers: &headers, client_ip: None, body: None };
    assert!(decider.decide(&facts).await.unwrap().allowed);
    assert_eq!(counts(), (before.0 + 1, before.1 + 1), "the proxy: bob one hit, carol one miss");
}
