//! [`GlobalTable`]: a memory-store region's `scope: global` state, and the
//! sync engine that keeps its peers in step — what to send each peer, what
//! they acknowledged, what a restarted peer must be sent again. Pure: no
//! clock reads, no I/O; a transport (gRPC between services, or the
//! simulator's network) moves the [`Batch`]es and [`Ack`]s.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use crate::region::entry::{Caps, Entry, Send, shape_of};
use crate::region::wire::{Ack, Batch, Component, Item, Shape};
use crate::region::{Lazy, Scope, SyncMode};
use crate::store::OwnedKey;
use crate::{Decision, Limit, StoreError};

/// Most peer regions.
pub const MAX_PEERS: usize = 63;

/// How a region syncs its global limits.
#[derive(Debug, Clone)]
pub struct RegionConfig {
    /// This region's name.
    pub region: String,
    /// The peer regions' names.
    pub peers: Vec<String>,
    /// This region's incarnation: new whenever its state was lost.
    pub incarnation: u64,
    /// Most keys in one batch (default 1 000).
    pub batch_items: usize,
    /// Most keys queued for one peer (default 1 048 576); beyond it a key
    /// is dropped from the queue and counted, and once the queue drains the
    /// peer gets a full state transfer, so nothing stays lost.
    pub max_queue: usize,
    /// Batches awaiting their acknowledgement per peer (default 8).
    pub max_in_flight: usize,
    /// The sync interval (µs): how often the transport asks for batches
    /// (default 100 ms).
    pub interval_us: u64,
    /// A batch with no acknowledgement after `interval + 2 × the link's
    /// round trip` is sent again; never later than this (µs, default 2 s).
    pub ack_timeout_us: u64,
    /// An idle link sends an empty batch this often (µs), so incarnations
    /// and lag stay known (default 1 s).
    pub heartbeat_us: u64,
    /// The wait suggested to a request the slice denies (µs): about one sync
    /// round trip (default 200 ms).
    pub retry_hint_us: u64,
    /// The longest a key far below its limit waits before it is sent (µs,
    /// default 1 s: ten intervals). A key whose hits not yet sent reach
    /// `remaining / (100 × regions)` is sent at the next batch.
    pub lazy_us: u64,
}

impl RegionConfig {
    /// Defaults for `region` with `peers`.
    pub fn new(region: impl Into<String>, peers: Vec<String>, incarnation: u64) -> Self {
        Self {
            region: region.into(),
            peers,
            incarnation,
            batch_items: 1_000,
            max_queue: 1 << 20,
            max_in_flight: 8,
            interval_us: 100_000,
            ack_timeout_us: 2_000_000,
            heartbeat_us: 1_000_000,
            retry_hint_us: 200_000,
            lazy_us: 1_000_000,
        }
    }
}

/// Counters of one peer link, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkStats {
    /// Batches sent.
    pub batches_sent: u64,
    /// Keys sent.
    pub items_sent: u64,
    /// Batches acknowledged.
    pub acks: u64,
    /// Batches that failed or were never acknowledged (sent again).
    pub failures: u64,
    /// Keys dropped from a full queue (each later resent in a full state
    /// transfer).
    pub dropped: u64,
    /// Full state transfers started.
    pub full_syncs: u64,
    /// Batches received from this peer.
    pub batches_received: u64,
    /// Keys received from this peer.
    pub items_received: u64,
    /// When the last acknowledgement arrived (µs since the epoch; 0: never).
    pub last_ack_us: u64,
    /// When the last batch from this peer arrived (µs; 0: never).
    pub last_received_us: u64,
    /// Round trip of the last acknowledged batch (µs).
    pub rtt_us: u64,
    /// Smoothed round trip (µs; 0 until the first acknowledgement).
    pub srtt_us: u64,
    /// Keys waiting to be sent.
    pub queued: u64,
    /// Batches awaiting acknowledgement.
    pub in_flight: u64,
    /// The peer's incarnation as last heard (0: never).
    pub incarnation: u64,
    /// Whether the peer has sent this region its full state (for this
    /// region's incarnation).
    pub complete: bool,
}

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

/// What receiving a batch did, for the transport's log and metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Receipt {
    /// The acknowledgement to send back.
    pub ack: Ack,
    /// The sender is not among this region's peers (merged anyway).
    pub unknown_sender: bool,
    /// The sender's incarnation changed since its last batch.
    pub sender_restarted: bool,
    /// The first key whose sender's limit differs from this region's, with
    /// how many did in this batch.
    pub mismatch: Option<(String, u64)>,
}

