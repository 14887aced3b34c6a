//! The answer to one request.

use std::time::Duration;

/// What one limit decided for one request.
///
/// A denial is a value, not an error: `allowed == false` with, when some wait
/// can help, the exact wait in `retry_after`. All waits are rounded **up** to
/// whole microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Decision {
    /// Whether the request may go ahead (for `hits = 0` always true: a peek).
    pub allowed: bool,
    /// The limit's configured count per window (`requests_per_unit`).
    pub limit: u64,
    /// Units still admissible right after this decision.
    pub remaining: u64,
    /// Wait until the key's state is back to empty (full, for buckets) if
    /// nothing else arrives; zero when it already is.
    pub reset_after: Duration,
    /// Denials only: the earliest wait after which the same request would be
    /// allowed if nothing else arrived. `None` when allowed, or when no wait
    /// can help (`hits` above the capacity, or `limit = 0`).
    pub retry_after: Option<Duration>,
    /// Shaping (`leaky_bucket` with `mode: shape`) only: how long to hold an
    /// admitted request before forwarding it. Zero otherwise.
    pub delay: Duration,
}

impl Decision {
    #[inline]
    pub(crate) fn allow(limit: u64, remaining: u64, reset_us: u64) -> Self {
        Self {
            allowed: true,
            limit,
            remaining,
            reset_after: Duration::from_micros(reset_us),
            retry_after: None,
            delay: Duration::ZERO,
        }
    }

    #[inline]
    pub(crate) fn deny(limit: u64, remaining: u64, reset_us: u64, retry_us: Option<u64>) -> Self {
        Self {
            allowed: false,
            limit,
            remaining,
            reset_after: Duration::from_micros(reset_us),
            retry_after: retry_us.map(Duration::from_micros),
            delay: Duration::ZERO,
        }
    }

    /// `reset_after` in whole microseconds.
    pub fn reset_after_us(&self) -> u64 {
        crate::clock::micros(self.reset_after)
    }

    /// `retry_after` in whole microseconds.
    pub fn retry_after_us(&self) -> Option<u64> {
        self.retry_after.map(crate::clock::micros)
    }
}
