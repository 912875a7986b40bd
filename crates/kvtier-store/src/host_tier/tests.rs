use std::collections::HashSet;

use kvtier_core::{BlockHasher, Dtype};
use proptest::prelude::*;

use super::*;

/// Bytes of one block-layer in [`geo`].
const BL: usize = 256;

fn geo() -> KvGeometry {
    // One block-layer is 2 * 4 tokens * 1 head * 16 dim * 2 bytes = 256 bytes; two layers fit one
    // 4 KiB page.
    KvGeometry::new(2, 1, 16, Dtype::Bf16, 4).unwrap()
}

fn tier(pages: u64, eviction: EvictionKind) -> HostTier {
    HostTier::new(
        geo(),
        &HostTierConfig {
            capacity: ByteSize(pages * 4096),
            eviction,
            ..Default::default()
        },
    )
    .unwrap()
}

const NS: NamespaceFingerprint = NamespaceFingerprint(42);

fn chain(n: usize, seed: u32) -> Vec<BlockKey> {
    let tokens: Vec<u32> = (0..n as u32 * 4)
        .map(|t| t.wrapping_mul(7).wrapping_add(seed))
        .collect();
    BlockHasher::new(NS, 4).keys(&tokens)
}

fn fill_bytes(key: BlockKey, layer: u32, len: usize) -> Vec<u8> {
    let seed = (key.0 as u64) ^ u64::from(layer).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (0..len)
        .map(|i| (seed.rotate_left((i % 64) as u32) as u8) ^ i as u8)
        .collect()
}

fn store(t: &HostTier, key: BlockKey, parent: Option<BlockKey>) -> Result<(), StoreError> {
    match t.reserve(NS, key, parent)? {
        Reservation::Writer(w) => {
            for layer in 0..2 {
                w.write_layer(layer, &fill_bytes(key, layer, BL))?;
            }
            w.commit();
            Ok(())
        }
        Reservation::AlreadyStored | Reservation::InFlight => Ok(()),
    }
}

fn store_chain(t: &HostTier, keys: &[BlockKey]) {
    let mut parent = None;
    for &k in keys {
        store(t, k, parent).unwrap();
        parent = Some(k);
    }
}

#[test]
fn capacity_smaller_than_one_block_is_refused() {
    let err = HostTier::new(
        geo(),
        &HostTierConfig {
            capacity: ByteSize(4095),
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::CapacityTooSmall {
                capacity_bytes: 4095,
                page_bytes: 4096
            }
        ),
        "{err}"
    );
}

#[test]
fn a_block_is_invisible_until_committed_and_abort_frees_its_page() {
    let t = tier(4, EvictionKind::Lru);
    let k = chain(1, 0)[0];
    let Reservation::Writer(w) = t.reserve(NS, k, None).unwrap() else {
        panic!()
    };
    w.write_layer(0, &fill_bytes(k, 0, BL)).unwrap();
    assert!(t.match_prefix(NS, &[k]).is_empty());
    assert!(t.pin(NS, k).is_none());
    assert!(matches!(t.reserve(NS, k, None).unwrap(), Reservation::InFlight));
    assert_eq!(t.stats().used_pages, 1);
    drop(w);
    assert_eq!(t.stats().used_pages, 0);
    assert_eq!(t.stats().aborted_writes_total, 1);
    assert!(!t.contains(NS, k));
    store(&t, k, None).unwrap();
    assert!(matches!(
        t.reserve(NS, k, None).unwrap(),
        Reservation::AlreadyStored
    ));
    let pin = t.pin(NS, k).unwrap();
    let mut out = vec![0u8; BL];
    pin.read_layer(0, &mut out).unwrap();
    assert_eq!(out, fill_bytes(k, 0, BL));
}

#[test]
fn bad_layer_and_buffer_sizes_are_named() {
    let t = tier(2, EvictionKind::S3fifo);
    let k = chain(1, 0)[0];
    let Reservation::Writer(w) = t.reserve(NS, k, None).unwrap() else {
        panic!()
    };
    assert!(matches!(
        w.write_layer(2, &[0; BL]),
        Err(StoreError::LayerOutOfRange { layer: 2, layers: 2 })
    ));
    assert!(matches!(
        w.write_layer(0, &[0; 100]),
        Err(StoreError::BufferSize {
            expected_bytes: 256,
            actual_bytes: 100
        })
    ));
    w.commit();
    let missing = chain(2, 9)[1];
    assert!(
        matches!(t.pin_all(NS, &[k, missing]), Err(StoreError::NotFound { key, tier: "host" }) if key == missing)
    );
    assert_eq!(t.stats().pinned_pages, 0, "a failed pin_all holds nothing");
}

