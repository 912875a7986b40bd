//! `kvtier bench offload`: the seed-003 microbenchmark.
//!
//! For each request of a batch, load its hit blocks and store its new blocks at the same time,
//! through the real duplex queues, then report the seed's ten lines, baselines measured in the
//! same run, and a bit-exact verification of every block moved. With `--tier host` (default)
//! the hit blocks are in host memory (host → device) and stores end in host memory; with
//! `--tier disk` the host tier is emptied before every batch, so loads go disk → host → device
//! and stores device → host → disk.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_core::{BlockHasher, BlockKey, ByteSize, Dtype, KvGeometry, Namespace, NamespaceFingerprint};
use kvtier_store::{
    BlockTier, DirectIo, DiskTierConfig, EvictionKind, HostTierConfig, TieredStore, TieredStoreConfig,
    TieredStoreStats, WritePolicy,
};
use kvtier_transfer::{
    CpuDevicePool, DevicePool, LoadBlock, QueueStats, RouteStats, StoreBlock, TransferConfig, TransferError,
    TransferQueues, TransferTiming,
};
use serde::Serialize;

use crate::BenchError;
use crate::baselines::{DiskBaseline, MemcpyBaseline, gib_s};
use crate::summary::Summary;

/// Where the benchmark's hit blocks come from and its new blocks go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BenchTier {
    /// Host memory: loads host → device, stores device → host.
    #[default]
    Host,
    /// Disk, host memory cold: loads disk → host → device, stores device → host → disk.
    Disk,
}

impl std::str::FromStr for BenchTier {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "host" => Ok(BenchTier::Host),
            "disk" => Ok(BenchTier::Disk),
            _ => Err(format!("unknown tier {s:?} (expected host or disk)")),
        }
    }
}

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
    pub tier: BenchTier,
    /// With `--tier disk`: the directory to test (a fresh subdirectory is made in it and
    /// removed afterwards); `None` for the system's temporary directory.
    pub disk_dir: Option<PathBuf>,
    /// With `--tier disk`: page-cache bypass.
    pub direct_io: DirectIo,
    /// Queue threads, bounds and chunking.
    pub transfer: TransferConfig,
}

impl Default for OffloadConfig {
    fn default() -> Self {
        Self {
            layers: 1,
            kv_heads: 4,
            head_dim: 128,
            dtype: Dtype::Bf16,
            block_tokens: 64,
            tokens: 10_000,
            hit_rate: 0.9,
            batch: 16,
            rounds: 100,
            warmup_rounds: 3,
            host_capacity: None,
            eviction: EvictionKind::default(),
            tier: BenchTier::Host,
            disk_dir: None,
            direct_io: DirectIo::Auto,
            transfer: TransferConfig::default(),
        }
    }
}

