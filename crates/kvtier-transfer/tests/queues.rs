//! The duplex queues against a real host tier and a real shared-memory device pool.

mod common;

use std::sync::Arc;

use common::*;
use kvtier_core::{ByteSize, Dtype, KvGeometry, LayoutKind};
use kvtier_store::{EvictionKind, HostTier, TieredStore};
use kvtier_transfer::{
    CpuDevicePool, DevicePool, LoadBlock, LoadEvent, StoreBlock, TransferConfig, TransferError,
};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// device → host → device is bit-exact for any geometry, engine layout, block count and
    /// chunking.
    #[test]
    fn round_trip_is_bit_exact_over_geometries(
        layout in prop::sample::select(LayoutKind::ALL.to_vec()),
        layers in 1u32..5,
        kv_heads in 1u32..5,
        head_dim in prop::sample::select(vec![8u32, 64, 80, 128]),
        dtype in prop::sample::select(vec![Dtype::F32, Dtype::Bf16, Dtype::Fp8E4m3]),
        block_tokens in prop::sample::select(vec![1u32, 16, 64]),
        n in 1usize..24,
        chunk_kib in 1u64..512,
        threads in 1usize..4,
    ) {
        let g = KvGeometry::new(layers, kv_heads, head_dim, dtype, block_tokens).unwrap();
        let config = TransferConfig {
            load_threads: threads,
            store_threads: threads,
            chunk_bytes: ByteSize::kib(chunk_kib),
            ..Default::default()
        };
        let host = HostTier::new(g, &host_config(g, 2 * n as u64, EvictionKind::S3fifo)).unwrap();
        let r = Rig::with_layout(TieredStore::host_only(host), 2 * n as u32, layout, &config);
        let ks = keys(n, layers * 1000 + n as u32, block_tokens);
        r.write_slots(&ks, 0);
        let report = r.queues.store.submit(&r.dyn_pool, &r.store, NS, &chain_blocks(&ks, 0)).unwrap().wait().unwrap();
        prop_assert_eq!(report.stored_blocks, n);
        prop_assert_eq!(report.bytes, (n * g.bytes_per_block()) as u64);
        prop_assert_eq!(r.host.match_prefix(NS, &ks).len(), n);
        // Load into other slots, after scrubbing them.
        r.scrub(n as u32, n);
        let mut ticket = r.queues.load.submit(&r.dyn_pool, &r.store, NS, &Rig::load_blocks(&ks, n as u32)).unwrap();
        let mut layers_seen = Vec::new();
        let report = loop {
            match ticket.next_event().unwrap() {
                LoadEvent::LayerReady { layer } => layers_seen.push(layer),
                LoadEvent::Done(r) => break r.unwrap(),
                LoadEvent::Missing { keys } => panic!("nothing is on disk, yet {keys:?} missing"),
            }
        };
        prop_assert_eq!(layers_seen, (0..layers).collect::<Vec<_>>(), "one event per layer, in order");
        prop_assert!(ticket.next_event().is_none());
        prop_assert_eq!(report.loaded_blocks, n);
        prop_assert!(report.missing.is_empty());
        prop_assert!(report.timing.span() <= report.timing.latency());
        r.assert_slots(&ks, n as u32);
        prop_assert_eq!(r.host.stats().pinned_pages, 0, "pins released when the load is done");
    }
}

#[test]
fn missing_blocks_are_reported_not_skipped() {
    let g = KvGeometry::new(2, 2, 16, Dtype::Bf16, 8).unwrap();
    let r = rig(g, 16, 16, TransferConfig::default());
    let ks = keys(6, 1, 8);
    r.write_slots(&ks[..3], 0);
    r.queues
        .store
        .submit(&r.dyn_pool, &r.store, NS, &chain_blocks(&ks[..3], 0))
        .unwrap()
        .wait()
        .unwrap();
    let ticket = r
        .queues
        .load
        .submit(&r.dyn_pool, &r.store, NS, &Rig::load_blocks(&ks, 8))
        .unwrap();
    assert_eq!(ticket.missing(), &ks[3..]);
    let report = ticket.wait().unwrap();
    assert_eq!((report.loaded_blocks, report.missing.len()), (3, 3));
    r.assert_slots(&ks[..3], 8);
    assert_eq!(r.queues.load.stats().missing_blocks_total, 3);
    // All missing: the ticket completes at once.
    let other = keys(2, 99, 8);
    let report = r
        .queues
        .load
        .submit(&r.dyn_pool, &r.store, NS, &Rig::load_blocks(&other, 0))
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(
        (report.loaded_blocks, report.missing.len(), report.bytes),
        (0, 2, 0)
    );
}

