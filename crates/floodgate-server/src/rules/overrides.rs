//! Runtime overrides: per-descriptor limits set while running, taking
//! precedence over the rules files, persisted on disk.
//!
//! An override names one exact descriptor (a domain and its `(key, value)`
//! entries) and gives its limits in the form of a `rate_limit` block (or a
//! list of them), validated exactly as in a rules file. They live in an
//! embedded database ([redb]: ACID, copy-on-write, fsync on commit, so a
//! crash mid-write leaves the last committed state, never a torn one) and in
//! an in-memory copy that readers use without locking. Writes are
//! serialised; each is durable before it is visible.
//!
//! When the database cannot be written (disk full, permissions), `set` and
//! `delete` fail and change nothing; reads keep answering from memory.
//!
//! With the Redis store, overrides are shared ([`Overrides::share`]): Redis
//! holds them (a hash and a version, see `floodgate_redis::SharedMap`),
//! every instance polls the version every 250 ms and reloads on a change
//! (so a change reaches every instance within a second), and the local
//! database keeps a mirror, so an instance that starts while Redis is down
//! serves the last overrides it saw. A change through the admin API goes to
//! Redis first: when Redis fails, it fails (503) and changes nothing. On
//! the first sync with a Redis that has never held overrides, this
//! instance's overrides are uploaded.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwap;
use floodgate_core::rules::{ConfigErrors, Rule, counter_key, parse_limits};
use floodgate_redis::SharedMap;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};

const TABLE: TableDefinition<&str, &str> = TableDefinition::new("overrides");

/// Most entries in an override's descriptor.
pub const MAX_ENTRIES: usize = 64;
/// Longest key or value, in bytes.
pub const MAX_TEXT: usize = 1_024;
/// Most overrides held.
pub const MAX_OVERRIDES: usize = 100_000;

/// One `(key, value)` of a descriptor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    /// The descriptor key.
    pub key: String,
    /// The value (exact; no wildcards).
    pub value: String,
}

/// What a client asks for: the descriptor and its limits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OverrideSpec {
    /// The domain.
    pub domain: String,
    /// The exact descriptor.
    pub descriptor: Vec<Entry>,
    /// One `rate_limit` block, or a list of them, as in a rules file.
    pub limits: serde_json::Value,
}

/// A stored override: the spec, its validated rules, when it was set.
#[derive(Debug, Clone)]
pub struct Override {
    /// As set.
    pub spec: OverrideSpec,
    /// The limits, validated.
    pub rules: Vec<Rule>,
    /// Seconds since the Unix epoch.
    pub updated_at: u64,
    key: String,
}

impl Override {
    /// The counter key of `rules[i]`: distinct from any file rule's, so an
    /// override starts its own counters and leaves the file rule's intact.
    pub fn counter_key(&self, i: usize) -> String {
        format!("{}@override#{i}", self.key)
    }
}

#[derive(Serialize, Deserialize)]
struct Stored {
    spec: OverrideSpec,
    updated_at: u64,
}

/// Why an override could not be set, deleted or loaded.
#[derive(Debug, thiserror::Error)]
pub enum OverrideError {
    /// The request itself is wrong (400).
    #[error("{0}")]
    Invalid(String),
    /// The limits do not validate (400), each error positioned in the
    /// limits' JSON.
    #[error("invalid limits:\n{0}")]
    Limits(ConfigErrors),
    /// The embedded database failed (500); nothing changed.
    #[error("override storage failed: {0}")]
    Storage(String),
    /// The database file is open in another process (redb locks it).
    #[error(
        "{0} is open in another floodgate process: give each instance its own --overrides-file (or leave the flag out: each instance then gets its own file under --state-dir)"
    )]
    InUse(String),
    /// Overrides are shared through Redis, which failed (503); nothing
    /// changed.
    #[error("overrides are shared through Redis, which failed: {0}; nothing changed, try again")]
    Shared(String),
}

fn storage(e: impl std::fmt::Display) -> OverrideError {
    OverrideError::Storage(e.to_string())
}

/// The override store.
#[derive(Debug)]
pub struct Overrides {
    db: Database,
    cache: ArcSwap<HashMap<String, Arc<Override>>>,
    write: Mutex<()>,
    problems: Vec<String>,
    shared: OnceLock<SharedMap>,
}

