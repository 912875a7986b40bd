//! The engine's errors.

use std::path::PathBuf;

/// Everything the engine can fail with; each message names the offending value.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// A bad model or engine configuration.
    #[error("{0}")]
    Config(String),
    /// A file could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A weights file is missing a tensor or has one of the wrong shape.
    #[error("weights: {0}")]
    Weights(String),
    /// A request the engine cannot serve (empty, too long, bad token id, bad sampling value).
    #[error("{0}")]
    BadRequest(String),
    /// Not enough device KV slots for the request, even after evicting every unused block.
    #[error("device KV pool full: {needed} slots needed, {free} free of {total}")]
    PoolFull {
        /// Slots the request needs.
        needed: usize,
        /// Slots free (or evictable) now.
        free: usize,
        /// Slots in the pool.
        total: usize,
    },
    /// The tensor library failed.
    #[error("tensor op: {0}")]
    Tensor(#[from] candle_core::Error),
    /// The device pool failed.
    #[error(transparent)]
    Transfer(#[from] kvtier_transfer::TransferError),
    /// Key or namespace arithmetic failed.
    #[error(transparent)]
    Core(#[from] kvtier_core::CoreError),
    /// A call to the kvtier sidecar failed (or none is connected).
    #[error(transparent)]
    Sidecar(#[from] crate::sidecar_link::LinkError),
    /// The engine stopped.
    #[error("engine stopped")]
    Stopped,
    /// The waiting queue is full: try again shortly.
    #[error(
        "the engine is at capacity: {waiting} requests wait already (max_waiting {limit}); retry shortly"
    )]
    Overloaded {
        /// Requests waiting now.
        waiting: usize,
        /// The configured bound.
        limit: usize,
    },
}
