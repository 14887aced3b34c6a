//! This instance's region: its name and peers, the state of its `scope:
//! global` limits ([`GlobalTable`], memory store), and the sync service and
//! links that keep the peers in step ([`floodgate_sync`]). Which rules can
//! be global on this instance is checked here, at start and on every
//! reload.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use floodgate_core::region::{GlobalTable, LinkStats, RegionConfig, Scope, SyncMode, min_capacity, shape_of, slice};
use floodgate_core::rules::{ConfigError, Rule, RuleSet};
use floodgate_core::{Algorithm, Clock, SystemClock};
use floodgate_redis::{RedisConfig, RedisRegion};
use floodgate_sync::{Peer, SyncStats};
use serde_json::{Value, json};

use crate::metrics::gauge;

/// How this instance takes part in many regions.
#[derive(Debug, Clone)]
pub struct RegionsConfig {
    /// This region's name (`--region`).
    pub region: String,
    /// The peer regions and their sync addresses (`--peers`).
    pub peers: Vec<Peer>,
    /// Where this region's sync service listens (`--sync-addr`).
    pub sync_addr: SocketAddr,
    /// How often usage is sent (`--sync-interval`, default 100 ms).
    pub interval: Duration,
    /// The longest a sync call may take (`--sync-timeout`, default 1 s).
    pub timeout: Duration,
    /// The longest a key far below its limit waits before it is sent
    /// (`--sync-lazy`, default ten intervals; zero: never waits).
    pub lazy: Duration,
    /// How long a region that knows nothing yet waits for a peer's full
    /// state before it admits on eventual rules (`--sync-warmup`, default
    /// 1 s; zero: its share at once).
    pub warmup: Duration,
    /// The token every sync call carries and requires (`--sync-token`).
    pub token: Option<String>,
}

/// Where a region's global state is.
#[derive(Debug, Clone)]
pub enum RegionState {
    /// In this process: a memory-store region (one instance).
    Memory(Arc<GlobalTable>),
    /// In the region's Redis: every instance on it.
    Redis(Arc<RedisRegion>),
}

impl RegionState {
    fn link_stats(&self, p: usize) -> LinkStats {
        match self {
            Self::Memory(t) => t.link_stats(p),
            Self::Redis(r) => r.link_stats(p),
        }
    }

    /// Whether the region waits for a peer's full state.
    pub fn warming(&self) -> bool {
        match self {
            Self::Memory(t) => t.warming(),
            Self::Redis(r) => r.warming(),
        }
    }

    /// Whether eventual rules admit nothing yet (no peer's full state, the
    /// warm-up wait not over).
    pub fn cold(&self) -> bool {
        match self {
            Self::Memory(t) => t.cold(),
            Self::Redis(r) => r.cold(),
        }
    }

    /// Whether bounded rules admit (every peer has recorded this
    /// incarnation).
    pub fn bounded_open(&self) -> bool {
        match self {
            Self::Memory(t) => t.bounded_open(),
            Self::Redis(r) => r.bounded_open(),
        }
    }

    /// Dead incarnations known, of every region.
    pub fn dead_incarnations(&self) -> u64 {
        match self {
            Self::Memory(t) => t.dead_incarnations(),
            Self::Redis(r) => r.dead_incarnations(),
        }
    }

    /// The region's incarnation.
    pub fn incarnation(&self) -> u64 {
        match self {
            Self::Memory(t) => t.incarnation(),
            Self::Redis(r) => r.incarnation(),
        }
    }
}

/// Why this instance cannot take part in its regions: what to change.
#[derive(Debug, thiserror::Error)]
pub enum RegionsError {
    /// The region and its peers cannot work together.
    #[error("--region/--peers: {0}")]
    Config(floodgate_core::region::RegionConfigError),
    /// A peer's address is not usable.
    #[error("--peers: {0}")]
    Peers(floodgate_sync::PeerError),
    /// The region's Redis cannot be used.
    #[error("--store {target}: {error}")]
    Redis {
        /// The store's address.
        target: String,
        /// What the Redis client said.
        error: redis::RedisError,
    },
}

/// This instance's region, running.
#[derive(Debug)]
pub struct Regions {
    /// The settings.
    pub config: RegionsConfig,
    /// The global limits' state.
    pub state: RegionState,
    /// The transport's counters.
    pub stats: Arc<SyncStats>,
}

