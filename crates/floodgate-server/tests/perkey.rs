//! Runtime overrides: set, get, list, delete, persisted, validated, and
//! durable across a crash mid-write.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use floodgate_server::rules::overrides::{Entry, OverrideError, OverrideSpec, Overrides};
use serde_json::json;

#[path = "../../floodgate/tests/common/mod.rs"]
mod common;

use common::TempDir;

fn spec(user: &str, limits: serde_json::Value) -> OverrideSpec {
    OverrideSpec { domain: "api".into(), descriptor: vec![Entry { key: "user".into(), value: user.into() }], limits }
}

fn limit_of(o: &Overrides, user: &str) -> Option<u64> {
    o.get("api", &[("user", user)]).map(|o| o.rules[0].limit.as_ref().unwrap().limit())
}

#[test]
fn set_get_list_delete_and_survive_a_restart() {
    let dir = TempDir::new("crud");
    let db = dir.0.join("overrides.redb");
    {
        let o = Overrides::open(&db).unwrap();
        assert!(o.is_empty());
        o.set(spec("alice", json!({"unit": "second", "requests_per_unit": 5}))).unwrap();
        o.set(spec("bob", json!([{"algorithm": "gcra", "window": "1s", "requests_per_unit": 2, "burst": 4}, {"unit": "day", "requests_per_unit": 100}]))).unwrap();
        assert_eq!(limit_of(&o, "alice"), Some(5));
        o.set(spec("alice", json!({"unit": "second", "requests_per_unit": 7}))).unwrap();
        assert_eq!(limit_of(&o, "alice"), Some(7), "set replaces");
        assert_eq!(o.list().len(), 2);
        assert_eq!(o.get("api", &[("user", "bob")]).unwrap().rules.len(), 2);
        assert!(o.get("api", &[("user", "carol")]).is_none());
        assert!(o.get("web", &[("user", "alice")]).is_none());
    }
    let o = Overrides::open(&db).unwrap();
    assert_eq!(limit_of(&o, "alice"), Some(7), "persisted");
    assert_eq!(o.list().len(), 2);
    assert!(o.delete("api", &[("user", "alice")]).unwrap());
    assert!(!o.delete("api", &[("user", "alice")]).unwrap());
    drop(o);
    let o = Overrides::open(&db).unwrap();
    assert!(limit_of(&o, "alice").is_none(), "the delete persisted");
    assert_eq!(o.len(), 1);
    assert!(o.problems().is_empty());
    // An override's counters are its own.
    let bob = o.get("api", &[("user", "bob")]).unwrap();
    assert_ne!(bob.counter_key(0), bob.counter_key(1));
    assert!(bob.counter_key(0).contains("@override"));
}

#[test]
fn invalid_overrides_are_refused_and_change_nothing() {
    let dir = TempDir::new("invalid");
    let o = Overrides::open(dir.0.join("o.redb")).unwrap();
    let err = o.set(spec("alice", json!({"unit": "fortnight", "requests_per_unit": 5}))).unwrap_err();
    assert!(matches!(&err, OverrideError::Limits(_)));
    assert!(err.to_string().contains("invalid unit `fortnight`"), "{err}");
    let err = o.set(spec("alice", json!({"unit": "second", "burst": 3}))).unwrap_err();
    assert!(err.to_string().contains("fixed_window has no burst"), "{err}");
    let err = o.set(spec("alice", json!({"unit": "second", "requests_per_units": 3}))).unwrap_err();
    assert!(err.to_string().contains("did you mean `requests_per_unit`"), "{err}");
    let err = o.set(spec("alice", json!([]))).unwrap_err();
    assert!(err.to_string().contains("empty list"), "{err}");
    let err = o.set(OverrideSpec { descriptor: vec![], ..spec("x", json!({"unit": "second"})) }).unwrap_err();
    assert!(matches!(err, OverrideError::Invalid(_)), "{err}");
    let long = "x".repeat(2_000);
    assert!(o.set(spec(&long, json!({"unit": "second"}))).is_err());
    assert!(o.is_empty());
}

/// A service over the in-memory store on one rules file for domain `api`,
/// with overrides (in `dir`) and its metrics.
fn memory_service(
    dir: &TempDir,
    rules_yaml: &str,
) -> (
    floodgate_server::service::Service<floodgate_core::MemoryStore>,
    std::sync::Arc<Overrides>,
    std::sync::Arc<floodgate_server::runtime::metrics::Metrics>,
) {
    use std::sync::Arc;

    use floodgate_core::MemoryStore;
    use floodgate_core::limiter::Limiter;
    use floodgate_core::rules::LoadOptions;
    use floodgate_server::rules::reload::Rules;
    use floodgate_server::runtime::metrics::Metrics;
    use floodgate_server::service::Service;

    std::fs::create_dir_all(dir.0.join("rules")).unwrap();
    std::fs::write(dir.0.join("rules/api.yaml"), rules_yaml).unwrap();
    let o = Arc::new(Overrides::open(dir.0.join("o.redb")).unwrap());
    let rules = Rules::load(dir.0.join("rules"), LoadOptions::default()).unwrap();
    let metrics = Arc::new(Metrics::new());
    let limiter = Limiter::new(MemoryStore::new(), MemoryStore::new());
    (Service::new(rules, Some(o.clone()), limiter, metrics.clone()), o, metrics)
}

