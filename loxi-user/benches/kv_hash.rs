//! Block hashing throughput per core for each contract (`sha256_cbor`, `xxhash_cbor`,
//! `sha256_sglang`): single blocks (16 and 32 tokens) and a 32k-token prompt end to end
//! (`BlockHasher::keys`, block size 16 → 2,048 blocks).
//!
//! `cargo bench -p loxi-user --bench kv_hash -- --warm-up-time 1 --measurement-time 3`
// `criterion_group!` generates an undocumented `pub fn`.
#![allow(
    missing_docs,
    reason = "criterion_group! generates an undocumented pub fn"
)]

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use loxi_user::kv::block_hash::{BlockHasher, HashAlgo, RequestExtras};

const ALGOS: [HashAlgo; 3] = [
    HashAlgo::Sha256Cbor,
    HashAlgo::XxhashCbor,
    HashAlgo::Sha256Sglang,
];

/// Deterministic pseudo-random token ids below a 150k vocabulary (mixed CBOR widths).
fn tokens(n: usize) -> Vec<u32> {
    let mut x = 0x9e37_79b9_u32;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x % 150_000
        })
        .collect()
}

fn single_block(c: &mut Criterion) {
    let mut g = c.benchmark_group("hash_block");
    for bs in [16usize, 32] {
        let toks = tokens(bs);
        g.throughput(Throughput::Elements(1));
        for algo in ALGOS {
            let h = BlockHasher::new(algo, Some("0"));
            let parent = *h.none_hash();
            g.bench_with_input(BenchmarkId::new(algo.as_str(), bs), &toks, |b, t| {
                b.iter(|| h.hash_block(black_box(&parent), black_box(t), &[]))
            });
        }
    }
    g.finish();
}

fn prompt_32k(c: &mut Criterion) {
    let mut g = c.benchmark_group("keys_32k_tokens_bs16");
    let toks = tokens(32 * 1024);
    g.throughput(Throughput::Elements((toks.len() / 16) as u64));
    for algo in ALGOS {
        let h = BlockHasher::new(algo, Some("0"));
        let extras = RequestExtras::default();
        g.bench_function(algo.as_str(), |b| {
            b.iter(|| h.keys(black_box(&toks), 16, &extras))
        });
    }
    g.finish();
}

criterion_group!(benches, single_block, prompt_32k);
criterion_main!(benches);
