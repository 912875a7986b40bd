//! The sidecar's shared state: tiers, queues, sessions, registered pools and soft pins.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Instant;

use kvtier_core::{BlockKey, KvGeometry, Namespace, NamespaceFingerprint};
use kvtier_store::{PinnedPage, TieredStore};
use kvtier_transfer::{DevicePool, TransferQueues};
use serde::Serialize;

use crate::{ServerConfig, ServerError};

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

    fn resident_blocks(&self) -> u64 {
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

#[derive(Debug)]
struct SoftPin {
    pages: Vec<PinnedPage>,
    expires: Option<Instant>,
}

#[derive(Debug)]
struct Session {
    client_name: String,
    opened: Instant,
    pools: Vec<u64>,
    pins: HashMap<u64, SoftPin>,
}

/// Counts of sessions, pools and pins.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct SessionStats {
    /// Open sessions.
    pub sessions: u64,
    /// Registered pools.
    pub pools: u64,
    /// Blocks under soft pins.
    pub soft_pinned_blocks: u64,
    /// Blocks engines report resident on their devices.
    pub device_blocks: u64,
}

/// Everything the service works on.
#[derive(Debug)]
pub struct ServerState {
    /// The effective configuration.
    pub config: ServerConfig,
    /// The geometry served.
    pub geometry: KvGeometry,
    /// Host and disk tiers.
    pub store: TieredStore,
    /// The duplex queues.
    pub queues: TransferQueues,
    sessions: Mutex<HashMap<u64, Session>>,
    pools: RwLock<HashMap<u64, Arc<PoolEntry>>>,
    next_id: AtomicU64,
}

impl ServerState {
    /// State over existing tiers and queues.
    pub fn new(
        config: ServerConfig,
        geometry: KvGeometry,
        store: TieredStore,
        queues: TransferQueues,
    ) -> Self {
        Self {
            config,
            geometry,
            store,
            queues,
            sessions: Mutex::new(HashMap::new()),
            pools: RwLock::new(HashMap::new()),
            next_id: AtomicU64::new(1),
        }
    }

    fn id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Opens a session; dropping the returned guard closes it.
    pub fn open_session(self: &Arc<Self>, client_name: &str) -> SessionGuard {
        let id = self.id();
        lock(&self.sessions).insert(
            id,
            Session {
                client_name: client_name.chars().take(256).collect(),
                opened: Instant::now(),
                pools: Vec::new(),
                pins: HashMap::new(),
            },
        );
        tracing::info!(session = id, client = client_name, "session opened");
        SessionGuard {
            state: Arc::clone(self),
            id,
        }
    }

    /// Closes a session: releases its soft pins and unregisters its pools (transfers in
    /// flight keep their pool mapped until they finish).
    pub fn close_session(&self, id: u64) {
        let Some(session) = lock(&self.sessions).remove(&id) else {
            return;
        };
        let pins: usize = session.pins.values().map(|p| p.pages.len()).sum();
        let mut pools = self.pools.write().unwrap_or_else(|e| e.into_inner());
        for p in &session.pools {
            pools.remove(p);
        }
        tracing::info!(
            session = id,
            client = %session.client_name,
            pools = session.pools.len(),
            released_pins = pins,
            open_s = session.opened.elapsed().as_secs(),
            "session closed"
        );
    }

    /// Checks that session `id` is open.
    ///
    /// # Errors
    /// [`ServerError::UnknownSession`].
    pub fn check_session(&self, id: u64) -> Result<(), ServerError> {
        if lock(&self.sessions).contains_key(&id) {
            Ok(())
        } else {
            Err(ServerError::UnknownSession(id))
        }
    }

    /// Registers a pool for session `session`.
    ///
    /// # Errors
    /// [`ServerError::UnknownSession`], [`ServerError::Core`] for a bad model id or rank.
    pub fn register_pool(
        &self,
        session: u64,
        device: Arc<dyn DevicePool>,
        model_id: String,
        tp_rank: u32,
        tp_size: u32,
    ) -> Result<Arc<PoolEntry>, ServerError> {
        // Validates model id and ranks once, up front.
        Namespace::new(model_id.clone(), self.geometry, tp_rank, tp_size, "")?;
        let entry = Arc::new(PoolEntry {
            id: self.id(),
            session,
            device,
            model_id,
            tp_rank,
            tp_size,
            namespaces: Mutex::new(HashMap::new()),
            resident: Mutex::new(HashMap::new()),
        });
        let mut sessions = lock(&self.sessions);
        let s = sessions
            .get_mut(&session)
            .ok_or(ServerError::UnknownSession(session))?;
        s.pools.push(entry.id);
        self.pools
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(entry.id, Arc::clone(&entry));
        Ok(entry)
    }

