//! Lazy sync: when a key's own hits may wait before going to the peers,
//! and the keys waiting. One rule and one list for both kinds of region
//! (the memory store's [`GlobalTable`](super::GlobalTable) and a Redis
//! region in the server).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

/// Whether `unsent` own hits of a key with `remaining` left may wait for
/// the lazy period: while they are below `remaining / (100 × regions)`.
///
/// Hits nobody else knows of yet are what a region can over-admit by: a
/// peer may meanwhile hand out everything it sees as left. Beyond the
/// staleness every eventual rule has (a sync interval and the latency),
/// the hits waiting in all regions together are then below 1% of what is
/// left, however late they arrive, and that is all lazy sync can add to
/// over-admission. (Bounded rules, warming regions and failing links send
/// at once whatever this says.)
pub fn can_wait(unsent: u64, remaining: u64, regions: usize) -> bool {
    let regions = u128::try_from(regions).unwrap_or(u128::MAX);
    u128::from(unsent).saturating_mul(LAZY_SHARE).saturating_mul(regions) < u128::from(remaining)
}

/// Lazy hits stay below `remaining / (LAZY_SHARE × regions)` in each region.
const LAZY_SHARE: u128 = 100;

/// Keys waiting out the lazy period, oldest first, and the links whose
/// last batch failed: while any do, nothing waits (a healed link then
/// finds every change already queued).
#[derive(Debug)]
pub struct Lazy<K> {
    waiting: Mutex<VecDeque<(u64, K)>>,
    failing: AtomicUsize,
    period_us: u64,
}

impl<K> Lazy<K> {
    /// Keys wait `period_us` at most.
    pub fn new(period_us: u64) -> Self {
        Self { waiting: Mutex::new(VecDeque::new()), failing: AtomicUsize::new(0), period_us }
    }

    /// `key` starts waiting at `now` (µs).
    pub fn wait(&self, now: u64, key: K) {
        self.lock().push_back((now, key));
    }

    /// The keys whose period is over at `now` (`u64::MAX`: all), taken
    /// out; the caller queues those still waiting by its own account.
    pub fn due(&self, now: u64) -> Vec<K> {
        let mut waiting = self.lock();
        let mut due = Vec::new();
        while waiting.front().is_some_and(|(since, _)| since.saturating_add(self.period_us) <= now) {
            if let Some((_, k)) = waiting.pop_front() {
                due.push(k);
            }
        }
        due
    }

    /// Whether a link is failing: then nothing may wait.
    pub fn eager(&self) -> bool {
        self.failing.load(Ordering::Acquire) > 0
    }

    /// A link started (`true`) or stopped failing; when one starts, every
    /// waiting key, to queue now.
    pub fn link_failing(&self, started: bool) -> Vec<K> {
        if started {
            self.failing.fetch_add(1, Ordering::AcqRel);
            self.due(u64::MAX)
        } else {
            self.failing.fetch_sub(1, Ordering::AcqRel);
            Vec::new()
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<(u64, K)>> {
        self.waiting.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hits_wait_below_their_share_of_what_is_left() {
        // 3 regions: a share is remaining / 300.
        assert!(can_wait(3, 1_000, 3));
        assert!(!can_wait(4, 1_000, 3));
        assert!(!can_wait(1, 300, 3));
        assert!(can_wait(1, 301, 3));
        assert!(!can_wait(0, 0, 3));
        assert!(!can_wait(u64::MAX, u64::MAX, usize::MAX));
    }

    #[test]
    fn keys_come_due_in_order_and_all_at_once_when_a_link_fails() {
        let lazy = Lazy::new(10);
        lazy.wait(0, "a");
        lazy.wait(5, "b");
        lazy.wait(20, "c");
        assert_eq!(lazy.due(9), Vec::<&str>::new());
        assert_eq!(lazy.due(15), vec!["a", "b"]);
        assert!(!lazy.eager());
        assert_eq!(lazy.link_failing(true), vec!["c"]);
        assert!(lazy.eager());
        assert_eq!(lazy.link_failing(false), Vec::<&str>::new());
        assert!(!lazy.eager());
    }
}
