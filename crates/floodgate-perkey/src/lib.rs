//! Per-key limits: a limit for one exact descriptor (`user=alice` in domain
//! `api`), by naming a tier of the domain's rules file or by giving its own
//! limits, taking precedence over the files. Millions of them: they live in
//! a store ([`disk`] on one node; [`sharded`], Redis or a Redis Cluster,
//! when instances share a Redis store), and the decision path reads them
//! through a bounded cache that also holds "no entry" answers.
//!
//! * **Lookups.** A domain without entries costs one set lookup. Otherwise
//!   the descriptor's lookup key is looked up in the cache: first the
//!   compact table ([`compact`]: "no entry" or a tier, seven answers to a
//!   128-byte bucket, each kept as a 64-bit keyed fingerprint of its key
//!   and one word, `--key-cache` answers, least frequently used with
//!   aging), then for answers with their own limits [quick_cache]
//!   (S3-FIFO eviction, sharded, `--key-cache` answers, about
//!   [`BYTES_PER_ANSWER`] bytes each). A cached answer is the entry's
//!   limits only: a tier (one copy of its name per process) or its own
//!   parsed limits. Concurrent misses for one key cost one read: on disk
//!   the later ones wait on the key's stripe ([`PerKey::stripe`]) and find
//!   the first one's answer; with Redis they wait on quick_cache's
//!   placeholder. With Redis, a cached answer older than the time to live
//!   (`--key-cache-ttl`, default 5 min, less up to a fifth at random) is
//!   read again, and a compact answer hit in the last half of it is read
//!   again before then, in the background ([`REFRESH_SHARE`]); on disk
//!   answers expire only when the flag is given (every write goes through
//!   this process, which drops its key).
//! * **Misses.** On disk, a miss reads the hash index beside the database
//!   ([`index`]: one `pread`), or the database for keys written since the
//!   index was built (a B-tree descent through one long-lived read
//!   transaction; redb readers take no lock writers or other readers
//!   hold), on the deciding thread. With Redis, a
//!   miss waits for the next read batch (one `HMGET` per shard, beside the
//!   decision's own call); when Redis fails, the miss gets the files' rules
//!   and nothing is cached (`floodgate_key_read_errors_total`).
//! * **Writes** go to the store first (durable when they return), then
//!   drop their keys from the cache. With Redis every instance drops them
//!   too: the write publishes its keys, and each instance's subscription
//!   removes them from its cache within a round trip. Pub/Sub delivers at
//!   most once: an instance whose subscription was lost (Redis restarted,
//!   failed over, or stopped answering its pings) drops its whole cache
//!   when it subscribes again, and the time to live bounds what a lost
//!   message could leave stale.
//! * **Tiers** are resolved at decision time against the rules in use, so a
//!   tier edited in its rules file applies to every key on it at once. An
//!   entry naming an unknown tier is refused when written; one found anyway
//!   (the tier's file edited by hand, another instance's write) falls back
//!   to the files' rules, with a warning and a metric.
//! * **Counts.** The store keeps the number of entries per (domain, tier),
//!   updated in each write's transaction (Redis: each shard's counts, in
//!   the write's script). A reload that would remove a tier still named by
//!   entries is refused ([`PerKey::check_rules`]).

mod compact;
mod disk;
mod front;
mod index;
mod sharded;
mod striped;
mod value;

use std::collections::{HashMap, HashSet};
use std::hash::BuildHasher;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Acquire, Ordering::Relaxed, Ordering::Release};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwap;
use floodgate_core::rules::{ConfigError, Pos, Rule, RuleSet, check_tier_name, counter_key};
use floodgate_redis::RedisStore;
use quick_cache::sync::Cache;
use serde::{Deserialize, Serialize};

pub use disk::DB_CACHE_BYTES;
use disk::Disk;
pub use front::BYTES as FRONT_BYTES;
pub use sharded::SHARDS;
use sharded::Sharded;
use striped::Padded;
pub use striped::Striped;
pub use value::MAX_TIER_NAMES;
pub use value::lookup_key;
use value::{Stored, check_text, limits_of, own_limits};

/// Most entries in an entry's descriptor.
pub const MAX_ENTRIES: usize = 64;
/// Longest domain, key or value, in bytes.
pub const MAX_TEXT: usize = 1_024;
/// Most entries one batch (one `keys import` request) writes.
pub const MAX_BATCH: usize = 10_000;
/// Cached answers by default.
pub const DEFAULT_CACHE_ENTRIES: usize = 100_000;
/// How long a cached answer is used by default, with entries in Redis
/// (change notices and the shards' versions keep answers fresh; this
/// bounds what a failure of both could leave stale).
pub const DEFAULT_CACHE_TTL: Duration = Duration::from_secs(300);
/// How often the shards' versions are read (a missed notice is caught
/// within this).
pub const VERSIONS_EVERY: Duration = Duration::from_secs(1);
/// With entries in Redis, a compact answer hit in the last
/// `1 / REFRESH_SHARE` of its time to live is read again in the
/// background ([`PerKey::refresh_due`]): an answer in use is renewed before
/// it expires instead of missing then (with the default 5 minutes, an
/// answer hit at least once in the last 2.5 minutes of its life). A
/// refresh is a key in a batch of up to a thousand, off the decisions'
/// path, where a miss is a decision waiting for a read: the last half and
/// not a tenth, so that answers hit every minute or two, most of a full
/// cache under Zipf-like keys, are renewed too. Answers that go unused
/// expire.
pub const REFRESH_SHARE: u64 = 2;
/// How long a thread's front copy of a due answer is used after it asked
/// for its refresh (so each thread asks at most this often per key, also
/// while Redis fails to answer).
const REFRESH_RETRY_MS: u64 = 1_000;
/// Due answers waiting for their refresh; beyond, a hit does not ask (the
/// answer misses at its expiry, as without refreshes).
const DUE_QUEUE: usize = 16_384;
/// How often the refresher takes the due answers asked for meanwhile (a
/// hit only queues its key: waking the refresher for each would cost a
/// cross-thread wake-up a hit).
const REFRESH_EVERY: Duration = Duration::from_millis(20);
/// The metrics label of entries with their own limits and no `name`.
pub const PER_KEY_LABEL: &str = "per-key";
/// Memory per answer in the general cache (own limits), its
/// key included, measured with descriptors like `user=<7 digits>`
/// (BENCHMARKS.md, "Per-key limits").
pub const BYTES_PER_ANSWER: usize = 170;
/// Most answers `--key-cache` may give (the compact table for them is
/// allocated whole: 64 GiB here).
pub const MAX_CACHE_ENTRIES: usize = 1 << 30;
/// Memory per answer of the compact table (tiers and "no entry"): its
/// line and its bucket's share of the versions. The cache's share of the
/// RSS bound is `--key-cache` × this, plus [`BYTES_PER_ANSWER`] for each
/// answer in the general cache.
pub const BYTES_PER_COMPACT_ANSWER: usize = compact::BYTES_PER_BUCKET.div_ceil(compact::WAYS);

/// One `(key, value)` of a descriptor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    /// The descriptor key.
    pub key: String,
    /// The value (exact; no wildcards).
    pub value: String,
}

/// An entry as written: the domain, the exact descriptor, and either a
/// tier of the domain or its own limits.
///
/// ```
/// use floodgate_perkey::KeySpec;
/// let s: KeySpec = serde_json::from_str(
///     r#"{"domain": "api", "descriptor": [{"key": "user", "value": "alice"}], "tier": "pro"}"#,
/// ).unwrap();
/// assert_eq!(s.tier.as_deref(), Some("pro"));
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeySpec {
    /// The domain.
    pub domain: String,
    /// The exact descriptor.
    pub descriptor: Vec<Entry>,
    /// A tier of the domain's rules file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier: Option<String>,
    /// Its own limits: one `rate_limit` block, or a list of them, as in a
    /// rules file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<serde_json::Value>,
    /// The metrics label of its own limits (default `per-key`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl KeySpec {
    /// The descriptor as `(key, value)` pairs.
    pub fn entries(&self) -> Vec<(&str, &str)> {
        self.descriptor.iter().map(|e| (e.key.as_str(), e.value.as_str())).collect()
    }
}

