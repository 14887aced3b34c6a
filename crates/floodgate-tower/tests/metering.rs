//! The metering layer inside an axum app that answers as an
//! OpenAI-compatible API: each request reserves its estimate and its
//! response settles what it says it cost — a JSON body, a stream (asked for
//! its usage by the layer), a stream that fails mid-way, an error, a
//! handler that panics, a client that goes away, a cost read from a
//! response header — and the budgets are exact after each, on the memory
//! store and on Redis.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use floodgate_core::rules::RuleSet;
use floodgate_core::{MemoryStore, Store};
use floodgate_redis::{RedisConfig, RedisStore, Target};
use floodgate_testing::RedisServer;
use floodgate_tower::{RateLimitLayer, RulesDecider};

const RULES: &str = r#"
domain: llm
request_descriptors:
  - actions: [{request_headers: {header_name: x-tenant, descriptor_key: requests}}]
  - actions: [{request_headers: {header_name: x-tenant, descriptor_key: tokens}}]
  - actions: [{request_headers: {header_name: x-tenant, descriptor_key: units}}]
  - actions: [{request_headers: {header_name: x-tenant, descriptor_key: shadowed}}]
descriptors:
  # Over its limit from the second request on, in shadow mode: it denies
  # nothing and keeps nothing in the reservation (the settle's amounts
  # match the parts kept).
  - key: shadowed
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: requests
    rate_limit: {unit: hour, requests_per_unit: 1000}
  - key: tokens
    rate_limit:
      unit: hour
      requests_per_unit: 10000
      cost: {estimate: {body: max_tokens, default: 50}, actual: {usage: total_tokens}}
  - key: units
    rate_limit:
      unit: hour
      requests_per_unit: 10000
      cost: {estimate: {header: x-estimate, default: 9}, actual: {header: x-cost}}
"#;

const USAGE: &str = r#"{"prompt_tokens":10,"completion_tokens":20,"total_tokens":30}"#;

fn chunk(data: &str) -> Result<Bytes, std::io::Error> {
    Ok(Bytes::from(format!("data: {data}\n\n")))
}

