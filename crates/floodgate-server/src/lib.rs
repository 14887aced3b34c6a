//! floodgate's service: the protocol-neutral [`service`], its adapters —
//! Envoy RLS v3 gRPC ([`grpc`]), the HTTP API ([`http`]), the admin API
//! ([`admin`]) — with [`metrics`], rate-limit [`headers`], hot-reloaded rules
//! ([`reload`]), runtime overrides persisted on disk ([`overrides`]), and
//! [`serve`], which binds them all and shuts down gracefully.

pub mod admin;
mod bundled;
pub mod grpc;
pub mod headers;
pub mod http;
pub mod json;
pub mod metrics;
pub mod overrides;
pub mod proxy;
pub mod reload;
mod runtimes;
pub mod serve;
pub mod service;
pub mod state;
pub mod store;
mod upstream;

pub use bundled::BUNDLED_RULES;
use floodgate_core::{MemoryStore, Store, SystemClock};

/// A store the server can run on: decides, and reports its own metrics.
pub trait Backend: Store + std::fmt::Debug + 'static {
    /// Append the store's metrics in Prometheus text format.
    fn render_metrics(&self, out: &mut String);

    /// Drop expired state held in this process (the in-memory store); a
    /// no-op for stores that expire their own.
    fn sweep(&self) {}
}

impl Backend for MemoryStore<SystemClock> {
    fn render_metrics(&self, out: &mut String) {
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
}
