//! What a load queue and a store queue share: worker threads, admission and counters.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use serde::Serialize;

use crate::TransferError;
use crate::route::Routes;
use crate::transfer_job::{Continuation, InflightBytes};
use crate::transfer_timing::TimingRecorder;
use crate::worker_threads::{ChunkedJob, JobTracker, WorkerHandle, WorkerThreads};

/// Workers, counters, the job tracker, the in-flight bound and the chunk size of one queue.
#[derive(Debug)]
pub(crate) struct QueueCore {
    name: &'static str,
    workers: WorkerThreads,
    /// Threads that only wait on disk I/O (reads for loads, writes for stores): enough of them
    /// keep several requests in flight, which is what disks need to reach their bandwidth.
    io_workers: WorkerThreads,
    pub counters: Arc<QueueCounters>,
    pub routes: Arc<Routes>,
    tracker: Arc<JobTracker>,
    limit_bytes: u64,
    pub chunk_bytes: usize,
}

impl QueueCore {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        name: &'static str,
        threads: usize,
        io_threads: usize,
        nice: i32,
        limit_bytes: u64,
        chunk_bytes: usize,
        routes: Arc<Routes>,
    ) -> Result<Self, TransferError> {
        let io_name = if name == "load" { "disk-read" } else { "disk-write" };
        Ok(Self {
            name,
            workers: WorkerThreads::new(name, threads, nice).map_err(TransferError::Spawn)?,
            io_workers: WorkerThreads::new(io_name, io_threads, nice).map_err(TransferError::Spawn)?,
            counters: Arc::default(),
            routes,
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

    /// The state a new request's first job starts from, counted as submitted and tracked until
    /// its last job is dropped.
    pub(crate) fn start(
        &self,
        submitted: Instant,
        cancelled: Arc<AtomicBool>,
        inflight: InflightBytes,
    ) -> Continuation {
        self.counters.submitted.fetch_add(1, Ordering::Relaxed);
        Continuation {
            timing: Arc::new(TimingRecorder::new(submitted)),
            cancelled,
            inflight: Some(inflight),
            token: Some(self.tracker.start()),
        }
    }

    /// A handle jobs use to queue the job that continues them on the copy workers.
    pub(crate) fn handle(&self) -> WorkerHandle {
        self.workers.handle()
    }

    /// A handle jobs use to queue the job that continues them on the disk I/O workers.
    pub(crate) fn io_handle(&self) -> WorkerHandle {
        self.io_workers.handle()
    }

    /// Hands a copy job to the workers, or finishes it at once if it has nothing to copy.
    pub(crate) fn launch(&self, job: Arc<dyn ChunkedJob>) {
        self.workers.handle().launch(job);
    }

    /// Hands a disk I/O job to the I/O workers.
    pub(crate) fn launch_io(&self, job: Arc<dyn ChunkedJob>) {
        self.io_workers.handle().launch(job);
    }

    pub(crate) fn stats(&self) -> QueueStats {
        self.counters.snapshot(
            self.workers.threads(),
            self.workers.queued() + self.io_workers.queued(),
            self.tracker.active(),
        )
    }

    pub(crate) fn threads(&self) -> usize {
        self.workers.threads()
    }

    pub(crate) fn wait_idle(&self) {
        self.tracker.wait_idle();
    }

    pub(crate) fn wait_idle_until(&self, deadline: Instant) -> bool {
        self.tracker.wait_idle_until(deadline)
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
    pub disk_blocks: AtomicU64,
    pub disk_failed_blocks: AtomicU64,
    pub persist_rejected_blocks: AtomicU64,
    /// Blocks handed to the disk writers and not yet written (or failed).
    pub pending_disk_blocks: AtomicU64,
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
    /// Blocks copied between host and device.
    pub blocks_total: u64,
    /// Bytes copied between host and device.
    pub bytes_total: u64,
    /// Sum of host ↔ device copy durations, in nanoseconds.
    pub active_ns_total: u64,
    /// Load blocks asked for that were in no tier (reported to the requester).
    pub missing_blocks_total: u64,
    /// Store blocks dropped because the host tier had no evictable page (and load blocks that
    /// could not be brought in from disk for that reason).
    pub no_space_blocks_total: u64,
    /// Store blocks skipped because they were already stored (or being stored).
    pub already_stored_blocks_total: u64,
    /// Blocks read from disk into host pages (loads) or written to disk (stores).
    pub disk_blocks_total: u64,
    /// Disk reads that failed verification or I/O (loads), or disk writes that failed
    /// (stores: disk full, I/O error).
    pub disk_failed_blocks_total: u64,
    /// Blocks admitted to disk whose write was dropped because the store queue was full.
    pub persist_rejected_blocks_total: u64,
    /// Blocks waiting for their disk write (stores under the write policy): what a stop
    /// would lose if it could not wait for them.
    pub pending_disk_blocks: u64,
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
            disk_blocks_total: l(&self.disk_blocks),
            disk_failed_blocks_total: l(&self.disk_failed_blocks),
            persist_rejected_blocks_total: l(&self.persist_rejected_blocks),
            pending_disk_blocks: l(&self.pending_disk_blocks),
            inflight_bytes: l(&self.inflight_bytes),
            queued_requests: queued,
            active_requests: active,
        }
    }

    /// Accounts a finished request.
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
            Err(e) => self.count_failure(e),
        }
    }

    /// Accounts a request that ended early: cancelled by its requester, or failed.
    pub(crate) fn count_failure(&self, e: &TransferError) {
        let c = match e {
            TransferError::Cancelled => &self.cancelled,
            _ => &self.failed,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }
}
