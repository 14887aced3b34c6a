//! A Redis region: every instance on one Redis (one server or a cluster) is
//! one region. Its global limits' state is in Redis (`state`: decisions,
//! merges, reads, acknowledgements, all in the one script); a
//! [`RedisRegion`] is each instance's side of the sync, on the engine every
//! kind of region shares ([`floodgate_core::region::link`]): the keys it
//! touched, queued per peer, batches read back from Redis, acknowledgements
//! written to it. Every instance of the region pushes what it touched and
//! receives what peers send (any instance may take a peer's batch: all
//! write the same Redis), so a key several instances touched goes out
//! several times; the maximum at the receiver makes that harmless.
//!
//! The region's state outlives its instances: its incarnation, the peers'
//! `complete` flags and whether each peer has recorded the incarnation live
//! in Redis (`<prefix>region:<name>`), and so does the record of
//! incarnations (`record`). A Redis that restarts empty is a new
//! incarnation, seen by every instance within a sync interval. A new
//! instance lists every key of the region's global rules (their state keys,
//! by the rules' fingerprints, and the keys peers sent) for its peers' full
//! state, so hits an instance admitted and died before sending still reach
//! every peer.

mod queue;
mod record;
mod state;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use floodgate_core::region::link::{Requeue, Take};
use floodgate_core::region::{
    Ack, Batch, BatchHead, BatchSink, Incarnation, Incarnations, Item, Lazy, LinkStats, Links, Receipt, Region,
    RegionConfig, SyncMode, TableStats, can_wait, fingerprint, shape_of,
};
use floodgate_core::{Clock, Limit, StoreError, SystemClock};

pub use state::MergeStats;

