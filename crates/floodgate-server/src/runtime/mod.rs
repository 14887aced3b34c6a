//! What the service runs on: the store chosen at start ([`store`]),
//! metrics and the dashboard's data ([`dashboard`], [`topkeys`]), the
//! instance's own files ([`state`]), bounded listeners ([`listen`]) and
//! per-thread runtimes.

pub mod dashboard;
pub mod listen;
pub mod metrics;
pub mod overload;
pub mod regions;
pub mod state;
pub mod store;
pub(crate) mod threads;
pub mod topkeys;
