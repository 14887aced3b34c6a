//! The wire messages of `floodgate.sync.v1.Sync/Push`, written by hand
//! (prost derives; no protoc, no build script), and their checked
//! conversion to and from [`floodgate_core::region`]'s types.
//!
//! ```proto
//! service Sync { rpc Push(SyncBatch) returns (SyncAck); }
//! message SyncBatch { string from = 1; uint64 from_incarnation = 2; uint64 to_incarnation = 3;
//!                     uint64 seq = 4; repeated SyncItem items = 5; bool complete = 6;
//!                     repeated string regions = 7; repeated SyncIncarnation incarnations = 8; }
//! message SyncItem  { string key = 1; uint64 fingerprint = 2; uint32 kind = 3; uint64 slot_us = 4;
//!                     uint32 horizon = 5; repeated SyncComponent components = 6; }
//! message SyncComponent { uint32 region = 1; uint64 incarnation = 2; uint64 slot = 3; uint64 count = 4;
//!                         uint64 back = 5; }
//! message SyncIncarnation { uint32 region = 1; uint64 incarnation = 2; uint64 recorded_us = 3;
//!                           uint64 dead_us = 4; uint64 count = 5; }
//! // region: an index into the batch's regions
//! message SyncAck   { string region = 1; uint64 incarnation = 2; uint64 seq = 3; uint64 for_incarnation = 4; }
//! ```

use floodgate_core::region::{Ack, Batch, Component, Incarnation, Item, Shape};

/// A batch on the wire.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SyncBatch {
    /// The sending region.
    #[prost(string, tag = "1")]
    pub from: String,
    /// Its incarnation.
    #[prost(uint64, tag = "2")]
    pub from_incarnation: u64,
    /// The receiver's incarnation as the sender knows it (0: unknown).
    #[prost(uint64, tag = "3")]
    pub to_incarnation: u64,
    /// The batch's number on this link.
    #[prost(uint64, tag = "4")]
    pub seq: u64,
    /// Keys and their components.
    #[prost(message, repeated, tag = "5")]
    pub items: Vec<SyncItem>,
    /// The sender's full state is complete with this batch.
    #[prost(bool, tag = "6")]
    pub complete: bool,
    /// The region names components refer to by index.
    #[prost(string, repeated, tag = "7")]
    pub regions: Vec<String>,
    /// The sender's record of incarnations (with a full state transfer;
    /// an older sender sends none).
    #[prost(message, repeated, tag = "8")]
    pub incarnations: Vec<SyncIncarnation>,
}

/// One incarnation of one region, in a sender's record.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SyncIncarnation {
    /// The region: an index into the batch's `regions`.
    #[prost(uint32, tag = "1")]
    pub region: u32,
    /// The incarnation.
    #[prost(uint64, tag = "2")]
    pub incarnation: u64,
    /// When the sender recorded it, µs since the epoch (0: not known).
    #[prost(uint64, tag = "3")]
    pub recorded_us: u64,
    /// When the sender learned of a later one (0: alive).
    #[prost(uint64, tag = "4")]
    pub dead_us: u64,
    /// Dead incarnations the record stands for (at least 1).
    #[prost(uint64, tag = "5")]
    pub count: u64,
}

/// One key on the wire.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SyncItem {
    /// The counter key.
    #[prost(string, tag = "1")]
    pub key: String,
    /// The sender's limit fingerprint.
    #[prost(uint64, tag = "2")]
    pub fingerprint: u64,
    /// 1: window counts; 2: the GCRA family.
    #[prost(uint32, tag = "3")]
    pub kind: u32,
    /// Slot length, µs.
    #[prost(uint64, tag = "4")]
    pub slot_us: u64,
    /// Slots that count (window counts).
    #[prost(uint32, tag = "5")]
    pub horizon: u32,
    /// The components.
    #[prost(message, repeated, tag = "6")]
    pub components: Vec<SyncComponent>,
}

/// One component on the wire.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SyncComponent {
    /// The region that admitted the hits: an index into the batch's
    /// `regions`.
    #[prost(uint32, tag = "1")]
    pub region: u32,
    /// Its incarnation.
    #[prost(uint64, tag = "2")]
    pub incarnation: u64,
    /// The slot.
    #[prost(uint64, tag = "3")]
    pub slot: u64,
    /// Hits taken.
    #[prost(uint64, tag = "4")]
    pub count: u64,
    /// Hits given back (0 from a peer built before refunds crossed regions:
    /// it keeps what it was sent until the slot ends, as it did).
    #[prost(uint64, tag = "5")]
    pub back: u64,
}

