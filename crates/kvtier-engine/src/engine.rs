//! The engine handle: a cheap, cloneable [`Engine`] whose calls are commands to the scheduler
//! thread.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::command::Command;
use crate::kv_slots::KvSlots;
use crate::model::Model;
use crate::scheduler::Scheduler;
use crate::sidecar_link::{SidecarConfig, SidecarLink};
use crate::{
    EngineConfig, EngineError, EngineStats, GenRequest, KvReuse, ModelConfig, SeqEvent, Usage, Weights,
};
use kvtier_core::{KvGeometry, Tier};
use kvtier_transfer::CpuDevicePool;

/// A handle on the engine thread. Cheap to clone; the engine stops when the last handle is
/// dropped.
#[derive(Debug, Clone)]
pub struct Engine {
    tx: mpsc::Sender<Command>,
    /// Requests submitted and not yet admitted (in the command channel or the waiting
    /// queue); the scheduler takes one off per admission.
    queued: Arc<std::sync::atomic::AtomicUsize>,
    max_waiting: usize,
    model: Arc<ModelConfig>,
    geometry: KvGeometry,
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

/// A fresh `kvtier-engine-<pid>-<n>.pool` in /dev/shm (the temp directory without it). Pool
/// files of engines that died without removing theirs (SIGKILL, OOM) are removed first: such a
/// file names a process that no longer runs, or this process's own pid with a number it has not
/// used yet (a dead process had this pid before).
fn default_pool_path() -> std::path::PathBuf {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    // Shared memory when the system has it, else the temp directory.
    let shm = std::path::Path::new("/dev/shm");
    let dir = if shm.is_dir() {
        shm.to_owned()
    } else {
        std::env::temp_dir()
    };
    let me = std::process::id();
    if n == 0 {
        remove_stale_pool_files(&dir);
    }
    let path = dir.join(format!("kvtier-engine-{me}-{n}.pool"));
    if path.exists() {
        tracing::warn!(path = %path.display(), "removing a stale engine pool file left by a dead process with this pid");
        let _ = std::fs::remove_file(&path);
    }
    path
}

/// Removes `kvtier-engine-<pid>-<n>.pool` files in `dir` whose pid runs no process. (This
/// process's own are left alone: another of its engines may have just made one.)
fn remove_stale_pool_files(dir: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("kvtier-engine-"))
            .and_then(|n| n.strip_suffix(".pool"))
            .and_then(|n| n.split_once('-'))
            .filter(|(_, k)| k.parse::<u64>().is_ok())
            .and_then(|(p, _)| p.parse::<i32>().ok())
        else {
            continue;
        };
        // SAFETY: kill(2) with signal 0 only checks whether the pid exists.
        let gone = unsafe { libc::kill(pid, 0) } != 0
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if gone {
            tracing::info!(path = %e.path().display(), pid, "removing the pool file of an engine that is gone");
            let _ = std::fs::remove_file(e.path());
        }
    }
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
            None => default_pool_path(),
        };
        let pool = Arc::new(CpuDevicePool::create(Some(&path), geometry, config.device_slots)?);
        let kv = KvSlots::new(Arc::clone(&pool))?;
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
        let queued = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let scheduler = Scheduler::new(
            model,
            kv,
            link,
            geometry,
            config.clone(),
            pool,
            Arc::clone(&queued),
        );
        std::thread::Builder::new()
            .name("kvtier-engine".into())
            .spawn(move || scheduler.run(&rx))
            .map_err(|e| EngineError::Config(format!("cannot start the engine thread: {e}")))?;
        Ok(Self {
            tx,
            queued,
            max_waiting: config.max_waiting,
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
        if let Some(n) = req.logprobs
            && n > crate::request::MAX_TOP_LOGPROBS
        {
            return Err(EngineError::BadRequest(format!(
                "logprobs: at most {} alternatives per token ({n} asked)",
                crate::request::MAX_TOP_LOGPROBS
            )));
        }
        use std::sync::atomic::Ordering;
        let waiting = self.queued.fetch_add(1, Ordering::AcqRel);
        if waiting >= self.max_waiting {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            return Err(EngineError::Overloaded {
                waiting,
                limit: self.max_waiting,
            });
        }
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        if self
            .tx
            .send(Command::Submit(Box::new(req), tx, Instant::now()))
            .is_err()
        {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            return Err(EngineError::Stopped);
        }
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
                Some(SeqEvent::Prefilled(_) | SeqEvent::Logprobs(_)) => {}
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
    /// `None` clears every tier. Returns (host blocks, disk blocks) removed.
    ///
    /// # Errors
    /// [`EngineError::Config`] without a sidecar configured, [`EngineError::Sidecar`] when it
    /// is not connected or refuses; [`EngineError::Stopped`].
    pub fn clear_tier(&self, tier: Option<Tier>) -> Result<(u64, u64), EngineError> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_files_of_dead_engines_are_removed_and_live_ones_kept() {
        let dir = tempfile::tempdir().unwrap();
        let mut dead = std::process::Command::new("true").spawn().unwrap();
        let dead_pid = dead.id();
        dead.wait().unwrap();
        let file = |pid: u32, n: u32| dir.path().join(format!("kvtier-engine-{pid}-{n}.pool"));
        let (stale, mine, init, other) = (
            file(dead_pid, 0),
            file(std::process::id(), 7),
            file(1, 0),
            dir.path().join("kvtier-engine-notes.txt"),
        );
        for f in [&stale, &mine, &init, &other] {
            std::fs::write(f, b"x").unwrap();
        }
        remove_stale_pool_files(dir.path());
        assert!(!stale.exists(), "a dead engine's pool file was kept");
        assert!(mine.exists() && init.exists() && other.exists());
    }
    use crate::Sampling;

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
            ..GenRequest::default()
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
    fn a_full_waiting_queue_refuses_at_once_and_every_accepted_request_ends() {
        let model = ModelConfig::preset("tiny-moe").unwrap();
        let weights = Weights::random(&model, 3).unwrap();
        let e = Engine::start(
            model,
            weights,
            EngineConfig {
                block_tokens: 4,
                device_slots: 256,
                kv_reuse: KvReuse::Device,
                max_running: 1,
                max_waiting: 2,
                ..EngineConfig::default()
            },
        )
        .unwrap();
        // The first runs 200 decode steps while the others arrive microseconds apart: one
        // runs, two wait, the rest are refused.
        let results: Vec<_> = (0..8u32).map(|i| e.submit(req(vec![1 + i, 2, 3], 200))).collect();
        let refused = results
            .iter()
            .filter(|r| matches!(r, Err(EngineError::Overloaded { limit: 2, .. })))
            .count();
        assert!(refused >= 1, "{results:?}");
        let waiting = e.stats().unwrap().waiting;
        assert!(waiting <= 2, "{waiting} waiting");
        for mut rx in results.into_iter().flatten() {
            loop {
                match rx.blocking_recv() {
                    Some(SeqEvent::Finished { .. }) => break,
                    Some(SeqEvent::Failed(e)) => panic!("{e}"),
                    Some(_) => {}
                    None => panic!("a request was dropped without an end"),
                }
            }
        }
        assert_eq!(
            e.stats().unwrap().waiting,
            0,
            "nothing is left counted as waiting"
        );
        e.submit(req(vec![1], 1)).expect("room again");
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
                    SeqEvent::Prefilled(_) | SeqEvent::Logprobs(_) => {}
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
