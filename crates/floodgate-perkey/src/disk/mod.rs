//! Per-key entries on disk: an embedded database ([redb]: ACID,
//! copy-on-write, fsync on commit, so a crash mid-write leaves the last
//! committed state of every batch, never a torn one).
//!
//! Nothing is loaded at open: a lookup reads one entry, a listing reads one
//! page in key order. A lookup asks the hash index beside the database
//! first ([`index`]: one bucket read), and the database (a B-tree
//! descent, a few microseconds from the OS page cache) when the index
//! cannot answer. Three tables:
//!
//! * `keys`: the entry's lookup key ([`lookup_key`](crate::lookup_key)) to its value (the
//!   bytes of `value.rs`). Key order is (domain, descriptor) order, so a
//!   domain or a descriptor prefix is one range.
//! * `tier_counts`: `domain \0 tier` (tier empty for entries with their own
//!   limits) to the number of entries, updated in the same transaction as
//!   the entries.
//! * `meta`: `generation`, the number of the last commit (each write's
//!   transaction adds one), and `commit`, a random number each write's
//!   transaction draws anew (and the first open, for a database without
//!   one): the index is used only if built at that commit, so a database
//!   restored from a copy, or made anew, never meets an index of another
//!   one that happens to have as many commits.
//!
//! Databases written before tiers hold a table `overrides` (the counter key
//! to the whole spec): [`Disk::open`] moves its rows into `keys` in one
//! transaction and drops it, with a log line.

mod index;

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;

use arc_swap::ArcSwap;
use redb::{
    Database, ReadOnlyTable, ReadTransaction, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition,
};

use self::index::{Answer, BuildError, Builder, Index, Next};
use super::{KeyError, Rows, Write};
use crate::entries::value::{ENTRY_SEP, count_key};

const KEYS: TableDefinition<&str, &[u8]> = TableDefinition::new("keys");
const COUNTS: TableDefinition<&str, u64> = TableDefinition::new("tier_counts");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const GENERATION: &str = "generation";
const COMMIT: &str = "commit";
/// The table of databases written before tiers (counter key to the JSON of
/// `{"spec": {domain, descriptor, limits}, "updated_at"}`).
const LEGACY: TableDefinition<&str, &str> = TableDefinition::new("overrides");

/// The database's own page cache (redb's default is 1 GiB, which 10M
/// entries would fill): the OS page cache holds the file besides, outside
/// the process's RSS.
pub const DB_CACHE_BYTES: usize = 32 << 20;

fn storage(e: impl std::fmt::Display) -> KeyError {
    KeyError::Storage(e.to_string())
}

/// The table lookups read: one read transaction, replaced after every
/// commit (a miss then costs a B-tree descent, not a transaction's set-up;
/// redb keeps the pages of the one version it pins).
type Reader = ReadOnlyTable<&'static str, &'static [u8]>;

/// The database.
pub(crate) struct Disk {
    // Declared first: dropped before the database it reads.
    reader: ArcSwap<Reader>,
    index: Arc<Index>,
    /// Builds the index in the background (joined on drop).
    builder: Option<JoinHandle<()>>,
    db: Arc<Database>,
}

impl Drop for Disk {
    fn drop(&mut self) {
        self.index.stop();
        if let Some(b) = self.builder.take() {
            let _ = b.join();
        }
    }
}

impl std::fmt::Debug for Disk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Disk").field("db", &self.db).finish_non_exhaustive()
    }
}

fn reader(db: &Database) -> Result<Reader, KeyError> {
    db.begin_read().map_err(storage)?.open_table(KEYS).map_err(storage)
}

