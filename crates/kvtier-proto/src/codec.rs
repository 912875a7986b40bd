//! The gRPC codec of `kvtier.v1`: prost encoding, with decoding failures answered by who sent
//! the bytes.
//!
//! tonic's stock codec answers every undecodable message INTERNAL (gRPC's status-code guide
//! lists parse errors under INTERNAL for both directions). A request the sidecar cannot decode
//! is the client's mistake, so here it is INVALID_ARGUMENT naming the message and prost's
//! reason; a reply a client cannot decode stays INTERNAL (the server's fault). Which side a
//! message is on is [`DecodeSide`], implemented once per message type below: a message type
//! without it does not compile into a service.

use std::marker::PhantomData;

use prost::Message;
use tonic::Status;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic_prost::ProstEncoder;

use crate::proto;

/// Which end sent a message, and so which status its decoding failure is.
pub trait DecodeSide {
    /// The message's name in the proto, for the status message.
    const NAME: &'static str;
    /// `true` for requests (decoded by the server: a failure is INVALID_ARGUMENT), `false` for
    /// replies (decoded by the client: a failure is INTERNAL).
    const REQUEST: bool;
}

macro_rules! sides {
    ($request:literal: $($ty:ident),* $(,)?) => {
        $(impl DecodeSide for proto::$ty {
            const NAME: &'static str = concat!("kvtier.v1.", stringify!($ty));
            const REQUEST: bool = $request;
        })*
    };
}

sides!(true: OpenSessionRequest, RegisterPoolRequest, UnregisterPoolRequest, MatchRequest,
    LoadRequest, StoreRequest, DeviceEventsRequest, PinRequest, UnpinRequest, ClearRequest,
    StatsRequest);
sides!(false: SessionEvent, RegisterPoolResponse, UnregisterPoolResponse, MatchResponse,
    LoadEvent, StoreResponse, DeviceEventsResponse, PinResponse, UnpinResponse, ClearResponse,
    StatsResponse);

/// The status for a message of type `U` that did not decode.
pub fn decode_status<U: DecodeSide>(error: &prost::DecodeError) -> Status {
    let message = format!("{} does not decode: {error}", U::NAME);
    if U::REQUEST {
        Status::invalid_argument(message)
    } else {
        Status::internal(message)
    }
}

/// KV cache groups a Load or Store of the largest batch may name a slot in, per block, and
/// still fit the message limit: as many as a layout may have
/// ([`kvtier_core::MAX_KV_CACHE_GROUPS`]).
pub const MAX_LIMIT_GROUPS: usize = kvtier_core::MAX_KV_CACHE_GROUPS as usize;

/// Bytes one block can take in the largest kvtier.v1 message: its token ids at the varint's
/// widest (5 bytes each) in a request, its packed key and a slot in each of
/// [`MAX_LIMIT_GROUPS`] groups in a request (56 bytes), or its packed key, slot and tier in a
/// reply (22 bytes) — whichever is largest — plus a margin for tags.
const fn block_wire_bytes(block_tokens: u32) -> usize {
    let tokens = 5 * block_tokens as usize;
    let slots = 16 + 5 * MAX_LIMIT_GROUPS;
    (if tokens > slots { tokens } else { slots }) + 16
}

/// The gRPC message size limit that lets a request of `max_batch_blocks` blocks of
/// `block_tokens` tokens through in any of its forms (token ids, or packed keys and slots):
/// `max_batch_blocks * (max(5 * block_tokens, 56) + 16) + 64 KiB`, at least gRPC's default 4
/// MiB. The sidecar decodes requests up to this size (larger ones are OUT_OF_RANGE before
/// being read); 65,536 blocks of 64 tokens make 22 MiB.
pub const fn max_message_bytes(max_batch_blocks: usize, block_tokens: u32) -> usize {
    let n = max_batch_blocks
        .saturating_mul(block_wire_bytes(block_tokens))
        .saturating_add(64 << 10);
    if n > 4 << 20 { n } else { 4 << 20 }
}

