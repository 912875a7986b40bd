//! The engine against a real `kvtier serve` process: the same greedy tokens under recompute,
//! a device hit, a host hit and a disk hit; a kvtier load that fails part-way (corrupt disk
//! blocks) falls back to recomputing; the sidecar killed and restarted mid-run.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvtier_client::Client;
use kvtier_core::{BlockHasher, KvGeometry, Namespace};
use kvtier_engine::{Engine, EngineConfig, GenRequest, KvReuse, ModelConfig, Sampling, Usage, Weights};

struct Sidecar(Child);

impl Drop for Sidecar {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `kvtier serve` for `g` with a disk tier that persists every stored block.
fn sidecar(socket: &Path, disk: &Path, g: KvGeometry) -> Sidecar {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(["serve", "--socket"])
        .arg(socket)
        .args(["--metrics", "off", "--host-capacity", "64MiB", "--disk-dir"])
        .arg(disk)
        .args([
            "--set",
            "write_policy=all",
            "--set",
            "disk.capacity=256MiB",
            "--set",
            "disk.region_size=8MiB",
            "--set",
            "disk.create_dir=true",
        ])
        .args(["--set", &format!("model.layers={}", g.layers())])
        .args(["--set", &format!("model.kv_heads={}", g.kv_heads())])
        .args(["--set", &format!("model.head_dim={}", g.head_dim())])
        .args(["--set", &format!("model.block_tokens={}", g.block_tokens())])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    loop {
        let line = lines.next().expect("the sidecar exited before serving").unwrap();
        if line.contains("kvtier: serving") {
            break;
        }
    }
    std::thread::spawn(move || for _ in lines {});
    Sidecar(child)
}

fn disk_entries(rt: &tokio::runtime::Runtime, target: &str) -> u64 {
    rt.block_on(async {
        let mut c = Client::connect(target, "observer").await.unwrap();
        let json: serde_json::Value = serde_json::from_str(&c.stats().await.unwrap().json).unwrap();
        json["tiers"]["disk"]["entries"].as_u64().unwrap_or(0)
    })
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Flips one payload byte of each disk entry whose header holds one of `keys`, in place (as
/// another writer would: the file never shrinks under the sidecar's mappings).
fn corrupt(disk: &Path, keys: &[kvtier_core::BlockKey]) -> usize {
    use std::os::unix::fs::FileExt;
    let mut hit = 0;
    for entry in std::fs::read_dir(disk).unwrap() {
        let path = entry.unwrap().path();
        let bytes = std::fs::read(&path).unwrap();
        let mut flips = Vec::new();
        for key in keys {
            let needle = key.0.to_le_bytes();
            let mut at = 0;
            while let Some(p) = bytes[at..].windows(16).position(|w| w == needle) {
                let header = (at + p) / 4096 * 4096;
                let payload = header + 4096 + 100;
                if payload < bytes.len() && bytes[header..header + 8] == *b"KVTBLOK\0" {
                    flips.push(payload);
                    hit += 1;
                }
                at += p + 16;
            }
        }
        if !flips.is_empty() {
            let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
            for payload in flips {
                file.write_all_at(&[bytes[payload] ^ 0x5a], payload as u64)
                    .unwrap();
            }
        }
    }
    hit
}

fn run_scenarios(preset: &str, layers: Option<usize>, block_tokens: u32, prompt_tokens: usize) {
    let mut model = ModelConfig::preset(preset).unwrap();
    if let Some(l) = layers {
        model = model.with_layers(l).unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("kvtier.sock");
    let disk = dir.path().join("disk");
    let target = format!("unix://{}", socket.display());
    let config = EngineConfig {
        block_tokens,
        device_slots: 256,
        kv_reuse: KvReuse::Tiered,
        sidecar: Some(kvtier_client::ConnectOptions::new(target.clone())),
        max_batch_tokens: 256,
        reconnect_ms: 100,
        ..EngineConfig::default()
    };
    let g = kvtier_engine::engine::kv_geometry(&model, &config).unwrap();
    let mut server = sidecar(&socket, &disk, g);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let weights = Weights::random(&model, 5).unwrap();
    let engine = Engine::start(model.clone(), weights, config).unwrap();
    let vocab = model.vocab as u32;
    let prompt = |seed: u32| -> Vec<u32> {
        (0..prompt_tokens as u32)
            .map(|i| (i * 7919 + seed * 104_729) % vocab)
            .collect()
    };
    let req = |p: &Vec<u32>| GenRequest {
        prompt: p.clone(),
        max_tokens: 6,
        sampling: Sampling::default(),
        ignore_eos: true,
        cache_salt: String::new(),
        ..GenRequest::default()
    };
    let run = |p: &Vec<u32>| -> (Vec<u32>, Usage) { engine.generate(req(p)).unwrap() };
    let reusable = (prompt_tokens - 1) / block_tokens as usize * block_tokens as usize;
    let blocks = reusable / block_tokens as usize;

    // Recompute (nothing cached anywhere), for two prompts.
    let (p1, p2) = (prompt(1), prompt(2));
    let (want1, u) = run(&p1);
    assert_eq!(u.cached.total(), 0, "{preset}: a cold prompt is computed");
    let (want2, _) = run(&p2);
    // Device hit.
    let (t, u) = run(&p1);
    assert_eq!(
        (t.as_slice(), u.cached.device),
        (want1.as_slice(), reusable),
        "{preset}: device hit"
    );
    // Host hit: the device cache forgets, kvtier's host tier has the blocks.
    engine.clear_device_cache().unwrap();
    let (t, u) = run(&p1);
    assert_eq!(
        (t.as_slice(), u.cached.host),
        (want1.as_slice(), reusable),
        "{preset}: host hit {u:?}"
    );

    // Every block of both prompts reaches the disk; then the sidecar dies.
    wait_for("the disk writes", || {
        disk_entries(&rt, &target) >= 2 * blocks as u64
    });
    server.0.kill().unwrap();
    server.0.wait().unwrap();
    // /health says so before any request: the end of the session stream is seen at once.
    wait_for("the engine to see the sidecar gone", || {
        !engine.stats().unwrap().sidecar_connected
    });
    // Down: the engine serves by recompute.
    engine.clear_device_cache().unwrap();
    let (t, u) = run(&p1);
    assert_eq!(
        (t.as_slice(), u.cached.total()),
        (want1.as_slice(), 0),
        "{preset}: served with the sidecar down"
    );
    assert!(!engine.stats().unwrap().sidecar_connected);

    // Restart: host memory is gone, the disk recovered. Then corrupt the second half of
    // prompt 2's blocks under the running sidecar (its index still lists them).
    let _server = sidecar(&socket, &disk, g);
    // An idle engine reconnects by itself (within its retry interval, 100 ms here).
    wait_for("the idle engine to reconnect", || {
        engine.stats().unwrap().sidecar_connected
    });
    let ns = Namespace::new(model.name.clone(), g, 0, 1, "")
        .unwrap()
        .fingerprint();
    let keys2 = BlockHasher::new(ns, block_tokens).keys(&p2[..reusable]);
    assert!(
        corrupt(&disk, &keys2[blocks / 2..]) > 0,
        "found prompt 2's entries on disk"
    );
    engine.clear_device_cache().unwrap();
    let start = Instant::now();
    let (t, u) = loop {
        let (t, u) = run(&p1);
        if u.cached.disk > 0 || start.elapsed() > Duration::from_secs(20) {
            break (t, u);
        }
        engine.clear_device_cache().unwrap();
        std::thread::sleep(Duration::from_millis(150));
    };
    assert_eq!(
        (t.as_slice(), u.cached.disk),
        (want1.as_slice(), reusable),
        "{preset}: disk hit {u:?}"
    );

    // Prompt 2: the first half loads, the corrupt half is reported missing and recomputed.
    let before = engine.stats().unwrap().load_fallback_tokens;
    let (t, u) = run(&p2);
    assert_eq!(t, want2, "{preset}: tokens after a partial load");
    assert_eq!(
        u.cached.disk,
        blocks / 2 * block_tokens as usize,
        "{preset}: {u:?}"
    );
    assert!(engine.stats().unwrap().load_fallback_tokens > before);
}

#[test]
fn tiny_model_same_tokens_from_every_tier_and_through_faults() {
    run_scenarios("tiny-moe", None, 16, 200);
}

#[test]
fn qwen3_30b_a3b_one_layer_same_tokens_from_every_tier() {
    run_scenarios("qwen3-30b-a3b", Some(1), 64, 300);
}
