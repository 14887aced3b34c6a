//! The store `serve` runs on, chosen at start: the in-memory store (alone,
//! or as a region whose `scope: global` limits are shared with peers) or
//! Redis (one server or a cluster). One enum, so the server is compiled
//! once and each decision costs one branch to dispatch.

pub mod regions;

use std::sync::Arc;

use floodgate_core::reservation::{ReservationError, ReservationId, Settled};
use floodgate_core::{Check, Clock, Decision, Limit, MemoryStore, Store, StoreError};
use floodgate_redis::{RedisRegion, RedisStore};

use crate::Backend;
use crate::metrics::gauge;
use crate::store::regions::Regions;
use floodgate_core::region::{GlobalTable, Scope};

/// The in-memory store, a memory-store region, or the Redis store.
#[derive(Debug)]
pub enum ServerStore {
    /// This process's memory.
    Memory(MemoryStore),
    /// This process's memory as one region of several: `global` limits go
    /// through the region's table, the others through the memory store.
    Regional(MemoryStore, Arc<GlobalTable>, Arc<Regions>),
    /// Redis or Redis Cluster, shared by every instance.
    Redis(RedisStore),
    /// One Redis server as one region of several: every check in the one
    /// script call, `global` ones over every region's counts.
    RedisRegional(RedisStore, Arc<RedisRegion>, Arc<Regions>),
}

impl ServerStore {
    /// The region this store is part of, if any.
    pub fn regions(&self) -> Option<&Arc<Regions>> {
        match self {
            Self::Regional(_, _, r) | Self::RedisRegional(_, _, r) => Some(r),
            _ => None,
        }
    }
}

impl Store for ServerStore {
    async fn apply(&self, key: &str, limit: &Limit, hits: u64) -> Result<Decision, StoreError> {
        match self {
            Self::Memory(s) | Self::Regional(s, ..) => s.apply_sync(key, limit, hits),
            Self::Redis(s) | Self::RedisRegional(s, ..) => s.apply(key, limit, hits).await,
        }
    }

    async fn ping(&self) -> Result<(), StoreError> {
        match self {
            Self::Memory(_) | Self::Regional(..) => Ok(()),
            Self::Redis(s) | Self::RedisRegional(s, ..) => s.ping().await,
        }
    }

