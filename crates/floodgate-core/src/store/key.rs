//! A stored key: up to 22 bytes inline in the slot, longer ones on the heap.
//!
//! Comparing a looked-up key with a stored one then reads only the slot's
//! cache line for short keys, instead of chasing a pointer to a separate
//! allocation (a cache miss per lookup in a large store), and short keys
//! cost no allocation at all. A long key keeps 32 bits of its hash beside
//! the pointer, so probing past other long keys reads no heap memory.

/// Inline capacity: a 24-byte key minus the length byte and the tag.
const INLINE: usize = 22;

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum StoredKey {
    Inline { len: u8, bytes: [u8; INLINE] },
    Heap { tag: u32, key: Box<[u8]> },
}

/// A looked-up key, classified once before probing. A short key is compared
/// with a slot's inline bytes by two or three word loads from each side
/// once the slot's line arrives: no call, no length-dependent loop, and
/// nothing written first (a load that half overlaps a fresh store waits for
/// it, which cost a quarter of a one-key decision when the probe was built
/// as a padded copy). A long key is compared by its hash tag first.
pub(crate) enum Probe<'a> {
    Inline(&'a [u8]),
    Heap { tag: u32, key: &'a [u8] },
}

impl<'a> Probe<'a> {
    /// `key`, whose hash is `hash`.
    #[inline]
    pub(crate) fn new(key: &'a [u8], hash: u64) -> Self {
        if key.len() <= INLINE { Probe::Inline(key) } else { Probe::Heap { tag: tag(hash), key } }
    }
}

/// The part of a key's hash a long key keeps.
#[inline]
fn tag(hash: u64) -> u32 {
    (hash >> 32) as u32
}

/// Whether `a` and `b` are equal, for `a` at most [`INLINE`] bytes long:
/// a length compare and two or three (possibly overlapping) word compares.
#[inline]
fn same_short(a: &[u8], b: &[u8]) -> bool {
    let n = a.len();
    let w8 = |s: &[u8], at: usize| s.get(at..at + 8).and_then(|w| w.try_into().ok()).map(u64::from_le_bytes);
    let w4 = |s: &[u8], at: usize| s.get(at..at + 4).and_then(|w| w.try_into().ok()).map(u32::from_le_bytes);
    if n != b.len() {
        false
    } else if n > 16 {
        w8(a, 0) == w8(b, 0) && w8(a, 8) == w8(b, 8) && w8(a, n - 8) == w8(b, n - 8)
    } else if n >= 8 {
        w8(a, 0) == w8(b, 0) && w8(a, n - 8) == w8(b, n - 8)
    } else if n >= 4 {
        w4(a, 0) == w4(b, 0) && w4(a, n - 4) == w4(b, n - 4)
    } else {
        a == b
    }
}

/// A key of at most [`INLINE`] bytes as an inline array and its length.
#[inline]
fn inline(key: &[u8]) -> (u8, [u8; INLINE]) {
    let mut bytes = [0u8; INLINE];
    bytes[..key.len()].copy_from_slice(key);
    (key.len() as u8, bytes)
}

impl StoredKey {
    /// The key `probe` was made for, to store.
    #[inline]
    pub(crate) fn new(probe: &Probe<'_>) -> Self {
        match *probe {
            Probe::Inline(key) => {
                let (len, bytes) = inline(key);
                Self::Inline { len, bytes }
            }
            Probe::Heap { tag, key } => Self::Heap { tag, key: key.into() },
        }
    }

    #[inline]
    pub(crate) fn as_bytes(&self) -> &[u8] {
        match self {
            Self::Inline { len, bytes } => &bytes[..usize::from(*len)],
            Self::Heap { key, .. } => key,
        }
    }

    /// Whether this is the key `probe` was made for.
    #[inline]
    pub(crate) fn matches(&self, probe: &Probe<'_>) -> bool {
        match (self, probe) {
            (Self::Inline { len, bytes }, Probe::Inline(key)) => {
                usize::from(*len) == key.len() && bytes.get(..key.len()).is_some_and(|b| same_short(b, key))
            }
            (Self::Heap { tag: t, key: k }, Probe::Heap { tag, key }) => t == tag && **k == **key,
            _ => false,
        }
    }

    /// Heap bytes owned beyond the slot.
    pub(crate) fn heap_bytes(&self) -> usize {
        match self {
            Self::Inline { .. } => 0,
            Self::Heap { key, .. } => key.len(),
        }
    }
}

/// A key owned outside the memory store's own table, where maps and queues
/// hold it and copy it (a memory-store region's global keys: the map, each
/// peer's queue, the batches in flight): short keys inline as in the store,
/// so they are no heap object of their own, longer ones shared, so a copy
/// is a reference count, not an allocation. Hashed and compared by its
/// bytes (a `HashMap<OwnedKey, _>` is looked up with a `&[u8]`). Made only
/// from `&str` keys.
#[derive(Clone, Debug)]
pub(crate) enum OwnedKey {
    Inline { len: u8, bytes: [u8; INLINE] },
    Shared(std::sync::Arc<[u8]>),
}

impl OwnedKey {
    #[inline]
    pub(crate) fn new(key: &str) -> Self {
        let key = key.as_bytes();
        if key.len() <= INLINE {
            let (len, bytes) = inline(key);
            Self::Inline { len, bytes }
        } else {
            Self::Shared(key.into())
        }
    }

    #[inline]
    pub(crate) fn as_bytes(&self) -> &[u8] {
        match self {
            Self::Inline { len, bytes } => &bytes[..usize::from(*len)],
            Self::Shared(key) => key,
        }
    }

    /// The key as text (always UTF-8: it was made from a `&str`).
    pub(crate) fn as_str(&self) -> &str {
        std::str::from_utf8(self.as_bytes()).unwrap_or_default()
    }
}

impl PartialEq for OwnedKey {
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for OwnedKey {}

impl std::hash::Hash for OwnedKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        // As `[u8]` hashes, which `Borrow` requires.
        self.as_bytes().hash(state);
    }
}

