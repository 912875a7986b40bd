//! Shared-memory regions: the one module that owns raw pointers into mapped memory.
//!
//! A [`ShmRegion`] is a `MAP_SHARED` mapping of a file under `/dev/shm` (or any path) or of an
//! anonymous memfd. Every access goes through a bounds-checked method; nothing outside this
//! module sees a pointer. Several processes may map the same file: who may write which bytes
//! when is a protocol above this module (slot ownership, page pins), exactly as for memory
//! shared with a GPU.
//!
//! A shared mapping is only as long as its file, and another process may shrink the file: every
//! shared region is registered with the bus-error guard (`fault_guard`), every accessor checks
//! it afterwards, and a region whose file shrank, was replaced or unlinked reports
//! [`StoreError::RegionUnusable`] from then on instead of crashing the process.

use std::any::Any;
use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use memmap2::{MmapOptions, MmapRaw};

use crate::StoreError;
use crate::fault_guard::FaultGuard;

/// How the pages of a new mapping are made resident before first use.
///
/// On virtual machines memory touched for the first time costs about ten times more than memory
/// already resident, so kvtier touches its arenas and pools once at start-up and never hands
/// them back: a transfer must never pay the first-touch cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Prefault {
    /// Map with `MAP_POPULATE` and write every page once (the default for memory kvtier owns).
    #[default]
    Touch,
    /// Map with `MAP_POPULATE` only: page tables are filled, contents are not written (for
    /// memory another process owns).
    Populate,
    /// Leave pages to be faulted in on first use (tests with large, mostly unused regions).
    Lazy,
}

/// See [`ShmRegion::device_registration`].
#[derive(Default)]
struct DeviceRegistration(OnceLock<Box<dyn Any + Send + Sync>>);

impl std::fmt::Debug for DeviceRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.get().is_some() {
            "registered"
        } else {
            "none"
        })
    }
}

/// A shared, writable memory mapping with bounds-checked byte access.
///
/// Cost: creating one allocates and (by default) touches `len` bytes; accessors copy exactly the
/// bytes asked for.
#[derive(Debug)]
pub struct ShmRegion {
    /// A device driver's registration of the mapping (CUDA's page-locking), declared first:
    /// released before the mapping goes away, so no device keeps DMA access to pages a later
    /// mapping at the same address would not own.
    device_registration: DeviceRegistration,
    /// Declared before `map`: unregistered before the mapping goes away.
    guard: Option<FaultGuard>,
    /// The mapped file (shared regions), for [`ShmRegion::check_backing`].
    file: Option<File>,
    map: MmapRaw,
    len: usize,
    name: String,
    path: Option<PathBuf>,
    remove_on_drop: bool,
}

// SAFETY: the mapping is plain shared memory; all access is through raw copies whose
// concurrency contract is documented on the type (writers of a range are serialized by the
// caller's protocol). MmapRaw itself is Send + Sync.
unsafe impl Send for ShmRegion {}
// SAFETY: see above.
unsafe impl Sync for ShmRegion {}

