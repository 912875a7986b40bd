//! Faults a real `kvtier serve` process must survive: a client that truncates, unlinks or
//! replaces its pool file (the others keep loading bit-exact), a graceful stop right after a
//! burst of stores (every acknowledged block is on disk after the restart), and a SIGKILL right
//! after durable stores (every durable block is).

mod common;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use common::*;
use kvtier_client::{Client, ClientError, PoolHandle};
use kvtier_core::BlockKey;
use kvtier_transfer::CpuDevicePool;
use tonic::Code;

/// A client with its own pool file, and the blocks it stored from slots `0..n`.
struct Engine {
    /// Also the cache salt: every engine has its own namespace.
    name: String,
    client: Client,
    pool: CpuDevicePool,
    handle: PoolHandle,
    keys: Vec<BlockKey>,
}

impl Engine {
    async fn start(target: &str, dir: &Path, name: &str, slots: u32, stored: usize) -> Engine {
        let mut client = Client::connect(target, name).await.unwrap();
        let pool = CpuDevicePool::create(Some(&dir.join(format!("pool-{name}"))), geometry(), slots).unwrap();
        let handle = client.register_cpu_pool(&pool, "fault-test", 0, 1).await.unwrap();
        let tokens: Vec<u32> = (0..stored as u32 * 16)
            .map(|t| t ^ (name.len() as u32 * 7919))
            .collect();
        let keys = handle.keys(name, &tokens).unwrap();
        let mut e = Engine {
            name: name.to_owned(),
            client,
            pool,
            handle,
            keys,
        };
        e.store_all(0).await;
        e
    }

    fn slots(&self, first_slot: u32) -> Vec<(BlockKey, u32)> {
        self.keys
            .iter()
            .enumerate()
            .map(|(i, &k)| (k, first_slot + i as u32))
            .collect()
    }

    /// Stores every block from slots `first_slot..`, in runs of 64 (one request each).
    async fn store_all(&mut self, first_slot: u32) {
        write_kv(&self.pool, &self.keys, first_slot);
        let name = self.name.clone();
        let run = self.slots(first_slot);
        let mut parent = None;
        for chunk in run.chunks(64) {
            let r = self
                .client
                .store(&self.handle, &name, parent, chunk)
                .await
                .unwrap();
            assert_eq!(r.stored_blocks + r.already_stored, chunk.len() as u32);
            parent = chunk.last().map(|b| b.0);
        }
    }

    async fn load(&mut self, first_slot: u32) -> Result<u32, ClientError> {
        let name = self.name.clone();
        let blocks = self.slots(first_slot);
        let out = self.client.load_all(&self.handle, &name, &blocks, None).await?;
        Ok(out.done.loaded_blocks)
    }

    /// Whether slots `first_slot..` hold exactly the stored blocks.
    fn holds(&self, first_slot: u32) -> bool {
        first_wrong_kv(&self.pool, &self.keys, first_slot).is_none()
    }
}

/// The status of a request that must fail because the pool's memory changed.
fn unusable(r: Result<impl std::fmt::Debug, ClientError>, what: &str) {
    match r {
        Err(ClientError::Status(s)) => {
            assert_eq!(s.code(), Code::FailedPrecondition, "{s:?}");
            assert!(
                s.message().contains("no longer usable") && s.message().contains(what),
                "{}",
                s.message()
            );
        }
        other => panic!("expected FAILED_PRECONDITION ({what}), got {other:?}"),
    }
}

