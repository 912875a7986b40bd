//! kvtier-proto: the wire contract between the kvtier sidecar and its clients.
//!
//! - [`proto`]: the prost messages and tonic stubs generated from `proto/kvtier/v1/kvtier.proto`
//!   (compiled with protox at build time: no system `protoc`), and the descriptor set for server
//!   reflection.
//! - [`wire`]: block keys packed 16 bytes each into one `bytes` field.
//! - Conversions between the messages and kvtier-core's types, written once for both ends:
//!   [`KvGeometry`](kvtier_core::KvGeometry) and [`Dtype`](kvtier_core::Dtype) (`From` /
//!   `TryFrom`, [`geometry_from_proto`]), a load's event stream ([`LoadEvent`], [`LoadDone`])
//!   transfer timings ([`WireTiming`]) and a device pool's layout
//!   ([`PoolLayout`](kvtier_core::PoolLayout), `From` both ways).
//! - [`codec`]: the stubs' codec — an undecodable request is INVALID_ARGUMENT, a reply INTERNAL.
//! - [`default_socket_path`]: where `kvtier serve` listens and clients dial by default.
//!
//! Every decoding failure is a [`ProtoError`] naming the field and the value.
#![warn(missing_docs)]

pub mod codec;
mod endpoint;
mod error;
mod geometry;
mod load_event;
mod pool_layout;
mod tier;
mod timing;
pub mod wire;

pub use endpoint::default_socket_path;
pub use error::ProtoError;
pub use geometry::geometry_from_proto;
pub use load_event::{LayerEvents, LoadDone, LoadEvent};
pub use tier::{MatchReply, MatchedBlock, StoreReply, tier_filter_from_proto, tier_from_proto};
pub use timing::WireTiming;

/// Generated protobuf messages and gRPC stubs of `kvtier.v1`.
#[allow(missing_docs, missing_debug_implementations, clippy::all, clippy::pedantic)]
pub mod proto {
    tonic::include_proto!("kvtier.v1");

    /// The encoded descriptor set of `kvtier.v1`, for server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/kvtier_descriptor.bin"));
}
