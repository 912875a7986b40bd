//! The `kvtier` command line: benchmarks and tools for kvtier's tiered KV-cache offload.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use kvtier_bench::{
    BenchDevice, MatchBenchConfig, OffloadConfig, ProgressBar, RecoveryConfig, SidecarTarget, run_match,
    run_offload, run_offload_sidecar, run_recovery,
};
use kvtier_core::{BlockHasher, ByteSize, KvGeometry, LayoutKind, Namespace, Tier};
use kvtier_cuda::CopyMethod;
use kvtier_server::ServerConfig;
use kvtier_store::{DirectIo, DiskTierConfig, EvictionKind};
use kvtier_transfer::TransferConfig;

mod engine_cmd;
mod flags;
mod sd_notify;

use flags::{ConnectFlags, GeometryArgs};

/// kvtier keeps the KV cache of prompt prefixes an LLM engine has already computed, in device
/// memory, host memory and on disk, and moves it between tiers with full-duplex load/store
/// queues, so a prefix hit costs a copy instead of a prefill.
#[derive(Debug, Parser)]
#[command(name = "kvtier", version, about, long_about)]
struct Cli {
    /// Log filter, e.g. `info` or `warn,kvtier_store=debug` (also KVTIER_LOG).
    #[arg(long, global = true, env = "KVTIER_LOG", default_value = "warn")]
    log: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The embedded demo: a kvtier sidecar and a Qwen3-30B-A3B-shaped 1-layer engine in this
    /// process, serving 4096-token prompts at 90% prefix hit four ways — recomputed, from
    /// kvtier's host tier, from its disk tier, resident in device memory — side by side.
    Demo(engine_cmd::DemoArgs),
    /// Run a benchmark (`kvtier bench offload --help`).
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Print the namespace fingerprint and chained block keys of a token sequence, as every
    /// kvtier client must compute them.
    Keys(KeysArgs),
    /// Run the gRPC sidecar: host (and disk) tiers and transfer queues behind the
    /// kvtier.v1.KvTier service on a Unix socket (and optionally TCP), with a Prometheus
    /// exporter. Configuration: defaults < --config FILE < KVTIER_* variables < flags.
    Serve(ServeArgs),
    /// Run the reference engine (a Qwen3-family model on candle, CPU) behind an OpenAI-style
    /// HTTP API, reusing prefixes from its device cache and from the kvtier sidecar.
    Engine(engine_cmd::EngineArgs),
    /// Ask a running sidecar whether it serves (grpc.health.v1); exit 0 if SERVING, 1 if not
    /// (for readiness probes).
    Health(HealthArgs),
}

#[derive(Debug, Args)]
struct HealthArgs {
    /// The sidecar: unix:///path/to/kvtier.sock, http://host:port or https://host:port
    /// [default: the socket `kvtier serve` uses by default]
    #[arg(long)]
    sidecar: Option<String>,
    /// The same as --sidecar (the form probes written before it use).
    #[arg(value_name = "SIDECAR", conflicts_with = "sidecar", hide = true)]
    target: Option<String>,
    #[command(flatten)]
    connect: ConnectFlags,
}