#[test]
fn a_client_that_shrinks_or_replaces_its_pool_file_fails_alone() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = ServeProcess::start(dir.path(), &["--host-capacity", "64MiB", "--metrics", "off"]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        // The bystander loads its 128 blocks again and again while the others misbehave.
        let mut bystander = Engine::start(&server.target, dir.path(), "bystander", 256, 128).await;
        let stop = Arc::new(AtomicBool::new(false));
        let stop_loads = Arc::clone(&stop);
        let loads = tokio::spawn(async move {
            let mut verified = 0u32;
            while !stop_loads.load(Ordering::Relaxed) || verified < 3 {
                bystander.pool.fill_slot_layer(128, 0, 0).unwrap();
                assert_eq!(bystander.load(128).await.unwrap(), 128);
                assert!(bystander.holds(128), "load {verified} not bit-exact");
                verified += 1;
            }
            (bystander, verified)
        });

        // 1. Truncated while loads from it are in flight: the loads in flight either finish or
        //    fail as the pool's fault; every request after that fails clearly.
        let mut shrunk = Engine::start(&server.target, dir.path(), "shrinker", 256, 128).await;
        let path = shrunk.pool.path().unwrap().to_owned();
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        let (in_flight, ()) = tokio::join!(shrunk.load(128), async {
            tokio::task::yield_now().await;
            file.set_len(4096).unwrap();
        });
        if let Err(e) = in_flight {
            unusable(Err::<(), _>(e), "");
        }
        // "shrank to 4096" when the size check sees it first, "shrank under the mapping"
        // when a copy in flight caught the bus error first: both name the cause.
        unusable(shrunk.load(128).await, "shrank");
        let name = shrunk.name.clone();
        let run = shrunk.slots(0);
        unusable(
            shrunk.client.store(&shrunk.handle, &name, None, &run[..8]).await,
            "shrank",
        );
        // Its engine can recover: a new pool on a new file serves again.
        let fresh =
            CpuDevicePool::create(Some(&dir.path().join("pool-shrinker-2")), geometry(), 256).unwrap();
        shrunk.client.unregister_pool(&shrunk.handle).await.unwrap();
        let handle = shrunk
            .client
            .register_cpu_pool(&fresh, "fault-test", 0, 1)
            .await
            .unwrap();
        let out = shrunk.client.load_all(&handle, &name, &run, None).await.unwrap();
        assert_eq!(
            out.done.loaded_blocks, 128,
            "what it stored before is still served"
        );

        // 2. Unlinked, then replaced by another file of the same size at the same path.
        let mut moved = Engine::start(&server.target, dir.path(), "replacer", 256, 64).await;
        let path = moved.pool.path().unwrap().to_owned();
        std::fs::remove_file(&path).unwrap();
        unusable(moved.load(128).await, "unlinked");
        let _impostor = CpuDevicePool::create(Some(&path), geometry(), 256).unwrap();
        unusable(moved.load(128).await, "replaced");

        stop.store(true, Ordering::Relaxed);
        let (mut bystander, verified) = loads.await.unwrap();
        assert!(verified >= 3, "{verified}");
        // The sidecar still serves everyone, and knows every session.
        assert_eq!(bystander.client.stats().await.unwrap().sessions, 3);
        drop((shrunk, moved, fresh));
    });
    assert!(server.alive(), "the sidecar died");
    assert!(server.terminate().success());
}

/// A fresh client loads `keys` (stored under `salt`) into slots `0..` of a new pool: the
/// outcome, and the first (slot, layer) that does not hold its block's bytes.
async fn load_back(
    target: &str,
    dir: &Path,
    salt: &str,
    keys: &[BlockKey],
) -> (kvtier_client::LoadOutcome, Option<(u32, u32)>) {
    let mut client = Client::connect(target, "after").await.unwrap();
    let pool = CpuDevicePool::create(Some(&dir.join("pool-after")), geometry(), keys.len() as u32).unwrap();
    let handle = client.register_cpu_pool(&pool, "fault-test", 0, 1).await.unwrap();
    let run: Vec<(BlockKey, u32)> = keys.iter().enumerate().map(|(i, &k)| (k, i as u32)).collect();
    let out = client.load_all(&handle, salt, &run, None).await.unwrap();
    (out, first_wrong_kv(&pool, keys, 0))
}

#[test]
fn a_graceful_stop_right_after_a_store_burst_keeps_every_acknowledged_block() {
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("disk");
    std::fs::create_dir(&disk).unwrap();
    let disk_arg = disk.to_str().unwrap();
    let args = [
        "--host-capacity",
        "160MiB",
        "--metrics",
        "off",
        "--disk-dir",
        disk_arg,
        "--set",
        "write_policy=all",
    ];
    let blocks = 4096;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let server = ServeProcess::start(dir.path(), &args);
    let keys = rt.block_on(async {
        // 4096 blocks (64 MiB) acknowledged in 64 stores; SIGTERM the moment the last returns.
        let e = Engine::start(&server.target, dir.path(), "burst", blocks, blocks as usize).await;
        e.keys.clone()
    });
    let status = server.terminate();
    assert!(status.success(), "{status}");

    let server = ServeProcess::start(dir.path(), &args);
    rt.block_on(async {
        let (out, wrong) = load_back(&server.target, dir.path(), "burst", &keys).await;
        assert_eq!(
            out.done.loaded_blocks,
            blocks,
            "acknowledged blocks lost in the stop (missing: {} bytes of keys)",
            out.done.missing.len()
        );
        assert_eq!(out.done.disk_blocks, blocks, "every block came back from disk");
        assert_eq!(wrong, None, "bit-exact after the restart");
    });
    assert!(server.terminate().success());
}

