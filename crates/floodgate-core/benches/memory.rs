//! Memory per key: fill the store with 1 000 000 keys per algorithm and
//! report bytes per key, from the store's own accounting (slots with the
//! hash table's slack, key bytes, history) and from the process's resident
//! memory (everything, allocator overhead included).
//!
//! Run: `cargo bench -p floodgate-core --bench memory`

#![allow(missing_docs, clippy::print_stdout)]

use std::time::Duration;

use floodgate_core::{Algorithm, Limit, ManualClock, MemoryStore};

const KEYS: usize = 1_000_000;

fn rss_bytes() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: usize = statm.split_whitespace().nth(1).and_then(|p| p.parse().ok()).unwrap_or(0);
    pages * 4096
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // `cargo bench -- --list` probes bench binaries
    }
    let keys: Vec<String> = (0..KEYS).map(|i| format!("ip:10.{}.{}.{}", i >> 16, (i >> 8) & 255, i & 255)).collect();
    let key_bytes: usize = keys.iter().map(String::len).sum::<usize>() / KEYS;
    println!("{KEYS} keys, {key_bytes} bytes of key text each on average");
    println!("{:<20} {:>14} {:>14}", "algorithm", "store B/key", "RSS B/key");
    for algorithm in [
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
        Algorithm::Gcra { burst: None },
        Algorithm::TokenBucket { burst: None },
        Algorithm::SlidingBuckets { granularity: 10 },
        Algorithm::SlidingLog,
    ] {
        let before = rss_bytes();
        let clock = ManualClock::new(1_700_000_000_000_000);
        let store = MemoryStore::builder().clock(&clock).max_keys(2 * KEYS).build();
        let limit = Limit::new(algorithm, 100, Duration::from_secs(60)).unwrap();
        for k in &keys {
            store.apply_sync(k, &limit, 1).unwrap();
        }
        let rss = rss_bytes().saturating_sub(before) / KEYS;
        println!("{:<20} {:>14} {:>14}", algorithm.kind().as_str(), store.memory_bytes() / KEYS, rss);
        drop(store);
    }
}
