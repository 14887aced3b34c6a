//! The `tower` layer: decide each request, then forward it (with the
//! rate-limit headers), hold it for a shaping delay first, or answer `429 Too
//! Many Requests` itself.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use floodgate_core::headers::{HeaderMode, Headline, write_rate_limit_headers};
use http::header::{CONTENT_TYPE, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use tower_layer::Layer;
use tower_service::Service;

use crate::client_ip::TrustedProxies;
use crate::decide::{Answer, Decide};
use crate::descriptors::RequestFacts;

/// The peer address of a connection, for servers that record it in the
/// request extensions under this type (the reverse proxy does). A plain
/// `SocketAddr` extension and (with the `axum` feature) axum's
/// `ConnectInfo<SocketAddr>` are read too.
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
/// // axum: Router::new().route(...).layer(layer)
/// ```
pub struct RateLimitLayer<D> {
    shared: Arc<Shared<D>>,
}

impl<D> Clone for RateLimitLayer<D> {
    fn clone(&self) -> Self {
        Self { shared: Arc::clone(&self.shared) }
    }
}

impl<D> std::fmt::Debug for RateLimitLayer<D> {
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
}

impl<D: Decide> RateLimitLayer<D> {
    /// A layer asking `decider`, trusting no proxy (the peer address is the
    /// client) and sending both header families.
    pub fn new(decider: D) -> Self {
        Self { shared: Arc::new(Shared { decider, trusted: TrustedProxies::default(), headers: HeaderMode::Both }) }
    }

    fn with(self, f: impl FnOnce(&mut Shared<D>)) -> Self {
        let mut shared = Arc::try_unwrap(self.shared).unwrap_or_else(|_| panic!("configure a layer before cloning it"));
        f(&mut shared);
        Self { shared: Arc::new(shared) }
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

    /// The decider.
    pub fn decider(&self) -> &D {
        &self.shared.decider
    }
}

impl<S, D> Layer<S> for RateLimitLayer<D> {
    type Service = RateLimit<S, D>;

    fn layer(&self, inner: S) -> RateLimit<S, D> {
        RateLimit { inner, shared: Arc::clone(&self.shared) }
    }
}

/// The rate-limiting service. For each request:
///
/// 1. the client IP (peer address, or trusted forwarding hop) and the
///    request line and headers go to the decider;
/// 2. denied: `429 Too Many Requests`, `Retry-After` (when a wait helps),
///    the rate-limit headers and a one-line text body; the inner service is
///    not called;
/// 3. allowed with a shaping delay (`leaky_bucket`, `mode: shape`): the
///    request is held for it (the limit's `burst` bounds how many wait per
///    key), then forwarded;
/// 4. forwarded: the inner response gets the rate-limit headers.
///
/// A decider error (a misconfigured server: no peer address for a
/// `remote_address` descriptor) is answered with its status and message.
/// Store failures never are: each rule's failure policy decides.
pub struct RateLimit<S, D> {
    inner: S,
    shared: Arc<Shared<D>>,
}

impl<S: Clone, D> Clone for RateLimit<S, D> {
    fn clone(&self) -> Self {
        Self { inner: self.inner.clone(), shared: Arc::clone(&self.shared) }
    }
}

impl<S: std::fmt::Debug, D> std::fmt::Debug for RateLimit<S, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimit").field("inner", &self.inner).finish_non_exhaustive()
    }
}

impl<S, D, ReqB, ResB> Service<Request<ReqB>> for RateLimit<S, D>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send,
    D: Decide,
    ReqB: Send + 'static,
{
    type Response = Response<RateLimitBody<ResB>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        // The clone is not ready; the one polled ready goes with this request.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let shared = Arc::clone(&self.shared);
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            let client_ip = peer_addr(&parts.extensions).map(|p| shared.trusted.client_ip(p.ip(), &parts.headers));
            let facts = RequestFacts { method: &parts.method, uri: &parts.uri, headers: &parts.headers, client_ip };
            let answer = match shared.decider.decide(&facts).await {
                Ok(a) => a,
                Err(e) => return Ok(local_response(e.status, format!("{e}\n"))),
            };
            if !answer.allowed {
                let mut resp = rejection(&answer);
                insert_answer_headers(resp.headers_mut(), &answer, shared.headers);
                return Ok(resp);
            }
            if !answer.delay.is_zero() {
                tokio::time::sleep(answer.delay).await;
            }
            let resp = inner.call(Request::from_parts(parts, body)).await?;
            let mut resp = resp.map(|body| RateLimitBody::Inner { body });
            insert_answer_headers(resp.headers_mut(), &answer, shared.headers);
            Ok(resp)
        })
    }
}

