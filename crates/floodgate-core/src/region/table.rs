//! [`GlobalTable`]: a memory-store region's `scope: global` state — its
//! decisions, the merges of what peers send, and the storage side of the
//! sync engine ([`super::link`]): a key is marked queued for a peer by a bit
//! on its entry, and a batch is read straight from the entries. Pure: no
//! clock reads, no I/O; a transport (gRPC between services, or the
//! simulator's network) moves the [`Batch`]es and [`Ack`]s.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use crate::region::entry::{Caps, Entry, Send, shape_of};
use crate::region::incarnations::{Incarnation, Incarnations};
use crate::region::link::{Requeue, Take};
use crate::region::wire::{Ack, Batch, Component};
use crate::region::{
    BatchHead, BatchSink, Items, Lazy, LinkStats, Links, Receipt, Region, RegionConfig, RegionConfigError, Scope,
    SyncMode,
};
use crate::store::{Op, OwnedKey};
use crate::{Decision, Limit, StoreError};
use foldhash::SharedSeed;
use foldhash::fast::SeedableRandomState;

/// Counters of the whole table, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TableStats {
    /// Components merged that changed something.
    pub merges: u64,
    /// Components that changed nothing (duplicates, replays, older counts).
    pub unchanged: u64,
    /// Components too old to count anywhere, dropped.
    pub stale: u64,
    /// Keys whose sender's limit fingerprint differs from this region's.
    pub fingerprint_mismatches: u64,
    /// Keys whose counts mean something else here (another algorithm or
    /// window): not merged.
    pub shape_mismatches: u64,
    /// Batches from a region that is not among the peers.
    pub unknown_senders: u64,
    /// Keys held.
    pub keys: u64,
}

struct Names {
    list: Vec<Arc<str>>,
    index: HashMap<Arc<str>, u16>,
}

/// Keys are held inline where short (`OwnedKey`), in the map and in every
/// queue: a million keys are then no million small heap objects, whose
/// allocation on the deciding threads and release by the sweeper slowed
/// every other allocation of the request path (BENCHMARKS.md, "Many
/// regions: sync on against sync off").
type Shard = Mutex<HashMap<OwnedKey, Entry, SeedableRandomState>>;

/// A memory-store region's global limits: decisions, merges, and what to
/// send each peer. Thread-safe; keys are sharded.
pub struct GlobalTable {
    region: Arc<str>,
    incarnation: u64,
    cfg: RegionConfig,
    names: RwLock<Names>,
    shards: Box<[Shard]>,
    hasher: SeedableRandomState,
    links: Links<VecDeque<OwnedKey>, Vec<(OwnedKey, u64, u64)>>,
    /// Keys whose own hits wait for the lazy period, and failing links.
    lazy: Lazy<OwnedKey>,
    /// Every region's incarnations, and what the dead ones cost.
    incarnations: Incarnations,
    /// A later incarnation of this region exists: bounded rules admit
    /// nothing here (logged by the caller).
    superseded: AtomicBool,
    /// The longest span a bounded decision counts (µs): how long a dead
    /// incarnation is remembered.
    bounded_span_us: AtomicU64,
    /// When this table first decided (µs; 0: not yet): the warm-up wait
    /// counts from it.
    started_us: AtomicU64,
    /// The limits entries share (see [`GlobalTable::shared`]).
    limits: Mutex<std::collections::HashSet<Arc<Limit>>>,
    merges: AtomicU64,
    unchanged: AtomicU64,
    stale: AtomicU64,
    fingerprint_mismatches: AtomicU64,
    shape_mismatches: AtomicU64,
    unknown_senders: AtomicU64,
}

