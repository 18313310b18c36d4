//! `make bench-hint`: hint latency (p50/p99/p99.9) while one thread ingests KV events, against
//! the same hints with no ingest, in one run; with `--scale`, the same at 4, 16, 64 and 256
//! workers, each fleet's index holding at least 1M entries.
//!
//! The sidecar is the real one ([`Sidecar::ingest`] and [`Sidecar::hint`], metrics and all,
//! minus HTTP): by default 8 workers of one model, each holding 256 prompts of 32 blocks. The
//! ingest thread stores a new 32-block prompt on a worker and removes that worker's oldest one,
//! as Dynamo events (16 blocks a message), paced to `--rate` stored blocks per second (default
//! 1,000,000 stored and as many removed); it reports the rate it reached. The hint thread asks
//! for resident prompts, reporting each ticket back with the next request, as the filter does;
//! the process's CPU time over the hints, per hint, is reported beside their latency. Writes
//! `target/bench/hint_under_ingest.json`, or with `--scale` `target/bench/hint_scale.json`
//! (one row per fleet size).

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
use kvroute_sidecar::metrics::Transport;
use kvroute_sidecar::sidecar::{Sidecar, Source};

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

/// The fleet a run indexes.
#[derive(Debug, Clone, Copy)]
struct Fleet {
    workers: u64,
    /// Prompts each worker holds.
    resident: u64,
}

impl Fleet {
    /// Prompt number `n` of worker `w`, globally unique.
    fn prompt(self, w: u64, n: u64) -> u64 {
        n * self.workers + w
    }

    fn entries(self) -> u64 {
        self.workers * self.resident * PROMPT_BLOCKS
    }
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

fn sidecar(fleet: Fleet) -> Sidecar {
    let model = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/models/tiny-llama");
    let mut text = format!("[[models]]\nname = \"m\"\ndir = \"{model}\"\nblock_size = 16\n");
    for w in 0..fleet.workers {
        text += &format!(
            "[[workers]]\naddress = \"127.0.0.1:{}\"\nmodel = \"m\"\ndynamo_worker_id = {}\n",
            9000 + w,
            1000 + w
        );
    }
    let config: Config = toml::from_str(&text).expect("bench config");
    Sidecar::from_config(&config).expect("bench sidecar")
}

const SUBJECT: &str = "namespace.bench.component.backend.kv-events";

/// Events as a NATS source hands them over.
fn ingest(source: &Source, events: &[RouterEvent]) {
    let now = Instant::now();
    for e in events {
        source.ingest(SUBJECT, Input::Message(Message::dynamo(e, None)), now);
    }
}

/// The process's CPU time so far (user + system), from `/proc/self/stat`; zero where there is
/// none.
fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which may hold spaces): utime and stime are 14 and 15.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    // The kernel's USER_HZ is 100 on every Linux this runs on.
    Duration::from_millis((ticks(11) + ticks(12)) * 10)
}

