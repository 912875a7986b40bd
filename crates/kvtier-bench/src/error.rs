//! Errors of kvtier-bench.

use kvtier_core::CoreError;
use kvtier_store::StoreError;
use kvtier_transfer::TransferError;

/// Why a benchmark could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BenchError {
    /// A flag value that makes no sense (named in the message).
    #[error("invalid benchmark configuration: {0}")]
    InvalidConfig(String),
    /// Geometry or namespace errors.
    #[error(transparent)]
    Core(#[from] CoreError),
    /// Host tier or mapping errors.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Pool or queue errors.
    #[error(transparent)]
    Transfer(#[from] TransferError),
}
