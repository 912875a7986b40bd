//! kvtier-transfer: moving KV blocks between an engine's device pool and the host tier.
//!
//! - [`DevicePool`]: the engine's paged KV memory, described by a [`kvtier_core::PoolLayout`]
//!   and copied in batches of one layer ([`DevicePool::submit`], completing through a
//!   [`CopyTicket`]); [`CpuDevicePool`] is the shared-memory one (kvtier's pool file, or any
//!   layout), created by the engine and opened by the sidecar by path; [`ProcessDevicePool`]
//!   is memory of the engine's own, reached with cross-memory attach. [`GroupedSlots`] puts a
//!   request on a pool of several KV cache groups (a slot per block per group) before the
//!   queues.
//! - [`TransferQueues`]: the full-duplex pair — [`LoadQueue`] (host → device, layer by layer,
//!   with an event per finished layer) and [`StoreQueue`] (device → host, bounded, dropping
//!   with a counted reason rather than stalling loads) — each on its own OS threads, each
//!   request split into chunks several threads copy at once, each copy timed
//!   ([`TransferTiming`]).
#![warn(missing_docs)]

mod cpu_pool;
mod device_pool;
mod disk_io_gate;
mod error;
mod event_sink;
mod grouped_slots;
mod load_queue;
mod process_pool;
mod queue_core;
mod route;
mod store_queue;
mod transfer_job;
mod transfer_queues;
mod transfer_timing;
mod worker_threads;

#[cfg(feature = "test-util")]
pub mod conformance;
#[cfg(feature = "test-util")]
pub mod pool_conformance;
#[cfg(feature = "test-util")]
pub mod test_util;

pub use cpu_pool::{CpuDevicePool, POOL_HEADER_BYTES};
pub use device_pool::{CopyDirection, CopyTicket, DevicePool, PendingCopies, SlotCopy};
pub use error::TransferError;
pub use event_sink::EventSink;
pub use grouped_slots::{GroupedSlots, NO_SLOT};
pub use load_queue::{InflightBlocks, LoadBlock, LoadEvent, LoadHandle, LoadQueue, LoadReport, LoadTicket};
pub use process_pool::{ProcessBuffer, ProcessDevicePool};
pub use queue_core::QueueStats;
pub use route::{Route, RouteFigures, RouteStats};
pub use store_queue::{
    Durability, PersistReport, StoreBlock, StoreEvent, StoreHandle, StoreQueue, StoreReport, StoreTicket,
};
pub use transfer_queues::{TransferConfig, TransferQueues};
pub use transfer_timing::TransferTiming;