impl ShmRegion {
    /// Creates a new file of `len` bytes at `path` (which must not exist) and maps it. The file
    /// is removed when the region is dropped, unless [`ShmRegion::keep_file`] is called.
    ///
    /// # Errors
    /// [`StoreError::AlreadyExists`] if `path` exists; [`StoreError::Io`] naming the path if it
    /// cannot be created, sized or mapped.
    pub fn create_file(path: &Path, len: usize, prefault: Prefault) -> Result<Self, StoreError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(|e| match e.kind() {
                io::ErrorKind::AlreadyExists => StoreError::AlreadyExists {
                    path: path.to_owned(),
                },
                _ => StoreError::io("create", path, e),
            })?;
        let result = Self::size_and_map(file, len, path.display().to_string(), prefault);
        match result {
            Ok(mut region) => {
                region.path = Some(path.to_owned());
                region.remove_on_drop = true;
                Ok(region)
            }
            Err(e) => {
                let _ = std::fs::remove_file(path);
                Err(e)
            }
        }
    }

    /// Creates an anonymous region of `len` bytes backed by a memfd named `name` (visible in
    /// `/proc/<pid>/maps`); it disappears with the process.
    ///
    /// # Errors
    /// [`StoreError::Io`] if the memfd cannot be created, sized or mapped.
    pub fn create_anonymous(name: &str, len: usize, prefault: Prefault) -> Result<Self, StoreError> {
        let label = format!("<memfd:{name}>");
        let cname = CString::new(name.replace('\0', "_")).unwrap_or_default();
        // SAFETY: memfd_create takes a NUL-terminated string and flags; it returns a new fd or -1.
        let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(StoreError::io("memfd_create", &label, io::Error::last_os_error()));
        }
        // SAFETY: fd is a freshly created descriptor owned by nobody else.
        let file = unsafe { File::from_raw_fd(fd) };
        Self::size_and_map(file, len, label, prefault)
    }

    /// Creates `len` bytes of process-private anonymous memory (not shareable with other
    /// processes). Direct I/O into private memory is markedly faster than into shared memory on
    /// the kernels we measured (the host tier's default backing; see `HostBacking`).
    ///
    /// # Errors
    /// [`StoreError::Io`] if the mapping fails.
    pub fn create_private(name: &str, len: usize, prefault: Prefault) -> Result<Self, StoreError> {
        let label = format!("<private:{name}>");
        if len == 0 {
            return Err(StoreError::OutOfBounds {
                region: label,
                offset: 0,
                len: 0,
                region_bytes: 0,
            });
        }
        let mut opts = MmapOptions::new();
        opts.len(len);
        if prefault != Prefault::Lazy {
            opts.populate();
        }
        let map = MmapRaw::from(opts.map_anon().map_err(|e| StoreError::io("mmap", &label, e))?);
        // Private anonymous memory has no file to shrink: nothing to guard.
        let region = Self {
            device_registration: DeviceRegistration::default(),
            guard: None,
            file: None,
            map,
            len,
            name: label,
            path: None,
            remove_on_drop: false,
        };
        if prefault == Prefault::Touch {
            region.touch_pages();
        }
        Ok(region)
    }

    /// Maps an existing file, which must be exactly `expected_len` bytes. The file is left in
    /// place on drop (its creator owns it).
    ///
    /// # Errors
    /// [`StoreError::FileNotFound`], [`StoreError::WrongSize`], or [`StoreError::Io`] naming
    /// the path.
    pub fn open_file(path: &Path, expected_len: usize, prefault: Prefault) -> Result<Self, StoreError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| match e.kind() {
                io::ErrorKind::NotFound => StoreError::FileNotFound {
                    path: path.to_owned(),
                },
                _ => StoreError::io("open", path, e),
            })?;
        let actual = file
            .metadata()
            .map_err(|e| StoreError::io("stat", path, e))?
            .len();
        if actual != expected_len as u64 {
            return Err(StoreError::WrongSize {
                path: path.to_owned(),
                expected_bytes: expected_len as u64,
                actual_bytes: actual,
            });
        }
        let mut region = Self::map(file, expected_len, path.display().to_string(), prefault)?;
        region.path = Some(path.to_owned());
        Ok(region)
    }

    fn size_and_map(file: File, len: usize, name: String, prefault: Prefault) -> Result<Self, StoreError> {
        if len == 0 {
            return Err(StoreError::OutOfBounds {
                region: name,
                offset: 0,
                len: 0,
                region_bytes: 0,
            });
        }
        file.set_len(len as u64)
            .map_err(|e| StoreError::io("ftruncate", &name, e))?;
        let region = Self::map(file, len, name, prefault)?;
        if prefault == Prefault::Touch {
            region.touch_pages();
        }
        Ok(region)
    }

    fn map(file: File, len: usize, name: String, prefault: Prefault) -> Result<Self, StoreError> {
        let mut opts = MmapOptions::new();
        opts.len(len);
        if prefault != Prefault::Lazy {
            opts.populate();
        }
        let map = opts
            .map_raw(&file)
            .map_err(|e| StoreError::io("mmap", &name, e))?;
        Ok(Self {
            device_registration: DeviceRegistration::default(),
            guard: FaultGuard::register(map.as_mut_ptr(), len, &name),
            file: Some(file),
            map,
            len,
            name,
            path: None,
            remove_on_drop: false,
        })
    }

    /// Writes one zero byte into every 4 KiB page so the whole region is resident and writable.
    fn touch_pages(&self) {
        let base = self.map.as_mut_ptr();
        let mut off = 0;
        while off < self.len {
            // SAFETY: off < len, inside the mapping; the region was just created and is not yet
            // shared with anyone, and a zero byte is what a fresh file already holds.
            unsafe { base.add(off).write_volatile(0) };
            off += 4096;
        }
    }

    /// Keeps the backing file after drop (for a pool another process will keep using).
    pub fn keep_file(&mut self) {
        self.remove_on_drop = false;
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a region has at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The backing file, or `None` for anonymous memory.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Path or memfd label, for messages.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Checks that `offset..offset+len` lies inside the region.
    ///
    /// # Errors
    /// [`StoreError::OutOfBounds`] naming the region and range.
    pub fn check_range(&self, offset: usize, len: usize) -> Result<(), StoreError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(StoreError::OutOfBounds {
                region: self.name.clone(),
                offset,
                len,
                region_bytes: self.len,
            }),
        }
    }

    /// The address of `offset..offset+len`, for a device API that reads or writes the region
    /// itself (a DMA engine, `cuMemHostRegister`). Nothing may be done through it that the
    /// region's own accessors would not do: the caller keeps the region alive until the device
    /// is done, and serializes writers of a range as for [`ShmRegion::write`].
    ///
    /// # Errors
    /// [`StoreError::OutOfBounds`] if the range does not fit.
    pub fn dma_address(&self, offset: usize, len: usize) -> Result<*mut u8, StoreError> {
        self.check_range(offset, len)?;
        // SAFETY: `offset` is inside the mapping (or its end), checked above.
        Ok(unsafe { self.map.as_mut_ptr().add(offset) })
    }

    /// The slot where a device driver keeps its registration of this mapping (kvtier-cuda's
    /// page-locked pinning): set once, kept while the region lives, dropped before it unmaps.
    pub fn device_registration(&self) -> &OnceLock<Box<dyn Any + Send + Sync>> {
        &self.device_registration.0
    }

    /// Copies `src` into the region at `offset` (streaming stores when it is large, as
    /// [`ShmRegion::copy`]: what lands in a region is read by another process or later).
    ///
    /// # Errors
    /// [`StoreError::OutOfBounds`] if the range does not fit.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), StoreError> {
        self.check_range(offset, src.len())?;
        // SAFETY: the range is inside the mapping (checked above) and cannot overlap `src`, which
        // is a Rust slice the caller borrows from elsewhere.
        unsafe {
            copy_bytes(src.as_ptr(), self.map.as_mut_ptr().add(offset), src.len());
        }
        self.check_fault()
    }

    /// Copies bytes at `offset` out into `dst`.
    ///
    /// # Errors
    /// [`StoreError::OutOfBounds`] if the range does not fit.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), StoreError> {
        self.check_range(offset, dst.len())?;
        // SAFETY: the range is inside the mapping (checked above); `dst` is an exclusive Rust
        // borrow, so it cannot overlap the mapping's bytes being read.
        unsafe {
            std::ptr::copy_nonoverlapping(self.map.as_ptr().add(offset), dst.as_mut_ptr(), dst.len());
        }
        self.check_fault()
    }

    /// Copies `src` into the range `(offset, len)`, which it must fill exactly (one
    /// block-layer, say).
    ///
    /// # Errors
    /// [`StoreError::BufferSize`] if `src` is not `len` bytes; [`StoreError::OutOfBounds`].
    pub fn write_range(&self, (offset, len): (usize, usize), src: &[u8]) -> Result<(), StoreError> {
        check_len(len, src.len())?;
        self.write(offset, src)
    }

    /// Copies the range `(offset, len)` into `dst`, which it must fill exactly.
    ///
    /// # Errors
    /// [`StoreError::BufferSize`] if `dst` is not `len` bytes; [`StoreError::OutOfBounds`].
    pub fn read_range(&self, (offset, len): (usize, usize), dst: &mut [u8]) -> Result<(), StoreError> {
        check_len(len, dst.len())?;
        self.read(offset, dst)
    }

    /// Sets `len` bytes at `offset` to `byte`.
    ///
    /// # Errors
    /// [`StoreError::OutOfBounds`] if the range does not fit.
    pub fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<(), StoreError> {
        self.check_range(offset, len)?;
        // SAFETY: the range is inside the mapping (checked above).
        unsafe { std::ptr::write_bytes(self.map.as_mut_ptr().add(offset), byte, len) };
        self.check_fault()
    }

    /// Runs `f` over a read-only view of `len` bytes at `offset`, without a copy (the engine
    /// converts its KV straight out of its pool). A fault under the view (a shrunk backing
    /// file) is caught: `f` then sees zeros and the call returns [`StoreError::RegionUnusable`].
    ///
    /// # Errors
    /// [`StoreError::OutOfBounds`] if the range does not fit; [`StoreError::RegionUnusable`].
    ///
    /// # Safety
    /// For as long as `f` runs, nothing may write the bytes `offset .. offset + len`: not this
    /// process through this or another mapping of the same file, and not another process that
    /// maps it. A shared slice asserts the bytes do not change while it lives; a write under
    /// it is undefined behaviour, not just a torn value. (The copying accessors, [`read`] and
    /// [`xxh3_64`], have no such requirement: a concurrent write only gives them a torn value.)
    ///
    /// [`read`]: ShmRegion::read
    /// [`xxh3_64`]: ShmRegion::xxh3_64
    pub unsafe fn with_bytes<R>(
        &self,
        offset: usize,
        len: usize,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, StoreError> {
        self.check_range(offset, len)?;
        // SAFETY: the range is inside the mapping (checked above) and the mapping outlives the
        // borrow, which does not escape `f`; no writer touches it while `f` runs (the caller's
        // obligation, see # Safety).
        let view = unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(offset), len) };
        let r = f(view);
        self.check_fault()?;
        Ok(r)
    }

    /// `xxh3_64` of `len` bytes at `offset`, for bit-exact verification. Reads the bytes
    /// through a 64 KiB copy at a time, so a concurrent writer gives a wrong checksum (which
    /// fails the verification), never undefined behaviour.
    ///
    /// # Errors
    /// [`StoreError::OutOfBounds`] if the range does not fit; [`StoreError::RegionUnusable`].
    pub fn xxh3_64(&self, offset: usize, len: usize) -> Result<u64, StoreError> {
        const PIECE: usize = 64 << 10;
        self.check_range(offset, len)?;
        let mut stream = kvtier_core::Xxh3Stream::new();
        let mut buf = vec![0u8; PIECE.min(len)];
        let mut done = 0;
        while done < len {
            let n = PIECE.min(len - done);
            self.read(offset + done, &mut buf[..n])?;
            stream.update(&buf[..n]);
            done += n;
        }
        Ok(stream.digest())
    }

    /// Writes `head` then `len` bytes of this region at `offset` into `file` at `file_offset`,
    /// in one `pwritev` (repeated only after a short write): how a disk entry's header and its
    /// host page reach the disk without a staging copy. With O_DIRECT, `head`, `offset`, `len`
    /// and `file_offset` must be 4 KiB aligned (host pages are).
    ///
    /// # Errors
    /// The OS error (`ENOSPC`, `EFBIG`, `EIO`, …), or `InvalidInput` for a range outside the
    /// region.
    pub fn write_to_file(
        &self,
        file: &File,
        file_offset: u64,
        head: &[u8],
        offset: usize,
        len: usize,
    ) -> io::Result<()> {
        self.check_range(offset, len)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        // SAFETY: `head` is a live borrow; the region range is inside the mapping (checked
        // above); the kernel only reads both during the call.
        unsafe {
            vectored_io(
                file_offset,
                head.as_ptr().cast_mut(),
                head.len(),
                self.map.as_ptr().add(offset).cast_mut(),
                len,
                |iov, at| libc::pwritev(file.as_raw_fd(), iov.as_ptr(), 2, at),
            )
        }?;
        // The kernel reads a truncated mapping as EFAULT; one remapped after a fault reads as
        // junk, which must not count as written.
        self.check_fault()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))
    }

    /// Reads `head.len()` bytes into `head` then `len` bytes into this region at `offset`, from
    /// `file` at `file_offset`, in one `preadv` (repeated only after a short read). Alignment
    /// rules as for [`ShmRegion::write_to_file`].
    ///
    /// # Errors
    /// The OS error; `UnexpectedEof` if the file ends first; `InvalidInput` for a range outside
    /// the region.
    pub fn read_from_file(
        &self,
        file: &File,
        file_offset: u64,
        head: &mut [u8],
        offset: usize,
        len: usize,
    ) -> io::Result<()> {
        self.check_range(offset, len)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        // SAFETY: `head` is an exclusive borrow; the region range is inside the mapping (checked
        // above) and owned by the caller's protocol (a page reserved for writing).
        unsafe {
            vectored_io(
                file_offset,
                head.as_mut_ptr(),
                head.len(),
                self.map.as_mut_ptr().add(offset),
                len,
                |iov, at| libc::preadv(file.as_raw_fd(), iov.as_ptr(), 2, at),
            )
        }?;
        self.check_fault()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))
    }

    /// Copies `len` bytes from `src` at `src_offset` to `dst` at `dst_offset`: the one copy every
    /// transfer between a host page and a CPU device slot makes where the block-layer is one
    /// run ([`ShmRegion::copy_ranges`] with one range).
    ///
    /// # Errors
    /// [`StoreError::OutOfBounds`] if either range does not fit, or if `src` and `dst` are the
    /// same region and the ranges overlap.
    pub fn copy(
        src: &ShmRegion,
        src_offset: usize,
        dst: &ShmRegion,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), StoreError> {
        Self::copy_ranges(CopyKind::Streaming, src, dst, [(src_offset, dst_offset, len)])
    }

    /// Both ranges of a copy inside their regions, and apart where the regions are one.
    fn check_copy(
        src: &ShmRegion,
        src_offset: usize,
        dst: &ShmRegion,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), StoreError> {
        src.check_range(src_offset, len)?;
        dst.check_range(dst_offset, len)?;
        if std::ptr::eq(src, dst) && src_offset < dst_offset + len && dst_offset < src_offset + len {
            return Err(StoreError::OutOfBounds {
                region: src.name.clone(),
                offset: dst_offset,
                len,
                region_bytes: src.len,
            });
        }
        Ok(())
    }

    /// Copies the ranges `(src_offset, dst_offset, len)` from `src` to `dst`: one logical copy
    /// (a block-layer) in one piece or in many (layouts that keep K and V apart, or split them
    /// per token and head). How it copies is one rule for both ([`CopyKind`]): with
    /// [`CopyKind::Streaming`], when the pieces add up to [`STREAM_MIN_BYTES`] or more, each
    /// piece of 64 bytes or more is stored non-temporally; everything else goes through
    /// `memcpy`. The fault check and the store fence run once, at the end.
    ///
    /// A fault or a bad range fails the whole call (ranges before it may have been written;
    /// the fence runs either way).
    ///
    /// # Errors
    /// [`StoreError::OutOfBounds`] for the first range that does not fit, or that overlaps
    /// itself where `src` and `dst` are the same region;
    /// [`StoreError::RegionUnusable`] if either region's file shrank under it.
    pub fn copy_ranges<I>(
        kind: CopyKind,
        src: &ShmRegion,
        dst: &ShmRegion,
        ranges: I,
    ) -> Result<(), StoreError>
    where
        I: IntoIterator<Item = (usize, usize, usize)>,
        I::IntoIter: Clone,
    {
        let ranges = ranges.into_iter();
        let total: usize = ranges.clone().map(|r| r.2).sum();
        let stream_from = match kind {
            CopyKind::Streaming if total >= STREAM_MIN_BYTES => STREAM_MIN_PIECE,
            _ => usize::MAX,
        };
        let mut streamed = false;
        let copied: Result<(), StoreError> = ranges.into_iter().try_for_each(|(s, d, len)| {
            Self::check_copy(src, s, dst, d, len)?;
            // SAFETY: both ranges are inside their mappings (checked above) and do not overlap
            // (different mappings of distinct memory, or disjoint ranges of one mapping). Two
            // mappings of the same file at overlapping ranges are excluded by the pool/arena
            // ownership protocol.
            streamed |= unsafe {
                copy_unfenced(
                    src.map.as_ptr().add(s),
                    dst.map.as_mut_ptr().add(d),
                    len,
                    stream_from,
                )
            };
            Ok(())
        });
        if streamed {
            fence_streams();
        }
        copied?;
        src.check_fault()?;
        dst.check_fault()
    }

    /// Whether an access found the region's file shorter than the mapping (a caught bus
    /// error). Once true, it stays true: the region's bytes are anonymous junk.
    pub fn faulted(&self) -> bool {
        self.guard.as_ref().is_some_and(FaultGuard::faulted)
    }

    fn check_fault(&self) -> Result<(), StoreError> {
        if self.faulted() {
            return Err(self.unusable("its file shrank under the mapping (a bus error was caught)"));
        }
        Ok(())
    }

    fn unusable(&self, reason: impl Into<String>) -> StoreError {
        StoreError::RegionUnusable {
            region: self.name.clone(),
            reason: reason.into(),
        }
    }

    /// Checks that the memory behind the region is still what was mapped: no caught fault, the
    /// file at least as long as the mapping, and (for a region opened by path) the path still
    /// naming the same file. The sidecar calls it before each request on memory another process
    /// owns, so a pool whose file was truncated, replaced or unlinked fails with a clear error
    /// instead of copying into memory the engine no longer sees.
    ///
    /// Cost: an `fstat`, and a `stat` of the path.
    ///
    /// # Errors
    /// [`StoreError::RegionUnusable`] saying what changed.
    pub fn check_backing(&self) -> Result<(), StoreError> {
        self.check_fault()?;
        let Some(file) = &self.file else { return Ok(()) };
        let mapped = file
            .metadata()
            .map_err(|e| StoreError::io("fstat", self.name.clone(), e))?;
        if mapped.len() < self.len as u64 {
            return Err(self.unusable(format!(
                "its file shrank to {} of the {} mapped bytes",
                mapped.len(),
                self.len
            )));
        }
        if let Some(path) = &self.path {
            match std::fs::metadata(path) {
                Ok(now) if (now.dev(), now.ino()) == (mapped.dev(), mapped.ino()) => {}
                Ok(_) => return Err(self.unusable("its path now names another file (replaced)")),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    return Err(self.unusable("its file was unlinked"));
                }
                Err(e) => return Err(StoreError::io("stat", path, e)),
            }
        }
        Ok(())
    }
}

