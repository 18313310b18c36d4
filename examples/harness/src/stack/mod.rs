//! A whole fleet for one routing mode: NATS, the engines (simulated, real Dynamo or vLLM), the
//! sidecar and Envoy — and, on a replica plane, more sidecar + Envoy pairs. One file per thing
//! started: `nats.rs`, `sim.rs` (real engines: `crate::dynamo`, `crate::vllm`), `sidecar.rs`,
//! `envoy.rs`; what to start in `options.rs`; what a running stack says in `read.rs`. Here: the
//! order things start in, and what tests do to a running stack (kill, restart, signal, change
//! its membership).

mod envoy;
mod nats;
mod options;
mod read;
mod sidecar;
mod sim;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context as _, Result};

use crate::dynamo::Discovery;
pub use crate::engines::{EngineInfo, MODEL};
use crate::lossy_nats::LossyNats;
use crate::paths;
use crate::process::{free_port, wait_for, Process};
use crate::vllm::VllmOptions;
use envoy::spawn_envoy;
pub use envoy::{render_envoy, write_eds, BootstrapFn, EnvoyInputs, SidecarAddress};
use nats::event_proxy;
pub(crate) use nats::start_nats;
pub use options::{Fallback, Mode, ReplicaOptions, SimOptions, StackOptions, TransportLoss};
pub use read::{quantile_between, Bucket};
use sidecar::{sidecar_text, start_sidecar, SidecarPlace};
use sim::start_sim;

/// The filter's shipped `stream_usage_every` (filter/src/config.rs): one stream in this many has
/// its usage read. Stacks read every stream unless their `filter_extra` says otherwise.
pub const SHIPPED_STREAM_USAGE_EVERY: u32 = 32;

/// What the sidecar logs once its NATS subscriptions are in place.
pub const SIDECAR_SUBSCRIBED: &str = "subscribed to Dynamo KV events";

/// One sidecar + Envoy pair of a stack.
#[derive(Debug, Clone)]
pub struct Replica {
    /// Envoy's listener.
    pub envoy_url: String,
    /// Envoy's admin endpoint.
    pub admin_url: String,
    /// The sidecar's API.
    pub sidecar_url: String,
}

/// A running fleet. Every process is killed when it is dropped.
pub struct Stack {
    /// Its directory (configs and logs).
    pub dir: PathBuf,
    /// The routing mode.
    pub mode: Mode,
    /// The engines.
    pub engines: Vec<EngineInfo>,
    /// Envoy's listener, `http://127.0.0.1:port`.
    pub envoy_url: String,
    /// Envoy's admin endpoint.
    pub admin_url: String,
    /// The sidecar's API (kvroute and ring_hash modes).
    pub sidecar_url: Option<String>,
    /// Pin mode: the Dynamo frontend (real or the simulator's stand-in) Envoy sends to.
    pub frontend: Option<String>,
    /// Real Dynamo, disaggregated: the decode workers' instance ids.
    pub decode_ids: Vec<u64>,
    /// The stack's NATS server, `nats://127.0.0.1:port`.
    pub nats_url: String,
    /// HTTP client for the stack's endpoints.
    pub http: reqwest::Client,
    /// Every sidecar + Envoy pair, the stack's own first (one without
    /// [`StackOptions::replicas`]; none in round-robin mode).
    pub replicas: Vec<Replica>,
    /// Where the Dynamo fleet's discovery records live (in pin mode; `dir/discovery` otherwise).
    pub discovery: Discovery,
    /// Real vLLM engines: how they were started (to start one again).
    vllm: Option<VllmOptions>,
    /// How the stack was started (to add simulated engines).
    options: StackOptions,
    /// The EDS file's version ([`StackOptions::eds_membership`]).
    eds_version: u64,
    processes: Vec<Process>,
    /// [`StackOptions::transport_loss`]: each sidecar's proxy, in sidecar order; they live as
    /// long as the stack.
    proxies: Vec<LossyNats>,
}

