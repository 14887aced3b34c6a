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
//! with other amounts it is a conflict ([`ReservationError::Conflict`]). A
//! reservation's record outlives its expiry by [`RETAIN_AFTER_EXPIRY`] × its
//! ttl, so a late settle can still be charged; after that it is unknown. A
//! settled record stays [`SETTLED_KEPT_US`] (a minute), for a settle sent
//! again.
//!
//! This module holds the rules and the in-process ledger; the stores apply
//! the adjustments (a late charge, a return) to their counters.

use std::fmt;
use std::str::FromStr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// How long a settled or expired reservation's record stays, in multiples
/// of its ttl after its expiry: a settle that comes this late is still
/// charged its excess; one that comes later is answered "unknown".
pub const RETAIN_AFTER_EXPIRY: u64 = 1;

/// How long a settled reservation's record stays to answer the same
/// settle again (µs): a minute, or until it would have gone unsettled if
/// that is sooner. A settle sent later is answered "unknown". (Kept for its
/// whole retention, settled records would fill the store at a few thousand
/// reservations a second.)
pub const SETTLED_KEPT_US: u64 = 60_000_000;

/// A reservation's name: 128 bits, unguessable in practice (from the
/// process's random hash keys and a counter), written as 32 lowercase hex
/// digits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReservationId(pub u128);

impl ReservationId {
    /// A new id, never the same twice in this process and random across
    /// processes.
    pub fn new() -> Self {
        ReservationId((u128::from(random_half(1)) << 64) | u128::from(random_half(2)))
    }
}

/// 64 bits never drawn twice in this process (for a `salt`) and random
/// across processes: a counter hashed with the process's random keys.
fn random_half(salt: u64) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static SEQ: AtomicU64 = AtomicU64::new(0);
    static KEYS: std::sync::OnceLock<(std::collections::hash_map::RandomState, u64)> = std::sync::OnceLock::new();
    let (state, start) = KEYS.get_or_init(|| {
        let state = std::collections::hash_map::RandomState::new();
        let start = state.hash_one(crate::Clock::now_us(&crate::SystemClock::new()));
        (state, start)
    });
    let n = SEQ.fetch_add(1, Ordering::Relaxed);
    let mut h = state.build_hasher();
    h.write_u64(*start);
    h.write_u64(n);
    h.write_u64(salt);
    h.finish()
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

impl Adjust {
    /// The hits charged late and the hits returned.
    pub fn amounts(self) -> (u64, u64) {
        match self {
            Adjust::Nothing => (0, 0),
            Adjust::Late(h) => (h, 0),
            Adjust::Return { hits, .. } => (0, hits),
        }
    }
}

/// One limit's share of a reservation: the estimate it took, when, and
/// until when a settle may return what was not used (its rule's
/// `reservation_ttl` after the reserve).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part<P> {
    /// What the store needs to adjust the counter (its key and limit).
    pub payload: P,
    /// The hits the reserve took.
    pub estimate: u64,
    /// When it took them (µs since the epoch).
    pub taken_at_us: u64,
    /// When the part expires unsettled, keeping its estimate (µs).
    pub expires_at_us: u64,
}

impl<P> Part<P> {
    /// What settling this part at `actual` hits at `now_us` does: see the
    /// module's rules.
    pub fn adjust(&self, actual: u64, now_us: u64) -> Adjust {
        if actual > self.estimate {
            Adjust::Late(actual - self.estimate)
        } else if actual < self.estimate && !self.expired(now_us) {
            Adjust::Return { hits: self.estimate - actual, taken_at_us: self.taken_at_us }
        } else {
            Adjust::Nothing
        }
    }

    /// Whether the part had expired unsettled at `now_us`.
    pub fn expired(&self, now_us: u64) -> bool {
        now_us >= self.expires_at_us
    }

    /// When the record of this part may be dropped: its ttl
    /// ([`RETAIN_AFTER_EXPIRY`] times) after its expiry.
    pub fn retained_until_us(&self) -> u64 {
        let ttl = self.expires_at_us.saturating_sub(self.taken_at_us);
        self.expires_at_us.saturating_add(ttl.saturating_mul(RETAIN_AFTER_EXPIRY))
    }
}

