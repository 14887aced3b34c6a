//! Per-key entries in Redis or a Redis Cluster, sharded by key: every
//! instance on the store sees every entry, and none loads them all.
//!
//! A lookup key belongs to one of [`SHARDS`] shards (FNV-1a of the key). A
//! shard is three keys under one hash tag, so one script updates them
//! atomically, in one slot of a cluster:
//!
//! * `<prefix>{keys:NN}:e`, a hash: lookup key → value (`value.rs`);
//! * `<prefix>{keys:NN}:i`, a sorted set of the lookup keys (all score 0,
//!   so in byte order): a listing is a `ZRANGEBYLEX` per shard, merged;
//! * `<prefix>{keys:NN}:c`, a hash: `domain \0 tier` → entries;
//! * `<prefix>{keys:NN}:v`, the shard's version: bumped by every write.
//!
//! A write is one script per shard it touches and per [`WRITE_CHUNK`]
//! entries ([`WRITE`]): the entries, the index, the counts, then a
//! `PUBLISH` of the shard, its new version and the written lookup keys on
//! `<prefix>keys:changed`, which every instance subscribes to and drops
//! those keys from its cache. Pub/Sub can lose a notice without losing the
//! subscription (a Redis Cluster's bus partitioned from the subscribed
//! node): every instance also reads the 64 versions every second, and a
//! shard whose version passed the last notice it got has its cached
//! answers dropped. Each
//! script is atomic and short (about a millisecond), so an import never
//! holds Redis away from decisions for long; a batch is therefore not
//! atomic as a whole: a failure or a crash midway can leave part of it
//! written, and writing it again completes it (writes are idempotent).
//! Administrative calls (writes, listings, counts) go on a connection of
//! their own with [`ADMIN_TIMEOUT`]; the misses' reads use the decisions'
//! connection and timeout.
//!
//! Misses are read in batches ([`Sharded::read`]), per deciding thread: the
//! thread's misses waiting while a batch is out go together in the next,
//! one `HMGET` per shard, sent together on the thread's own connection (on
//! one server as one pipeline: a batch costs the client one call); at
//! most [`READS_IN_FLIGHT`] batches a thread are out at once. A miss, its
//! batch and the reply stay on the thread that decides (one reader for the
//! whole process cost three or four cross-thread wake-ups a batch).

mod follow;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, PoisonError};

use floodgate_core::StoreError;
use floodgate_redis::{RedisStore, Script, Via};
use tokio::sync::{Semaphore, mpsc, oneshot};

use super::{KeyError, Rows, Write};

/// Shards of the entries. Fixed: instances on one store must agree.
pub const SHARDS: usize = 64;
/// Most misses one read batch carries.
pub(crate) const READ_BATCH: usize = 1_024;
/// Read batches out at once.
pub(crate) const READS_IN_FLIGHT: usize = 4;
/// Most entries one write script carries.
pub(crate) const WRITE_CHUNK: usize = 256;
/// Write scripts in flight at once for one batch.
const WRITES_IN_FLIGHT: usize = 4;
/// The longest an administrative call waits for Redis.
pub(crate) const ADMIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// Administrative calls (writes, listings, counts): their own connection,
/// [`ADMIN_TIMEOUT`].
const ADMIN: Via = Via::Admin(ADMIN_TIMEOUT);
/// Misses waiting for a batch before a lookup waits to queue.
const READ_QUEUE: usize = 65_536;

/// Writes entries of one shard: `scripts/write.lua` (its `KEYS` and
/// `ARGV` at its top).
const WRITE: &str = include_str!("../../scripts/write.lua");

/// A shard's entries (`e`), index (`i`), counts (`c`) or version (`v`)
/// key, under the store's key prefix.
fn shard_key(prefix: &str, shard: usize, part: &str) -> String {
    format!("{prefix}{{keys:{shard:02}}}:{part}")
}

/// The shard of a lookup key (FNV-1a: stable across builds and machines).
pub(crate) fn shard_of(key: &str) -> usize {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    usize::try_from(h % SHARDS as u64).unwrap_or(0)
}

/// One miss waiting for its batch.
struct Read {
    key: String,
    reply: oneshot::Sender<Result<Option<Vec<u8>>, KeyError>>,
}

