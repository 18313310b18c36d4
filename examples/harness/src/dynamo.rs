//! A real NVIDIA Dynamo 1.6.1 fleet on loopback: mocker workers (Dynamo's own engine simulator,
//! publishing real KV events on NATS, or on Dynamo's default ZMQ event plane, and real discovery
//! records in Dynamo's file store or in a real etcd) behind a real Dynamo frontend, from the
//! project's `.venv-dynamo` (`make venv-dynamo`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context as _, Result};

use crate::engines::{EngineInfo, MODEL};
use crate::paths;
use crate::process::{free_port, wait_for, Process};
use kvroute_sidecar::core::fleet::Role;
use kvroute_sidecar::observers::discovery;

/// What to start.
#[derive(Debug, Clone)]
pub struct DynamoOptions {
    /// Aggregated workers (prefill and decode on one worker).
    pub aggregated: usize,
    /// Disaggregated prefill workers.
    pub prefill: usize,
    /// Disaggregated decode workers.
    pub decode: usize,
    /// KV block size.
    pub block_size: u32,
    /// Cache capacity per worker, in blocks (`--num-gpu-blocks-override`).
    pub capacity_blocks: usize,
    /// How much faster than the modelled GPU the mocker runs (`--speedup-ratio`).
    pub speedup_ratio: f64,
    /// The mocker's GPU, when not Dynamo's default model.
    pub cost: Option<MockerCost>,
    /// Requests a worker runs at once and prompt tokens a pass computes (`--max-num-seqs`,
    /// `--max-num-batched-tokens`), when not the mocker's defaults (256, 8,192).
    pub batch_limits: Option<(usize, usize)>,
    /// The frontend's `--router-mode` (`kv`, `round-robin`, `direct`).
    pub router_mode: String,
    /// Workers publish vLLM's ZMQ format with a replay socket too (`--zmq-kv-events-ports`,
    /// `--zmq-replay-ports`; Dynamo relays the events to NATS), and the sidecar reads them there.
    pub zmq_events: bool,
    /// `--event-plane` / `DYN_EVENT_PLANE` for every Dynamo process: `None` (the default):
    /// Dynamo's own, ZMQ, whose publishers kvroute finds in the discovery records; or
    /// `Some("nats")` ([`DynamoOptions::on_nats`]) for what reads or drops NATS messages.
    pub event_plane: Option<String>,
    /// Discovery in etcd (Dynamo's default backend; a real etcd 3.5 is started for the fleet)
    /// instead of the file store.
    pub etcd: bool,
}

/// A linear GPU for the mocker in place of Dynamo's default model, given as the profile
/// `--planner-profile-data` reads: a prefill pass costs its new (uncached) tokens times
/// `prefill_ms_per_token`, a decode step `step_ms` whatever the batch; the mocker adds the two
/// within a pass, so a prefill slows the requests decoding beside it. Dynamo's default model
/// prices a decode step by the share of the cache in use, which on small caches outweighs a
/// prefill: a prefix hit then saves almost nothing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MockerCost {
    /// Milliseconds per prompt token computed.
    pub prefill_ms_per_token: f64,
    /// Milliseconds per decode step.
    pub step_ms: f64,
}

