//! The offload benchmark's workload, shared by its in-process and gRPC drivers: the batch of
//! requests (cached prefixes with real keys, new blocks per batch), their KV bytes in a device
//! pool, verification, and the seed's figures computed from transfer timings.

use std::path::Path;
use std::time::{Duration, Instant};

use kvtier_core::{BlockHasher, BlockKey, ByteSize, KvGeometry, Namespace, NamespaceFingerprint};
use kvtier_transfer::{LoadBlock, StoreBlock, TransferTiming};

use serde::Serialize;

use crate::baselines::gib_s;
use crate::slot_pool::SlotPool;
use crate::summary::Summary;
use crate::{BenchError, OffloadConfig};

/// The model id every benchmark namespace uses (so an external sidecar hashes the same keys).
pub(crate) const BENCH_MODEL_ID: &str = "kvtier-bench/offload";

/// A model id no other run uses (process id and start time), so a benchmark against a
/// long-running sidecar finds none of an earlier run's blocks and can clear its own.
pub(crate) fn run_model_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{BENCH_MODEL_ID}/run-{}-{nanos}", std::process::id())
}

/// One request of the batch: its cached prefix and its device slots.
pub(crate) struct Request {
    pub prefix: Vec<BlockKey>,
    /// xxh3 of each prefix block-layer as first written, `[block * layers + layer]`.
    pub prefix_hashes: Vec<u64>,
    pub first_slot: u32,
}

/// The batch, its pool, and the arithmetic of its sizes.
pub(crate) struct Workload {
    pub config: OffloadConfig,
    pub geometry: KvGeometry,
    pub ns: NamespaceFingerprint,
    pub hit: usize,
    pub new: usize,
    pub pool: SlotPool,
    pub requests: Vec<Request>,
    hasher: BlockHasher,
}

/// What one batch's new blocks are: keys per request and block-layer hashes.
pub(crate) struct NewBlocks {
    pub keys: Vec<Vec<BlockKey>>,
    pub hashes: Vec<u64>,
}

impl Workload {
    /// Validates the configuration, creates the pool (a file at `pool_path` when another
    /// process must open it) and writes every prefix block's KV into its slots.
    ///
    /// # Errors
    /// [`BenchError::InvalidConfig`] naming a bad flag; pool errors.
    pub fn new(config: &OffloadConfig, pool_path: Option<&Path>) -> Result<Self, BenchError> {
        Self::for_model(config, pool_path, BENCH_MODEL_ID)
    }

    /// [`Workload::new`] with keys in `model_id`'s namespace (a run of its own against a
    /// long-running sidecar: [`run_model_id`]).
    ///
    /// # Errors
    /// As [`Workload::new`].
    pub fn for_model(
        config: &OffloadConfig,
        pool_path: Option<&Path>,
        model_id: &str,
    ) -> Result<Self, BenchError> {
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
        let slots = u32::try_from(config.batch * blocks).map_err(|_| {
            BenchError::InvalidConfig(format!("{} device slots are too many", config.batch * blocks))
        })?;
        let ns = Namespace::single(model_id, geometry)?.fingerprint();
        let pool = SlotPool::create(
            config.device,
            config.layout,
            config.cuda_copy,
            pool_path,
            geometry,
            slots,
        )?;
        let mut w = Self {
            config: config.clone(),
            geometry,
            ns,
            hit,
            new: blocks - hit,
            pool,
            requests: Vec::with_capacity(config.batch),
            hasher: BlockHasher::new(ns, config.block_tokens),
        };
        w.write_prefixes()?;
        Ok(w)
    }

    /// Bytes of host memory the batch needs (hit blocks plus one batch of new blocks), and the
    /// default capacity (hit blocks plus four batches of new blocks).
    pub fn host_bytes(&self) -> (u64, u64) {
        let page = self
            .geometry
            .bytes_per_block()
            .next_multiple_of(kvtier_store::PAGE_ALIGN) as u64;
        let b = self.config.batch as u64;
        (
            b * (self.hit + self.new) as u64 * page,
            b * (self.hit + 4 * self.new) as u64 * page,
        )
    }

    /// The host capacity to use (the flag, or the default), checked against what one batch
    /// needs.
    ///
    /// # Errors
    /// [`BenchError::InvalidConfig`] if `--host-capacity` is too small.
    pub fn host_capacity(&self) -> Result<ByteSize, BenchError> {
        let (needed, default) = self.host_bytes();
        let capacity = self.config.host_capacity.unwrap_or(ByteSize(default));
        if capacity.bytes() < needed {
            return Err(BenchError::InvalidConfig(format!(
                "--host-capacity {capacity} cannot hold one batch's hit and new blocks ({})",
                ByteSize(needed)
            )));
        }
        Ok(capacity)
    }

