//! The in-memory store: sharded, atomic per key, bounded, self-pruning.
//!
//! * **Sharded**: a key's hash (foldhash, randomly seeded against hash
//!   flooding) picks one of N mutex-guarded hash tables and probes it with
//!   the same hash. No global lock; an existing key's decision allocates
//!   nothing.
//! * **Small**: one slot per key is 64 bytes, one cache line: the key (up to
//!   22 bytes inline, longer ones on the heap), the state, its expiry and
//!   the limit's fingerprint; `sliding_buckets` and `sliding_log` add their
//!   history on the heap.
//! * **Expiry**: each slot records when its state is back to empty. Expired
//!   keys are dropped when a shard grows (its length doubles since its last
//!   sweep), at most every [`SWEEP_INTERVAL_S`] seconds on an insert, and by
//!   [`MemoryStore::sweep`]. Dropping an expired key loses nothing: its state
//!   is the empty state.
//! * **Bound**: at most `max_keys` keys (spread over the shards, each holding
//!   `ceil(max_keys / shards)`). When a shard is full it first drops its
//!   expired keys; then, with [`OnFull::Evict`] (the default) it evicts the
//!   keys closest to expiry — those with the least state left to lose —
//!   until an eighth of the shard is free, so the O(n) scan is paid once per
//!   n/8 inserts; with [`OnFull::Refuse`] it returns [`StoreError::Full`]
//!   for new keys (existing keys keep working) and the rule's failure policy
//!   decides. An evicted key starts again from empty: its owner may get up
//!   to one extra limit's worth. [`MemoryStore::evictions`] counts them.
//!
//! Peeks (`hits = 0`) and denials never create a key.

use std::future::Future;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use super::key::{Probe, StoredKey};
use super::table::Table;

use super::{Check, Op, all_or_nothing};
use crate::reservation::{Book, ReservationError, ReservationId, Settled};
use crate::{Clock, Decision, Limit, State, Store, StoreError, SystemClock};

/// Default bound on the number of keys: 2^21 (about 2.1 million).
pub const DEFAULT_MAX_KEYS: usize = 1 << 21;
/// Default number of shards.
pub const DEFAULT_SHARDS: usize = 256;
/// A shard with expired keys is swept at most this often on insert.
pub const SWEEP_INTERVAL_S: u32 = 10;

/// What a full store does with a new key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnFull {
    /// Evict the keys closest to expiry (default).
    #[default]
    Evict,
    /// Refuse new keys with [`StoreError::Full`].
    Refuse,
}

/// The in-memory store. Cheap to share behind an `Arc`; every method takes
/// `&self`.
pub struct MemoryStore<C = SystemClock> {
    shards: Box<[Shard]>,
    shard_mask: usize,
    hasher: foldhash::fast::RandomState,
    per_shard_max: usize,
    max_keys: usize,
    on_full: OnFull,
    clock: C,
    evictions: AtomicU64,
    /// The reservations made here.
    book: Book,
}

/// One shard, on its own cache lines so neighbours' locks do not contend.
#[repr(align(128))]
struct Shard(Mutex<ShardInner>);

struct ShardInner {
    table: Table<Slot>,
    /// The concurrency limits' slots in this shard, by limit fingerprint
    /// (kept under the shard's lock: no lock of their own).
    leases: std::collections::HashMap<u32, LeaseStats>,
    /// Sweep expired keys when an insert finds the table this long...
    sweep_at_len: usize,
    /// ...or finds this second reached.
    sweep_at_s: u32,
    /// When the last sweep ran: a full shard sweeps at most once a second.
    swept_s: u32,
    /// Sweeps in a row that left the table under a quarter full: it shrinks
    /// after [`SPARSE_SWEEPS`] of them, not at the first, so keys that
    /// expire together and come back (a window's worth of clients) do not
    /// shrink and regrow it every window (that churn fragmented the heap).
    sparse_sweeps: u8,
}

/// Sweeps in a row under a quarter full before a table shrinks.
const SPARSE_SWEEPS: u8 = 6;

