//! A Redis region: every instance on one Redis (one server) is one region.
//! The global limits' state is in Redis ([`floodgate_redis::region`]:
//! decisions, merges, reads, acknowledgements, all in the one script); this
//! is each instance's side of the sync: the keys it touched, queued per
//! peer, batches read back from Redis, acknowledgements written to it. Every
//! instance of the region pushes what it touched and receives what peers
//! send (any instance may take a peer's batch: all write the same Redis), so
//! a key several instances touched goes out several times; the maximum at
//! the receiver makes that harmless.
//!
//! The region's incarnation and the peers' `complete` flags live in Redis
//! (`<prefix>region:<name>`): a Redis that restarts empty is a new
//! incarnation, seen by every instance within a sync interval.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use floodgate_core::region::{Ack, Batch, Item, Lazy, LinkStats, Receipt, SyncMode, TableStats, can_wait, fingerprint};
use floodgate_core::{Clock, Limit, SystemClock};
use floodgate_redis::{RedisStore, RegionCtx};

/// The maps of keys (client-chosen): foldhash, randomly seeded against hash
/// flooding, as the memory store's and the memory region's tables.
type KeyMap<V> = HashMap<String, V, foldhash::fast::RandomState>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Keys per batch.
const BATCH_ITEMS: usize = 100;
/// Batches awaiting acknowledgement per peer.
const MAX_IN_FLIGHT: usize = 8;
/// Keys queued per peer at most (then dropped, counted, and healed by a
/// full state transfer).
const MAX_QUEUE: usize = 1 << 20;
/// Items read for another peer's batch that a peer takes as its own, at
/// most (beyond, it reads its keys itself).
const MAX_SHARED: usize = 4 * BATCH_ITEMS;
/// Each `SCAN` call of a full state transfer's listing, at most.
const SCAN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);
/// Rules remembered by fingerprint, at most (then forgotten all at once:
/// only a hot reload makes new ones). A key whose rule is forgotten before
/// its read is read by the rule recorded in Redis; a window key with none
/// recorded yet is then not sent until its next admitted hit queues it
/// again.
const MAX_RULES: usize = 65_536;

/// What a queued key carries.
#[derive(Debug, Clone, Copy, Default)]
struct Tag {
    /// Whether its rule is bounded (its acknowledgements matter).
    bounded: bool,
    /// Its rule's fingerprint (in [`RedisRegion::rules`]; 0: not known
    /// here, as for a full state's keys). The read records the rule on the
    /// key's global state, where a window algorithm's decision leaves it.
    rule: u64,
}

impl Tag {
    /// A key queued again: bounded if either was, the newer rule.
    fn join(&mut self, newer: Tag) {
        self.bounded |= newer.bounded;
        if newer.rule != 0 {
            self.rule = newer.rule;
        }
    }
}

struct InFlight {
    seq: u64,
    sent_us: u64,
    /// The keys sent, each with its tag.
    keys: Vec<(String, Tag)>,
    acked: Vec<(String, Vec<(u64, u64)>)>,
    full: bool,
    complete: bool,
}

struct Full {
    keys: VecDeque<String>,
    for_incarnation: u64,
    complete_sent: bool,
}

#[derive(Default)]
struct Link {
    /// Keys to send, oldest first; one not in `queued` (taken since by
    /// another peer's read, see `shared`) is skipped.
    queue: VecDeque<String>,
    /// The keys in `queue`, each with its tag.
    queued: KeyMap<Tag>,
    /// Items another peer's batch read from Redis after this peer's queue
    /// had their keys: as new as a read of its own would be, so they go
    /// out without one (every peer's queue has about the same keys, and
    /// reading is what a Redis region's sync costs).
    shared: VecDeque<(Item, Tag)>,
    overflowed: bool,
    full: Option<Full>,
    known_incarnation: Option<u64>,
    in_flight: Vec<InFlight>,
    last_sent_us: u64,
    sender_incarnation: Option<u64>,
    failing: bool,
    stats: LinkStats,
}

