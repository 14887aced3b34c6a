//! Concurrency leases over gRPC: `floodgate.leases.v1.Leases`, beside RLS
//! and `floodgate.budget.v1.Budget` on the gRPC listener (hand-written
//! prost messages, as theirs are). The same operations as `/v1/check` with
//! a lease and `/v1/extend`:
//!
//! ```proto
//! package floodgate.leases.v1;
//! service Leases {
//!   rpc Acquire(AcquireRequest) returns (LeaseResponse);
//!   rpc Release(LeaseRequest) returns (LeaseResponse);
//!   rpc Extend(LeaseRequest) returns (LeaseResponse);
//! }
//! // Descriptor and LimitStatus: floodgate.budget.v1's.
//! message AcquireRequest { string domain = 1; repeated Descriptor descriptors = 2; uint64 hits = 3; }
//! // hits: every descriptor's without its own (0 counts as 1)
//! message LeaseRequest { string domain = 1; repeated Descriptor descriptors = 2; string lease = 3; }
//! message LeaseResponse { bool allowed = 1; string lease = 2; uint64 lease_ttl_ms = 3;
//!                         repeated LimitStatus descriptors = 4; uint64 retry_after_ms = 5; }
//! ```
//!
//! An allowed acquire whose descriptors meet a concurrency limit answers
//! its `lease` (16 hex digits) and how long it lasts; a rate beside it
//! takes its hits, all or nothing. A release frees that lease's slots (the
//! rates beside it only read); an extend pushes it back to a full
//! `lease_ttl`, denied once the lease is gone (acquire again). Errors:
//! `INVALID_ARGUMENT` naming the field (a bad request or lease id).

use std::sync::Arc;
use std::task::{Context, Poll};

use tonic::Status;
use tonic::codegen::{Body, BoxFuture, StdError};

use crate::Backend;
use crate::metrics::Protocol;
use crate::protocol::budget_grpc::{LimitStatus, MAX_MESSAGE, PbDescriptor, limit_statuses};
use crate::protocol::json::ms;
use crate::protocol::unary::unary;
use crate::service::{Decided, Descriptor, Request, Service, lease_text, parse_lease};

/// The service's full name.
pub const SERVICE: &str = "floodgate.leases.v1.Leases";

/// An acquire.
#[derive(Clone, PartialEq, prost::Message)]
pub struct AcquireRequest {
    /// The rules domain.
    #[prost(string, tag = "1")]
    pub domain: String,
    /// The descriptors.
    #[prost(message, repeated, tag = "2")]
    pub descriptors: Vec<PbDescriptor>,
    /// The hits (slots) of every descriptor without its own; 0 counts as 1.
    #[prost(uint64, tag = "3")]
    pub hits: u64,
}

/// A release or an extend of a lease.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaseRequest {
    /// The rules domain.
    #[prost(string, tag = "1")]
    pub domain: String,
    /// The descriptors the lease was acquired with.
    #[prost(message, repeated, tag = "2")]
    pub descriptors: Vec<PbDescriptor>,
    /// The lease (the 16 hex digits an acquire answered).
    #[prost(string, tag = "3")]
    pub lease: String,
}

/// What an acquire, a release or an extend answers.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaseResponse {
    /// Whether it was allowed (an extend: whether the lease was still held).
    #[prost(bool, tag = "1")]
    pub allowed: bool,
    /// The lease an allowed acquire holds (empty otherwise).
    #[prost(string, tag = "2")]
    pub lease: String,
    /// How long the lease lasts unless released or extended.
    #[prost(uint64, tag = "3")]
    pub lease_ttl_ms: u64,
    /// One per descriptor.
    #[prost(message, repeated, tag = "4")]
    pub descriptors: Vec<LimitStatus>,
    /// When a denied request may try again (0: no wait helps, or allowed).
    #[prost(uint64, tag = "5")]
    pub retry_after_ms: u64,
}

/// The gRPC service over a [`Service`].
pub struct LeasesServer<S> {
    service: Arc<Service<S>>,
}

impl<S> Clone for LeasesServer<S> {
    fn clone(&self) -> Self {
        Self { service: self.service.clone() }
    }
}

