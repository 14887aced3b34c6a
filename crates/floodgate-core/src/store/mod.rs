//! Stores apply limits to keyed state, atomically per key.

mod key;
pub(crate) use key::OwnedKey;
pub mod memory;
mod table;

use std::future::Future;

use crate::reservation::{ReservationError, ReservationId, Settled};
use crate::{Decision, Limit};

/// A store of keyed rate-limit state: one atomic check-and-update per call.
///
/// The in-memory store answers at once (its future is ready); the Redis store
/// makes one round trip. Implementations must be atomic per key: concurrent
/// calls on one key behave as if they ran one after the other.
pub trait Store: Send + Sync {
    /// Decide `hits` units of `limit` for `key` at the store's current time.
    fn apply(&self, key: &str, limit: &Limit, hits: u64) -> impl Future<Output = Result<Decision, StoreError>> + Send;

    /// Whether the store answers (for readiness probes). The in-memory store
    /// always does.
    fn ping(&self) -> impl Future<Output = Result<(), StoreError>> + Send {
        std::future::ready(Ok(()))
    }

    /// Decide every limit of one request, **all or nothing**: when an
    /// enforced check is denied, the checks that allowed keep nothing of this
    /// request (their hits are given back, [`Limit::refund`]). Writes one
    /// result per check, in order, into `out` (cleared first). Each decision
    /// is the one its limit made; a refunded limit's `remaining` does not
    /// count the refund.
    fn apply_all(
        &self,
        checks: &[Check<'_>],
        out: &mut Vec<Result<Decision, StoreError>>,
    ) -> impl Future<Output = ()> + Send;

    /// [`Store::apply`] for a key given as bytes, which the future does not
    /// hold: for callers that write keys into a buffer of their own (the
    /// tower layer's client-IP keys). A store that keys by bytes (the
    /// in-memory store, [`Store::keys_by_bytes`]) takes them as they are;
    /// the default asks [`Store::apply`] with the key as text (a copy),
    /// bytes that are not UTF-8 replaced by U+FFFD. A `&str` key and its
    /// bytes are the same key.
    fn apply_bytes<'a>(
        &'a self,
        key: &[u8],
        limit: &'a Limit,
        hits: u64,
    ) -> impl Future<Output = Result<Decision, StoreError>> + Send + use<'a, Self> {
        let key = String::from_utf8_lossy(key).into_owned();
        async move { self.apply(&key, limit, hits).await }
    }

    /// Whether every future this store gives is ready when first polled
    /// (the in-memory store: `true`; the default `false`). A caller that
    /// must not allocate for a decision that answers at once (the tower
    /// layer) polls it once, with [`ready_at_once`], only then.
    fn answers_at_once(&self) -> bool {
        false
    }

    /// Reserve: decide `checks` as [`Store::apply_all`] does (all or
    /// nothing, into `out`) and, when the request is allowed, keep what
    /// each check took as one reservation (`ttls_us`: each check's
    /// `reservation_ttl`), to settle later with [`Store::settle`] through
    /// any instance of the region. `None` when nothing was kept (denied,
    /// or no check takes). The default keeps none and decides nothing.
    fn reserve(
        &self,
        checks: &[Check<'_>],
        ttls_us: &[u64],
        out: &mut Vec<Result<Decision, StoreError>>,
    ) -> impl Future<Output = Result<Option<ReservationId>, ReservationError>> + Send {
        let _ = (checks, ttls_us);
        out.clear();
        std::future::ready(Err(ReservationError::Unsupported("use the memory store or Redis")))
    }

    /// Settle reservation `id` at `actual` (one amount for every part, or
    /// one per part): see [`crate::reservation`].
    fn settle(
        &self,
        id: ReservationId,
        actual: &[u64],
    ) -> impl Future<Output = Result<Settled, ReservationError>> + Send {
        let _ = (id, actual);
        std::future::ready(Err(ReservationError::Unsupported("use the memory store or Redis")))
    }

    /// Whether keys are compared as bytes, so a caller may key by bytes
    /// that are not text (an IP address's 4 or 16 bytes) through
    /// [`Store::apply_bytes`]; the default `false` (keys are text: the
    /// bytes of [`Store::apply_bytes`] are read as UTF-8).
    fn keys_by_bytes(&self) -> bool {
        false
    }
}

/// `fut` polled once: [`Poll::Ready`](std::task::Poll::Ready) with its
/// output, or `Pending` (and `fut` is dropped: what it started is
/// abandoned). For a caller that knows the stores below it answer at once
/// ([`Store::answers_at_once`]) and would rather not box the future it
/// holds (the tower layer's `call`): the decision, written once, runs to
/// its end in this one poll.
///
/// ```
/// use floodgate_core::{Algorithm, Limit, MemoryStore, Store};
/// use floodgate_core::store::ready_at_once;
/// let store = MemoryStore::new();
/// let limit = Limit::new(Algorithm::FixedWindow, 1, std::time::Duration::from_secs(60)).unwrap();
/// assert!(store.answers_at_once());
/// let std::task::Poll::Ready(Ok(d)) = ready_at_once(store.apply("alice", &limit, 1)) else { panic!() };
/// assert!(d.allowed);
/// assert!(ready_at_once(std::future::pending::<()>()).is_pending());
/// ```
#[inline(always)]
pub fn ready_at_once<F: Future>(fut: F) -> std::task::Poll<F::Output> {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    std::pin::pin!(fut).poll(&mut cx)
}

