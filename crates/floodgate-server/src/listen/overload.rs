//! Load shedding for gRPC: a bounded number of requests in flight per
//! runtime, counted from the moment a request's stream arrives (hyper calls
//! the service in the connection's task, before the request waits for a
//! thread) until its answer is sent. One more is answered at once with
//! `RESOURCE_EXHAUSTED` ("overloaded: …"), so an overloaded server keeps
//! answering what it accepts within a bounded time instead of queueing
//! without bound; Envoy's rate-limit filter then applies its own failure
//! mode (`failure_mode_deny`) to the shed request.
//!
//! Each per-thread gRPC runtime has its own counter and its share of
//! `--max-in-flight`, so counting costs one uncontended atomic add and
//! subtract per request.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::task::{Context, Poll};

use tower_layer::Layer;
use tower_service::Service;

use crate::metrics::Metrics;

/// Requests in flight on a gRPC listener at most, by default (shared out
/// among its runtimes): with decisions taking ~10 µs of CPU each, a full
/// queue waits ~10 ms at most, half Envoy's default 20 ms RLS timeout.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 1_024;

/// Shed gRPC requests beyond `max` in flight (one runtime's share).
#[derive(Debug, Clone)]
pub struct ShedLayer {
    in_flight: Arc<AtomicUsize>,
    max: usize,
    metrics: Arc<Metrics>,
}

impl ShedLayer {
    /// At most `max` requests in flight (at least 1) through the services
    /// this layer makes, together.
    pub fn new(max: usize, metrics: Arc<Metrics>) -> Self {
        Self { in_flight: Arc::new(AtomicUsize::new(0)), max: max.max(1), metrics }
    }
}

impl<S> Layer<S> for ShedLayer {
    type Service = Shed<S>;

    fn layer(&self, inner: S) -> Shed<S> {
        Shed { inner, layer: self.clone() }
    }
}

/// The service [`ShedLayer`] makes.
#[derive(Debug, Clone)]
pub struct Shed<S> {
    inner: S,
    layer: ShedLayer,
}

/// A request's place among those in flight, given back when it is
/// answered (or dropped).
#[derive(Debug)]
struct InFlight(Arc<AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

impl<S, B, RB> Service<http::Request<B>> for Shed<S>
where
    S: Service<http::Request<B>, Response = http::Response<RB>>,
    RB: Default,
{
    type Response = http::Response<RB>;
    type Error = S::Error;
    type Future = ShedFuture<S::Future, RB>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let l = &self.layer;
        if l.in_flight.fetch_add(1, Relaxed) >= l.max {
            l.in_flight.fetch_sub(1, Relaxed);
            l.metrics.shed();
            let status = tonic::Status::resource_exhausted(format!(
                "overloaded: {} requests in flight on this thread (--max-in-flight); retry with backoff",
                l.max
            ));
            return ShedFuture { state: State::Shed { resp: Some(status.into_http()) } };
        }
        let in_flight = InFlight(l.in_flight.clone());
        ShedFuture { state: State::Inner { fut: self.inner.call(req), in_flight } }
    }
}

pin_project_lite::pin_project! {
    /// The answer of [`Shed`]: the inner service's, or a shed one at once.
    pub struct ShedFuture<F, RB> {
        #[pin]
        state: State<F, RB>,
    }
}

pin_project_lite::pin_project! {
    #[project = StateProj]
    enum State<F, RB> {
        // Accepted: the inner service answers; its place is given back when
        // this is dropped.
        Inner { #[pin] fut: F, in_flight: InFlight },
        // Shed: the RESOURCE_EXHAUSTED answer, until taken.
        Shed { resp: Option<http::Response<RB>> },
    }
}

impl<F, RB> std::fmt::Debug for ShedFuture<F, RB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShedFuture").finish_non_exhaustive()
    }
}

impl<F, RB, E> Future for ShedFuture<F, RB>
where
    F: Future<Output = Result<http::Response<RB>, E>>,
    RB: Default,
{
    type Output = Result<http::Response<RB>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Inner { fut, .. } => fut.poll(cx),
            StateProj::Shed { resp } => Poll::Ready(Ok(resp.take().unwrap_or_default())),
        }
    }
}
