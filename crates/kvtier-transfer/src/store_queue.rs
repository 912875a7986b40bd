//! The store queue: device slots → host pages, admitted only while there is room; then, under
//! the write policy, host pages → disk in the background.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use kvtier_core::{BlockKey, NamespaceFingerprint};
use kvtier_store::{
    Appended, DiskTier, HostTier, PageWriter, PinnedPage, RemoteTier, Reservation, StoreError, TieredStore,
    WritePolicy,
};

use crate::disk_io_gate::DiskIoGate;
use crate::event_sink::EventSink;
use crate::queue_core::{QueueCore, QueueCounters, QueueStats};
use crate::route::{Route, Routes};
use crate::transfer_job::{CancelOnDrop, ChunkPlan, Continuation, JobCore, lock, validate_request};
use crate::transfer_timing::TransferTiming;
use crate::worker_threads::{ChunkedJob, WorkerHandle};
use crate::{CopyDirection, DevicePool, TransferConfig, TransferError};

/// One block to store: device `slot` holds block `key`, whose prefix block is `parent`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreBlock {
    /// The block.
    pub key: BlockKey,
    /// The block before it in its sequence (`None` for the first block); lets the host tier
    /// evict suffixes before prefixes.
    pub parent: Option<BlockKey>,
    /// The device slot holding its KV (must not be rewritten until the store is copied).
    pub slot: u32,
}

/// When a store's requester hears it is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Durability {
    /// When its blocks are in host memory (the slots may be reused); disk writes follow under
    /// the write policy.
    #[default]
    Host,
    /// Also when its blocks are written to the disk tier and fdatasynced, whatever the write
    /// policy (blocks the host tier already held are written too if the disk lacks them). The
    /// [`StoreEvent::Persisted`] report then says which blocks are durable.
    Disk,
}

/// What a store's device → host copy did.
#[derive(Debug, Clone)]
pub struct StoreReport {
    /// Blocks copied and published in the host tier.
    pub stored_blocks: usize,
    /// Blocks skipped because the host tier already had them (or was storing them).
    pub already_stored: usize,
    /// Blocks dropped because no host page could be freed (counted as dropped stores).
    pub no_space: Vec<BlockKey>,
    /// Of the already stored blocks, those another request was storing at that moment (their
    /// host page not yet published), or, for a [`Durability::Disk`] store, that were evicted
    /// before they could be pinned for their disk write: this store cannot make them durable.
    pub not_persisted: Vec<BlockKey>,
    /// Bytes copied.
    pub bytes: u64,
    /// When the copies ran.
    pub timing: TransferTiming,
}

/// What writing blocks to disk did.
#[derive(Debug, Clone, Default)]
pub struct PersistReport {
    /// Blocks written.
    pub written_blocks: usize,
    /// Blocks that were already on disk.
    pub already_on_disk: usize,
    /// Blocks that could not be written, with the reason (disk full, I/O error).
    pub failed: Vec<(BlockKey, String)>,
    /// Bytes written (payload).
    pub bytes: u64,
    /// When the copies ran: for a store, from its first device → host copy to its last disk
    /// write. `None` when nothing was to be written.
    pub timing: Option<TransferTiming>,
    /// When the disk writes alone ran. `None` when nothing was to be written.
    pub disk_timing: Option<TransferTiming>,
    /// For a [`Durability::Disk`] store: the written and already-on-disk blocks were
    /// fdatasynced afterwards (`false` if the sync failed: then they are in `failed` too).
    pub synced: bool,
}

/// Progress of a store, in order: exactly one `Copied`, then exactly one `Persisted`.
#[derive(Debug)]
pub enum StoreEvent {
    /// The device → host copy finished (or failed): the device slots may be reused.
    Copied(Result<StoreReport, TransferError>),
    /// The disk writes the write policy asked for finished (an empty report when there were
    /// none, or when the copy failed).
    Persisted(Result<PersistReport, TransferError>),
}

/// The requester's handle on a store. Dropping it before the device → host copy completes
/// cancels the store (nothing is published, reserved pages are freed); afterwards, dropping it
/// changes nothing: persistence continues in the background.
#[derive(Debug)]
pub struct StoreTicket {
    rx: mpsc::Receiver<StoreEvent>,
    cancel: StoreHandle,
}

/// The requester's handle on a store submitted with [`StoreQueue::submit_to`]: dropping it
/// before [`StoreEvent::Copied`] cancels the store, as dropping a [`StoreTicket`] does.
#[derive(Debug)]
pub struct StoreHandle(CancelOnDrop);

