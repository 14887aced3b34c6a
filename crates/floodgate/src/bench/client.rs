//! The two protocols `floodgate bench` speaks, sent straight through
//! hyper's connection handles on the sending thread's own runtime.
//!
//! gRPC: RLS `ShouldRateLimit` frames written by hand over HTTP/2
//! connections (`hyper::client::conn::http2`). tonic's `Channel` would put a
//! buffer task, and so a cross-task hop, in front of every request: on a
//! two-core machine shared with the server under test, the generator's
//! own CPU is part of what is measured, so it spends as little as it can.
//! JSON: `POST /json` over a pool of HTTP/1.1 connections; `get`: a plain
//! `GET` of a path (any HTTP server: the proxy's overhead), the same way.

use std::cell::{Cell, RefCell};
use std::time::Duration;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::client::conn::http2::SendRequest;
use hyper::header::{CONTENT_TYPE, HeaderMap, HeaderValue, TE};
use hyper::{Request, Uri};
use hyper_util::client::legacy::Client as Pool;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::json;

use crate::exit::Failure;

/// How long connecting may take before the run fails.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

const RLS_PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
const RESERVE_PATH: &str = "/floodgate.budget.v1.Budget/Reserve";
const SETTLE_PATH: &str = "/floodgate.budget.v1.Budget/Settle";

/// What `floodgate bench` speaks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Protocol {
    /// RLS `ShouldRateLimit` over HTTP/2.
    Grpc,
    /// `POST /json` over HTTP/1.1.
    Json,
    /// `GET` of this path over HTTP/1.1.
    Get(String),
    /// A reservation over HTTP/2: `floodgate.budget.v1.Budget/Reserve` of
    /// one hit, then `Settle` of it (one request of the run is both).
    Budget,
    /// Envoy's pair for a concurrency limit over HTTP/2: an RLS acquire,
    /// then (when allowed) the stream-end release carrying the lease id
    /// back (one request of the run is both).
    Lease,
}

/// What one request got back.
pub(super) enum Outcome {
    Allowed,
    Denied,
    /// Refused by an overloaded server (`RESOURCE_EXHAUSTED`, "overloaded").
    Shed,
    Error(String),
}

/// Where and what to send: the server's `host:port` and the descriptor.
#[derive(Debug, Clone)]
pub(super) struct Target {
    /// `host:port`, from `--server` with any `http://` and path removed.
    pub(super) authority: String,
    pub(super) domain: String,
    pub(super) key: String,
    /// Every request gives its hit back (`is_negative_hits`): `--refund`.
    pub(super) refund: bool,
}

impl Target {
    /// `--server` as `host:port` or `http://host:port[/]`.
    pub(super) fn parse(server: &str, domain: &str, key: &str) -> Result<Target, Failure> {
        let authority = crate::cli::http_authority("server", server, "127.0.0.1:8081")?;
        Ok(Target { authority, domain: domain.to_owned(), key: key.to_owned(), refund: false })
    }

    fn uri(&self, path: &str) -> Uri {
        // Checked in `parse`: an authority and an absolute path make a URI.
        Uri::builder()
            .scheme("http")
            .authority(self.authority.as_str())
            .path_and_query(path)
            .build()
            .unwrap_or_default()
    }
}

/// One sending thread's connections.
pub(super) enum Client {
    /// HTTP/2 connections; request `n` goes on connection `n % len`.
    Grpc { conns: Vec<H2>, uri: Uri },
    /// HTTP/2 connections for reserves and settles.
    Budget { conns: Vec<H2>, reserve: Uri, settle: Uri },
    /// HTTP/2 connections for acquires and their releases.
    Lease { conns: Vec<H2>, uri: Uri },
    Http {
        pool: Box<Pool<HttpConnector, Full<Bytes>>>,
        uri: Uri,
        /// A plain `GET` (else `POST /json` with the descriptor).
        get: bool,
    },
}

