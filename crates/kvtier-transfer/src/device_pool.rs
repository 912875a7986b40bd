//! The device pool contract: the engine's paged KV memory, which kvtier copies blocks into and
//! out of in batches, one layer at a time.

use std::fmt;

use kvtier_core::{KvGeometry, PoolLayout, SlotPieces};
use kvtier_store::ShmRegion;

use crate::TransferError;

/// Which way a batch of copies goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CopyDirection {
    /// Host pages into device slots (a load).
    HostToDevice,
    /// Device slots into host pages (a store).
    DeviceToHost,
}

/// One block-layer of a batch: device `slot` of the batch's layer, and where its host copy is
/// (kvtier's `[K|V][token][head][dim]` order, one block-layer long) in the batch's host region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotCopy {
    /// The device slot.
    pub slot: u32,
    /// Byte offset of the block-layer in the host region.
    pub host_offset: usize,
}

/// Copies a pool is still running (on a CUDA stream, say), waited for once.
pub trait PendingCopies: Send + fmt::Debug {
    /// Blocks until every copy of the batch has landed.
    ///
    /// # Errors
    /// The device's error if a copy failed.
    fn wait(&mut self) -> Result<(), TransferError>;
}

/// What [`DevicePool::submit`] hands back: either done already (a CPU pool copies while
/// submitting), or copies in flight to wait for. Dropping a ticket waits too, so the host
/// pages a batch reads or writes always outlive its copies.
#[derive(Debug)]
#[must_use = "a batch's copies have landed only once its ticket was waited for"]
pub struct CopyTicket {
    pending: Option<Box<dyn PendingCopies>>,
}

impl CopyTicket {
    /// A batch whose copies have all landed.
    pub fn done() -> Self {
        Self { pending: None }
    }

    /// A batch still in flight.
    pub fn pending(pending: Box<dyn PendingCopies>) -> Self {
        Self {
            pending: Some(pending),
        }
    }

    /// Blocks until the batch has landed.
    ///
    /// # Errors
    /// The device's error if a copy failed.
    pub fn wait(mut self) -> Result<(), TransferError> {
        match self.pending.take() {
            Some(mut p) => p.wait(),
            None => Ok(()),
        }
    }
}

impl Drop for CopyTicket {
    fn drop(&mut self) {
        if let Some(mut p) = self.pending.take() {
            // Nobody will read the outcome; waiting keeps the host pages alive until the
            // device is done with them.
            let _ = p.wait();
        }
    }
}

/// The engine's KV memory: per layer, `num_slots` slots of one block each, laid out as its
/// [`PoolLayout`] says. The engine owns slot allocation; kvtier only copies whole block-layers in
/// and out, a layer's batch at a time.
///
/// Implementations: [`crate::CpuDevicePool`] (shared memory both processes map) and the CUDA
/// pool of the `kvtier-cuda` crate (device memory, registered by IPC handle).
pub trait DevicePool: Send + Sync + fmt::Debug {
    /// The KV geometry of every slot.
    fn geometry(&self) -> &KvGeometry;
    /// Number of slots per layer.
    fn num_slots(&self) -> u32;
    /// Where K and V of each slot are.
    fn layout(&self) -> &PoolLayout;
    /// The kind of memory, for logs and errors (`cpu`, `cuda`).
    fn device_kind(&self) -> &'static str;

    /// Submits the copies of one layer in one direction: for each [`SlotCopy`], the slot's K
    /// and V to or from one block-layer of `host`. Returns once they are queued (a CPU pool
    /// has copied them by then; a CUDA pool has put them on the direction's stream and
    /// recorded an event); the ticket says when they have landed. Loads and stores go on
    /// separate streams, so a batch of one never waits behind the other.
    ///
    /// A batch that fails part-way may have written some slots (a load) or host pages (a
    /// store); the caller publishes nothing of a failed batch.
    ///
    /// # Errors
    /// [`TransferError::SlotOutOfRange`], a layer or host range out of bounds, a device error.
    fn submit(
        &self,
        direction: CopyDirection,
        layer: u32,
        host: &ShmRegion,
        copies: &[SlotCopy],
    ) -> Result<CopyTicket, TransferError>;

    /// The bytes of one batch this pool copies best, if it has a preference over the queue's
    /// `chunk_bytes` (a CUDA pool takes a whole layer per batch: one launch or one run of
    /// async copies, one event). `None` for the queue's chunking.
    fn batch_bytes(&self) -> Option<usize> {
        None
    }

    /// Checks that the pool's memory is still the memory that was registered (its owner may
    /// have truncated, replaced or freed it). Called before every request on the pool.
    ///
    /// # Errors
    /// [`TransferError::PoolUnusable`] saying what changed.
    fn check_usable(&self) -> Result<(), TransferError>;

    /// Checks that `slot` exists.
    ///
    /// # Errors
    /// [`TransferError::SlotOutOfRange`].
    fn check_slot(&self, slot: u32) -> Result<(), TransferError> {
        if slot >= self.num_slots() {
            return Err(TransferError::SlotOutOfRange {
                slot,
                num_slots: self.num_slots(),
            });
        }
        Ok(())
    }

    /// Where (`slot`, `layer`)'s block-layer is in this pool's buffers, piece by piece.
    ///
    /// # Errors
    /// [`TransferError::SlotOutOfRange`], [`kvtier_store::StoreError::LayerOutOfRange`].
    fn slot_pieces(&self, slot: u32, layer: u32) -> Result<SlotPieces, TransferError> {
        self.check_slot(slot)?;
        self.check_layer(layer)?;
        Ok(self.layout().slot_pieces(self.geometry(), layer, slot))
    }

    /// Checks that `layer` exists.
    ///
    /// # Errors
    /// [`kvtier_store::StoreError::LayerOutOfRange`].
    fn check_layer(&self, layer: u32) -> Result<(), TransferError> {
        if layer >= self.geometry().layers() {
            return Err(kvtier_store::StoreError::LayerOutOfRange {
                layer,
                layers: self.geometry().layers(),
            }
            .into());
        }
        Ok(())
    }
}
