//! The sidecar's configuration file (TOML).
//!
//! ```toml
//! listen = "127.0.0.1:9100"        # HTTP API (hints, bundles, metrics); loopback by default
//! unix_socket = "/run/kvroute.sock" # optional: the same API on a Unix socket
//! explain_bytes = 16777216          # recent decisions kept for /debug/explain
//!
//! [nats]                            # Dynamo KV events; omit the section to disable
//! url = "nats://127.0.0.1:4222"
//! subjects = ["namespace.*.component.*.kv-events", "namespace.*.component.*.endpoint.*.kv-events",
//!             "namespace.*.component.*.endpoint.*.kv_metrics"]  # the last: load, not events
//!
//! [[models]]
//! name = "tiny-llama"               # the request's `model`
//! dir = "examples/models/tiny-llama" # tokenizer.json, tokenizer_config.json, chat_template.jinja
//! block_size = 16                   # must equal the engines' KV block size
//! lora_adapters = ["sql-lora"]      # optional: adapters requested by name as the `model`
//!
//! [[zmq]]                           # vLLM KV events (one entry per engine endpoint)
//! endpoint = "tcp://127.0.0.1:5557" # vLLM's kv-events `endpoint`
//! replay_endpoint = "tcp://127.0.0.1:5558" # optional: fills sequence gaps
//! worker = "127.0.0.1:8001"         # optional with llm-d `kv@<ip:port>@<model>` topics; in pin
//!                                   # mode a Dynamo instance's request-plane ip:port
//! topic = "kv-events"               # optional prefix filter; bind = true if vLLM connects
//!
//! [[workers]]
//! address = "127.0.0.1:8001"        # as in Envoy's `workers` cluster
//! model = "tiny-llama"
//! dynamo_worker_id = 1001           # the worker_id in its KV events
//!
//! [[dynamo_discovery]]              # Dynamo workers behind a Dynamo frontend (pin mode)
//! dir = "/var/lib/dynamo/discovery" # the workers' DYN_FILE_KV (holds v1/instances, v1/mdc)
//!                                   # and v1/event_channels: ZMQ publishers are followed
//! model = "tiny-llama"
//! namespace = "dynamo"              # defaults: dynamo / any component / generate
//! endpoint = "generate"
//! probe_interval_ms = 250           # TCP-connect each instance; 2 failures: not pinned
//!
//! [envoy]                          # optional: Envoy's view of the workers cluster
//! admin_url = "http://127.0.0.1:9901" # unhealthy or absent workers are never hinted
//! cluster = "workers"
//! poll_interval_ms = 200
//! grace_period_ms = 30000           # then their index entries are dropped
//!
//! [[envoy.members]]                 # optional: a model's workers are a cluster's hosts (EDS)
//! cluster = "workers"               # default: [envoy] cluster
//! model = "tiny-llama"
//! events = "tcp://{host}:5557"      # each host's vLLM KV-event endpoint ({host}, {port},
//! replay = "tcp://{host}:5558"      # {address}, {port+N}); replay: optional
//! topic = "kv-events"
//!
//! [alarms]                          # see docs/operations.md, "Event sources"
//! silence_s = 30                    # no KV events this long while hints are served: alarm
//! min_hints = 20                    # a worker hinted this often without events: alarm
//! truth_window_s = 60               # stale_index / replica_skew weigh this much of the past
//!
//! [replicas]                        # see docs/operations.md, "Replicas"
//! group = "ingress"                 # peers publish and compare on kvroute.replicas.<group>.*
//! share_load = true                 # share requests in flight (and their prompts) per worker
//!
//! [routing]
//! min_matched_blocks = 1            # a shorter match is not worth a hint
//! max_hinted_workers = 3            # length of the override_host list (retries go down it)
//! max_waiting = 8                   # saturation thresholds: queued requests,
//! max_in_flight = 16                #   requests where the engine reports no queue,
//! # max_kv_usage = 0.95             #   KV cache usage (unset: not a threshold)
//! # waiting_kv_usage = 0.9          # a queue saturates only at this KV usage (unset: any)
//! saturation_slack = 4              # over a threshold counts only 4 requests above the mean
//! load_penalty_blocks = 2           # one request on a worker costs as much as 2 uncached blocks
//! scrape_interval_ms = 250          # engines' /metrics (vLLM names) are read this often
//! home_key_blocks = 8               # cold prompts go to the home of their first 8 blocks
//! home_balance = 1                  # … unless it is home to its share of the prefixes (rounded up)
//! spread_slack = 4                  # a popular prefix spreads to a worker this many requests less
//!                                   #   busy, from a holder this many (and 2×) above the mean
//!                                   #   running this many of the prefix's requests
//! spread_idle_slack = 2             # … or this many, to a worker running nothing
//! spread_demand = 0.5               # … while each holder gets over half a worker's share
//! predict_survival = true           # weigh what a worker will still hold, not all the index matched
//! ```

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context as _};
use serde::{Deserialize, Serialize};

/// The whole configuration.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// TCP address of the HTTP API.
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    /// Optional Unix socket serving the same API.
    #[serde(default)]
    pub unix_socket: Option<PathBuf>,
    /// The API's connections: how many, how long idle.
    #[serde(default)]
    pub api: ApiConfig,
    /// Bytes of recent decisions `GET /debug/explain` keeps (about 1–3 KB each with a few
    /// workers: 16 MiB is a minute at a few hundred requests a second).
    #[serde(default = "default_explain_bytes")]
    pub explain_bytes: usize,
    /// Dynamo event plane on NATS.
    #[serde(default)]
    pub nats: Option<NatsConfig>,
    /// vLLM KV-event publishers on ZMQ, one entry per endpoint.
    #[serde(default)]
    pub zmq: Vec<ZmqConfig>,
    /// Served models.
    #[serde(default)]
    pub models: Vec<ModelConfig>,
    /// Workers (engines) that may be hinted.
    #[serde(default)]
    pub workers: Vec<WorkerConfig>,
    /// Hint policy knobs.
    #[serde(default)]
    pub routing: RoutingConfig,
    /// Bounds on what the event sources can make the index hold.
    #[serde(default)]
    pub index: IndexConfig,
    /// Envoy's admin endpoint, to learn which workers Envoy considers healthy.
    #[serde(default)]
    pub envoy: Option<EnvoyConfig>,
    /// When the event plane's alarms fire.
    #[serde(default)]
    pub alarms: AlarmConfig,
    /// Dynamo instances to find in Dynamo's file discovery directory (pin mode).
    #[serde(default)]
    pub dynamo_discovery: Vec<DiscoveryConfig>,
    /// The other sidecars of this fleet (one per Envoy): compare indexes with them.
    #[serde(default)]
    pub replicas: Option<ReplicasConfig>,
    /// A copy of the index on local disk, to start from after a restart.
    #[serde(default)]
    pub snapshot: Option<SnapshotConfig>,
}

