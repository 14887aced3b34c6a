//! [`RedisStore`]: the [`Store`] over one Redis server or a Redis Cluster.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use floodgate_core::{Check, Decision, Limit, Store, StoreError};
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::Slot;

use crate::breaker::Breaker;
use crate::denied::DeniedCache;
use crate::script::{self, Op, Reply};
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
}

/// A live connection: both kinds pipeline concurrent commands on shared
/// sockets (the cluster one keeps one per node and follows MOVED/ASK).
#[derive(Clone)]
enum Conn {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl Conn {
    async fn query(&mut self, cmd: &redis::Cmd) -> redis::RedisResult<redis::Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd).await,
            Self::Cluster(c) => c.req_packed_command(cmd).await,
        }
    }
}

/// The Redis and Redis Cluster store.
///
/// * One round trip per decision: every limit of a request that lands in one
///   hash slot is decided by one `EVALSHA` of the composed script (`EVAL`
///   once per server after a restart: `NOSCRIPT`), atomically, all or
///   nothing. Limits in several slots (Redis Cluster) go concurrently; when
///   one slot denies, the others are refunded (a second trip, on that path
///   only).
/// * Every call is bounded by [`RedisConfig::timeout`]. After three
///   failures in a row a circuit breaker opens: decisions fail at once (the
///   rule's failure policy applies) while one probe every 500 ms tests
///   Redis; the first success closes it. A single server's connection is
///   dropped on an error or a timeout and made again by the next call.
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
    conn: Mutex<Option<Conn>>,
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
        }
    }

    /// [`Store::apply_all`] at a given time (microseconds since the Unix
    /// epoch) instead of the configured clock: for tests and replays.
    pub async fn apply_all_at(&self, checks: &[Check<'_>], now_us: u64, out: &mut Vec<Result<Decision, StoreError>>) {
        self.decide(checks, Some(now_us), out).await;
    }

    async fn connection(&self) -> Result<Conn, redis::RedisError> {
        if let Some(c) = self.inner.conn.lock().unwrap_or_else(PoisonError::into_inner).clone() {
            return Ok(c);
        }
        // One connect at a time; the others wait for it (bounded by the
        // call's timeout) instead of each opening a socket.
        let _one = self.inner.connecting.lock().await;
        if let Some(c) = self.inner.conn.lock().unwrap_or_else(PoisonError::into_inner).clone() {
            return Ok(c);
        }
        let t = self.inner.config.timeout;
        let conn = match &self.inner.client {
            Client::Single(c) => {
                // No response timeout of its own: every call is already
                // bounded by `timeout` (a second timer per command costs CPU).
                let cfg =
                    redis::AsyncConnectionConfig::new().set_connection_timeout(Some(t)).set_response_timeout(None);
                Conn::Single(c.get_multiplexed_async_connection_with_config(&cfg).await?)
            }
            Client::Cluster(c) => Conn::Cluster(c.get_async_connection().await?),
        };
        *self.inner.conn.lock().unwrap_or_else(PoisonError::into_inner) = Some(conn.clone());
        Ok(conn)
    }

    /// Forget a single server's connection after a fault, so the next call
    /// makes a new one. A cluster connection is kept: it reconnects to its
    /// nodes and refreshes the topology itself.
    fn drop_connection(&self) {
        if matches!(self.inner.client, Client::Single(_)) {
            *self.inner.conn.lock().unwrap_or_else(PoisonError::into_inner) = None;
        }
    }

    /// One command through the breaker, bounded by the timeout.
    /// `eval` builds the command to send instead on `NOSCRIPT` (only then:
    /// it carries the whole script).
    async fn call(
        &self,
        cmd: &redis::Cmd,
        eval: Option<&(dyn Fn() -> redis::Cmd + Sync)>,
    ) -> Result<redis::Value, CallError> {
        let i = &self.inner;
        if !i.breaker.permit() {
            i.rejected_open.fetch_add(1, Ordering::Relaxed);
            return Err(CallError::Open);
        }
        i.calls.fetch_add(1, Ordering::Relaxed);
        let attempt = async {
            let mut conn = self.connection().await?;
            match conn.query(cmd).await.and_then(redis::Value::extract_error) {
                Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => match eval {
                    // A restarted (or new) server: EVAL loads the script.
                    Some(eval) => conn.query(&eval()).await.and_then(redis::Value::extract_error),
                    None => Err(e),
                },
                r => r,
            }
        };
        let result = match tokio::time::timeout(i.config.timeout, attempt).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(CallError::Redis(e)),
            Err(_) => Err(CallError::Timeout),
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
                    i.breaker.failure();
                    self.drop_connection();
                }
            }
        }
        result
    }

    /// One command through the breaker and the timeout (for [`SharedMap`](crate::SharedMap)).
    pub(crate) async fn raw_call(&self, cmd: &redis::Cmd) -> Result<redis::Value, StoreError> {
        self.call(cmd, None).await.map_err(|e| e.store_error(self.inner.config.timeout))
    }

    /// One script call for a group of checks in one slot.
    async fn run(&self, keys: &[String], checks: &[&Check<'_>], now: Option<u64>, op: Op) -> Result<Reply, CallError> {
        let cmd = script::command(false, keys, checks, now, op);
        let eval = || script::command(true, keys, checks, now, op);
        let value = self.call(&cmd, Some(&eval)).await?;
        let values: Vec<i64> =
            redis::FromRedisValue::from_redis_value(value).map_err(|e| CallError::Reply(e.to_string()))?;
        if let Op::Refund(_) = op {
            return Ok(Reply {
                now_us: values.first().copied().unwrap_or(0).max(0) as u64,
                denied: false,
                decisions: vec![],
            });
        }
        script::reply(&values, checks).map_err(CallError::Reply)
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
        let keys: Vec<String> =
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
        let replies = if groups.len() == 1 {
            let refs: Vec<&Check<'_>> = checks.iter().collect();
            vec![self.run(&keys, &refs, now, Op::Apply).await]
        } else {
            let calls = groups.iter().map(|g| {
                let ks: Vec<String> = g.iter().map(|&j| keys[j].clone()).collect();
                let cs: Vec<&Check<'_>> = g.iter().map(|&j| &checks[j]).collect();
                async move { self.run(&ks, &cs, now, Op::Apply).await }
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
                    if let Err(e) = self.run(&ks, &cs, now, Op::Refund(at)).await {
                        tracing::warn!(error = %e.store_error(i.config.timeout), "cross-slot refund failed: those limits keep this request's hits");
                    }
                })
                .collect();
            join_all(calls).await;
        }

        out.resize_with(checks.len(), || Ok(Decision::default()));
        for (g, r) in groups.iter().zip(replies) {
            match r {
                Ok(r) => {
                    for (&j, d) in g.iter().zip(r.decisions) {
                        if cache && !d.allowed && checks[j].hits == 1 && checks[j].enforce {
                            i.denied.put(&keys[j], sent, &d);
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

/// Await every future, concurrently, in order (a request's slots).
async fn join_all<F: Future>(futures: Vec<F>) -> Vec<F::Output> {
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
        self.decide(&[Check { key, limit, hits, enforce: true }], None, &mut out).await;
        out.pop().unwrap_or_else(|| Err(StoreError::Unavailable("no answer".to_owned())))
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let t = self.inner.config.timeout;
        // A ping probes even through an open breaker: readiness must see
        // Redis come back.
        let attempt = async { self.connection().await?.query(&redis::cmd("PING")).await };
        match tokio::time::timeout(t, attempt).await {
            Ok(Ok(_)) => {
                self.inner.breaker.success();
                Ok(())
            }
            Ok(Err(e)) => {
                self.drop_connection();
                Err(StoreError::Unavailable(format!("Redis: {e}")))
            }
            Err(_) => {
                self.drop_connection();
                Err(StoreError::Unavailable(format!("Redis did not answer within {t:?}")))
            }
        }
    }

    async fn apply_all(&self, checks: &[Check<'_>], out: &mut Vec<Result<Decision, StoreError>>) {
        self.decide(checks, None, out).await;
    }
}
