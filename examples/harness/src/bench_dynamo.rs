//! `kvroute-bench dynamo`: kvroute against Dynamo's own KV router, on one real Dynamo 1.6.1
//! mocker fleet configuration and one request stream.
//!
//! Modes (each on a fresh fleet, so every one starts with empty caches):
//! - `dynamo_kv`: straight to a Dynamo frontend in `--router-mode kv` (Dynamo's KV router);
//! - `dynamo_round_robin`: straight to a frontend in `--router-mode round-robin`;
//! - `envoy_dynamo_kv`: through Envoy without the filter to a `kv` frontend: the hop kvroute's
//!   modes pay, alone (the TTFT it adds to `dynamo_kv` is Envoy's, not kvroute's);
//! - `kvroute_filter_only`: the same Envoy with the kvroute filter preparing every request but
//!   asking no hint (`hints: false`): what the filter's own work adds, without the hint and pin;
//! - `kvroute`: through Envoy with the kvroute filter in pin mode, in front of a `kv` frontend
//!   (the deployment docs/operations.md prescribes; unpinned requests are Dynamo's to route);
//! - `kvroute_sidecar_killed`: the same, with the sidecar SIGKILLed once a third of the requests
//!   are done (serving must not depend on it: every request still succeeds).
//!
//! Hit rate, aggregated: the responses' `usage.prompt_tokens_details.cached_tokens`.
//! Disaggregated, those count the *decode* worker's cache (checked on 1.6.1: a prompt served by a
//! prefill worker that never saw it reports the tokens cached), which no router picks; the cache
//! routing decides is the prefill workers'. Its hits are read from their own KV events: a prefill
//! worker stores every full prompt block it did not hold, so hit blocks = full prompt blocks −
//! blocks stored.

use std::collections::HashSet;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result};
use futures::StreamExt;
use indicatif::ProgressBar;
use serde_json::{json, Value};

use crate::client::{run_sessions_paced, Outcome, Pace, Target, CLIENT_START_GAP};
use crate::dynamo::DynamoOptions;
use crate::report::{self, ModeReport};
use crate::stack::MODEL;
use crate::workload::{ChatSpec, ChatWorkload, Session};
use crate::{Mode, Stack, StackOptions};
use kvroute_protocol::dynamo::{KvCacheEventData, RouterEvent};

/// What to run.
#[derive(Debug, Clone)]
pub struct DynamoBench {
    /// The fleet (`router_mode` is set per mode).
    pub fleet: DynamoOptions,
    /// Conversations of the multi-turn chat workload.
    pub conversations: usize,
    /// Conversations in flight.
    pub concurrency: usize,
    /// Appended to the sidecar's configuration (the kvroute modes).
    pub sidecar_toml: String,
    /// Only these modes (all of [`MODES`] when empty), in [`MODES`]' order.
    pub modes: Vec<String>,
    /// Users think up to this long before each next turn (see [`Pace::think_max`]): the mocker
    /// steps on a clock, and without it every turn would arrive at the same phase of it.
    pub think_max: Duration,
}

/// Every mode: its name, the frontend's router mode, how requests reach the frontend.
pub const MODES: [(&str, &str, Via); 6] = [
    ("dynamo_kv", "kv", Via::Frontend),
    ("dynamo_round_robin", "round-robin", Via::Frontend),
    ("envoy_dynamo_kv", "kv", Via::PlainEnvoy),
    ("kvroute_filter_only", "kv", Via::FilterOnly),
    ("kvroute", "kv", Via::Kvroute),
    ("kvroute_sidecar_killed", "kv", Via::Kvroute),
];

