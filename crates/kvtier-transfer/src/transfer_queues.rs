//! The pair of queues and their configuration.

use std::sync::Arc;

use kvtier_core::{BlockKey, ByteSize, NamespaceFingerprint};
use kvtier_store::{PrefixMatch, TieredStore};
use serde::{Deserialize, Serialize};

use crate::disk_io_gate::DiskIoGate;
use crate::route::{RouteStats, Routes};
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
    /// Threads that read blocks from disk for loads (default 4): each keeps one read in
    /// flight, and disks need several in flight to reach their bandwidth.
    pub disk_read_threads: usize,
    /// Threads that write blocks to disk (default 2).
    pub disk_write_threads: usize,
    /// How long a disk write waits for pending disk reads before it goes anyway (default
    /// 1000 ms): loads win the disk, persistence still progresses.
    pub disk_write_defer_ms: u64,
    /// How long a load waits for a block that is being written into the host tier right now
    /// before reporting it missing (default 2000 ms).
    pub load_wait_inflight_ms: u64,
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
            disk_read_threads: 4,
            disk_write_threads: 2,
            disk_write_defer_ms: 1000,
            load_wait_inflight_ms: 2000,
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
    /// The chunk size in bytes (at least one).
    pub(crate) fn chunk_bytes_usize(&self) -> usize {
        usize::try_from(self.chunk_bytes.bytes())
            .unwrap_or(usize::MAX)
            .max(1)
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
    routes: Arc<Routes>,
}

impl TransferQueues {
    /// Starts both queues' worker threads.
    ///
    /// # Errors
    /// [`TransferError::Spawn`] if threads cannot be started.
    pub fn new(config: &TransferConfig) -> Result<Self, TransferError> {
        let routes = Arc::new(Routes::default());
        let gate = Arc::new(DiskIoGate::default());
        Ok(Self {
            load: LoadQueue::new(config, Arc::clone(&routes), Arc::clone(&gate))?,
            store: StoreQueue::new(config, Arc::clone(&routes), gate)?,
            routes,
        })
    }

    /// Worker threads that copy, both queues together (the memcpy baseline uses as many).
    pub fn copy_threads(&self) -> usize {
        self.load.threads() + self.store.threads()
    }

    /// Blocks, bytes and busy time per route (host → device, device → host, disk → host,
    /// host → disk).
    pub fn routes(&self) -> RouteStats {
        self.routes.snapshot()
    }

    /// [`TieredStore::match_prefix`], then queues the disk and remote writes of the blocks the
    /// match admitted (write-through). A full queue drops those writes (counted).
    pub fn match_prefix(
        &self,
        store: &TieredStore,
        ns: NamespaceFingerprint,
        keys: &[BlockKey],
    ) -> PrefixMatch {
        let m = store.match_prefix(ns, keys);
        if !m.admitted.is_empty()
            && let Err(e) = self.store.persist(store, ns, &m.admitted)
        {
            tracing::debug!(error = %e, blocks = m.admitted.len(), "write-through dropped");
        }
        if !m.admitted_remote.is_empty() {
            // Drops (full queue, cluster down) are counted by the remote tier.
            store.write_remote(ns, &m.admitted_remote);
        }
        m
    }
}
