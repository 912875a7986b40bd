//! The sidecar's shared state: configuration, geometry, tiers, queues and sessions.

use std::sync::Arc;

use kvtier_core::KvGeometry;
use kvtier_store::TieredStore;
use kvtier_transfer::TransferQueues;

use crate::ServerConfig;
use crate::session::Sessions;

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
    /// Open sessions, their pools and pins.
    pub sessions: Arc<Sessions>,
}

impl ServerState {
    /// State over existing tiers and queues, with no session open.
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
            sessions: Arc::default(),
        }
    }
}
