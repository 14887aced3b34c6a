//! A deterministic WAN simulation of regions sharing `scope: global`
//! limits: the real [`GlobalTable`] decisions, batches, merges and
//! acknowledgements, over a simulated network (latency per pair, jitter,
//! loss, duplication, reordering, partitions) on a simulated clock, driven
//! by a seeded random source. The same seed gives the same report, and
//! nothing sleeps.
//!
//! Each run is compared with **the exact global answer**: the same
//! algorithm on one zero-latency store that sees every request at once.
//!
//! (About 900 lines: one event loop, the simulated network it drives and
//! the report it makes, which read best together.)

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::region::{Ack, Batch, GlobalTable, RegionConfig, SyncMode, slice};
use crate::{Algorithm, Limit, State};

/// The simulated epoch: a multiple of an hour, so windows align as they
/// would on a real clock.
pub const T0: u64 = 1_700_002_800_000_000;

/// A seeded random source (SplitMix64): small, fast, reproducible.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A source for `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x5DEE_CE66_D1A4_F87B)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n.max(1))) >> 64) as u64
    }

    /// True with probability `ppm` / 1 000 000.
    pub fn chance(&mut self, ppm: u32) -> bool {
        self.below(1_000_000) < u64::from(ppm)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The network between regions.
#[derive(Debug, Clone)]
pub struct Wan {
    /// Region names.
    pub names: Vec<String>,
    /// One-way latency `[from][to]`, µs.
    pub latency_us: Vec<Vec<u64>>,
    /// Each message's latency varies by up to ± this, µs.
    pub jitter_us: u64,
    /// Messages lost, per million.
    pub loss_ppm: u32,
    /// Messages delivered twice, per million.
    pub dup_ppm: u32,
    /// Messages held back (delivered after later ones), per million.
    pub reorder_ppm: u32,
}

impl Wan {
    /// The setting: A, B, C with one-way latency A–B 30 ms, A–C
    /// 70 ms, B–C 120 ms, ±10 ms jitter, 1% loss, duplicates and reorders.
    pub fn three_continents() -> Self {
        let ms = 1_000;
        Wan {
            names: vec!["a".into(), "b".into(), "c".into()],
            latency_us: vec![vec![0, 30 * ms, 70 * ms], vec![30 * ms, 0, 120 * ms], vec![70 * ms, 120 * ms, 0]],
            jitter_us: 10 * ms,
            loss_ppm: 10_000,
            dup_ppm: 10_000,
            reorder_ppm: 10_000,
        }
    }

    /// The largest one-way latency.
    pub fn max_latency_us(&self) -> u64 {
        self.latency_us.iter().flatten().copied().max().unwrap_or(0)
    }
}

/// A named traffic pattern.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pattern {
    /// Steady offered load, split across regions.
    Steady,
    /// Every region asks for the whole limit at once at each window start.
    Burst,
    /// One client spreading round-robin over the regions, just under
    /// limit / N each.
    RoundRobin,
    /// All demand in the first region, then abruptly all in the second.
    Shift,
    /// The first region cut off from the others for longer than a window,
    /// then healed (traffic stops at the heal; convergence is measured).
    Partition,
    /// Steady load on a tiny limit (pair with a limit of 1–10).
    Tiny,
    /// Requests of many hits each, often more than what is left.
    Heavy,
    /// Steady load over many distinct keys: several batches' worth.
    ManyKeys,
    /// The first region restarts with its state lost, mid-run.
    Restart,
    /// Region clocks skewed by -200 ms, 0 and +200 ms (and so on).
    Skew,
    /// Lazy sync's worst case: in every window but the first (the regions
    /// warm up in it), the first region trickles 8% of the limit over the
    /// first half, little enough for its hits to wait for the lazy period,
    /// then the second region asks for the whole limit at once; the first
    /// region's waiting hits are all it can over-admit by beyond staleness.
    Trickle,
    /// Steady load, and the last region crashes [`Spec::crashes`] times in
    /// every window after the first: each time it takes its slice (a
    /// burst of single hits, or 2 hits for an eventual rule) and dies at
    /// once with its state lost, and comes back at once as a new
    /// incarnation. What it admitted and no peer acknowledged dies with it.
    Crashloop,
    /// The second and the last region cut off from each other; every
    /// region takes 10 hits; the last region dies while still cut off; the
    /// cut heals; the last region comes back with its state lost. Every
    /// region must then agree (the dead incarnation's hits reach the second
    /// region through the others).
    PartitionCrash,
    /// Load on the first region for a quarter window; the last region then
    /// takes a key's first hits (its slice, or 2) and its instance dies right after,
    /// before its next batch, with the region's state kept (a Redis
    /// region's Redis keeps it): its queues and what it knew of its peers
    /// are lost. Every region must still learn those hits, and the last
    /// region must admit again.
    InstanceCrash,
    /// A metered budget (LLM tokens): requests reserve an estimate of 1 to
    /// limit / 30 hits (an ordinary decision), and each admitted one
    /// settles in the same region within a tenth of a window (and within
    /// its slot, so the bounded cap can be checked per slot): the actual
    /// cost is 0 to twice the estimate, the difference given back (a
    /// refund) or charged after the work (a late charge, never refused).
    /// Traffic stops half a window before the end; the regions must then
    /// agree, refunds included.
    Budget,
}

