//! kvtier-store: where blocks live between transfers.
//!
//! - [`ShmRegion`]: shared-memory mappings, the only owner of raw pointers into them.
//! - [`HostArena`]: one mapping cut into pages of exactly one block (all layers, layer-major).
//! - [`HostTier`]: the host-memory tier — a concurrent index from [`kvtier_core::BlockKey`] to
//!   page, two-phase inserts ([`PageWriter`]), pins ([`PinnedPage`]), prefix matching, and
//!   eviction through an [`EvictionPolicy`] ([`S3Fifo`] or [`Lru`]) that never takes a pinned
//!   page and takes suffix blocks before their prefixes.
//!
//! - [`DiskTier`]: log-structured region files with checksummed entries, O_DIRECT, FIFO region
//!   reclaim and crash recovery.
//!
//! - [`RemoteTier`]: blocks in a Redis Cluster shared by a fleet, as checksummed values
//!   ([`remote_value`]), written behind and read in parallel under deadlines.
//!
//! - [`TieredStore`]: the tiers and the [`WritePolicy`] between them.
//!
//! The transfer queues (kvtier-transfer) move bytes in and out.
#![warn(missing_docs)]

mod aligned_buf;
mod disk_format;
mod disk_tier;
mod error;
mod eviction;
mod fault_guard;
mod host_arena;
mod host_tier;
mod key_hasher;
mod remote_tier;
pub mod remote_value;
mod removal_feed;
mod shm_region;
#[cfg(any(test, feature = "test-util"))]
pub mod test_cluster;
mod tiered_store;

pub use disk_tier::{Appended, DirectIo, DiskTier, DiskTierConfig, DiskTierStats, RecoveryReport};
pub use error::StoreError;
pub use eviction::{EvictionKind, EvictionPolicy, Lru, S3Fifo};
pub use host_arena::{ArenaBacking, HostArena, PAGE_ALIGN, PageId};
pub use host_tier::{
    HostBacking, HostPage, HostTier, HostTierConfig, HostTierStats, PageWriter, PinnedPage, Removal,
    Reservation,
};
pub use remote_tier::{DropReason, RemoteReads, RemoteTier, RemoteTierConfig, RemoteTierStats};
pub use removal_feed::{RemovalFeed, Removed};
pub use shm_region::{CopyKind, Prefault, ShmRegion};
pub use tiered_store::{
    ClearedBlocks, PrefixMatch, TieredStore, TieredStoreConfig, TieredStoreStats, WritePolicy,
};
