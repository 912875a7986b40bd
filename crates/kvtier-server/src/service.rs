//! The `kvtier.v1.KvTier` gRPC service.
//!
//! Handlers validate, then hand the work to the transfer queues; anything that blocks (page
//! reservation, waiting for copies) runs on tokio's blocking pool, never on the async workers.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use kvtier_core::{BlockHasher, BlockKey, KvGeometry, PoolLayout, Tier};
use kvtier_cuda::{CopyMethod, CudaBufferSpec, CudaDevicePool, CudaPoolSpec};
use kvtier_proto::proto::{self, kv_tier_server::KvTier};
use kvtier_proto::wire::{pack_keys, unpack_key, unpack_keys, unpack_not_after, unpack_one_key};
use kvtier_proto::{
    LayerEvents, LoadDone, MatchReply, MatchedBlock, StoreReply, WireTiming, geometry_from_proto,
    tier_filter_from_proto,
};
use kvtier_store::Removed;
use kvtier_transfer::{
    CpuDevicePool, DevicePool, Durability, EventSink, GroupedSlots, InflightBlocks, LoadBlock, LoadEvent,
    LoadHandle, PersistReport, ProcessBuffer, ProcessDevicePool, Route, StoreBlock, StoreEvent, StoreReport,
    TransferError, TransferTiming,
};
use metrics::{counter, histogram};
use tokio::sync::{broadcast, mpsc};
use tokio_stream::Stream;
use tonic::{Code, Request, Response, Status};

use crate::ServerError;
use crate::error::code_of;
use crate::metric_names as m;
use crate::pool_registry::{PoolEntry, Residency};
use crate::session::SessionStream;
use crate::state::ServerState;

/// The gRPC service. Cheap to clone.
#[derive(Debug, Clone)]
pub struct KvTierService {
    state: Arc<ServerState>,
    shutdown: tokio::sync::watch::Receiver<bool>,
}

impl KvTierService {
    /// A service over `state`; session streams end when `shutdown` turns true.
    pub fn new(state: Arc<ServerState>, shutdown: tokio::sync::watch::Receiver<bool>) -> Self {
        Self { state, shutdown }
    }

    /// The state it serves.
    pub fn state(&self) -> &Arc<ServerState> {
        &self.state
    }
}

/// Every method [`observed`] counts: their request series exist from start-up.
pub(crate) const METHODS: [&str; 11] = [
    "OpenSession",
    "RegisterPool",
    "UnregisterPool",
    "Match",
    "Load",
    "Store",
    "DeviceEvents",
    "Pin",
    "Unpin",
    "Clear",
    "Stats",
];

/// Creates every method's request series at zero — each code the server can answer, and the
/// handling-time histogram — so the first error of a kind is a step `rate()` sees.
pub(crate) fn register_request_series() {
    for method in METHODS {
        for code in 0..=16 {
            let code = code_label(Code::from_i32(code));
            counter!(m::GRPC_REQUESTS, "method" => method, "code" => code).increment(0);
        }
        let _ = histogram!(m::GRPC_SECONDS, "method" => method);
    }
}

/// The canonical gRPC name of a code, for the `code` label.
fn code_label(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// Runs a handler, counting the request by method and code and timing it.
async fn observed<T>(
    method: &'static str,
    f: impl Future<Output = Result<T, ServerError>>,
) -> Result<Response<T>, Status> {
    let start = Instant::now();
    let r = f.await;
    let code = r.as_ref().map_or_else(code_of, |_| Code::Ok);
    counter!(m::GRPC_REQUESTS, "method" => method, "code" => code_label(code)).increment(1);
    histogram!(m::GRPC_SECONDS, "method" => method).record(start.elapsed().as_secs_f64());
    if let Err(e) = &r {
        tracing::debug!(method, code = code_label(code), error = %e, "request refused");
    }
    r.map(Response::new).map_err(Status::from)
}

/// Runs blocking work on tokio's blocking pool.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ServerError> + Send + 'static,
) -> Result<T, ServerError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ServerError::InvalidArgument(format!("request handler failed: {e}")))?
}

/// Keys and their slots, which must pair up.
/// Maps a CPU pool the engine created at `path`: kvtier's pool file (header checked) without a
/// layout, plain memory laid out as `layout` with one.
fn open_cpu_pool(
    path: &str,
    geometry: KvGeometry,
    num_slots: u32,
    layout: Option<PoolLayout>,
) -> Result<CpuDevicePool, ServerError> {
    // A missing file is NOT_FOUND (from the open below); a directory or device is the client's
    // mistake, not the server's.
    if std::fs::metadata(path).is_ok_and(|m| !m.is_file()) {
        return Err(ServerError::InvalidArgument(format!(
            "shm_path {path}: not a regular file (give the pool file the engine created)"
        )));
    }
    let path = std::path::Path::new(path);
    Ok(match layout {
        None => CpuDevicePool::open(path, geometry, num_slots)?,
        Some(layout) => CpuDevicePool::open_with_layout(path, geometry, num_slots, layout)?,
    })
}

