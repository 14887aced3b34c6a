//! What a region knows of every region's incarnations, and what the dead
//! ones may have taken with them (DESIGN, "Regions through crashes").
//!
//! A region that crashes loses its own hits that no peer has acknowledged
//! yet: nobody can say how many, but under a `bounded` rule they are at most
//! its slice per key. An incarnation is **dead** once a later one of its
//! region is known (incarnations are the time their region started, so a
//! later one is larger). Every bounded decision then counts one slice for
//! each dead incarnation whose span here — from when this region recorded
//! it to when it learned of its successor — overlaps what the decision
//! counts (the window algorithms), or takes one slice of debt dated when
//! the successor was learned (the GCRA family). A new incarnation admits
//! nothing on bounded rules until every peer has recorded it, so every
//! incarnation that admitted anything is in every region's record before
//! it can die, and the cap holds through any number of crashes. The cost:
//! a slice per bounded key per crash, counted twice once the dead
//! incarnation's real usage arrives (it was only delayed); after
//! `limit ÷ slice` crashes in a window a key admits nothing more in it.
//!
//! The record is exchanged in full state transfers, so a region that
//! restarts (its own record lost) learns the dead incarnations' spans from
//! its peers before it admits anything on bounded rules. Nothing needs to be
//! durable.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{PoisonError, RwLock};

/// A new incarnation for a region starting at `now_us` (µs since the
/// epoch): the start time in the high bits, so a later start is a later
/// incarnation (regions tell which of two is dead by that), and 12 bits
/// from `salt` and the time so two starts in the same microsecond differ.
/// A region whose clock steps back across a restart by more than the
/// restart took starts an incarnation that looks earlier than its last:
/// peers then count it dead at once (stricter, never looser) and it
/// admits nothing on bounded rules (`GlobalTable::superseded`).
pub fn new_incarnation(now_us: u64, salt: u64) -> u64 {
    let mix = std::hash::BuildHasher::hash_one(&std::hash::RandomState::new(), (now_us, salt));
    (now_us << 12) | (mix & 0xFFF) | 1
}

/// Dead incarnations remembered at most; beyond, the two oldest are folded
/// into one record covering both spans (charged twice over it: stricter,
/// never looser).
pub const MAX_DEAD: usize = 1_024;

/// One incarnation of one region, as exchanged between regions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Incarnation {
    /// The region (an index into a batch's regions, or a table's names).
    pub region: u32,
    /// The incarnation.
    pub incarnation: u64,
    /// When it was first recorded (µs since the epoch; 0: not known, as
    /// early as can be).
    pub recorded_us: u64,
    /// When a later incarnation of its region was first known (0: alive).
    pub dead_us: u64,
    /// Dead incarnations this record stands for (1, or more once folded).
    pub count: u64,
}

#[derive(Debug, Default)]
struct Inner {
    /// Every known incarnation, alive or dead, by region then incarnation.
    known: Vec<Incarnation>,
    /// The dead ones in the order they died, each with its death's
    /// sequence number (1, 2, ...; a folded record keeps the later one).
    dead: Vec<(u64, Incarnation)>,
}

/// A region's record of incarnations (this one's own included).
#[derive(Debug, Default)]
pub struct Incarnations {
    inner: RwLock<Inner>,
    /// Deaths ever recorded: 0 means no decision has anything to charge.
    deaths: AtomicU64,
}