/// A concurrency limit's slots in the store: held now, and acquired,
/// released and expired (a lease ended, or its key was dropped: swept,
/// evicted, or written by another limit) since the store began.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LeaseStats {
    /// Slots held now.
    pub held: u64,
    /// Slots acquired.
    pub acquired: u64,
    /// Slots released by their holders.
    pub released: u64,
    /// Slots whose lease ended (or whose key was dropped) while held.
    pub expired: u64,
}

impl LeaseStats {
    /// Slots `expired` (ended before the operation), then the held count
    /// moving from `before` to `after` by the operation.
    pub fn record(&mut self, expired: u64, before: u64, after: u64) {
        self.expired += expired;
        self.held = (self.held.saturating_sub(expired) + after).saturating_sub(before);
        if after > before {
            self.acquired += after - before;
        } else {
            self.released += before - after;
        }
    }

    fn add(&mut self, other: &LeaseStats) {
        self.held += other.held;
        self.acquired += other.acquired;
        self.released += other.released;
        self.expired += other.expired;
    }
}

/// Slots still held by a key's state as it is dropped: expired.
fn lost(leases: &mut std::collections::HashMap<u32, LeaseStats>, slot: &Slot) {
    let used = slot.state.leases_used();
    if used > 0 {
        leases.entry(slot.fp).or_default().record(used, used, used);
    }
}

/// One key: 64 bytes, one cache line.
#[repr(align(64))]
struct Slot {
    key: StoredKey,
    state: State,
    /// Second (since the epoch, rounded up) from which the state is empty.
    expires_s: u32,
    /// [`Limit::fingerprint`] of the limit that wrote `state`.
    fp: u32,
}

const MIN_SWEEP_LEN: usize = 64;

/// Builds a [`MemoryStore`].
#[derive(Debug, Clone)]
pub struct MemoryStoreBuilder<C = SystemClock> {
    max_keys: usize,
    shards: usize,
    on_full: OnFull,
    clock: C,
}

impl MemoryStore<SystemClock> {
    /// A store with the defaults: system clock, [`DEFAULT_MAX_KEYS`],
    /// [`DEFAULT_SHARDS`], [`OnFull::Evict`].
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// Start building a store.
    pub fn builder() -> MemoryStoreBuilder<SystemClock> {
        MemoryStoreBuilder {
            max_keys: DEFAULT_MAX_KEYS,
            shards: DEFAULT_SHARDS,
            on_full: OnFull::Evict,
            clock: SystemClock::new(),
        }
    }
}

impl Default for MemoryStore<SystemClock> {
    fn default() -> Self {
        Self::new()
    }
}

impl<C: Clock> MemoryStoreBuilder<C> {
    /// Bound on the number of keys (at least 1).
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = max_keys.max(1);
        self
    }

    /// Number of shards, rounded up to a power of two in `1..=65536`.
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = shards.clamp(1, 1 << 16).next_power_of_two();
        self
    }

    /// What to do with a new key when the store is full.
    pub fn on_full(mut self, on_full: OnFull) -> Self {
        self.on_full = on_full;
        self
    }

    /// The clock the store reads for [`MemoryStore::apply_sync`].
    pub fn clock<D: Clock>(self, clock: D) -> MemoryStoreBuilder<D> {
        MemoryStoreBuilder { max_keys: self.max_keys, shards: self.shards, on_full: self.on_full, clock }
    }

    /// Build the store.
    pub fn build(self) -> MemoryStore<C> {
        // Fewer shards than keys would leave shards with a bound of zero.
        let shards = self.shards.min(self.max_keys.next_power_of_two()).max(1);
        MemoryStore {
            shards: (0..shards)
                .map(|_| {
                    Shard(Mutex::new(ShardInner {
                        leases: std::collections::HashMap::new(),
                        table: Table::new(),
                        sweep_at_len: MIN_SWEEP_LEN,
                        sweep_at_s: 0,
                        swept_s: 0,
                        sparse_sweeps: 0,
                    }))
                })
                .collect(),
            shard_mask: shards - 1,
            hasher: foldhash::fast::RandomState::default(),
            per_shard_max: self.max_keys.div_ceil(shards),
            max_keys: self.max_keys,
            on_full: self.on_full,
            clock: self.clock,
            evictions: AtomicU64::new(0),
            book: Book::default(),
        }
    }
}

