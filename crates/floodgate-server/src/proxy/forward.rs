//! The reverse proxy (`floodgate proxy`): every request is decided by the
//! service (rules, overrides, metrics, any store) through the tower layer,
//! then forwarded to one upstream, held for a shaping delay first, or
//! answered `429` here.
//!
//! * Descriptors come from the domain's `request_descriptors` (hot reloaded
//!   with the rules); without any, each request carries `remote_address =
//!   <client IP>`.
//! * Bodies stream both ways: nothing is buffered whole.
//! * Upstream unreachable or failing: `502`; no response headers within
//!   the upstream timeout: `504`.
//! * HTTP/1.1 (keep-alive) and HTTP/2 (prior knowledge) from clients;
//!   HTTP/1.1 to the upstream over a keep-alive pool.
//! * A client slower than the header timeout to send its request head is
//!   disconnected; every connection is its own task, so a slow client
//!   never stalls another.

use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use floodgate_core::Store;
use floodgate_core::reservation::ReservationId;
use floodgate_core::rules::cost::Metering;
use floodgate_tower::{
    Answer, Decide, DecideError, PeerAddr, RateLimitLayer, RequestFacts, Reserved, TrustedProxies, build_descriptors,
    descriptor_templates, estimate, ip_str,
};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::PathAndQuery;
use http::{Request, Response, StatusCode, Uri, Version};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tower_layer::Layer;

use crate::listen::threads;
use crate::listen::{ConnLimit, ConnOptions, Handed, ServerError, accept, serve_http};
use crate::metrics::Protocol;
use crate::proxy::upstream::{Outgoing, Pool};
use crate::service::{Decided, Descriptor, Request as RlsRequest, RequestError, Service};

/// The proxy's settings.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// Where clients connect.
    pub listen: SocketAddr,
    /// Where requests go.
    pub upstream: Upstream,
    /// The rules domain requests are decided in.
    pub domain: String,
    /// Proxies in front of this one whose forwarding header is believed.
    pub trusted: TrustedProxies,
    /// The longest the upstream may take to start its response (504 after).
    pub upstream_timeout: Duration,
    /// Serve on this many single-threaded runtimes (0: the shared one); see
    /// [`serve_proxy`].
    pub threads: usize,
    /// At most this many requests held for shaping delays at once
    /// ([`RateLimitLayer::max_held`]).
    pub max_held: usize,
}

/// The upstream: `http://host:port[/base/path]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    authority: http::uri::Authority,
    /// Prefix of every forwarded path, without a trailing `/` ("" for none).
    base: String,
}

/// An upstream URL [`Upstream`] refuses, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadUpstream {
    /// Not a URL.
    #[error("`{0}` is not a URL ({1}): write e.g. http://127.0.0.1:3000")]
    NotUrl(String, String),
    /// An `https://` URL.
    #[error(
        "`{0}`: https upstreams are not supported; proxy to the service's plain-HTTP address (floodgate usually runs beside it), e.g. http://127.0.0.1:3000"
    )]
    Https(String),
    /// Another scheme, or none.
    #[error("`{0}`: give an http:// URL, e.g. http://127.0.0.1:3000")]
    Scheme(String),
    /// No host.
    #[error("`{0}`: the URL has no host")]
    NoHost(String),
    /// A query string.
    #[error("`{0}`: an upstream URL takes no query string")]
    Query(String),
}

impl FromStr for Upstream {
    type Err = BadUpstream;

    fn from_str(s: &str) -> Result<Self, BadUpstream> {
        let uri: Uri = s.parse().map_err(|e: http::uri::InvalidUri| BadUpstream::NotUrl(s.into(), e.to_string()))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some("https") => return Err(BadUpstream::Https(s.into())),
            _ => return Err(BadUpstream::Scheme(s.into())),
        }
        let authority = uri.authority().cloned().ok_or_else(|| BadUpstream::NoHost(s.into()))?;
        if uri.query().is_some() {
            return Err(BadUpstream::Query(s.into()));
        }
        let base = uri.path().trim_end_matches('/').to_owned();
        Ok(Upstream { authority, base })
    }
}

impl Upstream {
    /// The origin-form target (`/path?query`) of a request for `uri`, its
    /// path and query under the base: `None` when that is `uri` itself (no
    /// base path, origin-form already: the request keeps its own, nothing
    /// formatted, parsed or copied per request).
    fn target_of(&self, uri: &Uri) -> Result<Option<Uri>, http::Error> {
        if self.base.is_empty() && uri.scheme().is_none() && uri.authority().is_none() {
            return Ok(None);
        }
        let path = uri.path_and_query();
        let path = match (path, self.base.is_empty()) {
            (Some(p), true) => p.clone(),
            (None, true) => PathAndQuery::from_static("/"),
            (p, false) => PathAndQuery::try_from(format!("{}{}", self.base, p.map_or("/", PathAndQuery::as_str)))?,
        };
        Ok(Some(Uri::from(path)))
    }
}

