//! `kvroute-bench replicas`: 1, 2 and 4 sidecar + Envoy pairs (the pods of an ingress) in front
//! of one simulated fleet, every sidecar losing 0% or 10% of the KV-event messages (each its
//! own), with and without the replica plane's repair (`[replicas] reconcile`). The client spreads
//! requests over the Envoys in turn, as a Kubernetes Service without session affinity does, so
//! the turns of one conversation land on different replicas. Reported per scenario: aggregate
//! and per-replica hit rate, agreement (the fraction of probe prompts on which every sidecar,
//! asked directly, names the same first worker), messages lost and filled, snapshots taken,
//! imbalance, TTFT, and each replica's predicted against actual hit rate (what its hints said
//! the engines held, and what the engines reported). On the hot-prefix and system-prompt chats,
//! 4 replicas run with and without sharing their requests in flight (`[replicas] share_load`):
//! without it each weighs only its own quarter of the load.

use std::time::Duration;

use anyhow::{Context as _, Result};
use kvroute_protocol::hint::{encode_finished, Finished, Usage, FINISHED_PATH, HINT_CONTENT_TYPE};
use serde_json::{json, Value};

use crate::bench::{self, Scale};
use crate::client::{Outcome, Target};
use crate::prometheus;
use crate::stack::{ReplicaOptions, MODEL};
use crate::{paths, Mode, Stack, StackOptions};

/// One scenario: replicas, the fraction of events each loses, whether they repair.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scenario {
    /// Sidecar + Envoy pairs.
    pub replicas: usize,
    /// Fraction of KV-event messages each sidecar loses.
    pub loss: f64,
    /// `[replicas] reconcile`.
    pub reconcile: bool,
    /// `[replicas] share_load`.
    pub share_load: bool,
}

/// The scenarios: the single lossless replica (the baseline), a single lossy one (nothing to
/// repair from), then 2 and 4 replicas lossless, lossy without repair, lossy with it.
pub fn scenarios() -> Vec<Scenario> {
    let s = |replicas, loss, reconcile| Scenario {
        replicas,
        loss,
        reconcile,
        share_load: true,
    };
    vec![
        s(1, 0.0, true),
        s(1, 0.1, true),
        s(2, 0.0, true),
        s(2, 0.1, false),
        s(2, 0.1, true),
        s(4, 0.0, true),
        s(4, 0.1, false),
        s(4, 0.1, true),
    ]
}

/// The load-sharing comparison: one replica (the baseline), then 4 without and with sharing.
pub fn sharing_scenarios() -> Vec<Scenario> {
    let s = |replicas, share_load| Scenario {
        replicas,
        loss: 0.0,
        reconcile: true,
        share_load,
    };
    vec![s(1, true), s(4, false), s(4, true)]
}

/// What the benchmark runs.
#[derive(Debug, Clone)]
pub struct ReplicasBench {
    /// Input sizes (the multi-turn chat and the conversation trace, as in `routing`).
    pub scale: Scale,
    /// Simulated engines.
    pub engines: usize,
    /// `[replicas] interval_ms`.
    pub interval_ms: u64,
    /// Probe prompts asked of every sidecar after a run.
    pub probes: usize,
    /// The scenarios run ([`scenarios`]; the first of each workload is its baseline).
    pub scenarios: Vec<Scenario>,
    /// The workloads run, by name.
    pub workloads: Vec<&'static str>,
    /// The workloads run with [`sharing_scenarios`].
    pub sharing: Vec<&'static str>,
    /// Extra configuration for every sidecar.
    pub sidecar_toml: String,
}

impl ReplicasBench {
    /// Every scenario on the multi-turn chat and the conversation trace: 4 engines, digests
    /// every second, 200 probes.
    pub fn new(scale: Scale) -> Self {
        ReplicasBench {
            scale,
            engines: 4,
            interval_ms: 1000,
            probes: 200,
            scenarios: scenarios(),
            workloads: vec!["conversation_trace", "multi_turn"],
            sharing: vec!["hot_prefix", "system_prompt"],
            sidecar_toml: String::new(),
        }
    }
}

