//! The store queue: device slots → host pages, admitted only while there is room.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kvtier_core::{BlockKey, NamespaceFingerprint};
use kvtier_store::{HostTier, PageWriter, Reservation, StoreError};

use crate::transfer_job::{
    CancelOnDrop, ChunkPlan, JobCore, QueueCore, QueueCounters, QueueStats, validate_request,
};
use crate::transfer_timing::TransferTiming;
use crate::worker_pool::ChunkedJob;
use crate::{DevicePool, TransferError};

/// One block to store: device `slot` holds block `key`, whose prefix block is `parent`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreBlock {
    /// The block.
    pub key: BlockKey,
    /// The block before it in its sequence (`None` for the first block); lets the host tier
    /// evict suffixes before prefixes.
    pub parent: Option<BlockKey>,
    /// The device slot holding its KV (must not be rewritten until the store completes).
    pub slot: u32,
}

/// What a finished store did.
#[derive(Debug, Clone)]
pub struct StoreReport {
    /// Blocks copied and published in the host tier.
    pub stored_blocks: usize,
    /// Blocks skipped because the host tier already had them (or was storing them).
    pub already_stored: usize,
    /// Blocks dropped because no host page could be freed (counted as dropped stores).
    pub no_space: Vec<BlockKey>,
    /// Bytes copied.
    pub bytes: u64,
    /// When the copies ran.
    pub timing: TransferTiming,
}

/// The requester's handle on a store. When it completes, the device slots may be reused.
/// Dropping it before completion cancels the store: nothing of it is published and its
/// reserved pages are freed.
#[derive(Debug)]
pub struct StoreTicket {
    rx: mpsc::Receiver<Result<StoreReport, TransferError>>,
    cancel: CancelOnDrop,
}

impl StoreTicket {
    /// Blocks until the store finishes.
    ///
    /// # Errors
    /// A copy error, or [`TransferError::ShutDown`] if the queue stopped first.
    pub fn wait(mut self) -> Result<StoreReport, TransferError> {
        let r = self.rx.recv().unwrap_or(Err(TransferError::ShutDown));
        self.cancel.disarm();
        r
    }
}

/// Device → host copies, on their own worker threads (at lower scheduling priority when
/// configured), with a bound on bytes in flight: when it is reached, new stores are refused
/// with a counted reason instead of queueing up behind, so stores never hold loads back.
#[derive(Debug)]
pub struct StoreQueue {
    core: QueueCore,
}

impl StoreQueue {
    pub(crate) fn new(
        threads: usize,
        nice: i32,
        limit_bytes: u64,
        chunk_bytes: usize,
    ) -> Result<Self, TransferError> {
        Ok(Self {
            core: QueueCore::new("store", threads, nice, limit_bytes, chunk_bytes)?,
        })
    }

    /// Reserves a host page for each block not yet stored and queues the copies out of the
    /// device slots. Blocks become visible to matches when the whole store completes.
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
        host: &HostTier,
        ns: NamespaceFingerprint,
        blocks: &[StoreBlock],
    ) -> Result<StoreTicket, TransferError> {
        validate_request("store", pool.as_ref(), host, blocks.iter().map(|b| b.slot))?;
        let submitted = Instant::now();
        let geometry = *host.geometry();
        let asked = (blocks.len() * geometry.bytes_per_block()) as u64;
        let inflight = self.core.admit(asked, blocks.len())?;
        let mut writers = Vec::with_capacity(blocks.len());
        let mut copies = Vec::with_capacity(blocks.len());
        let (mut already_stored, mut no_space) = (0, Vec::new());
        for b in blocks {
            match host.reserve(ns, b.key, b.parent) {
                Ok(Reservation::Writer(w)) => {
                    copies.push((b.slot, w.layer_range(0)?.0));
                    writers.push(w);
                }
                Ok(Reservation::AlreadyStored | Reservation::InFlight) => already_stored += 1,
                Err(StoreError::NoSpace { .. }) => no_space.push(b.key),
                Err(e) => return Err(e.into()),
            }
        }
        let c = &self.core.counters;
        c.no_space_blocks
            .fetch_add(no_space.len() as u64, Ordering::Relaxed);
        c.already_stored_blocks
            .fetch_add(already_stored as u64, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let plan = ChunkPlan::new(
            copies.len(),
            geometry.layers(),
            geometry.bytes_per_block_layer(),
            self.core.chunk_bytes,
        );
        let job = Arc::new(StoreJob {
            core: self.core.job_core(plan, submitted, Arc::clone(&cancel), inflight),
            pool: Arc::clone(pool),
            host: host.clone(),
            layer_bytes: geometry.bytes_per_block_layer(),
            bytes: (copies.len() * geometry.bytes_per_block()) as u64,
            copies,
            writers: Mutex::new(writers),
            already_stored,
            no_space,
            done: tx,
            counters: Arc::clone(&self.core.counters),
        });
        self.core.launch(job);
        Ok(StoreTicket {
            rx,
            cancel: CancelOnDrop::new(cancel),
        })
    }

    /// A snapshot of the queue's counters.
    pub fn stats(&self) -> QueueStats {
        self.core.stats()
    }

    /// Number of worker threads.
    pub fn threads(&self) -> usize {
        self.core.threads()
    }

    /// Blocks until no store is queued or running.
    pub fn wait_idle(&self) {
        self.core.wait_idle();
    }
}

#[derive(Debug)]
struct StoreJob {
    core: JobCore,
    pool: Arc<dyn DevicePool>,
    host: HostTier,
    /// (device slot, host page offset) per block being written.
    copies: Vec<(u32, usize)>,
    layer_bytes: usize,
    bytes: u64,
    writers: Mutex<Vec<PageWriter>>,
    already_stored: usize,
    no_space: Vec<BlockKey>,
    done: mpsc::Sender<Result<StoreReport, TransferError>>,
    counters: Arc<QueueCounters>,
}

impl StoreJob {
    /// Publishes every page if every copy ran, frees them otherwise, then tells the requester.
    fn complete(&self) {
        let outcome = self.core.outcome();
        let writers = std::mem::take(&mut *self.writers.lock().unwrap_or_else(|e| e.into_inner()));
        if outcome.is_ok() {
            // Suffix first: eviction policies see a sequence's later blocks as older than its
            // earlier ones, so they leave in suffix-to-prefix order.
            writers.into_iter().rev().for_each(PageWriter::commit);
        } else {
            drop(writers);
        }
        self.core.release_inflight();
        let timing = self.core.timing.snapshot();
        self.counters.finish(
            &outcome,
            self.copies.len() as u64,
            self.bytes,
            timing.active.as_nanos() as u64,
        );
        let _ = self.done.send(outcome.map(|()| StoreReport {
            stored_blocks: self.copies.len(),
            already_stored: self.already_stored,
            no_space: self.no_space.clone(),
            bytes: self.bytes,
            timing,
        }));
    }
}

impl ChunkedJob for StoreJob {
    fn claim(&self) -> Option<usize> {
        self.core.claim()
    }

    fn run(&self, chunk: usize) {
        let region = self.host.region();
        let done = self.core.run_chunk(chunk, |b, layer| {
            let (slot, page_offset) = self.copies[b];
            self.pool.copy_out(
                slot,
                layer,
                region,
                page_offset + layer as usize * self.layer_bytes,
            )
        });
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
