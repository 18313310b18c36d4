//! `kvroute-bench replicas`: 1, 2, 4 and 8 sidecar + Envoy pairs (the pods of an ingress) in
//! front of one simulated fleet whose caches evict, every sidecar reading the engines' KV events
//! through its own lossy NATS proxy ([`crate::lossy_nats`]: 10% of the `kv-events` messages
//! lost on the transport, different ones for each sidecar, the product unchanged; the replica
//! plane itself on the real nats-server), repairing from each other (`[replicas] reconcile`).
//! Beside them, per workload, one lossless replica (the reference) and for 2, 4 and 8 Envoys
//! the **shared-index bound**: every Envoy asks one lossless sidecar (a test-only arrangement of
//! the harness, [`StackOptions::shared_sidecar`]): one index, what separate replicas can at
//! best reach. The client spreads requests over the Envoys in turn, as a Kubernetes Service
//! without session affinity does, so the turns of one conversation land on different replicas.
//!
//! Agreement is judged from outside ([`probe`]): after the traffic, three digest intervals
//! later, every sidecar is asked directly for the same probe prompts; agreement is the share of
//! probes on which every sidecar names the same first worker with the same matched blocks.
//! Reported per scenario besides: aggregate and per-Envoy hit rate, each sidecar's mean matched
//! blocks over the probes, each sidecar's predicted against actual hit rate (its `/metrics`),
//! the proxies' forwarded and dropped messages, messages filled by peers, snapshots, the blocks
//! the engines evicted (the simulator counts them), imbalance and TTFT. With `--sharing`, on the
//! hot-prefix and system-prompt chats 4 lossless replicas run with and without sharing their
//! requests in flight (`[replicas] share_load`).

use std::collections::HashSet;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use kvroute_protocol::hint::{
    encode_finished, Finished, HintResponse, Usage, FINISHED_PATH, HINT_CONTENT_TYPE,
};
use serde_json::{json, Value};

use crate::bench::{self, Scale};
use crate::client::{Outcome, Target};
use crate::prometheus;
use crate::stack::{ReplicaOptions, TransportLoss, MODEL};
use crate::{paths, Mode, Stack, StackOptions};

/// One scenario: replicas, the share of KV-event messages each loses on its transport, whether
/// they repair, whether they share their load, or one index for every Envoy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scenario {
    /// Envoys (and, unless `shared_index`, sidecars: one per Envoy).
    pub replicas: usize,
    /// Share of the KV-event messages each sidecar's proxy drops.
    pub loss: f64,
    /// `[replicas] reconcile`.
    pub reconcile: bool,
    /// `[replicas] share_load`.
    pub share_load: bool,
    /// Every Envoy asks one sidecar ([`StackOptions::shared_sidecar`]): the bound.
    pub shared_index: bool,
}

impl Scenario {
    /// `replicas` pairs, each sidecar losing `loss` of the events, repairing, sharing load.
    pub fn lossy(replicas: usize, loss: f64) -> Self {
        Scenario {
            replicas,
            loss,
            reconcile: true,
            share_load: true,
            shared_index: false,
        }
    }

    /// `replicas` Envoys asking one lossless sidecar.
    pub fn shared_index(replicas: usize) -> Self {
        Scenario {
            shared_index: true,
            ..Scenario::lossy(replicas, 0.0)
        }
    }

    /// The reference: one lossless replica.
    pub fn reference() -> Self {
        Scenario::lossy(1, 0.0)
    }

    /// How a progress line and the table name it.
    pub fn label(&self) -> String {
        if self.shared_index {
            return format!("{} Envoys, 1 shared index", self.replicas);
        }
        format!(
            "{}x loss {:.0}%{}{}",
            self.replicas,
            self.loss * 100.0,
            if self.reconcile { "" } else { " no repair" },
            if self.share_load { "" } else { " unshared" }
        )
    }
}

/// The scenarios for these replica counts at `loss`: the reference (one lossless replica), then
/// per count the lossy replicas, (from 2 on, with `lossless`) as many lossless replicas — what
/// separate replicas cost without any loss — and (from 2 on) the shared-index bound.
pub fn scenarios(counts: &[usize], loss: f64, lossless: bool) -> Vec<Scenario> {
    let mut out = vec![Scenario::reference()];
    for &n in counts {
        out.push(Scenario::lossy(n, loss));
        if n > 1 && lossless && loss > 0.0 {
            out.push(Scenario::lossy(n, 0.0));
        }
        if n > 1 {
            out.push(Scenario::shared_index(n));
        }
    }
    out
}

/// The load-sharing comparison: one replica (the baseline), then 4 without and with sharing.
pub fn sharing_scenarios() -> Vec<Scenario> {
    SHARING.to_vec()
}

/// What the benchmark runs.
#[derive(Debug, Clone)]
pub struct ReplicasBench {
    /// Input sizes.
    pub scale: Scale,
    /// Simulated engines.
    pub engines: usize,
    /// `[replicas] interval_ms`.
    pub interval_ms: u64,
    /// Probe prompts asked of every sidecar after a run.
    pub probes: usize,
    /// The scenarios run on each of `workloads` ([`scenarios`]; the first is the reference).
    pub scenarios: Vec<Scenario>,
    /// The loss workloads run, by name ([`loss_workloads`]).
    pub workloads: Vec<&'static str>,
    /// The workloads run with [`sharing_scenarios`] (of [`bench::workloads`]).
    pub sharing: Vec<&'static str>,
    /// Cache capacity per engine, in blocks, for the loss workloads (`None`: each its own,
    /// [`loss_workloads`]).
    pub capacity_blocks: Option<usize>,
    /// Extra configuration for every sidecar.
    pub sidecar_toml: String,
}