/// An instance's side of a Redis region's sync.
pub struct RedisRegion {
    name: String,
    peers: Vec<String>,
    store: RedisStore,
    /// The region's incarnation, from Redis (0 until read).
    incarnation: AtomicU64,
    warming: Arc<AtomicBool>,
    /// Per peer: whether its full state for this incarnation is in Redis.
    complete: Box<[AtomicBool]>,
    links: Box<[Mutex<Link>]>,
    seq: AtomicU64,
    /// Per key of an eventual limit waiting in `lazy`: own hits not yet
    /// queued, and its rule's fingerprint.
    pending: Mutex<KeyMap<(u64, u64)>>,
    /// The rules of the keys queued, by fingerprint (few: one per rule).
    rules: Mutex<HashMap<u64, Arc<(Limit, SyncMode)>>>,
    /// The fingerprint last put in `rules` (most decisions need no lock).
    last_rule: AtomicU64,
    /// Keys waiting to be queued, and failing links.
    lazy: Lazy<String>,
    interval_us: u64,
    ack_timeout_us: u64,
    last_state_us: AtomicU64,
    /// What this instance's merges did (`keys` stays 0: they are in Redis).
    merges: Mutex<TableStats>,
    /// Whether the last listing of the keys failed (logged once a streak).
    listing_failed: AtomicBool,
    clock: SystemClock,
}

impl std::fmt::Debug for RedisRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisRegion").field("name", &self.name).field("peers", &self.peers).finish_non_exhaustive()
    }
}

impl RedisRegion {
    /// This instance's side of region `name` with `peers`, over `store`
    /// (made a region's store here); a key far below its limit waits up to
    /// `lazy_us` before it is sent.
    pub fn new(
        name: String,
        peers: Vec<String>,
        store: RedisStore,
        interval_us: u64,
        retry_us: u64,
        lazy_us: u64,
    ) -> Self {
        let warming = Arc::new(AtomicBool::new(!peers.is_empty()));
        store.set_region(RegionCtx { regions: peers.len() + 1, warming: warming.clone(), retry_us });
        Self {
            links: peers.iter().map(|_| Mutex::new(Link::default())).collect(),
            complete: peers.iter().map(|_| AtomicBool::new(false)).collect(),
            name,
            peers,
            store,
            incarnation: AtomicU64::new(0),
            warming,
            seq: AtomicU64::new(0),
            pending: Mutex::new(KeyMap::default()),
            rules: Mutex::new(HashMap::new()),
            last_rule: AtomicU64::new(0),
            lazy: Lazy::new(lazy_us),
            interval_us,
            ack_timeout_us: 2_000_000,
            last_state_us: AtomicU64::new(0),
            merges: Mutex::new(TableStats::default()),
            listing_failed: AtomicBool::new(false),
            clock: SystemClock::new(),
        }
    }

    fn state_key(&self) -> String {
        format!("{}region:{}", self.store.config().key_prefix, self.name)
    }

    /// Read (or make) the region's incarnation and the peers' `complete`
    /// flags from Redis; at most once per interval.
    async fn refresh(&self, now: u64) {
        let last = self.last_state_us.load(Ordering::Relaxed);
        if last != 0 && now.saturating_sub(last) < self.interval_us {
            return;
        }
        self.last_state_us.store(now, Ordering::Relaxed);
        let fresh = now ^ std::hash::BuildHasher::hash_one(&std::hash::RandomState::new(), now) | 1;
        let key = self.state_key();
        let mut set = redis::cmd("HSETNX");
        set.arg(&key).arg("inc").arg(fresh.to_string());
        if self.store.raw(&set).await.is_err() {
            return;
        }
        let mut get = redis::cmd("HGETALL");
        get.arg(&key);
        let Ok(v) = self.store.raw(&get).await else { return };
        let map: HashMap<String, String> = redis::FromRedisValue::from_redis_value(v).unwrap_or_default();
        let inc: u64 = map.get("inc").and_then(|v| v.parse().ok()).unwrap_or(0);
        let old = self.incarnation.swap(inc, Ordering::AcqRel);
        if old != 0 && old != inc {
            tracing::warn!(region = %self.name, "Redis lost the region's state (a new incarnation): waiting for every peer's full state");
        }
        let mut warming = false;
        for (p, done) in self.peers.iter().zip(self.complete.iter()) {
            let c = map.get(&format!("c:{p}")).and_then(|v| v.parse::<u64>().ok()) == Some(inc);
            done.store(c, Ordering::Release);
            warming |= !c;
        }
        self.warming.store(warming, Ordering::Release);
    }

