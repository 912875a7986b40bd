//! kvtier-engine: the reference colocated prefill/decode engine kvtier is measured with.
//!
//! A Qwen3-family transformer on candle (CPU; the device is chosen in one place,
//! [`model::compute_device`]) whose KV lives in a paged device pool — the same shared-memory
//! [`kvtier_transfer::CpuDevicePool`] the sidecar copies blocks into and out of.
//!
//! - [`ModelConfig`]: presets (`qwen3-30b-a3b`, `qwen3-0.6b`, `tiny`, `tiny-moe`) or a Hugging
//!   Face `config.json`; [`Weights`]: seeded random or safetensors.
//! - [`Model::forward`]: a batch of prefill chunks and decode tokens over paged KV.
#![warn(missing_docs)]

pub mod chat_template;
mod command;
pub mod engine;
mod engine_config;
mod engine_stats;
mod error;
pub mod http;
pub mod kv_slots;
pub mod metrics;
pub mod model;
mod model_config;
pub mod request;
pub mod sampling;
mod scheduler;
pub mod sidecar_link;
pub mod slot_cache;
pub mod stop_strings;
pub mod text_codec;
mod weights;

pub use engine::Engine;
pub use engine_config::{EngineConfig, KvReuse};
pub use engine_stats::EngineStats;
pub use error::EngineError;
pub use kv_slots::KvSlots;
pub use model::{Model, SeqChunk};
pub use model_config::{Mlp, ModelConfig, PRESETS};
pub use request::{
    CachedTokens, FinishReason, GenRequest, SeqEvent, StopCheck, TransferSpan, Transfers, Usage,
};
pub use sampling::Sampling;
pub use text_codec::TextCodec;
pub use weights::{FfnWeights, LayerWeights, MlpWeights, Weights, load_model};
