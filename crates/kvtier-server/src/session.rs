//! Sessions: one per connected engine, opened by `OpenSession` and closed when its event
//! stream ends. A session owns the pools it registered and its soft pins; closing it releases
//! both.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Instant;

use kvtier_core::{KvGeometry, Namespace};
use kvtier_proto::proto;
use kvtier_store::PinnedPage;
use kvtier_transfer::DevicePool;
use serde::Serialize;
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tonic::Status;

use crate::ServerError;
use crate::pool_registry::{PoolEntry, PoolRegistry};

/// Pages held for a session until unpinned, expired or the session's end.
#[derive(Debug)]
struct SoftPin {
    pages: Vec<PinnedPage>,
    expires: Option<Instant>,
}

/// One open session.
#[derive(Debug)]
struct Session {
    client_name: String,
    opened: Instant,
    /// Ids of the pools it registered.
    pools: Vec<u64>,
    pins: HashMap<u64, SoftPin>,
}

impl Session {
    /// Blocks under this session's soft pins.
    fn pinned_blocks(&self) -> usize {
        self.pins.values().map(|p| p.pages.len()).sum()
    }
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

/// The open sessions by id, and the pools they registered.
#[derive(Debug)]
pub struct Sessions {
    map: Mutex<HashMap<u64, Session>>,
    pools: PoolRegistry,
    /// Ids of sessions, pools and pins (one sequence).
    next_id: AtomicU64,
}

impl Default for Sessions {
    fn default() -> Self {
        Self {
            map: Mutex::new(HashMap::new()),
            pools: PoolRegistry::default(),
            next_id: AtomicU64::new(1),
        }
    }
}

impl Sessions {
    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Session>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Runs `f` on session `id` under the sessions lock.
    fn with<R>(
        &self,
        id: u64,
        f: impl FnOnce(&mut Session) -> Result<R, ServerError>,
    ) -> Result<R, ServerError> {
        f(self.lock().get_mut(&id).ok_or(ServerError::UnknownSession(id))?)
    }

    /// Opens a session; dropping the returned guard closes it.
    pub fn open(self: &Arc<Self>, client_name: &str) -> SessionGuard {
        let id = self.id();
        self.lock().insert(
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
            sessions: Arc::clone(self),
            id,
        }
    }

    /// Closes a session: releases its soft pins and unregisters its pools (transfers in
    /// flight keep their pool mapped until they finish).
    pub fn close(&self, id: u64) {
        let Some(session) = self.lock().remove(&id) else {
            return;
        };
        self.pools.remove(&session.pools);
        tracing::info!(
            session = id,
            client = %session.client_name,
            pools = session.pools.len(),
            released_pins = session.pinned_blocks(),
            open_s = session.opened.elapsed().as_secs(),
            "session closed"
        );
    }

    /// Ends every session (shutdown).
    pub fn close_all(&self) {
        let ids: Vec<u64> = self.lock().keys().copied().collect();
        for id in ids {
            self.close(id);
        }
    }

    /// Checks that session `id` is open.
    ///
    /// # Errors
    /// [`ServerError::UnknownSession`].
    pub fn check(&self, id: u64) -> Result<(), ServerError> {
        self.with(id, |_| Ok(()))
    }

    /// Registers a pool of `geometry` for session `session`.
    ///
    /// # Errors
    /// [`ServerError::UnknownSession`], [`ServerError::Core`] for a bad model id or rank.
    pub fn register_pool(
        &self,
        session: u64,
        geometry: KvGeometry,
        device: Arc<dyn DevicePool>,
        model_id: String,
        tp_rank: u32,
        tp_size: u32,
    ) -> Result<Arc<PoolEntry>, ServerError> {
        // Validates model id and ranks once, up front.
        Namespace::new(model_id.clone(), geometry, tp_rank, tp_size, "")?;
        let entry = Arc::new(PoolEntry::new(
            self.id(),
            session,
            device,
            model_id,
            tp_rank,
            tp_size,
        ));
        // Under the sessions lock, so a pool never outlives its session closing meanwhile.
        self.with(session, |s| {
            s.pools.push(entry.id);
            self.pools.insert(Arc::clone(&entry));
            Ok(())
        })?;
        Ok(entry)
    }

    /// Unregisters pool `pool` of session `session`.
    ///
    /// # Errors
    /// [`ServerError::UnknownSession`]; [`ServerError::UnknownPool`] if the session does not
    /// own it.
    pub fn unregister_pool(&self, session: u64, pool: u64) -> Result<(), ServerError> {
        self.with(session, |s| {
            let before = s.pools.len();
            s.pools.retain(|&p| p != pool);
            if s.pools.len() == before {
                return Err(ServerError::UnknownPool(pool));
            }
            self.pools.remove(&[pool]);
            Ok(())
        })
    }

    /// Pool `pool`, which session `session` must own.
    ///
    /// # Errors
    /// [`ServerError::UnknownSession`], [`ServerError::UnknownPool`].
    pub fn pool(&self, session: u64, pool: u64) -> Result<Arc<PoolEntry>, ServerError> {
        self.check(session)?;
        let p = self.pools.get(pool).ok_or(ServerError::UnknownPool(pool))?;
        if p.session != session {
            return Err(ServerError::UnknownPool(pool));
        }
        Ok(p)
    }

    /// Holds `pages` for session `session` until [`Sessions::unpin`], `expires`, or the
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
        self.with(session, |s| {
            s.pins.insert(id, SoftPin { pages, expires });
            Ok(id)
        })
    }

    /// Releases pin `pin` of session `session`; returns the blocks released.
    ///
    /// # Errors
    /// [`ServerError::UnknownSession`], [`ServerError::UnknownPin`].
    pub fn unpin(&self, session: u64, pin: u64) -> Result<usize, ServerError> {
        self.with(session, |s| {
            let p = s.pins.remove(&pin).ok_or(ServerError::UnknownPin(pin))?;
            Ok(p.pages.len())
        })
    }

    /// Releases every soft pin whose TTL passed; returns how many pins expired.
    pub fn expire_pins(&self, now: Instant) -> usize {
        let mut expired = 0;
        for s in self.lock().values_mut() {
            let before = s.pins.len();
            s.pins.retain(|_, p| p.expires.is_none_or(|t| t > now));
            expired += before - s.pins.len();
        }
        expired
    }

    /// Counts of sessions, pools and pins.
    pub fn stats(&self) -> SessionStats {
        let (sessions, soft_pinned_blocks) = {
            let map = self.lock();
            (
                map.len() as u64,
                map.values().map(|s| s.pinned_blocks() as u64).sum(),
            )
        };
        let (pools, device_blocks) = self.pools.counts();
        SessionStats {
            sessions,
            pools,
            soft_pinned_blocks,
            device_blocks,
        }
    }
}

/// Closes its session when dropped: held by the session's response stream, which tonic drops
/// when the client closes it, disconnects or dies.
#[derive(Debug)]
pub struct SessionGuard {
    sessions: Arc<Sessions>,
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
        self.sessions.close(self.id);
    }
}

/// The session stream: events until the client goes away; dropping it closes the session.
pub(crate) struct SessionStream {
    pub(crate) rx: mpsc::Receiver<Result<proto::SessionEvent, Status>>,
    pub(crate) _guard: SessionGuard,
}

impl Stream for SessionStream {
    type Item = Result<proto::SessionEvent, Status>;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.rx.poll_recv(cx)
    }
}