impl<C: Clock> MemoryStore<C> {
    /// Decide `hits` units of `limit` for `key` now (the store's clock).
    #[inline]
    pub fn apply_sync(&self, key: &str, limit: &Limit, hits: u64) -> Result<Decision, StoreError> {
        self.apply_at(key, limit, hits, self.clock.now_us())
    }

    /// Decide at an explicit time (microseconds since the epoch), e.g. when
    /// replaying a trace. A time earlier than a key last saw is read as that
    /// key's last time (state never rewinds).
    #[inline]
    pub fn apply_at(&self, key: &str, limit: &Limit, hits: u64, now_us: u64) -> Result<Decision, StoreError> {
        self.apply_bytes_at(key.as_bytes(), limit, hits, now_us)
    }

    /// [`MemoryStore::apply_at`] for a key given as bytes (any bytes: the
    /// store compares and hashes keys as bytes; a `&str` key is its UTF-8).
    // Always inlined (the rare insert is out of line): called out of line,
    // the `Decision` was built in a temporary and copied to the caller,
    // and that copy's wide loads over the one-byte `allowed` store stalled
    // a one-key decision by a fifth (BENCHMARKS.md, "Core: in-memory store vs governor").
    #[inline(always)]
    pub fn apply_bytes_at(&self, key: &[u8], limit: &Limit, hits: u64, now_us: u64) -> Result<Decision, StoreError> {
        self.decide_bytes_at(key, limit, hits, false, now_us)
    }

    /// A late charge of `hits` for `key` at `now_us` ([`Op::Late`]):
    /// counted whatever the limit's own charge, never denied.
    pub fn late_at(&self, key: &str, limit: &Limit, hits: u64, now_us: u64) -> Result<Decision, StoreError> {
        self.decide_bytes_at(key.as_bytes(), limit, hits, true, now_us)
    }

    /// [`MemoryStore::apply_bytes_at`], or with `late` a late charge (a
    /// constant at each caller, so each inlines to its own path).
    #[inline(always)]
    fn decide_bytes_at(
        &self,
        key: &[u8],
        limit: &Limit,
        hits: u64,
        late: bool,
        now_us: u64,
    ) -> Result<Decision, StoreError> {
        if limit.is_concurrency() {
            // Leases, accounted ([`MemoryStore::lease_stats`]): an
            // anonymous acquire, or a peek.
            let hits = if late { 0 } else { hits };
            return self.leases_bytes_at(key, limit, now_us, hits > 0, |s| limit.acquire(s, now_us, hits, 0));
        }
        let hash = self.hasher.hash_one(key);
        let probe = Probe::new(key, hash);
        let mut shard = self.lock(hash);
        if let Some(slot) = slot_of(&mut shard, hash, &probe, limit) {
            let d = if late {
                limit.charge_late(&mut slot.state, now_us, hits)
            } else {
                limit.apply(&mut slot.state, now_us, hits)
            };
            // A denial or a peek leaves the state, and so its expiry, as it was.
            if d.allowed && hits > 0 {
                slot.expires_s = expiry_s(now_us, &d);
            }
            return Ok(d);
        }
        self.insert_at(shard, &probe, hash, limit, hits, late, now_us)
    }

    /// The rest of [`MemoryStore::apply_bytes_at`] for a key the shard does
    /// not hold: decided from the empty state, and stored if that changed
    /// it. Out of line, so the common path (an existing key) stays small
    /// enough to inline into its caller, where its `Decision` is built in
    /// place instead of copied out through memory.
    #[inline(never)]
    #[allow(clippy::too_many_arguments)]
    fn insert_at(
        &self,
        mut shard: MutexGuard<'_, ShardInner>,
        probe: &Probe<'_>,
        hash: u64,
        limit: &Limit,
        hits: u64,
        late: bool,
        now_us: u64,
    ) -> Result<Decision, StoreError> {
        let mut state = State::new();
        let d = if late { limit.charge_late(&mut state, now_us, hits) } else { limit.apply(&mut state, now_us, hits) };
        if !d.allowed || hits == 0 {
            return Ok(d);
        }
        self.make_room(&mut shard, seconds(now_us))?;
        let slot = Slot { key: StoredKey::new(probe), state, expires_s: expiry_s(now_us, &d), fp: limit.fingerprint() };
        shard.table.insert_unique(hash, slot, |s| self.hasher.hash_one(s.key.as_bytes()));
        Ok(d)
    }

