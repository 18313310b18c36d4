//! The soak on a real Dynamo 1.6.1 fleet: mocker workers on Dynamo's defaults (etcd discovery,
//! its ZMQ event plane) behind a `kv` frontend, kvroute pinning in front. A worker is killed as a
//! pod dies — SIGKILL, nothing said — and comes back as a restarted pod does: a new process, port
//! and instance id, found again in discovery.
//!
//! Mockers answer no `/oracle`, so the probe asks what an engine reports instead: for a recent
//! prompt, each sidecar's matched blocks per worker (read twice, [`SETTLE`] apart; a view that
//! changed is not judged), then the prompt sent with `max_tokens: 1` straight to the frontend,
//! pinned to one worker drawn at random, whose `cached_tokens` say what it held. A random worker
//! catches both an index that claims what an engine lost and one that misses what it holds; the
//! probe's own copy is what the next probe of that prompt must then find indexed. Probes go one
//! at a time: the prompts share system prompts, and one probe's copy landing while another
//! reads the index would be a disagreement of the probe's own making. What the load stores or
//! evicts on the drawn worker between the read and the probe's turn in its queue still is: the
//! steady state's agreement is that noise's level.

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use serde_json::Value;

use super::{index_view, EngineAgreement, Verdict};
use crate::bench_replicas::prompt_hashes;
use crate::client::post_with;
use crate::dynamo::DynamoOptions;
use crate::engines::EngineInfo;
use crate::process::wait_for;
use crate::stack::{Mode, Stack, StackOptions, MODEL};
use crate::workload::Rng;

/// The pinning header Dynamo's frontend honours.
const PIN: &str = "x-worker-instance-id";

/// Between the two reads of a sidecar's view: longer than a mocker's event takes to be indexed
/// on its ZMQ plane (milliseconds), short enough for a probe round of one prompt at a time.
const SETTLE: Duration = Duration::from_millis(50);

/// A Dynamo fleet of `workers` aggregated mockers with `capacity_blocks` each, on Dynamo's
/// defaults, kvroute pinning in front of a `kv` frontend.
pub(crate) fn stack_options(workers: usize, capacity_blocks: usize) -> StackOptions {
    let mut opts = StackOptions::new("soak-dynamo", Mode::Kvroute);
    opts.dynamo = Some(DynamoOptions {
        aggregated: workers,
        capacity_blocks,
        ..DynamoOptions::default()
    });
    opts
}

/// `worker`'s name in the sidecar's decisions.
fn label(worker: &EngineInfo) -> String {
    format!("{}/{:x}", worker.address, worker.dynamo_worker_id)
}

/// SIGKILL worker `n`, as a node or pod dies; when it was killed and when every sidecar had
/// stopped using it (its publisher's connection closed, or its discovery record gone).
pub(crate) async fn kill_worker(stack: &mut Stack, n: usize) -> Result<(Instant, Instant)> {
    let worker = stack.engines.get(n).context("no such worker")?.clone();
    stack.kill(&format!("dynamo-worker-{n}"));
    let killed = Instant::now();
    until_used(stack, &worker, false).await?;
    Ok((killed, Instant::now()))
}

