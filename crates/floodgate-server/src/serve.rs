//! `floodgate serve`: load and validate everything, then bind the gRPC, HTTP
//! and admin addresses, serve, and on shutdown stop accepting, finish the
//! requests in flight (bounded by a grace period) and return.
//!
//! The order matters (bad config never binds a port): [`prepare`] loads the
//! rules and overrides and checks the settings, [`Prepared::bind`] binds,
//! [`Bound::run`] serves.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use floodgate_core::limiter::Limiter;
use floodgate_core::rules::LoadOptions;
use floodgate_core::{MemoryStore, OnFull};
use floodgate_redis::{RedisConfig, RedisStore};
use floodgate_sync::{LinkConfig, SyncServer, run_links};
use floodgate_tower::RateLimitLayer;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::Backend;
use crate::instance::{OverridesFile, open_keys};
use crate::listen::overload::ShedLayer;
use crate::listen::threads;
use crate::listen::{ConnLimit, ConnOptions, Handed, Held, ServerError, accept, serve_router};
use crate::metrics::Metrics;
use crate::protocol::admin::{self, AdminState};
use crate::protocol::budget_grpc::BudgetServer;
use crate::protocol::grpc::Rls;
use crate::protocol::http::{self, HttpState};
use crate::protocol::leases_grpc::LeasesServer;
use crate::proxy::{Forward, ProxyConfig, ServiceDecider, serve_proxy};
use crate::rules::reload::{Rules, RulesSource, WatchOptions, Watcher, watch};
use crate::service::Service;
use crate::store::ServerStore;
use crate::store::regions::{RegionState, Regions, RegionsConfig, check_rules, global_rules};
use floodgate_core::headers::HeaderMode;
use floodgate_perkey::CacheOptions;

/// Everything `serve` needs to know.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where the rules come from: a directory (watched) or embedded files.
    pub rules: RulesSource,
    /// RLS gRPC address (`None`: no gRPC server).
    pub grpc_addr: Option<SocketAddr>,
    /// HTTP API address (`None`: no HTTP API).
    pub http_addr: Option<SocketAddr>,
    /// Admin API address.
    pub admin_addr: SocketAddr,
    /// Bearer token for the admin API.
    pub admin_token: Option<String>,
    /// Which rate-limit headers to send.
    pub headers: HeaderMode,
    /// Where per-key entries (and runtime overrides) persist
    /// ([`OverridesFile::Off`] disables them).
    pub overrides: OverridesFile,
    /// The per-key lookup cache.
    pub key_cache: CacheOptions,
    /// The store: `None` for the in-memory store, or Redis.
    pub redis: Option<RedisConfig>,
    /// Bound on the in-memory store's keys (and on the `local` fallback's).
    pub max_keys: usize,
    /// Watch the rules directory and reload on change.
    pub watch: bool,
    /// Largest HTTP request body.
    pub body_limit: usize,
    /// How long shutdown waits for requests in flight.
    pub shutdown_grace: Duration,
    /// gRPC on dedicated single-threaded runtimes, one per thread, each
    /// serving the connections handed to it round-robin (no work stealing,
    /// no cross-thread wake-ups); 0 serves gRPC on the shared runtime.
    pub grpc_threads: usize,
    /// Connections each listener (gRPC, HTTP API, admin API, proxy) holds
    /// open at most; beyond, new ones wait to be accepted.
    pub max_connections: usize,
    /// gRPC requests in flight at most (shared out among the gRPC
    /// runtimes); one more is answered `RESOURCE_EXHAUSTED` at once.
    pub max_in_flight: usize,
    /// The longest an HTTP/1 client may take to send a request's head
    /// (HTTP API, admin API, proxy); then its connection is closed.
    pub header_timeout: Duration,
    /// HTTP/2 streams (requests) a client may have open on one connection
    /// at once, on every listener.
    pub max_streams: u32,
    /// Keep the dashboard's data (per-rule charts and top keys).
    pub dashboard: bool,
    /// The reverse proxy, when one is served.
    pub proxy: Option<ProxyConfig>,
    /// This instance's region and its peers, when limits are shared across
    /// regions.
    pub regions: Option<RegionsConfig>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            rules: RulesSource::Embedded(crate::rules::BUNDLED_RULES),
            grpc_addr: Some(SocketAddr::from(([0, 0, 0, 0], 8081))),
            http_addr: Some(SocketAddr::from(([0, 0, 0, 0], 8080))),
            admin_addr: SocketAddr::from(([127, 0, 0, 1], 9090)),
            admin_token: None,
            headers: HeaderMode::default(),
            overrides: OverridesFile::Off,
            key_cache: CacheOptions::default(),
            redis: None,
            max_keys: floodgate_core::store::memory::DEFAULT_MAX_KEYS,
            watch: true,
            body_limit: http::DEFAULT_BODY_LIMIT,
            shutdown_grace: Duration::from_secs(10),
            grpc_threads: 0,
            max_connections: crate::listen::DEFAULT_MAX_CONNECTIONS,
            header_timeout: crate::listen::DEFAULT_HEADER_TIMEOUT,
            max_streams: crate::listen::DEFAULT_MAX_STREAMS,
            dashboard: true,
            max_in_flight: crate::listen::overload::DEFAULT_MAX_IN_FLIGHT,
            proxy: None,
            regions: None,
        }
    }
}