struct Names {
    list: Vec<Arc<str>>,
    index: HashMap<Arc<str>, u16>,
}

struct InFlight {
    seq: u64,
    sent_us: u64,
    /// The keys sent (sent again if the batch is lost).
    keys: Vec<OwnedKey>,
    /// Bounded keys' own counts sent, `(key, slot, count)`: what an
    /// acknowledgement confirms.
    acked: Vec<(OwnedKey, u64, u64)>,
    full: bool,
    complete: bool,
}

struct Full {
    keys: VecDeque<OwnedKey>,
    for_incarnation: u64,
    complete_sent: bool,
}

struct Link {
    name: Arc<str>,
    queue: VecDeque<OwnedKey>,
    overflowed: bool,
    full: Option<Full>,
    known_incarnation: Option<u64>,
    seq: u64,
    in_flight: Vec<InFlight>,
    last_sent_us: u64,
    /// The peer's incarnation in its last batch to us.
    sender_incarnation: Option<u64>,
    /// A batch to it failed since its last acknowledgement.
    failing: bool,
    complete_from: bool,
    stats: LinkStats,
}

/// Keys are held inline where short (`OwnedKey`), in the map and in every
/// queue: a million keys are then no million small heap objects, whose
/// allocation on the deciding threads and release by the sweeper slowed
/// every other allocation of the request path (BENCHMARKS.md, "Many
/// regions").
type Shard = Mutex<HashMap<OwnedKey, Entry, foldhash::fast::RandomState>>;

