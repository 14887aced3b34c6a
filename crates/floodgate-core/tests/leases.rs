//! Concurrency limits in the in-memory store: leases with the request's
//! other limits all or nothing, releases that only release, and no leak
//! when callers never release.

use std::time::Duration;

use floodgate_core::region::Scope;
use floodgate_core::{Algorithm, Check, Clock, Limit, ManualClock, MemoryStore, Op};

const T0: u64 = 1_700_000_000_000_000;

fn check<'a>(key: &'a str, limit: &'a Limit, hits: u64, op: Op) -> Check<'a> {
    Check { key, limit, hits, op, enforce: true, scope: Scope::Region }
}

fn decide(store: &MemoryStore<&ManualClock>, checks: &[Check<'_>]) -> Vec<bool> {
    let mut out = Vec::new();
    store.apply_all_at(checks, store.clock().now_us(), &mut out);
    out.into_iter().map(|r| r.unwrap().allowed).collect()
}

#[test]
fn a_request_refused_for_concurrency_takes_no_rate_and_one_refused_by_a_rate_holds_no_slot() {
    let clock = ManualClock::new(T0);
    let store = MemoryStore::builder().clock(&clock).build();
    let rate = Limit::new(Algorithm::FixedWindow, 3, Duration::from_secs(60)).unwrap();
    let slots = Limit::new(Algorithm::Concurrency, 1, Duration::from_secs(30)).unwrap();
    let req =
        |lease| [check("rate", &rate, 1, Op::Acquire { lease }), check("slots", &slots, 1, Op::Acquire { lease })];
    assert_eq!(decide(&store, &req(1)), [true, true]);
    // The slot is held: refused for concurrency, and the rate keeps 2.
    assert_eq!(decide(&store, &req(2)), [true, false]);
    assert_eq!(store.apply_sync("rate", &rate, 0).unwrap().remaining, 2, "no rate taken by a refused request");
    // A release only releases: the rate keeps its hits.
    assert_eq!(
        decide(
            &store,
            &[
                check("rate", &rate, 1, Op::Release { lease: Some(1) }),
                check("slots", &slots, 1, Op::Release { lease: Some(1) })
            ]
        ),
        [true, true]
    );
    assert_eq!(store.apply_sync("rate", &rate, 0).unwrap().remaining, 2);
    assert_eq!(store.apply_sync("slots", &slots, 0).unwrap().remaining, 1);
    // Use up the rate: a request refused by it holds no slot.
    assert_eq!(decide(&store, &req(3)), [true, true]);
    assert_eq!(decide(&store, &[check("slots", &slots, 1, Op::Release { lease: Some(3) })]), [true]);
    assert_eq!(decide(&store, &req(4)), [true, true]);
    assert_eq!(decide(&store, &[check("slots", &slots, 1, Op::Release { lease: Some(4) })]), [true]);
    assert_eq!(decide(&store, &req(5)), [false, true], "the rate is used up");
    assert_eq!(store.apply_sync("slots", &slots, 0).unwrap().remaining, 1, "the slot went back");
}

#[test]
fn a_lease_ends_by_itself_and_an_extended_one_later() {
    let clock = ManualClock::new(T0);
    let store = MemoryStore::builder().clock(&clock).build();
    let slots = Limit::new(Algorithm::Concurrency, 2, Duration::from_secs(10)).unwrap();
    assert_eq!(decide(&store, &[check("k", &slots, 1, Op::Acquire { lease: 1 })]), [true]);
    assert_eq!(decide(&store, &[check("k", &slots, 1, Op::Acquire { lease: 2 })]), [true]);
    assert_eq!(decide(&store, &[check("k", &slots, 1, Op::Acquire { lease: 3 })]), [false]);
    clock.advance(Duration::from_secs(8));
    assert_eq!(decide(&store, &[check("k", &slots, 1, Op::Extend { lease: 2 })]), [true]);
    clock.advance(Duration::from_secs(3));
    // Lease 1 ended (a crashed holder); lease 2 was extended.
    assert_eq!(decide(&store, &[check("k", &slots, 1, Op::Extend { lease: 1 })]), [false]);
    assert_eq!(decide(&store, &[check("k", &slots, 1, Op::Acquire { lease: 3 })]), [true]);
    assert_eq!(decide(&store, &[check("k", &slots, 1, Op::Acquire { lease: 4 })]), [false]);
    // A late release of lease 1 frees nobody else's slot.
    assert_eq!(decide(&store, &[check("k", &slots, 1, Op::Release { lease: Some(1) })]), [true]);
    assert_eq!(decide(&store, &[check("k", &slots, 1, Op::Acquire { lease: 4 })]), [false]);
    assert_eq!(store.lease_stats()[0].1.held, 2, "leases 2 and 3");
    // A release without an id frees the earliest-expiring lease (3's ends later than 2's).
    assert_eq!(decide(&store, &[check("k", &slots, 1, Op::Release { lease: None })]), [true]);
    assert_eq!(decide(&store, &[check("k", &slots, 1, Op::Extend { lease: 2 })]), [false], "lease 2 went");
    assert_eq!(decide(&store, &[check("k", &slots, 1, Op::Extend { lease: 3 })]), [true]);
}

/// A million acquires over 10 000 keys, a tenth never released: within one
/// lease every slot is free again, and the store holds no more keys or
/// bytes than before (a store that has served these keys once: its tables
/// keep their size through a quiet spell, by design, so "before" is that).
#[test]
fn a_million_acquires_with_a_tenth_never_released_leak_nothing() {
    let clock = ManualClock::new(T0);
    let store = MemoryStore::builder().clock(&clock).build();
    let slots = Limit::new(Algorithm::Concurrency, 8, Duration::from_secs(30)).unwrap();
    let names: Vec<String> = (0..10_000).map(|i| format!("tenant-{i}")).collect();
    let quiet = |store: &MemoryStore<&ManualClock>| {
        clock.advance(Duration::from_secs(31));
        // The periodic sweep: a table left sparse shrinks after a few sweeps
        // in a row (not at the first, so keys that come back do not churn it).
        for _ in 0..8 {
            store.sweep();
        }
    };
    for (i, key) in names.iter().enumerate() {
        decide(&store, &[check(key, &slots, 1, Op::Acquire { lease: i as u64 + 1 })]);
    }
    quiet(&store);
    let (keys_before, bytes_before) = (store.len(), store.memory_bytes());
    assert_eq!(keys_before, 0);
    let mut held = 0u64;
    for i in 0..1_000_000u64 {
        let key = &names[(i % 10_000) as usize];
        let lease = i + 1;
        let ok = decide(&store, &[check(key, &slots, 1, Op::Acquire { lease })]);
        if ok == [true] {
            if i % 10 == 0 {
                held += 1; // the caller crashed: never released
            } else {
                decide(&store, &[check(key, &slots, 1, Op::Release { lease: Some(lease) })]);
            }
        }
        if i % 100_000 == 0 {
            clock.advance(Duration::from_millis(10));
        }
    }
    assert!(held > 0);
    assert!(store.len() >= 10_000, "keys hold the unreleased leases");
    clock.advance(Duration::from_secs(31));
    for key in &names {
        assert_eq!(store.apply_sync(key, &slots, 0).unwrap().remaining, 8, "{key}: every slot free again");
    }
    quiet(&store);
    assert_eq!(store.len(), keys_before);
    // The slots' accounts: none held, each acquired one released by its
    // holder or expired (the tenth never released, and the warm-up's).
    let stats = store.lease_stats();
    assert_eq!(stats.len(), 1);
    let s = stats[0].1;
    assert_eq!(s.held, 0, "{s:?}");
    assert_eq!(s.acquired, s.released + s.expired, "{s:?}");
    assert_eq!(s.expired, held + names.len() as u64, "{s:?}");
    assert!(store.memory_bytes() <= bytes_before, "{} > {bytes_before}", store.memory_bytes());
}
