//! Command-line definitions.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// floodgate: a rate limiter you can run as a service or link as a library.
#[derive(Debug, Parser)]
#[command(name = "floodgate", version, about, long_about = None)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Replay a trace of requests (JSON lines on stdin) through an algorithm.
    ///
    /// Each input line is {"at_ms": 1200, "key": "alice", "hits": 1} (hits
    /// optional, default 1; at_ms non-decreasing, read as the clock, so
    /// windows align to at_ms = 0). Each output line is the decision:
    /// {"allowed": true, "remaining": 4, "reset_after_ms": 800,
    /// "retry_after_ms": null}, with waits rounded up to whole milliseconds.
    ///
    /// With --report, runs every algorithm on the trace instead and prints
    /// how often each disagrees with sliding_log, the exact answer.
    Simulate(SimulateArgs),
    /// Check a rules directory: every error with file:line:col and what to
    /// write instead (exit 64), or a summary of what it holds (exit 0).
    Validate(ValidateArgs),
    /// Run the rate-limit service: Envoy RLS v3 gRPC, the HTTP API, the
    /// admin API and metrics. With no arguments it serves the bundled
    /// example rules (examples/config, compiled in) from the in-memory store.
    Serve(ServeArgs),
    /// Run a rate-limiting reverse proxy in front of one HTTP upstream:
    /// requests over their limit get 429 with Retry-After and rate-limit
    /// headers, shaping limits delay them, the rest are forwarded.
    Proxy(ProxyArgs),
    /// Ask a running server for one decision over gRPC and print it; exit 0
    /// when allowed, 1 when denied, 2 when the server cannot be reached.
    Check(CheckArgs),
    /// Load a running server (gRPC or the JSON endpoint) and print
    /// throughput, latency percentiles and the allowed/denied split.
    Bench(BenchArgs),
    /// Per-key limits on a running server (its admin API): get, set and
    /// delete one entry, import and export many (JSON lines or CSV), count
    /// them per tier.
    Keys(KeysArgs),
}

#[derive(Debug, Args)]
pub(crate) struct ServeArgs {
    #[command(flatten)]
    pub(crate) common: CommonArgs,
    /// Envoy RLS v3 gRPC address (port 0 picks a free port; the bound one is
    /// logged; `none` serves no gRPC).
    #[arg(long, env = "FLOODGATE_GRPC_ADDR", default_value = "0.0.0.0:8081")]
    pub(crate) grpc_addr: String,
    /// HTTP API address (/json, /v1/check, /healthz, /readyz, /metrics; `none`: off).
    #[arg(long, env = "FLOODGATE_HTTP_ADDR", default_value = "0.0.0.0:8080")]
    pub(crate) http_addr: String,
    /// Largest HTTP request body, in bytes.
    #[arg(long, env = "FLOODGATE_BODY_LIMIT", default_value_t = 65536)]
    pub(crate) body_limit: usize,
    /// Serve gRPC on this many single-threaded runtimes, connections handed
    /// out round-robin (default: one per core; 0: on the shared runtime).
    #[arg(long, env = "FLOODGATE_GRPC_THREADS")]
    pub(crate) grpc_threads: Option<usize>,
}

