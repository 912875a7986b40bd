//! The disk tier: KV blocks in log-structured region files that survive restarts.
//!
//! Blocks are appended to the active region file, one fixed-size entry each (a 4 KiB header
//! that is the entry's commit record, then the block's host page), with O_DIRECT when the file
//! system allows it. The header carries the namespace, key, sequence number, the payload's
//! xxh3-64 and its own xxh3-64, so a torn or damaged entry is detected and dropped, never served.
//! Whole regions are reclaimed oldest first. A region that is full gets an index file so that a
//! restart reads one small file per region instead of every header.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use dashmap::DashMap;
use kvtier_core::{BlockKey, ByteSize, KvGeometry, NamespaceFingerprint};
use serde::{Deserialize, Serialize};

use crate::aligned_buf::{AlignedBuf, IO_ALIGN};
use crate::disk_format::{
    EntryHeader, FormatError, HEADER_BYTES, IndexRecord, RegionHeader, decode_index, encode_index,
};
use crate::key_hasher::KeyHasherBuilder;
use crate::shm_region::ShmRegion;
use crate::{PAGE_ALIGN, StoreError};

mod space;
mod syncer;

/// Whether the disk tier bypasses the page cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DirectIo {
    /// O_DIRECT if the file system accepts it, buffered I/O otherwise (logged at start).
    #[default]
    Auto,
    /// O_DIRECT or refuse to start.
    On,
    /// Buffered I/O through the page cache.
    Off,
}

impl std::str::FromStr for DirectIo {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(DirectIo::Auto),
            "on" => Ok(DirectIo::On),
            "off" => Ok(DirectIo::Off),
            _ => Err(format!("unknown direct-io mode {s:?} (expected auto, on or off)")),
        }
    }
}

/// Configuration of a disk tier (plain data; defaults documented per field).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DiskTierConfig {
    /// Directory of the region files (default `./kvtier-disk`). One directory per geometry.
    pub dir: PathBuf,
    /// Bytes of region files at most (default `16GiB`); the oldest regions are reclaimed
    /// beyond it.
    pub capacity: ByteSize,
    /// Bytes per region file (default `256MiB`), the unit of reclaim.
    pub region_size: ByteSize,
    /// Page-cache bypass (default `auto`).
    pub direct_io: DirectIo,
    /// Create the directory if it is missing (default `false`: a missing directory is an error,
    /// which catches a mistyped path or an unmounted disk).
    pub create_dir: bool,
    /// `fdatasync` the region files written to every this many milliseconds (default `1000`,
    /// like Redis's `appendfsync everysec`): a power cut then loses at most the last interval's
    /// blocks (as misses: torn entries fail their checksum). `0` syncs only when a region is
    /// sealed and at shutdown, leaving the rest to the OS's write-back.
    pub fsync_interval_ms: u64,
}

impl Default for DiskTierConfig {
    fn default() -> Self {
        Self {
            dir: PathBuf::from("kvtier-disk"),
            capacity: ByteSize::gib(16),
            region_size: ByteSize::mib(256),
            direct_io: DirectIo::Auto,
            create_dir: false,
            fsync_interval_ms: 1000,
        }
    }
}

/// What opening a disk tier found.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RecoveryReport {
    /// Region files opened.
    pub regions: usize,
    /// Blocks recovered into the index.
    pub entries: u64,
    /// Regions whose index file was used.
    pub regions_from_index: usize,
    /// Regions whose entries were scanned (no usable index file).
    pub regions_scanned: usize,
    /// Entries dropped because a header or payload failed its checksum.
    pub corrupt: u64,
    /// Entries cut short by the end of a truncated file.
    pub torn: u64,
    /// Entries or regions of another format version, skipped.
    pub skipped_other_version: u64,
    /// Regions whose header was unreadable, skipped.
    pub unreadable_regions: usize,
    /// Wall time of the recovery.
    #[serde(serialize_with = "ser_secs")]
    pub elapsed: Duration,
}

impl RecoveryReport {
    fn merge(&mut self, o: &RecoveryReport) {
        self.regions_from_index += o.regions_from_index;
        self.regions_scanned += o.regions_scanned;
        self.corrupt += o.corrupt;
        self.torn += o.torn;
        self.skipped_other_version += o.skipped_other_version;
        self.unreadable_regions += o.unreadable_regions;
    }
}

fn ser_secs<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

/// A snapshot of a disk tier's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct DiskTierStats {
    /// Blocks in the index.
    pub entries: u64,
    /// Bytes those entries occupy (header + page each).
    pub bytes: u64,
    /// Bytes the region files may take at most.
    pub capacity_bytes: u64,
    /// Region files.
    pub regions: u64,
    /// Whether I/O bypasses the page cache.
    pub direct_io: bool,
    /// Blocks written since open.
    pub writes_total: u64,
    /// Blocks read since open.
    pub reads_total: u64,
    /// Blocks found corrupt (on load or at recovery), dropped.
    pub corrupt_total: u64,
    /// Blocks recovered at open.
    pub recovered_total: u64,
    /// Regions reclaimed to make room.
    pub reclaimed_regions_total: u64,
    /// Index entries dropped with those regions.
    pub reclaimed_entries_total: u64,
    /// Writes dropped because the file system was full.
    pub dropped_writes_no_space_total: u64,
    /// Writes dropped on another I/O error.
    pub dropped_writes_io_error_total: u64,
}

