//! The process-memory pool: an engine's KV in its own address space (a numpy array, a torch CPU
//! tensor: memory no other process maps), which the sidecar copies to and from with Linux's
//! cross-memory attach (`process_vm_writev` / `process_vm_readv`). The kernel copies between the
//! sidecar's host pages and the engine's pages (short pieces by way of a scratch buffer in the
//! engine's order): no shared file, and nothing for the engine to copy.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use kvtier_core::{KvGeometry, LayoutError, LayoutKind, PoolLayout, SlotPiece};
use kvtier_store::ShmRegion;

use crate::{CopyDirection, CopyTicket, DevicePool, SlotCopy, TransferError};

/// Iovecs per system call (Linux's `IOV_MAX`).
const IOV_BATCH: usize = 1024;

/// Pieces shorter than this are gathered into (loads) or scattered out of (stores) a scratch
/// buffer in the engine's order, so that the kernel sees one long local run instead of many
/// short ones: it spends ~0.2 µs per iovec segment, which made 128-byte pieces (an engine
/// layout that interleaves K and V per token and head) copy at ~1 GiB/s, against ~10 GiB/s
/// for a user-space copy of the same pieces.
const GATHER_BELOW: usize = 16 << 10;
/// The scratch buffer of each transfer thread.
const SCRATCH_BYTES: usize = 4 << 20;

thread_local! {
    static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A submit's copies in progress: the batch for the next system call, and the scratch buffer
/// short pieces go through (`used` bytes of it taken; for a store, where each taken range goes
/// once the batch has run).
struct Moves<'a> {
    batch: Batch,
    scratch: &'a mut Vec<u8>,
    used: usize,
    scatter: Vec<(usize, usize, usize)>,
}

impl Moves<'_> {
    /// Puts a piece whose host side is `len` bytes at `page` at byte `at` of the scratch buffer:
    /// a load copies the host bytes in now, a store copies them out after the batch ran.
    /// Returns the scratch address.
    fn place(&mut self, to_process: bool, at: usize, page: usize, len: usize) -> usize {
        assert!(at + len <= self.scratch.len());
        // SAFETY: `at + len` is inside the scratch buffer (asserted).
        let scratch = unsafe { self.scratch.as_mut_ptr().add(at) };
        if to_process {
            // SAFETY: `page` is a checked range of the host region (dma_address) this load reads.
            unsafe { std::ptr::copy_nonoverlapping(page as *const u8, scratch, len) };
        } else {
            self.scatter.push((at, page, len));
        }
        scratch as usize
    }
}

/// One allocation of the engine's: `bytes` bytes at `address` in its address space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessBuffer {
    /// Where it starts.
    pub address: u64,
    /// Its length.
    pub bytes: u64,
}

/// A device pool in another process's memory, reached by pid. The pid is held by a pidfd, which
/// is checked before and after every batch of copies: a process that exited fails the batch
/// (its pid could be reused only in the microseconds between a check and a copy).
///
/// The sidecar needs ptrace-level access to the process: the same user (or `CAP_SYS_PTRACE`),
/// and where Yama's `ptrace_scope` is 1, the process's leave (`prctl(PR_SET_PTRACER, sidecar
/// pid)`). [`ProcessDevicePool::open`] reads a byte at each end of every buffer, so a pool it
/// returns could be reached then.
#[derive(Debug)]
pub struct ProcessDevicePool {
    pid: libc::pid_t,
    pidfd: OwnedFd,
    buffers: Vec<ProcessBuffer>,
    geometry: KvGeometry,
    num_slots: u32,
    layout: PoolLayout,
}

/// One system call's worth of copies: the local and the remote side each as iovecs, pieces that
/// continue the previous one on a side merged into it. An engine layout that interleaves K and V
/// per token and head is one run of the engine's memory per block-layer, scattered over the
/// host page: one remote iovec (the kernel pins the engine's pages per remote iovec) against
/// many local ones.
struct Batch {
    local: Vec<libc::iovec>,
    remote: Vec<libc::iovec>,
}

