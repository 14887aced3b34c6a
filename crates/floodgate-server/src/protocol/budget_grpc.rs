//! Reservations over gRPC: `floodgate.budget.v1.Budget`, beside RLS on the
//! gRPC listener. The messages are written by hand (prost derives; no
//! protoc, no build script), as `floodgate.sync.v1`'s are:
//!
//! ```proto
//! package floodgate.budget.v1;
//! service Budget {
//!   rpc Reserve(ReserveRequest) returns (ReserveResponse);
//!   rpc Settle(SettleRequest) returns (SettleResponse);
//!   rpc Cancel(CancelRequest) returns (SettleResponse);
//! }
//! message Entry { string key = 1; string value = 2; }
//! message Descriptor { repeated Entry entries = 1; optional uint64 hits = 2; }
//! message ReserveRequest { string domain = 1; repeated Descriptor descriptors = 2; uint64 hits = 3; }
//! // hits: the estimate of every descriptor without its own
//! message LimitStatus { bool allowed = 1; string name = 2; uint64 limit = 3; uint64 window_ms = 4;
//!                       uint64 remaining = 5; uint64 reset_after_ms = 6; bool limited = 7; }
//! message ReserveResponse { bool allowed = 1; string reservation = 2; uint64 reservation_ttl_ms = 3;
//!                           repeated LimitStatus descriptors = 4; uint64 retry_after_ms = 5; }
//! message SettleRequest { string reservation = 1; repeated uint64 actual = 2; }
//! message CancelRequest { string reservation = 1; }
//! message SettledLimit { string key = 1; string algorithm = 2; uint64 limit = 3; uint64 window_ms = 4;
//!                        uint64 estimate = 5; uint64 actual = 6; uint64 charged_late = 7; uint64 returned = 8;
//!                        bool expired = 9; uint64 remaining = 10; uint64 reset_after_ms = 11; string error = 12; }
//! message SettleResponse { string reservation = 1; bool again = 2; repeated SettledLimit limits = 3; }
//! ```
//!
//! `reservation` is empty when nothing was kept (denied, or no limit
//! took). Errors: `INVALID_ARGUMENT` (a bad request, id or amounts),
//! `NOT_FOUND` (unknown reservation), `FAILED_PRECONDITION` (settled
//! before with other amounts), `UNIMPLEMENTED` (the store keeps no
//! reservations), `UNAVAILABLE` (the store failed), `RESOURCE_EXHAUSTED`
//! (the memory store holds its most reservations).

use std::sync::Arc;
use std::task::{Context, Poll};

use tonic::Status;
use tonic::codegen::{Body, BoxFuture, StdError};

use crate::Backend;
use crate::protocol::json::ms;
use crate::protocol::unary::unary;
use crate::service::{Descriptor, Request, ReserveError, Service};
use floodgate_core::reservation::{ReservationError, ReservationId, Settled};

/// The service's full name.
pub const SERVICE: &str = "floodgate.budget.v1.Budget";

/// One descriptor entry.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Entry {
    /// The key.
    #[prost(string, tag = "1")]
    pub key: String,
    /// The value.
    #[prost(string, tag = "2")]
    pub value: String,
}

/// One descriptor.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PbDescriptor {
    /// Its entries, in order.
    #[prost(message, repeated, tag = "1")]
    pub entries: Vec<Entry>,
    /// Its estimate (else the request's `hits`).
    #[prost(uint64, optional, tag = "2")]
    pub hits: Option<u64>,
}

/// A reserve.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ReserveRequest {
    /// The rules domain.
    #[prost(string, tag = "1")]
    pub domain: String,
    /// The descriptors.
    #[prost(message, repeated, tag = "2")]
    pub descriptors: Vec<PbDescriptor>,
    /// The estimate of every descriptor without its own (0: a gate whose
    /// settle charges the actual amount).
    #[prost(uint64, tag = "3")]
    pub hits: u64,
}

/// One descriptor's status in a reserve's answer.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LimitStatus {
    /// Whether this descriptor allowed.
    #[prost(bool, tag = "1")]
    pub allowed: bool,
    /// The reported limit's rule name.
    #[prost(string, tag = "2")]
    pub name: String,
    /// Its limit.
    #[prost(uint64, tag = "3")]
    pub limit: u64,
    /// Its window.
    #[prost(uint64, tag = "4")]
    pub window_ms: u64,
    /// What remains.
    #[prost(uint64, tag = "5")]
    pub remaining: u64,
    /// When it resets.
    #[prost(uint64, tag = "6")]
    pub reset_after_ms: u64,
    /// Whether a limit applied.
    #[prost(bool, tag = "7")]
    pub limited: bool,
}

