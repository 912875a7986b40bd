//! What the benchmark's figures are compared with, measured in the same run: plain memcpy for
//! host ↔ device copies, sequential direct I/O for the disk tier, plain pipelined GET/SET for
//! the remote tier.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use kvtier_store::{CopyKind, Prefault, ShmRegion};

use crate::BenchError;

const GIB: f64 = (1u64 << 30) as f64;

pub(crate) fn gib_s(bytes: u64, d: Duration) -> f64 {
    if d.is_zero() {
        0.0
    } else {
        bytes as f64 / GIB / d.as_secs_f64()
    }
}

/// A plain copy of a batch's bytes between two prefaulted shared-memory buffers, with as many
/// threads as the queues have, each copying its contiguous share in as few calls as the
/// buffer allows: the bus bandwidth the queues are measured against. `kind` is the C library's
/// `memcpy` (seed 003's baseline) or the streaming copy kvtier's transfers use.
pub(crate) struct CopyBaseline {
    src: ShmRegion,
    dst: ShmRegion,
    threads: usize,
    total_bytes: u64,
    kind: CopyKind,
}

/// Largest baseline buffer; bigger batches copy it several times (same total bytes).
const BASELINE_MAX_BUFFER: u64 = 1 << 30;

impl CopyBaseline {
    pub(crate) fn new(total_bytes: u64, threads: usize, kind: CopyKind) -> Result<Self, BenchError> {
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
            kind,
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
                            ShmRegion::copy_ranges(
                                self.kind,
                                &self.src,
                                &self.dst,
                                [(i * share, i * share, n)],
                            )?;
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

/// I/O of `total_bytes` in requests of one block on a file in the disk tier's directory, at
/// queue depth 1 and at the tier's own depth (its disk read and write threads: that many
/// threads, each doing its contiguous share one block at a time), keeping the better of the
/// two for each direction: what that disk gives to the same number of requests in flight as
/// the tier keeps, so a ratio above 1 would mean the tier beat the device. O_DIRECT when the
/// directory allows it; otherwise buffered, with the file's pages written back and dropped
/// from the page cache before reading.
pub(crate) struct DiskBaseline {
    path: PathBuf,
    buffers: Vec<ShmRegion>,
    block_bytes: usize,
    blocks: usize,
    direct: bool,
    read_depth: usize,
    write_depth: usize,
}

/// One direction's best figure and the depth it came at.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DiskPass {
    pub(crate) gib_s: f64,
    pub(crate) depth: usize,
}

impl DiskBaseline {
    pub(crate) fn new(
        dir: &Path,
        block_bytes: usize,
        total_bytes: u64,
        direct: bool,
        (read_depth, write_depth): (usize, usize),
    ) -> Result<Self, BenchError> {
        let block_bytes = block_bytes.next_multiple_of(4096);
        let (read_depth, write_depth) = (read_depth.max(1), write_depth.max(1));
        let buffers = (0..read_depth.max(write_depth))
            .map(|_| {
                let b =
                    ShmRegion::create_anonymous("kvtier-bench-disk-baseline", block_bytes, Prefault::Touch)?;
                b.fill(0, block_bytes, 0xc3)?;
                Ok(b)
            })
            .collect::<Result<Vec<_>, BenchError>>()?;
        let baseline = Self {
            path: dir.join("disk-baseline.bin"),
            buffers,
            block_bytes,
            blocks: (total_bytes as usize).div_ceil(block_bytes).max(1),
            direct,
            read_depth,
            write_depth,
        };
        // The file the first read passes read.
        let file = baseline.fresh_file()?;
        baseline.pass(&file, true, write_depth)?;
        baseline.drop_cache(&file);
        Ok(baseline)
    }

    fn open(&self, write: bool) -> Result<File, BenchError> {
        let mut o = OpenOptions::new();
        o.read(true).write(write).create(write).truncate(write);
        if self.direct {
            o.custom_flags(libc::O_DIRECT);
        }
        o.open(&self.path).map_err(|e| io_err("open", &self.path, e))
    }

