//! The device pools engines registered: each pool's mapping, owner session, namespace
//! fingerprints and the blocks its engine reports resident, and the registry of them by id.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

use kvtier_core::{BlockKey, KvGeometry, Namespace, NamespaceFingerprint};
use kvtier_transfer::DevicePool;

use crate::ServerError;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A registered device pool.
#[derive(Debug)]
pub struct PoolEntry {
    /// Its id.
    pub id: u64,
    /// The session that registered it.
    pub session: u64,
    /// The mapped pool.
    pub device: Arc<dyn DevicePool>,
    model_id: String,
    tp_rank: u32,
    tp_size: u32,
    namespaces: Mutex<HashMap<String, NamespaceFingerprint>>,
    /// Blocks the engine reports its device holds: key → slot.
    resident: Mutex<HashMap<BlockKey, u32>>,
}

impl PoolEntry {
    pub(crate) fn new(
        id: u64,
        session: u64,
        device: Arc<dyn DevicePool>,
        model_id: String,
        tp_rank: u32,
        tp_size: u32,
    ) -> Self {
        Self {
            id,
            session,
            device,
            model_id,
            tp_rank,
            tp_size,
            namespaces: Mutex::new(HashMap::new()),
            resident: Mutex::new(HashMap::new()),
        }
    }

    /// The namespace fingerprint of this pool's model, geometry and rank under `salt`
    /// (computed once per salt).
    ///
    /// # Errors
    /// [`ServerError::Core`] for a salt longer than 1 KiB.
    pub fn namespace(&self, geometry: KvGeometry, salt: &str) -> Result<NamespaceFingerprint, ServerError> {
        let mut cache = lock(&self.namespaces);
        if let Some(fp) = cache.get(salt) {
            return Ok(*fp);
        }
        let fp =
            Namespace::new(self.model_id.clone(), geometry, self.tp_rank, self.tp_size, salt)?.fingerprint();
        if cache.len() < 4096 {
            cache.insert(salt.to_owned(), fp);
        }
        Ok(fp)
    }

    /// The device slot holding each of `keys`, as the engine reported (one lock for all).
    pub fn device_slots(&self, keys: &[BlockKey]) -> Vec<Option<u32>> {
        let r = lock(&self.resident);
        if r.is_empty() {
            return vec![None; keys.len()];
        }
        keys.iter().map(|k| r.get(k).copied()).collect()
    }

    /// Applies residency events; returns blocks resident afterwards.
    pub fn apply_residency(&self, events: impl IntoIterator<Item = Residency>) -> u64 {
        let mut r = lock(&self.resident);
        for e in events {
            match e {
                Residency::Stored(key, slot) => {
                    r.insert(key, slot);
                }
                Residency::Removed(key) => {
                    r.remove(&key);
                }
                Residency::Cleared => r.clear(),
            }
        }
        r.len() as u64
    }

    pub(crate) fn resident_blocks(&self) -> u64 {
        lock(&self.resident).len() as u64
    }
}

/// One device residency change.
#[derive(Debug, Clone, Copy)]
pub enum Residency {
    /// The device holds the block in the slot.
    Stored(BlockKey, u32),
    /// The device dropped the block.
    Removed(BlockKey),
    /// The device dropped everything.
    Cleared,
}

/// Registered pools by id.
#[derive(Debug, Default)]
pub(crate) struct PoolRegistry {
    pools: RwLock<HashMap<u64, Arc<PoolEntry>>>,
}

impl PoolRegistry {
    fn read(&self) -> RwLockReadGuard<'_, HashMap<u64, Arc<PoolEntry>>> {
        self.pools.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, HashMap<u64, Arc<PoolEntry>>> {
        self.pools.write().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn insert(&self, entry: Arc<PoolEntry>) {
        self.write().insert(entry.id, entry);
    }

    /// Removes each of `ids`.
    pub(crate) fn remove(&self, ids: &[u64]) {
        let mut pools = self.write();
        for id in ids {
            pools.remove(id);
        }
    }

    pub(crate) fn get(&self, id: u64) -> Option<Arc<PoolEntry>> {
        self.read().get(&id).cloned()
    }

    /// (pools, blocks their engines report resident).
    pub(crate) fn counts(&self) -> (u64, u64) {
        let pools = self.read();
        (
            pools.len() as u64,
            pools.values().map(|p| p.resident_blocks()).sum(),
        )
    }
}
