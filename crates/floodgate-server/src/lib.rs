//! floodgate's service: the protocol-neutral [`service`] and, grouped by
//! role around it:
//!
//! * [`protocol`]: its adapters — Envoy RLS v3 gRPC, the HTTP API, the
//!   admin API;
//! * [`proxy`]: the reverse proxy and its upstream pool;
//! * [`rules`]: where limits come from — hot-reloaded rules files (or the
//!   bundled ones compiled in);
//! * [`store`]: the store chosen at start (memory, Redis, either as a
//!   region's) and the regions' settings and health;
//! * [`dashboard`]: the live page, its data and its heavy-hitter sketch;
//! * [`metrics`]: the Prometheus metrics;
//! * [`listen`]: bounded listeners, per-thread runtimes, load shedding;
//! * [`instance`]: the instance's own files (its state directory);
//! * [`serve`]: settings, then binding everything, then graceful shutdown.

pub mod dashboard;
pub mod instance;
pub mod listen;
pub mod metrics;
pub mod protocol;
pub mod proxy;
pub mod rules;
pub mod serve;
pub mod service;
pub mod store;

use floodgate_core::{MemoryStore, Store, SystemClock};
pub use rules::BUNDLED_RULES;

/// A store the server can run on: decides, and reports its own metrics.
pub trait Backend: Store + std::fmt::Debug + 'static {
    /// Append the store's metrics in Prometheus text format.
    fn render_metrics(&self, out: &mut String);

    /// Drop expired state held in this process (the in-memory store); a
    /// no-op for stores that expire their own.
    fn sweep(&self) {}

    /// The region's health (peers, lag, warming), when this store is part of
    /// one: for `/readyz` and `/admin/v1/status`.
    fn regions_health(&self) -> Option<serde_json::Value> {
        None
    }

    /// The regions this store's limits can be shared by, this one included
    /// (0: not a region).
    fn regions_count(&self) -> usize {
        0
    }

    /// Each concurrency limit's slots (held, acquired, released, expired),
    /// by limit fingerprint.
    fn lease_stats(&self) -> Vec<(u32, floodgate_core::store::memory::LeaseStats)> {
        Vec::new()
    }

    /// Whether the leases live in a store other instances share (Redis):
    /// then [`Backend::lease_stats`] counts this instance's calls, and the
    /// slots held now are the store's, not known here.
    fn leases_shared(&self) -> bool {
        false
    }

    /// What the store reports of itself for the dashboard (kind, keys,
    /// Redis's breaker and counters).
    fn store_health(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
}

impl Backend for MemoryStore<SystemClock> {
    fn lease_stats(&self) -> Vec<(u32, floodgate_core::store::memory::LeaseStats)> {
        MemoryStore::lease_stats(self)
    }

    fn render_metrics(&self, out: &mut String) {
        metrics::gauge(
            out,
            "floodgate_reservations_held",
            "gauge",
            "Reservations the in-memory store holds (open, and settled or expired ones kept one ttl more).",
            self.book().len(),
        );
        metrics::gauge(out, "floodgate_store_keys", "gauge", "Keys held by the in-memory store.", self.len());
        metrics::gauge(
            out,
            "floodgate_store_max_keys",
            "gauge",
            "The in-memory store's bound on keys.",
            self.max_keys(),
        );
        metrics::gauge(
            out,
            "floodgate_store_evictions_total",
            "counter",
            "Keys evicted because the in-memory store was full.",
            self.evictions(),
        );
        metrics::gauge(
            out,
            "floodgate_store_memory_bytes",
            "gauge",
            "Approximate bytes held by the in-memory store.",
            self.memory_bytes(),
        );
    }

    fn sweep(&self) {
        MemoryStore::sweep(self);
    }

    fn store_health(&self) -> serde_json::Value {
        serde_json::json!({
            "kind": "memory",
            "keys": self.len(),
            "max_keys": self.max_keys(),
            "evictions": self.evictions(),
        })
    }
}
