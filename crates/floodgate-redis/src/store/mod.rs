//! [`RedisStore`]: the [`Store`] over one Redis server or a Redis Cluster. Here
//! its settings, connections, circuit breaker and the `Store` impl;
//! deciding and the per-thread batch queues in `batch`; plain commands and
//! the listing of keys in `raw`; the typed commands other crates use for
//! what they keep in Redis in `commands`.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use floodgate_core::reservation::{ReservationError, ReservationId, Settled};
use floodgate_core::{Check, Decision, Limit, Store, StoreError};

use crate::breaker::{Breaker, PROBE_EVERY};
use crate::conn::{self, Live, Packed};
use crate::denied::DeniedCache;
use crate::global::RegionCtx;
use crate::script::GlobalArgs;
use crate::target::Target;

mod batch;
mod commands;
mod raw;
mod reserve;

pub use commands::{Script, Via};

use batch::{Lane, MAX_LANES};

/// Settings of a [`RedisStore`].
#[derive(Debug, Clone)]
pub struct RedisConfig {
    /// The server or cluster.
    pub target: Target,
    /// The longest a decision (or a ping) waits for Redis, connecting
    /// included; then the rule's failure policy decides. Default 100 ms.
    pub timeout: Duration,
    /// Prepended to every key. Default `fg:`.
    pub key_prefix: String,
    /// Whose clock decides: Redis `TIME` (the default; instances with skewed
    /// clocks agree) or this process's.
    pub clock: ClockSource,
    /// Answer a request for one hit on a key known to be over its limit
    /// until a known time locally, without a Redis call. Default on.
    pub cache_denials: bool,
}

impl RedisConfig {
    /// Defaults for `target`.
    pub fn new(target: Target) -> Self {
        Self {
            target,
            timeout: Duration::from_millis(100),
            key_prefix: "fg:".to_owned(),
            clock: ClockSource::Redis,
            cache_denials: true,
        }
    }
}

/// Whose clock the scripts use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClockSource {
    /// The Redis server's `TIME`, read inside the script.
    Redis,
    /// This process's system clock, sent with each call.
    Local,
}

/// Counters of what the store did, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RedisStats {
    /// Script calls made.
    pub calls: u64,
    /// Calls that failed: timed out, lost the connection, or errored.
    pub errors: u64,
    /// Of those, the ones that timed out.
    pub timeouts: u64,
    /// Decisions refused at once because the circuit breaker was open.
    pub rejected_open: u64,
    /// Denials answered from the local over-limit cache.
    pub cached_denials: u64,
    /// Times the circuit breaker opened.
    pub breaker_trips: u64,
    /// Whether the breaker is open now.
    pub breaker_open: bool,
    /// Refund calls made after a denial in another slot.
    pub cross_slot_refunds: u64,
    /// Calls sent again on a fresh connection because not one byte of them
    /// had gone out when their connection failed.
    pub resent: u64,
    /// Connections replaced before use: closed by the server, or made
    /// before the breaker last opened.
    pub replaced: u64,
}

/// Checks sent in one call at most, over every request batched into it.
const BATCH_CHECKS: usize = 256;

/// Batched calls in flight at once on one server: while they are, the
/// requests that arrive wait for the next call.
const BATCHES_IN_FLIGHT: usize = 2;

/// The Redis and Redis Cluster store.
///
/// * One round trip per decision: every limit of a request that lands in one
///   hash slot is decided by one `EVALSHA` of the composed script (`EVAL`
///   once per server after a restart: `NOSCRIPT`), atomically, all or
///   nothing. Limits in several slots (Redis Cluster) go concurrently; when
///   one slot denies, the others are refunded (a second trip, on that path
///   only).
/// * On one server, requests are batched, per deciding thread (each with
///   its own queue and connection, so on per-core runtimes a request never
///   crosses threads): at most `BATCHES_IN_FLIGHT` calls are in flight,
///   and the requests that arrive meanwhile go together in the next call
///   (up to `BATCH_CHECKS` checks), each still all or nothing on its own. An idle store sends a request at once, so
///   batching adds no wait; under load it saves Redis the per-call cost
///   (running the script, reading `TIME`) and this process the per-command
///   one. A Redis Cluster cannot batch: the keys of one call must share a
///   hash slot.
/// * Every call is bounded by [`RedisConfig::timeout`]. After three
///   failures in a row a circuit breaker opens: decisions fail at once (the
///   rule's failure policy applies) while a background probe pings Redis
///   every 500 ms (no traffic needed); the first success closes it.
/// * Connections stay exact across a Redis restart: a single server's
///   connection is dropped on an error or a timeout; one the server closed
///   (a killed Redis closes them all), or made before the breaker last
///   opened, is replaced before a call is handed to it, on every thread.
///   A call that failed with not one byte sent (the script provably did not
///   run) goes once more on a fresh connection, within the same timeout; a
///   call that may have reached Redis is never sent twice.
/// * A key denied for one hit is answered locally until its retry time.
///
/// Cheap to clone (shared state behind an `Arc`).
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

