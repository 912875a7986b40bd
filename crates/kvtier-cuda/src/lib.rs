//! kvtier-cuda: the CUDA device path — device pools in GPU memory, pinned host pages, duplex
//! copy streams and the copy kernel of `kernels/`.
//!
//! The driver and NVRTC are loaded at run time (cudarc, `dynamic-loading`): this crate builds
//! without a CUDA toolkit, and a binary with it runs where there is no driver; [`status`] says
//! whether CUDA is usable and, if not, why, and every CUDA operation then answers
//! [`TransferError::DeviceUnavailable`](kvtier_transfer::TransferError::DeviceUnavailable)
//! with that reason.
//!
//! - [`CudaDevicePool`]: a [`DevicePool`](kvtier_transfer::DevicePool) over an engine's KV
//!   buffers opened by CUDA IPC handle ([`CudaDevicePool::open_ipc`]) or allocated in process
//!   ([`CudaDevicePool::allocate`]), in any [`PoolLayout`](kvtier_core::PoolLayout).
//! - [`pin_region`]: the host tier's pages page-locked and mapped for the GPU.
//! - [`copy_kernels`]: the gather/scatter kernel, from NVRTC or the kept PTX.
//! - [`pinned_baselines`]: what one large `cuMemcpyAsync` from pinned memory reaches each way
//!   and both ways at once, the benchmark's reference.
#![warn(missing_docs)]

pub mod copy_kernels;
mod cuda_pool;
mod driver;
mod host_pinning;
mod pinned_baselines;
pub mod run_copies;

pub use cuda_pool::{CopyMethod, CudaBufferSpec, CudaDevicePool, CudaPoolSpec};
pub use driver::{CudaContext, CudaStatus, DeviceInfo, status, uuid_text};
pub use host_pinning::{PinOutcome, pin_region};
pub use pinned_baselines::{PinnedBaselines, pinned_baselines};
