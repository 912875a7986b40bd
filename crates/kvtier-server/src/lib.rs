//! kvtier-server: the gRPC sidecar behind `kvtier serve`.
//!
//! - [`ServerConfig`]: configuration from defaults, a TOML file, `KVTIER_*` variables and
//!   flags.
//! - [`KvTierService`]: the `kvtier.v1.KvTier` service (sessions, pools, match, load, store,
//!   device events, pins, clear, stats) over [`ServerState`].
//! - [`serve`]: listeners, health and reflection, the Prometheus exporter
//!   ([`metric_names`]), graceful shutdown.
//! - [`proto`]: the generated messages and stubs (the client uses them too).
#![warn(missing_docs)]

mod config;
mod error;
pub mod metric_names;
mod serve;
mod service;
mod state;
mod stats;
pub mod wire;

pub use config::{ListenConfig, ModelConfig, ServerConfig};
pub use error::{ServerError, code_of};
pub use serve::{ServeInfo, serve};
pub use service::KvTierService;
pub use state::{PoolEntry, Residency, ServerState, SessionGuard, SessionStats};
pub use stats::Snapshot;

/// Generated protobuf messages and gRPC stubs of `kvtier.v1`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod proto {
    tonic::include_proto!("kvtier.v1");

    /// The encoded descriptor set, for server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/kvtier_descriptor.bin"));
}
