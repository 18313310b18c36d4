//! `kvroute-bench load` (`make bench-load`): open-loop load, the regime users decide in.
//!
//! Sessions arrive as a Poisson process at a ladder of request rates up to past saturation;
//! each session sends its turns in order, waiting for each answer and a think time before the
//! next (a single-turn session is one request). The Mooncake traces arrive at their own
//! timestamps instead, sped up to each rate. Every mode gets a fresh fleet and exactly the
//! same sessions at the same offsets. The fleet can be full: engines share their GPU a step at
//! a time (`kvroute-sim --batching`: a prefill slows its neighbours), the working set outgrows
//! one engine's cache but fits the fleet's, their events arrive as late as real vLLM's. With
//! `--dynamo N` the same stream and rates also run on N Dynamo mocker workers behind Dynamo's
//! KV router, its round robin, and kvroute in pin mode. With `--vllm` the fleet is real vLLM
//! 0.32 engines on CPU instead (`make venv-vllm`): what the simulator's cost model predicts,
//! checked against an engine's own.
//!
//! Per rate: TTFT p50/p90/p99, end-to-end latency, throughput, hit rate, imbalance, errors, the
//! filter's preparation and pause for the hint (its own histograms in Envoy), and the CPU each
//! process used (on a small machine the proxy side can saturate before the engines: the report
//! says which did). Per mode: the highest rate whose TTFT p90 stays within
//! the target — [`TARGET_MULTIPLE`] × the TTFT of a cold prompt on an idle fleet, measured at
//! the start of the run — and its goodput (requests a second answered within the target).
//! Beside the report, `requests.jsonl` holds every request: when it was sent, its TTFT, its
//! prompt and cached tokens, the engine (from Envoy's access log where the answer does not say),
//! and Envoy's split of its TTFT: held after its last byte, the engine's time to respond.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use serde_json::{json, Value};

use crate::bench::Scale;
use crate::client::{oracle_cached_all, send_streaming, send_streaming_as, Outcome};
use crate::process::Process;
use crate::report::quantile;
use crate::stack::{Mode, SimOptions, Stack, StackOptions, MODEL};
use crate::traces::{self, Line, TraceSpec};
use crate::vllm::VllmOptions;
use crate::workload::{words, ChatSpec, ChatWorkload, Rng, CHAT, COMPLETIONS};

/// The TTFT target, in cold prefills of an idle fleet.
pub const TARGET_MULTIPLE: f64 = 2.0;

/// A mode's ladder stops after this many rates past the target: higher ones only queue more.
const PAST_SATURATION: usize = 2;

/// Envoy's stats flush in the ladder's stacks: the filter's histograms are read per rate.
const STATS_FLUSH_MS: u64 = 500;

/// The filter's histograms each rate reports quantiles of: its preparation and its pause for
/// the hint (µs, recorded inside Envoy), `(histogram, key prefix in the point)`.
const FILTER_TIMINGS: [(&str, &str); 2] = [
    ("wasmcustom.kvroute.prepare_us", "filter_prepare"),
    ("wasmcustom.kvroute.hint_pause_us", "hint_pause"),
];

/// A request not answered within this long is an error (keeps every step bounded).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// One workload of the ladder.
#[derive(Debug, Clone)]
pub struct LoadWorkload {
    /// Name in reports.
    pub name: &'static str,
    /// Where its requests and their arrivals come from.
    pub source: Source,
    /// KV cache per engine, in blocks: the working set outgrows one engine, fits the fleet.
    pub capacity_blocks: usize,
}

/// Where a workload's requests come from.
#[derive(Debug, Clone)]
pub enum Source {
    /// Conversations of a [`ChatSpec`] (one turn each for single-turn workloads), arriving as a
    /// Poisson process at each rate.
    Chat {
        /// The conversations.
        spec: ChatSpec,
        /// Mean think time between a session's turns.
        think: Duration,
    },
    /// A Mooncake trace (`testdata/traces/<file>`) replayed at its own timestamps, sped up to
    /// each rate of the ladder: its bursts and its requests' prefix structure are kept (one
    /// trace block is one engine block of [`TRACE_BLOCK_TOKENS`] tokens), each step continues
    /// where the last one ended.
    Trace {
        /// The file.
        file: &'static str,
        /// Its first requests, replayed at the lowest rate before the ladder and not measured:
        /// a fleet in service has seen the trace's last minutes.
        warm_up: usize,
    },
}

/// Tokens per 512-token trace block on the ladder: one engine block, so the trace's prefix
/// structure is exact at 1/32 of its length (median prompts of ~250 tokens, like the other
/// workloads').
pub const TRACE_BLOCK_TOKENS: usize = 16;

/// Prompt tokens a simulated engine's step computes at most (`kvroute-sim --chunk-tokens`'s
/// default); the mockers get the same budget.
const SIM_CHUNK_TOKENS: usize = 2048;

/// KV cache per engine for the chat-shaped workloads, in blocks.
const CHAT_CAPACITY: usize = 512;

/// KV cache per engine for the traces, in blocks: their reuse comes back after one to five
/// minutes of the trace's time (most of the conversation trace's hits), ~25k blocks of its
/// traffic; 8 engines of this hold about that, one engine an eighth.
const TRACE_CAPACITY: usize = 4096;

/// A trace's warm-up, in requests: with every block ever seen kept, the conversation trace's
/// first 250 would reuse 3-9% of their blocks, the next 250 26%.
const TRACE_WARM_UP: usize = 300;

impl LoadWorkload {
    /// llm-d's shared-prefix shape scaled to this machine: 32 groups each behind its own long
    /// prefix, single-turn questions; the working set is about three engines' caches.
    pub fn shared_prefix() -> Self {
        LoadWorkload {
            name: "shared_prefix",
            source: Source::Chat {
                spec: Self::shared_prefix_spec(),
                think: Duration::ZERO,
            },
            capacity_blocks: CHAT_CAPACITY,
        }
    }

    fn shared_prefix_spec() -> ChatSpec {
        ChatSpec {
            seed: 21,
            system_prompt_words: vec![360; 32],
            conversations: 0,
            turns: 1,
            user_words: (40, 80),
            reply_words: (0, 0),
            max_tokens: 8,
            hot_share: None,
        }
    }

    /// The shared prefixes with one of them hot: half the questions behind one prefix, which
    /// one engine cannot serve at the ladder's upper rates (where spreading a prefix pays).
    pub fn hot_prefix() -> Self {
        LoadWorkload {
            name: "hot_prefix",
            source: Source::Chat {
                spec: ChatSpec {
                    seed: 25,
                    hot_share: Some(0.5),
                    ..Self::shared_prefix_spec()
                },
                think: Duration::ZERO,
            },
            capacity_blocks: CHAT_CAPACITY,
        }
    }

    /// The same workload drawn with another seed: other prompts and questions, the groups'
    /// users in another order. A router that places a new prefix by arrival order (the oracle,
    /// sglang-router) maps the groups onto the engines the same way on every run of one seed;
    /// runs of several seeds compare routers over maps, not on one. A trace has no seed: it is
    /// returned unchanged.
    pub fn with_seed(mut self, seed: u64) -> Self {
        if let Source::Chat { spec, .. } = &mut self.source {
            spec.seed = seed;
        }
        self
    }

    /// Every workload the ladder knows, by name.
    pub fn named(name: &str) -> Option<Self> {
        [
            Self::shared_prefix(),
            Self::hot_prefix(),
            Self::chat(),
            Self::conversation_trace(),
            Self::synthetic_trace(),
        ]
        .into_iter()
        .find(|w| w.name == name)
    }

    /// Multi-turn chat behind 16 apps' system prompts, users thinking between turns: the
    /// system prompts alone outgrow one engine's cache.
    pub fn chat() -> Self {
        LoadWorkload {
            name: "chat",
            source: Source::Chat {
                spec: ChatSpec {
                    seed: 23,
                    system_prompt_words: (0..16).map(|i| 160 + 20 * i).collect(),
                    conversations: 0,
                    turns: 4,
                    user_words: (30, 60),
                    reply_words: (20, 40),
                    max_tokens: 8,
                    hot_share: None,
                },
                think: Duration::from_millis(1000),
            },
            capacity_blocks: CHAT_CAPACITY,
        }
    }

    /// The Mooncake conversation trace (real arrivals of one hour of chat traffic) at its own
    /// timestamps.
    pub fn conversation_trace() -> Self {
        Self::trace("conversation_trace", "conversation_trace.jsonl")
    }

    /// The Mooncake synthetic trace (Poisson arrivals, conversations' turns in order) at its
    /// own timestamps.
    pub fn synthetic_trace() -> Self {
        Self::trace("synthetic_trace", "synthetic_trace.jsonl")
    }

    fn trace(name: &'static str, file: &'static str) -> Self {
        LoadWorkload {
            name,
            source: Source::Trace {
                file,
                warm_up: TRACE_WARM_UP,
            },
            capacity_blocks: TRACE_CAPACITY,
        }
    }

    /// Turns per session (1 for a trace's requests) and the mean think time between them.
    fn turns(&self) -> (usize, Duration) {
        match &self.source {
            Source::Chat { spec, think } => (spec.turns.max(1), *think),
            Source::Trace { .. } => (1, Duration::ZERO),
        }
    }

