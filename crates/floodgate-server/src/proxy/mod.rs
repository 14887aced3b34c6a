//! The reverse proxy (`floodgate proxy`): requests decided by the service
//! through the tower layer, then forwarded to one upstream over a pool of
//! keep-alive connections.

mod forward;
mod upstream;

pub use forward::*;
