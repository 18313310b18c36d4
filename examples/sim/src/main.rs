//! `kvroute-sim`: run a fleet of simulated engines in one process.
//!
//! Prints one line `READY {"engines": [{"index", "address", "dynamo_worker_id", "zmq_endpoint",
//! "replay_endpoint"}, …]}` on stdout once every engine listens, then serves until interrupted.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use clap::Parser;
use kvroute_prompt::Preprocessor;
use kvroute_protocol::dynamo::{subject_v12, subject_v16};
use kvroute_protocol::vllm::EventEncoding;
use kvroute_sim::delay::{self, EventDelay};
use kvroute_sim::publish::DynamoPublisher;
use kvroute_sim::zmq::VllmPublisher;
use kvroute_sim::{server, Engine, EngineConfig};

#[derive(Parser)]
#[command(
    version,
    about = "Simulated vLLM-like engines publishing real KV events"
)]
struct Args {
    /// HF-style model directory (tokenizer.json, tokenizer_config.json, chat_template.jinja).
    #[arg(long)]
    model_dir: PathBuf,
    /// Served model name.
    #[arg(long)]
    model: String,
    /// KV block size in tokens.
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// Number of engines.
    #[arg(long, default_value_t = 4)]
    engines: usize,
    /// Index of the first engine (its `x-sim-engine` header), the others following: engines
    /// started as processes of their own number themselves apart.
    #[arg(long, default_value_t = 0)]
    first_index: usize,
    /// Port of the first engine (the others follow); 0 picks free ports.
    #[arg(long, default_value_t = 0)]
    base_port: u16,
    /// KV cache capacity per engine, in blocks.
    #[arg(long, default_value_t = 4096)]
    capacity_blocks: usize,
    /// Requests running at once per engine.
    #[arg(long, default_value_t = 8)]
    max_running: usize,
    /// Fixed cost per request, µs.
    #[arg(long, default_value_t = 1000)]
    base_latency_us: u64,
    /// Prefill cost per uncached prompt token, µs.
    #[arg(long, default_value_t = 40)]
    prefill_us_per_token: u64,
    /// Decode cost per output token, µs.
    #[arg(long, default_value_t = 1000)]
    decode_us_per_token: u64,
    /// Running requests share one GPU a step at a time, as continuous batching does: a step
    /// lasts `decode_us_per_token` + `prefill_us_per_token` × the prompt tokens it computes +
    /// `decode_us_per_seq` × the requests decoding in it (else each request pays its own time).
    #[arg(long)]
    batching: bool,
    /// With `--batching`: a step's cost per request decoding in it, µs.
    #[arg(long, default_value_t = 50)]
    decode_us_per_seq: u64,
    /// With `--batching`: prompt tokens computed per step at most (chunked prefill).
    #[arg(long, default_value_t = 2048)]
    chunk_tokens: usize,
    /// Output tokens when a request sets no max_tokens.
    #[arg(long, default_value_t = 8)]
    output_tokens: u32,
    /// Longest prompt accepted, in tokens.
    #[arg(long, default_value_t = 32768)]
    max_model_len: usize,
    /// Answer every completion at once, without tokenizing (data-path benchmark upstream).
    #[arg(long)]
    instant: bool,
    /// NATS server to publish Dynamo KV events to (engines with the `dynamo` format).
    #[arg(long)]
    nats: Option<String>,
    /// KV-event format per engine, cycled over the engines: `dynamo` (1.6, NATS), `dynamo-v12`,
    /// `vllm-map` or `vllm-array` (ZMQ PUB + replay socket on free loopback ports), `none`.
    #[arg(long, value_delimiter = ',', default_value = "dynamo")]
    event_format: Vec<String>,
    /// How late each engine publishes a batch of KV events, `P50,P95,MAX` in ms (log-normal,
    /// capped, in order); `0,0,0` publishes at once. Real vLLM under load: 1.6,52,666.
    #[arg(long, default_value = "0,0,0", value_parser = EventDelay::parse)]
    event_delay_ms: EventDelay,
    /// How long a request takes to reach the scheduler (and the request gauges), in ms: vLLM's
    /// API server on a busy CPU machine took longer than 250 ms.
    #[arg(long, default_value_t = 0)]
    frontend_delay_ms: u64,
    /// How late `/metrics` answers, in ms, with the numbers of when it was asked.
    #[arg(long, default_value_t = 0)]
    metrics_delay_ms: u64,
    /// Bind each vLLM-format engine's PUB and replay sockets on the two ports after its HTTP
    /// port (what `tcp://{host}:{port+1}` / `{port+2}` templates of `[[envoy.members]]` expect).
    #[arg(long)]
    zmq_beside: bool,
    /// Topic of vLLM-format messages.
    #[arg(long, default_value = "kv-events")]
    zmq_topic: String,
    /// Dynamo instance id of engine 0 (engine i gets base + i).
    #[arg(long, default_value_t = 7_000_000_000_000_000_000)]
    worker_id_base: u64,
    /// Dynamo namespace, component and endpoint of the KV-events subject.
    #[arg(long, default_value = "dynamo")]
    namespace: String,
    #[arg(long, default_value = "backend")]
    component: String,
    #[arg(long, default_value = "generate")]
    endpoint: String,
    /// Also serve a Dynamo-frontend stand-in on a free port: requests carrying
    /// `x-worker-instance-id` go to that engine (Dynamo's direct routing).
    #[arg(long)]
    frontend: bool,
    /// Write each engine's Dynamo discovery record (`v1/instances/<namespace>/<component>/
    /// <endpoint>/<instance id hex>`) under this directory, as Dynamo's file discovery does.
    #[arg(long)]
    discovery_dir: Option<std::path::PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let bundle =
        kvroute_prompt::model_dir::load_bundle(&args.model_dir, &args.model, args.block_size)
            .with_context(|| format!("loading {}", args.model_dir.display()))?;
    let preprocessor = Arc::new(Preprocessor::from_bundle(&bundle)?);
    let nats = match &args.nats {
        Some(url) => Some(
            async_nats::connect(url.as_str())
                .await
                .with_context(|| format!("connecting to NATS at {url}"))?,
        ),
        None => None,
    };
    let subject = subject_v16(&args.namespace, &args.component, &args.endpoint);
    let mut ready = Vec::new();
    let mut pinnable = Vec::new();
    let mut servers = tokio::task::JoinSet::new();
    for index in args.first_index..args.first_index + args.engines {
        let worker_id = args.worker_id_base.wrapping_add(index as u64);
        let config = EngineConfig {
            index,
            model: args.model.clone(),
            capacity_blocks: args.capacity_blocks,
            max_running: args.max_running,
            base_latency_us: args.base_latency_us,
            prefill_us_per_token: args.prefill_us_per_token,
            decode_us_per_token: args.decode_us_per_token,
            default_output_tokens: args.output_tokens,
            max_model_len: args.max_model_len,
            frontend_delay: std::time::Duration::from_millis(args.frontend_delay_ms),
            metrics_delay: std::time::Duration::from_millis(args.metrics_delay_ms),
            batching: args.batching.then_some(kvroute_sim::gpu::GpuConfig {
                step_us: args.decode_us_per_token,
                prefill_us_per_token: args.prefill_us_per_token,
                decode_us_per_seq: args.decode_us_per_seq,
                chunk_tokens: args.chunk_tokens.max(1),
            }),
        };
        let position = index - args.first_index;
        let format = args.event_format[position % args.event_format.len().max(1)].as_str();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let rx = delay::delayed(rx, args.event_delay_ms, worker_id);
        let publishes = format != "none" && (!format.starts_with("dynamo") || nats.is_some());
        let engine = Arc::new(Engine::new(
            config,
            preprocessor.clone(),
            publishes.then_some(tx),
        ));
        let port = if args.base_port == 0 {
            0
        } else {
            args.base_port + position as u16
        };
        let vllm = matches!(format, "vllm-map" | "vllm-array");
        let (listener, beside) = bind_engine(port, args.zmq_beside && vllm).await?;
        let mut info = serde_json::json!({"index": index, "dynamo_worker_id": worker_id, "event_format": format});
        match format {
            "dynamo" | "dynamo-v12" => {
                if let Some(client) = nats.clone() {
                    let v12 = format == "dynamo-v12";
                    let publisher = DynamoPublisher {
                        client,
                        subject: if v12 {
                            subject_v12(&args.namespace, &args.component)
                        } else {
                            subject.clone()
                        },
                        worker_id,
                        publisher_id: worker_id ^ 0x9e37_79b9_7f4a_7c15,
                        v12,
                    };
                    tokio::spawn(publisher.run(rx));
                }
            }
            "vllm-map" | "vllm-array" => {
                let encoding = if format == "vllm-map" {
                    EventEncoding::Map
                } else {
                    EventEncoding::Array
                };
                let (publisher, endpoints) = VllmPublisher::bind(
                    &args.zmq_topic,
                    encoding,
                    args.block_size,
                    engine.stats.drop_events.clone(),
                    beside,
                )?;
                info["zmq_endpoint"] = endpoints.events.into();
                info["replay_endpoint"] = endpoints.replay.into();
                tokio::spawn(publisher.run(rx));
            }
            "none" => {}
            other => anyhow::bail!("unknown --event-format {other}"),
        }
        let address = listener.local_addr()?.to_string();
        info["address"] = address.clone().into();
        ready.push(info);
        let app = if args.instant {
            server::instant_router(index)
        } else {
            server::router(engine)
        };
        if let Some(dir) = &args.discovery_dir {
            write_discovery_record(dir, &args, worker_id, &address)?;
        }
        pinnable.push((worker_id, app.clone()));
        servers.spawn(async move { axum::serve(listener, app).await });
    }
    let mut announced = serde_json::json!({"engines": ready, "subject": subject});
    if args.frontend {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
        announced["frontend"] = listener.local_addr()?.to_string().into();
        let app = server::frontend_router(pinnable);
        servers.spawn(async move { axum::serve(listener, app).await });
    }
    println!("READY {announced}");
    tokio::select! {
        Some(done) = servers.join_next() => { done??; Ok(()) }
        _ = tokio::signal::ctrl_c() => Ok(()),
    }
}

