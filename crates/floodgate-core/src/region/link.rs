//! The per-peer sync engine, written once for every kind of region: what a
//! region owes each peer (a queue of dirty keys, or a full state transfer),
//! the batches awaiting acknowledgement, the round trip and the
//! acknowledgement timeout, the peer's incarnation, and whether the peer
//! has sent this region its full state.
//!
//! It is a state machine free of I/O, driven by the caller's clock: a
//! region asks [`Links::take`] for the next batch to send, reads the keys
//! from its own storage, records the batch with [`Links::sent`], and hands
//! back acknowledgements ([`Links::on_ack`]) and failures
//! ([`Links::on_failure`]). What each kind of region supplies is its
//! storage and how it marks a key queued:
//!
//! * a memory region ([`GlobalTable`](super::GlobalTable)) keeps one bit
//!   per peer on each key's entry, so its queues are plain [`VecDeque`]s;
//! * a Redis region (in `floodgate-redis`) keeps a map of queued keys per
//!   peer beside its queue ([`Links::push_with`]), since its keys' state is
//!   in Redis.
//!
//! Lock order: a region's own locks (a key's shard) may be held while one
//! link's lock is taken, never the other way round; every method here
//! takes and releases one link's lock.
//!
//! (About 870 lines, a fifth of them unit tests: one state machine, kept
//! whole so that its invariants read in one place.)

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::region::wire::Ack;

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
    /// (default 100 ms). An idle link sends an empty batch (a heartbeat)
    /// as often, so a peer that stops answering is known within an
    /// interval and the call timeout, and incarnations stay known.
    pub interval_us: u64,
    /// A batch with no acknowledgement after `interval + 2 × the link's
    /// round trip` is sent again; never later than this (µs, default 2 s).
    pub ack_timeout_us: u64,
    /// The wait suggested to a request the slice denies (µs): about one sync
    /// round trip (default 200 ms).
    pub retry_hint_us: u64,
    /// The longest a key far below its limit waits before it is sent (µs,
    /// default 1 s: ten intervals). A key whose hits not yet sent reach
    /// `remaining / (100 × regions)` is sent at the next batch.
    pub lazy_us: u64,
    /// How long a region that has heard no peer's full state yet (it just
    /// started, its state lost) waits before it admits on eventual rules
    /// (µs, default 1 s): it knows nothing of what the others admitted, so
    /// it admits nothing until the first full state arrives or this much
    /// time has passed (then its share of the limit until every peer's
    /// has).
    pub warmup_us: u64,
    /// Seeds the key table's hashing, for a run that must replay exactly
    /// (the simulator: the same seed, the same table). `None` (default):
    /// random per process, against hash flooding by chosen keys.
    pub hash_seed: Option<u64>,
}

/// A region's settings that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegionConfigError {
    /// This region's name.
    #[error("region name `{0}`: use 1 to 64 characters without spaces, `,` or `=`")]
    Name(String),
    /// A peer's name.
    #[error("peer region name `{0}`: use 1 to 64 characters without spaces, `,` or `=`")]
    PeerName(String),
    /// Too many peers.
    #[error("{0} peer regions: at most {MAX_PEERS}")]
    TooManyPeers(usize),
    /// This region among its peers.
    #[error("region `{0}` is listed among its own peers: list only the other regions")]
    ItsOwnPeer(String),
    /// A peer listed twice.
    #[error("peer region `{0}` is listed twice")]
    PeerTwice(String),
}

