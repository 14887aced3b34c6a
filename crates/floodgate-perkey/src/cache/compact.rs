//! The shared cache's table of compact answers: a bucket of seven answers
//! in two cache lines, each answer a fingerprint of its key and one word.
//!
//! Why: at a million cached answers, a hit in a general-purpose cache is
//! three dependent main-memory reads (its hash table's control bytes, the
//! index they lead to, the entry that index names: measured, they are 70%
//! of a hit's time), behind a shard lock every thread writes. Most answers
//! are small: "no entry", or a tier. Those are kept here, seven to a
//! 128-byte bucket, so that a hit reads two neighbouring lines with no
//! lock and no locked instruction, and a million answers take 18 MiB: the
//! hot part of the table stays in the processor's caches.
//!
//! * **Shape.** A bucket is chosen by a randomly seeded hash of the key
//!   (foldhash: a client cannot aim keys at one bucket). Its first line
//!   holds its version and the fingerprints of its [`WAYS`] answers, its
//!   second their answers ("no entry" or a tier's id), shards and expiries,
//!   and their use counts. Any key length fits; own limits stay in the
//!   general cache beside this one. The table is allocated at its first
//!   answer: [`BYTES_PER_BUCKET`] a bucket.
//! * **Fingerprints, not keys.** A slot keeps a 64-bit fingerprint of its
//!   key (SipHash-1-3 under a random 128-bit key, std's `RandomState`), not
//!   the key. A lookup takes another key's answer only if both keys fall in
//!   the same bucket and agree in all 64 bits of a keyed pseudorandom
//!   function: about 2^-61 per lookup of a key not held (7 slots compared),
//!   so once in tens of thousands of years at a million lookups a second,
//!   and a client that does not know the key cannot aim for it.
//! * **Eviction.** Per bucket, least frequently used, with aging: a hit
//!   counts on its slot (saturating at 255); a new answer takes an empty
//!   or expired slot, else the one with the lowest count (ties: a place
//!   that depends on the new key). A new answer starts at 0, so one used
//!   once is the next to go, and the answers in use stay. Aging: every
//!   [`AGE_EVERY`] evictions in a bucket halve its counts, so answers that
//!   were hot once and are no longer used go in time. (Simulated with
//!   Zipf(1) keys over a million and 100 000 answers: 0.806 of lookups
//!   hit with 7 ways, 0.803 with 8, 0.804 with 15, against 0.84 for a
//!   perfect choice of the top keys; BENCHMARKS.md has the measured rate.)
//! * **Concurrency.** Each bucket has a version (a sequence lock): a writer
//!   makes it odd, writes, makes it even again; a reader reads the slots
//!   and takes the answer only if the version was even and unchanged. The
//!   slots are atomics, so a reader racing a writer reads stale words,
//!   never undefined ones, and throws them away. A hit's count is a plain
//!   load and store of the bucket's counts word, not an atomic add: a
//!   count lost to a racing hit or writer only blurs the eviction order.

use std::hash::BuildHasher;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering, fence};

use crate::Limits;
use crate::entries::value::{MAX_TIER_NAMES, tier_id, tier_named};
use crate::sharded::{SHARDS, shard_of};

/// Answers per bucket.
pub(crate) const WAYS: usize = 7;
/// Bytes of one bucket (two cache lines).
pub(crate) const BYTES_PER_BUCKET: usize = std::mem::size_of::<Bucket>();

/// A bucket's words:
/// * `[VERSION]`: its version (odd while a writer holds it), the top byte
///   counting evictions since its counts were last halved;
/// * `[FP + i]`: slot `i`'s fingerprint (0: empty);
/// * `[META + i]`: slot `i`'s answer ([`ANSWER_BITS`]: 0 no entry, `n` the
///   tier with id `n - 1`), its key's Redis shard, and when it expires
///   (milliseconds after the store opened; [`NEVER`]: never);
/// * `[COUNTS]`: the slots' use counts, a byte each (slot `i` in byte `i`).
#[repr(C, align(128))]
#[derive(Default)]
struct Bucket([AtomicU64; 16]);

const VERSION: usize = 0;
const FP: usize = 1;
const META: usize = 8;
const COUNTS: usize = 15;

