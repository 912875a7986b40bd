//! One request's slots in a pool whose layers form several KV cache groups.
//!
//! An engine with several KV cache groups (vLLM's hybrid KV cache manager: sliding-window and
//! full-attention layers, a block table each) keeps block `b` of a request in a different slot
//! in each group, and a group may keep no block at all where its layers need none
//! ([`NO_SLOT`]: sliding-window layers before their window). [`GroupedSlots`] puts such a
//! request in front of the transfer queues as a pool of its own whose slot `b` is the
//! request's block `b`: each layer's batch goes to the real pool with the slots of that
//! layer's group, and copies into [`NO_SLOT`] are left out. The queues stay what they are.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::Arc;

use kvtier_core::{KvGeometry, MAX_KV_CACHE_GROUPS, PoolLayout};
use kvtier_store::ShmRegion;

use crate::{CopyDirection, CopyTicket, DevicePool, SlotCopy, TransferError};

/// A slot that says "this group keeps no block here": the load leaves that block's layers of
/// the group unwritten. Never valid in a store (a stored block holds every layer).
pub const NO_SLOT: u32 = u32::MAX;

/// In a load: the first real slot named by two groups whose layers share that slot's bytes
/// (the layers of vLLM's groups lie over one another), as (later group, earlier group, slot):
/// both layers would be written into the same bytes. Costs a hash lookup per slot, and a
/// compare of two groups' pieces only where a slot repeats across groups (against every
/// earlier group naming it: groups 0 and 2 may keep apart where 1 and 2 do not).
fn shared_slot(pool: &dyn DevicePool, slots: &[Vec<u32>]) -> Option<(usize, usize, u32)> {
    // Per slot, the groups that named it so far, one bit each (a validated layout has at
    // most MAX_KV_CACHE_GROUPS groups).
    const _: () = assert!(MAX_KV_CACHE_GROUPS <= u64::BITS);
    let mut named: HashMap<u32, u64> = HashMap::with_capacity(slots.first().map_or(0, Vec::len));
    for (g, list) in slots.iter().enumerate() {
        for &s in list.iter().filter(|&&s| s != NO_SLOT) {
            let earlier = named.entry(s).or_default();
            if let Some(first) =
                (0..g).find(|&a| *earlier & 1 << a != 0 && groups_share_slot(pool, a as u32, g as u32, s))
            {
                return Some((g, first, s));
            }
            *earlier |= 1 << g;
        }
    }
    None
}

/// Whether any byte of `slot` in a layer of group `a` is also a byte of `slot` in a layer of
/// group `b`.
fn groups_share_slot(pool: &dyn DevicePool, a: u32, b: u32, slot: u32) -> bool {
    let layout = pool.layout();
    let geometry = pool.geometry();
    let pieces = |group: u32| {
        let mut v: Vec<(u32, u64, u64)> = (0..layout.layers().len() as u32)
            .filter(|&l| layout.layer(l).group == group)
            .flat_map(|l| layout.slot_pieces(geometry, l, slot))
            .map(|p| (p.buffer, p.offset, p.offset + p.len as u64))
            .collect();
        v.sort_unstable();
        v
    };
    let (pa, pb) = (pieces(a), pieces(b));
    // Both sorted by (buffer, start): walk them together.
    let (mut i, mut j) = (0, 0);
    while i < pa.len() && j < pb.len() {
        let ((ba, sa, ea), (bb, sb, eb)) = (pa[i], pb[j]);
        if ba == bb && sa < eb && sb < ea {
            return true;
        }
        if (ba, ea) <= (bb, eb) {
            i += 1;
        } else {
            j += 1;
        }
    }
    false
}

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
    /// [`TransferError::GroupSlots`] naming the list at fault: lists that do not match the
    /// pool's groups or the request, a slot past the pool, a slot twice in one group's list,
    /// and in a load a slot named by two groups whose layers share its bytes.
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
        for (g, list) in slots.iter().enumerate() {
            if list.len() != blocks {
                return err(
                    field(g),
                    format!("{} slots for {blocks} keys: give one slot per key", list.len()),
                );
            }
            let mut seen = HashSet::with_capacity(list.len());
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
                if let Err(e) = pool.check_slot(s) {
                    return err(field(g), e.to_string());
                }
                if !seen.insert(s) {
                    return err(field(g), format!("device slot {s} appears twice in the list"));
                }
            }
        }
        if missing_ok && let Some((g, first, s)) = shared_slot(pool.as_ref(), &slots) {
            return err(
                field(g),
                format!(
                    "device slot {s} is also in {}, and their layers share its bytes: a load would \
                     write two layers into them (an engine gives a block to one group at a time)",
                    field(first)
                ),
            );
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

#[cfg(test)]
mod tests {
    use kvtier_core::{Dtype, LayoutKind};

    use super::*;
    use crate::CpuDevicePool;

    /// `n` layers, layer `l` in group `l`, laid apart, but for each `(l, on)` in `over` layer `l`
    /// lies over layer `on`'s bytes.
    fn pool(n: u32, over: &[(usize, usize)]) -> Arc<dyn DevicePool> {
        let g = KvGeometry::new(n, 2, 8, Dtype::F16, 4).unwrap();
        let mut layers = PoolLayout::of_kind(LayoutKind::Vllm, &g, 8, 0).layers().to_vec();
        for &(l, on) in over {
            layers[l] = layers[on];
        }
        for (i, l) in layers.iter_mut().enumerate() {
            l.group = i as u32;
        }
        let bytes = PoolLayout::kind_bytes(&g, 8, 0) as usize;
        Arc::new(CpuDevicePool::create_with_layout(None, g, 8, PoolLayout::new(layers), bytes).unwrap())
    }

    #[test]
    fn a_load_may_name_a_slot_in_two_groups_only_where_their_layers_keep_it_apart() {
        let lists = || vec![vec![0, 1, 2], vec![3, 1, NO_SLOT]];
        // Apart: slot 1 of group 0 (layer 0) and of group 1 (layer 1) are different bytes.
        GroupedSlots::new(pool(2, &[]), lists(), true).unwrap();
        // Over one another: the load would write layers 0 and 1 into one slot's bytes.
        let e = GroupedSlots::new(pool(2, &[(1, 0)]), lists(), true)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("group_slots[0]: device slot 1 is also in slots, and their layers share its bytes"),
            "{e}"
        );
        // Different slots over one another are apart; a store reads, so repeats are its own.
        GroupedSlots::new(pool(2, &[(1, 0)]), vec![vec![0, 1, 2], vec![3, 4, NO_SLOT]], true).unwrap();
        GroupedSlots::new(pool(2, &[(1, 0)]), vec![vec![0, 1, 2], vec![3, 1, 5]], false).unwrap();
        // Every earlier group naming the slot counts, not only the first: group 2 lies on
        // group 1, apart from group 0, and all three name slot 1.
        let e = GroupedSlots::new(pool(3, &[(2, 1)]), vec![vec![1], vec![1], vec![1]], true)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("group_slots[1]: device slot 1 is also in group_slots[0], and their layers share"),
            "{e}"
        );
    }
}
