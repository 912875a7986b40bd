//! Test rig shared by the queue tests: a host tier (and optionally a disk tier), a
//! shared-memory device pool, the queues, and deterministic KV bytes per block.
#![allow(dead_code)]

use std::sync::Arc;

use kvtier_core::{BlockHasher, BlockKey, ByteSize, KvGeometry, NamespaceFingerprint};
use kvtier_store::{
    DiskTier, DiskTierConfig, EvictionKind, HostTier, HostTierConfig, TieredStore, WritePolicy,
};
use kvtier_transfer::{CpuDevicePool, DevicePool, LoadBlock, StoreBlock, TransferConfig, TransferQueues};

pub const NS: NamespaceFingerprint = NamespaceFingerprint(0xfeed);

pub struct Rig {
    pub geometry: KvGeometry,
    pub host: HostTier,
    pub store: TieredStore,
    pub pool: Arc<CpuDevicePool>,
    pub dyn_pool: Arc<dyn DevicePool>,
    pub queues: TransferQueues,
}

pub fn rig(geometry: KvGeometry, host_blocks: u64, slots: u32, config: TransferConfig) -> Rig {
    rig_with_disk(geometry, host_blocks, slots, config, None)
}

/// A rig whose store also has a disk tier (configured and with the given write policy).
pub fn rig_with_disk(
    geometry: KvGeometry,
    host_blocks: u64,
    slots: u32,
    config: TransferConfig,
    disk: Option<(DiskTierConfig, WritePolicy)>,
) -> Rig {
    let page = geometry.bytes_per_block().next_multiple_of(4096) as u64;
    let host = HostTier::new(
        geometry,
        &HostTierConfig {
            capacity: ByteSize(page * host_blocks),
            eviction: EvictionKind::S3fifo,
            ..Default::default()
        },
    )
    .unwrap();
    let pool = Arc::new(CpuDevicePool::create(None, geometry, slots).unwrap());
    let dyn_pool: Arc<dyn DevicePool> = pool.clone();
    let store = match disk {
        Some((cfg, policy)) => {
            let (disk, _) = DiskTier::open(geometry, &cfg).unwrap();
            TieredStore::new(host.clone(), Some(disk), policy, 2)
        }
        None => TieredStore::host_only(host.clone()),
    };
    Rig {
        geometry,
        store,
        host,
        pool,
        dyn_pool,
        queues: TransferQueues::new(&config).unwrap(),
    }
}

/// Deterministic KV bytes for (key, layer), distinct per block and layer.
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

pub fn keys(n: usize, seed: u32, block_tokens: u32) -> Vec<BlockKey> {
    let tokens: Vec<u32> = (0..n as u32 * block_tokens)
        .map(|t| t ^ seed.wrapping_mul(2654435761))
        .collect();
    BlockHasher::new(NS, block_tokens).keys(&tokens)
}

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

impl Rig {
    pub fn write_slots(&self, keys: &[BlockKey], first_slot: u32) {
        let bl = self.geometry.bytes_per_block_layer();
        for (i, &k) in keys.iter().enumerate() {
            for layer in 0..self.geometry.layers() {
                self.pool
                    .write_slot_layer(first_slot + i as u32, layer, &kv(k, layer, bl))
                    .unwrap();
            }
        }
    }

    pub fn assert_slots(&self, keys: &[BlockKey], first_slot: u32) {
        let bl = self.geometry.bytes_per_block_layer();
        let mut buf = vec![0u8; bl];
        for (i, &k) in keys.iter().enumerate() {
            for layer in 0..self.geometry.layers() {
                self.pool
                    .read_slot_layer(first_slot + i as u32, layer, &mut buf)
                    .unwrap();
                assert!(
                    buf == kv(k, layer, bl),
                    "slot {} layer {layer} differs",
                    first_slot + i as u32
                );
            }
        }
    }

    pub fn scrub(&self, first_slot: u32, n: usize) {
        for s in first_slot..first_slot + n as u32 {
            for layer in 0..self.geometry.layers() {
                self.pool.fill_slot_layer(s, layer, 0xa5).unwrap();
            }
        }
    }

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
