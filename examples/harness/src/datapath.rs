//! `make bench-datapath`: what kvroute adds to Envoy's request path.
//!
//! The same upstream that answers at once (the simulator's `--instant` mode), behind plain Envoy
//! and behind Envoy + kvroute (filter alone with hints off; filter + sidecar, over TCP and over
//! a Unix socket; without the token cache; without reading usage), with chat prompts never seen
//! of about 1k, 8k and 32k tokens and the next turn of an ~8k-token conversation, one request at
//! a time and 16 at once. Reports latency p50/p99, requests/s and Envoy CPU per request (from
//! /proc, user + system time).

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use serde_json::{json, Value};

use crate::bench::Scale;
use crate::report::quantile;
use crate::stack::{quantile_between, Bucket, MODEL};
use crate::workload::{words, Rng};
use crate::{paths, Mode, Stack, StackOptions};

/// Where a request's body says which request it is: replaced by its number as it is sent, so
/// no two requests of a run are the same prompt.
pub const REQUEST_MARK: &str = "@@request@@";

/// A chat body whose prompt is about `tokens` tokens for the demo model: one user message,
/// starting with [`REQUEST_MARK`] — every request a prompt never seen.
pub fn body_of(tokens: usize) -> Result<Value> {
    grow(tokens, |text| {
        json!({"model": MODEL, "max_tokens": 1, "messages": [
            {"role": "user", "content": format!("{REQUEST_MARK} {text}")}]})
    })
}

/// A chat whose history is about `tokens` tokens (turns of ~400 tokens each), then a new
/// question with [`REQUEST_MARK`]: every request the next turn of a conversation seen before.
pub fn history_of(tokens: usize) -> Result<Value> {
    grow(tokens, |text| {
        let mut messages =
            vec![json!({"role": "system", "content": "You are a careful assistant."})];
        let words: Vec<&str> = text.split(' ').collect();
        for (i, turn) in words.chunks(300).enumerate() {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            messages.push(json!({"role": role, "content": turn.join(" ")}));
        }
        if messages.len() % 2 == 0 {
            messages.push(json!({"role": "assistant", "content": "Understood."}));
        }
        messages.push(json!({"role": "user", "content": format!("{REQUEST_MARK}: and then?")}));
        json!({"model": MODEL, "max_tokens": 1, "messages": messages})
    })
}

/// The body `make` builds from pseudo-random words, grown until its prompt has `tokens`.
fn grow(tokens: usize, make: impl Fn(&str) -> Value) -> Result<Value> {
    let bundle = kvroute_prompt::model_dir::load_bundle(&paths::model_dir(), MODEL, 16)?;
    let pre = kvroute_prompt::Preprocessor::from_bundle(&bundle)?;
    let mut rng = Rng::new(tokens as u64);
    let mut text = String::new();
    loop {
        let body = make(&text);
        let req = kvroute_prompt::LlmRequest::parse(body.to_string().as_bytes())?;
        let n = pre.tokens(&req)?.len();
        if n >= tokens {
            return Ok(body);
        }
        let more = ((tokens - n) / 2).max(8);
        if !text.is_empty() {
            text.push(' ');
        }
        text.push_str(&words(&mut rng, more));
    }
}

fn cpu_seconds(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = stat.rsplit_once(')').context("stat format")?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = fields[11].parse::<f64>()? + fields[12].parse::<f64>()?;
    Ok(ticks / 100.0)
}