impl std::borrow::Borrow<[u8]> for OwnedKey {
    fn borrow(&self) -> &[u8] {
        self.as_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_keys_are_inline_and_long_ones_on_the_heap() {
        assert_eq!(size_of::<StoredKey>(), 24);
        let hash = |k: &str| k.bytes().fold(17u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)) << 3);
        let probe = |k: &'static str| Probe::new(k.as_bytes(), hash(k));
        for key in ["", "a", "ip:10.255.255.255", "0123456789012345678901", "01234567890123456789012", "é✓x"] {
            let k = StoredKey::new(&probe(key));
            assert!(k.matches(&probe(key)));
            assert_eq!(k.as_bytes(), key.as_bytes());
            let longer: &'static str = format!("{key}x").leak();
            assert!(!k.matches(&probe(longer)));
            assert!(!StoredKey::new(&probe(longer)).matches(&probe(key)));
            assert_eq!(matches!(k, StoredKey::Inline { .. }), key.len() <= INLINE, "{key}");
        }
        assert!(!StoredKey::new(&Probe::new(b"ab", 1)).matches(&Probe::new(b"a", 1)));
        assert!(!StoredKey::new(&Probe::new(b"a\0", 1)).matches(&Probe::new(b"a", 1)));
        // A long key with the same bytes but another tag is another key's
        // hash: the bytes are never read.
        let long = b"0123456789012345678901234";
        assert!(!StoredKey::new(&Probe::new(long, 1 << 32)).matches(&Probe::new(long, 2 << 32)));
    }

    #[test]
    fn short_keys_compare_exactly_at_every_length() {
        let src: Vec<u8> = (1..=INLINE as u8 + 1).collect();
        for n in 0..=INLINE {
            let a = &src[..n];
            assert!(same_short(a, a), "{n}");
            for i in 0..n {
                let mut b = a.to_vec();
                b[i] ^= 0x40;
                assert!(!same_short(a, &b), "{n}: byte {i}");
            }
            assert!(n == 0 || !same_short(a, &src[1..=n]), "{n}: shifted");
        }
        assert!(!same_short(b"abc", b"ab"));
    }

    #[test]
    fn owned_keys_are_found_by_their_bytes() {
        let mut map = std::collections::HashMap::new();
        let long = "0123456789012345678901234567";
        for k in ["", "user_alice", long] {
            map.insert(OwnedKey::new(k), k.len());
        }
        for k in ["", "user_alice", long] {
            assert_eq!(map.get(k.as_bytes()), Some(&k.len()));
            assert_eq!(OwnedKey::new(k).as_str(), k);
        }
        assert_eq!(map.get(&long.as_bytes()[1..]), None);
        assert_eq!(size_of::<OwnedKey>(), 24);
    }
}
