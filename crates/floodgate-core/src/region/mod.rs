//! Many regions: one limit shared by regions that each decide locally and
//! share their usage asynchronously.
//!
//! A **region** is the instances that share one store (one instance with
//! the memory store, or every instance on one Redis); its **peers** are the
//! other regions. A `scope: global` limit's state is one **component** per
//! (counter key, slot, region, incarnation): a region writes only its own,
//! peers' arrive in batches and merge by maximum, so duplicated, reordered
//! or replayed messages change nothing. Decisions read the sum.
//!
//! Each region keeps every peer in step with one engine ([`link`]); what a
//! kind of region supplies is its storage: [`GlobalTable`] in memory, or a
//! Redis region (`floodgate_redis::RedisRegion`). A transport moves batches
//! between [`Region`]s.

mod entry;
pub mod goals;
mod incarnations;
mod lazy;
pub mod link;
mod scope;
pub mod sim;
mod table;
#[cfg(test)]
mod tests;
mod transport;
mod wire;

pub use entry::{fingerprint, shape_of};
pub use incarnations::{Incarnations, MAX_DEAD, new_incarnation};
pub use lazy::{Lazy, can_wait};
pub use link::{LinkStats, Links, MAX_PEERS, RegionConfig, RegionConfigError};
pub use scope::{BadOvershoot, MAX_OVERSHOOT_PPM, Scope, SyncMode, min_capacity, parse_overshoot, slice};
pub use table::{GlobalTable, TableStats, is_global};
pub use transport::{BatchHead, BatchSink, Items, Receipt, Region};
pub use wire::{Ack, Batch, Component, Incarnation, Item, Shape};