#[test]
fn bad_requests_are_refused_and_hold_nothing() {
    let g = KvGeometry::new(1, 2, 16, Dtype::Bf16, 8).unwrap();
    let r = rig(g, 8, 4, TransferConfig::default());
    let ks = keys(2, 5, 8);
    r.write_slots(&ks, 0);
    r.queues
        .store
        .submit(&r.dyn_pool, &r.store, NS, &chain_blocks(&ks, 0))
        .unwrap()
        .wait()
        .unwrap();
    let load = |blocks: &[LoadBlock]| {
        r.queues
            .load
            .submit(&r.dyn_pool, &r.store, NS, blocks)
            .map(|_| ())
    };
    assert!(matches!(
        load(&[]),
        Err(TransferError::EmptyRequest { queue: "load" })
    ));
    let e = load(&[LoadBlock { key: ks[0], slot: 4 }]).unwrap_err();
    assert!(
        matches!(
            e,
            TransferError::SlotOutOfRange {
                slot: 4,
                num_slots: 4
            }
        ),
        "{e}"
    );
    let e = load(&[
        LoadBlock { key: ks[0], slot: 1 },
        LoadBlock { key: ks[1], slot: 1 },
    ])
    .unwrap_err();
    assert!(matches!(e, TransferError::DuplicateSlot { slot: 1 }), "{e}");
    let store = |blocks: &[StoreBlock]| {
        r.queues
            .store
            .submit(&r.dyn_pool, &r.store, NS, blocks)
            .map(|_| ())
    };
    assert!(matches!(
        store(&[]),
        Err(TransferError::EmptyRequest { queue: "store" })
    ));
    let e = store(&[StoreBlock {
        key: ks[0],
        parent: None,
        slot: 9,
    }])
    .unwrap_err();
    assert!(matches!(e, TransferError::SlotOutOfRange { slot: 9, .. }), "{e}");
    // A pool of another geometry.
    let other_geo = KvGeometry::new(2, 2, 16, Dtype::Bf16, 8).unwrap();
    let other: Arc<dyn DevicePool> = Arc::new(CpuDevicePool::create(None, other_geo, 4).unwrap());
    let e = r
        .queues
        .load
        .submit(&other, &r.store, NS, &[LoadBlock { key: ks[0], slot: 0 }])
        .unwrap_err();
    assert!(matches!(e, TransferError::GeometryMismatch { .. }), "{e}");
    let s = r.host.stats();
    assert_eq!(
        (s.pinned_pages, s.used_pages),
        (0, 2),
        "refused requests pin and reserve nothing"
    );
}

#[test]
fn a_requester_that_goes_away_releases_its_pins_and_pages() {
    let g = KvGeometry::new(4, 8, 128, Dtype::Bf16, 64).unwrap();
    let n = 64;
    let r = rig(
        g,
        2 * n as u64 + 8,
        2 * n as u32,
        TransferConfig {
            load_threads: 1,
            store_threads: 1,
            chunk_bytes: ByteSize::kib(128),
            ..Default::default()
        },
    );
    let ks = keys(n, 3, 64);
    r.write_slots(&ks, 0);
    r.queues
        .store
        .submit(&r.dyn_pool, &r.store, NS, &chain_blocks(&ks, 0))
        .unwrap()
        .wait()
        .unwrap();
    // Many loads, each abandoned right away.
    for _ in 0..20 {
        let t = r
            .queues
            .load
            .submit(&r.dyn_pool, &r.store, NS, &Rig::load_blocks(&ks, n as u32))
            .unwrap();
        drop(t);
    }
    // Abandoned stores of new blocks.
    let fresh = keys(n, 4, 64);
    for _ in 0..5 {
        if let Ok(t) = r
            .queues
            .store
            .submit(&r.dyn_pool, &r.store, NS, &chain_blocks(&fresh, n as u32))
        {
            drop(t);
        }
    }
    r.queues.load.wait_idle();
    r.queues.store.wait_idle();
    let s = r.host.stats();
    assert_eq!(s.pinned_pages, 0, "every pin was released");
    let ls = r.queues.load.stats();
    assert_eq!(ls.completed_total + ls.cancelled_total, 20);
    assert!(ls.cancelled_total > 0, "at least one load was cut short: {ls:?}");
    assert_eq!(ls.inflight_bytes, 0);
    let ss = r.queues.store.stats();
    assert_eq!(ss.inflight_bytes, 0);
    // A cancelled store publishes nothing: each fresh block is either fully stored or absent.
    let bl = g.bytes_per_block_layer();
    let mut buf = vec![0u8; bl];
    for &k in &fresh {
        if let Some(pin) = r.host.pin(NS, k) {
            for layer in 0..4 {
                pin.read_layer(layer, &mut buf).unwrap();
                assert!(buf == kv(k, layer, bl));
            }
        }
    }
    assert_eq!(s.used_pages as u64, s.resident_blocks, "no page left reserved");
}

