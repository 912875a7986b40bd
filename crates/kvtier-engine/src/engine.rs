//! The engine: a scheduler thread that batches prefill chunks and decode steps of every
//! running sequence into one forward pass per step (continuous batching), reusing prefixes
//! from its own device cache and from kvtier's host and disk tiers.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvtier_core::{BlockHasher, BlockKey, Dtype, KvGeometry, Namespace};
use kvtier_transfer::CpuDevicePool;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc::UnboundedSender;

use crate::kv_pages::KvPages;
use crate::model::{Model, SeqChunk};
use crate::sampling::{Sampler, Sampling};
use crate::sidecar_link::{LoadEnd, LoadProgress, SidecarConfig, SidecarLink, StoreLog, TierHit, Window};
use crate::slot_cache::{Residency, SlotCache};
use crate::{EngineError, ModelConfig, Weights};

/// Where a request's prefix KV may come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum KvReuse {
    /// Recompute every prompt.
    None,
    /// Reuse blocks still in the engine's device pool.
    Device,
    /// Device first, then kvtier's host and disk tiers (needs a sidecar).
    #[default]
    Tiered,
    /// kvtier's tiers only: the device cache never serves a hit, so every reused prefix is
    /// loaded from host or disk (to measure the tiers; needs a sidecar).
    Kvtier,
}

impl KvReuse {
    /// Prefixes may come from the engine's device cache.
    pub fn uses_device(self) -> bool {
        matches!(self, Self::Device | Self::Tiered)
    }

    /// Prefixes may come from kvtier.
    pub fn uses_kvtier(self) -> bool {
        matches!(self, Self::Tiered | Self::Kvtier)
    }
}

impl std::str::FromStr for KvReuse {
    type Err = EngineError;
    fn from_str(s: &str) -> Result<Self, EngineError> {
        match s {
            "none" => Ok(Self::None),
            "device" => Ok(Self::Device),
            "tiered" => Ok(Self::Tiered),
            "kvtier" => Ok(Self::Kvtier),
            other => Err(EngineError::Config(format!(
                "--kv-reuse {other:?}: choose none, device, tiered or kvtier"
            ))),
        }
    }
}

/// Engine settings (plain data; defaults documented per field).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EngineConfig {
    /// Seed of the random weights (ignored with `model_dir`). Default 0.
    pub seed: u64,
    /// Dtype of the KV the pool holds (what a GPU engine moves). Default bf16.
    pub kv_dtype: Dtype,
    /// Tokens per KV block. Default 64.
    pub block_tokens: u32,
    /// Device pool slots (blocks). Default 1024.
    pub device_slots: u32,
    /// Where the device pool's shared-memory file goes; default
    /// `/dev/shm/kvtier-engine-<pid>-<n>.pool` (the temp directory without /dev/shm), removed
    /// when the engine stops.
    pub pool_path: Option<PathBuf>,
    /// Prefix reuse policy. Default tiered.
    pub kv_reuse: KvReuse,
    /// The sidecar (`unix:///path`, a socket path or `http://host:port`); `None` serves from
    /// the device cache only.
    pub sidecar: Option<String>,
    /// Tokens per forward pass (the chunked-prefill budget). Default 512.
    pub max_batch_tokens: usize,
    /// Sequences running at once. Default 16.
    pub max_running: usize,
    /// Deadline for a kvtier load, ms. Default 10000.
    pub load_deadline_ms: u64,
    /// Wait between sidecar reconnection attempts, ms. Default 2000.
    pub reconnect_ms: u64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            seed: 0,
            kv_dtype: Dtype::Bf16,
            block_tokens: 64,
            device_slots: 1024,
            pool_path: None,
            kv_reuse: KvReuse::Tiered,
            sidecar: None,
            max_batch_tokens: 512,
            max_running: 16,
            load_deadline_ms: 10_000,
            reconnect_ms: 2_000,
        }
    }
}

/// One generation request.
#[derive(Debug, Clone)]
pub struct GenRequest {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Tokens to generate at most (≥ 1).
    pub max_tokens: usize,
    /// Sampling.
    pub sampling: Sampling,
    /// Keep generating past end-of-sequence tokens (benchmarks do).
    pub ignore_eos: bool,
    /// Tenant isolation: prefixes are shared only under the same salt.
    pub cache_salt: String,
}

/// Prompt tokens served from each place.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CachedTokens {
    /// From the engine's device pool (no copy).
    pub device: usize,
    /// Loaded from kvtier's host tier.
    pub host: usize,
    /// Loaded from kvtier's disk tier.
    pub disk: usize,
}

impl CachedTokens {
    /// All cached prompt tokens.
    pub fn total(&self) -> usize {
        self.device + self.host + self.disk
    }
}

/// Why a sequence stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// `max_tokens` generated.
    Length,
    /// An end-of-sequence token.
    Stop,
}

/// When a request's kvtier copies ran, relative to its arrival.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct TransferSpan {
    /// First copy started, ms after arrival.
    pub start_ms: f64,
    /// Last copy finished, ms after arrival.
    pub end_ms: f64,
    /// Bytes moved.
    pub bytes: u64,
    /// Sum of the copies' own durations, ms.
    pub active_ms: f64,
}