#[test]
fn match_stops_at_a_hole_and_at_another_namespace() {
    let t = tier(16, EvictionKind::S3fifo);
    let keys = chain(6, 1);
    store_chain(&t, &keys[..3]);
    store(&t, keys[4], Some(keys[3])).unwrap();
    assert_eq!(t.match_prefix(NS, &keys).len(), 3);
    assert!(t.match_prefix(NamespaceFingerprint(43), &keys).is_empty());
    assert!(
        t.pin(NamespaceFingerprint(43), keys[0]).is_none(),
        "namespace is verified on pin"
    );
    let s = t.stats();
    assert_eq!((s.hits_total, s.lookups_total), (3, 5));
}

#[test]
fn pinned_pages_are_never_evicted_and_full_pinned_tier_says_no_space() {
    for kind in [EvictionKind::Lru, EvictionKind::S3fifo] {
        let t = tier(4, kind);
        let keys: Vec<BlockKey> = (0..4).map(|i| chain(1, i)[0]).collect();
        for &k in &keys {
            store(&t, k, None).unwrap();
        }
        let mut pins: Vec<_> = keys.iter().map(|&k| t.pin(NS, k).unwrap()).collect();
        let extra = chain(1, 100)[0];
        let err = t.reserve(NS, extra, None).unwrap_err();
        assert!(
            matches!(err, StoreError::NoSpace { capacity_pages: 4 }),
            "{kind:?}: {err}"
        );
        assert_eq!(t.stats().no_space_total, 1);
        drop(pins.remove(2));
        store(&t, extra, None).unwrap();
        assert!(
            !t.contains(NS, keys[2]),
            "{kind:?}: the one unpinned page was the victim"
        );
        for (i, &k) in keys.iter().enumerate() {
            if i != 2 {
                assert!(t.contains(NS, k), "{kind:?}: pinned block {i} survived");
            }
        }
    }
}

#[test]
fn suffixes_are_evicted_before_their_prefixes() {
    for kind in [EvictionKind::Lru, EvictionKind::S3fifo] {
        let t = tier(8, kind);
        let a = chain(8, 1);
        store_chain(&t, &a);
        // Touch the whole chain: a prefix is used at least as often as its suffix.
        t.match_prefix(NS, &a);
        // New single blocks keep arriving; whatever the policy picks, the chain's resident
        // blocks always stay a prefix of it.
        let mut lost = 0;
        for i in 0..12 {
            let r = store(&t, chain(1, 50 + i)[0], None);
            assert!(r.is_ok(), "{kind:?} insert {i}: {r:?}");
            // `contains` does not count as a use, unlike a match.
            let left = a.iter().take_while(|&&k| t.contains(NS, k)).count();
            for (j, &k) in a.iter().enumerate() {
                assert_eq!(
                    t.contains(NS, k),
                    j < left,
                    "{kind:?}: block {j} after insert {i}"
                );
            }
            lost = 8 - left;
        }
        assert!(
            lost >= 1,
            "{kind:?}: the chain gave up blocks to newer ones ({lost} lost)"
        );
    }
}

#[test]
fn remove_and_clear_respect_pins_and_namespaces() {
    let t = tier(8, EvictionKind::S3fifo);
    let keys = chain(4, 3);
    store_chain(&t, &keys);
    let other = NamespaceFingerprint(7);
    let ok = chain(1, 77)[0];
    let Reservation::Writer(w) = t.reserve(other, ok, None).unwrap() else {
        panic!()
    };
    w.commit();
    let pin = t.pin(NS, keys[1]).unwrap();
    assert_eq!(t.remove(NS, keys[3]), Removal::Removed);
    assert_eq!(t.remove(NS, keys[3]), Removal::Absent);
    assert_eq!(t.remove(other, keys[0]), Removal::Absent);
    assert_eq!(t.remove(NS, keys[1]), Removal::Pinned);
    assert_eq!(t.clear(Some(NS)), (2, 1));
    assert!(t.contains(NS, keys[1]) && t.contains(other, ok));
    drop(pin);
    assert_eq!(t.clear(None), (2, 0));
    assert_eq!(t.stats().used_pages, 0);
}

