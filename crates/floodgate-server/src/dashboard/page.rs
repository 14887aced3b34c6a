//! The dashboard: one page on the admin address, `GET /dashboard`, with its
//! script and style built into the binary (nothing is fetched from
//! anywhere else, so it works offline) and a strict Content-Security-Policy
//! (only this origin's script, style and calls). The page and its assets
//! need no token; the data does, as every admin call: the page asks for
//! the token, keeps it in `sessionStorage` and sends it as an
//! `Authorization` header with `fetch`. No cookies, so there is nothing for
//! a cross-site request to ride on.
//!
//! The data ([`snapshot`]): the readiness report (rules, last reload and
//! its errors, warnings, regions), the store's health and round trip, and
//! per rule its decisions per second and top keys
//! ([`crate::dashboard`]). `GET /admin/v1/dashboard` answers it
//! once; `/admin/v1/dashboard/stream` sends it as one JSON line a second
//! for as long as the client reads, and stops with the client (or at
//! shutdown). Nothing is rendered or sent while nobody watches.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};

use crate::Backend;
use crate::service::Service;

const PAGE: &str = include_str!("assets/dashboard.html");
const SCRIPT: &str = include_str!("assets/dashboard.js");
const STYLE: &str = include_str!("assets/dashboard.css");

/// The page may load its own script and style and call its own origin;
/// nothing else.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; \
                   base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// The page and its assets (no token needed), and whether the data needs
/// one (`GET /dashboard/config`), so the page asks for it before calling.
pub(crate) fn pages(token_required: bool) -> Router {
    Router::new()
        .route("/dashboard/config", get(move || async move { axum::Json(json!({ "token_required": token_required })) }))
        .route("/dashboard", get(|| async { asset(PAGE, "text/html; charset=utf-8") }))
        .route("/dashboard/app.js", get(|| async { asset(SCRIPT, "text/javascript; charset=utf-8") }))
        .route("/dashboard/app.css", get(|| async { asset(STYLE, "text/css; charset=utf-8") }))
}

fn asset(body: &'static str, kind: &'static str) -> Response {
    let mut r = body.into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(kind));
    h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

/// The dashboard's data now, with the `top` heaviest keys per table and
/// the histories over `range` (an index into
/// [`crate::dashboard::history::RANGES`]).
pub async fn snapshot<S: Backend>(service: &Service<S>, top: usize, range: usize) -> Value {
    let asked = Instant::now();
    let (_, mut status) = crate::protocol::http::readiness(service, false).await;
    let round_trip = asked.elapsed();
    if let Value::Object(o) = &mut status {
        let mut store = o.remove("store").unwrap_or(Value::Null);
        if let (Value::Object(s), Value::Object(h)) = (&mut store, service.store().store_health()) {
            s.extend(h);
        }
        if let Value::Object(s) = &mut store {
            s.insert("round_trip_ms".into(), json!(round_trip.as_secs_f64() * 1e3));
        }
        o.insert("store".into(), store);
    }
    let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis());
    json!({
        "now_unix_ms": now_ms,
        "status": status,
        "range": crate::dashboard::history::RANGES[range].0,
        "dashboard": with_leases(service.metrics().dashboard_json(top, range), &service.leases()),
    })
}

/// The dashboard's rules with their concurrency limits' slots: `in_flight`
/// and `concurrency` on each such rule's entry.
fn with_leases(mut dashboard: Value, leases: &[crate::service::RuleLeases]) -> Value {
    if let Some(rules) = dashboard["rules"].as_array_mut() {
        for r in rules {
            let lease = leases.iter().find(|l| r["domain"] == l.domain.as_str() && r["rule"] == l.rule.as_str());
            if let Some(l) = lease {
                // (null: leases in a shared store, held there, not known here.)
                r["in_flight"] = json!(l.in_flight());
                r["concurrency"] = json!(l.concurrency);
                r["leases_expired"] = json!(l.stats.expired);
            }
        }
    }
    dashboard
}

/// [`snapshot`] once a second as NDJSON, until the client stops reading
/// (its body is dropped) or `draining` is set.
pub fn stream<S: Backend>(service: Arc<Service<S>>, top: usize, range: usize, draining: Arc<AtomicBool>) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(1);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while !draining.load(Relaxed) {
            tick.tick().await;
            let mut line = snapshot(&service, top, range).await.to_string();
            line.push('\n');
            if tx.send(Ok(Bytes::from(line))).await.is_err() {
                break;
            }
        }
    });
    let mut r = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx)).into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/x-ndjson"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}
