//! The shared cache's table of compact answers: one cache line per answer.
//!
//! Why: at a million cached answers, a hit in a general-purpose cache is
//! three dependent main-memory reads (its hash table's control bytes, the
//! index they lead to, the entry that index names: measured, they are 70%
//! of a hit's time), behind a shard lock every thread writes. Most answers
//! are small: "no entry", or a tier's name, for a key of a few dozen bytes.
//! Those are kept here, each in one 64-byte line that holds its key, and a
//! hit reads the lines of one bucket, next to each other in memory, with no
//! lock and no write but a frequency count.
//!
//! * **Shape.** [`WAYS`] slots per bucket, a bucket chosen by a seeded
//!   hash of the key (foldhash, randomly seeded: a client cannot aim keys
//!   at one bucket). Keys of up to [`KEY_BYTES`] bytes and answers that
//!   are "no entry" or a tier; everything else (own limits, longer keys)
//!   stays in the general cache beside this one. The table is allocated
//!   at its first answer: [`BYTES_PER_SLOT`] bytes a slot, plus 8 bytes a
//!   bucket for its version.
//! * **Eviction.** Per bucket, least frequently used, with aging: a hit
//!   counts on its slot (saturating at 255); a new answer takes an empty
//!   or expired slot, else the one with the lowest count (ties: a place
//!   that depends on the new key). A new answer starts at 0, so one used
//!   once is the next to go, and the answers in use stay. Aging: every
//!   [`AGE_EVERY`] evictions in a bucket halve its counts, so answers that
//!   were hot once and are no longer used go in time. (Simulated with
//!   Zipf(1) keys over a million and 100 000 answers: 0.808 of lookups
//!   hit, against 0.796 with aging every 8 and 0.84 for a perfect choice
//!   of the top keys; BENCHMARKS.md has the measured rate.)
//! * **Concurrency.** Each bucket has a version (a sequence lock): a writer
//!   makes it odd, writes, makes it even again; a reader reads the slots
//!   and takes the answer only if the version was even and unchanged. The
//!   slots are atomics, so a reader racing a writer reads stale words,
//!   never undefined ones, and throws them away.

use std::hash::BuildHasher;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering, fence};

use super::Limits;
use super::value::{tier_id, tier_named};

/// Slots per bucket.
pub(super) const WAYS: usize = 8;
/// Longest key a slot holds.
pub(super) const KEY_BYTES: usize = 46;
/// Bytes of one slot (one cache line).
pub(super) const BYTES_PER_SLOT: usize = 64;

/// One answer: eight words.
/// * `w[0]`: the key's tag (32 bits of its hash, never 0: 0 is an empty
///   slot) in the high half, the answer in the low half (0: no entry;
///   `n`: the tier with id `n - 1`).
/// * `w[1]`: when it expires, in milliseconds after the store opened
///   (`u64::MAX`: never).
/// * `w[2]`: the key's length (low byte), its first 6 bytes, then the
///   count (top byte: an increment past 255 falls off the word).
/// * `w[3..8]`: the rest of the key, 8 bytes a word, zero-padded.
#[repr(C, align(64))]
struct Slot([AtomicU64; 8]);

/// Evictions in a bucket between two halvings of its counts (counted in
/// the top byte of the bucket's version).
const AGE_EVERY: u64 = 32;
const AGE_SHIFT: u32 = 56;
const COUNT_SHIFT: u32 = 56;
const COUNT_ONE: u64 = 1 << COUNT_SHIFT;
const KEY_MASK: u64 = COUNT_ONE - 1;

/// A key as the slot words that hold it (`w[2]` without its count, then
/// `w[3..8]`).
#[derive(PartialEq, Eq)]
struct Packed([u64; 6]);