/// A reservation: its parts, and its settle once made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation<P, R> {
    /// One per limit the reserve took from, in the request's order (none
    /// once settled: the answer says all a settle sent again needs).
    pub parts: Vec<Part<P>>,
    /// The amounts it was settled at (one per part), and the answer given.
    pub settled: Option<(Amounts<u64>, R)>,
    /// When the record may be dropped: when every part's may.
    retain_until_us: u64,
}

impl<P, R> Reservation<P, R> {
    /// A reservation of `parts`, not settled.
    pub fn new(parts: Vec<Part<P>>) -> Self {
        let retain_until_us = parts.iter().map(Part::retained_until_us).max().unwrap_or(0);
        Reservation { parts, settled: None, retain_until_us }
    }
}

/// Why a settle cannot be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReservationError {
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
    /// The store keeps no reservations.
    #[error("this store keeps no reservations: {0}")]
    Unsupported(&'static str),
    /// The store could not be asked.
    #[error(transparent)]
    Store(#[from] crate::StoreError),
    /// The store holds as many reservations as it may.
    #[error(
        "{max} reservations held, the most this store keeps: settle or cancel them, or wait for them to expire (a record outlives its expiry by its reservation_ttl)"
    )]
    Full {
        /// The bound.
        max: usize,
    },
}

/// The amount of each of `parts` parts a settle at `actual` gives: one
/// amount for every part, or one per part.
pub fn amounts(parts: usize, actual: &[u64]) -> Result<Amounts<u64>, ReservationError> {
    match actual {
        [one] => Ok(smallvec::smallvec![*one; parts]),
        many if many.len() == parts => Ok(Amounts::from_slice(many)),
        many => Err(ReservationError::Amounts { parts, given: many.len() }),
    }
}

/// One value per part of a reservation (most have a few: kept inline).
pub type Amounts<T> = smallvec::SmallVec<[T; 4]>;

/// What a settle may do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim<R> {
    /// Settle now: each part's adjustment, in order.
    First(Amounts<Adjust>),
    /// Settled before with these amounts: the first settle's answer.
    Again(R),
}

impl<P, R: Clone> Reservation<P, R> {
    /// The amounts per part for `actual`: one amount for every part, or one
    /// per part.
    pub fn amounts(&self, actual: &[u64]) -> Result<Amounts<u64>, ReservationError> {
        amounts(self.settled.as_ref().map_or(self.parts.len(), |(a, _)| a.len()), actual)
    }

    /// Claim the settle at `actual` at `now_us`: the adjustments to make
    /// (the caller records the answer in `settled`), or the first settle's
    /// answer, or a conflict.
    pub fn claim(&self, actual: &[u64], now_us: u64) -> Result<Claim<R>, ReservationError> {
        let amounts = self.amounts(actual)?;
        if let Some((settled, answer)) = &self.settled {
            return if *settled == amounts {
                Ok(Claim::Again(answer.clone()))
            } else {
                Err(ReservationError::Conflict { settled: settled.to_vec() })
            };
        }
        Ok(Claim::First(self.parts.iter().zip(&amounts).map(|(p, &a)| p.adjust(a, now_us)).collect()))
    }

    /// When the record may be dropped: when every part's may, or (settled)
    /// [`SETTLED_KEPT_US`] after its settle if that is sooner.
    pub fn retained_until_us(&self) -> u64 {
        self.retain_until_us
    }
}

/// What a part of a store's reservation holds: the counter it took from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// The counter key.
    pub key: std::sync::Arc<str>,
    /// The limit (as it was at the reserve: a reload since does not change
    /// what the reservation took).
    pub limit: crate::Limit,
    /// Which regions share it.
    pub scope: crate::region::Scope,
}

/// One part of a settle's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SettledPart {
    /// The counter key.
    pub key: std::sync::Arc<str>,
    /// The limit.
    pub limit: crate::Limit,
    /// Which regions share it.
    pub scope: crate::region::Scope,
    /// The hits reserved.
    pub estimate: u64,
    /// The hits settled.
    pub actual: u64,
    /// The hits the settle charged late (the excess over the estimate).
    pub charged_late: u64,
    /// The hits it gave back as never taken.
    pub returned: u64,
    /// Whether the part had expired unsettled (it kept its estimate).
    pub expired: bool,
    /// The limit after the settle (a peek), or why the store could not
    /// adjust it.
    pub decision: Result<crate::Decision, crate::StoreError>,
}

/// A settle's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settled {
    /// One per part, in the reserve's order (shared: the record keeps it
    /// for a settle sent again).
    pub parts: std::sync::Arc<[SettledPart]>,
    /// This settle repeated an earlier one (nothing was done again).
    pub again: bool,
}

