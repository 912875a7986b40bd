//! Running the sidecar: tiers, queues, listeners (Unix socket, optional TCP with TLS and a
//! bearer token), health and reflection services, the metrics exporter, graceful shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kvtier_store::TieredStore;
use kvtier_transfer::TransferQueues;
use tokio::sync::{oneshot, watch};
use tonic::transport::{Identity, Server, ServerTlsConfig};
use tonic::{Request, Status};

use crate::service::KvTierService;
use crate::state::ServerState;
use crate::stats::Snapshot;
use crate::{Secret, ServerConfig, ServerError, SocketMode, metric_names};
use kvtier_proto::proto::kv_tier_server::KvTierServer;

/// Where a running sidecar listens, handed to the caller once it accepts requests.
#[derive(Debug, Clone)]
pub struct ServeInfo {
    /// The Unix socket.
    pub socket: PathBuf,
    /// The TCP address, if any.
    pub tcp: Option<SocketAddr>,
    /// The metrics exporter's address, if any.
    pub metrics: Option<SocketAddr>,
    /// The state (for in-process benchmarks and tests).
    pub state: Arc<ServerState>,
}

/// Runs the sidecar until `shutdown` resolves, then stops accepting, lets in-flight requests
/// finish (up to `server.shutdown_grace_ms`), ends sessions (releasing their pins), lets the
/// disk writes of acknowledged stores finish (up to `server.shutdown_grace_ms` more; blocks
/// still waiting then are logged with their count), flushes the disk tier to stable storage
/// and lets queued remote-tier writes finish (up to the grace period again).
/// `ready` receives the listeners once the host arena is populated and the sockets accept
/// requests.
///
/// # Errors
/// Configuration, tier, listener and exporter errors at start.
///
/// # Cancel safety
/// Not cancel safe: dropping the future stops serving at once, without the drain above
/// (stores acknowledged but not yet written to disk are lost, and the disk tier is not
/// flushed). To stop, complete `shutdown` and await the future to its end.
pub async fn serve(
    config: ServerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
    ready: Option<oneshot::Sender<ServeInfo>>,
) -> Result<(), ServerError> {
    config.validate()?;
    let geometry = config.model.geometry()?;
    // Populates the whole host arena before anything listens: readiness means warm memory.
    let store_config = config.store_config();
    let (store, recovery) = tokio::task::spawn_blocking(move || TieredStore::open(geometry, &store_config))
        .await
        .map_err(|e| ServerError::Config(format!("opening the tiers failed: {e}")))??;
    if let Some(r) = recovery {
        tracing::info!(
            entries = r.entries,
            corrupt = r.corrupt,
            torn = r.torn,
            "disk tier recovered"
        );
    }
    let queues = TransferQueues::new(&config.transfer)?;
    let state = Arc::new(ServerState::new(config.clone(), geometry, store, queues));
    let metrics = match config.server.metrics {
        Some(addr) => Some(start_metrics(addr, &state)?),
        None => None,
    };

    {
        let state = Arc::clone(&state);
        tokio::task::spawn_blocking(move || crate::cuda_setup::start(&state.store))
            .await
            .map_err(|e| ServerError::Config(format!("CUDA start-up failed: {e}")))?;
    }

    let (stop_tx, stop_rx) = watch::channel(false);
    let service = KvTierService::new(Arc::clone(&state), stop_rx.clone());
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<KvTierServer<KvTierService>>().await;
    // Reflection in both versions clients speak: v1, and v1alpha (grpcio-reflection's client,
    // older grpcurl).
    let reflection_builder = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(kvtier_proto::proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection = reflection_builder()
        .build_v1()
        .map_err(|e| ServerError::Config(format!("reflection: {e}")))?;
    let reflection_alpha = reflection_builder()
        .build_v1alpha()
        .map_err(|e| ServerError::Config(format!("reflection v1alpha: {e}")))?;

    // Expired soft pins are released in the background.
    let expiry_state = Arc::clone(&state);
    let mut expiry_stop = stop_rx.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        loop {
            tokio::select! {
                _ = tick.tick() => { expiry_state.sessions.expire_pins(std::time::Instant::now()); }
                _ = expiry_stop.changed() => return,
            }
        }
    });

    let socket = config.server.socket.clone();
    let unix = bind_unix(&socket, config.server.socket_mode)?;
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let unix_server = Server::builder()
        .add_service(health_service.clone())
        .add_service(reflection.clone())
        .add_service(reflection_alpha.clone())
        .add_service(kvtier_server(service.clone(), &config))
        .serve_with_incoming_shutdown(
            // Clients that send their socket path as `:authority` are served too.
            tokio_stream::StreamExt::map(tokio_stream::wrappers::UnixListenerStream::new(unix), |c| {
                c.map(crate::uds_authority::AuthorityFix::new)
            }),
            stopped(stop_rx.clone()),
        );
    let unix_task = tokio::spawn(unix_server);

    let tcp_task = match config.server.tcp {
        Some(addr) => {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| ServerError::Listen {
                    what: addr.to_string(),
                    source: e,
                })?;
            let local = listener.local_addr().map_err(|e| ServerError::Listen {
                what: addr.to_string(),
                source: e,
            })?;
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
            let mut builder = Server::builder();
            if let (Some(cert), Some(key)) = (&config.server.tls_cert, &config.server.tls_key) {
                let read = |p: &Path| {
                    std::fs::read(p)
                        .map_err(|e| ServerError::Config(format!("cannot read {}: {e}", p.display())))
                };
                builder = builder
                    .tls_config(ServerTlsConfig::new().identity(Identity::from_pem(read(cert)?, read(key)?)))
                    .map_err(|e| ServerError::Config(format!("TLS: {e}")))?;
            }
            let token = config.server.bearer_token()?;
            let auth = tonic::service::InterceptorLayer::new(move |req: Request<()>| {
                check_token(req, token.as_ref().map(Secret::expose))
            });
            let server = builder
                .layer(auth)
                .add_service(health_service)
                .add_service(reflection)
                .add_service(reflection_alpha)
                .add_service(kvtier_server(service, &config))
                .serve_with_incoming_shutdown(incoming, stopped(stop_rx.clone()));
            Some((local, tokio::spawn(server)))
        }
        None => None,
    };

    tracing::info!(
        socket = %socket.display(),
        tcp = ?tcp_task.as_ref().map(|t| t.0),
        metrics = ?metrics,
        geometry = %geometry,
        "kvtier serving"
    );
    if let Some(ready) = ready {
        let _ = ready.send(ServeInfo {
            socket: socket.clone(),
            tcp: tcp_task.as_ref().map(|t| t.0),
            metrics,
            state: Arc::clone(&state),
        });
    }

    shutdown.await;
    tracing::info!("shutting down: no new requests, ending sessions");
    health.set_not_serving::<KvTierServer<KvTierService>>().await;
    let _ = stop_tx.send(true);
    let grace = Duration::from_millis(config.server.shutdown_grace_ms);
    let servers = async {
        let _ = unix_task.await;
        if let Some((_, t)) = tcp_task {
            let _ = t.await;
        }
    };
    if tokio::time::timeout(grace, servers).await.is_err() {
        tracing::warn!(
            grace_ms = grace.as_millis() as u64,
            "requests still running at the end of the grace period"
        );
    }
    state.sessions.close_all();
    let drain = Arc::clone(&state);
    let drained = tokio::task::spawn_blocking(move || {
        drain.queues.load.wait_idle();
        // A store is acknowledged once its blocks are in host memory; under the write policy
        // their disk writes are still queued. They finish before the process goes.
        let deadline = std::time::Instant::now() + grace;
        let idle = drain.queues.store.wait_idle_until(deadline);
        (idle, drain.queues.store.stats().pending_disk_blocks)
    })
    .await;
    match drained {
        Ok((true, _)) => {}
        Ok((false, pending)) => tracing::warn!(
            pending_disk_blocks = pending,
            grace_ms = grace.as_millis() as u64,
            "disk writes still pending at the end of the grace period; those blocks are not on disk"
        ),
        Err(e) => tracing::warn!(error = %e, "waiting for the transfer queues failed"),
    }
    if let Some(d) = state.store.disk() {
        let d = d.clone();
        let flushed = tokio::task::spawn_blocking(move || d.flush().map(|()| d.stats().entries))
            .await
            .map_err(|e| e.to_string())
            .and_then(|r| r.map_err(|e| e.to_string()));
        match flushed {
            Ok(entries) => tracing::info!(entries, "disk tier flushed"),
            Err(error) => tracing::warn!(%error, "disk tier flush failed"),
        }
    }
    if let Some(r) = state.store.remote() {
        // Acknowledged stores queued for the remote tier: written before the process goes,
        // within the grace period (the fleet's other nodes would otherwise miss them).
        let r = r.clone();
        let flushed = tokio::task::spawn_blocking(move || (r.flush(grace), r.stats().pending_writes)).await;
        match flushed {
            Ok((true, _)) => tracing::info!("remote tier writes flushed"),
            Ok((false, pending)) => tracing::warn!(
                pending_remote_blocks = pending,
                grace_ms = grace.as_millis() as u64,
                "remote writes still pending at the end of the grace period; those blocks are not in the remote tier"
            ),
            Err(e) => tracing::warn!(error = %e, "waiting for the remote tier failed"),
        }
    }
    let _ = std::fs::remove_file(&socket);
    tracing::info!("kvtier stopped");
    Ok(())
}

