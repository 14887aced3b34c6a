//! floodgate's service parts. For now: rules that reload themselves when
//! their files change ([`reload`]) and runtime overrides persisted on disk
//! ([`overrides`]).

pub mod overrides;
pub mod reload;
