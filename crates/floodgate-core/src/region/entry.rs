//! One global key's state in one region: its own component and the
//! components peers sent, per slot; for the GCRA family also the local
//! bucket, into which peers' usage is poured as debt.

use crate::region::incarnations::Incarnations;
use crate::region::wire::Shape;
use crate::region::{SyncMode, slice};
use crate::state::Inner;
use crate::{Algorithm, Decision, Limit, State};

/// The rule a region decides a key with (from its own rules). The limit is
/// shared by every key of the rule (a `Limit` is 128 bytes; a key's whole
/// entry is about that without it).
#[derive(Debug, Clone)]
pub(crate) struct RuleMeta {
    pub(crate) limit: std::sync::Arc<Limit>,
    pub(crate) mode: SyncMode,
    pub(crate) fingerprint: u64,
}

/// A peer region's (or an earlier incarnation's) count in one slot: hits
/// taken and hits given back, each the largest heard.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Comp {
    pub(crate) region: u16,
    pub(crate) incarnation: u64,
    pub(crate) count: u64,
    pub(crate) back: u64,
}

/// One slot: this region's own counts, what each peer acknowledged of
/// them, and the other components.
#[derive(Debug, Clone)]
pub(crate) struct Slot {
    pub(crate) id: u64,
    /// Hits taken here: admitted, and charged after the work (`late`).
    pub(crate) own: u64,
    /// Of `own`, the hits charged after the work: never refused, so exempt
    /// from the bounded slice (and not what acknowledgements measure).
    pub(crate) late: u64,
    /// Hits given back here (refunds), never decreasing.
    pub(crate) back: u64,
    /// Per peer: the largest count of admitted hits (`own - late`) it
    /// acknowledged.
    pub(crate) acked: Box<[u64]>,
    pub(crate) comps: Vec<Comp>,
}

impl Slot {
    /// A slot; `acks`: whether to keep what peers acknowledged (a bounded
    /// rule's slice reads it; an eventual one's never does, and allocates
    /// nothing for it).
    fn new(id: u64, peers: usize, acks: bool) -> Self {
        let acked = if acks { vec![0; peers].into_boxed_slice() } else { Box::default() };
        Slot { id, own: 0, late: 0, back: 0, acked, comps: Vec::new() }
    }

    /// Give back up to `hits` of this region's own here, never more than
    /// it took (less what it gave back already); the hits given back.
    fn give(&mut self, hits: u64) -> u64 {
        let g = hits.min(self.own.saturating_sub(self.back));
        self.back += g;
        g
    }

    /// Every region's hits in the slot: each component's taken less given
    /// back, never below zero.
    pub(crate) fn total(&self) -> u64 {
        self.comps
            .iter()
            .fold(self.own.saturating_sub(self.back), |s, c| s.saturating_add(c.count.saturating_sub(c.back)))
    }

    /// Own hits admitted at request time (the slice's concern).
    pub(crate) fn admitted(&self) -> u64 {
        self.own.saturating_sub(self.late)
    }

    /// Own admitted hits not yet acknowledged by every peer (0 where acks
    /// are not kept: eventual rules). Late charges are not counted: they
    /// cannot be refused, so the slice does not bound them.
    fn unacked(&self) -> u64 {
        let admitted = self.admitted();
        let least = self.acked.iter().copied().min().unwrap_or(admitted);
        admitted.saturating_sub(least)
    }
}

/// A key's state.
#[derive(Debug, Clone, Default)]
pub(crate) struct Entry {
    pub(crate) shape: Option<Shape>,
    pub(crate) rule: Option<RuleMeta>,
    /// The GCRA family's local bucket, peers' debt included.
    pub(crate) tat: State,
    /// GCRA debt from peers that arrived before this region knew the rule,
    /// in hits, and when the first of it arrived.
    pub(crate) pending: u64,
    pub(crate) pending_since: u64,
    /// Ascending by id.
    /// The current one inline: a fixed window's only slot is no heap
    /// object of its own.
    pub(crate) slots: smallvec::SmallVec<[Slot; 1]>,
    /// Bit `p`: queued to be sent to peer `p`.
    pub(crate) queued: u64,
    /// Bit `p`: send peer `p` every component, not only this region's own
    /// (others' components this region relays).
    pub(crate) relay: u64,
    /// Own hits admitted since the key was last queued for the peers.
    pub(crate) unsent: u64,
    /// Waiting in the table's lazy list (sent within the lazy period).
    pub(crate) lazy: bool,
    /// The GCRA family under a bounded rule: the deaths of incarnations
    /// whose debt is in the bucket already (see `incarnations`).
    pub(crate) deaths_seen: u32,
}

