//! A Redis region: every instance on one Redis (one server or a cluster) is
//! one region. Its global limits' state is in Redis ([`state`]: decisions,
//! merges, reads, acknowledgements, all in the one script); a
//! [`RedisRegion`] is each instance's side of the sync, on the engine every
//! kind of region shares ([`floodgate_core::region::link`]): the keys it
//! touched, queued per peer, batches read back from Redis, acknowledgements
//! written to it. Every instance of the region pushes what it touched and
//! receives what peers send (any instance may take a peer's batch: all
//! write the same Redis), so a key several instances touched goes out
//! several times; the maximum at the receiver makes that harmless.
//!
//! The region's incarnation and the peers' `complete` flags live in Redis
//! (`<prefix>region:<name>`): a Redis that restarts empty is a new
//! incarnation, seen by every instance within a sync interval.

mod state;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use floodgate_core::region::link::{KeyQueue, Requeue, Take};
use floodgate_core::region::{
    Ack, Batch, BatchHead, BatchSink, Item, Lazy, LinkStats, Links, Receipt, Region, RegionConfig, SyncMode,
    TableStats, can_wait, fingerprint,
};
use floodgate_core::{Clock, Limit, StoreError, SystemClock};

pub use state::MergeStats;

use crate::global::RegionCtx;
use crate::{RedisConfig, RedisStore};

/// The maps of keys (client-chosen): foldhash, randomly seeded against hash
/// flooding, as the memory store's and the memory region's tables.
type KeyMap<V> = HashMap<String, V, foldhash::fast::RandomState>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Keys per batch.
pub const BATCH_ITEMS: usize = 100;
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

/// A key owed to a peer: to be read from Redis, or read already.
#[derive(Debug)]
enum Owed {
    /// A key to read.
    Key(String, Tag),
    /// An item another peer's batch read from Redis after this peer's queue
    /// had its key: as new as a read of its own would be, so it goes out
    /// without one (every peer's queue has about the same keys, and reading
    /// is what a Redis region's sync costs).
    Read(Item, Tag),
}

/// One peer's queue: keys in order, each once (its tag in `queued`), and
/// the items read for another peer.
#[derive(Default)]
struct Queue {
    /// Keys to send, oldest first; one not in `queued` (taken since by
    /// another peer's read) is skipped.
    order: VecDeque<String>,
    /// The keys in `order`, each with its tag.
    queued: KeyMap<Tag>,
    shared: VecDeque<(Item, Tag)>,
}

impl Queue {
    /// Fold `key` into the same key queued already (`None`), or make what
    /// to queue.
    fn absorb(&mut self, key: &str, tag: Tag) -> Option<Owed> {
        match self.queued.get_mut(key) {
            Some(t) => {
                t.join(tag);
                None
            }
            None => Some(Owed::Key(key.to_owned(), tag)),
        }
    }
}

impl KeyQueue for Queue {
    type Key = Owed;

    fn len(&self) -> usize {
        self.queued.len() + self.shared.len()
    }

    fn size(&self) -> usize {
        self.order.len()
    }

    fn push_back(&mut self, key: Owed) {
        match key {
            Owed::Key(k, tag) => {
                self.queued.insert(k.clone(), tag);
                self.order.push_back(k);
            }
            Owed::Read(item, tag) => self.shared.push_back((item, tag)),
        }
    }

    fn pop_front(&mut self) -> Option<Owed> {
        if let Some((item, tag)) = self.shared.pop_front() {
            return Some(Owed::Read(item, tag));
        }
        while let Some(k) = self.order.pop_front() {
            if let Some(tag) = self.queued.remove(&k) {
                return Some(Owed::Key(k, tag));
            }
        }
        None
    }
}

/// What a bounded key's acknowledgement confirms: this region's own counts
/// as sent, `(counter key, [(slot, count)])`.
type Confirms = Vec<(String, Vec<(u64, u64)>)>;

