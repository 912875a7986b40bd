//! A load's event stream (`KvTier.Load`), decoded: keys unpacked, timings converted.

use kvtier_core::BlockKey;

use crate::proto::{self, load_event::Event};
use crate::wire::{pack_keys, unpack_keys};
use crate::{ProtoError, WireTiming};

/// Which `LayerReady` events a load streams (`LoadRequest.layer_event_stride` / `done_only`).
/// Each one means "layers `0..=layer` are in their slots", so fewer events lose only
/// granularity: a one-block load of a 48-layer model is 49 messages at [`LayerEvents::EVERY`],
/// 2 at [`LayerEvents::DoneOnly`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerEvents {
    /// After layers `n-1`, `2n-1`, … and always after the last (`n` of 0 counts as 1).
    Every(u32),
    /// None: `BlocksMissing` (if any) and `LoadDone` only.
    DoneOnly,
}

impl LayerEvents {
    /// One event per layer: the default.
    pub const EVERY: LayerEvents = LayerEvents::Every(1);

    /// From the request's two fields.
    pub fn from_proto(layer_event_stride: u32, done_only: bool) -> Self {
        if done_only {
            LayerEvents::DoneOnly
        } else {
            LayerEvents::Every(layer_event_stride.max(1))
        }
    }

    /// The request's `(layer_event_stride, done_only)`.
    pub fn to_proto(self) -> (u32, bool) {
        match self {
            LayerEvents::Every(n) => (n.max(1), false),
            LayerEvents::DoneOnly => (0, true),
        }
    }

    /// Whether the event for `layer` (of `layers`) is sent.
    pub fn wants(self, layer: u32, layers: u32) -> bool {
        match self {
            LayerEvents::Every(n) => (layer + 1).is_multiple_of(n.max(1)) || layer + 1 == layers,
            LayerEvents::DoneOnly => false,
        }
    }
}

impl Default for LayerEvents {
    fn default() -> Self {
        LayerEvents::EVERY
    }
}

/// One event of a load's stream, in the order the sidecar sends them: blocks found in no tier
/// (at once, so the engine can start recomputing them), one `LayerReady` per layer, and last
/// `Done`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoadEvent {
    /// Every block of the load is in its slot for layers `0..=layer`.
    LayerReady {
        /// The layer that just finished.
        layer: u32,
    },
    /// Blocks that will not be loaded (in no tier, or a disk read failed): their slots are not
    /// written.
    Missing {
        /// Their keys.
        keys: Vec<BlockKey>,
    },
    /// The final report; nothing follows it.
    Done(LoadDone),
}

/// A load's final report.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadDone {
    /// Blocks copied into their slots (all layers).
    pub loaded_blocks: u32,
    /// Of those, blocks first read from disk into host memory.
    pub disk_blocks: u32,
    /// Of those, blocks first fetched from the remote tier into host memory.
    pub remote_blocks: u32,
    /// Requested blocks that were not loaded (the requester recomputes them).
    pub missing: Vec<BlockKey>,
    /// Bytes copied into the device pool.
    pub bytes: u64,
    /// When the copies ran (`None` from a sidecar that did not say).
    pub timing: Option<WireTiming>,
}

impl TryFrom<proto::LoadDone> for LoadDone {
    type Error = ProtoError;

    /// Allocates the missing keys.
    ///
    /// # Errors
    /// [`ProtoError::BadKeys`] for `done.missing`.
    fn try_from(d: proto::LoadDone) -> Result<Self, ProtoError> {
        Ok(LoadDone {
            loaded_blocks: d.loaded_blocks,
            disk_blocks: d.disk_blocks,
            remote_blocks: d.remote_blocks,
            missing: unpack_keys("done.missing", &d.missing)?,
            bytes: d.bytes,
            timing: d.timing.map(WireTiming::from),
        })
    }
}

impl From<LoadDone> for proto::LoadDone {
    fn from(d: LoadDone) -> Self {
        proto::LoadDone {
            loaded_blocks: d.loaded_blocks,
            disk_blocks: d.disk_blocks,
            remote_blocks: d.remote_blocks,
            missing: pack_keys(&d.missing),
            bytes: d.bytes,
            timing: d.timing.map(proto::TransferTiming::from),
        }
    }
}

impl TryFrom<Event> for LoadEvent {
    type Error = ProtoError;

