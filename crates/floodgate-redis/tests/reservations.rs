//! Reservations on Redis and Redis Cluster settle as the memory store's
//! do: random traces of reserves, settles (again, at other amounts,
//! unknown) and ordinary decisions, over every algorithm, two limits a
//! request, with time steps across windows and past the reservations'
//! expiry, get the same answers — the decisions of each reserve, and of
//! each settle what it charged late, gave back, whether the part had
//! expired, and the counter after it. The memory store's answers follow
//! `floodgate_core::reservation`'s rules (unit-tested there); the Lua
//! settle computes them again from the records it keeps.

use std::time::Duration;

use floodgate_core::region::Scope;
use floodgate_core::reservation::{ReservationError, ReservationId, Settled};
use floodgate_core::store::ready_at_once;
use floodgate_core::{Algorithm, Charge, Check, Decision, Limit, ManualClock, MemoryStore, Op, Store, StoreError};
use floodgate_redis::{RedisConfig, RedisStore};
use floodgate_testing::{RedisCluster, RedisServer};
use proptest::prelude::*;

const SEC: u64 = 1_000_000;
const T0: u64 = 1_700_000_000 * SEC;
/// Each reservation's ttls: the first part's short enough that traces pass
/// it; the second's long enough that a settled record is dropped a minute
/// after its settle, before its retention ends.
const TTL: u64 = 3 * SEC;
const TTLS: [u64; 2] = [TTL, 100 * SEC];

fn limits() -> Vec<Limit> {
    let l = |a, n| Limit::new(a, n, Duration::from_secs(2)).unwrap();
    let after = |l: Limit| l.with_charge(Charge::After).unwrap();
    vec![
        l(Algorithm::FixedWindow, 20),
        l(Algorithm::SlidingLog, 20),
        l(Algorithm::SlidingWindow, 20),
        l(Algorithm::SlidingBuckets { granularity: 4 }, 20),
        l(Algorithm::Gcra { burst: Some(10) }, 20),
        l(Algorithm::TokenBucket { burst: None }, 20),
        after(l(Algorithm::FixedWindow, 20)),
        after(l(Algorithm::SlidingWindow, 20)),
        after(l(Algorithm::Gcra { burst: Some(10) }, 20)),
    ]
}

#[derive(Debug, Clone)]
enum Step {
    /// Reserve `a` on the first limit and `b` on the second.
    Reserve { dt: u64, a: u64, b: u64 },
    /// Settle reservation `which` (of those made, modulo) at `a` and `b`
    /// (`one`: one amount for both).
    Settle { dt: u64, which: usize, a: u64, b: u64, one: bool },
    /// An ordinary decision of `hits` on both.
    Decide { dt: u64, hits: u64 },
    /// A settle of a reservation never made.
    Unknown { dt: u64 },
    /// Time passes (30 to 90 s): settled records go a minute after their
    /// settle.
    Wait { dt: u64 },
}

fn step() -> impl Strategy<Value = Step> {
    let dt = 0..2_500_000u64;
    prop_oneof![
        3 => (dt.clone(), 0..12u64, 0..12u64).prop_map(|(dt, a, b)| Step::Reserve { dt, a, b }),
        3 => (dt.clone(), 0..8usize, 0..16u64, 0..16u64, any::<bool>())
            .prop_map(|(dt, which, a, b, one)| Step::Settle { dt, which, a, b, one }),
        2 => (dt.clone(), 0..6u64).prop_map(|(dt, hits)| Step::Decide { dt, hits }),
        1 => dt.prop_map(|dt| Step::Unknown { dt }),
        1 => (30 * SEC..90 * SEC).prop_map(|dt| Step::Wait { dt }),
    ]
}

/// What is compared of a decision.
fn seen(d: &Result<Decision, StoreError>) -> (bool, u64, Option<Duration>, Duration) {
    let d = d.as_ref().expect("the store answers");
    (d.allowed, d.remaining, d.retry_after, d.reset_after)
}

/// Of each part: late, returned, expired, remaining after.
type PartSeen = (u64, u64, bool, u64);

/// What is compared of a settle: again, and each part.
fn settled(r: &Result<Settled, ReservationError>) -> Result<(bool, Vec<PartSeen>), String> {
    match r {
        Ok(s) => Ok((
            s.again,
            s.parts
                .iter()
                .map(|p| {
                    let (late, back) = (p.charged_late, p.returned);
                    (late, back, p.expired, p.decision.as_ref().map_or(u64::MAX, |d| d.remaining))
                })
                .collect(),
        )),
        Err(ReservationError::Conflict { settled }) => Err(format!("conflict {settled:?}")),
        Err(e) => Err(e.to_string()),
    }
}

