//! The front cache: each deciding thread's own small copy of the answers
//! it used last, in front of the shared cache.
//!
//! Why: under a skewed key distribution most lookups are for a few
//! thousand hot keys. A front slot is in this thread's own memory, small
//! enough to stay in the core's own cache beside the rest of the request
//! path ([`BYTES`]), takes no lock and touches nothing another thread
//! writes; the shared table's bucket is a main-memory read for most keys.
//!
//! * **Shape.** [`SLOTS`] slots per thread, direct-mapped by the key's
//!   fingerprint (the shared table's: a 64-bit keyed hash, see
//!   [`super::compact`]; a hot key displaced by a colder one that maps to
//!   its slot is read from the shared table again). A slot holds the
//!   fingerprint and a compact answer ("no entry" or a tier, by id): the
//!   answers with their own limits are not kept here. Allocated on the
//!   thread's first lookup.
//! * **Freshness.** A slot holds the answer, its expiry and the owner's
//!   *generation* when it was read. Anything that takes an answer out of
//!   the shared cache (a write, a change notice, a dropped shard or cache)
//!   first takes it out there and then bumps the generation, and a slot
//!   whose generation is not the current one is not used: so no slot can
//!   outlive what the shared cache would answer. A reader takes the
//!   generation before it reads the shared cache, so an answer read across
//!   a bump is stored under the old one and not used again. Writes thus
//!   empty every thread's front at once; refilling costs one shared-table
//!   hit per key.
//! * **Owners.** One thread may look up in several stores (tests, tools):
//!   each store has its own fingerprint key and its own generation, so a
//!   slot another store filled is not taken (its fingerprint differs but
//!   with the odds of a fingerprint collision, 2^-64).

use std::cell::RefCell;

/// Slots per thread: a power of two. Zipf(1)'s top 4 096 of 10 million
/// keys take 53% of its lookups.
pub(crate) const SLOTS: usize = 4_096;
/// Bytes of one thread's front cache (allocated by a thread that looks
/// up an entry).
pub const BYTES: usize = SLOTS * std::mem::size_of::<Slot>();

/// A slot: two to a cache line.
#[derive(Clone, Copy, Default)]
#[repr(C, align(32))]
struct Slot {
    /// The key's fingerprint (0: empty).
    fp: u64,
    /// The owner's generation when it was read.
    generation: u64,
    /// When it expires (`u64::MAX`: never), in the owner's milliseconds.
    expires_ms: u64,
    /// The compact answer's code (see `compact`).
    code: u32,
}

thread_local! {
    static FRONT: RefCell<Option<Box<[Slot]>>> = const { RefCell::new(None) };
}

fn slot_of(fp: u64) -> usize {
    // The fingerprint is a keyed hash: any of its bits spread keys.
    (fp as usize) & (SLOTS - 1)
}

/// This thread's answer code for the key of fingerprint `fp`, if it holds
/// a current one.
pub(crate) fn get(fp: u64, generation: u64, now_ms: impl FnOnce() -> u64) -> Option<u32> {
    FRONT.with_borrow(|front| {
        let slot = &front.as_ref()?[slot_of(fp)];
        let hit = slot.fp == fp
            && slot.generation == generation
            && (slot.expires_ms == u64::MAX || now_ms() < slot.expires_ms);
        hit.then_some(slot.code)
    })
}

/// Keep answer `code` for the key of fingerprint `fp`, read under
/// `generation` (taken before the shared cache was read).
pub(crate) fn put(fp: u64, generation: u64, expires_ms: u64, code: u32) {
    FRONT.with_borrow_mut(|front| {
        let slots = front.get_or_insert_with(|| vec![Slot::default(); SLOTS].into_boxed_slice());
        slots[slot_of(fp)] = Slot { fp, generation, expires_ms, code };
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_is_used_only_under_its_fingerprint_generation_and_expiry() {
        put(0xA11CE, 7, u64::MAX, 3);
        assert_eq!(get(0xA11CE, 7, || 0), Some(3));
        assert_eq!(get(0xA11CE, 8, || 0), None, "a bumped generation");
        assert_eq!(get(0xA11CE + SLOTS as u64, 7, || 0), None, "another key in the same slot");
        put(0xB0B, 7, 100, 0);
        assert_eq!(get(0xB0B, 7, || 99), Some(0), "a cached no-entry answer");
        assert_eq!(get(0xB0B, 7, || 100), None, "expired");
    }

    #[test]
    fn a_front_is_as_large_as_the_readme_says() {
        assert_eq!(BYTES, 128 << 10, "docs/per-key.md, \"The cache\" and \"Memory\": the memory bound");
    }
}
