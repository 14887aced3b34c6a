//! Metering ([`MeterLayer`]): a request whose limits have a `cost` reserves
//! its estimate when it starts, and settles what the response says it cost
//! when the response ends.
//!
//! * **The estimate** of each metered limit is read from the request (a
//!   constant, a header, or a field of its JSON body such as `max_tokens`);
//!   the request's other limits take their hit as usual, and all of them
//!   decide together: a request denied by any reserves nothing.
//! * **The body** of a request in a metered domain is read before the
//!   decision when an estimate reads it (at most [`MAX_READ`] bytes; past
//!   that, or when it is not JSON, the estimate is the rule's `default` and
//!   the body is forwarded as it came). When a rule asks for usage and a
//!   request to a `/chat/completions` or `/completions` path streams
//!   (`"stream": true`) without `stream_options.include_usage`, that option
//!   is added (the response then ends with a usage chunk, which OpenAI's
//!   client libraries read or skip); `Accept-Encoding` is removed so that
//!   the usage can be read.
//! * **The response** streams through as it comes; its `usage` object (a
//!   JSON body, or the chunk of an event stream that carries it) or the
//!   rule's response header gives the actual amount.
//! * **The settle** happens when the response body ends, fails, or is
//!   dropped (the client went away, the request was cancelled, a handler
//!   panicked): each metered limit is settled at the amount read; an error
//!   response (4xx or 5xx) that says no amount, or a request the layer
//!   refused after reserving (held for shaping while it holds its most),
//!   settles at 0 (nothing was served); any other response without an amount (a stream cut or left
//!   before its usage chunk, a stream without usage) keeps the estimate —
//!   the upstream may bill what it generated, and the estimate is what the
//!   caller was allowed. Limits without a cost keep their hit.
//! * **A store that cannot keep reservations** (down, or without support):
//!   the request is decided as an ordinary one, by each rule's failure
//!   policy, and is not metered.

mod body;
mod tally;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use floodgate_core::limiter::Held;
use floodgate_core::rules::cost::{Cost, EstimateFrom, Metering};
use http::header::{ACCEPT_ENCODING, CONTENT_LENGTH, HeaderValue, TRANSFER_ENCODING};
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::Body;
use tower_layer::Layer;
use tower_service::Service;

pub use body::{MeteredBody, RequestBody};
pub use tally::{Meter, MeterPart};

use super::future::{HeldSlot, ResponseFuture, too_many_held};
use super::response::local_text;
use super::service::{Next, next, peer_addr};
use super::{Local, RateLimit, RateLimitLayer, Shared, Wrapped};
use crate::decide::{Answer, Decide};
use crate::descriptors::RequestFacts;

/// The most of a request body read for an estimate: 1 MiB.
pub const MAX_READ: usize = 1 << 20;

/// A metered request's decision: the answer and, when it was allowed and
/// something was reserved, what to settle.
#[derive(Debug)]
pub struct Reserved {
    /// The answer, as [`Decide::decide`] gives it.
    pub answer: Answer,
    /// The reservation (`None`: nothing to settle).
    pub meter: Option<Meter>,
    /// The slots held on concurrency limits, released
    /// ([`Decide::release`]) when the response ends.
    pub held: Option<Held>,
}

impl Reserved {
    /// An answer with nothing reserved.
    pub fn unmetered(answer: Answer) -> Self {
        Self { answer, meter: None, held: None }
    }
}

/// A request's estimate on a limit with `cost`, read from its headers or
/// its JSON body.
pub fn estimate(cost: &Cost, headers: &HeaderMap, body: Option<&serde_json::Value>) -> u64 {
    let read = match &cost.estimate.from {
        EstimateFrom::Constant => None,
        EstimateFrom::Header(name) => header_number(headers, name),
        EstimateFrom::Body(names) => body.and_then(|b| names.iter().find_map(|n| b.get(&**n)?.as_u64())),
    };
    cost.estimate.of(read)
}