/// Replica counts of the full run.
pub const COUNTS: [usize; 4] = [1, 2, 4, 8];
/// Replica counts of a quick run (4 left out to stay within 3 minutes).
pub const QUICK_COUNTS: [usize; 3] = [1, 2, 8];
/// Share of the KV-event messages each lossy sidecar's transport drops.
pub const LOSS: f64 = 0.1;
/// Worker threads of each Envoy of the loss scenarios (the load-sharing ones keep the stack's
/// default, 2): 8 Envoys on 2 cores have no use for more, and each thread's VM loads the model
/// bundle at start.
pub const ENVOY_CONCURRENCY: usize = 1;
/// Seed of the first sidecar's proxy (each scenario the same: sidecar `i` of any scenario
/// loses the same share of its stream).
pub const PROXY_SEED: u64 = 0x5eed_0014;

impl ReplicasBench {
    /// Every count ([`COUNTS`]; [`QUICK_COUNTS`] in a quick run, without the lossless replicas)
    /// on the multi-turn chat and the agent loop (the chat alone in a quick run): 4 engines,
    /// digests every second, 200 probes (100 in a quick run); no load-sharing runs (`sharing`:
    /// hot prefix, system prompt).
    pub fn new(scale: Scale) -> Self {
        ReplicasBench {
            scale,
            engines: 4,
            interval_ms: 1000,
            probes: if scale == Scale::Full { 200 } else { 100 },
            scenarios: if scale == Scale::Full {
                scenarios(&COUNTS, LOSS, true)
            } else {
                scenarios(&QUICK_COUNTS, LOSS, false)
            },
            workloads: if scale == Scale::Full {
                vec!["multi_turn", "agent_loop"]
            } else {
                vec!["multi_turn"]
            },
            sharing: vec![],
            capacity_blocks: None,
            sidecar_toml: String::new(),
        }
    }
}

/// Cache capacity per engine for the multi-turn chat of this benchmark: 256 blocks, a quarter
/// of routing's [`bench::CHAT_CAPACITY`]. With 1,024 the full chat (a working set of 3,277
/// blocks) fits in the 4 engines' 4,096 and the quick one (1,694) evicts nothing; with 256
/// (1,024 for the fleet) one engine holds under a tenth of the working set and the engines
/// evict throughout (`evicted_blocks` in every row).
pub const REPLICA_CHAT_CAPACITY: usize = 256;
/// Cache capacity per engine for the agent loop of this benchmark (working set 2,894 blocks):
/// at 256 its 8 agents' growing traces thrash the caches and one lossless replica's hit rate
/// moved 53–71% run to run; at 512 (2,048 for the fleet) the engines still evict about a
/// thousand blocks a run and the hit rate repeats within half a point.
pub const REPLICA_AGENT_CAPACITY: usize = 512;
/// Cache capacity per engine for the conversation trace of this benchmark (`--workloads
/// conversation_trace`: 1,500 requests, a working set of ~59,000 blocks): a quarter of routing's
/// [`bench::TRACE_CAPACITY`].
pub const REPLICA_TRACE_CAPACITY: usize = bench::TRACE_CAPACITY / 4;

/// The loss benchmark's workloads, on caches that evict: the multi-turn chat (4 turns per user,
/// 48 users in a quick run, 96 in a full one), the agent loop (8 steps per agent, 12 agents, 24)
/// and, only when asked for, the conversation trace (too slow for every run at a size where its
/// requests share prefixes: 1,500 requests). Small enough that 8 sidecar + Envoy pairs on 2
/// cores run each in well under a minute.
pub fn loss_workloads(scale: Scale) -> Result<Vec<bench::Workload>> {
    let mut out = Vec::new();
    for mut w in bench::workloads(Scale::Full)? {
        let size = |smoke: usize, quick: usize, full: usize| match scale {
            Scale::Smoke => smoke,
            Scale::Quick => quick,
            Scale::Full => full,
        };
        let (keep, capacity) = match w.name {
            "multi_turn" => (size(8, 48, 96), REPLICA_CHAT_CAPACITY),
            "agent_loop" => (size(2, 12, 24), REPLICA_AGENT_CAPACITY),
            "conversation_trace" => (size(30, 1500, 1500), REPLICA_TRACE_CAPACITY),
            _ => continue,
        };
        w.sessions.truncate(keep);
        // The smoke run's few sessions evict only from a smaller cache.
        w.capacity_blocks = if scale == Scale::Smoke {
            capacity / 4
        } else {
            capacity
        };
        out.push(w);
    }
    Ok(out)
}

