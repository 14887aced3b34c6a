//! floodgate's core: the rate-limiting algorithms, validated [`Limit`]s, the
//! [`Decision`] they return, the [`Clock`], and the in-memory [`MemoryStore`].
//!
//! Everything here is synchronous; the only I/O is reading a rules directory
//! ([`rules::RuleSet::load_dir`]). The async [`Store`] trait
//! is implemented by this crate's memory store and by the Redis store in
//! `floodgate-redis`.
//!
//! ```
//! use floodgate_core::{Algorithm, Limit, ManualClock, MemoryStore};
//! use std::time::Duration;
//!
//! let clock = ManualClock::new(0);
//! let store = MemoryStore::builder().clock(&clock).build();
//! let limit = Limit::new(Algorithm::Gcra { burst: Some(2) }, 10, Duration::from_secs(1)).unwrap();
//! assert!(store.apply_sync("alice", &limit, 1).unwrap().allowed);
//! assert!(store.apply_sync("alice", &limit, 1).unwrap().allowed);
//! let denied = store.apply_sync("alice", &limit, 1).unwrap();
//! assert!(!denied.allowed);
//! // One token every 100 ms.
//! assert_eq!(denied.retry_after, Some(Duration::from_millis(100)));
//! ```

mod algorithm;
mod answer;
mod clock;
mod decision;
mod duration;
pub mod headers;
mod limit;
pub mod limiter;
mod math;
pub mod region;
pub mod reservation;
pub mod rules;
mod state;
pub mod store;
pub mod usage;

pub use answer::{Answer, Headline};
pub use clock::{Clock, ManualClock, SystemClock};
pub use decision::Decision;
pub use duration::{DurationError, HumanDuration, parse_duration};
pub use limit::{
    Algorithm, AlgorithmKind, Charge, LeakyMode, Limit, LimitError, MAX_CONCURRENCY, MAX_GRANULARITY, MAX_LIMIT,
    MAX_LOG_LIMIT, MAX_WINDOW, MIN_WINDOW,
};
pub use state::State;
pub use store::memory::{MemoryStore, MemoryStoreBuilder, OnFull};
pub use store::{Check, Op, Store, StoreError};