fn keys_and_slots(keys: &[u8], slots: &[u32]) -> Result<Vec<(BlockKey, u32)>, ServerError> {
    let keys = unpack_keys("keys", keys)?;
    if keys.len() != slots.len() {
        return Err(ServerError::InvalidArgument(format!(
            "{} keys but {} slots: give one slot per key",
            keys.len(),
            slots.len()
        )));
    }
    Ok(keys.into_iter().zip(slots.iter().copied()).collect())
}

/// The pool a request's copies go through, and each block's slot in it: the registered pool
/// and `slots` where its layout has one KV cache group and the request names no others; else a
/// [`GroupedSlots`] over it (group 0's `slots`, then `group_slots`), whose slot `b` is block
/// `b`. `load`: [`kvtier_transfer::NO_SLOT`] may leave a group's block unwritten. The lists
/// are taken out of the request, not copied.
fn request_pool(
    device: &Arc<dyn DevicePool>,
    slots: &mut Vec<u32>,
    group_slots: &mut Vec<proto::GroupSlots>,
    load: bool,
) -> Result<(Arc<dyn DevicePool>, Vec<u32>), ServerError> {
    let (slots, group_slots) = (std::mem::take(slots), std::mem::take(group_slots));
    if group_slots.is_empty() && device.layout().groups() == 1 {
        return Ok((Arc::clone(device), slots));
    }
    let lists = std::iter::once(slots)
        .chain(group_slots.into_iter().map(|g| g.slots))
        .collect();
    let grouped = GroupedSlots::new(Arc::clone(device), lists, load)?;
    let blocks = (0..grouped.blocks()).collect();
    Ok((Arc::new(grouped), blocks))
}

/// The wire form of a transfer's timing: its queues' instants as durations from acceptance.
fn wire_timing(t: &TransferTiming) -> WireTiming {
    WireTiming {
        queue: t
            .first_copy_start
            .map_or(Duration::ZERO, |s| s.saturating_duration_since(t.submitted)),
        latency: t.latency(),
        span: t.span(),
        active: t.active,
    }
}

impl KvTierService {
    fn check_batch(&self, what: &'static str, n: usize) -> Result<(), ServerError> {
        if n == 0 {
            return Err(ServerError::EmptyBatch(what));
        }
        let max = self.state.config.server.max_batch_blocks;
        if n > max {
            return Err(ServerError::BatchTooLarge { n, max });
        }
        Ok(())
    }

    fn refuse_if_shutting_down(&self) -> Result<(), ServerError> {
        if *self.shutdown.borrow() {
            return Err(ServerError::ShuttingDown);
        }
        Ok(())
    }

    /// [`locate`], on a blocking thread when a remote tier may be asked (its lookups are
    /// network round trips), inline otherwise.
    async fn locate(
        &self,
        pool: Arc<PoolEntry>,
        ns: kvtier_core::NamespaceFingerprint,
        keys: Vec<BlockKey>,
    ) -> Result<(Vec<MatchedBlock>, Vec<BlockKey>), ServerError> {
        if self.state.store.remote().is_none() {
            let found = locate(&self.state, &pool, ns, &keys);
            return Ok((found, keys));
        }
        let state = Arc::clone(&self.state);
        blocking(move || {
            let found = locate(&state, &pool, ns, &keys);
            Ok((found, keys))
        })
        .await
    }
}

