//! Dynamo's discovery records: which instances serve a model, where, and in which role.
//!
//! Two stores hold the same keys and the same JSON values ([`Store`]): etcd (Dynamo's default,
//! `--discovery-backend etcd`, `ETCD_ENDPOINTS`; each key `v1/<bucket>/<key>` on the worker's
//! lease, 10 s, so it vanishes when the worker dies) and the file store (`--discovery-backend
//! file`, root `DYN_FILE_KV`). Both are polled; a scan reads what either returned ([`Records`]).
//!
//! Dynamo 1.6's file store (`--discovery-backend file`, root `DYN_FILE_KV`) keeps one JSON file per key in a
//! bucket directory, the key percent-encoded into a flat file name:
//! - `v1/instances/dynamo%2Fbackend%2Fgenerate%2F<instance hex>`: an `Endpoint` record
//!   (`{"type": "Endpoint", "namespace", "component", "endpoint", "instance_id",
//!   "transport": {"tcp": "ip:port/…"}}`); aggregated and decode workers register under
//!   `backend`, prefill workers under `prefill`; each worker also registers helper endpoints
//!   (`worker_kv_query_source_…`), which are not request targets;
//! - `v1/mdc/dynamo%2Fbackend%2Fgenerate%2F<instance hex>`: the model card (`card_json`:
//!   `display_name`, `worker_type` = `aggregated` | `prefill` | `decode`, `kv_cache_block_size`,
//!   `runtime_config.total_kv_blocks`). Absent when the worker self-hosts its card;
//! - `v1/event_channels/namespace%2F<ns>%2Fcomponent%2F<comp>%2Fendpoint%2F<ep>%2Ftopic%2F<topic>%2F<id hex>`:
//!   an `EventChannel` record per publisher and topic (`kv-events`, `kv_metrics`, …):
//!   `{"scope": {"kind": "endpoint", "endpoint": {namespace, component, name}}, "topic",
//!   "instance_id", "transport": {"kind": "Zmq", "config": {"endpoint": "tcp://…"}}}` on Dynamo's
//!   default event plane (`Nats` with a `subject_prefix` under `--event-plane nats`). Its
//!   `instance_id` is the publisher's id (the ZMQ messages' second frame), not the worker's; the
//!   worker registers a helper endpoint `worker_kv_query_source_<publisher hex>` under its own
//!   instance id, which ties a `kv-events` channel to its worker.
//!
//! Records are refreshed every few seconds and removed about 8 s after their worker dies
//! (measured: SIGKILL to removal, 7.8 s). Nested directories (`v1/instances/<ns>/<component>/
//! <endpoint>/<id>`) are read too: the key is the path either way, and the record's own fields
//! decide.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use kvroute_protocol::dynamo::KV_EVENTS_TOPIC;

use crate::config::DiscoveryConfig;
use crate::core::fleet::Role;
use crate::core::{DiscoveredInstance, Input};
use crate::sidecar::Sidecar;

/// One `Endpoint` record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointRecord {
    /// Dynamo namespace.
    pub namespace: String,
    /// Component (`backend`, `prefill`, …).
    pub component: String,
    /// Endpoint (`generate`, or a helper endpoint).
    pub endpoint: String,
    /// The instance id (the `worker_id` of its KV events).
    pub instance_id: u64,
    /// Its request-plane `ip:port` (`dynamo` when it has no TCP transport).
    pub address: String,
}

/// One model card (`Model` record).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelCard {
    /// The instance it describes.
    pub instance_id: u64,
    /// The served model's name (`display_name`).
    pub model: String,
    /// `worker_type`, when it is one of the known roles.
    pub role: Option<Role>,
    /// The engine's KV block size.
    pub block_size: Option<u32>,
    /// The engine's cache capacity, in blocks.
    pub total_kv_blocks: Option<u64>,
}

/// An instance record: the endpoint it serves, or why the file is not one.
pub fn parse_endpoint(bytes: &[u8]) -> Result<EndpointRecord, String> {
    let v: Value = serde_json::from_slice(bytes).map_err(|e| format!("not JSON: {e}"))?;
    match v.get("type").and_then(Value::as_str) {
        None | Some("Endpoint") => {}
        Some(other) => return Err(format!("a {other} record, not an Endpoint")),
    }
    let id = v
        .get("instance_id")
        .and_then(Value::as_u64)
        .ok_or("no u64 instance_id")?;
    let field = |name: &str| v.get(name).and_then(Value::as_str).unwrap_or("").to_owned();
    // "127.0.0.1:40051/bda8d114129d4c8f/dynamo/backend/generate": the address is before the path.
    let tcp = v
        .pointer("/transport/tcp")
        .and_then(Value::as_str)
        .unwrap_or("");
    let address = tcp.split('/').next().unwrap_or("");
    Ok(EndpointRecord {
        namespace: field("namespace"),
        component: field("component"),
        endpoint: field("endpoint"),
        instance_id: id,
        address: if address.is_empty() {
            "dynamo".into()
        } else {
            address.to_owned()
        },
    })
}

