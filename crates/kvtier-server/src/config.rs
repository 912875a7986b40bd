//! Configuration of `kvtier serve`: defaults, then a TOML file, then `KVTIER_*` environment
//! variables, then flags — each later source overrides the earlier ones, key by key.
//!
//! Environment variables name a key path with `__` between levels: `KVTIER_HOST__CAPACITY=8GiB`
//! sets `host.capacity`, `KVTIER_SERVER__SOCKET=/run/kvtier.sock` sets `server.socket`,
//! `KVTIER_WRITE_POLICY=all` sets `write_policy`. Variables whose first part names no section
//! or top-level key are not configuration and are ignored (`KVTIER_LOG` and `KVTIER_CONFIG`
//! are the log filter and the config file; a script's own `KVTIER_REPO` does no harm).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use kvtier_core::{Dtype, KvGeometry};
use kvtier_store::{DiskTierConfig, HostTierConfig, TieredStoreConfig, WritePolicy};
use kvtier_transfer::TransferConfig;
use serde::{Deserialize, Serialize};

use crate::ServerError;

/// Everything `kvtier serve` runs with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    /// Listeners and limits.
    pub server: ListenConfig,
    /// The KV geometry this sidecar serves (every registered pool must match it).
    pub model: ModelConfig,
    /// The host tier.
    pub host: HostTierConfig,
    /// The disk tier; absent (default) for host memory only.
    pub disk: Option<DiskTierConfig>,
    /// Which blocks go to disk (default `write_through`).
    pub write_policy: WritePolicy,
    /// Hits that admit a block to disk under `write_through` (default 2).
    pub admit_min_hits: u32,
    /// Transfer queues.
    pub transfer: TransferConfig,
}

impl Default for ServerConfig {
    fn default() -> Self {
        let store = TieredStoreConfig::default();
        Self {
            server: ListenConfig::default(),
            model: ModelConfig::default(),
            host: store.host,
            disk: None,
            write_policy: store.write_policy,
            admit_min_hits: store.admit_min_hits,
            transfer: TransferConfig::default(),
        }
    }
}

/// Where the sidecar listens and what it accepts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ListenConfig {
    /// Unix socket (mode 0600) — the default transport (default:
    /// `$XDG_RUNTIME_DIR/kvtier.sock`, else `/tmp/kvtier-<uid>.sock`).
    pub socket: PathBuf,
    /// Optional TCP address. Off loopback it requires `tls_cert`, `tls_key` and `auth_token`.
    pub tcp: Option<SocketAddr>,
    /// PEM certificate chain for TCP.
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for TCP.
    pub tls_key: Option<PathBuf>,
    /// Bearer token TCP clients must send (`authorization: Bearer <token>`).
    pub auth_token: Option<String>,
    /// Prometheus exporter address (default `127.0.0.1:9400`); `"off"` to disable.
    pub metrics: Option<SocketAddr>,
    /// Most blocks one request may name (default 65536). The gRPC message limit is sized from
    /// it (`kvtier_proto::codec::max_message_bytes`), so such a batch fits in any form.
    pub max_batch_blocks: usize,
    /// Interval of session heartbeats, ms (default 5000).
    pub heartbeat_ms: u64,
    /// How long shutdown waits for in-flight requests, ms (default 10000).
    pub shutdown_grace_ms: u64,
    /// Async runtime threads for gRPC (default 0: half the CPUs, at least one). Copies run on
    /// the transfer queues' own threads; on two cores one RPC thread answered Match faster
    /// (fewer cross-thread wake-ups) and as many per second as two.
    pub rpc_threads: usize,
}

impl Default for ListenConfig {
    fn default() -> Self {
        Self {
            socket: kvtier_proto::default_socket_path(),
            tcp: None,
            tls_cert: None,
            tls_key: None,
            auth_token: None,
            metrics: Some(SocketAddr::from(([127, 0, 0, 1], 9400))),
            max_batch_blocks: 65_536,
            heartbeat_ms: 5_000,
            shutdown_grace_ms: 10_000,
            rpc_threads: 0,
        }
    }
}

