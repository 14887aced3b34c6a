//! What the transport counts, per peer, for metrics and for logging a peer
//! that is down or misconfigured once, not on every attempt.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

/// One peer link's counters.
#[derive(Debug, Default)]
pub struct PeerCounters {
    /// Bytes of batches sent (encoded).
    pub bytes_sent: AtomicU64,
    /// Bytes of batches received from this peer.
    pub bytes_received: AtomicU64,
    /// Calls that failed (unreachable, timed out, refused).
    pub errors: AtomicU64,
    /// Whether the last call succeeded.
    pub up: AtomicBool,
    /// Whether a fingerprint mismatch with this peer was logged.
    pub(crate) mismatch_logged: AtomicBool,
    /// Whether a wrong region name was logged.
    pub(crate) misnamed_logged: AtomicBool,
    /// The last failure, for the health endpoint.
    pub(crate) last_error: Mutex<Option<String>>,
}

impl PeerCounters {
    /// The last failure's text, if the peer is down.
    pub fn last_error(&self) -> Option<String> {
        if self.up.load(Ordering::Relaxed) {
            return None;
        }
        self.last_error.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }
}

/// The transport's counters.
#[derive(Debug)]
pub struct SyncStats {
    peers: Box<[PeerCounters]>,
    /// Batches refused: bad token, bad contents.
    pub rejected: AtomicU64,
    /// Bytes received from regions that are not peers.
    pub unknown_bytes: AtomicU64,
    pub(crate) unknown_logged: AtomicBool,
}

impl SyncStats {
    /// Counters for `peers` links.
    pub fn new(peers: usize) -> Self {
        Self {
            peers: (0..peers).map(|_| PeerCounters::default()).collect(),
            rejected: AtomicU64::new(0),
            unknown_bytes: AtomicU64::new(0),
            unknown_logged: AtomicBool::new(false),
        }
    }

    /// Peer `p`'s counters.
    pub fn peer(&self, p: usize) -> &PeerCounters {
        &self.peers[p]
    }

    /// Every peer's counters, in link order.
    pub fn peers(&self) -> &[PeerCounters] {
        &self.peers
    }
}