/// A model card, or why the file is not one.
pub fn parse_card(bytes: &[u8]) -> Result<ModelCard, String> {
    let v: Value = serde_json::from_slice(bytes).map_err(|e| format!("not JSON: {e}"))?;
    if v.get("type").and_then(Value::as_str) != Some("Model") {
        return Err("not a Model record".into());
    }
    let id = v
        .get("instance_id")
        .and_then(Value::as_u64)
        .ok_or("no u64 instance_id")?;
    let card = v.get("card_json").ok_or("no card_json")?;
    let model = card
        .get("display_name")
        .and_then(Value::as_str)
        .ok_or("no display_name")?;
    let role = match card.get("worker_type").and_then(Value::as_str) {
        Some("aggregated") => Some(Role::Aggregated),
        Some("prefill") => Some(Role::Prefill),
        Some("decode") => Some(Role::Decode),
        _ => None,
    };
    Ok(ModelCard {
        instance_id: id,
        model: model.to_owned(),
        role,
        block_size: card
            .get("kv_cache_block_size")
            .and_then(Value::as_u64)
            .and_then(|b| u32::try_from(b).ok()),
        total_kv_blocks: card
            .pointer("/runtime_config/total_kv_blocks")
            .and_then(Value::as_u64),
    })
}

/// How an event channel's publisher can be reached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChannelTransport {
    /// Dynamo's default event plane: a ZMQ PUB socket bound at this endpoint (`tcp://ip:port`).
    Zmq(String),
    /// `--event-plane nats`: NATS subjects under this prefix.
    Nats(String),
    /// A transport this sidecar does not read.
    Other(String),
}

/// One `EventChannel` record: a publisher of one topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventChannel {
    /// Dynamo namespace of its scope.
    pub namespace: String,
    /// Component of its scope (empty for a namespace-wide channel).
    pub component: String,
    /// `kv-events`, `kv_metrics`, `forward-pass-metrics`, …
    pub topic: String,
    /// The publisher id (the record's `instance_id`; the messages' second frame).
    pub publisher_id: u64,
    /// Where it publishes.
    pub transport: ChannelTransport,
    /// The worker's instance id, when a `worker_kv_query_source_<publisher hex>` record names
    /// it (Dynamo registers one per `kv-events` channel).
    pub worker: Option<u64>,
}

impl EventChannel {
    /// `namespace/component`, as the core binds workers to components.
    pub fn component_path(&self) -> String {
        format!("{}/{}", self.namespace, self.component)
    }

    /// The ZMQ endpoint, when it publishes on ZMQ.
    pub fn zmq_endpoint(&self) -> Option<&str> {
        match &self.transport {
            ChannelTransport::Zmq(endpoint) => Some(endpoint),
            _ => None,
        }
    }
}

/// The prefix of the helper endpoint a worker registers for each of its `kv-events` channels;
/// the publisher id in hex follows.
const KV_QUERY_SOURCE: &str = "worker_kv_query_source_";

/// One discovery entry's handle on an event plane that follows publishers (the Dynamo ZMQ
/// plane, `crate::transports::dynamo_zmq`): where its scans send their channels, and how it
/// hears that a publisher went away (its worker's request plane is then probed at once).
#[derive(Debug, Clone)]
pub struct Follow {
    entry: usize,
    tx: std::sync::mpsc::Sender<(usize, Vec<EventChannel>)>,
    gone: tokio::sync::watch::Receiver<u64>,
}

impl Follow {
    /// The entry's channels as its last scan found them (every topic and transport; this
    /// transport keeps the ZMQ `kv-events` and `kv_metrics` ones).
    pub fn publishers(&self, channels: Vec<EventChannel>) {
        // The thread lives as long as the process: a send cannot fail but at exit.
        let _ = self.tx.send((self.entry, channels));
    }

    /// Entry `entry`'s handle on a plane that takes channels on `tx` and bumps `gone` when a
    /// publisher leaves.
    pub fn new(
        entry: usize,
        tx: std::sync::mpsc::Sender<(usize, Vec<EventChannel>)>,
        gone: tokio::sync::watch::Receiver<u64>,
    ) -> Self {
        Follow { entry, tx, gone }
    }

    /// Resolves when a `kv-events` publisher's connection closed since the last call: a
    /// worker probably stopped.
    pub async fn publisher_left(&mut self) {
        if self.gone.changed().await.is_err() {
            // The plane's thread is gone (the process ends): nothing more will leave.
            std::future::pending::<()>().await;
        }
    }
}

/// `endpoint` (`tcp://host:port`) with a wildcard host (`0.0.0.0`, `[::]`, `*`) replaced by the
/// host of `address` (`ip:port`, a worker's request plane); otherwise unchanged.
pub fn reachable(endpoint: &str, address: &str) -> String {
    let Some(rest) = endpoint.strip_prefix("tcp://") else {
        return endpoint.to_owned();
    };
    let Some((host, port)) = rest.rsplit_once(':') else {
        return endpoint.to_owned();
    };
    let Some((worker_host, _)) = address.rsplit_once(':') else {
        return endpoint.to_owned();
    };
    match host {
        "0.0.0.0" | "[::]" | "*" => format!("tcp://{worker_host}:{port}"),
        _ => endpoint.to_owned(),
    }
}