/// What an entry's limits are: what a lookup answers.
#[derive(Debug, Clone)]
pub enum Limits {
    /// The named tier of the domain, as the rules in use define it (one
    /// copy of each name per process).
    Tier(&'static str),
    /// Its own, validated.
    Own(Arc<[Rule]>),
}

impl Limits {
    /// Its limits under the rules `set` for an entry of `domain`: its own,
    /// or its tier's (`None` when the domain has no such tier).
    pub fn rules_in<'a>(&'a self, set: &'a RuleSet, domain: &str) -> Option<&'a [Rule]> {
        match self {
            Self::Own(rules) => Some(rules),
            Self::Tier(t) => tier_of(set, domain, t).map(|t| t.rules.as_slice()),
        }
    }

    /// The counter key of its `i`th limit, for the descriptor whose own
    /// counter key is `base`: the descriptor's counters, numbered as a
    /// file rule's (`base`, `base#1`, …). A limit that differs from the
    /// one that counted there before starts afresh (both stores keep state
    /// by the limit's fingerprint), so moving a key to another tier, or
    /// giving it its own limits, starts its counters anew, and a tier whose
    /// limits did not change keeps them. The key is no longer than the
    /// files' own: the in-memory store keeps keys of up to 22 bytes inline.
    pub fn counter_key(&self, base: &str, i: usize) -> String {
        self.suffixed(base.to_owned(), i)
    }

    /// [`Limits::counter_key`], written onto `base`.
    pub fn suffixed(&self, mut base: String, i: usize) -> String {
        if i > 0 {
            use std::fmt::Write as _;
            let _ = write!(base, "#{i}");
        }
        base
    }
}

/// An entry as written, validated.
#[derive(Debug, Clone)]
pub struct KeyEntry {
    /// As written.
    pub spec: KeySpec,
    /// Its limits.
    pub limits: Limits,
    /// Seconds since the Unix epoch.
    pub updated_at: u64,
}

impl KeyEntry {
    /// The counter key of its `i`th limit ([`Limits::counter_key`]).
    pub fn counter_key(&self, i: usize) -> String {
        self.limits.counter_key(&counter_key(&self.spec.domain, &self.spec.entries()), i)
    }

    /// Its limits under the rules `set` ([`Limits::rules_in`]).
    pub fn rules_in<'a>(&'a self, set: &'a RuleSet) -> Option<&'a [Rule]> {
        self.limits.rules_in(set, &self.spec.domain)
    }
}

/// The tier `tier` of `domain` in the rules `set`, if defined.
fn tier_of<'a>(set: &'a RuleSet, domain: &str, tier: &str) -> Option<&'a floodgate_core::rules::Tier> {
    set.domain(domain)?.tier(tier)
}

/// A lookup [`PerKey::lookup_now`] cannot answer without a Redis read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the entry is not cached: it needs a Redis read")]
pub struct NeedsRead;

/// Why an entry could not be set, deleted or read.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// The request itself is wrong (400).
    #[error("{0}")]
    Invalid(String),
    /// The limits do not validate (400), each error positioned in the
    /// limits' JSON.
    #[error("invalid limits:\n{0}")]
    Limits(floodgate_core::rules::ConfigErrors),
    /// The database failed (500); nothing changed.
    #[error("per-key storage failed: {0}")]
    Storage(String),
    /// The database file is open in another process (redb locks it).
    #[error(
        "{0} is open in another floodgate process: give each instance its own --overrides-file (or leave the flag out: each instance then gets its own file under --state-dir)"
    )]
    InUse(String),
    /// Entries are kept in Redis, which failed (503).
    #[error(
        "per-key entries are kept in Redis, which failed: {0}; try again (part of a batch may be written: writing it again completes it)"
    )]
    Shared(String),
}

/// The cache's size and time to live.
#[derive(Debug, Clone, Copy)]
pub struct CacheOptions {
    /// Most cached answers (entries and "no entry" alike).
    pub entries: usize,
    /// How long a cached answer is used before it is read again; `None`:
    /// [`DEFAULT_CACHE_TTL`] with entries in Redis, and no expiry on disk
    /// (every write goes through this process, which drops its key: no
    /// answer can go stale, and expiring hot answers would only read them
    /// again).
    pub ttl: Option<Duration>,
}

impl Default for CacheOptions {
    fn default() -> Self {
        Self { entries: DEFAULT_CACHE_ENTRIES, ttl: None }
    }
}

/// Stripes of keys for disk misses and writes ([`PerKey::stripe`]): two
/// misses of different keys wait for each other only when their keys share
/// one.
const STRIPES: usize = 256;

/// Longest lookup key a cache slot holds inline.
const INLINE_KEY: usize = 46;

/// A cache key: the lookup key, inline when it is short (most are: the
/// domain, the descriptor key and a value of up to ~30 bytes), so that a
/// hit follows no pointer to compare it and a miss allocates nothing.
/// 48 bytes either way.
#[derive(Clone, PartialEq, Eq, Hash)]
enum CacheKey {
    Inline(u8, [u8; INLINE_KEY]),
    Heap(Box<str>),
}

impl CacheKey {
    fn new(key: &str) -> Self {
        match u8::try_from(key.len()) {
            Ok(n) if key.len() <= INLINE_KEY => {
                let mut bytes = [0; INLINE_KEY];
                bytes[..key.len()].copy_from_slice(key.as_bytes());
                Self::Inline(n, bytes)
            }
            _ => Self::Heap(key.into()),
        }
    }

    fn as_str(&self) -> &str {
        match self {
            // Copied from a `str` whole: always UTF-8.
            Self::Inline(n, bytes) => std::str::from_utf8(&bytes[..usize::from(*n)]).unwrap_or_default(),
            Self::Heap(s) => s,
        }
    }
}

/// A cached answer: the entry's limits, or none, and when it expires
/// (milliseconds after the store opened).
#[derive(Clone)]
struct Cached {
    limits: Option<Limits>,
    expires_ms: u64,
}

/// A compact answer hit while due for its refresh ([`REFRESH_SHARE`]).
struct Due {
    key: String,
    at: compact::Place,
}

/// What became of a miss's answer offered to the compact table.
enum Kept {
    /// Kept, with this code.
    Yes(u32),
    /// Not kept: something left the caches since its read began.
    Raced,
    /// Not an answer the table holds (own limits).
    NotCompact,
}

/// A page of a listing.
#[derive(Debug)]
pub struct Page {
    /// The entries, in (domain, descriptor) order.
    pub entries: Vec<(KeySpec, u64)>,
    /// Give it as `cursor` for the next page (`None` at the end).
    pub next_cursor: Option<String>,
}

/// Counters of the per-key machinery, for the metrics.
#[derive(Debug, Default)]
pub struct KeyStats {
    /// Lookups answered from the cache.
    pub hits: Striped,
    /// Lookups that read the store.
    pub misses: Striped,
    /// Misses the store failed to answer (the files' rules applied).
    pub read_errors: AtomicU64,
    /// Decisions whose entry named a tier the rules do not define.
    pub unknown_tier: AtomicU64,
    /// Stored entries that could not be read or no longer validate.
    pub bad_entries: AtomicU64,
    /// Times the change subscription was (re)established, each dropping
    /// the cache.
    pub subscribed: AtomicU64,
    /// Shards found changed with no notice (each dropped its answers).
    pub missed_notices: AtomicU64,
    /// Change notices taken from Redis (each dropped its keys' answers).
    pub notices: AtomicU64,
    /// Answers read again in the background before they expired (hit
    /// while due: [`REFRESH_SHARE`]).
    pub refreshed: AtomicU64,
}

