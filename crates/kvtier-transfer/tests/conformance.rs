//! The tier contract over every tier configuration kvtier ships, and proof that each check
//! catches the fault it is about.

use kvtier_core::{BlockKey, NamespaceFingerprint};
use kvtier_store::test_cluster::TestCluster;
use kvtier_store::{EvictionKind, PinnedPage, TieredStore, WritePolicy};
use kvtier_transfer::conformance::{self, HostOnly, HostOverDisk, HostOverRemote, TierSubject};

/// A disk subject in a fresh directory that lives as long as the subject.
#[derive(Debug)]
struct Disk {
    subject: HostOverDisk,
    _dir: tempfile::TempDir,
}

fn disk(policy: WritePolicy) -> Disk {
    let dir = tempfile::tempdir().unwrap();
    Disk {
        subject: HostOverDisk {
            dir: dir.path().to_owned(),
            policy,
        },
        _dir: dir,
    }
}

impl TierSubject for Disk {
    fn open(&self) -> TieredStore {
        self.subject.open()
    }
    fn persistent(&self) -> bool {
        self.subject.persistent()
    }
    fn damage_at_rest(&self) -> bool {
        self.subject.damage_at_rest()
    }
}

fn assert_conforms<S: TierSubject>(make: impl Fn() -> S) {
    let failed = conformance::run_all(make);
    assert!(failed.is_empty(), "{failed:#?}");
}

#[test]
fn host_s3fifo_conforms() {
    assert_conforms(|| HostOnly {
        eviction: EvictionKind::S3fifo,
    });
}

#[test]
fn host_lru_conforms() {
    assert_conforms(|| HostOnly {
        eviction: EvictionKind::Lru,
    });
}

#[test]
fn host_over_disk_write_through_conforms() {
    assert_conforms(|| disk(WritePolicy::WriteThrough));
}

#[test]
fn host_over_disk_all_conforms() {
    assert_conforms(|| disk(WritePolicy::All));
}

/// The remote tier on a real cluster (scripts/redis_cluster.sh), under both write policies;
/// each check's subject has a key prefix of its own, so it starts empty.
#[test]
fn host_over_remote_conforms() {
    let cluster = TestCluster::start(&[]);
    let n = std::sync::atomic::AtomicU32::new(0);
    for policy in [WritePolicy::All, WritePolicy::WriteThrough] {
        assert_conforms(|| HostOverRemote {
            nodes: cluster.nodes().to_vec(),
            key_prefix: format!(
                "conformance-{}-{}",
                std::process::id(),
                n.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            ),
            policy,
        });
    }
}

/// A subject that breaks one rule of the contract.
#[derive(Debug)]
enum Fault {
    /// Damages a stored byte in host memory.
    FlipsAByte(HostOnly),
    /// Acknowledges disk writes whose commit never reached the file (what a reopen finds).
    SkipsACommit(Disk),
    /// Drops the pins it was asked to hold.
    ForgetsAPin(HostOnly),
}

impl TierSubject for Fault {
    fn open(&self) -> TieredStore {
        match self {
            Fault::FlipsAByte(s) | Fault::ForgetsAPin(s) => s.open(),
            Fault::SkipsACommit(d) => {
                for f in d.subject.region_files() {
                    std::fs::OpenOptions::new()
                        .write(true)
                        .open(&f)
                        .and_then(|f| f.set_len(4096))
                        .unwrap();
                }
                d.open()
            }
        }
    }
    fn persistent(&self) -> bool {
        matches!(self, Fault::SkipsACommit(_))
    }
    fn damage_at_rest(&self) -> bool {
        match self {
            Fault::SkipsACommit(d) => d.damage_at_rest(),
            _ => false,
        }
    }
    fn hold(&self, pins: Vec<PinnedPage>) -> Vec<PinnedPage> {
        match self {
            Fault::ForgetsAPin(_) => Vec::new(),
            _ => pins,
        }
    }
    fn after_store(&self, store: &TieredStore, ns: NamespaceFingerprint, keys: &[BlockKey]) {
        if let Fault::FlipsAByte(_) = self {
            let pin = store.host().pin(ns, keys[0]).unwrap();
            let (offset, _) = pin.layer_range(1).unwrap();
            let mut b = [0u8; 1];
            pin.region().read(offset + 77, &mut b).unwrap();
            pin.region().write(offset + 77, &[b[0] ^ 1]).unwrap();
        }
    }
}

fn fails(check: &str, subject: &Fault) -> String {
    let (_, f) = conformance::CHECKS.iter().find(|(n, _)| *n == check).unwrap();
    f(subject).expect_err(&format!("{check} did not catch {subject:?}"))
}

#[test]
fn each_check_catches_the_fault_it_is_about() {
    let host = || HostOnly {
        eviction: EvictionKind::S3fifo,
    };
    let e = fails("read_back_bit_exact", &Fault::FlipsAByte(host()));
    assert!(e.contains("differs"), "{e}");
    let e = fails(
        "reopen_keeps_acknowledged",
        &Fault::SkipsACommit(disk(WritePolicy::All)),
    );
    assert!(e.contains("after a reopen"), "{e}");
    let e = fails("pinned_is_never_evicted", &Fault::ForgetsAPin(host()));
    assert!(e.contains("evicted"), "{e}");
}

/// The device pool contract on the shared-memory pool, in each engine's layout.
#[test]
fn the_cpu_pool_keeps_the_pool_contract_in_every_layout() {
    use kvtier_core::{LayoutKind, PoolLayout};
    use kvtier_transfer::CpuDevicePool;
    use kvtier_transfer::pool_conformance::run_pool_checks;
    let g = conformance::geometry();
    for kind in LayoutKind::ALL {
        let pool = CpuDevicePool::create_with_layout(
            None,
            g,
            24,
            PoolLayout::of_kind(kind, &g, 24, 0),
            PoolLayout::kind_bytes(&g, 24, 0) as usize,
        )
        .unwrap();
        let failed = run_pool_checks(&pool);
        assert!(failed.is_empty(), "{kind}: {failed:?}");
    }
}

/// The device pool contract on the process-memory pool (this test process's own memory, reached
/// through process_vm_readv/writev as the sidecar reaches an engine's), in each engine's layout.
#[test]
fn the_process_pool_keeps_the_pool_contract_in_every_layout() {
    use kvtier_core::{LayoutKind, PoolLayout};
    use kvtier_store::{Prefault, ShmRegion};
    use kvtier_transfer::pool_conformance::run_pool_checks;
    use kvtier_transfer::{ProcessBuffer, ProcessDevicePool};
    let g = conformance::geometry();
    for kind in LayoutKind::ALL {
        let bytes = PoolLayout::kind_bytes(&g, 24, 0) as usize;
        let memory = ShmRegion::create_private("engine", bytes, Prefault::Populate).unwrap();
        let buffers = vec![ProcessBuffer {
            address: memory.dma_address(0, bytes).unwrap() as u64,
            bytes: bytes as u64,
        }];
        let pool = ProcessDevicePool::open(
            std::process::id(),
            buffers,
            g,
            24,
            Some(PoolLayout::of_kind(kind, &g, 24, 0)),
        )
        .unwrap();
        let failed = run_pool_checks(&pool);
        assert!(failed.is_empty(), "{kind}: {failed:?}");
    }
}
