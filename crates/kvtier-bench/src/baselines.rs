//! What the benchmark's figures are compared with, measured in the same run: plain memcpy for
//! host ↔ device copies, sequential direct I/O for the disk tier.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use kvtier_store::{Prefault, ShmRegion};

use crate::BenchError;

const GIB: f64 = (1u64 << 30) as f64;

pub(crate) fn gib_s(bytes: u64, d: Duration) -> f64 {
    if d.is_zero() {
        0.0
    } else {
        bytes as f64 / GIB / d.as_secs_f64()
    }
}

/// Plain memcpy of a batch's bytes between two prefaulted shared-memory buffers, with as many
/// threads as the queues have, each copying its contiguous share in as few calls as the
/// buffer allows: the bus bandwidth the queues are measured against.
pub(crate) struct MemcpyBaseline {
    src: ShmRegion,
    dst: ShmRegion,
    threads: usize,
    total_bytes: u64,
}

/// Largest baseline buffer; bigger batches copy it several times (same total bytes).
const BASELINE_MAX_BUFFER: u64 = 1 << 30;

impl MemcpyBaseline {
    pub(crate) fn new(total_bytes: u64, threads: usize) -> Result<Self, BenchError> {
        let threads = threads.max(1);
        let len = total_bytes
            .min(BASELINE_MAX_BUFFER)
            .next_multiple_of(4096 * threads as u64) as usize;
        let src = ShmRegion::create_anonymous("kvtier-bench-memcpy-src", len, Prefault::Touch)?;
        let dst = ShmRegion::create_anonymous("kvtier-bench-memcpy-dst", len, Prefault::Touch)?;
        src.fill(0, len, 0x5a)?;
        Ok(Self {
            src,
            dst,
            threads,
            total_bytes,
        })
    }

    /// One pass; returns GiB/s (total bytes over first start → last end).
    pub(crate) fn run_once(&self) -> Result<f64, BenchError> {
        let share = self.src.len() / self.threads;
        let per_thread = self.total_bytes / self.threads as u64;
        let barrier = Barrier::new(self.threads);
        let spans: Vec<Result<(Instant, Instant), BenchError>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..self.threads)
                .map(|i| {
                    let barrier = &barrier;
                    s.spawn(move || {
                        barrier.wait();
                        let start = Instant::now();
                        let mut left = per_thread as usize;
                        while left > 0 {
                            let n = left.min(share);
                            ShmRegion::copy(&self.src, i * share, &self.dst, i * share, n)?;
                            left -= n;
                        }
                        Ok((start, Instant::now()))
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(BenchError::InvalidConfig("memcpy thread panicked".into())))
                })
                .collect()
        });
        let spans: Vec<(Instant, Instant)> = spans.into_iter().collect::<Result<_, _>>()?;
        let start = spans.iter().map(|s| s.0).min().unwrap_or_else(Instant::now);
        let end = spans.iter().map(|s| s.1).max().unwrap_or(start);
        Ok(gib_s(
            per_thread * self.threads as u64,
            end.saturating_duration_since(start),
        ))
    }
}

/// Sequential I/O of `total_bytes` in requests of one block, at queue depth 1, on a file in the
/// disk tier's directory: what one stream of that disk gives. O_DIRECT when the directory
/// allows it; otherwise buffered, with the file's pages written back and dropped from the page
/// cache before reading.
pub(crate) struct DiskBaseline {
    path: PathBuf,
    buffer: ShmRegion,
    block_bytes: usize,
    blocks: usize,
    direct: bool,
}

impl DiskBaseline {
    pub(crate) fn new(
        dir: &Path,
        block_bytes: usize,
        total_bytes: u64,
        direct: bool,
    ) -> Result<Self, BenchError> {
        let block_bytes = block_bytes.next_multiple_of(4096);
        let buffer = ShmRegion::create_anonymous("kvtier-bench-disk-baseline", block_bytes, Prefault::Touch)?;
        buffer.fill(0, block_bytes, 0xc3)?;
        Ok(Self {
            path: dir.join("disk-baseline.bin"),
            buffer,
            block_bytes,
            blocks: (total_bytes as usize).div_ceil(block_bytes).max(1),
            direct,
        })
    }

    fn open(&self, write: bool) -> Result<File, BenchError> {
        let mut o = OpenOptions::new();
        o.read(true).write(write).create(write).truncate(write);
        if self.direct {
            o.custom_flags(libc::O_DIRECT);
        }
        o.open(&self.path).map_err(|e| io_err("open", &self.path, e))
    }

    /// One write pass then one read pass; returns (write GiB/s, read GiB/s).
    pub(crate) fn run_once(&self) -> Result<(f64, f64), BenchError> {
        let file = self.open(true)?;
        let bytes = (self.blocks * self.block_bytes) as u64;
        let start = Instant::now();
        for i in 0..self.blocks {
            self.buffer
                .write_to_file(&file, (i * self.block_bytes) as u64, &[], 0, self.block_bytes)
                .map_err(|e| io_err("write", &self.path, e))?;
        }
        if !self.direct {
            file.sync_data().map_err(|e| io_err("fdatasync", &self.path, e))?;
        }
        let write = gib_s(bytes, start.elapsed());
        if !self.direct {
            // SAFETY: fadvise on an open descriptor, whole-file range.
            unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        }
        drop(file);
        let file = self.open(false)?;
        let start = Instant::now();
        for i in 0..self.blocks {
            self.buffer
                .read_from_file(&file, (i * self.block_bytes) as u64, &mut [], 0, self.block_bytes)
                .map_err(|e| io_err("read", &self.path, e))?;
        }
        let read = gib_s(bytes, start.elapsed());
        Ok((write, read))
    }
}

impl Drop for DiskBaseline {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn io_err(op: &'static str, path: &Path, e: std::io::Error) -> BenchError {
    BenchError::Store(kvtier_store::StoreError::Io {
        op,
        path: path.to_owned(),
        source: e,
    })
}
