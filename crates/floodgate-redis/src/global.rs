//! What a Redis store needs of its region to decide `scope: global` checks
//! (given when the store is built: [`RedisStore::regional`](crate::RedisStore::regional)),
//! and the script arguments it makes of them. The sync that keeps the
//! region's peers in step is [`crate::RedisRegion`]'s.

use std::fmt::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use floodgate_core::Check;
use floodgate_core::region::{Incarnations, Scope, Shape, SyncMode, fingerprint, shape_of, slice};

use crate::script::{GlobalArgs, global_key, window_string_state};

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
    /// Whether every peer has recorded the region's incarnation: until
    /// then bounded rules admit nothing.
    pub recorded: Arc<AtomicBool>,
    /// Until when eventual rules admit nothing (µs since the epoch; 0:
    /// never): the region knows nothing yet (its Redis restarted empty) and
    /// no peer's full state has arrived.
    pub cold_until_us: Arc<AtomicU64>,
    /// The record of incarnations: what dead ones cost bounded decisions.
    pub deaths: Arc<Incarnations>,
}

impl RegionCtx {
    /// A region of `regions` regions, warm, recorded by every peer, with no
    /// dead incarnation known (what a caller that drives the region itself
    /// changes through the shared flags).
    pub fn new(regions: usize, retry_us: u64) -> Self {
        Self {
            regions,
            warming: Arc::new(AtomicBool::new(false)),
            retry_us,
            recorded: Arc::new(AtomicBool::new(true)),
            cold_until_us: Arc::new(AtomicU64::new(0)),
            deaths: Arc::new(Incarnations::new(0)),
        }
    }

    /// The script's global arguments for check `c` (its `G:x` key named
    /// under `prefix`, or empty for a quiet check), when the check is global; `now` reads the time
    /// (only when a crash charge or the warm-up needs it).
    pub(crate) fn args(&self, prefix: &str, c: &Check<'_>, now: impl Fn() -> u64) -> Option<(String, GlobalArgs)> {
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
        let warming = self.warming.load(Ordering::Acquire);
        let warm = if warming { if bounded > 0 { bounded } else { (capacity / n).max(1) } } else { 0 };
        let (mut charge, mut debts) = (0, String::new());
        let closed = match mode {
            SyncMode::Bounded { .. } => {
                if self.deaths.deaths() > 0 {
                    let t = now();
                    match shape {
                        // A slice per dead incarnation whose span overlaps
                        // what the decision counts.
                        Shape::Windowed { slot_us, horizon } => {
                            let cur = t / slot_us;
                            let from = (cur + 1).saturating_sub(u64::from(horizon)).saturating_mul(slot_us);
                            charge =
                                bounded.saturating_mul(self.deaths.charges(from, (cur + 1).saturating_mul(slot_us)));
                        }
                        // A slice of debt dated at each death (the script
                        // pours each once per key).
                        Shape::Gcra { .. } => {
                            for (_, dead_us, count) in self.deaths.dead_spans() {
                                let _ = write!(
                                    debts,
                                    "{}{dead_us}:{}",
                                    if debts.is_empty() { "" } else { "," },
                                    bounded.saturating_mul(count)
                                );
                            }
                        }
                    }
                }
                !self.recorded.load(Ordering::Acquire)
            }
            SyncMode::Eventual => {
                let until = self.cold_until_us.load(Ordering::Acquire);
                warming && until != 0 && now() < until
            }
        };
        // A quiet check (`scripts/entry.lua`): the script names its G:x
        // only when it reads it, which a key no peer counts for never needs
        // (empty here, "=" in the script's arguments).
        let quiet = window_string_state(c.limit) && bounded == 0 && warm == 0 && charge == 0 && !closed;
        let x = if quiet { String::new() } else { global_key(prefix, c.key, ":x") };
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
                charge,
                closed,
                debts,
            },
        ))
    }
}