impl RegionConfig {
    /// Whether the names can work: this region's and its peers', each
    /// once, at most [`MAX_PEERS`] peers.
    pub fn check(&self) -> Result<(), RegionConfigError> {
        let bad_name =
            |n: &str| n.is_empty() || n.len() > 64 || n.chars().any(|c| c.is_whitespace() || c == ',' || c == '=');
        if bad_name(&self.region) {
            return Err(RegionConfigError::Name(self.region.clone()));
        }
        if self.peers.len() > MAX_PEERS {
            return Err(RegionConfigError::TooManyPeers(self.peers.len()));
        }
        for (i, p) in self.peers.iter().enumerate() {
            if bad_name(p) {
                return Err(RegionConfigError::PeerName(p.clone()));
            }
            if *p == self.region {
                return Err(RegionConfigError::ItsOwnPeer(p.clone()));
            }
            if self.peers[..i].contains(p) {
                return Err(RegionConfigError::PeerTwice(p.clone()));
            }
        }
        Ok(())
    }

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
            retry_hint_us: 200_000,
            lazy_us: 1_000_000,
            warmup_us: 1_000_000,
            hash_seed: None,
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

/// The queue of keys a region owes one peer.
pub trait KeyQueue: Default + Send {
    /// What is queued (a key, and whatever the region carries with it).
    type Key: Send;

    /// The keys queued.
    fn len(&self) -> usize;

    /// Whether no key is queued.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What the queue's bound counts (by default [`KeyQueue::len`]).
    fn size(&self) -> usize {
        self.len()
    }

    /// Queue `key` last.
    fn push_back(&mut self, key: Self::Key);

    /// The oldest key, taken out.
    fn pop_front(&mut self) -> Option<Self::Key>;
}

impl<K: Send> KeyQueue for VecDeque<K> {
    type Key = K;

    fn len(&self) -> usize {
        VecDeque::len(self)
    }

    fn push_back(&mut self, key: K) {
        VecDeque::push_back(self, key);
    }

    fn pop_front(&mut self) -> Option<K> {
        VecDeque::pop_front(self)
    }
}

/// A batch to read and send: its number, its keys, and what it carries.
#[derive(Debug)]
pub struct Plan<K> {
    /// The batch's number on its link.
    pub seq: u64,
    /// The keys to read (from a full state transfer, or the queue). The
    /// region may replace them with what it wants sent again should the
    /// batch be lost.
    pub keys: Vec<K>,
    /// The keys are a full state transfer's: send every component.
    pub full: bool,
    /// The full state transfer is complete with this batch.
    pub complete: bool,
    /// The peer's incarnation as this region knows it (0: not yet).
    pub to_incarnation: u64,
}

/// What [`Links::take`] found.
#[derive(Debug)]
pub enum Take<K> {
    /// Nothing to send now (the link is idle and no heartbeat is due, or
    /// as many batches as allowed await acknowledgement).
    Wait,
    /// Keys were dropped from a full queue and the queue has drained: list
    /// every key the region holds and give them to [`Links::start_full`]
    /// for the peer at this incarnation, then take again.
    List(u64),
    /// The next batch.
    Batch(Plan<K>),
}

/// Keys to queue again, from batches that failed or went unacknowledged
/// (a full state transfer's keys are put back in the transfer already).
#[derive(Debug)]
pub struct Requeue<K> {
    /// The keys, for the region to queue again by its own account.
    pub keys: Vec<K>,
    /// The link started failing with these (it had not since its last
    /// acknowledgement): nothing may wait for the lazy period now.
    pub started_failing: bool,
}

/// What a peer's batch told the link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Received {
    /// The peer's incarnation changed since its last batch.
    pub sender_restarted: bool,
    /// The peer is at an incarnation the link did not know: send it the
    /// full state for this incarnation ([`Links::start_full`]).
    pub restarted: Option<u64>,
}

/// What an acknowledgement did.
#[derive(Debug)]
pub struct Acked<A> {
    /// What the acknowledged batch confirms, for the region to record.
    pub confirmed: Option<A>,
    /// The peer is a new incarnation (it restarted with its state lost, or
    /// this is the first word from it): send it the full state for this
    /// incarnation ([`Links::start_full`]).
    pub restarted: Option<u64>,
    /// The link had been failing and answers again.
    pub recovered: bool,
}

