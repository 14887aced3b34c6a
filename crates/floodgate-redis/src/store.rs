//! [`RedisStore`]: the [`Store`] over one Redis server or a Redis Cluster.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use floodgate_core::{Check, Decision, Limit, Store, StoreError};
use redis::cluster_routing::Slot;
use tokio::sync::{mpsc, oneshot};

use crate::breaker::{Breaker, PROBE_EVERY};
use crate::conn::{self, Live, Packed};
use crate::denied::DeniedCache;
use crate::global::RegionCtx;
use crate::script::{self, CheckArgs, GlobalArgs, Op, Reply};
use crate::target::Target;

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
///   crosses threads): at most [`BATCHES_IN_FLIGHT`] calls are in flight,
///   and the requests that arrive meanwhile go together in the next call
///   (up to [`BATCH_CHECKS`] checks), each still all or nothing on its own. An idle store sends a request at once, so
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

    /// One plain command through the breaker and the timeout (a region's
    /// own bookkeeping: its incarnation, `SCAN`).
    pub async fn raw(&self, cmd: &redis::Cmd) -> Result<redis::Value, StoreError> {
        self.raw_call(cmd).await
    }

    /// [`RedisStore::raw`] on a connection of this thread's own, made on
    /// the current runtime: on a per-core runtime the command, its
    /// connection's driver and the reply stay on one thread (no
    /// cross-thread wake-ups; a per-key miss's read). Beyond 16 threads,
    /// the shared connection.
    pub async fn raw_here(&self, cmd: &redis::Cmd) -> Result<redis::Value, StoreError> {
        let slot = self.here();
        let slot = slot.as_deref().unwrap_or(&self.inner.conn);
        self.call(Packed::One(cmd), None, true, None, slot, None)
            .await
            .map_err(|e| e.store_error(self.inner.config.timeout))
    }

    /// Each command of `pipe`, answered in order, on this thread's own
    /// connection as [`RedisStore::raw_here`]. On one server they go as one
    /// pipeline: one call through the breaker and the timeout, one write,
    /// one reply to wait for (a batch of per-key misses, a command per
    /// shard, costs what one command does). On a cluster each goes to its
    /// own node, all together. A command that Redis refuses fails its own
    /// answer; a call that fails (a timeout, a lost connection, the breaker
    /// open) fails them all.
    pub async fn raw_here_each(&self, pipe: &redis::Pipeline) -> Vec<Result<redis::Value, StoreError>> {
        if matches!(self.inner.client, Client::Cluster(_)) {
            return join_all(pipe.cmd_iter().map(|cmd| self.raw_here(cmd)).collect()).await;
        }
        let slot = self.here();
        let slot = slot.as_deref().unwrap_or(&self.inner.conn);
        let timeout = self.inner.config.timeout;
        match self.call(Packed::Many(pipe), None, true, None, slot, None).await {
            Ok(redis::Value::Array(replies)) if replies.len() == pipe.len() => replies
                .into_iter()
                .map(|v| v.extract_error().map_err(|e| CallError::Redis(e).store_error(timeout)))
                .collect(),
            Ok(_) => {
                let e = CallError::Reply("a pipeline answered with the wrong count".to_owned());
                pipe.cmd_iter().map(|_| Err(e.store_error(timeout))).collect()
            }
            Err(e) => pipe.cmd_iter().map(|_| Err(e.store_error(timeout))).collect(),
        }
    }

    /// This thread's own connection slot (`None` beyond [`MAX_LANES`]
    /// threads: the shared connection then).
    fn here(&self) -> Option<Arc<ConnSlot>> {
        let thread = std::thread::current().id();
        let mut here = self.inner.here.lock().unwrap_or_else(PoisonError::into_inner);
        match here.iter().find(|(t, _)| *t == thread) {
            Some((_, slot)) => Some(Arc::clone(slot)),
            None if here.len() < MAX_LANES => {
                let slot: Arc<ConnSlot> = Arc::new(Mutex::new(None));
                here.push((thread, Arc::clone(&slot)));
                Some(slot)
            }
            None => None,
        }
    }

    /// One administrative command (a bulk write, a listing) through the
    /// breaker, bounded by `timeout` instead of the decisions' timeout, on a
    /// connection of its own.
    pub async fn bulk(&self, cmd: &redis::Cmd, timeout: Duration) -> Result<redis::Value, StoreError> {
        let deadline = tokio::time::Instant::now() + timeout;
        self.call(Packed::One(cmd), None, true, Some(deadline), &self.inner.bulk, None)
            .await
            .map_err(|e| e.store_error(timeout))
    }

    /// Every key matching `pattern` (`SCAN … MATCH`, 1 000 a call), each
    /// call through the breaker, bounded by `timeout`, on the bulk
    /// connection; each key once. As with `SCAN` itself, a key that exists
    /// throughout is given, one written meanwhile may not be.
    ///
    /// On a cluster: one `SCAN` walk per primary, each routed by a slot it
    /// serves as `CLUSTER SLOTS` lists them. When the listing differs after
    /// the walks (a slot moved, a replica took over), a key may have moved
    /// past a walk: the walks run again, up to three times in all; a
    /// cluster still changing after that gives what the last walks found.
    pub async fn scan(&self, pattern: &str, timeout: Duration) -> Result<Vec<String>, StoreError> {
        let mut keys = std::collections::HashSet::new();
        if let Target::Single(_) = self.inner.config.target {
            // SCAN itself may give a key twice (while the server rehashes).
            keys.extend(self.scan_node(pattern, None, timeout).await?);
            return Ok(keys.into_iter().collect());
        }
        let mut before = self.topology(timeout).await?;
        for _ in 0..3 {
            keys.clear();
            // One walk per primary, routed by the first slot it serves.
            let mut walked: Vec<&redis::Value> = Vec::new();
            for (first, _, primary) in &before {
                if walked.contains(&primary) {
                    continue;
                }
                walked.push(primary);
                keys.extend(self.scan_node(pattern, Some(*first), timeout).await?);
            }
            let after = self.topology(timeout).await?;
            if after == before {
                break;
            }
            before = after;
        }
        Ok(keys.into_iter().collect())
    }

    /// One `SCAN` walk: of the server, or of the primary serving slot `at`.
    async fn scan_node(&self, pattern: &str, at: Option<u16>, timeout: Duration) -> Result<Vec<String>, StoreError> {
        let mut keys = Vec::new();
        let mut cursor = "0".to_owned();
        loop {
            let mut scan = redis::cmd("SCAN");
            scan.arg(&cursor).arg("MATCH").arg(pattern).arg("COUNT").arg(1000);
            let deadline = tokio::time::Instant::now() + timeout;
            let v = self
                .call(Packed::One(&scan), None, true, Some(deadline), &self.inner.bulk, at)
                .await
                .map_err(|e| e.store_error(timeout))?;
            let (next, found): (String, Vec<String>) = redis::FromRedisValue::from_redis_value(v)
                .map_err(|e| StoreError::Unavailable(format!("Redis: a SCAN reply: {e}")))?;
            keys.extend(found);
            if next == "0" {
                return Ok(keys);
            }
            cursor = next;
        }
    }

    /// The cluster's slot ranges as `CLUSTER SLOTS` gives them, ordered:
    /// `(first slot, last slot, primary's address and id)`.
    async fn topology(&self, timeout: Duration) -> Result<Vec<(u16, u16, redis::Value)>, StoreError> {
        let mut slots = redis::cmd("CLUSTER");
        slots.arg("SLOTS");
        let v = self.bulk(&slots, timeout).await?;
        let bad = |what: &str| StoreError::Unavailable(format!("Redis: a CLUSTER SLOTS reply {what}"));
        let redis::Value::Array(ranges) = v else { return Err(bad("that is not an array")) };
        let mut out = Vec::with_capacity(ranges.len());
        for r in ranges {
            let redis::Value::Array(f) = r else { return Err(bad("with a range that is not an array")) };
            let (Some(redis::Value::Int(first)), Some(redis::Value::Int(last)), Some(redis::Value::Array(primary))) =
                (f.first(), f.get(1), f.get(2))
            else {
                return Err(bad("with a range without its slots and primary"));
            };
            let slot = |n: &i64| u16::try_from(*n).map_err(|_| bad("with a slot beyond 16383"));
            out.push((slot(first)?, slot(last)?, redis::Value::Array(primary.iter().take(3).cloned().collect())));
        }
        out.sort_by_key(|r| r.0);
        Ok(out)
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

    /// One command through the breaker and the timeout (for [`SharedMap`](crate::SharedMap)).
    pub(crate) async fn raw_call(&self, cmd: &redis::Cmd) -> Result<redis::Value, StoreError> {
        self.call(Packed::One(cmd), None, true, None, &self.inner.conn, None)
            .await
            .map_err(|e| e.store_error(self.inner.config.timeout))
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

    /// One script call for `requests`: the reply's values.
    async fn run(
        &self,
        requests: &[script::Request<'_>],
        op: Op,
        gated: bool,
        deadline: Option<tokio::time::Instant>,
        slot: &ConnSlot,
    ) -> Result<Vec<i64>, CallError> {
        let cmd = script::command(false, requests, op);
        let eval = || script::command(true, requests, op);
        let value = self.call(Packed::One(&cmd), Some(&eval), gated, deadline, slot, None).await?;
        redis::FromRedisValue::from_redis_value(value).map_err(|e| CallError::Reply(e.to_string()))
    }

    /// One script call for one request's checks in one slot.
    async fn run_one(
        &self,
        keys: &[String],
        checks: &[&Check<'_>],
        now: Option<u64>,
        op: Op,
    ) -> Result<Reply, CallError> {
        let args: Vec<CheckArgs> =
            checks.iter().map(|c| CheckArgs::of(c, op).with_global(self.global_args(c, now))).collect();
        let values = self.run(&[(now, keys, &args)], op, true, None, &self.inner.conn).await?;
        if let Op::Refund(_) = op {
            return Ok(Reply {
                now_us: values.first().copied().unwrap_or(0).max(0) as u64,
                denied: false,
                decisions: vec![],
            });
        }
        script::reply(&values, checks).map_err(|e| CallError::Reply(e.0))
    }

    /// One request's checks through the batch queue (one server). Gives the
    /// keys back with the reply. No timer of its own: the batch answers
    /// by the request's deadline (its call is bounded by its requests'
    /// earliest one), and a request still queued at its deadline is not
    /// sent.
    async fn queued(
        &self,
        keys: Vec<String>,
        checks: &[&Check<'_>],
        now: Option<u64>,
    ) -> (Vec<String>, Result<Reply, CallError>) {
        if !self.permit() {
            return (keys, Err(CallError::Open));
        }
        let (tx, rx) = oneshot::channel();
        let args = checks.iter().map(|c| CheckArgs::of(c, Op::Apply).with_global(self.global_args(c, now))).collect();
        let deadline = tokio::time::Instant::now() + self.inner.config.timeout;
        self.enqueue(Queued { now, keys, args, deadline, reply: tx });
        match rx.await {
            Ok((keys, Ok(values))) => {
                let reply = script::reply(&values, checks).map_err(|e| CallError::Reply(e.0));
                (keys, reply)
            }
            Ok((keys, Err(e))) => (keys, Err(e)),
            // The batching task's runtime shut down.
            Err(_) => (Vec::new(), Err(CallError::Reply("the request was dropped unsent".to_owned()))),
        }
    }

    /// Put a request on this thread's batch queue, starting its batching
    /// task (on the current runtime) when there is none or its runtime is
    /// gone. Per thread: on per-core runtimes, a request, its batch and the
    /// connection stay on one thread (no cross-thread wake-ups).
    fn enqueue(&self, q: Queued) {
        let thread = std::thread::current().id();
        let mut lanes = self.inner.lanes.lock().unwrap_or_else(PoisonError::into_inner);
        let mut q = match lanes.iter().position(|l| l.thread == thread) {
            Some(i) => match lanes[i].tx.send(q) {
                Ok(()) => return,
                Err(mpsc::error::SendError(q)) => q,
            },
            None => q,
        };
        lanes.retain(|l| !l.tx.is_closed());
        if lanes.len() >= MAX_LANES {
            // More deciding threads than that: this one uses a random lane.
            let hash = std::hash::BuildHasher::hash_one(&std::hash::RandomState::new(), thread);
            let i = (hash % lanes.len() as u64) as usize;
            match lanes[i].tx.send(q) {
                Ok(()) => return,
                Err(mpsc::error::SendError(back)) => q = back,
            }
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let conn = Arc::new(Mutex::new(None));
        tokio::spawn(batcher(Arc::downgrade(&self.inner), rx, Arc::clone(&conn)));
        // A fresh channel's receiver is alive: the send succeeds.
        let _ = tx.send(q);
        lanes.push(Lane { thread, tx });
    }

    /// Send one batch and hand each request its part of the reply.
    async fn send_batch(&self, batch: Vec<Queued>, slot: &ConnSlot) {
        let requests: Vec<script::Request<'_>> = batch.iter().map(|q| (q.now, &q.keys[..], &q.args[..])).collect();
        let deadline = batch.iter().map(|q| q.deadline).min();
        let result = self.run(&requests, Op::Apply, false, deadline, slot).await;
        drop(requests);
        let parts = result.and_then(|values| {
            let parts = script::split(&values, batch.iter().map(|q| q.keys.len()), Op::Apply)
                .map_err(|e| CallError::Reply(e.0))?;
            Ok(parts.into_iter().map(<[i64]>::to_vec).collect::<Vec<_>>())
        });
        match parts {
            Ok(parts) => {
                for (q, part) in batch.into_iter().zip(parts) {
                    let _ = q.reply.send((q.keys, Ok(part)));
                }
            }
            Err(e) => {
                for q in batch {
                    let _ = q.reply.send((q.keys, Err(e.clone())));
                }
            }
        }
    }

    fn now(&self, now: Option<u64>) -> Option<u64> {
        use floodgate_core::Clock;
        match (now, self.inner.config.clock) {
            (Some(t), _) => Some(t),
            (None, ClockSource::Local) => Some(self.inner.clock.now_us()),
            (None, ClockSource::Redis) => None,
        }
    }

    async fn decide(&self, checks: &[Check<'_>], now: Option<u64>, out: &mut Vec<Result<Decision, StoreError>>) {
        out.clear();
        if checks.is_empty() {
            return;
        }
        let i = &self.inner;
        // The local over-limit cache works in real time: not for replays.
        let cache = i.config.cache_denials && now.is_none();
        let now = self.now(now);
        let sent = Instant::now();
        let mut keys: Vec<String> =
            checks.iter().map(|c| script::redis_key(&i.config.key_prefix, c.key, c.limit)).collect();

        // Every check a one-hit request on a key known to be over its limit:
        // answer here.
        if cache {
            let cached: Option<Vec<Decision>> =
                keys.iter().zip(checks).map(|(k, c)| if c.hits == 1 { i.denied.get(k, sent) } else { None }).collect();
            if let Some(cached) = cached {
                i.cached_denials.fetch_add(1, Ordering::Relaxed);
                out.extend(cached.into_iter().map(Ok));
                return;
            }
        }

        let groups = self.groups(&keys);
        let replies = if matches!(i.client, Client::Single(_)) {
            let refs: Vec<&Check<'_>> = checks.iter().collect();
            let (back, reply) = self.queued(std::mem::take(&mut keys), &refs, now).await;
            keys = back;
            vec![reply]
        } else {
            // Boxed: the cluster's calls and refunds would otherwise make
            // every decision's future (moved at each await level) larger.
            Box::pin(self.across_slots(&keys, checks, now, &groups)).await
        };

        out.resize_with(checks.len(), || Ok(Decision::default()));
        for (g, r) in groups.iter().zip(replies) {
            match r {
                Ok(r) => {
                    for (&j, d) in g.iter().zip(r.decisions) {
                        if cache
                            && !d.allowed
                            && checks[j].hits == 1
                            && checks[j].enforce
                            && let Some(key) = keys.get(j)
                        {
                            i.denied.put(key, sent, &d);
                        }
                        out[j] = Ok(d);
                    }
                }
                Err(e) => {
                    let e = e.store_error(i.config.timeout);
                    for &j in g {
                        out[j] = Err(e.clone());
                    }
                }
            }
        }
    }

    /// A Redis Cluster's calls for one request: one per hash slot,
    /// concurrently; when a slot denied, the slots that allowed are refunded.
    async fn across_slots(
        &self,
        keys: &[String],
        checks: &[Check<'_>],
        now: Option<u64>,
        groups: &[Vec<usize>],
    ) -> Vec<Result<Reply, CallError>> {
        let i = &self.inner;
        let replies = if groups.len() == 1 {
            let refs: Vec<&Check<'_>> = checks.iter().collect();
            vec![self.run_one(keys, &refs, now, Op::Apply).await]
        } else {
            let calls = groups.iter().map(|g| {
                let ks: Vec<String> = g.iter().map(|&j| keys[j].clone()).collect();
                let cs: Vec<&Check<'_>> = g.iter().map(|&j| &checks[j]).collect();
                async move { self.run_one(&ks, &cs, now, Op::Apply).await }
            });
            join_all(calls.collect()).await
        };

        // All or nothing across slots: a slot that allowed gives its hits
        // back when another denied (each slot already did so within itself).
        let denied_somewhere = replies.iter().any(|r| matches!(r, Ok(r) if r.denied));
        if denied_somewhere && groups.len() > 1 {
            let refunds = groups.iter().zip(&replies).filter_map(|(g, r)| {
                let r = r.as_ref().ok().filter(|r| !r.denied)?;
                let (ks, cs): (Vec<String>, Vec<&Check<'_>>) = g
                    .iter()
                    .zip(&r.decisions)
                    .filter(|&(&j, d)| d.allowed && checks[j].hits > 0)
                    .map(|(&j, _)| (keys[j].clone(), &checks[j]))
                    .unzip();
                (!cs.is_empty()).then_some((ks, cs, r.now_us))
            });
            let calls: Vec<_> = refunds
                .map(|(ks, cs, at)| async move {
                    i.cross_slot_refunds.fetch_add(1, Ordering::Relaxed);
                    if let Err(e) = self.run_one(&ks, &cs, now, Op::Refund(at)).await {
                        tracing::warn!(error = %e.store_error(i.config.timeout), "cross-slot refund failed: those limits keep this request's hits");
                    }
                })
                .collect();
            join_all(calls).await;
        }

        replies
    }

    /// Indices of the checks, grouped by hash slot (one group on a single
    /// server).
    fn groups(&self, keys: &[String]) -> Vec<Vec<usize>> {
        if matches!(self.inner.client, Client::Single(_)) || keys.len() == 1 {
            return vec![(0..keys.len()).collect()];
        }
        let mut groups: Vec<(Slot, Vec<usize>)> = Vec::new();
        for (j, k) in keys.iter().enumerate() {
            let slot = Slot::for_key(k);
            match groups.iter_mut().find(|(s, _)| *s == slot) {
                Some((_, g)) => g.push(j),
                None => groups.push((slot, vec![j])),
            }
        }
        groups.into_iter().map(|(_, g)| g).collect()
    }
}

/// A queued request's part of a batch's reply, with its keys given back.
type BatchReply = (Vec<String>, Result<Vec<i64>, CallError>);

/// Where a connection is kept (made on first use, dropped after a fault).
type ConnSlot = Mutex<Option<Live>>;

/// Batch queues at most: past that, threads share them.
const MAX_LANES: usize = 16;

/// One thread's batch queue.
struct Lane {
    thread: std::thread::ThreadId,
    tx: mpsc::UnboundedSender<Queued>,
}

/// A request waiting on a single server's batch queue: its time, keys and
/// checks, and where its part of the reply goes (with its keys, given back).
struct Queued {
    now: Option<u64>,
    keys: Vec<String>,
    args: Vec<CheckArgs>,
    deadline: tokio::time::Instant,
    reply: oneshot::Sender<BatchReply>,
}

/// The batching task of a single server: takes the requests queued while
/// [`BATCHES_IN_FLIGHT`] calls were out and sends them as one call. Ends
/// when the store is dropped.
async fn batcher(inner: Weak<Inner>, mut rx: mpsc::UnboundedReceiver<Queued>, conn: Arc<ConnSlot>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(BATCHES_IN_FLIGHT));
    let mut next: Option<Queued> = None;
    loop {
        let Ok(slot) = Arc::clone(&slots).acquire_owned().await else { return };
        let first = match next.take() {
            Some(q) => q,
            None => match rx.recv().await {
                Some(q) => q,
                None => return,
            },
        };
        let mut checks = first.keys.len();
        let mut batch = vec![first];
        while let Ok(q) = rx.try_recv() {
            if checks + q.keys.len() > BATCH_CHECKS {
                next = Some(q);
                break;
            }
            checks += q.keys.len();
            batch.push(q);
        }
        let Some(inner) = inner.upgrade() else { return };
        // A request whose caller is gone is not decided, nor one whose
        // deadline passed in the queue.
        let now = tokio::time::Instant::now();
        batch.retain(|q| !q.reply.is_closed());
        for q in batch.extract_if(.., |q| q.deadline <= now) {
            inner.timeouts.fetch_add(1, Ordering::Relaxed);
            inner.errors.fetch_add(1, Ordering::Relaxed);
            let _ = q.reply.send((q.keys, Err(CallError::Timeout)));
        }
        if batch.is_empty() {
            continue;
        }
        let conn = Arc::clone(&conn);
        tokio::spawn(async move {
            RedisStore { inner }.send_batch(batch, &conn).await;
            drop(slot);
        });
    }
}

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
        self.decide(&[Check { key, limit, hits, enforce: true, scope }], None, &mut out).await;
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
}
