//! The remote tier: KV blocks in a Redis Cluster (or Valkey) that every node of a fleet shares,
//! so a prefix computed on one node is a hit on all of them.
//!
//! kvtier does not run a store of its own here: capacity, replication and eviction are the
//! cluster's (run it with `maxmemory-policy allkeys-lru`; a key it evicted is a miss). Each
//! block is one value (see [`crate::remote_value`]: a checksummed header, then the block's host
//! page), under a key that names the namespace, spread over the cluster's slots.
//!
//! Everything here is bounded and never on the path of a host or disk hit:
//! - writes are write-behind: [`RemoteTier::write_behind`] queues a pinned host page and
//!   returns at once; a full queue, a cluster that is down or a write that times out drops the
//!   block and counts why;
//! - reads ([`RemoteTier::start_reads`]) run in parallel, each under a deadline; a value that is
//!   missing, late or does not verify is a miss for that block only;
//! - a cluster that cannot be reached at start is retried in the background while kvtier
//!   serves without it; wrong credentials are an error at start.
//!
//! The client runs on a small Tokio runtime of its own, so the synchronous transfer workers
//! and the sidecar's async handlers can both call in.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kvtier_core::{BlockKey, KvGeometry, NamespaceFingerprint, Secret};
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

use crate::remote_value::{
    REMOTE_HEADER_BYTES, encode_header, remote_key, remote_key_pattern, verify_header,
};
use crate::{PageWriter, PinnedPage, StoreError, WritePolicy};

mod direct_io;
use direct_io::{Command, Direct, DirectConfig, DirectIo};

/// Configuration of the remote tier (plain data; defaults documented per field).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RemoteTierConfig {
    /// Seed nodes of the cluster, `host:port` each (at least one; the rest are discovered).
    /// A list, or one string with commas (`"10.0.0.1:6379,10.0.0.2:6379"`, as a flag or an
    /// environment variable gives it).
    #[serde(deserialize_with = "node_list")]
    pub nodes: Vec<String>,
    /// ACL user (default `"off"`: the `default` user).
    #[serde(with = "kvtier_core::optional_setting")]
    pub username: Option<String>,
    /// Password of that user (default `"off"`). Printed as `<redacted>`; prefer
    /// `KVTIER_REMOTE__PASSWORD` to a flag, which other users see in `ps`.
    #[serde(with = "kvtier_core::optional_setting")]
    pub password: Option<Secret>,
    /// TLS to every node (default `false`), verified against the system's roots or
    /// `tls_ca_file`.
    pub tls: bool,
    /// A PEM file of the CA certificates to trust instead of the system's roots (default
    /// `"off"`); with `tls` only.
    #[serde(with = "kvtier_core::optional_setting")]
    pub tls_ca_file: Option<std::path::PathBuf>,
    /// Prefix of every key kvtier writes (default `kvtier`): fleets that share a cluster but
    /// not their KV use different prefixes.
    pub key_prefix: String,
    /// Connecting to a node, in milliseconds (default 2000).
    pub connect_timeout_ms: u64,
    /// One command (a block's GET or SET, an EXISTS), in milliseconds (default 2000): a read
    /// past it is a miss, a write past it is dropped.
    pub timeout_ms: u64,
    /// Which blocks are written to the cluster (default `write_through`: those hit
    /// `admit_min_hits` times in host memory; `all`: every stored block; `none`: read only).
    pub write_policy: WritePolicy,
    /// Hits that admit a block under `write_through` (default 2).
    pub admit_min_hits: u32,
    /// Blocks waiting for their write at most (default 256); each holds its host page pinned.
    /// Past it, blocks are dropped and counted (`queue_full`).
    pub max_pending_writes: usize,
    /// Writes in flight at once (default 8).
    pub write_concurrency: usize,
    /// Reads in flight at once (default 16).
    pub read_concurrency: usize,
    /// Wait between attempts to reach a cluster that was down at start, in milliseconds
    /// (default 2000).
    pub retry_ms: u64,
}

impl Default for RemoteTierConfig {
    fn default() -> Self {
        Self {
            nodes: Vec::new(),
            username: None,
            password: None,
            tls: false,
            tls_ca_file: None,
            key_prefix: "kvtier".into(),
            connect_timeout_ms: 2000,
            timeout_ms: 2000,
            write_policy: WritePolicy::WriteThrough,
            admit_min_hits: 2,
            max_pending_writes: 256,
            write_concurrency: 8,
            read_concurrency: 16,
            retry_ms: 2000,
        }
    }
}

impl RemoteTierConfig {
    /// Checks what the field types cannot: at least one node, each `host:port`; non-zero
    /// sizes and timeouts; a usable key prefix.
    ///
    /// # Errors
    /// What is wrong, naming the key (`remote.nodes`, …).
    pub fn validate(&self) -> Result<(), String> {
        let config = self;
        let bad = |reason: String| Err(reason);
        if config.nodes.is_empty() {
            return bad("remote.nodes is empty: name at least one node of the cluster (host:port)".into());
        }
        for n in &config.nodes {
            let ok = n
                .rsplit_once(':')
                .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
            if !ok {
                return bad(format!("remote.nodes: {n:?} is not host:port"));
            }
        }
        for (key, v) in [
            ("remote.max_pending_writes", config.max_pending_writes),
            ("remote.write_concurrency", config.write_concurrency),
            ("remote.read_concurrency", config.read_concurrency),
        ] {
            if v == 0 {
                return bad(format!("{key} = 0: give at least 1"));
            }
        }
        for (key, v) in [
            ("remote.timeout_ms", config.timeout_ms),
            ("remote.connect_timeout_ms", config.connect_timeout_ms),
        ] {
            if v == 0 {
                return bad(format!("{key} = 0: give a timeout in milliseconds"));
            }
        }
        if config.tls_ca_file.is_some() && !config.tls {
            return bad("remote.tls_ca_file is set but remote.tls = false: set remote.tls = true, or remove the CA file".into());
        }
        if config.admit_min_hits == 0 {
            return bad("remote.admit_min_hits = 0: give at least 1 (default 2)".into());
        }
        if config.key_prefix.is_empty() || config.key_prefix.contains(char::is_whitespace) {
            return bad(format!(
                "remote.key_prefix = {:?}: give a non-empty prefix without spaces",
                config.key_prefix
            ));
        }
        Ok(())
    }
}

