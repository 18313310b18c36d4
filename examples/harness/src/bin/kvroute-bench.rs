//! `kvroute-bench routing|datapath|load|load-pool|dynamo|vllm|replicas|storm|soak`: the
//! benchmark harness (see docs/benchmarks.md).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context as _, Result};
use clap::{Parser, Subcommand};
use kvroute_harness::bench::Scale;
use kvroute_harness::client::CLIENT_START_GAP;
use kvroute_harness::workload::ChatSpec;
use kvroute_harness::{bench, datapath, paths};

#[derive(Parser)]
#[command(about = "kvroute benchmarks: routing quality and data-path cost")]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Output directory (default: target/bench).
    #[arg(long, global = true)]
    out: Option<PathBuf>,
    /// Smaller inputs; finishes in minutes.
    #[arg(long, global = true)]
    quick: bool,
}

#[derive(Subcommand)]
enum Command {
    /// Every routing mode on every workload: hit rate, TTFT, imbalance.
    Routing {
        /// Simulated engines.
        #[arg(long, default_value_t = 4)]
        engines: usize,
        /// Only these workloads (comma-separated).
        #[arg(long, value_delimiter = ',')]
        workloads: Option<Vec<String>>,
        /// Only these modes (comma-separated; the oracle always runs).
        #[arg(long, value_delimiter = ',')]
        modes: Option<Vec<String>>,
        /// Milliseconds between the starts of concurrent clients (0: all at once).
        #[arg(long, default_value_t = CLIENT_START_GAP.as_secs_f64() * 1e3)]
        start_gap_ms: f64,
        /// How late the simulated engines publish KV events, `P50,P95,MAX` ms (`0,0,0`: at
        /// once); the default is what real vLLM showed under load.
        #[arg(long, default_value = bench::REAL_EVENT_DELAY_MS)]
        event_delay_ms: String,
        /// Extra sidecar configuration, e.g. `"[routing]\nhome_slack = 2"`.
        #[arg(long, default_value = "")]
        sidecar_toml: String,
        /// Cache capacity per engine in blocks, for every workload (default: each workload's).
        #[arg(long)]
        capacity_blocks: Option<usize>,
        /// Requests each engine runs at once (vLLM's `--max-num-seqs`; more wait).
        #[arg(long, default_value_t = bench::MAX_RUNNING)]
        max_running: usize,
    },
    /// Plain Envoy vs Envoy + kvroute on an instant upstream.
    Datapath {
        /// Only these setups (comma-separated: plain, filter_only, filter_only_no_token_cache,
        /// kvroute, kvroute_calls, kvroute_no_token_cache, kvroute_no_usage, kvroute_uds; default all, and the
        /// usage A/B only then).
        #[arg(long, value_delimiter = ',')]
        setups: Vec<String>,
        /// Only these prompts (comma-separated: 1k, 8k, 8k_turn, 32k; default all).
        #[arg(long, value_delimiter = ',')]
        sizes: Vec<String>,
        /// Run the setups this many times in turn; each figure is the round with the median
        /// c=1 p50.
        #[arg(long, default_value_t = 1)]
        rounds: usize,
        /// Requests of each 16-in-flight step (default 1,200; `--quick` 120): a longer step
        /// to attach a profiler to Envoy while it runs.
        #[arg(long)]
        c16_requests: Option<usize>,
    },
    /// Open-loop load: Poisson arrivals at a ladder of rates to past saturation, every mode on
    /// the same request stream; per mode the highest rate whose TTFT p90 stays within the
    /// target.
    Load {
        /// Engines (simulated, or real vLLM with `--vllm`).
        #[arg(long, default_value_t = 8)]
        engines: usize,
        /// The short run `make test` holds.
        #[arg(long)]
        smoke: bool,
        /// These workloads (comma-separated: `shared_prefix`, `hot_prefix`, `chat`,
        /// `conversation_trace`, `synthetic_trace`; default: the scale's).
        #[arg(long, value_delimiter = ',')]
        workloads: Option<Vec<String>>,
        /// Draw the chat-shaped workloads with this seed instead of their own (other prompts,
        /// another arrival order; the traces are replayed as they are).
        #[arg(long)]
        seed: Option<u64>,
        /// Cache capacity per engine in blocks (default: each workload's).
        #[arg(long)]
        capacity_blocks: Option<usize>,
        /// The ladder, req/s, comma-separated (default: per engine 0.5 … 8).
        #[arg(long, value_delimiter = ',')]
        rates: Option<Vec<f64>>,
        /// Seconds of arrivals per rate.
        #[arg(long)]
        step_s: Option<f64>,
        /// Write into `<out>/load-<suffix>/` instead of `<out>` (several fleet sizes side by side).
        #[arg(long)]
        suffix: Option<String>,
        /// Also run Dynamo 1.6.1 on the ladder: this many mocker workers behind a frontend in
        /// `kv` and in `round-robin` mode, and kvroute in pin mode in front of a `kv` frontend.
        #[arg(long)]
        dynamo: Option<usize>,
        /// Also run the peer routers from PyPI (`make venv-peers`) on the ladder; one that is
        /// not installed or does not start is reported unavailable.
        #[arg(long)]
        peers: bool,
        /// Also run an oracle on the ladder: the harness sends each request to the engine holding
        /// the most of its prompt (asked of every engine just before), ties to the least busy.
        #[arg(long)]
        oracle: bool,
        /// Extra sidecar configuration, e.g. `"[routing]\nmax_in_flight = 64"`.
        #[arg(long, default_value = "")]
        sidecar_toml: String,
        /// One more kvroute mode, `NAME=TOML`: its sidecar configuration also has TOML
        /// (`\n` for newlines); reported as `kvroute:NAME`. Repeatable.
        #[arg(long = "variant")]
        variants: Vec<String>,
        /// Only these modes (comma-separated, as in the report), run in this order; one named
        /// twice runs twice (reported as `<mode>_2`).
        #[arg(long, value_delimiter = ',')]
        modes: Option<Vec<String>>,
        /// Start every mode's fleet first, then run each rate on all of them in turn (the order
        /// reversed at every other rate, each fleet warmed up right before its first rung):
        /// modes compared within the same minutes, as real engines on a shared machine need.
        #[arg(long)]
        interleave: bool,
        /// Real vLLM 0.32 engines on CPU (`make venv-vllm`; `--engines` of them) instead of
        /// simulated ones: Envoy's modes only; token prompts cut to the model's length.
        #[arg(long)]
        vllm: bool,
    },
    /// Several runs of `load` read as one: every request pooled per workload, rate and mode,
    /// each fleet's own p90 and the order it ran in beside (`load-pool.{json,md}`).
    LoadPool {
        /// The runs' output directories (each with its `requests.jsonl`).
        #[arg(required = true)]
        dirs: Vec<PathBuf>,
    },
    /// KV events at a ladder of rates, then a burst, on one event plane: what one sidecar
    /// applies and indexes, against what was published.
    Storm {
        /// `nats` (Dynamo on a real nats-server), `vllm-zmq` (a PUB socket per engine) or
        /// `dynamo-zmq` (Dynamo's default plane, found in discovery records).
        #[arg(long, default_value = "nats")]
        plane: String,
        /// Dynamo workers the publisher plays.
        #[arg(long, default_value_t = 256)]
        workers: usize,
        /// Sustained rates, events per second (comma-separated).
        #[arg(long, value_delimiter = ',')]
        rates: Option<Vec<u64>>,
        /// Seconds each rate is held.
        #[arg(long, default_value_t = 4.0)]
        seconds: f64,
        /// Events in the final burst.
        #[arg(long, default_value_t = 200_000)]
        burst: u64,
        /// Events per message (one worker's, as Dynamo 1.6 batches a step's).
        #[arg(long, default_value_t = 1)]
        batch: u64,
        /// Extra `[nats]` lines, e.g. `"buffer_messages = 65536"`.
        #[arg(long, default_value = "")]
        nats_toml: String,
    },
    /// A fleet under steady load while faults are applied one at a time (nats-server, engines,
    /// a sidecar and a replica restarted, events lost, a replica cut off from them): failed
    /// requests, and how long until the indexes agree with the engines again.
    Soak {
        /// The short run `make test` holds (3 faults, held 3 s).
        #[arg(long)]
        smoke: bool,
        /// Only these faults of the full run, by their report names, comma-separated (e.g.
        /// `replica_1_partitioned_from_events`).
        #[arg(long, value_delimiter = ',')]
        faults: Vec<String>,
        /// Break a real Dynamo fleet (`.venv-dynamo`): workers killed and started again as new
        /// instances, the sidecar killed.
        #[arg(long)]
        dynamo: bool,
    },
    /// 1, 2, 4 and 8 sidecar + Envoy pairs on one fleet whose caches evict, each sidecar losing
    /// 10% of the KV events on its transport (a lossy NATS proxy) and repairing from the others,
    /// against one lossless replica and one index shared by every Envoy: hit rate, agreement
    /// (probed from outside), repairs.
    Replicas {
        /// Simulated engines.
        #[arg(long, default_value_t = 4)]
        engines: usize,
        /// `[replicas] interval_ms`.
        #[arg(long, default_value_t = 1000)]
        interval_ms: u64,
        /// Probe prompts asked of every sidecar after each run (default 200; 100 with --quick).
        #[arg(long)]
        probes: Option<usize>,
        /// Replica counts (comma-separated; default 1,2,4,8, with --quick 1,2,8); each runs
        /// lossy and, from 2 on, as one index shared by as many Envoys.
        #[arg(long, value_delimiter = ',')]
        counts: Option<Vec<usize>>,
        /// Share of the KV-event messages each lossy sidecar's transport drops.
        #[arg(long, default_value_t = kvroute_harness::bench_replicas::LOSS)]
        loss: f64,
        /// Also run each count from 2 on without loss (default: true; false with --quick).
        #[arg(long)]
        lossless: Option<bool>,
        /// Cache capacity per engine in blocks, for the loss workloads (default: each one's).
        #[arg(long)]
        capacity_blocks: Option<usize>,
        /// The loss workloads (comma-separated: multi_turn, agent_loop, conversation_trace;
        /// `none` for none; default multi_turn,agent_loop).
        #[arg(long, value_delimiter = ',')]
        workloads: Option<Vec<String>>,
        /// Load-sharing workloads to run as well (comma-separated: hot_prefix, system_prompt;
        /// default none).
        #[arg(long, value_delimiter = ',')]
        sharing: Option<Vec<String>>,
        /// Extra sidecar configuration, e.g. `"[routing]\nspread_slack = 1e9"`.
        #[arg(long, default_value = "")]
        sidecar_toml: String,
    },
    /// kvroute (pin mode) vs Dynamo's KV router and round robin on real Dynamo mocker workers.
    Dynamo {
        /// Aggregated workers (0 with --prefill/--decode: disaggregated).
        #[arg(long, default_value_t = 4)]
        workers: usize,
        /// Disaggregated prefill workers.
        #[arg(long, default_value_t = 0)]
        prefill: usize,
        /// Disaggregated decode workers.
        #[arg(long, default_value_t = 0)]
        decode: usize,
        /// KV cache per worker, in blocks.
        #[arg(long, default_value_t = 128)]
        capacity_blocks: usize,
        /// Conversations of the multi-turn chat.
        #[arg(long, default_value_t = 48)]
        conversations: usize,
        /// Conversations in flight.
        #[arg(long, default_value_t = 8)]
        concurrency: usize,
        /// Extra sidecar configuration, e.g. `"[routing]\nmax_kv_usage = 2.0"`.
        #[arg(long, default_value = "")]
        sidecar_toml: String,
        /// Run the fleet on Dynamo's NATS event plane and file discovery instead of its defaults
        /// (ZMQ events, etcd discovery).
        #[arg(long)]
        nats: bool,
        /// Only these modes (comma-separated; default all: dynamo_kv, dynamo_round_robin,
        /// envoy_dynamo_kv, kvroute_filter_only, kvroute, kvroute_sidecar_killed).
        #[arg(long, value_delimiter = ',')]
        modes: Vec<String>,
        /// Users think up to this long (ms, spread evenly) before each next turn, so turns reach
        /// the mockers' step clock at any phase.
        #[arg(long, default_value_t = 20.0)]
        think_ms: f64,
    },
    /// kvroute vs ring hash alone and round robin on real vLLM engines (CPU).
    Vllm {
        /// Engines.
        #[arg(long, default_value_t = 2)]
        engines: usize,
        /// KV cache per engine, in blocks of 32 tokens.
        #[arg(long, default_value_t = 512)]
        capacity_blocks: usize,
        /// Users of the multi-turn chat.
        #[arg(long, default_value_t = 16)]
        conversations: usize,
        /// Users in flight.
        #[arg(long, default_value_t = 16)]
        concurrency: usize,
        /// The apps' system prompts, one length in words each (user i talks to app i mod apps).
        #[arg(long, value_delimiter = ',', default_values_t = ChatSpec::demo().system_prompt_words)]
        system_prompt_words: Vec<usize>,
        /// Turns per user.
        #[arg(long, default_value_t = ChatSpec::demo().turns)]
        turns: usize,
        /// Before each turn after the first, a user thinks up to this long (spread evenly).
        #[arg(long, default_value_t = 0.0)]
        think_ms: f64,
        /// `max_tokens` of each request (the replies kept in the history are the workload's).
        #[arg(long, default_value_t = ChatSpec::demo().max_tokens)]
        max_tokens: u32,
        /// Extra sidecar configuration, e.g. `"[routing]\nload_penalty_blocks = 2"`.
        #[arg(long, default_value = "")]
        sidecar_toml: String,
        /// Only these modes (comma-separated: kvroute, ring_hash, round_robin).
        #[arg(long, value_delimiter = ',')]
        modes: Option<Vec<String>>,
        /// Runs per mode (workload seeds 42, 43, …), pooled.
        #[arg(long, default_value_t = 3)]
        repeat: usize,
        /// One more kvroute mode, `NAME=TOML` (added to `--sidecar-toml`), reported as
        /// `kvroute:NAME`; repeat the flag for several.
        #[arg(long = "variant")]
        variants: Vec<String>,
    },
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    let out = cli
        .out
        .unwrap_or_else(|| paths::workspace().join("target/bench"));
    let scale = if cli.quick { Scale::Quick } else { Scale::Full };
    match cli.command {
        Command::Routing {
            engines,
            workloads,
            modes,
            start_gap_ms,
            event_delay_ms,
            sidecar_toml,
            capacity_blocks,
            max_running,
        } => {
            let gap = millis("--start-gap-ms", start_gap_ms)?;
            let doc = bench::run(
                &bench::RoutingBench {
                    scale,
                    engines,
                    workloads,
                    modes,
                    start_gap: gap,
                    event_delay_ms,
                    sidecar_toml: sidecar_toml.replace("\\n", "\n"),
                    capacity_blocks,
                    max_running,
                },
                &out,
            )
            .await?;
            println!("\n{}", bench::markdown(&doc));
            println!("written to {}", out.join("routing.{json,md,png}").display());
        }
        Command::Dynamo {
            workers,
            prefill,
            decode,
            capacity_blocks,
            conversations,
            concurrency,
            sidecar_toml,
            nats,
            modes,
            think_ms,
        } => {
            let think_max = millis("--think-ms", think_ms)?;
            let bench = kvroute_harness::bench_dynamo::DynamoBench {
                fleet: kvroute_harness::DynamoOptions {
                    aggregated: workers,
                    prefill,
                    decode,
                    capacity_blocks,
                    // Dynamo's own defaults unless asked.
                    event_plane: nats.then(|| "nats".to_owned()),
                    etcd: !nats,
                    ..Default::default()
                },
                conversations: if cli.quick {
                    conversations / 4
                } else {
                    conversations
                },
                concurrency,
                sidecar_toml: sidecar_toml.replace("\\n", "\n"),
                modes,
                think_max,
            };
            println!(
                "\n{}",
                kvroute_harness::bench_dynamo::run(&bench, &out).await?
            );
            println!("written to {}", out.join("dynamo.{json,md}").display());
        }
        Command::Vllm {
            engines,
            capacity_blocks,
            conversations,
            concurrency,
            system_prompt_words,
            turns,
            think_ms,
            max_tokens,
            sidecar_toml,
            modes,
            repeat,
            variants,
        } => {
            let variants = variants
                .iter()
                .map(|v| parse_variant(v))
                .collect::<Result<Vec<_>>>()?;
            let think_max = millis("--think-ms", think_ms)?;
            let bench = kvroute_harness::bench_vllm::VllmBench {
                fleet: kvroute_harness::vllm::VllmOptions {
                    engines,
                    capacity_blocks,
                    ..Default::default()
                },
                chat: ChatSpec {
                    system_prompt_words,
                    conversations,
                    turns,
                    max_tokens,
                    ..ChatSpec::demo()
                },
                concurrency,
                think_max,
                sidecar_toml: sidecar_toml.replace("\\n", "\n"),
                modes: modes.unwrap_or_default(),
                repeat,
                variants,
            };
            println!(
                "\n{}",
                kvroute_harness::bench_vllm::run(&bench, &out).await?
            );
            println!("written to {}", out.join("vllm.{json,md}").display());
        }
        Command::Replicas {
            engines,
            interval_ms,
            probes,
            counts,
            loss,
            lossless,
            capacity_blocks,
            workloads,
            sharing,
            sidecar_toml,
        } => {
            use kvroute_harness::bench_replicas::{scenarios, ReplicasBench, COUNTS, QUICK_COUNTS};
            let all = ReplicasBench::new(scale);
            let only = |names: &[&'static str], keep: Option<Vec<String>>| match keep {
                Some(keep) => names
                    .iter()
                    .copied()
                    .filter(|n| keep.iter().any(|k| k == n))
                    .collect(),
                None => names.to_vec(),
            };
            let bench = ReplicasBench {
                engines,
                interval_ms,
                probes: probes.unwrap_or(all.probes),
                scenarios: scenarios(
                    &counts.unwrap_or_else(|| {
                        if cli.quick {
                            &QUICK_COUNTS[..]
                        } else {
                            &COUNTS[..]
                        }
                        .to_vec()
                    }),
                    loss,
                    lossless.unwrap_or(!cli.quick),
                ),
                capacity_blocks,
                workloads: match workloads {
                    Some(keep) => only(
                        &["multi_turn", "agent_loop", "conversation_trace"],
                        Some(keep),
                    ),
                    None => all.workloads.clone(),
                },
                sharing: only(
                    &["hot_prefix", "system_prompt"],
                    Some(sharing.unwrap_or_default()),
                ),
                sidecar_toml: sidecar_toml.replace("\\n", "\n"),
                ..all
            };
            println!(
                "\n{}",
                kvroute_harness::bench_replicas::run(&bench, &out).await?
            );
            println!("written to {}", out.join("replicas.{json,md}").display());
        }
        Command::Storm {
            plane,
            workers,
            rates,
            seconds,
            burst,
            batch,
            nats_toml,
        } => {
            use kvroute_harness::bench_storm::{run, Plane, StormBench};
            let full = StormBench::full();
            let bench = StormBench {
                plane: Plane::parse(&plane)?,
                workers,
                rates: rates.unwrap_or(full.rates),
                seconds,
                burst,
                batch: batch.max(1),
                nats_toml: nats_toml.replace("\\n", "\n"),
                ..full
            };
            let doc = run(&bench, &out).await?;
            println!("\n{}", kvroute_harness::bench_storm::markdown(&doc));
            let stem = kvroute_harness::bench_storm::file_stem(bench.plane, bench.batch);
            println!(
                "written to {}",
                out.join(format!("{stem}.{{json,md}}")).display()
            );
        }
        Command::Soak {
            smoke,
            faults,
            dynamo,
        } => {
            use kvroute_harness::soak::{file_stem, markdown, run, SoakBench};
            let mut bench = match (dynamo, smoke) {
                (false, false) => SoakBench::full(),
                (false, true) => SoakBench::smoke(),
                (true, false) => SoakBench::dynamo(),
                (true, true) => SoakBench::dynamo_smoke(),
            };
            if !faults.is_empty() {
                bench.only(&faults)?;
            }
            let doc = run(&bench, &out).await?;
            println!("\n{}", markdown(&doc));
            let stem = file_stem(bench.fleet);
            println!(
                "written to {}",
                out.join(format!("{stem}.{{json,md}}")).display()
            );
        }
        Command::Load {
            engines,
            smoke,
            workloads,
            seed,
            capacity_blocks,
            rates,
            step_s,
            suffix,
            dynamo,
            peers,
            oracle,
            sidecar_toml,
            variants,
            modes,
            vllm,
            interleave,
        } => {
            use kvroute_harness::bench_load::{markdown, run, LoadBench, LoadWorkload};
            let scale = if smoke { Scale::Smoke } else { scale };
            let mut bench = LoadBench::new(scale, engines);
            if let Some(names) = workloads {
                bench.workloads = names
                    .iter()
                    .map(|n| {
                        LoadWorkload::named(n).with_context(|| format!("no such workload: {n}"))
                    })
                    .collect::<Result<_>>()?;
            }
            if let Some(seed) = seed {
                bench.workloads = std::mem::take(&mut bench.workloads)
                    .into_iter()
                    .map(|w| w.with_seed(seed))
                    .collect();
            }
            bench.capacity_blocks = capacity_blocks;
            if let Some(r) = rates {
                bench.rates = r;
            }
            if let Some(s) = step_s {
                bench.step = Duration::from_secs_f64(s);
            }
            if let Some(workers) = dynamo {
                bench.with_dynamo(workers);
            }
            if oracle {
                bench.with_oracle();
            }
            if peers {
                bench.with_peers();
            }
            if vllm {
                bench.on_vllm();
            }
            bench.sidecar_toml = sidecar_toml;
            for (name, toml) in variants
                .iter()
                .map(|v| parse_variant(v))
                .collect::<Result<Vec<_>>>()?
            {
                // Leaked: the mode (`Copy`, like the others) names it for the whole run.
                bench.with_variant(Box::leak(name.into_boxed_str()), toml);
            }
            bench.interleave = interleave;
            if let Some(names) = modes {
                // In the order given, a mode named twice runs twice: on real engines a fleet
                // started after another runs on a machine in another state, so comparisons run
                // each order, or A/B/A.
                let known = std::mem::take(&mut bench.modes);
                for name in &names {
                    let mode = known
                        .iter()
                        .find(|m| m.name() == *name)
                        .with_context(|| format!("no such mode: {name}"))?;
                    bench.modes.push(*mode);
                }
            }
            let dir = match &suffix {
                Some(s) => out.join(format!("load-{s}")),
                None => out.clone(),
            };
            let doc = run(&bench, &dir).await?;
            println!("\n{}", markdown(&doc));
            println!("written to {}", dir.join("load.{json,md,png}").display());
        }
        Command::LoadPool { dirs } => {
            use kvroute_harness::load_pool;
            let pooled = load_pool::pool(&load_pool::read(&dirs)?);
            let md = load_pool::markdown(&pooled);
            std::fs::create_dir_all(&out)?;
            std::fs::write(
                out.join("load-pool.json"),
                serde_json::to_string_pretty(&pooled)?,
            )?;
            std::fs::write(out.join("load-pool.md"), &md)?;
            println!("{md}");
            println!("written to {}", out.join("load-pool.{json,md}").display());
        }
        Command::Datapath {
            setups,
            sizes,
            rounds,
            c16_requests,
        } => {
            let selection = datapath::Selection {
                setups,
                sizes,
                rounds,
                c16_requests,
            };
            datapath::run(scale, &out, &selection).await?;
            println!("written to {}", out.join("datapath.json").display());
        }
    }
    Ok(())
}

/// A duration flag given in milliseconds.
fn millis(flag: &str, ms: f64) -> Result<Duration> {
    Duration::try_from_secs_f64(ms / 1e3).map_err(|e| anyhow::anyhow!("{flag} {ms}: {e}"))
}

/// A `--variant NAME=TOML` argument: its name and configuration, `\n` for newlines.
fn parse_variant(v: &str) -> Result<(String, String)> {
    let (name, toml) = v
        .split_once('=')
        .with_context(|| format!("--variant {v:?} is not NAME=TOML"))?;
    Ok((name.to_owned(), toml.replace("\\n", "\n")))
}