impl Pattern {
    /// Every pattern, in report order.
    pub const ALL: [Pattern; 15] = [
        Pattern::Steady,
        Pattern::Burst,
        Pattern::RoundRobin,
        Pattern::Shift,
        Pattern::Partition,
        Pattern::Tiny,
        Pattern::Heavy,
        Pattern::ManyKeys,
        Pattern::Restart,
        Pattern::Skew,
        Pattern::Trickle,
        Pattern::Crashloop,
        Pattern::PartitionCrash,
        Pattern::InstanceCrash,
        Pattern::Budget,
    ];

    /// The pattern's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Pattern::Steady => "steady",
            Pattern::Burst => "burst",
            Pattern::RoundRobin => "round-robin",
            Pattern::Shift => "shift",
            Pattern::Partition => "partition",
            Pattern::Tiny => "tiny",
            Pattern::Heavy => "heavy",
            Pattern::ManyKeys => "many-keys",
            Pattern::Restart => "restart",
            Pattern::Skew => "skew",
            Pattern::Trickle => "trickle",
            Pattern::Crashloop => "crashloop",
            Pattern::PartitionCrash => "partition-crash",
            Pattern::InstanceCrash => "instance-crash",
            Pattern::Budget => "budget",
        }
    }

    /// Parse a name.
    pub fn parse(s: &str) -> Option<Pattern> {
        Pattern::ALL.into_iter().find(|p| p.as_str() == s)
    }
}

/// One request of a trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Req {
    /// When, µs after the start.
    pub at_us: u64,
    /// Which region it reaches.
    pub region: usize,
    /// Which key (of the run's keys).
    pub key: u32,
    /// Its weight.
    pub hits: u64,
    /// Budget: how it settles, if admitted.
    pub settle: Option<Settle>,
}

/// How an admitted request of the budget pattern settles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settle {
    /// When, µs after the request.
    pub after_us: u64,
    /// The actual cost: below the request's hits, the rest is given back;
    /// above, the excess is charged after the work.
    pub actual: u64,
}

/// One simulation run.
#[derive(Debug, Clone)]
pub struct Spec {
    /// The network.
    pub wan: Wan,
    /// The sync interval, µs.
    pub interval_us: u64,
    /// Keys per batch.
    pub batch_items: usize,
    /// The limit every key has.
    pub limit: Limit,
    /// Eventual or bounded.
    pub mode: SyncMode,
    /// The traffic.
    pub pattern: Pattern,
    /// Each region's share of the traffic (normalized).
    pub split: Vec<f64>,
    /// Offered load, in limits per window.
    pub offered: f64,
    /// How long, in windows.
    pub windows: u64,
    /// Distinct keys (many-keys: at least 2.5 batches' worth).
    pub keys: u32,
    /// The random seed.
    pub seed: u64,
    /// A trace to replay instead of the pattern.
    pub trace: Option<Vec<Req>>,
    /// Crashloop: crashes per window (default 5).
    pub crashes: u32,
}

impl Spec {
    /// The setting for `limit` and `mode`: three continents, sync
    /// every 100 ms, 2× the limit offered, split 70% / 20% / 10%.
    pub fn goals(limit: Limit, mode: SyncMode, pattern: Pattern, seed: u64) -> Self {
        Spec {
            wan: Wan::three_continents(),
            interval_us: 100_000,
            batch_items: 1_000,
            limit,
            mode,
            pattern,
            split: vec![0.7, 0.2, 0.1],
            offered: 2.0,
            windows: 3,
            keys: 1,
            seed,
            trace: None,
            crashes: 5,
        }
    }

    fn regions(&self) -> usize {
        self.wan.names.len()
    }

    /// Clock skew per region (µs, added to the true time).
    fn skew(&self, r: usize) -> i64 {
        if self.pattern != Pattern::Skew {
            return 0;
        }
        let n = self.regions() as i64;
        // -200 ms, 0, +200 ms for three; spread evenly for more.
        if n == 1 { 0 } else { -200_000 + 400_000 * r as i64 / (n - 1) }
    }

    /// The partition (from, to), µs after the start: the first region cut
    /// off for 1.5 windows, healed a quarter into the second window;
    /// partition-crash: the second and the last region cut from each other
    /// for half a window from an eighth in.
    fn partition(&self) -> Option<(u64, u64)> {
        let w = self.limit.window_us();
        match self.pattern {
            Pattern::Partition => Some((w / 4, w / 4 + 3 * w / 2)),
            Pattern::PartitionCrash => Some((w / 8, w / 8 + w / 2)),
            _ => None,
        }
    }