/// When a decision's own hits go to the peers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Send {
    /// Nothing changed.
    No,
    /// At the next batch: the hits can matter soon.
    Now,
    /// Within the lazy period: the key is far below its limit.
    Later,
}

/// GCRA slots per full refill time.
pub(crate) const GCRA_SLOTS_PER_REFILL: u128 = 4;

/// What kind of counts a limit keeps; `None` for `sliding_log` and
/// `concurrency`, which cannot be global.
pub fn shape_of(limit: &Limit) -> Option<Shape> {
    let w = limit.window_us();
    Some(match limit.algorithm() {
        Algorithm::FixedWindow => Shape::Windowed { slot_us: w, horizon: 1 },
        Algorithm::SlidingWindow => Shape::Windowed { slot_us: w, horizon: 2 },
        Algorithm::SlidingBuckets { granularity } => {
            Shape::Windowed { slot_us: w / u64::from(*granularity), horizon: *granularity }
        }
        Algorithm::SlidingLog | Algorithm::Concurrency => return None,
        Algorithm::Gcra { .. } | Algorithm::TokenBucket { .. } | Algorithm::LeakyBucket { .. } => {
            // A quarter of the full refill time, after which a hit's debt
            // has drained: debt is dated to the end of its slot, so a
            // coarser slot would overstate late usage by more.
            let refill = u128::from(limit.burst()) * u128::from(w) / u128::from(limit.limit().max(1));
            let slot = refill.div_ceil(GCRA_SLOTS_PER_REFILL);
            Shape::Gcra { slot_us: u64::try_from(slot).unwrap_or(u64::MAX).max(w.min(1_000)).max(1) }
        }
    })
}

/// The digest a region sends with a key's components: the limit's own
/// fingerprint and the sync mode.
pub fn fingerprint(limit: &Limit, mode: SyncMode) -> u64 {
    let m = match mode {
        SyncMode::Eventual => 0,
        SyncMode::Bounded { overshoot_ppm } => u64::from(overshoot_ppm) + 1,
    };
    (u64::from(limit.fingerprint()) << 32) ^ m.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// What a region may still admit beyond what it knows, when that is
/// bounded: the slice of a `bounded` rule, and while the region is warming
/// (restarted, not every peer has sent it their state) at most its slice,
/// or for an `eventual` rule its share of the limit.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Caps {
    pub(crate) regions: usize,
    pub(crate) warming: bool,
    /// The wait suggested to a request the caps deny (µs): about one sync
    /// round trip.
    pub(crate) retry_us: u64,
    /// Send every change at the next batch (a link is failing).
    pub(crate) eager: bool,
    /// Bounded rules admit nothing: not every peer has recorded this
    /// incarnation yet (or a later one of this region exists).
    pub(crate) closed: bool,
    /// Eventual rules admit nothing: no peer's full state yet, and the
    /// warm-up wait not over.
    pub(crate) cold: bool,
}

impl Entry {
    /// The rule to decide with. A changed limit starts fresh, as anywhere
    /// else (DESIGN: a limit whose parameters changed keeps no counters):
    /// this region's own state, that is, its own counts of a window
    /// algorithm, the local bucket of the GCRA family, and when the shape
    /// changed every count. Peers' counts of the same shape stay, as
    /// theirs; what peers hold of this region's own counts stays too (the
    /// maximum never decreases: stricter there for the rest of the slot).
    /// A Redis region does the same (the state key is named by the limit).
    /// `shared` gives the copy of `limit` every key of the rule shares.
    pub(crate) fn set_rule(
        &mut self,
        limit: &Limit,
        mode: SyncMode,
        shape: Shape,
        peers: usize,
        shared: impl FnOnce() -> std::sync::Arc<Limit>,
    ) {
        let fingerprint = fingerprint(limit, mode);
        if self.rule.as_ref().is_some_and(|r| r.fingerprint == fingerprint) {
            return;
        }
        if self.shape.is_some_and(|s| s != shape) {
            self.slots.clear();
            self.tat = State::new();
            self.pending = 0;
        } else if let Some(old) = &self.rule
            && old.limit.fingerprint() != limit.fingerprint()
        {
            match shape {
                // Fresh: what it took less what it gave back is zero, and
                // the given-back count stays (it never decreases), as a
                // Redis region's new state key starts at zero beside its
                // given-back counts.
                Shape::Windowed { .. } => self.slots.iter_mut().for_each(|s| {
                    s.own = s.back;
                    s.late = 0;
                }),
                Shape::Gcra { .. } => self.tat = State::new(),
            }
        }
        self.shape = Some(shape);
        self.rule = Some(RuleMeta { limit: shared(), mode, fingerprint });
        if matches!(mode, SyncMode::Bounded { .. }) {
            // Now bounded: slots kept from an eventual rule had no
            // acknowledgements; count all their hits as unacknowledged.
            for s in &mut self.slots {
                if s.acked.len() != peers {
                    s.acked = vec![0; peers].into_boxed_slice();
                }
            }
        }
        self.drain_pending();
    }