    /// After a global decision under `limit` admitted `hits` of `key`
    /// (`remaining` left, as this region sees it): queue it for the peers
    /// now, or within the lazy period when those hits cannot matter before
    /// (see `floodgate_core::region`).
    pub fn touched(&self, key: &str, limit: &Limit, mode: SyncMode, hits: u64, remaining: u64) {
        let rule = self.rule(limit, mode);
        let bounded = matches!(mode, SyncMode::Bounded { .. });
        if bounded || self.warming.load(Ordering::Acquire) || self.lazy.eager() {
            lock(&self.pending).remove(key);
            self.queue(key, Tag { bounded, rule });
            return;
        }
        let mut pending = lock(&self.pending);
        let (unsent, new) = match pending.get_mut(key) {
            Some(e) => {
                *e = (e.0.saturating_add(hits), rule);
                (e.0, false)
            }
            None => {
                pending.insert(key.to_owned(), (hits, rule));
                (hits, true)
            }
        };
        if !can_wait(unsent, remaining, self.peers.len() + 1) {
            pending.remove(key);
            drop(pending);
            self.queue(key, Tag { bounded: false, rule });
        } else if new {
            drop(pending);
            self.lazy.wait(self.clock.now_us(), key.to_owned());
        }
    }

    /// The fingerprint of `limit` under `mode`, its rule remembered.
    fn rule(&self, limit: &Limit, mode: SyncMode) -> u64 {
        let fp = fingerprint(limit, mode);
        if self.last_rule.load(Ordering::Relaxed) != fp {
            let mut rules = lock(&self.rules);
            if !rules.contains_key(&fp) {
                if rules.len() >= MAX_RULES {
                    rules.clear();
                }
                rules.insert(fp, Arc::new((limit.clone(), mode)));
            }
            self.last_rule.store(fp, Ordering::Relaxed);
        }
        fp
    }

    fn queue(&self, key: &str, tag: Tag) {
        for link in self.links.iter() {
            let mut l = lock(link);
            if let Some(t) = l.queued.get_mut(key) {
                t.join(tag);
                continue;
            }
            if l.queue.len() >= MAX_QUEUE {
                l.stats.dropped += 1;
                l.overflowed = true;
                continue;
            }
            l.queued.insert(key.to_owned(), tag);
            l.queue.push_back(key.to_owned());
        }
    }

    /// Queue `keys` from the lazy list, those still waiting.
    fn queue_lazy(&self, keys: Vec<String>) {
        for k in keys {
            // Gone when an urgent touch has queued it since.
            let waiting = lock(&self.pending).remove(&k);
            if let Some((_, rule)) = waiting {
                self.queue(&k, Tag { bounded: false, rule });
            }
        }
    }

    /// Every key of the region's global limits in Redis (for a full state
    /// transfer): their `:g:m` keys, from every primary of a cluster.
    /// `None` while Redis fails (the transfer is started again later).
    async fn all_keys(&self) -> Option<Vec<String>> {
        let prefix = &self.store.config().key_prefix;
        let pattern = format!("{prefix}*:g:m");
        let found = match self.store.scan(&pattern, SCAN_TIMEOUT).await {
            Ok(found) => {
                self.listing_failed.store(false, Ordering::Relaxed);
                found
            }
            Err(e) => {
                if !self.listing_failed.swap(true, Ordering::Relaxed) {
                    tracing::warn!(region = %self.name, error = %e, "cannot list the region's global keys in Redis for a peer's full state; trying again every interval");
                }
                return None;
            }
        };
        let keys = found
            .into_iter()
            .filter_map(|k| {
                // <prefix>{tag}rest:g:m -> tag + rest
                let body = k.strip_prefix(prefix.as_str())?.strip_suffix(":g:m")?;
                let open = body.strip_prefix('{')?;
                let close = open.find('}')?;
                Some(format!("{}{}", &open[..close], &open[close + 1..]))
            })
            .collect();
        Some(keys)
    }

    /// Start a full state transfer to peer `p` (incarnation `incarnation`),
    /// or when Redis cannot list the keys now, on a later batch.
    async fn full_state(&self, p: usize, incarnation: u64) {
        match self.all_keys().await {
            Some(keys) => self.start_full(p, incarnation, keys),
            None => lock(&self.links[p]).overflowed = true,
        }
    }