const ANSWER_BITS: u32 = 17;
const ANSWER_MASK: u64 = (1 << ANSWER_BITS) - 1;
const SHARD_BITS: u32 = 6;
const EXPIRY_SHIFT: u32 = ANSWER_BITS + SHARD_BITS;
/// The expiry of an answer that does not expire (and of any later than
/// 2^41 ms, 69 years, after the store opened).
const NEVER: u64 = u64::MAX >> EXPIRY_SHIFT;
const _: () = assert!(MAX_TIER_NAMES < 1 << ANSWER_BITS && SHARDS <= 1 << SHARD_BITS && FP + WAYS == META);
const _: () = assert!(META + WAYS == COUNTS && WAYS <= 8);

/// Evictions in a bucket between two halvings of its counts (counted in
/// the top byte of the bucket's version).
const AGE_EVERY: u64 = 32;
const AGE_SHIFT: u32 = 56;

/// The code of an answer this table can hold: 0 for "no entry", `n` for
/// the tier with id `n - 1`; `None` for own limits (and a tier name never
/// interned, which no stored entry gives).
pub(crate) fn code_of(limits: &Option<Limits>) -> Option<u32> {
    match limits {
        None => Some(0),
        Some(Limits::Tier(t)) => tier_id(t).map(|id| id + 1),
        Some(Limits::Own(_)) => None,
    }
}

/// The answer of a code ([`code_of`]).
pub(crate) fn answer_of(code: u32) -> Option<Option<Limits>> {
    match code {
        0 => Some(None),
        n => tier_named(n - 1).map(|t| Some(Limits::Tier(t))),
    }
}

/// A slot's answer word.
fn meta(code: u32, shard: usize, expires_ms: u64) -> u64 {
    u64::from(code) | (shard as u64) << ANSWER_BITS | expires_ms.min(NEVER) << EXPIRY_SHIFT
}

/// When an answer word expires (`u64::MAX`: never).
fn expiry(meta: u64) -> u64 {
    match meta >> EXPIRY_SHIFT {
        NEVER => u64::MAX,
        at => at,
    }
}

fn shard(meta: u64) -> usize {
    ((meta >> ANSWER_BITS) & ((1 << SHARD_BITS) - 1)) as usize
}

/// The table (see the module's documentation).
pub(crate) struct Compact {
    buckets: usize,
    /// Made at the first answer.
    table: OnceLock<Box<[Bucket]>>,
    to_bucket: foldhash::fast::RandomState,
    to_fingerprint: std::hash::RandomState,
    len: AtomicUsize,
}

impl std::fmt::Debug for Compact {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Compact").field("capacity", &self.capacity()).field("len", &self.len()).finish()
    }
}

/// What a lookup found.
pub(crate) enum Found {
    /// The answer's code ([`code_of`]), and when it expires.
    Hit(u32, u64),
    /// No answer for the key (or an expired one).
    Miss,
}

/// Where a key's answer is kept: its bucket and its fingerprint (worked out
/// once a lookup, and the front's too).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Place {
    bucket: usize,
    /// The key's fingerprint: 64 bits of a keyed hash, never 0.
    pub(crate) fp: u64,
}

