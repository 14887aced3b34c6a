//! Per-key limits: a limit for one exact descriptor (`user=alice` in domain
//! `api`), by naming a tier of the domain's rules file or by giving its own
//! limits, taking precedence over the files. Millions of them: they live on
//! disk ([`disk`]), and the decision path reads them through a bounded
//! cache that also holds "no entry" answers.
//!
//! * **Lookups.** A domain without entries costs one set lookup. Otherwise
//!   the descriptor's lookup key is looked up in the cache
//!   ([quick_cache]: S3-FIFO eviction, sharded, `--key-cache` entries); a
//!   miss reads the database on the deciding thread (a B-tree descent: a
//!   few microseconds from the OS page cache; redb readers take no lock
//!   that writers or other readers hold) and caches the answer, entry or
//!   none. Concurrent misses for one key wait for the first one's read:
//!   one read per key. A cached answer older than the time to live
//!   (`--key-cache-ttl`, default 60 s) is read again.
//! * **Writes** go to the database first (durable when they return), then
//!   drop that one key from the cache: the next lookup reads the new entry.
//!   A batch (`keys import`) is one transaction: all of it or none.
//! * **Tiers** are resolved at decision time against the rules in use, so a
//!   tier edited in its rules file applies to every key on it at once. An
//!   entry naming an unknown tier is refused when written; one found anyway
//!   (the tier's file edited by hand, another instance's write) falls back
//!   to the files' rules, with a warning and a metric.
//! * **Counts.** The database keeps the number of entries per (domain,
//!   tier), updated in each write's transaction. A reload that would remove
//!   a tier still named by entries is refused ([`PerKey::check_rules`]).
//!
//! With the Redis store the entries are shared ([`PerKey::share`]): Redis
//! holds them (`floodgate_redis::SharedMap`), every instance polls its
//! version every 250 ms and mirrors it to its database on a change, and a
//! write through the admin API goes to Redis first (when Redis fails, it
//! fails with 503 and changes nothing). Sharing holds at most
//! [`MAX_SHARED`] entries until the sharded Redis store lands.

mod disk;

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwap;
use floodgate_core::rules::{
    ConfigError, ConfigErrors, Pos, Rule, RuleSet, check_tier_name, counter_key, parse_limits,
};
use floodgate_redis::SharedMap;
use quick_cache::sync::{Cache, GuardResult};
use serde::{Deserialize, Serialize};

pub use disk::{DB_CACHE_BYTES, lookup_key};
use disk::{Disk, Stored, Write};

/// Most entries in an entry's descriptor.
pub const MAX_ENTRIES: usize = 64;
/// Longest domain, key or value, in bytes.
pub const MAX_TEXT: usize = 1_024;
/// Most entries one batch (one `keys import` request) writes.
pub const MAX_BATCH: usize = 10_000;
/// Most entries shared through Redis (the shared map is loaded whole).
pub const MAX_SHARED: usize = 100_000;
/// Cached answers by default.
pub const DEFAULT_CACHE_ENTRIES: usize = 100_000;
/// How long a cached answer is used by default.
pub const DEFAULT_CACHE_TTL: Duration = Duration::from_secs(60);
/// The metrics label of entries with their own limits and no `name`.
pub const PER_KEY_LABEL: &str = "per-key";

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
/// use floodgate_server::rules::perkey::KeySpec;
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

/// What an entry's limits are.
#[derive(Debug, Clone)]
pub enum Limits {
    /// The named tier of the domain, as the rules in use define it.
    Tier(Arc<str>),
    /// Its own, validated.
    Own(Vec<Rule>),
}

/// A stored entry, validated.
#[derive(Debug, Clone)]
pub struct KeyEntry {
    /// As written.
    pub spec: KeySpec,
    /// Its limits.
    pub limits: Limits,
    /// Seconds since the Unix epoch.
    pub updated_at: u64,
    key: String,
}

impl KeyEntry {
    /// The counter key of its `i`th limit: distinct from any file rule's
    /// (an entry starts its own counters and leaves the files' intact), and
    /// from other tiers' (moving a key to another tier starts it afresh).
    pub fn counter_key(&self, i: usize) -> String {
        match &self.limits {
            Limits::Tier(t) => format!("{}@tier:{t}#{i}", self.key),
            Limits::Own(_) => format!("{}@override#{i}", self.key),
        }
    }