    /// Give back, at `now_us`, `hits` admitted for `key` at `at_us` (see
    /// [`Limit::refund`]). A key that is gone, or was since written by another
    /// limit, has nothing to give back.
    pub fn refund_at(&self, key: &str, limit: &Limit, hits: u64, at_us: u64, now_us: u64) {
        let key = key.as_bytes();
        let hash = self.hasher.hash_one(key);
        let probe = Probe::new(key, hash);
        let mut shard = self.lock(hash);
        if let Some(slot) = shard.table.find_mut(hash, |s| s.key.matches(&probe))
            && slot.fp == limit.fingerprint()
        {
            limit.refund(&mut slot.state, at_us, now_us, hits);
        }
    }

    /// A refund of `hits` for `key` at `now_us` ([`Limit::give_back`]),
    /// answered as a peek afterwards. A key the store does not hold (never
    /// written, expired, or written since by another limit) has nothing to
    /// give back: its answer is the empty state's.
    pub fn give_back_at(&self, key: &str, limit: &Limit, hits: u64, now_us: u64) -> Decision {
        let key = key.as_bytes();
        let hash = self.hasher.hash_one(key);
        let probe = Probe::new(key, hash);
        let mut shard = self.lock(hash);
        match slot_of(&mut shard, hash, &probe, limit) {
            Some(slot) => limit.give_back(&mut slot.state, now_us, hits),
            None => limit.give_back(&mut State::new(), now_us, 0),
        }
    }

    /// The reservations made through this store (a memory region's
    /// decisions keep theirs here too).
    pub fn book(&self) -> &Book {
        &self.book
    }