/// Run every mode; write `dynamo.json` and `dynamo.md` to `out`; return the markdown.
pub async fn run(bench: &DynamoBench, out: &Path) -> Result<String> {
    let mut sessions = ChatWorkload::generate(&ChatSpec {
        conversations: bench.conversations,
        ..ChatSpec::demo()
    })
    .sessions(MODEL);
    // Dynamo names the workers that served each request.
    for body in sessions.iter_mut().flat_map(|s| s.bodies.iter_mut()) {
        body["nvext"] = json!({"extra_fields": ["worker_id"]});
    }
    let mut reports = Vec::new();
    if let Some(unknown) = bench
        .modes
        .iter()
        .find(|m| !MODES.iter().any(|(n, ..)| n == m))
    {
        anyhow::bail!(
            "unknown mode {unknown}: one of {:?}",
            MODES.map(|(n, ..)| n)
        );
    }
    let chosen = MODES
        .into_iter()
        .filter(|(n, ..)| bench.modes.is_empty() || bench.modes.iter().any(|m| m == n));
    for (mode, router_mode, via) in chosen {
        let run = run_mode(bench, &sessions, mode, router_mode, via, out).await?;
        let (outcomes, workers) = by_worker(run.outcomes);
        let mut r = ModeReport::new(mode, &outcomes, workers);
        if let Some(stored) = run.prefill_stored_blocks {
            let usage_rate = r.hit_rate;
            r.hit_rate = prefill_hit_rate(&outcomes, bench.fleet.block_size, stored);
            eprintln!("{mode}: decode-side (usage) hit rate {usage_rate:.3}");
        }
        eprintln!("{}", r.line());
        if let Some(fallbacks) = run.sidecar_fallbacks {
            eprintln!("{mode}: {fallbacks} requests fell back with the sidecar down");
        }
        reports.push(r);
    }
    let f = &bench.fleet;
    let hit = if f.prefill > 0 {
        "; hit rate: the prefill workers' caches, from their KV events"
    } else {
        ""
    };
    let title = format!(
        "Real Dynamo 1.6.1 mocker fleet: {} aggregated, {} prefill, {} decode workers, {}-block caches, multi-turn chat ({} conversations, {} at a time){hit}",
        f.aggregated, f.prefill, f.decode, f.capacity_blocks, bench.conversations, bench.concurrency
    );
    report::write(out, "dynamo", &title, &reports)
}

/// How a mode's requests reach the frontend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// Straight to it.
    Frontend,
    /// Through Envoy without the filter: the hop kvroute's modes pay, alone.
    PlainEnvoy,
    /// Through Envoy with the filter preparing requests but asking no hint.
    FilterOnly,
    /// Through Envoy with the filter in pin mode.
    Kvroute,
}

/// What one mode's run saw.
struct ModeRun {
    outcomes: Vec<Outcome>,
    /// Disaggregated: blocks the prefill workers stored during the run.
    prefill_stored_blocks: Option<u64>,
    /// `kvroute_sidecar_killed`: requests Envoy's filter routed without the sidecar.
    sidecar_fallbacks: Option<u64>,
}

/// Prefill-side hit rate: of the prompt tokens, those in full blocks the prefill worker did not
/// have to store.
fn prefill_hit_rate(outcomes: &[Outcome], block_size: u32, stored_blocks: u64) -> f64 {
    let bs = u64::from(block_size.max(1));
    let ok = outcomes.iter().filter(|o| o.ok());
    let (prompt, full_blocks) = ok.fold((0u64, 0u64), |(p, b), o| {
        (p + o.prompt_tokens, b + o.prompt_tokens / bs)
    });
    if prompt == 0 {
        return 0.0;
    }
    (full_blocks.saturating_sub(stored_blocks) * bs) as f64 / prompt as f64
}

