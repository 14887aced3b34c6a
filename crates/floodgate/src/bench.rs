//! `floodgate bench`: a load generator for a running server, over gRPC (RLS
//! `ShouldRateLimit`) or the JSON endpoint.
//!
//! `--concurrency` tasks each keep one request in flight, spread over
//! `--connections` HTTP/2 connections (gRPC). Without `--rate` each task sends
//! the next request when the last reply arrives (max throughput, closed
//! loop). With `--rate` each task sends on a fixed schedule and latency is
//! counted from when a request was *due*, not when it went out, so a server
//! that falls behind shows it (no coordinated omission).

use std::fmt::Write as _;
use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use floodgate_core::parse_duration;
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::json;
use tonic::transport::Channel;

use crate::check::endpoint;
use crate::cli::BenchArgs;
use crate::exit::Failure;

/// Which keys requests carry.
#[derive(Debug, Clone)]
enum Keys {
    Uniform(u64),
    /// Cumulative probabilities of keys 0..n.
    Zipf(Arc<[f64]>),
}

/// Largest key space for zipf (its table costs 8 bytes a key).
const MAX_ZIPF_KEYS: u64 = 10_000_000;

impl Keys {
    fn parse(n: u64, dist: &str) -> Result<Keys, Failure> {
        if n == 0 {
            return Err(Failure::usage("--keys: give at least 1"));
        }
        let s = match dist {
            "uniform" => return Ok(Keys::Uniform(n)),
            "zipf" => 1.0,
            d => match d.strip_prefix("zipf:").and_then(|s| s.parse::<f64>().ok()) {
                Some(s) if s > 0.0 && s.is_finite() => s,
                _ => {
                    return Err(Failure::usage(format!(
                        "--distribution `{dist}`: use uniform, zipf or zipf:S with S > 0"
                    )));
                }
            },
        };
        if n > MAX_ZIPF_KEYS {
            return Err(Failure::usage(format!("--keys {n}: zipf takes at most {MAX_ZIPF_KEYS} keys")));
        }
        let mut cdf: Vec<f64> = Vec::with_capacity(n as usize);
        let mut sum = 0.0;
        for k in 1..=n {
            sum += 1.0 / (k as f64).powf(s);
            cdf.push(sum);
        }
        for c in &mut cdf {
            *c /= sum;
        }
        Ok(Keys::Zipf(cdf.into()))
    }

    fn pick(&self, rng: &mut Rng) -> u64 {
        match self {
            Keys::Uniform(n) => rng.next() % n,
            Keys::Zipf(cdf) => {
                let u = (rng.next() >> 11) as f64 / (1u64 << 53) as f64;
                cdf.partition_point(|&c| c < u) as u64
            }
        }
    }

    fn describe(&self, n: u64, dist: &str) -> String {
        let plural = if n == 1 { "" } else { "s" };
        format!("{n} key{plural} ({dist})")
    }
}

/// splitmix64: fast, good enough to spread keys; no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

#[derive(Default)]
struct Counters {
    allowed: AtomicU64,
    denied: AtomicU64,
    errors: AtomicU64,
}

struct Shared {
    stop: AtomicBool,
    measuring: AtomicBool,
    counters: Counters,
    first_error: std::sync::Mutex<Option<String>>,
}

enum Client_ {
    Grpc(RateLimitServiceClient<Channel>),
    Json(Client<HttpConnector, Full<Bytes>>, String),
}

enum Outcome {
    Allowed,
    Denied,
    Error(String),
}

impl Client_ {
    async fn send(&mut self, domain: &str, key: &str, value: String) -> Outcome {
        match self {
            Client_::Grpc(c) => {
                let req = RateLimitRequest {
                    domain: domain.to_owned(),
                    descriptors: vec![RateLimitDescriptor {
                        entries: vec![Entry { key: key.to_owned(), value }],
                        ..Default::default()
                    }],
                    hits_addend: 1,
                };
                match c.should_rate_limit(req).await {
                    Ok(r) if r.get_ref().overall_code == Code::Ok as i32 => Outcome::Allowed,
                    Ok(_) => Outcome::Denied,
                    Err(s) => Outcome::Error(format!("{:?}: {}", s.code(), s.message())),
                }
            }
            Client_::Json(c, url) => {
                let body =
                    json!({"domain": domain, "descriptors": [{"entries": [{"key": key, "value": value}]}]}).to_string();
                let req = hyper::Request::post(url.as_str())
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from(body)));
                let Ok(req) = req else { return Outcome::Error("cannot build the request".into()) };
                match c.request(req).await {
                    Ok(resp) => {
                        let status = resp.status();
                        // Read the body so the connection can be reused.
                        let _ = resp.into_body().collect().await;
                        match status.as_u16() {
                            200 => Outcome::Allowed,
                            429 => Outcome::Denied,
                            s => Outcome::Error(format!("HTTP {s}")),
                        }
                    }
                    Err(e) => Outcome::Error(e.to_string()),
                }
            }
        }
    }
}

