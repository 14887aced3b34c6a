//! The tower layer's per-request cost beside `tower_governor`'s, in one run:
//! the same inner service, the same requests (axum `ConnectInfo` peer
//! addresses), each layer limiting per peer IP with a limit never reached
//! (the allow path, the common one), or one spent (the deny path).
//!
//! `cargo bench -p floodgate-tower --bench layer`

use std::convert::Infallible;
use std::future::poll_fn;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::response::IntoResponse;
use criterion::{Criterion, criterion_group};
use floodgate_core::{Algorithm, Limit, MemoryStore};
use floodgate_tower::{HeaderMode, Key, KeyedLimit, RateLimitLayer};
use http::{Request, Response};
use tower_layer::Layer;
use tower_service::Service;

#[derive(Clone)]
struct Ok200;

impl Service<Request<Body>> for Ok200 {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Response<Body>, Infallible>>;

    fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Infallible>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Request<Body>) -> Self::Future {
        std::future::ready(Ok(Response::new(Body::empty())))
    }
}

fn request(ip: u32) -> Request<Body> {
    let addr = SocketAddr::new(IpAddr::V4(Ipv4Addr::from(ip)), 40000);
    Request::builder().uri("/").extension(ConnectInfo(addr)).body(Body::empty()).unwrap()
}

/// One request through `svc` on a current-thread runtime; the status.
fn once<S, B>(rt: &tokio::runtime::Runtime, svc: &mut S, ip: u32) -> u16
where
    S: Service<Request<Body>, Response = Response<B>, Error = Infallible>,
{
    rt.block_on(async {
        poll_fn(|cx| svc.poll_ready(cx)).await.unwrap();
        svc.call(request(ip)).await.unwrap().status().as_u16()
    })
}

/// The same, the response then converted as an axum `Router` converts
/// every response of a layer (`IntoResponse`: a body that is not axum's own
/// `Body` is boxed).
fn once_in_axum<S, B>(rt: &tokio::runtime::Runtime, svc: &mut S, ip: u32) -> u16
where
    S: Service<Request<Body>, Response = Response<B>, Error = Infallible>,
    Response<B>: IntoResponse,
{
    rt.block_on(async {
        poll_fn(|cx| svc.poll_ready(cx)).await.unwrap();
        svc.call(request(ip)).await.unwrap().into_response().status().as_u16()
    })
}

const HUGE: u64 = 1 << 40;

/// tower_governor's configuration builder: a cell every nanosecond (never
/// reached), or for the spent case one an hour (the first request takes the
/// burst of 1, every later one is denied).
macro_rules! governor_config {
    ($spent:expr, $burst:expr) => {{
        let mut b = tower_governor::governor::GovernorConfigBuilder::default();
        if $spent {
            b.per_second(3600);
        } else {
            b.per_nanosecond(1);
        }
        b.burst_size($burst);
        b
    }};
}