/// Why a block was not written to the remote tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DropReason {
    /// `max_pending_writes` blocks were already waiting.
    QueueFull,
    /// The cluster is not connected.
    Unavailable,
    /// The write took longer than `timeout_ms`.
    Timeout,
    /// The cluster answered with an error (or the connection broke).
    Error,
}

impl DropReason {
    /// Every reason, in a fixed order.
    pub const ALL: [DropReason; 4] = [
        DropReason::QueueFull,
        DropReason::Unavailable,
        DropReason::Timeout,
        DropReason::Error,
    ];

    /// The metric label (`queue_full`, …).
    pub const fn name(self) -> &'static str {
        match self {
            DropReason::QueueFull => "queue_full",
            DropReason::Unavailable => "unavailable",
            DropReason::Timeout => "timeout",
            DropReason::Error => "error",
        }
    }
}

/// A snapshot of the remote tier's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct RemoteTierStats {
    /// Whether the cluster is connected now.
    pub connected: bool,
    /// Block reads asked for.
    pub reads_total: u64,
    /// Reads that found a value that verified.
    pub hits_total: u64,
    /// Reads that found no value (never written, evicted by the cluster, another namespace).
    pub misses_total: u64,
    /// Values that did not verify (header, key, namespace, length or payload checksum): misses,
    /// never served.
    pub corrupt_total: u64,
    /// Reads past the deadline.
    pub read_timeouts_total: u64,
    /// Reads that failed otherwise (connection, cluster error, not connected).
    pub read_errors_total: u64,
    /// Payload bytes read that verified.
    pub read_bytes_total: u64,
    /// Reads answered straight off the owning master's socket (hit, miss or corrupt); the
    /// rest went through the cluster client (TLS, a redirection, a node that failed).
    pub direct_reads_total: u64,
    /// Blocks written straight from the host page to the owning master's socket; the rest of
    /// `written_blocks_total` went through the cluster client.
    pub direct_writes_total: u64,
    /// Blocks written.
    pub written_blocks_total: u64,
    /// Payload bytes written.
    pub written_bytes_total: u64,
    /// Nanoseconds spent writing them (summed over concurrent writes).
    pub write_busy_ns_total: u64,
    /// Blocks not written, by reason (indexed by `reason as usize`, [`DropReason::ALL`]'s order).
    pub dropped_writes_total: [u64; 4],
    /// Blocks waiting for their write now.
    pub pending_writes: u64,
    /// Prefix lookups (EXISTS) that failed or timed out: counted as misses.
    pub lookup_errors_total: u64,
    /// Times a failure or timeout made the tier skipped for `retry_ms`.
    pub skipped_total: u64,
    /// Whether the tier is skipped now after a failure (see [`RemoteTier::available`]).
    pub skipping: bool,
}

impl RemoteTierStats {
    /// Blocks not written for `reason`.
    pub fn dropped(&self, reason: DropReason) -> u64 {
        self.dropped_writes_total[reason as usize]
    }
}

#[derive(Debug, Default)]
struct Counters {
    reads: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    corrupt: AtomicU64,
    read_timeouts: AtomicU64,
    read_errors: AtomicU64,
    read_bytes: AtomicU64,
    direct_reads: AtomicU64,
    direct_writes: AtomicU64,
    written: AtomicU64,
    written_bytes: AtomicU64,
    write_busy_ns: AtomicU64,
    dropped: [AtomicU64; 4],
    lookup_errors: AtomicU64,
    trips: AtomicU64,
}

/// The remote tier. Cheap to clone.
#[derive(Debug, Clone)]
pub struct RemoteTier {
    inner: Arc<Inner>,
}

