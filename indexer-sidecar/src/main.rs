//! `kvroute-sidecar`: the native sidecar binary.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use axum::serve::ListenerExt as _;
use clap::{Parser, Subcommand};
use kvroute_sidecar::config::Config;
use kvroute_sidecar::core::Input;
use kvroute_sidecar::sidecar::Sidecar;
use kvroute_sidecar::{connections, envoy_config, http_api, inspect, observers, transports};

#[derive(Parser)]
#[command(
    version,
    about = "kvroute sidecar: KV-event indexer and routing-hint server"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Index KV events and serve hints, bundles and metrics.
    Serve {
        /// Configuration file (TOML).
        #[arg(long, short)]
        config: PathBuf,
        /// Override `listen` from the configuration.
        #[arg(long)]
        listen: Option<std::net::SocketAddr>,
    },
    /// Subscribe like the sidecar would and print live events as JSON lines (stdout), with
    /// message counts per subject and component every few seconds (stderr).
    Tap {
        /// NATS server URL (Dynamo).
        #[arg(long)]
        nats: Option<String>,
        /// NATS subject (repeatable; default: everything under `namespace.>`).
        #[arg(long = "subject")]
        subjects: Vec<String>,
        /// vLLM ZMQ PUB endpoint to connect to (repeatable).
        #[arg(long = "zmq")]
        zmq: Vec<String>,
        /// ZMQ topic prefix.
        #[arg(long, default_value = "")]
        topic: String,
        /// Seconds between count summaries.
        #[arg(long, default_value_t = 5)]
        summary_s: u64,
    },
    /// Print what the filter computes for a request body read from stdin: rendered prompt,
    /// token ids, block hashes (as u64), as JSON.
    Tokenize {
        /// HF-style model directory, as in `[[models]] dir`.
        #[arg(long)]
        model_dir: PathBuf,
        /// KV block size of the engines.
        #[arg(long, default_value_t = 16)]
        block_size: u32,
    },
    /// Print a ready-to-run Envoy configuration (a shipped template, filled) to stdout.
    EnvoyConfig {
        /// Which shipped configuration.
        #[arg(long, value_enum, default_value = "kvroute")]
        template: envoy_config::Template,
        /// The `workers` cluster: engines (or, in pin mode, Dynamo frontends), `ip:port,…`.
        #[arg(long, required_unless_present = "workers_eds")]
        workers: Option<String>,
        /// Take the `workers` cluster's endpoints from this EDS file instead, reloaded whenever
        /// a new version is moved into place (filesystem xDS; `[[envoy.members]]` follows them).
        #[arg(long, conflicts_with = "workers")]
        workers_eds: Option<PathBuf>,
        /// Envoy's listener port (on 127.0.0.1, as shipped; edit the address to expose it).
        #[arg(long, default_value_t = 10000)]
        listen_port: u16,
        /// Envoy's admin port (127.0.0.1).
        #[arg(long, default_value_t = 9901)]
        admin_port: u16,
        /// The sidecar's `listen` address.
        #[arg(long, default_value = "127.0.0.1:9100")]
        sidecar: std::net::SocketAddr,
        /// Reach the sidecar on this Unix socket (its `unix_socket`) instead.
        #[arg(long)]
        sidecar_socket: Option<PathBuf>,
        /// The filter module (target/wasm32-wasip1/release/kvroute_filter.wasm after `make build`).
        #[arg(long, default_value = "kvroute_filter.wasm")]
        wasm: PathBuf,
        /// The filter's configuration, a JSON object (docs/operations.md; `{}`: defaults).
        #[arg(long, default_value = "{}")]
        filter_config: String,
        /// Seconds a stream may carry no byte before Envoy ends it (also how long a request
        /// paused on a filter VM that trapped waits); above your longest non-streamed answer.
        #[arg(long, default_value_t = envoy_config::STREAM_IDLE_TIMEOUT.as_secs_f64())]
        stream_idle_timeout_s: f64,
    },
    /// GET a URL of the running sidecar and exit 0 on a 2xx answer, 1 otherwise: the exec
    /// probe of a container that has no shell and whose API listens on loopback only
    /// (kubelet's httpGet probes reach the pod's IP, not its loopback).
    Probe {
        /// What to ask, e.g. `http://127.0.0.1:9100/readyz`.
        #[arg(long, default_value = "http://127.0.0.1:9100/healthz")]
        url: String,
        /// Seconds before giving up.
        #[arg(long, default_value_t = 2.0)]
        timeout_s: f64,
    },
    /// Print captured KV-event payloads as JSON lines (hashes as u64), one per event.
    Decode {
        /// Wire format of the files.
        #[arg(long, value_enum)]
        format: inspect::Format,
        /// Captured message bodies (Dynamo) or payload frames (vLLM).
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,tk_encode=warn,async_nats=warn".into()),
        )
        .init();
    match Cli::parse().command {
        Command::Serve { config, listen } => {
            let mut config = Config::load(&config)?;
            if let Some(listen) = listen {
                config.listen = listen;
            }
            serve(config).await
        }
        Command::Tap {
            nats,
            subjects,
            zmq,
            topic,
            summary_s,
        } => {
            if nats.is_none() && zmq.is_empty() {
                anyhow::bail!("tap needs --nats URL and/or --zmq ENDPOINT");
            }
            let subjects = if subjects.is_empty() {
                vec!["namespace.>".to_owned()]
            } else {
                subjects
            };
            inspect::tap(inspect::TapTargets {
                nats,
                subjects,
                zmq,
                topic,
                summary: std::time::Duration::from_secs(summary_s.max(1)),
            })
            .await
        }
        Command::Tokenize {
            model_dir,
            block_size,
        } => {
            let mut body = Vec::new();
            std::io::Read::read_to_end(&mut std::io::stdin(), &mut body)?;
            let out = inspect::tokenize(&model_dir, block_size, &body)?;
            print_lines(std::iter::once(out.to_string()))
        }
        Command::EnvoyConfig {
            template,
            workers,
            workers_eds,
            listen_port,
            admin_port,
            sidecar,
            sidecar_socket,
            wasm,
            filter_config,
            stream_idle_timeout_s,
        } => {
            let params = envoy_config::EnvoyParams {
                listen_port,
                admin_port,
                workers: match (workers, workers_eds) {
                    (_, Some(eds)) => {
                        envoy_config::Workers::EdsFile(std::path::absolute(&eds).unwrap_or(eds))
                    }
                    (list, None) => envoy_config::Workers::Listed(envoy_config::parse_workers(
                        list.as_deref().unwrap_or(""),
                    )?),
                },
                sidecar: match sidecar_socket {
                    Some(path) => envoy_config::SidecarAddress::Unix(path),
                    None => envoy_config::SidecarAddress::Tcp(sidecar),
                },
                filter_config: serde_json::from_str(&filter_config)
                    .context("--filter-config is not JSON")?,
                wasm: std::path::absolute(&wasm).unwrap_or(wasm),
                stream_idle_timeout: std::time::Duration::try_from_secs_f64(stream_idle_timeout_s)
                    .context("--stream-idle-timeout-s is not a number of seconds")?,
            };
            print!("{}", envoy_config::render(template.text(), &params)?);
            Ok(())
        }
        Command::Probe { url, timeout_s } => {
            let client = reqwest::Client::builder()
                .timeout(std::time::Duration::from_secs_f64(
                    timeout_s.clamp(0.01, 60.0),
                ))
                .build()?;
            let response = client.get(&url).send().await?;
            let status = response.status();
            let body = response.text().await.unwrap_or_default();
            println!("{status} {}", body.trim());
            if !status.is_success() {
                std::process::exit(1);
            }
            Ok(())
        }
        Command::Decode { format, files } => {
            let mut lines = Vec::new();
            for file in files {
                lines.extend(inspect::decode_file(format, &file)?);
            }
            print_lines(lines.into_iter().map(|l| l.to_string()))
        }
    }
}

