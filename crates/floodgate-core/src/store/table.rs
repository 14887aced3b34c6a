//! The in-memory store's hash table: open addressing over whole entries,
//! probed linearly, with no separate control bytes.
//!
//! A lookup in a table far larger than the caches is a cache miss per
//! memory location it reads. A SwissTable (hashbrown) reads a group of
//! control bytes and then the entry, two misses one after the other; here
//! the hash picks the entry's own slot, a 64-byte line that holds the key
//! (short keys inline, see `key.rs`), so a hit usually costs one miss, and
//! a collision the next line over, which the hardware prefetcher tends to
//! have fetched. Measured on 1 000 000 random keys: BENCHMARKS.md.
//!
//! Growth doubles at a load of 4/5 (linear probing's probe runs grow fast
//! beyond; at 4/5 a hit reads 3 slots on average, adjacent lines), so a
//! table is 2/5 to 4/5 full; removal rebuilds the table, which only bulk
//! paths (sweeps, eviction) do, so there are no tombstones.

/// At most 4 of every 5 slots are used.
const MAX_LOAD: (usize, usize) = (4, 5);
const MIN_CAPACITY: usize = 16;

/// A set of `T` keyed by a caller-computed 64-bit hash; the caller says
/// which entry is the one it looks for (`eq`) and how to hash an entry when
/// the table moves them (`rehash`), as hashbrown's `HashTable` does.
pub(super) struct Table<T> {
    /// A power-of-two number of slots (or none).
    slots: Box<[Option<T>]>,
    len: usize,
}

