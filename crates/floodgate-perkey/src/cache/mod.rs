//! Lookups through the cache: the per-thread front, the compact table, the
//! general cache, misses read from disk or from Redis, and the background
//! refresh of answers due.

pub(crate) mod compact;
pub(crate) mod front;

pub use front::BYTES as FRONT_BYTES;

use std::hash::BuildHasher;
use std::sync::PoisonError;
use std::sync::atomic::Ordering::{Acquire, Relaxed};
use std::time::Duration;

use crate::entries::value::{self, limits_of, lookup_key};
use crate::sharded::{self, Sharded};
use crate::{
    DEFAULT_CACHE_ENTRIES, DUE_QUEUE, KeyError, Limits, NeedsRead, PerKey, REFRESH_EVERY, REFRESH_RETRY_MS, random,
};

/// The cache's size and time to live.
#[derive(Debug, Clone, Copy)]
pub struct CacheOptions {
    /// Most cached answers (entries and "no entry" alike).
    pub entries: usize,
    /// How long a cached answer is used before it is read again; `None`:
    /// [`DEFAULT_CACHE_TTL`](crate::DEFAULT_CACHE_TTL) with entries in Redis, and no expiry on disk
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
pub(crate) const STRIPES: usize = 256;

/// Longest lookup key a cache slot holds inline.
pub(crate) const INLINE_KEY: usize = 46;

/// A cache key: the lookup key, inline when it is short (most are: the
/// domain, the descriptor key and a value of up to ~30 bytes), so that a
/// hit follows no pointer to compare it and a miss allocates nothing.
/// 48 bytes either way.
#[derive(Clone, PartialEq, Eq, Hash)]
pub(crate) enum CacheKey {
    Inline(u8, [u8; INLINE_KEY]),
    Heap(Box<str>),
}

impl CacheKey {
    pub(crate) fn new(key: &str) -> Self {
        match u8::try_from(key.len()) {
            Ok(n) if key.len() <= INLINE_KEY => {
                let mut bytes = [0; INLINE_KEY];
                bytes[..key.len()].copy_from_slice(key.as_bytes());
                Self::Inline(n, bytes)
            }
            _ => Self::Heap(key.into()),
        }
    }

