//! Device slot allocation and the engine's own prefix cache ("HBM hits").
//!
//! Every slot is free, held (by sequences or in-flight stores: a reference count), or cached
//! (a full block whose KV is complete, kept for reuse, evictable). Freeing a sequence releases
//! its blocks suffix first, so least-recently-used eviction takes suffixes before prefixes.

use std::collections::{BTreeMap, HashMap};

use kvtier_core::BlockKey;

use crate::EngineError;

/// What happened to the device-resident set, for the sidecar's `DeviceEvents`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Residency {
    /// `key` is now readable in `slot`.
    Stored(BlockKey, u32),
    /// `key` is no longer on the device.
    Removed(BlockKey),
}

#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    /// The block this slot holds for reuse, if it is published.
    key: Option<BlockKey>,
    refs: u32,
    /// LRU tick while in the evictable set.
    tick: u64,
}

/// Slots of a device pool and which published blocks they hold.
#[derive(Debug)]
pub struct SlotCache {
    slots: Vec<Slot>,
    free: Vec<u32>,
    by_key: HashMap<BlockKey, u32>,
    /// Published, unreferenced slots by release tick (oldest first).
    evictable: BTreeMap<u64, u32>,
    tick: u64,
    /// Whether published blocks are kept for reuse at all.
    reuse: bool,
    events: Vec<Residency>,
}

impl SlotCache {
    /// `slots` free slots; with `reuse` false nothing is ever published (every release frees).
    pub fn new(slots: u32, reuse: bool) -> Self {
        Self {
            slots: vec![Slot::default(); slots as usize],
            free: (0..slots).rev().collect(),
            by_key: HashMap::new(),
            evictable: BTreeMap::new(),
            tick: 0,
            reuse,
            events: Vec::new(),
        }
    }

    /// Turns publishing on or off (blocks already published stay).
    pub fn set_reuse(&mut self, reuse: bool) {
        self.reuse = reuse;
    }

    /// Slots in the pool.
    pub fn total(&self) -> usize {
        self.slots.len()
    }

    /// Slots that can be allocated now (free or evictable).
    pub fn available(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Published blocks (referenced or not).
    pub fn cached_blocks(&self) -> usize {
        self.by_key.len()
    }

    /// The slot holding published block `key`, taking a reference; `None` if not cached.
    pub fn acquire(&mut self, key: BlockKey) -> Option<u32> {
        let slot = *self.by_key.get(&key)?;
        let s = &mut self.slots[slot as usize];
        if s.refs == 0 {
            self.evictable.remove(&s.tick);
        }
        s.refs += 1;
        Some(slot)
    }

    /// Takes another reference on a held slot (an in-flight store keeps it from being reused).
    pub fn retain(&mut self, slot: u32) {
        self.slots[slot as usize].refs += 1;
    }

    /// A slot for new KV, evicting the least recently used cached block if none is free.
    ///
    /// # Errors
    /// [`EngineError::PoolFull`] when every slot is held.
    pub fn allocate(&mut self) -> Result<u32, EngineError> {
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                let (_, slot) = self.evictable.pop_first().ok_or(EngineError::PoolFull {
                    needed: 1,
                    free: 0,
                    total: self.slots.len(),
                })?;
                if let Some(key) = self.slots[slot as usize].key.take() {
                    self.by_key.remove(&key);
                    self.events.push(Residency::Removed(key));
                }
                slot
            }
        };
        self.slots[slot as usize].refs = 1;
        Ok(slot)
    }

    /// Marks held `slot` as holding the complete KV of `key`, for reuse. Returns `false` (and
    /// changes nothing) if `key` is already published in another slot or reuse is off.
    pub fn publish(&mut self, slot: u32, key: BlockKey) -> bool {
        if !self.reuse || self.by_key.contains_key(&key) || self.slots[slot as usize].key.is_some() {
            return false;
        }
        self.slots[slot as usize].key = Some(key);
        self.by_key.insert(key, slot);
        self.events.push(Residency::Stored(key, slot));
        true
    }

    /// Drops one reference; an unreferenced slot becomes evictable (published) or free.
    pub fn release(&mut self, slot: u32) {
        let s = &mut self.slots[slot as usize];
        debug_assert!(s.refs > 0, "release of unheld slot {slot}");
        s.refs = s.refs.saturating_sub(1);
        if s.refs > 0 {
            return;
        }
        if s.key.is_some() {
            self.tick += 1;
            s.tick = self.tick;
            self.evictable.insert(self.tick, slot);
        } else {
            self.free.push(slot);
        }
    }

    /// Every published block and its slot.
    pub fn published(&self) -> Vec<(BlockKey, u32)> {
        self.by_key.iter().map(|(k, s)| (*k, *s)).collect()
    }

    /// Unpublishes every unreferenced cached block (for `Clear`, or a model change).
    pub fn clear(&mut self) {
        while let Some((_, slot)) = self.evictable.pop_first() {
            if let Some(key) = self.slots[slot as usize].key.take() {
                self.by_key.remove(&key);
                self.events.push(Residency::Removed(key));
            }
            self.free.push(slot);
        }
    }

    /// Residency changes since the last call.
    pub fn take_events(&mut self) -> Vec<Residency> {
        std::mem::take(&mut self.events)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(i: u128) -> BlockKey {
        BlockKey(i)
    }

    #[test]
    fn hits_hold_eviction_is_lru_and_suffix_first() {
        let mut c = SlotCache::new(4, true);
        let s: Vec<u32> = (0..3).map(|_| c.allocate().unwrap()).collect();
        for (i, slot) in s.iter().enumerate() {
            assert!(c.publish(*slot, k(i as u128)));
        }
        assert!(!c.publish(s[0], k(9)), "a slot publishes one block");
        // The sequence ends: suffix released first.
        for slot in s.iter().rev() {
            c.release(*slot);
        }
        assert_eq!((c.available(), c.cached_blocks()), (4, 3));
        assert_eq!(c.acquire(k(0)), Some(s[0]), "a prefix hit");
        let fresh = c.allocate().unwrap();
        assert!(!s.contains(&fresh), "a free slot goes before any eviction");
        // Next allocation evicts the oldest released: block 2 (the suffix), not the held prefix.
        assert_eq!(c.allocate().unwrap(), s[2]);
        assert_eq!(c.acquire(k(2)), None);
        assert_eq!(c.allocate().unwrap(), s[1]);
        let e = c.allocate().unwrap_err().to_string();
        assert!(e.contains("pool full"), "{e}");
        let ev = c.take_events();
        assert_eq!(ev[3..], [Residency::Removed(k(2)), Residency::Removed(k(1))]);
        assert!(c.take_events().is_empty());
    }

    #[test]
    fn an_in_flight_store_keeps_its_slot_and_reuse_off_frees_everything() {
        let mut c = SlotCache::new(1, true);
        let s = c.allocate().unwrap();
        c.publish(s, k(1));
        c.retain(s);
        c.release(s);
        assert_eq!(c.available(), 0, "still held by the store");
        c.release(s);
        assert_eq!(c.available(), 1);
        c.clear();
        assert_eq!((c.cached_blocks(), c.acquire(k(1))), (0, None));

        let mut off = SlotCache::new(2, false);
        let s = off.allocate().unwrap();
        assert!(!off.publish(s, k(1)));
        off.release(s);
        assert_eq!((off.available(), off.acquire(k(1))), (2, None));
    }
}