impl Packed {
    /// The key's bytes in the words: its length in byte 0, then the key
    /// from byte 1, skipping byte 7 (the count's, in the slot).
    fn of(key: &[u8]) -> Option<Self> {
        if key.len() > KEY_BYTES {
            return None;
        }
        let mut bytes = [0u8; 48];
        bytes[0] = key.len() as u8;
        let (head, tail) = key.split_at(key.len().min(6));
        bytes[1..=head.len()].copy_from_slice(head);
        bytes[8..8 + tail.len()].copy_from_slice(tail);
        let mut words = [0u64; 6];
        for (w, chunk) in words.iter_mut().zip(bytes.chunks_exact(8)) {
            let mut b = [0; 8];
            b.copy_from_slice(chunk);
            *w = u64::from_le_bytes(b);
        }
        Some(Self(words))
    }

    /// The key these words hold.
    fn key(&self) -> String {
        let mut bytes = [0u8; 48];
        for (chunk, w) in bytes.chunks_exact_mut(8).zip(self.0) {
            chunk.copy_from_slice(&w.to_le_bytes());
        }
        let len = usize::from(bytes[0]).min(KEY_BYTES);
        let mut key = bytes[1..=len.min(6)].to_vec();
        key.extend_from_slice(&bytes[8..8 + len.saturating_sub(6)]);
        String::from_utf8_lossy(&key).into_owned()
    }
}

/// What a slot holds for its key.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Answer {
    None,
    Tier(u32),
}

impl Answer {
    fn of(limits: &Option<Limits>) -> Option<Self> {
        match limits {
            None => Some(Self::None),
            Some(Limits::Tier(t)) => tier_id(t).map(Self::Tier),
            Some(Limits::Own(_)) => None,
        }
    }

    fn code(self) -> u64 {
        match self {
            Self::None => 0,
            Self::Tier(id) => u64::from(id) + 1,
        }
    }

    fn limits(code: u64) -> Option<Option<Limits>> {
        match code {
            0 => Some(None),
            n => tier_named(u32::try_from(n - 1).ok()?).map(|t| Some(Limits::Tier(t))),
        }
    }
}

/// The table (see the module's documentation).
pub(super) struct Compact {
    buckets: usize,
    /// Made at the first answer.
    table: OnceLock<Table>,
    hasher: foldhash::fast::RandomState,
    len: AtomicUsize,
}

/// The slots, bucket after bucket, and each bucket's version.
struct Table {
    slots: Box<[Slot]>,
    versions: Box<[AtomicU64]>,
}

impl std::fmt::Debug for Compact {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Compact").field("capacity", &self.capacity()).field("len", &self.len()).finish()
    }
}

/// What a lookup found.
pub(super) enum Found {
    /// The answer, and when it expires.
    Hit(Option<Limits>, u64),
    /// No answer for the key (or an expired one).
    Miss,
}

impl Compact {
    /// A table of at least `capacity` answers (rounded up to whole
    /// buckets).
    pub(super) fn new(capacity: usize) -> Self {
        Self {
            buckets: capacity.max(1).div_ceil(WAYS),
            table: OnceLock::new(),
            hasher: foldhash::fast::RandomState::default(),
            len: AtomicUsize::new(0),
        }
    }

    /// Answers it holds at most.
    fn capacity(&self) -> usize {
        self.buckets * WAYS
    }

    /// Whether an answer for `key` can be kept here.
    pub(super) fn fits(key: &str, limits: &Option<Limits>) -> bool {
        key.len() <= KEY_BYTES && Answer::of(limits).is_some()
    }

    /// The bucket and tag of `key`.
    fn place(&self, key: &[u8]) -> (usize, u64) {
        let h = self.hasher.hash_one(key);
        // Multiply-shift onto the buckets (no power of two needed).
        let bucket = ((u128::from(h) * self.buckets as u128) >> 64) as usize;
        let tag = (h & 0xFFFF_FFFF) | 1;
        (bucket, tag << 32)
    }

    /// Bucket `b`'s slots and version (`None` before the first answer).
    fn bucket(&self, b: usize) -> Option<(&[Slot], &AtomicU64)> {
        self.table.get().map(|t| t.bucket(b))
    }

