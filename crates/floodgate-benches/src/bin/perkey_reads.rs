//! What one per-key lookup costs on the deciding thread, against a
//! database of `scripts/bench-perkey`'s entries (`bench`, `user=<i>`):
//!
//! * a miss: every lookup reads the store (a cache of one answer), first
//!   the database (the hash index removed), then the index once rebuilt;
//! * a shared-cache hit: keys spread over more than a thread's front holds;
//! * a front hit: the same few keys again and again;
//! * the bench's load: Zipf(1.0) over every user through a cache of
//!   1 000 000 answers, as `scripts/bench-perkey` runs it, after a warm-up
//!   of 20 million lookups (the cost a lookup, and the hit rate).
//!
//! ```text
//! cargo run --release -p floodgate-benches --bin perkey_reads -- PATH/keys.redb [users, default 10000000] [zipf]
//! ```
//!
//! With `zipf`, only the last (the bench's load, 5 rounds).
//!
//! The database must not be open in a server meanwhile (redb takes a lock).

#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::time::Instant;

use floodgate_perkey::{CacheOptions, PerKey};

/// A xorshift step: the keys' order, reproducible.
fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

fn run(what: &str, keys: &PerKey, users: u64, rounds: usize) {
    run_n(what, keys, users, rounds, 200_000);
}

fn run_n(what: &str, keys: &PerKey, users: u64, rounds: usize, n: usize) {
    let mut x = 0x2545_f491_4f6c_dd1d;
    let names: Vec<String> = (0..n).map(|_| (next(&mut x) % users).to_string()).collect();
    let mut found = 0usize;
    for round in 0..rounds {
        let t = Instant::now();
        for n in &names {
            found += usize::from(keys.get("bench", &[("user", n.as_str())]).is_some());
        }
        let ns = t.elapsed().as_nanos() as f64 / names.len() as f64;
        println!("{what}, round {round}: {ns:.0} ns a lookup");
    }
    assert!(found > 0, "no entry found: is this a database of bench-perkey's entries?");
}

/// The bench's load: Zipf(1.0) over `users` (users by rank, as `floodgate
/// bench` draws them), through a cache of a million answers.
fn zipf(path: &str, users: u64) {
    let mut cdf = Vec::with_capacity(users as usize);
    let mut sum = 0.0;
    for k in 1..=users {
        sum += 1.0 / k as f64;
        cdf.push(sum);
    }
    let mut x = 0x2545_f491_4f6c_dd1d;
    let mut draw = |n: usize| -> Vec<String> {
        (0..n)
            .map(|_| {
                let u = (next(&mut x) >> 11) as f64 / (1u64 << 53) as f64 * sum;
                cdf.partition_point(|&c| c < u).to_string()
            })
            .collect()
    };
    let keys = PerKey::open_with(path, CacheOptions { entries: 1_000_000, ttl: None }).expect("open");
    let t = Instant::now();
    while !keys.index_status().ready {
        assert!(t.elapsed().as_secs() < 600, "no index after 10 minutes");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    for _ in 0..10 {
        for n in &draw(2_000_000) {
            let _ = keys.get("bench", &[("user", n.as_str())]);
        }
    }
    let stats = keys.stats();
    for round in 0..5 {
        let names = draw(2_000_000);
        let (h0, m0) = (stats.hits.get(), stats.misses.get());
        let t = Instant::now();
        for n in &names {
            let _ = keys.get("bench", &[("user", n.as_str())]);
        }
        let ns = t.elapsed().as_nanos() as f64 / names.len() as f64;
        let (h, m) = (stats.hits.get() - h0, stats.misses.get() - m0);
        println!("zipf, round {round}: {ns:.0} ns a lookup, hit rate {:.3}", h as f64 / (h + m).max(1) as f64);
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let Some(path) = args.next() else {
        eprintln!("usage: perkey_reads PATH/keys.redb [users]");
        std::process::exit(64);
    };
    let users: u64 = args.next().map_or(10_000_000, |u| u.parse().expect("users: a number"));
    if args.next().as_deref() == Some("zipf") {
        zipf(&path, users);
        return;
    }
    // Without the index: its builder waits 2 s after the open, longer than
    // these rounds.
    let _ = std::fs::remove_file(format!("{path}.index"));
    let misses = PerKey::open_with(&path, CacheOptions { entries: 1, ttl: None }).expect("open");
    run_n("every lookup a miss, read from the database", &misses, users, 3, 50_000);
    let t = Instant::now();
    while !misses.index_status().ready {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    println!("index built in {:.1} s", t.elapsed().as_secs_f64());
    run("every lookup a miss, read from the hash index", &misses, users, 3);
    drop(misses);
    let hits = PerKey::open_with(&path, CacheOptions { entries: 1_000_000, ttl: None }).expect("open");
    run("shared-cache hits (200 000 keys, the first round reads them)", &hits, users, 3);
    run("front hits (1 000 keys)", &hits, 1_000, 3);
}
