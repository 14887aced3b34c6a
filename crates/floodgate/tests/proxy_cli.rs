//! `floodgate proxy` through the real binary, in front of a real upstream
//! (a hyper server in this test): limits and their headers, forged
//! forwarding headers, descriptors from headers and paths, shaping, bodies
//! streamed both ways, an upstream that is down or slow, slow clients,
//! HTTP/2, graceful shutdown, and bad flags.

use crate::cli;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use cli::{Served, run};
use http_body_util::{BodyExt, Empty, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

type Body = http_body_util::combinators::BoxBody<Bytes, Infallible>;

/// What the upstream saw and lets the test steer.
#[derive(Default)]
struct Upstream {
    calls: AtomicUsize,
    /// The upstream got the first chunk of an upload.
    upload_started: Notify,
    /// The test got the first chunk of a download: send the rest.
    download_go: Notify,
}

const CHUNK: usize = 64 * 1024;
const BIG: usize = 16 * 1024 * 1024;

async fn handle(up: Arc<Upstream>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    up.calls.fetch_add(1, Ordering::SeqCst);
    let text = |s: String| Response::new(http_body_util::Full::new(Bytes::from(s)).boxed());
    Ok(match req.uri().path() {
        "/upload" => {
            let mut body = req.into_body();
            let mut total = 0usize;
            while let Some(frame) = body.frame().await {
                if let Ok(data) = frame.unwrap().into_data() {
                    if total == 0 {
                        up.upload_started.notify_one();
                    }
                    total += data.len();
                }
            }
            text(total.to_string())
        }
        "/download" => {
            let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, Infallible>>(4);
            let up = up.clone();
            tokio::spawn(async move {
                let _ = tx.send(Ok(Frame::data(Bytes::from(vec![b'a'; CHUNK])))).await;
                up.download_go.notified().await;
                for _ in 0..BIG / CHUNK {
                    if tx.send(Ok(Frame::data(Bytes::from(vec![b'b'; CHUNK])))).await.is_err() {
                        return;
                    }
                }
            });
            Response::new(StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx)).boxed())
        }
        "/slow" => {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            text("slow".into())
        }
        _ => {
            let h = |n: &str| req.headers().get(n).map(|v| v.to_str().unwrap().to_owned());
            let seen = serde_json::json!({
                "path": req.uri().path_and_query().map(|p| p.as_str()),
                "xff": h("x-forwarded-for"),
                "proto": h("x-forwarded-proto"),
                "host": h("host"),
                "connection": h("connection"),
                "secret": h("x-hop"),
            });
            let mut resp = text(seen.to_string());
            resp.headers_mut().insert("x-upstream", "yes".parse().unwrap());
            resp
        }
    })
}

async fn upstream() -> (SocketAddr, Arc<Upstream>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let up = Arc::new(Upstream::default());
    let state = up.clone();
    tokio::spawn(async move {
        loop {
            let (io, _) = listener.accept().await.unwrap();
            let state = state.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req| handle(state.clone(), req));
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(io), svc)
                    .await;
            });
        }
    });
    (addr, up)
}

/// Start the proxy off the async threads (it blocks reading the log).
async fn proxy(name: &'static str, rules: &'static str, upstream: String, args: &'static [&'static str]) -> Served {
    tokio::task::spawn_blocking(move || Served::proxy(name, rules, &upstream, args)).await.unwrap()
}

struct Reply {
    status: u16,
    headers: http::HeaderMap,
    body: String,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }

    fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|_| panic!("not JSON: {}", self.body))
    }
}

async fn get(addr: &str, path: &str, headers: &[(&str, &str)]) -> Reply {
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let mut req = Request::get(format!("http://{addr}{path}"));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = client.request(req.body(Empty::new()).unwrap()).await.unwrap();
    let (status, headers) = (resp.status().as_u16(), resp.headers().clone());
    let body = String::from_utf8_lossy(&resp.into_body().collect().await.unwrap().to_bytes()).into_owned();
    Reply { status, headers, body }
}