#[test]
fn a_full_store_queue_drops_and_counts_instead_of_waiting() {
    let g = KvGeometry::new(1, 4, 128, Dtype::Bf16, 64).unwrap();
    let r = rig(
        g,
        64,
        32,
        TransferConfig {
            store_inflight_limit: ByteSize(g.bytes_per_block() as u64 * 4),
            store_threads: 1,
            ..Default::default()
        },
    );
    let ks = keys(32, 8, 64);
    r.write_slots(&ks, 0);
    // Submit many stores back to back; whatever exceeds the bound is refused at once.
    let mut tickets = Vec::new();
    let (mut refused, mut refused_blocks) = (0, 0);
    for (i, chunk) in ks.chunks(4).enumerate() {
        match r
            .queues
            .store
            .submit(&r.dyn_pool, &r.store, NS, &chain_blocks(chunk, i as u32 * 4))
        {
            Ok(t) => tickets.push(t),
            Err(TransferError::QueueFull {
                queue: "store",
                limit_bytes,
                ..
            }) => {
                assert_eq!(limit_bytes, g.bytes_per_block() as u64 * 4);
                refused += 1;
                refused_blocks += chunk.len() as u64;
            }
            Err(e) => panic!("{e}"),
        }
    }
    for t in tickets {
        t.wait().unwrap();
    }
    let s = r.queues.store.stats();
    assert_eq!(s.rejected_requests_total, refused);
    assert_eq!(s.dropped_blocks_total(), refused_blocks);
    assert_eq!(s.blocks_total + refused_blocks, 32);
}

#[test]
fn a_full_host_tier_drops_stores_with_no_space() {
    let g = KvGeometry::new(1, 4, 128, Dtype::Bf16, 64).unwrap();
    let r = rig(g, 4, 8, TransferConfig::default());
    let ks = keys(8, 9, 64);
    r.write_slots(&ks, 0);
    let blocks = chain_blocks(&ks, 0);
    let report = r
        .queues
        .store
        .submit(&r.dyn_pool, &r.store, NS, &blocks[..4])
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(report.stored_blocks, 4);
    let _pins = r.host.pin_all(NS, &ks[..4]).unwrap();
    let report = r
        .queues
        .store
        .submit(&r.dyn_pool, &r.store, NS, &blocks[4..])
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!((report.stored_blocks, report.no_space.len()), (0, 4));
    assert_eq!(r.queues.store.stats().dropped_blocks_total(), 4);
    // Storing the same blocks again is not a copy.
    let report = r
        .queues
        .store
        .submit(&r.dyn_pool, &r.store, NS, &blocks[..4])
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!((report.stored_blocks, report.already_stored), (0, 4));
}