/// Distinct KV blocks of every prompt of `workload` (block size 16): what the fleet would hold
/// to never miss twice.
pub fn working_set(workload: &bench::Workload) -> Result<usize> {
    let mut seen = HashSet::new();
    for body in workload.sessions.iter().flat_map(|s| &s.bodies) {
        seen.extend(prompt_hashes(body)?);
    }
    Ok(seen.len())
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

/// What the sidecars, asked the same probe prompts, answered ([`probe`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Agreement {
    /// Probe prompts asked.
    pub probes: usize,
    /// Share of the probes on which every sidecar named the same first worker with the same
    /// matched blocks (and named one): asked all at once, or, where they differed, asked again
    /// one sidecar at a time with nothing in flight.
    pub same: f64,
    /// The same share from the asks all at once alone: there each sidecar's probe ticket is
    /// shared with its peers while they decide (`[replicas] share_load`), and a peer's ticket
    /// counted on one of two workers holding the prompt tips the tie the other way.
    pub same_at_once: f64,
    /// Share on which every sidecar named the same first worker (matched blocks aside; as
    /// `same`).
    pub same_worker: f64,
    /// Share of the probes on which every sidecar's index matched the same blocks on every
    /// worker (each sidecar's candidates for the probe, read back from its `/debug/explain`):
    /// where the indexes agree, a different first worker is the routing rule's doing (load),
    /// not a divergent index. Over `index_probes`.
    pub same_index: f64,
    /// Probes whose decision was found in every sidecar's `/debug/explain`.
    pub index_probes: usize,
    /// Probes asked again one sidecar at a time (those the asks at once disagreed on).
    pub asked_again: usize,
    /// Per sidecar: its mean matched blocks over the probes (asked at once).
    pub mean_matched: Vec<f64>,
    /// Per sidecar: probes on which its final (worker, matched blocks) differed from the most
    /// common answer: which replica stands out.
    pub outliers: Vec<usize>,
    /// The first few probes the sidecars disagreed on at once: the probe's number, its blocks,
    /// whether they agreed asked one at a time, and every sidecar's answer (worker, matched
    /// blocks, the rule that decided, every worker's match, the candidates as shown).
    pub disagreements: Vec<Value>,
    /// The first few probes on which the sidecars' indexes differed: every sidecar's matched
    /// blocks per worker.
    pub index_disagreements: Vec<Value>,
    /// Per sidecar: its estimate of how much of each worker's idle matched blocks survive
    /// (`survival`, per worker, from its decision for the last probe): each replica estimates
    /// it from the usage of the requests it routed itself.
    pub survival: Vec<Value>,
}

/// How long [`probe`] waits after reporting a probe's tickets finished before it asks the next
/// one: long enough for every replica to have shared that they are gone (the benchmark shares
/// every 10 ms; with 8 sidecars and their Envoys on 2 cores a share can take tens of ms to be
/// applied).
pub const PROBE_SETTLE: Duration = Duration::from_millis(40);

/// Disagreeing probes kept in [`Agreement::disagreements`].
const DISAGREEMENTS_KEPT: usize = 8;

/// The worker a hint names first (an instance id in pin mode), `None` for none.
fn first_worker(answer: &HintResponse) -> Option<String> {
    match (answer.instance_id, answer.prefill_instance_id) {
        (Some(id), _) => Some(format!("instance {id}")),
        (None, Some(id)) => Some(format!("prefill {id}")),
        (None, None) => answer.workers.first().cloned(),
    }
}

/// One sidecar's answer to a probe: the first worker it names and that worker's matched blocks.
type Said = (Option<String>, u32);

/// Whether every sidecar named the same worker with the same match (and named one).
fn all_same(said: &[Said]) -> bool {
    said.first().is_some_and(|first| first.0.is_some()) && said.iter().all(|a| *a == said[0])
}

/// Ask the sidecar at `base` for `hint` and report its ticket finished at once (as a request
/// the filter gave up on), so that it counts on no worker afterwards.
async fn ask_and_close(
    http: &reqwest::Client,
    base: &str,
    hint: &kvroute_protocol::hint::HintRequest,
) -> Result<Said> {
    let answer = ask_hint(http, base, hint)
        .await
        .with_context(|| format!("asking {base} for a hint"))?;
    close(http, base, &answer).await?;
    Ok((first_worker(&answer), answer.matched_blocks))
}

/// Report `answer`'s ticket (if any) finished to the sidecar at `base`.
pub async fn close(http: &reqwest::Client, base: &str, answer: &HintResponse) -> Result<()> {
    let Some(ticket) = answer.ticket else {
        return Ok(());
    };
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
    Ok(())
}

/// One sidecar's decision for a probe, read back from its `/debug/explain`: the rule, and every
/// candidate's matched blocks by worker (sorted).
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    rule: Value,
    matched: Vec<(String, u64)>,
    /// The candidates as the sidecar showed them (load, survival, cost), best first.
    candidates: Value,
}

