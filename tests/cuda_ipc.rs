//! A GPU pool handed over by CUDA IPC from another process: PyTorch allocates KV in vLLM's
//! layout (scripts/gpu/torch_kv_pool.py), the sidecar opens its handles, stores blocks from
//! it, the tensors are zeroed, and loads bring the bytes back bit-exact. Then the engine
//! process dies with its pool registered: the sidecar closes the mapping and serves the next
//! engine. Needs a GPU and PyTorch: ignored in a plain `cargo test`, run by
//! scripts/gpu-check.sh (`--include-ignored`), which sets KVTIER_TORCH_PYTHON.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use common::*;
use kvtier_client::Client;
use kvtier_core::{BlockKey, ByteSize, Dtype, KvGeometry, LayerLayout, PoolLayout};
use kvtier_proto::proto;

/// Qwen3-30B-A3B's KV geometry (4 KV heads × 128 dims, bf16) in 64-token blocks: 128 KiB
/// block-layers, 4 layers.
fn gpu_geometry() -> KvGeometry {
    KvGeometry::new(4, 4, 128, Dtype::Bf16, 64).unwrap()
}

const BLOCKS: u32 = 64;

/// The PyTorch process and its pool's description.
struct TorchPool {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    spec: serde_json::Value,
}

impl TorchPool {
    fn start() -> TorchPool {
        let python = std::env::var("KVTIER_TORCH_PYTHON").unwrap_or_else(|_| "python3".into());
        let g = gpu_geometry();
        // The script beside a prebuilt test binary (scripts/gpu-check.sh sets its path), or
        // in this checkout.
        let script = std::env::var("KVTIER_TORCH_SCRIPT")
            .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/gpu/torch_kv_pool.py").into());
        let mut child = Command::new(python)
            .arg(&script)
            .args(["--layers", &g.layers().to_string()])
            .args(["--blocks", &BLOCKS.to_string()])
            .args(["--block-tokens", &g.block_tokens().to_string()])
            .args(["--kv-heads", &g.kv_heads().to_string()])
            .args(["--head-dim", &g.head_dim().to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python with torch (KVTIER_TORCH_PYTHON)");
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let spec: serde_json::Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
        eprintln!(
            "torch pool: {} on {} (torch {})",
            spec["buffers"].as_array().unwrap().len(),
            spec["device_name"],
            spec["torch"]
        );
        TorchPool {
            child,
            stdin,
            stdout,
            spec,
        }
    }

    fn ask(&mut self, cmd: &str) -> String {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        line.trim().to_string()
    }

    fn count(&mut self, cmd: &str, field: &str) -> u64 {
        let v: serde_json::Value = serde_json::from_str(&self.ask(cmd)).unwrap();
        v[field].as_u64().unwrap_or_else(|| panic!("{cmd}: {v}"))
    }

    /// The pool as RegisterPoolRequest.cuda, and its layout: per layer one tensor, K plane
    /// then V plane, a slot's K or V one half block-layer.
    fn registration(&self) -> (proto::CudaPool, PoolLayout) {
        let g = gpu_geometry();
        let half = g.bytes_per_block_layer() as u64 / 2;
        let hex = |s: &str| -> Vec<u8> {
            (0..s.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
                .collect()
        };
        let buffers: Vec<proto::CudaBuffer> = self.spec["buffers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| proto::CudaBuffer {
                ipc_handle: hex(b["ipc_handle"].as_str().unwrap()).into(),
                offset_bytes: b["offset_bytes"].as_u64().unwrap(),
                size_bytes: b["size_bytes"].as_u64().unwrap(),
            })
            .collect();
        let layout = PoolLayout::new(
            (0..g.layers())
                .map(|l| LayerLayout {
                    k_buffer: l,
                    v_buffer: l,
                    v_offset: u64::from(BLOCKS) * half,
                    slot_stride: half,
                    ..LayerLayout::default()
                })
                .collect(),
        );
        let cuda = proto::CudaPool {
            device_ordinal: 0,
            device_uuid: hex(self.spec["device_uuid"].as_str().unwrap_or("")).into(),
            buffers,
        };
        (cuda, layout)
    }
}

impl Drop for TorchPool {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a CUDA GPU and PyTorch (scripts/gpu-check.sh runs it)"]
async fn a_torch_pool_by_ipc_handle_round_trips_bit_exact_and_survives_its_engine() {
    let g = gpu_geometry();
    let sidecar = Sidecar::start(|c| {
        serve_geometry(c, g);
        c.host.capacity = ByteSize::mib(128);
    })
    .await;
    if let Some(reason) = kvtier_cuda::status().unavailable_reason() {
        panic!("this test needs CUDA: {reason}");
    }
    let mut torch = TorchPool::start();
    let mut client = Client::connect(&sidecar.target, "torch-engine").await.unwrap();
    let (cuda, layout) = torch.registration();
    let pool = client
        .register_cuda_pool(cuda, BLOCKS, &layout, "torch-model", 0, 1)
        .await
        .unwrap();
    assert_eq!(torch.ask("fill 7"), "ok");
    // Store the first half of the blocks, zero every tensor, load them into the second half.
    let half = BLOCKS / 2;
    let tokens: Vec<u32> = (0..half * g.block_tokens()).map(|t| t * 31 + 5).collect();
    let keys: Vec<BlockKey> = pool.keys("", &tokens).unwrap();
    assert_eq!(keys.len(), half as usize);
    let at = |first: u32| -> Vec<(BlockKey, u32)> {
        keys.iter()
            .enumerate()
            .map(|(i, &k)| (k, first + i as u32))
            .collect()
    };
    let stored = client.store(&pool, "", None, &at(0)).await.unwrap();
    assert_eq!(stored.stored_blocks, half);
    assert_eq!(torch.ask("zero"), "ok");
    let out = client.load_all(&pool, "", &at(half), None).await.unwrap();
    assert_eq!(out.done.loaded_blocks, half);
    assert_eq!(out.layers_ready, (0..g.layers()).collect::<Vec<_>>());
    let diff = torch.count(&format!("compare 0 {half} {half}"), "differing_elements");
    let untouched = torch.count(&format!("zeros 0 {half}"), "nonzero_elements");
    eprintln!(
        "cuda ipc: {half} blocks x {} layers stored from and loaded into a torch tensor in vLLM's layout: differing_elements={diff} nonzero_elements_outside_the_load={untouched}",
        g.layers()
    );
    assert_eq!(diff, 0, "loaded bytes differ from the stored ones");
    assert_eq!(untouched, 0, "the load wrote outside its slots");

    // The engine dies with its pool registered; its session ends: the sidecar closes the IPC
    // mapping and serves the next engine.
    drop(torch);
    drop(client);
    let mut torch = TorchPool::start();
    let mut client = Client::connect(&sidecar.target, "torch-engine-2").await.unwrap();
    let (cuda, layout) = torch.registration();
    let pool = client
        .register_cuda_pool(cuda, BLOCKS, &layout, "torch-model", 0, 1)
        .await
        .unwrap();
    assert_eq!(torch.ask("expect 7"), "ok");
    let out = client.load_all(&pool, "", &at(half), None).await.unwrap();
    assert_eq!(out.done.loaded_blocks, half, "the blocks outlive the engine");
    assert_eq!(
        torch.count(&format!("compare 0 {half} {half}"), "differing_elements"),
        0
    );
    // The first session ends once the sidecar sees its stream close: poll for it.
    let mut pools = 0;
    for _ in 0..100 {
        pools = client.stats().await.unwrap().pools;
        if pools == 1 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(pools, 1, "the dead engine's pool is gone");
    drop(client);
    drop(torch);
    sidecar.stop().await;
}
