//! A concurrency lease against a plain decision, on the memory store
//! (issue 49: an acquire plus its release should cost at most two
//! decisions): one check per request over 10 000 keys. The decision is a
//! fixed window that never fills; the lease is a concurrency limit of 64
//! with each key holding 8 leases already (a busy backend's tenants), so
//! every acquire and release scans a real lease list. The clock moves
//! 100 µs a request.
//!
//! Run: `cargo bench -p floodgate-core --bench leases`

use std::hint::black_box;
use std::task::Poll;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use floodgate_core::region::Scope;
use floodgate_core::store::ready_at_once;
use floodgate_core::{Algorithm, Check, Limit, ManualClock, MemoryStore, Op, Store};

fn now<T>(p: Poll<T>) -> T {
    match p {
        Poll::Ready(v) => v,
        Poll::Pending => unreachable!("the memory store answers at once"),
    }
}

fn leases(c: &mut Criterion) {
    let clock = std::sync::Arc::new(ManualClock::new(1_000_000));
    let store = MemoryStore::builder().clock(std::sync::Arc::clone(&clock)).build();
    let tick = || clock.advance(Duration::from_micros(100));
    let rate = Limit::new(Algorithm::FixedWindow, 1 << 50, Duration::from_secs(3600)).unwrap();
    let slots = Limit::new(Algorithm::Concurrency, 64, Duration::from_secs(3600)).unwrap();
    let keys: Vec<String> = (0..10_000).map(|i| format!("7:backend|6:tenant{i}")).collect();
    let check = |key, limit, op| Check { key, limit, hits: 1, op, enforce: true, scope: Scope::Region };
    let mut out = Vec::with_capacity(1);
    // Eight leases held per key.
    for (k, key) in keys.iter().enumerate() {
        for j in 0..8u64 {
            let lease = (k as u64) << 8 | (j + 1);
            now(ready_at_once(store.apply_all(&[check(key, &slots, Op::Acquire { lease })], &mut out)));
        }
    }
    let mut g = c.benchmark_group("leases");
    let mut i = 0usize;
    g.bench_function("decision", |b| {
        b.iter(|| {
            i = (i + 1) % keys.len();
            tick();
            now(ready_at_once(store.apply_all(&[check(&keys[i], &rate, Op::Take)], &mut out)));
            black_box(&out);
        })
    });
    let mut lease = 1u64 << 40;
    g.bench_function("acquire_and_release", |b| {
        b.iter(|| {
            i = (i + 1) % keys.len();
            lease += 1;
            tick();
            now(ready_at_once(store.apply_all(&[check(&keys[i], &slots, Op::Acquire { lease })], &mut out)));
            debug_assert!(out[0].as_ref().unwrap().allowed);
            now(ready_at_once(
                store.apply_all(&[check(&keys[i], &slots, Op::Release { lease: Some(lease) })], &mut out),
            ));
            black_box(&out);
        })
    });
    g.finish();
}

criterion_group!(benches, leases);
criterion_main!(benches);