#[derive(Debug, Default)]
struct Counters {
    writes: AtomicU64,
    reads: AtomicU64,
    corrupt: AtomicU64,
    recovered: AtomicU64,
    reclaimed_regions: AtomicU64,
    reclaimed_entries: AtomicU64,
    no_space: AtomicU64,
    io_error: AtomicU64,
}

/// Where a block lives on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Loc {
    region: u64,
    slot: u32,
    seq: u64,
    ns: NamespaceFingerprint,
}

#[derive(Debug)]
struct Region {
    id: u64,
    path: PathBuf,
    file: File,
    slots: u32,
    /// Entries written (or recovered), for the index file and for reclaim.
    records: Mutex<Vec<IndexRecord>>,
    /// Slots whose write finished (or failed); when it reaches `slots` the index is written.
    finished: AtomicU32,
}

impl Region {
    fn records(&self) -> MutexGuard<'_, Vec<IndexRecord>> {
        self.records.lock().unwrap_or_else(|e| e.into_inner())
    }
    fn index_path(&self) -> PathBuf {
        self.path.with_extension("idx")
    }
}

#[derive(Debug)]
struct Active {
    region: Option<Arc<Region>>,
    next_slot: u32,
    next_id: u64,
    /// Whether the file system is being treated as full.
    full: space::FullState,
}

#[derive(Debug)]
struct Inner {
    dir: PathBuf,
    geometry: KvGeometry,
    page_stride: usize,
    entry_stride: u64,
    slots_per_region: u32,
    max_regions: usize,
    direct: bool,
    _lock: File,
    index: DashMap<BlockKey, Loc, KeyHasherBuilder>,
    regions: RwLock<BTreeMap<u64, Arc<Region>>>,
    active: Mutex<Active>,
    seq: AtomicU64,
    cleared: Mutex<HashMap<NamespaceFingerprint, u64>>,
    /// Regions written since the last periodic fsync.
    dirty: Mutex<BTreeSet<u64>>,
    counters: Counters,
}

/// The disk tier. Cheap to clone (an `Arc`). All I/O is blocking: call it from transfer worker
/// threads, never from an async runtime.
#[derive(Debug, Clone)]
pub struct DiskTier {
    inner: Arc<Inner>,
}

/// Result of [`DiskTier::append`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Appended {
    /// The block was written.
    Written,
    /// The block was already on disk; nothing was written.
    AlreadyStored,
}

thread_local! {
    static HEADER_BUF: RefCell<AlignedBuf> = RefCell::new(AlignedBuf::new(HEADER_BYTES));
}

const LOCK_FILE: &str = "LOCK";
/// Regions opened (and scanned) at once during recovery.
const RECOVERY_THREADS: usize = 4;

/// What recovering one region gave: its entries (or `None` if skipped), and its counts.
type RegionRecovery = (
    Result<Option<(Region, Vec<IndexRecord>)>, StoreError>,
    RecoveryReport,
);
const CLEARED_FILE: &str = "CLEARED";

fn region_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("region-{id:016x}.kvt"))
}

fn parse_region_name(name: &str) -> Option<u64> {
    let hex = name.strip_prefix("region-")?.strip_suffix(".kvt")?;
    (hex.len() == 16).then(|| u64::from_str_radix(hex, 16).ok())?
}

fn is_full(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EFBIG | libc::EDQUOT))
}

fn lock_poisoned<T>(r: std::sync::LockResult<T>) -> T {
    r.unwrap_or_else(|e| e.into_inner())
}

impl DiskTier {
    /// Opens (recovering) or creates the tier in `config.dir` for blocks of `geometry`.
    ///
    /// Cost: reads one index file per sealed region and scans the headers and payloads of
    /// regions without one (those being written when the last process stopped).
    ///
    /// # Errors
    /// [`StoreError::DiskDir`] for a missing, non-directory or unwritable directory,
    /// [`StoreError::DirLocked`] if another process holds it,
    /// [`StoreError::DiskGeometryMismatch`] if it holds blocks of another geometry,
    /// [`StoreError::CapacityTooSmall`] if not even one region fits.
    pub fn open(geometry: KvGeometry, config: &DiskTierConfig) -> Result<(Self, RecoveryReport), StoreError> {
        let started = Instant::now();
        let dir = config.dir.clone();
        prepare_dir(&dir, config.create_dir)?;
        let lock = lock_dir(&dir)?;
        let direct = probe_direct_io(&dir, config.direct_io)?;
        let page_stride = geometry.bytes_per_block().next_multiple_of(PAGE_ALIGN);
        let entry_stride = (HEADER_BYTES + page_stride) as u64;
        let slots_per_region = ((config.region_size.bytes().saturating_sub(HEADER_BYTES as u64))
            / entry_stride)
            .clamp(1, u32::MAX as u64) as u32;
        let region_bytes = HEADER_BYTES as u64 + u64::from(slots_per_region) * entry_stride;
        let max_regions = (config.capacity.bytes() / region_bytes) as usize;
        if max_regions == 0 {
            return Err(StoreError::CapacityTooSmall {
                capacity_bytes: config.capacity.bytes(),
                page_bytes: region_bytes,
            });
        }
        let inner = Inner {
            dir: dir.clone(),
            geometry,
            page_stride,
            entry_stride,
            slots_per_region,
            max_regions,
            direct,
            _lock: lock,
            index: DashMap::with_hasher(KeyHasherBuilder::default()),
            regions: RwLock::new(BTreeMap::new()),
            active: Mutex::new(Active {
                region: None,
                next_slot: 0,
                next_id: 1,
                full: space::FullState::default(),
            }),
            seq: AtomicU64::new(0),
            cleared: Mutex::new(read_cleared(&dir)),
            dirty: Mutex::new(BTreeSet::new()),
            counters: Counters::default(),
        };
        let mut report = inner.recover()?;
        report.elapsed = started.elapsed();
        inner.counters.recovered.store(report.entries, Ordering::Relaxed);
        inner.check_space(config.capacity.bytes(), region_bytes);
        tracing::info!(
            dir = %dir.display(),
            direct_io = direct,
            regions = report.regions,
            entries = report.entries,
            corrupt = report.corrupt,
            torn = report.torn,
            elapsed_ms = report.elapsed.as_millis() as u64,
            "disk tier ready"
        );
        let inner = Arc::new(inner);
        if config.fsync_interval_ms > 0 {
            syncer::spawn(
                Arc::downgrade(&inner),
                Duration::from_millis(config.fsync_interval_ms),
            )
            .map_err(|e| StoreError::io("spawn fsync thread", &dir, e))?;
        }
        Ok((Self { inner }, report))
    }

