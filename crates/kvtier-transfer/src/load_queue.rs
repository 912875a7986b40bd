//! The load queue: host pages → device slots, layer by layer, latency first.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kvtier_core::{BlockKey, NamespaceFingerprint};
use kvtier_store::{HostTier, PinnedPage};

use crate::transfer_job::{
    CancelOnDrop, ChunkPlan, JobCore, QueueCore, QueueCounters, QueueStats, validate_request,
};
use crate::transfer_timing::TransferTiming;
use crate::worker_pool::ChunkedJob;
use crate::{DevicePool, TransferError};

/// One block to load: the host block `key` into device `slot`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadBlock {
    /// The block.
    pub key: BlockKey,
    /// The device slot to fill (owned by the requester for the duration of the load).
    pub slot: u32,
}

/// Progress of a load, in order: `LayerReady` for layer 0, 1, … (each once every block of that
/// layer is in its slot), then exactly one `Done`.
#[derive(Debug)]
pub enum LoadEvent {
    /// Every requested block of this layer (and of all earlier layers) is in place.
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
    /// Requested blocks that were not resident in the host tier: their slots were not written;
    /// the requester must recompute them.
    pub missing: Vec<BlockKey>,
    /// Bytes copied.
    pub bytes: u64,
    /// When the copies ran.
    pub timing: TransferTiming,
}

/// The requester's handle on a load. Dropping it before `Done` cancels the load: chunks not yet
/// started are skipped and the host pages' pins are released.
#[derive(Debug)]
pub struct LoadTicket {
    rx: mpsc::Receiver<LoadEvent>,
    cancel: CancelOnDrop,
    missing: Vec<BlockKey>,
}

impl LoadTicket {
    /// Requested blocks that are not resident (known at submission, so recomputing them can
    /// start at once).
    pub fn missing(&self) -> &[BlockKey] {
        &self.missing
    }

    /// Blocks until the next event; `None` once `Done` has been returned.
    pub fn next_event(&mut self) -> Option<LoadEvent> {
        if !self.cancel.armed() {
            return None;
        }
        let ev = self
            .rx
            .recv()
            .unwrap_or(LoadEvent::Done(Err(TransferError::ShutDown)));
        if matches!(ev, LoadEvent::Done(_)) {
            self.cancel.disarm();
        }
        Some(ev)
    }

    /// Blocks until the load finishes, skipping layer events.
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

/// Host → device copies, on their own worker threads. Loads are what a request's
/// time-to-first-token waits for: they never wait behind stores (separate threads and queue),
/// and each load is spread over all load workers so it finishes as early as possible.
#[derive(Debug)]
pub struct LoadQueue {
    core: QueueCore,
}

impl LoadQueue {
    pub(crate) fn new(threads: usize, limit_bytes: u64, chunk_bytes: usize) -> Result<Self, TransferError> {
        Ok(Self {
            core: QueueCore::new("load", threads, 0, limit_bytes, chunk_bytes)?,
        })
    }

