//! Per-key state, small and fixed-size for every algorithm but the two whose
//! definition needs history (`sliding_log`, `sliding_buckets`): those keep it
//! behind one pointer so every key's slot stays the same size.

use std::collections::VecDeque;

/// The state one limit keeps for one key. Start from [`State::default`] (empty)
/// and pass it to [`Limit::apply`](crate::Limit::apply); a state written by
/// another algorithm is read as empty.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct State(pub(crate) Inner);

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) enum Inner {
    #[default]
    Empty,
    /// `fixed_window`.
    Window { id: u64, count: u64 },
    /// `sliding_window`.
    Sliding { id: u64, prev: u64, cur: u64 },
    /// `gcra`, `token_bucket`, `leaky_bucket`: theoretical arrival time
    /// `us + rem / limit` microseconds (`rem < limit`).
    Tat { us: u64, rem: u64 },
    /// `sliding_buckets`: `[last bucket id, sum, count per bucket...]`.
    Buckets(Box<[u64]>),
    /// `sliding_log`.
    Log(Box<Log>),
    /// `concurrency`: the leases held.
    Leases(Box<Leases>),
}

/// The leases of one key (a concurrency limit): at most the limit's count,
/// expired ones dropped when the key is next met.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Leases {
    pub(crate) held: Vec<Lease>,
    /// The slots the held leases take.
    pub(crate) used: u64,
}

/// One lease: its id (0: anonymous), when it expires (µs since the epoch)
/// and the slots it takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Lease {
    pub(crate) id: u64,
    pub(crate) expires_us: u64,
    pub(crate) slots: u64,
}

/// Admitted `(time, hits)` entries of the last window, oldest first, and
/// their sum.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Log {
    pub(crate) entries: VecDeque<(u64, u64)>,
    pub(crate) sum: u64,
}

impl State {
    /// An empty state.
    pub const fn new() -> Self {
        Self(Inner::Empty)
    }

    /// The slots its leases hold (a concurrency limit's state), else 0.
    pub fn leases_used(&self) -> u64 {
        match &self.0 {
            Inner::Leases(l) => l.used,
            _ => 0,
        }
    }

    /// Heap bytes owned beyond the state itself (for memory accounting).
    pub fn heap_bytes(&self) -> usize {
        match &self.0 {
            Inner::Buckets(b) => b.len() * 8,
            Inner::Log(l) => size_of::<Log>() + l.entries.capacity() * 16,
            Inner::Leases(l) => size_of::<Leases>() + l.held.capacity() * size_of::<Lease>(),
            _ => 0,
        }
    }
}

macro_rules! view {
    ($name:ident, $variant:ident { $($f:ident),* }, $init:expr) => {
        #[inline]
        pub(crate) fn $name(&mut self) -> ($(&mut view!(@ty $f)),*) {
            if !matches!(self.0, Inner::$variant { .. }) {
                self.0 = $init;
            }
            match &mut self.0 {
                Inner::$variant { $($f),* } => ($($f),*),
                _ => unreachable!("state was just set to this variant"),
            }
        }
    };
    (@ty $f:ident) => { u64 };
}

impl State {
    view!(window, Window { id, count }, Inner::Window { id: 0, count: 0 });
    view!(sliding, Sliding { id, prev, cur }, Inner::Sliding { id: 0, prev: 0, cur: 0 });
    view!(tat, Tat { us, rem }, Inner::Tat { us: 0, rem: 0 });

    /// The bucket ring for `granularity` buckets, created at `bucket_id`.
    #[inline]
    pub(crate) fn buckets(&mut self, granularity: usize, bucket_id: u64) -> &mut [u64] {
        let fits = matches!(&self.0, Inner::Buckets(b) if b.len() == granularity + 2);
        if !fits {
            let mut ring = vec![0u64; granularity + 2].into_boxed_slice();
            ring[0] = bucket_id;
            self.0 = Inner::Buckets(ring);
        }
        match &mut self.0 {
            Inner::Buckets(b) => b,
            _ => unreachable!("state was just set to buckets"),
        }
    }

    pub(crate) fn leases(&mut self) -> &mut Leases {
        if !matches!(self.0, Inner::Leases(_)) {
            self.0 = Inner::Leases(Box::default());
        }
        match &mut self.0 {
            Inner::Leases(l) => l,
            _ => unreachable!("state was just set to leases"),
        }
    }

    #[inline]
    pub(crate) fn log(&mut self) -> &mut Log {
        if !matches!(self.0, Inner::Log(_)) {
            self.0 = Inner::Log(Box::default());
        }
        match &mut self.0 {
            Inner::Log(l) => l,
            _ => unreachable!("state was just set to log"),
        }
    }
}