    /// The geometry of every block in this tier.
    pub fn geometry(&self) -> &KvGeometry {
        &self.inner.geometry
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    /// Whether I/O bypasses the page cache (O_DIRECT).
    pub fn direct_io(&self) -> bool {
        self.inner.direct
    }

    /// Whether block `key` of `ns` is on disk (as far as the index knows; a load verifies).
    pub fn contains(&self, ns: NamespaceFingerprint, key: BlockKey) -> bool {
        self.inner.index.get(&key).is_some_and(|l| l.ns == ns)
    }

    /// Writes the block whose host page starts at `src_offset` of `src` (a page of the host
    /// arena: 4 KiB aligned, one block long) as the next entry of the active region.
    ///
    /// Cost: one xxh3 pass over the block and one `pwritev` of header + page; a region file is
    /// created (and the oldest reclaimed) every `region_size` bytes.
    ///
    /// # Errors
    /// [`StoreError::DiskFull`] (counted as a dropped write, reason no_space), other I/O
    /// errors as [`StoreError::Io`] (reason io_error). Nothing partial is ever indexed.
    pub fn append(
        &self,
        ns: NamespaceFingerprint,
        key: BlockKey,
        src: &ShmRegion,
        src_offset: usize,
    ) -> Result<Appended, StoreError> {
        let inner = &self.inner;
        if self.contains(ns, key) {
            return Ok(Appended::AlreadyStored);
        }
        let payload_len = inner.geometry.bytes_per_block();
        let payload_xxh3 = src.xxh3_64(src_offset, payload_len)?;
        let (region, slot) = inner.reserve_slot().inspect_err(|e| inner.count_write_error(e))?;
        let seq = inner.seq.fetch_add(1, Ordering::Relaxed) + 1;
        let header = EntryHeader {
            ns,
            key,
            payload_len: payload_len as u64,
            seq,
            payload_xxh3,
        };
        let offset = HEADER_BYTES as u64 + u64::from(slot) * inner.entry_stride;
        let written = HEADER_BUF.with(|buf| {
            let mut buf = buf.borrow_mut();
            header.encode(&mut buf);
            src.write_to_file(&region.file, offset, &buf, src_offset, inner.page_stride)
        });
        let record = match written {
            Ok(()) => Some(IndexRecord {
                slot,
                ns,
                key,
                seq,
                payload_xxh3,
            }),
            Err(e) => {
                inner.finish_slot(&region, None);
                let err = if is_full(&e) {
                    // A file system without preallocation filled under a sparse region.
                    let mut a = lock_poisoned(inner.active.lock());
                    inner.note_full(&mut a.full, &region.path);
                    StoreError::DiskFull {
                        path: region.path.clone(),
                        source: e,
                    }
                } else {
                    StoreError::io("write", &region.path, e)
                };
                inner.count_write_error(&err);
                return Err(err);
            }
        };
        inner.finish_slot(&region, record);
        lock_poisoned(inner.dirty.lock()).insert(region.id);
        // Publish only if the region was not reclaimed meanwhile.
        if lock_poisoned(inner.regions.read()).contains_key(&region.id) {
            let loc = Loc {
                region: region.id,
                slot,
                seq,
                ns,
            };
            inner
                .index
                .entry(key)
                .and_modify(|l| {
                    if l.seq < seq {
                        *l = loc;
                    }
                })
                .or_insert(loc);
        }
        inner.counters.writes.fetch_add(1, Ordering::Relaxed);
        Ok(Appended::Written)
    }

    /// Reads block `key` of `ns` into the host page at `dst_offset` of `dst` and verifies it
    /// (header checksum, key, namespace, sequence, payload checksum).
    ///
    /// Cost: one `preadv` of header + page and one xxh3 pass over the block.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] if it is not on disk; [`StoreError::CorruptBlock`] if it fails
    /// verification (it is then dropped from the index and counted); [`StoreError::Io`].
    /// On error the page's bytes are unspecified and must not be published.
    pub fn read_into(
        &self,
        ns: NamespaceFingerprint,
        key: BlockKey,
        dst: &ShmRegion,
        dst_offset: usize,
    ) -> Result<(), StoreError> {
        let inner = &self.inner;
        let not_found = StoreError::NotFound { key, tier: "disk" };
        let loc = inner
            .index
            .get(&key)
            .map(|l| *l)
            .filter(|l| l.ns == ns)
            .ok_or(not_found)?;
        let Some(region) = lock_poisoned(inner.regions.read()).get(&loc.region).cloned() else {
            inner.index.remove_if(&key, |_, l| *l == loc);
            return Err(StoreError::NotFound { key, tier: "disk" });
        };
        let offset = HEADER_BYTES as u64 + u64::from(loc.slot) * inner.entry_stride;
        let header = HEADER_BUF.with(|buf| {
            let mut buf = buf.borrow_mut();
            dst.read_from_file(&region.file, offset, &mut buf, dst_offset, inner.page_stride)
                .map(|()| EntryHeader::decode(&buf))
        });
        let header = match header {
            Ok(h) => h,
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                return Err(inner.corrupt(
                    key,
                    loc,
                    &region.path,
                    "entry cut short by the end of the file".into(),
                ));
            }
            Err(e) => return Err(StoreError::io("read", &region.path, e)),
        };
        let h = header.map_err(|e| inner.corrupt(key, loc, &region.path, format!("header: {e}")))?;
        if h.key != key
            || h.ns != ns
            || h.seq != loc.seq
            || h.payload_len != inner.geometry.bytes_per_block() as u64
        {
            return Err(inner.corrupt(key, loc, &region.path, "header names another block".into()));
        }
        if dst.xxh3_64(dst_offset, h.payload_len as usize)? != h.payload_xxh3 {
            return Err(inner.corrupt(key, loc, &region.path, "payload checksum mismatch".into()));
        }
        inner.counters.reads.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Forgets every block of namespace `ns` (or of every namespace for `None`), durably: a
    /// restart does not bring them back. Returns the number of blocks forgotten.
    ///
    /// # Errors
    /// [`StoreError::Io`] if the clear record cannot be written.
    pub fn clear(&self, ns: Option<NamespaceFingerprint>) -> Result<u64, StoreError> {
        let inner = &self.inner;
        let Some(ns) = ns else {
            let regions: Vec<u64> = lock_poisoned(inner.regions.read()).keys().copied().collect();
            let before = inner.index.len() as u64;
            let mut active = lock_poisoned(inner.active.lock());
            active.region = None;
            for id in regions {
                inner.reclaim(id);
            }
            inner.index.clear();
            return Ok(before);
        };
        let upto = inner.seq.load(Ordering::Relaxed);
        {
            let mut cleared = lock_poisoned(inner.cleared.lock());
            cleared.insert(ns, upto);
            write_cleared(&inner.dir, &cleared)?;
        }
        let before = inner.index.len();
        inner.index.retain(|_, l| !(l.ns == ns && l.seq <= upto));
        Ok((before - inner.index.len()) as u64)
    }

    /// Writes the index of the region being filled and flushes every region file, so that a
    /// restart is fast and (with buffered I/O) nothing written is lost with the machine.
    ///
    /// # Errors
    /// [`StoreError::Io`].
    pub fn flush(&self) -> Result<(), StoreError> {
        let inner = &self.inner;
        let active = lock_poisoned(inner.active.lock()).region.clone();
        if let Some(r) = active {
            inner.write_index(&r)?;
        }
        for r in lock_poisoned(inner.regions.read()).values() {
            r.file
                .sync_data()
                .map_err(|e| StoreError::io("fdatasync", &r.path, e))?;
        }
        Ok(())
    }

    /// With buffered I/O: writes back and evicts every region file's pages from the page cache,
    /// so the next reads come from the disk (benchmarks). A no-op with O_DIRECT.
    ///
    /// # Errors
    /// [`StoreError::Io`].
    pub fn drop_page_cache(&self) -> Result<(), StoreError> {
        if self.inner.direct {
            return Ok(());
        }
        for r in lock_poisoned(self.inner.regions.read()).values() {
            r.file
                .sync_data()
                .map_err(|e| StoreError::io("fdatasync", &r.path, e))?;
            // SAFETY: fadvise on an open descriptor with a whole-file range has no memory effects.
            let rc = unsafe { libc::posix_fadvise(r.file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
            if rc != 0 {
                return Err(StoreError::io(
                    "posix_fadvise",
                    &r.path,
                    io::Error::from_raw_os_error(rc),
                ));
            }
        }
        Ok(())
    }

    /// A snapshot of the tier's counters.
    pub fn stats(&self) -> DiskTierStats {
        let inner = &self.inner;
        let c = &inner.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let entries = inner.index.len() as u64;
        let region_bytes = HEADER_BYTES as u64 + u64::from(inner.slots_per_region) * inner.entry_stride;
        DiskTierStats {
            entries,
            bytes: entries * inner.entry_stride,
            capacity_bytes: inner.max_regions as u64 * region_bytes,
            regions: lock_poisoned(inner.regions.read()).len() as u64,
            direct_io: inner.direct,
            writes_total: l(&c.writes),
            reads_total: l(&c.reads),
            corrupt_total: l(&c.corrupt),
            recovered_total: l(&c.recovered),
            reclaimed_regions_total: l(&c.reclaimed_regions),
            reclaimed_entries_total: l(&c.reclaimed_entries),
            dropped_writes_no_space_total: l(&c.no_space),
            dropped_writes_io_error_total: l(&c.io_error),
        }
    }
}

impl Inner {
    /// Warns when `dir`'s file system cannot hold `capacity_bytes` next to the regions the
    /// tier already has: the tier then holds what fits (see [`space`]); it does not refuse to
    /// start, since the space may be freed later.
    fn check_space(&self, capacity_bytes: u64, region_bytes: u64) {
        let held_bytes = lock_poisoned(self.regions.read()).len() as u64 * region_bytes;
        match space::available_bytes(&self.dir) {
            Ok(available_bytes) if held_bytes + available_bytes < capacity_bytes => tracing::warn!(
                dir = %self.dir.display(),
                capacity_bytes,
                held_bytes,
                available_bytes,
                "disk.capacity is more than the file system can hold: the tier keeps what fits and gives back its oldest regions when the file system is full"
            ),
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(dir = %self.dir.display(), error = %e, "cannot read the disk tier's free space")
            }
        }
    }

    /// Starts (or extends) a full spell: writes are refused for a while, logged once per spell.
    fn note_full(&self, full: &mut space::FullState, path: &Path) {
        if full.found_full(Instant::now()) {
            tracing::warn!(
                path = %path.display(),
                available_bytes = space::available_bytes(&self.dir).unwrap_or(0),
                retry_ms = space::FULL_RETRY.as_millis() as u64,
                "disk tier file system full: writes are dropped (counted as no_space) and retried"
            );
        }
    }

    fn count_write_error(&self, e: &StoreError) {
        let c = match e {
            StoreError::DiskFull { .. } => &self.counters.no_space,
            _ => &self.counters.io_error,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    fn corrupt(&self, key: BlockKey, loc: Loc, path: &Path, reason: String) -> StoreError {
        self.index.remove_if(&key, |_, l| *l == loc);
        self.counters.corrupt.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(%key, path = %path.display(), slot = loc.slot, %reason, "corrupt disk block dropped");
        StoreError::CorruptBlock {
            key,
            path: path.to_owned(),
            reason,
        }
    }

    fn open_options(&self) -> OpenOptions {
        let mut o = OpenOptions::new();
        o.read(true).write(true);
        if self.direct {
            o.custom_flags(libc::O_DIRECT);
        }
        o
    }

    /// The next free slot of the active region, starting a new region (and reclaiming the
    /// oldest) when it is full.
    fn reserve_slot(&self) -> Result<(Arc<Region>, u32), StoreError> {
        let mut a = lock_poisoned(self.active.lock());
        if let Some(r) = a.region.clone()
            && a.next_slot < r.slots
        {
            let slot = a.next_slot;
            a.next_slot += 1;
            return Ok((r, slot));
        }
        let now = Instant::now();
        if !a.full.may_try(now) {
            return Err(StoreError::DiskFull {
                path: self.dir.clone(),
                source: io::Error::from_raw_os_error(libc::ENOSPC),
            });
        }
        let id = a.next_id;
        loop {
            let oldest = {
                let regions = lock_poisoned(self.regions.read());
                if regions.len() < self.max_regions {
                    break;
                }
                regions.keys().next().copied()
            };
            match oldest {
                Some(old) => self.reclaim(old),
                None => break,
            }
        }
        let created = match self.create_region(id) {
            // The file system holds less than the capacity: one region out, one in, so the tier
            // keeps to what fits.
            Err(StoreError::DiskFull { .. }) if self.reclaim_oldest() => self.create_region(id),
            r => r,
        };
        let region = match created {
            Ok(r) => {
                if let Some(spell) = a.full.found_room(now) {
                    tracing::info!(
                        dir = %self.dir.display(),
                        full_ms = spell.as_millis() as u64,
                        "disk tier writes resumed"
                    );
                }
                Arc::new(r)
            }
            Err(e) => {
                if let StoreError::DiskFull { path, .. } = &e {
                    self.note_full(&mut a.full, path);
                }
                return Err(e);
            }
        };
        lock_poisoned(self.regions.write()).insert(id, Arc::clone(&region));
        a.next_id = id + 1;
        a.region = Some(Arc::clone(&region));
        a.next_slot = 1;
        Ok((region, 0))
    }

    fn create_region(&self, id: u64) -> Result<Region, StoreError> {
        let path = region_path(&self.dir, id);
        let full_or = |e: io::Error, op| {
            if is_full(&e) {
                StoreError::DiskFull {
                    path: path.clone(),
                    source: e,
                }
            } else {
                StoreError::io(op, &path, e)
            }
        };
        let file = self
            .open_options()
            .create_new(true)
            .open(&path)
            .map_err(|e| full_or(e, "create"))?;
        let len = HEADER_BYTES as u64 + u64::from(self.slots_per_region) * self.entry_stride;
        let fail = |e: io::Error, op| {
            let _ = std::fs::remove_file(&path);
            full_or(e, op)
        };
        // Reserve the whole region now: a full disk fails here, not in the middle of a block.
        // SAFETY: fallocate on an open descriptor with a valid range.
        let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len as libc::off_t) };
        if rc != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
                file.set_len(len).map_err(|e| fail(e, "ftruncate"))?;
            } else {
                return Err(fail(e, "fallocate"));
            }
        }
        let mut header = AlignedBuf::new(HEADER_BYTES);
        RegionHeader {
            geometry: self.geometry,
            slots: self.slots_per_region,
            entry_stride: self.entry_stride,
            region_id: id,
        }
        .encode(&mut header);
        file.write_all_at(&header, 0).map_err(|e| fail(e, "write"))?;
        tracing::debug!(region = id, path = %path.display(), "disk region created");
        Ok(Region {
            id,
            path,
            file,
            slots: self.slots_per_region,
            records: Mutex::new(Vec::new()),
            finished: AtomicU32::new(0),
        })
    }

