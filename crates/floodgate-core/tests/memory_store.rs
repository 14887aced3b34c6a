//! The in-memory store: atomic per key under concurrency, bounded, expiring.

use std::sync::Barrier;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use floodgate_core::{Algorithm, LeakyMode, Limit, ManualClock, MemoryStore, OnFull, Store, StoreError};

const SEC: Duration = Duration::from_secs(1);

fn exact_algorithms() -> Vec<Algorithm> {
    vec![
        Algorithm::FixedWindow,
        Algorithm::SlidingLog,
        Algorithm::SlidingBuckets { granularity: 10 },
        Algorithm::TokenBucket { burst: None },
        Algorithm::Gcra { burst: Some(37) },
        Algorithm::LeakyBucket { burst: None, mode: LeakyMode::Meter },
        Algorithm::LeakyBucket { burst: None, mode: LeakyMode::Shape },
    ]
}

#[test]
fn eight_threads_on_one_key_admit_exactly_the_capacity() {
    for algorithm in exact_algorithms() {
        for hits in [1u64, 3] {
            let clock = ManualClock::new(1_700_000_000_000_000);
            let store = MemoryStore::builder().clock(&clock).build();
            let limit = Limit::new(algorithm, 1_000, SEC).unwrap();
            let capacity =
                limit.burst() + u64::from(matches!(algorithm, Algorithm::LeakyBucket { mode: LeakyMode::Shape, .. }));
            let barrier = Barrier::new(8);
            let admitted: u64 = std::thread::scope(|scope| {
                let workers: Vec<_> = (0..8)
                    .map(|_| {
                        scope.spawn(|| {
                            barrier.wait();
                            let mut units = 0;
                            for _ in 0..capacity {
                                if store.apply_sync("hot", &limit, hits).unwrap().allowed {
                                    units += hits;
                                }
                            }
                            units
                        })
                    })
                    .collect();
                workers.into_iter().map(|w| w.join().unwrap()).sum()
            });
            // Exactly the capacity, in whole requests of `hits` units.
            assert_eq!(admitted, capacity / hits * hits, "{algorithm:?} hits {hits}");
        }
    }
}

#[test]
fn racing_threads_over_time_admit_what_one_thread_would() {
    // Seven threads race through 200 phases; between phases time moves
    // 7 ms. Requests within a phase all happen at the same time, so how many
    // the phase admits is fixed by the algorithm, whatever the interleaving:
    // it must equal a single thread's replay, phase by phase.
    const WORKERS: usize = 7;
    const PHASES: usize = 200;
    const TRIES: usize = 3;
    for algorithm in exact_algorithms() {
        let limit = Limit::new(algorithm, 50, SEC).unwrap();
        let clock = ManualClock::new(1_700_000_000_000_000);
        let store = MemoryStore::builder().clock(&clock).build();
        let start = Barrier::new(WORKERS + 1);
        let end = Barrier::new(WORKERS + 1);
        let admitted: Vec<std::sync::atomic::AtomicU64> = (0..PHASES).map(|_| Default::default()).collect();
        std::thread::scope(|scope| {
            for _ in 0..WORKERS {
                scope.spawn(|| {
                    for phase in &admitted {
                        start.wait();
                        for _ in 0..TRIES {
                            if store.apply_sync("k", &limit, 1).unwrap().allowed {
                                phase.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            }
                        }
                        end.wait();
                    }
                });
            }
            for _ in 0..PHASES {
                start.wait();
                end.wait();
                clock.advance(Duration::from_millis(7));
            }
        });
        let serial_clock = ManualClock::new(1_700_000_000_000_000);
        let serial = MemoryStore::builder().clock(&serial_clock).build();
        for (phase, raced) in admitted.iter().enumerate() {
            let want = (0..WORKERS * TRIES).filter(|_| serial.apply_sync("k", &limit, 1).unwrap().allowed).count();
            let got = raced.load(std::sync::atomic::Ordering::Relaxed);
            assert_eq!(got, want as u64, "{algorithm:?}: phase {phase}");
            serial_clock.advance(Duration::from_millis(7));
        }
    }
}

#[test]
fn peeks_and_denials_create_no_keys() {
    let store = MemoryStore::builder().clock(ManualClock::new(0)).build();
    let limit = Limit::new(Algorithm::FixedWindow, 5, SEC).unwrap();
    assert_eq!(store.apply_sync("a", &limit, 0).unwrap().remaining, 5);
    assert!(!store.apply_sync("b", &limit, 6).unwrap().allowed);
    let zero = Limit::new(Algorithm::FixedWindow, 0, SEC).unwrap();
    assert!(!store.apply_sync("c", &zero, 1).unwrap().allowed);
    assert_eq!(store.len(), 0);
    assert!(store.apply_sync("a", &limit, 1).unwrap().allowed);
    assert_eq!(store.len(), 1);
}