/// Write lines to stdout; a reader that went away (`| head`) ends the output quietly instead of
/// the panic `println!` would raise.
fn print_lines(lines: impl Iterator<Item = String>) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    for line in lines {
        match writeln!(out, "{line}") {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(()),
            Err(e) => return Err(e.into()),
        }
    }
    match out.flush() {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

async fn serve(config: Config) -> anyhow::Result<()> {
    let state = Arc::new(Sidecar::from_config(&config)?);
    tracing::info!(
        models = config.models.len(),
        workers = config.workers.len(),
        "bundles loaded"
    );
    let app = http_api::router(state.clone());
    let descriptors = connections::raise_descriptor_limit();
    let max_connections = connections::cap(config.api.max_connections, descriptors);
    let idle = std::time::Duration::from_secs(config.api.idle_timeout_s);
    let tcp = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("binding {}", config.listen))?;
    tracing::info!(listen = %tcp.local_addr()?, max_connections, idle_timeout_s = config.api.idle_timeout_s, "serving the hint API");
    // Hints are small request/response exchanges on the request path: send each answer at once.
    let tcp = tcp.tap_io(|stream| {
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY on a hint connection");
        }
    });
    let tcp = connections::Bounded::new(tcp, max_connections, idle);
    let mut tasks = tokio::task::JoinSet::new();
    if let Some(snapshot) = config.snapshot.clone() {
        // Before any source starts: a vLLM replay then continues the restored caches.
        kvroute_sidecar::replication::disk::restore(&snapshot, &state);
        let state = state.clone();
        tasks.spawn(async move {
            kvroute_sidecar::replication::disk::run(snapshot, state).await;
            Ok(())
        });
    }
    tasks.spawn(async move {
        axum::serve(tcp, app.clone())
            .await
            .map_err(anyhow::Error::from)
    });
    if let Some(path) = &config.unix_socket {
        let _ = std::fs::remove_file(path);
        let uds = tokio::net::UnixListener::bind(path)
            .with_context(|| format!("binding unix socket {}", path.display()))?;
        tracing::info!(socket = %path.display(), "serving the hint API on a Unix socket");
        let app = http_api::router(state.clone());
        let uds = connections::Bounded::new(uds, max_connections, idle);
        tasks.spawn(async move { axum::serve(uds, app).await.map_err(anyhow::Error::from) });
    }
    tasks.spawn({
        let state = state.clone();
        async move {
            observers::engine_metrics::run(state).await;
            Ok(())
        }
    });
    if let Some(envoy) = config.envoy.clone() {
        let state = state.clone();
        tasks.spawn(async move {
            observers::envoy_admin::run(envoy, state).await;
            Ok(())
        });
    }
    if let Some(nats) = config.nats.clone() {
        let state = state.clone();
        tasks.spawn(transports::nats::run(nats, state));
    }
    if let Some(replicas) = config.replicas.clone() {
        let (state, nats) = (state.clone(), config.nats.clone());
        tasks.spawn(async move {
            // The replica plane is an addition: its failure is said and retried, serving goes on.
            loop {
                let run = kvroute_sidecar::replication::plane::run(replicas.clone(), nats.clone(), state.clone());
                if let Err(e) = run.await {
                    tracing::error!(error = %format!("{e:#}"), "replica plane stopped; serving alone, retrying in 5 s");
                }
                tokio::time::sleep(std::time::Duration::from_secs(5)).await;
            }
        });
    }
    for zmq in config.zmq.clone() {
        // A configured source runs for the life of the process: its stop flag is never set.
        transports::zmq::spawn(zmq, state.clone()).context("starting a ZMQ subscriber")?;
    }
    // Dynamo's default event plane (ZMQ): its publishers are found in the discovery records.
    let zmq_plane = match config.dynamo_discovery.is_empty() {
        true => None,
        false => Some(
            transports::dynamo_zmq::start(state.clone(), config.nats.is_some())
                .context("starting the Dynamo ZMQ event plane's thread")?,
        ),
    };
    for (i, discovery) in config.dynamo_discovery.clone().into_iter().enumerate() {
        let follow = zmq_plane.as_ref().map(|p| p.entry(i));
        tasks.spawn(observers::discovery::run(discovery, state.clone(), follow));
    }
    tasks.spawn({
        let state = state.clone();
        async move {
            state.watch_alarms().await;
            Ok(())
        }
    });
    tasks.spawn({
        let state = state.clone();
        async move {
            // Tickets expire on their own clock, scraped workers or not.
            let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
            loop {
                tick.tick().await;
                state.ingest(Input::Tick, std::time::Instant::now());
            }
        }
    });
    let members = config.envoy.as_ref().is_some_and(|e| !e.members.is_empty());
    if config.nats.is_none()
        && config.zmq.is_empty()
        && config.dynamo_discovery.is_empty()
        && !members
    {
        tracing::warn!("neither [nats], [[zmq]], [[dynamo_discovery]] nor [[envoy.members]] configured: no KV events will arrive, every request goes to the least loaded worker");
    }
    tokio::select! {
        Some(done) = tasks.join_next() => done?.context("a sidecar task stopped"),
        _ = tokio::signal::ctrl_c() => Ok(()),
    }
}