/// What a decision (an entry of `/debug/explain`) says the index matched on each candidate
/// worker, sorted by worker.
pub fn matched_by_worker(decision: &Value) -> Option<Vec<(String, u64)>> {
    let mut matched: Vec<(String, u64)> = decision["candidates"]
        .as_array()?
        .iter()
        .map(|c| {
            (
                c["worker"].as_str().unwrap_or("").to_owned(),
                c["matched_blocks"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    matched.sort();
    Some(matched)
}

/// The decisions of the last `last_blocks.len()` hints of the sidecar at `base` (oldest
/// first), each `None` unless it was for the probe's prompt (`last_blocks`): nothing else asks
/// it after the traffic, so they are the probes'.
async fn seen_by(
    http: &reqwest::Client,
    base: &str,
    last_blocks: &[Option<String>],
) -> Vec<Option<Seen>> {
    let n = last_blocks.len();
    let entries = crate::client::get_json(http, &format!("{base}/debug/explain?limit={n}")).await;
    let entries = entries.as_array().cloned().unwrap_or_default();
    // Newest first: the last probe's decision is the first entry.
    (0..n)
        .map(|i| {
            let e = entries.get(n - 1 - i)?;
            if e["last_block"].as_str() != last_blocks[i].as_deref() {
                return None;
            }
            Some(Seen {
                rule: e["decision"]["rule"].clone(),
                matched: matched_by_worker(&e["decision"])?,
                candidates: e["decision"]["candidates"].clone(),
            })
        })
        .collect()
}

/// Ask every sidecar in `sidecars` for each of `bodies` directly with the prompt's hashes (as the
/// filter does) and compare their answers: first worker and matched blocks. The sidecars are
/// asked at once and their tickets reported finished right after, and the next prompt waits
/// until replicas sharing their load have shared that they are gone, so that the sidecars'
/// loads stay alike and only their indexes can differ; then each sidecar's decisions are read
/// back (`/debug/explain`) to compare what their indexes matched on every worker; last, the
/// prompts they disagreed on are asked again one sidecar at a time, each ticket closed and
/// shared before the next sidecar is asked (asked at once, a peer's ticket shared before a
/// slower sidecar decides tips a tie between two holders of the prompt).
pub async fn probe(
    http: &reqwest::Client,
    sidecars: &[String],
    bodies: &[Value],
) -> Result<Agreement> {
    let n = sidecars.len();
    let mut out = Agreement {
        mean_matched: vec![0.0; n],
        outliers: vec![0; n],
        ..Agreement::default()
    };
    let mut asked = Vec::with_capacity(bodies.len());
    for body in bodies {
        let hint = kvroute_protocol::hint::HintRequest {
            model: MODEL.into(),
            hashes: prompt_hashes(body)?,
            finished: Vec::new(),
        };
        let answers =
            futures::future::join_all(sidecars.iter().map(|base| ask_hint(http, base, &hint)))
                .await;
        let mut said = Vec::with_capacity(n);
        let mut reports = Vec::new();
        for (base, answer) in sidecars.iter().zip(answers) {
            let answer = answer.with_context(|| format!("asking {base} for a hint"))?;
            said.push((first_worker(&answer), answer.matched_blocks));
            reports.push(async move { close(http, base, &answer).await });
        }
        for report in futures::future::join_all(reports).await {
            report?;
        }
        tokio::time::sleep(PROBE_SETTLE).await;
        for (i, a) in said.iter().enumerate() {
            out.mean_matched[i] += f64::from(a.1);
        }
        asked.push((hint, said));
    }
    out.probes = asked.len();
    let last_blocks: Vec<Option<String>> = asked
        .iter()
        .map(|(hint, _)| hint.hashes.last().map(|h| format!("{:016x}", h.0)))
        .collect();
    let mut seen = Vec::with_capacity(n);
    for base in sidecars {
        seen.push(seen_by(http, base, &last_blocks).await);
    }
    let (mut same, mut same_at_once, mut same_worker, mut same_index) = (0, 0, 0, 0);
    for (p, (hint, said)) in asked.iter().enumerate() {
        let views: Option<Vec<&Seen>> = seen.iter().map(|s| s[p].as_ref()).collect();
        if let Some(views) = &views {
            out.index_probes += 1;
            let agree = views.iter().all(|v| v.matched == views[0].matched);
            same_index += usize::from(agree);
            if !agree && out.index_disagreements.len() < DISAGREEMENTS_KEPT {
                let per_sidecar: Vec<Value> = views
                    .iter()
                    .map(|v| {
                        json!(v
                            .matched
                            .iter()
                            .map(|(w, m)| json!([w, m]))
                            .collect::<Vec<_>>())
                    })
                    .collect();
                out.index_disagreements.push(json!({
                    "probe": p,
                    "blocks": hint.hashes.len(),
                    "matched": per_sidecar,
                }));
            }
        }
        let at_once = all_same(said);
        same_at_once += usize::from(at_once);
        let said = if at_once {
            said.clone()
        } else {
            out.asked_again += 1;
            let mut again = Vec::with_capacity(n);
            for base in sidecars {
                again.push(ask_and_close(http, base, hint).await?);
                tokio::time::sleep(PROBE_SETTLE).await;
            }
            if out.disagreements.len() < DISAGREEMENTS_KEPT {
                let answers: Vec<Value> = said
                    .iter()
                    .zip(&again)
                    .enumerate()
                    .map(|(i, ((worker, matched), alone))| {
                        let view = seen[i][p].as_ref();
                        json!({
                            "worker": worker,
                            "matched_blocks": matched,
                            "asked_alone": [alone.0, alone.1],
                            "rule": view.map(|v| v.rule.clone()),
                            "index": view.map(|v| v.matched.iter().map(|(w, m)| json!([w, m])).collect::<Vec<_>>()),
                            "candidates": view.map(|v| v.candidates.clone()),
                        })
                    })
                    .collect();
                out.disagreements.push(json!({
                    "probe": p,
                    "blocks": hint.hashes.len(),
                    "agreed_alone": all_same(&again),
                    "answers": answers,
                }));
            }
            again
        };
        same += usize::from(all_same(&said));
        same_worker += usize::from(said[0].0.is_some() && said.iter().all(|a| a.0 == said[0].0));
        let common = said
            .iter()
            .max_by_key(|a| said.iter().filter(|b| b == a).count())
            .cloned();
        for (i, a) in said.iter().enumerate() {
            out.outliers[i] += usize::from(Some(a) != common.as_ref());
        }
    }
    out.survival = seen
        .iter()
        .map(|s| {
            s.iter()
                .rev()
                .flatten()
                .next()
                .and_then(|v| v.candidates.as_array())
                .map(|cs| {
                    let mut by_worker: Vec<(String, f64)> = cs
                        .iter()
                        .map(|c| {
                            (
                                c["worker"].as_str().unwrap_or("").to_owned(),
                                c["survival"].as_f64().unwrap_or(1.0),
                            )
                        })
                        .collect();
                    by_worker.sort_by(|a, b| a.0.cmp(&b.0));
                    json!(by_worker)
                })
                .unwrap_or(Value::Null)
        })
        .collect();
    let probes = out.probes.max(1) as f64;
    out.same = same as f64 / probes;
    out.same_at_once = same_at_once as f64 / probes;
    out.same_worker = same_worker as f64 / probes;
    out.same_index = same_index as f64 / out.index_probes.max(1) as f64;
    for m in &mut out.mean_matched {
        *m /= probes;
    }
    Ok(out)
}

/// The share of `bodies` for which every sidecar in `sidecars`, asked directly, names the same
/// first worker with the same matched blocks ([`probe`]).
pub async fn agreement(
    http: &reqwest::Client,
    sidecars: &[String],
    bodies: &[Value],
) -> Result<f64> {
    Ok(probe(http, sidecars, bodies).await?.same)
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

/// Wait until the sidecars' repairs have settled: at least 5 repair intervals, then until an
/// interval passes in which no sidecar noticed, filled or repaired anything more — at most 20
/// intervals. Only when to probe is decided by the sidecars' own counters; whether they agree
/// is the probe's.
async fn settle(http: &reqwest::Client, sidecars: &[String], interval_ms: u64) {
    const REPAIRS: [&str; 3] = [
        "kvroute_replica_lost_messages_total",
        "kvroute_replica_repairs_total",
        "kvroute_replica_divergences_total",
    ];
    let interval = Duration::from_millis(interval_ms);
    tokio::time::sleep(5 * interval).await;
    let mut last = None;
    for _ in 5..20 {
        let mut now = 0.0;
        for base in sidecars {
            let text = crate::client::get_text(http, &format!("{base}/metrics"))
                .await
                .unwrap_or_default();
            now += prometheus::sum_where(&text, |l| REPAIRS.iter().any(|r| l.starts_with(r)));
        }
        if last == Some(now) {
            return;
        }
        last = Some(now);
        tokio::time::sleep(interval).await;
    }
}

/// The sidecars' distinct URLs, in replica order (one for a shared index).
pub fn sidecars_of(stack: &Stack) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for r in &stack.replicas {
        if !out.contains(&r.sidecar_url) {
            out.push(r.sidecar_url.clone());
        }
    }
    out
}

/// Run `scenario` on `workload` (`sharing`: a load-sharing comparison) on a fresh stack.
/// The parts of the routing rule, as `kvroute_hint_rules_total` labels them.
const RULES: [&str; 4] = ["longest_match", "least_loaded", "no_match", "spread"];

async fn run_scenario(
    bench: &ReplicasBench,
    workload: &bench::Workload,
    capacity_blocks: usize,
    scenario: Scenario,
    sharing: bool,
) -> Result<Value> {
    let started = Instant::now();
    let name = format!(
        "bench-replicas-{}-{}x-{}-{}-{}{}",
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
        },
        if scenario.shared_index {
            "-oneindex"
        } else {
            ""
        }
    );
    let mut opts = StackOptions::new(&name, Mode::Kvroute);
    opts.sim = bench::fleet(bench.engines, capacity_blocks);
    opts.sidecar_toml = bench.sidecar_toml.clone();
    opts.replicas = Some(ReplicaOptions {
        count: scenario.replicas,
        interval_ms: bench.interval_ms,
        loss: 0.0,
        lossy: None,
        reconcile: scenario.reconcile,
        share_load: scenario.share_load,
        // The simulator's requests last tens of milliseconds, real ones seconds: the shares are
        // made as much fresher as the requests are shorter.
        load_interval_ms: 10,
    });
    // Every row reads its events through proxies (lossless ones for the reference and the
    // bound), so only the loss differs between rows.
    opts.transport_loss = Some(TransportLoss {
        loss: scenario.loss,
        seed: PROXY_SEED,
    });
    opts.shared_sidecar = scenario.shared_index;
    if !sharing {
        opts.envoy_concurrency = ENVOY_CONCURRENCY;
    }
    let mut stack = Stack::start(opts).await?;
    let start_s = started.elapsed().as_secs_f64();
    let routers: Vec<String> = stack.replicas.iter().map(|r| r.envoy_url.clone()).collect();
    let target = Target::Spread(routers);
    let outcomes = bench::run_workload(
        &stack.http,
        &target,
        workload,
        crate::client::CLIENT_START_GAP,
        &scenario.label(),
    )
    .await?;
    stack.check_alive()?;
    // Events still on their way, and repair rounds: a message lost at the very end is noticed
    // only by a digest round and filled by a later one, and a divergence needs a snapshot
    // after that (5 intervals once left one of 32 smoke probes unrepaired on a loaded 2-core
    // machine): then every sidecar is asked the same.
    let sidecars = sidecars_of(&stack);
    settle(&stack.http, &sidecars, bench.interval_ms).await;
    let agreement = probe(
        &stack.http,
        &sidecars,
        &probe_bodies(workload, bench.probes),
    )
    .await?;
    let transport = stack.transport_counts();
    // How far apart the replicas' survival estimates of one worker are, the widest worker.
    let mut spread: f64 = 0.0;
    let estimates: Vec<Vec<(String, f64)>> = agreement
        .survival
        .iter()
        .filter_map(|v| serde_json::from_value(v.clone()).ok())
        .collect();
    if let Some(first) = estimates.first() {
        for (worker, _) in first {
            let of = estimates
                .iter()
                .filter_map(|e| e.iter().find(|(w, _)| w == worker).map(|(_, s)| *s));
            let (lo, hi) = of.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), s| {
                (lo.min(s), hi.max(s))
            });
            if hi >= lo {
                spread = spread.max(hi - lo);
            }
        }
    }
    let mut sums = [0.0; 5];
    let mut rules = [0.0; 4];
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
            "kvroute_replica_lost_messages_total{outcome=\"filled\"}",
            "kvroute_replica_lost_messages_total{outcome=\"unfilled\"}",
            "kvroute_replica_repairs_total{kind=\"peer_snapshot\"}",
            "kvroute_replica_divergences_total",
            "kvroute_capacity_evictions_total",
        ]) {
            *sum += one(series);
        }
        for (sum, rule) in rules.iter_mut().zip(RULES) {
            *sum += one(&format!("kvroute_hint_rules_total{{rule=\"{rule}\"}}"));
        }
    }
    // What the engines evicted, warm-up included (the simulator counts it).
    let mut evicted = Vec::new();
    for e in &stack.engines {
        let text = crate::client::get_text(&stack.http, &format!("http://{}/metrics", e.address))
            .await
            .unwrap_or_default();
        evicted.push(prometheus::sum(&text, "kvroute_sim:evicted_blocks_total") as u64);
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
    // Where replicas disagree, what each believes of its caches and its peers' (the probe is
    // what counts; this says why).
    let mut states = Vec::new();
    if agreement.same < 1.0 {
        for base in &sidecars {
            states.push(
                crate::client::get_json(&stack.http, &format!("{base}/debug/replicas")).await,
            );
        }
    }
    let mut row = bench::summary(&outcomes, bench.engines);
    let fields = json!({
        "workload": workload.name,
        "replicas": scenario.replicas,
        "sidecars": sidecars.len(),
        "loss": scenario.loss,
        "reconcile": scenario.reconcile,
        "share_load": scenario.share_load,
        "shared_index": scenario.shared_index,
        "agreement": agreement.same,
        "agreement_at_once": agreement.same_at_once,
        "agreement_worker": agreement.same_worker,
        "agreement_index": agreement.same_index,
        "index_probes": agreement.index_probes,
        "probes_asked_again": agreement.asked_again,
        "probes": agreement.probes,
        "mean_matched_per_replica": agreement.mean_matched,
        "probe_outliers_per_replica": agreement.outliers,
        "disagreements": agreement.disagreements,
        "index_disagreements": agreement.index_disagreements,
        "replica_states": states,
        "survival_per_replica": agreement.survival,
        "survival_spread": spread,
        "predicted_per_replica": predicted,
        "actual_per_replica": actual,
        "hit_rate_per_replica": per_replica,
        "transport_dropped_per_replica": transport.iter().map(|c| c.dropped).collect::<Vec<_>>(),
        "transport_forwarded_per_replica": transport.iter().map(|c| c.forwarded).collect::<Vec<_>>(),
        "events_dropped": transport.iter().map(|c| c.dropped).sum::<u64>(),
        "messages_filled": sums[0],
        "messages_unfilled": sums[1],
        "snapshots": sums[2],
        "divergences": sums[3],
        "index_capacity_evictions": sums[4],
        "rules": RULES.iter().zip(rules).map(|(r, n)| (r.to_string(), json!(n))).collect::<serde_json::Map<_, _>>(),
        "evicted_blocks_per_engine": evicted,
        "evicted_blocks": evicted.iter().sum::<u64>(),
        "capacity_blocks": capacity_blocks,
        "hinted": envoys[1] as f64 / envoys[0].max(1) as f64,
        "hint_timeouts": envoys[2],
        "start_s": start_s,
        "elapsed_s": started.elapsed().as_secs_f64(),
    });
    if let (Some(row), Some(fields)) = (row.as_object_mut(), fields.as_object()) {
        row.extend(fields.clone());
    }
    Ok(row)
}