/// The leading blocks found on this pool's device (as its engine reported), in host memory,
/// on disk or in the remote tier; the first block in none ends the run.
///
/// # Blocking
/// Up to the remote tier's timeout when it has one.
fn locate(
    state: &ServerState,
    pool: &PoolEntry,
    ns: kvtier_core::NamespaceFingerprint,
    keys: &[BlockKey],
) -> Vec<MatchedBlock> {
    let on_device = |slot| MatchedBlock {
        tier: Tier::Device,
        device_slot: Some(slot),
    };
    let device = pool.device_slots(keys);
    let mut out = Vec::with_capacity(keys.len());
    let mut i = 0;
    while i < keys.len() {
        if let Some(slot) = device[i] {
            out.push(on_device(slot));
            i += 1;
            continue;
        }
        // Counts host hits for the disk admission filter, and queues admitted writes.
        let m = state.queues.match_prefix(&state.store, ns, &keys[i..]);
        if m.tiers.is_empty() {
            break;
        }
        for t in m.tiers {
            out.push(device[i].map_or(
                MatchedBlock {
                    tier: t,
                    device_slot: None,
                },
                on_device,
            ));
            i += 1;
        }
    }
    out
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// Removals one `BlocksRemoved` event carries at most.
const REMOVALS_PER_EVENT: usize = 4096;

/// The next removal a watching session hears (`Err` when it lagged); never, for a session
/// that does not watch; `None` once the feed is closed.
async fn next_removal(
    rx: &mut Option<broadcast::Receiver<Removed>>,
) -> Option<Result<Removed, broadcast::error::RecvError>> {
    match rx {
        None => std::future::pending().await,
        Some(rx) => match rx.recv().await {
            Err(broadcast::error::RecvError::Closed) => None,
            r => Some(r),
        },
    }
}

/// One `BlocksRemoved` event: `first` and whatever else is already queued (up to
/// [`REMOVALS_PER_EVENT`] keys); a lag or a clear is said, not spelled out.
fn removal_event(
    first: Result<Removed, broadcast::error::RecvError>,
    mut rx: Option<&mut broadcast::Receiver<Removed>>,
) -> proto::SessionEvent {
    let mut out = proto::BlocksRemoved::default();
    let mut keys: Vec<BlockKey> = Vec::new();
    let mut next = Some(first);
    while let Some(r) = next.take() {
        match r {
            Ok(Removed::Block(_, key)) => keys.push(key),
            Ok(Removed::Cleared) => out.cleared = true,
            Err(_) => out.lost = true,
        }
        if keys.len() >= REMOVALS_PER_EVENT {
            break;
        }
        next = match rx.as_deref_mut().map(broadcast::Receiver::try_recv) {
            Some(Ok(r)) => Some(Ok(r)),
            Some(Err(broadcast::error::TryRecvError::Lagged(n))) => {
                Some(Err(broadcast::error::RecvError::Lagged(n)))
            }
            _ => None,
        };
    }
    out.keys = pack_keys(&keys);
    proto::SessionEvent {
        event: Some(proto::session_event::Event::Removed(out)),
    }
}

#[tonic::async_trait]
impl KvTier for KvTierService {
    type OpenSessionStream = BoxStream<proto::SessionEvent>;
    type LoadStream = BoxStream<proto::LoadEvent>;

    /// Opens a session and streams its events (Opened, then heartbeats) until the client goes
    /// away or the sidecar stops.
    ///
    /// # Cancel safety
    /// Dropping the stream (the client disconnecting) drops the session's guard: the session
    /// closes, its soft pins are released and its pools unregistered; transfers in flight
    /// keep their pool mapped until they finish.
    async fn open_session(
        &self,
        request: Request<proto::OpenSessionRequest>,
    ) -> Result<Response<Self::OpenSessionStream>, Status> {
        observed("OpenSession", async {
            self.refuse_if_shutting_down()?;
            let guard = self.state.sessions.open(&request.get_ref().client_name);
            let mut removals = request
                .get_ref()
                .watch_removals
                .then(|| self.state.store.removals().subscribe());
            let (tx, rx) = mpsc::channel(4);
            let opened = proto::SessionEvent {
                event: Some(proto::session_event::Event::Opened(proto::SessionOpened {
                    session_id: guard.id(),
                    geometry: Some(self.state.geometry.into()),
                    sidecar_pid: std::process::id(),
                })),
            };
            tx.try_send(Ok(opened)).map_err(|_| ServerError::ShuttingDown)?;
            let every = Duration::from_millis(self.state.config.server.heartbeat_ms.max(100));
            let mut shutdown = self.shutdown.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(every);
                tick.tick().await;
                loop {
                    tokio::select! {
                        _ = tick.tick() => {
                            let unix_ms = std::time::SystemTime::now()
                                .duration_since(std::time::UNIX_EPOCH)
                                .map_or(0, |d| d.as_millis() as u64);
                            let beat = proto::SessionEvent {
                                event: Some(proto::session_event::Event::Heartbeat(proto::Heartbeat { unix_ms })),
                            };
                            if tx.send(Ok(beat)).await.is_err() {
                                return; // the client went away
                            }
                        }
                        _ = shutdown.changed() => {
                            let _ = tx.send(Err(Status::unavailable("kvtier is shutting down"))).await;
                            return;
                        }
                        _ = tx.closed() => return,
                        first = next_removal(&mut removals) => {
                            let Some(first) = first else {
                                removals = None; // the store is gone: heartbeats go on
                                continue;
                            };
                            let event = removal_event(first, removals.as_mut());
                            if tx.send(Ok(event)).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            });
            Ok(Box::pin(SessionStream { rx, _guard: guard }) as Self::OpenSessionStream)
        })
        .await
    }

    /// Maps an engine's device pool for the session.
    ///
    /// # Cancel safety
    /// The mapping runs on a blocking thread; a call dropped before the pool was registered
    /// registers nothing (the mapping is unmapped when the thread's result is dropped). One
    /// dropped after registration leaves the pool registered until the session ends.
    async fn register_pool(
        &self,
        request: Request<proto::RegisterPoolRequest>,
    ) -> Result<Response<proto::RegisterPoolResponse>, Status> {
        observed("RegisterPool", async {
            self.refuse_if_shutting_down()?;
            // The process at the other end of the Unix socket (a process pool's memory).
            // None over TCP; Some(None) where the kernel gave no credentials.
            let peer_pid = request
                .extensions()
                .get::<tonic::transport::server::UdsConnectInfo>()
                .map(|c| c.peer_cred.and_then(|c| c.pid()));
            let r = request.into_inner();
            self.state.sessions.check(r.session_id)?;
            let claimed = geometry_from_proto(r.geometry.as_ref())?;
            if claimed != self.state.geometry {
                return Err(ServerError::GeometryMismatch {
                    served: self.state.geometry,
                    claimed,
                });
            }
            if r.tp_size == 0 {
                return Err(ServerError::InvalidArgument(
                    "tp_size 0: give the tensor-parallel world size (1 without tensor parallelism)".into(),
                ));
            }
            let num_slots = r.num_slots;
            let layout = r.layout.as_ref().map(PoolLayout::from);
            let device: Arc<dyn DevicePool> = match r.location {
                Some(proto::register_pool_request::Location::ShmPath(path)) if !path.is_empty() => {
                    Arc::new(blocking(move || open_cpu_pool(&path, claimed, num_slots, layout)).await?)
                }
                Some(proto::register_pool_request::Location::Cuda(cuda)) => {
                    let Some(layout) = layout else {
                        return Err(ServerError::InvalidArgument(
                            "layout is required for a CUDA pool (where K and V of each slot are)".into(),
                        ));
                    };
                    let spec = CudaPoolSpec {
                        device_ordinal: cuda.device_ordinal,
                        device_uuid: cuda.device_uuid.to_vec(),
                        buffers: cuda
                            .buffers
                            .iter()
                            .map(|b| CudaBufferSpec {
                                ipc_handle: b.ipc_handle.to_vec(),
                                offset_bytes: b.offset_bytes,
                                size_bytes: b.size_bytes,
                            })
                            .collect(),
                    };
                    let pool = blocking(move || {
                        Ok(CudaDevicePool::open_ipc(
                            &spec,
                            claimed,
                            num_slots,
                            layout,
                            CopyMethod::from_env(),
                        )?)
                    })
                    .await?;
                    tracing::info!(
                        session = r.session_id,
                        gpu = pool.context().info().ordinal,
                        copy = %pool.method_description(),
                        "CUDA pool opened by IPC handle"
                    );
                    Arc::new(pool)
                }
                Some(proto::register_pool_request::Location::Process(process)) => {
                    let pid = match peer_pid {
                        Some(Some(p)) if p > 0 => p as u32,
                        // The kernel reports 0 for a peer outside the sidecar's PID namespace.
                        Some(Some(_)) => {
                            return Err(ServerError::Unsupported(
                                "the engine's process is not visible from the sidecar's PID namespace (another \
                                 container?): share the process namespace (a pod's shareProcessNamespace) for a \
                                 process pool, or register a shared-memory pool"
                                    .into(),
                            ));
                        }
                        Some(None) => {
                            return Err(ServerError::Unsupported(
                                "the kernel gave no credentials for this connection (SO_PEERCRED), so the \
                                 sidecar cannot tell whose memory a process pool would be: register a \
                                 shared-memory pool"
                                    .into(),
                            ));
                        }
                        None => {
                            return Err(ServerError::Unsupported(
                                "a process pool is registered over the sidecar's Unix socket (the process at its \
                                 other end is the one whose memory the pool is); over TCP register a shared-memory \
                                 pool"
                                    .into(),
                            ));
                        }
                    };
                    let buffers = process
                        .buffers
                        .iter()
                        .map(|b| ProcessBuffer {
                            address: b.address,
                            bytes: b.size_bytes,
                        })
                        .collect();
                    let pool =
                        blocking(move || Ok(ProcessDevicePool::open(pid, buffers, claimed, num_slots, layout)?)).await?;
                    tracing::info!(session = r.session_id, pid, "process pool opened");
                    Arc::new(pool)
                }
                _ => {
                    return Err(ServerError::InvalidArgument(
                        "give shm_path (a CPU pool), cuda (a GPU pool) or process (memory of the engine's own)".into(),
                    ));
                }
            };
            let tp_size = r.tp_size;
            let kind = device.device_kind();
            let entry = self.state.sessions.register_pool(
                r.session_id,
                self.state.geometry,
                device,
                r.model_id,
                r.tp_rank,
                tp_size,
            )?;
            let ns = entry.namespace(self.state.geometry, "")?;
            tracing::info!(
                session = r.session_id,
                pool = entry.id,
                slots = num_slots,
                device = kind,
                "pool registered"
            );
            Ok(proto::RegisterPoolResponse {
                pool_id: entry.id,
                namespace_fingerprint: ns.to_le_bytes().to_vec().into(),
            })
        })
        .await
    }

    /// Unregisters a pool of the session.
    ///
    /// # Cancel safety
    /// Runs without awaiting: it has happened or not, never half.
    async fn unregister_pool(
        &self,
        request: Request<proto::UnregisterPoolRequest>,
    ) -> Result<Response<proto::UnregisterPoolResponse>, Status> {
        observed("UnregisterPool", async {
            let r = request.into_inner();
            self.state.sessions.unregister_pool(r.session_id, r.pool_id)?;
            Ok(proto::UnregisterPoolResponse {})
        })
        .await
    }

    /// Where each leading block of a sequence is (device, host, disk, remote).
    ///
    /// # Cancel safety
    /// Without a remote tier it runs without awaiting; with one, the lookup runs on a
    /// blocking thread and completes even if the call is dropped. Either way the hits it
    /// counts for the admission filters and the writes it admits are queued whether or not
    /// the reply is read.
    async fn r#match(
        &self,
        request: Request<proto::MatchRequest>,
    ) -> Result<Response<proto::MatchResponse>, Status> {
        observed("Match", async {
            let r = request.into_inner();
            let pool = self.state.sessions.pool(r.session_id, r.pool_id)?;
            let ns = pool.namespace(self.state.geometry, &r.cache_salt)?;
            let from_tokens = !r.token_ids.is_empty();
            let keys: Vec<BlockKey> = match (r.keys.is_empty(), from_tokens) {
                (false, false) => {
                    let keys = unpack_keys("keys", &r.keys)?;
                    self.check_batch("keys", keys.len())?;
                    keys
                }
                (true, true) => {
                    let bt = self.state.geometry.block_tokens() as usize;
                    self.check_batch("token_ids", r.token_ids.len() / bt)?;
                    BlockHasher::new(ns, self.state.geometry.block_tokens()).keys(&r.token_ids)
                }
                (true, false) => return Err(ServerError::EmptyBatch("keys or token_ids")),
                (false, true) => {
                    return Err(ServerError::InvalidArgument(
                        "give keys or token_ids, not both".into(),
                    ));
                }
            };
            let (found, keys) = self.locate(pool, ns, keys).await?;
            let hashed = if from_tokens {
                keys[..found.len()].to_vec()
            } else {
                Vec::new()
            };
            let reply = MatchReply::new(found, hashed, self.state.geometry.block_tokens());
            counter!(m::MATCH_LOOKUPS).increment(keys.len() as u64);
            for tier in Tier::ALL {
                let blocks = reply.tiers().filter(|&t| t == tier).count();
                counter!(m::MATCH_HITS, "tier" => tier.name()).increment(blocks as u64);
            }
            Ok(reply.into())
        })
        .await
    }

    /// Starts a load into device slots and streams its events (Missing, LayerReady per
    /// layer, Done).
    ///
    /// # Cancel safety
    /// Dropping the call before the stream is returned withdraws the submission if it was
    /// still waiting for a block in flight. Dropping the stream (the client cancelling or
    /// disconnecting) cancels the load: copies not started are skipped, the load's host pins
    /// are released and it is counted cancelled; copies already running finish, so the
    /// slots may be partly written.
    async fn load(&self, request: Request<proto::LoadRequest>) -> Result<Response<Self::LoadStream>, Status> {
        let arrived = Instant::now();
        observed("Load", async {
            self.refuse_if_shutting_down()?;
            let mut r = request.into_inner();
            let pool = self.state.sessions.pool(r.session_id, r.pool_id)?;
            let pairs = keys_and_slots(&r.keys, &r.slots)?;
            self.check_batch("keys", pairs.len())?;
            let (device, slots) = request_pool(&pool.device, &mut r.slots, &mut r.group_slots, true)?;
            let ns = pool.namespace(self.state.geometry, &r.cache_salt)?;
            let blocks: Vec<LoadBlock> = pairs
                .into_iter()
                .zip(slots)
                .map(|((key, _), slot)| LoadBlock { key, slot })
                .collect();
            let deadline = (r.deadline_ms > 0).then(|| arrived + Duration::from_millis(r.deadline_ms));
            let (tx, rx) = mpsc::unbounded_channel();
            // Layer events the caller did not ask for are dropped here, before the channel.
            let wanted = LayerEvents::from_proto(r.layer_event_stride, r.done_only);
            let layers = self.state.geometry.layers();
            let sink = EventSink::new(move |e| {
                if let LoadEvent::LayerReady { layer } = e
                    && !wanted.wants(layer, layers)
                {
                    return;
                }
                let _ = tx.send(e);
            });
            let state = &self.state;
            // Submitting never waits here; a block another request is writing into the host
            // tier right now sends the submission to a blocking thread to wait for it.
            let handle = match state.queues.load.submit_to(
                &device,
                &state.store,
                ns,
                &blocks,
                sink.clone(),
                InflightBlocks::Refuse,
            ) {
                Err(TransferError::WouldBlock) => {
                    let state = Arc::clone(&self.state);
                    blocking(move || {
                        Ok(state.queues.load.submit_to(
                            &device,
                            &state.store,
                            ns,
                            &blocks,
                            sink,
                            InflightBlocks::Wait,
                        )?)
                    })
                    .await?
                }
                r => r?,
            };
            let deadline = deadline.map(|d| (Box::pin(tokio::time::sleep_until(d.into())), r.deadline_ms));
            Ok(Box::pin(LoadEvents {
                rx,
                announce: handle.missing().to_vec(),
                handle,
                deadline,
                done: false,
            }) as Self::LoadStream)
        })
        .await
    }

    /// Copies device slots into the host tier; replies once the slots may be reused.
    ///
    /// # Cancel safety
    /// Dropping the call (the client cancelling or disconnecting) cancels the copies not
    /// started; blocks already copied stay stored, and copies already running still read
    /// their slots and complete. It is counted cancelled. Disk writes of blocks already
    /// stored go on behind the store queue.
    async fn store(
        &self,
        request: Request<proto::StoreRequest>,
    ) -> Result<Response<proto::StoreResponse>, Status> {
        observed("Store", async {
            self.refuse_if_shutting_down()?;
            let mut r = request.into_inner();
            let pool = self.state.sessions.pool(r.session_id, r.pool_id)?;
            let pairs = keys_and_slots(&r.keys, &r.slots)?;
            self.check_batch("keys", pairs.len())?;
            let (device, slots) = request_pool(&pool.device, &mut r.slots, &mut r.group_slots, false)?;
            let mut parent = unpack_key("parent", &r.parent)?;
            let ns = pool.namespace(self.state.geometry, &r.cache_salt)?;
            let blocks: Vec<StoreBlock> = pairs
                .into_iter()
                .zip(slots)
                .map(|((key, _), slot)| {
                    let b = StoreBlock { key, parent, slot };
                    parent = Some(key);
                    b
                })
                .collect();
            let durability = if r.durable {
                Durability::Disk
            } else {
                Durability::Host
            };
            // The copy (and a durable store's disk writes) are awaited on the runtime: a store
            // worker completes the oneshots.
            let (copied_tx, copied_rx) = tokio::sync::oneshot::channel();
            let (persisted_tx, persisted_rx) = tokio::sync::oneshot::channel();
            let txs = std::sync::Mutex::new((Some(copied_tx), Some(persisted_tx)));
            let sink = EventSink::new(move |e| {
                let mut txs = txs.lock().unwrap_or_else(|e| e.into_inner());
                match e {
                    StoreEvent::Copied(r) => {
                        if let Some(tx) = txs.0.take() {
                            let _ = tx.send(r);
                        }
                    }
                    StoreEvent::Persisted(r) => {
                        if let Some(tx) = txs.1.take() {
                            let _ = tx.send(r);
                        }
                    }
                }
            });
            let mut handle = self.state.queues.store.submit_to(
                &device,
                &self.state.store,
                ns,
                &blocks,
                durability,
                unpack_not_after(r.not_after_unix_ms),
                sink,
            )?;
            let report = copied_rx.await.unwrap_or(Err(TransferError::ShutDown))?;
            handle.disarm();
            histogram!(m::TRANSFER_SECONDS, "route" => Route::DeviceToHost.name())
                .record(report.timing.span().as_secs_f64());
            let mut reply = StoreReply {
                stored_blocks: report.stored_blocks as u32,
                already_stored: report.already_stored as u32,
                no_space: report.no_space.clone(),
                bytes: report.bytes,
                timing: Some(wire_timing(&report.timing)),
                ..StoreReply::default()
            };
            if r.durable {
                // The blocks stay in host memory whatever happens now; what this waits for is
                // their disk writes and the fdatasync after them.
                let persisted = persisted_rx.await.unwrap_or(Err(TransferError::ShutDown));
                let not_durable = not_durable(&blocks, &report, persisted.as_ref().ok());
                if let Ok(p) = &persisted
                    && let Some(t) = &p.timing
                {
                    reply.timing = Some(wire_timing(t));
                }
                reply.durable_blocks = (blocks.len() - not_durable.len()) as u32;
                reply.not_durable = not_durable;
            }
            Ok(reply.into())
        })
        .await
    }

    /// Applies residency changes the engine reports.
    ///
    /// # Cancel safety
    /// Validates every event first, then applies them in one step without awaiting: all or
    /// none.
    async fn device_events(
        &self,
        request: Request<proto::DeviceEventsRequest>,
    ) -> Result<Response<proto::DeviceEventsResponse>, Status> {
        observed("DeviceEvents", async {
            let r = request.into_inner();
            let pool = self.state.sessions.pool(r.session_id, r.pool_id)?;
            self.check_batch("events", r.events.len())?;
            let slots = pool.device.num_slots();
            let groups = pool.device.layout().groups();
            let mut changes = Vec::with_capacity(r.events.len());
            for (i, e) in r.events.iter().enumerate() {
                changes.push(match proto::device_event::Kind::try_from(e.kind) {
                    Ok(proto::device_event::Kind::Stored) if groups > 1 => {
                        return Err(ServerError::Unsupported(format!(
                            "events[{i}]: pool {} has {groups} KV cache groups, and a device-resident block \
                             is one slot of a pool of one group; report residency only for such pools",
                            r.pool_id
                        )));
                    }
                    Ok(proto::device_event::Kind::Stored) => {
                        if e.slot >= slots {
                            return Err(ServerError::Transfer(TransferError::SlotOutOfRange {
                                slot: e.slot,
                                num_slots: slots,
                            }));
                        }
                        Residency::Stored(unpack_one_key("events[].key", &e.key)?, e.slot)
                    }
                    Ok(proto::device_event::Kind::Removed) => {
                        Residency::Removed(unpack_one_key("events[].key", &e.key)?)
                    }
                    Ok(proto::device_event::Kind::Cleared) => Residency::Cleared,
                    _ => {
                        return Err(ServerError::InvalidArgument(format!(
                            "events[{i}].kind {} is not a kind",
                            e.kind
                        )));
                    }
                });
            }
            let device_blocks = pool.apply_residency(changes.iter().copied());
            Ok(proto::DeviceEventsResponse {
                applied: changes.len() as u32,
                device_blocks,
            })
        })
        .await
    }

    /// Soft-pins blocks in host memory for the session.
    ///
    /// # Cancel safety
    /// The pin is taken without awaiting; a call dropped after that leaves it held until its
    /// TTL or the session's end.
    async fn pin(&self, request: Request<proto::PinRequest>) -> Result<Response<proto::PinResponse>, Status> {
        observed("Pin", async {
            let r = request.into_inner();
            let pool = self.state.sessions.pool(r.session_id, r.pool_id)?;
            let keys = unpack_keys("keys", &r.keys)?;
            self.check_batch("keys", keys.len())?;
            let ns = pool.namespace(self.state.geometry, &r.cache_salt)?;
            let mut pages = Vec::with_capacity(keys.len());
            let mut missing = Vec::new();
            for k in keys {
                match self.state.store.host().pin(ns, k) {
                    Some(p) => pages.push(p),
                    None => missing.push(k),
                }
            }
            let pinned = pages.len() as u32;
            let expires = (r.ttl_ms > 0).then(|| Instant::now() + Duration::from_millis(r.ttl_ms));
            let pin_id = self.state.sessions.add_pin(r.session_id, pages, expires)?;
            Ok(proto::PinResponse {
                pin_id,
                pinned_blocks: pinned,
                missing: pack_keys(&missing),
            })
        })
        .await
    }

    /// Releases a soft pin.
    ///
    /// # Cancel safety
    /// Runs without awaiting: the pin is released or not, never half.
    async fn unpin(
        &self,
        request: Request<proto::UnpinRequest>,
    ) -> Result<Response<proto::UnpinResponse>, Status> {
        observed("Unpin", async {
            let r = request.into_inner();
            let released = self.state.sessions.unpin(r.session_id, r.pin_id)?;
            Ok(proto::UnpinResponse {
                released_blocks: released as u32,
            })
        })
        .await
    }

    /// Forgets blocks by namespace and tier.
    ///
    /// # Cancel safety
    /// The clear runs on a blocking thread and completes even if the call is dropped (what it
    /// removed is then not reported).
    async fn clear(
        &self,
        request: Request<proto::ClearRequest>,
    ) -> Result<Response<proto::ClearResponse>, Status> {
        observed("Clear", async {
            let r = request.into_inner();
            let ns = if r.all {
                self.state.sessions.check(r.session_id)?;
                None
            } else {
                let pool = self.state.sessions.pool(r.session_id, r.pool_id)?;
                Some(pool.namespace(self.state.geometry, &r.cache_salt)?)
            };
            let refuse = || {
                ServerError::InvalidArgument(format!(
                    "tier {}: clear TIER_HOST, TIER_DISK, TIER_REMOTE or host and disk (TIER_UNSPECIFIED)",
                    r.tier
                ))
            };
            let tier = tier_filter_from_proto("tier", r.tier).map_err(|_| refuse())?;
            let tiers: &'static [Tier] = match tier {
                None => &[Tier::Host, Tier::Disk],
                Some(Tier::Host) => &[Tier::Host],
                Some(Tier::Disk) => &[Tier::Disk],
                Some(Tier::Remote) => &[Tier::Remote],
                Some(Tier::Device) => return Err(refuse()),
            };
            if tier == Some(Tier::Remote) && self.state.store.remote().is_none() {
                return Err(ServerError::Unsupported(
                    "clearing TIER_REMOTE on a sidecar without a remote tier (remote.nodes)".into(),
                ));
            }
            let state = Arc::clone(&self.state);
            let cleared = blocking(move || Ok(state.store.clear_tiers(ns, tiers)?)).await?;
            Ok(proto::ClearResponse {
                host_blocks: cleared.host_blocks,
                disk_blocks: cleared.disk_blocks,
                kept_pinned: cleared.kept_pinned,
                remote_blocks: cleared.remote_blocks,
            })
        })
        .await
    }

    /// The sidecar's counters.
    ///
    /// # Cancel safety
    /// Reads only.
    async fn stats(
        &self,
        _request: Request<proto::StatsRequest>,
    ) -> Result<Response<proto::StatsResponse>, Status> {
        observed("Stats", async {
            let snapshot = crate::stats::Snapshot::take(&self.state);
            snapshot.publish();
            Ok(snapshot.to_proto())
        })
        .await
    }
}