pub(crate) fn run(args: &BenchArgs) -> Result<(), Failure> {
    let duration = parse_duration(&args.duration).map_err(|e| Failure::usage(format!("--duration: {e}")))?;
    let warmup = parse_duration(&args.warmup).map_err(|e| Failure::usage(format!("--warmup: {e}")))?;
    let keys = Keys::parse(args.keys, &args.distribution)?;
    if args.concurrency == 0 || args.connections == 0 {
        return Err(Failure::usage("--concurrency and --connections: give at least 1"));
    }
    if args.rate == Some(0) {
        return Err(Failure::usage("--rate: give at least 1 request per second"));
    }
    if !matches!(args.protocol.as_str(), "grpc" | "json") {
        return Err(Failure::usage(format!("--protocol `{}`: use grpc or json", args.protocol)));
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| Failure::runtime(format!("cannot start the runtime: {e}")))?;
    let report = rt.block_on(bench(args, keys.clone(), warmup, duration))?;
    let out = if args.json { format!("{}\n", report.to_json(args, &keys)) } else { report.to_text(args, &keys) };
    let _ = std::io::stdout().write_all(out.as_bytes());
    Ok(())
}

async fn connect(args: &BenchArgs) -> Result<Vec<Client_>, Failure> {
    let url = endpoint(&args.server);
    if args.protocol == "json" {
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new()).pool_max_idle_per_host(args.concurrency).build(http);
        return Ok(vec![Client_::Json(client, format!("{url}/json"))]);
    }
    let mut clients = Vec::with_capacity(args.connections);
    for _ in 0..args.connections {
        let ch = tonic::transport::Endpoint::from_shared(url.clone())
            .map_err(|e| Failure::usage(format!("--server `{url}`: {e}")))?
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_secs(5))
            .connect()
            .await
            .map_err(|e| Failure::runtime(format!("cannot connect to {url}: {e}")))?;
        clients.push(Client_::Grpc(RateLimitServiceClient::new(ch)));
    }
    Ok(clients)
}

struct Report {
    hist: Histogram<u64>,
    allowed: u64,
    denied: u64,
    errors: u64,
    elapsed: Duration,
    first_error: Option<String>,
}

