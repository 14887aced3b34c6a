//! What a Redis region's `scope: global` check costs Redis, against the
//! same check regional: a redis-server of its own, 64 concurrent callers
//! (so the store batches as `serve` does), keys drawn uniformly, and the
//! server's own CPU (`INFO cpu`) and script time (`INFO commandstats`) per
//! decision. Not a benchmark of record (scripts/bench-regions is); a quick
//! look at the scripts alone.
//!
//! ```text
//! cargo run --release -p floodgate-benches --bin region_cost -- [keys] [decisions]
//! ```
#![allow(clippy::print_stdout, missing_docs)]

use std::sync::Arc;
use std::time::Duration;

use floodgate_core::region::{Scope, SyncMode};
use floodgate_core::{Algorithm, Check, Limit, Op, Store};
use floodgate_redis::{RedisConfig, RedisStore, RegionCtx};
use floodgate_testing::RedisServer;

fn info(server: &RedisServer) -> (f64, u64, u64) {
    let cpu = server.cli(&["info", "cpu"]);
    let field =
        |name: &str| -> f64 { cpu.lines().find_map(|l| l.strip_prefix(name)?.trim().parse().ok()).unwrap_or(0.0) };
    let cmds = server.cli(&["info", "commandstats"]);
    let (mut calls, mut usec) = (0, 0);
    for l in cmds.lines().filter(|l| l.starts_with("cmdstat_evalsha:")) {
        for part in l.split([':', ',']) {
            if let Some(v) = part.strip_prefix("calls=") {
                calls = v.parse().unwrap_or(0);
            }
            if let Some(v) = part.strip_prefix("usec=") {
                usec = v.parse().unwrap_or(0);
            }
        }
    }
    (field("used_cpu_user:") + field("used_cpu_sys:"), calls, usec)
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let keys: u64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(10_000);
    let n: u64 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(300_000);
    let server = RedisServer::start();
    let limit = Arc::new(Limit::new(Algorithm::FixedWindow, 1_000_000_000, Duration::from_secs(1)).unwrap());
    for round in 0..2 {
        for global in [false, true] {
            let mut c = RedisConfig::new(server.url().parse().unwrap());
            c.key_prefix = format!("r{}:", u8::from(global)); // round 1: every key known
            let store = Arc::new(if global {
                RedisStore::regional(c, RegionCtx::new(3, 200_000)).unwrap()
            } else {
                RedisStore::new(c).unwrap()
            });
            let scope = if global { Scope::Global(SyncMode::Eventual) } else { Scope::Region };
            let (cpu0, calls0, usec0) = info(&server);
            let t = std::time::Instant::now();
            let mut tasks = Vec::new();
            for w in 0..64u64 {
                let (store, limit) = (store.clone(), limit.clone());
                tasks.push(tokio::spawn(async move {
                    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ w;
                    let mut out = Vec::new();
                    for _ in 0..n / 64 {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let key = format!("5:bench4:user{}:{}", (x % keys).to_string().len(), x % keys);
                        let check = [Check { key: &key, limit: &limit, hits: 1, op: Op::Take, enforce: true, scope }];
                        store.apply_all(&check, &mut out).await;
                    }
                }));
            }
            for t in tasks {
                t.await.unwrap();
            }
            let secs = t.elapsed().as_secs_f64();
            let (cpu1, calls1, usec1) = info(&server);
            let d = (n / 64 * 64) as f64;
            println!(
                "round {round} {:8}: {:7.0}/s, redis CPU {:5.2} us/decision, scripts {:5.2} us/decision ({:.1} decisions a call)",
                if global { "global" } else { "regional" },
                d / secs,
                (cpu1 - cpu0) * 1e6 / d,
                (usec1 - usec0) as f64 / d,
                d / (calls1 - calls0).max(1) as f64,
            );
        }
    }
}
