//! A stored key: up to 22 bytes inline in the slot, longer ones on the heap.
//!
//! Comparing a looked-up key with a stored one then reads only the slot's
//! cache line for short keys, instead of chasing a pointer to a separate
//! allocation (a cache miss per lookup in a large store), and short keys
//! cost no allocation at all.

/// Inline capacity: a 24-byte key minus the length byte and the tag.
const INLINE: usize = 22;

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum StoredKey {
    Inline { len: u8, bytes: [u8; INLINE] },
    Heap(Box<str>),
}

impl StoredKey {
    #[inline]
    pub(crate) fn new(key: &str) -> Self {
        let b = key.as_bytes();
        if b.len() <= INLINE {
            let mut bytes = [0u8; INLINE];
            bytes[..b.len()].copy_from_slice(b);
            Self::Inline { len: b.len() as u8, bytes }
        } else {
            Self::Heap(key.into())
        }
    }

    #[inline]
    pub(crate) fn as_bytes(&self) -> &[u8] {
        match self {
            Self::Inline { len, bytes } => &bytes[..usize::from(*len)],
            Self::Heap(s) => s.as_bytes(),
        }
    }

    /// The key as text (it was made from a `&str`, so it is valid UTF-8).
    pub(crate) fn as_str(&self) -> &str {
        match self {
            Self::Inline { .. } => std::str::from_utf8(self.as_bytes()).unwrap_or_default(),
            Self::Heap(s) => s,
        }
    }

    #[inline]
    pub(crate) fn matches(&self, key: &str) -> bool {
        self.as_bytes() == key.as_bytes()
    }

    /// Heap bytes owned beyond the slot.
    pub(crate) fn heap_bytes(&self) -> usize {
        match self {
            Self::Inline { .. } => 0,
            Self::Heap(s) => s.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_keys_are_inline_and_long_ones_on_the_heap() {
        assert_eq!(size_of::<StoredKey>(), 24);
        for key in ["", "a", "ip:10.255.255.255", "0123456789012345678901", "01234567890123456789012", "é✓x"] {
            let k = StoredKey::new(key);
            assert!(k.matches(key));
            assert_eq!(k.as_str(), key);
            assert!(!k.matches(&format!("{key}x")));
            assert_eq!(matches!(k, StoredKey::Inline { .. }), key.len() <= INLINE, "{key}");
        }
        assert!(!StoredKey::new("ab").matches("a"));
    }
}