/// An acknowledgement on the wire.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SyncAck {
    /// The receiving region.
    #[prost(string, tag = "1")]
    pub region: String,
    /// Its incarnation.
    #[prost(uint64, tag = "2")]
    pub incarnation: u64,
    /// The batch acknowledged.
    #[prost(uint64, tag = "3")]
    pub seq: u64,
    /// The incarnation of the sender the batch came from (0: not said).
    #[prost(uint64, tag = "4")]
    pub for_incarnation: u64,
}

/// Bounds on what a peer may send in one batch.
pub mod limits {
    /// Most keys per batch.
    pub const MAX_ITEMS: usize = 10_000;
    /// Longest counter key, bytes.
    pub const MAX_KEY: usize = 4_096;
    /// Most components per key.
    pub const MAX_COMPONENTS: usize = 4_096;
    /// Most region names per batch.
    pub const MAX_REGIONS: usize = 1_024;
    /// Most incarnation records per batch (a sender folds its dead ones
    /// beyond [`floodgate_core::region::MAX_DEAD`]).
    pub const MAX_INCARNATIONS: usize = 4 * floodgate_core::region::MAX_DEAD;
    /// Longest region name, bytes.
    pub const MAX_NAME: usize = 64;
    /// Most slots a window key may count (the largest granularity).
    pub const MAX_HORIZON: u32 = floodgate_core::MAX_GRANULARITY;
    /// Largest encoded batch, bytes.
    pub const MAX_MESSAGE: usize = 16 << 20;
}

fn name_ok(n: &str) -> bool {
    !n.is_empty() && n.len() <= limits::MAX_NAME && !n.chars().any(|c| c.is_whitespace() || c.is_control())
}

impl SyncBatch {
    /// From the core type (moved: keys and names are not copied).
    pub fn from_batch(b: Batch) -> Self {
        SyncBatch {
            from: b.from,
            regions: b.regions,
            from_incarnation: b.from_incarnation,
            to_incarnation: b.to_incarnation,
            seq: b.seq,
            items: b
                .items
                .into_iter()
                .map(|i| {
                    let (kind, slot_us, horizon) = match i.shape {
                        Shape::Windowed { slot_us, horizon } => (1, slot_us, horizon),
                        Shape::Gcra { slot_us } => (2, slot_us, 0),
                    };
                    SyncItem {
                        key: i.key,
                        fingerprint: i.fingerprint,
                        kind,
                        slot_us,
                        horizon,
                        components: i
                            .components
                            .into_iter()
                            .map(|c| SyncComponent {
                                region: c.region,
                                incarnation: c.incarnation,
                                slot: c.slot,
                                count: c.count,
                                back: c.back,
                            })
                            .collect(),
                    }
                })
                .collect(),
            complete: b.complete,
            incarnations: b.incarnations.iter().map(SyncIncarnation::from_record).collect(),
        }
    }

