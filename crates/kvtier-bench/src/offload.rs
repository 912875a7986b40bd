//! `kvtier bench offload`: the seed-003 microbenchmark.
//!
//! For each request of a batch, load its hit blocks and store its new blocks at the same time,
//! through the real duplex queues, then report the seed's ten lines, baselines measured in the
//! same run, and a bit-exact verification of every block moved. With `--tier host` (default)
//! the hit blocks are in host memory (host → device) and stores end in host memory; with
//! `--tier disk` the host tier is emptied before every batch, so loads go disk → host → device
//! and stores device → host → disk; `--tier remote` does the same with a Redis Cluster
//! (`remote_nodes`) in place of the disk, against plain pipelined GET/SET of the same bytes
//! with the same client library.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use kvtier_core::{ByteSize, Dtype, KvGeometry, LayoutKind, Tier};
use kvtier_cuda::CopyMethod;
use kvtier_store::{
    CopyKind, DirectIo, DiskTierConfig, EvictionKind, HostTierConfig, RemoteTierConfig, TieredStore,
    TieredStoreConfig, TieredStoreStats, WritePolicy,
};
use kvtier_transfer::{DevicePool, QueueStats, RouteStats, TransferConfig, TransferError, TransferQueues};
use serde::Serialize;

use crate::BenchError;
use crate::baselines::{CopyBaseline, DiskBaseline, RemoteBaseline, gib_s};
use crate::slot_pool::{BenchDevice, SlotPool};
use crate::summary::Summary;
use crate::workload::{BatchResult, NewBlocks, RequestResult, Samples, SeedFigures, Workload, record};

/// Parameters of the offload benchmark. Defaults follow the seed experiment: Qwen3-30B-A3B's
/// KV geometry with one layer (4 KV heads, head_dim 128, bf16), 10,000-token requests, 90% of
/// each request's blocks already cached, blocks of 64 tokens, batches of 16.
#[derive(Debug, Clone, Serialize)]
pub struct OffloadConfig {
    /// Layers whose KV is moved.
    pub layers: u32,
    /// KV heads.
    pub kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// KV element type.
    pub dtype: Dtype,
    /// Tokens per block.
    pub block_tokens: u32,
    /// Tokens per request (only full blocks move).
    pub tokens: usize,
    /// Fraction of each request's blocks already cached (loaded); the rest are new (stored).
    pub hit_rate: f64,
    /// Requests per batch.
    pub batch: usize,
    /// Measured batches.
    pub rounds: usize,
    /// Unmeasured batches first (page tables, caches, thread start).
    pub warmup_rounds: usize,
    /// Host tier size; `None` sizes it to the hit blocks plus four batches of new blocks.
    pub host_capacity: Option<ByteSize>,
    /// Host tier eviction policy.
    pub eviction: EvictionKind,
    /// Where hit blocks live.
    pub tier: Tier,
    /// With `--tier disk`: the directory to test (a fresh subdirectory is made in it and
    /// removed afterwards); `None` for the system's temporary directory.
    pub disk_dir: Option<PathBuf>,
    /// With `--tier disk`: page-cache bypass.
    pub direct_io: DirectIo,
    /// With `--tier remote`: the cluster's nodes (`host:port`).
    pub remote_nodes: Vec<String>,
    /// Queue threads, bounds and chunking.
    pub transfer: TransferConfig,
    /// Where the device pool lives.
    pub device: BenchDevice,
    /// How the device pool lays K and V out (an engine's layout).
    pub layout: LayoutKind,
    /// With `--device cuda`: how batches are copied.
    pub cuda_copy: CopyMethod,
}

impl Default for OffloadConfig {
    fn default() -> Self {
        Self {
            layers: 1,
            kv_heads: KvGeometry::QWEN3_30B_A3B_KV_HEADS,
            head_dim: KvGeometry::QWEN3_30B_A3B_HEAD_DIM,
            dtype: Dtype::Bf16,
            block_tokens: KvGeometry::DEFAULT_BLOCK_TOKENS,
            tokens: 10_000,
            hit_rate: 0.9,
            batch: 16,
            rounds: 100,
            warmup_rounds: 3,
            host_capacity: None,
            eviction: EvictionKind::default(),
            tier: Tier::Host,
            disk_dir: None,
            direct_io: DirectIo::Auto,
            remote_nodes: Vec::new(),
            transfer: TransferConfig::default(),
            device: BenchDevice::Cpu,
            layout: LayoutKind::Kvtier,
            cuda_copy: CopyMethod::Auto,
        }
    }
}

