//! One peer's queue in a Redis region's instance: the keys owed to it,
//! each once with what it carries, and the items another peer's read
//! shared with it.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use floodgate_core::region::Item;
use floodgate_core::region::link::KeyQueue;

/// A key as the instance's sync holds it: made once when a decision first
/// queues it, shared by the lazy list and every peer's queue.
pub(super) type Key = Arc<str>;

/// The maps of keys (client-chosen): foldhash, randomly seeded against hash
/// flooding, as the memory store's and the memory region's tables.
pub(super) type KeyMap<V> = HashMap<Key, V, foldhash::fast::RandomState>;

/// What a queued key carries.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Tag {
    /// Whether its rule is bounded (its acknowledgements matter).
    pub(super) bounded: bool,
    /// Its rule's fingerprint (in [`RedisRegion::rules`]; 0: not known
    /// here, as for a full state's keys). The read records the rule on the
    /// key's global state, where a window algorithm's decision leaves it.
    pub(super) rule: u64,
    /// Read with every component, not only this region's own: others'
    /// components this region relays (or a lost batch's, which may have).
    pub(super) relay: bool,
}

impl Tag {
    /// A key queued again: bounded, or relayed, if either was; the newer
    /// rule.
    fn join(&mut self, newer: Tag) {
        self.bounded |= newer.bounded;
        self.relay |= newer.relay;
        if newer.rule != 0 {
            self.rule = newer.rule;
        }
    }
}

/// A key owed to a peer: to be read from Redis, or read already.
#[derive(Debug)]
pub(super) enum Owed {
    /// A key to read.
    Key(Key, Tag),
    /// An item another peer's batch read from Redis after this peer's queue
    /// had its key: as new as a read of its own would be, so it goes out
    /// without one (every peer's queue has about the same keys, and reading
    /// is what a Redis region's sync costs).
    Read(Item, Tag),
}

/// One peer's queue: keys in order, each once (its tag in `queued`), and
/// the items read for another peer.
#[derive(Default)]
pub(super) struct Queue {
    /// Keys to send, oldest first; one not in `queued` (taken since by
    /// another peer's read) is skipped.
    pub(super) order: VecDeque<Key>,
    /// The keys in `order`, each with its tag.
    pub(super) queued: KeyMap<Tag>,
    pub(super) shared: VecDeque<(Item, Tag)>,
}

impl Queue {
    /// Fold `key` into the same key queued already (`None`), or make what
    /// to queue. `made` is the shared key once a queue needed it (made here
    /// at the first), so a key every queue holds already costs no
    /// allocation (a bounded key is touched at every decision).
    pub(super) fn absorb(&mut self, key: &str, tag: Tag, made: &mut Option<Key>) -> Option<Owed> {
        match self.queued.get_mut(key) {
            Some(t) => {
                t.join(tag);
                None
            }
            None => Some(Owed::Key(made.get_or_insert_with(|| Key::from(key)).clone(), tag)),
        }
    }
}

impl KeyQueue for Queue {
    type Key = Owed;

    fn len(&self) -> usize {
        self.queued.len() + self.shared.len()
    }

    fn size(&self) -> usize {
        self.order.len()
    }

    fn push_back(&mut self, key: Owed) {
        match key {
            Owed::Key(k, tag) => {
                self.queued.insert(k.clone(), tag);
                self.order.push_back(k);
            }
            Owed::Read(item, tag) => self.shared.push_back((item, tag)),
        }
    }

    fn pop_front(&mut self) -> Option<Owed> {
        if let Some((item, tag)) = self.shared.pop_front() {
            return Some(Owed::Read(item, tag));
        }
        while let Some(k) = self.order.pop_front() {
            if let Some(tag) = self.queued.remove(&k) {
                return Some(Owed::Key(k, tag));
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use floodgate_core::region::link::KeyQueue;
    use floodgate_core::region::{Item, Shape};

    use super::{Owed, Queue, Tag};

    fn key(o: Option<Owed>) -> Option<(String, bool)> {
        o.map(|o| match o {
            Owed::Key(k, t) => (k.to_string(), t.bounded),
            Owed::Read(item, t) => (format!("read {}", item.key), t.bounded),
        })
    }

    #[test]
    fn a_queue_holds_a_key_once_gives_read_items_first_and_skips_keys_taken_by_another_peer() {
        let mut q = Queue::default();
        for (k, bounded) in [("a", false), ("b", false)] {
            let owed = q.absorb(k, Tag { bounded, rule: 1, relay: false }, &mut None).expect("not queued yet");
            q.push_back(owed);
        }
        assert!(q.absorb("a", Tag { bounded: true, rule: 0, relay: false }, &mut None).is_none(), "queued: folded in");
        assert_eq!(q.len(), 2);
        // Another peer's read took `b` (its item goes to that peer).
        q.queued.remove("b");
        let item = Item { key: "c".into(), fingerprint: 1, shape: Shape::Gcra { slot_us: 1 }, components: vec![] };
        q.push_back(Owed::Read(item, Tag::default()));
        assert_eq!((q.len(), q.size()), (2, 2), "the bound counts the order, the length what is owed");
        assert_eq!(key(q.pop_front()), Some(("read c".into(), false)));
        assert_eq!(key(q.pop_front()), Some(("a".into(), true)), "bounded if either was");
        assert_eq!(key(q.pop_front()), None, "b was taken");
        assert!(q.is_empty());
    }
}