#[derive(Debug, Args)]
pub(crate) struct ProxyArgs {
    /// Where to forward requests: http://HOST:PORT[/BASE/PATH].
    #[arg(long, env = "FLOODGATE_UPSTREAM")]
    pub(crate) upstream: String,
    /// Where clients connect (HTTP/1.1 and HTTP/2).
    #[arg(long, env = "FLOODGATE_LISTEN", default_value = "0.0.0.0:8000")]
    pub(crate) listen: String,
    /// The rules domain requests are decided in; its `request_descriptors`
    /// build the descriptors (default: remote_address = client IP).
    #[arg(long, env = "FLOODGATE_DOMAIN", default_value = "proxy")]
    pub(crate) domain: String,
    /// Proxies in front of this one (comma-separated CIDRs: 10.0.0.0/8,::1)
    /// whose forwarding header is believed; the client is the right-most
    /// hop not among them. Default: none (the peer address is the client).
    #[arg(long, env = "FLOODGATE_TRUSTED_PROXIES", default_value = "")]
    pub(crate) trusted_proxies: String,
    /// The header the trusted proxies append to: x-forwarded-for or forwarded.
    #[arg(long, env = "FLOODGATE_FORWARDED_HEADER", default_value = "x-forwarded-for")]
    pub(crate) forwarded_header: String,
    /// The longest the upstream may take to start its response (then 504).
    #[arg(long, env = "FLOODGATE_UPSTREAM_TIMEOUT", default_value = "30s")]
    pub(crate) upstream_timeout: String,
    /// HTTP API address for /metrics, /healthz, /readyz (and /json,
    /// /v1/check); `none`: off.
    #[arg(long, env = "FLOODGATE_HTTP_ADDR", default_value = "none")]
    pub(crate) http_addr: String,
    /// Hold at most this many requests for shaping delays at once (each
    /// shaping rule's burst bounds them per key; this bounds them all); one
    /// more is answered 503 with Retry-After.
    #[arg(long, env = "FLOODGATE_MAX_HELD", default_value_t = floodgate_tower::DEFAULT_MAX_HELD)]
    pub(crate) max_held: usize,
    /// Serve on this many single-threaded runtimes, connections handed out
    /// round-robin, each with its own upstream pool (default: one per core;
    /// 0: on the shared runtime).
    #[arg(long, env = "FLOODGATE_PROXY_THREADS")]
    pub(crate) threads: Option<usize>,
    #[command(flatten)]
    pub(crate) common: CommonArgs,
}

