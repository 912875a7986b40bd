//! The gRPC API end to end against an in-process sidecar on a Unix socket: every RPC, every
//! bad input's status code, sessions, health and reflection.

mod common;

use std::time::{Duration, SystemTime};

use common::*;
use kvtier_client::{Client, LayerEvents, LoadEvent, MatchedBlock, PoolHandle};
use kvtier_core::{BlockKey, Dtype, KvGeometry, LayoutKind, PoolLayout, Tier};
use kvtier_proto::proto;
use kvtier_transfer::CpuDevicePool;
use tonic::Code;

struct Engine {
    client: Client,
    pool: CpuDevicePool,
    handle: PoolHandle,
}

async fn engine(sidecar: &Sidecar, slots: u32) -> Engine {
    let mut client = Client::connect(&sidecar.target, "test-engine").await.unwrap();
    assert_eq!(client.geometry(), geometry());
    let path = sidecar.dir.path().join(format!("pool-{}", client.session_id()));
    let pool = CpuDevicePool::create(Some(&path), geometry(), slots).unwrap();
    let handle = client.register_cpu_pool(&pool, "test-model", 0, 1).await.unwrap();
    Engine { client, pool, handle }
}

impl Engine {
    fn write(&self, keys: &[BlockKey], first_slot: u32) {
        write_kv(&self.pool, keys, first_slot);
    }

    fn check(&self, keys: &[BlockKey], first_slot: u32) {
        if let Some((slot, layer)) = first_wrong_kv(&self.pool, keys, first_slot) {
            panic!("slot {slot} layer {layer}");
        }
    }

    fn slots(keys: &[BlockKey], first_slot: u32) -> Vec<(BlockKey, u32)> {
        keys.iter()
            .enumerate()
            .map(|(i, &k)| (k, first_slot + i as u32))
            .collect()
    }
}

fn code(e: kvtier_client::ClientError) -> Code {
    match e {
        kvtier_client::ClientError::Status(s) => s.code(),
        other => panic!("expected a status, got {other}"),
    }
}

