//! kvtier-client: what an engine links to use the kvtier sidecar.
//!
//! ```no_run
//! # async fn demo(pool: &kvtier_transfer::CpuDevicePool) -> Result<(), kvtier_client::ClientError> {
//! let mut kv = kvtier_client::Client::connect("unix:///tmp/kvtier.sock", "engine-0").await?;
//! let handle = kv.register_cpu_pool(pool, "Qwen/Qwen3-30B-A3B", 0, 1).await?;
//! let tokens: Vec<u32> = (0..640).collect();
//! let m = kv.match_tokens(&handle, "", &tokens).await?;
//! println!("{} of {} tokens cached", m.matched_tokens, tokens.len());
//! # Ok(()) }
//! ```
//!
//! The session lives as long as the [`Client`]: dropping it (or the process dying) ends the
//! session, and the sidecar then releases its pins and unregisters its pools.
#![warn(missing_docs)]

use std::path::PathBuf;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use kvtier_core::{BlockHasher, BlockKey, CoreError, KvGeometry, Namespace, NamespaceFingerprint};
use kvtier_proto::proto::kv_tier_client::KvTierClient;
use kvtier_proto::wire::{pack_key, pack_keys};
use kvtier_proto::{ProtoError, geometry_from_proto};
use kvtier_transfer::{CpuDevicePool, DevicePool};
use tonic::metadata::MetadataValue;
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint, Uri};
use tonic::{Request, Status};

/// The generated kvtier.v1 messages, for calls through [`Client::rpc`] and the replies this
/// client returns as they come.
pub use kvtier_proto::proto;
pub use kvtier_proto::proto::{MatchResponse, PinResponse, StoreResponse, Tier};
pub use kvtier_proto::{LoadDone, LoadEvent, WireTiming};