#[test]
fn keys_expire_once_their_state_is_empty() {
    let clock = ManualClock::new(0);
    let store = MemoryStore::builder().clock(&clock).build();
    let minute = Limit::new(Algorithm::Gcra { burst: None }, 60, Duration::from_secs(60)).unwrap();
    let hour = Limit::new(Algorithm::FixedWindow, 10, Duration::from_secs(3_600)).unwrap();
    for i in 0..100 {
        store.apply_sync(&format!("m{i}"), &minute, 30).unwrap();
    }
    store.apply_sync("h", &hour, 1).unwrap();
    clock.advance(Duration::from_secs(29));
    assert_eq!(store.sweep(), 0, "30 tokens take 30 s to refill");
    clock.advance(Duration::from_secs(1));
    assert_eq!(store.sweep(), 100);
    assert_eq!(store.len(), 1);
    clock.advance(Duration::from_secs(3_600));
    assert_eq!(store.sweep(), 1);
    assert!(store.is_empty());
}

#[test]
fn inserts_sweep_expired_keys_without_being_asked() {
    let clock = ManualClock::new(0);
    let store = MemoryStore::builder().clock(&clock).shards(1).build();
    let limit = Limit::new(Algorithm::FixedWindow, 1, SEC).unwrap();
    for round in 0..50u64 {
        for i in 0..1_000 {
            store.apply_sync(&format!("{round}-{i}"), &limit, 1).unwrap();
        }
        clock.advance(Duration::from_secs(11));
    }
    assert!(store.len() <= 2_000, "expired keys are dropped as the shard grows: {}", store.len());
}

#[test]
fn a_full_store_evicts_the_keys_closest_to_expiry() {
    let clock = ManualClock::new(0);
    let store = MemoryStore::builder().clock(&clock).shards(1).max_keys(64).build();
    let daily = Limit::new(Algorithm::FixedWindow, 1, Duration::from_secs(86_400)).unwrap();
    let secondly = Limit::new(Algorithm::FixedWindow, 1, SEC).unwrap();
    assert!(store.apply_sync("heavy", &daily, 1).unwrap().allowed);
    for i in 0..10_000 {
        store.apply_sync(&format!("flood{i}"), &secondly, 1).unwrap();
    }
    assert!(store.len() <= 64);
    assert!(store.evictions() >= 10_000 - 64);
    // The flood did not reset the long-lived key.
    assert!(!store.apply_sync("heavy", &daily, 1).unwrap().allowed);
}

#[test]
fn a_full_store_set_to_refuse_errors_for_new_keys_only() {
    let clock = ManualClock::new(0);
    let store = MemoryStore::builder().clock(&clock).shards(1).max_keys(4).on_full(OnFull::Refuse).build();
    let limit = Limit::new(Algorithm::FixedWindow, 10, SEC).unwrap();
    for i in 0..4 {
        store.apply_sync(&format!("k{i}"), &limit, 1).unwrap();
    }
    let err = store.apply_sync("new", &limit, 1).unwrap_err();
    assert_eq!(err, StoreError::Full { max_keys: 4 });
    assert!(err.is_transient());
    assert!(store.apply_sync("k0", &limit, 1).unwrap().allowed, "existing keys keep working");
    clock.advance(Duration::from_secs(2));
    assert!(store.apply_sync("new", &limit, 1).unwrap().allowed, "expired keys make room");
}

#[test]
fn changed_parameters_start_the_key_fresh() {
    let store = MemoryStore::builder().clock(ManualClock::new(0)).build();
    let strict = Limit::new(Algorithm::Gcra { burst: None }, 1, Duration::from_secs(60)).unwrap();
    let loose = Limit::new(Algorithm::Gcra { burst: None }, 2, Duration::from_secs(60)).unwrap();
    assert!(store.apply_sync("k", &strict, 1).unwrap().allowed);
    assert!(!store.apply_sync("k", &strict, 1).unwrap().allowed);
    assert_eq!(store.apply_sync("k", &loose, 0).unwrap().remaining, 2);
}

#[test]
fn the_async_trait_answers_at_once() {
    let store = MemoryStore::builder().clock(ManualClock::new(0)).build();
    let limit = Limit::new(Algorithm::FixedWindow, 1, SEC).unwrap();
    let mut fut = std::pin::pin!(Store::apply(&store, "k", &limit, 1));
    let mut cx = Context::from_waker(Waker::noop());
    match fut.as_mut().poll(&mut cx) {
        Poll::Ready(Ok(d)) => assert!(d.allowed),
        other => panic!("memory store future not ready: {other:?}"),
    }
}

#[test]
fn memory_per_key_is_bounded() {
    let store = MemoryStore::builder().clock(ManualClock::new(0)).build();
    let limit = Limit::new(Algorithm::Gcra { burst: None }, 10, SEC).unwrap();
    for i in 0..100_000 {
        store.apply_sync(&format!("user:{i:08}"), &limit, 1).unwrap();
    }
    let per_key = store.memory_bytes() / store.len();
    // A 64-byte slot (13-byte keys are inline), at a load factor of 2/5 to
    // 4/5 (here 391 keys in each of 256 shards of 512 slots: 84 bytes).
    assert!(per_key <= 64 * 5 / 2, "{per_key} bytes per key");
}