impl Client {
    /// Connect `connections` HTTP/2 connections (gRPC), or set up an
    /// HTTP/1.1 pool of up to `in_flight` connections (JSON, GET) — checked
    /// with one connection now, so an unreachable server fails the run at
    /// once.
    pub(super) async fn connect(
        target: &Target,
        protocol: &Protocol,
        connections: usize,
        in_flight: usize,
    ) -> Result<Client, Failure> {
        if !matches!(protocol, Protocol::Grpc | Protocol::Budget | Protocol::Lease) {
            tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(&target.authority))
                .await
                .map_err(|_| Failure::runtime(format!("cannot connect to {}: timed out", target.authority)))?
                .map_err(|e| Failure::runtime(format!("cannot connect to {}: {e}", target.authority)))?;
            let mut http = HttpConnector::new();
            http.set_nodelay(true);
            http.set_connect_timeout(Some(CONNECT_TIMEOUT));
            let pool = Pool::builder(TokioExecutor::new()).pool_max_idle_per_host(in_flight).build(http);
            let (uri, get) = match protocol {
                Protocol::Get(path) => (target.uri(path), true),
                _ => (target.uri("/json"), false),
            };
            return Ok(Client::Http { pool: Box::new(pool), uri, get });
        }
        let mut conns = Vec::with_capacity(connections);
        for _ in 0..connections {
            let sender = handshake(&target.authority).await.map_err(Failure::runtime)?;
            conns.push(H2 {
                authority: target.authority.clone(),
                sender: RefCell::new(Some(sender)),
                reconnecting: Cell::new(false),
            });
        }
        if *protocol == Protocol::Budget {
            return Ok(Client::Budget { conns, reserve: target.uri(RESERVE_PATH), settle: target.uri(SETTLE_PATH) });
        }
        if *protocol == Protocol::Lease {
            return Ok(Client::Lease { conns, uri: target.uri(RLS_PATH) });
        }
        Ok(Client::Grpc { conns, uri: target.uri(RLS_PATH) })
    }

    /// Send request number `n` for descriptor value `value`.
    pub(super) async fn send(&self, target: &Target, n: usize, value: String) -> Outcome {
        match self {
            Client::Grpc { conns, uri } => {
                let Some(conn) = conns.get(n % conns.len().max(1)) else {
                    return Outcome::Error("no connection".into());
                };
                match conn.call(uri, grpc_frame(target, &value)).await {
                    Ok(outcome) => outcome,
                    Err(e) => Outcome::Error(e),
                }
            }
            Client::Budget { conns, reserve, settle } => {
                let Some(conn) = conns.get(n % conns.len().max(1)) else {
                    return Outcome::Error("no connection".into());
                };
                match reserve_and_settle(conn, reserve, settle, target, value).await {
                    Ok(outcome) => outcome,
                    Err(e) => Outcome::Error(e),
                }
            }
            Client::Lease { conns, uri } => {
                let Some(conn) = conns.get(n % conns.len().max(1)) else {
                    return Outcome::Error("no connection".into());
                };
                match acquire_and_release(conn, uri, target, value).await {
                    Ok(outcome) => outcome,
                    Err(e) => Outcome::Error(e),
                }
            }
            Client::Http { pool, uri, get } => {
                let req = if *get {
                    Request::get(uri.clone()).body(Full::new(Bytes::new()))
                } else {
                    let body = json!({
                        "domain": target.domain,
                        "descriptors": [{"entries": [{"key": target.key, "value": value}], "isNegativeHits": target.refund}],
                    })
                    .to_string();
                    Request::post(uri.clone())
                        .header(CONTENT_TYPE, "application/json")
                        .body(Full::new(Bytes::from(body)))
                };
                let Ok(req) = req else { return Outcome::Error("cannot build the request".into()) };
                match pool.request(req).await {
                    Ok(resp) => {
                        let status = resp.status();
                        // Read the body so the connection can be reused.
                        let _ = resp.into_body().collect().await;
                        match status.as_u16() {
                            200 => Outcome::Allowed,
                            _ if *get && status.is_success() => Outcome::Allowed,
                            429 => Outcome::Denied,
                            s => Outcome::Error(format!("HTTP {s}")),
                        }
                    }
                    Err(e) => Outcome::Error(e.to_string()),
                }
            }
        }
    }
}