#[derive(Debug, Args)]
struct ServeArgs {
    /// TOML configuration file (also KVTIER_CONFIG).
    #[arg(long, env = "KVTIER_CONFIG")]
    config: Option<PathBuf>,
    /// Unix socket path (sets server.socket).
    #[arg(long)]
    socket: Option<PathBuf>,
    /// TCP address, e.g. 127.0.0.1:50051 (sets server.tcp).
    #[arg(long)]
    tcp: Option<SocketAddr>,
    /// Prometheus exporter address, or "off" (sets server.metrics).
    #[arg(long, value_parser = parse_metrics)]
    metrics: Option<Metrics>,
    /// Host tier size, e.g. 8GiB (sets host.capacity).
    #[arg(long)]
    host_capacity: Option<ByteSize>,
    /// Disk tier directory (sets disk.dir; enables the disk tier).
    #[arg(long)]
    disk_dir: Option<PathBuf>,
    /// File holding the bearer token TCP clients must send (sets server.auth_token_file; the
    /// token may also come from KVTIER_SERVER__AUTH_TOKEN, never from a flag value, which
    /// other users see in `ps`).
    #[arg(long, value_name = "FILE")]
    auth_token_file: Option<PathBuf>,
    /// Any setting as key.path=value (repeatable), e.g. --set model.layers=1 (docs/api.md
    /// lists every key). A key that one of the flags above also sets is an error: give one.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Print the effective configuration as TOML and exit.
    #[arg(long)]
    print_config: bool,
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// The seed-003 offload microbenchmark: per request, load its hit blocks into device slots
    /// and store its new blocks, at the same time, through the real duplex queues; print the
    /// seed's lines (load_span_ms … batch_duplex_bw_gib_s), a plain-memcpy baseline from the
    /// same run, the ratio to it, and a bit-exact check of every block moved.
    Offload(OffloadArgs),
    /// Match latency (p50/p99) and Match calls per second through gRPC, at several
    /// concurrencies: against a sidecar in this process by default (over a Unix socket), a
    /// spawned `kvtier serve`, or a running sidecar (--sidecar URL).
    Match(MatchArgs),
    /// The reference engine: prefill and decode tokens/s, and time to first token of a long
    /// prompt with a cached prefix, recomputed vs loaded from kvtier's host tier vs still in the
    /// device pool.
    Engine(engine_cmd::EngineBenchArgs),
    /// Serving benchmark against the engine's HTTP API (like SGLang's bench_serving): a
    /// shared prefix at --hit-rate, scenarios recompute / host / disk / hbm side by side.
    Serve(engine_cmd::ServeBenchArgs),
    /// Fill a disk tier, drop it, and time reopening it (the index rebuilt from region index
    /// files, or with --scan also from every header and payload).
    Recovery(RecoveryArgs),
}

