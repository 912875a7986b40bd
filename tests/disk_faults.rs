//! Real faults against the disk tier, in real processes: a writer killed with SIGKILL in the
//! middle of storing, and a file system that runs out of room.

use std::ffi::CString;
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;

use kvtier_core::{BlockHasher, BlockKey, ByteSize, Dtype, KvGeometry, NamespaceFingerprint};
use kvtier_store::{
    DiskTier, DiskTierConfig, HostTier, HostTierConfig, Prefault, ShmRegion, StoreError, TieredStore,
    WritePolicy,
};
use kvtier_transfer::{CpuDevicePool, DevicePool, StoreBlock, TransferConfig, TransferQueues};

const ROLE: &str = "KVTIER_TEST_DISK_ROLE";
const DIR: &str = "KVTIER_TEST_DISK_DIR";
const NS: NamespaceFingerprint = NamespaceFingerprint(0xfa17);
const BATCH: usize = 64;

fn geo() -> KvGeometry {
    // 1 layer × 2 × 16 tokens × 2 heads × 64 dims × 2 bytes = 8 KiB per block.
    KvGeometry::new(1, 2, 64, Dtype::Bf16, 16).unwrap()
}

fn disk_cfg(dir: &Path) -> DiskTierConfig {
    DiskTierConfig {
        dir: dir.to_owned(),
        capacity: ByteSize::gib(1),
        region_size: ByteSize::mib(2),
        ..Default::default()
    }
}

/// The keys of batch `b`: one 64-block sequence per batch.
fn batch_keys(b: usize) -> Vec<BlockKey> {
    let tokens: Vec<u32> = (0..(BATCH * 16) as u32).map(|t| t ^ ((b as u32) << 16)).collect();
    BlockHasher::new(NS, 16).keys(&tokens)
}

