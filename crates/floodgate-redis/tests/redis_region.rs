//! A Redis region's instance (`RedisRegion`) between two memory regions,
//! batches moved by hand (no network, no waiting on timers): what a Redis
//! region's instance or Redis takes with it when it dies reaches every
//! region, the bounded cap charges what may have been lost, and a bounded
//! key's slice is free again once its usage is acknowledged.

use std::time::Duration;

use floodgate_core::region::{GlobalTable, Region, RegionConfig, Scope, SyncMode};
use floodgate_core::{Algorithm, Check, Clock, Limit, Op, SystemClock};
use floodgate_redis::{RedisConfig, RedisRegion};
use floodgate_testing::RedisServer;

const A: usize = 0;
const B: usize = 1;
const C: usize = 2;
const NAMES: [&str; 3] = ["a", "b", "c"];

/// Regions a and c in memory, b on Redis.
struct World {
    a: GlobalTable,
    b: RedisRegion,
    c: GlobalTable,
    redis: RedisServer,
    rt: tokio::runtime::Runtime,
    clock: SystemClock,
    rules: Vec<(Limit, SyncMode)>,
}

fn peers(i: usize) -> Vec<String> {
    NAMES.iter().enumerate().filter(|&(j, _)| j != i).map(|(_, n)| (*n).to_owned()).collect()
}

fn cfg(i: usize, incarnation: u64) -> RegionConfig {
    let mut cfg = RegionConfig::new(NAMES[i], peers(i), incarnation);
    cfg.interval_us = 1;
    cfg.lazy_us = 0;
    cfg.warmup_us = 0;
    cfg
}

fn redis_region(redis: &RedisServer) -> RedisRegion {
    let mut c = RedisConfig::new(redis.url().parse().unwrap());
    c.timeout = Duration::from_secs(2);
    c.cache_denials = false;
    let cfg = cfg(B, 0);
    let mut cfg = cfg;
    cfg.batch_items = floodgate_redis::region::BATCH_ITEMS;
    RedisRegion::new(&cfg, c).unwrap()
}

impl World {
    fn new(rules: &[(Limit, SyncMode)]) -> World {
        let clock = SystemClock::new();
        let redis = RedisServer::start();
        let b = redis_region(&redis);
        b.set_rules(rules.iter().cloned());
        let now = clock.now_us();
        let w = World {
            a: GlobalTable::new(cfg(A, floodgate_core::region::new_incarnation(now, 1))).unwrap(),
            b,
            c: GlobalTable::new(cfg(C, floodgate_core::region::new_incarnation(now, 3))).unwrap(),
            redis,
            rt: tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap(),
            clock,
            rules: rules.to_vec(),
        };
        w.sync(&[]);
        assert!(!w.a.warming() && !w.c.warming() && !w.b.warming(), "every region has every peer's full state");
        w
    }

    fn now(&self) -> u64 {
        self.clock.now_us()
    }

    /// Everything `from` has for `to`, delivered and acknowledged.
    fn push(&self, from: usize, to: usize) {
        let p = peers(from).iter().position(|n| n == NAMES[to]).unwrap();
        for _ in 0..64 {
            let now = self.now();
            let batch = match from {
                A => self.a.next_batch(p, now),
                C => self.c.next_batch(p, now),
                _ => {
                    let mut items = floodgate_core::region::Items::default();
                    let head = self.rt.block_on(self.b.next_batch_into(p, now, &mut items));
                    head.map(|head| head.with_items(items.0))
                }
            };
            let Some(batch) = batch else { return };
            let idle = batch.items.is_empty() && !batch.complete;
            let now = self.now();
            let ack = match to {
                A => self.a.receive(&batch, now).ack,
                C => self.c.receive(&batch, now).ack,
                _ => self.rt.block_on(self.b.receive(batch, now)).unwrap().ack,
            };
            let now = self.now();
            match from {
                A => self.a.on_ack(p, &ack, now),
                C => self.c.on_ack(p, &ack, now),
                _ => self.rt.block_on(self.b.on_ack(p, &ack, now)),
            }
            if idle {
                return;
            }
        }
    }