impl StoreHandle {
    /// The copy finished: dropping the handle no longer cancels anything.
    pub fn disarm(&mut self) {
        self.0.disarm();
    }
}

impl StoreTicket {
    /// Blocks until the device → host copy completes: the device slots may be reused.
    ///
    /// # Errors
    /// A copy error, or [`TransferError::ShutDown`] if the queue stopped first.
    pub fn wait(mut self) -> Result<StoreReport, TransferError> {
        self.copied()
    }

    /// Blocks until the copy and then the disk writes the write policy asked for complete.
    ///
    /// # Errors
    /// As [`StoreTicket::wait`].
    pub fn wait_persisted(mut self) -> Result<(StoreReport, PersistReport), TransferError> {
        let copied = self.copied()?;
        match self.rx.recv() {
            Ok(StoreEvent::Persisted(r)) => Ok((copied, r?)),
            _ => Err(TransferError::ShutDown),
        }
    }

    fn copied(&mut self) -> Result<StoreReport, TransferError> {
        let r = match self.rx.recv() {
            Ok(StoreEvent::Copied(r)) => r,
            _ => Err(TransferError::ShutDown),
        };
        self.cancel.disarm();
        r
    }
}

/// Device → host copies, on their own worker threads (at lower scheduling priority when
/// configured), with a bound on bytes in flight: when it is reached, new stores are refused
/// with a counted reason instead of queueing up behind, so stores never hold loads back. Disk
/// writes run on the same threads after the copies and count against the same bound.
#[derive(Debug)]
pub struct StoreQueue {
    core: QueueCore,
    gate: Arc<DiskIoGate>,
    max_defer: Duration,
}

impl StoreQueue {
    pub(crate) fn new(
        config: &TransferConfig,
        routes: Arc<Routes>,
        gate: Arc<DiskIoGate>,
    ) -> Result<Self, TransferError> {
        Ok(Self {
            core: QueueCore::new(
                "store",
                config.resolved_store_threads(),
                config.disk_write_threads.max(1),
                config.store_nice,
                config.store_inflight_limit.bytes(),
                config.chunk_bytes_usize(),
                routes,
            )?,
            gate,
            max_defer: Duration::from_millis(config.disk_write_defer_ms),
        })
    }

    /// Reserves a host page for each block not yet stored and queues the copies out of the
    /// device slots. Blocks become visible to matches when the whole store is copied; with the
    /// `all` write policy they are then written to disk.
    ///
    /// Cost: one page reservation per block now (may evict); the copies run on the store
    /// workers.
    ///
    /// # Errors
    /// [`TransferError::EmptyRequest`], [`TransferError::GeometryMismatch`],
    /// [`TransferError::SlotOutOfRange`], [`TransferError::DuplicateSlot`], and
    /// [`TransferError::QueueFull`] (counted as dropped stores). Nothing is reserved when an
    /// error is returned.
    pub fn submit(
        &self,
        pool: &Arc<dyn DevicePool>,
        store: &TieredStore,
        ns: NamespaceFingerprint,
        blocks: &[StoreBlock],
    ) -> Result<StoreTicket, TransferError> {
        self.ticket(pool, store, ns, blocks, Durability::Host)
    }

    /// Like [`StoreQueue::submit`] with [`Durability::Disk`]: wait with
    /// [`StoreTicket::wait_persisted`] to know the blocks are on stable storage.
    ///
    /// # Errors
    /// As [`StoreQueue::submit`], and [`TransferError::NoDiskTier`] without a disk tier.
    pub fn submit_durable(
        &self,
        pool: &Arc<dyn DevicePool>,
        store: &TieredStore,
        ns: NamespaceFingerprint,
        blocks: &[StoreBlock],
    ) -> Result<StoreTicket, TransferError> {
        self.ticket(pool, store, ns, blocks, Durability::Disk)
    }

    fn ticket(
        &self,
        pool: &Arc<dyn DevicePool>,
        store: &TieredStore,
        ns: NamespaceFingerprint,
        blocks: &[StoreBlock],
        durability: Durability,
    ) -> Result<StoreTicket, TransferError> {
        let (tx, rx) = mpsc::channel();
        let cancel = self.submit_to(pool, store, ns, blocks, durability, None, EventSink::channel(tx))?;
        Ok(StoreTicket { rx, cancel })
    }