    /// [`Store::apply_all`] at an explicit time.
    pub fn apply_all_at(&self, checks: &[Check<'_>], now_us: u64, out: &mut Vec<Result<Decision, StoreError>>) {
        all_or_nothing(checks, out, |c| self.check_at(c, now_us), |c| self.undo_at(c, now_us));
    }

    /// Undo check `c` just decided at `now_us` for a request another of its
    /// limits denied: its hits given back, or the lease it took released.
    pub fn undo_at(&self, c: &Check<'_>, now_us: u64) {
        match c.op {
            Op::Acquire { lease } if lease != 0 && c.op.on_leases(c.limit) => {
                let _ = self.leases_at(c.key, c.limit, now_us, false, |s| c.limit.release(s, now_us, Some(lease)));
            }
            // An anonymous slot (lease 0): the newest anonymous lease.
            Op::Take | Op::Acquire { .. } if c.limit.is_concurrency() => {
                let _ = self.leases_at(c.key, c.limit, now_us, false, |s| {
                    c.limit.refund(s, now_us, now_us, c.hits);
                    c.limit.acquire(s, now_us, 0, 0)
                });
            }
            _ => self.refund_at(c.key, c.limit, c.hits, now_us, now_us),
        }
    }

    /// A lease operation of a concurrency limit on `key`'s state at
    /// `now_us` (`op` answers it): a key the store does not hold is met
    /// empty, and stored only when `create` and the answer took slots.
    /// The key's expiry follows its leases: it is empty once the last ends.
    fn leases_at(
        &self,
        key: &str,
        limit: &Limit,
        now_us: u64,
        create: bool,
        op: impl FnOnce(&mut State) -> Decision,
    ) -> Result<Decision, StoreError> {
        self.leases_bytes_at(key.as_bytes(), limit, now_us, create, op)
    }

    /// [`MemoryStore::leases_at`] for a key given as bytes.
    #[inline(never)]
    fn leases_bytes_at(
        &self,
        key: &[u8],
        limit: &Limit,
        now_us: u64,
        create: bool,
        op: impl FnOnce(&mut State) -> Decision,
    ) -> Result<Decision, StoreError> {
        let hash = self.hasher.hash_one(key);
        let probe = Probe::new(key, hash);
        let mut shard = self.lock(hash);
        if let Some(slot) = slot_of(&mut shard, hash, &probe, limit) {
            let expired = limit.expire_leases(&mut slot.state, now_us);
            let before = slot.state.leases_used();
            let d = op(&mut slot.state);
            let after = slot.state.leases_used();
            slot.expires_s = expiry_s(now_us, &d);
            shard.leases.entry(limit.fingerprint()).or_default().record(expired, before, after);
            return Ok(d);
        }
        let mut state = State::new();
        let d = op(&mut state);
        if !create || !d.allowed || d.remaining == d.limit {
            return Ok(d);
        }
        self.make_room(&mut shard, seconds(now_us))?;
        shard.leases.entry(limit.fingerprint()).or_default().record(0, 0, state.leases_used());
        let slot =
            Slot { key: StoredKey::new(&probe), state, expires_s: expiry_s(now_us, &d), fp: limit.fingerprint() };
        shard.table.insert_unique(hash, slot, |s| self.hasher.hash_one(s.key.as_bytes()));
        Ok(d)
    }

    /// Every concurrency limit's slots in the store, by limit fingerprint
    /// ([`Limit::fingerprint`]: two limits of the same parameters share
    /// theirs).
    pub fn lease_stats(&self) -> Vec<(u32, LeaseStats)> {
        let mut all: std::collections::HashMap<u32, LeaseStats> = std::collections::HashMap::new();
        for s in self.shards.iter() {
            let inner = s.0.lock().unwrap_or_else(PoisonError::into_inner);
            for (fp, st) in &inner.leases {
                all.entry(*fp).or_default().add(st);
            }
        }
        let mut out: Vec<(u32, LeaseStats)> = all.into_iter().collect();
        out.sort_unstable_by_key(|(fp, _)| *fp);
        out
    }

    /// One check at `now_us`, as its [`Op`] says (alone: a request's
    /// checks go through [`MemoryStore::apply_all_at`], all or nothing).
    pub fn check_at(&self, c: &Check<'_>, now_us: u64) -> Result<Decision, StoreError> {
        match c.op {
            // A refund of slots without an id.
            Op::Refund if c.limit.is_concurrency() => {
                self.leases_at(c.key, c.limit, now_us, false, |s| c.limit.give_back(s, now_us, c.hits))
            }
            Op::Take => self.apply_at(c.key, c.limit, c.hits, now_us),
            Op::Refund => Ok(self.give_back_at(c.key, c.limit, c.hits, now_us)),
            Op::Late => self.late_at(c.key, c.limit, c.hits, now_us),
            Op::Return { taken_at_us } => {
                self.refund_at(c.key, c.limit, c.hits, taken_at_us, now_us);
                // A peek, as a refund answers (not a gate).
                Ok(self.give_back_at(c.key, c.limit, 0, now_us))
            }
            Op::Acquire { lease } if c.op.on_leases(c.limit) => {
                self.leases_at(c.key, c.limit, now_us, true, |s| c.limit.acquire(s, now_us, c.hits, lease))
            }
            Op::Acquire { .. } => self.apply_at(c.key, c.limit, c.hits, now_us),
            Op::Release { lease } if c.op.on_leases(c.limit) => {
                self.leases_at(c.key, c.limit, now_us, false, |s| c.limit.release(s, now_us, lease))
            }
            Op::Extend { lease } if c.op.on_leases(c.limit) => {
                self.leases_at(c.key, c.limit, now_us, false, |s| c.limit.extend(s, now_us, lease))
            }
            // Beside a concurrency limit, a rate only peeks (its expiry stays).
            Op::Release { .. } | Op::Extend { .. } => Ok(self.give_back_at(c.key, c.limit, 0, now_us)),
        }
    }

    /// Drop every expired key now (e.g. from a periodic task); returns how
    /// many were dropped.
    pub fn sweep(&self) -> usize {
        let now_us = self.clock.now_us();
        // Reservations whose records have outlived their retention too.
        self.book.sweep(now_us);
        let now_s = seconds(now_us);
        self.shards
            .iter()
            .map(|s| {
                let mut inner = s.0.lock().unwrap_or_else(PoisonError::into_inner);
                sweep_expired(&mut inner, now_s, &self.hasher)
            })
            .sum()
    }

    /// Number of keys held (expired ones included until swept).
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.0.lock().unwrap_or_else(PoisonError::into_inner).table.len()).sum()
    }

    /// Whether the store holds no key.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Keys evicted because the store was full, since it was built.
    pub fn evictions(&self) -> u64 {
        self.evictions.load(Ordering::Relaxed)
    }

    /// The configured bound on the number of keys.
    pub fn max_keys(&self) -> usize {
        self.max_keys
    }

    /// The store's clock.
    pub fn clock(&self) -> &C {
        &self.clock
    }

    /// Approximate bytes held: slots (with hash-table slack), key bytes and
    /// per-key history.
    pub fn memory_bytes(&self) -> usize {
        self.shards
            .iter()
            .map(|s| {
                let inner = s.0.lock().unwrap_or_else(PoisonError::into_inner);
                inner.table.capacity() * size_of::<Option<Slot>>()
                    + inner.table.iter().map(|slot| slot.key.heap_bytes() + slot.state.heap_bytes()).sum::<usize>()
            })
            .sum()
    }

    #[inline]
    fn lock(&self, hash: u64) -> MutexGuard<'_, ShardInner> {
        // The table probes from the low bits and long keys keep the top 32:
        // pick the shard from bits in between so the probe start stays
        // uniform within a shard (true for any table under 2^32 slots).
        let i = usize::try_from(hash >> 32).unwrap_or(0) & self.shard_mask;
        self.shards[i].0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Ensure the shard can take one more key (slow path: new keys only).
    fn make_room(&self, shard: &mut ShardInner, now_s: u32) -> Result<(), StoreError> {
        let len = shard.table.len();
        let full = len >= self.per_shard_max;
        if len >= shard.sweep_at_len
            || (now_s >= shard.sweep_at_s && len >= MIN_SWEEP_LEN)
            || (full && now_s != shard.swept_s)
        {
            sweep_expired(shard, now_s, &self.hasher);
        }
        let max = self.per_shard_max;
        if shard.table.len() < max {
            return Ok(());
        }
        match self.on_full {
            OnFull::Refuse => Err(StoreError::Full { max_keys: self.max_keys }),
            OnFull::Evict => {
                let ShardInner { table, leases, .. } = shard;
                let evicted = evict_nearest_expiry(table, leases, (max / 8).max(1), max, &self.hasher);
                self.evictions.fetch_add(evicted as u64, Ordering::Relaxed);
                Ok(())
            }
        }
    }
}