    fn start_full(&self, p: usize, incarnation: u64, keys: Vec<String>) {
        let mut l = lock(&self.links[p]);
        l.stats.full_syncs += 1;
        l.full = Some(Full { keys: keys.into(), for_incarnation: incarnation, complete_sent: false });
    }

    fn link_failing(&self, started: bool) {
        self.queue_lazy(self.lazy.link_failing(started));
    }

    fn requeue(&self, p: usize, f: InFlight) {
        let mut l = lock(&self.links[p]);
        if f.complete {
            if let Some(full) = &mut l.full {
                full.complete_sent = false;
            }
            return;
        }
        if f.full {
            if let Some(full) = &mut l.full {
                for (k, _) in f.keys.into_iter().rev() {
                    full.keys.push_front(k);
                }
            }
            return;
        }
        for (k, tag) in f.keys {
            match l.queued.get_mut(&k) {
                Some(t) => t.join(tag),
                None => {
                    l.queued.insert(k.clone(), tag);
                    l.queue.push_back(k);
                }
            }
        }
    }

    /// Take `keys` out of every other peer's queue that has them (a peer
    /// that is failing, or holds enough shared items already, reads its
    /// own): per peer, the keys taken and their tags there.
    fn take_for_others(&self, p: usize, keys: &[(String, Tag)]) -> Vec<(usize, Vec<(String, Tag)>)> {
        let mut taken = Vec::new();
        for (q, link) in self.links.iter().enumerate() {
            if q == p {
                continue;
            }
            let mut l = lock(link);
            if l.failing || l.shared.len() >= MAX_SHARED || l.queued.is_empty() {
                continue;
            }
            let ks: Vec<(String, Tag)> =
                keys.iter().filter_map(|(k, _)| l.queued.remove(k).map(|b| (k.clone(), b))).collect();
            if !ks.is_empty() {
                taken.push((q, ks));
            }
        }
        taken
    }

    /// The counters of the link to peer `p`.
    pub fn link_stats(&self, p: usize) -> LinkStats {
        let l = lock(&self.links[p]);
        let mut s = l.stats;
        s.queued = (l.queued.len() + l.shared.len()) as u64 + l.full.as_ref().map_or(0, |f| f.keys.len() as u64);
        s.in_flight = l.in_flight.len() as u64;
        s.incarnation = l.known_incarnation.unwrap_or(0);
        s.complete = self.complete[p].load(Ordering::Acquire);
        s
    }

    /// What this instance's merges of peers' batches did.
    pub fn stats(&self) -> TableStats {
        *lock(&self.merges)
    }

    /// Whether the region waits for a peer's full state.
    pub fn warming(&self) -> bool {
        self.warming.load(Ordering::Acquire)
    }

    /// The region's incarnation (0 until read from Redis).
    pub fn incarnation(&self) -> u64 {
        self.incarnation.load(Ordering::Acquire)
    }

    /// The peers, in link order.
    pub fn peer_names(&self) -> &[String] {
        &self.peers
    }
}

impl floodgate_sync::Region for RedisRegion {
    fn name(&self) -> &str {
        &self.name
    }

    fn peers(&self) -> &[String] {
        &self.peers
    }