/// The checks that adjust `parts` as `adjust` says, one per part (a peek
/// for [`Adjust::Nothing`]: the answer reads every part's counter).
pub fn adjustments<'a>(parts: &'a [Part<Held>], adjust: &[Adjust]) -> Amounts<crate::Check<'a>> {
    let mut checks = Amounts::with_capacity(parts.len());
    for (p, a) in parts.iter().zip(adjust) {
        let (hits, op) = match *a {
            Adjust::Nothing => (0, crate::Op::Take),
            Adjust::Late(h) => (h, crate::Op::Late),
            Adjust::Return { hits, taken_at_us } => (hits, crate::Op::Return { taken_at_us }),
        };
        checks.push(crate::Check {
            key: &p.payload.key,
            limit: &p.payload.limit,
            hits,
            op,
            enforce: false,
            scope: p.payload.scope,
        });
    }
    checks
}

/// A settle's answer from its parts, amounts, adjustments and the store's
/// results of [`adjustments`] at `now_us`.
pub fn settled(
    parts: &[Part<Held>],
    amounts: &[u64],
    adjust: &[Adjust],
    results: Vec<Result<crate::Decision, crate::StoreError>>,
    now_us: u64,
) -> Settled {
    let parts = parts
        .iter()
        .zip(amounts)
        .zip(adjust)
        .zip(results)
        .map(|(((p, &actual), &adjust), decision)| SettledPart {
            key: p.payload.key.clone(),
            limit: p.payload.limit.clone(),
            scope: p.payload.scope,
            estimate: p.estimate,
            actual,
            charged_late: adjust.amounts().0,
            returned: adjust.amounts().1,
            expired: p.expired(now_us),
            decision: decision.map(|mut d| {
                // What the settle answers is the counter after it: allowed
                // (a settle denies nothing), however a peek would gate.
                d.allowed = true;
                d
            }),
        })
        .collect();
    Settled { parts, again: false }
}

/// Reservations kept in this process (the memory store's): in sharded
/// slabs, each record dropped once [`Reservation::retained_until_us`] has
/// passed (when met; and each shard keeps its records in the order they
/// came, so an insert drops the ones whose time has passed from the front:
/// no scan), at most [`MAX_RESERVATIONS`] at once.
///
/// A record's id names its place: its shard, its slot and the slot's
/// generation (a slot is reused once its record has gone), beside 64 random
/// bits that make it unguessable; a settle finds it without hashing, and
/// slots are reused while hot in the cache.
#[derive(Debug)]
pub struct Ledger<P, R> {
    shards: Box<[Mutex<Records<P, R>>]>,
    /// Records held (kept beside the shards' counts, read without a lock).
    held: std::sync::atomic::AtomicUsize,
    /// When a full ledger may next sweep every shard (µs).
    next_full_sweep_us: AtomicU64,
    /// The shard of the next insert (round robin).
    next_shard: std::sync::atomic::AtomicUsize,
    /// The most records held at once.
    max: usize,
}

/// The most reservations the memory store keeps at once: a reserve beyond
/// that is refused ([`ReservationError::Full`]). A record is a few hundred
/// bytes: about 300 MiB at the bound.
pub const MAX_RESERVATIONS: usize = 1 << 20;

/// Shards of a ledger (at most 256: an id names its shard in 8 bits).
const SHARDS: usize = 16;

/// A slot's generation: 24 bits of an id.
const GENERATIONS: u32 = 1 << 24;

/// One place of a shard: its generation, the random half of its record's
/// id, and the record (`None`: free).
#[derive(Debug)]
struct Slot<P, R> {
    generation: u32,
    tag: u64,
    record: Option<Reservation<P, R>>,
}

#[derive(Debug)]
struct Records<P, R> {
    slots: Vec<Slot<P, R>>,
    /// Free slots.
    free: Vec<u32>,
    /// Each record's slot and generation with when it may be dropped, in
    /// the order they came. Not sorted when ttls differ: a record behind a
    /// longer-lived one waits for it (at most the longest ttl twice).
    order: std::collections::VecDeque<(u64, u32, u32)>,
    /// The same for settled records, in the order they were settled (kept
    /// [`SETTLED_KEPT_US`]: sorted).
    settled: std::collections::VecDeque<(u64, u32, u32)>,
}

