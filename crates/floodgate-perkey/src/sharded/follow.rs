//! Following the other instances' changes over Redis Pub/Sub (and the
//! shards' versions, for a notice that was lost), and setting up the
//! sharded layout.

use std::sync::Arc;
use std::sync::atomic::Ordering::{Relaxed, Release};
use std::time::{Duration, Instant};

use floodgate_redis::RedisStore;

use super::{SHARDS, Sharded};
use crate::entries::Write;
use crate::{DEFAULT_CACHE_TTL, KeyError, MAX_BATCH, PerKey, REFRESH_SHARE, VERSIONS_EVERY, sharded};

/// How often the per-tier counts are read from Redis besides after change
/// notices.
pub(crate) const COUNTS_EVERY: Duration = Duration::from_secs(5);

impl PerKey {
    /// Keep the entries in Redis from now on (`store`): reads, writes and
    /// listings go there, and the returned task (run it) reads misses in
    /// batches and keeps this instance's cache in step with every other
    /// instance's writes. Entries of an older layout are moved in first,
    /// once per Redis: the shared overrides of builds before tiers, else
    /// this instance's database.
    pub fn share(self: &Arc<Self>, store: RedisStore) -> impl std::future::Future<Output = ()> + Send + 'static {
        let sharded = Arc::new(Sharded::new(store));
        let _ = self.sharded.set(sharded.clone());
        if self.ttl.is_none() {
            self.ttl_ms.store(u64::try_from(DEFAULT_CACHE_TTL.as_millis()).unwrap_or(u64::MAX), Relaxed);
        }
        let ttl = self.ttl_ms.load(Relaxed);
        if ttl != u64::MAX {
            self.refresh_ms.store(ttl / REFRESH_SHARE, Relaxed);
        }
        // Until Redis's counts are read, every domain is looked up.
        self.all_domains.store(true, Relaxed);
        let this = self.clone();
        async move {
            tokio::join!(this.follow(&sharded), this.refresh_due(&sharded));
        }
    }

    /// Set up the layout, then follow the change channel for good:
    /// subscribe, drop the cache, refresh the counts; drop each message's
    /// keys from the cache; on losing the subscription, start over.
    pub(crate) async fn follow(&self, sharded: &Sharded) {
        let mut set_up = false;
        let mut lost_logged = false;
        loop {
            if !set_up {
                match self.set_up(sharded).await {
                    Ok(()) => set_up = true,
                    Err(e) => tracing::debug!("per-key layout in Redis not checked yet: {e}"),
                }
            }
            match sharded.store().subscribe(&sharded.channel).await {
                Ok(mut sub) => {
                    let n = self.stats.subscribed.fetch_add(1, Relaxed);
                    self.drop_all();
                    if n > 0 {
                        tracing::info!(
                            "per-key change notices from Redis resumed: the cache was dropped (changes meanwhile may have been missed)"
                        );
                    }
                    lost_logged = false;
                    if let Err(e) = self.refresh_counts().await {
                        tracing::debug!("per-key counts not read: {e}");
                    }
                    // Read after notices (at most every 250 ms), and every
                    // COUNTS_EVERY regardless.
                    let mut counts = tokio::time::interval(Duration::from_millis(250));
                    counts.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    let (mut noticed, mut counted) = (false, Instant::now());
                    let mut versions = tokio::time::interval(VERSIONS_EVERY);
                    versions.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    // The versions as of the subscription (the cache is empty).
                    let mut seen: Option<Vec<u64>> = None;
                    loop {
                        tokio::select! {
                            msg = sub.next() => match msg {
                                Some(payload) => {
                                    self.changed(&payload, seen.as_mut());
                                    noticed = true;
                                }
                                None => break,
                            },
                            _ = counts.tick(), if noticed || counted.elapsed() >= COUNTS_EVERY => {
                                noticed = false;
                                counted = Instant::now();
                                if let Err(e) = self.refresh_counts().await {
                                    tracing::debug!("per-key counts not read: {e}");
                                }
                            }
                            _ = versions.tick() => match sharded.versions().await {
                                Ok(now) => self.check_versions(&mut seen, now),
                                Err(e) => tracing::debug!("per-key shard versions not read: {e}"),
                            },
                        }
                    }
                }
                Err(e) if !lost_logged => {
                    lost_logged = true;
                    tracing::warn!(
                        "per-key change notices from Redis unavailable: {e}; cached answers serve until their time to live, and the cache is dropped once they resume"
                    );
                }
                Err(_) => {}
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// A change notice (`shard:version:["lookup key", …]`): its keys leave
    /// the cache, and its shard's version is noted as seen.
    pub(crate) fn changed(&self, payload: &[u8], seen: Option<&mut Vec<u64>>) {
        let parsed = std::str::from_utf8(payload).ok().and_then(|p| {
            let mut parts = p.splitn(3, ':');
            let shard: usize = parts.next()?.parse().ok().filter(|s| *s < SHARDS)?;
            let version: u64 = parts.next()?.parse().ok()?;
            let keys: Vec<String> = serde_json::from_str(parts.next()?).ok()?;
            Some((shard, version, keys))
        });
        match parsed {
            Some((shard, version, keys)) => {
                self.forget(keys.iter().map(String::as_str));
                self.stats.notices.fetch_add(1, Relaxed);
                if let Some(seen) = seen {
                    // Notices of one shard come in order (one node
                    // publishes them): a gap is a lost notice.
                    if version > seen[shard] + 1 {
                        self.drop_shards(&[shard]);
                    }
                    seen[shard] = seen[shard].max(version);
                }
            }
            None => {
                tracing::warn!("a per-key change notice that does not parse: the cache is dropped");
                self.drop_all();
            }
        }
    }

    /// The shards' versions read now against those seen: a shard that
    /// moved past its last notice lost one, and its cached answers go.
    pub(crate) fn check_versions(&self, seen: &mut Option<Vec<u64>>, now: Vec<u64>) {
        let Some(seen) = seen else {
            *seen = Some(now);
            return;
        };
        let behind: Vec<usize> = (0..SHARDS).filter(|&s| now[s] > seen[s]).collect();
        if behind.is_empty() {
            return;
        }
        // A notice may also be on its way still: dropping early costs a
        // read per key, never a stale answer.
        self.drop_shards(&behind);
        for s in behind {
            seen[s] = now[s];
        }
    }

    /// Drop the cached answers of these shards (they changed with no
    /// notice).
    pub(crate) fn drop_shards(&self, shards: &[usize]) {
        self.stats.missed_notices.fetch_add(shards.len() as u64, Relaxed);
        tracing::debug!(?shards, "per-key shards changed with no notice: their cached answers are dropped");
        self.dropping(|| {
            self.compact.retain_shards(|s| !shards.contains(&s));
            self.cache.retain(|k, _| !shards.contains(&sharded::shard_of(k.as_str())));
        });
    }

    /// Drop every cached answer.
    pub(crate) fn drop_all(&self) {
        self.dropping(|| {
            self.compact.clear();
            self.cache.clear();
        });
    }

    /// Take answers out of the caches with `drop`, in the order both
    /// guards need: the epoch first (a miss whose read began before is then
    /// not kept in the compact table), the generation after (every
    /// thread's front copies go too, and none read before is used again).
    pub(crate) fn dropping(&self, drop: impl FnOnce()) {
        self.epoch.fetch_add(1, Release);
        drop();
        self.generation.fetch_add(1, Release);
    }

    /// Move entries of an older layout into the sharded one, once per
    /// Redis (a marker key says it was done): the shared map of builds
    /// before tiers (`<prefix>{overrides}`), else this instance's database.
    pub(crate) async fn set_up(&self, sharded: &Sharded) -> Result<(), KeyError> {
        if sharded.is_set_up().await? {
            return Ok(());
        }
        let old = sharded.store().shared_map("overrides");
        let (version, rows) = old.load().await.map_err(|e| KeyError::Shared(e.to_string()))?;
        let mut moved = 0;
        if version > 0 {
            let mut writes = Vec::with_capacity(rows.len());
            for (field, text) in &rows {
                match Write::legacy(text) {
                    Ok(w) => writes.push(w),
                    Err(e) => tracing::warn!("shared override {field:?} not moved: {e}"),
                }
            }
            for chunk in writes.chunks(MAX_BATCH) {
                sharded.apply(chunk).await?;
                moved += chunk.len();
            }
            tracing::info!(
                entries = moved,
                "moved the shared runtime overrides into the sharded per-key entries in Redis"
            );
        } else {
            let mut cursor = None;
            loop {
                let page = self.page(None, "", false, cursor.as_deref(), 1_000)?;
                let writes: Vec<Write> = page.entries.iter().filter_map(|(spec, at)| Write::of(spec, *at)).collect();
                sharded.apply(&writes).await?;
                moved += writes.len();
                match page.next_cursor {
                    Some(c) => cursor = Some(c),
                    None => break,
                }
            }
            if moved > 0 {
                tracing::info!(entries = moved, "Redis held no per-key entries: uploaded this instance's");
            }
        }
        sharded.mark_set_up().await
    }
}
