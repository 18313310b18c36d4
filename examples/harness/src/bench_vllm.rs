//! `kvroute-bench vllm`: kvroute against Envoy's ring hash alone and round robin, on real vLLM
//! 0.32 engines on CPU (`make venv-vllm`), one multi-turn chat request stream.
//!
//! Modes (each on a fresh fleet, so every one starts with empty caches): `kvroute` (hints, ring
//! hash fallback), `ring_hash` (the filter sets only the fallback key: `hints: false`),
//! `round_robin` (plain Envoy). Requests per engine come from each engine's own
//! `vllm:request_success_total`, since vLLM does not say in a response who served it.

use std::path::Path;
use std::time::Duration;

use anyhow::Result;
use indicatif::ProgressBar;

use crate::client::{run_sessions, Outcome, Target, CLIENT_START_GAP};
use crate::report::{self, ModeReport};
use crate::stack::MODEL;
use crate::vllm::VllmOptions;
use crate::workload::{ChatSpec, ChatWorkload, Session};
use crate::{Mode, Stack, StackOptions};

/// What to run.
#[derive(Debug, Clone)]
pub struct VllmBench {
    /// The fleet.
    pub fleet: VllmOptions,
    /// Conversations (users) of the multi-turn chat.
    pub conversations: usize,
    /// Conversations in flight.
    pub concurrency: usize,
    /// Extra sidecar configuration (`[routing]` settings to compare).
    pub sidecar_toml: String,
    /// Only these modes (`kvroute`, `ring_hash`, `round_robin`; empty: all).
    pub modes: Vec<String>,
    /// Runs per mode, each with its own workload seed and fresh engines; a mode's report pools
    /// them (one run of 64 requests moves by ±2 points from timing alone).
    pub repeat: usize,
}

/// Run every mode; write `vllm.json` and `vllm.md` to `out`; return the markdown.
pub async fn run(bench: &VllmBench, out: &Path) -> Result<String> {
    let workloads: Vec<Vec<Session>> = (0..bench.repeat.max(1) as u64)
        .map(|r| {
            ChatWorkload::generate(&ChatSpec {
                seed: ChatSpec::demo().seed + r,
                conversations: bench.conversations,
                ..ChatSpec::demo()
            })
            .sessions(MODEL)
        })
        .collect();
    let modes: Vec<Mode> = [Mode::Kvroute, Mode::RingHash, Mode::RoundRobin]
        .into_iter()
        .filter(|m| bench.modes.is_empty() || bench.modes.iter().any(|n| n == m.name()))
        .collect();
    // Per mode: its outcomes and the requests each engine served, over every run. The modes
    // take turns on each workload, so a slow spell of this shared machine falls on all of them.
    let mut pooled: Vec<(Vec<Outcome>, Vec<usize>)> =
        vec![(Vec::new(), vec![0; bench.fleet.engines]); modes.len()];
    for sessions in &workloads {
        for (&mode, (outcomes, per_engine)) in modes.iter().zip(&mut pooled) {
            let (o, served) = run_mode(bench, sessions, mode).await?;
            outcomes.extend(o);
            for (total, n) in per_engine.iter_mut().zip(served) {
                *total += n;
            }
        }
    }
    let mut reports = Vec::new();
    for (mode, (outcomes, per_engine)) in modes.into_iter().zip(pooled) {
        let mut r = ModeReport::new(mode.name(), &outcomes, bench.fleet.engines);
        r.requests_per_engine = per_engine;
        eprintln!("{}", r.line());
        reports.push(r);
    }
    let f = &bench.fleet;
    let title = format!(
        "Real vLLM 0.32 (CPU): {} engines, {}-block caches of {} tokens, multi-turn chat ({} users × 4 turns, {} at a time; {} runs pooled)",
        f.engines,
        f.capacity_blocks,
        crate::vllm::BLOCK_SIZE,
        bench.conversations,
        bench.concurrency,
        bench.repeat.max(1)
    );
    report::write(out, "vllm", &title, &reports)
}

/// One run of one mode on fresh engines: the outcomes and the requests each engine served.
async fn run_mode(
    bench: &VllmBench,
    sessions: &[Session],
    mode: Mode,
) -> Result<(Vec<Outcome>, Vec<usize>)> {
    let mut opts = StackOptions::new(&format!("bench-vllm-{}", mode.name()), mode);
    opts.vllm = Some(bench.fleet.clone());
    opts.hint_timeout_ms = 1000;
    opts.sidecar_toml = bench.sidecar_toml.clone();
    let stack = Stack::start(opts).await?;
    let outcomes = run_sessions(
        &stack.http,
        &Target::Router(stack.envoy_url.clone()),
        sessions,
        bench.concurrency,
        CLIENT_START_GAP,
        &ProgressBar::hidden(),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    if stack.sidecar_url.is_some() {
        // How the sidecar decided, beside the result: hints by rule, blocks matched.
        let metrics = stack.sidecar_metrics().await.unwrap_or_default();
        for line in metrics.lines().filter(|l| {
            l.starts_with("kvroute_hints_total{") || l.starts_with("kvroute_hint_matched_blocks")
        }) {
            eprintln!("  {line}");
        }
        // What the hints promised against what the engines found: more promised than found
        // is over-prediction (blocks evicted between the hint and the prefill).
        let promised = stack
            .hinted_match_tokens(crate::vllm::BLOCK_SIZE)
            .await
            .unwrap_or(0);
        let cached: u64 = outcomes.iter().map(|o| o.cached_tokens).sum();
        eprintln!("  hinted matches {promised} tokens, engines' cached tokens {cached}");
        stack.save_explain().await?;
    }
    let mut per_engine = Vec::new();
    for engine in &stack.engines {
        per_engine.push(served(&stack.http, &engine.address).await?);
    }
    Ok((outcomes, per_engine))
}

/// Requests an engine finished, from its `/metrics`.
async fn served(http: &reqwest::Client, address: &str) -> Result<usize> {
    let text = http
        .get(format!("http://{address}/metrics"))
        .send()
        .await?
        .text()
        .await?;
    Ok(crate::prometheus::sum(&text, "vllm:request_success_total{") as usize)
}