/// One progress line for a finished scenario.
fn progress_line(done: usize, total: usize, row: &Value) -> String {
    let f = |k: &str| row[k].as_f64().unwrap_or(0.0);
    let label = Scenario {
        replicas: row["replicas"].as_u64().unwrap_or(0) as usize,
        loss: f("loss"),
        reconcile: row["reconcile"] != false,
        share_load: row["share_load"] != false,
        shared_index: row["shared_index"] == true,
    }
    .label();
    format!(
        "[{done}/{total}] {} / {label}: hit {:.1}%, agreement {:.1}% (at once {:.1}%, index {:.1}%), dropped {} of {}, filled {}, snapshots {}, engines evicted {} blocks, {} errors, {:.0} s",
        row["workload"].as_str().unwrap_or(""),
        f("hit_rate") * 100.0,
        f("agreement") * 100.0,
        f("agreement_at_once") * 100.0,
        f("agreement_index") * 100.0,
        f("events_dropped"),
        row["transport_forwarded_per_replica"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_u64)
            .sum::<u64>()
            + row["events_dropped"].as_u64().unwrap_or(0),
        f("messages_filled"),
        f("snapshots"),
        row["evicted_blocks"],
        row["errors"],
        f("elapsed_s"),
    )
}

/// Each row's hit rate against its workload's reference (one lossless replica,
/// `hit_rate_vs_single`) and against the bound of its Envoy count (`hit_rate_vs_bound`: the
/// shared-index row with as many Envoys; the reference for one Envoy).
fn compare(rows: &mut [Value]) {
    let hit = |r: &Value| r["hit_rate"].as_f64().unwrap_or(0.0);
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    let snapshot = rows.to_vec();
    for row in rows.iter_mut() {
        let same = |r: &&Value| r["workload"] == row["workload"];
        let reference = snapshot.iter().filter(same).find(|r| {
            r["replicas"] == 1 && r["loss"].as_f64() == Some(0.0) && r["shared_index"] != true
        });
        let bound = if row["replicas"] == 1 {
            reference
        } else {
            snapshot
                .iter()
                .filter(same)
                .find(|r| r["shared_index"] == true && r["replicas"] == row["replicas"])
        };
        if let Some(reference) = reference {
            row["hit_rate_vs_single"] = json!(ratio(hit(row), hit(reference)));
        }
        if let Some(bound) = bound {
            row["bound_hit_rate"] = json!(hit(bound));
            row["hit_rate_vs_bound"] = json!(ratio(hit(row), hit(bound)));
        }
    }
}

