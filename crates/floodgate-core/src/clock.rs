//! Time sources. Every decision takes `now` as integer microseconds since the
//! Unix epoch; algorithms never read a clock themselves.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// A source of the current time in microseconds since the Unix epoch.
pub trait Clock: Send + Sync {
    /// Now, in whole microseconds since the Unix epoch.
    fn now_us(&self) -> u64;
}

/// The system clock: wall time read once at creation plus a monotonic
/// [`Instant`] since, so it is epoch-aligned (windows line up across
/// processes and with Redis `TIME`) and never steps back.
#[derive(Debug, Clone, Copy)]
pub struct SystemClock {
    start_wall_us: u64,
    start: Instant,
}

impl SystemClock {
    /// Read the wall clock once and anchor the monotonic clock to it.
    pub fn new() -> Self {
        let start = Instant::now();
        let wall = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO);
        Self { start_wall_us: micros(wall), start }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    #[inline]
    fn now_us(&self) -> u64 {
        self.start_wall_us.saturating_add(micros(self.start.elapsed()))
    }
}

/// A clock that only moves when told to: for tests, benchmarks and replaying
/// traces (`floodgate simulate`).
///
/// ```
/// use floodgate_core::{Clock, ManualClock};
/// use std::time::Duration;
/// let clock = ManualClock::new(1_000);
/// clock.advance(Duration::from_millis(2));
/// assert_eq!(clock.now_us(), 3_000);
/// ```
#[derive(Debug, Default)]
pub struct ManualClock(AtomicU64);

impl ManualClock {
    /// A clock reading `now_us` microseconds since the epoch.
    pub fn new(now_us: u64) -> Self {
        Self(AtomicU64::new(now_us))
    }

    /// Set the time (it may go backwards; stores read a step back as the
    /// last time each key saw).
    pub fn set(&self, now_us: u64) {
        self.0.store(now_us, Ordering::Relaxed);
    }

    /// Move the time forward by `by` (rounded down to whole microseconds).
    pub fn advance(&self, by: Duration) {
        self.0.fetch_add(micros(by), Ordering::Relaxed);
    }
}

impl Clock for ManualClock {
    #[inline]
    fn now_us(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    #[inline]
    fn now_us(&self) -> u64 {
        (**self).now_us()
    }
}

impl<C: Clock + ?Sized> Clock for &C {
    #[inline]
    fn now_us(&self) -> u64 {
        (**self).now_us()
    }
}

/// Whole microseconds in `d`, saturating.
pub(crate) fn micros(d: Duration) -> u64 {
    // Whole seconds and sub-second micros: no 128-bit arithmetic (this runs
    // on every decision's clock read).
    d.as_secs().saturating_mul(1_000_000).saturating_add(u64::from(d.subsec_micros()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn system_clock_is_epoch_aligned_and_monotonic() {
        let c = SystemClock::new();
        let a = c.now_us();
        let b = c.now_us();
        assert!(b >= a);
        // After 2020-01-01 and before 2200.
        assert!(a > 1_577_836_800_000_000 && a < 7_258_118_400_000_000);
    }

    #[test]
    fn micros_round_down_and_saturate() {
        assert_eq!(micros(Duration::new(5, 999)), 5_000_000);
        assert_eq!(micros(Duration::new(5, 1_999)), 5_000_001);
        assert_eq!(micros(Duration::new(0, 999_999_999)), 999_999);
        assert_eq!(micros(Duration::from_secs(u64::MAX / 1_000_000)), u64::MAX / 1_000_000 * 1_000_000);
        assert_eq!(micros(Duration::MAX), u64::MAX);
        assert_eq!(micros(Duration::new(u64::MAX / 1_000_000, 999_999_999)), u64::MAX);
    }
}
