//! Errors of kvtier-core.

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
