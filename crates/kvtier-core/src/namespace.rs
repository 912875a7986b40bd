//! Namespaces: which blocks may ever match each other.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::{CoreError, KvGeometry};

/// Longest `model_id` or `cache_salt` accepted, in bytes.
const MAX_NAME_BYTES: usize = 1024;

/// Magic that starts the canonical namespace encoding; bump the version to change the encoding.
const NAMESPACE_ENCODING_MAGIC: &[u8; 12] = b"kvtier-ns-v1";

/// Everything that must be equal for two blocks with equal tokens to hold equal KV: the model,
/// the KV geometry, the tenant's `cache_salt` and the tensor-parallel rank.
///
/// Its [`fingerprint`](Namespace::fingerprint) seeds every block key, so blocks of two
/// namespaces never match.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "RawNamespace", into = "RawNamespace")]
pub struct Namespace {
    model_id: String,
    geometry: KvGeometry,
    tp_rank: u32,
    tp_size: u32,
    cache_salt: String,
}

impl Namespace {
    /// Validates and builds a namespace.
    ///
    /// `model_id` names the weights (a Hugging Face id, a path, a checksum: whatever changes when
    /// the KV would change); `cache_salt` isolates tenants (empty for none).
    ///
    /// # Errors
    /// [`CoreError::InvalidNamespace`] when `model_id` is empty, a name exceeds 1024 bytes,
    /// `tp_size` is 0 or `tp_rank >= tp_size`.
    pub fn new(
        model_id: impl Into<String>,
        geometry: KvGeometry,
        tp_rank: u32,
        tp_size: u32,
        cache_salt: impl Into<String>,
    ) -> Result<Self, CoreError> {
        let model_id = model_id.into();
        let cache_salt = cache_salt.into();
        if model_id.is_empty() {
            return Err(CoreError::InvalidNamespace {
                field: "model_id",
                reason: "must not be empty".into(),
            });
        }
        for (field, value) in [("model_id", &model_id), ("cache_salt", &cache_salt)] {
            if value.len() > MAX_NAME_BYTES {
                return Err(CoreError::InvalidNamespace {
                    field,
                    reason: format!("{} bytes, at most {MAX_NAME_BYTES} allowed", value.len()),
                });
            }
        }
        if tp_size == 0 {
            return Err(CoreError::InvalidNamespace {
                field: "tp_size",
                reason: "must be at least 1".into(),
            });
        }
        if tp_rank >= tp_size {
            return Err(CoreError::InvalidNamespace {
                field: "tp_rank",
                reason: format!("{tp_rank} is not below tp_size {tp_size}"),
            });
        }
        Ok(Self {
            model_id,
            geometry,
            tp_rank,
            tp_size,
            cache_salt,
        })
    }

    /// A namespace on a single rank (tp 0 of 1) with no salt.
    ///
    /// # Errors
    /// As [`Namespace::new`].
    pub fn single(model_id: impl Into<String>, geometry: KvGeometry) -> Result<Self, CoreError> {
        Self::new(model_id, geometry, 0, 1, "")
    }

    /// The model id.
    pub fn model_id(&self) -> &str {
        &self.model_id
    }
    /// The KV geometry.
    pub fn geometry(&self) -> &KvGeometry {
        &self.geometry
    }
    /// Tensor-parallel rank of the KV this namespace holds.
    pub fn tp_rank(&self) -> u32 {
        self.tp_rank
    }
    /// Tensor-parallel world size.
    pub fn tp_size(&self) -> u32 {
        self.tp_size
    }
    /// Tenant salt (empty for none).
    pub fn cache_salt(&self) -> &str {
        &self.cache_salt
    }

    /// The canonical byte encoding hashed into the fingerprint (all integers little-endian):
    ///
    /// ```text
    /// "kvtier-ns-v1"                      12 bytes
    /// model_id    u32 length, UTF-8 bytes
    /// layers, kv_heads, head_dim          u32 each
    /// dtype       u32 length, canonical name ("bf16", …)
    /// block_tokens, tp_rank, tp_size      u32 each
    /// cache_salt  u32 length, UTF-8 bytes
    /// ```
    pub fn canonical_bytes(&self) -> Vec<u8> {
        fn put_str(out: &mut Vec<u8>, s: &str) {
            // Lengths are bounded by MAX_NAME_BYTES at construction.
            out.extend_from_slice(&(s.len() as u32).to_le_bytes());
            out.extend_from_slice(s.as_bytes());
        }
        let g = &self.geometry;
        let mut out = Vec::with_capacity(64 + self.model_id.len() + self.cache_salt.len());
        out.extend_from_slice(NAMESPACE_ENCODING_MAGIC);
        put_str(&mut out, &self.model_id);
        for v in [g.layers(), g.kv_heads(), g.head_dim()] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        put_str(&mut out, g.dtype().name());
        for v in [g.block_tokens(), self.tp_rank, self.tp_size] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        put_str(&mut out, &self.cache_salt);
        out
    }

