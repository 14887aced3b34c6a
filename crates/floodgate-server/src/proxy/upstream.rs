//! The proxy's connections to its upstream: HTTP/1.1 keep-alive
//! connections to one address, pooled (one pool per serving runtime, so a
//! connection is only ever used on the thread that opened it).
//!
//! * A connection goes back to the pool when its response body has been
//!   read to the end; a response abandoned halfway (the client left) closes
//!   it, as HTTP/1.1 leaves no other way to skip the rest.
//! * The most recently used idle connection is taken first; one idle for
//!   [`IDLE_TIMEOUT`] is closed, and at most [`MAX_IDLE`] are kept.
//! * A request that a reused connection could not send (the upstream had
//!   just closed it) goes again on another one. A request that was sent is
//!   never sent twice: its failure is the caller's (502).
//! * Upstream down: connecting fails at once (refused) or after the
//!   connect timeout, and the caller answers 502.
//!
//! This replaces hyper-util's pooled client, which per request hashed the
//! pool key, spawned a task to return the connection and wrapped the
//! response in several futures: about a seventh of the proxy's
//! instructions per request.

use std::collections::VecDeque;
use std::fmt;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::uri::Authority;
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// A request body as the proxy forwards it: the client's, after what the
/// metering read of it.
pub(crate) type Outgoing = floodgate_tower::RequestBody<Incoming>;

/// An idle connection is closed after this long.
pub(crate) const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// At most this many idle connections per pool (the oldest go first).
pub(crate) const MAX_IDLE: usize = 1024;

/// Why the upstream gave no response.
#[derive(Debug, thiserror::Error)]
pub(crate) enum UpstreamError {
    /// No connection could be opened.
    #[error("cannot connect: {0}")]
    Connect(std::io::Error),
    /// Connecting took longer than the connect timeout.
    #[error("cannot connect within {0:?}")]
    ConnectTimeout(Duration),
    /// The connection failed while sending or reading the response head.
    #[error(transparent)]
    Http(hyper::Error),
}

/// Keep-alive connections to one upstream address.
pub(crate) struct Pool {
    authority: Authority,
    connect_timeout: Duration,
    max_idle: usize,
    idle: Mutex<VecDeque<Idle>>,
    sweeping: AtomicBool,
}

struct Idle {
    sender: SendRequest<Outgoing>,
    since: Instant,
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool").field("authority", &self.authority).field("idle", &self.idle_len()).finish()
    }
}

impl Pool {
    /// A pool of connections to `authority` (`host[:port]`, port 80 if
    /// none), each given `connect_timeout` to open.
    pub(crate) fn new(authority: Authority, connect_timeout: Duration) -> Arc<Self> {
        Arc::new(Pool {
            authority,
            connect_timeout,
            max_idle: MAX_IDLE,
            idle: Mutex::new(VecDeque::new()),
            sweeping: AtomicBool::new(false),
        })
    }

    /// Send `req` (origin-form URI, `Host` set) on an idle connection or a
    /// new one; the response's body returns the connection when read.
    pub(crate) async fn send(
        self: &Arc<Self>,
        mut req: Request<Outgoing>,
    ) -> Result<Response<PooledBody>, UpstreamError> {
        loop {
            let (mut sender, reused) = match self.checkout() {
                Some(sender) => (sender, true),
                None => (self.connect().await?, false),
            };
            match sender.try_send_request(req).await {
                Ok(resp) => {
                    let back = Some((sender, Arc::clone(self)));
                    return Ok(resp.map(|body| PooledBody { body, back, ended: false }));
                }
                Err(mut e) => match e.take_message() {
                    // Never sent: the connection had closed under us.
                    Some(unsent) if reused => req = unsent,
                    _ => return Err(UpstreamError::Http(e.into_error())),
                },
            }
        }
    }

    /// The most recently used idle connection that can take a request.
    fn checkout(&self) -> Option<SendRequest<Outgoing>> {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        // Closed ones (the upstream hung up) are dropped on the way.
        while let Some(i) = idle.pop_back() {
            if i.sender.is_ready() {
                return Some(i.sender);
            }
        }
        None
    }

    /// Keep `sender` for the next request.
    fn check_in(self: &Arc<Self>, sender: SendRequest<Outgoing>) {
        if sender.is_closed() {
            return;
        }
        let now = Instant::now();
        {
            let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
            if idle.len() >= self.max_idle {
                idle.pop_front();
            }
            idle.push_back(Idle { sender, since: now });
        }
        if !self.sweeping.load(Ordering::Relaxed) && !self.sweeping.swap(true, Ordering::Relaxed) {
            self.sweep_idle();
        }
    }