/// A memory-store region's global limits: decisions, merges, and what to
/// send each peer. Thread-safe; keys are sharded.
pub struct GlobalTable {
    region: Arc<str>,
    incarnation: u64,
    cfg: RegionConfig,
    names: RwLock<Names>,
    shards: Box<[Shard]>,
    hasher: foldhash::fast::RandomState,
    links: Box<[Mutex<Link>]>,
    /// Keys whose own hits wait for the lazy period, and failing links.
    lazy: Lazy<OwnedKey>,
    warming: AtomicBool,
    /// The limits entries share (see [`GlobalTable::shared`]).
    limits: Mutex<std::collections::HashSet<Arc<Limit>>>,
    merges: AtomicU64,
    unchanged: AtomicU64,
    stale: AtomicU64,
    fingerprint_mismatches: AtomicU64,
    shape_mismatches: AtomicU64,
    unknown_senders: AtomicU64,
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
    pub fn new(cfg: RegionConfig) -> Result<Self, String> {
        let bad_name =
            |n: &str| n.is_empty() || n.len() > 64 || n.chars().any(|c| c.is_whitespace() || c == ',' || c == '=');
        if bad_name(&cfg.region) {
            return Err(format!("region name `{}`: use 1 to 64 characters without spaces, `,` or `=`", cfg.region));
        }
        if cfg.peers.len() > MAX_PEERS {
            return Err(format!("{} peer regions: at most {MAX_PEERS}", cfg.peers.len()));
        }
        let mut list: Vec<Arc<str>> = vec![Arc::from(cfg.region.as_str())];
        for p in &cfg.peers {
            if bad_name(p) {
                return Err(format!("peer region name `{p}`: use 1 to 64 characters without spaces, `,` or `=`"));
            }
            if list.iter().any(|n| &**n == p.as_str()) {
                return Err(if *p == cfg.region {
                    format!("region `{p}` is listed among its own peers: list only the other regions")
                } else {
                    format!("peer region `{p}` is listed twice")
                });
            }
            list.push(Arc::from(p.as_str()));
        }
        let index = list.iter().enumerate().map(|(i, n)| (n.clone(), i as u16)).collect();
        let links = list[1..]
            .iter()
            .map(|name| {
                Mutex::new(Link {
                    name: name.clone(),
                    queue: VecDeque::new(),
                    overflowed: false,
                    full: None,
                    known_incarnation: None,
                    seq: 0,
                    in_flight: Vec::new(),
                    last_sent_us: 0,
                    sender_incarnation: None,
                    failing: false,
                    complete_from: false,
                    stats: LinkStats::default(),
                })
            })
            .collect();
        let shards =
            (0..64).map(|_| Mutex::new(HashMap::with_hasher(foldhash::fast::RandomState::default()))).collect();
        Ok(Self {
            region: list[0].clone(),
            incarnation: cfg.incarnation,
            warming: AtomicBool::new(!cfg.peers.is_empty()),
            names: RwLock::new(Names { list, index }),
            shards,
            hasher: foldhash::fast::RandomState::default(),
            links,
            lazy: Lazy::new(cfg.lazy_us),
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
        self.warming.load(Ordering::Acquire)
    }

    fn shard(&self, key: &[u8]) -> &Shard {
        let h = std::hash::BuildHasher::hash_one(&self.hasher, key);
        &self.shards[(h as usize) % self.shards.len()]
    }

    fn caps(&self) -> Caps {
        Caps {
            regions: self.regions(),
            warming: self.warming(),
            retry_us: self.cfg.retry_hint_us,
            eager: self.lazy.eager(),
        }
    }

    /// Decide `hits` of a `scope: global` limit for `key` at `now`
    /// (µs since the epoch): the limit over every region's known usage,
    /// then the slice (`bounded`, or while warming); admitted hits are
    /// queued for every peer.
    pub fn apply(&self, key: &str, limit: &Limit, mode: SyncMode, hits: u64, now: u64) -> Result<Decision, StoreError> {
        let Some(shape) = shape_of(limit) else {
            return Err(StoreError::Unavailable(
                "sliding_log cannot be global: use sliding_buckets or gcra, or scope: region".to_owned(),
            ));
        };
        let peers = self.links.len();
        let caps = self.caps();
        let mut shard = lock(self.shard(key.as_bytes()));
        let decide = |entry: &mut Entry| {
            entry.set_rule(limit, mode, shape, peers, || self.shared(limit));
            let (d, send) = entry.decide(limit, now, hits, peers, caps);
            match send {
                Send::Now => self.queue_for_peers(entry, || OwnedKey::new(key)),
                Send::Later if !entry.lazy => {
                    entry.lazy = true;
                    self.lazy.wait(now, OwnedKey::new(key));
                }
                Send::Later | Send::No => {}
            }
            d
        };
        // One lookup on the common path (the key is known).
        if let Some(entry) = shard.get_mut(key.as_bytes()) {
            return Ok(decide(entry));
        }
        Ok(decide(shard.entry(OwnedKey::new(key)).or_default()))
    }

    /// Give back `hits` admitted at `at` (another limit of the request
    /// denied it). See [`Entry::refund`]: exact here, never looser elsewhere.
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

    /// Queue `entry`'s key (`name` makes it) for every peer it is not
    /// queued for yet (under its shard's lock).
    fn queue_for_peers(&self, entry: &mut Entry, name: impl FnOnce() -> OwnedKey) {
        let all = if self.links.len() == 64 { u64::MAX } else { (1u64 << self.links.len()) - 1 };
        let missing = all & !entry.queued;
        if missing == 0 {
            return;
        }
        let name = name();
        entry.unsent = 0;
        entry.lazy = false;
        entry.queued |= missing;
        for (p, link) in self.links.iter().enumerate() {
            if missing & (1 << p) != 0 {
                let mut link = lock(link);
                if link.queue.len() >= self.cfg.max_queue {
                    link.stats.dropped += 1;
                    link.overflowed = true;
                    entry.queued &= !(1 << p);
                } else {
                    link.queue.push_back(name.clone());
                }
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
        e.slots.iter().map(|s| (s.id, s.comps.iter().fold(s.own, |t, c| t.saturating_add(c.count)))).collect()
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
            ack: Ack { region: self.region.to_string(), incarnation: self.incarnation, seq: batch.seq },
            ..Receipt::default()
        };
        match sender.filter(|&i| i > 0) {
            Some(i) => {
                let mut link = lock(&self.links[usize::from(i) - 1]);
                receipt.sender_restarted = link.sender_incarnation.is_some_and(|inc| inc != batch.from_incarnation);
                link.sender_incarnation = Some(batch.from_incarnation);
                link.stats.batches_received += 1;
                link.stats.items_received += batch.items.len() as u64;
                link.stats.last_received_us = now;
                if batch.complete && batch.to_incarnation == self.incarnation && !link.complete_from {
                    link.complete_from = true;
                    drop(link);
                    let warming = self.links.iter().any(|l| !lock(l).complete_from);
                    self.warming.store(warming, Ordering::Release);
                }
            }
            None => {
                self.unknown_senders.fetch_add(1, Ordering::Relaxed);
                receipt.unknown_sender = true;
            }
        }
        let mut mismatches = 0u64;
        let names: Vec<u16> = batch.regions.iter().map(|n| self.intern(n)).collect();
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
            for c in &item.components {
                let Some(&region) = names.get(c.region as usize) else { continue };
                if region == 0 && c.incarnation == self.incarnation {
                    continue; // our own current component: ours is the truth
                }
                let cur = entry.current_slot(now).unwrap_or(0);
                if c.slot.saturating_add(item.shape.horizon()) <= cur {
                    self.stale.fetch_add(1, Ordering::Relaxed);
                } else if entry.merge(region, c.incarnation, c.slot, c.count, now, peers) {
                    self.merges.fetch_add(1, Ordering::Relaxed);
                } else {
                    self.unchanged.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        if let Some(m) = &mut receipt.mismatch {
            m.1 = mismatches;
        }
        receipt
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
        let mut items = Vec::new();
        let head = self.next_batch_into(p, now, &mut |key: &str, fingerprint, shape, components: &[Component]| {
            items.push(Item { key: key.to_owned(), fingerprint, shape, components: components.to_vec() });
        })?;
        Some(Batch {
            from: head.from,
            regions: head.regions,
            from_incarnation: head.from_incarnation,
            to_incarnation: head.to_incarnation,
            seq: head.seq,
            items,
            complete: head.complete,
        })
    }

    /// [`GlobalTable::next_batch`], each key handed to `sink` as it is read
    /// (under its shard's lock; `components` is a buffer reused between
    /// keys) instead of collected: a transport can encode the batch
    /// straight from the table. Returns the batch's other fields.
    pub fn next_batch_into(&self, p: usize, now: u64, sink: &mut impl BatchSink) -> Option<BatchHead> {
        self.flush_lazy(now);
        let expired = {
            let mut link = lock(&self.links[p]);
            // Unacknowledged after an interval and twice the round trip: lost
            // (retransmitted, harmlessly if it was only slow).
            let srtt = if link.stats.srtt_us == 0 { self.cfg.ack_timeout_us } else { link.stats.srtt_us };
            let timeout = (self.cfg.interval_us + 2 * srtt).min(self.cfg.ack_timeout_us);
            let (gone, kept): (Vec<InFlight>, Vec<InFlight>) =
                std::mem::take(&mut link.in_flight).into_iter().partition(|f| now.saturating_sub(f.sent_us) >= timeout);
            link.in_flight = kept;
            link.stats.failures += gone.len() as u64;
            let started = !gone.is_empty() && !link.failing;
            link.failing |= !gone.is_empty();
            (gone, started)
        };
        let (expired, started) = expired;
        if started {
            self.link_failing(true);
        }
        for f in expired {
            self.requeue(p, f);
        }
        let (keys, full, complete, seq, to_incarnation) = {
            let mut link = lock(&self.links[p]);
            if link.in_flight.len() >= self.cfg.max_in_flight.max(1) {
                return None;
            }
            if link.overflowed && link.queue.is_empty() && link.full.is_none() {
                // Keys were dropped from a full queue: send everything.
                link.overflowed = false;
                let inc = link.known_incarnation.unwrap_or(0);
                drop(link);
                self.start_full(p, inc);
                link = lock(&self.links[p]);
            }
            let n = self.cfg.batch_items.max(1);
            let mut keys = Vec::new();
            let mut full = false;
            let mut complete = false;
            let full_in_flight = link.in_flight.iter().any(|f| f.full || f.complete);
            if let Some(f) = &mut link.full {
                while keys.len() < n {
                    match f.keys.pop_front() {
                        Some(k) => keys.push(k),
                        None => break,
                    }
                }
                full = !keys.is_empty();
                if keys.is_empty() && !full_in_flight && !f.complete_sent {
                    f.complete_sent = true;
                    complete = true;
                }
            }
            if !full {
                while keys.len() < n {
                    match link.queue.pop_front() {
                        Some(k) => keys.push(k),
                        None => break,
                    }
                }
            }
            // Idle: a heartbeat now and then, and at once to a peer not yet
            // heard from (its incarnation starts the state transfer).
            let first_contact = link.known_incarnation.is_none() && link.in_flight.is_empty();
            let heartbeat_due = now.saturating_sub(link.last_sent_us) >= self.cfg.heartbeat_us;
            if keys.is_empty() && !complete && !first_contact && !heartbeat_due {
                return None;
            }
            link.seq += 1;
            link.last_sent_us = now;
            (keys, full, complete, link.seq, link.known_incarnation.unwrap_or(0))
        };
        let mut items = 0u64;
        let mut components: Vec<Component> = Vec::new();
        let mut sent = Vec::new();
        // Components name their region by its index here (0: this one).
        let regions: Vec<String> =
            self.names.read().unwrap_or_else(PoisonError::into_inner).list.iter().map(|n| n.to_string()).collect();
        for key in &keys {
            let mut shard = lock(self.shard(key.as_bytes()));
            let Some(entry) = shard.get_mut(key.as_bytes()) else { continue };
            if !full {
                entry.queued &= !(1 << p);
            }
            entry.prune(now);
            let (Some(shape), Some(rule)) = (entry.shape, entry.rule.as_ref()) else {
                // Only peers' counts, no rule here yet: a full transfer
                // relays them with a zero fingerprint.
                if full && let Some(shape) = entry.shape {
                    components.clear();
                    components.extend(entry.slots.iter().flat_map(|s| {
                        s.comps.iter().map(|c| Component {
                            region: u32::from(c.region),
                            incarnation: c.incarnation,
                            slot: s.id,
                            count: c.count,
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
                if s.own > 0 || full {
                    components.push(Component { region: 0, incarnation: self.incarnation, slot: s.id, count: s.own });
                    if bounded {
                        sent.push((key.clone(), s.id, s.own));
                    }
                }
                if full {
                    for c in &s.comps {
                        components.push(Component {
                            region: u32::from(c.region),
                            incarnation: c.incarnation,
                            slot: s.id,
                            count: c.count,
                        });
                    }
                }
            }
            sink.item(key.as_str(), rule.fingerprint, shape, &components);
            items += 1;
        }
        let mut link = lock(&self.links[p]);
        link.stats.batches_sent += 1;
        link.stats.items_sent += items;
        link.in_flight.push(InFlight { seq, sent_us: now, keys, acked: sent, full, complete });
        Some(BatchHead {
            from: self.region.to_string(),
            regions,
            from_incarnation: self.incarnation,
            to_incarnation,
            seq,
            items,
            complete,
        })
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

    /// A batch failed or went unacknowledged: its keys go out again.
    fn requeue(&self, p: usize, f: InFlight) {
        if f.complete {
            let mut link = lock(&self.links[p]);
            if let Some(full) = &mut link.full {
                full.complete_sent = false;
            }
            return;
        }
        if f.full {
            let mut link = lock(&self.links[p]);
            if let Some(full) = &mut link.full {
                for k in f.keys.into_iter().rev() {
                    full.keys.push_front(k);
                }
            }
            return;
        }
        for key in f.keys {
            let mut shard = lock(self.shard(key.as_bytes()));
            let Some(entry) = shard.get_mut(key.as_bytes()) else { continue };
            if entry.queued & (1 << p) == 0 {
                entry.queued |= 1 << p;
                drop(shard);
                let mut link = lock(&self.links[p]);
                if link.queue.len() >= self.cfg.max_queue {
                    link.stats.dropped += 1;
                    link.overflowed = true;
                    drop(link);
                    if let Some(e) = lock(self.shard(key.as_bytes())).get_mut(key.as_bytes()) {
                        e.queued &= !(1 << p);
                    }
                } else {
                    link.queue.push_back(key);
                }
            }
        }
    }

    /// The transport could not deliver batch `seq` to peer `p`: its keys go
    /// out again.
    pub fn on_failure(&self, p: usize, seq: u64) {
        let f = {
            let mut link = lock(&self.links[p]);
            let Some(i) = link.in_flight.iter().position(|f| f.seq == seq) else { return };
            link.stats.failures += 1;
            let started = !std::mem::replace(&mut link.failing, true);
            (link.in_flight.swap_remove(i), started)
        };
        let (f, started) = f;
        if started {
            self.link_failing(true);
        }
        self.requeue(p, f);
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
        let (done, restart, recovered) = {
            let mut link = lock(&self.links[p]);
            link.stats.last_ack_us = now;
            let recovered = std::mem::take(&mut link.failing);
            let restart = link.known_incarnation != Some(ack.incarnation);
            link.known_incarnation = Some(ack.incarnation);
            let done = match link.in_flight.iter().position(|f| f.seq == ack.seq) {
                Some(i) => {
                    let f = link.in_flight.swap_remove(i);
                    link.stats.acks += 1;
                    let rtt = now.saturating_sub(f.sent_us);
                    link.stats.rtt_us = rtt;
                    link.stats.srtt_us = if link.stats.srtt_us == 0 { rtt } else { (7 * link.stats.srtt_us + rtt) / 8 };
                    if f.complete
                        && let Some(full) = &link.full
                        && full.for_incarnation == ack.incarnation
                    {
                        link.full = None;
                    }
                    Some(f)
                }
                None => None,
            };
            (done, restart, recovered)
        };
        if recovered {
            self.link_failing(false);
        }
        if let Some(f) = done {
            for (key, slot, count) in f.acked {
                if let Some(entry) = lock(self.shard(key.as_bytes())).get_mut(key.as_bytes()) {
                    entry.acked(p, slot, count);
                }
            }
        }
        if restart {
            self.start_full(p, ack.incarnation);
        }
    }

    /// Send peer `p` (at `incarnation`) every key this region holds.
    fn start_full(&self, p: usize, incarnation: u64) {
        let mut keys = VecDeque::new();
        for shard in self.shards.iter() {
            keys.extend(lock(shard).keys().cloned());
        }
        let mut link = lock(&self.links[p]);
        link.stats.full_syncs += 1;
        link.full = Some(Full { keys, for_incarnation: incarnation, complete_sent: false });
    }

    /// Drop what no longer matters at `now`: slots past their horizon,
    /// keys with nothing left. Returns the keys held.
    pub fn sweep(&self, now: u64) -> usize {
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
        let link = lock(&self.links[p]);
        let mut s = link.stats;
        s.queued = link.queue.len() as u64 + link.full.as_ref().map_or(0, |f| f.keys.len() as u64);
        s.in_flight = link.in_flight.len() as u64;
        s.incarnation = link.known_incarnation.unwrap_or(0);
        s.complete = link.complete_from;
        let _ = &link.name;
        s
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
        out.clear();
        let mut denied = false;
        for c in checks {
            let r = match c.scope {
                Scope::Global(mode) => self.apply(c.key, c.limit, mode, c.hits, now),
                Scope::Region => store.apply_at(c.key, c.limit, c.hits, now),
            };
            denied |= c.enforce && r.as_ref().is_ok_and(|d| !d.allowed);
            out.push(r);
        }
        if denied {
            for (c, r) in checks.iter().zip(out.iter()) {
                if c.hits > 0 && r.as_ref().is_ok_and(|d| d.allowed) {
                    match c.scope {
                        Scope::Global(_) => self.refund(c.key, c.hits, now, now),
                        Scope::Region => store.refund_at(c.key, c.limit, c.hits, now, now),
                    }
                }
            }
        }
    }
}

/// Where [`GlobalTable::next_batch_into`] hands each key of a batch.
pub trait BatchSink {
    /// One key: its fingerprint, shape and components.
    fn item(&mut self, key: &str, fingerprint: u64, shape: Shape, components: &[Component]);
}

impl<F: FnMut(&str, u64, Shape, &[Component])> BatchSink for F {
    fn item(&mut self, key: &str, fingerprint: u64, shape: Shape, components: &[Component]) {
        self(key, fingerprint, shape, components);
    }
}

/// A batch's fields other than its keys (see [`Batch`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchHead {
    /// The sending region.
    pub from: String,
    /// The region names components refer to by index.
    pub regions: Vec<String>,
    /// The sender's incarnation.
    pub from_incarnation: u64,
    /// The receiver's incarnation as the sender knows it.
    pub to_incarnation: u64,
    /// The batch's number on its link.
    pub seq: u64,
    /// Keys handed to the sink.
    pub items: u64,
    /// The full state transfer is complete with this batch.
    pub complete: bool,
}

/// Whether a rule's scope sends it through a [`GlobalTable`].
pub fn is_global(scope: Scope) -> Option<SyncMode> {
    match scope {
        Scope::Global(m) => Some(m),
        Scope::Region => None,
    }
}