/// The disk tier's figures and baselines.
#[derive(Debug, Clone, Serialize)]
pub struct DiskFigures {
    /// `o_direct`, or `buffered` (page cache written back and dropped before every batch).
    pub io: &'static str,
    /// Reads of one block per request on the same directory, the better of queue depth 1 and
    /// the tier's depth (its disk read threads), GiB/s.
    pub read_baseline_gib_s: f64,
    /// Writes likewise (the tier's disk write threads), GiB/s.
    pub write_baseline_gib_s: f64,
    /// The depth the read baseline's last pass was best at.
    pub read_baseline_depth: usize,
    /// The depth the write baseline's last pass was best at.
    pub write_baseline_depth: usize,
    /// A batch's bytes read from disk / (its first disk read started → its last finished),
    /// GiB/s.
    pub load_gib_s: Summary,
    /// A batch's bytes written to disk / (its first disk write started → its last finished),
    /// GiB/s.
    pub store_gib_s: Summary,
    /// `load_gib_s.mean / read_baseline_gib_s`.
    pub load_ratio: f64,
    /// `store_gib_s.mean / write_baseline_gib_s`.
    pub store_ratio: f64,
}

/// The remote tier's figures and baselines.
#[derive(Debug, Clone, Serialize)]
pub struct RemoteFigures {
    /// Plain GETs of a batch's hit bytes (values of the same size as kvtier's) on the same
    /// client library's cluster connection, while plain SETs write its new bytes, as the
    /// batch does; the better of all in flight at once and the tier's own concurrency, GiB/s.
    pub get_baseline_gib_s: f64,
    /// Those SETs, GiB/s.
    pub set_baseline_gib_s: f64,
    /// A batch's bytes fetched from the remote tier / (its first fetch started → its last
    /// verified in a host page), GiB/s.
    pub load_gib_s: Summary,
    /// A batch's new bytes / (the first of their writes to the cluster started → the last
    /// ended), GiB/s: the write-behind, running while the batch's loads do.
    pub store_gib_s: Summary,
    /// `load_gib_s.mean / get_baseline_gib_s`.
    pub ratio_to_baseline: f64,
    /// `store_gib_s.mean / set_baseline_gib_s`.
    pub store_ratio_to_baseline: f64,
}

/// The CUDA pool's figures: one large pinned `cuMemcpyAsync` each way and both at once on the
/// same GPU in the same run, and kvtier's figures against them.
#[derive(Debug, Clone, Serialize)]
pub struct CudaFigures {
    /// The GPU.
    pub gpu: String,
    /// How the pool copied (`auto (kernel from nvrtc)`, `memcpy (cuMemcpyAsync)`).
    pub copy: String,
    /// Pinned host → device, GiB/s.
    pub pinned_h2d_gib_s: f64,
    /// Pinned device → host, GiB/s.
    pub pinned_d2h_gib_s: f64,
    /// Both at once on two streams, GiB/s of both directions' bytes.
    pub pinned_duplex_gib_s: f64,
    /// `load_bw_gib_s.mean / pinned_h2d_gib_s`.
    pub h2d_ratio_to_pinned: f64,
    /// `store_bw_gib_s.mean / pinned_d2h_gib_s`.
    pub d2h_ratio_to_pinned: f64,
    /// `batch_duplex_bw_gib_s.mean / pinned_duplex_gib_s`.
    pub duplex_ratio_to_pinned: f64,
    /// `batch_duplex_bw_gib_s.mean / pinned_h2d_gib_s`: what running both directions at once
    /// gains over one (the seeds' duplex target is ≥ 1.7 with as many bytes each way).
    pub duplex_over_one_direction: f64,
}