/// Durable stores (`StoreRequest.durable`) under the default write policy, which would write a
/// plain store's blocks to disk only after two hits: SIGKILL the moment the last reply
/// arrives, restart, and every block those replies called durable loads bit-exact from disk.
#[test]
fn a_sigkill_right_after_durable_stores_loses_none_of_their_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("disk");
    std::fs::create_dir(&disk).unwrap();
    let args = [
        "--host-capacity",
        "64MiB",
        "--metrics",
        "off",
        "--disk-dir",
        disk.to_str().unwrap(),
    ];
    let blocks: u32 = 1024;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut server = ServeProcess::start(dir.path(), &args);
    let keys = rt.block_on(async {
        let mut client = Client::connect(&server.target, "durable").await.unwrap();
        let pool = CpuDevicePool::create(Some(&dir.path().join("pool-durable")), geometry(), blocks).unwrap();
        let handle = client.register_cpu_pool(&pool, "fault-test", 0, 1).await.unwrap();
        let tokens: Vec<u32> = (0..blocks * 16).map(|t| t.wrapping_mul(2_654_435_761)).collect();
        let keys = handle.keys("d", &tokens).unwrap();
        write_kv(&pool, &keys, 0);
        let run: Vec<(BlockKey, u32)> = keys.iter().enumerate().map(|(i, &k)| (k, i as u32)).collect();
        let mut parent = None;
        for chunk in run.chunks(64) {
            let r = client.store_durable(&handle, "d", parent, chunk).await.unwrap();
            assert_eq!(r.durable_blocks, chunk.len() as u32, "{r:?}");
            assert!(r.not_durable.is_empty(), "{r:?}");
            parent = chunk.last().map(|b| b.0);
        }
        keys
    });
    server.child.kill().unwrap(); // SIGKILL, right after the last reply
    server.child.wait().unwrap();
    drop(server);

    let server = ServeProcess::start(dir.path(), &args);
    rt.block_on(async {
        let (out, wrong) = load_back(&server.target, dir.path(), "d", &keys).await;
        assert_eq!(
            (out.done.loaded_blocks, out.done.disk_blocks),
            (blocks, blocks),
            "durable blocks lost to SIGKILL"
        );
        assert_eq!(wrong, None, "bit-exact after the restart");
    });
    assert!(server.terminate().success());
}

/// `kvtier health` reaches a serving sidecar by every Unix form gRPC's naming document
/// defines, and `kvtier serve` ignores `KVTIER_*` variables that name no setting.
#[test]
fn health_accepts_every_unix_target_form_and_unrelated_variables_are_ignored() {
    let dir = tempfile::tempdir().unwrap();
    let sidecar = ServeProcess::start(dir.path(), &[]);
    let abs = sidecar.socket.display().to_string();
    for target in [
        format!("unix://{abs}"),
        format!("unix:{abs}"),
        abs.clone(),
        "unix:kvtier.sock".to_owned(),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvtier"))
            .args(["health", &target])
            .current_dir(dir.path())
            .output()
            .unwrap();
        assert!(
            out.status.success() && String::from_utf8_lossy(&out.stdout).contains("SERVING"),
            "{target}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    drop(sidecar);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(["serve", "--print-config"])
        .env("KVTIER_REPO", "x")
        .env("KVTIER_BUILD_ID", "42")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(["serve", "--print-config"])
        .env("KVTIER_HOST__CAPACTY", "1GiB")
        .output()
        .unwrap();
    assert!(
        !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("capacty"),
        "a misspelt key of a known section is still an error"
    );
}
