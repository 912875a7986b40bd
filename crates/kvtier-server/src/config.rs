//! Configuration of `kvtier serve`: defaults, then a TOML file, then `KVTIER_*` environment
//! variables, then flags — each later source overrides the earlier ones, key by key.
//!
//! Environment variables name a key path with `__` between levels: `KVTIER_HOST__CAPACITY=8GiB`
//! sets `host.capacity`, `KVTIER_SERVER__SOCKET=/run/kvtier.sock` sets `server.socket`,
//! `KVTIER_WRITE_POLICY=all` sets `write_policy`. Variables whose first part names no section
//! or top-level key are not configuration and are ignored (`KVTIER_LOG` and `KVTIER_CONFIG`
//! are the log filter and the config file; a script's own `KVTIER_REPO` does no harm).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use kvtier_core::{ByteSize, Dtype, KvGeometry};
use kvtier_store::{
    DiskTierConfig, HostTierConfig, PAGE_ALIGN, RemoteTierConfig, TieredStoreConfig, WritePolicy,
};
use kvtier_transfer::TransferConfig;
use serde::{Deserialize, Serialize};

use crate::ServerError;
use crate::socket_mode::SocketMode;
use kvtier_core::Secret;

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
    /// The disk tier; `"off"` (default) for host memory only.
    #[serde(with = "kvtier_core::optional_setting")]
    pub disk: Option<DiskTierConfig>,
    /// Which blocks go to disk (default `write_through`).
    pub write_policy: WritePolicy,
    /// Hits that admit a block to disk under `write_through` (default 2).
    pub admit_min_hits: u32,
    /// The remote tier (a Redis Cluster the fleet shares); `"off"` (default).
    #[serde(with = "kvtier_core::optional_setting")]
    pub remote: Option<RemoteTierConfig>,
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
            remote: None,
            transfer: TransferConfig::default(),
        }
    }
}

/// Where the sidecar listens and what it accepts. Optional settings are `"off"` in TOML.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ListenConfig {
    /// Unix socket — the default transport (default: `$XDG_RUNTIME_DIR/kvtier.sock`, else
    /// `/tmp/kvtier-<uid>.sock`).
    pub socket: PathBuf,
    /// Permission bits of the socket (default `"0600"`; `"0660"` admits the socket's group).
    pub socket_mode: SocketMode,
    /// Optional TCP address. Off loopback it requires `tls_cert`, `tls_key` and a token.
    #[serde(with = "kvtier_core::optional_setting")]
    pub tcp: Option<SocketAddr>,
    /// PEM certificate chain for TCP.
    #[serde(with = "kvtier_core::optional_setting")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for TCP.
    #[serde(with = "kvtier_core::optional_setting")]
    pub tls_key: Option<PathBuf>,
    /// Bearer token TCP clients must send (`authorization: Bearer <token>`). Printed as
    /// `<redacted>`; prefer `auth_token_file` or `KVTIER_SERVER__AUTH_TOKEN` to a flag, which
    /// other users see in `ps`.
    #[serde(with = "kvtier_core::optional_setting")]
    pub auth_token: Option<Secret>,
    /// A file whose contents (less a trailing newline) are the bearer token, read at start.
    #[serde(with = "kvtier_core::optional_setting")]
    pub auth_token_file: Option<PathBuf>,
    /// Prometheus exporter address (default `127.0.0.1:9400`); `"off"` to disable.
    #[serde(with = "kvtier_core::optional_setting")]
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
            socket_mode: SocketMode::OWNER,
            tcp: None,
            tls_cert: None,
            tls_key: None,
            auth_token: None,
            auth_token_file: None,
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

    /// The bearer token TCP clients must send: `auth_token`, or the contents of
    /// `auth_token_file` (read now, a trailing newline dropped).
    ///
    /// Cost: reads the file, if one is named.
    ///
    /// # Errors
    /// [`ServerError::Config`] for both set, an unreadable or empty file, or a token a gRPC
    /// header cannot carry.
    pub fn bearer_token(&self) -> Result<Option<Secret>, ServerError> {
        let token = match (&self.auth_token, &self.auth_token_file) {
            (Some(_), Some(_)) => {
                return Err(ServerError::Config(
                    "server.auth_token and server.auth_token_file are both set: set one".into(),
                ));
            }
            (Some(t), None) => t.clone(),
            (None, Some(path)) => {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    ServerError::Config(format!(
                        "server.auth_token_file = {:?}: cannot read it: {e}",
                        path.display()
                    ))
                })?;
                Secret::new(text.trim_end_matches(['\n', '\r']))
            }
            (None, None) => return Ok(None),
        };
        let key = if self.auth_token.is_some() {
            "server.auth_token"
        } else {
            "server.auth_token_file"
        };
        if token.expose().is_empty() {
            return Err(ServerError::Config(format!(
                "{key}: the token is empty; give at least 16 printable ASCII characters"
            )));
        }
        if !token.expose().bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ServerError::Config(format!(
                "{key}: the token has a space, control or non-ASCII character, which an `authorization` header cannot carry; use printable ASCII (e.g. `openssl rand -hex 32`)"
            )));
        }
        Ok(Some(token))
    }
}

