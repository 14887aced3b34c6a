//! What the service targets share: a service as `serve` builds it (memory
//! store, per-key entries in a fresh directory) and one runtime.

use std::sync::Arc;

use floodgate_core::limiter::Limiter;
use floodgate_core::rules::LoadOptions;
use floodgate_core::{MemoryStore, SystemClock};
use floodgate_perkey::PerKey;
use floodgate_server::metrics::Metrics;
use floodgate_server::rules::reload::{Rules, RulesSource};
use floodgate_server::service::Service;

/// The service the targets decide with.
pub type FuzzService = Service<MemoryStore<SystemClock>>;

/// A service on `files` (embedded rules), with per-key entries kept in a
/// directory of this process's own under the temp dir.
pub fn service(files: &'static [(&'static str, &'static str)]) -> Arc<FuzzService> {
    let dir = std::env::temp_dir().join(format!("floodgate-fuzz-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a temp dir");
    let overrides = Arc::new(PerKey::open(dir.join("overrides.redb")).expect("the per-key store opens"));
    let rules = Rules::load(RulesSource::Embedded(files), LoadOptions::default()).expect("the fuzz rules load");
    let limiter = Limiter::new(MemoryStore::new(), MemoryStore::new());
    Arc::new(Service::new(rules, Some(overrides), limiter, Arc::new(Metrics::new())))
}

/// A single-threaded runtime with time and I/O, as each of `serve`'s
/// decision threads runs.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime")
}