    /// Whether the link between regions `a` and `b` is cut at `t`.
    fn cut(&self, t: u64, a: usize, b: usize) -> bool {
        let Some((from, to)) = self.partition() else { return false };
        if t < from || t >= to {
            return false;
        }
        let last = self.regions() - 1;
        match self.pattern {
            Pattern::PartitionCrash => (a.min(b), a.max(b)) == (1.min(last), last),
            _ => (a == 0) != (b == 0),
        }
    }

    /// What happens to regions, by time: `(at, event, region)`.
    fn region_events(&self) -> Vec<(u64, Life, usize)> {
        let w = self.limit.window_us();
        let last = self.regions() - 1;
        match self.pattern {
            Pattern::Restart => vec![(w * 3 / 2, Life::Restart, 0)],
            Pattern::Crashloop => self.crash_times().into_iter().map(|t| (t, Life::Restart, last)).collect(),
            Pattern::PartitionCrash => {
                let (from, heal) = self.partition().unwrap_or((0, w));
                vec![(from + w / 4, Life::Down, last), (heal + w / 16, Life::Restart, last)]
            }
            Pattern::InstanceCrash => vec![(w / 4 + 1_000, Life::Instance, last)],
            _ => Vec::new(),
        }
    }

    /// Crashloop: when the last region crashes ([`Spec::crashes`] times in
    /// every window but the first, evenly spread).
    fn crash_times(&self) -> Vec<u64> {
        let w = self.limit.window_us();
        let k = u64::from(self.crashes.max(1));
        (1..self.windows.max(2)).flat_map(|win| (0..k).map(move |i| win * w + (2 * i + 1) * w / (2 * k))).collect()
    }

    /// What a region takes in a burst before it dies (crashloop,
    /// instance-crash): a bounded rule's slice, else 2 hits.
    pub fn burst_before_crash(&self) -> u64 {
        match self.mode {
            SyncMode::Bounded { overshoot_ppm } => {
                let capacity = if is_gcra(&self.limit) { self.limit.burst() } else { self.limit.limit() };
                slice(overshoot_ppm, capacity, self.regions()).max(1)
            }
            SyncMode::Eventual => 2,
        }
    }

