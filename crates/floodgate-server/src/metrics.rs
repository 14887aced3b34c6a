//! Prometheus metrics, rendered in the text exposition format. Label values
//! come from configuration (domains, rule names) or fixed sets, never from
//! client keys, so every label's cardinality is bounded by the rules.

use std::collections::HashMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use floodgate_core::limiter::Verdict;
use floodgate_core::reservation::{ReservationError, Settled};
use floodgate_core::rules::{FailureMode, Rule};
use floodgate_core::{Op, StoreError};
use serde_json::{Value, json};

use crate::dashboard::{Dashboard, KeyRef, RuleWatch, SERIES};

/// The adapter a request came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// Envoy RLS v3 gRPC.
    Grpc,
    /// `POST /json` (envoy's JSON endpoint).
    Json,
    /// `POST /v1/check`.
    Check,
    /// The reverse proxy (`floodgate proxy`).
    Proxy,
    /// Reserves (`POST /v1/reserve`, `floodgate.budget.v1.Budget/Reserve`).
    Reserve,
}

impl Protocol {
    const ALL: [Protocol; 5] = [Protocol::Grpc, Protocol::Json, Protocol::Check, Protocol::Proxy, Protocol::Reserve];

    fn as_str(self) -> &'static str {
        match self {
            Protocol::Grpc => "grpc",
            Protocol::Json => "json",
            Protocol::Check => "check",
            Protocol::Proxy => "proxy",
            Protocol::Reserve => "reserve",
        }
    }
}

/// The `result` labels of `floodgate_settles_total`.
const SETTLE_RESULTS: [&str; 5] = ["settled", "again", "unknown", "conflict", "error"];

/// Latency buckets, in seconds (10 µs to 1 s).
const BUCKETS: [f64; 15] = [
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002, 0.002_5, 0.005, 0.01, 0.025, 0.1, 0.25,
    1.0,
];

#[derive(Debug, Default)]
struct Histogram {
    buckets: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_ns: AtomicU64,
}

impl Histogram {
    fn record(&self, d: Duration) {
        let s = d.as_secs_f64();
        if let Some(i) = BUCKETS.iter().position(|&b| s <= b) {
            self.buckets[i].fetch_add(1, Relaxed);
        }
        self.count.fetch_add(1, Relaxed);
        self.sum_ns.fetch_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX), Relaxed);
    }
}

/// Per-rule decision counters.
#[derive(Debug, Default)]
struct RuleCounters {
    ok: AtomicU64,
    over_limit: AtomicU64,
    shadow_over_limit: AtomicU64,
    unlimited: AtomicU64,
    failed_open: AtomicU64,
    failed_closed: AtomicU64,
    failed_local: AtomicU64,
    /// Refunds (hits given back; not decisions of traffic).
    refund: AtomicU64,
    /// Releases and extends of a request's leases (not traffic).
    release: AtomicU64,
    /// The dashboard's data for this rule.
    watch: RuleWatch,
}

impl RuleCounters {
    /// Totals in the dashboard's series order: allowed, denied,
    /// shadow-denied, decided by the failure policy.
    fn series(&self) -> [u64; 4] {
        let l = |a: &AtomicU64| a.load(Relaxed);
        [
            l(&self.ok) + l(&self.unlimited),
            l(&self.over_limit),
            l(&self.shadow_over_limit),
            l(&self.failed_open) + l(&self.failed_closed) + l(&self.failed_local),
        ]
    }
}

type ByRule = HashMap<String, HashMap<String, Arc<RuleCounters>>>;

/// The service's counters.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Requests by protocol and result (ok, over_limit, error).
    requests: [[AtomicU64; 3]; Protocol::ALL.len()],
    latency: [Histogram; Protocol::ALL.len()],
    rules: RwLock<ByRule>,
    /// Store errors by kind: full, unavailable.
    store_errors: [AtomicU64; 2],
    /// gRPC requests shed (too many in flight; `listen::overload`).
    shed: AtomicU64,
    /// Settles by result: settled, again, unknown, conflict, error.
    settles: [AtomicU64; 5],
    /// Hits settles charged late and returned.
    settled_hits: [AtomicU64; 2],
    dashboard: Dashboard,
}

