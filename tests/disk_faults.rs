//! Real faults against the disk tier, in real processes: a writer killed with SIGKILL in the
//! middle of storing, a file system smaller than the tier's capacity, and one that fills up and
//! is freed again.

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
    kvtier_transfer::test_util::kv(key, 0, geo().bytes_per_block())
}

/// A writer process: stores batch after batch through the real queues with the `all` write
/// policy and prints `KVTIER-STORED b` once batch b is on disk.
fn writer(dir: &Path, batches: usize) {
    let Some(w) = Writer::open(dir) else { return };
    let (mut ok, mut failed, mut first_error) = (0usize, 0usize, String::new());
    for b in 0..batches {
        let (written, errors) = w.store_batch(b);
        ok += written;
        failed += errors.len();
        if first_error.is_empty()
            && let Some(e) = errors.first()
        {
            first_error = e.clone();
        }
        println!("\nKVTIER-STORED {b}");
    }
    let s = w.disk.stats();
    println!(
        "\nKVTIER-DONE ok={ok} failed={failed} no_space={} reclaimed={} entries={} error={first_error}",
        s.dropped_writes_no_space_total, s.reclaimed_regions_total, s.entries
    );
}

/// The tiers and queues of a writer process.
struct Writer {
    disk: DiskTier,
    store: TieredStore,
    cpu: Arc<CpuDevicePool>,
    pool: Arc<dyn DevicePool>,
    queues: TransferQueues,
}

impl Writer {
    fn open(dir: &Path) -> Option<Writer> {
        let host = HostTier::new(
            geo(),
            &HostTierConfig {
                capacity: ByteSize::mib(4),
                ..Default::default()
            },
        )
        .unwrap();
        let disk = match DiskTier::open(geo(), &disk_cfg(dir)) {
            Ok((d, _)) => d,
            Err(e) => {
                println!("\nKVTIER-OPEN-FAILED {e}");
                return None;
            }
        };
        let cpu = Arc::new(CpuDevicePool::create(None, geo(), BATCH as u32).unwrap());
        Some(Writer {
            store: TieredStore::new(host, Some(disk.clone()), WritePolicy::All, 2),
            disk,
            pool: cpu.clone(),
            cpu,
            queues: TransferQueues::new(&TransferConfig::default()).unwrap(),
        })
    }

