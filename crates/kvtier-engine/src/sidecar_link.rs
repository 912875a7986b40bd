//! The engine's connection to the kvtier sidecar: Match, Load (streamed layer by layer into
//! the scheduler), Store and DeviceEvents, with reconnection. Every call is made from the
//! engine thread without waiting on the network except `Match`; loads and stores run as tasks
//! on a small runtime of the link's own and report back through shared state and channels.
//!
//! When the sidecar is down the engine serves by recompute: a failed call or the end of the
//! session stream drops the connection (and `/health` says so at once), and the engine tries
//! to connect again every `retry_ms`, at its next admission or while idle.

use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kvtier_client::{Client, ClientError, LoadEvent, PoolHandle, WireTiming};
use kvtier_core::{BlockKey, KvGeometry, Tier};
use kvtier_transfer::CpuDevicePool;

use crate::EngineError;

/// Why a call over the link failed. Cheap to clone (a load's failure is read by the stream's
/// task and by the sequence waiting on it).
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum LinkError {
    /// No session is open (the sidecar is down or was never reached).
    #[error("the kvtier sidecar is not connected")]
    NotConnected,
    /// The sidecar did not answer in time.
    #[error("kvtier {call} timed out after {after:?}")]
    TimedOut {
        /// The call (`connect`, `match`).
        call: &'static str,
        /// The time allowed.
        after: Duration,
    },
    /// The sidecar serves another KV geometry than the engine's pool.
    #[error(
        "the sidecar serves KV geometry {served}, the engine's is {engine}: start `kvtier serve` with the engine's model shape"
    )]
    GeometryMismatch {
        /// What the sidecar serves.
        served: KvGeometry,
        /// The engine's pool.
        engine: KvGeometry,
    },
    /// The client call failed (the sidecar's status, a connection or protocol error).
    #[error(transparent)]
    Client(Arc<ClientError>),
    /// The link's background task that carries the call has stopped.
    #[error("the kvtier link's control task stopped")]
    TaskStopped,
    /// A load's stream ended without its final report (the sidecar went away mid-load).
    #[error("the load stream ended without a final report")]
    NoReport,
    /// A load did not end before the engine's own deadline.
    #[error("the load did not finish in time")]
    LoadDeadline,
}

impl From<ClientError> for LinkError {
    fn from(e: ClientError) -> Self {
        Self::Client(Arc::new(e))
    }
}

impl LinkError {
    /// Whether the sidecar refused the call for lack of room (a full queue or host tier):
    /// the call was dropped and counted, the connection is sound.
    fn is_resource_exhausted(&self) -> bool {
        self.status_code() == Some(tonic::Code::ResourceExhausted)
    }

    /// Whether the sidecar ended the call at its deadline: the connection is sound.
    fn is_deadline(&self) -> bool {
        self.status_code() == Some(tonic::Code::DeadlineExceeded)
    }

    fn status_code(&self) -> Option<tonic::Code> {
        match self {
            Self::Client(c) => match c.as_ref() {
                ClientError::Status(s) => Some(s.code()),
                _ => None,
            },
            _ => None,
        }
    }
}

/// How long connecting (and registering the pool) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a match may take before the link gives the sidecar up.
const MATCH_TIMEOUT: Duration = Duration::from_secs(5);

/// One transfer as the engine saw it: its copies ran from `start` to `end` (engine clock,
/// from the sidecar's timing relative to when the call was sent).
#[derive(Debug, Clone, Copy)]
pub struct Window {
    /// First copy started.
    pub start: Instant,
    /// Last copy finished.
    pub end: Instant,
    /// Bytes moved.
    pub bytes: u64,
    /// Sum of the copies' own durations.
    pub active: Duration,
}

impl Window {
    fn of(sent: Instant, t: Option<WireTiming>, bytes: u64) -> Option<Self> {
        let t = t?;
        (bytes > 0).then(|| Self {
            start: sent + t.queue,
            end: sent + t.latency,
            bytes,
            active: t.active,
        })
    }
}

/// The store windows of one sequence, appended by the store tasks.
pub type StoreLog = Arc<Mutex<Vec<Window>>>;