/// A load's events as its gRPC response stream. Dropping it before `Done` (the client went
/// away, or the deadline passed) cancels the load.
struct LoadEvents {
    rx: mpsc::UnboundedReceiver<LoadEvent>,
    /// Blocks in no tier at submission, announced first so the engine can start recomputing.
    announce: Vec<BlockKey>,
    handle: LoadHandle,
    /// When to give up, and the deadline as the client gave it.
    deadline: Option<(Pin<Box<tokio::time::Sleep>>, u64)>,
    done: bool,
}

impl Stream for LoadEvents {
    type Item = Result<proto::LoadEvent, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        if !this.announce.is_empty() {
            let keys = std::mem::take(&mut this.announce);
            return Poll::Ready(Some(Ok(kvtier_proto::LoadEvent::Missing { keys }.into())));
        }
        // An event already delivered wins over a deadline that passed meanwhile.
        let ev = match this.rx.poll_recv(cx) {
            Poll::Ready(ev) => ev.unwrap_or(LoadEvent::Done(Err(TransferError::ShutDown))),
            Poll::Pending => {
                let Some((sleep, ms)) = &mut this.deadline else {
                    return Poll::Pending;
                };
                if sleep.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                this.done = true;
                counter!(m::GRPC_REQUESTS, "method" => "Load", "code" => "DEADLINE_EXCEEDED").increment(1);
                return Poll::Ready(Some(Err(Status::from(ServerError::DeadlineExceeded(*ms)))));
            }
        };
        Poll::Ready(Some(match ev {
            LoadEvent::LayerReady { layer } => Ok(kvtier_proto::LoadEvent::LayerReady { layer }.into()),
            LoadEvent::Missing { keys } => Ok(kvtier_proto::LoadEvent::Missing { keys }.into()),
            LoadEvent::Done(r) => {
                this.done = true;
                this.handle.disarm();
                r.map(|r| {
                    histogram!(m::TRANSFER_SECONDS, "route" => Route::HostToDevice.name())
                        .record(r.timing.span().as_secs_f64());
                    counter!(m::MISSING_BLOCKS).increment(r.missing.len() as u64);
                    kvtier_proto::LoadEvent::Done(LoadDone {
                        loaded_blocks: r.loaded_blocks as u32,
                        disk_blocks: r.disk_blocks as u32,
                        remote_blocks: r.remote_blocks as u32,
                        timing: Some(wire_timing(&r.timing)),
                        missing: r.missing,
                        bytes: r.bytes,
                    })
                    .into()
                })
                .map_err(|e| Status::from(ServerError::Transfer(e)))
            }
        }))
    }
}