#[derive(Debug, Args)]
struct RecoveryArgs {
    #[command(flatten)]
    geometry: GeometryArgs,
    /// Bytes of blocks to write before reopening.
    #[arg(long, default_value = "1GiB")]
    bytes: ByteSize,
    /// Directory whose disk to use (a fresh subdirectory is made in it and removed).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Region file size.
    #[arg(long, default_value = "256MiB")]
    region_size: ByteSize,
    /// Writer threads while filling.
    #[arg(long, default_value_t = 2)]
    writers: usize,
    /// Also time a reopen with every region index removed (a full scan).
    #[arg(long)]
    scan: bool,
    /// Page-cache bypass: auto, on or off.
    #[arg(long, default_value = "auto")]
    direct_io: DirectIo,
    /// Print one JSON object instead of the lines.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
struct OffloadArgs {
    #[command(flatten)]
    geometry: GeometryArgs,
    /// Tokens per request (only full blocks move).
    #[arg(long, default_value_t = 10_000)]
    tokens: usize,
    /// Fraction of each request's blocks already in the host tier (loaded); the rest are new
    /// (stored).
    #[arg(long, default_value_t = 0.9)]
    hit_rate: f64,
    /// Requests per batch.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Measured batches (default: 100 with --tier host, 20 with --tier disk or remote).
    #[arg(long)]
    rounds: Option<usize>,
    /// Unmeasured batches before them.
    #[arg(long, default_value_t = 3)]
    warmup_rounds: usize,
    /// Host tier size, e.g. 2GiB (default: the hit blocks plus four batches of new blocks).
    #[arg(long)]
    host_capacity: Option<ByteSize>,
    /// Host tier eviction policy: s3fifo or lru.
    #[arg(long, default_value = "s3fifo")]
    eviction: EvictionKind,
    /// Load worker threads (0 = one per CPU).
    #[arg(long, default_value_t = 0)]
    load_threads: usize,
    /// Store worker threads (0 = half the CPUs, at least one).
    #[arg(long, default_value_t = 0)]
    store_threads: usize,
    /// Bytes one worker copies per claim.
    #[arg(long, default_value = "1MiB")]
    chunk_bytes: ByteSize,
    /// Scheduling niceness of store workers (positive lets loads win the CPU).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    store_nice: i32,
    /// Where the hit blocks are: `host` (loads host → device), `disk` (host tier emptied
    /// before every batch: loads disk → host → device, stores device → host → disk) or
    /// `remote` (likewise with a Redis Cluster: --remote-nodes; scripts/remote_bench.sh starts
    /// one and runs this).
    #[arg(long, default_value = "host")]
    tier: Tier,
    /// With --tier remote: the cluster's nodes, host:port, comma separated
    /// (`scripts/redis_cluster.sh start DIR` prints them).
    #[arg(long, value_delimiter = ',')]
    remote_nodes: Vec<String>,
    /// With --tier disk: the directory whose disk to measure (a fresh subdirectory is made in
    /// it and removed afterwards; default: the system's temporary directory).
    #[arg(long)]
    disk_dir: Option<PathBuf>,
    /// With --tier disk: page-cache bypass, auto (O_DIRECT if the file system allows it), on
    /// or off.
    #[arg(long, default_value = "auto")]
    direct_io: DirectIo,
    /// Where the device pool lives: `cpu` (shared memory) or `cuda` (GPU 0's memory, copied
    /// over PCIe; adds the pinned cudaMemcpyAsync baselines and ratios to the output).
    #[arg(long, default_value = "cpu")]
    device: BenchDevice,
    /// The device pool's layout: `kvtier` ([slot][K|V]), `vllm` (per layer [2, blocks, …]: K
    /// and V planes apart), `vllm-lbnhc` / `vllm-lbhnc` (vLLM ≥ 0.34: per layer [blocks,
    /// token, head, K‖V] / [blocks, head, token, K‖V], K and V interleaved) or `sglang` (a K
    /// and a V buffer per layer).
    #[arg(long, default_value = "kvtier")]
    layout: LayoutKind,
    /// With --device cuda: `auto` (the copy kernel where K and V are apart, cudaMemcpyAsync
    /// otherwise), `memcpy` or `kernel`.
    #[arg(long, default_value = "auto")]
    cuda_copy: CopyMethod,
    /// Run the workload through a gRPC sidecar instead, as an engine process would, and also
    /// in-process in the same run, and print both and their ratio: `spawn` (start `kvtier
    /// serve` as a child with matching settings), `in-process`, or the URL of a running
    /// sidecar (unix:///path, http://host:port, https://host:port), whose geometry is used
    /// unless flags say otherwise. Each run uses a namespace of its own and clears it at the
    /// end, so runs against one long-running sidecar repeat.
    #[arg(long)]
    sidecar: Option<String>,
    #[command(flatten)]
    connect: ConnectFlags,
    /// Print one JSON object with the configuration and every figure instead of the lines.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
struct MatchArgs {
    #[command(flatten)]
    geometry: GeometryArgs,
    /// The sidecar: `in-process` (one on its own threads in this process, over a Unix socket),
    /// `spawn` (a `kvtier serve` child), or the URL of a running one (unix:///path,
    /// http://host:port, https://host:port; its geometry is used unless flags say otherwise).
    #[arg(long, default_value = "in-process")]
    sidecar: String,
    #[command(flatten)]
    connect: ConnectFlags,
    /// Concurrency levels (clients, each with its own connection and session).
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    clients: Vec<usize>,
    /// Match calls per concurrency level.
    #[arg(long, default_value_t = 20_000)]
    requests: usize,
    /// Keys per Match call (156 = a 10,000-token prompt in blocks of 64).
    #[arg(long, default_value_t = 156)]
    blocks: usize,
    /// Print one JSON object instead of the lines.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
struct KeysArgs {
    /// Model id (whatever changes when the KV would change).
    #[arg(long)]
    model_id: String,
    /// The geometry is part of the namespace; left out, it is `kvtier serve`'s default (48
    /// layers), so keys match a sidecar run with defaults.
    #[command(flatten)]
    geometry: GeometryArgs,
    /// Tensor-parallel rank.
    #[arg(long, default_value_t = 0)]
    tp_rank: u32,
    /// Tensor-parallel size.
    #[arg(long, default_value_t = 1)]
    tp_size: u32,
    /// Tenant salt.
    #[arg(long, default_value = "")]
    cache_salt: String,
    /// Token ids, comma separated.
    #[arg(long, value_delimiter = ',', required = true)]
    tokens: Vec<u32>,
}

fn main() -> ExitCode {
    let matches = serve_help_defaults(Cli::command()).get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    init_logging(&cli.log);
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvtier: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// `serve`'s flags have no clap defaults (a flag left out must not override the file or the
/// environment), so their help shows the built-in defaults, taken from [`ServerConfig`].
fn serve_help_defaults(cli: clap::Command) -> clap::Command {
    let d = ServerConfig::default();
    let defaults = [
        (
            "socket",
            format!(
                "$XDG_RUNTIME_DIR/kvtier.sock, else /tmp/kvtier-<uid>.sock; here {}",
                d.server.socket.display()
            ),
        ),
        ("tcp", "off".to_owned()),
        (
            "metrics",
            d.server.metrics.map_or("off".to_owned(), |m| m.to_string()),
        ),
        ("host_capacity", d.host.capacity.to_string()),
        ("disk_dir", "off (no disk tier)".to_owned()),
        ("auth_token_file", "off".to_owned()),
    ];
    cli.mut_subcommand("serve", |mut serve| {
        for (id, default) in defaults {
            serve = serve.mut_arg(id, |a| {
                let help = a.get_help().map(ToString::to_string).unwrap_or_default();
                a.help(format!("{help} [default: {default}]"))
            });
        }
        serve
    })
}

fn init_logging(filter: &str) {
    let targets: tracing_subscriber::filter::Targets = filter.parse().unwrap_or_else(|e| {
        eprintln!("kvtier: ignoring log filter {filter:?}: {e}");
        tracing_subscriber::filter::Targets::new().with_default(tracing::Level::WARN)
    });
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    tracing_subscriber::registry()
        .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
        .with(targets)
        .init();
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Bench(BenchCommand::Offload(a)) => bench_offload(a),
        Command::Bench(BenchCommand::Recovery(a)) => bench_recovery(a),
        Command::Bench(BenchCommand::Match(a)) => bench_match(a),
        Command::Bench(BenchCommand::Engine(a)) => engine_cmd::bench(a),
        Command::Bench(BenchCommand::Serve(a)) => engine_cmd::serve_bench(a),
        Command::Demo(a) => engine_cmd::demo(a),
        Command::Keys(a) => keys(a),
        Command::Serve(a) => serve(a),
        Command::Health(a) => health(a),
        Command::Engine(a) => engine_cmd::run(a),
    }
}

/// The geometry of a benchmark against `target`: the flags given, the rest from a running
/// sidecar's own geometry, else from the benchmarks' default.
fn bench_geometry(flags: &GeometryArgs, target: Option<&SidecarTarget>) -> Result<KvGeometry> {
    match target {
        Some(SidecarTarget::Url(connect)) => flags.over(kvtier_bench::sidecar_geometry(connect)?),
        _ => flags.geometry(),
    }
}

fn bench_offload(a: OffloadArgs) -> Result<()> {
    let target = match &a.sidecar {
        Some(s) => Some(SidecarTarget::parse_with(s, &a.connect.options(s)?)),
        None => None,
    };
    let g = bench_geometry(&a.geometry, target.as_ref())?;
    let rounds = a.rounds.unwrap_or(match a.tier {
        Tier::Disk | Tier::Remote => 20,
        Tier::Device | Tier::Host => 100,
    });
    let config = OffloadConfig {
        layers: g.layers(),
        kv_heads: g.kv_heads(),
        head_dim: g.head_dim(),
        dtype: g.dtype(),
        block_tokens: g.block_tokens(),
        tokens: a.tokens,
        hit_rate: a.hit_rate,
        batch: a.batch,
        rounds,
        warmup_rounds: a.warmup_rounds,
        host_capacity: a.host_capacity,
        eviction: a.eviction,
        tier: a.tier,
        disk_dir: a.disk_dir.clone(),
        direct_io: a.direct_io,
        remote_nodes: a.remote_nodes.clone(),
        transfer: TransferConfig {
            load_threads: a.load_threads,
            store_threads: a.store_threads,
            chunk_bytes: a.chunk_bytes,
            store_nice: a.store_nice,
            ..TransferConfig::default()
        },
        device: a.device,
        layout: a.layout,
        cuda_copy: a.cuda_copy,
    };
    if target.is_some() && a.device == BenchDevice::Cuda {
        anyhow::bail!(
            "--device cuda runs in-process (the sidecar is handed CUDA pools by IPC handle: scripts/gpu-check.sh)"
        );
    }
    eprintln!(
        "kvtier bench offload: tier {:?} | device {} layout {} | {} | {} tokens/request, hit {:.0}%, batch {}, {} rounds (+{} warm-up), threads load={} store={}",
        a.tier,
        if a.device == BenchDevice::Cuda {
            "cuda"
        } else {
            "cpu"
        },
        a.layout,
        g,
        a.tokens,
        a.hit_rate * 100.0,
        a.batch,
        rounds,
        a.warmup_rounds,
        config.transfer.resolved_load_threads(),
        config.transfer.resolved_store_threads(),
    );
    if let Some(target) = target {
        let mut bar = ProgressBar::new("offload", 2 * (rounds + a.warmup_rounds) as u64);
        let report = run_offload_sidecar(&config, &target, &mut |done, _| bar.update(done as u64));
        bar.finish();
        return print_report(&report.context("bench offload --sidecar")?, a.json, |r| r.lines());
    }
    let mut bar = ProgressBar::new("offload", (rounds + a.warmup_rounds) as u64);
    let report = run_offload(&config, &mut |done, _| bar.update(done as u64));
    bar.finish();
    print_report(&report.context("bench offload")?, a.json, |r| r.lines())
}

fn bench_match(a: MatchArgs) -> Result<()> {
    let target = SidecarTarget::parse_with(&a.sidecar, &a.connect.options(&a.sidecar)?);
    let config = MatchBenchConfig {
        geometry: bench_geometry(&a.geometry, Some(&target))?,
        target,
        clients: a.clients,
        requests: a.requests,
        blocks: a.blocks,
    };
    eprintln!(
        "kvtier bench match: {} keys per call, {} calls per level, clients {:?}, sidecar {}",
        config.blocks, config.requests, config.clients, config.target
    );
    let mut bar = ProgressBar::new("match", config.clients.len() as u64);
    let report = run_match(&config, &mut |done, _| bar.update(done as u64));
    bar.finish();
    print_report(&report.context("bench match")?, a.json, |r| r.lines())
}

fn bench_recovery(a: RecoveryArgs) -> Result<()> {
    let config = RecoveryConfig {
        geometry: a.geometry.geometry()?,
        bytes: a.bytes,
        dir: a.dir,
        region_size: a.region_size,
        writers: a.writers,
        scan: a.scan,
        direct_io: a.direct_io,
    };
    eprintln!(
        "kvtier bench recovery: {} | {} of blocks",
        config.geometry, config.bytes
    );
    let mut bar = ProgressBar::new("fill", 1);
    let report = run_recovery(&config, &mut |done, total| {
        bar.set_total(total);
        bar.update(done);
    });
    bar.finish();
    print_report(&report.context("bench recovery")?, a.json, |r| r.lines())
}

/// Prints a report as its lines, or as one JSON object.
fn print_report<R: serde::Serialize>(
    report: &R,
    json: bool,
    lines: impl Fn(&R) -> Vec<String>,
) -> Result<()> {
    let mut out = std::io::stdout().lock();
    if json {
        serde_json::to_writer(&mut out, report)?;
        writeln!(out)?;
    } else {
        for line in lines(report) {
            writeln!(out, "{line}")?;
        }
    }
    Ok(())
}

/// `--metrics`: an exporter address or `off`.
#[derive(Debug, Clone, Copy)]
struct Metrics(Option<SocketAddr>);

fn parse_metrics(s: &str) -> Result<Metrics, String> {
    if s == "off" {
        return Ok(Metrics(None));
    }
    s.parse()
        .map(|a| Metrics(Some(a)))
        .map_err(|e| format!("{e}: give host:port, such as 127.0.0.1:9400 or 0.0.0.0:9400, or off"))
}

impl ServeArgs {
    /// The keys the dedicated flags given set, with the flag.
    fn flag_keys(&self) -> Vec<(&'static str, &'static str)> {
        [
            (self.socket.is_some(), "--socket", "server.socket"),
            (self.tcp.is_some(), "--tcp", "server.tcp"),
            (self.metrics.is_some(), "--metrics", "server.metrics"),
            (self.host_capacity.is_some(), "--host-capacity", "host.capacity"),
            (self.disk_dir.is_some(), "--disk-dir", "disk.dir"),
            (
                self.auth_token_file.is_some(),
                "--auth-token-file",
                "server.auth_token_file",
            ),
        ]
        .into_iter()
        .filter_map(|(given, flag, key)| given.then_some((flag, key)))
        .collect()
    }

