//! The remote tier against a real Redis Cluster (scripts/redis_cluster.sh).

use kvtier_core::{BlockHasher, ByteSize, Dtype};

use super::*;
use crate::test_cluster::TestCluster;
use crate::{HostTier, HostTierConfig, Reservation};

const NS: NamespaceFingerprint = NamespaceFingerprint(0xfeed);
const OTHER: NamespaceFingerprint = NamespaceFingerprint(0xbeef);

fn geo() -> KvGeometry {
    // 2 layers of 2 × 16 tokens × 2 heads × 64 dims × 2 bytes = 8 KiB per block-layer.
    KvGeometry::new(2, 2, 64, Dtype::Bf16, 16).unwrap()
}

fn host() -> HostTier {
    HostTier::new(
        geo(),
        &HostTierConfig {
            capacity: ByteSize::mib(4),
            ..Default::default()
        },
    )
    .unwrap()
}

fn keys(n: usize, seed: u32) -> Vec<BlockKey> {
    let tokens: Vec<u32> = (0..n as u32 * 16)
        .map(|t| t.wrapping_mul(31).wrapping_add(seed))
        .collect();
    BlockHasher::new(NS, 16).keys(&tokens)
}

fn bytes_of(key: BlockKey) -> Vec<u8> {
    let len = geo().bytes_per_block();
    (0..len)
        .map(|i| ((key.0 >> (i % 97)) as u8) ^ (i as u8))
        .collect()
}

/// Stores each key's bytes in host memory and returns pins on them.
fn stored(host: &HostTier, ns: NamespaceFingerprint, keys: &[BlockKey]) -> Vec<PinnedPage> {
    let bl = geo().bytes_per_block_layer();
    keys.iter()
        .map(|&k| {
            let Ok(Reservation::Writer(w)) = host.reserve(ns, k, None) else {
                panic!("reserve {k}")
            };
            let b = bytes_of(k);
            for layer in 0..2 {
                w.write_layer(layer, &b[layer as usize * bl..(layer as usize + 1) * bl])
                    .unwrap();
            }
            w.commit_pinned()
        })
        .collect()
}

/// Stores `keys`' bytes in `h` and writes them to the cluster, waiting until they are there.
fn publish(remote: &RemoteTier, h: &HostTier, ns: NamespaceFingerprint, keys: &[BlockKey]) {
    for p in stored(h, ns, keys) {
        remote.write_behind(ns, p).unwrap();
    }
    assert!(remote.flush(Duration::from_secs(20)));
}

fn config(nodes: &[String]) -> RemoteTierConfig {
    RemoteTierConfig {
        nodes: nodes.to_vec(),
        key_prefix: format!("kvtier-test-{}", std::process::id()),
        ..Default::default()
    }
}

/// Reads `keys` through a fresh host page each; what each read returned.
fn read_back(
    remote: &RemoteTier,
    ns: NamespaceFingerprint,
    keys: &[BlockKey],
) -> Vec<Result<Vec<u8>, StoreError>> {
    let fresh = host();
    let writers = keys
        .iter()
        .map(|&k| match fresh.reserve(ns, k, None) {
            Ok(Reservation::Writer(w)) => w,
            _ => panic!("reserve {k}"),
        })
        .collect();
    let reads = remote.start_reads(ns, writers);
    (0..keys.len())
        .map(|i| {
            let (w, r) = reads.wait(i).expect("the page back");
            assert_eq!(w.key(), keys[i]);
            r?;
            let mut out = vec![0u8; geo().bytes_per_block()];
            fresh
                .region()
                .read(w.layer_range(0).unwrap().0, &mut out)
                .unwrap();
            Ok(out)
        })
        .collect()
}