    /// The requests of the pattern, by time.
    pub fn trace(&self) -> Vec<Req> {
        if let Some(t) = &self.trace {
            return t.clone();
        }
        let mut rng = Rng::new(self.seed.wrapping_mul(31).wrapping_add(7));
        let n = self.regions();
        let w = self.limit.window_us();
        let end = w * self.windows.max(1);
        let limit = self.limit.limit().max(1);
        let total: f64 = self.split.iter().sum::<f64>().max(f64::MIN_POSITIVE);
        let share = |r: usize| self.split.get(r).copied().unwrap_or(0.0) / total;
        let keys = if self.pattern == Pattern::ManyKeys {
            self.keys.max(u32::try_from(self.batch_items * 5 / 2).unwrap_or(u32::MAX))
        } else {
            self.keys.max(1)
        };
        let mut out = Vec::new();
        // Poisson arrivals at `rate` per µs in [from, to) to `region`.
        // Heavy requests weigh 1 to limit / 30 (often more than a bounded
        // rule's slice, and more than is left near the limit).
        let heavy_max = (limit / 30).max(2);
        let poisson =
            move |out: &mut Vec<Req>, rng: &mut Rng, region: usize, rate: f64, from: u64, to: u64, heavy: bool| {
                if rate <= 0.0 {
                    return;
                }
                let mut t = from as f64;
                loop {
                    t += -(1.0 - rng.unit()).ln() / rate;
                    if t >= to as f64 {
                        break;
                    }
                    let hits = if heavy { 1 + rng.below(heavy_max) } else { 1 };
                    let key = rng.below(u64::from(keys)) as u32;
                    out.push(Req { at_us: t as u64, region, key, hits, settle: None });
                }
            };
        let per_us = self.offered * limit as f64 / w as f64;
        match self.pattern {
            Pattern::Steady
            | Pattern::Tiny
            | Pattern::ManyKeys
            | Pattern::Restart
            | Pattern::Skew
            | Pattern::Heavy
            | Pattern::Crashloop => {
                let heavy = self.pattern == Pattern::Heavy;
                let per_us = if heavy { per_us / (heavy_max as f64 / 2.0 + 0.5) } else { per_us };
                for r in 0..n {
                    poisson(&mut out, &mut rng, r, per_us * share(r) * f64::from(keys), 0, end, heavy);
                }
                if self.pattern == Pattern::Crashloop {
                    let burst = self.burst_before_crash();
                    for t in self.crash_times() {
                        for i in 0..burst {
                            // Spread over the last millisecond of its life.
                            let at = t - 1_000 + i * 1_000 / burst;
                            out.push(Req { at_us: at, region: n - 1, key: 0, hits: 1, settle: None });
                        }
                    }
                }
            }
            Pattern::Budget => {
                let per_us = per_us / (heavy_max as f64 / 2.0 + 0.5);
                let stop = end.saturating_sub(w / 2);
                for r in 0..n {
                    poisson(&mut out, &mut rng, r, per_us * share(r) * f64::from(keys), 0, stop, true);
                }
                // Each settles within a tenth of a window, and within the
                // slot it was admitted in (a refund then gives back hits of
                // that slot: the cap check can count it there).
                let slot = match self.limit.algorithm() {
                    Algorithm::SlidingBuckets { granularity } => w / u64::from(*granularity),
                    _ => w,
                };
                out.sort_by_key(|q| (q.at_us, q.region, q.key));
                for q in &mut out {
                    let abs = T0 + q.at_us;
                    let left = ((abs / slot + 1) * slot - abs).min(w / 10).max(1);
                    q.settle = Some(Settle { after_us: rng.below(left), actual: rng.below(2 * q.hits + 1) });
                }
            }
            Pattern::PartitionCrash => {
                let (from, _) = self.partition().unwrap_or((0, w));
                for r in 0..n {
                    for i in 0..10 {
                        out.push(Req {
                            at_us: from + 10_000 + i * 1_000 + r as u64,
                            region: r,
                            key: 0,
                            hits: 1,
                            settle: None,
                        });
                    }
                }
            }
            Pattern::InstanceCrash => {
                // The first region's load stops as the last region takes
                // its hits, so agreement can be measured.
                poisson(&mut out, &mut rng, 0, per_us * share(0), 0, w / 4, false);
                let burst = self.burst_before_crash();
                for i in 0..burst {
                    out.push(Req { at_us: w / 4 + i * 500 / burst, region: n - 1, key: 0, hits: 1, settle: None });
                }
                // Afterwards, the last region asks now and then: once the
                // dead instance's hits are acknowledged it admits again.
                for i in 1..(2 * self.windows.max(1)) {
                    out.push(Req { at_us: w / 4 + i * w / 2, region: n - 1, key: 0, hits: 1, settle: None });
                }
            }
            Pattern::Partition => {
                let (_, heal) = self.partition().unwrap_or((0, end));
                for r in 0..n {
                    poisson(&mut out, &mut rng, r, per_us * share(r) * f64::from(keys), 0, heal, false);
                }
            }
            Pattern::Shift => {
                let at = w / 4;
                poisson(&mut out, &mut rng, 0, per_us * f64::from(keys), 0, at, false);
                poisson(&mut out, &mut rng, 1.min(n - 1), per_us * f64::from(keys), at, end, false);
            }
            Pattern::Burst => {
                for win in 0..self.windows.max(1) {
                    for r in 0..n {
                        for k in 0..keys {
                            for i in 0..limit {
                                // Spread over 1 ms at the window start.
                                let at = win * w + rng.below(1_000).min(w - 1);
                                out.push(Req { at_us: at, region: r, key: k, hits: 1, settle: None });
                                let _ = i;
                            }
                        }
                    }
                }
            }
            Pattern::Trickle => {
                let trickle = (limit * 8 / 100).max(1);
                for win in 1..self.windows.max(2) {
                    for k in 0..keys {
                        for i in 0..trickle {
                            let at = win * w + (i * w / 2 + w / 4) / trickle;
                            out.push(Req { at_us: at, region: 0, key: k, hits: 1, settle: None });
                        }
                        for _ in 0..limit {
                            let at = win * w + w / 2 + rng.below(1_000).min(w / 2 - 1);
                            out.push(Req { at_us: at, region: 1.min(n - 1), key: k, hits: 1, settle: None });
                        }
                    }
                }
            }
            Pattern::RoundRobin => {
                // Just under the limit in all: limit × 0.98 per window,
                // spread evenly, region after region.
                let per_window = (limit as f64 * 0.98).floor().max(1.0) as u64;
                let mut r = 0;
                for win in 0..self.windows.max(1) {
                    for k in 0..keys {
                        for i in 0..per_window {
                            let at = win * w + (i * w + w / 2) / per_window;
                            out.push(Req {
                                at_us: at.min(win * w + w - 1),
                                region: r % n,
                                key: k,
                                hits: 1,
                                settle: None,
                            });
                            r += 1;
                        }
                    }
                }
            }
        }
        out.sort_by_key(|q| (q.at_us, q.region, q.key));
        out
    }
}

/// What a run showed.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Report {
    /// Requests offered.
    pub requests: u64,
    /// Hits admitted by the regions.
    pub admitted: u64,
    /// Hits the exact global answer admitted.
    pub exact: u64,
    /// Hits admitted per region.
    pub by_region: Vec<u64>,
    /// Hits the last region admitted after the run's last region event (a
    /// crash, an instance's death).
    pub last_after_event: u64,
    /// Σ over windows of what the regions admitted beyond the exact answer.
    pub over: u64,
    /// The worst window's over-admission.
    pub worst_over: u64,
    /// Σ over windows of what the exact answer admitted beyond the regions
    /// (denials the exact answer would not have made).
    pub false_denials: u64,
    /// For bounded rules: the cap, and whether every window (every
    /// interval, for the GCRA family) stayed within it.
    pub cap: Option<u64>,
    /// Whether the cap held (true without one).
    pub cap_held: bool,
    /// The staleness bound S of the eventual mode, in hits.
    pub staleness: f64,
    /// Partition: time from the heal until every region agrees, µs.
    pub convergence_us: Option<u64>,
    /// The bound it is held to: after a heal, 2 × (interval + largest
    /// latency + jitter) plus ⌈dirty keys / batch⌉ × interval; after a
    /// region's (or an instance's) return, 3 × rather than 2 × (its first
    /// word, a peer's full state and a relay).
    pub convergence_bound_us: u64,
    /// Shift (bounded): sync rounds after the shift until the admission
    /// rate is back to ≥ 90% of limit / window.
    pub rounds_to_90: Option<u64>,
    /// The slice-limited rate, hits per second per region: slice over the
    /// acknowledgement round trip.
    pub slice_rate: Option<f64>,
    /// Batches sent, keys in them, and messages lost and duplicated.
    pub batches: u64,
    /// Keys sent in batches.
    pub items: u64,
    /// Messages lost.
    pub lost: u64,
    /// Messages duplicated.
    pub duplicated: u64,
    /// Budget: hits the regions gave back, and charged after the work.
    pub refunded: u64,
    /// Hits charged after the work.
    pub late: u64,
}

