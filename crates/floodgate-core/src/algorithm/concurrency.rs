//! `concurrency`: at most `limit` slots held at once by leases, each
//! released by its id or expiring `window` (the lease's length) after it was
//! taken or last extended. Not a rate: a slot counts while it is held, and
//! frees the moment it is released.
//!
//! A key's leases are kept in its state (at most `limit` of them, so memory
//! per key is bounded by the limit, [`MAX_CONCURRENCY`](crate::MAX_CONCURRENCY));
//! an expired lease is dropped whenever its key is next met, so a holder
//! that crashed or hung never keeps a slot longer than its lease.

use crate::state::{Lease, Leases};
use crate::{Decision, Limit, State};

/// Drop the leases expired at `now`: the slots they held.
pub(super) fn prune(leases: &mut Leases, now: u64) -> u64 {
    if !leases.held.iter().any(|l| l.expires_us <= now) {
        return 0;
    }
    let before = leases.used;
    leases.held.retain(|l| l.expires_us > now);
    leases.used = leases.held.iter().map(|l| l.slots).sum();
    before - leases.used
}

/// Until every lease has expired.
fn reset(leases: &Leases, now: u64) -> u64 {
    leases.held.iter().map(|l| l.expires_us).max().map_or(0, |e| e.saturating_sub(now))
}

/// What a request of `hits` slots is answered now, taking nothing.
fn answer(limit: &Limit, leases: &Leases, now: u64, hits: u64) -> Decision {
    let l = limit.limit();
    let remaining = l.saturating_sub(leases.used);
    if hits <= remaining {
        return Decision::allow(l, remaining, reset(leases, now));
    }
    // Denied: the earliest time enough leases expire (a release may come
    // sooner); none helps a request larger than the limit.
    let retry = (hits <= l).then(|| {
        let mut expiries: Vec<(u64, u64)> = leases.held.iter().map(|x| (x.expires_us, x.slots)).collect();
        expiries.sort_unstable();
        let mut need = leases.used + hits - l;
        let mut at = now;
        for (e, s) in expiries {
            at = e;
            need = need.saturating_sub(s);
            if need == 0 {
                break;
            }
        }
        at.saturating_sub(now)
    });
    Decision::deny(l, remaining, reset(leases, now), retry)
}

/// Acquire `hits` slots as lease `id` (0: anonymous), expiring a lease's
/// length from now, when they fit. Hits 0 is a peek. A lease `id` already
/// held is extended, not taken twice (a retried acquire keeps one slot).
/// The slots held never pass the limit.
pub(super) fn acquire(limit: &Limit, state: &mut State, now: u64, hits: u64, id: u64) -> Decision {
    let leases = state.leases();
    prune(leases, now);
    let expires_us = now.saturating_add(limit.window_us());
    if id != 0
        && hits > 0
        && let Some(held) = leases.held.iter_mut().find(|x| x.id == id)
    {
        held.expires_us = expires_us;
        return answer(limit, leases, now, 0);
    }
    let d = answer(limit, leases, now, hits);
    if hits == 0 || !d.allowed {
        return d;
    }
    leases.held.push(Lease { id, expires_us, slots: hits });
    leases.used += hits;
    answer(limit, leases, now, 0)
}

/// Release lease `id`, or with `None` the earliest-expiring lease (the
/// oldest of equals; a release that lost its id: the slot that would free
/// first anyway), answered as a
/// peek afterwards. A lease already gone (released, expired) frees nothing:
/// a late or repeated release never frees another holder's slot.
pub(super) fn release(limit: &Limit, state: &mut State, now: u64, id: Option<u64>) -> Decision {
    let leases = state.leases();
    prune(leases, now);
    let at = match id {
        Some(id) => leases.held.iter().position(|x| x.id == id),
        None => leases.held.iter().enumerate().min_by_key(|(_, x)| x.expires_us).map(|(i, _)| i),
    };
    if let Some(i) = at {
        // `remove`, not `swap_remove`: the leases stay in the order they
        // were taken, so ties of expiry go to the oldest.
        let gone = leases.held.remove(i);
        leases.used -= gone.slots;
    }
    answer(limit, leases, now, 0)
}