/// Where an id says its record is: (shard, slot, generation, tag).
fn place(id: ReservationId) -> (usize, u32, u32, u64) {
    let low = id.0 as u64;
    ((low >> 56) as usize, low as u32, ((low >> 32) as u32) & (GENERATIONS - 1), (id.0 >> 64) as u64)
}

impl<P, R> Records<P, R> {
    /// The record in `slot` of `generation` and `tag`, if it is there.
    fn get_mut(&mut self, slot: u32, generation: u32, tag: u64) -> Option<&mut Reservation<P, R>> {
        let s = self.slots.get_mut(slot as usize)?;
        if s.generation != generation || s.tag != tag {
            return None;
        }
        s.record.as_mut()
    }

    /// Free `slot` (its record dropped); whether it held one.
    fn free(&mut self, slot: u32) -> bool {
        let s = &mut self.slots[slot as usize];
        let held = s.record.take().is_some();
        if held {
            s.generation = (s.generation + 1) % GENERATIONS;
            self.free.push(slot);
        }
        held
    }

    /// Drop the records at the front of either queue whose time has passed
    /// at `now_us`; how many.
    fn expire(&mut self, now_us: u64) -> usize {
        let mut dropped = 0;
        for settled in [false, true] {
            loop {
                let queue = if settled { &mut self.settled } else { &mut self.order };
                let Some(&(until, slot, generation)) = queue.front() else { break };
                if until > now_us {
                    break;
                }
                queue.pop_front();
                // A slot freed early (settled, or a settle after its
                // retention) may hold a later record: only this
                // generation's goes.
                if self.slots[slot as usize].generation == generation && self.free(slot) {
                    dropped += 1;
                }
            }
        }
        // Settled records leave their first entry behind: when those pile
        // up, keep only the live ones (amortized: the queue at least
        // halves).
        if self.order.len() > 1024 && self.order.len() > 2 * (self.slots.len() - self.free.len()) {
            let slots = &self.slots;
            self.order.retain(|&(_, slot, generation)| {
                let s = &slots[slot as usize];
                s.generation == generation && s.record.is_some()
            });
        }
        dropped
    }
}

impl<P, R> Default for Ledger<P, R> {
    fn default() -> Self {
        Ledger {
            shards: (0..SHARDS)
                .map(|_| {
                    Mutex::new(Records {
                        slots: Vec::new(),
                        free: Vec::new(),
                        order: std::collections::VecDeque::new(),
                        settled: std::collections::VecDeque::new(),
                    })
                })
                .collect(),
            held: std::sync::atomic::AtomicUsize::new(0),
            next_full_sweep_us: AtomicU64::new(0),
            next_shard: std::sync::atomic::AtomicUsize::new(0),
            max: MAX_RESERVATIONS,
        }
    }
}

impl<P, R: Clone> Ledger<P, R> {
    fn lock(&self, shard: usize) -> std::sync::MutexGuard<'_, Records<P, R>> {
        self.shards[shard].lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Keep `r` under a new id at `now_us`.
    pub fn insert(&self, r: Reservation<P, R>, now_us: u64) -> ReservationId {
        let tag = random_half(3);
        let until = r.retained_until_us();
        let shard = self.next_shard.fetch_add(1, Ordering::Relaxed) % self.shards.len();
        let mut records = self.lock(shard);
        let dropped = records.expire(now_us);
        self.held.fetch_sub(dropped, Ordering::Relaxed);
        let slot = match records.free.pop() {
            Some(slot) => slot,
            None => {
                records.slots.push(Slot { generation: 0, tag: 0, record: None });
                u32::try_from(records.slots.len() - 1).expect("fewer than 2^32 slots (MAX_RESERVATIONS)")
            }
        };
        let s = &mut records.slots[slot as usize];
        s.tag = tag;
        s.record = Some(r);
        let generation = s.generation;
        records.order.push_back((until, slot, generation));
        drop(records);
        self.held.fetch_add(1, Ordering::Relaxed);
        let low = ((shard as u64) << 56) | (u64::from(generation) << 32) | u64::from(slot);
        ReservationId((u128::from(tag) << 64) | u128::from(low))
    }

    /// A ledger of at most `max` records.
    pub fn with_max(max: usize) -> Self {
        Ledger { max, ..Ledger::default() }
    }

    /// The most records it holds at once.
    pub fn max(&self) -> usize {
        self.max
    }