enum Event {
    Request(usize),
    Tick(usize),
    Batch {
        to: usize,
        batch: Batch,
    },
    Ack {
        to: usize,
        from: usize,
        ack: Ack,
    },
    Region(Life, usize),
    /// A budget request settles: in its region, or (`exact`) in the exact
    /// answer's store.
    Settle {
        region: usize,
        key: u32,
        hits: u64,
        actual: u64,
        exact: bool,
    },
}

/// What happens to a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Life {
    /// Dies with its state lost and is back at once, a new incarnation.
    Restart,
    /// Dies with its state lost and stays down (messages to it are lost,
    /// requests to it denied) until a `Restart`.
    Down,
    /// Its instance dies and is back at once with the region's state
    /// kept: what it knew of its links is lost.
    Instance,
}

struct Queue {
    heap: BinaryHeap<Reverse<(u64, u64)>>,
    events: Vec<Option<Event>>,
}

impl Queue {
    fn push(&mut self, at: u64, e: Event) {
        let id = self.events.len() as u64;
        self.events.push(Some(e));
        self.heap.push(Reverse((at, id)));
    }

    fn pop(&mut self) -> Option<(u64, Event)> {
        let Reverse((at, id)) = self.heap.pop()?;
        self.events[id as usize].take().map(|e| (at, e))
    }
}

/// Region `r`'s table as incarnation `incarnation`. The regions the run
/// starts with have been up before it (`warm`: no warm-up wait, though
/// they exchange their full states first, as a restart does): a pattern
/// measures regions in operation, and a restart within the run waits as a
/// real one does.
fn table(spec: &Spec, r: usize, incarnation: u64, warm: bool) -> GlobalTable {
    let name = spec.wan.names[r].clone();
    let peers = spec.wan.names.iter().filter(|n| **n != name).cloned().collect();
    let mut cfg = RegionConfig::new(name, peers, incarnation);
    cfg.batch_items = spec.batch_items;
    cfg.interval_us = spec.interval_us;
    cfg.retry_hint_us = 2 * spec.interval_us;
    cfg.lazy_us = 10 * spec.interval_us;
    cfg.hash_seed = Some(incarnation);
    if warm {
        cfg.warmup_us = 0;
    }
    GlobalTable::new(cfg).expect("simulated regions are valid")
}