/// Binds the Unix socket with mode 0600, replacing a stale socket file but never a live one.
/// The KvTier service with its message limit sized from the batch limit
/// ([`kvtier_proto::codec::max_message_bytes`]): `server.max_batch_blocks` blocks fit in a
/// request of any form, and larger messages are OUT_OF_RANGE before they are read.
fn kvtier_server(service: KvTierService, config: &ServerConfig) -> KvTierServer<KvTierService> {
    let limit =
        kvtier_proto::codec::max_message_bytes(config.server.max_batch_blocks, config.model.block_tokens);
    KvTierServer::new(service)
        .max_decoding_message_size(limit)
        .max_encoding_message_size(limit)
}

/// Binds the Unix socket and gives it `mode`, whatever the process's umask. (Connecting
/// needs write permission on the socket file; to keep other users out before the chmod too,
/// put the socket in a directory only its users may enter, as the deploy files do.)
fn bind_unix(path: &Path, mode: SocketMode) -> Result<tokio::net::UnixListener, ServerError> {
    let listen_err = |e| ServerError::Listen {
        what: path.display().to_string(),
        source: e,
    };
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(ServerError::SocketInUse(path.to_owned()));
        }
        std::fs::remove_file(path).map_err(listen_err)?;
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(listen_err)?;
    }
    let listener = tokio::net::UnixListener::bind(path).map_err(listen_err)?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode.bits())).map_err(listen_err)?;
    Ok(listener)
}

