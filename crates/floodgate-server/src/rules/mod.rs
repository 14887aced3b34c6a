//! Where limits come from: the hot-reloaded rules files (or the bundled
//! ones compiled in), and the runtime overrides for exact descriptors.

mod bundled;
pub mod overrides;
pub mod reload;

pub use bundled::BUNDLED_RULES;
