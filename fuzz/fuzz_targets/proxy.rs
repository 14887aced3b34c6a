//! The reverse proxy's request head: raw bytes from a client through hyper
//! (HTTP/1, as `proxy` serves it), the rate-limit layer (client address,
//! `X-Forwarded-For` from a trusted peer, descriptors from headers, the
//! path, the method and the authority), metering (a tokens limit whose
//! estimate is read from the request's JSON body or a header) and the
//! forwarder (the upstream is a closed port: an admitted request gets a
//! 502, and its reservation settles at 0). Never a panic, a hang or a 500.
#![no_main]

mod common;

use std::net::SocketAddr;
use std::sync::LazyLock;
use std::time::Duration;

use floodgate_core::headers::HeaderMode;
use floodgate_server::proxy::{Forward, ServiceDecider, Upstream};
use floodgate_tower::{PeerAddr, RateLimitLayer, TrustedProxies};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower::{Layer, Service};

const RULES: &[(&str, &str)] = &[(
    "proxy.yaml",
    r#"domain: proxy
request_descriptors:
  - actions: [{remote_address: {}}]
  - actions: [{request_headers: {header_name: x-tenant, descriptor_key: tenant}}]
  - actions:
      - request_headers: {header_name: X-Api-Key, descriptor_key: api_key}
      - request_headers: {header_name: ":path", descriptor_key: path, skip_if_absent: true}
  - actions:
      - request_headers: {header_name: ":method", descriptor_key: method}
      - request_headers: {header_name: ":authority", descriptor_key: host, skip_if_absent: true}
      - generic_key: {descriptor_value: all}
descriptors:
  - key: remote_address
    rate_limit: {unit: second, requests_per_unit: 1000}
  - key: api_key
    rate_limit: {algorithm: sliding_window, unit: minute, requests_per_unit: 50}
    descriptors:
      - key: path
        value: /admin*
        rate_limit: {algorithm: gcra, window: 1s, requests_per_unit: 5, burst: 2}
  - key: method
    value: POST
    descriptors:
      - key: host
        rate_limit: {algorithm: token_bucket, window: 10s, requests_per_unit: 3, burst: 6}
  - key: tenant
    rate_limits:
      - unit: hour
        requests_per_unit: 100000
        cost: {estimate: {body: [max_completion_tokens, max_tokens], default: 500}, actual: {usage: total_tokens}}
      - unit: hour
        requests_per_unit: 1000
        cost: {estimate: {header: x-estimate, default: 5, times: 0.5, plus: 1}, actual: {header: x-cost}}
"#,
)];

struct Fixture {
    rt: tokio::runtime::Runtime,
    layer: RateLimitLayer<ServiceDecider<floodgate_core::MemoryStore>>,
    forward: Forward,
}

static FIXTURE: LazyLock<Fixture> = LazyLock::new(|| {
    let service = common::service(RULES);
    let trusted = TrustedProxies::parse_list("127.0.0.0/8,::1/128").expect("networks");
    let layer = RateLimitLayer::new(ServiceDecider::new(service, "proxy".into()))
        .trusted_proxies(trusted)
        .headers(HeaderMode::Both)
        .max_held(16);
    // Port 9 (discard) on loopback: nothing listens, a connect is refused at once.
    let upstream: Upstream = "http://127.0.0.1:9/base".parse().expect("an upstream");
    let rt = common::runtime();
    let forward = {
        let _guard = rt.enter();
        Forward::new(upstream, Duration::from_secs(2))
    };
    Fixture { rt, layer, forward }
});

fuzz_target!(|data: &[u8]| {
    let fx = &*FIXTURE;
    let svc = fx.layer.clone().metered().layer(fx.forward.clone());
    let peer: SocketAddr = ([127, 0, 0, 1], 40000).into();
    fx.rt.block_on(async {
        let (mut client, server) = tokio::io::duplex(1 << 16);
        let service = hyper::service::service_fn(move |mut req: http::Request<Incoming>| {
            req.extensions_mut().insert(PeerAddr(peer));
            svc.clone().call(req)
        });
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder.timer(TokioTimer::new()).header_read_timeout(Duration::from_secs(1)).keep_alive(true);
        let conn = tokio::spawn(builder.serve_connection(TokioIo::new(server), service));
        let mut response = Vec::new();
        let talk = async {
            client.write_all(data).await?;
            client.shutdown().await?;
            client.read_to_end(&mut response).await
        };
        tokio::time::timeout(Duration::from_secs(10), talk).await.expect("the connection ends within 10 s").ok();
        let _ = tokio::time::timeout(Duration::from_secs(10), conn).await.expect("the server side ends within 10 s");
        // Every response on the connection: none is a 500.
        let text = String::from_utf8_lossy(&response);
        assert!(!text.contains("HTTP/1.1 500"), "{text}");
    });
});
