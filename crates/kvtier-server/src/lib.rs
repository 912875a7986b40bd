//! kvtier-server: the gRPC sidecar behind `kvtier serve`.
//!
//! - [`ServerConfig`]: configuration from defaults, a TOML file, `KVTIER_*` variables and
//!   flags.
//! - [`KvTierService`]: the `kvtier.v1.KvTier` service (sessions, pools, match, load, store,
//!   device events, pins, clear, stats) over [`ServerState`].
//! - [`serve`]: listeners, health and reflection, the Prometheus exporter
//!   ([`metric_names`]), graceful shutdown.
//!
//! The generated messages and stubs, key packing and the message conversions are kvtier-proto's.
#![warn(missing_docs)]

mod config;
mod cuda_setup;
mod error;
pub mod metric_names;
mod pool_registry;
mod serve;
mod service;
mod session;
mod socket_mode;
mod state;
mod stats;
mod uds_authority;

pub use config::{ListenConfig, ModelConfig, ServerConfig};
pub use error::{ServerError, code_of};
pub use kvtier_core::{REDACTED, Secret};
pub use pool_registry::{PoolEntry, Residency};
pub use serve::{ServeInfo, serve};
pub use service::KvTierService;
pub use session::{SessionGuard, SessionStats, Sessions};
pub use socket_mode::SocketMode;
pub use state::ServerState;
pub use stats::Snapshot;
