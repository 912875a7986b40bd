//! The load queue: host pages → device slots, layer by layer, latency first; blocks that are
//! only on disk are read into host pages first (route disk → host).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvtier_core::{BlockKey, NamespaceFingerprint, Tier};
use kvtier_store::{
    DiskTier, HostTier, PageWriter, PinnedPage, RemoteReads, RemoteTier, Reservation, StoreError, TieredStore,
};

use crate::disk_io_gate::{DiskIoGate, PendingReads};
use crate::event_sink::EventSink;
use crate::queue_core::{QueueCore, QueueCounters, QueueStats};
use crate::route::{Route, Routes};
use crate::transfer_job::{CancelOnDrop, ChunkPlan, Continuation, JobCore, lock, validate_request};
use crate::transfer_timing::TransferTiming;
use crate::worker_threads::{ChunkedJob, WorkerHandle};
use crate::{CopyDirection, DevicePool, TransferConfig, TransferError};

/// One block to load: block `key` into device `slot`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadBlock {
    /// The block.
    pub key: BlockKey,
    /// The device slot to fill (owned by the requester for the duration of the load).
    pub slot: u32,
}

/// Progress of a load, in order: at most one `Missing`, then `LayerReady` for layer 0, 1, …
/// (each once every loadable block of that layer is in its slot), then exactly one `Done`.
#[derive(Debug)]
// `Done` carries the report (with its timings) inline: one such event per load, so boxing it
// would buy nothing but an allocation.
#[allow(clippy::large_enum_variant)]
pub enum LoadEvent {
    /// Blocks found on disk at submission that could not be read (corrupt, reclaimed, I/O
    /// error): their slots are not written; recompute them.
    Missing {
        /// The blocks.
        keys: Vec<BlockKey>,
    },
    /// Every loadable block of this layer (and of all earlier layers) is in place.
    LayerReady {
        /// The layer.
        layer: u32,
    },
    /// The load finished (or failed); no event follows.
    Done(Result<LoadReport, TransferError>),
}

/// What a finished load did.
#[derive(Debug, Clone)]
pub struct LoadReport {
    /// Blocks copied into their slots (all layers).
    pub loaded_blocks: usize,
    /// Of those, blocks first read from disk into host pages.
    pub disk_blocks: usize,
    /// Of those, blocks first fetched from the remote tier into host pages.
    pub remote_blocks: usize,
    /// Requested blocks that could not be loaded: their slots were not written; the requester
    /// must recompute them.
    pub missing: Vec<BlockKey>,
    /// Bytes copied into the device.
    pub bytes: u64,
    /// When the copies ran (disk reads included).
    pub timing: TransferTiming,
    /// When the disk reads ran (`None` if nothing came from disk).
    pub disk_timing: Option<TransferTiming>,
    /// When the remote fetches ran (`None` if nothing came from the remote tier). A load with
    /// blocks from both has one promotion phase: both timings are that phase.
    pub remote_timing: Option<TransferTiming>,
}

/// The requester's handle on a load. Dropping it before `Done` cancels the load: chunks not yet
/// started are skipped and the host pages' pins are released.
#[derive(Debug)]
pub struct LoadTicket {
    rx: mpsc::Receiver<LoadEvent>,
    handle: LoadHandle,
}

/// The requester's handle on a load submitted with [`LoadQueue::submit_to`]: dropping it
/// before [`LoadEvent::Done`] cancels the load, as dropping a [`LoadTicket`] does.
#[derive(Debug)]
pub struct LoadHandle {
    cancel: CancelOnDrop,
    missing: Vec<BlockKey>,
}

impl LoadHandle {
    /// Requested blocks in no tier at submission (so recomputing them can start at once). Disk
    /// reads that fail later are announced by [`LoadEvent::Missing`].
    pub fn missing(&self) -> &[BlockKey] {
        &self.missing
    }

    /// The load finished: dropping the handle no longer cancels anything.
    pub fn disarm(&mut self) {
        self.cancel.disarm();
    }
}