/// One step of the model-based property test.
#[derive(Debug, Clone)]
enum Op {
    Store { chain: u8, len: u8 },
    Reserve { key: u8 },
    Commit,
    Abort,
    Pin { key: u8 },
    Unpin,
    Match { chain: u8 },
    Remove { key: u8 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..6, 1u8..6).prop_map(|(chain, len)| Op::Store { chain, len }),
        (0u8..40).prop_map(|key| Op::Reserve { key }),
        Just(Op::Commit),
        Just(Op::Abort),
        (0u8..40).prop_map(|key| Op::Pin { key }),
        Just(Op::Unpin),
        (0u8..6).prop_map(|chain| Op::Match { chain }),
        (0u8..40).prop_map(|key| Op::Remove { key }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Random interleavings of stores, open writers, pins, matches and removals never allocate
    /// a page twice, never evict a pinned block, never exceed capacity and never leak a page.
    #[test]
    fn allocator_and_index_invariants(ops in proptest::collection::vec(op(), 1..120), lru in any::<bool>()) {
        let kind = if lru { EvictionKind::Lru } else { EvictionKind::S3fifo };
        let t = tier(8, kind);
        let chains: Vec<Vec<BlockKey>> = (0..6).map(|c| chain(6, c * 1000)).collect();
        let singles: Vec<BlockKey> = (0..40).map(|i| chain(1, 100_000 + i * 13)[0]).collect();
        let mut writers: Vec<PageWriter> = Vec::new();
        let mut pins: Vec<PinnedPage> = Vec::new();
        for op in ops {
            match op {
                Op::Store { chain, len } => {
                    let keys = &chains[chain as usize][..len as usize];
                    let mut parent = None;
                    for &k in keys {
                        match store(&t, k, parent) {
                            Ok(()) | Err(StoreError::NoSpace { .. }) => {}
                            Err(e) => prop_assert!(false, "{e}"),
                        }
                        parent = Some(k);
                    }
                }
                Op::Reserve { key } => {
                    if let Ok(Reservation::Writer(w)) = t.reserve(NS, singles[key as usize], None) {
                        w.write_layer(0, &fill_bytes(w.key(), 0, BL)).unwrap();
                        w.write_layer(1, &fill_bytes(w.key(), 1, BL)).unwrap();
                        writers.push(w);
                    }
                }
                Op::Commit => { if let Some(w) = writers.pop() { w.commit(); } }
                Op::Abort => { writers.pop(); }
                Op::Pin { key } => {
                    if let Some(p) = t.pin(NS, singles[key as usize]) { pins.push(p); }
                    if let Some(p) = t.pin(NS, chains[key as usize % 6][0]) { pins.push(p); }
                }
                Op::Unpin => { pins.pop(); }
                Op::Match { chain } => { t.match_prefix(NS, &chains[chain as usize]); }
                Op::Remove { key } => { t.remove(NS, singles[key as usize]); }
            }
            // Invariants after every step.
            let s = t.stats();
            prop_assert!(s.used_pages <= s.capacity_pages);
            let mut pages = HashSet::new();
            let mut resident = 0u64;
            for k in chains.iter().flatten().chain(singles.iter()) {
                if let Some(p) = t.pin(NS, *k) {
                    prop_assert!(pages.insert(p.page()), "page {} holds two blocks", p.page());
                    let mut buf = vec![0u8; BL];
                    p.read_layer(1, &mut buf).unwrap();
                    prop_assert_eq!(&buf, &fill_bytes(*k, 1, BL), "block bytes intact");
                    resident += 1;
                }
            }
            for w in &writers {
                prop_assert!(pages.insert(w.page()), "a writer's page is also resident");
            }
            prop_assert_eq!(resident, s.resident_blocks);
            prop_assert_eq!(s.used_pages as usize, resident as usize + writers.len());
            for p in &pins {
                prop_assert!(t.contains(NS, p.key()), "pinned block {} vanished", p.key());
            }
        }
        drop(writers);
        drop(pins);
        t.clear(None);
        let s = t.stats();
        prop_assert_eq!(s.used_pages, 0, "no page leaked");
        prop_assert_eq!(s.pinned_pages, 0);
    }
}

#[test]
fn concurrent_writers_readers_and_evictions_stay_bit_exact() {
    let t = tier(64, EvictionKind::S3fifo);
    let threads: Vec<_> = (0..4u32)
        .map(|tid| {
            let t = t.clone();
            std::thread::spawn(move || {
                let mut verified = 0u64;
                for round in 0..200u32 {
                    let keys = chain(8, tid * 100_000 + round % 13);
                    let mut parent = None;
                    for &k in &keys {
                        match store(&t, k, parent) {
                            Ok(()) | Err(StoreError::NoSpace { .. }) => {}
                            Err(e) => panic!("{e}"),
                        }
                        parent = Some(k);
                    }
                    let matched = t.match_prefix(NS, &keys).len();
                    for &k in &keys[..matched] {
                        if let Some(p) = t.pin(NS, k) {
                            let mut buf = vec![0u8; BL];
                            p.read_layer(0, &mut buf).unwrap();
                            assert_eq!(buf, fill_bytes(k, 0, BL));
                            verified += 1;
                        }
                    }
                }
                verified
            })
        })
        .collect();
    let verified: u64 = threads.into_iter().map(|h| h.join().unwrap()).sum();
    assert!(verified > 1000, "verified {verified}");
    let s = t.stats();
    assert!(s.evictions_total > 0);
    assert_eq!(s.pinned_pages, 0);
    assert_eq!(t.clear(None).1, 0);
    assert_eq!(t.stats().used_pages, 0);
}

#[test]
fn racing_writers_of_the_same_blocks_never_deadlock_and_every_waiter_gets_its_pin() {
    // Four threads reserve the same chains at once: one wins each block and writes it, the
    // others wait for it. Two defects this catches: the losing `reserve` read the index shard
    // under its own write lock (a self-deadlock), and a waiter whose writer committed between
    // its failed pin and its "still writing?" check gave up with a miss.
    let t = tier(256, EvictionKind::Lru);
    for round in 0..50u32 {
        let keys = chain(16, 1_000 + round);
        let barrier = Arc::new(std::sync::Barrier::new(4));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (t, keys, barrier) = (t.clone(), keys.clone(), Arc::clone(&barrier));
                std::thread::spawn(move || {
                    barrier.wait();
                    let mut parent = None;
                    for &k in &keys {
                        store(&t, k, parent).unwrap();
                        parent = Some(k);
                    }
                    for &k in &keys {
                        let p = t
                            .pin_waiting(NS, k, Duration::from_secs(30))
                            .expect("a block written by another thread is pinned, not missed");
                        let mut buf = vec![0u8; BL];
                        p.read_layer(1, &mut buf).unwrap();
                        assert_eq!(buf, fill_bytes(k, 1, BL));
                    }
                })
            })
            .collect();
        for h in threads {
            h.join().unwrap();
        }
        assert_eq!(t.stats().pinned_pages, 0, "round {round}");
    }
}