impl ProcessDevicePool {
    /// Opens `num_slots` slots of `geometry` in `buffers` of process `pid`, laid out as `layout`
    /// says (absent: kvtier's `[layer][slot]` order from the start of buffer 0).
    ///
    /// # Errors
    /// [`TransferError::NoSlots`]; [`TransferError::Layout`] for buffers or a layout that do
    /// not fit; [`TransferError::PoolUnusable`] for a process that has exited or buffers it
    /// has not mapped; [`TransferError::DeviceUnavailable`] where the sidecar may not reach
    /// the process's memory (saying what would allow it).
    pub fn open(
        pid: u32,
        buffers: Vec<ProcessBuffer>,
        geometry: KvGeometry,
        num_slots: u32,
        layout: Option<PoolLayout>,
    ) -> Result<Self, TransferError> {
        if num_slots == 0 {
            return Err(TransferError::NoSlots);
        }
        let field = |i: usize, reason: String| LayoutError {
            field: format!("process.buffers[{i}]"),
            reason,
        };
        if buffers.is_empty() {
            return Err(LayoutError {
                field: "process.buffers".into(),
                reason: "no buffers: give the address and size of each allocation the layout names".into(),
            }
            .into());
        }
        for (i, b) in buffers.iter().enumerate() {
            if b.address == 0 || b.bytes == 0 {
                return Err(field(
                    i,
                    format!(
                        "address {:#x}, {} bytes: give a real allocation",
                        b.address, b.bytes
                    ),
                )
                .into());
            }
            if b.address
                .checked_add(b.bytes)
                .is_none_or(|end| end > isize::MAX as u64)
            {
                return Err(field(
                    i,
                    format!("{:#x} + {} bytes wraps the address space", b.address, b.bytes),
                )
                .into());
            }
        }
        // Buffers that share memory would let planes of different buffers overlap, which the
        // layout's check (per buffer) cannot see.
        let mut by_address: Vec<usize> = (0..buffers.len()).collect();
        by_address.sort_unstable_by_key(|&i| buffers[i].address);
        for w in by_address.windows(2) {
            let (a, b) = (&buffers[w[0]], &buffers[w[1]]);
            if b.address < a.address + a.bytes {
                return Err(field(
                    w[1].max(w[0]),
                    format!(
                        "overlaps process.buffers[{}]: give each allocation once",
                        w[1].min(w[0])
                    ),
                )
                .into());
            }
        }
        let pid_t = libc::pid_t::try_from(pid)
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| TransferError::DeviceUnavailable {
                device: "process",
                reason: format!("pid {pid} names no process"),
            })?;
        let layout =
            layout.unwrap_or_else(|| PoolLayout::of_kind(LayoutKind::Kvtier, &geometry, num_slots, 0));
        let sizes: Vec<u64> = buffers.iter().map(|b| b.bytes).collect();
        layout.validate(&geometry, num_slots, &sizes)?;
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid_t, 0) };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                Some(libc::ESRCH) => gone(pid_t),
                Some(libc::ENOSYS) => TransferError::DeviceUnavailable {
                    device: "process",
                    reason: "this kernel has no pidfd_open (Linux 5.3 or newer is needed)".into(),
                },
                _ => device_error("pidfd_open", &e),
            });
        }
        // SAFETY: `fd` is a descriptor pidfd_open just returned, owned by nobody else.
        let pidfd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        let pool = Self {
            pid: pid_t,
            pidfd,
            buffers,
            geometry,
            num_slots,
            layout,
        };
        pool.probe()?;
        Ok(pool)
    }

    /// The process the pool is in.
    pub fn pid(&self) -> u32 {
        self.pid as u32
    }

    /// Reads the first and last byte of every buffer: EPERM, ESRCH or EFAULT here is the
    /// registration's error, not the first load's.
    fn probe(&self) -> Result<(), TransferError> {
        let mut bytes = vec![0u8; 2 * self.buffers.len()];
        let mut batch = Batch::new();
        for (i, b) in self.buffers.iter().enumerate() {
            for (j, at) in [b.address, b.address + b.bytes - 1].into_iter().enumerate() {
                let local = bytes[2 * i + j..].as_mut_ptr() as usize;
                if batch.push(local, at as usize, 1) {
                    self.run(false, std::mem::replace(&mut batch, Batch::new()))?;
                }
            }
        }
        self.run(false, batch)
    }

    /// Whether the process has exited (its pidfd is readable then).
    fn check_alive(&self) -> Result<(), TransferError> {
        let mut p = libc::pollfd {
            fd: self.pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd, a zero timeout.
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        if n > 0 && p.revents != 0 {
            return Err(gone(self.pid));
        }
        Ok(())
    }

    fn remote_address(&self, p: &SlotPiece) -> usize {
        // The layout passed validate() against the buffers' sizes: nothing overflows.
        (self.buffers[p.buffer as usize].address + p.offset) as usize
    }

    /// Runs one batch to the end: a short count is retried from the byte it stopped at, so the
    /// error reported is the kernel's for the remote iovec there.
    fn run(&self, to_process: bool, mut b: Batch) -> Result<(), TransferError> {
        let (mut li, mut ri) = (0, 0);
        while ri < b.remote.len() {
            let (local, remote) = (&b.local[li..], &b.remote[ri..]);
            let copy = if to_process {
                libc::process_vm_writev
            } else {
                libc::process_vm_readv
            };
            // SAFETY: every local iovec lies in memory this process owns for the call (a host
            // region's checked range, the scratch buffer, or a buffer on the stack); the remote
            // ones are checked by the kernel against the other process's mappings.
            let n = unsafe {
                copy(
                    self.pid,
                    local.as_ptr(),
                    local.len() as _,
                    remote.as_ptr(),
                    remote.len() as _,
                    0,
                )
            };
            let at = remote[0].iov_base as u64;
            if n < 0 {
                return Err(self.copy_error(&std::io::Error::last_os_error(), at));
            }
            if n == 0 {
                return Err(self.copy_error(&std::io::Error::from_raw_os_error(libc::EFAULT), at));
            }
            advance(&mut b.local, &mut li, n as usize);
            advance(&mut b.remote, &mut ri, n as usize);
        }
        Ok(())
    }

    /// Runs the batch, then (a store) scatters what landed in the scratch buffer to the host
    /// pages; the scratch buffer is free again.
    fn flush(&self, to_process: bool, m: &mut Moves<'_>) -> Result<(), TransferError> {
        if m.batch.remote.is_empty() {
            return Ok(());
        }
        self.run(to_process, std::mem::replace(&mut m.batch, Batch::new()))?;
        // The process was alive when the batch began; still alive now, the bytes were its.
        self.check_alive()?;
        for (at, page, len) in m.scatter.drain(..) {
            // SAFETY: `at..at + len` is inside the scratch buffer, `page` a checked range of the
            // host region this store fills (dma_address), which no one else writes meanwhile.
            unsafe { std::ptr::copy_nonoverlapping(m.scratch.as_ptr().add(at), page as *mut u8, len) };
        }
        m.used = 0;
        Ok(())
    }

    fn copy_error(&self, e: &std::io::Error, address: u64) -> TransferError {
        match e.raw_os_error() {
            Some(libc::ESRCH) => gone(self.pid),
            Some(libc::EPERM) => TransferError::DeviceUnavailable {
                device: "process",
                reason: format!(
                    "the sidecar (pid {}) may not read or write process {}'s memory (EPERM): it needs \
                     the same user or CAP_SYS_PTRACE, and where /proc/sys/kernel/yama/ptrace_scope is 1 \
                     the process must allow it with prctl(PR_SET_PTRACER, {}); a shared-memory pool \
                     needs none of this",
                    std::process::id(),
                    self.pid,
                    std::process::id()
                ),
            },
            Some(libc::EFAULT) => {
                let buffer = self
                    .buffers
                    .iter()
                    .position(|b| (b.address..b.address + b.bytes).contains(&address))
                    .map_or(String::new(), |i| format!(" (buffer {i})"));
                TransferError::PoolUnusable {
                    pool: format!("process {}'s memory", self.pid),
                    reason: format!("bytes at {address:#x}{buffer} are {NOT_MAPPED}"),
                }
            }
            _ => device_error("process_vm_readv/process_vm_writev", e),
        }
    }
}

