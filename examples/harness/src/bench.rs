//! `make bench-routing`: every routing mode on the same fleet and request stream, per workload.
//!
//! Modes: `round_robin`, `ring_hash`, `kvroute` (through Envoy), `oracle` (straight to the engine
//! holding the longest prefix, asked of every engine; ties rotate like kvroute's), and the peer
//! routers of [`crate::peers`]. Every mode gets a fresh fleet (empty caches), the same engine
//! settings and the same sessions.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};

use crate::client::{run_sessions, Outcome, Target};
use crate::peers::PEERS;
use crate::report::ModeReport;
use crate::stack::MODEL;
use crate::traces::{self, TraceSpec};
use crate::workload::{warm_up_sessions, ChatSpec, ChatWorkload, Session};
use crate::{Mode, SimOptions, Stack, StackOptions};

/// A named workload and how many sessions run at once.
pub struct Workload {
    /// Name in reports.
    pub name: &'static str,
    /// The sessions.
    pub sessions: Vec<Session>,
    /// Sessions in flight.
    pub concurrency: usize,
    /// KV cache capacity per engine, in blocks.
    pub capacity_blocks: usize,
}

/// How big a run is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scale {
    /// A few requests per workload: keeps the harness working (the smoke test in `make test`).
    Smoke,
    /// `--quick`: the core workloads and modes in a few minutes.
    Quick,
    /// Everything.
    Full,
}

/// The benchmark's workloads; quick and smoke runs keep the three core ones, smaller.
pub fn workloads(scale: Scale) -> Result<Vec<Workload>> {
    let quick = scale != Scale::Full;
    let size = |smoke: usize, quick: usize, full: usize| match scale {
        Scale::Smoke => smoke,
        Scale::Quick => quick,
        Scale::Full => full,
    };
    let trace = |file: &str, requests: usize| {
        let spec = TraceSpec {
            requests,
            block_tokens: 32,
            max_output: 8,
            vocab: 2000,
        };
        traces::load(&traces::path(file), MODEL, &spec)
    };
    let chat = |spec: ChatSpec| ChatWorkload::generate(&spec).sessions(MODEL);
    let mut out = vec![
        Workload {
            name: "conversation_trace",
            sessions: trace("conversation_trace.jsonl", size(30, 400, 1500))?,
            concurrency: 16,
            capacity_blocks: TRACE_CAPACITY,
        },
        Workload {
            name: "multi_turn",
            sessions: chat(ChatSpec {
                conversations: size(8, 48, 96),
                ..ChatSpec::demo()
            }),
            concurrency: 16,
            capacity_blocks: CHAT_CAPACITY,
        },
        Workload {
            name: "hot_prefix",
            sessions: chat(ChatSpec {
                conversations: size(20, 120, 240),
                ..ChatSpec::hot_prefix()
            }),
            concurrency: 16,
            capacity_blocks: CHAT_CAPACITY,
        },
    ];
    if !quick {
        out.push(Workload {
            name: "synthetic_trace",
            sessions: trace("synthetic_trace.jsonl", 800)?,
            concurrency: 16,
            capacity_blocks: TRACE_CAPACITY,
        });
        out.push(Workload {
            name: "system_prompt",
            sessions: chat(ChatSpec::system_prompt()),
            concurrency: 16,
            capacity_blocks: CHAT_CAPACITY,
        });
        out.push(Workload {
            name: "agent_loop",
            sessions: chat(ChatSpec::agent_loop()),
            concurrency: 8,
            capacity_blocks: CHAT_CAPACITY,
        });
    }
    Ok(out)
}

/// Cache capacity per engine for the chat workloads: small enough that they evict.
pub const CHAT_CAPACITY: usize = 1024;
/// Cache capacity per engine for the trace replays: the fleet holds about as many blocks as
/// the replayed requests' distinct prefixes need (~60k), so placement decides what survives.
pub const TRACE_CAPACITY: usize = 16384;

/// Requests each engine of the benchmark fleet runs at once.
pub const MAX_RUNNING: usize = 4;

/// Engine settings of the benchmark fleet: limited caches, bounded concurrency.
pub fn fleet(engines: usize, capacity_blocks: usize) -> SimOptions {
    SimOptions {
        engines,
        capacity_blocks,
        max_running: MAX_RUNNING,
        event_delay_ms: REAL_EVENT_DELAY_MS.into(),
        ..SimOptions::default()
    }
}