/// One HTTP/2 connection, made again by the first request that finds it
/// closed (a server restarted under load); requests meanwhile fail fast.
pub(super) struct H2 {
    authority: String,
    sender: RefCell<Option<SendRequest<Full<Bytes>>>>,
    reconnecting: Cell<bool>,
}

/// One reserve of one hit and, when allowed, its settle at one hit.
async fn reserve_and_settle(
    conn: &H2,
    reserve: &Uri,
    settle: &Uri,
    target: &Target,
    value: String,
) -> Result<Outcome, String> {
    use floodgate_server::protocol::budget_grpc::{
        Entry, PbDescriptor, ReserveRequest, ReserveResponse, SettleRequest, SettleResponse,
    };
    use prost::Message;
    let frame = |m: &dyn Fn(&mut Vec<u8>)| {
        let mut buf = vec![0; 5];
        m(&mut buf);
        let len = u32::try_from(buf.len() - 5).unwrap_or(u32::MAX);
        buf[1..5].copy_from_slice(&len.to_be_bytes());
        Bytes::from(buf)
    };
    let q = ReserveRequest {
        domain: target.domain.clone(),
        descriptors: vec![PbDescriptor { entries: vec![Entry { key: target.key.clone(), value }], hits: None }],
        hits: 1,
    };
    let reply = match conn.message(reserve, frame(&|b| q.encode_raw(b))).await? {
        Ok(m) => ReserveResponse::decode(m).map_err(|e| format!("a reserve reply that does not decode: {e}"))?,
        Err(shed) => return Ok(shed),
    };
    if !reply.allowed {
        return Ok(Outcome::Denied);
    }
    let q = SettleRequest { reservation: reply.reservation, actual: vec![1] };
    match conn.message(settle, frame(&|b| q.encode_raw(b))).await? {
        Ok(m) => SettleResponse::decode(m).map_err(|e| format!("a settle reply that does not decode: {e}"))?,
        Err(shed) => return Ok(shed),
    };
    Ok(Outcome::Allowed)
}

/// Envoy's calls for a request under a concurrency limit: the acquire and,
/// when allowed, the stream-end release with the lease id the answer's
/// dynamic metadata carried.
async fn acquire_and_release(conn: &H2, uri: &Uri, target: &Target, value: String) -> Result<Outcome, String> {
    let reply = match conn.message(uri, rls_frame(&target.domain, &[(&target.key, &value)], false)).await? {
        Ok(m) => m,
        Err(shed) => return Ok(shed),
    };
    let (code, lease) = code_and_lease(&reply).map_err(|e| format!("a reply that does not decode: {e}"))?;
    if code != Code::Ok as u64 {
        return Ok(Outcome::Denied);
    }
    let Some(lease) = lease else {
        return Err("an allowed answer without a lease: the domain's descriptor has no concurrency limit".into());
    };
    let release = rls_frame(&target.domain, &[(&target.key, &value), ("lease_id", &lease)], true);
    match conn.message(uri, release).await? {
        Ok(m) => overall_code(&m).map_err(|e| format!("a release reply that does not decode: {e}"))?,
        Err(shed) => return Ok(shed),
    };
    Ok(Outcome::Allowed)
}

impl H2 {
    async fn call(&self, uri: &Uri, frame: Bytes) -> Result<Outcome, String> {
        match self.message(uri, frame).await? {
            Ok(message) => {
                let code = overall_code(&message).map_err(|e| format!("a reply that does not decode: {e}"))?;
                Ok(if code == Code::Ok as u64 { Outcome::Allowed } else { Outcome::Denied })
            }
            Err(shed) => Ok(shed),
        }
    }

