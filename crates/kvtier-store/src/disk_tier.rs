//! The disk tier: KV blocks in log-structured region files that survive restarts.
//!
//! Blocks are appended to the active region file, one fixed-size entry each (a 4 KiB header
//! that is the entry's commit record, then the block's host page), with O_DIRECT when the file
//! system allows it. The header carries the namespace, key, sequence number, the payload's
//! xxh3-64 and its own xxh3-64, so a torn or damaged entry is detected and dropped, never served.
//! Whole regions are reclaimed oldest first. A region that is full gets an index file so that a
//! restart reads one small file per region instead of every header.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use dashmap::DashMap;
use kvtier_core::{BlockKey, ByteSize, KvGeometry, NamespaceFingerprint};
use serde::{Deserialize, Serialize};

use crate::aligned_buf::AlignedBuf;
use crate::disk_format::{EntryHeader, HEADER_BYTES, IndexRecord};
use crate::key_hasher::KeyHasherBuilder;
use crate::removal_feed::{DropHook, HookSlot};
use crate::shm_region::ShmRegion;
use crate::{PAGE_ALIGN, StoreError};

mod clear_records;
mod dir_lock;
mod recovery;
mod region;
mod space;
mod syncer;

pub use recovery::RecoveryReport;

use clear_records::{read_cleared, write_cleared};
use dir_lock::{lock_dir, prepare_dir, probe_direct_io};

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

impl DiskTierConfig {
    /// Block slots per region file and the file's bytes, for `geometry`: a region holds at
    /// least one block, so it may be larger than `region_size` when a block is.
    pub fn region_layout(&self, geometry: &KvGeometry) -> (u32, u64) {
        let entry_stride = (HEADER_BYTES + geometry.bytes_per_block().next_multiple_of(PAGE_ALIGN)) as u64;
        let slots = ((self.region_size.bytes().saturating_sub(HEADER_BYTES as u64)) / entry_stride)
            .clamp(1, u32::MAX as u64) as u32;
        (slots, HEADER_BYTES as u64 + u64::from(slots) * entry_stride)
    }
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
    /// Blocks written whose region file has not been fdatasynced since (a power cut may lose
    /// them; a process kill does not).
    pub unsynced_blocks: u64,
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
    /// Blocks written and not yet fdatasynced.
    unsynced: AtomicU64,
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
    /// Regions written since their last fsync, with how many blocks each got meanwhile.
    dirty: Mutex<BTreeMap<u64, u64>>,
    /// Held across a whole sync pass (periodic, durable or flush), so a durable store's sync
    /// waits for a pass already syncing its region instead of finding nothing dirty.
    sync_lock: Mutex<()>,
    counters: Counters,
    /// Told of each entry a reclaimed region drops (see `TieredStore`'s removal feed).
    on_reclaim: HookSlot,
}

/// A [`DiskTier`] that is not kept alive by this reference.
#[derive(Debug, Clone)]
pub(crate) struct WeakDiskTier(std::sync::Weak<Inner>);

impl WeakDiskTier {
    /// The tier, while it lives.
    pub(crate) fn upgrade(&self) -> Option<DiskTier> {
        self.0.upgrade().map(|inner| DiskTier { inner })
    }
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

/// Regions opened (and scanned) at once during recovery.
const RECOVERY_THREADS: usize = 4;

/// What recovering one region gave: its entries (or `None` if skipped), and its counts.
type RegionRecovery = (
    Result<Option<(Region, Vec<IndexRecord>)>, StoreError>,
    RecoveryReport,
);

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
        let (slots_per_region, region_bytes) = config.region_layout(&geometry);
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
            dirty: Mutex::new(BTreeMap::new()),
            sync_lock: Mutex::new(()),
            on_reclaim: HookSlot::default(),
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

    /// Calls `hook` with each entry a reclaimed region drops (set once; a second hook is
    /// ignored).
    pub(crate) fn set_reclaim_hook(&self, hook: DropHook) {
        self.inner.on_reclaim.set(hook);
    }

    /// A reference that does not keep the tier alive (for the other tiers' hooks).
    pub(crate) fn downgrade(&self) -> WeakDiskTier {
        WeakDiskTier(Arc::downgrade(&self.inner))
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
        *lock_poisoned(inner.dirty.lock()).entry(region.id).or_default() += 1;
        inner.counters.unsynced.fetch_add(1, Ordering::Relaxed);
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
                inner.drop_region(id, false); // the caller says Cleared once
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
        let _pass = lock_poisoned(inner.sync_lock.lock());
        let dirty = std::mem::take(&mut *lock_poisoned(inner.dirty.lock()));
        let regions: Vec<Arc<Region>> = lock_poisoned(inner.regions.read()).values().cloned().collect();
        for r in regions {
            if let Err(e) = r.file.sync_data() {
                inner.restore_dirty(dirty);
                return Err(StoreError::io("fdatasync", &r.path, e));
            }
        }
        inner.synced(&dirty);
        Ok(())
    }

    /// `fdatasync`s every region file written since its last sync: when this returns `Ok`,
    /// every block whose [`DiskTier::append`] returned before the call is on stable storage
    /// (a sync already running elsewhere is waited for, not skipped). Durable stores call it.
    ///
    /// Cost: one `fdatasync` per region written since the last pass (usually one).
    ///
    /// # Errors
    /// [`StoreError::Io`] naming the region file; its blocks stay counted as unsynced.
    pub fn sync(&self) -> Result<(), StoreError> {
        self.inner.sync_dirty()
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
            unsynced_blocks: l(&c.unsynced),
        }
    }
}

impl Inner {
    /// One sync pass over the dirty regions (see [`DiskTier::sync`]).
    fn sync_dirty(&self) -> Result<(), StoreError> {
        let _pass = lock_poisoned(self.sync_lock.lock());
        let mut dirty = std::mem::take(&mut *lock_poisoned(self.dirty.lock()));
        let mut done = BTreeMap::new();
        while let Some((id, blocks)) = dirty.pop_first() {
            let region = lock_poisoned(self.regions.read()).get(&id).cloned();
            // A region reclaimed meanwhile has no blocks left to make durable.
            if let Some(r) = region
                && let Err(e) = r.file.sync_data()
            {
                dirty.insert(id, blocks);
                self.synced(&done);
                self.restore_dirty(dirty);
                return Err(StoreError::io("fdatasync", &r.path, e));
            }
            done.insert(id, blocks);
        }
        self.synced(&done);
        Ok(())
    }

    /// These regions' blocks are on stable storage.
    fn synced(&self, regions: &BTreeMap<u64, u64>) {
        let n: u64 = regions.values().sum();
        self.counters.unsynced.fetch_sub(n, Ordering::Relaxed);
    }

    /// A pass failed: these regions are still dirty (counts merged with writes since).
    fn restore_dirty(&self, regions: BTreeMap<u64, u64>) {
        let mut d = lock_poisoned(self.dirty.lock());
        for (id, n) in regions {
            *d.entry(id).or_default() += n;
        }
    }

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

#[cfg(test)]
mod tests;
