//! `floodgate serve` and `floodgate proxy`: parse and validate every setting
//! and the rules, then bind, then serve until SIGTERM or SIGINT, then drain
//! and exit 0.

use std::net::SocketAddr;
use std::path::PathBuf;

use floodgate_core::parse_duration;
use std::time::Duration;

use floodgate_perkey::CacheOptions;
use floodgate_server::instance::{self as state, OverridesFile};
use floodgate_server::proxy::{ProxyConfig, Upstream};
use floodgate_server::rules::reload::RulesSource;
use floodgate_server::serve::{Config, ServeError, prepare};
use floodgate_server::store::regions::RegionsConfig;
use floodgate_sync::Peer;
use floodgate_tower::{ForwardedHeader, TrustedProxies};

use crate::cli::{CommonArgs, ProxyArgs, ServeArgs};
use crate::exit::Failure;

fn addr(flag: &str, s: &str) -> Result<SocketAddr, Failure> {
    s.parse().map_err(|_| {
        Failure::usage(format!(
            "--{flag} `{s}`: give an address as IP:PORT, e.g. 0.0.0.0:8081 (port 0 picks a free port)"
        ))
    })
}

/// An address, or `none` for a server that is not started.
fn optional_addr(flag: &str, s: &str) -> Result<Option<SocketAddr>, Failure> {
    match s {
        "none" | "off" | "" => Ok(None),
        s => addr(flag, s).map(Some),
    }
}

fn duration(flag: &str, s: &str) -> Result<Duration, Failure> {
    match parse_duration(s) {
        Ok(d) if !d.is_zero() => Ok(d),
        Ok(_) => Err(Failure::usage(format!("--{flag}: give a positive duration, e.g. 100ms or 10s"))),
        Err(e) => Err(Failure::usage(format!("--{flag}: {e}"))),
    }
}

fn serve_config(args: &ServeArgs) -> Result<Config, Failure> {
    Ok(Config {
        grpc_addr: optional_addr("grpc-addr", &args.grpc_addr)?,
        http_addr: optional_addr("http-addr", &args.http_addr)?,
        body_limit: args.body_limit,
        grpc_threads: args.grpc_threads.unwrap_or_else(cores),
        ..common_config(&args.common)?
    })
}

/// The number of cores (1 when unknown).
fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
}

fn proxy_config(args: &ProxyArgs) -> Result<Config, Failure> {
    let upstream: Upstream = args.upstream.parse().map_err(|e| Failure::usage(format!("--upstream {e}")))?;
    let mut trusted = TrustedProxies::parse_list(&args.trusted_proxies)
        .map_err(|e| Failure::usage(format!("--trusted-proxies: {e}")))?;
    let header: ForwardedHeader = args
        .forwarded_header
        .parse()
        .map_err(|e: floodgate_tower::UnknownForwardedHeader| Failure::usage(format!("--forwarded-header: {e}")))?;
    trusted = trusted.header(header);
    if args.domain.is_empty() {
        return Err(Failure::usage("--domain: give the rules domain requests are decided in, e.g. proxy"));
    }
    let proxy = ProxyConfig {
        listen: addr("listen", &args.listen)?,
        upstream,
        domain: args.domain.clone(),
        trusted,
        upstream_timeout: duration("upstream-timeout", &args.upstream_timeout)?,
        threads: args.threads.unwrap_or_else(cores),
        max_held: args.max_held,
    };
    Ok(Config {
        grpc_addr: None,
        http_addr: optional_addr("http-addr", &args.http_addr)?,
        proxy: Some(proxy),
        ..common_config(&args.common)?
    })
}

fn common_config(args: &CommonArgs) -> Result<Config, Failure> {
    let redis = match args.store.as_str() {
        "memory" => None,
        other => {
            let target: floodgate_redis::Target = other
                .parse()
                .map_err(|e| Failure::usage(format!("--store `{other}`: use memory, or a Redis address: {e}")))?;
            let mut c = floodgate_redis::RedisConfig::new(target);
            c.timeout = duration("redis-timeout", &args.redis_timeout)?;
            c.key_prefix.clone_from(&args.redis_prefix);
            Some(c)
        }
    };
    let headers = args
        .response_headers
        .parse()
        .map_err(|e: floodgate_core::headers::UnknownHeaderMode| Failure::usage(format!("--response-headers: {e}")))?;
    let grace = parse_duration(&args.shutdown_grace).map_err(|e| Failure::usage(format!("--shutdown-grace: {e}")))?;
    if args.max_keys == 0 {
        return Err(Failure::usage("--max-keys: give at least 1"));
    }
    if args.max_in_flight == 0 {
        return Err(Failure::usage("--max-in-flight: give at least 1"));
    }
    if args.max_connections == 0 {
        return Err(Failure::usage("--max-connections: give at least 1"));
    }
    if args.max_streams == 0 {
        return Err(Failure::usage("--max-streams: give at least 1"));
    }
    let header_timeout = duration("header-timeout", &args.header_timeout)?;
    if args.key_cache == 0 {
        return Err(Failure::usage("--key-cache: give at least 1"));
    }
    if args.key_cache > floodgate_perkey::MAX_CACHE_ENTRIES {
        return Err(Failure::usage(format!(
            "--key-cache: give at most {} answers (each takes {} bytes of a table allocated whole at the first answer)",
            floodgate_perkey::MAX_CACHE_ENTRIES,
            floodgate_perkey::BYTES_PER_COMPACT_ANSWER
        )));
    }
    let ttl = args.key_cache_ttl.as_deref().map(|t| duration("key-cache-ttl", t)).transpose()?;
    let key_cache = CacheOptions { entries: args.key_cache, ttl };
    let admin_addr = addr("admin-addr", &args.admin_addr)?;
    let overrides = match args.overrides_file.as_deref() {
        Some("none" | "") => OverridesFile::Off,
        Some(p) => OverridesFile::At(PathBuf::from(p)),
        None => {
            let instance = args.instance.clone().unwrap_or_else(|| state::instance_for(admin_addr));
            state::check_instance_name(&instance).map_err(|e| Failure::usage(format!("--instance: {e}")))?;
            let state_dir = args.state_dir.clone().unwrap_or_else(state::default_state_dir);
            OverridesFile::Instance { state_dir, instance }
        }
    };
    let rules = match &args.config {
        Some(dir) => RulesSource::Dir(dir.clone()),
        None => RulesSource::Embedded(floodgate_server::BUNDLED_RULES),
    };
    let regions = regions_config(args)?;
    Ok(Config {
        rules,
        regions,
        admin_addr,
        admin_token: args.admin_token.clone(),
        headers,
        overrides,
        key_cache,
        redis,
        max_keys: args.max_keys,
        max_connections: args.max_connections,
        max_in_flight: args.max_in_flight,
        header_timeout,
        max_streams: args.max_streams,
        dashboard: args.dashboard == "on",
        watch: !args.no_watch,
        shutdown_grace: grace,
        ..Config::default()
    })
}