/// An instance's side of a Redis region's sync.
pub struct RedisRegion {
    name: String,
    peers: Vec<String>,
    store: RedisStore,
    /// The region's incarnation, from Redis (0 until read).
    incarnation: AtomicU64,
    links: Links<Queue, Confirms>,
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
    /// This instance's side of region `cfg.region` with `cfg.peers`, over
    /// the Redis of `redis` (its store built here, as a region's: see
    /// [`RedisRegion::store`]). `cfg.incarnation` is not used: a Redis
    /// region's incarnation is in Redis.
    pub fn new(cfg: &RegionConfig, redis: RedisConfig) -> Result<Self, redis::RedisError> {
        let links = Links::new(cfg);
        let ctx = RegionCtx {
            regions: cfg.peers.len() + 1,
            warming: links.warming_flag().clone(),
            retry_us: cfg.retry_hint_us,
        };
        Ok(Self {
            name: cfg.region.clone(),
            peers: cfg.peers.clone(),
            store: RedisStore::regional(redis, ctx)?,
            incarnation: AtomicU64::new(0),
            links,
            pending: Mutex::new(KeyMap::default()),
            rules: Mutex::new(HashMap::new()),
            last_rule: AtomicU64::new(0),
            lazy: Lazy::new(cfg.lazy_us),
            interval_us: cfg.interval_us,
            last_state_us: AtomicU64::new(0),
            merges: Mutex::new(TableStats::default()),
            listing_failed: AtomicBool::new(false),
            clock: SystemClock::new(),
        })
    }

    /// The region's store: decisions go through it.
    pub fn store(&self) -> &RedisStore {
        &self.store
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
        // Later than the one this instance knew (a Redis that restarts
        // empty is a later incarnation, whatever this clock says).
        let fresh = floodgate_core::region::new_incarnation(now, std::process::id().into())
            .max(self.incarnation.load(Ordering::Relaxed).saturating_add(1));
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
        for (p, peer) in self.peers.iter().enumerate() {
            let complete = map.get(&format!("c:{peer}")).and_then(|v| v.parse::<u64>().ok()) == Some(inc);
            self.links.set_complete(p, complete);
        }
    }