/// The settings `serve` and `proxy` share.
#[derive(Debug, Args)]
pub(crate) struct CommonArgs {
    /// Rules directory, watched for changes (default: the bundled example
    /// rules, compiled in, named <embedded>/FILE, not watched).
    #[arg(long, env = "FLOODGATE_CONFIG")]
    pub(crate) config: Option<PathBuf>,
    /// Admin API address; a non-loopback address needs --admin-token.
    #[arg(long, env = "FLOODGATE_ADMIN_ADDR", default_value = "127.0.0.1:9090")]
    pub(crate) admin_addr: String,
    /// Bearer token every admin call must carry.
    #[arg(long, env = "FLOODGATE_ADMIN_TOKEN", hide_env_values = true)]
    pub(crate) admin_token: Option<String>,
    /// Where counters live: `memory` (this process), `redis://HOST:PORT[/DB]`
    /// (one Redis, shared by every instance), or
    /// `redis+cluster://HOST:PORT[,HOST:PORT...]` (a Redis Cluster).
    #[arg(long, env = "FLOODGATE_STORE", default_value = "memory")]
    pub(crate) store: String,
    /// The longest a decision waits for Redis (connecting included) before
    /// the rule's failure_mode decides.
    #[arg(long, env = "FLOODGATE_REDIS_TIMEOUT", default_value = "100ms")]
    pub(crate) redis_timeout: String,
    /// Prefix of every Redis key floodgate writes.
    #[arg(long, env = "FLOODGATE_REDIS_PREFIX", default_value = "fg:")]
    pub(crate) redis_prefix: String,
    /// Bound on the in-memory store's keys (the oldest-expiring are evicted beyond it).
    #[arg(long, env = "FLOODGATE_MAX_KEYS", default_value_t = floodgate_core::store::memory::DEFAULT_MAX_KEYS)]
    pub(crate) max_keys: usize,
    /// Connections each listener (gRPC, HTTP API, admin API, proxy) holds
    /// open at most; beyond, new ones wait in the kernel's backlog until one
    /// closes.
    #[arg(long, env = "FLOODGATE_MAX_CONNECTIONS", default_value_t = floodgate_server::listen::DEFAULT_MAX_CONNECTIONS)]
    pub(crate) max_connections: usize,
    /// gRPC requests in flight at most, counted from their arrival (shared
    /// out among the gRPC threads); one more is answered RESOURCE_EXHAUSTED
    /// at once, so an overloaded server answers what it accepts in bounded
    /// time.
    #[arg(long, env = "FLOODGATE_MAX_IN_FLIGHT", default_value_t = floodgate_server::listen::overload::DEFAULT_MAX_IN_FLIGHT)]
    pub(crate) max_in_flight: usize,
    /// The longest an HTTP/1 client may take to send a request's head (HTTP
    /// API, admin API, proxy); then its connection is closed.
    #[arg(long, env = "FLOODGATE_HEADER_TIMEOUT", default_value = "10s")]
    pub(crate) header_timeout: String,
    /// HTTP/2 requests a client may have open on one connection at once
    /// (every listener; gRPC included). A client at the bound waits to open
    /// more, so an overloaded server's queue stays short.
    #[arg(long, env = "FLOODGATE_MAX_STREAMS", default_value_t = floodgate_server::listen::DEFAULT_MAX_STREAMS)]
    pub(crate) max_streams: u32,
    /// Keep the dashboard's data (per-rule decisions per second, top keys)
    /// for `/dashboard` on the admin address: `on` or `off`.
    #[arg(long, env = "FLOODGATE_DASHBOARD", default_value = "on", value_parser = ["on", "off"])]
    pub(crate) dashboard: String,
    /// File where per-key entries (and runtime overrides) persist, or
    /// `none` to disable them (default: STATE_DIR/INSTANCE/overrides.redb).
    #[arg(long, env = "FLOODGATE_OVERRIDES_FILE")]
    pub(crate) overrides_file: Option<String>,
    /// Per-key answers cached: tier and "no entry" answers in a table of
    /// ~19 bytes an answer (least frequently used with aging), answers with
    /// their own limits in up to as many more (~170 bytes each, S3-FIFO).
    #[arg(long, env = "FLOODGATE_KEY_CACHE", default_value_t = floodgate_perkey::DEFAULT_CACHE_ENTRIES)]
    pub(crate) key_cache: usize,
    /// How long a cached per-key answer is used before it is read again
    /// (default: 5m with a Redis store, where an answer hit in the last
    /// half of it is read again in the background first; none on disk,
    /// where every write goes through this process).
    #[arg(long, env = "FLOODGATE_KEY_CACHE_TTL")]
    pub(crate) key_cache_ttl: Option<String>,
    /// Where instances keep their own files (default: $XDG_STATE_HOME/floodgate,
    /// else ~/.local/state/floodgate, else for a user with no home
    /// floodgate-UID in the temp dir).
    #[arg(long, env = "FLOODGATE_STATE_DIR")]
    pub(crate) state_dir: Option<PathBuf>,
    /// This instance's name: its files live in STATE_DIR/NAME (default:
    /// admin-IP-PORT of --admin-addr, so instances side by side never share
    /// files and a restart finds its own).
    #[arg(long, env = "FLOODGATE_INSTANCE")]
    pub(crate) instance: Option<String>,
    /// Rate-limit headers to send: none, x-ratelimit, ietf or both.
    #[arg(long, env = "FLOODGATE_RESPONSE_HEADERS", default_value = "both")]
    pub(crate) response_headers: String,
    /// Log format: text or json (level from FLOODGATE_LOG, e.g. debug).
    #[arg(long, env = "FLOODGATE_LOG_FORMAT", default_value = "text")]
    pub(crate) log_format: String,
    /// Do not watch the rules directory (reload through the admin API only).
    #[arg(long, env = "FLOODGATE_NO_WATCH")]
    pub(crate) no_watch: bool,
    /// How long shutdown waits for requests in flight: 10s, 500ms...
    #[arg(long, env = "FLOODGATE_SHUTDOWN_GRACE", default_value = "10s")]
    pub(crate) shutdown_grace: String,
    /// Worker threads (default: one per core).
    #[arg(long, env = "FLOODGATE_WORKERS")]
    pub(crate) workers: Option<usize>,
    /// This instance's region, for rules with scope: global (their usage is
    /// shared with the --peers regions).
    #[arg(long, env = "FLOODGATE_REGION")]
    pub(crate) region: Option<String>,
    /// The peer regions and their sync addresses: NAME=http://HOST:PORT,...
    #[arg(long, env = "FLOODGATE_PEERS")]
    pub(crate) peers: Option<String>,
    /// Where this region's sync service listens for its peers (port 0 picks
    /// one); a non-loopback address needs --sync-token.
    #[arg(long, env = "FLOODGATE_SYNC_ADDR")]
    pub(crate) sync_addr: Option<String>,
    /// How often usage of global limits is sent to each peer.
    #[arg(long, env = "FLOODGATE_SYNC_INTERVAL", default_value = "100ms")]
    pub(crate) sync_interval: String,
    /// The longest one sync call may take, connecting included.
    #[arg(long, env = "FLOODGATE_SYNC_TIMEOUT", default_value = "1s")]
    pub(crate) sync_timeout: String,
    /// The longest a key far below its limit waits before its usage is
    /// sent (its unsent hits below 1% of what is left, over the regions);
    /// 0s sends every key at the next interval. Default: ten
    /// --sync-interval.
    #[arg(long, env = "FLOODGATE_SYNC_LAZY")]
    pub(crate) sync_lazy: Option<String>,
    /// How long a region that knows nothing yet (it just started, or its
    /// Redis restarted empty) waits for its first peer's full state before
    /// it admits on eventual global rules; until then it admits nothing
    /// there (it cannot tell a spent key from a fresh one). 0s admits its
    /// share of each limit at once.
    #[arg(long, env = "FLOODGATE_SYNC_WARMUP", default_value = "1s")]
    pub(crate) sync_warmup: String,
    /// The bearer token every region's sync service requires (the same in
    /// every region).
    #[arg(long, env = "FLOODGATE_SYNC_TOKEN", hide_env_values = true)]
    pub(crate) sync_token: Option<String>,
}