/// Moves `head_len` bytes at `head` then `len` bytes at `payload` with `op` (a `pwritev` or
/// `preadv` of two iovecs at a file offset), repeating after short transfers and `EINTR`.
///
/// # Safety
/// Both ranges must be live memory of the given lengths, writable if `op` writes into them,
/// for the duration of the call.
unsafe fn vectored_io(
    file_offset: u64,
    head: *mut u8,
    head_len: usize,
    payload: *mut u8,
    len: usize,
    op: impl Fn(&[libc::iovec; 2], libc::off_t) -> isize,
) -> io::Result<()> {
    let total = head_len + len;
    let mut done = 0usize;
    while done < total {
        let (h, p) = (done.min(head_len), done.saturating_sub(head_len));
        let iov = [
            libc::iovec {
                // SAFETY: h <= head_len: inside (or one past) `head`, per the caller.
                iov_base: unsafe { head.add(h) }.cast(),
                iov_len: head_len - h,
            },
            libc::iovec {
                // SAFETY: p <= len: inside (or one past) `payload`, per the caller.
                iov_base: unsafe { payload.add(p) }.cast(),
                iov_len: len - p,
            },
        ];
        match op(&iov, (file_offset + done as u64) as libc::off_t) {
            n if n > 0 => done += n as usize,
            0 => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "file ends inside the entry",
                ));
            }
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}

