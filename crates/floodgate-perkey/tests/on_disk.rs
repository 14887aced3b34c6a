//! Per-key entries on disk: set, get, list, delete, persisted, validated,
//! tiers, the cache, the hash index, and durable across a crash mid-write.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use floodgate_core::rules::RuleSet;
use floodgate_perkey::{Entry, KeyError, KeySpec, PerKey};
use serde_json::json;

use floodgate_testing::TempDir;

fn spec(user: &str, limits: serde_json::Value) -> KeySpec {
    KeySpec {
        domain: "api".into(),
        descriptor: vec![Entry { key: "user".into(), value: user.into() }],
        tier: None,
        limits: Some(limits),
        name: None,
    }
}

fn tiered(user: &str, tier: &str) -> KeySpec {
    KeySpec { tier: Some(tier.into()), limits: None, ..spec(user, json!(null)) }
}

/// Rules of domain `api` with tiers `free` (60/min) and `pro` (2 limits).
const TIERED: &str = "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 10}\ntiers:\n  free: {unit: minute, requests_per_unit: 60}\n  pro:\n    - {unit: second, requests_per_unit: 50}\n    - {unit: day, requests_per_unit: 1000000}\n";

fn no_rules() -> RuleSet {
    RuleSet::default()
}

fn limit_of(o: &PerKey, user: &str) -> Option<u64> {
    let e = o.get("api", &[("user", user)])?;
    Some(e.rules_in(&no_rules(), "api")?[0].limit.as_ref().unwrap().limit())
}

#[test]
fn set_get_list_delete_and_survive_a_restart() {
    let dir = TempDir::new("crud");
    let db = dir.0.join("overrides.redb");
    {
        let o = PerKey::open(&db).unwrap();
        assert!(o.is_empty());
        o.set(spec("alice", json!({"unit": "second", "requests_per_unit": 5})), &no_rules()).unwrap();
        o.set(spec("bob", json!([{"algorithm": "gcra", "window": "1s", "requests_per_unit": 2, "burst": 4}, {"unit": "day", "requests_per_unit": 100}])), &no_rules()).unwrap();
        assert_eq!(limit_of(&o, "alice"), Some(5));
        o.set(spec("alice", json!({"unit": "second", "requests_per_unit": 7})), &no_rules()).unwrap();
        assert_eq!(limit_of(&o, "alice"), Some(7), "set replaces (and the cache knows)");
        assert_eq!(o.total(), 2);
        assert_eq!(o.get("api", &[("user", "bob")]).unwrap().rules_in(&no_rules(), "api").unwrap().len(), 2);
        assert!(o.get("api", &[("user", "carol")]).is_none());
        assert!(o.get("web", &[("user", "alice")]).is_none());
    }
    let o = PerKey::open(&db).unwrap();
    assert_eq!(limit_of(&o, "alice"), Some(7), "persisted");
    assert_eq!(o.total(), 2);
    assert!(o.delete("api", &[("user", "alice")]).unwrap());
    assert!(!o.delete("api", &[("user", "alice")]).unwrap());
    drop(o);
    let o = PerKey::open(&db).unwrap();
    assert!(limit_of(&o, "alice").is_none(), "the delete persisted");
    assert_eq!(o.total(), 1);
    // An override's counters are its own.
    let bob = o.get("api", &[("user", "bob")]).unwrap();
    assert_ne!(bob.counter_key("k", 0), bob.counter_key("k", 1));
    assert_eq!(
        (bob.counter_key("k", 0), bob.counter_key("k", 1)),
        ("k".into(), "k#1".into()),
        "numbered as a file rule's"
    );
}

