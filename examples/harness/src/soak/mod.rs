//! `kvroute-bench soak` (`make soak`): a fleet under steady load while a scheduler breaks it,
//! one fault at a time, and measures how long each takes to heal — judged from outside, against
//! what the engines hold.
//!
//! The fleet: simulated engines whose caches evict, half publishing Dynamo's events on a real
//! nats-server, half vLLM's on ZMQ, every event late (p50 2 ms, p95 50 ms, as measured on real
//! vLLM); two sidecar + Envoy pairs on one replica plane, each sidecar reading NATS through its
//! own lossy proxy. Clients hold multi-turn conversations spread over both Envoys the whole time;
//! a failed request is sent again once, and a failure the second try serves is one a retry
//! could have saved (Envoy's retry policy should have) — unless it met a killed worker before
//! any sidecar could know (in flight when it died, or sent before the kill was seen), which no
//! router can save and the report counts apart.
//!
//! Each fault is applied, held, undone; then every second both sidecars are probed until their
//! indexes agree with the engines again ([`engine_agreement`]: for recent prompts, each
//! sidecar's matched blocks per worker, read from its `/debug/explain`, against each engine's
//! `/oracle`). At the end the load stops, and the indexes are compared with the engines and with
//! each other once more.
//!
//! `--dynamo` breaks a real Dynamo fleet instead (`soak/dynamo.rs`): workers SIGKILLed and started
//! again as new instances, the sidecar killed; judged against what the workers report cached.

mod dynamo;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use serde_json::{json, Value};

use crate::bench_replicas::{ask_hint, close, matched_by_worker, prompt_hashes, sidecars_of};
use crate::client::{self, Outcome};
use crate::stack::{Mode, ReplicaOptions, SimOptions, Stack, StackOptions, TransportLoss, MODEL};
use crate::workload::{ChatSpec, ChatWorkload, Rng};

/// One thing that goes wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// nats-server killed and started again on its port (Dynamo on NATS replays nothing:
    /// what its engines published meanwhile is lost to every replica).
    NatsRestart,
    /// Engine `n` restarts: its cache empties, its event numbering starts over.
    EngineRestart(usize),
    /// Engine `n` (a vLLM publisher) sends none of its next 50 messages live; its replay
    /// buffer keeps them.
    EngineDropsEvents(usize),
    /// The second sidecar loses 20% of its KV-event messages on the way from NATS.
    EventLoss,
    /// The second sidecar receives no KV event from NATS at all (its peers still reach it).
    Partition,
    /// The first sidecar SIGKILLed and started again: its index starts empty.
    SidecarKill,
    /// The second sidecar SIGKILLed and started again.
    ReplicaKill,
    /// Real Dynamo: worker `n` SIGKILLed, and after the hold started again as a new instance.
    DynamoWorkerKill(usize),
}

impl Fault {
    /// Its name in reports.
    pub fn name(self) -> String {
        match self {
            Fault::NatsRestart => "nats_restart".into(),
            Fault::EngineRestart(n) => format!("engine_{n}_restart"),
            Fault::EngineDropsEvents(n) => format!("engine_{n}_drops_events"),
            Fault::EventLoss => "replica_1_loses_20pct".into(),
            Fault::Partition => "replica_1_partitioned_from_events".into(),
            Fault::SidecarKill => "sidecar_0_killed".into(),
            Fault::ReplicaKill => "sidecar_1_killed".into(),
            Fault::DynamoWorkerKill(n) => format!("dynamo_worker_{n}_killed"),
        }
    }
}

/// Which fleet the soak breaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fleet {
    /// Simulated engines (even ones publish Dynamo's events on NATS, odd ones vLLM's on ZMQ),
    /// two sidecar + Envoy replicas.
    Simulated,
    /// Real Dynamo mocker workers behind a `kv` frontend, one sidecar + Envoy pinning.
    Dynamo,
}