/// A header's value read as a whole number (`None`: missing or not one).
fn header_number(headers: &HeaderMap, name: &str) -> Option<u64> {
    headers.get(name).and_then(|v| v.to_str().ok()).and_then(|s| s.trim().parse().ok())
}

/// Meters the requests of a rules domain whose limits have a `cost`, and
/// rate-limits every request as [`RateLimitLayer`] does; see the module
/// documentation. The inner service takes [`RequestBody`]s (axum's `Router`
/// takes any body).
pub struct MeterLayer<D> {
    layer: RateLimitLayer<D, Wrapped>,
}

impl<D> Clone for MeterLayer<D> {
    fn clone(&self) -> Self {
        Self { layer: self.layer.clone() }
    }
}

impl<D> std::fmt::Debug for MeterLayer<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeterLayer").field("layer", &self.layer).finish()
    }
}

impl<D: Decide> RateLimitLayer<D> {
    /// This layer, metering the requests whose limits have a `cost`
    /// ([`MeterLayer`]).
    pub fn metered(self) -> MeterLayer<D> {
        MeterLayer { layer: self }
    }
}

impl<D> MeterLayer<D> {
    /// The rate-limit layer it decides with.
    pub fn rate_limit(&self) -> &RateLimitLayer<D> {
        &self.layer
    }
}

impl<S, D> Layer<S> for MeterLayer<D> {
    type Service = Metered<S, D>;

    fn layer(&self, inner: S) -> Metered<S, D> {
        Metered { plain: self.layer.layer(inner) }
    }
}

/// The metering service of [`MeterLayer`].
pub struct Metered<S, D> {
    plain: RateLimit<S, D, Wrapped>,
}

impl<S: Clone, D> Clone for Metered<S, D> {
    fn clone(&self) -> Self {
        Self { plain: self.plain.clone() }
    }
}

impl<S: std::fmt::Debug, D> std::fmt::Debug for Metered<S, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metered").field("plain", &self.plain).finish()
    }
}

/// The response of a metered request.
type MeteredResponse<ResB, E> = Pin<Box<dyn Future<Output = Result<Response<MeteredBody<ResB>>, E>> + Send>>;

// pin-project-lite takes no doc comments on fields.
#[allow(missing_docs)]
mod pinned {
    use super::{MeteredResponse, Request, RequestBody, ResponseFuture, Service, Wrapped};

    pin_project_lite::pin_project! {
        /// The response future of [`super::Metered`].
        #[project = MeterFutureProj]
        pub enum MeterFuture<S, ReqB, ResB>
        where
            S: Service<Request<RequestBody<ReqB>>>,
        {
            /// A request of a domain without costs: the rate-limit layer's.
            Plain { #[pin] fut: ResponseFuture<S, RequestBody<ReqB>, ResB, Wrapped> },
            /// A metered request.
            Metered { fut: MeteredResponse<ResB, S::Error> },
        }
    }
}
pub use pinned::MeterFuture;
use pinned::MeterFutureProj;

impl<S, ReqB, ResB> Future for MeterFuture<S, ReqB, ResB>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>>,
{
    type Output = Result<Response<MeteredBody<ResB>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            MeterFutureProj::Plain { fut } => fut.poll(cx).map_ok(|r| r.map(MeteredBody::plain)),
            MeterFutureProj::Metered { fut } => fut.as_mut().poll(cx),
        }
    }
}

impl<S, D, ReqB, ResB> Service<Request<ReqB>> for Metered<S, D>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    D: Decide,
    ReqB: Body<Data = Bytes> + Unpin + Send + 'static,
    ResB: Send + 'static,
{
    type Response = Response<MeteredBody<ResB>>;
    type Error = S::Error;
    type Future = MeterFuture<S, ReqB, ResB>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.plain.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        let Some(metering) = self.plain.shared.decider.metering() else {
            return MeterFuture::Plain { fut: self.plain.call(req.map(RequestBody::new)) };
        };
        let shared = Arc::clone(&self.plain.shared);
        let inner = self.plain.take_ready();
        MeterFuture::Metered { fut: Box::pin(metered(shared, inner, req, metering)) }
    }
}

