//! `floodgate bench`: a load generator for a running server, over gRPC (RLS
//! `ShouldRateLimit`) or the JSON endpoint.
//!
//! It is built to take as little of the machine as it can, since on one
//! box it shares the cores with the server it measures: `--threads`
//! sending threads (default 1), each a single-threaded runtime with its own
//! connections, with no cross-thread hop per request (see `client`).
//!
//! Without `--rate`, `--concurrency` loops each keep one request in flight
//! (max throughput, closed loop), latency counted from when each request
//! went out. With `--rate`, a pacing thread releases requests on a fixed
//! schedule (sleeping with the OS's fine-grained timer, not tokio's
//! millisecond wheel), at most `--concurrency` in flight, and latency is
//! counted from when a request was *due*, not when it went out, so a server
//! that falls behind shows it (no coordinated omission). The report also
//! says how late the generator itself got to each request, so a generator
//! that could not keep its own schedule shows that too.

mod client;
mod keys;

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::fmt::Write as _;
use std::io::Write;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use floodgate_core::parse_duration;
use hdrhistogram::Histogram;
use serde_json::json;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};
use tokio::sync::{Notify, oneshot};
use tokio::task::{JoinSet, LocalSet};

use self::client::{Client, Outcome, Protocol, Target};
use self::keys::{Keys, Rng};
use crate::cli::BenchArgs;
use crate::exit::Failure;

/// A failed request's loop waits this long before the next try, so a dead
/// server is not hammered in a tight loop.
const ERROR_PAUSE: Duration = Duration::from_millis(10);
/// Longest the pacing thread sleeps, so it notices the end promptly.
const MAX_PACER_SLEEP: Duration = Duration::from_millis(50);
/// Shortest: at high rates the pacer releases the requests due in each
/// tick together rather than waking (and waking a sending thread) once per
/// request, which on a shared core costs more than the requests. A request
/// can so go out up to one tick (plus the OS timer slack) late; that lag
/// counts in its latency and is reported.
const MIN_PACER_SLEEP: Duration = Duration::from_micros(100);
/// Requests one thread may hold waiting for a free in-flight slot (open
/// loop); more are counted as errors: the server cannot keep up with the
/// rate, and the queue must not grow without bound.
const MAX_WAITING: usize = 65_536;

/// Everything a run needs, checked.
struct Plan {
    target: Target,
    protocol: Protocol,
    threads: usize,
    concurrency: usize,
    connections: usize,
    rate: Option<u64>,
    warmup: Duration,
    duration: Duration,
    timeout: Duration,
    keys: Keys,
    seed: u64,
}

impl Plan {
    fn new(args: &BenchArgs) -> Result<Plan, Failure> {
        let duration = parse_duration(&args.duration).map_err(|e| Failure::usage(format!("--duration: {e}")))?;
        let warmup = parse_duration(&args.warmup).map_err(|e| Failure::usage(format!("--warmup: {e}")))?;
        let timeout = parse_duration(&args.timeout).map_err(|e| Failure::usage(format!("--timeout: {e}")))?;
        if timeout.is_zero() {
            return Err(Failure::usage("--timeout: give a positive duration, e.g. 10s"));
        }
        let keys = Keys::parse(args.keys, &args.distribution)?;
        if args.concurrency == 0 || args.connections == 0 || args.threads == 0 {
            return Err(Failure::usage("--concurrency, --connections and --threads: give at least 1"));
        }
        if args.rate == Some(0) {
            return Err(Failure::usage("--rate: give at least 1 request per second"));
        }
        let protocol = match args.protocol.as_str() {
            "grpc" => Protocol::Grpc,
            "json" => Protocol::Json,
            "budget" => Protocol::Budget,
            "lease" => Protocol::Lease,
            "get" if args.path.starts_with('/') && args.path.parse::<hyper::http::uri::PathAndQuery>().is_ok() => {
                Protocol::Get(args.path.clone())
            }
            "get" => {
                return Err(Failure::usage(format!("--path `{}`: give an absolute path, e.g. /healthz", args.path)));
            }
            p => return Err(Failure::usage(format!("--protocol `{p}`: use grpc, json, get, budget or lease"))),
        };
        let mut target = Target::parse(&args.server, &args.domain, &args.key)?;
        target.refund = args.refund;
        if args.refund && matches!(protocol, Protocol::Get(_) | Protocol::Budget | Protocol::Lease) {
            return Err(Failure::usage("--refund sends is_negative_hits: use --protocol grpc or json".to_owned()));
        }
        // Every thread gets at least one request in flight and, over gRPC,
        // one connection.
        let mut threads = args.threads.min(args.concurrency);
        if matches!(protocol, Protocol::Grpc | Protocol::Budget | Protocol::Lease) {
            threads = threads.min(args.connections);
        }
        Ok(Plan {
            target,
            protocol,
            threads,
            concurrency: args.concurrency,
            connections: args.connections,
            rate: args.rate,
            warmup,
            duration,
            timeout,
            keys,
            seed: args.seed,
        })
    }