/// An event-channel record, or why the file is not one.
pub fn parse_event_channel(bytes: &[u8]) -> Result<EventChannel, String> {
    let v: Value = serde_json::from_slice(bytes).map_err(|e| format!("not JSON: {e}"))?;
    if v.get("type").and_then(Value::as_str) != Some("EventChannel") {
        return Err("not an EventChannel record".into());
    }
    let publisher_id = v
        .get("instance_id")
        .and_then(Value::as_u64)
        .ok_or("no u64 instance_id")?;
    let topic = v
        .get("topic")
        .and_then(Value::as_str)
        .ok_or("no topic")?
        .to_owned();
    // `{"kind": "endpoint", "endpoint": {namespace, component, name}}`; a component scope
    // names its component `name`.
    let scope = v.get("scope").ok_or("no scope")?;
    let kind = scope.get("kind").and_then(Value::as_str).unwrap_or("");
    let inner = scope.get(kind).unwrap_or(scope);
    let text = |name: &str| inner.get(name).and_then(Value::as_str);
    let namespace = text("namespace").ok_or("no scope namespace")?.to_owned();
    let component = text("component")
        .or_else(|| (kind == "component").then(|| text("name")).flatten())
        .unwrap_or("")
        .to_owned();
    let config = |name: &str| {
        v.pointer(&format!("/transport/config/{name}"))
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned()
    };
    let transport = match v.pointer("/transport/kind").and_then(Value::as_str) {
        Some("Zmq") => match config("endpoint") {
            e if e.is_empty() => return Err("a Zmq channel without an endpoint".into()),
            e => ChannelTransport::Zmq(e),
        },
        Some("Nats") => ChannelTransport::Nats(config("subject_prefix")),
        other => ChannelTransport::Other(other.unwrap_or("none").to_owned()),
    };
    Ok(EventChannel {
        namespace,
        component,
        topic,
        publisher_id,
        transport,
        worker: None,
    })
}

/// An instance kvroute may route to, or knows the frontend routes to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Instance {
    /// Request-plane `ip:port`.
    pub address: String,
    /// Its namespace.
    pub namespace: String,
    /// Its component.
    pub component: String,
    /// Its role.
    pub role: Role,
    /// Cache capacity in blocks, from its model card.
    pub total_kv_blocks: Option<u64>,
    /// KV block size, from its model card.
    pub block_size: Option<u32>,
}

/// One read of the discovery root for one `[[dynamo_discovery]]` entry.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scan {
    /// The entry's instances, by instance id.
    pub instances: BTreeMap<u64, Instance>,
    /// Every instance record read, matching or not.
    pub records: usize,
    /// `namespace/component/endpoint` of every record that did not match, with counts: what
    /// the no-instances warning shows.
    pub elsewhere: BTreeMap<String, usize>,
    /// The entry's event channels (its namespace, and component when one is configured), by
    /// publisher id.
    pub channels: BTreeMap<u64, EventChannel>,
}

impl Scan {
    /// Instances kvroute pins requests to (not decode workers).
    pub fn hintable(&self) -> usize {
        self.instances
            .values()
            .filter(|i| i.role != Role::Decode)
            .count()
    }

    /// `kv-events` publishers found: (on ZMQ, on NATS).
    pub fn kv_publishers(&self) -> (usize, usize) {
        let kv = self
            .channels
            .values()
            .filter(|c| c.topic == KV_EVENTS_TOPIC);
        kv.fold((0, 0), |(zmq, nats), c| match c.transport {
            ChannelTransport::Zmq(_) => (zmq + 1, nats),
            ChannelTransport::Nats(_) => (zmq, nats + 1),
            ChannelTransport::Other(_) => (zmq, nats),
        })
    }

    /// How many instances of a role.
    pub fn count(&self, role: Role) -> usize {
        self.instances.values().filter(|i| i.role == role).count()
    }

    /// The instances as the core takes them.
    pub fn instances(&self) -> Vec<DiscoveredInstance> {
        self.instances
            .iter()
            .map(|(&instance_id, i)| DiscoveredInstance {
                instance_id,
                address: i.address.clone(),
                role: i.role,
                component: format!("{}/{}", i.namespace, i.component),
                capacity: i.total_kv_blocks,
            })
            .collect()
    }
}

/// How deep nested layouts go below a bucket (`<ns>/<component>/<endpoint>/<id>`).
const MAX_DEPTH: usize = 4;
/// The same for event channels (`namespace/<ns>/component/<comp>/endpoint/<ep>/topic/<t>/<id>`).
const MAX_CHANNEL_DEPTH: usize = 10;

