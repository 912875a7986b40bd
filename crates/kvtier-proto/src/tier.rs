//! Tiers on the wire, and the typed replies that name them (`Match`, `Store`).

use kvtier_core::{BlockKey, Tier};

use crate::wire::{pack_keys, unpack_keys};
use crate::{ProtoError, WireTiming, proto};

impl From<Tier> for proto::Tier {
    fn from(t: Tier) -> Self {
        match t {
            Tier::Device => proto::Tier::Device,
            Tier::Host => proto::Tier::Host,
            Tier::Disk => proto::Tier::Disk,
            Tier::Remote => proto::Tier::Remote,
        }
    }
}

/// The tier of the wire value `value` of `field`, where `TIER_UNSPECIFIED` means "every tier"
/// (`None`), as `Clear` reads it.
///
/// # Errors
/// [`ProtoError::UnknownEnum`] for a value this build does not know.
pub fn tier_filter_from_proto(field: &'static str, value: i32) -> Result<Option<Tier>, ProtoError> {
    match proto::Tier::try_from(value) {
        Ok(proto::Tier::Unspecified) => Ok(None),
        Ok(proto::Tier::Device) => Ok(Some(Tier::Device)),
        Ok(proto::Tier::Host) => Ok(Some(Tier::Host)),
        Ok(proto::Tier::Disk) => Ok(Some(Tier::Disk)),
        Ok(proto::Tier::Remote) => Ok(Some(Tier::Remote)),
        Err(_) => Err(ProtoError::UnknownEnum {
            field,
            kind: "tier",
            value,
        }),
    }
}

/// The tier of the wire value `value` of `field`, which must name one.
///
/// # Errors
/// [`ProtoError::UnknownEnum`] for `TIER_UNSPECIFIED` or a value this build does not know.
pub fn tier_from_proto(field: &'static str, value: i32) -> Result<Tier, ProtoError> {
    tier_filter_from_proto(field, value)?.ok_or(ProtoError::UnknownEnum {
        field,
        kind: "tier",
        value,
    })
}

/// One leading block a `Match` found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatchedBlock {
    /// Where it is.
    pub tier: Tier,
    /// Its slot in the pool, when `tier` is [`Tier::Device`].
    pub device_slot: Option<u32>,
}

/// A `Match` reply, decoded.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MatchReply {
    /// The leading blocks found, in order; the first block in no tier ends the list.
    pub blocks: Vec<MatchedBlock>,
    /// Their keys when the request gave token ids (the sidecar hashed them); empty otherwise.
    pub keys: Vec<BlockKey>,
    /// Tokens of the blocks found.
    pub matched_tokens: u64,
    /// Of those, on the device.
    pub device_tokens: u64,
    /// In host memory.
    pub host_tokens: u64,
    /// On disk only.
    pub disk_tokens: u64,
    /// In the remote tier only.
    pub remote_tokens: u64,
}

impl MatchReply {
    /// The reply for `blocks` found, of `block_tokens` tokens each, with their `keys` when the
    /// sidecar hashed them: the per-tier token counts follow from the blocks.
    pub fn new(blocks: Vec<MatchedBlock>, keys: Vec<BlockKey>, block_tokens: u32) -> Self {
        let bt = u64::from(block_tokens);
        let tokens = |t: Tier| blocks.iter().filter(|b| b.tier == t).count() as u64 * bt;
        Self {
            matched_tokens: blocks.len() as u64 * bt,
            device_tokens: tokens(Tier::Device),
            host_tokens: tokens(Tier::Host),
            disk_tokens: tokens(Tier::Disk),
            remote_tokens: tokens(Tier::Remote),
            blocks,
            keys,
        }
    }

    /// The tier of each block found.
    pub fn tiers(&self) -> impl Iterator<Item = Tier> + '_ {
        self.blocks.iter().map(|b| b.tier)
    }
}

impl From<MatchReply> for proto::MatchResponse {
    fn from(r: MatchReply) -> Self {
        proto::MatchResponse {
            tiers: r
                .blocks
                .iter()
                .map(|b| proto::Tier::from(b.tier) as i32)
                .collect(),
            device_slots: r.blocks.iter().map(|b| b.device_slot.unwrap_or(0)).collect(),
            keys: pack_keys(&r.keys),
            matched_tokens: r.matched_tokens,
            device_tokens: r.device_tokens,
            host_tokens: r.host_tokens,
            disk_tokens: r.disk_tokens,
            remote_tokens: r.remote_tokens,
        }
    }
}

