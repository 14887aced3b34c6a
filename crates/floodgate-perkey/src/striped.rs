//! A counter every deciding thread adds to without sharing a cache line.
//!
//! Why: a hit counter that every lookup adds to is one cache line written
//! by every thread; on two cores each add takes the line from the other
//! core first (measured: tens of nanoseconds a lookup, more than the rest
//! of a front hit). Here each thread adds to its own stripe, and a reader
//! (the metrics, a test) sums them.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

/// Stripes of a counter: threads beyond this many share one (by the order
/// they first counted), which costs speed, never a count.
const STRIPES: usize = 16;

/// A counter of stripes (see the module's documentation).
#[derive(Default)]
pub struct Striped([Padded<AtomicU64>; STRIPES]);

/// A value alone on its cache lines (128 bytes: the adjacent-line
/// prefetcher pairs lines): a counter's stripe, a lock of a stripe of keys.
#[derive(Default)]
#[repr(align(128))]
pub(crate) struct Padded<T>(pub(crate) T);

/// Gives each thread its stripe, in the order threads first count.
static NEXT: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static MINE: usize = NEXT.fetch_add(1, Relaxed) % STRIPES;
}

impl Striped {
    /// Add `n` (on this thread's stripe).
    pub fn add(&self, n: u64) {
        let i = MINE.with(|i| *i);
        self.0[i].0.fetch_add(n, Relaxed);
    }

    /// The count: every stripe's, summed (adds racing the read may or may
    /// not be in it).
    pub fn get(&self) -> u64 {
        self.0.iter().map(|s| s.0.load(Relaxed)).fold(0, u64::wrapping_add)
    }
}

impl std::fmt::Debug for Striped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.get())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adds_from_many_threads_sum_exactly() {
        let c = Striped::default();
        std::thread::scope(|s| {
            for _ in 0..(STRIPES + 3) {
                s.spawn(|| {
                    for _ in 0..10_000 {
                        c.add(1);
                    }
                });
            }
        });
        c.add(5);
        assert_eq!(c.get(), (STRIPES as u64 + 3) * 10_000 + 5);
    }
}