fn kv(key: BlockKey) -> Vec<u8> {
    let mut x = key.0 as u64 | 1;
    (0..geo().bytes_per_block())
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A writer process: stores batch after batch through the real queues with the `all` write
/// policy and prints `KVTIER-STORED b` once batch b is on disk.
fn writer(dir: &Path, batches: usize) {
    let host = HostTier::new(
        geo(),
        &HostTierConfig {
            capacity: ByteSize::mib(4),
            ..Default::default()
        },
    )
    .unwrap();
    let disk = DiskTier::open(geo(), &disk_cfg(dir)).map(|(d, _)| d);
    let disk = match disk {
        Ok(d) => d,
        Err(e) => {
            println!("\nKVTIER-OPEN-FAILED {e}");
            return;
        }
    };
    let store = TieredStore::new(host, Some(disk.clone()), WritePolicy::All, 2);
    let cpu = Arc::new(CpuDevicePool::create(None, geo(), BATCH as u32).unwrap());
    let pool: Arc<dyn DevicePool> = cpu.clone();
    let queues = TransferQueues::new(&TransferConfig::default()).unwrap();
    let (mut ok, mut failed, mut first_error) = (0usize, 0usize, String::new());
    for b in 0..batches {
        let keys = batch_keys(b);
        for (i, &k) in keys.iter().enumerate() {
            cpu.write_slot_layer(i as u32, 0, &kv(k)).unwrap();
        }
        let blocks: Vec<StoreBlock> = keys
            .iter()
            .enumerate()
            .map(|(i, &key)| StoreBlock {
                key,
                parent: i.checked_sub(1).map(|p| keys[p]),
                slot: i as u32,
            })
            .collect();
        let (_, persisted) = queues
            .store
            .submit(&pool, &store, NS, &blocks)
            .unwrap()
            .wait_persisted()
            .unwrap();
        ok += persisted.written_blocks;
        failed += persisted.failed.len();
        if first_error.is_empty()
            && let Some((_, e)) = persisted.failed.first()
        {
            first_error = e.clone();
        }
        println!("\nKVTIER-STORED {b}");
    }
    let s = disk.stats();
    println!(
        "\nKVTIER-DONE ok={ok} failed={failed} no_space={} error={first_error}",
        s.dropped_writes_no_space_total
    );
}

/// Not a test: the entry point of the writer processes the tests below start.
#[test]
#[ignore = "entry point of the writer child processes, started by the tests below"]
fn disk_child() {
    let (Ok(role), Ok(dir)) = (std::env::var(ROLE), std::env::var(DIR)) else {
        return;
    };
    match role.as_str() {
        "forever" => writer(Path::new(&dir), usize::MAX),
        "full" => {
            writer(Path::new(&dir), 40);
            // The small file system lives in this process's mount namespace: check what was
            // written from here, through a fresh open.
            let (disk, report) = DiskTier::open(geo(), &disk_cfg(Path::new(&dir))).unwrap();
            let mut loaded = 0;
            for b in 0..40 {
                for k in batch_keys(b) {
                    if let Ok(got) = read_back(&disk, k) {
                        assert!(got == kv(k), "batch {b} block {k} differs");
                        loaded += 1;
                    }
                }
            }
            println!(
                "\nKVTIER-VERIFIED loaded={loaded} entries={} direct_io={}",
                report.entries,
                disk.direct_io()
            );
        }
        "readonly" => match DiskTier::open(geo(), &disk_cfg(Path::new(&dir))) {
            Ok(_) => println!("\nKVTIER-OPENED"),
            Err(e) => println!("\nKVTIER-REFUSED {e}"),
        },
        _ => panic!("unknown role {role}"),
    }
}

/// Starts a writer child. With `tmpfs_bytes`, the child first gets a private mount namespace
/// (a user namespace too when not root) with a tmpfs of that size mounted on `dir`: a real,
/// small, full-able file system that nothing outside the child sees.
fn spawn(role: &str, dir: &Path, tmpfs_bytes: Option<u64>) -> std::process::Child {
    spawn_with(role, dir, tmpfs_bytes, 0)
}

/// As [`spawn`], mounting the tmpfs with `mount_flags` (e.g. `MS_RDONLY`).
fn spawn_with(
    role: &str,
    dir: &Path,
    tmpfs_bytes: Option<u64>,
    mount_flags: libc::c_ulong,
) -> std::process::Child {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "disk_child",
        "--ignored",
        "--nocapture",
        "--test-threads",
        "1",
    ])
    .env(ROLE, role)
    .env(DIR, dir)
    .stdout(Stdio::piped());
    if let Some(bytes) = tmpfs_bytes {
        let c = |s: String| CString::new(s).unwrap();
        // Prepared before fork: only async-signal-safe calls may run between fork and exec.
        // SAFETY: getuid/getgid have no preconditions.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        let uid_map = c(format!("0 {uid} 1"));
        let gid_map = c(format!("0 {gid} 1"));
        let target = c(dir.display().to_string());
        let options = c(format!("size={bytes}"));
        let (tmpfs, root) = (c("tmpfs".into()), c("/".into()));
        let paths = [
            c("/proc/self/setgroups".into()),
            c("/proc/self/uid_map".into()),
            c("/proc/self/gid_map".into()),
        ];
        let deny = c("deny".into());
        // SAFETY: the closure only makes raw system calls on the prepared strings.
        unsafe {
            cmd.pre_exec(move || {
                let write = |path: &CString, text: &CString| {
                    let fd = libc::open(path.as_ptr(), libc::O_WRONLY);
                    if fd >= 0 {
                        libc::write(fd, text.as_ptr().cast(), text.as_bytes().len());
                        libc::close(fd);
                    }
                };
                if libc::unshare(libc::CLONE_NEWNS) != 0 {
                    if libc::unshare(libc::CLONE_NEWUSER | libc::CLONE_NEWNS) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    write(&paths[0], &deny);
                    write(&paths[1], &uid_map);
                    write(&paths[2], &gid_map);
                }
                let none = std::ptr::null();
                if libc::mount(
                    none,
                    root.as_ptr(),
                    none,
                    libc::MS_REC | libc::MS_PRIVATE,
                    std::ptr::null(),
                ) != 0
                    || libc::mount(
                        tmpfs.as_ptr(),
                        target.as_ptr(),
                        tmpfs.as_ptr(),
                        mount_flags,
                        options.as_ptr().cast(),
                    ) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    cmd.spawn().unwrap()
}

fn marker_lines(child: &mut std::process::Child) -> impl Iterator<Item = String> + use<> {
    BufReader::new(child.stdout.take().unwrap())
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| l.trim().strip_prefix("KVTIER-").map(str::to_owned))
}

fn read_back(disk: &DiskTier, key: BlockKey) -> Result<Vec<u8>, StoreError> {
    let page = ShmRegion::create_anonymous(
        "read",
        geo().bytes_per_block().next_multiple_of(4096),
        Prefault::Lazy,
    )?;
    disk.read_into(NS, key, &page, 0)?;
    let mut out = vec![0u8; geo().bytes_per_block()];
    page.read(0, &mut out)?;
    Ok(out)
}

#[test]
fn a_writer_killed_mid_store_loses_nothing_it_reported_and_serves_nothing_partial() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = spawn("forever", dir.path(), None);
    let mut last = None;
    for line in marker_lines(&mut child) {
        if let Some(b) = line.strip_prefix("STORED ") {
            last = Some(b.parse::<usize>().unwrap());
            // Thousands of blocks completed, then kill in the middle of the next ones.
            if last == Some(40) {
                child.kill().unwrap(); // SIGKILL
                break;
            }
        }
    }
    child.wait().unwrap();
    let last = last.expect("the writer reported progress");
    let (disk, report) = DiskTier::open(geo(), &disk_cfg(dir.path())).unwrap();
    // Every block of every reported batch is there and bit-exact.
    for b in 0..=last {
        for k in batch_keys(b) {
            let got = read_back(&disk, k).unwrap_or_else(|e| panic!("batch {b} block {k}: {e}"));
            assert!(got == kv(k), "batch {b} block {k} differs");
        }
    }
    // Later blocks may or may not have made it; whatever is served is whole.
    let mut extra = 0;
    for b in last + 1..last + 4 {
        for k in batch_keys(b) {
            if let Ok(got) = read_back(&disk, k) {
                assert!(got == kv(k), "a partial block was served");
                extra += 1;
            }
        }
    }
    assert!(report.entries as usize >= (last + 1) * BATCH);
    assert_eq!(report.entries as usize, (last + 1) * BATCH + extra);
    // And the tier keeps accepting stores.
    let src = ShmRegion::create_anonymous("src", 8192, Prefault::Lazy).unwrap();
    let k = batch_keys(10_000)[0];
    src.write(0, &kv(k)).unwrap();
    disk.append(NS, k, &src, 0).unwrap();
    assert_eq!(read_back(&disk, k).unwrap(), kv(k));
}

#[test]
fn a_full_file_system_fails_stores_clearly_and_loads_keep_working() {
    let dir = tempfile::tempdir().unwrap();
    // A 7 MiB file system: three 2 MiB regions fit, the fourth cannot be allocated.
    let mut child = spawn("full", dir.path(), Some(7 << 20));
    // Read to the end, so the child never writes into a closed pipe.
    let lines: Vec<String> = marker_lines(&mut child).collect();
    assert!(child.wait().unwrap().success(), "{lines:?}");
    let find = |prefix: &str| {
        lines
            .iter()
            .find_map(|l| l.strip_prefix(prefix).map(str::to_owned))
            .unwrap_or_else(|| panic!("no {prefix} line in {lines:?}"))
    };
    let field = |line: &str, name: &str| -> String {
        let start = line.find(&format!("{name}=")).unwrap() + name.len() + 1;
        line[start..].split(' ').next().unwrap().to_owned()
    };
    let done = find("DONE ");
    let ok: usize = field(&done, "ok").parse().unwrap();
    let failed: usize = field(&done, "failed").parse().unwrap();
    let no_space: u64 = field(&done, "no_space").parse().unwrap();
    assert!(ok > 0 && failed > 0, "{done}");
    assert_eq!(ok + failed, 40 * BATCH, "{done}");
    assert!(no_space > 0, "{done}");
    assert!(done.contains("disk full"), "clear error: {done}");
    // What was written loads, bit-exact (checked by the child, where the file system is).
    let verified = find("VERIFIED ");
    assert_eq!(field(&verified, "loaded"), ok.to_string(), "{verified}");
    assert_eq!(field(&verified, "entries"), ok.to_string(), "{verified}");
}

#[test]
fn a_read_only_directory_is_a_clear_error_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = spawn_with("readonly", dir.path(), Some(1 << 20), libc::MS_RDONLY);
    let lines: Vec<String> = marker_lines(&mut child).collect();
    assert!(child.wait().unwrap().success(), "{lines:?}");
    let refused = lines
        .iter()
        .find_map(|l| l.strip_prefix("REFUSED "))
        .unwrap_or_else(|| panic!("the tier opened on a read-only file system: {lines:?}"));
    assert!(
        refused.contains("disk tier directory") && refused.contains("Read-only file system"),
        "{refused}"
    );
}