struct InFlight<K, A> {
    seq: u64,
    sent_us: u64,
    keys: Vec<K>,
    /// What an acknowledgement confirms.
    acked: A,
    full: bool,
    complete: bool,
}

struct Full<K> {
    keys: VecDeque<K>,
    for_incarnation: u64,
    complete_sent: bool,
}

/// One peer's link.
pub struct Link<Q: KeyQueue, A> {
    queue: Q,
    /// Keys were dropped from a full queue: a full state transfer follows.
    overflowed: bool,
    full: Option<Full<Q::Key>>,
    known_incarnation: Option<u64>,
    seq: u64,
    in_flight: Vec<InFlight<Q::Key, A>>,
    last_sent_us: u64,
    /// The peer's incarnation in its last batch to us.
    sender_incarnation: Option<u64>,
    /// A batch to it failed since its last acknowledgement.
    failing: bool,
    /// The peer has sent this region its full state (for this region's
    /// incarnation).
    complete_from: bool,
    /// The peer acknowledged a batch of this incarnation: it has recorded
    /// it (bounded rules admit nothing until every peer has).
    recorded: bool,
    stats: LinkStats,
}

impl<Q: KeyQueue, A> Link<Q, A> {
    fn new() -> Self {
        Self {
            queue: Q::default(),
            overflowed: false,
            full: None,
            known_incarnation: None,
            seq: 0,
            in_flight: Vec::new(),
            last_sent_us: 0,
            sender_incarnation: None,
            failing: false,
            complete_from: false,
            recorded: false,
            stats: LinkStats::default(),
        }
    }

    /// The queue, for what a region does with it beyond the engine's steps.
    pub fn queue_mut(&mut self) -> &mut Q {
        &mut self.queue
    }

    /// Whether a batch to the peer failed since its last acknowledgement.
    pub fn failing(&self) -> bool {
        self.failing
    }

    /// Put a lost batch's keys back: a full state transfer's into the
    /// transfer (its end marker to be sent again), the others returned.
    fn put_back(&mut self, f: InFlight<Q::Key, A>) -> Vec<Q::Key> {
        if f.complete {
            if let Some(full) = &mut self.full {
                full.complete_sent = false;
            }
            return Vec::new();
        }
        if f.full {
            if let Some(full) = &mut self.full {
                for k in f.keys.into_iter().rev() {
                    full.keys.push_front(k);
                }
            }
            return Vec::new();
        }
        f.keys
    }

    /// Mark the link failing with `lost`; their keys to queue again.
    fn lose(&mut self, lost: Vec<InFlight<Q::Key, A>>) -> Requeue<Q::Key> {
        self.stats.failures += lost.len() as u64;
        let started_failing = !lost.is_empty() && !self.failing;
        self.failing |= !lost.is_empty();
        let mut keys = Vec::new();
        for f in lost {
            keys.extend(self.put_back(f));
        }
        Requeue { keys, started_failing }
    }
}

/// Every peer's link of one region, and whether the region still waits for
/// some peer's full state (it is *warming*).
pub struct Links<Q: KeyQueue, A> {
    links: Box<[Mutex<Link<Q, A>>]>,
    warming: Arc<AtomicBool>,
    /// Every peer has recorded this incarnation.
    recorded: Arc<AtomicBool>,
    /// Some peer has sent this region its full state.
    heard_full: AtomicBool,
    batch_items: usize,
    max_queue: usize,
    max_in_flight: usize,
    interval_us: u64,
    ack_timeout_us: u64,
}

impl<Q: KeyQueue, A> std::fmt::Debug for Links<Q, A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Links").field("peers", &self.links.len()).finish_non_exhaustive()
    }
}