/// Why the server could not start or run.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Bad configuration (exit 64): nothing was bound.
    #[error("{0}")]
    Config(String),
    /// An address could not be bound (exit 2).
    #[error("cannot bind the {what} address {addr}: {source}")]
    Bind {
        /// Which address.
        what: &'static str,
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// A server failed while running (exit 2).
    #[error("{0}")]
    Runtime(String),
}

/// Resolves once `rx` reads true (shutdown).
async fn stopped(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

type Health = tonic_health::pb::health_server::HealthServer<tonic_health::server::HealthService>;

/// What every gRPC runtime serves: the RLS and health services, and its
/// share of the requests in flight.
#[derive(Clone)]
struct Grpc {
    service: Arc<Service<ServerStore>>,
    health: Health,
    headers: HeaderMode,
    max_in_flight: usize,
    max_streams: u32,
}

/// The gRPC server (RLS and health) on `incoming` connections, until `stop`.
async fn serve_grpc<I, IO, IE>(incoming: I, grpc: Grpc, stop: watch::Receiver<bool>) -> Result<(), ServerError>
where
    I: tokio_stream::Stream<Item = Result<IO, IE>>,
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + tonic::transport::server::Connected + Unpin + Send + 'static,
    IE: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let shed = ShedLayer::new(grpc.max_in_flight, grpc.service.metrics().clone());
    tonic::transport::Server::builder()
        .max_concurrent_streams(grpc.max_streams)
        .layer(shed)
        .add_service(grpc.health)
        .add_service(BudgetServer::new(grpc.service.clone()))
        .add_service(LeasesServer::new(grpc.service.clone()))
        .add_service(Rls::server(grpc.service, grpc.headers))
        .serve_with_incoming_shutdown(incoming, stopped(stop))
        .await
        .map_err(ServerError::from)
}

/// gRPC on `n` single-threaded runtimes ([`threads::on_threads`]), each
/// with its share of `--max-in-flight`. Returns when every runtime has
/// drained after shutdown.
async fn per_thread_grpc(
    n: usize,
    listener: TcpListener,
    bound: ConnLimit,
    mut grpc: Grpc,
    stop: watch::Receiver<bool>,
) -> Result<(), ServerError> {
    let serve_stop = stop.clone();
    grpc.max_in_flight = grpc.max_in_flight.div_ceil(n.max(1));
    threads::on_threads(n, "grpc", listener, bound, stop, move |handed| {
        serve_grpc(held(handed), grpc.clone(), serve_stop.clone())
    })
    .await
}

/// Handed connections as tonic's incoming stream, each holding its place
/// under the listener's bound until it closes.
fn held(handed: Handed) -> impl tokio_stream::Stream<Item = std::io::Result<Held>> {
    tokio_stream::StreamExt::map(tokio_stream::wrappers::UnboundedReceiverStream::new(handed), |(io, _peer, permit)| {
        Held::new(io, permit)
    })
}