fn run(redis: &RedisStore, rt: &tokio::runtime::Runtime, case: u64, pair: &[Limit; 2], steps: &[Step]) {
    let clock = std::sync::Arc::new(ManualClock::new(T0));
    let memory = MemoryStore::builder().clock(clock.clone()).build();
    let keys = [format!("r{case}-a"), format!("r{case}-b")];
    let mut now = T0;
    // Each reservation: its id in memory, its id in Redis.
    let mut made: Vec<(ReservationId, ReservationId)> = Vec::new();
    for (i, s) in steps.iter().enumerate() {
        let (dt, hits, op) = match *s {
            Step::Reserve { dt, a, b } => (dt, [a, b], "reserve"),
            Step::Decide { dt, hits } => (dt, [hits, hits], "decide"),
            Step::Settle { dt, .. } | Step::Unknown { dt } => (dt, [0, 0], "settle"),
            Step::Wait { dt } => (dt, [0, 0], "wait"),
        };
        now += dt;
        clock.set(now);
        let checks: Vec<Check<'_>> = (0..2)
            .map(|j| Check {
                key: &keys[j],
                limit: &pair[j],
                hits: hits[j],
                op: Op::Take,
                enforce: true,
                scope: Scope::Region,
            })
            .collect();
        let at = format!("step {i} {s:?} at +{} ms ({}, {})", (now - T0) / 1000, pair[0], pair[1]);
        match (op, s) {
            ("reserve", _) => {
                let (mut m, mut r) = (Vec::new(), Vec::new());
                let mid = ready_at_once(memory.reserve(&checks, &TTLS, &mut m)).map(Result::unwrap);
                let std::task::Poll::Ready(mid) = mid else { unreachable!("the memory store answers at once") };
                let rid = rt.block_on(redis.reserve_at(&checks, &TTLS, Some(now), &mut r)).unwrap();
                let (ms, rs): (Vec<_>, Vec<_>) = (m.iter().map(seen).collect(), r.iter().map(seen).collect());
                assert_eq!(rs, ms, "{at}: reserve's decisions, redis then memory");
                assert_eq!(rid.is_some(), mid.is_some(), "{at}: a reservation kept by one store only");
                if let (Some(m), Some(r)) = (mid, rid) {
                    made.push((m, r));
                }
            }
            ("decide", _) => {
                let (mut m, mut r) = (Vec::new(), Vec::new());
                memory.apply_all_at(&checks, now, &mut m);
                rt.block_on(redis.apply_all_at(&checks, now, &mut r));
                let (ms, rs): (Vec<_>, Vec<_>) = (m.iter().map(seen).collect(), r.iter().map(seen).collect());
                assert_eq!(rs, ms, "{at}: decisions, redis then memory");
            }
            ("wait", _) => {}
            (_, Step::Settle { which, a, b, one, .. }) if !made.is_empty() => {
                let (m, r) = made[which % made.len()];
                let actual: Vec<u64> = if *one { vec![*a] } else { vec![*a, *b] };
                let std::task::Poll::Ready(ms) = ready_at_once(memory.settle(m, &actual)) else {
                    unreachable!("the memory store answers at once")
                };
                let rs = rt.block_on(redis.settle_at(r, &actual, Some(now)));
                // A reservation of one limit (the other's estimate did not
                // take: a peek on a limit charged after the work does) has
                // one part: both stores say so alike.
                assert_eq!(settled(&rs), settled(&ms), "{at}: settle, redis then memory");
            }
            _ => {
                let id = ReservationId(u128::from(now));
                let std::task::Poll::Ready(ms) = ready_at_once(memory.settle(id, &[1])) else { unreachable!() };
                let rs = rt.block_on(redis.settle_at(id, &[1], Some(now)));
                assert_eq!(settled(&rs), settled(&ms), "{at}: an unknown reservation");
            }
        }
    }
}

fn suite(url: &str, cases: u32) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let mut config = RedisConfig::new(url.parse().unwrap());
    config.timeout = Duration::from_secs(2);
    config.cache_denials = false;
    let redis = rt.block_on(async { RedisStore::new(config) }).unwrap();
    let limits = limits();
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(cases),
        ..ProptestConfig::default()
    });
    let case = std::sync::atomic::AtomicU64::new(0);
    runner
        .run(&(prop::collection::vec(step(), 1..30), 0..limits.len(), 0..limits.len()), |(steps, a, b)| {
            let case = case.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let pair = [limits[a].clone(), limits[b].clone()];
            run(&redis, &rt, case, &pair, &steps);
            Ok(())
        })
        .unwrap();
}

#[test]
fn reservations_on_redis_settle_as_in_memory() {
    let server = RedisServer::start();
    suite(&server.url(), 64);
}

#[test]
fn reservations_on_a_redis_cluster_settle_as_in_memory() {
    let cluster = RedisCluster::start();
    suite(&cluster.url(), 24);
}