impl Metrics {
    /// Fresh counters, keeping the dashboard's data.
    pub fn new() -> Self {
        Self::default()
    }

    /// Fresh counters, keeping the dashboard's data only when `on`.
    pub fn with_dashboard(on: bool) -> Self {
        Self { dashboard: Dashboard::new(on), ..Self::default() }
    }

    /// The dashboard's switch and budget.
    pub fn dashboard(&self) -> &Dashboard {
        &self.dashboard
    }

    /// The dashboard's second, ending at `now_s` (Unix seconds): each
    /// rule's counters into its history.
    pub fn tick(&self, now_s: u64) {
        if !self.dashboard.is_on() {
            return;
        }
        let map = self.rules.read().unwrap_or_else(PoisonError::into_inner);
        for c in map.values().flat_map(HashMap::values) {
            c.watch.tick(&self.dashboard, c.series(), now_s);
        }
    }

    /// Every watched rule's dashboard data (its `top` heaviest keys per
    /// table, its history over `range`, an index into
    /// [`crate::dashboard::history::RANGES`]), by domain and rule.
    pub fn dashboard_json(&self, top: usize, range: usize) -> Value {
        let map = self.rules.read().unwrap_or_else(PoisonError::into_inner);
        let mut rules = Vec::new();
        for (domain, by_rule) in map.iter() {
            for (rule, c) in by_rule {
                let mut data = c.watch.to_json(top, range);
                if let Value::Object(o) = &mut data {
                    o.insert("domain".into(), json!(domain));
                    o.insert("rule".into(), json!(rule));
                    let totals = SERIES.iter().zip(c.series()).map(|(name, t)| ((*name).to_owned(), json!(t)));
                    o.insert("totals".into(), Value::Object(totals.collect()));
                    rules.push(data);
                }
            }
        }
        rules.sort_by(|a, b| {
            (a["domain"].as_str(), a["rule"].as_str()).cmp(&(b["domain"].as_str(), b["rule"].as_str()))
        });
        json!({ "rules": rules, "peers": self.dashboard.peers_json(range), "budget": self.dashboard.budget() })
    }

    /// Count one request: `Some(allowed)` when decided, `None` when refused
    /// as malformed.
    pub fn request(&self, protocol: Protocol, allowed: Option<bool>, took: Duration) {
        let p = protocol as usize;
        let r = match allowed {
            Some(true) => 0,
            Some(false) => 1,
            None => 2,
        };
        self.requests[p][r].fetch_add(1, Relaxed);
        self.latency[p].record(took);
    }

    /// Count one gRPC request shed for overload.
    pub fn shed(&self) {
        self.shed.fetch_add(1, Relaxed);
    }

    /// Count one rule's verdict in `domain`, of `hits` for `key` (the
    /// dashboard's top keys).
    pub fn verdict(&self, domain: &str, rule: &Rule, v: &Verdict, key: KeyRef<'_>, hits: u64, op: Op) {
        if let Some((e, _)) = &v.failure {
            let kind = match e {
                StoreError::Full { .. } => 0,
                StoreError::Unavailable(_) => 1,
            };
            self.store_errors[kind].fetch_add(1, Relaxed);
        }
        let label = rule.label();
        let counters = {
            let map = self.rules.read().unwrap_or_else(PoisonError::into_inner);
            map.get(domain).and_then(|m| m.get(label)).cloned()
        };
        let c = counters.unwrap_or_else(|| {
            let mut map = self.rules.write().unwrap_or_else(PoisonError::into_inner);
            map.entry(domain.to_owned()).or_default().entry(label.to_owned()).or_default().clone()
        });
        // Not traffic: counted apart, and not in the dashboard's data.
        if matches!(op, Op::Refund | Op::Return { .. }) {
            c.refund.fetch_add(1, Relaxed);
            return;
        }
        if matches!(op, Op::Release { .. } | Op::Extend { .. }) {
            c.release.fetch_add(1, Relaxed);
            return;
        }
        let slot = match (&v.failure, v.decision) {
            (Some((_, FailureMode::Open)), _) => &c.failed_open,
            (Some((_, FailureMode::Closed)), _) => &c.failed_closed,
            (Some((_, FailureMode::Local)), _) => &c.failed_local,
            (None, None) => &c.unlimited,
            (None, Some(d)) if d.allowed => &c.ok,
            (None, Some(_)) if v.shadow => &c.shadow_over_limit,
            (None, Some(_)) => &c.over_limit,
        };
        slot.fetch_add(1, Relaxed);
        if self.dashboard.is_on() {
            let denied = v.failure.is_none() && v.decision.is_some_and(|d| !d.allowed);
            c.watch.record(&self.dashboard, key, hits, denied);
        }
    }