impl<C: Clock> Store for MemoryStore<C> {
    #[inline]
    fn apply(&self, key: &str, limit: &Limit, hits: u64) -> impl Future<Output = Result<Decision, StoreError>> + Send {
        std::future::ready(self.apply_sync(key, limit, hits))
    }

    #[inline]
    fn apply_all(
        &self,
        checks: &[Check<'_>],
        out: &mut Vec<Result<Decision, StoreError>>,
    ) -> impl Future<Output = ()> + Send {
        self.apply_all_at(checks, self.clock.now_us(), out);
        std::future::ready(())
    }

    // Always inlined, as `apply_bytes_at` is (into the tower layer's `call`).
    #[inline(always)]
    fn apply_bytes<'a>(
        &'a self,
        key: &[u8],
        limit: &'a Limit,
        hits: u64,
    ) -> impl Future<Output = Result<Decision, StoreError>> + Send + use<'a, C> {
        std::future::ready(self.apply_bytes_at(key, limit, hits, self.clock.now_us()))
    }

    #[inline]
    fn answers_at_once(&self) -> bool {
        true
    }

    fn reserve(
        &self,
        checks: &[Check<'_>],
        ttls_us: &[u64],
        out: &mut Vec<Result<Decision, StoreError>>,
    ) -> impl Future<Output = Result<Option<ReservationId>, ReservationError>> + Send {
        let now = self.clock.now_us();
        std::future::ready(self.book.reserve_with(checks, ttls_us, now, out, |out| self.apply_all_at(checks, now, out)))
    }

    fn settle(
        &self,
        id: ReservationId,
        actual: &[u64],
    ) -> impl Future<Output = Result<Settled, ReservationError>> + Send {
        let now = self.clock.now_us();
        std::future::ready(self.book.settle_with(id, actual, now, |c, out| self.apply_all_at(c, now, out)))
    }

    #[inline]
    fn keys_by_bytes(&self) -> bool {
        true
    }
}