    /// Like [`StoreQueue::submit`] (or [`StoreQueue::submit_durable`]), but the events go to
    /// `events` (on a store worker thread) instead of a ticket to block on. Never blocks.
    /// `not_after`: the store publishes nothing unless its copies end by then (the requester
    /// may write its slots again from then on).
    ///
    /// # Errors
    /// As [`StoreQueue::submit_durable`], and [`TransferError::TooLate`] when `not_after` has
    /// passed already; no event is sent when an error is returned.
    #[allow(clippy::too_many_arguments)]
    pub fn submit_to(
        &self,
        pool: &Arc<dyn DevicePool>,
        store: &TieredStore,
        ns: NamespaceFingerprint,
        blocks: &[StoreBlock],
        durability: Durability,
        not_after: Option<SystemTime>,
        events: EventSink<StoreEvent>,
    ) -> Result<StoreHandle, TransferError> {
        let geometry = *store.geometry();
        validate_request("store", pool.as_ref(), &geometry, blocks.iter().map(|b| b.slot))?;
        if let Some(t) = not_after {
            late(t, "were to start")?;
        }
        let durable_to = match durability {
            Durability::Host => None,
            Durability::Disk => match store.disk() {
                None => {
                    return Err(TransferError::NoDiskTier(
                        "this sidecar has no disk tier (disk.dir)",
                    ));
                }
                Some(_) if store.write_policy() == WritePolicy::None => {
                    return Err(TransferError::NoDiskTier("disk.write_policy is none"));
                }
                Some(disk) => Some(disk.clone()),
            },
        };
        let submitted = Instant::now();
        let asked = (blocks.len() * geometry.bytes_per_block()) as u64;
        let inflight = self.core.admit(asked, blocks.len())?;
        let host = store.host();
        let mut writers = Vec::with_capacity(blocks.len());
        let mut copies = Vec::with_capacity(blocks.len());
        let (mut already_stored, mut no_space, mut not_persisted) = (0, Vec::new(), Vec::new());
        // A durable store writes the blocks the host already held too, if the disk lacks them.
        let mut held = Vec::new();
        for b in blocks {
            match host.reserve(ns, b.key, b.parent) {
                Ok(Reservation::Writer(w)) => {
                    copies.push((b.slot, w.layer_range(0)?.0));
                    writers.push(w);
                }
                Ok(Reservation::AlreadyStored) => {
                    already_stored += 1;
                    if let Some(disk) = &durable_to
                        && !disk.contains(ns, b.key)
                    {
                        match host.pin(ns, b.key) {
                            Some(p) => held.push(p),
                            None => not_persisted.push(b.key),
                        }
                    }
                }
                Ok(Reservation::InFlight) => {
                    already_stored += 1;
                    not_persisted.push(b.key);
                }
                Err(StoreError::NoSpace { .. }) => no_space.push(b.key),
                Err(e) => return Err(e.into()),
            }
        }
        let c = &self.core.counters;
        c.no_space_blocks
            .fetch_add(no_space.len() as u64, Ordering::Relaxed);
        c.already_stored_blocks
            .fetch_add(already_stored as u64, Ordering::Relaxed);
        let cancel = Arc::new(AtomicBool::new(false));
        let plan = ChunkPlan::new(
            copies.len(),
            geometry.layers(),
            geometry.bytes_per_block_layer(),
            pool.batch_bytes().unwrap_or(self.core.chunk_bytes),
        );
        let parts = self.core.start(submitted, Arc::clone(&cancel), inflight);
        self.core.launch(Arc::new(StoreJob {
            core: JobCore::new(plan, parts),
            pool: Arc::clone(pool),
            host: host.clone(),
            ns,
            persist_to: durable_to
                .clone()
                .or_else(|| store.persists_on_store().then(|| store.disk().cloned()).flatten()),
            durable: durable_to.is_some(),
            remote_to: store.remote_on_store().cloned(),
            held: Mutex::new(held),
            layer_bytes: geometry.bytes_per_block_layer(),
            bytes: (copies.len() * geometry.bytes_per_block()) as u64,
            copies,
            writers: Mutex::new(writers),
            already_stored,
            no_space,
            not_persisted,
            not_after,
            events,
            shared: self.shared(),
            io_workers: self.core.io_handle(),
        }));
        Ok(StoreHandle(CancelOnDrop::new(cancel)))
    }

