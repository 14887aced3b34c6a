//! What a transport between regions needs from a region: batches to send
//! each peer, what to do with their acknowledgements and failures, and how
//! to store what peers send. A memory-store region is a
//! [`GlobalTable`](super::GlobalTable); a Redis region is
//! `floodgate_redis::RedisRegion`. Both keep each peer in step with the one
//! engine of [`super::link`]; a transport (`floodgate-sync`'s gRPC links, or
//! the simulator's network) moves the bytes.

use std::future::Future;

use crate::StoreError;
use crate::region::wire::{Ack, Batch, Component, Incarnation, Item, Shape};

/// A region's side of the sync.
pub trait Region: Send + Sync + 'static {
    /// This region's name.
    fn name(&self) -> &str;

    /// The peer regions, in link order.
    fn peers(&self) -> &[String];

    /// The next batch for peer `peer` at `now_us`, if one is due: each key
    /// handed to `sink`; the batch's other fields returned.
    fn next_batch_into<S: BatchSink + Send>(
        &self,
        peer: usize,
        now_us: u64,
        sink: &mut S,
    ) -> impl Future<Output = Option<BatchHead>> + Send;

    /// Peer `peer` acknowledged a batch.
    fn on_ack(&self, peer: usize, ack: &Ack, now_us: u64) -> impl Future<Output = ()> + Send;

    /// A batch could not be delivered: its keys go out again.
    fn on_failure(&self, peer: usize, seq: u64);

    /// Store a peer's batch; the acknowledgement, sent only once everything
    /// in it is stored in this region. `Err`: not stored (the peer sends it
    /// again).
    fn receive(&self, batch: Batch, now_us: u64) -> impl Future<Output = Result<Receipt, StoreError>> + Send;
}

impl<R: Region> Region for std::sync::Arc<R> {
    fn name(&self) -> &str {
        (**self).name()
    }

    fn peers(&self) -> &[String] {
        (**self).peers()
    }

    fn next_batch_into<S: BatchSink + Send>(
        &self,
        peer: usize,
        now_us: u64,
        sink: &mut S,
    ) -> impl Future<Output = Option<BatchHead>> + Send {
        (**self).next_batch_into(peer, now_us, sink)
    }

    fn on_ack(&self, peer: usize, ack: &Ack, now_us: u64) -> impl Future<Output = ()> + Send {
        (**self).on_ack(peer, ack, now_us)
    }

    fn on_failure(&self, peer: usize, seq: u64) {
        (**self).on_failure(peer, seq);
    }

    fn receive(&self, batch: Batch, now_us: u64) -> impl Future<Output = Result<Receipt, StoreError>> + Send {
        (**self).receive(batch, now_us)
    }
}

/// What receiving a batch did, for the transport's log and metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Receipt {
    /// The acknowledgement to send back.
    pub ack: Ack,
    /// The sender is not among this region's peers (merged anyway).
    pub unknown_sender: bool,
    /// The sender's incarnation changed since its last batch.
    pub sender_restarted: bool,
    /// The first key whose sender's limit differs from this region's, with
    /// how many did in this batch.
    pub mismatch: Option<(String, u64)>,
}

/// Where [`Region::next_batch_into`] hands each key of a batch.
pub trait BatchSink {
    /// One key: its fingerprint, shape and components.
    fn item(&mut self, key: &str, fingerprint: u64, shape: Shape, components: &[Component]);
}

impl<F: FnMut(&str, u64, Shape, &[Component])> BatchSink for F {
    fn item(&mut self, key: &str, fingerprint: u64, shape: Shape, components: &[Component]) {
        self(key, fingerprint, shape, components);
    }
}

/// A sink that keeps every key as an [`Item`]: with its [`BatchHead`], a
/// whole [`Batch`] ([`BatchHead::with_items`]), for callers that want one.
#[derive(Debug, Default)]
pub struct Items(pub Vec<Item>);

impl BatchSink for Items {
    fn item(&mut self, key: &str, fingerprint: u64, shape: Shape, components: &[Component]) {
        self.0.push(Item { key: key.to_owned(), fingerprint, shape, components: components.to_vec() });
    }
}

/// A batch's fields other than its keys (see [`Batch`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchHead {
    /// The sending region.
    pub from: String,
    /// The region names components refer to by index.
    pub regions: Vec<String>,
    /// The sender's incarnation.
    pub from_incarnation: u64,
    /// The receiver's incarnation as the sender knows it.
    pub to_incarnation: u64,
    /// The batch's number on its link.
    pub seq: u64,
    /// Keys handed to the sink.
    pub items: u64,
    /// The full state transfer is complete with this batch.
    pub complete: bool,
    /// The sender's record of incarnations (with a full state transfer).
    pub incarnations: Vec<Incarnation>,
}

impl BatchHead {
    /// The whole batch: this head and its keys (as [`Items`] kept them).
    pub fn with_items(self, items: Vec<Item>) -> Batch {
        Batch {
            from: self.from,
            regions: self.regions,
            from_incarnation: self.from_incarnation,
            to_incarnation: self.to_incarnation,
            seq: self.seq,
            items,
            complete: self.complete,
            incarnations: self.incarnations,
        }
    }
}
