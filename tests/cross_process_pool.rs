//! An engine process creates a shared-memory device pool and writes KV into it; this process
//! (in the sidecar's role) opens the pool by path, stores the blocks into its host tier, loads
//! them back into other slots, and the engine process checks the bytes it sees — real shared
//! memory between two real processes, both directions.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;

use kvtier_core::{BlockHasher, BlockKey, ByteSize, Dtype, KvGeometry, Namespace};
use kvtier_store::{HostTier, HostTierConfig, TieredStore};
use kvtier_transfer::{CpuDevicePool, DevicePool, LoadBlock, StoreBlock, TransferConfig, TransferQueues};

const ROLE: &str = "KVTIER_TEST_ENGINE_POOL";
const BLOCKS: u32 = 48;

fn geometry() -> KvGeometry {
    KvGeometry::new(3, 4, 64, Dtype::Bf16, 16).unwrap()
}

fn kv(slot: u32, layer: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32 ^ slot.wrapping_mul(31) ^ layer.wrapping_mul(131)) as u8)
        .collect()
}

/// The engine side, run in a child process: create the pool, write KV into slots 0..BLOCKS,
/// then on `check` verify that slots BLOCKS..2*BLOCKS hold the same bytes.
fn engine(path: &Path) {
    let g = geometry();
    let pool = CpuDevicePool::create(Some(path), g, 2 * BLOCKS).unwrap();
    let bl = g.bytes_per_block_layer();
    for slot in 0..BLOCKS {
        for layer in 0..g.layers() {
            pool.write_slot_layer(slot, layer, &kv(slot, layer, bl)).unwrap();
        }
    }
    let stdout = std::io::stdout();
    // The test harness may print on the same line first: markers are searched, not matched.
    writeln!(stdout.lock(), "\nKVTIER-READY").unwrap();
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "check");
    let mut good = 0;
    let mut buf = vec![0u8; bl];
    for slot in 0..BLOCKS {
        for layer in 0..g.layers() {
            pool.read_slot_layer(BLOCKS + slot, layer, &mut buf).unwrap();
            good += u32::from(buf == kv(slot, layer, bl));
        }
    }
    writeln!(stdout.lock(), "\nKVTIER-OK {good}").unwrap();
}

/// Not a test: the entry point of the engine child process, run by the test below.
#[test]
#[ignore = "entry point of the engine child process, started by the test below"]
fn engine_child() {
    if let Ok(path) = std::env::var(ROLE) {
        engine(&PathBuf::from(path));
    }
}

#[test]
fn a_pool_created_by_another_process_round_trips_bit_exact() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("engine-pool");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "engine_child",
            "--ignored",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(ROLE, &path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    let mut next_marker = |marker: &str| loop {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "engine exited before printing {marker}"
        );
        if let Some(rest) = line.trim().strip_prefix(marker) {
            return rest.trim().to_owned();
        }
    };
    next_marker("KVTIER-READY");

    let g = geometry();
    // Wrong claims about the pool are refused before anything is mapped.
    assert!(
        CpuDevicePool::open(
            &path,
            KvGeometry::new(2, 4, 64, Dtype::Bf16, 16).unwrap(),
            2 * BLOCKS
        )
        .is_err()
    );
    assert!(CpuDevicePool::open(&path, g, BLOCKS).is_err());
    let pool: Arc<dyn DevicePool> = Arc::new(CpuDevicePool::open(&path, g, 2 * BLOCKS).unwrap());
    let host = HostTier::new(
        g,
        &HostTierConfig {
            capacity: ByteSize::mib(16),
            ..HostTierConfig::default()
        },
    )
    .unwrap();
    let store = TieredStore::host_only(host.clone());
    let queues = TransferQueues::new(&TransferConfig::default()).unwrap();
    let ns = Namespace::single("cross-process", g).unwrap().fingerprint();
    let tokens: Vec<u32> = (0..BLOCKS * 16).collect();
    let keys: Vec<BlockKey> = BlockHasher::new(ns, 16).keys(&tokens);
    let stores: Vec<StoreBlock> = keys
        .iter()
        .enumerate()
        .map(|(i, &key)| StoreBlock {
            key,
            parent: i.checked_sub(1).map(|p| keys[p]),
            slot: i as u32,
        })
        .collect();
    let report = queues
        .store
        .submit(&pool, &store, ns, &stores)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(report.stored_blocks, BLOCKS as usize);
    assert_eq!(host.match_prefix(ns, &keys).len(), BLOCKS as usize);
    let loads: Vec<LoadBlock> = keys
        .iter()
        .enumerate()
        .map(|(i, &key)| LoadBlock {
            key,
            slot: BLOCKS + i as u32,
        })
        .collect();
    let report = queues
        .load
        .submit(&pool, &store, ns, &loads)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(report.loaded_blocks, BLOCKS as usize);

    writeln!(child.stdin.as_mut().unwrap(), "check").unwrap();
    let good = next_marker("KVTIER-OK");
    assert_eq!(
        good,
        (BLOCKS * g.layers()).to_string(),
        "the engine sees every loaded block"
    );
    assert!(child.wait().unwrap().success());
    assert!(!path.exists(), "the engine removed its pool file on exit");
    // The sidecar's mapping outlives the file; its pins are all released.
    assert_eq!(host.stats().pinned_pages, 0);
}