    /// Four prompts no engine has seen, at the size that sets the target: the longest system
    /// prompt with a question for a chat workload, the trace's 90th-percentile prompt for a
    /// trace (its TTFT p90 is what the target bounds).
    fn cold_prompts(&self) -> Result<Vec<(&'static str, Value)>> {
        let mut rng = Rng::new(0xc01d);
        match &self.source {
            Source::Chat { spec, .. } => Ok((0..4)
                .map(|_| {
                    let words_in =
                        |(lo, hi): (usize, usize), rng: &mut Rng| rng.range(lo, hi.max(lo));
                    let longest = spec.system_prompt_words.iter().max().copied();
                    let system = words(&mut rng, longest.unwrap_or(0));
                    let n = words_in(spec.user_words, &mut rng);
                    let user = words(&mut rng, n);
                    let body = json!({"model": MODEL, "max_tokens": spec.max_tokens,
                        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]});
                    (CHAT, body)
                })
                .collect()),
            Source::Trace { file, .. } => {
                let lines = trace_lines(file)?;
                let lengths: Vec<f64> = lines.iter().map(|l| l.input_length as f64).collect();
                let p90 = quantile(&lengths, 0.9) as usize;
                let tokens = (p90 * TRACE_BLOCK_TOKENS).div_ceil(512);
                Ok((0..4)
                    .map(|_| {
                        // Block ids far beyond any trace's, so no engine holds them.
                        let id = u64::MAX - rng.next_u64() % (1 << 32);
                        let prompt = traces::block_tokens(id, tokens, trace_spec().vocab);
                        let body = json!({"model": MODEL, "max_tokens": trace_spec().max_output, "prompt": prompt});
                        (COMPLETIONS, body)
                    })
                    .collect())
            }
        }
    }
}