/// The disk tier's figures and baselines.
#[derive(Debug, Clone, Serialize)]
pub struct DiskFigures {
    /// `o_direct`, or `buffered` (page cache written back and dropped before every batch).
    pub io: &'static str,
    /// Sequential reads of one block at a time on the same directory, GiB/s.
    pub read_baseline_gib_s: f64,
    /// Sequential writes of one block at a time on the same directory, GiB/s.
    pub write_baseline_gib_s: f64,
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
    /// First copy → last copy of a request's load, ms.
    pub load_span_ms: Summary,
    /// First copy → last copy of a request's store (its last disk write with `--tier disk`), ms.
    pub store_span_ms: Summary,
    /// First copy → last copy of a request, both directions, ms.
    pub e2e_ms: Summary,
    /// Sum of a request's load copy durations, ms.
    pub load_active_sum_ms: Summary,
    /// Sum of a request's store copy durations, ms.
    pub store_active_sum_ms: Summary,
    /// Load bytes / load span, GiB/s.
    pub load_bw_gib_s: Summary,
    /// Store bytes / store span, GiB/s.
    pub store_bw_gib_s: Summary,
    /// (Load + store bytes) / e2e span, GiB/s.
    pub duplex_bw_gib_s: Summary,
    /// First submission → last completion of a batch, ms.
    pub batch_makespan_ms: Summary,
    /// All bytes of a batch / its makespan, GiB/s.
    pub batch_duplex_bw_gib_s: Summary,
    /// Plain memcpy of a batch's bytes with `copy_threads` threads, GiB/s (mean of one pass
    /// after each measured batch); host tier only.
    pub memcpy_baseline_gib_s: Option<f64>,
    /// `batch_duplex_bw_gib_s.mean / memcpy_baseline_gib_s`; host tier only.
    pub duplex_ratio_to_memcpy: Option<f64>,
    /// Disk figures; disk tier only.
    pub disk: Option<DiskFigures>,
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
        let mut lines = vec![
            self.load_span_ms.line("load_span_ms", 3),
            self.store_span_ms.line("store_span_ms", 3),
            self.e2e_ms.line("e2e_ms", 3),
            self.load_active_sum_ms.line("load_active_sum_ms", 3),
            self.store_active_sum_ms.line("store_active_sum_ms", 3),
            self.load_bw_gib_s.line("load_bw_gib_s", 2),
            self.store_bw_gib_s.line("store_bw_gib_s", 2),
            self.duplex_bw_gib_s.line("duplex_bw_gib_s", 2),
            self.batch_makespan_ms.line("batch_makespan_ms", 3),
            self.batch_duplex_bw_gib_s.line("batch_duplex_bw_gib_s", 2),
        ];
        if let (Some(b), Some(r)) = (self.memcpy_baseline_gib_s, self.duplex_ratio_to_memcpy) {
            lines.push(format!("memcpy_baseline_gib_s={b:.2}"));
            lines.push(format!("duplex_ratio_to_memcpy={r:.3}"));
        }
        if let Some(d) = &self.disk {
            lines.push(format!("disk_io={}", d.io));
            lines.push(format!("disk_read_baseline_gib_s={:.2}", d.read_baseline_gib_s));
            lines.push(format!("disk_write_baseline_gib_s={:.2}", d.write_baseline_gib_s));
            lines.push(d.load_gib_s.line("disk_load_gib_s", 2));
            lines.push(d.store_gib_s.line("disk_store_gib_s", 2));
            lines.push(format!("disk_load_ratio={:.3}", d.load_ratio));
            lines.push(format!("disk_store_ratio={:.3}", d.store_ratio));
        }
        lines.push(format!(
            "verified_blocks={} mismatched_blocks={}",
            self.verified_blocks, self.mismatched_blocks
        ));
        lines.push(format!("dropped_stores={}", self.dropped_stores));
        lines
    }
}

/// One request of the batch: its cached prefix and its device slots.
struct Request {
    prefix: Vec<BlockKey>,
    /// xxh3 of each prefix block-layer as first written, `[block * layers + layer]`.
    prefix_hashes: Vec<u64>,
    first_slot: u32,
}

