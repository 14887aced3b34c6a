//! Rough cost of one decision: the memory store against a region's global
//! table (with and without its peers draining batches). Not a benchmark of
//! record (see scripts/bench-regions); a quick look.
#![allow(clippy::print_stdout, missing_docs)]

use std::time::{Duration, Instant};

use floodgate_core::region::{GlobalTable, RegionConfig, SyncMode};
use floodgate_core::{Algorithm, Limit, MemoryStore};

fn main() {
    let limit = Limit::new(Algorithm::FixedWindow, 1_000_000_000, Duration::from_secs(1)).unwrap();
    let keys: Vec<String> = (0..100_000).map(|i| format!("bench\x1fuser={i}#0")).collect();
    let n = 2_000_000;
    let store = MemoryStore::new();
    let t = Instant::now();
    for i in 0..n {
        store.apply_at(&keys[i % keys.len()], &limit, 1, 1_700_000_000_000_000 + i as u64).unwrap();
    }
    println!("memory store: {:.0} ns/decision", t.elapsed().as_nanos() as f64 / n as f64);
    for drain in [false, true] {
        let table = GlobalTable::new(RegionConfig::new("a", vec!["b".into(), "c".into()], 1)).unwrap();
        let t = Instant::now();
        for i in 0..n {
            let now = 1_700_000_000_000_000 + i as u64 * 10;
            table.apply(&keys[i % keys.len()], &limit, SyncMode::Eventual, 1, now).unwrap();
            if drain && i % 10_000 == 0 {
                for p in 0..2 {
                    let mut bytes = 0usize;
                    let mut sink = |k: &str,
                                    _fp: u64,
                                    _s: floodgate_core::region::Shape,
                                    c: &[floodgate_core::region::Component]| {
                        bytes += k.len() + 8 * c.len();
                    };
                    while let Some(b) = table.next_batch_into(p, now, &mut sink) {
                        let ack = floodgate_core::region::Ack { region: String::new(), incarnation: 9, seq: b.seq };
                        table.on_ack(p, &ack, now);
                        if b.items == 0 {
                            break;
                        }
                    }
                    std::hint::black_box(bytes);
                }
            }
        }
        println!(
            "global table (batches drained: {drain}): {:.0} ns/decision",
            t.elapsed().as_nanos() as f64 / n as f64
        );
    }
}
