//! [`AppState`]: the registry, the per-model indexes, the bundles and the metrics, shared by the
//! HTTP API and the event sources.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use kvroute_protocol::bundle::{Catalog, CatalogEntry};
use kvroute_protocol::dynamo::{KvMetrics, RouterEvent};
use kvroute_protocol::hint::{HintRequest, HintResponse, Ticket};
use kvroute_protocol::vllm::EventBatch;

use crate::config::{Config, DiscoveryConfig, RoutingConfig};
use crate::event::{KvEvent, VllmEventProblem};
use crate::health::{AlarmConfig, EventPlane};
use crate::index::RadixIndex;
use crate::load::{Load, LoadTracker};
use crate::metrics::{label, Metrics};
use crate::registry::{Worker, WorkerId, WorkerRegistry};
use crate::router::{self, Decision, Rule};
use crate::sequence::{check_seq, SeqCheck};
use crate::sources::discovery::{Role, Scan};
use crate::sources::envoy_admin::HostView;

/// How many recent decisions `/debug/explain` keeps.
const EXPLAINED: usize = 100;

/// Model bundles, serialized once at start.
#[derive(Default)]
pub struct Bundles {
    /// `GET /v1/models` body.
    pub catalog: Vec<u8>,
    /// `GET /v1/models/{name}/bundle` bodies.
    pub by_model: HashMap<String, Vec<u8>>,
}

/// Everything the sidecar knows.
pub struct AppState {
    /// The workers (swapped whole when discovery adds one; readers hold a snapshot).
    registry: RwLock<Arc<WorkerRegistry>>,
    /// Serializes discovery's additions to the registry.
    adding: Mutex<()>,
    /// One index per model.
    pub indexes: RwLock<HashMap<String, RadixIndex>>,
    /// Bundles served to filters.
    pub bundles: Bundles,
    /// Hint policy.
    pub routing: RoutingConfig,
    /// Metrics.
    pub metrics: Metrics,
    /// Each worker's load.
    pub load: Mutex<LoadTracker>,
    /// KV block size of each model.
    block_sizes: HashMap<String, u32>,
    /// Event sources and the alarms about them (see [`AppState::plane`]).
    plane: Mutex<EventPlane>,
    /// Last Dynamo `event_id` per (worker, data-parallel rank).
    dynamo_cursors: Mutex<HashMap<(WorkerId, u32), u64>>,
    /// Alarm thresholds.
    pub alarms: AlarmConfig,
    /// The most recent decisions, newest first, for `/debug/explain`.
    pub decisions: Mutex<VecDeque<serde_json::Value>>,
    /// Since when each worker has been unhealthy or absent in Envoy (`None`: usable).
    unusable_since: Mutex<Vec<Option<Instant>>>,
    grace_period: Duration,
}

impl AppState {
    /// Build from a configuration, loading every model's bundle (fails on a bundle that the
    /// filter could not load, naming the model).
    pub fn from_config(config: &Config) -> anyhow::Result<Self> {
        let mut bundles = Bundles::default();
        let mut catalog = Catalog::default();
        for m in &config.models {
            let bundle = kvroute_prompt::model_dir::load_bundle(&m.dir, &m.name, m.block_size)
                .with_context(|| format!("model {} ({})", m.name, m.dir.display()))?;
            catalog.models.push(CatalogEntry {
                model: m.name.clone(),
                version: bundle.version.clone(),
                adapters: m.lora_adapters.clone(),
            });
            bundles
                .by_model
                .insert(m.name.clone(), serde_json::to_vec(&bundle)?);
        }
        bundles.catalog = serde_json::to_vec(&catalog)?;
        let state = AppState {
            registry: RwLock::new(Arc::new(WorkerRegistry::new(&config.workers))),
            adding: Mutex::new(()),
            indexes: RwLock::new(
                config
                    .models
                    .iter()
                    .map(|m| (m.name.clone(), RadixIndex::default()))
                    .collect(),
            ),
            bundles,
            routing: config.routing.clone(),
            metrics: Metrics::default(),
            plane: Mutex::new(EventPlane::new(config.workers.len())),
            dynamo_cursors: Mutex::new(HashMap::new()),
            alarms: config.alarms.clone(),
            block_sizes: config
                .models
                .iter()
                .map(|m| (m.name.clone(), m.block_size))
                .collect(),
            load: Mutex::new(LoadTracker::new(
                config.workers.len(),
                Duration::from_millis(config.routing.scrape_interval_ms.max(1)),
            )),
            decisions: Mutex::new(VecDeque::with_capacity(EXPLAINED)),
            unusable_since: Mutex::new(vec![None; config.workers.len()]),
            grace_period: Duration::from_millis(
                config.envoy.as_ref().map_or(30_000, |e| e.grace_period_ms),
            ),
        };
        for w in state.registry().iter() {
            state
                .metrics
                .index_blocks
                .get_or_create(&label("worker", w.address.clone()))
                .set(0);
        }
        Ok(state)
    }

