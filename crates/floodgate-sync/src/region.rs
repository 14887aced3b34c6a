//! A region's next batch, encoded for the wire. What the transport needs
//! from a region is [`floodgate_core::region::Region`]: a memory-store
//! region is a `GlobalTable`, a Redis region a `floodgate_redis::RedisRegion`.

use floodgate_core::region::Region;

use crate::proto::{BatchEncoder, Encoded};

/// A batch ready to send.
#[derive(Debug)]
pub struct Outgoing {
    /// Its sequence number (for [`Region::on_failure`]).
    pub seq: u64,
    /// No keys and not the end of a full state transfer: a heartbeat.
    pub idle: bool,
    /// The encoded `SyncBatch`.
    pub bytes: Encoded,
}

/// The next batch for peer `peer` at `now_us`, encoded as the region hands
/// over its keys (no per-key copies); `None` when none is due.
pub async fn next_encoded<R: Region>(region: &R, peer: usize, now_us: u64) -> Option<Outgoing> {
    let mut enc = BatchEncoder::default();
    let head = region.next_batch_into(peer, now_us, &mut enc).await?;
    Some(Outgoing { seq: head.seq, idle: head.items == 0 && !head.complete, bytes: enc.finish(&head) })
}