    /// Records a finished slot; the one that completes a full region writes its index.
    fn finish_slot(&self, region: &Region, record: Option<IndexRecord>) {
        if let Some(r) = record {
            region.records().push(r);
        }
        if region.finished.fetch_add(1, Ordering::AcqRel) + 1 == region.slots
            && let Err(e) = self.write_index(region)
        {
            tracing::warn!(region = region.id, error = %e, "could not write region index; a restart will scan it");
        }
    }

    fn write_index(&self, region: &Region) -> Result<(), StoreError> {
        let records = region.records().clone();
        self.write_index_records(region, &records)
    }

    fn write_index_records(&self, region: &Region, records: &[IndexRecord]) -> Result<(), StoreError> {
        let path = region.index_path();
        let tmp = path.with_extension("idx.tmp");
        let bytes = encode_index(region.id, records);
        let write = || -> io::Result<()> {
            let mut f = File::create(&tmp)?;
            f.write_all(&bytes)?;
            f.sync_data()?;
            std::fs::rename(&tmp, &path)
        };
        write().map_err(|e| StoreError::io("write index", &path, e))
    }

    /// Reclaims the oldest region; whether there was one.
    fn reclaim_oldest(&self) -> bool {
        let oldest = lock_poisoned(self.regions.read()).keys().next().copied();
        oldest.inspect(|&id| self.reclaim(id)).is_some()
    }