#[test]
fn concurrent_loads_and_stores_from_many_threads_verify() {
    let g = KvGeometry::new(2, 4, 64, Dtype::Bf16, 16).unwrap();
    let per = 24usize;
    let clients = 4usize;
    let r = Arc::new(rig(
        g,
        (clients * per * 11) as u64,
        (clients * per * 2) as u32,
        TransferConfig {
            load_threads: 2,
            store_threads: 2,
            chunk_bytes: ByteSize::kib(64),
            ..Default::default()
        },
    ));
    let handles: Vec<_> = (0..clients)
        .map(|c| {
            let r = Arc::clone(&r);
            std::thread::spawn(move || {
                let base = (c * per * 2) as u32;
                let mut verified = 0;
                for round in 0..10u32 {
                    let ks = keys(per, (c as u32) << 16 | round, 16);
                    r.write_slots(&ks, base);
                    let store = r
                        .queues
                        .store
                        .submit(&r.dyn_pool, &r.store, NS, &chain_blocks(&ks, base))
                        .unwrap();
                    // Meanwhile load the previous round's blocks.
                    if round > 0 {
                        let prev = keys(per, (c as u32) << 16 | (round - 1), 16);
                        r.scrub(base + per as u32, per);
                        let rep = r
                            .queues
                            .load
                            .submit(
                                &r.dyn_pool,
                                &r.store,
                                NS,
                                &Rig::load_blocks(&prev, base + per as u32),
                            )
                            .unwrap()
                            .wait()
                            .unwrap();
                        assert!(rep.missing.is_empty());
                        r.assert_slots(&prev, base + per as u32);
                        verified += per;
                    }
                    store.wait().unwrap();
                }
                verified
            })
        })
        .collect();
    let verified: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
    assert_eq!(verified, clients * per * 9);
    assert_eq!(r.host.stats().pinned_pages, 0);
}

#[test]
fn events_go_to_a_callback_and_a_non_blocking_load_refuses_instead_of_waiting() {
    use kvtier_store::Reservation;
    use kvtier_transfer::{EventSink, InflightBlocks, StoreEvent};

    let g = KvGeometry::new(2, 2, 16, Dtype::Bf16, 8).unwrap();
    let r = rig(g, 16, 16, TransferConfig::default());
    let ks = keys(4, 7, 8);
    r.write_slots(&ks[..3], 0);
    // A store whose events go to a callback: Copied, then Persisted.
    let (tx, rx) = std::sync::mpsc::channel();
    let mut handle = r
        .queues
        .store
        .submit_to(
            &r.dyn_pool,
            &r.store,
            NS,
            &chain_blocks(&ks[..3], 0),
            kvtier_transfer::Durability::Host,
            None,
            EventSink::new(move |e| tx.send(e).unwrap()),
        )
        .unwrap();
    match rx.recv().unwrap() {
        StoreEvent::Copied(report) => assert_eq!(report.unwrap().stored_blocks, 3),
        other => panic!("{other:?} before Copied"),
    }
    handle.disarm();
    assert!(matches!(rx.recv().unwrap(), StoreEvent::Persisted(Ok(_))));

    // Block 3 is being written by someone else right now.
    let Reservation::Writer(writer) = r.host.reserve(NS, ks[3], Some(ks[2])).unwrap() else {
        panic!("block 3 was free")
    };
    let sink = |tx: std::sync::mpsc::Sender<LoadEvent>| EventSink::new(move |e| tx.send(e).unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    let refused = r.queues.load.submit_to(
        &r.dyn_pool,
        &r.store,
        NS,
        &Rig::load_blocks(&ks, 8),
        sink(tx),
        InflightBlocks::Refuse,
    );
    assert!(matches!(refused, Err(TransferError::WouldBlock)), "{refused:?}");
    assert!(rx.try_recv().is_err(), "a refused load sends no event");
    assert_eq!(r.host.stats().pinned_pages, 0, "a refused load pins nothing");

    // Without the writer, the same non-blocking load runs; its events reach the callback.
    drop(writer);
    let (tx, rx) = std::sync::mpsc::channel();
    let handle = r
        .queues
        .load
        .submit_to(
            &r.dyn_pool,
            &r.store,
            NS,
            &Rig::load_blocks(&ks, 8),
            sink(tx),
            InflightBlocks::Refuse,
        )
        .unwrap();
    assert_eq!(handle.missing(), &ks[3..]);
    let events: Vec<LoadEvent> = rx.iter().take(3).collect();
    assert!(matches!(events[0], LoadEvent::LayerReady { layer: 0 }));
    assert!(matches!(events[1], LoadEvent::LayerReady { layer: 1 }));
    match &events[2] {
        LoadEvent::Done(Ok(report)) => assert_eq!((report.loaded_blocks, report.missing.len()), (3, 1)),
        other => panic!("{other:?}"),
    }
    r.assert_slots(&ks[..3], 8);
}

/// A pool whose copies wait until the test lets them run.
#[derive(Debug)]
struct HeldPool {
    inner: Arc<dyn DevicePool>,
    open: Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>,
}

impl DevicePool for HeldPool {
    fn geometry(&self) -> &KvGeometry {
        self.inner.geometry()
    }
    fn num_slots(&self) -> u32 {
        self.inner.num_slots()
    }
    fn layout(&self) -> &kvtier_core::PoolLayout {
        self.inner.layout()
    }
    fn device_kind(&self) -> &'static str {
        self.inner.device_kind()
    }
    fn submit(
        &self,
        direction: kvtier_transfer::CopyDirection,
        layer: u32,
        host: &kvtier_store::ShmRegion,
        copies: &[kvtier_transfer::SlotCopy],
    ) -> Result<kvtier_transfer::CopyTicket, TransferError> {
        let (open, cv) = &*self.open;
        // Wait for the gate, then let it go: the copies themselves need not hold it.
        drop(cv.wait_while(open.lock().unwrap(), |o| !*o).unwrap());
        self.inner.submit(direction, layer, host, copies)
    }
    fn check_usable(&self) -> Result<(), TransferError> {
        self.inner.check_usable()
    }
}

