//! `kvroute-bench vllm`: kvroute against Envoy's ring hash alone and round robin, on real vLLM
//! 0.32 engines on CPU (`make venv-vllm`), one multi-turn chat request stream whose shape —
//! system prompts, conversations, turns, think time, output length — the command sets.
//!
//! Modes (each on a fresh fleet, so every one starts with empty caches): `kvroute` (hints, ring
//! hash fallback), `ring_hash` (the filter sets only the fallback key: `hints: false`),
//! `round_robin` (plain Envoy). Requests per engine come from each engine's own
//! `vllm:request_success_total`, since vLLM does not say in a response who served it.

use std::path::Path;
use std::time::Duration;

use anyhow::Result;
use indicatif::ProgressBar;

use crate::client::{run_sessions_paced, Outcome, Pace, Target, CLIENT_START_GAP};
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
    /// The multi-turn chat; run `r` uses seed `chat.seed + r`.
    pub chat: ChatSpec,
    /// Conversations in flight.
    pub concurrency: usize,
    /// Each turn after a conversation's first waits up to this long (the user thinking).
    pub think_max: Duration,
    /// Extra sidecar configuration (`[routing]` settings to compare).
    pub sidecar_toml: String,
    /// Only these modes (`kvroute`, `ring_hash`, `round_robin`; empty: all).
    pub modes: Vec<String>,
    /// More kvroute modes, each (name, sidecar configuration added to `sidecar_toml`),
    /// reported as `kvroute:name`: a rule change measured in turns with what it changes.
    pub variants: Vec<(String, String)>,
    /// Runs per mode, each with its own workload seed and fresh engines; a mode's report pools
    /// them (one run of 64 requests moves by ±2 points from timing alone).
    pub repeat: usize,
}

/// Run every mode; write `vllm.json` and `vllm.md` to `out`; return the markdown.
pub async fn run(bench: &VllmBench, out: &Path) -> Result<String> {
    let workloads: Vec<Vec<Session>> = (0..bench.repeat.max(1) as u64)
        .map(|r| {
            ChatWorkload::generate(&ChatSpec {
                seed: bench.chat.seed + r,
                ..bench.chat.clone()
            })
            .sessions(MODEL)
        })
        .collect();
    let mut modes: Vec<Run> = [Mode::Kvroute, Mode::RingHash, Mode::RoundRobin]
        .into_iter()
        .filter(|m| bench.modes.is_empty() || bench.modes.iter().any(|n| n == m.name()))
        .map(|mode| Run {
            name: mode.name().to_owned(),
            mode,
            sidecar_toml: bench.sidecar_toml.clone(),
        })
        .collect();
    modes.extend(bench.variants.iter().map(|(name, toml)| Run {
        name: format!("kvroute:{name}"),
        mode: Mode::Kvroute,
        sidecar_toml: format!("{}\n{toml}", bench.sidecar_toml),
    }));
    // Per mode: its outcomes and the requests each engine served, over every run. The modes
    // take turns on each workload, so a slow spell of this shared machine falls on all of them.
    let mut pooled: Vec<(Vec<Outcome>, Vec<usize>)> =
        vec![(Vec::new(), vec![0; bench.fleet.engines]); modes.len()];
    for (seed, sessions) in workloads.iter().enumerate() {
        for (run, (outcomes, per_engine)) in modes.iter().zip(&mut pooled) {
            let (o, served) = run_mode(bench, sessions, run).await?;
            let single = ModeReport::new(&run.name, &o, bench.fleet.engines);
            eprintln!(
                "  run {seed} {}: hit rate {:.1}%",
                run.name,
                single.hit_rate * 100.0
            );
            outcomes.extend(o);
            for (total, n) in per_engine.iter_mut().zip(served) {
                *total += n;
            }
        }
    }
    let mut reports = Vec::new();
    for (run, (outcomes, per_engine)) in modes.into_iter().zip(pooled) {
        let mut r = ModeReport::new(&run.name, &outcomes, bench.fleet.engines);
        r.requests_per_engine = per_engine;
        eprintln!("{}", r.line());
        reports.push(r);
    }
    let (f, c) = (&bench.fleet, &bench.chat);
    let title = format!(
        "Real vLLM 0.32 (CPU): {} engines, {}-block caches of {} tokens, multi-turn chat ({} system prompts of {:?} words, {} users × {} turns, {} at a time, think time up to {} ms, max_tokens {}; {} runs pooled)",
        f.engines,
        f.capacity_blocks,
        crate::vllm::BLOCK_SIZE,
        c.system_prompt_words.len(),
        c.system_prompt_words,
        c.conversations,
        c.turns,
        bench.concurrency,
        bench.think_max.as_millis(),
        c.max_tokens,
        bench.repeat.max(1)
    );
    report::write(out, "vllm", &title, &reports)
}

/// A mode as run: its report name and sidecar configuration.
struct Run {
    name: String,
    mode: Mode,
    sidecar_toml: String,
}

/// One run of one mode on fresh engines: the outcomes and the requests each engine served.
async fn run_mode(
    bench: &VllmBench,
    sessions: &[Session],
    run: &Run,
) -> Result<(Vec<Outcome>, Vec<usize>)> {
    let dir = format!("bench-vllm-{}", run.name.replace(':', "-"));
    let mut opts = StackOptions::new(&dir, run.mode);
    opts.vllm = Some(bench.fleet.clone());
    opts.hint_timeout_ms = 1000;
    opts.sidecar_toml = run.sidecar_toml.clone();
    let stack = Stack::start(opts).await?;
    let pace = Pace {
        start_gap: CLIENT_START_GAP,
        think_max: bench.think_max,
    };
    let outcomes = run_sessions_paced(
        &stack.http,
        &Target::Router(stack.envoy_url.clone()),
        sessions,
        bench.concurrency,
        pace,
        &ProgressBar::hidden(),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Each request's session, turn and cache, to split a mode's hit rate by turn and app.
    let requests: Vec<serde_json::Value> = outcomes
        .iter()
        .map(|o| {
            serde_json::json!({
                "session": o.session,
                "turn": o.turn,
                "status": o.status,
                "prompt_tokens": o.prompt_tokens,
                "cached_tokens": o.cached_tokens,
                "ttft_ms": o.ttft.as_secs_f64() * 1000.0,
            })
        })
        .collect();
    std::fs::write(
        stack.dir.join("requests.json"),
        serde_json::to_vec(&requests)?,
    )?;
    if stack.sidecar_url.is_some() {
        // How the sidecar decided, beside the result: hints by rule, blocks matched.
        let metrics = stack.sidecar_metrics().await.unwrap_or_default();
        std::fs::write(stack.dir.join("sidecar-metrics.txt"), &metrics)?;
        for line in metrics.lines().filter(|l| {
            l.starts_with("kvroute_hints_total{")
                || l.starts_with("kvroute_hint_matched_blocks")
                || l.starts_with("kvroute_tickets_total{")
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
    let per_engine = crate::vllm::served(&stack.http, &stack.engines).await?;
    Ok((outcomes, per_engine))
}