    /// To the core type, checked: what is wrong, with where, for a peer's
    /// `INVALID_ARGUMENT`.
    pub fn into_batch(self) -> Result<Batch, InvalidBatch> {
        if !name_ok(&self.from) {
            return Err(InvalidBatch(format!(
                "from: region name {:?}: 1 to {} characters, no spaces",
                truncate(&self.from),
                limits::MAX_NAME
            )));
        }
        if self.regions.len() > limits::MAX_REGIONS {
            return Err(InvalidBatch(format!(
                "regions: {} names, at most {}",
                self.regions.len(),
                limits::MAX_REGIONS
            )));
        }
        if let Some((i, n)) = self.regions.iter().enumerate().find(|(_, n)| !name_ok(n)) {
            return Err(InvalidBatch(format!(
                "regions[{i}]: region name {:?}: 1 to {} characters, no spaces",
                truncate(n),
                limits::MAX_NAME
            )));
        }
        if self.items.len() > limits::MAX_ITEMS {
            return Err(InvalidBatch(format!(
                "items: {} in one batch, at most {}",
                self.items.len(),
                limits::MAX_ITEMS
            )));
        }
        let mut items = Vec::with_capacity(self.items.len());
        for (i, item) in self.items.into_iter().enumerate() {
            let at = |f: &str| format!("items[{i}].{f}");
            if item.key.is_empty() || item.key.len() > limits::MAX_KEY {
                return Err(InvalidBatch(format!("{}: 1 to {} bytes", at("key"), limits::MAX_KEY)));
            }
            if item.slot_us == 0 {
                return Err(InvalidBatch(format!("{}: must be at least 1", at("slot_us"))));
            }
            let shape = match item.kind {
                1 if (1..=limits::MAX_HORIZON).contains(&item.horizon) => {
                    Shape::Windowed { slot_us: item.slot_us, horizon: item.horizon }
                }
                1 => return Err(InvalidBatch(format!("{}: 1 to {}", at("horizon"), limits::MAX_HORIZON))),
                2 => Shape::Gcra { slot_us: item.slot_us },
                k => {
                    return Err(InvalidBatch(format!("{}: {k} is not a kind (1: window counts, 2: gcra)", at("kind"))));
                }
            };
            if item.components.len() > limits::MAX_COMPONENTS {
                return Err(InvalidBatch(format!(
                    "{}: {} components, at most {}",
                    at("components"),
                    item.components.len(),
                    limits::MAX_COMPONENTS
                )));
            }
            let mut components = Vec::with_capacity(item.components.len());
            for (j, c) in item.components.into_iter().enumerate() {
                if c.region as usize >= self.regions.len() {
                    return Err(InvalidBatch(format!(
                        "{}: {} is not an index into regions ({} names)",
                        at(&format!("components[{j}].region")),
                        c.region,
                        self.regions.len()
                    )));
                }
                components.push(Component {
                    region: c.region,
                    incarnation: c.incarnation,
                    slot: c.slot,
                    count: c.count,
                    back: c.back,
                });
            }
            items.push(Item { key: item.key, fingerprint: item.fingerprint, shape, components });
        }
        if self.incarnations.len() > limits::MAX_INCARNATIONS {
            return Err(InvalidBatch(format!(
                "incarnations: {} records, at most {}",
                self.incarnations.len(),
                limits::MAX_INCARNATIONS
            )));
        }
        let mut incarnations = Vec::with_capacity(self.incarnations.len());
        for (i, r) in self.incarnations.into_iter().enumerate() {
            if r.region as usize >= self.regions.len() {
                return Err(InvalidBatch(format!(
                    "incarnations[{i}].region: {} is not an index into regions ({} names)",
                    r.region,
                    self.regions.len()
                )));
            }
            if r.count == 0 {
                return Err(InvalidBatch(format!("incarnations[{i}].count: must be at least 1")));
            }
            if r.dead_us != 0 && r.recorded_us > r.dead_us {
                return Err(InvalidBatch(format!(
                    "incarnations[{i}]: recorded_us {} after dead_us {}: a record ends after it starts",
                    r.recorded_us, r.dead_us
                )));
            }
            incarnations.push(Incarnation {
                region: r.region,
                incarnation: r.incarnation,
                recorded_us: r.recorded_us,
                dead_us: r.dead_us,
                count: r.count,
            });
        }
        Ok(Batch {
            from: self.from,
            regions: self.regions,
            from_incarnation: self.from_incarnation,
            to_incarnation: self.to_incarnation,
            seq: self.seq,
            items,
            complete: self.complete,
            incarnations,
        })
    }
}

impl SyncIncarnation {
    /// From the core type.
    pub fn from_record(r: &Incarnation) -> Self {
        SyncIncarnation {
            region: r.region,
            incarnation: r.incarnation,
            recorded_us: r.recorded_us,
            dead_us: r.dead_us,
            count: r.count,
        }
    }
}

impl SyncAck {
    /// From the core type.
    pub fn from_ack(a: &Ack) -> Self {
        SyncAck { region: a.region.clone(), incarnation: a.incarnation, seq: a.seq, for_incarnation: a.for_incarnation }
    }

    /// To the core type.
    pub fn into_ack(self) -> Ack {
        Ack { region: self.region, incarnation: self.incarnation, seq: self.seq, for_incarnation: self.for_incarnation }
    }
}

