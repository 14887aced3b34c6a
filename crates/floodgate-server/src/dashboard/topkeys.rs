//! The heaviest keys of one rule, by the Space-Saving algorithm (Metwally,
//! Agrawal and El Abbadi, "Efficient computation of frequent and top-k
//! elements in data streams", 2005), in fixed memory whatever the number of
//! distinct keys.
//!
//! [`TopKeys`] holds `TOP_KEYS` counters. A key already held adds to its
//! counter; a new key takes the place of the smallest, inheriting its count
//! as its error. Of `seen` hits in all:
//! * every key with more than `seen / TOP_KEYS` hits is held;
//! * a held key's true count lies in `[count - error, count]`, and `error`
//!   is at most `seen / TOP_KEYS`.
//!
//! Keys are held by a 64-bit hash of their counter key (two keys sharing a
//! hash would share a counter: with a random seed, about one chance in
//! 2^58 for a table of 32), and their display text is kept, cut at
//! [`KEY_BYTES`], only for the keys held.

/// Counters per table.
pub const TOP_KEYS: usize = 32;
/// Bytes of a key's display text kept at most (cut at a character
/// boundary, marked with `…`).
pub const KEY_BYTES: usize = 64;

/// One held key.
#[derive(Debug, Clone)]
struct Slot {
    hash: u64,
    count: u64,
    error: u64,
    /// Reused when another key takes the place: no allocation per miss.
    key: String,
}

/// The heaviest keys seen, in fixed memory (Space-Saving).
#[derive(Debug, Default)]
pub struct TopKeys {
    slots: Vec<Slot>,
    seen: u64,
}

/// A held key as listed.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Heavy {
    /// Its display text (cut at [`KEY_BYTES`]).
    pub key: String,
    /// Its count, an overestimate by at most `error`.
    pub count: u64,
    /// How much of `count` may belong to keys it displaced.
    pub error: u64,
}

impl TopKeys {
    /// Count `hits` for the key hashing to `hash`; `key` writes its display
    /// text (into an emptied buffer), asked only when the key takes a place.
    pub fn record(&mut self, hash: u64, hits: u64, key: impl FnOnce(&mut String)) {
        self.seen = self.seen.saturating_add(hits);
        if let Some(s) = self.slots.iter_mut().find(|s| s.hash == hash) {
            s.count = s.count.saturating_add(hits);
            return;
        }
        if self.slots.len() < TOP_KEYS {
            let mut text = String::with_capacity(KEY_BYTES + '…'.len_utf8());
            key(&mut text);
            cut(&mut text);
            self.slots.push(Slot { hash, count: hits, error: 0, key: text });
            return;
        }
        // Full: the smallest counter's key gives way (the first when tied).
        let Some(min) = self.slots.iter_mut().min_by_key(|s| s.count) else { return };
        let floor = min.count;
        min.hash = hash;
        min.count = floor.saturating_add(hits);
        min.error = floor;
        min.key.clear();
        key(&mut min.key);
        cut(&mut min.key);
    }

    /// Hits counted in all.
    pub fn seen(&self) -> u64 {
        self.seen
    }

    /// The most any listed count overestimates its key's: `seen / TOP_KEYS`
    /// once the table is full, else 0 (every key seen is held exactly).
    pub fn bound(&self) -> u64 {
        if self.slots.len() < TOP_KEYS { 0 } else { self.seen / TOP_KEYS as u64 }
    }

    /// The `n` heaviest, heaviest first.
    pub fn top(&self, n: usize) -> Vec<Heavy> {
        let mut slots: Vec<&Slot> = self.slots.iter().collect();
        slots.sort_by(|a, b| b.count.cmp(&a.count).then_with(|| a.key.cmp(&b.key)));
        slots.into_iter().take(n).map(|s| Heavy { key: s.key.to_string(), count: s.count, error: s.error }).collect()
    }

    /// Bytes this table holds at most.
    pub const fn max_bytes() -> usize {
        std::mem::size_of::<TopKeys>() + TOP_KEYS * (std::mem::size_of::<Slot>() + KEY_BYTES + '…'.len_utf8())
    }
}

/// `key` cut to [`KEY_BYTES`] at a character boundary, marked when cut.
fn cut(key: &mut String) {
    if key.len() > KEY_BYTES {
        let mut end = KEY_BYTES;
        while !key.is_char_boundary(end) {
            end -= 1;
        }
        key.truncate(end);
        key.push('…');
        // A long key's text grew the buffer: give the rest back.
        key.shrink_to(KEY_BYTES + '…'.len_utf8());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(t: &mut TopKeys, key: &str) {
        use std::hash::BuildHasher;
        let h = foldhash::fast::FixedState::with_seed(7).hash_one(key);
        t.record(h, 1, |out| out.push_str(key));
    }

    #[test]
    fn few_keys_are_counted_exactly() {
        let mut t = TopKeys::default();
        for (k, n) in [("a", 5), ("b", 3), ("c", 9)] {
            for _ in 0..n {
                record(&mut t, k);
            }
        }
        let top = t.top(10);
        let got: Vec<_> = top.iter().map(|h| (h.key.as_str(), h.count, h.error)).collect();
        assert_eq!(got, [("c", 9, 0), ("a", 5, 0), ("b", 3, 0)]);
        assert_eq!((t.seen(), t.bound()), (17, 0));
    }

    /// The Space-Saving guarantees on a skewed stream of far more keys than
    /// counters: every key above seen/k is held, and every listed count is
    /// within its error, and the error within the bound, of the truth.
    #[test]
    fn heavy_keys_are_found_within_the_bound_among_many() {
        let mut t = TopKeys::default();
        let mut truth = std::collections::HashMap::new();
        let mut x: u64 = 1;
        for i in 0..200_000u64 {
            // Three heavy keys (~20%, ~10%, ~5%) in a crowd of 50 000 light ones.
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let r = x >> 33;
            let key = match r % 100 {
                0..20 => "heavy-1".to_owned(),
                20..30 => "heavy-2".to_owned(),
                30..35 => "heavy-3".to_owned(),
                _ => format!("light-{}", (r ^ i) % 50_000),
            };
            *truth.entry(key.clone()).or_insert(0u64) += 1;
            record(&mut t, &key);
        }
        let bound = t.bound();
        assert_eq!(t.seen(), 200_000);
        assert_eq!(bound, 200_000 / TOP_KEYS as u64);
        let top = t.top(3);
        assert_eq!(top.iter().map(|h| h.key.as_str()).collect::<Vec<_>>(), ["heavy-1", "heavy-2", "heavy-3"]);
        for h in t.top(TOP_KEYS) {
            let real = truth[&h.key];
            assert!(h.count >= real && h.count - h.error <= real, "{h:?} vs {real}");
            assert!(h.error <= bound, "{h:?} over the bound {bound}");
        }
        for (k, &n) in &truth {
            if n > bound {
                assert!(t.top(TOP_KEYS).iter().any(|h| &h.key == k), "{k} ({n} > {bound}) not held");
            }
        }
    }

    #[test]
    fn long_keys_are_cut_at_a_character_boundary() {
        let mut t = TopKeys::default();
        let long = "é".repeat(100);
        record(&mut t, &long);
        let k = &t.top(1)[0].key;
        assert!(k.len() <= KEY_BYTES + '…'.len_utf8() && k.ends_with('…') && k.starts_with("éé"), "{k}");
    }
}