/// Samples of the measured batches.
#[derive(Default)]
struct Samples {
    load_span: Vec<f64>,
    store_span: Vec<f64>,
    e2e: Vec<f64>,
    load_active: Vec<f64>,
    store_active: Vec<f64>,
    load_bw: Vec<f64>,
    store_bw: Vec<f64>,
    duplex_bw: Vec<f64>,
    makespan: Vec<f64>,
    batch_bw: Vec<f64>,
    memcpy: Vec<f64>,
    disk_load: Vec<f64>,
    disk_store: Vec<f64>,
    disk_write_baseline: Vec<f64>,
    disk_read_baseline: Vec<f64>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Pseudo-random bytes (xorshift64*), fast enough not to matter next to the copies.
fn fill_random(buf: &mut [u8], seed: u64) {
    let mut x = seed | 1;
    for chunk in buf.chunks_mut(8) {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let v = x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

fn seed_of(parts: [u64; 4]) -> u64 {
    parts.iter().fold(0xcbf2_9ce4_8422_2325, |h, p| {
        (h ^ p).wrapping_mul(0x0000_0100_0000_01b3).rotate_left(17)
    })
}

/// A fresh directory for the disk tier, removed when the run ends.
struct ScratchDir(PathBuf);

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The batch's fixed parts: geometry, tiers, pool, queues, requests.
struct Bench {
    config: OffloadConfig,
    geometry: KvGeometry,
    ns: NamespaceFingerprint,
    hit: usize,
    new: usize,
    store: TieredStore,
    pool: Arc<CpuDevicePool>,
    dyn_pool: Arc<dyn DevicePool>,
    queues: TransferQueues,
    requests: Vec<Request>,
    hasher: BlockHasher,
    _scratch: Option<ScratchDir>,
}

/// What one request of a batch measured: bytes and timing of its load and store, and of
/// their disk parts.
#[derive(Default)]
struct RequestResult {
    load: Option<(u64, TransferTiming)>,
    store: Option<(u64, TransferTiming)>,
    disk_read: Option<(u64, TransferTiming)>,
    disk_write: Option<(u64, TransferTiming)>,
}

/// What one batch measured.
struct BatchResult {
    requests: Vec<RequestResult>,
    t0: Instant,
}

/// Bytes of `parts` over their common window (first copy started → last copy finished).
fn window_gib_s<'a>(parts: impl Iterator<Item = &'a (u64, TransferTiming)> + Clone) -> f64 {
    let bytes: u64 = parts.clone().map(|(b, _)| b).sum();
    let start = parts.clone().filter_map(|(_, t)| t.first_copy_start).min();
    let end = parts.filter_map(|(_, t)| t.last_copy_end).max();
    match (start, end) {
        (Some(s), Some(e)) => gib_s(bytes, e.saturating_duration_since(s)),
        _ => 0.0,
    }
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
    let geometry = bench.geometry;
    let blocks = bench.hit + bench.new;
    let batch_bytes = (config.batch * blocks * geometry.bytes_per_block()) as u64;
    let memcpy = match config.tier {
        BenchTier::Host => Some(MemcpyBaseline::new(batch_bytes, bench.queues.copy_threads())?),
        BenchTier::Disk => None,
    };
    let disk_baseline = match bench.store.disk() {
        Some(d) if config.tier == BenchTier::Disk => Some(DiskBaseline::new(
            d.dir(),
            geometry.bytes_per_block(),
            batch_bytes,
            d.direct_io(),
        )?),
        _ => None,
    };
    // Disk baselines run a few times spread over the measured batches (each moves a whole
    // batch's bytes twice).
    let disk_every = config.rounds.div_ceil(3).max(1);
    let mut samples = Samples::default();
    let (mut verified, mut mismatched) = (0u64, 0u64);
    let total_rounds = config.warmup_rounds + config.rounds;
    for round in 0..total_rounds {
        let measured = round >= config.warmup_rounds;
        let (new_keys, new_hashes) = bench.prepare(round)?;
        let batch = bench.run_batch(&new_keys)?;
        if measured {
            record(&mut samples, &batch);
            if let Some(m) = &memcpy {
                samples.memcpy.push(m.run_once()?);
            }
            if let Some(d) = &disk_baseline
                && (round - config.warmup_rounds) % disk_every == 0
            {
                let (w, r) = d.run_once()?;
                samples.disk_write_baseline.push(w);
                samples.disk_read_baseline.push(r);
            }
        }
        let (ok, bad) = bench.verify(&new_keys, &new_hashes)?;
        verified += ok;
        mismatched += bad;
        progress(round + 1, total_rounds);
    }
    Ok(bench.report(samples, verified, mismatched, memcpy.is_some()))
}

fn record(samples: &mut Samples, batch: &BatchResult) {
    let mut batch_total = 0u64;
    let mut end = batch.t0;
    for r in &batch.requests {
        if let Some((bytes, t)) = &r.load {
            samples.load_span.push(ms(t.span()));
            samples.load_active.push(ms(t.active));
            samples.load_bw.push(gib_s(*bytes, t.span()));
        }
        if let Some((bytes, t)) = &r.store {
            samples.store_span.push(ms(t.span()));
            samples.store_active.push(ms(t.active));
            samples.store_bw.push(gib_s(*bytes, t.span()));
        }
        let both: Vec<&(u64, TransferTiming)> = r.load.iter().chain(r.store.iter()).collect();
        let bytes: u64 = both.iter().map(|(b, _)| b).sum();
        let start = both.iter().filter_map(|(_, t)| t.first_copy_start).min();
        let last = both.iter().filter_map(|(_, t)| t.last_copy_end).max();
        if let (Some(s), Some(e)) = (start, last) {
            let e2e = e.saturating_duration_since(s);
            samples.e2e.push(ms(e2e));
            samples.duplex_bw.push(gib_s(bytes, e2e));
            end = end.max(e);
        }
        batch_total += bytes;
    }
    let makespan = end.saturating_duration_since(batch.t0);
    samples.makespan.push(ms(makespan));
    samples.batch_bw.push(gib_s(batch_total, makespan));
    let reads = batch.requests.iter().filter_map(|r| r.disk_read.as_ref());
    let writes = batch.requests.iter().filter_map(|r| r.disk_write.as_ref());
    samples.disk_load.push(window_gib_s(reads));
    samples.disk_store.push(window_gib_s(writes));
}

impl Bench {
    fn new(config: &OffloadConfig) -> Result<Self, BenchError> {
        let bad = |m: String| Err(BenchError::InvalidConfig(m));
        if !(0.0..=1.0).contains(&config.hit_rate) {
            return bad(format!("--hit-rate {} must be between 0 and 1", config.hit_rate));
        }
        if config.batch == 0 || config.rounds == 0 {
            return bad(format!(
                "--batch {} and --rounds {} must be at least 1",
                config.batch, config.rounds
            ));
        }
        let geometry = KvGeometry::new(
            config.layers,
            config.kv_heads,
            config.head_dim,
            config.dtype,
            config.block_tokens,
        )?;
        let blocks = geometry.full_blocks(config.tokens);
        if blocks == 0 {
            return bad(format!(
                "--tokens {} is less than one block of {} tokens",
                config.tokens, config.block_tokens
            ));
        }
        let hit = ((blocks as f64 * config.hit_rate).floor() as usize).min(blocks);
        let new = blocks - hit;
        let slots = u32::try_from(config.batch * blocks).map_err(|_| {
            BenchError::InvalidConfig(format!("{} device slots are too many", config.batch * blocks))
        })?;
        let page_bytes = geometry
            .bytes_per_block()
            .next_multiple_of(kvtier_store::PAGE_ALIGN) as u64;
        let needed_pages = (config.batch * (hit + new)) as u64;
        let host_capacity = match config.host_capacity {
            Some(c) => c,
            None => ByteSize((config.batch * (hit + 4 * new)) as u64 * page_bytes),
        };
        if host_capacity.bytes() < needed_pages * page_bytes {
            return bad(format!(
                "--host-capacity {host_capacity} cannot hold one batch's hit and new blocks ({})",
                ByteSize(needed_pages * page_bytes)
            ));
        }
        let (scratch, disk) = match config.tier {
            BenchTier::Host => (None, None),
            BenchTier::Disk => {
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
                };
                (Some(ScratchDir(dir)), Some(disk))
            }
        };
        let (store, _) = TieredStore::open(
            geometry,
            &TieredStoreConfig {
                host: HostTierConfig {
                    capacity: host_capacity,
                    shm_path: None,
                    backing: kvtier_store::HostBacking::Private,
                    eviction: config.eviction,
                    prefault: true,
                },
                disk,
                write_policy: WritePolicy::All,
                admit_min_hits: 2,
            },
        )?;
        let ns = Namespace::single("kvtier-bench/offload", geometry)?.fingerprint();
        let pool = Arc::new(CpuDevicePool::create(None, geometry, slots)?);
        let dyn_pool: Arc<dyn DevicePool> = pool.clone();
        let queues = TransferQueues::new(&config.transfer)?;
        let mut bench = Self {
            config: config.clone(),
            geometry,
            ns,
            hit,
            new,
            store,
            pool,
            dyn_pool,
            queues,
            requests: Vec::with_capacity(config.batch),
            hasher: BlockHasher::new(ns, config.block_tokens),
            _scratch: scratch,
        };
        bench.store_prefixes()?;
        Ok(bench)
    }

    /// Each request's cached prefix: random tokens, real keys, KV written into its slots and
    /// stored through the store queue (and to disk with `--tier disk`).
    fn store_prefixes(&mut self) -> Result<(), BenchError> {
        let layers = self.geometry.layers();
        let mut buf = vec![0u8; self.geometry.bytes_per_block_layer()];
        let (hit, new) = (self.hit, self.new);
        for r in 0..self.config.batch {
            let first_slot = (r * (hit + new)) as u32;
            let tokens: Vec<u32> = (0..hit * self.config.block_tokens as usize)
                .map(|t| (seed_of([1, r as u64, t as u64, 0]) % 151_936) as u32)
                .collect();
            let prefix = self.hasher.keys(&tokens);
            let mut prefix_hashes = Vec::with_capacity(hit * layers as usize);
            for b in 0..hit {
                for layer in 0..layers {
                    fill_random(&mut buf, seed_of([2, r as u64, b as u64, u64::from(layer)]));
                    prefix_hashes.push(kvtier_core::xxh3_64(&buf));
                    self.pool.write_slot_layer(first_slot + b as u32, layer, &buf)?;
                }
            }
            if hit > 0 {
                let blocks = store_chain(&prefix, None, first_slot);
                let ticket = self
                    .queues
                    .store
                    .submit(&self.dyn_pool, &self.store, self.ns, &blocks)?;
                let (copied, persisted) = ticket.wait_persisted()?;
                let stored = if self.config.tier == BenchTier::Disk {
                    persisted.written_blocks
                } else {
                    copied.stored_blocks
                };
                if stored != hit {
                    return Err(BenchError::InvalidConfig(format!(
                        "only {stored} of {hit} prefix blocks could be stored: {:?}",
                        persisted.failed.first()
                    )));
                }
            }
            self.requests.push(Request {
                prefix,
                prefix_hashes,
                first_slot,
            });
        }
        Ok(())
    }

    /// Untimed: fresh KV for the new blocks, scrubbed slots for the hit blocks, the tier made
    /// cold for `--tier disk`, and the engine's first question (what is cached) asked.
    /// Returns the new blocks' keys and their block-layer hashes.
    fn prepare(&mut self, round: usize) -> Result<(Vec<Vec<BlockKey>>, Vec<u64>), BenchError> {
        let layers = self.geometry.layers() as usize;
        let (hit, new) = (self.hit, self.new);
        let mut buf = vec![0u8; self.geometry.bytes_per_block_layer()];
        let mut new_hashes = vec![0u64; self.config.batch * new * layers];
        let mut new_keys = Vec::with_capacity(self.config.batch);
        if self.config.tier == BenchTier::Disk {
            self.store.host().clear(None);
            if let Some(d) = self.store.disk() {
                d.drop_page_cache()?;
            }
        }
        let want = match self.config.tier {
            BenchTier::Host => BlockTier::Host,
            BenchTier::Disk => BlockTier::Disk,
        };
        for (r, req) in self.requests.iter().enumerate() {
            let tokens: Vec<u32> = (0..new * self.config.block_tokens as usize)
                .map(|t| (seed_of([3, r as u64, round as u64, t as u64]) % 151_936) as u32)
                .collect();
            let mut keys = Vec::with_capacity(new);
            self.hasher
                .extend_keys(req.prefix.last().copied(), &tokens, &mut keys);
            for b in 0..new {
                for layer in 0..layers {
                    fill_random(
                        &mut buf,
                        seed_of([4, r as u64, round as u64, (b as u64) << 32 | layer as u64]),
                    );
                    new_hashes[(r * new + b) * layers + layer] = kvtier_core::xxh3_64(&buf);
                    self.pool
                        .write_slot_layer(req.first_slot + (hit + b) as u32, layer as u32, &buf)?;
                }
            }
            for b in 0..hit {
                for layer in 0..layers {
                    self.pool
                        .fill_slot_layer(req.first_slot + b as u32, layer as u32, 0)?;
                }
            }
            let m = self.queues.match_prefix(&self.store, self.ns, &req.prefix);
            let found = m.tiers.iter().filter(|&&t| t == want).count();
            if found != hit {
                return Err(BenchError::InvalidConfig(format!(
                    "request {r}: only {found} of {hit} hit blocks in the {want:?} tier; raise --host-capacity"
                )));
            }
            new_keys.push(keys);
        }
        Ok((new_keys, new_hashes))
    }

    /// The timed part: every request's load and store submitted back to back, all awaited.
    fn run_batch(&self, new_keys: &[Vec<BlockKey>]) -> Result<BatchResult, BenchError> {
        let t0 = Instant::now();
        let mut tickets = Vec::with_capacity(self.config.batch);
        for (r, req) in self.requests.iter().enumerate() {
            let load = (self.hit > 0)
                .then(|| {
                    let blocks: Vec<LoadBlock> = req
                        .prefix
                        .iter()
                        .enumerate()
                        .map(|(b, &key)| LoadBlock {
                            key,
                            slot: req.first_slot + b as u32,
                        })
                        .collect();
                    self.queues
                        .load
                        .submit(&self.dyn_pool, &self.store, self.ns, &blocks)
                })
                .transpose()?;
            let store = if self.new > 0 {
                let blocks = store_chain(
                    &new_keys[r],
                    req.prefix.last().copied(),
                    req.first_slot + self.hit as u32,
                );
                match self
                    .queues
                    .store
                    .submit(&self.dyn_pool, &self.store, self.ns, &blocks)
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
        let block_bytes = self.geometry.bytes_per_block() as u64;
        let mut requests = Vec::with_capacity(self.config.batch);
        for (load, store) in tickets {
            let mut result = RequestResult::default();
            if let Some(t) = load {
                let l = t.wait()?;
                result.load = Some((l.bytes, l.timing));
                result.disk_read = l.disk_timing.map(|t| (l.disk_blocks as u64 * block_bytes, t));
            }
            if let Some(t) = store {
                let (copied, persisted) = t.wait_persisted()?;
                // With a disk tier the store ends at its last disk write.
                result.store = Some((copied.bytes, persisted.timing.unwrap_or(copied.timing)));
                result.disk_write = persisted.disk_timing.map(|t| (persisted.bytes, t));
            }
            requests.push(result);
        }
        Ok(BatchResult { requests, t0 })
    }

    /// Untimed: every loaded slot against the bytes first written, every stored page against
    /// the bytes that were in its slot. Returns (verified, mismatched) blocks.
    fn verify(&self, new_keys: &[Vec<BlockKey>], new_hashes: &[u64]) -> Result<(u64, u64), BenchError> {
        let layers = self.geometry.layers();
        let (mut ok, mut bad) = (0u64, 0u64);
        for (r, req) in self.requests.iter().enumerate() {
            for b in 0..self.hit {
                let good = (0..layers).all(|layer| {
                    self.pool.slot_layer_xxh3(req.first_slot + b as u32, layer).ok()
                        == Some(req.prefix_hashes[b * layers as usize + layer as usize])
                });
                ok += u64::from(good);
                bad += u64::from(!good);
            }
            for (b, &key) in new_keys[r].iter().enumerate() {
                let Some(pin) = self.store.host().pin(self.ns, key) else {
                    continue;
                };
                let good = (0..layers).all(|layer| {
                    pin.layer_xxh3(layer).ok()
                        == Some(new_hashes[(r * self.new + b) * layers as usize + layer as usize])
                });
                ok += u64::from(good);
                bad += u64::from(!good);
            }
        }
        Ok((ok, bad))
    }

    fn report(self, samples: Samples, verified: u64, mismatched: u64, memcpy: bool) -> OffloadReport {
        let batch_bw = Summary::of(&samples.batch_bw);
        let memcpy_baseline = memcpy.then(|| Summary::of(&samples.memcpy).mean);
        let disk = self
            .store
            .disk()
            .filter(|_| self.config.tier == BenchTier::Disk)
            .map(|d| {
                let read = Summary::of(&samples.disk_read_baseline).mean;
                let write = Summary::of(&samples.disk_write_baseline).mean;
                let load = Summary::of(&samples.disk_load);
                let store = Summary::of(&samples.disk_store);
                DiskFigures {
                    io: if d.direct_io() { "o_direct" } else { "buffered" },
                    read_baseline_gib_s: read,
                    write_baseline_gib_s: write,
                    load_ratio: if read > 0.0 { load.mean / read } else { 0.0 },
                    store_ratio: if write > 0.0 { store.mean / write } else { 0.0 },
                    load_gib_s: load,
                    store_gib_s: store,
                }
            });
        let store_queue = self.queues.store.stats();
        let tiers = self.store.stats();
        OffloadReport {
            config: self.config.clone(),
            blocks_per_request: self.hit + self.new,
            hit_blocks: self.hit,
            new_blocks: self.new,
            host_capacity_bytes: u64::from(tiers.host.capacity_pages) * tiers.host.page_bytes,
            copy_threads: self.queues.copy_threads(),
            load_span_ms: Summary::of(&samples.load_span),
            store_span_ms: Summary::of(&samples.store_span),
            e2e_ms: Summary::of(&samples.e2e),
            load_active_sum_ms: Summary::of(&samples.load_active),
            store_active_sum_ms: Summary::of(&samples.store_active),
            load_bw_gib_s: Summary::of(&samples.load_bw),
            store_bw_gib_s: Summary::of(&samples.store_bw),
            duplex_bw_gib_s: Summary::of(&samples.duplex_bw),
            batch_makespan_ms: Summary::of(&samples.makespan),
            batch_duplex_bw_gib_s: batch_bw,
            memcpy_baseline_gib_s: memcpy_baseline,
            duplex_ratio_to_memcpy: memcpy_baseline.map(|b| if b > 0.0 { batch_bw.mean / b } else { 0.0 }),
            disk,
            verified_blocks: verified,
            mismatched_blocks: mismatched,
            dropped_stores: store_queue.dropped_blocks_total(),
            tiers,
            load_queue: self.queues.load.stats(),
            store_queue,
            routes: self.queues.routes(),
        }
    }
}

fn store_chain(keys: &[BlockKey], parent: Option<BlockKey>, first_slot: u32) -> Vec<StoreBlock> {
    keys.iter()
        .enumerate()
        .map(|(i, &key)| StoreBlock {
            key,
            parent: if i == 0 { parent } else { Some(keys[i - 1]) },
            slot: first_slot + i as u32,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> OffloadConfig {
        OffloadConfig {
            layers: 2,
            kv_heads: 2,
            head_dim: 32,
            block_tokens: 16,
            tokens: 640,
            batch: 3,
            rounds: 3,
            warmup_rounds: 1,
            ..OffloadConfig::default()
        }
    }

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
        assert_eq!(r.load_span_ms.n, 9);
        assert_eq!(r.batch_makespan_ms.n, 3);
        assert!(r.memcpy_baseline_gib_s.unwrap() > 0.0 && r.duplex_ratio_to_memcpy.unwrap() > 0.0);
        let lines = r.lines();
        assert_eq!(lines.len(), 14);
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
