//! The algorithms: pure state machines `(limit, &mut state, now, hits) ->
//! Decision`. No clock reads, no locks, no I/O, no floats; a denied request
//! leaves the state as it found it.
//!
//! A `now` earlier than the time a key's state was last written (a clock that
//! stepped back) never rewinds the state: window algorithms read it as the
//! start of the window or bucket they last saw, `sliding_log` as its newest
//! entry, and the GCRA family as is (a smaller `now` only makes the answer
//! stricter).

mod concurrency;
mod fixed_window;
mod gcra;
mod sliding_buckets;
mod sliding_log;
mod sliding_window;

#[cfg(test)]
mod edge_tests;
#[cfg(test)]
mod proptests;

use crate::{Algorithm, Charge, Decision, LeakyMode, Limit, State};

impl Limit {
    /// Decide `hits` units for one key whose state is `state`, at `now_us`
    /// (microseconds since the Unix epoch), updating the state when allowed.
    ///
    /// ```
    /// use floodgate_core::{Algorithm, Limit, State};
    /// use std::time::Duration;
    /// let limit = Limit::new(Algorithm::FixedWindow, 2, Duration::from_secs(1)).unwrap();
    /// let mut state = State::default();
    /// assert!(limit.apply(&mut state, 0, 1).allowed);
    /// assert!(limit.apply(&mut state, 0, 1).allowed);
    /// let denied = limit.apply(&mut state, 250_000, 1);
    /// assert!(!denied.allowed);
    /// assert_eq!(denied.retry_after, Some(Duration::from_millis(750)));
    /// ```
    ///
    /// A limit charged after the work ([`Charge::After`]) never denies
    /// hits ≥ 1 (a late charge, counted into debt if need be) and answers
    /// hits 0 as the gate: denied once a request of one hit would be.
    #[inline(always)]
    pub fn apply(&self, state: &mut State, now_us: u64, hits: u64) -> Decision {
        if self.charge() == Charge::After {
            return self.after_work(state, now_us, hits);
        }
        self.dispatch(state, now_us, hits, false, |d| d)
    }

    /// A late charge of `hits` whatever this limit's own charge (a
    /// reservation settled above its estimate): counted into debt if need
    /// be, never denied, saturating at [`MAX_LIMIT`](crate::MAX_LIMIT).
    /// Hits 0 is a peek.
    pub fn charge_late(&self, state: &mut State, now_us: u64, hits: u64) -> Decision {
        self.dispatch(state, now_us, hits.min(crate::MAX_LIMIT), true, |d| d)
    }

    /// [`Limit::apply`] of a limit charged after the work.
    #[inline(never)]
    fn after_work(&self, state: &mut State, now_us: u64, hits: u64) -> Decision {
        if hits > 0 {
            return self.charge_late(state, now_us, hits);
        }
        // The gate: what a peek sees, unless nothing is left; then the
        // denial of one hit (which leaves the state as it was), with its
        // wait. (With no limit, nothing is ever left.)
        let peek = self.dispatch(state, now_us, 0, false, |d| d);
        if peek.remaining > 0 { peek } else { self.dispatch(state, now_us, 1, false, |d| d) }
    }

    /// The algorithm's decision, given to `then` in each arm. (Written as
    /// one `match` returning the decision, the memory store's one-key denied
    /// case measured ~10% slower — 52 against 47 ns, pinned to a core,
    /// `vs_governor` — though the two forms mean the same.)
    ///
    /// `force`: admit whatever the count (a late charge), saturating at
    /// [`MAX_LIMIT`](crate::MAX_LIMIT).
    #[inline(always)]
    fn dispatch<R>(
        &self,
        state: &mut State,
        now_us: u64,
        hits: u64,
        force: bool,
        then: impl FnOnce(Decision) -> R,
    ) -> R {
        if self.limit() == 0 {
            // Envoy's `requests_per_unit: 0`: deny every hit, no wait helps
            // (a late charge is taken: there is nothing to count it in).
            return then(if hits == 0 || force { Decision::allow(0, 0, 0) } else { Decision::deny(0, 0, 0, None) });
        }
        match self.algorithm() {
            Algorithm::FixedWindow => then(fixed_window::apply(self, state, now_us, hits, force)),
            Algorithm::SlidingLog => then(sliding_log::apply(self, state, now_us, hits, force)),
            Algorithm::SlidingWindow => then(sliding_window::apply(self, state, now_us, hits, force)),
            Algorithm::SlidingBuckets { granularity } => {
                then(sliding_buckets::apply(self, *granularity, state, now_us, hits, force))
            }
            Algorithm::TokenBucket { .. } | Algorithm::Gcra { .. } => {
                then(gcra::apply(self, state, now_us, hits, false, force))
            }
            Algorithm::LeakyBucket { mode, .. } => {
                then(gcra::apply(self, state, now_us, hits, *mode == LeakyMode::Shape, force))
            }
            // An acquire without an id: an anonymous lease. A late charge
            // takes no slot (a slot is taken before the work or not at all).
            Algorithm::Concurrency => then(concurrency::acquire(self, state, now_us, if force { 0 } else { hits }, 0)),
        }
    }

