//! Block-key hashing throughput, in bytes of token ids hashed per second (target ≥ 5 GiB/s).

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvtier_core::{BlockHasher, Dtype, KvGeometry, Namespace};

fn block_keys(c: &mut Criterion) {
    let mut group = c.benchmark_group("block_keys");
    for block_tokens in [16u32, 64, 256] {
        let geometry = KvGeometry::new(48, 4, 128, Dtype::Bf16, block_tokens).expect("valid geometry");
        let ns = Namespace::single("Qwen/Qwen3-30B-A3B", geometry).expect("valid namespace");
        let mut hasher = BlockHasher::new(ns.fingerprint(), block_tokens);
        // A 10,000-token prompt, as in the seed experiment.
        let tokens: Vec<u32> = (0..10_000u32)
            .map(|t| t.wrapping_mul(2_654_435_761) % 151_936)
            .collect();
        let hashed = tokens.len() / block_tokens as usize * block_tokens as usize;
        group.throughput(Throughput::Bytes((hashed * 4) as u64));
        let mut out = Vec::with_capacity(tokens.len());
        group.bench_function(format!("block_tokens={block_tokens}"), |b| {
            b.iter(|| {
                out.clear();
                hasher.extend_keys(None, black_box(&tokens), &mut out);
                black_box(out.len())
            })
        });
    }
    group.finish();
}

criterion_group!(benches, block_keys);
criterion_main!(benches);
