//! The engine's settings: where prefixes may come from ([`KvReuse`]) and the sizes and links
//! of one engine ([`EngineConfig`]).

use std::path::PathBuf;

use kvtier_core::{Dtype, KvGeometry};
use serde::{Deserialize, Serialize};

use crate::EngineError;

/// Where a request's prefix KV may come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum KvReuse {
    /// Recompute every prompt.
    None,
    /// Reuse blocks still in the engine's device pool.
    Device,
    /// Device first, then kvtier's host and disk tiers (needs a sidecar).
    #[default]
    Tiered,
    /// kvtier's tiers only: the device cache never serves a hit, so every reused prefix is
    /// loaded from host or disk (to measure the tiers; needs a sidecar).
    Kvtier,
}

impl KvReuse {
    /// Prefixes may come from the engine's device cache.
    pub fn uses_device(self) -> bool {
        matches!(self, Self::Device | Self::Tiered)
    }

    /// Prefixes may come from kvtier.
    pub fn uses_kvtier(self) -> bool {
        matches!(self, Self::Tiered | Self::Kvtier)
    }
}

impl std::str::FromStr for KvReuse {
    type Err = EngineError;
    fn from_str(s: &str) -> Result<Self, EngineError> {
        match s {
            "none" => Ok(Self::None),
            "device" => Ok(Self::Device),
            "tiered" => Ok(Self::Tiered),
            "kvtier" => Ok(Self::Kvtier),
            other => Err(EngineError::Config(format!(
                "--kv-reuse {other:?}: choose none, device, tiered or kvtier"
            ))),
        }
    }
}

/// Engine settings (plain data; defaults documented per field).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EngineConfig {
    /// Seed of the random weights (ignored with `model_dir`). Default 0.
    pub seed: u64,
    /// Dtype of the KV the pool holds (what a GPU engine moves). Default bf16.
    pub kv_dtype: Dtype,
    /// Tokens per KV block. Default 64.
    pub block_tokens: u32,
    /// Device pool slots (blocks). Default 1024.
    pub device_slots: u32,
    /// Where the device pool's shared-memory file goes; default
    /// `/dev/shm/kvtier-engine-<pid>-<n>.pool` (the temp directory without /dev/shm), removed
    /// when the engine stops.
    pub pool_path: Option<PathBuf>,
    /// Prefix reuse policy. Default tiered.
    pub kv_reuse: KvReuse,
    /// The sidecar (`unix:///path`, a socket path, `http://host:port` or `https://host:port`,
    /// with TLS settings and a token when it needs them); `None` serves from the device cache
    /// only.
    pub sidecar: Option<kvtier_client::ConnectOptions>,
    /// Tokens per forward pass (the chunked-prefill budget). Default 512.
    pub max_batch_tokens: usize,
    /// Sequences running at once. Default 16.
    pub max_running: usize,
    /// Requests waiting (submitted, not yet running) at most; past it a request is refused
    /// at once ([`crate::EngineError::Overloaded`], HTTP 503 with `Retry-After`) instead of
    /// waiting without bound. Default 256.
    pub max_waiting: usize,
    /// Deadline for a kvtier load, ms. Default 10000.
    pub load_deadline_ms: u64,
    /// Wait between sidecar reconnection attempts, ms. Default 2000.
    pub reconnect_ms: u64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            seed: 0,
            kv_dtype: Dtype::Bf16,
            block_tokens: KvGeometry::DEFAULT_BLOCK_TOKENS,
            device_slots: 1024,
            pool_path: None,
            kv_reuse: KvReuse::Tiered,
            sidecar: None,
            max_batch_tokens: 512,
            max_running: 16,
            max_waiting: 256,
            load_deadline_ms: 10_000,
            reconnect_ms: 2_000,
        }
    }
}