/// Extend lease `id` to a lease's length from now: allowed when it was
/// held; denied (no wait helps: acquire again) when it is gone.
pub(super) fn extend(limit: &Limit, state: &mut State, now: u64, id: u64) -> Decision {
    let leases = state.leases();
    prune(leases, now);
    match leases.held.iter_mut().find(|x| x.id == id) {
        Some(held) => {
            held.expires_us = now.saturating_add(limit.window_us());
            answer(limit, leases, now, 0)
        }
        None => {
            let d = answer(limit, leases, now, 0);
            Decision::deny(d.limit, d.remaining, d.reset_after_us(), None)
        }
    }
}

/// Give back up to `n` slots of lease `i` (dropped once it holds none):
/// the slots given back.
fn take_slots(leases: &mut Leases, i: usize, n: u64) -> u64 {
    let lease = &mut leases.held[i];
    let take = lease.slots.min(n);
    lease.slots -= take;
    leases.used -= take;
    if lease.slots == 0 {
        leases.held.remove(i);
    }
    take
}

/// Give back `hits` slots of leases this call cannot name (a refund without
/// a lease id): the earliest-expiring leases first, never more than held.
pub(super) fn give_back(state: &mut State, hits: u64) {
    let leases = state.leases();
    let mut left = hits;
    while left > 0 {
        let Some((i, _)) = leases.held.iter().enumerate().min_by_key(|(_, x)| x.expires_us) else { break };
        left -= take_slots(leases, i, left);
    }
}