fn check_len(expected_bytes: usize, actual_bytes: usize) -> Result<(), StoreError> {
    if expected_bytes != actual_bytes {
        return Err(StoreError::BufferSize {
            expected_bytes,
            actual_bytes,
        });
    }
    Ok(())
}

impl Drop for ShmRegion {
    fn drop(&mut self) {
        if self.remove_on_drop
            && let Some(p) = &self.path
        {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// How [`ShmRegion::copy_ranges`] copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyKind {
    /// What kvtier's transfers use: non-temporal stores for copies of 64 KiB or more on
    /// x86-64 (their pieces of 64 bytes or more), `memcpy` below that.
    Streaming,
    /// The C library's `memcpy`, whatever the size.
    Memcpy,
}

/// Copies of at least this many bytes bypass the caches (non-temporal stores): a block-layer is
/// read back by another process or much later, if at all, and streaming stores skip the
/// read-for-ownership of every destination line (~1.5x the bandwidth of `memcpy` here for
/// 128 KiB pieces). Smaller copies use `memcpy`.
const STREAM_MIN_BYTES: usize = 64 << 10;

/// Pieces of a streamed copy shorter than this use `memcpy`: a 16-byte-aligned run of
/// non-temporal stores needs a few lines to pay for its unaligned head and tail.
const STREAM_MIN_PIECE: usize = 64;

/// Copies `len` bytes from `src` to `dst`: non-temporal 16-byte stores for large copies on
/// x86-64 (SSE2 is part of its baseline), `memcpy` otherwise. The stores are fenced before it
/// returns, so whatever the caller publishes afterwards (a completion) is ordered after them.
///
/// # Safety
/// `src` must be valid for reads and `dst` for writes of `len` bytes, and the ranges must not
/// overlap.
unsafe fn copy_bytes(src: *const u8, dst: *mut u8, len: usize) {
    // SAFETY: the caller's contract.
    if unsafe { copy_unfenced(src, dst, len, STREAM_MIN_BYTES) } {
        fence_streams();
    }
}

/// Copies `len` bytes, streamed (non-temporal stores, not fenced) when `len >= stream_from` on
/// x86-64, else with `memcpy`; whether it streamed. [`ShmRegion::copy_ranges`] streams each of
/// many short pieces of one large copy and fences once after the last ([`fence_streams`]).
///
/// # Safety
/// As [`copy_bytes`].
unsafe fn copy_unfenced(src: *const u8, dst: *mut u8, len: usize, stream_from: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    if len >= stream_from {
        // SAFETY: the caller's contract.
        unsafe { stream_unfenced(src, dst, len) };
        return true;
    }
    let _ = stream_from;
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
    false
}

/// Orders the streaming stores of [`copy_unfenced`] before any later store.
fn fence_streams() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE2 is part of x86-64's baseline.
    unsafe {
        std::arch::x86_64::_mm_sfence();
    }
}

/// Non-temporal stores of `[0, len)` (32-byte with AVX2, found at run time, else 16-byte),
/// memcpy for the unaligned head and the tail; no fence.
///
/// # Safety
/// As [`copy_bytes`].
#[cfg(target_arch = "x86_64")]
unsafe fn stream_unfenced(src: *const u8, dst: *mut u8, len: usize) {
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the caller's contract; AVX2 is present (checked just above).
        unsafe { stream_unfenced_avx2(src, dst, len) }
    } else {
        // SAFETY: the caller's contract.
        unsafe { stream_unfenced_sse2(src, dst, len) }
    }
}