    /// Three rounds of every link but those `cut` (either way).
    fn sync(&self, cut: &[(usize, usize)]) {
        for _ in 0..3 {
            for from in 0..3 {
                for to in 0..3 {
                    if from != to && !cut.contains(&(from, to)) && !cut.contains(&(to, from)) {
                        self.push(from, to);
                    }
                }
            }
            // A Redis region's instance reads its region's state back at
            // most once a sync interval.
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Decide `hits` of `key` in region `i`; whether admitted.
    fn decide(&self, i: usize, key: &str, limit: &Limit, mode: SyncMode, hits: u64) -> bool {
        let now = self.now();
        match i {
            A => self.a.apply(key, limit, mode, hits, now).unwrap().allowed,
            C => self.c.apply(key, limit, mode, hits, now).unwrap().allowed,
            _ => {
                let check = Check { key, limit, hits, op: Op::Take, enforce: true, scope: Scope::Global(mode) };
                let mut out = Vec::new();
                self.rt.block_on(floodgate_core::Store::apply_all(self.b.store(), &[check], &mut out));
                let d = out.pop().unwrap().unwrap();
                if d.allowed && hits > 0 {
                    self.b.touched(key, limit, mode, hits, d.remaining);
                }
                d.allowed
            }
        }
    }

    fn admitted(&self, i: usize, key: &str, limit: &Limit, mode: SyncMode, n: u64) -> u64 {
        (0..n).filter(|_| self.decide(i, key, limit, mode, 1)).count() as u64
    }

    fn remaining(&self, i: usize, key: &str, limit: &Limit, mode: SyncMode) -> u64 {
        let now = self.now();
        match i {
            A => self.a.apply(key, limit, mode, 0, now).unwrap().remaining,
            C => self.c.apply(key, limit, mode, 0, now).unwrap().remaining,
            _ => {
                let check = Check { key, limit, hits: 0, op: Op::Take, enforce: true, scope: Scope::Global(mode) };
                let mut out = Vec::new();
                self.rt.block_on(floodgate_core::Store::apply_all(self.b.store(), &[check], &mut out));
                out.pop().unwrap().unwrap().remaining
            }
        }
    }

    /// b's instance dies (its queues with it) and a new one starts; with
    /// `flush`, its Redis restarts empty too.
    fn restart_b(&mut self, flush: bool) {
        if flush {
            self.redis.cli(&["FLUSHALL"]);
        }
        let rules = self.rules.clone();
        self.b = redis_region(&self.redis);
        self.b.set_rules(rules);
    }
}

fn bounded() -> SyncMode {
    SyncMode::Bounded { overshoot_ppm: 50_000 }
}

fn minute(n: u64) -> Limit {
    Limit::new(Algorithm::FixedWindow, n, Duration::from_secs(60)).unwrap()
}

/// Every region's remaining count of `key`.
fn everywhere(w: &World, key: &str, limit: &Limit, mode: SyncMode) -> [u64; 3] {
    [A, B, C].map(|i| w.remaining(i, key, limit, mode))
}

/// Defect: an instance killed within a sync interval of a key's first hits
/// took them with it (the full state listed only keys read once), and a
/// bounded key's slice stayed full for good.
#[test]
fn regression_an_instance_that_dies_before_its_first_batch_loses_nothing() {
    let (t, u) = (minute(120), minute(600));
    let mut w = World::new(&[(t.clone(), bounded()), (u.clone(), SyncMode::Eventual)]);
    assert_eq!(w.admitted(B, "t", &t, bounded(), 5), 2, "the slice: 2");
    assert_eq!(w.admitted(B, "u", &u, SyncMode::Eventual, 5), 5);
    w.restart_b(false);
    assert_eq!(w.admitted(B, "t", &t, bounded(), 1), 0, "the slice is still b's own hits, unacknowledged");
    w.sync(&[]);
    assert_eq!(everywhere(&w, "t", &t, bounded()), [118; 3]);
    assert_eq!(everywhere(&w, "u", &u, SyncMode::Eventual), [595; 3]);
    assert_eq!(w.admitted(B, "t", &t, bounded(), 5), 2, "acknowledged: the slice is free again");
}

/// Defect: a region that died while cut off from another (here b's Redis
/// restarted empty with its instance) never got its last hits to it.
#[test]
fn regression_a_redis_region_lost_during_a_partition_converges() {
    let u = minute(600);
    let e = SyncMode::Eventual;
    let mut w = World::new(&[(u.clone(), e)]);
    for i in [A, B, C] {
        assert_eq!(w.admitted(i, "u", &u, e, 10), 10);
    }
    w.sync(&[(B, C)]);
    assert_eq!(w.remaining(C, "u", &u, e), 580, "c never heard from b");
    w.restart_b(true);
    w.sync(&[]);
    assert_eq!(everywhere(&w, "u", &u, e), [570; 3], "b's old hits came back to b and went on to c");
}

/// Defect: a Redis region whose Redis restarts empty with its instance,
/// right after taking its slice, took the slice with it, and repeated
/// crashes broke the bounded cap. Each dead incarnation now costs its slice
/// everywhere, b's new incarnations included.
#[test]
fn regression_a_redis_regions_crashes_are_charged_everywhere() {
    let t = minute(120);
    let mut w = World::new(&[(t.clone(), bounded())]);
    for round in 1..=3u64 {
        assert_eq!(w.admitted(B, "t", &t, bounded(), 5), 2, "round {round}");
        w.restart_b(true);
        w.sync(&[]);
        assert_eq!(everywhere(&w, "t", &t, bounded()), [120 - 2 * round; 3], "round {round}");
    }
}