/// A sliding log: no window edge to cross mid-test (a fixed minute window
/// started afresh at a minute boundary and let a run's bench admit 3 more).
const PER_IP: &str = "domain: proxy
descriptors:
  - key: remote_address
    rate_limit: {unit: minute, requests_per_unit: 3, name: per_client, algorithm: sliding_log}
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_the_limit_is_429_with_headers_and_the_upstream_sees_only_what_passed() {
    let (up_addr, up) = upstream().await;
    let p = proxy("proxy-limit", PER_IP, format!("http://{up_addr}"), &[]).await;
    for remaining in ["2", "1", "0"] {
        let r = get(&p.proxy, "/hello?x=1", &[("connection", "x-hop"), ("x-hop", "secret")]).await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.header("x-upstream"), Some("yes"));
        assert_eq!(r.header("x-ratelimit-remaining"), Some(remaining));
        assert_eq!(r.header("ratelimit-policy"), Some("\"per_client\";q=3;w=60"));
        let seen = r.json();
        assert_eq!(seen["path"], "/hello?x=1");
        assert_eq!(seen["xff"], "127.0.0.1", "the proxy appends the peer");
        assert_eq!(seen["proto"], "http");
        assert_eq!(seen["host"], p.proxy.as_str(), "the client's Host is kept");
        assert!(seen["secret"].is_null() && seen["connection"].is_null(), "hop-by-hop headers are dropped: {seen}");
    }
    let r = get(&p.proxy, "/hello", &[]).await;
    assert_eq!(r.status, 429);
    let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
    assert_eq!(r.header("x-ratelimit-limit"), Some("3"));
    assert!(r.body.contains("429 Too Many Requests"), "{}", r.body);
    assert_eq!(up.calls.load(Ordering::SeqCst), 3, "a denied request never reaches the upstream");
    // `floodgate bench --protocol get` (the proxy's benchmark) counts the
    // proxy's 429s as denials.
    let addr = p.proxy.clone();
    let args = ["--path", "/hello", "--duration", "300ms", "--concurrency", "2"];
    let v = tokio::task::spawn_blocking(move || cli::bench(&addr, "get", &args)).await.unwrap();
    assert!(v["requests"].as_u64().unwrap() > 0, "{v}");
    assert_eq!((&v["denied"], &v["allowed"], &v["errors"]), (&v["requests"], &0.into(), &0.into()), "{v}");
    assert_eq!(up.calls.load(Ordering::SeqCst), 3);
    // The decisions are in the metrics, labelled proxy.
    let metrics = get(&p.http, "/metrics", &[]).await.body;
    assert!(metrics.contains("protocol=\"proxy\""), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_forwarded_for_never_escapes_the_limit() {
    let (up_addr, _) = upstream().await;
    // No trusted proxies: the header is never read, whatever it says.
    let p = proxy("proxy-forge", PER_IP, format!("http://{up_addr}"), &[]).await;
    let statuses: Vec<u16> = futures_statuses(&p.proxy, &["1.1.1.1", "2.2.2.2", "3.3.3.3", "4.4.4.4"]).await;
    assert_eq!(statuses, [200, 200, 200, 429]);
    // Trusting the test client (a "proxy" at 127.0.0.1): the right-most hop
    // it appended is the client; a forged hop to its left changes nothing.
    let p = proxy("proxy-trust", PER_IP, format!("http://{up_addr}"), &["--trusted-proxies", "127.0.0.1/32"]).await;
    let forged: Vec<String> = (1..=4).map(|i| format!("{i}.{i}.{i}.{i}, 203.0.113.9")).collect();
    let forged: Vec<&str> = forged.iter().map(String::as_str).collect();
    assert_eq!(futures_statuses(&p.proxy, &forged).await, [200, 200, 200, 429]);
    // Another real client behind the trusted proxy has its own counter, and
    // the upstream sees the chain with the peer appended.
    let r = get(&p.proxy, "/", &[("x-forwarded-for", "198.51.100.7")]).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["xff"], "198.51.100.7, 127.0.0.1");
}

/// One request per X-Forwarded-For value, in order; their statuses.
async fn futures_statuses(addr: &str, xffs: &[&str]) -> Vec<u16> {
    let mut out = Vec::new();
    for xff in xffs {
        out.push(get(addr, "/", &[("x-forwarded-for", xff)]).await.status);
    }
    out
}

const BY_KEY_AND_PATH: &str = r#"domain: proxy
request_descriptors:
  - actions: [{request_headers: {header_name: x-api-key, descriptor_key: api_key}}]
  - actions:
      - request_headers: {header_name: ":method", descriptor_key: method}
      - request_headers: {header_name: ":path", descriptor_key: path}
descriptors:
  - key: api_key
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: method
    value: GET
    descriptors:
      - key: path
        value: "/expensive*"
        share_threshold: true
        rate_limit: {unit: hour, requests_per_unit: 1}
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn descriptors_come_from_headers_method_and_path() {
    let (up_addr, _) = upstream().await;
    let p = proxy("proxy-desc", BY_KEY_AND_PATH, format!("http://{up_addr}"), &[]).await;
    // No api key and a cheap path: nothing applies.
    for _ in 0..5 {
        assert_eq!(get(&p.proxy, "/cheap", &[]).await.status, 200);
    }
    assert_eq!(get(&p.proxy, "/expensive/report", &[]).await.status, 200);
    assert_eq!(
        get(&p.proxy, "/expensive/other", &[]).await.status,
        429,
        "one an hour on all of /expensive* (share_threshold)"
    );
    let key = [("x-api-key", "k1")];
    assert_eq!(get(&p.proxy, "/cheap", &key).await.status, 200);
    assert_eq!(get(&p.proxy, "/cheap", &key).await.status, 200);
    assert_eq!(get(&p.proxy, "/cheap", &key).await.status, 429);
    assert_eq!(get(&p.proxy, "/cheap", &[("x-api-key", "k2")]).await.status, 200);
}