    pub(crate) fn as_str(&self) -> &str {
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
pub(crate) struct Cached {
    limits: Option<Limits>,
    expires_ms: u64,
}

/// A compact answer hit while due for its refresh ([`REFRESH_SHARE`](crate::REFRESH_SHARE)).
pub(crate) struct Due {
    key: String,
    at: compact::Place,
}

/// What became of a miss's answer offered to the compact table.
pub(crate) enum Kept {
    /// Kept, with this code.
    Yes(u32),
    /// Not kept: something left the caches since its read began.
    Raced,
    /// Not an answer the table holds (own limits).
    NotCompact,
}

impl PerKey {
    /// Whether a descriptor of `domain` may have an entry.
    pub(crate) fn may_have(&self, domain: &str) -> bool {
        self.all_domains.load(Relaxed) || self.domains.load().contains(domain)
    }

    /// The limits of exactly this descriptor's entry, if any, through the
    /// caches ([`PerKey::cached_answer`]); a miss reads the store (on disk, on this
    /// thread; in Redis, in the next read batch). `None` when there is none,
    /// or the store failed to answer a miss (the files' rules apply then).
    /// Ready at its first poll unless the entries are in Redis
    /// ([`PerKey::answers_at_once`]) and the answer is not cached. Each call
    /// counts one hit or one miss.
    pub async fn lookup(&self, domain: &str, entries: &[(impl AsRef<str>, impl AsRef<str>)]) -> Option<Limits> {
        match self.cached_answer(domain, entries) {
            Ok(limits) => limits,
            Err(NeedsRead) => self.read_miss(lookup_key(domain, entries)?).await,
        }
    }

    /// Whether every [`PerKey::lookup`] is ready at its first poll: the
    /// entries are on disk (read on the caller's thread), not in Redis.
    pub fn answers_at_once(&self) -> bool {
        self.sharded.get().is_none()
    }

    /// The answer the caches hold for this descriptor (a hit counted), or
    /// the disk's (a miss counted); [`NeedsRead`] (nothing counted) when
    /// only a Redis read can answer.
    pub fn cached_answer(
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

    /// The Redis read of a miss of `key` ([`PerKey::cached_answer`] could not
    /// answer), shared with any read of the same key under way (one waits
    /// for the other's answer, counted as a hit); its answer cached.
    async fn read_miss(&self, key: String) -> Option<Limits> {
        let sharded = self.sharded.get()?;
        let at = self.compact.place(&key);
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

    /// [`PerKey::cached_answer`], a Redis miss answered `None` (for tests and
    /// tools; the service waits for the read).
    pub fn get(&self, domain: &str, entries: &[(impl AsRef<str>, impl AsRef<str>)]) -> Option<Limits> {
        self.cached_answer(domain, entries).ok().flatten()
    }

    /// The compact table's answer for the key at `at`, and its code, a hit
    /// counted.
    pub(crate) fn compact_hit(&self, at: compact::Place) -> Option<(Cached, u32)> {
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
    pub(crate) fn keep_compact(
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
    pub(crate) fn front_until(&self, key: &str, at: compact::Place, expires_ms: u64) -> u64 {
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
    pub(crate) async fn refresh_due(&self, sharded: &Sharded) {
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
    pub(crate) async fn refresh(&self, sharded: &Sharded, batch: &[Due]) {
        // Taken before the read, as a miss takes them: an answer expires
        // within the time to live of the state it was read from.
        let epoch = self.epoch.load(Acquire);
        let expiries: Vec<u64> = batch.iter().map(|_| self.expiry()).collect();
        let values = {
            let keys: Vec<&str> = batch.iter().map(|d| d.key.as_str()).collect();
            sharded.read_due(&keys).await
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

    pub(crate) fn fresh(&self, c: &Cached) -> bool {
        c.expires_ms == u64::MAX || self.now_ms() < c.expires_ms
    }

    /// When an answer read now expires: after the time to live, less up to
    /// a fifth of it at random, so answers read together (a cold start, a
    /// dropped cache) do not all expire together and read again at once.
    pub(crate) fn expiry(&self) -> u64 {
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
    pub(crate) fn lookup_disk(&self, key: &str, at: compact::Place) -> Result<(Cached, Option<u32>), Option<Limits>> {
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
    pub(crate) fn general_hit(&self, key: &CacheKey) -> Option<Cached> {
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
    pub(crate) fn general_hit_on_disk(&self, key: &CacheKey) -> Option<Cached> {
        if self.general_used.load(Relaxed) { self.general_hit(key) } else { None }
    }

    /// Hold `key`'s stripe: a disk miss holds it across its read and the
    /// keeping of its answer, and a write holds it while dropping the key.
    pub(crate) fn stripe(&self, key: &str) -> std::sync::MutexGuard<'_, ()> {
        let i = (self.stripes_hash.hash_one(key) % self.stripes.len() as u64) as usize;
        self.stripes[i].0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Read one entry's limits from the database (a miss).
    pub(crate) fn read_disk(&self, key: &str) -> Result<Option<Limits>, KeyError> {
        self.stats.misses.add(1);
        let read = self.disk.with(key, |v| self.decoded(key, Some(v))).inspect_err(|e| {
            self.stats.read_errors.fetch_add(1, Relaxed);
            tracing::warn!("a per-key entry could not be read: {e}; the files' rules apply");
        })?;
        Ok(read.flatten())
    }

    /// The limits of a stored value; a value that no longer validates is
    /// counted, logged and taken as none.
    pub(crate) fn decoded(&self, key: &str, value: Option<&[u8]>) -> Option<Limits> {
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