/// The API's connections (docs/operations.md, "Connections").
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ApiConfig {
    /// Connections open at once (each Envoy worker thread keeps a few); at the bound the one
    /// idle longest is closed for a new one. Kept below three quarters of the descriptor limit.
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// A connection that moves no byte for this long is closed (Envoy's pool closes its idle
    /// ones at 30 s in the shipped configs, first).
    #[serde(default = "default_idle_timeout_s")]
    pub idle_timeout_s: u64,
}

impl Default for ApiConfig {
    fn default() -> Self {
        ApiConfig {
            max_connections: default_max_connections(),
            idle_timeout_s: default_idle_timeout_s(),
        }
    }
}

fn default_max_connections() -> usize {
    4096
}

fn default_idle_timeout_s() -> u64 {
    60
}

/// The index kept on local disk (docs/operations.md, "A snapshot on disk"): written every
/// `interval_ms`, read at start.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotConfig {
    /// The file (relative paths are relative to the config file); written next to it under
    /// `<file>.tmp` and renamed, so a crash mid-write leaves the last one whole.
    pub path: PathBuf,
    /// How often it is written.
    #[serde(default = "default_snapshot_interval_ms")]
    pub interval_ms: u64,
    /// How long a cache read at start waits for its worker to appear (Dynamo discovery finds
    /// workers after start); then it is given up, and said.
    #[serde(default = "default_restore_wait_ms")]
    pub restore_wait_ms: u64,
}

fn default_snapshot_interval_ms() -> u64 {
    30_000
}

fn default_restore_wait_ms() -> u64 {
    60_000
}

/// The replica plane: every sidecar of a fleet publishes its caches' digests on NATS and
/// compares them with its peers' (docs/operations.md, "Replicas").
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReplicasConfig {
    /// The fleet's name: replicas of one group compare with each other (subject
    /// `kvroute.replicas.<group>.digests`).
    pub group: String,
    /// This replica's name among its peers; default: the host name (the pod's name). Replicas
    /// sharing a host name (several on one machine) must each set one: a message from a peer
    /// with our own id is taken for our own and ignored.
    pub id: Option<String>,
    /// How often digests are published.
    pub interval_ms: u64,
    /// NATS server of the replica plane; default: `[nats] url` (with its authentication).
    pub nats_url: Option<String>,
    /// Repair from peers: lost messages asked of them, divergent caches replaced by a clean
    /// peer's snapshot. `false` only compares (to measure what repair buys).
    pub reconcile: bool,
    /// Share this replica's requests in flight per worker with its peers (each with its
    /// prompt's leading blocks), and weigh theirs: the load rule then sees the fleet's load,
    /// and every replica the prompts running on a worker, not this replica's share of them.
    pub share_load: bool,
    /// How often a changed in-flight count is shared (coalesced: a burst is one message).
    pub load_interval_ms: u64,
    /// Tests only: drop this fraction (0..1) of the KV-event messages this replica ingests, to
    /// make it diverge. Never set it in production.
    pub test_drop_events: f64,
}

impl Default for ReplicasConfig {
    fn default() -> Self {
        ReplicasConfig {
            group: "kvroute".into(),
            id: None,
            interval_ms: 2000,
            nats_url: None,
            reconcile: true,
            share_load: true,
            load_interval_ms: 50,
            test_drop_events: 0.0,
        }
    }
}

impl ReplicasConfig {
    /// This replica's name: `id`, else the host name, else one made of the process id.
    pub fn replica_id(&self) -> String {
        self.id
            .clone()
            .or_else(|| std::env::var("HOSTNAME").ok().filter(|h| !h.is_empty()))
            .or_else(|| {
                std::fs::read_to_string("/etc/hostname")
                    .ok()
                    .map(|h| h.trim().to_owned())
                    .filter(|h| !h.is_empty())
            })
            .unwrap_or_else(|| format!("replica-{}", std::process::id()))
    }

    /// How often lost messages are asked of peers, and how old a loss is before it is asked
    /// (a peer a little behind receives the message meanwhile): a twentieth of the interval,
    /// 20–200 ms. A prompt's next turn often comes within a second: its blocks must be back by
    /// then. Only losses are asked for, so this costs nothing while nothing is lost.
    pub fn fill_interval(&self) -> Duration {
        Duration::from_millis((self.interval_ms / 20).clamp(20, 200))
    }

    /// How long a peer's shared in-flight counts are believed without a new message: it shares
    /// them at least every interval, so two intervals without one is a peer gone.
    pub fn peer_load_ttl(&self) -> Duration {
        Duration::from_millis(2 * self.interval_ms)
    }

    /// How long a lost message is asked for before the cache counts as unclean (a snapshot
    /// from a clean peer repairs it then): an interval, at least a second.
    pub fn fill_timeout(&self) -> Duration {
        Duration::from_millis(self.interval_ms.max(1000))
    }

    /// The subject digests are published on.
    pub fn subject(&self) -> String {
        format!("kvroute.replicas.{}.digests", self.group)
    }
}