impl fmt::Display for Upstream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "http://{}{}", self.authority, self.base)
    }
}

/// The service's rules engine as the tower layer's decider: descriptors
/// built by the domain's current `request_descriptors`, decided with
/// overrides and metrics (`protocol="proxy"`).
pub struct ServiceDecider<S> {
    service: Arc<Service<S>>,
    domain: String,
}

impl<S> ServiceDecider<S> {
    /// Decide `domain` with `service`.
    pub fn new(service: Arc<Service<S>>, domain: String) -> Self {
        Self { service, domain }
    }
}

impl<S> fmt::Debug for ServiceDecider<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServiceDecider").field("domain", &self.domain).finish_non_exhaustive()
    }
}

impl<S: Store> ServiceDecider<S> {
    /// The RLS request of a request's descriptors (`None`: no descriptor, so
    /// nothing limits it).
    fn request(&self, facts: &RequestFacts<'_>) -> Result<Option<RlsRequest>, DecideError> {
        let descriptors =
            build_descriptors(descriptor_templates(&self.service.rules().current(), &self.domain), facts)?;
        if descriptors.is_empty() {
            return Ok(None);
        }
        Ok(Some(RlsRequest {
            domain: self.domain.clone(),
            descriptors: descriptors
                .into_iter()
                .map(|entries| Descriptor { entries, hits_addend: None, refund: false, limit: None, lease: None })
                .collect(),
            hits_addend: 1,
        }))
    }
}

/// The layer's answer: the service's (a refused request is a server error).
fn layer_answer(a: Result<Decided, RequestError>) -> Result<Answer, DecideError> {
    a.map(|d| d.answer).map_err(|e| DecideError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        message: format!("the descriptors built for this request are refused ({e}): check request_descriptors"),
    })
}

impl<S: Store + 'static> Decide for ServiceDecider<S> {
    async fn decide(&self, facts: &RequestFacts<'_>) -> Result<Answer, DecideError> {
        let Some(req) = self.request(facts)? else { return Ok(Answer::unlimited()) };
        layer_answer(self.service.decide(&req, Protocol::Proxy).await)
    }

    fn answers_at_once(&self) -> bool {
        self.service.answers_at_once()
    }

    fn metering(&self) -> Option<Metering> {
        self.service.rules().current().domain(&self.domain)?.metering()
    }

    async fn reserve(&self, facts: &RequestFacts<'_>) -> Result<Reserved, DecideError> {
        let Some(req) = self.request(facts)? else { return Ok(Reserved::unmetered(Answer::unlimited())) };
        let estimate = |cost: &floodgate_core::rules::cost::Cost| estimate(cost, facts.headers, facts.body);
        match self.service.meter(&req, &estimate).await {
            Ok(r) => Ok(Reserved { answer: r.decided.answer, meter: r.meter, held: r.held }),
            Err(crate::service::ReserveError::Request(e)) => layer_answer(Err(e)).map(Reserved::unmetered),
            Err(e) => Err(DecideError { status: StatusCode::INTERNAL_SERVER_ERROR, message: e.to_string() }),
        }
    }

    async fn settle(&self, id: ReservationId, actual: &[u64]) {
        // Counted in the metrics (`floodgate_settles_total`); a failed
        // settle leaves the reservation to expire at its estimate.
        if let Err(e) = self.service.settle(id, actual).await {
            tracing::warn!(reservation = %id, error = %e, "the proxy's settle failed: the reservation keeps its estimate");
        }
    }

    async fn release(&self, held: floodgate_tower::Held) {
        self.service.release(&held).await;
    }
}

/// A response body of the proxy: the upstream's, streamed, or one made here.
pub type ProxyBody = BoxBody<Bytes, hyper::Error>;

/// Forwards requests to the upstream (the service inside the rate-limit
/// layer). Never fails: upstream errors become 502 and 504 responses.
#[derive(Clone)]
pub struct Forward {
    pool: Arc<Pool>,
    upstream: Arc<Upstream>,
    host: HeaderValue,
    timeout: Duration,
}

impl fmt::Debug for Forward {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Forward").field("upstream", &self.upstream).finish_non_exhaustive()
    }
}

impl Forward {
    /// Forward to `upstream`, waiting at most `timeout` for its response
    /// head (connecting included).
    pub fn new(upstream: Upstream, timeout: Duration) -> Self {
        let pool = Pool::new(upstream.authority.clone(), timeout);
        // An authority is valid header text.
        let host = HeaderValue::from_str(upstream.authority.as_str()).unwrap_or(HeaderValue::from_static("localhost"));
        Self { pool, upstream: Arc::new(upstream), host, timeout }
    }

