//! The `tower` layer: decide each request, then forward it (with the
//! rate-limit headers), hold it for a shaping delay first, or answer `429 Too
//! Many Requests` itself.
//!
//! (About 900 lines, a tenth of them tests: the layer, its service, its
//! response future, its body and the rejections it writes. Still to be
//! split a file each, as tower-http's `limit/` is: issue 44, item 5.)

use std::future::Future;
use std::marker::PhantomData;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use floodgate_core::headers::{Field, HeaderMode, Value, write_rate_limit_headers};
use http::header::{CONTENT_TYPE, HeaderName, HeaderValue, RETRY_AFTER};
use http::{Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use tower_layer::Layer;
use tower_service::Service;

use crate::client_ip::TrustedProxies;
use crate::decide::{Answer, Decide, DecideError};
use crate::descriptors::RequestFacts;

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
        RequestFacts { method: req.method(), uri: req.uri(), headers: req.headers(), client_ip }
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
pub struct RateLimit<S, D, M = Wrapped> {
    inner: S,
    shared: Arc<Shared<D>>,
    mode: PhantomData<fn() -> M>,
}

impl<S: Clone, D, M> Clone for RateLimit<S, D, M> {
    fn clone(&self) -> Self {
        Self { inner: self.inner.clone(), shared: Arc::clone(&self.shared), mode: PhantomData }
    }
}

impl<S: std::fmt::Debug, D, M> std::fmt::Debug for RateLimit<S, D, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimit").field("inner", &self.inner).finish_non_exhaustive()
    }
}

impl<S, D, M, ReqB, ResB> Service<Request<ReqB>> for RateLimit<S, D, M>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send,
    D: Decide,
    M: BodyMode<ResB>,
    ReqB: Send + 'static,
{
    type Response = Response<M::Body>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqB, ResB, M>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        let mode = self.shared.headers;
        // A decider that can answer at once (an in-memory store) does, here:
        // no allocation, and the ready inner service is called in place.
        // (Matched by reference: moving the answer out would copy it.)
        let decided = self.shared.decider.decide_now(&self.shared.facts(&req));
        let Some(result) = &decided else {
            let shared = Arc::clone(&self.shared);
            let decision = Box::pin(async move {
                let result = shared.decider.decide(&shared.facts(&req)).await;
                (req, result)
            });
            let state =
                State::Deciding { decision, inner: Some(self.take_ready()), holds: self.shared.holds.clone(), mode };
            return ResponseFuture { state, headers: None, body: PhantomData };
        };
        // The common case, without a call: allowed now, no headers to add.
        if let Ok(a) = result
            && a.allowed
            && a.delay.is_zero()
            && mode == HeaderMode::None
        {
            return ResponseFuture {
                state: State::Calling { fut: self.inner.call(req) },
                headers: None,
                body: PhantomData,
            };
        }
        let mut headers = None;
        // Each arm builds the future in place: the inner future is not moved.
        match next(result, req.headers(), &mut headers, mode) {
            Next::Forward => {
                ResponseFuture { state: State::Calling { fut: self.inner.call(req) }, headers, body: PhantomData }
            }
            Next::Answered(resp) => {
                ResponseFuture { state: State::Answered { resp: Some(Box::new(resp)) }, headers, body: PhantomData }
            }
            Next::Hold(delay) => {
                let state = match HeldSlot::take(&self.shared.holds) {
                    Some(slot) => State::holding(delay, slot, self.take_ready(), req),
                    None => State::Answered {
                        resp: Some(Box::new(too_many_held(delay, self.shared.holds.max, headers.take()))),
                    },
                };
                ResponseFuture { state, headers, body: PhantomData }
            }
        }
    }
}

impl<S: Clone, D, M> RateLimit<S, D, M> {
    /// The inner service polled ready, for a call made later; a clone (not
    /// ready yet) stays for the next request.
    fn take_ready(&mut self) -> S {
        let clone = self.inner.clone();
        std::mem::replace(&mut self.inner, clone)
    }
}