/// Dynamo workers behind a Dynamo frontend, found in Dynamo's discovery records: its file store
/// (`dir`) or etcd (`etcd`, Dynamo's default backend). They are hinted by instance id: the filter sends `x-worker-instance-id` (aggregated workers) or
/// `x-prefill-instance-id` (prefill workers of a disaggregated fleet) and the frontend serves
/// the request there (see docs/operations.md, "Dynamo fleets: pin mode").
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DiscoveryConfig {
    /// The file store's root (the workers' `DYN_FILE_KV`, holding `v1/instances/…`; relative
    /// paths are relative to the config file). Either this or `etcd`.
    #[serde(default)]
    pub dir: Option<PathBuf>,
    /// etcd's client URLs (the workers' `ETCD_ENDPOINTS`, e.g. `["http://etcd:2379"]`), tried
    /// in order. Either this or `dir`.
    #[serde(default)]
    pub etcd: Vec<String>,
    /// The model the instances serve.
    pub model: String,
    /// Dynamo namespace.
    #[serde(default = "default_dynamo_namespace")]
    pub namespace: String,
    /// Only this component's instances (default: every component; roles come from the model
    /// cards or the component names, see [`crate::observers::discovery::scan`]).
    #[serde(default)]
    pub component: Option<String>,
    /// Its endpoint.
    #[serde(default = "default_dynamo_endpoint")]
    pub endpoint: String,
    /// How often the directory is read.
    #[serde(default = "default_discovery_poll_ms")]
    pub poll_interval_ms: u64,
    /// How often each pinned instance's request plane is probed with a TCP connect (0: never).
    /// Two failed probes in a row make it unusable: a killed worker's record stays for about
    /// 8 s, and the frontend fails every request pinned to it meanwhile.
    #[serde(default = "default_probe_interval_ms")]
    pub probe_interval_ms: u64,
    /// How long a probe's connect may take before it counts as failed.
    #[serde(default = "default_probe_timeout_ms")]
    pub probe_timeout_ms: u64,
}

impl DiscoveryConfig {
    /// `model`'s instances under discovery root `dir`, every other field at its default.
    pub fn new(dir: impl Into<PathBuf>, model: &str) -> Self {
        DiscoveryConfig {
            dir: Some(dir.into()),
            ..Self::etcd(Vec::new(), model)
        }
    }

    /// `model`'s instances in the etcd at `endpoints`, every other field at its default.
    pub fn etcd(endpoints: Vec<String>, model: &str) -> Self {
        DiscoveryConfig {
            dir: None,
            etcd: endpoints,
            model: model.to_owned(),
            namespace: default_dynamo_namespace(),
            component: None,
            endpoint: default_dynamo_endpoint(),
            poll_interval_ms: default_discovery_poll_ms(),
            probe_interval_ms: default_probe_interval_ms(),
            probe_timeout_ms: default_probe_timeout_ms(),
        }
    }

    /// Where the records are read, as lines say it.
    pub fn store(&self) -> String {
        match &self.dir {
            Some(dir) => format!("dir {}", dir.display()),
            None => format!("etcd {}", self.etcd.join(",")),
        }
    }
}

fn default_probe_interval_ms() -> u64 {
    250
}

fn default_probe_timeout_ms() -> u64 {
    250
}

fn default_dynamo_namespace() -> String {
    "dynamo".into()
}

fn default_dynamo_endpoint() -> String {
    "generate".into()
}

fn default_discovery_poll_ms() -> u64 {
    1000
}

/// Where to read Envoy's view of the workers cluster.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct EnvoyConfig {
    /// Envoy's admin URL, e.g. `http://127.0.0.1:9901`.
    pub admin_url: String,
    /// The cluster override_host routes into.
    #[serde(default = "default_cluster")]
    pub cluster: String,
    /// How often to poll `/clusters`.
    #[serde(default = "default_poll_ms")]
    pub poll_interval_ms: u64,
    /// How long a worker may stay unhealthy or absent before its index entries are dropped.
    #[serde(default = "default_grace_ms")]
    pub grace_period_ms: u64,
    /// Models whose workers are an Envoy cluster's hosts, as EDS lists them.
    #[serde(default)]
    pub members: Vec<MembersConfig>,
}

/// A model served by the hosts of an Envoy cluster (`[[envoy.members]]`): each host Envoy lists
/// is a worker, hinted by its address, its KV events read from the endpoints the templates give
/// for it; hosts EDS adds and removes are followed without a restart.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct MembersConfig {
    /// The cluster (default: `[envoy] cluster`).
    #[serde(default)]
    pub cluster: Option<String>,
    /// The model its hosts serve.
    pub model: String,
    /// Each host's vLLM KV-event endpoint: `{host}` (its IP), `{port}`, `{address}`
    /// (`ip:port`), `{port+N}` / `{port-N}`; e.g. `tcp://{host}:5557`.
    pub events: String,
    /// Each host's replay endpoint, the same way (optional: fills gaps, warm start).
    #[serde(default)]
    pub replay: Option<String>,
    /// Topic prefix to subscribe to (vLLM's `topic`; empty: everything).
    #[serde(default)]
    pub topic: String,
    /// Larger messages close the connection instead of being read.
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: u64,
}

impl EnvoyConfig {
    /// The cluster a `[[envoy.members]]` entry reads.
    pub fn members_cluster<'a>(&'a self, m: &'a MembersConfig) -> &'a str {
        m.cluster.as_deref().unwrap_or(&self.cluster)
    }
}

fn default_cluster() -> String {
    "workers".into()
}

fn default_poll_ms() -> u64 {
    200
}

fn default_grace_ms() -> u64 {
    30_000
}

fn default_explain_bytes() -> usize {
    16 << 20
}

fn default_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9100))
}

/// Where Dynamo KV events come from.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct NatsConfig {
    /// NATS server URL (`nats://`, `tls://`; `user:password@` in it works, but is better in
    /// the fields below: the URL is shown with its secret masked).
    pub url: String,
    /// Subjects to subscribe to (wildcards allowed).
    #[serde(default = "default_subjects")]
    pub subjects: Vec<String>,
    /// Messages the NATS client keeps per subscription while the sidecar is busy; past this the
    /// client drops them ("slow consumer": counted in `kvroute_source_dropped_messages_total`,
    /// then seen as gaps). A burst of this many messages is kept whole; memory is spent only
    /// while they wait (~0.4 KB each).
    #[serde(default = "default_buffer_messages")]
    pub buffer_messages: usize,
    /// A `.creds` file (JWT and NKey seed), as `nsc` writes it.
    #[serde(default)]
    pub credentials_file: Option<PathBuf>,
    /// A file holding an NKey seed (`SU…`).
    #[serde(default)]
    pub nkey_seed_file: Option<PathBuf>,
    /// User name, with `password_file`.
    #[serde(default)]
    pub user: Option<String>,
    /// A file holding the user's password.
    #[serde(default)]
    pub password_file: Option<PathBuf>,
    /// A file holding an authentication token.
    #[serde(default)]
    pub token_file: Option<PathBuf>,
    /// Refuse a connection that is not TLS.
    #[serde(default)]
    pub require_tls: bool,
    /// CA certificate(s) (PEM) to verify the server with.
    #[serde(default)]
    pub tls_ca: Option<PathBuf>,
    /// Client certificate (PEM), with `tls_key`, for servers that verify clients.
    #[serde(default)]
    pub tls_cert: Option<PathBuf>,
    /// The client certificate's key (PEM).
    #[serde(default)]
    pub tls_key: Option<PathBuf>,
}

