//! Errors of kvtier-store.

use std::io;
use std::path::PathBuf;

use kvtier_core::{BlockKey, CoreError, ErrorKind, KvGeometry};

/// Why a kvtier-store operation failed. Every variant names the offending value.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// A namespace, geometry or size from kvtier-core was invalid.
    #[error(transparent)]
    Core(#[from] CoreError),
    /// A system call on a file or mapping failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done (`create`, `open`, `map`, …).
        op: &'static str,
        /// The file concerned (`<memfd:name>` for anonymous memory).
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// A file that must be created already exists.
    #[error("{path} already exists: remove it or choose another path")]
    AlreadyExists {
        /// The path.
        path: PathBuf,
    },
    /// A file that must be opened does not exist.
    #[error("{path} does not exist")]
    FileNotFound {
        /// The path.
        path: PathBuf,
    },
    /// A file has another size than its header or the caller says it must have.
    #[error("{path} is {actual_bytes} bytes, expected {expected_bytes}")]
    WrongSize {
        /// The path.
        path: PathBuf,
        /// Size the caller expected.
        expected_bytes: u64,
        /// Size found.
        actual_bytes: u64,
    },
    /// A capacity too small to hold a single block.
    #[error("capacity of {capacity_bytes} bytes is smaller than one block page of {page_bytes} bytes")]
    CapacityTooSmall {
        /// Capacity asked for.
        capacity_bytes: u64,
        /// Bytes one block needs (all layers, page-aligned).
        page_bytes: u64,
    },
    /// A capacity that needs more pages than an arena can index.
    #[error(
        "capacity of {capacity_bytes} bytes needs {pages} pages, more than the {max_pages} an arena can hold"
    )]
    CapacityTooLarge {
        /// Capacity asked for.
        capacity_bytes: u64,
        /// Pages it would need.
        pages: u64,
        /// Most pages an arena holds.
        max_pages: u64,
    },
    /// A byte range outside a mapped region.
    #[error("range {offset}+{len} is outside the {region_bytes}-byte region {region}")]
    OutOfBounds {
        /// Region name (path or memfd name).
        region: String,
        /// Start of the range.
        offset: usize,
        /// Length of the range.
        len: usize,
        /// Size of the region.
        region_bytes: usize,
    },
    /// A layer index at or past the geometry's layer count.
    #[error("layer {layer} out of range: the geometry has {layers} layers")]
    LayerOutOfRange {
        /// Layer asked for.
        layer: u32,
        /// Layers in the geometry.
        layers: u32,
    },
    /// A buffer whose length is not one block-layer.
    #[error("buffer of {actual_bytes} bytes where one block-layer of {expected_bytes} bytes is needed")]
    BufferSize {
        /// Bytes expected.
        expected_bytes: usize,
        /// Bytes given.
        actual_bytes: usize,
    },
    /// A key that is not stored (or not readable yet) in this tier and namespace.
    #[error("block {key} is not in the {tier} tier")]
    NotFound {
        /// The key.
        key: BlockKey,
        /// `host`, `disk` or `remote`.
        tier: &'static str,
    },
    /// A stored block failed verification (checksum, key, namespace or length): it was dropped
    /// from the index and counted; the caller sees a miss, never wrong KV.
    #[error("block {key} in {path} is corrupt ({reason}); dropped")]
    CorruptBlock {
        /// The key.
        key: BlockKey,
        /// The region file.
        path: PathBuf,
        /// What did not match.
        reason: String,
    },
    /// The disk tier's directory is missing, not a directory, or unusable.
    #[error("disk tier directory {path}: {reason}")]
    DiskDir {
        /// The directory.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// Another process holds the disk tier's directory.
    #[error(
        "disk tier directory {path} is in use by another kvtier process ({holder}); stop it or choose another directory"
    )]
    DirLocked {
        /// The directory.
        path: PathBuf,
        /// Who holds the lock (pid from the lock file).
        holder: String,
    },
    /// The file system is full (or a file size limit was hit): the block was not written.
    #[error("disk full writing {path}: {source}")]
    DiskFull {
        /// The file being written.
        path: PathBuf,
        /// The OS error (ENOSPC, EFBIG, EDQUOT).
        source: io::Error,
    },
    /// The directory holds blocks of another KV geometry.
    #[error(
        "{path} holds blocks of geometry {found}, this tier is configured for {expected}; use another directory for another model"
    )]
    DiskGeometryMismatch {
        /// The region file.
        path: PathBuf,
        /// The configured geometry.
        expected: KvGeometry,
        /// The geometry in the file.
        found: KvGeometry,
    },
    /// Shared memory whose file was truncated, replaced or unlinked by another process: its
    /// bytes are not the ones that were mapped, so every access to it fails from now on.
    #[error("shared memory {region} is no longer usable: {reason}")]
    RegionUnusable {
        /// Region name (path or memfd name).
        region: String,
        /// What changed.
        reason: String,
    },
    /// No page could be allocated: every page is pinned, being written, or holds a prefix of
    /// another resident block.
    #[error(
        "host tier full: none of its {capacity_pages} pages can be evicted (pinned, being written, or a prefix of a resident block)"
    )]
    NoSpace {
        /// Pages in the tier.
        capacity_pages: u32,
    },
    /// The remote tier's configuration is unusable.
    #[error("remote tier: {reason}")]
    RemoteConfig {
        /// What is wrong, naming the key.
        reason: String,
    },
    /// The remote cluster refused kvtier's credentials.
    #[error(
        "remote tier {nodes}: authentication failed ({reason}): check remote.username and remote.password"
    )]
    RemoteAuth {
        /// The configured nodes.
        nodes: String,
        /// The cluster's answer.
        reason: String,
    },
    /// A remote-tier operation failed (not connected, timeout, cluster error).
    #[error("remote tier {op}: {reason}")]
    Remote {
        /// What was being done (`read`, `clear`, …).
        op: &'static str,
        /// Why it failed.
        reason: String,
    },
}

impl StoreError {
    /// The kind of failure, decided here for every variant.
    pub fn kind(&self) -> ErrorKind {
        match self {
            StoreError::Core(e) => e.kind(),
            StoreError::Io { .. } | StoreError::DiskDir { .. } | StoreError::DirLocked { .. } => {
                ErrorKind::Internal
            }
            StoreError::AlreadyExists { .. } => ErrorKind::AlreadyExists,
            StoreError::FileNotFound { .. } | StoreError::NotFound { .. } => ErrorKind::NotFound,
            StoreError::WrongSize { .. }
            | StoreError::DiskGeometryMismatch { .. }
            | StoreError::RegionUnusable { .. } => ErrorKind::FailedPrecondition,
            StoreError::CapacityTooSmall { .. }
            | StoreError::CapacityTooLarge { .. }
            | StoreError::OutOfBounds { .. }
            | StoreError::LayerOutOfRange { .. }
            | StoreError::BufferSize { .. } => ErrorKind::InvalidArgument,
            StoreError::CorruptBlock { .. } => ErrorKind::DataLoss,
            StoreError::DiskFull { .. } | StoreError::NoSpace { .. } => ErrorKind::ResourceExhausted,
            StoreError::RemoteConfig { .. } => ErrorKind::InvalidArgument,
            StoreError::RemoteAuth { .. } => ErrorKind::FailedPrecondition,
            StoreError::Remote { .. } => ErrorKind::Unavailable,
        }
    }

    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        StoreError::Io {
            op,
            path: path.into(),
            source,
        }
    }
}