    /// **Acquire** `hits` slots of a concurrency limit as lease `lease`
    /// (0: anonymous), expiring a lease's length (the limit's window) from
    /// `now_us` unless extended ([`Limit::extend`]) or released first
    /// ([`Limit::release`]). A lease already held is extended, not taken
    /// twice. Any other limit decides the hits as [`Limit::apply`] does.
    ///
    /// ```
    /// use floodgate_core::{Algorithm, Limit, State};
    /// use std::time::Duration;
    /// let limit = Limit::new(Algorithm::Concurrency, 2, Duration::from_secs(30)).unwrap();
    /// let mut state = State::default();
    /// assert!(limit.acquire(&mut state, 0, 1, 7).allowed);
    /// assert!(limit.acquire(&mut state, 0, 1, 8).allowed);
    /// let full = limit.acquire(&mut state, 1_000, 1, 9);
    /// assert!(!full.allowed);
    /// assert_eq!(full.retry_after, Some(Duration::from_micros(29_999_000))); // lease 7 expires
    /// assert_eq!(limit.release(&mut state, 2_000, Some(7)).remaining, 1);
    /// assert!(limit.acquire(&mut state, 3_000, 1, 9).allowed);
    /// // A crashed holder's slot frees itself when its lease ends (8's at 30 s).
    /// assert_eq!(limit.acquire(&mut state, 29_999_999, 0, 0).remaining, 0);
    /// assert_eq!(limit.acquire(&mut state, 30_000_000, 0, 0).remaining, 1);
    /// ```
    pub fn acquire(&self, state: &mut State, now_us: u64, hits: u64, lease: u64) -> Decision {
        match self.algorithm() {
            Algorithm::Concurrency if self.limit() > 0 => concurrency::acquire(self, state, now_us, hits, lease),
            _ => self.apply(state, now_us, hits),
        }
    }

    /// The slots a concurrency limit's `state` holds (leases expired but not
    /// yet dropped included; 0 for any other state).
    pub fn leases_held(&self, state: &State) -> u64 {
        state.leases_used()
    }

    /// Drop the leases of `state` expired at `now_us`: the slots they held
    /// (0 for any other limit).
    pub fn expire_leases(&self, state: &mut State, now_us: u64) -> u64 {
        if !self.is_concurrency() || state.leases_used() == 0 {
            return 0;
        }
        concurrency::prune(state.leases(), now_us)
    }

    /// **Release** lease `lease` of a concurrency limit, or with `None` its
    /// earliest-expiring lease (a release that lost its id frees the slot
    /// that would free first anyway), answered as a peek afterwards. A
    /// lease already gone frees nothing. Any other limit only peeks: a
    /// release gives back no rate or budget hits.
    pub fn release(&self, state: &mut State, now_us: u64, lease: Option<u64>) -> Decision {
        match self.algorithm() {
            Algorithm::Concurrency if self.limit() > 0 => concurrency::release(self, state, now_us, lease),
            _ => self.dispatch(state, now_us, 0, false, |d| d),
        }
    }

    /// **Extend** lease `lease` of a concurrency limit to a lease's length
    /// from `now_us`: allowed while it was held, denied (acquire again)
    /// once it is gone. Any other limit only peeks.
    pub fn extend(&self, state: &mut State, now_us: u64, lease: u64) -> Decision {
        match self.algorithm() {
            Algorithm::Concurrency if self.limit() > 0 => concurrency::extend(self, state, now_us, lease),
            _ => self.dispatch(state, now_us, 0, false, |d| d),
        }
    }