impl NatsConfig {
    /// The URL with any `user:password@` masked: what logs and `/debug/sources` show.
    pub fn redacted_url(&self) -> String {
        redact_url(&self.url)
    }

    fn resolve_paths(&mut self, base: &Path) {
        for p in [
            &mut self.credentials_file,
            &mut self.nkey_seed_file,
            &mut self.password_file,
            &mut self.token_file,
            &mut self.tls_ca,
            &mut self.tls_cert,
            &mut self.tls_key,
        ]
        .into_iter()
        .flatten()
        {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        }
    }

    fn validate(&self) -> anyhow::Result<()> {
        let methods = [
            self.credentials_file.is_some(),
            self.nkey_seed_file.is_some(),
            self.user.is_some() || self.password_file.is_some(),
            self.token_file.is_some(),
        ];
        if methods.iter().filter(|&&m| m).count() > 1 {
            bail!("[nats]: set one of credentials_file, nkey_seed_file, user + password_file, token_file");
        }
        if self.user.is_some() != self.password_file.is_some() {
            bail!("[nats]: user and password_file go together");
        }
        if self.tls_cert.is_some() != self.tls_key.is_some() {
            bail!("[nats]: tls_cert and tls_key go together");
        }
        if self.buffer_messages < 1024 {
            bail!("[nats] buffer_messages: at least 1024 (a burst of one step of a small fleet)");
        }
        Ok(())
    }
}

/// `scheme://user:secret@host` → `scheme://***@host` (any userinfo, whole).
pub fn redact_url(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    match authority.rsplit_once('@') {
        Some((_, host)) if scheme.is_empty() => format!("***@{host}{path}"),
        Some((_, host)) => format!("{scheme}://***@{host}{path}"),
        None => url.to_owned(),
    }
}

/// `url` without its `user:password@` or `token@`: what a client library is given, since it
/// may print its URL (async-nats does, at debug level, on every connection attempt).
pub fn without_credentials(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    match authority.rsplit_once('@') {
        Some((_, host)) if scheme.is_empty() => format!("{host}{path}"),
        Some((_, host)) => format!("{scheme}://{host}{path}"),
        None => url.to_owned(),
    }
}

/// Room for a 256-worker fleet's burst of 1,000 messages each.
fn default_buffer_messages() -> usize {
    262_144
}

/// KV events in both Dynamo subject layouts (1.2 and 1.6), and 1.6's per-worker KV usage;
/// any namespace and component.
pub fn default_subjects() -> Vec<String> {
    vec![
        "namespace.*.component.*.kv-events".into(),
        "namespace.*.component.*.endpoint.*.kv-events".into(),
        "namespace.*.component.*.endpoint.*.kv_metrics".into(),
    ]
}

/// One vLLM KV-event publisher (`--kv-events-config` with `"publisher": "zmq"`).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ZmqConfig {
    /// vLLM's `endpoint`, e.g. `tcp://10.0.0.5:5557`.
    pub endpoint: String,
    /// vLLM's `replay_endpoint`, used to fill sequence gaps; without it a gap resyncs the worker.
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    /// The worker publishing here: its `[[workers]]` address, or a Dynamo instance's
    /// request-plane `ip:port` (its discovery record's): that worker then takes its KV events
    /// from here only, not from the copies Dynamo relays to NATS. Optional when topics follow
    /// llm-d's `kv@<ip:port>@<model>`, which names the worker.
    #[serde(default)]
    pub worker: Option<String>,
    /// Topic prefix to subscribe to (vLLM's `topic`; empty: everything).
    #[serde(default)]
    pub topic: String,
    /// Bind instead of connect: vLLM connects when its endpoint has no `*`, and then several
    /// engines may publish into one bound socket (tell them apart by topic).
    #[serde(default)]
    pub bind: bool,
    /// Larger messages close the connection instead of being read (a peer announcing a huge
    /// frame must not make the sidecar allocate it).
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: u64,
}

/// 16 MiB: a vLLM batch of several thousand 16-token blocks fits many times over.
pub fn default_max_message_bytes() -> u64 {
    16 << 20
}

/// One served model.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Model name, as requests send it.
    pub name: String,
    /// HF-style directory with tokenizer.json (relative paths are relative to the config file).
    pub dir: PathBuf,
    /// KV block size of the engines serving it.
    pub block_size: u32,
    /// LoRA adapters the engines serve on it under their own names (vLLM `--lora-modules`).
    #[serde(default)]
    pub lora_adapters: Vec<String>,
}

/// One worker.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    /// `ip:port` exactly as in Envoy's cluster (override_host matches on it).
    pub address: String,
    /// The model it serves.
    pub model: String,
    /// Its Dynamo instance id (the `worker_id` of its KV events).
    #[serde(default)]
    pub dynamo_worker_id: Option<u64>,
    /// The Dynamo component (`namespace/component`) whose subjects carry its events and
    /// `kv_metrics`; others naming it are refused. Unset: the first subject it is seen on.
    #[serde(default)]
    pub dynamo_component: Option<String>,
    /// Blocks its KV cache holds (per data-parallel rank), when its engine does not say
    /// (vLLM's `vllm:cache_config_info` does, and wins).
    #[serde(default)]
    pub capacity_blocks: Option<u64>,
}

