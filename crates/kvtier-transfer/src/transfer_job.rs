//! What every transfer job shares: the chunk plan, claiming, per-layer completion, timing,
//! cancellation and admission of in-flight bytes.

use std::collections::HashSet;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kvtier_core::KvGeometry;

use crate::transfer_timing::{TimingRecorder, TransferTiming};
use crate::worker_threads::JobToken;
use crate::{CopyDirection, DevicePool, SlotCopy, TransferError};

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

/// What a job hands to the job that continues it (a disk read to the device copy, a host copy
/// to the disk write): the requester's timing record, cancel flag, in-flight bytes and the
/// queue's count of active jobs.
#[derive(Debug)]
pub(crate) struct Continuation {
    pub timing: Arc<TimingRecorder>,
    pub cancelled: Arc<AtomicBool>,
    pub inflight: Option<InflightBytes>,
    pub token: Option<JobToken>,
}

/// State every job has.
#[derive(Debug)]
pub(crate) struct JobCore {
    pub plan: ChunkPlan,
    next: AtomicUsize,
    remaining_in_layer: Box<[AtomicUsize]>,
    remaining: AtomicUsize,
    pub timing: Arc<TimingRecorder>,
    /// This job's own copies (`timing` may span several jobs of one request).
    own: TimingRecorder,
    pub cancelled: Arc<AtomicBool>,
    skipped: AtomicBool,
    error: Mutex<Option<TransferError>>,
    inflight: Mutex<Option<InflightBytes>>,
    token: Mutex<Option<JobToken>>,
}

impl JobCore {
    pub(crate) fn new(plan: ChunkPlan, parts: Continuation) -> Self {
        Self {
            next: AtomicUsize::new(0),
            remaining_in_layer: (0..plan.layers)
                .map(|_| AtomicUsize::new(plan.chunks_per_layer))
                .collect(),
            remaining: AtomicUsize::new(plan.total()),
            timing: parts.timing,
            own: TimingRecorder::new(Instant::now()),
            cancelled: parts.cancelled,
            skipped: AtomicBool::new(false),
            error: Mutex::new(None),
            inflight: Mutex::new(parts.inflight),
            token: Mutex::new(parts.token),
            plan,
        }
    }

    /// Hands the requester's state on to the job that continues this one.
    pub(crate) fn continuation(&self) -> Continuation {
        Continuation {
            timing: Arc::clone(&self.timing),
            cancelled: Arc::clone(&self.cancelled),
            inflight: lock(&self.inflight).take(),
            token: lock(&self.token).take(),
        }
    }

    pub(crate) fn claim(&self) -> Option<usize> {
        let c = self.next.fetch_add(1, Ordering::Relaxed);
        (c < self.plan.total()).then_some(c)
    }

    /// Runs `copy(block_index, layer)` for every block of chunk `c`; as
    /// [`JobCore::run_chunk_batch`].
    pub(crate) fn run_chunk(
        &self,
        c: usize,
        mut copy: impl FnMut(usize, u32) -> Result<(), TransferError>,
        layer_done: impl FnOnce(u32),
    ) -> bool {
        self.run_chunk_batch(
            c,
            |layer, range| range.into_iter().try_for_each(|b| copy(b, layer)),
            layer_done,
        )
    }

    /// Runs `copy(layer, block_range)` for chunk `c` (unless the job was cancelled or already
    /// failed) and records the timing; if the chunk completed its layer, calls
    /// `layer_done(layer)`. Returns whether it was the job's last chunk.
    ///
    /// `layer_done` runs before the chunk counts as finished, so the thread that finishes the
    /// job knows every layer report has been made: a "layer ready" can never follow "done".
    pub(crate) fn run_chunk_batch(
        &self,
        c: usize,
        copy: impl FnOnce(u32, Range<usize>) -> Result<(), TransferError>,
        layer_done: impl FnOnce(u32),
    ) -> bool {
        let (layer, range) = self.plan.locate(c);
        if self.cancelled.load(Ordering::Acquire) || self.failed() {
            self.skipped.store(true, Ordering::Release);
        } else {
            let start = Instant::now();
            let result = copy(layer, range);
            let end = Instant::now();
            self.timing.record(start, end);
            self.own.record(start, end);
            if let Err(e) = result {
                lock(&self.error).get_or_insert(e);
            }
        }
        if self.remaining_in_layer[layer as usize].fetch_sub(1, Ordering::AcqRel) == 1 {
            layer_done(layer);
        }
        self.remaining.fetch_sub(1, Ordering::AcqRel) == 1
    }

    /// Submits the device copies of `copies[range]` (device slot, host page offset) for
    /// `layer` in one batch and waits for them to land.
    pub(crate) fn copy_batch(
        pool: &dyn DevicePool,
        direction: CopyDirection,
        host: &kvtier_store::ShmRegion,
        layer: u32,
        layer_bytes: usize,
        copies: &[(u32, usize)],
    ) -> Result<(), TransferError> {
        let batch: Vec<SlotCopy> = copies
            .iter()
            .map(|&(slot, page_offset)| SlotCopy {
                slot,
                host_offset: page_offset + layer as usize * layer_bytes,
            })
            .collect();
        pool.submit(direction, layer, host, &batch)?.wait()
    }

    /// Nanoseconds this job's chunks spent copying.
    pub(crate) fn busy_ns(&self) -> u64 {
        self.own.snapshot().active.as_nanos() as u64
    }

    /// This job's own copies, without the other jobs of its request.
    pub(crate) fn own_timing(&self) -> TransferTiming {
        self.own.snapshot()
    }

    /// Gives the job's bytes back to the queue's in-flight bound (at completion, before the
    /// requester hears of it).
    pub(crate) fn release_inflight(&self) {
        lock(&self.inflight).take();
    }

    fn failed(&self) -> bool {
        lock(&self.error).is_some()
    }

    /// Once the job is done: its first copy error, or cancellation, if any. A requester that
    /// went away before the job finished cancelled it, even if every copy had already run:
    /// nobody will use what it copied, so nothing is published and it counts as cancelled.
    pub(crate) fn outcome(&self) -> Result<(), TransferError> {
        if let Some(e) = lock(&self.error).take() {
            return Err(e);
        }
        if self.skipped.load(Ordering::Acquire) || self.cancelled.load(Ordering::Acquire) {
            return Err(TransferError::Cancelled);
        }
        Ok(())
    }
}

/// Locks a mutex, carrying on after a panic elsewhere (the data are plain counters and lists
/// that stay consistent between statements).
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Checks what every request must satisfy: blocks present, pool and host tier of one geometry,
/// every slot in range and used once.
pub(crate) fn validate_request(
    queue: &'static str,
    pool: &dyn DevicePool,
    geometry: &KvGeometry,
    slots: impl ExactSizeIterator<Item = u32>,
) -> Result<(), TransferError> {
    if slots.len() == 0 {
        return Err(TransferError::EmptyRequest { queue });
    }
    if pool.geometry() != geometry {
        return Err(TransferError::GeometryMismatch {
            expected: *geometry,
            actual: *pool.geometry(),
        });
    }
    pool.check_usable()?;
    let mut seen = HashSet::with_capacity(slots.len());
    for slot in slots {
        pool.check_slot(slot)?;
        if !seen.insert(slot) {
            return Err(TransferError::DuplicateSlot { slot });
        }
    }
    Ok(())
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
