//! Per-key entries on disk: an embedded database ([redb]: ACID,
//! copy-on-write, fsync on commit, so a crash mid-write leaves the last
//! committed state of every batch, never a torn one).
//!
//! Nothing is loaded at open: a lookup reads one entry (a B-tree descent,
//! a few microseconds from the OS page cache), a listing reads one page in
//! key order. Two tables:
//!
//! * `keys`: the entry's lookup key ([`lookup_key`]: the domain, then each
//!   `key`/`value` of the descriptor, in order, separated by control bytes
//!   no entry may contain) to its stored form ([`Stored`], JSON). Key order
//!   is (domain, descriptor) order, so a domain or a descriptor prefix is
//!   one range.
//! * `tier_counts`: `domain \0 tier` (tier empty for entries with their own
//!   limits) to the number of entries, updated in the same transaction as
//!   the entries.
//!
//! Databases written before tiers hold a table `overrides` (the counter key
//! to the whole spec): [`Disk::open`] moves its rows into `keys` in one
//! transaction and drops it, with a log line.

use std::collections::HashMap;
use std::path::Path;

use arc_swap::ArcSwap;
use redb::{Database, ReadOnlyTable, ReadableDatabase, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};

use super::{Entry, KeyError, KeySpec};

const KEYS: TableDefinition<&str, &[u8]> = TableDefinition::new("keys");
const COUNTS: TableDefinition<&str, u64> = TableDefinition::new("tier_counts");
/// The table of databases written before tiers (counter key to the JSON of
/// `{"spec": {domain, descriptor, limits}, "updated_at"}`).
const LEGACY: TableDefinition<&str, &str> = TableDefinition::new("overrides");

/// The database's own page cache (redb's default is 1 GiB, which 10M
/// entries would fill): the OS page cache holds the file besides, outside
/// the process's RSS.
pub const DB_CACHE_BYTES: usize = 32 << 20;

/// Separates the domain and the entries of a lookup key.
const ENTRY_SEP: char = '\u{0}';
/// Separates an entry's key from its value.
const KV_SEP: char = '\u{1}';

/// An entry as stored: what it maps to, not its descriptor (the key holds
/// that).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(crate) struct Stored {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) tier: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) limits: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) name: Option<String>,
    pub(crate) updated_at: u64,
}

impl Stored {
    pub(crate) fn of(spec: &KeySpec, updated_at: u64) -> Self {
        Self { tier: spec.tier.clone(), limits: spec.limits.clone(), name: spec.name.clone(), updated_at }
    }

    /// The spec this stored form and its lookup key describe.
    pub(crate) fn spec(self, key: &str) -> KeySpec {
        let (domain, descriptor) = split_lookup_key(key);
        KeySpec { domain, descriptor, tier: self.tier, limits: self.limits, name: self.name }
    }

    /// The `tier_counts` row this entry counts in.
    fn count_key(&self, domain: &str) -> String {
        format!("{domain}{ENTRY_SEP}{}", self.tier.as_deref().unwrap_or(""))
    }
}

/// The lookup key of (domain, descriptor); `None` when a part holds one of
/// the separator bytes (no entry can: [`check_text`] refuses them).
pub fn lookup_key<K: AsRef<str>, V: AsRef<str>>(domain: &str, entries: &[(K, V)]) -> Option<String> {
    let mut key = String::with_capacity(domain.len() + entries.len() * 16);
    push_part(&mut key, domain)?;
    for (k, v) in entries {
        key.push(ENTRY_SEP);
        push_part(&mut key, k.as_ref())?;
        key.push(KV_SEP);
        push_part(&mut key, v.as_ref())?;
    }
    Some(key)
}

fn push_part(key: &mut String, part: &str) -> Option<()> {
    if part.contains([ENTRY_SEP, KV_SEP]) {
        return None;
    }
    key.push_str(part);
    Some(())
}

/// Whether an entry's domain, key or value may be stored.
pub(crate) fn check_text(what: &str, text: &str) -> Result<(), KeyError> {
    if text.contains([ENTRY_SEP, KV_SEP]) {
        return Err(KeyError::Invalid(format!("{what} must not contain the control characters U+0000 or U+0001")));
    }
    Ok(())
}

/// The lookup key's domain and descriptor.
fn split_lookup_key(key: &str) -> (String, Vec<Entry>) {
    let mut parts = key.split(ENTRY_SEP);
    let domain = parts.next().unwrap_or_default().to_owned();
    let descriptor = parts
        .map(|p| {
            let (k, v) = p.split_once(KV_SEP).unwrap_or((p, ""));
            Entry { key: k.to_owned(), value: v.to_owned() }
        })
        .collect();
    (domain, descriptor)
}