/// The sync service on `listener` and the links to every peer, for a
/// region whose state is `region`.
fn spawn_sync<R: floodgate_core::region::Region + Clone>(
    servers: &mut JoinSet<(&'static str, Result<(), ServerError>)>,
    region: R,
    regions: &Regions,
    listener: TcpListener,
    stop: &watch::Receiver<bool>,
) {
    let server = SyncServer::new(region.clone(), regions.config.token.clone(), regions.stats.clone());
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    let serving = tonic::transport::Server::builder()
        .add_service(server)
        .serve_with_incoming_shutdown(incoming, stopped(stop.clone()));
    servers.spawn(async move { ("sync", serving.await.map_err(ServerError::from)) });
    let link = LinkConfig {
        interval: regions.config.interval,
        timeout: regions.config.timeout,
        token: regions.config.token.clone(),
    };
    let links = run_links(region, regions.config.peers.clone(), link, regions.stats.clone(), stop.clone());
    servers.spawn(async move { ("sync links", links.await.map_err(ServerError::from)) });
}

/// Loaded and validated, not yet bound.
#[derive(Debug)]
pub struct Prepared {
    config: Config,
    service: Arc<Service<ServerStore>>,
}

fn log_region(r: &RegionsConfig, kind: &str) {
    tracing::info!(
        region = %r.region,
        state = kind,
        peers = %r.peers.iter().map(|p| format!("{}={}", p.name, p.url)).collect::<Vec<_>>().join(","),
        "this region shares its global limits with its peers"
    );
}

fn memory(max_keys: usize) -> MemoryStore {
    MemoryStore::builder().max_keys(max_keys).on_full(OnFull::Evict).build()
}

/// Load the rules and overrides and check the settings; binds nothing.
pub fn prepare(config: Config) -> Result<Prepared, ServeError> {
    if config.admin_token.as_deref().is_some_and(str::is_empty) {
        return Err(ServeError::Config(
            "--admin-token is empty: give a secret, or leave it out on a loopback admin address".into(),
        ));
    }
    if config.admin_token.is_none() && !config.admin_addr.ip().is_loopback() {
        return Err(ServeError::Config(format!(
            "the admin address {} is not loopback and no --admin-token is set: set a token (FLOODGATE_ADMIN_TOKEN) or bind the admin API to 127.0.0.1",
            config.admin_addr
        )));
    }
    let rules = Rules::load(config.rules.clone(), LoadOptions::default()).map_err(|errs| {
        let list: Vec<String> = errs.0.iter().map(ToString::to_string).collect();
        ServeError::Config(format!("the rules in {} do not validate:\n{}", config.rules, list.join("\n")))
    })?;
    if let Some(p) = &config.proxy {
        rules.require_domain(&p.domain, "the proxy");
    }
    // Global rules need peer regions (and a slice of at least one hit):
    // checked now and on every reload.
    let regions_n = config.regions.as_ref().map_or(0, |r| r.peers.len() + 1);
    rules.add_check(move |set| check_rules(set, regions_n)).map_err(|errs| {
        let list: Vec<String> = errs.0.iter().map(ToString::to_string).collect();
        ServeError::Config(format!("the rules in {} cannot run here:\n{}", config.rules, list.join("\n")))
    })?;
    for w in rules.current().warnings() {
        tracing::warn!("{w}");
    }
    let keys =
        open_keys(&config.overrides, config.key_cache).map_err(|e| ServeError::Config(e.to_string()))?.map(Arc::new);
    if let Some(k) = &keys {
        // Entries naming a tier the rules lack (the files edited while
        // stopped) get the files' rules: said now, never fatal.
        for (domain, tier, n) in k.missing_tiers(&rules.current()) {
            tracing::warn!(%domain, %tier, entries = n, "per-key entries name a tier the rules do not define: their keys get the files' rules until it is defined");
        }
        // A reload must not remove a tier that entries still name.
        let (checker, in_use) = (k.clone(), Arc::downgrade(&rules));
        rules
            .add_check(move |set| match in_use.upgrade() {
                Some(r) => checker.check_rules(set, &r.current()),
                None => Vec::new(),
            })
            .map_err(|errs| ServeError::Config(errs.to_string()))?;
    }
    let store = match (&config.redis, &config.regions) {
        (None, None) => ServerStore::Memory(memory(config.max_keys)),
        (None, Some(r)) => {
            let regions = Regions::new(r.clone()).map_err(|e| ServeError::Config(e.to_string()))?;
            log_region(r, "memory");
            let Some(table) = regions.table().cloned() else {
                return Err(ServeError::Config("a memory region has a table".into()));
            };
            ServerStore::Regional(memory(config.max_keys), table, Arc::new(regions))
        }
        (Some(redis), Some(r)) => {
            let regions = Regions::redis(r.clone(), redis.clone()).map_err(|e| ServeError::Config(e.to_string()))?;
            log_region(
                r,
                if matches!(redis.target, floodgate_redis::Target::Cluster(_)) { "redis cluster" } else { "redis" },
            );
            let RegionState::Redis(region) = regions.state.clone() else {
                return Err(ServeError::Config("a Redis region has a Redis state".into()));
            };
            // Its full state listing finds the global rules' keys by name.
            region.set_rules(global_rules(&rules.current()));
            let listing = region.clone();
            rules.on_reload(move |set| listing.set_rules(global_rules(set)));
            ServerStore::RedisRegional(region.store().clone(), region, Arc::new(regions))
        }
        (Some(redis), None) => ServerStore::Redis(
            RedisStore::new(redis.clone()).map_err(|e| ServeError::Config(format!("--store {}: {e}", redis.target)))?,
        ),
    };
    let local = MemoryStore::builder().max_keys(config.max_keys).build();
    let service = Arc::new(Service::new(
        rules,
        keys,
        Limiter::new(store, local),
        Arc::new(Metrics::with_dashboard(config.dashboard)),
    ));
    Ok(Prepared { config, service })
}

impl Prepared {
    /// The service (for tests and embedding).
    pub fn service(&self) -> &Arc<Service<ServerStore>> {
        &self.service
    }

    /// Bind the configured addresses (port 0 picks a free port).
    pub async fn bind(self) -> Result<Bound, ServeError> {
        let bind = |what: &'static str, addr: SocketAddr| async move {
            TcpListener::bind(addr).await.map_err(|source| ServeError::Bind { what, addr, source })
        };
        let optional = |what: &'static str, addr: Option<SocketAddr>| async move {
            match addr {
                Some(addr) => bind(what, addr).await.map(Some),
                None => Ok(None),
            }
        };
        let grpc = optional("gRPC", self.config.grpc_addr).await?;
        let http = optional("HTTP", self.config.http_addr).await?;
        let admin = bind("admin", self.config.admin_addr).await?;
        let proxy = optional("proxy", self.config.proxy.as_ref().map(|p| p.listen)).await?;
        let sync = optional("sync", self.config.regions.as_ref().map(|r| r.sync_addr)).await?;
        Ok(Bound { prepared: self, grpc, http, admin, proxy, sync })
    }
}