struct Inner {
    config: RedisConfig,
    client: Client,
    conn: ConnSlot,
    /// Long administrative calls (bulk writes, listings), kept off `conn`
    /// so that they never queue ahead of shorter calls.
    bulk: ConnSlot,
    /// A single server's batch queues: one per thread that decides, each
    /// with its own connection.
    lanes: Mutex<Vec<Lane>>,
    /// Plain commands' connections, one per thread that sends them
    /// ([`RedisStore::raw_here`]).
    here: Mutex<Vec<(std::thread::ThreadId, Arc<ConnSlot>)>>,
    connecting: tokio::sync::Mutex<()>,
    breaker: Breaker,
    /// The parts of the reservations this instance made.
    reservations: reserve::Remembered,
    /// What this instance's calls did to concurrency limits' slots.
    leases: crate::script::LeaseAccounts,
    denied: DeniedCache,
    clock: floodgate_core::SystemClock,
    calls: AtomicU64,
    errors: AtomicU64,
    timeouts: AtomicU64,
    rejected_open: AtomicU64,
    cached_denials: AtomicU64,
    cross_slot_refunds: AtomicU64,
    resent: AtomicU64,
    replaced: AtomicU64,
    /// The connection epoch: starts anew when the breaker opens, and a
    /// single server's connections of an older epoch are replaced.
    epoch: AtomicU64,
    /// Whether the background probe runs.
    probing: std::sync::atomic::AtomicBool,
    /// When this store is a region's: how it decides `global` checks.
    region: Option<RegionCtx>,
}

enum Client {
    Single(redis::Client),
    Cluster(Box<redis::cluster::ClusterClient>),
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore").field("target", &self.inner.config.target.to_string()).finish_non_exhaustive()
    }
}

/// A failure of one call, before it becomes a [`StoreError`].
#[derive(Clone)]
enum CallError {
    Open,
    Timeout,
    Redis(redis::RedisError),
    Reply(String),
}

impl CallError {
    fn store_error(&self, timeout: Duration) -> StoreError {
        StoreError::Unavailable(match self {
            Self::Open => "Redis is failing (circuit breaker open)".to_owned(),
            Self::Timeout => format!("Redis did not answer within {timeout:?}"),
            Self::Redis(e) => format!("Redis: {e}"),
            Self::Reply(e) => format!("Redis script: {e}"),
        })
    }
}

impl RedisStore {
    /// A store for `config`. Connects lazily: the first call (or
    /// [`Store::ping`]) connects, so a server that starts later is fine.
    pub fn new(config: RedisConfig) -> Result<Self, redis::RedisError> {
        Self::build(config, None)
    }

    /// A region's store for `config`: `global` checks are decided over
    /// every region's counts, as `region` says (see [`crate::RedisRegion`],
    /// which builds its store so).
    pub fn regional(config: RedisConfig, region: RegionCtx) -> Result<Self, redis::RedisError> {
        Self::build(config, Some(region))
    }