    /// A settle's result in the metrics.
    pub fn settle(&self, result: &Result<Settled, ReservationError>) {
        let i = match result {
            Ok(s) if s.again => 1,
            Ok(s) => {
                for p in s.parts.iter() {
                    let (late, returned) = (p.charged_late, p.returned);
                    self.settled_hits[0].fetch_add(late, Relaxed);
                    self.settled_hits[1].fetch_add(returned, Relaxed);
                }
                0
            }
            Err(ReservationError::Unknown) => 2,
            Err(ReservationError::Conflict { .. }) => 3,
            Err(_) => 4,
        };
        self.settles[i].fetch_add(1, Relaxed);
    }

    /// Append the service's metrics in Prometheus text format.
    pub fn render(&self, out: &mut String) {
        out.push_str("# HELP floodgate_requests_total Rate-limit requests by protocol and result.\n");
        out.push_str("# TYPE floodgate_requests_total counter\n");
        for p in Protocol::ALL {
            for (r, name) in ["ok", "over_limit", "error"].iter().enumerate() {
                let v = self.requests[p as usize][r].load(Relaxed);
                let _ = writeln!(out, "floodgate_requests_total{{protocol=\"{}\",result=\"{name}\"}} {v}", p.as_str());
            }
        }
        out.push_str("# HELP floodgate_request_duration_seconds Time to decide one request.\n");
        out.push_str("# TYPE floodgate_request_duration_seconds histogram\n");
        for p in Protocol::ALL {
            let h = &self.latency[p as usize];
            let mut cum = 0;
            for (i, b) in BUCKETS.iter().enumerate() {
                cum += h.buckets[i].load(Relaxed);
                let _ = writeln!(
                    out,
                    "floodgate_request_duration_seconds_bucket{{protocol=\"{}\",le=\"{b}\"}} {cum}",
                    p.as_str()
                );
            }
            let count = h.count.load(Relaxed);
            let p = p.as_str();
            let _ = writeln!(out, "floodgate_request_duration_seconds_bucket{{protocol=\"{p}\",le=\"+Inf\"}} {count}");
            let sum = h.sum_ns.load(Relaxed) as f64 / 1e9;
            let _ = writeln!(out, "floodgate_request_duration_seconds_sum{{protocol=\"{p}\"}} {sum}");
            let _ = writeln!(out, "floodgate_request_duration_seconds_count{{protocol=\"{p}\"}} {count}");
        }
        out.push_str("# HELP floodgate_settles_total Reservation settles (and cancels) by result.\n");
        out.push_str("# TYPE floodgate_settles_total counter\n");
        for (i, r) in SETTLE_RESULTS.iter().enumerate() {
            let v = self.settles[i].load(Relaxed);
            let _ = writeln!(out, "floodgate_settles_total{{result=\"{r}\"}} {v}");
        }
        out.push_str("# HELP floodgate_settled_hits_total Hits settles charged after the work (late) and gave back (returned).\n");
        out.push_str("# TYPE floodgate_settled_hits_total counter\n");
        for (i, r) in ["late", "returned"].iter().enumerate() {
            let v = self.settled_hits[i].load(Relaxed);
            let _ = writeln!(out, "floodgate_settled_hits_total{{kind=\"{r}\"}} {v}");
        }
        out.push_str("# HELP floodgate_shed_total gRPC requests refused with RESOURCE_EXHAUSTED: too many in flight (--max-in-flight).\n");
        out.push_str("# TYPE floodgate_shed_total counter\n");
        let _ = writeln!(out, "floodgate_shed_total {}", self.shed.load(Relaxed));
        out.push_str(
            "# HELP floodgate_store_errors_total Store calls that failed (the rule's failure policy decided).\n",
        );
        out.push_str("# TYPE floodgate_store_errors_total counter\n");
        for (i, kind) in ["full", "unavailable"].iter().enumerate() {
            let v = self.store_errors[i].load(Relaxed);
            let _ = writeln!(out, "floodgate_store_errors_total{{kind=\"{kind}\"}} {v}");
        }
        out.push_str(
            "# HELP floodgate_decisions_total Decisions by domain, rule (name, else descriptor path) and result.\n",
        );
        out.push_str("# TYPE floodgate_decisions_total counter\n");
        let map = self.rules.read().unwrap_or_else(PoisonError::into_inner);
        let mut domains: Vec<_> = map.iter().collect();
        domains.sort_by(|a, b| a.0.cmp(b.0));
        for (domain, rules) in domains {
            let mut rules: Vec<_> = rules.iter().collect();
            rules.sort_by(|a, b| a.0.cmp(b.0));
            for (rule, c) in rules {
                let results = [
                    ("ok", &c.ok),
                    ("over_limit", &c.over_limit),
                    ("shadow_over_limit", &c.shadow_over_limit),
                    ("unlimited", &c.unlimited),
                    ("failed_open", &c.failed_open),
                    ("failed_closed", &c.failed_closed),
                    ("failed_local", &c.failed_local),
                    ("refund", &c.refund),
                    ("release", &c.release),
                ];
                for (name, v) in results {
                    let _ = writeln!(
                        out,
                        "floodgate_decisions_total{{domain=\"{}\",rule=\"{}\",result=\"{name}\"}} {}",
                        escape(domain),
                        escape(rule),
                        v.load(Relaxed)
                    );
                }
            }
        }
    }
}

