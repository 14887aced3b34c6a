//! Envoy RLS v3: `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`,
//! a drop-in for envoyproxy/ratelimit, on the published Envoy protos
//! (`envoy-types`).

use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit as PbUnit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus, RateLimit};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use envoy_types::pb::google::protobuf::{Struct as PbStruct, Value as PbValue, value as pb_value};
use floodgate_core::Store;
use floodgate_core::rules::Unit;

use crate::metrics::Protocol;
use crate::protocol::unary::{BoxFuture, StdError, unary};
use crate::service::{Decided, Descriptor, LEASE_ENTRY, LimitOverride, Request, Service, lease_text};
use floodgate_core::headers::HeaderMode;

/// The RLS gRPC service over a [`Service`].
#[derive(Debug)]
pub struct Rls<S> {
    service: Arc<Service<S>>,
    headers: HeaderMode,
}

impl<S: Store + 'static> Rls<S> {
    /// The tonic service, ready to add to a server.
    pub fn server(service: Arc<Service<S>>, headers: HeaderMode) -> RlsServer<S> {
        RlsServer(Arc::new(Rls { service, headers }))
    }

    /// `ShouldRateLimit`.
    pub async fn should_rate_limit(&self, request: RateLimitRequest) -> Result<RateLimitResponse, tonic::Status> {
        let req = from_proto(request).map_err(tonic::Status::invalid_argument)?;
        match self.service.decide(&req, Protocol::Grpc).await {
            Ok(answer) => Ok(to_proto(&answer, self.headers)),
            Err(e) => Err(tonic::Status::invalid_argument(e.to_string())),
        }
    }
}

/// The RLS service as tonic serves it: `ShouldRateLimit`, served with
/// buffers that fit its messages ([`crate::protocol::unary`]), in place of
/// `envoy-types`' generated server (same path, same messages).
#[derive(Debug)]
pub struct RlsServer<S>(Arc<Rls<S>>);

impl<S> Clone for RlsServer<S> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

/// RLS requests may carry many descriptors: tonic's default bound, 4 MiB.
const MAX_MESSAGE: usize = 4 * 1024 * 1024;

const SHOULD_RATE_LIMIT: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

impl<S: Store + 'static, B> tonic::codegen::Service<http::Request<B>> for RlsServer<S>
where
    B: http_body::Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let rls = Arc::clone(&self.0);
        if req.uri().path() != SHOULD_RATE_LIMIT {
            return Box::pin(async move {
                Ok(tonic::Status::unimplemented("envoy.service.ratelimit.v3.RateLimitService has ShouldRateLimit")
                    .into_http())
            });
        }
        Box::pin(async move {
            let f = |rls: Arc<Rls<S>>, r: RateLimitRequest| async move { rls.should_rate_limit(r).await };
            Ok(unary(rls, f, req, MAX_MESSAGE).await)
        })
    }
}

impl<S> tonic::server::NamedService for RlsServer<S> {
    const NAME: &'static str = "envoy.service.ratelimit.v3.RateLimitService";
}

/// Translate an RLS request (moving its strings, not copying them). A
/// descriptor's [`LEASE_ENTRY`] is taken out (the lease a stream-end
/// release names); the error names a malformed one.
pub fn from_proto(r: RateLimitRequest) -> Result<Request, String> {
    Ok(Request {
        domain: r.domain,
        hits_addend: u64::from(r.hits_addend),
        descriptors: r
            .descriptors
            .into_iter()
            .enumerate()
            .map(|(i, d)| descriptor_from_proto(d).map_err(|e| format!("descriptors[{i}].{LEASE_ENTRY}: {e}")))
            .collect::<Result<_, _>>()?,
    })
}

fn descriptor_from_proto(d: RateLimitDescriptor) -> Result<Descriptor, String> {
    let limit = d
        .limit
        .and_then(|l| Some(LimitOverride { requests_per_unit: l.requests_per_unit, unit: unit_from_proto(l.unit)? }));
    Descriptor::rls(
        d.entries.into_iter().map(|e| (e.key, e.value)).collect(),
        d.hits_addend.map(|h| h.value),
        d.is_negative_hits,
        limit,
    )
}

