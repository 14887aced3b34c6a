//! Stores apply limits to keyed state, atomically per key.

mod key;
pub(crate) use key::OwnedKey;
pub mod memory;
mod table;

use std::future::Future;

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

    /// Whether [`Store::apply_now`] and [`Store::apply_all_now`] always
    /// answer (the in-memory store: `true`; the default `false`), so a
    /// caller can skip preparing a call that would be declined.
    fn answers_now(&self) -> bool {
        false
    }

    /// [`Store::apply`] without waiting, for a store that can answer at once
    /// (the in-memory store always does; the default is `None`). `None`
    /// means nothing was done: ask [`Store::apply`].
    fn apply_now(&self, key: &str, limit: &Limit, hits: u64) -> Option<Result<Decision, StoreError>> {
        let _ = (key, limit, hits);
        None
    }

    /// [`Store::apply_now`] for a key given as bytes, the decision written
    /// into `out` (left as it was unless `Some(Ok(()))`): for callers that
    /// write keys into a buffer (the tower layer's client-IP keys) and keep
    /// the decision in a larger answer. A store that keys by bytes (the
    /// in-memory store) takes them as they are; the default asks
    /// [`Store::apply_now`] with the key as text, and declines (`None`) a key
    /// that is not UTF-8. A `&str` key and its bytes are the same key.
    fn apply_bytes_now(
        &self,
        key: &[u8],
        limit: &Limit,
        hits: u64,
        out: &mut Decision,
    ) -> Option<Result<(), StoreError>> {
        Some(self.apply_now(std::str::from_utf8(key).ok()?, limit, hits)?.map(|d| *out = d))
    }

    /// [`Store::apply_all`] without waiting, as [`Store::apply_now`]: `false`
    /// means nothing was done (and `out` is untouched).
    fn apply_all_now(&self, checks: &[Check<'_>], out: &mut Vec<Result<Decision, StoreError>>) -> bool {
        let _ = (checks, out);
        false
    }
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
    /// Units to take (0 = peek).
    pub hits: u64,
    /// Whether a denial of this limit denies the request.
    pub enforce: bool,
    /// Which regions share the limit: a store that is not a region's (or
    /// knows no peers) decides a `global` check as a regional one.
    pub scope: crate::region::Scope,
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
