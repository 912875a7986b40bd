//! Blocks moving between host memory and disk through the queues: persistence under the write
//! policy, promotion from disk on load, demotion, corrupt blocks, restarts.

mod common;

use std::path::Path;
use std::sync::Arc;

use common::*;
use kvtier_core::{ByteSize, Dtype, KvGeometry, Tier};
use kvtier_store::{DiskTierConfig, TieredStore, WritePolicy};
use kvtier_transfer::{LoadEvent, TransferConfig};

fn geo() -> KvGeometry {
    // 2 layers of 2 × 16 tokens × 2 heads × 64 dims × 2 bytes = 8 KiB per block-layer.
    KvGeometry::new(2, 2, 64, Dtype::Bf16, 16).unwrap()
}

fn disk_cfg(dir: &Path) -> DiskTierConfig {
    DiskTierConfig {
        dir: dir.to_owned(),
        capacity: ByteSize::mib(256),
        region_size: ByteSize::mib(4),
        ..Default::default()
    }
}

fn disk_rig(dir: &Path, host_blocks: u64, policy: WritePolicy) -> Rig {
    rig_with_disk(
        geo(),
        host_blocks,
        128,
        TransferConfig::default(),
        Some((disk_cfg(dir), policy)),
    )
}

#[test]
fn stored_blocks_persist_and_load_back_from_disk_bit_exact() {
    let dir = tempfile::tempdir().unwrap();
    let r = disk_rig(dir.path(), 64, WritePolicy::All);
    let ks = keys(24, 1, 16);
    r.write_slots(&ks, 0);
    let (copied, persisted) = r
        .queues
        .store
        .submit(&r.dyn_pool, &r.store, NS, &chain_blocks(&ks, 0))
        .unwrap()
        .wait_persisted()
        .unwrap();
    assert_eq!((copied.stored_blocks, persisted.written_blocks), (24, 24));
    assert!(persisted.failed.is_empty());
    let t = persisted.timing.unwrap();
    assert!(
        t.first_copy_start.unwrap() <= copied.timing.last_copy_end.unwrap(),
        "one timing spans both phases"
    );
    // Host cold: everything must come from disk.
    assert_eq!(r.host.clear(None), (24, 0));
    let m = r.queues.match_prefix(&r.store, NS, &ks);
    assert_eq!((m.host_blocks(), m.disk_blocks()), (0, 24));
    r.scrub(32, 24);
    let report = r
        .queues
        .load
        .submit(&r.dyn_pool, &r.store, NS, &Rig::load_blocks(&ks, 32))
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(
        (report.loaded_blocks, report.disk_blocks, report.missing.len()),
        (24, 24, 0)
    );
    r.assert_slots(&ks, 32);
    // Promoted: the host tier has them again, unpinned.
    assert_eq!(r.store.match_prefix(NS, &ks).host_blocks(), 24);
    assert_eq!(r.host.stats().pinned_pages, 0);
    let routes = r.queues.routes();
    assert_eq!(routes.disk_to_host.blocks_total, 24);
    assert_eq!(routes.host_to_disk.blocks_total, 24);
    assert_eq!(routes.host_to_device.blocks_total, 24);
    assert_eq!(routes.device_to_host.blocks_total, 24);
    assert_eq!(
        routes.disk_to_host.bytes_total,
        24 * geo().bytes_per_block() as u64
    );
}

#[test]
fn a_durable_store_answers_once_its_blocks_are_written_and_synced_whatever_the_policy() {
    let dir = tempfile::tempdir().unwrap();
    // write_through would write nothing on a first store; a durable store writes anyway.
    let r = disk_rig(dir.path(), 64, WritePolicy::WriteThrough);
    let disk = r.store.disk().unwrap().clone();
    let ks = keys(12, 9, 16);
    r.write_slots(&ks, 0);
    // Blocks 0..4 reach host memory first by a plain store: not on disk.
    r.queues
        .store
        .submit(&r.dyn_pool, &r.store, NS, &chain_blocks(&ks[..4], 0))
        .unwrap()
        .wait_persisted()
        .unwrap();
    assert!(!disk.contains(NS, ks[0]));
    let (copied, persisted) = r
        .queues
        .store
        .submit_durable(&r.dyn_pool, &r.store, NS, &chain_blocks(&ks, 0))
        .unwrap()
        .wait_persisted()
        .unwrap();
    assert_eq!((copied.stored_blocks, copied.already_stored), (8, 4));
    assert!(copied.not_persisted.is_empty());
    assert_eq!(
        persisted.written_blocks, 12,
        "the four the host held were written too"
    );
    assert!(persisted.synced && persisted.failed.is_empty(), "{persisted:?}");
    assert!(ks.iter().all(|&k| disk.contains(NS, k)));
    assert_eq!(disk.stats().unsynced_blocks, 0, "durable means fdatasynced");
    assert_eq!(r.host.stats().pinned_pages, 0);
    // Again: all on disk already, nothing written, still synced.
    let (_, again) = r
        .queues
        .store
        .submit_durable(&r.dyn_pool, &r.store, NS, &chain_blocks(&ks, 0))
        .unwrap()
        .wait_persisted()
        .unwrap();
    assert!(again.synced && again.written_blocks == 0, "{again:?}");
    // The bytes on disk are the ones stored.
    assert_eq!(r.host.clear(None).0, 12);
    r.scrub(32, 12);
    let report = r
        .queues
        .load
        .submit(&r.dyn_pool, &r.store, NS, &Rig::load_blocks(&ks, 32))
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!((report.disk_blocks, report.missing.len()), (12, 0));
    r.assert_slots(&ks, 32);

    // Without a disk tier, or one that is never written: refused, nothing reserved.
    let plain = rig(geo(), 64, 64, TransferConfig::default());
    plain.write_slots(&ks, 0);
    let e = plain
        .queues
        .store
        .submit_durable(&plain.dyn_pool, &plain.store, NS, &chain_blocks(&ks, 0))
        .unwrap_err();
    assert!(e.to_string().contains("no disk tier"), "{e}");
    assert_eq!(plain.host.stats().used_pages, 0);
    let dir2 = tempfile::tempdir().unwrap();
    let read_only = disk_rig(dir2.path(), 64, WritePolicy::None);
    let e = read_only
        .queues
        .store
        .submit_durable(&read_only.dyn_pool, &read_only.store, NS, &chain_blocks(&ks, 0))
        .unwrap_err();
    assert!(e.to_string().contains("write_policy is none"), "{e}");
}