/// Each concurrency rule's slots ([`crate::service::Service::leases`]):
/// held now against the limit (not for leases a shared store keeps: only
/// it knows), and acquired, released and expired (its refusals are
/// `floodgate_decisions_total{result="over_limit"}`).
pub fn render_leases(out: &mut String, leases: &[crate::service::RuleLeases]) {
    if leases.is_empty() {
        return;
    }
    // (None: a series this instance does not know.)
    type Pick = fn(&crate::service::RuleLeases) -> Option<u64>;
    let families: [(&str, &str, &str, Pick); 5] = [
        ("floodgate_leases_in_flight", "gauge", "Slots held now by a concurrency limit's leases.", |l| l.in_flight()),
        ("floodgate_leases_limit", "gauge", "A concurrency limit's slots per key (concurrency).", |l| {
            Some(l.concurrency)
        }),
        ("floodgate_leases_acquired_total", "counter", "Slots acquired.", |l| Some(l.stats.acquired)),
        ("floodgate_leases_released_total", "counter", "Slots released by their holders.", |l| Some(l.stats.released)),
        (
            "floodgate_leases_expired_total",
            "counter",
            "Slots whose lease ended while held (a holder that crashed, hung or never released; or its key dropped).",
            |l| Some(l.stats.expired),
        ),
    ];
    for (name, kind, help, pick) in families {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (l, v) in leases.iter().filter_map(|l| Some((l, pick(l)?))) {
            let _ = writeln!(out, "{name}{{domain=\"{}\",rule=\"{}\"}} {v}", escape(&l.domain), escape(&l.rule));
        }
    }
}