/// A durable store's blocks that are not on stable storage, in request order: dropped for
/// lack of host memory, stored by another request at that moment, failed on disk — or all of
/// them if the disk writes did not finish or the sync after them failed.
fn not_durable(
    blocks: &[StoreBlock],
    copied: &StoreReport,
    persisted: Option<&PersistReport>,
) -> Vec<BlockKey> {
    let Some(p) = persisted.filter(|p| p.synced) else {
        return blocks.iter().map(|b| b.key).collect();
    };
    let bad: std::collections::HashSet<BlockKey> = copied
        .no_space
        .iter()
        .chain(&copied.not_persisted)
        .chain(p.failed.iter().map(|f| &f.0))
        .copied()
        .collect();
    blocks.iter().map(|b| b.key).filter(|k| bad.contains(k)).collect()
}

#[cfg(test)]
mod tests {
    use super::METHODS;

    #[test]
    fn every_observed_method_has_its_series_created_at_start() {
        let source = include_str!("service.rs");
        let needle = concat!("observed", "(\"");
        let observed: Vec<&str> = source
            .match_indices(needle)
            .map(|(i, _)| {
                let rest = &source[i + needle.len()..];
                &rest[..rest.find('"').unwrap()]
            })
            .collect();
        assert_eq!(observed.len(), METHODS.len(), "{observed:?}");
        for method in observed {
            assert!(METHODS.contains(&method), "{method} is not in METHODS");
        }
    }
}
