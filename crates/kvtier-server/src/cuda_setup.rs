//! CUDA at start: say whether this sidecar can serve GPU pools (and why not), and when it can,
//! pin the host tier's pages so copies to and from GPUs run as DMA at link speed.

use kvtier_cuda::{CudaContext, PinOutcome, pin_region};
use kvtier_store::TieredStore;
use metrics::{counter, gauge};

use crate::metric_names as m;

/// Logs CUDA's status, sets [`m::CUDA_AVAILABLE`], and pins the host arena where CUDA is
/// usable ([`m::HOST_PINNED_BYTES`]; a refusal is logged, counted in [`m::HOST_PIN_FAILURES`],
/// and copies then use pageable memory). Runs once, before the sockets listen; pinning a large
/// arena takes the driver a moment per GiB.
pub(crate) fn start(store: &TieredStore) {
    let status = kvtier_cuda::status();
    gauge!(m::HOST_PINNED_BYTES).set(0.0);
    counter!(m::HOST_PIN_FAILURES).increment(0);
    if let Some(reason) = status.unavailable_reason() {
        gauge!(m::CUDA_AVAILABLE).set(0.0);
        tracing::info!(
            %reason,
            "CUDA unavailable: CPU pools only (RegisterPool with a cuda pool answers FAILED_PRECONDITION)"
        );
        return;
    }
    gauge!(m::CUDA_AVAILABLE).set(1.0);
    tracing::info!("{}", status.describe());
    let outcome = CudaContext::get(0).and_then(|ctx| pin_region(&ctx, store.host().region()));
    match outcome {
        Ok(PinOutcome::Pinned { bytes, .. }) => {
            gauge!(m::HOST_PINNED_BYTES).set(bytes as f64);
            tracing::info!(bytes, "host arena pinned for GPU copies");
        }
        Ok(PinOutcome::Failed { reason }) => {
            counter!(m::HOST_PIN_FAILURES).increment(1);
            tracing::warn!(%reason, "host arena not pinned: GPU copies use pageable memory (slower)");
        }
        Err(e) => {
            counter!(m::HOST_PIN_FAILURES).increment(1);
            tracing::warn!(error = %e, "host arena not pinned: GPU copies use pageable memory (slower)");
        }
    }
}