#[test]
fn invalid_overrides_are_refused_and_change_nothing() {
    let dir = TempDir::new("invalid");
    let o = PerKey::open(dir.0.join("o.redb")).unwrap();
    let set = |s: KeySpec| o.set(s, &no_rules());
    let err = set(spec("alice", json!({"unit": "fortnight", "requests_per_unit": 5}))).unwrap_err();
    assert!(matches!(&err, KeyError::Limits(_)));
    assert!(err.to_string().contains("invalid unit `fortnight`"), "{err}");
    let err = set(spec("alice", json!({"unit": "second", "burst": 3}))).unwrap_err();
    assert!(err.to_string().contains("fixed_window has no burst"), "{err}");
    let err = set(spec("alice", json!({"unit": "second", "requests_per_units": 3}))).unwrap_err();
    assert!(err.to_string().contains("did you mean `requests_per_unit`"), "{err}");
    let err = set(spec("alice", json!([]))).unwrap_err();
    assert!(err.to_string().contains("empty list"), "{err}");
    let err = set(KeySpec { descriptor: vec![], ..spec("x", json!({"unit": "second"})) }).unwrap_err();
    assert!(matches!(err, KeyError::Invalid(_)), "{err}");
    let long = "x".repeat(2_000);
    assert!(set(spec(&long, json!({"unit": "second"}))).is_err());
    let err = set(spec("a\u{0}b", json!({"unit": "second"}))).unwrap_err();
    assert!(err.to_string().contains("control characters"), "{err}");
    let err = set(KeySpec { tier: Some("pro".into()), ..spec("x", json!({"unit": "second"})) }).unwrap_err();
    assert!(err.to_string().contains("either tier or limits"), "{err}");
    let err = set(KeySpec { limits: None, ..spec("x", json!(null)) }).unwrap_err();
    assert!(err.to_string().contains("give tier"), "{err}");
    let err = set(tiered("x", "pro")).unwrap_err();
    assert!(err.to_string().contains("domain `api` has no rules file"), "{err}");
    let rules = RuleSet::from_yaml("api.yaml", TIERED).unwrap();
    let err = o.set(tiered("x", "gold"), &rules).unwrap_err();
    assert!(err.to_string().contains("unknown tier `gold` in domain `api` (its tiers: free, pro)"), "{err}");
    assert!(o.is_empty());
}

/// Run as a child process by `a_crash_mid_write_loses_nothing_acknowledged`:
/// sets overrides forever, printing each one after it is durable.
#[test]
fn crash_child_writer() {
    let Ok(path) = std::env::var("FLOODGATE_CRASH_CHILD_DB") else { return };
    let o = PerKey::open(path).unwrap();
    for i in 1u64.. {
        o.set(spec(&format!("u{}", i % 20), json!({"unit": "minute", "requests_per_unit": i})), &no_rules()).unwrap();
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
            .args(["--exact", "on_disk::crash_child_writer", "--nocapture", "--test-threads", "1"])
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
        let o = PerKey::open(&db).expect("the database opens after a crash");
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
fn the_cache_holds_no_entry_answers_and_reads_each_key_once() {
    let dir = TempDir::new("cache");
    let o = std::sync::Arc::new(PerKey::open(dir.0.join("o.redb")).unwrap());
    // A domain with no entries at all costs no lookup.
    assert!(o.get("api", &[("user", "nobody")]).is_none());
    assert_eq!(o.stats().misses.get(), 0);
    o.set(spec("alice", json!({"unit": "second", "requests_per_unit": 5})), &no_rules()).unwrap();
    assert!(o.get("api", &[("user", "nobody")]).is_none());
    assert!(o.get("api", &[("user", "nobody")]).is_none());
    assert_eq!((o.stats().misses.get(), o.stats().hits.get()), (1, 1), "'none' is cached");
    // Eight threads missing one key at once: one read.
    let before = o.stats().misses.get();
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(8));
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let (o, barrier) = (o.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                o.get("api", &[("user", "alice")]).is_some()
            })
        })
        .collect();
    assert!(threads.into_iter().all(|t| t.join().unwrap()));
    assert_eq!(o.stats().misses.get() - before, 1);
    // A write drops its key: the next lookup reads the new entry.
    o.set(spec("nobody", json!({"unit": "second", "requests_per_unit": 3})), &no_rules()).unwrap();
    assert_eq!(limit_of(&o, "nobody"), Some(3));
}

