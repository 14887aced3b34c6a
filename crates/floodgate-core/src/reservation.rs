//! Reservations: reserve an estimate when work starts, settle the actual
//! amount when it ends (`../shared/DESIGN.md`, "Refunds, late charges,
//! reservations"). A reserve is an ordinary decision of the estimate, all
//! or nothing over the request's limits; each limit it took from is a
//! [`Part`] of the [`Reservation`], kept in the store of the region under a
//! [`ReservationId`], so any instance of the region settles it.
//!
//! What a settle does to each part ([`Part::adjust`]):
//!
//! * actual above the estimate: the difference is a **late charge** at the
//!   time of the settle — the current window, post-paid, never lost, never
//!   denied;
//! * actual below it: the difference is **returned as if never taken** at
//!   the time of the reserve ([`crate::Limit::refund`]): what has left the
//!   window since is not given back (giving it to the current window would
//!   hand out the budget twice);
//! * after the reservation expired (never settled within its
//!   `reservation_ttl`): it kept its estimate, so a late settle charges any
//!   excess and returns nothing — a crashed caller neither leaks budget nor
//!   escapes the charge.
//!
//! Cancelling is settling at 0. A reservation settles once: settling again
//! with the same amounts answers the first settle's result ([`Claim::Again`]);
//! with other amounts it is a conflict ([`SettleError::Conflict`]). A
//! reservation's record outlives its expiry by [`RETAIN_AFTER_EXPIRY`] × its
//! ttl, so a late settle can still be charged; after that it is unknown.
//!
//! This module holds the rules and the in-process ledger; the stores apply
//! the adjustments (a late charge, a return) to their counters.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// How long a settled or expired reservation's record stays, in multiples
/// of its ttl after its expiry: a settle that comes this late is still
/// charged its excess; one that comes later is answered "unknown".
pub const RETAIN_AFTER_EXPIRY: u64 = 1;

/// A reservation's name: 128 bits, unguessable in practice (from the
/// process's random hash keys and a counter), written as 32 lowercase hex
/// digits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReservationId(pub u128);

impl ReservationId {
    /// A new id, never the same twice in this process and random across
    /// processes.
    pub fn new() -> Self {
        use std::hash::{BuildHasher, Hasher};
        static SEQ: AtomicU64 = AtomicU64::new(0);
        static KEYS: std::sync::OnceLock<(std::collections::hash_map::RandomState, u64)> = std::sync::OnceLock::new();
        let (state, start) = KEYS.get_or_init(|| {
            let state = std::collections::hash_map::RandomState::new();
            let start = state.hash_one(crate::Clock::now_us(&crate::SystemClock::new()));
            (state, start)
        });
        let n = SEQ.fetch_add(1, Ordering::Relaxed);
        let half = |salt: u64| {
            let mut h = state.build_hasher();
            h.write_u64(*start);
            h.write_u64(n);
            h.write_u64(salt);
            h.finish()
        };
        ReservationId((u128::from(half(1)) << 64) | u128::from(half(2)))
    }
}

impl Default for ReservationId {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Display for ReservationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// A reservation id that is not 32 hex digits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("reservation `{0}`: write the id a reserve answered, 32 hex digits")]
pub struct BadReservationId(pub String);

impl FromStr for ReservationId {
    type Err = BadReservationId;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.len() != 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(BadReservationId(s.chars().take(64).collect()));
        }
        u128::from_str_radix(s, 16).map(ReservationId).map_err(|_| BadReservationId(s.to_owned()))
    }
}

/// What settling does to one part's counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Adjust {
    /// The actual amount is the estimate (or a late settle returns nothing).
    Nothing,
    /// Charge this many hits after the work, now: never denied.
    Late(u64),
    /// Give back this many hits as if the reserve had never taken them
    /// (taken at `taken_at_us`).
    Return {
        /// The hits.
        hits: u64,
        /// When the reserve took them.
        taken_at_us: u64,
    },
}

/// One limit's share of a reservation: the estimate it took, and when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part<P> {
    /// What the store needs to adjust the counter (its key and limit).
    pub payload: P,
    /// The hits the reserve took.
    pub estimate: u64,
    /// When it took them (µs since the epoch).
    pub taken_at_us: u64,
}

impl<P> Part<P> {
    /// What settling this part at `actual` hits does: see the module's
    /// rules. `expired`: the reservation outlived its ttl unsettled.
    pub fn adjust(&self, actual: u64, expired: bool) -> Adjust {
        if actual > self.estimate {
            Adjust::Late(actual - self.estimate)
        } else if actual < self.estimate && !expired {
            Adjust::Return { hits: self.estimate - actual, taken_at_us: self.taken_at_us }
        } else {
            Adjust::Nothing
        }
    }
}

