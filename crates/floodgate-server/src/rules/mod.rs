//! Where limits come from: the hot-reloaded rules files (or the bundled
//! ones compiled in). Per-key limits for exact descriptors are the
//! `floodgate-perkey` crate's.

mod bundled;
pub mod reload;

pub use bundled::BUNDLED_RULES;