/// What the network can make the index hold: events are not authenticated beyond their
/// transport, and a lost removal is never seen (see docs/operations.md, "Bounds").
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct IndexConfig {
    /// Blocks one cache (worker × data-parallel rank) may hold when neither its engine nor
    /// `[[workers]] capacity_blocks` says: past it, the oldest go.
    pub max_blocks_per_cache: u64,
    /// Data-parallel ranks one worker may have; events and `kv_metrics` of further ranks are
    /// refused.
    pub max_ranks_per_worker: u32,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            // 4 Mi blocks of 16 tokens: 64 M tokens, more than any single engine's cache.
            max_blocks_per_cache: 1 << 22,
            max_ranks_per_worker: 64,
        }
    }
}

/// Hint policy knobs (see docs/operations.md for how to tune them).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct RoutingConfig {
    /// Matches shorter than this many blocks count as none (the least loaded worker wins).
    pub min_matched_blocks: u32,
    /// At most this many workers in a hint (Envoy retries go down the list).
    pub max_hinted_workers: usize,
    /// A worker with this many queued requests is saturated.
    pub max_waiting: f64,
    /// A worker whose KV cache is this full (0..1) is saturated; unset, KV usage alone never
    /// saturates a worker. A busy engine with a small cache runs near 100% (its running
    /// requests' blocks), and whether new requests wait is what `max_waiting` sees: on real
    /// vLLM and Dynamo this threshold sent warm turns away at the load where their cache
    /// mattered (docs/benchmarks.md).
    pub max_kv_usage: Option<f64>,
    /// A queue of `max_waiting` saturates a worker only while its KV cache is this full (0..1):
    /// requests waiting for cache blocks lose their prefixes as they wait (vLLM with a small
    /// cache), while an engine queueing for compute keeps them, and moving its requests pays
    /// their prefills for a queue that is only chance (the simulator past saturation). Unset:
    /// any such queue. Off by default: it also cost a chat workload below saturation
    /// (docs/benchmarks.md, "A larger saturation slack").
    pub waiting_kv_usage: Option<f64>,
    /// A worker with this many requests (see [`crate::core::load::Load::busy`]) is saturated,
    /// where its engine reports no queue ([`crate::core::policy::saturated`]).
    pub max_in_flight: f64,
    /// A worker over a threshold counts as saturated only with this many requests more than
    /// the fleet's mean: when every worker is that busy, moving a request pays its prefill
    /// and saves no queue.
    pub saturation_slack: f64,
    /// Cost of one request in flight on a worker, in blocks of prefill: how many cached blocks
    /// are worth waiting behind one more request.
    pub load_penalty_blocks: f64,
    /// How often engines' `/metrics` are scraped.
    pub scrape_interval_ms: u64,
    /// A prompt no worker holds goes to the home of its first this many blocks (the filter's
    /// `fallback_key_blocks`); 0: to the least loaded worker.
    pub home_key_blocks: usize,
    /// A cold prompt's home is passed over when it has this many requests more than the least
    /// loaded worker.
    pub home_slack: f64,
    /// A cold prompt's home is also passed over when its hinted requests' distinct prompt
    /// blocks exceed the fewest of any worker's by this many: a second long prefix does not
    /// land where another one is running. Unset: [`PREFILL_HOME_SLACK_BLOCKS`] for the prefill
    /// workers of a disaggregated fleet, off for aggregated workers; `inf`: off for all.
    pub home_slack_blocks: Option<f64>,
    /// A cold prompt's home is also passed over when it is home to this many times its share
    /// of the prefixes, counting the new one, rounded up (`home_key_blocks` deep: those its
    /// caches hold by the index, and those of its requests running, whose events are yet to
    /// come; consistent hashing with bounded loads): the prefixes that first land by hashing
    /// stay there, so hashing alone leaves some workers three times the prefixes of others.
    /// Counted from the index, every replica bounds alike once their indexes agree. 1 (the
    /// default): no worker takes a second prefix while another has none; `inf`: off.
    pub home_balance: f64,
    /// A popular prefix (requests lately branched off it in different ways, or several workers hold it)
    /// goes to another worker, which then holds it too, when each holder has this many
    /// requests more than that worker and than the workers without it have on average (and
    /// twice their average), and runs at least this many requests of the prefix
    /// (`spread_idle_slack` when that worker runs nothing): it spreads instead of queueing
    /// where it first landed.
    pub spread_slack: f64,
    /// The prefix's own requests on its holder that spread it to a worker running nothing,
    /// where the copy's prefill slows no one (`spread_slack` to a busy one).
    pub spread_idle_slack: f64,
    /// A popular prefix spreads only while its requests per holder are more than this share of
    /// a worker's (its share of the recent requests × workers / holders): at 0.5, one of 32
    /// equally asked prefixes never spreads on 8 workers, one of 4 apps on 4 workers does (two
    /// apps sharing one home), one behind half the requests spreads to 7 of 8. A burst on
    /// the holder of a prefix that is one of many passes; a prefix worth a worker's attention
    /// does not. 0: load alone decides.
    pub spread_demand: f64,
    /// Weigh what a worker will still hold when the request gets there: the prompt blocks its
    /// running requests share, and of its other matched blocks the share its engine's reports
    /// show surviving. Off: every block the index matched counts.
    pub predict_survival: bool,
}

/// `home_slack_blocks` for prefill workers when unset. A prefill worker's work is the
/// prompts it computes, so the distinct prompt blocks in flight are its load; an aggregated
/// worker's is dominated by decoding its requests, which `home_slack` counts. Measured
/// (docs/benchmarks.md, "Against Dynamo's KV router"): in front of disaggregated
/// Dynamo it removed the runs where two long system prompts shared one prefill worker; on
/// aggregated real vLLM it moved the hit rate by under a point and not the TTFT p95 for the
/// better.
pub const PREFILL_HOME_SLACK_BLOCKS: f64 = 16.0;

impl RoutingConfig {
    /// The `home_slack_blocks` that applies to a worker, by its role; `None`: off.
    pub fn home_slack_blocks_for(&self, prefill: bool) -> Option<f64> {
        self.home_slack_blocks
            .or(prefill.then_some(PREFILL_HOME_SLACK_BLOCKS))
            .filter(|v| v.is_finite())
    }
}

