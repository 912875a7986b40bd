//! `kvtier engine`: the reference engine behind its HTTP API.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;
use kvtier_core::Dtype;
use kvtier_engine::http::{AppState, router};
use kvtier_engine::{Engine, EngineConfig, KvReuse, TextCodec, load_model};

/// Flags shared by everything that starts an engine.
#[derive(Debug, Args, Clone)]
pub struct EngineFlags {
    /// A preset (qwen3-30b-a3b, qwen3-0.6b, tiny, tiny-moe) or a Hugging Face model directory
    /// (config.json + *.safetensors, tokenizer.json if present).
    #[arg(long, default_value = "qwen3-30b-a3b")]
    pub model: String,
    /// Keep only the first N layers (the seed experiment ran qwen3-30b-a3b with 1).
    #[arg(long)]
    pub layers: Option<usize>,
    /// Seed of the random weights of a preset.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Prefix reuse: none (recompute), device (the engine's own cache), tiered (device, then
    /// kvtier host and disk through the sidecar).
    #[arg(long, default_value = "tiered")]
    pub kv_reuse: KvReuse,
    /// The kvtier sidecar: unix:///path/to/kvtier.sock or http://host:port.
    #[arg(long)]
    pub sidecar: Option<String>,
    /// KV dtype in the device pool: bf16, f16 or f32.
    #[arg(long, default_value = "bf16")]
    pub kv_dtype: Dtype,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 64)]
    pub block_tokens: u32,
    /// Device pool size in blocks.
    #[arg(long, default_value_t = 1024)]
    pub device_slots: u32,
    /// Tokens per forward pass (chunked prefill budget).
    #[arg(long, default_value_t = 512)]
    pub max_batch_tokens: usize,
    /// Sequences running at once.
    #[arg(long, default_value_t = 16)]
    pub max_running: usize,
    /// Device pool file (default /dev/shm/kvtier-engine-<pid>-<n>.pool).
    #[arg(long)]
    pub pool_path: Option<PathBuf>,
}

impl EngineFlags {
    /// The engine configuration these flags give.
    pub fn config(&self) -> EngineConfig {
        EngineConfig {
            seed: self.seed,
            kv_dtype: self.kv_dtype,
            block_tokens: self.block_tokens,
            device_slots: self.device_slots,
            pool_path: self.pool_path.clone(),
            kv_reuse: self.kv_reuse,
            sidecar: self.sidecar.clone(),
            max_batch_tokens: self.max_batch_tokens,
            max_running: self.max_running,
            ..EngineConfig::default()
        }
    }

    /// Loads the model and starts the engine; returns it with the model's text codec.
    pub fn start(&self) -> Result<(Engine, TextCodec)> {
        let (model, weights, dir) = load_model(&self.model, self.layers, self.seed)
            .with_context(|| format!("loading model {}", self.model))?;
        let codec = TextCodec::for_model_dir(dir.as_deref())?;
        let engine = Engine::start(model, weights, self.config()).context("starting the engine")?;
        Ok((engine, codec))
    }
}

#[derive(Debug, Args)]
pub struct EngineArgs {
    #[command(flatten)]
    pub engine: EngineFlags,
    /// HTTP listen address.
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub listen: String,
}

pub fn run(a: EngineArgs) -> Result<()> {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .context("installing the metrics recorder")?;
    let (engine, codec) = a.engine.start()?;
    let m = engine.model();
    eprintln!(
        "kvtier engine: model {} ({} layers, {:.2} B parameters), KV {}, reuse {:?}, tokenizer {}",
        m.name,
        m.layers,
        m.parameters() as f64 / 1e9,
        engine.geometry(),
        engine.kv_reuse(),
        codec.name(),
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .thread_name("kvtier-http")
        .build()
        .context("starting the async runtime")?;
    let state = Arc::new(AppState {
        engine,
        codec,
        metrics: Some(recorder),
    });
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&a.listen)
            .await
            .with_context(|| format!("binding {}", a.listen))?;
        eprintln!("kvtier engine: serving http://{}", listener.local_addr()?);
        axum::serve(listener, router(state))
            .with_graceful_shutdown(crate::shutdown_signal())
            .await
            .context("the HTTP server failed")
    })
}