/// The soak's inputs.
#[derive(Debug, Clone)]
pub struct SoakBench {
    /// What runs the requests.
    pub fleet: Fleet,
    /// Engines (simulated, or Dynamo workers).
    pub engines: usize,
    /// Each engine's cache, in blocks (small: caches evict under the load).
    pub capacity_blocks: usize,
    /// Concurrent clients.
    pub clients: usize,
    /// The faults, in order.
    pub faults: Vec<Fault>,
    /// Steady load before the first fault and between a recovery and the next fault.
    pub steady: Duration,
    /// How long a fault with a duration (loss, partition, a process down) lasts.
    pub hold: Duration,
    /// A fault not healed after this long is reported as not recovered.
    pub deadline: Duration,
    /// Prompts per probe.
    pub probes: usize,
    /// Healed: every sidecar agrees with the engines on at least this share of the probes.
    pub healed_share: f64,
}

impl SoakBench {
    /// `make soak`: every fault, each held 8 s.
    pub fn full() -> Self {
        SoakBench {
            fleet: Fleet::Simulated,
            engines: 4,
            capacity_blocks: 384,
            clients: 4,
            faults: vec![
                Fault::NatsRestart,
                Fault::EngineRestart(0),
                Fault::EngineRestart(1),
                Fault::EngineDropsEvents(1),
                Fault::EventLoss,
                Fault::Partition,
                Fault::SidecarKill,
                Fault::ReplicaKill,
            ],
            steady: Duration::from_secs(8),
            hold: Duration::from_secs(8),
            deadline: Duration::from_secs(45),
            probes: 32,
            healed_share: 0.9,
        }
    }

    /// The smoke `make test` runs: one fault of each kind of component, held 3 s.
    pub fn smoke() -> Self {
        SoakBench {
            faults: vec![
                Fault::EngineRestart(0),
                Fault::Partition,
                Fault::SidecarKill,
            ],
            steady: Duration::from_secs(4),
            hold: Duration::from_secs(3),
            // Healed in 5-11 s here; the margin is for a CI machine running other tests.
            deadline: Duration::from_secs(60),
            ..SoakBench::full()
        }
    }

    /// `make soak`'s second part: 3 Dynamo workers, two of them killed in turn, and the sidecar.
    pub fn dynamo() -> Self {
        SoakBench {
            fleet: Fleet::Dynamo,
            engines: 3,
            capacity_blocks: 512,
            faults: vec![
                Fault::DynamoWorkerKill(0),
                Fault::SidecarKill,
                Fault::DynamoWorkerKill(2),
            ],
            ..SoakBench::full()
        }
    }

    /// The smoke of the Dynamo part `make test` runs: one worker killed, held 2 s.
    pub fn dynamo_smoke() -> Self {
        SoakBench {
            faults: vec![Fault::DynamoWorkerKill(1)],
            steady: Duration::from_secs(4),
            hold: Duration::from_secs(2),
            deadline: Duration::from_secs(60),
            ..SoakBench::dynamo()
        }
    }

    /// Keep only the faults named (as in reports); a name no fault has is an error.
    pub fn only(&mut self, names: &[String]) -> Result<()> {
        if let Some(unknown) = names
            .iter()
            .find(|n| !self.faults.iter().any(|f| f.name() == **n))
        {
            let known: Vec<String> = self.faults.iter().map(|f| f.name()).collect();
            anyhow::bail!("no fault {unknown:?}; the faults: {}", known.join(", "));
        }
        self.faults.retain(|f| names.contains(&f.name()));
        Ok(())
    }
}

/// A request that failed.
#[derive(Debug, Clone)]
struct Failure {
    sent: Instant,
    failed: Instant,
    /// The one retry was served.
    saved: bool,
    error: String,
}

/// What the clients saw.
#[derive(Debug, Default)]
struct Tally {
    sent: AtomicUsize,
    failures: Mutex<Vec<Failure>>,
    /// From a worker's kill to the moment every sidecar stopped using it: a request sent into
    /// it — or in flight at the kill, its stream cut — no router could have saved.
    blind: Mutex<Vec<(Instant, Instant)>>,
    cached_tokens: AtomicUsize,
    prompt_tokens: AtomicUsize,
    /// The last prompts sent (the probes' pool).
    recent: Mutex<Vec<Value>>,
}

const RECENT: usize = 64;
const ERRORS_KEPT: usize = 8;