    /// # Errors
    /// [`ProtoError::BadKeys`] for `missing.keys` or `done.missing`.
    fn try_from(e: Event) -> Result<Self, ProtoError> {
        Ok(match e {
            Event::LayerReady(l) => LoadEvent::LayerReady { layer: l.layer },
            Event::Missing(m) => LoadEvent::Missing {
                keys: unpack_keys("missing.keys", &m.keys)?,
            },
            Event::Done(d) => LoadEvent::Done(d.try_into()?),
        })
    }
}

impl LoadEvent {
    /// Decodes one message of the stream. `Ok(None)` for a message with no event set: that is
    /// how an event kind added to the proto after this build decodes, and it is skipped.
    ///
    /// # Errors
    /// As `LoadEvent::try_from(Event)`.
    pub fn from_proto(m: proto::LoadEvent) -> Result<Option<Self>, ProtoError> {
        m.event.map(LoadEvent::try_from).transpose()
    }
}

impl From<LoadEvent> for proto::LoadEvent {
    fn from(e: LoadEvent) -> Self {
        let event = match e {
            LoadEvent::LayerReady { layer } => Event::LayerReady(proto::LayerReady { layer }),
            LoadEvent::Missing { keys } => Event::Missing(proto::BlocksMissing {
                keys: pack_keys(&keys),
            }),
            LoadEvent::Done(d) => Event::Done(d.into()),
        };
        proto::LoadEvent { event: Some(event) }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    #[test]
    fn layer_events_every_n_always_end_with_the_last_layer() {
        let sent =
            |e: LayerEvents, layers: u32| (0..layers).filter(|&l| e.wants(l, layers)).collect::<Vec<_>>();
        assert_eq!(sent(LayerEvents::EVERY, 4), vec![0, 1, 2, 3]);
        assert_eq!(sent(LayerEvents::Every(0), 3), vec![0, 1, 2], "0 counts as 1");
        assert_eq!(sent(LayerEvents::Every(4), 10), vec![3, 7, 9]);
        assert_eq!(sent(LayerEvents::Every(4), 48).len(), 12);
        assert_eq!(sent(LayerEvents::Every(100), 48), vec![47]);
        assert!(sent(LayerEvents::DoneOnly, 48).is_empty());
        for e in [LayerEvents::EVERY, LayerEvents::Every(6), LayerEvents::DoneOnly] {
            let (stride, done_only) = e.to_proto();
            assert_eq!(LayerEvents::from_proto(stride, done_only), e);
        }
    }

    use super::*;

    fn keys(n: u128) -> Vec<BlockKey> {
        (1..=n).map(|i| BlockKey(i * 0x1_0000_0001)).collect()
    }

    #[test]
    fn events_round_trip() {
        let done = LoadDone {
            loaded_blocks: 7,
            disk_blocks: 2,
            remote_blocks: 1,
            missing: keys(3),
            bytes: 7 << 20,
            timing: Some(WireTiming {
                queue: Duration::from_micros(10),
                latency: Duration::from_micros(900),
                span: Duration::from_micros(890),
                active: Duration::from_micros(1_700),
            }),
        };
        for e in [
            LoadEvent::LayerReady { layer: 5 },
            LoadEvent::Missing { keys: keys(4) },
            LoadEvent::Missing { keys: Vec::new() },
            LoadEvent::Done(done),
            LoadEvent::Done(LoadDone::default()),
        ] {
            let p = proto::LoadEvent::from(e.clone());
            assert_eq!(LoadEvent::from_proto(p).unwrap(), Some(e));
        }
    }

    #[test]
    fn empty_events_are_skipped_and_bad_keys_name_their_field() {
        assert_eq!(
            LoadEvent::from_proto(proto::LoadEvent { event: None }).unwrap(),
            None
        );
        let bad = |event| LoadEvent::from_proto(proto::LoadEvent { event: Some(event) }).unwrap_err();
        assert_eq!(
            bad(Event::Missing(proto::BlocksMissing {
                keys: vec![0u8; 17].into()
            })),
            ProtoError::BadKeys {
                field: "missing.keys",
                len: 17
            }
        );
        assert_eq!(
            bad(Event::Done(proto::LoadDone {
                missing: vec![0u8; 31].into(),
                ..Default::default()
            }))
            .to_string(),
            "done.missing: 31 bytes is not a whole number of 16-byte block keys"
        );
    }
}
