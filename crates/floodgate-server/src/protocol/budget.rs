//! Reservations over HTTP: `POST /v1/reserve`, `/v1/settle` and
//! `/v1/cancel` (docs/budgets.md, "Reservations"); the gRPC service
//! `floodgate.budget.v1.Budget` is in [`crate::protocol::budget_grpc`].
//!
//! * `/v1/reserve`: `/v1/check`'s body (`hits` is the estimate, 0 or
//!   more) and its answer, with `reservation` (the id, or `null` when
//!   nothing was kept) and `reservation_ttl_ms`.
//! * `/v1/settle`: `{"reservation": "<id>", "actual": 120}` (one amount for
//!   every limit) or `"actual": [120, 500000]` (one per limit, in the
//!   reserve's order); `/v1/cancel`: `{"reservation": "<id>"}` (a settle
//!   at 0). The answer: `{"reservation", "again", "limits": [...]}`.
//!
//! Errors: 400 with the field for a malformed body or amounts, 404 for an
//! unknown reservation, 409 for a second settle with other amounts, 501
//! when the store keeps no reservations, 503 when it cannot be reached.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::Backend;
use crate::metrics::Protocol;
use crate::protocol::http::{ApiError, HttpState, body};
use crate::protocol::json::{BadRequest, Entries, check_response, ms, parse};
use crate::service::{Descriptor, Request, ReserveError, Reserved};
use floodgate_core::headers::HeaderMode;
use floodgate_core::reservation::{ReservationError, ReservationId, Settled};

/// A `/v1/reserve` body.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReserveBody {
    domain: String,
    descriptors: Vec<Entries>,
    /// The estimate: one for every descriptor (default 1), or one per
    /// descriptor (each dimension its own: input and output tokens,
    /// money).
    #[serde(default)]
    hits: Option<Amounts>,
}

/// A `/v1/reserve` body: `/v1/check`'s, with an estimate of 0 or more for
/// every descriptor, or one per descriptor.
pub fn parse_reserve_request(raw: &[u8]) -> Result<Request, BadRequest> {
    let b: ReserveBody = parse(raw)?;
    let n = b.descriptors.len();
    let hits = match b.hits {
        None => vec![1; n],
        Some(Amounts::One(h)) => vec![h; n],
        Some(Amounts::Each(v)) if v.len() == n => v,
        Some(Amounts::Each(v)) => {
            return Err(BadRequest {
                field: "hits".into(),
                message: format!("{} estimates for {n} descriptors: send one for all, or one per descriptor", v.len()),
            });
        }
    };
    if let Some(i) = hits.iter().position(|&h| h > floodgate_core::MAX_LIMIT) {
        return Err(BadRequest {
            field: "hits".into(),
            message: format!("{} is out of range: send 0 to {} (2^53 - 1)", hits[i], floodgate_core::MAX_LIMIT),
        });
    }
    Ok(Request {
        domain: b.domain,
        hits_addend: hits.first().copied().unwrap_or(1),
        descriptors: b
            .descriptors
            .into_iter()
            .zip(hits)
            .map(|(e, h)| Descriptor { entries: e.0, hits_addend: Some(h), refund: false, limit: None, lease: None })
            .collect(),
    })
}

/// The `/v1/reserve` answer: `/v1/check`'s, with the reservation.
pub fn reserve_response(r: &Reserved, mode: HeaderMode) -> Value {
    let mut v = check_response(&r.decided, mode);
    v["reservation"] = r.id.map(|id| id.to_string()).into();
    v["reservation_ttl_ms"] = r.ttl.map(ms).into();
    v
}

/// A `/v1/settle` or `/v1/cancel` body.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SettleBody {
    reservation: String,
    #[serde(default)]
    actual: Option<Amounts>,
}

/// One amount for every limit, or one per limit.
#[derive(Deserialize)]
#[serde(untagged)]
enum Amounts {
    One(u64),
    Each(Vec<u64>),
}

/// A settle's id and amounts (`cancel`: none may be given; the amount is 0).
pub fn parse_settle_request(raw: &[u8], cancel: bool) -> Result<(ReservationId, Vec<u64>), BadRequest> {
    let b: SettleBody = parse(raw)?;
    let id = b
        .reservation
        .parse::<ReservationId>()
        .map_err(|e| BadRequest { field: "reservation".into(), message: e.to_string() })?;
    let bad = |message: &str| Err(BadRequest { field: "actual".into(), message: message.into() });
    let actual = match (b.actual, cancel) {
        (None, true) => vec![0],
        (Some(_), true) => return bad("a cancel gives the whole estimate back: send no actual, or settle at it"),
        (None, false) => return bad("missing: send the amount used, a whole number, or one per limit in a list"),
        (Some(Amounts::One(n)), false) => vec![n],
        (Some(Amounts::Each(v)), false) => v,
    };
    if let Some(i) = actual.iter().position(|&n| n > floodgate_core::MAX_LIMIT) {
        return Err(BadRequest {
            field: if actual.len() == 1 { "actual".into() } else { format!("actual[{i}]") },
            message: format!("{} is out of range: at most {} (2^53 - 1)", actual[i], floodgate_core::MAX_LIMIT),
        });
    }
    Ok((id, actual))
}

