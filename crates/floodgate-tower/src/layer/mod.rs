//! The `tower` layer: decide each request, then forward it (with the
//! rate-limit headers), hold it for a shaping delay first, or answer `429 Too
//! Many Requests` itself.
//!
//! A file each, as tower-http's `limit/` has them: the layer and its
//! settings here, the service ([`RateLimit`], `service.rs`), its response
//! future (`future.rs`: deciding, holding, calling), its body (`body.rs`),
//! and the responses it writes itself (`response.rs`).

use std::marker::PhantomData;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use floodgate_core::headers::HeaderMode;
use http::{Request, Response};
use tower_layer::Layer;

use crate::client_ip::TrustedProxies;
use crate::decide::Decide;
use crate::descriptors::RequestFacts;

mod body;
mod future;
mod meter;
mod response;
mod service;

pub use body::RateLimitBody;
pub use future::ResponseFuture;
pub use meter::{
    MAX_READ, Meter, MeterFuture, MeterLayer, MeterPart, Metered, MeteredBody, RequestBody, Reserved, estimate,
};
pub use response::{AnswerHeaders, grpc_rejection, grpc_response, insert_answer_headers, local_response, rejection};
pub use service::RateLimit;
use service::peer_addr;

/// The peer address of a connection, for servers that record it in the
/// request extensions under this type (the reverse proxy does). A plain
/// `SocketAddr` extension, (with the `axum` feature) axum's
/// `ConnectInfo<SocketAddr>` and (with the `tonic` feature) tonic's
/// `TcpConnectInfo` are read too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerAddr(pub SocketAddr);

/// Applies rate limits to an inner HTTP service; see [`RateLimit`].
///
/// ```
/// use floodgate_core::{Algorithm, Limit, MemoryStore};
/// use floodgate_tower::{Key, KeyedLimit, RateLimitLayer};
/// use std::time::Duration;
/// let limit = Limit::new(Algorithm::FixedWindow, 100, Duration::from_secs(60)).unwrap();
/// let layer = RateLimitLayer::new(KeyedLimit::new(limit, Key::ClientIp, MemoryStore::new()));
/// // axum: Router::new().route(...).layer(layer.inner_body())
/// ```
///
/// `M` is how responses carry their bodies: [`Wrapped`] (the default, any
/// inner body type) or, after [`RateLimitLayer::inner_body`], the inner
/// service's own body type ([`InnerBody`]).
pub struct RateLimitLayer<D, M = Wrapped> {
    shared: Arc<Shared<D>>,
    mode: PhantomData<fn() -> M>,
}

impl<D, M> Clone for RateLimitLayer<D, M> {
    fn clone(&self) -> Self {
        Self { shared: Arc::clone(&self.shared), mode: PhantomData }
    }
}

impl<D, M> std::fmt::Debug for RateLimitLayer<D, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("trusted", &self.shared.trusted)
            .field("headers", &self.shared.headers)
            .finish_non_exhaustive()
    }
}

struct Shared<D> {
    decider: D,
    trusted: TrustedProxies,
    headers: HeaderMode,
    holds: Holds,
}

/// The bound on requests held for shaping at once, and the count (shared by
/// every clone of the service).
#[derive(Debug, Clone)]
struct Holds {
    max: usize,
    held: Arc<AtomicUsize>,
}

/// Default bound on requests held for shaping delays at once, per layer.
pub const DEFAULT_MAX_HELD: usize = 10_000;

impl<D> Shared<D> {
    /// What the decider knows of `req`: its client IP (the peer address, or
    /// a trusted forwarding hop), request line and headers. (Inlined: built
    /// in place, where the decider reads it.)
    #[inline(always)]
    fn facts<'r, B>(&self, req: &'r Request<B>) -> RequestFacts<'r> {
        let client_ip = peer_addr(req.extensions()).map(|p| self.trusted.client_ip(p.ip(), req.headers()));
        RequestFacts { method: req.method(), uri: req.uri(), headers: req.headers(), client_ip, body: None }
    }
}

impl<D: Decide> RateLimitLayer<D> {
    /// A layer asking `decider`, trusting no proxy (the peer address is the
    /// client) and sending both header families; bodies [`Wrapped`].
    pub fn new(decider: D) -> Self {
        Self {
            shared: Arc::new(Shared {
                decider,
                trusted: TrustedProxies::default(),
                headers: HeaderMode::Both,
                holds: Holds { max: DEFAULT_MAX_HELD, held: Arc::new(AtomicUsize::new(0)) },
            }),
            mode: PhantomData,
        }
    }

