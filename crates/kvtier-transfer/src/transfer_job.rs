//! What load and store jobs share: the chunk plan, claiming, per-layer completion, timing,
//! cancellation, admission of in-flight bytes, and the counters behind [`QueueStats`].

use std::collections::HashSet;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::Serialize;

use kvtier_store::HostTier;

use crate::transfer_timing::TimingRecorder;
use crate::worker_pool::{ChunkedJob, JobToken, JobTracker, WorkerPool};
use crate::{DevicePool, TransferError};

/// How a job's block-layer copies are cut into chunks: layer-major (every chunk of layer 0,
/// then layer 1, …) so that layers complete in order, `per_chunk` blocks per chunk so that
/// several threads share one request.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ChunkPlan {
    pub blocks: usize,
    pub layers: u32,
    pub per_chunk: usize,
    pub chunks_per_layer: usize,
}

impl ChunkPlan {
    pub(crate) fn new(blocks: usize, layers: u32, block_layer_bytes: usize, chunk_bytes: usize) -> Self {
        let per_chunk = (chunk_bytes / block_layer_bytes.max(1)).clamp(1, blocks.max(1));
        Self {
            blocks,
            layers,
            per_chunk,
            chunks_per_layer: blocks.div_ceil(per_chunk),
        }
    }
    pub(crate) fn total(&self) -> usize {
        self.chunks_per_layer * self.layers as usize
    }
    /// The layer and block range of chunk `c`.
    pub(crate) fn locate(&self, c: usize) -> (u32, Range<usize>) {
        let layer = (c / self.chunks_per_layer) as u32;
        let start = (c % self.chunks_per_layer) * self.per_chunk;
        (layer, start..(start + self.per_chunk).min(self.blocks))
    }
}

/// Bytes a job holds against its queue's in-flight bound, given back on drop.
#[derive(Debug)]
pub(crate) struct InflightBytes {
    counter: Arc<AtomicU64>,
    bytes: u64,
}

impl InflightBytes {
    /// Admits `bytes` if they fit under `limit`, or if nothing is in flight (so one request
    /// larger than the bound still runs, alone).
    pub(crate) fn admit(
        queue: &'static str,
        counter: &Arc<AtomicU64>,
        bytes: u64,
        limit: u64,
    ) -> Result<Self, TransferError> {
        counter
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |cur| {
                (cur == 0 || cur.saturating_add(bytes) <= limit).then(|| cur + bytes)
            })
            .map_err(|cur| TransferError::QueueFull {
                queue,
                inflight_bytes: cur,
                request_bytes: bytes,
                limit_bytes: limit,
            })?;
        Ok(Self {
            counter: Arc::clone(counter),
            bytes,
        })
    }
}

impl Drop for InflightBytes {
    fn drop(&mut self) {
        self.counter.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// Held by a ticket: sets its job's cancel flag when dropped before the job finished, so a
/// requester that goes away stops the copies and releases what the job holds.
#[derive(Debug)]
pub(crate) struct CancelOnDrop {
    flag: Arc<AtomicBool>,
    armed: bool,
}

impl CancelOnDrop {
    pub(crate) fn new(flag: Arc<AtomicBool>) -> Self {
        Self { flag, armed: true }
    }
    /// The job finished: dropping the ticket no longer cancels anything.
    pub(crate) fn disarm(&mut self) {
        self.armed = false;
    }
    pub(crate) fn armed(&self) -> bool {
        self.armed
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.armed {
            self.flag.store(true, Ordering::Release);
        }
    }
}

/// What finishing a chunk completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ChunkDone {
    /// The chunk was the last of this layer.
    pub layer_done: Option<u32>,
    /// The chunk was the last of the job.
    pub job_done: bool,
}

/// State every job has.
#[derive(Debug)]
pub(crate) struct JobCore {
    pub plan: ChunkPlan,
    next: AtomicUsize,
    remaining_in_layer: Box<[AtomicUsize]>,
    remaining: AtomicUsize,
    pub timing: TimingRecorder,
    pub cancelled: Arc<AtomicBool>,
    skipped: AtomicBool,
    error: Mutex<Option<TransferError>>,
    inflight: Mutex<Option<InflightBytes>>,
    _token: JobToken,
}

impl JobCore {
    pub(crate) fn new(
        plan: ChunkPlan,
        submitted: Instant,
        cancelled: Arc<AtomicBool>,
        inflight: InflightBytes,
        token: JobToken,
    ) -> Self {
        Self {
            next: AtomicUsize::new(0),
            remaining_in_layer: (0..plan.layers)
                .map(|_| AtomicUsize::new(plan.chunks_per_layer))
                .collect(),
            remaining: AtomicUsize::new(plan.total()),
            timing: TimingRecorder::new(submitted),
            cancelled,
            skipped: AtomicBool::new(false),
            error: Mutex::new(None),
            inflight: Mutex::new(Some(inflight)),
            _token: token,
            plan,
        }
    }