const SHAPE: &str = "domain: proxy
descriptors:
  - key: remote_address
    rate_limit: {algorithm: leaky_bucket, mode: shape, window: 400ms, requests_per_unit: 1, burst: 2}
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shaping_rule_queues_up_to_its_burst_like_nginx_limit_req() {
    let (up_addr, up) = upstream().await;
    let p = proxy("proxy-shape", SHAPE, format!("http://{up_addr}"), &[]).await;
    let started = Instant::now();
    let tasks: Vec<_> = (0..4)
        .map(|_| {
            let addr = p.proxy.clone();
            tokio::spawn(async move { get(&addr, "/", &[]).await.status })
        })
        .collect();
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.push(t.await.unwrap());
    }
    statuses.sort_unstable();
    assert_eq!(statuses, [200, 200, 200, 429], "one now, two queued, one refused");
    assert!(started.elapsed() >= Duration::from_millis(800), "the queued ones were held: {:?}", started.elapsed());
    assert_eq!(up.calls.load(Ordering::SeqCst), 3);

    // The same rule, but the proxy holds one request at most: the second
    // waiting one is 503 (within its limit, but no room), not a pile-up.
    let (up_addr, up) = upstream().await;
    let p = proxy("proxy-shape-held", SHAPE, format!("http://{up_addr}"), &["--max-held", "1"]).await;
    let tasks: Vec<_> = (0..3)
        .map(|_| {
            let addr = p.proxy.clone();
            tokio::spawn(async move { get(&addr, "/", &[]).await })
        })
        .collect();
    let mut replies = Vec::new();
    for t in tasks {
        replies.push(t.await.unwrap());
    }
    replies.sort_by_key(|r| r.status);
    assert_eq!(replies.iter().map(|r| r.status).collect::<Vec<_>>(), [200, 200, 503]);
    assert_eq!(replies[2].header("retry-after"), Some("1"), "{}", replies[2].body);
    assert!(replies[2].body.contains("already held for shaping"), "{}", replies[2].body);
    assert_eq!(up.calls.load(Ordering::SeqCst), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_stream_both_ways_without_being_buffered_whole() {
    let (up_addr, up) = upstream().await;
    let p = proxy("proxy-stream", "domain: other\ndescriptors: []\n", format!("http://{up_addr}"), &[]).await;
    // Upload: the upstream sees the first chunk before the client has sent
    // the rest (a buffering proxy would wait for all of it: deadlock).
    let mut s = TcpStream::connect(&p.proxy).await.unwrap();
    s.write_all(b"POST /upload HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n").await.unwrap();
    let chunk = vec![b'u'; CHUNK];
    let frame = |data: &[u8]| [format!("{:x}\r\n", data.len()).into_bytes(), data.to_vec(), b"\r\n".to_vec()].concat();
    s.write_all(&frame(&chunk)).await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), up.upload_started.notified())
        .await
        .expect("the first chunk reached the upstream before the upload ended");
    for _ in 1..BIG / CHUNK {
        s.write_all(&frame(&chunk)).await.unwrap();
    }
    s.write_all(b"0\r\n\r\n").await.unwrap();
    let reply = read_response(&mut s).await;
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    assert!(reply.ends_with(&BIG.to_string()), "the upstream got every byte: {reply}");

    // Download: the client gets the first chunk while the upstream holds
    // the rest back.
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let resp = client.get(format!("http://{}/download", p.proxy).parse().unwrap()).await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut total = 0usize;
    while total < CHUNK {
        let frame = tokio::time::timeout(Duration::from_secs(10), body.frame()).await.expect("first bytes stream");
        total += frame.unwrap().unwrap().into_data().map_or(0, |d| d.len());
    }
    up.download_go.notify_one();
    while let Some(frame) = body.frame().await {
        total += frame.unwrap().into_data().map_or(0, |d| d.len());
    }
    assert_eq!(total, CHUNK + BIG);
}