impl Compact {
    /// A table of at least `capacity` answers (rounded up to whole
    /// buckets).
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            buckets: capacity.max(1).div_ceil(WAYS),
            table: OnceLock::new(),
            to_bucket: foldhash::fast::RandomState::default(),
            to_fingerprint: std::hash::RandomState::new(),
            len: AtomicUsize::new(0),
        }
    }

    /// Answers it holds at most.
    fn capacity(&self) -> usize {
        self.buckets * WAYS
    }

    /// Where `key`'s answer is kept.
    pub(crate) fn place(&self, key: &str) -> Place {
        let h = self.to_bucket.hash_one(key);
        // Multiply-shift onto the buckets (no power of two needed).
        let bucket = ((u128::from(h) * self.buckets as u128) >> 64) as usize;
        Place { bucket, fp: self.to_fingerprint.hash_one(key).max(1) }
    }

    /// The words of the bucket at `at` (`None` before the first answer).
    fn bucket(&self, at: Place) -> Option<&[AtomicU64; 16]> {
        Some(&self.table.get()?[at.bucket].0)
    }

    /// The answer for the key at `at`, at `now_ms`, counting the hit.
    pub(crate) fn get(&self, at: Place, now_ms: impl FnOnce() -> u64) -> Found {
        let Some(w) = self.bucket(at) else { return Found::Miss };
        let fp = at.fp;
        let mut spins = 0u32;
        loop {
            let v = w[VERSION].load(Ordering::Acquire);
            if v & 1 == 0 {
                let found = find(w, fp).map(|i| (i, w[META + i].load(Ordering::Relaxed)));
                fence(Ordering::Acquire);
                if w[VERSION].load(Ordering::Relaxed) == v {
                    let Some((i, meta)) = found else { return Found::Miss };
                    let expires = expiry(meta);
                    if expires != u64::MAX && now_ms() >= expires {
                        return Found::Miss;
                    }
                    let counts = &w[COUNTS];
                    let c = counts.load(Ordering::Relaxed);
                    if (c >> (8 * i)) & 0xFF < 0xFF {
                        // Racy by design (see the module's documentation).
                        counts.store(c + (1 << (8 * i)), Ordering::Relaxed);
                    }
                    return Found::Hit((meta & ANSWER_MASK) as u32, expires);
                }
            }
            spins += 1;
            if spins > 64 {
                // A writer holds the bucket for long (it was preempted):
                // a miss reads the store, which is always right.
                return Found::Miss;
            }
            std::hint::spin_loop();
        }
    }

    /// Keep answer `code` ([`code_of`]) for `key`, placed at `at`, until
    /// `expires_ms` (it is `now_ms`), if `still` holds with the bucket
    /// locked (the caller's check that nothing changed the key since its
    /// read: a write that drops the key after `still` turns false finds the
    /// answer here and drops it). Whether it was kept.
    pub(crate) fn insert(
        &self,
        key: &str,
        at: Place,
        code: u32,
        expires_ms: u64,
        now_ms: u64,
        still: impl FnOnce() -> bool,
    ) -> bool {
        let table = self.table.get_or_init(|| (0..self.buckets).map(|_| Bucket::default()).collect());
        let w = &table[at.bucket].0;
        let _lock = Locked::new(&w[VERSION]);
        if !still() {
            return false;
        }
        let i = match find(w, at.fp) {
            Some(i) => i,
            None => {
                let i = victim(w, now_ms, at.fp as usize);
                if w[FP + i].load(Ordering::Relaxed) == 0 {
                    self.len.fetch_add(1, Ordering::Relaxed);
                }
                let counts = w[COUNTS].load(Ordering::Relaxed);
                w[COUNTS].store(counts & !(0xFF << (8 * i)), Ordering::Relaxed);
                w[FP + i].store(at.fp, Ordering::Relaxed);
                i
            }
        };
        w[META + i].store(meta(code, shard_of(key), expires_ms), Ordering::Relaxed);
        true
    }

    /// Drop the answer of the key at `at`, if any.
    pub(crate) fn remove(&self, at: Place) {
        let Some(w) = self.bucket(at) else { return };
        let _lock = Locked::new(&w[VERSION]);
        if let Some(i) = find(w, at.fp) {
            self.empty(w, i);
        }
    }

    fn empty(&self, w: &[AtomicU64; 16], i: usize) {
        w[FP + i].store(0, Ordering::Relaxed);
        w[META + i].store(0, Ordering::Relaxed);
        self.len.fetch_sub(1, Ordering::Relaxed);
    }

    /// Keep only the answers whose keys' Redis shards pass `keep`.
    pub(crate) fn retain_shards(&self, keep: impl Fn(usize) -> bool) {
        let Some(table) = self.table.get() else { return };
        for bucket in table.iter() {
            let w = &bucket.0;
            let _lock = Locked::new(&w[VERSION]);
            for i in 0..WAYS {
                if w[FP + i].load(Ordering::Relaxed) != 0 && !keep(shard(w[META + i].load(Ordering::Relaxed))) {
                    self.empty(w, i);
                }
            }
        }
    }

    /// Drop every answer.
    pub(crate) fn clear(&self) {
        self.retain_shards(|_| false);
    }

    /// Answers held.
    pub(crate) fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    /// Bytes the table takes (0 until its first answer).
    pub(crate) fn bytes(&self) -> usize {
        if self.table.get().is_none() { 0 } else { self.buckets * BYTES_PER_BUCKET }
    }
}

/// The slot of fingerprint `fp` in bucket `w`, if there.
fn find(w: &[AtomicU64; 16], fp: u64) -> Option<usize> {
    (0..WAYS).find(|&i| w[FP + i].load(Ordering::Relaxed) == fp)
}