impl MockerCost {
    /// Write the mocker-format NPZ (with the Dynamo venv's numpy) to `dir`, once; its path.
    fn profile(&self, dir: &Path) -> Result<PathBuf> {
        let path = dir.join(format!(
            "mocker-cost-{}-{}.npz",
            self.prefill_ms_per_token, self.step_ms
        ));
        if path.exists() {
            return Ok(path);
        }
        // Two points each way: the mocker interpolates linearly and extrapolates.
        let script = "import sys, numpy as np\n\
            per_token, step = float(sys.argv[2]), float(sys.argv[3])\n\
            np.savez(sys.argv[1], prefill_isl=np.array([0.0, 1e5]), \
            prefill_ttft_ms=np.array([0.0, 1e5 * per_token]), \
            decode_active_kv_tokens=np.array([0.0, 1e7]), \
            decode_context_length=np.array([0.0, 1e6]), decode_itl=np.full((2, 2), step))\n";
        std::fs::create_dir_all(dir)?;
        let out = std::process::Command::new(paths::dynamo_python()?)
            .args(["-c", script])
            .arg(&path)
            .arg(self.prefill_ms_per_token.to_string())
            .arg(self.step_ms.to_string())
            .output()
            .context("running the Dynamo venv's python")?;
        anyhow::ensure!(
            out.status.success(),
            "writing the mocker's cost profile: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(path)
    }
}

/// Where a fleet's discovery records live.
#[derive(Debug, Clone)]
pub enum Discovery {
    /// Dynamo's file store under this root (`DYN_FILE_KV`).
    File(PathBuf),
    /// etcd at this client URL (`ETCD_ENDPOINTS`).
    Etcd(String),
}

impl Discovery {
    /// The sidecar's `[[dynamo_discovery]]` entry for `model` here, every other field at its
    /// default.
    pub fn config(&self, model: &str) -> kvroute_sidecar::config::DiscoveryConfig {
        use kvroute_sidecar::config::DiscoveryConfig;
        match self {
            Discovery::File(dir) => DiscoveryConfig::new(dir.clone(), model),
            Discovery::Etcd(url) => DiscoveryConfig::etcd(vec![url.clone()], model),
        }
    }

    /// Every record now, as the sidecar reads them.
    pub async fn records(&self) -> Result<discovery::Records> {
        let http = reqwest::Client::new();
        discovery::Store::of(&self.config(MODEL)).read(&http).await
    }
}

impl Default for DynamoOptions {
    fn default() -> Self {
        DynamoOptions {
            aggregated: 2,
            prefill: 0,
            decode: 0,
            block_size: 16,
            capacity_blocks: 1024,
            speedup_ratio: 10.0,
            cost: None,
            batch_limits: None,
            router_mode: "kv".into(),
            zmq_events: false,
            // Dynamo's own defaults: ZMQ events, etcd discovery.
            event_plane: None,
            etcd: true,
        }
    }
}

impl DynamoOptions {
    /// A fleet on NATS (`--event-plane nats`) with file discovery: for the tests that lose
    /// NATS messages on purpose or compare NATS copies.
    pub fn on_nats() -> Self {
        DynamoOptions {
            event_plane: Some("nats".into()),
            etcd: false,
            ..DynamoOptions::default()
        }
    }
}

/// The running fleet's facts.
pub struct DynamoFleet {
    /// The frontend's `127.0.0.1:port`.
    pub frontend: String,
    /// The workers kvroute pins to (aggregated or prefill), as their discovery records say;
    /// `index` is the `dynamo-worker-<index>` process.
    pub engines: Vec<EngineInfo>,
    /// The decode workers' instance ids.
    pub decode_ids: Vec<u64>,
    /// Where its discovery records live.
    pub discovery: Discovery,
}

/// The environment every Dynamo process gets: the stack's NATS, its discovery, the event plane
/// `opts` asks for (none: Dynamo's default), every listener on loopback.
fn dynamo_env(cmd: &mut Command, opts: &DynamoOptions, nats_url: &str, discovery: &Discovery) {
    match &opts.event_plane {
        Some(plane) => cmd.env("DYN_EVENT_PLANE", plane),
        None => cmd.env_remove("DYN_EVENT_PLANE"),
    };
    match discovery {
        Discovery::File(dir) => cmd
            .env("DYN_DISCOVERY_BACKEND", "file")
            .env("DYN_FILE_KV", dir)
            .env_remove("ETCD_ENDPOINTS"),
        Discovery::Etcd(url) => cmd
            .env("DYN_DISCOVERY_BACKEND", "etcd")
            .env("ETCD_ENDPOINTS", url)
            .env_remove("DYN_FILE_KV"),
    };
    cmd.env("NATS_SERVER", nats_url)
        .env("DYN_REQUEST_PLANE", "tcp")
        .env("DYN_TCP_RPC_HOST", "127.0.0.1")
        .env("DYN_TCP_RESPONSE_STREAM_HOST", "127.0.0.1")
        .env("DYN_EVENT_PLANE_HOST", "127.0.0.1")
        .env("DYN_SYSTEM_HOST", "127.0.0.1")
        .env("DYN_LOG", "info")
        .env("HF_HUB_OFFLINE", "1");
}

/// A mocker worker in `role` (`agg`, `prefill`, `decode`) whose request plane listens on
/// `127.0.0.1:port`, publishing vLLM's ZMQ format on `zmq` (events, replay) ports if given;
/// its cost profile, if any, is written to `dir`.
pub fn worker_command(
    opts: &DynamoOptions,
    role: &str,
    port: u16,
    zmq: Option<(u16, u16)>,
    nats_url: &str,
    discovery: &Discovery,
    dir: &Path,
) -> Result<Command> {
    let mut cmd = Command::new(paths::dynamo_python()?);
    cmd.args(["-m", "dynamo.mocker", "--model-path"])
        .arg(paths::model_dir())
        .args(["--model-name", MODEL])
        .args([
            "--discovery-backend",
            backend(discovery),
            "--request-plane",
            "tcp",
        ])
        .args(event_plane_args(opts))
        .args(["--block-size", &opts.block_size.to_string()])
        .args([
            "--num-gpu-blocks-override",
            &opts.capacity_blocks.to_string(),
        ])
        .args(["--speedup-ratio", &opts.speedup_ratio.to_string()])
        .args(["--disaggregation-mode", role]);
    if let Some(cost) = &opts.cost {
        cmd.arg("--planner-profile-data").arg(cost.profile(dir)?);
    }
    if let Some((seqs, tokens)) = opts.batch_limits {
        cmd.args(["--max-num-seqs", &seqs.to_string()])
            .args(["--max-num-batched-tokens", &tokens.to_string()]);
    }
    if let Some((events, replay)) = zmq {
        cmd.args(["--zmq-kv-events-ports", &events.to_string()])
            .args(["--zmq-replay-ports", &replay.to_string()]);
    }
    dynamo_env(&mut cmd, opts, nats_url, discovery);
    cmd.env("DYN_TCP_RPC_PORT", port.to_string());
    Ok(cmd)
}

fn backend(discovery: &Discovery) -> &'static str {
    match discovery {
        Discovery::File(_) => "file",
        Discovery::Etcd(_) => "etcd",
    }
}