    /// One gRPC call: the reply's message, or the outcome of a shed call.
    async fn message(&self, uri: &Uri, frame: Bytes) -> Result<Result<Bytes, Outcome>, String> {
        let live = self.sender.borrow().as_ref().filter(|s| !s.is_closed()).cloned();
        let mut sender = match live {
            Some(s) => s,
            None => {
                // One request at a time reconnects; the others fail fast
                // until it is back.
                if self.reconnecting.replace(true) {
                    return Err(format!("connection to {} lost, reconnecting", self.authority));
                }
                let made = handshake(&self.authority).await;
                self.reconnecting.set(false);
                let s = made?;
                *self.sender.borrow_mut() = Some(s.clone());
                s
            }
        };
        let req = Request::post(uri.clone())
            .header(CONTENT_TYPE, HeaderValue::from_static("application/grpc"))
            .header(TE, HeaderValue::from_static("trailers"))
            .body(Full::new(frame))
            .map_err(|e| e.to_string())?;
        let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
        let (head, body) = resp.into_parts();
        if head.status != hyper::StatusCode::OK {
            return Err(format!("HTTP {}", head.status));
        }
        let body = body.collect().await.map_err(|e| e.to_string())?;
        // A trailers-only reply (an error) carries its status in the head.
        let status = body.trailers().and_then(grpc_status).or_else(|| grpc_status(&head.headers));
        let trailers = body.trailers().cloned().unwrap_or_default();
        match status {
            Some(0) => {}
            Some(code) => {
                let message = trailers
                    .get("grpc-message")
                    .or_else(|| head.headers.get("grpc-message"))
                    .and_then(|m| m.to_str().ok())
                    .unwrap_or("");
                if code == 8 && message.starts_with("overloaded") {
                    return Ok(Err(Outcome::Shed));
                }
                return Err(format!("gRPC status {code}: {message}"));
            }
            None => return Err("a reply without grpc-status".into()),
        }
        let bytes = body.to_bytes();
        match bytes.get(..5) {
            Some(&[0, a, b, c, d]) => {
                let len = u32::from_be_bytes([a, b, c, d]) as usize;
                if bytes.len() < 5 + len {
                    return Err("a truncated gRPC message".into());
                }
                Ok(Ok(bytes.slice(5..5 + len)))
            }
            _ => Err("a reply that is not one uncompressed gRPC message".into()),
        }
    }
}

fn grpc_status(headers: &HeaderMap) -> Option<i32> {
    headers.get("grpc-status")?.to_str().ok()?.parse().ok()
}

/// One RLS request as a gRPC message: uncompressed flag, length, protobuf
/// (`domain`, one descriptor of one entry — with `is_negative_hits` for
/// `--refund` —, `hits_addend: 1`), written
/// straight into one buffer: the generator's own CPU per request is part
/// of what a run on a shared machine measures.
fn grpc_frame(target: &Target, value: &str) -> Bytes {
    rls_frame(&target.domain, &[(&target.key, value)], target.refund)
}

/// A gRPC frame of a `RateLimitRequest` of one descriptor of `entries`
/// (given back when `refund`: `is_negative_hits`), one hit.
fn rls_frame(domain: &str, entries: &[(&str, &str)], refund: bool) -> Bytes {
    // Entry { key = 1, value = 2 }.
    let entry = |k: &str, v: &str| field_len(1, k.len()) + field_len(2, v.len());
    // RateLimitDescriptor { entries = 1, is_negative_hits = 4 }.
    let descriptor = entries.iter().map(|(k, v)| field_len(1, entry(k, v))).sum::<usize>() + if refund { 2 } else { 0 };
    // RateLimitRequest { domain = 1, descriptors = 2, hits_addend = 3 }.
    let message = field_len(1, domain.len()) + field_len(2, descriptor) + 2;
    let mut buf = Vec::with_capacity(5 + message);
    buf.push(0);
    buf.extend_from_slice(&u32::try_from(message).unwrap_or(u32::MAX).to_be_bytes());
    put_field(&mut buf, 1, domain.len());
    buf.extend_from_slice(domain.as_bytes());
    put_field(&mut buf, 2, descriptor);
    for (k, v) in entries {
        put_field(&mut buf, 1, entry(k, v));
        put_field(&mut buf, 1, k.len());
        buf.extend_from_slice(k.as_bytes());
        put_field(&mut buf, 2, v.len());
        buf.extend_from_slice(v.as_bytes());
    }
    if refund {
        buf.extend_from_slice(&[4 << 3, 1]);
    }
    buf.extend_from_slice(&[3 << 3, 1]);
    Bytes::from(buf)
}