/// A fresh incarnation: the memory store starts empty at every start.
fn incarnation() -> u64 {
    floodgate_core::region::new_incarnation(SystemClock::new().now_us(), std::process::id().into())
}

impl Regions {
    /// The engine's settings for `config`, checked (the peers' names and
    /// addresses); the error says what to change.
    fn settings(config: &RegionsConfig) -> Result<RegionConfig, RegionsError> {
        let names: Vec<String> = config.peers.iter().map(|p| p.name.clone()).collect();
        let mut cfg = RegionConfig::new(config.region.clone(), names, incarnation());
        cfg.interval_us = u64::try_from(config.interval.as_micros()).unwrap_or(u64::MAX).max(1);
        cfg.retry_hint_us = 2 * cfg.interval_us;
        cfg.lazy_us = u64::try_from(config.lazy.as_micros()).unwrap_or(u64::MAX);
        cfg.warmup_us = u64::try_from(config.warmup.as_micros()).unwrap_or(u64::MAX);
        cfg.ack_timeout_us = cfg.ack_timeout_us.max(2 * u64::try_from(config.timeout.as_micros()).unwrap_or(0));
        cfg.check().map_err(RegionsError::Config)?;
        let link = floodgate_sync::LinkConfig {
            interval: config.interval,
            timeout: config.timeout,
            token: config.token.clone(),
        };
        floodgate_sync::check_peers(&config.peers, &link).map_err(RegionsError::Peers)?;
        Ok(cfg)
    }

    /// A memory-store region (this instance alone is the region).
    pub fn new(config: RegionsConfig) -> Result<Self, RegionsError> {
        let table = GlobalTable::new(Self::settings(&config)?).map_err(RegionsError::Config)?;
        let stats = Arc::new(SyncStats::new(config.peers.len()));
        Ok(Self { config, state: RegionState::Memory(Arc::new(table)), stats })
    }

    /// A Redis region over the Redis of `redis` (every instance on it is
    /// the region); its store is [`RedisRegion::store`].
    pub fn redis(config: RegionsConfig, redis: RedisConfig) -> Result<Self, RegionsError> {
        let mut cfg = Self::settings(&config)?;
        cfg.batch_items = floodgate_redis::region::BATCH_ITEMS;
        let region = RedisRegion::new(&cfg, redis.clone())
            .map_err(|error| RegionsError::Redis { target: redis.target.to_string(), error })?;
        let stats = Arc::new(SyncStats::new(config.peers.len()));
        Ok(Self { config, state: RegionState::Redis(Arc::new(region)), stats })
    }

    /// The memory-store region's table, if that is what this is.
    pub fn table(&self) -> Option<&Arc<GlobalTable>> {
        match &self.state {
            RegionState::Memory(t) => Some(t),
            RegionState::Redis(_) => None,
        }
    }

    /// The regions in all, this one included.
    pub fn count(&self) -> usize {
        self.config.peers.len() + 1
    }

