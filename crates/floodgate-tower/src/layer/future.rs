//! The response future: a decision that could not answer at once, a
//! request held for its shaping delay, the inner service's call, or an
//! answer made here.

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use floodgate_core::headers::{HeaderMode, Value};
use http::header::{HeaderValue, RETRY_AFTER};
use http::{Request, Response, StatusCode};
use tower_service::Service;

use super::response::{AnswerHeaders, local_text};
use super::service::{Next, next};
use super::{BodyMode, Holds, Local, Wrapped};
use crate::decide::{Answer, DecideError};

/// The asynchronous decision of a request: the request comes back with it.
pub(super) type Deciding<ReqB> =
    Pin<Box<dyn Future<Output = (Request<ReqB>, Result<Answer, DecideError>)> + Send + 'static>>;

pin_project_lite::pin_project! {
    /// The response future of [`RateLimit`].
    pub struct ResponseFuture<S, ReqB, ResB, M = Wrapped>
    where
        S: Service<Request<ReqB>>,
    {
        #[pin]
        pub(super) state: State<S, S::Future, ReqB>,
        // The rate-limit headers of a forwarded request, for the inner
        // response (boxed, as the rare states are: the future stays the
        // inner future's size and a word, and moves cheaply).
        pub(super) headers: Option<Box<AnswerHeaders>>,
        pub(super) body: PhantomData<fn() -> (ResB, M)>,
    }
}

pin_project_lite::pin_project! {
    #[project = StateProj]
    pub(super) enum State<S, F, ReqB> {
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
pub(super) struct Held<S, ReqB> {
    sleep: Pin<Box<tokio::time::Sleep>>,
    inner: S,
    req: Request<ReqB>,
    _slot: HeldSlot,
}

/// One of the layer's places for a held request, given back on drop (the
/// request forwarded, or its client gone).
pub(super) struct HeldSlot(Arc<AtomicUsize>);

impl HeldSlot {
    /// A place, if fewer than the layer's maximum are taken.
    pub(super) fn take(holds: &Holds) -> Option<Self> {
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
pub(super) fn too_many_held(delay: Duration, max: usize, headers: Option<Box<AnswerHeaders>>) -> Local {
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
    pub(super) fn holding(delay: Duration, slot: HeldSlot, inner: S, req: Request<ReqB>) -> Self {
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

pub(super) const POLLED_AFTER_DONE: &str = "RateLimit's ResponseFuture polled after it completed";

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
