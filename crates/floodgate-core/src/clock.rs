//! Time sources. Every decision takes `now` as integer microseconds since the
//! Unix epoch; algorithms never read a clock themselves.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// A source of the current time in microseconds since the Unix epoch.
pub trait Clock: Send + Sync {
    /// Now, in whole microseconds since the Unix epoch.
    fn now_us(&self) -> u64;
}

/// The system clock: wall time read once at creation plus the monotonic time
/// since, so it is epoch-aligned (windows line up across processes and with
/// Redis `TIME`) and never steps back on a thread.
///
/// The monotonic time is `CLOCK_MONOTONIC` ([`Instant`]) interpolated by the
/// CPU's counter (the invariant TSC on x86-64, through `quanta`, calibrated
/// against `Instant` once per process): a vDSO `clock_gettime` costs ~25 ns
/// on a VM, a counter read ~10 ns, and every decision reads the clock. Each
/// thread re-reads `Instant` at least once per millisecond of counter time
/// (and whenever the counter reads lower than its last anchor, as on another
/// socket), so the calibration's error (a few parts per million) never
/// accumulates past nanoseconds. Where the CPU has no usable counter, quanta
/// reads `CLOCK_MONOTONIC` itself.
#[derive(Debug, Clone, Copy)]
pub struct SystemClock {
    start_wall_us: u64,
    start_ns: u64,
    monotonic: &'static Monotonic,
}

impl SystemClock {
    /// Read the wall clock once and anchor the monotonic clock to it. (The
    /// first clock of a process calibrates the counter: under a millisecond.)
    pub fn new() -> Self {
        let monotonic = Monotonic::get();
        let start_ns = monotonic.now_ns();
        let wall = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO);
        Self { start_wall_us: micros(wall), start_ns, monotonic }
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
        let since = self.monotonic.now_ns().saturating_sub(self.start_ns);
        self.start_wall_us.saturating_add(since / 1_000)
    }
}

/// The process's monotonic time: nanoseconds since `origin`, read from the
/// CPU counter between a thread's anchors on [`Instant`].
#[derive(Debug)]
pub(crate) struct Monotonic {
    counter: quanta::Clock,
    origin: Instant,
}

/// At most this much counter time between a thread's reads of [`Instant`].
const REANCHOR_NS: u64 = 1_000_000;

/// A thread's last reading of [`Instant`] and of the counter at the same
/// moment, and the last time it returned (never returns less).
#[derive(Clone, Copy)]
struct Anchor {
    raw: u64,
    ns: u64,
    last: u64,
}

thread_local! {
    static ANCHOR: Cell<Anchor> = const { Cell::new(Anchor { raw: 0, ns: 0, last: 0 }) };
}

impl Monotonic {
    /// The process's one instance (calibrating the counter costs a fraction
    /// of a millisecond, and each new `quanta::Clock` a `CPUID`: a VM exit).
    fn get() -> &'static Monotonic {
        static ONE: OnceLock<Monotonic> = OnceLock::new();
        ONE.get_or_init(|| Monotonic { counter: quanta::Clock::new(), origin: Instant::now() })
    }

    /// Nanoseconds since `origin`; never less than this thread's last.
    #[inline]
    fn now_ns(&self) -> u64 {
        let raw = self.counter.raw();
        let a = ANCHOR.get();
        if raw > a.raw {
            let since = self.counter.delta_as_nanos(a.raw, raw);
            if since < REANCHOR_NS {
                let ns = (a.ns + since).max(a.last);
                ANCHOR.set(Anchor { last: ns, ..a });
                return ns;
            }
        }
        self.reanchor(a.last)
    }

    /// Read [`Instant`] and the counter afresh for this thread.
    #[cold]
    fn reanchor(&self, last: u64) -> u64 {
        let raw = self.counter.raw();
        let ns = u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let out = ns.max(last);
        ANCHOR.set(Anchor { raw, ns, last: out });
        out
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
    fn system_clock_keeps_to_instant_across_reanchors() {
        // Sleeps and busy spans both longer and shorter than the re-anchor
        // interval: the clock's elapsed time stays within `Instant`'s, to the
        // microseconds' rounding.
        // Every read is bracketed by two `Instant`s, so a preempted read
        // widens the bounds instead of failing them.
        let c = SystemClock::new();
        let (i0_before, c0, i0_after) = (Instant::now(), c.now_us(), Instant::now());
        for step in 0..12u32 {
            if step % 2 == 0 {
                std::thread::sleep(Duration::from_micros(300 + 700 * u64::from(step)));
            } else {
                let until = Instant::now() + Duration::from_micros(400 * u64::from(step));
                while Instant::now() < until {}
            }
            let before = micros(i0_after.elapsed());
            let clock = c.now_us() - c0;
            let after = micros(i0_before.elapsed());
            assert!(clock + 2 >= before && clock <= after + 2, "step {step}: {before} <= {clock} <= {after} us");
        }
    }

    #[test]
    fn system_clock_never_steps_back_on_a_thread() {
        let threads: Vec<_> = (0..3)
            .map(|_| {
                std::thread::spawn(|| {
                    let c = SystemClock::new();
                    let until = Instant::now() + Duration::from_millis(12);
                    let (mut last, mut reads) = (c.now_us(), 0u64);
                    while Instant::now() < until {
                        let now = c.now_us();
                        assert!(now >= last, "{now} after {last}");
                        (last, reads) = (now, reads + 1);
                    }
                    reads
                })
            })
            .collect();
        for t in threads {
            assert!(t.join().unwrap() > 0);
        }
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
