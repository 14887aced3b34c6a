//! Per-key limits: a limit for one exact descriptor (`user=alice` in domain
//! `api`), by naming a tier of the domain's rules file or by giving its own
//! limits, taking precedence over the files. Millions of them: they live in
//! a store (`disk` on one node; `sharded`, Redis or a Redis Cluster,
//! when instances share a Redis store), and the decision path reads them
//! through a bounded cache that also holds "no entry" answers.
//!
//! * **Lookups.** A domain without entries costs one set lookup. Otherwise
//!   the descriptor's lookup key is looked up in the cache: first the
//!   compact table (`cache::compact`: "no entry" or a tier, seven answers to a
//!   128-byte bucket, each kept as a 64-bit keyed fingerprint of its key
//!   and one word, `--key-cache` answers, least frequently used with
//!   aging), then for answers with their own limits [quick_cache]
//!   (S3-FIFO eviction, sharded, `--key-cache` answers, about
//!   [`BYTES_PER_ANSWER`] bytes each). A cached answer is the entry's
//!   limits only: a tier (one copy of its name per process) or its own
//!   parsed limits. Concurrent misses for one key cost one read: on disk
//!   the later ones wait on the key's stripe (`PerKey::stripe`) and find
//!   the first one's answer; with Redis they wait on quick_cache's
//!   placeholder. With Redis, a cached answer older than the time to live
//!   (`--key-cache-ttl`, default 5 min, less up to a fifth at random) is
//!   read again, and a compact answer hit in the last half of it is read
//!   again before then, in the background ([`REFRESH_SHARE`]); on disk
//!   answers expire only when the flag is given (every write goes through
//!   this process, which drops its key).
//! * **Misses.** On disk, a miss reads the hash index beside the database
//!   (`disk/index.rs`: one `pread`), or the database for keys written since the
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
//!
//! Where the code is: `entries/` (what an entry is, its checks, its stored
//! form), `cache/` (lookups: the per-thread front, the compact table, the
//! general cache, misses and refreshes), `disk/` (redb and the hash index),
//! `sharded/` (the entries in Redis, read in batches, and following the
//! other instances' changes), `writes.rs`, `listing.rs`; this file holds
//! the store itself, its settings and its counters.

mod cache;
mod disk;
mod entries;
mod listing;
mod sharded;
mod striped;
mod writes;

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwap;
use floodgate_core::rules::{ConfigError, Pos, RuleSet};
use quick_cache::sync::Cache;

use cache::{CacheKey, Cached, Due, STRIPES, compact};
pub use cache::{CacheOptions, FRONT_BYTES};
pub use disk::DB_CACHE_BYTES;
use disk::Disk;
pub use entries::{Entry, KeyEntry, KeySpec, Limits, MAX_TIER_NAMES, lookup_key};
use entries::{Write, tier_of};
pub use listing::Page;
pub use sharded::SHARDS;
use sharded::Sharded;
use striped::Padded;
pub use striped::Striped;

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
/// background (`PerKey::refresh_due`): an answer in use is renewed before
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
/// (BENCHMARKS.md, "Per-key limits: 10 million entries against none").
pub const BYTES_PER_ANSWER: usize = 170;
/// Most answers `--key-cache` may give (the compact table for them is
/// allocated whole: 64 GiB here).
pub const MAX_CACHE_ENTRIES: usize = 1 << 30;
/// Memory per answer of the compact table (tiers and "no entry"): its
/// line and its bucket's share of the versions. The cache's share of the
/// RSS bound is `--key-cache` × this, plus [`BYTES_PER_ANSWER`] for each
/// answer in the general cache.
pub const BYTES_PER_COMPACT_ANSWER: usize = compact::BYTES_PER_BUCKET.div_ceil(compact::WAYS);

/// A lookup the caches cannot answer ([`PerKey::cached_answer`]): it needs a
/// Redis read.
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
    /// Disk misses and writes, by stripes of keys (`PerKey::stripe`).
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
    /// Redis: `PerKey::refresh_due`).
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