    /// Writes blocks already in the host tier to `disk` in the background (blocks the
    /// admission filter just admitted). Blocks no longer resident are skipped. Returns how many
    /// were queued.
    ///
    /// # Errors
    /// [`TransferError::QueueFull`]: the writes are dropped and counted.
    pub fn persist(
        &self,
        store: &TieredStore,
        ns: NamespaceFingerprint,
        keys: &[BlockKey],
    ) -> Result<usize, TransferError> {
        let Some(disk) = store.disk() else { return Ok(0) };
        let pins: Vec<PinnedPage> = keys
            .iter()
            .filter(|&&k| !disk.contains(ns, k))
            .filter_map(|&k| store.host().pin(ns, k))
            .collect();
        if pins.is_empty() {
            return Ok(0);
        }
        let bytes = (pins.len() * store.geometry().bytes_per_block()) as u64;
        let inflight = self.core.admit(bytes, 0).inspect_err(|_| {
            self.core
                .counters
                .persist_rejected_blocks
                .fetch_add(pins.len() as u64, Ordering::Relaxed);
        })?;
        let n = pins.len();
        let parts = self
            .core
            .start(Instant::now(), Arc::new(AtomicBool::new(false)), inflight);
        self.core.launch_io(Arc::new(PersistJob::new(
            disk.clone(),
            store.host().clone(),
            ns,
            pins,
            parts,
            None,
            self.shared(),
        )));
        Ok(n)
    }

    fn shared(&self) -> PersistShared {
        PersistShared {
            counters: Arc::clone(&self.core.counters),
            routes: Arc::clone(&self.core.routes),
            gate: Arc::clone(&self.gate),
            max_defer: self.max_defer,
        }
    }

    /// A snapshot of the queue's counters.
    pub fn stats(&self) -> QueueStats {
        self.core.stats()
    }

    /// Number of worker threads.
    pub fn threads(&self) -> usize {
        self.core.threads()
    }

    /// Blocks until no store (or disk write) is queued or running.
    pub fn wait_idle(&self) {
        self.core.wait_idle();
    }

    /// Like [`StoreQueue::wait_idle`], giving up at `deadline`. Returns whether every store and
    /// disk write finished; if not, [`QueueStats::pending_disk_blocks`] says how many blocks
    /// were still waiting for their disk write.
    pub fn wait_idle_until(&self, deadline: Instant) -> bool {
        self.core.wait_idle_until(deadline)
    }
}

/// The device → host copies of a store.
#[derive(Debug)]
struct StoreJob {
    core: JobCore,
    pool: Arc<dyn DevicePool>,
    host: HostTier,
    ns: NamespaceFingerprint,
    /// The disk to write the blocks to afterwards (write policy `all`, or a durable store).
    persist_to: Option<DiskTier>,
    /// The remote tier to write the new blocks to behind the store (its policy `all`).
    remote_to: Option<RemoteTier>,
    /// A [`Durability::Disk`] store: sync after writing, report which blocks are durable.
    durable: bool,
    /// Pages the host tier already held that a durable store writes too.
    held: Mutex<Vec<PinnedPage>>,
    /// (device slot, host page offset) per block being written.
    copies: Vec<(u32, usize)>,
    layer_bytes: usize,
    bytes: u64,
    writers: Mutex<Vec<PageWriter>>,
    already_stored: usize,
    no_space: Vec<BlockKey>,
    not_persisted: Vec<BlockKey>,
    /// The requester's `not_after`: nothing is published of copies that end later.
    not_after: Option<SystemTime>,
    events: EventSink<StoreEvent>,
    shared: PersistShared,
    io_workers: WorkerHandle,
}

/// `Err(TooLate)` once `not_after` has passed (`what`: the copies "ended", "were to start").
fn late(not_after: SystemTime, what: &str) -> Result<(), TransferError> {
    match SystemTime::now().duration_since(not_after) {
        Ok(by) if !by.is_zero() => Err(TransferError::TooLate(format!(
            "{what} {:.1} ms after the request's not_after",
            by.as_secs_f64() * 1e3
        ))),
        _ => Ok(()),
    }
}

/// What every disk write job needs from its queue.
#[derive(Debug, Clone)]
struct PersistShared {
    counters: Arc<QueueCounters>,
    routes: Arc<Routes>,
    gate: Arc<DiskIoGate>,
    max_defer: Duration,
}

impl ChunkedJob for StoreJob {
    fn claim(&self) -> Option<usize> {
        self.core.claim()
    }

