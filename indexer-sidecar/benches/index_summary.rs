//! `make bench-index`: the index at 1M and 10M (block, worker) entries over 64 workers.
//!
//! Measures single-core ingest (blocks/s), hint-query latency for 512-block prompts (p50/p99),
//! and heap bytes per entry, read from a counting global allocator (not estimated).
//! Writes `target/bench/index.json` with the 10M figures (and the 1M ones under `"1M"`).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use kvroute_sidecar::RadixIndex;

#[path = "fleet.rs"]
mod fleet;

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator and only counts sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size, Ordering::Relaxed);
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const WORKERS: u32 = 64;
const COPIES: u64 = 2;

fn quantile(sorted: &[f64], q: f64) -> f64 {
    sorted[((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1]
}

fn run(entries: u64) -> serde_json::Value {
    let sequences = entries / (COPIES * fleet::SEQ_BLOCKS as u64);
    // Events are generated up front so only `apply` is timed.
    let events: Vec<_> = (0..sequences)
        .flat_map(|seq| {
            (0..COPIES).flat_map(move |copy| {
                let w = fleet::placement(seq, copy, WORKERS);
                fleet::events(seq, w).into_iter().map(move |e| (w, e))
            })
        })
        .collect();
    let before = LIVE.load(Ordering::Relaxed);
    let mut index = RadixIndex::default();
    let start = Instant::now();
    for (w, e) in &events {
        index.apply(*w, e);
    }
    let ingest = start.elapsed();
    let bytes = LIVE.load(Ordering::Relaxed) - before;
    let indexed = sequences * COPIES * fleet::SEQ_BLOCKS as u64;
    drop(events);

    let queries: Vec<_> = (0..2000u64)
        .map(|i| {
            let seq = (i * 7919) % sequences;
            if i % 2 == 0 {
                fleet::query(seq)
            } else {
                fleet::query_new_in_group(seq)
            }
        })
        .collect();
    let mut micros = Vec::with_capacity(queries.len() * 5);
    for _ in 0..5 {
        for q in &queries {
            let t = Instant::now();
            std::hint::black_box(index.find_matches(std::hint::black_box(q), 3));
            micros.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    micros.sort_by(f64::total_cmp);
    let out = serde_json::json!({
        "ingest_blocks_per_s": indexed as f64 / ingest.as_secs_f64(),
        "query_p50_us": quantile(&micros, 0.5),
        "query_p99_us": quantile(&micros, 0.99),
        "bytes_per_entry": bytes as f64 / indexed as f64,
        "indexed_blocks": indexed,
        "distinct_prefixes": index.len(),
        "workers": WORKERS,
        "query_blocks": fleet::SEQ_BLOCKS,
    });
    println!("{entries:>9} entries: {out}");
    out
}

fn main() {
    // `cargo bench` passes `--bench`; under `cargo test` this is a smoke run on a tiny index.
    let full = std::env::args().any(|a| a == "--bench");
    let (sizes, dir) = if full {
        ((1_000_000, 10_000_000), "../target/bench")
    } else {
        ((20_480, 40_960), "../target/bench-smoke")
    };
    let small = run(sizes.0);
    let mut big = run(sizes.1);
    for v in [&small, &big] {
        for key in [
            "ingest_blocks_per_s",
            "query_p50_us",
            "query_p99_us",
            "bytes_per_entry",
        ] {
            assert!(v[key].as_f64().is_some_and(|x| x > 0.0), "{key}: {v}");
        }
    }
    big["1M"] = small;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
    std::fs::create_dir_all(&dir).expect("target/bench");
    let path = dir.join("index.json");
    std::fs::write(&path, serde_json::to_string_pretty(&big).expect("json")).expect("write");
    println!("written to {}", path.display());
}
