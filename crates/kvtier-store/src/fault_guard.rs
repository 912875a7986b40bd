//! Turning a bus error in memory another process controls into an error of one region.
//!
//! A `MAP_SHARED` mapping of a file is only as long as the file: when the file's owner (an
//! engine with its pool file, anyone with write access to the arena's file) truncates it, the
//! next access past the new end raises SIGBUS, which would kill the sidecar and every engine it
//! serves. Every shared mapping is registered here. A process-wide SIGBUS handler that finds the
//! faulting address inside a registered mapping marks that mapping faulted, replaces the whole
//! mapping with anonymous memory (so the copy that faulted finishes, on bytes nobody will use)
//! and returns. [`crate::ShmRegion`] checks the mark after every access and reports the region
//! as unusable from then on. A fault anywhere else goes to the handler that was there before
//! (the Rust runtime's stack-overflow report, or the default: the process dies as it would have).
//!
//! Cost on the copy path: one atomic load per access. Registering and dropping a mapping is a
//! scan of a fixed table of [`MAX_GUARDED`] entries.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Shared mappings that can be guarded at once; more are mapped unguarded (and logged).
pub const MAX_GUARDED: usize = 1024;

/// Marks an entry taken but not yet filled in.
const RESERVED: usize = usize::MAX;

struct Entry {
    /// Start address of the mapping; 0 when the entry is free.
    start: AtomicUsize,
    len: AtomicUsize,
    faulted: AtomicBool,
}

impl Entry {
    const fn new() -> Self {
        Self {
            start: AtomicUsize::new(0),
            len: AtomicUsize::new(0),
            faulted: AtomicBool::new(false),
        }
    }
}

static TABLE: [Entry; MAX_GUARDED] = [const { Entry::new() }; MAX_GUARDED];

/// The SIGBUS action found when ours was installed, to hand other faults to.
struct Previous(libc::sigaction);
// SAFETY: a sigaction is plain data (a handler address, flags, a signal mask); it is written
// once before any handler can read it and never changed.
unsafe impl Sync for Previous {}
// SAFETY: as above.
unsafe impl Send for Previous {}

static PREVIOUS: OnceLock<Result<Previous, i32>> = OnceLock::new();

/// One registered mapping. Dropping it unregisters the mapping; it must be dropped before the
/// mapping is unmapped.
#[derive(Debug)]
pub(crate) struct FaultGuard {
    index: usize,
}

impl FaultGuard {
    /// Registers `len` bytes at `start` (a live shared mapping), installing the SIGBUS handler
    /// on first use. `None` when the table is full or the handler could not be installed (the
    /// mapping then works as before, unguarded).
    pub(crate) fn register(start: *mut u8, len: usize, name: &str) -> Option<Self> {
        if let Err(errno) = PREVIOUS.get_or_init(install) {
            tracing::warn!(
                region = name,
                errno,
                "cannot install the bus-error handler; mapping unguarded"
            );
            return None;
        }
        let start = start as usize;
        for (index, e) in TABLE.iter().enumerate() {
            if e.start
                .compare_exchange(0, RESERVED, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                e.len.store(len, Ordering::Relaxed);
                e.faulted.store(false, Ordering::Relaxed);
                e.start.store(start, Ordering::Release);
                return Some(Self { index });
            }
        }
        tracing::warn!(
            region = name,
            max = MAX_GUARDED,
            "too many shared mappings to guard; mapping unguarded"
        );
        None
    }

    /// Whether an access to the mapping faulted (its file shrank under it). Once true, the
    /// mapping holds anonymous memory and stays faulted.
    pub(crate) fn faulted(&self) -> bool {
        TABLE[self.index].faulted.load(Ordering::Acquire)
    }
}

impl Drop for FaultGuard {
    fn drop(&mut self) {
        TABLE[self.index].start.store(0, Ordering::Release);
    }
}

fn install() -> Result<Previous, i32> {
    // SAFETY: a zeroed sigaction is a valid value to fill in; sigemptyset initialises the mask;
    // sigaction reads `action` and writes the old action into `previous`, both live locals.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_sigbus as *const () as libc::sighandler_t;
        action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        libc::sigemptyset(&mut action.sa_mask);
        let mut previous: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(libc::SIGBUS, &action, &mut previous) != 0 {
            return Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0));
        }
        Ok(Previous(previous))
    }
}

/// The SIGBUS handler. Only async-signal-safe work: atomics, `mmap`, `sigaction`.
extern "C" fn on_sigbus(_signal: libc::c_int, info: *mut libc::siginfo_t, _context: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for a SA_SIGINFO handler; for a fault it raised
    // (si_code > 0, not a signal sent by a process) si_addr is the faulting address.
    let addr = unsafe {
        if (*info).si_code > 0 {
            (*info).si_addr() as usize
        } else {
            0
        }
    };
    for e in TABLE.iter().filter(|_| addr != 0) {
        let start = e.start.load(Ordering::Acquire);
        if start == 0 || start == RESERVED {
            continue;
        }
        let len = e.len.load(Ordering::Relaxed);
        if addr < start || addr - start >= len {
            continue;
        }
        // Marked before the remap, so a thread that reads the anonymous bytes sees the mark
        // when it checks after its copy.
        e.faulted.store(true, Ordering::SeqCst);
        // SAFETY: [start, start+len) is a live mapping registered by its owner, which cannot
        // unmap it while an access to it is faulting; replacing it with anonymous memory of the
        // same size keeps every pointer into it valid.
        let p = unsafe {
            libc::mmap(
                start as *mut libc::c_void,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p != libc::MAP_FAILED {
            return; // the faulting access is retried, now on anonymous memory
        }
        break;
    }
    // Not ours (or the remap failed): put the previous action back and return, so the access
    // faults again and is handled as it would have been without us.
    if let Some(Ok(previous)) = PREVIOUS.get() {
        // SAFETY: restoring an action the kernel gave us.
        unsafe { libc::sigaction(libc::SIGBUS, &previous.0, std::ptr::null_mut()) };
    }
}