impl Incarnations {
    /// A record holding this region's own `incarnation` (region 0).
    pub fn new(incarnation: u64) -> Self {
        let me = Incarnation { region: 0, incarnation, recorded_us: 0, dead_us: 0, count: 1 };
        Self { inner: RwLock::new(Inner { known: vec![me], ..Inner::default() }), deaths: AtomicU64::new(0) }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Inner> {
        self.inner.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Inner> {
        self.inner.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// Deaths recorded so far (a sequence number for [`Incarnations::debts_after`]).
    pub fn deaths(&self) -> u64 {
        self.deaths.load(Ordering::Acquire)
    }

    /// Whether `incarnation` of `region` is known.
    pub fn knows(&self, region: u32, incarnation: u64) -> bool {
        self.read().known.iter().any(|k| k.region == region && k.incarnation == incarnation)
    }

    /// Record that `incarnation` of `region` exists, learned at `now`
    /// (from its own batch, or a component of it): a later incarnation
    /// kills the earlier ones. An earlier one learned only now is dead
    /// already, its span unknown (from 0). Returns whether it was new.
    pub fn learn(&self, region: u32, incarnation: u64, now: u64) -> bool {
        if self.knows(region, incarnation) {
            return false;
        }
        self.insert(Incarnation { region, incarnation, recorded_us: now, dead_us: 0, count: 1 }, now, false);
        true
    }

    /// Merge `rec` from a peer's record (its region already mapped to this
    /// table's index), at `now`: an unknown incarnation is taken with the
    /// peer's span (its recording may predate this region's own); a known
    /// one is kept as this region recorded it.
    pub fn merge(&self, rec: Incarnation, now: u64) {
        if self.knows(rec.region, rec.incarnation) {
            return;
        }
        self.insert(rec, now, true);
    }

    /// Add `rec`; `span_known`: its recording time is a real one (a
    /// peer's), not just when this region heard of it.
    fn insert(&self, mut rec: Incarnation, now: u64, span_known: bool) {
        let mut g = self.write();
        if g.known.iter().any(|k| k.region == rec.region && k.incarnation == rec.incarnation) {
            return;
        }
        let latest = g.known.iter().filter(|k| k.region == rec.region).map(|k| k.incarnation).max();
        let mut died = Vec::new();
        match latest {
            Some(l) if l > rec.incarnation => {
                // Its region has a later one: dead since at least now, and
                // alive since who knows when (unless a peer says).
                if rec.dead_us == 0 {
                    rec.dead_us = now;
                }
                if !span_known {
                    rec.recorded_us = 0;
                }
                rec.recorded_us = rec.recorded_us.min(rec.dead_us);
                died.push(rec);
            }
            _ => {
                // The latest now: every other one of its region is dead.
                for k in g.known.iter_mut().filter(|k| k.region == rec.region && k.dead_us == 0) {
                    k.dead_us = now.max(k.recorded_us);
                    died.push(*k);
                }
                if rec.dead_us != 0 {
                    died.push(rec);
                }
            }
        }
        g.known.push(rec);
        for d in died {
            let seq = self.deaths.fetch_add(1, Ordering::AcqRel) + 1;
            g.dead.push((seq, d));
        }
        fold(&mut g.dead);
    }

    /// Whether this region's own incarnation (region 0, `mine`) is no
    /// longer its region's latest: a later one exists (a clock stepped back
    /// across a restart, or two processes claim one region).
    pub fn superseded(&self, mine: u64) -> bool {
        self.read().known.iter().any(|k| k.region == 0 && k.incarnation > mine)
    }

    /// Dead incarnations whose span overlaps `[from_us, to_us)`: what a
    /// window decision counting that span must charge a slice for each.
    pub fn charges(&self, from_us: u64, to_us: u64) -> u64 {
        if self.deaths() == 0 {
            return 0;
        }
        self.read()
            .dead
            .iter()
            .filter(|(_, d)| d.recorded_us < to_us && d.dead_us >= from_us)
            .map(|(_, d)| d.count)
            .sum()
    }

    /// The deaths after sequence number `seq` (0: all), each
    /// `(dead_us, count)`, and the number to ask from next time (the GCRA
    /// family's debts).
    pub fn debts_after(&self, seq: u64) -> (Vec<(u64, u64)>, u64) {
        let g = self.read();
        let debts = g.dead.iter().filter(|(s, _)| *s > seq).map(|(_, d)| (d.dead_us, d.count)).collect();
        (debts, self.deaths().max(seq))
    }

    /// Forget dead incarnations that died before `before_us` (no decision
    /// counts their span any more).
    pub fn prune(&self, before_us: u64) {
        if self.deaths() == 0 {
            return;
        }
        let mut g = self.write();
        g.dead.retain(|(_, d)| d.dead_us >= before_us);
        g.known.retain(|k| k.dead_us == 0 || k.dead_us >= before_us);
    }

    /// The dead incarnations' spans and counts, `(recorded_us, dead_us,
    /// count)`, in the order they died.
    pub fn dead_spans(&self) -> Vec<(u64, u64, u64)> {
        self.read().dead.iter().map(|(_, d)| (d.recorded_us, d.dead_us, d.count)).collect()
    }

    /// Replace the whole record with `records` (as a region whose record is
    /// in its store reads it back): an incarnation with a later one of its
    /// region is dead since that one was recorded, unless the record says
    /// when. Region 0 is this region.
    pub fn reset(&self, records: &[Incarnation]) {
        let mut sorted = records.to_vec();
        sorted.sort_by_key(|r| (r.region, r.incarnation));
        sorted.dedup_by_key(|r| (r.region, r.incarnation));
        let mut dead = Vec::new();
        for i in 0..sorted.len() {
            let next = sorted.get(i + 1).filter(|n| n.region == sorted[i].region).map(|n| n.recorded_us);
            let r = &mut sorted[i];
            if r.dead_us == 0
                && let Some(succ) = next
            {
                r.dead_us = succ.max(r.recorded_us).max(1);
            }
            if r.dead_us != 0 {
                r.recorded_us = r.recorded_us.min(r.dead_us);
                dead.push(*r);
            }
        }
        dead.sort_by_key(|d| d.dead_us);
        let mut g = self.write();
        let n = dead.len() as u64;
        g.dead = dead.into_iter().enumerate().map(|(i, d)| (i as u64 + 1, d)).collect();
        fold(&mut g.dead);
        g.known = sorted;
        self.deaths.store(n, Ordering::Release);
    }

    /// Every known incarnation, for a full state transfer.
    pub fn records(&self) -> Vec<Incarnation> {
        let g = self.read();
        let mut out: Vec<Incarnation> = g.known.iter().filter(|k| k.dead_us == 0).copied().collect();
        out.extend(g.dead.iter().map(|(_, d)| *d));
        out
    }
}

/// At most [`MAX_DEAD`] records: fold the two oldest into one covering
/// both, numbered as the later (a GCRA key that had seen only the first
/// pays both again: stricter, never looser).
fn fold(dead: &mut Vec<(u64, Incarnation)>) {
    while dead.len() > MAX_DEAD {
        let (seq, b) = dead.remove(1);
        let a = &mut dead[0];
        a.0 = seq;
        a.1.recorded_us = a.1.recorded_us.min(b.recorded_us);
        a.1.dead_us = a.1.dead_us.max(b.dead_us);
        a.1.count += b.count;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_later_incarnation_kills_the_earlier_and_its_span_is_charged() {
        let r = Incarnations::new(1);
        assert!(r.learn(1, 10, 100));
        assert!(!r.learn(1, 10, 150), "known");
        assert_eq!(r.deaths(), 0);
        assert_eq!(r.charges(0, u64::MAX), 0);
        assert!(r.learn(1, 20, 200));
        assert_eq!(r.deaths(), 1);
        // Span [100, 200]: windows overlapping it are charged once.
        assert_eq!(r.charges(0, 100), 0, "ends before it was recorded");
        assert_eq!(r.charges(0, 101), 1);
        assert_eq!(r.charges(150, 160), 1);
        assert_eq!(r.charges(200, 300), 1);
        assert_eq!(r.charges(201, 300), 0, "starts after it died");
        // An older one heard of late: dead already, its start unknown.
        assert!(r.learn(1, 5, 300));
        assert_eq!(r.charges(0, 1), 1);
        assert_eq!(r.charges(250, 400), 1, "dead since at least 300");
        assert_eq!(r.charges(301, 400), 0);
        let (debts, next) = r.debts_after(0);
        assert_eq!((debts, next), (vec![(200, 1), (300, 1)], 2));
        assert_eq!(r.debts_after(1).0, vec![(300, 1)]);
        assert!(r.debts_after(2).0.is_empty());
        r.prune(250);
        assert_eq!(r.debts_after(0), (vec![(300, 1)], 2), "the first death is forgotten");
        assert!(!r.knows(1, 10));
    }

    #[test]
    fn a_peers_record_brings_a_span_this_region_never_saw() {
        let r = Incarnations::new(7);
        r.merge(Incarnation { region: 2, incarnation: 3, recorded_us: 50, dead_us: 90, count: 1 }, 1_000);
        assert_eq!(r.charges(60, 70), 1);
        r.merge(Incarnation { region: 2, incarnation: 4, recorded_us: 80, dead_us: 0, count: 1 }, 1_000);
        assert_eq!(r.charges(0, u64::MAX), 1, "the live one is not charged");
        // This region's own earlier incarnation, from a peer: dead.
        r.merge(Incarnation { region: 0, incarnation: 6, recorded_us: 10, dead_us: 0, count: 1 }, 1_000);
        assert_eq!(r.charges(0, 20), 1);
        assert_eq!(r.charges(999, 1_001), 1, "dead since this region knew better");
        assert!(!r.superseded(7));
        r.learn(0, 8, 1_100);
        assert!(r.superseded(7));
        assert_eq!(r.records().len(), 5);
    }

    #[test]
    fn a_record_read_back_from_a_store_tells_the_dead_by_their_successors() {
        let r = Incarnations::new(1);
        let rec = |region, incarnation, recorded_us, dead_us| Incarnation {
            region,
            incarnation,
            recorded_us,
            dead_us,
            count: 1,
        };
        r.reset(&[rec(0, 1, 0, 0), rec(2, 5, 100, 0), rec(2, 9, 300, 0), rec(2, 7, 200, 0), rec(1, 3, 50, 60)]);
        // 5 died when 7 was recorded, 7 when 9 was; 3 says when it died.
        assert_eq!(r.dead_spans(), vec![(50, 60, 1), (100, 200, 1), (200, 300, 1)]);
        assert_eq!(r.deaths(), 3);
        assert_eq!(r.charges(250, 260), 1);
        assert!(r.knows(2, 9) && !r.superseded(1));
    }

    #[test]
    fn too_many_deaths_fold_into_wider_records_never_fewer_charges() {
        let r = Incarnations::new(1);
        for i in 0..(MAX_DEAD as u64 + 10) {
            r.learn(1, i + 1, 1_000 * (i + 1));
        }
        let total: u64 = r.records().iter().filter(|k| k.dead_us != 0).map(|k| k.count).sum();
        assert_eq!(total, MAX_DEAD as u64 + 9);
        assert!(r.records().iter().filter(|k| k.dead_us != 0).count() <= MAX_DEAD);
        // Every window that overlapped a span still pays at least once.
        for i in 0..(MAX_DEAD as u64 + 9) {
            let at = 1_000 * (i + 1);
            assert!(r.charges(at, at + 1) >= 1, "{i}");
        }
    }
}