/// How late real vLLM 0.32 published its KV events under load (issue 11: p50 1.6 ms, p95 52 ms,
/// max 666 ms after the engine stamped them); the benchmark's engines are as late.
pub const REAL_EVENT_DELAY_MS: &str = "1.6,52,666";

/// The result of one mode on one workload.
pub fn summary(outcomes: &[Outcome], engines: usize) -> Value {
    let r = ModeReport::new("", outcomes, engines);
    let served: usize = r.requests_per_engine.iter().sum();
    let mean = served as f64 / engines.max(1) as f64;
    let max = r.requests_per_engine.iter().copied().max().unwrap_or(0) as f64;
    let first_error = outcomes.iter().find(|o| !o.ok()).map(|o| {
        format!(
            "status {}: {}",
            o.status,
            o.error.clone().unwrap_or_default()
        )
    });
    json!({
        "hit_rate": r.hit_rate,
        "ttft_p50_ms": r.ttft_p50_ms,
        "ttft_p95_ms": r.ttft_p95_ms,
        "imbalance": if mean > 0.0 { max / mean } else { 0.0 },
        "requests": r.requests,
        "errors": r.errors,
        "available": true,
        "requests_per_engine": r.requests_per_engine,
        "cached_tokens": outcomes.iter().filter(|o| o.ok()).map(|o| o.cached_tokens).sum::<u64>(),
        "first_error": first_error,
    })
}

fn unavailable(reason: String) -> Value {
    json!({"hit_rate": 0.0, "ttft_p50_ms": 0.0, "ttft_p95_ms": 0.0, "imbalance": 0.0,
           "requests": 0, "errors": 0, "available": false, "reason": reason})
}

/// kvroute fed by vLLM's ZMQ events instead of Dynamo's (side by side with vllm-router's
/// `kv_aware`, which reads the same events).
pub const KVROUTE_ZMQ: &str = "kvroute:vllm-zmq";

/// Which modes to run: the four core modes, plus kvroute on vLLM events and the peers in a full
/// run. The smoke run keeps one peer (not installed for `make test`), to exercise the
/// "unavailable" path.
pub fn mode_names(scale: Scale) -> Vec<String> {
    let mut modes: Vec<String> = ["round_robin", "ring_hash", "kvroute", "oracle"]
        .map(String::from)
        .to_vec();
    match scale {
        Scale::Full => {
            modes.push(KVROUTE_ZMQ.to_owned());
            modes.extend(PEERS.iter().map(|p| p.mode.to_owned()));
        }
        Scale::Smoke => modes.push("vllm-router:kv_aware".to_owned()),
        Scale::Quick => {}
    }
    modes
}