/// Why a client call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The sidecar could not be reached.
    #[error("cannot connect to kvtier at {target}: {source}")]
    Connect {
        /// What was dialled.
        target: String,
        /// Why.
        source: tonic::transport::Error,
    },
    /// The sidecar refused the request (the status names the reason).
    #[error("kvtier: {}: {}", .0.code(), .0.message())]
    Status(#[from] Status),
    /// The sidecar answered something this client did not expect.
    #[error("kvtier protocol: {0}")]
    Protocol(String),
    /// A reply field that does not decode (keys of a bad length, an unknown dtype).
    #[error("kvtier protocol: {0}")]
    Proto(#[from] ProtoError),
    /// A geometry or namespace error.
    #[error(transparent)]
    Core(#[from] CoreError),
}

/// Adds the bearer token (TCP listeners off loopback require one).
#[derive(Debug, Clone, Default)]
pub struct Auth(Option<MetadataValue<tonic::metadata::Ascii>>);

impl Interceptor for Auth {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

/// The generated gRPC stub with the bearer-token interceptor.
pub type Stub = KvTierClient<InterceptedService<Channel, Auth>>;

/// A registered device pool: its id and the namespace keys are hashed in.
#[derive(Debug, Clone)]
pub struct PoolHandle {
    /// The sidecar's id for it.
    pub id: u64,
    model_id: String,
    geometry: KvGeometry,
    tp_rank: u32,
    tp_size: u32,
}

impl PoolHandle {
    /// The namespace of this pool under `salt`.
    ///
    /// # Errors
    /// [`CoreError`] for a salt over 1 KiB.
    pub fn namespace(&self, salt: &str) -> Result<NamespaceFingerprint, CoreError> {
        Ok(Namespace::new(
            self.model_id.clone(),
            self.geometry,
            self.tp_rank,
            self.tp_size,
            salt,
        )?
        .fingerprint())
    }

    /// The block keys of a token sequence (from token 0), as the sidecar computes them.
    ///
    /// # Errors
    /// As [`PoolHandle::namespace`].
    pub fn keys(&self, salt: &str, tokens: &[u32]) -> Result<Vec<BlockKey>, CoreError> {
        Ok(BlockHasher::new(self.namespace(salt)?, self.geometry.block_tokens()).keys(tokens))
    }
}

/// Everything a load reported.
#[derive(Debug, Clone, Default)]
pub struct LoadOutcome {
    /// Layers announced ready, in order.
    pub layers_ready: Vec<u32>,
    /// Blocks announced missing before the layers (disk reads that failed).
    pub missing_announced: Vec<BlockKey>,
    /// The final report.
    pub done: LoadDone,
}

/// A load's events as they arrive ([`Client::load`]), decoded: keys unpacked, timings as
/// [`WireTiming`].
///
/// Dropping it before [`LoadEvent::Done`] cancels the load: the sidecar sees the stream go
/// away, skips the copies that have not started and releases the load's pins. Copies already
/// running finish, so the load's slots may be partly written: treat them as garbage.
#[derive(Debug)]
pub struct LoadStream {
    events: tonic::Streaming<proto::LoadEvent>,
}

impl LoadStream {
    /// The next event; `None` when the stream has ended (after [`LoadEvent::Done`], or early:
    /// a sidecar that went away mid-load ends the stream without a report). Messages with no
    /// event set (an event kind newer than this client) are skipped. Waits on the network;
    /// allocates the keys of `Missing` and `Done`.
    ///
    /// # Errors
    /// The sidecar's status (`DEADLINE_EXCEEDED` when the load's deadline passed, …);
    /// [`ClientError::Proto`] for an event that does not decode.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the returned future (in a `select!`, a timeout) loses no event;
    /// the next call returns it. Only dropping the [`LoadStream`] cancels the load.
    pub async fn next(&mut self) -> Result<Option<LoadEvent>, ClientError> {
        while let Some(m) = self.events.message().await? {
            if let Some(e) = LoadEvent::from_proto(m)? {
                return Ok(Some(e));
            }
        }
        Ok(None)
    }
}

/// A connection and a session with the kvtier sidecar. Clones share the connection and the
/// session (for concurrent calls); the session ends when the last clone is dropped.
#[derive(Debug, Clone)]
pub struct Client {
    rpc: Stub,
    session_id: u64,
    geometry: KvGeometry,
    _session: std::sync::Arc<SessionTask>,
}

/// The task that keeps the session stream open.
#[derive(Debug)]
struct SessionTask(tokio::task::JoinHandle<()>);

impl Drop for SessionTask {
    fn drop(&mut self) {
        // Ends the session stream: the sidecar releases this session's pins and pools.
        self.0.abort();
    }
}

/// Opens a channel to `target`: `unix:///path` (or a bare path) for the Unix socket,
/// `http://host:port` or `https://host:port` for TCP.
///
/// # Errors
/// [`ClientError::Connect`].
pub async fn channel(target: &str) -> Result<Channel, ClientError> {
    let err = |source| ClientError::Connect {
        target: target.to_owned(),
        source,
    };
    if target.starts_with("http://") || target.starts_with("https://") {
        return Endpoint::from_shared(target.to_owned())
            .map_err(err)?
            .connect()
            .await
            .map_err(err);
    }
    let path = PathBuf::from(target.strip_prefix("unix://").unwrap_or(target));
    // The URI is required by the API and ignored by the connector.
    Endpoint::from_static("http://kvtier.sock")
        .connect_timeout(Duration::from_secs(5))
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?)) }
        }))
        .await
        .map_err(err)
}

impl Client {
    /// Connects and opens a session (see [`channel`] for `target`).
    ///
    /// # Errors
    /// [`ClientError::Connect`], or the sidecar's status.
    ///
    /// # Cancel safety
    /// Dropping the future closes the connection; a session the sidecar had already opened
    /// ends with its stream, as when a [`Client`] is dropped.
    pub async fn connect(target: &str, client_name: &str) -> Result<Self, ClientError> {
        Self::connect_with_token(target, client_name, None).await
    }

