//! The reference a CUDA pool's copies are measured against: one large `cuMemcpyAsync` from
//! page-locked host memory to device memory and back, and both at once on two streams, on
//! the same GPU in the same run (seed 003's duplex measurement).

use std::time::Instant;

use cudarc::driver::sys;
use kvtier_transfer::TransferError;

use crate::driver::{CudaContext, Stream, check};

/// GiB/s of one large pinned copy each way, and of both ways at once (bytes of both
/// directions over the wall time).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PinnedBaselines {
    /// Host to device.
    pub h2d_gib_s: f64,
    /// Device to host.
    pub d2h_gib_s: f64,
    /// Both at once.
    pub duplex_gib_s: f64,
}

/// Page-locked host memory from `cuMemHostAlloc`, freed on drop.
struct PinnedBuffer(*mut std::ffi::c_void);

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc, no copy pending (streams were synchronized).
        let _ = unsafe { sys::cuMemFreeHost(self.0) };
    }
}

/// Device memory from `cuMemAlloc`, freed on drop.
struct DeviceBuffer(u64);

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemAlloc, no copy pending.
        let _ = unsafe { sys::cuMemFree_v2(self.0) };
    }
}

/// Measures [`PinnedBaselines`] on GPU `ordinal` with copies of `bytes`, `rounds` times each
/// (the best round counts, as for kvtier's own figures).
///
/// # Errors
/// [`TransferError::DeviceUnavailable`] without CUDA; [`TransferError::Device`] when an
/// allocation or copy fails.
pub fn pinned_baselines(ordinal: u32, bytes: usize, rounds: usize) -> Result<PinnedBaselines, TransferError> {
    let ctx = CudaContext::get(ordinal)?;
    ctx.bind()?;
    let host_alloc = || -> Result<PinnedBuffer, TransferError> {
        let mut p = std::ptr::null_mut();
        // SAFETY: valid out-pointer, context current.
        check("cuMemHostAlloc", unsafe {
            sys::cuMemHostAlloc(&mut p, bytes, sys::CU_MEMHOSTALLOC_PORTABLE)
        })?;
        Ok(PinnedBuffer(p))
    };
    let dev_alloc = || -> Result<DeviceBuffer, TransferError> {
        let mut p = 0;
        // SAFETY: valid out-pointer, context current.
        check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut p, bytes) })?;
        Ok(DeviceBuffer(p))
    };
    let (host_src, host_dst) = (host_alloc()?, host_alloc()?);
    let (dev_dst, dev_src) = (dev_alloc()?, dev_alloc()?);
    let (h2d, d2h) = (Stream::new(&ctx, true)?, Stream::new(&ctx, false)?);
    let up = || {
        // SAFETY: both buffers are `bytes` long and live until the stream is synchronized.
        check("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(dev_dst.0, host_src.0, bytes, h2d.raw)
        })
    };
    let down = || {
        // SAFETY: as above.
        check("cuMemcpyDtoHAsync", unsafe {
            sys::cuMemcpyDtoHAsync_v2(host_dst.0, dev_src.0, bytes, d2h.raw)
        })
    };
    let gib_s = |b: usize, secs: f64| b as f64 / secs / f64::from(1u32 << 30);
    let (mut best_up, mut best_down, mut best_both) = (0f64, 0f64, 0f64);
    // One untimed round warms the copy engines and the mappings.
    for round in 0..=rounds {
        let t = Instant::now();
        up()?;
        h2d.synchronize()?;
        let s_up = t.elapsed().as_secs_f64();
        let t = Instant::now();
        down()?;
        d2h.synchronize()?;
        let s_down = t.elapsed().as_secs_f64();
        let t = Instant::now();
        up()?;
        down()?;
        h2d.synchronize()?;
        d2h.synchronize()?;
        let s_both = t.elapsed().as_secs_f64();
        if round > 0 {
            best_up = best_up.max(gib_s(bytes, s_up));
            best_down = best_down.max(gib_s(bytes, s_down));
            best_both = best_both.max(gib_s(2 * bytes, s_both));
        }
    }
    Ok(PinnedBaselines {
        h2d_gib_s: best_up,
        d2h_gib_s: best_down,
        duplex_gib_s: best_both,
    })
}
