//! The layer inside real axum apps, over real sockets: limits, headers,
//! `Retry-After`, trusted proxies, shaping, the Redis store shared by two
//! apps, and a server that forgot to record peer addresses.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::get;
use floodgate_core::rules::RuleSet;
use floodgate_core::{Algorithm, Limit, MemoryStore};
use floodgate_redis::{RedisConfig, RedisStore, Target};
use floodgate_testing::RedisServer;
use floodgate_tower::{Key, KeyedLimit, RateLimitLayer, RulesDecider, TrustedProxies};
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

const RULES: &str = r#"
domain: api
request_descriptors:
  - actions: [{remote_address: {}}]
  - actions: [{request_headers: {header_name: x-api-key, descriptor_key: api_key}}]
descriptors:
  - key: remote_address
    rate_limit: {unit: minute, requests_per_unit: 3, name: per_ip}
  - key: api_key
    value: small
    rate_limit: {unit: hour, requests_per_unit: 1}
"#;

struct App {
    addr: SocketAddr,
    calls: Arc<AtomicUsize>,
}

/// Serve `layer` around a handler that counts its calls; `connect_info`
/// records peer addresses.
async fn serve<L>(layer: L, connect_info: bool) -> App
where
    L: tower_layer::Layer<axum::routing::Route> + Clone + Send + Sync + 'static,
    L::Service: tower_service::Service<axum::extract::Request> + Clone + Send + Sync + 'static,
    <L::Service as tower_service::Service<axum::extract::Request>>::Response: axum::response::IntoResponse + 'static,
    <L::Service as tower_service::Service<axum::extract::Request>>::Error: Into<std::convert::Infallible> + 'static,
    <L::Service as tower_service::Service<axum::extract::Request>>::Future: Send + 'static,
{
    let calls = Arc::new(AtomicUsize::new(0));
    let c = Arc::clone(&calls);
    let app = Router::new()
        .route(
            "/hello",
            get(move || {
                c.fetch_add(1, Ordering::SeqCst);
                async { "hi" }
            }),
        )
        .layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        if connect_info {
            axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await.unwrap();
        } else {
            axum::serve(listener, app).await.unwrap();
        }
    });
    App { addr, calls }
}

struct Reply {
    status: u16,
    headers: http::HeaderMap,
    body: String,
}

async fn get_with(addr: SocketAddr, headers: &[(&str, &str)]) -> Reply {
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let mut req = http::Request::get(format!("http://{addr}/hello"));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = client.request(req.body(Empty::new()).unwrap()).await.unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = String::from_utf8(resp.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap();
    Reply { status, headers, body }
}

fn header<'a>(r: &'a Reply, name: &str) -> Option<&'a str> {
    r.headers.get(name).map(|v| v.to_str().unwrap())
}

fn rules() -> RuleSet {
    RuleSet::from_yaml("api.yaml", RULES).unwrap()
}

#[tokio::test]
async fn limits_count_down_then_429_with_retry_after_and_the_handler_is_not_called() {
    let app = serve(RateLimitLayer::new(RulesDecider::new(rules(), "api", MemoryStore::new())), true).await;
    counts_down_then_429(&app).await;
}

#[tokio::test]
async fn with_axums_own_body_type_the_answers_are_the_same() {
    let layer = RateLimitLayer::new(RulesDecider::new(rules(), "api", MemoryStore::new())).inner_body();
    let app = serve(layer, true).await;
    counts_down_then_429(&app).await;
}

/// Three allowed requests with their headers, then a `429` with its body
/// and `Retry-After`, the handler called three times.
async fn counts_down_then_429(app: &App) {
    for remaining in ["2", "1", "0"] {
        let r = get_with(app.addr, &[]).await;
        assert_eq!((r.status, r.body.as_str()), (200, "hi"));
        assert_eq!(header(&r, "x-ratelimit-limit"), Some("3"));
        assert_eq!(header(&r, "x-ratelimit-remaining"), Some(remaining));
        assert_eq!(header(&r, "ratelimit-policy"), Some("\"per_ip\";q=3;w=60"));
        assert!(header(&r, "retry-after").is_none());
    }
    let r = get_with(app.addr, &[]).await;
    assert_eq!(r.status, 429);
    let retry: u64 = header(&r, "retry-after").unwrap().parse().unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
    assert_eq!(header(&r, "x-ratelimit-remaining"), Some("0"));
    assert!(header(&r, "ratelimit").unwrap().starts_with("\"per_ip\";r=0;t="));
    assert!(r.body.contains("retry after"), "{}", r.body);
    assert_eq!(app.calls.load(Ordering::SeqCst), 3, "a denied request never reaches the handler");
}

#[tokio::test]
async fn a_header_descriptor_adds_its_own_limit() {
    let app = serve(RateLimitLayer::new(RulesDecider::new(rules(), "api", MemoryStore::new())), true).await;
    let small = [("x-api-key", "small")];
    assert_eq!(get_with(app.addr, &small).await.status, 200);
    let r = get_with(app.addr, &small).await;
    assert_eq!(r.status, 429, "api_key small allows one an hour");
    assert_eq!(header(&r, "x-ratelimit-limit"), Some("1"), "headers describe the denying limit");
    // Without the header only the per-IP limit applies (2 left of 3, one
    // was taken by the first request; the denied one took nothing).
    assert_eq!(header(&get_with(app.addr, &[]).await, "x-ratelimit-remaining"), Some("1"));
}

