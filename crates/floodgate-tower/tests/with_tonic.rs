//! The layer around a real tonic gRPC server, over a real socket: calls are
//! limited per peer address (tonic's `TcpConnectInfo`), a denied call gets
//! gRPC's `RESOURCE_EXHAUSTED` with `retry-after` and the rate-limit headers
//! as metadata (not an HTTP 429, which gRPC clients see as `UNAVAILABLE`),
//! and the service is not called.

use std::time::Duration;

use floodgate_core::{Algorithm, Limit, MemoryStore};
use floodgate_tower::{Key, KeyedLimit, RateLimitLayer};
use tonic::Code;
use tonic::transport::server::TcpIncoming;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

#[tokio::test]
async fn grpc_calls_are_limited_with_resource_exhausted() {
    let limit = Limit::new(Algorithm::FixedWindow, 2, Duration::from_secs(3600)).unwrap();
    let layer = RateLimitLayer::new(KeyedLimit::new(limit, Key::ClientIp, MemoryStore::new()).name("per_peer"));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (_reporter, health) = tonic_health::server::health_reporter();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(
        tonic::transport::Server::builder().layer(layer).add_service(health).serve_with_incoming_shutdown(
            TcpIncoming::from(listener),
            async {
                let _ = stop_rx.await;
            },
        ),
    );

    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}")).unwrap().connect().await.unwrap();
    let mut client = HealthClient::new(channel);
    let check = || HealthCheckRequest { service: String::new() };
    for remaining in ["1", "0"] {
        let r = client.check(check()).await.expect("within the limit");
        assert_eq!(r.get_ref().status, 1, "SERVING");
        let md = r.metadata();
        assert_eq!(md.get("x-ratelimit-limit").unwrap(), "2");
        assert_eq!(md.get("x-ratelimit-remaining").unwrap(), remaining);
        assert_eq!(md.get("ratelimit-policy").unwrap(), "\"per_peer\";q=2;w=3600");
    }

    let denied = client.check(check()).await.expect_err("over the limit");
    assert_eq!(denied.code(), Code::ResourceExhausted, "{denied:?}");
    assert!(denied.message().starts_with("rate limit exceeded, retry after "), "{}", denied.message());
    let md = denied.metadata();
    let retry: u64 = md.get("retry-after").expect("retry-after").to_str().unwrap().parse().unwrap();
    assert!((1..=3600).contains(&retry), "retry-after {retry}");
    assert_eq!(md.get("x-ratelimit-remaining").unwrap(), "0");

    // The connection stays usable and the next call is denied too.
    assert_eq!(client.check(check()).await.unwrap_err().code(), Code::ResourceExhausted);

    let _ = stop_tx.send(());
    server.await.unwrap().unwrap();
}