/// Where each setting that did not come from the defaults or the file came from, by key path.
type Origins = BTreeMap<String, String>;

impl ServerConfig {
    /// The tier configuration.
    pub fn store_config(&self) -> TieredStoreConfig {
        TieredStoreConfig {
            host: self.host.clone(),
            disk: self.disk.clone(),
            write_policy: self.write_policy,
            admit_min_hits: self.admit_min_hits,
            remote: self.remote.clone(),
        }
    }

    /// Builds the effective configuration: defaults, then `file` (if any), then the
    /// `KVTIER_*` variables of `env`, then `overrides` (`key.path=value`, as flags give them),
    /// and validates it ([`ServerConfig::validate`]).
    ///
    /// # Errors
    /// [`ServerError::Config`] naming the key, its value, where it came from (the file and
    /// line, the variable or the flag) and what is accepted.
    pub fn load(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
        overrides: &[String],
    ) -> Result<Self, ServerError> {
        let mut table = toml::Table::try_from(ServerConfig::default())
            .map_err(|e| ServerError::Config(format!("defaults: {e}")))?;
        if let Some(path) = file {
            merge(&mut table, read_file(path)?);
        }
        let mut origins = Origins::new();
        // Only variables that name a setting are read: `KVTIER_<SECTION>__<KEY>` of a section
        // kvtier has, or `KVTIER_<KEY>` of a top-level key. Any other `KVTIER_*` (a script's
        // `KVTIER_REPO`, `KVTIER_LOG`, `KVTIER_CONFIG`) is not configuration and is left alone;
        // a misspelt key inside a known section is still an error naming it.
        let known: Vec<String> = table.keys().cloned().collect();
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
            origins.insert(key.join("."), format!("from {name}"));
        }
        for o in overrides {
            let (k, v) = o
                .split_once('=')
                .ok_or_else(|| ServerError::Config(format!("{o:?}: expected key.path=value")))?;
            let key: Vec<String> = k.trim().split('.').map(str::to_owned).collect();
            set(&mut table, &key, v.trim()).map_err(|e| ServerError::Config(format!("{k}: {e}")))?;
            origins.insert(key.join("."), format!("from --set {o}"));
        }
        let config: ServerConfig = serde_path_to_error::deserialize(toml::Value::Table(table.clone()))
            .map_err(|e| {
                let path = e.path().to_string();
                let value = lookup(&table, &path)
                    .map(|v| format!(" = {v}"))
                    .unwrap_or_default();
                let from = origin(&origins, &path)
                    .map(|o| format!(" ({o})"))
                    .unwrap_or_default();
                ServerError::Config(format!(
                    "{path}{value}{from}: {}{}",
                    e.inner().message(),
                    hint(&path)
                ))
            })?;
        config.validate()?;
        Ok(config)
    }

    /// Checks what no single field's type can: a usable geometry; tiers, limits and queues
    /// that can hold one block of it; TLS and a token off loopback; readable TLS and token
    /// files. Each error names the key, its value and what is accepted.
    ///
    /// Cost: reads the token file and opens the TLS files, if named.
    ///
    /// # Errors
    /// [`ServerError::Config`] (or [`ServerError::Core`] for the geometry).
    pub fn validate(&self) -> Result<(), ServerError> {
        let geometry = self.model.geometry()?;
        let bad = |msg: String| Err(ServerError::Config(msg));
        let s = &self.server;
        let socket_bytes = s.socket.as_os_str().len();
        if socket_bytes == 0 || socket_bytes > 107 {
            return bad(format!(
                "server.socket = {:?}: a Unix socket path is 1 to 107 bytes ({socket_bytes} given); choose a shorter path",
                s.socket.display()
            ));
        }
        let token = s.bearer_token()?;
        if let Some(addr) = s.tcp
            && !addr.ip().is_loopback()
            && (s.tls_cert.is_none() || s.tls_key.is_none() || token.is_none())
        {
            return bad(format!(
                "server.tcp = \"{addr}\" is not loopback: set server.tls_cert, server.tls_key and server.auth_token (or server.auth_token_file)"
            ));
        }
        if s.tls_cert.is_some() != s.tls_key.is_some() {
            return bad("server.tls_cert and server.tls_key go together: set both or neither".into());
        }
        for (key, path) in [("server.tls_cert", &s.tls_cert), ("server.tls_key", &s.tls_key)] {
            if let Some(p) = path
                && let Err(e) = std::fs::File::open(p)
            {
                return bad(format!("{key} = {:?}: cannot read it: {e}", p.display()));
            }
        }
        if s.max_batch_blocks == 0 {
            return bad("server.max_batch_blocks = 0: give at least 1 (default 65536)".into());
        }
        if s.heartbeat_ms == 0 {
            return bad("server.heartbeat_ms = 0: give an interval of at least 1 ms (default 5000)".into());
        }
        let page = geometry.bytes_per_block().next_multiple_of(PAGE_ALIGN) as u64;
        let block = format!("one block of {geometry} takes {} ({page} bytes)", ByteSize(page));
        if self.host.capacity.bytes() < page {
            return bad(format!(
                "host.capacity = \"{}\" holds no block: {block}; give at least \"{}\"",
                self.host.capacity,
                ByteSize(page)
            ));
        }
        if let Some(d) = &self.disk {
            if d.dir.as_os_str().is_empty() {
                return bad("disk.dir = \"\": name the directory of the disk tier".into());
            }
            let (_, region_bytes) = d.region_layout(&geometry);
            if d.capacity.bytes() < region_bytes {
                return bad(format!(
                    "disk.capacity = \"{}\" is less than one region file of {} (disk.region_size = \"{}\"; {block}): give disk.capacity of at least \"{}\", or a smaller disk.region_size",
                    d.capacity,
                    ByteSize(region_bytes),
                    d.region_size,
                    ByteSize(region_bytes.next_multiple_of(1 << 20)),
                ));
            }
        }
        if self.admit_min_hits == 0 {
            return bad(
                "admit_min_hits = 0: give at least 1 (1 admits a block to disk on its first store; default 2)".into(),
            );
        }
        if let Some(r) = &self.remote {
            r.validate().map_err(ServerError::Config)?;
        }
        let t = &self.transfer;
        let bytes_per_block = geometry.bytes_per_block() as u64;
        for (key, limit) in [
            ("transfer.load_inflight_limit", t.load_inflight_limit),
            ("transfer.store_inflight_limit", t.store_inflight_limit),
        ] {
            if limit.bytes() < bytes_per_block {
                return bad(format!(
                    "{key} = \"{limit}\" admits no request: one block of {geometry} is {bytes_per_block} bytes; give at least \"{}\" (default {})",
                    ByteSize(bytes_per_block),
                    if key.contains("load") { "8GiB" } else { "1GiB" },
                ));
            }
        }
        if t.chunk_bytes.bytes() == 0 {
            return bad("transfer.chunk_bytes = 0: give at least 1 byte (default \"1MiB\")".into());
        }
        if !(-20..=19).contains(&t.store_nice) {
            return bad(format!(
                "transfer.store_nice = {}: a niceness is -20 to 19 (default 0)",
                t.store_nice
            ));
        }
        if self.disk.is_some() {
            for (key, n) in [
                ("transfer.disk_read_threads", t.disk_read_threads),
                ("transfer.disk_write_threads", t.disk_write_threads),
            ] {
                if n == 0 {
                    return bad(format!(
                        "{key} = 0: the disk tier needs at least 1 (defaults 4 and 2)"
                    ));
                }
            }
        }
        Ok(())
    }

    /// The configuration as TOML (what `kvtier serve --print-config` prints): every key,
    /// optional ones as `"off"`, secrets as `<redacted>`. With the disk or remote tier off,
    /// its keys and their defaults follow as comments.
    pub fn to_toml(&self) -> String {
        let mut out =
            toml::to_string_pretty(self).unwrap_or_else(|e| format!("# cannot print configuration: {e}\n"));
        // An optional section that is off, as comments: how to turn it on, then its defaults.
        let commented = |out: &mut String, intro: &str, section: &str, example: String| {
            out.push_str(&format!("\n# {intro}\n# with these defaults:\n# [{section}]\n"));
            for line in example.lines().filter(|l| !l.is_empty()) {
                out.push_str("# ");
                out.push_str(line);
                out.push('\n');
            }
        };
        if self.disk.is_none() {
            commented(
                &mut out,
                "The disk tier is off (disk = \"off\"). Setting disk.dir (or --disk-dir) turns it on",
                "disk",
                toml::to_string_pretty(&DiskTierConfig::default()).unwrap_or_default(),
            );
        }
        if self.remote.is_none() {
            commented(
                &mut out,
                "The remote tier is off (remote = \"off\"). Setting remote.nodes turns it on",
                "remote",
                toml::to_string_pretty(&RemoteTierConfig::default()).unwrap_or_default(),
            );
        }
        out
    }

    /// Every key path a configuration may set (`server.socket`, `disk.capacity`, …), the
    /// disk tier's included.
    pub fn key_paths() -> Vec<String> {
        let full = ServerConfig {
            disk: Some(DiskTierConfig::default()),
            remote: Some(RemoteTierConfig::default()),
            ..ServerConfig::default()
        };
        let mut keys = Vec::new();
        if let Ok(t) = toml::Table::try_from(full) {
            collect_keys(&t, "", &mut keys);
        }
        keys
    }
}

