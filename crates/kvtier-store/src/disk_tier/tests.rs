use std::os::unix::fs::FileExt;

use kvtier_core::{BlockHasher, Dtype};

use super::*;
use crate::Prefault;

const NS: NamespaceFingerprint = NamespaceFingerprint(0xd15c);

fn geo() -> KvGeometry {
    // 2 layers × 2 × 16 tokens × 2 heads × 32 dim × 2 bytes = 8 KiB per block: two 4 KiB pages.
    KvGeometry::new(2, 2, 32, Dtype::Bf16, 16).unwrap()
}

const BLOCK: usize = 8192;

fn config(dir: &Path) -> DiskTierConfig {
    DiskTierConfig {
        dir: dir.to_owned(),
        capacity: ByteSize::mib(64),
        // 8 entries of (4 KiB header + 8 KiB page) per region.
        region_size: ByteSize(4096 + 8 * 12288),
        ..Default::default()
    }
}

fn keys(n: usize, seed: u32) -> Vec<BlockKey> {
    let tokens: Vec<u32> = (0..n as u32 * 16).map(|t| t.wrapping_mul(31) ^ seed).collect();
    BlockHasher::new(NS, 16).keys(&tokens)
}

/// A host-like region of `n` pages, page `i` filled with bytes derived from `keys[i]`.
fn pages(keys: &[BlockKey]) -> ShmRegion {
    let r = ShmRegion::create_anonymous("disk-test", keys.len().max(1) * BLOCK, Prefault::Touch).unwrap();
    for (i, k) in keys.iter().enumerate() {
        r.write(i * BLOCK, &bytes_of(*k)).unwrap();
    }
    r
}

fn bytes_of(k: BlockKey) -> Vec<u8> {
    let mut x = k.0 as u64 | 1;
    (0..BLOCK)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn write_all(t: &DiskTier, ks: &[BlockKey]) {
    let src = pages(ks);
    for (i, &k) in ks.iter().enumerate() {
        assert_eq!(t.append(NS, k, &src, i * BLOCK).unwrap(), Appended::Written);
    }
}

/// Reads `k` and checks its bytes; `Err` if the tier refused it.
fn read(t: &DiskTier, k: BlockKey) -> Result<(), StoreError> {
    let dst = ShmRegion::create_anonymous("disk-read", BLOCK, Prefault::Touch).unwrap();
    t.read_into(NS, k, &dst, 0)?;
    let mut got = vec![0u8; BLOCK];
    dst.read(0, &mut got).unwrap();
    assert!(got == bytes_of(k), "block {k} read back different bytes");
    Ok(())
}

fn region_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "kvt"))
        .collect();
    v.sort();
    v
}

#[test]
fn blocks_survive_a_restart_bit_exact() {
    let dir = tempfile::tempdir().unwrap();
    let ks = keys(20, 1);
    {
        let (t, report) = DiskTier::open(geo(), &config(dir.path())).unwrap();
        assert_eq!(report.entries, 0);
        write_all(&t, &ks);
        assert_eq!(
            t.append(NS, ks[0], &pages(&ks[..1]), 0).unwrap(),
            Appended::AlreadyStored
        );
        for &k in &ks {
            read(&t, k).unwrap();
        }
        let s = t.stats();
        assert_eq!(
            (s.entries, s.writes_total, s.reads_total, s.regions),
            (20, 20, 20, 3)
        );
    }
    // Two full regions have index files; the third was indexed at drop.
    let (t, report) = DiskTier::open(geo(), &config(dir.path())).unwrap();
    assert_eq!(
        (report.entries, report.regions, report.regions_from_index),
        (20, 3, 3)
    );
    assert_eq!(report.corrupt + report.torn, 0);
    for &k in &ks {
        read(&t, k).unwrap();
    }
    // New writes go to a new region after a restart.
    write_all(&t, &keys(3, 2));
    assert_eq!(t.stats().regions, 4);
}