impl Default for RoutingConfig {
    fn default() -> Self {
        RoutingConfig {
            min_matched_blocks: 1,
            max_hinted_workers: 3,
            max_waiting: 8.0,
            max_kv_usage: None,
            waiting_kv_usage: None,
            max_in_flight: 16.0,
            saturation_slack: 4.0,
            load_penalty_blocks: 2.0,
            scrape_interval_ms: 250,
            home_key_blocks: 8,
            home_slack: 4.0,
            home_slack_blocks: None,
            home_balance: 1.0,
            spread_slack: 4.0,
            spread_idle_slack: 2.0,
            spread_demand: 0.5,
            predict_survival: true,
        }
    }
}

impl Config {
    /// Read and check a configuration file; relative model dirs resolve against its folder.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading config {}", path.display()))?;
        let mut config: Config =
            toml::from_str(&text).with_context(|| format!("parsing config {}", path.display()))?;
        let base = path.parent().unwrap_or(Path::new("."));
        for m in &mut config.models {
            if m.dir.is_relative() {
                m.dir = base.join(&m.dir);
            }
        }
        for d in &mut config.dynamo_discovery {
            if let Some(dir) = d.dir.as_mut().filter(|d| d.is_relative()) {
                *dir = base.join(&*dir);
            }
        }
        if let Some(nats) = &mut config.nats {
            nats.resolve_paths(base);
        }
        if let Some(s) = &mut config.snapshot {
            if s.path.is_relative() {
                s.path = base.join(&s.path);
            }
        }
        config.validate()?;
        Ok(config)
    }

    /// Reject configurations that could only route wrongly.
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.api.max_connections == 0 || self.api.idle_timeout_s == 0 {
            bail!("[api] max_connections and idle_timeout_s must be positive");
        }
        let mut names = std::collections::HashSet::new();
        for m in &self.models {
            if m.block_size == 0 {
                bail!("model {}: block_size must be positive", m.name);
            }
            if !names.insert(m.name.as_str()) {
                bail!("model {} is configured twice", m.name);
            }
        }
        let a = &self.alarms;
        if a.truth_window_s == 0 {
            bail!("[alarms] truth_window_s must be at least 1");
        }
        for (name, v) in [
            ("stale_index_ratio", a.stale_index_ratio),
            ("replica_skew_ratio", a.replica_skew_ratio),
        ] {
            if !(0.0..=1.0).contains(&v) {
                bail!("[alarms] {name} = {v}: must be within 0..=1");
            }
        }
        if let Some(r) = &self.replicas {
            if r.nats_url.is_none() && self.nats.is_none() {
                bail!("[replicas] needs nats_url, or a [nats] section to share");
            }
            if !(100..=60_000).contains(&r.interval_ms) {
                bail!(
                    "[replicas] interval_ms = {}: must be 100..=60000",
                    r.interval_ms
                );
            }
            if !(10..=r.interval_ms).contains(&r.load_interval_ms) {
                bail!(
                    "[replicas] load_interval_ms = {}: must be 10..=interval_ms",
                    r.load_interval_ms
                );
            }
            if !(0.0..=1.0).contains(&r.test_drop_events) {
                bail!("[replicas] test_drop_events must be within 0..=1");
            }
            if r.group.is_empty() || r.group.contains(['.', '*', '>', ' ']) {
                bail!("[replicas] group {:?}: one NATS subject token", r.group);
            }
            let id = r.replica_id();
            if id.is_empty() || id.contains(['*', '>']) || id.contains(char::is_whitespace) {
                bail!("[replicas] id {id:?}: must be usable in a NATS subject (no *, >, spaces)");
            }
        }
        if self.index.max_blocks_per_cache == 0 {
            bail!("[index] max_blocks_per_cache must be positive");
        }
        if self.index.max_ranks_per_worker == 0 {
            bail!("[index] max_ranks_per_worker must be positive");
        }
        let mut addresses = std::collections::HashSet::new();
        let mut ids = std::collections::HashSet::new();
        for w in &self.workers {
            if w.capacity_blocks == Some(0) {
                bail!("worker {}: capacity_blocks must be positive", w.address);
            }
            if let Some(c) = &w.dynamo_component {
                if c.split('/').count() != 2 || c.split('/').any(str::is_empty) {
                    bail!(
                        "worker {}: dynamo_component {c:?} is not namespace/component",
                        w.address
                    );
                }
            }
            if !names.contains(w.model.as_str()) {
                bail!(
                    "worker {} serves model {}, which is not configured",
                    w.address,
                    w.model
                );
            }
            if w.address.parse::<SocketAddr>().is_err() {
                bail!("worker address {} is not ip:port", w.address);
            }
            if !addresses.insert(w.address.as_str()) {
                bail!("worker {} is configured twice", w.address);
            }
            if let Some(id) = w.dynamo_worker_id {
                if !ids.insert(id) {
                    bail!("dynamo_worker_id {id} is configured twice");
                }
            }
        }
        for d in &self.dynamo_discovery {
            if !names.contains(d.model.as_str()) {
                bail!(
                    "[[dynamo_discovery]] {} serves model {}, which is not configured",
                    d.store(),
                    d.model
                );
            }
            if d.dir.is_some() != d.etcd.is_empty() {
                bail!("[[dynamo_discovery]] for model {}: set `dir` (Dynamo's file store) or `etcd` (its client URLs), one of them", d.model);
            }
            for url in &d.etcd {
                if !url.starts_with("http://") && !url.starts_with("https://") {
                    bail!("[[dynamo_discovery]] etcd endpoint {url:?} is not http:// or https://");
                }
            }
        }
        if let Some(envoy) = &self.envoy {
            let mut clusters = std::collections::HashSet::new();
            for m in &envoy.members {
                let cluster = envoy.members_cluster(m);
                if !names.contains(m.model.as_str()) {
                    bail!(
                        "[[envoy.members]] {cluster} serves model {}, which is not configured",
                        m.model
                    );
                }
                if !clusters.insert(cluster) {
                    bail!("[[envoy.members]] cluster {cluster} is listed twice");
                }
                for t in std::iter::once(&m.events).chain(&m.replay) {
                    crate::endpoint_template::EndpointTemplate::parse(t)
                        .with_context(|| format!("[[envoy.members]] {cluster}"))?;
                }
                if m.max_message_bytes == 0 {
                    bail!("[[envoy.members]] {cluster}: max_message_bytes must be positive");
                }
            }
        }
        for z in &self.zmq {
            if let Some(w) = &z.worker {
                // With discovery, a worker may be a Dynamo instance's request-plane address.
                let discovered =
                    !self.dynamo_discovery.is_empty() && w.parse::<SocketAddr>().is_ok();
                if !addresses.contains(w.as_str()) && !discovered {
                    bail!(
                        "[[zmq]] {} names worker {w}, which is not configured (nor, with [[dynamo_discovery]], an instance's ip:port)",
                        z.endpoint
                    );
                }
            }
            if !z.endpoint.starts_with("tcp://") && !z.endpoint.starts_with("ipc://") {
                bail!("[[zmq]] endpoint {} is not tcp:// or ipc://", z.endpoint);
            }
            if z.max_message_bytes == 0 {
                bail!("[[zmq]] {}: max_message_bytes must be positive", z.endpoint);
            }
        }
        if let Some(nats) = &self.nats {
            nats.validate()?;
        }
        let r = &self.routing;
        if !(10..=60_000).contains(&r.scrape_interval_ms) {
            bail!(
                "[routing] scrape_interval_ms = {}: must be 10..=60000",
                r.scrape_interval_ms
            );
        }
        if r.max_hinted_workers == 0 {
            bail!("[routing] max_hinted_workers must be at least 1");
        }
        // A weight multiplies a load that can be 0 (`inf` × 0 is NaN) and a KV usage is a
        // fraction: those must be finite. A slack or a threshold is only compared, so `inf`
        // means "never", as for `home_balance`.
        for (name, v) in [
            ("load_penalty_blocks", r.load_penalty_blocks),
            ("max_kv_usage", r.max_kv_usage.unwrap_or(0.0)),
            ("waiting_kv_usage", r.waiting_kv_usage.unwrap_or(0.0)),
        ] {
            if !v.is_finite() || v < 0.0 {
                bail!("[routing] {name} = {v}: must be a finite number >= 0");
            }
        }
        for (name, v) in [
            ("home_slack", r.home_slack),
            ("spread_slack", r.spread_slack),
            ("spread_idle_slack", r.spread_idle_slack),
            ("spread_demand", r.spread_demand),
            ("saturation_slack", r.saturation_slack),
            ("max_waiting", r.max_waiting),
            ("max_in_flight", r.max_in_flight),
        ] {
            if v.is_nan() || v < 0.0 {
                bail!("[routing] {name} = {v}: must be a number >= 0, or inf (never)");
            }
        }
        if r.home_balance.is_nan() || r.home_balance < 1.0 {
            bail!(
                "[routing] home_balance = {}: must be a number >= 1, or inf (off)",
                r.home_balance
            );
        }
        if let Some(v) = r.home_slack_blocks.filter(|v| v.is_nan() || *v < 0.0) {
            bail!("[routing] home_slack_blocks = {v}: must be a number >= 0, or inf (off)");
        }
        Ok(())
    }
}