impl TransferSpan {
    fn of(arrived: Instant, windows: &[Window]) -> Option<Self> {
        let start = windows.iter().map(|w| w.start).min()?;
        let end = windows.iter().map(|w| w.end).max()?;
        let ms = |t: Instant| t.saturating_duration_since(arrived).as_secs_f64() * 1e3;
        Some(Self {
            start_ms: ms(start),
            end_ms: ms(end),
            bytes: windows.iter().map(|w| w.bytes).sum(),
            active_ms: windows.iter().map(|w| w.active.as_secs_f64() * 1e3).sum(),
        })
    }
}

/// A request's kvtier transfers: its prefix load (host/disk → device) and the stores of its
/// new blocks (device → host) whose replies came before it finished.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Transfers {
    /// The load, if the prefix came from kvtier.
    pub load: Option<TransferSpan>,
    /// The stores.
    pub store: Option<TransferSpan>,
}

/// What a finished request used and how long it took.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Prompt tokens not recomputed, by source.
    pub cached: CachedTokens,
    /// Arrival → first token, ms.
    pub ttft_ms: f64,
    /// Mean time per output token after the first, ms.
    pub tpot_ms: f64,
    /// Arrival → last token, ms.
    pub e2e_ms: f64,
    /// kvtier transfers.
    pub transfers: Transfers,
}

/// A request's output, in order: `Token`s, then one `Finished` (or one `Failed`).
#[derive(Debug, Clone)]
pub enum SeqEvent {
    /// The next token.
    Token(u32),
    /// Generation ended.
    Finished {
        /// Why.
        reason: FinishReason,
        /// Counts and timings.
        usage: Usage,
    },
    /// The request could not be served (the message says why).
    Failed(String),
}

/// Engine counters since start.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct EngineStats {
    /// Requests finished.
    pub requests: u64,
    /// Prompt tokens computed (prefill).
    pub prefill_tokens: u64,
    /// Seconds spent in forward passes that ran prefill tokens.
    pub prefill_seconds: f64,
    /// Tokens generated by decode-only steps (steps without prefill work).
    pub decode_tokens: u64,
    /// Seconds spent in forward passes of decode steps only.
    pub decode_seconds: f64,
    /// Prompt tokens served from each cache.
    pub cached: CachedTokens,
    /// Prompt tokens recomputed after a kvtier load failed.
    pub load_fallback_tokens: u64,
    /// Sequences running now.
    pub running: usize,
    /// Requests waiting for admission.
    pub waiting: usize,
    /// Device blocks held for reuse.
    pub device_cached_blocks: usize,
    /// Whether the sidecar is connected.
    pub sidecar_connected: bool,
    /// The reuse policy now.
    pub kv_reuse: KvReuse,
    /// Device pool size, blocks.
    pub device_slots: usize,
}

enum Command {
    Submit(Box<GenRequest>, UnboundedSender<SeqEvent>, Instant),
    Stats(mpsc::Sender<EngineStats>),
    ClearDeviceCache(mpsc::Sender<()>),
    ClearTier(kvtier_client::Tier, mpsc::Sender<Result<(u64, u64), EngineError>>),
    SetReuse(KvReuse, mpsc::Sender<()>),
    SidecarStats(mpsc::Sender<Result<String, EngineError>>),
}

/// A handle on the engine thread. Cheap to clone; the engine stops when the last handle is
/// dropped.
#[derive(Debug, Clone)]
pub struct Engine {
    tx: mpsc::Sender<Command>,
    model: Arc<ModelConfig>,
    geometry: KvGeometry,
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Command::Submit(..) => "Submit",
            Command::Stats(_) => "Stats",
            Command::ClearDeviceCache(_) => "ClearDeviceCache",
            Command::ClearTier(..) => "ClearTier",
            Command::SetReuse(..) => "SetReuse",
            Command::SidecarStats(_) => "SidecarStats",
        })
    }
}

/// The KV geometry of a model under an engine configuration.
///
/// # Errors
/// [`EngineError::Core`] for shapes the geometry refuses.
pub fn kv_geometry(model: &ModelConfig, config: &EngineConfig) -> Result<KvGeometry, EngineError> {
    Ok(KvGeometry::new(
        model.layers as u32,
        model.kv_heads as u32,
        model.head_dim as u32,
        config.kv_dtype,
        config.block_tokens,
    )?)
}