/// What a decided request comes to.
enum Next {
    /// A response made here: a `429` (with its headers) or a decider error.
    Answered(Local),
    /// Hold the request this long, then forward it.
    Hold(Duration),
    /// Forward it now.
    Forward,
}

/// Where a decision sends its request (with `request_headers`: a gRPC call
/// is answered in gRPC's terms); the headers of a forwarded request go to
/// `slot` (when there are any), for the inner response.
fn next(
    result: &Result<Answer, DecideError>,
    request_headers: &http::HeaderMap,
    slot: &mut Option<Box<AnswerHeaders>>,
    mode: HeaderMode,
) -> Next {
    // Only a request answered here needs to know (not the common one).
    let grpc = || is_grpc(request_headers);
    let answer = match result {
        Ok(a) => a,
        Err(e) if grpc() => {
            let code = if e.status.is_client_error() { GRPC_INVALID_ARGUMENT } else { GRPC_INTERNAL };
            return Next::Answered(grpc_local(code, &e.message));
        }
        Err(e) => return Next::Answered(local_text(e.status, format!("{e}\n").into(), 0)),
    };
    if !answer.allowed {
        if grpc() {
            let mut resp = grpc_rejection_local(answer);
            AnswerHeaders::of(answer, mode).insert_into(resp.headers_mut());
            return Next::Answered(resp);
        }
        // The body is written after the header values: one buffer for all.
        let (headers, body) = AnswerHeaders::with_text(answer, mode, |out| write_denial(answer, REJECTED, b"\n", out));
        let mut resp = local_text(StatusCode::TOO_MANY_REQUESTS, body, headers.fields().len());
        headers.insert_into(resp.headers_mut());
        return Next::Answered(resp);
    }
    let delay = answer.delay;
    if mode != HeaderMode::None {
        *slot = Some(Box::new(AnswerHeaders::of(answer, mode)));
    }
    if delay.is_zero() { Next::Forward } else { Next::Hold(delay) }
}

/// The asynchronous decision of a request: the request comes back with it.
type Deciding<ReqB> = Pin<Box<dyn Future<Output = (Request<ReqB>, Result<Answer, DecideError>)> + Send + 'static>>;

pin_project_lite::pin_project! {
    /// The response future of [`RateLimit`].
    pub struct ResponseFuture<S, ReqB, ResB, M = Wrapped>
    where
        S: Service<Request<ReqB>>,
    {
        #[pin]
        state: State<S, S::Future, ReqB>,
        // The rate-limit headers of a forwarded request, for the inner
        // response (boxed, as the rare states are: the future stays the
        // inner future's size and a word, and moves cheaply).
        headers: Option<Box<AnswerHeaders>>,
        body: PhantomData<fn() -> (ResB, M)>,
    }
}