    async fn next_batch(&self, p: usize, now: u64) -> Option<Batch> {
        self.refresh(now).await;
        self.queue_lazy(self.lazy.due(now));
        let incarnation = self.incarnation();
        if incarnation == 0 {
            return None;
        }
        // Expired batches go out again.
        let (expired, started) = {
            let mut l = lock(&self.links[p]);
            let srtt = if l.stats.srtt_us == 0 { self.ack_timeout_us } else { l.stats.srtt_us };
            let timeout = (self.interval_us + 2 * srtt).min(self.ack_timeout_us);
            let (gone, kept): (Vec<InFlight>, Vec<InFlight>) =
                std::mem::take(&mut l.in_flight).into_iter().partition(|f| now.saturating_sub(f.sent_us) >= timeout);
            l.in_flight = kept;
            l.stats.failures += gone.len() as u64;
            let started = !gone.is_empty() && !l.failing;
            l.failing |= !gone.is_empty();
            (gone, started)
        };
        if started {
            self.link_failing(true);
        }
        for f in expired {
            self.requeue(p, f);
        }
        let overflowed = std::mem::take(&mut lock(&self.links[p]).overflowed);
        if overflowed {
            let inc = lock(&self.links[p]).known_incarnation.unwrap_or(0);
            self.full_state(p, inc).await;
        }
        let (keys, shared, full, complete, to_incarnation) = {
            let mut l = lock(&self.links[p]);
            if l.in_flight.len() >= MAX_IN_FLIGHT {
                return None;
            }
            let full_in_flight = l.in_flight.iter().any(|f| f.full || f.complete);
            let mut keys = Vec::new();
            let mut full = false;
            let mut complete = false;
            if let Some(f) = &mut l.full {
                while keys.len() < BATCH_ITEMS {
                    match f.keys.pop_front() {
                        Some(k) => keys.push((k, Tag::default())),
                        None => break,
                    }
                }
                full = !keys.is_empty();
                if keys.is_empty() && !full_in_flight && !f.complete_sent {
                    f.complete_sent = true;
                    complete = true;
                }
            }
            let mut shared = Vec::new();
            if !full {
                while shared.len() < BATCH_ITEMS {
                    match l.shared.pop_front() {
                        Some(item) => shared.push(item),
                        None => break,
                    }
                }
                while keys.len() + shared.len() < BATCH_ITEMS {
                    match l.queue.pop_front() {
                        Some(k) => {
                            if let Some(tag) = l.queued.remove(&k) {
                                keys.push((k, tag));
                            }
                        }
                        None => break,
                    }
                }
            }
            let first_contact = l.known_incarnation.is_none() && l.in_flight.is_empty();
            let heartbeat = now.saturating_sub(l.last_sent_us) >= 1_000_000;
            if keys.is_empty() && shared.is_empty() && !complete && !first_contact && !heartbeat {
                return None;
            }
            l.last_sent_us = now;
            (keys, shared, full, complete, l.known_incarnation.unwrap_or(0))
        };
        // The other peers whose queues have these keys take them out now,
        // before the read: what this read returns is then new enough for
        // them, and a hit after it queues the key again.
        let taken = if full { Vec::new() } else { self.take_for_others(p, &keys) };
        let mut regions = vec![self.name.clone()];
        let names: Vec<String> = keys.iter().map(|(k, _)| k.clone()).collect();
        let read = if names.is_empty() {
            Ok(Vec::new())
        } else {
            let known: Vec<Option<Arc<(Limit, SyncMode)>>> = {
                let rules = lock(&self.rules);
                keys.iter().map(|(_, t)| rules.get(&t.rule).cloned()).collect()
            };
            let rules: Vec<Option<(&Limit, SyncMode)>> =
                known.iter().map(|r| r.as_deref().map(|(l, m)| (l, *m))).collect();
            self.store.read_global(&names, &rules, full, incarnation, &mut regions, None).await
        };
        let Ok(read) = read else {
            // Redis failing: the keys go out again later, to every peer.
            let mut keys = keys;
            keys.extend(shared.into_iter().map(|(item, b)| (item.key, b)));
            let f = InFlight { seq: 0, sent_us: now, keys, acked: Vec::new(), full, complete };
            self.requeue(p, f);
            for (q, ks) in taken {
                let f = InFlight { seq: 0, sent_us: now, keys: ks, acked: Vec::new(), full: false, complete: false };
                self.requeue(q, f);
            }
            return None;
        };
        if !taken.is_empty() {
            let at: HashMap<&str, usize> = keys.iter().enumerate().map(|(i, (k, _))| (k.as_str(), i)).collect();
            for (q, ks) in taken {
                let mut l = lock(&self.links[q]);
                for (k, b) in ks {
                    if let Some(item) = at.get(k.as_str()).and_then(|&i| read[i].as_ref()) {
                        l.shared.push_back((item.clone(), b));
                    }
                }
            }
        }
        let mut keys = keys;
        let mut items: Vec<Item> = read.into_iter().flatten().collect();
        for (item, b) in shared {
            keys.push((item.key.clone(), b));
            items.push(item);
        }
        let bounded: HashSet<&str> = keys.iter().filter(|(_, t)| t.bounded).map(|(k, _)| k.as_str()).collect();
        // What a bounded key's acknowledgement will confirm: this region's
        // own counts as sent.
        let acked: Vec<(String, Vec<(u64, u64)>)> = items
            .iter()
            .filter(|item| bounded.contains(item.key.as_str()))
            .map(|item| {
                let own = item.components.iter().filter(|c| c.region == 0).map(|c| (c.slot, c.count)).collect();
                (item.key.clone(), own)
            })
            .collect();
        let seq = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
        let mut l = lock(&self.links[p]);
        l.stats.batches_sent += 1;
        l.stats.items_sent += items.len() as u64;
        l.in_flight.push(InFlight { seq, sent_us: now, keys, acked, full, complete });
        Some(Batch {
            from: self.name.clone(),
            regions,
            from_incarnation: incarnation,
            to_incarnation,
            seq,
            items,
            complete,
        })
    }