impl<C> std::fmt::Debug for MemoryStore<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("shards", &self.shards.len())
            .field("max_keys", &self.max_keys)
            .field("on_full", &self.on_full)
            .finish_non_exhaustive()
    }
}

/// The slot of the key `probe` in `shard`, its state emptied if another
/// limit wrote it.
#[inline(always)]
fn slot_of<'s>(shard: &'s mut ShardInner, hash: u64, probe: &Probe<'_>, limit: &Limit) -> Option<&'s mut Slot> {
    let ShardInner { table, leases, .. } = shard;
    let slot = table.find_mut(hash, |s| s.key.matches(probe))?;
    if slot.fp != limit.fingerprint() {
        lost(leases, slot);
        slot.state = State::new();
        slot.fp = limit.fingerprint();
    }
    Some(slot)
}

fn sweep_expired(shard: &mut ShardInner, now_s: u32, hasher: &foldhash::fast::RandomState) -> usize {
    let before = shard.table.len();
    let rehash = |s: &Slot| hasher.hash_one(s.key.as_bytes());
    if shard.table.iter().any(|s| s.expires_s <= now_s) {
        let ShardInner { table, leases, .. } = shard;
        table.retain(
            |s| {
                let keep = s.expires_s > now_s;
                if !keep {
                    lost(leases, s);
                }
                keep
            },
            rehash,
        );
    }
    let len = shard.table.len();
    if shard.table.capacity() > 4 * len.max(MIN_SWEEP_LEN) {
        shard.sparse_sweeps = shard.sparse_sweeps.saturating_add(1);
        if shard.sparse_sweeps >= SPARSE_SWEEPS {
            shard.table.shrink_to(2 * len, rehash);
            shard.sparse_sweeps = 0;
        }
    } else {
        shard.sparse_sweeps = 0;
    }
    shard.sweep_at_len = (2 * len).max(MIN_SWEEP_LEN);
    shard.sweep_at_s = now_s.saturating_add(SWEEP_INTERVAL_S);
    shard.swept_s = now_s;
    before - len
}

/// Evict the slots closest to expiry until `free` slots are free below `max`.
fn evict_nearest_expiry(
    table: &mut Table<Slot>,
    leases: &mut std::collections::HashMap<u32, LeaseStats>,
    free: usize,
    max: usize,
    hasher: &foldhash::fast::RandomState,
) -> usize {
    let keep = max.saturating_sub(free);
    let excess = table.len().saturating_sub(keep);
    if excess == 0 {
        return 0;
    }
    let mut expiries: Vec<u32> = table.iter().map(|s| s.expires_s).collect();
    let (_, &mut cut, _) = expiries.select_nth_unstable(excess - 1);
    let mut ties = excess - expiries.iter().filter(|&&e| e < cut).count();
    table.retain(
        |s| {
            let keep = if s.expires_s < cut {
                false
            } else if s.expires_s == cut && ties > 0 {
                ties -= 1;
                false
            } else {
                true
            };
            if !keep {
                lost(leases, s);
            }
            keep
        },
        |s| hasher.hash_one(s.key.as_bytes()),
    );
    excess
}

#[inline]
fn seconds(us: u64) -> u32 {
    u32::try_from(us / 1_000_000).unwrap_or(u32::MAX)
}