    async fn apply_all(&self, checks: &[Check<'_>], out: &mut Vec<Result<Decision, StoreError>>) {
        match self {
            Self::Memory(s) => s.apply_all(checks, out).await,
            Self::Regional(s, t, _) => t.apply_all_with(s, checks, s.clock().now_us(), out),
            Self::Redis(s) => s.apply_all(checks, out).await,
            Self::RedisRegional(s, region, _) => {
                s.apply_all(checks, out).await;
                touched(region, checks, out);
            }
        }
    }

    async fn reserve(
        &self,
        checks: &[Check<'_>],
        ttls_us: &[u64],
        out: &mut Vec<Result<Decision, StoreError>>,
    ) -> Result<Option<ReservationId>, ReservationError> {
        match self {
            Self::Memory(s) => s.reserve(checks, ttls_us, out).await,
            Self::Regional(s, t, _) => {
                // The region is this process: its reservations are kept
                // beside the memory store's, decided through the table.
                let now = s.clock().now_us();
                s.book().reserve_with(checks, ttls_us, now, out, |out| t.apply_all_with(s, checks, now, out))
            }
            Self::Redis(s) => s.reserve(checks, ttls_us, out).await,
            Self::RedisRegional(s, region, _) => {
                let id = s.reserve(checks, ttls_us, out).await;
                touched(region, checks, out);
                id
            }
        }
    }

    async fn settle(&self, id: ReservationId, actual: &[u64]) -> Result<Settled, ReservationError> {
        match self {
            Self::Memory(s) => s.settle(id, actual).await,
            Self::Regional(s, t, _) => {
                let now = s.clock().now_us();
                s.book().settle_with(id, actual, now, |c, out| t.apply_all_with(s, c, now, out))
            }
            Self::Redis(s) => s.settle(id, actual).await,
            Self::RedisRegional(s, region, _) => {
                let settled = s.settle(id, actual).await?;
                for p in settled.parts.iter().filter(|_| !settled.again) {
                    let (late, returned) = (p.charged_late, p.returned);
                    let hits = late + returned;
                    if let (Scope::Global(mode), Ok(d), true) = (p.scope, &p.decision, hits > 0) {
                        region.touched(&p.key, &p.limit, mode, hits, d.remaining);
                    }
                }
                Ok(settled)
            }
        }
    }

    fn answers_at_once(&self) -> bool {
        match self {
            Self::Memory(s) | Self::Regional(s, ..) => s.answers_at_once(),
            Self::Redis(s) | Self::RedisRegional(s, ..) => s.answers_at_once(),
        }
    }
}

/// A Redis region's global checks that changed a count, marked for the
/// next sync.
fn touched(region: &RedisRegion, checks: &[Check<'_>], out: &[Result<Decision, StoreError>]) {
    for (c, r) in checks.iter().zip(out.iter()) {
        if let (Scope::Global(mode), Ok(d)) = (c.scope, r)
            && d.allowed
            && c.hits > 0
        {
            region.touched(c.key, c.limit, mode, c.hits, d.remaining);
        }
    }
}

impl Backend for ServerStore {
    fn render_metrics(&self, out: &mut String) {
        match self {
            Self::Memory(s) => s.render_metrics(out),
            Self::Regional(s, _, r) => {
                s.render_metrics(out);
                r.render_metrics(out);
            }
            Self::Redis(s) | Self::RedisRegional(s, ..) => {
                if let Self::RedisRegional(_, _, r) = self {
                    r.render_metrics(out);
                }
                let st = s.stats();
                gauge(out, "floodgate_redis_calls_total", "counter", "Script calls made to Redis.", st.calls);
                gauge(
                    out,
                    "floodgate_redis_errors_total",
                    "counter",
                    "Redis calls that failed (timed out, lost the connection, or errored).",
                    st.errors,
                );
                gauge(out, "floodgate_redis_timeouts_total", "counter", "Redis calls that timed out.", st.timeouts);
                gauge(
                    out,
                    "floodgate_redis_breaker_open",
                    "gauge",
                    "1 while the circuit breaker is open (Redis failing; decisions follow the failure policy at once).",
                    u8::from(st.breaker_open),
                );
                gauge(
                    out,
                    "floodgate_redis_breaker_trips_total",
                    "counter",
                    "Times the circuit breaker opened.",
                    st.breaker_trips,
                );
                gauge(
                    out,
                    "floodgate_redis_rejected_open_total",
                    "counter",
                    "Decisions not sent to Redis because the breaker was open.",
                    st.rejected_open,
                );
                gauge(
                    out,
                    "floodgate_redis_cached_denials_total",
                    "counter",
                    "Denials answered from the local over-limit cache, without a Redis call.",
                    st.cached_denials,
                );
                gauge(
                    out,
                    "floodgate_redis_cross_slot_refunds_total",
                    "counter",
                    "Refund calls after a request was denied in another Redis Cluster slot.",
                    st.cross_slot_refunds,
                );
                gauge(
                    out,
                    "floodgate_redis_resent_total",
                    "counter",
                    "Calls sent once more on a fresh connection: their connection failed before one byte of them went out.",
                    st.resent,
                );
                gauge(
                    out,
                    "floodgate_redis_connections_replaced_total",
                    "counter",
                    "Connections replaced before use: closed by Redis, or made before the breaker last opened.",
                    st.replaced,
                );
            }
        }
    }

    fn regions_health(&self) -> Option<serde_json::Value> {
        self.regions().map(|r| r.health())
    }

    fn regions_count(&self) -> usize {
        self.regions().map_or(0, |r| r.count())
    }

    fn lease_stats(&self) -> Vec<(u32, floodgate_core::store::memory::LeaseStats)> {
        match self {
            Self::Memory(s) | Self::Regional(s, ..) => s.lease_stats(),
            Self::Redis(s) | Self::RedisRegional(s, ..) => s.lease_stats(),
        }
    }

    fn leases_shared(&self) -> bool {
        matches!(self, Self::Redis(..) | Self::RedisRegional(..))
    }

    fn store_health(&self) -> serde_json::Value {
        match self {
            Self::Memory(s) | Self::Regional(s, ..) => s.store_health(),
            Self::Redis(s) | Self::RedisRegional(s, ..) => {
                let st = s.stats();
                serde_json::json!({
                    "kind": "redis",
                    "breaker_open": st.breaker_open,
                    "breaker_trips": st.breaker_trips,
                    "calls": st.calls,
                    "errors": st.errors,
                    "timeouts": st.timeouts,
                    "cached_denials": st.cached_denials,
                    "rejected_open": st.rejected_open,
                })
            }
        }
    }

    fn sweep(&self) {
        match self {
            Self::Memory(s) => {
                s.sweep();
            }
            Self::Regional(s, t, _) => {
                s.sweep();
                t.sweep(s.clock().now_us());
            }
            Self::Redis(_) | Self::RedisRegional(..) => {}
        }
    }
}
