//! Envoy RLS v3: protobuf bytes through the tonic service as `serve`
//! mounts it (gRPC framing, decoding, the decision). The first byte picks
//! whether the rest is framed here (one message, as Envoy sends) or is the
//! whole request body, framing included. Never a panic or a hang; every
//! answer is a gRPC status.
#![no_main]

mod common;

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use bytes::Bytes;
use floodgate_core::headers::HeaderMode;
use floodgate_server::BUNDLED_RULES;
use floodgate_server::protocol::grpc::Rls;
use http_body_util::{BodyExt, Full};
use libfuzzer_sys::fuzz_target;
use tower::ServiceExt;

struct Fixture {
    rt: tokio::runtime::Runtime,
    service: Arc<common::FuzzService>,
}

static FIXTURE: LazyLock<Fixture> =
    LazyLock::new(|| Fixture { rt: common::runtime(), service: common::service(BUNDLED_RULES) });

fuzz_target!(|data: &[u8]| {
    let [mode, rest @ ..] = data else { return };
    let body = if mode & 1 == 0 {
        let mut framed = Vec::with_capacity(rest.len() + 5);
        framed.push(0);
        framed.extend_from_slice(&(rest.len() as u32).to_be_bytes());
        framed.extend_from_slice(rest);
        framed
    } else {
        rest.to_vec()
    };
    let req = http::Request::builder()
        .method("POST")
        .uri("/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(Full::new(Bytes::from(body)))
        .expect("a request");
    let fx = &*FIXTURE;
    let svc = Rls::server(fx.service.clone(), HeaderMode::Both);
    fx.rt.block_on(async {
        let resp = tokio::time::timeout(Duration::from_secs(10), svc.oneshot(req))
            .await
            .expect("an answer within 10 s")
            .expect("tonic services are infallible");
        let (parts, body) = resp.into_parts();
        let collected = tokio::time::timeout(Duration::from_secs(10), body.collect())
            .await
            .expect("a body within 10 s")
            .expect("a body");
        // A gRPC status, in the trailers or (trailers-only) in the head.
        let status = collected
            .trailers()
            .and_then(|t| t.get("grpc-status"))
            .or_else(|| parts.headers.get("grpc-status"))
            .expect("a grpc-status");
        let code: i32 = status.to_str().expect("ascii").parse().expect("a number");
        // The handler answers OK (0) or INVALID_ARGUMENT (3); tonic answers
        // INTERNAL (13) for bytes that are no framed RateLimitRequest, and
        // OUT_OF_RANGE (11) for a frame longer than its 4 MiB limit, before
        // the handler runs, as gRPC's status code table says ("error parsing
        // request proto": INTERNAL). Anything else is a bug.
        let message = collected
            .trailers()
            .and_then(|t| t.get("grpc-message"))
            .or_else(|| parts.headers.get("grpc-message"))
            .and_then(|m| m.to_str().ok())
            .unwrap_or("");
        assert!(matches!(code, 0 | 3 | 11 | 13), "grpc-status {code}: {message}");
    });
});