    /// Close the connections idle for [`IDLE_TIMEOUT`], every quarter of it,
    /// for as long as the pool lives (on the runtime of its first check-in).
    fn sweep_idle(self: &Arc<Self>) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        let pool: Weak<Self> = Arc::downgrade(self);
        rt.spawn(async move {
            let mut every = tokio::time::interval(IDLE_TIMEOUT / 4);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                let Some(pool) = pool.upgrade() else { return };
                pool.expire(Instant::now(), IDLE_TIMEOUT);
            }
        });
    }

    /// Close the connections idle since before `now - timeout`.
    fn expire(&self, now: Instant, timeout: Duration) {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        // Oldest first: check-ins only ever push newer ones at the back.
        while idle.front().is_some_and(|i| now.saturating_duration_since(i.since) >= timeout || i.sender.is_closed()) {
            idle.pop_front();
        }
    }

    fn idle_len(&self) -> usize {
        self.idle.lock().unwrap_or_else(PoisonError::into_inner).len()
    }

    /// Open a connection (each address of the host in turn).
    async fn connect(&self) -> Result<SendRequest<Outgoing>, UpstreamError> {
        let stream = tokio::time::timeout(self.connect_timeout, connect_tcp(&self.authority))
            .await
            .map_err(|_| UpstreamError::ConnectTimeout(self.connect_timeout))?
            .map_err(UpstreamError::Connect)?;
        let _ = stream.set_nodelay(true);
        let (sender, conn) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(UpstreamError::Http)?;
        let authority = self.authority.clone();
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(upstream = %authority, error = %e, "upstream connection ended with an error");
            }
        });
        Ok(sender)
    }
}

async fn connect_tcp(authority: &Authority) -> std::io::Result<TcpStream> {
    // An IPv6 literal is bracketed in a URL, not for the resolver.
    let host = authority.host().trim_start_matches('[').trim_end_matches(']');
    let port = authority.port_u16().unwrap_or(80);
    let mut last = None;
    for addr in tokio::net::lookup_host((host, port)).await? {
        match TcpStream::connect(addr).await {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, format!("{host} has no address"))))
}

/// An upstream response body that gives its connection back to the pool
/// once read to the end.
pub(crate) struct PooledBody {
    body: Incoming,
    back: Option<(SendRequest<Outgoing>, Arc<Pool>)>,
    ended: bool,
}

impl PooledBody {
    fn give_back(&mut self) {
        if let Some((sender, pool)) = self.back.take() {
            pool.check_in(sender);
        }
    }
}