/// What the three operations do.
#[derive(Clone, Copy)]
enum Kind {
    Release,
    Extend,
}

impl<S: Backend> LeasesServer<S> {
    /// The service, ready to add to a tonic server.
    pub fn new(service: Arc<Service<S>>) -> Self {
        Self { service }
    }

    async fn acquire(&self, r: AcquireRequest) -> Result<LeaseResponse, Status> {
        let descriptors =
            r.descriptors.into_iter().map(|d| Descriptor { hits_addend: d.hits, ..descriptor(d) }).collect::<Vec<_>>();
        let mut hits = descriptors.iter().filter_map(|d| d.hits_addend).chain([r.hits]);
        if let Some(n) = hits.find(|&n| n > floodgate_core::MAX_LIMIT) {
            return Err(Status::invalid_argument(format!("hits: {n} is out of range: at most 2^53 - 1")));
        }
        let req = Request { domain: r.domain, descriptors, hits_addend: r.hits };
        let decided = self.service.decide(&req, Protocol::Grpc).await.map_err(invalid)?;
        Ok(response(&decided))
    }

    async fn lease(&self, r: LeaseRequest, kind: Kind) -> Result<LeaseResponse, Status> {
        let id = parse_lease(&r.lease).map_err(|e| Status::invalid_argument(format!("lease: {e}")))?;
        let descriptors = r
            .descriptors
            .into_iter()
            // A release gives back no hits: a descriptor that meets no
            // concurrency limit only reads (0 hits given back).
            .map(|d| Descriptor {
                lease: Some(id),
                refund: matches!(kind, Kind::Release),
                hits_addend: Some(u64::from(matches!(kind, Kind::Extend))),
                ..descriptor(d)
            })
            .collect();
        let req = Request { domain: r.domain, descriptors, hits_addend: 1 };
        let decided = match kind {
            Kind::Release => self.service.decide(&req, Protocol::Grpc).await,
            Kind::Extend => self.service.extend(&req, Protocol::Grpc).await,
        };
        Ok(response(&decided.map_err(invalid)?))
    }
}

/// A descriptor's entries.
fn descriptor(d: PbDescriptor) -> Descriptor {
    Descriptor { entries: d.entries.into_iter().map(|e| (e.key, e.value)).collect(), ..Descriptor::default() }
}

fn invalid(e: crate::service::RequestError) -> Status {
    Status::invalid_argument(e.to_string())
}

fn response(decided: &Decided) -> LeaseResponse {
    let a = &decided.answer;
    LeaseResponse {
        allowed: a.allowed,
        lease: decided.lease.as_ref().map(|l| lease_text(l.id)).unwrap_or_default(),
        lease_ttl_ms: decided.lease.as_ref().map(|l| ms(l.ttl)).unwrap_or(0),
        descriptors: limit_statuses(decided),
        retry_after_ms: a.retry_after.filter(|_| !a.allowed).map(ms).unwrap_or(0),
    }
}

impl<S: Backend, B> tonic::codegen::Service<http::Request<B>> for LeasesServer<S>
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
        let kind = match req.uri().path() {
            "/floodgate.leases.v1.Leases/Acquire" => {
                return Box::pin(async move {
                    let f = |s: LeasesServer<S>, r: AcquireRequest| async move { s.acquire(r).await };
                    Ok(unary(server, f, req, MAX_MESSAGE).await)
                });
            }
            "/floodgate.leases.v1.Leases/Release" => Kind::Release,
            "/floodgate.leases.v1.Leases/Extend" => Kind::Extend,
            _ => {
                return Box::pin(async move {
                    Ok(Status::unimplemented("floodgate.leases.v1.Leases has Acquire, Release and Extend").into_http())
                });
            }
        };
        Box::pin(async move {
            let f = move |s: LeasesServer<S>, r: LeaseRequest| async move { s.lease(r, kind).await };
            Ok(unary(server, f, req, MAX_MESSAGE).await)
        })
    }
}

impl<S> tonic::server::NamedService for LeasesServer<S> {
    const NAME: &'static str = SERVICE;
}