/// Requires `authorization: Bearer <token>` when a token is configured.
fn check_token(req: Request<()>, token: Option<&str>) -> Result<Request<()>, Status> {
    let Some(token) = token else { return Ok(req) };
    let given = req
        .metadata()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    // Constant-time comparison: no timing hint about how much of the token matched.
    let same = given.len() == token.len()
        && given
            .bytes()
            .zip(token.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0;
    if same {
        Ok(req)
    } else {
        Err(Status::unauthenticated("missing or wrong bearer token"))
    }
}

/// Installs the Prometheus exporter on `addr` and publishes a snapshot every second.
fn start_metrics(addr: SocketAddr, state: &Arc<ServerState>) -> Result<SocketAddr, ServerError> {
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(addr)
        .set_buckets(&[
            0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
            1.0, 2.5,
        ])
        .and_then(|b| b.install())
        .map_err(|e| ServerError::Metrics {
            addr,
            reason: e.to_string(),
        })?;
    metric_names::describe();
    metric_names::register_event_series();
    // The first snapshot now, so every family is there before the socket serves.
    Snapshot::take(state).publish();
    let state = Arc::clone(state);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            let s = Arc::clone(&state);
            if let Ok(snapshot) = tokio::task::spawn_blocking(move || Snapshot::take(&s)).await {
                snapshot.publish();
            }
        }
    });
    Ok(addr)
}