/// The on-disk hash index's state ([`PerKey::index_status`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexStatus {
    /// An index is in use for misses (otherwise misses read the database).
    pub ready: bool,
    /// Misses it answered.
    pub answered: u64,
    /// Builds put in use.
    pub builds: u64,
}

/// Rows of a listing (lookup key, value) and whether more follow.
pub(crate) type Rows = (Vec<(String, Vec<u8>)>, bool);

/// One write of a batch: a lookup key and its new value (`None` deletes).
pub(crate) struct Write {
    key: String,
    value: Option<Vec<u8>>,
}

impl Write {
    fn put(key: String, stored: &Stored) -> Self {
        Self { key, value: Some(stored.encode()) }
    }

    /// The write setting `spec`, updated at `updated_at`; `None` when its
    /// descriptor holds a separator (no entry built by [`build`] does).
    fn of(spec: &KeySpec, updated_at: u64) -> Option<Self> {
        Some(Self::put(lookup_key(&spec.domain, &spec.entries())?, &Stored::of(spec, updated_at)))
    }

    /// The write of an entry as builds before tiers stored it (redb's
    /// `overrides` table, Redis's shared map): the JSON of
    /// `{"spec": {domain, descriptor, limits}, "updated_at"}`.
    fn legacy(text: &str) -> Result<Self, BadLegacy> {
        #[derive(Deserialize)]
        struct Legacy {
            spec: KeySpec,
            updated_at: u64,
        }
        let old: Legacy = serde_json::from_str(text).map_err(BadLegacy::Parse)?;
        Self::of(&old.spec, old.updated_at).ok_or(BadLegacy::Separator)
    }
}

/// Why an entry written by an older build cannot be moved (it is dropped,
/// with a warning).
#[derive(Debug, thiserror::Error)]
enum BadLegacy {
    #[error("it does not parse: {0}")]
    Parse(serde_json::Error),
    #[error("a control character in its descriptor")]
    Separator,
}

/// The per-key store.
pub struct PerKey {
    disk: Disk,
    /// Set when entries are kept in Redis: every read and write goes there.
    sharded: OnceLock<Arc<Sharded>>,
    /// The compact answers ("no entry", a tier): most of them
    /// ([`compact`]).
    compact: compact::Compact,
    /// The other answers (own limits), and with Redis every miss's
    /// placeholder while its read is out (one read per key).
    cache: Cache<CacheKey, Cached>,
    /// Set once the general cache has been given an answer on disk (until
    /// then, a disk lookup does not read it).
    general_used: AtomicBool,
    /// Disk misses and writes, by stripes of keys ([`PerKey::stripe`]).
    stripes: Box<[Padded<Mutex<()>>]>,
    stripes_hash: foldhash::fast::RandomState,
    /// Bumped before anything leaves the caches: a miss's read that
    /// straddles a bump is not kept in `compact` (it may predate a write).
    epoch: AtomicU64,
    /// Bumped after anything leaves `cache` (a front slot of an older
    /// generation is not used).
    generation: AtomicU64,
    /// The time to live given, if any.
    ttl: Option<Duration>,
    /// The time to live in use (`u64::MAX`: none).
    ttl_ms: AtomicU64,
    /// With Redis, how long before its expiry a hit asks for an answer's
    /// refresh (0: never, on disk).
    refresh_ms: AtomicU64,
    /// Due answers asked for since the refresher last took them (with
    /// Redis: [`PerKey::refresh_due`]).
    due: Mutex<Vec<Due>>,
    opened: Instant,
    /// Domains with at least one entry (most requests skip the cache).
    domains: ArcSwap<HashSet<Box<str>>>,
    /// Look up every domain: set until Redis's counts are first read.
    all_domains: AtomicBool,
    /// Domains added by writes and change notices so far (a refresh of the
    /// counts keeps those added while it read).
    noticed: AtomicU64,
    /// `(domain, tier)` → entries (tier empty for own limits).
    counts: Mutex<HashMap<(String, String), u64>>,
    /// Serializes disk writes (redb has one writer at a time anyway).
    write: Mutex<()>,
    /// Serializes writes to Redis with their counts' refresh.
    shared_write: tokio::sync::Mutex<()>,
    /// `(domain, tier)` already warned about as unknown.
    warned: Mutex<HashSet<(String, String)>>,
    stats: KeyStats,
}

impl std::fmt::Debug for PerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PerKey").field("disk", &self.disk).finish_non_exhaustive()
    }
}