#[test]
fn a_region_without_index_is_scanned() {
    let dir = tempfile::tempdir().unwrap();
    let ks = keys(12, 3);
    {
        let (t, _) = DiskTier::open(geo(), &config(dir.path())).unwrap();
        write_all(&t, &ks);
    }
    for f in std::fs::read_dir(dir.path()).unwrap() {
        let p = f.unwrap().path();
        if p.extension().is_some_and(|e| e == "idx") {
            std::fs::remove_file(p).unwrap();
        }
    }
    let (t, report) = DiskTier::open(geo(), &config(dir.path())).unwrap();
    assert_eq!(
        (report.entries, report.regions_scanned, report.regions_from_index),
        (12, 2, 0)
    );
    for &k in &ks {
        read(&t, k).unwrap();
    }
}

#[test]
fn flipped_bytes_make_counted_misses_and_spare_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let ks = keys(16, 4);
    {
        let (t, _) = DiskTier::open(geo(), &config(dir.path())).unwrap();
        write_all(&t, &ks);
    }
    // Damage: a payload byte of slot 1 and a header byte of slot 5 in the first region, and
    // the region header... of nothing else.
    let files = region_files(dir.path());
    let f = OpenOptions::new().read(true).write(true).open(&files[0]).unwrap();
    let stride = 4096 + BLOCK as u64;
    for off in [4096 + stride + 4096 + 100, 4096 + 5 * stride + 40] {
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, off).unwrap();
        f.write_all_at(&[b[0] ^ 0x5a], off).unwrap();
    }
    drop(f);
    let (t, _) = DiskTier::open(geo(), &config(dir.path())).unwrap();
    let mut corrupt = 0;
    for (i, &k) in ks.iter().enumerate() {
        match read(&t, k) {
            Ok(()) => assert!(i != 1 && i != 5, "damaged block {i} was served"),
            Err(StoreError::CorruptBlock { key, .. }) => {
                assert_eq!(key, k);
                corrupt += 1;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(corrupt, 2);
    assert_eq!(t.stats().corrupt_total, 2);
    assert!(
        matches!(read(&t, ks[1]), Err(StoreError::NotFound { tier: "disk", .. })),
        "dropped after"
    );
    assert_eq!(t.stats().entries, 14);

    // The same damage found by a scan at start.
    drop(t);
    for p in std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().path()) {
        if p.extension().is_some_and(|e| e == "idx") {
            std::fs::remove_file(p).unwrap();
        }
    }
    let (_t, report) = DiskTier::open(geo(), &config(dir.path())).unwrap();
    assert_eq!((report.entries, report.corrupt), (14, 2));
}

#[test]
fn a_truncated_region_keeps_what_precedes_the_cut() {
    let dir = tempfile::tempdir().unwrap();
    let ks = keys(8, 5);
    {
        let (t, _) = DiskTier::open(geo(), &config(dir.path())).unwrap();
        write_all(&t, &ks);
    }
    let files = region_files(dir.path());
    let stride = 4096 + BLOCK as u64;
    // Cut in the middle of slot 5.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&files[0])
        .unwrap()
        .set_len(4096 + 5 * stride + 6000)
        .unwrap();
    let (t, report) = DiskTier::open(geo(), &config(dir.path())).unwrap();
    assert_eq!((report.entries, report.torn), (5, 1));
    for (i, &k) in ks.iter().enumerate() {
        assert_eq!(read(&t, k).is_ok(), i < 5, "block {i}");
    }
    // A file cut inside its region header is skipped, not fatal.
    drop(t);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&files[0])
        .unwrap()
        .set_len(100)
        .unwrap();
    let (t, report) = DiskTier::open(geo(), &config(dir.path())).unwrap();
    assert_eq!((report.entries, report.unreadable_regions), (0, 1));
    write_all(&t, &keys(2, 6));
}