/// Everything one run measured.
#[derive(Debug, Clone, Serialize)]
pub struct OffloadReport {
    /// The configuration that ran.
    pub config: OffloadConfig,
    /// Full blocks per request.
    pub blocks_per_request: usize,
    /// Blocks loaded per request.
    pub hit_blocks: usize,
    /// Blocks stored per request.
    pub new_blocks: usize,
    /// Bytes of the host tier.
    pub host_capacity_bytes: u64,
    /// Load + store worker threads (the memcpy baseline uses as many).
    pub copy_threads: usize,
    /// The seed's ten figures (flattened into the JSON report).
    #[serde(flatten)]
    pub seed: SeedFigures,
    /// Plain memcpy of a batch's bytes with `copy_threads` threads, GiB/s (mean of one pass
    /// after each measured batch); host tier only.
    pub memcpy_baseline_gib_s: Option<f64>,
    /// `batch_duplex_bw_gib_s.mean / memcpy_baseline_gib_s`; host tier only.
    pub duplex_ratio_to_memcpy: Option<f64>,
    /// The same copy with the streaming (non-temporal) stores kvtier's transfers use for
    /// large copies, GiB/s; host tier only.
    pub stream_copy_baseline_gib_s: Option<f64>,
    /// `batch_duplex_bw_gib_s.mean / stream_copy_baseline_gib_s`; host tier only.
    pub duplex_ratio_to_stream_copy: Option<f64>,
    /// Disk figures; disk tier only.
    pub disk: Option<DiskFigures>,
    /// Remote figures; remote tier only.
    pub remote: Option<RemoteFigures>,
    /// CUDA figures; `--device cuda` only.
    pub cuda: Option<CudaFigures>,
    /// Blocks checked bit-exact after their load or store.
    pub verified_blocks: u64,
    /// Blocks whose bytes differed (must be 0).
    pub mismatched_blocks: u64,
    /// Store blocks dropped (queue full or no host page).
    pub dropped_stores: u64,
    /// Tier counters at the end.
    pub tiers: TieredStoreStats,
    /// Load queue counters at the end.
    pub load_queue: QueueStats,
    /// Store queue counters at the end.
    pub store_queue: QueueStats,
    /// Per-route totals at the end.
    pub routes: RouteStats,
}

impl OffloadReport {
    /// The output lines: the seed's ten, then the baselines and ratios of the tier, then
    /// verification and drops.
    pub fn lines(&self) -> Vec<String> {
        let mut lines = self.seed.lines();
        if let (Some(b), Some(r)) = (self.memcpy_baseline_gib_s, self.duplex_ratio_to_memcpy) {
            lines.push(format!("memcpy_baseline_gib_s={b:.2}"));
            lines.push(format!("duplex_ratio_to_memcpy={r:.3}"));
        }
        if let (Some(b), Some(r)) = (self.stream_copy_baseline_gib_s, self.duplex_ratio_to_stream_copy) {
            lines.push(format!("stream_copy_baseline_gib_s={b:.2}"));
            lines.push(format!("duplex_ratio_to_stream_copy={r:.3}"));
        }
        if let Some(d) = &self.disk {
            lines.push(format!("disk_io={}", d.io));
            lines.push(format!("disk_read_baseline_gib_s={:.2}", d.read_baseline_gib_s));
            lines.push(format!("disk_write_baseline_gib_s={:.2}", d.write_baseline_gib_s));
            lines.push(format!(
                "disk_baseline_queue_depth read={} write={}",
                d.read_baseline_depth, d.write_baseline_depth
            ));
            lines.push(d.load_gib_s.line("disk_load_gib_s", 2));
            lines.push(d.store_gib_s.line("disk_store_gib_s", 2));
            lines.push(format!("disk_load_ratio={:.3}", d.load_ratio));
            lines.push(format!("disk_store_ratio={:.3}", d.store_ratio));
        }
        if let Some(r) = &self.remote {
            lines.push(format!("remote_get_baseline_gib_s={:.2}", r.get_baseline_gib_s));
            lines.push(format!("remote_set_baseline_gib_s={:.2}", r.set_baseline_gib_s));
            lines.push(r.load_gib_s.line("remote_load_gib_s", 2));
            lines.push(r.store_gib_s.line("remote_store_gib_s", 2));
            lines.push(format!("remote_ratio_to_baseline={:.3}", r.ratio_to_baseline));
            lines.push(format!(
                "remote_store_ratio_to_baseline={:.3}",
                r.store_ratio_to_baseline
            ));
        }
        if let Some(c) = &self.cuda {
            lines.push(format!("cuda_gpu={}", c.gpu));
            lines.push(format!("cuda_copy={}", c.copy));
            lines.push(format!("pinned_h2d_gib_s={:.2}", c.pinned_h2d_gib_s));
            lines.push(format!("pinned_d2h_gib_s={:.2}", c.pinned_d2h_gib_s));
            lines.push(format!("pinned_duplex_gib_s={:.2}", c.pinned_duplex_gib_s));
            lines.push(format!("h2d_ratio_to_pinned={:.3}", c.h2d_ratio_to_pinned));
            lines.push(format!("d2h_ratio_to_pinned={:.3}", c.d2h_ratio_to_pinned));
            lines.push(format!("duplex_ratio_to_pinned={:.3}", c.duplex_ratio_to_pinned));
            lines.push(format!(
                "duplex_over_one_direction={:.3}",
                c.duplex_over_one_direction
            ));
        }
        lines.push(format!(
            "verified_blocks={} mismatched_blocks={}",
            self.verified_blocks, self.mismatched_blocks
        ));
        lines.push(format!("dropped_stores={}", self.dropped_stores));
        lines
    }
}