impl PerKey {
    /// Open (or create) the store at `path` with the default cache. Loads
    /// nothing but the per-tier counts.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, KeyError> {
        Self::open_with(path, CacheOptions::default())
    }

    /// [`PerKey::open`] with this cache.
    pub fn open_with(path: impl AsRef<Path>, cache: CacheOptions) -> Result<Self, KeyError> {
        let disk = Disk::open(path.as_ref())?;
        let this = Self {
            disk,
            sharded: OnceLock::new(),
            compact: compact::Compact::new(cache.entries.clamp(1, MAX_CACHE_ENTRIES)),
            cache: Cache::new(cache.entries.clamp(1, MAX_CACHE_ENTRIES)),
            general_used: AtomicBool::new(false),
            stripes: (0..STRIPES).map(|_| Padded::default()).collect(),
            stripes_hash: foldhash::fast::RandomState::default(),
            epoch: AtomicU64::new(0),
            generation: AtomicU64::new(0),
            ttl: cache.ttl,
            ttl_ms: AtomicU64::new(cache.ttl.map_or(u64::MAX, |t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX))),
            refresh_ms: AtomicU64::new(0),
            due: Mutex::default(),
            opened: Instant::now(),
            domains: ArcSwap::default(),
            all_domains: AtomicBool::new(false),
            noticed: AtomicU64::new(0),
            counts: Mutex::default(),
            write: Mutex::new(()),
            shared_write: tokio::sync::Mutex::new(()),
            warned: Mutex::default(),
            stats: KeyStats::default(),
        };
        this.set_counts(this.disk.counts()?);
        Ok(this)
    }

    /// The on-disk hash index in front of the database (built in the
    /// background: after open when missing or out of date, and after
    /// writes once they pause).
    pub fn index_status(&self) -> IndexStatus {
        let ix = self.disk.index();
        IndexStatus { ready: ix.is_built(), answered: ix.answered.get(), builds: ix.builds.load(Relaxed) }
    }

    /// Whether the entries are kept in Redis.
    pub fn is_shared(&self) -> bool {
        self.sharded.get().is_some()
    }

    /// Take the per-tier counts (and the domains with entries) as read.
    fn set_counts(&self, rows: Vec<(String, String, u64)>) {
        let domains = self.take_counts(rows);
        self.domains.store(Arc::new(domains));
    }

    /// Take the per-tier counts as read; the domains they give entries.
    fn take_counts(&self, rows: Vec<(String, String, u64)>) -> HashSet<Box<str>> {
        let domains = rows.iter().filter(|r| r.2 > 0).map(|r| Box::from(r.0.as_str())).collect();
        let counts = rows.into_iter().map(|(d, t, n)| ((d, t), n)).collect();
        *self.counts.lock().unwrap_or_else(PoisonError::into_inner) = counts;
        domains
    }

    /// Read the per-tier counts from the store again. A domain that a
    /// change notice added while Redis's counts were being read stays: the
    /// counts may predate its first entry.
    async fn refresh_counts(&self) -> Result<(), KeyError> {
        let Some(sharded) = self.sharded.get() else {
            self.set_counts(self.disk.counts()?);
            return Ok(());
        };
        let noticed = self.noticed.load(Relaxed);
        let rows = sharded.counts().await?;
        let fresh = self.take_counts(rows);
        // Retried when a notice swaps the set meanwhile, so none is lost.
        self.domains.rcu(|now| {
            let mut set = fresh.clone();
            if self.noticed.load(Relaxed) != noticed {
                set.extend(now.iter().cloned());
            }
            set
        });
        self.all_domains.store(false, Relaxed);
        Ok(())
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.opened.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Whether a descriptor of `domain` may have an entry.
    fn may_have(&self, domain: &str) -> bool {
        self.all_domains.load(Relaxed) || self.domains.load().contains(domain)
    }

    /// The lookup key of a descriptor, when its domain may have entries.
    fn key_of(&self, domain: &str, entries: &[(impl AsRef<str>, impl AsRef<str>)]) -> Option<String> {
        if !self.may_have(domain) {
            return None;
        }
        lookup_key(domain, entries)
    }

    /// The limits of exactly this descriptor's entry, if any, through the
    /// cache; a miss reads the store (on disk, on this thread; in Redis, in
    /// the next read batch). `None` when there is none, or the store failed
    /// to answer a miss (the files' rules apply then).
    pub async fn lookup(&self, domain: &str, entries: &[(impl AsRef<str>, impl AsRef<str>)]) -> Option<Limits> {
        let key = self.key_of(domain, entries)?;
        let at = self.compact.place(&key);
        let Some(sharded) = self.sharded.get() else {
            return self.lookup_disk(&key, at).map_or_else(|l| l, |(c, _)| c.limits);
        };
        if let Some((c, _)) = self.compact_hit(at) {
            return c.limits;
        }
        let cache_key = CacheKey::new(&key);
        for _ in 0..2 {
            match self.cache.get_value_or_guard_async(&cache_key).await {
                Ok(c) if self.fresh(&c) => {
                    self.stats.hits.add(1);
                    return c.limits;
                }
                Ok(_) => {
                    self.cache.remove(&cache_key);
                }
                Err(guard) => {
                    // The read this placeholder waited for may have gone
                    // to the compact table.
                    if let Some((c, _)) = self.compact_hit(at) {
                        return c.limits;
                    }
                    let (epoch, expires_ms) = (self.epoch.load(Acquire), self.expiry());
                    self.stats.misses.add(1);
                    let got = sharded.read(key.clone()).await.inspect_err(|e| {
                        self.stats.read_errors.fetch_add(1, Relaxed);
                        tracing::debug!("a per-key miss could not be read: {e}; the files' rules apply");
                    });
                    let limits = self.decoded(&key, got.ok()?.as_deref());
                    // Either fails when a change removed the key meanwhile.
                    if let Kept::NotCompact = self.keep_compact(&key, at, &limits, expires_ms, epoch) {
                        let _ = guard.insert(Cached { limits: limits.clone(), expires_ms });
                    }
                    return limits;
                }
            }
        }
        None
    }

    /// [`PerKey::lookup`] without waiting: [`NeedsRead`] when the answer
    /// needs a Redis read (a miss with the entries in Redis).
    pub fn lookup_now(
        &self,
        domain: &str,
        entries: &[(impl AsRef<str>, impl AsRef<str>)],
    ) -> Result<Option<Limits>, NeedsRead> {
        if !self.may_have(domain) {
            return Ok(None);
        }
        // The key is written into this thread's buffer: a hit allocates
        // nothing (a miss's cache slot takes its own copy).
        thread_local!(static KEY: std::cell::RefCell<String> = std::cell::RefCell::new(String::with_capacity(128)));
        KEY.with_borrow_mut(|key| {
            if !value::lookup_key_into(key, domain, entries) {
                return Ok(None);
            }
            let at = self.compact.place(key);
            // Taken before the shared cache is read (see `front`).
            let generation = self.generation.load(Acquire);
            if let Some(code) = front::get(at.fp, generation, || self.now_ms())
                && let Some(answer) = compact::answer_of(code)
            {
                self.stats.hits.add(1);
                return Ok(answer);
            }
            let (c, code) = if self.sharded.get().is_none() {
                match self.lookup_disk(key, at) {
                    Ok(got) => got,
                    Err(limits) => return Ok(limits),
                }
            } else if let Some((c, code)) = self.compact_hit(at) {
                (c, Some(code))
            } else {
                match self.general_hit(&CacheKey::new(key)) {
                    Some(c) => (c, None),
                    None => return Err(NeedsRead),
                }
            };
            if let Some(code) = code {
                front::put(at.fp, generation, self.front_until(key, at, c.expires_ms), code);
            }
            Ok(c.limits)
        })
    }

    /// [`PerKey::lookup_now`], a Redis miss answered `None` (for tests and
    /// tools; the service waits for the read).
    pub fn get(&self, domain: &str, entries: &[(impl AsRef<str>, impl AsRef<str>)]) -> Option<Limits> {
        self.lookup_now(domain, entries).ok().flatten()
    }

    /// The compact table's answer for the key at `at`, and its code, a hit
    /// counted.
    fn compact_hit(&self, at: compact::Place) -> Option<(Cached, u32)> {
        match self.compact.get(at, || self.now_ms()) {
            compact::Found::Hit(code, expires_ms) => {
                let limits = compact::answer_of(code)?;
                self.stats.hits.add(1);
                Some((Cached { limits, expires_ms }, code))
            }
            compact::Found::Miss => None,
        }
    }

    /// Keep a miss's answer for `key` (placed at `at`) in the compact
    /// table, read since `epoch` (not kept when something left the caches
    /// since the read began: the read may predate a write).
    fn keep_compact(
        &self,
        key: &str,
        at: compact::Place,
        limits: &Option<Limits>,
        expires_ms: u64,
        epoch: u64,
    ) -> Kept {
        let Some(code) = compact::code_of(limits) else { return Kept::NotCompact };
        if self.compact.insert(key, at, code, expires_ms, self.now_ms(), || self.epoch.load(Acquire) == epoch) {
            Kept::Yes(code)
        } else {
            Kept::Raced
        }
    }

    /// Until when a thread's front copy of the compact answer for `key`,
    /// expiring at `expires_ms`, is used: until the answer falls due for its
    /// refresh, so that a hit then reaches the shared table and this. A due
    /// one is sent for its refresh now, and its front copy used for
    /// [`REFRESH_RETRY_MS`] at most.
    fn front_until(&self, key: &str, at: compact::Place, expires_ms: u64) -> u64 {
        let window = self.refresh_ms.load(Relaxed);
        if expires_ms == u64::MAX || window == 0 {
            return expires_ms;
        }
        let due_at = expires_ms.saturating_sub(window);
        let now = self.now_ms();
        if now < due_at {
            return due_at;
        }
        let mut due = self.due.lock().unwrap_or_else(PoisonError::into_inner);
        // Full: this answer misses at its expiry instead.
        if due.len() < DUE_QUEUE {
            due.push(Due { key: key.to_owned(), at });
        }
        drop(due);
        expires_ms.min(now.saturating_add(REFRESH_RETRY_MS))
    }

    /// Read due answers again: every [`REFRESH_EVERY`], those asked for
    /// meanwhile, each key once, [`sharded::READ_BATCH`] a read; and keep
    /// what is read with a new expiry, as a miss keeps its read (not when
    /// something left the caches meanwhile). An
    /// answer that Redis fails to give stays as it was and expires as
    /// usual (a hit while still due asks again); one that is no longer
    /// compact (the entry now has its own limits, a change whose notice
    /// has yet to come) leaves the caches. Runs as long as the store does.
    async fn refresh_due(&self, sharded: &Sharded) {
        let mut every = tokio::time::interval(REFRESH_EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            let mut due = std::mem::take(&mut *self.due.lock().unwrap_or_else(PoisonError::into_inner));
            due.sort_unstable_by_key(|d| d.at.fp);
            due.dedup_by_key(|d| d.at.fp);
            for batch in due.chunks(sharded::READ_BATCH) {
                self.refresh(sharded, batch).await;
            }
        }
    }

    /// [`PerKey::refresh_due`] of one batch.
    async fn refresh(&self, sharded: &Sharded, batch: &[Due]) {
        // Taken before the read, as a miss takes them: an answer expires
        // within the time to live of the state it was read from.
        let epoch = self.epoch.load(Acquire);
        let expiries: Vec<u64> = batch.iter().map(|_| self.expiry()).collect();
        let values = {
            let keys: Vec<&str> = batch.iter().map(|d| d.key.as_str()).collect();
            sharded.read_now(&keys).await
        };
        for ((d, got), expires_ms) in batch.iter().zip(values).zip(expiries) {
            let Ok(got) = got else { continue };
            let limits = self.decoded(&d.key, got.as_deref());
            match self.keep_compact(&d.key, d.at, &limits, expires_ms, epoch) {
                Kept::Yes(_) => {
                    self.stats.refreshed.fetch_add(1, Relaxed);
                }
                Kept::Raced => {}
                Kept::NotCompact => self.forget(std::iter::once(d.key.as_str())),
            }
        }
    }

    fn fresh(&self, c: &Cached) -> bool {
        c.expires_ms == u64::MAX || self.now_ms() < c.expires_ms
    }

    /// When an answer read now expires: after the time to live, less up to
    /// a fifth of it at random, so answers read together (a cold start, a
    /// dropped cache) do not all expire together and read again at once.
    fn expiry(&self) -> u64 {
        let ttl = self.ttl_ms.load(Relaxed);
        if ttl == u64::MAX {
            return u64::MAX;
        }
        let now = self.now_ms();
        let spread = ttl / 5;
        let jitter = if spread == 0 { 0 } else { random() % spread };
        now.saturating_add(ttl - jitter)
    }

    /// A lookup on disk: the cache, then the database on this thread. The
    /// answer as cached, or `Err` with one that was not (a failed read, or
    /// one that raced a write and was not kept).
    fn lookup_disk(&self, key: &str, at: compact::Place) -> Result<(Cached, Option<u32>), Option<Limits>> {
        if let Some((c, code)) = self.compact_hit(at) {
            return Ok((c, Some(code)));
        }
        let cache_key = CacheKey::new(key);
        if let Some(c) = self.general_hit_on_disk(&cache_key) {
            return Ok((c, None));
        }
        // A miss. With its key's stripe held, concurrent misses for it wait
        // and then find this one's answer: one read.
        let _reading = self.stripe(key);
        if let Some((c, code)) = self.compact_hit(at) {
            return Ok((c, Some(code)));
        }
        if let Some(c) = self.general_hit_on_disk(&cache_key) {
            return Ok((c, None));
        }
        let (epoch, expires_ms) = (self.epoch.load(Acquire), self.expiry());
        let limits = self.read_disk(key).map_err(|_| None)?;
        let c = Cached { limits, expires_ms };
        match self.keep_compact(key, at, &c.limits, expires_ms, epoch) {
            Kept::Yes(code) => Ok((c, Some(code))),
            // Raced a write: answered once, not kept.
            Kept::Raced => Err(c.limits),
            Kept::NotCompact => {
                // A write drops its keys holding their stripes (`forget`):
                // it dropped this key before the read began, or drops it
                // after this answer is kept. (The flag is set before the
                // stripe is let go: the next miss of this key sees it.)
                self.general_used.store(true, Relaxed);
                self.cache.insert(cache_key, c.clone());
                Ok((c, None))
            }
        }
    }

    /// The general cache's answer for `key`, a hit counted; one past its
    /// time to live is dropped (read it again).
    fn general_hit(&self, key: &CacheKey) -> Option<Cached> {
        let c = self.cache.get(key)?;
        if self.fresh(&c) {
            self.stats.hits.add(1);
            Some(c)
        } else {
            self.cache.remove(key);
            None
        }
    }

    /// [`PerKey::general_hit`] on disk, where the general cache is read
    /// only once it holds something (never, when every entry names a tier).
    fn general_hit_on_disk(&self, key: &CacheKey) -> Option<Cached> {
        if self.general_used.load(Relaxed) { self.general_hit(key) } else { None }
    }

    /// Hold `key`'s stripe: a disk miss holds it across its read and the
    /// keeping of its answer, and a write holds it while dropping the key.
    fn stripe(&self, key: &str) -> std::sync::MutexGuard<'_, ()> {
        let i = (self.stripes_hash.hash_one(key) % self.stripes.len() as u64) as usize;
        self.stripes[i].0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Read one entry's limits from the database (a miss).
    fn read_disk(&self, key: &str) -> Result<Option<Limits>, KeyError> {
        self.stats.misses.add(1);
        let read = self.disk.with(key, |v| self.decoded(key, Some(v))).inspect_err(|e| {
            self.stats.read_errors.fetch_add(1, Relaxed);
            tracing::warn!("a per-key entry could not be read: {e}; the files' rules apply");
        })?;
        Ok(read.flatten())
    }

    /// The limits of a stored value; a value that no longer validates is
    /// counted, logged and taken as none.
    fn decoded(&self, key: &str, value: Option<&[u8]>) -> Option<Limits> {
        match limits_of(value?) {
            Ok(l) => Some(l),
            Err(e) => {
                self.stats.bad_entries.fetch_add(1, Relaxed);
                tracing::warn!(entry = %key.replace(['\u{0}', '\u{1}'], " "), "a stored per-key entry is ignored: {e}");
                None
            }
        }
    }

    /// Note a decision whose entry, of `domain`, names a tier the rules do
    /// not define: counted, and logged once per (domain, tier).
    pub fn unknown_tier(&self, domain: &str, limits: &Limits) {
        self.stats.unknown_tier.fetch_add(1, Relaxed);
        let Limits::Tier(t) = limits else { return };
        let first =
            self.warned.lock().unwrap_or_else(PoisonError::into_inner).insert((domain.to_owned(), t.to_string()));
        if first {
            tracing::warn!(
                domain = %domain,
                tier = %t,
                "a per-key entry names a tier the rules do not define: its key gets the files' rules (counted in floodgate_key_unknown_tier_total)"
            );
        }
    }

    /// Validate `specs` against the rules `set` (tiers must exist there;
    /// `check_rule` refuses limits this server cannot honour) and build them.
    /// Every error, with the index of its spec.
    pub fn validate(
        specs: Vec<KeySpec>,
        set: &RuleSet,
        check_rule: impl Fn(&Rule) -> Option<String>,
    ) -> Result<Vec<KeyEntry>, Vec<(usize, KeyError)>> {
        let now = unix_now();
        let mut built = Vec::with_capacity(specs.len());
        let mut errors = Vec::new();
        for (i, spec) in specs.into_iter().enumerate() {
            let e = build(spec, now).and_then(|e| {
                match &e.limits {
                    Limits::Tier(t) => {
                        let Some(domain) = set.domain(&e.spec.domain) else {
                            return Err(KeyError::Invalid(format!(
                                "tier `{t}`: domain `{}` has no rules file here, and tiers are defined in it (under `tiers:`)",
                                e.spec.domain
                            )));
                        };
                        if domain.tier(t).is_none() {
                            let mut known: Vec<&str> = domain.tiers().map(|(n, _)| n).collect();
                            known.sort_unstable();
                            let known = if known.is_empty() { "none".to_owned() } else { known.join(", ") };
                            return Err(KeyError::Invalid(format!(
                                "unknown tier `{t}` in domain `{}` (its tiers: {known}): name one of them, or define it under `tiers:` in the domain's rules file",
                                e.spec.domain
                            )));
                        }
                    }
                    Limits::Own(rules) => {
                        if let Some(why) = rules.iter().find_map(&check_rule) {
                            return Err(KeyError::Invalid(format!("limits: {why}")));
                        }
                    }
                }
                Ok(e)
            });
            match e {
                Ok(e) => built.push(e),
                Err(e) => errors.push((i, e)),
            }
        }
        if errors.is_empty() { Ok(built) } else { Err(errors) }
    }

    /// Write validated entries ([`PerKey::validate`]): in one transaction
    /// on disk; in Redis, see [`sharded`].
    pub async fn put_all(&self, entries: &[KeyEntry]) -> Result<usize, KeyError> {
        self.commit(writes_of(entries)?).await?;
        Ok(entries.len())
    }

    /// Write validated entries on disk, in one transaction (not for entries
    /// kept in Redis: [`PerKey::put_all`]).
    pub fn write_all(&self, entries: &[KeyEntry]) -> Result<usize, KeyError> {
        self.commit_disk(&writes_of(entries)?)?;
        Ok(entries.len())
    }

    /// Apply writes to the store, then refresh the counts and drop the
    /// written keys from the cache (in that order: a lookup after the drop
    /// reads the new state, and sees its domain). Whether each key held an
    /// entry before.
    async fn commit(&self, writes: Vec<Write>) -> Result<Vec<bool>, KeyError> {
        let Some(sharded) = self.sharded.get() else { return self.commit_disk(&writes) };
        let _guard = self.shared_write.lock().await;
        let before = sharded.apply(&writes).await?;
        if let Err(e) = self.refresh_counts().await {
            tracing::debug!("per-key counts not read after a write: {e}");
        }
        self.forget(writes.iter().map(|w| w.key.as_str()));
        Ok(before)
    }

    fn commit_disk(&self, writes: &[Write]) -> Result<Vec<bool>, KeyError> {
        if self.is_shared() {
            return Err(KeyError::Invalid(
                "per-key entries are kept in Redis here: write them through the admin API".into(),
            ));
        }
        let _guard = self.write.lock().unwrap_or_else(PoisonError::into_inner);
        let before = self.disk.apply(writes, |_| Ok(()))?;
        self.set_counts(self.disk.counts()?);
        self.forget(writes.iter().map(|w| w.key.as_str()));
        Ok(before)
    }

    /// Drop these lookup keys from the cache, and note their domains as
    /// having entries (so lookups no longer skip them).
    fn forget<'a>(&self, keys: impl Iterator<Item = &'a str>) {
        let mut new_domains: Vec<Box<str>> = Vec::new();
        self.dropping(|| {
            let domains = self.domains.load();
            for k in keys {
                // Not while a miss of this key reads (`lookup_disk`).
                let _reading = self.stripe(k);
                self.compact.remove(self.compact.place(k));
                self.cache.remove(&CacheKey::new(k));
                let d = value::domain_of(k);
                if !domains.contains(d) && !new_domains.iter().any(|n| &**n == d) {
                    new_domains.push(Box::from(d));
                }
            }
        });
        if !new_domains.is_empty() {
            self.noticed.fetch_add(1, Relaxed);
            self.domains.rcu(|old| {
                let mut set = HashSet::clone(old);
                set.extend(new_domains.iter().cloned());
                set
            });
        }
    }

    /// [`PerKey::validate`] of one spec: the entry, or why not.
    fn validate_one(
        spec: KeySpec,
        set: &RuleSet,
        check_rule: impl Fn(&Rule) -> Option<String>,
    ) -> Result<KeyEntry, KeyError> {
        match Self::validate(vec![spec], set, check_rule) {
            Ok(mut built) => Ok(built.remove(0)),
            Err(mut errors) => Err(errors.remove(0).1),
        }
    }

    /// Set one entry (validated against `set`; `check_rule` refuses limits
    /// this server cannot honour, as for [`PerKey::validate`]).
    pub async fn put(
        &self,
        spec: KeySpec,
        set: &RuleSet,
        check_rule: impl Fn(&Rule) -> Option<String>,
    ) -> Result<KeyEntry, KeyError> {
        let e = Self::validate_one(spec, set, check_rule)?;
        self.put_all(std::slice::from_ref(&e)).await?;
        Ok(e)
    }

    /// Set one entry on disk (validated against `set`); durable when this
    /// returns.
    pub fn set(&self, spec: KeySpec, set: &RuleSet) -> Result<KeyEntry, KeyError> {
        let e = Self::validate_one(spec, set, |_| None)?;
        self.write_all(std::slice::from_ref(&e))?;
        Ok(e)
    }

    /// Delete one entry on disk; `false` when there was none.
    pub fn delete(&self, domain: &str, entries: &[(impl AsRef<str>, impl AsRef<str>)]) -> Result<bool, KeyError> {
        let Some(key) = lookup_key(domain, entries) else { return Ok(false) };
        Ok(self.commit_disk(&[Write { key, value: None }])?.first().copied().unwrap_or(false))
    }

    /// Delete one entry from the store; `false` when there was none.
    pub async fn remove(&self, domain: &str, entries: &[(impl AsRef<str>, impl AsRef<str>)]) -> Result<bool, KeyError> {
        let Some(key) = lookup_key(domain, entries) else { return Ok(false) };
        Ok(self.commit(vec![Write { key, value: None }]).await?.first().copied().unwrap_or(false))
    }

    /// One page of entries in (domain, descriptor) order: of `domain` (all
    /// domains when `None`) whose descriptor, written `key=value, key=value`,
    /// starts with `prefix` (or is exactly `prefix` with `exact`), after
    /// `cursor` (a page's `next_cursor`). Up to `limit`: with Redis a page
    /// may hold fewer while more follow (`next_cursor` says).
    pub async fn list(
        &self,
        domain: Option<&str>,
        prefix: &str,
        exact: bool,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<Page, KeyError> {
        let Some(sharded) = self.sharded.get() else { return self.page(domain, prefix, exact, cursor, limit) };
        let (rows, more) = match Scan::of(domain, prefix, exact, cursor)? {
            Scan::Exact(k) => (sharded.get(&k).await?.map(|v| vec![(k, v)]).unwrap_or_default(), false),
            Scan::Range { start, inclusive, within } => sharded.page(&start, inclusive, &within, limit).await?,
            Scan::Nothing => (Vec::new(), false),
        };
        self.page_of(rows, more)
    }

    /// [`PerKey::list`] on disk (not for entries kept in Redis).
    pub fn page(
        &self,
        domain: Option<&str>,
        prefix: &str,
        exact: bool,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<Page, KeyError> {
        let (rows, more) = match Scan::of(domain, prefix, exact, cursor)? {
            Scan::Exact(k) => (self.disk.get(&k)?.map(|v| vec![(k, v)]).unwrap_or_default(), false),
            Scan::Range { start, inclusive, within } => self.disk.page(&start, inclusive, &within, limit)?,
            Scan::Nothing => (Vec::new(), false),
        };
        self.page_of(rows, more)
    }

    /// A page of stored rows (one that does not decode is skipped, logged).
    fn page_of(&self, rows: Vec<(String, Vec<u8>)>, more: bool) -> Result<Page, KeyError> {
        let next_cursor = if more { rows.last().map(|(k, _)| hex(k)) } else { None };
        let entries = rows
            .into_iter()
            .filter_map(|(k, v)| match Stored::decode(&v) {
                Ok(s) => {
                    let at = s.updated_at;
                    Some((s.spec(&k), at))
                }
                Err(e) => {
                    tracing::warn!(entry = %k.replace(['\u{0}', '\u{1}'], " "), "a stored entry that does not decode is not listed: {e}");
                    None
                }
            })
            .collect();
        Ok(Page { entries, next_cursor })
    }

    /// Entries per `(domain, tier)` (tier empty for entries with their own
    /// limits), sorted.
    pub fn counts(&self) -> Vec<(String, String, u64)> {
        let counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        let mut out: Vec<_> = counts.iter().map(|((d, t), n)| (d.clone(), t.clone(), *n)).collect();
        out.sort();
        out
    }

    /// Every entry.
    pub fn total(&self) -> usize {
        let counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        usize::try_from(counts.values().sum::<u64>()).unwrap_or(usize::MAX)
    }

    /// Whether there are none (lookups can be skipped).
    pub fn is_empty(&self) -> bool {
        !self.all_domains.load(Relaxed) && self.domains.load().is_empty()
    }

    /// Answers cached now.
    pub fn cached(&self) -> usize {
        self.compact.len() + self.cache.len()
    }

    /// Bytes the cache holds now (its keys and answers, quick_cache's own
    /// accounting).
    pub fn cache_bytes(&self) -> usize {
        self.compact.bytes() + self.cache.memory_used().total()
    }

    /// The counters for the metrics.
    pub fn stats(&self) -> &KeyStats {
        &self.stats
    }

    /// Batches of misses read from Redis so far (0 on disk).
    pub fn read_batches(&self) -> u64 {
        self.sharded.get().map_or(0, |s| s.batches.load(Relaxed))
    }

    /// The errors a new rule set has against the entries: a tier named by
    /// entries that the rules `in_use` define and `set` no longer does. For
    /// the server's `Rules::add_check`: such a reload is refused. (A tier
    /// `in_use` lacks already, e.g. found so at startup, is no error: its
    /// entries get the files' rules, see [`PerKey::missing_tiers`].)
    pub fn check_rules(&self, set: &RuleSet, in_use: &RuleSet) -> Vec<ConfigError> {
        let mut errors = Vec::new();
        for (domain, tier, n) in self.counts() {
            if tier.is_empty()
                || n == 0
                || tier_of(set, &domain, &tier).is_some()
                || tier_of(in_use, &domain, &tier).is_none()
            {
                continue;
            }
            let d = set.domain(&domain);
            let (file, pos) = match d {
                Some(d) => (set.files().get(d.file()).cloned().unwrap_or_default(), d.pos()),
                None => (format!("(domain {domain})").into(), Pos::default()),
            };
            errors.push(ConfigError {
                file,
                pos,
                field: format!("tiers.{tier}"),
                message: format!(
                    "{n} per-key entries of domain `{domain}` name tier `{tier}`: keep it under `tiers:`, or move those entries to another tier first (floodgate keys export, then keys import)"
                ),
            });
        }
        errors
    }

    /// `(domain, tier, entries)` of tiers that entries name and `set` does
    /// not define (their keys get the files' rules).
    pub fn missing_tiers(&self, set: &RuleSet) -> Vec<(String, String, u64)> {
        self.counts().into_iter().filter(|(d, t, n)| !t.is_empty() && *n > 0 && tier_of(set, d, t).is_none()).collect()
    }

    /// Keep the entries in Redis from now on (`store`): reads, writes and
    /// listings go there, and the returned task (run it) reads misses in
    /// batches and keeps this instance's cache in step with every other
    /// instance's writes. Entries of an older layout are moved in first,
    /// once per Redis: the shared overrides of builds before tiers, else
    /// this instance's database.
    pub fn share(self: &Arc<Self>, store: RedisStore) -> impl std::future::Future<Output = ()> + Send + 'static {
        let sharded = Arc::new(Sharded::new(store));
        let _ = self.sharded.set(sharded.clone());
        if self.ttl.is_none() {
            self.ttl_ms.store(u64::try_from(DEFAULT_CACHE_TTL.as_millis()).unwrap_or(u64::MAX), Relaxed);
        }
        let ttl = self.ttl_ms.load(Relaxed);
        if ttl != u64::MAX {
            self.refresh_ms.store(ttl / REFRESH_SHARE, Relaxed);
        }
        // Until Redis's counts are read, every domain is looked up.
        self.all_domains.store(true, Relaxed);
        let this = self.clone();
        async move {
            tokio::join!(this.follow(&sharded), this.refresh_due(&sharded));
        }
    }

    /// Set up the layout, then follow the change channel for good:
    /// subscribe, drop the cache, refresh the counts; drop each message's
    /// keys from the cache; on losing the subscription, start over.
    async fn follow(&self, sharded: &Sharded) {
        let mut set_up = false;
        let mut lost_logged = false;
        loop {
            if !set_up {
                match self.set_up(sharded).await {
                    Ok(()) => set_up = true,
                    Err(e) => tracing::debug!("per-key layout in Redis not checked yet: {e}"),
                }
            }
            match sharded.store().subscribe(&sharded.channel).await {
                Ok(mut sub) => {
                    let n = self.stats.subscribed.fetch_add(1, Relaxed);
                    self.drop_all();
                    if n > 0 {
                        tracing::info!(
                            "per-key change notices from Redis resumed: the cache was dropped (changes meanwhile may have been missed)"
                        );
                    }
                    lost_logged = false;
                    if let Err(e) = self.refresh_counts().await {
                        tracing::debug!("per-key counts not read: {e}");
                    }
                    // Read after notices (at most every 250 ms), and every
                    // COUNTS_EVERY regardless.
                    let mut counts = tokio::time::interval(Duration::from_millis(250));
                    counts.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    let (mut noticed, mut counted) = (false, Instant::now());
                    let mut versions = tokio::time::interval(VERSIONS_EVERY);
                    versions.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    // The versions as of the subscription (the cache is empty).
                    let mut seen: Option<Vec<u64>> = None;
                    loop {
                        tokio::select! {
                            msg = sub.next() => match msg {
                                Some(payload) => {
                                    self.changed(&payload, seen.as_mut());
                                    noticed = true;
                                }
                                None => break,
                            },
                            _ = counts.tick(), if noticed || counted.elapsed() >= COUNTS_EVERY => {
                                noticed = false;
                                counted = Instant::now();
                                if let Err(e) = self.refresh_counts().await {
                                    tracing::debug!("per-key counts not read: {e}");
                                }
                            }
                            _ = versions.tick() => match sharded.versions().await {
                                Ok(now) => self.check_versions(&mut seen, now),
                                Err(e) => tracing::debug!("per-key shard versions not read: {e}"),
                            },
                        }
                    }
                }
                Err(e) if !lost_logged => {
                    lost_logged = true;
                    tracing::warn!(
                        "per-key change notices from Redis unavailable: {e}; cached answers serve until their time to live, and the cache is dropped once they resume"
                    );
                }
                Err(_) => {}
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// A change notice (`shard:version:["lookup key", …]`): its keys leave
    /// the cache, and its shard's version is noted as seen.
    fn changed(&self, payload: &[u8], seen: Option<&mut Vec<u64>>) {
        let parsed = std::str::from_utf8(payload).ok().and_then(|p| {
            let mut parts = p.splitn(3, ':');
            let shard: usize = parts.next()?.parse().ok().filter(|s| *s < SHARDS)?;
            let version: u64 = parts.next()?.parse().ok()?;
            let keys: Vec<String> = serde_json::from_str(parts.next()?).ok()?;
            Some((shard, version, keys))
        });
        match parsed {
            Some((shard, version, keys)) => {
                self.forget(keys.iter().map(String::as_str));
                self.stats.notices.fetch_add(1, Relaxed);
                if let Some(seen) = seen {
                    // Notices of one shard come in order (one node
                    // publishes them): a gap is a lost notice.
                    if version > seen[shard] + 1 {
                        self.drop_shards(&[shard]);
                    }
                    seen[shard] = seen[shard].max(version);
                }
            }
            None => {
                tracing::warn!("a per-key change notice that does not parse: the cache is dropped");
                self.drop_all();
            }
        }
    }

    /// The shards' versions read now against those seen: a shard that
    /// moved past its last notice lost one, and its cached answers go.
    fn check_versions(&self, seen: &mut Option<Vec<u64>>, now: Vec<u64>) {
        let Some(seen) = seen else {
            *seen = Some(now);
            return;
        };
        let behind: Vec<usize> = (0..SHARDS).filter(|&s| now[s] > seen[s]).collect();
        if behind.is_empty() {
            return;
        }
        // A notice may also be on its way still: dropping early costs a
        // read per key, never a stale answer.
        self.drop_shards(&behind);
        for s in behind {
            seen[s] = now[s];
        }
    }

    /// Drop the cached answers of these shards (they changed with no
    /// notice).
    fn drop_shards(&self, shards: &[usize]) {
        self.stats.missed_notices.fetch_add(shards.len() as u64, Relaxed);
        tracing::debug!(?shards, "per-key shards changed with no notice: their cached answers are dropped");
        self.dropping(|| {
            self.compact.retain_shards(|s| !shards.contains(&s));
            self.cache.retain(|k, _| !shards.contains(&sharded::shard_of(k.as_str())));
        });
    }

    /// Drop every cached answer.
    fn drop_all(&self) {
        self.dropping(|| {
            self.compact.clear();
            self.cache.clear();
        });
    }

    /// Take answers out of the caches with `drop`, in the order both
    /// guards need: the epoch first (a miss whose read began before is then
    /// not kept in the compact table), the generation after (every
    /// thread's front copies go too, and none read before is used again).
    fn dropping(&self, drop: impl FnOnce()) {
        self.epoch.fetch_add(1, Release);
        drop();
        self.generation.fetch_add(1, Release);
    }

    /// Move entries of an older layout into the sharded one, once per
    /// Redis (a marker key says it was done): the shared map of builds
    /// before tiers (`<prefix>{overrides}`), else this instance's database.
    async fn set_up(&self, sharded: &Sharded) -> Result<(), KeyError> {
        if sharded.is_set_up().await? {
            return Ok(());
        }
        let old = sharded.store().shared_map("overrides");
        let (version, rows) = old.load().await.map_err(|e| KeyError::Shared(e.to_string()))?;
        let mut moved = 0;
        if version > 0 {
            let mut writes = Vec::with_capacity(rows.len());
            for (field, text) in &rows {
                match Write::legacy(text) {
                    Ok(w) => writes.push(w),
                    Err(e) => tracing::warn!("shared override {field:?} not moved: {e}"),
                }
            }
            for chunk in writes.chunks(MAX_BATCH) {
                sharded.apply(chunk).await?;
                moved += chunk.len();
            }
            tracing::info!(
                entries = moved,
                "moved the shared runtime overrides into the sharded per-key entries in Redis"
            );
        } else {
            let mut cursor = None;
            loop {
                let page = self.page(None, "", false, cursor.as_deref(), 1_000)?;
                let writes: Vec<Write> = page.entries.iter().filter_map(|(spec, at)| Write::of(spec, *at)).collect();
                sharded.apply(&writes).await?;
                moved += writes.len();
                match page.next_cursor {
                    Some(c) => cursor = Some(c),
                    None => break,
                }
            }
            if moved > 0 {
                tracing::info!(entries = moved, "Redis held no per-key entries: uploaded this instance's");
            }
        }
        sharded.mark_set_up().await
    }
}

/// How often the per-tier counts are read from Redis besides after change
/// notices.
const COUNTS_EVERY: Duration = Duration::from_secs(5);

/// The writes of validated entries.
fn writes_of(entries: &[KeyEntry]) -> Result<Vec<Write>, KeyError> {
    entries
        .iter()
        .map(|e| {
            Write::of(&e.spec, e.updated_at)
                .ok_or_else(|| KeyError::Invalid("a control character in the descriptor".into()))
        })
        .collect()
}

/// What one page of a listing reads.
enum Scan {
    /// One lookup key (an exact descriptor).
    Exact(String),
    /// Keys from `start` (inclusive or not) while they start with `within`.
    Range { start: String, inclusive: bool, within: String },
    /// Nothing (past an exact descriptor's page).
    Nothing,
}

impl Scan {
    /// The read of a listing of `domain` (all when `None`) under `prefix`
    /// (exactly it with `exact`), after `cursor`.
    fn of(domain: Option<&str>, prefix: &str, exact: bool, cursor: Option<&str>) -> Result<Self, KeyError> {
        let within = match domain {
            Some(d) => value::listing_start(d, prefix)?,
            None if prefix.is_empty() => String::new(),
            None => return Err(KeyError::Invalid("prefix: give domain too".into())),
        };
        let after = cursor.map(unhex).transpose()?;
        Ok(match after {
            Some(a) if exact && a >= within => Self::Nothing,
            _ if exact => Self::Exact(within),
            Some(a) if a >= within => Self::Range { start: a, inclusive: false, within },
            _ => Self::Range { start: within.clone(), inclusive: true, within },
        })
    }
}

/// A cheap random number (xorshift, per thread, seeded by the clock).
fn random() -> u64 {
    use std::cell::Cell;
    thread_local!(static STATE: Cell<u64> = Cell::new(
        SystemTime::now().duration_since(UNIX_EPOCH).map_or(0x9e37_79b9, |d| d.as_nanos() as u64) | 1
    ));
    STATE.with(|s| {
        let mut x = s.get();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.set(x);
        x
    })
}

/// Seconds since the Unix epoch.
fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn hex(s: &str) -> String {
    s.bytes().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Result<String, KeyError> {
    let bad = || KeyError::Invalid("cursor: give a page's next_cursor as it was".into());
    if !s.len().is_multiple_of(2) {
        return Err(bad());
    }
    let bytes: Vec<u8> = (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16))
        .collect::<Result<_, _>>()
        .map_err(|_| bad())?;
    String::from_utf8(bytes).map_err(|_| bad())
}

/// Check a spec and build its entry (a tier is not checked against the
/// rules here: [`PerKey::validate`] does that).
fn build(spec: KeySpec, updated_at: u64) -> Result<KeyEntry, KeyError> {
    let bad = |m: String| Err(KeyError::Invalid(m));
    if spec.domain.is_empty() || spec.domain.len() > MAX_TEXT {
        return bad(format!("domain must be 1 to {MAX_TEXT} bytes"));
    }
    check_text("domain", &spec.domain)?;
    if spec.descriptor.is_empty() || spec.descriptor.len() > MAX_ENTRIES {
        return bad(format!(
            "descriptor must have 1 to {MAX_ENTRIES} entries, e.g. [{{\"key\": \"user\", \"value\": \"alice\"}}]"
        ));
    }
    for (i, e) in spec.descriptor.iter().enumerate() {
        if e.key.is_empty() || e.key.len() > MAX_TEXT || e.value.len() > MAX_TEXT {
            return bad(format!("descriptor[{i}]: key must be 1 to {MAX_TEXT} bytes and value at most {MAX_TEXT}"));
        }
        check_text(&format!("descriptor[{i}]"), &e.key)?;
        check_text(&format!("descriptor[{i}]"), &e.value)?;
    }
    if let Some(n) = &spec.name
        && (n.is_empty() || n.len() > 64)
    {
        return bad("name must be 1 to 64 bytes (it labels the entry's decisions in metrics)".into());
    }
    let limits = match (&spec.tier, &spec.limits) {
        (Some(t), None) => {
            check_tier_name(t).map_err(|e| KeyError::Invalid(e.to_string()))?;
            Limits::Tier(value::intern_tier(t)?)
        }
        (None, Some(limits)) => own_limits(limits, spec.name.as_deref())?,
        (Some(_), Some(_)) => return bad("give either tier or limits, not both".into()),
        (None, None) => {
            return bad(
                "give tier (a tier of the domain's rules file, e.g. \"tier\": \"pro\") or limits (e.g. \"limits\": {\"unit\": \"second\", \"requests_per_unit\": 5})"
                    .into(),
            );
        }
    };
    Ok(KeyEntry { spec, limits, updated_at })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A miss's read that began before a write (its epoch taken, then the
    /// write, then the answer offered to the compact table) is not kept:
    /// on disk no time to live would ever take it out.
    #[test]
    fn a_read_from_before_a_write_is_not_kept() {
        let dir = std::env::temp_dir().join(format!("fg-perkey-epoch-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let o = PerKey::open(dir.join("o.redb")).unwrap();
        let key = "api\0user\u{1}alice";
        let epoch = o.epoch.load(Acquire);
        let old: Option<Limits> = None;
        o.forget(std::iter::once(key));
        let at = o.compact.place(key);
        assert!(matches!(o.keep_compact(key, at, &old, u64::MAX, epoch), Kept::Raced), "raced a write");
        assert!(o.compact_hit(at).is_none());
        let epoch = o.epoch.load(Acquire);
        assert!(matches!(o.keep_compact(key, at, &old, u64::MAX, epoch), Kept::Yes(0)), "no write since");
        assert!(o.compact_hit(at).is_some());
        drop(o);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
