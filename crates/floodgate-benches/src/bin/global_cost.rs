//! Rough cost of one decision: the memory store against a region's global
//! table (with and without its peers draining batches), on the bench's
//! shape of traffic: keys drawn uniformly or Zipf(1), simulated time
//! advancing 20 µs a decision (50 000/s), the stores swept every 10 s as
//! `serve` sweeps them, batches to two peers every 100 ms. Not a benchmark
//! of record (see scripts/bench-regions); a quick look.
//!
//! ```text
//! cargo run --release -p floodgate-benches --bin global_cost -- [keys] [uniform|zipf] [key length]
//! ```
#![allow(clippy::print_stdout, missing_docs)]

use std::time::{Duration, Instant};

use floodgate_core::region::{Ack, Component, GlobalTable, RegionConfig, Shape, SyncMode};
use floodgate_core::{Algorithm, Limit, MemoryStore};

const START: u64 = 1_700_000_000_000_000;
const STEP_US: u64 = 20;

/// A xorshift generator: the same draws every run.
struct Rng(u64);

impl Rng {
    fn next_f64(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn draws(keys: usize, zipf: bool, n: usize) -> Vec<u32> {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    if !zipf {
        return (0..n).map(|_| (rng.next_f64() * keys as f64) as u32 % keys as u32).collect();
    }
    let mut cdf = Vec::with_capacity(keys);
    let mut sum = 0.0;
    for i in 1..=keys {
        sum += 1.0 / i as f64;
        cdf.push(sum);
    }
    (0..n)
        .map(|_| {
            let x = rng.next_f64() * sum;
            cdf.partition_point(|&c| c < x).min(keys - 1) as u32
        })
        .collect()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let nkeys: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(100_000);
    let zipf = args.get(2).is_some_and(|a| a == "zipf");
    let limit = Limit::new(Algorithm::FixedWindow, 1_000_000_000, Duration::from_secs(1)).unwrap();
    // The bench's keys are short (inline); a longer one (an API key) is on
    // the heap.
    let len: usize = args.get(3).and_then(|a| a.parse().ok()).unwrap_or(0);
    let keys: Vec<String> = (0..nkeys).map(|i| format!("{:x>len$}", format!("bench\x1fuser={i}#0"))).collect();
    let n = 3_000_000;
    let seq = draws(nkeys, zipf, n);
    let sweep_every = (10_000_000 / STEP_US) as usize;
    let batch_every = (100_000 / STEP_US) as usize;
    for round in 0..2 {
        let store = MemoryStore::new();
        let t = Instant::now();
        for (i, &k) in seq.iter().enumerate() {
            let now = START + i as u64 * STEP_US;
            store.apply_at(&keys[k as usize], &limit, 1, now).unwrap();
            if i % sweep_every == sweep_every - 1 {
                store.sweep();
            }
        }
        println!("round {round} memory store: {:.0} ns/decision", t.elapsed().as_nanos() as f64 / n as f64);
        for drain in [false, true] {
            let table = GlobalTable::new(RegionConfig::new("a", vec!["b".into(), "c".into()], 1)).unwrap();
            let mut decide = Duration::ZERO;
            let t = Instant::now();
            let mut sent = 0usize;
            for (start, chunk) in seq.chunks(batch_every).enumerate() {
                let d = Instant::now();
                for (j, &k) in chunk.iter().enumerate() {
                    let now = START + (start * batch_every + j) as u64 * STEP_US;
                    table.apply(&keys[k as usize], &limit, SyncMode::Eventual, 1, now).unwrap();
                }
                decide += d.elapsed();
                let i = (start + 1) * batch_every;
                let now = START + i as u64 * STEP_US;
                if drain {
                    for p in 0..2 {
                        let mut bytes = 0usize;
                        let mut sink = |k: &str, _fp: u64, _s: Shape, c: &[Component]| {
                            bytes += k.len() + 8 * c.len();
                        };
                        while let Some(b) = table.next_batch_into(p, now, &mut sink) {
                            let ack = Ack { region: String::new(), incarnation: 9, seq: b.seq, for_incarnation: 0 };
                            table.on_ack(p, &ack, now);
                            sent += b.items as usize;
                            if b.items == 0 {
                                break;
                            }
                        }
                        std::hint::black_box(bytes);
                    }
                }
                if i % sweep_every < batch_every {
                    table.sweep(now);
                }
            }
            println!(
                "round {round} global table (batches drained: {drain}): {:.0} ns/decision, of which deciding {:.0} ns; {:.2} keys sent per decision",
                t.elapsed().as_nanos() as f64 / n as f64,
                decide.as_nanos() as f64 / n as f64,
                sent as f64 / n as f64,
            );
        }
    }
}