/// Misses read the store while writes change the same keys: a read that
/// began before a write must not leave its answer cached after the write
/// (no time to live on disk would ever take it out). Tiers and "no entry"
/// are the answers the compact table holds.
#[test]
fn a_miss_racing_a_write_never_leaves_the_old_answer_cached() {
    use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

    let dir = TempDir::new("race");
    let rules = RuleSet::from_yaml("api.yaml", TIERED).unwrap();
    // A small cache: lookups of 64 keys keep evicting, so misses keep
    // reading while the writes go on.
    let o = std::sync::Arc::new(
        PerKey::open_with(dir.0.join("o.redb"), floodgate_perkey::CacheOptions { entries: 16, ttl: None }).unwrap(),
    );
    let users: Vec<String> = (0..64).map(|i| format!("u{i}")).collect();
    for u in &users {
        o.set(tiered(u, "free"), &rules).unwrap();
    }
    let done = std::sync::Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..3)
        .map(|t| {
            let (o, done, users) = (o.clone(), done.clone(), users.clone());
            std::thread::spawn(move || {
                let mut n = t;
                while !done.load(Relaxed) {
                    let _ = o.get("api", &[("user", users[n % users.len()].as_str())]);
                    n += 7;
                }
            })
        })
        .collect();
    let tier_of = |u: &str| match o.get("api", &[("user", u)]) {
        Some(floodgate_perkey::Limits::Tier(t)) => t.to_owned(),
        Some(_) => "own".to_owned(),
        None => "none".to_owned(),
    };
    for round in 0..40 {
        let u = &users[round % 8];
        if round % 3 == 2 {
            assert!(o.delete("api", &[("user", u.as_str())]).unwrap());
        } else {
            o.set(tiered(u, if round % 2 == 0 { "pro" } else { "free" }), &rules).unwrap();
        }
    }
    done.store(true, Relaxed);
    for r in readers {
        r.join().unwrap();
    }
    // The last write of each of the 8 users written, looked up twice (the
    // second from the cache).
    for (i, u) in users.iter().enumerate().take(8) {
        let last = (0..40).filter(|r| r % 8 == i).max().unwrap();
        let want = if last % 3 == 2 {
            "none"
        } else if last % 2 == 0 {
            "pro"
        } else {
            "free"
        };
        for _ in 0..2 {
            assert_eq!(tier_of(u), want, "{u}");
        }
    }
}

/// Each deciding thread keeps its own copies of the answers it used last
/// (the front cache): a write on another thread changes what every one of
/// them answers next, and two stores on one thread never see each other's.
#[test]
fn a_write_reaches_every_threads_own_copies_at_once() {
    use std::sync::mpsc;

    let dir = TempDir::new("front");
    let o = std::sync::Arc::new(PerKey::open(dir.0.join("o.redb")).unwrap());
    let other = PerKey::open(dir.0.join("other.redb")).unwrap();
    other.set(spec("alice", json!({"unit": "second", "requests_per_unit": 99})), &no_rules()).unwrap();
    o.set(spec("alice", json!({"unit": "second", "requests_per_unit": 5})), &no_rules()).unwrap();
    let (to_main, from_threads) = mpsc::channel();
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let (o, to_main) = (o.clone(), to_main.clone());
            let (to_thread, from_main) = mpsc::channel::<()>();
            let t = std::thread::spawn(move || {
                // Looked up over and over: held in this thread's front.
                for _ in 0..2 {
                    let seen: Vec<Option<u64>> = (0..100).map(|_| limit_of(&o, "alice")).collect();
                    to_main.send(seen).unwrap();
                    from_main.recv().unwrap();
                }
            });
            (t, to_thread)
        })
        .collect();
    for _ in &threads {
        assert_eq!(from_threads.recv().unwrap(), vec![Some(5); 100]);
    }
    assert_eq!(limit_of(&other, "alice"), Some(99), "each store answers its own");
    o.set(spec("alice", json!({"unit": "second", "requests_per_unit": 7})), &no_rules()).unwrap();
    for (_, to_thread) in &threads {
        to_thread.send(()).unwrap();
    }
    for _ in &threads {
        assert_eq!(from_threads.recv().unwrap(), vec![Some(7); 100], "the write reached every thread");
    }
    for (t, to_thread) in threads {
        to_thread.send(()).unwrap();
        t.join().unwrap();
    }
    assert!(o.delete("api", &[("user", "alice")]).unwrap());
    assert_eq!(limit_of(&o, "alice"), None, "and a delete");
}