    /// [`Client::connect`] with a bearer token.
    ///
    /// # Errors
    /// As [`Client::connect`]; [`ClientError::Protocol`] for a token that is not ASCII,
    /// [`ClientError::Proto`] for a session that opened with a geometry this client cannot
    /// decode.
    ///
    /// # Cancel safety
    /// As [`Client::connect`].
    pub async fn connect_with_token(
        target: &str,
        client_name: &str,
        token: Option<&str>,
    ) -> Result<Self, ClientError> {
        let auth = match token {
            Some(t) => {
                Auth(Some(format!("Bearer {t}").parse().map_err(|_| {
                    ClientError::Protocol("the token is not ASCII".into())
                })?))
            }
            None => Auth(None),
        };
        let mut rpc = KvTierClient::with_interceptor(channel(target).await?, auth);
        let mut events = rpc
            .open_session(proto::OpenSessionRequest {
                client_name: client_name.to_owned(),
            })
            .await?
            .into_inner();
        let first = events
            .message()
            .await?
            .and_then(|e| e.event)
            .ok_or_else(|| ClientError::Protocol("the session stream ended before it opened".into()))?;
        let proto::session_event::Event::Opened(opened) = first else {
            return Err(ClientError::Protocol(
                "the session stream did not start with Opened".into(),
            ));
        };
        let geometry = geometry_from_proto(opened.geometry.as_ref())?;
        // Keep the session stream open (heartbeats) for the client's lifetime.
        let session_task = tokio::spawn(async move {
            while let Ok(Some(_)) = events.message().await {}
            tracing::debug!("kvtier session stream ended");
        });
        Ok(Self {
            rpc,
            session_id: opened.session_id,
            geometry,
            _session: std::sync::Arc::new(SessionTask(session_task)),
        })
    }

    /// The session id.
    pub fn session_id(&self) -> u64 {
        self.session_id
    }

    /// The geometry the sidecar serves.
    pub fn geometry(&self) -> KvGeometry {
        self.geometry
    }

    /// The raw gRPC stub, for calls this client does not wrap.
    pub fn rpc(&mut self) -> &mut Stub {
        &mut self.rpc
    }

    /// A clone of the stub (same connection and session), for concurrent calls.
    pub fn stub(&self) -> Stub {
        self.rpc.clone()
    }

    /// Registers a CPU device pool the engine created (by its shared-memory path).
    ///
    /// # Errors
    /// The sidecar's status (geometry mismatch, file errors, …); [`ClientError::Protocol`] for
    /// an anonymous pool, which another process cannot open.
    ///
    /// # Cancel safety
    /// Dropping the future after the request was sent may still register the pool; unknown
    /// to this client, it stays registered (and mapped by the sidecar) until the session ends.
    pub async fn register_cpu_pool(
        &mut self,
        pool: &CpuDevicePool,
        model_id: &str,
        tp_rank: u32,
        tp_size: u32,
    ) -> Result<PoolHandle, ClientError> {
        let path = pool.path().ok_or_else(|| {
            ClientError::Protocol("the pool has no file path; create it with a path".into())
        })?;
        let geometry = *pool.geometry();
        let r = self
            .rpc
            .register_pool(proto::RegisterPoolRequest {
                session_id: self.session_id,
                model_id: model_id.to_owned(),
                geometry: Some(geometry.into()),
                num_slots: pool.num_slots(),
                tp_rank,
                tp_size,
                location: Some(proto::register_pool_request::Location::ShmPath(
                    path.display().to_string(),
                )),
            })
            .await?
            .into_inner();
        Ok(PoolHandle {
            id: r.pool_id,
            model_id: model_id.to_owned(),
            geometry,
            tp_rank,
            tp_size,
        })
    }

    /// Unregisters a pool.
    ///
    /// # Errors
    /// The sidecar's status.
    pub async fn unregister_pool(&mut self, pool: &PoolHandle) -> Result<(), ClientError> {
        self.rpc
            .unregister_pool(proto::UnregisterPoolRequest {
                session_id: self.session_id,
                pool_id: pool.id,
            })
            .await?;
        Ok(())
    }

