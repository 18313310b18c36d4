//! A whole fleet for one routing mode: NATS, simulated engines, the sidecar and Envoy.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use serde::Deserialize;

use kvroute_sidecar::config::Config;

use crate::dynamo::{Discovery, DynamoOptions};
pub use crate::engines::{EngineInfo, MODEL};

/// What the sidecar logs once its NATS subscriptions are in place.
pub const SIDECAR_SUBSCRIBED: &str = "subscribed to Dynamo KV events";
use crate::lossy_nats::{LossCounts, LossSpec, LossyNats};
use crate::paths;
use crate::process::{free_port, wait_for, Process};
use crate::vllm::VllmOptions;

/// How Envoy routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The kvroute filter with sidecar hints, ring hash as fallback.
    Kvroute,
    /// The kvroute filter setting only the fallback key: Envoy's ring hash alone.
    RingHash,
    /// Plain Envoy round robin, no filter.
    RoundRobin,
}

impl Mode {
    /// Name used in reports.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Kvroute => "kvroute",
            Mode::RingHash => "ring_hash",
            Mode::RoundRobin => "round_robin",
        }
    }
}

/// Envoy's fallback policy when there is no hint (kvroute and ring_hash modes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    /// `deploy/envoy/kvroute.yaml`.
    RingHash,
    /// `deploy/envoy/kvroute-maglev.yaml`.
    Maglev,
}

/// Settings of the simulated engines.
#[derive(Debug, Clone)]
pub struct SimOptions {
    /// Number of engines.
    pub engines: usize,
    /// KV block size.
    pub block_size: u32,
    /// Cache capacity per engine, in blocks.
    pub capacity_blocks: usize,
    /// Running requests per engine.
    pub max_running: usize,
    /// Fixed cost per request, µs.
    pub base_latency_us: u64,
    /// Prefill cost per uncached token, µs.
    pub prefill_us_per_token: u64,
    /// Decode cost per output token, µs.
    pub decode_us_per_token: u64,
    /// Default output tokens.
    pub output_tokens: u32,
    /// Answer at once without tokenizing (data-path benchmark).
    pub instant: bool,
    /// KV-event format per engine, cycled (`dynamo`, `dynamo-v12`, `vllm-map`, `vllm-array`,
    /// `none`).
    pub event_formats: Vec<String>,
    /// Dynamo component the engines publish under (`backend`; `prefill` in a disaggregated
    /// fleet).
    pub dynamo_component: String,
    /// How late engines publish their KV events, `P50,P95,MAX` ms (`kvroute-sim
    /// --event-delay-ms`); `0,0,0` at once.
    pub event_delay_ms: String,
    /// How long a request takes to reach an engine's scheduler, ms (`kvroute-sim
    /// --frontend-delay-ms`).
    pub frontend_delay_ms: u64,
    /// How late engines answer `/metrics`, ms (`kvroute-sim --metrics-delay-ms`).
    pub metrics_delay_ms: u64,
    /// Running requests share each engine's GPU a step at a time (`kvroute-sim --batching`):
    /// `Some(decode_us_per_seq)`, a step's cost per request decoding in it.
    pub batching: Option<u64>,
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions {
            engines: 4,
            block_size: 16,
            capacity_blocks: 4096,
            max_running: 8,
            base_latency_us: 1000,
            prefill_us_per_token: 40,
            decode_us_per_token: 1000,
            output_tokens: 8,
            instant: false,
            event_formats: vec!["dynamo".into()],
            dynamo_component: "backend".into(),
            event_delay_ms: "0,0,0".into(),
            frontend_delay_ms: 0,
            metrics_delay_ms: 0,
            batching: None,
        }
    }
}

/// Several sidecar + Envoy pairs in front of one fleet, as the pods of an ingress: each pair its
/// own index, fed by the same events, the sidecars on one replica plane (`[replicas]`).
#[derive(Debug, Clone)]
pub struct ReplicaOptions {
    /// Pairs (the stack's own is the first).
    pub count: usize,
    /// `[replicas] interval_ms`.
    pub interval_ms: u64,
    /// `[replicas] test_drop_events` of every sidecar: each loses this fraction of the KV-event
    /// messages, different ones, inside the product (0: the line is not written). A loss on the
    /// transport instead: [`StackOptions::transport_loss`].
    pub loss: f64,
    /// Only this replica loses messages (`None`: every one).
    pub lossy: Option<usize>,
    /// `[replicas] reconcile`.
    pub reconcile: bool,
    /// `[replicas] share_load`.
    pub share_load: bool,
    /// `[replicas] load_interval_ms`.
    pub load_interval_ms: u64,
}

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

