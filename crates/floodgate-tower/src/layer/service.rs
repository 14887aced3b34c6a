//! The rate-limiting service: each request decided, then answered here,
//! held, or forwarded.

use std::marker::PhantomData;
use std::net::SocketAddr;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use floodgate_core::headers::HeaderMode;
use floodgate_core::store::ready_at_once;
use http::{Request, Response, StatusCode};
use tower_service::Service;

use super::future::{HeldSlot, State, too_many_held};
use super::response::{
    AnswerHeaders, GRPC_INTERNAL, GRPC_INVALID_ARGUMENT, REJECTED, grpc_local, grpc_rejection_local, is_grpc,
    local_text, write_denial,
};
use super::{BodyMode, Local, PeerAddr, ResponseFuture, Shared, Wrapped};
use crate::decide::{Answer, Decide, DecideError};

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
    pub(super) inner: S,
    pub(super) shared: Arc<Shared<D>>,
    pub(super) mode: PhantomData<fn() -> M>,
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
        // A decider that answers at once (an in-memory store) is polled
        // once, here: no allocation, and the ready inner service is called
        // in place. (Matched by reference: moving the answer out would copy
        // it.)
        let decided = match self.shared.decider.answers_at_once() {
            true => ready_at_once(self.shared.decider.decide(&self.shared.facts(&req))),
            false => Poll::Pending,
        };
        let Poll::Ready(result) = &decided else {
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
    pub(super) fn take_ready(&mut self) -> S {
        let clone = self.inner.clone();
        std::mem::replace(&mut self.inner, clone)
    }
}

/// What a decided request comes to.
pub(super) enum Next {
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
pub(super) fn next(
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

/// The request's peer address, from the extensions a server put there.
/// (Inlined: an address returned through memory is reloaded wide and
/// stalls.)
#[inline(always)]
pub(super) fn peer_addr(ext: &http::Extensions) -> Option<SocketAddr> {
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