#[derive(Debug, Args)]
pub(crate) struct CheckArgs {
    /// The server's gRPC address.
    #[arg(long, env = "FLOODGATE_SERVER", default_value = "127.0.0.1:8081")]
    pub(crate) server: String,
    /// The rules domain.
    #[arg(long)]
    pub(crate) domain: String,
    /// One descriptor: key=value entries separated by commas
    /// (`user=alice,method=POST`). Repeat for several descriptors.
    #[arg(long = "descriptor", required = true)]
    pub(crate) descriptors: Vec<String>,
    /// Hits (weight) of the request; 0 only reads the counters.
    #[arg(long, default_value_t = 1)]
    pub(crate) hits: u32,
    /// Print the decision as JSON.
    #[arg(long)]
    pub(crate) json: bool,
    /// Give up after this long: 2s, 500ms...
    #[arg(long, default_value = "5s")]
    pub(crate) timeout: String,
}

#[derive(Debug, Args)]
pub(crate) struct BenchArgs {
    /// The server: host:port of its gRPC (or, with --protocol json or get,
    /// HTTP) address.
    #[arg(long, default_value = "127.0.0.1:8081")]
    pub(crate) server: String,
    /// grpc (RLS ShouldRateLimit), json (POST /json), get (GET --path on
    /// any HTTP server, e.g. through `floodgate proxy`: 2xx counts as
    /// allowed, 429 as denied; no descriptor is sent), budget (a
    /// reservation of one hit and its settle over gRPC,
    /// floodgate.budget.v1.Budget: one request of the run is both calls),
    /// or lease (Envoy's pair for a concurrency limit: an RLS acquire, then
    /// the stream-end release with the lease id the answer carried; one
    /// request of the run is both calls).
    #[arg(long, default_value = "grpc")]
    pub(crate) protocol: String,
    /// The path of --protocol get.
    #[arg(long, default_value = "/")]
    pub(crate) path: String,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 128)]
    pub(crate) concurrency: usize,
    /// Connections (HTTP/2 for gRPC; HTTP/1.1 keeps one per request in flight).
    #[arg(long, default_value_t = 4)]
    pub(crate) connections: usize,
    /// How long to run: 10s, 1m...
    #[arg(long, default_value = "10s")]
    pub(crate) duration: String,
    /// Warm-up before measuring (not counted).
    #[arg(long, default_value = "1s")]
    pub(crate) warmup: String,
    /// Distinct keys (descriptor values).
    #[arg(long, default_value_t = 1)]
    pub(crate) keys: u64,
    /// Key distribution: uniform, or zipf (s = 1), or zipf:S.
    #[arg(long, default_value = "uniform")]
    pub(crate) distribution: String,
    /// Open loop at this many requests per second (latency counted from when
    /// each request was due); without it, as fast as replies come.
    #[arg(long)]
    pub(crate) rate: Option<u64>,
    /// Sending threads, each with its own single-threaded runtime and its
    /// share of the connections and of the requests in flight.
    #[arg(long, default_value_t = 1)]
    pub(crate) threads: usize,
    /// A request with no reply by then counts as an error.
    #[arg(long, default_value = "10s")]
    pub(crate) timeout: String,
    /// The domain sent.
    #[arg(long, default_value = "bench")]
    pub(crate) domain: String,
    /// The descriptor key sent; its value is the key number.
    #[arg(long, default_value = "user")]
    pub(crate) key: String,
    /// Send refunds: every request gives its hit back (`is_negative_hits`
    /// over gRPC and /json), to measure what a refund costs beside a
    /// decision.
    #[arg(long)]
    pub(crate) refund: bool,
    /// The seed of the keys drawn: one seed draws the same keys in the same
    /// order every run (give each run its own to load a server whose cache
    /// is already warm with new draws).
    #[arg(long, default_value_t = 0x5EED)]
    pub(crate) seed: u64,
    /// Print the result as JSON.
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Debug, Args)]
pub(crate) struct ValidateArgs {
    /// Directory of rules files (*.yaml, *.yml; searched recursively).
    pub(crate) dir: PathBuf,
}

