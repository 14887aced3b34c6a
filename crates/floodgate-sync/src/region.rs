//! What the transport needs from a region: batches to send each peer, what
//! to do with their acknowledgements and failures, and how to store what
//! peers send. A memory-store region is a [`GlobalTable`]; a Redis region
//! implements this over its Redis (in `floodgate-server`).

use std::future::Future;

use floodgate_core::region::{Ack, Batch, GlobalTable, Receipt};
use prost::Message;

use crate::proto::{BatchEncoder, Encoded, SyncBatch};

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

/// A region's side of the sync.
pub trait Region: Send + Sync + 'static {
    /// This region's name.
    fn name(&self) -> &str;

    /// The peer regions, in link order.
    fn peers(&self) -> &[String];

    /// The next batch for peer `peer` at `now_us`, if one is due.
    fn next_batch(&self, peer: usize, now_us: u64) -> impl Future<Output = Option<Batch>> + Send;

    /// The next batch for peer `peer`, encoded (by default from
    /// [`Region::next_batch`]; a region can write it without the copy).
    fn next_encoded(&self, peer: usize, now_us: u64) -> impl Future<Output = Option<Outgoing>> + Send {
        async move {
            let batch = self.next_batch(peer, now_us).await?;
            let (seq, idle) = (batch.seq, batch.items.is_empty() && !batch.complete);
            Some(Outgoing { seq, idle, bytes: Encoded(SyncBatch::from_batch(batch).encode_to_vec()) })
        }
    }

    /// Peer `peer` acknowledged a batch.
    fn on_ack(&self, peer: usize, ack: &Ack, now_us: u64) -> impl Future<Output = ()> + Send;

    /// A batch could not be delivered: its keys go out again.
    fn on_failure(&self, peer: usize, seq: u64);

    /// Store a peer's batch; the acknowledgement, sent only once everything
    /// in it is stored in this region. `Err`: not stored (the peer sends it
    /// again).
    fn receive(&self, batch: Batch, now_us: u64) -> impl Future<Output = Result<Receipt, String>> + Send;
}

impl Region for GlobalTable {
    fn name(&self) -> &str {
        self.region()
    }

    fn peers(&self) -> &[String] {
        GlobalTable::peers(self)
    }

    fn next_batch(&self, peer: usize, now_us: u64) -> impl Future<Output = Option<Batch>> + Send {
        std::future::ready(GlobalTable::next_batch(self, peer, now_us))
    }

    fn next_encoded(&self, peer: usize, now_us: u64) -> impl Future<Output = Option<Outgoing>> + Send {
        let mut enc = BatchEncoder::default();
        let out = GlobalTable::next_batch_into(self, peer, now_us, &mut enc).map(|head| Outgoing {
            seq: head.seq,
            idle: head.items == 0 && !head.complete,
            bytes: enc.finish(&head),
        });
        std::future::ready(out)
    }

    fn on_ack(&self, peer: usize, ack: &Ack, now_us: u64) -> impl Future<Output = ()> + Send {
        GlobalTable::on_ack(self, peer, ack, now_us);
        std::future::ready(())
    }

    fn on_failure(&self, peer: usize, seq: u64) {
        GlobalTable::on_failure(self, peer, seq);
    }

    fn receive(&self, batch: Batch, now_us: u64) -> impl Future<Output = Result<Receipt, String>> + Send {
        std::future::ready(Ok(GlobalTable::receive(self, &batch, now_us)))
    }
}

impl<R: Region> Region for std::sync::Arc<R> {
    fn name(&self) -> &str {
        (**self).name()
    }

    fn peers(&self) -> &[String] {
        (**self).peers()
    }

    fn next_batch(&self, peer: usize, now_us: u64) -> impl Future<Output = Option<Batch>> + Send {
        (**self).next_batch(peer, now_us)
    }

    fn next_encoded(&self, peer: usize, now_us: u64) -> impl Future<Output = Option<Outgoing>> + Send {
        (**self).next_encoded(peer, now_us)
    }

    fn on_ack(&self, peer: usize, ack: &Ack, now_us: u64) -> impl Future<Output = ()> + Send {
        (**self).on_ack(peer, ack, now_us)
    }

    fn on_failure(&self, peer: usize, seq: u64) {
        (**self).on_failure(peer, seq);
    }

    fn receive(&self, batch: Batch, now_us: u64) -> impl Future<Output = Result<Receipt, String>> + Send {
        (**self).receive(batch, now_us)
    }
}