impl Overrides {
    /// Open (or create) the store at `path` and load every override. A
    /// stored override that no longer validates (e.g. after an upgrade
    /// tightened a bound) is skipped and reported in [`Overrides::problems`].
    pub fn open(path: impl AsRef<Path>) -> Result<Self, OverrideError> {
        let path = path.as_ref();
        let db = Database::create(path).map_err(|e| match e {
            redb::DatabaseError::DatabaseAlreadyOpen => OverrideError::InUse(path.display().to_string()),
            e => OverrideError::Storage(format!("{}: {e}", path.display())),
        })?;
        let txn = db.begin_write().map_err(storage)?;
        txn.open_table(TABLE).map_err(storage)?;
        txn.commit().map_err(storage)?;
        let mut map = HashMap::new();
        let mut problems = Vec::new();
        {
            let read = db.begin_read().map_err(storage)?;
            let table = read.open_table(TABLE).map_err(storage)?;
            for row in table.iter().map_err(storage)? {
                let (k, v) = row.map_err(storage)?;
                let key = k.value().to_owned();
                let parsed = serde_json::from_str::<Stored>(v.value())
                    .map_err(|e| e.to_string())
                    .and_then(|s| build(s.spec, s.updated_at).map_err(|e| e.to_string()));
                match parsed {
                    Ok(o) => {
                        map.insert(key, Arc::new(o));
                    }
                    Err(e) => {
                        tracing::warn!("override {key:?} skipped: {e}");
                        problems.push(format!("{key}: {e}"));
                    }
                }
            }
        }
        Ok(Self { db, cache: ArcSwap::from_pointee(map), write: Mutex::new(()), problems, shared: OnceLock::new() })
    }