async fn run_mode(mode: &str, workload: &Workload, bench: &RoutingBench) -> Result<Value> {
    let (engines, start_gap) = (bench.engines, bench.start_gap);
    let stack_mode = match mode {
        "kvroute" | KVROUTE_ZMQ => Mode::Kvroute,
        "ring_hash" => Mode::RingHash,
        _ => Mode::RoundRobin,
    };
    let mut opts = StackOptions::new(
        &format!("bench-{}-{}", workload.name, mode.replace(':', "-")),
        stack_mode,
    );
    opts.sim = fleet(
        engines,
        bench.capacity_blocks.unwrap_or(workload.capacity_blocks),
    );
    opts.sim.event_delay_ms = bench.event_delay_ms.clone();
    opts.sim.max_running = bench.max_running;
    opts.sidecar_toml = bench.sidecar_toml.clone();
    // Engines publish vLLM's ZMQ events for the routers that read them.
    let peer = crate::peers::named(mode);
    if mode == KVROUTE_ZMQ || peer.is_some_and(|p| p.kv_events) {
        opts.sim.event_formats = vec!["vllm-map".into()];
    }
    let block_size = opts.sim.block_size;
    let mut stack = Stack::start(opts).await?;
    let addresses: Vec<String> = stack.engines.iter().map(|e| e.address.clone()).collect();
    let mut _peer = None;
    let target = match mode {
        "round_robin" | "ring_hash" | "kvroute" | KVROUTE_ZMQ => {
            Target::Router(stack.envoy_url.clone())
        }
        "oracle" => Target::Oracle(addresses),
        other => {
            let peer = peer.ok_or_else(|| anyhow::anyhow!("unknown mode {other}"))?;
            match peer.start(&stack.engines, &stack.dir).await {
                Ok((process, url)) => {
                    _peer = Some(process);
                    Target::Router(url)
                }
                Err(e) => return Ok(unavailable(format!("{e:#}"))),
            }
        }
    };
    let outcomes = run_workload(&stack.http, &target, workload, start_gap, mode).await?;
    stack.check_alive()?;
    // Every request's outcome next to the logs, to look into a tail.
    let rows: Vec<Value> = outcomes
        .iter()
        .map(|o| {
            json!({"status": o.status, "ttft_ms": o.ttft.as_secs_f64() * 1e3, "engine": o.engine,
                   "prompt_tokens": o.prompt_tokens, "cached_tokens": o.cached_tokens,
                   "slot_wait_ms": o.slot_wait_us as f64 / 1e3})
        })
        .collect();
    std::fs::write(
        stack.dir.join("outcomes.json"),
        Value::from(rows).to_string(),
    )?;
    stack.save_explain().await?;
    let mut result = summary(&outcomes, engines);
    if stack_mode == Mode::Kvroute {
        // Against `cached_tokens`: what the index over-predicted (blocks evicted between the
        // hint and the prefill, or events not yet applied).
        result["hinted_match_tokens"] = json!(stack.hinted_match_tokens(block_size).await);
        result["predictions"] = json!(stack.predictions().await);
    }
    Ok(result)
}

/// Warm the fleet up through `target` (see `warm_up_sessions`; not measured), then run the
/// workload's sessions with a progress bar labelled `label`.
pub async fn run_workload(
    http: &reqwest::Client,
    target: &Target,
    workload: &Workload,
    start_gap: Duration,
    label: &str,
) -> Result<Vec<Outcome>> {
    let warm_up = warm_up_sessions(MODEL, 2 * workload.concurrency);
    let warmed = run_sessions(
        http,
        target,
        &warm_up,
        workload.concurrency,
        Duration::ZERO,
        &ProgressBar::hidden(),
    )
    .await;
    if let Some(failed) = warmed.iter().find(|o| !o.ok()) {
        eprintln!(
            "{} / {label}: a warm-up request failed: {failed:?}",
            workload.name
        );
    }
    let total: usize = workload.sessions.iter().map(|s| s.bodies.len()).sum();
    let bar = ProgressBar::new(total as u64).with_style(
        ProgressStyle::with_template("{prefix:>44} [{bar:30}] {pos}/{len} {elapsed}")?
            .progress_chars("=> "),
    );
    bar.set_prefix(format!("{} / {label}", workload.name));
    let outcomes = run_sessions(
        http,
        target,
        &workload.sessions,
        workload.concurrency,
        start_gap,
        &bar,
    )
    .await;
    bar.finish();
    Ok(outcomes)
}

/// What the routing benchmark runs.
#[derive(Debug, Clone)]
pub struct RoutingBench {
    /// Input sizes.
    pub scale: Scale,
    /// Simulated engines.
    pub engines: usize,
    /// Only these workloads (all when `None`).
    pub workloads: Option<Vec<String>>,
    /// Only these modes (the oracle always runs).
    pub modes: Option<Vec<String>>,
    /// Between the starts of concurrent clients (see [`crate::client::CLIENT_START_GAP`]).
    pub start_gap: Duration,
    /// How late the engines publish KV events (`P50,P95,MAX` ms; default
    /// [`REAL_EVENT_DELAY_MS`]).
    pub event_delay_ms: String,
    /// Appended to the sidecar's configuration (kvroute modes), for A/B runs.
    pub sidecar_toml: String,
    /// Cache capacity per engine, in blocks, for every workload (each has its own otherwise).
    pub capacity_blocks: Option<usize>,
    /// Requests each engine runs at once.
    pub max_running: usize,
}