    /// Metrics of the sync, in Prometheus text.
    pub fn render_metrics(&self, out: &mut String) {
        let t = match &self.state {
            RegionState::Memory(t) => t.stats(),
            RegionState::Redis(r) => r.stats(),
        };
        let now = SystemClock::new().now_us();
        gauge(
            out,
            "floodgate_sync_warming",
            "gauge",
            "1 while this region waits for a peer's full state (it admits only within its slice of global limits).",
            u8::from(self.state.warming()),
        );
        if let RegionState::Memory(_) = self.state {
            gauge(out, "floodgate_sync_keys", "gauge", "Keys of global limits held.", t.keys);
        }
        gauge(
            out,
            "floodgate_sync_merges_total",
            "counter",
            "Peers' components merged that changed something.",
            t.merges,
        );
        gauge(
            out,
            "floodgate_sync_unchanged_total",
            "counter",
            "Peers' components that changed nothing (duplicates, replays, older counts).",
            t.unchanged,
        );
        gauge(
            out,
            "floodgate_sync_stale_total",
            "counter",
            "Peers' components too old to count anywhere, dropped.",
            t.stale,
        );
        gauge(
            out,
            "floodgate_sync_fingerprint_mismatches_total",
            "counter",
            "Keys a peer sent under different limits than this region's (each enforces its own).",
            t.fingerprint_mismatches,
        );
        gauge(
            out,
            "floodgate_sync_shape_mismatches_total",
            "counter",
            "Keys a peer sent whose counts mean something else here (not merged).",
            t.shape_mismatches,
        );
        gauge(
            out,
            "floodgate_sync_unknown_senders_total",
            "counter",
            "Batches from regions not among the peers.",
            t.unknown_senders,
        );
        gauge(
            out,
            "floodgate_sync_rejected_total",
            "counter",
            "Sync calls refused (bad token or contents).",
            self.stats.rejected.load(Ordering::Relaxed),
        );
        let mut families: Vec<Family> = vec![
            (
                "floodgate_sync_lag_ms",
                "gauge",
                "Milliseconds since the peer last acknowledged a batch (-1: never).",
                vec![],
            ),
            ("floodgate_sync_rtt_ms", "gauge", "Smoothed sync round trip to the peer, milliseconds.", vec![]),
            ("floodgate_sync_batches_sent_total", "counter", "Batches sent to the peer.", vec![]),
            ("floodgate_sync_keys_sent_total", "counter", "Keys sent to the peer.", vec![]),
            ("floodgate_sync_bytes_sent_total", "counter", "Bytes of batches sent to the peer.", vec![]),
            ("floodgate_sync_batches_received_total", "counter", "Batches received from the peer.", vec![]),
            ("floodgate_sync_keys_received_total", "counter", "Keys received from the peer.", vec![]),
            ("floodgate_sync_bytes_received_total", "counter", "Bytes of batches received from the peer.", vec![]),
            (
                "floodgate_sync_failures_total",
                "counter",
                "Batches that failed or went unacknowledged (sent again).",
                vec![],
            ),
            (
                "floodgate_sync_dropped_total",
                "counter",
                "Keys dropped from a full queue (resent by a full state transfer).",
                vec![],
            ),
            ("floodgate_sync_queued", "gauge", "Keys waiting to be sent to the peer.", vec![]),
            ("floodgate_sync_up", "gauge", "1 when the last call to the peer succeeded.", vec![]),
        ];
        for (p, peer) in self.config.peers.iter().enumerate() {
            let l = self.state.link_stats(p);
            let c = self.stats.peer(p);
            let lag = if l.last_ack_us == 0 { u64::MAX } else { now.saturating_sub(l.last_ack_us) / 1_000 };
            let values = [
                lag,
                l.srtt_us / 1_000,
                l.batches_sent,
                l.items_sent,
                c.bytes_sent.load(Ordering::Relaxed),
                l.batches_received,
                l.items_received,
                c.bytes_received.load(Ordering::Relaxed),
                l.failures,
                l.dropped,
                l.queued,
                u64::from(c.up.load(Ordering::Relaxed)),
            ];
            for (f, v) in families.iter_mut().zip(values) {
                f.3.push((peer.name.clone(), v));
            }
        }
        for (name, kind, help, rows) in families {
            out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
            for (peer, v) in rows {
                let v = if v == u64::MAX { "-1".to_owned() } else { v.to_string() };
                out.push_str(&format!("{name}{{peer=\"{}\"}} {v}\n", escape(&peer)));
            }
        }
        out.push_str("# HELP floodgate_sync_slice_unacked_ratio The largest share of a bounded limit's slice in use (unacknowledged by some peer), per limit.\n# TYPE floodgate_sync_slice_unacked_ratio gauge\n");
        for (fp, (used, slice)) in self.table().map(|t| t.slice_use()).unwrap_or_default() {
            let ratio = if slice == 0 { 1.0 } else { used as f64 / slice as f64 };
            out.push_str(&format!("floodgate_sync_slice_unacked_ratio{{limit=\"{fp:016x}\"}} {ratio}\n"));
        }
    }

