//! `make bench-hint`: hint latency (p50/p99/p99.9) while one thread ingests KV events, against
//! the same hints with no ingest, in one run.
//!
//! The sidecar is the real one ([`Sidecar::ingest`] and [`Sidecar::hint`], metrics and all,
//! minus HTTP): 8 workers of one model, each holding 256 prompts of 32 blocks. The ingest
//! thread stores a new 32-block prompt on a worker and removes that worker's oldest one, as
//! Dynamo events (16 blocks a message), paced to `--rate` stored blocks per second (default
//! 1,000,000 stored and as many removed); it reports the rate it reached. The hint thread asks
//! for resident prompts, reporting each ticket back with the next request, as the filter does.
//! Writes `target/bench/hint_under_ingest.json`.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_protocol::dynamo::{
    KvCacheEvent, KvCacheEventData, RemovedBlocks, RouterEvent, StoredBlock, StoredBlocks,
};
use kvroute_protocol::hash::prefix_hashes;
use kvroute_protocol::hint::{Finished, HintRequest, Usage};
use kvroute_protocol::LocalBlockHash;
use kvroute_sidecar::config::Config;
use kvroute_sidecar::core::{Input, Message};
use kvroute_sidecar::sidecar::{Sidecar, SourceRef};

const WORKERS: u64 = 8;
const RESIDENT: u64 = 256;
const PROMPT_BLOCKS: u64 = 32;
const CHUNK: u64 = 16;
const HINT_SECONDS: f64 = 3.0;

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The tokens hashes of prompt `p`.
fn locals(p: u64) -> Vec<LocalBlockHash> {
    (0..PROMPT_BLOCKS)
        .map(|i| LocalBlockHash(mix(p << 16 | i)))
        .collect()
}

/// The engine's name for block `i` of prompt `p` on worker `w`.
fn engine_hash(w: u64, p: u64, i: u64) -> u64 {
    mix(mix(w + 1) ^ p << 16 ^ i)
}

/// Prompt number `n` of worker `w`, globally unique.
fn prompt(w: u64, n: u64) -> u64 {
    n * WORKERS + w
}

struct Publisher {
    worker: u64,
    event_id: u64,
}

impl Publisher {
    fn event(&mut self, data: KvCacheEventData) -> RouterEvent {
        self.event_id += 1;
        RouterEvent {
            worker_id: 1000 + self.worker,
            storage_tier: "device".into(),
            residency_domain: None,
            event: KvCacheEvent {
                event_id: self.event_id,
                data,
                dp_rank: 0,
            },
        }
    }

    /// The messages storing prompt `p`, 16 blocks each, chained.
    fn store(&mut self, p: u64) -> Vec<RouterEvent> {
        let locals = locals(p);
        (0..PROMPT_BLOCKS / CHUNK)
            .map(|c| {
                let range = c * CHUNK..(c + 1) * CHUNK;
                let data = KvCacheEventData::Stored(StoredBlocks {
                    parent_hash: (c > 0).then(|| engine_hash(self.worker, p, c * CHUNK - 1)),
                    start_position: None,
                    blocks: range
                        .map(|i| StoredBlock {
                            block_hash: engine_hash(self.worker, p, i),
                            tokens_hash: locals[i as usize].0,
                            mm_extra_info: None,
                        })
                        .collect(),
                });
                self.event(data)
            })
            .collect()
    }

    /// The messages removing prompt `p`, tail first, 16 blocks each.
    fn remove(&mut self, p: u64) -> Vec<RouterEvent> {
        (0..PROMPT_BLOCKS / CHUNK)
            .rev()
            .map(|c| {
                let data = KvCacheEventData::Removed(RemovedBlocks {
                    block_hashes: (c * CHUNK..(c + 1) * CHUNK)
                        .rev()
                        .map(|i| engine_hash(self.worker, p, i))
                        .collect(),
                });
                self.event(data)
            })
            .collect()
    }
}

fn sidecar() -> Sidecar {
    let model = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/models/tiny-llama");
    let mut text = format!("[[models]]\nname = \"m\"\ndir = \"{model}\"\nblock_size = 16\n");
    for w in 0..WORKERS {
        text += &format!(
            "[[workers]]\naddress = \"127.0.0.1:{}\"\nmodel = \"m\"\ndynamo_worker_id = {}\n",
            9000 + w,
            1000 + w
        );
    }
    let config: Config = toml::from_str(&text).expect("bench config");
    Sidecar::from_config(&config).expect("bench sidecar")
}

const SOURCE: SourceRef<'static> = SourceRef {
    index: 0,
    subject: "namespace.bench.component.backend.kv-events",
};

fn ingest(sidecar: &Sidecar, events: &[RouterEvent]) {
    let now = Instant::now();
    for e in events {
        sidecar.ingest(Some(SOURCE), Input::Message(Message::dynamo(e, None)), now);
    }
}