    fn run(&self, chunk: usize) {
        let region = self.host.region();
        let last = self.core.run_chunk_batch(
            chunk,
            |layer, range| {
                // Past `not_after` nothing of this store can be published: the rest of its
                // copies are skipped, as after a failed one.
                if let Some(t) = self.not_after {
                    late(t, "were still running")?;
                }
                JobCore::copy_batch(
                    &*self.pool,
                    CopyDirection::DeviceToHost,
                    region,
                    layer,
                    self.layer_bytes,
                    &self.copies[range],
                )
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

    /// Publishes every page if every copy ran (frees them otherwise), tells the requester the
    /// slots are free, then hands the pages to the disk writer if the policy says so.
    fn finish(&self) {
        // Every copy has ended: in time for the requester, or nothing is published.
        let outcome = self
            .core
            .outcome()
            .and_then(|()| self.not_after.map_or(Ok(()), |t| late(t, "ended")));
        let writers = std::mem::take(&mut *lock(&self.writers));
        let held = std::mem::take(&mut *lock(&self.held));
        let blocks = self.copies.len() as u64;
        self.shared
            .counters
            .finish(&outcome, blocks, self.bytes, self.core.busy_ns());
        let report = outcome.map(|()| StoreReport {
            stored_blocks: self.copies.len(),
            already_stored: self.already_stored,
            no_space: self.no_space.clone(),
            not_persisted: self.not_persisted.clone(),
            bytes: self.bytes,
            timing: self.core.timing.snapshot(),
        });
        if report.is_err() {
            drop((writers, held));
            self.core.release_inflight();
            self.events.send(StoreEvent::Copied(report));
            self.events
                .send(StoreEvent::Persisted(Ok(PersistReport::default())));
            return;
        }
        self.shared
            .routes
            .add(Route::DeviceToHost, blocks, self.bytes, self.core.busy_ns());
        // Suffix first: eviction policies see a sequence's later blocks as older than its
        // earlier ones, so they leave in suffix-to-prefix order.
        let persist = match (&self.persist_to, &self.remote_to) {
            (None, None) => {
                writers.into_iter().rev().for_each(PageWriter::commit);
                None
            }
            (disk, remote) => {
                let mut pins: Vec<PinnedPage> =
                    writers.into_iter().rev().map(PageWriter::commit_pinned).collect();
                if let Some(remote) = remote {
                    // The blocks this store wrote (not those the host already held); drops
                    // are counted by the remote tier and never delay this reply.
                    for p in &pins {
                        let _ = remote.write_behind(self.ns, p.clone());
                    }
                }
                pins.extend(held);
                disk.as_ref().map(|d| (d.clone(), pins))
            }
        };
        // The disk job exists (its blocks counted as pending disk writes) before the requester
        // hears of the copy: a graceful stop right after the reply sees them.
        let job = match persist {
            Some((disk, pins)) if !pins.is_empty() => Some(PersistJob::new(
                disk,
                self.host.clone(),
                self.ns,
                pins,
                Continuation {
                    // Persistence outlives the ticket: it cannot be cancelled.
                    cancelled: Arc::new(AtomicBool::new(false)),
                    ..self.core.continuation()
                },
                Some(Requester {
                    events: self.events.clone(),
                    durability: if self.durable {
                        Durability::Disk
                    } else {
                        Durability::Host
                    },
                }),
                self.shared.clone(),
            )),
            _ => None,
        };
        self.events.send(StoreEvent::Copied(report));
        match job {
            Some(job) => self.io_workers.launch(Arc::new(job)),
            None => {
                // Nothing to write; a durable store still syncs what it found on disk (another
                // store may have written it since the last pass).
                let report = match (&self.persist_to, self.durable) {
                    (Some(disk), true) => match disk.sync() {
                        Ok(()) => PersistReport {
                            synced: true,
                            ..PersistReport::default()
                        },
                        Err(e) => {
                            tracing::warn!(error = %e, "durable store: disk tier sync failed");
                            PersistReport::default()
                        }
                    },
                    _ => PersistReport::default(),
                };
                self.core.release_inflight();
                self.events.send(StoreEvent::Persisted(Ok(report)));
            }
        }
    }
}

/// Who hears of a disk job's end (nobody, for writes the admission filter queued), and
/// whether it waits for them to be synced.
#[derive(Debug)]
struct Requester {
    events: EventSink<StoreEvent>,
    durability: Durability,
}

/// Host pages → disk entries, one block per chunk; each page stays pinned (so it is served from
/// memory, and not evicted) until its write finished.
#[derive(Debug)]
struct PersistJob {
    core: JobCore,
    disk: DiskTier,
    host: HostTier,
    ns: NamespaceFingerprint,
    /// (key, host page offset) per block.
    blocks: Vec<(BlockKey, usize)>,
    pins: Mutex<Vec<PinnedPage>>,
    written: AtomicU64,
    already: AtomicU64,
    failed: Mutex<Vec<(BlockKey, String)>>,
    events: Option<EventSink<StoreEvent>>,
    /// Sync the disk tier after the writes (a durable store).
    sync: bool,
    shared: PersistShared,
    /// Writes wait for pending disk reads until then at the latest.
    defer_until: Instant,
}

impl PersistJob {
    fn new(
        disk: DiskTier,
        host: HostTier,
        ns: NamespaceFingerprint,
        pins: Vec<PinnedPage>,
        parts: Continuation,
        requester: Option<Requester>,
        shared: PersistShared,
    ) -> Self {
        let sync = requester
            .as_ref()
            .is_some_and(|r| r.durability == Durability::Disk);
        let events = requester.map(|r| r.events);
        let blocks: Vec<(BlockKey, usize)> = pins
            .iter()
            .map(|p| (p.key(), p.layer_range(0).map_or(0, |r| r.0)))
            .collect();
        shared
            .counters
            .pending_disk_blocks
            .fetch_add(blocks.len() as u64, Ordering::Relaxed);
        Self {
            core: JobCore::new(ChunkPlan::new(blocks.len(), 1, 1, 1), parts),
            disk,
            host,
            ns,
            blocks,
            pins: Mutex::new(pins),
            written: AtomicU64::new(0),
            already: AtomicU64::new(0),
            failed: Mutex::new(Vec::new()),
            events,
            sync,
            defer_until: Instant::now() + shared.max_defer,
            shared,
        }
    }
}

impl ChunkedJob for PersistJob {
    fn claim(&self) -> Option<usize> {
        self.core.claim()
    }

    fn run(&self, chunk: usize) {
        let region = self.host.region();
        // Loads win: let pending disk reads go first (for a bounded time).
        self.shared.gate.wait_for_reads(self.defer_until);
        let last = self.core.run_chunk(
            chunk,
            |b, _| {
                let (key, offset) = self.blocks[b];
                // A block that cannot be written is reported and counted; the others go on.
                match self.disk.append(self.ns, key, region, offset) {
                    Ok(Appended::Written) => self.written.fetch_add(1, Ordering::Relaxed),
                    Ok(Appended::AlreadyStored) => self.already.fetch_add(1, Ordering::Relaxed),
                    Err(e) => {
                        lock(&self.failed).push((key, e.to_string()));
                        0
                    }
                };
                Ok(())
            },
            |_| {},
        );
        self.shared
            .counters
            .pending_disk_blocks
            .fetch_sub(1, Ordering::Relaxed);
        if last {
            self.finish();
        }
    }

    fn chunks(&self) -> usize {
        self.core.plan.total()
    }

    fn finish(&self) {
        // A durable store: every block written (or found on disk) reaches stable storage before
        // the report; the pages stay pinned until then.
        let mut failed = std::mem::take(&mut *lock(&self.failed));
        let synced = self.sync
            && match self.disk.sync() {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!(error = %e, "durable store: disk tier sync failed");
                    let reason = e.to_string();
                    let failed_keys: std::collections::HashSet<BlockKey> =
                        failed.iter().map(|f| f.0).collect();
                    let unsynced: Vec<(BlockKey, String)> = self
                        .blocks
                        .iter()
                        .filter(|b| !failed_keys.contains(&b.0))
                        .map(|b| (b.0, reason.clone()))
                        .collect();
                    failed.extend(unsynced);
                    false
                }
            };
        drop(std::mem::take(&mut *lock(&self.pins)));
        self.core.release_inflight();
        let written = self.written.load(Ordering::Relaxed);
        let block_bytes = self.host.geometry().bytes_per_block() as u64;
        let c = &self.shared.counters;
        c.disk_blocks.fetch_add(written, Ordering::Relaxed);
        c.disk_failed_blocks
            .fetch_add(failed.len() as u64, Ordering::Relaxed);
        self.shared.routes.add(
            Route::HostToDisk,
            written,
            written * block_bytes,
            self.core.busy_ns(),
        );
        if let Some(events) = &self.events {
            let report = self.core.outcome().map(|()| PersistReport {
                written_blocks: written as usize,
                already_on_disk: self.already.load(Ordering::Relaxed) as usize,
                failed,
                bytes: written * block_bytes,
                timing: Some(self.core.timing.snapshot()),
                disk_timing: Some(self.core.own_timing()),
                synced,
            });
            events.send(StoreEvent::Persisted(report));
        }
    }
}
