//! The pair of queues and their configuration.

use kvtier_core::ByteSize;
use serde::{Deserialize, Serialize};

use crate::{LoadQueue, StoreQueue, TransferError};

/// Configuration of the transfer queues (plain data; defaults documented per field).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TransferConfig {
    /// Load worker threads; 0 (default) = one per available CPU.
    pub load_threads: usize,
    /// Store worker threads; 0 (default) = half the available CPUs, at least one.
    pub store_threads: usize,
    /// Bytes of loads admitted at once (default `8GiB`); past it loads are refused.
    pub load_inflight_limit: ByteSize,
    /// Bytes of stores admitted at once (default `1GiB`); past it stores are dropped and
    /// counted, never queued behind loads.
    pub store_inflight_limit: ByteSize,
    /// Bytes one worker copies per claim (default `1MiB`): small enough that several threads
    /// share one request, large enough that claiming costs nothing.
    pub chunk_bytes: ByteSize,
    /// Scheduling niceness of store workers (default 0; positive lets loads win the CPU).
    pub store_nice: i32,
}

impl Default for TransferConfig {
    fn default() -> Self {
        Self {
            load_threads: 0,
            store_threads: 0,
            load_inflight_limit: ByteSize::gib(8),
            store_inflight_limit: ByteSize::gib(1),
            chunk_bytes: ByteSize::mib(1),
            store_nice: 0,
        }
    }
}

impl TransferConfig {
    /// Load threads after resolving 0 to the CPU count.
    pub fn resolved_load_threads(&self) -> usize {
        if self.load_threads > 0 {
            self.load_threads
        } else {
            cpus()
        }
    }
    /// Store threads after resolving 0 to half the CPU count.
    pub fn resolved_store_threads(&self) -> usize {
        if self.store_threads > 0 {
            self.store_threads
        } else {
            (cpus() / 2).max(1)
        }
    }
}

fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The full-duplex pair: loads and stores run at the same time on separate threads.
#[derive(Debug)]
pub struct TransferQueues {
    /// Host → device.
    pub load: LoadQueue,
    /// Device → host.
    pub store: StoreQueue,
}

impl TransferQueues {
    /// Starts both queues' worker threads.
    ///
    /// # Errors
    /// [`TransferError::Spawn`] if threads cannot be started.
    pub fn new(config: &TransferConfig) -> Result<Self, TransferError> {
        let chunk = usize::try_from(config.chunk_bytes.bytes())
            .unwrap_or(usize::MAX)
            .max(1);
        Ok(Self {
            load: LoadQueue::new(
                config.resolved_load_threads(),
                config.load_inflight_limit.bytes(),
                chunk,
            )?,
            store: StoreQueue::new(
                config.resolved_store_threads(),
                config.store_nice,
                config.store_inflight_limit.bytes(),
                chunk,
            )?,
        })
    }

    /// Worker threads that copy, both queues together (the memcpy baseline uses as many).
    pub fn copy_threads(&self) -> usize {
        self.load.threads() + self.store.threads()
    }
}
