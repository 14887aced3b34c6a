//! Every algorithm on one key through the in-memory store, manual clock
//! advancing so calls are (mostly) admitted.
//!
//! Run: `cargo bench -p floodgate-core --bench algorithms`

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use floodgate_core::{Algorithm, LeakyMode, Limit, ManualClock, MemoryStore};

fn algorithms(c: &mut Criterion) {
    let mut g = c.benchmark_group("algorithm_one_key");
    for algorithm in [
        Algorithm::FixedWindow,
        Algorithm::SlidingLog,
        Algorithm::SlidingWindow,
        Algorithm::SlidingBuckets { granularity: 10 },
        Algorithm::TokenBucket { burst: None },
        Algorithm::Gcra { burst: None },
        Algorithm::LeakyBucket { burst: None, mode: LeakyMode::Shape },
    ] {
        let clock = ManualClock::new(1_700_000_000_000_000);
        let store = MemoryStore::builder().clock(&clock).build();
        let limit = Limit::new(algorithm, 1_000, Duration::from_secs(1)).unwrap();
        let name = match algorithm {
            Algorithm::LeakyBucket { .. } => "leaky_bucket_shape".to_owned(),
            a => a.kind().to_string(),
        };
        g.bench_function(name, |b| {
            b.iter(|| {
                clock.advance(Duration::from_millis(1));
                black_box(store.apply_sync(black_box("user:alice"), &limit, 1).unwrap())
            })
        });
    }
    g.finish();
}

criterion_group!(benches, algorithms);
criterion_main!(benches);