impl Body for PooledBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => self.ended = true,
            Poll::Ready(Some(Ok(_))) => self.ended = self.body.is_end_stream(),
            // A failed body leaves the connection unusable: it is dropped.
            Poll::Ready(Some(Err(_))) => self.back = None,
            Poll::Pending => {}
        }
        if self.ended {
            self.give_back();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.ended || self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl Drop for PooledBody {
    fn drop(&mut self) {
        // An empty body is never polled; one dropped before its end takes
        // its connection with it.
        if self.ended || self.body.is_end_stream() {
            self.give_back();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use std::sync::atomic::AtomicUsize;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// When the test upstream hangs up on a connection.
    #[derive(Clone, Copy)]
    enum Hangup {
        Never,
        /// Once it has been idle this long.
        Idle(Duration),
        /// After each response, saying `connection: close`.
        Close,
    }

    /// An upstream answering each request on a connection with `body`;
    /// counts the connections it accepted.
    async fn upstream(body: &'static str, hangup: Hangup) -> (Authority, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = Arc::clone(&accepted);
        tokio::spawn(async move {
            loop {
                let (mut s, _) = listener.accept().await.unwrap();
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    let mut have = Vec::new();
                    loop {
                        let read = match hangup {
                            Hangup::Idle(t) => match tokio::time::timeout(t, s.read(&mut buf)).await {
                                Ok(r) => r,
                                Err(_) => return,
                            },
                            _ => s.read(&mut buf).await,
                        };
                        let n = match read {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        have.extend_from_slice(&buf[..n]);
                        while let Some(end) = have.windows(4).position(|w| w == b"\r\n\r\n") {
                            have.drain(..end + 4);
                            let close = if matches!(hangup, Hangup::Close) { "connection: close\r\n" } else { "" };
                            let resp =
                                format!("HTTP/1.1 200 OK\r\n{close}content-length: {}\r\n\r\n{body}", body.len());
                            if s.write_all(resp.as_bytes()).await.is_err() || !close.is_empty() {
                                return;
                            }
                        }
                    }
                });
            }
        });
        (addr.to_string().parse().unwrap(), accepted)
    }

    /// A `Request<Incoming>` needs a hyper server: this one takes requests
    /// and sends each through `pool`, answering with the upstream's body.
    async fn through(pool: Arc<Pool>) -> std::net::SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (s, _) = listener.accept().await.unwrap();
                let pool = Arc::clone(&pool);
                let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let pool = Arc::clone(&pool);
                    async move {
                        let mut resp =
                            pool.send(req.map(floodgate_tower::RequestBody::new)).await.map_err(|e| e.to_string())?;
                        // The upstream's hop-by-hop header is not for this client.
                        resp.headers_mut().remove(http::header::CONNECTION);
                        Ok::<_, String>(resp)
                    }
                });
                tokio::spawn(hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(s), svc));
            }
        });
        addr
    }

    async fn get(sender: &mut SendRequest<http_body_util::Empty<Bytes>>) -> (u16, String) {
        sender.ready().await.unwrap();
        let req = Request::get("/").header("host", "x").body(http_body_util::Empty::new()).unwrap();
        let resp = sender.send_request(req).await.unwrap();
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    async fn client(addr: std::net::SocketAddr) -> SendRequest<http_body_util::Empty<Bytes>> {
        let s = TcpStream::connect(addr).await.unwrap();
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(s)).await.unwrap();
        tokio::spawn(conn);
        sender
    }

    #[tokio::test(flavor = "current_thread")]
    async fn one_connection_serves_requests_in_turn() {
        // An empty body is never polled: its drop gives the connection back.
        for body in ["hello", ""] {
            let (up, accepted) = upstream(body, Hangup::Never).await;
            let pool = Pool::new(up, Duration::from_secs(2));
            let mut c = client(through(Arc::clone(&pool)).await).await;
            for _ in 0..50 {
                assert_eq!(get(&mut c).await, (200, body.to_owned()));
            }
            assert_eq!(accepted.load(Ordering::SeqCst), 1, "each response gives its connection back ({body:?})");
            assert_eq!(pool.idle_len(), 1);
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn connections_the_upstream_closed_are_replaced() {
        let (up, accepted) = upstream("hi", Hangup::Idle(Duration::from_millis(30))).await;
        let pool = Pool::new(up, Duration::from_secs(2));
        let mut c = client(through(Arc::clone(&pool)).await).await;
        for _ in 0..5 {
            assert_eq!(get(&mut c).await, (200, "hi".to_owned()));
            tokio::time::sleep(Duration::from_millis(80)).await;
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 5, "a closed connection is not reused");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_connection_the_upstream_says_it_closes_is_not_kept() {
        let (up, accepted) = upstream("bye", Hangup::Close).await;
        let pool = Pool::new(up, Duration::from_secs(2));
        let mut c = client(through(Arc::clone(&pool)).await).await;
        for _ in 0..10 {
            assert_eq!(get(&mut c).await, (200, "bye".to_owned()));
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 10);
        assert_eq!(pool.idle_len(), 0);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn concurrent_requests_open_more_connections_and_keep_some() {
        let (up, accepted) = upstream("x", Hangup::Never).await;
        let pool = Pool::new(up.clone(), Duration::from_secs(2));
        let bounded = Arc::new(Pool { max_idle: 2, ..Arc::into_inner(Pool::new(up, Duration::from_secs(2))).unwrap() });
        let addr = through(Arc::clone(&pool)).await;
        let to_bounded = through(Arc::clone(&bounded)).await;
        let (mut a, mut b, mut c, mut d) =
            (client(addr).await, client(addr).await, client(addr).await, client(addr).await);
        for _ in 0..10 {
            let got = tokio::join!(get(&mut a), get(&mut b), get(&mut c), get(&mut d));
            for g in [got.0, got.1, got.2, got.3] {
                assert_eq!(g, (200, "x".to_owned()));
            }
        }
        let opened = accepted.load(Ordering::SeqCst);
        assert!((1..=4).contains(&opened), "{opened} connections for 4 clients");
        assert_eq!(pool.idle_len(), opened);

        let (mut a, mut b, mut c, mut d) =
            (client(to_bounded).await, client(to_bounded).await, client(to_bounded).await, client(to_bounded).await);
        for _ in 0..10 {
            let _ = tokio::join!(get(&mut a), get(&mut b), get(&mut c), get(&mut d));
            assert!(bounded.idle_len() <= 2);
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn idle_connections_expire() {
        let (up, _) = upstream("x", Hangup::Never).await;
        let pool = Pool::new(up, Duration::from_secs(2));
        let mut c = client(through(Arc::clone(&pool)).await).await;
        get(&mut c).await;
        assert_eq!(pool.idle_len(), 1);
        pool.expire(Instant::now(), Duration::from_secs(1));
        assert_eq!(pool.idle_len(), 1, "not idle long enough");
        pool.expire(Instant::now() + Duration::from_secs(2), Duration::from_secs(1));
        assert_eq!(pool.idle_len(), 0);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn an_upstream_down_is_an_error_not_a_hang() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let dead: Authority = listener.local_addr().unwrap().to_string().parse().unwrap();
        drop(listener);
        let pool = Pool::new(dead, Duration::from_secs(2));
        let e = pool.connect().await.expect_err("nothing listens there");
        assert!(matches!(e, UpstreamError::Connect(_)), "{e:?}");
        assert!(e.to_string().starts_with("cannot connect: "), "{e}");
    }
}