    /// Its limits under the rules `set`: its own, or its tier's (`None` when
    /// the domain has no such tier).
    pub fn rules_in<'a>(&'a self, set: &'a RuleSet) -> Option<&'a [Rule]> {
        match &self.limits {
            Limits::Own(rules) => Some(rules),
            Limits::Tier(t) => tier_of(set, &self.spec.domain, t).map(|t| t.rules.as_slice()),
        }
    }
}

/// The tier `tier` of `domain` in the rules `set`, if defined.
fn tier_of<'a>(set: &'a RuleSet, domain: &str, tier: &str) -> Option<&'a floodgate_core::rules::Tier> {
    set.domain(domain)?.tier(tier)
}

/// Why an entry could not be set, deleted or read.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// The request itself is wrong (400).
    #[error("{0}")]
    Invalid(String),
    /// The limits do not validate (400), each error positioned in the
    /// limits' JSON.
    #[error("invalid limits:\n{0}")]
    Limits(ConfigErrors),
    /// The database failed (500); nothing changed.
    #[error("per-key storage failed: {0}")]
    Storage(String),
    /// The database file is open in another process (redb locks it).
    #[error(
        "{0} is open in another floodgate process: give each instance its own --overrides-file (or leave the flag out: each instance then gets its own file under --state-dir)"
    )]
    InUse(String),
    /// Entries are shared through Redis, which failed (503); nothing
    /// changed.
    #[error("per-key entries are shared through Redis, which failed: {0}; nothing changed, try again")]
    Shared(String),
}

fn storage(e: impl std::fmt::Display) -> KeyError {
    KeyError::Storage(e.to_string())
}

/// The cache's size and time to live.
#[derive(Debug, Clone, Copy)]
pub struct CacheOptions {
    /// Most cached answers (entries and "no entry" alike).
    pub entries: usize,
    /// How long a cached answer is used before it is read again.
    pub ttl: Duration,
}

impl Default for CacheOptions {
    fn default() -> Self {
        Self { entries: DEFAULT_CACHE_ENTRIES, ttl: DEFAULT_CACHE_TTL }
    }
}

/// A cached answer: the entry, or none, and when it was read.
#[derive(Clone)]
struct Cached {
    entry: Option<Arc<KeyEntry>>,
    read_at: Instant,
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
    pub hits: AtomicU64,
    /// Lookups that read the database.
    pub misses: AtomicU64,
    /// Decisions whose entry named a tier the rules do not define.
    pub unknown_tier: AtomicU64,
    /// Stored entries that could not be read or no longer validate.
    pub bad_entries: AtomicU64,
}

