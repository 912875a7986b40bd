//! The CUDA pool against the pool contract and the real queues. Tests that need a GPU are
//! ignored in a plain `cargo test` (CI has none) and say so; `scripts/gpu-check.sh` runs them
//! with `--include-ignored` on a GPU machine, where they fail if CUDA is not usable.

use std::sync::Arc;

use kvtier_core::{BlockKey, ErrorKind, KvGeometry, LayoutKind, NamespaceFingerprint};
use kvtier_cuda::{CopyMethod, CudaBufferSpec, CudaDevicePool, CudaPoolSpec, CudaStatus};
use kvtier_store::{EvictionKind, HostTier, TieredStore};
use kvtier_transfer::conformance;
use kvtier_transfer::pool_conformance::run_pool_checks;
use kvtier_transfer::test_util::{Rig, chain_blocks, host_config, keys, kv};
use kvtier_transfer::{DevicePool, LoadEvent, TransferConfig, TransferError, TransferQueues};

const NS: NamespaceFingerprint = NamespaceFingerprint(0xc0da);

/// Without a usable driver, every CUDA entry point answers FAILED_PRECONDITION with the
/// probe's reason, and the GPU tests of this file are the ones reported ignored.
#[test]
fn without_cuda_the_pool_refuses_with_the_reason() {
    let status = kvtier_cuda::status();
    eprintln!("{}", status.describe());
    let CudaStatus::Unavailable { reason } = status else {
        // With a driver the same calls must succeed (the GPU tests below go further).
        let g = conformance::geometry();
        CudaDevicePool::allocate(0, g, 8, LayoutKind::Vllm, CopyMethod::Auto).unwrap();
        return;
    };
    assert!(!reason.is_empty());
    let g = conformance::geometry();
    let err = CudaDevicePool::allocate(0, g, 8, LayoutKind::Vllm, CopyMethod::Auto).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::FailedPrecondition, "{err}");
    assert!(err.to_string().contains(reason.as_str()), "{err}");
    let spec = CudaPoolSpec {
        device_ordinal: 0,
        device_uuid: vec![],
        buffers: vec![CudaBufferSpec {
            ipc_handle: vec![0; 64],
            offset_bytes: 0,
            size_bytes: 1 << 20,
        }],
    };
    let layout = kvtier_core::PoolLayout::of_kind(LayoutKind::Vllm, &g, 8, 0);
    let err = CudaDevicePool::open_ipc(&spec, g, 8, layout, CopyMethod::Auto).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::FailedPrecondition, "{err}");
}

fn pool(g: KvGeometry, slots: u32, kind: LayoutKind, method: CopyMethod) -> CudaDevicePool {
    CudaDevicePool::allocate(0, g, slots, kind, method).unwrap_or_else(|e| panic!("{kind} {method}: {e}"))
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh runs it)"]
fn cuda_pool_keeps_the_pool_contract_in_every_layout_and_method() {
    let g = conformance::geometry();
    for kind in LayoutKind::ALL {
        for method in CopyMethod::ALL {
            let p = pool(g, 24, kind, method);
            let failed = run_pool_checks(&p);
            assert!(failed.is_empty(), "{kind} {}: {failed:?}", p.method_description());
        }
    }
}