struct Inner {
    config: RemoteTierConfig,
    geometry: KvGeometry,
    handle: tokio::runtime::Handle,
    /// Owned to be shut down without blocking when the tier is dropped (maybe on an async
    /// thread).
    runtime: Option<tokio::runtime::Runtime>,
    conn: Mutex<Option<ClusterConnection>>,
    connected: AtomicBool,
    /// Until when (ms since `epoch`) the tier is skipped after a lookup or read failed or
    /// timed out, so a cluster that went slow or away costs one timeout per `retry_ms`, not one
    /// per request.
    sick_until_ms: AtomicU64,
    epoch: Instant,
    counters: Counters,
    reads: Arc<Semaphore>,
    writes: Arc<Semaphore>,
    /// Block reads and writes on the masters' sockets (`None` with TLS: everything goes
    /// through the cluster client).
    direct: Option<Arc<DirectIo>>,
    /// Blocks queued or being written, and its waiters ([`RemoteTier::flush`]).
    pending: Mutex<u64>,
    /// First start and last end of the writes that succeeded since the last
    /// [`RemoteTier::take_write_window`].
    write_window: Mutex<Option<(Instant, Instant)>>,
    settled: Condvar,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteTier")
            .field("nodes", &self.config.nodes)
            .field("key_prefix", &self.config.key_prefix)
            .field("connected", &self.connected.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// `nodes` as a TOML list or one comma-separated string.
fn node_list<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Nodes {
        List(Vec<String>),
        One(String),
    }
    Ok(match Nodes::deserialize(d)? {
        Nodes::List(v) => v,
        Nodes::One(s) => s
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(str::to_owned)
            .collect(),
    })
}

fn remote_err(op: &'static str, reason: impl ToString) -> StoreError {
    StoreError::Remote {
        op,
        reason: reason.to_string(),
    }
}

/// Whether a connection error says the credentials are wrong (not worth retrying).
fn is_auth_error(e: &redis::RedisError) -> bool {
    if e.kind() == redis::ErrorKind::AuthenticationFailed {
        return true;
    }
    // The cluster client wraps the per-node failure in an I/O error ("Failed to create
    // initial connections - Io: Password authentication failed - AuthenticationFailed").
    let s = e.to_string();
    [
        "WRONGPASS",
        "NOAUTH",
        "NOPERM",
        "AuthenticationFailed",
        "authentication failed",
        "invalid password",
    ]
    .iter()
    .any(|m| s.contains(m))
}

/// Whether a connection error says the nodes' certificates are not trusted (or TLS does not
/// match what the nodes speak): a configuration error, not worth retrying.
fn is_certificate_error(e: &redis::RedisError) -> bool {
    let s = e.to_string();
    [
        "certificate",
        "UnknownIssuer",
        "InvalidCertificate",
        "NotValidForName",
        "tls handshake",
    ]
    .iter()
    .any(|m| s.contains(m))
}

impl RemoteTier {
    /// Connects to the cluster. A cluster that cannot be reached is not an error: the tier
    /// starts disconnected (every read a miss, every write dropped as `unavailable`), says so
    /// in the log, and keeps retrying every `retry_ms` in the background.
    ///
    /// # Blocking
    /// Up to `connect_timeout_ms` for the first attempt.
    ///
    /// # Errors
    /// [`StoreError::RemoteConfig`] as [`RemoteTierConfig::validate`] says, for an unreadable
    /// `tls_ca_file`, and when the nodes' certificates are not trusted;
    /// [`StoreError::RemoteAuth`] when the cluster refuses the credentials.
    pub fn open(geometry: KvGeometry, config: &RemoteTierConfig) -> Result<Self, StoreError> {
        config
            .validate()
            .map_err(|reason| StoreError::RemoteConfig { reason })?;
        let scheme = if config.tls { "rediss" } else { "redis" };
        let mut b = ClusterClientBuilder::new(config.nodes.iter().map(|n| format!("{scheme}://{n}")))
            .connection_timeout(Duration::from_millis(config.connect_timeout_ms))
            .response_timeout(Duration::from_millis(config.timeout_ms))
            .retries(2)
            .min_retry_wait(10)
            .max_retry_wait(200);
        if let Some(u) = &config.username {
            b = b.username(u);
        }
        if let Some(p) = &config.password {
            b = b.password(p.expose());
        }
        if config.tls {
            // rustls picks no provider by itself when the process could have two; ours is ring.
            // Already installed (by us or tonic) is fine.
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        if let Some(path) = &config.tls_ca_file {
            let root_cert = std::fs::read(path).map_err(|e| StoreError::RemoteConfig {
                reason: format!("remote.tls_ca_file = {:?}: cannot read it: {e}", path.display()),
            })?;
            b = b.certs(redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(root_cert),
            });
        }
        let client = b.build().map_err(|e| StoreError::RemoteConfig {
            reason: e.to_string(),
        })?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("kvtier-remote")
            .enable_all()
            .build()
            .map_err(|e| StoreError::io("start the remote tier's runtime", "<runtime>", e))?;
        let inner = Arc::new(Inner {
            config: config.clone(),
            geometry,
            handle: runtime.handle().clone(),
            runtime: Some(runtime),
            conn: Mutex::new(None),
            connected: AtomicBool::new(false),
            sick_until_ms: AtomicU64::new(0),
            epoch: Instant::now(),
            counters: Counters::default(),
            reads: Arc::new(Semaphore::new(config.read_concurrency)),
            writes: Arc::new(Semaphore::new(config.write_concurrency)),
            direct: (!config.tls).then(|| {
                Arc::new(DirectIo::new(DirectConfig {
                    username: config.username.clone(),
                    password: config.password.clone(),
                    connect_timeout: Duration::from_millis(config.connect_timeout_ms),
                    timeout: Duration::from_millis(config.timeout_ms),
                    retry: Duration::from_millis(config.retry_ms),
                    max_idle: config.read_concurrency + config.write_concurrency,
                }))
            }),
            pending: Mutex::new(0),
            write_window: Mutex::new(None),
            settled: Condvar::new(),
        });
        let tier = Self { inner };
        let first = tier.block_on(connect(client.clone(), config.connect_timeout_ms));
        match first {
            Ok(Ok(conn)) => tier.set_connected(conn),
            Ok(Err(e)) if is_auth_error(&e) => {
                return Err(StoreError::RemoteAuth {
                    nodes: config.nodes.join(","),
                    reason: e.to_string(),
                });
            }
            Ok(Err(e)) if is_certificate_error(&e) => {
                return Err(StoreError::RemoteConfig {
                    reason: format!(
                        "{}: the TLS handshake failed ({e}): check remote.tls and remote.tls_ca_file",
                        config.nodes.join(",")
                    ),
                });
            }
            Ok(Err(e)) => {
                tracing::warn!(nodes = %config.nodes.join(","), error = %e, retry_ms = config.retry_ms,
                    "remote tier unavailable at start; serving without it and retrying");
                tier.retry_in_background(client);
            }
            Err(e) => {
                tracing::warn!(nodes = %config.nodes.join(","), error = %e, retry_ms = config.retry_ms,
                    "remote tier unavailable at start; serving without it and retrying");
                tier.retry_in_background(client);
            }
        }
        Ok(tier)
    }