impl<Q: KeyQueue, A> Links<Q, A> {
    /// A link to each of `cfg`'s peers. The region is warming until every
    /// peer has sent its full state (at once when there are none).
    pub fn new(cfg: &RegionConfig) -> Self {
        Self {
            links: cfg.peers.iter().map(|_| Mutex::new(Link::new())).collect(),
            warming: Arc::new(AtomicBool::new(!cfg.peers.is_empty())),
            recorded: Arc::new(AtomicBool::new(cfg.peers.is_empty())),
            heard_full: AtomicBool::new(cfg.peers.is_empty()),
            batch_items: cfg.batch_items.max(1),
            max_queue: cfg.max_queue,
            max_in_flight: cfg.max_in_flight.max(1),
            interval_us: cfg.interval_us,
            ack_timeout_us: cfg.ack_timeout_us,
        }
    }

    /// The number of peers.
    pub fn len(&self) -> usize {
        self.links.len()
    }

    /// Whether there are no peers.
    pub fn is_empty(&self) -> bool {
        self.links.is_empty()
    }

    /// Peer `p`'s link, locked.
    pub fn lock(&self, p: usize) -> MutexGuard<'_, Link<Q, A>> {
        self.links[p].lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the region waits for some peer's full state.
    pub fn warming(&self) -> bool {
        self.warming.load(Ordering::Acquire)
    }

    /// The warming flag itself, for a store that decides with it.
    pub fn warming_flag(&self) -> &Arc<AtomicBool> {
        &self.warming
    }

    /// Whether some peer has sent this region its full state.
    pub fn heard_full(&self) -> bool {
        self.heard_full.load(Ordering::Acquire)
    }

    /// Whether every peer has recorded this incarnation (acknowledged one
    /// of its batches): until then bounded rules admit nothing, so every
    /// incarnation that admitted is known to all before it can die.
    pub fn recorded_by_all(&self) -> bool {
        self.recorded.load(Ordering::Acquire)
    }

    /// The recorded-by-all flag itself, for a store that decides with it.
    pub fn recorded_flag(&self) -> &Arc<AtomicBool> {
        &self.recorded
    }

    /// Record whether peer `p` has recorded this incarnation (a region
    /// whose instances share it reads that from its store: another instance
    /// may have seen the acknowledgement, or the incarnation changed).
    pub fn set_recorded(&self, p: usize, recorded: bool) {
        if std::mem::replace(&mut self.lock(p).recorded, recorded) == recorded {
            return;
        }
        let all = (0..self.links.len()).all(|q| self.lock(q).recorded);
        self.recorded.store(all, Ordering::Release);
    }

    /// Whether peer `p` has recorded this incarnation.
    pub fn recorded(&self, p: usize) -> bool {
        self.lock(p).recorded
    }

    /// Queue `key` for peer `p`; `false` when the queue is full (the key
    /// is dropped and counted, and once the queue drains the peer gets a
    /// full state transfer, so nothing stays lost).
    pub fn push(&self, p: usize, key: Q::Key) -> bool {
        self.push_with(p, |_| Some(key))
    }

    /// [`Links::push`] what `make` makes of peer `p`'s queue: nothing when
    /// it folds the key into the same key queued already (a region that
    /// keeps its queued keys in the queue itself), else the key to queue.
    pub fn push_with(&self, p: usize, make: impl FnOnce(&mut Q) -> Option<Q::Key>) -> bool {
        let mut link = self.lock(p);
        let Some(key) = make(&mut link.queue) else { return true };
        if link.queue.size() >= self.max_queue {
            link.stats.dropped += 1;
            link.overflowed = true;
            return false;
        }
        link.queue.push_back(key);
        true
    }

    /// Peer `p`'s batches unacknowledged after an interval and twice the
    /// round trip (never longer than the acknowledgement timeout) at `now`:
    /// lost, their keys to queue again (harmless if they were only slow).
    pub fn expire(&self, p: usize, now: u64) -> Requeue<Q::Key> {
        let mut link = self.lock(p);
        let srtt = if link.stats.srtt_us == 0 { self.ack_timeout_us } else { link.stats.srtt_us };
        let timeout = (self.interval_us + 2 * srtt).min(self.ack_timeout_us);
        let (gone, kept): (Vec<_>, Vec<_>) =
            std::mem::take(&mut link.in_flight).into_iter().partition(|f| now.saturating_sub(f.sent_us) >= timeout);
        link.in_flight = kept;
        link.lose(gone)
    }