/// The served KV geometry (defaults: Qwen3-30B-A3B, 48 layers, 4 KV heads, head_dim 128, bf16,
/// blocks of 64 tokens).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// Layers.
    pub layers: u32,
    /// KV heads per tensor-parallel rank.
    pub kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// KV element type.
    pub dtype: Dtype,
    /// Tokens per block.
    pub block_tokens: u32,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            layers: KvGeometry::QWEN3_30B_A3B_LAYERS,
            kv_heads: KvGeometry::QWEN3_30B_A3B_KV_HEADS,
            head_dim: KvGeometry::QWEN3_30B_A3B_HEAD_DIM,
            dtype: Dtype::Bf16,
            block_tokens: KvGeometry::DEFAULT_BLOCK_TOKENS,
        }
    }
}

impl ModelConfig {
    /// The validated geometry.
    ///
    /// # Errors
    /// [`ServerError::Core`] naming the bad field.
    pub fn geometry(&self) -> Result<KvGeometry, ServerError> {
        Ok(KvGeometry::new(
            self.layers,
            self.kv_heads,
            self.head_dim,
            self.dtype,
            self.block_tokens,
        )?)
    }
}

impl ListenConfig {
    /// RPC threads after resolving 0.
    pub fn resolved_rpc_threads(&self) -> usize {
        if self.rpc_threads > 0 {
            self.rpc_threads
        } else {
            (std::thread::available_parallelism().map_or(1, |n| n.get()) / 2).max(1)
        }
    }
}

impl ServerConfig {
    /// The tier configuration.
    pub fn store_config(&self) -> TieredStoreConfig {
        TieredStoreConfig {
            host: self.host.clone(),
            disk: self.disk.clone(),
            write_policy: self.write_policy,
            admit_min_hits: self.admit_min_hits,
        }
    }

    /// Builds the effective configuration: defaults, then `file` (if any), then the
    /// `KVTIER_*` variables of `env`, then `overrides` (`key.path=value`, as flags give them).
    ///
    /// # Errors
    /// [`ServerError::Config`] naming the file, variable or key that is wrong.
    pub fn load(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
        overrides: &[String],
    ) -> Result<Self, ServerError> {
        let mut table = toml::Table::try_from(ServerConfig::default())
            .map_err(|e| ServerError::Config(format!("defaults: {e}")))?;
        if let Some(path) = file {
            let text = std::fs::read_to_string(path)
                .map_err(|e| ServerError::Config(format!("cannot read {}: {e}", path.display())))?;
            let from_file: toml::Table = text
                .parse()
                .map_err(|e| ServerError::Config(format!("{}: {e}", path.display())))?;
            merge(&mut table, from_file);
        }
        // Only variables that name a setting are read: `KVTIER_<SECTION>__<KEY>` of a section
        // kvtier has, or `KVTIER_<KEY>` of a top-level key. Any other `KVTIER_*` (a script's
        // `KVTIER_REPO`, `KVTIER_LOG`, `KVTIER_CONFIG`) is not configuration and is left alone;
        // a misspelt key inside a known section is still an error naming it.
        let known: Vec<String> = table.keys().cloned().chain(["disk".to_owned()]).collect();
        for (name, value) in env {
            let Some(rest) = name.strip_prefix("KVTIER_") else {
                continue;
            };
            let key: Vec<String> = rest.split("__").map(str::to_ascii_lowercase).collect();
            if !known.contains(&key[0]) {
                tracing::debug!(variable = %name, "not a kvtier setting; ignored");
                continue;
            }
            set(&mut table, &key, &value).map_err(|e| ServerError::Config(format!("{name}: {e}")))?;
        }
        for o in overrides {
            let (k, v) = o
                .split_once('=')
                .ok_or_else(|| ServerError::Config(format!("{o:?}: expected key.path=value")))?;
            let key: Vec<String> = k.trim().split('.').map(str::to_owned).collect();
            set(&mut table, &key, v.trim()).map_err(|e| ServerError::Config(format!("{k}: {e}")))?;
        }
        // Optional settings are switched off with "off" (TOML has no null).
        let mut off = Vec::new();
        for &(section, key) in OPTIONAL_KEYS {
            if let Some(t) = table.get_mut(section).and_then(toml::Value::as_table_mut)
                && t.get(key).and_then(toml::Value::as_str) == Some("off")
            {
                t.remove(key);
                off.push((section, key));
            }
        }
        if table.get("disk").and_then(toml::Value::as_str) == Some("off") {
            table.remove("disk");
        }
        let mut config: ServerConfig = toml::Value::Table(table)
            .try_into()
            .map_err(|e: toml::de::Error| ServerError::Config(e.message().to_owned()))?;
        for (section, key) in off {
            match (section, key) {
                ("server", "tcp") => config.server.tcp = None,
                ("server", "metrics") => config.server.metrics = None,
                ("server", "tls_cert") => config.server.tls_cert = None,
                ("server", "tls_key") => config.server.tls_key = None,
                ("server", "auth_token") => config.server.auth_token = None,
                _ => config.host.shm_path = None,
            }
        }
        config.validate()?;
        Ok(config)
    }