/// Ask the sidecar at `base` for a hint, as the filter does; `None` when it does not answer.
pub async fn ask_hint(
    http: &reqwest::Client,
    base: &str,
    req: &kvroute_protocol::hint::HintRequest,
) -> Option<kvroute_protocol::hint::HintResponse> {
    use kvroute_protocol::hint::{HINT_CONTENT_TYPE, HINT_PATH};
    http.post(format!("{base}{HINT_PATH}"))
        .header("content-type", HINT_CONTENT_TYPE)
        .body(req.encode())
        .send()
        .await
        .ok()?
        .json()
        .await
        .ok()
}

/// The block hashes of a request body for the example model, as the filter computes them.
pub fn prompt_hashes(body: &Value) -> Result<Vec<kvroute_protocol::PrefixHash>> {
    static PRE: std::sync::OnceLock<kvroute_prompt::Preprocessor> = std::sync::OnceLock::new();
    let pre = match PRE.get() {
        Some(p) => p,
        None => {
            let bundle = kvroute_prompt::model_dir::load_bundle(&paths::model_dir(), MODEL, 16)?;
            let built = kvroute_prompt::Preprocessor::from_bundle(&bundle)?;
            PRE.get_or_init(|| built)
        }
    };
    let text = body.to_string();
    let req = kvroute_prompt::request::LlmRequest::parse(text.as_bytes())?;
    Ok(pre.hashes(&req)?.hashes)
}

/// The fraction of `bodies` for which every sidecar in `sidecars` names the same first worker,
/// asked directly with the prompt's hashes. The sidecars are asked at once and their tickets
/// reported finished right after, and the next prompt waits until replicas sharing their load
/// have shared that it is gone: so the sidecars' loads stay alike and only their indexes can
/// differ.
pub async fn agreement(
    http: &reqwest::Client,
    sidecars: &[String],
    bodies: &[Value],
) -> Result<f64> {
    let (mut same, mut asked) = (0usize, 0usize);
    for body in bodies {
        let hint = kvroute_protocol::hint::HintRequest {
            model: MODEL.into(),
            hashes: prompt_hashes(body)?,
            finished: Vec::new(),
        };
        let answers =
            futures::future::join_all(sidecars.iter().map(|base| ask_hint(http, base, &hint)))
                .await;
        let mut first = Vec::new();
        for (base, answer) in sidecars.iter().zip(answers) {
            let answer = answer.with_context(|| format!("asking {base} for a hint"))?;
            if let Some(ticket) = answer.ticket {
                let done = [Finished {
                    ticket,
                    usage: Usage::Unanswered,
                }];
                http.post(format!("{base}{FINISHED_PATH}"))
                    .header("content-type", HINT_CONTENT_TYPE)
                    .body(encode_finished(&done))
                    .send()
                    .await
                    .with_context(|| format!("reporting to {base}"))?;
            }
            first.push(answer.workers.first().cloned());
        }
        // Two share intervals (the benchmark's 10 ms each) and a little.
        tokio::time::sleep(Duration::from_millis(25)).await;
        asked += 1;
        same += usize::from(first[0].is_some() && first.iter().all(|f| *f == first[0]));
    }
    Ok(same as f64 / asked.max(1) as f64)
}

/// Every `n`-th body of the sessions, `probes` of them at most: prompts the fleet has seen.
fn probe_bodies(workload: &bench::Workload, probes: usize) -> Vec<Value> {
    let all: Vec<&Value> = workload.sessions.iter().flat_map(|s| &s.bodies).collect();
    let step = (all.len() / probes.max(1)).max(1);
    all.into_iter()
        .step_by(step)
        .take(probes)
        .cloned()
        .collect()
}

