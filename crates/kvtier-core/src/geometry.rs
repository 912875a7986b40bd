//! KV geometry: the shape of one model's KV cache and the byte arithmetic derived from it.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::CoreError;

/// Element type of the stored K and V tensors.
///
/// kvtier never interprets KV values; the dtype only fixes the element size and is part of the
/// namespace, so blocks written as bf16 never match a reader that expects f16.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
#[non_exhaustive]
pub enum Dtype {
    /// IEEE 754 binary32.
    F32,
    /// IEEE 754 binary16.
    F16,
    /// bfloat16, what most GPU engines keep their KV cache in.
    Bf16,
    /// 8-bit float, 4 exponent bits.
    Fp8E4m3,
    /// 8-bit float, 5 exponent bits.
    Fp8E5m2,
}

impl Dtype {
    /// Size of one element in bytes.
    pub const fn size_bytes(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::Fp8E4m3 | Dtype::Fp8E5m2 => 1,
        }
    }

    /// Canonical lowercase name, used in namespace fingerprints, files and flags.
    pub const fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
            Dtype::Fp8E4m3 => "fp8_e4m3",
            Dtype::Fp8E5m2 => "fp8_e5m2",
        }
    }

    /// A stable small integer for binary headers (pool files, disk entries).
    pub const fn code(self) -> u32 {
        match self {
            Dtype::F32 => 1,
            Dtype::F16 => 2,
            Dtype::Bf16 => 3,
            Dtype::Fp8E4m3 => 4,
            Dtype::Fp8E5m2 => 5,
        }
    }

    /// Inverse of [`Dtype::code`].
    pub const fn from_code(code: u32) -> Option<Dtype> {
        Some(match code {
            1 => Dtype::F32,
            2 => Dtype::F16,
            3 => Dtype::Bf16,
            4 => Dtype::Fp8E4m3,
            5 => Dtype::Fp8E5m2,
            _ => return None,
        })
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Dtype {
    type Err = CoreError;

    /// Accepts the canonical names and the common aliases (`bfloat16`, `fp16`, `half`,
    /// `float32`, `fp8`, `e4m3`, …), case-insensitively.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" | "float" => Dtype::F32,
            "f16" | "fp16" | "float16" | "half" => Dtype::F16,
            "bf16" | "bfloat16" => Dtype::Bf16,
            "fp8_e4m3" | "fp8e4m3" | "e4m3" | "fp8" | "float8_e4m3fn" => Dtype::Fp8E4m3,
            "fp8_e5m2" | "fp8e5m2" | "e5m2" | "float8_e5m2" => Dtype::Fp8E5m2,
            _ => return Err(CoreError::UnknownDtype(s.to_owned())),
        })
    }
}

impl TryFrom<String> for Dtype {
    type Error = CoreError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<Dtype> for String {
    fn from(d: Dtype) -> String {
        d.name().to_owned()
    }
}

/// The shape of the KV cache of one model (on one tensor-parallel rank).
///
/// A *block* holds `block_tokens` tokens of every layer; a *block-layer* is the K and V of one
/// block in one layer, `2 * block_tokens * kv_heads * head_dim * dtype_size` bytes, laid out
/// `[K|V][token][head][dim]`. A block-layer is the unit of every copy kvtier makes.
///
/// Construct it with [`KvGeometry::new`], which validates every field, so the arithmetic methods
/// never overflow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "RawGeometry", into = "RawGeometry")]
pub struct KvGeometry {
    layers: u32,
    kv_heads: u32,
    head_dim: u32,
    dtype: Dtype,
    block_tokens: u32,
}

/// Largest block-layer kvtier accepts (1 GiB): far above any real model, small enough that
/// every derived size fits in memory arithmetic without overflow.
const MAX_BLOCK_LAYER_BYTES: u64 = 1 << 30;
/// Largest number of layers accepted.
const MAX_LAYERS: u32 = 4096;

impl KvGeometry {
    /// Tokens per block where none is configured: what the seed experiments measured and the
    /// sidecar, the engine and every benchmark default to.
    pub const DEFAULT_BLOCK_TOKENS: u32 = 64;
    /// KV heads per rank of Qwen3-30B-A3B, the model kvtier is sized and measured for.
    pub const QWEN3_30B_A3B_KV_HEADS: u32 = 4;
    /// Head dimension of Qwen3-30B-A3B.
    pub const QWEN3_30B_A3B_HEAD_DIM: u32 = 128;
    /// Layers of Qwen3-30B-A3B.
    pub const QWEN3_30B_A3B_LAYERS: u32 = 48;