    /// `xxh3_128` of [`canonical_bytes`](Namespace::canonical_bytes). Costs one small hash.
    pub fn fingerprint(&self) -> NamespaceFingerprint {
        NamespaceFingerprint(xxhash_rust::xxh3::xxh3_128(&self.canonical_bytes()))
    }
}

/// The 128-bit fingerprint of a [`Namespace`]; seeds block keys and tags stored blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct NamespaceFingerprint(pub u128);

impl NamespaceFingerprint {
    /// The 16 little-endian bytes that enter block keys and headers.
    pub const fn to_le_bytes(self) -> [u8; 16] {
        self.0.to_le_bytes()
    }
}

impl fmt::Display for NamespaceFingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// Unvalidated serde form of [`Namespace`].
#[derive(Serialize, Deserialize)]
struct RawNamespace {
    model_id: String,
    geometry: KvGeometry,
    #[serde(default)]
    tp_rank: u32,
    #[serde(default = "one")]
    tp_size: u32,
    #[serde(default)]
    cache_salt: String,
}

fn one() -> u32 {
    1
}

impl TryFrom<RawNamespace> for Namespace {
    type Error = CoreError;
    fn try_from(r: RawNamespace) -> Result<Self, Self::Error> {
        Namespace::new(r.model_id, r.geometry, r.tp_rank, r.tp_size, r.cache_salt)
    }
}

impl From<Namespace> for RawNamespace {
    fn from(n: Namespace) -> Self {
        RawNamespace {
            model_id: n.model_id,
            geometry: n.geometry,
            tp_rank: n.tp_rank,
            tp_size: n.tp_size,
            cache_salt: n.cache_salt,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Dtype;

    fn geo() -> KvGeometry {
        KvGeometry::new(1, 4, 128, Dtype::Bf16, 64).unwrap()
    }

    #[test]
    fn every_field_changes_the_fingerprint() {
        let base = Namespace::new("qwen3", geo(), 0, 2, "").unwrap();
        let variants = [
            Namespace::new("qwen3b", geo(), 0, 2, "").unwrap(),
            Namespace::new("qwen3", geo(), 1, 2, "").unwrap(),
            Namespace::new("qwen3", geo(), 0, 4, "").unwrap(),
            Namespace::new("qwen3", geo(), 0, 2, "tenant-a").unwrap(),
            Namespace::new(
                "qwen3",
                KvGeometry::new(2, 4, 128, Dtype::Bf16, 64).unwrap(),
                0,
                2,
                "",
            )
            .unwrap(),
            Namespace::new(
                "qwen3",
                KvGeometry::new(1, 4, 128, Dtype::F16, 64).unwrap(),
                0,
                2,
                "",
            )
            .unwrap(),
            Namespace::new(
                "qwen3",
                KvGeometry::new(1, 4, 128, Dtype::Bf16, 32).unwrap(),
                0,
                2,
                "",
            )
            .unwrap(),
        ];
        for v in &variants {
            assert_ne!(v.fingerprint(), base.fingerprint(), "{v:?}");
        }
        // Length prefixes keep ("ab","c") and ("a","bc") apart.
        let a = Namespace::new("ab", geo(), 0, 1, "c").unwrap();
        let b = Namespace::new("a", geo(), 0, 1, "bc").unwrap();
        assert_ne!(a.fingerprint(), b.fingerprint());
    }

    #[test]
    fn bad_fields_are_named() {
        let e = Namespace::new("", geo(), 0, 1, "").unwrap_err();
        assert!(matches!(
            e,
            CoreError::InvalidNamespace {
                field: "model_id",
                ..
            }
        ));
        let e = Namespace::new("m", geo(), 2, 2, "").unwrap_err();
        assert!(e.to_string().contains("tp_rank: 2 is not below tp_size 2"), "{e}");
        let e = Namespace::new("m", geo(), 0, 0, "").unwrap_err();
        assert!(matches!(e, CoreError::InvalidNamespace { field: "tp_size", .. }));
        let e = Namespace::new("m", geo(), 0, 1, "x".repeat(2000)).unwrap_err();
        assert!(matches!(
            e,
            CoreError::InvalidNamespace {
                field: "cache_salt",
                ..
            }
        ));
    }
}
