//! The admin API, under `/admin/v1/` on its own address, bearer-token
//! protected (every call needs `Authorization: Bearer <token>` when a token
//! is set; the server refuses a non-loopback admin address without one).
//!
//! | call | what |
//! |---|---|
//! | `GET /admin/v1/status` | rules source, reload status and errors, warnings (e.g. the proxy's domain has no rules), store health |
//! | `GET /admin/v1/rules` | loaded domains and rules, with file:line, and the warnings |
//! | `POST /admin/v1/reload` | reload the rules now (422 with every error; the last good rules stay) |
//! | `GET /admin/v1/keys` | per-key entries in (domain, descriptor) order, a page at a time: `?domain=&prefix=&cursor=&limit=` (prefix of the descriptor written `key=value, key=value`, or that descriptor exactly with `exact=true`; `next_cursor` fetches the next page; `limit` up to 1000, default 100) |
//! | `PUT /admin/v1/keys` | set one: `{"domain", "descriptor": [{"key","value"}], "tier": "pro"}`, or `"limits": {rate_limit} or [..]` instead of `tier` (and an optional `"name"`, its metrics label) |
//! | `DELETE /admin/v1/keys` | delete one: `{"domain", "descriptor": [...]}` |
//! | `POST /admin/v1/keys/import` | set up to 10 000 at once, all or none: `{"entries": [ ... ]}`; a refusal lists every bad entry by index |
//! | `GET /admin/v1/tiers` | entries per (domain, tier) |
//! | `/admin/v1/overrides` | the same as `/admin/v1/keys` (GET, PUT, DELETE), as before tiers: listings under `overrides` |
//! | `POST /admin/v1/counters` | one descriptor's current counters, without taking anything: `{"domain", "descriptor": [...]}` |
//! | `GET /admin/v1/dashboard` | the dashboard's data now (`?top=N` keys per table, default 10; `?range=5m`, `1h` or `1d`): status, store health, per-rule decisions over the range and top keys, peer regions over the range |
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
use crate::service::{Descriptor, LimitFrom, Request as RlRequest, Service};
use floodgate_perkey::{Entry, KeyError, KeySpec, MAX_BATCH, PerKey};

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
        .route("/admin/v1/keys", get(list::<S>).put(set::<S>).delete(delete::<S>))
        .route("/admin/v1/overrides", get(list_overrides::<S>).put(set::<S>).delete(delete::<S>))
        .route("/admin/v1/keys/import", post(import::<S>).layer(DefaultBodyLimit::max(IMPORT_BODY_LIMIT)))
        .route("/admin/v1/tiers", get(tiers::<S>))
        .route("/admin/v1/counters", post(counters::<S>))
        .route("/admin/v1/dashboard", get(dashboard::<S>))
        .route("/admin/v1/dashboard/stream", get(dashboard_stream::<S>))
        .fallback(|| async {
            error(
                StatusCode::NOT_FOUND,
                "",
                "no such admin endpoint: see /dashboard, /admin/v1/status, rules, reload, keys, keys/import, tiers, counters, dashboard",
            )
        })
        .method_not_allowed_fallback(|| async {
            error(StatusCode::METHOD_NOT_ALLOWED, "", "method not allowed on this endpoint")
        })
        .layer(middleware::from_fn_with_state(state.clone(), auth::<S>))
        .layer(DefaultBodyLimit::max(1024 * 1024))
        .with_state(state.clone());
    crate::dashboard::page::pages(state.token.is_some()).merge(protected)
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

fn key_error(e: KeyError) -> ApiError {
    match e {
        KeyError::Invalid(m) => ApiError::new(StatusCode::BAD_REQUEST, "", m),
        KeyError::Limits(errs) => ApiError::new(StatusCode::BAD_REQUEST, "limits", errs),
        KeyError::Storage(m) => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "", m),
        e @ KeyError::InUse(_) => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "", e.to_string()),
        e @ KeyError::Shared(_) => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "", e.to_string()),
    }
}