/// What to start.
#[derive(Debug, Clone)]
pub struct StackOptions {
    /// Run-directory name.
    pub name: String,
    /// Routing mode.
    pub mode: Mode,
    /// Engines.
    pub sim: SimOptions,
    /// How long the filter waits for a hint.
    pub hint_timeout_ms: u64,
    /// Envoy worker threads.
    pub envoy_concurrency: usize,
    /// Reach the sidecar over a Unix socket instead of TCP.
    pub sidecar_uds: bool,
    /// Envoy's policy for unhinted requests.
    pub fallback: Fallback,
    /// NATS subjects the sidecar subscribes to (`None`: its defaults).
    pub nats_subjects: Option<Vec<String>>,
    /// Extra TOML tables appended to the sidecar's configuration (`[alarms]`, `[routing]`).
    pub sidecar_toml: String,
    /// Extra fields of the filter's JSON configuration (over `hints` and `hint_timeout_ms`).
    pub filter_extra: serde_json::Map<String, serde_json::Value>,
    /// Envoy's stream idle timeout.
    pub stream_idle_timeout: Duration,
    /// Pin mode: Envoy sends to the simulator's Dynamo-frontend stand-in, the sidecar finds the
    /// engines through Dynamo discovery records and hints their instance ids.
    pub dynamo_frontend: bool,
    /// Real NVIDIA Dynamo instead of the simulator: mocker workers behind a Dynamo frontend,
    /// in pin mode (`sim` is not used).
    pub dynamo: Option<DynamoOptions>,
    /// Real vLLM engines instead of the simulator (`sim` is not used).
    pub vllm: Option<VllmOptions>,
    /// More sidecar + Envoy pairs on a replica plane (kvroute mode).
    pub replicas: Option<ReplicaOptions>,
    /// Every sidecar reads its KV events through its own [`LossyNats`] proxy in front of the
    /// stack's nats-server (its `[nats] url`), losing this share of them; its replica plane
    /// (`[replicas] nats_url`) stays on the real server. `None`: straight from the server.
    pub transport_loss: Option<TransportLoss>,
    /// Test-only arrangement, not a product mode: the Envoys of [`StackOptions::replicas`] all
    /// ask the stack's one sidecar (one index for every Envoy; the upper bound of what separate
    /// replicas can reach). The replicas' `sidecar_url` is then the same for all.
    pub shared_sidecar: bool,
    /// Envoy's outlier `base_ejection_time` in seconds, in place of the shipped configuration's
    /// 30 (tests of what happens when an ejection ends).
    pub ejection_s: Option<u64>,
    /// A fleet under a control plane: Envoy's `workers` cluster reads an EDS file
    /// ([`Stack::set_members`]), and the sidecar takes its workers from Envoy's membership
    /// (`[[envoy.members]]`, events at `{port+1}`, replay at `{port+2}`) instead of
    /// `[[workers]]` and `[[zmq]]`. Engines publishing vLLM's format: simulated, or real vLLM
    /// with [`crate::vllm::VllmOptions::zmq_beside`].
    pub eds_membership: bool,
    /// Envoy's configuration built by this function instead of from a shipped template: a
    /// bootstrap assembled the way a control plane would apply `deploy/`'s patches.
    pub envoy_bootstrap: Option<BootstrapFn>,
    /// The name of Envoy's cluster of engines (`workers` in the shipped templates).
    pub workers_cluster: String,
}

/// Builds an Envoy bootstrap (YAML or JSON text) from what the stack started.
pub type BootstrapFn = fn(&EnvoyInputs) -> Result<String>;

/// What the stack gives a [`BootstrapFn`].
#[derive(Debug, Clone)]
pub struct EnvoyInputs {
    /// The listener's port, on 127.0.0.1.
    pub listen: u16,
    /// The admin port, on 127.0.0.1.
    pub admin: u16,
    /// The engines (or frontends): `ip:port`.
    pub upstreams: Vec<std::net::SocketAddr>,
    /// The sidecar's port on 127.0.0.1 (TCP only).
    pub sidecar_port: u16,
    /// The filter's configuration as the stack would pass it.
    pub filter_config: serde_json::Value,
    /// The filter module.
    pub wasm: PathBuf,
}