/// One limit to decide for one request: the key's counter, the limit, the
/// hits, and whether a denial denies the request (`false` for a shadow-mode
/// limit, which is counted and reported but never denies).
#[derive(Debug, Clone, Copy)]
pub struct Check<'a> {
    /// The counter key.
    pub key: &'a str,
    /// The limit.
    pub limit: &'a Limit,
    /// Units to take (0 = peek), or to give back.
    pub hits: u64,
    /// Whether the check takes or gives back.
    pub op: Op,
    /// Whether a denial of this limit denies the request.
    pub enforce: bool,
    /// Which regions share the limit: a store that is not a region's (or
    /// knows no peers) decides a `global` check as a regional one.
    pub scope: crate::region::Scope,
}

/// Decide one request's `checks` **all or nothing** into `out` (cleared
/// first): `decide` answers each check in order; when an enforced check
/// that takes is denied, `undo` gives back each check that took hits (a
/// refund took nothing, so it stays; a late charge is never given back: the
/// work it counts is done). Shared by the stores that decide in
/// this process (the in-memory store, a memory region's table).
pub(crate) fn all_or_nothing(
    checks: &[Check<'_>],
    out: &mut Vec<Result<Decision, StoreError>>,
    mut decide: impl FnMut(&Check<'_>) -> Result<Decision, StoreError>,
    mut undo: impl FnMut(&Check<'_>),
) {
    out.clear();
    let mut denied = false;
    for c in checks {
        let r = decide(c);
        denied |= c.enforce && r.as_ref().is_ok_and(|d| !d.allowed);
        out.push(r);
    }
    if denied {
        // Newest first, as the Redis script undoes: two anonymous slots of
        // one key give back what each took.
        for (c, r) in checks.iter().zip(out.iter()).rev() {
            if c.takes_back_on_denial() && r.as_ref().is_ok_and(|d| d.allowed) {
                undo(c);
            }
        }
    }
}

impl Check<'_> {
    /// Whether a denial of its request gives this check's hits back: it
    /// took some before the work (not a refund, a peek or a late charge).
    pub fn takes_back_on_denial(&self) -> bool {
        matches!(self.op, Op::Take | Op::Acquire { .. })
            && self.hits > 0
            && self.limit.charge() == crate::Charge::Before
    }

    /// Whether a reservation keeps a part for this check when it allows:
    /// it takes (a peek too: a settle charges its actual amount late), and
    /// not a concurrency limit's slot (released, never settled).
    pub fn reserves(&self) -> bool {
        matches!(self.op, Op::Take | Op::Acquire { .. }) && !self.limit.is_concurrency()
    }
}

/// What a check does to its limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Op {
    /// Take `hits` if they fit (0: a peek, which takes nothing). A request
    /// takes all its checks' hits or none.
    #[default]
    Take,
    /// A refund: give `hits` back ([`Limit::give_back`]). Always allowed,
    /// never denies its request, and given back whatever the request's
    /// other checks decide (it takes nothing, so there is nothing to undo).
    Refund,
    /// A late charge: `hits` counted after the work whatever the limit's
    /// own charge (a reservation settled above its estimate): never
    /// denied, never undone, counted into debt if need be.
    Late,
    /// Give back `hits` taken at `taken_at_us` as if they had never been
    /// taken ([`Limit::refund`]: what has left the window since is not
    /// given back) — a reservation settled below its estimate, or
    /// cancelled. Answered as a peek afterwards; never denies.
    Return {
        /// When the hits were taken (µs since the epoch).
        taken_at_us: u64,
    },
    /// Acquire `hits` slots of a concurrency limit as lease `lease`
    /// ([`Limit::acquire`]); any other limit takes its hits as
    /// [`Op::Take`] does. A request denied by another of its limits holds
    /// no slot (the lease is released).
    Acquire {
        /// The lease's id (0: anonymous).
        lease: u64,
    },
    /// Release lease `lease` of a concurrency limit, or with `None` its
    /// earliest-expiring lease ([`Limit::release`]); any other limit only
    /// peeks: a release gives back no rate or budget hits. Never denies.
    Release {
        /// The lease's id, when the caller has it.
        lease: Option<u64>,
    },
    /// Extend lease `lease` of a concurrency limit ([`Limit::extend`]):
    /// denied when the lease is gone; any other limit only peeks.
    Extend {
        /// The lease's id.
        lease: u64,
    },
}

impl Op {
    /// Whether this op, on `limit`, is one of a concurrency limit's lease
    /// operations (an acquire, release or extend of its slots).
    pub fn on_leases(self, limit: &crate::Limit) -> bool {
        matches!(self, Op::Acquire { .. } | Op::Release { .. } | Op::Extend { .. }) && limit.is_concurrency()
    }
}

/// A store could not decide. A denial is not an error: it is a [`Decision`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The key bound is reached and the store is set to refuse new keys
    /// ([`OnFull::Refuse`](memory::OnFull::Refuse)).
    #[error("the store holds its maximum of {max_keys} keys and refuses new ones; raise max_keys or choose eviction")]
    Full {
        /// The configured bound.
        max_keys: usize,
    },
    /// The backing service failed or did not answer in time.
    #[error("store unavailable: {0}")]
    Unavailable(String),
}

impl StoreError {
    /// Whether trying again later may succeed (the rule's failure policy
    /// applies); a non-transient error is a bug or a misconfiguration.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Full { .. } | Self::Unavailable(_) => true,
        }
    }
}
