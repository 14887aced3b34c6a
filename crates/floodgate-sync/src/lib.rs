//! floodgate's transport between regions.
//!
//! Every region runs a small gRPC service, `floodgate.sync.v1.Sync/Push`,
//! on its `--sync-addr`, and a link to every peer region that pushes, every
//! `--sync-interval`, batches of its usage of `scope: global` limits (one
//! component per key and slot, merged by maximum at the receiver) and takes
//! the acknowledgements back. The state model, batching, acknowledgement
//! and restart rules are [`floodgate_core::region`]'s; this crate moves the
//! bytes.
//!
//! Why gRPC between floodgate services: the service already speaks it and
//! an operator already runs and routes its port; it needs nothing new
//! (NATS, a shared Redis across oceans), works the same for memory-store
//! and Redis regions, and an acknowledgement is simply the call's answer.

mod link;
pub mod proto;
mod region;
mod server;
mod stats;

pub use link::{LinkConfig, Peer, PeerError, check_peers, run_links};
pub use region::{Outgoing, next_encoded};
pub use server::{PUSH, SERVICE, SyncServer};
pub use stats::{PeerCounters, SyncStats};