/// Every record file under a bucket directory, flat or nested; a missing bucket holds none.
fn record_files(bucket: &Path, max_depth: usize) -> std::io::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut dirs = vec![(bucket.to_path_buf(), 0)];
    while let Some((dir, depth)) = dirs.pop() {
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) if depth == 0 => return Err(e),
            Err(_) => continue,
        };
        for entry in entries.flatten() {
            if entry.file_name().to_string_lossy().starts_with('.') {
                continue;
            }
            let path = entry.path();
            if path.is_dir() {
                if depth < max_depth {
                    dirs.push((path, depth + 1));
                }
            } else if path.is_file() {
                out.push(path);
            }
        }
    }
    Ok(out)
}

/// The records of one read of a store, by bucket (key order is not kept: the values say it all).
#[derive(Debug, Clone, Default)]
pub struct Records {
    /// `v1/mdc`: model cards.
    pub cards: Vec<Vec<u8>>,
    /// `v1/instances`: endpoint records.
    pub instances: Vec<Vec<u8>>,
    /// `v1/event_channels`: event-channel records.
    pub channels: Vec<Vec<u8>>,
}

impl Records {
    /// Sort `(key, value)` pairs of a key-value store into buckets (other keys are not records).
    pub fn from_entries(entries: impl IntoIterator<Item = (String, Vec<u8>)>) -> Self {
        let mut records = Records::default();
        for (key, value) in entries {
            let bucket = match key.split('/').take(2).collect::<Vec<_>>()[..] {
                ["v1", "mdc"] => &mut records.cards,
                ["v1", "instances"] => &mut records.instances,
                ["v1", "event_channels"] => &mut records.channels,
                _ => continue,
            };
            bucket.push(value);
        }
        records
    }
}

/// Where one `[[dynamo_discovery]]` entry reads its records.
#[derive(Debug, Clone)]
pub enum Store {
    /// Dynamo's file store under this root.
    Dir(PathBuf),
    /// etcd at these client URLs (first that answers).
    Etcd(Vec<String>),
}

impl Store {
    /// The store `config` names.
    pub fn of(config: &DiscoveryConfig) -> Self {
        match &config.dir {
            Some(dir) => Store::Dir(dir.clone()),
            None => Store::Etcd(config.etcd.clone()),
        }
    }

    /// Every record, now.
    pub async fn read(&self, http: &reqwest::Client) -> anyhow::Result<Records> {
        match self {
            Store::Dir(root) => {
                let root = root.clone();
                Ok(tokio::task::spawn_blocking(move || read_dir(&root)).await??)
            }
            Store::Etcd(endpoints) => {
                let entries = super::etcd::range_prefix(http, endpoints, "v1/").await?;
                Ok(Records::from_entries(entries))
            }
        }
    }
}

/// Every record of the file store under `root` (the directory holding `v1/`). A record being
/// rewritten may be empty or cut: it is skipped by its parser this scan.
pub fn read_dir(root: &Path) -> std::io::Result<Records> {
    let read = |bucket: &str, depth: usize| -> std::io::Result<Vec<Vec<u8>>> {
        Ok(record_files(&root.join(bucket), depth)?
            .into_iter()
            .filter_map(|path| std::fs::read(path).ok())
            .collect())
    };
    Ok(Records {
        cards: read("v1/mdc", MAX_DEPTH)?,
        instances: read("v1/instances", MAX_DEPTH)?,
        channels: read("v1/event_channels", MAX_CHANNEL_DEPTH)?,
    })
}