pin_project_lite::pin_project! {
    #[project = StateProj]
    enum State<S, F, ReqB> {
        // Waiting for a decider that could not answer at once.
        Deciding { decision: Deciding<ReqB>, inner: Option<S>, holds: Holds, mode: HeaderMode },
        // Holding an allowed request for its shaping delay (boxed: rare, and
        // it would make every response future larger).
        Holding { held: Option<Box<Held<S, ReqB>>> },
        // Waiting for the inner service.
        Calling { #[pin] fut: F },
        // Answered here (boxed: a response is larger than most inner
        // futures).
        Answered { resp: Option<Box<Local>> },
    }
}

/// A request held for its shaping delay, and the service it goes to.
struct Held<S, ReqB> {
    sleep: Pin<Box<tokio::time::Sleep>>,
    inner: S,
    req: Request<ReqB>,
    _slot: HeldSlot,
}

/// One of the layer's places for a held request, given back on drop (the
/// request forwarded, or its client gone).
struct HeldSlot(Arc<AtomicUsize>);

impl HeldSlot {
    /// A place, if fewer than the layer's maximum are taken.
    fn take(holds: &Holds) -> Option<Self> {
        let taken = holds.held.fetch_add(1, Ordering::AcqRel);
        let slot = HeldSlot(Arc::clone(&holds.held));
        // Over the bound: dropping the slot gives the place back.
        (taken < holds.max).then_some(slot)
    }
}

impl Drop for HeldSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The answer to a request that would be held while the layer already holds
/// its maximum: `503` (the server is out of room, the client within its
/// limit), `Retry-After` its delay, and its rate-limit headers.
fn too_many_held(delay: Duration, max: usize, headers: Option<Box<AnswerHeaders>>) -> Local {
    let secs = floodgate_core::headers::ceil_secs(delay).max(1);
    let mut text = Vec::with_capacity(96);
    text.extend_from_slice(b"503 Service Unavailable: ");
    Value::Number(u64::try_from(max).unwrap_or(u64::MAX)).write_to(&mut text);
    text.extend_from_slice(b" requests are already held for shaping, retry after ");
    Value::Number(secs).write_to(&mut text);
    text.extend_from_slice(b" s\n");
    let more = headers.as_ref().map_or(0, |h| h.fields().len());
    let mut resp = local_text(StatusCode::SERVICE_UNAVAILABLE, Bytes::from(text), 1 + more);
    resp.headers_mut().insert(RETRY_AFTER, HeaderValue::from(secs));
    if let Some(h) = headers {
        h.insert_into(resp.headers_mut());
    }
    resp
}

impl<S, F, ReqB> State<S, F, ReqB> {
    fn holding(delay: Duration, slot: HeldSlot, inner: S, req: Request<ReqB>) -> Self {
        let sleep = Box::pin(tokio::time::sleep(delay));
        State::Holding { held: Some(Box::new(Held { sleep, inner, req, _slot: slot })) }
    }
}

impl<S, ReqB, ResB, M> std::fmt::Debug for ResponseFuture<S, ReqB, ResB, M>
where
    S: Service<Request<ReqB>>,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").field("headers", &self.headers).finish_non_exhaustive()
    }
}

const POLLED_AFTER_DONE: &str = "RateLimit's ResponseFuture polled after it completed";

impl<S, ReqB, ResB, M> Future for ResponseFuture<S, ReqB, ResB, M>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    M: BodyMode<ResB>,
{
    type Output = Result<Response<M::Body>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            let state = match this.state.as_mut().project() {
                StateProj::Deciding { decision, inner, holds, mode } => {
                    let (req, result) = std::task::ready!(decision.as_mut().poll(cx));
                    let mut inner = inner.take().expect(POLLED_AFTER_DONE);
                    match next(&result, req.headers(), this.headers, *mode) {
                        Next::Answered(resp) => State::Answered { resp: Some(Box::new(resp)) },
                        Next::Hold(delay) => match HeldSlot::take(holds) {
                            Some(slot) => State::holding(delay, slot, inner, req),
                            None => State::Answered {
                                resp: Some(Box::new(too_many_held(delay, holds.max, this.headers.take()))),
                            },
                        },
                        Next::Forward => State::Calling { fut: inner.call(req) },
                    }
                }
                StateProj::Holding { held } => {
                    let h = held.as_mut().expect(POLLED_AFTER_DONE);
                    std::task::ready!(h.sleep.as_mut().poll(cx));
                    let Held { mut inner, req, .. } = *held.take().expect(POLLED_AFTER_DONE);
                    State::Calling { fut: inner.call(req) }
                }
                StateProj::Calling { fut } => {
                    if this.headers.is_none() {
                        // Nothing to add: the inner future's answer is ours,
                        // written where our caller wants it (not copied out
                        // of a temporary).
                        return fut.poll(cx).map_ok(M::forwarded);
                    }
                    let mut resp = M::forwarded(std::task::ready!(fut.poll(cx))?);
                    if let Some(headers) = this.headers.take() {
                        headers.insert_into(resp.headers_mut());
                    }
                    return Poll::Ready(Ok(resp));
                }
                StateProj::Answered { resp } => {
                    return Poll::Ready(Ok(resp.take().expect(POLLED_AFTER_DONE).map(M::local)));
                }
            };
            this.state.set(state);
        }
    }
}

