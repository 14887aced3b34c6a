//! Where limits come from: the hot-reloaded rules files (or the bundled
//! ones compiled in), and per-key limits for exact descriptors (millions of
//! them, on disk, each naming a tier of the rules or giving its own).

mod bundled;
pub mod reload;

pub use bundled::BUNDLED_RULES;