/// The floodgate unit of a proto unit (`None` for UNKNOWN or out of range).
pub fn unit_from_proto(u: i32) -> Option<Unit> {
    Some(match PbUnit::try_from(u).ok()? {
        PbUnit::Unknown => return None,
        PbUnit::Second => Unit::Second,
        PbUnit::Minute => Unit::Minute,
        PbUnit::Hour => Unit::Hour,
        PbUnit::Day => Unit::Day,
        PbUnit::Week => Unit::Week,
        PbUnit::Month => Unit::Month,
        PbUnit::Year => Unit::Year,
    })
}

/// The proto unit of a floodgate unit (`UNKNOWN` when the window is not one).
pub fn unit_to_proto(u: Option<Unit>) -> PbUnit {
    match u {
        None => PbUnit::Unknown,
        Some(Unit::Second) => PbUnit::Second,
        Some(Unit::Minute) => PbUnit::Minute,
        Some(Unit::Hour) => PbUnit::Hour,
        Some(Unit::Day) => PbUnit::Day,
        Some(Unit::Week) => PbUnit::Week,
        Some(Unit::Month) => PbUnit::Month,
        Some(Unit::Year) => PbUnit::Year,
    }
}

/// Translate an answer to an RLS response. Limits above `u32::MAX`
/// saturate; a window that is not one of envoy's units is reported as
/// `UNKNOWN` with the rule's name (or the window) as the limit's name.
pub fn to_proto(a: &Decided, mode: HeaderMode) -> RateLimitResponse {
    let sat = |v: u64| u32::try_from(v).unwrap_or(u32::MAX);
    let statuses = a
        .statuses
        .iter()
        .map(|s| {
            let code = if s.over_limit { Code::OverLimit } else { Code::Ok };
            let mut status = DescriptorStatus { code: code as i32, ..Default::default() };
            if let (Some(info), Some(d)) = (&s.limit, &s.decision) {
                let name = match (&info.name, info.unit) {
                    (Some(n), _) => n.to_string(),
                    (None, Some(_)) => String::new(),
                    (None, None) => duration_text(info.window),
                };
                status.current_limit = Some(RateLimit {
                    name,
                    requests_per_unit: sat(info.requests_per_unit),
                    unit: unit_to_proto(info.unit) as i32,
                });
                status.limit_remaining = sat(d.remaining);
                status.duration_until_reset = Some(pb_duration(d.reset_after));
            }
            status
        })
        .collect();
    let code = if a.answer.allowed { Code::Ok } else { Code::OverLimit };
    RateLimitResponse {
        overall_code: code as i32,
        statuses,
        response_headers_to_add: a
            .answer
            .headers(mode)
            .into_iter()
            .map(|(k, v)| HeaderValue { key: k.to_owned(), value: v, raw_value: Vec::new() })
            .collect(),
        // The lease a concurrency limit took, for Envoy to send back at the
        // stream's end (a `metadata` action under the filter's namespace,
        // `envoy.filters.http.ratelimit`); none on a denial.
        dynamic_metadata: a.lease.map(|l| {
            let value = |v: String| PbValue { kind: Some(pb_value::Kind::StringValue(v)) };
            PbStruct { fields: [(LEASE_ENTRY.to_owned(), value(lease_text(l.id)))].into_iter().collect() }
        }),
        ..Default::default()
    }
}

/// A protobuf Duration, exact to the microsecond.
fn pb_duration(d: std::time::Duration) -> PbDuration {
    PbDuration {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
    }
}

/// A duration as protobuf JSON writes it: seconds with 0, 3, 6 or 9
/// fractional digits and an `s` (`"1s"`, `"1.500s"`, `"0.000001s"`).
pub fn duration_text(d: std::time::Duration) -> String {
    let (s, n) = (d.as_secs(), d.subsec_nanos());
    if n == 0 {
        format!("{s}s")
    } else if n % 1_000_000 == 0 {
        format!("{s}.{:03}s", n / 1_000_000)
    } else if n % 1_000 == 0 {
        format!("{s}.{:06}s", n / 1_000)
    } else {
        format!("{s}.{n:09}s")
    }
}
