//! `kvtier bench offload`: the seed-003 microbenchmark.
//!
//! For each request of a batch, load its hit blocks (host → device) and store its new blocks
//! (device → host) at the same time, through the real duplex queues, then report the seed's ten
//! lines, a plain-memcpy baseline measured in the same run with as many threads, and a bit-exact
//! verification of every block moved.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use kvtier_core::{BlockHasher, BlockKey, ByteSize, Dtype, KvGeometry, Namespace};
use kvtier_store::{EvictionKind, HostTier, HostTierConfig, HostTierStats, Prefault, ShmRegion};
use kvtier_transfer::{
    CpuDevicePool, DevicePool, LoadBlock, QueueStats, StoreBlock, TransferConfig, TransferError,
    TransferQueues, TransferTiming,
};
use serde::Serialize;

use crate::BenchError;
use crate::summary::Summary;

const GIB: f64 = (1u64 << 30) as f64;

/// Parameters of the offload benchmark. Defaults follow the seed experiment: Qwen3-30B-A3B's
/// KV geometry with one layer (4 KV heads, head_dim 128, bf16), 10,000-token requests, 90% of
/// each request's blocks already in the host tier, blocks of 64 tokens, batches of 16.
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
    /// Fraction of each request's blocks found in the host tier (loaded); the rest are new
    /// (stored).
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
            transfer: TransferConfig::default(),
        }
    }
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
    /// Load + store worker threads (the baseline uses as many).
    pub copy_threads: usize,
    /// First copy → last copy of a request's load, ms.
    pub load_span_ms: Summary,
    /// First copy → last copy of a request's store, ms.
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
    /// after each measured batch).
    pub memcpy_baseline_gib_s: f64,
    /// `batch_duplex_bw_gib_s.mean / memcpy_baseline_gib_s`.
    pub duplex_ratio_to_memcpy: f64,
    /// Blocks checked bit-exact after their load or store.
    pub verified_blocks: u64,
    /// Blocks whose bytes differed (must be 0).
    pub mismatched_blocks: u64,
    /// Store blocks dropped (queue full or no host page).
    pub dropped_stores: u64,
    /// Host tier counters at the end.
    pub host: HostTierStats,
    /// Load queue counters at the end.
    pub load_queue: QueueStats,
    /// Store queue counters at the end.
    pub store_queue: QueueStats,
}

impl OffloadReport {
    /// The output lines: the seed's ten, then baseline, ratio, verification and drops.
    pub fn lines(&self) -> Vec<String> {
        vec![
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
            format!("memcpy_baseline_gib_s={:.2}", self.memcpy_baseline_gib_s),
            format!("duplex_ratio_to_memcpy={:.3}", self.duplex_ratio_to_memcpy),
            format!(
                "verified_blocks={} mismatched_blocks={}",
                self.verified_blocks, self.mismatched_blocks
            ),
            format!("dropped_stores={}", self.dropped_stores),
        ]
    }
}

/// One request of the batch: its cached prefix and its device slots.
struct Request {
    prefix: Vec<BlockKey>,
    /// xxh3 of each prefix block-layer as first written, `[block * layers + layer]`.
    prefix_hashes: Vec<u64>,
    first_slot: u32,
}