/// Spend the limit of the spent cases, and check every layer answers as the
/// case says (a bench that measured allowed requests as denied ones would
/// compare nothing).
fn expect<S, B>(rt: &tokio::runtime::Runtime, svc: &mut S, spent: bool, name: &str)
where
    S: Service<Request<Body>, Response = Response<B>, Error = Infallible>,
{
    let first = once(rt, svc, 0x0a00_0000);
    let second = once(rt, svc, 0x0a00_0000);
    let want = if spent { 429 } else { 200 };
    assert_eq!((first, second), (200, want), "{name}");
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    for (case, keys, spent) in
        [("one_ip_allowed", 1u32, false), ("1k_ips_allowed", 1000, false), ("one_ip_denied", 1, true)]
    {
        let mut g = c.benchmark_group(format!("layer/{case}"));
        let (limit, burst) = if spent { (1u64, 1u32) } else { (HUGE, u32::MAX) };
        let mut i = 0u32;
        let mut next = move || {
            i = (i + 1) % keys;
            0x0a00_0000 + i
        };

        let mut bare = Ok200;
        g.bench_function("no_layer", |b| b.iter(|| once(&rt, &mut bare, next())));

        let keyed = |mode| {
            let l = Limit::new(Algorithm::Gcra { burst: Some(limit) }, limit, Duration::from_secs(1)).unwrap();
            RateLimitLayer::new(KeyedLimit::new(l, Key::ClientIp, MemoryStore::new())).headers(mode)
        };
        // As an axum app would use it: axum's own body type, not wrapped.
        for (name, mode) in [
            ("floodgate", HeaderMode::None),
            ("floodgate_x_headers", HeaderMode::XRateLimit),
            ("floodgate_headers", HeaderMode::Both),
        ] {
            let mut svc = keyed(mode).inner_body().layer(Ok200);
            expect(&rt, &mut svc, spent, name);
            g.bench_function(name, |b| b.iter(|| once(&rt, &mut svc, next())));
        }
        // The default, for any inner body type: each body wrapped.
        let mut svc = keyed(HeaderMode::None).layer(Ok200);
        expect(&rt, &mut svc, spent, "floodgate_wrapped");
        g.bench_function("floodgate_wrapped", |b| b.iter(|| once(&rt, &mut svc, next())));
        if case == "one_ip_allowed" {
            g.bench_function("floodgate_wrapped_in_axum", |b| b.iter(|| once_in_axum(&rt, &mut svc, next())));
            let mut svc = keyed(HeaderMode::None).inner_body().layer(Ok200);
            g.bench_function("floodgate_in_axum", |b| b.iter(|| once_in_axum(&rt, &mut svc, next())));
        }

        let config = governor_config!(spent, burst).finish().unwrap();
        let mut svc = tower_governor::GovernorLayer::new(config).layer(Ok200);
        expect(&rt, &mut svc, spent, "tower_governor");
        g.bench_function("tower_governor", |b| b.iter(|| once(&rt, &mut svc, next())));
        let config = governor_config!(spent, burst).use_headers().finish().unwrap();
        let mut svc = tower_governor::GovernorLayer::new(config).layer(Ok200);
        expect(&rt, &mut svc, spent, "tower_governor_headers");
        g.bench_function("tower_governor_headers", |b| b.iter(|| once(&rt, &mut svc, next())));
        g.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    targets = bench
}
/// `LAYER_COUNT=<layer>:<requests>` runs that many allowed requests from one
/// IP through one layer (`none`, `floodgate`, `floodgate_headers` (both
/// with axum's body type), `floodgate_wrapped`, `tower_governor`,
/// `tower_governor_headers`) and exits: a fixed workload
/// for `valgrind --tool=callgrind`, whose instruction counts do not drift
/// with the VM's noise as times do.
fn count(spec: &str) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let (name, n) = spec.split_once(':').expect("LAYER_COUNT=<layer>:<requests>");
    let n: u32 = n.parse().unwrap();
    let mut ok = 0u32;
    let mut run = |svc: &mut dyn FnMut() -> u16| (0..n).for_each(|_| ok += u32::from(svc() == 200));
    match name {
        "none" => run(&mut || once(&rt, &mut Ok200, 0x0a00_0001)),
        "floodgate" | "floodgate_headers" | "floodgate_wrapped" => {
            let mode = if name == "floodgate_headers" { HeaderMode::Both } else { HeaderMode::None };
            let l = Limit::new(Algorithm::Gcra { burst: Some(HUGE) }, HUGE, Duration::from_secs(1)).unwrap();
            let layer = RateLimitLayer::new(KeyedLimit::new(l, Key::ClientIp, MemoryStore::new())).headers(mode);
            if name == "floodgate_wrapped" {
                let mut svc = layer.layer(Ok200);
                run(&mut || once(&rt, &mut svc, 0x0a00_0001));
            } else {
                let mut svc = layer.inner_body().layer(Ok200);
                run(&mut || once(&rt, &mut svc, 0x0a00_0001));
            }
        }
        "tower_governor" | "tower_governor_headers" => {
            let mut b = tower_governor::governor::GovernorConfigBuilder::default();
            b.per_nanosecond(1).burst_size(u32::MAX);
            if name.ends_with("headers") {
                let config = b.use_headers().finish().unwrap();
                let mut svc = tower_governor::GovernorLayer::new(config).layer(Ok200);
                run(&mut || once(&rt, &mut svc, 0x0a00_0001));
            } else {
                let mut svc = tower_governor::GovernorLayer::new(b.finish().unwrap()).layer(Ok200);
                run(&mut || once(&rt, &mut svc, 0x0a00_0001));
            }
        }
        other => panic!("unknown layer {other}"),
    }
    assert_eq!(ok, n, "every request is allowed");
}

fn main() {
    if std::env::var_os("LAYER_SIZES").is_some() {
        return sizes();
    }
    if let Ok(spec) = std::env::var("LAYER_COUNT") {
        return count(&spec);
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
/// `LAYER_SIZES=1` prints the response futures' sizes: a caller moves a
/// future at least once (into its own state or a box), and one larger than
/// 128 bytes is copied by a `memcpy` call.
fn sizes() {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    type L = floodgate_tower::RateLimit<Ok200, KeyedLimit<MemoryStore>, floodgate_tower::InnerBody>;
    let _ = writeln!(out, "floodgate: {} bytes", std::mem::size_of::<<L as Service<Request<Body>>>::Future>());
    let _ = writeln!(out, "inner service: {} bytes", std::mem::size_of::<<Ok200 as Service<Request<Body>>>::Future>());
    let mut b = tower_governor::governor::GovernorConfigBuilder::default();
    b.per_nanosecond(1).burst_size(u32::MAX);
    let mut svc = tower_governor::GovernorLayer::new(b.finish().unwrap()).layer(Ok200);
    let _ = writeln!(out, "tower_governor: {} bytes", std::mem::size_of_val(&svc.call(request(1))));
}