/// A lossy transport between the nats-server and each sidecar ([`StackOptions::transport_loss`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TransportLoss {
    /// Share of the KV-event messages (subjects containing `kv-events`) each sidecar loses
    /// (0.0: every one passes, through the proxy all the same).
    pub loss: f64,
    /// Seed of sidecar 0's proxy; sidecar `i`'s is `seed + i * 1_000_003`, so each loses other
    /// messages.
    pub seed: u64,
}

impl TransportLoss {
    /// The proxy of sidecar `replica`.
    fn spec(&self, replica: usize) -> LossSpec {
        LossSpec {
            loss: self.loss,
            seed: self
                .seed
                .wrapping_add((replica as u64).wrapping_mul(1_000_003)),
            subject_contains: kvroute_protocol::dynamo::KV_EVENTS_TOPIC.into(),
        }
    }
}

impl StackOptions {
    /// Defaults for `mode`, with run directory `name`.
    pub fn new(name: &str, mode: Mode) -> Self {
        StackOptions {
            name: name.to_owned(),
            mode,
            sim: SimOptions::default(),
            hint_timeout_ms: 200,
            envoy_concurrency: 2,
            sidecar_uds: false,
            fallback: Fallback::RingHash,
            nats_subjects: None,
            sidecar_toml: String::new(),
            filter_extra: serde_json::Map::new(),
            stream_idle_timeout: kvroute_sidecar::envoy_config::STREAM_IDLE_TIMEOUT,
            dynamo_frontend: false,
            dynamo: None,
            vllm: None,
            replicas: None,
            transport_loss: None,
            shared_sidecar: false,
            ejection_s: None,
            eds_membership: false,
            envoy_bootstrap: None,
            workers_cluster: "workers".into(),
        }
    }

    /// The engines' KV block size.
    pub fn block_size(&self) -> u32 {
        match (&self.dynamo, &self.vllm) {
            (Some(d), _) => d.block_size,
            (None, Some(_)) => crate::vllm::BLOCK_SIZE,
            (None, None) => self.sim.block_size,
        }
    }

    /// Whether the sidecar finds the engines through Dynamo discovery (a real Dynamo fleet, or
    /// the simulator's frontend stand-in) instead of `[[workers]]`.
    pub fn pin_mode(&self) -> bool {
        self.dynamo_frontend || self.dynamo.is_some()
    }
}