/// The app: an OpenAI-style API by path.
fn app() -> Router {
    Router::new()
        .route("/json", post(|| async { format!(r#"{{"choices":[],"usage":{USAGE}}}"#) }))
        .route(
            "/v1/chat/completions",
            post(|body: Bytes| async move {
                let asked = String::from_utf8_lossy(&body).contains("\"include_usage\":true");
                let mut chunks = vec![chunk(r#"{"choices":[{"delta":{"content":"hi"}}]}"#)];
                if asked {
                    chunks.push(chunk(&format!(r#"{{"choices":[],"usage":{USAGE}}}"#)));
                }
                chunks.push(chunk("[DONE]"));
                Body::from_stream(tokio_stream::iter(chunks))
            }),
        )
        .route(
            "/cut",
            post(|| async {
                let chunks = vec![chunk(r#"{"choices":[]}"#), Err(std::io::Error::other("the upstream went away"))];
                Body::from_stream(tokio_stream::iter(chunks))
            }),
        )
        .route("/error", post(|| async { (http::StatusCode::SERVICE_UNAVAILABLE, "overloaded").into_response() }))
        .route(
            "/header",
            post(|| async { Response::builder().header("x-cost", "7").body(Body::from("done")).unwrap() }),
        )
        .route(
            "/slow",
            post(|| async {
                let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(1);
                tokio::spawn(async move {
                    for _ in 0..100 {
                        if tx.send(chunk(r#"{"choices":[]}"#)).await.is_err() {
                            return;
                        }
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                });
                Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
            }),
        )
        .route(
            "/panic",
            post(|| async {
                if true {
                    panic!("the handler fails");
                }
                ""
            }),
        )
}

/// A request for tenant acme on a raw connection.
fn request(addr: SocketAddr, path: &str, body: &str, extra: &str) -> std::net::TcpStream {
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        c,
        "POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nx-tenant: acme\r\ncontent-type: application/json\r\n{extra}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    c
}

/// The whole response (a cut one as far as it came).
fn call(addr: SocketAddr, path: &str, body: &str, extra: &str) -> String {
    let mut c = request(addr, path, body, extra);
    let mut out = Vec::new();
    let _ = c.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

async fn metered<S: Store + 'static>(store: S) {
    let rules = RuleSet::from_yaml("llm.yaml", RULES).unwrap();
    let decider = RulesDecider::new(rules.clone(), "llm", store);
    let layer = RateLimitLayer::new(decider).metered();
    let used = {
        let layer = layer.clone();
        move |i: usize| {
            let m =
                rules.matches("llm", &[([("requests", "acme"), ("tokens", "acme"), ("units", "acme")][i])]).unwrap();
            let (key, limit) = (m.counter_key(0), m.rules[0].limit.clone().unwrap());
            let layer = layer.clone();
            async move {
                let d = layer.rate_limit().decider().store().apply(&key, &limit, 0).await.unwrap();
                limit.limit() - d.remaining
            }
        }
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app().layer(layer)).await });

    let mut want = [0u64; 3];
    // Each case on a thread of its own (the client is blocking), then the
    // budgets as they settle (with a deadline).
    macro_rules! case {
        ($what:expr, $path:expr, $body:expr, $extra:expr, $check:expr, [$r:expr, $t:expr, $u:expr]) => {{
            let (path, body, extra) = ($path, $body, $extra);
            let text = tokio::task::spawn_blocking(move || call(addr, path, body, extra)).await.unwrap();
            let check: fn(&str) -> bool = $check;
            assert!(check(&text), "{}: {text}", $what);
            want = [want[0] + $r, want[1] + $t, want[2] + $u];
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            loop {
                let got = [used(0).await, used(1).await, used(2).await];
                if got == want {
                    break;
                }
                assert!(tokio::time::Instant::now() < deadline, "{}: used {got:?}, want {want:?}", $what);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }};
    }
    case!("a JSON body's usage", "/json", r#"{"max_tokens": 100}"#, "", |t| t.contains("total_tokens"), [1, 30, 9]);
    case!(
        "a stream asked for its usage",
        "/v1/chat/completions",
        r#"{"max_tokens": 100, "stream": true}"#,
        "",
        |t| t.contains("\"usage\"") && t.contains("[DONE]"),
        [1, 30, 9]
    );
    case!("a stream that fails: the estimate", "/cut", r#"{"max_tokens": 100}"#, "", |_| true, [1, 100, 9]);
    case!("an error: nothing served", "/error", r#"{"max_tokens": 100}"#, "", |t| t.contains(" 503 "), [1, 0, 0]);
    case!("a header's cost", "/header", "{}", "x-estimate: 3\r\n", |t| t.contains("done"), [1, 50, 7]);
    case!("a handler that panics: the estimates", "/panic", r#"{"max_tokens": 70}"#, "", |_| true, [1, 70, 9]);
    case!("denied: nothing reserved", "/json", r#"{"max_tokens": 100000}"#, "", |t| t.contains(" 429 "), [0, 0, 0]);

    // A client that goes away mid-stream: the estimates stay.
    let mut c = request(addr, "/slow", r#"{"max_tokens": 40}"#, "");
    tokio::task::spawn_blocking(move || {
        let mut head = [0u8; 64];
        let n = c.read(&mut head).unwrap();
        assert!(String::from_utf8_lossy(&head[..n]).starts_with("HTTP/1.1 200"));
    })
    .await
    .unwrap();
    case!("after a client went away", "/json", r#"{"max_tokens": 100}"#, "", |_| true, [2, 40 + 30, 9 + 9]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_axum_app_is_metered_on_the_memory_store() {
    metered(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_axum_app_is_metered_on_redis() {
    let redis = RedisServer::start();
    let store = RedisStore::new(RedisConfig::new(redis.url().parse::<Target>().unwrap())).unwrap();
    metered(store).await;
}

/// A metered request that the layer refuses after reserving (it would wait
/// for a shaping limit while the layer holds its most): nothing was served,
/// so its cost settles at 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_refused_while_held_for_shaping_costs_nothing() {
    let rules = RuleSet::from_yaml(
        "llm.yaml",
        r#"
domain: llm
request_descriptors:
  - actions: [{request_headers: {header_name: x-tenant, descriptor_key: shaped}}]
  - actions: [{request_headers: {header_name: x-tenant, descriptor_key: tokens}}]
descriptors:
  - key: shaped
    rate_limit: {algorithm: leaky_bucket, mode: shape, unit: hour, requests_per_unit: 1, burst: 5}
  - key: tokens
    rate_limit:
      unit: hour
      requests_per_unit: 10000
      cost: {estimate: {body: max_tokens, default: 50}, actual: {usage: total_tokens}}
"#,
    )
    .unwrap();
    let decider = RulesDecider::new(rules.clone(), "llm", MemoryStore::new());
    let layer = RateLimitLayer::new(decider).max_held(0).metered();
    let m = rules.matches("llm", &[("tokens", "acme")]).unwrap();
    let (key, limit) = (m.counter_key(0), m.rules[0].limit.clone().unwrap());
    let store_layer = layer.clone();
    let used = move || {
        let d = store_layer.rate_limit().decider().store().apply_sync(&key, &limit, 0).unwrap();
        limit.limit() - d.remaining
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app().layer(layer)).await });
    let first = tokio::task::spawn_blocking(move || call(addr, "/json", r#"{"max_tokens": 100}"#, "")).await.unwrap();
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    assert_eq!(used(), 30, "the first: its usage");
    let held = tokio::task::spawn_blocking(move || call(addr, "/json", r#"{"max_tokens": 100}"#, "")).await.unwrap();
    assert!(held.starts_with("HTTP/1.1 503"), "the second would wait, and none may: {held}");
    assert_eq!(used(), 30, "refused before the work: its estimate given back");
}