fn keys_of<S: Backend>(state: &AdminState<S>) -> Result<&Arc<PerKey>, ApiError> {
    state.service.keys().ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "",
            "per-key entries are disabled on this server (start it without --overrides-file none)",
        )
    })
}

/// Largest import batch body: 10 000 entries of up to ~1.6 KiB each.
const IMPORT_BODY_LIMIT: usize = 16 << 20;

async fn rules<S: Backend>(State(state): State<Arc<AdminState<S>>>) -> Response {
    let current = state.service.rules().current();
    // Per-key entries by (domain, tier; "" for their own limits).
    let counts: std::collections::HashMap<(String, String), u64> =
        state.service.keys().map(|k| k.counts().into_iter().map(|(d, t, n)| ((d, t), n)).collect()).unwrap_or_default();
    let mut domains: Vec<Value> = current
        .domains()
        .map(|d| {
            let file = current.files().get(d.file()).map(|p| p.display().to_string()).unwrap_or_default();
            // A rule of the files or of a tier, as the dashboard and a
            // reader want it.
            let rule_json = |r: &floodgate_core::rules::Rule| {
                json!({
                    "rule": r.label(),
                    "name": r.name.as_deref(),
                    "unlimited": r.limit.is_none(),
                    "algorithm": r.limit.as_ref().map(|l| l.algorithm().kind().as_str()),
                    "limit": r.limit.as_ref().map(|l| l.limit()),
                    "window_ms": r.limit.as_ref().map(|l| l.window().as_millis()),
                    "burst": r.limit.as_ref().map(|l| l.burst()),
                    "charge": r.limit.as_ref().map(|l| l.charge().as_str()),
                    "scope": r.scope.as_str(),
                    "shadow_mode": r.shadow_mode,
                    "failure_mode": r.failure_mode.as_str(),
                    "at": current.at(d, r.source.pos),
                })
            };
            let rules: Vec<Value> = d
                .rules()
                .map(|r| {
                    let mut v = rule_json(r);
                    v["descriptor"] = json!(r.stats_key);
                    v
                })
                .collect();
            let mut tiers: Vec<Value> = d
                .tiers()
                .map(|(name, t)| {
                    let limits: Vec<Value> = t.rules.iter().map(rule_json).collect();
                    let entries = counts.get(&(d.name().to_owned(), name.to_owned())).copied().unwrap_or(0);
                    json!({ "tier": name, "limits": limits, "entries": entries, "at": current.at(d, t.pos) })
                })
                .collect();
            tiers.sort_by(|a, b| a["tier"].as_str().cmp(&b["tier"].as_str()));
            // Per-key entries with limits of their own (not a tier's).
            let own = counts.get(&(d.name().to_owned(), String::new())).copied().unwrap_or(0);
            json!({ "domain": d.name(), "file": file, "rules": rules, "tiers": tiers, "own_entries": own })
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

async fn list<S: Backend>(
    State(state): State<Arc<AdminState<S>>>,
    query: Result<axum::extract::Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    listing(&state, query, "entries").await
}

/// `GET /admin/v1/overrides`: the listing as before tiers (under
/// `overrides`).
async fn list_overrides<S: Backend>(
    State(state): State<Arc<AdminState<S>>>,
    query: Result<axum::extract::Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    listing(&state, query, "overrides").await
}

async fn listing<S: Backend>(
    state: &AdminState<S>,
    query: Result<axum::extract::Query<ListQuery>, axum::extract::rejection::QueryRejection>,
    field: &str,
) -> Result<Response, ApiError> {
    let k = keys_of(state)?;
    let axum::extract::Query(q) = query.map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "query",
            format!("{}; give domain, prefix, exact, cursor and limit", e.body_text()),
        )
    })?;
    let limit = q.limit.unwrap_or(100);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(ApiError::new(StatusCode::BAD_REQUEST, "limit", format!("give 1 to {MAX_PAGE}")));
    }
    let page = k.list(q.domain.as_deref(), &q.prefix, q.exact, q.cursor.as_deref(), limit).await.map_err(key_error)?;
    let listed: Vec<Value> = page.entries.iter().map(|(spec, at)| entry_json(spec, *at)).collect();
    let mut out = serde_json::Map::new();
    out.insert(field.to_owned(), Value::Array(listed));
    out.insert("next_cursor".into(), json!(page.next_cursor));
    out.insert("total".into(), json!(k.total()));
    Ok(axum::Json(Value::Object(out)).into_response())
}

