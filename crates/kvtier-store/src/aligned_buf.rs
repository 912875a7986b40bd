//! Heap buffers aligned for O_DIRECT I/O (4 KiB address, length a multiple of 4 KiB).

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// Alignment (and length granularity) of direct I/O buffers.
pub(crate) const IO_ALIGN: usize = 4096;

/// A zeroed heap buffer whose address is 4 KiB aligned.
pub(crate) struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer owns its allocation exclusively; it is plain bytes.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only reads plain bytes.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes rounded up to 4 KiB (at least 4 KiB).
    pub(crate) fn new(len: usize) -> Self {
        let len = len.max(1).next_multiple_of(IO_ALIGN);
        let layout = Layout::from_size_align(len, IO_ALIGN).expect("4 KiB alignment is a valid layout");
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Self { ptr, len }
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is a live allocation of len initialized (zeroed) bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.len, IO_ALIGN).expect("layout was valid at allocation");
        // SAFETY: ptr was allocated with exactly this layout and is freed once.
        unsafe { dealloc(self.ptr.as_ptr(), layout) };
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_zeroed() {
        let mut b = AlignedBuf::new(5000);
        assert_eq!(b.len(), 8192);
        assert_eq!(b.as_ptr() as usize % IO_ALIGN, 0);
        assert!(b.iter().all(|&x| x == 0));
        b[8191] = 7;
        assert_eq!(b[8191], 7);
    }
}