    /// Thread `t`'s share of `total`, spread as evenly as it goes.
    fn share(&self, total: usize, t: usize) -> usize {
        total / self.threads + usize::from(t < total % self.threads)
    }
}

pub(crate) fn run(args: &BenchArgs) -> Result<(), Failure> {
    let plan = Arc::new(Plan::new(args)?);
    let report = drive(&plan, !args.json)?;
    let out = if args.json { format!("{}\n", report.to_json(args, &plan)) } else { report.to_text(args, &plan) };
    let _ = std::io::stdout().write_all(out.as_bytes());
    Ok(())
}

#[derive(Default)]
struct Counters {
    allowed: AtomicU64,
    denied: AtomicU64,
    shed: AtomicU64,
    errors: AtomicU64,
}

impl Counters {
    fn total(&self) -> u64 {
        self.allowed.load(Relaxed) + self.denied.load(Relaxed) + self.shed.load(Relaxed) + self.errors.load(Relaxed)
    }
}

#[derive(Default)]
struct Shared {
    stop: AtomicBool,
    measuring: AtomicBool,
    counters: Counters,
    first_error: std::sync::Mutex<Option<String>>,
}

impl Shared {
    fn count(&self, outcome: Outcome) {
        let c = &self.counters;
        match outcome {
            Outcome::Allowed => c.allowed.fetch_add(1, Relaxed),
            Outcome::Denied => c.denied.fetch_add(1, Relaxed),
            Outcome::Shed => c.shed.fetch_add(1, Relaxed),
            Outcome::Error(e) => {
                self.first_error.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get_or_insert(e);
                c.errors.fetch_add(1, Relaxed)
            }
        };
    }
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("valid histogram bounds")
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX).max(1)
}

/// What one sending thread measured, in nanoseconds.
struct Measured {
    /// From when each request was due (open loop) or sent (closed loop)
    /// to its reply.
    latency: Histogram<u64>,
    /// How late each request reached its sending thread after it was due,
    /// before any wait for a free slot (open loop).
    lag: Histogram<u64>,
    /// From when each request went out to its reply (open loop): the
    /// server and the network alone, without the generator's lag or any
    /// wait for a free slot.
    service: Histogram<u64>,
}

impl Measured {
    fn new() -> Self {
        Measured { latency: histogram(), lag: histogram(), service: histogram() }
    }

    fn add(&mut self, other: &Measured) {
        let _ = self.latency.add(&other.latency);
        let _ = self.lag.add(&other.lag);
        let _ = self.service.add(&other.service);
    }
}

/// A request the pacer released: when it was due, and its number on the
/// thread it was given to.
struct Due {
    at: Instant,
    n: usize,
}