/// An entry as the API shows it.
fn entry_json(spec: &KeySpec, updated_at: u64) -> Value {
    let mut v = serde_json::to_value(spec).unwrap_or_default();
    v["updated_at_unix_s"] = json!(updated_at);
    v
}

async fn tiers<S: Backend>(State(state): State<Arc<AdminState<S>>>) -> Result<Response, ApiError> {
    let k = keys_of(&state)?;
    let rows: Vec<Value> = k
        .counts()
        .into_iter()
        .map(|(domain, tier, n)| {
            let tier = (!tier.is_empty()).then_some(tier);
            json!({ "domain": domain, "tier": tier, "entries": n })
        })
        .collect();
    Ok(axum::Json(json!({ "tiers": rows, "total": k.total() })).into_response())
}

/// `?top=N&range=5m|1h|1d` of the dashboard's calls.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DashQuery {
    top: Option<usize>,
    range: Option<String>,
}

type DashQueryResult = Result<axum::extract::Query<DashQuery>, axum::extract::rejection::QueryRejection>;

/// The keys per table (default 10) and the range's index (default `5m`).
fn dash_query(query: DashQueryResult) -> Result<(usize, usize), ApiError> {
    let axum::extract::Query(q) = query.map_err(|e| {
        ApiError::new(StatusCode::BAD_REQUEST, "query", format!("{}; give top=N and range=5m, 1h or 1d", e.body_text()))
    })?;
    let max = crate::dashboard::topkeys::TOP_KEYS;
    let top = match q.top.unwrap_or(10) {
        n @ 1.. if n <= max => n,
        _ => return Err(ApiError::new(StatusCode::BAD_REQUEST, "top", format!("give 1 to {max}"))),
    };
    let range = match q.range.as_deref() {
        None => 0,
        Some(r) => crate::dashboard::history::range_named(r).ok_or_else(|| {
            ApiError::new(StatusCode::BAD_REQUEST, "range", format!("\"{r}\" is not a range; give 5m, 1h or 1d"))
        })?,
    };
    Ok((top, range))
}

async fn dashboard<S: Backend>(
    State(state): State<Arc<AdminState<S>>>,
    query: DashQueryResult,
) -> Result<Response, ApiError> {
    let (top, range) = dash_query(query)?;
    Ok(axum::Json(crate::dashboard::page::snapshot(&state.service, top, range).await).into_response())
}

async fn dashboard_stream<S: Backend>(
    State(state): State<Arc<AdminState<S>>>,
    query: DashQueryResult,
) -> Result<Response, ApiError> {
    let (top, range) = dash_query(query)?;
    Ok(crate::dashboard::page::stream(state.service.clone(), top, range, state.draining.clone()))
}

async fn set<S: Backend>(
    State(state): State<Arc<AdminState<S>>>,
    headers: HeaderMap,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let k = keys_of(&state)?;
    let spec: KeySpec = parse(&body(&headers, raw)?).map_err(ApiError::from)?;
    let rules = state.service.rules().current();
    let e = k.put(spec, &rules, rule_check(&state)).await.map_err(key_error)?;
    let limits = e.rules_in(&rules).map_or(0, <[_]>::len);
    Ok(axum::Json(json!({ "set": true, "domain": e.spec.domain, "descriptor": e.spec.descriptor, "tier": e.spec.tier, "limits": limits }))
        .into_response())
}