/// The first lookup key of a listing: `domain`, then the descriptor written
/// `key=value, key=value` (a prefix of one: `user=al` lists every `user`
/// value starting `al`).
pub(crate) fn listing_start(domain: &str, prefix: &str) -> Result<String, KeyError> {
    check_text("domain", domain)?;
    check_text("prefix", prefix)?;
    let mut key = domain.to_owned();
    key.push(ENTRY_SEP);
    for (i, part) in prefix.split(", ").enumerate().filter(|(_, p)| !p.is_empty()) {
        if i > 0 {
            key.push(ENTRY_SEP);
        }
        match part.split_once('=') {
            Some((k, v)) => {
                key.push_str(k);
                key.push(KV_SEP);
                key.push_str(v);
            }
            None => key.push_str(part),
        }
    }
    Ok(key)
}

fn storage(e: impl std::fmt::Display) -> KeyError {
    KeyError::Storage(e.to_string())
}

/// One write of a batch.
pub(crate) enum Write {
    Put(String, Stored),
    Delete(String),
}

/// The table lookups read: one read transaction, replaced after every
/// commit (a miss then costs a B-tree descent, not a transaction's set-up;
/// redb keeps the pages of the one version it pins).
type Reader = ReadOnlyTable<&'static str, &'static [u8]>;

/// The database.
pub(crate) struct Disk {
    // Declared first: dropped before the database it reads.
    reader: ArcSwap<Reader>,
    db: Database,
}

impl std::fmt::Debug for Disk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Disk").field("db", &self.db).finish_non_exhaustive()
    }
}

fn reader(db: &Database) -> Result<Reader, KeyError> {
    db.begin_read().map_err(storage)?.open_table(KEYS).map_err(storage)
}

impl Disk {
    /// Open (or create) the database at `path`, migrating a database
    /// written before tiers.
    pub(crate) fn open(path: &Path) -> Result<Self, KeyError> {
        let db = Database::builder().set_cache_size(DB_CACHE_BYTES).create(path).map_err(|e| match e {
            redb::DatabaseError::DatabaseAlreadyOpen => KeyError::InUse(path.display().to_string()),
            e => KeyError::Storage(format!("{}: {e}", path.display())),
        })?;
        let txn = db.begin_write().map_err(storage)?;
        txn.open_table(KEYS).map_err(storage)?;
        txn.open_table(COUNTS).map_err(storage)?;
        txn.commit().map_err(storage)?;
        let disk = Self { reader: ArcSwap::from_pointee(reader(&db)?), db };
        disk.migrate(path)?;
        Ok(disk)
    }

    /// Move the rows of a pre-tier `overrides` table into `keys`.
    fn migrate(&self, path: &Path) -> Result<(), KeyError> {
        #[derive(Deserialize)]
        struct Old {
            spec: KeySpec,
            updated_at: u64,
        }
        let read = self.db.begin_read().map_err(storage)?;
        let rows: Vec<(String, String)> = match read.open_table(LEGACY) {
            Ok(t) => t
                .iter()
                .map_err(storage)?
                .filter_map(Result::ok)
                .map(|(k, v)| (k.value().to_owned(), v.value().to_owned()))
                .collect(),
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(()),
            Err(e) => return Err(storage(e)),
        };
        drop(read);
        let mut writes = Vec::with_capacity(rows.len());
        for (key, text) in &rows {
            match serde_json::from_str::<Old>(text) {
                Ok(old) => match lookup_key(&old.spec.domain, &old.spec.entries()) {
                    Some(k) => writes.push(Write::Put(k, Stored::of(&old.spec, old.updated_at))),
                    None => {
                        tracing::warn!(override = %key, "an old override with a control character in its descriptor is dropped")
                    }
                },
                Err(e) => tracing::warn!(override = %key, "an old override that does not parse is dropped: {e}"),
            }
        }
        let n = writes.len();
        self.apply(&writes, |txn| txn.delete_table(LEGACY).map(drop).map_err(storage))?;
        tracing::info!(file = %path.display(), entries = n, "migrated the runtime overrides to per-key entries");
        Ok(())
    }

    /// The stored entry under `key`.
    pub(crate) fn get(&self, key: &str) -> Result<Option<Stored>, KeyError> {
        let table = self.reader.load();
        let Some(v) = table.get(key).map_err(storage)? else { return Ok(None) };
        serde_json::from_slice(v.value()).map(Some).map_err(|e| KeyError::Storage(format!("a stored entry: {e}")))
    }