/// Run one simulation.
pub fn run(spec: &Spec) -> Report {
    let n = spec.regions();
    let trace = spec.trace();
    let mut rng = Rng::new(spec.seed);
    let mut tables: Vec<GlobalTable> = (0..n).map(|r| table(spec, r, 1 + r as u64 + (spec.seed << 8), true)).collect();
    let clock = |r: usize, t: u64| -> u64 { (T0 + t).saturating_add_signed(spec.skew(r)) };
    let keys: Vec<String> = {
        let k = trace.iter().map(|q| q.key).max().map_or(1, |m| m + 1);
        (0..k).map(|i| format!("key:{i}")).collect()
    };
    let w = spec.limit.window_us();
    let end = w * spec.windows.max(1) + w / 2;
    let mut q = Queue { heap: BinaryHeap::new(), events: Vec::new() };
    for (i, req) in trace.iter().enumerate() {
        q.push(req.at_us, Event::Request(i));
    }
    for r in 0..n {
        // Ticks start at a random phase per region.
        q.push(rng.below(spec.interval_us), Event::Tick(r));
    }
    for (at, life, r) in spec.region_events() {
        q.push(at, Event::Region(life, r));
    }
    let partition = spec.partition();
    let cut = |t: u64, a: usize, b: usize| spec.cut(t, a, b);
    let mut down = vec![false; n];

    // Admitted hits per (key, region-labelled slot) and per (key, true
    // window) of the exact store, and GCRA admissions for the interval cap.
    let account_slot = |r: usize, t: u64| -> u64 { clock(r, t) / w };
    let mut adm: std::collections::HashMap<(u32, u64), u64> = std::collections::HashMap::new();
    let mut exact_adm: std::collections::HashMap<(u32, u64), u64> = std::collections::HashMap::new();
    let mut admissions: Vec<Admission> = Vec::new();
    let mut exact_state: Vec<State> = vec![State::new(); keys.len()];
    let mut exact_log: Vec<(u64, u32, u64)> = Vec::new();
    let mut report = Report { requests: trace.len() as u64, by_region: vec![0; n], ..Report::default() };
    let mut restarts = 0u64;
    let send = |q: &mut Queue, rng: &mut Rng, report: &mut Report, t: u64, from: usize, to: usize, e: Event| {
        if cut(t, from, to) || rng.chance(spec.wan.loss_ppm) {
            report.lost += 1;
            return;
        }
        let delay = |rng: &mut Rng| {
            let j = spec.wan.jitter_us;
            let base = spec.wan.latency_us[from][to] + rng.below(2 * j + 1);
            let held = if rng.chance(spec.wan.reorder_ppm) { 2 * j + spec.interval_us } else { 0 };
            (base + held).saturating_sub(j)
        };
        let first = delay(rng);
        if rng.chance(spec.wan.dup_ppm) {
            report.duplicated += 1;
            let again = delay(rng);
            let copy = match &e {
                Event::Batch { to, batch } => Event::Batch { to: *to, batch: batch.clone() },
                Event::Ack { to, from, ack } => Event::Ack { to: *to, from: *from, ack: ack.clone() },
                _ => unreachable!("only messages are sent"),
            };
            q.push(t + again, copy);
        }
        q.push(t + first, e);
    };
    // Convergence is measured from the heal (partition), from the dead
    // region's return (partition-crash), or from the instance's death.
    let heal = match spec.pattern {
        Pattern::PartitionCrash | Pattern::InstanceCrash => spec.region_events().last().map(|e| e.0),
        // Budget: from the last settle.
        Pattern::Budget => Some((w * spec.windows.max(1)).saturating_sub(w / 2) + w / 10),
        _ => partition.map(|(_, to)| to),
    };
    let last_event = spec.region_events().last().map(|e| e.0);
    let mut converged: Option<u64> = None;
    let mut shift_rounds: Vec<u64> = Vec::new();
    while let Some((t, e)) = q.pop() {
        if t > end {
            break;
        }
        match e {
            Event::Request(i) => {
                let req = trace[i];
                let key = &keys[req.key as usize];
                let d = if down[req.region] {
                    Err(crate::StoreError::Unavailable("down".into()))
                } else {
                    tables[req.region].apply(key, &spec.limit, spec.mode, req.hits, clock(req.region, t))
                };
                if d.is_ok_and(|d| d.allowed) && req.hits > 0 {
                    report.admitted += req.hits;
                    report.by_region[req.region] += req.hits;
                    if req.region == n - 1 && last_event.is_some_and(|at| t > at) {
                        report.last_after_event += req.hits;
                    }
                    *adm.entry((req.key, account_slot(req.region, t))).or_default() += req.hits;
                    admissions.push(Admission { key: req.key, region: req.region, at: t, hits: req.hits as i64 });
                    if let Some(s) = req.settle {
                        let (region, key, hits, actual) = (req.region, req.key, req.hits, s.actual);
                        q.push(t + s.after_us, Event::Settle { region, key, hits, actual, exact: false });
                    }
                    if spec.pattern == Pattern::Shift && t >= w / 4 {
                        let round = (t - w / 4) / spec.interval_us;
                        if shift_rounds.len() <= round as usize {
                            shift_rounds.resize(round as usize + 1, 0);
                        }
                        shift_rounds[round as usize] += req.hits;
                    }
                }
                let ed = spec.limit.apply(&mut exact_state[req.key as usize], T0 + t, req.hits);
                if ed.allowed && req.hits > 0 {
                    report.exact += req.hits;
                    *exact_adm.entry((req.key, (T0 + t) / w)).or_default() += req.hits;
                    exact_log.push((t, req.key, req.hits));
                    if let Some(s) = req.settle {
                        let (region, key, hits, actual) = (req.region, req.key, req.hits, s.actual);
                        q.push(t + s.after_us, Event::Settle { region, key, hits, actual, exact: true });
                    }
                }
            }
            Event::Settle { region, key, hits, actual, exact } => {
                let k = key as usize;
                if exact {
                    let state = &mut exact_state[k];
                    if actual < hits {
                        spec.limit.give_back(state, T0 + t, hits - actual);
                    } else if actual > hits {
                        spec.limit.charge_late(state, T0 + t, actual - hits);
                    }
                } else if !down[region] {
                    let now = clock(region, t);
                    if actual < hits {
                        if let Ok((_, given)) =
                            tables[region].give_back(&keys[k], &spec.limit, spec.mode, hits - actual, now)
                        {
                            report.refunded += given;
                            admissions.push(Admission { key, region, at: t, hits: -(given as i64) });
                        }
                    } else if actual > hits
                        && tables[region].charge_late(&keys[k], &spec.limit, spec.mode, actual - hits, now).is_ok()
                    {
                        report.late += actual - hits;
                    }
                }
            }
            Event::Tick(r) if down[r] => q.push(t + spec.interval_us, Event::Tick(r)),
            Event::Tick(r) => {
                let now = clock(r, t);
                for p in 0..n - 1 {
                    let to = if p < r { p } else { p + 1 };
                    while let Some(batch) = tables[r].next_batch(p, now) {
                        report.batches += 1;
                        report.items += batch.items.len() as u64;
                        let empty = batch.items.is_empty();
                        send(&mut q, &mut rng, &mut report, t, r, to, Event::Batch { to, batch });
                        if empty {
                            break;
                        }
                    }
                }
                if t % (10 * spec.interval_us) < spec.interval_us {
                    tables[r].sweep(now);
                }
                if let Some(h) = heal
                    && t >= h
                    && converged.is_none()
                    && !down.contains(&true)
                    && keys.iter().all(|k| {
                        let v0 = tables[0].view(k, clock(0, t));
                        (1..n).all(|o| tables[o].view(k, clock(o, t)) == v0)
                    })
                {
                    converged = Some(t - h);
                }
                q.push(t + spec.interval_us, Event::Tick(r));
            }
            Event::Batch { to, .. } | Event::Ack { to, .. } if down[to] => report.lost += 1,
            Event::Batch { to, batch } => {
                let from = spec.wan.names.iter().position(|x| *x == batch.from).unwrap_or(0);
                let receipt = tables[to].receive(&batch, clock(to, t));
                send(&mut q, &mut rng, &mut report, t, to, from, Event::Ack { to: from, from: to, ack: receipt.ack });
            }
            Event::Ack { to, from, ack } => {
                if let Some(p) = tables[to].peer_index(&spec.wan.names[from]) {
                    tables[to].on_ack(p, &ack, clock(to, t));
                }
            }
            Event::Region(Life::Restart, r) => {
                restarts += 1;
                tables[r] = table(spec, r, 1_000_000 + restarts + (spec.seed << 8), false);
                down[r] = false;
            }
            Event::Region(Life::Down, r) => down[r] = true,
            Event::Region(Life::Instance, r) => tables[r].restart_instance(),
        }
    }
    if is_gcra(&spec.limit) {
        // A bucket carries debt from one window into the next: compare the
        // running totals. Over-admission: the most the regions were ever
        // ahead of the exact answer; false denials: how far behind they
        // ended.
        let mut keys_seen: std::collections::BTreeMap<u32, (i128, i128, i128)> = std::collections::BTreeMap::new();
        // Admissions only: the exact answer's log has no refunds either.
        let mut events: Vec<(u64, u32, i128)> =
            admissions.iter().filter(|a| a.hits > 0).map(|a| (a.at, a.key, i128::from(a.hits))).collect();
        events.extend(exact_log.iter().map(|&(t, k, h)| (t, k, -i128::from(h))));
        events.sort_by_key(|e| (e.0, e.2 < 0));
        for (_, k, d) in events {
            let (lead, worst, _) = keys_seen.entry(k).or_insert((0, 0, 0));
            *lead += d;
            *worst = (*worst).max(*lead);
        }
        for (lead, worst, _) in keys_seen.values() {
            report.over += u64::try_from(*worst).unwrap_or(0);
            report.worst_over = report.worst_over.max(u64::try_from(*worst).unwrap_or(0));
            report.false_denials += u64::try_from(-*lead).unwrap_or(0);
        }
    } else {
        // Per window (as each region labels it): the regions against the
        // exact answer.
        let mut windows: std::collections::BTreeSet<(u32, u64)> = adm.keys().copied().collect();
        windows.extend(exact_adm.keys().copied());
        for k in windows {
            let a = adm.get(&k).copied().unwrap_or(0);
            let x = exact_adm.get(&k).copied().unwrap_or(0);
            report.over += a.saturating_sub(x);
            report.worst_over = report.worst_over.max(a.saturating_sub(x));
            report.false_denials += x.saturating_sub(a);
        }
    }
    report.cap_held = true;
    if let SyncMode::Bounded { overshoot_ppm } = spec.mode {
        report.cap_held = cap_holds(spec, overshoot_ppm, &admissions, &mut report, clock);
        let capacity = if is_gcra(&spec.limit) { spec.limit.burst() } else { spec.limit.limit() };
        let s = slice(overshoot_ppm, capacity, n);
        // The slowest acknowledgement round trip: to the farthest peer and
        // back, plus up to an interval's wait for the next batch.
        let rtt = 2 * spec.wan.max_latency_us() + 2 * spec.wan.jitter_us + spec.interval_us;
        report.slice_rate = Some(s as f64 / (rtt as f64 / 1e6));
        if spec.pattern == Pattern::Shift {
            let target = 0.9 * spec.limit.limit() as f64 * spec.interval_us as f64 / w as f64;
            report.rounds_to_90 = shift_rounds.iter().position(|&h| h as f64 >= target).map(|r| r as u64 + 1);
        }
    }
    report.staleness = staleness(spec, &trace);
    if let Some(h) = heal {
        report.convergence_us = converged;
        let dirty = keys.len() as u64;
        let batches = dirty.div_ceil(spec.batch_items.max(1) as u64);
        // After a heal: a batch each way. After a region's return (or its
        // instance's): its first word to a peer, that peer's full state
        // back, and a relay on to the others.
        let hops = if matches!(spec.pattern, Pattern::Partition | Pattern::Budget) { 2 } else { 3 };
        report.convergence_bound_us =
            hops * (spec.interval_us + spec.wan.max_latency_us() + spec.wan.jitter_us) + batches * spec.interval_us;
        let _ = h;
    }
    report
}