impl RoutingBench {
    /// Every workload and mode at `scale` on 4 engines, as late as real engines.
    pub fn new(scale: Scale) -> Self {
        RoutingBench {
            scale,
            engines: 4,
            workloads: None,
            modes: None,
            start_gap: crate::client::CLIENT_START_GAP,
            event_delay_ms: REAL_EVENT_DELAY_MS.into(),
            sidecar_toml: String::new(),
            capacity_blocks: None,
            max_running: MAX_RUNNING,
        }
    }
}

/// Run the benchmark and write `routing.json`, `routing.md` and `routing.png` into `out`.
pub async fn run(bench: &RoutingBench, out: &Path) -> Result<Value> {
    let (scale, engines, start_gap) = (bench.scale, bench.engines, bench.start_gap);
    let mut doc = BTreeMap::new();
    for workload in workloads(scale)? {
        if bench
            .workloads
            .as_ref()
            .is_some_and(|o| !o.iter().any(|w| w == workload.name))
        {
            continue;
        }
        let mut modes = serde_json::Map::new();
        // The oracle always runs: hit rates are reported against it.
        let wanted = |m: &str| {
            m == "oracle"
                || bench
                    .modes
                    .as_ref()
                    .is_none_or(|o| o.iter().any(|x| x == m))
        };
        for mode in mode_names(scale).into_iter().filter(|m| wanted(m)) {
            let result = match run_mode(&mode, &workload, bench).await {
                Ok(v) => v,
                Err(e) => unavailable(format!("{e:#}")),
            };
            modes.insert(mode, result);
        }
        let oracle = modes
            .get("oracle")
            .and_then(|m| m["hit_rate"].as_f64())
            .unwrap_or(0.0);
        for m in modes.values_mut() {
            let hit = m["hit_rate"].as_f64().unwrap_or(0.0);
            m["hit_rate_vs_oracle"] = json!(if oracle > 0.0 { hit / oracle } else { 0.0 });
        }
        doc.insert(workload.name.to_owned(), json!({"modes": modes, "sessions": workload.sessions.len(), "concurrency": workload.concurrency}));
    }
    let doc = json!({"engines": engines, "scale": format!("{scale:?}"),
                     "start_gap_ms": start_gap.as_secs_f64() * 1e3, "workloads": doc});
    crate::report::write_pair(out, "routing", &doc, &markdown(&doc))?;
    let panels: Vec<(String, crate::plot::Bars)> = doc["workloads"]
        .as_object()
        .map(|w| {
            w.iter()
                .map(|(name, v)| {
                    let bars = v["modes"]
                        .as_object()
                        .map(|m| {
                            m.iter()
                                .filter(|(_, r)| r["available"] == true)
                                .map(|(mode, r)| {
                                    (
                                        mode.clone(),
                                        r["hit_rate"].as_f64().unwrap_or(0.0),
                                        r["ttft_p50_ms"].as_f64().unwrap_or(0.0),
                                    )
                                })
                                .collect()
                        })
                        .unwrap_or_default();
                    (name.clone(), bars)
                })
                .collect()
        })
        .unwrap_or_default();
    crate::plot::routing_png(&out.join("routing.png"), &panels)?;
    Ok(doc)
}

/// The markdown table of a `routing.json` document.
pub fn markdown(doc: &Value) -> String {
    let mut out = String::from("# Routing benchmark\n");
    let Some(workloads) = doc["workloads"].as_object() else {
        return out;
    };
    for (name, w) in workloads {
        out.push_str(&format!(
            "\n## {name}\n\n| mode | hit rate | vs oracle | TTFT p50 (ms) | TTFT p95 (ms) | imbalance | requests | errors |\n|---|---|---|---|---|---|---|---|\n"
        ));
        for (mode, r) in w["modes"].as_object().into_iter().flatten() {
            if r["available"] != true {
                out.push_str(&format!(
                    "| {mode} | unavailable: {} | | | | | | |\n",
                    crate::report::unavailable_reason(r)
                ));
                continue;
            }
            let f = |k: &str| r[k].as_f64().unwrap_or(0.0);
            out.push_str(&format!(
                "| {mode} | {:.1}% | {:.0}% | {:.1} | {:.1} | {:.2} | {} | {} |\n",
                f("hit_rate") * 100.0,
                f("hit_rate_vs_oracle") * 100.0,
                f("ttft_p50_ms"),
                f("ttft_p95_ms"),
                f("imbalance"),
                r["requests"],
                r["errors"]
            ));
        }
    }
    out
}