/// One flipped byte anywhere in a region's header (magic, version, geometry, slots, stride, id,
/// checksum) costs no entry: every one verifies on its own and is recovered, the header is
/// rewritten, and the next start reads the region normally.
#[test]
fn a_damaged_region_header_loses_no_entry_that_verifies() {
    let dir = tempfile::tempdir().unwrap();
    // 8 entries fill region 1; 3 more start region 2.
    let ks = keys(11, 9);
    {
        let (t, _) = DiskTier::open(geo(), &config(dir.path())).unwrap();
        write_all(&t, &ks);
    }
    let first = region_files(dir.path())[0].clone();
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&first)
        .unwrap();
    for at in [0usize, 9, 17, 29, 37, 44, 50, 60] {
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, at as u64).unwrap();
        f.write_all_at(&[b[0] ^ 0x5a], at as u64).unwrap();
        let (t, report) = DiskTier::open(geo(), &config(dir.path())).unwrap();
        assert_eq!(
            (
                report.entries,
                report.regions_salvaged,
                report.unreadable_regions,
                report.corrupt
            ),
            (11, 1, 0, 0),
            "byte {at} flipped: {report:?}"
        );
        for &k in &ks {
            read(&t, k).unwrap_or_else(|e| panic!("byte {at} flipped: {k}: {e}"));
        }
        drop(t);
        let (_t, report) = DiskTier::open(geo(), &config(dir.path())).unwrap();
        assert_eq!(
            (report.entries, report.regions_salvaged),
            (11, 0),
            "after repair of byte {at}"
        );
    }
    // A damaged header and damaged entries: the entries that still verify come back, the
    // others are counted corrupt.
    let stride = 4096 + BLOCK as u64;
    f.write_all_at(&[0xff; 4], 3).unwrap();
    f.write_all_at(&[0xff; 4], 4096 + 2 * stride + 40).unwrap();
    f.write_all_at(&[0xff; 4], 4096 + 6 * stride + 9000).unwrap();
    let (t, report) = DiskTier::open(geo(), &config(dir.path())).unwrap();
    assert_eq!(
        (report.entries, report.regions_salvaged, report.corrupt),
        (9, 1, 2),
        "{report:?}"
    );
    for (i, &k) in ks.iter().enumerate() {
        assert_eq!(read(&t, k).is_ok(), i != 2 && i != 6, "block {i}");
    }
}

#[test]
fn bad_directories_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope");
    let e = DiskTier::open(geo(), &config(&missing)).unwrap_err();
    assert!(
        matches!(e, StoreError::DiskDir { .. }) && e.to_string().contains("does not exist"),
        "{e}"
    );
    let (_t, _) = DiskTier::open(
        geo(),
        &DiskTierConfig {
            create_dir: true,
            ..config(&missing)
        },
    )
    .unwrap();
    let file = dir.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    let e = DiskTier::open(geo(), &config(&file)).unwrap_err();
    assert!(e.to_string().contains("not a directory"), "{e}");
    // A directory nobody may create files in (even root): procfs.
    let e = DiskTier::open(geo(), &config(Path::new("/proc/self"))).unwrap_err();
    assert!(matches!(e, StoreError::DiskDir { .. }), "{e}");
    assert!(e.to_string().contains("LOCK"), "{e}");
}

#[test]
fn a_second_opener_is_refused_until_the_first_closes() {
    let dir = tempfile::tempdir().unwrap();
    let (t, _) = DiskTier::open(geo(), &config(dir.path())).unwrap();
    let e = DiskTier::open(geo(), &config(dir.path())).unwrap_err();
    assert!(matches!(e, StoreError::DirLocked { .. }), "{e}");
    assert!(
        e.to_string().contains(&format!("pid {}", std::process::id())),
        "{e}"
    );
    drop(t);
    DiskTier::open(geo(), &config(dir.path())).unwrap();
}

#[test]
fn another_geometry_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (t, _) = DiskTier::open(geo(), &config(dir.path())).unwrap();
        write_all(&t, &keys(1, 7));
    }
    let other = KvGeometry::new(2, 2, 32, Dtype::F16, 16).unwrap();
    let e = DiskTier::open(other, &config(dir.path())).unwrap_err();
    assert!(matches!(e, StoreError::DiskGeometryMismatch { .. }), "{e}");
}

