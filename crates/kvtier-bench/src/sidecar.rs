//! Benchmarks through the real gRPC path: `kvtier bench offload --sidecar` (the seed-003
//! workload as an engine process drives it through a sidecar, next to the in-process figure
//! from the same run) and `kvtier bench match` (Match latency and throughput over the socket).

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_client::{Client, ConnectOptions, PoolHandle};
use kvtier_core::{BlockKey, ByteSize, KvGeometry, Tier};
use kvtier_proto::wire::{pack_key, pack_keys};
use kvtier_proto::{WireTiming, proto};
use kvtier_server::ServerConfig;
use kvtier_transfer::TransferTiming;
use serde::Serialize;

use crate::summary::Summary;
use crate::workload::{BatchResult, RequestResult, Samples, SeedFigures, Workload, record, run_model_id};
use crate::{BenchError, OffloadConfig, OffloadReport, run_offload};

/// Which sidecar a gRPC benchmark talks to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum SidecarTarget {
    /// A running sidecar (`unix:///path`, `http://host:port` or `https://host:port`, with
    /// TLS settings and a token when it needs them); its geometry must match.
    Url(ConnectOptions),
    /// `kvtier serve` started by the benchmark as a child process from this executable, with
    /// the benchmark's geometry and sizes.
    Spawn(PathBuf),
    /// A sidecar on its own runtime threads in this process (still gRPC over a Unix socket).
    InProcess,
}

impl SidecarTarget {
    /// `spawn` starts a child from the current executable, `in-process` runs one here, anything
    /// else is a URL (reached without TLS settings or a token; see
    /// [`SidecarTarget::parse_with`]).
    pub fn parse(s: &str) -> Self {
        Self::parse_with(s, &ConnectOptions::default())
    }

    /// [`SidecarTarget::parse`], reaching a URL with `connect`'s TLS settings and token.
    pub fn parse_with(s: &str, connect: &ConnectOptions) -> Self {
        match s {
            "spawn" => {
                SidecarTarget::Spawn(std::env::current_exe().unwrap_or_else(|_| PathBuf::from("kvtier")))
            }
            "in-process" => SidecarTarget::InProcess,
            url => SidecarTarget::Url(connect.with_target(url)),
        }
    }
}

impl std::fmt::Display for SidecarTarget {
    /// `in-process`, `spawn`, or the URL (never the token).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SidecarTarget::Url(c) => f.write_str(&c.target),
            SidecarTarget::Spawn(_) => f.write_str("spawn"),
            SidecarTarget::InProcess => f.write_str("in-process"),
        }
    }
}

fn rpc_err(e: impl std::fmt::Display) -> BenchError {
    BenchError::InvalidConfig(format!("sidecar: {e}"))
}

/// An in-process sidecar: its runtime, its stop signal and its task.
type InProcessServer = (
    tokio::runtime::Runtime,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), kvtier_server::ServerError>>,
);

/// A sidecar the benchmark started (child process or in-process), stopped on drop.
#[derive(Default)]
pub(crate) struct Running {
    child: Option<Child>,
    in_process: Option<InProcessServer>,
    _dir: Option<tempfile::TempDir>,
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(c) = &mut self.child {
            // SAFETY: a signal to our own child.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let _ = c.wait();
        }
        if let Some((runtime, stop, task)) = self.in_process.take() {
            let _ = stop.send(());
            let _ = runtime.block_on(task);
        }
    }
}

/// `--set` overrides for a sidecar serving `geometry` with a `host` tier and no metrics
/// listener.
pub(crate) fn base_overrides(geometry: &KvGeometry, host: ByteSize) -> Vec<String> {
    vec![
        format!("model.layers={}", geometry.layers()),
        format!("model.kv_heads={}", geometry.kv_heads()),
        format!("model.head_dim={}", geometry.head_dim()),
        format!("model.dtype=\"{}\"", geometry.dtype()),
        format!("model.block_tokens={}", geometry.block_tokens()),
        format!("host.capacity=\"{host}\""),
        "server.metrics=\"off\"".into(),
    ]
}