fn truncate(s: &str) -> &str {
    match s.char_indices().nth(64) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

/// What is wrong with a peer's batch, and where (a field path such as
/// `items[3].kind`): the peer gets it as `INVALID_ARGUMENT`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidBatch(pub String);

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    #[test]
    fn batches_round_trip_and_bad_ones_say_what_is_wrong() {
        let b = Batch {
            from: "eu".into(),
            regions: vec!["eu".into()],
            from_incarnation: 7,
            to_incarnation: 9,
            seq: 3,
            items: vec![Item {
                key: "api|user=alice#0".into(),
                fingerprint: 42,
                shape: Shape::Windowed { slot_us: 60_000_000, horizon: 1 },
                components: vec![Component { region: 0, incarnation: 7, slot: 28_333_380, count: 5, back: 2 }],
            }],
            complete: true,
            incarnations: vec![Incarnation { region: 0, incarnation: 5, recorded_us: 10, dead_us: 20, count: 1 }],
        };
        let wire = SyncBatch::from_batch(b.clone()).encode_to_vec();
        assert_eq!(SyncBatch::decode(&wire[..]).unwrap().into_batch().unwrap(), b);

        let bad = |f: &dyn Fn(&mut SyncBatch)| {
            let mut m = SyncBatch::from_batch(b.clone());
            f(&mut m);
            m.into_batch().unwrap_err().0
        };
        assert!(bad(&|m| m.from = String::new()).starts_with("from:"));
        assert!(bad(&|m| m.items[0].kind = 9).contains("items[0].kind: 9 is not a kind"));
        assert!(bad(&|m| m.items[0].horizon = 0).contains("items[0].horizon"));
        assert!(bad(&|m| m.items[0].slot_us = 0).contains("items[0].slot_us"));
        assert!(bad(&|m| m.items[0].key = "k".repeat(5_000)).contains("items[0].key"));
        assert!(bad(&|m| m.items[0].components[0].region = 3).contains("components[0].region: 3 is not an index"));
        assert!(bad(&|m| m.regions[0] = "a b".into()).contains("regions[0]"));
        assert!(bad(&|m| m.incarnations[0].region = 1).contains("incarnations[0].region: 1 is not an index"));
        assert!(bad(&|m| m.incarnations[0].count = 0).contains("incarnations[0].count"));
        assert!(bad(&|m| m.incarnations[0].recorded_us = 30).contains("incarnations[0]: recorded_us 30 after"));
        // Garbage bytes are a decode error, not a panic.
        assert!(SyncBatch::decode(&[0xff, 0xff, 0xff][..]).is_err());
    }
}

/// A message already encoded (a batch written straight from a region's
/// table by [`BatchEncoder`]): sent as is.
#[derive(Clone, PartialEq, Default)]
pub struct Encoded(pub Vec<u8>);

impl std::fmt::Debug for Encoded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Encoded({} bytes)", self.0.len())
    }
}

impl prost::Message for Encoded {
    fn encode_raw(&self, buf: &mut impl bytes::BufMut) {
        buf.put_slice(&self.0);
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: prost::encoding::WireType,
        buf: &mut impl bytes::Buf,
        ctx: prost::encoding::DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        // Never decoded: only sent.
        prost::encoding::skip_field(wire_type, tag, buf, ctx)
    }

    fn encoded_len(&self) -> usize {
        self.0.len()
    }

    fn clear(&mut self) {
        self.0.clear();
    }
}

/// Writes a [`SyncBatch`]'s bytes as a region's table hands it the keys
/// ([`floodgate_core::region::BatchSink`]): no per-key strings or vectors.
/// Protobuf fields may come in any order, so the keys go first and the
/// batch's other fields last ([`BatchEncoder::finish`]).
#[derive(Debug, Default)]
pub struct BatchEncoder {
    buf: Vec<u8>,
}

mod wire {
    use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint};

    pub(super) fn varint_field_len(tag: u32, v: u64) -> usize {
        if v == 0 { 0 } else { prost::encoding::key_len(tag) + encoded_len_varint(v) }
    }

    pub(super) fn varint_field(tag: u32, v: u64, buf: &mut Vec<u8>) {
        if v != 0 {
            encode_key(tag, WireType::Varint, buf);
            encode_varint(v, buf);
        }
    }

    pub(super) fn len_field_len(tag: u32, len: usize) -> usize {
        prost::encoding::key_len(tag) + encoded_len_varint(len as u64) + len
    }

    pub(super) fn len_head(tag: u32, len: usize, buf: &mut Vec<u8>) {
        encode_key(tag, WireType::LengthDelimited, buf);
        encode_varint(len as u64, buf);
    }
}