    /// The answer for `key` at `now_ms`, counting the hit.
    pub(super) fn get(&self, key: &str, now_ms: impl FnOnce() -> u64) -> Found {
        let Some(packed) = Packed::of(key.as_bytes()) else { return Found::Miss };
        let (b, tag) = self.place(key.as_bytes());
        let Some((slots, version)) = self.bucket(b) else { return Found::Miss };
        let mut spins = 0u32;
        loop {
            let v = version.load(Ordering::Acquire);
            if v & 1 == 0 {
                let found = find(slots, tag, &packed).map(|i| {
                    let s = &slots[i].0;
                    (i, s[0].load(Ordering::Relaxed), s[1].load(Ordering::Relaxed))
                });
                fence(Ordering::Acquire);
                if version.load(Ordering::Relaxed) == v {
                    let Some((i, w0, expires)) = found else { return Found::Miss };
                    if expires != u64::MAX && now_ms() >= expires {
                        return Found::Miss;
                    }
                    let Some(limits) = Answer::limits(w0 & 0xFFFF_FFFF) else { return Found::Miss };
                    let w2 = &slots[i].0[2];
                    if w2.load(Ordering::Relaxed) >> COUNT_SHIFT < 255 {
                        // Racy by design: a count lost or given to the
                        // slot's next key only blurs the eviction order.
                        w2.fetch_add(COUNT_ONE, Ordering::Relaxed);
                    }
                    return Found::Hit(limits, expires);
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

    /// Keep `limits` for `key` until `expires_ms` (it is `now_ms`), if it
    /// fits and `still` holds with the bucket locked (the caller's check
    /// that nothing changed the key since its read: a write that drops the
    /// key after `still` turns false finds the answer here and drops it).
    /// Whether it was kept.
    pub(super) fn insert(
        &self,
        key: &str,
        limits: &Option<Limits>,
        expires_ms: u64,
        now_ms: u64,
        still: impl FnOnce() -> bool,
    ) -> bool {
        let (Some(packed), Some(answer)) = (Packed::of(key.as_bytes()), Answer::of(limits)) else { return false };
        let (b, tag) = self.place(key.as_bytes());
        let table = self.table.get_or_init(|| Table {
            slots: (0..self.capacity()).map(|_| Slot(Default::default())).collect(),
            versions: (0..self.buckets).map(|_| AtomicU64::new(0)).collect(),
        });
        let (slots, version) = table.bucket(b);
        let _lock = Locked::new(version);
        if !still() {
            return false;
        }
        let i = match find(slots, tag, &packed) {
            Some(i) => i,
            None => {
                let i = victim(slots, version, now_ms, (tag >> 32) as usize);
                if slots[i].0[0].load(Ordering::Relaxed) == 0 {
                    self.len.fetch_add(1, Ordering::Relaxed);
                }
                let s = &slots[i].0;
                s[2].store(packed.0[0], Ordering::Relaxed);
                for (w, p) in s[3..].iter().zip(&packed.0[1..]) {
                    w.store(*p, Ordering::Relaxed);
                }
                i
            }
        };
        let s = &slots[i].0;
        s[0].store(tag | answer.code(), Ordering::Relaxed);
        s[1].store(expires_ms, Ordering::Relaxed);
        true
    }

    /// Drop the answer for `key`, if any.
    pub(super) fn remove(&self, key: &str) {
        let Some(packed) = Packed::of(key.as_bytes()) else { return };
        let (b, tag) = self.place(key.as_bytes());
        let Some((slots, version)) = self.bucket(b) else { return };
        let _lock = Locked::new(version);
        if let Some(i) = find(slots, tag, &packed) {
            self.empty(&slots[i]);
        }
    }

    fn empty(&self, slot: &Slot) {
        for w in &slot.0 {
            w.store(0, Ordering::Relaxed);
        }
        self.len.fetch_sub(1, Ordering::Relaxed);
    }

    /// Keep only the answers whose keys pass `keep`.
    pub(super) fn retain(&self, mut keep: impl FnMut(&str) -> bool) {
        for b in 0..self.buckets {
            let Some((slots, version)) = self.bucket(b) else { return };
            let _lock = Locked::new(version);
            for slot in slots {
                let s = &slot.0;
                if s[0].load(Ordering::Relaxed) == 0 {
                    continue;
                }
                let mut words = [0u64; 6];
                words[0] = s[2].load(Ordering::Relaxed) & KEY_MASK;
                for (w, x) in words[1..].iter_mut().zip(&s[3..]) {
                    *w = x.load(Ordering::Relaxed);
                }
                if !keep(&Packed(words).key()) {
                    self.empty(slot);
                }
            }
        }
    }

    /// Drop every answer.
    pub(super) fn clear(&self) {
        self.retain(|_| false);
    }

    /// Answers held.
    pub(super) fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    /// Bytes the table takes (0 until its first answer).
    pub(super) fn bytes(&self) -> usize {
        if self.table.get().is_none() { 0 } else { self.capacity() * BYTES_PER_SLOT + self.buckets * 8 }
    }
}

impl Table {
    fn bucket(&self, b: usize) -> (&[Slot], &AtomicU64) {
        (&self.slots[b * WAYS..(b + 1) * WAYS], &self.versions[b])
    }
}

/// The slot of `packed` (tagged `tag`) among `slots`, if there.
fn find(slots: &[Slot], tag: u64, packed: &Packed) -> Option<usize> {
    slots.iter().position(|slot| {
        let s = &slot.0;
        s[0].load(Ordering::Relaxed) & !0xFFFF_FFFF == tag
            && s[2].load(Ordering::Relaxed) & KEY_MASK == packed.0[0]
            && s[3..].iter().zip(&packed.0[1..]).all(|(w, p)| w.load(Ordering::Relaxed) == *p)
    })
}

/// The slot a new answer takes in a bucket (its `version` held by the
/// caller): an empty one, else one expired at `now_ms`, else the least
/// counted (ties: the first from `start`); every [`AGE_EVERY`] evictions
/// halve the bucket's counts.
fn victim(slots: &[Slot], version: &AtomicU64, now_ms: u64, start: usize) -> usize {
    if let Some(i) =
        slots.iter().position(|s| s.0[0].load(Ordering::Relaxed) == 0 || s.0[1].load(Ordering::Relaxed) <= now_ms)
    {
        return i;
    }
    let count = |i: usize| slots[i].0[2].load(Ordering::Relaxed) >> COUNT_SHIFT;
    let i = (0..WAYS).map(|k| (start + k) % WAYS).min_by_key(|&i| count(i)).unwrap_or(0);
    let evictions = (version.load(Ordering::Relaxed) >> AGE_SHIFT) + 1;
    if evictions < AGE_EVERY {
        version.fetch_add(1 << AGE_SHIFT, Ordering::Relaxed);
        return i;
    }
    version.fetch_sub((evictions - 1) << AGE_SHIFT, Ordering::Relaxed);
    for slot in slots {
        // Only the lock's holder changes a key: a hit's count that lands
        // between the load and the store is lost, nothing else.
        let w = &slot.0[2];
        let now = w.load(Ordering::Relaxed);
        w.store((now & KEY_MASK) | ((now >> COUNT_SHIFT) / 2) << COUNT_SHIFT, Ordering::Relaxed);
    }
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
        Some(Limits::Tier(super::super::value::intern_tier(t).unwrap()))
    }

    fn hit(c: &Compact, key: &str, now: u64) -> Option<Option<Limits>> {
        match c.get(key, || now) {
            Found::Hit(l, _) => Some(l),
            Found::Miss => None,
        }
    }

    /// A table of one bucket, full of `{prefix}0`… each hit `hits` times.
    fn one_full_bucket(prefix: &str, hits: usize) -> Compact {
        let c = Compact::new(WAYS);
        for i in 0..WAYS {
            assert!(c.insert(&format!("{prefix}{i}"), &None, u64::MAX, 0, || true));
            for _ in 0..hits {
                let _ = hit(&c, &format!("{prefix}{i}"), 0);
            }
        }
        c
    }

    #[test]
    fn keys_of_every_length_pack_and_unpack() {
        for n in 0..=KEY_BYTES {
            let key: String = (0..n).map(|i| char::from(b'a' + (i % 26) as u8)).collect();
            let p = Packed::of(key.as_bytes()).unwrap();
            assert_eq!(p.key(), key);
            assert_eq!(p.0[0] >> COUNT_SHIFT, 0, "the count's byte is free");
        }
        assert!(Packed::of(&[b'x'; KEY_BYTES + 1]).is_none());
        // Keys differing only in their 7th byte (the first past the count's
        // byte) differ.
        assert!(Packed::of(b"abcdefX") != Packed::of(b"abcdefY"));
    }

    #[test]
    fn answers_are_found_replaced_expired_and_removed() {
        let c = Compact::new(64);
        assert!(hit(&c, "api\0user\u{1}alice", 0).is_none());
        assert!(c.insert("api\0user\u{1}alice", &tier("pro"), u64::MAX, 0, || true));
        assert!(c.insert("api\0user\u{1}bob", &None, 100, 0, || true));
        assert!(matches!(hit(&c, "api\0user\u{1}alice", 0), Some(Some(Limits::Tier("pro")))));
        assert!(matches!(hit(&c, "api\0user\u{1}bob", 99), Some(None)));
        assert!(hit(&c, "api\0user\u{1}bob", 100).is_none(), "expired");
        assert!(hit(&c, "api\0user\u{1}alicf", 0).is_none(), "another key");
        assert!(c.insert("api\0user\u{1}alice", &tier("free"), u64::MAX, 0, || true));
        assert!(matches!(hit(&c, "api\0user\u{1}alice", 0), Some(Some(Limits::Tier("free")))), "replaced");
        assert_eq!(c.len(), 2);
        c.remove("api\0user\u{1}alice");
        assert!(hit(&c, "api\0user\u{1}alice", 0).is_none());
        assert_eq!(c.len(), 1);
        assert!(!c.insert("api\0user\u{1}carol", &None, u64::MAX, 0, || false), "a changed key is not kept");
        assert!(hit(&c, "api\0user\u{1}carol", 0).is_none());
        let own = Some(Limits::Own(std::sync::Arc::from(Vec::new())));
        assert!(!c.insert("api\0user\u{1}dave", &own, u64::MAX, 0, || true), "own limits stay in the general cache");
        assert!(!c.insert(&"x".repeat(KEY_BYTES + 1), &None, u64::MAX, 0, || true), "long keys too");
    }

    #[test]
    fn retain_and_clear_drop_what_they_say() {
        let c = Compact::new(1000);
        for i in 0..500 {
            assert!(c.insert(&format!("d{}\0k\u{1}{i}", i % 2), &None, u64::MAX, 0, || true));
        }
        let held = c.len();
        assert!(held > 400, "{held}");
        c.retain(|k| k.starts_with("d0"));
        assert!((0..500).filter(|i| i % 2 == 1).all(|i| hit(&c, &format!("d1\0k\u{1}{i}"), 0).is_none()));
        assert!(c.len() < held && c.len() > 0);
        c.clear();
        assert_eq!(c.len(), 0);
        assert!((0..500).all(|i| hit(&c, &format!("d{}\0k\u{1}{i}", i % 2), 0).is_none()));
    }

    #[test]
    fn a_full_bucket_keeps_its_most_used_answers() {
        // One bucket: eight answers in use keep their places while a
        // stream of new keys, each used once, passes through; one slot
        // goes to the stream.
        let c = one_full_bucket("hot", 0);
        for n in 0..100 {
            for i in 0..WAYS {
                let _ = hit(&c, &format!("hot{i}"), 0);
            }
            assert!(c.insert(&format!("cold{n}"), &None, u64::MAX, 0, || true));
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
                    assert!(c.insert(&key, &None, u64::MAX, 0, || true));
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
                    w.insert(&format!("key{}", n % 16), t, u64::MAX, 0, || true);
                    if n % 7 == 0 {
                        w.remove(&format!("key{}", n % 16));
                    }
                }
            });
            for _ in 0..20_000 {
                for k in 0..16 {
                    // Whatever is found is one the writer wrote for it.
                    match c.get(&format!("key{k}"), || 0) {
                        Found::Hit(Some(Limits::Tier(t)), _) => assert_eq!(t, "pro"),
                        Found::Hit(Some(Limits::Own(_)), _) => panic!("never written"),
                        _ => {}
                    }
                }
            }
        });
    }
}