/// A real etcd 3.5 on loopback for a fleet's discovery (data in `dir/etcd`); its client URL.
pub async fn start_etcd(dir: &Path, processes: &mut Vec<Process>) -> Result<String> {
    let (client, peer) = (free_port()?, free_port()?);
    let client_url = format!("http://127.0.0.1:{client}");
    let peer_url = format!("http://127.0.0.1:{peer}");
    let mut cmd = Command::new(paths::venv_tool("etcd")?);
    cmd.args(["--name", "kvroute", "--data-dir"])
        .arg(dir.join("etcd"))
        .args(["--listen-client-urls", &client_url])
        .args(["--advertise-client-urls", &client_url])
        .args(["--listen-peer-urls", &peer_url])
        .args(["--initial-advertise-peer-urls", &peer_url])
        .args(["--initial-cluster", &format!("kvroute={peer_url}")])
        .args(["--log-level", "warn"]);
    processes.push(Process::spawn("etcd", cmd, dir)?);
    let http = reqwest::Client::new();
    let (health, http) = (&format!("{client_url}/health"), &http);
    wait_for("etcd /health", Duration::from_secs(30), || async move {
        let text = crate::client::get_text(http, health).await?;
        text.contains("true").then_some(())
    })
    .await
    .with_context(|| tail_of(processes, "etcd"))?;
    Ok(client_url)
}

/// `--event-plane <plane>`, or nothing for Dynamo's default.
fn event_plane_args(opts: &DynamoOptions) -> Vec<String> {
    match &opts.event_plane {
        Some(plane) => vec!["--event-plane".into(), plane.clone()],
        None => Vec::new(),
    }
}

