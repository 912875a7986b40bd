//! `kvtier engine`: the reference engine behind its HTTP API.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;
use kvtier_core::Dtype;
use kvtier_engine::chat_template::ChatTemplate;
use kvtier_engine::http::{AppState, router};
use kvtier_engine::{Engine, EngineConfig, KvReuse, TextCodec, load_model};

use crate::flags::{BlockTokensFlag, ConnectFlags};

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
    /// kvtier host and disk through the sidecar), kvtier (kvtier's tiers only).
    #[arg(long, default_value = "tiered")]
    pub kv_reuse: KvReuse,
    /// The kvtier sidecar: unix:///path/to/kvtier.sock, http://host:port or
    /// https://host:port [default with --kv-reuse tiered or kvtier: the socket `kvtier serve`
    /// uses by default]
    #[arg(long)]
    pub sidecar: Option<String>,
    #[command(flatten)]
    pub connect: ConnectFlags,
    /// KV dtype in the device pool: bf16, f16 or f32.
    #[arg(long, default_value = "bf16")]
    pub kv_dtype: Dtype,
    #[command(flatten)]
    pub block: BlockTokensFlag,
    /// Device pool size in blocks.
    #[arg(long, default_value_t = 1024)]
    pub device_slots: u32,
    /// Tokens per forward pass (chunked prefill budget).
    #[arg(long, default_value_t = 512)]
    pub max_batch_tokens: usize,
    /// Sequences running at once.
    #[arg(long, default_value_t = 16)]
    pub max_running: usize,
    /// Requests waiting at most; past it requests get 503 with Retry-After.
    #[arg(long, default_value_t = 256)]
    pub max_waiting: usize,
    /// Device pool file (default /dev/shm/kvtier-engine-<pid>-<n>.pool).
    #[arg(long)]
    pub pool_path: Option<PathBuf>,
}

impl EngineFlags {
    /// The engine configuration these flags give.
    ///
    /// # Errors
    /// An unreadable token file.
    pub fn config(&self) -> Result<EngineConfig> {
        let sidecar = match self.sidecar.clone().or_else(|| {
            self.kv_reuse
                .uses_kvtier()
                .then(|| format!("unix://{}", kvtier_proto::default_socket_path().display()))
        }) {
            Some(target) => Some(self.connect.options(&target)?),
            None => None,
        };
        Ok(EngineConfig {
            seed: self.seed,
            kv_dtype: self.kv_dtype,
            block_tokens: self.block.block_tokens,
            device_slots: self.device_slots,
            pool_path: self.pool_path.clone(),
            kv_reuse: self.kv_reuse,
            sidecar,
            max_batch_tokens: self.max_batch_tokens,
            max_running: self.max_running,
            max_waiting: self.max_waiting,
            ..EngineConfig::default()
        })
    }

