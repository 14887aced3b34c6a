//! Concurrency limits in the metered layer inside an axum app: a request
//! holds its slot until its response body ends — streamed to the end, cut,
//! dropped by a client that went away, or never made (a panicking handler)
//! — and a request refused for concurrency is answered 429 without reaching
//! the app. The plain layer refuses a concurrency limit (it could never
//! release the slot).

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::routing::get;
use floodgate_core::MemoryStore;
use floodgate_core::rules::RuleSet;
use floodgate_tower::{RateLimitLayer, RulesDecider};

const RULES: &str = r#"
domain: backend
request_descriptors:
  - actions: [{request_headers: {header_name: x-tenant, descriptor_key: tenant}}]
descriptors:
  - key: tenant
    rate_limits:
      - {unit: hour, requests_per_unit: 1000, name: tenant_rate}
      - {concurrency: 1, lease_ttl: 60s, name: tenant_in_flight}
"#;

/// `/slow` streams for as long as its `gate` is open (a chunk every 20 ms, at
/// most 10 s); `/fast` answers at once; `/panic` fails.
fn app(gate: tokio::sync::watch::Receiver<bool>) -> Router {
    Router::new()
        .route("/fast", get(|| async { "done" }))
        .route(
            "/slow",
            get(move || {
                let mut gate = gate.clone();
                async move {
                    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(1);
                    tokio::spawn(async move {
                        for _ in 0..500 {
                            if !*gate.borrow_and_update() || tx.send(Ok(Bytes::from_static(b"."))).await.is_err() {
                                return;
                            }
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    });
                    Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
                }
            }),
        )
        .route(
            "/panic",
            get(|| async {
                if true {
                    panic!("the handler fails");
                }
                ""
            }),
        )
}

fn request(addr: SocketAddr, path: &str) -> std::net::TcpStream {
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(c, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nx-tenant: acme\r\n\r\n").unwrap();
    c
}

/// The status of a whole response.
fn status(addr: SocketAddr, path: &str) -> String {
    let mut c = request(addr, path);
    let mut out = Vec::new();
    let _ = c.read_to_end(&mut out);
    String::from_utf8_lossy(&out).split_whitespace().nth(1).unwrap_or("none").to_owned()
}

/// The status of a response whose body is still streaming (its head read,
/// the connection kept).
fn started(addr: SocketAddr, path: &str) -> (String, std::net::TcpStream) {
    let mut c = request(addr, path);
    let mut head = [0u8; 256];
    let n = c.read(&mut head).unwrap();
    (String::from_utf8_lossy(&head[..n]).split_whitespace().nth(1).unwrap_or("none").to_owned(), c)
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.unwrap()
}

/// `want` from `/fast` within 5 s (a slot frees as soon as its release is
/// done; the release of a body dropped by a gone client follows the
/// server's noticing it).
async fn eventually(addr: SocketAddr, want: &'static str, what: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let got = blocking(move || status(addr, "/fast")).await;
        if got == want {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "{what}: /fast answered {got}, want {want}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_is_held_until_the_response_ends() {
    let rules = RuleSet::from_yaml("backend.yaml", RULES).unwrap();
    let decider = RulesDecider::new(rules, "backend", MemoryStore::new());
    let layer = RateLimitLayer::new(decider).metered();
    let (open, gate) = tokio::sync::watch::channel(true);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app(gate).layer(layer)).await });

    // A request streams: its slot is held while the body flows.
    let (st, slow) = blocking(move || started(addr, "/slow")).await;
    assert_eq!(st, "200");
    assert_eq!(blocking(move || status(addr, "/fast")).await, "429", "one in flight: the second is refused");
    // The stream ends: the slot frees.
    open.send(false).unwrap();
    blocking(move || {
        let mut slow = slow;
        let mut rest = Vec::new();
        let _ = slow.read_to_end(&mut rest);
    })
    .await;
    eventually(addr, "200", "after the stream ended").await;

    // A client that goes away mid-stream frees its slot.
    open.send(true).unwrap();
    let (st, slow) = blocking(move || started(addr, "/slow")).await;
    assert_eq!(st, "200");
    assert_eq!(blocking(move || status(addr, "/fast")).await, "429");
    drop(slow);
    eventually(addr, "200", "after the client went away").await;

    // A handler that panics holds nothing afterwards.
    let _ = blocking(move || status(addr, "/panic")).await;
    eventually(addr, "200", "after a panic").await;
}

#[tokio::test]
async fn the_plain_layer_refuses_a_concurrency_limit() {
    let rules = RuleSet::from_yaml("backend.yaml", RULES).unwrap();
    let layer = RateLimitLayer::new(RulesDecider::new(rules, "backend", MemoryStore::new()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (_open, gate) = tokio::sync::watch::channel(true);
    tokio::spawn(async move { axum::serve(listener, app(gate).layer(layer)).await });
    let text = blocking(move || {
        let mut c = request(addr, "/fast");
        let mut out = Vec::new();
        let _ = c.read_to_end(&mut out);
        String::from_utf8_lossy(&out).into_owned()
    })
    .await;
    assert!(text.starts_with("HTTP/1.1 500"), "{text}");
    assert!(text.contains("RateLimitLayer::metered()"), "{text}");
}