    /// Pins each block of namespace `ns` in `host` and queues its copy into its device slot.
    /// Blocks that are not resident are reported in [`LoadTicket::missing`] and in the report,
    /// never silently skipped.
    ///
    /// Cost: one pin per block now; the copies (`blocks × layers` block-layers) run on the
    /// load workers.
    ///
    /// # Errors
    /// [`TransferError::EmptyRequest`], [`TransferError::GeometryMismatch`],
    /// [`TransferError::SlotOutOfRange`], [`TransferError::DuplicateSlot`],
    /// [`TransferError::QueueFull`]. Nothing is pinned or queued when an error is returned.
    pub fn submit(
        &self,
        pool: &Arc<dyn DevicePool>,
        host: &HostTier,
        ns: NamespaceFingerprint,
        blocks: &[LoadBlock],
    ) -> Result<LoadTicket, TransferError> {
        validate_request("load", pool.as_ref(), host, blocks.iter().map(|b| b.slot))?;
        let submitted = Instant::now();
        let mut pins: Vec<PinnedPage> = Vec::with_capacity(blocks.len());
        let mut copies = Vec::with_capacity(blocks.len());
        let mut missing = Vec::new();
        for b in blocks {
            match host.pin(ns, b.key) {
                Some(pin) => {
                    copies.push((b.slot, pin.layer_range(0)?.0));
                    pins.push(pin);
                }
                None => missing.push(b.key),
            }
        }
        let geometry = *host.geometry();
        let bytes = (copies.len() * geometry.bytes_per_block()) as u64;
        let inflight = self.core.admit(bytes, blocks.len())?;
        self.core
            .counters
            .missing_blocks
            .fetch_add(missing.len() as u64, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let ticket = LoadTicket {
            rx,
            cancel: CancelOnDrop::new(Arc::clone(&cancel)),
            missing: missing.clone(),
        };
        let plan = ChunkPlan::new(
            copies.len(),
            geometry.layers(),
            geometry.bytes_per_block_layer(),
            self.core.chunk_bytes,
        );
        let job = Arc::new(LoadJob {
            core: self.core.job_core(plan, submitted, cancel, inflight),
            pool: Arc::clone(pool),
            host: host.clone(),
            copies,
            layer_bytes: geometry.bytes_per_block_layer(),
            pins: Mutex::new(pins),
            missing,
            progress: Mutex::new(LayerProgress {
                done: vec![false; geometry.layers() as usize],
                next: 0,
            }),
            events: tx,
            counters: Arc::clone(&self.core.counters),
            bytes,
        });
        self.core.launch(job);
        Ok(ticket)
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

#[derive(Debug)]
struct LayerProgress {
    done: Vec<bool>,
    next: u32,
}

#[derive(Debug)]
struct LoadJob {
    core: JobCore,
    pool: Arc<dyn DevicePool>,
    host: HostTier,
    /// (device slot, host page offset) per block.
    copies: Vec<(u32, usize)>,
    layer_bytes: usize,
    pins: Mutex<Vec<PinnedPage>>,
    missing: Vec<BlockKey>,
    progress: Mutex<LayerProgress>,
    events: mpsc::Sender<LoadEvent>,
    counters: Arc<QueueCounters>,
    bytes: u64,
}

impl LoadJob {
    /// Reports layers in order: a layer is announced once it and every earlier layer are done.
    fn layer_finished(&self, layer: u32) {
        let mut p = self.progress.lock().unwrap_or_else(|e| e.into_inner());
        p.done[layer as usize] = true;
        while (p.next as usize) < p.done.len() && p.done[p.next as usize] {
            if !self.core.cancelled.load(Ordering::Acquire) {
                // A requester that went away is not an error.
                let _ = self.events.send(LoadEvent::LayerReady { layer: p.next });
            }
            p.next += 1;
        }
    }

    fn complete(&self) {
        drop(std::mem::take(
            &mut *self.pins.lock().unwrap_or_else(|e| e.into_inner()),
        ));
        self.core.release_inflight();
        let outcome = self.core.outcome();
        let timing = self.core.timing.snapshot();
        self.counters.finish(
            &outcome,
            self.copies.len() as u64,
            self.bytes,
            timing.active.as_nanos() as u64,
        );
        let result = outcome.map(|()| LoadReport {
            loaded_blocks: self.copies.len(),
            missing: self.missing.clone(),
            bytes: self.bytes,
            timing,
        });
        let _ = self.events.send(LoadEvent::Done(result));
    }
}

impl ChunkedJob for LoadJob {
    fn claim(&self) -> Option<usize> {
        self.core.claim()
    }

    fn run(&self, chunk: usize) {
        let region = self.host.region();
        let done = self.core.run_chunk(chunk, |b, layer| {
            let (slot, page_offset) = self.copies[b];
            self.pool.copy_in(
                slot,
                layer,
                region,
                page_offset + layer as usize * self.layer_bytes,
            )
        });
        if let Some(layer) = done.layer_done {
            self.layer_finished(layer);
        }
        if done.job_done {
            self.complete();
        }
    }

    fn chunks(&self) -> usize {
        self.core.plan.total()
    }

    fn finish(&self) {
        self.complete();
    }
}