/// Bound to its addresses, ready to serve.
#[derive(Debug)]
pub struct Bound {
    prepared: Prepared,
    grpc: Option<TcpListener>,
    http: Option<TcpListener>,
    admin: TcpListener,
    proxy: Option<TcpListener>,
    sync: Option<TcpListener>,
}

impl Bound {
    /// The bound gRPC address.
    pub fn grpc_addr(&self) -> Option<SocketAddr> {
        self.grpc.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// The bound HTTP address.
    pub fn http_addr(&self) -> Option<SocketAddr> {
        self.http.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// The bound proxy address.
    pub fn proxy_addr(&self) -> Option<SocketAddr> {
        self.proxy.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// The bound admin address.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin.local_addr().unwrap_or(self.prepared.config.admin_addr)
    }

    /// Serve until `shutdown` completes; then stop accepting, finish the
    /// requests in flight (at most the grace period) and return.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), ServeError> {
        let (grpc_addr, http_addr, admin_addr, proxy_addr) =
            (self.grpc_addr(), self.http_addr(), self.admin_addr(), self.proxy_addr());
        let sync_addr = self.sync.as_ref().and_then(|l| l.local_addr().ok());
        let Bound { prepared, grpc, http, admin, proxy, sync } = self;
        let Prepared { config, service } = prepared;
        let _watcher: Option<Watcher> = if config.watch && config.rules.dir().is_some() {
            let opts = WatchOptions::default();
            match watch(service.rules().clone(), opts) {
                Ok(w) => Some(w),
                Err(e) => {
                    tracing::warn!("not watching {} for changes: {e}", config.rules);
                    None
                }
            }
        } else {
            None
        };
        let draining = Arc::new(AtomicBool::new(false));
        let options = ConnOptions { header_timeout: config.header_timeout, max_streams: config.max_streams };
        let (stop_tx, stop_rx) = watch::channel(false);
        // Every server is one task naming itself; the first to stop on its
        // own (a failure) stops the rest.
        let mut servers: JoinSet<(&'static str, Result<(), ServerError>)> = JoinSet::new();

        let health = tonic_health::server::HealthReporter::new();
        if let Some(grpc) = grpc {
            let health_service: Health = tonic_health::pb::health_server::HealthServer::new(
                tonic_health::server::HealthService::from_health_reporter(health.clone()),
            );
            health.set_service_status("", tonic_health::ServingStatus::Serving).await;
            for name in [
                "envoy.service.ratelimit.v3.RateLimitService",
                crate::protocol::budget_grpc::SERVICE,
                crate::protocol::leases_grpc::SERVICE,
            ] {
                health.set_service_status(name, tonic_health::ServingStatus::Serving).await;
            }
            let serving = Grpc {
                service: service.clone(),
                health: health_service,
                headers: config.headers,
                max_in_flight: config.max_in_flight,
                max_streams: config.max_streams,
            };
            let (stop, threads) = (stop_rx.clone(), config.grpc_threads);
            let bound = ConnLimit::new(config.max_connections);
            servers.spawn(async move {
                let r = if threads == 0 {
                    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                    let accepting = accept(grpc, vec![tx], bound, stop.clone());
                    tokio::join!(accepting, serve_grpc(held(rx), serving, stop)).1
                } else {
                    per_thread_grpc(threads, grpc, bound, serving, stop).await
                };
                ("gRPC", r)
            });
        }
        if let Some(http) = http {
            let state =
                Arc::new(HttpState { service: service.clone(), headers: config.headers, draining: draining.clone() });
            let router = http::router(state, config.body_limit);
            let bound = ConnLimit::new(config.max_connections);
            let serving = serve_router(http, router, bound, options, stop_rx.clone());
            servers.spawn(async move { ("HTTP", serving.await) });
        }
        let admin_state = Arc::new(AdminState {
            service: service.clone(),
            token: config.admin_token.clone(),
            draining: draining.clone(),
        });
        let bound = ConnLimit::new(config.max_connections);
        let serving = serve_router(admin, admin::router(admin_state), bound, options, stop_rx.clone());
        servers.spawn(async move { ("admin", serving.await) });
        if let (Some(listener), Some(p)) = (proxy, &config.proxy) {
            let decider = ServiceDecider::new(service.clone(), p.domain.clone());
            let layer = RateLimitLayer::new(decider)
                .trusted_proxies(p.trusted.clone())
                .headers(config.headers)
                .max_held(p.max_held);
            let forward = Forward::new(p.upstream.clone(), p.upstream_timeout);
            let bound = ConnLimit::new(config.max_connections);
            let serving = serve_proxy(listener, layer, forward, options, bound, stop_rx.clone(), p.threads);
            servers.spawn(async move { ("proxy", serving.await) });
        }
        // With Redis, per-key entries are kept there, sharded: read misses in
        // batches and follow the other instances' changes.
        let sharing = match (service.store(), service.keys()) {
            (ServerStore::Redis(redis) | ServerStore::RedisRegional(redis, ..), Some(o)) => {
                Some(tokio::spawn(o.share(redis.clone())))
            }
            _ => None,
        };
        if let (Some(listener), Some(regions)) = (sync, service.store().regions()) {
            match regions.state.clone() {
                RegionState::Memory(t) => spawn_sync(&mut servers, t, regions, listener, &stop_rx),
                RegionState::Redis(r) => spawn_sync(&mut servers, r, regions, listener, &stop_rx),
            }
        }
        let sweeper = {
            let service = service.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_secs(10));
                loop {
                    tick.tick().await;
                    service.store().sweep();
                }
            })
        };

