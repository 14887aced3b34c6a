//! The local over-limit cache: a key denied for one hit stays denied until
//! its `retry_after` if nothing else arrives, so until then a request for
//! one hit on it is answered here, without a Redis call. Only denials are
//! cached, never an allow, and only for the exact wait the script computed,
//! measured from when the request was sent (so the entry lapses a round
//! trip early, never late). A refund through this instance drops the key's
//! entry. Two things can make room sooner unseen: a refund through another
//! instance, and a cross-slot refund of a request taken before this denial
//! (Redis Cluster, a request whose limits span slots and were denied
//! elsewhere); until the entry lapses, that room waits.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use floodgate_core::Decision;

const SHARDS: usize = 16;

/// Entries per shard; a full shard first drops expired entries, then stops
/// caching until some expire (the cache only saves Redis calls).
const SHARD_CAPACITY: usize = 8_192;

/// Key -> (when the denial was asked for, the denial).
type Shard = Mutex<HashMap<String, (Instant, Decision)>>;

#[derive(Debug)]
pub(crate) struct DeniedCache {
    shards: Box<[Shard]>,
    hasher: std::collections::hash_map::RandomState,
}

impl DeniedCache {
    pub(crate) fn new() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            hasher: std::collections::hash_map::RandomState::new(),
        }
    }

    fn shard(&self, key: &str) -> &Shard {
        use std::hash::BuildHasher;
        &self.shards[(self.hasher.hash_one(key) as usize) % SHARDS]
    }

    /// The cached denial of `key` as of `now`, its waits shortened by the
    /// time since it was decided.
    pub(crate) fn get(&self, key: &str, now: Instant) -> Option<Decision> {
        let shard = self.shard(key).lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let (decided, d) = shard.get(key)?;
        let elapsed = now.saturating_duration_since(*decided);
        let retry = d.retry_after?.checked_sub(elapsed).filter(|r| !r.is_zero())?;
        Some(Decision { retry_after: Some(retry), reset_after: d.reset_after.saturating_sub(elapsed), ..*d })
    }

    /// Forget `key`'s denial (a refund made room).
    pub(crate) fn forget(&self, key: &str) {
        let mut shard = self.shard(key).lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        shard.remove(key);
    }

    /// Remember a denial of one hit decided at `now`.
    pub(crate) fn put(&self, key: &str, now: Instant, d: &Decision) {
        let Some(retry) = d.retry_after else { return };
        if retry < Duration::from_millis(1) {
            return;
        }
        let mut shard = self.shard(key).lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if shard.len() >= SHARD_CAPACITY && !shard.contains_key(key) {
            shard.retain(|_, (at, d)| d.retry_after.is_some_and(|r| now.saturating_duration_since(*at) < r));
            if shard.len() >= SHARD_CAPACITY {
                return;
            }
        }
        shard.insert(key.to_owned(), (now, *d));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_denial_is_served_until_its_retry_time_only() {
        let c = DeniedCache::new();
        let t0 = Instant::now();
        let d = Decision {
            allowed: false,
            limit: 5,
            retry_after: Some(Duration::from_millis(100)),
            reset_after: Duration::from_millis(300),
            ..Decision::default()
        };
        c.put("k", t0, &d);
        let later = c.get("k", t0 + Duration::from_millis(40)).unwrap();
        assert_eq!(later.retry_after, Some(Duration::from_millis(60)));
        assert_eq!(later.reset_after, Duration::from_millis(260));
        assert!(c.get("k", t0 + Duration::from_millis(100)).is_none(), "due: ask Redis again");
        assert!(c.get("other", t0).is_none());
    }
}