/// A store with a `not_after` that has passed stores nothing and says so; one in time stores.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_past_its_not_after_stores_nothing() {
    let sidecar = Sidecar::start(|_| {}).await;
    let mut e = engine(&sidecar, 8).await;
    let tokens: Vec<u32> = (0..16 * 2).map(|t| t * 3 + 2).collect();
    let keys = e.handle.keys("", &tokens).unwrap();
    e.write(&keys, 0);
    let past = SystemTime::now() - Duration::from_secs(1);
    let err = e
        .client
        .store_until(&e.handle, "", None, &Engine::slots(&keys, 0), past)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("not_after: nothing was stored"), "{err}");
    assert_eq!(code(err), Code::DeadlineExceeded);
    let m = e.client.match_keys(&e.handle, "", &keys).await.unwrap();
    assert_eq!(m.matched_tokens, 0, "nothing stored");
    let later = SystemTime::now() + Duration::from_secs(60);
    let r = e
        .client
        .store_until(&e.handle, "", None, &Engine::slots(&keys, 0), later)
        .await
        .unwrap();
    assert_eq!(r.stored_blocks, 2);
    sidecar.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_match_load_round_trip_bit_exact() {
    let sidecar = Sidecar::start(|_| {}).await;
    let mut e = engine(&sidecar, 64).await;
    let tokens: Vec<u32> = (0..16 * 12).map(|t| t * 7 + 1).collect();
    let keys = e.handle.keys("", &tokens).unwrap();
    assert_eq!(keys.len(), 12);
    e.write(&keys, 0);
    let stored = e
        .client
        .store(&e.handle, "", None, &Engine::slots(&keys[..10], 0))
        .await
        .unwrap();
    assert_eq!(stored.stored_blocks, 10);
    assert_eq!(stored.bytes, 10 * geometry().bytes_per_block() as u64);
    // Match by tokens (the sidecar hashes them) and by keys agree.
    let by_tokens = e.client.match_tokens(&e.handle, "", &tokens).await.unwrap();
    let by_keys = e.client.match_keys(&e.handle, "", &keys).await.unwrap();
    assert_eq!(
        (&by_tokens.blocks, by_tokens.matched_tokens),
        (&by_keys.blocks, by_keys.matched_tokens)
    );
    assert_eq!(
        by_tokens.keys,
        keys[..10].to_vec(),
        "token matches return their keys"
    );
    assert!(by_keys.keys.is_empty(), "key matches do not echo them");
    assert_eq!(by_keys.blocks.len(), 10);
    assert_eq!(
        (by_keys.matched_tokens, by_keys.host_tokens, by_keys.device_tokens),
        (160, 160, 0)
    );
    assert!(by_keys.tiers().all(|t| t == Tier::Host));
    // Another tenant's salt matches nothing.
    assert_eq!(
        e.client
            .match_tokens(&e.handle, "tenant-b", &tokens)
            .await
            .unwrap()
            .matched_tokens,
        0
    );
    // Load into other slots: one event per layer, then the report.
    let out = e
        .client
        .load_all(&e.handle, "", &Engine::slots(&keys, 20), None)
        .await
        .unwrap();
    assert_eq!(out.layers_ready, vec![0, 1]);
    assert_eq!(out.done.loaded_blocks, 10);
    assert_eq!(out.done.missing, keys[10..].to_vec(), "never silently skipped");
    e.check(&keys[..10], 20);
    // Fewer layer events when asked: every 2nd layer (here: the last), or none at all.
    for (events, expect) in [(LayerEvents::Every(2), vec![1]), (LayerEvents::DoneOnly, vec![])] {
        let slots = Engine::slots(&keys[..10], 40);
        let zeros = vec![0u8; geometry().bytes_per_block_layer()];
        for &(_, slot) in &slots {
            for layer in 0..geometry().layers() {
                e.pool.write_slot_layer(slot, layer, &zeros).unwrap();
            }
        }
        let mut stream = e
            .client
            .load_with(&e.handle, "", &slots, None, events)
            .await
            .unwrap();
        let mut layers = Vec::new();
        loop {
            match stream.next().await.unwrap().expect("a final report") {
                LoadEvent::LayerReady { layer } => layers.push(layer),
                LoadEvent::Missing { keys } => panic!("{} missing", keys.len()),
                LoadEvent::Done(d) => {
                    assert_eq!(d.loaded_blocks, 10);
                    break;
                }
            }
        }
        assert_eq!(layers, expect, "{events:?}");
        e.check(&keys[..10], 40);
    }
    // Device residency shows in Match.
    let resident: Vec<(BlockKey, Option<u32>)> = keys[..3]
        .iter()
        .enumerate()
        .map(|(i, &k)| (k, Some(20 + i as u32)))
        .collect();
    assert_eq!(e.client.device_events(&e.handle, &resident).await.unwrap(), 3);
    let m = e.client.match_keys(&e.handle, "", &keys).await.unwrap();
    assert_eq!((m.device_tokens, m.host_tokens), (48, 112));
    assert_eq!(
        m.blocks[2],
        MatchedBlock {
            tier: Tier::Device,
            device_slot: Some(22)
        }
    );
    assert_eq!(m.blocks[3].device_slot, None);
    assert_eq!(
        e.client
            .device_events(&e.handle, &[(keys[0], None)])
            .await
            .unwrap(),
        2
    );
    let stats = e.client.stats().await.unwrap();
    assert_eq!((stats.sessions, stats.pools, stats.pinned_blocks), (1, 1, 0));
    assert!(stats.json.contains("\"routes\""));
    drop(e);
    sidecar.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bad_request_gets_its_status_and_changes_nothing() {
    let sidecar = Sidecar::start(|c| c.server.max_batch_blocks = 100).await;
    let mut e = engine(&sidecar, 8).await;
    let keys = e.handle.keys("", &(0..16 * 4).collect::<Vec<u32>>()).unwrap();
    e.write(&keys, 0);
    e.client
        .store(&e.handle, "", None, &Engine::slots(&keys, 0))
        .await
        .unwrap();
    let sid = e.client.session_id();
    let rpc = e.client.rpc();

    // Unknown session and pool.
    let pack = |ks: &[BlockKey]| kvtier_proto::wire::pack_keys(ks);
    let m = |session_id, pool_id, keys| proto::MatchRequest {
        session_id,
        pool_id,
        keys,
        ..Default::default()
    };
    assert_eq!(
        rpc.r#match(m(999, e.handle.id, pack(&keys[..1])))
            .await
            .unwrap_err()
            .code(),
        Code::NotFound
    );
    let err = rpc.r#match(m(sid, 12345, pack(&keys[..1]))).await.unwrap_err();
    assert_eq!(
        (err.code(), err.message()),
        (Code::NotFound, "unknown pool 12345")
    );
    // Wrong key length, empty batch, both keys and tokens, oversized batch.
    let err = rpc
        .r#match(m(sid, e.handle.id, vec![1u8; 15].into()))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message()
            .contains("keys: 15 bytes is not a whole number of 16-byte block keys"),
        "{}",
        err.message()
    );
    assert_eq!(
        rpc.r#match(m(sid, e.handle.id, Default::default()))
            .await
            .unwrap_err()
            .code(),
        Code::InvalidArgument
    );
    let mut both = m(sid, e.handle.id, pack(&keys[..1]));
    both.token_ids = vec![1; 16];
    assert_eq!(rpc.r#match(both).await.unwrap_err().code(), Code::InvalidArgument);
    let err = rpc
        .r#match(m(sid, e.handle.id, pack(&vec![keys[0]; 101])))
        .await
        .unwrap_err();
    assert!(
        err.code() == Code::InvalidArgument && err.message().contains("at most 100"),
        "{}",
        err.message()
    );

    // Slot out of range, duplicate slot, keys without slots, nothing to load; a bad parent.
    let load = |ks: &[BlockKey], slots: Vec<u32>| proto::LoadRequest {
        session_id: sid,
        pool_id: e.handle.id,
        keys: pack(ks),
        slots,
        ..Default::default()
    };
    let err = rpc.load(load(&keys[..1], vec![8])).await.unwrap_err();
    assert!(
        err.code() == Code::InvalidArgument && err.message().contains("slot 8 out of range"),
        "{}",
        err.message()
    );
    assert_eq!(
        rpc.load(load(&keys[..2], vec![1, 1])).await.unwrap_err().code(),
        Code::InvalidArgument
    );
    let err = rpc.load(load(&keys[..2], vec![1])).await.unwrap_err();
    assert!(err.message().contains("2 keys but 1 slots"), "{}", err.message());
    assert_eq!(
        rpc.load(load(&[], vec![])).await.unwrap_err().code(),
        Code::InvalidArgument
    );
    let store = proto::StoreRequest {
        session_id: sid,
        pool_id: e.handle.id,
        keys: pack(&keys[..1]),
        slots: vec![0],
        parent: vec![0u8; 3].into(),
        ..Default::default()
    };
    let err = rpc.store(store).await.unwrap_err();
    assert!(err.message().contains("parent: 3 bytes"), "{}", err.message());

    // Device events: slot out of range, unknown kind.
    let ev = |kind, slot| proto::DeviceEventsRequest {
        session_id: sid,
        pool_id: e.handle.id,
        events: vec![proto::DeviceEvent {
            kind,
            key: kvtier_proto::wire::pack_keys(&keys[..1]),
            slot,
        }],
    };
    assert_eq!(
        rpc.device_events(ev(1, 99)).await.unwrap_err().code(),
        Code::InvalidArgument
    );
    assert_eq!(
        rpc.device_events(ev(42, 0)).await.unwrap_err().code(),
        Code::InvalidArgument
    );
    // Unknown pin.
    let err = rpc
        .unpin(proto::UnpinRequest {
            session_id: sid,
            pin_id: 77,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);

    // Pools: another geometry, a missing file, a file of another size, no location, CUDA.
    let other = KvGeometry::new(2, 2, 64, Dtype::F16, 16).unwrap();
    let reg = |geometry: KvGeometry, path: &str, num_slots| proto::RegisterPoolRequest {
        session_id: sid,
        model_id: "m".into(),
        geometry: Some(geometry.into()),
        num_slots,
        tp_rank: 0,
        tp_size: 1,
        location: Some(proto::register_pool_request::Location::ShmPath(path.into())),
        layout: None,
    };
    let path = e.pool.path().unwrap().display().to_string();
    let err = rpc.register_pool(reg(other, &path, 8)).await.unwrap_err();
    assert!(
        err.code() == Code::FailedPrecondition && err.message().contains("dtype=f16"),
        "{}",
        err.message()
    );
    assert_eq!(
        rpc.register_pool(reg(geometry(), "/no/such/pool", 8))
            .await
            .unwrap_err()
            .code(),
        Code::NotFound
    );
    assert_eq!(
        rpc.register_pool(reg(geometry(), &path, 9))
            .await
            .unwrap_err()
            .code(),
        Code::FailedPrecondition
    );
    // A directory for shm_path, and tp_size 0: the client's mistakes, named.
    let dir = std::env::temp_dir().display().to_string();
    let err = rpc.register_pool(reg(geometry(), &dir, 8)).await.unwrap_err();
    assert!(
        err.code() == Code::InvalidArgument && err.message().contains("not a regular file"),
        "{err:?}"
    );
    let mut no_world = reg(geometry(), &path, 8);
    no_world.tp_size = 0;
    let err = rpc.register_pool(no_world).await.unwrap_err();
    assert!(
        err.code() == Code::InvalidArgument && err.message().contains("tp_size"),
        "{err:?}"
    );
    // A CUDA pool: the layout is required; without a usable driver (CI) the sidecar says
    // why with FAILED_PRECONDITION, with one a handle that does not open is named.
    let mut cuda = reg(geometry(), &path, 8);
    cuda.location = Some(proto::register_pool_request::Location::Cuda(proto::CudaPool {
        device_ordinal: 0,
        device_uuid: Default::default(),
        buffers: vec![proto::CudaBuffer {
            ipc_handle: vec![0u8; 64].into(),
            offset_bytes: 0,
            size_bytes: PoolLayout::kind_bytes(&geometry(), 8, 0),
        }],
    }));
    let err = rpc.register_pool(cuda.clone()).await.unwrap_err();
    assert!(
        err.code() == Code::InvalidArgument && err.message().contains("layout is required"),
        "{err:?}"
    );
    cuda.layout = Some((&PoolLayout::of_kind(LayoutKind::Vllm, &geometry(), 8, 0)).into());
    let err = rpc.register_pool(cuda).await.unwrap_err();
    match kvtier_cuda::status().unavailable_reason() {
        Some(reason) => assert!(
            err.code() == Code::FailedPrecondition && err.message().contains(reason),
            "{err:?}"
        ),
        None => assert!(
            err.code() == Code::InvalidArgument && err.message().contains("cuda.buffers[0].ipc_handle"),
            "{err:?}"
        ),
    }
    let mut nowhere = reg(geometry(), &path, 8);
    nowhere.location = None;
    assert_eq!(
        rpc.register_pool(nowhere).await.unwrap_err().code(),
        Code::InvalidArgument
    );
    let mut no_geometry = reg(geometry(), &path, 8);
    no_geometry.geometry = None;
    assert_eq!(
        rpc.register_pool(no_geometry).await.unwrap_err().code(),
        Code::InvalidArgument
    );

    // A durable store on a sidecar without a disk tier: FAILED_PRECONDITION, nothing stored.
    let fresh = e
        .handle
        .keys("durable", &(0..16 * 2).collect::<Vec<u32>>())
        .unwrap();
    e.write(&fresh, 4);
    let err = e
        .client
        .store_durable(&e.handle, "durable", None, &Engine::slots(&fresh, 4))
        .await
        .unwrap_err();
    assert_eq!(code(err), Code::FailedPrecondition);
    assert!(
        e.client
            .match_keys(&e.handle, "durable", &fresh)
            .await
            .unwrap()
            .blocks
            .is_empty()
    );

    // Nothing above changed the tier or leaked a pin.
    let m = e.client.match_keys(&e.handle, "", &keys).await.unwrap();
    assert_eq!(m.blocks.len(), 4);
    let stats = e.client.stats().await.unwrap();
    assert_eq!((stats.pools, stats.pinned_blocks), (1, 0));
    drop(e);
    sidecar.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_deadline_cancels_the_load_and_releases_its_pins() {
    let sidecar = Sidecar::start(|c| c.host.capacity = kvtier_core::ByteSize::mib(96)).await;
    let mut e = engine(&sidecar, 2048).await;
    let keys = e.handle.keys("", &(0..16 * 1024).collect::<Vec<u32>>()).unwrap();
    e.write(&keys, 0);
    e.client
        .store(&e.handle, "", None, &Engine::slots(&keys, 0))
        .await
        .unwrap();
    // 16 MiB to copy: far more than a microsecond-scale deadline allows.
    let err = e
        .client
        .load_all(
            &e.handle,
            "",
            &Engine::slots(&keys, 1024),
            Some(Duration::from_micros(1)),
        )
        .await
        .unwrap_err();
    assert_eq!(code(err), Code::DeadlineExceeded);
    sidecar.state.queues.load.wait_idle();
    assert_eq!(e.client.stats().await.unwrap().pinned_blocks, 0);
    let q = sidecar.state.queues.load.stats();
    assert_eq!(
        (q.submitted_total, q.cancelled_total, q.completed_total),
        (1, 1, 0),
        "a load past its deadline counts as cancelled: {q:?}"
    );
    drop(e);
    sidecar.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pins_hold_until_unpin_ttl_or_session_end() {
    let sidecar = Sidecar::start(|_| {}).await;
    let mut e = engine(&sidecar, 16).await;
    let keys = e
        .handle
        .keys("", &(100..100 + 16 * 6).collect::<Vec<u32>>())
        .unwrap();
    e.write(&keys, 0);
    e.client
        .store(&e.handle, "", None, &Engine::slots(&keys[..4], 0))
        .await
        .unwrap();
    let p = e.client.pin(&e.handle, "", &keys, None).await.unwrap();
    assert_eq!((p.pinned_blocks, p.missing.len()), (4, 2 * 16));
    assert_eq!(e.client.stats().await.unwrap().pinned_blocks, 4);
    assert_eq!(e.client.unpin(p.pin_id).await.unwrap(), 4);
    assert_eq!(e.client.stats().await.unwrap().pinned_blocks, 0);
    // A TTL pin goes by itself.
    e.client
        .pin(&e.handle, "", &keys[..2], Some(Duration::from_millis(300)))
        .await
        .unwrap();
    assert_eq!(e.client.stats().await.unwrap().pinned_blocks, 2);
    let start = std::time::Instant::now();
    while e.client.stats().await.unwrap().pinned_blocks != 0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the TTL pin did not expire"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A session that ends releases its pins and pools.
    e.client.pin(&e.handle, "", &keys[..3], None).await.unwrap();
    let mut observer = Client::connect(&sidecar.target, "observer").await.unwrap();
    assert_eq!(observer.stats().await.unwrap().pinned_blocks, 3);
    drop(e);
    let start = std::time::Instant::now();
    loop {
        let s = observer.stats().await.unwrap();
        if (s.pinned_blocks, s.pools, s.sessions) == (0, 0, 1) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "session not cleaned up: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(observer);
    sidecar.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clear_forgets_a_namespace() {
    let sidecar = Sidecar::start(|_| {}).await;
    let mut e = engine(&sidecar, 16).await;
    let tokens: Vec<u32> = (0..16 * 4).collect();
    for (salt, first) in [("a", 0), ("b", 4)] {
        let keys = e.handle.keys(salt, &tokens).unwrap();
        e.write(&keys, first);
        e.client
            .store(&e.handle, salt, None, &Engine::slots(&keys, first))
            .await
            .unwrap();
    }
    let h = e.handle.clone();
    let r = e.client.clear(&h, "a", false, None).await.unwrap();
    assert_eq!((r.host_blocks, r.disk_blocks, r.remote_blocks), (4, 0, 0));
    let err = e
        .client
        .clear(&h, "a", false, Some(Tier::Device))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("TIER_HOST"), "{err}");
    assert_eq!(
        e.client
            .match_tokens(&e.handle, "a", &tokens)
            .await
            .unwrap()
            .matched_tokens,
        0
    );
    assert_eq!(
        e.client
            .match_tokens(&e.handle, "b", &tokens)
            .await
            .unwrap()
            .matched_tokens,
        64
    );
    // Host memory only: the blocks of "b" go (there is no disk tier to keep them).
    assert_eq!(
        e.client.clear(&h, "b", false, Some(Tier::Host)).await.unwrap(),
        kvtier_client::proto::ClearResponse {
            host_blocks: 4,
            ..Default::default()
        }
    );
    // The fleet's shared tier is cleared only by name, and this sidecar has none.
    let err = e
        .client
        .clear(&h, "b", false, Some(Tier::Remote))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("remote.nodes"), "{err}");
    drop(e);
    sidecar.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_reflection_and_malformed_messages() {
    let sidecar = Sidecar::start(|_| {}).await;
    let channel = kvtier_client::channel(&sidecar.target).await.unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
    for service in ["", "kvtier.v1.KvTier"] {
        let r = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            r.status(),
            tonic_health::pb::health_check_response::ServingStatus::Serving,
            "{service:?}"
        );
    }
    // Reflection lists the service.
    use tonic_reflection::pb::v1::{
        ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
        server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
    };
    let mut reflection = ServerReflectionClient::new(channel.clone());
    let req = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut stream = reflection
        .server_reflection_info(tokio_stream::iter([req]))
        .await
        .unwrap()
        .into_inner();
    let Some(MessageResponse::ListServicesResponse(list)) =
        stream.message().await.unwrap().unwrap().message_response
    else {
        panic!("no service list");
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    assert!(names.contains(&"kvtier.v1.KvTier".to_owned()), "{names:?}");
    assert!(names.contains(&"grpc.health.v1.Health".to_owned()), "{names:?}");
    // And in v1alpha, which grpcio-reflection's client and older grpcurl speak.
    {
        use tonic_reflection::pb::v1alpha::{
            ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
            server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
        };
        let mut reflection = ServerReflectionClient::new(channel.clone());
        let req = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut stream = reflection
            .server_reflection_info(tokio_stream::iter([req]))
            .await
            .unwrap()
            .into_inner();
        let Some(MessageResponse::ListServicesResponse(list)) =
            stream.message().await.unwrap().unwrap().message_response
        else {
            panic!("no v1alpha service list");
        };
        let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
        assert!(names.contains(&"kvtier.v1.KvTier".to_owned()), "{names:?}");
    }

    // Bytes that are not a MatchRequest: an error status, and the server keeps serving.
    let mut grpc = tonic::client::Grpc::new(channel.clone());
    grpc.ready().await.unwrap();
    let path = http::uri::PathAndQuery::from_static("/kvtier.v1.KvTier/Match");
    let garbage = tonic::Request::new(vec![0xff_u8, 0xff, 0xff, 0xff, 0x0f, 0x12]);
    let err = grpc
        .unary::<_, Vec<u8>, _>(garbage, path, RawCodec)
        .await
        .unwrap_err();
    // The client's mistake, named: INVALID_ARGUMENT, not tonic's stock INTERNAL.
    assert!(
        err.code() == Code::InvalidArgument
            && err.message().contains("kvtier.v1.MatchRequest does not decode"),
        "{err:?}"
    );
    // The message limit is sized from server.max_batch_blocks: a whole batch by token ids at
    // the varint's widest (5.1 MiB here, over gRPC's default 4 MiB) is read — NOT_FOUND for its
    // unknown session proves it decoded — and one byte over the limit is OUT_OF_RANGE.
    let g = common::geometry();
    let blocks = kvtier_server::ServerConfig::default().server.max_batch_blocks;
    let whole_batch = proto::MatchRequest {
        session_id: 999,
        pool_id: 1,
        token_ids: vec![u32::MAX; blocks * g.block_tokens() as usize],
        ..Default::default()
    };
    let mut rpc = proto::kv_tier_client::KvTierClient::new(channel.clone());
    let err = rpc.r#match(whole_batch).await.unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    let limit = kvtier_proto::codec::max_message_bytes(blocks, g.block_tokens());
    let path = http::uri::PathAndQuery::from_static("/kvtier.v1.KvTier/Match");
    grpc.ready().await.unwrap();
    let err = grpc
        .unary::<_, Vec<u8>, _>(tonic::Request::new(vec![0u8; limit + 1]), path, RawCodec)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::OutOfRange, "{err:?}");
    let r = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await;
    assert!(r.is_ok(), "the server still answers");
    sidecar.stop().await;
}

/// Sends and receives raw bytes, to put malformed messages on the wire.
#[derive(Debug, Clone, Default)]
struct RawCodec;

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawCodec;
    type Decoder = RawCodec;
    fn encoder(&mut self) -> Self::Encoder {
        RawCodec
    }
    fn decoder(&mut self) -> Self::Decoder {
        RawCodec
    }
}

impl tonic::codec::Encoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(&mut self, item: Vec<u8>, dst: &mut tonic::codec::EncodeBuf<'_>) -> Result<(), tonic::Status> {
        use bytes::BufMut;
        dst.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(&mut self, src: &mut tonic::codec::DecodeBuf<'_>) -> Result<Option<Vec<u8>>, tonic::Status> {
        use bytes::Buf;
        Ok(Some(src.copy_to_bytes(src.remaining()).to_vec()))
    }
}

/// Pools in vLLM's (before and from 0.34, K and V interleaved) and SGLang's layouts register
/// with their layout and round-trip bit-exact; a layout that does not fit its file is
/// INVALID_ARGUMENT naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pools_in_engine_layouts_register_and_load_bit_exact() {
    let sidecar = Sidecar::start(|_| {}).await;
    let g = geometry();
    let slots = 32;
    for kind in [
        LayoutKind::Vllm,
        LayoutKind::VllmLbnhc,
        LayoutKind::VllmLbhnc,
        LayoutKind::Sglang,
    ] {
        let mut client = Client::connect(&sidecar.target, "layout-engine").await.unwrap();
        let path = sidecar.dir.path().join(format!("pool-{kind}"));
        let pool = CpuDevicePool::create_with_layout(
            Some(&path),
            g,
            slots,
            PoolLayout::of_kind(kind, &g, slots, 0),
            PoolLayout::kind_bytes(&g, slots, 0) as usize,
        )
        .unwrap();
        assert!(!pool.is_pool_file());
        let handle = client.register_cpu_pool(&pool, "m", 0, 1).await.unwrap();
        let tokens: Vec<u32> = (0..16 * 8).map(|t| t * 13 + kind as u32).collect();
        let keys = handle.keys("", &tokens).unwrap();
        write_kv(&pool, &keys, 0);
        let stored = client
            .store(&handle, "", None, &Engine::slots(&keys, 0))
            .await
            .unwrap();
        assert_eq!(stored.stored_blocks, 8, "{kind}");
        let zeros = vec![0u8; g.bytes_per_block_layer()];
        for s in 0..slots {
            for layer in 0..g.layers() {
                pool.write_slot_layer(s, layer, &zeros).unwrap();
            }
        }
        let out = client
            .load_all(&handle, "", &Engine::slots(&keys, 16), None)
            .await
            .unwrap();
        assert_eq!(out.done.loaded_blocks, 8, "{kind}");
        assert_eq!(first_wrong_kv(&pool, &keys, 16), None, "{kind}");
        // Slots 0..8 stayed zero: the load wrote only where it was asked to.
        let mut buf = vec![1u8; g.bytes_per_block_layer()];
        pool.read_slot_layer(0, 0, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 0), "{kind}");

        // The same file with layouts that do not fit.
        let sid = client.session_id();
        let reg = |layout: PoolLayout| proto::RegisterPoolRequest {
            session_id: sid,
            model_id: "m".into(),
            geometry: Some(g.into()),
            num_slots: slots,
            tp_rank: 0,
            tp_size: 1,
            location: Some(proto::register_pool_request::Location::ShmPath(
                path.display().to_string(),
            )),
            layout: Some((&layout).into()),
        };
        let mut layers = PoolLayout::of_kind(kind, &g, slots, 0).layers().to_vec();
        layers[1].k_offset = layers[0].k_offset;
        let overlapping = PoolLayout::new(layers.clone());
        let too_long = PoolLayout::of_kind(kind, &g, slots, 4096);
        let mut short = layers.clone();
        short.pop();
        let mut rpc = client.stub();
        for (layout, field) in [
            (overlapping, "layout.layers[1]"),
            (too_long, "layout.layers["),
            (PoolLayout::new(short), "layout.layers"),
        ] {
            let err = rpc.register_pool(reg(layout)).await.unwrap_err();
            assert!(
                err.code() == Code::InvalidArgument && err.message().contains(field),
                "{kind}: {err:?}"
            );
        }
        // Headerless memory registered as kvtier's pool file: refused, not misread.
        let mut bare = reg(PoolLayout::new(vec![]));
        bare.layout = None;
        assert_ne!(rpc.register_pool(bare).await.unwrap_err().code(), Code::Ok);
        assert_eq!(
            client.stats().await.unwrap().pools,
            1,
            "{kind}: only the good pool"
        );
        drop(client);
    }
    sidecar.stop().await;
}

/// A process pool (the engine's own memory, no shared file) in each engine layout: blocks
/// stored from it come back bit-exact into other slots of it, written by the sidecar with
/// process_vm_writev; buffers the process has not mapped, or that do not hold the layout, are
/// refused at registration; memory freed under a registered pool fails that request with
/// FAILED_PRECONDITION, and the sidecar serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_pools_move_the_engines_own_memory_bit_exact() {
    use kvtier_store::{Prefault, ShmRegion};
    let sidecar = Sidecar::start(|_| {}).await;
    let g = geometry();
    let slots = 32;
    let buffer = |m: &ShmRegion| proto::ProcessMemory {
        buffers: vec![proto::ProcessBuffer {
            address: m.dma_address(0, m.len()).unwrap() as u64,
            size_bytes: m.len() as u64,
        }],
    };
    for kind in LayoutKind::ALL {
        let mut client = Client::connect(&sidecar.target, "process-engine").await.unwrap();
        let layout = PoolLayout::of_kind(kind, &g, slots, 0);
        let bytes = PoolLayout::kind_bytes(&g, slots, 0) as usize;
        // The engine's memory, which no other process maps (MAP_PRIVATE | MAP_ANONYMOUS); the
        // same layout over a shared file lets the test's pool accessors check it.
        let memory = ShmRegion::create_private("engine", bytes, Prefault::Populate).unwrap();
        let handle = client
            .register_process_pool(buffer(&memory), slots, Some(&layout), "m", 0, 1)
            .await
            .unwrap();
        let tokens: Vec<u32> = (0..16 * 8).map(|t| t * 17 + kind as u32).collect();
        let keys = handle.keys("", &tokens).unwrap();
        let view = CpuDevicePool::create_with_layout(None, g, slots, layout.clone(), bytes).unwrap();
        write_kv(&view, &keys, 0);
        memory.write(0, &read_all(view.region())).unwrap();
        let stored = client
            .store(&handle, "", None, &Engine::slots(&keys, 0))
            .await
            .unwrap();
        assert_eq!(stored.stored_blocks, 8, "{kind}");
        memory.fill(0, bytes, 0).unwrap();
        let out = client
            .load_all(&handle, "", &Engine::slots(&keys, 16), None)
            .await
            .unwrap();
        assert_eq!(out.done.loaded_blocks, 8, "{kind}");
        view.region().write(0, &read_all(&memory)).unwrap();
        assert_eq!(first_wrong_kv(&view, &keys, 16), None, "{kind}");
        assert!(read_all(&memory).iter().filter(|&&b| b != 0).count() > 0);
        drop(client);
    }

    let mut client = Client::connect(&sidecar.target, "process-engine").await.unwrap();
    let memory = ShmRegion::create_private(
        "engine",
        PoolLayout::kind_bytes(&g, slots, 0) as usize,
        Prefault::Populate,
    )
    .unwrap();
    // One slot more than the buffer holds; memory this process has not mapped.
    let err = client
        .register_process_pool(buffer(&memory), slots + 1, None, "m", 0, 1)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kvtier_client::ClientError::Status(s) if s.code() == Code::InvalidArgument
        && s.message().contains("past the end of buffer 0")),
        "{err}"
    );
    let unmapped = proto::ProcessMemory {
        buffers: vec![proto::ProcessBuffer {
            address: 4096,
            size_bytes: memory.len() as u64,
        }],
    };
    let err = client
        .register_process_pool(unmapped, slots, None, "m", 0, 1)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kvtier_client::ClientError::Status(s) if s.code() == Code::FailedPrecondition
        && s.message().contains("not mapped")),
        "{err}"
    );
    // Memory taken away under a registered pool (made inaccessible, as freed memory is, but
    // kept reserved so that nothing else of this test process is mapped there): that load
    // fails, the sidecar serves on.
    let handle = client
        .register_process_pool(buffer(&memory), slots, None, "m", 0, 1)
        .await
        .unwrap();
    let keys = handle.keys("", &(0..16 * 2).collect::<Vec<u32>>()).unwrap();
    assert_eq!(
        client
            .store(&handle, "", None, &Engine::slots(&keys, 0))
            .await
            .unwrap()
            .stored_blocks,
        2
    );
    // SAFETY: the range is the region's own mapping; nothing reads it until it is unmapped.
    let r = unsafe {
        libc::mprotect(
            memory.dma_address(0, memory.len()).unwrap().cast(),
            memory.len(),
            libc::PROT_NONE,
        )
    };
    assert_eq!(r, 0);
    let err = client
        .load_all(&handle, "", &Engine::slots(&keys, 2), None)
        .await
        .unwrap_err();
    assert_eq!(code(err), Code::FailedPrecondition);
    let mut other = engine(&sidecar, 4).await;
    let keys = other.handle.keys("", &(0..16 * 2).collect::<Vec<u32>>()).unwrap();
    other.write(&keys, 0);
    let st = other
        .client
        .store(&other.handle, "", None, &Engine::slots(&keys, 0))
        .await
        .unwrap();
    assert_eq!(st.stored_blocks, 2);
    sidecar.stop().await;
}