/// The body of a streaming copy with one vector type: `memcpy` up to the first boundary of
/// `dst` aligned to the vector (stream stores need it), then four unaligned loads and four
/// non-temporal stores a turn, then `memcpy` for the tail.
///
/// # Safety
/// As [`copy_bytes`], on a CPU with the vector type's instructions.
#[cfg(target_arch = "x86_64")]
macro_rules! stream_body {
    ($src:ident, $dst:ident, $len:ident, $vec:ty, $load:path, $store:path) => {{
        const W: usize = std::mem::size_of::<$vec>();
        let head = $dst.align_offset(W).min($len);
        // SAFETY: `head <= len`; the caller's ranges cover it.
        unsafe { std::ptr::copy_nonoverlapping($src, $dst, head) };
        let body = ($len - head) / (4 * W) * (4 * W);
        let mut i = head;
        while i < head + body {
            // SAFETY: `i + 4W <= len`, so all four loads and stores are inside the caller's
            // ranges; `dst + i` is W-aligned (`head` aligned it, `i - head` is a multiple of
            // 4W); loads are unaligned.
            unsafe {
                let s = $src.add(i).cast::<$vec>();
                let d = $dst.add(i).cast::<$vec>();
                let (a, b, c, e) = ($load(s), $load(s.add(1)), $load(s.add(2)), $load(s.add(3)));
                $store(d, a);
                $store(d.add(1), b);
                $store(d.add(2), c);
                $store(d.add(3), e);
            }
            i += 4 * W;
        }
        // SAFETY: the tail `[i, len)` is inside the caller's ranges.
        unsafe { std::ptr::copy_nonoverlapping($src.add(i), $dst.add(i), $len - i) };
    }};
}