/// `--set` overrides that give a sidecar the benchmark's geometry and sizes.
fn server_overrides(geometry: &KvGeometry, host: ByteSize, config: &OffloadConfig) -> Vec<String> {
    let t = &config.transfer;
    let mut o = base_overrides(geometry, host);
    o.extend([
        format!(
            "host.eviction=\"{}\"",
            match config.eviction {
                kvtier_store::EvictionKind::Lru => "lru",
                _ => "s3fifo",
            }
        ),
        format!("transfer.load_threads={}", t.load_threads),
        format!("transfer.store_threads={}", t.store_threads),
        format!("transfer.chunk_bytes=\"{}\"", t.chunk_bytes),
        format!("transfer.store_nice={}", t.store_nice),
    ]);
    o
}

/// Starts (or names) the sidecar with `overrides` (`key.path=value`); returns how to reach it
/// and a guard that stops it.
pub(crate) fn start(
    target: &SidecarTarget,
    overrides: &[String],
) -> Result<(ConnectOptions, Running), BenchError> {
    match target {
        SidecarTarget::Url(url) => Ok((url.clone(), Running::default())),
        SidecarTarget::Spawn(exe) => {
            let dir = tempfile::tempdir().map_err(rpc_err)?;
            let socket = dir.path().join("kvtier.sock");
            let mut cmd = Command::new(exe);
            cmd.arg("serve").arg("--socket").arg(&socket);
            for o in overrides {
                cmd.arg("--set").arg(o);
            }
            let mut child = cmd
                .stderr(Stdio::piped())
                .spawn()
                .map_err(|e| rpc_err(format!("starting {}: {e}", exe.display())))?;
            let stderr = child.stderr.take().ok_or_else(|| rpc_err("no stderr"))?;
            let mut lines = std::io::BufReader::new(stderr).lines();
            loop {
                match lines.next() {
                    Some(Ok(l)) if l.contains("kvtier: serving") => break,
                    Some(Ok(_)) => {}
                    _ => return Err(rpc_err("the spawned sidecar exited before serving")),
                }
            }
            std::thread::spawn(move || for _ in lines {});
            Ok((
                ConnectOptions::new(format!("unix://{}", socket.display())),
                Running {
                    child: Some(child),
                    in_process: None,
                    _dir: Some(dir),
                },
            ))
        }
        SidecarTarget::InProcess => {
            let dir = tempfile::tempdir().map_err(rpc_err)?;
            let socket = dir.path().join("kvtier.sock");
            let mut server_config = ServerConfig::load(None, Vec::new(), overrides).map_err(rpc_err)?;
            server_config.server.socket = socket.clone();
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(server_config.server.resolved_rpc_threads())
                .thread_name("kvtier-sidecar")
                .enable_all()
                .build()
                .map_err(rpc_err)?;
            let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
            let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
            let task = runtime.spawn(kvtier_server::serve(
                server_config,
                async move {
                    let _ = stop_rx.await;
                },
                Some(ready_tx),
            ));
            runtime
                .block_on(ready_rx)
                .map_err(|_| rpc_err("the in-process sidecar did not start"))?;
            Ok((
                ConnectOptions::new(format!("unix://{}", socket.display())),
                Running {
                    child: None,
                    in_process: Some((runtime, stop_tx, task)),
                    _dir: Some(dir),
                },
            ))
        }
    }
}

/// The geometry a running sidecar serves (asked by opening a session and closing it), for
/// benchmarks that take their geometry from the server they run against.
///
/// # Errors
/// [`BenchError::InvalidConfig`] naming the sidecar when it cannot be reached.
pub fn sidecar_geometry(connect: &ConnectOptions) -> Result<KvGeometry, BenchError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(rpc_err)?;
    let client = rt
        .block_on(Client::connect_with(connect, "kvtier-bench-geometry"))
        .map_err(|e| rpc_err(format!("{}: {e}", connect.target)))?;
    Ok(client.geometry())
}