    /// `layers` of Qwen3-30B-A3B's KV (4 KV heads, head_dim 128, bf16) in blocks of
    /// [`KvGeometry::DEFAULT_BLOCK_TOKENS`]: the sidecar serves all 48 layers by default, the
    /// offload benchmark moves 1 as the seed experiment did.
    ///
    /// # Errors
    /// As [`KvGeometry::new`] (`layers` 0 or over 4096).
    pub fn qwen3_30b_a3b(layers: u32) -> Result<Self, CoreError> {
        Self::new(
            layers,
            Self::QWEN3_30B_A3B_KV_HEADS,
            Self::QWEN3_30B_A3B_HEAD_DIM,
            Dtype::Bf16,
            Self::DEFAULT_BLOCK_TOKENS,
        )
    }

    /// Validates and builds a geometry.
    ///
    /// # Errors
    /// [`CoreError::InvalidGeometry`] naming the field when a field is zero, `layers` exceeds
    /// 4096, or one block-layer would exceed 1 GiB.
    pub fn new(
        layers: u32,
        kv_heads: u32,
        head_dim: u32,
        dtype: Dtype,
        block_tokens: u32,
    ) -> Result<Self, CoreError> {
        for (field, value) in [
            ("layers", layers),
            ("kv_heads", kv_heads),
            ("head_dim", head_dim),
            ("block_tokens", block_tokens),
        ] {
            if value == 0 {
                return Err(CoreError::InvalidGeometry {
                    field,
                    value: 0,
                    reason: "must be at least 1",
                });
            }
        }
        if layers > MAX_LAYERS {
            return Err(CoreError::InvalidGeometry {
                field: "layers",
                value: u64::from(layers),
                reason: "must be at most 4096",
            });
        }
        let block_layer = 2
            * u64::from(block_tokens)
            * u64::from(kv_heads)
            * u64::from(head_dim)
            * dtype.size_bytes() as u64;
        if block_layer > MAX_BLOCK_LAYER_BYTES {
            return Err(CoreError::InvalidGeometry {
                field: "block_tokens",
                value: u64::from(block_tokens),
                reason: "one block-layer (2 * block_tokens * kv_heads * head_dim * dtype size) exceeds 1 GiB",
            });
        }
        Ok(Self {
            layers,
            kv_heads,
            head_dim,
            dtype,
            block_tokens,
        })
    }

    /// Number of layers whose KV is stored.
    pub const fn layers(&self) -> u32 {
        self.layers
    }
    /// Number of KV heads (on this tensor-parallel rank).
    pub const fn kv_heads(&self) -> u32 {
        self.kv_heads
    }
    /// Dimension of one head.
    pub const fn head_dim(&self) -> u32 {
        self.head_dim
    }
    /// Element type.
    pub const fn dtype(&self) -> Dtype {
        self.dtype
    }
    /// Tokens per block.
    pub const fn block_tokens(&self) -> u32 {
        self.block_tokens
    }

    /// Bytes of K and V for one token in one layer: `2 * kv_heads * head_dim * dtype_size`.
    pub const fn bytes_per_token_layer(&self) -> usize {
        2 * self.kv_heads as usize * self.head_dim as usize * self.dtype.size_bytes()
    }
    /// Bytes of K and V for one token in all layers.
    pub const fn bytes_per_token(&self) -> usize {
        self.bytes_per_token_layer() * self.layers as usize
    }
    /// Bytes of one block in one layer (K then V): the unit of every copy.
    pub const fn bytes_per_block_layer(&self) -> usize {
        self.bytes_per_token_layer() * self.block_tokens as usize
    }
    /// Bytes of one block in all layers.
    pub const fn bytes_per_block(&self) -> usize {
        self.bytes_per_block_layer() * self.layers as usize
    }
    /// Number of full blocks in `tokens` tokens (a partial tail block is not stored).
    pub const fn full_blocks(&self, tokens: usize) -> usize {
        tokens / self.block_tokens as usize
    }
}

impl fmt::Display for KvGeometry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "layers={} kv_heads={} head_dim={} dtype={} block_tokens={}",
            self.layers, self.kv_heads, self.head_dim, self.dtype, self.block_tokens
        )
    }
}