    /// Apply one Dynamo event received on `subject`. Its `event_id` is checked per (worker,
    /// data-parallel rank): a gap is counted (NATS core cannot replay; removals may have been
    /// missed, so a few entries may be stale until evicted); going back means the worker
    /// restarted with an empty cache, so its entries are dropped.
    pub fn apply_dynamo(&self, source: usize, subject: &str, event: &RouterEvent) {
        let registry = self.registry();
        let Some(worker) = registry.by_dynamo_id(event.worker_id) else {
            let counter = self
                .metrics
                .unknown_worker_events
                .get_or_create(&label("worker_id", event.worker_id.to_string()));
            if counter.get() == 0 {
                tracing::warn!(worker_id = event.worker_id, %subject, "KV events from a Dynamo worker that is neither in [[workers]] nor discovered (yet), or of another model/component: ignored");
            }
            counter.inc();
            self.plane().unknown_worker(event.worker_id);
            return;
        };
        let (id, model) = (worker.id, worker.model.clone());
        let address = worker.address.clone();
        let check = {
            let mut cursors = self
                .dynamo_cursors
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            let key = (id, event.event.dp_rank);
            let check = check_seq(cursors.get(&key).copied(), event.event.event_id);
            cursors.insert(key, event.event.event_id);
            check
        };
        let bump = |kind: &str| {
            self.metrics
                .sequence
                .get_or_create(&vec![
                    ("worker", address.clone()),
                    ("kind", kind.to_owned()),
                ])
                .inc();
        };
        match check {
            SeqCheck::First | SeqCheck::Next => {}
            SeqCheck::Gap { from, to } => {
                tracing::warn!(worker = %address, from, to, "Dynamo event_id gap: events lost");
                bump("gap");
            }
            SeqCheck::Restarted => {
                let dropped = self.forget_worker(id);
                tracing::warn!(worker = %address, event_id = event.event.event_id, dropped, "Dynamo event_id went back: worker restarted, its index entries dropped");
                bump("restart");
            }
        }
        self.plane_event(source, id);
        let kv = KvEvent::from_dynamo(event);
        self.metrics
            .events
            .get_or_create(&vec![
                ("subject", subject.to_owned()),
                ("type", kv.kind.label().to_owned()),
            ])
            .inc();
        self.apply(id, &model, &kv);
    }

    /// Apply an event of a known worker to its model's index.
    pub fn apply(&self, worker: WorkerId, model: &str, event: &KvEvent) {
        let mut indexes = self.indexes.write().unwrap_or_else(|e| e.into_inner());
        let Some(index) = indexes.get_mut(model) else {
            return;
        };
        let out = index.apply(worker, event);
        let held = index.blocks_of(worker);
        drop(indexes);
        let address = self
            .registry()
            .get(worker)
            .map(|w| w.address.clone())
            .unwrap_or_default();
        if out.too_many_caches {
            tracing::warn!(worker = %address, "index full: more than 65535 caches; event dropped");
        }
        if out.orphan {
            tracing::debug!(worker = %address, "stored event with unknown parent dropped");
            self.metrics
                .orphan_stores
                .get_or_create(&label("worker", address.clone()))
                .inc();
        }
        if out.unknown_removals > 0 {
            self.metrics
                .unknown_removals
                .inc_by(out.unknown_removals as u64);
        }
        self.metrics
            .index_blocks
            .get_or_create(&label("worker", address))
            .set(held as i64);
    }