async fn run_scenario(
    bench: &ReplicasBench,
    workload: &bench::Workload,
    scenario: Scenario,
) -> Result<Value> {
    let name = format!(
        "bench-replicas-{}-{}x-{}-{}-{}",
        workload.name,
        scenario.replicas,
        (scenario.loss * 100.0).round(),
        if scenario.reconcile {
            "repair"
        } else {
            "norepair"
        },
        if scenario.share_load {
            "shared"
        } else {
            "alone"
        }
    );
    let mut opts = StackOptions::new(&name, Mode::Kvroute);
    opts.sim = bench::fleet(bench.engines, workload.capacity_blocks);
    opts.sidecar_toml = bench.sidecar_toml.clone();
    opts.replicas = Some(ReplicaOptions {
        count: scenario.replicas,
        interval_ms: bench.interval_ms,
        loss: scenario.loss,
        lossy: None,
        reconcile: scenario.reconcile,
        share_load: scenario.share_load,
        // The simulator's requests last tens of milliseconds, real ones seconds: the shares are
        // made as much fresher as the requests are shorter.
        load_interval_ms: 10,
    });
    let mut stack = Stack::start(opts).await?;
    let routers: Vec<String> = stack.replicas.iter().map(|r| r.envoy_url.clone()).collect();
    let target = Target::Spread(routers);
    let label = format!(
        "{}x loss {} {}{}",
        scenario.replicas,
        scenario.loss,
        if scenario.reconcile {
            "repair"
        } else {
            "no repair"
        },
        if scenario.share_load { "" } else { " unshared" }
    );
    let outcomes = bench::run_workload(
        &stack.http,
        &target,
        workload,
        crate::client::CLIENT_START_GAP,
        &label,
    )
    .await?;
    stack.check_alive()?;
    // Events still on their way, and a repair round: then every replica is asked the same.
    tokio::time::sleep(Duration::from_millis(2 * bench.interval_ms)).await;
    let sidecars: Vec<String> = stack
        .replicas
        .iter()
        .map(|r| r.sidecar_url.clone())
        .collect();
    let agreement = agreement(
        &stack.http,
        &sidecars,
        &probe_bodies(workload, bench.probes),
    )
    .await?;
    let mut sums = [0.0; 5];
    let (mut predicted, mut actual) = (Vec::new(), Vec::new());
    for base in &sidecars {
        let text = crate::client::get_text(&stack.http, &format!("{base}/metrics"))
            .await
            .unwrap_or_default();
        let one = |name: &str| prometheus::sum_where(&text, |l| l.starts_with(name));
        let prompt = one("kvroute_served_prompt_tokens_total").max(1.0);
        predicted.push(one("kvroute_predicted_cached_tokens_total") / prompt);
        actual.push(one("kvroute_actual_cached_tokens_total") / prompt);
        for (sum, series) in sums.iter_mut().zip([
            "kvroute_test_dropped_events_total",
            "kvroute_replica_lost_messages_total{outcome=\"filled\"}",
            "kvroute_replica_lost_messages_total{outcome=\"unfilled\"}",
            "kvroute_replica_repairs_total{kind=\"peer_snapshot\"}",
            "kvroute_replica_divergences_total",
        ]) {
            *sum += one(series);
        }
    }
    // Requests each Envoy sent where its sidecar said, and hints that came too late.
    let mut envoys = [0u64; 3];
    for r in &stack.replicas {
        for (sum, stat) in envoys.iter_mut().zip([
            "wasmcustom.kvroute.requests",
            "wasmcustom.kvroute.hinted",
            "wasmcustom.kvroute.sidecar.timeouts",
        ]) {
            *sum += stack.envoy_stat_at(&r.admin_url, stat).await.unwrap_or(0);
        }
    }
    let per_replica: Vec<f64> = (0..scenario.replicas)
        .map(|r| {
            let mine: Vec<Outcome> = outcomes
                .iter()
                .filter(|o| o.router == Some(r))
                .cloned()
                .collect();
            bench::summary(&mine, bench.engines)["hit_rate"]
                .as_f64()
                .unwrap_or(0.0)
        })
        .collect();
    let mut row = bench::summary(&outcomes, bench.engines);
    let fields = json!({
        "workload": workload.name,
        "replicas": scenario.replicas,
        "loss": scenario.loss,
        "reconcile": scenario.reconcile,
        "share_load": scenario.share_load,
        "agreement": agreement,
        "predicted_per_replica": predicted,
        "actual_per_replica": actual,
        "hit_rate_per_replica": per_replica,
        "events_dropped": sums[0],
        "messages_filled": sums[1],
        "messages_unfilled": sums[2],
        "snapshots": sums[3],
        "divergences": sums[4],
        "hinted": envoys[1] as f64 / envoys[0].max(1) as f64,
        "hint_timeouts": envoys[2],
    });
    if let (Some(row), Some(fields)) = (row.as_object_mut(), fields.as_object()) {
        row.extend(fields.clone());
    }
    Ok(row)
}

