//! The scheduler thread: batches prefill chunks and decode steps of every running sequence
//! into one forward pass per step (continuous batching), reusing prefixes from its own device
//! cache and from kvtier's host and disk tiers, and publishing full blocks back to both.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvtier_core::{BlockHasher, BlockKey, KvGeometry, Namespace, Tier};
use kvtier_transfer::CpuDevicePool;
use tokio::sync::mpsc::UnboundedSender;

use crate::command::Command;
use crate::kv_slots::KvSlots;
use crate::model::{Model, SeqChunk};
use crate::sampling::Sampler;
use crate::sidecar_link::{LoadEnd, LoadProgress, SidecarLink, StoreLog, Window};
use crate::slot_cache::{Residency, SlotCache};
use crate::{
    CachedTokens, EngineConfig, EngineError, EngineStats, FinishReason, GenRequest, KvReuse, SeqEvent,
    TransferSpan, Transfers, Usage,
};

/// A kvtier load a sequence is waiting on: blocks `first .. first + hits.len()`.
#[derive(Debug)]
struct PendingLoad {
    progress: Arc<LoadProgress>,
    first: usize,
    hits: Vec<Tier>,
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
    stop_token_ids: Vec<u32>,
    min_tokens: usize,
    stop: Option<crate::request::StopCheck>,
    logprobs: Option<usize>,
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

/// The scheduler thread's state: the model, the device pool and its slots, the sidecar link,
/// and the sequences waiting and running.
pub(crate) struct Scheduler {
    model: Model,
    kv: KvSlots,
    cache: SlotCache,
    link: Option<SidecarLink>,
    geometry: KvGeometry,
    config: EngineConfig,
    waiting: VecDeque<(Box<GenRequest>, UnboundedSender<SeqEvent>, Instant)>,
    running: Vec<Seq>,
    stats: EngineStats,
    next_id: u64,
    /// The (running, waiting) counts last published as gauges.
    published_sizes: (usize, usize),
    /// Requests submitted and not yet admitted, shared with [`crate::Engine::submit`].
    queued: Arc<std::sync::atomic::AtomicUsize>,
    _pool: Arc<CpuDevicePool>,
}

impl Scheduler {
    /// A scheduler over `model` and the device pool behind `kv`; with a `link`, it tries to
    /// reach the sidecar now and says so when it cannot.
    pub(crate) fn new(
        model: Model,
        kv: KvSlots,
        link: Option<SidecarLink>,
        geometry: KvGeometry,
        config: EngineConfig,
        pool: Arc<CpuDevicePool>,
        queued: Arc<std::sync::atomic::AtomicUsize>,
    ) -> Self {
        let mut scheduler = Self {
            cache: SlotCache::new(config.device_slots, config.kv_reuse.uses_device()),
            model,
            kv,
            link,
            geometry,
            config,
            waiting: VecDeque::new(),
            running: Vec::new(),
            stats: EngineStats::default(),
            next_id: 0,
            published_sizes: (0, 0),
            queued,
            _pool: pool,
        };
        if let Some(link) = &mut scheduler.link
            && link.ensure_connected().is_none()
        {
            tracing::warn!(
                target = link.target(),
                "kvtier sidecar not reachable at start: serving by recompute until it is"
            );
        }
        scheduler
    }