    /// Pour GCRA debt that arrived before the rule was known into the bucket.
    fn drain_pending(&mut self) {
        if self.pending == 0 {
            return;
        }
        if let Some(r) = &self.rule {
            let (pending, since) = (self.pending, self.pending_since);
            self.pending = 0;
            add_debt(&r.limit, &mut self.tat, since, pending);
        }
    }

    /// The current slot id for `now`.
    fn slot_at(&self, now: u64) -> Option<u64> {
        self.shape.map(|s| now / s.slot_us())
    }

    /// Drop slots that no longer count at `now`.
    pub(crate) fn prune(&mut self, now: u64) {
        let Some(shape) = self.shape else { return };
        let cur = now / shape.slot_us();
        let oldest = (cur + 1).saturating_sub(shape.horizon());
        if self.slots.first().is_some_and(|s| s.id < oldest) {
            self.slots.retain(|s| s.id >= oldest);
        }
    }

    fn slot_mut(&mut self, id: u64, peers: usize) -> &mut Slot {
        let acks = self.rule.as_ref().is_none_or(|r| matches!(r.mode, SyncMode::Bounded { .. }));
        let i = match self.slots.binary_search_by_key(&id, |s| s.id) {
            Ok(i) => i,
            Err(i) => {
                if self.slots.len() == self.slots.capacity() {
                    // Room for as many as count at once, not twice what
                    // there is.
                    let horizon = usize::try_from(self.shape.map_or(1, |s| s.horizon())).unwrap_or(1).clamp(1, 64);
                    self.slots.reserve_exact(horizon.saturating_sub(self.slots.len()).max(1));
                }
                self.slots.insert(i, Slot::new(id, peers, acks));
                i
            }
        };
        &mut self.slots[i]
    }

    fn total(&self, id: u64) -> u64 {
        self.slots.binary_search_by_key(&id, |s| s.id).map_or(0, |i| self.slots[i].total())
    }