    /// After a global decision under `limit` admitted `hits` of `key`
    /// (`remaining` left, as this region sees it): queue it for the peers
    /// now, or within the lazy period when those hits cannot matter before
    /// (see `floodgate_core::region`).
    pub fn touched(&self, key: &str, limit: &Limit, mode: SyncMode, hits: u64, remaining: u64) {
        let rule = self.rule(limit, mode);
        let bounded = matches!(mode, SyncMode::Bounded { .. });
        if bounded || self.links.warming() || self.lazy.eager() {
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

    /// Queue `key` for every peer.
    fn queue(&self, key: &str, tag: Tag) {
        for p in 0..self.links.len() {
            self.links.push_with(p, |q| q.absorb(key, tag));
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

    /// Queue `keys` again for peer `p` (a read item as its key).
    fn requeue_keys(&self, p: usize, keys: Vec<Owed>) {
        for owed in keys {
            let (key, tag) = match owed {
                Owed::Key(k, tag) => (k, tag),
                Owed::Read(item, tag) => (item.key, tag),
            };
            self.links.push_with(p, |q| q.absorb(&key, tag));
        }
    }

    /// Batches to peer `p` were lost: their keys go out again (the lazy
    /// ones at once if the link started failing).
    fn requeue(&self, p: usize, lost: Requeue<Owed>) {
        if lost.started_failing {
            self.link_failing(true);
        }
        self.requeue_keys(p, lost.keys);
    }

    fn link_failing(&self, started: bool) {
        self.queue_lazy(self.lazy.link_failing(started));
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

    /// Start a full state transfer to peer `p` (incarnation `incarnation`);
    /// when Redis cannot list the keys now, the engine asks again later.
    async fn full_state(&self, p: usize, incarnation: u64) -> bool {
        match self.all_keys().await {
            Some(keys) => {
                let keys = keys.into_iter().map(|k| Owed::Key(k, Tag::default()));
                self.links.start_full(p, incarnation, keys);
                true
            }
            None => {
                self.links.list_failed(p);
                false
            }
        }
    }

    /// Take `keys` out of every other peer's queue that has them (a peer
    /// that is failing, or holds enough shared items already, reads its
    /// own): per peer, the keys taken and their tags there.
    fn take_for_others(&self, p: usize, keys: &[(String, Tag)]) -> Vec<(usize, Vec<(String, Tag)>)> {
        let mut taken = Vec::new();
        for q in (0..self.links.len()).filter(|&q| q != p) {
            let mut link = self.links.lock(q);
            if link.failing() {
                continue;
            }
            let queue = link.queue_mut();
            if queue.shared.len() >= MAX_SHARED || queue.queued.is_empty() {
                continue;
            }
            let ks: Vec<(String, Tag)> =
                keys.iter().filter_map(|(k, _)| queue.queued.remove(k).map(|b| (k.clone(), b))).collect();
            if !ks.is_empty() {
                taken.push((q, ks));
            }
        }
        taken
    }

    /// The counters of the link to peer `p`.
    pub fn link_stats(&self, p: usize) -> LinkStats {
        self.links.stats(p)
    }

    /// What this instance's merges of peers' batches did.
    pub fn stats(&self) -> TableStats {
        *lock(&self.merges)
    }

    /// Whether the region waits for a peer's full state.
    pub fn warming(&self) -> bool {
        self.links.warming()
    }

    /// The region's incarnation (0 until read from Redis).
    pub fn incarnation(&self) -> u64 {
        self.incarnation.load(Ordering::Acquire)
    }
}

impl Region for RedisRegion {
    fn name(&self) -> &str {
        &self.name
    }

    fn peers(&self) -> &[String] {
        &self.peers
    }

    async fn next_batch_into<S: BatchSink + Send>(&self, p: usize, now: u64, sink: &mut S) -> Option<BatchHead> {
        self.refresh(now).await;
        self.queue_lazy(self.lazy.due(now));
        let incarnation = self.incarnation();
        if incarnation == 0 {
            return None;
        }
        let expired = self.links.expire(p, now);
        self.requeue(p, expired);
        let mut plan = loop {
            match self.links.take(p, now) {
                Take::Wait => return None,
                // Keys were dropped from a full queue: send everything.
                Take::List(inc) => {
                    if !self.full_state(p, inc).await {
                        return None;
                    }
                }
                Take::Batch(plan) => break plan,
            }
        };
        let mut keys: Vec<(String, Tag)> = Vec::new();
        let mut shared: Vec<(Item, Tag)> = Vec::new();
        for owed in std::mem::take(&mut plan.keys) {
            match owed {
                Owed::Key(k, tag) => keys.push((k, tag)),
                Owed::Read(item, tag) => shared.push((item, tag)),
            }
        }
        // The other peers whose queues have these keys take them out now,
        // before the read: what this read returns is then new enough for
        // them, and a hit after it queues the key again.
        let taken = if plan.full { Vec::new() } else { self.take_for_others(p, &keys) };
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
            self.store.read_global(&names, &rules, plan.full, incarnation, &mut regions, None).await
        };
        let Ok(read) = read else {
            // Redis failing: the keys go out again later, to every peer.
            plan.keys = keys.into_iter().map(|(k, tag)| Owed::Key(k, tag)).collect();
            plan.keys.extend(shared.into_iter().map(|(item, tag)| Owed::Read(item, tag)));
            let back = self.links.abort(p, plan, Vec::new());
            self.requeue_keys(p, back);
            for (q, ks) in taken {
                self.requeue_keys(q, ks.into_iter().map(|(k, tag)| Owed::Key(k, tag)).collect());
            }
            return None;
        };
        if !taken.is_empty() {
            let at: HashMap<&str, usize> = keys.iter().enumerate().map(|(i, (k, _))| (k.as_str(), i)).collect();
            for (q, ks) in taken {
                let mut link = self.links.lock(q);
                for (k, b) in ks {
                    if let Some(item) = at.get(k.as_str()).and_then(|&i| read[i].as_ref()) {
                        link.queue_mut().shared.push_back((item.clone(), b));
                    }
                }
            }
        }
        let mut items: Vec<Item> = read.into_iter().flatten().collect();
        for (item, b) in shared {
            keys.push((item.key.clone(), b));
            items.push(item);
        }
        let bounded: HashSet<&str> = keys.iter().filter(|(_, t)| t.bounded).map(|(k, _)| k.as_str()).collect();
        let confirms: Confirms = items
            .iter()
            .filter(|item| bounded.contains(item.key.as_str()))
            .map(|item| {
                let own = item.components.iter().filter(|c| c.region == 0).map(|c| (c.slot, c.count)).collect();
                (item.key.clone(), own)
            })
            .collect();
        for item in &items {
            sink.item(&item.key, item.fingerprint, item.shape, &item.components);
        }
        plan.keys = keys.into_iter().map(|(k, tag)| Owed::Key(k, tag)).collect();
        let head = BatchHead {
            from: self.name.clone(),
            regions,
            from_incarnation: incarnation,
            to_incarnation: plan.to_incarnation,
            seq: plan.seq,
            items: items.len() as u64,
            complete: plan.complete,
            incarnations: Vec::new(),
        };
        self.links.sent(p, plan, confirms, items.len() as u64, now);
        Some(head)
    }

    async fn on_ack(&self, p: usize, ack: &Ack, now: u64) {
        let acked = self.links.on_ack(p, ack, now, self.incarnation());
        if acked.recovered {
            self.link_failing(false);
        }
        if let Some(confirmed) = acked.confirmed
            && !confirmed.is_empty()
        {
            let _ = self.store.ack_global(p, &confirmed, None).await;
        }
        if let Some(incarnation) = acked.restarted {
            self.full_state(p, incarnation).await;
        }
    }

    fn on_failure(&self, p: usize, seq: u64) {
        self.requeue(p, self.links.on_failure(p, seq));
    }

    async fn receive(&self, batch: Batch, now: u64) -> Result<Receipt, StoreError> {
        self.refresh(now).await;
        let incarnation = self.incarnation();
        if incarnation == 0 {
            return Err(StoreError::Unavailable("this region's Redis is not answering".into()));
        }
        let stats = self.store.merge(&batch, &self.name, incarnation, None).await?;
        {
            let mut t = lock(&self.merges);
            t.merges += stats.merged;
            t.unchanged += stats.unchanged;
            t.stale += stats.stale;
            t.fingerprint_mismatches += stats.mismatched;
            t.unknown_senders += u64::from(!self.peers.contains(&batch.from));
        }
        let mut receipt = Receipt {
            ack: Ack {
                region: self.name.clone(),
                incarnation,
                seq: batch.seq,
                for_incarnation: batch.from_incarnation,
            },
            ..Receipt::default()
        };
        match self.peers.iter().position(|p| *p == batch.from) {
            Some(p) => {
                let heard = self.links.received(p, batch.from_incarnation, batch.items.len(), now);
                receipt.sender_restarted = heard.sender_restarted;
                if let Some(incarnation) = heard.restarted {
                    self.full_state(p, incarnation).await;
                }
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
            self.store.raw(&set).await?;
            self.last_state_us.store(0, Ordering::Relaxed);
        }
        Ok(receipt)
    }
}

#[cfg(test)]
mod tests {
    use floodgate_core::region::link::KeyQueue;
    use floodgate_core::region::{Item, Shape};

    use super::{Owed, Queue, Tag};

    fn key(o: Option<Owed>) -> Option<(String, bool)> {
        o.map(|o| match o {
            Owed::Key(k, t) => (k, t.bounded),
            Owed::Read(item, t) => (format!("read {}", item.key), t.bounded),
        })
    }

    #[test]
    fn a_queue_holds_a_key_once_gives_read_items_first_and_skips_keys_taken_by_another_peer() {
        let mut q = Queue::default();
        for (k, bounded) in [("a", false), ("b", false)] {
            let owed = q.absorb(k, Tag { bounded, rule: 1 }).expect("not queued yet");
            q.push_back(owed);
        }
        assert!(q.absorb("a", Tag { bounded: true, rule: 0 }).is_none(), "queued: folded in");
        assert_eq!(q.len(), 2);
        // Another peer's read took `b` (its item goes to that peer).
        q.queued.remove("b");
        let item = Item { key: "c".into(), fingerprint: 1, shape: Shape::Gcra { slot_us: 1 }, components: vec![] };
        q.push_back(Owed::Read(item, Tag::default()));
        assert_eq!((q.len(), q.size()), (2, 2), "the bound counts the order, the length what is owed");
        assert_eq!(key(q.pop_front()), Some(("read c".into(), false)));
        assert_eq!(key(q.pop_front()), Some(("a".into(), true)), "bounded if either was");
        assert_eq!(key(q.pop_front()), None, "b was taken");
        assert!(q.is_empty());
    }
}
