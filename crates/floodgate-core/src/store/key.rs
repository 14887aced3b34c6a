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
    Heap { tag: u32, key: Box<str> },
}

/// A looked-up key in its stored form, made once before probing: comparing
/// a short key is then a fixed-size compare of the slot's bytes (no call,
/// no length-dependent loop) once the slot's line arrives.
pub(crate) enum Probe<'a> {
    Inline { len: u8, bytes: [u8; INLINE] },
    Heap { tag: u32, key: &'a str },
}

impl<'a> Probe<'a> {
    /// `key`, whose hash is `hash`.
    #[inline]
    pub(crate) fn new(key: &'a str, hash: u64) -> Self {
        let b = key.as_bytes();
        if b.len() <= INLINE {
            Probe::Inline { len: b.len() as u8, bytes: padded(b) }
        } else {
            Probe::Heap { tag: tag(hash), key }
        }
    }
}

/// `b` (at most [`INLINE`] bytes) zero-padded, copied as at most three
/// fixed-size moves (two may overlap) instead of a `memcpy` call.
#[inline]
fn padded(b: &[u8]) -> [u8; INLINE] {
    let mut out = [0u8; INLINE];
    let n = b.len();
    if n >= 16 {
        out[..16].copy_from_slice(&b[..16]);
        out[n - 8..n].copy_from_slice(&b[n - 8..]);
    } else if n >= 8 {
        out[..8].copy_from_slice(&b[..8]);
        out[n - 8..n].copy_from_slice(&b[n - 8..]);
    } else if n >= 4 {
        out[..4].copy_from_slice(&b[..4]);
        out[n - 4..n].copy_from_slice(&b[n - 4..]);
    } else {
        for (o, i) in out.iter_mut().zip(b) {
            *o = *i;
        }
    }
    out
}

/// The part of a key's hash a long key keeps.
#[inline]
fn tag(hash: u64) -> u32 {
    (hash >> 32) as u32
}

impl StoredKey {
    /// The key `probe` was made for, to store.
    #[inline]
    pub(crate) fn new(probe: &Probe<'_>) -> Self {
        match *probe {
            Probe::Inline { len, bytes } => Self::Inline { len, bytes },
            Probe::Heap { tag, key } => Self::Heap { tag, key: key.into() },
        }
    }

    #[inline]
    pub(crate) fn as_bytes(&self) -> &[u8] {
        match self {
            Self::Inline { len, bytes } => &bytes[..usize::from(*len)],
            Self::Heap { key, .. } => key.as_bytes(),
        }
    }

    /// The key as text (it was made from a `&str`, so it is valid UTF-8).
    pub(crate) fn as_str(&self) -> &str {
        match self {
            Self::Inline { .. } => std::str::from_utf8(self.as_bytes()).unwrap_or_default(),
            Self::Heap { key, .. } => key,
        }
    }

    /// Whether this is the key `probe` was made for.
    #[inline]
    pub(crate) fn matches(&self, probe: &Probe<'_>) -> bool {
        match (self, probe) {
            (Self::Inline { len, bytes }, Probe::Inline { len: l, bytes: b }) => len == l && bytes == b,
            (Self::Heap { tag: t, key: k }, Probe::Heap { tag, key }) => t == tag && k.as_bytes() == key.as_bytes(),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_keys_are_inline_and_long_ones_on_the_heap() {
        assert_eq!(size_of::<StoredKey>(), 24);
        let hash = |k: &str| k.bytes().fold(17u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)) << 3);
        let probe = |k: &'static str| Probe::new(k, hash(k));
        for key in ["", "a", "ip:10.255.255.255", "0123456789012345678901", "01234567890123456789012", "é✓x"] {
            let k = StoredKey::new(&probe(key));
            assert!(k.matches(&probe(key)));
            assert_eq!(k.as_str(), key);
            let longer: &'static str = format!("{key}x").leak();
            assert!(!k.matches(&probe(longer)));
            assert!(!StoredKey::new(&probe(longer)).matches(&probe(key)));
            assert_eq!(matches!(k, StoredKey::Inline { .. }), key.len() <= INLINE, "{key}");
        }
        assert!(!StoredKey::new(&Probe::new("ab", 1)).matches(&Probe::new("a", 1)));
        assert!(!StoredKey::new(&Probe::new("a\0", 1)).matches(&Probe::new("a", 1)));
        // A long key with the same bytes but another tag is another key's
        // hash: the bytes are never read.
        let long = "0123456789012345678901234";
        assert!(!StoredKey::new(&Probe::new(long, 1 << 32)).matches(&Probe::new(long, 2 << 32)));
    }

    #[test]
    fn padding_copies_every_length_exactly() {
        let src: Vec<u8> = (1..=INLINE as u8).collect();
        for n in 0..=INLINE {
            let mut want = [0u8; INLINE];
            want[..n].copy_from_slice(&src[..n]);
            assert_eq!(padded(&src[..n]), want, "{n}");
        }
    }
}
