//! The receiving side: the `floodgate.sync.v1.Sync` gRPC service. A batch
//! is checked (token, then contents), stored through [`Region::receive`],
//! and acknowledged only once stored.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};

use floodgate_core::region::Region;
use floodgate_core::{Clock, SystemClock};
use prost::Message;
use tonic::codegen::{Body, BoxFuture, StdError};
use tonic::{Request, Response, Status};

use crate::proto::{SyncAck, SyncBatch, limits};
use crate::stats::SyncStats;

/// The service's full name.
pub const SERVICE: &str = "floodgate.sync.v1.Sync";
/// The path of its one method.
pub const PUSH: &str = "/floodgate.sync.v1.Sync/Push";

/// The gRPC service that receives peers' batches.
pub struct SyncServer<R> {
    inner: Arc<Inner<R>>,
}

struct Inner<R> {
    region: R,
    token: Option<String>,
    stats: Arc<SyncStats>,
    clock: SystemClock,
}

impl<R> Clone for SyncServer<R> {
    fn clone(&self) -> Self {
        Self { inner: self.inner.clone() }
    }
}

impl<R: Region> SyncServer<R> {
    /// A service storing into `region`; with a `token`, every call must
    /// carry `authorization: Bearer <token>`.
    pub fn new(region: R, token: Option<String>, stats: Arc<SyncStats>) -> Self {
        Self { inner: Arc::new(Inner { region, token, stats, clock: SystemClock::new() }) }
    }
}

/// Constant-time comparison, so a token cannot be guessed byte by byte.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl<R: Region> Inner<R> {
    async fn push(&self, req: Request<SyncBatch>) -> Result<Response<SyncAck>, Status> {
        if let Some(token) = &self.token {
            let given = req
                .metadata()
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .map(str::trim);
            if !given.is_some_and(|g| same(g.as_bytes(), token.as_bytes())) {
                self.stats.rejected.fetch_add(1, Ordering::Relaxed);
                return Err(Status::unauthenticated("send authorization: Bearer <the --sync-token of this region>"));
            }
        }
        let msg = req.into_inner();
        let bytes = msg.encoded_len() as u64;
        let batch = msg.into_batch().map_err(|e| {
            self.stats.rejected.fetch_add(1, Ordering::Relaxed);
            Status::invalid_argument(e.to_string())
        })?;
        let from = batch.from.clone();
        let peer = self.region.peers().iter().position(|p| *p == from);
        let receipt =
            self.region.receive(batch, self.clock.now_us()).await.map_err(|e| Status::unavailable(e.to_string()))?;
        match peer {
            Some(p) => {
                let c = self.stats.peer(p);
                c.bytes_received.fetch_add(bytes, Ordering::Relaxed);
                if let Some((key, n)) = &receipt.mismatch
                    && !c.mismatch_logged.swap(true, Ordering::Relaxed)
                {
                    tracing::warn!(
                        peer = %from,
                        first_key = %key,
                        keys = n,
                        "region sync: peer {from}'s limits differ from this region's for some global keys (a rolling deploy?); each region enforces its own limit; counted in floodgate_sync_fingerprint_mismatches_total, logged once"
                    );
                }
            }
            None => {
                self.stats.unknown_bytes.fetch_add(bytes, Ordering::Relaxed);
                if !self.stats.unknown_logged.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        sender = %from,
                        "region sync: region {from} sends usage but is not among this region's --peers: merged anyway (its usage is real), but nothing is sent back; add it to --peers; logged once"
                    );
                }
            }
        }
        Ok(Response::new(SyncAck::from_ack(&receipt.ack)))
    }
}

struct Push<R>(Arc<Inner<R>>);

impl<R: Region> tonic::server::UnaryService<SyncBatch> for Push<R> {
    type Response = SyncAck;
    type Future = BoxFuture<Response<SyncAck>, Status>;

    fn call(&mut self, request: Request<SyncBatch>) -> Self::Future {
        let inner = self.0.clone();
        Box::pin(async move { inner.push(request).await })
    }
}

impl<R: Region, B> tonic::codegen::Service<http::Request<B>> for SyncServer<R>
where
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if req.uri().path() == PUSH {
            let inner = self.inner.clone();
            return Box::pin(async move {
                let codec = tonic_prost::ProstCodec::<SyncAck, SyncBatch>::default();
                let mut grpc =
                    tonic::server::Grpc::new(codec).apply_max_message_size_config(Some(limits::MAX_MESSAGE), None);
                Ok(grpc.unary(Push(inner), req).await)
            });
        }
        Box::pin(async move { Ok(Status::unimplemented("floodgate.sync.v1.Sync has one method: Push").into_http()) })
    }
}

impl<R> tonic::server::NamedService for SyncServer<R> {
    const NAME: &'static str = SERVICE;
}