use crate::global::RegionCtx;
use crate::{RedisConfig, RedisStore};
use queue::{Key, KeyMap, Owed, Queue, Tag};
use record::Record;

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
    lazy: Lazy<Key>,
    interval_us: u64,
    last_state_us: AtomicU64,
    /// What this instance's merges did (`keys` stays 0: they are in Redis).
    merges: Mutex<TableStats>,
    /// Whether the last listing of the keys failed (logged once a streak).
    listing_failed: AtomicBool,
    clock: SystemClock,
    /// Every region's incarnations (shared with the store's decisions).
    deaths: Arc<Incarnations>,
    /// Until when eventual rules admit nothing (shared with the store).
    cold_until_us: Arc<AtomicU64>,
    warmup_us: u64,
    /// The record of incarnations in Redis.
    record: Record,
    /// The loaded global rules, by their limit's fingerprint as state keys
    /// end in it (a full state's listing finds their keys by it).
    global_rules: RwLock<HashMap<String, (Limit, SyncMode)>>,
    /// The same by `fingerprint(limit, mode)`, as batches carry it (a merge
    /// names the keys' state keys by it).
    by_fingerprint: RwLock<Arc<HashMap<u64, Limit>>>,
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
        let (deaths, cold_until_us) = (Arc::new(Incarnations::new(0)), Arc::new(AtomicU64::new(0)));
        let ctx = RegionCtx {
            regions: cfg.peers.len() + 1,
            warming: links.warming_flag().clone(),
            retry_us: cfg.retry_hint_us,
            recorded: links.recorded_flag().clone(),
            cold_until_us: cold_until_us.clone(),
            deaths: deaths.clone(),
        };
        let record = Record::new(&redis.key_prefix, &cfg.region);
        Ok(Self {
            deaths,
            cold_until_us,
            warmup_us: cfg.warmup_us,
            record,
            global_rules: RwLock::new(HashMap::new()),
            by_fingerprint: RwLock::new(Arc::default()),
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
        // The incarnation's start time (0 for one an older build made).
        let started = Some(inc >> 12).filter(|&t| t <= now.saturating_add(60_000_000)).unwrap_or(0);
        if old != inc {
            let me = Incarnation { region: 0, incarnation: inc, recorded_us: started.min(now), dead_us: 0, count: 1 };
            if self.record.add(&self.store, &[me]).await.is_err() {
                self.last_state_us.store(0, Ordering::Relaxed);
            }
        }
        let mut heard = false;
        for (p, peer) in self.peers.iter().enumerate() {
            let is = |field: &str| map.get(&format!("{field}:{peer}")).and_then(|v| v.parse::<u64>().ok()) == Some(inc);
            let complete = is("c");
            heard |= complete;
            self.links.set_complete(p, complete);
            self.links.set_recorded(p, is("r"));
        }
        // Knowing nothing yet: eventual rules wait for the first peer's
        // full state, at most the warm-up wait from the incarnation's start.
        let cold =
            if self.links.warming() && !heard && started != 0 { started.saturating_add(self.warmup_us) } else { 0 };
        self.cold_until_us.store(cold, Ordering::Release);
        if let Ok(records) = self.record.read(&self.store).await {
            self.deaths.reset(&records);
            // Dead long enough that no bounded decision counts them.
            let before = now.saturating_sub(self.keep_dead_us());
            let old: Vec<Incarnation> =
                self.deaths.records().into_iter().filter(|r| r.dead_us != 0 && r.dead_us < before).collect();
            if !old.is_empty() && self.record.remove(&self.store, &old).await.is_ok() {
                self.deaths.prune(before);
            }
        }
    }

    /// How long a dead incarnation is remembered: twice the longest span a
    /// bounded rule counts, at least an hour.
    fn keep_dead_us(&self) -> u64 {
        let rules = self.global_rules.read().unwrap_or_else(PoisonError::into_inner);
        let span = rules
            .values()
            .filter(|(_, m)| matches!(m, SyncMode::Bounded { .. }))
            .filter_map(|(l, _)| shape_of(l))
            .map(|s| s.slot_us().saturating_mul(s.horizon()))
            .max()
            .unwrap_or(0);
        span.saturating_mul(2).max(3_600_000_000)
    }

    /// The region's global rules (at start and after every reload): a full
    /// state's listing finds their keys by their state keys' names, so hits
    /// an instance admitted and died before sending are not lost.
    pub fn set_rules(&self, rules: impl IntoIterator<Item = (Limit, SyncMode)>) {
        let map: HashMap<String, (Limit, SyncMode)> =
            rules.into_iter().map(|(l, m)| (format!("{:08x}", l.fingerprint()), (l, m))).collect();
        *self.by_fingerprint.write().unwrap_or_else(PoisonError::into_inner) =
            Arc::new(map.values().map(|(l, m)| (fingerprint(l, *m), l.clone())).collect());
        *self.global_rules.write().unwrap_or_else(PoisonError::into_inner) = map;
    }

    /// Record the incarnations `batch` shows (its sender's, its
    /// components', its record's) that the region does not know yet: in
    /// Redis first (every instance reads them back), then here.
    async fn learn(&self, batch: &Batch, now: u64) -> Result<(), StoreError> {
        let mine = self.incarnation();
        // Each with whether a peer's record gave its span.
        let mut new: Vec<(Incarnation, bool)> = Vec::new();
        let mut add = |region: u32, rec: Incarnation, spanned: bool| {
            let rec = Incarnation { region, ..rec };
            let mine_now = region == 0 && rec.incarnation == mine;
            let known = self.deaths.knows(region, rec.incarnation)
                || new.iter().any(|(n, _)| (n.region, n.incarnation) == (region, rec.incarnation));
            if !mine_now && !known {
                new.push((rec, spanned));
            }
        };
        let fresh = |incarnation| Incarnation { region: 0, incarnation, recorded_us: now, dead_us: 0, count: 1 };
        add(self.record.index(&batch.from), fresh(batch.from_incarnation), false);
        let names: Vec<u32> = batch.regions.iter().map(|n| self.record.index(n)).collect();
        for item in &batch.items {
            for c in &item.components {
                if let Some(&region) = names.get(c.region as usize) {
                    add(region, fresh(c.incarnation), false);
                }
            }
        }
        for r in &batch.incarnations {
            if let Some(&region) = names.get(r.region as usize) {
                add(region, *r, true);
            }
        }
        if new.is_empty() {
            return Ok(());
        }
        let recs: Vec<Incarnation> = new.iter().map(|(r, _)| *r).collect();
        self.record.add(&self.store, &recs).await?;
        for (r, spanned) in new {
            if spanned {
                self.deaths.merge(r, now);
            } else {
                self.deaths.learn(r.region, r.incarnation, now);
            }
        }
        Ok(())
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
            self.queue(key, None, Tag { bounded, rule, relay: false });
            return;
        }
        let mut pending = lock(&self.pending);
        let (unsent, new) = match pending.get_mut(key) {
            Some(e) => {
                *e = (e.0.saturating_add(hits), rule);
                (e.0, false)
            }
            None => (hits, true),
        };
        if !can_wait(unsent, remaining, self.peers.len() + 1) {
            pending.remove(key);
            drop(pending);
            self.queue(key, None, Tag { bounded: false, rule, relay: false });
        } else if new {
            let key = Key::from(key);
            pending.insert(key.clone(), (hits, rule));
            drop(pending);
            self.lazy.wait(self.clock.now_us(), key);
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

    /// Queue `key` for every peer (`made`: its shared key, if there is
    /// one already).
    fn queue(&self, key: &str, made: Option<Key>, tag: Tag) {
        self.queue_but(key, made, tag, None);
    }

    /// Queue `key` for every peer but `but`.
    fn queue_but(&self, key: &str, mut made: Option<Key>, tag: Tag, but: Option<usize>) {
        for p in (0..self.links.len()).filter(|&p| Some(p) != but) {
            self.links.push_with(p, |q| q.absorb(key, tag, &mut made));
        }
    }

    /// Queue `keys` from the lazy list, those still waiting.
    fn queue_lazy(&self, keys: Vec<Key>) {
        for k in keys {
            // Gone when an urgent touch has queued it since.
            let waiting = lock(&self.pending).remove(&*k);
            if let Some((_, rule)) = waiting {
                self.queue(&k, Some(k.clone()), Tag { bounded: false, rule, relay: false });
            }
        }
    }

    /// Queue `keys` again for peer `p` (a read item as its key), with
    /// every component: the lost batch may have relayed others'.
    fn requeue_keys(&self, p: usize, keys: Vec<Owed>) {
        for owed in keys {
            let (key, tag) = match owed {
                Owed::Key(k, tag) => (k, tag),
                Owed::Read(item, tag) => (Key::from(item.key), tag),
            };
            let mut made = Some(key.clone());
            self.links.push_with(p, |q| q.absorb(&key, Tag { relay: true, ..tag }, &mut made));
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
    /// transfer), from every primary of a cluster: the state keys of the
    /// global rules (by the limit's fingerprint they end in: a key admitted
    /// but never sent yet has nothing else), each with its rule, and every
    /// key whose global state is recorded (`:g:m`: peers' counts among
    /// them). `None` while Redis fails (the transfer is started again
    /// later).
    async fn all_keys(&self) -> Option<Vec<(Key, Tag)>> {
        let prefix = &self.store.config().key_prefix;
        let pattern = format!("{prefix}*");
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
        // <prefix>{tag}rest<suffix> -> tag + rest
        let counter_key = |body: &str| -> Option<String> {
            let open = body.strip_prefix('{')?;
            let close = open.find('}')?;
            Some(format!("{}{}", &open[..close], &open[close + 1..]))
        };
        let rules = self.global_rules.read().unwrap_or_else(PoisonError::into_inner).clone();
        let mut keys: KeyMap<Tag> = KeyMap::default();
        for k in found {
            let Some(body) = k.strip_prefix(prefix.as_str()) else { continue };
            if let Some(base) = body.strip_suffix(":g:m") {
                if let Some(key) = counter_key(base) {
                    keys.entry(key.into()).or_default();
                }
            } else if let Some((base, fp)) = body.rsplit_once(':')
                && let Some((limit, mode)) = rules.get(fp)
                && let Some(key) = counter_key(base)
            {
                let tag = Tag {
                    bounded: matches!(mode, SyncMode::Bounded { .. }),
                    rule: self.rule(limit, *mode),
                    relay: false,
                };
                keys.insert(key.into(), tag);
            }
        }
        Some(keys.into_iter().collect())
    }

    /// Start a full state transfer to peer `p` (incarnation `incarnation`);
    /// when Redis cannot list the keys now, the engine asks again later.
    async fn full_state(&self, p: usize, incarnation: u64) -> bool {
        match self.all_keys().await {
            Some(keys) => {
                let keys = keys.into_iter().map(|(k, tag)| Owed::Key(k, tag));
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
    fn take_for_others(&self, p: usize, keys: &[(Key, Tag)]) -> Vec<(usize, Vec<(Key, Tag)>)> {
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
            // Not a key it relays (this read may have only own counts).
            let mut ks: Vec<(Key, Tag)> = Vec::new();
            for (k, _) in keys {
                if queue.queued.get(k).is_some_and(|t| !t.relay)
                    && let Some(tag) = queue.queued.remove(k)
                {
                    ks.push((k.clone(), tag));
                }
            }
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

    /// Whether the region knows nothing yet (its Redis restarted empty) and
    /// no peer's full state has arrived: eventual rules admit nothing until
    /// one does or the warm-up wait is over.
    pub fn cold(&self) -> bool {
        self.links.warming() && self.cold_until_us.load(Ordering::Acquire) != 0
    }

    /// Whether bounded rules admit: every peer has recorded the region's
    /// incarnation.
    pub fn bounded_open(&self) -> bool {
        self.links.recorded_by_all()
    }

    /// Dead incarnations known (of every region).
    pub fn dead_incarnations(&self) -> u64 {
        self.deaths.deaths()
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
        let mut keys: Vec<(Key, Tag)> = Vec::new();
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
        let names: Vec<&str> = keys.iter().map(|(k, _)| &**k).collect();
        let read = if names.is_empty() {
            Ok(Vec::new())
        } else {
            let known: Vec<Option<Arc<(Limit, SyncMode)>>> = {
                let rules = lock(&self.rules);
                keys.iter().map(|(_, t)| rules.get(&t.rule).cloned()).collect()
            };
            let rules: Vec<Option<(&Limit, SyncMode)>> =
                known.iter().map(|r| r.as_deref().map(|(l, m)| (l, *m))).collect();
            let every: Vec<bool> = keys.iter().map(|(_, t)| plan.full || t.relay).collect();
            self.store.read_global(&names, &rules, &every, incarnation, &mut regions, None).await
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
            let at: HashMap<&str, usize> = keys.iter().enumerate().map(|(i, (k, _))| (&**k, i)).collect();
            for (q, ks) in taken {
                let mut link = self.links.lock(q);
                for (k, b) in ks {
                    if let Some(item) = at.get(&*k).and_then(|&i| read[i].as_ref()) {
                        link.queue_mut().shared.push_back((item.clone(), b));
                    }
                }
            }
        }
        let mut items: Vec<Item> = read.into_iter().flatten().collect();
        for (item, b) in shared {
            keys.push((Key::from(item.key.as_str()), b));
            items.push(item);
        }
        let bounded: HashSet<&str> = keys.iter().filter(|(_, t)| t.bounded).map(|(k, _)| &**k).collect();
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
        // A full state transfer carries the record of incarnations, its
        // regions numbered as the batch's.
        let mut incarnations = Vec::new();
        if plan.full || plan.complete {
            for r in self.deaths.records() {
                let Some(name) = self.record.name(r.region) else { continue };
                let at = regions.iter().position(|n| *n == name).unwrap_or_else(|| {
                    regions.push(name);
                    regions.len() - 1
                });
                incarnations.push(Incarnation { region: u32::try_from(at).unwrap_or(u32::MAX), ..r });
            }
        }
        let head = BatchHead {
            from: self.name.clone(),
            regions,
            from_incarnation: incarnation,
            to_incarnation: plan.to_incarnation,
            seq: plan.seq,
            items: items.len() as u64,
            complete: plan.complete,
            incarnations,
        };
        self.links.sent(p, plan, confirms, items.len() as u64, now);
        Some(head)
    }

    async fn on_ack(&self, p: usize, ack: &Ack, now: u64) {
        let incarnation = self.incarnation();
        let was = self.links.recorded(p);
        let acked = self.links.on_ack(p, ack, now, incarnation);
        if !was && self.links.recorded(p) {
            // The peer has recorded this incarnation: region-wide, so every
            // instance admits on bounded rules once every peer has.
            let mut set = redis::cmd("HSET");
            set.arg(self.state_key()).arg(format!("r:{}", self.peers[p])).arg(incarnation.to_string());
            if self.store.raw(&set).await.is_err() {
                self.links.set_recorded(p, false);
            }
        }
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
        let rules = self.by_fingerprint.read().unwrap_or_else(PoisonError::into_inner).clone();
        let stats = self.store.merge(&batch, &rules, &self.name, incarnation, None).await?;
        self.learn(&batch, now).await?;
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
        let sender = self.peers.iter().position(|p| *p == batch.from);
        // What the sender relays and raised ours goes on to the others.
        for &i in &stats.relay {
            if let Some(item) = batch.items.get(i) {
                self.queue_but(&item.key, None, Tag { bounded: false, rule: 0, relay: true }, sender);
            }
        }
        match sender {
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