/// What kvtier's client accepts in a reply: the largest Match reply (22 bytes a block) of 4M
/// blocks. Replies come from the sidecar the client chose to trust; the bound only stops a
/// runaway stream.
pub const CLIENT_MAX_REPLY_BYTES: usize = 128 << 20;

/// [`Codec`] for every kvtier.v1 method (set by build.rs as the generated stubs' codec).
#[derive(Debug, Clone)]
pub struct KvCodec<T, U> {
    _pd: PhantomData<(T, U)>,
}

impl<T, U> Default for KvCodec<T, U> {
    fn default() -> Self {
        Self { _pd: PhantomData }
    }
}

impl<T, U> Codec for KvCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + DecodeSide + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = KvDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::new(BufferSettings::default())
    }

    fn decoder(&mut self) -> Self::Decoder {
        KvDecoder { _pd: PhantomData }
    }
}

/// Decodes `U` with prost; a failure is [`decode_status`].
#[derive(Debug, Clone, Default)]
pub struct KvDecoder<U> {
    _pd: PhantomData<U>,
}

impl<U: Message + Default + DecodeSide> Decoder for KvDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        U::decode(buf).map(Some).map_err(|e| decode_status::<U>(&e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_undecodable_request_is_invalid_argument_and_a_reply_internal() {
        // Field 1 as a varint with its continuation bit set and nothing after it.
        let bytes: &[u8] = &[0x08, 0xff];
        let e = proto::MatchRequest::decode(bytes).unwrap_err();
        let s = decode_status::<proto::MatchRequest>(&e);
        assert_eq!(s.code(), tonic::Code::InvalidArgument);
        assert!(
            s.message().starts_with("kvtier.v1.MatchRequest does not decode"),
            "{}",
            s.message()
        );
        let e = proto::MatchResponse::decode(bytes).unwrap_err();
        assert_eq!(
            decode_status::<proto::MatchResponse>(&e).code(),
            tonic::Code::Internal
        );
    }

    #[test]
    fn the_message_limit_fits_the_batch_limit_in_every_form() {
        use prost::Message as _;
        assert_eq!(max_message_bytes(1, 64), 4 << 20, "never below gRPC's default");
        // Short blocks, where keys and slots outweigh token ids.
        let (blocks, tokens) = (65_536_usize, 4_u32);
        let limit = max_message_bytes(blocks, tokens);
        let by_tokens = proto::MatchRequest {
            session_id: u64::MAX,
            pool_id: u64::MAX,
            cache_salt: "s".repeat(256),
            token_ids: vec![u32::MAX; blocks * tokens as usize],
            ..Default::default()
        };
        let by_keys = proto::LoadRequest {
            session_id: u64::MAX,
            pool_id: u64::MAX,
            cache_salt: "s".repeat(256),
            keys: vec![0xff; blocks * 16].into(),
            slots: vec![u32::MAX; blocks],
            deadline_ms: u64::MAX,
            layer_event_stride: u32::MAX,
            done_only: true,
            group_slots: vec![
                proto::GroupSlots {
                    slots: vec![u32::MAX; blocks]
                };
                MAX_LIMIT_GROUPS - 1
            ],
        };
        let reply = proto::MatchResponse {
            tiers: vec![3; blocks],
            device_slots: vec![u32::MAX; blocks],
            keys: vec![0xff; blocks * 16].into(),
            matched_tokens: u64::MAX,
            device_tokens: u64::MAX,
            host_tokens: u64::MAX,
            disk_tokens: u64::MAX,
            remote_tokens: u64::MAX,
        };
        for (what, len) in [
            ("token ids", by_tokens.encoded_len()),
            ("keys and slots", by_keys.encoded_len()),
            ("match reply", reply.encoded_len()),
        ] {
            assert!(len <= limit, "{what}: {len} > {limit}");
        }
        assert!(
            reply.encoded_len() * 64 <= CLIENT_MAX_REPLY_BYTES,
            "the client reads 4M-block replies"
        );
    }
}
