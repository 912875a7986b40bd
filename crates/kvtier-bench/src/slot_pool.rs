//! The benchmark's device pool: shared memory (`--device cpu`, any `--layout`) or GPU memory
//! (`--device cuda`), with the untimed slot access the workload needs to write KV and verify
//! it (for a GPU, synchronous copies of one block-layer).

use std::path::Path;
use std::sync::Arc;

use kvtier_core::{KvGeometry, LayoutKind, PoolLayout};
use kvtier_cuda::{CopyMethod, CudaDevicePool};
use kvtier_transfer::{CpuDevicePool, DevicePool, TransferError};
use serde::Serialize;

/// Where the benchmark's device pool lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BenchDevice {
    /// Shared memory: the CPU pool.
    Cpu,
    /// GPU 0's memory: the CUDA pool (needs a driver and a GPU).
    Cuda,
}

impl std::str::FromStr for BenchDevice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(BenchDevice::Cpu),
            "cuda" => Ok(BenchDevice::Cuda),
            _ => Err(format!("unknown device {s:?} (expected cpu or cuda)")),
        }
    }
}

/// The pool and how to reach its slots outside the timed part.
#[derive(Debug, Clone)]
pub(crate) enum SlotPool {
    Cpu(Arc<CpuDevicePool>),
    Cuda(Arc<CudaDevicePool>),
}

impl SlotPool {
    /// A pool of `slots` slots of `geometry` in `layout` on `device` (`pool_path`: a file for
    /// a CPU pool another process opens).
    pub(crate) fn create(
        device: BenchDevice,
        layout: LayoutKind,
        method: CopyMethod,
        pool_path: Option<&Path>,
        geometry: KvGeometry,
        slots: u32,
    ) -> Result<Self, TransferError> {
        Ok(match (device, layout) {
            (BenchDevice::Cpu, LayoutKind::Kvtier) => {
                SlotPool::Cpu(Arc::new(CpuDevicePool::create(pool_path, geometry, slots)?))
            }
            (BenchDevice::Cpu, kind) => SlotPool::Cpu(Arc::new(CpuDevicePool::create_with_layout(
                pool_path,
                geometry,
                slots,
                PoolLayout::of_kind(kind, &geometry, slots, 0),
                PoolLayout::kind_bytes(&geometry, slots, 0) as usize,
            )?)),
            (BenchDevice::Cuda, kind) => SlotPool::Cuda(Arc::new(CudaDevicePool::allocate(
                0, geometry, slots, kind, method,
            )?)),
        })
    }

    /// The pool as the queues take it.
    pub(crate) fn dyn_pool(&self) -> Arc<dyn DevicePool> {
        match self {
            SlotPool::Cpu(p) => p.clone(),
            SlotPool::Cuda(p) => p.clone(),
        }
    }

    /// The CPU pool (the gRPC driver registers it by path).
    pub(crate) fn cpu(&self) -> Result<&Arc<CpuDevicePool>, TransferError> {
        match self {
            SlotPool::Cpu(p) => Ok(p),
            SlotPool::Cuda(_) => Err(TransferError::DeviceUnavailable {
                device: "cuda",
                reason: "the benchmark against a sidecar process uses a CPU pool (--device cpu)".into(),
            }),
        }
    }

    pub(crate) fn write_slot_layer(&self, slot: u32, layer: u32, src: &[u8]) -> Result<(), TransferError> {
        match self {
            SlotPool::Cpu(p) => p.write_slot_layer(slot, layer, src),
            SlotPool::Cuda(p) => p.write_slot_layer(slot, layer, src),
        }
    }

    pub(crate) fn fill_slot_layer(&self, slot: u32, layer: u32, byte: u8) -> Result<(), TransferError> {
        match self {
            SlotPool::Cpu(p) => p.fill_slot_layer(slot, layer, byte),
            SlotPool::Cuda(p) => p.fill_slot_layer(slot, layer, byte),
        }
    }

    pub(crate) fn slot_layer_xxh3(&self, slot: u32, layer: u32) -> Result<u64, TransferError> {
        match self {
            SlotPool::Cpu(p) => p.slot_layer_xxh3(slot, layer),
            SlotPool::Cuda(p) => {
                let mut b = vec![0u8; p.geometry().bytes_per_block_layer()];
                p.read_slot_layer(slot, layer, &mut b)?;
                Ok(kvtier_core::xxh3_64(&b))
            }
        }
    }
}