    /// Every block once, by `depth` threads each doing a contiguous share; GiB/s.
    fn pass(&self, file: &File, write: bool, depth: usize) -> Result<f64, BenchError> {
        let share = self.blocks.div_ceil(depth);
        let start = Instant::now();
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..depth)
                .map(|t| {
                    let buffer = &self.buffers[t];
                    s.spawn(move || {
                        for i in t * share..((t + 1) * share).min(self.blocks) {
                            let offset = (i * self.block_bytes) as u64;
                            let r = if write {
                                buffer.write_to_file(file, offset, &[], 0, self.block_bytes)
                            } else {
                                buffer.read_from_file(file, offset, &mut [], 0, self.block_bytes)
                            };
                            r.map_err(|e| io_err(if write { "write" } else { "read" }, &self.path, e))?;
                        }
                        Ok(())
                    })
                })
                .collect();
            handles.into_iter().try_for_each(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(BenchError::InvalidConfig("disk baseline thread panicked".into()))
                })
            })
        })?;
        if write && !self.direct {
            file.sync_data().map_err(|e| io_err("fdatasync", &self.path, e))?;
        }
        Ok(gib_s((self.blocks * self.block_bytes) as u64, start.elapsed()))
    }

    /// A fresh file reserved with fallocate, as the tier reserves a new region: every write
    /// pass starts from unwritten extents, so a later pass does not get the cheaper overwrite.
    fn fresh_file(&self) -> Result<File, BenchError> {
        let file = self.open(true)?;
        let len = (self.blocks * self.block_bytes) as libc::off_t;
        // SAFETY: fallocate on an open descriptor with a valid range.
        if unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EOPNOTSUPP) {
                return Err(io_err("fallocate", &self.path, e));
            }
        }
        Ok(file)
    }

    /// Drops the file's pages from the page cache (buffered I/O only).
    fn drop_cache(&self, file: &File) {
        if !self.direct {
            // SAFETY: fadvise on an open descriptor, whole-file range.
            unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        }
    }

    /// The better of a pass at `depth` and one at depth 1 (in that order: this virtio disk
    /// serves the first burst after a pause fastest), each on the file `file_for_pass` gives.
    fn best_of(
        &self,
        write: bool,
        depth: usize,
        mut file_for_pass: impl FnMut() -> Result<File, BenchError>,
    ) -> Result<DiskPass, BenchError> {
        let mut best = DiskPass { gib_s: 0.0, depth: 1 };
        for d in std::iter::once(depth).chain((depth > 1).then_some(1)) {
            let file = file_for_pass()?;
            let g = self.pass(&file, write, d)?;
            self.drop_cache(&file);
            if g > best.gib_s {
                best = DiskPass { gib_s: g, depth: d };
            }
        }
        Ok(best)
    }

    /// Read passes of the file the previous call (or `new`) wrote, then write passes each on
    /// a fresh file; at the tier's depth and at depth 1, returning the better (write, read) of
    /// each. Reads come first so they do not run while the device is still absorbing the
    /// writes just made, which the tier's reads do not either. Every pass leaves the file out
    /// of the page cache.
    pub(crate) fn run_once(&self) -> Result<(DiskPass, DiskPass), BenchError> {
        let read = self.best_of(false, self.read_depth, || self.open(false))?;
        let write = self.best_of(true, self.write_depth, || self.fresh_file())?;
        Ok((write, read))
    }
}

/// The batch's bytes moved with plain commands of the redis crate's cluster connection — the
/// client library the remote tier uses — pipelined (the connection pipelines the commands in
/// flight per node): GETs of `get_values` values of `value_bytes` each (a batch's hit blocks,
/// as kvtier stores them: header + block) while, at the same time as in the batch, SETs of
/// `set_values` such values (its new blocks). Two depths: every command at once, and the
/// tier's own read and write concurrency; the better of the two. What the cluster gives that
/// library for the batch's traffic, with none of kvtier's work (host pages, verification,
/// device copies).
pub(crate) struct RemoteBaseline {
    runtime: tokio::runtime::Runtime,
    conn: redis::cluster_async::ClusterConnection,
    get_keys: Vec<String>,
    set_keys: Vec<String>,
    value: std::sync::Arc<Vec<u8>>,
    depths: (usize, usize),
}