/// A metered request: read what the estimates need, reserve, forward, and
/// tally the response for its settle.
async fn metered<S, D, ReqB, ResB>(
    shared: Arc<Shared<D>>,
    mut inner: S,
    req: Request<ReqB>,
    metering: Metering,
) -> Result<Response<MeteredBody<ResB>>, S::Error>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>>,
    D: Decide,
    ReqB: Body<Data = Bytes> + Unpin,
{
    let (mut parts, body) = req.into_parts();
    let (body, json) = if metering.body {
        let include_usage = metering.include_usage && asks_for_chat(parts.uri.path());
        match read(body, &mut parts.headers, include_usage).await {
            Ok(read) => read,
            Err(resp) => return Ok(resp.map(MeteredBody::local)),
        }
    } else {
        (RequestBody::new(body), None)
    };
    if metering.usage {
        parts.headers.remove(ACCEPT_ENCODING);
    }
    let client_ip = peer_addr(&parts.extensions).map(|p| shared.trusted.client_ip(p.ip(), &parts.headers));
    let facts = RequestFacts {
        method: &parts.method,
        uri: &parts.uri,
        headers: &parts.headers,
        client_ip,
        body: json.as_ref(),
    };
    let reserved = shared.decider.reserve(&facts).await;
    drop(json);
    let (result, meter, held) = match reserved {
        Ok(r) => (Ok(r.answer), r.meter, r.held),
        Err(e) => (Err(e), None, None),
    };
    // From here the reservation settles, and the slots held are released,
    // whatever happens (dropped before a response: the reservation at its
    // estimate).
    let mut tally =
        (meter.is_some() || held.is_some()).then(|| tally::Tally::new(meter, held, tally::settler(&shared)));
    let mut headers = None;
    match next(&result, &parts.headers, &mut headers, shared.headers) {
        Next::Answered(resp) => return Ok(resp.map(MeteredBody::local)),
        Next::Hold(delay) => {
            let Some(_slot) = HeldSlot::take(&shared.holds) else {
                return Ok(too_many_held(delay, shared.holds.max, headers).map(MeteredBody::local));
            };
            tokio::time::sleep(delay).await;
        }
        Next::Forward => {}
    }
    if let Some(t) = &mut tally {
        t.forwarded();
    }
    let mut resp = inner.call(Request::from_parts(parts, body)).await?;
    if let Some(t) = &mut tally {
        t.head(resp.status(), resp.headers());
    }
    if let Some(h) = headers {
        h.insert_into(resp.headers_mut());
    }
    Ok(resp.map(|b| MeteredBody::metered(b, tally)))
}

/// Read a request body for its estimates: the body to forward (what was
/// read, then the rest) and its JSON, when it was read whole and is JSON.
/// A streaming request asking no usage is asked for it (`include_usage`).
async fn read<B: Body<Data = Bytes> + Unpin>(
    mut body: B,
    headers: &mut HeaderMap,
    include_usage: bool,
) -> Result<(RequestBody<B>, Option<serde_json::Value>), Local> {
    let mut buf = Vec::new();
    loop {
        let frame = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await;
        match frame {
            None => break,
            Some(Ok(frame)) => {
                // Trailers of a request body are not forwarded.
                if let Ok(data) = frame.into_data() {
                    buf.extend_from_slice(&data);
                }
                if buf.len() > MAX_READ {
                    return Ok((RequestBody::after(Bytes::from(buf), body), None));
                }
            }
            Some(Err(_)) => {
                let text = Bytes::from_static(b"400 Bad Request: the request body could not be read\n");
                return Err(local_text(StatusCode::BAD_REQUEST, text, 0));
            }
        }
    }
    let json = serde_json::from_slice::<serde_json::Value>(&buf).ok();
    let mut bytes = Bytes::from(buf);
    if include_usage
        && let Some(j) = json.as_ref().filter(|j| asks_no_usage(j))
        && let Some(rewritten) = with_include_usage(&bytes, j)
    {
        bytes = Bytes::from(rewritten);
        headers.remove(TRANSFER_ENCODING);
        headers.insert(CONTENT_LENGTH, HeaderValue::from(bytes.len()));
    }
    Ok((RequestBody::read(bytes), json))
}