/// Read the instance records and model cards of `records` and keep `config`'s: its namespace and endpoint, any component unless one is configured, and
/// not an instance whose model card names another model. Roles come from the model cards; without
/// one, component `prefill` is a prefill worker and, when there are prefill workers, the others
/// are decode workers.
pub fn scan(records: &Records, config: &DiscoveryConfig) -> Scan {
    let mut cards: BTreeMap<u64, ModelCard> = BTreeMap::new();
    for bytes in &records.cards {
        if let Ok(card) = parse_card(bytes) {
            cards.insert(card.instance_id, card);
        }
    }
    let mut scan = Scan::default();
    let mut found = Vec::new();
    // Publisher id -> the worker whose `worker_kv_query_source_<publisher hex>` record it is,
    // and that worker's request-plane address.
    let mut query_sources: BTreeMap<u64, (u64, String)> = BTreeMap::new();
    for bytes in &records.instances {
        let record = match parse_endpoint(bytes) {
            Ok(r) => r,
            Err(why) => {
                tracing::debug!(%why, "not an instance record");
                continue;
            }
        };
        scan.records += 1;
        if let Some(hex) = record.endpoint.strip_prefix(KV_QUERY_SOURCE) {
            if let Ok(publisher) = u64::from_str_radix(hex, 16) {
                query_sources.insert(publisher, (record.instance_id, record.address.clone()));
            }
        }
        let card = cards.get(&record.instance_id);
        let matches = record.namespace == config.namespace
            && record.endpoint == config.endpoint
            && config
                .component
                .as_ref()
                .is_none_or(|c| *c == record.component)
            && card.is_none_or(|c| c.model == config.model);
        if matches {
            found.push((record, card));
        } else {
            *scan
                .elsewhere
                .entry(format!(
                    "{}/{}/{}",
                    record.namespace, record.component, record.endpoint
                ))
                .or_default() += 1;
        }
    }
    let disaggregated = found.iter().any(|(r, card)| {
        card.and_then(|c| c.role) == Some(Role::Prefill) || r.component == "prefill"
    });
    for (record, card) in found {
        let role = card.and_then(|c| c.role).unwrap_or(match () {
            _ if record.component == "prefill" => Role::Prefill,
            _ if disaggregated => Role::Decode,
            _ => Role::Aggregated,
        });
        scan.instances.insert(
            record.instance_id,
            Instance {
                address: record.address,
                namespace: record.namespace,
                component: record.component,
                role,
                total_kv_blocks: card.and_then(|c| c.total_kv_blocks),
                block_size: card.and_then(|c| c.block_size),
            },
        );
    }
    for bytes in &records.channels {
        let Ok(mut channel) = parse_event_channel(bytes) else {
            continue;
        };
        let ours = channel.namespace == config.namespace
            && config
                .component
                .as_ref()
                .is_none_or(|c| *c == channel.component);
        let source = query_sources.get(&channel.publisher_id);
        channel.worker = source.map(|(id, _)| *id);
        // A publisher bound on every interface advertises it as such: reach it at its worker's
        // host.
        if let (ChannelTransport::Zmq(endpoint), Some((_, address))) =
            (&mut channel.transport, source)
        {
            *endpoint = reachable(endpoint, address);
        }
        // A worker with a record that is not this entry's (another model) publishes for it.
        let theirs = channel.worker.is_some_and(|w| {
            !scan.instances.contains_key(&w)
                && cards.get(&w).is_some_and(|c| c.model != config.model)
        });
        if ours && !theirs {
            scan.channels.insert(channel.publisher_id, channel);
        }
    }
    scan
}

/// Probes in a row that must fail before an instance counts as down.
const PROBE_FAILURES: u32 = 2;

/// Poll the directory forever, applying each scan to the registry, and probe every pinned
/// instance's request plane between scans. Each scan's event channels go to `channels` (the
/// Dynamo ZMQ event plane), when given.
pub async fn run(
    config: DiscoveryConfig,
    state: Arc<Sidecar>,
    channels: Option<Follow>,
) -> anyhow::Result<()> {
    let entry = state.discovery_source(&config);
    let store = Store::of(&config);
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()?;
    tracing::info!(store = %config.store(), model = %config.model, namespace = %config.namespace, "reading Dynamo discovery records");
    let mut scans = tokio::time::interval(Duration::from_millis(config.poll_interval_ms.max(50)));
    scans.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut probes = tokio::time::interval(Duration::from_millis(
        config.probe_interval_ms.clamp(50, 3_600_000),
    ));
    probes.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    let mut last_summary = String::new();
    let mut last = Scan::default();
    // Consecutive failed probes per instance id.
    let mut failed: BTreeMap<u64, u32> = BTreeMap::new();
    let mut channels = channels;
    let has_channels = channels.is_some() && config.probe_interval_ms > 0;
    loop {
        tokio::select! {
            _ = scans.tick() => {}
            _ = probes.tick(), if config.probe_interval_ms > 0 => {
                if probe_all(&config, &last, &mut failed).await {
                    apply(&state, &config, &last, &down(&failed));
                }
                continue;
            }
            // A KV-event publisher's connection closed: its worker probably stopped. Probe
            // now, as many times as it takes to call an instance down, rather than pin
            // requests to a dead worker until the next probes (or its record goes, ~8 s).
            _ = async { channels.as_mut().expect("guarded").publisher_left().await }, if has_channels => {
                let mut changed = false;
                for _ in 0..PROBE_FAILURES {
                    changed |= probe_all(&config, &last, &mut failed).await;
                }
                if changed {
                    apply(&state, &config, &last, &down(&failed));
                }
                continue;
            }
        }
        match store.read(&http).await {
            Ok(records) => {
                let found = scan(&records, &config);
                if failing {
                    tracing::info!(store = %config.store(), "reading Dynamo discovery records again");
                }
                failing = false;
                let summary = summary(&config, &found);
                if summary != last_summary {
                    if found.hintable() == 0 {
                        tracing::warn!(alarm = "no_instances", "{summary}");
                    } else {
                        tracing::info!("{summary}");
                    }
                    last_summary = summary.clone();
                }
                entry.found(found.hintable(), summary, found.kv_publishers());
                failed.retain(|id, _| found.instances.contains_key(id));
                apply(&state, &config, &found, &down(&failed));
                // After the instances: their workers are known when their events arrive.
                if let Some(follow) = &channels {
                    follow.publishers(found.channels.values().cloned().collect());
                }
                last = found;
            }
            Err(e) => {
                let error = format!("{e:#}");
                if !failing {
                    tracing::error!(store = %config.store(), %error, "cannot read Dynamo's discovery records; instances keep their last state");
                }
                failing = true;
                entry.failed(error, std::time::Instant::now());
            }
        }
    }
}