/// Latencies of hints for resident prompts for `seconds`, in microseconds, sorted; and the
/// hints' share of the process's CPU time (all of it when nothing else runs).
fn hints(
    sidecar: &Sidecar,
    fleet: Fleet,
    resident: &[AtomicU64],
    seconds: f64,
) -> (Vec<f64>, Duration) {
    let mut out = Vec::new();
    let mut finished = Vec::new();
    let start = Instant::now();
    let cpu = cpu_time();
    let mut i = 0u64;
    while start.elapsed().as_secs_f64() < seconds {
        let w = i % fleet.workers;
        // A prompt the worker holds: its newest stored one.
        let n = resident[w as usize].load(Ordering::Relaxed);
        let req = HintRequest {
            model: "m".into(),
            hashes: prefix_hashes(&locals(fleet.prompt(w, n))),
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
    let cpu = cpu_time().saturating_sub(cpu);
    out.sort_by(f64::total_cmp);
    (out, cpu)
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn summary(name: &str, (sorted, cpu): &(Vec<f64>, Duration)) -> serde_json::Value {
    let cpu_us = cpu.as_secs_f64() * 1e6 / sorted.len().max(1) as f64;
    println!(
        "{name:>20}: {:>8} hints  p50 {:6.1} µs  p99 {:6.1} µs  p99.9 {:7.1} µs  max {:8.1} µs  CPU {cpu_us:5.1} µs/hint",
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
        "process_cpu_us_per_hint": cpu_us,
    })
}

/// A sidecar indexing `fleet`, hints with no ingest and then while one thread ingests `rate`
/// blocks a second (stored, and as many removed).
fn run(fleet: Fleet, rate: f64) -> serde_json::Value {
    let sidecar = Arc::new(sidecar(fleet));
    let source = Arc::new(sidecar.source(Transport::Nats, "bench", vec![SUBJECT.to_owned()]));
    let mut publishers: Vec<Publisher> = (0..fleet.workers)
        .map(|worker| Publisher {
            worker,
            event_id: 0,
        })
        .collect();
    for p in &mut publishers {
        for n in 0..fleet.resident {
            let events = p.store(fleet.prompt(p.worker, n));
            ingest(&source, &events);
        }
    }
    let resident: Arc<Vec<AtomicU64>> = Arc::new(
        (0..fleet.workers)
            .map(|_| AtomicU64::new(fleet.resident - 1))
            .collect(),
    );

    let idle = hints(&sidecar, fleet, &resident, HINT_SECONDS);

    let stop = Arc::new(AtomicBool::new(false));
    let ingester = {
        let (source, resident, stop) = (source.clone(), resident.clone(), stop.clone());
        std::thread::spawn(move || {
            let start = Instant::now();
            let mut stored = 0u64;
            let mut next = vec![fleet.resident; fleet.workers as usize];
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
                    let events = p.store(fleet.prompt(p.worker, n));
                    ingest(&source, &events);
                    resident[w].store(n, Ordering::Relaxed);
                    let events = p.remove(fleet.prompt(p.worker, n - fleet.resident));
                    ingest(&source, &events);
                    next[w] += 1;
                    stored += PROMPT_BLOCKS;
                }
            }
            stored as f64 / start.elapsed().as_secs_f64()
        })
    };
    // Let the ingest reach its pace before measuring.
    std::thread::sleep(Duration::from_millis(300));
    let busy = hints(&sidecar, fleet, &resident, HINT_SECONDS);
    stop.store(true, Ordering::Relaxed);
    let reached = ingester.join().expect("ingest thread");

    println!(
        "{} workers, {} entries; ingest: {:.0} blocks stored and as many removed per second (asked for {rate:.0})",
        fleet.workers,
        fleet.entries(),
        reached
    );
    serde_json::json!({
        "workers": fleet.workers,
        "entries": fleet.entries(),
        "resident_blocks_per_worker": fleet.resident * PROMPT_BLOCKS,
        "prompt_blocks": PROMPT_BLOCKS,
        "ingest_rate_asked": rate,
        "ingest_rate_reached": reached,
        "idle": summary("no ingest", &idle),
        "under_ingest": summary("under ingest", &busy),
    })
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let rate: f64 = args
        .iter()
        .skip_while(|a| *a != "--rate")
        .nth(1)
        .and_then(|r| r.parse().ok())
        .unwrap_or(1_000_000.0);
    let (name, report) = if args.iter().any(|a| a == "--scale") {
        // At least 1M entries at every size: the index, not the fleet, is as large as a big one.
        let rows: Vec<serde_json::Value> = [4u64, 16, 64, 256]
            .into_iter()
            .map(|workers| {
                let resident = (1u64 << 20).div_ceil(workers * PROMPT_BLOCKS).max(256);
                let row = run(Fleet { workers, resident }, rate);
                serde_json::json!({
                    "workers": workers,
                    "entries": row["entries"],
                    "p50_us": row["idle"]["p50_us"],
                    "p99_us": row["idle"]["p99_us"],
                    "process_cpu_us_per_hint": row["idle"]["process_cpu_us_per_hint"],
                    "under_ingest": row["under_ingest"],
                    "ingest_rate_reached": row["ingest_rate_reached"],
                })
            })
            .collect();
        ("hint_scale.json", serde_json::Value::from(rows))
    } else {
        let fleet = Fleet {
            workers: 8,
            resident: 256,
        };
        ("hint_under_ingest.json", run(fleet, rate))
    };
    let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench");
    if std::fs::create_dir_all(&out).is_ok() {
        let path = out.join(name);
        if let Err(e) = std::fs::write(
            &path,
            serde_json::to_string_pretty(&report).unwrap_or_default(),
        ) {
            eprintln!("cannot write {}: {e}", path.display());
        }
    }
}