impl Engine {
    /// Creates the device pool, starts the engine thread and (with a sidecar configured and
    /// `kv_reuse = tiered`) tries to connect; without a sidecar it serves from the device
    /// cache and says so.
    ///
    /// Cost: maps and touches `device_slots` blocks of KV.
    ///
    /// # Errors
    /// Configuration, pool and link errors.
    pub fn start(model: ModelConfig, weights: Weights, config: EngineConfig) -> Result<Self, EngineError> {
        if config.max_batch_tokens == 0 || config.max_running == 0 || config.device_slots == 0 {
            return Err(EngineError::Config(
                "max_batch_tokens, max_running and device_slots must be at least 1".into(),
            ));
        }
        let geometry = kv_geometry(&model, &config)?;
        let path = match &config.pool_path {
            Some(p) => p.clone(),
            None => {
                static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                // Shared memory when the system has it, else the temp directory.
                let shm = std::path::Path::new("/dev/shm");
                let dir = if shm.is_dir() {
                    shm.to_owned()
                } else {
                    std::env::temp_dir()
                };
                dir.join(format!("kvtier-engine-{}-{n}.pool", std::process::id()))
            }
        };
        let pool = Arc::new(CpuDevicePool::create(Some(&path), geometry, config.device_slots)?);
        let kv = KvPages::new(Arc::clone(&pool))?;
        let link = match (&config.sidecar, config.kv_reuse.uses_kvtier()) {
            (Some(target), true) => Some(SidecarLink::new(
                SidecarConfig {
                    target: target.clone(),
                    retry: Duration::from_millis(config.reconnect_ms),
                    load_deadline: Duration::from_millis(config.load_deadline_ms),
                },
                model.name.clone(),
                Arc::clone(&pool),
            )?),
            (None, true) => {
                tracing::warn!("no kvtier sidecar configured: serving from the device cache only");
                None
            }
            _ => None,
        };
        let model_arc = Arc::new(model.clone());
        let model = Model::new(model, weights)?;
        let (tx, rx) = mpsc::channel();
        let mut core = Core {
            cache: SlotCache::new(config.device_slots, config.kv_reuse.uses_device()),
            model,
            kv,
            link,
            geometry,
            config: config.clone(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            stats: EngineStats::default(),
            next_id: 0,
            _pool: pool,
        };
        if let Some(link) = &mut core.link
            && link.ensure_connected().is_none()
        {
            tracing::warn!(
                target = link.target(),
                "kvtier sidecar not reachable at start: serving by recompute until it is"
            );
        }
        std::thread::Builder::new()
            .name("kvtier-engine".into())
            .spawn(move || core.run(&rx))
            .map_err(|e| EngineError::Config(format!("cannot start the engine thread: {e}")))?;
        Ok(Self {
            tx,
            model: model_arc,
            geometry,
        })
    }

    /// The model's configuration.
    pub fn model(&self) -> &ModelConfig {
        &self.model
    }

    /// The KV geometry of the device pool (what `kvtier serve` must be configured with).
    pub fn geometry(&self) -> KvGeometry {
        self.geometry
    }

    /// Changes the reuse policy from the next admission on (benchmarks switch between
    /// scenarios). Switching to a kvtier policy needs a sidecar configured at start.
    ///
    /// # Errors
    /// [`EngineError::Stopped`].
    pub fn set_kv_reuse(&self, policy: KvReuse) -> Result<(), EngineError> {
        let (tx, rx) = mpsc::channel();
        self.tx
            .send(Command::SetReuse(policy, tx))
            .map_err(|_| EngineError::Stopped)?;
        rx.recv().map_err(|_| EngineError::Stopped)
    }

    /// Queues a request; its tokens and end arrive on the returned channel. Dropping the
    /// receiver cancels the request at the next step.
    ///
    /// # Errors
    /// [`EngineError::BadRequest`] for an empty prompt, `max_tokens` 0, an out-of-vocabulary
    /// token, a sequence longer than the model allows or bad sampling values;
    /// [`EngineError::Stopped`].
    pub fn submit(
        &self,
        req: GenRequest,
    ) -> Result<tokio::sync::mpsc::UnboundedReceiver<SeqEvent>, EngineError> {
        let m = &self.model;
        if req.prompt.is_empty() {
            return Err(EngineError::BadRequest("the prompt is empty".into()));
        }
        if req.max_tokens == 0 {
            return Err(EngineError::BadRequest("max_tokens must be at least 1".into()));
        }
        if let Some(bad) = req.prompt.iter().find(|t| **t as usize >= m.vocab) {
            return Err(EngineError::BadRequest(format!(
                "token id {bad} is outside the vocabulary of {}",
                m.vocab
            )));
        }
        if req.prompt.len() + req.max_tokens > m.max_positions {
            return Err(EngineError::BadRequest(format!(
                "prompt of {} tokens + max_tokens {} exceeds the model's {} positions",
                req.prompt.len(),
                req.max_tokens,
                m.max_positions
            )));
        }
        req.sampling.validate()?;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        self.tx
            .send(Command::Submit(Box::new(req), tx, Instant::now()))
            .map_err(|_| EngineError::Stopped)?;
        Ok(rx)
    }

    /// Runs a request to the end (blocking the calling thread): the tokens and the usage.
    ///
    /// # Errors
    /// As [`Engine::submit`], or the request's failure.
    pub fn generate(&self, req: GenRequest) -> Result<(Vec<u32>, Usage), EngineError> {
        let mut rx = self.submit(req)?;
        let mut tokens = Vec::new();
        loop {
            match rx.blocking_recv() {
                Some(SeqEvent::Token(t)) => tokens.push(t),
                Some(SeqEvent::Finished { usage, .. }) => return Ok((tokens, usage)),
                Some(SeqEvent::Failed(e)) => return Err(EngineError::BadRequest(e)),
                None => return Err(EngineError::Stopped),
            }
        }
    }

    /// Counters now.
    ///
    /// # Errors
    /// [`EngineError::Stopped`].
    pub fn stats(&self) -> Result<EngineStats, EngineError> {
        let (tx, rx) = mpsc::channel();
        self.tx
            .send(Command::Stats(tx))
            .map_err(|_| EngineError::Stopped)?;
        rx.recv().map_err(|_| EngineError::Stopped)
    }

    /// Forgets every unused block of the device cache (so the next prompt cannot hit it),
    /// after the stores in flight have been answered (so kvtier holds what the device held).
    ///
    /// # Errors
    /// [`EngineError::Stopped`].
    pub fn clear_device_cache(&self) -> Result<(), EngineError> {
        let (tx, rx) = mpsc::channel();
        self.tx
            .send(Command::ClearDeviceCache(tx))
            .map_err(|_| EngineError::Stopped)?;
        rx.recv().map_err(|_| EngineError::Stopped)
    }

    /// Forgets kvtier's blocks in `tier` (every namespace): `Host` leaves only the disk copies,
    /// `Unspecified` every tier. Returns (host blocks, disk blocks) removed.
    ///
    /// # Errors
    /// [`EngineError::Config`] without a connected sidecar or when it refuses;
    /// [`EngineError::Stopped`].
    pub fn clear_tier(&self, tier: kvtier_client::Tier) -> Result<(u64, u64), EngineError> {
        let (tx, rx) = mpsc::channel();
        self.tx
            .send(Command::ClearTier(tier, tx))
            .map_err(|_| EngineError::Stopped)?;
        rx.recv().map_err(|_| EngineError::Stopped)?
    }

    /// The sidecar's statistics snapshot (JSON).
    ///
    /// # Errors
    /// As [`Engine::clear_tier`].
    pub fn sidecar_stats(&self) -> Result<String, EngineError> {
        let (tx, rx) = mpsc::channel();
        self.tx
            .send(Command::SidecarStats(tx))
            .map_err(|_| EngineError::Stopped)?;
        rx.recv().map_err(|_| EngineError::Stopped)?
    }
}

/// A kvtier load a sequence is waiting on: blocks `first .. first + hits.len()`.
#[derive(Debug)]
struct PendingLoad {
    progress: Arc<LoadProgress>,
    first: usize,
    hits: Vec<TierHit>,
    deadline: Instant,
}

#[derive(Debug)]
struct Seq {
    out: UnboundedSender<SeqEvent>,
    arrived: Instant,
    first_token: Option<Instant>,
    prompt_len: usize,
    tokens: Vec<u32>,
    max_tokens: usize,
    ignore_eos: bool,
    sampler: Sampler,
    salt: String,
    hasher: BlockHasher,
    /// Keys of the full blocks of `tokens` computed so far.
    keys: Vec<BlockKey>,
    /// Tokens whose KV is in the pool.
    computed: usize,
    /// Slot per block.
    blocks: Vec<u32>,
    /// Blocks already published to the device cache / stored.
    published: usize,
    /// Slots reserved for this sequence's growth (prompt + max_tokens), not yet allocated.
    reserved: usize,
    load: Option<PendingLoad>,
    /// When the prefix load's copies ran.
    load_window: Option<Window>,
    /// When this sequence's stores ran.
    store_log: StoreLog,
    cached: CachedTokens,
    /// The chunk run in this step is invalid (its kvtier load failed): redo it.
    invalid: bool,
}

impl Seq {
    fn key_of(&mut self, block: usize) -> BlockKey {
        let bt = self.hasher.block_tokens();
        while self.keys.len() <= block {
            let b = self.keys.len();
            let parent = self.keys.last().copied();
            let key = self.hasher.key(parent, &self.tokens[b * bt..(b + 1) * bt]);
            self.keys.push(key.expect("a full block has block_tokens tokens"));
        }
        self.keys[block]
    }

    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
}

struct Core {
    model: Model,
    kv: KvPages,
    cache: SlotCache,
    link: Option<SidecarLink>,
    geometry: KvGeometry,
    config: EngineConfig,
    waiting: VecDeque<(Box<GenRequest>, UnboundedSender<SeqEvent>, Instant)>,
    running: Vec<Seq>,
    stats: EngineStats,
    next_id: u64,
    _pool: Arc<CpuDevicePool>,
}

impl Core {
    fn run(&mut self, rx: &mpsc::Receiver<Command>) {
        loop {
            let cmd = if self.running.is_empty() && self.waiting.is_empty() {
                match rx.recv() {
                    Ok(c) => Some(c),
                    Err(_) => return,
                }
            } else {
                match rx.try_recv() {
                    Ok(c) => Some(c),
                    Err(mpsc::TryRecvError::Empty) => None,
                    Err(mpsc::TryRecvError::Disconnected) if self.running.is_empty() => return,
                    Err(mpsc::TryRecvError::Disconnected) => None,
                }
            };
            if let Some(cmd) = cmd {
                self.command(cmd);
                continue;
            }
            self.step();
        }
    }