/// A hasher's state: random (against hash flooding), or from `seed` for a
/// run that must replay exactly (`n` tells a table's hashers apart).
fn hash_state(seed: Option<u64>, n: u64) -> SeedableRandomState {
    match seed {
        Some(s) => SeedableRandomState::with_seed(
            s.wrapping_add(n.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
            SharedSeed::global_fixed(),
        ),
        None => SeedableRandomState::random(),
    }
}

impl std::fmt::Debug for GlobalTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GlobalTable")
            .field("region", &self.region)
            .field("incarnation", &self.incarnation)
            .field("peers", &self.cfg.peers)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl GlobalTable {
    /// A table for `cfg`; fails on a peer list that cannot work (this
    /// region among its peers, a peer twice, an empty name, too many).
    pub fn new(cfg: RegionConfig) -> Result<Self, RegionConfigError> {
        cfg.check()?;
        let list: Vec<Arc<str>> =
            std::iter::once(&cfg.region).chain(&cfg.peers).map(|n| Arc::from(n.as_str())).collect();
        let index = list.iter().enumerate().map(|(i, n)| (n.clone(), i as u16)).collect();
        let links = Links::new(&cfg);
        let shards = (0..64).map(|i| Mutex::new(HashMap::with_hasher(hash_state(cfg.hash_seed, i + 1)))).collect();
        Ok(Self {
            region: list[0].clone(),
            incarnation: cfg.incarnation,
            names: RwLock::new(Names { list, index }),
            shards,
            hasher: hash_state(cfg.hash_seed, 0),
            links,
            lazy: Lazy::new(cfg.lazy_us),
            incarnations: Incarnations::new(cfg.incarnation),
            superseded: AtomicBool::new(false),
            bounded_span_us: AtomicU64::new(0),
            started_us: AtomicU64::new(0),
            limits: Mutex::new(std::collections::HashSet::new()),
            cfg,
            merges: AtomicU64::new(0),
            unchanged: AtomicU64::new(0),
            stale: AtomicU64::new(0),
            fingerprint_mismatches: AtomicU64::new(0),
            shape_mismatches: AtomicU64::new(0),
            unknown_senders: AtomicU64::new(0),
        })
    }

    /// This region's name.
    pub fn region(&self) -> &str {
        &self.region
    }

    /// This region's incarnation.
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// The peer regions, in link order.
    pub fn peers(&self) -> &[String] {
        &self.cfg.peers
    }

    /// The regions in all, this one included.
    pub fn regions(&self) -> usize {
        self.cfg.peers.len() + 1
    }

    /// Whether this region still waits for some peer's full state (then it
    /// admits only within its slice beyond what it knows).
    pub fn warming(&self) -> bool {
        self.links.warming()
    }

    /// Whether no peer's full state has arrived yet: eventual rules admit
    /// nothing until one does, or the warm-up wait is over.
    pub fn cold(&self) -> bool {
        self.links.warming() && !self.links.heard_full()
    }

    /// Whether bounded rules admit: every peer has recorded this
    /// incarnation, and no later one of this region exists.
    pub fn bounded_open(&self) -> bool {
        self.links.recorded_by_all() && !self.superseded.load(Ordering::Relaxed)
    }

    /// Dead incarnations known (of every region): each costs a bounded
    /// decision a slice while its span counts.
    pub fn dead_incarnations(&self) -> u64 {
        self.incarnations.deaths()
    }

    /// What a region whose state outlives its instance (a Redis region)
    /// goes through when its instance dies: the state stays, every link
    /// forgets what it had queued and sent, and no key is queued or waits
    /// for the lazy period. (The simulator's `instance-crash`.)
    pub fn restart_instance(&self) {
        for _ in 0..self.links.forget() {
            self.lazy.link_failing(false);
        }
        let _ = self.lazy.due(u64::MAX);
        for shard in self.shards.iter() {
            for e in lock(shard).values_mut() {
                e.queued = 0;
                e.lazy = false;
                e.unsent = 0;
            }
        }
    }

    fn shard(&self, key: &[u8]) -> &Shard {
        let h = std::hash::BuildHasher::hash_one(&self.hasher, key);
        &self.shards[(h as usize) % self.shards.len()]
    }

    fn caps(&self, now: u64) -> Caps {
        let warming = self.warming();
        let cold = warming && !self.links.heard_full() && {
            let started = match self.started_us.compare_exchange(0, now, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => now,
                Err(t) => t,
            };
            now < started.saturating_add(self.cfg.warmup_us)
        };
        Caps {
            regions: self.regions(),
            warming,
            cold,
            retry_us: self.cfg.retry_hint_us,
            eager: self.lazy.eager(),
            closed: !self.links.recorded_by_all() || self.superseded.load(Ordering::Relaxed),
        }
    }

    /// Decide `hits` of a `scope: global` limit for `key` at `now`
    /// (µs since the epoch): the limit over every region's known usage,
    /// then the slice (`bounded`, or while warming); admitted hits are
    /// queued for every peer.
    pub fn apply(&self, key: &str, limit: &Limit, mode: SyncMode, hits: u64, now: u64) -> Result<Decision, StoreError> {
        self.take(key, limit, mode, hits, false, now)
    }

    /// A late charge of `hits` for `key` at `now`, whatever the limit's own
    /// charge (a reservation settled above its estimate): counted, never
    /// denied, and exempt from the bounded slice (it cannot be refused, so
    /// the cap holds on what is admitted at request time, plus late charges
    /// not yet acknowledged). On a limit charged after the work
    /// ([`crate::Charge::After`]) [`GlobalTable::apply`] charges so already.
    pub fn charge_late(
        &self,
        key: &str,
        limit: &Limit,
        mode: SyncMode,
        hits: u64,
        now: u64,
    ) -> Result<Decision, StoreError> {
        self.take(key, limit, mode, hits, true, now)
    }

    /// A refund of `hits` for `key` at `now`: given back from this region's
    /// own count (see `Entry::give_back`), and carried to every peer as a
    /// count given back, merged by maximum as a charge is: once they have
    /// it, every region counts the key as if the hits had never been taken.
    /// Returns what a peek answers afterwards, and the hits given back.
    pub fn give_back(
        &self,
        key: &str,
        limit: &Limit,
        mode: SyncMode,
        hits: u64,
        now: u64,
    ) -> Result<(Decision, u64), StoreError> {
        self.give_back_as(key, limit, mode, now, |entry, peers| entry.give_back(now, hits, peers))
    }

    /// Give back `hits` of `key` taken at `taken_at` as if never taken (a
    /// reservation settled below its estimate; see `Entry::return_at`), and
    /// to every peer as a count given back. Returns what a peek answers
    /// afterwards, and the hits given back.
    pub fn return_at(
        &self,
        key: &str,
        limit: &Limit,
        mode: SyncMode,
        hits: u64,
        taken_at: u64,
        now: u64,
    ) -> Result<(Decision, u64), StoreError> {
        self.give_back_as(key, limit, mode, now, |entry, peers| entry.return_at(taken_at, now, hits, peers))
    }

    /// Give back as `give` does to `key`'s entry (the hits given back),
    /// queue them for the peers, and answer as a peek afterwards.
    fn give_back_as(
        &self,
        key: &str,
        limit: &Limit,
        mode: SyncMode,
        now: u64,
        give: impl FnOnce(&mut Entry, usize) -> u64,
    ) -> Result<(Decision, u64), StoreError> {
        let peers = self.links.len();
        self.with_entry(key, limit, mode, now, |entry, caps| {
            let given = give(entry, peers);
            if given > 0 {
                self.queue_for_peers(entry, || OwnedKey::new(key));
            }
            (entry.decide(limit, now, 0, true, peers, caps, &self.incarnations).0, given)
        })
    }

    fn take(
        &self,
        key: &str,
        limit: &Limit,
        mode: SyncMode,
        hits: u64,
        late: bool,
        now: u64,
    ) -> Result<Decision, StoreError> {
        let peers = self.links.len();
        self.with_entry(key, limit, mode, now, |entry, caps| {
            let (d, send) = entry.decide(limit, now, hits, late, peers, caps, &self.incarnations);
            match send {
                Send::Now => self.queue_for_peers(entry, || OwnedKey::new(key)),
                Send::Later if !entry.lazy => {
                    entry.lazy = true;
                    self.lazy.wait(now, OwnedKey::new(key));
                }
                Send::Later | Send::No => {}
            }
            d
        })
    }

    /// `f` on `key`'s entry (made if new) with its rule set to `limit`
    /// under `mode`, and the caps at `now`, under the shard's lock.
    fn with_entry<R>(
        &self,
        key: &str,
        limit: &Limit,
        mode: SyncMode,
        now: u64,
        f: impl FnOnce(&mut Entry, Caps) -> R,
    ) -> Result<R, StoreError> {
        let Some(shape) = shape_of(limit) else {
            return Err(StoreError::Unavailable(
                "sliding_log cannot be global: use sliding_buckets or gcra, or scope: region".to_owned(),
            ));
        };
        let peers = self.links.len();
        let caps = self.caps(now);
        if matches!(mode, SyncMode::Bounded { .. }) {
            // How long a dead incarnation must be remembered.
            let span = shape.slot_us().saturating_mul(shape.horizon());
            if span > self.bounded_span_us.load(Ordering::Relaxed) {
                self.bounded_span_us.fetch_max(span, Ordering::Relaxed);
            }
        }
        let mut shard = lock(self.shard(key.as_bytes()));
        let decide = |entry: &mut Entry| {
            entry.set_rule(limit, mode, shape, peers, || self.shared(limit));
            f(entry, caps)
        };
        // One lookup on the common path (the key is known).
        if let Some(entry) = shard.get_mut(key.as_bytes()) {
            return Ok(decide(entry));
        }
        Ok(decide(shard.entry(OwnedKey::new(key)).or_default()))
    }

    /// Give back `hits` admitted at `at` (another limit of the request
    /// denied it). See `Entry::refund`: exact here, never looser elsewhere.
    pub fn refund(&self, key: &str, hits: u64, at: u64, now: u64) {
        let mut shard = lock(self.shard(key.as_bytes()));
        if let Some(e) = shard.get_mut(key.as_bytes())
            && e.refund(at, now, hits)
        {
            self.queue_for_peers(e, || OwnedKey::new(key));
        }
    }

    /// The one copy of `limit` its keys' entries share. Copies no entry
    /// holds any more (rules reloaded since) are dropped as new ones come.
    fn shared(&self, limit: &Limit) -> Arc<Limit> {
        let mut limits = lock(&self.limits);
        if let Some(l) = limits.get(limit) {
            return l.clone();
        }
        if limits.len() >= 1_024 {
            limits.retain(|l| Arc::strong_count(l) > 1);
        }
        let l = Arc::new(limit.clone());
        limits.insert(l.clone());
        l
    }

    /// Every peer's bit.
    fn all_peers(&self) -> u64 {
        if self.links.len() == 64 { u64::MAX } else { (1u64 << self.links.len()) - 1 }
    }

    /// Queue `entry`'s key (`name` makes it) for every peer it is not
    /// queued for yet (under its shard's lock): its own hits go now.
    fn queue_for_peers(&self, entry: &mut Entry, name: impl FnOnce() -> OwnedKey) {
        if self.all_peers() & !entry.queued == 0 {
            return;
        }
        entry.unsent = 0;
        entry.lazy = false;
        self.queue_for(entry, self.all_peers(), name);
    }

    /// Queue `entry`'s key for the peers in `mask` it is not queued for yet.
    fn queue_for(&self, entry: &mut Entry, mask: u64, name: impl FnOnce() -> OwnedKey) {
        let missing = mask & !entry.queued;
        if missing == 0 {
            return;
        }
        let name = name();
        entry.queued |= missing;
        for p in 0..self.links.len() {
            if missing & (1 << p) != 0 && !self.links.push(p, name.clone()) {
                entry.queued &= !(1 << p);
            }
        }
    }

    /// What this region knows of `key` at `now`: every live slot's total
    /// over all regions, ascending (regions agree when their views are
    /// equal).
    pub fn view(&self, key: &str, now: u64) -> Vec<(u64, u64)> {
        let mut shard = lock(self.shard(key.as_bytes()));
        let Some(e) = shard.get_mut(key.as_bytes()) else { return Vec::new() };
        e.prune(now);
        e.slots.iter().map(|s| (s.id, s.total())).collect()
    }

    /// Own hits of `key` not yet acknowledged by every peer.
    pub fn unacked(&self, key: &str) -> u64 {
        lock(self.shard(key.as_bytes())).get(key.as_bytes()).map_or(0, Entry::unacked)
    }

    /// The largest unacknowledged usage of any key of a `bounded` limit, as
    /// a fraction of its slice in parts per million, per limit fingerprint
    /// (for the metric of each bounded rule's slice in use).
    pub fn slice_use(&self) -> HashMap<u64, (u64, u64)> {
        let mut out: HashMap<u64, (u64, u64)> = HashMap::new();
        for shard in self.shards.iter() {
            for e in lock(shard).values() {
                let Some(r) = &e.rule else { continue };
                if let SyncMode::Bounded { overshoot_ppm } = r.mode {
                    let capacity = match e.shape {
                        Some(crate::region::Shape::Gcra { .. }) => r.limit.burst(),
                        _ => r.limit.limit(),
                    };
                    let slice = crate::region::slice(overshoot_ppm, capacity, self.regions());
                    let v = out.entry(r.fingerprint).or_insert((0, slice));
                    v.0 = v.0.max(e.unacked());
                }
            }
        }
        out
    }

    /// Merge a peer's batch at `now`; the acknowledgement to send back.
    pub fn receive(&self, batch: &Batch, now: u64) -> Receipt {
        let peers = self.links.len();
        let sender = self.names.read().unwrap_or_else(PoisonError::into_inner).index.get(batch.from.as_str()).copied();
        let mut receipt = Receipt {
            ack: Ack {
                region: self.region.to_string(),
                incarnation: self.incarnation,
                seq: batch.seq,
                for_incarnation: batch.from_incarnation,
            },
            ..Receipt::default()
        };
        match sender.filter(|&i| i > 0) {
            Some(i) => {
                let p = usize::from(i) - 1;
                let heard = self.links.received(p, batch.from_incarnation, batch.items.len(), now);
                receipt.sender_restarted = heard.sender_restarted;
                if let Some(incarnation) = heard.restarted {
                    self.start_full(p, incarnation);
                }
                if batch.complete && batch.to_incarnation == self.incarnation {
                    self.links.set_complete(p, true);
                }
            }
            None => {
                self.unknown_senders.fetch_add(1, Ordering::Relaxed);
                receipt.unknown_sender = true;
            }
        }
        let mut mismatches = 0u64;
        let names: Vec<u16> = batch.regions.iter().map(|n| self.intern(n)).collect();
        // A component the sender relays (not its own current one) that
        // raises ours goes on to every other peer: a dead incarnation's last
        // usage then reaches every region that missed it.
        let sender = self.intern(&batch.from);
        let relay_to = match usize::from(sender).checked_sub(1).filter(|&p| p < peers) {
            Some(p) => self.all_peers() & !(1 << p),
            None => self.all_peers(),
        };
        // Incarnations: the sender's own, its record's, and those of the
        // components below.
        self.incarnations.learn(u32::from(sender), batch.from_incarnation, now);
        for rec in &batch.incarnations {
            if let Some(&region) = names.get(rec.region as usize) {
                self.incarnations.merge(Incarnation { region: u32::from(region), ..*rec }, now);
            }
        }
        let mut seen: Vec<(u16, u64)> = Vec::new();
        for item in &batch.items {
            let mut shard = lock(self.shard(item.key.as_bytes()));
            if !shard.contains_key(item.key.as_bytes()) {
                shard.insert(OwnedKey::new(&item.key), Entry::default());
            }
            let Some(entry) = shard.get_mut(item.key.as_bytes()) else { unreachable!("just inserted") };
            if entry.shape.is_some_and(|s| s != item.shape) {
                self.shape_mismatches.fetch_add(1, Ordering::Relaxed);
                mismatches += 1;
                receipt.mismatch.get_or_insert_with(|| (item.key.clone(), 0));
                continue;
            }
            if entry.rule.as_ref().is_some_and(|r| r.fingerprint != item.fingerprint) {
                self.fingerprint_mismatches.fetch_add(1, Ordering::Relaxed);
                mismatches += 1;
                receipt.mismatch.get_or_insert_with(|| (item.key.clone(), 0));
            }
            entry.shape.get_or_insert(item.shape);
            let mut relay = false;
            for c in &item.components {
                let Some(&region) = names.get(c.region as usize) else { continue };
                if region == 0 && c.incarnation == self.incarnation {
                    continue; // our own current component: ours is the truth
                }
                if !seen.contains(&(region, c.incarnation)) {
                    seen.push((region, c.incarnation));
                }
                let cur = entry.current_slot(now).unwrap_or(0);
                if c.slot.saturating_add(item.shape.horizon()) <= cur {
                    self.stale.fetch_add(1, Ordering::Relaxed);
                } else if entry.merge(region, c.incarnation, c.slot, c.count, c.back, now, peers) {
                    self.merges.fetch_add(1, Ordering::Relaxed);
                    relay |= region != sender || c.incarnation != batch.from_incarnation;
                } else {
                    self.unchanged.fetch_add(1, Ordering::Relaxed);
                }
            }
            if relay && relay_to != 0 {
                entry.relay |= relay_to;
                self.queue_for(entry, relay_to, || OwnedKey::new(&item.key));
            }
        }
        for (region, incarnation) in seen {
            self.incarnations.learn(u32::from(region), incarnation, now);
        }
        if self.incarnations.superseded(self.incarnation) {
            self.superseded.store(true, Ordering::Relaxed);
        }
        if let Some(m) = &mut receipt.mismatch {
            m.1 = mismatches;
        }
        receipt
    }

    /// Whether a later incarnation of this region is known (its clock
    /// stepped back across a restart, or two processes claim the region):
    /// bounded rules admit nothing here until it restarts.
    pub fn superseded(&self) -> bool {
        self.superseded.load(Ordering::Relaxed)
    }

    fn intern(&self, name: &str) -> u16 {
        if let Some(&i) = self.names.read().unwrap_or_else(PoisonError::into_inner).index.get(name) {
            return i;
        }
        let mut names = self.names.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(&i) = names.index.get(name) {
            return i;
        }
        let i = u16::try_from(names.list.len()).unwrap_or(u16::MAX);
        let name: Arc<str> = Arc::from(name);
        names.list.push(name.clone());
        names.index.insert(name, i);
        i
    }

    /// The next batch for peer `p` at `now`, if one is due: queued keys (a
    /// full state transfer's first), or an empty heartbeat on an idle link.
    /// `None` while `max_in_flight` batches await acknowledgement.
    pub fn next_batch(&self, p: usize, now: u64) -> Option<Batch> {
        let mut items = Items::default();
        let head = self.next_batch_into(p, now, &mut items)?;
        Some(head.with_items(items.0))
    }

    /// [`GlobalTable::next_batch`], each key handed to `sink` as it is read
    /// (under its shard's lock; `components` is a buffer reused between
    /// keys) instead of collected: a transport can encode the batch
    /// straight from the table. Returns the batch's other fields.
    pub fn next_batch_into(&self, p: usize, now: u64, sink: &mut impl BatchSink) -> Option<BatchHead> {
        self.flush_lazy(now);
        let expired = self.links.expire(p, now);
        self.requeue(p, expired);
        let plan = loop {
            match self.links.take(p, now) {
                Take::Wait => return None,
                // Keys were dropped from a full queue: send everything.
                Take::List(incarnation) => self.start_full(p, incarnation),
                Take::Batch(plan) => break plan,
            }
        };
        let full = plan.full;
        let mut items = 0u64;
        let mut components: Vec<Component> = Vec::new();
        let mut sent = Vec::new();
        // Components name their region by its index here (0: this one).
        let regions: Vec<String> =
            self.names.read().unwrap_or_else(PoisonError::into_inner).list.iter().map(|n| n.to_string()).collect();
        for key in &plan.keys {
            let mut shard = lock(self.shard(key.as_bytes()));
            let Some(entry) = shard.get_mut(key.as_bytes()) else { continue };
            // Every component: in a full transfer, or relayed.
            let all = full || entry.relay & (1 << p) != 0;
            if !full {
                entry.queued &= !(1 << p);
            }
            entry.relay &= !(1 << p);
            entry.prune(now);
            let (Some(shape), Some(rule)) = (entry.shape, entry.rule.as_ref()) else {
                // Only peers' counts, no rule here yet: a full transfer (or
                // a relay) sends them with a zero fingerprint.
                if all && let Some(shape) = entry.shape {
                    components.clear();
                    components.extend(entry.slots.iter().flat_map(|s| {
                        s.comps.iter().map(|c| Component {
                            region: u32::from(c.region),
                            incarnation: c.incarnation,
                            slot: s.id,
                            count: c.count,
                            back: c.back,
                        })
                    }));
                    sink.item(key.as_str(), 0, shape, &components);
                    items += 1;
                }
                continue;
            };
            // Only a bounded rule's slice reads what peers acknowledged: the
            // values sent are kept for those alone.
            let bounded = matches!(rule.mode, SyncMode::Bounded { .. });
            components.clear();
            for s in &entry.slots {
                if s.own > 0 || s.back > 0 || full {
                    components.push(Component {
                        region: 0,
                        incarnation: self.incarnation,
                        slot: s.id,
                        count: s.own,
                        back: s.back,
                    });
                    if bounded {
                        // What an acknowledgement confirms: the hits
                        // admitted so far (late charges are not sliced).
                        sent.push((key.clone(), s.id, s.admitted()));
                    }
                }
                if all {
                    for c in &s.comps {
                        components.push(Component {
                            region: u32::from(c.region),
                            incarnation: c.incarnation,
                            slot: s.id,
                            count: c.count,
                            back: c.back,
                        });
                    }
                }
            }
            sink.item(key.as_str(), rule.fingerprint, shape, &components);
            items += 1;
        }
        // A full state transfer carries the record of incarnations (the
        // names' indices are the batch's regions).
        let incarnations = if full || plan.complete { self.incarnations.records() } else { Vec::new() };
        let head = BatchHead {
            from: self.region.to_string(),
            regions,
            from_incarnation: self.incarnation,
            to_incarnation: plan.to_incarnation,
            seq: plan.seq,
            items,
            complete: plan.complete,
            incarnations,
        };
        self.links.sent(p, plan, sent, items, now);
        Some(head)
    }

    /// Queue the keys whose lazy period is over.
    fn flush_lazy(&self, now: u64) {
        self.queue_lazy(self.lazy.due(now));
    }

    /// Queue `keys` from the lazy list, those still waiting.
    fn queue_lazy(&self, keys: Vec<OwnedKey>) {
        for key in keys {
            let mut shard = lock(self.shard(key.as_bytes()));
            if let Some(e) = shard.get_mut(key.as_bytes())
                && e.lazy
            {
                self.queue_for_peers(e, || key.clone());
            }
        }
    }

    /// Batches failed or went unacknowledged: their keys go out again (the
    /// lazy ones at once if the link started failing).
    fn requeue(&self, p: usize, lost: Requeue<OwnedKey>) {
        if lost.started_failing {
            self.link_failing(true);
        }
        for key in lost.keys {
            let mut shard = lock(self.shard(key.as_bytes()));
            let Some(entry) = shard.get_mut(key.as_bytes()) else { continue };
            // The lost batch may have relayed others' components: all go
            // again.
            entry.relay |= 1 << p;
            if entry.queued & (1 << p) == 0 {
                entry.queued |= 1 << p;
                drop(shard);
                let name = key.clone();
                if !self.links.push(p, key)
                    && let Some(e) = lock(self.shard(name.as_bytes())).get_mut(name.as_bytes())
                {
                    e.queued &= !(1 << p);
                }
            }
        }
    }

    /// The transport could not deliver batch `seq` to peer `p`: its keys go
    /// out again.
    pub fn on_failure(&self, p: usize, seq: u64) {
        self.requeue(p, self.links.on_failure(p, seq));
    }

    /// A link started (`true`) or stopped failing. While any link fails,
    /// nothing is lazy (and what was waiting goes now): a healed link then
    /// finds every change already queued.
    fn link_failing(&self, started: bool) {
        self.queue_lazy(self.lazy.link_failing(started));
    }

    /// Peer `p` acknowledged a batch at `now`. A new incarnation of the
    /// peer (it restarted with its state lost, or this is the first word
    /// from it) starts a full state transfer to it.
    pub fn on_ack(&self, p: usize, ack: &Ack, now: u64) {
        let acked = self.links.on_ack(p, ack, now, self.incarnation);
        if acked.recovered {
            self.link_failing(false);
        }
        for (key, slot, count) in acked.confirmed.unwrap_or_default() {
            if let Some(entry) = lock(self.shard(key.as_bytes())).get_mut(key.as_bytes()) {
                entry.acked(p, slot, count);
            }
        }
        if let Some(incarnation) = acked.restarted {
            self.start_full(p, incarnation);
        }
    }

    /// Send peer `p` (at `incarnation`) every key this region holds.
    fn start_full(&self, p: usize, incarnation: u64) {
        let mut keys = VecDeque::new();
        for shard in self.shards.iter() {
            keys.extend(lock(shard).keys().cloned());
        }
        self.links.start_full(p, incarnation, keys);
    }

    /// Drop what no longer matters at `now`: slots past their horizon,
    /// keys with nothing left. Returns the keys held.
    pub fn sweep(&self, now: u64) -> usize {
        // A dead incarnation whose span ended before anything a bounded
        // decision counts now is charged no more.
        let keep = self.bounded_span_us.load(Ordering::Relaxed).saturating_mul(2).max(3_600_000_000);
        self.incarnations.prune(now.saturating_sub(keep));
        let mut held = 0;
        for shard in self.shards.iter() {
            let mut s = lock(shard);
            s.retain(|_, e| {
                e.prune(now);
                !e.idle(now)
            });
            held += s.len();
        }
        held
    }

    /// The counters of the link to peer `p`.
    pub fn link_stats(&self, p: usize) -> LinkStats {
        self.links.stats(p)
    }

    /// The table's counters.
    pub fn stats(&self) -> TableStats {
        TableStats {
            merges: self.merges.load(Ordering::Relaxed),
            unchanged: self.unchanged.load(Ordering::Relaxed),
            stale: self.stale.load(Ordering::Relaxed),
            fingerprint_mismatches: self.fingerprint_mismatches.load(Ordering::Relaxed),
            shape_mismatches: self.shape_mismatches.load(Ordering::Relaxed),
            unknown_senders: self.unknown_senders.load(Ordering::Relaxed),
            keys: self.shards.iter().map(|s| lock(s).len() as u64).sum(),
        }
    }

    /// The index of peer `name`, if it is one.
    pub fn peer_index(&self, name: &str) -> Option<usize> {
        self.cfg.peers.iter().position(|p| p == name)
    }
}

impl GlobalTable {
    /// Decide one request's checks at `now`: the `global` ones here, the
    /// others in `store`, **all or nothing** across both (a denied request
    /// keeps nothing in any counter; see [`GlobalTable::refund`]).
    pub fn apply_all_with<C: crate::Clock>(
        &self,
        store: &crate::MemoryStore<C>,
        checks: &[crate::Check<'_>],
        now: u64,
        out: &mut Vec<Result<Decision, StoreError>>,
    ) {
        crate::store::all_or_nothing(
            checks,
            out,
            |c| match (c.scope, c.op) {
                // A concurrency limit is never global (the rules refuse it):
                // beside one, a global limit takes as usual, and a release or
                // an extend only peeks.
                (Scope::Global(mode), Op::Take | Op::Acquire { .. }) => self.apply(c.key, c.limit, mode, c.hits, now),
                (Scope::Global(mode), Op::Release { .. } | Op::Extend { .. }) => {
                    self.apply(c.key, c.limit, mode, 0, now)
                }
                // Given back from this region's own count, and to every
                // peer as a count given back (see `GlobalTable::give_back`).
                (Scope::Global(mode), Op::Refund) => self.give_back(c.key, c.limit, mode, c.hits, now).map(|(d, _)| d),
                (Scope::Global(mode), Op::Late) => self.charge_late(c.key, c.limit, mode, c.hits, now),
                (Scope::Global(mode), Op::Return { taken_at_us }) => {
                    self.return_at(c.key, c.limit, mode, c.hits, taken_at_us, now).map(|(d, _)| d)
                }
                (Scope::Region, _) => store.check_at(c, now),
            },
            |c| match c.scope {
                Scope::Global(_) => self.refund(c.key, c.hits, now, now),
                Scope::Region => store.undo_at(c, now),
            },
        );
    }
}

/// Whether a rule's scope sends it through a [`GlobalTable`].
pub fn is_global(scope: Scope) -> Option<SyncMode> {
    match scope {
        Scope::Global(m) => Some(m),
        Scope::Region => None,
    }
}

impl Region for GlobalTable {
    fn name(&self) -> &str {
        self.region()
    }

    fn peers(&self) -> &[String] {
        GlobalTable::peers(self)
    }

    fn next_batch_into<S: BatchSink + std::marker::Send>(
        &self,
        peer: usize,
        now_us: u64,
        sink: &mut S,
    ) -> impl Future<Output = Option<BatchHead>> + std::marker::Send {
        std::future::ready(GlobalTable::next_batch_into(self, peer, now_us, sink))
    }

    fn on_ack(&self, peer: usize, ack: &Ack, now_us: u64) -> impl Future<Output = ()> + std::marker::Send {
        GlobalTable::on_ack(self, peer, ack, now_us);
        std::future::ready(())
    }

    fn on_failure(&self, peer: usize, seq: u64) {
        GlobalTable::on_failure(self, peer, seq);
    }

    fn receive(
        &self,
        batch: Batch,
        now_us: u64,
    ) -> impl Future<Output = Result<Receipt, StoreError>> + std::marker::Send {
        std::future::ready(Ok(GlobalTable::receive(self, &batch, now_us)))
    }
}