#[test]
fn write_through_admits_blocks_on_their_second_hit() {
    let dir = tempfile::tempdir().unwrap();
    let r = disk_rig(dir.path(), 64, WritePolicy::WriteThrough);
    let ks = keys(8, 2, 16);
    r.write_slots(&ks, 0);
    let (_, persisted) = r
        .queues
        .store
        .submit(&r.dyn_pool, &r.store, NS, &chain_blocks(&ks, 0))
        .unwrap()
        .wait_persisted()
        .unwrap();
    assert_eq!(
        persisted.written_blocks, 0,
        "stored once, hit never: not admitted"
    );
    let disk = r.store.disk().unwrap();
    let first = r.queues.match_prefix(&r.store, NS, &ks[..4]);
    assert!(first.admitted.is_empty());
    r.queues.store.wait_idle();
    assert!(!disk.contains(NS, ks[0]));
    let second = r.queues.match_prefix(&r.store, NS, &ks);
    assert_eq!(second.admitted, ks[..4].to_vec(), "the first four reach two hits");
    r.queues.store.wait_idle();
    for (i, &k) in ks.iter().enumerate() {
        assert_eq!(disk.contains(NS, k), i < 4, "block {i}");
    }
    // A third hit admits nothing new for those four; the other four reach two.
    let third = r.queues.match_prefix(&r.store, NS, &ks);
    assert_eq!(third.admitted, ks[4..].to_vec());
    r.queues.store.wait_idle();
    assert!(ks.iter().all(|&k| disk.contains(NS, k)));
    assert_eq!(r.host.stats().pinned_pages, 0, "persistence released its pins");
}

#[test]
fn evicted_blocks_are_demoted_to_disk_and_still_load() {
    let dir = tempfile::tempdir().unwrap();
    // Host holds 16 blocks; 48 go through it.
    let r = disk_rig(dir.path(), 16, WritePolicy::All);
    let all = keys(48, 3, 16);
    for (i, chunk) in all.chunks(8).enumerate() {
        r.write_slots(chunk, (i * 8) as u32);
        r.queues
            .store
            .submit(&r.dyn_pool, &r.store, NS, &chain_blocks(chunk, (i * 8) as u32))
            .unwrap()
            .wait_persisted()
            .unwrap();
    }
    assert!(r.host.stats().evictions_total >= 32);
    let m = r.store.match_prefix(NS, &all[..8]);
    assert_eq!(
        m.tiers,
        vec![Tier::Disk; 8],
        "the first chunk lives on disk only now"
    );
    r.scrub(64, 8);
    let report = r
        .queues
        .load
        .submit(&r.dyn_pool, &r.store, NS, &Rig::load_blocks(&all[..8], 64))
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(report.disk_blocks, 8);
    r.assert_slots(&all[..8], 64);
}

