//! The tower layer's integration tests, one binary for both: in an axum
//! application and in a tonic server.

mod leases;
mod metering;
mod with_axum;
mod with_tonic;