    fn write_prefixes(&mut self) -> Result<(), BenchError> {
        let layers = self.geometry.layers();
        let mut buf = vec![0u8; self.geometry.bytes_per_block_layer()];
        let blocks = self.hit + self.new;
        for r in 0..self.config.batch {
            let first_slot = (r * blocks) as u32;
            let tokens: Vec<u32> = (0..self.hit * self.config.block_tokens as usize)
                .map(|t| (seed_of([1, r as u64, t as u64, 0]) % 151_936) as u32)
                .collect();
            let prefix = self.hasher.keys(&tokens);
            let mut prefix_hashes = Vec::with_capacity(self.hit * layers as usize);
            for b in 0..self.hit {
                for layer in 0..layers {
                    fill_random(&mut buf, seed_of([2, r as u64, b as u64, u64::from(layer)]));
                    prefix_hashes.push(kvtier_core::xxh3_64(&buf));
                    self.pool.write_slot_layer(first_slot + b as u32, layer, &buf)?;
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

    /// The store blocks of request `r`'s prefix (its KV is in its slots).
    pub fn prefix_store(&self, r: usize) -> Vec<StoreBlock> {
        let req = &self.requests[r];
        store_chain(&req.prefix, None, req.first_slot)
    }

    /// Untimed: fresh KV for batch `round`'s new blocks in their slots, and the hit blocks'
    /// slots scrubbed so that only a load can refill them.
    ///
    /// # Errors
    /// Pool errors.
    pub fn prepare(&mut self, round: usize) -> Result<NewBlocks, BenchError> {
        let layers = self.geometry.layers() as usize;
        let (hit, new) = (self.hit, self.new);
        let mut buf = vec![0u8; self.geometry.bytes_per_block_layer()];
        let mut hashes = vec![0u64; self.config.batch * new * layers];
        let mut keys = Vec::with_capacity(self.config.batch);
        for (r, req) in self.requests.iter().enumerate() {
            let tokens: Vec<u32> = (0..new * self.config.block_tokens as usize)
                .map(|t| (seed_of([3, r as u64, round as u64, t as u64]) % 151_936) as u32)
                .collect();
            let mut k = Vec::with_capacity(new);
            self.hasher
                .extend_keys(req.prefix.last().copied(), &tokens, &mut k);
            for b in 0..new {
                for layer in 0..layers {
                    fill_random(
                        &mut buf,
                        seed_of([4, r as u64, round as u64, (b as u64) << 32 | layer as u64]),
                    );
                    hashes[(r * new + b) * layers + layer] = kvtier_core::xxh3_64(&buf);
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
            keys.push(k);
        }
        Ok(NewBlocks { keys, hashes })
    }

    /// Request `r`'s load: its prefix into its first slots.
    pub fn load_blocks(&self, r: usize) -> Vec<LoadBlock> {
        let req = &self.requests[r];
        req.prefix
            .iter()
            .enumerate()
            .map(|(b, &key)| LoadBlock {
                key,
                slot: req.first_slot + b as u32,
            })
            .collect()
    }

    /// Request `r`'s store: its new blocks, chained after its prefix.
    pub fn store_blocks(&self, r: usize, new: &NewBlocks) -> Vec<StoreBlock> {
        let req = &self.requests[r];
        store_chain(
            &new.keys[r],
            req.prefix.last().copied(),
            req.first_slot + self.hit as u32,
        )
    }

    /// Every loaded slot against the bytes first written for its block. Returns (ok, bad).
    pub fn verify_loaded(&self) -> (u64, u64) {
        let layers = self.geometry.layers();
        let (mut ok, mut bad) = (0, 0);
        for req in &self.requests {
            for b in 0..self.hit {
                let good = (0..layers).all(|layer| {
                    self.pool.slot_layer_xxh3(req.first_slot + b as u32, layer).ok()
                        == Some(req.prefix_hashes[b * layers as usize + layer as usize])
                });
                ok += u64::from(good);
                bad += u64::from(!good);
            }
        }
        (ok, bad)
    }

    /// Every stored block whose copy `stored(r, b, key, layer)` can hash, against the bytes that
    /// were in its slot. Returns (ok, bad); blocks it cannot find are not counted.
    pub fn verify_stored(
        &self,
        new: &NewBlocks,
        mut stored: impl FnMut(usize, usize, BlockKey, u32) -> Option<u64>,
    ) -> (u64, u64) {
        let layers = self.geometry.layers();
        let (mut ok, mut bad) = (0, 0);
        for (r, keys) in new.keys.iter().enumerate() {
            for (b, &key) in keys.iter().enumerate() {
                let mut found = true;
                let mut good = true;
                for layer in 0..layers {
                    match stored(r, b, key, layer) {
                        Some(h) => {
                            good &= h == new.hashes[(r * self.new + b) * layers as usize + layer as usize]
                        }
                        None => found = false,
                    }
                }
                if found {
                    ok += u64::from(good);
                    bad += u64::from(!good);
                }
            }
        }
        (ok, bad)
    }

    /// A batch's bytes (every block, both directions).
    pub fn batch_bytes(&self) -> u64 {
        (self.config.batch * (self.hit + self.new) * self.geometry.bytes_per_block()) as u64
    }
}

pub(crate) fn store_chain(keys: &[BlockKey], parent: Option<BlockKey>, first_slot: u32) -> Vec<StoreBlock> {
    keys.iter()
        .enumerate()
        .map(|(i, &key)| StoreBlock {
            key,
            parent: if i == 0 { parent } else { Some(keys[i - 1]) },
            slot: first_slot + i as u32,
        })
        .collect()
}

/// Samples of the measured batches.
#[derive(Default)]
pub(crate) struct Samples {
    pub load_span: Vec<f64>,
    pub store_span: Vec<f64>,
    pub e2e: Vec<f64>,
    pub load_active: Vec<f64>,
    pub store_active: Vec<f64>,
    pub load_bw: Vec<f64>,
    pub store_bw: Vec<f64>,
    pub duplex_bw: Vec<f64>,
    pub makespan: Vec<f64>,
    pub batch_bw: Vec<f64>,
    pub memcpy: Vec<f64>,
    pub stream_copy: Vec<f64>,
    pub disk_load: Vec<f64>,
    pub disk_store: Vec<f64>,
    pub disk_write_baseline: Vec<f64>,
    pub disk_read_baseline: Vec<f64>,
    pub remote_load: Vec<f64>,
    pub remote_store: Vec<f64>,
    pub remote_get_baseline: Vec<f64>,
    pub remote_set_baseline: Vec<f64>,
}

/// The seed's ten figures of the measured batches.
#[derive(Debug, Clone, Serialize)]
pub struct SeedFigures {
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
}

impl Samples {
    pub fn seed_figures(&self) -> SeedFigures {
        SeedFigures {
            load_span_ms: Summary::of(&self.load_span),
            store_span_ms: Summary::of(&self.store_span),
            e2e_ms: Summary::of(&self.e2e),
            load_active_sum_ms: Summary::of(&self.load_active),
            store_active_sum_ms: Summary::of(&self.store_active),
            load_bw_gib_s: Summary::of(&self.load_bw),
            store_bw_gib_s: Summary::of(&self.store_bw),
            duplex_bw_gib_s: Summary::of(&self.duplex_bw),
            batch_makespan_ms: Summary::of(&self.makespan),
            batch_duplex_bw_gib_s: Summary::of(&self.batch_bw),
        }
    }
}

impl SeedFigures {
    /// The seed's ten lines.
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
        ]
    }
}

/// What one request of a batch measured: bytes and timing of its load and store, and of
/// their disk parts.
#[derive(Default)]
pub(crate) struct RequestResult {
    pub load: Option<(u64, TransferTiming)>,
    pub store: Option<(u64, TransferTiming)>,
    pub disk_read: Option<(u64, TransferTiming)>,
    pub disk_write: Option<(u64, TransferTiming)>,
    pub remote_read: Option<(u64, TransferTiming)>,
}

/// What one batch measured.
pub(crate) struct BatchResult {
    pub requests: Vec<RequestResult>,
    pub t0: Instant,
    /// When the requester saw the last reply, if measured (through gRPC: the makespan then
    /// includes the replies' way back).
    pub replied: Option<Instant>,
    /// With a remote tier: the batch's new bytes over batch start → the last of them in the
    /// cluster.
    pub remote_store_gib_s: Option<f64>,
}

pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
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

/// Adds one measured batch to the samples.
pub(crate) fn record(samples: &mut Samples, batch: &BatchResult) {
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
    let makespan = batch.replied.unwrap_or(end).saturating_duration_since(batch.t0);
    samples.makespan.push(ms(makespan));
    samples.batch_bw.push(gib_s(batch_total, makespan));
    let reads = batch.requests.iter().filter_map(|r| r.disk_read.as_ref());
    let writes = batch.requests.iter().filter_map(|r| r.disk_write.as_ref());
    samples.disk_load.push(window_gib_s(reads));
    samples.disk_store.push(window_gib_s(writes));
    let fetched = batch.requests.iter().filter_map(|r| r.remote_read.as_ref());
    samples.remote_load.push(window_gib_s(fetched));
}

/// Pseudo-random bytes (xorshift64*), fast enough not to matter next to the copies.
pub(crate) fn fill_random(buf: &mut [u8], seed: u64) {
    let mut x = seed | 1;
    for chunk in buf.chunks_mut(8) {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let v = x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

pub(crate) fn seed_of(parts: [u64; 4]) -> u64 {
    parts.iter().fold(0xcbf2_9ce4_8422_2325, |h, p| {
        (h ^ p).wrapping_mul(0x0000_0100_0000_01b3).rotate_left(17)
    })
}

/// A run small enough for unit tests: 2 layers, 40 blocks of 16 tokens, 3 requests a batch.
#[cfg(test)]
pub(crate) fn small_config() -> OffloadConfig {
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