/// The second (rounded up) at which the state `d` left is empty again:
/// `ceil((now + reset) / 1 s)`, as whole seconds of the reset plus the
/// rest, without a round trip of the reset through 128-bit microseconds.
#[inline]
fn expiry_s(now_us: u64, d: &Decision) -> u32 {
    let rest = now_us.saturating_add(u64::from(d.reset_after.subsec_micros()));
    let at = d.reset_after.as_secs().saturating_add(rest.div_ceil(1_000_000));
    u32::try_from(at).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use floodgate_testing::at_once;

    #[test]
    fn expiry_is_the_reset_rounded_up_to_a_second() {
        let at = |now_us: u64, reset_us: u64| {
            let d = Decision { reset_after: std::time::Duration::from_micros(reset_us), ..Decision::default() };
            expiry_s(now_us, &d)
        };
        for (now, reset) in [(0, 0), (1, 0), (999_999, 1), (1_000_000, 0), (1_500_000, 2_500_000), (7, 86_400_000_000)]
        {
            assert_eq!(u64::from(at(now, reset)), (now + reset).div_ceil(1_000_000), "{now} + {reset}");
        }
        assert_eq!(at(u64::MAX, 1), u32::MAX);
    }

    #[test]
    fn a_key_and_its_bytes_are_one_key_and_any_bytes_are_a_key() {
        let store = MemoryStore::builder().clock(crate::ManualClock::new(0)).build();
        let limit = Limit::new(crate::Algorithm::FixedWindow, 2, std::time::Duration::from_secs(60)).unwrap();
        let remaining = |key: &[u8]| at_once(store.apply_bytes(key, &limit, 1)).unwrap().remaining;
        assert_eq!(at_once(store.apply("alice", &limit, 1)).unwrap().remaining, 1);
        assert_eq!(remaining(b"alice"), 0);
        // Not UTF-8, and two values that would read alike as lossy text.
        assert_eq!(remaining(b"\xff"), 1);
        assert_eq!(remaining(b"\xfe"), 1);
        assert_eq!(remaining(b"\xff"), 0);
        // Long keys (on the heap) too.
        let long = [0xffu8; 40];
        assert_eq!(remaining(&long), 1);
        assert_eq!(remaining(&long), 0);
        assert_eq!(store.len(), 4);
    }

    /// A store that answers at once through the trait's defaults only.
    struct TextOnly(MemoryStore);

    impl Store for TextOnly {
        async fn apply(&self, key: &str, limit: &Limit, hits: u64) -> Result<Decision, StoreError> {
            self.0.apply_sync(key, limit, hits)
        }

        async fn apply_all(&self, checks: &[Check<'_>], out: &mut Vec<Result<Decision, StoreError>>) {
            self.0.apply_all(checks, out).await;
        }
    }

    #[test]
    fn a_text_store_takes_utf8_bytes_as_text_and_others_as_lossy_text() {
        let store = TextOnly(MemoryStore::new());
        assert!(!store.keys_by_bytes() && !store.answers_at_once(), "the defaults");
        let limit = Limit::new(crate::Algorithm::FixedWindow, 2, std::time::Duration::from_secs(60)).unwrap();
        let d = at_once(store.apply_bytes("caf\u{e9}".as_bytes(), &limit, 1)).unwrap();
        assert_eq!(d.remaining, 1, "the decision is given");
        assert_eq!(store.0.apply_sync("caf\u{e9}", &limit, 1).unwrap().remaining, 0, "the same key");
        // A text store cannot hold other bytes: they are read as text, each
        // bad byte U+FFFD (as a text store's callers always gave them).
        assert_eq!(at_once(store.apply_bytes(b"\xff", &limit, 1)).unwrap().remaining, 1);
        assert_eq!(store.0.apply_sync("\u{fffd}", &limit, 1).unwrap().remaining, 0, "the same key");
        assert_eq!(store.0.len(), 2);
    }

    #[test]
    fn a_slot_is_one_cache_line() {
        // key 24 (inline up to 22 bytes) + state 32 + expiry 4 + fingerprint 4;
        // an empty slot is a niche of the key's tag, not another byte.
        assert_eq!(size_of::<Slot>(), 64);
        assert_eq!(size_of::<Option<Slot>>(), 64);
        assert_eq!(size_of::<State>(), 32);
    }
}