/// Hand a scan to the sidecar.
fn apply(
    state: &Sidecar,
    config: &DiscoveryConfig,
    scan: &Scan,
    unreachable: &std::collections::BTreeSet<u64>,
) {
    let instances = scan.instances();
    let input = Input::Discovery {
        model: &config.model,
        instances: &instances,
        unreachable,
    };
    state.ingest(input, std::time::Instant::now());
}

/// The instances whose last probes all failed.
fn down(failed: &BTreeMap<u64, u32>) -> std::collections::BTreeSet<u64> {
    failed
        .iter()
        .filter(|(_, n)| **n >= PROBE_FAILURES)
        .map(|(id, _)| *id)
        .collect()
}

/// TCP-connect every pinned instance of `scan` at once (connect only: Dynamo's request plane
/// logs nothing for a connection closed before its handshake); whether any instance went down
/// or came back.
async fn probe_all(config: &DiscoveryConfig, scan: &Scan, failed: &mut BTreeMap<u64, u32>) -> bool {
    let timeout = Duration::from_millis(config.probe_timeout_ms.max(1));
    let probes = scan
        .instances
        .iter()
        .filter(|(_, i)| i.role != Role::Decode)
        .filter_map(|(id, i)| Some((*id, i.address.parse::<std::net::SocketAddr>().ok()?)))
        .map(|(id, address)| async move {
            let up = matches!(
                tokio::time::timeout(timeout, tokio::net::TcpStream::connect(address)).await,
                Ok(Ok(_))
            );
            (id, address, up)
        });
    let mut changed = false;
    for (id, address, up) in futures::future::join_all(probes).await {
        let n = failed.entry(id).or_default();
        let was_down = *n >= PROBE_FAILURES;
        *n = if up { 0 } else { n.saturating_add(1) };
        let is_down = *n >= PROBE_FAILURES;
        if is_down != was_down {
            changed = true;
            if is_down {
                tracing::warn!(instance_id = id, %address, "Dynamo instance's request plane refuses connections: not pinned until it answers again");
            } else {
                tracing::info!(instance_id = id, %address, "Dynamo instance answers again");
            }
        }
    }
    changed
}