    /// The region's health, for `/readyz` and `/admin/v1/status`.
    pub fn health(&self) -> Value {
        let now = SystemClock::new().now_us();
        let peers: Vec<Value> = self
            .config
            .peers
            .iter()
            .enumerate()
            .map(|(p, peer)| {
                let l = self.state.link_stats(p);
                let c = self.stats.peer(p);
                json!({
                    "region": peer.name,
                    "url": peer.url,
                    "reachable": c.up.load(Ordering::Relaxed),
                    "error": c.last_error(),
                    "lag_ms": (l.last_ack_us > 0).then(|| now.saturating_sub(l.last_ack_us) / 1_000),
                    "rtt_ms": l.srtt_us as f64 / 1e3,
                    "queued_keys": l.queued,
                    "sent_full_state": l.complete,
                })
            })
            .collect();
        let down = peers.iter().filter(|p| p["reachable"] != json!(true)).count();
        json!({
            "region": self.config.region,
            "incarnation": format!("{:016x}", self.state.incarnation()),
            "warming": self.state.warming(),
            "cold": self.state.cold(),
            "bounded_open": self.state.bounded_open(),
            "dead_incarnations": self.state.dead_incarnations(),
            "state": match self.state { RegionState::Memory(_) => "memory", RegionState::Redis(_) => "redis" },
            "peers": peers,
            "note": if down > 0 {
                format!("{down} peer region(s) unreachable: decisions go on with what this region knows (eventual limits may over-admit by what they miss; bounded ones admit at most their slice beyond it)")
            } else {
                String::new()
            },
        })
    }
}

/// A metric family per peer: name, type, help, and a value per peer.
type Family = (&'static str, &'static str, &'static str, Vec<(String, u64)>);

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// Every global rule's limit and sync mode in `set` (the domains' rules and
/// their tiers'), for a Redis region's full state listing.
pub fn global_rules(set: &RuleSet) -> Vec<(floodgate_core::Limit, SyncMode)> {
    let mut out = Vec::new();
    for domain in set.domains() {
        let tiers = domain.tiers().flat_map(|(_, t)| t.rules.iter());
        for rule in domain.rules().chain(tiers) {
            if let (Scope::Global(mode), Some(limit)) = (rule.scope, &rule.limit) {
                out.push((limit.clone(), mode));
            }
        }
    }
    out
}

/// What is wrong with `rules`' global rules on an instance with `regions`
/// regions in all (0: no regions configured): each error positioned, with
/// what to write instead. (A tier's rules decide as the store decides a
/// regional check: their scope is not checked.)
pub fn check_rules(set: &RuleSet, regions: usize) -> Vec<ConfigError> {
    let mut errors = Vec::new();
    for domain in set.domains() {
        let file = set.files().get(domain.file()).cloned().unwrap_or_default();
        for rule in domain.rules() {
            let Some(message) = check_rule(rule, regions) else { continue };
            errors.push(ConfigError {
                file: file.clone(),
                pos: rule.source.pos,
                field: format!("{}: rate_limit.scope", rule.stats_key),
                message,
            });
        }
    }
    errors
}

/// What is wrong with one rule's scope here (`regions` regions in all), if
/// anything.
pub fn check_rule(rule: &Rule, regions: usize) -> Option<String> {
    let Scope::Global(mode) = rule.scope else { return None };
    let limit = rule.limit.as_ref()?;
    if regions < 2 {
        return Some(
            "scope: global shares the limit with peer regions, but none are configured: start with --region NAME --peers NAME=URL,... --sync-addr ADDR, or write scope: region"
                .into(),
        );
    }
    if shape_of(limit).is_none() {
        return Some(
            "sliding_log cannot be global (its exactness needs every admitted request's time in every region): use sliding_buckets (exact at its granularity) or gcra, or scope: region".into(),
        );
    }
    if let Algorithm::SlidingBuckets { granularity } = limit.algorithm()
        && *granularity > 60
    {
        return Some(format!(
            "a global sliding_buckets keeps a count per region per bucket: granularity {granularity} is too fine; use at most 60"
        ));
    }
    if let SyncMode::Bounded { overshoot_ppm } = mode {
        let capacity = match shape_of(limit) {
            Some(floodgate_core::region::Shape::Gcra { .. }) => limit.burst(),
            _ => limit.limit(),
        };
        if slice(overshoot_ppm, capacity, regions) == 0 {
            return Some(format!(
                "sync: bounded gives each of {regions} regions a slice of floor(overshoot x {capacity} / {regions}) = 0 hits: no region could admit anything beyond what it knows; raise the limit to at least {} (or the overshoot)",
                min_capacity(overshoot_ppm, regions)
            ));
        }
    }
    None
}
