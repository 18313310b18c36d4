//! Criterion benches of the index: event ingest and hint queries.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvroute_sidecar::RadixIndex;

#[path = "fleet.rs"]
mod fleet;

const WORKERS: u32 = 64;

fn build(sequences: u64) -> RadixIndex {
    let mut index = RadixIndex::default();
    for seq in 0..sequences {
        for copy in 0..2 {
            let w = fleet::placement(seq, copy, WORKERS);
            for e in fleet::events(seq, w) {
                index.apply(w, &e);
            }
        }
    }
    index
}

fn ingest(c: &mut Criterion) {
    let events: Vec<_> = (0..64u64)
        .flat_map(|seq| {
            let w = fleet::placement(seq, 0, WORKERS);
            fleet::events(seq, w).into_iter().map(move |e| (w, e))
        })
        .collect();
    let mut group = c.benchmark_group("ingest");
    group.throughput(Throughput::Elements(64 * fleet::SEQ_BLOCKS as u64));
    group.bench_function("64 sequences x 512 blocks", |b| {
        b.iter(|| {
            let mut index = RadixIndex::default();
            for (w, e) in &events {
                index.apply(*w, e);
            }
            index
        })
    });
    group.finish();
}

fn query(c: &mut Criterion) {
    let sequences = 1024; // ~1M (block, worker) entries
    let index = build(sequences);
    let hit = fleet::query(7);
    let miss = fleet::query_new_in_group(7);
    let mut group = c.benchmark_group("query 512 blocks, 1M entries");
    group.bench_function("full match", |b| b.iter(|| index.find_matches(&hit, 3)));
    group.bench_function("shared prefix only", |b| {
        b.iter(|| index.find_matches(&miss, 3))
    });
    group.finish();
}

criterion_group!(benches, ingest, query);
criterion_main!(benches);
