//! The response body: the inner service's, or one made here.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

// pin-project-lite takes no doc comments on pinned fields.
#[allow(missing_docs)]
mod pinned {
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
use pinned::BodyProj;
pub use pinned::RateLimitBody;

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