#[test]
fn an_override_takes_precedence_over_the_files() {
    use floodgate_server::service::{Descriptor, Request};

    let dir = TempDir::new("precedence");
    let (service, o, _) = memory_service(
        &dir,
        "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 10}\n",
    );
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    // The (counter key, limit) of every limit applying to one descriptor.
    let resolve = |k: &str, v: &str| -> Vec<(String, u64)> {
        let req = Request {
            domain: "api".into(),
            descriptors: vec![Descriptor { entries: vec![(k.into(), v.into())], ..Descriptor::default() }],
            hits_addend: 0,
        };
        rt.block_on(service.peek(&req))
            .unwrap()
            .into_iter()
            .map(|(key, info, _)| (key, info.requests_per_unit))
            .collect()
    };
    let before = resolve("user", "alice");
    assert_eq!(before.len(), 1);
    assert!(!before[0].0.contains("@override"), "from the files: {before:?}");
    assert_eq!(before[0].1, 10);
    o.set(spec("alice", json!({"unit": "minute", "requests_per_unit": 1000}))).unwrap();
    let after = resolve("user", "alice");
    assert!(after[0].0.contains("@override"), "from the override: {after:?}");
    assert_eq!(after[0].1, 1000);
    assert_ne!(after[0].0, before[0].0);
    // Other users still get the file's rule; a descriptor no file matches can
    // still be overridden.
    assert_eq!(resolve("user", "bob")[0].1, 10);
    assert!(resolve("ip", "1.2.3.4").is_empty());
    o.set(OverrideSpec {
        descriptor: vec![Entry { key: "ip".into(), value: "1.2.3.4".into() }],
        ..spec("x", json!({"unit": "second", "requests_per_unit": 0}))
    })
    .unwrap();
    assert_eq!(resolve("ip", "1.2.3.4")[0].1, 0);
    o.delete("api", &[("user", "alice")]).unwrap();
    assert_eq!(resolve("user", "alice")[0].1, 10);
}

/// Run as a child process by `a_crash_mid_write_loses_nothing_acknowledged`:
/// sets overrides forever, printing each one after it is durable.
#[test]
fn crash_child_writer() {
    let Ok(path) = std::env::var("FLOODGATE_CRASH_CHILD_DB") else { return };
    let o = Overrides::open(path).unwrap();
    for i in 1u64.. {
        o.set(spec(&format!("u{}", i % 20), json!({"unit": "minute", "requests_per_unit": i}))).unwrap();
        #[allow(clippy::print_stdout)] // the parent reads these lines
        {
            println!("ok {i}");
        }
    }
}

#[test]
fn a_crash_mid_write_loses_nothing_acknowledged() {
    let dir = TempDir::new("crash");
    let db = dir.0.join("o.redb");
    for round in 0..3 {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "crash_child_writer", "--nocapture", "--test-threads", "1"])
            .env("FLOODGATE_CRASH_CHILD_DB", &db)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut acked: Vec<u64> = Vec::new();
        for line in BufReader::new(child.stdout.take().unwrap()).lines() {
            let line = line.unwrap();
            if let Some(i) = line.strip_prefix("ok ") {
                acked.push(i.parse().unwrap());
                if acked.len() >= 40 + round * 17 {
                    break;
                }
            }
        }
        assert_eq!(acked.len(), 40 + round * 17, "the writer child did not run");
        child.kill().unwrap(); // SIGKILL: no destructor, no flush
        child.wait().unwrap();
        let o = Overrides::open(&db).expect("the database opens after a crash");
        assert!(o.problems().is_empty(), "{:?}", o.problems());
        // Every acknowledged write is there (or a later one for that user).
        let mut last = std::collections::HashMap::new();
        for i in acked {
            last.insert(i % 20, i);
        }
        for (user, i) in last {
            let stored = limit_of(&o, &format!("u{user}")).expect("acknowledged override present");
            assert!(stored >= i, "user u{user}: stored {stored} < acknowledged {i}");
        }
    }
}

#[test]
fn decide_now_answers_as_decide_does_on_the_same_counters_overrides_and_metrics() {
    use floodgate_server::runtime::metrics::Protocol;
    use floodgate_server::service::{Descriptor, Request};

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
            service.decide_now(&req("alice"), Protocol::Proxy).expect("the memory store answers now").unwrap()
        } else {
            rt.block_on(service.decide(&req("alice"), Protocol::Proxy)).unwrap()
        };
        let (info, d) = a.headline.clone().unwrap();
        assert_eq!(info.name.as_deref(), Some("per_user"));
        seen.push((a.allowed, d.remaining));
        assert_eq!(a.retry_after.is_some(), !a.allowed);
    }
    assert_eq!(seen, [(true, 3), (true, 2), (true, 1), (true, 0), (false, 0)]);
    // An override applies on the synchronous path too.
    o.set(spec("bob", json!({"unit": "minute", "requests_per_unit": 1}))).unwrap();
    let first = service.decide_now(&req("bob"), Protocol::Proxy).unwrap().unwrap();
    let second = service.decide_now(&req("bob"), Protocol::Proxy).unwrap().unwrap();
    assert_eq!((first.allowed, second.allowed), (true, false));
    // Bad requests are refused the same way, and every decision is counted.
    let empty = Request { domain: "api".into(), descriptors: vec![], hits_addend: 1 };
    let sync_err = service.decide_now(&empty, Protocol::Proxy).unwrap().unwrap_err().to_string();
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