fn is_gcra(limit: &Limit) -> bool {
    matches!(limit.algorithm(), Algorithm::Gcra { .. } | Algorithm::TokenBucket { .. } | Algorithm::LeakyBucket { .. })
}

/// One admitted request (negative: hits given back).
#[derive(Debug, Clone, Copy)]
struct Admission {
    key: u32,
    region: usize,
    at: u64,
    hits: i64,
}

/// Whether every window (GCRA family: every interval) stayed within the
/// bounded cap; sets `report.cap`. Windows are counted as each region
/// labels them (by its own clock).
fn cap_holds(
    spec: &Spec,
    overshoot_ppm: u32,
    admissions: &[Admission],
    report: &mut Report,
    clock: impl Fn(usize, u64) -> u64,
) -> bool {
    let c = 1_000_000 + u128::from(overshoot_ppm);
    let w = u128::from(spec.limit.window_us());
    let l = u128::from(spec.limit.limit());
    if is_gcra(&spec.limit) {
        // In any interval [t_j, t_i]: admitted ≤ (1 + o)(B + L (t_i - t_j) / W),
        // i.e. 1e6 W f_i - c L t_i ≤ c B W + min_j (1e6 W f_j⁻ - c L t_j).
        let b = u128::from(spec.limit.burst());
        report.cap = Some(u64::try_from(c * b / 1_000_000).unwrap_or(u64::MAX));
        let mut by_key: std::collections::HashMap<u32, (i128, i128)> = std::collections::HashMap::new();
        // Net of refunds: a point just after one is an interval's start too.
        for a in admissions {
            let (f, best) = by_key.entry(a.key).or_insert((0, i128::MAX));
            let t = a.at as i128;
            let before = 1_000_000 * w as i128 * *f - (c * l) as i128 * t;
            *best = (*best).min(before);
            *f += i128::from(a.hits);
            let after = 1_000_000 * w as i128 * *f - (c * l) as i128 * t;
            if a.hits < 0 {
                *best = (*best).min(after);
            } else if after > (c * b * w) as i128 + *best {
                return false;
            }
        }
        true
    } else {
        let cap = u64::try_from(c * l / 1_000_000).unwrap_or(u64::MAX);
        report.cap = Some(cap);
        let horizon = match spec.limit.algorithm() {
            Algorithm::SlidingBuckets { granularity } => u64::from(*granularity),
            _ => 1,
        };
        let slot_us = spec.limit.window_us() / horizon;
        let mut per: std::collections::BTreeMap<(u32, u64), i64> = std::collections::BTreeMap::new();
        for a in admissions {
            *per.entry((a.key, clock(a.region, a.at) / slot_us)).or_default() += a.hits;
        }
        // Any `horizon` consecutive slots.
        let slots: Vec<((u32, u64), i64)> = per.into_iter().collect();
        slots.iter().enumerate().all(|(i, &((k, s), _))| {
            let sum: i64 =
                slots[i..].iter().take_while(|((k2, s2), _)| *k2 == k && *s2 < s + horizon).map(|x| x.1).sum();
            sum <= cap as i64
        })
    }
}