/// The slot a new answer takes in bucket `w` (held by the caller): an
/// empty one, else one expired at `now_ms`, else the least counted (ties:
/// the first from `start`); every [`AGE_EVERY`] evictions halve the
/// bucket's counts.
fn victim(w: &[AtomicU64; 16], now_ms: u64, start: usize) -> usize {
    let free =
        |i: usize| w[FP + i].load(Ordering::Relaxed) == 0 || expiry(w[META + i].load(Ordering::Relaxed)) <= now_ms;
    if let Some(i) = (0..WAYS).find(|&i| free(i)) {
        return i;
    }
    let counts = w[COUNTS].load(Ordering::Relaxed);
    let count = |i: usize| (counts >> (8 * i)) & 0xFF;
    let i = (0..WAYS).map(|k| (start + k) % WAYS).min_by_key(|&i| count(i)).unwrap_or(0);
    let version = &w[VERSION];
    let evictions = (version.load(Ordering::Relaxed) >> AGE_SHIFT) + 1;
    if evictions < AGE_EVERY {
        version.fetch_add(1 << AGE_SHIFT, Ordering::Relaxed);
        return i;
    }
    version.fetch_sub((evictions - 1) << AGE_SHIFT, Ordering::Relaxed);
    // Every count halved at once (each byte's low bit masked off the one
    // below it).
    w[COUNTS].store((counts >> 1) & 0x7F7F_7F7F_7F7F_7F7F, Ordering::Relaxed);
    i
}

/// A bucket's version held odd: its writer's lock.
struct Locked<'a>(&'a AtomicU64);