/// Store from GPU slots through the real queues, scrub the slots, load into others: the
/// bytes come back bit-exact, one layer event per layer, in every layout.
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh runs it)"]
fn cuda_pool_round_trips_through_the_queues_in_every_layout() {
    // Qwen3-30B-A3B's block-layer: 4 KV heads × 128 dim × bf16 × 16 tokens × 2 = 32 KiB
    // (128 KiB at 64 tokens); 4 layers keep the test short.
    let g = KvGeometry::new(4, 4, 128, kvtier_core::Dtype::Bf16, 64).unwrap();
    let n = 12usize;
    for kind in LayoutKind::ALL {
        let p = Arc::new(pool(g, 2 * n as u32, kind, CopyMethod::Auto));
        let dyn_pool: Arc<dyn DevicePool> = p.clone();
        let host = HostTier::new(g, &host_config(g, 2 * n as u64, EvictionKind::S3fifo)).unwrap();
        let store = TieredStore::host_only(host.clone());
        let queues = TransferQueues::new(&TransferConfig::default()).unwrap();
        let ks: Vec<BlockKey> = keys(n, 7, g.block_tokens());
        let bl = g.bytes_per_block_layer();
        for (i, &k) in ks.iter().enumerate() {
            for layer in 0..g.layers() {
                p.write_slot_layer(i as u32, layer, &kv(k, layer, bl)).unwrap();
            }
        }
        let report = queues
            .store
            .submit(&dyn_pool, &store, NS, &chain_blocks(&ks, 0))
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!(report.stored_blocks, n, "{kind}");
        for s in n..2 * n {
            for layer in 0..g.layers() {
                p.fill_slot_layer(s as u32, layer, 0).unwrap();
            }
        }
        let mut ticket = queues
            .load
            .submit(&dyn_pool, &store, NS, &Rig::load_blocks(&ks, n as u32))
            .unwrap();
        let mut layers = Vec::new();
        let done = loop {
            match ticket.next_event().unwrap() {
                LoadEvent::LayerReady { layer } => layers.push(layer),
                LoadEvent::Done(r) => break r.unwrap(),
                LoadEvent::Missing { keys } => panic!("{kind}: {keys:?} missing"),
            }
        };
        assert_eq!(done.loaded_blocks, n, "{kind}");
        assert_eq!(layers, (0..g.layers()).collect::<Vec<_>>(), "{kind}");
        let mut got = vec![0u8; bl];
        for (i, &k) in ks.iter().enumerate() {
            for layer in 0..g.layers() {
                p.read_slot_layer((n + i) as u32, layer, &mut got).unwrap();
                assert!(
                    got == kv(k, layer, bl),
                    "{kind}: slot {} layer {layer} differs",
                    n + i
                );
            }
        }
    }
}

/// Handles that do not open, another GPU's UUID, buffers past their allocation: each refused
/// naming the field, and the GPU keeps serving.
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh runs it)"]
fn bad_cuda_pools_are_refused_naming_the_field() {
    let g = conformance::geometry();
    let layout = kvtier_core::PoolLayout::of_kind(LayoutKind::Vllm, &g, 8, 0);
    let spec = |handle: Vec<u8>, uuid: Vec<u8>| CudaPoolSpec {
        device_ordinal: 0,
        device_uuid: uuid,
        buffers: vec![CudaBufferSpec {
            ipc_handle: handle,
            offset_bytes: 0,
            size_bytes: 1 << 20,
        }],
    };
    let open =
        |s: &CudaPoolSpec| CudaDevicePool::open_ipc(s, g, 8, layout.clone(), CopyMethod::Auto).unwrap_err();
    let field = |e: &TransferError| match e {
        TransferError::Layout(l) => l.field.clone(),
        e => panic!("not a layout error: {e}"),
    };
    let e = open(&spec(vec![7; 64], vec![]));
    assert_eq!(field(&e), "cuda.buffers[0].ipc_handle", "{e}");
    let e = open(&spec(vec![7; 12], vec![]));
    assert_eq!(field(&e), "cuda.buffers[0].ipc_handle", "{e}");
    let e = open(&spec(vec![7; 64], vec![1; 5]));
    assert_eq!(field(&e), "cuda.device_uuid", "{e}");
    let e = open(&spec(vec![7; 64], vec![0xee; 16]));
    assert_eq!(e.kind(), ErrorKind::FailedPrecondition, "{e}");
    let mut other_gpu = spec(vec![7; 64], vec![]);
    other_gpu.device_ordinal = 99;
    assert_eq!(open(&other_gpu).kind(), ErrorKind::FailedPrecondition);
    // The GPU still serves.
    let p = pool(g, 8, LayoutKind::Kvtier, CopyMethod::Auto);
    assert!(run_pool_checks(&p).is_empty());
}