    /// Answer with the inner service's own response body type instead of
    /// wrapping every body in [`RateLimitBody`]: for inner services whose
    /// body type can be made from [`Bytes`] (`B: From<Bytes>`: axum's
    /// `Body`, `http_body_util::Full<Bytes>`, `String`...), the layer's own
    /// answers (a `429`'s text) are made as that type, and a forwarded
    /// response passes through untouched.
    ///
    /// Use it with axum: axum boxes every response body that is not its own
    /// `Body` (an allocation per response), and a forwarded response is not
    /// moved into a wrapper (BENCHMARKS.md: a fifth of the layer's cost on
    /// an allowed request). Bodies that cannot be made from bytes (hyper's
    /// `Incoming`, `BoxBody`) need the default.
    pub fn inner_body(self) -> RateLimitLayer<D, InnerBody> {
        RateLimitLayer { shared: self.shared, mode: PhantomData }
    }
}

impl<D: Decide, M> RateLimitLayer<D, M> {
    fn with(self, f: impl FnOnce(&mut Shared<D>)) -> Self {
        let mut shared = Arc::try_unwrap(self.shared).unwrap_or_else(|_| panic!("configure a layer before cloning it"));
        f(&mut shared);
        Self { shared: Arc::new(shared), mode: PhantomData }
    }

    /// Believe the forwarding header of these proxies (see
    /// [`TrustedProxies::client_ip`]).
    #[must_use]
    pub fn trusted_proxies(self, trusted: TrustedProxies) -> Self {
        self.with(|s| s.trusted = trusted)
    }

    /// Which rate-limit headers to send (`Retry-After` is always sent on a
    /// denial that a wait can help).
    #[must_use]
    pub fn headers(self, mode: HeaderMode) -> Self {
        self.with(|s| s.headers = mode)
    }

    /// Hold at most `max` requests for shaping delays at once (default
    /// [`DEFAULT_MAX_HELD`]). Each shaping limit's `burst` bounds how many
    /// wait per key; this bounds them all together, so many keys cannot
    /// pile up held requests (and their sockets and buffers) without limit.
    /// A request that would wait while `max` already do is answered `503
    /// Service Unavailable` with `Retry-After` (its delay); the limit has
    /// counted it, as a shaper counts a request it then drops.
    #[must_use]
    pub fn max_held(self, max: usize) -> Self {
        self.with(|s| s.holds.max = max)
    }

    /// Requests held for shaping delays right now.
    pub fn held(&self) -> usize {
        self.shared.holds.held.load(Ordering::Relaxed)
    }

    /// The decider.
    pub fn decider(&self) -> &D {
        &self.shared.decider
    }
}

impl<S, D, M> Layer<S> for RateLimitLayer<D, M> {
    type Service = RateLimit<S, D, M>;

    fn layer(&self, inner: S) -> RateLimit<S, D, M> {
        RateLimit { inner, shared: Arc::clone(&self.shared), mode: PhantomData }
    }
}

/// How the layer's responses carry their bodies: [`Wrapped`] or
/// [`InnerBody`].
pub trait BodyMode<B>: 'static {
    /// The layer's response body type.
    type Body;
    /// The inner service's response, as the layer's.
    fn forwarded(resp: Response<B>) -> Response<Self::Body>;
    /// A body made by the layer (`None`: empty).
    fn local(data: Option<Bytes>) -> Self::Body;
}

/// Every response body wrapped in [`RateLimitBody`] (the default): works
/// with any inner body type.
#[derive(Debug, Clone, Copy, Default)]
pub struct Wrapped;

/// The inner service's own body type (`B: From<Bytes>`), see
/// [`RateLimitLayer::inner_body`].
#[derive(Debug, Clone, Copy, Default)]
pub struct InnerBody;

impl<B> BodyMode<B> for Wrapped {
    type Body = RateLimitBody<B>;

    #[inline]
    fn forwarded(resp: Response<B>) -> Response<RateLimitBody<B>> {
        resp.map(|body| RateLimitBody::Inner { body })
    }

    fn local(data: Option<Bytes>) -> RateLimitBody<B> {
        RateLimitBody::Local { data }
    }
}

impl<B: From<Bytes>> BodyMode<B> for InnerBody {
    type Body = B;

    #[inline]
    fn forwarded(resp: Response<B>) -> Response<B> {
        resp
    }

    fn local(data: Option<Bytes>) -> B {
        B::from(data.unwrap_or_default())
    }
}

/// A response made by the layer, before its body takes the layer's body
/// type.
type Local = Response<Option<Bytes>>;

#[cfg(test)]
mod tests {
    use std::task::{Context, Poll};
    use std::time::Duration;

    use http::StatusCode;
    use http::header::{CONTENT_TYPE, RETRY_AFTER};
    use http_body::Body;

    use super::response::{GRPC_INTERNAL, is_grpc};
    use super::service::{Next, next};
    use super::*;
    use crate::decide::Answer;