/// Run the scenarios on the workloads; write `replicas.json` (a list of rows, one per scenario
/// and workload) and `replicas.md` into `out`, printing a line per scenario as it ends.
pub async fn run(bench: &ReplicasBench, out: &std::path::Path) -> Result<String> {
    let started = Instant::now();
    let mut rows = Vec::new();
    let loss: Vec<bench::Workload> = loss_workloads(bench.scale)?
        .into_iter()
        .filter(|w| bench.workloads.contains(&w.name))
        .collect();
    let sharing: Vec<bench::Workload> = if bench.sharing.is_empty() {
        Vec::new()
    } else {
        bench::workloads(bench.scale)?
            .into_iter()
            .filter(|w| bench.sharing.contains(&w.name))
            .collect()
    };
    let total = loss.len() * bench.scenarios.len() + sharing.len() * sharing_scenarios().len();
    let mut done = 0;
    let plan = loss
        .iter()
        .map(|w| (w, &bench.scenarios[..], false))
        .chain(sharing.iter().map(|w| (w, &SHARING[..], true)));
    for (workload, scenarios, sharing) in plan {
        // The load-sharing workloads keep their routing capacities.
        let capacity = if sharing {
            workload.capacity_blocks
        } else {
            bench.capacity_blocks.unwrap_or(workload.capacity_blocks)
        };
        let requests: usize = workload.sessions.iter().map(|s| s.bodies.len()).sum();
        let working_set = working_set(workload)?;
        println!(
            "{}: {} sessions, {requests} requests, working set {working_set} blocks; {} engines × {capacity} blocks (fleet {})",
            workload.name,
            workload.sessions.len(),
            bench.engines,
            bench.engines * capacity
        );
        for &scenario in scenarios {
            let mut row = run_scenario(bench, workload, capacity, scenario, sharing)
                .await
                .with_context(|| format!("{} / {scenario:?}", workload.name))?;
            row["working_set_blocks"] = json!(working_set);
            row["fleet_blocks"] = json!(bench.engines * capacity);
            done += 1;
            println!("{}", progress_line(done, total, &row));
            rows.push(row);
        }
    }
    compare(&mut rows);
    let doc = Value::from(rows);
    let table = markdown(&doc);
    crate::report::write_pair(out, "replicas", &doc, &table)?;
    println!(
        "{done} scenarios in {:.1} min",
        started.elapsed().as_secs_f64() / 60.0
    );
    Ok(table)
}

