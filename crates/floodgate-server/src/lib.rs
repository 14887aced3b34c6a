//! floodgate's service parts. For now: rules that reload themselves when
//! their files change ([`reload`]).

pub mod reload;