    /// Drops region `id`: its entries leave the index, its files are deleted (readers that
    /// still hold it finish from the open descriptor).
    fn reclaim(&self, id: u64) {
        let Some(region) = lock_poisoned(self.regions.write()).remove(&id) else {
            return;
        };
        let mut dropped = 0;
        for r in region.records().iter() {
            if self.index.remove_if(&r.key, |_, l| l.region == id).is_some() {
                dropped += 1;
            }
        }
        let _ = std::fs::remove_file(&region.path);
        let _ = std::fs::remove_file(region.index_path());
        self.counters.reclaimed_regions.fetch_add(1, Ordering::Relaxed);
        self.counters
            .reclaimed_entries
            .fetch_add(dropped, Ordering::Relaxed);
        tracing::debug!(region = id, entries = dropped, "disk region reclaimed");
    }

    /// Rebuilds the index from the region files.
    fn recover(&self) -> Result<RecoveryReport, StoreError> {
        let mut report = RecoveryReport::default();
        let mut ids: Vec<u64> = std::fs::read_dir(&self.dir)
            .map_err(|e| StoreError::io("read_dir", &self.dir, e))?
            .filter_map(|e| e.ok()?.file_name().to_str().and_then(parse_region_name))
            .collect();
        ids.sort_unstable();
        let cleared = lock_poisoned(self.cleared.lock()).clone();
        // Regions are independent: open (and, without an index, scan) several at once, which
        // also keeps several reads in flight for the disk.
        let next = std::sync::atomic::AtomicUsize::new(0);
        let threads = ids.len().clamp(1, RECOVERY_THREADS);
        let mut found: Vec<(u64, RegionRecovery)> = std::thread::scope(|s| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    s.spawn(|| {
                        let mut out = Vec::new();
                        loop {
                            let i = next.fetch_add(1, Ordering::Relaxed);
                            let Some(&id) = ids.get(i) else { return out };
                            let mut local = RecoveryReport::default();
                            let r = self.recover_region(id, &mut local);
                            out.push((id, (r, local)));
                        }
                    })
                })
                .collect();
            workers
                .into_iter()
                .flat_map(|w| w.join().unwrap_or_default())
                .collect()
        });
        found.sort_by_key(|(id, _)| *id);
        let mut max_seq = 0;
        for (id, (result, local)) in found {
            report.merge(&local);
            self.counters.corrupt.fetch_add(local.corrupt, Ordering::Relaxed);
            let Some((region, records)) = result? else {
                continue;
            };
            report.regions += 1;
            for rec in records {
                if cleared.get(&rec.ns).is_some_and(|&upto| rec.seq <= upto) {
                    continue;
                }
                max_seq = max_seq.max(rec.seq);
                let loc = Loc {
                    region: id,
                    slot: rec.slot,
                    seq: rec.seq,
                    ns: rec.ns,
                };
                self.index
                    .entry(rec.key)
                    .and_modify(|l| {
                        if l.seq < loc.seq {
                            *l = loc;
                        }
                    })
                    .or_insert(loc);
                region.records().push(rec);
            }
            lock_poisoned(self.regions.write()).insert(id, Arc::new(region));
        }
        report.entries = self.index.len() as u64;
        self.seq.store(
            max_seq.max(cleared.values().copied().max().unwrap_or(0)),
            Ordering::Relaxed,
        );
        lock_poisoned(self.active.lock()).next_id = ids.last().map_or(1, |l| l + 1);
        // A smaller capacity than last time: drop the oldest regions.
        loop {
            let oldest = {
                let regions = lock_poisoned(self.regions.read());
                if regions.len() <= self.max_regions {
                    break;
                }
                regions.keys().next().copied()
            };
            match oldest {
                Some(old) => self.reclaim(old),
                None => break,
            }
        }
        Ok(report)
    }

    /// Opens one region file and lists its valid entries (from its index file, or by scanning).
    /// `None` for a region that is skipped (unreadable header or other format version).
    fn recover_region(
        &self,
        id: u64,
        report: &mut RecoveryReport,
    ) -> Result<Option<(Region, Vec<IndexRecord>)>, StoreError> {
        let path = region_path(&self.dir, id);
        let file = self
            .open_options()
            .open(&path)
            .map_err(|e| StoreError::io("open", &path, e))?;
        let len = file
            .metadata()
            .map_err(|e| StoreError::io("stat", &path, e))?
            .len();
        let mut header = AlignedBuf::new(HEADER_BYTES);
        let decoded = if len < HEADER_BYTES as u64 {
            Err(FormatError::Invalid(format!(
                "{len} bytes, shorter than its header"
            )))
        } else {
            file.read_exact_at(&mut header, 0)
                .map_err(|e| StoreError::io("read", &path, e))?;
            RegionHeader::decode(&header)
        };
        let rh = match decoded {
            Ok(h) => h,
            Err(FormatError::Version(v)) => {
                tracing::warn!(path = %path.display(), version = v, "skipping disk region of another format version");
                report.skipped_other_version += 1;
                return Ok(None);
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "skipping unreadable disk region");
                report.unreadable_regions += 1;
                return Ok(None);
            }
        };
        if rh.geometry != self.geometry {
            return Err(StoreError::DiskGeometryMismatch {
                path,
                expected: self.geometry,
                found: rh.geometry,
            });
        }
        if rh.entry_stride != self.entry_stride || rh.region_id != id {
            tracing::warn!(path = %path.display(), "skipping disk region with an inconsistent header");
            report.unreadable_regions += 1;
            return Ok(None);
        }
        let full_len = HEADER_BYTES as u64 + u64::from(rh.slots) * rh.entry_stride;
        let region = Region {
            id,
            path: path.clone(),
            file,
            slots: rh.slots,
            records: Mutex::new(Vec::new()),
            finished: AtomicU32::new(rh.slots),
        };
        if len >= full_len
            && let Ok(bytes) = std::fs::read(region.index_path())
        {
            match decode_index(&bytes, id) {
                Ok(records) if records.iter().all(|r| r.slot < rh.slots) => {
                    report.regions_from_index += 1;
                    return Ok(Some((region, records)));
                }
                Ok(_) => {
                    tracing::warn!(path = %path.display(), "region index names slots past the region; scanning")
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "unusable region index; scanning")
                }
            }
        }
        if len < full_len {
            tracing::warn!(path = %path.display(), bytes = len, expected_bytes = full_len, "disk region truncated; recovering the entries before the cut");
        }
        let records = self.scan_region(&region, rh.slots, len, report)?;
        report.regions_scanned += 1;
        if len >= full_len {
            // Next time, read the index instead of scanning.
            let _ = self.write_index_records(&region, &records);
        }
        Ok(Some((region, records)))
    }

    /// Reads every entry header of a region and verifies each payload.
    fn scan_region(
        &self,
        region: &Region,
        slots: u32,
        len: u64,
        report: &mut RecoveryReport,
    ) -> Result<Vec<IndexRecord>, StoreError> {
        // One read per entry: header and payload together.
        let mut entry = AlignedBuf::new(self.entry_stride as usize);
        let mut records = Vec::new();
        let mut other_version = false;
        for slot in 0..slots {
            let off = HEADER_BYTES as u64 + u64::from(slot) * self.entry_stride;
            if off + self.entry_stride > len {
                if off < len {
                    report.torn += 1;
                }
                break;
            }
            region
                .file
                .read_exact_at(&mut entry, off)
                .map_err(|e| StoreError::io("read", &region.path, e))?;
            let h = match EntryHeader::decode(&entry[..HEADER_BYTES]) {
                Ok(h) => h,
                Err(FormatError::Empty) => continue,
                Err(FormatError::Version(_)) => {
                    other_version = true;
                    report.skipped_other_version += 1;
                    continue;
                }
                Err(_) => {
                    report.corrupt += 1;
                    continue;
                }
            };
            let payload = &entry[HEADER_BYTES..];
            if h.payload_len != self.geometry.bytes_per_block() as u64
                || kvtier_core::xxh3_64(&payload[..h.payload_len as usize]) != h.payload_xxh3
            {
                report.corrupt += 1;
                continue;
            }
            records.push(IndexRecord {
                slot,
                ns: h.ns,
                key: h.key,
                seq: h.seq,
                payload_xxh3: h.payload_xxh3,
            });
        }
        if other_version {
            tracing::warn!(path = %region.path.display(), "skipped disk entries of another format version");
        }
        Ok(records)
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Best effort: make the next start read an index instead of scanning.
        let active = lock_poisoned(self.active.lock()).region.clone();
        if let Some(r) = active
            && !r.records().is_empty()
            && let Err(e) = self.write_index(&r)
        {
            tracing::warn!(error = %e, "could not write the active region's index at shutdown");
        }
    }
}