    /// Answer a hint request.
    pub fn hint(&self, req: &HintRequest) -> Option<HintResponse> {
        if !req.finished.is_empty() {
            self.finished(&req.finished);
        }
        let indexes = self.indexes.read().unwrap_or_else(|e| e.into_inner());
        let Some(index) = indexes.get(&req.model) else {
            self.metrics
                .hints
                .get_or_create(&label("result", "unknown_model"))
                .inc();
            return None;
        };
        // A few tiers beyond the hint's length, so saturated leaders have runners-up.
        let matches = index.find_matches(&req.hashes, self.routing.max_hinted_workers * 2);
        drop(indexes);
        let registry = self.registry();
        let decision = {
            let mut load = self.load.lock().unwrap_or_else(|e| e.into_inner());
            let unusable = self
                .unusable_since
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            let home_key = match self.routing.home_key_blocks.min(req.hashes.len()) {
                0 => None,
                n => Some(req.hashes[n - 1].0),
            };
            let mut decision = router::choose(
                req.hashes.len() as u32,
                home_key,
                &matches,
                &registry,
                &self.routing,
                |w| load.get(w.0 as usize),
                |w| unusable.get(w.0 as usize).is_some_and(Option::is_none),
            );
            drop(unusable);
            if let Some(first) = decision.hint.workers.first() {
                if let Some(w) = registry.iter().find(|w| &w.address == first) {
                    decision.hint.ticket = load.hinted(w.id.0 as usize);
                    self.set_in_flight(&load, w.id);
                    self.plane().hinted(w.id.0 as usize);
                    if w.pinned {
                        // Behind a Dynamo frontend: one instance id, no addresses for Envoy.
                        match w.role {
                            Role::Prefill => decision.hint.prefill_instance_id = w.dynamo_worker_id,
                            Role::Aggregated | Role::Decode => {
                                decision.hint.instance_id = w.dynamo_worker_id
                            }
                        }
                        decision.hint.workers.clear();
                    }
                }
            }
            decision
        };
        let resp = decision.hint.clone();
        let no_target = !resp.has_target();
        if no_target {
            // A hinted request is recorded with its worker (`hinted`); this one is not.
            self.plane().requested();
        }
        let result = match decision.rule {
            _ if no_target => "no_worker",
            Rule::NoMatch => "no_match",
            Rule::LongestMatch | Rule::LeastLoaded => {
                self.metrics
                    .hint_matched_blocks
                    .inc_by(u64::from(resp.matched_blocks));
                "hinted"
            }
        };
        self.metrics
            .hints
            .get_or_create(&label("result", result))
            .inc();
        self.explain(req, decision);
        Some(resp)
    }

    fn explain(&self, req: &HintRequest, decision: Decision) {
        let entry = serde_json::json!({
            "model": req.model,
            "prompt_blocks": req.hashes.len(),
            "first_block": req.hashes.first().map(|h| format!("{:016x}", h.0)),
            // The prefix hash of the whole hashed prompt: equal to `kvroute-sidecar tokenize`'s
            // `last_block` exactly when the filter saw the same tokens.
            "last_block": req.hashes.last().map(|h| format!("{:016x}", h.0)),
            "decision": decision,
        });
        let mut recent = self.decisions.lock().unwrap_or_else(|e| e.into_inner());
        if recent.len() == EXPLAINED {
            recent.pop_back();
        }
        recent.push_front(entry);
    }

    /// Apply Envoy's view of the workers cluster: health, membership and requests in flight.
    /// A worker Envoy does not list or considers unhealthy is never hinted; after the grace
    /// period its index entries are dropped (it may come back with an empty cache). Pinned
    /// workers are not in Envoy's cluster (a Dynamo frontend is): discovery decides for them.
    pub fn record_envoy_view(&self, hosts: &HashMap<String, HostView>) {
        let registry = self.registry();
        let mut seen = Vec::new();
        {
            let mut load = self.load.lock().unwrap_or_else(|e| e.into_inner());
            for w in registry.iter().filter(|w| !w.pinned) {
                let view = hosts.get(&w.address);
                load.envoy_active(w.id.0 as usize, view.map_or(0.0, |v| v.rq_active));
                let why = if view.is_some() {
                    "Envoy does not consider this worker healthy"
                } else {
                    "Envoy does not list this worker"
                };
                seen.push((w, view.is_some_and(|v| v.healthy), why));
            }
        }
        self.set_usable(&seen);
    }