impl TryFrom<proto::MatchResponse> for MatchReply {
    type Error = ProtoError;

    /// # Errors
    /// [`ProtoError::UnknownEnum`] for a tier this build does not know (`tiers[]`),
    /// [`ProtoError::BadKeys`] for `keys`.
    fn try_from(r: proto::MatchResponse) -> Result<Self, ProtoError> {
        let blocks = r
            .tiers
            .iter()
            .enumerate()
            .map(|(i, &t)| {
                let tier = tier_from_proto("tiers[]", t)?;
                let device_slot = (tier == Tier::Device).then(|| r.device_slots.get(i).copied().unwrap_or(0));
                Ok(MatchedBlock { tier, device_slot })
            })
            .collect::<Result<_, ProtoError>>()?;
        Ok(Self {
            blocks,
            keys: unpack_keys("keys", &r.keys)?,
            matched_tokens: r.matched_tokens,
            device_tokens: r.device_tokens,
            host_tokens: r.host_tokens,
            disk_tokens: r.disk_tokens,
            remote_tokens: r.remote_tokens,
        })
    }
}

/// A `Store` reply, decoded: what was stored and when the copies ran.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreReply {
    /// Blocks copied into the host tier.
    pub stored_blocks: u32,
    /// Blocks the host tier already held (not copied again).
    pub already_stored: u32,
    /// Blocks dropped for lack of host memory (counted as dropped stores).
    pub no_space: Vec<BlockKey>,
    /// Bytes copied out of the device pool.
    pub bytes: u64,
    /// When the copies ran (`None` from a sidecar that did not say).
    pub timing: Option<WireTiming>,
    /// A durable store: the request's blocks now on disk and fdatasynced.
    pub durable_blocks: u32,
    /// A durable store: the request's blocks that are not (see the proto's `not_durable`).
    pub not_durable: Vec<BlockKey>,
}

impl From<StoreReply> for proto::StoreResponse {
    fn from(r: StoreReply) -> Self {
        proto::StoreResponse {
            stored_blocks: r.stored_blocks,
            already_stored: r.already_stored,
            no_space: pack_keys(&r.no_space),
            bytes: r.bytes,
            timing: r.timing.map(Into::into),
            durable_blocks: r.durable_blocks,
            not_durable: pack_keys(&r.not_durable),
        }
    }
}

impl TryFrom<proto::StoreResponse> for StoreReply {
    type Error = ProtoError;

    /// # Errors
    /// [`ProtoError::BadKeys`] for `no_space` or `not_durable`.
    fn try_from(r: proto::StoreResponse) -> Result<Self, ProtoError> {
        Ok(Self {
            stored_blocks: r.stored_blocks,
            already_stored: r.already_stored,
            no_space: unpack_keys("no_space", &r.no_space)?,
            bytes: r.bytes,
            timing: r.timing.map(WireTiming::from),
            durable_blocks: r.durable_blocks,
            not_durable: unpack_keys("not_durable", &r.not_durable)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiers_round_trip_and_unspecified_is_every_tier_or_an_error() {
        for t in Tier::ALL {
            let v = proto::Tier::from(t) as i32;
            assert_eq!(tier_from_proto("tier", v), Ok(t));
        }
        assert_eq!(tier_filter_from_proto("tier", 0), Ok(None));
        assert!(matches!(
            tier_from_proto("tiers[]", 0),
            Err(ProtoError::UnknownEnum { field: "tiers[]", .. })
        ));
        assert!(tier_filter_from_proto("tier", 99).is_err());
    }

    #[test]
    fn match_replies_round_trip_with_token_counts() {
        let key = BlockKey::from_le_bytes([7; 16]);
        let blocks = vec![
            MatchedBlock {
                tier: Tier::Device,
                device_slot: Some(3),
            },
            MatchedBlock {
                tier: Tier::Disk,
                device_slot: None,
            },
            MatchedBlock {
                tier: Tier::Remote,
                device_slot: None,
            },
        ];
        let r = MatchReply::new(blocks, vec![key, key, key], 16);
        assert_eq!(
            (
                r.matched_tokens,
                r.device_tokens,
                r.host_tokens,
                r.disk_tokens,
                r.remote_tokens
            ),
            (48, 16, 0, 16, 16)
        );
        let back = MatchReply::try_from(proto::MatchResponse::from(r.clone())).unwrap();
        assert_eq!(back, r);
        let bad = proto::MatchResponse {
            tiers: vec![42],
            ..Default::default()
        };
        assert!(MatchReply::try_from(bad).is_err());
    }
}