fn prepare_dir(dir: &Path, create: bool) -> Result<(), StoreError> {
    let err = |reason: String| StoreError::DiskDir {
        path: dir.to_owned(),
        reason,
    };
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(err("not a directory".into())),
        Err(e) if e.kind() == io::ErrorKind::NotFound && create => {
            std::fs::create_dir_all(dir).map_err(|e| err(format!("cannot create it: {e}")))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            Err(err("does not exist (create it, or set create_dir)".into()))
        }
        Err(e) => Err(err(e.to_string())),
    }
}

/// Takes an exclusive `flock` on `dir/LOCK` (released when the process exits, even by SIGKILL)
/// and writes our pid into it.
fn lock_dir(dir: &Path) -> Result<File, StoreError> {
    let path = dir.join(LOCK_FILE);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| StoreError::DiskDir {
            path: dir.to_owned(),
            reason: format!("cannot open {}: {e}", path.display()),
        })?;
    // SAFETY: flock on a descriptor we own.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let holder = std::fs::read_to_string(&path)
            .ok()
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
            .map_or_else(|| "unknown pid".into(), |pid| format!("pid {pid}"));
        return Err(StoreError::DirLocked {
            path: dir.to_owned(),
            holder,
        });
    }
    let pid = std::process::id().to_string();
    file.set_len(0)
        .and_then(|()| file.write_all_at(pid.as_bytes(), 0))
        .map_err(|e| StoreError::DiskDir {
            path: dir.to_owned(),
            reason: format!("cannot write {}: {e}", path.display()),
        })?;
    let _ = file.flush();
    Ok(file)
}

