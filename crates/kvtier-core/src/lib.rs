//! kvtier-core: the vocabulary every other kvtier crate shares.
//!
//! - [`KvGeometry`] and [`Dtype`]: the shape of one model's KV cache and the byte arithmetic
//!   derived from it (bytes per token, per block-layer, per block).
//! - [`Namespace`] and its [`NamespaceFingerprint`]: which blocks may ever match each other.
//! - [`BlockKey`] and [`BlockHasher`]: the 128-bit chained prefix hash that addresses a block
//!   everywhere (see `docs/block-keys.md` and the published vectors in `vectors/`).
//! - [`xxh3_64`]: the checksum of stored bytes.
//! - [`PoolLayout`]: where an engine keeps K and V of each slot (kvtier, vLLM, SGLang layouts).
//! - [`ByteSize`]: human byte sizes (`512MiB`, `2GiB`) for configuration and flags.
#![warn(missing_docs)]

mod block_key;
mod byte_size;
mod checksum;
mod error;
mod geometry;
mod namespace;
pub mod optional_setting;
mod pool_layout;
mod secret;
mod tier;

pub use block_key::{BlockHasher, BlockKey};
pub use byte_size::{BYTE_SIZE_FORM, ByteSize};
pub use checksum::{Xxh3Stream, xxh3_64};
pub use error::{CoreError, ErrorKind};
pub use geometry::{Dtype, KvGeometry};
pub use namespace::{Namespace, NamespaceFingerprint};
pub use pool_layout::{
    LayerLayout, LayerRuns, LayoutError, LayoutKind, MAX_KV_CACHE_GROUPS, PoolLayout, SlotPiece, SlotPieces,
};
pub use secret::{REDACTED, Secret};
pub use tier::Tier;