/// An engine's HTTP listener on `port` (0: a free one) and, when `beside`, the two ports after
/// it for its ZMQ sockets, checked free (a free port whose neighbours are taken is skipped).
async fn bind_engine(
    port: u16,
    beside: bool,
) -> anyhow::Result<(tokio::net::TcpListener, Option<(u16, u16)>)> {
    if !beside {
        return Ok((
            tokio::net::TcpListener::bind(("127.0.0.1", port)).await?,
            None,
        ));
    }
    for _ in 0..100 {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
        let p = listener.local_addr()?.port();
        let (Some(events), Some(replay)) = (p.checked_add(1), p.checked_add(2)) else {
            continue;
        };
        let free = |q: u16| std::net::TcpListener::bind(("127.0.0.1", q)).is_ok();
        if free(events) && free(replay) {
            return Ok((listener, Some((events, replay))));
        }
        if port != 0 {
            break;
        }
    }
    anyhow::bail!("no free port with two free ports after it for --zmq-beside")
}

/// The records Dynamo 1.6's file discovery writes for a worker: its `Endpoint` instance record
/// and its model card, each under its key percent-encoded into one flat file name
/// (`v1/instances/dynamo%2Fbackend%2Fgenerate%2F<id hex>`, `v1/mdc/…`), as in
/// `testdata/samples/dynamo/discovery-1.6.1-disaggregated`.
fn write_discovery_record(
    root: &std::path::Path,
    args: &Args,
    instance_id: u64,
    address: &str,
) -> anyhow::Result<()> {
    let (ns, component, endpoint) = (&args.namespace, &args.component, &args.endpoint);
    let key = percent_encode(&format!("{ns}/{component}/{endpoint}/{instance_id:x}"));
    let instance = serde_json::json!({
        "type": "Endpoint",
        "component": component,
        "endpoint": endpoint,
        "namespace": ns,
        "instance_id": instance_id,
        "transport": {"tcp": format!("{address}/{instance_id:x}/{ns}/{component}/{endpoint}")},
        "device_type": "cuda",
        "request_plane_codec": "msgpack",
    });
    let card = serde_json::json!({
        "type": "Model",
        "namespace": ns,
        "component": component,
        "endpoint": endpoint,
        "instance_id": instance_id,
        "card_json": {
            "display_name": args.model,
            "kv_cache_block_size": args.block_size,
            "worker_type": if component == "prefill" { "prefill" } else { "aggregated" },
            "runtime_config": {"total_kv_blocks": args.capacity_blocks},
        },
    });
    for (bucket, record) in [("v1/instances", instance), ("v1/mdc", card)] {
        let dir = root.join(bucket);
        std::fs::create_dir_all(&dir)?;
        // Written aside and renamed, so a reader never sees half a record.
        let tmp = dir.join(format!(".{key}.tmp"));
        std::fs::write(&tmp, record.to_string())?;
        std::fs::rename(&tmp, dir.join(&key))?;
    }
    Ok(())
}

/// Dynamo's file-name encoding of a discovery key: every byte but ASCII letters and digits as
/// `%XX`.
fn percent_encode(key: &str) -> String {
    key.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn keys_are_encoded_as_dynamo_names_its_files() {
        assert_eq!(
            super::percent_encode("dynamo/backend/worker_kv_query-1/ab"),
            "dynamo%2Fbackend%2Fworker%5Fkv%5Fquery%2D1%2Fab"
        );
    }
}