#[test]
fn a_corrupt_disk_block_is_announced_missing_and_the_rest_loads() {
    let dir = tempfile::tempdir().unwrap();
    let r = disk_rig(dir.path(), 64, WritePolicy::All);
    let ks = keys(6, 4, 16);
    r.write_slots(&ks, 0);
    r.queues
        .store
        .submit(&r.dyn_pool, &r.store, NS, &chain_blocks(&ks, 0))
        .unwrap()
        .wait_persisted()
        .unwrap();
    r.host.clear(None);
    r.store.disk().unwrap().flush().unwrap();
    // Damage the payload of the third block written (slot 2 of the only region).
    let region = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "kvt"))
        .unwrap();
    let entry = 4096 + 16384u64; // header + one page of 16 KiB
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&region)
        .unwrap();
    use std::os::unix::fs::FileExt;
    f.write_all_at(&[0xff; 16], 4096 + 2 * entry + 4096 + 500)
        .unwrap();
    // Which block slot 2 holds: the key is at bytes 32..48 of its header.
    let mut key = [0u8; 16];
    f.read_exact_at(&mut key, 4096 + 2 * entry + 32).unwrap();
    let damaged = kvtier_core::BlockKey::from_le_bytes(key);
    let d = ks
        .iter()
        .position(|&k| k == damaged)
        .expect("slot 2 holds one of the blocks");
    drop(f);
    r.scrub(8, 6);
    let mut ticket = r
        .queues
        .load
        .submit(&r.dyn_pool, &r.store, NS, &Rig::load_blocks(&ks, 8))
        .unwrap();
    let mut announced = Vec::new();
    let report = loop {
        match ticket.next_event().unwrap() {
            LoadEvent::Missing { keys } => announced = keys,
            LoadEvent::LayerReady { layer } => {
                assert_eq!(announced.len(), 1, "missing announced before layer {layer}")
            }
            LoadEvent::Done(r) => break r.unwrap(),
        }
    };
    assert_eq!(announced, vec![damaged]);
    assert_eq!(report.missing, vec![damaged]);
    assert_eq!(report.loaded_blocks, 5);
    r.assert_slots(&ks[..d], 8);
    r.assert_slots(&ks[d + 1..], 8 + d as u32 + 1);
    assert_eq!(r.store.disk().unwrap().stats().corrupt_total, 1);
    assert!(!r.host.contains(NS, damaged), "the failed page was not published");
    assert_eq!(r.host.stats().used_pages as u64, r.host.stats().resident_blocks);
}

#[test]
fn concurrent_loads_of_one_disk_prefix_both_get_every_block() {
    let dir = tempfile::tempdir().unwrap();
    let r = Arc::new(disk_rig(dir.path(), 64, WritePolicy::All));
    let ks = keys(32, 5, 16);
    r.write_slots(&ks, 0);
    r.queues
        .store
        .submit(&r.dyn_pool, &r.store, NS, &chain_blocks(&ks, 0))
        .unwrap()
        .wait_persisted()
        .unwrap();
    r.host.clear(None);
    let handles: Vec<_> = [32u32, 64]
        .into_iter()
        .map(|first| {
            let r = Arc::clone(&r);
            let ks = ks.clone();
            std::thread::spawn(move || {
                r.scrub(first, 32);
                let report = r
                    .queues
                    .load
                    .submit(&r.dyn_pool, &r.store, NS, &Rig::load_blocks(&ks, first))
                    .unwrap()
                    .wait()
                    .unwrap();
                assert!(report.missing.is_empty(), "{:?}", report.missing);
                r.assert_slots(&ks, first);
                report.disk_blocks
            })
        })
        .collect();
    let from_disk: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
    assert_eq!(
        from_disk, 32,
        "each block was read from disk once, the other load waited for it"
    );
    assert_eq!(r.host.stats().pinned_pages, 0);
}

#[test]
fn blocks_persisted_before_a_restart_load_after_it() {
    let dir = tempfile::tempdir().unwrap();
    let ks = keys(10, 6, 16);
    {
        let r = disk_rig(dir.path(), 64, WritePolicy::All);
        r.write_slots(&ks, 0);
        r.queues
            .store
            .submit(&r.dyn_pool, &r.store, NS, &chain_blocks(&ks, 0))
            .unwrap()
            .wait_persisted()
            .unwrap();
    }
    let r = disk_rig(dir.path(), 64, WritePolicy::All);
    assert_eq!(r.store.match_prefix(NS, &ks).disk_blocks(), 10);
    r.queues
        .load
        .submit(&r.dyn_pool, &r.store, NS, &Rig::load_blocks(&ks, 20))
        .unwrap()
        .wait()
        .unwrap();
    r.assert_slots(&ks, 20);
    // The restarted store keeps writing.
    let more = keys(4, 7, 16);
    r.write_slots(&more, 40);
    let (_, p) = r
        .queues
        .store
        .submit(&r.dyn_pool, &r.store, NS, &chain_blocks(&more, 40))
        .unwrap()
        .wait_persisted()
        .unwrap();
    assert_eq!(p.written_blocks, 4);
    drop(r);
    let (store, report) = TieredStore::open(
        geo(),
        &kvtier_store::TieredStoreConfig {
            host: kvtier_store::HostTierConfig {
                capacity: ByteSize::mib(1),
                ..Default::default()
            },
            disk: Some(disk_cfg(dir.path())),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(report.unwrap().entries, 14);
    assert_eq!(store.stats().disk.unwrap().entries, 14);
}
