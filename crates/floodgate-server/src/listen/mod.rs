//! Accepting connections, bounded: every listener (gRPC, the HTTP API, the
//! admin API, the proxy) holds at most `--max-connections` open at once; at
//! the bound it stops accepting until one closes, so further clients wait
//! in the kernel's backlog instead of taking descriptors and memory. HTTP/1
//! clients must send a request's head within `--header-timeout` (a slow
//! client trickling headers is cut off); an HTTP/2 client may have at most
//! `--max-streams` requests open on one connection, and its resets are
//! bounded by h2's own limits (hyper's defaults).

pub mod overload;
pub(crate) mod threads;

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use floodgate_tower::PeerAddr;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};

/// Why a server (gRPC, the HTTP or admin API, the proxy, the sync) stopped
/// with an error while running.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// tonic's server failed.
    #[error(transparent)]
    Transport(#[from] tonic::transport::Error),
    /// The links to the peer regions failed.
    #[error(transparent)]
    Links(#[from] floodgate_sync::PeerError),
    /// A per-thread runtime or its thread could not start.
    #[error("cannot start {name} {what} {index}: {source}")]
    Start {
        /// The servers' name (`grpc`, `proxy`).
        name: &'static str,
        /// `runtime` or `thread`.
        what: &'static str,
        /// Which of them.
        index: usize,
        /// Why.
        source: io::Error,
    },
    /// A per-thread runtime ended without saying how (its thread panicked).
    #[error("a {0} runtime stopped unexpectedly")]
    Stopped(&'static str),
}

/// Connections a listener holds open at most, by default.
pub const DEFAULT_MAX_CONNECTIONS: usize = 10_000;
/// How long an HTTP/1 client may take to send a request's head, by default.
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// HTTP/2 streams (requests) a client may have open on one connection at
/// once, by default (nginx's `http2_max_concurrent_streams`). The bound is
/// what keeps an overloaded server's queue short: a client at it waits to
/// open more (Envoy opens another connection or times the request out and
/// applies its failure mode) instead of piling requests into the socket.
pub const DEFAULT_MAX_STREAMS: u32 = 128;

/// What every HTTP connection of a listener is held to.
#[derive(Debug, Clone, Copy)]
pub struct ConnOptions {
    /// The longest an HTTP/1 client may take to send a request's head.
    pub header_timeout: Duration,
    /// HTTP/2 streams open at once on one connection, at most.
    pub max_streams: u32,
}

/// One listener's bound on open connections: a permit per connection,
/// given back when it closes.
#[derive(Debug, Clone)]
pub struct ConnLimit(Arc<Semaphore>);

impl ConnLimit {
    /// At most `max` connections at once (at least 1).
    pub fn new(max: usize) -> Self {
        Self(Arc::new(Semaphore::new(max.clamp(1, Semaphore::MAX_PERMITS))))
    }
}

/// An accepted connection (`TCP_NODELAY` set, nonblocking), its peer, and
/// its place under the listener's bound (held until the connection closes).
pub(crate) type Accepted = (std::net::TcpStream, SocketAddr, OwnedSemaphorePermit);

/// The connections handed to one runtime; it ends when accepting stops.
pub(crate) type Handed = UnboundedReceiver<Accepted>;

/// Accept until `stop`, each connection once a place under `bound` is
/// free, handing them to `senders` in turn; dropping them when done tells
/// the servers no more are coming.
pub(crate) async fn accept(
    listener: TcpListener,
    senders: Vec<UnboundedSender<Accepted>>,
    bound: ConnLimit,
    mut stop: watch::Receiver<bool>,
) {
    let mut next = 0;
    let mut warned: Option<Instant> = None;
    loop {
        let permit = tokio::select! {
            _ = stop.wait_for(|s| *s) => break,
            p = bound.0.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
        };
        let accepted = tokio::select! {
            _ = stop.wait_for(|s| *s) => break,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((io, peer)) => {
                let _ = io.set_nodelay(true);
                let Ok(io) = io.into_std() else { continue };
                let _ = senders[next % senders.len()].send((io, peer, permit));
                next += 1;
            }
            Err(e) => {
                // Out of descriptors (EMFILE) fails every accept at once: wait
                // instead of spinning, and say so at most every 10 s.
                if warned.is_none_or(|w| w.elapsed() >= Duration::from_secs(10)) {
                    tracing::warn!(error = %e, "cannot accept a connection (out of file descriptors? raise `ulimit -n` or lower --max-connections); retrying every 100 ms");
                    warned = Some(Instant::now());
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// A connection holding its place under the listener's bound.
#[derive(Debug)]
pub(crate) struct Held {
    io: TcpStream,
    _permit: OwnedSemaphorePermit,
}

impl Held {
    /// `io` (from [`Accepted`]) on this runtime.
    pub(crate) fn new(io: std::net::TcpStream, permit: OwnedSemaphorePermit) -> io::Result<Self> {
        Ok(Self { io: TcpStream::from_std(io)?, _permit: permit })
    }
}

impl AsyncRead for Held {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Held {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for Held {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

/// Serve `router` (the HTTP or the admin API) on `listener`, bounded by
/// `bound` and `options`, until `stop`; then stop accepting and let open
/// connections finish their requests.
pub(crate) async fn serve_router(
    listener: TcpListener,
    router: Router,
    bound: ConnLimit,
    options: ConnOptions,
    stop: watch::Receiver<bool>,
) -> Result<(), ServerError> {
    let (tx, rx) = unbounded_channel();
    let accepting = accept(listener, vec![tx], bound, stop.clone());
    tokio::join!(accepting, serve_http(rx, router, options, stop, "HTTP"));
    Ok(())
}

/// Serve the connections from `incoming` on this runtime with `service`
/// (each request carrying its peer's address as a [`PeerAddr`] extension),
/// held to `options`, until `stop` or the end of `incoming`; then let open
/// connections finish their requests. `what` names them in the log.
pub(crate) async fn serve_http<S, B>(
    mut incoming: Handed,
    service: S,
    options: ConnOptions,
    mut stop: watch::Receiver<bool>,
    what: &'static str,
) where
    S: tower_service::Service<http::Request<Incoming>, Response = http::Response<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(options.header_timeout).keep_alive(true);
    builder.http2().timer(TokioTimer::new()).max_concurrent_streams(options.max_streams);
    loop {
        let (io, peer, permit) = tokio::select! {
            _ = stop.wait_for(|s| *s) => break,
            next = incoming.recv() => match next {
                Some(conn) => conn,
                None => break,
            },
        };
        let Ok(io) = Held::new(io, permit) else { continue };
        let service = service.clone();
        let service = hyper::service::service_fn(move |mut req: http::Request<Incoming>| {
            req.extensions_mut().insert(PeerAddr(peer));
            service.clone().call(req)
        });
        let conn = graceful.watch(builder.serve_connection(TokioIo::new(io), service).into_owned());
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(%peer, error = %e, "{what} connection ended with an error");
            }
        });
    }
    graceful.shutdown().await;
}