/// A settle's answer.
pub fn settled_response(id: ReservationId, s: &Settled) -> Value {
    let limits: Vec<Value> = s
        .parts
        .iter()
        .map(|p| {
            let (late, returned) = (p.charged_late, p.returned);
            let mut v = json!({
                "key": &*p.key,
                "algorithm": p.limit.algorithm().kind().as_str(),
                "limit": p.limit.limit(),
                "window_ms": ms(p.limit.window()),
                "estimate": p.estimate,
                "actual": p.actual,
                "charged_late": late,
                "returned": returned,
                "expired": p.expired,
            });
            match &p.decision {
                Ok(d) => {
                    v["remaining"] = d.remaining.into();
                    v["reset_after_ms"] = ms(d.reset_after).into();
                }
                Err(e) => v["error"] = e.to_string().into(),
            }
            v
        })
        .collect();
    json!({ "reservation": id.to_string(), "again": s.again, "limits": limits })
}

impl From<ReserveError> for ApiError {
    fn from(e: ReserveError) -> Self {
        match e {
            ReserveError::Request(e) => e.into(),
            ReserveError::Reservation(e) => e.into(),
        }
    }
}

impl From<ReservationError> for ApiError {
    fn from(e: ReservationError) -> Self {
        let (status, field) = match &e {
            ReservationError::Unknown => (StatusCode::NOT_FOUND, "reservation"),
            ReservationError::Conflict { .. } => (StatusCode::CONFLICT, "actual"),
            ReservationError::Amounts { .. } => (StatusCode::BAD_REQUEST, "actual"),
            ReservationError::Unsupported(_) => (StatusCode::NOT_IMPLEMENTED, ""),
            ReservationError::Store(_) | ReservationError::Full { .. } => (StatusCode::SERVICE_UNAVAILABLE, ""),
        };
        ApiError::new(status, field, e)
    }
}

/// `POST /v1/reserve`: 200 with the decision (allowed or not) and the
/// reservation.
pub(crate) async fn reserve<S: Backend>(
    State(state): State<Arc<HttpState<S>>>,
    headers_in: HeaderMap,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let raw = body(&headers_in, raw)?;
    let req = parse_reserve_request(&raw).map_err(|e| {
        state.service.metrics().request(Protocol::Reserve, None, std::time::Duration::ZERO);
        ApiError::from(e)
    })?;
    let reserved = state.service.reserve(&req).await?;
    let resp = (StatusCode::OK, axum::Json(reserve_response(&reserved, state.headers))).into_response();
    Ok(crate::protocol::http::with_headers(resp, reserved.decided.answer.headers(state.headers)))
}

async fn settle_as<S: Backend>(
    state: &HttpState<S>,
    headers_in: &HeaderMap,
    raw: Result<Bytes, BytesRejection>,
    cancel: bool,
) -> Result<Response, ApiError> {
    let raw = body(headers_in, raw)?;
    let (id, actual) = parse_settle_request(&raw, cancel)?;
    let settled = state.service.settle(id, &actual).await?;
    Ok((StatusCode::OK, axum::Json(settled_response(id, &settled))).into_response())
}

/// `POST /v1/settle`.
pub(crate) async fn settle<S: Backend>(
    State(state): State<Arc<HttpState<S>>>,
    headers_in: HeaderMap,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    settle_as(&state, &headers_in, raw, false).await
}

/// `POST /v1/cancel`.
pub(crate) async fn cancel<S: Backend>(
    State(state): State<Arc<HttpState<S>>>,
    headers_in: HeaderMap,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    settle_as(&state, &headers_in, raw, true).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settle_bodies_name_what_is_wrong() {
        let id = "0123456789abcdef0123456789abcdef";
        let (got, actual) =
            parse_settle_request(format!(r#"{{"reservation":"{id}","actual":7}}"#).as_bytes(), false).unwrap();
        assert_eq!((got.to_string().as_str(), actual), (id, vec![7]));
        let (_, each) =
            parse_settle_request(format!(r#"{{"reservation":"{id}","actual":[1,2]}}"#).as_bytes(), false).unwrap();
        assert_eq!(each, vec![1, 2]);
        assert_eq!(parse_settle_request(format!(r#"{{"reservation":"{id}"}}"#).as_bytes(), true).unwrap().1, vec![0]);
        let err = |body: String, cancel: bool| parse_settle_request(body.as_bytes(), cancel).unwrap_err();
        assert_eq!(err(format!(r#"{{"reservation":"{id}"}}"#), false).field, "actual");
        assert_eq!(err(format!(r#"{{"reservation":"{id}","actual":3}}"#), true).field, "actual");
        assert_eq!(err(r#"{"reservation":"xyz","actual":3}"#.into(), false).field, "reservation");
        assert_eq!(err(format!(r#"{{"reservation":"{id}","actual":-3}}"#), false).field, "actual");
        assert_eq!(err(format!(r#"{{"reservation":"{id}","actual":[1,9007199254740992]}}"#), false).field, "actual[1]");
        assert!(err(format!(r#"{{"reservation":"{id}","actual":1,"x":1}}"#), false).message.contains("unknown field"));
        let refund = parse_reserve_request(br#"{"domain":"d","descriptors":[{"a":"1"}],"hits":-2}"#).unwrap_err();
        assert_eq!(refund.field, "hits");
        let each = parse_reserve_request(br#"{"domain":"d","descriptors":[{"a":"1"},{"b":"2"}],"hits":[5,7]}"#);
        let hits: Vec<Option<u64>> = each.unwrap().descriptors.iter().map(|d| d.hits_addend).collect();
        assert_eq!(hits, [Some(5), Some(7)]);
        let short = parse_reserve_request(br#"{"domain":"d","descriptors":[{"a":"1"},{"b":"2"}],"hits":[5]}"#);
        assert!(short.unwrap_err().message.contains("1 estimates for 2 descriptors"));
    }
}