    /// Whether a new reservation would exceed [`Ledger::max`] at `now_us`
    /// (a full ledger sweeps every shard first, at most once a second).
    pub fn full(&self, now_us: u64) -> bool {
        if self.held.load(Ordering::Relaxed) < self.max {
            return false;
        }
        if self.next_full_sweep_us.fetch_max(now_us + 1_000_000, Ordering::Relaxed) <= now_us {
            self.sweep(now_us);
        }
        self.held.load(Ordering::Relaxed) >= self.max
    }

    /// Settle `id` at `actual` at `now_us`: `apply` makes the adjustments
    /// of a first settle (given the parts, the amounts per part and their
    /// adjustments) and returns the answer, which is recorded; a second
    /// settle with the same amounts answers it again (and `true`: a
    /// repeat). The shard's lock is held throughout, so two settles of one
    /// reservation never both apply.
    pub fn settle(
        &self,
        id: ReservationId,
        actual: &[u64],
        now_us: u64,
        apply: impl FnOnce(&[Part<P>], &[u64], &[Adjust]) -> R,
    ) -> Result<(R, bool), ReservationError> {
        let (shard, slot, generation, tag) = place(id);
        if shard >= self.shards.len() {
            return Err(ReservationError::Unknown);
        }
        let mut records = self.lock(shard);
        let retained = match records.get_mut(slot, generation, tag) {
            None => return Err(ReservationError::Unknown),
            Some(r) => now_us < r.retained_until_us(),
        };
        if !retained {
            records.free(slot);
            self.held.fetch_sub(1, Ordering::Relaxed);
            return Err(ReservationError::Unknown);
        }
        let r = records.get_mut(slot, generation, tag).expect("found above, under the same lock");
        let (answer, until) = match r.claim(actual, now_us)? {
            Claim::Again(answer) => return Ok((answer, true)),
            Claim::First(adjust) => {
                let amounts = r.amounts(actual)?;
                let answer = apply(&r.parts, &amounts, &adjust);
                r.settled = Some((amounts, answer.clone()));
                r.parts = Vec::new();
                r.retain_until_us = r.retain_until_us.min(now_us.saturating_add(SETTLED_KEPT_US));
                (answer, r.retain_until_us)
            }
        };
        records.settled.push_back((until, slot, generation));
        Ok((answer, false))
    }

    /// Drop the records whose retention has passed at `now_us`; how many.
    pub fn sweep(&self, now_us: u64) -> usize {
        self.shards
            .iter()
            .map(|s| {
                let mut s = s.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                let dropped = s.expire(now_us);
                self.held.fetch_sub(dropped, Ordering::Relaxed);
                dropped
            })
            .sum()
    }

