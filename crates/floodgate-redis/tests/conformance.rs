//! One conformance suite, run unchanged over the in-memory store, one Redis
//! server and a Redis Cluster: random traces of multi-limit requests (every
//! algorithm, edge-sized limits and windows, weighted hits, peeks, shadow
//! limits, refunds, limits charged after the work (late charges into debt,
//! gates), concurrency limits (leases acquired, released by id or the
//! earliest, extended, expiring; anonymous slots), repeated keys, a clock
//! that steps back) must get exactly
//! the decisions of a reference model built from the pure algorithms.

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use floodgate_core::{
    Algorithm, Charge, Check, Decision, LeakyMode, Limit, MAX_LIMIT, MemoryStore, Op, State, StoreError,
};
use floodgate_redis::{RedisConfig, RedisStore, join_all};
use floodgate_testing::{RedisCluster, RedisServer};

type Out = Vec<Result<Decision, StoreError>>;

/// A store under test, deciding at a given time.
trait AtStore {
    fn decide(&self, checks: &[Check<'_>], now_us: u64, out: &mut Out) -> impl Future<Output = ()>;
}

impl AtStore for MemoryStore {
    async fn decide(&self, checks: &[Check<'_>], now_us: u64, out: &mut Out) {
        self.apply_all_at(checks, now_us, out);
    }
}

impl AtStore for RedisStore {
    async fn decide(&self, checks: &[Check<'_>], now_us: u64, out: &mut Out) {
        self.apply_all_at(checks, now_us, out).await;
    }
}

/// The reference: the pure algorithms on one state per (key, limit), all or
/// nothing by immediate refunds; a peek or a denial of a key that has no
/// state creates none (what it would create is the empty state, but after
/// a clock step back the two differ, and no store keeps it).
#[derive(Default)]
struct Model(HashMap<(String, u32), State>);

impl Model {
    fn decide(&mut self, checks: &[Check<'_>], now: u64) -> Vec<Decision> {
        let mut out = Vec::new();
        for c in checks {
            let id = (c.key.to_owned(), c.limit.fingerprint());
            let existed = self.0.contains_key(&id);
            let s = self.0.entry(id.clone()).or_default();
            let d = match c.op {
                Op::Take => c.limit.apply(s, now, c.hits),
                Op::Refund => c.limit.give_back(s, now, c.hits),
                Op::Late => c.limit.charge_late(s, now, c.hits),
                Op::Return { taken_at_us } => {
                    c.limit.refund(s, taken_at_us, now, c.hits);
                    c.limit.give_back(s, now, 0)
                }
                Op::Acquire { lease } => c.limit.acquire(s, now, c.hits, lease),
                Op::Release { lease } => c.limit.release(s, now, lease),
                Op::Extend { lease } => c.limit.extend(s, now, lease),
            };
            let no_take = matches!(c.op, Op::Refund | Op::Return { .. } | Op::Release { .. } | Op::Extend { .. });
            if !existed && (!d.allowed || c.hits == 0 || no_take) {
                self.0.remove(&id);
            }
            out.push(d);
        }
        if checks.iter().zip(&out).any(|(c, d)| c.enforce && !d.allowed) {
            // Newest first; a lease acquired by id is released.
            for (c, d) in checks.iter().zip(&out).rev() {
                if d.allowed && c.takes_back_on_denial() {
                    let s = self.0.get_mut(&(c.key.to_owned(), c.limit.fingerprint())).unwrap();
                    match c.op {
                        Op::Acquire { lease } if lease != 0 && c.op.on_leases(c.limit) => {
                            c.limit.release(s, now, Some(lease));
                        }
                        _ => c.limit.refund(s, now, now, c.hits),
                    }
                }
            }
        }
        out
    }
}

const SEC: u64 = 1_000_000;
const YEAR: u64 = 365 * 86_400 * SEC;

fn limits() -> Vec<Limit> {
    let l = |a, n, w| Limit::new(a, n, Duration::from_micros(w)).unwrap();
    vec![
        l(Algorithm::FixedWindow, 5, SEC),
        l(Algorithm::FixedWindow, MAX_LIMIT, YEAR),
        l(Algorithm::SlidingLog, 4, SEC),
        l(Algorithm::SlidingLog, 3, 1_000),
        l(Algorithm::SlidingWindow, 6, SEC),
        l(Algorithm::SlidingWindow, MAX_LIMIT - 2, YEAR),
        l(Algorithm::SlidingWindow, 1_000_003, 7_000),
        l(Algorithm::SlidingBuckets { granularity: 4 }, 5, SEC),
        l(Algorithm::SlidingBuckets { granularity: 3_600 }, 100, 3_600 * SEC),
        l(Algorithm::Gcra { burst: Some(3) }, 7, SEC),
        l(Algorithm::Gcra { burst: None }, 3, SEC),
        l(Algorithm::Gcra { burst: Some(MAX_LIMIT) }, MAX_LIMIT, YEAR),
        l(Algorithm::TokenBucket { burst: Some(1_000_000_007) }, 999_999_937, 86_400 * SEC),
        l(Algorithm::LeakyBucket { burst: Some(2), mode: LeakyMode::Meter }, 3, 1_000),
        l(Algorithm::LeakyBucket { burst: Some(2), mode: LeakyMode::Shape }, 2, SEC),
        l(Algorithm::LeakyBucket { burst: None, mode: LeakyMode::Shape }, MAX_LIMIT - 1, YEAR),
        l(Algorithm::FixedWindow, 0, SEC),
        // Charged after the work: late charges into debt, gates (hits 0).
        after(l(Algorithm::FixedWindow, 5, SEC)),
        after(l(Algorithm::FixedWindow, MAX_LIMIT, YEAR)),
        after(l(Algorithm::SlidingLog, 4, SEC)),
        after(l(Algorithm::SlidingWindow, 6, SEC)),
        after(l(Algorithm::SlidingBuckets { granularity: 4 }, 5, SEC)),
        after(l(Algorithm::Gcra { burst: Some(3) }, 7, SEC)),
        after(l(Algorithm::Gcra { burst: Some(MAX_LIMIT) }, MAX_LIMIT, YEAR)),
        after(l(Algorithm::TokenBucket { burst: Some(1_000_000_007) }, 999_999_937, 86_400 * SEC)),
        after(l(Algorithm::LeakyBucket { burst: Some(2), mode: LeakyMode::Meter }, 3, 1_000)),
        after(l(Algorithm::FixedWindow, 0, SEC)),
        // Concurrency: leases of a second, a millisecond, ten seconds, a day.
        l(Algorithm::Concurrency, 3, SEC),
        l(Algorithm::Concurrency, 1, 1_000),
        l(Algorithm::Concurrency, 2, 10 * SEC),
        l(Algorithm::Concurrency, 100_000, 86_400 * SEC),
    ]
}

fn after(l: Limit) -> Limit {
    l.with_charge(Charge::After).unwrap()
}

/// xorshift64*: the same trace for every store.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Run `traces` random traces of `steps` requests through `store`, each
/// against a fresh model, and compare every decision. The traces run
/// concurrently (each one in order, on keys of its own), so a store that
/// batches concurrent requests into one call (one Redis server) decides
/// requests of different traces, at different times, together.
/// `CONFORMANCE_TRACES=N` multiplies the number of traces by N.
async fn conformance(store: &impl AtStore, name: &str, traces: u64, steps: usize) {
    let scale: u64 = std::env::var("CONFORMANCE_TRACES").ok().and_then(|s| s.parse().ok()).unwrap_or(1);
    let limits = limits();
    join_all((1..=traces * scale).map(|seed| trace(store, name, &limits, seed, steps)).collect()).await;
}

/// One trace of [`conformance`].
async fn trace(store: &impl AtStore, name: &str, limits: &[Limit], seed: u64, steps: usize) {
    {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let mut model = Model::default();
        // Keys unique to this run, so traces never share state; one limit
        // per key, as rules give (a store may restart a key whose limit
        // changed).
        let keys: Vec<Vec<String>> =
            (0..3).map(|k| (0..limits.len()).map(|l| format!("{name}/{seed}/k{k}/l{l}")).collect()).collect();
        let mut now = 1_763_000_000 * SEC + rng.below(YEAR);
        for step in 0..steps {
            now = match rng.below(20) {
                0 => now.saturating_sub(rng.below(2 * SEC)), // the clock steps back
                1..=5 => now,
                6..=10 => now + rng.below(1_000),
                11..=15 => now + rng.below(SEC),
                16..=18 => now + rng.below(10 * SEC),
                _ => now + rng.below(YEAR / 4),
            };
            let n = 1 + rng.below(3) as usize;
            let picks: Vec<(usize, usize, u64, bool, Op)> = (0..n)
                .map(|_| {
                    let li = rng.below(limits.len() as u64) as usize;
                    let ki = rng.below(keys.len() as u64) as usize;
                    let cap = limits[li].limit().max(limits[li].burst());
                    let hits = match rng.below(12) {
                        0 => 0,
                        1 => 2,
                        2 => cap,
                        3 => cap.saturating_add(1),
                        4 => u64::MAX,
                        5 => rng.below(cap.max(1)),
                        _ => 1,
                    };
                    // Lease ids from a few, so that leases are extended,
                    // released twice and acquired again.
                    let lease = 1 + rng.below(4);
                    let op = match rng.below(if limits[li].is_concurrency() { 26 } else { 16 }) {
                        0 | 1 => Op::Refund,
                        2 => Op::Late,
                        3 => Op::Return { taken_at_us: now.saturating_sub(rng.below(2 * SEC)) },
                        16..=19 => Op::Acquire { lease },
                        20 | 21 => Op::Release { lease: Some(lease) },
                        22 => Op::Release { lease: None },
                        23 | 24 => Op::Extend { lease },
                        25 => Op::Acquire { lease: 0 },
                        _ => Op::Take,
                    };
                    (li, ki, hits, rng.below(5) != 0, op)
                })
                .collect();
            let checks: Vec<Check<'_>> = picks
                .iter()
                .map(|&(li, ki, hits, enforce, op)| Check {
                    key: &keys[ki][li],
                    limit: &limits[li],
                    hits,
                    op,
                    enforce,
                    scope: floodgate_core::region::Scope::Region,
                })
                .collect();
            let want = model.decide(&checks, now);
            let mut got = Vec::new();
            store.decide(&checks, now, &mut got).await;
            let got: Vec<Decision> = got.into_iter().map(|r| r.unwrap_or_else(|e| panic!("{name}: {e}"))).collect();
            if std::env::var_os("FG_TRACE").is_some() {
                for (c, d) in checks.iter().zip(&got) {
                    eprintln!(
                        "{step} @{now} {} {:?} {:?} hits {} enforce {} -> {} rem {} reset {:?} retry {:?}",
                        c.key,
                        c.limit.algorithm(),
                        c.op,
                        c.hits,
                        c.enforce,
                        d.allowed,
                        d.remaining,
                        d.reset_after,
                        d.retry_after
                    );
                }
            }
            if got != want {
                let desc: Vec<String> = checks
                    .iter()
                    .map(|c| {
                        format!(
                            "{} {:?} limit {} window {:?} {:?} hits {} enforce {}",
                            c.key,
                            c.limit.algorithm(),
                            c.limit.limit(),
                            c.limit.window(),
                            c.op,
                            c.hits,
                            c.enforce
                        )
                    })
                    .collect();
                panic!(
                    "{name}: trace {seed} step {step} at {now}:\n  checks {desc:#?}\n  want {want:#?}\n  got {got:#?}"
                );
            }
        }
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

/// A Redis store for the suite: a generous timeout, because the suite
/// checks decisions, not latency, and its concurrent traces share two
/// cores with the servers (and, in CI, with other tests).
fn conformance_store(url: &str) -> RedisStore {
    let mut config = RedisConfig::new(url.parse().unwrap());
    config.timeout = Duration::from_secs(5);
    RedisStore::new(config).unwrap()
}

#[test]
fn memory_store_conforms() {
    runtime().block_on(conformance(&MemoryStore::new(), "memory", 40, 300));
}

#[test]
fn redis_store_conforms() {
    let server = RedisServer::start();
    let rt = runtime();
    let store = conformance_store(&server.url());
    rt.block_on(conformance(&store, "redis", 40, 300));
    let stats = store.stats();
    assert!(stats.calls * 4 <= 40 * 300, "concurrent requests were batched: {stats:?}");
}

#[test]
fn redis_cluster_store_conforms() {
    let cluster = RedisCluster::start();
    let rt = runtime();
    let store = conformance_store(&cluster.url());
    rt.block_on(conformance(&store, "cluster", 20, 300));
    let stats = store.stats();
    assert!(stats.cross_slot_refunds > 0, "the traces spread requests over slots and some were refunded: {stats:?}");
}