/// A reservation: its parts, when it expires, and its settle once made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation<P, R> {
    /// One per limit the reserve took from, in the request's order.
    pub parts: Vec<Part<P>>,
    /// Until when (µs) a settle may return what was not used.
    pub expires_at_us: u64,
    /// Its ttl (µs): the record stays [`RETAIN_AFTER_EXPIRY`] ttls beyond
    /// the expiry.
    pub ttl_us: u64,
    /// The amounts it was settled at (one per part), and the answer given.
    pub settled: Option<(Vec<u64>, R)>,
}

/// Why a settle cannot be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SettleError {
    /// No such reservation (never made, or its record is gone).
    #[error("no reservation by this id (never made, or settled or expired more than its ttl ago)")]
    Unknown,
    /// Settled before with other amounts.
    #[error(
        "already settled at {settled:?}: a reservation settles once; settle again with the same amounts to read that result"
    )]
    Conflict {
        /// The amounts it was settled at.
        settled: Vec<u64>,
    },
    /// Not one amount per part (nor one for all).
    #[error(
        "{given} amounts for a reservation of {parts} limits: give one for all, or one per limit in the reserve's order"
    )]
    Amounts {
        /// Parts of the reservation.
        parts: usize,
        /// Amounts given.
        given: usize,
    },
}

/// What a settle may do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim<R> {
    /// Settle now: each part's adjustment, in order; `expired` says whether
    /// the reservation outlived its ttl (it returns nothing).
    First {
        /// One per part.
        adjust: Vec<Adjust>,
        /// Whether it had expired.
        expired: bool,
    },
    /// Settled before with these amounts: the first settle's answer.
    Again(R),
}

impl<P, R: Clone> Reservation<P, R> {
    /// The amounts per part for `actual`: one amount for every part, or one
    /// per part.
    pub fn amounts(&self, actual: &[u64]) -> Result<Vec<u64>, SettleError> {
        match actual {
            [one] => Ok(vec![*one; self.parts.len()]),
            many if many.len() == self.parts.len() => Ok(many.to_vec()),
            many => Err(SettleError::Amounts { parts: self.parts.len(), given: many.len() }),
        }
    }

    /// Claim the settle at `actual` at `now_us`: the adjustments to make
    /// (the caller records the answer in `settled`), or the first settle's
    /// answer, or a conflict.
    pub fn claim(&self, actual: &[u64], now_us: u64) -> Result<Claim<R>, SettleError> {
        let amounts = self.amounts(actual)?;
        if let Some((settled, answer)) = &self.settled {
            return if *settled == amounts {
                Ok(Claim::Again(answer.clone()))
            } else {
                Err(SettleError::Conflict { settled: settled.clone() })
            };
        }
        let expired = now_us >= self.expires_at_us;
        Ok(Claim::First {
            adjust: self.parts.iter().zip(&amounts).map(|(p, &a)| p.adjust(a, expired)).collect(),
            expired,
        })
    }

    /// When the record may be dropped.
    pub fn retained_until_us(&self) -> u64 {
        self.expires_at_us.saturating_add(self.ttl_us.saturating_mul(RETAIN_AFTER_EXPIRY))
    }
}

/// Reservations kept in this process (the memory store's): sharded by id,
/// each record dropped once [`Reservation::retained_until_us`] has passed
/// (when met, and by [`Ledger::sweep`]).
#[derive(Debug)]
pub struct Ledger<P, R> {
    shards: Box<[Mutex<Records<P, R>>]>,
}

type Records<P, R> = HashMap<ReservationId, Reservation<P, R>>;

impl<P, R> Default for Ledger<P, R> {
    fn default() -> Self {
        Ledger { shards: (0..16).map(|_| Mutex::new(HashMap::new())).collect() }
    }
}

impl<P, R: Clone> Ledger<P, R> {
    fn shard(&self, id: ReservationId) -> std::sync::MutexGuard<'_, Records<P, R>> {
        let i = (id.0 as usize) % self.shards.len();
        self.shards[i].lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Keep `r` under a new id.
    pub fn insert(&self, r: Reservation<P, R>) -> ReservationId {
        let id = ReservationId::new();
        self.shard(id).insert(id, r);
        id
    }

    /// Settle `id` at `actual` at `now_us`: `apply` makes the adjustments
    /// of a first settle (given each part and its adjustment) and returns
    /// the answer, which is recorded; a second settle with the same amounts
    /// answers it again. The shard's lock is held throughout, so two
    /// settles of one reservation never both apply.
    pub fn settle(
        &self,
        id: ReservationId,
        actual: &[u64],
        now_us: u64,
        apply: impl FnOnce(&[Part<P>], &[Adjust], bool) -> R,
    ) -> Result<R, SettleError> {
        let mut shard = self.shard(id);
        let Some(r) = shard.get_mut(&id).filter(|r| now_us < r.retained_until_us()) else {
            shard.remove(&id);
            return Err(SettleError::Unknown);
        };
        match r.claim(actual, now_us)? {
            Claim::Again(answer) => Ok(answer),
            Claim::First { adjust, expired } => {
                let answer = apply(&r.parts, &adjust, expired);
                r.settled = Some((r.amounts(actual)?, answer.clone()));
                Ok(answer)
            }
        }
    }