    /// Records held.
    pub fn len(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    /// Whether no record is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The memory store's reservations (and a memory region's: the region is
/// one process).
pub type Book = Ledger<Held, Settled>;

impl Book {
    /// Reserve at `now_us`: refused when the ledger is full; else `decide`
    /// decides `checks` all or nothing into `out` (at `now_us`), and what
    /// they took is kept ([`Book::keep`]).
    pub fn reserve_with(
        &self,
        checks: &[crate::Check<'_>],
        ttls_us: &[u64],
        now_us: u64,
        out: &mut Vec<Result<crate::Decision, crate::StoreError>>,
        decide: impl FnOnce(&mut Vec<Result<crate::Decision, crate::StoreError>>),
    ) -> Result<Option<ReservationId>, ReservationError> {
        if self.full(now_us) {
            out.clear();
            return Err(ReservationError::Full { max: self.max });
        }
        decide(out);
        Ok(self.keep(checks, out, ttls_us, now_us))
    }

    /// Keep what an allowed request's `checks` took at `now_us` (their
    /// store `results`; `ttls_us` each check's `reservation_ttl`): one part
    /// per check that takes (a peek too: a settle charges its actual amount
    /// late). `None` when the request was denied (it took nothing) or has
    /// no such check.
    pub fn keep(
        &self,
        checks: &[crate::Check<'_>],
        results: &[Result<crate::Decision, crate::StoreError>],
        ttls_us: &[u64],
        now_us: u64,
    ) -> Option<ReservationId> {
        let denied = checks.iter().zip(results).any(|(c, r)| c.enforce && r.as_ref().is_ok_and(|d| !d.allowed));
        if denied {
            return None;
        }
        let parts: Vec<Part<Held>> = checks
            .iter()
            .zip(results)
            .zip(ttls_us)
            .filter(|((c, r), _)| c.reserves() && r.as_ref().is_ok_and(|d| d.allowed))
            .map(|((c, _), &ttl)| Part {
                payload: Held { key: c.key.into(), limit: c.limit.clone(), scope: c.scope },
                estimate: c.hits,
                taken_at_us: now_us,
                expires_at_us: now_us.saturating_add(ttl),
            })
            .collect();
        if parts.is_empty() {
            return None;
        }
        Some(self.insert(Reservation::new(parts), now_us))
    }

    /// Settle `id` at `actual` at `now_us`, `apply` deciding the
    /// adjustments' checks (all at `now_us`; each is never denied).
    pub fn settle_with(
        &self,
        id: ReservationId,
        actual: &[u64],
        now_us: u64,
        apply: impl FnOnce(&[crate::Check<'_>], &mut Vec<Result<crate::Decision, crate::StoreError>>),
    ) -> Result<Settled, ReservationError> {
        let (mut answer, again) = self.settle(id, actual, now_us, |parts, amounts, adjust| {
            let checks = adjustments(parts, adjust);
            let mut out = Vec::with_capacity(checks.len());
            apply(&checks, &mut out);
            settled(parts, amounts, adjust, out, now_us)
        })?;
        answer.again = again;
        Ok(answer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000;

    fn reservation(estimates: &[u64]) -> Reservation<&'static str, String> {
        Reservation::new(
            estimates
                .iter()
                .map(|&e| Part { payload: "k", estimate: e, taken_at_us: 0, expires_at_us: 300 * S })
                .collect(),
        )
    }

    #[test]
    fn a_settle_charges_the_excess_late_and_returns_the_rest_as_never_taken() {
        let r = reservation(&[100]);
        let first = |a: u64, now: u64| match r.claim(&[a], now).unwrap() {
            Claim::First(adjust) => adjust[0],
            Claim::Again(_) => unreachable!(),
        };
        assert_eq!(first(130, 10 * S), Adjust::Late(30));
        assert_eq!(first(40, 10 * S), Adjust::Return { hits: 60, taken_at_us: 0 });
        assert_eq!(first(100, 10 * S), Adjust::Nothing);
        assert_eq!(first(0, 10 * S), Adjust::Return { hits: 100, taken_at_us: 0 }, "cancel");
        // Expired unsettled: it kept its estimate; the excess is still
        // charged, nothing is returned.
        assert_eq!(first(130, 300 * S), Adjust::Late(30));
        assert_eq!(first(40, 300 * S), Adjust::Nothing);
    }

    #[test]
    fn amounts_are_one_for_all_or_one_per_part() {
        let r = reservation(&[10, 20]);
        assert_eq!(r.amounts(&[5]).unwrap().as_slice(), [5, 5]);
        assert_eq!(r.amounts(&[5, 25]).unwrap().as_slice(), [5, 25]);
        assert_eq!(r.amounts(&[1, 2, 3]), Err(ReservationError::Amounts { parts: 2, given: 3 }));
        assert_eq!(r.amounts(&[]), Err(ReservationError::Amounts { parts: 2, given: 0 }));
    }

    #[test]
    fn a_reservation_settles_once_and_answers_the_same_settle_again() {
        let ledger: Ledger<&'static str, String> = Ledger::default();
        let id = ledger.insert(reservation(&[10, 20]), 0);
        let mut applied = 0;
        let answer = ledger
            .settle(id, &[5, 25], 10 * S, |parts, amounts, adjust| {
                applied += 1;
                assert_eq!(parts.len(), 2);
                assert_eq!(amounts, [5, 25]);
                format!("{adjust:?}")
            })
            .unwrap();
        assert_eq!(answer, ("[Return { hits: 5, taken_at_us: 0 }, Late(5)]".to_owned(), false));
        let again = ledger.settle(id, &[5, 25], 11 * S, |_, _, _| unreachable!("settled once")).unwrap();
        assert_eq!(again, (answer.0, true));
        assert_eq!(applied, 1);
        assert_eq!(
            ledger.settle(id, &[6, 25], 11 * S, |_, _, _| unreachable!()),
            Err(ReservationError::Conflict { settled: vec![5, 25] })
        );
        assert_eq!(
            ledger.settle(ReservationId(1), &[1], 11 * S, |_, _, _| unreachable!()),
            Err(ReservationError::Unknown)
        );
    }

    #[test]
    fn a_record_outlives_its_expiry_by_its_ttl_then_is_unknown() {
        let ledger: Ledger<&'static str, String> = Ledger::default();
        let id = ledger.insert(reservation(&[10]), 0);
        let late = ledger.settle(id, &[5], 599 * S, |_, _, adjust| format!("{adjust:?}")).unwrap();
        assert_eq!(late.0, "[Nothing]", "expired: it kept its estimate");
        let gone = ledger.insert(reservation(&[10]), 0);
        assert_eq!(ledger.sweep(599 * S), 0);
        assert_eq!(ledger.sweep(600 * S), 2);
        assert_eq!(ledger.settle(gone, &[15], 600 * S, |_, _, _| unreachable!()), Err(ReservationError::Unknown));
        assert!(ledger.is_empty());
    }

    #[test]
    fn a_settled_record_answers_again_for_a_minute_then_goes() {
        let ledger: Ledger<&'static str, String> = Ledger::default();
        let id = ledger.insert(reservation(&[10]), 0);
        let settle = |now| ledger.settle(id, &[4], now, |_, _, a| format!("{a:?}"));
        let first = settle(10 * S).unwrap();
        assert_eq!(settle(69 * S).unwrap(), (first.0, true), "sent again within the minute");
        assert_eq!(ledger.sweep(69 * S), 0);
        assert_eq!(ledger.sweep(70 * S), 1, "a minute after its settle, not at 600 s");
        assert_eq!(settle(70 * S), Err(ReservationError::Unknown));
        assert!(ledger.is_empty());
        // Settled records do not pile up their first entries.
        for i in 0..40_000 {
            let id = ledger.insert(reservation(&[1]), i);
            ledger.settle(id, &[1], i, |_, _, _| String::new()).unwrap();
        }
        // A minute on, an insert in each shard drops the settled records.
        for _ in 0..SHARDS {
            ledger.insert(reservation(&[1]), 100 * S);
        }
        assert_eq!(ledger.len(), SHARDS);
        let queued: usize = ledger.shards.iter().map(|s| s.lock().unwrap().order.len()).sum();
        assert!(queued <= 2 * SHARDS, "{queued} entries queued for {SHARDS} records");
    }

    #[test]
    fn a_reused_slot_answers_only_its_own_record() {
        let ledger: Ledger<&'static str, String> = Ledger::default();
        // One shard's first slot, dropped at 600 s.
        let old = ledger.insert(reservation(&[10]), 0);
        assert_eq!(ledger.sweep(600 * S), 1);
        // Its slot is reused (a shard every insert: go round to it).
        let later = || {
            let part = Part { payload: "k", estimate: 10, taken_at_us: 600 * S, expires_at_us: 900 * S };
            Reservation::new(vec![part])
        };
        let new = ledger.insert(later(), 600 * S);
        let again =
            (0..SHARDS).map(|_| ledger.insert(later(), 600 * S)).find(|id| place(*id).0 == place(old).0).unwrap();
        assert_eq!((place(again).0, place(again).1), (place(old).0, place(old).1), "the same slot");
        assert_ne!(place(again).2, place(old).2, "another generation");
        let settle = |id| ledger.settle(id, &[1], 601 * S, |_, _, a| format!("{a:?}"));
        assert_eq!(settle(old), Err(ReservationError::Unknown), "the old record's id");
        assert!(settle(again).is_ok());
        assert!(settle(new).is_ok());
        // The right place with another random half is no one's.
        let forged = ReservationId(again.0 ^ (1u128 << 100));
        assert_eq!(settle(forged), Err(ReservationError::Unknown));
        assert_eq!(settle(ReservationId(u128::MAX)), Err(ReservationError::Unknown), "no such shard");
    }

    #[test]
    fn a_full_ledger_refuses_until_records_have_gone() {
        let ledger: Ledger<&'static str, String> = Ledger::with_max(3);
        for _ in 0..3 {
            assert!(!ledger.full(0));
            ledger.insert(reservation(&[1]), 0);
        }
        assert!(ledger.full(0), "three held, three the most");
        assert!(ledger.full(599 * S), "retained until 600 s");
        assert!(!ledger.full(600 * S), "swept once they have gone");
        assert_eq!(ledger.len(), 0);
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