/// A reserve's answer.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ReserveResponse {
    /// Whether the estimate fit.
    #[prost(bool, tag = "1")]
    pub allowed: bool,
    /// The reservation id (empty when nothing was kept).
    #[prost(string, tag = "2")]
    pub reservation: String,
    /// How long it may give back what it does not use.
    #[prost(uint64, tag = "3")]
    pub reservation_ttl_ms: u64,
    /// One per request descriptor.
    #[prost(message, repeated, tag = "4")]
    pub descriptors: Vec<LimitStatus>,
    /// For a denial: when the same estimate could fit (0: none helps).
    #[prost(uint64, tag = "5")]
    pub retry_after_ms: u64,
}

/// A settle.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SettleRequest {
    /// The id a reserve answered.
    #[prost(string, tag = "1")]
    pub reservation: String,
    /// One amount for every limit, or one per limit.
    #[prost(uint64, repeated, tag = "2")]
    pub actual: Vec<u64>,
}

/// A cancel (a settle at 0).
#[derive(Clone, PartialEq, prost::Message)]
pub struct CancelRequest {
    /// The id a reserve answered.
    #[prost(string, tag = "1")]
    pub reservation: String,
}

/// One limit of a settle's answer.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SettledLimit {
    /// The counter key.
    #[prost(string, tag = "1")]
    pub key: String,
    /// The algorithm.
    #[prost(string, tag = "2")]
    pub algorithm: String,
    /// The limit.
    #[prost(uint64, tag = "3")]
    pub limit: u64,
    /// Its window.
    #[prost(uint64, tag = "4")]
    pub window_ms: u64,
    /// The hits reserved.
    #[prost(uint64, tag = "5")]
    pub estimate: u64,
    /// The hits settled.
    #[prost(uint64, tag = "6")]
    pub actual: u64,
    /// Charged after the work.
    #[prost(uint64, tag = "7")]
    pub charged_late: u64,
    /// Given back as never taken.
    #[prost(uint64, tag = "8")]
    pub returned: u64,
    /// Whether the part had expired unsettled.
    #[prost(bool, tag = "9")]
    pub expired: bool,
    /// What remains after the settle.
    #[prost(uint64, tag = "10")]
    pub remaining: u64,
    /// When the limit resets.
    #[prost(uint64, tag = "11")]
    pub reset_after_ms: u64,
    /// Why the store could not adjust it (empty: it did).
    #[prost(string, tag = "12")]
    pub error: String,
}

/// A settle's answer.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SettleResponse {
    /// The reservation.
    #[prost(string, tag = "1")]
    pub reservation: String,
    /// This settle repeated an earlier one.
    #[prost(bool, tag = "2")]
    pub again: bool,
    /// One per limit, in the reserve's order.
    #[prost(message, repeated, tag = "3")]
    pub limits: Vec<SettledLimit>,
}

/// The gRPC service over a [`Service`].
pub struct BudgetServer<S> {
    service: Arc<Service<S>>,
}

impl<S> Clone for BudgetServer<S> {
    fn clone(&self) -> Self {
        Self { service: self.service.clone() }
    }
}

impl<S: Backend> BudgetServer<S> {
    /// The service, ready to add to a tonic server.
    pub fn new(service: Arc<Service<S>>) -> Self {
        Self { service }
    }

    async fn reserve(&self, r: ReserveRequest) -> Result<ReserveResponse, Status> {
        let req = Request {
            domain: r.domain,
            hits_addend: r.hits,
            descriptors: r
                .descriptors
                .into_iter()
                .map(|d| Descriptor {
                    entries: d.entries.into_iter().map(|e| (e.key, e.value)).collect(),
                    hits_addend: Some(d.hits.unwrap_or(r.hits)),
                    ..Descriptor::default()
                })
                .collect(),
        };
        if let Some(d) = req.descriptors.iter().find(|d| d.hits_addend.unwrap_or(0) > floodgate_core::MAX_LIMIT) {
            return Err(Status::invalid_argument(format!(
                "hits: {} is out of range: at most {} (2^53 - 1)",
                d.hits_addend.unwrap_or(0),
                floodgate_core::MAX_LIMIT
            )));
        }
        let reserved = self.service.reserve(&req).await.map_err(|e| match e {
            ReserveError::Request(e) => Status::invalid_argument(e.to_string()),
            ReserveError::Reservation(e) => status(&e),
        })?;
        let a = &reserved.decided.answer;
        Ok(ReserveResponse {
            allowed: a.allowed,
            reservation: reserved.id.map(|id| id.to_string()).unwrap_or_default(),
            reservation_ttl_ms: reserved.ttl.map(ms).unwrap_or(0),
            retry_after_ms: a.retry_after.filter(|_| !a.allowed).map(ms).unwrap_or(0),
            descriptors: limit_statuses(&reserved.decided),
        })
    }