    /// The next batch for peer `p` at `now`: a full state transfer's keys
    /// first, then the queue's; its end marker once every key of it is
    /// acknowledged; an empty heartbeat on an idle link, and at once to a
    /// peer not heard from yet (its incarnation starts the transfer).
    pub fn take(&self, p: usize, now: u64) -> Take<Q::Key> {
        let mut link = self.lock(p);
        if link.in_flight.len() >= self.max_in_flight {
            return Take::Wait;
        }
        if link.overflowed && link.queue.is_empty() && link.full.is_none() {
            link.overflowed = false;
            return Take::List(link.known_incarnation.unwrap_or(0));
        }
        let n = self.batch_items;
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
        let first_contact = link.known_incarnation.is_none() && link.in_flight.is_empty();
        let heartbeat_due = now.saturating_sub(link.last_sent_us) >= self.interval_us;
        if keys.is_empty() && !complete && !first_contact && !heartbeat_due {
            return Take::Wait;
        }
        link.seq += 1;
        link.last_sent_us = now;
        Take::Batch(Plan { seq: link.seq, keys, full, complete, to_incarnation: link.known_incarnation.unwrap_or(0) })
    }

    /// Send peer `p` (at `incarnation`) every key in `keys`: the region's
    /// whole state. Replaces a transfer under way.
    pub fn start_full(&self, p: usize, incarnation: u64, keys: impl IntoIterator<Item = Q::Key>) {
        let mut link = self.lock(p);
        link.stats.full_syncs += 1;
        link.full = Some(Full { keys: keys.into_iter().collect(), for_incarnation: incarnation, complete_sent: false });
    }

    /// The region could not list its keys for a full state transfer to
    /// peer `p`: ask again once the queue has drained.
    pub fn list_failed(&self, p: usize) {
        self.lock(p).overflowed = true;
    }

    /// Batch `plan` of `items` keys went to peer `p` at `now`; `acked` is
    /// what its acknowledgement will confirm.
    pub fn sent(&self, p: usize, plan: Plan<Q::Key>, acked: A, items: u64, now: u64) {
        let mut link = self.lock(p);
        link.stats.batches_sent += 1;
        link.stats.items_sent += items;
        let Plan { seq, keys, full, complete, .. } = plan;
        link.in_flight.push(InFlight { seq, sent_us: now, keys, acked, full, complete });
    }

    /// Batch `plan` could not be read (the region's storage failed): its
    /// keys go out later, the others' returned to queue again.
    pub fn abort(&self, p: usize, plan: Plan<Q::Key>, acked: A) -> Vec<Q::Key> {
        let Plan { seq, keys, full, complete, .. } = plan;
        self.lock(p).put_back(InFlight { seq, sent_us: 0, keys, acked, full, complete })
    }

    /// Peer `p` acknowledged a batch at `now`; `incarnation` is this
    /// region's. An acknowledgement of a batch an earlier incarnation of
    /// this region sent confirms nothing.
    pub fn on_ack(&self, p: usize, ack: &Ack, now: u64, incarnation: u64) -> Acked<A> {
        if ack.for_incarnation != 0 && ack.for_incarnation != incarnation {
            return Acked { confirmed: None, restarted: None, recovered: false };
        }
        let acked = self.ack(p, ack, now);
        self.set_recorded(p, true);
        acked
    }

