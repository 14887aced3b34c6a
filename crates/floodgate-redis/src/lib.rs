//! floodgate's Redis and Redis Cluster store.
//!
//! Every algorithm runs inside Redis as Lua (`scripts/`, one file per
//! algorithm with its contract at the top, composed into one script), with
//! the same integer arithmetic as the in-memory store, so both give the same
//! answers: one round trip and one atomic check-and-update per decision.
//!
//! ```no_run
//! use floodgate_redis::{RedisConfig, RedisStore};
//! let store = RedisStore::new(RedisConfig::new("redis://127.0.0.1:6379".parse()?))?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod breaker;
mod conn;
mod denied;
mod global;
mod pubsub;
pub mod region;
pub mod script;
mod shared;
mod store;
mod target;

pub use global::RegionCtx;
pub use pubsub::{PING_EVERY, Subscription};
pub use region::{MergeStats, RedisRegion};
pub use shared::SharedMap;
pub use store::{ClockSource, RedisConfig, RedisStats, RedisStore, Script, Via, join_all};
pub use target::{Target, TargetError};

/// The guide's chapter on the stores (`docs/stores.md`): its Rust examples
/// run as this crate's doctests, so they cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/stores.md")]
pub struct StoresChapter;