    #[test]
    fn the_response_future_is_little_more_than_the_inner_future() {
        // Every caller moves the future at least once; the layer's own rare
        // states are boxed so that an allowed request moves little more
        // than the inner service's future (BENCHMARKS.md, "Tower layer vs tower_governor").
        #[derive(Clone)]
        struct Inner;
        impl tower_service::Service<Request<()>> for Inner {
            type Response = Response<String>;
            type Error = std::convert::Infallible;
            type Future = std::future::Ready<Result<Response<String>, Self::Error>>;
            fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
                Poll::Ready(Ok(()))
            }
            fn call(&mut self, _: Request<()>) -> Self::Future {
                std::future::ready(Ok(Response::new(String::new())))
            }
        }
        type Fut<M> = ResponseFuture<Inner, (), String, M>;
        let inner = std::mem::size_of::<<Inner as tower_service::Service<Request<()>>>::Future>();
        // (Today exactly one word more: the state's tag and the boxed
        // headers.)
        assert!(std::mem::size_of::<Fut<InnerBody>>() <= inner + 16);
        assert!(std::mem::size_of::<Fut<Wrapped>>() <= inner + 16);
    }

    #[test]
    fn grpc_messages_are_percent_encoded() {
        let resp: Response<RateLimitBody<http_body_util::Empty<Bytes>>> =
            grpc_response(GRPC_INTERNAL, "100% caf\u{e9}\n");
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(resp.headers()["grpc-status"], "13");
        assert_eq!(resp.headers()["grpc-message"], "100%25 caf%C3%A9%0A");
        assert!(resp.body().is_end_stream(), "trailers-only");
    }

    #[test]
    fn only_grpc_content_types_are_grpc() {
        let req = |ct: &str| Request::builder().header(CONTENT_TYPE, ct).body(()).unwrap();
        assert!(is_grpc(req("application/grpc").headers()));
        assert!(is_grpc(req("application/grpc+proto").headers()));
        assert!(!is_grpc(req("application/json").headers()));
        assert!(!is_grpc(Request::new(()).headers()));
    }

    #[test]
    fn a_denial_has_its_body_and_every_header_value_from_one_buffer() {
        use floodgate_core::Decision;
        let decision = Decision {
            allowed: false,
            limit: 10,
            remaining: 0,
            reset_after: Duration::from_millis(59_500),
            retry_after: Some(Duration::from_millis(2_100)),
            delay: Duration::ZERO,
        };
        let answer = Answer {
            allowed: false,
            retry_after: decision.retry_after,
            delay: Duration::ZERO,
            headline: Some(crate::decide::Headline {
                name: Some("per \"ip\"".into()),
                requests_per_unit: 10,
                window: Duration::from_secs(60),
                decision,
            }),
        };
        for mode in [HeaderMode::None, HeaderMode::XRateLimit, HeaderMode::Ietf, HeaderMode::Both] {
            let mut slot = None;
            let Next::Answered(resp) = next(&Ok(answer.clone()), &http::HeaderMap::new(), &mut slot, mode) else {
                panic!("a denial is answered here")
            };
            assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
            let h = resp.headers();
            assert_eq!(h[CONTENT_TYPE], "text/plain; charset=utf-8");
            assert_eq!(h[RETRY_AFTER], "3", "{mode:?}");
            let want_x = matches!(mode, HeaderMode::XRateLimit | HeaderMode::Both);
            let want_ietf = matches!(mode, HeaderMode::Ietf | HeaderMode::Both);
            assert_eq!(h.get("x-ratelimit-limit").map(|v| v.to_str().unwrap()), want_x.then_some("10"));
            assert_eq!(h.get("x-ratelimit-remaining").map(|v| v.to_str().unwrap()), want_x.then_some("0"));
            assert_eq!(h.get("x-ratelimit-reset").map(|v| v.to_str().unwrap()), want_x.then_some("60"));
            assert_eq!(
                h.get("ratelimit-policy").map(|v| v.to_str().unwrap()),
                want_ietf.then_some(r#""per \"ip\"";q=10;w=60"#)
            );
            assert_eq!(
                h.get("ratelimit").map(|v| v.to_str().unwrap()),
                want_ietf.then_some(r#""per \"ip\"";r=0;t=60"#)
            );
            assert_eq!(h.len(), 2 + 3 * usize::from(want_x) + 2 * usize::from(want_ietf));
            let Some(body) = resp.body() else { panic!("a local body") };
            assert_eq!(&body[..], b"429 Too Many Requests: rate limit exceeded, retry after 3 s\n");
        }
        let too_big = Answer { retry_after: None, headline: None, ..answer };
        let Next::Answered(resp) = next(&Ok(too_big), &http::HeaderMap::new(), &mut None, HeaderMode::Both) else {
            panic!("a denial is answered here")
        };
        assert!(resp.headers().get(RETRY_AFTER).is_none(), "no wait helps");
        let Some(body) = resp.body() else { panic!("a local body") };
        assert_eq!(&body[..], b"429 Too Many Requests: rate limit exceeded (the request is larger than the limit)\n");
    }
}
