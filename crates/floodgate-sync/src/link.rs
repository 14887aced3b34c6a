//! The sending side: one link per peer region. Every sync interval it asks
//! the region for batches and pushes each over gRPC (concurrently, as many
//! as the region allows in flight), bounded by the call timeout; an
//! acknowledgement goes back to the region, a failure too (the batch's keys
//! go out again). A peer that is down or misconfigured gets one log line
//! when it goes down and one when it comes back, not one per attempt.
//! Decisions never wait for any of this.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use floodgate_core::{Clock, SystemClock};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tonic::transport::{Channel, Endpoint};

use crate::proto::{Encoded, SyncAck, limits};
use floodgate_core::region::Region;

use crate::region::next_encoded;
use crate::server::PUSH;
use crate::stats::SyncStats;

/// A peer region and where its sync service listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    /// The peer region's name (as it calls itself: `--region`).
    pub name: String,
    /// Its sync address: `http://host:port`.
    pub url: String,
}

/// How links behave.
#[derive(Debug, Clone)]
pub struct LinkConfig {
    /// How often batches are sent.
    pub interval: Duration,
    /// The longest a call (connecting included) may take.
    pub timeout: Duration,
    /// The token peers' sync services want.
    pub token: Option<String>,
}

/// A peer's address could not be used.
#[derive(Debug, thiserror::Error)]
#[error("peer region {name}: address {url:?}: {why}; write NAME=http://HOST:PORT")]
pub struct PeerError {
    name: String,
    url: String,
    why: String,
}

fn endpoint(peer: &Peer, cfg: &LinkConfig) -> Result<Endpoint, PeerError> {
    let err = |why: String| PeerError { name: peer.name.clone(), url: peer.url.clone(), why };
    if !peer.url.starts_with("http://") {
        return Err(err("the scheme must be http:// (put a TLS proxy in front for other networks)".into()));
    }
    let endpoint = Endpoint::from_shared(peer.url.clone()).map_err(|e| err(e.to_string()))?;
    Ok(endpoint
        .connect_timeout(cfg.timeout)
        .timeout(cfg.timeout)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(cfg.timeout.max(Duration::from_secs(1))))
}

/// A lazily connected channel to `peer` (needs a Tokio runtime).
fn channel(peer: &Peer, cfg: &LinkConfig) -> Result<Channel, PeerError> {
    endpoint(peer, cfg).map(|e| e.connect_lazy())
}

/// Check every peer's address; nothing connects (no runtime needed).
pub fn check_peers(peers: &[Peer], cfg: &LinkConfig) -> Result<(), PeerError> {
    peers.iter().try_for_each(|p| endpoint(p, cfg).map(drop))
}

/// Run a link to every peer until `stop` reads true. `peers` must be in
/// the region's link order ([`Region::peers`]).
pub async fn run_links<R: Region + Clone>(
    region: R,
    peers: Vec<Peer>,
    cfg: LinkConfig,
    stats: Arc<SyncStats>,
    stop: watch::Receiver<bool>,
) -> Result<(), PeerError> {
    let mut links = JoinSet::new();
    for (p, peer) in peers.into_iter().enumerate() {
        let ch = channel(&peer, &cfg)?;
        links.spawn(link(region.clone(), p, peer, ch, cfg.clone(), stats.clone(), stop.clone()));
    }
    while links.join_next().await.is_some() {}
    Ok(())
}

async fn link<R: Region + Clone>(
    region: R,
    p: usize,
    peer: Peer,
    ch: Channel,
    cfg: LinkConfig,
    stats: Arc<SyncStats>,
    mut stop: watch::Receiver<bool>,
) {
    let clock = SystemClock::new();
    let mut tick = tokio::time::interval(cfg.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut calls = JoinSet::new();
    let peer = Arc::new(peer);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        while calls.try_join_next().is_some() {}
        loop {
            let Some(out) = next_encoded(&region, p, clock.now_us()).await else { break };
            let idle = out.idle;
            let (region, ch, cfg, stats, peer) = (region.clone(), ch.clone(), cfg.clone(), stats.clone(), peer.clone());
            calls.spawn(async move {
                let seq = out.seq;
                let msg = out.bytes;
                let bytes = msg.0.len() as u64;
                let counters = stats.peer(p);
                match push(ch, msg, &cfg).await {
                    Ok(ack) if ack.region == peer.name => {
                        counters.bytes_sent.fetch_add(bytes, Ordering::Relaxed);
                        if !counters.up.swap(true, Ordering::Relaxed) && counters.errors.load(Ordering::Relaxed) > 0 {
                            tracing::info!(peer = %peer.name, url = %peer.url, "region sync: peer {} reachable again", peer.name);
                        }
                        region.on_ack(p, &ack.into_ack(), SystemClock::new().now_us()).await;
                    }
                    Ok(ack) => {
                        region.on_failure(p, seq);
                        counters.errors.fetch_add(1, Ordering::Relaxed);
                        counters.up.store(false, Ordering::Relaxed);
                        if !counters.misnamed_logged.swap(true, Ordering::Relaxed) {
                            tracing::error!(
                                peer = %peer.name, url = %peer.url, answered = %ack.region,
                                "region sync: the service at {} is region {}, not {}: fix --peers (NAME=URL, NAME as that region's --region); nothing is exchanged with it; logged once",
                                peer.url, ack.region, peer.name
                            );
                        }
                    }
                    Err(e) => {
                        region.on_failure(p, seq);
                        counters.errors.fetch_add(1, Ordering::Relaxed);
                        let was_up = counters.up.swap(false, Ordering::Relaxed);
                        let first = counters.errors.load(Ordering::Relaxed) == 1;
                        *counters.last_error.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(e.to_string());
                        if was_up || first {
                            tracing::warn!(
                                peer = %peer.name, url = %peer.url,
                                "region sync: peer {} unreachable ({e}); decisions go on with what this region knows; retrying every {:?}, logged again when it answers",
                                peer.name, cfg.interval
                            );
                        }
                    }
                }
            });
            if idle {
                break;
            }
        }
    }
}

/// Why a `Push` call failed (kept as the peer's last error, as text).
#[derive(Debug, thiserror::Error)]
enum PushError {
    #[error("not connected: {0}")]
    NotConnected(tonic::transport::Error),
    #[error("the sync token is not a valid header value")]
    BadToken,
    #[error("{:?}{}{}", .0.code(), if .0.message().is_empty() { "" } else { ": " }, .0.message())]
    Refused(tonic::Status),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

/// One `Push` call, bounded by the timeout.
async fn push(ch: Channel, msg: Encoded, cfg: &LinkConfig) -> Result<SyncAck, PushError> {
    let call = async {
        let mut grpc = tonic::client::Grpc::new(ch).max_decoding_message_size(limits::MAX_MESSAGE);
        grpc.ready().await.map_err(PushError::NotConnected)?;
        let mut req = tonic::Request::new(msg);
        req.set_timeout(cfg.timeout);
        if let Some(t) = &cfg.token {
            let v = format!("Bearer {t}").parse().map_err(|_| PushError::BadToken)?;
            req.metadata_mut().insert("authorization", v);
        }
        let codec = tonic_prost::ProstCodec::<Encoded, SyncAck>::default();
        let path = http::uri::PathAndQuery::from_static(PUSH);
        grpc.unary(req, path, codec).await.map(tonic::Response::into_inner).map_err(PushError::Refused)
    };
    match tokio::time::timeout(cfg.timeout, call).await {
        Ok(r) => r,
        Err(_) => Err(PushError::Timeout(cfg.timeout)),
    }
}