    async fn settle(&self, reservation: &str, actual: &[u64]) -> Result<SettleResponse, Status> {
        let id =
            reservation.parse::<ReservationId>().map_err(|e| Status::invalid_argument(format!("reservation: {e}")))?;
        if let Some(n) = actual.iter().find(|&&n| n > floodgate_core::MAX_LIMIT) {
            return Err(Status::invalid_argument(format!("actual: {n} is out of range: at most 2^53 - 1")));
        }
        if actual.is_empty() {
            return Err(Status::invalid_argument(
                "actual: missing: send the amount used, or one per limit in the reserve's order",
            ));
        }
        let settled = self.service.settle(id, actual).await.map_err(|e| status(&e))?;
        Ok(settle_response(id, &settled))
    }
}

/// Each descriptor's status in a decided request.
pub(crate) fn limit_statuses(decided: &crate::service::Decided) -> Vec<LimitStatus> {
    decided
        .statuses
        .iter()
        .map(|s| match (&s.limit, &s.decision) {
            (Some(info), Some(d)) => LimitStatus {
                allowed: !s.over_limit,
                name: info.name.as_deref().unwrap_or("").to_owned(),
                limit: info.requests_per_unit,
                window_ms: ms(info.window),
                remaining: d.remaining,
                reset_after_ms: ms(d.reset_after),
                limited: true,
            },
            _ => LimitStatus { allowed: true, ..LimitStatus::default() },
        })
        .collect()
}

fn status(e: &ReservationError) -> Status {
    let m = e.to_string();
    match e {
        ReservationError::Unknown => Status::not_found(format!("reservation: {m}")),
        ReservationError::Conflict { .. } => Status::failed_precondition(format!("actual: {m}")),
        ReservationError::Amounts { .. } => Status::invalid_argument(format!("actual: {m}")),
        ReservationError::Unsupported(_) => Status::unimplemented(m),
        ReservationError::Store(_) => Status::unavailable(m),
        ReservationError::Full { .. } => Status::resource_exhausted(m),
    }
}

fn settle_response(id: ReservationId, s: &Settled) -> SettleResponse {
    SettleResponse {
        reservation: id.to_string(),
        again: s.again,
        limits: s
            .parts
            .iter()
            .map(|p| {
                let (charged_late, returned) = (p.charged_late, p.returned);
                let (remaining, reset_after_ms, error) = match &p.decision {
                    Ok(d) => (d.remaining, ms(d.reset_after), String::new()),
                    Err(e) => (0, 0, e.to_string()),
                };
                SettledLimit {
                    key: p.key.to_string(),
                    algorithm: p.limit.algorithm().kind().as_str().to_owned(),
                    limit: p.limit.limit(),
                    window_ms: ms(p.limit.window()),
                    estimate: p.estimate,
                    actual: p.actual,
                    charged_late,
                    returned,
                    expired: p.expired,
                    remaining,
                    reset_after_ms,
                    error,
                }
            })
            .collect(),
    }
}

/// Requests are small: 64 KiB, as the HTTP API's body limit.
pub(crate) const MAX_MESSAGE: usize = 64 * 1024;

impl<S: Backend, B> tonic::codegen::Service<http::Request<B>> for BudgetServer<S>
where
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let server = self.clone();
        match req.uri().path() {
            "/floodgate.budget.v1.Budget/Reserve" => Box::pin(async move {
                Ok(unary(
                    server,
                    |s: BudgetServer<S>, r: ReserveRequest| async move { s.reserve(r).await },
                    req,
                    MAX_MESSAGE,
                )
                .await)
            }),
            "/floodgate.budget.v1.Budget/Settle" => Box::pin(async move {
                let f = |s: BudgetServer<S>, r: SettleRequest| async move { s.settle(&r.reservation, &r.actual).await };
                Ok(unary(server, f, req, MAX_MESSAGE).await)
            }),
            "/floodgate.budget.v1.Budget/Cancel" => Box::pin(async move {
                let f = |s: BudgetServer<S>, r: CancelRequest| async move { s.settle(&r.reservation, &[0]).await };
                Ok(unary(server, f, req, MAX_MESSAGE).await)
            }),
            _ => Box::pin(async move {
                Ok(Status::unimplemented("floodgate.budget.v1.Budget has Reserve, Settle and Cancel").into_http())
            }),
        }
    }
}

impl<S> tonic::server::NamedService for BudgetServer<S> {
    const NAME: &'static str = SERVICE;
}
