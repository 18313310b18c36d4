//! Other cache-aware routers from PyPI, started against the same engines for comparison.
//!
//! They are installed by `make bench-routing` into `.venv-peers` (kept apart from the pinned
//! test venv). A peer that is missing or does not start is reported as unavailable with the
//! reason; it never fails a benchmark run.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Result};

use crate::paths;
use crate::process::{free_port, wait_for, Process};
use crate::stack::{EngineInfo, MODEL};

/// A peer router and policy.
#[derive(Debug, Clone, Copy)]
pub struct Peer {
    /// Mode name in reports.
    pub mode: &'static str,
    /// Executable in the peers venv.
    pub program: &'static str,
    /// Leading arguments (a subcommand).
    pub subcommand: Option<&'static str>,
    /// `--policy` value.
    pub policy: &'static str,
    /// Reads the engines' vLLM ZMQ KV events (they must publish them).
    pub kv_events: bool,
}

/// The peers the routing benchmark tries.
pub const PEERS: [Peer; 4] = [
    Peer {
        mode: "sglang-router:cache_aware",
        program: "sglang-router",
        subcommand: Some("launch"),
        policy: "cache_aware",
        kv_events: false,
    },
    Peer {
        mode: "vllm-router:cache_aware",
        program: "vllm-router",
        subcommand: None,
        policy: "cache_aware",
        kv_events: false,
    },
    Peer {
        mode: "vllm-router:kv_aware",
        program: "vllm-router",
        subcommand: None,
        policy: "kv_aware",
        kv_events: true,
    },
    Peer {
        mode: "smg:cache_aware",
        program: "smg",
        subcommand: Some("launch"),
        policy: "cache_aware",
        kv_events: false,
    },
];

/// The peer whose report name is `mode`.
pub fn named(mode: &str) -> Option<&'static Peer> {
    PEERS.iter().find(|p| p.mode == mode)
}

/// The venv the peers are installed in (`KVROUTE_PEERS_VENV` overrides `.venv-peers`).
pub fn venv() -> PathBuf {
    std::env::var_os("KVROUTE_PEERS_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| paths::workspace().join(".venv-peers"))
}

impl Peer {
    /// Start the peer in front of `engines`; returns the process and its base URL.
    pub async fn start(&self, engines: &[EngineInfo], dir: &Path) -> Result<(Process, String)> {
        let program = venv().join("bin").join(self.program);
        if !program.exists() {
            bail!(
                "{} is not installed in {} (make bench-routing installs it)",
                self.program,
                venv().display()
            );
        }
        let port = free_port()?;
        let mut cmd = Command::new(program);
        if let Some(sub) = self.subcommand {
            cmd.arg(sub);
        }
        cmd.arg("--worker-urls");
        cmd.args(engines.iter().map(|e| format!("http://{}", e.address)));
        if self.kv_events {
            for e in engines {
                let (Some(events), Some(replay)) = (&e.zmq_endpoint, &e.replay_endpoint) else {
                    bail!("engine {} publishes no vLLM KV events", e.address);
                };
                let url = format!("http://{}", e.address);
                cmd.arg("--kv-event-source").arg(format!("{url}={events}"));
                cmd.arg("--kv-event-replay-source")
                    .arg(format!("{url}={replay}"));
            }
            cmd.args(["--kv-event-block-size", "16", "--kv-event-model", MODEL]);
        }
        cmd.args([
            "--policy",
            self.policy,
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
        ]);
        let name = self.mode.replace(':', "-");
        let mut process = Process::spawn(&name, cmd, dir)?;
        let url = format!("http://127.0.0.1:{port}");
        let http = reqwest::Client::new();
        let (http, health) = (&http, &format!("{url}/health"));
        let ready = wait_for(
            &format!("{} to listen", self.mode),
            Duration::from_secs(60),
            || async move {
                let r = http.get(health).send().await.ok()?;
                r.status().is_success().then_some(())
            },
        )
        .await;
        if let Err(e) = ready {
            let alive = process.is_running();
            bail!("{e} (running: {alive}): {}", process.log_tail());
        }
        Ok((process, url))
    }
}