/// The request's peer address, from the extensions a server put there.
/// (Inlined: an address returned through memory is reloaded wide and
/// stalls.)
#[inline(always)]
fn peer_addr(ext: &http::Extensions) -> Option<SocketAddr> {
    #[cfg(feature = "axum")]
    if let Some(p) = ext.get::<axum::extract::ConnectInfo<SocketAddr>>() {
        return Some(p.0);
    }
    #[cfg(feature = "tonic")]
    if let Some(p) = ext.get::<tonic::transport::server::TcpConnectInfo>().and_then(|c| c.remote_addr()) {
        return Some(p);
    }
    if let Some(p) = ext.get::<PeerAddr>() {
        return Some(p.0);
    }
    ext.get::<SocketAddr>().copied()
}

/// Add the rate-limit headers of `answer` in `mode` to `headers`.
pub fn insert_answer_headers(headers: &mut http::HeaderMap, answer: &Answer, mode: HeaderMode) {
    AnswerHeaders::of(answer, mode).insert_into(headers);
}

/// The rate-limit header values of one answer, written once into one buffer
/// (one allocation for all of them) and kept small: a forwarded request's
/// response future carries them to the inner response.
#[derive(Debug, Clone)]
pub struct AnswerHeaders {
    values: Bytes,
    // Each field and where its value ends in `values` (it starts where the
    // previous one ends).
    fields: [(Field, u16); 6],
    len: u8,
}

impl AnswerHeaders {
    /// The headers of `answer` in `mode` (`Retry-After` on a denial that a
    /// wait helps, whatever the mode).
    pub fn of(answer: &Answer, mode: HeaderMode) -> Self {
        Self::with_text(answer, mode, |_| {}).0
    }

    /// The same, and `text` written after the values into the same buffer
    /// (one allocation for a denial's headers and body).
    fn with_text(answer: &Answer, mode: HeaderMode, text: impl FnOnce(&mut Vec<u8>)) -> (Self, Bytes) {
        let headline = answer.headline.as_ref();
        let mut buf = Vec::new();
        let mut fields = [(Field::RetryAfter, 0u16); 6];
        let mut len = 0;
        write_rate_limit_headers(answer.allowed, answer.retry_after, headline, mode, |field, value| {
            if buf.capacity() == 0 {
                buf.reserve(128);
            }
            value.write_to(&mut buf);
            // A value past 64 KiB (a rule name that long) is left out: no
            // server would take it.
            if let (Ok(end), Some(slot)) = (u16::try_from(buf.len()), fields.get_mut(usize::from(len))) {
                *slot = (field, end);
                len += 1;
            }
        });
        let start = buf.len();
        text(&mut buf);
        let values = Bytes::from(buf);
        let tail = values.slice(start..);
        (AnswerHeaders { values, fields, len }, tail)
    }

    fn fields(&self) -> &[(Field, u16)] {
        &self.fields[..usize::from(self.len)]
    }

    /// Insert them into `headers`, replacing any of the same name.
    pub fn insert_into(&self, headers: &mut http::HeaderMap) {
        let fields = self.fields();
        headers.reserve(fields.len());
        let mut start = 0;
        for &(field, end) in fields {
            let end = usize::from(end);
            if let Ok(v) = HeaderValue::from_maybe_shared(self.values.slice(start..end)) {
                headers.insert(header_name(field), v);
            }
            start = end;
        }
    }
}

/// The field's header name, made once.
fn header_name(field: Field) -> HeaderName {
    const X_LIMIT: HeaderName = HeaderName::from_static(Field::XRateLimitLimit.name());
    const X_REMAINING: HeaderName = HeaderName::from_static(Field::XRateLimitRemaining.name());
    const X_RESET: HeaderName = HeaderName::from_static(Field::XRateLimitReset.name());
    const POLICY: HeaderName = HeaderName::from_static(Field::RateLimitPolicy.name());
    const RATELIMIT: HeaderName = HeaderName::from_static(Field::RateLimit.name());
    match field {
        Field::RetryAfter => RETRY_AFTER,
        Field::XRateLimitLimit => X_LIMIT,
        Field::XRateLimitRemaining => X_REMAINING,
        Field::XRateLimitReset => X_RESET,
        Field::RateLimitPolicy => POLICY,
        Field::RateLimit => RATELIMIT,
    }
}