impl floodgate_core::region::BatchSink for BatchEncoder {
    fn item(&mut self, key: &str, fingerprint: u64, shape: Shape, components: &[Component]) {
        use wire::*;
        let (kind, slot_us, horizon) = match shape {
            Shape::Windowed { slot_us, horizon } => (1u64, slot_us, u64::from(horizon)),
            Shape::Gcra { slot_us } => (2, slot_us, 0),
        };
        let comp_len = |c: &Component| {
            varint_field_len(1, u64::from(c.region))
                + varint_field_len(2, c.incarnation)
                + varint_field_len(3, c.slot)
                + varint_field_len(4, c.count)
                + varint_field_len(5, c.back)
        };
        let item_len = len_field_len(1, key.len())
            + varint_field_len(2, fingerprint)
            + varint_field_len(3, kind)
            + varint_field_len(4, slot_us)
            + varint_field_len(5, horizon)
            + components.iter().map(|c| len_field_len(6, comp_len(c))).sum::<usize>();
        let b = &mut self.buf;
        len_head(5, item_len, b);
        len_head(1, key.len(), b);
        b.extend_from_slice(key.as_bytes());
        varint_field(2, fingerprint, b);
        varint_field(3, kind, b);
        varint_field(4, slot_us, b);
        varint_field(5, horizon, b);
        for c in components {
            len_head(6, comp_len(c), b);
            varint_field(1, u64::from(c.region), b);
            varint_field(2, c.incarnation, b);
            varint_field(3, c.slot, b);
            varint_field(4, c.count, b);
            varint_field(5, c.back, b);
        }
    }
}

impl BatchEncoder {
    /// The whole message: the keys written so far, then `head`'s fields.
    pub fn finish(mut self, head: &floodgate_core::region::BatchHead) -> Encoded {
        use wire::*;
        let b = &mut self.buf;
        len_head(1, head.from.len(), b);
        b.extend_from_slice(head.from.as_bytes());
        varint_field(2, head.from_incarnation, b);
        varint_field(3, head.to_incarnation, b);
        varint_field(4, head.seq, b);
        varint_field(6, u64::from(head.complete), b);
        for r in &head.regions {
            len_head(7, r.len(), b);
            b.extend_from_slice(r.as_bytes());
        }
        for r in &head.incarnations {
            let len = varint_field_len(1, u64::from(r.region))
                + varint_field_len(2, r.incarnation)
                + varint_field_len(3, r.recorded_us)
                + varint_field_len(4, r.dead_us)
                + varint_field_len(5, r.count);
            len_head(8, len, b);
            varint_field(1, u64::from(r.region), b);
            varint_field(2, r.incarnation, b);
            varint_field(3, r.recorded_us, b);
            varint_field(4, r.dead_us, b);
            varint_field(5, r.count, b);
        }
        Encoded(self.buf)
    }
}

#[cfg(test)]
mod encoder_tests {
    use super::*;
    use floodgate_core::region::BatchSink;
    use prost::Message;

    #[test]
    fn the_direct_encoding_decodes_as_the_message() {
        let items = [
            (
                "api|user=alice#0",
                42u64,
                Shape::Windowed { slot_us: 60_000_000, horizon: 1 },
                vec![
                    Component { region: 0, incarnation: 7, slot: 28_333_380, count: 5, back: 2 },
                    Component { region: 2, incarnation: 0, slot: 0, count: 0, back: 0 },
                ],
            ),
            ("k", 0, Shape::Gcra { slot_us: 250_000 }, vec![]),
        ];
        let mut enc = BatchEncoder::default();
        for (k, fp, shape, comps) in &items {
            enc.item(k, *fp, *shape, comps);
        }
        let head = floodgate_core::region::BatchHead {
            from: "eu".into(),
            regions: vec!["eu".into(), "us".into(), "ap".into()],
            from_incarnation: 7,
            to_incarnation: 0,
            seq: 12,
            items: 2,
            complete: true,
            incarnations: vec![
                Incarnation { region: 1, incarnation: 3, recorded_us: 0, dead_us: 9, count: 2 },
                Incarnation { region: 0, incarnation: 7, recorded_us: 1, dead_us: 0, count: 1 },
            ],
        };
        let bytes = enc.finish(&head).0;
        let got = SyncBatch::decode(&bytes[..]).unwrap().into_batch().unwrap();
        assert_eq!(got.from, "eu");
        assert_eq!((got.from_incarnation, got.to_incarnation, got.seq, got.complete), (7, 0, 12, true));
        assert_eq!(got.regions, head.regions);
        assert_eq!(got.incarnations, head.incarnations);
        assert_eq!(got.items.len(), 2);
        assert_eq!(got.items[0].key, "api|user=alice#0");
        assert_eq!(got.items[0].components, items[0].3);
        assert_eq!(got.items[1].shape, Shape::Gcra { slot_us: 250_000 });
        // The same bytes prost writes for the same message.
        let via_prost = SyncBatch::decode(&bytes[..]).unwrap();
        assert_eq!(SyncBatch::decode(&via_prost.encode_to_vec()[..]).unwrap(), via_prost);
    }
}
