//! `HostTier::match_prefix` throughput on one thread, in matched blocks per second
//! (target ≥ 5 M/s).

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvtier_core::{BlockHasher, ByteSize, Dtype, KvGeometry, Namespace};
use kvtier_store::{EvictionKind, HostTier, HostTierConfig, Reservation};

fn match_prefix(c: &mut Criterion) {
    let mut group = c.benchmark_group("match_prefix");
    // Small blocks keep the arena small; matching cost does not depend on block bytes.
    let geometry = KvGeometry::new(1, 1, 8, Dtype::Bf16, 64).expect("valid geometry");
    let ns = Namespace::single("bench", geometry)
        .expect("valid namespace")
        .fingerprint();
    let sequences = 64usize;
    let blocks = 156usize; // a 10,000-token prompt in blocks of 64
    for eviction in [EvictionKind::S3fifo, EvictionKind::Lru] {
        let tier = HostTier::new(
            geometry,
            &HostTierConfig {
                capacity: ByteSize((sequences * blocks * 4096) as u64),
                eviction,
                ..HostTierConfig::default()
            },
        )
        .expect("host tier");
        let mut hasher = BlockHasher::new(ns, 64);
        let chains: Vec<_> = (0..sequences as u32)
            .map(|s| {
                let tokens: Vec<u32> = (0..(blocks * 64) as u32).map(|t| t ^ (s << 20)).collect();
                let keys = hasher.keys(&tokens);
                let mut parent = None;
                for &k in &keys {
                    if let Ok(Reservation::Writer(w)) = tier.reserve(ns, k, parent) {
                        w.commit();
                    }
                    parent = Some(k);
                }
                keys
            })
            .collect();
        group.throughput(Throughput::Elements(blocks as u64));
        let mut i = 0;
        group.bench_function(format!("{eviction:?}/156_of_156_blocks"), |b| {
            b.iter(|| {
                i = (i + 1) % sequences;
                let m = tier.match_prefix(ns, black_box(&chains[i]));
                assert_eq!(m.len(), blocks);
                m.len()
            })
        });
    }
    group.finish();
}

criterion_group!(benches, match_prefix);
criterion_main!(benches);
