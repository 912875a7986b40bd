//! Why a client call failed.

use kvtier_core::CoreError;
use kvtier_proto::ProtoError;
use tonic::Status;

/// Why a client call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The sidecar could not be reached.
    #[error("cannot connect to kvtier at {target}: {source}")]
    Connect {
        /// What was dialled.
        target: String,
        /// Why.
        source: tonic::transport::Error,
    },
    /// The sidecar refused the request (the status names the reason).
    #[error("kvtier: {}: {}", .0.code(), .0.message())]
    Status(#[from] Status),
    /// The sidecar answered something this client did not expect.
    #[error("kvtier protocol: {0}")]
    Protocol(String),
    /// A reply field that does not decode (keys of a bad length, an unknown dtype).
    #[error("kvtier protocol: {0}")]
    Proto(#[from] ProtoError),
    /// A geometry or namespace error.
    #[error(transparent)]
    Core(#[from] CoreError),
}
