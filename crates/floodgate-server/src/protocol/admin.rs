//! The admin API, under `/admin/v1/` on its own address, bearer-token
//! protected (every call needs `Authorization: Bearer <token>` when a token
//! is set; the server refuses a non-loopback admin address without one).
//!
//! | call | what |
//! |---|---|
//! | `GET /admin/v1/status` | rules source, reload status and errors, warnings (e.g. the proxy's domain has no rules), store health |
//! | `GET /admin/v1/rules` | loaded domains and rules, with file:line, and the warnings |
//! | `POST /admin/v1/reload` | reload the rules now (422 with every error; the last good rules stay) |
//! | `GET /admin/v1/overrides` | every override |
//! | `PUT /admin/v1/overrides` | set one: `{"domain", "descriptor": [{"key","value"}], "limits": {rate_limit} or [..]}` |
//! | `DELETE /admin/v1/overrides` | delete one: `{"domain", "descriptor": [...]}` |
//! | `POST /admin/v1/counters` | one descriptor's current counters, without taking anything: `{"domain", "descriptor": [...]}` |

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
}

/// The admin router.
pub fn router<S: Backend>(state: Arc<AdminState<S>>) -> Router {
    Router::new()
        .route("/admin/v1/status", get(status::<S>))
        .route("/admin/v1/rules", get(rules::<S>))
        .route("/admin/v1/reload", post(reload::<S>))
        .route("/admin/v1/overrides", get(list::<S>).put(set::<S>).delete(delete::<S>))
        .route("/admin/v1/counters", post(counters::<S>))
        .fallback(|| async {
            error(
                StatusCode::NOT_FOUND,
                "",
                "no such admin endpoint: see /admin/v1/status, rules, reload, overrides, counters",
            )
        })
        .method_not_allowed_fallback(|| async {
            error(StatusCode::METHOD_NOT_ALLOWED, "", "method not allowed on this endpoint")
        })
        .layer(middleware::from_fn_with_state(state.clone(), auth::<S>))
        .layer(DefaultBodyLimit::max(1024 * 1024))
        .with_state(state)
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

async fn list<S: Backend>(State(state): State<Arc<AdminState<S>>>) -> Result<Response, ApiError> {
    let o = state.service.overrides().ok_or_else(no_overrides)?;
    let all: Vec<Value> = o
        .list()
        .iter()
        .map(|o| json!({ "domain": o.spec.domain, "descriptor": o.spec.descriptor, "limits": o.spec.limits, "updated_at_unix_s": o.updated_at }))
        .collect();
    Ok(axum::Json(json!({ "overrides": all, "problems": o.problems() })).into_response())
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