/// Per-request samples of the measured batches.
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
    baseline: Vec<f64>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn gib_s(bytes: u64, d: Duration) -> f64 {
    if d.is_zero() {
        0.0
    } else {
        bytes as f64 / GIB / d.as_secs_f64()
    }
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

/// Runs the benchmark; `progress(done, total)` is called after every batch.
///
/// # Errors
/// [`BenchError::InvalidConfig`] naming a bad parameter; pool, tier or queue errors.
pub fn run_offload(
    config: &OffloadConfig,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<OffloadReport, BenchError> {
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

    let ns = Namespace::single("kvtier-bench/offload", geometry)?.fingerprint();
    let host = HostTier::new(
        geometry,
        &HostTierConfig {
            capacity: host_capacity,
            shm_path: None,
            eviction: config.eviction,
            prefault: true,
        },
    )?;
    let pool = Arc::new(CpuDevicePool::create(None, geometry, slots)?);
    let dyn_pool: Arc<dyn DevicePool> = pool.clone();
    let queues = TransferQueues::new(&config.transfer)?;
    let layers = geometry.layers();
    let block_layer = geometry.bytes_per_block_layer();
    let mut buf = vec![0u8; block_layer];
    let mut hasher = BlockHasher::new(ns, config.block_tokens);

    // Each request's cached prefix: random tokens, real keys, KV written into its slots and
    // stored through the store queue.
    let mut requests = Vec::with_capacity(config.batch);
    for r in 0..config.batch {
        let first_slot = (r * blocks) as u32;
        let tokens: Vec<u32> = (0..hit * config.block_tokens as usize)
            .map(|t| (seed_of([1, r as u64, t as u64, 0]) % 151_936) as u32)
            .collect();
        let prefix = hasher.keys(&tokens);
        let mut prefix_hashes = Vec::with_capacity(hit * layers as usize);
        for b in 0..hit {
            for layer in 0..layers {
                fill_random(&mut buf, seed_of([2, r as u64, b as u64, u64::from(layer)]));
                prefix_hashes.push(xxhash_rust::xxh3::xxh3_64(&buf));
                pool.write_slot_layer(first_slot + b as u32, layer, &buf)?;
            }
        }
        if hit > 0 {
            let blocks: Vec<StoreBlock> = store_chain(&prefix, None, first_slot);
            let report = queues.store.submit(&dyn_pool, &host, ns, &blocks)?.wait()?;
            if report.stored_blocks != hit {
                return bad(format!(
                    "only {} of {hit} prefix blocks fit the host tier",
                    report.stored_blocks
                ));
            }
        }
        requests.push(Request {
            prefix,
            prefix_hashes,
            first_slot,
        });
    }

    let batch_bytes = (config.batch * blocks * geometry.bytes_per_block()) as u64;
    let baseline = MemcpyBaseline::new(batch_bytes, queues.copy_threads())?;
    let mut samples = Samples::default();
    let (mut verified, mut mismatched) = (0u64, 0u64);
    let total_rounds = config.warmup_rounds + config.rounds;
    let mut new_hashes = vec![0u64; config.batch * new * layers as usize];
    for round in 0..total_rounds {
        let measured = round >= config.warmup_rounds;
        // Prepare (not timed): fresh KV for the new blocks, scrubbed slots for the hit blocks.
        let mut new_keys = Vec::with_capacity(config.batch);
        for (r, req) in requests.iter().enumerate() {
            let tokens: Vec<u32> = (0..new * config.block_tokens as usize)
                .map(|t| (seed_of([3, r as u64, round as u64, t as u64]) % 151_936) as u32)
                .collect();
            let mut keys = Vec::with_capacity(new);
            hasher.extend_keys(req.prefix.last().copied(), &tokens, &mut keys);
            for b in 0..new {
                for layer in 0..layers {
                    fill_random(
                        &mut buf,
                        seed_of([4, r as u64, round as u64, (b as u64) << 32 | u64::from(layer)]),
                    );
                    new_hashes[(r * new + b) * layers as usize + layer as usize] =
                        xxhash_rust::xxh3::xxh3_64(&buf);
                    pool.write_slot_layer(req.first_slot + (hit + b) as u32, layer, &buf)?;
                }
            }
            for b in 0..hit {
                for layer in 0..layers {
                    pool.fill_slot_layer(req.first_slot + b as u32, layer, 0)?;
                }
            }
            // What an engine does first: ask what is cached.
            let matched = host.match_prefix(ns, &req.prefix).len();
            if matched != hit {
                return bad(format!(
                    "request {r}: only {matched} of {hit} hit blocks still in the host tier; raise --host-capacity"
                ));
            }
            new_keys.push(keys);
        }

        // The timed part: every request's load and store submitted back to back.
        let t0 = Instant::now();
        let mut tickets = Vec::with_capacity(config.batch);
        for (r, req) in requests.iter().enumerate() {
            let load = (hit > 0)
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
                    queues.load.submit(&dyn_pool, &host, ns, &blocks)
                })
                .transpose()?;
            let store = if new > 0 {
                let blocks = store_chain(
                    &new_keys[r],
                    req.prefix.last().copied(),
                    req.first_slot + hit as u32,
                );
                match queues.store.submit(&dyn_pool, &host, ns, &blocks) {
                    Ok(t) => Some(t),
                    Err(TransferError::QueueFull { .. }) => None,
                    Err(e) => return Err(e.into()),
                }
            } else {
                None
            };
            tickets.push((load, store));
        }
        let mut reports = Vec::with_capacity(config.batch);
        for (load, store) in tickets {
            let load = load.map(|t| t.wait()).transpose()?;
            let store = store.map(|t| t.wait()).transpose()?;
            reports.push((load, store));
        }
        let batch_end = reports
            .iter()
            .flat_map(|(l, s)| [l.as_ref().map(|l| l.timing), s.as_ref().map(|s| s.timing)])
            .flatten()
            .filter_map(|t| t.last_copy_end)
            .max()
            .unwrap_or(t0);

        if measured {
            let mut batch_total = 0u64;
            for (load, store) in &reports {
                let lt = load.as_ref().map(|l| (l.bytes, l.timing));
                let st = store.as_ref().map(|s| (s.bytes, s.timing));
                if let Some((bytes, t)) = lt {
                    samples.load_span.push(ms(t.span()));
                    samples.load_active.push(ms(t.active));
                    samples.load_bw.push(gib_s(bytes, t.span()));
                }
                if let Some((bytes, t)) = st {
                    samples.store_span.push(ms(t.span()));
                    samples.store_active.push(ms(t.active));
                    samples.store_bw.push(gib_s(bytes, t.span()));
                }
                let both: Vec<(u64, TransferTiming)> = lt.into_iter().chain(st).collect();
                let bytes: u64 = both.iter().map(|(b, _)| b).sum();
                let start = both.iter().filter_map(|(_, t)| t.first_copy_start).min();
                let end = both.iter().filter_map(|(_, t)| t.last_copy_end).max();
                if let (Some(s), Some(e)) = (start, end) {
                    let e2e = e.saturating_duration_since(s);
                    samples.e2e.push(ms(e2e));
                    samples.duplex_bw.push(gib_s(bytes, e2e));
                }
                batch_total += bytes;
            }
            let makespan = batch_end.saturating_duration_since(t0);
            samples.makespan.push(ms(makespan));
            samples.batch_bw.push(gib_s(batch_total, makespan));
            samples.baseline.push(baseline.run_once()?);
        }

        // Verify (not timed): every loaded slot against the bytes first written, every stored
        // page against the bytes in its slot.
        for (r, req) in requests.iter().enumerate() {
            for b in 0..hit {
                let ok = (0..layers).all(|layer| {
                    pool.slot_layer_xxh3(req.first_slot + b as u32, layer).ok()
                        == Some(req.prefix_hashes[b * layers as usize + layer as usize])
                });
                verified += u64::from(ok);
                mismatched += u64::from(!ok);
            }
            for (b, &key) in new_keys[r].iter().enumerate() {
                let Some(pin) = host.pin(ns, key) else { continue };
                let ok = (0..layers).all(|layer| {
                    pin.layer_xxh3(layer).ok()
                        == Some(new_hashes[(r * new + b) * layers as usize + layer as usize])
                });
                verified += u64::from(ok);
                mismatched += u64::from(!ok);
            }
        }
        progress(round + 1, total_rounds);
    }

    let baseline_gib_s = Summary::of(&samples.baseline).mean;
    let batch_bw = Summary::of(&samples.batch_bw);
    let store_queue = queues.store.stats();
    Ok(OffloadReport {
        config: config.clone(),
        blocks_per_request: blocks,
        hit_blocks: hit,
        new_blocks: new,
        host_capacity_bytes: host.stats().capacity_pages as u64 * page_bytes,
        copy_threads: queues.copy_threads(),
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
        memcpy_baseline_gib_s: baseline_gib_s,
        duplex_ratio_to_memcpy: if baseline_gib_s > 0.0 {
            batch_bw.mean / baseline_gib_s
        } else {
            0.0
        },
        verified_blocks: verified,
        mismatched_blocks: mismatched,
        dropped_stores: store_queue.dropped_blocks_total(),
        host: host.stats(),
        load_queue: queues.load.stats(),
        store_queue,
    })
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

/// Plain memcpy of a batch's bytes between two prefaulted shared-memory buffers, with as many
/// threads as the queues have, each copying its contiguous share in as few calls as the
/// buffer allows: the bus bandwidth the queues are measured against.
struct MemcpyBaseline {
    src: ShmRegion,
    dst: ShmRegion,
    threads: usize,
    total_bytes: u64,
}

/// Largest baseline buffer; bigger batches copy it several times (same total bytes).
const BASELINE_MAX_BUFFER: u64 = 1 << 30;

impl MemcpyBaseline {
    fn new(total_bytes: u64, threads: usize) -> Result<Self, BenchError> {
        let threads = threads.max(1);
        let len = total_bytes
            .min(BASELINE_MAX_BUFFER)
            .next_multiple_of(4096 * threads as u64) as usize;
        let src = ShmRegion::create_anonymous("kvtier-bench-memcpy-src", len, Prefault::Touch)?;
        let dst = ShmRegion::create_anonymous("kvtier-bench-memcpy-dst", len, Prefault::Touch)?;
        src.fill(0, len, 0x5a)?;
        Ok(Self {
            src,
            dst,
            threads,
            total_bytes,
        })
    }

    /// One pass; returns GiB/s (total bytes over first start → last end).
    fn run_once(&self) -> Result<f64, BenchError> {
        let share = self.src.len() / self.threads;
        let per_thread = self.total_bytes / self.threads as u64;
        let barrier = Barrier::new(self.threads);
        let spans: Vec<Result<(Instant, Instant), BenchError>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..self.threads)
                .map(|i| {
                    let barrier = &barrier;
                    s.spawn(move || {
                        barrier.wait();
                        let start = Instant::now();
                        let mut left = per_thread as usize;
                        while left > 0 {
                            let n = left.min(share);
                            ShmRegion::copy(&self.src, i * share, &self.dst, i * share, n)?;
                            left -= n;
                        }
                        Ok((start, Instant::now()))
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(BenchError::InvalidConfig("memcpy thread panicked".into())))
                })
                .collect()
        });
        let spans: Vec<(Instant, Instant)> = spans.into_iter().collect::<Result<_, _>>()?;
        let start = spans.iter().map(|s| s.0).min().unwrap_or_else(Instant::now);
        let end = spans.iter().map(|s| s.1).max().unwrap_or(start);
        Ok(gib_s(
            per_thread * self.threads as u64,
            end.saturating_duration_since(start),
        ))
    }
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
        assert!(r.memcpy_baseline_gib_s > 0.0 && r.duplex_ratio_to_memcpy > 0.0);
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