    fn ack(&self, p: usize, ack: &Ack, now: u64) -> Acked<A> {
        let mut link = self.lock(p);
        link.stats.last_ack_us = now;
        let recovered = std::mem::take(&mut link.failing);
        let restarted = (link.known_incarnation != Some(ack.incarnation)).then_some(ack.incarnation);
        link.known_incarnation = Some(ack.incarnation);
        let confirmed = match link.in_flight.iter().position(|f| f.seq == ack.seq) {
            Some(i) => {
                let f = link.in_flight.swap_remove(i);
                link.stats.acks += 1;
                let rtt = now.saturating_sub(f.sent_us);
                link.stats.rtt_us = rtt;
                link.stats.srtt_us = if link.stats.srtt_us == 0 { rtt } else { (7 * link.stats.srtt_us + rtt) / 8 };
                if f.complete && link.full.as_ref().is_some_and(|full| full.for_incarnation == ack.incarnation) {
                    link.full = None;
                }
                Some(f.acked)
            }
            None => None,
        };
        Acked { confirmed, restarted, recovered }
    }

    /// The transport could not deliver batch `seq` to peer `p`: its keys
    /// to queue again.
    pub fn on_failure(&self, p: usize, seq: u64) -> Requeue<Q::Key> {
        let mut link = self.lock(p);
        let lost = match link.in_flight.iter().position(|f| f.seq == seq) {
            Some(i) => vec![link.in_flight.swap_remove(i)],
            None => Vec::new(),
        };
        link.lose(lost)
    }

    /// A batch of `items` keys from peer `p` (at `incarnation`) arrived at
    /// `now`.
    pub fn received(&self, p: usize, incarnation: u64, items: usize, now: u64) -> Received {
        let mut link = self.lock(p);
        let sender_restarted = link.sender_incarnation.is_some_and(|inc| inc != incarnation);
        link.sender_incarnation = Some(incarnation);
        link.stats.batches_received += 1;
        link.stats.items_received += items as u64;
        link.stats.last_received_us = now;
        // A peer heard from at an incarnation this link did not know (it
        // restarted, or this is the first word from it) gets the full state
        // at once, not only after its next acknowledgement.
        let new = link.known_incarnation != Some(incarnation);
        link.known_incarnation = Some(incarnation);
        Received { sender_restarted, restarted: new.then_some(incarnation) }
    }

    /// Forget every link's state but whether each peer has sent the
    /// region its full state and has recorded its incarnation: what an
    /// instance of a region whose state
    /// outlives it (a Redis region's) loses when it dies. Its queues, its
    /// batches in flight and what it knew of its peers are gone; each peer
    /// is then a first contact again (and gets the full state). Returns
    /// how many links were failing.
    pub fn forget(&self) -> usize {
        let mut failing = 0;
        for p in 0..self.links.len() {
            let mut link = self.lock(p);
            let (complete, recorded) = (link.complete_from, link.recorded);
            failing += usize::from(link.failing);
            *link = Link::new();
            link.complete_from = complete;
            link.recorded = recorded;
        }
        failing
    }

    /// Whether peer `p` has sent this region its full state.
    pub fn complete(&self, p: usize) -> bool {
        self.lock(p).complete_from
    }

    /// Record whether peer `p` has sent this region its full state (for
    /// this region's incarnation); the region is warming while any has
    /// not.
    pub fn set_complete(&self, p: usize, complete: bool) {
        if std::mem::replace(&mut self.lock(p).complete_from, complete) == complete {
            return;
        }
        if complete {
            self.heard_full.store(true, Ordering::Release);
        }
        let warming = (0..self.links.len()).any(|q| !self.lock(q).complete_from);
        self.warming.store(warming, Ordering::Release);
    }