/// Start the threads, wait until every one is connected, run, report.
fn drive(plan: &Arc<Plan>, progress: bool) -> Result<Report, Failure> {
    let shared = Arc::new(Shared::default());
    let (ready_tx, ready_rx) = mpsc::channel();
    let (mut workers, mut gos, mut feeds) = (Vec::new(), Vec::new(), Vec::new());
    for t in 0..plan.threads {
        let (go_tx, go_rx) = oneshot::channel();
        let (feed_tx, feed_rx) = tokio::sync::mpsc::unbounded_channel();
        gos.push(go_tx);
        feeds.push(feed_tx);
        let (plan, shared, ready) = (plan.clone(), shared.clone(), ready_tx.clone());
        let feed = plan.rate.map(|_| feed_rx);
        let spawned = std::thread::Builder::new()
            .name(format!("bench-{t}"))
            .spawn(move || sender_thread(plan, &shared, t, &ready, go_rx, feed));
        workers.push(spawned.map_err(|e| Failure::runtime(format!("cannot start a sending thread: {e}")))?);
    }
    drop(ready_tx);
    let mut failure = None;
    for _ in 0..plan.threads {
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                failure.get_or_insert(e);
            }
            Err(_) => {
                failure.get_or_insert(Failure::runtime("a sending thread stopped before it connected"));
            }
        }
    }
    if let Some(failure) = failure {
        drop((gos, feeds));
        for w in workers {
            let _ = w.join();
        }
        return Err(failure);
    }
    let start = Instant::now();
    for go in gos {
        let _ = go.send(start);
    }
    let pacer = match plan.rate {
        Some(rate) => {
            let shared = shared.clone();
            let spawned = std::thread::Builder::new()
                .name("bench-pacer".into())
                .spawn(move || pace(rate, start, &shared, &feeds));
            Some(spawned.map_err(|e| Failure::runtime(format!("cannot start the pacing thread: {e}")))?)
        }
        None => {
            drop(feeds);
            None
        }
    };
    std::thread::sleep(plan.warmup);
    shared.measuring.store(true, Relaxed);
    let measured_from = Instant::now();
    let end = measured_from + plan.duration;
    let mut last = 0;
    loop {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        let step = Duration::from_secs(1).min(left);
        std::thread::sleep(step);
        let done = shared.counters.total();
        if progress {
            eprint!(
                "\r[{:>4.0}s] {:>9.0} req/s, {} errors   ",
                measured_from.elapsed().as_secs_f64(),
                (done - last) as f64 / step.as_secs_f64().max(1e-9),
                shared.counters.errors.load(Relaxed)
            );
        }
        last = done;
    }
    shared.stop.store(true, Relaxed);
    let elapsed = measured_from.elapsed();
    if progress {
        eprintln!();
    }
    if let Some(p) = pacer {
        let _ = p.join();
    }
    let mut measured = Measured::new();
    for w in workers {
        if let Ok(m) = w.join() {
            measured.add(&m);
        }
    }
    let c = &shared.counters;
    let first_error = shared.first_error.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
    Ok(Report {
        measured,
        open_loop: plan.rate.is_some(),
        allowed: c.allowed.load(Relaxed),
        denied: c.denied.load(Relaxed),
        shed: c.shed.load(Relaxed),
        errors: c.errors.load(Relaxed),
        elapsed,
        first_error,
    })
}

/// Release requests at `rate` per second from `start`, round-robin over
/// the sending threads, until told to stop. `thread::sleep` wakes within
/// the OS timer slack (~50 us on Linux), where tokio's timer wheel would
/// round every wait up to the next millisecond and count that as latency;
/// at high rates one wake releases every request due since the last.
fn pace(rate: u64, start: Instant, shared: &Shared, feeds: &[UnboundedSender<Vec<Due>>]) {
    let per_ns = 1e9 / rate as f64;
    let due = |n: u64| start + Duration::from_nanos((n as f64 * per_ns) as u64);
    let threads = feeds.len().max(1) as u64;
    let mut batches: Vec<Vec<Due>> = feeds.iter().map(|_| Vec::new()).collect();
    let mut n = 0u64;
    while !shared.stop.load(Relaxed) {
        let now = Instant::now();
        while due(n) <= now {
            let t = (n % threads) as usize;
            batches[t].push(Due { at: due(n), n: (n / threads) as usize });
            n += 1;
        }
        for (feed, batch) in feeds.iter().zip(&mut batches) {
            if !batch.is_empty() && feed.send(std::mem::take(batch)).is_err() {
                return;
            }
        }
        let wait = due(n).saturating_duration_since(Instant::now());
        std::thread::sleep(wait.clamp(MIN_PACER_SLEEP, MAX_PACER_SLEEP));
    }
}

