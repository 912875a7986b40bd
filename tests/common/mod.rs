//! Shared pieces of the sidecar tests: an in-process sidecar on a temporary socket, the test
//! geometry, and deterministic KV bytes.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;

use kvtier_core::{BlockKey, ByteSize, Dtype, KvGeometry};
use kvtier_server::{ServeInfo, ServerConfig, ServerError, ServerState};
use tokio::sync::oneshot;

/// 2 layers × 2 × 16 tokens × 2 heads × 64 dims × 2 bytes: 8 KiB per block-layer.
pub fn geometry() -> KvGeometry {
    KvGeometry::new(2, 2, 64, Dtype::Bf16, 16).unwrap()
}

/// A configuration for `geometry()` with a small host tier and no metrics exporter.
pub fn config(socket: PathBuf) -> ServerConfig {
    let mut c = ServerConfig::default();
    let g = geometry();
    c.server.socket = socket;
    c.server.metrics = None;
    c.server.heartbeat_ms = 200;
    c.server.shutdown_grace_ms = 2_000;
    c.model.layers = g.layers();
    c.model.kv_heads = g.kv_heads();
    c.model.head_dim = g.head_dim();
    c.model.dtype = g.dtype();
    c.model.block_tokens = g.block_tokens();
    c.host.capacity = ByteSize::mib(16);
    c
}

/// A sidecar running in this process.
pub struct Sidecar {
    pub dir: tempfile::TempDir,
    pub target: String,
    pub state: Arc<ServerState>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), ServerError>>,
}

impl Sidecar {
    pub async fn start(tweak: impl FnOnce(&mut ServerConfig)) -> Sidecar {
        let dir = tempfile::tempdir().unwrap();
        let mut c = config(dir.path().join("kvtier.sock"));
        tweak(&mut c);
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let (ready_tx, ready_rx) = oneshot::channel::<ServeInfo>();
        let task = tokio::spawn(kvtier_server::serve(
            c,
            async move {
                let _ = stop_rx.await;
            },
            Some(ready_tx),
        ));
        let info = ready_rx.await.expect("the sidecar started");
        Sidecar {
            target: format!("unix://{}", info.socket.display()),
            state: info.state,
            dir,
            stop: Some(stop_tx),
            task,
        }
    }

    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        (&mut self.task).await.unwrap().unwrap();
    }
}

/// Deterministic KV bytes of `key` in `layer`.
pub fn kv(key: BlockKey, layer: u32, len: usize) -> Vec<u8> {
    let mut x = (key.0 as u64) ^ (u64::from(layer) << 48) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}