/// Start the workers (logs in `dir`, file discovery under `discovery`), wait until each has
/// registered, then the frontend, and wait until it serves the model.
pub async fn start(
    opts: &DynamoOptions,
    nats_url: &str,
    dir: &Path,
    discovery: &Path,
    processes: &mut Vec<Process>,
) -> Result<DynamoFleet> {
    std::fs::create_dir_all(discovery)?;
    let discovery = match opts.etcd {
        true => Discovery::Etcd(start_etcd(dir, processes).await?),
        false => Discovery::File(discovery.to_path_buf()),
    };
    let discovery = &discovery;
    let roles = std::iter::repeat_n("agg", opts.aggregated)
        .chain(std::iter::repeat_n("prefill", opts.prefill))
        .chain(std::iter::repeat_n("decode", opts.decode));
    // Worker i listens on ports[i]: its discovery record's address says which process it is.
    let mut ports = Vec::new();
    let mut zmq_ports = Vec::new();
    for (i, role) in roles.enumerate() {
        let port = free_port()?;
        // Decode workers publish no KV events.
        let zmq = match opts.zmq_events && role != "decode" {
            true => Some((free_port()?, free_port()?)),
            false => None,
        };
        let cmd = worker_command(opts, role, port, zmq, nats_url, discovery, dir)?;
        processes.push(Process::spawn(&format!("dynamo-worker-{i}"), cmd, dir)?);
        ports.push(format!("127.0.0.1:{port}"));
        zmq_ports.push(zmq);
    }
    let config = discovery.config(MODEL);
    let wanted = opts.aggregated + opts.prefill + opts.decode;
    let config_ref = &config;
    let http = reqwest::Client::new();
    let http = &http;
    let scan = wait_for(
        "every Dynamo worker's discovery record",
        Duration::from_secs(120),
        || async move {
            let records = discovery::Store::of(config_ref).read(http).await.ok()?;
            let scan = discovery::scan(&records, config_ref);
            (scan.instances.len() >= wanted).then_some(scan)
        },
    )
    .await
    .with_context(|| tail_of(processes, "dynamo-worker-0"))?;

    let port = free_port()?;
    let mut cmd = Command::new(paths::dynamo_python()?);
    cmd.args(["-m", "dynamo.frontend", "--http-host", "127.0.0.1"])
        .args(["--http-port", &port.to_string()])
        .args(["--router-mode", &opts.router_mode])
        .args([
            "--discovery-backend",
            backend(discovery),
            "--request-plane",
            "tcp",
        ])
        .args(event_plane_args(opts))
        .args(["--kv-cache-block-size", &opts.block_size.to_string()]);
    dynamo_env(&mut cmd, opts, nats_url, discovery);
    processes.push(Process::spawn("dynamo-frontend", cmd, dir)?);
    let frontend = format!("127.0.0.1:{port}");
    let models = &format!("http://{frontend}/v1/models");
    wait_for(
        "the Dynamo frontend to serve the model",
        Duration::from_secs(120),
        || async move {
            let text = crate::client::get_text(http, models).await?;
            text.contains(MODEL).then_some(())
        },
    )
    .await
    .with_context(|| tail_of(processes, "dynamo-frontend"))?;

    let mut engines = Vec::new();
    let mut decode_ids = Vec::new();
    for (i, address) in ports.iter().enumerate() {
        let (&id, instance) = scan
            .instances
            .iter()
            .find(|(_, instance)| &instance.address == address)
            .with_context(|| format!("no discovery record for dynamo-worker-{i} at {address}"))?;
        if instance.role == Role::Decode {
            decode_ids.push(id);
        } else {
            let endpoint = |port: u16| format!("tcp://127.0.0.1:{port}");
            engines.push(EngineInfo {
                index: i,
                address: address.clone(),
                dynamo_worker_id: id,
                zmq_endpoint: zmq_ports[i].map(|(events, _)| endpoint(events)),
                replay_endpoint: zmq_ports[i].map(|(_, replay)| endpoint(replay)),
            });
        }
    }
    Ok(DynamoFleet {
        frontend,
        engines,
        decode_ids,
        discovery: discovery.clone(),
    })
}

fn tail_of(processes: &[Process], name: &str) -> String {
    processes
        .iter()
        .find(|p| p.name() == name)
        .map(Process::log_tail)
        .unwrap_or_default()
}
