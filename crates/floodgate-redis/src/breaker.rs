//! A circuit breaker: after [`TRIP_AFTER`] failures in a row, calls fail at
//! once (microseconds, not a timeout each) except one probe every
//! [`PROBE_EVERY`]; the first success closes it again.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Consecutive failures that open the breaker.
pub(crate) const TRIP_AFTER: u32 = 3;
/// How often an open breaker lets one call through to probe the server.
pub(crate) const PROBE_EVERY: Duration = Duration::from_millis(500);

#[derive(Debug)]
pub(crate) struct Breaker {
    start: Instant,
    failures: AtomicU32,
    /// 0 while closed; else the time (µs since `start`, at least 1) after
    /// which the next probe may go.
    probe_at: AtomicU64,
    trips: AtomicU64,
}

impl Breaker {
    pub(crate) fn new() -> Self {
        Self {
            start: Instant::now(),
            failures: AtomicU32::new(0),
            probe_at: AtomicU64::new(0),
            trips: AtomicU64::new(0),
        }
    }

    fn now(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_micros()).unwrap_or(u64::MAX).max(1)
    }

    /// Whether a call may go to the server now: always while closed; while
    /// open, one caller per [`PROBE_EVERY`].
    pub(crate) fn permit(&self) -> bool {
        let at = self.probe_at.load(Ordering::Acquire);
        if at == 0 {
            return true;
        }
        let now = self.now();
        now >= at
            && self
                .probe_at
                .compare_exchange(at, now + micros(PROBE_EVERY), Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
    }

    pub(crate) fn success(&self) {
        // Loads first: the common case (closed, no failures) writes nothing.
        if self.failures.load(Ordering::Relaxed) != 0 {
            self.failures.store(0, Ordering::Relaxed);
        }
        if self.probe_at.load(Ordering::Relaxed) != 0 {
            self.probe_at.store(0, Ordering::Release);
            tracing::info!("Redis answers again: circuit breaker closed");
        }
    }

    /// A call failed; true when this opened the breaker.
    pub(crate) fn failure(&self) -> bool {
        let n = self.failures.fetch_add(1, Ordering::Relaxed).saturating_add(1);
        if n >= TRIP_AFTER {
            let next = self.now() + micros(PROBE_EVERY);
            if self.probe_at.swap(next, Ordering::AcqRel) == 0 {
                self.trips.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(failures = n, "Redis failing: circuit breaker open, probing every {PROBE_EVERY:?}");
                return true;
            }
        }
        false
    }

    pub(crate) fn is_open(&self) -> bool {
        self.probe_at.load(Ordering::Acquire) != 0
    }

    pub(crate) fn trips(&self) -> u64 {
        self.trips.load(Ordering::Relaxed)
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_failures_and_lets_one_probe_through() {
        let b = Breaker::new();
        for _ in 0..TRIP_AFTER - 1 {
            assert!(!b.failure());
            assert!(b.permit() && !b.is_open());
        }
        assert!(b.failure(), "this one opened it");
        assert!(!b.failure(), "already open");
        assert!(b.is_open() && !b.permit(), "open: calls fail fast");
        b.probe_at.store(1, Ordering::Release); // the probe is due
        assert!(b.permit(), "one probe");
        assert!(!b.permit(), "only one");
        b.success();
        assert!(!b.is_open() && b.permit());
        assert_eq!(b.trips(), 1);
    }
}