impl Stack {
    /// Start NATS, the engines, the sidecar (unless round robin) and Envoy; wait until each is
    /// ready and, for the filter modes, until every Envoy VM has loaded the model bundle.
    pub async fn start(opts: StackOptions) -> Result<Stack> {
        let dir = paths::run_dir(&opts.name)?;
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            .build()?;
        let mut processes = Vec::new();

        let nats_port = free_port()?;
        processes.push(start_nats(nats_port, &dir).await?);
        let nats_url = format!("nats://127.0.0.1:{nats_port}");

        let discovery = dir.join("discovery");
        let pin_mode = opts.pin_mode();
        if opts.eds_membership && opts.pin_mode() {
            bail!("eds_membership is for engines publishing vLLM's format (simulated or real)");
        }
        if opts.eds_membership && opts.vllm.as_ref().is_some_and(|v| !v.zmq_beside) {
            bail!("eds_membership with real vLLM needs VllmOptions::zmq_beside");
        }
        let mut dynamo_discovery = None;
        let (engines, frontend, decode_ids) = match (&opts.dynamo, &opts.vllm) {
            (Some(d), _) => {
                let fleet =
                    crate::dynamo::start(d, &nats_url, &dir, &discovery, &mut processes).await?;
                dynamo_discovery = Some(fleet.discovery);
                (fleet.engines, Some(fleet.frontend), fleet.decode_ids)
            }
            (None, Some(v)) => {
                let engines = crate::vllm::start(v, &dir, &mut processes).await?;
                (engines, None, Vec::new())
            }
            (None, None) => {
                let (engines, frontend) = start_sim(
                    &opts,
                    &nats_url,
                    &dir,
                    &discovery,
                    ("sim", 0),
                    &mut processes,
                )?;
                (engines, frontend, Vec::new())
            }
        };
        let discovery = dynamo_discovery.unwrap_or(Discovery::File(discovery));
        // What Envoy's `workers` cluster lists: the engines, or in pin mode the frontend.
        let upstreams: Vec<String> = match (&frontend, pin_mode) {
            (Some(frontend), true) => vec![frontend.clone()],
            (None, true) => bail!("the simulator did not start its frontend"),
            _ => engines.iter().map(|e| e.address.clone()).collect(),
        };

        let sidecar_port = free_port()?;
        let (listen, admin) = (free_port()?, free_port()?);
        let mut proxies = Vec::new();
        let sidecar_url = if opts.mode == Mode::RoundRobin {
            None
        } else {
            let events_url = match event_proxy(&opts, &nats_url, 0).await? {
                Some(proxy) => {
                    let url = proxy.url();
                    proxies.push(proxy);
                    url
                }
                None => nats_url.clone(),
            };
            let place = SidecarPlace {
                replica: 0,
                port: sidecar_port,
                unix_socket: opts.sidecar_uds.then(|| dir.join("sidecar.sock")),
                admin,
                events_url: &events_url,
            };
            let text = sidecar_text(&opts, &engines, &nats_url, &place, &discovery)?;
            std::fs::write(dir.join("sidecar.toml"), text)?;
            let url = format!("http://127.0.0.1:{sidecar_port}");
            processes.push(start_sidecar(&dir, "sidecar", &url, &http).await?);
            Some(url)
        };

        if opts.eds_membership {
            write_eds(&dir, 0, &upstreams)?;
        }
        let envoy_config = dir.join("envoy.yaml");
        let sidecar = if opts.sidecar_uds {
            SidecarAddress::Unix(dir.join("sidecar.sock"))
        } else {
            SidecarAddress::Tcp(sidecar_port)
        };
        std::fs::write(
            &envoy_config,
            render_envoy(&opts, &dir, &upstreams, listen, admin, &sidecar)?,
        )?;
        processes.push(spawn_envoy(&opts, &envoy_config, &dir, "envoy")?);
        let admin_url = format!("http://127.0.0.1:{admin}");
        let replicas = sidecar_url
            .iter()
            .map(|s| Replica {
                envoy_url: format!("http://127.0.0.1:{listen}"),
                admin_url: admin_url.clone(),
                sidecar_url: s.clone(),
            })
            .collect();
        let mut stack = Stack {
            dir,
            mode: opts.mode,
            engines,
            envoy_url: format!("http://127.0.0.1:{listen}"),
            admin_url,
            sidecar_url,
            frontend,
            decode_ids,
            nats_url,
            http,
            replicas,
            vllm: opts.vllm.clone(),
            discovery,
            options: opts.clone(),
            eds_version: 0,
            processes,
            proxies,
        };
        let (ready, http) = (&format!("{}/ready", stack.admin_url), &stack.http);
        let live = wait_for("envoy /ready", Duration::from_secs(60), || async move {
            let r = http.get(ready).send().await.ok()?;
            r.status().is_success().then_some(())
        })
        .await;
        stack.with_envoy_log(live)?;
        // A module in place of the filter's loads no bundle.
        if opts.mode != Mode::RoundRobin && opts.filter_wasm.is_none() {
            let loaded = stack.wait_bundles(&opts, &stack.admin_url.clone()).await;
            stack.with_envoy_log(loaded)?;
        }
        if let Some(r) = opts
            .replicas
            .as_ref()
            .filter(|_| opts.mode != Mode::RoundRobin)
        {
            for i in 1..r.count {
                stack.start_replica(&opts, &upstreams, i).await?;
            }
        }
        // Envoy lists every upstream, and the sidecar hints only workers it has seen Envoy
        // (or, in pin mode, Dynamo discovery) call usable.
        let (engines, upstreams) = (stack.engines.len() as u64, upstreams.len() as u64);
        let stack_ref = &stack;
        let stat = &format!("cluster.{}.membership_healthy", opts.workers_cluster);
        let healthy = wait_for(
            "Envoy to find every engine healthy",
            Duration::from_secs(30),
            || async move {
                let n = stack_ref.envoy_stat(stat).await?;
                if n < upstreams {
                    return None;
                }
                for r in &stack_ref.replicas {
                    let url = format!("{}/metrics", r.sidecar_url);
                    let text = crate::client::get_text(&stack_ref.http, &url).await?;
                    let usable = crate::prometheus::series(&text, "kvroute_worker_usable{")
                        .filter(|(_, v)| *v == 1.0)
                        .count() as u64;
                    if usable < engines {
                        return None;
                    }
                }
                Some(())
            },
        )
        .await;
        stack.with_envoy_log(healthy)?;
        stack.check_alive()?;
        Ok(stack)
    }