/// Waits until the tier has loaded the cluster's slot map (its direct reads start then).
fn wait_for_slot_map(remote: &RemoteTier) {
    let direct = remote.inner.direct.as_ref().expect("direct reads without TLS");
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while direct.needs_refresh() {
        assert!(std::time::Instant::now() < until, "no slot map after 10 s");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn blocks_round_trip_bit_exact_and_every_fault_is_a_counted_miss() {
    let cluster = TestCluster::start(&[]);
    let remote = RemoteTier::open(geo(), &config(cluster.nodes())).unwrap();
    assert!(remote.connected());
    let h = host();
    let ks = keys(12, 1);
    publish(&remote, &h, NS, &ks);
    let s = remote.stats();
    assert_eq!((s.written_blocks_total, s.pending_writes), (12, 0));
    assert_eq!(h.stats().pinned_pages, 0, "written pages are unpinned");

    // Found as a run; a gap ends it; another namespace finds nothing.
    assert_eq!(remote.match_run(NS, &ks), 12);
    let mut gap = ks.clone();
    gap.insert(5, BlockKey(42));
    assert_eq!(remote.match_run(NS, &gap), 5);
    assert_eq!(remote.match_run(OTHER, &ks), 0);

    // Bit-exact into fresh host pages, read straight off the masters' sockets once the tier
    // has the slot map.
    wait_for_slot_map(&remote);
    let direct = remote.stats().direct_reads_total;
    for (k, got) in ks.iter().zip(read_back(&remote, NS, &ks)) {
        assert_eq!(got.unwrap(), bytes_of(*k), "block {k}");
    }
    assert_eq!(remote.stats().direct_reads_total, direct + 12);

    // Masters that closed the tier's idle connections: each read reconnects and still reads
    // directly, and no master is given up on.
    let mut killed = 0;
    for n in cluster.nodes() {
        let port: u16 = n.rsplit_once(':').unwrap().1.parse().unwrap();
        let name = format!("name={}", direct_io::CONNECTION_NAME);
        for line in cluster.cli_on(port, &["CLIENT", "LIST"]).lines() {
            if line.split(' ').any(|f| f == name) {
                let id = line.split(' ').find_map(|f| f.strip_prefix("id=")).unwrap();
                cluster.cli_on(port, &["CLIENT", "KILL", "ID", id]);
                killed += 1;
            }
        }
    }
    assert!(killed > 0, "no direct-read connection listed by the masters");
    for (k, got) in ks.iter().zip(read_back(&remote, NS, &ks)) {
        assert_eq!(got.unwrap(), bytes_of(*k), "block {k} after the kill");
    }
    assert_eq!(remote.stats().direct_reads_total, direct + 24);
    assert!(!remote.stats().skipping);
    assert!(matches!(
        read_back(&remote, OTHER, &ks[..1]).pop().unwrap(),
        Err(StoreError::NotFound { tier: "remote", .. })
    ));

    // Another writer's garbage under a kvtier key, and a value of another block copied over
    // this one: both misses, counted as corrupt, never served.
    let name0 = remote_key(&remote.config().key_prefix, NS, ks[0]);
    let name1 = remote_key(&remote.config().key_prefix, NS, ks[1]);
    cluster.cli(&["SET", &name0, "not a kv block"]);
    let v2 = crate::remote_value::encode_value(NS, ks[2], &bytes_of(ks[2]));
    let dump = cluster.cli(&[
        "--no-raw",
        "DUMP",
        &remote_key(&remote.config().key_prefix, NS, ks[2]),
    ]);
    assert!(!dump.is_empty());
    {
        // Write the other block's value under block 1's key with a client of our own.
        let client =
            redis::cluster::ClusterClient::new(cluster.nodes().iter().map(|n| format!("redis://{n}")))
                .unwrap();
        let mut c = client.get_connection().unwrap();
        redis::cmd("SET").arg(&name1).arg(v2).query::<()>(&mut c).unwrap();
    }
    let before = remote.stats().corrupt_total;
    let got = read_back(&remote, NS, &ks[..3]);
    assert!(
        matches!(got[0], Err(StoreError::CorruptBlock { .. })),
        "{:?}",
        got[0].as_ref().err()
    );
    assert!(
        matches!(got[1], Err(StoreError::CorruptBlock { .. })),
        "{:?}",
        got[1].as_ref().err()
    );
    assert_eq!(got[2].as_ref().unwrap(), &bytes_of(ks[2]));
    assert_eq!(remote.stats().corrupt_total, before + 2);

    // The same through the cluster client (a value the direct path gave up on mid-way left
    // its connection closed, and the next reads still find every block).
    let direct = remote.stats().direct_reads_total;
    let mut through_client = RemoteTier::open(geo(), &config(cluster.nodes())).unwrap();
    Arc::get_mut(&mut through_client.inner)
        .expect("one handle")
        .direct = None;
    let got = read_back(&through_client, NS, &ks[..4]);
    assert!(matches!(got[0], Err(StoreError::CorruptBlock { .. })));
    assert!(matches!(got[1], Err(StoreError::CorruptBlock { .. })));
    assert_eq!(got[2].as_ref().unwrap(), &bytes_of(ks[2]));
    assert_eq!(got[3].as_ref().unwrap(), &bytes_of(ks[3]));
    assert_eq!(through_client.stats().direct_reads_total, 0);
    assert_eq!(through_client.stats().corrupt_total, 2);
    let got = read_back(&remote, NS, &ks[2..]);
    assert!(
        got.iter()
            .zip(&ks[2..])
            .all(|(g, k)| g.as_ref().unwrap() == &bytes_of(*k))
    );
    assert_eq!(remote.stats().direct_reads_total, direct + 10);

    // Clear by namespace removes this namespace's blocks and nothing else. (The slot map is
    // loaded by now: these writes go straight to the masters' sockets.)
    let other_keys = keys(3, 99);
    let direct = remote.stats().direct_writes_total;
    publish(&remote, &h, OTHER, &other_keys);
    assert_eq!(remote.stats().direct_writes_total, direct + 3);
    for (k, got) in other_keys.iter().zip(read_back(&remote, OTHER, &other_keys)) {
        assert_eq!(got.unwrap(), bytes_of(*k), "block {k} written directly");
    }
    assert_eq!(remote.clear(Some(NS)).unwrap(), 12);
    assert_eq!(remote.match_run(NS, &ks), 0);
    assert_eq!(remote.match_run(OTHER, &other_keys), 3);
    assert_eq!(remote.clear(None).unwrap(), 3);

    // Masters out of memory refuse writes: each is counted once, as dropped for an error.
    for n in cluster.nodes() {
        let port: u16 = n.rsplit_once(':').unwrap().1.parse().unwrap();
        cluster.cli_on(port, &["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
        cluster.cli_on(port, &["CONFIG", "SET", "maxmemory", "1"]);
        cluster.cli_on(port, &["CONFIG", "RESETSTAT"]);
    }
    let refused = keys(2, 7);
    let (written, direct) = (
        remote.stats().written_blocks_total,
        remote.stats().direct_writes_total,
    );
    publish(&remote, &h, NS, &refused);
    let s = remote.stats();
    assert_eq!(s.dropped(DropReason::Error), 2, "{s:?}");
    assert_eq!((s.written_blocks_total, s.direct_writes_total), (written, direct));
    // Each refused SET was sent once: not again through the cluster client.
    let rejected: u64 = cluster
        .nodes()
        .iter()
        .map(|n| {
            let port: u16 = n.rsplit_once(':').unwrap().1.parse().unwrap();
            let info = cluster.cli_on(port, &["INFO", "commandstats"]);
            info.lines()
                .find(|l| l.starts_with("cmdstat_set:"))
                .and_then(|l| l.split(',').find_map(|f| f.strip_prefix("rejected_calls=")))
                .map_or(0, |v| v.trim().parse::<u64>().unwrap())
        })
        .sum();
    assert_eq!(rejected, 2, "refused SETs sent");
}

#[test]
fn a_cluster_down_at_start_is_served_without_and_wrong_bad_config_is_named() {
    // Nothing listens on the port: the tier opens disconnected, misses and drops by reason.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    let mut cfg = config(&[format!("127.0.0.1:{port}")]);
    cfg.connect_timeout_ms = 300;
    cfg.retry_ms = 100_000;
    let remote = RemoteTier::open(geo(), &cfg).unwrap();
    assert!(!remote.connected());
    let h = host();
    let ks = keys(2, 3);
    assert_eq!(remote.match_run(NS, &ks), 0);
    let p = stored(&h, NS, &ks[..1]).pop().unwrap();
    assert_eq!(remote.write_behind(NS, p), Err(DropReason::Unavailable));
    assert_eq!(remote.stats().dropped(DropReason::Unavailable), 1);
    assert_eq!(h.stats().pinned_pages, 0);
    assert!(matches!(
        read_back(&remote, NS, &ks[1..]).pop().unwrap(),
        Err(StoreError::NotFound { .. })
    ));

    for (cfg, needle) in [
        (RemoteTierConfig::default(), "remote.nodes is empty"),
        (config(&["localhost".into()]), "is not host:port"),
        (
            RemoteTierConfig {
                read_concurrency: 0,
                ..config(&["h:1".into()])
            },
            "remote.read_concurrency = 0",
        ),
        (
            RemoteTierConfig {
                key_prefix: "a b".into(),
                ..config(&["h:1".into()])
            },
            "remote.key_prefix",
        ),
    ] {
        let e = RemoteTier::open(geo(), &cfg).unwrap_err().to_string();
        assert!(e.contains(needle), "{e}");
    }
}

#[test]
fn wrong_credentials_are_an_error_at_start_and_right_ones_connect() {
    let cluster = TestCluster::start(&["--password", "s3cret-pass"]);
    let mut cfg = config(cluster.nodes());
    cfg.password = Some(Secret::new("wrong"));
    let e = RemoteTier::open(geo(), &cfg).unwrap_err();
    assert!(matches!(e, StoreError::RemoteAuth { .. }), "{e}");
    assert!(e.to_string().contains("remote.password"), "{e}");
    cfg.password = Some(Secret::new("s3cret-pass"));
    let remote = RemoteTier::open(geo(), &cfg).unwrap();
    assert!(remote.connected());
    let h = host();
    let ks = keys(2, 5);
    publish(&remote, &h, NS, &ks);
    assert_eq!(remote.match_run(NS, &ks), 2);
    // Direct reads and writes sign in with the same credentials.
    wait_for_slot_map(&remote);
    let more = keys(2, 6);
    let before = remote.stats().direct_writes_total;
    publish(&remote, &h, NS, &more);
    assert_eq!(remote.stats().direct_writes_total, before + 2);
    assert_eq!(remote.match_run(NS, &more), 2);
    for (k, got) in ks.iter().zip(read_back(&remote, NS, &ks)) {
        assert_eq!(got.unwrap(), bytes_of(*k), "block {k}");
    }
    assert_eq!(remote.stats().direct_reads_total, 2);
}

/// Sends SIGCONT to the stopped node when dropped, whatever the test did meanwhile.
struct Stopped(i32);

impl Drop for Stopped {
    fn drop(&mut self) {
        // SAFETY: kill(2) with a pid and a signal number; no memory is involved.
        unsafe { libc::kill(self.0, libc::SIGCONT) };
    }
}

#[test]
fn a_master_that_stops_answering_costs_one_timeout_then_the_tier_is_skipped_until_retry() {
    let cluster = TestCluster::start(&[]);
    let mut cfg = config(cluster.nodes());
    cfg.timeout_ms = 300;
    cfg.retry_ms = 500;
    let remote = RemoteTier::open(geo(), &cfg).unwrap();
    let h = host();
    let ks = keys(12, 7);
    publish(&remote, &h, NS, &ks);
    let port = cluster.master_of(&remote_key(&cfg.key_prefix, NS, ks[0]));
    let pid = cluster.pid(port).expect("the master's pid") as i32;
    // SAFETY: kill(2) with a pid and a signal number; no memory is involved.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let stopped = Stopped(pid);

    // The blocks on the stopped master time out (bounded, counted); the others verify; no
    // read returns wrong bytes.
    let got = read_back(&remote, NS, &ks);
    assert!(
        matches!(got[0], Err(StoreError::Remote { .. })),
        "{:?}",
        got[0].as_ref().err()
    );
    for (k, g) in ks.iter().zip(&got) {
        if let Ok(bytes) = g {
            assert_eq!(bytes, &bytes_of(*k));
        }
    }
    let s = remote.stats();
    assert!(
        s.read_timeouts_total >= 1 && s.skipping && s.skipped_total >= 1,
        "{s:?}"
    );
    // Skipped now: no lookup, no fetch, writes dropped as unavailable.
    assert!(!remote.available());
    assert_eq!(remote.match_run(NS, &ks), 0);
    assert_eq!(remote.stats().lookup_errors_total, 0, "a skipped tier was asked");
    let p = stored(&h, NS, &keys(1, 99)).pop().unwrap();
    assert_eq!(remote.write_behind(NS, p), Err(DropReason::Unavailable));

    drop(stopped);
    // After the retry interval the tier is asked again and serves every block.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        std::thread::sleep(Duration::from_millis(100));
        if remote.available() && read_back(&remote, NS, &ks).iter().all(Result::is_ok) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the tier never served again: {:?}",
            remote.stats()
        );
    }
    assert_eq!(remote.match_run(NS, &ks), 12);
}

#[test]
fn a_tls_cluster_is_reached_with_its_ca_and_refused_without_it() {
    let tls = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/tls");
    let cluster = TestCluster::start(&["--tls", tls.to_str().unwrap()]);
    let mut cfg = config(cluster.nodes());
    cfg.tls = true;
    cfg.connect_timeout_ms = 1000;
    // The system's roots do not know the test CA: a configuration error at start.
    let e = RemoteTier::open(geo(), &cfg).unwrap_err().to_string();
    assert!(e.contains("remote.tls_ca_file"), "{e}");
    cfg.tls_ca_file = Some(tls.join("redis-ca.pem"));
    let remote = RemoteTier::open(geo(), &cfg).unwrap();
    assert!(remote.connected());
    let h = host();
    let ks = keys(6, 11);
    publish(&remote, &h, NS, &ks);
    assert_eq!(remote.match_run(NS, &ks), 6);
    for (k, got) in ks.iter().zip(read_back(&remote, NS, &ks)) {
        assert_eq!(got.unwrap(), bytes_of(*k));
    }
    // A CA file without TLS is refused by name.
    cfg.tls = false;
    let e = RemoteTier::open(geo(), &cfg).unwrap_err().to_string();
    assert!(e.contains("remote.tls = false"), "{e}");
}

#[test]
fn a_cluster_that_comes_up_after_the_tier_opened_is_connected_by_the_retries() {
    // A free base below the ephemeral range (the script's own choice is random; here the tier
    // must know the ports before the cluster exists).
    let free = |p: u16| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok();
    let base = (16_000u16..17_000)
        .step_by(10)
        .find(|&b| (b..b + 6).all(|p| free(p) && free(p + 10_000)))
        .expect("a free port base");
    let mut cfg = config(&[format!("127.0.0.1:{base}")]);
    cfg.connect_timeout_ms = 300;
    cfg.retry_ms = 200;
    let remote = RemoteTier::open(geo(), &cfg).unwrap();
    assert!(!remote.connected(), "nothing listens yet");
    let cluster = TestCluster::start(&["--port-base", &base.to_string()]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !remote.connected() {
        assert!(Instant::now() < deadline, "the retries never connected");
        std::thread::sleep(Duration::from_millis(50));
    }
    let h = host();
    let ks = keys(4, 21);
    publish(&remote, &h, NS, &ks);
    assert_eq!(remote.match_run(NS, &ks), 4);
    drop(cluster);
}
