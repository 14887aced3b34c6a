//! The front cache: each deciding thread's own small copy of the answers
//! it used last, in front of the shared cache.
//!
//! Why: under a skewed key distribution most lookups are for a few
//! thousand hot keys, and a hit in the shared cache (one lock, a hash
//! table probe and an entry, each likely a main-memory miss at a million
//! answers, and a hit counter every thread writes) costs more than the
//! rest of the lookup. A front slot is in this thread's own memory, takes
//! no lock and touches nothing another thread writes.
//!
//! * **Shape.** [`SLOTS`] slots per thread, direct-mapped by a hash of the
//!   lookup key (a hot key displaced by a colder one that maps to its slot
//!   is read from the shared cache again); only keys short enough to be
//!   held inline ([`INLINE_KEY`] bytes) are kept. About [`BYTES`] per
//!   thread, allocated on the thread's first lookup.
//! * **Freshness.** A slot holds the answer, its expiry and the owner's
//!   *generation* when it was read. Anything that takes an answer out of
//!   the shared cache (a write, a change notice, a dropped shard or cache)
//!   first takes it out there and then bumps the generation, and a slot
//!   whose generation is not the current one is not used: so no slot can
//!   outlive what the shared cache would answer. A reader takes the
//!   generation before it reads the shared cache, so an answer read across
//!   a bump is stored under the old one and not used again. Writes thus
//!   empty every thread's front at once; refilling costs one shared-cache
//!   hit per key.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};

use super::{CacheKey, INLINE_KEY, Limits};

/// Slots per thread: a power of two. Zipf(1)'s top 8 192 of 10 million
/// keys take 57% of its lookups.
pub(super) const SLOTS: usize = 8_192;
/// Bytes of one thread's front cache (allocated by a thread that looks
/// up an entry).
pub const BYTES: usize = SLOTS * std::mem::size_of::<Slot>();

/// Gives each [`super::PerKey`] its own identity in the fronts (one thread
/// may look up in several: tests, tools).
static OWNERS: AtomicU64 = AtomicU64::new(1);

/// A new owner's identity (never 0, the empty slot's).
pub(super) fn new_owner() -> u64 {
    OWNERS.fetch_add(1, Ordering::Relaxed)
}

struct Slot {
    owner: u64,
    generation: u64,
    expires_ms: u64,
    /// Always inline (a refill allocates nothing).
    key: CacheKey,
    limits: Option<Limits>,
}

impl Slot {
    const EMPTY: Self =
        Self { owner: 0, generation: 0, expires_ms: 0, key: CacheKey::Inline(0, [0; INLINE_KEY]), limits: None };
}

thread_local! {
    static FRONT: RefCell<Option<Box<[Slot]>>> = const { RefCell::new(None) };
}

/// The slot of a key: a word-at-a-time multiplicative hash (keys are
/// short; this is a few nanoseconds).
fn slot_of(key: &[u8]) -> usize {
    let mut h: u64 = key.len() as u64;
    let mut chunks = key.chunks_exact(8);
    for c in &mut chunks {
        let mut w = [0; 8];
        w.copy_from_slice(c);
        h = (h ^ u64::from_le_bytes(w)).wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(29);
    }
    let mut w = [0; 8];
    w[..chunks.remainder().len()].copy_from_slice(chunks.remainder());
    h = (h ^ u64::from_le_bytes(w)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    // The high bits are the best mixed.
    (h >> (64 - SLOTS.trailing_zeros())) as usize
}

/// This thread's answer for `key` of `owner`, if it holds a current one:
/// `Some(answer)` (the answer itself may be "no entry").
pub(super) fn get(owner: u64, generation: u64, now_ms: impl FnOnce() -> u64, key: &str) -> Option<Option<Limits>> {
    if key.len() > INLINE_KEY {
        return None;
    }
    FRONT.with_borrow(|front| {
        let slot = &front.as_ref()?[slot_of(key.as_bytes())];
        let hit = slot.owner == owner
            && slot.generation == generation
            && slot.key.is(key)
            && (slot.expires_ms == u64::MAX || now_ms() < slot.expires_ms);
        hit.then(|| slot.limits.clone())
    })
}

/// Keep `limits` as this thread's answer for `key` of `owner`, read under
/// `generation` (taken before the shared cache was read).
pub(super) fn put(owner: u64, generation: u64, expires_ms: u64, key: &str, limits: &Option<Limits>) {
    if key.len() > INLINE_KEY {
        return;
    }
    FRONT.with_borrow_mut(|front| {
        let slots = front.get_or_insert_with(|| (0..SLOTS).map(|_| Slot::EMPTY).collect());
        let slot = &mut slots[slot_of(key.as_bytes())];
        slot.owner = owner;
        slot.generation = generation;
        slot.expires_ms = expires_ms;
        slot.key = CacheKey::new(key);
        slot.limits.clone_from(limits);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_is_used_only_under_its_owner_generation_and_expiry() {
        let (a, b) = (new_owner(), new_owner());
        let pro = Some(Limits::Tier("pro"));
        put(a, 7, u64::MAX, "api\0user\u{1}alice", &pro);
        assert!(matches!(get(a, 7, || 0, "api\0user\u{1}alice"), Some(Some(Limits::Tier("pro")))));
        assert!(get(a, 8, || 0, "api\0user\u{1}alice").is_none(), "a bumped generation");
        assert!(get(b, 7, || 0, "api\0user\u{1}alice").is_none(), "another owner");
        assert!(get(a, 7, || 0, "api\0user\u{1}alicf").is_none(), "another key");
        put(a, 7, 100, "api\0user\u{1}bob", &None);
        assert!(matches!(get(a, 7, || 99, "api\0user\u{1}bob"), Some(None)), "a cached no-entry answer");
        assert!(get(a, 7, || 100, "api\0user\u{1}bob").is_none(), "expired");
        let long = "x".repeat(INLINE_KEY + 1);
        put(a, 7, u64::MAX, &long, &pro);
        assert!(get(a, 7, || 0, &long).is_none(), "long keys are not kept");
    }

    #[test]
    fn a_front_is_as_large_as_the_readme_says() {
        assert_eq!(BYTES, 768 << 10, "README, \"Per-key limits\": the cache and the memory bound");
    }

    #[test]
    fn slots_spread_keys() {
        let used: std::collections::HashSet<usize> =
            (0..SLOTS).map(|i| slot_of(format!("bench\0user\u{1}{i}").as_bytes())).collect();
        // A uniform hash fills 1 - 1/e (63%) of the slots with as many keys.
        assert!(used.len() > SLOTS * 55 / 100, "{} of {SLOTS}", used.len());
    }
}