/// Run the scenarios on the workloads; write `replicas.json` (a list of rows, one per scenario
/// and workload) and `replicas.md` into `out`. Each row's `hit_rate_vs_single` is against the
/// first scenario of its workload (the single lossless replica).
pub async fn run(bench: &ReplicasBench, out: &std::path::Path) -> Result<String> {
    let mut rows = Vec::new();
    let sharing = sharing_scenarios();
    for workload in bench::workloads(bench.scale)? {
        let scenarios = if bench.workloads.contains(&workload.name) {
            &bench.scenarios
        } else if bench.sharing.contains(&workload.name) {
            &sharing
        } else {
            continue;
        };
        let mut baseline = None;
        for &scenario in scenarios {
            let mut row = run_scenario(bench, &workload, scenario)
                .await
                .with_context(|| format!("{} / {scenario:?}", workload.name))?;
            let hit = row["hit_rate"].as_f64().unwrap_or(0.0);
            let base = *baseline.get_or_insert(hit);
            row["hit_rate_vs_single"] = json!(if base > 0.0 { hit / base } else { 0.0 });
            rows.push(row);
        }
    }
    std::fs::create_dir_all(out)?;
    let doc = Value::from(rows);
    std::fs::write(
        out.join("replicas.json"),
        serde_json::to_string_pretty(&doc)?,
    )?;
    let table = markdown(&doc);
    std::fs::write(out.join("replicas.md"), &table)?;
    Ok(table)
}

/// The markdown table of a `replicas.json` document.
pub fn markdown(doc: &Value) -> String {
    let mut out = String::from(
        "| workload | replicas | loss | repair | shared load | hit rate | vs 1 lossless | per replica | predicted / actual per replica | agreement | lost → filled / unfilled | snapshots | imbalance | TTFT p95 (ms) | hinted | errors |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in doc.as_array().into_iter().flatten() {
        let f = |k: &str| r[k].as_f64().unwrap_or(0.0);
        let per: Vec<String> = r["hit_rate_per_replica"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|h| format!("{:.1}", h.as_f64().unwrap_or(0.0) * 100.0))
            .collect();
        let rate = |k: &str, i: usize| r[k][i].as_f64().unwrap_or(0.0) * 100.0;
        let truth: Vec<String> = (0..r["predicted_per_replica"].as_array().map_or(0, Vec::len))
            .map(|i| {
                format!(
                    "{:.1}/{:.1}",
                    rate("predicted_per_replica", i),
                    rate("actual_per_replica", i)
                )
            })
            .collect();
        out.push_str(&format!(
            "| {} | {} | {:.0}% | {} | {} | {:.1}% | {:.1}% | {} | {} | {:.1}% | {:.0} → {:.0} / {:.0} | {:.0} | {:.2} | {:.1} | {:.1}% | {} |\n",
            r["workload"].as_str().unwrap_or(""),
            r["replicas"],
            f("loss") * 100.0,
            if r["reconcile"] == true { "on" } else { "off" },
            if r["share_load"] == false { "off" } else { "on" },
            f("hit_rate") * 100.0,
            f("hit_rate_vs_single") * 100.0,
            per.join(" / "),
            truth.join(" · "),
            f("agreement") * 100.0,
            f("events_dropped"),
            f("messages_filled"),
            f("messages_unfilled"),
            f("snapshots"),
            f("imbalance"),
            f("ttft_p95_ms"),
            f("hinted") * 100.0,
            r["errors"],
        ));
    }
    out
}