impl Tally {
    fn failures(&self) -> Vec<Failure> {
        self.failures
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Whether `f` met a worker no router could yet know was dead.
    fn blind(&self, f: &Failure) -> bool {
        let blind = self.blind.lock().unwrap_or_else(|e| e.into_inner());
        blind
            .iter()
            .any(|&(killed, seen)| f.sent <= seen && f.failed >= killed)
    }

    /// `first` was sent at `sent`.
    fn record(&self, body: &Value, sent: Instant, first: &Outcome, retry: Option<&Outcome>) {
        self.sent.fetch_add(1, Ordering::Relaxed);
        let served = if first.ok() { Some(first) } else { retry };
        if !first.ok() {
            let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
            failures.push(Failure {
                sent,
                failed: Instant::now(),
                saved: retry.is_some_and(Outcome::ok),
                error: format!("status {}: {:?}", first.status, first.error),
            });
        }
        if let Some(o) = served.filter(|o| o.ok()) {
            self.cached_tokens
                .fetch_add(o.cached_tokens as usize, Ordering::Relaxed);
            self.prompt_tokens
                .fetch_add(o.prompt_tokens as usize, Ordering::Relaxed);
        }
        let mut recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        if recent.len() >= RECENT {
            recent.remove(0);
        }
        recent.push(body.clone());
    }

    fn recent(&self) -> Vec<Value> {
        self.recent
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// Clients holding conversations until `stop`: each request to the next Envoy in turn, a
/// failure sent again once after 200 ms.
async fn clients(
    http: reqwest::Client,
    routers: Vec<String>,
    workload: Arc<ChatWorkload>,
    n: usize,
    stop: Arc<AtomicBool>,
    tally: Arc<Tally>,
) {
    let next_conversation = Arc::new(AtomicUsize::new(0));
    let tasks = (0..n).map(|k| {
        let (http, routers, workload) = (http.clone(), routers.clone(), workload.clone());
        let (stop, tally, next) = (stop.clone(), tally.clone(), next_conversation.clone());
        async move {
            tokio::time::sleep(client::CLIENT_START_GAP * k as u32).await;
            let mut sent = k;
            while !stop.load(Ordering::Relaxed) {
                let conv = next.fetch_add(1, Ordering::Relaxed) % workload.conversations.len();
                for turn in 0..workload.conversations[conv].user_turns.len() {
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    let body = workload.body(MODEL, conv, turn);
                    sent += 1;
                    let url = format!("{}/v1/chat/completions", routers[sent % routers.len()]);
                    let sent = Instant::now();
                    let first = client::send_streaming(&http, &url, &body).await;
                    let retry = if first.ok() {
                        None
                    } else {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        Some(client::send_streaming(&http, &url, &body).await)
                    };
                    tally.record(&body, sent, &first, retry.as_ref());
                }
            }
        }
    });
    futures::future::join_all(tasks).await;
}

/// One sidecar's index view of a prompt: matched blocks per worker, read back from its
/// `/debug/explain` right after asking (its ticket closed at once). `None`: the sidecar did
/// not answer, or its decision was not found among the newest.
pub(crate) async fn index_view(
    http: &reqwest::Client,
    base: &str,
    hint: &kvroute_protocol::hint::HintRequest,
) -> Option<Vec<(String, u64)>> {
    let answer = ask_hint(http, base, hint).await?;
    close(http, base, &answer).await.ok()?;
    let last = format!("{:016x}", hint.hashes.last()?.0);
    let url = format!("{base}/debug/explain?last_block={last}&limit=1");
    let entries = client::get_json(http, &url).await;
    matched_by_worker(&entries.as_array()?.first()?["decision"])
}

/// What each engine's cache holds of a prompt (its `/oracle`), by address.
async fn engines_view(
    http: &reqwest::Client,
    engines: &[String],
    body: &Value,
) -> Vec<(String, u64)> {
    let cached = client::oracle_cached_all(http, engines, body).await;
    engines.iter().cloned().zip(cached).collect()
}

/// One sidecar's verdict on one prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Its index matched what every engine held, on every worker.
    Agrees,
    /// It did not (or did not answer): how.
    Differs(String),
    /// An engine's cache changed while it was asked: nothing to judge by.
    Unsettled,
}

/// Longer than an event takes to arrive (the soak's engines publish at most 100 ms late): an
/// engine whose cache did not change over this long before the sidecar was asked must be
/// indexed as it is.
const SETTLE: Duration = Duration::from_millis(150);
/// Prompts probed at once (each costs every engine two `/oracle` answers under load).
const PROBES_AT_ONCE: usize = 8;

/// How the indexes compare with the engines.
#[derive(Debug, Clone, Default)]
pub struct EngineAgreement {
    /// Per sidecar, the share of the prompts judged on which it agreed (`None`: none judged).
    pub shares: Vec<Option<f64>>,
    /// How the first disagreements went, per sidecar, worker by worker (matched blocks in the
    /// index against those the engine held).
    pub disagreements: Vec<String>,
}

/// Disagreements kept per probe round, for the report.
const DISAGREEMENTS_KEPT: usize = 6;

/// Per sidecar, the share of `bodies` whose index view equals the engines' caches on every
/// worker (a worker the sidecar does not list: 0 blocks), among the prompts the engines held
/// still for: each engine is asked before and after the sidecar, 150 ms apart, and a prompt
/// whose cached blocks changed meanwhile is not judged. A sidecar that does not answer agrees
/// on nothing. `None` for a sidecar when no prompt held still.
pub async fn engine_agreement(
    http: &reqwest::Client,
    sidecars: &[String],
    engines: &[String],
    bodies: &[Value],
) -> Result<EngineAgreement> {
    use futures::StreamExt as _;
    let one = |body: &Value| {
        let hashes = prompt_hashes(body);
        let body = body.clone();
        async move {
            let hint = kvroute_protocol::hint::HintRequest {
                model: MODEL.into(),
                hashes: hashes?,
                finished: Vec::new(),
            };
            let per_sidecar = sidecars.iter().map(|base| {
                let (hint, body) = (&hint, &body);
                async move {
                    let before = engines_view(http, engines, body).await;
                    tokio::time::sleep(SETTLE).await;
                    let view = index_view(http, base, hint).await;
                    if engines_view(http, engines, body).await != before {
                        return Verdict::Unsettled;
                    }
                    let Some(view) = view else {
                        return Verdict::Differs(format!("{base}: no decision found"));
                    };
                    let held = |w: &str| view.iter().find(|(v, _)| v == w).map_or(0, |(_, m)| *m);
                    let wrong: Vec<String> = before
                        .iter()
                        .filter(|(e, cached)| held(e) != *cached)
                        .map(|(e, cached)| format!("{e} indexed {} held {cached}", held(e)))
                        .collect();
                    if wrong.is_empty() {
                        Verdict::Agrees
                    } else {
                        Verdict::Differs(format!("{base}: {}", wrong.join(", ")))
                    }
                }
            });
            anyhow::Ok(futures::future::join_all(per_sidecar).await)
        }
    };
    let answers: Vec<Result<Vec<Verdict>>> = futures::stream::iter(bodies.iter().map(one))
        .buffer_unordered(PROBES_AT_ONCE)
        .collect()
        .await;
    EngineAgreement::tally(answers, sidecars.len())
}

impl EngineAgreement {
    /// Per prompt, each sidecar's verdict: the shares, and the first disagreements.
    pub(crate) fn tally(answers: Vec<Result<Vec<Verdict>>>, sidecars: usize) -> Result<Self> {
        let (mut agreed, mut judged) = (vec![0usize; sidecars], vec![0usize; sidecars]);
        let mut disagreements = Vec::new();
        for answer in answers {
            for (i, verdict) in answer?.into_iter().enumerate() {
                agreed[i] += usize::from(verdict == Verdict::Agrees);
                judged[i] += usize::from(verdict != Verdict::Unsettled);
                if let Verdict::Differs(how) = verdict {
                    if disagreements.len() < DISAGREEMENTS_KEPT {
                        disagreements.push(how);
                    }
                }
            }
        }
        let shares = agreed
            .into_iter()
            .zip(judged)
            .map(|(a, n)| (n > 0).then(|| a as f64 / n as f64))
            .collect();
        Ok(EngineAgreement {
            shares,
            disagreements,
        })
    }
}

/// `probes` of the recent prompts, at random.
fn pick(recent: &[Value], probes: usize, rng: &mut Rng) -> Vec<Value> {
    if recent.is_empty() {
        return Vec::new();
    }
    (0..probes)
        .map(|_| recent[rng.range(0, recent.len() - 1)].clone())
        .collect()
}

/// Break the fleet as `fault` says, hold it, undo it. For a worker killed: from the kill to the
/// moment every sidecar stopped using it.
async fn apply(
    stack: &mut Stack,
    fault: Fault,
    hold: Duration,
) -> Result<Option<(Instant, Instant)>> {
    let http = stack.http.clone();
    let admin = |n: usize, what: &str| format!("http://{}/admin/{what}", stack.engines[n].address);
    match fault {
        Fault::NatsRestart => {
            stack.kill("nats");
            tokio::time::sleep(hold).await;
            stack.restart_nats().await?;
        }
        Fault::EngineRestart(n) => {
            http.post(admin(n, "restart"))
                .send()
                .await?
                .error_for_status()?;
        }
        Fault::EngineDropsEvents(n) => {
            http.post(admin(n, "drop_events"))
                .body("50")
                .send()
                .await?
                .error_for_status()?;
            tokio::time::sleep(hold).await;
        }
        Fault::EventLoss | Fault::Partition => {
            let loss = if fault == Fault::Partition { 1.0 } else { 0.2 };
            stack.set_transport_loss(1, loss)?;
            tokio::time::sleep(hold).await;
            stack.set_transport_loss(1, 0.0)?;
        }
        Fault::SidecarKill => {
            stack.kill("sidecar");
            tokio::time::sleep(hold).await;
            stack.restart_sidecar().await?;
        }
        Fault::ReplicaKill => {
            stack.kill("sidecar-1");
            tokio::time::sleep(hold).await;
            stack.restart_replica_sidecar(1, |toml| toml).await?;
        }
        Fault::DynamoWorkerKill(n) => {
            let (killed, seen) = dynamo::kill_worker(stack, n).await?;
            tokio::time::sleep(hold.saturating_sub(killed.elapsed())).await;
            dynamo::restart_worker(stack, n).await?;
            return Ok(Some((killed, seen)));
        }
    }
    Ok(None)
}

/// How a fault healed: after how long, and every probe on the way.
struct Healing {
    /// `None`: not within the deadline.
    after: Option<Duration>,
    /// Per probe: seconds since the fault was undone, each sidecar's agreement with the
    /// engines (`None`: no prompt held still), and how the first disagreements went.
    probes: Vec<(f64, Vec<Option<f64>>, Vec<String>)>,
}

/// The engines' addresses.
fn engines_of(stack: &Stack) -> Vec<String> {
    stack.engines.iter().map(|e| e.address.clone()).collect()
}

/// How every sidecar's index compares with what the engines hold of `bodies`, asked as the
/// fleet can be: simulated engines' `/oracle`, Dynamo workers' reported cached tokens.
async fn agreement(
    stack: &Stack,
    fleet: Fleet,
    bodies: &[Value],
    rng: &mut Rng,
) -> Result<EngineAgreement> {
    let sidecars = sidecars_of(stack);
    match fleet {
        Fleet::Simulated => {
            engine_agreement(&stack.http, &sidecars, &engines_of(stack), bodies).await
        }
        Fleet::Dynamo => dynamo::agreement(stack, &sidecars, bodies, rng).await,
    }
}

/// Probe every second until every sidecar agrees with the engines on `healed_share` of the
/// probes, or the deadline passes.
async fn heal(stack: &Stack, bench: &SoakBench, tally: &Tally, rng: &mut Rng) -> Result<Healing> {
    let start = Instant::now();
    let mut probes = Vec::new();
    loop {
        let bodies = pick(&tally.recent(), bench.probes, rng);
        let agreement = agreement(stack, bench.fleet, &bodies, rng).await?;
        let healed = agreement
            .shares
            .iter()
            .all(|s| s.is_some_and(|s| s >= bench.healed_share));
        probes.push((
            start.elapsed().as_secs_f64(),
            agreement.shares,
            agreement.disagreements,
        ));
        if healed {
            return Ok(Healing {
                after: Some(start.elapsed()),
                probes,
            });
        }
        if start.elapsed() > bench.deadline {
            return Ok(Healing {
                after: None,
                probes,
            });
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// The simulated fleet: engines whose events arrive late, two replicas each reading NATS
/// through a lossy proxy.
fn simulated_fleet(bench: &SoakBench) -> StackOptions {
    let mut opts = StackOptions::new("soak", Mode::Kvroute);
    opts.sim = SimOptions {
        engines: bench.engines,
        capacity_blocks: bench.capacity_blocks,
        event_formats: vec!["dynamo".into(), "vllm-map".into()],
        event_delay_ms: "2,50,100".into(),
        ..SimOptions::default()
    };
    opts.replicas = Some(ReplicaOptions {
        count: 2,
        interval_ms: 1000,
        loss: 0.0,
        lossy: None,
        reconcile: true,
        share_load: true,
        load_interval_ms: 10,
    });
    opts.transport_loss = Some(TransportLoss { loss: 0.0, seed: 7 });
    opts
}

/// Run the soak; writes `soak.json` and `soak.md` into `out`.
pub async fn run(bench: &SoakBench, out: &std::path::Path) -> Result<Value> {
    let opts = match bench.fleet {
        Fleet::Simulated => simulated_fleet(bench),
        Fleet::Dynamo => dynamo::stack_options(bench.engines, bench.capacity_blocks),
    };
    let mut stack = Stack::start(opts)
        .await
        .context("starting the soak's fleet")?;
    let workload = Arc::new(ChatWorkload::generate(&ChatSpec {
        conversations: 96,
        turns: 6,
        ..ChatSpec::demo()
    }));
    let routers: Vec<String> = stack.replicas.iter().map(|r| r.envoy_url.clone()).collect();
    let started = Instant::now();
    let (stop, tally) = (Arc::new(AtomicBool::new(false)), Arc::new(Tally::default()));
    let load = tokio::spawn(clients(
        stack.http.clone(),
        routers,
        workload,
        bench.clients,
        stop.clone(),
        tally.clone(),
    ));
    let mut rng = Rng::new(99);
    tokio::time::sleep(bench.steady).await;
    let baseline: Vec<Option<f64>> = heal(&stack, bench, &tally, &mut rng)
        .await?
        .probes
        .pop()
        .map(|p| p.1)
        .unwrap_or_default();
    println!("soak: steady state, indexes agree with the engines on {baseline:?} of the probes");
    let mut faults = Vec::new();
    for &fault in &bench.faults {
        let failed_before = tally.failures().len();
        let at = started.elapsed();
        let blind = apply(&mut stack, fault, bench.hold)
            .await
            .with_context(|| format!("applying {}", fault.name()))?;
        if let Some(window) = blind {
            tally
                .blind
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(window);
        }
        let healing = heal(&stack, bench, &tally, &mut rng).await?;
        let healed = healing.after;
        let row = json!({
            "fault": fault.name(),
            "at_s": at.as_secs_f64(),
            "held_s": bench.hold.as_secs_f64(),
            "healed_after_s": healed.map(|d| d.as_secs_f64()),
            "agreement_with_engines": healing.probes.last().map(|p| p.1.clone()),
            "disagreements": healing.probes.last().map(|p| p.2.clone()),
            "probes": healing.probes,
            "failed_requests": tally.failures().len() - failed_before,
            "kill_seen_after_ms": blind.map(|(killed, seen)| (seen - killed).as_secs_f64() * 1e3),
        });
        println!(
            "soak: {} at {:.0} s: healed {} after it was undone; requests failed meanwhile: {}",
            fault.name(),
            at.as_secs_f64(),
            healed.map_or("never (past the deadline)".to_owned(), |d| format!(
                "{:.1} s",
                d.as_secs_f64()
            )),
            row["failed_requests"],
        );
        if healed.is_none() {
            println!("soak: still disagreeing: {}", row["disagreements"]);
        }
        faults.push(row);
        stack.check_alive()?;
        tokio::time::sleep(bench.steady).await;
    }
    stop.store(true, Ordering::Relaxed);
    load.await.context("the clients")?;
    // Load stopped: let late events land and the replicas compare once more.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let sidecars = sidecars_of(&stack);
    let recent = tally.recent();
    let final_engines = agreement(&stack, bench.fleet, &recent, &mut rng).await?;
    let (final_engines, final_disagreements) = (final_engines.shares, final_engines.disagreements);
    let final_replicas = match sidecars.len() {
        1 => None,
        _ => Some(crate::bench_replicas::agreement(&stack.http, &sidecars, &recent).await?),
    };
    let failures = tally.failures();
    let saved: Vec<&Failure> = failures.iter().filter(|f| f.saved).collect();
    let blind = saved.iter().filter(|f| tally.blind(f)).count();
    let at = |t: Instant| t.saturating_duration_since(started).as_secs_f64();
    let errors: Vec<String> = failures
        .iter()
        .take(ERRORS_KEPT)
        .map(|f| {
            format!(
                "sent at {:.2} s, failed at {:.2} s{}: {}",
                at(f.sent),
                at(f.failed),
                if tally.blind(f) {
                    " (before the kill was seen)"
                } else {
                    ""
                },
                f.error
            )
        })
        .collect();
    let doc = json!({
        "fleet": match bench.fleet {
            Fleet::Simulated => "simulated",
            Fleet::Dynamo => "dynamo",
        },
        "replicas": sidecars.len(),
        "engines": bench.engines,
        "capacity_blocks": bench.capacity_blocks,
        "clients": bench.clients,
        "seconds": started.elapsed().as_secs_f64(),
        "requests": tally.sent.load(Ordering::Relaxed),
        "failed_requests": failures.len(),
        "failures_a_retry_saved": saved.len(),
        "failures_before_a_kill_was_seen": blind,
        "failures_a_retry_could_have_saved": saved.len() - blind,
        "errors": errors,
        "hit_rate": tally.cached_tokens.load(Ordering::Relaxed) as f64
            / tally.prompt_tokens.load(Ordering::Relaxed).max(1) as f64,
        "baseline_agreement_with_engines": baseline,
        "faults": faults,
        "final_agreement_with_engines": final_engines,
        "final_disagreements": final_disagreements,
        "final_agreement_between_replicas": final_replicas,
        "transport_counts": stack.transport_counts().iter().map(|c| json!({"forwarded": c.forwarded, "dropped": c.dropped})).collect::<Vec<_>>(),
    });
    crate::report::write_pair(out, file_stem(bench.fleet), &doc, &markdown(&doc))?;
    Ok(doc)
}

/// The report's file name (without extension): `soak`, `soak_dynamo`.
pub fn file_stem(fleet: Fleet) -> &'static str {
    match fleet {
        Fleet::Simulated => "soak",
        Fleet::Dynamo => "soak_dynamo",
    }
}

/// The report docs/benchmarks.md quotes.
pub fn markdown(doc: &Value) -> String {
    let mut s = format!(
        "{} {} engines ({} blocks each), {} replicas, {} clients, {:.0} s: {} requests, {} failed, {} of them a retry served; hit rate {:.1}%\n\nIndexes agreeing with the engines: steady {}, final {}; replicas agreeing with each other at the end: {}\n\n| fault | at | held | healed after undone | agreement with engines then | requests failed |\n|---|---|---|---|---|---|\n",
        doc["engines"],
        doc["fleet"].as_str().unwrap_or(""),
        doc["capacity_blocks"],
        doc["replicas"],
        doc["clients"],
        doc["seconds"].as_f64().unwrap_or(0.0),
        doc["requests"],
        doc["failed_requests"],
        doc["failures_a_retry_saved"],
        100.0 * doc["hit_rate"].as_f64().unwrap_or(0.0),
        doc["baseline_agreement_with_engines"],
        doc["final_agreement_with_engines"],
        doc["final_agreement_between_replicas"]
            .as_f64()
            .map_or("— (one)".to_owned(), |a| format!("{:.1}%", 100.0 * a)),
    );
    for f in doc["faults"].as_array().into_iter().flatten() {
        s.push_str(&format!(
            "| {} | {:.0} s | {:.0} s | {} | {} | {} |\n",
            f["fault"].as_str().unwrap_or(""),
            f["at_s"].as_f64().unwrap_or(0.0),
            f["held_s"].as_f64().unwrap_or(0.0),
            f["healed_after_s"]
                .as_f64()
                .map_or("not within the deadline".to_owned(), |s| format!(
                    "{s:.1} s"
                )),
            f["agreement_with_engines"],
            f["failed_requests"],
        ));
    }
    s
}