    /// Wait until every VM of the Envoy at `admin_url` has loaded the model bundle.
    async fn wait_bundles(&self, opts: &StackOptions, admin_url: &str) -> Result<()> {
        // One VM per worker thread plus the main thread's.
        let vms = opts.envoy_concurrency as u64 + 1;
        wait_for(
            "every Envoy VM to load the bundle",
            Duration::from_secs(60),
            || async move {
                let n = self
                    .envoy_stat_at(admin_url, "wasmcustom.kvroute.bundles.loaded")
                    .await?;
                (n >= vms).then_some(())
            },
        )
        .await
    }

    /// Start sidecar + Envoy pair `i` beside the stack's own, in `replica-<i>/` (with
    /// [`StackOptions::shared_sidecar`], only the Envoy, asking the stack's sidecar).
    async fn start_replica(
        &mut self,
        opts: &StackOptions,
        upstreams: &[String],
        i: usize,
    ) -> Result<()> {
        let dir = self.dir.join(format!("replica-{i}"));
        std::fs::create_dir_all(&dir)?;
        let (listen, admin) = (free_port()?, free_port()?);
        let (port, sidecar_url) = if opts.shared_sidecar {
            let url = self
                .sidecar_url
                .clone()
                .context("a shared sidecar needs the stack's own")?;
            let port = url
                .rsplit(':')
                .next()
                .and_then(|p| p.parse().ok())
                .with_context(|| format!("no port in {url}"))?;
            (port, url)
        } else {
            let port = free_port()?;
            let events_url = match event_proxy(opts, &self.nats_url, i).await? {
                Some(proxy) => {
                    let url = proxy.url();
                    self.proxies.push(proxy);
                    url
                }
                None => self.nats_url.clone(),
            };
            let place = SidecarPlace {
                replica: i,
                port,
                unix_socket: None,
                admin,
                events_url: &events_url,
            };
            let text = sidecar_text(opts, &self.engines, &self.nats_url, &place, &self.discovery)?;
            std::fs::write(dir.join("sidecar.toml"), text)?;
            let sidecar_url = format!("http://127.0.0.1:{port}");
            let sidecar =
                start_sidecar(&dir, &format!("sidecar-{i}"), &sidecar_url, &self.http).await?;
            self.processes.push(sidecar);
            (port, sidecar_url)
        };
        let config = dir.join("envoy.yaml");
        std::fs::write(
            &config,
            render_envoy(
                opts,
                &self.dir,
                upstreams,
                listen,
                admin,
                &SidecarAddress::Tcp(port),
            )?,
        )?;
        let name = format!("envoy-{i}");
        self.processes
            .push(spawn_envoy(opts, &config, &dir, &name)?);
        let admin_url = format!("http://127.0.0.1:{admin}");
        let (ready, http) = (&format!("{admin_url}/ready"), &self.http);
        wait_for("envoy /ready", Duration::from_secs(60), || async move {
            let r = http.get(ready).send().await.ok()?;
            r.status().is_success().then_some(())
        })
        .await
        .map_err(|e| anyhow::anyhow!("{e}: {}", self.log_tail(&name)))?;
        self.wait_bundles(opts, &admin_url).await?;
        self.replicas.push(Replica {
            envoy_url: format!("http://127.0.0.1:{listen}"),
            admin_url,
            sidecar_url,
        });
        Ok(())
    }