/// Clears this run's namespace from the sidecar's tiers when the run ends (also on an error
/// part-way), so runs against a long-running sidecar leave nothing behind.
struct Cleanup<'a> {
    rt: &'a tokio::runtime::Runtime,
    /// A clone of the run's client (same session) and its pool; taken when cleared.
    session: Option<(Client, PoolHandle)>,
}

impl<'a> Cleanup<'a> {
    fn new(rt: &'a tokio::runtime::Runtime, client: &Client, pool: &PoolHandle) -> Self {
        Self {
            rt,
            session: Some((client.clone(), pool.clone())),
        }
    }

    fn run(&mut self) {
        let Some((mut client, pool)) = self.session.take() else {
            return;
        };
        if let Err(e) = self.rt.block_on(client.clear(&pool, "", false, None)) {
            eprintln!("kvtier bench: could not clear this run's blocks from the sidecar: {e}");
        }
    }
}

impl Drop for Cleanup<'_> {
    fn drop(&mut self) {
        self.run();
    }
}

/// The client side's runtime, sized like the sidecar's (half the CPUs).
fn client_runtime() -> Result<tokio::runtime::Runtime, BenchError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads((std::thread::available_parallelism().map_or(1, |n| n.get()) / 2).max(1))
        .thread_name("kvtier-bench-client")
        .enable_all()
        .build()
        .map_err(rpc_err)
}

/// A pool file another process can open: under /dev/shm when there is one.
pub(crate) fn pool_path(tag: &str) -> PathBuf {
    let shm = Path::new("/dev/shm");
    let dir = if shm.is_dir() {
        shm.to_owned()
    } else {
        std::env::temp_dir()
    };
    dir.join(format!("kvtier-bench-{tag}-{}", std::process::id()))
}

/// A server's relative timing placed on the client's clock, from when the request was sent.
fn timing_at(sent: Instant, t: Option<proto::TransferTiming>) -> TransferTiming {
    let t = WireTiming::from(t.unwrap_or_default());
    TransferTiming {
        submitted: sent,
        first_copy_start: Some(sent + t.queue),
        last_copy_end: Some(sent + t.latency),
        active: t.active,
        copy_calls: 0,
    }
}

/// The offload benchmark through a sidecar, with the in-process figure from the same run.
#[derive(Debug, Clone, Serialize)]
pub struct SidecarOffloadReport {
    /// The sidecar used.
    pub target: SidecarTarget,
    /// The seed's ten figures through gRPC (span/active from the sidecar's timings, placed on
    /// the client's clock from when each request was sent).
    pub sidecar: Vec<String>,
    /// Blocks checked bit-exact after their load or store.
    pub verified_blocks: u64,
    /// Blocks whose bytes differed.
    pub mismatched_blocks: u64,
    /// Store blocks the sidecar dropped.
    pub dropped_stores: u64,
    /// `batch_duplex_bw_gib_s` mean through the sidecar.
    pub sidecar_batch_duplex_bw_gib_s: f64,
    /// The same figure in-process, same configuration, same run.
    pub in_process_batch_duplex_bw_gib_s: f64,
    /// Sidecar / in-process.
    pub sidecar_ratio_to_in_process: f64,
    /// The in-process run in full.
    pub in_process: OffloadReport,
}

impl SidecarOffloadReport {
    /// Output lines.
    pub fn lines(&self) -> Vec<String> {
        let mut v = self.sidecar.clone();
        v.push(format!(
            "verified_blocks={} mismatched_blocks={}",
            self.verified_blocks, self.mismatched_blocks
        ));
        v.push(format!("dropped_stores={}", self.dropped_stores));
        v.push(format!(
            "in_process_batch_duplex_bw_gib_s={:.2}",
            self.in_process_batch_duplex_bw_gib_s
        ));
        v.push(format!(
            "sidecar_ratio_to_in_process={:.3}",
            self.sidecar_ratio_to_in_process
        ));
        v
    }
}