/// Who routes a ladder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadMode {
    /// Envoy in this mode over the simulated engines.
    Sim(Mode),
    /// Straight to a Dynamo 1.6.1 frontend over mocker workers, in this `--router-mode`
    /// (`kv`: Dynamo's KV router; `round-robin`).
    Dynamo(&'static str),
    /// Envoy + kvroute in pin mode in front of a `kv` Dynamo frontend.
    KvrouteOnDynamo,
    /// A peer router from PyPI ([`crate::peers::PEERS`], by its mode name) in front of the
    /// simulated engines.
    Peer(&'static str),
    /// The harness routing each request itself with what no router has: every engine's cache
    /// asked exactly (its `/oracle`) just before, the request goes to the engine holding the
    /// most of the prompt; ties (nothing held) to the one with the fewest requests in flight.
    Oracle,
    /// kvroute over the simulated engines with more sidecar configuration
    /// ([`LoadBench::with_variant`], by its name): a rule change measured beside the rule.
    Variant(&'static str),
}

impl LoadMode {
    /// Its name in reports.
    pub fn name(self) -> String {
        match self {
            LoadMode::Sim(mode) => mode.name().to_owned(),
            LoadMode::Dynamo(router) => format!("dynamo_{}", router.replace('-', "_")),
            LoadMode::KvrouteOnDynamo => "kvroute_pin_dynamo".into(),
            LoadMode::Peer(mode) => mode.to_owned(),
            LoadMode::Oracle => "oracle".into(),
            LoadMode::Variant(name) => format!("kvroute:{name}"),
        }
    }

    /// The stack mode of a mode run by Envoy over the simulated (or vLLM) engines.
    fn envoy_mode(self) -> Option<Mode> {
        match self {
            LoadMode::Sim(mode) => Some(mode),
            LoadMode::Variant(_) => Some(Mode::Kvroute),
            _ => None,
        }
    }

    /// Whether it runs on the Dynamo mocker fleet (its own engines, so its own target).
    fn on_dynamo(self) -> bool {
        matches!(self, LoadMode::Dynamo(_) | LoadMode::KvrouteOnDynamo)
    }

    /// Whether it needs something only some machines have (Dynamo, a peer): one that does not
    /// start is reported unavailable, not fatal.
    fn optional(self) -> bool {
        !matches!(
            self,
            LoadMode::Sim(_) | LoadMode::Oracle | LoadMode::Variant(_)
        )
    }
}

/// What the load benchmark runs.
#[derive(Debug, Clone)]
pub struct LoadBench {
    /// Simulated engines.
    pub engines: usize,
    /// KV cache per engine, in blocks, for every workload instead of its own.
    pub capacity_blocks: Option<usize>,
    /// The ladder: request rates, req/s, ascending.
    pub rates: Vec<f64>,
    /// How long sessions keep arriving at each rate.
    pub step: Duration,
    /// The workloads.
    pub workloads: Vec<LoadWorkload>,
    /// The modes.
    pub modes: Vec<LoadMode>,
    /// The engines' settings beyond the above.
    pub sim: SimOptions,
    /// The Dynamo mocker fleet of the Dynamo modes.
    pub dynamo: crate::dynamo::DynamoOptions,
    /// Appended to the sidecar's configuration (the kvroute modes), for A/B runs.
    pub sidecar_toml: String,
    /// Each [`LoadMode::Variant`]'s name and its configuration, appended after `sidecar_toml`.
    pub variants: Vec<(&'static str, String)>,
    /// Real vLLM engines instead of simulated ones ([`LoadBench::on_vllm`]).
    pub vllm: Option<VllmOptions>,
    /// Start every mode's fleet first and run each rate on all of them in turn (the order
    /// reversed at every other rate), instead of one mode's whole ladder after another's: on a
    /// machine whose speed drifts over minutes, modes compared within the same minutes.
    pub interleave: bool,
}

impl LoadBench {
    /// The ladder at `scale` on `engines` engines.
    pub fn new(scale: Scale, engines: usize) -> Self {
        let sim = SimOptions {
            engines,
            // A decode step costs as much as 40 prompt tokens' prefill (50-100 on a datacenter
            // GPU); all of it slowed so the fleet saturates at rates the proxy side serves on
            // two cores.
            batching: Some(1000),
            prefill_us_per_token: 1000,
            decode_us_per_token: 40_000,
            base_latency_us: 0,
            max_running: 16,
            output_tokens: 8,
            event_formats: vec!["vllm-map".into()],
            event_delay_ms: crate::bench::REAL_EVENT_DELAY_MS.into(),
            ..SimOptions::default()
        };
        let per_engine = |r: &[f64]| r.iter().map(|x| x * engines as f64).collect::<Vec<_>>();
        // The mockers get the simulated engines' GPU (their default one prices a decode step by
        // the cache in use, which on these small caches outweighs a prefill, so a hit saved
        // almost nothing): the two fleets saturate alike and a hit saves the same.
        let dynamo = crate::dynamo::DynamoOptions {
            aggregated: engines,
            speedup_ratio: 1.0,
            cost: Some(crate::dynamo::MockerCost {
                prefill_ms_per_token: sim.prefill_us_per_token as f64 / 1e3,
                step_ms: sim.decode_us_per_token as f64 / 1e3,
            }),
            batch_limits: Some((sim.max_running, SIM_CHUNK_TOKENS)),
            ..Default::default()
        };
        let sim_modes = |modes: &[Mode]| modes.iter().map(|&m| LoadMode::Sim(m)).collect();
        match scale {
            Scale::Smoke => LoadBench {
                engines,
                capacity_blocks: None,
                rates: per_engine(&[0.5, 2.0]),
                step: Duration::from_secs(4),
                workloads: vec![LoadWorkload::shared_prefix()],
                modes: sim_modes(&[Mode::RoundRobin, Mode::Kvroute]),
                sim,
                dynamo,
                sidecar_toml: String::new(),
                variants: Vec::new(),
                vllm: None,
                interleave: false,
            },
            Scale::Quick => LoadBench {
                engines,
                capacity_blocks: None,
                rates: per_engine(&[0.5, 1.0, 2.0, 3.0, 4.0, 6.0]),
                step: Duration::from_secs(10),
                workloads: vec![LoadWorkload::shared_prefix()],
                modes: sim_modes(&[Mode::RoundRobin, Mode::RingHash, Mode::Kvroute]),
                sim,
                dynamo,
                sidecar_toml: String::new(),
                variants: Vec::new(),
                vllm: None,
                interleave: false,
            },
            Scale::Full => LoadBench {
                engines,
                capacity_blocks: None,
                rates: per_engine(&[0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0]),
                step: Duration::from_secs(12),
                workloads: vec![LoadWorkload::shared_prefix(), LoadWorkload::chat()],
                modes: sim_modes(&[Mode::RoundRobin, Mode::RingHash, Mode::Kvroute]),
                sim,
                dynamo,
                sidecar_toml: String::new(),
                variants: Vec::new(),
                vllm: None,
                interleave: false,
            },
        }
    }

    /// The cache per engine `workload` runs with; on vLLM a workload's own holds as many
    /// tokens as on the simulator, in vLLM's larger blocks.
    pub fn capacity(&self, workload: &LoadWorkload) -> usize {
        let own = match self.vllm {
            Some(_) => {
                workload.capacity_blocks * self.sim.block_size as usize
                    / crate::vllm::BLOCK_SIZE as usize
            }
            None => workload.capacity_blocks,
        };
        self.capacity_blocks.unwrap_or(own)
    }

    /// Run the fleet's modes on real vLLM engines (as many as [`LoadBench::engines`]) instead
    /// of simulated ones. Only Envoy's modes run there (the oracle asks the simulator's
    /// `/oracle`; the peers and Dynamo are not set up for them).
    pub fn on_vllm(&mut self) {
        self.vllm = Some(VllmOptions {
            engines: self.engines,
            ..VllmOptions::default()
        });
    }

    /// Run kvroute with `toml` appended to its sidecar's configuration too, reported as
    /// `kvroute:<name>`.
    pub fn with_variant(&mut self, name: &'static str, toml: String) {
        self.variants.push((name, toml));
        self.modes.push(LoadMode::Variant(name));
    }

    /// Run the oracle too ([`LoadMode::Oracle`]).
    pub fn with_oracle(&mut self) {
        self.modes.push(LoadMode::Oracle);
    }

    /// Run the peer routers too ([`crate::peers::PEERS`]; `make venv-peers` installs them), each
    /// in front of the simulated engines on the same stream.
    pub fn with_peers(&mut self) {
        self.modes
            .extend(crate::peers::PEERS.iter().map(|p| LoadMode::Peer(p.mode)));
    }

    /// Run the Dynamo modes too: a fleet of `workers` mocker workers ([`LoadMode::Dynamo`],
    /// [`LoadMode::KvrouteOnDynamo`]), the same rates and request stream.
    pub fn with_dynamo(&mut self, workers: usize) {
        self.dynamo.aggregated = workers;
        self.modes.extend([
            LoadMode::Dynamo("kv"),
            LoadMode::Dynamo("round-robin"),
            LoadMode::KvrouteOnDynamo,
        ]);
    }
}

/// One session of the stream: when it starts, and each turn's body with the think time before
/// it.
#[derive(Debug, Clone)]
pub struct Planned {
    /// Offset from the step's start.
    pub at: Duration,
    /// The API path of its requests.
    pub path: &'static str,
    /// The app whose system prompt it starts with (chat-shaped workloads): which group of
    /// users it belongs to, for reading how a mode placed the groups.
    pub group: Option<usize>,
    /// (think time before the turn, body).
    pub turns: Vec<(Duration, Value)>,
}

/// The request stream, the same for every mode: a first step not measured (a fleet in service
/// has warm caches), then step `k` holds the sessions arriving at `rates[k]` over `step`, all
/// drawn from one workload so the steps share its prefixes and a fleet carries its caches up
/// the ladder. The warm-up is at the lowest rate: one step of a chat workload, a trace's first
/// `warm_up` requests (its reuse comes back minutes later).
pub fn plan(workload: &LoadWorkload, rates: &[f64], step: Duration) -> Result<Vec<Vec<Planned>>> {
    let lowest = *rates.first().context("an empty ladder")?;
    match &workload.source {
        Source::Chat { spec, think } => {
            let ladder: Vec<f64> = std::iter::once(lowest)
                .chain(rates.iter().copied())
                .collect();
            Ok(plan_chat(spec, *think, &ladder, step))
        }
        Source::Trace { file, warm_up } => {
            let lines = trace_lines(file)?;
            let warm_up = (*warm_up, Duration::from_secs_f64(*warm_up as f64 / lowest));
            let windows: Vec<(usize, Duration)> = std::iter::once(warm_up)
                .chain(rates.iter().map(|r| {
                    let n = (r * step.as_secs_f64()).round().max(1.0) as usize;
                    (n, step)
                }))
                .collect();
            plan_trace(&lines, &windows)
        }
    }
}

/// The lines of the trace `file`, as the ladder reads them ([`trace_spec`]).
fn trace_lines(file: &str) -> Result<Vec<traces::Line>> {
    traces::lines(&traces::path(file), &trace_spec())
}

/// How the ladder turns a trace's lines into requests: the whole file, blocks of
/// [`TRACE_BLOCK_TOKENS`], as many output tokens as the engines decode.
fn trace_spec() -> TraceSpec {
    TraceSpec {
        requests: usize::MAX,
        block_tokens: TRACE_BLOCK_TOKENS,
        max_output: 8,
        vocab: 2000,
    }
}

/// A trace's requests per second at its own timestamps.
pub fn trace_rate(lines: &[Line]) -> f64 {
    let span = match (lines.first(), lines.last()) {
        (Some(a), Some(b)) => b.at().saturating_sub(a.at()).as_secs_f64(),
        _ => 0.0,
    };
    lines.len().saturating_sub(1) as f64 / span.max(1e-3)
}

/// Sessions of `spec`, arriving as a Poisson process.
fn plan_chat(spec: &ChatSpec, think: Duration, rates: &[f64], step: Duration) -> Vec<Vec<Planned>> {
    let turns = spec.turns.max(1);
    let counts: Vec<usize> = rates
        .iter()
        .map(|r| ((r * step.as_secs_f64()) / turns as f64).round().max(1.0) as usize)
        .collect();
    let all = ChatWorkload::generate(&ChatSpec {
        conversations: counts.iter().sum(),
        ..spec.clone()
    });
    let mut rng = Rng::new(spec.seed ^ 0x10ad);
    // Sessions in a random order: an app's users do not arrive in turn.
    let mut order: Vec<usize> = (0..all.conversations.len()).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.range(0, i));
    }
    let mut next = order.into_iter();
    let exp = |rng: &mut Rng, mean: f64| {
        let u = ((rng.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
        -mean * u.ln()
    };
    rates
        .iter()
        .zip(&counts)
        .map(|(rate, &n)| {
            let mean_gap = turns as f64 / rate;
            let mut at = 0.0;
            (0..n)
                .filter_map(|_| {
                    let conv = next.next()?;
                    let planned = Planned {
                        at: Duration::from_secs_f64(at),
                        path: CHAT,
                        group: Some(all.conversations[conv].app),
                        turns: (0..turns)
                            .map(|t| {
                                let think = if t == 0 {
                                    0.0
                                } else {
                                    exp(&mut rng, think.as_secs_f64())
                                };
                                (Duration::from_secs_f64(think), all.body(MODEL, conv, t))
                            })
                            .collect(),
                    };
                    at += exp(&mut rng, mean_gap);
                    Some(planned)
                })
                .collect()
        })
        .collect()
}

/// A trace's requests at their own timestamps, sped up: each window `(n, duration)` replays
/// the `n` lines after the previous window's, the time from its first line to the line after
/// its last compressed into `duration` (the speed-up is that stretch's own, so `n / duration`
/// is the rate offered and the trace's bursts within it are kept).
fn plan_trace(lines: &[Line], windows: &[(usize, Duration)]) -> Result<Vec<Vec<Planned>>> {
    let mut next = 0;
    windows
        .iter()
        .map(|&(n, duration)| {
            let (Some(window), Some(after)) = (lines.get(next..next + n), lines.get(next + n))
            else {
                anyhow::bail!(
                    "the trace ends before the ladder does: its {} requests are too few",
                    lines.len()
                );
            };
            next += n;
            let start = window.first().map_or(Duration::ZERO, Line::at);
            let span = after
                .at()
                .saturating_sub(start)
                .max(Duration::from_millis(1));
            let speedup = span.as_secs_f64() / duration.as_secs_f64().max(1e-3);
            Ok(window
                .iter()
                .map(|l| Planned {
                    at: l.at().saturating_sub(start).div_f64(speedup),
                    path: COMPLETIONS,
                    group: None,
                    turns: vec![(Duration::ZERO, l.body(MODEL, &trace_spec()))],
                })
                .collect())
        })
        .collect()
}

/// Where a step's requests go.
enum Route<'a> {
    /// All to this base URL.
    Url(&'a str),
    /// Each to the probed engine [`LoadMode::Oracle`] picks from what the probe saw; the
    /// requests in flight per probed engine counted here.
    Oracle(&'a [AtomicUsize]),
}

/// One request sent and what the engines held of its prompt just before.
struct Sent {
    outcome: Outcome,
    /// When it was sent, from the step's start.
    at: Duration,
    /// Its `x-request-id`, which Envoy's access log names with the engine it went to.
    id: String,
    /// Its session's group ([`Planned::group`]).
    group: Option<usize>,
    /// Leading prompt blocks each engine held (its `/oracle`), in fleet order; empty where the
    /// engines cannot be asked (Dynamo's mockers).
    held: Vec<u64>,
}

impl Route<'_> {
    /// The URL for `body`, the engine it is counted against (the oracle's), and what every
    /// engine of `probe` holds of its prompt: the outside view each mode's routing is held to.
    async fn pick(
        &self,
        http: &reqwest::Client,
        probe: &[String],
        path: &str,
        body: &Value,
    ) -> (String, Option<usize>, Vec<u64>) {
        let held = oracle_cached_all(http, probe, body).await;
        match self {
            Route::Url(base) => (format!("{base}{path}"), None, held),
            Route::Oracle(in_flight) => {
                let best = (0..probe.len())
                    .max_by_key(|&i| {
                        let busy = in_flight[i].load(Ordering::Relaxed);
                        (held.get(i).copied().unwrap_or(0), std::cmp::Reverse(busy))
                    })
                    .unwrap_or(0);
                in_flight[best].fetch_add(1, Ordering::Relaxed);
                (format!("http://{}{path}", probe[best]), Some(best), held)
            }
        }
    }

    /// The request [`Route::pick`] counted against `engine` is over.
    fn done(&self, engine: Option<usize>) {
        if let (Route::Oracle(in_flight), Some(i)) = (self, engine) {
            in_flight[i].fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// Run one step's sessions along `route`, asking the engines of `probe` before each request;
/// every request sent.
async fn run_step(
    http: &reqwest::Client,
    route: &Route<'_>,
    probe: &[String],
    sessions: &[Planned],
    step: &str,
) -> Vec<Sent> {
    let start = tokio::time::Instant::now();
    let runs = sessions.iter().enumerate().map(|(n, s)| async move {
        tokio::time::sleep_until(start + s.at).await;
        let mut sent = Vec::new();
        for (turn, (think, body)) in s.turns.iter().enumerate() {
            tokio::time::sleep(*think).await;
            let (url, engine, held) = route.pick(http, probe, s.path, body).await;
            let id = format!("{step}-{n}-{turn}");
            let at = start.elapsed();
            let answer = tokio::time::timeout(
                REQUEST_TIMEOUT,
                send_streaming_as(http, &url, body, Some(&id)),
            )
            .await;
            route.done(engine);
            let outcome = match answer {
                Ok(o) => o,
                Err(_) => Outcome {
                    error: Some(format!("no answer within {REQUEST_TIMEOUT:?}")),
                    ..Outcome::default()
                },
            };
            let failed = !outcome.ok();
            sent.push(Sent {
                outcome,
                at,
                id,
                group: s.group,
                held,
            });
            if failed {
                break;
            }
        }
        sent
    });
    futures::future::join_all(runs)
        .await
        .into_iter()
        .flatten()
        .collect()
}

/// A cold prompt's TTFT on the idle fleet behind `base`, ms: the median of the prompts no
/// engine has seen (`cold`, [`LoadWorkload::cold_prompts`]) sent one at a time, but for the
/// first (a first request pays for connections and a frontend's first-use work).
async fn cold_ttft_ms(
    http: &reqwest::Client,
    base: &str,
    cold: &[(&'static str, Value)],
) -> Result<f64> {
    let mut ttfts = Vec::new();
    for (path, body) in cold {
        let o = send_streaming(http, &format!("{base}{path}"), body).await;
        anyhow::ensure!(o.ok(), "a cold prompt on the idle fleet failed: {o:?}");
        ttfts.push(o.ttft.as_secs_f64() * 1e3);
    }
    Ok(quantile(&ttfts[1..], 0.5))
}

/// CPU cores each kind of process used between two readings `seconds` apart: the simulated
/// engines, Envoy, the sidecar, and this harness (the clients).
fn cores(before: &[(String, f64)], after: &[(String, f64)], seconds: f64) -> BTreeMap<String, f64> {
    let kind = |name: &str| {
        ["sim", "vllm", "envoy", "sidecar", "nats", "dynamo", "etcd"]
            .into_iter()
            .find(|k| name.starts_with(k))
            .unwrap_or("other")
            .to_owned()
    };
    let mut out = BTreeMap::new();
    for (name, t) in after {
        let t0 = before
            .iter()
            .find(|(n, _)| n == name)
            .map_or(0.0, |(_, t)| *t);
        *out.entry(kind(name)).or_insert(0.0) += (t - t0) / seconds.max(1e-9);
    }
    out
}

/// The sidecar's hints so far by the part of the rule that chose (none without a sidecar):
/// how often load moved a prompt off its longest match.
async fn hint_rules(stack: &Stack) -> BTreeMap<String, f64> {
    let Ok(text) = stack.sidecar_metrics().await else {
        return BTreeMap::new();
    };
    crate::prometheus::series(&text, "kvroute_hint_rules_total{")
        .filter_map(|(series, n)| {
            let rule = series.split("rule=\"").nth(1)?.split('"').next()?;
            Some((rule.to_owned(), n))
        })
        .collect()
}

/// One rate's figures. With what the engines held just before each request (`sent`, in blocks
/// of `block_size` tokens): `held_best`, the share of prompt tokens the engine holding the most
/// had, and `held_sent`, the share the engine it went to had — so a hit rate below the oracle's
/// splits into what the fleet no longer held anywhere, what routing passed over
/// (`held_best − held_sent`), and what was evicted while the request queued
/// (`held_sent − hit_rate`).
fn point(
    rate: f64,
    sent: &[Sent],
    block_size: u32,
    seconds: f64,
    engines: usize,
    target_ms: f64,
) -> Value {
    let outcomes: Vec<&Outcome> = sent.iter().map(|s| &s.outcome).collect();
    let ok: Vec<&Outcome> = outcomes.iter().copied().filter(|o| o.ok()).collect();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let ttft: Vec<f64> = ok.iter().map(|o| ms(o.ttft)).collect();
    let e2e: Vec<f64> = ok.iter().map(|o| ms(o.latency)).collect();
    let (prompt, cached) = ok.iter().fold((0, 0), |(p, c), o| {
        (p + o.prompt_tokens, c + o.cached_tokens)
    });
    let mut per_engine = vec![0usize; engines];
    for o in &ok {
        if let Some(n) = o.engine.and_then(|e| per_engine.get_mut(e)) {
            *n += 1;
        }
    }
    let within = ttft.iter().filter(|&&t| t <= target_ms).count();
    let probed: Vec<&Sent> = sent
        .iter()
        .filter(|s| s.outcome.ok() && !s.held.is_empty())
        .collect();
    let probed_tokens: u64 = probed.iter().map(|s| s.outcome.prompt_tokens).sum();
    let held_share = |held: &dyn Fn(&Sent) -> u64| {
        let tokens: u64 = probed
            .iter()
            .map(|s| (held(s) * u64::from(block_size)).min(s.outcome.prompt_tokens))
            .sum();
        tokens as f64 / probed_tokens.max(1) as f64
    };
    let held_best = held_share(&|s| s.held.iter().copied().max().unwrap_or(0));
    let held_sent = held_share(&|s| {
        let engine = s.outcome.engine.and_then(|e| s.held.get(e));
        engine.copied().unwrap_or(0)
    });
    let mut p = json!({
        "rate": rate,
        "requests": outcomes.len(),
        "errors": outcomes.len() - ok.len(),
        "ttft_p50_ms": quantile(&ttft, 0.5),
        "ttft_p90_ms": quantile(&ttft, 0.9),
        "ttft_p99_ms": quantile(&ttft, 0.99),
        "e2e_p50_ms": quantile(&e2e, 0.5),
        "e2e_p90_ms": quantile(&e2e, 0.9),
        "throughput": ok.len() as f64 / seconds.max(1e-9),
        "goodput": within as f64 / seconds.max(1e-9),
        "hit_rate": if prompt == 0 { 0.0 } else { cached as f64 / prompt as f64 },
        "imbalance": imbalance(&per_engine),
        "requests_per_engine": per_engine,
        "first_error": outcomes.iter().find(|o| !o.ok()).map(|o| format!("status {}: {}", o.status, o.error.clone().unwrap_or_default())),
    });
    if !probed.is_empty() {
        p["held_best"] = json!(held_best);
        p["held_sent"] = json!(held_sent);
    }
    p
}

/// One line of `requests.jsonl`: what one request of the step at `rate` saw (its fleet's turn
/// at that rate: `order`), for reading a rate's quantiles apart (TTFT against the prompt's
/// uncached tokens, the engine, the load).
fn request_record(rate: f64, order: usize, s: &Sent) -> Value {
    let o = &s.outcome;
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    json!({
        "rate": rate,
        "order": order,
        "id": s.id,
        "group": s.group,
        "at_ms": ms(s.at),
        "ok": o.ok(),
        "ttft_ms": ms(o.ttft),
        "e2e_ms": ms(o.latency),
        "prompt_tokens": o.prompt_tokens,
        "cached_tokens": o.cached_tokens,
        "engine": o.engine,
        "held": s.held,
    })
}

/// What Envoy's access log says of each record's request (its `request_id=` is the record's
/// id): the engine it went to where the record has none (vLLM's answers do not say; `upstream=`
/// is one of `engines`, `ip:port`), and how long Envoy held it after its last byte
/// (`held_us`: the filter's work and its wait for a hint) and the engine took to its first
/// response byte (`upstream_us`).
fn from_access_log(records: &mut [Value], log: &str, engines: &[String]) {
    let field = |line: &'_ str, key: &str| -> Option<String> {
        let rest = &line[line.find(key)? + key.len()..];
        Some(
            rest.split_whitespace()
                .next()
                .unwrap_or_default()
                .to_owned(),
        )
    };
    let lines: HashMap<String, &str> = log
        .lines()
        .filter_map(|line| Some((field(line, " request_id=")?, line)))
        .collect();
    for r in records.iter_mut() {
        let Some(&line) = r["id"].as_str().and_then(|id| lines.get(id)) else {
            continue;
        };
        let upstream = field(line, " upstream=");
        let engine = upstream.and_then(|u| engines.iter().position(|e| *e == u));
        if let (true, Some(engine)) = (r["engine"].is_null(), engine) {
            r["engine"] = json!(engine);
        }
        for key in ["held_us", "upstream_us"] {
            if let Some(us) = field(line, &format!(" {key}=")).and_then(|v| v.parse::<i64>().ok()) {
                r[key] = json!(us);
            }
        }
    }
}

/// The busiest engine's requests over the fleet's mean (0 when none were served).
fn imbalance(per_engine: &[usize]) -> f64 {
    let total: usize = per_engine.iter().sum();
    let max = per_engine.iter().copied().max().unwrap_or(0);
    match total {
        0 => 0.0,
        _ => max as f64 * per_engine.len() as f64 / total as f64,
    }
}

/// The filter's [`FILTER_TIMINGS`] histograms so far (each empty where no Envoy runs the
/// filter).
async fn filter_timings(stack: &Stack) -> Vec<Vec<crate::stack::Bucket>> {
    let mut all = Vec::new();
    for (name, _) in FILTER_TIMINGS {
        all.push(stack.envoy_histogram(name).await.unwrap_or_default());
    }
    all
}

/// Requests each vLLM engine has finished so far, in fleet order; `None` off vLLM or when an
/// engine does not answer (the step then reports no split).
async fn vllm_served(bench: &LoadBench, stack: &Stack) -> Option<Vec<usize>> {
    bench.vllm.as_ref()?;
    crate::vllm::served(&stack.http, &stack.engines).await.ok()
}

/// Whether a rate's TTFT p90 stays within the target with at most 1% errors.
fn meets(point: &Value, target_ms: f64) -> bool {
    let errors = point["errors"].as_f64().unwrap_or(0.0);
    let requests = point["requests"].as_f64().unwrap_or(0.0).max(1.0);
    point["ttft_p90_ms"].as_f64().unwrap_or(f64::MAX) <= target_ms && errors / requests <= 0.01
}

/// The highest rate of the ladder, counted from the bottom, whose TTFT p90 stays within the
/// target with at most 1% errors (0 when the first already does not); and the best goodput.
pub fn within_target(points: &[Value], target_ms: f64) -> (f64, f64) {
    let best = points
        .iter()
        .take_while(|p| meets(p, target_ms))
        .last()
        .map_or(0.0, |p| p["rate"].as_f64().unwrap_or(0.0));
    let goodput = points
        .iter()
        .filter_map(|p| p["goodput"].as_f64())
        .fold(0.0, f64::max);
    (best, goodput)
}

/// What limited the first rate past `max_rate`: this machine's CPU when the processes used
/// most of its cores there (the proxy side, the engines' tokenizers and the clients share
/// them), else the engines' GPUs (their steps queue). `none` when no rate went past.
fn saturated_by(points: &[Value], max_rate: f64) -> String {
    let Some(past) = points
        .iter()
        .find(|p| p["rate"].as_f64().unwrap_or(0.0) > max_rate)
    else {
        return "none".into();
    };
    let cores: f64 = past["cpu_cores"]
        .as_object()
        .into_iter()
        .flatten()
        .filter_map(|(_, c)| c.as_f64())
        .sum();
    let machine = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    if cores > 0.75 * machine {
        format!("this machine's CPU ({cores:.2} of {machine} cores busy)")
    } else {
        format!("the engines ({cores:.2} of {machine} cores busy)")
    }
}

/// A fleet for `mode`, the base URL its requests go to, and the peer router's process if one
/// routes.
async fn start(
    bench: &LoadBench,
    workload: &LoadWorkload,
    mode: LoadMode,
) -> Result<(Stack, String, Option<Process>)> {
    let name = format!("load-{}-{}", workload.name, mode.name().replace(':', "-"));
    let capacity_blocks = bench.capacity(workload);
    // Before a fleet starts for nothing.
    let peer = match mode {
        LoadMode::Peer(name) => {
            Some(crate::peers::named(name).with_context(|| format!("no peer router {name}"))?)
        }
        _ => None,
    };
    let (stack_mode, dynamo_router) = match mode {
        LoadMode::Sim(m) => (m, None),
        LoadMode::Variant(_) => (Mode::Kvroute, None),
        LoadMode::Peer(_) | LoadMode::Oracle => (Mode::RoundRobin, None),
        LoadMode::Dynamo(router) => (Mode::RoundRobin, Some(router)),
        LoadMode::KvrouteOnDynamo => (Mode::Kvroute, Some("kv")),
    };
    let mut opts = StackOptions::new(&name, stack_mode);
    opts.sidecar_toml = bench.sidecar_toml.clone();
    if let LoadMode::Variant(variant) = mode {
        for (_, toml) in bench.variants.iter().filter(|(name, _)| *name == variant) {
            opts.sidecar_toml = format!("{}\n{toml}", opts.sidecar_toml);
        }
    }
    opts.envoy_stats_flush_ms = Some(STATS_FLUSH_MS);
    opts.envoy_log_flush_ms = Some(STATS_FLUSH_MS);
    opts.sim = SimOptions {
        capacity_blocks,
        ..bench.sim.clone()
    };
    if let Some(vllm) = &bench.vllm {
        anyhow::ensure!(
            mode.envoy_mode().is_some(),
            "{} does not run on real vLLM engines",
            mode.name()
        );
        opts.vllm = Some(VllmOptions {
            capacity_blocks,
            ..vllm.clone()
        });
        // Engines, Envoy and the sidecar share two cores: a hint waits for a busy sidecar
        // rather than fall back (as `kvroute-bench vllm`).
        opts.hint_timeout_ms = 1000;
    }
    if let Some(router) = dynamo_router {
        opts.dynamo = Some(crate::dynamo::DynamoOptions {
            router_mode: router.into(),
            capacity_blocks,
            ..bench.dynamo.clone()
        });
    }
    let stack = Stack::start(opts).await?;
    let mut process = None;
    let base = match (mode, peer) {
        (LoadMode::Dynamo(_), _) => format!(
            "http://{}",
            stack
                .frontend
                .as_deref()
                .context("the Dynamo fleet has no frontend")?
        ),
        (_, Some(peer)) => {
            let (started, url) = peer.start(&stack.engines, &stack.dir).await?;
            process = Some(started);
            url
        }
        _ => stack.envoy_url.clone(),
    };
    Ok((stack, base, process))
}

/// Cut a completion's token prompt so that it and its output fit `max_len` tokens, keeping its
/// prefix (a trace's longest prompts exceed a small model's length); whether it was cut.
fn fit_prompt(body: &mut Value, max_len: usize) -> bool {
    let output = body["max_tokens"].as_u64().unwrap_or(0) as usize;
    let keep = max_len.saturating_sub(output);
    match body["prompt"].as_array_mut() {
        Some(prompt) if prompt.len() > keep => {
            prompt.truncate(keep);
            true
        }
        _ => false,
    }
}

/// The stream as a Dynamo frontend is asked it: each body asks which worker served it.
fn naming_workers(steps: &[Vec<Planned>]) -> Vec<Vec<Planned>> {
    let mut steps = steps.to_vec();
    for (_, body) in steps.iter_mut().flatten().flat_map(|s| s.turns.iter_mut()) {
        body["nvext"] = json!({"extra_fields": ["worker_id"]});
    }
    steps
}

/// One mode's fleet and what its ladder measured so far. A ladder runs its rates one after the
/// other ([`run_mode`]), or in turn with other modes' ladders, each on its own fleet, rate by
/// rate ([`LoadBench::interleave`]).
struct Ladder {
    mode: LoadMode,
    stack: Stack,
    url: String,
    _peer: Option<Process>,
    cold_ms: f64,
    /// Engines a point counts requests against.
    engines: usize,
    /// Dynamo names the worker by instance id; reports number them in the fleet's order.
    ids: Vec<u64>,
    addresses: Vec<String>,
    /// [`LoadMode::Oracle`]'s requests in flight per engine.
    in_flight: Vec<AtomicUsize>,
    points: Vec<Value>,
    /// Every request ([`request_record`]).
    requests: Vec<Value>,
    /// Rates past the target so far.
    past: usize,
}

impl Ladder {
    /// Start `mode`'s fleet and measure its cold TTFT with the `cold` prompts; `target` is the
    /// fleet kind's (set from the first mode started on it).
    async fn start(
        bench: &LoadBench,
        workload: &LoadWorkload,
        mode: LoadMode,
        cold: &[(&'static str, Value)],
        target: &mut Option<(f64, f64)>,
    ) -> Result<Self> {
        let (stack, url, peer) = start(bench, workload, mode).await?;
        let cold_ms = cold_ttft_ms(&stack.http, &url, cold).await?;
        target.get_or_insert((cold_ms, TARGET_MULTIPLE * cold_ms));
        let ids: Vec<u64> = stack.engines.iter().map(|e| e.dynamo_worker_id).collect();
        let engines = if mode.on_dynamo() {
            ids.len()
        } else {
            bench.engines
        };
        let addresses: Vec<String> = stack.engines.iter().map(|e| e.address.clone()).collect();
        Ok(Ladder {
            mode,
            in_flight: addresses.iter().map(|_| AtomicUsize::new(0)).collect(),
            stack,
            url,
            _peer: peer,
            cold_ms,
            engines,
            ids,
            addresses,
            points: Vec::new(),
            requests: Vec::new(),
            past: 0,
        })
    }

    fn route(&self) -> Route<'_> {
        match self.mode {
            LoadMode::Oracle => Route::Oracle(&self.in_flight),
            _ => Route::Url(&self.url),
        }
    }

    /// The engines asked what they hold before each request: Dynamo's mockers and vLLM cannot
    /// say.
    fn probe(&self, bench: &LoadBench) -> &[String] {
        if self.mode.on_dynamo() || bench.vllm.is_some() {
            &[]
        } else {
            &self.addresses
        }
    }

    /// The unmeasured first step (a fleet in service is warm).
    async fn warm_up(&self, bench: &LoadBench, sessions: &[Planned]) {
        let probe = self.probe(bench);
        run_step(&self.stack.http, &self.route(), probe, sessions, "warm-up").await;
    }

    /// Whether its ladder stopped, [`PAST_SATURATION`] rates past the target.
    fn stopped(&self) -> bool {
        self.past >= PAST_SATURATION
    }

    /// Run one rate's sessions and record its point; `order` is this ladder's turn at this
    /// rate (0: it ran first).
    async fn step(
        &mut self,
        bench: &LoadBench,
        workload: &LoadWorkload,
        rate: f64,
        sessions: &[Planned],
        target_ms: f64,
        order: usize,
    ) {
        let stack = &self.stack;
        let (cpu0, t0) = (stack.cpu_seconds(), Instant::now());
        let harness0 = crate::process::cpu_seconds(std::process::id()).unwrap_or(0.0);
        let rules0 = hint_rules(stack).await;
        let served0 = vllm_served(bench, stack).await;
        let timings0 = filter_timings(stack).await;
        let probe = self.probe(bench);
        let tag = format!("{rate}");
        let mut sent = run_step(&stack.http, &self.route(), probe, sessions, &tag).await;
        let seconds = t0.elapsed().as_secs_f64();
        for o in sent.iter_mut().map(|s| &mut s.outcome) {
            if let Some((worker, _)) = o.dynamo_workers {
                o.engine = self.ids.iter().position(|&id| id == worker);
            }
        }
        let mut p = point(
            rate,
            &sent,
            bench.sim.block_size,
            seconds,
            self.engines,
            target_ms,
        );
        if let (Some(before), Some(after)) = (served0, vllm_served(bench, stack).await) {
            // vLLM does not say in a response who served it: its engines' counts do.
            let per_engine: Vec<usize> = after
                .iter()
                .zip(&before)
                .map(|(a, b)| a.saturating_sub(*b))
                .collect();
            p["imbalance"] = json!(imbalance(&per_engine));
            p["requests_per_engine"] = json!(per_engine);
        }
        // What the filter spent of each request's TTFT, where it ran (not on Dynamo's own
        // router nor the peers').
        if timings0.iter().any(|h| !h.is_empty()) {
            tokio::time::sleep(Duration::from_millis(3 * STATS_FLUSH_MS)).await;
            let timings = filter_timings(stack).await;
            for ((before, after), (_, key)) in timings0.iter().zip(&timings).zip(FILTER_TIMINGS) {
                for (q, name) in [(0.5, "p50"), (0.9, "p90"), (0.99, "p99")] {
                    if let Some(us) = crate::stack::quantile_between(before, after, q) {
                        p[format!("{key}_{name}_us")] = json!(us);
                    }
                }
            }
        }
        let mut used = cores(&cpu0, &stack.cpu_seconds(), seconds);
        let harness = crate::process::cpu_seconds(std::process::id()).unwrap_or(0.0);
        used.insert("harness".into(), (harness - harness0) / seconds);
        p["cpu_cores"] = json!(used);
        let rules: BTreeMap<String, f64> = hint_rules(stack)
            .await
            .into_iter()
            .map(|(rule, n)| {
                let before = rules0.get(&rule).copied().unwrap_or(0.0);
                (rule, n - before)
            })
            .filter(|(_, n)| *n > 0.0)
            .collect();
        if !rules.is_empty() {
            p["hint_rules"] = json!(rules);
        }
        println!(
            "load: {} / {} at {rate:.1} req/s: TTFT p50 {:.0} ms p90 {:.0} ms (target {target_ms:.0}), hit rate {:.1}%{}, {:.1} req/s, errors {}, CPU {}{}",
            workload.name,
            self.mode.name(),
            p["ttft_p50_ms"].as_f64().unwrap_or(0.0),
            p["ttft_p90_ms"].as_f64().unwrap_or(0.0),
            100.0 * p["hit_rate"].as_f64().unwrap_or(0.0),
            match (p["held_best"].as_f64(), p["held_sent"].as_f64()) {
                (Some(best), Some(sent)) => format!(
                    " (held before sending: {:.1}% by the best engine, {:.1}% where sent)",
                    100.0 * best,
                    100.0 * sent
                ),
                _ => String::new(),
            },
            p["throughput"].as_f64().unwrap_or(0.0),
            p["errors"],
            used.iter().map(|(k, v)| format!("{k} {v:.2}")).collect::<Vec<_>>().join(", "),
            match p.get("hint_rules") {
                Some(rules) => format!(", rules {rules}"),
                None => String::new(),
            },
        );
        self.requests
            .extend(sent.iter().map(|s| request_record(rate, order, s)));
        self.past += usize::from(!meets(&p, target_ms));
        self.points.push(p);
        if self.stopped() {
            println!(
                "load: {} / {}: {PAST_SATURATION} rates past the target, the ladder stops here",
                workload.name,
                self.mode.name()
            );
        }
    }

    /// The mode's result: its points, the highest rate within the target, where it saturated,
    /// its requests (moved to `requests.jsonl` by [`run`]).
    async fn finish(mut self, workload: &LoadWorkload, target_ms: f64) -> Result<Value> {
        self.stack.check_alive()?;
        let (max_rate, goodput) = within_target(&self.points, target_ms);
        let saturated_by = saturated_by(&self.points, max_rate);
        println!(
            "load: {} / {}: highest rate within target {max_rate} req/s, best goodput {goodput:.1} req/s; past it, saturated by {saturated_by}",
            workload.name,
            self.mode.name()
        );
        if self.mode.envoy_mode().is_some() {
            tokio::time::sleep(Duration::from_millis(3 * STATS_FLUSH_MS)).await;
            let log = std::fs::read_to_string(self.stack.dir.join("envoy.log")).unwrap_or_default();
            from_access_log(&mut self.requests, &log, &self.addresses);
        }
        let mut result = json!({"available": true, "cold_ttft_ms": self.cold_ms,
              "target_ttft_ms": target_ms, "max_rate_within_target": max_rate,
              "goodput": goodput, "saturated_by": saturated_by, "points": self.points,
              "requests": self.requests});
        // The sidecar's own time per hint over the whole ladder, beside the filter's pause per
        // rate: what the pause spends outside the sidecar is transport and the wait for a core.
        if let Ok(metrics) = self.stack.sidecar_metrics().await {
            for (q, name) in [(0.5, "p50"), (0.9, "p90"), (0.99, "p99")] {
                let at = crate::prometheus::histogram_quantile(&metrics, "kvroute_hint_seconds", q);
                if let Some(seconds) = at {
                    result[format!("sidecar_hint_{name}_us_bucket_bound")] = json!(seconds * 1e6);
                }
            }
        }
        Ok(result)
    }
}

/// One mode's ladder on its own fleet, rate after rate: its result ([`Ladder::finish`]).
/// `target` is the fleet kind's (measured with the `cold` prompts on the first mode to run on
/// it); `order` is its place among the modes run one after the other.
async fn run_mode(
    bench: &LoadBench,
    workload: &LoadWorkload,
    mode: LoadMode,
    steps: &[Vec<Planned>],
    cold: &[(&'static str, Value)],
    target: &mut Option<(f64, f64)>,
    order: usize,
) -> Result<Value> {
    let mut ladder = Ladder::start(bench, workload, mode, cold, target).await?;
    let target_ms = target.map_or(0.0, |t| t.1);
    let (warm_up, steps) = steps.split_first().context("an empty ladder")?;
    ladder.warm_up(bench, warm_up).await;
    for (rate, sessions) in bench.rates.iter().zip(steps) {
        ladder
            .step(bench, workload, *rate, sessions, target_ms, order)
            .await;
        if ladder.stopped() {
            break;
        }
        // Let the fleet drain before the next rate.
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    ladder.finish(workload, target_ms).await
}

/// Each mode's name in the report: a mode run again (an A/B/A comparison, to see how far two
/// fleets of one mode differ) is `<mode>_2`, `<mode>_3`, ….
fn run_names(modes: &[LoadMode]) -> Vec<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    modes
        .iter()
        .map(|m| {
            let n = seen.entry(m.name()).or_insert(0);
            *n += 1;
            match *n {
                1 => m.name(),
                n => format!("{}_{n}", m.name()),
            }
        })
        .collect()
}

/// A mode's result as the report keeps it: unavailable where a mode that needs what this
/// machine may lack could not run (any other error is the run's), with its mode (a mode run
/// twice is reported under another name) and the order its fleet started in, which matters on
/// real engines (`load-pool` shows it).
fn reported(
    run: Result<Value>,
    workload: &LoadWorkload,
    mode: LoadMode,
    order: usize,
) -> Result<Value> {
    let mut result = match run {
        Ok(r) => r,
        Err(e) if mode.optional() => unavailable(workload, mode, &e),
        Err(e) => return Err(e),
    };
    result["order"] = json!(order);
    result["mode"] = json!(mode.name());
    Ok(result)
}

/// A mode that needs what this machine lacks (Dynamo, a peer router), reported as such.
fn unavailable(workload: &LoadWorkload, mode: LoadMode, e: &anyhow::Error) -> Value {
    println!(
        "load: {} / {}: unavailable: {e:#}",
        workload.name,
        mode.name()
    );
    json!({"available": false, "reason": format!("{e:#}")})
}

/// What every mode of a workload is sent: the simulated (or vLLM) fleet's steps, the Dynamo
/// fleet's (asking which worker served), and the cold prompts that set each fleet's target.
struct Fleets<'a> {
    steps: &'a [Vec<Planned>],
    dynamo_steps: &'a [Vec<Planned>],
    cold: &'a [(&'static str, Value)],
}

impl Fleets<'_> {
    /// The steps `mode`'s fleet is sent, the warm-up first.
    fn steps(&self, mode: LoadMode) -> &[Vec<Planned>] {
        if mode.on_dynamo() {
            self.dynamo_steps
        } else {
            self.steps
        }
    }
}

/// Each kind of fleet's (cold TTFT, target TTFT p90), ms, once the first mode on it measured
/// them: the simulated (or vLLM) fleet's and Dynamo's.
#[derive(Default)]
struct Targets {
    sim: Option<(f64, f64)>,
    dynamo: Option<(f64, f64)>,
}

impl Targets {
    /// `mode`'s fleet kind's.
    fn of(&mut self, mode: LoadMode) -> &mut Option<(f64, f64)> {
        if mode.on_dynamo() {
            &mut self.dynamo
        } else {
            &mut self.sim
        }
    }

    /// `mode`'s target, ms (0 before it is measured).
    fn target_ms(&mut self, mode: LoadMode) -> f64 {
        self.of(mode).map_or(0.0, |t| t.1)
    }
}

/// Every mode's ladder in turn, rate by rate ([`LoadBench::interleave`]): all fleets start
/// first, then each rate runs every mode that has not stopped, the order reversed at every
/// other rate. On a machine whose speed drifts over minutes (engines on CPU beside other
/// tenants), modes are compared within the same minutes. Each fleet warms up right before its
/// first rung: warmed up together, the first to run had idled longest, and an idle vLLM engine
/// answers its next request 2-3x slower (docs/benchmarks.md).
async fn run_interleaved(
    bench: &LoadBench,
    workload: &LoadWorkload,
    fleets: &Fleets<'_>,
    targets: &mut Targets,
) -> Result<serde_json::Map<String, Value>> {
    let mut results = serde_json::Map::new();
    let mut ladders = Vec::new();
    let names = run_names(&bench.modes);
    for (order, &mode) in bench.modes.iter().enumerate() {
        match Ladder::start(bench, workload, mode, fleets.cold, targets.of(mode)).await {
            Ok(ladder) => ladders.push((order, ladder)),
            Err(e) => {
                let result = reported(Err(e), workload, mode, order)?;
                results.insert(names[order].clone(), result);
            }
        }
    }
    for (i, rate) in bench.rates.iter().enumerate() {
        let mut turns: Vec<usize> = (0..ladders.len()).collect();
        if i % 2 == 1 {
            turns.reverse();
        }
        let mut order = 0;
        for k in turns {
            let ladder = &mut ladders[k].1;
            let Some(sessions) = fleets.steps(ladder.mode).get(i + 1) else {
                continue;
            };
            if ladder.stopped() {
                continue;
            }
            if i == 0 {
                let warm_up = fleets
                    .steps(ladder.mode)
                    .first()
                    .context("an empty ladder")?;
                ladder.warm_up(bench, warm_up).await;
            }
            let target_ms = targets.target_ms(ladder.mode);
            ladder
                .step(bench, workload, *rate, sessions, target_ms, order)
                .await;
            order += 1;
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
    for (order, ladder) in ladders {
        let mode = ladder.mode;
        let run = ladder.finish(workload, targets.target_ms(mode)).await;
        results.insert(names[order].clone(), reported(run, workload, mode, order)?);
    }
    Ok(results)
}

/// Run every mode's ladder of one workload: the cold TTFT and target of each fleet (the
/// simulated one, Dynamo's), and per mode its points. A Dynamo mode whose fleet does not start
/// (Dynamo not installed) is reported unavailable.
async fn run_workload(bench: &LoadBench, workload: &LoadWorkload) -> Result<Value> {
    let mut steps = plan(workload, &bench.rates, bench.step)?;
    let dynamo_steps = naming_workers(&steps);
    let mut cold = workload.cold_prompts()?;
    if bench.vllm.is_some() {
        let bodies = steps.iter_mut().flatten().flat_map(|s| s.turns.iter_mut());
        let clipped = bodies
            .map(|(_, body)| body)
            .chain(cold.iter_mut().map(|(_, body)| body))
            .map(|body| fit_prompt(body, crate::vllm::MAX_MODEL_LEN))
            .filter(|&cut| cut)
            .count();
        if clipped > 0 {
            println!(
                "load: {}: {clipped} prompts cut to fit vLLM's {} tokens (their prefixes kept)",
                workload.name,
                crate::vllm::MAX_MODEL_LEN
            );
        }
    }
    let fleets = Fleets {
        steps: &steps,
        dynamo_steps: &dynamo_steps,
        cold: &cold,
    };
    let mut targets = Targets::default();
    let modes = if bench.interleave {
        run_interleaved(bench, workload, &fleets, &mut targets).await?
    } else {
        let mut modes = serde_json::Map::new();
        let names = run_names(&bench.modes);
        for (order, &mode) in bench.modes.iter().enumerate() {
            let (steps, target) = (fleets.steps(mode), targets.of(mode));
            let run = run_mode(bench, workload, mode, steps, fleets.cold, target, order).await;
            modes.insert(names[order].clone(), reported(run, workload, mode, order)?);
        }
        modes
    };
    let (turns, think) = workload.turns();
    let mut doc = json!({
        "cold_ttft_ms": targets.sim.map(|t| t.0),
        "target_ttft_ms": targets.sim.map(|t| t.1),
        "dynamo_cold_ttft_ms": targets.dynamo.map(|t| t.0),
        "dynamo_target_ttft_ms": targets.dynamo.map(|t| t.1),
        "capacity_blocks": bench.capacity(workload),
        "turns": turns,
        "think_ms": think.as_secs_f64() * 1e3,
        "modes": modes,
    });
    if let Source::Trace { file, .. } = &workload.source {
        let lines = trace_lines(file)?;
        doc["trace"] = json!(file);
        // A rate's speed-up over the trace's own time is the rate over this.
        doc["trace_rate"] = json!(trace_rate(&lines));
    }
    Ok(doc)
}

/// Run the ladder; writes `load.json`, `load.md` and `load.png` into `out`.
pub async fn run(bench: &LoadBench, out: &Path) -> Result<Value> {
    let mut workloads = serde_json::Map::new();
    for w in &bench.workloads {
        let result = run_workload(bench, w)
            .await
            .with_context(|| format!("workload {}", w.name))?;
        workloads.insert(w.name.to_owned(), result);
    }
    let mut doc = json!({
        "engines": bench.engines,
        "vllm": bench.vllm.is_some(),
        "dynamo_workers": bench.dynamo.aggregated,
        "step_s": bench.step.as_secs_f64(),
        "target_multiple_of_cold_ttft": TARGET_MULTIPLE,
        "engine": match &bench.vllm {
            Some(v) => json!({
                "vllm": "0.32 (CPU)",
                "block_size": crate::vllm::BLOCK_SIZE,
                "max_num_seqs": v.max_num_seqs,
                "max_model_len": crate::vllm::MAX_MODEL_LEN,
            }),
            None => json!({
                "prefill_us_per_token": bench.sim.prefill_us_per_token,
                "step_us": bench.sim.decode_us_per_token,
                "decode_us_per_seq": bench.sim.batching,
                "max_running": bench.sim.max_running,
                "event_delay_ms": bench.sim.event_delay_ms,
            }),
        },
        "workloads": workloads,
    });
    std::fs::create_dir_all(out)?;
    // Per-request records go beside the report, not in it: a workload's ladder sends thousands.
    let mut lines = String::new();
    for (name, w) in doc["workloads"].as_object_mut().into_iter().flatten() {
        for (fleet, m) in w["modes"].as_object_mut().into_iter().flatten() {
            let records = m.as_object_mut().and_then(|m| m.remove("requests"));
            for mut r in records
                .and_then(|r| r.as_array().cloned())
                .unwrap_or_default()
            {
                r["workload"] = json!(name);
                r["mode"] = m["mode"].clone();
                r["fleet"] = json!(fleet);
                lines += &format!("{r}\n");
            }
        }
    }
    std::fs::write(out.join("requests.jsonl"), lines)?;
    std::fs::write(out.join("load.json"), serde_json::to_string_pretty(&doc)?)?;
    std::fs::write(out.join("load.md"), markdown(&doc))?;
    crate::plot::load_png(&out.join("load.png"), &doc)?;
    Ok(doc)
}

/// The report docs/benchmarks.md quotes: per workload, each mode's highest rate within the
/// target and its TTFT p90 and hit rate at every rate.
pub fn markdown(doc: &Value) -> String {
    let mut s = String::new();
    for (name, w) in doc["workloads"].as_object().into_iter().flatten() {
        // Each fleet that ran has its own target.
        let fleets: Vec<String> = [
            (
                "",
                match doc["vllm"] == true {
                    true => format!("{} real vLLM engines", doc["engines"]),
                    false => format!("{} simulated engines", doc["engines"]),
                },
            ),
            (
                "dynamo_",
                format!("{} Dynamo mocker workers", doc["dynamo_workers"]),
            ),
        ]
        .into_iter()
        .filter_map(|(prefix, fleet)| {
            let target = w[format!("{prefix}target_ttft_ms")].as_f64()?;
            let cold = w[format!("{prefix}cold_ttft_ms")].as_f64()?;
            let multiple = &doc["target_multiple_of_cold_ttft"];
            Some(format!(
                "{fleet}, target TTFT p90 {target:.0} ms ({multiple}× a cold prompt's {cold:.0} ms)"
            ))
        })
        .collect();
        s.push_str(&format!(
            "## {name}: {}-block caches; {}\n\n| mode | target TTFT p90 (ms) | highest rate within target (req/s) | best goodput (req/s) | past it, saturated by |\n|---|---|---|---|---|\n",
            w["capacity_blocks"],
            fleets.join("; "),
        ));
        let modes = w["modes"].as_object().cloned().unwrap_or_default();
        for (mode, m) in &modes {
            if m["available"] != true {
                s.push_str(&format!(
                    "| {mode} | unavailable: {} | | | |\n",
                    crate::report::unavailable_reason(m)
                ));
                continue;
            }
            s.push_str(&format!(
                "| {mode} | {:.0} | {} | {:.1} | {} |\n",
                m["target_ttft_ms"].as_f64().unwrap_or(0.0),
                m["max_rate_within_target"],
                m["goodput"].as_f64().unwrap_or(0.0),
                m["saturated_by"].as_str().unwrap_or(""),
            ));
        }
        s.push_str("\nTTFT p90 ms / hit rate / imbalance per rate:\n\n| rate |");
        for mode in modes.keys() {
            s.push_str(&format!(" {mode} |"));
        }
        s.push_str("\n|---|");
        s.push_str(&"---|".repeat(modes.len()));
        s.push('\n');
        let rates: Vec<f64> = modes
            .values()
            .filter_map(|m| m["points"].as_array())
            .max_by_key(|ps| ps.len())
            .map(|ps| ps.iter().filter_map(|p| p["rate"].as_f64()).collect())
            .unwrap_or_default();
        for (i, rate) in rates.iter().enumerate() {
            s.push_str(&format!("| {rate:.1} |"));
            for m in modes.values() {
                let p = &m["points"][i];
                if p.is_null() {
                    s.push_str(" (stopped) |");
                    continue;
                }
                s.push_str(&format!(
                    " {:.0} / {:.1}% / {:.2}{} |",
                    p["ttft_p90_ms"].as_f64().unwrap_or(0.0),
                    100.0 * p["hit_rate"].as_f64().unwrap_or(0.0),
                    p["imbalance"].as_f64().unwrap_or(0.0),
                    match p["errors"].as_u64() {
                        Some(0) | None => String::new(),
                        Some(n) => format!(", {n} errors"),
                    }
                ));
            }
            s.push('\n');
        }
        s.push('\n');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every mode gets the same stream: the plan is deterministic, each step's sessions arrive
    /// at about its rate, and sessions are not reused between steps.
    #[test]
    fn the_plan_is_one_stream_at_each_rate() {
        let w = LoadWorkload::chat();
        let rates = [2.0, 8.0];
        let a = plan(&w, &rates, Duration::from_secs(20)).unwrap();
        let b = plan(&w, &rates, Duration::from_secs(20)).unwrap();
        assert_eq!(a.len(), 3, "a warm-up step, then the ladder");
        assert_eq!(a[0].len(), 10, "the warm-up at the lowest rate");
        let (a, b) = (&a[1..], &b[1..]);
        assert_eq!(a[1].len(), 40, "8 req/s × 20 s over 4 turns");
        assert_eq!(a[1][7].turns[2].1, b[1][7].turns[2].1);
        assert_eq!(a[1][7].at, b[1][7].at);
        let last = a[1].last().unwrap().at.as_secs_f64();
        assert!(
            (10.0..30.0).contains(&last),
            "40 arrivals at 2/s end near 20 s, not {last}"
        );
        assert_ne!(
            a[0][0].turns[0].1, a[1][0].turns[0].1,
            "a session runs once"
        );
        assert!(
            a[1].iter().all(|s| s.turns[0].0.is_zero()),
            "no think before a first turn"
        );
    }

    /// A trace keeps its own arrivals, sped up to each rate, and each step continues the trace
    /// where the last one stopped; a ladder longer than the trace is an error, not a short step.
    #[test]
    fn a_trace_is_replayed_at_its_own_timestamps_sped_up() {
        // One request a second, in bursts of two at every fourth second.
        let lines: Vec<Line> = (0..40u64)
            .map(|i| {
                let ts = if i % 4 == 1 { (i - 1) * 1000 } else { i * 1000 };
                serde_json::from_value(json!({"timestamp": ts, "input_length": 600,
                    "output_length": 4, "hash_ids": [i % 3, 100 + i]}))
                .unwrap()
            })
            .collect();
        assert!((trace_rate(&lines) - 1.0).abs() < 0.03);
        let five = Duration::from_secs(5);
        let steps = plan_trace(&lines, &[(5, five), (20, five)]).unwrap();
        assert_eq!(steps[0].len(), 5, "1 req/s for 5 s");
        assert_eq!(steps[1].len(), 20, "4 req/s for 5 s");
        assert_eq!(steps[0][1].at, Duration::ZERO, "a burst stays a burst");
        // Step 0: lines 0-4 span 0-4 s, line 5 comes at 4 s: 4 s of the trace in 5 s.
        assert_eq!(steps[0][2].at, Duration::from_millis(2500));
        // Step 1: lines 5-24 at 4-24 s, line 25 at 24 s: 20 s of the trace in 5 s.
        assert_eq!(
            steps[1][0].at,
            Duration::ZERO,
            "a step starts at its first request"
        );
        assert_eq!(
            steps[1][1].at,
            Duration::from_millis(500),
            "2 s of the trace in 0.5 s"
        );
        let prompt = |p: &Planned| p.turns[0].1["prompt"].as_array().unwrap().clone();
        assert_eq!(
            prompt(&steps[0][4]),
            prompt(&lines_body(&lines[4])),
            "the steps continue the trace in order"
        );
        assert_eq!(prompt(&steps[1][0]), prompt(&lines_body(&lines[5])));
        // 600 tokens: a whole 512-token block and 88 tokens' share of one, scaled.
        assert_eq!(prompt(&steps[1][0]).len(), TRACE_BLOCK_TOKENS + 3);
        let err = plan_trace(&lines, &[(5, five), (35, five)]);
        assert!(err.is_err(), "40 requests cannot fill 5 + 35");
    }

    fn lines_body(line: &Line) -> Planned {
        Planned {
            at: Duration::ZERO,
            path: COMPLETIONS,
            group: None,
            turns: vec![(Duration::ZERO, line.body(MODEL, &trace_spec()))],
        }
    }

    /// On vLLM a trace's token prompt longer than the model's length is cut to its prefix; a
    /// chat body is left as it is.
    #[test]
    fn a_prompt_is_cut_to_fit_with_its_output_and_its_prefix_kept() {
        let mut long = json!({"prompt": (0..100).collect::<Vec<u32>>(), "max_tokens": 8});
        assert!(fit_prompt(&mut long, 50));
        let kept: Vec<u64> = long["prompt"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_u64)
            .collect();
        assert_eq!(kept, (0..42).collect::<Vec<u64>>());
        let mut short = json!({"prompt": [1, 2, 3], "max_tokens": 8});
        assert!(!fit_prompt(&mut short, 50));
        let mut chat = json!({"messages": [], "max_tokens": 8});
        assert!(!fit_prompt(&mut chat, 1));
    }

    /// Imbalance is the busiest engine's requests over the mean; nothing served is 0.
    #[test]
    fn imbalance_is_the_busiest_over_the_mean() {
        assert_eq!(imbalance(&[3, 1]), 1.5);
        assert_eq!(imbalance(&[2, 2, 2, 2]), 1.0);
        assert_eq!(imbalance(&[0, 0]), 0.0);
        assert_eq!(imbalance(&[]), 0.0);
    }

    /// A record takes from the access log line with its request id the engine (where it has
    /// none and the line names one of the fleet's) and Envoy's two timings.
    #[test]
    fn the_access_log_names_the_engine_and_the_timings_of_a_request() {
        let engines = ["127.0.0.1:9001".to_owned(), "127.0.0.1:9002".to_owned()];
        let line = |id: &str, up: &str, held: &str| {
            format!("[2026-12-06T19:50:00.000Z] \"POST /v1/chat/completions\" 200 - 30ms request_id={id} upstream={up} hinted=- held_us={held} upstream_us=7021\n")
        };
        let log = [
            line("8-0-1", "127.0.0.1:9002", "512"),
            line("8-1-0", "127.0.0.1:9009", "-"),
            line("8-2-0", "127.0.0.1:9001", "430"),
        ]
        .concat();
        let mut records = vec![
            json!({"id": "8-0-1", "engine": null}),
            json!({"id": "8-1-0", "engine": null}),
            json!({"id": "8-2-0", "engine": 1}),
            json!({"id": "8-3-0", "engine": null}),
        ];
        from_access_log(&mut records, &log, &engines);
        assert_eq!(
            records[0],
            json!({"id": "8-0-1", "engine": 1, "held_us": 512, "upstream_us": 7021})
        );
        assert_eq!(
            records[1],
            json!({"id": "8-1-0", "engine": null, "upstream_us": 7021})
        );
        assert_eq!(
            records[2],
            json!({"id": "8-2-0", "engine": 1, "held_us": 430, "upstream_us": 7021})
        );
        assert_eq!(records[3], json!({"id": "8-3-0", "engine": null}));
    }

    /// The highest rate counts from the bottom: a rate within the target above one that missed
    /// does not count.
    #[test]
    fn the_highest_rate_within_target_counts_from_the_bottom() {
        let p = |rate: f64, p90: f64, errors: u64| json!({"rate": rate, "ttft_p90_ms": p90, "errors": errors, "requests": 100, "goodput": rate});
        let points = [
            p(1.0, 50.0, 0),
            p(2.0, 90.0, 0),
            p(4.0, 300.0, 0),
            p(8.0, 80.0, 0),
        ];
        assert_eq!(within_target(&points, 100.0), (2.0, 8.0));
        let errors = [p(1.0, 50.0, 0), p(2.0, 90.0, 5)];
        assert_eq!(within_target(&errors, 100.0).0, 1.0);
        assert_eq!(within_target(&[p(1.0, 500.0, 0)], 100.0).0, 0.0);
    }
}
