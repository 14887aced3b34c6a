//! What a metered response has said of its cost so far, and its settle.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use floodgate_core::limiter::{Held, RuleCheck, Verdict};
use floodgate_core::reservation::ReservationId;
use floodgate_core::rules::cost::Actual;
use http::{HeaderMap, StatusCode};

use crate::decide::Decide;
use crate::layer::Shared;
use crate::usage::Scanner;

/// A metered request's reservation: its id and, for each limit it holds in
/// order, what to settle it at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Meter {
    /// The reservation.
    pub id: ReservationId,
    /// One per limit of the reservation, in the reserve's order.
    pub parts: Vec<MeterPart>,
}

/// One limit of a metered request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MeterPart {
    /// What it reserved.
    pub estimate: u64,
    /// Where its actual amount is read (`None`: it keeps its estimate, a
    /// limit without `cost`).
    pub actual: Option<Actual>,
}

impl Meter {
    /// The meter of reservation `id` made of `checks`, given their
    /// `verdicts` (one each, in order): its parts are the checks the store
    /// kept, as it keeps them — a limit's check it answered and allowed (a
    /// shadowed limit over its limit, or one whose store failed, keeps
    /// nothing, and a concurrency limit's slot is released, not settled) —
    /// so a settle gives one amount per part.
    pub fn of(id: ReservationId, checks: &[RuleCheck<'_>], verdicts: &[Verdict]) -> Meter {
        let parts = checks
            .iter()
            .zip(verdicts)
            .filter(|(c, v)| {
                c.rule.limit.as_ref().is_some_and(|l| !l.is_concurrency())
                    && v.failure.is_none()
                    && v.decision.is_some_and(|d| d.allowed)
            })
            .map(|(c, _)| MeterPart { estimate: c.hits, actual: c.rule.cost.as_ref().map(|k| k.actual.clone()) })
            .collect();
        Meter { id, parts }
    }
}

/// Settles a reservation and releases held slots (the decider, behind the
/// layer's shared state).
pub(crate) trait Settler: Send + Sync {
    fn settle(&self, meter: &Meter, actual: Vec<u64>) -> Pin<Box<dyn Future<Output = ()> + Send>>;
    fn release(&self, held: Held) -> Pin<Box<dyn Future<Output = ()> + Send>>;
}

struct SettleWith<D>(Arc<Shared<D>>);

impl<D: Decide> Settler for SettleWith<D> {
    fn settle(&self, meter: &Meter, actual: Vec<u64>) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        let (shared, id) = (Arc::clone(&self.0), meter.id);
        Box::pin(async move { shared.decider.settle(id, &actual).await })
    }

    fn release(&self, held: Held) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        let shared = Arc::clone(&self.0);
        Box::pin(async move { shared.decider.release(held).await })
    }
}

/// The settler of a layer's decider.
pub(crate) fn settler<D: Decide>(shared: &Arc<Shared<D>>) -> Arc<dyn Settler> {
    Arc::new(SettleWith(Arc::clone(shared)))
}

/// What a metered response said of its cost; settled, and its slots
/// released, when dropped (the body ended or was dropped).
pub(crate) struct Tally {
    /// The reservation, when one was kept.
    meter: Option<Meter>,
    /// The slots held on concurrency limits.
    held: Option<Held>,
    settler: Arc<dyn Settler>,
    /// The response's status, once its head came.
    status: Option<StatusCode>,
    /// Each part's amount read from a response header.
    from_headers: Vec<Option<u64>>,
    /// The body's usage, when a part reads it.
    scanner: Option<Scanner>,
    /// The request went to the inner service (else nothing was served).
    forwarded: bool,
}

impl Tally {
    pub(crate) fn new(meter: Option<Meter>, held: Option<Held>, settler: Arc<dyn Settler>) -> Self {
        let usage = meter.iter().flat_map(|m| &m.parts).any(|p| p.actual.as_ref().is_some_and(Actual::reads_usage));
        Self {
            meter,
            held,
            settler,
            status: None,
            from_headers: Vec::new(),
            scanner: usage.then(Scanner::new),
            forwarded: false,
        }
    }

    /// The request goes to the inner service now.
    pub(crate) fn forwarded(&mut self) {
        self.forwarded = true;
    }

    /// The response head came.
    pub(crate) fn head(&mut self, status: StatusCode, headers: &HeaderMap) {
        self.status = Some(status);
        let Some(meter) = &self.meter else { return };
        if !meter.parts.iter().any(|p| matches!(p.actual, Some(Actual::Header(_)))) {
            return;
        }
        self.from_headers = meter
            .parts
            .iter()
            .map(|p| match &p.actual {
                Some(Actual::Header(name)) => super::header_number(headers, name),
                _ => None,
            })
            .collect();
    }

    /// The next piece of the body.
    pub(crate) fn feed(&mut self, data: &[u8]) {
        if let Some(s) = &mut self.scanner {
            s.feed(data);
        }
    }

    /// Each part's amount: what the response said; else 0 on an error
    /// response or a request never forwarded (refused while held for
    /// shaping, or its client gone before: nothing was served); else the
    /// estimate.
    fn actuals(&self, meter: &Meter) -> Vec<u64> {
        let failed = !self.forwarded || self.status.is_some_and(|s| s.is_client_error() || s.is_server_error());
        let usage = self.scanner.as_ref().map(Scanner::usage);
        meter
            .parts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let Some(actual) = &p.actual else { return p.estimate };
                let read = match actual {
                    Actual::Header(_) => self.from_headers.get(i).copied().flatten(),
                    Actual::Usage(_) => usage.and_then(|u| actual.of_usage(|f| u.get(f))),
                };
                match read {
                    Some(v) => v,
                    None if failed => 0,
                    None => p.estimate,
                }
            })
            .collect()
    }
}

impl Drop for Tally {
    fn drop(&mut self) {
        let settle = self.meter.as_ref().map(|m| self.settler.settle(m, self.actuals(m)));
        let release = self.held.take().map(|h| self.settler.release(h));
        for mut work in settle.into_iter().chain(release) {
            // The memory store answers at once; a store that waits finishes
            // on the runtime. Without one, the reservation keeps its
            // estimate until it expires, and the slots free when their
            // lease ends.
            if work.as_mut().poll(&mut Context::from_waker(Waker::noop())) == Poll::Ready(()) {
                continue;
            }
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(work);
            }
        }
    }
}