    /// The same settings over a connection pool of its own (one per
    /// runtime: a pool's connections live on the runtime that opened them).
    pub fn with_own_pool(&self) -> Self {
        Self { pool: Pool::new(self.upstream.authority.clone(), self.timeout), ..self.clone() }
    }

    async fn forward(self, mut req: Request<Outgoing>) -> Response<ProxyBody> {
        let peer = req.extensions().get::<PeerAddr>().map(|p| p.0.ip());
        let Ok(target) = self.upstream.target_of(req.uri()) else {
            let path = req.uri().path_and_query().map_or("/", |p| p.as_str());
            return local(StatusCode::BAD_REQUEST, format!("400 Bad Request: cannot forward the path `{path}`\n"));
        };
        // HTTP/2 clients send no Host: keep the authority they asked for;
        // failing that (HTTP/1.0), name the upstream.
        if !req.headers().contains_key(header::HOST) {
            let host = req.uri().authority().and_then(|a| HeaderValue::from_str(a.as_str()).ok());
            req.headers_mut().insert(header::HOST, host.unwrap_or_else(|| self.host.clone()));
        }
        if let Some(target) = target {
            *req.uri_mut() = target;
        }
        *req.version_mut() = Version::HTTP_11;
        let headers = req.headers_mut();
        strip_hop_by_hop(headers);
        if let Some(ip) = peer {
            append_forwarded_for(headers, ip);
        }
        if !headers.contains_key(X_FORWARDED_PROTO) {
            headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
        }
        match tokio::time::timeout(self.timeout, self.pool.send(req)).await {
            Ok(Ok(resp)) => {
                let mut resp = resp.map(BodyExt::boxed);
                strip_hop_by_hop(resp.headers_mut());
                resp
            }
            Ok(Err(e)) => {
                tracing::debug!(upstream = %self.upstream, error = %chain(&e), "upstream request failed");
                local(StatusCode::BAD_GATEWAY, format!("502 Bad Gateway: upstream {}: {}\n", self.upstream, chain(&e)))
            }
            Err(_) => local(
                StatusCode::GATEWAY_TIMEOUT,
                format!("504 Gateway Timeout: upstream {} did not answer within {:?}\n", self.upstream, self.timeout),
            ),
        }
    }
}

impl tower_service::Service<Request<Outgoing>> for Forward {
    type Response = Response<ProxyBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<ProxyBody>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Outgoing>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move { Ok(this.forward(req).await) })
    }
}

/// An error and its sources, `a: b: c`.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        source = inner.source();
    }
    s
}

fn local(status: StatusCode, text: String) -> Response<ProxyBody> {
    let body = Full::new(Bytes::from(text)).map_err(|never: Infallible| match never {}).boxed();
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    resp
}

/// Remove the hop-by-hop headers (RFC 9110 7.6.1): `Connection` and those it
/// names, and the fixed list. Most messages carry none, and one pass over
/// their names (standard names compare as numbers) finds that out: removing
/// each of the list by its text looked every name up again (a twelfth of
/// the proxy's instructions per request).
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    if !headers.keys().any(is_hop_by_hop) {
        return;
    }
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    let fixed: Vec<HeaderName> = headers.keys().filter(|n| is_hop_by_hop(n)).cloned().collect();
    for name in fixed {
        headers.remove(name);
    }
}

/// A header that only concerns one connection (RFC 9110 7.6.1), besides
/// those `Connection` names.
fn is_hop_by_hop(name: &HeaderName) -> bool {
    *name == header::CONNECTION
        || *name == header::TE
        || *name == header::TRAILER
        || *name == header::TRANSFER_ENCODING
        || *name == header::UPGRADE
        || *name == header::PROXY_AUTHENTICATE
        || *name == header::PROXY_AUTHORIZATION
        || *name == "keep-alive"
        || *name == "proxy-connection"
}

/// Append the peer to `X-Forwarded-For` (one header line, the list kept).
fn append_forwarded_for(headers: &mut HeaderMap, ip: std::net::IpAddr) {
    let mut value = Vec::with_capacity(64);
    for prior in headers.get_all(X_FORWARDED_FOR) {
        if let Ok(prior) = prior.to_str() {
            value.extend_from_slice(prior.as_bytes());
            value.extend_from_slice(b", ");
        }
    }
    value.extend_from_slice(ip_str(ip, &mut [0; 48]).as_bytes());
    if let Ok(v) = HeaderValue::from_maybe_shared(Bytes::from(value)) {
        headers.insert(X_FORWARDED_FOR, v);
    }
}

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");