/// One sending thread: its own runtime and connections; reports readiness
/// (or why it cannot connect), waits for the start, then sends until the
/// end (closed loop) or until the pacer stops feeding it (open loop).
fn sender_thread(
    plan: Arc<Plan>,
    shared: &Arc<Shared>,
    t: usize,
    ready: &mpsc::Sender<Result<(), Failure>>,
    go: oneshot::Receiver<Instant>,
    feed: Option<UnboundedReceiver<Vec<Due>>>,
) -> Measured {
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            let _ = ready.send(Err(Failure::runtime(format!("cannot start the runtime: {e}"))));
            return Measured::new();
        }
    };
    let in_flight = plan.share(plan.concurrency, t);
    LocalSet::new().block_on(&rt, async move {
        let connections = plan.share(plan.connections, t);
        let client = match Client::connect(&plan.target, &plan.protocol, connections, in_flight).await {
            Ok(client) => client,
            Err(e) => {
                let _ = ready.send(Err(e));
                return Measured::new();
            }
        };
        let _ = ready.send(Ok(()));
        if go.await.is_err() {
            return Measured::new();
        }
        let sender = Rc::new(Sender {
            plan: plan.clone(),
            shared: shared.clone(),
            client,
            rng: RefCell::new(Rng(plan.seed ^ (t as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15))),
            measured: RefCell::new(Measured::new()),
            queue: RefCell::new(VecDeque::new()),
            queued: Notify::new(),
            fed: Cell::new(false),
        });
        let mut tasks = JoinSet::new();
        let Some(mut feed) = feed else {
            for slot in 0..in_flight {
                tasks.spawn_local(closed_loop(sender.clone(), slot));
            }
            while tasks.join_next().await.is_some() {}
            return sender.measured.replace(Measured::new());
        };
        // Open loop: `in_flight` loops take due requests from the queue.
        for _ in 0..in_flight {
            tasks.spawn_local(scheduled_loop(sender.clone()));
        }
        while let Some(batch) = feed.recv().await {
            let measuring = shared.measuring.load(Relaxed);
            for due in batch {
                if measuring {
                    sender.measured.borrow_mut().lag.saturating_record(nanos(due.at.elapsed()));
                }
                if sender.queue.borrow().len() >= MAX_WAITING {
                    let e = format!(
                        "over {MAX_WAITING} requests waiting for a free slot: the server cannot keep up with --rate"
                    );
                    // The generator's own queue overflowed: counted, but it
                    // has no latency to add (nothing was sent).
                    if measuring {
                        sender.shared.count(Outcome::Error(e));
                    }
                    continue;
                }
                sender.queue.borrow_mut().push_back(due);
                sender.queued.notify_one();
            }
        }
        sender.fed.set(true);
        sender.queued.notify_waiters();
        while tasks.join_next().await.is_some() {}
        sender.measured.replace(Measured::new())
    })
}

/// One thread's sending state, shared by its tasks (single-threaded).
struct Sender {
    plan: Arc<Plan>,
    shared: Arc<Shared>,
    client: Client,
    rng: RefCell<Rng>,
    measured: RefCell<Measured>,
    /// Released requests no loop has taken yet (open loop).
    queue: RefCell<VecDeque<Due>>,
    queued: Notify,
    /// The pacer has released its last request.
    fed: Cell<bool>,
}

impl Sender {
    /// Send request `n` now; its latency counts from `due` if it had a
    /// schedule, else from now. Whether it failed.
    async fn send(&self, n: usize, due: Option<Instant>) -> bool {
        let value = self.plan.keys.pick(&mut self.rng.borrow_mut()).to_string();
        let sent = Instant::now();
        let reply = tokio::time::timeout(self.plan.timeout, self.client.send(&self.plan.target, n, value)).await;
        let outcome = reply.unwrap_or_else(|_| Outcome::Error(format!("no reply within {:?}", self.plan.timeout)));
        let failed = matches!(outcome, Outcome::Error(_) | Outcome::Shed);
        if due.is_some() && self.shared.measuring.load(Relaxed) {
            self.measured.borrow_mut().service.saturating_record(nanos(sent.elapsed()));
        }
        self.record(due.unwrap_or(sent), outcome);
        failed
    }

    /// Count `outcome` and its latency from `from`, once measuring.
    fn record(&self, from: Instant, outcome: Outcome) {
        if !self.shared.measuring.load(Relaxed) {
            return;
        }
        // Latency is of the answers (decisions and errors); a shed request
        // was not served, and is only counted.
        if !matches!(outcome, Outcome::Shed) {
            self.measured.borrow_mut().latency.saturating_record(nanos(from.elapsed()));
        }
        self.shared.count(outcome);
    }
}

/// Keep one request in flight on slot `slot` until the end.
async fn closed_loop(sender: Rc<Sender>, slot: usize) {
    while !sender.shared.stop.load(Relaxed) {
        if sender.send(slot, None).await {
            tokio::time::sleep(ERROR_PAUSE).await;
        }
    }
}

/// One of the open loop's in-flight slots: send released requests, oldest
/// first, until the pacer is done and the queue is empty. The generator's
/// own lag was counted when the request reached this thread; waiting here
/// for a free slot is the server's doing, and both count in the latency.
async fn scheduled_loop(sender: Rc<Sender>) {
    loop {
        let next = sender.queue.borrow_mut().pop_front();
        match next {
            Some(due) => {
                sender.send(due.n, Some(due.at)).await;
            }
            None if sender.fed.get() => return,
            None => sender.queued.notified().await,
        }
    }
}