/// The last commit a read transaction sees: its number and its random id.
fn last_commit(read: &ReadTransaction) -> Result<(u64, u64), KeyError> {
    let t = read.open_table(META).map_err(storage)?;
    let get = |k: &str| Ok::<_, KeyError>(t.get(k).map_err(storage)?.map_or(0, |v| v.value()));
    Ok((get(GENERATION)?, get(COMMIT)?))
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
        let commit = {
            let mut meta = txn.open_table(META).map_err(storage)?;
            let id = meta.get(COMMIT).map_err(storage)?.map(|v| v.value());
            match id {
                Some(id) => id,
                None => {
                    let id = super::random();
                    meta.insert(COMMIT, id).map_err(storage)?;
                    id
                }
            }
        };
        txn.commit().map_err(storage)?;
        let index = Arc::new(Index::open(index::with_suffix(path, ".index"), commit));
        let db = Arc::new(db);
        let builder = {
            let (index, db) = (Arc::clone(&index), Arc::downgrade(&db));
            std::thread::Builder::new()
                .name("floodgate-key-index".into())
                .spawn(move || keep_index(&index, &db))
                .map_err(|e| KeyError::Storage(format!("cannot start the index's builder: {e}")))?
        };
        let disk = Self { reader: ArcSwap::from_pointee(reader(&db)?), index, builder: Some(builder), db };
        disk.migrate(path)?;
        Ok(disk)
    }

    /// The hash index in front of the database.
    pub(crate) fn index(&self) -> &Index {
        &self.index
    }

    /// Move the rows of a pre-tier `overrides` table into `keys`.
    fn migrate(&self, path: &Path) -> Result<(), KeyError> {
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
            match Write::legacy(text) {
                Ok(w) => writes.push(w),
                Err(e) => tracing::warn!(override = %key, "an old override is dropped: {e}"),
            }
        }
        let n = writes.len();
        self.apply(&writes, |txn| txn.delete_table(LEGACY).map(drop).map_err(storage))?;
        tracing::info!(file = %path.display(), entries = n, "migrated the runtime overrides to per-key entries");
        Ok(())
    }

    /// The value under `key`, handed to `f` where it lies (no copy).
    pub(crate) fn with<T>(&self, key: &str, f: impl FnOnce(&[u8]) -> T) -> Result<Option<T>, KeyError> {
        let mut buf = [0u8; index::BUCKET];
        match self.index.find(key, &mut buf) {
            Answer::Value(v) => return Ok(Some(f(v))),
            Answer::Absent => return Ok(None),
            Answer::AskDb => {}
        }
        let table = self.reader.load();
        let Some(v) = table.get(key).map_err(storage)? else { return Ok(None) };
        Ok(Some(f(v.value())))
    }

    /// The value under `key`, copied.
    pub(crate) fn get(&self, key: &str) -> Result<Option<Vec<u8>>, KeyError> {
        self.with(key, <[u8]>::to_vec)
    }

    /// Apply `writes` in one transaction (all or nothing), keeping the tier
    /// counts; `also` runs inside it before the commit. Whether each written
    /// key held a value before, in order.
    pub(crate) fn apply(
        &self,
        writes: &[Write],
        also: impl FnOnce(&redb::WriteTransaction) -> Result<(), KeyError>,
    ) -> Result<Vec<bool>, KeyError> {
        let txn = self.db.begin_write().map_err(storage)?;
        let mut before = Vec::with_capacity(writes.len());
        let commit = {
            let mut meta = txn.open_table(META).map_err(storage)?;
            let next = meta.get(GENERATION).map_err(storage)?.map_or(0, |v| v.value()) + 1;
            meta.insert(GENERATION, next).map_err(storage)?;
            meta.insert(COMMIT, super::random()).map_err(storage)?;
            next
        };
        {
            let mut table = txn.open_table(KEYS).map_err(storage)?;
            let mut counts = txn.open_table(COUNTS).map_err(storage)?;
            let mut delta: HashMap<String, i64> = HashMap::new();
            for w in writes {
                let key = w.key.as_str();
                let old = match &w.value {
                    Some(v) => table.insert(key, v.as_slice()).map_err(storage)?.map(|v| v.value().to_vec()),
                    None => table.remove(key).map_err(storage)?.map(|v| v.value().to_vec()),
                };
                if let Some(o) = &old {
                    *delta.entry(count_key(key, o)).or_default() -= 1;
                }
                if let Some(n) = &w.value {
                    *delta.entry(count_key(key, n)).or_default() += 1;
                }
                before.push(old.is_some());
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
        // Before the caller drops the keys from the cache (see `index`).
        self.index.written(writes.iter().map(|w| w.key.as_str()), commit);
        self.reader.store(Arc::new(reader(&self.db)?));
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
    pub(crate) fn page(&self, start: &str, inclusive: bool, within: &str, limit: usize) -> Result<Rows, KeyError> {
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
            out.push((key.to_owned(), v.value().to_vec()));
        }
        Ok((out, false))
    }
}

/// The index's builder: waits until a build is due, builds from one read
/// transaction, swaps the result in; until the store is dropped.
fn keep_index(index: &Index, db: &Weak<Database>) {
    let has_entries =
        || db.upgrade().and_then(|db| db.begin_read().ok()?.open_table(KEYS).ok()?.len().ok()).is_some_and(|n| n > 0);
    while let Next::Build = index.next(has_entries) {
        let Some(db) = db.upgrade() else { return };
        let started = std::time::Instant::now();
        match build(index, &db) {
            Ok((file, generation, entries)) => {
                index.built(file, generation);
                tracing::info!(
                    file = %index.path().display(),
                    entries,
                    seconds = started.elapsed().as_secs_f64(),
                    "per-key index built"
                );
            }
            Err(BuildError::Stopped) => return,
            Err(BuildError::Failed(e)) => {
                index.failed();
                tracing::warn!(
                    file = %index.path().display(),
                    "the per-key index could not be built: {e}; misses read the database (tried again after the next write or in 5 minutes)"
                );
            }
        }
    }
}

/// Build the index from a snapshot: the file, the snapshot's commit
/// number, its entries.
fn build(index: &Index, db: &Database) -> Result<(index::IndexFile, u64, u64), BuildError> {
    let read = db.begin_read()?;
    let (generation, commit) = last_commit(&read).map_err(|e| BuildError::Failed(e.to_string()))?;
    let table = read.open_table(KEYS)?;
    let mut b = Builder::new(index.path(), commit, table.len()?, &index.stopping)?;
    for row in table.iter()? {
        let (k, v) = row?;
        b.add(k.value().as_bytes(), v.value())?;
    }
    drop(table);
    drop(read);
    let entries = b.entries();
    Ok((b.finish()?, generation, entries))
}