/// Undo an anonymous acquire of `hits` just made (its request was denied by
/// another limit): the newest anonymous lease gives its slots back.
pub(super) fn undo_anonymous(state: &mut State, hits: u64) {
    let leases = state.leases();
    if let Some(i) = leases.held.iter().rposition(|x| x.id == 0) {
        take_slots(leases, i, hits);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use proptest::prelude::*;

    use crate::{Algorithm, Limit, State};

    #[derive(Debug, Clone)]
    enum Step {
        Acquire { id: u64, slots: u64 },
        Release { id: Option<u64> },
        Extend { id: u64 },
        Wait { us: u64 },
        Refund { slots: u64 },
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => (0..6u64, 0..3u64).prop_map(|(id, slots)| Step::Acquire { id, slots }),
            2 => prop::option::of(1..6u64).prop_map(|id| Step::Release { id }),
            1 => (1..6u64).prop_map(|id| Step::Extend { id }),
            3 => (0..40u64).prop_map(|us| Step::Wait { us }),
            1 => (0..3u64).prop_map(|slots| Step::Refund { slots }),
        ]
    }

    /// The reference: every lease ever taken, by a sequence number, with its
    /// id, expiry and slots; held = not released and not expired.
    #[derive(Default)]
    struct Model {
        leases: BTreeMap<u64, (u64, u64, u64)>,
        next: u64,
    }

    impl Model {
        fn held(&self, now: u64) -> impl Iterator<Item = (&u64, &(u64, u64, u64))> {
            self.leases.iter().filter(move |(_, (_, e, s))| *e > now && *s > 0)
        }
        fn used(&self, now: u64) -> u64 {
            self.held(now).map(|(_, (_, _, s))| s).sum()
        }
        /// The lease a release without an id frees: the earliest expiry,
        /// the oldest of equals.
        fn earliest(&self, now: u64) -> Option<u64> {
            self.held(now).min_by_key(|(_, (_, e, _))| *e).map(|(k, _)| *k)
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2_000, ..ProptestConfig::default() })]

        /// Every answer (allowed, remaining, and the wait of a denial) is the
        /// model's, over random acquires, releases, extends, refunds and
        /// waits on a 4-slot limit with 25 µs leases.
        #[test]
        fn leases_match_the_model(steps in prop::collection::vec(step(), 1..60)) {
            let ttl = 25u64;
            let n = 4u64;
            let limit = Limit::checked(Algorithm::Concurrency, n, ttl).unwrap();
            let mut state = State::default();
            let mut m = Model::default();
            let mut now = 1_000u64;
            for s in steps {
                match s {
                    Step::Wait { us } => now += us,
                    Step::Acquire { id, slots } => {
                        let d = limit.acquire(&mut state, now, slots, id);
                        let held = m.held(now).find(|(_, (i, _, _))| id != 0 && *i == id).map(|(k, _)| *k);
                        if let (Some(k), true) = (held, slots > 0) {
                            m.leases.get_mut(&k).unwrap().1 = now + ttl;
                            prop_assert!(d.allowed);
                        } else {
                            let used = m.used(now);
                            let fits = used + slots <= n;
                            prop_assert_eq!(d.allowed, fits, "{:?} used {}", d, used);
                            if fits && slots > 0 {
                                m.leases.insert(m.next, (id, now + ttl, slots));
                                m.next += 1;
                            }
                            if !fits {
                                // The wait: the first time enough held leases end.
                                let mut ends: Vec<(u64, u64)> = m.held(now).map(|(_, (_, e, s))| (*e, *s)).collect();
                                ends.sort_unstable();
                                let mut need = used + slots - n;
                                let mut at = now;
                                for (e, s) in ends { at = e; need = need.saturating_sub(s); if need == 0 { break; } }
                                let want = (slots <= n).then(|| Duration::from_micros(at - now));
                                prop_assert_eq!(d.retry_after, want);
                            }
                        }
                        prop_assert_eq!(d.remaining, n.saturating_sub(m.used(now)));
                    }
                    Step::Release { id } => {
                        let before = m.used(now);
                        let d = limit.release(&mut state, now, id);
                        let k = match id {
                            Some(id) => m.held(now).find(|(_, (i, _, _))| *i == id).map(|(k, _)| *k),
                            None => m.earliest(now),
                        };
                        let freed = k.map_or(0, |k| m.leases.remove(&k).unwrap().2);
                        prop_assert!(d.allowed);
                        prop_assert_eq!(d.remaining, n.saturating_sub(before - freed));
                    }
                    Step::Extend { id } => {
                        let d = limit.extend(&mut state, now, id);
                        let k = m.held(now).find(|(_, (i, _, _))| *i == id).map(|(k, _)| *k);
                        prop_assert_eq!(d.allowed, k.is_some());
                        if let Some(k) = k {
                            m.leases.get_mut(&k).unwrap().1 = now + ttl;
                        }
                    }
                    Step::Refund { slots } => {
                        let d = limit.give_back(&mut state, now, slots);
                        let mut left = slots;
                        while left > 0 {
                            let Some(k) = m.earliest(now) else { break };
                            let l = m.leases.get_mut(&k).unwrap();
                            let take = l.2.min(left);
                            l.2 -= take;
                            left -= take;
                        }
                        prop_assert!(d.allowed);
                        prop_assert_eq!(d.remaining, n.saturating_sub(m.used(now)));
                    }
                }
                // The key's state is back to empty once its last lease ends.
                let peek = limit.acquire(&mut state, now, 0, 0);
                prop_assert_eq!(peek.remaining, n.saturating_sub(m.used(now)));
                let last = m.held(now).map(|(_, (_, e, _))| *e).max().map_or(0, |e| e - now);
                prop_assert_eq!(peek.reset_after, Duration::from_micros(last));
            }
        }
    }

    #[test]
    fn memory_is_bounded_by_the_limit() {
        let limit = Limit::checked(Algorithm::Concurrency, 3, 1_000).unwrap();
        let mut state = State::default();
        for i in 1..=10_000u64 {
            limit.acquire(&mut state, i, 1, i);
        }
        assert!(state.heap_bytes() < 256, "{}", state.heap_bytes());
        assert_eq!(limit.acquire(&mut state, 20_000, 0, 0).remaining, 3, "every lease ended");
    }
}
