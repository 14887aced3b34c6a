//! The admin API, under `/admin/v1/` on its own address, bearer-token
//! protected (every call needs `Authorization: Bearer <token>` when a token
//! is set; the server refuses a non-loopback admin address without one).
//!
//! | call | what |
//! |---|---|
//! | `GET /admin/v1/status` | rules source, reload status and errors, warnings (e.g. the proxy's domain has no rules), store health |
//! | `GET /admin/v1/rules` | loaded domains and rules, with file:line, and the warnings |
//! | `POST /admin/v1/reload` | reload the rules now (422 with every error; the last good rules stay) |
//! | `GET /admin/v1/overrides` | overrides in (domain, descriptor) order, a page at a time: `?domain=&prefix=&cursor=&limit=` (prefix of the descriptor written `key=value, key=value`, or that descriptor exactly with `exact=true`; `next_cursor` fetches the next page; `limit` up to 1000, default 100) |
//! | `PUT /admin/v1/overrides` | set one: `{"domain", "descriptor": [{"key","value"}], "limits": {rate_limit} or [..]}` |
//! | `DELETE /admin/v1/overrides` | delete one: `{"domain", "descriptor": [...]}` |
//! | `POST /admin/v1/counters` | one descriptor's current counters, without taking anything: `{"domain", "descriptor": [...]}` |
//! | `GET /admin/v1/dashboard` | the dashboard's data now (`?top=N` keys per table, default 10): status, store health, per-rule decisions per second and top keys |
//! | `GET /admin/v1/dashboard/stream` | the same, one JSON line a second (NDJSON, streamed) for as long as the client reads |
//!
//! The dashboard page itself (`GET /dashboard`, its two assets, and
//! `/dashboard/config`: whether a token is needed) needs no token: it asks
//! for one and sends it with each call above.

use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::Backend;
use crate::protocol::http::{ApiError, body, error};
use crate::protocol::json::parse;
use crate::rules::overrides::{Entry, OverrideError, OverrideSpec};
use crate::service::{Descriptor, Request as RlRequest, Service};

/// What the admin handlers share.
#[derive(Debug)]
pub struct AdminState<S> {
    /// The service.
    pub service: Arc<Service<S>>,
    /// The bearer token, when required.
    pub token: Option<String>,
    /// Set when the server shuts down: the dashboard's streams end.
    pub draining: Arc<std::sync::atomic::AtomicBool>,
}

/// The admin router.
pub fn router<S: Backend>(state: Arc<AdminState<S>>) -> Router {
    let protected = Router::new()
        .route("/admin/v1/status", get(status::<S>))
        .route("/admin/v1/rules", get(rules::<S>))
        .route("/admin/v1/reload", post(reload::<S>))
        .route("/admin/v1/overrides", get(list::<S>).put(set::<S>).delete(delete::<S>))
        .route("/admin/v1/counters", post(counters::<S>))
        .route("/admin/v1/dashboard", get(dashboard::<S>))
        .route("/admin/v1/dashboard/stream", get(dashboard_stream::<S>))
        .fallback(|| async {
            error(
                StatusCode::NOT_FOUND,
                "",
                "no such admin endpoint: see /dashboard, /admin/v1/status, rules, reload, overrides, counters, dashboard",
            )
        })
        .method_not_allowed_fallback(|| async {
            error(StatusCode::METHOD_NOT_ALLOWED, "", "method not allowed on this endpoint")
        })
        .layer(middleware::from_fn_with_state(state.clone(), auth::<S>))
        .layer(DefaultBodyLimit::max(1024 * 1024))
        .with_state(state.clone());
    crate::protocol::dashboard::pages(state.token.is_some()).merge(protected)
}

/// Constant-time comparison, so the token cannot be guessed byte by byte
/// from response times.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn auth<S: Backend>(State(state): State<Arc<AdminState<S>>>, req: Request, next: Next) -> Response {
    if let Some(token) = &state.token {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        if !given.is_some_and(|g| same(g.as_bytes(), token.as_bytes())) {
            let mut r = error(StatusCode::UNAUTHORIZED, "authorization", "send Authorization: Bearer <admin token>");
            r.headers_mut().insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer"));
            return r;
        }
    }
    next.run(req).await
}

fn override_error(e: OverrideError) -> ApiError {
    match e {
        OverrideError::Invalid(m) => ApiError::new(StatusCode::BAD_REQUEST, "", m),
        OverrideError::Limits(errs) => ApiError::new(StatusCode::BAD_REQUEST, "limits", errs),
        OverrideError::Storage(m) => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "", m),
        e @ OverrideError::InUse(_) => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "", e.to_string()),
        e @ OverrideError::Shared(_) => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "", e.to_string()),
    }
}