/// A store with a `not_after` (an engine that reuses its blocks once it stops waiting):
/// refused when that time has passed before it starts, and publishing nothing when its copies
/// end after it, however long the sidecar took to get to it; in time, it stores as usual.
#[test]
fn a_store_publishes_nothing_of_copies_that_end_after_its_not_after() {
    use std::time::{Duration, SystemTime};

    use kvtier_transfer::{Durability, EventSink, StoreEvent};

    let g = KvGeometry::new(2, 2, 16, Dtype::Bf16, 8).unwrap();
    let r = rig(g, 16, 16, TransferConfig::default());
    let ks = keys(3, 9, 8);
    r.write_slots(&ks, 0);
    let open = Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
    let held: Arc<dyn DevicePool> = Arc::new(HeldPool {
        inner: Arc::clone(&r.dyn_pool),
        open: Arc::clone(&open),
    });
    let store = |pool: &Arc<dyn DevicePool>, not_after: SystemTime| {
        let (tx, rx) = std::sync::mpsc::channel();
        r.queues
            .store
            .submit_to(
                pool,
                &r.store,
                NS,
                &chain_blocks(&ks, 0),
                Durability::Host,
                Some(not_after),
                EventSink::new(move |e| {
                    if let StoreEvent::Copied(c) = e {
                        tx.send(c).unwrap();
                    }
                }),
            )
            .map(|h| (h, rx))
    };
    // Past already: refused before anything is reserved.
    let past = SystemTime::now() - Duration::from_millis(5);
    let e = store(&r.dyn_pool, past).unwrap_err();
    assert!(
        matches!(&e, TransferError::TooLate(why) if why.starts_with("were to start")),
        "{e:?}"
    );
    assert_eq!(r.host.stats().used_pages, 0);
    // Copies held past it: nothing published, every page let go. The margin only has to
    // cover the submit (its start is checked against `soon`); the wait below ends once the
    // wall clock is past `soon`.
    let soon = SystemTime::now() + Duration::from_millis(100);
    let (_handle, rx) = store(&held, soon).unwrap();
    while SystemTime::now() <= soon {
        std::thread::sleep(Duration::from_millis(5)); // the engine's wait runs out
    }
    *open.0.lock().unwrap() = true;
    open.1.notify_all();
    let e = rx.recv().unwrap().unwrap_err();
    assert!(
        // Late either at the end, or at a copy after the first (the rest are skipped).
        matches!(&e, TransferError::TooLate(why) if why.starts_with("ended") || why.starts_with("were still running")),
        "{e:?}"
    );
    assert!(e.to_string().contains("nothing was stored"), "{e}");
    r.queues.store.wait_idle();
    assert_eq!(r.host.match_prefix(NS, &ks).len(), 0, "nothing published");
    assert_eq!(r.host.stats().used_pages, 0, "no page left reserved");
    // In time: stored.
    let later = SystemTime::now() + Duration::from_secs(60);
    let (mut handle, rx) = store(&r.dyn_pool, later).unwrap();
    assert_eq!(rx.recv().unwrap().unwrap().stored_blocks, 3);
    handle.disarm();
    assert_eq!(r.host.match_prefix(NS, &ks).len(), 3);
}