/// `--region`, `--peers` and the sync settings, when this instance is part
/// of several regions.
fn regions_config(args: &CommonArgs) -> Result<Option<RegionsConfig>, Failure> {
    let (region, peers) = match (&args.region, &args.peers) {
        (None, None) => {
            if args.sync_addr.is_some() {
                return Err(Failure::usage("--sync-addr needs --region NAME and --peers NAME=URL,..."));
            }
            return Ok(None);
        }
        (None, Some(_)) => return Err(Failure::usage("--peers needs --region: name this instance's region")),
        (Some(_), None) => {
            return Err(Failure::usage("--region needs --peers: list the other regions as NAME=http://HOST:PORT,..."));
        }
        (Some(r), Some(p)) => (r.clone(), p),
    };
    let peers = peers
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (name, url) = p.split_once('=').ok_or_else(|| {
                Failure::usage(format!(
                    "--peers `{p}`: write NAME=http://HOST:PORT (the peer's --region and --sync-addr)"
                ))
            })?;
            Ok(Peer { name: name.trim().to_owned(), url: url.trim().to_owned() })
        })
        .collect::<Result<Vec<_>, Failure>>()?;
    if peers.is_empty() {
        return Err(Failure::usage("--peers: list at least one other region as NAME=http://HOST:PORT"));
    }
    let sync_addr = match &args.sync_addr {
        Some(a) => addr("sync-addr", a)?,
        None => {
            return Err(Failure::usage(
                "--region needs --sync-addr: where this region's peers send their usage (e.g. 0.0.0.0:8082, with --sync-token)",
            ));
        }
    };
    if args.sync_token.as_deref().is_some_and(str::is_empty) {
        return Err(Failure::usage("--sync-token is empty: give a secret shared by every region"));
    }
    if args.sync_token.is_none() && !sync_addr.ip().is_loopback() {
        return Err(Failure::usage(format!(
            "the sync address {sync_addr} is not loopback and no --sync-token is set: set one (FLOODGATE_SYNC_TOKEN, the same in every region) or bind it to 127.0.0.1"
        )));
    }
    let interval = duration("sync-interval", &args.sync_interval)?;
    Ok(Some(RegionsConfig {
        region,
        peers,
        sync_addr,
        interval,
        timeout: duration("sync-timeout", &args.sync_timeout)?,
        lazy: match &args.sync_lazy {
            // Zero is allowed: nothing waits.
            Some(l) => parse_duration(l).map_err(|e| Failure::usage(format!("--sync-lazy: {e}")))?,
            None => interval.saturating_mul(10),
        },
        // Zero is allowed: no wait.
        warmup: parse_duration(&args.sync_warmup).map_err(|e| Failure::usage(format!("--sync-warmup: {e}")))?,
        token: args.sync_token.clone(),
    }))
}

fn init_logging(format: &str) -> Result<(), Failure> {
    let filter = tracing_subscriber::EnvFilter::try_from_env("FLOODGATE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi);
    match format {
        "text" => builder.init(),
        "json" => builder.json().init(),
        _ => return Err(Failure::usage(format!("--log-format `{format}`: use text or json"))),
    }
    Ok(())
}

/// Resolves on SIGTERM or SIGINT.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => tracing::info!("SIGINT received"),
        () = term => tracing::info!("SIGTERM received"),
    }
}

/// `floodgate serve`.
pub(crate) fn run(args: &ServeArgs) -> Result<(), Failure> {
    start(serve_config(args)?, &args.common)
}

/// `floodgate proxy`.
pub(crate) fn run_proxy(args: &ProxyArgs) -> Result<(), Failure> {
    start(proxy_config(args)?, &args.common)
}

fn start(config: Config, args: &CommonArgs) -> Result<(), Failure> {
    init_logging(&args.log_format)?;
    let prepared = prepare(config).map_err(|e| match e {
        ServeError::Config(m) => Failure::usage(m),
        e => Failure::runtime(e.to_string()),
    })?;
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = args.workers {
        rt.worker_threads(n.max(1));
    }
    let rt = rt.enable_all().build().map_err(|e| Failure::runtime(format!("cannot start the runtime: {e}")))?;
    rt.block_on(async move {
        let bound = prepared.bind().await.map_err(|e| Failure::runtime(e.to_string()))?;
        bound.run(shutdown_signal()).await.map_err(|e| Failure::runtime(e.to_string()))
    })?;
    tracing::info!("stopped");
    Ok(())
}