fn no_overrides() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "", "overrides are disabled on this server (start it with --overrides-file)")
}

async fn rules<S: Backend>(State(state): State<Arc<AdminState<S>>>) -> Response {
    let current = state.service.rules().current();
    let mut domains: Vec<Value> = current
        .domains()
        .map(|d| {
            let file = current.files().get(d.file()).map(|p| p.display().to_string()).unwrap_or_default();
            let rules: Vec<Value> = d
                .rules()
                .map(|r| {
                    json!({
                        "descriptor": r.stats_key,
                        "name": r.name.as_deref(),
                        "unlimited": r.limit.is_none(),
                        "algorithm": r.limit.as_ref().map(|l| l.algorithm().kind().as_str()),
                        "limit": r.limit.as_ref().map(|l| l.limit()),
                        "window_ms": r.limit.as_ref().map(|l| l.window().as_millis()),
                        "burst": r.limit.as_ref().map(|l| l.burst()),
                        "shadow_mode": r.shadow_mode,
                        "failure_mode": r.failure_mode.as_str(),
                        "at": format!("{file}:{}:{}", r.source.pos.line, r.source.pos.col),
                    })
                })
                .collect();
            json!({ "domain": d.name(), "file": file, "rules": rules })
        })
        .collect();
    domains.sort_by(|a, b| a["domain"].as_str().cmp(&b["domain"].as_str()));
    axum::Json(json!({ "domains": domains, "warnings": state.service.rules().warnings() })).into_response()
}

/// The readiness report of `/readyz` (rules, reload status, warnings,
/// store), always 200: the admin view of the instance's health.
async fn status<S: Backend>(State(state): State<Arc<AdminState<S>>>) -> Response {
    let (_, body) = crate::protocol::http::readiness(&state.service, false).await;
    axum::Json(body).into_response()
}

async fn reload<S: Backend>(State(state): State<Arc<AdminState<S>>>) -> Response {
    let rules = state.service.rules();
    match rules.reload() {
        Ok(changed) => {
            axum::Json(json!({ "reloaded": true, "changed": changed, "rules": rules.current().rule_count() }))
                .into_response()
        }
        Err(errs) => {
            let errors: Vec<String> = errs.0.iter().map(ToString::to_string).collect();
            (
                StatusCode::UNPROCESSABLE_ENTITY,
                axum::Json(json!({ "reloaded": false, "error": "the rules did not validate; the last good rules stay", "errors": errors })),
            )
                .into_response()
        }
    }
}

/// `GET /admin/v1/overrides`'s query.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    domain: Option<String>,
    #[serde(default)]
    prefix: String,
    /// Only the descriptor written exactly as `prefix` (exact lookup).
    #[serde(default)]
    exact: bool,
    cursor: Option<String>,
    limit: Option<usize>,
}

/// Most overrides one page lists.
const MAX_PAGE: usize = 1_000;

/// A descriptor as the listing orders and filters it: `key=value, key=value`.
fn descriptor_text(d: &[Entry]) -> String {
    d.iter().map(|e| format!("{}={}", e.key, e.value)).collect::<Vec<_>>().join(", ")
}

async fn list<S: Backend>(
    State(state): State<Arc<AdminState<S>>>,
    query: Result<axum::extract::Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let o = state.service.overrides().ok_or_else(no_overrides)?;
    let axum::extract::Query(q) = query.map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "query",
            format!("{}; give domain, prefix, cursor and limit", e.body_text()),
        )
    })?;
    let limit = q.limit.unwrap_or(100);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(ApiError::new(StatusCode::BAD_REQUEST, "limit", format!("give 1 to {MAX_PAGE}")));
    }
    // Ordered by (domain, descriptor text); the cursor is the last listed.
    let mut all: Vec<(String, Arc<crate::rules::overrides::Override>)> = o
        .list()
        .into_iter()
        .filter(|o| q.domain.as_ref().is_none_or(|d| &o.spec.domain == d))
        .map(|o| (format!("{}\u{0}{}", o.spec.domain, descriptor_text(&o.spec.descriptor)), o))
        .filter(|(k, o)| {
            let text = &k[o.spec.domain.len() + 1..];
            if q.exact { text == q.prefix } else { text.starts_with(&q.prefix) }
        })
        .collect();
    all.sort_by(|a, b| a.0.cmp(&b.0));
    let start = q.cursor.as_ref().map_or(0, |c| all.partition_point(|(k, _)| k <= c));
    let page = &all[start..all.len().min(start + limit)];
    let next = (start + page.len() < all.len()).then(|| page.last().map(|(k, _)| k.clone())).flatten();
    let listed: Vec<Value> = page
        .iter()
        .map(|(_, o)| json!({ "domain": o.spec.domain, "descriptor": o.spec.descriptor, "limits": o.spec.limits, "updated_at_unix_s": o.updated_at }))
        .collect();
    Ok(axum::Json(json!({ "overrides": listed, "next_cursor": next, "total": o.len(), "problems": o.problems() }))
        .into_response())
}