    /// Decide `hits` at `now` with the rule set by [`Entry::set_rule`]:
    /// the algorithm over the sum of every region's counts (the GCRA
    /// family: over the local bucket, peers' debt included), then the
    /// caps; admitted hits join this region's own component. Returns the
    /// decision and whether the own component changed.
    ///
    /// `late`: the hits are charged after the work whatever the limit's own
    /// charge (a reservation settled above its estimate); with hits 0, a
    /// plain peek (a refund's answer), not the gate of a limit charged
    /// after the work. Such a limit (`Charge::After`) charges every hit ≥ 1
    /// late. A late charge is never denied, by the algorithm or by the caps
    /// (the slice does not bound it), and counts into debt as in one
    /// region.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn decide(
        &mut self,
        limit: &Limit,
        now: u64,
        hits: u64,
        late: bool,
        peers: usize,
        caps: Caps,
        deaths: &Incarnations,
    ) -> (Decision, Send) {
        let late = late || (hits > 0 && limit.charge() == crate::Charge::After);
        let apply = |s: &mut State| if late { limit.charge_late(s, now, hits) } else { limit.apply(s, now, hits) };
        let (Some(mode), Some(shape)) = (self.rule.as_ref().map(|r| r.mode), self.shape) else {
            return (Decision::deny(0, 0, 0, None), Send::No);
        };
        self.prune(now);
        let cur = now / shape.slot_us();
        // Bounded: a slice for every dead incarnation that may have taken
        // its unacknowledged hits with it (see `incarnations`).
        let crash_slice = match mode {
            SyncMode::Bounded { overshoot_ppm } if deaths.deaths() > 0 => {
                let capacity = match shape {
                    Shape::Gcra { .. } => limit.burst(),
                    Shape::Windowed { .. } => limit.limit(),
                };
                slice(overshoot_ppm, capacity, caps.regions)
            }
            _ => 0,
        };
        let (d, gcra_state) = match (shape, limit.algorithm()) {
            (Shape::Gcra { .. }, _) => {
                if crash_slice > 0 && u64::from(self.deaths_seen) < deaths.deaths() {
                    let (debts, seen) = deaths.debts_after(u64::from(self.deaths_seen));
                    for (at, count) in debts {
                        add_debt(limit, &mut self.tat, at, crash_slice.saturating_mul(count));
                    }
                    self.deaths_seen = u32::try_from(seen).unwrap_or(u32::MAX);
                }
                let mut t = self.tat.clone();
                (apply(&mut t), Some(t))
            }
            (Shape::Windowed { horizon, slot_us }, algorithm) => {
                let charge = if crash_slice > 0 {
                    let from = (cur + 1).saturating_sub(u64::from(horizon)).saturating_mul(slot_us);
                    crash_slice.saturating_mul(deaths.charges(from, (cur + 1).saturating_mul(slot_us)))
                } else {
                    0
                };
                let mut synth = self.synthetic(algorithm, cur, horizon, charge);
                (apply(&mut synth), None)
            }
        };
        if !d.allowed || hits == 0 {
            return (d, Send::No);
        }
        // The caps: what this region may admit beyond what it knows.
        let capacity = match shape {
            Shape::Gcra { .. } => limit.burst(),
            Shape::Windowed { .. } => limit.limit(),
        };
        let own: u64 = self.slots.iter().map(Slot::admitted).sum();
        let unacked: u64 = self.slots.iter().map(Slot::unacked).sum();
        let cap = match mode {
            SyncMode::Bounded { overshoot_ppm } if caps.closed => {
                Some((0, slice(overshoot_ppm, capacity, caps.regions)))
            }
            SyncMode::Bounded { overshoot_ppm } => {
                let s = slice(overshoot_ppm, capacity, caps.regions);
                let left = s.saturating_sub(unacked);
                let warm_left = if caps.warming { s.saturating_sub(own) } else { u64::MAX };
                Some((left.min(warm_left), s))
            }
            SyncMode::Eventual if caps.cold => {
                Some((0, (capacity / u64::try_from(caps.regions.max(1)).unwrap_or(1)).max(1)))
            }
            SyncMode::Eventual if caps.warming => {
                let share = (capacity / u64::try_from(caps.regions.max(1)).unwrap_or(1)).max(1);
                Some((share.saturating_sub(own), share))
            }
            SyncMode::Eventual => None,
        };
        if let Some((left, whole)) = cap
            && hits > left
            && !late
        {
            // Acknowledgements (or the peers' state) free it, about a sync
            // round trip from now: the hint; a request larger than the
            // whole slice can never pass, and gets no retry time.
            let remaining = left.min(d.remaining.saturating_add(hits));
            let retry = (hits <= whole).then_some(caps.retry_us.max(1));
            let reset = u64::try_from(d.reset_after.as_micros()).unwrap_or(u64::MAX);
            return (Decision::deny(d.limit, remaining, reset, retry), Send::No);
        }
        if let Some(t) = gcra_state {
            self.tat = t;
        }
        let slot = self.slot_mut(cur, peers);
        slot.own = slot.own.saturating_add(hits);
        if late {
            slot.late = slot.late.saturating_add(hits);
        }
        self.unsent = self.unsent.saturating_add(hits);
        // A key far below its limit may wait for the lazy period
        // (`lazy::can_wait`); otherwise, and for bounded rules
        // (acknowledgements free the slice), while warming or while a link
        // fails, it goes at the next batch.
        let urgent = matches!(mode, SyncMode::Bounded { .. })
            || caps.warming
            || caps.eager
            || !super::lazy::can_wait(self.unsent, d.remaining, caps.regions);
        (d, if urgent { Send::Now } else { Send::Later })
    }

    /// The window algorithms' state as if one region held every count,
    /// plus `charge` hits in the current slot (what dead incarnations may
    /// have taken).
    fn synthetic(&self, algorithm: &Algorithm, cur: u64, horizon: u32, charge: u64) -> State {
        match algorithm {
            Algorithm::SlidingWindow => State(Inner::Sliding {
                id: cur,
                prev: cur.checked_sub(1).map_or(0, |p| self.total(p)),
                cur: self.total(cur).saturating_add(charge),
            }),
            Algorithm::SlidingBuckets { .. } => {
                let g = horizon as usize;
                let mut ring = vec![0u64; g + 2];
                ring[0] = cur;
                for s in &self.slots {
                    if s.id <= cur && cur - s.id < horizon as u64 {
                        let t = s.total();
                        ring[2 + (s.id % horizon as u64) as usize] = t;
                        ring[1] = ring[1].saturating_add(t);
                    }
                }
                let at = 2 + (cur % u64::from(horizon)) as usize;
                ring[at] = ring[at].saturating_add(charge);
                ring[1] = ring[1].saturating_add(charge);
                State(Inner::Buckets(ring.into_boxed_slice()))
            }
            _ => State(Inner::Window { id: cur, count: self.total(cur).saturating_add(charge) }),
        }
    }

    /// Give back `hits` admitted at `at` (another limit of the request
    /// denied it). Locally exact; a peer that already holds the larger count
    /// keeps it until the slot ends (the max never decreases), which can only
    /// make it stricter.
    pub(crate) fn refund(&mut self, at: u64, now: u64, hits: u64) -> bool {
        let (Some(rule), Some(shape)) = (&self.rule, self.shape) else { return false };
        if let Shape::Gcra { .. } = shape {
            rule.limit.refund(&mut self.tat, at, now, hits);
        }
        let id = at / shape.slot_us();
        match self.slots.binary_search_by_key(&id, |s| s.id) {
            Ok(i) => {
                let s = &mut self.slots[i];
                s.own = s.own.saturating_sub(hits);
                true
            }
            Err(_) => false,
        }
    }

    /// A refund at `now` (Envoy's `is_negative_hits`, a negative `hits`):
    /// give back up to `hits` of this region's own, as one region gives
    /// back ([`Limit::give_back`]): the window algorithms from the newest
    /// slot that counts to the oldest (a fixed window: its current one),
    /// never more than this region took in a slot; the GCRA family moves
    /// its bucket back, by no more than this region's own hits in the slots
    /// it keeps. Hits another region took are not given back here: the
    /// regions' counts stay per region, so a refund can only lower this
    /// region's. Returns the hits given back; the slot's `back` carries
    /// them to the peers, who give them back exactly (merged by maximum,
    /// as a charge is).
    pub(crate) fn give_back(&mut self, now: u64, hits: u64, peers: usize) -> u64 {
        let (Some(shape), Some(limit)) = (self.shape, self.rule.as_ref().map(|r| r.limit.clone())) else { return 0 };
        self.prune(now);
        let cur = now / shape.slot_us();
        match shape {
            Shape::Gcra { .. } => {
                let (own, back) = self
                    .slots
                    .iter()
                    .fold((0u64, 0u64), |(o, b), s| (o.saturating_add(s.own), b.saturating_add(s.back)));
                let given = hits.min(own.saturating_sub(back));
                if given > 0 {
                    limit.refund(&mut self.tat, now, now, given);
                    let slot = self.slot_mut(cur, peers);
                    slot.back = slot.back.saturating_add(given);
                }
                given
            }
            Shape::Windowed { .. } => {
                let mut left = hits;
                for s in self.slots.iter_mut().rev().filter(|s| s.id <= cur) {
                    left -= s.give(left);
                    if left == 0 {
                        break;
                    }
                }
                hits - left
            }
        }
    }

    /// Give back `hits` taken at `at` as if never taken (a reservation
    /// settled below its estimate), as one region's `Limit::refund` does:
    /// the window algorithms from the slot `at` fell in, if it still
    /// counts, never more than this region took there (what has left the
    /// window is not given back); the GCRA family as a refund now
    /// (`give_back`: its bucket holds every region's debt, so what has
    /// drained since `at` is not told apart). Returns the hits given back.
    pub(crate) fn return_at(&mut self, at: u64, now: u64, hits: u64, peers: usize) -> u64 {
        match self.shape {
            Some(Shape::Gcra { .. }) => self.give_back(now, hits, peers),
            Some(Shape::Windowed { slot_us, .. }) if self.rule.is_some() => {
                self.prune(now);
                match self.slots.binary_search_by_key(&(at / slot_us), |s| s.id) {
                    Ok(i) => self.slots[i].give(hits),
                    Err(_) => 0,
                }
            }
            _ => 0,
        }
    }

    /// Merge one component from a peer at `now` (hits taken, `count`, and
    /// given back, `back`); whether it changed anything. Older than the
    /// slots that still count: dropped (its hits no longer matter
    /// anywhere).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn merge(
        &mut self,
        region: u16,
        incarnation: u64,
        id: u64,
        count: u64,
        back: u64,
        now: u64,
        peers: usize,
    ) -> bool {
        let Some(shape) = self.shape else { return false };
        let cur = now / shape.slot_us();
        if id.saturating_add(shape.horizon()) <= cur {
            return false;
        }
        let slot = self.slot_mut(id, peers);
        let (delta, given) = match slot.comps.iter_mut().find(|c| c.region == region && c.incarnation == incarnation) {
            Some(c) => {
                let d = (count.saturating_sub(c.count), back.saturating_sub(c.back));
                c.count = c.count.max(count);
                c.back = c.back.max(back);
                d
            }
            None => {
                slot.comps.push(Comp { region, incarnation, count, back });
                (count, back)
            }
        };
        if delta == 0 && given == 0 {
            return false;
        }
        if delta > 0
            && let Shape::Gcra { slot_us } = shape
        {
            // The hits were admitted in slot `id`, so by its end: their debt
            // starts then at the latest (never in the future), not when the
            // message happened to arrive. A late message then costs only
            // what has not drained since; a full state transfer to a
            // restarted region does not turn three slots of old usage into
            // fresh debt.
            let at = now.min(id.saturating_add(1).saturating_mul(slot_us));
            match &self.rule {
                Some(r) => add_debt(&r.limit, &mut self.tat, at, delta),
                None => {
                    if self.pending == 0 || at < self.pending_since {
                        self.pending_since = at;
                    }
                    self.pending = self.pending.saturating_add(delta);
                }
            }
        }
        if given > 0
            && let Shape::Gcra { .. } = shape
        {
            // Given back in the peer's bucket: given back in this one (never
            // past full), as the debt was poured in (after the debt, when both came).
            match &self.rule {
                Some(r) => r.limit.refund(&mut self.tat, now, now, given),
                None => self.pending = self.pending.saturating_sub(given),
            }
        }
        true
    }

    /// Record that peer `p` acknowledged own count `count` in slot `id`.
    pub(crate) fn acked(&mut self, p: usize, id: u64, count: u64) {
        if let Ok(i) = self.slots.binary_search_by_key(&id, |s| s.id)
            && let Some(a) = self.slots[i].acked.get_mut(p)
        {
            *a = (*a).max(count);
        }
    }

    /// Own hits not yet acknowledged by every peer, over the slots that count.
    pub(crate) fn unacked(&self) -> u64 {
        self.slots.iter().map(Slot::unacked).sum()
    }

    /// Nothing left to remember at `now`.
    pub(crate) fn idle(&self, now: u64) -> bool {
        let drained = match &self.tat.0 {
            Inner::Tat { us, .. } => *us <= now,
            _ => true,
        };
        self.slots.is_empty() && self.pending == 0 && self.queued == 0 && drained
    }

    /// The current slot id, if the shape is known.
    pub(crate) fn current_slot(&self, now: u64) -> Option<u64> {
        self.slot_at(now)
    }
}

/// `tat = max(tat, at) + hits × T`, exactly (T = window / limit as a
/// fraction: microseconds plus a remainder in 1/limit).
fn add_debt(limit: &Limit, tat: &mut State, at: u64, hits: u64) {
    let l = u128::from(limit.limit().max(1));
    let (us, rem) = tat.tat();
    let base = if *us >= at { u128::from(*us) * l + u128::from(*rem) } else { u128::from(at) * l };
    let debt = u128::from(hits) * u128::from(limit.window_us());
    let t = base.saturating_add(debt);
    *us = u64::try_from(t / l).unwrap_or(u64::MAX);
    *rem = u64::try_from(t % l).unwrap_or(0);
}
