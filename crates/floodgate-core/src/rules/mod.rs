//! Rules: the envoyproxy/ratelimit YAML format plus floodgate's extensions,
//! validated with positioned errors, and matched against descriptors.
//!
//! ```yaml
//! domain: api
//! descriptors:
//!   - key: remote_address            # one counter per client address
//!     rate_limit:
//!       unit: second
//!       requests_per_unit: 10
//!   - key: user
//!     rate_limits:                   # several limits on one key (floodgate)
//!       - { algorithm: gcra, window: 1s, requests_per_unit: 5, burst: 10 }
//!       - { unit: day, requests_per_unit: 10000 }
//! tiers:                             # plans for per-key entries (floodgate)
//!   free: { unit: minute, requests_per_unit: 60 }
//!   pro:
//!     - { unit: second, requests_per_unit: 50 }
//!     - { unit: day, requests_per_unit: 1000000 }
//! ```

pub mod cost;
mod error;
mod load;
mod matcher;
mod model;
mod parse;
mod plan;
pub(crate) mod yaml;

pub use error::{ConfigError, ConfigErrors};
pub use load::{RulesDirError, Sources, is_rules_file, rule_files};
pub use matcher::{Match, RequestMatch, carried_key, counter_key, limit_key};
pub use model::{
    Action, DEFAULT_LEASE_TTL, DEFAULT_RESERVATION_TTL, Domain, FailureMode, MAX_LEASE_TTL, MAX_RESERVATION_TTL,
    PSEUDO_HEADERS, RequestDescriptor, Rule, RuleSet, Source, Tier, Unit,
};
pub use parse::{BadTierName, LoadOptions, check_tier_name, parse_limits};
pub use plan::{Planned, checks_of};
pub use yaml::Pos;

#[cfg(test)]
mod tests;