    /// Share these overrides through Redis from now on: changes go to `map`
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
                    Err(e) => tracing::debug!("overrides not synced from Redis: {e}"),
                }
            }
        }
    }

    /// One sync step: reload from Redis when its version moved since
    /// `seen`; the version now.
    async fn sync(&self, map: &SharedMap, seen: Option<u64>) -> Result<u64, floodgate_core::StoreError> {
        let version = map.version().await?;
        if seen == Some(version) {
            return Ok(version);
        }
        if version == 0 && seen.is_none() {
            // Redis never held overrides: upload ours.
            for o in self.list() {
                let Ok(text) = stored(&o) else { continue };
                map.set(&o.key, &text).await?;
            }
        }
        let (version, entries) = map.load().await?;
        let mut next = HashMap::new();
        for (key, value) in &entries {
            let parsed = serde_json::from_str::<Stored>(value)
                .map_err(|e| e.to_string())
                .and_then(|s| build(s.spec, s.updated_at).map_err(|e| e.to_string()));
            match parsed {
                Ok(o) => {
                    next.insert(key.clone(), Arc::new(o));
                }
                Err(e) => tracing::warn!("shared override {key:?} skipped: {e}"),
            }
        }
        let _guard = self.write.lock().unwrap_or_else(PoisonError::into_inner);
        if let Err(e) = self.mirror(&entries) {
            tracing::warn!("overrides from Redis not mirrored to disk: {e}");
        }
        self.cache.store(Arc::new(next));
        Ok(version)
    }

    /// Replace the local database's overrides with `entries`.
    fn mirror(&self, entries: &[(String, String)]) -> Result<(), OverrideError> {
        let txn = self.db.begin_write().map_err(storage)?;
        {
            let mut table = txn.open_table(TABLE).map_err(storage)?;
            table.retain(|_, _| false).map_err(storage)?;
            for (k, v) in entries {
                table.insert(k.as_str(), v.as_str()).map_err(storage)?;
            }
        }
        txn.commit().map_err(storage)
    }

    /// Set an override, through Redis first when shared ([`Overrides::set`]
    /// otherwise).
    pub async fn put(&self, spec: OverrideSpec) -> Result<Arc<Override>, OverrideError> {
        let o = build(spec, unix_now())?;
        if let Some(map) = self.shared.get() {
            Self::check_room(&self.cache.load(), &o.key)?;
            map.set(&o.key, &stored(&o)?).await.map_err(|e| OverrideError::Shared(e.to_string()))?;
        }
        self.insert(o)
    }

    /// Delete an override, through Redis first when shared
    /// ([`Overrides::delete`] otherwise).
    pub async fn remove(
        &self,
        domain: &str,
        entries: &[(impl AsRef<str>, impl AsRef<str>)],
    ) -> Result<bool, OverrideError> {
        if let Some(map) = self.shared.get() {
            let key = counter_key(domain, entries);
            if !self.cache.load().contains_key(&key) {
                return Ok(false);
            }
            map.remove(&key).await.map_err(|e| OverrideError::Shared(e.to_string()))?;
        }
        self.delete(domain, entries)
    }

    /// Stored overrides that could not be loaded, and why.
    pub fn problems(&self) -> &[String] {
        &self.problems
    }

    /// Set (create or replace) an override; durable when this returns.
    pub fn set(&self, spec: OverrideSpec) -> Result<Arc<Override>, OverrideError> {
        self.insert(build(spec, unix_now())?)
    }

    /// Refuse a new override beyond [`MAX_OVERRIDES`].
    fn check_room(current: &HashMap<String, Arc<Override>>, key: &str) -> Result<(), OverrideError> {
        if !current.contains_key(key) && current.len() >= MAX_OVERRIDES {
            return Err(OverrideError::Invalid(format!("{MAX_OVERRIDES} overrides already: delete some first")));
        }
        Ok(())
    }

    /// Store a built override in the database, then in memory.
    fn insert(&self, o: Override) -> Result<Arc<Override>, OverrideError> {
        let o = Arc::new(o);
        let _guard = self.write.lock().unwrap_or_else(PoisonError::into_inner);
        let current = self.cache.load_full();
        Self::check_room(&current, &o.key)?;
        let txn = self.db.begin_write().map_err(storage)?;
        txn.open_table(TABLE).map_err(storage)?.insert(o.key.as_str(), stored(&o)?.as_str()).map_err(storage)?;
        txn.commit().map_err(storage)?;
        let mut next = (*current).clone();
        next.insert(o.key.clone(), o.clone());
        self.cache.store(Arc::new(next));
        Ok(o)
    }

    /// Delete an override; `false` when there was none.
    pub fn delete(&self, domain: &str, entries: &[(impl AsRef<str>, impl AsRef<str>)]) -> Result<bool, OverrideError> {
        let key = counter_key(domain, entries);
        let _guard = self.write.lock().unwrap_or_else(PoisonError::into_inner);
        let current = self.cache.load_full();
        if !current.contains_key(&key) {
            return Ok(false);
        }
        let txn = self.db.begin_write().map_err(storage)?;
        txn.open_table(TABLE).map_err(storage)?.remove(key.as_str()).map_err(storage)?;
        txn.commit().map_err(storage)?;
        let mut next = (*current).clone();
        next.remove(&key);
        self.cache.store(Arc::new(next));
        Ok(true)
    }

    /// The override of exactly this descriptor, if any.
    pub fn get(&self, domain: &str, entries: &[(impl AsRef<str>, impl AsRef<str>)]) -> Option<Arc<Override>> {
        let cache = self.cache.load();
        if cache.is_empty() {
            return None;
        }
        cache.get(&counter_key(domain, entries)).cloned()
    }

    /// Every override, sorted by domain then descriptor.
    pub fn list(&self) -> Vec<Arc<Override>> {
        let mut all: Vec<_> = self.cache.load().values().cloned().collect();
        all.sort_by(|a, b| (&a.spec.domain, &a.key).cmp(&(&b.spec.domain, &b.key)));
        all
    }

    /// Number of overrides.
    pub fn len(&self) -> usize {
        self.cache.load().len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Seconds since the Unix epoch.
fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// An override as stored (in the database, and in Redis when shared).
fn stored(o: &Override) -> Result<String, OverrideError> {
    serde_json::to_string(&Stored { spec: o.spec.clone(), updated_at: o.updated_at }).map_err(storage)
}

/// Check a spec and build its rules.
fn build(spec: OverrideSpec, updated_at: u64) -> Result<Override, OverrideError> {
    let bad = |m: String| Err(OverrideError::Invalid(m));
    if spec.domain.is_empty() || spec.domain.len() > MAX_TEXT {
        return bad(format!("domain must be 1 to {MAX_TEXT} bytes"));
    }
    if spec.descriptor.is_empty() || spec.descriptor.len() > MAX_ENTRIES {
        return bad(format!(
            "descriptor must have 1 to {MAX_ENTRIES} entries, e.g. [{{\"key\": \"user\", \"value\": \"alice\"}}]"
        ));
    }
    for (i, e) in spec.descriptor.iter().enumerate() {
        if e.key.is_empty() || e.key.len() > MAX_TEXT || e.value.len() > MAX_TEXT {
            return bad(format!("descriptor[{i}]: key must be 1 to {MAX_TEXT} bytes and value at most {MAX_TEXT}"));
        }
    }
    let entries: Vec<(&str, &str)> = spec.descriptor.iter().map(|e| (e.key.as_str(), e.value.as_str())).collect();
    let key = counter_key(&spec.domain, &entries);
    let stats_key = std::iter::once(spec.domain.clone())
        .chain(
            spec.descriptor
                .iter()
                .map(|e| if e.value.is_empty() { e.key.clone() } else { format!("{}_{}", e.key, e.value) }),
        )
        .collect::<Vec<_>>()
        .join(".");
    let text = serde_json::to_string(&spec.limits).map_err(storage)?;
    let rules = parse_limits("limits", &text, &stats_key).map_err(OverrideError::Limits)?;
    Ok(Override { spec, rules, updated_at, key })
}