/// The start of a `429`'s body.
const REJECTED: &[u8] = b"429 Too Many Requests: ";

/// The `429` answer to a denied request (headers added by the caller).
pub fn rejection<B>(answer: &Answer) -> Response<RateLimitBody<B>> {
    let mut text = Vec::with_capacity(80);
    write_denial(answer, REJECTED, b"\n", &mut text);
    local_response(StatusCode::TOO_MANY_REQUESTS, text)
}

/// A response made here, with its body wrapped.
fn wrapped<B>(resp: Local) -> Response<RateLimitBody<B>> {
    resp.map(|data| RateLimitBody::Local { data })
}

/// Why a request was denied, and when to come back, between `before` and
/// `after`, appended to `out` (without `core::fmt`: a denial is as common as
/// an attack makes it).
fn write_denial(answer: &Answer, before: &[u8], after: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(before);
    match answer.retry_after {
        Some(wait) => {
            out.extend_from_slice(b"rate limit exceeded, retry after ");
            Value::Number(floodgate_core::headers::ceil_secs(wait).max(1)).write_to(out);
            out.extend_from_slice(b" s");
        }
        None => out.extend_from_slice(b"rate limit exceeded (the request is larger than the limit)"),
    }
    out.extend_from_slice(after);
}

/// gRPC status codes the layer answers with.
const GRPC_INVALID_ARGUMENT: u8 = 3;
const GRPC_RESOURCE_EXHAUSTED: u8 = 8;
const GRPC_INTERNAL: u8 = 13;

/// Whether a request with these headers is a gRPC call (`content-type:
/// application/grpc...`).
fn is_grpc(headers: &http::HeaderMap) -> bool {
    headers.get(CONTENT_TYPE).is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

/// The answer to a denied gRPC call: `RESOURCE_EXHAUSTED`, as gRPC clients
/// expect (an HTTP `429` would reach them as `UNAVAILABLE`, which many retry
/// at once). The rate-limit headers and `retry-after` go with it, as
/// metadata.
pub fn grpc_rejection<B>(answer: &Answer) -> Response<RateLimitBody<B>> {
    wrapped(grpc_rejection_local(answer))
}

fn grpc_rejection_local(answer: &Answer) -> Local {
    let mut text = Vec::with_capacity(64);
    write_denial(answer, b"", b"", &mut text);
    grpc_local(GRPC_RESOURCE_EXHAUSTED, &String::from_utf8_lossy(&text))
}

/// A trailers-only gRPC response (HTTP 200, no body) with `code` and
/// `message` (percent-encoded as gRPC requires).
pub fn grpc_response<B>(code: u8, message: &str) -> Response<RateLimitBody<B>> {
    wrapped(grpc_local(code, message))
}

fn grpc_local(code: u8, message: &str) -> Local {
    let mut resp = Response::new(None);
    let headers = resp.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    headers.insert("grpc-status", HeaderValue::from(u16::from(code)));
    let mut encoded = String::with_capacity(message.len());
    for b in message.bytes() {
        if (b' '..=b'~').contains(&b) && b != b'%' {
            encoded.push(char::from(b));
        } else {
            encoded.push_str(&format!("%{b:02X}"));
        }
    }
    if let Ok(v) = HeaderValue::from_str(&encoded) {
        headers.insert("grpc-message", v);
    }
    resp
}

/// A plain-text response made here.
pub fn local_response<B>(status: StatusCode, text: impl Into<Bytes>) -> Response<RateLimitBody<B>> {
    wrapped(local_text(status, text.into(), 0))
}

/// The same, with room for `more` headers beside its content type.
fn local_text(status: StatusCode, text: Bytes, more: usize) -> Local {
    let mut resp = Response::new(Some(text));
    *resp.status_mut() = status;
    let headers = resp.headers_mut();
    headers.reserve(1 + more);
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_response_future_is_little_more_than_the_inner_future() {
        // Every caller moves the future at least once; the layer's own rare
        // states are boxed so that an allowed request moves little more
        // than the inner service's future (BENCHMARKS.md, tower layer).
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