    /// Add the end of Envoy's log to a failed start-up step.
    fn with_envoy_log<T>(&self, step: Result<T>) -> Result<T> {
        step.map_err(|e| anyhow::anyhow!("{e}: {}", self.log_tail("envoy")))
    }

    /// Fail if any process has exited.
    pub fn check_alive(&mut self) -> Result<()> {
        for p in &mut self.processes {
            if !p.is_running() {
                bail!("{} exited: {}", p.name(), p.log_tail());
            }
        }
        Ok(())
    }

    /// Kill one process (`nats`, `sim`, `sidecar`, `envoy`) and forget it.
    pub fn kill(&mut self, name: &str) {
        self.processes.retain_mut(|p| {
            if p.name() == name {
                p.kill();
                false
            } else {
                true
            }
        });
    }

    /// Kill the sidecar and start a new one with the same configuration, as a crashed or
    /// upgraded sidecar comes back: its index starts empty.
    pub async fn restart_sidecar(&mut self) -> Result<()> {
        let url = self
            .sidecar_url
            .clone()
            .context("no sidecar in this stack")?;
        self.kill("sidecar");
        let sidecar = start_sidecar(&self.dir, "sidecar", &url, &self.http).await?;
        self.processes.push(sidecar);
        Ok(())
    }

    /// Start nats-server again on its port (after [`Stack::kill`]`("nats")`), with nothing
    /// of what it held: clients reconnect by themselves.
    pub async fn restart_nats(&mut self) -> Result<()> {
        let port: u16 = self
            .nats_url
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .context("the stack's NATS URL has no port")?;
        self.kill("nats");
        let nats = start_nats(port, &self.dir).await?;
        self.processes.push(nats);
        Ok(())
    }

    /// [`StackOptions::transport_loss`]: sidecar `replica` (0: the stack's own) loses this
    /// share of its KV-event messages from now on (1.0: it is cut off from them).
    pub fn set_transport_loss(&self, replica: usize, loss: f64) -> Result<()> {
        self.proxies
            .get(replica)
            .context("no lossy transport for that sidecar")?
            .set_loss(loss);
        Ok(())
    }

    /// Kill the sidecar of replica `i` (1…: not the stack's own) and start it again on its
    /// configuration as `edit` changes it: a replica redeployed with another setting.
    pub async fn restart_replica_sidecar(
        &mut self,
        i: usize,
        edit: impl FnOnce(String) -> String,
    ) -> Result<()> {
        let url = self
            .replicas
            .get(i)
            .filter(|_| i > 0)
            .context("no such replica")?
            .sidecar_url
            .clone();
        let dir = self.dir.join(format!("replica-{i}"));
        let name = format!("sidecar-{i}");
        self.kill(&name);
        let path = dir.join("sidecar.toml");
        std::fs::write(&path, edit(std::fs::read_to_string(&path)?))?;
        let sidecar = start_sidecar(&dir, &name, &url, &self.http).await?;
        self.processes.push(sidecar);
        Ok(())
    }

    /// [`StackOptions::eds_membership`]: make Envoy's `workers` cluster list these engines, as
    /// a control plane pushing EDS would (Envoy reloads the file within moments).
    pub fn set_members(&mut self, engines: &[usize]) -> Result<()> {
        let upstreams: Vec<String> = engines
            .iter()
            .map(|&i| {
                Ok(self
                    .engines
                    .get(i)
                    .context("no such engine")?
                    .address
                    .clone())
            })
            .collect::<Result<_>>()?;
        self.eds_version += 1;
        write_eds(&self.dir, self.eds_version, &upstreams)
    }