/// What [`LoadQueue::submit_to`] does about a block that is being written into the host tier
/// right now (stored, or read from disk by another load).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InflightBlocks {
    /// Wait for its writer, up to the configured wait; report it missing after that.
    Wait,
    /// Do not block: refuse the whole load with [`TransferError::WouldBlock`].
    Refuse,
}

impl LoadTicket {
    /// Requested blocks in no tier at submission (so recomputing them can start at once). Disk
    /// reads that fail later are announced by [`LoadEvent::Missing`].
    pub fn missing(&self) -> &[BlockKey] {
        self.handle.missing()
    }

    /// Blocks until the next event; `None` once `Done` has been returned.
    pub fn next_event(&mut self) -> Option<LoadEvent> {
        if !self.handle.cancel.armed() {
            return None;
        }
        let ev = self
            .rx
            .recv()
            .unwrap_or(LoadEvent::Done(Err(TransferError::ShutDown)));
        if matches!(ev, LoadEvent::Done(_)) {
            self.handle.disarm();
        }
        Some(ev)
    }

    /// Like [`LoadTicket::next_event`], but gives up at `deadline`.
    ///
    /// # Errors
    /// [`TransferError::DeadlineExceeded`] if no event came in time (the ticket is still
    /// armed: dropping it cancels the load).
    pub fn next_event_until(&mut self, deadline: Instant) -> Result<Option<LoadEvent>, TransferError> {
        if !self.handle.cancel.armed() {
            return Ok(None);
        }
        let timeout = deadline.saturating_duration_since(Instant::now());
        let ev = match self.rx.recv_timeout(timeout) {
            Ok(ev) => ev,
            Err(mpsc::RecvTimeoutError::Timeout) => return Err(TransferError::DeadlineExceeded),
            Err(mpsc::RecvTimeoutError::Disconnected) => LoadEvent::Done(Err(TransferError::ShutDown)),
        };
        if matches!(ev, LoadEvent::Done(_)) {
            self.handle.disarm();
        }
        Ok(Some(ev))
    }

    /// Blocks until the load finishes, skipping the other events.
    ///
    /// # Errors
    /// The load's error, or [`TransferError::ShutDown`] if the queue stopped first.
    pub fn wait(mut self) -> Result<LoadReport, TransferError> {
        while let Some(ev) = self.next_event() {
            if let LoadEvent::Done(r) = ev {
                return r;
            }
        }
        Err(TransferError::ShutDown)
    }
}

/// Host → device copies (and disk → host reads), on their own worker threads. Loads are what a
/// request's time-to-first-token waits for: they never wait behind stores (separate threads and
/// queue), and each load is spread over all load workers so it finishes as early as possible.
#[derive(Debug)]
pub struct LoadQueue {
    core: QueueCore,
    inflight_wait: Duration,
    gate: Arc<DiskIoGate>,
}

impl LoadQueue {
    pub(crate) fn new(
        config: &TransferConfig,
        routes: Arc<Routes>,
        gate: Arc<DiskIoGate>,
    ) -> Result<Self, TransferError> {
        Ok(Self {
            core: QueueCore::new(
                "load",
                config.resolved_load_threads(),
                config.disk_read_threads.max(1),
                0,
                config.load_inflight_limit.bytes(),
                config.chunk_bytes_usize(),
                routes,
            )?,
            inflight_wait: Duration::from_millis(config.load_wait_inflight_ms),
            gate,
        })
    }

    /// Pins each block of namespace `ns` in the host tier — reserving a host page and queueing
    /// a disk read for blocks only on disk — and queues the copies into the device slots.
    /// Blocks in no tier are reported in [`LoadTicket::missing`] and in the report, never
    /// silently skipped. `blocks` list one sequence's blocks in order (as a match returns them):
    /// a block read from disk is linked to the one before it for eviction order.
    ///
    /// Cost: one pin or page reservation per block now; the reads and copies run on the load
    /// workers.
    ///
    /// # Blocking
    /// A block being written into the host tier right now (stored, or read from disk by another
    /// load) is waited for, up to the configured wait, and reported missing after it.
    ///
    /// # Errors
    /// [`TransferError::EmptyRequest`], [`TransferError::GeometryMismatch`],
    /// [`TransferError::SlotOutOfRange`], [`TransferError::DuplicateSlot`],
    /// [`TransferError::QueueFull`]. Nothing is pinned or queued when an error is returned.
    pub fn submit(
        &self,
        pool: &Arc<dyn DevicePool>,
        store: &TieredStore,
        ns: NamespaceFingerprint,
        blocks: &[LoadBlock],
    ) -> Result<LoadTicket, TransferError> {
        let (tx, rx) = mpsc::channel();
        let handle = self.submit_to(
            pool,
            store,
            ns,
            blocks,
            EventSink::channel(tx),
            InflightBlocks::Wait,
        )?;
        Ok(LoadTicket { rx, handle })
    }