/// Serve the proxy on `listener` until `stop` reads true; then stop
/// accepting and let open connections finish their requests.
///
/// With `threads > 0` the connections are served on that many
/// single-threaded runtimes, handed out round-robin, each with its own
/// upstream connection pool: a request, its decision and its upstream call
/// stay on one thread (no cross-thread wakeups, the bulk of a proxy's
/// added latency). With `0`, on the caller's runtime.
pub async fn serve_proxy<S: Store + 'static>(
    listener: TcpListener,
    layer: RateLimitLayer<ServiceDecider<S>>,
    forward: Forward,
    options: ConnOptions,
    bound: ConnLimit,
    stop: watch::Receiver<bool>,
    threads: usize,
) -> Result<(), ServerError> {
    if threads == 0 {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let serving = serve_connections(rx, layer, forward, options, stop.clone());
        let accepting = accept(listener, vec![tx], bound, stop);
        let ((), served) = tokio::join!(accepting, serving);
        return served;
    }
    let serve_stop = stop.clone();
    threads::on_threads(threads, "proxy", listener, bound, stop, move |handed| {
        serve_connections(handed, layer.clone(), forward.with_own_pool(), options, serve_stop.clone())
    })
    .await
}

/// Serve the connections from `incoming` on this runtime until `stop` or
/// the end of `incoming`; then let open connections finish their requests.
async fn serve_connections<S: Store + 'static>(
    incoming: Handed,
    layer: RateLimitLayer<ServiceDecider<S>>,
    forward: Forward,
    options: ConnOptions,
    stop: watch::Receiver<bool>,
) -> Result<(), ServerError> {
    serve_http(incoming, layer.metered().layer(forward), options, stop, "proxy").await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_paths_go_under_the_upstreams_base() {
        let bare: Upstream = "http://127.0.0.1:3000".parse().unwrap();
        let based: Upstream = "http://127.0.0.1:3000/api/".parse().unwrap();
        for (u, uri, want) in [
            (&bare, "/a/b?x=1&y", "/a/b?x=1&y"),
            // HTTP/2 requests come in absolute form.
            (&bare, "http://svc/a?x=1", "/a?x=1"),
            (&bare, "http://svc", "/"),
            (&based, "/a?x=1", "/api/a?x=1"),
            (&based, "/", "/api/"),
            (&based, "http://svc", "/api/"),
        ] {
            let uri: Uri = uri.parse().unwrap();
            let target = u.target_of(&uri).unwrap().unwrap_or_else(|| uri.clone());
            assert_eq!(target.to_string(), want, "{u} {uri}");
        }
        let own: Uri = "/a?b".parse().unwrap();
        assert!(bare.target_of(&own).unwrap().is_none(), "an origin-form request keeps its own URI");
    }

    #[test]
    fn upstreams_parse_or_say_what_to_write() {
        let u: Upstream = "http://127.0.0.1:3000/api/".parse().unwrap();
        assert_eq!(u.to_string(), "http://127.0.0.1:3000/api");
        assert_eq!("http://svc".parse::<Upstream>().unwrap().to_string(), "http://svc");
        for (bad, says) in [
            ("https://x", "https upstreams are not supported"),
            ("ftp://x", "give an http:// URL"),
            ("127.0.0.1:3000", "give an http:// URL"),
            ("http://x/?a=1", "no query"),
            ("http://", "not a URL"),
        ] {
            let e = bad.parse::<Upstream>().unwrap_err();
            assert!(e.to_string().contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn hop_by_hop_headers_go_and_forwarded_for_is_appended() {
        let mut h = HeaderMap::new();
        h.insert("connection", HeaderValue::from_static("close, x-secret"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("te", HeaderValue::from_static("trailers"));
        h.insert("x-keep", HeaderValue::from_static("1"));
        h.append("x-forwarded-for", HeaderValue::from_static("1.1.1.1"));
        h.append("x-forwarded-for", HeaderValue::from_static("2.2.2.2"));
        strip_hop_by_hop(&mut h);
        append_forwarded_for(&mut h, "10.0.0.1".parse().unwrap());
        assert!(h.get("connection").is_none() && h.get("x-secret").is_none() && h.get("te").is_none());
        assert_eq!(h.get("x-keep").unwrap(), "1");
        assert_eq!(h.get_all("x-forwarded-for").iter().collect::<Vec<_>>(), ["1.1.1.1, 2.2.2.2, 10.0.0.1"]);

        // Without `Connection`, the fixed list still goes; the rest stays.
        let mut h = HeaderMap::new();
        for (name, value) in [("keep-alive", "timeout=5"), ("Proxy-Connection", "keep-alive"), ("upgrade", "h2c")] {
            h.insert(HeaderName::from_bytes(name.as_bytes()).unwrap(), HeaderValue::from_static(value));
        }
        h.insert("x-keep", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.keys().map(HeaderName::as_str).collect::<Vec<_>>(), ["x-keep"]);
        append_forwarded_for(&mut h, "::1".parse().unwrap());
        assert_eq!(h.get("x-forwarded-for").unwrap(), "::1");
    }
}