#[test]
fn regions_are_reclaimed_oldest_first() {
    let dir = tempfile::tempdir().unwrap();
    let region = 4096 + 8 * 12288;
    let cfg = DiskTierConfig {
        capacity: ByteSize(3 * region),
        ..config(dir.path())
    };
    let (t, _) = DiskTier::open(geo(), &cfg).unwrap();
    let ks = keys(40, 8);
    write_all(&t, &ks);
    let s = t.stats();
    assert_eq!(s.regions, 3);
    assert!(region_files(dir.path()).len() <= 3);
    assert_eq!(s.reclaimed_regions_total, 2);
    // 40 blocks in regions of 8: the first 16 went with the two oldest regions.
    for (i, &k) in ks.iter().enumerate() {
        assert_eq!(t.contains(NS, k), i >= 16, "block {i}");
    }
    assert_eq!(s.entries, 24);
    read(&t, ks[39]).unwrap();
}

#[test]
fn a_cleared_namespace_stays_cleared_after_restart() {
    let dir = tempfile::tempdir().unwrap();
    let ks = keys(6, 9);
    {
        let (t, _) = DiskTier::open(geo(), &config(dir.path())).unwrap();
        write_all(&t, &ks);
        assert_eq!(t.clear(Some(NS)).unwrap(), 6);
        assert!(!t.contains(NS, ks[0]));
        // Written after the clear: kept.
        write_all(&t, &keys(2, 10));
    }
    let (t, report) = DiskTier::open(geo(), &config(dir.path())).unwrap();
    assert_eq!(report.entries, 2);
    assert!(!t.contains(NS, ks[0]));
    assert!(t.contains(NS, keys(2, 10)[1]));
    assert_eq!(t.clear(None).unwrap(), 2);
    assert!(region_files(dir.path()).is_empty());
}

#[test]
fn entries_of_another_format_version_are_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let ks = keys(3, 11);
    {
        let (t, _) = DiskTier::open(geo(), &config(dir.path())).unwrap();
        write_all(&t, &ks);
    }
    let files = region_files(dir.path());
    std::fs::remove_file(files[0].with_extension("idx")).unwrap();
    // Rewrite slot 2's header as version 2 with a valid checksum.
    let f = OpenOptions::new().read(true).write(true).open(&files[0]).unwrap();
    let off = 4096 + 2 * (4096 + BLOCK as u64);
    let mut h = vec![0u8; 80];
    f.read_exact_at(&mut h, off).unwrap();
    h[8..12].copy_from_slice(&2u32.to_le_bytes());
    let sum = kvtier_core::xxh3_64(&h[..72]);
    h[72..80].copy_from_slice(&sum.to_le_bytes());
    f.write_all_at(&h, off).unwrap();
    let (t, report) = DiskTier::open(geo(), &config(dir.path())).unwrap();
    assert_eq!(
        (report.entries, report.skipped_other_version, report.corrupt),
        (2, 1, 0)
    );
    assert!(!t.contains(NS, ks[2]));
}

#[test]
fn capacity_below_one_region_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let e = DiskTier::open(
        geo(),
        &DiskTierConfig {
            capacity: ByteSize(1000),
            ..config(dir.path())
        },
    )
    .unwrap_err();
    assert!(matches!(e, StoreError::CapacityTooSmall { .. }), "{e}");
}

#[test]
fn unsynced_blocks_are_counted_until_a_sync_or_flush() {
    let dir = tempfile::tempdir().unwrap();
    // No periodic pass: only sync and flush clear the count.
    let (t, _) = DiskTier::open(
        geo(),
        &DiskTierConfig {
            fsync_interval_ms: 0,
            ..config(dir.path())
        },
    )
    .unwrap();
    // 11 blocks over two regions of 8.
    let ks = keys(11, 77);
    write_all(&t, &ks);
    assert_eq!(t.stats().unsynced_blocks, 11);
    t.sync().unwrap();
    assert_eq!(t.stats().unsynced_blocks, 0);
    t.sync().unwrap();
    assert_eq!(t.stats().unsynced_blocks, 0, "nothing dirty: a no-op");
    let more = keys(3, 78);
    write_all(&t, &more);
    assert_eq!(t.stats().unsynced_blocks, 3);
    t.flush().unwrap();
    assert_eq!(t.stats().unsynced_blocks, 0);
}