    /// Unregisters pool `pool` of session `session`.
    ///
    /// # Errors
    /// [`ServerError::UnknownPool`] if the session does not own it.
    pub fn unregister_pool(&self, session: u64, pool: u64) -> Result<(), ServerError> {
        let mut sessions = lock(&self.sessions);
        let s = sessions
            .get_mut(&session)
            .ok_or(ServerError::UnknownSession(session))?;
        let before = s.pools.len();
        s.pools.retain(|&p| p != pool);
        if s.pools.len() == before {
            return Err(ServerError::UnknownPool(pool));
        }
        self.pools
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&pool);
        Ok(())
    }

    /// Pool `pool`, which session `session` must own.
    ///
    /// # Errors
    /// [`ServerError::UnknownSession`], [`ServerError::UnknownPool`].
    pub fn pool(&self, session: u64, pool: u64) -> Result<Arc<PoolEntry>, ServerError> {
        self.check_session(session)?;
        let p = self
            .pools
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&pool)
            .cloned()
            .ok_or(ServerError::UnknownPool(pool))?;
        if p.session != session {
            return Err(ServerError::UnknownPool(pool));
        }
        Ok(p)
    }

    /// Holds `pages` for session `session` until [`ServerState::unpin`], `expires`, or the
    /// session's end. Returns the pin id.
    ///
    /// # Errors
    /// [`ServerError::UnknownSession`].
    pub fn add_pin(
        &self,
        session: u64,
        pages: Vec<PinnedPage>,
        expires: Option<Instant>,
    ) -> Result<u64, ServerError> {
        let id = self.id();
        let mut sessions = lock(&self.sessions);
        let s = sessions
            .get_mut(&session)
            .ok_or(ServerError::UnknownSession(session))?;
        s.pins.insert(id, SoftPin { pages, expires });
        Ok(id)
    }

    /// Releases pin `pin` of session `session`; returns the blocks released.
    ///
    /// # Errors
    /// [`ServerError::UnknownSession`], [`ServerError::UnknownPin`].
    pub fn unpin(&self, session: u64, pin: u64) -> Result<usize, ServerError> {
        let mut sessions = lock(&self.sessions);
        let s = sessions
            .get_mut(&session)
            .ok_or(ServerError::UnknownSession(session))?;
        let p = s.pins.remove(&pin).ok_or(ServerError::UnknownPin(pin))?;
        Ok(p.pages.len())
    }

    /// Releases every soft pin whose TTL passed; returns how many pins expired.
    pub fn expire_pins(&self, now: Instant) -> usize {
        let mut expired = 0;
        for s in lock(&self.sessions).values_mut() {
            let before = s.pins.len();
            s.pins.retain(|_, p| p.expires.is_none_or(|t| t > now));
            expired += before - s.pins.len();
        }
        expired
    }

    /// Counts of sessions, pools and pins.
    pub fn session_stats(&self) -> SessionStats {
        let sessions = lock(&self.sessions);
        let pools = self.pools.read().unwrap_or_else(|e| e.into_inner());
        SessionStats {
            sessions: sessions.len() as u64,
            pools: pools.len() as u64,
            soft_pinned_blocks: sessions
                .values()
                .flat_map(|s| s.pins.values())
                .map(|p| p.pages.len() as u64)
                .sum(),
            device_blocks: pools.values().map(|p| p.resident_blocks()).sum(),
        }
    }

    /// Ends every session (shutdown).
    pub fn close_all_sessions(&self) {
        let ids: Vec<u64> = lock(&self.sessions).keys().copied().collect();
        for id in ids {
            self.close_session(id);
        }
    }
}

/// Closes its session when dropped: held by the session's response stream, which tonic drops
/// when the client closes it, disconnects or dies.
#[derive(Debug)]
pub struct SessionGuard {
    state: Arc<ServerState>,
    id: u64,
}

impl SessionGuard {
    /// The session id.
    pub fn id(&self) -> u64 {
        self.id
    }
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        self.state.close_session(self.id);
    }
}