struct Report {
    measured: Measured,
    open_loop: bool,
    allowed: u64,
    denied: u64,
    shed: u64,
    errors: u64,
    elapsed: Duration,
    first_error: Option<String>,
}

/// Quantile `q` of `h` in milliseconds (0 when empty).
fn ms(h: &Histogram<u64>, q: f64) -> f64 {
    if h.is_empty() { 0.0 } else { h.value_at_quantile(q) as f64 / 1e6 }
}

fn max_ms(h: &Histogram<u64>) -> f64 {
    h.max() as f64 / 1e6
}

impl Report {
    fn total(&self) -> u64 {
        self.allowed + self.denied + self.shed + self.errors
    }

    fn rate(&self) -> f64 {
        self.total() as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    fn to_text(&self, args: &BenchArgs, plan: &Plan) -> String {
        let mut out = String::new();
        let mode = args.rate.map_or("max throughput".to_owned(), |r| format!("open loop at {r}/s"));
        let _ = writeln!(
            out,
            "floodgate bench: {} {}, {} in flight over {} connection(s), {} sending thread(s), {}, {mode}, {:.1}s",
            args.protocol,
            args.server,
            args.concurrency,
            if plan.protocol == Protocol::Grpc { args.connections } else { args.concurrency },
            plan.threads,
            plan.keys.describe(args.keys, &args.distribution),
            self.elapsed.as_secs_f64()
        );
        let decided = (self.allowed + self.denied) as f64 / self.elapsed.as_secs_f64().max(1e-9);
        let _ = writeln!(out, "requests   {:>10}   {:.0}/s   ({decided:.0}/s decided)", self.total(), self.rate());
        let _ = writeln!(
            out,
            "allowed    {:>10}   denied {}   shed {}   errors {}",
            self.allowed, self.denied, self.shed, self.errors
        );
        let h = &self.measured.latency;
        let _ = writeln!(
            out,
            "latency    p50 {:.3} ms   p90 {:.3} ms   p99 {:.3} ms   p99.9 {:.3} ms   max {:.3} ms{}",
            ms(h, 0.5),
            ms(h, 0.9),
            ms(h, 0.99),
            ms(h, 0.999),
            max_ms(h),
            if self.open_loop { " (from when due)" } else { "" }
        );
        if self.open_loop {
            let (lag, service) = (&self.measured.lag, &self.measured.service);
            let _ = writeln!(
                out,
                "gen. lag   p50 {:.3} ms   p99 {:.3} ms   max {:.3} ms (how late the generator got to a request; included above)",
                ms(lag, 0.5),
                ms(lag, 0.99),
                max_ms(lag)
            );
            let _ = writeln!(
                out,
                "service    p50 {:.3} ms   p90 {:.3} ms   p99 {:.3} ms   p99.9 {:.3} ms   max {:.3} ms (from when sent)",
                ms(service, 0.5),
                ms(service, 0.9),
                ms(service, 0.99),
                ms(service, 0.999),
                max_ms(service)
            );
        }
        if let Some(e) = &self.first_error {
            let _ = writeln!(out, "first error: {e}");
        }
        out
    }

    fn to_json(&self, args: &BenchArgs, plan: &Plan) -> serde_json::Value {
        let (h, lag, service) = (&self.measured.latency, &self.measured.lag, &self.measured.service);
        json!({
            "protocol": args.protocol,
            "server": args.server,
            "concurrency": args.concurrency,
            "connections": args.connections,
            "threads": plan.threads,
            "keys": plan.keys.describe(args.keys, &args.distribution),
            "rate": args.rate,
            "seconds": self.elapsed.as_secs_f64(),
            "requests": self.total(),
            "throughput": self.rate(),
            "decided_per_second": (self.allowed + self.denied) as f64 / self.elapsed.as_secs_f64().max(1e-9),
            "allowed": self.allowed,
            "denied": self.denied,
            "shed": self.shed,
            "errors": self.errors,
            "latency_ms": {
                "p50": ms(h, 0.5), "p90": ms(h, 0.9), "p99": ms(h, 0.99), "p99.9": ms(h, 0.999),
                "max": max_ms(h),
            },
            "generator_lag_ms": self.open_loop.then(|| json!({
                "p50": ms(lag, 0.5), "p99": ms(lag, 0.99), "max": max_ms(lag),
            })),
            "service_latency_ms": self.open_loop.then(|| json!({
                "p50": ms(service, 0.5), "p90": ms(service, 0.9), "p99": ms(service, 0.99),
                "p99.9": ms(service, 0.999), "max": max_ms(service),
            })),
            "first_error": self.first_error,
        })
    }
}