impl Batch {
    fn new() -> Self {
        Self {
            local: Vec::with_capacity(IOV_BATCH),
            remote: Vec::with_capacity(IOV_BATCH),
        }
    }

    /// Adds `len` bytes at `local` ↔ `remote`; true once a side holds [`IOV_BATCH`] iovecs
    /// (the batch must be run before the next push).
    fn push(&mut self, local: usize, remote: usize, len: usize) -> bool {
        merge(&mut self.local, local, len);
        merge(&mut self.remote, remote, len);
        self.local.len() == IOV_BATCH || self.remote.len() == IOV_BATCH
    }
}

/// Appends `len` bytes at `base` to `v`, into its last iovec where they continue it.
fn merge(v: &mut Vec<libc::iovec>, base: usize, len: usize) {
    if let Some(last) = v.last_mut()
        && last.iov_base as usize + last.iov_len == base
    {
        last.iov_len += len;
        return;
    }
    v.push(libc::iovec {
        iov_base: base as *mut libc::c_void,
        iov_len: len,
    });
}

/// Moves `*i` and `v[*i]` past `n` bytes the kernel copied.
fn advance(v: &mut [libc::iovec], i: &mut usize, mut n: usize) {
    while n > 0 {
        let len = v[*i].iov_len;
        if n >= len {
            n -= len;
            *i += 1;
        } else {
            v[*i].iov_base = v[*i].iov_base.cast::<u8>().wrapping_add(n).cast();
            v[*i].iov_len -= n;
            n = 0;
        }
    }
}