/// Counts the blocks `workers` store, from their KV events, until dropped: on the stack's NATS
/// (`--event-plane nats`), or on Dynamo's ZMQ event plane (its default) from every `kv-events`
/// publisher discovery lists.
struct StoredBlocks {
    stored: Arc<AtomicU64>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl StoredBlocks {
    fn count(&self) -> u64 {
        self.stored.load(Ordering::Relaxed)
    }

    fn add(counter: &AtomicU64, workers: &HashSet<u64>, events: &[RouterEvent]) {
        for e in events.iter().filter(|e| workers.contains(&e.worker_id)) {
            if let KvCacheEventData::Stored(s) = &e.event.data {
                counter.fetch_add(s.blocks.len() as u64, Ordering::Relaxed);
            }
        }
    }

    async fn on_nats(nats_url: &str, workers: HashSet<u64>) -> Result<StoredBlocks> {
        let client = async_nats::connect(nats_url)
            .await
            .with_context(|| format!("connecting to {nats_url}"))?;
        let mut sub = client.subscribe("namespace.>").await?;
        client.flush().await?;
        let stored = Arc::new(AtomicU64::new(0));
        let counter = stored.clone();
        let task = tokio::spawn(async move {
            let _client = client;
            while let Some(msg) = sub.next().await {
                if !msg.subject.ends_with(".kv-events") {
                    continue;
                }
                if let Ok(decoded) = kvroute_protocol::dynamo::decode_message(&msg.payload) {
                    Self::add(&counter, &workers, &decoded.events);
                }
            }
        });
        Ok(StoredBlocks {
            stored,
            stop: Arc::default(),
            task: Some(task),
        })
    }

    /// One SUB socket connected to every endpoint (a thread: libzmq's sockets block).
    fn on_zmq(endpoints: Vec<String>, workers: HashSet<u64>) -> Result<StoredBlocks> {
        anyhow::ensure!(
            !endpoints.is_empty(),
            "no kv-events publisher on ZMQ in discovery"
        );
        let context = zmq::Context::new();
        let socket = context.socket(zmq::SUB)?;
        socket.set_subscribe(b"")?;
        socket.set_rcvtimeo(100)?;
        for e in &endpoints {
            socket.connect(e)?;
        }
        let stored = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (counter, stopped) = (stored.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stopped.load(Ordering::Relaxed) {
                let Ok(parts) = socket.recv_multipart(0) else {
                    continue;
                };
                let Ok(message) = kvroute_protocol::dynamo_zmq::decode_frames(&parts) else {
                    continue;
                };
                if let Ok(decoded) = message.kv_events() {
                    Self::add(&counter, &workers, &decoded.events);
                }
            }
        });
        Ok(StoredBlocks {
            stored,
            stop,
            task: None,
        })
    }
}