/// Read one HTTP/1.1 response with a content-length body, as text.
async fn read_response(s: &mut TcpStream) -> String {
    let mut buf = Vec::new();
    let mut byte = [0u8; 4096];
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let n = tokio::time::timeout(Duration::from_secs(20), s.read(&mut byte)).await.unwrap().unwrap();
        buf.extend_from_slice(&byte[..n]);
        let text = String::from_utf8_lossy(&buf).into_owned();
        if let Some(end) = text.find("\r\n\r\n") {
            let len = text[..end]
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase().strip_prefix("content-length: ").map(|v| v.trim().parse().unwrap())
                })
                .unwrap_or(0usize);
            if buf.len() >= end + 4 + len {
                return text;
            }
        }
        assert!(n > 0 && Instant::now() < deadline, "connection closed mid-response: {text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_down_is_502_and_a_slow_one_504() {
    let (_held, dead) = cli::refusing_addr();
    let p = proxy("proxy-down", PER_IP, format!("http://{dead}"), &[]).await;
    let r = get(&p.proxy, "/", &[]).await;
    assert_eq!(r.status, 502);
    assert!(r.body.contains(&format!("upstream http://{dead}")), "{}", r.body);
    assert!(r.header("x-ratelimit-remaining").is_some(), "the decision's headers are still sent");

    let (up_addr, _) = upstream().await;
    let p = proxy("proxy-slow", PER_IP, format!("http://{up_addr}"), &["--upstream-timeout", "300ms"]).await;
    let r = get(&p.proxy, "/slow", &[]).await;
    assert_eq!(r.status, 504, "{}", r.body);
    assert!(r.body.contains("did not answer within"), "{}", r.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_do_not_stall_others_and_are_cut_off() {
    let (up_addr, _) = upstream().await;
    let rules = "domain: other\ndescriptors: []\n";
    let p = proxy("proxy-slowloris", rules, format!("http://{up_addr}"), &["--header-timeout", "1s"]).await;
    // 50 clients send half a request head and stall.
    let mut stalled = Vec::new();
    for _ in 0..50 {
        let mut s = TcpStream::connect(&p.proxy).await.unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n").await.unwrap();
        stalled.push(s);
    }
    // Everyone else is served meanwhile.
    for _ in 0..20 {
        let r = tokio::time::timeout(Duration::from_secs(5), get(&p.proxy, "/", &[])).await.expect("not stalled");
        assert_eq!(r.status, 200);
    }
    // The stalled ones are cut off after the header timeout (408 or close).
    for mut s in stalled {
        let mut buf = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf)).await;
        assert!(read.is_ok(), "a stalled client was disconnected within 10 s");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_clients_are_served() {
    let (up_addr, _) = upstream().await;
    let p = proxy("proxy-h2", PER_IP, format!("http://{up_addr}"), &[]).await;
    let client = Client::builder(TokioExecutor::new()).http2_only(true).build_http::<Empty<Bytes>>();
    let resp = client.get(format!("http://{}/h2", p.proxy).parse().unwrap()).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-ratelimit-remaining"], "2");
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let seen: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(seen["path"], "/h2");
    assert_eq!(seen["host"], p.proxy.as_str(), "the :authority becomes Host upstream");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_a_request_in_flight_finish() {
    // Per-core runtimes (the default) and the shared runtime.
    for (name, args) in [("proxy-term", &[] as &'static [&'static str]), ("proxy-term-shared", &["--threads", "0"])] {
        let (up_addr, _) = upstream().await;
        let p = proxy(name, PER_IP, format!("http://{up_addr}"), args).await;
        let addr = p.proxy.clone();
        let slow = tokio::spawn(async move { get(&addr, "/slow", &[]).await });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(get(&p.proxy, "/", &[]).await.status, 200, "{name}: served beside the slow one");
        let code = tokio::task::spawn_blocking(move || p.terminate()).await.unwrap();
        assert_eq!(code, Some(0), "{name}");
        let r = slow.await.unwrap();
        assert_eq!((r.status, r.body.as_str()), (200, "slow"), "{name}");
    }
}

#[test]
fn bad_proxy_flags_exit_64_before_binding() {
    for (args, says) in [
        (vec!["proxy", "--upstream", "https://example.com"], "https upstreams are not supported"),
        (vec!["proxy", "--upstream", "localhost:3000"], "give an http:// URL"),
        (vec!["proxy", "--upstream", "http://127.0.0.1:1", "--trusted-proxies", "10.0.0.0/99"], "--trusted-proxies"),
        (vec!["proxy", "--upstream", "http://127.0.0.1:1", "--forwarded-header", "x-real-ip"], "--forwarded-header"),
        (vec!["proxy", "--upstream", "http://127.0.0.1:1", "--upstream-timeout", "0s"], "positive duration"),
        (vec!["proxy", "--upstream", "http://127.0.0.1:1", "--listen", "nowhere"], "--listen"),
    ] {
        let (code, _, err) = run(&args);
        assert_eq!(code, Some(64), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}