#[tokio::test]
async fn behind_a_trusted_proxy_the_forwarded_client_is_limited_and_cannot_escape_by_forging() {
    let layer = RateLimitLayer::new(RulesDecider::new(rules(), "api", MemoryStore::new()))
        .trusted_proxies(TrustedProxies::parse_list("127.0.0.0/8").unwrap());
    let app = serve(layer, true).await;
    // The test client is the "proxy" (127.0.0.1); it appended 203.0.113.9.
    // The client forges a different left-most hop each time: one counter.
    for (i, forged) in ["1.1.1.1", "2.2.2.2", "3.3.3.3", "4.4.4.4"].iter().enumerate() {
        let xff = format!("{forged}, 203.0.113.9");
        let r = get_with(app.addr, &[("x-forwarded-for", &xff)]).await;
        assert_eq!(r.status, if i < 3 { 200 } else { 429 }, "request {i}");
    }
    // Another client behind the same proxy has its own counter.
    assert_eq!(get_with(app.addr, &[("x-forwarded-for", "198.51.100.7")]).await.status, 200);
}

/// A per-client-IP shaper: one request per `every`, `queued` waiting.
fn shaper(queued: u64, every: Duration) -> RateLimitLayer<KeyedLimit<MemoryStore>> {
    let mode = floodgate_core::LeakyMode::Shape;
    let limit = Limit::new(Algorithm::LeakyBucket { burst: Some(queued), mode }, 1, every).unwrap();
    RateLimitLayer::new(KeyedLimit::new(limit, Key::ClientIp, MemoryStore::new()))
}

/// `n` requests to `app` at once; their replies, by status.
async fn at_once(app: &App, n: usize) -> Vec<Reply> {
    let requests: Vec<_> = (0..n).map(|_| tokio::spawn(get_with(app.addr, &[]))).collect();
    let mut replies = Vec::new();
    for r in requests {
        replies.push(r.await.unwrap());
    }
    replies.sort_by_key(|r| r.status);
    replies
}

#[tokio::test]
async fn a_shaping_limit_delays_instead_of_rejecting_up_to_its_burst() {
    // One per 300 ms, 2 queued: one passes now, two wait 300 and 600 ms,
    // the fourth is rejected (arrivals may spread over up to 300 ms).
    let app = serve(shaper(2, Duration::from_millis(300)), true).await;
    let started = Instant::now();
    let statuses: Vec<u16> = at_once(&app, 4).await.iter().map(|r| r.status).collect();
    assert_eq!(statuses, [200, 200, 200, 429], "one now, two queued, the fourth refused");
    // The last admitted one was held for two emission intervals.
    assert!(started.elapsed() >= Duration::from_millis(600), "{:?}", started.elapsed());
}

#[tokio::test]
async fn past_the_layers_bound_on_held_requests_a_shaped_one_is_503_not_a_pile_up() {
    // One per 400 ms with room for 5 queued per key, but the layer holds at
    // most one request at a time: of three at once, one passes now, one
    // waits, one is answered 503 at once with when to come back.
    let layer = shaper(5, Duration::from_millis(400)).max_held(1);
    let app = serve(layer.clone(), true).await;
    let replies = at_once(&app, 3).await;
    assert_eq!(replies.iter().map(|r| r.status).collect::<Vec<_>>(), [200, 200, 503]);
    let full = &replies[2];
    assert_eq!(header(full, "retry-after"), Some("1"), "its delay, rounded up");
    assert!(full.body.contains("1 requests are already held for shaping"), "{}", full.body);
    assert!(header(full, "x-ratelimit-limit").is_some(), "the rate-limit headers go with it");
    assert_eq!(app.calls.load(Ordering::SeqCst), 2, "the 503 never reached the handler");
    assert_eq!(layer.held(), 0, "every place is given back");
}

#[tokio::test]
async fn two_apps_on_one_redis_share_the_limit_exactly() {
    let redis = RedisServer::start();
    let store = || RedisStore::new(RedisConfig::new(redis.url().parse::<Target>().unwrap())).unwrap();
    let limit = Limit::new(Algorithm::SlidingLog, 10, Duration::from_secs(3600)).unwrap();
    let layer = || RateLimitLayer::new(KeyedLimit::new(limit.clone(), Key::Header("x-user".parse().unwrap()), store()));
    let (a, b) = (serve(layer(), true).await, serve(layer(), true).await);
    let mut tasks = Vec::new();
    for i in 0..40 {
        let addr = if i % 2 == 0 { a.addr } else { b.addr };
        tasks.push(tokio::spawn(async move { get_with(addr, &[("x-user", "alice")]).await.status }));
    }
    let mut ok = 0;
    for t in tasks {
        ok += usize::from(t.await.unwrap() == 200);
    }
    assert_eq!(ok, 10);
    assert_eq!(a.calls.load(Ordering::SeqCst) + b.calls.load(Ordering::SeqCst), 10);
    // No x-user: the key is absent, not limited.
    assert_eq!(get_with(a.addr, &[]).await.status, 200);
}

#[tokio::test]
async fn without_peer_addresses_the_layer_says_what_to_fix() {
    let app = serve(RateLimitLayer::new(RulesDecider::new(rules(), "api", MemoryStore::new())), false).await;
    let r = get_with(app.addr, &[]).await;
    assert_eq!(r.status, 500);
    assert!(r.body.contains("into_make_service_with_connect_info"), "{}", r.body);
    assert_eq!(app.calls.load(Ordering::SeqCst), 0);
}