    async fn on_ack(&self, p: usize, ack: &Ack, now: u64) {
        let (done, restart, recovered) = {
            let mut l = lock(&self.links[p]);
            l.stats.last_ack_us = now;
            let recovered = std::mem::take(&mut l.failing);
            let restart = l.known_incarnation != Some(ack.incarnation);
            l.known_incarnation = Some(ack.incarnation);
            let done = l.in_flight.iter().position(|f| f.seq == ack.seq).map(|i| {
                let f = l.in_flight.swap_remove(i);
                l.stats.acks += 1;
                let rtt = now.saturating_sub(f.sent_us);
                l.stats.rtt_us = rtt;
                l.stats.srtt_us = if l.stats.srtt_us == 0 { rtt } else { (7 * l.stats.srtt_us + rtt) / 8 };
                if f.complete && l.full.as_ref().is_some_and(|full| full.for_incarnation == ack.incarnation) {
                    l.full = None;
                }
                f
            });
            (done, restart, recovered)
        };
        if recovered {
            self.link_failing(false);
        }
        if let Some(f) = done
            && !f.acked.is_empty()
        {
            let _ = self.store.ack_global(p, &f.acked, None).await;
        }
        if restart {
            self.full_state(p, ack.incarnation).await;
        }
    }

    fn on_failure(&self, p: usize, seq: u64) {
        let f = {
            let mut l = lock(&self.links[p]);
            let Some(i) = l.in_flight.iter().position(|f| f.seq == seq) else { return };
            l.stats.failures += 1;
            let started = !std::mem::replace(&mut l.failing, true);
            (l.in_flight.swap_remove(i), started)
        };
        if f.1 {
            self.link_failing(true);
        }
        self.requeue(p, f.0);
    }

    async fn receive(&self, batch: Batch, now: u64) -> Result<Receipt, String> {
        self.refresh(now).await;
        let incarnation = self.incarnation();
        if incarnation == 0 {
            return Err("this region's Redis is not answering".into());
        }
        let stats = self.store.merge(&batch, &self.name, incarnation, None).await.map_err(|e| e.to_string())?;
        {
            let mut t = lock(&self.merges);
            t.merges += stats.merged;
            t.unchanged += stats.unchanged;
            t.stale += stats.stale;
            t.fingerprint_mismatches += stats.mismatched;
            t.unknown_senders += u64::from(!self.peers.contains(&batch.from));
        }
        let mut receipt =
            Receipt { ack: Ack { region: self.name.clone(), incarnation, seq: batch.seq }, ..Receipt::default() };
        match self.peers.iter().position(|p| *p == batch.from) {
            Some(p) => {
                let mut l = lock(&self.links[p]);
                receipt.sender_restarted = l.sender_incarnation.is_some_and(|i| i != batch.from_incarnation);
                l.sender_incarnation = Some(batch.from_incarnation);
                l.stats.batches_received += 1;
                l.stats.items_received += batch.items.len() as u64;
                l.stats.last_received_us = now;
            }
            None => receipt.unknown_sender = true,
        }
        if stats.mismatched > 0 {
            receipt.mismatch = batch.items.first().map(|i| (i.key.clone(), stats.mismatched));
        }
        if batch.complete && batch.to_incarnation == incarnation {
            // Region-wide: every instance reads it back on its next refresh.
            let mut set = redis::cmd("HSET");
            set.arg(self.state_key()).arg(format!("c:{}", batch.from)).arg(incarnation.to_string());
            self.store.raw(&set).await.map_err(|e| e.to_string())?;
            self.last_state_us.store(0, Ordering::Relaxed);
        }
        Ok(receipt)
    }
}