    fn command(&mut self, cmd: Command) {
        match cmd {
            Command::Submit(req, out, at) => self.waiting.push_back((req, out, at)),
            Command::Stats(reply) => {
                let mut s = self.stats.clone();
                s.running = self.running.len();
                s.waiting = self.waiting.len();
                s.device_cached_blocks = self.cache.cached_blocks();
                s.sidecar_connected = self.link.as_ref().is_some_and(SidecarLink::is_connected);
                s.kv_reuse = self.config.kv_reuse;
                s.device_slots = self.cache.total();
                let _ = reply.send(s);
            }
            Command::ClearDeviceCache(reply) => {
                self.wait_for_stores();
                self.cache.clear();
                self.flush_residency();
                let _ = reply.send(());
            }
            Command::ClearTier(tier, reply) => {
                self.wait_for_stores();
                let r = match &mut self.link {
                    Some(link) => link.clear(tier).map_err(EngineError::Config),
                    None => Err(EngineError::Config("no kvtier sidecar configured".into())),
                };
                let _ = reply.send(r);
            }
            Command::SetReuse(policy, reply) => {
                self.config.kv_reuse = policy;
                self.cache.set_reuse(policy.uses_device());
                let _ = reply.send(());
            }
            Command::SidecarStats(reply) => {
                let r = match &mut self.link {
                    Some(link) => link.sidecar_stats().map_err(EngineError::Config),
                    None => Err(EngineError::Config("no kvtier sidecar configured".into())),
                };
                let _ = reply.send(r);
            }
        }
    }

