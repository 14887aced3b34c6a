//! Connections to Redis, and what the store knows about each: whether it is
//! still alive, and whether a failed call could have reached the server.
//!
//! A single server's connections are made here rather than by redis-rs's
//! client so the store owns the two facts it needs to stay exact across a
//! Redis restart:
//!
//! * **alive**: the connection's driver task ends when the socket closes
//!   (a killed Redis closes every socket at once). A dead connection is
//!   replaced before a call is handed to it, so no thread keeps a socket
//!   from before the restart and answers its next request with the failure
//!   policy.
//! * **written**: the bytes the socket accepted. A call that failed while
//!   not one byte went out (the socket was already closed, or the write
//!   failed) provably did not run its script; only such a call is sent
//!   again, once, on a fresh connection. A call that failed after bytes
//!   went out may have run, and is never sent twice.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{ConnectionAddr, RedisError};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// A live connection: both kinds pipeline concurrent commands on shared
/// sockets (the cluster one keeps one per node and follows MOVED/ASK).
#[derive(Clone)]
pub(crate) enum Conn {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

/// What one call sends.
#[derive(Clone, Copy)]
pub(crate) enum Packed<'a> {
    /// One command: an error in its reply fails the call.
    One(&'a redis::Cmd),
    /// Commands pipelined: one write, one reply to wait for, answered as an
    /// array of their replies, each holding its own error (the call fails
    /// only when the connection does). On a cluster, commands of one slot
    /// only.
    Many(&'a redis::Pipeline),
}

impl Conn {
    /// `what`, on a cluster to its keys' node, or with `at` to the primary
    /// serving that hash slot (a command without keys for one node: `SCAN`).
    pub(crate) async fn query(&mut self, what: Packed<'_>, at: Option<u16>) -> redis::RedisResult<redis::Value> {
        let cmd = match what {
            Packed::One(cmd) => cmd,
            Packed::Many(pipe) => {
                let replies = match self {
                    Self::Single(c) => c.req_packed_commands(pipe, 0, pipe.len()).await,
                    Self::Cluster(c) => c.req_packed_commands(pipe, 0, pipe.len()).await,
                };
                return replies.map(redis::Value::Array);
            }
        };
        let r = match (self, at) {
            (Self::Single(c), _) => c.req_packed_command(cmd).await,
            (Self::Cluster(c), None) => c.req_packed_command(cmd).await,
            (Self::Cluster(c), Some(slot)) => {
                let route = Route::new(slot, SlotAddr::Master);
                c.route_command(cmd.clone(), RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route))).await
            }
        };
        r.and_then(redis::Value::extract_error)
    }
}

/// A connection as the store keeps it.
#[derive(Clone)]
pub(crate) struct Live {
    pub(crate) conn: Conn,
    /// A single server's socket facts (a cluster connection reconnects its
    /// nodes itself and has none).
    watch: Option<Arc<Watch>>,
    /// The store's connection epoch when this was made: a breaker trip
    /// starts a new epoch, and connections of an older one are replaced.
    epoch: u64,
}

impl Live {
    pub(crate) fn cluster(conn: ClusterConnection, epoch: u64) -> Self {
        Self { conn: Conn::Cluster(conn), watch: None, epoch }
    }

    /// Whether calls may go on this connection in `epoch`.
    pub(crate) fn usable(&self, epoch: u64) -> bool {
        match &self.watch {
            None => true,
            Some(w) => self.epoch == epoch && w.alive.load(Ordering::Acquire),
        }
    }

    /// Bytes the socket accepted so far (0 for a cluster connection).
    pub(crate) fn written(&self) -> u64 {
        self.watch.as_ref().map_or(0, |w| w.written.load(Ordering::Acquire))
    }

    /// Whether a call that began when [`Live::written`] was `before` and
    /// failed with `e` provably never reached the server: the connection
    /// was dropped and not one byte went out since. Never for a cluster
    /// connection (redis-rs retries those itself).
    pub(crate) fn unsent(&self, before: u64, e: &RedisError) -> bool {
        self.watch.is_some() && e.is_connection_dropped() && self.written() == before
    }

    /// Whether `self` and `other` are the same connection.
    pub(crate) fn same(&self, other: &Self) -> bool {
        match (&self.watch, &other.watch) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

/// What the store knows about one socket.
#[derive(Debug)]
struct Watch {
    /// False once the connection's driver ended (the socket closed).
    alive: AtomicBool,
    /// Bytes the socket accepted.
    written: AtomicU64,
}

/// Connect to a single server: the socket, the handshake (AUTH, SELECT,
/// CLIENT SETINFO) and a driver task on the current runtime that marks the
/// connection dead when it ends. Not bounded in time: the caller's timeout
/// bounds it.
pub(crate) async fn connect_single(client: &redis::Client, epoch: u64) -> Result<Live, RedisError> {
    let info = client.get_connection_info();
    let watch = Arc::new(Watch { alive: AtomicBool::new(true), written: AtomicU64::new(0) });
    // No response timeout of its own: every call is already bounded by the
    // store's timeout (a second timer per command costs CPU).
    let config = redis::AsyncConnectionConfig::new().set_response_timeout(None);
    let conn = match info.addr() {
        ConnectionAddr::Tcp(host, port) => {
            let socket = tokio::net::TcpStream::connect((host.as_str(), *port)).await?;
            socket.set_nodelay(true)?;
            start(info.redis_settings(), Watched { io: socket, watch: Arc::clone(&watch) }, config).await?
        }
        ConnectionAddr::Unix(path) => {
            let socket = tokio::net::UnixStream::connect(path).await?;
            start(info.redis_settings(), Watched { io: socket, watch: Arc::clone(&watch) }, config).await?
        }
        _ => {
            return Err(RedisError::from((
                redis::ErrorKind::InvalidClientConfig,
                "TLS (rediss://) is not supported by this build; use redis:// behind a TLS tunnel",
            )));
        }
    };
    Ok(Live { conn: Conn::Single(conn), watch: Some(watch), epoch })
}

/// The handshake over `io`, then its driver spawned: when the driver ends,
/// the connection is marked dead.
async fn start<S>(
    settings: &redis::RedisConnectionInfo,
    io: Watched<S>,
    config: redis::AsyncConnectionConfig,
) -> Result<MultiplexedConnection, RedisError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let watch = Arc::clone(&io.watch);
    let (conn, driver) = MultiplexedConnection::new_with_config(settings, io, config).await?;
    tokio::spawn(async move {
        driver.await;
        watch.alive.store(false, Ordering::Release);
    });
    Ok(conn)
}

/// A socket that counts the bytes it accepts.
struct Watched<S> {
    io: S,
    watch: Arc<Watch>,
}

impl<S> Watched<S> {
    fn count(&self, r: Poll<io::Result<usize>>) -> Poll<io::Result<usize>> {
        if let Poll::Ready(Ok(n)) = r {
            self.watch.written.fetch_add(n as u64, Ordering::Release);
        }
        r
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write(cx, buf);
        self.count(r)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.count(r)
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
