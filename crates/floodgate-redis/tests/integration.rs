//! The Redis store's integration tests, one binary for all of them (one
//! link instead of four). Each starts its own `redis-server` (or cluster)
//! on free ports in a temporary directory.

mod conformance;
mod faults;
mod leases;
mod redis_region;
mod region;
mod reservations;