    /// Waits (up to 30 s) until every store sent has been answered.
    fn wait_for_stores(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.link.as_ref().is_some_and(|l| l.stores_in_flight() > 0) && Instant::now() < deadline {
            self.release_finished_transfers();
            std::thread::sleep(Duration::from_millis(1));
        }
        self.release_finished_transfers();
    }

    fn reserved(&self) -> usize {
        self.running.iter().map(|s| s.reserved).sum()
    }

    /// Moves waiting requests into the running set while slots and room allow.
    fn admit(&mut self) {
        let bt = self.geometry.block_tokens() as usize;
        if let Some(link) = &mut self.link
            && link.ensure_connected() == Some(true)
        {
            // A new session: tell the sidecar what the device holds.
            let held: Vec<(BlockKey, Option<u32>)> = self
                .cache
                .published()
                .into_iter()
                .map(|(k, s)| (k, Some(s)))
                .collect();
            link.device_events(held);
        }
        while self.running.len() < self.config.max_running {
            let Some((req, out, arrived)) = self.waiting.pop_front() else {
                break;
            };
            if out.is_closed() {
                continue;
            }
            let total_blocks = (req.prompt.len() + req.max_tokens).div_ceil(bt);
            if total_blocks > self.cache.total() {
                let _ = out.send(SeqEvent::Failed(
                    EngineError::PoolFull {
                        needed: total_blocks,
                        free: self.cache.available(),
                        total: self.cache.total(),
                    }
                    .to_string(),
                ));
                continue;
            }
            let ns = match Namespace::new(
                self.model.config().name.clone(),
                self.geometry,
                0,
                1,
                req.cache_salt.clone(),
            ) {
                Ok(ns) => ns.fingerprint(),
                Err(e) => {
                    let _ = out.send(SeqEvent::Failed(e.to_string()));
                    continue;
                }
            };
            let mut seq = Seq {
                out,
                arrived,
                first_token: None,
                prompt_len: req.prompt.len(),
                tokens: req.prompt.clone(),
                max_tokens: req.max_tokens,
                ignore_eos: req.ignore_eos,
                sampler: Sampler::new(req.sampling),
                salt: req.cache_salt.clone(),
                hasher: BlockHasher::new(ns, self.geometry.block_tokens()),
                keys: Vec::new(),
                computed: 0,
                blocks: Vec::new(),
                published: 0,
                reserved: 0,
                load: None,
                load_window: None,
                store_log: StoreLog::default(),
                cached: CachedTokens::default(),
                invalid: false,
            };
            // At least the last prompt token is computed (its logits give the first token).
            let reusable = (seq.prompt_len - 1) / bt;
            if self.config.kv_reuse.uses_device() {
                for b in 0..reusable {
                    let key = seq.key_of(b);
                    match self.cache.acquire(key) {
                        Some(slot) => seq.blocks.push(slot),
                        None => break,
                    }
                }
            }
            let device_hits = seq.blocks.len();
            // Slots this sequence still needs, beyond the device hits it holds now.
            let need = total_blocks - device_hits;
            if need > self.cache.available().saturating_sub(self.reserved()) {
                // Not now: give the hits back and wait (first come, first served).
                for s in seq.blocks.drain(..).rev() {
                    self.cache.release(s);
                }
                self.waiting.push_front((req, seq.out, arrived));
                break;
            }
            seq.reserved = need;
            seq.computed = device_hits * bt;
            seq.published = device_hits;
            seq.cached.device = device_hits * bt;
            if let Some(link) = &mut self.link
                && self.config.kv_reuse.uses_kvtier()
                && device_hits < reusable
            {
                let keys: Vec<BlockKey> = (device_hits..reusable).map(|b| seq.key_of(b)).collect();
                let hits = link.match_prefix(&seq.salt, &keys);
                if !hits.is_empty() {
                    let mut blocks = Vec::with_capacity(hits.len());
                    for (i, _) in hits.iter().enumerate() {
                        let slot = self.cache.allocate().expect("admission reserved these slots");
                        seq.reserved -= 1;
                        seq.blocks.push(slot);
                        blocks.push((keys[i], slot));
                    }
                    match link.start_load(&seq.salt, blocks) {
                        Some(progress) => {
                            seq.computed += hits.len() * bt;
                            seq.load = Some(PendingLoad {
                                progress,
                                first: device_hits,
                                deadline: Instant::now()
                                    + Duration::from_millis(self.config.load_deadline_ms + 1000),
                                hits,
                            });
                        }
                        None => {
                            for s in seq.blocks.drain(device_hits..).rev() {
                                self.cache.release(s);
                                seq.reserved += 1;
                            }
                        }
                    }
                }
            }
            self.next_id += 1;
            self.running.push(seq);
        }
    }