impl RemoteBaseline {
    /// Connects and writes the values the GETs read (untimed).
    pub(crate) fn new(
        nodes: &[String],
        value_bytes: usize,
        (get_values, set_values): (usize, usize),
        (read_depth, write_depth): (usize, usize),
    ) -> Result<Self, BenchError> {
        let remote = |e: redis::RedisError| BenchError::InvalidConfig(format!("remote baseline: {e}"));
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|e| BenchError::InvalidConfig(format!("remote baseline runtime: {e}")))?;
        let client = redis::cluster::ClusterClient::builder(nodes.iter().map(|n| format!("redis://{n}")))
            .response_timeout(Duration::from_secs(60))
            .build()
            .map_err(remote)?;
        let conn = runtime.block_on(client.get_async_connection()).map_err(remote)?;
        let mut value = vec![0u8; value_bytes];
        crate::workload::fill_random(&mut value, 0x5eed);
        let keys = |what: &str, n: usize| -> Vec<String> {
            (0..n)
                .map(|i| format!("kvtier-bench-baseline-{}:{what}{i}", std::process::id()))
                .collect()
        };
        let b = Self {
            runtime,
            conn,
            get_keys: keys("r", get_values),
            set_keys: keys("w", set_values),
            value: std::sync::Arc::new(value),
            depths: (read_depth.max(1), write_depth.max(1)),
        };
        b.runtime
            .block_on(b.run(b.get_keys.clone(), Vec::new(), (64, 64)))
            .map_err(|e| BenchError::InvalidConfig(format!("remote baseline: {e}")))?;
        Ok(b)
    }

    /// One pass at each depth; the better (set, get) GiB/s.
    pub(crate) fn run_once(&self) -> Result<(f64, f64), BenchError> {
        let all = (self.get_keys.len().max(1), self.set_keys.len().max(1));
        let mut best = (0.0f64, 0.0f64);
        for depths in [all, self.depths] {
            let (set, get) = self
                .runtime
                .block_on(self.run(self.set_keys.clone(), self.get_keys.clone(), depths))
                .map_err(|e| BenchError::InvalidConfig(format!("remote baseline: {e}")))?;
            best = (best.0.max(set), best.1.max(get));
        }
        Ok(best)
    }

    /// SETs of `set_keys` and GETs of `get_keys`, started together with `depths` (read,
    /// write) in flight; (set, get) GiB/s, each over its own span from the common start.
    async fn run(
        &self,
        set_keys: Vec<String>,
        get_keys: Vec<String>,
        depths: (usize, usize),
    ) -> Result<(f64, f64), String> {
        let reads = std::sync::Arc::new(tokio::sync::Semaphore::new(depths.0.max(1)));
        let writes = std::sync::Arc::new(tokio::sync::Semaphore::new(depths.1.max(1)));
        let t0 = Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        for k in &set_keys {
            let (mut c, writes, value) = (self.conn.clone(), writes.clone(), self.value.clone());
            let cmd = redis::cmd("SET").arg(k).arg(&value[..]).clone();
            tasks.spawn(async move {
                let _slot = writes.acquire_owned().await;
                cmd.query_async::<()>(&mut c)
                    .await
                    .map(|_| (false, 0usize, t0.elapsed()))
            });
        }
        for k in &get_keys {
            let (mut c, reads) = (self.conn.clone(), reads.clone());
            let cmd = redis::cmd("GET").arg(k).clone();
            tasks.spawn(async move {
                let _slot = reads.acquire_owned().await;
                cmd.query_async::<Option<Vec<u8>>>(&mut c)
                    .await
                    .map(|v| (true, v.map_or(0, |v| v.len()), t0.elapsed()))
            });
        }
        let (mut got, mut set_end, mut get_end) = (0usize, Duration::ZERO, Duration::ZERO);
        while let Some(r) = tasks.join_next().await {
            let (is_get, n, at) = r.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?;
            if is_get {
                got += n;
                get_end = get_end.max(at);
            } else {
                set_end = set_end.max(at);
            }
        }
        let get_bytes = (get_keys.len() * self.value.len()) as u64;
        if got as u64 != get_bytes {
            return Err(format!(
                "GET returned {got} of {get_bytes} bytes (the cluster evicted some: raise maxmemory)"
            ));
        }
        let set_bytes = (set_keys.len() * self.value.len()) as u64;
        Ok((gib_s(set_bytes, set_end), gib_s(get_bytes, get_end)))
    }
}

impl Drop for RemoteBaseline {
    fn drop(&mut self) {
        let mut keys = std::mem::take(&mut self.get_keys);
        keys.append(&mut self.set_keys);
        let conn = self.conn.clone();
        self.runtime.block_on(async move {
            for k in keys {
                let mut c = conn.clone();
                let _ = redis::cmd("UNLINK").arg(k).query_async::<u64>(&mut c).await;
            }
        });
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
