//! What the layer writes: the rate-limit headers of an answer, and the
//! responses it makes itself (a `429`, a gRPC status, a decider's error).

use bytes::Bytes;
use floodgate_core::headers::{Field, HeaderMode, Value, write_rate_limit_headers};
use http::header::{CONTENT_TYPE, HeaderName, HeaderValue, RETRY_AFTER};
use http::{Response, StatusCode};

use super::{Local, RateLimitBody};
use crate::decide::Answer;

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
    pub(super) fn with_text(answer: &Answer, mode: HeaderMode, text: impl FnOnce(&mut Vec<u8>)) -> (Self, Bytes) {
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

    pub(super) fn fields(&self) -> &[(Field, u16)] {
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
pub(super) fn header_name(field: Field) -> HeaderName {
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
pub(super) const REJECTED: &[u8] = b"429 Too Many Requests: ";

/// The `429` answer to a denied request (headers added by the caller).
pub fn rejection<B>(answer: &Answer) -> Response<RateLimitBody<B>> {
    let mut text = Vec::with_capacity(80);
    write_denial(answer, REJECTED, b"\n", &mut text);
    local_response(StatusCode::TOO_MANY_REQUESTS, text)
}

/// A response made here, with its body wrapped.
pub(super) fn wrapped<B>(resp: Local) -> Response<RateLimitBody<B>> {
    resp.map(|data| RateLimitBody::Local { data })
}

/// Why a request was denied, and when to come back, between `before` and
/// `after`, appended to `out` (without `core::fmt`: a denial is as common as
/// an attack makes it).
pub(super) fn write_denial(answer: &Answer, before: &[u8], after: &[u8], out: &mut Vec<u8>) {
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
pub(super) const GRPC_INVALID_ARGUMENT: u8 = 3;
pub(super) const GRPC_RESOURCE_EXHAUSTED: u8 = 8;
pub(super) const GRPC_INTERNAL: u8 = 13;

/// Whether a request with these headers is a gRPC call (`content-type:
/// application/grpc...`).
pub(super) fn is_grpc(headers: &http::HeaderMap) -> bool {
    headers.get(CONTENT_TYPE).is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

/// The answer to a denied gRPC call: `RESOURCE_EXHAUSTED`, as gRPC clients
/// expect (an HTTP `429` would reach them as `UNAVAILABLE`, which many retry
/// at once). The rate-limit headers and `retry-after` go with it, as
/// metadata.
pub fn grpc_rejection<B>(answer: &Answer) -> Response<RateLimitBody<B>> {
    wrapped(grpc_rejection_local(answer))
}

pub(super) fn grpc_rejection_local(answer: &Answer) -> Local {
    let mut text = Vec::with_capacity(64);
    write_denial(answer, b"", b"", &mut text);
    grpc_local(GRPC_RESOURCE_EXHAUSTED, &String::from_utf8_lossy(&text))
}

/// A trailers-only gRPC response (HTTP 200, no body) with `code` and
/// `message` (percent-encoded as gRPC requires).
pub fn grpc_response<B>(code: u8, message: &str) -> Response<RateLimitBody<B>> {
    wrapped(grpc_local(code, message))
}

pub(super) fn grpc_local(code: u8, message: &str) -> Local {
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
pub(super) fn local_text(status: StatusCode, text: Bytes, more: usize) -> Local {
    let mut resp = Response::new(Some(text));
    *resp.status_mut() = status;
    let headers = resp.headers_mut();
    headers.reserve(1 + more);
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    resp
}
