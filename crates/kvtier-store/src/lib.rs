//! kvtier-store: where blocks live between transfers.
//!
//! - [`ShmRegion`]: shared-memory mappings, the only owner of raw pointers into them.
//! - [`HostArena`]: one mapping cut into pages of exactly one block (all layers, layer-major).
//! - [`HostTier`]: the host-memory tier — a concurrent index from [`kvtier_core::BlockKey`] to
//!   page, two-phase inserts ([`PageWriter`]), pins ([`PinnedPage`]), prefix matching, and
//!   eviction through an [`EvictionPolicy`] ([`S3Fifo`] or [`Lru`]) that never takes a pinned
//!   page and takes suffix blocks before their prefixes.
//!
//! No networking here; the transfer queues (kvtier-transfer) move bytes in and out.
#![warn(missing_docs)]

mod error;
mod eviction;
mod host_arena;
mod host_tier;
mod shm_region;

pub use error::StoreError;
pub use eviction::{EvictionKind, EvictionPolicy, Lru, PageId, S3Fifo};
pub use host_arena::{HostArena, PAGE_ALIGN};
pub use host_tier::{HostTier, HostTierConfig, HostTierStats, PageWriter, PinnedPage, Removal, Reservation};
pub use shm_region::{Prefault, ShmRegion};
