//! The bodies of metered requests and responses.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

use super::tally::Tally;
use crate::layer::RateLimitBody;

// pin-project-lite takes no doc comments on pinned fields.
#[allow(missing_docs)]
mod pinned {
    use bytes::Bytes;

    use super::{RateLimitBody, Tally};

    pin_project_lite::pin_project! {
        /// A request body as the inner service of a [`super::super::MeterLayer`]
        /// gets it: what was read for an estimate, then the rest as it comes.
        pub struct RequestBody<B> {
            pub(super) head: Option<Bytes>,
            #[pin]
            pub(super) rest: Option<B>,
        }
    }

    pin_project_lite::pin_project! {
        /// A response body of a [`super::super::MeterLayer`]: passed through
        /// frame by frame, read for its usage on the way when the request is
        /// metered, and settled when it ends or is dropped.
        pub struct MeteredBody<B> {
            #[pin]
            pub(super) body: RateLimitBody<B>,
            pub(super) tally: Option<Box<Tally>>,
        }
    }
}
pub use pinned::{MeteredBody, RequestBody};

impl<B> RequestBody<B> {
    /// A body passed on as it comes.
    pub fn new(body: B) -> Self {
        Self { head: None, rest: Some(body) }
    }

    /// A body read whole.
    pub(super) fn read(bytes: Bytes) -> Self {
        Self { head: (!bytes.is_empty()).then_some(bytes), rest: None }
    }

    /// `head`, read already, then the rest of `body`.
    pub(super) fn after(head: Bytes, body: B) -> Self {
        Self { head: Some(head), rest: Some(body) }
    }
}

impl<B> std::fmt::Debug for RequestBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestBody").field("head", &self.head.as_ref().map(Bytes::len)).finish_non_exhaustive()
    }
}

impl<B: Body<Data = Bytes>> Body for RequestBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.project();
        if let Some(head) = this.head.take() {
            return Poll::Ready(Some(Ok(Frame::data(head))));
        }
        match this.rest.as_pin_mut() {
            Some(rest) => rest.poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.head.is_none() && self.rest.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        let head = self.head.as_ref().map_or(0, |h| h.len() as u64);
        let rest = self.rest.as_ref().map_or_else(|| SizeHint::with_exact(0), Body::size_hint);
        // (The upper bound first: a lower bound past it panics.)
        let mut hint = SizeHint::new();
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper + head);
        }
        hint.set_lower(rest.lower() + head);
        hint
    }
}

impl<B> MeteredBody<B> {
    /// A forwarded response's body, not metered.
    pub(super) fn plain(body: RateLimitBody<B>) -> Self {
        Self { body, tally: None }
    }

    /// A response made by the layer.
    pub(super) fn local(data: Option<Bytes>) -> Self {
        Self { body: RateLimitBody::Local { data }, tally: None }
    }

    /// A metered response's body.
    pub(super) fn metered(body: B, tally: Option<Tally>) -> Self {
        Self { body: RateLimitBody::Inner { body }, tally: tally.map(Box::new) }
    }
}

impl<B> std::fmt::Debug for MeteredBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeteredBody").field("body", &self.body).field("metered", &self.tally.is_some()).finish()
    }
}

impl<B: Body<Data = Bytes>> Body for MeteredBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.project();
        let polled = this.body.poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some(tally), Some(data)) = (this.tally.as_mut(), frame.data_ref()) {
                    tally.feed(data);
                }
            }
            // Ended or failed: settled now (dropping the tally settles).
            Poll::Ready(_) => drop(this.tally.take()),
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