/// Runs the offload workload through a sidecar, then in-process, and compares.
///
/// # Errors
/// Configuration, connection and transfer errors.
pub fn run_offload_sidecar(
    config: &OffloadConfig,
    target: &SidecarTarget,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<SidecarOffloadReport, BenchError> {
    if config.tier != Tier::Host {
        return Err(BenchError::InvalidConfig(
            "--sidecar measures the host tier; drop --tier disk".into(),
        ));
    }
    let total = 2 * (config.warmup_rounds + config.rounds);
    let path = pool_path("offload");
    // A namespace of this run's own: a long-running sidecar may hold an earlier run's blocks.
    let model_id = run_model_id();
    let mut work = Workload::for_model(config, Some(&path), &model_id)?;
    let host = work.host_capacity()?;
    let (url, _running) = start(target, &server_overrides(&work.geometry, host, config))?;
    let rt = client_runtime()?;
    let mut client = rt
        .block_on(Client::connect_with(&url, "kvtier-bench"))
        .map_err(rpc_err)?;
    if client.geometry() != work.geometry {
        return Err(BenchError::InvalidConfig(format!(
            "the sidecar serves {}, the benchmark uses {}",
            client.geometry(),
            work.geometry
        )));
    }
    let pool = rt
        .block_on(client.register_cpu_pool(work.pool.cpu()?, &model_id, 0, 1))
        .map_err(rpc_err)?;
    let mut cleanup = Cleanup::new(&rt, &client, &pool);
    for r in 0..config.batch {
        if work.hit == 0 {
            break;
        }
        let blocks: Vec<_> = work.prefix_store(r).iter().map(|b| (b.key, b.slot)).collect();
        let s = rt
            .block_on(client.store(&pool, "", None, &blocks))
            .map_err(rpc_err)?;
        if s.stored_blocks as usize != work.hit {
            return Err(BenchError::InvalidConfig(format!(
                "only {} of {} prefix blocks stored",
                s.stored_blocks, work.hit
            )));
        }
    }
    let mut samples = Samples::default();
    let (mut verified, mut mismatched, mut dropped) = (0, 0, 0u64);
    let rounds = config.warmup_rounds + config.rounds;
    for round in 0..rounds {
        let new = work.prepare(round)?;
        for req in &work.requests {
            let m = rt
                .block_on(client.match_keys(&pool, "", &req.prefix))
                .map_err(rpc_err)?;
            if m.blocks.len() != work.hit {
                return Err(BenchError::InvalidConfig(
                    "hit blocks left the sidecar's host tier; raise --host-capacity".into(),
                ));
            }
        }
        let batch = rt.block_on(run_batch(&client, &pool, &work, &new))?;
        dropped += batch.1;
        if round >= config.warmup_rounds {
            record(&mut samples, &batch.0);
        }
        // Verify (untimed): loaded slots, then each stored block loaded back into its slot.
        let (ok, bad) = work.verify_loaded();
        let stored_back = rt.block_on(load_back(&mut client, &pool, &work, &new))?;
        let (ok2, bad2) = work.verify_stored(&new, |r, b, _, layer| {
            stored_back[r][b].then(|| {
                work.pool
                    .slot_layer_xxh3(work.requests[r].first_slot + (work.hit + b) as u32, layer)
                    .ok()
            })?
        });
        verified += ok + ok2;
        mismatched += bad + bad2;
        progress(round + 1, total);
    }
    let seed: SeedFigures = samples.seed_figures();
    cleanup.run();
    drop(client);
    drop(_running);
    let offset = config.warmup_rounds + config.rounds;
    let in_process = run_offload(config, &mut |d, _| progress(offset + d, total))?;
    let side = seed.batch_duplex_bw_gib_s.mean;
    let inp = in_process.seed.batch_duplex_bw_gib_s.mean;
    Ok(SidecarOffloadReport {
        target: target.clone(),
        sidecar: seed.lines(),
        verified_blocks: verified,
        mismatched_blocks: mismatched,
        dropped_stores: dropped,
        sidecar_batch_duplex_bw_gib_s: side,
        in_process_batch_duplex_bw_gib_s: inp,
        sidecar_ratio_to_in_process: if inp > 0.0 { side / inp } else { 0.0 },
        in_process,
    })
}

/// The timed part through gRPC: every request's Load and Store sent at once, all awaited.
/// Returns the batch and the store blocks the sidecar dropped.
async fn run_batch(
    client: &Client,
    pool: &PoolHandle,
    work: &Workload,
    new: &crate::workload::NewBlocks,
) -> Result<(BatchResult, u64), BenchError> {
    let session_id = client.session_id();
    let t0 = Instant::now();
    let mut tasks = Vec::with_capacity(work.config.batch);
    for r in 0..work.config.batch {
        let mut rpc = client.stub();
        let load = (work.hit > 0).then(|| {
            let blocks = work.load_blocks(r);
            proto::LoadRequest {
                session_id,
                pool_id: pool.id,
                keys: pack_keys(&blocks.iter().map(|b| b.key).collect::<Vec<_>>()),
                slots: blocks.iter().map(|b| b.slot).collect(),
                ..Default::default()
            }
        });
        let store = (work.new > 0).then(|| {
            let blocks = work.store_blocks(r, new);
            proto::StoreRequest {
                session_id,
                pool_id: pool.id,
                keys: pack_keys(&blocks.iter().map(|b| b.key).collect::<Vec<_>>()),
                slots: blocks.iter().map(|b| b.slot).collect(),
                parent: pack_key(blocks.first().and_then(|b| b.parent)),
                ..Default::default()
            }
        });
        let mut rpc2 = client.stub();
        tasks.push(tokio::spawn(async move {
            let load = async {
                let Some(req) = load else { return Ok(None) };
                let sent = Instant::now();
                let mut stream = rpc.load(req).await?.into_inner();
                while let Some(ev) = stream.message().await? {
                    if let Some(proto::load_event::Event::Done(d)) = ev.event {
                        return Ok(Some((d.bytes, timing_at(sent, d.timing))));
                    }
                }
                Err(tonic::Status::internal("the load stream ended without a report"))
            };
            let store = async {
                let Some(req) = store else { return Ok(None) };
                let sent = Instant::now();
                let s = rpc2.store(req).await?.into_inner();
                Ok(Some((
                    s.bytes,
                    timing_at(sent, s.timing),
                    s.no_space.len() as u64,
                )))
            };
            let (l, s): (Result<_, tonic::Status>, Result<_, tonic::Status>) = tokio::join!(load, store);
            Ok::<_, tonic::Status>((l?, s?))
        }));
    }
    let mut requests = Vec::with_capacity(tasks.len());
    let mut dropped = 0;
    for t in tasks {
        let (load, store) = t.await.map_err(rpc_err)?.map_err(rpc_err)?;
        dropped += store.as_ref().map_or(0, |s| s.2);
        requests.push(RequestResult {
            load,
            store: store.map(|s| (s.0, s.1)),
            ..RequestResult::default()
        });
    }
    Ok((
        BatchResult {
            requests,
            t0,
            replied: Some(Instant::now()),
            remote_store_gib_s: None,
        },
        dropped,
    ))
}

/// Loads every stored block back into its own (scrubbed) slot; `[r][b]` says whether it came.
async fn load_back(
    client: &mut Client,
    pool: &PoolHandle,
    work: &Workload,
    new: &crate::workload::NewBlocks,
) -> Result<Vec<Vec<bool>>, BenchError> {
    let layers = work.geometry.layers();
    let mut out = Vec::with_capacity(new.keys.len());
    for (r, keys) in new.keys.iter().enumerate() {
        let first = work.requests[r].first_slot + work.hit as u32;
        for b in 0..keys.len() as u32 {
            for layer in 0..layers {
                work.pool.fill_slot_layer(first + b, layer, 0)?;
            }
        }
        let blocks: Vec<(BlockKey, u32)> = keys
            .iter()
            .enumerate()
            .map(|(b, &k)| (k, first + b as u32))
            .collect();
        if blocks.is_empty() {
            out.push(Vec::new());
            continue;
        }
        let done = client
            .load_all(pool, "", &blocks, None)
            .await
            .map_err(rpc_err)?
            .done;
        out.push(keys.iter().map(|k| !done.missing.contains(k)).collect());
    }
    Ok(out)
}

/// Match latency and throughput at one concurrency.
#[derive(Debug, Clone, Serialize)]
pub struct MatchFigures {
    /// Concurrent clients (each its own session and connection).
    pub clients: usize,
    /// Per-call latency, µs.
    pub latency_us: Summary,
    /// Calls per second, all clients together.
    pub rps: f64,
}

/// `kvtier bench match` parameters.
#[derive(Debug, Clone, Serialize)]
pub struct MatchBenchConfig {
    /// The sidecar.
    pub target: SidecarTarget,
    /// Concurrency levels.
    pub clients: Vec<usize>,
    /// Match calls per concurrency level (all clients together).
    pub requests: usize,
    /// Keys per call (a cached prefix of that many blocks).
    pub blocks: usize,
    /// The geometry of the blocks.
    pub geometry: KvGeometry,
}

/// `kvtier bench match` results.
#[derive(Debug, Clone, Serialize)]
pub struct MatchBenchReport {
    /// What ran.
    pub config: MatchBenchConfig,
    /// One entry per concurrency level.
    pub runs: Vec<MatchFigures>,
}

impl MatchBenchReport {
    /// Output lines.
    pub fn lines(&self) -> Vec<String> {
        self.runs
            .iter()
            .flat_map(|r| {
                [
                    r.latency_us
                        .line(&format!("match_latency_us clients={}", r.clients), 1),
                    format!("match_rps clients={} {:.0}", r.clients, r.rps),
                ]
            })
            .collect()
    }
}

/// Measures Match over the socket: one session per client, each asking for the same cached
/// prefix of `blocks` keys, `requests` calls per concurrency level.
///
/// # Errors
/// Connection and setup errors.
pub fn run_match(
    config: &MatchBenchConfig,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<MatchBenchReport, BenchError> {
    let g = config.geometry;
    let offload = OffloadConfig {
        layers: g.layers(),
        kv_heads: g.kv_heads(),
        head_dim: g.head_dim(),
        dtype: g.dtype(),
        block_tokens: g.block_tokens(),
        ..OffloadConfig::default()
    };
    let page = g.bytes_per_block().next_multiple_of(kvtier_store::PAGE_ALIGN) as u64;
    let host = ByteSize((config.blocks as u64 + 64) * page * 2);
    let (url, _running) = start(&config.target, &server_overrides(&g, host, &offload))?;
    let path = pool_path("match");
    let model_id = run_model_id();
    let pool = kvtier_transfer::CpuDevicePool::create(Some(&path), g, config.blocks.max(1) as u32)?;
    let rt = client_runtime()?;
    let mut setup = rt
        .block_on(Client::connect_with(&url, "match-setup"))
        .map_err(rpc_err)?;
    let handle = rt
        .block_on(setup.register_cpu_pool(&pool, &model_id, 0, 1))
        .map_err(rpc_err)?;
    let mut cleanup = Cleanup::new(&rt, &setup, &handle);
    let tokens: Vec<u32> = (0..(config.blocks * g.block_tokens() as usize) as u32).collect();
    let keys = Arc::new(handle.keys("", &tokens)?);
    let run: Vec<_> = keys.iter().enumerate().map(|(i, &k)| (k, i as u32)).collect();
    let stored = rt
        .block_on(setup.store(&handle, "", None, &run))
        .map_err(rpc_err)?;
    if stored.stored_blocks as usize != config.blocks {
        return Err(BenchError::InvalidConfig(format!(
            "only {} of {} blocks stored",
            stored.stored_blocks, config.blocks
        )));
    }
    let mut runs = Vec::new();
    for (i, &n) in config.clients.iter().enumerate() {
        let n = n.max(1);
        let per = config.requests.div_ceil(n).max(1);
        let run = rt.block_on(async {
            let mut clients = Vec::with_capacity(n);
            for c in 0..n {
                let mut cl = Client::connect_with(&url, &format!("match-{c}"))
                    .await
                    .map_err(rpc_err)?;
                let h = cl
                    .register_cpu_pool(&pool, &model_id, 0, 1)
                    .await
                    .map_err(rpc_err)?;
                clients.push((cl, h));
            }
            let barrier = Arc::new(tokio::sync::Barrier::new(n));
            let tasks: Vec<_> = clients
                .into_iter()
                .map(|(mut cl, h)| {
                    let keys = Arc::clone(&keys);
                    let barrier = Arc::clone(&barrier);
                    tokio::spawn(async move {
                        for _ in 0..per.min(200) {
                            cl.match_keys(&h, "", &keys).await?;
                        }
                        barrier.wait().await;
                        let began = Instant::now();
                        let mut lat = Vec::with_capacity(per);
                        for _ in 0..per {
                            let t = Instant::now();
                            cl.match_keys(&h, "", &keys).await?;
                            lat.push(t.elapsed().as_secs_f64() * 1e6);
                        }
                        Ok::<_, kvtier_client::ClientError>((lat, began.elapsed()))
                    })
                })
                .collect();
            let mut all = Vec::with_capacity(per * n);
            let mut wall = Duration::ZERO;
            for t in tasks {
                let (lat, took) = t.await.map_err(rpc_err)?.map_err(rpc_err)?;
                all.extend(lat);
                wall = wall.max(took);
            }
            Ok::<_, BenchError>(MatchFigures {
                clients: n,
                latency_us: Summary::of(&all),
                rps: all.len() as f64 / wall.as_secs_f64().max(1e-9),
            })
        })?;
        runs.push(run);
        progress(i + 1, config.clients.len());
    }
    cleanup.run();
    drop(setup);
    Ok(MatchBenchReport {
        config: config.clone(),
        runs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offload_through_an_in_process_sidecar_verifies_and_compares() {
        let config = OffloadConfig {
            rounds: 2,
            ..crate::workload::small_config()
        };
        let r = run_offload_sidecar(&config, &SidecarTarget::InProcess, &mut |_, _| {}).unwrap();
        // 3 batches of 3 requests of 40 blocks, every one checked.
        assert_eq!(
            (r.verified_blocks, r.mismatched_blocks, r.dropped_stores),
            (3 * 3 * 40, 0, 0)
        );
        assert!(r.sidecar_batch_duplex_bw_gib_s > 0.0 && r.in_process_batch_duplex_bw_gib_s > 0.0);
        let lines = r.lines();
        assert_eq!(lines.len(), 14);
        assert!(lines[0].starts_with("load_span_ms mean="));
        assert!(lines[13].starts_with("sidecar_ratio_to_in_process="));
        let e = run_offload_sidecar(
            &OffloadConfig {
                tier: Tier::Disk,
                ..config
            },
            &SidecarTarget::InProcess,
            &mut |_, _| {},
        )
        .unwrap_err();
        assert!(e.to_string().contains("--tier disk"), "{e}");
    }

    #[test]
    fn match_over_the_socket_reports_each_concurrency() {
        let config = MatchBenchConfig {
            target: SidecarTarget::InProcess,
            clients: vec![1, 3],
            requests: 60,
            blocks: 20,
            geometry: KvGeometry::new(1, 1, 32, kvtier_core::Dtype::Bf16, 16).unwrap(),
        };
        let r = run_match(&config, &mut |_, _| {}).unwrap();
        assert_eq!(r.runs.len(), 2);
        assert_eq!(r.runs[0].latency_us.n, 60);
        assert_eq!(r.runs[1].latency_us.n, 60);
        assert!(r.runs.iter().all(|f| f.rps > 0.0 && f.latency_us.p50 > 0.0));
        assert_eq!(r.lines()[1].split(' ').next(), Some("match_rps"));
    }
}