/// With a disk tier: a host eviction of a block the disk holds is not a removal; a reclaimed
/// region's blocks that the host does not hold are.
#[test]
fn only_blocks_that_leave_both_tiers_are_removals() {
    use crate::{EvictionKind, HostTier, HostTierConfig, Removed, Reservation, TieredStore, WritePolicy};
    let dir = tempfile::tempdir().unwrap();
    let region = 4096 + 8 * 12288;
    let cfg = DiskTierConfig {
        capacity: ByteSize(2 * region),
        ..config(dir.path())
    };
    let (disk, _) = DiskTier::open(geo(), &cfg).unwrap();
    let host = HostTier::new(
        geo(),
        &HostTierConfig {
            capacity: ByteSize(2 * BLOCK as u64),
            eviction: EvictionKind::Lru,
            ..Default::default()
        },
    )
    .unwrap();
    let store = TieredStore::new(host.clone(), Some(disk.clone()), WritePolicy::All, 1);
    let mut rx = store.removals().subscribe();
    let ks = keys(20, 77);
    // ks[0] and ks[2] go to the disk; ks[1] does not. The host then evicts ks[0] and ks[1]
    // and keeps ks[2] and ks[3].
    write_all(&disk, &[ks[0], ks[2]]);
    for &k in &ks[..4] {
        let Reservation::Writer(w) = host.reserve(NS, k, None).unwrap() else {
            panic!("fresh key");
        };
        w.commit();
    }
    let heard: Vec<Removed> = std::iter::from_fn(|| rx.try_recv().ok()).collect();
    assert_eq!(heard, vec![Removed::Block(NS, ks[1])], "ks[0] is still on disk");
    // 16 more blocks on disk: two regions of 8 each, so the oldest (ks[0], ks[2] and 6
    // others) goes. ks[2] is still in the host: not removed.
    write_all(&disk, &ks[4..20]);
    let heard: Vec<Removed> = std::iter::from_fn(|| rx.try_recv().ok()).collect();
    assert!(heard.contains(&Removed::Block(NS, ks[0])), "{heard:?}");
    assert!(heard.contains(&Removed::Block(NS, ks[4])), "{heard:?}");
    assert!(
        !heard.contains(&Removed::Block(NS, ks[2])),
        "ks[2] is in the host: {heard:?}"
    );
    // Clearing everything says so once; it does not name each disk block.
    store.clear(None).unwrap();
    let heard: Vec<Removed> = std::iter::from_fn(|| rx.try_recv().ok()).collect();
    assert_eq!(heard, vec![Removed::Cleared]);
    // Tier by tier: each clear says Cleared once if it removed anything; a tier the store
    // lacks (remote) and one holding nothing clear nothing and say nothing.
    use crate::ClearedBlocks;
    use kvtier_core::Tier;
    write_all(&disk, &ks[..3]);
    for &k in &ks[..2] {
        let Reservation::Writer(w) = host.reserve(NS, k, None).unwrap() else {
            panic!("cleared key");
        };
        w.commit();
    }
    let mut clear = |tiers: &[Tier]| {
        let c = store.clear_tiers(Some(NS), tiers).unwrap();
        (c, std::iter::from_fn(|| rx.try_recv().ok()).collect::<Vec<_>>())
    };
    let none = ClearedBlocks::default();
    assert_eq!(clear(&[Tier::Remote, Tier::Device]), (none, vec![]));
    let host_only = ClearedBlocks {
        host_blocks: 2,
        ..none
    };
    assert_eq!(clear(&[Tier::Host]), (host_only, vec![Removed::Cleared]));
    assert_eq!(clear(&[Tier::Host]), (none, vec![]));
    let disk_only = ClearedBlocks {
        disk_blocks: 3,
        ..none
    };
    assert_eq!(
        clear(&[Tier::Disk, Tier::Remote]),
        (disk_only, vec![Removed::Cleared])
    );
}