    fn build(config: RedisConfig, region: Option<RegionCtx>) -> Result<Self, redis::RedisError> {
        let client = match &config.target {
            Target::Single(url) => Client::Single(redis::Client::open(url.as_str())?),
            Target::Cluster(urls) => Client::Cluster(Box::new(
                redis::cluster::ClusterClientBuilder::new(urls.iter().map(String::as_str))
                    .connection_timeout(config.timeout)
                    .response_timeout(config.timeout)
                    .retries(2)
                    .build()?,
            )),
        };
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                client,
                conn: Mutex::new(None),
                bulk: Mutex::new(None),
                lanes: Mutex::new(Vec::new()),
                here: Mutex::new(Vec::new()),
                connecting: tokio::sync::Mutex::new(()),
                breaker: Breaker::new(),
                reservations: reserve::Remembered::default(),
                leases: crate::script::LeaseAccounts::default(),
                denied: DeniedCache::new(),
                clock: floodgate_core::SystemClock::new(),
                calls: AtomicU64::new(0),
                errors: AtomicU64::new(0),
                timeouts: AtomicU64::new(0),
                rejected_open: AtomicU64::new(0),
                cached_denials: AtomicU64::new(0),
                cross_slot_refunds: AtomicU64::new(0),
                resent: AtomicU64::new(0),
                replaced: AtomicU64::new(0),
                epoch: AtomicU64::new(0),
                probing: std::sync::atomic::AtomicBool::new(false),
                region,
            }),
        })
    }

    /// The settings.
    pub fn config(&self) -> &RedisConfig {
        &self.inner.config
    }

    /// What this instance's calls did to each concurrency limit's slots,
    /// by limit fingerprint: acquired, released by their holders, and
    /// found expired as their keys were met (counts of this instance's
    /// calls: add the instances' up). `held` is this instance's view
    /// only; the slots held now are in Redis.
    pub fn lease_stats(&self) -> Vec<(u32, floodgate_core::store::memory::LeaseStats)> {
        self.inner.leases.all()
    }

    /// What the store did so far.
    pub fn stats(&self) -> RedisStats {
        let i = &self.inner;
        RedisStats {
            calls: i.calls.load(Ordering::Relaxed),
            errors: i.errors.load(Ordering::Relaxed),
            timeouts: i.timeouts.load(Ordering::Relaxed),
            rejected_open: i.rejected_open.load(Ordering::Relaxed),
            cached_denials: i.cached_denials.load(Ordering::Relaxed),
            breaker_trips: i.breaker.trips(),
            breaker_open: i.breaker.is_open(),
            cross_slot_refunds: i.cross_slot_refunds.load(Ordering::Relaxed),
            resent: i.resent.load(Ordering::Relaxed),
            replaced: i.replaced.load(Ordering::Relaxed),
        }
    }

    /// [`Store::apply_all`] at a given time (microseconds since the Unix
    /// epoch) instead of the configured clock: for tests and replays.
    pub async fn apply_all_at(&self, checks: &[Check<'_>], now_us: u64, out: &mut Vec<Result<Decision, StoreError>>) {
        self.decide(checks, Some(now_us), out).await;
    }

    /// The slot's connection, made when there is none and replaced when it
    /// is dead or from before the breaker last opened (nothing was sent on
    /// it, so nothing is lost).
    async fn connection(&self, slot: &ConnSlot) -> Result<Live, redis::RedisError> {
        let epoch = self.inner.epoch.load(Ordering::Acquire);
        if let Some(c) = self.usable(slot, epoch) {
            return Ok(c);
        }
        // One connect at a time; the others wait for it (bounded by the
        // call's timeout) instead of each opening a socket.
        let _one = self.inner.connecting.lock().await;
        if let Some(c) = self.usable(slot, epoch) {
            return Ok(c);
        }
        let live = match &self.inner.client {
            Client::Single(c) => conn::connect_single(c, epoch).await?,
            Client::Cluster(c) => Live::cluster(c.get_async_connection().await?, epoch),
        };
        *slot.lock().unwrap_or_else(PoisonError::into_inner) = Some(live.clone());
        Ok(live)
    }

    /// The slot's connection if it may be used in `epoch`; a stale one is
    /// taken out (and counted).
    fn usable(&self, slot: &ConnSlot, epoch: u64) -> Option<Live> {
        let mut held = slot.lock().unwrap_or_else(PoisonError::into_inner);
        match &*held {
            Some(c) if c.usable(epoch) => Some(c.clone()),
            Some(_) => {
                *held = None;
                self.inner.replaced.fetch_add(1, Ordering::Relaxed);
                None
            }
            None => None,
        }
    }

    /// Forget a single server's connection after a fault, so the next call
    /// makes a new one; only if the slot still holds `failed` (another call
    /// may have replaced it already). A cluster connection is kept: it
    /// reconnects to its nodes and refreshes the topology itself.
    fn drop_connection(&self, slot: &ConnSlot, failed: Option<&Live>) {
        if matches!(self.inner.client, Client::Single(_)) {
            let mut held = slot.lock().unwrap_or_else(PoisonError::into_inner);
            if failed.is_none_or(|f| held.as_ref().is_some_and(|h| h.same(f))) {
                *held = None;
            }
        }
    }

    /// Send `what` (then `eval` on `NOSCRIPT`) on the slot's connection.
    /// When it fails with not one byte sent, once more on a fresh
    /// connection. Gives back the connection used, for
    /// [`RedisStore::drop_connection`].
    async fn send(
        &self,
        what: Packed<'_>,
        eval: Option<&(dyn Fn() -> redis::Cmd + Sync)>,
        slot: &ConnSlot,
        at: Option<u16>,
    ) -> (Option<Live>, redis::RedisResult<redis::Value>) {
        let mut resent = false;
        loop {
            let live = match self.connection(slot).await {
                Ok(c) => c,
                Err(e) => return (None, Err(e)),
            };
            let before = live.written();
            let mut c = live.conn.clone();
            let r = match c.query(what, at).await {
                Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => match eval {
                    // A restarted (or new) server: EVAL loads the script.
                    Some(eval) => c.query(Packed::One(&eval()), at).await,
                    None => Err(e),
                },
                r => r,
            };
            match r {
                Err(e) if !resent && live.unsent(before, &e) => {
                    // The script did not run: the same call, on a new socket.
                    resent = true;
                    self.inner.resent.fetch_add(1, Ordering::Relaxed);
                    self.drop_connection(slot, Some(&live));
                }
                r => return (Some(live), r),
            }
        }
    }

    /// One command through the breaker, bounded by the timeout.
    /// `eval` builds the command to send instead on `NOSCRIPT` (only then:
    /// it carries the whole script).
    /// `gated`: ask the breaker first (a batch does not: each of its
    /// requests asked when it was queued). `deadline`: when to give up
    /// (`None`: the configured timeout from now). `at`: on a cluster, the
    /// primary of this hash slot instead of the command's keys' (`SCAN`).
    async fn call(
        &self,
        what: Packed<'_>,
        eval: Option<&(dyn Fn() -> redis::Cmd + Sync)>,
        gated: bool,
        deadline: Option<tokio::time::Instant>,
        slot: &ConnSlot,
        at: Option<u16>,
    ) -> Result<redis::Value, CallError> {
        let i = &self.inner;
        if gated && !self.permit() {
            return Err(CallError::Open);
        }
        i.calls.fetch_add(1, Ordering::Relaxed);
        let deadline = deadline.unwrap_or_else(|| tokio::time::Instant::now() + i.config.timeout);
        // The connection used, once known: a timeout drops the slot's.
        let (used, result) = match tokio::time::timeout_at(deadline, self.send(what, eval, slot, at)).await {
            Ok((used, Ok(v))) => (used, Ok(v)),
            Ok((used, Err(e))) => (used, Err(CallError::Redis(e))),
            Err(_) => (None, Err(CallError::Timeout)),
        };
        match &result {
            Ok(_) => i.breaker.success(),
            Err(e) => {
                i.errors.fetch_add(1, Ordering::Relaxed);
                if matches!(e, CallError::Timeout) {
                    i.timeouts.fetch_add(1, Ordering::Relaxed);
                }
                // A script error is a reply: the connection is fine.
                let connection_fault = match e {
                    CallError::Redis(e) => e.kind() != redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError),
                    _ => true,
                };
                if connection_fault {
                    self.failed();
                    self.drop_connection(slot, used.as_ref());
                }
            }
        }
        result
    }

    /// One script command (`EVALSHA`, then `eval()` on `NOSCRIPT`) through
    /// the breaker and the timeout, on the shared connection: a region's
    /// merge, read and ack calls.
    pub(crate) async fn script_call(
        &self,
        cmd: &redis::Cmd,
        eval: &(dyn Fn() -> redis::Cmd + Sync),
    ) -> Result<redis::Value, StoreError> {
        self.call(Packed::One(cmd), Some(eval), true, None, &self.inner.conn, None)
            .await
            .map_err(|e| e.store_error(self.inner.config.timeout))
    }

    /// The script's global arguments for check `c`, when this store is a
    /// region's and the check is global.
    fn global_args(&self, c: &Check<'_>, now: Option<u64>) -> Option<(String, GlobalArgs)> {
        let now = || now.unwrap_or_else(|| self.local_now_us());
        self.inner.region.as_ref()?.args(&self.inner.config.key_prefix, c, now)
    }

    /// This process's clock, µs since the epoch (what a region's caps and
    /// the sync's records are read against; the scripts use Redis's).
    pub(crate) fn local_now_us(&self) -> u64 {
        use floodgate_core::Clock;
        self.inner.clock.now_us()
    }

    /// A call failed for want of Redis. When that opens the breaker, every
    /// connection made so far is retired (the next call on each thread makes
    /// a new one) and the background probe starts.
    fn failed(&self) {
        if self.inner.breaker.failure() {
            self.inner.epoch.fetch_add(1, Ordering::AcqRel);
            self.start_probe();
        }
    }

    /// Ping Redis every [`PROBE_EVERY`] while the breaker is open, so it
    /// closes within that of Redis answering again with no traffic needed.
    /// One probe task per store; it holds the store weakly and ends when
    /// the breaker closes. Needs a Tokio runtime (calls run on one).
    fn start_probe(&self) {
        if self.inner.probing.swap(true, Ordering::AcqRel) {
            return;
        }
        let weak = Arc::downgrade(&self.inner);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(PROBE_EVERY).await;
                let Some(inner) = weak.upgrade() else { return };
                let store = RedisStore { inner };
                if !store.inner.breaker.is_open() {
                    store.inner.probing.store(false, Ordering::Release);
                    // A trip between the check and the store: probe on.
                    if !store.inner.breaker.is_open() || store.inner.probing.swap(true, Ordering::AcqRel) {
                        return;
                    }
                }
                let _ = store.ping().await;
            }
        });
    }

    /// Whether the breaker lets a call go (counted when it does not).
    fn permit(&self) -> bool {
        let ok = self.inner.breaker.permit();
        if !ok {
            self.inner.rejected_open.fetch_add(1, Ordering::Relaxed);
        }
        ok
    }
}

