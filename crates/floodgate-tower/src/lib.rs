//! floodgate at the edge of an HTTP service: a `tower` [`RateLimitLayer`]
//! (axum, tonic, hyper), the client-IP logic it shares with `floodgate
//! proxy` ([`TrustedProxies`]), descriptors built from requests by the rules'
//! `request_descriptors`, and client-side throttling ([`Throttle`]).
//!
//! Every store works: the in-memory `MemoryStore`, or the Redis store of
//! `floodgate-redis` to share counters between processes.
//!
//! ```
//! use floodgate_core::{MemoryStore, rules::RuleSet};
//! use floodgate_tower::{RateLimitLayer, RulesDecider};
//! let rules = RuleSet::from_yaml("api.yaml", "
//! domain: api
//! request_descriptors:
//!   - actions: [{remote_address: {}}]
//!   - actions: [{request_headers: {header_name: x-api-key, descriptor_key: api_key}}]
//! descriptors:
//!   - key: remote_address
//!     rate_limit: {unit: second, requests_per_unit: 20}
//!   - key: api_key
//!     rate_limits:
//!       - {algorithm: gcra, window: 1s, requests_per_unit: 5, burst: 10}
//!       - {unit: day, requests_per_unit: 10000}
//! ").unwrap();
//! let layer = RateLimitLayer::new(RulesDecider::new(rules, "api", MemoryStore::new()));
//! ```

mod client_ip;
mod decide;
mod descriptors;
mod layer;
mod throttle;
pub mod usage;

pub use client_ip::{Cidr, CidrError, ForwardedHeader, TrustedProxies, UnknownForwardedHeader};
pub use decide::{Answer, Decide, DecideError, Headline, Key, KeyFn, KeyedLimit, RulesDecider, ip_str};
pub use descriptors::{
    DescriptorError, Entries, RequestFacts, build as build_descriptors, default_descriptors,
    templates as descriptor_templates,
};
pub use floodgate_core::headers::HeaderMode;
pub use floodgate_core::limiter::Held;
pub use layer::{
    AnswerHeaders, BodyMode, DEFAULT_MAX_HELD, InnerBody, MAX_READ, Meter, MeterFuture, MeterLayer, MeterPart, Metered,
    MeteredBody, PeerAddr, RateLimit, RateLimitBody, RateLimitLayer, RequestBody, Reserved, ResponseFuture, Wrapped,
    estimate, grpc_rejection, grpc_response, insert_answer_headers, local_response, rejection,
};
pub use throttle::{Throttle, ThrottleError};

/// The guide's chapter on the proxy and the tower layer
/// (`docs/proxy-and-tower.md`): its Rust examples run as this crate's
/// doctests, so they cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/proxy-and-tower.md")]
pub struct ProxyAndTowerChapter;

/// The README's tour (its tower-layer example runs as this crate's doctest).
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeTour;