    /// Give back, at `now_us`, `hits` that [`Limit::apply`] admitted at
    /// `at_us` for this state, as if that request had never come (a request denied by another
    /// of its limits keeps nothing: all or nothing). Whatever has since left
    /// the window is not given back twice; a refund never leaves more room
    /// than the request took.
    ///
    /// ```
    /// use floodgate_core::{Algorithm, Limit, State};
    /// use std::time::Duration;
    /// let limit = Limit::new(Algorithm::FixedWindow, 1, Duration::from_secs(1)).unwrap();
    /// let mut state = State::default();
    /// assert!(limit.apply(&mut state, 0, 1).allowed);
    /// limit.refund(&mut state, 0, 0, 1);
    /// assert!(limit.apply(&mut state, 10, 1).allowed);
    /// ```
    pub fn refund(&self, state: &mut State, at_us: u64, now_us: u64, hits: u64) {
        // As much as any store counts (a larger refund gives back as much).
        let hits = hits.min(crate::MAX_LIMIT);
        if self.limit() == 0 || hits == 0 {
            return;
        }
        match self.algorithm() {
            Algorithm::FixedWindow => fixed_window::refund(self, state, at_us, hits),
            Algorithm::SlidingLog => sliding_log::refund(self, state, at_us, now_us, hits),
            Algorithm::SlidingWindow => sliding_window::refund(self, state, at_us, hits),
            Algorithm::SlidingBuckets { granularity } => {
                sliding_buckets::refund(self, *granularity, state, at_us, hits)
            }
            Algorithm::TokenBucket { .. } | Algorithm::Gcra { .. } | Algorithm::LeakyBucket { .. } => {
                gcra::refund(self, state, at_us, now_us, hits)
            }
            Algorithm::Concurrency => concurrency::undo_anonymous(state, hits),
        }
    }

    /// A **refund** at `now_us`: give back `hits` taken earlier by requests
    /// this call cannot name (Envoy's `is_negative_hits`, a negative `hits`
    /// on `/v1/check`), and answer what a peek answers afterwards (always
    /// allowed). What still counts is given back, never below zero:
    ///
    /// * `fixed_window`: from the current window's count (a window that has
    ///   ended has nothing left to give).
    /// * `sliding_window`, `sliding_buckets`, `sliding_log`: the newest hits
    ///   first — the current window's count then the previous one's; the
    ///   newest bucket then the older ones still in the window; the newest
    ///   log entries then older ones still in the window. The hits a refund
    ///   comes after are the newest ones, and these leave the window last.
    /// * the GCRA family (`gcra`, `token_bucket`, `leaky_bucket`): the
    ///   theoretical arrival time moves back by `hits` emission intervals,
    ///   never past "full" (a bucket cannot hold more than its burst). The
    ///   shaper cannot take back a delay already served: the refund makes
    ///   room for the requests that come next.
    ///
    /// ```
    /// use floodgate_core::{Algorithm, Limit, State};
    /// use std::time::Duration;
    /// let limit = Limit::new(Algorithm::SlidingLog, 3, Duration::from_secs(1)).unwrap();
    /// let mut state = State::default();
    /// assert!(limit.apply(&mut state, 0, 2).allowed);
    /// assert!(limit.apply(&mut state, 10, 1).allowed);
    /// let after = limit.give_back(&mut state, 20, 5); // more than was taken
    /// assert!(after.allowed);
    /// assert_eq!(after.remaining, 3);
    /// ```
    ///
    /// At most [`MAX_LIMIT`](crate::MAX_LIMIT) is given back at once (every
    /// store counts exactly up to it; a larger refund gives back as much).
    pub fn give_back(&self, state: &mut State, now_us: u64, hits: u64) -> Decision {
        let hits = hits.min(crate::MAX_LIMIT);
        // A peek first brings the state to `now` (what left the window is
        // dropped), so what is given back is what still counts.
        let _ = self.dispatch(state, now_us, 0, false, |d| d);
        if self.limit() > 0 && hits > 0 {
            match self.algorithm() {
                Algorithm::FixedWindow => fixed_window::give_back(state, hits),
                Algorithm::SlidingLog => sliding_log::give_back(state, hits),
                Algorithm::SlidingWindow => sliding_window::give_back(state, hits),
                Algorithm::SlidingBuckets { granularity } => {
                    sliding_buckets::give_back(self, *granularity, state, hits)
                }
                Algorithm::TokenBucket { .. } | Algorithm::Gcra { .. } | Algorithm::LeakyBucket { .. } => {
                    gcra::refund(self, state, now_us, now_us, hits)
                }
                Algorithm::Concurrency => concurrency::give_back(state, hits),
            }
        }
        self.dispatch(state, now_us, 0, false, |d| d)
    }
}