#[test]
fn each_admission_threshold_is_reached_on_its_own_match() {
    // The disk's filter (2 hits) and the remote tier's (3 hits) count the same hits.
    let t = tier(16, EvictionKind::Lru);
    let keys = chain(3, 77);
    store_chain(&t, &keys);
    let all = vec![0, 1, 2];
    for (n, want) in [
        (1, [vec![], vec![]]),
        (2, [all.clone(), vec![]]),
        (3, [vec![], all.clone()]),
        (4, [vec![], vec![]]),
    ] {
        let (pages, reached) = t.match_prefix_counting(NS, &keys, [2, 3]);
        assert_eq!(pages.len(), 3);
        assert_eq!(reached, want, "match {n}");
    }
    // 0 admits nothing, whatever the count.
    assert_eq!(t.match_prefix_counting(NS, &keys, [0]).1, [Vec::<usize>::new()]);
}

/// Evictions reach the tiered store's removal feed, named; a clear says so.
#[test]
fn evictions_and_clears_reach_the_removal_feed() {
    use crate::{Removed, TieredStore};
    let t = tier(4, EvictionKind::Lru);
    let tiers = TieredStore::host_only(t.clone());
    let ks: Vec<BlockKey> = (0..8).map(|i| chain(1, 100 + i)[0]).collect();
    store(&t, ks[0], None).unwrap();
    let mut rx = tiers.removals().subscribe();
    for &k in &ks[1..] {
        store(&t, k, None).unwrap();
    }
    // 8 blocks through 4 pages: the 4 oldest left, in order.
    let heard: Vec<Removed> = std::iter::from_fn(|| rx.try_recv().ok()).collect();
    assert_eq!(
        heard,
        ks[..4].iter().map(|&k| Removed::Block(NS, k)).collect::<Vec<_>>()
    );
    assert!(ks[..4].iter().all(|&k| !t.contains(NS, k)));
    tiers.clear(None).unwrap();
    assert_eq!(rx.try_recv().unwrap(), Removed::Cleared);
    assert!(rx.try_recv().is_err());
}
