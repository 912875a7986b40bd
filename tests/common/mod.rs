//! Shared pieces of the sidecar tests: an in-process sidecar on a temporary socket, the test
//! geometry, and deterministic KV bytes.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;

use kvtier_core::{ByteSize, Dtype, KvGeometry};
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
    serve_geometry(&mut c, g);
    c.host.capacity = ByteSize::mib(16);
    c
}

/// Makes `c` serve geometry `g`.
pub fn serve_geometry(c: &mut ServerConfig, g: KvGeometry) {
    c.model.layers = g.layers();
    c.model.kv_heads = g.kv_heads();
    c.model.head_dim = g.head_dim();
    c.model.dtype = g.dtype();
    c.model.block_tokens = g.block_tokens();
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

/// Writes [`kv`] of each key into `pool` slots `first_slot..`, as a forward pass would; and
/// the first (slot, layer) from `first_slot` that does not hold [`kv`] of its key.
#[allow(unused_imports)] // Not every test binary writes KV.
pub use kvtier_transfer::test_util::{first_wrong_kv_slot as first_wrong_kv, write_kv_slots as write_kv};

/// `kvtier serve` as a real process on a socket in `dir`, for `geometry()`, killed on drop.
pub struct ServeProcess {
    pub child: std::process::Child,
    pub socket: PathBuf,
    pub target: String,
}

impl ServeProcess {
    /// Starts the sidecar with `args` added and returns once it says it is serving.
    pub fn start(dir: &std::path::Path, args: &[&str]) -> ServeProcess {
        use std::io::BufRead;
        let g = geometry();
        let socket = dir.join("kvtier.sock");
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kvtier"))
            .args(["serve", "--socket"])
            .arg(&socket)
            .args(["--set", &format!("model.layers={}", g.layers())])
            .args(["--set", &format!("model.kv_heads={}", g.kv_heads())])
            .args(["--set", &format!("model.head_dim={}", g.head_dim())])
            .args(["--set", &format!("model.block_tokens={}", g.block_tokens())])
            .args(args)
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
        loop {
            let line = lines.next().expect("the server exited before serving").unwrap();
            if line.contains("kvtier: serving") {
                break;
            }
        }
        std::thread::spawn(move || for _ in lines {});
        ServeProcess {
            child,
            target: format!("unix://{}", socket.display()),
            socket,
        }
    }

    /// SIGTERM, then the exit status.
    pub fn terminate(mut self) -> std::process::ExitStatus {
        // SAFETY: sending a signal to our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        self.child.wait().unwrap()
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