/// The request's peer address, from the extensions a server put there.
fn peer_addr(ext: &http::Extensions) -> Option<SocketAddr> {
    #[cfg(feature = "axum")]
    if let Some(p) = ext.get::<axum::extract::ConnectInfo<SocketAddr>>() {
        return Some(p.0);
    }
    if let Some(p) = ext.get::<PeerAddr>() {
        return Some(p.0);
    }
    ext.get::<SocketAddr>().copied()
}

/// Add the rate-limit headers of `answer` in `mode` to `headers`. Every
/// value is written into one buffer: one allocation for all of them.
pub fn insert_answer_headers(headers: &mut http::HeaderMap, answer: &Answer, mode: HeaderMode) {
    let headline = answer.headline.as_ref().map(|h| Headline {
        name: h.name.as_deref(),
        requests_per_unit: h.requests_per_unit,
        window: h.window,
        decision: &h.decision,
    });
    let mut buf = bytes::BytesMut::new();
    let mut spans: [(&'static str, usize, usize); 6] = [("", 0, 0); 6];
    let mut n = 0;
    write_rate_limit_headers(answer.allowed, answer.retry_after, headline, mode, |name, value| {
        let start = buf.len();
        let _ = std::fmt::Write::write_fmt(&mut buf, value);
        if n < spans.len() {
            spans[n] = (name, start, buf.len());
            n += 1;
        }
    });
    let all = buf.freeze();
    for &(name, start, end) in &spans[..n] {
        if let Ok(v) = HeaderValue::from_maybe_shared(all.slice(start..end)) {
            headers.insert(name, v);
        }
    }
}

/// The `429` answer to a denied request (headers added by the caller).
pub fn rejection<B>(answer: &Answer) -> Response<RateLimitBody<B>> {
    let body = match answer.retry_after {
        Some(wait) => {
            let secs = floodgate_core::headers::ceil_secs(wait).max(1);
            format!("429 Too Many Requests: rate limit exceeded, retry after {secs} s\n")
        }
        None => "429 Too Many Requests: rate limit exceeded (the request is larger than the limit)\n".to_owned(),
    };
    local_response(StatusCode::TOO_MANY_REQUESTS, body)
}

/// A plain-text response made here.
pub fn local_response<B>(status: StatusCode, text: String) -> Response<RateLimitBody<B>> {
    let mut resp = Response::new(RateLimitBody::Local { data: Some(Bytes::from(text)) });
    *resp.status_mut() = status;
    resp.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    resp
}

pub use body::RateLimitBody;

// pin-project-lite takes no doc comments on pinned fields.
#[allow(missing_docs)]
mod body {
    use bytes::Bytes;

    pin_project_lite::pin_project! {
        /// The response body: the inner service's, or the one of a response
        /// made here (a `429`, or a decider error).
        #[project = BodyProj]
        pub enum RateLimitBody<B> {
            /// The inner service's body, passed through frame by frame.
            Inner { #[pin] body: B },
            /// A body made here.
            Local { data: Option<Bytes> },
        }
    }
}
use body::BodyProj;

impl<B> std::fmt::Debug for RateLimitBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RateLimitBody::Inner { .. } => f.write_str("RateLimitBody::Inner"),
            RateLimitBody::Local { data } => f.debug_struct("RateLimitBody::Local").field("data", data).finish(),
        }
    }
}

impl<B: Body<Data = Bytes>> Body for RateLimitBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project() {
            BodyProj::Inner { body } => body.poll_frame(cx),
            BodyProj::Local { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            RateLimitBody::Inner { body } => body.is_end_stream(),
            RateLimitBody::Local { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            RateLimitBody::Inner { body } => body.size_hint(),
            RateLimitBody::Local { data } => SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64)),
        }
    }
}