impl<'a> Locked<'a> {
    fn new(version: &'a AtomicU64) -> Self {
        let mut spins = 0u32;
        loop {
            let v = version.load(Ordering::Relaxed);
            if v & 1 == 0 && version.compare_exchange_weak(v, v + 1, Ordering::Acquire, Ordering::Relaxed).is_ok() {
                // The slots' writes come after the odd version.
                fence(Ordering::Release);
                return Self(version);
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                // The holder was preempted (it holds the bucket for a few
                // stores): let it run.
                std::thread::yield_now();
            }
        }
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tier(t: &'static str) -> Option<Limits> {
        Some(Limits::Tier(crate::entries::value::intern_tier(t).unwrap()))
    }

    fn hit(c: &Compact, key: &str, now: u64) -> Option<Option<Limits>> {
        match c.get(c.place(key), || now) {
            Found::Hit(code, _) => Some(answer_of(code).unwrap()),
            Found::Miss => None,
        }
    }

    /// Keep `limits` for `key` (`false`: not kept, or not compact).
    fn keep(c: &Compact, key: &str, limits: &Option<Limits>, expires_ms: u64, still: impl FnOnce() -> bool) -> bool {
        code_of(limits).is_some_and(|code| c.insert(key, c.place(key), code, expires_ms, 0, still))
    }

    /// A table of one bucket, full of `{prefix}0`… each hit `hits` times.
    fn one_full_bucket(prefix: &str, hits: usize) -> Compact {
        let c = Compact::new(WAYS);
        for i in 0..WAYS {
            assert!(keep(&c, &format!("{prefix}{i}"), &None, u64::MAX, || true));
            for _ in 0..hits {
                let _ = hit(&c, &format!("{prefix}{i}"), 0);
            }
        }
        c
    }

    #[test]
    fn a_bucket_is_two_cache_lines() {
        assert_eq!(BYTES_PER_BUCKET, 128);
        assert_eq!(std::mem::align_of::<Bucket>(), 128);
    }

    #[test]
    fn answer_words_keep_their_answer_shard_and_expiry() {
        let top = MAX_TIER_NAMES as u32;
        for (code, shard, at) in [(0, 0, 0), (top, SHARDS - 1, NEVER - 1), (4, 17, 123_456), (top, 5, u64::MAX)] {
            let m = meta(code, shard, at);
            assert_eq!(m & ANSWER_MASK, u64::from(code));
            assert_eq!(self::shard(m), shard);
            assert_eq!(expiry(m), if at >= NEVER { u64::MAX } else { at });
        }
    }

    #[test]
    fn answers_are_found_replaced_expired_and_removed() {
        let c = Compact::new(64);
        assert!(hit(&c, "api\0user\u{1}alice", 0).is_none());
        assert!(keep(&c, "api\0user\u{1}alice", &tier("pro"), u64::MAX, || true));
        assert!(keep(&c, "api\0user\u{1}bob", &None, 100, || true));
        assert!(matches!(hit(&c, "api\0user\u{1}alice", 0), Some(Some(Limits::Tier("pro")))));
        assert!(matches!(hit(&c, "api\0user\u{1}bob", 99), Some(None)));
        assert!(hit(&c, "api\0user\u{1}bob", 100).is_none(), "expired");
        assert!(hit(&c, "api\0user\u{1}alicf", 0).is_none(), "another key");
        assert!(keep(&c, "api\0user\u{1}alice", &tier("free"), u64::MAX, || true));
        assert!(matches!(hit(&c, "api\0user\u{1}alice", 0), Some(Some(Limits::Tier("free")))), "replaced");
        assert_eq!(c.len(), 2);
        c.remove(c.place("api\0user\u{1}alice"));
        assert!(hit(&c, "api\0user\u{1}alice", 0).is_none());
        assert_eq!(c.len(), 1);
        assert!(!keep(&c, "api\0user\u{1}carol", &None, u64::MAX, || false), "a changed key is not kept");
        assert!(hit(&c, "api\0user\u{1}carol", 0).is_none());
        let own = Some(Limits::Own(std::sync::Arc::from(Vec::new())));
        assert!(!keep(&c, "api\0user\u{1}dave", &own, u64::MAX, || true), "own limits stay in the general cache");
        let long = format!("api\0user\u{1}{}", "x".repeat(1_000));
        assert!(keep(&c, &long, &tier("pro"), u64::MAX, || true), "a key of any length");
        assert!(matches!(hit(&c, &long, 0), Some(Some(Limits::Tier("pro")))));
        assert!(hit(&c, &long[..long.len() - 1], 0).is_none());
    }

    #[test]
    fn dropped_shards_and_clear_drop_what_they_say() {
        let c = Compact::new(1000);
        let keys: Vec<String> = (0..500).map(|i| format!("api\0user\u{1}{i}")).collect();
        for k in &keys {
            assert!(keep(&c, k, &None, u64::MAX, || true));
        }
        let held = c.len();
        assert!(held > 400, "{held}");
        let kept = |k: &String| shard_of(k).is_multiple_of(2);
        c.retain_shards(|s| s % 2 == 0);
        assert!(keys.iter().filter(|k| !kept(k)).all(|k| hit(&c, k, 0).is_none()));
        assert!(c.len() < held && c.len() > 0);
        assert_eq!(c.len(), keys.iter().filter(|k| hit(&c, k, 0).is_some()).count());
        c.clear();
        assert_eq!(c.len(), 0);
        assert!(keys.iter().all(|k| hit(&c, k, 0).is_none()));
    }

    #[test]
    fn a_full_bucket_keeps_its_most_used_answers() {
        // One bucket: its answers in use keep their places while a stream
        // of new keys, each used once, passes through; one slot goes to
        // the stream.
        let c = one_full_bucket("hot", 0);
        for n in 0..100 {
            for i in 0..WAYS {
                let _ = hit(&c, &format!("hot{i}"), 0);
            }
            assert!(keep(&c, &format!("cold{n}"), &None, u64::MAX, || true));
        }
        let kept = (0..WAYS).filter(|i| hit(&c, &format!("hot{i}"), 0).is_some()).count();
        assert_eq!(kept, WAYS - 1, "hot answers kept");
        assert!(hit(&c, "cold99", 0).is_some(), "the newest stays until the next");
        assert_eq!(c.len(), WAYS);
    }

    #[test]
    fn answers_no_longer_used_age_out() {
        // Counted many times once, then not used: new answers that are
        // used take their places within a few rounds.
        let c = one_full_bucket("old", 100);
        for _ in 0..100 {
            for n in 0..WAYS {
                let key = format!("new{n}");
                if hit(&c, &key, 0).is_none() {
                    assert!(keep(&c, &key, &None, u64::MAX, || true));
                }
                for _ in 0..3 {
                    let _ = hit(&c, &key, 0);
                }
            }
        }
        let kept = (0..WAYS).filter(|n| hit(&c, &format!("new{n}"), 0).is_some()).count();
        assert!(kept >= WAYS - 1, "{kept} of the new answers in use kept");
    }

    #[test]
    fn readers_racing_writers_never_see_a_torn_answer() {
        let c = std::sync::Arc::new(Compact::new(WAYS));
        let pro = tier("pro");
        std::thread::scope(|s| {
            let w = c.clone();
            s.spawn(move || {
                for n in 0..20_000 {
                    let t = if n % 2 == 0 { &pro } else { &None };
                    keep(&w, &format!("key{}", n % 16), t, u64::MAX, || true);
                    if n % 7 == 0 {
                        w.remove(w.place(&format!("key{}", n % 16)));
                    }
                }
            });
            for _ in 0..20_000 {
                for k in 0..16 {
                    // Whatever is found is one the writer wrote for it.
                    match hit(&c, &format!("key{k}"), 0) {
                        Some(Some(Limits::Tier(t))) => assert_eq!(t, "pro"),
                        Some(Some(Limits::Own(_))) => panic!("never written"),
                        _ => {}
                    }
                }
            }
        });
    }
}