/// [`stream_unfenced`] with 32-byte loads and non-temporal stores, 128 bytes a turn.
///
/// # Safety
/// As [`copy_bytes`], on a CPU with AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn stream_unfenced_avx2(src: *const u8, dst: *mut u8, len: usize) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256};
    stream_body!(src, dst, len, __m256i, _mm256_loadu_si256, _mm256_stream_si256);
}

/// [`stream_unfenced`] with SSE2 (x86-64's baseline): 16-byte stores, 64 bytes a turn.
///
/// # Safety
/// As [`copy_bytes`].
#[cfg(target_arch = "x86_64")]
unsafe fn stream_unfenced_sse2(src: *const u8, dst: *mut u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    stream_body!(src, dst, len, __m128i, _mm_loadu_si128, _mm_stream_si128);
}

#[cfg(test)]
mod tests {

    /// Every copy routine (the one [`copy_bytes`] picks, and on x86-64 each streaming variant
    /// this CPU has) at sizes around the cutoffs and at every alignment mix.
    #[test]
    fn copies_are_bit_exact_at_every_size_and_alignment() {
        type Routine = unsafe fn(*const u8, *mut u8, usize);
        let mut routines: Vec<(&str, Routine)> = vec![("copy_bytes", copy_bytes)];
        #[cfg(target_arch = "x86_64")]
        {
            routines.push(("sse2", stream_unfenced_sse2));
            if std::is_x86_feature_detected!("avx2") {
                routines.push(("avx2", stream_unfenced_avx2));
            }
        }
        let src: Vec<u8> = (0..300_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for (name, copy) in routines {
            for len in [
                0,
                1,
                63,
                64,
                127,
                129,
                STREAM_MIN_BYTES - 1,
                STREAM_MIN_BYTES,
                STREAM_MIN_BYTES + 1,
                STREAM_MIN_BYTES + 17,
                200_003,
            ] {
                for (so, d_o) in [(0, 0), (1, 0), (0, 3), (5, 11), (16, 16), (17, 9), (32, 48)] {
                    let mut dst = vec![0xAAu8; len + 64];
                    // SAFETY: both ranges are inside their vectors and distinct allocations;
                    // the AVX2 routine is listed only where the CPU has AVX2.
                    unsafe { copy(src.as_ptr().add(so), dst.as_mut_ptr().add(d_o), len) };
                    #[cfg(target_arch = "x86_64")]
                    fence_streams();
                    assert_eq!(
                        &dst[d_o..d_o + len],
                        &src[so..so + len],
                        "{name}: len {len}, offsets {so}/{d_o}"
                    );
                    assert!(
                        dst[..d_o].iter().chain(&dst[d_o + len..]).all(|&b| b == 0xAA),
                        "{name}: len {len}: wrote outside"
                    );
                }
            }
        }
    }
    use super::*;

    /// Many pieces of every length and both alignments land where they are asked to and
    /// nowhere else, streamed (a large piece brings the copy to the streaming size) or not
    /// (the short pieces alone, or `Memcpy`); a bad range fails the call; a range overlapping
    /// itself in one region is refused.
    #[test]
    fn copy_ranges_places_every_piece_and_checks_each_range() {
        const N: usize = 1 << 18;
        let src = ShmRegion::create_anonymous("src", N, Prefault::Touch).unwrap();
        let dst = ShmRegion::create_anonymous("dst", N, Prefault::Touch).unwrap();
        let data: Vec<u8> = (0..N as u32).map(|i| (i * 31 + 7) as u8).collect();
        src.write(0, &data).unwrap();
        // (src offset, dst offset, len): lengths 1..300 at odd and aligned offsets, apart.
        let short: Vec<(usize, usize, usize)> = (1..300usize)
            .map(|len| (len * 97 % 5000, 200 * len + (len % 3) * 5, len))
            .collect();
        let mut long = short.clone();
        long.push((70_001, 70_000, STREAM_MIN_BYTES + 3));
        for (ranges, kind) in [
            (&short, CopyKind::Streaming),
            (&long, CopyKind::Streaming),
            (&long, CopyKind::Memcpy),
        ] {
            dst.fill(0, N, 0xAA).unwrap();
            ShmRegion::copy_ranges(kind, &src, &dst, ranges.iter().copied()).unwrap();
            let mut out = vec![0u8; N];
            dst.read(0, &mut out).unwrap();
            let mut expect = vec![0xAAu8; N];
            for &(s, d, len) in ranges {
                expect[d..d + len].copy_from_slice(&data[s..s + len]);
            }
            assert!(out == expect, "{} ranges, {kind:?}", ranges.len());
        }
        let bad = [(0, 0, 64), (N - 36, 0, 64)];
        assert!(matches!(
            ShmRegion::copy_ranges(CopyKind::Streaming, &src, &dst, bad),
            Err(StoreError::OutOfBounds { offset, .. }) if offset == N - 36
        ));
        assert!(ShmRegion::copy_ranges(CopyKind::Streaming, &src, &src, [(0, 32, 64)]).is_err());
        ShmRegion::copy_ranges(CopyKind::Streaming, &src, &src, [(0, 64, 64)]).unwrap();
    }

    #[test]
    fn anonymous_round_trip_and_bounds() {
        let r = ShmRegion::create_anonymous("t", 10_000, Prefault::Touch).unwrap();
        r.write(100, b"hello").unwrap();
        let mut out = [0u8; 5];
        r.read(100, &mut out).unwrap();
        assert_eq!(&out, b"hello");
        assert!(matches!(
            r.write(9_998, b"abc"),
            Err(StoreError::OutOfBounds {
                offset: 9_998,
                len: 3,
                region_bytes: 10_000,
                ..
            })
        ));
        assert!(r.read(usize::MAX, &mut out).is_err());
        assert!(ShmRegion::create_anonymous("z", 0, Prefault::Lazy).is_err());
    }

    #[test]
    fn file_is_shared_between_mappings_and_checked_on_open() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pool");
        let a = ShmRegion::create_file(&path, 8192, Prefault::Touch).unwrap();
        assert!(matches!(
            ShmRegion::create_file(&path, 8192, Prefault::Lazy),
            Err(StoreError::AlreadyExists { .. })
        ));
        let b = ShmRegion::open_file(&path, 8192, Prefault::Populate).unwrap();
        a.write(4000, &[7u8; 200]).unwrap();
        assert_eq!(b.xxh3_64(4000, 200).unwrap(), kvtier_core::xxh3_64(&[7u8; 200]));
        ShmRegion::copy(&b, 4000, &a, 0, 200).unwrap();
        assert_eq!(a.xxh3_64(0, 200).unwrap(), b.xxh3_64(4000, 200).unwrap());
        assert!(ShmRegion::copy(&a, 0, &a, 100, 200).is_err(), "overlap refused");
        assert!(matches!(
            ShmRegion::open_file(&path, 4096, Prefault::Lazy),
            Err(StoreError::WrongSize {
                expected_bytes: 4096,
                actual_bytes: 8192,
                ..
            })
        ));
        assert!(matches!(
            ShmRegion::open_file(&dir.path().join("nope"), 4096, Prefault::Lazy),
            Err(StoreError::FileNotFound { .. })
        ));
        drop(b);
        drop(a);
        assert!(!path.exists(), "the creator removes its file");
    }

