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

mod channel;
mod error;
mod load_stream;
mod pool_handle;
mod session;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use kvtier_core::{BlockKey, KvGeometry};
use kvtier_proto::proto::kv_tier_client::KvTierClient;
use kvtier_proto::wire::{pack_key, pack_keys};
use kvtier_transfer::{CpuDevicePool, DevicePool};

pub use channel::{Auth, ConnectOptions, Stub, channel};
pub use error::ClientError;
pub use load_stream::{LoadOutcome, LoadStream};
pub use pool_handle::PoolHandle;

pub use kvtier_core::Tier;
/// The generated kvtier.v1 messages, for calls through [`Client::rpc`] and the replies this
/// client returns as they come.
pub use kvtier_proto::proto;
pub use kvtier_proto::proto::PinResponse;
pub use kvtier_proto::{LayerEvents, LoadDone, LoadEvent, MatchReply, MatchedBlock, StoreReply, WireTiming};

/// A connection and a session with the kvtier sidecar. Clones share the connection and the
/// session (for concurrent calls); the session ends when the last clone is dropped.
#[derive(Debug, Clone)]
pub struct Client {
    rpc: Stub,
    session_id: u64,
    geometry: KvGeometry,
    _session: Arc<session::SessionTask>,
    session_open: Arc<std::sync::atomic::AtomicBool>,
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
        let options = ConnectOptions {
            token: token.map(str::to_owned),
            ..ConnectOptions::new(target)
        };
        Self::connect_with(&options, client_name).await
    }

    /// [`Client::connect`] with TLS settings and a token ([`ConnectOptions`]).
    ///
    /// # Errors
    /// As [`Client::connect_with_token`].
    ///
    /// # Cancel safety
    /// As [`Client::connect`].
    pub async fn connect_with(options: &ConnectOptions, client_name: &str) -> Result<Self, ClientError> {
        let mut rpc = KvTierClient::with_interceptor(options.channel().await?, options.auth()?)
            .max_decoding_message_size(kvtier_proto::codec::CLIENT_MAX_REPLY_BYTES);
        let session = session::open(&mut rpc, client_name).await?;
        Ok(Self {
            rpc,
            session_id: session.id,
            geometry: session.geometry,
            _session: Arc::new(session.task),
            session_open: session.open,
        })
    }

    /// The session id.
    pub fn session_id(&self) -> u64 {
        self.session_id
    }

    /// Whether the session is still open: `false` once its stream ended (the sidecar stopped,
    /// restarted, or the connection broke). The session's pools and pins are gone then;
    /// connect again. Cost: one atomic load.
    pub fn session_open(&self) -> bool {
        self.session_open.load(std::sync::atomic::Ordering::Acquire)
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

    /// Registers a CPU device pool the engine created (by its shared-memory path): kvtier's pool
    /// file as it is, a headerless pool with its layout (vLLM's, SGLang's, …).
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
        let location = proto::register_pool_request::Location::ShmPath(path.display().to_string());
        // kvtier's pool file describes itself; headerless memory says where K and V are.
        let layout = (!pool.is_pool_file()).then(|| pool.layout().into());
        let slots = (*pool.geometry(), pool.num_slots());
        self.register(location, layout, slots, model_id, tp_rank, tp_size)
            .await
    }

    /// Registers an engine's KV in GPU memory: `cuda` names the GPU and each buffer's CUDA IPC
    /// handle, `layout` where K and V of each of `num_slots` slots are in those buffers. The
    /// sidecar opens the handles on that GPU and closes them when the pool is unregistered or
    /// the session ends.
    ///
    /// # Errors
    /// The sidecar's status: FAILED_PRECONDITION without CUDA there (its message says why) or
    /// for another GPU, INVALID_ARGUMENT naming the field that does not fit.
    ///
    /// # Cancel safety
    /// As [`Client::register_cpu_pool`].
    pub async fn register_cuda_pool(
        &mut self,
        cuda: proto::CudaPool,
        num_slots: u32,
        layout: &kvtier_core::PoolLayout,
        model_id: &str,
        tp_rank: u32,
        tp_size: u32,
    ) -> Result<PoolHandle, ClientError> {
        let location = proto::register_pool_request::Location::Cuda(cuda);
        let slots = (self.geometry, num_slots);
        self.register(location, Some(layout.into()), slots, model_id, tp_rank, tp_size)
            .await
    }

    /// Registers an engine's KV in this process's own memory (`process.buffers`: each
    /// allocation's address and size), laid out as `layout` says (`None`: kvtier's
    /// `[layer][slot]` block-layers from the start of buffer 0). The sidecar copies to and from
    /// it with `process_vm_writev` / `process_vm_readv`, reaching this process by the pid at the
    /// other end of the Unix socket; the memory must stay allocated while the pool is
    /// registered.
    ///
    /// # Errors
    /// The sidecar's status: FAILED_PRECONDITION over TCP, where it may not reach this
    /// process's memory (the message says what would allow it) or for an address not mapped;
    /// INVALID_ARGUMENT naming the field that does not fit.
    ///
    /// # Cancel safety
    /// As [`Client::register_cpu_pool`].
    pub async fn register_process_pool(
        &mut self,
        process: proto::ProcessMemory,
        num_slots: u32,
        layout: Option<&kvtier_core::PoolLayout>,
        model_id: &str,
        tp_rank: u32,
        tp_size: u32,
    ) -> Result<PoolHandle, ClientError> {
        let location = proto::register_pool_request::Location::Process(process);
        let slots = (self.geometry, num_slots);
        self.register(
            location,
            layout.map(Into::into),
            slots,
            model_id,
            tp_rank,
            tp_size,
        )
        .await
    }

    async fn register(
        &mut self,
        location: proto::register_pool_request::Location,
        layout: Option<proto::PoolLayout>,
        (geometry, num_slots): (KvGeometry, u32),
        model_id: &str,
        tp_rank: u32,
        tp_size: u32,
    ) -> Result<PoolHandle, ClientError> {
        let r = self
            .rpc
            .register_pool(proto::RegisterPoolRequest {
                session_id: self.session_id,
                model_id: model_id.to_owned(),
                geometry: Some(geometry.into()),
                num_slots,
                tp_rank,
                tp_size,
                location: Some(location),
                layout,
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
    ///
    /// # Cancel safety
    /// Dropping the future after the request was sent may still unregister the pool; the
    /// handle must not be used again either way.
    pub async fn unregister_pool(&mut self, pool: &PoolHandle) -> Result<(), ClientError> {
        self.rpc
            .unregister_pool(proto::UnregisterPoolRequest {
                session_id: self.session_id,
                pool_id: pool.id,
            })
            .await?;
        Ok(())
    }

    /// Where each leading block of `keys` is (device, host or disk).
    ///
    /// # Errors
    /// The sidecar's status; [`ClientError::Proto`] for a reply that does not decode (a tier
    /// this build does not know).
    ///
    /// # Cancel safety
    /// Cancel safe: a match only reads (it may count hits for the disk admission filter).
    pub async fn match_keys(
        &mut self,
        pool: &PoolHandle,
        salt: &str,
        keys: &[BlockKey],
    ) -> Result<MatchReply, ClientError> {
        let r = self
            .rpc
            .r#match(proto::MatchRequest {
                session_id: self.session_id,
                pool_id: pool.id,
                cache_salt: salt.to_owned(),
                keys: pack_keys(keys),
                token_ids: Vec::new(),
            })
            .await?
            .into_inner();
        Ok(MatchReply::try_from(r)?)
    }

    /// Where each leading block of a token sequence is (the sidecar hashes the tokens, and
    /// the reply carries their keys).
    ///
    /// # Errors
    /// As [`Client::match_keys`].
    ///
    /// # Cancel safety
    /// As [`Client::match_keys`].
    pub async fn match_tokens(
        &mut self,
        pool: &PoolHandle,
        salt: &str,
        tokens: &[u32],
    ) -> Result<MatchReply, ClientError> {
        let r = self
            .rpc
            .r#match(proto::MatchRequest {
                session_id: self.session_id,
                pool_id: pool.id,
                cache_salt: salt.to_owned(),
                keys: Default::default(),
                token_ids: tokens.to_vec(),
            })
            .await?
            .into_inner();
        Ok(MatchReply::try_from(r)?)
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
        self.load_with(pool, salt, blocks, deadline, LayerEvents::EVERY)
            .await
    }

    /// [`Client::load`] with the layer events the caller wants: every layer, every `n` layers
    /// (and the last), or none ([`LayerEvents::DoneOnly`]: the missing blocks and the final
    /// report only). Each [`LoadEvent::LayerReady`] still means "layers `0..=layer` are in
    /// their slots".
    ///
    /// # Errors
    /// As [`Client::load`].
    ///
    /// # Cancel safety
    /// As [`Client::load`].
    pub async fn load_with(
        &mut self,
        pool: &PoolHandle,
        salt: &str,
        blocks: &[(BlockKey, u32)],
        deadline: Option<Duration>,
        layer_events: LayerEvents,
    ) -> Result<LoadStream, ClientError> {
        let (layer_event_stride, done_only) = layer_events.to_proto();
        let events = self
            .rpc
            .load(proto::LoadRequest {
                session_id: self.session_id,
                pool_id: pool.id,
                cache_salt: salt.to_owned(),
                keys: pack_keys(&blocks.iter().map(|b| b.0).collect::<Vec<_>>()),
                slots: blocks.iter().map(|b| b.1).collect(),
                deadline_ms: deadline.map_or(0, |d| d.as_millis().max(1) as u64),
                layer_event_stride,
                done_only,
                group_slots: Vec::new(),
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
    /// or host tier: nothing was stored); [`ClientError::Proto`] for a reply that does not
    /// decode.
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
    ) -> Result<StoreReply, ClientError> {
        self.store_with(pool, salt, parent, blocks, false, None).await
    }

    /// Like [`Client::store`], but the sidecar publishes nothing unless its copies end by
    /// `not_after`, and refuses the store if that has passed before it starts
    /// (`DEADLINE_EXCEEDED` either way). From `not_after` on, the slots may be written again
    /// whatever became of the call: dropped, timed out, or read late by a sidecar that was
    /// stopped while the request waited. `not_after` is on the wall clock the sidecar's host
    /// shares (in-place pools are on the same host).
    ///
    /// # Errors
    /// As [`Client::store`].
    ///
    /// # Cancel safety
    /// Dropping the future is safe once `not_after` has passed: nothing read from the slots
    /// after it is published.
    pub async fn store_until(
        &mut self,
        pool: &PoolHandle,
        salt: &str,
        parent: Option<BlockKey>,
        blocks: &[(BlockKey, u32)],
        not_after: SystemTime,
    ) -> Result<StoreReply, ClientError> {
        self.store_with(pool, salt, parent, blocks, false, Some(not_after))
            .await
    }

    /// Like [`Client::store`], but returns only when the blocks are also written to the
    /// sidecar's disk tier and fdatasynced (whatever its write policy): a crash or power cut
    /// after this returns loses none of `durable_blocks`; `not_durable` lists the others
    /// (retry them). Slower by the disk writes and one fdatasync.
    ///
    /// # Errors
    /// As [`Client::store`]; `FAILED_PRECONDITION` from a sidecar without a disk tier or with
    /// `disk.write_policy = none`.
    ///
    /// # Cancel safety
    /// As [`Client::store`]; dropping the future after the slots were copied leaves the disk
    /// writes running, but then nothing says whether they finished.
    pub async fn store_durable(
        &mut self,
        pool: &PoolHandle,
        salt: &str,
        parent: Option<BlockKey>,
        blocks: &[(BlockKey, u32)],
    ) -> Result<StoreReply, ClientError> {
        self.store_with(pool, salt, parent, blocks, true, None).await
    }

    async fn store_with(
        &mut self,
        pool: &PoolHandle,
        salt: &str,
        parent: Option<BlockKey>,
        blocks: &[(BlockKey, u32)],
        durable: bool,
        not_after: Option<SystemTime>,
    ) -> Result<StoreReply, ClientError> {
        let r = self
            .rpc
            .store(proto::StoreRequest {
                session_id: self.session_id,
                pool_id: pool.id,
                cache_salt: salt.to_owned(),
                keys: pack_keys(&blocks.iter().map(|b| b.0).collect::<Vec<_>>()),
                slots: blocks.iter().map(|b| b.1).collect(),
                parent: pack_key(parent),
                durable,
                group_slots: Vec::new(),
                not_after_unix_ms: kvtier_proto::wire::pack_not_after(not_after),
            })
            .await?
            .into_inner();
        Ok(StoreReply::try_from(r)?)
    }

    /// Reports device residency: blocks now held in slots (`Some(slot)`) or dropped (`None`).
    /// Returns the blocks the device holds afterwards.
    ///
    /// # Errors
    /// The sidecar's status.
    ///
    /// # Cancel safety
    /// Dropping the future after the request was sent may still apply the events (all or
    /// none): report the same residency again to be sure.
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
    ///
    /// # Cancel safety
    /// Dropping the future after the request was sent may still take the pin; unknown to this
    /// client, it is held until its TTL or the session's end.
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
    ///
    /// # Cancel safety
    /// Dropping the future may still release the pin; unpinning again then fails with
    /// NOT_FOUND.
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
    /// in `tier` (`None`: every tier; the sidecar refuses [`Tier::Device`], which it does not
    /// hold; [`Tier::Remote`] clears the fleet's shared tier, which `None` leaves alone). Returns
    /// what was removed from each tier and the pinned blocks kept.
    ///
    /// # Errors
    /// The sidecar's status.
    ///
    /// # Cancel safety
    /// Dropping the future after the request was sent does not stop the clear: the sidecar
    /// completes it, unreported.
    pub async fn clear(
        &mut self,
        pool: &PoolHandle,
        salt: &str,
        all: bool,
        tier: Option<Tier>,
    ) -> Result<proto::ClearResponse, ClientError> {
        Ok(self
            .rpc
            .clear(proto::ClearRequest {
                session_id: self.session_id,
                pool_id: pool.id,
                cache_salt: salt.to_owned(),
                all,
                tier: tier.map_or(proto::Tier::Unspecified, proto::Tier::from) as i32,
            })
            .await?
            .into_inner())
    }

    /// The sidecar's counters.
    ///
    /// # Errors
    /// The sidecar's status.
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads.
    pub async fn stats(&mut self) -> Result<proto::StatsResponse, ClientError> {
        Ok(self.rpc.stats(proto::StatsRequest {}).await?.into_inner())
    }
}