    /// Checks what no single field can: a usable geometry, TLS and a token off loopback.
    ///
    /// # Errors
    /// [`ServerError::Config`].
    pub fn validate(&self) -> Result<(), ServerError> {
        self.model.geometry()?;
        if let Some(addr) = self.server.tcp
            && !addr.ip().is_loopback()
            && (self.server.tls_cert.is_none()
                || self.server.tls_key.is_none()
                || self.server.auth_token.is_none())
        {
            return Err(ServerError::Config(format!(
                "server.tcp = {addr} is not loopback: set server.tls_cert, server.tls_key and server.auth_token"
            )));
        }
        if self.server.tls_cert.is_some() != self.server.tls_key.is_some() {
            return Err(ServerError::Config(
                "server.tls_cert and server.tls_key go together".into(),
            ));
        }
        if self.server.max_batch_blocks == 0 {
            return Err(ServerError::Config(
                "server.max_batch_blocks must be at least 1".into(),
            ));
        }
        Ok(())
    }

    /// The configuration as TOML (what `kvtier serve --print-config` prints).
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_else(|e| format!("# cannot print configuration: {e}\n"))
    }
}

/// Settings that may be set to "off".
const OPTIONAL_KEYS: &[(&str, &str)] = &[
    ("server", "tcp"),
    ("server", "metrics"),
    ("server", "tls_cert"),
    ("server", "tls_key"),
    ("server", "auth_token"),
    ("host", "shm_path"),
];

/// Deep-merges `from` into `into`: tables merge key by key, other values replace.
fn merge(into: &mut toml::Table, from: toml::Table) {
    for (k, v) in from {
        match (into.get_mut(&k), v) {
            (Some(toml::Value::Table(a)), toml::Value::Table(b)) => merge(a, b),
            (_, v) => {
                into.insert(k, v);
            }
        }
    }
}