    fn unusable(e: StoreError, what: &str) {
        assert!(
            matches!(&e, StoreError::RegionUnusable { reason, .. } if reason.contains(what)),
            "{e}"
        );
    }

    #[test]
    fn a_file_truncated_under_the_mapping_is_an_error_not_a_crash() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pool");
        let len = 64 << 10;
        let owner = ShmRegion::create_file(&path, len, Prefault::Touch).unwrap();
        let mapped = ShmRegion::open_file(&path, len, Prefault::Populate).unwrap();
        let other = ShmRegion::create_anonymous("other", len, Prefault::Touch).unwrap();
        other.fill(0, len, 0x5a).unwrap();
        mapped.write(0, &[1u8; 4096]).unwrap();
        mapped.check_backing().unwrap();
        // The owner shrinks its file to one page: every page past it now raises SIGBUS.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(4096)
            .unwrap();
        unusable(mapped.check_backing().unwrap_err(), "shrank to 4096");
        // A copy that touches the lost pages faults; the fault is caught and reported.
        unusable(
            ShmRegion::copy(&other, 0, &mapped, 0, len).unwrap_err(),
            "bus error",
        );
        assert!(mapped.faulted());
        // From then on every access fails, reads and writes alike, and stays failed.
        let mut buf = [0u8; 16];
        unusable(mapped.read(0, &mut buf).unwrap_err(), "bus error");
        unusable(mapped.write(0, &buf).unwrap_err(), "bus error");
        unusable(mapped.xxh3_64(0, 16).unwrap_err(), "bus error");
        // (A copy out of it fails too, after writing what it read: junk, into a scratch region.)
        let scratch = ShmRegion::create_anonymous("scratch", 4096, Prefault::Touch).unwrap();
        unusable(
            ShmRegion::copy(&mapped, 0, &scratch, 0, 16).unwrap_err(),
            "bus error",
        );
        // Other regions, and the other mapping of the same file, are not affected.
        assert!(!other.faulted() && !owner.faulted());
        assert_eq!(
            other.xxh3_64(0, len).unwrap(),
            kvtier_core::xxh3_64(&vec![0x5a; len])
        );
        // The page still in the file holds its old bytes or the copied ones, nothing else
        // (whether the copy reached it before faulting depends on the copy's order: streaming
        // copies go front to back, glibc's memcpy may write the tail first).
        owner.read(0, &mut buf).unwrap();
        assert!(buf == [0x5a; 16] || buf == [1; 16], "{buf:?}");
        // A fault in a region that was faulted and dropped is not blamed on the next one.
        drop(mapped);
        let fresh = ShmRegion::create_anonymous("fresh", len, Prefault::Touch).unwrap();
        assert!(!fresh.faulted());
    }

    #[test]
    fn a_replaced_or_unlinked_file_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pool");
        let mut owner = ShmRegion::create_file(&path, 8192, Prefault::Touch).unwrap();
        owner.keep_file();
        let mapped = ShmRegion::open_file(&path, 8192, Prefault::Populate).unwrap();
        std::fs::remove_file(&path).unwrap();
        unusable(mapped.check_backing().unwrap_err(), "unlinked");
        // The same path, the same size, another file.
        let _new = ShmRegion::create_file(&path, 8192, Prefault::Touch).unwrap();
        unusable(mapped.check_backing().unwrap_err(), "replaced");
        // The bytes themselves are still mapped: only the identity check refuses them.
        assert!(!mapped.faulted());
        mapped.write(0, b"x").unwrap();
    }
}