/// Unvalidated serde form of [`KvGeometry`].
#[derive(Serialize, Deserialize)]
struct RawGeometry {
    layers: u32,
    kv_heads: u32,
    head_dim: u32,
    dtype: Dtype,
    block_tokens: u32,
}

impl TryFrom<RawGeometry> for KvGeometry {
    type Error = CoreError;
    fn try_from(r: RawGeometry) -> Result<Self, Self::Error> {
        KvGeometry::new(r.layers, r.kv_heads, r.head_dim, r.dtype, r.block_tokens)
    }
}

impl From<KvGeometry> for RawGeometry {
    fn from(g: KvGeometry) -> Self {
        RawGeometry {
            layers: g.layers,
            kv_heads: g.kv_heads,
            head_dim: g.head_dim,
            dtype: g.dtype,
            block_tokens: g.block_tokens,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwen3_30b_a3b_one_layer_arithmetic() {
        let g = KvGeometry::new(1, 4, 128, Dtype::Bf16, 64).unwrap();
        assert_eq!(g.bytes_per_token_layer(), 2 * 4 * 128 * 2);
        assert_eq!(g.bytes_per_block_layer(), 131_072);
        assert_eq!(g.bytes_per_block(), 131_072);
        assert_eq!(g.full_blocks(10_000), 156);
        let g48 = KvGeometry::new(48, 4, 128, Dtype::Bf16, 64).unwrap();
        assert_eq!(g48.bytes_per_block(), 48 * 131_072);
        assert_eq!(g48.bytes_per_token(), 48 * 2048);
    }

    #[test]
    fn zero_fields_are_named() {
        for (i, field) in ["layers", "kv_heads", "head_dim", "block_tokens"]
            .iter()
            .enumerate()
        {
            let mut v = [1u32; 4];
            v[i] = 0;
            let err = KvGeometry::new(v[0], v[1], v[2], Dtype::Bf16, v[3]).unwrap_err();
            assert!(
                matches!(err, CoreError::InvalidGeometry { field: f, value: 0, .. } if f == *field),
                "{err}"
            );
        }
    }

    #[test]
    fn oversized_geometry_is_refused() {
        let err = KvGeometry::new(1, 1 << 16, 1 << 10, Dtype::F32, 1 << 10).unwrap_err();
        assert!(err.to_string().contains("exceeds 1 GiB"), "{err}");
        let err = KvGeometry::new(5000, 1, 1, Dtype::F32, 1).unwrap_err();
        assert!(err.to_string().contains("layers=5000"), "{err}");
    }

    #[test]
    fn dtype_names_round_trip() {
        for d in [
            Dtype::F32,
            Dtype::F16,
            Dtype::Bf16,
            Dtype::Fp8E4m3,
            Dtype::Fp8E5m2,
        ] {
            assert_eq!(d.name().parse::<Dtype>().unwrap(), d);
            assert_eq!(Dtype::from_code(d.code()), Some(d));
        }
        assert_eq!("BFloat16".parse::<Dtype>().unwrap(), Dtype::Bf16);
        assert!(matches!("int4".parse::<Dtype>(), Err(CoreError::UnknownDtype(s)) if s == "int4"));
        assert_eq!(Dtype::from_code(0), None);
    }

    #[test]
    fn serde_validates() {
        let g: KvGeometry = serde_json::from_str(
            r#"{"layers":2,"kv_heads":8,"head_dim":64,"dtype":"fp16","block_tokens":16}"#,
        )
        .unwrap();
        assert_eq!(g.dtype(), Dtype::F16);
        let bad = serde_json::from_str::<KvGeometry>(
            r#"{"layers":0,"kv_heads":8,"head_dim":64,"dtype":"f16","block_tokens":16}"#,
        );
        assert!(bad.unwrap_err().to_string().contains("layers=0"));
    }
}