/// Each length-delimited field `want` of an encoded message given to
/// `found`, every other field skipped unread; the answer is its varint
/// field 1 (a `RateLimitResponse`'s `overall_code`; 0 when absent).
fn scan(mut b: &[u8], want: u64, mut found: impl FnMut(&[u8])) -> Result<u64, &'static str> {
    let mut first = 0;
    while !b.is_empty() {
        let (tag, n) = varint(b).ok_or("a bad field tag")?;
        b = &b[n..];
        let skip = match (tag >> 3, tag & 7) {
            (1, 0) => {
                let (v, n) = varint(b).ok_or("a bad varint")?;
                first = v;
                n
            }
            (_, 0) => varint(b).ok_or("a bad varint")?.1,
            (_, 1) => 8,
            (f, 2) => {
                let (len, n) = varint(b).ok_or("a bad length")?;
                let len = usize::try_from(len).map_err(|_| "a bad length")?;
                let body = b.get(n..n + len).ok_or("a truncated field")?;
                if f == want {
                    found(body);
                }
                n + len
            }
            (_, 5) => 4,
            _ => return Err("an unknown wire type"),
        };
        b = b.get(skip..).ok_or("a truncated field")?;
    }
    Ok(first)
}

/// `overall_code` and the `lease_id` string of `dynamic_metadata` (field 6,
/// a Struct: map entries in field 1, each a key 1 and a Value 2, whose
/// string is 3) of an encoded `RateLimitResponse`.
fn code_and_lease(message: &[u8]) -> Result<(u64, Option<String>), &'static str> {
    let mut lease = None;
    let code = scan(message, 6, |metadata| {
        let _ = scan(metadata, 1, |entry| {
            let (mut key, mut value) = (None, None);
            let _ = scan(entry, 1, |k| key = Some(k.to_vec()));
            let _ = scan(entry, 2, |v| {
                let _ = scan(v, 3, |s| value = Some(String::from_utf8_lossy(s).into_owned()));
            });
            if key.as_deref() == Some(b"lease_id".as_slice()) {
                lease = value;
            }
        });
    })?;
    Ok((code, lease))
}

/// Bytes of a length-delimited field `field` holding `len` bytes.
fn field_len(field: u32, len: usize) -> usize {
    varint_len(u64::from(field << 3 | 2)) + varint_len(len as u64) + len
}

fn put_field(buf: &mut Vec<u8>, field: u32, len: usize) {
    put_varint(buf, u64::from(field << 3 | 2));
    put_varint(buf, len as u64);
}

fn varint_len(v: u64) -> usize {
    (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

fn put_varint(buf: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        buf.push((v as u8) | 0x80);
        v >>= 7;
    }
    buf.push(v as u8);
}

/// A varint at the start of `b`: its value and length.
fn varint(b: &[u8]) -> Option<(u64, usize)> {
    let mut v = 0u64;
    for (i, &byte) in b.iter().enumerate().take(10) {
        v |= u64::from(byte & 0x7f) << (7 * i);
        if byte < 0x80 {
            return Some((v, i + 1));
        }
    }
    None
}

/// `overall_code` (field 1) of an encoded `RateLimitResponse`, skipping
/// every other field unread: the generator needs only that (0, UNKNOWN,
/// when absent, as proto3 leaves out a default).
fn overall_code(b: &[u8]) -> Result<u64, &'static str> {
    scan(b, 0, |_| {})
}