#[derive(Debug, Args)]
pub(crate) struct SimulateArgs {
    /// fixed_window, sliding_log, sliding_window, sliding_buckets,
    /// token_bucket, gcra or leaky_bucket (optional with --report).
    #[arg(long, required_unless_present_any = ["report", "goals", "regions", "budget"])]
    pub(crate) algorithm: Option<String>,
    /// Requests (units) per window.
    #[arg(long, required_unless_present = "goals")]
    pub(crate) limit: Option<u64>,
    /// Window: 250ms, 1s, 90s, 1m, 1h, 1d...
    #[arg(long, required_unless_present = "goals")]
    pub(crate) window: Option<String>,
    /// Capacity of token_bucket, gcra, leaky_bucket (default: the limit).
    #[arg(long)]
    pub(crate) burst: Option<u64>,
    /// Sub-windows of sliding_buckets (with --report, default: about 10).
    #[arg(long)]
    pub(crate) granularity: Option<u32>,
    /// leaky_bucket mode: meter (default) or shape (adds "delay_ms").
    #[arg(long)]
    pub(crate) mode: Option<String>,
    /// Compare every algorithm with the exact sliding_log instead of printing
    /// decisions.
    #[arg(long)]
    pub(crate) report: bool,
    /// Also draw what each algorithm admits over time on the trace's
    /// busiest key, beside the limit and the exact sliding_log: an SVG (or
    /// an HTML page holding it). With --report, every algorithm.
    #[arg(long, value_name = "FILE.svg|FILE.html", conflicts_with_all = ["goals", "regions"])]
    pub(crate) plot: Option<String>,
    /// Replay requests whose cost is known at their end (a trace of starts
    /// with estimates and ends with actual costs) three ways: the exact
    /// answer, "peek, then charge after", and "reserve, then settle"; a
    /// fixed window of --limit per --window.
    #[arg(long, conflicts_with_all = ["report", "plot", "algorithm", "goals", "regions"])]
    pub(crate) budget: bool,
    /// With --budget: generate closed-loop traces instead of reading one,
    /// and print the over-admission of both ways by requests in flight and
    /// estimate error, beside its bound.
    #[arg(long, requires = "budget")]
    pub(crate) table: bool,
    #[command(flatten)]
    pub(crate) regions: RegionSimArgs,
}