/// [`sharing_scenarios`], as a constant to compare against.
const SHARING: [Scenario; 3] = [
    Scenario {
        replicas: 1,
        loss: 0.0,
        reconcile: true,
        share_load: true,
        shared_index: false,
    },
    Scenario {
        replicas: 4,
        loss: 0.0,
        reconcile: true,
        share_load: false,
        shared_index: false,
    },
    Scenario {
        replicas: 4,
        loss: 0.0,
        reconcile: true,
        share_load: true,
        shared_index: false,
    },
];

/// The markdown tables of a `replicas.json` document: the workloads, then one row per scenario.
pub fn markdown(doc: &Value) -> String {
    let rows: Vec<&Value> = doc.as_array().into_iter().flatten().collect();
    let mut out = String::from(
        "| workload | requests | working set (blocks) | engine cache (blocks) | fleet (blocks) | evicted blocks (reference row) |\n|---|---|---|---|---|---|\n",
    );
    let mut seen = Vec::new();
    for r in &rows {
        let key = (r["workload"].clone(), r["capacity_blocks"].clone());
        if seen.contains(&key) {
            continue;
        }
        seen.push(key);
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} |\n",
            r["workload"].as_str().unwrap_or(""),
            r["requests"],
            r["working_set_blocks"],
            r["capacity_blocks"],
            r["fleet_blocks"],
            r["evicted_blocks"],
        ));
    }
    out.push_str(
        "\n| workload | Envoys | index | loss | hit rate | vs 1 lossless | vs bound | per Envoy | agreement (asked at once / indexes) | survival spread | mean matched per sidecar | predicted / actual per sidecar | dropped / forwarded per sidecar | lost → filled / unfilled | snapshots | evicted blocks | rules (longest / least loaded / no match / spread) | imbalance | TTFT p95 (ms) | errors | time (s) |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let f = |k: &str| r[k].as_f64().unwrap_or(0.0);
        let list = |k: &str, scale: f64, digits: usize| -> Vec<String> {
            r[k].as_array()
                .into_iter()
                .flatten()
                .map(|v| format!("{:.*}", digits, v.as_f64().unwrap_or(0.0) * scale))
                .collect()
        };
        let (predicted, actual) = (
            list("predicted_per_replica", 100.0, 1),
            list("actual_per_replica", 100.0, 1),
        );
        let truth: Vec<String> = predicted
            .iter()
            .zip(&actual)
            .map(|(p, a)| format!("{p}/{a}"))
            .collect();
        let (dropped, forwarded) = (
            list("transport_dropped_per_replica", 1.0, 0),
            list("transport_forwarded_per_replica", 1.0, 0),
        );
        let transport: Vec<String> = dropped
            .iter()
            .zip(&forwarded)
            .map(|(d, f)| format!("{d}/{f}"))
            .collect();
        let index = if r["shared_index"] == true {
            "1 shared".to_owned()
        } else if r["share_load"] == false {
            "own, load unshared".to_owned()
        } else {
            format!(
                "own{}",
                if r["reconcile"] == true {
                    ""
                } else {
                    ", no repair"
                }
            )
        };
        let rules = RULES
            .iter()
            .map(|rule| format!("{:.0}", r["rules"][rule].as_f64().unwrap_or(0.0)))
            .collect::<Vec<_>>()
            .join(" / ");
        let pct = |k: &str| {
            r[k].as_f64()
                .map_or("–".to_owned(), |v| format!("{:.1}%", v * 100.0))
        };
        out.push_str(&format!(
            "| {} | {} | {index} | {:.0}% | {:.1}% | {} | {} | {} | {:.1}% ({:.1}% / {:.1}%) | {:.2} | {} | {} | {} | {:.0} → {:.0} / {:.0} | {:.0} | {:.0} | {rules} | {:.2} | {:.1} | {} | {:.0} |\n",
            r["workload"].as_str().unwrap_or(""),
            r["replicas"],
            f("loss") * 100.0,
            f("hit_rate") * 100.0,
            pct("hit_rate_vs_single"),
            pct("hit_rate_vs_bound"),
            list("hit_rate_per_replica", 100.0, 1).join(" / "),
            f("agreement") * 100.0,
            f("agreement_at_once") * 100.0,
            f("agreement_index") * 100.0,
            f("survival_spread"),
            list("mean_matched_per_replica", 1.0, 2).join(" / "),
            truth.join(" · "),
            transport.join(" · "),
            f("events_dropped"),
            f("messages_filled"),
            f("messages_unfilled"),
            f("snapshots"),
            f("evicted_blocks"),
            f("imbalance"),
            f("ttft_p95_ms"),
            r["errors"],
            f("elapsed_s"),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scenarios_are_the_reference_then_each_count_lossy_lossless_and_shared() {
        let s = scenarios(&[1, 8], 0.1, true);
        assert_eq!(
            s,
            vec![
                Scenario::reference(),
                Scenario::lossy(1, 0.1),
                Scenario::lossy(8, 0.1),
                Scenario::lossy(8, 0.0),
                Scenario::shared_index(8),
            ]
        );
        assert!(s[4].shared_index && s[4].loss == 0.0 && s[4].replicas == 8);
        // Without the lossless rows, and without a lossy row twice when the loss is 0.
        assert_eq!(scenarios(&[2], 0.1, false).len(), 3);
        assert_eq!(scenarios(&[2], 0.0, true).len(), 3);
    }

    #[test]
    fn rows_compare_with_the_reference_and_the_bound_of_their_count() {
        let row = |replicas: usize, loss: f64, shared: bool, hit: f64| {
            json!({"workload": "w", "replicas": replicas, "loss": loss,
                   "shared_index": shared, "hit_rate": hit})
        };
        let mut rows = vec![
            row(1, 0.0, false, 0.8),
            row(1, 0.1, false, 0.72),
            row(8, 0.1, false, 0.6),
            row(8, 0.0, true, 0.75),
        ];
        compare(&mut rows);
        let near = |v: &Value, x: f64| (v.as_f64().unwrap() - x).abs() < 1e-9;
        assert!(near(&rows[1]["hit_rate_vs_single"], 0.9));
        assert!(
            near(&rows[1]["hit_rate_vs_bound"], 0.9),
            "1 Envoy: the reference"
        );
        assert!(near(&rows[2]["hit_rate_vs_bound"], 0.8));
        assert!(near(&rows[2]["bound_hit_rate"], 0.75));
        assert!(near(&rows[3]["hit_rate_vs_bound"], 1.0));
        let table = markdown(&Value::from(rows));
        assert!(
            table.contains("| w | 8 | 1 shared | 0% | 75.0% |"),
            "{table}"
        );
    }

    #[test]
    fn answers_agree_only_when_all_name_the_same_worker_and_match() {
        let w = |s: &str, m| (Some(s.to_owned()), m);
        assert!(all_same(&[w("a", 3), w("a", 3)]));
        assert!(!all_same(&[w("a", 3), w("a", 2)]));
        assert!(!all_same(&[w("a", 3), w("b", 3)]));
        assert!(!all_same(&[(None, 0), (None, 0)]));
    }
}