/// An HTTP/2 connection to `authority`, its driver spawned on this thread.
async fn handshake(authority: &str) -> Result<SendRequest<Full<Bytes>>, String> {
    let connect = async {
        let tcp = tokio::net::TcpStream::connect(authority).await.map_err(|e| e.to_string())?;
        tcp.set_nodelay(true).map_err(|e| e.to_string())?;
        let (sender, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .handshake(TokioIo::new(tcp))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok::<_, String>(sender)
    };
    match tokio::time::timeout(CONNECT_TIMEOUT, connect).await {
        Ok(Ok(sender)) => Ok(sender),
        Ok(Err(e)) => Err(format!("cannot connect to {authority}: {e}")),
        Err(_) => Err(format!("cannot connect to {authority}: timed out after {CONNECT_TIMEOUT:?}")),
    }
}

#[cfg(test)]
mod tests {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
    use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
    use prost::Message;

    use super::*;

    #[test]
    fn server_addresses() {
        for ok in ["127.0.0.1:8081", "http://127.0.0.1:8081", "http://localhost:1/", "[::1]:80"] {
            assert!(Target::parse(ok, "d", "k").is_ok(), "{ok}");
        }
        for bad in ["", "http://", "https://h:1", "h:1/path", "h:1?q", "a b:1"] {
            assert!(Target::parse(bad, "d", "k").is_err(), "{bad}");
        }
        let t = Target::parse("http://h:9/", "d", "k").unwrap();
        assert_eq!(t.uri(RLS_PATH).to_string(), format!("http://h:9{RLS_PATH}"));
    }

    #[test]
    fn a_frame_decodes_as_the_request() {
        // Lengths on both sides of a varint's one-byte limit.
        let long = "x".repeat(200);
        let cases = [("bench", "user", "42"), ("d", "k", ""), (long.as_str(), "k", "v")];
        for ((domain, key, value), refund) in cases.into_iter().flat_map(|c| [(c, false), (c, true)]) {
            let mut t = Target::parse("h:1", domain, key).unwrap();
            t.refund = refund;
            let f = grpc_frame(&t, value);
            let len = u32::from_be_bytes([f[1], f[2], f[3], f[4]]) as usize;
            assert_eq!((f[0], f.len()), (0, 5 + len));
            let want = RateLimitRequest {
                domain: domain.to_owned(),
                descriptors: vec![RateLimitDescriptor {
                    entries: vec![Entry { key: key.to_owned(), value: value.to_owned() }],
                    is_negative_hits: refund,
                    ..Default::default()
                }],
                hits_addend: 1,
            };
            assert_eq!(RateLimitRequest::decode(&f[5..]).unwrap(), want, "{domain}");
            // proto3 leaves out an empty string, which decodes the same.
            assert!(f.len() - 5 - want.encoded_len() <= 2);
        }
    }

    #[test]
    fn a_lease_id_is_read_from_the_dynamic_metadata() {
        use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
        let s = |v: &str| Value { kind: Some(Kind::StringValue(v.into())) };
        let reply = RateLimitResponse {
            overall_code: Code::Ok as i32,
            dynamic_metadata: Some(Struct {
                fields: [("other".to_owned(), s("x")), ("lease_id".to_owned(), s("00000000000000ab"))]
                    .into_iter()
                    .collect(),
            }),
            raw_body: vec![7; 30],
            ..Default::default()
        };
        assert_eq!(code_and_lease(&reply.encode_to_vec()), Ok((Code::Ok as u64, Some("00000000000000ab".to_owned()))));
        let denied = RateLimitResponse { overall_code: Code::OverLimit as i32, ..Default::default() };
        assert_eq!(code_and_lease(&denied.encode_to_vec()), Ok((Code::OverLimit as u64, None)));
        // The release frame decodes as Envoy's stream-end call.
        let frame = rls_frame("d", &[("k", "v"), ("lease_id", "ab")], true);
        let q = RateLimitRequest::decode(&frame[5..]).unwrap();
        assert_eq!(q.descriptors[0].entries[1].value, "ab");
        assert!(q.descriptors[0].is_negative_hits);
    }

    #[test]
    fn overall_code_is_read_past_other_fields() {
        use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::DescriptorStatus;
        let mut reply = RateLimitResponse {
            overall_code: Code::OverLimit as i32,
            statuses: vec![DescriptorStatus { limit_remaining: 300, ..Default::default() }],
            raw_body: vec![7; 300],
            ..Default::default()
        };
        assert_eq!(overall_code(&reply.encode_to_vec()), Ok(Code::OverLimit as u64));
        reply.overall_code = Code::Ok as i32;
        assert_eq!(overall_code(&reply.encode_to_vec()), Ok(Code::Ok as u64));
        assert_eq!(overall_code(&[]), Ok(0));
        assert!(overall_code(&[0x12, 5, 1]).is_err(), "a length past the end");
        assert!(overall_code(&[0x0f]).is_err(), "wire type 7");
    }
}
