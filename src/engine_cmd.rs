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
    /// The kvtier sidecar: unix:///path/to/kvtier.sock or http://host:port (default with
    /// --kv-reuse tiered: the socket `kvtier serve` uses by default).
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
            sidecar: self.sidecar.clone().or_else(|| {
                (self.kv_reuse == KvReuse::Tiered).then(|| {
                    format!(
                        "unix://{}",
                        kvtier_server::ServerConfig::default().server.socket.display()
                    )
                })
            }),
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

#[derive(Debug, Args)]
pub struct EngineBenchArgs {
    /// A preset or a Hugging Face model directory.
    #[arg(long, default_value = "qwen3-30b-a3b")]
    pub model: String,
    /// Keep only the first N layers (default 1, as the seed experiment; 0 keeps all).
    #[arg(long, default_value_t = 1)]
    pub layers: usize,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Prompt length of the TTFT scenarios.
    #[arg(long, default_value_t = 4096)]
    pub prompt_tokens: usize,
    /// Cached fraction of the prompt in the host and device scenarios.
    #[arg(long, default_value_t = 0.9)]
    pub hit_rate: f64,
    /// Measured requests per scenario.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Tokens per decode sequence.
    #[arg(long, default_value_t = 32)]
    pub decode_tokens: usize,
    /// Concurrent sequences of the decode measurements.
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    pub decode_batch: Vec<usize>,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 64)]
    pub block_tokens: u32,
    /// Chunked-prefill budget (tokens per forward pass).
    #[arg(long, default_value_t = 512)]
    pub max_batch_tokens: usize,
    /// The sidecar: `in-process` (default), `spawn`, or a URL.
    #[arg(long, default_value = "in-process")]
    pub sidecar: String,
    /// The sidecar's host tier (when the benchmark starts it).
    #[arg(long, default_value = "2GiB")]
    pub host_capacity: kvtier_core::ByteSize,
    /// Print one JSON object instead of the lines.
    #[arg(long)]
    pub json: bool,
}

pub fn bench(a: EngineBenchArgs) -> Result<()> {
    let config = kvtier_bench::EngineBenchConfig {
        model: a.model,
        layers: (a.layers > 0).then_some(a.layers),
        seed: a.seed,
        prompt_tokens: a.prompt_tokens,
        hit_rate: a.hit_rate,
        rounds: a.rounds,
        decode_tokens: a.decode_tokens,
        decode_batches: a.decode_batch,
        block_tokens: a.block_tokens,
        max_batch_tokens: a.max_batch_tokens,
        sidecar: kvtier_bench::SidecarTarget::parse(&a.sidecar),
        host_capacity: a.host_capacity,
    };
    eprintln!(
        "kvtier bench engine: model {}{} | prompt {} tokens, hit {:.0}%, {} rounds, decode {} tokens at batch {:?}, sidecar {:?}",
        config.model,
        config
            .layers
            .map(|l| format!(" --layers {l}"))
            .unwrap_or_default(),
        config.prompt_tokens,
        config.hit_rate * 100.0,
        config.rounds,
        config.decode_tokens,
        config.decode_batches,
        config.sidecar,
    );
    let mut bar = kvtier_bench::ProgressBar::new("requests", 1);
    let report = kvtier_bench::run_engine_bench(&config, &mut |done, total| {
        bar.set_total(total as u64);
        bar.update(done as u64);
    });
    bar.finish();
    crate::print_report(&report.context("bench engine")?, a.json, |r| r.lines())
}