    /// Serves commands and steps the running sequences until every handle is dropped and no
    /// sequence runs.
    pub(crate) fn run(mut self, rx: &mpsc::Receiver<Command>) {
        loop {
            let sizes = (self.running.len(), self.waiting.len());
            if sizes != self.published_sizes {
                crate::metrics::queue_sizes(sizes.0, sizes.1);
                self.published_sizes = sizes;
            }
            let cmd = if self.running.is_empty() && self.waiting.is_empty() {
                // Idle: wait for a command, waking to look at the sidecar link (a session that
                // ended is dropped, a lost sidecar reconnected when a retry is due) so it is
                // back before the next request.
                match self.link.as_ref().map(SidecarLink::check_in) {
                    Some(wait) => match rx.recv_timeout(wait.max(Duration::from_millis(10))) {
                        Ok(c) => Some(c),
                        Err(mpsc::RecvTimeoutError::Timeout) => {
                            self.reconnect();
                            continue;
                        }
                        Err(mpsc::RecvTimeoutError::Disconnected) => return,
                    },
                    None => match rx.recv() {
                        Ok(c) => Some(c),
                        Err(_) => return,
                    },
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
                // What is really queued: the waiting queue and submissions not yet read.
                s.waiting = self.queued.load(std::sync::atomic::Ordering::Acquire);
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
                    Some(link) => link.clear(tier).map_err(EngineError::from),
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
                    Some(link) => link.sidecar_stats().map_err(EngineError::from),
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

    /// Connects to the sidecar if the link is down and a retry is due; on a new session,
    /// tells the sidecar what the device holds.
    fn reconnect(&mut self) {
        if let Some(link) = &mut self.link
            && link.ensure_connected() == Some(true)
        {
            let held: Vec<(BlockKey, Option<u32>)> = self
                .cache
                .published()
                .into_iter()
                .map(|(k, s)| (k, Some(s)))
                .collect();
            link.device_events(held);
        }
    }

    /// Moves waiting requests into the running set while slots and room allow.
    fn admit(&mut self) {
        let bt = self.geometry.block_tokens() as usize;
        self.reconnect();
        while self.running.len() < self.config.max_running {
            let Some((req, out, arrived)) = self.waiting.pop_front() else {
                break;
            };
            self.queued.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
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
                stop_token_ids: req.stop_token_ids.clone(),
                min_tokens: req.min_tokens,
                stop: req.stop.clone(),
                logprobs: req.logprobs,
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
                self.queued.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
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
            let r = self.model.forward(&self.kv, &chunks, &mut |layer, skip| {
                for (i, progress, deadline) in &loads {
                    if !failed.contains(i) && !progress.wait_layer(layer as u32, *deadline) {
                        failed.push(*i);
                    }
                }
                // A chunk whose load failed reads no KV from here on: the load may still be
                // writing its slots (the chunk is redone once the load has ended).
                for (c, &(i, _)) in plan.iter().enumerate() {
                    skip[c] = failed.contains(&i);
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
                // Highest index first: `plan` is in decode-first order, and a swap_remove
                // moves the last sequence into the removed one's place.
                let mut failed: Vec<usize> = plan.iter().map(|&(i, _)| i).collect();
                failed.sort_unstable();
                for i in failed.into_iter().rev() {
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
                Tier::Device => s.cached.device += bt,
                Tier::Host => s.cached.host += bt,
                Tier::Disk => s.cached.disk += bt,
                Tier::Remote => s.cached.remote += bt,
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
            LoadEnd::Failed(e) => e.to_string(),
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
        let token = if s.generated() < s.min_tokens {
            // Not yet: end-of-sequence and stop tokens cannot be drawn.
            let mut masked = logits.to_vec();
            for &t in eos.iter().chain(&s.stop_token_ids) {
                if let Some(l) = masked.get_mut(t as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
            s.sampler.sample(&masked)
        } else {
            s.sampler.sample(logits)
        };
        if s.first_token.is_none() {
            s.first_token = Some(Instant::now());
            if s.out.send(SeqEvent::Prefilled(s.cached)).is_err() {
                return true; // the requester went away
            }
        }
        s.tokens.push(token);
        if decode {
            self.stats.decode_tokens += 1;
        }
        if let Some(top) = s.logprobs {
            let lp = crate::request::TokenLogprobs::of(logits, token, top);
            if s.out.send(SeqEvent::Logprobs(lp)).is_err() {
                return true;
            }
        }
        if s.out.send(SeqEvent::Token(token)).is_err() {
            return true; // the requester went away
        }
        let generated = &s.tokens[s.prompt_len..];
        let reason = if (!s.ignore_eos && eos.contains(&token))
            || s.stop_token_ids.contains(&token)
            || s.stop.as_ref().is_some_and(|c| (c.0)(generated))
        {
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
        self.stats.cached.remote += s.cached.remote;
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
        // Requesters that went away: waiting ones leave the queue (and its count) at once.
        let before = self.waiting.len();
        self.waiting.retain(|(_, out, _)| !out.is_closed());
        self.queued
            .fetch_sub(before - self.waiting.len(), std::sync::atomic::Ordering::AcqRel);
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