    pub(crate) fn claim(&self) -> Option<usize> {
        let c = self.next.fetch_add(1, Ordering::Relaxed);
        (c < self.plan.total()).then_some(c)
    }

    /// Runs `copy(block_index, layer)` for every block of chunk `c` (unless the job was
    /// cancelled or already failed), records the timing, and says what the chunk completed.
    pub(crate) fn run_chunk(
        &self,
        c: usize,
        mut copy: impl FnMut(usize, u32) -> Result<(), TransferError>,
    ) -> ChunkDone {
        let (layer, range) = self.plan.locate(c);
        if self.cancelled.load(Ordering::Acquire) || self.failed() {
            self.skipped.store(true, Ordering::Release);
        } else {
            let start = Instant::now();
            let result = range.into_iter().try_for_each(|b| copy(b, layer));
            self.timing.record(start, Instant::now());
            if let Err(e) = result {
                self.lock_error().get_or_insert(e);
            }
        }
        let layer_done =
            (self.remaining_in_layer[layer as usize].fetch_sub(1, Ordering::AcqRel) == 1).then_some(layer);
        ChunkDone {
            layer_done,
            job_done: self.remaining.fetch_sub(1, Ordering::AcqRel) == 1,
        }
    }

    /// Gives the job's bytes back to the queue's in-flight bound (at completion, before the
    /// requester hears of it).
    pub(crate) fn release_inflight(&self) {
        self.inflight.lock().unwrap_or_else(|e| e.into_inner()).take();
    }

    fn lock_error(&self) -> std::sync::MutexGuard<'_, Option<TransferError>> {
        self.error.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn failed(&self) -> bool {
        self.lock_error().is_some()
    }

    /// Once the job is done: its first copy error, or `ShutDown`-like cancellation, if any.
    pub(crate) fn outcome(&self) -> Result<(), TransferError> {
        if let Some(e) = self.lock_error().take() {
            return Err(e);
        }
        if self.skipped.load(Ordering::Acquire) {
            return Err(TransferError::Cancelled);
        }
        Ok(())
    }
}

/// Checks what every request must satisfy: blocks present, pool and host tier of one geometry,
/// every slot in range and used once.
pub(crate) fn validate_request(
    queue: &'static str,
    pool: &dyn DevicePool,
    host: &HostTier,
    slots: impl ExactSizeIterator<Item = u32>,
) -> Result<(), TransferError> {
    if slots.len() == 0 {
        return Err(TransferError::EmptyRequest { queue });
    }
    if pool.geometry() != host.geometry() {
        return Err(TransferError::GeometryMismatch {
            expected: *host.geometry(),
            actual: *pool.geometry(),
        });
    }
    let mut seen = HashSet::with_capacity(slots.len());
    for slot in slots {
        pool.check_slot(slot)?;
        if !seen.insert(slot) {
            return Err(TransferError::DuplicateSlot { slot });
        }
    }
    Ok(())
}

/// What a load queue and a store queue share: workers, counters, the job tracker, the
/// in-flight bound and the chunk size.
#[derive(Debug)]
pub(crate) struct QueueCore {
    name: &'static str,
    workers: WorkerPool,
    pub counters: Arc<QueueCounters>,
    tracker: Arc<JobTracker>,
    limit_bytes: u64,
    pub chunk_bytes: usize,
}

impl QueueCore {
    pub(crate) fn new(
        name: &'static str,
        threads: usize,
        nice: i32,
        limit_bytes: u64,
        chunk_bytes: usize,
    ) -> Result<Self, TransferError> {
        Ok(Self {
            name,
            workers: WorkerPool::new(name, threads, nice).map_err(TransferError::Spawn)?,
            counters: Arc::default(),
            tracker: Arc::default(),
            limit_bytes,
            chunk_bytes,
        })
    }