/// The eventual mode's staleness bound: S = max over regions k of
/// Σ_{j≠k} r_j × (interval + latency_kj + jitter), with r_j region j's
/// offered rate (its admission rate while it still admits), in hits.
fn staleness(spec: &Spec, trace: &[Req]) -> f64 {
    let n = spec.regions();
    let w = spec.limit.window_us();
    // Per (region, key, window): hits offered and the span they came in.
    let mut per: std::collections::HashMap<(usize, u32, u64), (u64, u64, u64)> = std::collections::HashMap::new();
    for q in trace {
        let e = per.entry((q.region, q.key, q.at_us / w)).or_insert((0, q.at_us, q.at_us));
        e.0 += q.hits;
        e.2 = q.at_us;
    }
    // r_j: region j's rate while it admits, per key: the busiest window's.
    let mut rate = vec![0.0f64; n];
    for (&(r, _, _), &(hits, first, last)) in &per {
        let span = (last - first).max(1_000).min(w) as f64;
        rate[r] = rate[r].max(hits as f64 / span);
    }
    (0..n)
        .map(|k| {
            (0..n)
                .filter(|&j| j != k)
                .map(|j| rate[j] * (spec.interval_us + spec.wan.latency_us[k][j] + spec.wan.jitter_us) as f64)
                .sum::<f64>()
        })
        .fold(0.0, f64::max)
}