    /// Like [`LoadQueue::submit`], but the events go to `events` (on a load worker thread)
    /// instead of a ticket to block on. With [`InflightBlocks::Refuse`] it never blocks, so an
    /// async runtime can call it directly and fall back to a blocking thread on
    /// [`TransferError::WouldBlock`].
    ///
    /// # Errors
    /// As [`LoadQueue::submit`], and [`TransferError::WouldBlock`]; no event is sent and
    /// nothing is pinned or queued when an error is returned.
    pub fn submit_to(
        &self,
        pool: &Arc<dyn DevicePool>,
        store: &TieredStore,
        ns: NamespaceFingerprint,
        blocks: &[LoadBlock],
        events: EventSink<LoadEvent>,
        inflight: InflightBlocks,
    ) -> Result<LoadHandle, TransferError> {
        let geometry = *store.geometry();
        validate_request("load", pool.as_ref(), &geometry, blocks.iter().map(|b| b.slot))?;
        let submitted = Instant::now();
        let host = store.host();
        let mut ready: Vec<(u32, PinnedPage)> = Vec::with_capacity(blocks.len());
        let mut promote: Vec<Promotion> = Vec::new();
        let mut missing = Vec::new();
        let mut no_space = 0u64;
        for (i, b) in blocks.iter().enumerate() {
            if let Some(pin) = host.pin(ns, b.key) {
                ready.push((b.slot, pin));
                continue;
            }
            // Not in host memory: read it from disk if it is there, else fetch it from the
            // remote tier (a value that is not there, or does not verify, is then missing).
            let from = if store.disk().is_some_and(|d| d.contains(ns, b.key)) {
                Some(Tier::Disk)
            } else if store.remote().is_some_and(RemoteTier::available) && !host.is_writing(b.key) {
                Some(Tier::Remote)
            } else {
                None
            };
            if let Some(from) = from {
                let parent = i.checked_sub(1).map(|p| blocks[p].key);
                match host.reserve(ns, b.key, parent) {
                    Ok(Reservation::Writer(writer)) => {
                        promote.push(Promotion {
                            slot: b.slot,
                            key: b.key,
                            page_offset: writer.layer_range(0)?.0,
                            writer: Some(writer),
                            from,
                        });
                        continue;
                    }
                    // Raced with another writer of the same block: wait for it below.
                    Ok(Reservation::AlreadyStored | Reservation::InFlight) => {}
                    Err(StoreError::NoSpace { .. }) => {
                        no_space += 1;
                        missing.push(b.key);
                        continue;
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            let pin = match inflight {
                InflightBlocks::Wait => host.pin_waiting(ns, b.key, self.inflight_wait),
                InflightBlocks::Refuse if host.is_writing(b.key) => return Err(TransferError::WouldBlock),
                InflightBlocks::Refuse => host.pin(ns, b.key),
            };
            match pin {
                Some(pin) => ready.push((b.slot, pin)),
                None => missing.push(b.key),
            }
        }
        let bytes = ((ready.len() + promote.len()) * geometry.bytes_per_block()) as u64;
        let inflight = self.core.admit(bytes, blocks.len())?;
        let c = &self.core.counters;
        c.missing_blocks
            .fetch_add(missing.len() as u64, Ordering::Relaxed);
        c.no_space_blocks.fetch_add(no_space, Ordering::Relaxed);
        let cancel = Arc::new(AtomicBool::new(false));
        let handle = LoadHandle {
            cancel: CancelOnDrop::new(Arc::clone(&cancel)),
            missing: missing.clone(),
        };
        let parts = self.core.start(submitted, cancel, inflight);
        let request = LoadRequest {
            pool: Arc::clone(pool),
            host: host.clone(),
            layer_bytes: geometry.bytes_per_block_layer(),
            chunk_bytes: pool.batch_bytes().unwrap_or(self.core.chunk_bytes),
            events,
            counters: Arc::clone(&self.core.counters),
            routes: Arc::clone(&self.core.routes),
            missing,
            workers: self.core.handle(),
        };
        if promote.is_empty() {
            self.core
                .launch(Arc::new(LoadJob::new(request, ready, None, parts)));
        } else {
            // Every remote block's fetch starts now, all in flight together, each verified into
            // its page as it arrives; the I/O workers take the pages back in order.
            let remote_writers: Vec<PageWriter> = promote
                .iter_mut()
                .filter(|p| p.from == Tier::Remote)
                .filter_map(|p| p.writer.take())
                .collect();
            let remote_reads = match store.remote() {
                Some(r) if !remote_writers.is_empty() => Some(r.start_reads(ns, remote_writers)),
                _ => None,
            };
            let mut next_remote = 0;
            let targets = promote
                .iter()
                .map(|p| {
                    let source = match p.from {
                        Tier::Remote => {
                            next_remote += 1;
                            Source::Remote(next_remote - 1)
                        }
                        _ => Source::Disk,
                    };
                    (p.key, p.page_offset, source)
                })
                .collect();
            let disk_reads = promote.iter().filter(|p| p.from == Tier::Disk).count();
            let plan = ChunkPlan::new(promote.len(), 1, 1, 1);
            self.core.launch_io(Arc::new(PromoteJob {
                core: JobCore::new(plan, parts),
                reads: self.gate.reads(disk_reads),
                disk: store.disk().cloned(),
                remote: remote_reads,
                host: host.clone(),
                ns,
                failed: promote.iter().map(|_| AtomicBool::new(false)).collect(),
                targets,
                promote: Mutex::new(promote),
                ready: Mutex::new(ready),
                request: Mutex::new(Some(request)),
            }));
        }
        Ok(handle)
    }

    /// A snapshot of the queue's counters.
    pub fn stats(&self) -> QueueStats {
        self.core.stats()
    }

    /// Number of worker threads.
    pub fn threads(&self) -> usize {
        self.core.threads()
    }

    /// Blocks until no load is queued or running.
    pub fn wait_idle(&self) {
        self.core.wait_idle();
    }
}

/// A block on its way from disk or the remote tier into a reserved host page.
#[derive(Debug)]
struct Promotion {
    slot: u32,
    key: BlockKey,
    page_offset: usize,
    /// The reserved page; lent to the remote read while it runs (`None` then).
    writer: Option<PageWriter>,
    /// [`Tier::Disk`] or [`Tier::Remote`].
    from: Tier,
}

/// Where a promoted block's bytes come from.
#[derive(Debug, Clone, Copy)]
enum Source {
    Disk,
    /// The block's index among the load's remote reads.
    Remote(usize),
}

/// What every phase of one load needs.
#[derive(Debug)]
struct LoadRequest {
    pool: Arc<dyn DevicePool>,
    host: HostTier,
    layer_bytes: usize,
    chunk_bytes: usize,
    events: EventSink<LoadEvent>,
    counters: Arc<QueueCounters>,
    routes: Arc<Routes>,
    missing: Vec<BlockKey>,
    workers: WorkerHandle,
}

/// Phase 1 of a load with blocks only on disk or in the remote tier: one read per chunk into
/// reserved host pages; then the pages are published and the device copies queued.
#[derive(Debug)]
struct PromoteJob {
    core: JobCore,
    /// The disk reads, counted by the disk I/O gate, so disk writes wait for them.
    reads: PendingReads,
    disk: Option<DiskTier>,
    /// The remote fetches, started when the load was submitted.
    remote: Option<RemoteReads>,
    host: HostTier,
    ns: NamespaceFingerprint,
    /// (key, host page offset, source) per block to read.
    targets: Vec<(BlockKey, usize, Source)>,
    failed: Vec<AtomicBool>,
    promote: Mutex<Vec<Promotion>>,
    ready: Mutex<Vec<(u32, PinnedPage)>>,
    /// Moved into the device-copy job at finish.
    request: Mutex<Option<LoadRequest>>,
}

impl ChunkedJob for PromoteJob {
    fn claim(&self) -> Option<usize> {
        self.core.claim()
    }

    fn run(&self, chunk: usize) {
        let region = self.host.region();
        let last = self.core.run_chunk(
            chunk,
            |b, _| {
                let (key, page_offset, source) = self.targets[b];
                let read = match (source, &self.disk, &self.remote) {
                    (Source::Disk, Some(disk), _) => {
                        let r = disk.read_into(self.ns, key, region, page_offset);
                        self.reads.one_done();
                        r
                    }
                    (Source::Remote(i), _, Some(remote)) => {
                        // One wake-up per load for the workers, not one per block: the values
                        // are verified into their pages as they arrive, on the tier's runtime.
                        remote.wait_all();
                        match remote.wait(i) {
                            Some((writer, r)) => {
                                lock(&self.promote)[b].writer = Some(writer);
                                r
                            }
                            None => Err(StoreError::NotFound { key, tier: "remote" }),
                        }
                    }
                    _ => Err(StoreError::NotFound { key, tier: "disk" }),
                };
                // A block that fails is reported missing; the others still load.
                if read.is_err() {
                    self.failed[b].store(true, Ordering::Release);
                }
                Ok(())
            },
            |_| {},
        );
        if last {
            self.finish();
        }
    }

    fn chunks(&self) -> usize {
        self.core.plan.total()
    }

    fn finish(&self) {
        let promote = std::mem::take(&mut *lock(&self.promote));
        let mut ready = std::mem::take(&mut *lock(&self.ready));
        let Some(mut request) = lock(&self.request).take() else {
            return;
        };
        if let Err(e) = self.core.outcome() {
            // Cancelled or failed: dropping the writers frees their pages unpublished.
            drop(promote);
            request.counters.count_failure(&e);
            request.events.send(LoadEvent::Done(Err(e)));
            return;
        }
        let mut failed = Vec::new();
        let (mut read, mut fetched, mut disk_failed) = (0u64, 0u64, 0u64);
        // Suffix first, so eviction policies see prefixes as younger.
        for (i, p) in promote.into_iter().enumerate().rev() {
            match p.writer {
                Some(writer) if !self.failed[i].load(Ordering::Acquire) => {
                    match p.from {
                        Tier::Remote => fetched += 1,
                        _ => read += 1,
                    }
                    ready.push((p.slot, writer.commit_pinned()));
                }
                _ => {
                    disk_failed += u64::from(p.from == Tier::Disk);
                    failed.push(p.key);
                }
            }
        }
        let geometry_bytes = self.host.geometry().bytes_per_block() as u64;
        let c = &request.counters;
        c.disk_blocks.fetch_add(read, Ordering::Relaxed);
        c.disk_failed_blocks.fetch_add(disk_failed, Ordering::Relaxed);
        // The phase's busy time, shared between the two routes by blocks.
        let busy = self.core.busy_ns();
        let remote_busy = busy * fetched / (read + fetched).max(1);
        request
            .routes
            .add(Route::DiskToHost, read, read * geometry_bytes, busy - remote_busy);
        request.routes.add(
            Route::RemoteToHost,
            fetched,
            fetched * geometry_bytes,
            remote_busy,
        );
        if !failed.is_empty() {
            failed.reverse();
            request.events.send(LoadEvent::Missing { keys: failed.clone() });
            request.missing.extend(failed);
        }
        let workers = request.workers.clone();
        let promoted = Promoted {
            disk_blocks: read as usize,
            remote_blocks: fetched as usize,
            timing: self.core.own_timing(),
        };
        workers.launch_first(Arc::new(LoadJob::new(
            request,
            ready,
            Some(promoted),
            self.core.continuation(),
        )));
    }
}

/// What the promotion phase of a load moved into host pages, and when.
#[derive(Debug, Clone, Copy)]
struct Promoted {
    disk_blocks: usize,
    remote_blocks: usize,
    timing: TransferTiming,
}

#[derive(Debug)]
struct LayerProgress {
    done: Vec<bool>,
    next: u32,
}

/// The device copies of a load, layer-major.
#[derive(Debug)]
struct LoadJob {
    core: JobCore,
    request: LoadRequest,
    /// (device slot, host page offset) per block.
    copies: Vec<(u32, usize)>,
    pins: Mutex<Vec<PinnedPage>>,
    /// Blocks read from disk or fetched from the remote tier first, and when.
    promoted: Option<Promoted>,
    progress: Mutex<LayerProgress>,
    bytes: u64,
}

impl LoadJob {
    fn new(
        request: LoadRequest,
        ready: Vec<(u32, PinnedPage)>,
        promoted: Option<Promoted>,
        parts: Continuation,
    ) -> Self {
        let geometry = *request.host.geometry();
        let copies = ready
            .iter()
            .map(|(slot, pin)| (*slot, pin.layer_range(0).map_or(0, |r| r.0)))
            .collect::<Vec<_>>();
        let plan = ChunkPlan::new(
            copies.len(),
            geometry.layers(),
            request.layer_bytes,
            request.chunk_bytes,
        );
        Self {
            core: JobCore::new(plan, parts),
            bytes: (copies.len() * geometry.bytes_per_block()) as u64,
            copies,
            pins: Mutex::new(ready.into_iter().map(|(_, p)| p).collect()),
            promoted,
            progress: Mutex::new(LayerProgress {
                done: vec![false; geometry.layers() as usize],
                next: 0,
            }),
            request,
        }
    }

    /// Reports layers in order: a layer is announced once it and every earlier layer are done.
    fn layer_finished(&self, layer: u32) {
        let mut p = lock(&self.progress);
        p.done[layer as usize] = true;
        while (p.next as usize) < p.done.len() && p.done[p.next as usize] {
            if !self.core.cancelled.load(Ordering::Acquire) {
                // A requester that went away is not an error.
                self.request.events.send(LoadEvent::LayerReady { layer: p.next });
            }
            p.next += 1;
        }
    }
}

impl ChunkedJob for LoadJob {
    fn claim(&self) -> Option<usize> {
        self.core.claim()
    }

    fn run(&self, chunk: usize) {
        let region = self.request.host.region();
        let last = self.core.run_chunk_batch(
            chunk,
            |layer, range| {
                JobCore::copy_batch(
                    &*self.request.pool,
                    CopyDirection::HostToDevice,
                    region,
                    layer,
                    self.request.layer_bytes,
                    &self.copies[range],
                )
            },
            |layer| self.layer_finished(layer),
        );
        if last {
            self.finish();
        }
    }

    fn chunks(&self) -> usize {
        self.core.plan.total()
    }

    fn finish(&self) {
        drop(std::mem::take(&mut *lock(&self.pins)));
        self.core.release_inflight();
        let outcome = self.core.outcome();
        let timing = self.core.timing.snapshot();
        let blocks = self.copies.len() as u64;
        self.request
            .counters
            .finish(&outcome, blocks, self.bytes, self.core.busy_ns());
        if outcome.is_ok() {
            self.request
                .routes
                .add(Route::HostToDevice, blocks, self.bytes, self.core.busy_ns());
        }
        let result = outcome.map(|()| LoadReport {
            loaded_blocks: self.copies.len(),
            disk_blocks: self.promoted.map_or(0, |p| p.disk_blocks),
            remote_blocks: self.promoted.map_or(0, |p| p.remote_blocks),
            missing: self.request.missing.clone(),
            bytes: self.bytes,
            timing,
            disk_timing: self.promoted.filter(|p| p.disk_blocks > 0).map(|p| p.timing),
            remote_timing: self.promoted.filter(|p| p.remote_blocks > 0).map(|p| p.timing),
        });
        self.request.events.send(LoadEvent::Done(result));
    }
}