    /// Stores batch `b` and waits for its disk writes: blocks written, and the errors of those
    /// that were not.
    fn store_batch(&self, b: usize) -> (usize, Vec<String>) {
        let keys = batch_keys(b);
        for (i, &k) in keys.iter().enumerate() {
            self.cpu.write_slot_layer(i as u32, 0, &kv(k)).unwrap();
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
        let (_, persisted) = self
            .queues
            .store
            .submit(&self.pool, &self.store, NS, &blocks)
            .unwrap()
            .wait_persisted()
            .unwrap();
        let errors = persisted.failed.into_iter().map(|(_, e)| e).collect();
        (persisted.written_blocks, errors)
    }
}

/// Fills `dir`'s file system to the last byte with one file.
fn fill(path: &Path) {
    use std::io::Write;
    let mut f = std::fs::File::create(path).unwrap();
    let chunk = vec![0xffu8; 64 << 10];
    let mut left = chunk.as_slice();
    loop {
        match f.write(left) {
            Ok(0) => break,
            Ok(n) if n == left.len() => left = chunk.as_slice(),
            Ok(n) => left = &left[n..],
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
            Err(e) => panic!("filling {}: {e}", path.display()),
        }
    }
}

/// A writer on a file system that another file filled: its writes fail as disk full; once the
/// file is removed they resume, without a restart.
fn refill(dir: &Path) {
    let Some(w) = Writer::open(dir) else { return };
    let filler = dir.join("filler");
    fill(&filler);
    let (mut written, mut errors) = (0, Vec::new());
    for b in 0..4 {
        let (n, e) = w.store_batch(b);
        written += n;
        errors.extend(e);
    }
    println!(
        "\nKVTIER-FULL written={written} failed={} no_space={} error={}",
        errors.len(),
        w.disk.stats().dropped_writes_no_space_total,
        errors.first().cloned().unwrap_or_default()
    );
    std::fs::remove_file(&filler).unwrap();
    // The tier retries on its own a moment later: keep storing until a batch reaches disk.
    let start = std::time::Instant::now();
    let mut b = 4;
    let resumed = loop {
        let (n, _) = w.store_batch(b);
        if n == BATCH {
            break Some(b);
        }
        if start.elapsed() > std::time::Duration::from_secs(20) {
            break None;
        }
        b += 1;
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let Some(resumed) = resumed else {
        println!("\nKVTIER-NEVER-RESUMED");
        return;
    };
    drop(w);
    let (disk, report) = DiskTier::open(geo(), &disk_cfg(dir)).unwrap();
    let loaded = batch_keys(resumed)
        .into_iter()
        .filter(|&k| read_back(&disk, k).is_ok_and(|got| got == kv(k)))
        .count();
    println!(
        "\nKVTIER-RESUMED batch={resumed} loaded={loaded} entries={}",
        report.entries
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
        "refill" => refill(Path::new(&dir)),
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

/// Runs a child with `role` on a fresh 7 MiB file system (three 2 MiB regions fit, the fourth
/// does not) and returns its marker lines.
fn on_small_fs(role: &str) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let mut child = spawn(role, dir.path(), Some(7 << 20));
    // Read to the end, so the child never writes into a closed pipe.
    let lines: Vec<String> = marker_lines(&mut child).collect();
    assert!(child.wait().unwrap().success(), "{lines:?}");
    lines
}

fn find(lines: &[String], prefix: &str) -> String {
    lines
        .iter()
        .find_map(|l| l.strip_prefix(prefix).map(str::to_owned))
        .unwrap_or_else(|| panic!("no {prefix} line in {lines:?}"))
}

fn field<T: std::str::FromStr>(line: &str, name: &str) -> T
where
    T::Err: std::fmt::Debug,
{
    let start = line.find(&format!("{name}=")).unwrap() + name.len() + 1;
    line[start..].split(' ').next().unwrap().parse().unwrap()
}

#[test]
fn a_file_system_smaller_than_the_capacity_is_pressure_and_what_is_kept_loads() {
    // 40 batches of 512 KiB against a 1 GiB capacity on a 7 MiB file system.
    let lines = on_small_fs("full");
    let done = find(&lines, "DONE ");
    let ok: usize = field(&done, "ok");
    let failed: usize = field(&done, "failed");
    let reclaimed: u64 = field(&done, "reclaimed");
    let entries: usize = field(&done, "entries");
    // The full file system made the tier give back its oldest regions instead of failing.
    assert_eq!(ok + failed, 40 * BATCH, "{done}");
    assert!(
        ok > 30 * BATCH,
        "writes went on past the full file system: {done}"
    );
    assert!(reclaimed > 0, "{done}");
    assert!(entries > 0 && entries < ok, "{done}");
    // What the tier kept loads, bit-exact (checked by the child, where the file system is).
    let verified = find(&lines, "VERIFIED ");
    assert_eq!(field::<usize>(&verified, "loaded"), entries, "{verified}");
    assert_eq!(field::<usize>(&verified, "entries"), entries, "{verified}");
}

#[test]
fn a_full_file_system_fails_writes_clearly_and_they_resume_when_space_is_back() {
    let lines = on_small_fs("refill");
    let full = find(&lines, "FULL ");
    // Filled by another file, with nothing of its own to give back: writes fail, counted.
    assert_eq!(field::<usize>(&full, "written"), 0, "{full}");
    assert_eq!(field::<usize>(&full, "failed"), 4 * BATCH, "{full}");
    assert!(field::<u64>(&full, "no_space") >= 4 * BATCH as u64, "{full}");
    assert!(full.contains("disk full"), "clear error: {full}");
    // The file is removed: the same tier, not restarted, writes again, and it sticks.
    assert!(
        !lines.iter().any(|l| l == "NEVER-RESUMED"),
        "writes never resumed: {lines:?}"
    );
    let resumed = find(&lines, "RESUMED ");
    assert_eq!(field::<usize>(&resumed, "loaded"), BATCH, "{resumed}");
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