/// Refuses limits this server cannot honour (a `global` rule without
/// regions, a `bounded` slice under one hit), for per-key entries' own
/// limits.
fn rule_check<S: Backend>(state: &AdminState<S>) -> impl Fn(&floodgate_core::rules::Rule) -> Option<String> {
    let regions = state.service.store().regions_count();
    move |r| crate::store::regions::check_rule(r, regions)
}

/// `POST /admin/v1/keys/import`'s body.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Batch {
    entries: Vec<KeySpec>,
}

async fn import<S: Backend>(
    State(state): State<Arc<AdminState<S>>>,
    headers: HeaderMap,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let k = keys_of(&state)?;
    let batch: Batch = parse(&body(&headers, raw)?).map_err(ApiError::from)?;
    if batch.entries.len() > MAX_BATCH {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "entries",
            format!("{} entries: send at most {MAX_BATCH} per batch", batch.entries.len()),
        ));
    }
    let built = match PerKey::validate(batch.entries, &state.service.rules().current(), rule_check(&state)) {
        Ok(b) => b,
        Err(errors) => {
            let errors: Vec<Value> =
                errors.iter().map(|(i, e)| json!({ "index": i, "error": e.to_string() })).collect();
            return Ok((
                StatusCode::BAD_REQUEST,
                axum::Json(json!({ "error": "nothing of this batch was written", "errors": errors })),
            )
                .into_response());
        }
    };
    let n = k.put_all(&built).await.map_err(key_error)?;
    Ok(axum::Json(json!({ "written": n, "total": k.total() })).into_response())
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
    let k = keys_of(&state)?;
    let d: DescriptorRef = parse(&body(&headers, raw)?).map_err(ApiError::from)?;
    let entries: Vec<(&str, &str)> = d.descriptor.iter().map(|e| (e.key.as_str(), e.value.as_str())).collect();
    if k.remove(&d.domain, &entries).await.map_err(key_error)? {
        Ok(axum::Json(json!({ "deleted": true })).into_response())
    } else {
        Err(ApiError::new(StatusCode::NOT_FOUND, "descriptor", "no per-key entry for this domain and descriptor"))
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
            refund: false,
            limit: None,
            lease: None,
        }],
    };
    let limits = state.service.peek(&req).await.map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "descriptor", e))?;
    let limits: Vec<Value> = limits
        .into_iter()
        .map(|p| {
            let (from, tier) = match p.from {
                LimitFrom::Rules => ("rules", None),
                LimitFrom::Tier(t) => ("tier", Some(t)),
                LimitFrom::PerKey => ("per_key", None),
                LimitFrom::Request => ("request", None),
            };
            let mut v = json!({
                "counter_key": p.counter_key,
                "rule": p.rule,
                "from": from,
                "tier": tier,
                "at": p.at,
                "shadow": p.shadow,
                "limited_now": false,
            });
            match p.counters {
                None => v["unlimited"] = json!(true),
                Some(Err(e)) => v["error"] = json!(format!("{e}: the rule's failure policy decides")),
                Some(Ok((info, capacity, d))) => {
                    let counters = json!({
                        "name": info.name.as_deref(),
                        "algorithm": info.algorithm,
                        "limit": info.requests_per_unit,
                        "capacity": capacity,
                        "window_ms": info.window.as_millis(),
                        "used": capacity.saturating_sub(d.remaining),
                        "remaining": d.remaining,
                        "reset_after_us": d.reset_after_us(),
                        // A request of one hit would be denied now (shadow
                        // rules never deny).
                        "limited_now": d.remaining == 0 && !p.shadow,
                    });
                    if let (Value::Object(o), Value::Object(c)) = (&mut v, counters) {
                        o.extend(c);
                    }
                }
            }
            v
        })
        .collect();
    let limited = limits.iter().any(|l| l["limited_now"] == json!(true));
    Ok(axum::Json(json!({ "matched": !limits.is_empty(), "limited_now": limited, "limits": limits })).into_response())
}
