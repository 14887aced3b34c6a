//! An axum app rate-limited in-process by floodgate's tower layer, with the
//! same YAML rules the service reads.
//!
//! ```sh
//! cargo run -p floodgate-tower --example axum_app
//! curl -i localhost:3000/            # 5 a second per client, then 429
//! curl -i -H 'x-api-key: k1' localhost:3000/search   # plus 2 a second per key
//! ```
//!
//! `FLOODGATE_REDIS=redis://127.0.0.1:6379` counts in Redis instead, so
//! several copies of the app share the limits.

use std::net::SocketAddr;

use axum::Router;
use axum::routing::get;
use floodgate_core::MemoryStore;
use floodgate_core::rules::RuleSet;
use floodgate_redis::{RedisConfig, RedisStore};
use floodgate_tower::{RateLimitLayer, RulesDecider, TrustedProxies};

const RULES: &str = r#"
domain: app
request_descriptors:
  - actions: [{remote_address: {}}]
  - actions:
      - request_headers: {header_name: x-api-key, descriptor_key: api_key}
      - request_headers: {header_name: ":path", descriptor_key: path}
descriptors:
  - key: remote_address
    rate_limit: {algorithm: gcra, window: 1s, requests_per_unit: 5, burst: 10, name: per_client}
  - key: api_key
    descriptors:
      - key: path
        value: /search
        rate_limit: {algorithm: sliding_window, window: 1s, requests_per_unit: 2, name: search}
"#;

fn app<S: floodgate_core::Store + 'static>(rules: RuleSet, store: S) -> Router {
    // Behind a load balancer on the private network, believe its
    // X-Forwarded-For; a client's own header is never enough.
    let trusted = TrustedProxies::parse_list("10.0.0.0/8").expect("valid CIDRs");
    // `inner_body`: responses keep axum's own body type (no wrapper for
    // axum to box).
    let layer = RateLimitLayer::new(RulesDecider::new(rules, "app", store)).trusted_proxies(trusted).inner_body();
    Router::new().route("/", get(|| async { "hello\n" })).route("/search", get(|| async { "results\n" })).layer(layer)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let rules = RuleSet::from_yaml("app.yaml", RULES)?;
    let router = match std::env::var("FLOODGATE_REDIS") {
        Ok(url) => app(rules, RedisStore::new(RedisConfig::new(url.parse()?))?),
        Err(_) => app(rules, MemoryStore::new()),
    };
    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    eprintln!("listening on http://{}", listener.local_addr()?);
    // The layer needs each request's peer address.
    axum::serve(listener, router.into_make_service_with_connect_info::<SocketAddr>()).await?;
    Ok(())
}