/// Append one metric with no labels.
pub fn gauge(out: &mut String, name: &str, kind: &str, help: &str, value: impl std::fmt::Display) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}");
}

/// The per-key store's metrics: entries per (domain, tier), the cache's
/// hits and misses, entries that could not be honoured.
pub fn render_keys(out: &mut String, k: &floodgate_perkey::PerKey) {
    gauge(out, "floodgate_overrides", "gauge", "Per-key entries (formerly runtime overrides), in all.", k.total());
    out.push_str("# HELP floodgate_key_entries Per-key entries by domain and tier (tier=\"\" for entries with their own limits).\n");
    out.push_str("# TYPE floodgate_key_entries gauge\n");
    for (domain, tier, n) in k.counts() {
        let _ = writeln!(out, "floodgate_key_entries{{domain=\"{}\",tier=\"{}\"}} {n}", escape(&domain), escape(&tier));
    }
    let s = k.stats();
    gauge(out, "floodgate_key_cache_hits_total", "counter", "Per-key lookups answered by the cache.", s.hits.get());
    gauge(out, "floodgate_key_cache_misses_total", "counter", "Per-key lookups that read the store.", s.misses.get());
    gauge(out, "floodgate_key_cache_entries", "gauge", "Per-key answers cached (entries and none alike).", k.cached());
    gauge(
        out,
        "floodgate_key_cache_bytes",
        "gauge",
        "Memory the per-key cache holds (keys and answers).",
        k.cache_bytes(),
    );
    gauge(
        out,
        "floodgate_key_read_errors_total",
        "counter",
        "Per-key misses the store failed to answer (the files' rules applied, nothing cached).",
        s.read_errors.load(Relaxed),
    );
    let ix = k.index_status();
    gauge(
        out,
        "floodgate_key_index_reads_total",
        "counter",
        "Per-key misses the on-disk hash index answered (the rest read the database).",
        ix.answered,
    );
    gauge(out, "floodgate_key_index_builds_total", "counter", "Per-key hash indexes built and put in use.", ix.builds);
    gauge(
        out,
        "floodgate_key_index_ready",
        "gauge",
        "1 when a per-key hash index is in use for misses, 0 while misses read the database (none built yet, or too many writes since).",
        u8::from(ix.ready),
    );
    gauge(
        out,
        "floodgate_key_read_batches_total",
        "counter",
        "Batches of per-key misses read from Redis (one HMGET per shard each).",
        k.read_batches(),
    );
    gauge(
        out,
        "floodgate_key_cache_refreshes_total",
        "counter",
        "Per-key answers read again in the background, hit in the last half of their time to live (with Redis).",
        s.refreshed.load(Relaxed),
    );
    gauge(
        out,
        "floodgate_key_notices_total",
        "counter",
        "Per-key change notices taken from Redis (each dropped its keys' cached answers).",
        s.notices.load(Relaxed),
    );
    gauge(
        out,
        "floodgate_key_missed_notices_total",
        "counter",
        "Per-key shards in Redis found changed with no change notice (their cached answers were dropped).",
        s.missed_notices.load(Relaxed),
    );
    gauge(
        out,
        "floodgate_key_subscriptions_total",
        "counter",
        "Times the per-key change notices from Redis were subscribed to, each dropping the cache.",
        s.subscribed.load(Relaxed),
    );
    gauge(
        out,
        "floodgate_key_unknown_tier_total",
        "counter",
        "Decisions whose per-key entry names a tier the rules lack (the files' rules applied).",
        s.unknown_tier.load(Relaxed),
    );
    gauge(
        out,
        "floodgate_key_bad_entries_total",
        "counter",
        "Stored per-key entries that could not be read or no longer validate (the files' rules applied).",
        s.bad_entries.load(Relaxed),
    );
}

/// Escape a label value (backslash, quote, newline).
fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}