fn read_all(region: &kvtier_store::ShmRegion) -> Vec<u8> {
    let mut v = vec![0u8; region.len()];
    region.read(0, &mut v).unwrap();
    v
}

/// A pool of two KV cache groups (vLLM's hybrid KV cache manager: layer 1 in group 1, over
/// the same memory as layer 0): a block is stored from, and loaded into, each layer's own
/// group's slot, none into a group's NO_SLOT; requests that do not name the groups' slots
/// right are INVALID_ARGUMENT naming the field, and device residency is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pools_of_several_kv_cache_groups_move_each_layer_in_its_groups_slot() {
    use kvtier_transfer::NO_SLOT;
    use kvtier_transfer::test_util::kv;
    let sidecar = Sidecar::start(|_| {}).await;
    let g = geometry();
    let slots = 16;
    let mut layers = PoolLayout::of_kind(LayoutKind::Vllm, &g, slots, 0)
        .layers()
        .to_vec();
    layers[1] = kvtier_core::LayerLayout {
        group: 1,
        ..layers[0]
    };
    let layout = PoolLayout::new(layers);
    let path = sidecar.dir.path().join("pool-hybrid");
    let pool = CpuDevicePool::create_with_layout(
        Some(&path),
        g,
        slots,
        layout.clone(),
        PoolLayout::kind_bytes(&g, slots, 0) as usize,
    )
    .unwrap();
    let mut client = Client::connect(&sidecar.target, "hybrid-engine").await.unwrap();
    let handle = client.register_cpu_pool(&pool, "m", 0, 1).await.unwrap();
    let tokens: Vec<u32> = (0..16 * 4).map(|t| t * 7 + 1).collect();
    let keys = handle.keys("", &tokens).unwrap();
    let bl = g.bytes_per_block_layer();
    // Block b: layer 0 in slot b (group 0), layer 1 in slot 4 + b (group 1).
    let (g0, g1): (Vec<u32>, Vec<u32>) = (0..4).map(|b| (b, 4 + b)).unzip();
    for (b, &k) in keys.iter().enumerate() {
        pool.write_slot_layer(g0[b], 0, &kv(k, 0, bl)).unwrap();
        pool.write_slot_layer(g1[b], 1, &kv(k, 1, bl)).unwrap();
    }
    let sid = client.session_id();
    let packed = kvtier_proto::wire::pack_keys(&keys);
    let group = |slots: Vec<u32>| vec![proto::GroupSlots { slots }];
    let store = |slots: Vec<u32>, groups: Vec<proto::GroupSlots>| proto::StoreRequest {
        session_id: sid,
        pool_id: handle.id,
        keys: packed.clone(),
        slots,
        group_slots: groups,
        ..Default::default()
    };
    let load = |slots: Vec<u32>, groups: Vec<proto::GroupSlots>| proto::LoadRequest {
        session_id: sid,
        pool_id: handle.id,
        keys: packed.clone(),
        slots,
        group_slots: groups,
        done_only: true,
        ..Default::default()
    };
    let mut rpc = client.stub();
    let refused = |e: tonic::Status, code: Code, words: &str| {
        assert!(e.code() == code && e.message().contains(words), "{e:?}");
    };
    // Wrong before anything moves: no groups named, a short list, NO_SLOT or a repeat in a
    // store, a slot past the pool.
    for (req, words) in [
        (
            store(g0.clone(), vec![]),
            "group_slots: 0 list(s) for a pool of 2",
        ),
        (
            store(g0.clone(), group(vec![4, 5])),
            "group_slots[0]: 2 slots for 4 keys",
        ),
        (
            store(g0.clone(), group(vec![4, NO_SLOT, 6, 7])),
            "NO_SLOT in a store",
        ),
        (
            store(g0.clone(), group(vec![4, 4, 6, 7])),
            "group_slots[0]: device slot 4 appears twice",
        ),
        (
            store(g0.clone(), group(vec![4, 5, 6, 99])),
            "group_slots[0]: device slot 99 out of range",
        ),
        (
            store(vec![0, 1, 99, 3], group(g1.clone())),
            "slots: device slot 99 out of range",
        ),
    ] {
        refused(rpc.store(req).await.unwrap_err(), Code::InvalidArgument, words);
    }
    assert_eq!(client.stats().await.unwrap().host_used_bytes, 0, "nothing stored");
    let r = rpc
        .store(store(g0.clone(), group(g1.clone())))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.stored_blocks, 4);

    // Zeroed, then loaded elsewhere: block 1 has no slot in group 1.
    let zeros = vec![0u8; bl];
    for s in 0..slots {
        pool.write_slot_layer(s, 0, &zeros).unwrap();
    }
    let (l0, l1) = (vec![8, 9, 10, 11], vec![12, NO_SLOT, 14, 15]);
    let mut events = rpc
        .load(load(l0.clone(), group(l1.clone())))
        .await
        .unwrap()
        .into_inner();
    let mut loaded = None;
    while let Some(e) = events.message().await.unwrap() {
        if let Some(proto::load_event::Event::Done(d)) = e.event {
            loaded = Some(d.loaded_blocks);
        }
    }
    assert_eq!(loaded, Some(4));
    let mut buf = vec![0u8; bl];
    for (b, &k) in keys.iter().enumerate() {
        pool.read_slot_layer(l0[b], 0, &mut buf).unwrap();
        assert!(buf == kv(k, 0, bl), "block {b} layer 0");
        if l1[b] != NO_SLOT {
            pool.read_slot_layer(l1[b], 1, &mut buf).unwrap();
            assert!(buf == kv(k, 1, bl), "block {b} layer 1");
        }
    }
    pool.read_slot_layer(13, 1, &mut buf).unwrap();
    assert!(buf.iter().all(|&x| x == 0), "NO_SLOT: nothing written");
    // Loads may leave group 0 out too; the groups' lists still pair with the keys.
    refused(
        rpc.load(load(l0.clone(), vec![])).await.unwrap_err(),
        Code::InvalidArgument,
        "group_slots",
    );
    refused(
        rpc.load(load(l0.clone(), group(vec![12, 13, 14])))
            .await
            .unwrap_err(),
        Code::InvalidArgument,
        "group_slots[0]: 3 slots for 4 keys",
    );
    // Layer 1 (group 1) lies on layer 0 (group 0): one slot in both groups of a load would
    // take both layers into the same bytes.
    refused(
        rpc.load(load(l0.clone(), group(vec![12, NO_SLOT, 10, 15])))
            .await
            .unwrap_err(),
        Code::InvalidArgument,
        "group_slots[0]: device slot 10 is also in slots, and their layers share its bytes",
    );
    // A one-group pool takes no group_slots.
    let plain = engine(&sidecar, 8).await;
    let mut plain_rpc = plain.client.stub();
    let mut req = load(vec![0, 1, 2, 3], group(vec![4, 5, 6, 7]));
    req.session_id = plain.client.session_id();
    req.pool_id = plain.handle.id;
    refused(
        plain_rpc.load(req).await.unwrap_err(),
        Code::InvalidArgument,
        "for a pool of 1 KV cache group",
    );
    // Device residency is one slot per block: refused for a pool of groups.
    let err = rpc
        .device_events(proto::DeviceEventsRequest {
            session_id: sid,
            pool_id: handle.id,
            events: vec![proto::DeviceEvent {
                kind: proto::device_event::Kind::Stored as i32,
                key: kvtier_proto::wire::pack_keys(&keys[..1]),
                slot: 0,
            }],
        })
        .await
        .unwrap_err();
    refused(err, Code::FailedPrecondition, "2 KV cache groups");
    drop((client, plain));
    sidecar.stop().await;
}
