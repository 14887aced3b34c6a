//! floodgate as a library, in memory: the service's YAML rules, matched
//! against a request's descriptors and decided all or nothing by a
//! [`Limiter`] over the in-memory store. No server, no Redis.
//!
//! ```sh
//! cargo run -p floodgate-core --example library
//! ```
//!
//! The same code over Redis (limits shared by every process that uses
//! it): `cargo run -p floodgate-redis --example library_redis`.

#![allow(clippy::print_stdout, clippy::print_stderr)]

use floodgate_core::limiter::Limiter;
use floodgate_core::rules::{RuleSet, checks_of};
use floodgate_core::{MemoryStore, Op};

const RULES: &str = "
domain: api
descriptors:
  # 3 requests a second per user...
  - key: user
    rate_limit: {unit: second, requests_per_unit: 3}
    descriptors:
      # ...and 2 a second per user on one path.
      - key: path
        rate_limit: {unit: second, requests_per_unit: 2}
";

/// Decide one request with `descriptors` (each a list of entries) in
/// domain `api`: every rule it matches, all or nothing.
async fn decide(rules: &RuleSet, limiter: &Limiter<MemoryStore>, descriptors: &[&[(&str, &str)]]) -> bool {
    // Every limit that applies, with its counter key (`|_| None`: no
    // descriptor brings limits of its own), each taking one hit.
    let planned = rules.plan("api", descriptors.iter().copied(), |_| None);
    let checks = checks_of(&planned, |_| (1, Op::Take));
    let outcome = limiter.check(&checks).await;
    for (check, verdict) in checks.iter().zip(&outcome.verdicts) {
        if let Some(d) = verdict.decision {
            println!("  {:<28} allowed {:<5} remaining {}", check.key, d.allowed, d.remaining);
        }
    }
    outcome.allowed
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    if let Err(e) = run().await {
        eprintln!("{e}");
        std::process::exit(1);
    }
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    // Errors name file:line:col, as `floodgate validate` prints them.
    let rules = RuleSet::from_yaml("rules.yaml", RULES)?;
    // The second store serves rules with `failure_mode: local` when the
    // first fails; in memory, it never does.
    let limiter = Limiter::new(MemoryStore::new(), MemoryStore::new());
    for i in 1..=4 {
        let user: &[(&str, &str)] = &[("user", "alice")];
        let on_path: &[(&str, &str)] = &[("user", "alice"), ("path", "/search")];
        println!("request {i} of alice to /search:");
        let allowed = decide(&rules, &limiter, &[user, on_path]).await;
        println!("  -> {}", if allowed { "allowed" } else { "denied (429)" });
    }
    Ok(())
}