/// The entries in Redis.
pub(crate) struct Sharded {
    store: RedisStore,
    prefix: String,
    /// Where writes announce their keys.
    pub(crate) channel: String,
    /// Set once the layout holds every entry (old ones migrated).
    marker: String,
    /// Each deciding thread's reader (see [`Sharded::read`]).
    readers: Mutex<Vec<(std::thread::ThreadId, mpsc::Sender<Read>)>>,
    /// Read batches sent so far.
    pub(crate) batches: AtomicU64,
    /// Each shard's entries key (`e`), made once: every miss names one.
    entries_keys: Box<[String]>,
    /// [`WRITE`].
    write: Script,
}

fn shared(e: impl std::fmt::Display) -> KeyError {
    KeyError::Shared(e.to_string())
}

/// The same failure again, for each key of a failed call.
fn again(e: &KeyError) -> KeyError {
    match e {
        KeyError::Shared(why) => KeyError::Shared(why.clone()),
        e => shared(e),
    }
}

impl Sharded {
    pub(crate) fn new(store: RedisStore) -> Self {
        let prefix = store.config().key_prefix.clone();
        let entries_keys = (0..SHARDS).map(|s| shard_key(&prefix, s, "e")).collect();
        Self {
            entries_keys,
            channel: format!("{prefix}keys:changed"),
            marker: format!("{prefix}keys:layout"),
            prefix,
            store,
            readers: Mutex::new(Vec::new()),
            batches: AtomicU64::new(0),
            write: Script::new(WRITE),
        }
    }

    /// [`shard_key`] under this store's prefix.
    fn key(&self, shard: usize, part: &str) -> String {
        shard_key(&self.prefix, shard, part)
    }

    /// `call(shard)` on every shard, sent together.
    async fn every_shard<T, F: Future<Output = Result<T, StoreError>>>(
        &self,
        call: impl Fn(usize) -> F,
    ) -> Result<Vec<T>, KeyError> {
        let calls = (0..SHARDS).map(call);
        floodgate_redis::join_all(calls.collect()).await.into_iter().map(|r| r.map_err(shared)).collect()
    }

    /// The values under `keys`, in order: one `HMGET` per shard, sent
    /// together (with the decisions' connection, on one server, as one
    /// pipeline). A shard's failure fails its keys only.
    async fn values(&self, keys: &[&str], via: Via) -> Vec<Result<Option<Vec<u8>>, KeyError>> {
        let mut by_shard: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for (i, k) in keys.iter().enumerate() {
            by_shard.entry(shard_of(k)).or_default().push(i);
        }
        let reads: Vec<(&str, Vec<&str>)> = by_shard
            .iter()
            .map(|(&shard, idx)| (self.entries_keys[shard].as_str(), idx.iter().map(|&i| keys[i]).collect()))
            .collect();
        let replies = self.store.hmget_each(&reads, via).await;
        let mut out: Vec<Result<Option<Vec<u8>>, KeyError>> = keys.iter().map(|_| Ok(None)).collect();
        for ((_, idx), got) in by_shard.into_iter().zip(replies) {
            match got.map_err(shared) {
                Ok(values) => idx.into_iter().zip(values).for_each(|(i, v)| out[i] = Ok(v)),
                Err(e) => idx.into_iter().for_each(|i| out[i] = Err(again(&e))),
            }
        }
        out
    }

    /// The value under `key`, read in this thread's next batch. Fails (the
    /// caller applies the files' rules) when Redis does.
    pub(crate) async fn read(self: &Arc<Self>, key: String) -> Result<Option<Vec<u8>>, KeyError> {
        let (tx, rx) = oneshot::channel();
        self.reader().send(Read { key, reply: tx }).await.map_err(|_| shared("the reader stopped"))?;
        rx.await.map_err(|_| shared("the reader stopped"))?
    }

