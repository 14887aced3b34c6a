//! `floodgate simulate`'s input lines, replayed through every algorithm as
//! `simulate --report` does: never a panic, and no decision reports more
//! remaining than its limit can hold (its burst; the shaper: one in service
//! and its burst queued).
#![no_main]

use std::time::Duration;

use floodgate::trace::{TraceError, for_each_event};
use floodgate_core::{Algorithm, LeakyMode, Limit, ManualClock, MemoryStore};
use libfuzzer_sys::fuzz_target;

fn limits() -> Vec<Limit> {
    let mut out = Vec::new();
    for (limit, window) in [(3, Duration::from_millis(10)), (1_000, Duration::from_secs(3_600))] {
        for a in [
            Algorithm::SlidingLog,
            Algorithm::FixedWindow,
            Algorithm::SlidingWindow,
            Algorithm::SlidingBuckets { granularity: 10 },
            Algorithm::TokenBucket { burst: Some(5) },
            Algorithm::Gcra { burst: None },
            Algorithm::LeakyBucket { burst: Some(2), mode: LeakyMode::Meter },
            Algorithm::LeakyBucket { burst: None, mode: LeakyMode::Shape },
        ] {
            out.push(Limit::new(a, limit, window).expect("a valid limit"));
        }
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let limits = limits();
    let stores: Vec<MemoryStore<ManualClock>> =
        limits.iter().map(|_| MemoryStore::builder().clock(ManualClock::new(0)).max_keys(1 << 16).build()).collect();
    let _ = for_each_event(data, |ev| {
        let now = ev.at_ms.saturating_mul(1_000);
        for (limit, store) in limits.iter().zip(&stores) {
            if let Ok(d) = store.apply_at(&ev.key, limit, ev.hits, now) {
                let shaper = matches!(limit.algorithm(), Algorithm::LeakyBucket { mode: LeakyMode::Shape, .. });
                let most = limit.limit().max(limit.burst() + u64::from(shaper));
                assert!(d.remaining <= most, "{limit:?} {ev:?} {d:?}");
            }
        }
        Ok::<(), TraceError>(())
    });
});