/// A load's progress, shared between the task reading its event stream and the forward pass
/// waiting for layers.
#[derive(Debug, Default)]
pub struct LoadProgress {
    state: Mutex<LoadState>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct LoadState {
    layers_ready: u32,
    missing: Vec<BlockKey>,
    /// `Some` once the load ended: `Ok(true)` complete, `Ok(false)` complete with missing
    /// blocks, `Err` failed (stream error, deadline, sidecar gone).
    ended: Option<Result<bool, LinkError>>,
    /// Slots given up by the sequence while the load could still write them: released to the
    /// engine when the load ends.
    orphans: Vec<u32>,
    /// When the copies ran (set by the final report).
    window: Option<Window>,
}

/// How a load ended, as far as the sequence is concerned.
#[derive(Debug, Clone)]
pub enum LoadEnd {
    /// Every block is in its slot.
    Complete,
    /// The load finished but these blocks are not in their slots.
    Missing(Vec<BlockKey>),
    /// The load failed or did not finish in time; which slots were written is unknown.
    Failed(LinkError),
}

impl LoadProgress {
    fn update(&self, f: impl FnOnce(&mut LoadState)) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut s);
        self.changed.notify_all();
    }

    /// Waits until layer `layer` is loaded (`true`), or the load has failed or reported a
    /// missing block (`false`), or `deadline` passed (`false`).
    pub fn wait_layer(&self, layer: u32, deadline: Instant) -> bool {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if !s.missing.is_empty() || matches!(s.ended, Some(Err(_)) | Some(Ok(false))) {
                return false;
            }
            if s.layers_ready > layer || matches!(s.ended, Some(Ok(true))) {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            s = self
                .changed
                .wait_timeout(s, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Waits for the load to end, until `deadline`.
    pub fn wait_end(&self, deadline: Instant) -> LoadEnd {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            match &s.ended {
                Some(Ok(_)) if s.missing.is_empty() => return LoadEnd::Complete,
                Some(Ok(_)) => return LoadEnd::Missing(s.missing.clone()),
                Some(Err(e)) => return LoadEnd::Failed(e.clone()),
                None => {}
            }
            let now = Instant::now();
            if now >= deadline {
                return LoadEnd::Failed(LinkError::LoadDeadline);
            }
            s = self
                .changed
                .wait_timeout(s, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// When the load's copies ran, once it has ended with a report.
    pub fn window(&self) -> Option<Window> {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).window
    }

    /// Hands `slots` over to the load: if it has ended they come back at once (returned),
    /// otherwise they are released through the link when it ends.
    pub fn orphan(&self, slots: Vec<u32>) -> Vec<u32> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if s.ended.is_some() {
            slots
        } else {
            s.orphans.extend(slots);
            Vec::new()
        }
    }
}

/// Slots a store (its reply came) or an abandoned load (it ended) no longer uses.
#[derive(Debug)]
struct Released {
    slots: Vec<u32>,
    /// From a store (counted in flight until now).
    store: bool,
}

/// Connection settings.
#[derive(Debug, Clone)]
pub struct SidecarConfig {
    /// `unix:///path`, a socket path, or `http(s)://host:port`.
    pub target: kvtier_client::ConnectOptions,
    /// Wait between reconnection attempts.
    pub retry: Duration,
    /// Deadline the sidecar gets for each load.
    pub load_deadline: Duration,
}

/// What the ordered control task sends: residency changes, and matches, which must see every
/// change sent before them (a block the engine just dropped must not answer `DEVICE`).
#[derive(Debug)]
enum Ordered {
    Events(Vec<(BlockKey, Option<u32>)>),
    Match {
        salt: String,
        keys: Vec<BlockKey>,
        reply: tokio::sync::oneshot::Sender<Result<Vec<Tier>, LinkError>>,
    },
}

#[derive(Debug)]
struct Conn {
    ordered: tokio::sync::mpsc::UnboundedSender<Ordered>,
    client: Client,
    pool: PoolHandle,
}

/// The link. Owned by the engine thread.
#[derive(Debug)]
pub struct SidecarLink {
    rt: tokio::runtime::Runtime,
    config: SidecarConfig,
    model_id: String,
    pool: Arc<CpuDevicePool>,
    conn: Option<Conn>,
    retry_at: Instant,
    released_tx: mpsc::Sender<Released>,
    released_rx: mpsc::Receiver<Released>,
    /// Set by background tasks when a call failed: the connection is dropped at the next
    /// engine step.
    broken: Arc<std::sync::atomic::AtomicBool>,
    stores_in_flight: usize,
}

impl SidecarLink {
    /// A link for the engine's `pool` (which must have a file path) under `model_id`; does not
    /// connect yet.
    ///
    /// # Errors
    /// [`EngineError::Config`] if the runtime cannot start or the pool has no path.
    pub fn new(
        config: SidecarConfig,
        model_id: String,
        pool: Arc<CpuDevicePool>,
    ) -> Result<Self, EngineError> {
        if pool.path().is_none() {
            return Err(EngineError::Config(
                "the device pool must live in a shared-memory file for the sidecar to map it".into(),
            ));
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvtier-link")
            .enable_all()
            .build()
            .map_err(|e| EngineError::Config(format!("cannot start the sidecar link runtime: {e}")))?;
        let (released_tx, released_rx) = mpsc::channel();
        Ok(Self {
            rt,
            config,
            model_id,
            pool,
            conn: None,
            retry_at: Instant::now(),
            released_tx,
            released_rx,
            broken: Arc::default(),
            stores_in_flight: 0,
        })
    }

    /// The sidecar's address.
    pub fn target(&self) -> &str {
        &self.config.target.target
    }

    /// Whether a session is open now: a connection whose session stream is still open and
    /// whose calls have not failed since (what `/health` reports). Cost: two atomic loads.
    pub fn is_connected(&self) -> bool {
        self.conn.as_ref().is_some_and(|c| c.client.session_open())
            && !self.broken.load(std::sync::atomic::Ordering::Acquire)
    }

    /// How long an idle engine may wait before it looks at the link again: until the next
    /// reconnection attempt is due while down (zero if due now), one retry interval while up
    /// (a session that ends while idle is then noticed, and replaced, within two intervals).
    pub fn check_in(&self) -> Duration {
        if self.is_connected() {
            self.config.retry
        } else {
            self.retry_at.saturating_duration_since(Instant::now())
        }
    }

    /// Connects (and registers the pool) if not connected and a retry is due. Returns `Some`
    /// with `true` when this call made a new connection (the engine then re-announces its
    /// device-resident blocks), `Some(false)` when already connected, `None` when down.
    pub fn ensure_connected(&mut self) -> Option<bool> {
        if self.broken.swap(false, std::sync::atomic::Ordering::AcqRel) {
            self.drop_conn(&"a background call failed");
        }
        if self.conn.as_ref().is_some_and(|c| !c.client.session_open()) {
            self.drop_conn(&"the session stream ended (the sidecar stopped or restarted)");
        }
        if self.conn.is_some() {
            return Some(false);
        }
        if Instant::now() < self.retry_at {
            return None;
        }
        let target = self.config.target.clone();
        let model = self.model_id.clone();
        let pool = Arc::clone(&self.pool);
        let geometry = *kvtier_transfer::DevicePool::geometry(pool.as_ref());
        let attempt = self.rt.block_on(async move {
            let connect = async {
                let mut client = Client::connect_with(&target, "kvtier-engine").await?;
                if client.geometry() != geometry {
                    return Err(LinkError::GeometryMismatch {
                        served: client.geometry(),
                        engine: geometry,
                    });
                }
                let handle = client.register_cpu_pool(&pool, &model, 0, 1).await?;
                Ok((client, handle))
            };
            tokio::time::timeout(CONNECT_TIMEOUT, connect)
                .await
                .unwrap_or(Err(LinkError::TimedOut {
                    call: "connect",
                    after: CONNECT_TIMEOUT,
                }))
        });
        match attempt {
            Ok((client, pool)) => {
                let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Ordered>();
                let (c, p, broken) = (client.clone(), pool.clone(), Arc::clone(&self.broken));
                // One task sends residency changes and matches, in order.
                self.rt.spawn(async move {
                    let mut c = c;
                    while let Some(msg) = rx.recv().await {
                        match msg {
                            Ordered::Events(batch) => {
                                for part in batch.chunks(4096) {
                                    if let Err(e) = c.device_events(&p, part).await {
                                        tracing::warn!(error = %e, "kvtier device events failed");
                                        broken.store(true, std::sync::atomic::Ordering::Release);
                                        return;
                                    }
                                }
                            }
                            Ordered::Match { salt, keys, reply } => {
                                let r = c
                                    .match_keys(&p, &salt, &keys)
                                    .await
                                    .map(|m| m.tiers().collect())
                                    .map_err(LinkError::from);
                                let _ = reply.send(r);
                            }
                        }
                    }
                });
                tracing::info!(target = %self.config.target.target, pool = pool.id, "connected to the kvtier sidecar");
                self.conn = Some(Conn {
                    client,
                    pool,
                    ordered: tx,
                });
                Some(true)
            }
            Err(e) => {
                tracing::warn!(target = %self.config.target.target, error = %e, "kvtier sidecar unavailable; serving by recompute");
                self.retry_at = Instant::now() + self.config.retry;
                None
            }
        }
    }

    fn drop_conn(&mut self, why: &dyn std::fmt::Display) {
        if self.conn.take().is_some() {
            tracing::warn!(target = %self.config.target.target, reason = %why, "lost the kvtier sidecar; serving by recompute");
        }
        self.retry_at = Instant::now() + self.config.retry;
    }

    /// The leading blocks of `keys` kvtier holds in host memory, on disk or in its remote tier,
    /// [`Tier::Host`], [`Tier::Disk`] or [`Tier::Remote`] each (empty when down; the device
    /// cache is the engine's own).
    pub fn match_prefix(&mut self, salt: &str, keys: &[BlockKey]) -> Vec<Tier> {
        let Some(conn) = &self.conn else {
            return Vec::new();
        };
        if keys.is_empty() {
            return Vec::new();
        }
        let (reply, answer) = tokio::sync::oneshot::channel();
        let msg = Ordered::Match {
            salt: salt.to_owned(),
            keys: keys.to_vec(),
            reply,
        };
        let r = match conn.ordered.send(msg) {
            Ok(()) => self.rt.block_on(async move {
                tokio::time::timeout(MATCH_TIMEOUT, answer)
                    .await
                    .map_err(|_| LinkError::TimedOut {
                        call: "match",
                        after: MATCH_TIMEOUT,
                    })?
                    .map_err(|_| LinkError::TaskStopped)?
            }),
            Err(_) => Err(LinkError::TaskStopped),
        };
        match r {
            Ok(tiers) => tiers
                .into_iter()
                .take_while(|t| matches!(t, Tier::Host | Tier::Disk | Tier::Remote))
                .collect(),
            Err(e) => {
                self.drop_conn(&e);
                Vec::new()
            }
        }
    }

    /// Starts loading `blocks` into their slots; progress is reported into the returned
    /// handle. `None` when the sidecar is down.
    pub fn start_load(&mut self, salt: &str, blocks: Vec<(BlockKey, u32)>) -> Option<Arc<LoadProgress>> {
        let conn = self.conn.as_ref()?;
        let progress = Arc::new(LoadProgress::default());
        let (mut c, p, salt) = (conn.client.clone(), conn.pool.clone(), salt.to_owned());
        let (prog, released, broken) = (
            Arc::clone(&progress),
            self.released_tx.clone(),
            Arc::clone(&self.broken),
        );
        let deadline = self.config.load_deadline;
        self.rt.spawn(async move {
            let sent = Instant::now();
            let run = async {
                let mut stream = c.load(&p, &salt, &blocks, Some(deadline)).await?;
                while let Some(ev) = stream.next().await? {
                    match ev {
                        LoadEvent::LayerReady { layer } => {
                            prog.update(|s| s.layers_ready = s.layers_ready.max(layer + 1))
                        }
                        LoadEvent::Missing { keys } => prog.update(|s| s.missing.extend(keys)),
                        LoadEvent::Done(d) => {
                            let w = Window::of(sent, d.timing, d.bytes);
                            prog.update(|s| s.window = w);
                            return Ok(d.missing);
                        }
                    }
                }
                Err(LinkError::NoReport)
            };
            let result: Result<Vec<BlockKey>, LinkError> = run.await;
            if let Err(e) = &result
                && !e.is_deadline()
            {
                broken.store(true, std::sync::atomic::Ordering::Release);
            }
            let mut orphans = Vec::new();
            prog.update(|s| {
                match result {
                    Ok(missing) => {
                        for k in missing {
                            if !s.missing.contains(&k) {
                                s.missing.push(k);
                            }
                        }
                        s.ended = Some(Ok(s.missing.is_empty()));
                    }
                    Err(e) => s.ended = Some(Err(e)),
                }
                orphans = std::mem::take(&mut s.orphans);
            });
            if !orphans.is_empty() {
                let _ = released.send(Released {
                    slots: orphans,
                    store: false,
                });
            }
        });
        Some(progress)
    }

    /// Stores a run of one sequence's blocks (`parent` precedes the first); the slots come
    /// back through [`SidecarLink::take_released`] when the sidecar has copied them (or the
    /// call failed), and the copy's window is appended to `log`. Returns `false` (nothing
    /// sent, the caller keeps the slots) when down.
    pub fn store(
        &mut self,
        salt: &str,
        parent: Option<BlockKey>,
        blocks: Vec<(BlockKey, u32)>,
        log: StoreLog,
    ) -> bool {
        let Some(conn) = &self.conn else {
            return false;
        };
        let (mut c, p, salt) = (conn.client.clone(), conn.pool.clone(), salt.to_owned());
        let (released, broken) = (self.released_tx.clone(), Arc::clone(&self.broken));
        self.stores_in_flight += 1;
        self.rt.spawn(async move {
            let sent = Instant::now();
            match c.store(&p, &salt, parent, &blocks).await.map_err(LinkError::from) {
                Ok(r) => {
                    if let Some(w) = Window::of(sent, r.timing, r.bytes) {
                        log.lock().unwrap_or_else(|e| e.into_inner()).push(w);
                    }
                }
                // A full queue or no host space drops the store (counted by the sidecar): the
                // blocks stay on the device only.
                Err(e) if e.is_resource_exhausted() => {}
                Err(e) => {
                    tracing::warn!(error = %e, "kvtier store failed");
                    broken.store(true, std::sync::atomic::Ordering::Release);
                }
            }
            let _ = released.send(Released {
                slots: blocks.iter().map(|b| b.1).collect(),
                store: true,
            });
        });
        true
    }

    /// Stores sent whose replies have not been taken yet.
    pub fn stores_in_flight(&self) -> usize {
        self.stores_in_flight
    }

    /// Forgets kvtier's blocks of every namespace in `tier` (host, disk; `None`: every tier),
    /// as a benchmark does between scenarios. Returns (host blocks, disk blocks) removed.
    ///
    /// # Errors
    /// [`LinkError::NotConnected`], or the sidecar's refusal.
    pub fn clear(&mut self, tier: Option<Tier>) -> Result<(u64, u64), LinkError> {
        let conn = self.conn.as_ref().ok_or(LinkError::NotConnected)?;
        let (mut c, p) = (conn.client.clone(), conn.pool.clone());
        let r = self
            .rt
            .block_on(async move { c.clear(&p, "", true, tier).await })?;
        Ok((r.host_blocks, r.disk_blocks))
    }

    /// The sidecar's statistics snapshot (JSON).
    ///
    /// # Errors
    /// [`LinkError::NotConnected`], or the call failed.
    pub fn sidecar_stats(&mut self) -> Result<String, LinkError> {
        let conn = self.conn.as_ref().ok_or(LinkError::NotConnected)?;
        let mut c = conn.client.clone();
        Ok(self.rt.block_on(async move { c.stats().await })?.json)
    }

    /// Reports residency changes (in order, in the background).
    pub fn device_events(&mut self, events: Vec<(BlockKey, Option<u32>)>) {
        if events.is_empty() {
            return;
        }
        if let Some(conn) = &self.conn
            && conn.ordered.send(Ordered::Events(events)).is_err()
        {
            self.drop_conn(&"the device events task stopped");
        }
    }

    /// Slots whose stores or abandoned loads have finished.
    pub fn take_released(&mut self) -> Vec<u32> {
        let mut slots = Vec::new();
        for r in self.released_rx.try_iter() {
            if r.store {
                self.stores_in_flight -= 1;
            }
            slots.extend(r.slots);
        }
        slots
    }
}