/// `simulate --regions`: a deterministic WAN simulation of regions sharing a
/// `scope: global` limit (no input read; nothing sleeps).
#[derive(Debug, Default, Args)]
pub(crate) struct RegionSimArgs {
    /// Simulate these regions sharing the limit: names, comma-separated
    /// (e.g. a,b,c).
    #[arg(long, value_name = "NAMES")]
    pub(crate) regions: Option<String>,
    /// One-way latency per pair: a-b=30ms,a-c=70ms,... (default: for a,b,c
    /// 30, 70 and 120 ms; else 50 ms for every pair).
    #[arg(long, requires = "regions")]
    pub(crate) latency: Option<String>,
    /// Each message's latency varies by up to ± this.
    #[arg(long, default_value = "10ms", requires = "regions")]
    pub(crate) jitter: String,
    /// Messages lost, as a percentage.
    #[arg(long, default_value = "1%", requires = "regions")]
    pub(crate) loss: String,
    /// Messages delivered twice, as a percentage.
    #[arg(long, default_value = "1%", requires = "regions")]
    pub(crate) dup: String,
    /// Messages delivered after later ones, as a percentage.
    #[arg(long, default_value = "1%", requires = "regions")]
    pub(crate) reorder: String,
    /// How often each region sends its usage.
    #[arg(long, default_value = "100ms", requires = "regions")]
    pub(crate) sync_interval: String,
    /// Traffic per region, as weights (70,20,10; default: even).
    #[arg(long, requires = "regions")]
    pub(crate) split: Option<String>,
    /// steady, burst, round-robin, shift, partition, tiny, heavy,
    /// many-keys, restart, skew, trickle, crashloop, partition-crash,
    /// instance-crash or budget (refunds and late charges).
    #[arg(long, default_value = "steady", requires = "regions")]
    pub(crate) pattern: String,
    /// For --pattern crashloop: how often the last region crashes in each
    /// window (after the first), each time right after taking its slice.
    #[arg(long, default_value_t = 5, requires = "regions", value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub(crate) crashes: u32,
    /// Offered load, in limits per window.
    #[arg(long, default_value_t = 2.0, requires = "regions")]
    pub(crate) offered: f64,
    /// How long to simulate, in windows.
    #[arg(long, default_value_t = 3, requires = "regions")]
    pub(crate) windows: u64,
    /// Distinct keys (many-keys: at least 2.5 batches' worth).
    #[arg(long, default_value_t = 1, requires = "regions")]
    pub(crate) keys: u32,
    /// Keys per sync batch.
    #[arg(long, default_value_t = 1000, requires = "regions")]
    pub(crate) batch: usize,
    /// eventual or bounded.
    #[arg(long = "sync", default_value = "eventual", requires = "regions")]
    pub(crate) sync_mode: String,
    /// For --sync bounded: 5%, 0.5%, 0.05...
    #[arg(long, requires = "regions")]
    pub(crate) overshoot: Option<String>,
    /// The first random seed.
    #[arg(long, default_value_t = 1, requires = "regions")]
    pub(crate) seed: u64,
    /// Seeds to run (seed, seed + 1, ...), summed.
    #[arg(long, default_value_t = 1, requires = "regions")]
    pub(crate) seeds: u64,
    /// Print JSON instead of text.
    #[arg(long, requires = "regions")]
    pub(crate) json: bool,
    /// Run the many-regions goals instead (the setting for every
    /// mode, algorithm, window and pattern) and print their table.
    #[arg(long)]
    pub(crate) goals: bool,
    /// Seeds per bounded row of --goals (each must keep the cap).
    #[arg(long, default_value_t = 100)]
    pub(crate) goals_seeds: u64,
}