/// What an EFAULT of a copy says (blamed on the engine's side until the host region says
/// otherwise).
const NOT_MAPPED: &str = "not mapped in the process (freed?)";

fn is_fault(e: &TransferError) -> bool {
    matches!(e, TransferError::PoolUnusable { reason, .. } if reason.ends_with(NOT_MAPPED))
}

fn gone(pid: libc::pid_t) -> TransferError {
    TransferError::PoolUnusable {
        pool: format!("process {pid}'s memory"),
        reason: "the process has exited".into(),
    }
}

fn device_error(op: &str, e: &std::io::Error) -> TransferError {
    TransferError::Device {
        device: "process",
        op: op.into(),
        reason: e.to_string(),
    }
}

impl DevicePool for ProcessDevicePool {
    fn geometry(&self) -> &KvGeometry {
        &self.geometry
    }
    fn num_slots(&self) -> u32 {
        self.num_slots
    }
    fn layout(&self) -> &PoolLayout {
        &self.layout
    }
    fn device_kind(&self) -> &'static str {
        "process"
    }
    /// Copies the batch before returning, up to [`IOV_BATCH`] iovecs a side per system call
    /// (pieces that continue each other on a side are one iovec there: a run of slots of a
    /// block-major pool, a block-layer whose K and V interleave, is one on the engine's side).
    fn submit(
        &self,
        direction: CopyDirection,
        layer: u32,
        host: &ShmRegion,
        copies: &[SlotCopy],
    ) -> Result<CopyTicket, TransferError> {
        self.check_alive()?;
        let to_process = direction == CopyDirection::HostToDevice;
        let copied = SCRATCH.with_borrow_mut(|scratch| {
            if scratch.len() < SCRATCH_BYTES {
                scratch.resize(SCRATCH_BYTES, 0);
            }
            let mut moves = Moves {
                batch: Batch::new(),
                scratch,
                used: 0,
                scatter: Vec::new(),
            };
            // One block-layer's pieces as (remote, local, len), in the engine's address order: K
            // and V planes apart walk as K runs then V runs, so each plane's runs merge on the
            // remote side.
            let mut ordered: Vec<(usize, usize, usize)> = Vec::new();
            for c in copies {
                let (mut lo, mut hi, mut total) = (usize::MAX, 0, 0);
                for p in self.slot_pieces(c.slot, layer)? {
                    // Past the end (even wrapping) is the host region's OutOfBounds.
                    let page = c.host_offset.saturating_add(p.at);
                    let remote = self.remote_address(&p);
                    ordered.push((remote, host.dma_address(page, p.len)? as usize, p.len));
                    (lo, hi, total) = (lo.min(remote), hi.max(remote + p.len), total + p.len);
                }
                let small = ordered.len() > 1 && total / ordered.len() < GATHER_BELOW;
                if small && hi - lo == total && total <= SCRATCH_BYTES {
                    // Short pieces that tile one range of the engine's memory (K and V
                    // interleaved per token and head): laid out in the scratch buffer as they lie
                    // there, one iovec a side.
                    if moves.used + total > SCRATCH_BYTES {
                        self.flush(to_process, &mut moves)?;
                    }
                    let base = moves.used;
                    for (remote, local, len) in ordered.drain(..) {
                        moves.place(to_process, base + remote - lo, local, len);
                    }
                    moves.used += total;
                    let at = moves.scratch.as_ptr() as usize + base;
                    if moves.batch.push(at, lo, total) {
                        self.flush(to_process, &mut moves)?;
                    }
                    continue;
                }
                if !ordered.is_sorted_by_key(|o| o.0) {
                    ordered.sort_unstable_by_key(|o| o.0);
                }
                for (remote, local, len) in ordered.drain(..) {
                    let local = if len < GATHER_BELOW {
                        if moves.used + len > SCRATCH_BYTES {
                            self.flush(to_process, &mut moves)?;
                        }
                        let at = moves.place(to_process, moves.used, local, len);
                        moves.used += len;
                        at
                    } else {
                        local
                    };
                    if moves.batch.push(local, remote, len) {
                        self.flush(to_process, &mut moves)?;
                    }
                }
            }
            self.flush(to_process, &mut moves)?;
            Ok(CopyTicket::done())
        });
        // A fault of the host pages is theirs, not the engine's: the gather and scatter copies
        // are caught by the region's guard, the kernel's copies come back as EFAULT.
        if host.faulted() || copied.as_ref().is_err_and(is_fault) {
            host.check_backing()?;
            if host.faulted() {
                return Err(kvtier_store::StoreError::RegionUnusable {
                    region: host.name().to_owned(),
                    reason: "a bus error was caught copying its pages".into(),
                }
                .into());
            }
        }
        copied
    }
    fn check_usable(&self) -> Result<(), TransferError> {
        self.check_alive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier_core::Dtype;
    use kvtier_store::Prefault;

    fn geo() -> KvGeometry {
        KvGeometry::new(3, 2, 8, Dtype::F16, 4).unwrap()
    }

    fn own(region: &ShmRegion) -> Vec<ProcessBuffer> {
        vec![ProcessBuffer {
            address: region.dma_address(0, region.len()).unwrap() as u64,
            bytes: region.len() as u64,
        }]
    }

    #[test]
    fn loads_land_in_the_process_and_stores_read_it() {
        let g = geo();
        let bl = g.bytes_per_block_layer();
        let engine = ShmRegion::create_private("engine", 3 * 5 * bl, Prefault::Populate).unwrap();
        let pool = ProcessDevicePool::open(std::process::id(), own(&engine), g, 5, None).unwrap();
        let host = ShmRegion::create_private("host", 2 * bl, Prefault::Populate).unwrap();
        let kv: Vec<u8> = (0..2 * bl).map(|i| (i * 7) as u8).collect();
        host.write(0, &kv).unwrap();
        let copies = [
            SlotCopy {
                slot: 4,
                host_offset: 0,
            },
            SlotCopy {
                slot: 1,
                host_offset: bl,
            },
        ];
        pool.submit(CopyDirection::HostToDevice, 2, &host, &copies)
            .unwrap()
            .wait()
            .unwrap();
        let mut out = vec![0u8; bl];
        engine.read((2 * 5 + 4) * bl, &mut out).unwrap();
        assert_eq!(out, kv[..bl]);
        engine.read((2 * 5 + 1) * bl, &mut out).unwrap();
        assert_eq!(out, kv[bl..]);
        let back = ShmRegion::create_private("back", 2 * bl, Prefault::Populate).unwrap();
        pool.submit(CopyDirection::DeviceToHost, 2, &back, &copies)
            .unwrap()
            .wait()
            .unwrap();
        let mut got = vec![0u8; 2 * bl];
        back.read(0, &mut got).unwrap();
        assert_eq!(got, kv);
        assert_eq!(pool.device_kind(), "process");
        pool.check_usable().unwrap();
    }

    #[test]
    fn bad_registrations_are_named() {
        let g = geo();
        let engine =
            ShmRegion::create_private("engine", 3 * 5 * g.bytes_per_block_layer(), Prefault::Populate)
                .unwrap();
        let me = std::process::id();
        let e = ProcessDevicePool::open(me, own(&engine), g, 0, None).unwrap_err();
        assert!(matches!(e, TransferError::NoSlots), "{e}");
        let e = ProcessDevicePool::open(me, vec![], g, 5, None).unwrap_err();
        assert!(e.to_string().contains("process.buffers"), "{e}");
        // One slot too many for the buffer.
        let e = ProcessDevicePool::open(me, own(&engine), g, 6, None).unwrap_err();
        assert!(matches!(e, TransferError::Layout(_)), "{e}");
        let e = ProcessDevicePool::open(
            me,
            vec![ProcessBuffer {
                address: u64::MAX - 8,
                bytes: 64,
            }],
            g,
            1,
            None,
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("process.buffers[0]") && e.to_string().contains("wraps"),
            "{e}"
        );
        // Two buffers over the same memory: planes in different buffers could overlap, which
        // the layout's per-buffer check cannot see (a load would then write scratch bytes the
        // pieces do not cover).
        let mut twice = own(&engine);
        twice.push(ProcessBuffer {
            address: twice[0].address + 64,
            bytes: 256,
        });
        let e = ProcessDevicePool::open(me, twice, g, 5, None).unwrap_err();
        assert!(
            e.to_string().contains("process.buffers[1]")
                && e.to_string().contains("overlaps process.buffers[0]"),
            "{e}"
        );
        // Memory the process cannot give: made inaccessible, as freed memory is (but kept
        // reserved, so that no other test's mapping lands there).
        let gone_region =
            ShmRegion::create_private("gone", 3 * 5 * g.bytes_per_block_layer(), Prefault::Populate).unwrap();
        take_away(&gone_region);
        let e = ProcessDevicePool::open(me, own(&gone_region), g, 5, None).unwrap_err();
        assert!(
            matches!(e, TransferError::PoolUnusable { .. }) && e.to_string().contains("not mapped"),
            "{e}"
        );
    }

    /// Pieces that continue each other merge on their side only; a short count moves each side
    /// past what was copied, inside an iovec too.
    #[test]
    fn batches_merge_runs_and_resume_mid_iovec() {
        let mut b = Batch::new();
        // Local: K run at 0 and V run at 1000 (a host page's halves); remote: one K‖V row.
        assert!(!b.push(0x1_0000, 0x9_0000, 64));
        assert!(!b.push(0x1_0000 + 1000, 0x9_0000 + 64, 64));
        assert!(!b.push(0x1_0000 + 64, 0x9_0000 + 128, 64));
        assert_eq!((b.local.len(), b.remote.len()), (3, 1));
        assert_eq!(b.remote[0].iov_len, 192);
        let (mut li, mut ri) = (0, 0);
        advance(&mut b.local, &mut li, 100);
        advance(&mut b.remote, &mut ri, 100);
        assert_eq!(
            (li, b.local[1].iov_base as usize, b.local[1].iov_len),
            (1, 0x1_0000 + 1000 + 36, 28)
        );
        assert_eq!(
            (ri, b.remote[0].iov_base as usize, b.remote[0].iov_len),
            (0, 0x9_0000 + 100, 92)
        );
        advance(&mut b.local, &mut li, 92);
        assert_eq!(li, 3);
        let mut full = Batch::new();
        let filled = (0..IOV_BATCH)
            .map(|i| full.push(i * 128, 0x9_0000 + i * 64, 64))
            .collect::<Vec<_>>();
        assert_eq!(
            filled.iter().filter(|f| **f).count(),
            1,
            "full once, at the last push"
        );
        assert!(filled[IOV_BATCH - 1]);
    }

    /// Makes `region` inaccessible (PROT_NONE): the kernel then treats it as it treats freed
    /// memory (EFAULT), while the addresses stay reserved for it.
    fn take_away(region: &ShmRegion) {
        // SAFETY: the range is the region's own mapping; the tests read it no more.
        let r = unsafe {
            libc::mprotect(
                region.dma_address(0, region.len()).unwrap().cast(),
                region.len(),
                libc::PROT_NONE,
            )
        };
        assert_eq!(r, 0);
    }

    /// Memory freed under a registered pool fails the copy (PoolUnusable, naming the address),
    /// never the sidecar.
    #[test]
    fn memory_freed_under_the_pool_fails_the_copy() {
        let g = geo();
        let bl = g.bytes_per_block_layer();
        let engine = ShmRegion::create_private("engine", 3 * 5 * bl, Prefault::Populate).unwrap();
        let pool = ProcessDevicePool::open(std::process::id(), own(&engine), g, 5, None).unwrap();
        let host = ShmRegion::create_private("host", bl, Prefault::Populate).unwrap();
        take_away(&engine);
        let copies = [SlotCopy {
            slot: 0,
            host_offset: 0,
        }];
        for d in [CopyDirection::HostToDevice, CopyDirection::DeviceToHost] {
            let e = pool.submit(d, 0, &host, &copies).unwrap_err();
            assert!(
                matches!(e, TransferError::PoolUnusable { .. }) && e.to_string().contains("not mapped"),
                "{e}"
            );
        }
    }

    /// A pool in a process that exits is unusable from then on (its pidfd says so), even if
    /// the pid is handed to a new process.
    #[test]
    fn a_process_that_exits_leaves_its_pool_unusable() {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        // A writable mapping of the child's (its stack), read off /proc.
        let maps = std::fs::read_to_string(format!("/proc/{}/maps", child.id())).unwrap();
        let (start, end) = maps
            .lines()
            .find(|l| l.ends_with("[stack]"))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|r| r.split_once('-'))
            .map(|(a, b)| {
                (
                    u64::from_str_radix(a, 16).unwrap(),
                    u64::from_str_radix(b, 16).unwrap(),
                )
            })
            .unwrap();
        let g = geo();
        let slots = ((end - start) / (3 * g.bytes_per_block_layer() as u64)).min(4) as u32;
        let buffers = vec![ProcessBuffer {
            address: start,
            bytes: end - start,
        }];
        let pool = ProcessDevicePool::open(child.id(), buffers, g, slots, None).unwrap();
        assert_eq!(pool.pid(), child.id());
        pool.check_usable().unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        let e = pool.check_usable().unwrap_err();
        assert!(e.to_string().contains("exited"), "{e}");
        let host = ShmRegion::create_private("host", g.bytes_per_block_layer(), Prefault::Populate).unwrap();
        let e = pool
            .submit(
                CopyDirection::HostToDevice,
                0,
                &host,
                &[SlotCopy {
                    slot: 0,
                    host_offset: 0,
                }],
            )
            .unwrap_err();
        assert!(e.to_string().contains("exited"), "{e}");
    }
}
