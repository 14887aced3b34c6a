//! A reservation against a plain decision, on the memory store (issue 47:
//! a reserve plus its settle should cost at most two decisions): one check
//! per request over 10 000 keys, a fixed window that never fills. The
//! store's clock moves 100 µs a request (10 000 a second: records are
//! retained as they would be at that rate, and the ledger never fills).
//!
//! Run: `cargo bench -p floodgate-core --bench reservation`

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

fn reservation(c: &mut Criterion) {
    let clock = std::sync::Arc::new(ManualClock::new(1_000_000));
    let store = MemoryStore::builder().clock(std::sync::Arc::clone(&clock)).build();
    let tick = || clock.advance(Duration::from_micros(100));
    let limit = Limit::new(Algorithm::FixedWindow, 1 << 50, Duration::from_secs(3600)).unwrap();
    let keys: Vec<String> = (0..10_000).map(|i| format!("3:llm|6:tenant{i}")).collect();
    let checks: Vec<Check<'_>> = keys
        .iter()
        .map(|key| Check { key, limit: &limit, hits: 100, op: Op::Take, enforce: true, scope: Scope::Region })
        .collect();
    let ttl = [std::env::var("TTL_US").ok().and_then(|v| v.parse().ok()).unwrap_or(300_000_000u64)];
    let mut g = c.benchmark_group("reservation");
    let mut out = Vec::with_capacity(1);
    let mut i = 0usize;
    g.bench_function("decision", |b| {
        b.iter(|| {
            i = (i + 1) % keys.len();
            tick();
            now(ready_at_once(store.apply_all(&checks[i..=i], &mut out)));
            black_box(&out);
        })
    });
    for (name, actual) in [("reserve_and_settle_below", 60u64), ("reserve_and_settle_above", 130)] {
        g.bench_function(name, |b| {
            b.iter(|| {
                i = (i + 1) % keys.len();
                tick();
                let id = now(ready_at_once(store.reserve(&checks[i..=i], &ttl, &mut out))).unwrap().unwrap();
                black_box(now(ready_at_once(store.settle(id, &[actual]))).unwrap());
            })
        });
    }
    g.finish();
}

criterion_group!(benches, reservation);
criterion_main!(benches);