        // The dashboard's second (nothing when it is off): the rules'
        // counters and the peer regions' health into their histories.
        let ticker = {
            let service = service.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_secs(1));
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                while service.metrics().dashboard().is_on() {
                    tick.tick().await;
                    let now_s = crate::dashboard::unix_now_s();
                    service.metrics().tick(now_s);
                    if let Some(regions) = service.store().regions_health() {
                        service.metrics().dashboard().tick_peers(&regions, now_s);
                    }
                }
            })
        };
        let show = |a: Option<SocketAddr>| a.map_or_else(|| "off".to_owned(), |a| a.to_string());
        tracing::info!(
            grpc_addr = %show(grpc_addr),
            http_addr = %show(http_addr),
            %admin_addr,
            proxy_addr = %show(proxy_addr),
            sync_addr = %show(sync_addr),
            upstream = %config.proxy.as_ref().map_or_else(String::new, |p| p.upstream.to_string()),
            rules = %config.rules,
            "floodgate serving"
        );

        let failed: Option<String> = tokio::select! {
            () = shutdown => None,
            Some(r) = servers.join_next() => Some(match r {
                Ok((what, Ok(()))) => format!("the {what} server stopped"),
                Ok((what, Err(e))) => format!("the {what} server failed: {e}"),
                Err(e) => format!("a server task failed: {e}"),
            }),
        };
        tracing::info!("shutting down: no new connections; finishing requests in flight");
        draining.store(true, Ordering::Relaxed);
        health.set_service_status("", tonic_health::ServingStatus::NotServing).await;
        let _ = stop_tx.send(true);
        sweeper.abort();
        ticker.abort();
        if let Some(s) = sharing {
            s.abort();
        }
        let all = async { while servers.join_next().await.is_some() {} };
        if tokio::time::timeout(config.shutdown_grace, all).await.is_err() {
            tracing::warn!(grace = ?config.shutdown_grace, "requests still in flight after the grace period; stopping anyway");
        }
        match failed {
            Some(e) => Err(ServeError::Runtime(e)),
            None => Ok(()),
        }
    }
}