/// Alarm thresholds (`[alarms]` in the configuration).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct AlarmConfig {
    /// Seconds without events before `no_events` / `silent_worker` fire.
    pub silence_s: u64,
    /// Hints a worker must have received before `silent_worker` can fire for it.
    pub min_hints: u64,
    /// Seconds of finished requests `stale_index` and `replica_skew` weigh.
    pub truth_window_s: u64,
    /// `stale_index`: the engine reported less than this fraction of the cached tokens the
    /// hints to a worker predicted…
    pub stale_index_ratio: f64,
    /// …over at least this many predicted tokens in the window.
    pub stale_index_min_tokens: u64,
    /// `replica_skew`: a replica's hit rate (cached / prompt tokens its engines reported) is
    /// below this fraction of its peers' together (and 0.05 below it)…
    pub replica_skew_ratio: f64,
    /// …each with at least this many prompt tokens in the window.
    pub replica_skew_min_tokens: u64,
    /// `index_behind` and `replica_prediction_skew`: a replica's prediction error — the cached
    /// tokens its engines reported less the ones its hints predicted, over the prompt tokens —
    /// above this (it under-predicts), or this far from its peers' (either way)…
    pub prediction_gap: f64,
    /// …over at least this many prompt tokens in the window (each side).
    pub prediction_min_tokens: u64,
    /// `replica_divergent`: a cache disagrees with a peer's for this many replica intervals.
    pub divergent_intervals: u32,
}

