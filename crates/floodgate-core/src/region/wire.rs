//! What regions send each other, independent of the transport: a batch of
//! per-key components and its acknowledgement.
//!
//! Every value is state, never a delta: a component is the count one
//! region's incarnation took for one key in one slot and the count it gave
//! back (refunds), each never decreasing, and a receiver keeps the largest
//! of each it has seen. A lost batch is healed by the next one; a
//! duplicated, replayed or reordered one changes nothing.

pub use crate::region::incarnations::Incarnation;

/// One region's count for one key in one slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Component {
    /// The region that admitted the hits: an index into the batch's
    /// [`Batch::regions`].
    pub region: u32,
    /// Its incarnation (a region that restarts with its state lost takes a
    /// new one).
    pub incarnation: u64,
    /// The slot: a window or bucket id for the window algorithms; for the
    /// GCRA family, `floor(time / slot_us)`.
    pub slot: u64,
    /// Hits taken (admitted, and charged after the work), never decreasing
    /// within a slot.
    pub count: u64,
    /// Hits given back (refunds) in the slot, never decreasing: the
    /// component counts `count - back` (never below zero). The window
    /// algorithms give back no more than the region took in the slot; the
    /// GCRA family records its refunds in the slot they were made in.
    pub back: u64,
}

/// What kind of counts a key carries, so a receiver that does not know the
/// rule yet can keep and expire them, and one that does can tell whether
/// they mean the same as its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Shape {
    /// Counts per window or bucket, summed over the last `horizon` slots of
    /// `slot_us` microseconds.
    Windowed {
        /// Slot length.
        slot_us: u64,
        /// Slots that count toward a decision.
        horizon: u32,
    },
    /// The GCRA family: counts per slot of `slot_us` (a quarter of the full
    /// refill time), turned into debt on arrival.
    Gcra {
        /// Slot length.
        slot_us: u64,
    },
}

impl Shape {
    /// Slot length in microseconds.
    pub fn slot_us(self) -> u64 {
        match self {
            Shape::Windowed { slot_us, .. } | Shape::Gcra { slot_us } => slot_us,
        }
    }

    /// Slots kept: the ones a decision reads (the GCRA family: a slot is a
    /// quarter of the refill time, and a hit's debt has drained a refill
    /// time after its slot ends: six).
    pub fn horizon(self) -> u64 {
        match self {
            Shape::Windowed { horizon, .. } => u64::from(horizon),
            Shape::Gcra { .. } => 6,
        }
    }
}

/// One key's components in a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Item {
    /// The counter key.
    pub key: String,
    /// The sender's limit fingerprint ([`crate::region::fingerprint`]): a
    /// receiver whose rule differs counts and reports the mismatch, and
    /// enforces its own limit.
    pub fingerprint: u64,
    /// What the counts mean.
    pub shape: Shape,
    /// The components: the sender's own, or (in a full state transfer)
    /// every one it holds.
    pub components: Vec<Component>,
}

/// A batch from one region to one peer.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Batch {
    /// The sending region.
    pub from: String,
    /// The region names the components refer to, by index (sent once per
    /// batch, not once per component).
    pub regions: Vec<String>,
    /// The sender's incarnation.
    pub from_incarnation: u64,
    /// The receiver's incarnation as the sender last heard it (0: unknown).
    pub to_incarnation: u64,
    /// The batch's number on this sender's link to this receiver; the
    /// acknowledgement names it.
    pub seq: u64,
    /// Keys and their components.
    pub items: Vec<Item>,
    /// With this batch the receiver (at `to_incarnation`) holds every
    /// component the sender held when it learned that incarnation: a
    /// restarted region admits beyond its slice only once every peer has
    /// sent it this.
    pub complete: bool,
    /// The sender's record of incarnations (sent with a full state
    /// transfer): what a restarted region must charge for the dead ones.
    pub incarnations: Vec<Incarnation>,
}

/// The receiver's answer to a batch: every component in it is stored in
/// the receiving region.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Ack {
    /// The receiving region.
    pub region: String,
    /// Its incarnation (a new one asks the sender for its full state).
    pub incarnation: u64,
    /// The batch acknowledged.
    pub seq: u64,
    /// The incarnation of the batch's sender the batch came from (0: not
    /// said, as by an older peer): an acknowledgement that reaches a later
    /// incarnation of the sender (it restarted meanwhile) confirms nothing.
    pub for_incarnation: u64,
}
