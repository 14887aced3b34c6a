//! What a Redis store needs of its region to decide `scope: global` checks
//! (given when the store is built: [`RedisStore::regional`](crate::RedisStore::regional)),
//! and the script arguments it makes of them. The sync that keeps the
//! region's peers in step is [`crate::RedisRegion`]'s.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use floodgate_core::Check;
use floodgate_core::region::{Scope, Shape, SyncMode, fingerprint, shape_of, slice};

use crate::script::{GlobalArgs, global_key};

/// How a region's store decides `global` checks.
#[derive(Debug, Clone)]
pub struct RegionCtx {
    /// The regions in all, this one included.
    pub regions: usize,
    /// Whether the region waits for a peer's full state (then it admits
    /// only within its slice beyond what it knows).
    pub warming: Arc<AtomicBool>,
    /// The retry time of a request the slice denies, µs.
    pub retry_us: u64,
}

impl RegionCtx {
    /// The script's global arguments for check `c` (its `G:x` key named
    /// under `prefix`), when the check is global.
    pub(crate) fn args(&self, prefix: &str, c: &Check<'_>) -> Option<(String, GlobalArgs)> {
        let Scope::Global(mode) = c.scope else { return None };
        let shape = shape_of(c.limit)?;
        let capacity = match shape {
            Shape::Gcra { .. } => c.limit.burst(),
            Shape::Windowed { .. } => c.limit.limit(),
        };
        let n = u64::try_from(self.regions.max(1)).unwrap_or(u64::MAX);
        let bounded = match mode {
            SyncMode::Bounded { overshoot_ppm } => slice(overshoot_ppm, capacity, self.regions).max(1),
            SyncMode::Eventual => 0,
        };
        let warm = if self.warming.load(Ordering::Acquire) {
            if bounded > 0 { bounded } else { (capacity / n).max(1) }
        } else {
            0
        };
        let x = global_key(prefix, c.key, ":x");
        Some((
            x,
            GlobalArgs {
                slot_us: shape.slot_us(),
                horizon: shape.horizon(),
                slice: bounded,
                peers: n - 1,
                warm,
                retry_us: self.retry_us,
                fingerprint: fingerprint(c.limit, mode),
            },
        ))
    }
}