/// Sets `key` (a path of table names) to `raw`, read as a TOML value when it is one (`8`,
/// `true`, `"x"`) and as a string otherwise (`8GiB`, `/run/kvtier.sock`).
fn set(table: &mut toml::Table, key: &[String], raw: &str) -> Result<(), String> {
    let (last, path) = key.split_last().ok_or("empty key")?;
    let mut t = table;
    for part in path {
        let entry = t
            .entry(part.clone())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        t = entry
            .as_table_mut()
            .ok_or_else(|| format!("{part} is not a section"))?;
    }
    let value = format!("v = {raw}")
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut v| v.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_owned()));
    t.insert(last.clone(), value);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precedence_is_defaults_file_env_flags() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("kvtier.toml");
        std::fs::write(
            &file,
            r#"
write_policy = "all"
[server]
socket = "/from/file.sock"
max_batch_blocks = 100
[host]
capacity = "1GiB"
[model]
layers = 2
"#,
        )
        .unwrap();
        let env = vec![
            ("KVTIER_SERVER__SOCKET".to_owned(), "/from/env.sock".to_owned()),
            ("KVTIER_HOST__CAPACITY".to_owned(), "2GiB".to_owned()),
            ("KVTIER_LOG".to_owned(), "debug".to_owned()),
            ("KVTIER_REPO".to_owned(), "x".to_owned()),
            ("KVTIER_TEST_DIR".to_owned(), "/tmp".to_owned()),
            ("OTHER".to_owned(), "x".to_owned()),
        ];
        let c = ServerConfig::load(
            Some(&file),
            env,
            &["host.capacity=3GiB".into(), "model.kv_heads=8".into()],
        )
        .unwrap();
        assert_eq!(c.server.socket, PathBuf::from("/from/env.sock"), "env over file");
        assert_eq!(c.host.capacity, kvtier_core::ByteSize::gib(3), "flags over env");
        assert_eq!(c.server.max_batch_blocks, 100, "file over defaults");
        assert_eq!((c.model.layers, c.model.kv_heads, c.model.head_dim), (2, 8, 128));
        assert_eq!(c.write_policy, WritePolicy::All);
        // The printed configuration reads back the same.
        let printed = dir.path().join("printed.toml");
        std::fs::write(&printed, c.to_toml()).unwrap();
        assert_eq!(ServerConfig::load(Some(&printed), vec![], &[]).unwrap(), c);
    }

    #[test]
    fn the_shipped_example_configuration_loads() {
        let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/kvtier.toml");
        let c = ServerConfig::load(Some(&example), vec![], &[]).unwrap();
        assert_eq!(c.host.capacity, kvtier_core::ByteSize::gib(32));
        assert!(c.disk.is_some());
        assert_eq!(c.transfer.disk_read_threads, 4);
    }

    #[test]
    fn bad_configurations_are_named() {
        let e = ServerConfig::load(None, vec![], &["host.capcity=1GiB".into()]).unwrap_err();
        assert!(e.to_string().contains("capcity"), "{e}");
        let e =
            ServerConfig::load(None, vec![("KVTIER_HOST__CAPACITY".into(), "lots".into())], &[]).unwrap_err();
        assert!(e.to_string().contains("lots"), "{e}");
        // A misspelt key of a known section is still named.
        let e =
            ServerConfig::load(None, vec![("KVTIER_HOST__CAPACTY".into(), "1GiB".into())], &[]).unwrap_err();
        assert!(e.to_string().contains("capacty"), "{e}");
        let e = ServerConfig::load(None, vec![], &["model.layers=0".into()]).unwrap_err();
        assert!(e.to_string().contains("layers=0"), "{e}");
        let e = ServerConfig::load(None, vec![], &["server.tcp=\"0.0.0.0:5000\"".into()]).unwrap_err();
        assert!(e.to_string().contains("not loopback"), "{e}");
        let e = ServerConfig::load(Some(Path::new("/nonexistent.toml")), vec![], &[]).unwrap_err();
        assert!(e.to_string().contains("/nonexistent.toml"), "{e}");
        let e = ServerConfig::load(None, vec![], &["novalue".into()]).unwrap_err();
        assert!(e.to_string().contains("key.path=value"), "{e}");
        ServerConfig::load(None, vec![], &["server.tcp=\"127.0.0.1:5000\"".into()]).unwrap();
        let c = ServerConfig::load(None, vec![("KVTIER_SERVER__METRICS".into(), "off".into())], &[]).unwrap();
        assert_eq!(c.server.metrics, None);
    }
}
