//! The remote tier across processes, against a real Redis Cluster started by
//! scripts/redis_cluster.sh: a prefix stored through sidecar A loads bit-exact through sidecar
//! B (another process with its own host tier); a master killed during loads serves no wrong
//! byte and reports every block it could not serve; a value overwritten with garbage is a
//! counted miss.

use std::time::{Duration, Instant};

use kvtier_client::{Client, PoolHandle};
use kvtier_core::{Dtype, KvGeometry, Tier};
use kvtier_store::remote_value::remote_key;
use kvtier_store::test_cluster::TestCluster;
use kvtier_transfer::CpuDevicePool;
use kvtier_transfer::test_util::{first_wrong_kv_slot, write_kv_slots};

#[path = "common/process.rs"]
mod process;

use process::Kvtier;

/// 8 layers of 8 KiB block-layers: 64 KiB per block.
fn geometry() -> KvGeometry {
    KvGeometry::new(8, 2, 64, Dtype::Bf16, 16).unwrap()
}

const MODEL: &str = "remote-test";

/// A sidecar on `socket` with a host tier of its own and the cluster as its remote tier,
/// writing every stored block there.
fn sidecar(socket: &std::path::Path, nodes: &str) -> Kvtier {
    let g = geometry();
    let sets = [
        format!("model.layers={}", g.layers()),
        format!("model.kv_heads={}", g.kv_heads()),
        format!("model.head_dim={}", g.head_dim()),
        format!("model.block_tokens={}", g.block_tokens()),
        "server.metrics=off".to_owned(),
        format!("remote.nodes={nodes}"),
        "remote.write_policy=all".to_owned(),
        "remote.timeout_ms=1000".to_owned(),
    ];
    let mut args = vec![
        "serve".to_owned(),
        "--socket".to_owned(),
        socket.display().to_string(),
    ];
    args.extend(["--host-capacity".to_owned(), "64MiB".to_owned()]);
    for s in sets {
        args.extend(["--set".to_owned(), s]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Kvtier::spawn_until(&args, "kvtier: serving")
}

/// A client with a pool of `slots` slots registered for [`MODEL`].
async fn engine(
    socket: &std::path::Path,
    dir: &std::path::Path,
    name: &str,
    slots: u32,
) -> (Client, CpuDevicePool, PoolHandle) {
    let mut c = Client::connect(&format!("unix://{}", socket.display()), name)
        .await
        .unwrap();
    let pool = CpuDevicePool::create(Some(&dir.join(format!("{name}-pool"))), geometry(), slots).unwrap();
    let h = c.register_cpu_pool(&pool, MODEL, 0, 1).await.unwrap();
    (c, pool, h)
}

/// The remote tier's counters from a sidecar's Stats.
async fn remote_stats(c: &mut Client) -> serde_json::Value {
    let s = c.stats().await.unwrap();
    let v: serde_json::Value = serde_json::from_str(&s.json).unwrap();
    v["tiers"]["remote"].clone()
}

/// Stores `n` blocks of a sequence through `c` (slots 0..n) and waits until the sidecar has
/// written them all to the cluster. Returns the tokens and keys.
async fn store_and_publish(
    c: &mut Client,
    pool: &CpuDevicePool,
    h: &PoolHandle,
    n: u32,
    seed: u32,
) -> (Vec<u32>, Vec<kvtier_core::BlockKey>) {
    let tokens: Vec<u32> = (0..n * 16)
        .map(|t| t.wrapping_mul(7).wrapping_add(seed))
        .collect();
    let keys = h.keys("", &tokens).unwrap();
    write_kv_slots(pool, &keys, 0);
    let run: Vec<_> = keys.iter().enumerate().map(|(i, &k)| (k, i as u32)).collect();
    assert_eq!(c.store(h, "", None, &run).await.unwrap().stored_blocks, n);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = remote_stats(c).await;
        if r["pending_writes"] == 0 && r["written_blocks_total"].as_u64().unwrap() >= u64::from(n) {
            break;
        }
        assert!(Instant::now() < deadline, "not written to the cluster: {r}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (tokens, keys)
}

/// Whether slot `slot` holds block `key`'s bytes in every layer.
fn holds(pool: &CpuDevicePool, slot: u32, key: kvtier_core::BlockKey) -> bool {
    first_wrong_kv_slot(pool, &[key], slot).is_none()
}

/// Whether slot `slot` still holds the scrub pattern in every layer (nothing was written).
fn untouched(pool: &CpuDevicePool, slot: u32) -> bool {
    let g = geometry();
    let mut buf = vec![0u8; g.bytes_per_block_layer()];
    (0..g.layers()).all(|layer| {
        pool.read_slot_layer(slot, layer, &mut buf).unwrap();
        buf.iter().all(|&b| b == 0xee)
    })
}

fn scrub(pool: &CpuDevicePool, slots: std::ops::Range<u32>) {
    let g = geometry();
    let junk = vec![0xeeu8; g.bytes_per_block_layer()];
    for s in slots {
        for layer in 0..g.layers() {
            pool.write_slot_layer(s, layer, &junk).unwrap();
        }
    }
}

/// A cluster and two sidecars on it (nodes A and B), each a process with its own host tier.
struct Fleet {
    cluster: TestCluster,
    dir: tempfile::TempDir,
    _sidecars: (Kvtier, Kvtier),
}

impl Fleet {
    fn start() -> Self {
        let cluster = TestCluster::start(&[]);
        let nodes = cluster.nodes().join(",");
        let dir = tempfile::tempdir().unwrap();
        let sidecars = (
            sidecar(&dir.path().join("a.sock"), &nodes),
            sidecar(&dir.path().join("b.sock"), &nodes),
        );
        Self {
            cluster,
            dir,
            _sidecars: sidecars,
        }
    }

    /// An engine on node A or B with a pool of `slots` slots.
    async fn engine(&self, node: &str, slots: u32) -> (Client, CpuDevicePool, PoolHandle) {
        let socket = self.dir.path().join(format!("{node}.sock"));
        engine(&socket, self.dir.path(), &format!("node-{node}"), slots).await
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn a_prefix_stored_on_one_node_is_a_remote_hit_on_another_and_loads_bit_exact() {
    let fleet = Fleet::start();
    runtime().block_on(async {
        let (mut a, pool_a, ha) = fleet.engine("a", 64).await;
        let (tokens, keys) = store_and_publish(&mut a, &pool_a, &ha, 24, 1).await;

        let (mut b, pool_b, hb) = fleet.engine("b", 64).await;
        let m = b.match_tokens(&hb, "", &tokens).await.unwrap();
        assert_eq!(m.tiers().collect::<Vec<_>>(), vec![Tier::Remote; 24]);
        assert_eq!((m.remote_tokens, m.host_tokens), (24 * 16, 0));
        // A salted tenant on node B sees none of it.
        assert_eq!(
            b.match_tokens(&hb, "other-tenant", &tokens)
                .await
                .unwrap()
                .matched_tokens,
            0
        );

        scrub(&pool_b, 32..56);
        let run: Vec<_> = keys
            .iter()
            .enumerate()
            .map(|(i, &k)| (k, 32 + i as u32))
            .collect();
        let out = b.load_all(&hb, "", &run, None).await.unwrap();
        assert!(out.done.missing.is_empty(), "{:?}", out.done.missing);
        assert_eq!((out.done.loaded_blocks, out.done.remote_blocks), (24, 24));
        for (i, &k) in keys.iter().enumerate() {
            assert!(holds(&pool_b, 32 + i as u32, k), "block {i} differs on node B");
        }
        // Now in node B's host memory too.
        let m = b.match_tokens(&hb, "", &tokens).await.unwrap();
        assert_eq!(m.host_tokens, 24 * 16);
        let r = remote_stats(&mut b).await;
        assert_eq!(
            (r["hits_total"].as_u64(), r["corrupt_total"].as_u64()),
            (Some(24), Some(0))
        );
        let s: serde_json::Value = serde_json::from_str(&b.stats().await.unwrap().json).unwrap();
        assert_eq!(s["routes"]["remote_to_host"]["blocks_total"], 24);
        let s: serde_json::Value = serde_json::from_str(&a.stats().await.unwrap().json).unwrap();
        assert_eq!(s["routes"]["host_to_remote"]["blocks_total"], 24);
        // A clear of every tier leaves the fleet's; naming it removes the prefix for every node.
        assert_eq!(a.clear(&ha, "", false, None).await.unwrap().remote_blocks, 0);
        assert_eq!(
            b.clear(&hb, "", false, Some(Tier::Remote))
                .await
                .unwrap()
                .remote_blocks,
            24
        );
        a.clear(&ha, "", false, Some(Tier::Host)).await.unwrap();
        assert_eq!(a.match_tokens(&ha, "", &tokens).await.unwrap().matched_tokens, 0);
    });
}

#[test]
fn a_value_overwritten_with_garbage_is_a_counted_miss_and_the_rest_loads() {
    let fleet = Fleet::start();
    runtime().block_on(async {
        let (mut a, pool_a, ha) = fleet.engine("a", 16).await;
        let (_, keys) = store_and_publish(&mut a, &pool_a, &ha, 8, 2).await;
        let ns = ha.namespace("").unwrap();
        fleet.cluster.cli(&[
            "SET",
            &remote_key("kvtier", ns, keys[3]),
            "written by someone else",
        ]);

        let (mut b, pool_b, hb) = fleet.engine("b", 16).await;
        scrub(&pool_b, 0..8);
        let run: Vec<_> = keys.iter().enumerate().map(|(i, &k)| (k, i as u32)).collect();
        let out = b.load_all(&hb, "", &run, None).await.unwrap();
        assert_eq!(out.done.missing, vec![keys[3]]);
        assert_eq!(out.done.loaded_blocks, 7);
        for (i, &k) in keys.iter().enumerate() {
            if i == 3 {
                assert!(untouched(&pool_b, 3), "the corrupt block's slot was written");
            } else {
                assert!(holds(&pool_b, i as u32, k), "block {i} differs");
            }
        }
        let r = remote_stats(&mut b).await;
        assert_eq!(r["corrupt_total"], 1, "{r}");
    });
}

#[test]
fn a_master_killed_during_loads_serves_no_wrong_byte_and_reports_what_it_lost() {
    let fleet = Fleet::start();
    runtime().block_on(async {
        let n = 48u32;
        let (mut a, pool_a, ha) = fleet.engine("a", n).await;
        let (_, keys) = store_and_publish(&mut a, &pool_a, &ha, n, 3).await;

        let (mut b, pool_b, hb) = fleet.engine("b", n).await;
        let run: Vec<_> = keys.iter().enumerate().map(|(i, &k)| (k, i as u32)).collect();
        let victim: u16 = fleet.cluster.nodes()[1].rsplit_once(':').unwrap().1.parse().unwrap();
        let pid = fleet.cluster.pid(victim).expect("the victim's pid");
        // Redis replicates asynchronously: a write the victim acknowledged but had not yet sent
        // to its replica is lost with it, and the prefix could never load whole again.
        assert!(
            fleet.cluster.wait_replicated(victim, Duration::from_secs(20)),
            "the victim's replica never caught up"
        );
        let (mut loads, mut partial, mut lost_blocks) = (0u32, 0u32, 0usize);
        let started = Instant::now();
        let mut killed_at = None;
        let mut whole_after_kill = false;
        while started.elapsed() < Duration::from_secs(40) {
            if killed_at.is_none() && loads >= 3 {
                // SIGKILL: the master vanishes mid-stream, as in a crash.
                // SAFETY: kill(2) with a pid and a signal number; no memory is involved.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
                killed_at = Some(Instant::now());
            }
            b.clear(&hb, "", false, Some(Tier::Host)).await.unwrap();
            scrub(&pool_b, 0..n);
            let out = b.load_all(&hb, "", &run, Some(Duration::from_secs(10))).await.unwrap();
            loads += 1;
            let missing: std::collections::HashSet<_> = out.done.missing.iter().copied().collect();
            for (i, &k) in keys.iter().enumerate() {
                if missing.contains(&k) {
                    assert!(untouched(&pool_b, i as u32), "load {loads}: missing block {i}'s slot was written");
                } else {
                    assert!(holds(&pool_b, i as u32, k), "load {loads}: block {i} has wrong bytes");
                }
            }
            assert_eq!(out.done.loaded_blocks as usize + missing.len(), keys.len());
            if !missing.is_empty() {
                partial += 1;
                lost_blocks += missing.len();
            }
            if let Some(t) = killed_at
                && missing.is_empty()
                && t.elapsed() > Duration::from_secs(1)
            {
                // The replica took over: the whole prefix loads again.
                whole_after_kill = true;
                break;
            }
        }
        assert!(killed_at.is_some(), "the master was killed");
        assert!(
            whole_after_kill,
            "after {loads} loads ({partial} partial, {lost_blocks} blocks reported missing) the prefix never loaded whole again"
        );
        // Reads went straight to the masters' sockets before the kill (and back to the
        // cluster client where a socket broke).
        let direct = remote_stats(&mut b).await["direct_reads_total"].as_u64().unwrap();
        assert!(direct > 0, "no read went straight to a master");
        eprintln!(
            "failover: {loads} loads, {partial} partial, {lost_blocks} blocks reported missing, 0 wrong bytes; {direct} direct reads"
        );
    });
}