impl<T> Table<T> {
    pub(super) fn new() -> Self {
        Self { slots: Box::default(), len: 0 }
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Slots allocated.
    pub(super) fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// The entry for which `eq` holds, among those with this `hash`.
    #[inline]
    pub(super) fn find_mut(&mut self, hash: u64, mut eq: impl FnMut(&T) -> bool) -> Option<&mut T> {
        let mask = self.slots.len().checked_sub(1)?;
        let mut i = start(hash, mask);
        loop {
            match &self.slots[i] {
                None => return None,
                Some(t) if eq(t) => return self.slots[i].as_mut(),
                Some(_) => i = (i + 1) & mask,
            }
        }
    }

    /// Insert `value`, which the caller knows is not in the table.
    pub(super) fn insert_unique(&mut self, hash: u64, value: T, rehash: impl Fn(&T) -> u64) {
        if (self.len + 1) * MAX_LOAD.1 > self.slots.len() * MAX_LOAD.0 {
            let capacity = (self.slots.len() * 2).max(MIN_CAPACITY);
            self.rebuild(capacity, |_| true, &rehash);
        }
        self.place(hash, value);
        self.len += 1;
    }

    /// Keep only the entries for which `keep` holds (called once on each,
    /// in slot order from a free slot), in place: no allocation, so a store
    /// that evicts and sweeps all day does not churn the allocator (a fresh
    /// array per sweep of every shard fragmented glibc's heap: RSS grew to
    /// 3-4x the entries held, docs/operations.md, "Resource attacks").
    ///
    /// Linear probing without tombstones: an entry must be reachable from
    /// its home slot without crossing a free one. Walking once around from a
    /// slot that was free before any removal (no probe run crosses it), each
    /// kept entry moves to the first free slot between its home and where
    /// it is, which every earlier entry has already settled.
    pub(super) fn retain(&mut self, mut keep: impl FnMut(&T) -> bool, rehash: impl Fn(&T) -> u64) {
        let n = self.slots.len();
        let Some(free) = self.slots.iter().position(Option::is_none) else { return };
        let mask = n - 1;
        for step in 1..n {
            let i = (free + step) & mask;
            let Some(value) = &self.slots[i] else { continue };
            if !keep(value) {
                self.slots[i] = None;
                self.len -= 1;
                continue;
            }
            let home = start(rehash(value), mask);
            let mut j = home;
            while j != i {
                if self.slots[j].is_none() {
                    self.slots[j] = self.slots[i].take();
                    break;
                }
                j = (j + 1) & mask;
            }
        }
    }

    /// Shrink to the smallest capacity that holds `at_least` entries (and
    /// the entries held) within the load limit.
    pub(super) fn shrink_to(&mut self, at_least: usize, rehash: impl Fn(&T) -> u64) {
        let capacity = fit(at_least.max(self.len));
        if capacity < self.slots.len() {
            self.rebuild(capacity, |_| true, &rehash);
        }
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &T> {
        self.slots.iter().flatten()
    }

    /// Move the kept entries into a fresh array of `capacity` slots.
    fn rebuild(&mut self, capacity: usize, mut keep: impl FnMut(&T) -> bool, rehash: &impl Fn(&T) -> u64) {
        let fresh = std::iter::repeat_with(|| None).take(capacity).collect();
        let old = std::mem::replace(&mut self.slots, fresh);
        self.len = 0;
        for value in old.into_vec().into_iter().flatten() {
            if keep(&value) {
                self.place(rehash(&value), value);
                self.len += 1;
            }
        }
    }

    /// Put `value` in the first free slot from its hash's position (there is
    /// one: the load stays under 1).
    fn place(&mut self, hash: u64, value: T) {
        let mask = self.slots.len() - 1;
        let mut i = start(hash, mask);
        while self.slots[i].is_some() {
            i = (i + 1) & mask;
        }
        self.slots[i] = Some(value);
    }
}

/// The slot a hash starts probing at: its low bits (the store picks the
/// shard from higher ones, so both stay uniform).
#[inline]
fn start(hash: u64, mask: usize) -> usize {
    (hash as usize) & mask
}

/// The power-of-two capacity that holds `n` entries within the load limit.
fn fit(n: usize) -> usize {
    (n * MAX_LOAD.1).div_ceil(MAX_LOAD.0).max(MIN_CAPACITY).next_power_of_two()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Entries `(key, value)` hashed by a deliberately poor hash (many
    /// collisions and long probe runs), against a `HashMap` model.
    #[test]
    fn agrees_with_a_map_through_inserts_updates_retains_and_shrinks() {
        let hash = |k: u64| k.wrapping_mul(0x9E37_79B9) % 97;
        let rehash = |e: &(u64, u64)| hash(e.0);
        let mut table: Table<(u64, u64)> = Table::new();
        let mut model = HashMap::new();
        let mut x = 7u64;
        for step in 0..20_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let k = x % 3_000;
            match table.find_mut(hash(k), |e| e.0 == k) {
                Some(e) => e.1 += 1,
                None => table.insert_unique(hash(k), (k, 1), rehash),
            }
            *model.entry(k).or_insert(0) += 1;
            if step % 5_000 == 4_999 {
                table.retain(|e| e.0 % 3 != 0, rehash);
                model.retain(|k, _| k % 3 != 0);
                table.shrink_to(0, rehash);
            }
            assert_eq!(table.len(), model.len());
        }
        for (k, v) in &model {
            assert_eq!(table.find_mut(hash(*k), |e| e.0 == *k).map(|e| e.1), Some(*v), "{k}");
        }
        assert_eq!(table.iter().count(), model.len());
        assert!(table.find_mut(hash(3_001), |e| e.0 == 3_001).is_none());
        assert!(table.len() * MAX_LOAD.1 <= table.capacity() * MAX_LOAD.0);
    }

    /// Found by `scripts/bench-keys` (10M distinct keys through one
    /// bounded store): each eviction and sweep allocated a fresh array, and
    /// glibc's heap fragmented to 3-4x the entries held. Retain works in
    /// place now, and still finds everything it kept, through many rounds of
    /// random removals with a poor hash (long, wrapping probe runs).
    #[test]
    fn retain_works_in_place_and_keeps_every_entry_reachable() {
        let hash = |k: u64| k.wrapping_mul(0x9E37_79B9) % 61 + 1_000;
        let rehash = |e: &(u64, u64)| hash(e.0);
        let mut table: Table<(u64, u64)> = Table::new();
        let mut model = HashMap::new();
        let mut x = 11u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for round in 0..200u64 {
            while table.len() < 400 {
                let k = next() % 100_000;
                if table.find_mut(hash(k), |e| e.0 == k).is_none() {
                    table.insert_unique(hash(k), (k, round), rehash);
                    model.insert(k, round);
                }
            }
            let array = table.slots.as_ptr();
            let cut = next() % 4;
            table.retain(|e| (e.0 + round) % 4 != cut, rehash);
            model.retain(|k, _| (k + round) % 4 != cut);
            assert_eq!(table.slots.as_ptr(), array, "retain allocated");
            assert_eq!(table.len(), model.len());
            assert_eq!(table.iter().count(), model.len());
            for (k, v) in &model {
                assert_eq!(table.find_mut(hash(*k), |e| e.0 == *k).map(|e| e.1), Some(*v), "round {round}, key {k}");
            }
        }
    }

    #[test]
    fn an_empty_table_finds_nothing_and_shrinks_to_its_minimum() {
        let mut t: Table<u64> = Table::new();
        assert!(t.find_mut(1, |_| true).is_none());
        for i in 0..1000 {
            t.insert_unique(i, i, |v| *v);
        }
        t.retain(|_| false, |v| *v);
        t.shrink_to(0, |v| *v);
        assert_eq!((t.len(), t.capacity()), (0, MIN_CAPACITY));
        assert_eq!(fit(12), 16);
        assert_eq!(fit(13), 32);
    }
}