/// A fresh directory for the disk tier, removed when the run ends.
struct ScratchDir(PathBuf);

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The in-process driver: the workload against a tiered store and queues in this process.
struct Bench {
    work: Workload,
    store: TieredStore,
    dyn_pool: Arc<dyn DevicePool>,
    queues: TransferQueues,
    _scratch: Option<ScratchDir>,
}

/// Runs the benchmark; `progress(done, total)` is called after every batch.
///
/// # Errors
/// [`BenchError::InvalidConfig`] naming a bad parameter; pool, tier or queue errors.
pub fn run_offload(
    config: &OffloadConfig,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<OffloadReport, BenchError> {
    let mut bench = Bench::new(config)?;
    let geometry = bench.work.geometry;
    let batch_bytes = bench.work.batch_bytes();
    let memcpy = match (config.device, config.tier) {
        (BenchDevice::Cuda, _) | (_, Tier::Disk | Tier::Remote) => None,
        (BenchDevice::Cpu, Tier::Device | Tier::Host) => {
            let threads = bench.queues.copy_threads();
            Some((
                CopyBaseline::new(batch_bytes, threads, CopyKind::Memcpy)?,
                CopyBaseline::new(batch_bytes, threads, CopyKind::Streaming)?,
            ))
        }
    };
    // One large pinned copy of a batch's bytes, each way and both at once: before the batches
    // and again after them, the better of the two kept (the GPU's clocks settle in between).
    let slot_pool = bench.work.pool.clone();
    let pinned = |rounds| match &slot_pool {
        SlotPool::Cuda(p) => {
            kvtier_cuda::pinned_baselines(p.context().info().ordinal, batch_bytes as usize, rounds).map(Some)
        }
        SlotPool::Cpu(_) => Ok(None),
    };
    let pinned_before = pinned(5)?;
    let disk_baseline = match bench.store.disk() {
        Some(d) if config.tier == Tier::Disk => Some(DiskBaseline::new(
            d.dir(),
            geometry.bytes_per_block(),
            batch_bytes,
            d.direct_io(),
            (
                config.transfer.disk_read_threads,
                config.transfer.disk_write_threads,
            ),
        )?),
        _ => None,
    };
    let remote_baseline = match bench.store.remote() {
        Some(r) => Some(RemoteBaseline::new(
            &r.config().nodes,
            geometry.bytes_per_block() + kvtier_store::remote_value::REMOTE_HEADER_BYTES,
            (bench.work.hit * config.batch, bench.work.new * config.batch),
            (r.config().read_concurrency, r.config().write_concurrency),
        )?),
        None => None,
    };
    let mut disk_depths = (1, 1);
    // Disk baselines run a few times spread over the measured batches (each moves a whole
    // batch's bytes twice).
    let disk_every = config.rounds.div_ceil(3).max(1);
    let mut samples = Samples::default();
    let (mut verified, mut mismatched) = (0u64, 0u64);
    let total_rounds = config.warmup_rounds + config.rounds;
    for round in 0..total_rounds {
        let measured = round >= config.warmup_rounds;
        let new = bench.prepare(round)?;
        let batch = bench.run_batch(&new)?;
        if measured {
            record(&mut samples, &batch);
            if let Some((m, st)) = &memcpy {
                samples.memcpy.push(m.run_once()?);
                samples.stream_copy.push(st.run_once()?);
            }
            if let Some(d) = &disk_baseline
                && (round - config.warmup_rounds).is_multiple_of(disk_every)
            {
                let (w, r) = d.run_once()?;
                samples.disk_write_baseline.push(w.gib_s);
                samples.disk_read_baseline.push(r.gib_s);
                disk_depths = (r.depth, w.depth);
            }
            // Every batch: the cluster shares this machine's cores, and its speed varies more
            // from one second to the next than a disk's does.
            if let Some(b) = &remote_baseline {
                let (set, get) = b.run_once()?;
                samples.remote_set_baseline.push(set);
                samples.remote_get_baseline.push(get);
            }
            if let Some(s) = batch.remote_store_gib_s {
                samples.remote_store.push(s);
            }
        }
        let (ok, bad) = bench.verify(&new);
        verified += ok;
        mismatched += bad;
        progress(round + 1, total_rounds);
    }
    let pinned = match (pinned_before, pinned(5)?) {
        (Some(a), Some(b)) => Some(kvtier_cuda::PinnedBaselines {
            h2d_gib_s: a.h2d_gib_s.max(b.h2d_gib_s),
            d2h_gib_s: a.d2h_gib_s.max(b.d2h_gib_s),
            duplex_gib_s: a.duplex_gib_s.max(b.duplex_gib_s),
        }),
        _ => None,
    };
    Ok(bench.report(
        samples,
        verified,
        mismatched,
        memcpy.is_some(),
        disk_depths,
        pinned,
    ))
}

impl Bench {
    fn new(config: &OffloadConfig) -> Result<Self, BenchError> {
        let work = Workload::new(config, None)?;
        let host_capacity = work.host_capacity()?;
        let (hit, new) = (work.hit, work.new);
        let page_bytes = work
            .geometry
            .bytes_per_block()
            .next_multiple_of(kvtier_store::PAGE_ALIGN) as u64;
        let (scratch, disk) = match config.tier {
            Tier::Device => {
                return Err(BenchError::InvalidConfig(
                    "--tier device: the hit blocks are loaded from kvtier's tiers; choose host or disk"
                        .into(),
                ));
            }
            Tier::Host => (None, None),
            Tier::Disk => {
                let parent = config.disk_dir.clone().unwrap_or_else(std::env::temp_dir);
                let dir = parent.join(format!("kvtier-bench-{}", std::process::id()));
                std::fs::create_dir_all(&dir).map_err(|e| {
                    BenchError::InvalidConfig(format!("--disk-dir {}: {e}", parent.display()))
                })?;
                // Room for the prefixes and every batch's new blocks, with a region to spare.
                let entry = 4096 + page_bytes;
                let entries = (config.batch * (hit + (config.warmup_rounds + config.rounds) * new)) as u64;
                let region = ByteSize::mib(64);
                let disk = DiskTierConfig {
                    dir: dir.clone(),
                    capacity: ByteSize(entries * entry + 4 * region.bytes()),
                    region_size: region,
                    direct_io: config.direct_io,
                    create_dir: false,
                    ..DiskTierConfig::default()
                };
                (Some(ScratchDir(dir)), Some(disk))
            }
            Tier::Remote => (None, None),
        };
        let remote = match config.tier {
            Tier::Remote if config.remote_nodes.is_empty() => {
                return Err(BenchError::InvalidConfig(
                    "--tier remote needs --remote-nodes host:port,… (scripts/redis_cluster.sh start DIR prints them; scripts/remote_bench.sh starts one and runs this)".into(),
                ));
            }
            Tier::Remote => Some(RemoteTierConfig {
                nodes: config.remote_nodes.clone(),
                // A prefix of this run's own, removed at the end.
                key_prefix: format!("kvtier-bench-{}", std::process::id()),
                write_policy: WritePolicy::All,
                // Every new block is written (none dropped for a full queue), so the figures
                // are of all of them; reads and writes in flight as a sidecar has by default.
                max_pending_writes: 1 << 16,
                timeout_ms: 20_000,
                ..RemoteTierConfig::default()
            }),
            _ => None,
        };
        let (store, _) = TieredStore::open(
            work.geometry,
            &TieredStoreConfig {
                host: HostTierConfig {
                    capacity: host_capacity,
                    eviction: config.eviction,
                    ..HostTierConfig::default()
                },
                disk,
                write_policy: WritePolicy::All,
                admit_min_hits: 2,
                remote,
            },
        )?;
        if let Some(r) = store.remote()
            && !r.connected()
        {
            return Err(BenchError::InvalidConfig(format!(
                "--remote-nodes {}: the cluster cannot be reached",
                config.remote_nodes.join(",")
            )));
        }
        let dyn_pool: Arc<dyn DevicePool> = work.pool.dyn_pool();
        let queues = TransferQueues::new(&config.transfer)?;
        let bench = Self {
            work,
            store,
            dyn_pool,
            queues,
            _scratch: scratch,
        };
        bench.store_prefixes()?;
        if let Some(r) = bench.store.remote() {
            // The prefixes' writes are not a batch's.
            r.take_write_window();
        }
        Ok(bench)
    }

    /// Each request's cached prefix, stored through the store queue (and to disk with
    /// `--tier disk`).
    fn store_prefixes(&self) -> Result<(), BenchError> {
        let w = &self.work;
        if w.hit == 0 {
            return Ok(());
        }
        for r in 0..w.config.batch {
            let ticket = self
                .queues
                .store
                .submit(&self.dyn_pool, &self.store, w.ns, &w.prefix_store(r))?;
            let (copied, persisted) = ticket.wait_persisted()?;
            let stored = match (w.config.tier, self.store.remote()) {
                (Tier::Disk, _) => persisted.written_blocks,
                (Tier::Remote, Some(remote)) => {
                    remote.flush(std::time::Duration::from_secs(600));
                    let s = remote.stats();
                    let dropped: u64 = s.dropped_writes_total.iter().sum();
                    if dropped > 0 {
                        return Err(BenchError::InvalidConfig(format!(
                            "{dropped} prefix blocks could not be written to the cluster: {s:?}"
                        )));
                    }
                    copied.stored_blocks
                }
                _ => copied.stored_blocks,
            };
            if stored != w.hit {
                return Err(BenchError::InvalidConfig(format!(
                    "only {stored} of {} prefix blocks could be stored: {:?}",
                    w.hit,
                    persisted.failed.first()
                )));
            }
        }
        Ok(())
    }

    /// Untimed: the workload's preparation, the tier made cold for `--tier disk`, and the
    /// engine's first question (what is cached) asked.
    fn prepare(&mut self, round: usize) -> Result<NewBlocks, BenchError> {
        let new = self.work.prepare(round)?;
        if matches!(self.work.config.tier, Tier::Disk | Tier::Remote) {
            self.store.host().clear(None);
            if let Some(d) = self.store.disk() {
                d.drop_page_cache()?;
            }
        }
        let want = self.work.config.tier;
        for (r, req) in self.work.requests.iter().enumerate() {
            let m = self.queues.match_prefix(&self.store, self.work.ns, &req.prefix);
            let found = m.tiers.iter().filter(|&&t| t == want).count();
            if found != self.work.hit {
                return Err(BenchError::InvalidConfig(format!(
                    "request {r}: only {found} of {} hit blocks in the {want} tier; raise --host-capacity",
                    self.work.hit
                )));
            }
        }
        Ok(new)
    }

    /// The timed part: every request's load and store submitted back to back, all awaited.
    fn run_batch(&self, new: &NewBlocks) -> Result<BatchResult, BenchError> {
        let w = &self.work;
        let t0 = Instant::now();
        let mut tickets = Vec::with_capacity(w.config.batch);
        for r in 0..w.config.batch {
            let load = (w.hit > 0)
                .then(|| {
                    self.queues
                        .load
                        .submit(&self.dyn_pool, &self.store, w.ns, &w.load_blocks(r))
                })
                .transpose()?;
            let store = if w.new > 0 {
                match self
                    .queues
                    .store
                    .submit(&self.dyn_pool, &self.store, w.ns, &w.store_blocks(r, new))
                {
                    Ok(t) => Some(t),
                    Err(TransferError::QueueFull { .. }) => None,
                    Err(e) => return Err(e.into()),
                }
            } else {
                None
            };
            tickets.push((load, store));
        }
        let block_bytes = w.geometry.bytes_per_block() as u64;
        let mut requests = Vec::with_capacity(w.config.batch);
        for (load, store) in tickets {
            let mut result = RequestResult::default();
            if let Some(t) = load {
                let l = t.wait()?;
                result.load = Some((l.bytes, l.timing));
                result.disk_read = l.disk_timing.map(|t| (l.disk_blocks as u64 * block_bytes, t));
                result.remote_read = l.remote_timing.map(|t| (l.remote_blocks as u64 * block_bytes, t));
            }
            if let Some(t) = store {
                let (copied, persisted) = t.wait_persisted()?;
                // With a disk tier the store ends at its last disk write.
                result.store = Some((copied.bytes, persisted.timing.unwrap_or(copied.timing)));
                result.disk_write = persisted.disk_timing.map(|t| (persisted.bytes, t));
            }
            requests.push(result);
        }
        // The write-behind of the batch's new blocks: their bytes over the span from the first
        // write's start to the last one's end (they run while the loads do).
        let remote_store_gib_s = self.store.remote().map(|r| {
            r.flush(std::time::Duration::from_secs(600));
            r.take_write_window().map_or(0.0, |(s, e)| {
                gib_s((w.new * w.config.batch) as u64 * block_bytes, e - s)
            })
        });
        Ok(BatchResult {
            requests,
            t0,
            replied: None,
            remote_store_gib_s,
        })
    }

    /// Untimed: loaded slots against the bytes first written, stored pages against the bytes
    /// that were in their slots. Returns (verified, mismatched) blocks.
    fn verify(&self, new: &NewBlocks) -> (u64, u64) {
        let (ok, bad) = self.work.verify_loaded();
        let host = self.store.host();
        let (ok2, bad2) = self.work.verify_stored(new, |_, _, key, layer| {
            host.pin(self.work.ns, key)?.layer_xxh3(layer).ok()
        });
        (ok + ok2, bad + bad2)
    }

    fn report(
        self,
        samples: Samples,
        verified: u64,
        mismatched: u64,
        memcpy: bool,
        (read_depth, write_depth): (usize, usize),
        pinned: Option<kvtier_cuda::PinnedBaselines>,
    ) -> OffloadReport {
        let w = &self.work;
        let seed = samples.seed_figures();
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
        let cuda = match (&w.pool, pinned) {
            (SlotPool::Cuda(p), Some(b)) => Some(CudaFigures {
                gpu: format!("{} {}", p.context().info().ordinal, p.context().info().name),
                copy: p.method_description(),
                pinned_h2d_gib_s: b.h2d_gib_s,
                pinned_d2h_gib_s: b.d2h_gib_s,
                pinned_duplex_gib_s: b.duplex_gib_s,
                h2d_ratio_to_pinned: ratio(seed.load_bw_gib_s.mean, b.h2d_gib_s),
                d2h_ratio_to_pinned: ratio(seed.store_bw_gib_s.mean, b.d2h_gib_s),
                duplex_ratio_to_pinned: ratio(seed.batch_duplex_bw_gib_s.mean, b.duplex_gib_s),
                duplex_over_one_direction: ratio(seed.batch_duplex_bw_gib_s.mean, b.h2d_gib_s),
            }),
            _ => None,
        };
        let memcpy_baseline = memcpy.then(|| Summary::of(&samples.memcpy).mean);
        let stream_baseline = memcpy.then(|| Summary::of(&samples.stream_copy).mean);
        let disk = self
            .store
            .disk()
            .filter(|_| w.config.tier == Tier::Disk)
            .map(|d| {
                let read = Summary::of(&samples.disk_read_baseline).mean;
                let write = Summary::of(&samples.disk_write_baseline).mean;
                let load = Summary::of(&samples.disk_load);
                let store = Summary::of(&samples.disk_store);
                DiskFigures {
                    io: if d.direct_io() { "o_direct" } else { "buffered" },
                    read_baseline_gib_s: read,
                    write_baseline_gib_s: write,
                    read_baseline_depth: read_depth,
                    write_baseline_depth: write_depth,
                    load_ratio: if read > 0.0 { load.mean / read } else { 0.0 },
                    store_ratio: if write > 0.0 { store.mean / write } else { 0.0 },
                    load_gib_s: load,
                    store_gib_s: store,
                }
            });
        let remote = self.store.remote().map(|_| {
            let get = Summary::of(&samples.remote_get_baseline).mean;
            let set = Summary::of(&samples.remote_set_baseline).mean;
            let load = Summary::of(&samples.remote_load);
            let store = Summary::of(&samples.remote_store);
            RemoteFigures {
                get_baseline_gib_s: get,
                set_baseline_gib_s: set,
                ratio_to_baseline: if get > 0.0 { load.mean / get } else { 0.0 },
                store_ratio_to_baseline: if set > 0.0 { store.mean / set } else { 0.0 },
                load_gib_s: load,
                store_gib_s: store,
            }
        });
        if let Some(r) = self.store.remote() {
            let _ = r.clear(None);
        }
        let store_queue = self.queues.store.stats();
        let tiers = self.store.stats();
        let routes = self.queues.routes().with_remote(tiers.remote.as_ref());
        let batch_bw = seed.batch_duplex_bw_gib_s;
        OffloadReport {
            config: w.config.clone(),
            blocks_per_request: w.hit + w.new,
            hit_blocks: w.hit,
            new_blocks: w.new,
            host_capacity_bytes: u64::from(tiers.host.capacity_pages) * tiers.host.page_bytes,
            copy_threads: self.queues.copy_threads(),
            seed,
            memcpy_baseline_gib_s: memcpy_baseline,
            duplex_ratio_to_memcpy: memcpy_baseline.map(|b| ratio(batch_bw.mean, b)),
            stream_copy_baseline_gib_s: stream_baseline,
            duplex_ratio_to_stream_copy: stream_baseline.map(|b| ratio(batch_bw.mean, b)),
            disk,
            remote,
            cuda,
            verified_blocks: verified,
            mismatched_blocks: mismatched,
            dropped_stores: store_queue.dropped_blocks_total(),
            tiers,
            load_queue: self.queues.load.stats(),
            store_queue,
            routes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::small_config as small;

    #[test]
    fn a_small_run_moves_and_verifies_every_block() {
        let cfg = small();
        let mut calls = 0;
        let r = run_offload(&cfg, &mut |done, total| {
            calls += 1;
            assert!(done <= total);
        })
        .unwrap();
        assert_eq!(calls, 4);
        assert_eq!((r.blocks_per_request, r.hit_blocks, r.new_blocks), (40, 36, 4));
        // 4 batches of 3 requests, each 36 loaded + 4 stored blocks checked.
        assert_eq!(r.verified_blocks, 4 * 3 * 40);
        assert_eq!((r.mismatched_blocks, r.dropped_stores), (0, 0));
        assert_eq!(r.seed.load_span_ms.n, 9);
        assert_eq!(r.seed.batch_makespan_ms.n, 3);
        assert!(r.memcpy_baseline_gib_s.unwrap() > 0.0 && r.duplex_ratio_to_memcpy.unwrap() > 0.0);
        let lines = r.lines();
        assert!(r.stream_copy_baseline_gib_s.unwrap() > 0.0 && r.duplex_ratio_to_stream_copy.unwrap() > 0.0);
        assert_eq!(lines.len(), 16);
        for (line, name) in lines.iter().zip([
            "load_span_ms mean=",
            "store_span_ms mean=",
            "e2e_ms mean=",
            "load_active_sum_ms mean=",
            "store_active_sum_ms mean=",
            "load_bw_gib_s mean=",
            "store_bw_gib_s mean=",
            "duplex_bw_gib_s mean=",
            "batch_makespan_ms mean=",
            "batch_duplex_bw_gib_s mean=",
            "memcpy_baseline_gib_s=",
            "duplex_ratio_to_memcpy=",
            "stream_copy_baseline_gib_s=",
            "duplex_ratio_to_stream_copy=",
            "verified_blocks=",
            "dropped_stores=0",
        ]) {
            assert!(line.starts_with(name), "{line}");
        }
    }

    #[test]
    fn bad_parameters_are_named() {
        for (cfg, needle) in [
            (
                OffloadConfig {
                    hit_rate: 1.5,
                    ..small()
                },
                "--hit-rate 1.5",
            ),
            (OffloadConfig { batch: 0, ..small() }, "--batch 0"),
            (
                OffloadConfig {
                    tokens: 10,
                    ..small()
                },
                "--tokens 10",
            ),
            (
                OffloadConfig {
                    host_capacity: Some(ByteSize::kib(64)),
                    ..small()
                },
                "--host-capacity 64KiB",
            ),
            (OffloadConfig { layers: 0, ..small() }, "layers=0"),
        ] {
            let e = run_offload(&cfg, &mut |_, _| {}).unwrap_err().to_string();
            assert!(e.contains(needle), "{e}");
        }
    }

    #[test]
    fn all_hit_and_all_new_runs_work() {
        for hit_rate in [0.0, 1.0] {
            let r = run_offload(&OffloadConfig { hit_rate, ..small() }, &mut |_, _| {}).unwrap();
            assert_eq!(r.mismatched_blocks, 0);
            assert_eq!(r.verified_blocks, 4 * 3 * 40);
        }
    }
}