#[test]
fn cached_answers_expire_after_their_time_to_live() {
    use floodgate_perkey::CacheOptions;

    let dir = TempDir::new("ttl");
    let cache = CacheOptions { entries: 10, ttl: Some(std::time::Duration::from_millis(50)) };
    let o = PerKey::open_with(dir.0.join("o.redb"), cache).unwrap();
    o.set(spec("alice", json!({"unit": "second", "requests_per_unit": 5})), &no_rules()).unwrap();
    assert!(o.get("api", &[("user", "alice")]).is_some());
    assert!(o.get("api", &[("user", "alice")]).is_some());
    assert_eq!(o.stats().misses.get(), 1);
    std::thread::sleep(std::time::Duration::from_millis(80));
    assert!(o.get("api", &[("user", "alice")]).is_some());
    assert_eq!(o.stats().misses.get(), 2, "read again after the time to live");
}

#[test]
fn a_batch_is_all_or_nothing_and_counted_per_tier() {
    let dir = TempDir::new("batch");
    let o = PerKey::open(dir.0.join("o.redb")).unwrap();
    let rules = RuleSet::from_yaml("api.yaml", TIERED).unwrap();
    let mut batch: Vec<KeySpec> = (0..1_000).map(|i| tiered(&format!("u{i:04}"), "free")).collect();
    batch[500] = tiered("u0500", "gold");
    batch[700] = spec("u0700", json!({"unit": "fortnight"}));
    let errors = PerKey::validate(batch.clone(), &rules, |_| None).unwrap_err();
    assert_eq!(errors.iter().map(|e| e.0).collect::<Vec<_>>(), [500, 700]);
    assert!(o.is_empty(), "nothing written");
    batch[500] = tiered("u0500", "pro");
    batch[700] = spec("u0700", json!({"unit": "second", "requests_per_unit": 1}));
    let built = PerKey::validate(batch, &rules, |_| None).unwrap();
    assert_eq!(o.write_all(&built).unwrap(), 1_000);
    assert_eq!(
        o.counts(),
        [
            ("api".to_owned(), String::new(), 1),
            ("api".to_owned(), "free".to_owned(), 998),
            ("api".to_owned(), "pro".to_owned(), 1)
        ]
    );
    // Moving a key to another tier moves its count.
    o.set(tiered("u0001", "pro"), &rules).unwrap();
    assert_eq!(o.counts()[1].2, 997);
    assert_eq!(o.counts()[2].2, 2);
}

#[test]
fn listings_page_in_order_by_domain_and_prefix() {
    let dir = TempDir::new("pages");
    let o = PerKey::open(dir.0.join("o.redb")).unwrap();
    for u in ["alan", "alice", "albert", "bob"] {
        o.set(spec(u, json!({"unit": "second", "requests_per_unit": 1})), &no_rules()).unwrap();
    }
    o.set(KeySpec { domain: "api2".into(), ..spec("alice", json!({"unit": "second"})) }, &no_rules()).unwrap();
    let users = |p: &floodgate_perkey::Page| {
        p.entries.iter().map(|(s, _)| format!("{}/{}", s.domain, s.descriptor[0].value)).collect::<Vec<_>>()
    };
    let p1 = o.page(Some("api"), "user=al", false, None, 2).unwrap();
    assert_eq!(users(&p1), ["api/alan", "api/albert"]);
    let p2 = o.page(Some("api"), "user=al", false, p1.next_cursor.as_deref(), 2).unwrap();
    assert_eq!(users(&p2), ["api/alice"]);
    assert!(p2.next_cursor.is_none());
    assert_eq!(users(&o.page(Some("api"), "", false, None, 10).unwrap()).len(), 4, "api2 is another domain");
    assert_eq!(users(&o.page(Some("api"), "user=alice", true, None, 10).unwrap()), ["api/alice"]);
    assert!(o.page(Some("api"), "user=ali", true, None, 10).unwrap().entries.is_empty());
    assert_eq!(users(&o.page(None, "", false, None, 10).unwrap()).len(), 5);
    assert!(o.page(None, "user=a", false, None, 10).is_err(), "a prefix needs a domain");
    assert!(o.page(Some("api"), "", false, Some("zz-not-hex"), 10).is_err());
}

