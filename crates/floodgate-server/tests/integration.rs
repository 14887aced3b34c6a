//! The server's integration tests, one binary for all of them: the
//! service over gRPC and HTTP, rules reloads, and per-key entries through
//! the service.

mod budgets;
mod leases;
mod perkey;
mod reload;
mod reservations;
mod server;