    /// Apply one scan of a `[[dynamo_discovery]]` entry: new aggregated and prefill instances are
    /// added as pinned workers (decode workers are the frontend's choice, never hinted);
    /// instances whose record is gone, or whose request plane does not accept connections
    /// (`unreachable`), are no longer hinted and, after the grace period, lose their entries.
    pub fn record_discovery(
        &self,
        config: &DiscoveryConfig,
        scan: &Scan,
        unreachable: &BTreeSet<u64>,
    ) {
        let model = config.model.as_str();
        for role in [Role::Aggregated, Role::Prefill, Role::Decode] {
            self.metrics
                .discovered_instances
                .get_or_create(&vec![
                    ("model", model.to_owned()),
                    ("role", role.label().to_owned()),
                ])
                .set(scan.count(role) as i64);
        }
        let added: Vec<(u64, String, Role)> = {
            let registry = self.registry();
            scan.instances
                .iter()
                .filter(|(id, i)| i.role != Role::Decode && registry.by_dynamo_id(**id).is_none())
                .map(|(id, i)| (*id, format!("{}/{id:x}", i.address), i.role))
                .collect()
        };
        if !added.is_empty() {
            // One adder at a time; the per-worker tables grow before the new registry is
            // published, so every id a reader can see has its rows. The registry lock itself is
            // only held to swap (hint() holds the load lock while it reads the registry).
            let _adding = self.adding.lock().unwrap_or_else(|e| e.into_inner());
            let mut registry = WorkerRegistry::clone(&self.registry());
            for (id, address, role) in added {
                registry.add_pinned(id, address.clone(), model.to_owned(), role);
                tracing::info!(instance_id = id, worker = %address, model, role = role.label(), "Dynamo instance discovered: hinted by instance id");
                self.metrics
                    .index_blocks
                    .get_or_create(&label("worker", address))
                    .set(0);
            }
            let n = registry.len();
            self.load.lock().unwrap_or_else(|e| e.into_inner()).grow(n);
            self.plane().grow(n);
            {
                let mut unusable = self
                    .unusable_since
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                if unusable.len() < n {
                    unusable.resize(n, None);
                }
            }
            *self.registry.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(registry);
        }
        let registry = self.registry();
        let seen: Vec<_> = registry
            .iter()
            .filter(|w| w.pinned && w.model == model)
            .map(|w| {
                let id = w.dynamo_worker_id.unwrap_or_default();
                match (scan.instances.contains_key(&id), unreachable.contains(&id)) {
                    (false, _) => (w, false, "its Dynamo discovery record is gone"),
                    (true, true) => (
                        w,
                        false,
                        "its request plane refuses connections (probe): the worker is down",
                    ),
                    (true, false) => (w, true, ""),
                }
            })
            .collect();
        self.set_usable(&seen);
    }

    /// Mark workers usable or not (with why not); drop the entries of those unusable for longer
    /// than the grace period.
    fn set_usable(&self, workers: &[(&Worker, bool, &str)]) {
        let now = Instant::now();
        let mut expired = Vec::new();
        {
            let mut unusable = self
                .unusable_since
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            for &(w, usable, why) in workers {
                self.metrics
                    .worker_usable
                    .get_or_create(&label("worker", w.address.clone()))
                    .set(i64::from(usable));
                let Some(slot) = unusable.get_mut(w.id.0 as usize) else {
                    continue;
                };
                match (usable, *slot) {
                    (true, Some(_)) => {
                        tracing::info!(worker = %w.address, "worker usable again");
                        *slot = None;
                    }
                    (false, None) => {
                        tracing::warn!(worker = %w.address, "{why}: no more hints to it");
                        *slot = Some(now);
                    }
                    (false, Some(since)) if now.duration_since(since) >= self.grace_period => {
                        expired.push((w.id, w.address.clone()));
                    }
                    _ => {}
                }
            }
        }
        for (id, address) in expired {
            let dropped = self.forget_worker(id);
            if dropped > 0 {
                tracing::warn!(worker = %address, blocks = dropped, "unusable past the grace period: index entries dropped");
            }
        }
    }