/// One line saying what a scan found for `config`, and where to look when it found nothing.
pub fn summary(config: &DiscoveryConfig, scan: &Scan) -> String {
    let (agg, prefill, decode) = (
        scan.count(Role::Aggregated),
        scan.count(Role::Prefill),
        scan.count(Role::Decode),
    );
    let wanted = format!(
        "{}/{}/{}",
        config.namespace,
        config.component.as_deref().unwrap_or("*"),
        config.endpoint
    );
    if scan.hintable() > 0 {
        let zmq = scan
            .channels
            .values()
            .filter(|c| {
                c.zmq_endpoint().is_some() && c.topic == kvroute_protocol::dynamo::KV_EVENTS_TOPIC
            })
            .count();
        return format!(
            "Dynamo discovery for model {}: {agg} aggregated, {prefill} prefill, {decode} decode instances ({wanted}); {zmq} KV-event publishers on ZMQ",
            config.model
        );
    }
    let elsewhere: Vec<String> = scan
        .elsewhere
        .iter()
        .map(|(k, n)| format!("{k} ({n})"))
        .collect();
    format!(
        "Dynamo discovery for model {} found no instance to pin requests to in {} ({wanted}; {decode} decode instances): every request falls back to the frontend's own routing. Instance records read: {}{}. Check {}, and the namespace and model name.",
        config.model,
        config.store(),
        scan.records,
        if elsewhere.is_empty() {
            String::new()
        } else {
            format!(", for other endpoints: [{}]", elsewhere.join(", "))
        },
        match config.dir {
            Some(_) => "`dir` is the workers' DYN_FILE_KV",
            None => "`etcd` is the workers' ETCD_ENDPOINTS and they run with --discovery-backend etcd",
        }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan_dir(root: &Path, config: &DiscoveryConfig) -> std::io::Result<Scan> {
        Ok(scan(&read_dir(root)?, config))
    }

    fn config(dir: &Path) -> DiscoveryConfig {
        DiscoveryConfig::new(dir.to_path_buf(), "tiny-llama")
    }

    fn captured(name: &str) -> PathBuf {
        kvroute_protocol::samples_dir().join("dynamo").join(name)
    }

    #[test]
    fn reads_the_captured_records() {
        let instance = std::fs::read(captured("discovery_instance_record.json")).unwrap();
        let record = parse_endpoint(&instance).unwrap();
        assert_eq!(
            (record.instance_id, record.address.as_str()),
            (13666402953397619855, "127.0.0.1:40051")
        );
        assert_eq!(
            (record.component.as_str(), record.endpoint.as_str()),
            ("backend", "generate")
        );
        for other in [
            "discovery_event_channel_record.json",
            "discovery_event_source_record.json",
        ] {
            let bytes = std::fs::read(captured(other)).unwrap();
            assert!(parse_endpoint(&bytes).is_err(), "{other}");
            assert!(parse_card(&bytes).is_err(), "{other}");
        }
        assert!(parse_endpoint(b"{").is_err());
        assert!(parse_endpoint(br#"{"type":"Endpoint","instance_id":-1}"#).is_err());
    }

    /// The discovery root Dynamo 1.6.1 wrote for one aggregated worker and one prefill/decode
    /// pair (flat, percent-encoded file names; model cards beside the instances).
    #[test]
    fn reads_dynamo_1_6_flat_layout_with_roles() {
        let root = captured("discovery-1.6.1-disaggregated");
        let found = scan_dir(&root, &config(&root)).unwrap();
        let roles: Vec<(Role, &str)> = found
            .instances
            .values()
            .map(|i| (i.role, i.component.as_str()))
            .collect();
        assert_eq!(found.count(Role::Prefill), 1, "{roles:?}");
        assert_eq!(found.count(Role::Decode), 1, "{roles:?}");
        assert_eq!(found.hintable(), 1);
        let prefill = found
            .instances
            .values()
            .find(|i| i.role == Role::Prefill)
            .unwrap();
        assert_eq!(prefill.component, "prefill");
        assert_eq!(prefill.total_kv_blocks, Some(128));
        assert_eq!(prefill.block_size, Some(16));
        assert!(prefill.address.starts_with("127.0.0.1:"), "{prefill:?}");
        assert!(
            found
                .elsewhere
                .keys()
                .any(|k| k.contains("worker_kv_query_source")),
            "helper endpoints are read and left out: {:?}",
            found.elsewhere
        );

        let mut other_model = config(&root);
        other_model.model = "another".into();
        let none = scan_dir(&root, &other_model).unwrap();
        assert_eq!(none.hintable(), 0, "the model cards name tiny-llama");
        let line = summary(&other_model, &none);
        assert!(line.contains("found no instance"), "{line}");
        assert!(line.contains("dynamo/prefill/generate (1)"), "{line}");
    }

    /// Without model cards (workers that self-host them) the component decides: `prefill` is a
    /// prefill worker and, beside prefill workers, `backend` instances decode.
    #[test]
    fn roles_without_model_cards() {
        let dir = tempfile::tempdir().unwrap();
        let instances = dir.path().join("v1/instances");
        std::fs::create_dir_all(&instances).unwrap();
        let record = |component: &str, id: u64, port: u16| {
            let body = serde_json::json!({"type": "Endpoint", "namespace": "dynamo", "component": component,
                "endpoint": "generate", "instance_id": id, "transport": {"tcp": format!("127.0.0.1:{port}/{id:x}")}});
            std::fs::write(
                instances.join(format!("dynamo%2F{component}%2Fgenerate%2F{id:x}")),
                body.to_string(),
            )
            .unwrap();
        };
        record("backend", 1, 1001);
        let found = scan_dir(dir.path(), &config(dir.path())).unwrap();
        assert_eq!(found.instances[&1].role, Role::Aggregated);
        record("prefill", 2, 1002);
        std::fs::write(instances.join("partial"), b"{\"type\":").unwrap();
        let found = scan_dir(dir.path(), &config(dir.path())).unwrap();
        assert_eq!(found.instances[&1].role, Role::Decode);
        assert_eq!(found.instances[&2].role, Role::Prefill);
        assert_eq!(found.records, 2, "a cut record is skipped");
    }

    /// Nested directories (`<ns>/<component>/<endpoint>/<id>`) hold the same records.
    #[test]
    fn reads_nested_directories() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("v1/instances/dynamo/backend/generate");
        assert!(scan_dir(root.path(), &config(root.path()))
            .unwrap()
            .instances
            .is_empty());
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(
            captured("discovery_instance_record.json"),
            dir.join("bda8d114129d4c8f"),
        )
        .unwrap();
        let found = scan_dir(root.path(), &config(root.path())).unwrap();
        assert_eq!(
            found.instances[&13666402953397619855].address,
            "127.0.0.1:40051"
        );
        assert_eq!(
            found.instances[&13666402953397619855].role,
            Role::Aggregated
        );
    }
    /// Write `records_json` (key -> record, as the capture's README describes) into `bucket`
    /// under `root` the way Dynamo's file backend does: one file per key, flat, percent-encoded.
    fn write_records(root: &Path, bucket: &str, records_json: &str) -> Vec<PathBuf> {
        let dir = root.join("v1").join(bucket);
        std::fs::create_dir_all(&dir).unwrap();
        let bytes = std::fs::read(captured(&format!("zmq-default-plane/{records_json}"))).unwrap();
        let records: serde_json::Map<String, Value> = serde_json::from_slice(&bytes).unwrap();
        records
            .iter()
            .map(|(key, record)| {
                let name = key.replace('_', "%5F").replace('/', "%2F");
                let path = dir.join(name);
                std::fs::write(&path, record.to_string()).unwrap();
                path
            })
            .collect()
    }

    /// The discovery root of a default Dynamo 1.6.1 fleet (no `--event-plane`): every
    /// publisher is a ZMQ event channel, and each `kv-events` one is tied to its worker by the
    /// `worker_kv_query_source_<publisher hex>` record.
    #[test]
    fn reads_the_zmq_event_channels_of_a_default_fleet() {
        let root = tempfile::tempdir().unwrap();
        write_records(root.path(), "instances", "instances_records.json");
        write_records(root.path(), "mdc", "mdc_records.json");
        let channels = write_records(root.path(), "event_channels", "event_channel_records.json");
        let mut config = DiscoveryConfig::new(root.path(), "tiny");
        let found = scan_dir(root.path(), &config).unwrap();
        assert_eq!(found.count(Role::Aggregated), 2, "{found:?}");
        assert_eq!(found.channels.len(), 8, "{:?}", found.channels);
        let kv: Vec<&EventChannel> = found
            .channels
            .values()
            .filter(|c| c.topic == "kv-events")
            .collect();
        assert_eq!(kv.len(), 2);
        for c in &kv {
            let worker = c.worker.expect("tied to its worker");
            assert!(found.instances.contains_key(&worker), "{c:?}");
            assert_ne!(worker, c.publisher_id);
            assert!(c.zmq_endpoint().unwrap().starts_with("tcp://127.0.0.1:"));
            assert_eq!(c.component_path(), "dynamo/backend");
        }
        assert_eq!(
            found.channels[&0x572029c44fc55].worker,
            Some(16607851000334464958)
        );
        assert_eq!(
            found.channels[&0x572029c44fc55].transport,
            ChannelTransport::Zmq("tcp://127.0.0.1:42701".into())
        );
        let line = summary(&config, &found);
        assert!(line.contains("2 KV-event publishers on ZMQ"), "{line}");

        // Another model's entry does not follow these workers' KV events.
        config.model = "another".into();
        let theirs = scan_dir(root.path(), &config).unwrap();
        assert!(
            theirs.channels.values().all(|c| c.topic != "kv-events"),
            "{theirs:?}"
        );
        config.model = "tiny".into();

        // Another namespace has none of them; another component neither.
        config.namespace = "other".into();
        assert!(scan_dir(root.path(), &config).unwrap().channels.is_empty());
        config.namespace = "dynamo".into();
        config.component = Some("prefill".into());
        assert!(scan_dir(root.path(), &config).unwrap().channels.is_empty());
        config.component = None;

        // Records appear and vanish like instance records.
        let gone = channels
            .iter()
            .find(|p| p.to_string_lossy().ends_with("572029c44fc55"))
            .unwrap();
        std::fs::remove_file(gone).unwrap();
        let found = scan_dir(root.path(), &config).unwrap();
        assert_eq!(found.channels.len(), 7);
        assert!(!found.channels.contains_key(&0x572029c44fc55));
    }

    #[test]
    fn event_channel_records_of_both_planes() {
        let nats = std::fs::read(captured("discovery_event_channel_record.json")).unwrap();
        let c = parse_event_channel(&nats).unwrap();
        assert_eq!(
            c.transport,
            ChannelTransport::Nats("namespace.dynamo.component.backend.endpoint.generate".into())
        );
        assert_eq!(
            (c.topic.as_str(), c.publisher_id),
            ("kv-events", 570174152145588)
        );
        assert_eq!(c.zmq_endpoint(), None);
        let instance = std::fs::read(captured("discovery_instance_record.json")).unwrap();
        assert!(parse_event_channel(&instance).is_err());
        assert!(parse_event_channel(b"[").is_err());
        let no_endpoint = br#"{"type":"EventChannel","scope":{"kind":"endpoint","endpoint":{"namespace":"d","component":"c","name":"g"}},"topic":"kv-events","instance_id":1,"transport":{"kind":"Zmq","config":{}}}"#;
        assert!(parse_event_channel(no_endpoint).is_err());
        let component_scope = br#"{"type":"EventChannel","scope":{"kind":"component","component":{"namespace":"d","name":"prefill"}},"topic":"kv-events","instance_id":1,"transport":{"kind":"Tcp"}}"#;
        let c = parse_event_channel(component_scope).unwrap();
        assert_eq!(c.component_path(), "d/prefill");
        assert_eq!(c.transport, ChannelTransport::Other("Tcp".into()));
    }

    #[test]
    fn wildcard_publisher_hosts_are_reached_at_their_workers_host() {
        assert_eq!(
            reachable("tcp://0.0.0.0:5000", "10.0.0.7:4000"),
            "tcp://10.0.0.7:5000"
        );
        assert_eq!(
            reachable("tcp://[::]:5000", "10.0.0.7:4000"),
            "tcp://10.0.0.7:5000"
        );
        assert_eq!(
            reachable("tcp://10.0.0.8:5000", "10.0.0.7:4000"),
            "tcp://10.0.0.8:5000"
        );
        assert_eq!(reachable("ipc:///tmp/x", "10.0.0.7:4000"), "ipc:///tmp/x");
        assert_eq!(
            reachable("tcp://0.0.0.0:5000", "dynamo"),
            "tcp://0.0.0.0:5000"
        );
    }
}