    /// The counters of the link to peer `p`.
    pub fn stats(&self, p: usize) -> LinkStats {
        let link = self.lock(p);
        let mut s = link.stats;
        s.queued = link.queue.len() as u64 + link.full.as_ref().map_or(0, |f| f.keys.len() as u64);
        s.in_flight = link.in_flight.len() as u64;
        s.incarnation = link.known_incarnation.unwrap_or(0);
        s.complete = link.complete_from;
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type L = Links<VecDeque<&'static str>, Vec<&'static str>>;

    fn links(peers: usize) -> L {
        let mut cfg = RegionConfig::new("a", (0..peers).map(|i| format!("p{i}")).collect(), 1);
        cfg.batch_items = 2;
        cfg.max_queue = 3;
        cfg.max_in_flight = 2;
        Links::new(&cfg)
    }

    fn batch(t: Take<&'static str>) -> Plan<&'static str> {
        match t {
            Take::Batch(p) => p,
            other => panic!("expected a batch, got {other:?}"),
        }
    }

    fn ack(seq: u64, incarnation: u64) -> Ack {
        Ack { region: "p0".into(), incarnation, seq, for_incarnation: 0 }
    }

    #[test]
    fn first_contact_goes_at_once_then_the_peers_incarnation_starts_a_full_transfer() {
        let l = links(1);
        let hello = batch(l.take(0, 10));
        assert_eq!((hello.seq, hello.keys.len(), hello.to_incarnation), (1, 0, 0));
        l.sent(0, hello, vec![], 0, 10);
        assert!(matches!(l.take(0, 20), Take::Wait), "one first contact in flight is enough");
        let a = l.on_ack(0, &ack(1, 7), 30, 0);
        assert_eq!((a.confirmed, a.restarted, a.recovered), (Some(vec![]), Some(7), false));
        l.start_full(0, 7, ["x", "y", "z"]);
        l.push(0, "q");
        let b = batch(l.take(0, 40));
        assert_eq!((b.keys.as_slice(), b.full, b.complete, b.to_incarnation), (&["x", "y"][..], true, false, 7));
        l.sent(0, b, vec![], 2, 40);
        let c = batch(l.take(0, 40));
        assert_eq!((c.keys.as_slice(), c.full), (&["z"][..], true), "the transfer goes before the queue");
        l.sent(0, c, vec![], 1, 40);
        assert!(matches!(l.take(0, 40), Take::Wait), "two in flight at most");
        assert!(l.on_ack(0, &ack(2, 7), 50, 0).restarted.is_none());
        let d = batch(l.take(0, 50));
        assert_eq!((d.keys.as_slice(), d.full, d.complete), (&["q"][..], false, false), "no end marker while keys fly");
        l.sent(0, d, vec![], 1, 50);
        l.on_ack(0, &ack(3, 7), 60, 0);
        l.on_ack(0, &ack(4, 7), 60, 0);
        let e = batch(l.take(0, 70));
        assert!(e.complete && e.keys.is_empty(), "{e:?}");
        l.sent(0, e, vec![], 0, 70);
        assert_eq!(l.stats(0).queued, 0);
        l.on_ack(0, &ack(5, 7), 80, 0);
        assert!(l.lock(0).full.is_none(), "the transfer is done once its end is acknowledged");
        assert!(matches!(l.take(0, 90), Take::Wait));
        assert!(matches!(l.take(0, 70 + 99_999), Take::Wait));
        assert!(matches!(l.take(0, 70 + 100_000), Take::Batch(_)), "a heartbeat every interval");
    }

    #[test]
    fn an_unacknowledged_batch_expires_after_an_interval_and_two_round_trips() {
        let l = links(1);
        l.sent(0, batch(l.take(0, 0)), vec![], 0, 0);
        l.on_ack(0, &ack(1, 7), 1_000, 0);
        assert_eq!(l.stats(0).srtt_us, 1_000);
        l.push(0, "k");
        let b = batch(l.take(0, 10_000));
        l.sent(0, b, vec!["k"], 1, 10_000);
        // interval 100 ms + 2 × 1 ms.
        let r = l.expire(0, 10_000 + 101_999);
        assert!(r.keys.is_empty() && !r.started_failing);
        let r = l.expire(0, 10_000 + 102_000);
        assert_eq!((r.keys, r.started_failing), (vec!["k"], true));
        assert!(!l.expire(0, 500_000).started_failing);
        let a = l.on_ack(0, &ack(2, 7), 500_000, 0);
        assert!(a.confirmed.is_none(), "an expired batch's late acknowledgement confirms nothing");
        assert!(a.recovered);
        assert_eq!(l.stats(0).failures, 1);
    }

    #[test]
    fn a_lost_transfer_batch_goes_back_in_order_and_its_end_marker_again() {
        let l = links(1);
        l.start_full(0, 7, ["x", "y", "z"]);
        let b = batch(l.take(0, 0));
        let seq = b.seq;
        l.sent(0, b, vec![], 2, 0);
        let r = l.on_failure(0, seq);
        assert!(r.keys.is_empty() && r.started_failing);
        assert_eq!(batch(l.take(0, 1)).keys, ["x", "y"]);
        let l = links(1);
        l.start_full(0, 7, std::iter::empty());
        let end = batch(l.take(0, 0));
        assert!(end.complete);
        assert!(l.abort(0, end, vec![]).is_empty());
        assert!(batch(l.take(0, 1)).complete, "the end marker goes again");
    }

    #[test]
    fn a_full_queue_drops_and_then_sends_everything() {
        let l = links(1);
        assert!(l.push(0, "a") && l.push(0, "b") && l.push(0, "c"));
        assert!(!l.push(0, "d"));
        assert_eq!(l.stats(0).dropped, 1);
        l.sent(0, batch(l.take(0, 0)), vec![], 2, 0);
        l.sent(0, batch(l.take(0, 0)), vec![], 1, 0);
        l.on_ack(0, &ack(1, 7), 1, 0);
        l.on_ack(0, &ack(2, 7), 1, 0);
        let l2 = &l;
        l2.lock(0).full = None;
        match l.take(0, 2) {
            Take::List(inc) => assert_eq!(inc, 7),
            other => panic!("{other:?}"),
        }
        l.list_failed(0);
        assert!(matches!(l.take(0, 3), Take::List(7)), "asked again after a failed listing");
        l.start_full(0, 7, ["a", "b", "c", "d"]);
        assert!(batch(l.take(0, 4)).full);
    }

    #[test]
    fn an_earlier_incarnations_acknowledgement_confirms_and_records_nothing() {
        let l = links(1);
        l.push(0, "k");
        l.sent(0, batch(l.take(0, 0)), vec!["k"], 1, 0);
        assert!(!l.recorded_by_all());
        let stale = Ack { region: "p0".into(), incarnation: 7, seq: 1, for_incarnation: 41 };
        let a = l.on_ack(0, &stale, 10, 42);
        assert!(a.confirmed.is_none() && a.restarted.is_none());
        assert!(!l.recorded_by_all(), "the peer has not recorded incarnation 42");
        let a = l.on_ack(0, &Ack { for_incarnation: 42, ..stale }, 10, 42);
        assert_eq!(a.confirmed, Some(vec!["k"]));
        assert!(l.recorded_by_all());
    }

    #[test]
    fn warming_ends_when_every_peer_has_sent_its_state() {
        let l = links(2);
        assert!(l.warming());
        l.set_complete(0, true);
        assert!(l.warming());
        l.set_complete(1, true);
        assert!(!l.warming());
        l.set_complete(1, false);
        assert!(l.warming());
        assert!(!links(0).warming());
        let r = l.received(0, 5, 3, 9);
        assert!(!r.sender_restarted);
        assert_eq!(r.restarted, Some(5), "first word from the peer: it gets the full state");
        let r = l.received(0, 6, 0, 10);
        assert!(r.sender_restarted, "a new incarnation in the sender's batch");
        assert_eq!(r.restarted, Some(6));
        assert_eq!(l.received(0, 6, 0, 11).restarted, None);
        assert!(l.on_ack(0, &ack(1, 6), 12, 0).restarted.is_none(), "known already from its batch");
        let s = l.stats(0);
        assert_eq!((s.batches_received, s.items_received, s.last_received_us), (3, 3, 11));
    }
}
