//! `kvroute-bench dynamo`: kvroute against Dynamo's own KV router, on one real Dynamo 1.6.1
//! mocker fleet configuration and one request stream.
//!
//! Modes (each on a fresh fleet, so every one starts with empty caches):
//! - `dynamo_kv`: straight to a Dynamo frontend in `--router-mode kv` (Dynamo's KV router);
//! - `dynamo_round_robin`: straight to a frontend in `--router-mode round-robin`;
//! - `kvroute`: through Envoy with the kvroute filter in pin mode, in front of a `kv` frontend
//!   (the deployment docs/operations.md prescribes; unpinned requests are Dynamo's to route).

use std::path::Path;
use std::time::Duration;

use anyhow::Result;
use indicatif::ProgressBar;
use serde_json::json;

use crate::client::{run_sessions, Outcome, Target, CLIENT_START_GAP};
use crate::dynamo::DynamoOptions;
use crate::report::{self, ModeReport};
use crate::stack::MODEL;
use crate::workload::{ChatSpec, ChatWorkload, Session};
use crate::{Mode, Stack, StackOptions};

/// What to run.
#[derive(Debug, Clone)]
pub struct DynamoBench {
    /// The fleet (`router_mode` is set per mode).
    pub fleet: DynamoOptions,
    /// Conversations of the multi-turn chat workload.
    pub conversations: usize,
    /// Conversations in flight.
    pub concurrency: usize,
}

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
    for (mode, router_mode, through_envoy) in [
        ("dynamo_kv", "kv", false),
        ("dynamo_round_robin", "round-robin", false),
        ("kvroute", "kv", true),
    ] {
        let outcomes = run_mode(bench, &sessions, mode, router_mode, through_envoy).await?;
        let (outcomes, workers) = by_worker(outcomes);
        let r = ModeReport::new(mode, &outcomes, workers);
        eprintln!("{}", r.line());
        reports.push(r);
    }
    let f = &bench.fleet;
    let title = format!(
        "Real Dynamo 1.6.1 mocker fleet: {} aggregated, {} prefill, {} decode workers, {}-block caches, multi-turn chat ({} conversations, {} at a time)",
        f.aggregated, f.prefill, f.decode, f.capacity_blocks, bench.conversations, bench.concurrency
    );
    report::write(out, "dynamo", &title, &reports)
}

async fn run_mode(
    bench: &DynamoBench,
    sessions: &[Session],
    mode: &str,
    router_mode: &str,
    through_envoy: bool,
) -> Result<Vec<Outcome>> {
    let mut opts = StackOptions::new(
        &format!("bench-dynamo-{mode}"),
        if through_envoy {
            Mode::Kvroute
        } else {
            Mode::RoundRobin
        },
    );
    opts.dynamo = Some(DynamoOptions {
        router_mode: router_mode.into(),
        ..bench.fleet.clone()
    });
    let stack = Stack::start(opts).await?;
    let base = if through_envoy {
        stack.envoy_url.clone()
    } else {
        format!("http://{}", stack.frontend.as_ref().expect("a frontend"))
    };
    let progress = ProgressBar::hidden();
    let outcomes = run_sessions(
        &stack.http,
        &Target::Router(base),
        sessions,
        bench.concurrency,
        CLIENT_START_GAP,
        &progress,
    )
    .await;
    // Let the last requests' events land before the fleet goes.
    tokio::time::sleep(Duration::from_millis(200)).await;
    Ok(outcomes)
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
