//! Test fixtures shared by every crate's tests (feature `test-util`): deterministic KV bytes,
//! chained keys, and a rig of tiers, a shared-memory device pool and the real queues.
//!
//! Nothing here is for production use; it panics on any error, as a test should.

use std::sync::Arc;

use kvtier_core::{
    BlockHasher, BlockKey, ByteSize, KvGeometry, LayoutKind, NamespaceFingerprint, PoolLayout,
};
use kvtier_store::{
    DiskTier, DiskTierConfig, EvictionKind, HostTier, HostTierConfig, TieredStore, WritePolicy,
};

use crate::{CpuDevicePool, DevicePool, LoadBlock, StoreBlock, TransferConfig, TransferQueues};

/// The namespace fixtures use unless told otherwise.
pub const NS: NamespaceFingerprint = NamespaceFingerprint(0xfeed);

/// Deterministic KV bytes of block `key` in `layer`: distinct per block and layer, the same in
/// every process.
pub fn kv(key: BlockKey, layer: u32, len: usize) -> Vec<u8> {
    let mut x = (key.0 as u64) ^ (u64::from(layer) << 56) ^ 0x9e37_79b9_7f4a_7c15;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// The chained keys of `n` blocks of a token sequence derived from `seed`, in [`NS`].
pub fn keys(n: usize, seed: u32, block_tokens: u32) -> Vec<BlockKey> {
    keys_in(NS, n, seed, block_tokens)
}

/// As [`keys`], in namespace `ns`.
pub fn keys_in(ns: NamespaceFingerprint, n: usize, seed: u32, block_tokens: u32) -> Vec<BlockKey> {
    let tokens: Vec<u32> = (0..n as u32 * block_tokens)
        .map(|t| t ^ seed.wrapping_mul(2654435761))
        .collect();
    BlockHasher::new(ns, block_tokens).keys(&tokens)
}

/// Writes [`kv`] of each key into `pool`'s slots `first_slot..`, as a forward pass would.
pub fn write_kv_slots(pool: &CpuDevicePool, keys: &[BlockKey], first_slot: u32) {
    let g = *DevicePool::geometry(pool);
    for (i, &k) in keys.iter().enumerate() {
        for layer in 0..g.layers() {
            pool.write_slot_layer(
                first_slot + i as u32,
                layer,
                &kv(k, layer, g.bytes_per_block_layer()),
            )
            .unwrap();
        }
    }
}

/// The first (slot, layer) of `pool` from `first_slot` whose bytes are not [`kv`] of its key.
pub fn first_wrong_kv_slot(pool: &CpuDevicePool, keys: &[BlockKey], first_slot: u32) -> Option<(u32, u32)> {
    let g = *DevicePool::geometry(pool);
    let bl = g.bytes_per_block_layer();
    let mut buf = vec![0u8; bl];
    for (i, &k) in keys.iter().enumerate() {
        for layer in 0..g.layers() {
            let slot = first_slot + i as u32;
            pool.read_slot_layer(slot, layer, &mut buf).unwrap();
            if buf != kv(k, layer, bl) {
                return Some((slot, layer));
            }
        }
    }
    None
}

/// Store blocks for `keys` as one sequence in slots `first_slot..`.
pub fn chain_blocks(keys: &[BlockKey], first_slot: u32) -> Vec<StoreBlock> {
    keys.iter()
        .enumerate()
        .map(|(i, &key)| StoreBlock {
            key,
            parent: i.checked_sub(1).map(|p| keys[p]),
            slot: first_slot + i as u32,
        })
        .collect()
}

/// A host tier (and optionally a disk tier), a device pool in shared memory and the queues.
#[derive(Debug)]
pub struct Rig {
    /// Geometry of everything.
    pub geometry: KvGeometry,
    /// The host tier (also inside `store`).
    pub host: HostTier,
    /// The tiers.
    pub store: TieredStore,
    /// The device pool.
    pub pool: Arc<CpuDevicePool>,
    /// The same pool, as the queues take it.
    pub dyn_pool: Arc<dyn DevicePool>,
    /// The queues.
    pub queues: TransferQueues,
}

/// A rig of `host_blocks` host pages (S3-FIFO) and `slots` device slots, without a disk tier.
pub fn rig(geometry: KvGeometry, host_blocks: u64, slots: u32, config: TransferConfig) -> Rig {
    rig_with_disk(geometry, host_blocks, slots, config, None)
}

/// Host tier config of `host_blocks` pages.
pub fn host_config(geometry: KvGeometry, host_blocks: u64, eviction: EvictionKind) -> HostTierConfig {
    let page = geometry.bytes_per_block().next_multiple_of(4096) as u64;
    HostTierConfig {
        capacity: ByteSize(page * host_blocks),
        eviction,
        ..Default::default()
    }
}

/// A rig whose store also has a disk tier (configured and with the given write policy).
pub fn rig_with_disk(
    geometry: KvGeometry,
    host_blocks: u64,
    slots: u32,
    config: TransferConfig,
    disk: Option<(DiskTierConfig, WritePolicy)>,
) -> Rig {
    let host = HostTier::new(
        geometry,
        &host_config(geometry, host_blocks, EvictionKind::S3fifo),
    )
    .unwrap();
    let store = match disk {
        Some((cfg, policy)) => {
            let (disk, _) = DiskTier::open(geometry, &cfg).unwrap();
            TieredStore::new(host, Some(disk), policy, 2)
        }
        None => TieredStore::host_only(host),
    };
    Rig::new(store, slots, &config)
}

impl Rig {
    /// A rig over `store`, with a pool of `slots` slots and queues made from `config`.
    pub fn new(store: TieredStore, slots: u32, config: &TransferConfig) -> Rig {
        Self::with_layout(store, slots, LayoutKind::Kvtier, config)
    }

    /// As [`Rig::new`], with the device pool in an engine's layout (kvtier's own is its pool
    /// file format; vLLM's and SGLang's are headerless memory laid out as those engines do).
    pub fn with_layout(store: TieredStore, slots: u32, layout: LayoutKind, config: &TransferConfig) -> Rig {
        let geometry = *store.geometry();
        let pool = match layout {
            LayoutKind::Kvtier => CpuDevicePool::create(None, geometry, slots),
            kind => CpuDevicePool::create_with_layout(
                None,
                geometry,
                slots,
                PoolLayout::of_kind(kind, &geometry, slots, 0),
                PoolLayout::kind_bytes(&geometry, slots, 0) as usize,
            ),
        };
        let pool = Arc::new(pool.unwrap());
        Rig {
            geometry,
            host: store.host().clone(),
            store,
            dyn_pool: pool.clone(),
            pool,
            queues: TransferQueues::new(config).unwrap(),
        }
    }

    /// Writes [`kv`] of each key into slots `first_slot..`, as a forward pass would.
    pub fn write_slots(&self, keys: &[BlockKey], first_slot: u32) {
        write_kv_slots(&self.pool, keys, first_slot);
    }

    /// The first slot from `first_slot` whose bytes are not [`kv`] of its key, if any.
    pub fn first_wrong_slot(&self, keys: &[BlockKey], first_slot: u32) -> Option<(u32, u32)> {
        first_wrong_kv_slot(&self.pool, keys, first_slot)
    }

    /// Panics unless slots `first_slot..` hold exactly [`kv`] of `keys`.
    pub fn assert_slots(&self, keys: &[BlockKey], first_slot: u32) {
        if let Some((slot, layer)) = self.first_wrong_slot(keys, first_slot) {
            panic!("slot {slot} layer {layer} differs");
        }
    }

    /// Overwrites `n` slots from `first_slot` with a fill byte, so a load must rewrite them.
    pub fn scrub(&self, first_slot: u32, n: usize) {
        for s in first_slot..first_slot + n as u32 {
            for layer in 0..self.geometry.layers() {
                self.pool.fill_slot_layer(s, layer, 0xa5).unwrap();
            }
        }
    }

    /// Load blocks for `keys` into slots `first_slot..`.
    pub fn load_blocks(keys: &[BlockKey], first_slot: u32) -> Vec<LoadBlock> {
        keys.iter()
            .enumerate()
            .map(|(i, &key)| LoadBlock {
                key,
                slot: first_slot + i as u32,
            })
            .collect()
    }
}
