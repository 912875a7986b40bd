//! Errors of the sidecar, and the one mapping from every error kind to a gRPC status.

use std::net::SocketAddr;
use std::path::PathBuf;

use kvtier_core::{CoreError, ErrorKind, KvGeometry};
use kvtier_proto::ProtoError;
use kvtier_store::StoreError;
use kvtier_transfer::TransferError;
use tonic::{Code, Status};

/// Why the sidecar refused a request or could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServerError {
    /// A session id that is not open.
    #[error("unknown session {0} (open one with OpenSession; sessions end with their stream)")]
    UnknownSession(u64),
    /// A pool id that is not registered (or belongs to another session).
    #[error("unknown pool {0}")]
    UnknownPool(u64),
    /// A pin id that is not held by this session.
    #[error("unknown pin {0}")]
    UnknownPin(u64),
    /// A request field that does not decode (packed keys of a bad length, an unknown dtype, a
    /// missing geometry).
    #[error(transparent)]
    Proto(#[from] ProtoError),
    /// A request with nothing in it.
    #[error("empty {0}: give at least one block")]
    EmptyBatch(&'static str),
    /// A request with more blocks than `server.max_batch_blocks`.
    #[error("{n} blocks in one request; at most {max} (server.max_batch_blocks)")]
    BatchTooLarge {
        /// Blocks asked for.
        n: usize,
        /// The bound.
        max: usize,
    },
    /// A pool of another geometry than the one this sidecar serves.
    #[error("this sidecar serves KV geometry {served}; the pool claims {claimed}")]
    GeometryMismatch {
        /// What the sidecar serves.
        served: KvGeometry,
        /// What the pool claims.
        claimed: KvGeometry,
    },
    /// A request field that is missing or out of range.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Something this sidecar does not do (yet).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A load that did not finish within its deadline.
    #[error("load did not finish within its {0} ms deadline; its pins were released")]
    DeadlineExceeded(u64),
    /// The sidecar is shutting down.
    #[error("kvtier is shutting down")]
    ShuttingDown,
    /// A configuration that cannot run.
    #[error("configuration: {0}")]
    Config(String),
    /// A listener could not be set up.
    #[error("cannot listen on {what}: {source}")]
    Listen {
        /// Socket path or address.
        what: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// A socket path already served by a live process.
    #[error("{0} is in use by a running kvtier (or another server); stop it or choose another socket")]
    SocketInUse(PathBuf),
    /// The metrics exporter could not start.
    #[error("metrics exporter on {addr}: {reason}")]
    Metrics {
        /// The address.
        addr: SocketAddr,
        /// Why.
        reason: String,
    },
    /// Core (geometry, namespace) errors.
    #[error(transparent)]
    Core(#[from] CoreError),
    /// Tier errors.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Pool and queue errors.
    #[error(transparent)]
    Transfer(#[from] TransferError),
}

impl From<ServerError> for Status {
    fn from(e: ServerError) -> Status {
        Status::new(code_of(&e), e.to_string())
    }
}

/// The one place that decides which gRPC code each error is.
pub fn code_of(e: &ServerError) -> Code {
    match e {
        ServerError::UnknownSession(_) | ServerError::UnknownPool(_) | ServerError::UnknownPin(_) => {
            Code::NotFound
        }
        ServerError::Proto(_)
        | ServerError::EmptyBatch(_)
        | ServerError::BatchTooLarge { .. }
        | ServerError::InvalidArgument(_) => Code::InvalidArgument,
        ServerError::GeometryMismatch { .. } | ServerError::Unsupported(_) => Code::FailedPrecondition,
        ServerError::DeadlineExceeded(_) => Code::DeadlineExceeded,
        ServerError::ShuttingDown => Code::Unavailable,
        ServerError::Config(_)
        | ServerError::Listen { .. }
        | ServerError::SocketInUse(_)
        | ServerError::Metrics { .. } => Code::Internal,
        ServerError::Core(e) => code_of_kind(e.kind()),
        ServerError::Store(e) => code_of_kind(e.kind()),
        ServerError::Transfer(e) => code_of_kind(e.kind()),
    }
}

/// The gRPC code of each kind of library error (kinds are decided where errors are defined).
pub fn code_of_kind(kind: ErrorKind) -> Code {
    match kind {
        ErrorKind::InvalidArgument => Code::InvalidArgument,
        ErrorKind::NotFound => Code::NotFound,
        ErrorKind::AlreadyExists => Code::AlreadyExists,
        ErrorKind::FailedPrecondition => Code::FailedPrecondition,
        ErrorKind::ResourceExhausted => Code::ResourceExhausted,
        ErrorKind::DataLoss => Code::DataLoss,
        ErrorKind::Unavailable => Code::Unavailable,
        ErrorKind::Cancelled => Code::Cancelled,
        ErrorKind::DeadlineExceeded => Code::DeadlineExceeded,
        ErrorKind::Internal => Code::Internal,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes() {
        let g = KvGeometry::new(1, 1, 8, kvtier_core::Dtype::Bf16, 16).unwrap();
        for (e, code) in [
            (ServerError::UnknownPool(3), Code::NotFound),
            (
                ServerError::Proto(ProtoError::BadKeys {
                    field: "keys",
                    len: 15,
                }),
                Code::InvalidArgument,
            ),
            (
                ServerError::BatchTooLarge { n: 10, max: 5 },
                Code::InvalidArgument,
            ),
            (
                ServerError::GeometryMismatch {
                    served: g,
                    claimed: g,
                },
                Code::FailedPrecondition,
            ),
            (ServerError::DeadlineExceeded(5), Code::DeadlineExceeded),
            (
                ServerError::Transfer(TransferError::SlotOutOfRange {
                    slot: 9,
                    num_slots: 4,
                }),
                Code::InvalidArgument,
            ),
            (
                ServerError::Transfer(TransferError::QueueFull {
                    queue: "store",
                    inflight_bytes: 1,
                    request_bytes: 2,
                    limit_bytes: 2,
                }),
                Code::ResourceExhausted,
            ),
            (
                ServerError::Transfer(TransferError::Store(StoreError::FileNotFound {
                    path: "/x".into(),
                })),
                Code::NotFound,
            ),
        ] {
            let msg = e.to_string();
            let status = Status::from(e);
            assert_eq!(status.code(), code, "{msg}");
            assert_eq!(status.message(), msg);
        }
    }
}
