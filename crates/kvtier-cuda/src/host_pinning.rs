//! Page-locked host memory: kvtier's host pages registered with the CUDA driver
//! (`cuMemHostRegister`, portable to every context and mapped into the device address space), so
//! copies to and from them run as DMA at link speed and the copy kernels can address them.
//!
//! The registration lives in the region itself ([`ShmRegion::device_registration`]): made once,
//! by the first of the sidecar's start-up pinning or a pool's first copy, and released before
//! the region unmaps, so no GPU keeps access to pages a later mapping at the same address would
//! not own. A region that cannot be pinned (the memlock limit, a driver refusal) stays usable:
//! copies from pageable memory are correct, only slower; the outcome says why.

use std::sync::Arc;

use cudarc::driver::sys;
use kvtier_store::ShmRegion;
use kvtier_transfer::TransferError;

use crate::driver::{CudaContext, check, error_text};

/// What became of a region's pinning.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PinOutcome {
    /// Page-locked and mapped: `device_base` addresses the region's first byte on the GPU.
    Pinned {
        /// Bytes pinned (the whole region).
        bytes: usize,
        /// The region's start in the device address space.
        device_base: u64,
    },
    /// Not pinned; copies use pageable memory.
    Failed {
        /// The driver's refusal, or why it was not asked.
        reason: String,
    },
}

/// The registration kept in the region (see the module docs).
#[derive(Debug)]
struct HostPin {
    outcome: PinOutcome,
    /// The host address registered (`None` when registration failed or another owner holds it).
    registered: Option<usize>,
    ctx: Arc<CudaContext>,
}

impl Drop for HostPin {
    fn drop(&mut self) {
        if let Some(ptr) = self.registered
            && self.ctx.bind().is_ok()
        {
            // SAFETY: `ptr` was registered by this pin and the region is still mapped (the
            // registration is dropped before the mapping).
            let _ = unsafe { sys::cuMemHostUnregister(ptr as *mut std::ffi::c_void) };
        }
    }
}

/// Pins `region` for `ctx`'s GPU (and every other: the registration is portable), once; later
/// calls return the first outcome.
///
/// # Errors
/// [`TransferError::Device`] only when the context cannot be made current; a refused
/// registration is [`PinOutcome::Failed`].
pub fn pin_region(ctx: &Arc<CudaContext>, region: &ShmRegion) -> Result<PinOutcome, TransferError> {
    ctx.bind()?;
    Ok(match registration(ctx, region) {
        Some(p) => p.outcome.clone(),
        None => PinOutcome::Failed {
            reason: "the region is registered with another device driver".into(),
        },
    })
}

/// The region's pin, made on first use (the caller has bound `ctx`); `None` for a
/// registration that is not kvtier-cuda's.
fn registration<'a>(ctx: &Arc<CudaContext>, region: &'a ShmRegion) -> Option<&'a HostPin> {
    region
        .device_registration()
        .get_or_init(|| Box::new(register(ctx, region)))
        .downcast_ref::<HostPin>()
}

/// Where `region` starts in the device address space, pinning it on first use; `None` when it
/// could not be pinned (copies then use pageable memory). The data path's call (the caller has
/// bound `ctx`): no allocation once the region's pin exists.
pub(crate) fn mapped_base(ctx: &Arc<CudaContext>, region: &ShmRegion) -> Option<u64> {
    match registration(ctx, region)?.outcome {
        PinOutcome::Pinned { device_base, .. } => Some(device_base),
        PinOutcome::Failed { .. } => None,
    }
}

fn register(ctx: &Arc<CudaContext>, region: &ShmRegion) -> HostPin {
    let failed = |reason: String| HostPin {
        outcome: PinOutcome::Failed { reason },
        registered: None,
        ctx: ctx.clone(),
    };
    if region.is_empty() {
        return failed("empty region".into());
    }
    let ptr = match region.dma_address(0, region.len()) {
        Ok(p) => p,
        Err(e) => return failed(e.to_string()),
    };
    let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
    // SAFETY: `ptr..ptr+len` is the region's live mapping; it stays mapped while this pin
    // (kept in the region, dropped before the mapping) lives.
    let r = unsafe { sys::cuMemHostRegister_v2(ptr.cast(), region.len(), flags) };
    let registered = match r {
        sys::CUresult::CUDA_SUCCESS => Some(ptr as usize),
        // Someone else in this process pinned it (an engine's allocator): usable, not ours
        // to unregister.
        sys::CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED => None,
        r => {
            return failed(format!(
                "cuMemHostRegister of {} bytes: {} (raise `ulimit -l` / the container's memlock limit)",
                region.len(),
                error_text(r)
            ));
        }
    };
    let mut device_base = 0;
    // SAFETY: `ptr` is registered with DEVICEMAP; valid out-pointer.
    let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device_base, ptr.cast(), 0) };
    if let Err(e) = check("cuMemHostGetDevicePointer", r) {
        let pin = failed(e.to_string());
        if let Some(p) = registered {
            // SAFETY: registered just above, not used by anyone yet.
            let _ = unsafe { sys::cuMemHostUnregister(p as *mut std::ffi::c_void) };
        }
        return pin;
    }
    HostPin {
        outcome: PinOutcome::Pinned {
            bytes: region.len(),
            device_base,
        },
        registered,
        ctx: ctx.clone(),
    }
}