    /// Where each leading block of `keys` is.
    ///
    /// # Errors
    /// The sidecar's status.
    pub async fn match_keys(
        &mut self,
        pool: &PoolHandle,
        salt: &str,
        keys: &[BlockKey],
    ) -> Result<MatchResponse, ClientError> {
        Ok(self
            .rpc
            .r#match(proto::MatchRequest {
                session_id: self.session_id,
                pool_id: pool.id,
                cache_salt: salt.to_owned(),
                keys: pack_keys(keys),
                token_ids: Vec::new(),
            })
            .await?
            .into_inner())
    }

    /// Where each leading block of a token sequence is (the sidecar hashes the tokens).
    ///
    /// # Errors
    /// The sidecar's status.
    pub async fn match_tokens(
        &mut self,
        pool: &PoolHandle,
        salt: &str,
        tokens: &[u32],
    ) -> Result<MatchResponse, ClientError> {
        Ok(self
            .rpc
            .r#match(proto::MatchRequest {
                session_id: self.session_id,
                pool_id: pool.id,
                cache_salt: salt.to_owned(),
                keys: Default::default(),
                token_ids: tokens.to_vec(),
            })
            .await?
            .into_inner())
    }

    /// Starts a load of `(key, slot)` blocks; the stream yields the blocks in no tier first
    /// ([`LoadEvent::Missing`]), one [`LoadEvent::LayerReady`] per finished layer, then the
    /// final [`LoadEvent::Done`]. `deadline` bounds the whole load on the sidecar (rounded up
    /// to a millisecond). Returns once the sidecar has accepted the load.
    ///
    /// # Errors
    /// The sidecar's status (unknown pool, bad slots, a full queue, …).
    ///
    /// # Cancel safety
    /// Dropping the future before it resolves withdraws the load as far as it got: once the
    /// request has reached the sidecar, dropping it is dropping the [`LoadStream`] (copies not
    /// started are skipped, pins released, the slots possibly partly written).
    pub async fn load(
        &mut self,
        pool: &PoolHandle,
        salt: &str,
        blocks: &[(BlockKey, u32)],
        deadline: Option<Duration>,
    ) -> Result<LoadStream, ClientError> {
        let events = self
            .rpc
            .load(proto::LoadRequest {
                session_id: self.session_id,
                pool_id: pool.id,
                cache_salt: salt.to_owned(),
                keys: pack_keys(&blocks.iter().map(|b| b.0).collect::<Vec<_>>()),
                slots: blocks.iter().map(|b| b.1).collect(),
                deadline_ms: deadline.map_or(0, |d| d.as_millis().max(1) as u64),
            })
            .await?
            .into_inner();
        Ok(LoadStream { events })
    }

    /// [`Client::load`], collecting every event until the final report.
    ///
    /// # Errors
    /// The sidecar's status, at the start or in the stream; [`ClientError::Proto`] for an
    /// event that does not decode; [`ClientError::Protocol`] for a stream that ended without
    /// a report.
    ///
    /// # Cancel safety
    /// As [`Client::load`]: dropping the future cancels the load on the sidecar.
    pub async fn load_all(
        &mut self,
        pool: &PoolHandle,
        salt: &str,
        blocks: &[(BlockKey, u32)],
        deadline: Option<Duration>,
    ) -> Result<LoadOutcome, ClientError> {
        let mut stream = self.load(pool, salt, blocks, deadline).await?;
        let mut out = LoadOutcome::default();
        while let Some(ev) = stream.next().await? {
            match ev {
                LoadEvent::LayerReady { layer } => out.layers_ready.push(layer),
                LoadEvent::Missing { keys } => out.missing_announced.extend(keys),
                LoadEvent::Done(d) => {
                    out.done = d;
                    return Ok(out);
                }
            }
        }
        Err(ClientError::Protocol(
            "the load stream ended without a final report".into(),
        ))
    }

    /// Stores a contiguous run of one sequence's blocks, `(key, slot)` in order; `parent` is
    /// the key of the block before the first (`None` when the run starts the sequence).
    /// Returns when the device slots may be reused.
    ///
    /// # Errors
    /// The sidecar's status (`RESOURCE_EXHAUSTED` when the store was dropped for a full queue
    /// or host tier: nothing was stored).
    ///
    /// # Cancel safety
    /// Not cancel safe. Dropping the future after the request was sent does not withdraw it:
    /// the sidecar cancels the copies it has not started when it sees the call go away, but
    /// blocks already copied stay stored, and copies already running still read their device
    /// slots. Without the reply nothing says when those copies are done, so only drop a
    /// store whose slots will not be written again (shutting down).
    pub async fn store(
        &mut self,
        pool: &PoolHandle,
        salt: &str,
        parent: Option<BlockKey>,
        blocks: &[(BlockKey, u32)],
    ) -> Result<StoreResponse, ClientError> {
        Ok(self
            .rpc
            .store(proto::StoreRequest {
                session_id: self.session_id,
                pool_id: pool.id,
                cache_salt: salt.to_owned(),
                keys: pack_keys(&blocks.iter().map(|b| b.0).collect::<Vec<_>>()),
                slots: blocks.iter().map(|b| b.1).collect(),
                parent: pack_key(parent),
            })
            .await?
            .into_inner())
    }

    /// Reports device residency: blocks now held in slots (`Some(slot)`) or dropped (`None`).
    /// Returns the blocks the device holds afterwards.
    ///
    /// # Errors
    /// The sidecar's status.
    pub async fn device_events(
        &mut self,
        pool: &PoolHandle,
        events: &[(BlockKey, Option<u32>)],
    ) -> Result<u64, ClientError> {
        use proto::device_event::Kind;
        let r = self
            .rpc
            .device_events(proto::DeviceEventsRequest {
                session_id: self.session_id,
                pool_id: pool.id,
                events: events
                    .iter()
                    .map(|(k, slot)| proto::DeviceEvent {
                        kind: if slot.is_some() {
                            Kind::Stored
                        } else {
                            Kind::Removed
                        } as i32,
                        key: pack_keys(&[*k]),
                        slot: slot.unwrap_or(0),
                    })
                    .collect(),
            })
            .await?
            .into_inner();
        Ok(r.device_blocks)
    }

    /// Soft-pins blocks in host memory until [`Client::unpin`], `ttl` or the session's end.
    ///
    /// # Errors
    /// The sidecar's status.
    pub async fn pin(
        &mut self,
        pool: &PoolHandle,
        salt: &str,
        keys: &[BlockKey],
        ttl: Option<Duration>,
    ) -> Result<PinResponse, ClientError> {
        Ok(self
            .rpc
            .pin(proto::PinRequest {
                session_id: self.session_id,
                pool_id: pool.id,
                cache_salt: salt.to_owned(),
                keys: pack_keys(keys),
                ttl_ms: ttl.map_or(0, |d| d.as_millis().max(1) as u64),
            })
            .await?
            .into_inner())
    }

    /// Releases a soft pin; returns the blocks released.
    ///
    /// # Errors
    /// The sidecar's status.
    pub async fn unpin(&mut self, pin_id: u64) -> Result<u32, ClientError> {
        Ok(self
            .rpc
            .unpin(proto::UnpinRequest {
                session_id: self.session_id,
                pin_id,
            })
            .await?
            .into_inner()
            .released_blocks)
    }

    /// Forgets the blocks of `salt`'s namespace of `pool` (or of every namespace with `all`)
    /// in `tier` (`Tier::Unspecified`: every tier). Returns (host blocks, disk blocks) removed.
    ///
    /// # Errors
    /// The sidecar's status.
    pub async fn clear(
        &mut self,
        pool: &PoolHandle,
        salt: &str,
        all: bool,
        tier: proto::Tier,
    ) -> Result<(u64, u64), ClientError> {
        let r = self
            .rpc
            .clear(proto::ClearRequest {
                session_id: self.session_id,
                pool_id: pool.id,
                cache_salt: salt.to_owned(),
                all,
                tier: tier as i32,
            })
            .await?
            .into_inner();
        Ok((r.host_blocks, r.disk_blocks))
    }

    /// The sidecar's counters.
    ///
    /// # Errors
    /// The sidecar's status.
    pub async fn stats(&mut self) -> Result<proto::StatsResponse, ClientError> {
        Ok(self.rpc.stats(proto::StatsRequest {}).await?.into_inner())
    }
}