    /// Admits `bytes` of a request of `blocks` blocks against the in-flight bound; a refusal
    /// is counted.
    pub(crate) fn admit(&self, bytes: u64, blocks: usize) -> Result<InflightBytes, TransferError> {
        InflightBytes::admit(self.name, &self.counters.inflight_bytes, bytes, self.limit_bytes).inspect_err(
            |_| {
                self.counters.rejected_requests.fetch_add(1, Ordering::Relaxed);
                self.counters
                    .rejected_blocks
                    .fetch_add(blocks as u64, Ordering::Relaxed);
            },
        )
    }

    /// The shared state of a new job, counted by the queue's tracker until it is dropped.
    pub(crate) fn job_core(
        &self,
        plan: ChunkPlan,
        submitted: Instant,
        cancelled: Arc<AtomicBool>,
        inflight: InflightBytes,
    ) -> JobCore {
        self.counters.submitted.fetch_add(1, Ordering::Relaxed);
        JobCore::new(plan, submitted, cancelled, inflight, self.tracker.start())
    }

    /// Hands `job` to the workers, or finishes it at once if it has nothing to copy.
    pub(crate) fn launch(&self, job: Arc<dyn ChunkedJob>) {
        if job.chunks() == 0 {
            job.finish();
        } else {
            self.workers.submit(job);
        }
    }

    pub(crate) fn stats(&self) -> QueueStats {
        self.counters.snapshot(
            self.workers.threads(),
            self.workers.queued(),
            self.tracker.active(),
        )
    }

    pub(crate) fn threads(&self) -> usize {
        self.workers.threads()
    }

    pub(crate) fn wait_idle(&self) {
        self.tracker.wait_idle();
    }
}

/// Counters of one queue, updated by submitters and workers.
#[derive(Debug, Default)]
pub(crate) struct QueueCounters {
    pub submitted: AtomicU64,
    pub completed: AtomicU64,
    pub cancelled: AtomicU64,
    pub failed: AtomicU64,
    pub rejected_requests: AtomicU64,
    pub rejected_blocks: AtomicU64,
    pub blocks: AtomicU64,
    pub bytes: AtomicU64,
    pub active_ns: AtomicU64,
    pub missing_blocks: AtomicU64,
    pub no_space_blocks: AtomicU64,
    pub already_stored_blocks: AtomicU64,
    pub inflight_bytes: Arc<AtomicU64>,
}

/// A snapshot of one queue's counters and gauges.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct QueueStats {
    /// Worker threads serving the queue.
    pub threads: usize,
    /// Requests accepted.
    pub submitted_total: u64,
    /// Requests whose copies all finished.
    pub completed_total: u64,
    /// Requests abandoned by their requester before finishing.
    pub cancelled_total: u64,
    /// Requests that failed on a copy error.
    pub failed_total: u64,
    /// Requests refused at admission because the queue was full.
    pub rejected_requests_total: u64,
    /// Blocks in those refused requests.
    pub rejected_blocks_total: u64,
    /// Blocks copied.
    pub blocks_total: u64,
    /// Bytes copied.
    pub bytes_total: u64,
    /// Sum of copy durations, in nanoseconds.
    pub active_ns_total: u64,
    /// Load blocks asked for that were not resident (reported to the requester).
    pub missing_blocks_total: u64,
    /// Store blocks dropped because the host tier had no evictable page.
    pub no_space_blocks_total: u64,
    /// Store blocks skipped because they were already stored (or being stored).
    pub already_stored_blocks_total: u64,
    /// Bytes admitted and not yet finished.
    pub inflight_bytes: u64,
    /// Requests queued and not yet fully claimed by a worker.
    pub queued_requests: usize,
    /// Requests queued or running.
    pub active_requests: usize,
}