async fn load(stack: &Stack, body: &Value, concurrency: usize, requests: usize) -> Result<Value> {
    let url = format!("{}/v1/chat/completions", stack.envoy_url);
    let payload = body.to_string();
    let numbered = |n: usize| payload.replacen(REQUEST_MARK, &format!("request {n}"), 1);
    static SENT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let number = || SENT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    // Warm up connections and the filter.
    for _ in 0..5 {
        stack
            .http
            .post(&url)
            .body(numbered(number()))
            .send()
            .await?
            .bytes()
            .await?;
    }
    let pid = stack.envoy_pid().context("envoy pid")?;
    let cpu_before = cpu_seconds(pid)?;
    let next = std::sync::atomic::AtomicUsize::new(0);
    let started = Instant::now();
    let worker = || async {
        let mut lat = Vec::new();
        while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < requests {
            let body = numbered(number());
            let t = Instant::now();
            let ok = match stack
                .http
                .post(&url)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
            {
                Ok(r) => r.status().is_success() && r.bytes().await.is_ok(),
                Err(_) => false,
            };
            if ok {
                lat.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        lat
    };
    let all: Vec<f64> = futures::future::join_all((0..concurrency).map(|_| worker()))
        .await
        .into_iter()
        .flatten()
        .collect();
    let elapsed = started.elapsed();
    let cpu = cpu_seconds(pid)? - cpu_before;
    Ok(json!({
        "p50_us": quantile(&all, 0.5),
        "p99_us": quantile(&all, 0.99),
        "rps": all.len() as f64 / elapsed.as_secs_f64(),
        "envoy_cpu_us_per_request": cpu * 1e6 / requests as f64,
        "errors": requests - all.len(),
        "requests": requests,
    }))
}

/// Envoy's heap (`/memory`: allocated and heap size, bytes).
async fn envoy_memory(stack: &Stack) -> Result<Value> {
    let m: Value = stack
        .http
        .get(format!("{}/memory", stack.admin_url))
        .send()
        .await?
        .json()
        .await?;
    let num = |k: &str| {
        m[k].as_str()
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    Ok(json!({"allocated": num("allocated"), "heap_size": num("heap_size")}))
}

/// The slowest bundle load the filter VMs logged ("loaded bundle … in N ms").
fn bundle_load_ms(dir: &Path) -> Option<f64> {
    let log = std::fs::read_to_string(dir.join("envoy.log")).ok()?;
    log.lines()
        .filter_map(|l| {
            l.split(" in ")
                .last()?
                .strip_suffix(" ms")?
                .trim()
                .parse::<f64>()
                .ok()
        })
        .reduce(f64::max)
}

/// What reading the responses' usage costs Envoy, resolved below the run-to-run noise of the
/// table's separate stacks: three kvroute stacks alike but for how they read — every response
/// (`stream_usage_every` 1), the shipped default (one stream in 32), none (`read_usage` off) —,
/// all up at once and loaded in turns (the order rotating), on simulated engines that answer a
/// short prompt with 128 tokens: one JSON body, or 128 server-sent events a decode step apart
/// plus the usage chunk, as a streaming client gets them. Envoy's CPU per request (user +
/// system, 10 ms ticks) over `requests` requests 16 at a time is compared round by round.
async fn usage_cost(rounds: usize, requests: usize) -> Result<Value> {
    let default_every = crate::stack::SHIPPED_STREAM_USAGE_EVERY;
    let mut stacks = Vec::new();
    for (name, read_usage, every) in [
        ("every", true, 1),
        ("sampled", true, default_every),
        ("off", false, 1),
    ] {
        let mut opts = StackOptions::new(&format!("datapath-usage-{name}"), Mode::Kvroute);
        opts.filter_extra
            .insert("read_usage".into(), read_usage.into());
        opts.filter_extra
            .insert("stream_usage_every".into(), every.into());
        opts.sim.output_tokens = 128;
        opts.hint_timeout_ms = 1000;
        stacks.push(Stack::start(opts).await?);
    }
    let mut out = serde_json::Map::new();
    for stream in [false, true] {
        let mut body = body_of(256)?;
        body["max_tokens"] = json!(128);
        if stream {
            body["stream"] = json!(true);
            body["stream_options"] = json!({"include_usage": true});
        }
        let mut cpu: [Vec<f64>; 3] = Default::default();
        for round in 0..rounds {
            for k in 0..3 {
                let i = (round + k) % 3;
                let r = load(&stacks[i], &body, 16, requests).await?;
                anyhow::ensure!(r["errors"] == 0, "usage cost run failed: {r}");
                cpu[i].push(r["envoy_cpu_us_per_request"].as_f64().unwrap_or(0.0));
            }
        }
        // What each sidecar was told, so a run shows the stacks differ as they claim (the
        // filter reports finished requests within 200 ms).
        tokio::time::sleep(Duration::from_secs(1)).await;
        let mut reported = Vec::new();
        for stack in &stacks {
            let m = stack.sidecar_metrics().await?;
            reported.push(crate::prometheus::sum(
                &m,
                "kvroute_served_prompt_tokens_total",
            ));
        }
        let kind = if stream { "stream_128_chunks" } else { "json" };
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
        // Per round, against the stack that reads nothing.
        let over_off =
            |i: usize| -> Vec<f64> { cpu[i].iter().zip(&cpu[2]).map(|(a, b)| a - b).collect() };
        let (every, sampled) = (over_off(0), over_off(1));
        let row = json!({
            "envoy_cpu_us_every": cpu[0], "envoy_cpu_us_sampled": cpu[1], "envoy_cpu_us_off": cpu[2],
            "mean_every": mean(&cpu[0]), "mean_sampled": mean(&cpu[1]), "mean_off": mean(&cpu[2]),
            "every_minus_off_us_median": quantile(&every, 0.5),
            "every_minus_off_us_mean": mean(&every),
            "sampled_minus_off_us_median": quantile(&sampled, 0.5),
            "sampled_minus_off_us_mean": mean(&sampled),
            "stream_usage_every_sampled": default_every,
            "requests_per_round": requests, "rounds": rounds,
            "reported_prompt_tokens_every": reported[0],
            "reported_prompt_tokens_sampled": reported[1],
            "reported_prompt_tokens_off": reported[2],
        });
        println!("usage cost, {kind}: {row}");
        out.insert(kind.to_owned(), row);
    }
    Ok(Value::Object(out))
}

/// Run every case; write `datapath.json` into `out`.
/// What a run measures: every setup and size (empty: all), each setup `rounds` times in turn
/// (round 1 every setup, then round 2 …), so two setups compared are measured minutes apart
/// at most and the shared machine's drift shows as a spread.
#[derive(Debug, Clone)]
pub struct Selection {
    /// Setups by name (`plain`, `filter_only`, …), run in this order; empty: all.
    pub setups: Vec<String>,
    /// Prompt sizes by name (`1k`, `8k`, `8k_turn`, `32k`); empty: all.
    pub sizes: Vec<String>,
    /// Rounds.
    pub rounds: usize,
    /// Requests of each 16-in-flight step, when not the scale's.
    pub c16_requests: Option<usize>,
}

impl Default for Selection {
    fn default() -> Self {
        Selection {
            setups: Vec::new(),
            sizes: Vec::new(),
            rounds: 1,
            c16_requests: None,
        }
    }
}

/// A setup of the stack a case runs on.
#[derive(Debug, Clone, Copy)]
struct Setup {
    name: &'static str,
    mode: Mode,
    /// The sidecar over a Unix socket.
    uds: bool,
    /// The filter reads the responses' usage.
    read_usage: bool,
    /// The filter's token cache on.
    token_cache: bool,
    /// Hints asked on the hint stream (else as HTTP calls).
    hint_stream: bool,
    /// The reference module ([`crate::paths::wasm_floor`]) in place of the filter, making this
    /// many extra host calls a request.
    floor: Option<u32>,
}

const KVROUTE: Setup = Setup {
    name: "kvroute",
    mode: Mode::Kvroute,
    uds: false,
    read_usage: true,
    token_cache: true,
    hint_stream: true,
    floor: None,
};

/// The extra host calls of `wasm_floor_calls`.
const FLOOR_HOST_CALLS: u32 = 20;

/// `wasm_floor`: a wasm module that only waits for the body and copies it into its VM
/// (`examples/wasm-floor`), the least any filter reading the prompt costs Envoy, so `wasm_floor −
/// plain` is the platform's share and `filter_only − wasm_floor` the filter's own;
/// `wasm_floor_calls` the same with 20 host calls more (a request header read 20 times), so a
/// twentieth of `wasm_floor_calls − wasm_floor` is what one host call costs.
/// `filter_only`: the filter with hints off — parse, template, tokenize and hash inside Envoy,
/// no sidecar call: what preparing a request costs on the event loop. `kvroute_no_usage`: the
/// same as `kvroute` without reading the responses' usage, so `kvroute − kvroute_no_usage` is
/// what reading them costs. `…_no_token_cache`: with the filter's token cache off, so each pair
/// shows what the cache saves. `kvroute_calls`: each hint an HTTP call instead of a message on
/// the hint stream.
const SETUPS: [Setup; 10] = [
    Setup {
        name: "plain",
        mode: Mode::RoundRobin,
        ..KVROUTE
    },
    Setup {
        name: "wasm_floor",
        mode: Mode::RingHash,
        floor: Some(0),
        ..KVROUTE
    },
    Setup {
        name: "wasm_floor_calls",
        mode: Mode::RingHash,
        floor: Some(FLOOR_HOST_CALLS),
        ..KVROUTE
    },
    Setup {
        name: "filter_only",
        mode: Mode::RingHash,
        ..KVROUTE
    },
    Setup {
        name: "filter_only_no_token_cache",
        mode: Mode::RingHash,
        token_cache: false,
        ..KVROUTE
    },
    KVROUTE,
    Setup {
        name: "kvroute_calls",
        hint_stream: false,
        ..KVROUTE
    },
    Setup {
        name: "kvroute_no_token_cache",
        token_cache: false,
        ..KVROUTE
    },
    Setup {
        name: "kvroute_no_usage",
        read_usage: false,
        ..KVROUTE
    },
    Setup {
        name: "kvroute_uds",
        uds: true,
        ..KVROUTE
    },
];

/// The round whose c=1 p50 is the median of `rounds` (each a `load` result), with every
/// round's p50 beside it.
fn median_round(mut rounds: Vec<Value>) -> Value {
    let p50 = |v: &Value| v["p50_us"].as_f64().unwrap_or(f64::NAN);
    let all: Vec<f64> = rounds.iter().map(p50).collect();
    rounds.sort_by(|a, b| p50(a).total_cmp(&p50(b)));
    let mut median = rounds.swap_remove(rounds.len() / 2);
    median["p50_us_rounds"] = json!(all);
    median
}

/// Envoy's stats flush in the datapath stacks: the filter's histograms are read per step.
const STATS_FLUSH_MS: u64 = 500;

/// What the filter's `prepare_us` histogram holds once Envoy has flushed what was recorded so
/// far (empty before anything was).
async fn filter_prepare(stack: &Stack) -> Vec<Bucket> {
    tokio::time::sleep(Duration::from_millis(3 * STATS_FLUSH_MS)).await;
    stack
        .envoy_histogram("wasmcustom.kvroute.prepare_us")
        .await
        .unwrap_or_default()
}

/// Run `selection` at `scale`; writes `out/datapath.json`.
pub async fn run(scale: Scale, out: &Path, selection: &Selection) -> Result<Value> {
    // `8k_turn`: the next turn of an ~8k-token conversation (the filter's token cache has its
    // history from the warm-up requests on); the others are prompts never seen.
    type Body = fn(usize) -> Result<Value>;
    let all: &[(&str, usize, Body)] = &[
        ("1k", 1000, body_of),
        ("8k", 8000, body_of),
        ("8k_turn", 8000, history_of),
        ("32k", 32000, body_of),
    ];
    let wanted = |list: &[String], name: &str| list.is_empty() || list.iter().any(|n| n == name);
    let sizes: Vec<_> = all
        .iter()
        .filter(|(name, ..)| wanted(&selection.sizes, name))
        .take(if scale == Scale::Smoke { 1 } else { all.len() })
        .collect();
    // In the order asked for, so an A/B can be run both ways round.
    let setups: Vec<Setup> = if selection.setups.is_empty() {
        SETUPS.to_vec()
    } else {
        selection
            .setups
            .iter()
            .filter_map(|name| SETUPS.into_iter().find(|s| s.name == name))
            .collect()
    };
    anyhow::ensure!(
        !sizes.is_empty() && !setups.is_empty(),
        "nothing selected: setups {:?} of {:?}, sizes {:?}",
        selection.setups,
        SETUPS.map(|s| s.name),
        selection.sizes
    );
    let (n1, n16) = match scale {
        Scale::Smoke => (5, 16),
        Scale::Quick => (40, 120),
        Scale::Full => (300, 1200),
    };
    let n16 = selection.c16_requests.unwrap_or(n16);
    let bodies: Vec<(&str, Value)> = sizes
        .iter()
        .map(|(name, tokens, body)| Ok((*name, body(*tokens)?)))
        .collect::<Result<_>>()?;
    // (size, setup, concurrency) → one result per round.
    let mut results: std::collections::BTreeMap<(String, String, usize), Vec<Value>> =
        Default::default();
    let (mut memory, mut bundle_ms) = (serde_json::Map::new(), serde_json::Map::new());
    for round in 1..=selection.rounds.max(1) {
        for &Setup {
            name: setup,
            mode,
            uds,
            read_usage,
            token_cache,
            hint_stream,
            floor,
        } in &setups
        {
            let mut opts = StackOptions::new(&format!("datapath-{setup}"), mode);
            opts.filter_extra
                .insert("read_usage".into(), read_usage.into());
            opts.filter_extra
                .insert("hint_stream".into(), hint_stream.into());
            if !token_cache {
                opts.filter_extra
                    .insert("token_cache_bytes".into(), 0.into());
            }
            opts.sim.instant = true;
            opts.sim.engines = 1;
            opts.sidecar_uds = uds;
            opts.hint_timeout_ms = 1000;
            opts.envoy_stats_flush_ms = Some(STATS_FLUSH_MS);
            if let Some(calls) = floor {
                opts.filter_wasm = Some(crate::paths::wasm_floor()?);
                opts.filter_extra
                    .insert("floor_host_calls".into(), calls.into());
            }
            let stack = Stack::start(opts).await?;
            // The filter's own time preparing each request (its warm-ups among them).
            let filtered = mode != Mode::RoundRobin && floor.is_none();
            for (name, body) in &bodies {
                let before = match filtered {
                    true => filter_prepare(&stack).await,
                    false => Vec::new(),
                };
                let mut c1 = load(&stack, body, 1, n1).await?;
                if filtered {
                    let after = filter_prepare(&stack).await;
                    c1["filter_prepare_p50_us"] = json!(quantile_between(&before, &after, 0.5));
                }
                let c16 = load(&stack, body, 16, n16).await?;
                println!(
                    "[round {round}] {setup:>12} {name:>4}: c=1 {c1}\n{:>17}  c=16 {c16}",
                    ""
                );
                for (c, r) in [(1, c1), (16, c16)] {
                    let key = ((*name).to_owned(), setup.to_owned(), c);
                    results.entry(key).or_default().push(r);
                }
            }
            memory.insert(setup.to_owned(), envoy_memory(&stack).await?);
            if filtered {
                bundle_ms.insert(setup.to_owned(), json!(bundle_load_ms(&stack.dir)));
            }
            // Let Envoy settle between setups: the next one starts its own.
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let mut cases = serde_json::Map::new();
    for ((size, setup, c), rounds) in results {
        let case = cases.entry(size).or_insert_with(|| json!({}));
        let key = if c == 1 {
            setup
        } else {
            format!("{setup}_c16")
        };
        case[key] = median_round(rounds);
    }
    for case in cases.values_mut() {
        let p50 = |setup: &str| case[setup]["p50_us"].as_f64();
        let cpu = |setup: &str| case[setup]["envoy_cpu_us_per_request"].as_f64();
        let differences = [
            ("added_p50_us", p50("kvroute"), p50("plain")),
            ("prepare_p50_us", p50("filter_only"), p50("plain")),
            (
                "prepare_no_token_cache_p50_us",
                p50("filter_only_no_token_cache"),
                p50("plain"),
            ),
            (
                "token_cache_saves_p50_us",
                p50("kvroute_no_token_cache"),
                p50("kvroute"),
            ),
            ("usage_p50_us", p50("kvroute"), p50("kvroute_no_usage")),
            ("usage_cpu_us", cpu("kvroute"), cpu("kvroute_no_usage")),
            ("stream_saves_p50_us", p50("kvroute_calls"), p50("kvroute")),
            (
                "stream_saves_c16_p50_us",
                p50("kvroute_calls_c16"),
                p50("kvroute_c16"),
            ),
            (
                "stream_saves_c16_cpu_us",
                cpu("kvroute_calls_c16"),
                cpu("kvroute_c16"),
            ),
        ];
        for (name, a, b) in differences {
            if let (Some(a), Some(b)) = (a, b) {
                case[name] = json!(a - b);
            }
        }
    }
    // Envoy runs one VM per worker thread plus one on the main thread.
    let vms = (StackOptions::new("", Mode::Kvroute).envoy_concurrency + 1) as f64;
    let plain_mem = memory
        .get("plain")
        .and_then(|m| m["allocated"].as_f64())
        .unwrap_or(0.0);
    let filter_mem = memory
        .get("filter_only")
        .and_then(|m| m["allocated"].as_f64())
        .unwrap_or(0.0);
    let (rounds, requests) = match scale {
        Scale::Smoke => (1, 16),
        Scale::Quick => (2, 200),
        Scale::Full => (6, 1000),
    };
    let usage = if selection.setups.is_empty() {
        usage_cost(rounds, requests).await?
    } else {
        Value::Null
    };
    let doc = json!({"cases": cases, "scale": format!("{scale:?}"), "usage_cost": usage,
        "envoy_memory": memory, "bundle_load_ms": bundle_ms,
        "filter_memory_per_vm_bytes": (filter_mem - plain_mem) / vms});
    std::fs::create_dir_all(out)?;
    std::fs::write(
        out.join("datapath.json"),
        serde_json::to_string_pretty(&doc)?,
    )?;
    Ok(doc)
}
