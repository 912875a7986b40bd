//! Errors of kvtier-core, and the kinds every kvtier error is sorted into.

/// What kind of failure an error is, decided where the error is defined (each library error's
/// `kind()`, an exhaustive match), so that a new variant cannot silently become an internal
/// error: the server maps kinds, not variants, to gRPC codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The caller sent something malformed or out of range.
    InvalidArgument,
    /// What the caller named does not exist.
    NotFound,
    /// What the caller wants to create exists already.
    AlreadyExists,
    /// The request is well formed but the state it needs does not hold (a pool of another
    /// geometry, memory that changed under a registration).
    FailedPrecondition,
    /// A bound was reached (a full queue, tier or disk); trying later may work.
    ResourceExhausted,
    /// Stored data failed verification.
    DataLoss,
    /// The service cannot take it now (shutting down, a transient conflict).
    Unavailable,
    /// The requester gave up.
    Cancelled,
    /// The requester's deadline passed.
    DeadlineExceeded,
    /// A fault of kvtier or of its machine (an I/O error, a thread that cannot start).
    Internal,
}

/// Why a value from a caller, a flag or a file was refused by kvtier-core.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CoreError {
    /// A KV geometry field is zero, or the derived byte counts overflow.
    #[error("invalid KV geometry: {field}={value}: {reason}")]
    InvalidGeometry {
        /// The offending field (`layers`, `kv_heads`, …).
        field: &'static str,
        /// Its value.
        value: u64,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A dtype name that kvtier does not know.
    #[error("unknown dtype {0:?} (expected one of f32, f16, bf16, fp8_e4m3, fp8_e5m2)")]
    UnknownDtype(String),
    /// A namespace field is out of range.
    #[error("invalid namespace: {field}: {reason}")]
    InvalidNamespace {
        /// The offending field (`model_id`, `tp_rank`, …).
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A block key given as text is not 32 hexadecimal digits.
    #[error("invalid block key {input:?}: expected 32 hexadecimal digits")]
    InvalidKey {
        /// The text that was given.
        input: String,
    },
    /// A byte size given as text could not be parsed.
    #[error("invalid byte size {input:?}: {reason}")]
    InvalidByteSize {
        /// The text that was given.
        input: String,
        /// What is wrong with it.
        reason: &'static str,
    },
}

impl CoreError {
    /// The kind of failure: every variant is the caller's bad input.
    pub fn kind(&self) -> ErrorKind {
        match self {
            CoreError::InvalidGeometry { .. }
            | CoreError::UnknownDtype(_)
            | CoreError::InvalidNamespace { .. }
            | CoreError::InvalidKey { .. }
            | CoreError::InvalidByteSize { .. } => ErrorKind::InvalidArgument,
        }
    }
}
