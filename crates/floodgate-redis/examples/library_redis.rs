//! floodgate as a library over Redis: the in-memory example
//! (`floodgate-core`'s `library`) with its counters in Redis, so every
//! process using the same Redis shares the limits. Run it twice at once
//! and the two share alice's 3 a second.
//!
//! ```sh
//! redis-server --port 6379 &
//! cargo run -p floodgate-redis --example library_redis  # redis://127.0.0.1:6379
//! FLOODGATE_REDIS=redis://10.0.0.5:6379 cargo run -p floodgate-redis --example library_redis
//! ```
//!
//! When Redis fails or is slow (over `RedisConfig::timeout`, 100 ms by
//! default), each rule's `failure_mode` decides: `open` (the default)
//! allows, `closed` denies, `local` counts in the second, in-memory store.

#![allow(clippy::print_stdout)]

use floodgate_core::limiter::Limiter;
use floodgate_core::rules::{RuleSet, checks_of};
use floodgate_core::{MemoryStore, Op};
use floodgate_redis::{RedisConfig, RedisStore};

const RULES: &str = "
domain: api
descriptors:
  # 3 requests a second per user, counted in Redis; a local share of it
  # while Redis is down.
  - key: user
    rate_limit: {unit: second, requests_per_unit: 3, failure_mode: local}
";

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), String> {
    let url = std::env::var("FLOODGATE_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let rules = RuleSet::from_yaml("rules.yaml", RULES).map_err(|e| e.to_string())?;
    // Connects lazily: the first decision opens the connection.
    let target = url.parse().map_err(|e| format!("FLOODGATE_REDIS: {e}"))?;
    let store = RedisStore::new(RedisConfig::new(target)).map_err(|e| e.to_string())?;
    let limiter = Limiter::new(store, MemoryStore::new());
    // The same request each time: planned once (its counter keys and rules).
    let alice: &[(&str, &str)] = &[("user", "alice")];
    let planned = rules.plan("api", [alice].into_iter(), |_| None);
    let checks = checks_of(&planned, |_| (1, Op::Take));
    for i in 1..=4 {
        let outcome = limiter.check(&checks).await;
        let verdict = &outcome.verdicts[0];
        let failed = verdict.failure.as_ref().map(|(e, mode)| format!(" (Redis failed: {e}; {mode:?} decided)"));
        println!(
            "request {i} of alice: {}, {} left{}",
            if outcome.allowed { "allowed" } else { "denied" },
            verdict.decision.map_or(0, |d| d.remaining),
            failed.unwrap_or_default()
        );
    }
    Ok(())
}
