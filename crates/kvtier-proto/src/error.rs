//! Why a message could not be decoded into kvtier's types.

use kvtier_core::CoreError;

/// A field of a kvtier.v1 message that does not decode. Each variant names the field (as a
/// path into the message, e.g. `geometry.dtype`) and the value found there.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtoError {
    /// A field of packed keys whose length is not a multiple of 16 bytes.
    #[error("{field}: {len} bytes is not a whole number of 16-byte block keys")]
    BadKeys {
        /// Which field (`keys`, `missing`, …).
        field: &'static str,
        /// Its length in bytes.
        len: usize,
    },
    /// A field that holds one key (or none, where that is allowed) but is another length.
    #[error("{field}: {len} bytes is not one 16-byte block key")]
    BadKey {
        /// Which field (`parent`, `events[].key`).
        field: &'static str,
        /// Its length in bytes.
        len: usize,
    },
    /// An enum value this build does not know (or `*_UNSPECIFIED` where a value is required).
    #[error("{field}: unknown {kind} {value}")]
    UnknownEnum {
        /// Which field (`geometry.dtype`).
        field: &'static str,
        /// The enum (`dtype`).
        kind: &'static str,
        /// The value on the wire.
        value: i32,
    },
    /// A required message field that is absent.
    #[error("{field} is required")]
    Missing {
        /// Which field (`geometry`).
        field: &'static str,
    },
    /// A geometry whose fields kvtier-core refuses (zero, or byte counts that overflow).
    #[error("{field}: {source}")]
    Geometry {
        /// Which field (`geometry`).
        field: &'static str,
        /// What kvtier-core said.
        source: CoreError,
    },
}