    /// Drop the records whose retention has passed at `now_us`; how many.
    pub fn sweep(&self, now_us: u64) -> usize {
        self.shards
            .iter()
            .map(|s| {
                let mut s = s.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                let before = s.len();
                s.retain(|_, r| now_us < r.retained_until_us());
                before - s.len()
            })
            .sum()
    }

    /// Records held.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().unwrap_or_else(std::sync::PoisonError::into_inner).len()).sum()
    }

    /// Whether no record is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000;

    fn reservation(estimates: &[u64]) -> Reservation<&'static str, String> {
        Reservation {
            parts: estimates.iter().map(|&e| Part { payload: "k", estimate: e, taken_at_us: 7 * S }).collect(),
            expires_at_us: 300 * S,
            ttl_us: 300 * S,
            settled: None,
        }
    }

    #[test]
    fn a_settle_charges_the_excess_late_and_returns_the_rest_as_never_taken() {
        let r = reservation(&[100]);
        let first = |a: u64, now: u64| match r.claim(&[a], now).unwrap() {
            Claim::First { adjust, .. } => adjust[0],
            Claim::Again(_) => unreachable!(),
        };
        assert_eq!(first(130, 10 * S), Adjust::Late(30));
        assert_eq!(first(40, 10 * S), Adjust::Return { hits: 60, taken_at_us: 7 * S });
        assert_eq!(first(100, 10 * S), Adjust::Nothing);
        assert_eq!(first(0, 10 * S), Adjust::Return { hits: 100, taken_at_us: 7 * S }, "cancel");
        // Expired unsettled: it kept its estimate; the excess is still
        // charged, nothing is returned.
        assert_eq!(first(130, 300 * S), Adjust::Late(30));
        assert_eq!(first(40, 300 * S), Adjust::Nothing);
    }

    #[test]
    fn amounts_are_one_for_all_or_one_per_part() {
        let r = reservation(&[10, 20]);
        assert_eq!(r.amounts(&[5]).unwrap(), vec![5, 5]);
        assert_eq!(r.amounts(&[5, 25]).unwrap(), vec![5, 25]);
        assert_eq!(r.amounts(&[1, 2, 3]), Err(SettleError::Amounts { parts: 2, given: 3 }));
        assert_eq!(r.amounts(&[]), Err(SettleError::Amounts { parts: 2, given: 0 }));
    }

    #[test]
    fn a_reservation_settles_once_and_answers_the_same_settle_again() {
        let ledger: Ledger<&'static str, String> = Ledger::default();
        let id = ledger.insert(reservation(&[10, 20]));
        let mut applied = 0;
        let answer = ledger
            .settle(id, &[5, 25], 10 * S, |parts, adjust, expired| {
                applied += 1;
                assert_eq!(parts.len(), 2);
                assert!(!expired);
                format!("{adjust:?}")
            })
            .unwrap();
        assert_eq!(answer, "[Return { hits: 5, taken_at_us: 7000000 }, Late(5)]");
        let again = ledger.settle(id, &[5, 25], 11 * S, |_, _, _| unreachable!("settled once")).unwrap();
        assert_eq!(again, answer);
        assert_eq!(applied, 1);
        assert_eq!(
            ledger.settle(id, &[6, 25], 11 * S, |_, _, _| unreachable!()),
            Err(SettleError::Conflict { settled: vec![5, 25] })
        );
        assert_eq!(ledger.settle(ReservationId(1), &[1], 11 * S, |_, _, _| unreachable!()), Err(SettleError::Unknown));
    }

    #[test]
    fn a_record_outlives_its_expiry_by_its_ttl_then_is_unknown() {
        let ledger: Ledger<&'static str, String> = Ledger::default();
        let id = ledger.insert(reservation(&[10]));
        let late = ledger.settle(id, &[15], 599 * S, |_, adjust, expired| format!("{adjust:?} {expired}")).unwrap();
        assert_eq!(late, "[Late(5)] true");
        let gone = ledger.insert(reservation(&[10]));
        assert_eq!(ledger.sweep(599 * S), 0);
        assert_eq!(ledger.sweep(600 * S), 2);
        assert_eq!(ledger.settle(gone, &[15], 600 * S, |_, _, _| unreachable!()), Err(SettleError::Unknown));
        assert!(ledger.is_empty());
    }

    #[test]
    fn ids_are_distinct_and_read_back_from_their_text() {
        let ids: std::collections::HashSet<ReservationId> = (0..10_000).map(|_| ReservationId::new()).collect();
        assert_eq!(ids.len(), 10_000);
        for id in ids.iter().take(10) {
            let text = id.to_string();
            assert_eq!(text.len(), 32);
            assert_eq!(text.parse::<ReservationId>().unwrap(), *id);
        }
        for bad in ["", "xyz", "0123456789abcdef0123456789abcdeg", "0123456789abcdef0123456789abcdef0"] {
            assert!(bad.parse::<ReservationId>().is_err(), "{bad}");
        }
    }
}