#[test]
fn a_database_from_before_tiers_is_migrated_on_open() {
    let dir = TempDir::new("migrate");
    let path = dir.0.join("o.redb");
    {
        let db = redb::Database::create(&path).unwrap();
        let txn = db.begin_write().unwrap();
        {
            let def: redb::TableDefinition<&str, &str> = redb::TableDefinition::new("overrides");
            let mut t = txn.open_table(def).unwrap();
            let old = json!({"spec": {"domain": "api", "descriptor": [{"key": "user", "value": "vip"}], "limits": {"unit": "second", "requests_per_unit": 9}}, "updated_at": 1_700_000_000u64});
            t.insert("3:api|4:user|3:vip", old.to_string().as_str()).unwrap();
        }
        txn.commit().unwrap();
    }
    let o = PerKey::open(&path).unwrap();
    assert_eq!(limit_of(&o, "vip"), Some(9));
    assert_eq!(o.page(Some("api"), "", false, None, 10).unwrap().entries[0].1, 1_700_000_000);
    drop(o);
    // Opened again, it is simply there (the old table is gone).
    let o = PerKey::open(&path).unwrap();
    assert_eq!(o.total(), 1);
}

/// Wait (bounded) until the store's hash index is in use.
fn index_ready(o: &PerKey) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !o.index_status().ready {
        assert!(std::time::Instant::now() < deadline, "no index within 30 s: {:?}", o.index_status());
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[test]
fn misses_read_the_hash_index_and_writes_since_it_stay_exact() {
    use floodgate_perkey::CacheOptions;
    use std::sync::atomic::Ordering::Relaxed;
    let dir = TempDir::new("index");
    let path = dir.0.join("o.redb");
    let rules = RuleSet::from_yaml("api.yaml", TIERED).unwrap();
    let tier_of = |o: &PerKey, user: &str| match o.get("api", &[("user", user)]) {
        Some(floodgate_perkey::Limits::Tier(t)) => Some(t.to_string()),
        Some(other) => Some(format!("{other:?}")),
        None => None,
    };
    // A cache of one answer: nearly every lookup reads the store.
    let small = CacheOptions { entries: 1, ttl: None };
    {
        let o = PerKey::open_with(&path, small).unwrap();
        assert!(!o.index_status().ready, "an empty database needs no index");
        let batch: Vec<KeySpec> = (0..3_000).map(|i| tiered(&format!("u{i}"), "free")).collect();
        o.write_all(&PerKey::validate(batch, &rules, |_| None).unwrap()).unwrap();
        // Before any index: the database answers.
        assert_eq!(tier_of(&o, "u7").as_deref(), Some("free"));
        index_ready(&o);
        let before = o.index_status().answered;
        for i in (0..3_000).step_by(7) {
            assert_eq!(tier_of(&o, &format!("u{i}")).as_deref(), Some("free"), "u{i}");
        }
        assert!(tier_of(&o, "nobody").is_none());
        assert!(o.index_status().answered > before + 400, "the index answered the misses: {:?}", o.index_status());
        // Writes after the build: each key's next lookup is the new state.
        o.set(tiered("u5", "pro"), &rules).unwrap();
        assert!(o.delete("api", &[("user", "u6")]).unwrap());
        o.set(tiered("new", "pro"), &rules).unwrap();
        for _ in 0..2 {
            assert_eq!(tier_of(&o, "u5").as_deref(), Some("pro"));
            assert!(tier_of(&o, "u6").is_none());
            assert_eq!(tier_of(&o, "new").as_deref(), Some("pro"));
            assert_eq!(tier_of(&o, "u8").as_deref(), Some("free"));
        }
        assert_eq!(o.stats().read_errors.load(Relaxed), 0);
    }
    // Reopened: the index predates the last writes, so it is not used
    // until rebuilt; the answers are the same throughout.
    let o = PerKey::open_with(&path, small).unwrap();
    assert!(!o.index_status().ready, "an index older than the database is not used");
    assert_eq!(tier_of(&o, "u5").as_deref(), Some("pro"));
    index_ready(&o);
    assert_eq!(o.index_status().builds, 1);
    assert_eq!(tier_of(&o, "u5").as_deref(), Some("pro"));
    assert!(tier_of(&o, "u6").is_none());
    assert_eq!(tier_of(&o, "new").as_deref(), Some("pro"));
    drop(o);
    // Reopened with no write since the build: used at once.
    let o = PerKey::open_with(&path, small).unwrap();
    assert!(o.index_status().ready, "an index of the last commit is used at open");
    assert_eq!(tier_of(&o, "u9").as_deref(), Some("free"));
    drop(o);
    // A damaged index is not used, and the answers do not change.
    let index = dir.0.join("o.redb.index");
    let mut bytes = std::fs::read(&index).unwrap();
    bytes[4096..].fill(0xAB);
    bytes[10] ^= 0xFF;
    std::fs::write(&index, &bytes).unwrap();
    let o = PerKey::open_with(&path, small).unwrap();
    assert!(!o.index_status().ready);
    assert_eq!(tier_of(&o, "u9").as_deref(), Some("free"));
    assert!(tier_of(&o, "u6").is_none());
    index_ready(&o);
    drop(o);
    // Another database in the same place, with as many commits: the index
    // of the first one is not used for it.
    std::fs::remove_file(&path).unwrap();
    let o = PerKey::open_with(&path, small).unwrap();
    let batch: Vec<KeySpec> = (0..3_000).map(|i| tiered(&format!("u{i}"), "pro")).collect();
    o.write_all(&PerKey::validate(batch, &rules, |_| None).unwrap()).unwrap();
    o.set(tiered("u5", "free"), &rules).unwrap();
    o.delete("api", &[("user", "u6")]).unwrap();
    o.set(tiered("new", "free"), &rules).unwrap();
    drop(o);
    let o = PerKey::open_with(&path, small).unwrap();
    assert!(!o.index_status().ready, "an index of another database is not used");
    assert_eq!(tier_of(&o, "u9").as_deref(), Some("pro"));
    assert_eq!(tier_of(&o, "u5").as_deref(), Some("free"));
}

#[test]
fn an_index_that_cannot_be_built_leaves_misses_on_the_database() {
    use floodgate_perkey::CacheOptions;
    let dir = TempDir::new("index-fails");
    let path = dir.0.join("o.redb");
    // Where the build spills its records, a file: every build fails.
    std::fs::write(dir.0.join("o.redb.index.build"), b"in the way").unwrap();
    let rules = RuleSet::from_yaml("api.yaml", TIERED).unwrap();
    let o = PerKey::open_with(&path, CacheOptions { entries: 1, ttl: None }).unwrap();
    let batch: Vec<KeySpec> = (0..100).map(|i| tiered(&format!("u{i}"), "free")).collect();
    o.write_all(&PerKey::validate(batch, &rules, |_| None).unwrap()).unwrap();
    // Past the pause a build waits for, and a failed try.
    std::thread::sleep(std::time::Duration::from_secs(3));
    assert!(!o.index_status().ready);
    for i in 0..100 {
        assert!(o.get("api", &[("user", format!("u{i}").as_str())]).is_some(), "u{i}");
    }
    assert!(o.get("api", &[("user", "nobody")]).is_none());
    assert_eq!(o.index_status().answered, 0);
    // Out of the way: the next write's pause brings a build.
    std::fs::remove_file(dir.0.join("o.redb.index.build")).unwrap();
    o.set(tiered("u1", "pro"), &rules).unwrap();
    index_ready(&o);
    // The cache holds a few of them (one bucket): the others are read.
    for i in 2..100 {
        assert!(o.get("api", &[("user", format!("u{i}").as_str())]).is_some(), "u{i}");
    }
    assert!(o.index_status().answered > 0);
}