#[derive(Deserialize)]
struct SimReady {
    engines: Vec<EngineInfo>,
    /// The Dynamo-frontend stand-in (`--frontend`).
    #[serde(default)]
    frontend: Option<String>,
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

/// How Envoy reaches the sidecar.
#[derive(Debug, Clone)]
pub enum SidecarAddress {
    /// TCP on 127.0.0.1.
    Tcp(u16),
    /// A Unix socket (Envoy `pipe` address).
    Unix(PathBuf),
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
        if opts.mode != Mode::RoundRobin {
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

    /// The last lines of a process's log.
    pub fn log_tail(&self, name: &str) -> String {
        self.processes
            .iter()
            .find(|p| p.name() == name)
            .map(Process::log_tail)
            .unwrap_or_default()
    }

    /// [`StackOptions::transport_loss`]: the KV-event messages each sidecar's proxy forwarded and
    /// dropped so far, in sidecar order (empty without it).
    pub fn transport_counts(&self) -> Vec<LossCounts> {
        self.proxies.iter().map(LossyNats::counts).collect()
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

    /// Write the sidecar's last decisions (`/debug/explain`) into the run directory, to see
    /// why requests went where; nothing without a sidecar.
    pub async fn save_explain(&self) -> Result<()> {
        let Some(url) = &self.sidecar_url else {
            return Ok(());
        };
        if let Ok(r) = self.http.get(format!("{url}/debug/explain")).send().await {
            std::fs::write(
                self.dir.join("explain.json"),
                r.bytes().await.unwrap_or_default(),
            )?;
        }
        Ok(())
    }

    /// Prompt tokens the sidecar's hints said their workers held
    /// (`kvroute_hint_matched_blocks_total` × block size): against the engines' cached tokens,
    /// how much the index over-predicted. `None` without a sidecar.
    pub async fn hinted_match_tokens(&self, block_size: u32) -> Option<u64> {
        self.sidecar_url.as_ref()?;
        let metrics = self.sidecar_metrics().await.ok()?;
        let blocks = crate::prometheus::sum(&metrics, "kvroute_hint_matched_blocks");
        Some(blocks as u64 * u64::from(block_size))
    }

    /// What the sidecar's hints predicted against what the engines reported, over the hinted
    /// requests whose usage gave cached tokens: predictions `exact` (within a block), `over`,
    /// `under`, and the predicted, cached and prompt tokens. `None` without a sidecar.
    pub async fn predictions(&self) -> Option<serde_json::Value> {
        self.sidecar_url.as_ref()?;
        let m = self.sidecar_metrics().await.ok()?;
        let sum = |family: &str| crate::prometheus::sum(&m, family);
        let outcome = |o: &str| {
            crate::prometheus::sum_where(&m, |l| {
                l.starts_with("kvroute_predictions_total{")
                    && l.contains(&format!("outcome=\"{o}\""))
            })
        };
        Some(serde_json::json!({
            "exact": outcome("exact"),
            "over": outcome("over"),
            "under": outcome("under"),
            "predicted_tokens": sum("kvroute_predicted_cached_tokens_total"),
            "cached_tokens": sum("kvroute_actual_cached_tokens_total"),
            "prompt_tokens": sum("kvroute_served_prompt_tokens_total"),
        }))
    }

    /// Envoy's process id (for CPU accounting).
    pub fn envoy_pid(&self) -> Option<u32> {
        self.processes
            .iter()
            .find(|p| p.name() == "envoy")
            .map(Process::pid)
    }

    /// A counter or gauge from Envoy's `/stats`.
    pub async fn envoy_stat(&self, name: &str) -> Option<u64> {
        self.envoy_stat_at(&self.admin_url, name).await
    }

    /// A counter or gauge from the `/stats` of the Envoy at `admin_url`.
    pub async fn envoy_stat_at(&self, admin_url: &str, name: &str) -> Option<u64> {
        let escaped = name.replace('.', "\\.").replace('|', "\\|");
        let url = format!("{admin_url}/stats?filter=^{escaped}$");
        let text = crate::client::get_text(&self.http, &url).await?;
        text.lines().find_map(|l| {
            l.strip_prefix(name)?
                .strip_prefix(": ")?
                .trim()
                .parse()
                .ok()
        })
    }

    /// CPU time (user + system) each of the stack's processes has used so far, by name, in
    /// seconds: where a load step's CPU went.
    pub fn cpu_seconds(&self) -> Vec<(String, f64)> {
        self.processes
            .iter()
            .filter_map(|p| Some((p.name().to_owned(), crate::process::cpu_seconds(p.pid())?)))
            .collect()
    }

    /// The sidecar's `/metrics` text.
    pub async fn sidecar_metrics(&self) -> Result<String> {
        let url = self
            .sidecar_url
            .as_ref()
            .context("no sidecar in this mode")?;
        Ok(self
            .http
            .get(format!("{url}/metrics"))
            .send()
            .await?
            .text()
            .await?)
    }
}

/// Sidecar `replica`'s proxy in front of the server at `nats_url`
/// ([`StackOptions::transport_loss`]; `None` without it).
async fn event_proxy(
    opts: &StackOptions,
    nats_url: &str,
    replica: usize,
) -> Result<Option<LossyNats>> {
    let Some(loss) = &opts.transport_loss else {
        return Ok(None);
    };
    let upstream: std::net::SocketAddr = nats_url
        .strip_prefix("nats://")
        .and_then(|a| a.parse().ok())
        .with_context(|| format!("nats url {nats_url} is not nats://ip:port"))?;
    let proxy = LossyNats::start(upstream, loss.spec(replica))
        .await
        .context("starting a lossy NATS proxy")?;
    Ok(Some(proxy))
}

/// Start the simulated engines (and, in pin mode, their Dynamo-frontend stand-in).
fn start_sim(
    opts: &StackOptions,
    nats_url: &str,
    dir: &std::path::Path,
    discovery: &std::path::Path,
    (name, first_index): (&str, usize),
    processes: &mut Vec<Process>,
) -> Result<(Vec<EngineInfo>, Option<String>)> {
    let s = &opts.sim;
    let mut sim = Command::new(paths::binary("kvroute-sim")?);
    sim.arg("--model-dir").arg(paths::model_dir());
    sim.args(["--model", MODEL, "--nats", nats_url]);
    for (flag, value) in [
        ("--engines", s.engines.to_string()),
        ("--first-index", first_index.to_string()),
        ("--block-size", s.block_size.to_string()),
        ("--capacity-blocks", s.capacity_blocks.to_string()),
        ("--max-running", s.max_running.to_string()),
        ("--base-latency-us", s.base_latency_us.to_string()),
        ("--prefill-us-per-token", s.prefill_us_per_token.to_string()),
        ("--decode-us-per-token", s.decode_us_per_token.to_string()),
        ("--output-tokens", s.output_tokens.to_string()),
        ("--event-format", s.event_formats.join(",")),
        ("--component", s.dynamo_component.clone()),
        ("--event-delay-ms", s.event_delay_ms.clone()),
        ("--frontend-delay-ms", s.frontend_delay_ms.to_string()),
        ("--metrics-delay-ms", s.metrics_delay_ms.to_string()),
    ] {
        sim.args([flag, &value]);
    }
    if s.instant {
        sim.arg("--instant");
    }
    if let Some(per_seq) = s.batching {
        sim.args(["--batching", "--decode-us-per-seq", &per_seq.to_string()]);
    }
    if opts.eds_membership {
        sim.arg("--zmq-beside");
    }
    if opts.dynamo_frontend {
        sim.arg("--frontend").arg("--discovery-dir").arg(discovery);
    }
    let (sim, ready) = Process::spawn_until_line(name, sim, dir, "READY", Duration::from_secs(30))?;
    processes.push(sim);
    let ready =
        serde_json::from_str::<SimReady>(&ready).context("parsing the simulator's READY line")?;
    Ok((ready.engines, ready.frontend))
}

/// A value of one of the sidecar's configuration types from JSON: the fields given, every other
/// at its default, refused (by the sidecar's own `deny_unknown_fields`) when a field is not one.
fn typed<T: serde::de::DeserializeOwned>(what: &str, value: serde_json::Value) -> Result<T> {
    serde_json::from_value(value).with_context(|| format!("the harness's {what} configuration"))
}

/// Where one sidecar of a stack listens and what it reads.
struct SidecarPlace<'a> {
    /// 0: the stack's own; 1…: a replica's.
    replica: usize,
    /// Its API port on 127.0.0.1.
    port: u16,
    /// Its Unix socket, when it serves one too.
    unix_socket: Option<PathBuf>,
    /// The admin port of the Envoy beside it.
    admin: u16,
    /// Where it reads KV events: the stack's nats-server, or a lossy proxy in front of it.
    events_url: &'a str,
}

/// The configuration of one sidecar of the stack, built from the sidecar's own configuration
/// types: the model, the workers (`[[workers]]` and `[[zmq]]`, Dynamo discovery in pin mode,
/// Envoy's membership with EDS), NATS, Envoy's admin, the replica plane.
fn sidecar_config(
    opts: &StackOptions,
    engines: &[EngineInfo],
    nats_url: &str,
    place: &SidecarPlace<'_>,
    discovery: &Discovery,
) -> Result<Config> {
    let mut nats = serde_json::json!({"url": place.events_url});
    if let Some(subjects) = &opts.nats_subjects {
        nats["subjects"] = serde_json::json!(subjects);
    }
    let mut config: Config = typed(
        "sidecar",
        serde_json::json!({
            "listen": format!("127.0.0.1:{}", place.port),
            "unix_socket": place.unix_socket,
            "nats": nats,
            "models": [{"name": MODEL, "dir": paths::model_dir(), "block_size": opts.block_size()}],
            "envoy": {
                "admin_url": format!("http://127.0.0.1:{}", place.admin),
                "cluster": opts.workers_cluster,
                "poll_interval_ms": 100,
            },
        }),
    )?;
    // In pin mode the engines are found through Dynamo discovery, with EDS through Envoy.
    for e in engines.iter().filter(|_| !opts.eds_membership) {
        if !opts.pin_mode() {
            config.workers.push(typed(
                "worker",
                serde_json::json!({"address": e.address, "model": MODEL, "dynamo_worker_id": e.dynamo_worker_id}),
            )?);
        }
        if let (Some(events), Some(replay)) = (&e.zmq_endpoint, &e.replay_endpoint) {
            // Dynamo's mocker publishes on vLLM's default topic, the empty one.
            let topic = if opts.dynamo.is_some() {
                ""
            } else {
                "kv-events"
            };
            config.zmq.push(typed(
                "zmq",
                serde_json::json!({"endpoint": events, "replay_endpoint": replay, "worker": e.address, "topic": topic}),
            )?);
        }
    }
    if opts.pin_mode() {
        let mut d = discovery.config(MODEL);
        d.poll_interval_ms = 100;
        config.dynamo_discovery.push(d);
    }
    if opts.eds_membership {
        if let Some(envoy) = &mut config.envoy {
            envoy.members.push(typed(
                "members",
                serde_json::json!({"model": MODEL, "events": "tcp://{host}:{port+1}", "replay": "tcp://{host}:{port+2}", "topic": "kv-events"}),
            )?);
        }
    }
    if let Some(r) = &opts.replicas {
        let loss = if r.lossy.is_none_or(|l| l == place.replica) {
            r.loss
        } else {
            0.0
        };
        config.replicas = Some(typed(
            "replicas",
            serde_json::json!({
                "group": "stack",
                "id": format!("r{}", place.replica),
                "interval_ms": r.interval_ms,
                "reconcile": r.reconcile,
                "share_load": r.share_load,
                "load_interval_ms": r.load_interval_ms,
                "test_drop_events": loss,
                // Events through a proxy: the replica plane stays on the real server.
                "nats_url": (place.events_url != nats_url).then_some(nats_url),
            }),
        )?);
    }
    Ok(config)
}

/// [`sidecar_config`] as the TOML the sidecar reads, with [`StackOptions::sidecar_toml`]'s
/// tables merged over it (a key given there replaces the stack's; an array of tables given
/// there is appended to).
fn sidecar_text(
    opts: &StackOptions,
    engines: &[EngineInfo],
    nats_url: &str,
    place: &SidecarPlace<'_>,
    discovery: &Discovery,
) -> Result<String> {
    let config = sidecar_config(opts, engines, nats_url, place, discovery)?;
    let mut table =
        toml::Table::try_from(&config).context("the sidecar's configuration as TOML")?;
    let extra: toml::Table = toml::from_str(&opts.sidecar_toml).with_context(|| {
        format!(
            "StackOptions::sidecar_toml is not TOML: {}",
            opts.sidecar_toml
        )
    })?;
    merge(&mut table, extra);
    // Parsed back as the sidecar will: a key the merge got wrong fails here, not in a sidecar.
    let text = toml::to_string(&table)?;
    toml::from_str::<Config>(&text).context("the merged sidecar configuration")?;
    Ok(text)
}

/// `extra` over `base`: tables merged key by key, arrays appended, anything else replaced.
fn merge(base: &mut toml::Table, extra: toml::Table) {
    for (key, value) in extra {
        match (base.get_mut(&key), value) {
            (Some(toml::Value::Table(b)), toml::Value::Table(e)) => merge(b, e),
            (Some(toml::Value::Array(b)), toml::Value::Array(e)) => b.extend(e),
            (_, value) => {
                base.insert(key, value);
            }
        }
    }
}

/// The EDS file of a stack in `dir` ([`StackOptions::eds_membership`]).
fn eds_path(dir: &Path) -> PathBuf {
    dir.join("eds").join("workers.yaml")
}

fn parse_upstreams(upstreams: &[String]) -> Result<Vec<std::net::SocketAddr>> {
    upstreams
        .iter()
        .map(|a| {
            a.parse()
                .with_context(|| format!("upstream {a} is not ip:port"))
        })
        .collect()
}

/// nats-server on `port`, once it greets with its INFO line: a bare connect can succeed before
/// it listens (a loopback socket that happens to get the port as its source connects to itself).
pub(crate) async fn start_nats(port: u16, dir: &Path) -> Result<Process> {
    let mut nats = Command::new(paths::venv_tool("nats-server")?);
    nats.args(["-a", "127.0.0.1", "-p", &port.to_string()]);
    let process = Process::spawn("nats", nats, dir)?;
    wait_for("nats-server", Duration::from_secs(10), || async move {
        use tokio::io::AsyncReadExt as _;
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        let mut greeting = [0u8; 4];
        let read = stream.read_exact(&mut greeting);
        tokio::time::timeout(Duration::from_millis(500), read)
            .await
            .ok()?
            .ok()?;
        (&greeting == b"INFO").then_some(())
    })
    .await?;
    Ok(process)
}

/// Write the EDS file of a stack in `dir` as a control plane's push: beside it, then renamed
/// over it (Envoy reloads on the move).
pub fn write_eds(dir: &Path, version: u64, upstreams: &[String]) -> Result<()> {
    let text =
        kvroute_sidecar::envoy_config::eds_file("workers", version, &parse_upstreams(upstreams)?);
    let path = eds_path(dir);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let staged = dir.join("eds.staged.yaml");
    std::fs::write(&staged, text)?;
    std::fs::rename(&staged, &path)?;
    Ok(())
}

fn spawn_envoy(opts: &StackOptions, config: &Path, dir: &Path, name: &str) -> Result<Process> {
    let mut envoy = Command::new(paths::venv_tool("envoy")?);
    envoy
        .arg("-c")
        .arg(config)
        .args(["--concurrency", &opts.envoy_concurrency.to_string()])
        .args(["--disable-hot-restart", "-l", "info"]);
    Process::spawn(name, envoy, dir)
}

/// Start the sidecar on `dir/sidecar.toml` as process `name` and wait until `url` answers
/// `/healthz`.
async fn start_sidecar(
    dir: &Path,
    name: &str,
    url: &str,
    http: &reqwest::Client,
) -> Result<Process> {
    let mut cmd = Command::new(paths::binary("kvroute-sidecar")?);
    cmd.arg("serve")
        .arg("--config")
        .arg(dir.join("sidecar.toml"));
    let process = Process::spawn(name, cmd, dir)?;
    let probe = &format!("{url}/healthz");
    wait_for("sidecar /healthz", Duration::from_secs(30), || async move {
        http.get(probe)
            .send()
            .await
            .ok()
            .filter(|r| r.status().is_success())
    })
    .await?;
    Ok(process)
}

/// The shipped Envoy configuration for `opts` (`deploy/envoy/kvroute.yaml`, `kvroute-maglev.yaml` or
/// `round-robin.yaml`), filled as `kvroute-sidecar envoy-config` fills it.
pub fn render_envoy(
    opts: &StackOptions,
    dir: &Path,
    upstreams: &[String],
    listen: u16,
    admin: u16,
    sidecar: &SidecarAddress,
) -> Result<String> {
    use kvroute_sidecar::envoy_config::{self, EnvoyParams, Template};
    let template = match (opts.mode, opts.fallback) {
        (Mode::RoundRobin, _) => Template::RoundRobin,
        (_, Fallback::RingHash) => Template::Kvroute,
        (_, Fallback::Maglev) => Template::KvrouteMaglev,
    };
    let params = EnvoyParams {
        listen_port: listen,
        admin_port: admin,
        workers: match opts.eds_membership {
            true => envoy_config::Workers::EdsFile(eds_path(dir)),
            false => envoy_config::Workers::Listed(parse_upstreams(upstreams)?),
        },
        sidecar: match sidecar {
            SidecarAddress::Tcp(port) => {
                envoy_config::SidecarAddress::Tcp(([127, 0, 0, 1], *port).into())
            }
            SidecarAddress::Unix(path) => envoy_config::SidecarAddress::Unix(path.clone()),
        },
        filter_config: {
            let mut config = opts.filter_extra.clone();
            // Tests and benchmarks compare every hinted response with its prediction.
            config
                .entry("stream_usage_every")
                .or_insert_with(|| 1.into());
            config.insert("hints".into(), (opts.mode == Mode::Kvroute).into());
            config.insert("hint_timeout_ms".into(), opts.hint_timeout_ms.into());
            serde_json::Value::Object(config)
        },
        wasm: paths::filter_wasm()?,
        stream_idle_timeout: opts.stream_idle_timeout,
    };
    if let Some(bootstrap) = opts.envoy_bootstrap {
        let (envoy_config::Workers::Listed(upstreams), SidecarAddress::Tcp(sidecar_port)) =
            (params.workers, sidecar)
        else {
            anyhow::bail!("an assembled bootstrap takes listed workers and a TCP sidecar");
        };
        return bootstrap(&EnvoyInputs {
            listen,
            admin,
            upstreams,
            sidecar_port: *sidecar_port,
            filter_config: params.filter_config,
            wasm: params.wasm,
        });
    }
    let text = envoy_config::render(template.text(), &params)?;
    match opts.ejection_s {
        Some(s) => {
            const SHIPPED: &str = "base_ejection_time: 30s";
            anyhow::ensure!(
                text.contains(SHIPPED),
                "the Envoy config has no `{SHIPPED}`"
            );
            Ok(text.replace(SHIPPED, &format!("base_ejection_time: {s}s")))
        }
        None => Ok(text),
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

    fn engines() -> Vec<EngineInfo> {
        (0..2)
            .map(|i| EngineInfo {
                index: i,
                address: format!("127.0.0.1:{}", 9000 + i),
                dynamo_worker_id: 100 + i as u64,
                zmq_endpoint: (i == 1).then(|| "tcp://127.0.0.1:9101".to_owned()),
                replay_endpoint: (i == 1).then(|| "tcp://127.0.0.1:9102".to_owned()),
            })
            .collect()
    }

    fn place(replica: usize, events_url: &str) -> SidecarPlace<'_> {
        SidecarPlace {
            replica,
            port: 7000,
            unix_socket: None,
            admin: 7001,
            events_url,
        }
    }

    /// The text the sidecar reads back is the stack's fleet: both engines as workers, the vLLM
    /// one's sockets, NATS through the proxy, the replica plane on the real server, the lossy
    /// replica losing and the other not.
    #[test]
    fn a_replicas_configuration_reads_back_as_the_stack_built_it() {
        let mut opts = StackOptions::new("t", Mode::Kvroute);
        opts.replicas = Some(ReplicaOptions {
            count: 2,
            interval_ms: 500,
            loss: 0.1,
            lossy: Some(1),
            reconcile: true,
            share_load: false,
            load_interval_ms: 10,
        });
        let discovery = Discovery::File(PathBuf::from("/nowhere"));
        for (replica, loss) in [(0, 0.0), (1, 0.1)] {
            let text = sidecar_text(
                &opts,
                &engines(),
                "nats://127.0.0.1:4222",
                &place(replica, "nats://127.0.0.1:5555"),
                &discovery,
            )
            .unwrap();
            let config: Config = toml::from_str(&text).unwrap();
            assert_eq!(config.listen.port(), 7000);
            assert_eq!(config.workers.len(), 2);
            assert_eq!(config.workers[1].dynamo_worker_id, Some(101));
            assert_eq!(config.zmq.len(), 1, "{text}");
            assert_eq!(config.zmq[0].worker.as_deref(), Some("127.0.0.1:9001"));
            assert_eq!(config.nats.unwrap().url, "nats://127.0.0.1:5555");
            let r = config.replicas.unwrap();
            assert_eq!(r.id.as_deref(), Some(format!("r{replica}").as_str()));
            assert_eq!(r.nats_url.as_deref(), Some("nats://127.0.0.1:4222"));
            assert_eq!(r.test_drop_events, loss);
            assert!(config.dynamo_discovery.is_empty());
        }
    }

    /// A test's extra TOML goes over the stack's: a key replaces, a table it alone names is
    /// added, an array of tables is appended to; a field the sidecar does not know is refused
    /// here, not in a sidecar that fails to start.
    #[test]
    fn extra_toml_merges_over_the_stacks_and_is_checked() {
        let mut opts = StackOptions::new("t", Mode::Kvroute);
        opts.sidecar_toml = "[routing]\nmax_hinted_workers = 1\n[alarms]\nmin_hints = 3\n[[workers]]\naddress = \"127.0.0.1:9999\"\nmodel = \"tiny-llama\"\n".into();
        let discovery = Discovery::File(PathBuf::from("/nowhere"));
        let url = "nats://127.0.0.1:4222";
        let text = sidecar_text(&opts, &engines(), url, &place(0, url), &discovery).unwrap();
        let config: Config = toml::from_str(&text).unwrap();
        assert_eq!(config.routing.max_hinted_workers, 1);
        assert_eq!(config.alarms.min_hints, 3);
        assert_eq!(config.workers.len(), 3);
        assert!(config.replicas.is_none());

        opts.sidecar_toml = "[routing]\nmax_hinted_worker = 1\n".into();
        let err = sidecar_text(&opts, &engines(), url, &place(0, url), &discovery).unwrap_err();
        assert!(format!("{err:#}").contains("max_hinted_worker"), "{err:#}");
    }
}