/// Latencies of hints for resident prompts for `seconds`, in microseconds, sorted.
fn hints(sidecar: &Sidecar, resident: &[AtomicU64], seconds: f64) -> Vec<f64> {
    let mut out = Vec::new();
    let mut finished = Vec::new();
    let start = Instant::now();
    let mut i = 0u64;
    while start.elapsed().as_secs_f64() < seconds {
        let w = i % WORKERS;
        // A prompt the worker holds: its newest stored one.
        let n = resident[w as usize].load(Ordering::Relaxed);
        let req = HintRequest {
            model: "m".into(),
            hashes: prefix_hashes(&locals(prompt(w, n))),
            finished: std::mem::take(&mut finished),
        };
        let t = Instant::now();
        let resp = sidecar.hint(&req, None, Instant::now());
        out.push(t.elapsed().as_secs_f64() * 1e6);
        finished.extend(resp.and_then(|r| r.ticket).map(|ticket| Finished {
            ticket,
            usage: Usage::Missing,
        }));
        i += 1;
    }
    out.sort_by(f64::total_cmp);
    out
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn summary(name: &str, sorted: &[f64]) -> serde_json::Value {
    println!(
        "{name:>14}: {:>8} hints  p50 {:6.1} µs  p99 {:6.1} µs  p99.9 {:7.1} µs  max {:8.1} µs",
        sorted.len(),
        pct(sorted, 0.5),
        pct(sorted, 0.99),
        pct(sorted, 0.999),
        sorted.last().copied().unwrap_or(0.0)
    );
    serde_json::json!({
        "hints": sorted.len(),
        "p50_us": pct(sorted, 0.5),
        "p99_us": pct(sorted, 0.99),
        "p999_us": pct(sorted, 0.999),
        "max_us": sorted.last().copied().unwrap_or(0.0),
    })
}

fn main() {
    let rate: f64 = std::env::args()
        .skip_while(|a| a != "--rate")
        .nth(1)
        .and_then(|r| r.parse().ok())
        .unwrap_or(1_000_000.0);
    let sidecar = Arc::new(sidecar());
    let mut publishers: Vec<Publisher> = (0..WORKERS)
        .map(|worker| Publisher {
            worker,
            event_id: 0,
        })
        .collect();
    for p in &mut publishers {
        for n in 0..RESIDENT {
            let events = p.store(prompt(p.worker, n));
            ingest(&sidecar, &events);
        }
    }
    let resident: Arc<Vec<AtomicU64>> =
        Arc::new((0..WORKERS).map(|_| AtomicU64::new(RESIDENT - 1)).collect());

    let idle = hints(&sidecar, &resident, HINT_SECONDS);

    let stop = Arc::new(AtomicBool::new(false));
    let ingester = {
        let (sidecar, resident, stop) = (sidecar.clone(), resident.clone(), stop.clone());
        std::thread::spawn(move || {
            let start = Instant::now();
            let mut stored = 0u64;
            let mut next = vec![RESIDENT; WORKERS as usize];
            while !stop.load(Ordering::Relaxed) {
                // Catch up with the pace, one prompt per worker at a time.
                let due = (start.elapsed().as_secs_f64() * rate) as u64;
                if stored >= due {
                    std::thread::sleep(Duration::from_micros(200));
                    continue;
                }
                for p in &mut publishers {
                    let w = p.worker as usize;
                    let n = next[w];
                    let events = p.store(prompt(p.worker, n));
                    ingest(&sidecar, &events);
                    resident[w].store(n, Ordering::Relaxed);
                    let events = p.remove(prompt(p.worker, n - RESIDENT));
                    ingest(&sidecar, &events);
                    next[w] += 1;
                    stored += PROMPT_BLOCKS;
                }
            }
            stored as f64 / start.elapsed().as_secs_f64()
        })
    };
    // Let the ingest reach its pace before measuring.
    std::thread::sleep(Duration::from_millis(300));
    let busy = hints(&sidecar, &resident, HINT_SECONDS);
    stop.store(true, Ordering::Relaxed);
    let reached = ingester.join().expect("ingest thread");

    println!(
        "ingest: {:.0} blocks stored and as many removed per second (asked for {rate:.0})",
        reached
    );
    let report = serde_json::json!({
        "workers": WORKERS,
        "resident_blocks_per_worker": RESIDENT * PROMPT_BLOCKS,
        "prompt_blocks": PROMPT_BLOCKS,
        "ingest_rate_asked": rate,
        "ingest_rate_reached": reached,
        "idle": summary("no ingest", &idle),
        "under_ingest": summary("under ingest", &busy),
    });
    let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench");
    if std::fs::create_dir_all(&out).is_ok() {
        let path = out.join("hint_under_ingest.json");
        if let Err(e) = std::fs::write(&path, report.to_string()) {
            eprintln!("cannot write {}: {e}", path.display());
        }
    }
}