    fn set_connected(&self, conn: ClusterConnection) {
        self.direct(&conn);
        *lock(&self.inner.conn) = Some(conn);
        self.inner.connected.store(true, Ordering::Release);
        tracing::info!(nodes = %self.inner.config.nodes.join(","), "remote tier connected");
    }

    fn retry_in_background(&self, client: ClusterClient) {
        let weak = Arc::downgrade(&self.inner);
        let (retry_ms, timeout_ms) = (
            self.inner.config.retry_ms.max(10),
            self.inner.config.connect_timeout_ms,
        );
        self.inner.handle.spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(retry_ms)).await;
                let Some(inner) = weak.upgrade() else { return };
                drop(inner);
                match connect(client.clone(), timeout_ms).await {
                    Ok(conn) => {
                        if let Some(inner) = weak.upgrade() {
                            RemoteTier { inner }.set_connected(conn);
                        }
                        return;
                    }
                    Err(e) if is_auth_error(&e) => {
                        tracing::error!(error = %e, "remote tier refuses kvtier's credentials; giving up");
                        return;
                    }
                    Err(e) => tracing::debug!(error = %e, "remote tier still unavailable"),
                }
            }
        });
    }

    /// Runs `f` on the tier's runtime and waits for it; callable from any thread, an async
    /// runtime's included (it blocks that thread). `Err` if the runtime is gone.
    fn block_on<F>(&self, f: F) -> Result<F::Output, StoreError>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.inner.handle.spawn(async move {
            let _ = tx.send(f.await);
        });
        rx.recv()
            .map_err(|_| remote_err("call", "the remote tier's runtime stopped"))
    }

    fn conn(&self) -> Option<ClusterConnection> {
        lock(&self.inner.conn).clone()
    }

    fn key(&self, ns: NamespaceFingerprint, key: BlockKey) -> String {
        remote_key(&self.inner.config.key_prefix, ns, key)
    }

    fn timeout(&self) -> Duration {
        Duration::from_millis(self.inner.config.timeout_ms)
    }

    /// The configuration.
    pub fn config(&self) -> &RemoteTierConfig {
        &self.inner.config
    }

    /// Whether the cluster is connected now.
    pub fn connected(&self) -> bool {
        self.inner.connected.load(Ordering::Acquire)
    }

    /// Whether the tier is to be asked now: connected, and no lookup or read failed or timed
    /// out in the last `retry_ms`. While it is not, matches skip it, loads do not fetch from
    /// it and writes are dropped (`unavailable`).
    pub fn available(&self) -> bool {
        self.connected() && self.now_ms() >= self.inner.sick_until_ms.load(Ordering::Acquire)
    }

    fn now_ms(&self) -> u64 {
        self.inner.epoch.elapsed().as_millis() as u64
    }

    /// A lookup or read failed or timed out: skip the tier for `retry_ms`.
    fn trip(&self, why: &str) {
        let until = self.now_ms() + self.inner.config.retry_ms;
        let before = self.inner.sick_until_ms.fetch_max(until, Ordering::AcqRel);
        self.inner.counters.trips.fetch_add(1, Ordering::Relaxed);
        if before <= self.now_ms() {
            tracing::warn!(
                reason = why,
                retry_ms = self.inner.config.retry_ms,
                "remote tier failing; skipped until the retry interval passes"
            );
        }
    }

    /// How many of `keys` (of `ns`), from the first, the cluster holds: the run ends at the
    /// first key it lacks. Lookups that fail or time out end the run (counted).
    ///
    /// Cost: one EXISTS per key up to the first miss, 32 in flight at once; at most one
    /// `timeout_ms` per 32 keys. Nothing is read or pinned: a key may be evicted right after.
    pub fn match_run(&self, ns: NamespaceFingerprint, keys: &[BlockKey]) -> usize {
        let Some(conn) = self.conn().filter(|_| !keys.is_empty() && self.available()) else {
            return 0;
        };
        let names: Vec<String> = keys.iter().map(|&k| self.key(ns, k)).collect();
        let timeout = self.timeout();
        let result = self.block_on(async move {
            let mut run = 0usize;
            for batch in names.chunks(32) {
                let tasks: Vec<_> = batch
                    .iter()
                    .map(|name| {
                        let mut c = conn.clone();
                        let cmd = redis::cmd("EXISTS").arg(name).clone();
                        tokio::spawn(async move {
                            tokio::time::timeout(timeout, cmd.query_async::<bool>(&mut c)).await
                        })
                    })
                    .collect();
                // In order: the run ends at the first miss or failure (the batch's other
                // lookups finish unread).
                for t in tasks {
                    match t.await {
                        Ok(Ok(Ok(true))) => run += 1,
                        Ok(Ok(Ok(false))) => return Ok(run),
                        _ => return Err(run),
                    }
                }
            }
            Ok(run)
        });
        match result {
            Ok(Ok(n)) => n,
            // A lookup that failed ends the run where it failed.
            Ok(Err(n)) => {
                self.inner.counters.lookup_errors.fetch_add(1, Ordering::Relaxed);
                self.trip("lookup failed or timed out");
                n
            }
            Err(_) => {
                self.inner.counters.lookup_errors.fetch_add(1, Ordering::Relaxed);
                self.trip("lookup failed");
                0
            }
        }
    }

    /// Starts reading the blocks of `writers` (reserved host pages, of `ns`): every GET at
    /// once (`read_concurrency` in flight, each under `timeout_ms`); as each value arrives it
    /// is verified and copied into its page on the tier's runtime, while it is still in cache.
    /// [`RemoteReads::wait`] hands each writer back with the outcome; the caller publishes
    /// the pages that verified.
    ///
    /// Cost: one GET per block; one pass over each value (hash and copy together). Each read
    /// owns its page until handed back, so a load that goes away frees the pages only when
    /// their reads end (at most `timeout_ms`).
    pub fn start_reads(&self, ns: NamespaceFingerprint, writers: Vec<PageWriter>) -> RemoteReads {
        let c = &self.inner.counters;
        c.reads.fetch_add(writers.len() as u64, Ordering::Relaxed);
        let conn = self.conn();
        let timeout = self.timeout();
        let left = Arc::new((Mutex::new(writers.len()), Condvar::new()));
        let slots = writers
            .into_iter()
            .map(|writer| {
                let left = Arc::clone(&left);
                let key = writer.key();
                let (tx, rx) = std::sync::mpsc::sync_channel(1);
                let tier = self.clone();
                let conn = conn.clone();
                let name = self.key(ns, key);
                let permits = Arc::clone(&self.inner.reads);
                self.inner.handle.spawn(async move {
                    let fetched = match conn {
                        None => Fetched::Failed(FetchFailure::Unavailable),
                        Some(conn) => match permits.acquire_owned().await {
                            Err(_) => Fetched::Failed(FetchFailure::Unavailable),
                            Ok(_permit) => {
                                // The client's own response timeout is the same bound.
                                let deadline = tokio::time::Instant::now() + timeout;
                                let fetch = tier.fetch(conn, &name, ns, key, &writer, deadline);
                                tokio::time::timeout_at(deadline, fetch)
                                    .await
                                    .unwrap_or(Fetched::Failed(FetchFailure::Timeout))
                            }
                        },
                    };
                    let outcome = tier.settle(ns, key, fetched, &writer);
                    let _ = tx.send((writer, outcome));
                    let (n, all) = &*left;
                    let mut n = lock(n);
                    *n -= 1;
                    if *n == 0 {
                        all.notify_all();
                    }
                });
                Mutex::new(rx)
            })
            .collect();
        RemoteReads { slots, left }
    }

    /// Reads value `name` into `writer`'s page: straight off the owning master's socket
    /// ([`DirectIo`]) where it can, else a GET through the cluster client (verified into
    /// the page by [`RemoteTier::settle`]).
    async fn fetch(
        &self,
        mut conn: ClusterConnection,
        name: &str,
        ns: NamespaceFingerprint,
        key: BlockKey,
        writer: &PageWriter,
        deadline: tokio::time::Instant,
    ) -> Fetched {
        let len = self.inner.geometry.bytes_per_block();
        if let Some(d) = self.direct(&conn) {
            let get = Command::Get {
                name,
                ns,
                key,
                len,
                writer,
            };
            let found = match d.run(get, deadline).await {
                Direct::Copied => Some(Fetched::Copied),
                Direct::Absent => Some(Fetched::Absent),
                Direct::Corrupt(reason) => Some(Fetched::Corrupt(reason)),
                Direct::Refused | Direct::Fallback => None,
            };
            if let Some(found) = found {
                self.inner.counters.direct_reads.fetch_add(1, Ordering::Relaxed);
                return found;
            }
        }
        match redis::cmd("GET")
            .arg(name)
            .query_async::<Option<Vec<u8>>>(&mut conn)
            .await
        {
            Err(e) if e.is_timeout() => Fetched::Failed(FetchFailure::Timeout),
            Err(e) => Fetched::Failed(FetchFailure::Error(e.to_string())),
            Ok(None) => Fetched::Absent,
            Ok(Some(v)) => Fetched::Value(v),
        }
    }

    /// Counts what a read found and, for a value, verifies it into `writer`'s page.
    fn settle(
        &self,
        ns: NamespaceFingerprint,
        key: BlockKey,
        fetched: Fetched,
        writer: &PageWriter,
    ) -> Result<(), StoreError> {
        let c = &self.inner.counters;
        let not_found = StoreError::NotFound { key, tier: "remote" };
        match fetched {
            Fetched::Absent => {
                c.misses.fetch_add(1, Ordering::Relaxed);
                Err(not_found)
            }
            Fetched::Failed(FetchFailure::Unavailable) => {
                c.read_errors.fetch_add(1, Ordering::Relaxed);
                Err(not_found)
            }
            Fetched::Failed(FetchFailure::Timeout) => {
                c.read_timeouts.fetch_add(1, Ordering::Relaxed);
                self.trip("read timed out");
                Err(remote_err(
                    "read",
                    format!(
                        "block {key}: no answer within {} ms",
                        self.inner.config.timeout_ms
                    ),
                ))
            }
            Fetched::Failed(FetchFailure::Error(e)) => {
                c.read_errors.fetch_add(1, Ordering::Relaxed);
                self.trip("read failed");
                Err(remote_err("read", format!("block {key}: {e}")))
            }
            Fetched::Corrupt(reason) => Err(self.corrupt(ns, key, reason)),
            Fetched::Copied => {
                c.hits.fetch_add(1, Ordering::Relaxed);
                c.read_bytes
                    .fetch_add(self.inner.geometry.bytes_per_block() as u64, Ordering::Relaxed);
                Ok(())
            }
            Fetched::Value(v) => {
                let len = self.inner.geometry.bytes_per_block();
                let (payload, digest) =
                    verify_header(&v, ns, key, len).map_err(|reason| self.corrupt(ns, key, reason))?;
                let (dst_offset, _) = writer.layer_range(0)?;
                // Hash each piece as it is copied, while it is still in cache: one pass over
                // the value instead of two. The page is published only if the digest holds.
                let mut hash = kvtier_core::Xxh3Stream::new();
                for (i, piece) in payload.chunks(COPY_PIECE_BYTES).enumerate() {
                    hash.update(piece);
                    writer.region().write(dst_offset + i * COPY_PIECE_BYTES, piece)?;
                }
                if hash.digest() != digest {
                    return Err(self.corrupt(ns, key, "payload checksum"));
                }
                c.hits.fetch_add(1, Ordering::Relaxed);
                c.read_bytes.fetch_add(len as u64, Ordering::Relaxed);
                Ok(())
            }
        }
    }

    /// A value that does not verify: counted, logged, a miss.
    fn corrupt(&self, ns: NamespaceFingerprint, key: BlockKey, reason: &str) -> StoreError {
        self.inner.counters.corrupt.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(%key, reason, "remote value does not verify; treated as a miss");
        StoreError::CorruptBlock {
            key,
            path: format!("remote:{}", self.key(ns, key)).into(),
            reason: reason.into(),
        }
    }

    /// Queues the block of `page` (of `ns`) for writing and returns at once; the page stays
    /// pinned until it is written or dropped.
    ///
    /// Cost: on the tier's runtime, one xxh3 pass over the page and one SET, its payload sent
    /// straight from the page (`direct_io`); through the cluster client (TLS, a redirection,
    /// a master that failed), one more copy of the block into the command's buffer.
    ///
    /// # Errors
    /// The reason it was dropped (also counted): [`DropReason::Unavailable`],
    /// [`DropReason::QueueFull`].
    pub fn write_behind(&self, ns: NamespaceFingerprint, page: PinnedPage) -> Result<(), DropReason> {
        let inner = &self.inner;
        let Some(conn) = self.conn().filter(|_| self.available()) else {
            return Err(self.dropped(DropReason::Unavailable));
        };
        {
            let mut pending = lock(&inner.pending);
            if *pending >= inner.config.max_pending_writes as u64 {
                drop(pending);
                return Err(self.dropped(DropReason::QueueFull));
            }
            *pending += 1;
        }
        let tier = self.clone();
        let name = self.key(ns, page.key());
        let len = inner.geometry.bytes_per_block();
        let timeout = self.timeout();
        inner.handle.spawn(async move {
            let permits = Arc::clone(&tier.inner.writes);
            let outcome = match permits.acquire_owned().await {
                Err(_) => Err(DropReason::Unavailable),
                Ok(_permit) => {
                    let started = Instant::now();
                    let deadline = tokio::time::Instant::from_std(started) + timeout;
                    let r = tokio::time::timeout_at(
                        deadline,
                        tier.write_one(conn, &name, ns, page, len, deadline),
                    )
                    .await;
                    let c = &tier.inner.counters;
                    c.write_busy_ns
                        .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    // The client's own response timeout is the same bound.
                    r.unwrap_or(Err(DropReason::Timeout)).map(|()| started)
                }
            };
            match outcome {
                Ok(started) => {
                    let ended = Instant::now();
                    let mut w = lock(&tier.inner.write_window);
                    *w = Some(w.map_or((started, ended), |(s, e)| (s.min(started), e.max(ended))));
                    drop(w);
                    let c = &tier.inner.counters;
                    c.written.fetch_add(1, Ordering::Relaxed);
                    c.written_bytes.fetch_add(len as u64, Ordering::Relaxed);
                }
                Err(reason) => {
                    tier.dropped(reason);
                }
            }
            let mut pending = lock(&tier.inner.pending);
            *pending -= 1;
            tier.inner.settled.notify_all();
        });
        Ok(())
    }

    /// Writes the block of `page` as value `name`: straight from the page to the owning
    /// master's socket ([`DirectIo`]) where it can, else a `SET` through the cluster client.
    async fn write_one(
        &self,
        mut conn: ClusterConnection,
        name: &str,
        ns: NamespaceFingerprint,
        page: PinnedPage,
        len: usize,
        deadline: tokio::time::Instant,
    ) -> Result<(), DropReason> {
        let unreadable = |e: StoreError| {
            tracing::warn!(error = %e, "remote write: reading the host page failed");
            DropReason::Error
        };
        let (offset, header) = value_header(ns, &page, len).map_err(unreadable)?;
        if let Some(d) = self.direct(&conn) {
            let set = Command::Set {
                name,
                header: &header,
                page: &page,
                offset,
                len,
            };
            match d.run(set, deadline).await {
                Direct::Copied => {
                    self.inner.counters.direct_writes.fetch_add(1, Ordering::Relaxed);
                    return Ok(());
                }
                Direct::Refused => {
                    tracing::debug!(key = %name, "remote write refused by the cluster");
                    return Err(DropReason::Error);
                }
                _ => {}
            }
        }
        let cmd = set_command(name, &header, &page, offset, len);
        drop(page);
        let cmd = cmd.map_err(unreadable)?;
        match cmd.query_async::<()>(&mut conn).await {
            Ok(()) => Ok(()),
            Err(e) if e.is_timeout() => Err(DropReason::Timeout),
            Err(e) => {
                tracing::debug!(error = %e, key = %name, "remote write failed");
                Err(DropReason::Error)
            }
        }
    }

    /// The direct path, if the tier has one (no TLS); asks the cluster for the slot map in the
    /// background when it has none (`conn` is the cluster client's connection to ask on).
    fn direct(&self, conn: &ClusterConnection) -> Option<&Arc<DirectIo>> {
        let d = self.inner.direct.as_ref()?;
        if d.needs_refresh() {
            self.inner.handle.spawn(Arc::clone(d).refresh(conn.clone()));
        }
        Some(d)
    }

    /// When the writes that succeeded since the last call ran: the first one's start and
    /// the last one's end (`None` if none did). What a benchmark divides their bytes by.
    pub fn take_write_window(&self) -> Option<(Instant, Instant)> {
        lock(&self.inner.write_window).take()
    }

    fn dropped(&self, reason: DropReason) -> DropReason {
        self.inner.counters.dropped[reason as usize].fetch_add(1, Ordering::Relaxed);
        reason
    }

    /// Waits until no write is queued or running, at most `timeout`; `true` if none is left.
    ///
    /// # Blocking
    /// Up to `timeout`.
    pub fn flush(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut pending = lock(&self.inner.pending);
        while *pending > 0 {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            pending = self
                .inner
                .settled
                .wait_timeout(pending, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }

    /// Deletes every block of `ns` (or of every namespace) under this tier's key prefix from
    /// the cluster; returns how many. Other fleets' prefixes are untouched.
    ///
    /// Cost: a SCAN of every master, one UNLINK per key found.
    ///
    /// # Errors
    /// [`StoreError::Remote`] if the cluster is not connected or a node fails.
    pub fn clear(&self, ns: Option<NamespaceFingerprint>) -> Result<u64, StoreError> {
        let Some(conn) = self.conn() else {
            return Err(remote_err("clear", "not connected"));
        };
        let pattern = remote_key_pattern(&self.inner.config.key_prefix, ns);
        self.block_on(clear_matching(conn, pattern))?
    }

    /// Flips one payload byte of every value under this tier's key prefix, as damage at rest
    /// would (the conformance suite's fault); returns how many. Test support only.
    ///
    /// # Errors
    /// [`StoreError::Remote`] if the cluster is not connected or a node fails.
    #[cfg(any(test, feature = "test-util"))]
    pub fn damage_all(&self) -> Result<u64, StoreError> {
        let Some(mut conn) = self.conn() else {
            return Err(remote_err("damage", "not connected"));
        };
        let pattern = remote_key_pattern(&self.inner.config.key_prefix, None);
        self.block_on(async move {
            let mut n = 0;
            for k in scan_keys(&mut conn, &pattern).await? {
                let v: Option<Vec<u8>> = redis::cmd("GET")
                    .arg(&k)
                    .query_async(&mut conn)
                    .await
                    .map_err(|e| remote_err("damage", e))?;
                let Some(mut v) = v else { continue };
                let at = (crate::remote_value::REMOTE_HEADER_BYTES + 1000).min(v.len() - 1);
                v[at] ^= 0x40;
                redis::cmd("SET")
                    .arg(&k)
                    .arg(v)
                    .query_async::<()>(&mut conn)
                    .await
                    .map_err(|e| remote_err("damage", e))?;
                n += 1;
            }
            Ok(n)
        })?
    }

    /// Counters.
    pub fn stats(&self) -> RemoteTierStats {
        let c = &self.inner.counters;
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RemoteTierStats {
            connected: self.connected(),
            reads_total: r(&c.reads),
            hits_total: r(&c.hits),
            misses_total: r(&c.misses),
            corrupt_total: r(&c.corrupt),
            read_timeouts_total: r(&c.read_timeouts),
            read_errors_total: r(&c.read_errors),
            read_bytes_total: r(&c.read_bytes),
            direct_reads_total: r(&c.direct_reads),
            direct_writes_total: r(&c.direct_writes),
            written_blocks_total: r(&c.written),
            written_bytes_total: r(&c.written_bytes),
            write_busy_ns_total: r(&c.write_busy_ns),
            dropped_writes_total: std::array::from_fn(|i| r(&c.dropped[i])),
            pending_writes: *lock(&self.inner.pending),
            lookup_errors_total: r(&c.lookup_errors),
            skipped_total: r(&c.trips),
            skipping: self.connected() && !self.available(),
        }
    }
}

async fn connect(client: ClusterClient, timeout_ms: u64) -> Result<ClusterConnection, redis::RedisError> {
    let attempt = async {
        let mut conn = client.get_async_connection().await?;
        // A cluster that accepts the connection but not our credentials says so here.
        redis::cmd("PING").query_async::<String>(&mut conn).await?;
        Ok(conn)
    };
    match tokio::time::timeout(Duration::from_millis(timeout_ms), attempt).await {
        Ok(r) => r,
        Err(_) => Err(redis::RedisError::from((
            redis::ErrorKind::Io,
            "connect timed out",
            format!("after {timeout_ms} ms"),
        ))),
    }
}

/// `SET name value` for the block at `offset` of `page`, the value (`header` + payload)
/// written straight from the host page into the command's buffer: one copy.
fn set_command(
    name: &str,
    header: &[u8; REMOTE_HEADER_BYTES],
    page: &PinnedPage,
    offset: usize,
    len: usize,
) -> Result<redis::Cmd, StoreError> {
    use redis::RedisWrite;
    use std::io::Write;
    let mut cmd = redis::cmd("SET");
    cmd.arg(name);
    // SAFETY: `page` is a pin on a published block. Host pages are written only through the
    // `PageWriter` of a reserved page, never once published, and a pinned page is neither
    // evicted nor reused; the host arena is kvtier's own memory. So nothing writes these bytes
    // while the view lives.
    unsafe {
        page.region().with_bytes(offset, len, |payload| {
            let mut w = cmd.writer_for_next_arg();
            // Writes into a growable buffer cannot fail.
            let _ = w.write_all(header);
            let _ = w.write_all(payload);
        })?;
    }
    Ok(cmd)
}

/// Where the block of `page` starts in its region, and its value header (one xxh3 pass over
/// the page).
fn value_header(
    ns: NamespaceFingerprint,
    page: &PinnedPage,
    len: usize,
) -> Result<(usize, [u8; REMOTE_HEADER_BYTES]), StoreError> {
    let (offset, _) = page.layer_range(0)?;
    // SAFETY: as in `set_command`: a pinned, published host page is written by no one.
    let digest = unsafe { page.region().with_bytes(offset, len, kvtier_core::xxh3_64)? };
    Ok((offset, encode_header(ns, page.key(), len as u64, digest)))
}

/// The masters that answer now, `(host, port)`.
async fn masters(conn: &mut ClusterConnection) -> Result<Vec<(String, u16)>, StoreError> {
    let nodes: String = redis::cmd("CLUSTER")
        .arg("NODES")
        .query_async(conn)
        .await
        .map_err(|e| remote_err("clear", e))?;
    Ok(nodes
        .lines()
        .filter(|l| {
            let flags = l.split(' ').nth(2).unwrap_or("");
            flags.contains("master") && !flags.contains("fail")
        })
        .filter_map(|l| {
            let addr = l.split(' ').nth(1)?.split('@').next()?;
            let (h, p) = addr.rsplit_once(':')?;
            Some((h.to_string(), p.parse().ok()?))
        })
        .collect())
}

/// Every key matching `pattern` on every master.
async fn scan_keys(conn: &mut ClusterConnection, pattern: &str) -> Result<Vec<String>, StoreError> {
    let mut found = Vec::new();
    for (host, port) in masters(conn).await? {
        let mut cursor = 0u64;
        loop {
            let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                host: host.clone(),
                port,
            });
            let cmd = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(pattern)
                .arg("COUNT")
                .arg(1000)
                .clone();
            let v = conn
                .route_command(cmd, routing)
                .await
                .map_err(|e| remote_err("clear", e))?;
            let (next, keys): (u64, Vec<String>) =
                redis::from_redis_value(v).map_err(|e| remote_err("clear", e))?;
            found.extend(keys);
            if next == 0 {
                break;
            }
            cursor = next;
        }
    }
    Ok(found)
}