fn collect_keys(t: &toml::Table, prefix: &str, out: &mut Vec<String>) {
    for (k, v) in t {
        let path = format!("{prefix}{k}");
        match v {
            toml::Value::Table(inner) => collect_keys(inner, &format!("{path}."), out),
            _ => out.push(path),
        }
    }
}

/// Reads and checks a configuration file on its own, so that an unknown key or a bad value
/// in it is reported with the file and line.
fn read_file(path: &Path) -> Result<toml::Table, ServerError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ServerError::Config(format!("cannot read {}: {e}", path.display())))?;
    let at = |span: Option<std::ops::Range<usize>>| {
        let line = span.map_or(1, |r| text[..r.start.min(text.len())].matches('\n').count() + 1);
        format!("{}:{line}", path.display())
    };
    let table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| ServerError::Config(format!("{}: {}", at(e.span()), e.message())))?;
    let de = toml::Deserializer::parse(&text)
        .map_err(|e| ServerError::Config(format!("{}: {}", at(e.span()), e.message())))?;
    serde_path_to_error::deserialize::<_, ServerConfig>(de).map_err(|e| {
        let path = e.path().to_string();
        ServerError::Config(format!(
            "{}: {path}: {}{}",
            at(e.inner().span()),
            e.inner().message(),
            hint(&path)
        ))
    })?;
    Ok(table)
}

