//! The HTTP API: `POST /json` and `GET /healthcheck` as envoyproxy/ratelimit
//! serves them, `POST /v1/check`, `GET /healthz`, `GET /readyz`,
//! `GET /metrics`.
//!
//! Every bad request gets a JSON error naming the field: 400 for malformed
//! or invalid bodies, 413 above the body limit, 415 for a body that is not
//! JSON, 405/404 for wrong methods and paths.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};

use crate::Backend;
use crate::metrics::{Protocol, gauge};
use crate::protocol::budget;
use crate::protocol::json::{BadRequest, check_response, parse_check_request, parse_pb_request, pb_response};
use crate::service::{Request, RequestError, Service};
use floodgate_core::headers::HeaderMode;

/// Default largest request body: 64 KiB.
pub const DEFAULT_BODY_LIMIT: usize = 64 * 1024;

/// What the HTTP handlers share.
#[derive(Debug)]
pub struct HttpState<S> {
    /// The service.
    pub service: Arc<Service<S>>,
    /// Which rate-limit headers to send.
    pub headers: HeaderMode,
    /// Set when shutting down: `/readyz` answers 503 so load balancers
    /// drain this instance.
    pub draining: Arc<AtomicBool>,
}

/// The HTTP API router.
pub fn router<S: Backend>(state: Arc<HttpState<S>>, body_limit: usize) -> Router {
    Router::new()
        .route("/json", post(pb_json::<S>))
        .route("/v1/check", post(check::<S>))
        .route("/v1/extend", post(extend::<S>))
        .route("/v1/reserve", post(budget::reserve::<S>))
        .route("/v1/settle", post(budget::settle::<S>))
        .route("/v1/cancel", post(budget::cancel::<S>))
        .route("/healthcheck", get(healthcheck::<S>))
        .route("/healthz", get(|| async { (StatusCode::OK, axum::Json(json!({"status": "ok"}))) }))
        .route("/readyz", get(readyz::<S>))
        .route("/metrics", get(metrics::<S>))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(body_limit))
        .with_state(state)
}

/// A JSON error: `{"error": what is wrong and what to send, "field": path}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    status: StatusCode,
    field: String,
    message: String,
}

impl ApiError {
    /// An error with `status`, about `field` (empty for the whole request).
    pub fn new(status: StatusCode, field: &str, message: impl std::fmt::Display) -> Self {
        Self { status, field: field.to_owned(), message: message.to_string() }
    }
}

impl From<BadRequest> for ApiError {
    fn from(e: BadRequest) -> Self {
        Self { status: StatusCode::BAD_REQUEST, field: e.field, message: e.message }
    }
}

impl From<RequestError> for ApiError {
    /// 400, naming the field the message starts with.
    fn from(e: RequestError) -> Self {
        let msg = e.to_string();
        let field = msg.split(':').next().unwrap_or("").to_owned();
        ApiError::new(StatusCode::BAD_REQUEST, &field, msg)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(json!({ "error": self.message, "field": self.field }))).into_response()
    }
}

/// A JSON error response.
pub fn error(status: StatusCode, field: &str, message: impl std::fmt::Display) -> Response {
    ApiError::new(status, field, message).into_response()
}

async fn not_found() -> Response {
    error(
        StatusCode::NOT_FOUND,
        "",
        "no such endpoint: see docs/service.md (\"The HTTP API\") for /json, /v1/check, /v1/reserve, /v1/settle, /v1/cancel, /healthz, /readyz, /metrics",
    )
}

async fn method_not_allowed() -> Response {
    error(StatusCode::METHOD_NOT_ALLOWED, "", "method not allowed on this endpoint")
}

/// The body, or the JSON error for a body that cannot be read.
pub fn body(headers: &HeaderMap, body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    if let Some(ct) = headers.get(header::CONTENT_TYPE) {
        let ct = ct.to_str().unwrap_or("");
        let mime = ct.split(';').next().unwrap_or("").trim();
        // envoyproxy/ratelimit's clients often send no type or a form type
        // with a JSON body; refuse only types that are clearly something else.
        if !(mime.is_empty() || mime.ends_with("json") || mime == "text/plain" || mime.starts_with("application/x-www"))
        {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "",
                format!("content-type `{ct}`: send application/json"),
            ));
        }
    }
    body.map_err(|e| {
        let status = e.status();
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(status, "", "body too large: send one request of at most the configured body limit")
        } else {
            ApiError::new(status, "", format!("cannot read the body: {e}"))
        }
    })
}