async fn clear_matching(mut conn: ClusterConnection, pattern: String) -> Result<u64, StoreError> {
    let mut removed = 0u64;
    for k in scan_keys(&mut conn, &pattern).await? {
        let n: u64 = redis::cmd("UNLINK")
            .arg(&k)
            .query_async(&mut conn)
            .await
            .map_err(|e| remote_err("clear", e))?;
        removed += n;
    }
    Ok(removed)
}

/// Bytes hashed and copied at a time when a value is moved into a host page: small enough to
/// stay in L2 between the two.
const COPY_PIECE_BYTES: usize = 256 << 10;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[derive(Debug)]
enum FetchFailure {
    Unavailable,
    Timeout,
    Error(String),
}

#[derive(Debug)]
enum Fetched {
    /// A value through the cluster client, to verify.
    Value(Vec<u8>),
    /// Read straight into the page and verified ([`DirectIo`]).
    Copied,
    /// Read straight off the socket but did not verify (what did not).
    Corrupt(&'static str),
    Absent,
    Failed(FetchFailure),
}

/// Reads started by [`RemoteTier::start_reads`]: each block's page is handed back once, with
/// what its read found, in any order. Dropping it abandons the rest (each page is freed, never
/// published, when its read ends).
#[derive(Debug)]
pub struct RemoteReads {
    /// One receiver per block (behind a lock so the handle can be shared by workers).
    #[allow(clippy::type_complexity)]
    slots: Vec<Mutex<std::sync::mpsc::Receiver<(PageWriter, Result<(), StoreError>)>>>,
    /// Reads not ended yet, and their waiters ([`RemoteReads::wait_all`]).
    left: Arc<(Mutex<usize>, Condvar)>,
}

impl RemoteReads {
    /// Waits for block `i`'s read and hands its page back with the outcome: `Ok` if the page
    /// now holds the block, verified (publish it); otherwise [`StoreError::NotFound`] (absent,
    /// or the tier unavailable), [`StoreError::CorruptBlock`] (did not verify; counted) or
    /// [`StoreError::Remote`] (timeout or cluster error; counted), and the page's bytes are
    /// unspecified. `None` if the page was already handed back or its read was lost.
    ///
    /// # Blocking
    /// Until its GET ends: at most the tier's `timeout_ms` after it started.
    pub fn wait(&self, i: usize) -> Option<(PageWriter, Result<(), StoreError>)> {
        lock(&self.slots[i]).recv().ok()
    }

    /// Blocks until every read has ended (each within the tier's `timeout_ms` of its start):
    /// a worker that then takes the pages back with [`RemoteReads::wait`] is woken once per
    /// load, not once per block.
    pub fn wait_all(&self) {
        let (n, all) = &*self.left;
        let mut n = lock(n);
        while *n > 0 {
            n = all.wait(n).unwrap_or_else(|e| e.into_inner());
        }
    }
}

#[cfg(test)]
mod tests;