/// Until every sidecar's `kvroute_worker_usable` for `worker` is 1 (`used`) or not. Polled every
/// 5 ms: after a kill, this window is where failures are excused.
async fn until_used(stack: &Stack, worker: &EngineInfo, used: bool) -> Result<()> {
    let series = format!("kvroute_worker_usable{{worker=\"{}\"}}", label(worker));
    let start = Instant::now();
    for sidecar in crate::bench_replicas::sidecars_of(stack) {
        let url = format!("{sidecar}/metrics");
        loop {
            let text = crate::client::get_text(&stack.http, &url).await;
            let text = text.unwrap_or_default();
            if crate::prometheus::series(&text, &series).any(|(_, v)| v == 1.0) == used {
                break;
            }
            anyhow::ensure!(
                start.elapsed() < Duration::from_secs(30),
                "{sidecar}: {series} not {} after 30 s",
                u8::from(used)
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    Ok(())
}

/// Start killed worker `n` again and wait until the frontend serves the new instance and every
/// sidecar uses it: what it stores before a sidecar has connected to its publisher no index can
/// have (Dynamo's ZMQ plane keeps no history), and kvroute pins nothing there until then.
pub(crate) async fn restart_worker(stack: &mut Stack, n: usize) -> Result<()> {
    let worker = stack.start_dynamo_worker(n).await?;
    until_used(stack, &worker, true).await?;
    let frontend = frontend_url(stack)?;
    let (frontend, id) = (&frontend, worker.dynamo_worker_id.to_string());
    let ping = serde_json::json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "ping"}],
        "max_tokens": 1,
    });
    let (ping, id) = (&ping, &id);
    wait_for(
        "the frontend to serve the restarted worker",
        Duration::from_secs(60),
        || async move {
            let o = post_with(frontend, ping, &[(PIN, id.clone())]).await;
            o.ok().then_some(())
        },
    )
    .await
}

fn frontend_url(stack: &Stack) -> Result<String> {
    let frontend = stack.frontend.as_ref().context("no Dynamo frontend")?;
    Ok(format!("http://{frontend}"))
}

/// Per sidecar, the share of `bodies` on which its index matched what a worker drawn at random
/// reported cached (module docs).
pub(crate) async fn agreement(
    stack: &Stack,
    sidecars: &[String],
    bodies: &[Value],
    rng: &mut Rng,
) -> Result<EngineAgreement> {
    use futures::StreamExt as _;
    let frontend = &frontend_url(stack)?;
    let block = u64::from(DynamoOptions::default().block_size);
    let http = &stack.http;
    let one = |(body, worker): (Value, EngineInfo)| async move {
        let hint = kvroute_protocol::hint::HintRequest {
            model: MODEL.into(),
            hashes: prompt_hashes(&body)?,
            finished: Vec::new(),
        };
        let mut views = Vec::new();
        for base in sidecars {
            let first = index_view(http, base, &hint).await;
            tokio::time::sleep(SETTLE).await;
            let second = index_view(http, base, &hint).await;
            views.push((base, (first == second).then_some(second)));
        }
        let mut probe = body;
        probe["max_tokens"] = 1.into();
        let pin = [(PIN, worker.dynamo_worker_id.to_string())];
        let o = post_with(frontend, &probe, &pin).await;
        let name = label(&worker);
        let verdicts = views.into_iter().map(|(base, view)| match (view, o.ok()) {
            (None, _) => Verdict::Unsettled,
            (Some(_), false) => Verdict::Differs(format!("{name}: the probe failed: {o:?}")),
            (Some(None), true) => Verdict::Differs(format!("{base}: no decision found")),
            (Some(Some(view)), true) => {
                // An engine computes at least a prompt's last token: a prompt held whole
                // reports one block fewer cached when it ends on a block boundary.
                let reusable = o.prompt_tokens.saturating_sub(1) / block;
                let indexed = view
                    .iter()
                    .find(|(w, _)| *w == name)
                    .map_or(0, |(_, m)| (*m).min(reusable));
                let held = o.cached_tokens / block;
                if indexed == held {
                    Verdict::Agrees
                } else {
                    Verdict::Differs(format!("{base}: {name} indexed {indexed} held {held}"))
                }
            }
        });
        anyhow::Ok(verdicts.collect())
    };
    let drawn: Vec<(Value, EngineInfo)> = bodies
        .iter()
        .map(|b| {
            let w = rng.range(0, stack.engines.len() - 1);
            (b.clone(), stack.engines[w].clone())
        })
        .collect();
    let answers: Vec<Result<Vec<Verdict>>> = futures::stream::iter(drawn).then(one).collect().await;
    EngineAgreement::tally(answers, sidecars.len())
}