impl QueueStats {
    /// Store blocks that were not stored for lack of room: refused at admission or with no
    /// evictable page. The benchmark's `dropped_stores`.
    pub fn dropped_blocks_total(&self) -> u64 {
        self.rejected_blocks_total + self.no_space_blocks_total
    }
}

impl QueueCounters {
    pub(crate) fn snapshot(&self, threads: usize, queued: usize, active: usize) -> QueueStats {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        QueueStats {
            threads,
            submitted_total: l(&self.submitted),
            completed_total: l(&self.completed),
            cancelled_total: l(&self.cancelled),
            failed_total: l(&self.failed),
            rejected_requests_total: l(&self.rejected_requests),
            rejected_blocks_total: l(&self.rejected_blocks),
            blocks_total: l(&self.blocks),
            bytes_total: l(&self.bytes),
            active_ns_total: l(&self.active_ns),
            missing_blocks_total: l(&self.missing_blocks),
            no_space_blocks_total: l(&self.no_space_blocks),
            already_stored_blocks_total: l(&self.already_stored_blocks),
            inflight_bytes: l(&self.inflight_bytes),
            queued_requests: queued,
            active_requests: active,
        }
    }

    /// Accounts a finished job.
    pub(crate) fn finish(
        &self,
        outcome: &Result<(), TransferError>,
        blocks: u64,
        bytes: u64,
        active_ns: u64,
    ) {
        self.active_ns.fetch_add(active_ns, Ordering::Relaxed);
        match outcome {
            Ok(()) => {
                self.completed.fetch_add(1, Ordering::Relaxed);
                self.blocks.fetch_add(blocks, Ordering::Relaxed);
                self.bytes.fetch_add(bytes, Ordering::Relaxed);
            }
            Err(TransferError::Cancelled) => {
                self.cancelled.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {
                self.failed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_are_layer_major_and_cover_every_block_once() {
        for (blocks, layers, per) in [(1usize, 1u32, 1usize), (140, 1, 8), (17, 3, 4), (5, 2, 100)] {
            let plan = ChunkPlan::new(blocks, layers, 1000, per * 1000);
            let mut seen = vec![vec![0u32; blocks]; layers as usize];
            let mut last_layer = 0;
            for c in 0..plan.total() {
                let (layer, range) = plan.locate(c);
                assert!(layer >= last_layer, "layer-major order");
                last_layer = layer;
                for b in range {
                    seen[layer as usize][b] += 1;
                }
            }
            assert!(seen.iter().flatten().all(|&n| n == 1), "{blocks} {layers} {per}");
        }
    }

    #[test]
    fn admission_bounds_bytes_but_lets_a_lone_big_request_run() {
        let c = Arc::new(AtomicU64::new(0));
        let big = InflightBytes::admit("load", &c, 500, 100).unwrap();
        let e = InflightBytes::admit("load", &c, 1, 100).unwrap_err();
        assert!(matches!(
            e,
            TransferError::QueueFull {
                inflight_bytes: 500,
                request_bytes: 1,
                limit_bytes: 100,
                ..
            }
        ));
        drop(big);
        let a = InflightBytes::admit("load", &c, 60, 100).unwrap();
        assert!(InflightBytes::admit("load", &c, 41, 100).is_err());
        let b = InflightBytes::admit("load", &c, 40, 100).unwrap();
        assert_eq!(c.load(Ordering::Relaxed), 100);
        drop((a, b));
        assert_eq!(c.load(Ordering::Relaxed), 0);
    }
}