    /// A snapshot of the workers (cheap: one reference count).
    pub fn registry(&self) -> Arc<WorkerRegistry> {
        Arc::clone(&self.registry.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// The event sources' bookkeeping (a poisoned lock is still usable: it holds counters).
    pub fn plane(&self) -> std::sync::MutexGuard<'_, EventPlane> {
        self.plane.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn plane_event(&self, source: usize, worker: WorkerId) {
        self.plane().event(source, worker.0 as usize);
    }

    /// Drop every index entry of a worker (all its data-parallel ranks); how many were dropped.
    pub fn forget_worker(&self, worker: WorkerId) -> usize {
        let registry = self.registry();
        let Some(w) = registry.get(worker) else {
            return 0;
        };
        let mut indexes = self.indexes.write().unwrap_or_else(|e| e.into_inner());
        let dropped = indexes
            .get_mut(&w.model)
            .map_or(0, |index| index.remove_worker(worker));
        drop(indexes);
        self.metrics
            .index_blocks
            .get_or_create(&label("worker", w.address.clone()))
            .set(0);
        dropped
    }

    /// Apply a vLLM event batch of a known worker (`source` labels the metrics: the endpoint).
    pub fn apply_vllm(&self, source: usize, worker: WorkerId, endpoint: &str, batch: &EventBatch) {
        let registry = self.registry();
        let Some(w) = registry.get(worker) else {
            return;
        };
        let block_size = self.block_sizes.get(&w.model).copied().unwrap_or(0);
        if batch.skipped > 0 {
            self.metrics
                .skipped_events
                .get_or_create(&label("source", "zmq"))
                .inc_by(batch.skipped as u64);
        }
        for event in &batch.events {
            match KvEvent::from_vllm(event, batch.dp_rank, block_size) {
                Ok(kv) => {
                    self.plane_event(source, worker);
                    self.metrics
                        .events
                        .get_or_create(&vec![
                            ("subject", endpoint.to_owned()),
                            ("type", kv.kind.label().to_owned()),
                        ])
                        .inc();
                    self.apply(worker, &w.model, &kv);
                }
                Err(problem @ VllmEventProblem::BlockSize { .. }) => {
                    let counter = self
                        .metrics
                        .block_size_mismatches
                        .get_or_create(&label("worker", w.address.clone()));
                    if counter.get() == 0 {
                        tracing::error!(worker = %w.address, model = %w.model, %problem, "block-size mismatch: this worker's KV events can never match a request; fix [[models]] block_size or the engine's --block-size");
                    }
                    counter.inc();
                }
                Err(VllmEventProblem::Medium(_)) => {
                    self.metrics
                        .skipped_events
                        .get_or_create(&label("source", "zmq"))
                        .inc();
                }
                Err(problem @ VllmEventProblem::Tokens { .. }) => {
                    tracing::warn!(worker = %w.address, %problem, "malformed vLLM store event");
                    self.metrics
                        .decode_errors
                        .get_or_create(&label("source", "zmq"))
                        .inc();
                }
            }
        }
    }

    /// Record a Dynamo worker's `kv_metrics` (load of one data-parallel rank).
    pub fn record_dynamo_metrics(&self, m: &KvMetrics) {
        let registry = self.registry();
        let Some(worker) = registry.by_dynamo_id(m.worker_id) else {
            self.metrics
                .unknown_worker_events
                .get_or_create(&label("worker_id", m.worker_id.to_string()))
                .inc();
            return;
        };
        let block_size = self
            .block_sizes
            .get(&worker.model)
            .copied()
            .unwrap_or(1)
            .max(1);
        let queued = m.active_prefill_tokens.unwrap_or(0) as f64 / f64::from(block_size);
        let used = m.kv_used_blocks.unwrap_or(0) as f64;
        let mut tracker = self.load.lock().unwrap_or_else(|e| e.into_inner());
        tracker.dynamo_metrics(worker.id.0 as usize, m.dp_rank, queued, used);
        let load = tracker.get(worker.id.0 as usize);
        drop(tracker);
        let labels = label("worker", worker.address.clone());
        self.metrics
            .queued_prefill_blocks
            .get_or_create(&labels)
            .set(load.queued_prefill_blocks as i64);
        self.metrics
            .kv_used_blocks
            .get_or_create(&labels)
            .set(load.kv_used_blocks as i64);
    }

    /// Record a scrape of a worker's engine metrics.
    pub fn record_load(&self, worker: WorkerId, load: Option<Load>) {
        let mut tracker = self.load.lock().unwrap_or_else(|e| e.into_inner());
        let reclaimed = tracker.scraped(worker.0 as usize, load);
        for (how, n) in [
            ("reclaimed", reclaimed.surplus),
            ("expired", reclaimed.expired),
        ] {
            if n > 0 {
                self.metrics
                    .tickets
                    .get_or_create(&label("how", how))
                    .inc_by(n);
            }
        }
        self.set_in_flight(&tracker, worker);
    }

    /// Hinted requests that finished (reported by the filter without a hint request).
    pub fn finished(&self, tickets: &[Ticket]) {
        let mut tracker = self.load.lock().unwrap_or_else(|e| e.into_inner());
        for &ticket in tickets {
            self.close_ticket(&mut tracker, ticket);
        }
    }

    fn close_ticket(&self, tracker: &mut LoadTracker, ticket: Ticket) {
        let worker = tracker.finished(ticket);
        let how = if worker.is_some() {
            "finished"
        } else {
            "unknown"
        };
        self.metrics.tickets.get_or_create(&label("how", how)).inc();
        if let Some(w) = worker {
            self.set_in_flight(tracker, WorkerId(w as u32));
        }
    }

    fn set_in_flight(&self, tracker: &LoadTracker, worker: WorkerId) {
        if let Some(w) = self.registry().get(worker) {
            self.metrics
                .in_flight
                .get_or_create(&label("worker", w.address.clone()))
                .set(tracker.get(worker.0 as usize).hinted_in_flight as i64);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A state with one model (block size 16) and worker `127.0.0.1:9000`, Dynamo id of the
    /// captured samples.
    pub(crate) fn state() -> AppState {
        let model = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/models/tiny-llama");
        let text = format!(
            "[[models]]\nname = \"m\"\ndir = \"{model}\"\nblock_size = 16\n[[workers]]\naddress = \"127.0.0.1:9000\"\nmodel = \"m\"\ndynamo_worker_id = 13140558925506144034\n"
        );
        let config: Config = toml::from_str(&text).unwrap();
        AppState::from_config(&config).unwrap()
    }

    /// A discovery scan of these instances (instance id, port, role).
    fn scan(instances: &[(u64, u16, Role)]) -> Scan {
        Scan {
            instances: instances
                .iter()
                .map(|&(id, port, role)| {
                    let instance = crate::sources::discovery::Instance {
                        address: format!("127.0.0.1:{port}"),
                        component: if role == Role::Prefill {
                            "prefill"
                        } else {
                            "backend"
                        }
                        .into(),
                        role,
                        total_kv_blocks: None,
                        block_size: None,
                    };
                    (id, instance)
                })
                .collect(),
            ..Scan::default()
        }
    }

    fn discovery_config() -> DiscoveryConfig {
        DiscoveryConfig::new("/d", "m")
    }

    /// A state with model `m` and no configured worker, the captured Dynamo events (of one
    /// publisher) and a hint request for the captured prompt.
    fn pin_fixture() -> (AppState, Vec<RouterEvent>, HintRequest) {
        use kvroute_protocol::hash::token_prefix_hashes;
        use kvroute_protocol::HashSeed;
        let model = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/models/tiny-llama");
        let text = format!("[[models]]\nname = \"m\"\ndir = \"{model}\"\nblock_size = 16\n");
        let state = AppState::from_config(&toml::from_str(&text).unwrap()).unwrap();
        let samples = kvroute_protocol::samples_dir().join("dynamo");
        let body = std::fs::read(samples.join("kv-events_stored_prompt_4blocks.msgpack")).unwrap();
        let events = kvroute_protocol::dynamo::decode_message(&body)
            .unwrap()
            .events;
        let tokens = kvroute_protocol::golden_dynamo_prompt();
        let req = HintRequest {
            model: "m".into(),
            hashes: token_prefix_hashes(&tokens, 16, HashSeed::default()),
            finished: Vec::new(),
        };
        (state, events, req)
    }

    /// Instances found through discovery are hinted by instance id, not while their probe fails
    /// and not once their record is gone; the captured Dynamo prompt steers to the instance that
    /// stored it.
    #[test]
    fn discovered_instances_are_pinned_until_their_record_goes() {
        let (state, events, req) = pin_fixture();
        let publisher = events[0].worker_id;
        let other = 77;
        let both = scan(&[
            (publisher, 40051, Role::Aggregated),
            (other, 40052, Role::Aggregated),
        ]);
        state.record_discovery(&discovery_config(), &both, &BTreeSet::new());
        state.record_discovery(&discovery_config(), &both, &BTreeSet::new());
        assert_eq!(state.registry().len(), 2, "each instance is added once");
        for e in &events {
            state.apply_dynamo(0, "subject", e);
        }
        let hint = state.hint(&req).unwrap();
        assert_eq!(hint.instance_id, Some(publisher));
        assert!(hint.workers.is_empty(), "no address for Envoy: {hint:?}");
        assert_eq!(hint.matched_blocks, 4);
        assert!(hint.ticket.is_some());

        // Its request plane refuses connections: not pinned until it answers again.
        let down: BTreeSet<u64> = [publisher].into();
        state.record_discovery(&discovery_config(), &both, &down);
        assert_eq!(state.hint(&req).unwrap().instance_id, Some(other));
        state.record_discovery(&discovery_config(), &both, &BTreeSet::new());
        assert_eq!(state.hint(&req).unwrap().instance_id, Some(publisher));

        state.record_discovery(
            &discovery_config(),
            &scan(&[(other, 40052, Role::Aggregated)]),
            &BTreeSet::new(),
        );
        for _ in 0..5 {
            let hint = state.hint(&req).unwrap();
            assert_eq!(
                hint.instance_id,
                Some(other),
                "the departed instance is not hinted"
            );
        }
    }

    /// Disaggregated: the prefill worker holding the prefix is pinned with the prefill header;
    /// decode workers, which publish no KV events, are never hinted, warm prompt or cold.
    #[test]
    fn disaggregated_fleets_pin_the_prefill_worker() {
        let (state, events, mut req) = pin_fixture();
        let prefill = events[0].worker_id;
        let (cold_prefill, decode) = (78, 79);
        let fleet = scan(&[
            (prefill, 40051, Role::Prefill),
            (cold_prefill, 40052, Role::Prefill),
            (decode, 40053, Role::Decode),
        ]);
        state.record_discovery(&discovery_config(), &fleet, &BTreeSet::new());
        assert_eq!(
            state.registry().len(),
            2,
            "decode workers are not registered"
        );
        let text = state.metrics.render();
        assert!(
            text.contains("kvroute_discovered_instances{model=\"m\",role=\"decode\"} 1"),
            "{text}"
        );
        for e in &events {
            state.apply_dynamo(0, "subject", e);
        }
        let hint = state.hint(&req).unwrap();
        assert_eq!(hint.prefill_instance_id, Some(prefill), "{hint:?}");
        assert_eq!(hint.instance_id, None, "{hint:?}");
        req.hashes.truncate(0);
        req.hashes.push(kvroute_protocol::PrefixHash(12345));
        for _ in 0..4 {
            let cold = state.hint(&req).unwrap();
            let target = cold.prefill_instance_id;
            assert!(
                target == Some(prefill) || target == Some(cold_prefill),
                "cold prompts go to a prefill worker: {cold:?}"
            );
            assert_eq!(cold.instance_id, None);
        }
    }

    /// vLLM events with another block size than the model's are refused, counted per worker,
    /// and do not reach the index.
    #[test]
    fn block_size_mismatch_is_counted_not_indexed() {
        use kvroute_protocol::vllm::{EngineBlockHash, EventBatch, VllmEvent};
        let state = state();
        let batch = EventBatch {
            events: vec![VllmEvent::BlockStored {
                block_hashes: vec![EngineBlockHash(1)],
                parent: None,
                token_ids: (0..32).collect(),
                block_size: 32,
                lora_name: None,
                medium: None,
                has_extra_keys: vec![],
            }],
            ..EventBatch::default()
        };
        let worker = state.registry().by_address("127.0.0.1:9000").unwrap().id;
        state.apply_vllm(0, worker, "tcp://e", &batch);
        state.apply_vllm(0, worker, "tcp://e", &batch);
        let text = state.metrics.render();
        assert!(
            text.contains("kvroute_block_size_mismatches_total{worker=\"127.0.0.1:9000\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("kvroute_index_blocks{worker=\"127.0.0.1:9000\"} 0"),
            "{text}"
        );
    }
}