    /// Start one more simulated engine (a process of its own, `sim-<index>`, configured as the
    /// stack's); its index. Envoy does not list it until [`Stack::set_members`] says so.
    pub fn add_sim_engine(&mut self) -> Result<usize> {
        let index = self.engines.len();
        let mut opts = self.options.clone();
        opts.sim.engines = 1;
        let discovery = self.dir.join("discovery");
        let name = format!("sim-{index}");
        let (mut engines, _) = start_sim(
            &opts,
            &self.nats_url,
            &self.dir,
            &discovery,
            (&name, index),
            &mut self.processes,
        )?;
        let engine = engines.pop().context("the simulator started no engine")?;
        self.engines.push(engine);
        Ok(index)
    }

    /// Real vLLM: start engine `index` again on its ports (after [`Stack::kill`] or
    /// [`Stack::signal`] stopped it) and wait until it serves.
    pub async fn start_vllm_engine(&mut self, index: usize) -> Result<()> {
        let opts = self.vllm.clone().context("no vLLM engines in this stack")?;
        let engine = self.engines.get(index).context("no such engine")?.clone();
        let name = crate::vllm::process_name(index);
        self.kill(&name);
        let mut process = crate::vllm::spawn(&opts, &engine, &self.dir)?;
        let ready = crate::vllm::wait_ready(&engine, &mut process, &self.http).await;
        self.processes.push(process);
        ready
    }

    /// Real Dynamo, aggregated: start engine `index`'s worker again (after [`Stack::kill`] of
    /// `dynamo-worker-<index>`) as a restarted pod comes back — a new process on a new port, a
    /// new instance id — and wait until its discovery records (the instance and its `kv-events`
    /// publisher) are in place. `engines[index]` becomes the new worker.
    pub async fn start_dynamo_worker(&mut self, index: usize) -> Result<EngineInfo> {
        let opts = self
            .options
            .dynamo
            .clone()
            .context("no Dynamo fleet in this stack")?;
        let name = format!("dynamo-worker-{index}");
        self.kill(&name);
        let port = free_port()?;
        let cmd = crate::dynamo::worker_command(
            &opts,
            "agg",
            port,
            None,
            &self.nats_url,
            &self.discovery,
            &self.dir,
        )?;
        self.processes.push(Process::spawn(&name, cmd, &self.dir)?);
        let address = format!("127.0.0.1:{port}");
        let (discovery, address_ref) = (&self.discovery, &address);
        let config = discovery.config(MODEL);
        let config = &config;
        let id = wait_for(
            "the restarted Dynamo worker's discovery records",
            Duration::from_secs(120),
            || async move {
                let records = discovery.records().await.ok()?;
                let scan = kvroute_sidecar::observers::discovery::scan(&records, config);
                let (&id, _) = scan
                    .instances
                    .iter()
                    .find(|(_, i)| &i.address == address_ref)?;
                let publishes = scan
                    .channels
                    .values()
                    .any(|c| c.topic == "kv-events" && c.worker == Some(id));
                publishes.then_some(id)
            },
        )
        .await?;
        let engine = self.engines.get_mut(index).context("no such engine")?;
        engine.address = address;
        engine.dynamo_worker_id = id;
        Ok(engine.clone())
    }

    /// Send a signal (`STOP`, `CONT`, …) to one process, e.g. to make it hang without dying;
    /// `STOP` returns once the process has stopped.
    pub fn signal(&self, name: &str, signal: &str) -> Result<()> {
        let p = self
            .processes
            .iter()
            .find(|p| p.name() == name)
            .with_context(|| format!("no process {name}"))?;
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(p.pid().to_string())
            .status()?;
        if !status.success() {
            bail!("kill -{signal} {name} failed");
        }
        if signal == "STOP" {
            // kill returns once the signal is queued; on a loaded machine the process can run on
            // (and answer a request) for tens of milliseconds. Wait until every thread stopped.
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while !all_threads_stopped(p.pid()) {
                if std::time::Instant::now() > deadline {
                    bail!("{name} did not stop within 10 s of SIGSTOP");
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        Ok(())
    }
}

/// Whether every thread of process `pid` is stopped (state `T` in `/proc/PID/task/*/stat`).
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|task| {
        std::fs::read_to_string(task.path().join("stat")).is_ok_and(|stat| {
            // The state follows the command name, which is in parentheses and may hold spaces.
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.trim_start().chars().next())
                == Some('T')
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A running process is not stopped; one that does not exist is not either.
    #[test]
    fn only_a_stopped_process_counts_as_stopped() {
        assert!(!all_threads_stopped(std::process::id()));
        assert!(!all_threads_stopped(u32::MAX));
    }
}
