//! The HTTP API's and the admin API's request bodies, through their axum
//! routers as `serve` builds them: the first byte picks the endpoint, the
//! second the content type, the rest is the body (or the query). Never a
//! panic or a hang, never a 500, and every 4xx is a JSON error that says
//! what is wrong.
#![no_main]

mod common;

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use floodgate_core::headers::HeaderMode;
use floodgate_server::BUNDLED_RULES;
use floodgate_server::protocol::admin::{self, AdminState};
use floodgate_server::protocol::http::{self as api, HttpState};
use http_body_util::BodyExt;
use libfuzzer_sys::fuzz_target;
use tower::ServiceExt;

const ENDPOINTS: &[(&str, &str, bool)] = &[
    ("POST", "/json", false),
    ("POST", "/v1/check", false),
    ("PUT", "/admin/v1/overrides", true),
    ("DELETE", "/admin/v1/overrides", true),
    ("POST", "/admin/v1/counters", true),
    ("GET", "/admin/v1/overrides", true),
    ("GET", "/admin/v1/status", true),
    ("GET", "/admin/v1/rules", true),
    ("GET", "/readyz", false),
    ("POST", "/v1/check?", false),
    ("GET", "/admin/v1/overrides?", true),
    ("GET", "/admin/v1/dashboard?", true),
    ("GET", "/dashboard/config", true),
    ("PUT", "/admin/v1/keys", true),
    ("POST", "/admin/v1/keys/import", true),
    ("GET", "/admin/v1/keys?", true),
    ("GET", "/admin/v1/tiers", true),
];
const TYPES: &[Option<&str>] =
    &[None, Some("application/json"), Some("text/plain"), Some("application/json; charset=utf-8"), Some("image/png")];

struct Fixture {
    rt: tokio::runtime::Runtime,
    api: Router,
    admin: Router,
}

static FIXTURE: LazyLock<Fixture> = LazyLock::new(|| {
    let service = common::service(BUNDLED_RULES);
    let api = api::router(
        Arc::new(HttpState {
            service: service.clone(),
            headers: HeaderMode::Both,
            draining: Arc::new(AtomicBool::new(false)),
        }),
        64 * 1024,
    );
    let admin =
        admin::router(Arc::new(AdminState { service, token: Some("fuzz-token".into()), draining: Default::default() }));
    Fixture { rt: common::runtime(), api, admin }
});

fuzz_target!(|data: &[u8]| {
    let [endpoint, kind, rest @ ..] = data else { return };
    let (method, path, is_admin) = ENDPOINTS[usize::from(*endpoint) % ENDPOINTS.len()];
    let content_type = TYPES[usize::from(*kind) % TYPES.len()];
    let fx = &*FIXTURE;
    let mut req = http::Request::builder().method(method);
    req = if path.ends_with('?') {
        // The rest as a query string, when it is one.
        let Ok(query) = std::str::from_utf8(rest) else { return };
        let Ok(uri) = format!("{path}{query}").parse::<http::Uri>() else { return };
        req.uri(uri)
    } else {
        req.uri(path)
    };
    if let Some(ct) = content_type {
        req = req.header("content-type", ct);
    }
    if is_admin && kind & 0x80 == 0 {
        req = req.header("authorization", "Bearer fuzz-token");
    }
    let req = req.body(Body::from(rest.to_vec())).expect("a request");
    let router = if is_admin { fx.admin.clone() } else { fx.api.clone() };
    fx.rt.block_on(async {
        let resp = tokio::time::timeout(Duration::from_secs(10), router.oneshot(req))
            .await
            .expect("an answer within 10 s")
            .expect("routers are infallible");
        let status = resp.status();
        let body = resp.into_body().collect().await.expect("a body").to_bytes();
        assert!(status != http::StatusCode::INTERNAL_SERVER_ERROR, "500 for {method} {path}: {body:?}");
        // 429 is a decision (the body is the answer); every other 4xx is an
        // error that says what to send instead.
        if status.is_client_error() && status != http::StatusCode::TOO_MANY_REQUESTS {
            let v: serde_json::Value = serde_json::from_slice(&body).expect("a 4xx body is JSON");
            let e = v.get("error").and_then(|e| e.as_str()).expect("a 4xx body has an error");
            assert!(!e.is_empty(), "{v}");
        }
    });
});
