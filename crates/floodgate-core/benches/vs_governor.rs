//! floodgate's in-memory store beside governor's keyed rate limiter, in the
//! same criterion groups, on the same keys, both on manual clocks.
//!
//! Both limit 1000 requests per second per key with a burst of 1000 (GCRA
//! for floodgate, governor's own GCRA). "allowed": both clocks advance 1 ms
//! per call, so every call is admitted; "denied": the clocks stand still
//! after the burst, so every call is refused. floodgate computes the full
//! decision (remaining, reset, retry) on every call; governor only
//! allowed/not-until.
//!
//! Run: `cargo bench -p floodgate-core --bench vs_governor`

use std::hint::black_box;
use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use floodgate_core::{Algorithm, Limit, ManualClock, MemoryStore};
use governor::clock::FakeRelativeClock;
use governor::{Quota, RateLimiter};

const RATE: u32 = 1_000;
const KEYS: usize = 1_000_000;

fn floodgate() -> (MemoryStore<&'static ManualClock>, &'static ManualClock, Limit) {
    let clock: &'static ManualClock = Box::leak(Box::new(ManualClock::new(1_700_000_000_000_000)));
    let store = MemoryStore::builder().clock(clock).max_keys(2 * KEYS).build();
    let limit = Limit::new(Algorithm::Gcra { burst: None }, u64::from(RATE), Duration::from_secs(1)).unwrap();
    (store, clock, limit)
}

type Governor = RateLimiter<
    String,
    governor::state::keyed::DashMapStateStore<String>,
    FakeRelativeClock,
    governor::middleware::NoOpMiddleware<governor::nanos::Nanos>,
>;

fn governor() -> (Governor, FakeRelativeClock) {
    let clock = FakeRelativeClock::default();
    let quota = Quota::per_second(NonZeroU32::new(RATE).unwrap());
    (RateLimiter::dashmap_with_clock(quota, clock.clone()), clock)
}

/// xorshift64: the same pseudo-random key sequence for both limiters.
fn next(x: &mut u64) -> usize {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    usize::try_from(*x % KEYS as u64).unwrap()
}

fn one_key(c: &mut Criterion) {
    let mut g = c.benchmark_group("one_key");
    let key = String::from("user:alice");
    let (store, fclock, limit) = floodgate();
    g.bench_function("floodgate/allowed", |b| {
        b.iter(|| {
            fclock.advance(Duration::from_millis(1));
            black_box(store.apply_sync(black_box(&key), &limit, 1).unwrap())
        })
    });
    let (gov, gclock) = governor();
    g.bench_function("governor/allowed", |b| {
        b.iter(|| {
            gclock.advance(Duration::from_millis(1));
            black_box(gov.check_key(black_box(&key)).is_ok())
        })
    });
    let (store, _, limit) = floodgate();
    g.bench_function("floodgate/denied", |b| {
        b.iter(|| black_box(store.apply_sync(black_box(&key), &limit, 1).unwrap()))
    });
    let (gov, _) = governor();
    g.bench_function("governor/denied", |b| b.iter(|| black_box(gov.check_key(black_box(&key)).is_ok())));
    g.finish();
}

fn million_keys(c: &mut Criterion) {
    let keys: Vec<String> = (0..KEYS).map(|i| format!("ip:10.{}.{}.{}", i >> 16, (i >> 8) & 255, i & 255)).collect();
    let mut g = c.benchmark_group("keys_1m_random");
    let (store, fclock, limit) = floodgate();
    for k in &keys {
        store.apply_sync(k, &limit, 1).unwrap();
    }
    let mut x = 88_172_645_463_325_252u64;
    g.bench_function("floodgate", |b| {
        b.iter(|| {
            fclock.advance(Duration::from_micros(1));
            black_box(store.apply_sync(black_box(&keys[next(&mut x)]), &limit, 1).unwrap())
        })
    });
    drop(store);
    let (gov, gclock) = governor();
    for k in &keys {
        let _ = gov.check_key(k);
    }
    let mut x = 88_172_645_463_325_252u64;
    g.bench_function("governor", |b| {
        b.iter(|| {
            gclock.advance(Duration::from_micros(1));
            black_box(gov.check_key(black_box(&keys[next(&mut x)])).is_ok())
        })
    });
    g.finish();
}

/// Run `call` `iters` times split over two threads; the wall time is the
/// time per call over both threads together (aggregate throughput).
fn on_two_threads(iters: u64, call: impl Fn() + Sync) -> Duration {
    let start = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| (0..iters / 2).for_each(|_| call()));
        }
    });
    start.elapsed()
}

/// Two threads hammering one key.
fn two_threads_one_key(c: &mut Criterion) {
    let mut g = c.benchmark_group("two_threads_one_key");
    let key = String::from("user:alice");
    let (store, fclock, limit) = floodgate();
    g.bench_function("floodgate", |b| {
        b.iter_custom(|iters| {
            on_two_threads(iters, || {
                fclock.advance(Duration::from_millis(1));
                black_box(store.apply_sync(&key, &limit, 1).unwrap());
            })
        })
    });
    let (gov, gclock) = governor();
    g.bench_function("governor", |b| {
        b.iter_custom(|iters| {
            on_two_threads(iters, || {
                gclock.advance(Duration::from_millis(1));
                black_box(gov.check_key(&key).is_ok());
            })
        })
    });
    g.finish();
}

criterion_group!(benches, one_key, million_keys, two_threads_one_key);
criterion_main!(benches);