impl Drop for StoredBlocks {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// The endpoints of the `kv-events` publishers on ZMQ that a discovery store lists.
async fn zmq_kv_endpoints(discovery: &crate::dynamo::Discovery) -> Result<Vec<String>> {
    let records = discovery.records().await?;
    Ok(records
        .channels
        .iter()
        .filter_map(|b| serde_json::from_slice::<serde_json::Value>(b).ok())
        .filter(|c| c["topic"] == "kv-events" && c["transport"]["kind"] == "Zmq")
        .filter_map(|c| {
            c["transport"]["config"]["endpoint"]
                .as_str()
                .map(str::to_owned)
        })
        .collect())
}

async fn run_mode(
    bench: &DynamoBench,
    sessions: &[Session],
    mode: &str,
    router_mode: &str,
    via: Via,
    out: &Path,
) -> Result<ModeRun> {
    let mut opts = StackOptions::new(
        &format!("bench-dynamo-{mode}"),
        match via {
            Via::Kvroute => Mode::Kvroute,
            // The filter without hints: the harness's name for it is ring hash (with one
            // upstream, the frontend, there is nothing to hash between).
            Via::FilterOnly => Mode::RingHash,
            Via::Frontend | Via::PlainEnvoy => Mode::RoundRobin,
        },
    );
    opts.sidecar_toml = bench.sidecar_toml.clone();
    // TTFT is compared with Dynamo's router alone: the filter reads responses' usage as
    // shipped, not every stream as the harness does elsewhere.
    opts.filter_extra.insert(
        "stream_usage_every".into(),
        crate::stack::SHIPPED_STREAM_USAGE_EVERY.into(),
    );
    opts.dynamo = Some(DynamoOptions {
        router_mode: router_mode.into(),
        ..bench.fleet.clone()
    });
    let stack = Stack::start(opts).await?;
    let base = match via {
        Via::Frontend => format!("http://{}", stack.frontend.as_ref().expect("a frontend")),
        Via::PlainEnvoy | Via::FilterOnly | Via::Kvroute => stack.envoy_url.clone(),
    };
    let counting = if bench.fleet.prefill > 0 {
        let prefill = stack.engines.iter().map(|e| e.dynamo_worker_id).collect();
        Some(match bench.fleet.event_plane.as_deref() {
            Some("nats") => StoredBlocks::on_nats(&stack.nats_url, prefill).await?,
            _ => StoredBlocks::on_zmq(zmq_kv_endpoints(&stack.discovery).await?, prefill)?,
        })
    } else {
        None
    };
    let progress = ProgressBar::hidden();
    let total: usize = sessions.iter().map(|s| s.bodies.len()).sum();
    let kill_sidecar = mode == "kvroute_sidecar_killed";
    let killer = async {
        if !kill_sidecar {
            return Ok(());
        }
        while (progress.position() as usize) < total / 3 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        stack.signal("sidecar", "KILL")
    };
    let target = Target::Router(base);
    let (outcomes, killed) = tokio::join!(
        run_sessions_paced(
            &stack.http,
            &target,
            sessions,
            bench.concurrency,
            Pace {
                start_gap: CLIENT_START_GAP,
                think_max: bench.think_max,
            },
            &progress,
        ),
        killer
    );
    killed?;
    // Let the last requests' events land before the fleet goes.
    tokio::time::sleep(Duration::from_millis(200)).await;
    if let Some(p) = stack.predictions().await.filter(|_| !kill_sidecar) {
        // The filter reports finished requests within a second.
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let p = stack.predictions().await.unwrap_or(p);
        eprintln!("{mode}: the sidecar's predictions against the engines' cached tokens: {p}");
        stack.save_explain().await?;
    }
    if mode == "kvroute" {
        where_kvroute_time_went(&stack, out).await?;
    }
    let prefill_stored_blocks = counting.map(|c| c.count());
    let sidecar_fallbacks = if kill_sidecar {
        Some(
            stack
                .envoy_stat("wasmcustom.kvroute.fallback.sidecar")
                .await
                .unwrap_or(0),
        )
    } else {
        None
    };
    Ok(ModeRun {
        outcomes,
        prefill_stored_blocks,
        sidecar_fallbacks,
    })
}

/// Where the run's time in front of Dynamo went, from both sides: the filter's preparation and
/// its pause for the hint (Envoy's histograms, µs), the sidecar's answer (its histogram's
/// buckets, µs: an upper bound); printed and written to `kvroute_timings.json`.
async fn where_kvroute_time_went(stack: &Stack, out: &Path) -> Result<()> {
    // Envoy flushes histograms to /stats every 5 s.
    tokio::time::sleep(Duration::from_millis(5500)).await;
    let mut doc = serde_json::Map::new();
    for name in ["kvroute.prepare_us", "kvroute.hint_pause_us"] {
        let q = stack
            .envoy_quantiles(&format!("wasmcustom.{name}"))
            .await
            .unwrap_or_default();
        let at = |p: f64| q.iter().find(|(at, _)| *at == p).map(|(_, v)| *v);
        doc.insert(
            name.into(),
            json!({"p50": at(50.0), "p95": at(95.0), "p99": at(99.0)}),
        );
    }
    let metrics = stack.sidecar_metrics().await.unwrap_or_default();
    let at = |q| {
        crate::prometheus::histogram_quantile(&metrics, "kvroute_hint_seconds", q).map(|s| s * 1e6)
    };
    doc.insert(
        "sidecar.hint_us (bucket bound)".into(),
        json!({"p50": at(0.5), "p95": at(0.95), "p99": at(0.99)}),
    );
    let doc = Value::Object(doc);
    eprintln!("kvroute: where its time went (µs): {doc}");
    std::fs::create_dir_all(out)?;
    std::fs::write(
        out.join("kvroute_timings.json"),
        serde_json::to_string_pretty(&doc)?,
    )?;
    Ok(())
}

/// Number the workers that served (their prefill instance: where the cache hit happens) in the
/// order first seen, for the per-worker counts.
fn by_worker(mut outcomes: Vec<Outcome>) -> (Vec<Outcome>, usize) {
    let mut ids: Vec<u64> = Vec::new();
    for o in &mut outcomes {
        if let Some((prefill, _)) = o.dynamo_workers {
            let i = ids.iter().position(|&id| id == prefill).unwrap_or_else(|| {
                ids.push(prefill);
                ids.len() - 1
            });
            o.engine = Some(i);
        }
    }
    let workers = ids.len();
    (outcomes, workers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_hits_are_the_full_blocks_not_stored() {
        let o = |prompt_tokens, status| Outcome {
            status,
            prompt_tokens,
            ..Outcome::default()
        };
        // 2 × 100 tokens = 2 × 6 full blocks of 16; 4 stored: 8 hit blocks = 128 of 200 tokens.
        let outcomes = [o(100, 200), o(100, 200), o(50, 500)];
        assert!((prefill_hit_rate(&outcomes, 16, 4) - 0.64).abs() < 1e-9);
        assert_eq!(prefill_hit_rate(&outcomes, 16, 99), 0.0);
        assert_eq!(prefill_hit_rate(&[], 16, 0), 0.0);
    }
}
