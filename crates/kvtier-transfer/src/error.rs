//! Errors of kvtier-transfer.

use std::path::PathBuf;

use kvtier_core::{CoreError, ErrorKind, KvGeometry, LayoutError};
use kvtier_store::StoreError;

/// Why a pool operation or a transfer request failed. Every variant names the offending value.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransferError {
    /// A storage-layer error (mapping, bounds, host tier).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// An invalid geometry or namespace.
    #[error(transparent)]
    Core(#[from] CoreError),
    /// A device slot index at or past the pool's slot count.
    #[error("device slot {slot} out of range: the pool has {num_slots} slots")]
    SlotOutOfRange {
        /// Slot asked for.
        slot: u32,
        /// Slots in the pool.
        num_slots: u32,
    },
    /// A request's slots for a pool of several KV cache groups that do not fit it: `field`
    /// names the request field (`group_slots[0]`), `reason` says why.
    #[error("{field}: {reason}")]
    GroupSlots {
        /// The field at fault.
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The same device slot appears twice in one request.
    #[error("device slot {slot} appears twice in one request")]
    DuplicateSlot {
        /// The repeated slot.
        slot: u32,
    },
    /// A pool or tier whose geometry is not the one expected.
    #[error("KV geometry mismatch: expected {expected}, found {actual}")]
    GeometryMismatch {
        /// What the caller said.
        expected: KvGeometry,
        /// What the pool or tier has.
        actual: KvGeometry,
    },
    /// A file that is not a kvtier device pool, or whose header is damaged.
    #[error(
        "{path} is not a kvtier device pool: {reason} (memory without kvtier's pool header, such as an engine's own KV, registers with its layout)"
    )]
    NotAPool {
        /// The file.
        path: PathBuf,
        /// What is wrong with its header.
        reason: String,
    },
    /// A pool file made for another number of slots.
    #[error("{path} holds {actual} slots, expected {expected}")]
    SlotCountMismatch {
        /// The file.
        path: PathBuf,
        /// Slots the caller said.
        expected: u32,
        /// Slots in the header.
        actual: u32,
    },
    /// A device pool whose memory is no longer the one registered: its owner truncated,
    /// replaced or unlinked it. Every request on it fails; other pools are not affected.
    #[error("device pool {pool} is no longer usable: {reason}; unregister it and register a new pool")]
    PoolUnusable {
        /// The pool (its file, or memfd name).
        pool: String,
        /// What changed.
        reason: String,
    },
    /// A pool of zero slots.
    #[error("a device pool needs at least one slot")]
    NoSlots,
    /// A request with no blocks.
    #[error("empty {queue} request: give at least one block")]
    EmptyRequest {
        /// `load` or `store`.
        queue: &'static str,
    },
    /// Admission refused: the queue's bytes in flight would exceed its bound.
    #[error(
        "{queue} queue full: {inflight_bytes} bytes in flight + {request_bytes} requested exceeds the {limit_bytes}-byte bound"
    )]
    QueueFull {
        /// `load` or `store`.
        queue: &'static str,
        /// Bytes already in flight.
        inflight_bytes: u64,
        /// Bytes this request needs.
        request_bytes: u64,
        /// The bound.
        limit_bytes: u64,
    },
    /// The requester abandoned the transfer before it finished; nothing was published.
    #[error("transfer cancelled by its requester")]
    Cancelled,
    /// Worker threads could not be started.
    #[error("cannot start transfer worker threads: {0}")]
    Spawn(#[source] std::io::Error),
    /// The caller's deadline passed before the transfer finished (it was then cancelled).
    #[error("deadline passed before the transfer finished")]
    DeadlineExceeded,
    /// A store whose copies did not end by the requester's `not_after` (or which was
    /// submitted after it): nothing was published.
    #[error("the store's copies {0}: nothing was stored (the engine may have written its blocks since)")]
    TooLate(String),
    /// A non-blocking load met a block being written into the host tier right now.
    #[error("a block of the load is being written into the host tier; submit it where waiting is allowed")]
    WouldBlock,
    /// The queue was shut down before the transfer finished.
    #[error("transfer queue shut down before the transfer finished")]
    ShutDown,
    /// A durable store on a sidecar whose disk tier is off (or never written).
    #[error("a durable store needs a disk tier that is written: {0}")]
    NoDiskTier(&'static str),
    /// A pool layout that does not fit the pool's memory or geometry (the field is named).
    #[error("invalid pool layout: {0}")]
    Layout(#[from] LayoutError),
    /// A device kind this process cannot use (no CUDA driver, say); the reason says why.
    #[error("{device} pools are not available: {reason}")]
    DeviceUnavailable {
        /// `cuda`.
        device: &'static str,
        /// Why not (library not found, no device, driver too old).
        reason: String,
    },
    /// A device operation that failed (a CUDA call, naming it and the driver's error).
    #[error("{device} error in {op}: {reason}")]
    Device {
        /// `cuda`.
        device: &'static str,
        /// The call or step that failed.
        op: String,
        /// The driver's error.
        reason: String,
    },
}

impl TransferError {
    /// The kind of failure, decided here for every variant.
    pub fn kind(&self) -> ErrorKind {
        match self {
            TransferError::Store(e) => e.kind(),
            TransferError::Core(e) => e.kind(),
            TransferError::SlotOutOfRange { .. }
            | TransferError::DuplicateSlot { .. }
            | TransferError::GroupSlots { .. }
            | TransferError::EmptyRequest { .. }
            | TransferError::Layout(_) => ErrorKind::InvalidArgument,
            TransferError::GeometryMismatch { .. }
            | TransferError::NotAPool { .. }
            | TransferError::SlotCountMismatch { .. }
            | TransferError::PoolUnusable { .. }
            | TransferError::NoSlots
            | TransferError::NoDiskTier(_)
            | TransferError::DeviceUnavailable { .. } => ErrorKind::FailedPrecondition,
            TransferError::QueueFull { .. } => ErrorKind::ResourceExhausted,
            TransferError::Cancelled => ErrorKind::Cancelled,
            TransferError::Spawn(_) | TransferError::Device { .. } => ErrorKind::Internal,
            TransferError::DeadlineExceeded | TransferError::TooLate(_) => ErrorKind::DeadlineExceeded,
            TransferError::WouldBlock | TransferError::ShutDown => ErrorKind::Unavailable,
        }
    }
}