impl Default for AlarmConfig {
    fn default() -> Self {
        AlarmConfig {
            silence_s: 30,
            min_hints: 20,
            truth_window_s: 60,
            stale_index_ratio: 0.5,
            stale_index_min_tokens: 4096,
            replica_skew_ratio: 0.7,
            replica_skew_min_tokens: 16384,
            prediction_gap: 0.15,
            prediction_min_tokens: 16384,
            divergent_intervals: 5,
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn credentials_are_stripped_from_urls_given_to_clients() {
        assert_eq!(
            without_credentials("nats://user:pa@ss@10.0.0.1:4222"),
            "nats://10.0.0.1:4222"
        );
        assert_eq!(
            without_credentials("tls://token@host:4222/x"),
            "tls://host:4222/x"
        );
        assert_eq!(without_credentials("u:p@host:4222"), "host:4222");
        assert_eq!(without_credentials("nats://host:4222"), "nats://host:4222");
    }

    use super::*;

    const EXAMPLE: &str = r#"
listen = "127.0.0.1:9200"
[nats]
url = "nats://127.0.0.1:4222"
[[models]]
name = "tiny"
dir = "models/tiny"
block_size = 16
[[workers]]
address = "127.0.0.1:8001"
model = "tiny"
dynamo_worker_id = 18446744073709551615
"#;

    #[test]
    fn secrets_in_urls_are_masked() {
        assert_eq!(
            redact_url("nats://u:p4ss@10.0.0.1:4222"),
            "nats://***@10.0.0.1:4222"
        );
        assert_eq!(
            redact_url("tls://tok3n@nats:4222/x"),
            "tls://***@nats:4222/x"
        );
        assert_eq!(redact_url("nats://10.0.0.1:4222"), "nats://10.0.0.1:4222");
        assert_eq!(redact_url("u:p@h:1"), "***@h:1");
        let both =
            "[nats]\nurl = \"nats://h\"\ntoken_file = \"t\"\nuser = \"u\"\npassword_file = \"p\"\n";
        let c: Config = toml::from_str(both).unwrap();
        assert!(c.validate().unwrap_err().to_string().contains("one of"));
    }

    #[test]
    fn bad_numbers_are_refused_naming_the_field() {
        for (extra, field) in [
            ("[routing]\nscrape_interval_ms = 0\n", "scrape_interval_ms"),
            (
                "[routing]\nscrape_interval_ms = 18446744073709551615\n",
                "scrape_interval_ms",
            ),
            (
                "[routing]\nload_penalty_blocks = -1.0\n",
                "load_penalty_blocks",
            ),
            ("[routing]\nmax_hinted_workers = 0\n", "max_hinted_workers"),
        ] {
            let c: Config = toml::from_str(extra).unwrap();
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains(field), "{extra}: {e}");
        }
    }

    /// Unset, `home_slack_blocks` applies to prefill workers only; a number applies to every
    /// worker; `inf` turns it off for all; a negative number is refused.
    #[test]
    fn home_slack_blocks_defaults_by_role() {
        let slack = |toml: &str| {
            let c: Config = toml::from_str(toml).unwrap();
            c.validate().map(|()| {
                let r = &c.routing;
                (
                    r.home_slack_blocks_for(true),
                    r.home_slack_blocks_for(false),
                )
            })
        };
        assert_eq!(slack("").unwrap(), (Some(PREFILL_HOME_SLACK_BLOCKS), None));
        let set = "[routing]\nhome_slack_blocks = 8.0\n";
        assert_eq!(slack(set).unwrap(), (Some(8.0), Some(8.0)));
        let off = "[routing]\nhome_slack_blocks = inf\n";
        assert_eq!(slack(off).unwrap(), (None, None));
        let bad = slack("[routing]\nhome_slack_blocks = -1.0\n").unwrap_err();
        assert!(bad.to_string().contains("home_slack_blocks"), "{bad}");
    }

    /// A slack or a threshold set to `inf` turns its rule off, as `home_balance = inf` does.
    #[test]
    fn slacks_and_thresholds_take_inf_as_never() {
        let toml = format!("{EXAMPLE}[routing]\nspread_slack = inf\nspread_idle_slack = inf\nsaturation_slack = inf\nmax_in_flight = inf\n");
        let c: Config = toml::from_str(&toml).unwrap();
        c.validate().unwrap();
        assert_eq!(c.routing.spread_slack, f64::INFINITY);
    }

    #[test]
    fn parses_and_resolves_dirs() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sidecar.toml");
        std::fs::write(&path, EXAMPLE).unwrap();
        let c = Config::load(&path).unwrap();
        assert_eq!(c.listen.port(), 9200);
        assert_eq!(c.nats.unwrap().subjects, default_subjects());
        assert_eq!(c.models[0].dir, dir.path().join("models/tiny"));
        assert_eq!(c.workers[0].dynamo_worker_id, Some(u64::MAX));
        assert_eq!(c.routing.max_hinted_workers, 3);
    }

    /// In pin mode a `[[zmq]]` entry names a Dynamo instance by its request-plane address.
    #[test]
    fn zmq_may_name_a_discovered_instance() {
        let zmq = "[[zmq]]\nendpoint = \"tcp://h:1\"\nworker = \"127.0.0.1:9\"\n";
        let discovery = "[[dynamo_discovery]]\ndir = \"d\"\nmodel = \"tiny\"\n";
        let c: Config = toml::from_str(&format!("{EXAMPLE}{zmq}{discovery}")).unwrap();
        c.validate().unwrap();
        let etcd = "[[dynamo_discovery]]\netcd = [\"http://etcd:2379\"]\nmodel = \"tiny\"\n";
        let c: Config = toml::from_str(&format!("{EXAMPLE}{etcd}")).unwrap();
        c.validate().unwrap();
        assert_eq!(c.dynamo_discovery[0].store(), "etcd http://etcd:2379");
    }

    #[test]
    fn rejects_inconsistent_configs() {
        for (bad, why) in [
            (
                EXAMPLE.replace("block_size = 16", "block_size = 0"),
                "block_size",
            ),
            (
                EXAMPLE.replace("model = \"tiny\"", "model = \"other\""),
                "not configured",
            ),
            (EXAMPLE.replace("127.0.0.1:8001", "localhost"), "ip:port"),
            (
                format!("{EXAMPLE}[[zmq]]\nendpoint = \"tcp://h:1\"\nworker = \"127.0.0.1:9\"\n"),
                "not configured",
            ),
            (
                EXAMPLE.replace("[nats]", "[nats]\nurll = 1"),
                "unknown field",
            ),
            (
                format!("{EXAMPLE}[[dynamo_discovery]]\nmodel = \"tiny\"\n"),
                "one of them",
            ),
            (
                format!("{EXAMPLE}[[dynamo_discovery]]\nmodel = \"tiny\"\ndir = \"d\"\netcd = [\"http://e:2379\"]\n"),
                "one of them",
            ),
            (
                format!("{EXAMPLE}[[dynamo_discovery]]\nmodel = \"tiny\"\netcd = [\"e:2379\"]\n"),
                "not http://",
            ),
            (
                format!("{EXAMPLE}[envoy]\nadmin_url = \"http://a\"\n[[envoy.members]]\nmodel = \"tiny\"\nevents = \"tcp://10.0.0.1:5557\"\n"),
                "names no host",
            ),
            (
                format!("{EXAMPLE}[envoy]\nadmin_url = \"http://a\"\n[[envoy.members]]\nmodel = \"other\"\nevents = \"tcp://{{host}}:5557\"\n"),
                "not configured",
            ),
            (
                format!("{EXAMPLE}[routing]\nwaiting_kv_usage = -0.5\n"),
                "waiting_kv_usage",
            ),
            (
                format!("{EXAMPLE}[routing]\nload_penalty_blocks = inf\n"),
                "load_penalty_blocks",
            ),
            (
                format!("{EXAMPLE}[routing]\nspread_slack = nan\n"),
                "spread_slack",
            ),
        ] {
            let err = toml::from_str::<Config>(&bad)
                .map_err(anyhow::Error::from)
                .and_then(|c| c.validate())
                .unwrap_err();
            assert!(format!("{err:#}").contains(why), "{why}: {err:#}");
        }
    }
}
