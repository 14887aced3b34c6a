//! Concurrency leases on Redis leak nothing (issue 49): many acquires over
//! many keys, a fifth never released (their holders "crashed"); once one
//! lease has passed every slot is free again and Redis holds no lease key.
//! (That Redis decides leases exactly as the memory store does is the
//! conformance suite's; this is about what stays behind.)

use std::time::{Duration, Instant};

use floodgate_core::{Algorithm, Check, Limit, Op, Store};
use floodgate_redis::{RedisConfig, RedisStore};
use floodgate_testing::RedisServer;

fn check<'a>(key: &'a str, limit: &'a Limit, op: Op, hits: u64) -> Check<'a> {
    Check { key, limit, hits, op, enforce: true, scope: floodgate_core::region::Scope::Region }
}

#[test]
fn unreleased_leases_leave_nothing_behind_after_one_lease() {
    let server = RedisServer::start();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let store = RedisStore::new(RedisConfig::new(server.url().parse().unwrap())).unwrap();
    let limit = Limit::new(Algorithm::Concurrency, 4, Duration::from_secs(3)).unwrap();
    let keys: Vec<String> = (0..200).map(|k| format!("job{k}")).collect();
    rt.block_on(async {
        let mut out = Vec::new();
        let mut never_released = 0;
        for i in 0..2_000u64 {
            let key = &keys[(i % 200) as usize];
            let lease = i + 1;
            store.apply_all(&[check(key, &limit, Op::Acquire { lease }, 1)], &mut out).await;
            assert!(out[0].as_ref().unwrap().allowed, "acquire {i}: {:?}", out[0]);
            if i / 200 >= 8 {
                never_released += 1;
                continue;
            }
            store.apply_all(&[check(key, &limit, Op::Release { lease: Some(lease) }, 0)], &mut out).await;
        }
        assert_eq!(never_released, 400, "a fifth");
        // 400 slots are held by holders that will never come back (the last
        // two rounds, so well within their lease now): two per key, so each
        // key has two left.
        store.apply_all(&[check(&keys[3], &limit, Op::Take, 0)], &mut out).await;
        assert_eq!(out[0].as_ref().unwrap().remaining, 2);
        assert_eq!(server.cli(&["dbsize"]).trim(), "400", "a hash and a sorted set per key holding leases");
        // One lease later every slot is free, and Redis dropped the keys by
        // itself (their expiry follows the last lease).
        tokio::time::sleep(Duration::from_millis(3_100)).await;
        store.apply_all(&[check(&keys[3], &limit, Op::Take, 0)], &mut out).await;
        assert_eq!(out[0].as_ref().unwrap().remaining, 4);
        let deadline = Instant::now() + Duration::from_secs(10);
        while server.cli(&["dbsize"]).trim() != "0" {
            assert!(Instant::now() < deadline, "lease keys left: {}", server.cli(&["dbsize"]));
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
}

/// The store's accounts count what its calls did to the slots: acquired,
/// released, and expired leases found as their key is met.
#[test]
fn the_accounts_count_acquired_released_and_expired_slots() {
    let server = RedisServer::start();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let store = RedisStore::new(RedisConfig::new(server.url().parse().unwrap())).unwrap();
    let limit = Limit::new(Algorithm::Concurrency, 2, Duration::from_secs(2)).unwrap();
    rt.block_on(async {
        let mut out = Vec::new();
        let mut op = async |op: Op, hits: u64| {
            store.apply_all(&[check("acct", &limit, op, hits)], &mut out).await;
            assert!(out[0].as_ref().unwrap().allowed, "{op:?}: {:?}", out[0]);
        };
        op(Op::Acquire { lease: 1 }, 1).await;
        tokio::time::sleep(Duration::from_millis(1_000)).await;
        // Lease 2 keeps the key alive past lease 1's end.
        op(Op::Acquire { lease: 2 }, 1).await;
        tokio::time::sleep(Duration::from_millis(1_200)).await;
        // Lease 1 has ended unreleased: found expired by the next acquire.
        op(Op::Acquire { lease: 3 }, 1).await;
        op(Op::Release { lease: Some(3) }, 0).await;
        op(Op::Release { lease: Some(3) }, 0).await; // again: frees nothing
    });
    let stats = store.lease_stats();
    assert_eq!(stats.len(), 1);
    let s = stats[0].1;
    assert_eq!((s.acquired, s.released, s.expired, s.held), (3, 1, 1, 1), "{s:?}");
}