    /// Loads the model and starts the engine; returns it with the model's text codec and
    /// chat template.
    pub fn start(&self) -> Result<(Engine, TextCodec, ChatTemplate)> {
        let (model, weights, dir) = load_model(&self.model, self.layers, self.seed)
            .with_context(|| format!("loading model {}", self.model))?;
        let codec = TextCodec::for_model_dir(dir.as_deref())?;
        let chat = ChatTemplate::for_model_dir(dir.as_deref())?;
        let engine = Engine::start(model, weights, self.config()?).context("starting the engine")?;
        Ok((engine, codec, chat))
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
    let mut builder = metrics_exporter_prometheus::PrometheusBuilder::new();
    for (name, buckets) in kvtier_engine::metrics::BUCKETS {
        builder = builder
            .set_buckets_for_metric(
                metrics_exporter_prometheus::Matcher::Full((*name).into()),
                buckets,
            )
            .context("setting histogram buckets")?;
    }
    let recorder = builder
        .install_recorder()
        .context("installing the metrics recorder")?;
    kvtier_engine::metrics::describe();
    let (engine, codec, chat) = a.engine.start()?;
    let policy = a.engine.kv_reuse;
    let m = engine.model();
    eprintln!(
        "kvtier engine: model {} ({} layers, {:.2} B parameters), KV {}, reuse {:?}, tokenizer {}, chat template {}",
        m.name,
        m.layers,
        m.parameters() as f64 / 1e9,
        engine.geometry(),
        policy,
        codec.name(),
        chat.source(),
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
        chat,
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

/// The model a benchmark starts its engine with.
#[derive(Debug, Args)]
pub struct BenchModelArgs {
    /// A preset or a Hugging Face model directory.
    #[arg(long, default_value = "qwen3-30b-a3b")]
    pub model: String,
    /// Keep only the first N layers (default 1, as the seed experiment; 0 keeps all).
    #[arg(long, default_value_t = 1)]
    pub layers: usize,
    /// Seed of the random weights (and of the dataset).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl BenchModelArgs {
    fn layers(&self) -> Option<usize> {
        (self.layers > 0).then_some(self.layers)
    }
}

#[derive(Debug, Args)]
pub struct EngineBenchArgs {
    #[command(flatten)]
    pub model: BenchModelArgs,
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
    #[command(flatten)]
    pub block: BlockTokensFlag,
    /// Chunked-prefill budget (tokens per forward pass).
    #[arg(long, default_value_t = 512)]
    pub max_batch_tokens: usize,
    /// The sidecar: `in-process` (default), `spawn`, or the URL of a running one.
    #[arg(long, default_value = "in-process")]
    pub sidecar: String,
    #[command(flatten)]
    pub connect: ConnectFlags,
    /// The sidecar's host tier (when the benchmark starts it).
    #[arg(long, default_value = "2GiB")]
    pub host_capacity: kvtier_core::ByteSize,
    /// Print one JSON object instead of the lines.
    #[arg(long)]
    pub json: bool,
}

pub fn bench(a: EngineBenchArgs) -> Result<()> {
    let config = kvtier_bench::EngineBenchConfig {
        layers: a.model.layers(),
        seed: a.model.seed,
        model: a.model.model,
        prompt_tokens: a.prompt_tokens,
        hit_rate: a.hit_rate,
        rounds: a.rounds,
        decode_tokens: a.decode_tokens,
        decode_batches: a.decode_batch,
        block_tokens: a.block.block_tokens,
        max_batch_tokens: a.max_batch_tokens,
        sidecar: kvtier_bench::SidecarTarget::parse_with(&a.sidecar, &a.connect.options(&a.sidecar)?),
        host_capacity: a.host_capacity,
    };
    eprintln!(
        "kvtier bench engine: model {}{} | prompt {} tokens, hit {:.0}%, {} rounds, decode {} tokens at batch {:?}, sidecar {}",
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

#[derive(Debug, Args)]
pub struct ServeBenchArgs {
    /// A running engine (http://host:port); without it the benchmark starts an engine and an
    /// embedded sidecar (host and disk tiers) itself.
    #[arg(long)]
    pub base_url: Option<String>,
    #[command(flatten)]
    pub model: BenchModelArgs,
    /// Prompt tokens per request.
    #[arg(long, default_value_t = 4096)]
    pub input_len: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 16)]
    pub output_len: usize,
    /// Fraction of each prompt that is the shared prefix.
    #[arg(long, default_value_t = 0.9)]
    pub hit_rate: f64,
    /// Requests per run (default: the batch size).
    #[arg(long)]
    pub num_prompts: Option<usize>,
    /// Requests in flight at most (default: the batch size).
    #[arg(long)]
    pub max_concurrency: Option<usize>,
    /// Requests per second, Poisson arrivals ("inf": all at once).
    #[arg(long, default_value = "inf")]
    pub request_rate: f64,
    /// Batch sizes to sweep, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "4")]
    pub batch: Vec<usize>,
    /// Scenarios, comma separated: recompute, host, disk, hbm, remote (needs --remote-nodes).
    #[arg(long, value_delimiter = ',', default_value = "recompute,host,disk,hbm")]
    pub scenarios: Vec<kvtier_bench::Scenario>,
    /// A Redis Cluster's nodes (host:port, comma separated): two nodes (engine + sidecar each)
    /// share it as their remote tier, and the remote scenario measures node B serving a prefix
    /// node A computed. scripts/remote_bench.sh starts a cluster and runs this.
    #[arg(long, value_delimiter = ',')]
    pub remote_nodes: Vec<String>,
    #[command(flatten)]
    pub block: BlockTokensFlag,
    /// Chunked-prefill budget of the engine it starts.
    #[arg(long, default_value_t = 512)]
    pub max_batch_tokens: usize,
    /// Host tier of the sidecar it starts.
    #[arg(long, default_value = "2GiB")]
    pub host_capacity: kvtier_core::ByteSize,
    /// Disk tier of the sidecar it starts.
    #[arg(long, default_value = "4GiB")]
    pub disk_capacity: kvtier_core::ByteSize,
    /// Print one JSON line per run instead of the text.
    #[arg(long)]
    pub json: bool,
    /// Draw TTFT and throughput per scenario and batch size into this SVG file.
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

impl ServeBenchArgs {
    fn config(&self) -> kvtier_bench::ServeConfig {
        kvtier_bench::ServeConfig {
            base_url: self.base_url.clone(),
            model: self.model.model.clone(),
            layers: self.model.layers(),
            seed: self.model.seed,
            input_len: self.input_len,
            output_len: self.output_len,
            hit_rate: self.hit_rate,
            num_prompts: self.num_prompts,
            max_concurrency: self.max_concurrency,
            request_rate: self.request_rate,
            batches: self.batch.clone(),
            scenarios: self.scenarios.clone(),
            block_tokens: self.block.block_tokens,
            max_batch_tokens: self.max_batch_tokens,
            host_capacity: self.host_capacity,
            disk_capacity: self.disk_capacity,
            remote_nodes: self.remote_nodes.clone(),
        }
    }
}

fn run_serve_bench(config: &kvtier_bench::ServeConfig) -> Result<kvtier_bench::ServeReport> {
    eprintln!(
        "kvtier bench serve: {} | input {} output {} hit {:.0}% | batch {:?} | scenarios {}",
        config.base_url.clone().unwrap_or_else(|| format!(
            "{}{} (embedded engine + sidecar)",
            config.model,
            config
                .layers
                .map(|l| format!(" --layers {l}"))
                .unwrap_or_default()
        )),
        config.input_len,
        config.output_len,
        config.hit_rate * 100.0,
        config.batches,
        config
            .scenarios
            .iter()
            .map(|s| s.name())
            .collect::<Vec<_>>()
            .join(","),
    );
    let mut bar = kvtier_bench::ProgressBar::new("requests", 1);
    let report = kvtier_bench::run_serve(config, &mut |done, total| {
        bar.set_total(total as u64);
        bar.update(done as u64);
    });
    bar.finish();
    report.context("bench serve")
}

fn write_plot(report: &kvtier_bench::ServeReport, path: &std::path::Path) -> Result<()> {
    std::fs::write(path, report.svg()).with_context(|| format!("writing {}", path.display()))
}

pub fn serve_bench(a: ServeBenchArgs) -> Result<()> {
    let report = run_serve_bench(&a.config())?;
    if a.json {
        let mut out = std::io::stdout().lock();
        for run in &report.runs {
            use std::io::Write;
            writeln!(out, "{}", serde_json::to_string(run)?)?;
        }
    } else {
        for line in report.lines() {
            println!("{line}");
        }
    }
    if let Some(p) = &a.plot {
        write_plot(&report, p)?;
        eprintln!("plot written to {}", p.display());
    }
    Ok(())
}

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Where to draw the comparison.
    #[arg(long, default_value = "kvtier-demo.svg")]
    pub plot: PathBuf,
    /// Prompt tokens per request.
    #[arg(long, default_value_t = 4096)]
    pub input_len: usize,
    /// Concurrent requests per scenario.
    #[arg(long, default_value_t = 4)]
    pub batch: usize,
}

/// The embedded demo: sidecar + engine in this process, the four scenarios at 90% hit.
pub fn demo(a: DemoArgs) -> Result<()> {
    let config = kvtier_bench::ServeConfig {
        input_len: a.input_len,
        batches: vec![a.batch],
        ..kvtier_bench::ServeConfig::default()
    };
    let report = run_serve_bench(&config)?;
    for line in report.lines() {
        println!("{line}");
    }
    let ttft = |s: kvtier_bench::Scenario| {
        report
            .runs
            .iter()
            .find(|r| r.scenario == s)
            .map(|r| r.ttft_ms.mean)
    };
    use kvtier_bench::Scenario::{Disk, Hbm, Host, Recompute};
    if let (Some(rc), Some(h), Some(d), Some(hbm)) = (ttft(Recompute), ttft(Host), ttft(Disk), ttft(Hbm)) {
        println!();
        println!(
            "mean TTFT at 90% hit: recompute {rc:.0} ms, host {h:.0} ms, disk {d:.0} ms, hbm {hbm:.0} ms"
        );
        println!(
            "host/hbm={:.2} host/recompute={:.2} disk/hbm={:.2}",
            h / hbm,
            h / rc,
            d / hbm
        );
    }
    write_plot(&report, &a.plot)?;
    println!("plot written to {}", a.plot.display());
    Ok(())
}