    fn step(&mut self) {
        self.release_finished_transfers();
        self.admit();
        if self.running.is_empty() {
            if !self.waiting.is_empty() {
                // Nothing runs and the head cannot be admitted: wait for slots to come back.
                std::thread::sleep(Duration::from_millis(1));
            }
            return;
        }
        let bt = self.geometry.block_tokens() as usize;
        // Decode steps first (latency), then prefill chunks in arrival order, within budget.
        let mut budget = self.config.max_batch_tokens;
        let mut plan: Vec<(usize, usize)> = Vec::new(); // (running index, tokens)
        let mut order: Vec<usize> = (0..self.running.len()).collect();
        order.sort_by_key(|i| self.running[*i].computed < self.running[*i].prompt_len);
        for i in order {
            let s = &self.running[i];
            let todo = s.tokens.len() - s.computed;
            let n = todo.min(budget);
            if n == 0 {
                continue;
            }
            budget -= n;
            plan.push((i, n));
        }
        // Slots for the new tokens.
        for &(i, n) in &plan {
            let s = &mut self.running[i];
            while s.blocks.len() * bt < s.computed + n {
                let slot = self
                    .cache
                    .allocate()
                    .expect("admission reserved this sequence's slots");
                s.reserved = s.reserved.saturating_sub(1);
                s.blocks.push(slot);
            }
        }
        let prefill: usize = plan
            .iter()
            .filter(|(i, _)| self.running[*i].computed < self.running[*i].prompt_len)
            .map(|(_, n)| n)
            .sum();
        let started = Instant::now();
        let result = {
            let chunks: Vec<SeqChunk<'_>> = plan
                .iter()
                .map(|&(i, n)| {
                    let s = &self.running[i];
                    SeqChunk {
                        tokens: &s.tokens[s.computed..s.computed + n],
                        start: s.computed,
                        blocks: &s.blocks,
                        logits: s.computed + n == s.tokens.len(),
                    }
                })
                .collect();
            let loads: Vec<(usize, Arc<LoadProgress>, Instant)> = plan
                .iter()
                .filter_map(|&(i, _)| {
                    self.running[i]
                        .load
                        .as_ref()
                        .map(|l| (i, Arc::clone(&l.progress), l.deadline))
                })
                .collect();
            let mut failed: Vec<usize> = Vec::new();
            let r = self.model.forward(&self.kv, &chunks, &mut |layer| {
                for (i, progress, deadline) in &loads {
                    if !failed.contains(i) && !progress.wait_layer(layer as u32, *deadline) {
                        failed.push(*i);
                    }
                }
                Ok(())
            });
            for (i, _, _) in &loads {
                if failed.contains(i) {
                    self.running[*i].invalid = true;
                }
            }
            r
        };
        let elapsed = started.elapsed().as_secs_f64();
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                // A bad batch: fail its sequences rather than loop on it.
                tracing::error!(error = %e, "forward pass failed");
                for &(i, _) in plan.iter().rev() {
                    let s = self.running.swap_remove(i);
                    let _ = s.out.send(SeqEvent::Failed(e.to_string()));
                    self.free(s);
                }
                return;
            }
        };
        if prefill > 0 {
            self.stats.prefill_tokens += prefill as u64;
            self.stats.prefill_seconds += elapsed;
        } else {
            self.stats.decode_seconds += elapsed;
        }
        crate::metrics::forward_pass(prefill, plan.len(), elapsed);
        // Loads the chunks depended on must have completed before their KV counts.
        for &(i, _) in &plan {
            self.settle_load(i);
        }
        let mut next_logits = logits.into_iter();
        let mut finished = Vec::new();
        for &(i, n) in &plan {
            let wants = self.running[i].computed + n == self.running[i].tokens.len();
            let l = if wants { next_logits.next() } else { None };
            if self.running[i].invalid {
                self.running[i].invalid = false;
                continue;
            }
            self.running[i].computed += n;
            self.publish_full_blocks(i);
            if let Some(l) = l
                && self.emit(i, &l, prefill == 0)
            {
                finished.push(i);
            }
        }
        finished.sort_unstable();
        for i in finished.into_iter().rev() {
            let s = self.running.swap_remove(i);
            self.free(s);
        }
        self.flush_residency();
    }

    /// After a step: a pending load either completed (its blocks join the device cache) or
    /// failed (its blocks are recomputed from the first one missing).
    fn settle_load(&mut self, i: usize) {
        let bt = self.geometry.block_tokens() as usize;
        let Some(load) = self.running[i].load.take() else {
            return;
        };
        let end = if self.running[i].invalid {
            // Wait for the end so we know which slots the load may still write.
            load.progress.wait_end(Instant::now())
        } else {
            load.progress.wait_end(load.deadline)
        };
        let s = &mut self.running[i];
        s.load_window = load.progress.window();
        let keep = match &end {
            LoadEnd::Complete => load.hits.len(),
            LoadEnd::Missing(missing) => (0..load.hits.len())
                .position(|j| missing.contains(&s.keys[load.first + j]))
                .unwrap_or(load.hits.len()),
            LoadEnd::Failed(_) => 0,
        };
        for (j, hit) in load.hits.iter().take(keep).enumerate() {
            match hit {
                TierHit::Host => s.cached.host += bt,
                TierHit::Disk => s.cached.disk += bt,
            }
            let b = load.first + j;
            let key = s.keys[b];
            self.cache.publish(s.blocks[b], key);
        }
        s.published = load.first + keep;
        if keep == load.hits.len() {
            return;
        }
        let why = match &end {
            LoadEnd::Failed(e) => e.clone(),
            LoadEnd::Missing(m) => format!("{} blocks missing", m.len()),
            LoadEnd::Complete => String::new(),
        };
        tracing::warn!(blocks = load.hits.len() - keep, reason = %why, "kvtier load incomplete: recomputing");
        // Recompute from block first + keep: its slots (and later ones) are given up if the
        // load might still write them, and fresh ones are allocated as the prefill proceeds.
        let cut = load.first + keep;
        let given: Vec<u32> = s.blocks.drain(cut..).collect();
        let lost = s.computed.saturating_sub(cut * bt);
        self.stats.load_fallback_tokens += lost as u64;
        s.computed = cut * bt;
        s.reserved += given.len();
        s.invalid = false;
        let back = match end {
            LoadEnd::Failed(_) => load.progress.orphan(given),
            _ => given,
        };
        for slot in back.into_iter().rev() {
            self.cache.release(slot);
        }
    }

    /// Publishes (and stores to kvtier) the blocks that became full and computed.
    fn publish_full_blocks(&mut self, i: usize) {
        let bt = self.geometry.block_tokens() as usize;
        let s = &mut self.running[i];
        if s.load.is_some() {
            return;
        }
        let full = s.computed / bt;
        if full <= s.published {
            return;
        }
        let mut run = Vec::new();
        let kvtier_only = self.config.kv_reuse == KvReuse::Kvtier;
        let parent = s.published.checked_sub(1).map(|b| s.key_of(b));
        for b in s.published..full {
            let key = s.key_of(b);
            let slot = s.blocks[b];
            // kvtier-only: nothing is published on the device (so the sidecar never answers
            // DEVICE for it), but new blocks still go to kvtier.
            if self.cache.publish(slot, key) || kvtier_only {
                run.push((key, slot));
            }
        }
        s.published = full;
        if run.is_empty() {
            return;
        }
        if let Some(link) = &mut self.link {
            for (_, slot) in &run {
                self.cache.retain(*slot);
            }
            let slots: Vec<u32> = run.iter().map(|r| r.1).collect();
            if !link.store(&s.salt, parent, run, Arc::clone(&s.store_log)) {
                for slot in slots {
                    self.cache.release(slot);
                }
            }
        }
    }

    /// Samples the next token of sequence `i`; returns whether it finished.
    fn emit(&mut self, i: usize, logits: &[f32], decode: bool) -> bool {
        let eos = &self.model.config().eos_token_ids;
        let max_positions = self.model.config().max_positions;
        let s = &mut self.running[i];
        let token = s.sampler.sample(logits);
        s.first_token.get_or_insert_with(Instant::now);
        s.tokens.push(token);
        if decode {
            self.stats.decode_tokens += 1;
        }
        if s.out.send(SeqEvent::Token(token)).is_err() {
            return true; // the requester went away
        }
        let reason = if !s.ignore_eos && eos.contains(&token) {
            FinishReason::Stop
        } else if s.generated() >= s.max_tokens || s.tokens.len() >= max_positions {
            FinishReason::Length
        } else {
            return false;
        };
        let now = Instant::now();
        let first = s.first_token.unwrap_or(now);
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let usage = Usage {
            prompt_tokens: s.prompt_len,
            completion_tokens: s.generated(),
            cached: s.cached,
            ttft_ms: ms(first - s.arrived),
            tpot_ms: if s.generated() > 1 {
                ms(now - first) / (s.generated() - 1) as f64
            } else {
                0.0
            },
            e2e_ms: ms(now - s.arrived),
            transfers: Transfers {
                load: s.load_window.and_then(|w| TransferSpan::of(s.arrived, &[w])),
                store: TransferSpan::of(s.arrived, &s.store_log.lock().unwrap_or_else(|e| e.into_inner())),
            },
        };
        self.stats.requests += 1;
        self.stats.cached.device += s.cached.device;
        self.stats.cached.host += s.cached.host;
        self.stats.cached.disk += s.cached.disk;
        crate::metrics::request_finished(&usage);
        let _ = s.out.send(SeqEvent::Finished { reason, usage });
        true
    }

    /// Releases a finished sequence's slots, suffix first.
    fn free(&mut self, mut s: Seq) {
        if let Some(load) = s.load.take() {
            let given: Vec<u32> = s.blocks.drain(load.first..).collect();
            let back = load.progress.orphan(given);
            for slot in back.into_iter().rev() {
                self.cache.release(slot);
            }
        }
        for slot in s.blocks.into_iter().rev() {
            self.cache.release(slot);
        }
    }

    fn release_finished_transfers(&mut self) {
        if let Some(link) = &mut self.link {
            for slot in link.take_released() {
                self.cache.release(slot);
            }
        }
        // Requesters that went away.
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].out.is_closed() {
                let s = self.running.swap_remove(i);
                self.free(s);
            } else {
                i += 1;
            }
        }
    }

    fn flush_residency(&mut self) {
        let events: Vec<(BlockKey, Option<u32>)> = self
            .cache
            .take_events()
            .into_iter()
            .map(|e| match e {
                Residency::Stored(k, s) => (k, Some(s)),
                Residency::Removed(k) => (k, None),
            })
            .collect();
        if let Some(link) = &mut self.link {
            link.device_events(events);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(reuse: KvReuse, slots: u32) -> Engine {
        let model = ModelConfig::preset("tiny-moe").unwrap();
        let weights = Weights::random(&model, 3).unwrap();
        Engine::start(
            model,
            weights,
            EngineConfig {
                block_tokens: 4,
                device_slots: slots,
                kv_reuse: reuse,
                max_batch_tokens: 16,
                ..EngineConfig::default()
            },
        )
        .unwrap()
    }

    fn req(prompt: Vec<u32>, max_tokens: usize) -> GenRequest {
        GenRequest {
            prompt,
            max_tokens,
            sampling: Sampling::default(),
            ignore_eos: true,
            cache_salt: String::new(),
        }
    }

    #[test]
    fn device_hits_give_the_recomputed_tokens() {
        let prompt: Vec<u32> = (0..30).map(|i| (i * 13 + 7) % 500).collect();
        let none = engine(KvReuse::None, 64);
        let (want, u) = none.generate(req(prompt.clone(), 8)).unwrap();
        assert_eq!((want.len(), u.cached.total(), u.prompt_tokens), (8, 0, 30));
        let dev = engine(KvReuse::Device, 64);
        let (first, u1) = dev.generate(req(prompt.clone(), 8)).unwrap();
        let (second, u2) = dev.generate(req(prompt.clone(), 8)).unwrap();
        assert_eq!(
            first, want,
            "chunked prefill (16-token budget) vs the same engine config"
        );
        assert_eq!(second, want, "device hit");
        assert_eq!(
            (u1.cached.device, u2.cached.device),
            (0, 28),
            "7 full blocks of the first 29 tokens"
        );
        // A different salt never shares.
        let (_, u3) = dev
            .generate(GenRequest {
                cache_salt: "tenant-b".into(),
                ..req(prompt.clone(), 2)
            })
            .unwrap();
        assert_eq!(u3.cached.total(), 0);
        // Continuing the conversation hits the prompt and the generated tokens' blocks.
        let mut longer = prompt.clone();
        longer.extend(&second);
        longer.extend([1, 2, 3]);
        let (_, u4) = dev.generate(req(longer, 2)).unwrap();
        assert_eq!(u4.cached.device, 36);
        let s = dev.stats().unwrap();
        assert_eq!(s.requests, 4);
        assert!(s.device_cached_blocks > 0 && s.prefill_tokens > 0);
    }

    #[test]
    fn concurrent_overlapping_requests_batch_and_agree() {
        let base: Vec<u32> = (0..24).map(|i| (i * 7 + 1) % 500).collect();
        let prompts: Vec<Vec<u32>> = (0..6u32)
            .map(|j| {
                let mut p = base.clone();
                p.extend((0..(j + 3)).map(|i| (i * 31 + j * 5) % 500));
                p
            })
            .collect();
        let solo = engine(KvReuse::None, 128);
        let want: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| solo.generate(req(p.clone(), 6)).unwrap().0)
            .collect();
        let dev = engine(KvReuse::Device, 128);
        let rxs: Vec<_> = prompts
            .iter()
            .map(|p| dev.submit(req(p.clone(), 6)).unwrap())
            .collect();
        for (mut rx, want) in rxs.into_iter().zip(want) {
            let mut got = Vec::new();
            while let Some(ev) = rx.blocking_recv() {
                match ev {
                    SeqEvent::Token(t) => got.push(t),
                    SeqEvent::Finished { .. } => break,
                    SeqEvent::Failed(e) => panic!("{e}"),
                }
            }
            assert_eq!(got, want);
        }
    }

    #[test]
    fn bad_requests_are_refused_and_oversized_ones_fail() {
        let e = engine(KvReuse::Device, 8);
        for (r, needle) in [
            (req(vec![], 1), "empty"),
            (req(vec![1], 0), "max_tokens"),
            (req(vec![9999], 1), "token id 9999"),
            (req(vec![1; 4000], 200), "positions"),
            (
                GenRequest {
                    sampling: Sampling {
                        temperature: -1.0,
                        ..Sampling::default()
                    },
                    ..req(vec![1], 1)
                },
                "temperature",
            ),
        ] {
            let err = e.submit(r).unwrap_err().to_string();
            assert!(err.contains(needle), "{err}");
        }
        // 8 slots of 4 tokens: a 40-token request can never fit.
        let err = e.generate(req(vec![1; 36], 4)).unwrap_err().to_string();
        assert!(err.contains("pool full"), "{err}");
        let (t, _) = e.generate(req(vec![1; 20], 4)).unwrap();
        assert_eq!(t.len(), 4, "the engine still serves");
    }
}
