//! The engine (and sidecar) a serving benchmark talks to: one it starts in-process, or a
//! running engine at `--base-url`.

use std::sync::Arc;

use serde_json::{Value, json};

use crate::BenchError;
use crate::http_client::call_json;
use crate::sidecar::{Running, SidecarTarget, base_overrides, start};

use super::{ServeConfig, err};

/// The engine the benchmark talks to: its address, and what it started (stopped on drop).
pub(super) struct Target {
    pub(super) host: String,
    pub(super) prefix: String,
    pub(super) model: String,
    pub(super) parameters: u64,
    pub(super) device_tokens: usize,
    pub(super) block_tokens: usize,
    pub(super) _embedded: Option<Embedded>,
    /// With a remote tier: node A, which computes the prefixes this node (B) then finds in the
    /// remote tier.
    pub(super) peer: Option<Box<Target>>,
}

/// An engine (and sidecar) this process started.
pub(super) struct Embedded {
    pub(super) _server: tokio::task::JoinHandle<()>,
    pub(super) _sidecar: Running,
    pub(super) _disk: tempfile::TempDir,
}

/// The engine (and sidecar) the benchmark measures; with `remote_nodes`, a second one (its
/// peer, node A) sharing the remote tier with it.
pub(super) fn start_embedded(
    config: &ServeConfig,
    rt: &tokio::runtime::Runtime,
) -> Result<Target, BenchError> {
    let mut target = start_node(config, rt)?;
    if !config.remote_nodes.is_empty() {
        target.peer = Some(Box::new(start_node(config, rt)?));
    }
    Ok(target)
}

fn start_node(config: &ServeConfig, rt: &tokio::runtime::Runtime) -> Result<Target, BenchError> {
    let (model, weights, _) =
        kvtier_engine::load_model(&config.model, config.layers, config.seed).map_err(err)?;
    let bt = config.block_tokens as usize;
    let max_batch = config.batches.iter().copied().max().unwrap_or(1);
    let per_request = (config.input_len + config.output_len).div_ceil(bt);
    // Every request of the largest batch, its own copy of the prefix (kvtier-only loads),
    // the warm-ups, and the cached prefixes of earlier runs.
    let slots = (per_request * (2 * max_batch + 2 + 2 * config.scenarios.len())) as u32;
    let engine_config = kvtier_engine::EngineConfig {
        seed: config.seed,
        block_tokens: config.block_tokens,
        device_slots: slots,
        kv_reuse: kvtier_engine::KvReuse::Tiered,
        max_batch_tokens: config.max_batch_tokens,
        max_running: max_batch.max(1),
        reconnect_ms: 100,
        ..kvtier_engine::EngineConfig::default()
    };
    let geometry = kvtier_engine::engine::kv_geometry(&model, &engine_config).map_err(err)?;
    let disk = tempfile::Builder::new()
        .prefix("kvtier-bench-disk")
        .tempdir()
        .map_err(err)?;
    let mut overrides = base_overrides(&geometry, config.host_capacity);
    overrides.extend([
        format!("disk.dir=\"{}\"", disk.path().display()),
        format!("disk.capacity=\"{}\"", config.disk_capacity),
        "disk.region_size=\"64MiB\"".into(),
        // Every stored block goes to disk too, so the disk scenario has its prefix there.
        "write_policy=\"all\"".into(),
    ]);
    if !config.remote_nodes.is_empty() {
        overrides.extend([
            format!("remote.nodes=\"{}\"", config.remote_nodes.join(",")),
            // Every stored block goes to the cluster, and under this run's own prefix.
            "remote.write_policy=\"all\"".into(),
            format!("remote.key_prefix=\"kvtier-bench-serve-{}\"", std::process::id()),
        ]);
    }
    let (url, sidecar) = start(&SidecarTarget::InProcess, &overrides)?;
    let name = model.name.clone();
    let parameters = model.parameters();
    let engine = kvtier_engine::Engine::start(
        model,
        weights,
        kvtier_engine::EngineConfig {
            sidecar: Some(url),
            ..engine_config
        },
    )
    .map_err(err)?;
    let state = Arc::new(kvtier_engine::http::AppState {
        engine,
        codec: kvtier_engine::TextCodec::Bytes,
        chat: kvtier_engine::chat_template::ChatTemplate::for_model_dir(None).map_err(err)?,
        metrics: None,
    });
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .map_err(err)?;
    let addr = listener.local_addr().map_err(err)?;
    let server = rt.spawn(async move {
        let _ = axum::serve(listener, kvtier_engine::http::router(state)).await;
    });
    Ok(Target {
        host: addr.to_string(),
        prefix: String::new(),
        model: name,
        parameters,
        device_tokens: slots as usize * bt,
        block_tokens: bt,
        _embedded: Some(Embedded {
            _server: server,
            _sidecar: sidecar,
            _disk: disk,
        }),
        peer: None,
    })
}

impl Target {
    pub(super) async fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> Result<Value, BenchError> {
        call_json(
            &self.host,
            method,
            &format!("{}{path}", self.prefix),
            body.map(|b| b.to_string()),
        )
        .await
    }

    pub(super) async fn set_reuse(&self, policy: &str) -> Result<(), BenchError> {
        self.call("POST", "/kvtier/reuse", Some(json!({"kv_reuse": policy})))
            .await
            .map(|_| ())
    }

    pub(super) async fn disk_entries(&self) -> Result<u64, BenchError> {
        let v = self.call("GET", "/kvtier/stats", None).await?;
        Ok(v["tiers"]["disk"]["entries"].as_u64().unwrap_or(0))
    }

    /// Blocks this node's sidecar wrote to the remote tier, and those still queued.
    pub(super) async fn remote_writes(&self) -> Result<(u64, u64), BenchError> {
        let v = self.call("GET", "/kvtier/stats", None).await?;
        let r = &v["tiers"]["remote"];
        Ok((
            r["written_blocks_total"].as_u64().unwrap_or(0),
            r["pending_writes"].as_u64().unwrap_or(0),
        ))
    }
}