    /// This thread's reader: made, on the current runtime, at its first
    /// miss, and again when its runtime is gone.
    fn reader(self: &Arc<Self>) -> mpsc::Sender<Read> {
        let thread = std::thread::current().id();
        let mut readers = self.readers.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, tx)) = readers.iter().find(|(t, tx)| *t == thread && !tx.is_closed()) {
            return tx.clone();
        }
        readers.retain(|(t, tx)| *t != thread && !tx.is_closed());
        let (tx, rx) = mpsc::channel(READ_QUEUE);
        tokio::spawn(Arc::clone(self).run_reads(rx));
        readers.push((thread, tx.clone()));
        tx
    }

    /// Serve one thread's [`Sharded::read`]s: take what waits, up to
    /// [`READ_BATCH`], and read it with one `HMGET` per shard, sent
    /// together. Runs until its runtime stops.
    async fn run_reads(self: Arc<Self>, mut rx: mpsc::Receiver<Read>) {
        let slots = Arc::new(Semaphore::new(READS_IN_FLIGHT));
        while let Some(first) = rx.recv().await {
            let mut batch = vec![first];
            while batch.len() < READ_BATCH {
                match rx.try_recv() {
                    Ok(r) => batch.push(r),
                    Err(_) => break,
                }
            }
            let Ok(slot) = slots.clone().acquire_owned().await else { return };
            self.batches.fetch_add(1, Relaxed);
            let this = self.clone();
            tokio::spawn(async move {
                this.read_batch(batch).await;
                drop(slot);
            });
        }
    }

    async fn read_batch(&self, batch: Vec<Read>) {
        let keys: Vec<&str> = batch.iter().map(|r| r.key.as_str()).collect();
        let values = self.values(&keys, Via::Decisions).await;
        for (r, v) in batch.into_iter().zip(values) {
            let _ = r.reply.send(v);
        }
    }

    /// The values under `keys` of answers due for their refresh, read on
    /// the decisions' connection (not batched with misses):
    /// [`Sharded::values`].
    pub(crate) async fn read_due(&self, keys: &[&str]) -> Vec<Result<Option<Vec<u8>>, KeyError>> {
        self.values(keys, Via::Decisions).await
    }

    /// The value under `key`, read now (the admin API's exact lookup).
    pub(crate) async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, KeyError> {
        self.store.hget(&self.entries_keys[shard_of(key)], key, ADMIN).await.map_err(shared)
    }

    /// Apply `writes` ([`WRITE`]): one script per shard and per
    /// [`WRITE_CHUNK`] entries, [`WRITES_IN_FLIGHT`] at a time. Whether
    /// each key held a value before, in order. On an error, the scripts
    /// that ran stay applied.
    pub(crate) async fn apply(&self, writes: &[Write]) -> Result<Vec<bool>, KeyError> {
        let mut by_shard: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for (i, w) in writes.iter().enumerate() {
            by_shard.entry(shard_of(&w.key)).or_default().push(i);
        }
        let calls: Vec<(usize, &[usize])> =
            by_shard.iter().flat_map(|(shard, idx)| idx.chunks(WRITE_CHUNK).map(move |c| (*shard, c))).collect();
        let mut before = vec![false; writes.len()];
        for wave in calls.chunks(WRITES_IN_FLIGHT) {
            let parts = wave.iter().map(|&(shard, idx)| self.write_chunk(writes, shard, idx));
            for part in floodgate_redis::join_all(parts.collect()).await {
                for (i, existed) in part? {
                    before[i] = existed;
                }
            }
        }
        Ok(before)
    }

    /// One [`WRITE`] script: the writes `idx` of one shard.
    async fn write_chunk(&self, writes: &[Write], shard: usize, idx: &[usize]) -> Result<Vec<(usize, bool)>, KeyError> {
        let keys: Vec<&str> = idx.iter().map(|&i| writes[i].key.as_str()).collect();
        let message = serde_json::to_string(&keys).map_err(shared)?;
        let shard_keys = ["e", "i", "c", "v"].map(|part| self.key(shard, part));
        let shard_number = shard.to_string();
        let mut args: Vec<&[u8]> = vec![self.channel.as_bytes(), message.as_bytes(), shard_number.as_bytes()];
        for &i in idx {
            args.push(writes[i].key.as_bytes());
            args.push(writes[i].value.as_deref().unwrap_or_default());
        }
        let shard_keys = shard_keys.each_ref().map(String::as_str);
        let existed = self.store.run_script(&self.write, &shard_keys, &args, ADMIN).await.map_err(shared)?;
        if existed.len() != idx.len() {
            return Err(shared("Redis answered the write with the wrong count"));
        }
        Ok(idx.iter().copied().zip(existed.into_iter().map(|e| e == 1)).collect())
    }

    /// Entries per `(domain, tier)`, every shard's counts summed.
    pub(crate) async fn counts(&self) -> Result<Vec<(String, String, u64)>, KeyError> {
        let keys: Vec<String> = (0..SHARDS).map(|s| self.key(s, "c")).collect();
        let shards = self.every_shard(|s| self.store.hash_counts(&keys[s], ADMIN)).await?;
        let mut sum: BTreeMap<(String, String), u64> = BTreeMap::new();
        for rows in shards {
            for (k, n) in rows {
                let (d, t) = k.split_once('\u{0}').unwrap_or((k.as_str(), ""));
                *sum.entry((d.to_owned(), t.to_owned())).or_default() += n;
            }
        }
        Ok(sum.into_iter().filter(|(_, n)| *n > 0).map(|((d, t), n)| (d, t, n)).collect())
    }

    /// Up to `limit` entries from `start` (inclusive or not) whose key
    /// starts with `within`, in key order, and whether more follow. Each
    /// shard gives its next few keys; the page ends at the smallest last key
    /// of a shard that may hold more, so no key is skipped (a page may hold
    /// fewer than `limit` while more follow).
    pub(crate) async fn page(
        &self,
        start: &str,
        inclusive: bool,
        within: &str,
        limit: usize,
    ) -> Result<Rows, KeyError> {
        let each = (2 * limit).div_ceil(SHARDS).max(16);
        let min = [if inclusive { b"[" } else { b"(" }.as_slice(), start.as_bytes()].concat();
        let max = if within.is_empty() { b"+".to_vec() } else { [b"[", within.as_bytes(), &[0xff]].concat() };
        let index_keys: Vec<String> = (0..SHARDS).map(|s| self.key(s, "i")).collect();
        let shards = self.every_shard(|s| self.store.range_by_lex(&index_keys[s], &min, &max, each, ADMIN)).await?;
        let mut keys = Vec::new();
        let mut bound: Option<String> = None;
        for shard in shards {
            if shard.len() == each
                && let Some(last) = shard.last()
                && bound.as_ref().is_none_or(|b| last < b)
            {
                bound = Some(last.clone());
            }
            keys.extend(shard);
        }
        keys.sort_unstable();
        let candidates = keys.len();
        if let Some(b) = &bound {
            keys.retain(|k| k <= b);
        }
        keys.truncate(limit);
        let more = bound.is_some() || keys.len() < candidates;
        let found = self.values(&keys.iter().map(String::as_str).collect::<Vec<_>>(), ADMIN).await;
        let mut values = Vec::with_capacity(keys.len());
        for (k, v) in keys.into_iter().zip(found) {
            // Deleted between the two reads: not listed.
            if let Some(v) = v? {
                values.push((k, v));
            }
        }
        Ok((values, more))
    }

    /// Every shard's version (0 before its first write), read together.
    pub(crate) async fn versions(&self) -> Result<Vec<u64>, KeyError> {
        let keys: Vec<String> = (0..SHARDS).map(|s| self.key(s, "v")).collect();
        let versions = self.every_shard(|s| self.store.get_number(&keys[s], ADMIN)).await?;
        Ok(versions.into_iter().map(Option::unwrap_or_default).collect())
    }

    /// Whether the layout was set up (old entries migrated into it).
    pub(crate) async fn is_set_up(&self) -> Result<bool, KeyError> {
        self.store.exists(&self.marker, ADMIN).await.map_err(shared)
    }

    /// Note that the layout holds every entry.
    pub(crate) async fn mark_set_up(&self) -> Result<(), KeyError> {
        self.store.set(&self.marker, "1", ADMIN).await.map_err(shared)
    }

    /// The store, for the subscription.
    pub(crate) fn store(&self) -> &RedisStore {
        &self.store
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_spread_keys_and_stay_put() {
        let mut seen = [0usize; SHARDS];
        for i in 0..64_000 {
            seen[shard_of(&format!("api\u{0}user\u{1}{i}"))] += 1;
        }
        assert!(seen.iter().all(|&n| (700..1300).contains(&n)), "{seen:?}");
        // Fixed forever: instances of different builds share one layout.
        assert_eq!(shard_of("api\u{0}user\u{1}alice"), shard_of("api\u{0}user\u{1}alice"));
        assert_eq!(shard_of(""), 0xcbf2_9ce4_8422_2325_u64 as usize % SHARDS);
    }
}