#[derive(Debug, Args)]
pub(crate) struct KeysArgs {
    #[command(subcommand)]
    pub(crate) action: KeysAction,
    /// The server's admin address.
    #[arg(long, global = true, env = "FLOODGATE_ADMIN_ADDR", default_value = "127.0.0.1:9090")]
    pub(crate) admin_addr: String,
    /// The server's admin token.
    #[arg(long, global = true, env = "FLOODGATE_ADMIN_TOKEN", hide_env_values = true)]
    pub(crate) admin_token: Option<String>,
}

/// One entry: its domain and exact descriptor.
#[derive(Debug, Args)]
pub(crate) struct KeyRef {
    /// The domain.
    #[arg(long)]
    pub(crate) domain: String,
    /// A descriptor entry, KEY=VALUE; repeat it for each entry, in order.
    #[arg(long = "descriptor", short = 'd', required = true)]
    pub(crate) descriptor: Vec<String>,
}

#[derive(Debug, Subcommand)]
pub(crate) enum KeysAction {
    /// Print one entry (exit 1 when there is none).
    Get(KeyRef),
    /// Set one entry: a tier of the domain, or its own limits.
    Set {
        #[command(flatten)]
        key: KeyRef,
        /// A tier of the domain's rules file.
        #[arg(long, conflicts_with = "limits", required_unless_present = "limits")]
        tier: Option<String>,
        /// Its own limits: a rate_limit block (or a list) as JSON, e.g.
        /// '{"unit": "second", "requests_per_unit": 5}'.
        #[arg(long)]
        limits: Option<String>,
        /// The metrics label of its own limits (default per-key).
        #[arg(long, requires = "limits")]
        name: Option<String>,
    },
    /// Delete one entry (exit 1 when there was none).
    Delete(KeyRef),
    /// Write the entries of FILE (JSON lines, or CSV with a header) in
    /// batches, each all or nothing; a bad line stops the import, reported
    /// with its line number (the batches before it are written; importing
    /// again is harmless: an entry is set, not added).
    Import {
        /// The file (`-`: standard input).
        file: String,
        /// jsonl or csv (default: from the file name; `.csv` is CSV).
        #[arg(long)]
        format: Option<String>,
        /// Entries per batch (one transaction on the server), up to 10000.
        #[arg(long, default_value_t = 5_000)]
        batch: usize,
    },
    /// Write every entry (of --domain, under --prefix) as JSON lines or
    /// CSV, in (domain, descriptor) order.
    Export {
        /// Only this domain.
        #[arg(long)]
        domain: Option<String>,
        /// Only descriptors starting so, written KEY=VALUE, KEY=VALUE (needs
        /// --domain).
        #[arg(long, requires = "domain", default_value = "")]
        prefix: String,
        /// jsonl or csv (default: from --output's name; JSON lines).
        #[arg(long)]
        format: Option<String>,
        /// The file to write (default: standard output).
        #[arg(long)]
        output: Option<String>,
    },
    /// Entries per (domain, tier).
    Tiers,
}

/// A server address flag (`--server`, `--admin-addr`) given as `host:port`
/// or `http://host:port[/]`: its `host:port`. `example` goes in the message.
pub(crate) fn http_authority(flag: &str, given: &str, example: &str) -> Result<String, crate::exit::Failure> {
    use crate::exit::Failure;
    let authority = given.strip_prefix("http://").unwrap_or(given).trim_end_matches('/');
    if authority.is_empty() || authority.contains(['/', '?', '#']) || given.contains("https://") {
        return Err(Failure::usage(format!(
            "--{flag} `{given}`: give host:port (or http://host:port), e.g. {example}"
        )));
    }
    if authority.parse::<hyper::http::uri::Authority>().is_err() {
        return Err(Failure::usage(format!("--{flag} `{given}`: `{authority}` is not a host:port")));
    }
    Ok(authority.to_owned())
}