/// An OpenAI-style completion path, whose streams take
/// `stream_options.include_usage` (the Responses API and other APIs, which
/// may refuse an unknown field, are left as they are).
fn asks_for_chat(path: &str) -> bool {
    path.ends_with("/chat/completions") || path.ends_with("/completions")
}

/// `body` (whose JSON is `j`) asking for usage: without `stream_options`,
/// the field is written in after the opening brace (the rest of the bytes
/// as they came); with one, the JSON is written again with the option set.
fn with_include_usage(body: &[u8], j: &serde_json::Value) -> Option<Vec<u8>> {
    const OPTION: &[u8] = b"\"stream_options\":{\"include_usage\":true},";
    if j.get("stream_options").is_none() {
        let open = body.iter().position(|&b| b == b'{')?;
        let mut out = Vec::with_capacity(body.len() + OPTION.len());
        out.extend_from_slice(&body[..=open]);
        out.extend_from_slice(OPTION);
        out.extend_from_slice(&body[open + 1..]);
        return Some(out);
    }
    let mut j = j.clone();
    j["stream_options"]["include_usage"] = serde_json::Value::Bool(true);
    serde_json::to_vec(&j).ok()
}

/// An OpenAI-style request that streams (`"stream": true`) without asking
/// for usage, whose `stream_options` (if any) is an object to add it to.
fn asks_no_usage(j: &serde_json::Value) -> bool {
    let streams = j.get("stream").and_then(serde_json::Value::as_bool) == Some(true);
    let options = j.get("stream_options");
    let room = options.is_none_or(serde_json::Value::is_object);
    let asked = options.and_then(|o| o.get("include_usage")).and_then(serde_json::Value::as_bool) == Some(true);
    streams && room && !asked
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_streaming_requests_without_usage_are_asked_for_it() {
        let j = |s: &str| serde_json::from_str::<serde_json::Value>(s).unwrap();
        assert!(asks_no_usage(&j(r#"{"stream": true}"#)));
        assert!(asks_no_usage(&j(r#"{"stream": true, "stream_options": {"include_usage": false}}"#)));
        assert!(!asks_no_usage(&j(r#"{"stream": true, "stream_options": {"include_usage": true}}"#)));
        assert!(!asks_no_usage(&j(r#"{"stream": false}"#)));
        assert!(!asks_no_usage(&j(r#"{"messages": []}"#)));
        assert!(!asks_no_usage(&j(r#"{"stream": true, "stream_options": 3}"#)), "not ours to replace");
        assert!(asks_for_chat("/v1/chat/completions") && asks_for_chat("/v1/completions"));
        assert!(!asks_for_chat("/v1/messages") && !asks_for_chat("/v1/responses"), "Anthropic's, OpenAI's Responses");
    }

    #[test]
    fn the_option_is_written_in_and_the_rest_kept_as_it_came() {
        let body = br#" {"stream": true, "n": 18446744073709551616000}"#;
        let j = serde_json::from_slice::<serde_json::Value>(body).unwrap();
        let out = with_include_usage(body, &j).unwrap();
        assert_eq!(
            String::from_utf8(out.clone()).unwrap(),
            r#" {"stream_options":{"include_usage":true},"stream": true, "n": 18446744073709551616000}"#,
            "a number past u64 stays as written"
        );
        let v = serde_json::from_slice::<serde_json::Value>(&out).unwrap();
        assert!(!asks_no_usage(&v));
        let with = br#"{"stream": true, "stream_options": {"include_usage": false, "x": 1}}"#;
        let j = serde_json::from_slice::<serde_json::Value>(with).unwrap();
        let v = serde_json::from_slice::<serde_json::Value>(&with_include_usage(with, &j).unwrap()).unwrap();
        assert_eq!(v["stream_options"], serde_json::json!({"include_usage": true, "x": 1}));
    }
}