pub(crate) fn with_headers(mut resp: Response, hs: Vec<(&'static str, String)>) -> Response {
    for (k, v) in hs {
        if let Ok(v) = HeaderValue::from_str(&v) {
            resp.headers_mut().insert(HeaderName::from_static(k), v);
        }
    }
    resp
}

async fn decide<S: Backend>(
    state: &HttpState<S>,
    req: &Request,
    protocol: Protocol,
) -> Result<crate::service::Decided, ApiError> {
    state.service.decide(req, protocol).await.map_err(ApiError::from)
}

/// A parsed body, or its error (counted as a malformed request).
fn parsed<S: Backend>(
    state: &HttpState<S>,
    protocol: Protocol,
    r: Result<Request, BadRequest>,
) -> Result<Request, ApiError> {
    r.map_err(|e| {
        state.service.metrics().request(protocol, None, std::time::Duration::ZERO);
        ApiError::from(e)
    })
}

/// `POST /json`: 200 OK, 429 over the limit, with the RLS response as JSON.
async fn pb_json<S: Backend>(
    State(state): State<Arc<HttpState<S>>>,
    headers_in: HeaderMap,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let raw = body(&headers_in, raw)?;
    let req = parsed(&state, Protocol::Json, parse_pb_request(&raw))?;
    let decided = decide(&state, &req, Protocol::Json).await?;
    let status = if decided.answer.allowed { StatusCode::OK } else { StatusCode::TOO_MANY_REQUESTS };
    Ok((status, axum::Json(pb_response(&decided, state.headers))).into_response())
}

/// `POST /v1/check`: always 200 with the decision in the body (and the
/// rate-limit headers on the response too).
async fn check<S: Backend>(
    State(state): State<Arc<HttpState<S>>>,
    headers_in: HeaderMap,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    check_as(&state, &headers_in, raw, false).await
}

/// `POST /v1/extend`: extend the `lease` of every concurrency limit the
/// descriptors match to its `lease_ttl` from now (the body of `/v1/check`
/// with `lease`): `allowed` while the lease was held; denied once it is gone
/// (acquire again).
async fn extend<S: Backend>(
    State(state): State<Arc<HttpState<S>>>,
    headers_in: HeaderMap,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    check_as(&state, &headers_in, raw, true).await
}

/// A `/v1/check` body decided, or with `extend` its leases extended.
async fn check_as<S: Backend>(
    state: &HttpState<S>,
    headers_in: &HeaderMap,
    raw: Result<Bytes, BytesRejection>,
    extend: bool,
) -> Result<Response, ApiError> {
    let raw = body(headers_in, raw)?;
    let req = parsed(state, Protocol::Check, parse_check_request(&raw))?;
    let decided = if extend {
        state.service.extend(&req, Protocol::Check).await.map_err(ApiError::from)?
    } else {
        decide(state, &req, Protocol::Check).await?
    };
    let resp = (StatusCode::OK, axum::Json(check_response(&decided, state.headers))).into_response();
    Ok(with_headers(resp, decided.answer.headers(state.headers)))
}

/// envoyproxy/ratelimit's probe: 200 `OK` while serving.
async fn healthcheck<S: Backend>(State(state): State<Arc<HttpState<S>>>) -> Response {
    if state.draining.load(Ordering::Relaxed) {
        (StatusCode::SERVICE_UNAVAILABLE, "draining").into_response()
    } else {
        (StatusCode::OK, "OK").into_response()
    }
}

/// How long readiness waits for the store's ping.
pub const PING_WITHIN: std::time::Duration = std::time::Duration::from_secs(1);

/// The readiness report: rules, reload status, warnings, regions, and
/// whether the store answers a ping (within [`PING_WITHIN`]).
pub async fn readiness<S: Backend>(service: &Service<S>, draining: bool) -> (bool, Value) {
    let rules = service.rules();
    let status = rules.status();
    let current = rules.current();
    // A store that does not answer within a second is not ready (a probe
    // waits no longer, and the dashboard's line must not wait on it).
    let store = match tokio::time::timeout(PING_WITHIN, service.store().ping()).await {
        Ok(r) => r,
        Err(_) => Err(floodgate_core::StoreError::Unavailable(format!(
            "no answer to a ping within {} ms",
            PING_WITHIN.as_millis()
        ))),
    };
    let ready = !draining && store.is_ok();
    let ts = |t: Option<std::time::SystemTime>| {
        t.and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).map(|d| d.as_secs())
    };
    let body = json!({
        "ready": ready,
        "draining": draining,
        "rules": {
            "source": rules.source().to_string(),
            "domains": current.domains().count(),
            "rules": current.rule_count(),
            "loaded_at_unix_s": ts(status.loaded_at),
            "reloads": rules.reloads(),
            "reload_failures": rules.failures(),
            "last_error": status.last_error,
            "last_errors": status.last_errors,
            "failed_at_unix_s": ts(status.failed_at),
        },
        "warnings": rules.warnings(),
        "regions": service.store().regions_health(),
        "store": match &store {
            Ok(()) => json!({"ok": true}),
            Err(e) => json!({"ok": false, "error": e.to_string()}),
        },
    });
    (ready, body)
}

async fn readyz<S: Backend>(State(state): State<Arc<HttpState<S>>>) -> Response {
    let (ready, body) = readiness(&state.service, state.draining.load(Ordering::Relaxed)).await;
    let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (status, axum::Json(body)).into_response()
}

async fn metrics<S: Backend>(State(state): State<Arc<HttpState<S>>>) -> Response {
    let mut out = String::with_capacity(8 * 1024);
    let service = &state.service;
    service.metrics().render(&mut out);
    let rules = service.rules();
    gauge(&mut out, "floodgate_config_reloads_total", "counter", "Successful rule reloads.", rules.reloads());
    gauge(
        &mut out,
        "floodgate_config_reload_failures_total",
        "counter",
        "Rule reloads refused (the last good rules stay).",
        rules.failures(),
    );
    let current = rules.current();
    gauge(&mut out, "floodgate_config_rules", "gauge", "Rules loaded.", current.rule_count());
    gauge(
        &mut out,
        "floodgate_config_last_reload_ok",
        "gauge",
        "1 when the last reload succeeded.",
        u8::from(rules.status().last_error.is_none()),
    );
    if let Some(k) = service.keys() {
        crate::metrics::render_keys(&mut out, k);
    }
    service.store().render_metrics(&mut out);
    crate::metrics::render_leases(&mut out, &service.leases());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], out).into_response()
}
