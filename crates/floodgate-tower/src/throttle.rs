//! Client-side throttling: wait for permission instead of failing, for
//! clients that must stay under a provider's limit.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use floodgate_core::{Limit, MemoryStore, Store, StoreError};

/// Why a [`Throttle`] gave up instead of waiting.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ThrottleError {
    /// More units than the limit can ever grant at once: no wait helps.
    #[error("{n} units can never pass a limit of capacity {capacity}: ask for at most {capacity} at a time")]
    InsufficientCapacity {
        /// Units asked for.
        n: u64,
        /// The most the limit grants at once.
        capacity: u64,
    },
    /// Permission would come later than the cap on the wait allows.
    #[error("permission in {wait:?}, later than the {max_wait:?} allowed")]
    TooLong {
        /// The wait needed from now (without jitter).
        wait: Duration,
        /// The cap.
        max_wait: Duration,
    },
    /// The store failed (the Redis store: down, timed out, or open breaker).
    #[error("the store failed: {0}")]
    Store(#[from] StoreError),
}

/// Waits until a limit grants units: `until_ready().await` returns when one
/// request may go, sleeping for the limit's exact `retry_after` (plus
/// jitter, so many waiting clients do not wake at once) as often as needed.
/// Over a shared store (Redis) many processes share one budget.
///
/// ```
/// # async fn f() -> Result<(), floodgate_tower::ThrottleError> {
/// use floodgate_core::{Algorithm, Limit};
/// use floodgate_tower::Throttle;
/// use std::time::Duration;
/// // The provider allows 100 calls a minute.
/// let limit = Limit::new(Algorithm::Gcra { burst: Some(10) }, 100, Duration::from_secs(60)).unwrap();
/// let throttle = Throttle::new(limit).jitter(Duration::from_millis(50)).max_wait(Duration::from_secs(30));
/// throttle.until_ready().await?;
/// // call the provider
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Throttle<S = MemoryStore> {
    store: S,
    limit: Limit,
    key: String,
    jitter: Duration,
    max_wait: Option<Duration>,
}

impl Throttle<MemoryStore> {
    /// A throttle of `limit` in this process.
    pub fn new(limit: Limit) -> Self {
        Self::with_store(limit, MemoryStore::new(), "throttle")
    }
}

impl<S: Store> Throttle<S> {
    /// A throttle of `limit` counted under `key` in `store` (a Redis store
    /// shares the budget between processes).
    pub fn with_store(limit: Limit, store: S, key: impl Into<String>) -> Self {
        Self { store, limit, key: key.into(), jitter: Duration::ZERO, max_wait: None }
    }

    /// Add a random wait of up to `jitter` to each sleep.
    #[must_use]
    pub fn jitter(mut self, jitter: Duration) -> Self {
        self.jitter = jitter;
        self
    }

    /// Give up (with [`ThrottleError::TooLong`], at once) when permission is
    /// further away than `max_wait` from the first call.
    #[must_use]
    pub fn max_wait(mut self, max_wait: Duration) -> Self {
        self.max_wait = Some(max_wait);
        self
    }

    /// Wait until one unit is granted; returns how long it waited.
    pub async fn until_ready(&self) -> Result<Duration, ThrottleError> {
        self.until_n_ready(1).await
    }

    /// Wait until `n` units are granted at once; returns how long it waited.
    pub async fn until_n_ready(&self, n: u64) -> Result<Duration, ThrottleError> {
        let started = Instant::now();
        loop {
            let d = self.store.apply(&self.key, &self.limit, n).await?;
            if d.allowed {
                // A shaping limit admits now and says when to go.
                if !d.delay.is_zero() {
                    tokio::time::sleep(d.delay).await;
                }
                return Ok(started.elapsed());
            }
            let Some(wait) = d.retry_after else {
                return Err(ThrottleError::InsufficientCapacity { n, capacity: self.limit.capacity() });
            };
            if let Some(max_wait) = self.max_wait {
                let total = started.elapsed() + wait;
                if total > max_wait {
                    return Err(ThrottleError::TooLong { wait: total, max_wait });
                }
            }
            tokio::time::sleep(wait + random_up_to(self.jitter)).await;
        }
    }
}

/// A uniformly random duration in `0..=max` (std's randomly keyed hasher
/// over a counter: no RNG dependency for a jitter).
fn random_up_to(max: Duration) -> Duration {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = u64::try_from(max.as_nanos()).unwrap_or(u64::MAX);
    if nanos == 0 {
        return Duration::ZERO;
    }
    let r = std::collections::hash_map::RandomState::new().hash_one(COUNTER.fetch_add(1, Ordering::Relaxed));
    Duration::from_nanos(r % nanos.saturating_add(1).max(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use floodgate_core::Algorithm;

    fn gcra(limit: u64, window_ms: u64, burst: u64) -> Limit {
        Limit::new(Algorithm::Gcra { burst: Some(burst) }, limit, Duration::from_millis(window_ms)).unwrap()
    }

    #[tokio::test]
    async fn waits_for_each_unit_at_the_limits_pace() {
        // 2 at once, then one every 20 ms.
        let t = Throttle::new(gcra(1, 20, 2)).jitter(Duration::from_millis(2));
        let started = Instant::now();
        for _ in 0..6 {
            t.until_ready().await.unwrap();
        }
        // The last 4 each waited for a new unit: at least 4 × 20 ms in all.
        assert!(started.elapsed() >= Duration::from_millis(80), "{:?}", started.elapsed());
    }

    #[tokio::test]
    async fn gives_up_at_once_when_no_wait_helps_or_the_wait_is_too_long() {
        let t = Throttle::new(gcra(1, 60_000, 3)).max_wait(Duration::from_millis(50));
        assert_eq!(t.until_n_ready(4).await, Err(ThrottleError::InsufficientCapacity { n: 4, capacity: 3 }));
        t.until_n_ready(3).await.unwrap();
        let started = Instant::now();
        match t.until_ready().await {
            Err(ThrottleError::TooLong { wait, max_wait }) => {
                assert_eq!(max_wait, Duration::from_millis(50));
                assert!(wait > Duration::from_secs(59), "{wait:?}");
            }
            other => panic!("{other:?}"),
        }
        assert!(started.elapsed() < Duration::from_secs(59), "it did not sleep first");
    }

    #[test]
    fn jitter_stays_in_range_and_varies() {
        let max = Duration::from_millis(10);
        let draws: Vec<Duration> = (0..200).map(|_| random_up_to(max)).collect();
        assert!(draws.iter().all(|d| *d <= max));
        assert!(draws.iter().any(|d| *d != draws[0]), "not constant");
        assert_eq!(random_up_to(Duration::ZERO), Duration::ZERO);
    }
}