/// Where a connection is kept (made on first use, dropped after a fault).
type ConnSlot = Mutex<Option<Live>>;

/// Await every future, concurrently, and give their outputs in order (a
/// request's slots; in tests, concurrent traces).
///
/// # Panics
/// Never: every future is polled until it finished.
pub async fn join_all<F: Future>(futures: Vec<F>) -> Vec<F::Output> {
    let mut futures: Vec<Pin<Box<F>>> = futures.into_iter().map(Box::pin).collect();
    let mut outputs: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, o) in futures.iter_mut().zip(outputs.iter_mut()) {
            if o.is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => *o = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending { std::task::Poll::Pending } else { std::task::Poll::Ready(()) }
    })
    .await;
    outputs.into_iter().map(|o| o.expect("every future finished")).collect()
}

impl Store for RedisStore {
    async fn apply(&self, key: &str, limit: &Limit, hits: u64) -> Result<Decision, StoreError> {
        let mut out = Vec::with_capacity(1);
        let scope = floodgate_core::region::Scope::Region;
        self.decide(&[Check { key, limit, hits, op: floodgate_core::Op::Take, enforce: true, scope }], None, &mut out)
            .await;
        out.pop().unwrap_or_else(|| Err(StoreError::Unavailable("no answer".to_owned())))
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let t = self.inner.config.timeout;
        // A ping probes even through an open breaker: readiness must see
        // Redis come back.
        let ping = redis::cmd("PING");
        let attempt = self.send(Packed::One(&ping), None, &self.inner.conn, None);
        match tokio::time::timeout(t, attempt).await {
            Ok((_, Ok(_))) => {
                self.inner.breaker.success();
                Ok(())
            }
            Ok((used, Err(e))) => {
                self.drop_connection(&self.inner.conn, used.as_ref());
                Err(StoreError::Unavailable(format!("Redis: {e}")))
            }
            Err(_) => {
                self.drop_connection(&self.inner.conn, None);
                Err(StoreError::Unavailable(format!("Redis did not answer within {t:?}")))
            }
        }
    }

    async fn apply_all(&self, checks: &[Check<'_>], out: &mut Vec<Result<Decision, StoreError>>) {
        self.decide(checks, None, out).await;
    }

    async fn reserve(
        &self,
        checks: &[Check<'_>],
        ttls_us: &[u64],
        out: &mut Vec<Result<Decision, StoreError>>,
    ) -> Result<Option<ReservationId>, ReservationError> {
        self.reserve_at(checks, ttls_us, None, out).await
    }

    async fn settle(&self, id: ReservationId, actual: &[u64]) -> Result<Settled, ReservationError> {
        self.settle_at(id, actual, None).await
    }
}