    /// Refuses a key given both by a dedicated flag and by --set (which of them should win
    /// would depend on an order nobody sees).
    fn check_conflicts(&self) -> Result<()> {
        for (flag, key) in self.flag_keys() {
            if let Some(o) = self
                .set
                .iter()
                .find(|o| o.split_once('=').is_some_and(|(k, _)| k.trim() == key))
            {
                anyhow::bail!("{flag} and --set {o} both set {key}: give one");
            }
        }
        Ok(())
    }

    /// Assigns the typed flags over the loaded configuration (they win over the file and the
    /// variables; [`ServeArgs::check_conflicts`] keeps them apart from --set).
    fn apply(&self, config: &mut ServerConfig) {
        if let Some(s) = &self.socket {
            config.server.socket = s.clone();
        }
        if let Some(t) = self.tcp {
            config.server.tcp = Some(t);
        }
        if let Some(Metrics(m)) = self.metrics {
            config.server.metrics = m;
        }
        if let Some(c) = self.host_capacity {
            config.host.capacity = c;
        }
        if let Some(d) = &self.disk_dir {
            let disk = config.disk.get_or_insert_with(DiskTierConfig::default);
            disk.dir = d.clone();
        }
        if let Some(f) = &self.auth_token_file {
            config.server.auth_token_file = Some(f.clone());
        }
    }
}

fn serve(a: ServeArgs) -> Result<()> {
    a.check_conflicts()?;
    let mut config = ServerConfig::load(a.config.as_deref(), std::env::vars(), &a.set)?;
    a.apply(&mut config);
    config.validate()?;
    if a.print_config {
        print!("{}", config.to_toml());
        return Ok(());
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(config.server.resolved_rpc_threads())
        .enable_all()
        .thread_name("kvtier-rpc")
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let stopping = async {
            shutdown_signal().await;
            sd_notify::notify("STOPPING=1");
        };
        let server = tokio::spawn(kvtier_server::serve(config, stopping, Some(ready_tx)));
        if let Ok(info) = ready_rx.await {
            eprintln!(
                "kvtier: serving {} on unix://{}{}{}",
                info.state.geometry,
                info.socket.display(),
                info.tcp.map(|t| format!(" and tcp://{t}")).unwrap_or_default(),
                info.metrics
                    .map(|m| format!("; metrics on http://{m}/metrics"))
                    .unwrap_or_default(),
            );
            sd_notify::notify("READY=1");
        }
        server.await.context("the server task failed")??;
        anyhow::Ok(())
    })
}

fn health(a: HealthArgs) -> Result<()> {
    let target = match a.sidecar.or(a.target) {
        Some(t) => t,
        None => format!("unix://{}", ServerConfig::default().server.socket.display()),
    };
    let connect = a.connect.options(&target)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let channel = connect.channel().await?;
        let mut client =
            tonic_health::pb::health_client::HealthClient::with_interceptor(channel, connect.auth()?);
        let status = client
            .check(tonic_health::pb::HealthCheckRequest {
                service: "kvtier.v1.KvTier".into(),
            })
            .await
            .map_err(|s| anyhow::anyhow!("{target}: {}", s.message()))?
            .into_inner()
            .status();
        println!("{target}: {}", status.as_str_name());
        anyhow::ensure!(
            status == tonic_health::pb::health_check_response::ServingStatus::Serving,
            "{target} is not serving"
        );
        Ok(())
    })
}

/// Resolves on SIGTERM or SIGINT.
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt()))
    else {
        // Without signal handlers, run until killed.
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

fn keys(a: KeysArgs) -> Result<()> {
    let geometry = a.geometry.over(ServerConfig::default().model.geometry()?)?;
    let ns = Namespace::new(a.model_id, geometry, a.tp_rank, a.tp_size, a.cache_salt)?;
    let fp = ns.fingerprint();
    let keys = BlockHasher::new(fp, geometry.block_tokens()).keys(&a.tokens);
    let mut out = std::io::stdout().lock();
    writeln!(out, "fingerprint={fp}")?;
    for (i, k) in keys.iter().enumerate() {
        writeln!(out, "key[{i}]={k}")?;
    }
    if !a.tokens.len().is_multiple_of(geometry.block_tokens() as usize) {
        eprintln!(
            "kvtier keys: {} trailing tokens do not fill a block and have no key",
            a.tokens.len() % geometry.block_tokens() as usize
        );
    }
    Ok(())
}