    /// Apply `writes` in one transaction (all or nothing), keeping the tier
    /// counts; `also` runs inside it before the commit. The previous stored
    /// form of each written key, in order.
    pub(crate) fn apply(
        &self,
        writes: &[Write],
        also: impl FnOnce(&redb::WriteTransaction) -> Result<(), KeyError>,
    ) -> Result<Vec<Option<Stored>>, KeyError> {
        let txn = self.db.begin_write().map_err(storage)?;
        let mut before = Vec::with_capacity(writes.len());
        {
            let mut table = txn.open_table(KEYS).map_err(storage)?;
            let mut counts = txn.open_table(COUNTS).map_err(storage)?;
            let mut delta: HashMap<String, i64> = HashMap::new();
            for w in writes {
                let (key, new) = match w {
                    Write::Put(k, s) => (k.as_str(), Some(s)),
                    Write::Delete(k) => (k.as_str(), None),
                };
                let domain = key.split(ENTRY_SEP).next().unwrap_or_default();
                let old = match new {
                    Some(s) => {
                        let text = serde_json::to_vec(s).map_err(storage)?;
                        table.insert(key, text.as_slice()).map_err(storage)?.map(|v| v.value().to_vec())
                    }
                    None => table.remove(key).map_err(storage)?.map(|v| v.value().to_vec()),
                };
                let old: Option<Stored> = old.and_then(|v| serde_json::from_slice(&v).ok());
                if let Some(o) = &old {
                    *delta.entry(o.count_key(domain)).or_default() -= 1;
                }
                if let Some(n) = new {
                    *delta.entry(n.count_key(domain)).or_default() += 1;
                }
                before.push(old);
            }
            for (k, d) in delta.into_iter().filter(|(_, d)| *d != 0) {
                let now = counts.get(k.as_str()).map_err(storage)?.map_or(0, |v| v.value());
                let next = now.saturating_add_signed(d);
                if next == 0 {
                    counts.remove(k.as_str()).map_err(storage)?;
                } else {
                    counts.insert(k.as_str(), next).map_err(storage)?;
                }
            }
        }
        also(&txn)?;
        txn.commit().map_err(storage)?;
        self.reader.store(std::sync::Arc::new(reader(&self.db)?));
        Ok(before)
    }

    /// Every `(domain, tier, entries)` count (`tier` empty for entries with
    /// their own limits).
    pub(crate) fn counts(&self) -> Result<Vec<(String, String, u64)>, KeyError> {
        let read = self.db.begin_read().map_err(storage)?;
        let table = read.open_table(COUNTS).map_err(storage)?;
        let mut out = Vec::new();
        for row in table.iter().map_err(storage)? {
            let (k, v) = row.map_err(storage)?;
            let (domain, tier) = k.value().split_once(ENTRY_SEP).unwrap_or((k.value(), ""));
            out.push((domain.to_owned(), tier.to_owned(), v.value()));
        }
        Ok(out)
    }

    /// Up to `limit` entries from `start` (inclusive) while their key starts
    /// with `within`, and whether more follow.
    pub(crate) fn page(
        &self,
        start: &str,
        inclusive: bool,
        within: &str,
        limit: usize,
    ) -> Result<(Vec<(String, Stored)>, bool), KeyError> {
        let read = self.db.begin_read().map_err(storage)?;
        let table = read.open_table(KEYS).map_err(storage)?;
        let range = if inclusive {
            table.range::<&str>(start..).map_err(storage)?
        } else {
            table.range::<&str>((std::ops::Bound::Excluded(start), std::ops::Bound::Unbounded)).map_err(storage)?
        };
        let mut out = Vec::with_capacity(limit.min(1_024));
        for row in range {
            let (k, v) = row.map_err(storage)?;
            let key = k.value();
            if !key.starts_with(within) {
                return Ok((out, false));
            }
            if out.len() == limit {
                return Ok((out, true));
            }
            match serde_json::from_slice::<Stored>(v.value()) {
                Ok(s) => out.push((key.to_owned(), s)),
                Err(e) => tracing::warn!(entry = ?key, "a stored entry that does not parse is skipped: {e}"),
            }
        }
        Ok((out, false))
    }

    /// Every stored entry, in key order (for the shared mirror's diff).
    pub(crate) fn all_keys(&self) -> Result<Vec<String>, KeyError> {
        let read = self.db.begin_read().map_err(storage)?;
        let table = read.open_table(KEYS).map_err(storage)?;
        let mut out = Vec::new();
        for row in table.iter().map_err(storage)? {
            out.push(row.map_err(storage)?.0.value().to_owned());
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_keys_order_by_domain_then_descriptor_and_split_back() {
        let a = lookup_key("api", &[("user", "alice")]).unwrap();
        let b = lookup_key("api", &[("user", "alice"), ("path", "/x")]).unwrap();
        let c = lookup_key("api", &[("user", "bob")]).unwrap();
        let d = lookup_key("api2", &[("user", "alice")]).unwrap();
        assert!(a < b && b < c && c < d, "{a:?} {b:?} {c:?} {d:?}");
        assert!(b.starts_with(&listing_start("api", "user=al").unwrap()));
        assert!(a.starts_with(&listing_start("api", "").unwrap()));
        assert!(!d.starts_with(&listing_start("api", "").unwrap()), "api2 is another domain");
        assert_eq!(listing_start("api", "user=alice").unwrap(), a, "a whole descriptor is its lookup key");
        let (domain, entries) = split_lookup_key(&b);
        assert_eq!(domain, "api");
        assert_eq!(entries[1], Entry { key: "path".into(), value: "/x".into() });
        assert!(lookup_key("api", &[("user", "a\u{0}b")]).is_none());
    }
}