/// The per-key store.
pub struct PerKey {
    disk: Disk,
    cache: Cache<String, Cached>,
    ttl: Duration,
    /// Domains with at least one entry (most requests skip the cache).
    domains: ArcSwap<HashSet<Box<str>>>,
    /// `(domain, tier)` → entries (tier empty for own limits).
    counts: Mutex<HashMap<(String, String), u64>>,
    write: Mutex<()>,
    shared: OnceLock<SharedMap>,
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
            cache: Cache::new(cache.entries.max(1)),
            ttl: cache.ttl,
            domains: ArcSwap::default(),
            counts: Mutex::default(),
            write: Mutex::new(()),
            shared: OnceLock::new(),
            warned: Mutex::default(),
            stats: KeyStats::default(),
        };
        this.refresh_counts()?;
        Ok(this)
    }

    /// Reload the per-tier counts (and the domains with entries) from disk.
    fn refresh_counts(&self) -> Result<(), KeyError> {
        let rows = self.disk.counts()?;
        let domains = rows.iter().filter(|r| r.2 > 0).map(|r| Box::from(r.0.as_str())).collect();
        let counts = rows.into_iter().map(|(d, t, n)| ((d, t), n)).collect();
        *self.counts.lock().unwrap_or_else(PoisonError::into_inner) = counts;
        self.domains.store(Arc::new(domains));
        Ok(())
    }

    /// The entry of exactly this descriptor, if any (through the cache).
    pub fn get(&self, domain: &str, entries: &[(impl AsRef<str>, impl AsRef<str>)]) -> Option<Arc<KeyEntry>> {
        if !self.domains.load().contains(domain) {
            return None;
        }
        let key = lookup_key(domain, entries)?;
        for _ in 0..2 {
            match self.cache.get_value_or_guard(&key, None) {
                GuardResult::Value(c) if c.read_at.elapsed() < self.ttl => {
                    self.stats.hits.fetch_add(1, Relaxed);
                    return c.entry;
                }
                GuardResult::Value(_) => {
                    // Past its time to live: read it again.
                    self.cache.remove(&key);
                }
                GuardResult::Guard(g) => {
                    let read_at = Instant::now();
                    let entry = self.read(&key).ok()?;
                    // Fails when a write removed the placeholder meanwhile:
                    // the next lookup reads the new entry.
                    let _ = g.insert(Cached { entry: entry.clone(), read_at });
                    return entry;
                }
                GuardResult::Timeout => break,
            }
        }
        self.read(&key).ok().flatten()
    }

    /// Read one entry from the database (a miss). A stored entry that no
    /// longer validates is counted, logged and treated as none.
    fn read(&self, key: &str) -> Result<Option<Arc<KeyEntry>>, KeyError> {
        self.stats.misses.fetch_add(1, Relaxed);
        let stored = self.disk.get(key).inspect_err(|e| {
            self.stats.bad_entries.fetch_add(1, Relaxed);
            tracing::warn!("a per-key entry could not be read: {e}; the files' rules apply");
        })?;
        let Some(stored) = stored else { return Ok(None) };
        let updated_at = stored.updated_at;
        match build(stored.spec(key), updated_at) {
            Ok(e) => Ok(Some(Arc::new(e))),
            Err(e) => {
                self.stats.bad_entries.fetch_add(1, Relaxed);
                tracing::warn!(entry = %key.replace(['\u{0}', '\u{1}'], " "), "a stored per-key entry is ignored: {e}");
                Ok(None)
            }
        }
    }

    /// Note a decision whose entry names a tier the rules do not define:
    /// counted, and logged once per (domain, tier).
    pub fn unknown_tier(&self, entry: &KeyEntry) {
        self.stats.unknown_tier.fetch_add(1, Relaxed);
        let Limits::Tier(t) = &entry.limits else { return };
        let first = self
            .warned
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert((entry.spec.domain.clone(), t.to_string()));
        if first {
            tracing::warn!(
                domain = %entry.spec.domain,
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

    /// Write validated entries ([`PerKey::validate`]) in one transaction,
    /// through Redis first when shared.
    pub async fn put_all(&self, entries: &[KeyEntry]) -> Result<usize, KeyError> {
        if let Some(map) = self.shared.get() {
            if self.total() + entries.len() > MAX_SHARED {
                return Err(KeyError::Invalid(format!(
                    "entries shared through Redis stop at {MAX_SHARED} for now: delete some first"
                )));
            }
            for e in entries {
                map.set(&e.key, &shared_text(&e.spec, e.updated_at)?)
                    .await
                    .map_err(|e| KeyError::Shared(e.to_string()))?;
            }
        }
        self.write_all(entries)
    }

    /// Write validated entries locally, in one transaction.
    pub fn write_all(&self, entries: &[KeyEntry]) -> Result<usize, KeyError> {
        let writes: Vec<Write> = entries
            .iter()
            .map(|e| {
                let key = lookup_key(&e.spec.domain, &e.spec.entries())
                    .ok_or_else(|| KeyError::Invalid("a control character in the descriptor".into()))?;
                Ok(Write::Put(key, Stored::of(&e.spec, e.updated_at)))
            })
            .collect::<Result<_, KeyError>>()?;
        self.commit(&writes)?;
        Ok(entries.len())
    }

    /// Apply writes, then refresh the counts and drop the written keys from
    /// the cache (in that order: a lookup after the drop reads the new
    /// state, and sees its domain). Whether each key held an entry before.
    fn commit(&self, writes: &[Write]) -> Result<Vec<bool>, KeyError> {
        let _guard = self.write.lock().unwrap_or_else(PoisonError::into_inner);
        let before = self.disk.apply(writes, |_| Ok(()))?;
        self.refresh_counts()?;
        for w in writes {
            let (Write::Put(k, _) | Write::Delete(k)) = w;
            self.cache.remove(k);
        }
        Ok(before.iter().map(Option::is_some).collect())
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

    /// Set one entry (validated against `set`), through Redis first when
    /// shared.
    pub async fn put(&self, spec: KeySpec, set: &RuleSet, regions: usize) -> Result<Arc<KeyEntry>, KeyError> {
        let e = Self::validate_one(spec, set, |r| crate::runtime::regions::check_rule(r, regions))?;
        self.put_all(std::slice::from_ref(&e)).await?;
        Ok(Arc::new(e))
    }

    /// Set one entry locally (validated against `set`); durable when this
    /// returns.
    pub fn set(&self, spec: KeySpec, set: &RuleSet) -> Result<Arc<KeyEntry>, KeyError> {
        let e = Self::validate_one(spec, set, |_| None)?;
        self.write_all(std::slice::from_ref(&e))?;
        Ok(Arc::new(e))
    }

    /// Delete one entry locally; `false` when there was none.
    pub fn delete(&self, domain: &str, entries: &[(impl AsRef<str>, impl AsRef<str>)]) -> Result<bool, KeyError> {
        let Some(key) = lookup_key(domain, entries) else { return Ok(false) };
        Ok(self.commit(&[Write::Delete(key)])?.first().copied().unwrap_or(false))
    }

    /// Delete one entry, through Redis first when shared.
    pub async fn remove(&self, domain: &str, entries: &[(impl AsRef<str>, impl AsRef<str>)]) -> Result<bool, KeyError> {
        if let Some(map) = self.shared.get() {
            let Some(key) = lookup_key(domain, entries) else { return Ok(false) };
            if self.disk.get(&key)?.is_none() {
                return Ok(false);
            }
            map.remove(&counter_key(domain, entries)).await.map_err(|e| KeyError::Shared(e.to_string()))?;
        }
        self.delete(domain, entries)
    }

    /// One page of entries in (domain, descriptor) order: of `domain` (all
    /// domains when `None`) whose descriptor, written `key=value, key=value`,
    /// starts with `prefix` (or is exactly `prefix` with `exact`), after
    /// `cursor` (a page's `next_cursor`).
    pub fn page(
        &self,
        domain: Option<&str>,
        prefix: &str,
        exact: bool,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<Page, KeyError> {
        let within = match domain {
            Some(d) => disk::listing_start(d, prefix)?,
            None if prefix.is_empty() => String::new(),
            None => return Err(KeyError::Invalid("prefix: give domain too".into())),
        };
        let after = cursor.map(unhex).transpose()?;
        let (rows, more) = if exact {
            let rows = match self.disk.get(&within)? {
                Some(s) if after.as_deref().is_none_or(|a| a < within.as_str()) => vec![(within.clone(), s)],
                _ => Vec::new(),
            };
            (rows, false)
        } else {
            match &after {
                Some(a) if a.as_str() >= within.as_str() => self.disk.page(a, false, &within, limit)?,
                _ => self.disk.page(&within, true, &within, limit)?,
            }
        };
        let next_cursor = if more { rows.last().map(|(k, _)| hex(k)) } else { None };
        let entries = rows
            .into_iter()
            .map(|(k, s)| {
                let at = s.updated_at;
                (s.spec(&k), at)
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

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.domains.load().is_empty()
    }

    /// Answers cached now.
    pub fn cached(&self) -> usize {
        self.cache.len()
    }

    /// The counters for the metrics.
    pub fn stats(&self) -> &KeyStats {
        &self.stats
    }

    /// The errors a new rule set has against the entries: a tier named by
    /// entries that the rules `in_use` define and `set` no longer does. For
    /// [`Rules::add_check`]: such a reload is refused. (A tier `in_use`
    /// lacks already, e.g. found so at startup, is no error: its entries get
    /// the files' rules, see [`PerKey::missing_tiers`].)
    ///
    /// [`Rules::add_check`]: crate::rules::reload::Rules::add_check
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

    /// Share the entries through Redis from now on: changes go to `map`
    /// first, and the returned task (run it) keeps this instance in step
    /// with the others.
    pub fn share(self: &Arc<Self>, map: SharedMap) -> impl std::future::Future<Output = ()> + Send + 'static {
        let _ = self.shared.set(map.clone());
        let this = self.clone();
        async move {
            let mut seen: Option<u64> = None;
            let mut tick = tokio::time::interval(Duration::from_millis(250));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                match this.sync(&map, seen).await {
                    Ok(v) => seen = Some(v),
                    Err(e) => tracing::debug!("per-key entries not synced from Redis: {e}"),
                }
            }
        }
    }

    /// One sync step: mirror Redis's entries when its version moved since
    /// `seen`; the version now.
    async fn sync(&self, map: &SharedMap, seen: Option<u64>) -> Result<u64, KeyError> {
        let shared = |e: floodgate_core::StoreError| KeyError::Shared(e.to_string());
        let version = map.version().await.map_err(shared)?;
        if seen == Some(version) {
            return Ok(version);
        }
        if version == 0 && seen.is_none() {
            // Redis never held entries: upload ours.
            let mut cursor = None;
            loop {
                let page = self.page(None, "", false, cursor.as_deref(), 1_000)?;
                for (spec, at) in &page.entries {
                    map.set(&counter_key(&spec.domain, &spec.entries()), &shared_text(spec, *at)?)
                        .await
                        .map_err(shared)?;
                }
                match page.next_cursor {
                    Some(c) => cursor = Some(c),
                    None => break,
                }
            }
        }
        let (version, rows) = map.load().await.map_err(shared)?;
        #[derive(Deserialize)]
        struct SharedEntry {
            spec: KeySpec,
            updated_at: u64,
        }
        let mut writes = Vec::with_capacity(rows.len());
        let mut keep = HashSet::with_capacity(rows.len());
        for (field, text) in &rows {
            let parsed = serde_json::from_str::<SharedEntry>(text).map_err(|e| e.to_string()).and_then(|s| {
                let key = lookup_key(&s.spec.domain, &s.spec.entries()).ok_or("a control character")?;
                Ok((key, Stored::of(&s.spec, s.updated_at)))
            });
            match parsed {
                Ok((key, stored)) => {
                    keep.insert(key.clone());
                    writes.push(Write::Put(key, stored));
                }
                Err(e) => tracing::warn!("shared per-key entry {field:?} skipped: {e}"),
            }
        }
        for key in self.disk.all_keys()? {
            if !keep.contains(&key) {
                writes.push(Write::Delete(key));
            }
        }
        {
            let _guard = self.write.lock().unwrap_or_else(PoisonError::into_inner);
            if let Err(e) = self.disk.apply(&writes, |_| Ok(())) {
                tracing::warn!("per-key entries from Redis not mirrored to disk: {e}");
            }
            self.refresh_counts()?;
            self.cache.clear();
        }
        Ok(version)
    }
}

/// Seconds since the Unix epoch.
fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// An entry as the shared map holds it (the pre-tier overrides' format,
/// which older instances read too).
fn shared_text(spec: &KeySpec, updated_at: u64) -> Result<String, KeyError> {
    serde_json::to_string(&serde_json::json!({ "spec": spec, "updated_at": updated_at })).map_err(storage)
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
    disk::check_text("domain", &spec.domain)?;
    if spec.descriptor.is_empty() || spec.descriptor.len() > MAX_ENTRIES {
        return bad(format!(
            "descriptor must have 1 to {MAX_ENTRIES} entries, e.g. [{{\"key\": \"user\", \"value\": \"alice\"}}]"
        ));
    }
    for (i, e) in spec.descriptor.iter().enumerate() {
        if e.key.is_empty() || e.key.len() > MAX_TEXT || e.value.len() > MAX_TEXT {
            return bad(format!("descriptor[{i}]: key must be 1 to {MAX_TEXT} bytes and value at most {MAX_TEXT}"));
        }
        disk::check_text(&format!("descriptor[{i}]"), &e.key)?;
        disk::check_text(&format!("descriptor[{i}]"), &e.value)?;
    }
    if let Some(n) = &spec.name
        && (n.is_empty() || n.len() > 64)
    {
        return bad("name must be 1 to 64 bytes (it labels the entry's decisions in metrics)".into());
    }
    let key = counter_key(&spec.domain, &spec.entries());
    let limits = match (&spec.tier, &spec.limits) {
        (Some(t), None) => {
            check_tier_name(t).map_err(KeyError::Invalid)?;
            Limits::Tier(Arc::from(t.as_str()))
        }
        (None, Some(limits)) => {
            let text = serde_json::to_string(limits).map_err(storage)?;
            let label = spec.name.as_deref().unwrap_or(PER_KEY_LABEL);
            Limits::Own(parse_limits("limits", &text, label).map_err(KeyError::Limits)?)
        }
        (Some(_), Some(_)) => return bad("give either tier or limits, not both".into()),
        (None, None) => {
            return bad(
                "give tier (a tier of the domain's rules file, e.g. \"tier\": \"pro\") or limits (e.g. \"limits\": {\"unit\": \"second\", \"requests_per_unit\": 5})"
                    .into(),
            );
        }
    };
    Ok(KeyEntry { spec, limits, updated_at, key })
}