/// Decides O_DIRECT: tries an aligned write to a probe file opened with it.
fn probe_direct_io(dir: &Path, mode: DirectIo) -> Result<bool, StoreError> {
    if mode == DirectIo::Off {
        return Ok(false);
    }
    let probe = dir.join(".direct-io-probe");
    let result = (|| -> io::Result<()> {
        let f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_DIRECT)
            .open(&probe)?;
        f.write_all_at(&AlignedBuf::new(IO_ALIGN), 0)
    })();
    let _ = std::fs::remove_file(&probe);
    match (result, mode) {
        (Ok(()), _) => Ok(true),
        (Err(e), DirectIo::On) => Err(StoreError::DiskDir {
            path: dir.to_owned(),
            reason: format!("O_DIRECT requested but refused by the file system: {e}"),
        }),
        (Err(e), _) if e.raw_os_error() == Some(libc::EINVAL) => {
            tracing::warn!(dir = %dir.display(), "O_DIRECT not supported here; using buffered I/O");
            Ok(false)
        }
        (Err(e), _) => Err(StoreError::DiskDir {
            path: dir.to_owned(),
            reason: format!("cannot write in it: {e}"),
        }),
    }
}

fn read_cleared(dir: &Path) -> HashMap<NamespaceFingerprint, u64> {
    let Ok(bytes) = std::fs::read(dir.join(CLEARED_FILE)) else {
        return HashMap::new();
    };
    if bytes.len() < 8 || (bytes.len() - 8) % 24 != 0 {
        tracing::warn!(dir = %dir.display(), "ignoring a damaged CLEARED file");
        return HashMap::new();
    }
    let (body, sum) = bytes.split_at(bytes.len() - 8);
    if kvtier_core::xxh3_64(body).to_le_bytes() != sum {
        tracing::warn!(dir = %dir.display(), "ignoring a CLEARED file with a bad checksum");
        return HashMap::new();
    }
    body.chunks_exact(24)
        .map(|c| {
            (
                NamespaceFingerprint(u128::from_le_bytes(c[..16].try_into().expect("16 bytes"))),
                u64::from_le_bytes(c[16..].try_into().expect("8 bytes")),
            )
        })
        .collect()
}

fn write_cleared(dir: &Path, cleared: &HashMap<NamespaceFingerprint, u64>) -> Result<(), StoreError> {
    let mut body = Vec::with_capacity(cleared.len() * 24 + 8);
    for (ns, seq) in cleared {
        body.extend_from_slice(&ns.0.to_le_bytes());
        body.extend_from_slice(&seq.to_le_bytes());
    }
    let sum = kvtier_core::xxh3_64(&body);
    body.extend_from_slice(&sum.to_le_bytes());
    let path = dir.join(CLEARED_FILE);
    let tmp = dir.join("CLEARED.tmp");
    let write = || -> io::Result<()> {
        let mut f = File::create(&tmp)?;
        f.write_all(&body)?;
        f.sync_data()?;
        std::fs::rename(&tmp, &path)
    };
    write().map_err(|e| StoreError::io("write", &path, e))
}

#[cfg(test)]
mod tests;