/// `?top=N` of the dashboard's calls.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TopQuery {
    top: Option<usize>,
}

fn top_of(
    query: Result<axum::extract::Query<TopQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<usize, ApiError> {
    let axum::extract::Query(q) =
        query.map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "query", format!("{}; give top=N", e.body_text())))?;
    let max = crate::runtime::topkeys::TOP_KEYS;
    match q.top.unwrap_or(10) {
        n @ 1.. if n <= max => Ok(n),
        _ => Err(ApiError::new(StatusCode::BAD_REQUEST, "top", format!("give 1 to {max}"))),
    }
}

async fn dashboard<S: Backend>(
    State(state): State<Arc<AdminState<S>>>,
    query: Result<axum::extract::Query<TopQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let top = top_of(query)?;
    Ok(axum::Json(crate::protocol::dashboard::snapshot(&state.service, top).await).into_response())
}

async fn dashboard_stream<S: Backend>(
    State(state): State<Arc<AdminState<S>>>,
    query: Result<axum::extract::Query<TopQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let top = top_of(query)?;
    Ok(crate::protocol::dashboard::stream(state.service.clone(), top, state.draining.clone()))
}

async fn set<S: Backend>(
    State(state): State<Arc<AdminState<S>>>,
    headers: HeaderMap,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let o = state.service.overrides().ok_or_else(no_overrides)?;
    let spec: OverrideSpec = parse(&body(&headers, raw)?).map_err(ApiError::from)?;
    // A global limit needs peer regions here, as in the rules files.
    if let Ok(rules) = floodgate_core::rules::parse_limits("limits", &spec.limits.to_string(), "override") {
        let regions = state.service.store().regions_count();
        if let Some(why) = rules.iter().find_map(|r| crate::runtime::regions::check_rule(r, regions)) {
            return Err(ApiError::new(StatusCode::BAD_REQUEST, "limits", why));
        }
    }
    let o = o.put(spec).await.map_err(override_error)?;
    let n = o.rules.len();
    Ok(axum::Json(json!({ "set": true, "domain": o.spec.domain, "descriptor": o.spec.descriptor, "limits": n }))
        .into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DescriptorRef {
    domain: String,
    descriptor: Vec<Entry>,
}

async fn delete<S: Backend>(
    State(state): State<Arc<AdminState<S>>>,
    headers: HeaderMap,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let o = state.service.overrides().ok_or_else(no_overrides)?;
    let d: DescriptorRef = parse(&body(&headers, raw)?).map_err(ApiError::from)?;
    let entries: Vec<(&str, &str)> = d.descriptor.iter().map(|e| (e.key.as_str(), e.value.as_str())).collect();
    if o.remove(&d.domain, &entries).await.map_err(override_error)? {
        Ok(axum::Json(json!({ "deleted": true })).into_response())
    } else {
        Err(ApiError::new(StatusCode::NOT_FOUND, "descriptor", "no override for this domain and descriptor"))
    }
}

async fn counters<S: Backend>(
    State(state): State<Arc<AdminState<S>>>,
    headers: HeaderMap,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let d: DescriptorRef = parse(&body(&headers, raw)?).map_err(ApiError::from)?;
    let req = RlRequest {
        domain: d.domain,
        hits_addend: 0,
        descriptors: vec![Descriptor {
            entries: d.descriptor.into_iter().map(|e| (e.key, e.value)).collect(),
            hits_addend: Some(0),
            limit: None,
        }],
    };
    let limits = state.service.peek(&req).await.map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "descriptor", e))?;
    {
        {
            let limits: Vec<Value> = limits
                .into_iter()
                .map(|(key, info, d)| {
                    json!({
                        "counter_key": key,
                        "name": info.name.as_deref(),
                        "algorithm": info.algorithm,
                        "limit": info.requests_per_unit,
                        "window_ms": info.window.as_millis(),
                        "remaining": d.remaining,
                        "reset_after_us": d.reset_after_us(),
                    })
                })
                .collect();
            Ok(axum::Json(json!({ "matched": !limits.is_empty(), "limits": limits })).into_response())
        }
    }
}
