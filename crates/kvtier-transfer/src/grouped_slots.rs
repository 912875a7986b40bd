//! One request's slots in a pool whose layers form several KV cache groups.
//!
//! An engine with several KV cache groups (vLLM's hybrid KV cache manager: sliding-window and
//! full-attention layers, a block table each) keeps block `b` of a request in a different slot
//! in each group, and a group may keep no block at all where its layers need none
//! ([`NO_SLOT`]: sliding-window layers before their window). [`GroupedSlots`] puts such a
//! request in front of the transfer queues as a pool of its own whose slot `b` is the
//! request's block `b`: each layer's batch goes to the real pool with the slots of that
//! layer's group, and copies into [`NO_SLOT`] are left out. The queues stay what they are.

use std::fmt;
use std::sync::Arc;

use kvtier_core::{KvGeometry, PoolLayout};
use kvtier_store::ShmRegion;

use crate::{CopyDirection, CopyTicket, DevicePool, SlotCopy, TransferError};

/// A slot that says "this group keeps no block here": the load leaves that block's layers of
/// the group unwritten. Never valid in a store (a stored block holds every layer).
pub const NO_SLOT: u32 = u32::MAX;

/// A request's slots per KV cache group over a real pool, seen as a pool whose slot `b` is
/// block `b` of the request (see the module docs).
pub struct GroupedSlots {
    pool: Arc<dyn DevicePool>,
    /// `[group][block]`: the real slot, or [`NO_SLOT`].
    slots: Vec<Vec<u32>>,
    /// Each layer's group.
    layer_groups: Vec<u32>,
}

impl fmt::Debug for GroupedSlots {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GroupedSlots")
            .field("pool", &self.pool)
            .field("groups", &self.slots.len())
            .field("blocks", &self.blocks())
            .finish()
    }
}

impl GroupedSlots {
    /// `slots[g][b]` is block `b`'s slot in group `g` of `pool` (every group of its layout,
    /// each list as long as the request). `missing_ok`: a load, where [`NO_SLOT`] may stand
    /// for a block a group does not keep. Group 0's list is the request's `slots` field, the
    /// others `group_slots[g - 1]`, as errors name them.
    ///
    /// # Errors
    /// [`TransferError::GroupSlots`] for lists that do not match the pool's groups or the
    /// request, [`TransferError::SlotOutOfRange`] and [`TransferError::DuplicateSlot`] (within
    /// a group) naming the slot.
    pub fn new(
        pool: Arc<dyn DevicePool>,
        slots: Vec<Vec<u32>>,
        missing_ok: bool,
    ) -> Result<Self, TransferError> {
        let groups = pool.layout().groups() as usize;
        let field = |g: usize| {
            if g == 0 {
                "slots".to_string()
            } else {
                format!("group_slots[{}]", g - 1)
            }
        };
        let err = |field: String, reason: String| Err(TransferError::GroupSlots { field, reason });
        if slots.len() != groups {
            return err(
                "group_slots".into(),
                format!(
                    "{} list(s) for a pool of {groups} KV cache group(s): give one per group after the first \
                     (slots is group 0's)",
                    slots.len().saturating_sub(1)
                ),
            );
        }
        let blocks = slots[0].len();
        let num_slots = pool.num_slots();
        for (g, list) in slots.iter().enumerate() {
            if list.len() != blocks {
                return err(
                    field(g),
                    format!("{} slots for {blocks} keys: give one slot per key", list.len()),
                );
            }
            let mut seen = std::collections::HashSet::with_capacity(list.len());
            for &s in list {
                if s == NO_SLOT {
                    if !missing_ok {
                        return err(
                            field(g),
                            "NO_SLOT in a store: a stored block holds every layer, so every group must give \
                             a slot"
                                .into(),
                        );
                    }
                    continue;
                }
                if s >= num_slots {
                    return Err(TransferError::SlotOutOfRange { slot: s, num_slots });
                }
                if !seen.insert(s) {
                    return Err(TransferError::DuplicateSlot { slot: s });
                }
            }
        }
        Ok(Self {
            layer_groups: pool.layout().layer_groups(),
            pool,
            slots,
        })
    }

    /// Blocks in the request (the slots of this pool: `0..blocks`).
    pub fn blocks(&self) -> u32 {
        self.slots.first().map_or(0, |s| s.len() as u32)
    }
}

impl DevicePool for GroupedSlots {
    fn geometry(&self) -> &KvGeometry {
        self.pool.geometry()
    }

    fn num_slots(&self) -> u32 {
        self.blocks()
    }

    fn layout(&self) -> &PoolLayout {
        self.pool.layout()
    }

    fn device_kind(&self) -> &'static str {
        self.pool.device_kind()
    }

    fn submit(
        &self,
        direction: CopyDirection,
        layer: u32,
        host: &ShmRegion,
        copies: &[SlotCopy],
    ) -> Result<CopyTicket, TransferError> {
        self.check_layer(layer)?;
        let slots = &self.slots[self.layer_groups[layer as usize] as usize];
        let mut real = Vec::with_capacity(copies.len());
        for c in copies {
            self.check_slot(c.slot)?;
            let slot = slots[c.slot as usize];
            if slot != NO_SLOT {
                real.push(SlotCopy { slot, ..*c });
            }
        }
        if real.is_empty() {
            return Ok(CopyTicket::done());
        }
        self.pool.submit(direction, layer, host, &real)
    }

    fn batch_bytes(&self) -> Option<usize> {
        self.pool.batch_bytes()
    }

    fn check_usable(&self) -> Result<(), TransferError> {
        self.pool.check_usable()
    }
}