async fn bench(args: &BenchArgs, keys: Keys, warmup: Duration, duration: Duration) -> Result<Report, Failure> {
    let clients = connect(args).await?;
    let shared = Arc::new(Shared {
        stop: AtomicBool::new(false),
        measuring: AtomicBool::new(warmup.is_zero()),
        counters: Counters::default(),
        first_error: std::sync::Mutex::new(None),
    });
    // Each task's schedule: one request every `concurrency / rate` seconds.
    let interval = args.rate.map(|r| Duration::from_secs_f64(args.concurrency as f64 / r as f64));
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(args.concurrency);
    for i in 0..args.concurrency {
        let mut client = match &clients[i % clients.len()] {
            Client_::Grpc(c) => Client_::Grpc(c.clone()),
            Client_::Json(c, u) => Client_::Json(c.clone(), u.clone()),
        };
        let shared = shared.clone();
        let keys = keys.clone();
        let (domain, key, n) = (args.domain.clone(), args.key.clone(), args.concurrency);
        tasks.push(tokio::spawn(async move {
            let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("valid histogram bounds");
            let mut rng = Rng(0x5EED ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            // Spread the tasks' first sends over one interval.
            let mut due = interval.map(|iv| start + warmup_skew(iv, i, n));
            while !shared.stop.load(Relaxed) {
                let sent_at = match (due, interval) {
                    (Some(d), Some(iv)) => {
                        tokio::time::sleep_until(d.into()).await;
                        due = Some(d + iv);
                        d
                    }
                    _ => Instant::now(),
                };
                let value = keys.pick(&mut rng).to_string();
                let outcome = client.send(&domain, &key, value).await;
                if !shared.measuring.load(Relaxed) {
                    continue;
                }
                let took = u64::try_from(sent_at.elapsed().as_nanos()).unwrap_or(u64::MAX);
                let c = &shared.counters;
                match outcome {
                    Outcome::Allowed => c.allowed.fetch_add(1, Relaxed),
                    Outcome::Denied => c.denied.fetch_add(1, Relaxed),
                    Outcome::Error(e) => {
                        shared.first_error.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get_or_insert(e);
                        c.errors.fetch_add(1, Relaxed)
                    }
                };
                hist.saturating_record(took.max(1));
            }
            hist
        }));
    }
    tokio::time::sleep(warmup).await;
    shared.measuring.store(true, Relaxed);
    let measured_from = Instant::now();
    let mut last = 0;
    let end = measured_from + duration;
    while Instant::now() < end {
        let step = Duration::from_secs(1).min(end.saturating_duration_since(Instant::now()));
        tokio::time::sleep(step).await;
        let c = &shared.counters;
        let done = c.allowed.load(Relaxed) + c.denied.load(Relaxed) + c.errors.load(Relaxed);
        if !args.json {
            eprint!(
                "\r[{:>4.0}s] {:>9.0} req/s, {} errors   ",
                measured_from.elapsed().as_secs_f64(),
                (done - last) as f64 / step.as_secs_f64().max(1e-9),
                c.errors.load(Relaxed)
            );
        }
        last = done;
    }
    shared.stop.store(true, Relaxed);
    let elapsed = measured_from.elapsed();
    if !args.json {
        eprintln!();
    }
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("valid histogram bounds");
    for t in tasks {
        if let Ok(h) = t.await {
            let _ = hist.add(h);
        }
    }
    let c = &shared.counters;
    let first_error = shared.first_error.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
    Ok(Report {
        hist,
        allowed: c.allowed.load(Relaxed),
        denied: c.denied.load(Relaxed),
        errors: c.errors.load(Relaxed),
        elapsed,
        first_error,
    })
}

/// Task `i` of `n` first sends `i / n` of an interval in, so the open-loop
/// schedule is even rather than `n` requests at once.
fn warmup_skew(interval: Duration, i: usize, n: usize) -> Duration {
    interval.mul_f64(i as f64 / n as f64)
}

impl Report {
    fn total(&self) -> u64 {
        self.allowed + self.denied + self.errors
    }

    fn rate(&self) -> f64 {
        self.total() as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    fn ms(&self, q: f64) -> f64 {
        if self.hist.is_empty() { 0.0 } else { self.hist.value_at_quantile(q) as f64 / 1e6 }
    }

    fn to_text(&self, args: &BenchArgs, keys: &Keys) -> String {
        let mut out = String::new();
        let mode = args.rate.map_or("max throughput".to_owned(), |r| format!("open loop at {r}/s"));
        let _ = writeln!(
            out,
            "floodgate bench: {} {}, {} in flight over {} connection(s), {}, {mode}, {:.1}s",
            args.protocol,
            args.server,
            args.concurrency,
            if args.protocol == "json" { args.concurrency } else { args.connections },
            keys.describe(args.keys, &args.distribution),
            self.elapsed.as_secs_f64()
        );
        let _ = writeln!(out, "requests   {:>10}   {:.0}/s", self.total(), self.rate());
        let _ = writeln!(out, "allowed    {:>10}   denied {}   errors {}", self.allowed, self.denied, self.errors);
        let _ = writeln!(
            out,
            "latency    p50 {:.3} ms   p90 {:.3} ms   p99 {:.3} ms   p99.9 {:.3} ms   max {:.3} ms",
            self.ms(0.5),
            self.ms(0.9),
            self.ms(0.99),
            self.ms(0.999),
            self.hist.max() as f64 / 1e6
        );
        if let Some(e) = &self.first_error {
            let _ = writeln!(out, "first error: {e}");
        }
        out
    }

    fn to_json(&self, args: &BenchArgs, keys: &Keys) -> serde_json::Value {
        json!({
            "protocol": args.protocol,
            "server": args.server,
            "concurrency": args.concurrency,
            "connections": args.connections,
            "keys": keys.describe(args.keys, &args.distribution),
            "rate": args.rate,
            "seconds": self.elapsed.as_secs_f64(),
            "requests": self.total(),
            "throughput": self.rate(),
            "allowed": self.allowed,
            "denied": self.denied,
            "errors": self.errors,
            "latency_ms": {
                "p50": self.ms(0.5), "p90": self.ms(0.9), "p99": self.ms(0.99), "p99.9": self.ms(0.999),
                "max": self.hist.max() as f64 / 1e6,
            },
            "first_error": self.first_error,
        })
    }
}
