//! Flags several commands share, defined once: the KV geometry of the benchmarks and key
//! tools, and the block size of the engine commands. Their defaults are kvtier-core's.

use anyhow::Result;
use clap::Args;
use kvtier_core::{Dtype, KvGeometry};

/// Tokens per KV block.
#[derive(Debug, Clone, Copy, Args)]
pub struct BlockTokensFlag {
    /// Tokens per KV block.
    #[arg(long, default_value_t = KvGeometry::DEFAULT_BLOCK_TOKENS)]
    pub block_tokens: u32,
}

/// The KV geometry: Qwen3-30B-A3B's shape with one layer unless told otherwise.
#[derive(Debug, Clone, Copy, Args)]
pub struct GeometryArgs {
    /// Layers whose KV is stored (the seed experiment kept 1 of Qwen3-30B-A3B's 48).
    #[arg(long, default_value_t = 1)]
    pub layers: u32,
    /// KV heads (per tensor-parallel rank).
    #[arg(long, default_value_t = KvGeometry::QWEN3_30B_A3B_KV_HEADS)]
    pub kv_heads: u32,
    /// Head dimension.
    #[arg(long, default_value_t = KvGeometry::QWEN3_30B_A3B_HEAD_DIM)]
    pub head_dim: u32,
    /// KV element type: f32, f16, bf16, fp8_e4m3, fp8_e5m2.
    #[arg(long, default_value = "bf16")]
    pub dtype: Dtype,
    #[command(flatten)]
    pub block: BlockTokensFlag,
}

impl GeometryArgs {
    /// The validated geometry.
    pub fn geometry(&self) -> Result<KvGeometry> {
        Ok(KvGeometry::new(
            self.layers,
            self.kv_heads,
            self.head_dim,
            self.dtype,
            self.block.block_tokens,
        )?)
    }
}
