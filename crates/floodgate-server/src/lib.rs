//! floodgate's service parts. For now: rules that reload themselves when
//! their files change ([`reload`]) and runtime overrides persisted on disk
//! ([`overrides`]), and [`resolve`], which combines them: an override of a
//! descriptor takes precedence over the files.

pub mod overrides;
pub mod reload;
pub mod resolve;