/// The value at `path` (`host.capacity`) in `table`, as TOML.
fn lookup(table: &toml::Table, path: &str) -> Option<String> {
    let mut parts = path.split('.');
    let mut v = table.get(parts.next()?)?;
    for p in parts {
        v = v.as_table()?.get(p)?;
    }
    (!v.is_table()).then(|| v.to_string())
}

/// Where the setting at `path` (or the section holding it) came from.
fn origin<'a>(origins: &'a Origins, path: &str) -> Option<&'a str> {
    origins
        .iter()
        .find(|(k, _)| *k == path || k.starts_with(&format!("{path}.")) || path.starts_with(&format!("{k}.")))
        .map(|(_, v)| v.as_str())
}

/// The accepted form of keys whose type's own message does not say it.
fn hint(path: &str) -> &'static str {
    match path {
        "server.tcp" => "; give host:port, such as \"127.0.0.1:50051\", or \"off\"",
        "server.metrics" => "; give host:port, such as \"127.0.0.1:9400\" or \"0.0.0.0:9400\", or \"off\"",
        _ => "",
    }
}

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
/// `true`, `"x"`) and as a string otherwise (`8GiB`, `/run/kvtier.sock`). A section that is
/// `"off"` (the disk tier) becomes a table again when one of its keys is set.
fn set(table: &mut toml::Table, key: &[String], raw: &str) -> Result<(), String> {
    let (last, path) = key.split_last().ok_or("empty key")?;
    let mut t = table;
    for part in path {
        let entry = t
            .entry(part.clone())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        if entry.as_str() == Some(kvtier_core::optional_setting::OFF) {
            *entry = toml::Value::Table(toml::Table::new());
        }
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

    /// Loads `overrides` and returns the error's message.
    fn refused(overrides: &[&str]) -> String {
        let o: Vec<String> = overrides.iter().map(|s| (*s).to_owned()).collect();
        match ServerConfig::load(None, vec![], &o) {
            Ok(_) => panic!("{overrides:?} was accepted"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn every_refusal_names_the_key_the_value_and_the_form() {
        for (set, want) in [
            (
                &["transfer.load_inflight_limit=0"][..],
                &["transfer.load_inflight_limit", "\"0B\"", "at least"][..],
            ),
            (
                &["transfer.store_inflight_limit=\"1KiB\""],
                &["transfer.store_inflight_limit", "1KiB", "at least"],
            ),
            (&["host.capacity=-1"], &["host.capacity = -1", "negative", "8GiB"]),
            (&["host.capacity=\"lots\""], &["host.capacity = \"lots\"", "8GiB"]),
            (
                &["host.capacity=\"1MiB\""],
                &["host.capacity = \"1MiB\"", "holds no block", "6MiB"],
            ),
            (
                &["server.metrics=9400"],
                &["server.metrics = 9400", "host:port", "off"],
            ),
            (
                &["server.metrics=\"9400\""],
                &["server.metrics = \"9400\"", "host:port"],
            ),
            (&["server.tcp=\"localhost\""], &["server.tcp", "host:port"]),
            (
                &["disk.dir=\"/tmp/d\"", "disk.capacity=\"1MiB\""],
                &["disk.capacity = \"1MiB\"", "region", "disk.region_size"],
            ),
            (&["server.heartbeat_ms=0"], &["server.heartbeat_ms = 0"]),
            (
                &["transfer.store_nice=40"],
                &["transfer.store_nice = 40", "-20 to 19"],
            ),
            (&["transfer.chunk_bytes=0"], &["transfer.chunk_bytes = 0"]),
            (&["admit_min_hits=0"], &["admit_min_hits = 0"]),
            (
                &["write_policy=\"sometimes\""],
                &["write_policy", "sometimes", "write_through"],
            ),
            (&["server.socket_mode=\"0777\""], &["server.socket_mode", "0660"]),
            (
                &["server.auth_token=\"<redacted>\""],
                &["server.auth_token", "placeholder"],
            ),
            (
                &["server.auth_token=\"has space\""],
                &["server.auth_token", "printable ASCII"],
            ),
            (&["server.auth_token=\"\""], &["server.auth_token", "empty"]),
            (
                &["server.auth_token_file=\"/nonexistent/token\""],
                &["server.auth_token_file", "/nonexistent/token", "cannot read"],
            ),
            (
                &["server.auth_token=\"abc\"", "server.auth_token_file=\"/x\""],
                &["both set"],
            ),
            (
                &[
                    "server.tls_cert=\"/nonexistent.pem\"",
                    "server.tls_key=\"/nonexistent.key\"",
                ],
                &["server.tls_cert", "/nonexistent.pem"],
            ),
            (&["server.socket=\"\""], &["server.socket", "1 to 107 bytes"]),
            (
                &["disk.dir=\"/tmp/d\"", "transfer.disk_read_threads=0"],
                &["transfer.disk_read_threads = 0"],
            ),
        ] {
            let e = refused(set);
            for w in want {
                assert!(e.contains(w), "{set:?}: {e:?} lacks {w:?}");
            }
        }
        // The source of a bad value is named.
        let e =
            ServerConfig::load(None, vec![("KVTIER_HOST__CAPACITY".into(), "-5".into())], &[]).unwrap_err();
        assert!(e.to_string().contains("KVTIER_HOST__CAPACITY"), "{e}");
        let e = refused(&["host.capacity=-1"]);
        assert!(e.contains("--set host.capacity=-1"), "{e}");
    }

    #[test]
    fn a_file_error_names_the_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("kvtier.toml");
        std::fs::write(
            &file,
            "[server]\nsocket = \"/run/k.sock\"\n\n[host]\ncapcity = \"1GiB\"\n",
        )
        .unwrap();
        let e = ServerConfig::load(Some(&file), vec![], &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("{}:5", file.display())), "{e}");
        assert!(e.contains("capcity"), "{e}");
        std::fs::write(&file, "[transfer]\nload_threads = 2\nload_inflight_limit = -3\n").unwrap();
        let e = ServerConfig::load(Some(&file), vec![], &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("{}:3", file.display())), "{e}");
        assert!(e.contains("transfer.load_inflight_limit"), "{e}");
        std::fs::write(&file, "[server\n").unwrap();
        let e = ServerConfig::load(Some(&file), vec![], &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("{}:1", file.display())), "{e}");
    }

    #[test]
    fn the_token_comes_from_a_file_and_is_never_printed() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "s3cr3t-token-0123456789\n").unwrap();
        let c = ServerConfig::load(
            None,
            vec![],
            &[format!("server.auth_token_file=\"{}\"", file.display())],
        )
        .unwrap();
        assert_eq!(
            c.server.bearer_token().unwrap().unwrap().expose(),
            "s3cr3t-token-0123456789"
        );
        let c = ServerConfig::load(
            None,
            vec![("KVTIER_SERVER__AUTH_TOKEN".into(), "from-env-0123456789".into())],
            &[],
        )
        .unwrap();
        assert_eq!(
            c.server.bearer_token().unwrap().unwrap().expose(),
            "from-env-0123456789"
        );
        let printed = c.to_toml();
        assert!(!printed.contains("from-env"), "{printed}");
        assert!(printed.contains("auth_token = \"<redacted>\""), "{printed}");
        assert!(!format!("{c:?}").contains("from-env"));
    }

    #[test]
    fn print_config_shows_every_key_and_reads_back() {
        let keys = ServerConfig::key_paths();
        for must in [
            "server.tcp",
            "server.auth_token_file",
            "host.shm_path",
            "disk.capacity",
            "transfer.store_nice",
        ] {
            assert!(keys.iter().any(|k| k == must), "{must} not in {keys:?}");
        }
        let with_disk = ServerConfig::load(None, vec![], &["disk.dir=\"/var/cache/kvtier\"".into()]).unwrap();
        let defaults = ServerConfig::default();
        // The remote tier's nodes as a flag or a variable gives them: one comma-separated string.
        let with_remote = ServerConfig::load(
            None,
            vec![(
                "KVTIER_REMOTE__NODES".into(),
                "10.0.0.1:6379, 10.0.0.2:6379".into(),
            )],
            &["remote.write_policy=all".into()],
        )
        .unwrap();
        let r = with_remote.remote.as_ref().unwrap();
        assert_eq!(r.nodes, ["10.0.0.1:6379", "10.0.0.2:6379"]);
        assert_eq!(r.write_policy, WritePolicy::All);
        for c in [&defaults, &with_disk, &with_remote] {
            let printed = c.to_toml();
            for k in &keys {
                let leaf = k.rsplit('.').next().unwrap();
                assert!(
                    printed
                        .lines()
                        .any(|l| l.trim_start_matches("# ").starts_with(&format!("{leaf} = "))),
                    "{k} missing from\n{printed}"
                );
            }
            let dir = tempfile::tempdir().unwrap();
            let f = dir.path().join("printed.toml");
            std::fs::write(&f, &printed).unwrap();
            assert_eq!(&ServerConfig::load(Some(&f), vec![], &[]).unwrap(), c);
        }
        // "off" turns the disk tier off again.
        let off = ServerConfig::load(None, vec![], &["disk.dir=\"/d\"".into(), "disk=off".into()]).unwrap();
        assert_eq!(off.disk, None);
    }

    #[test]
    fn every_key_is_in_the_shipped_configuration() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let text = std::fs::read_to_string(root.join("deploy/kvtier.toml")).unwrap();
        let table: toml::Table = text.parse().unwrap();
        // The remote tier ships commented out (it needs a cluster): its keys are documented as
        // `# key = …` lines after `# [remote]`.
        let remote_doc = text.split("# [remote]").nth(1).unwrap_or("");
        for k in ServerConfig::key_paths() {
            match k.strip_prefix("remote.") {
                Some(leaf) => assert!(
                    remote_doc.lines().any(|l| l.starts_with(&format!("# {leaf} = "))),
                    "deploy/kvtier.toml does not document {k}"
                ),
                None => assert!(lookup(&table, &k).is_some(), "deploy/kvtier.toml lacks {k}"),
            }
        }
    }
}
