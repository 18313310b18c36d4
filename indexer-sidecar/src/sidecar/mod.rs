//! [`Sidecar`]: the [`Core`] behind its lock, and what the edges share: the event plane's
//! bookkeeping, the recent decisions, the replica plane's brain, the bundles and the metrics.
//!
//! # Verbs, not locks
//! Edges — the HTTP API, the event transports, the observers, the replica plane's loop — call
//! operations named for what they do or ask: [`Sidecar::ingest`], [`Sidecar::hint`], a
//! [`Source`] handle for everything an event source reports ([`Sidecar::source`]), the replica
//! plane's `replica_*` verbs, reads such as [`Sidecar::serves`]. The locks and the metrics are
//! private to this module: an edge cannot take one or write one (the compiler says so, and
//! `tests/tests/layout.rs` checks the edge files for locks and metric writes of their own).
//! Every metric write and its log line sit in this module, one file per family:
//! - `record.rs`: what the core says happened (events, sequences, fleet, replicas, served);
//! - `source.rs`: what event sources and discovery see (connections, undecodable messages,
//!   unknown fields, losses a publisher's numbering shows, replays);
//! - `replicas.rs`: the replica plane (agreement, snapshots, the disk snapshot, warm starts);
//! - `hint.rs`: hints and their record for `/debug/explain`;
//! - `alarms.rs`: the alarms and their gauges;
//! - here: construction, ingestion, engine scrapes and the reads.
//!
//! # Lock model
//! - `core` (`Mutex<Core>`): the fleet table and the indexes. The hint path's only lock. Held
//!   for pure core calls only — no I/O, no logging, no metric encoding under it — so a holder
//!   is done in microseconds. One lock rather than one per table: a hint reads the index and
//!   the load and writes a ticket, an event writes the index and a cursor; splitting them would
//!   make each do two locks for no shorter wait (measured: docs/benchmarks.md, "Hints under
//!   ingest").
//! - `plane` (`Mutex<EventPlane>`): per-source counters and discovery status; sources take it
//!   per message, `/debug/sources` and the alarm check to read.
//! - `explained` (`Mutex<ExplainLog>`): the recent decisions for `/debug/explain`.
//! - `replication` (`Mutex<Brain>`): the replica plane's state (the peers' digests, the last
//!   load share, snapshots taken for peers); the replica plane takes it per message and tick,
//!   `/debug/replicas`, `/readyz` and the alarm check to read (our own reports are taken from
//!   the core first).
//!
//! Taking or installing a peer snapshot holds `core` for the cache's size (a hash-map walk per
//! entry): a peer asks for one only for a cache that diverged, at most once per three
//! intervals, and an unchanged cache's snapshot is served again rather than taken anew. So
//! does a fill's rebuild (the cache put back to its base, the messages since re-applied), and
//! the base is copied when a loss is first seen.
//!
//! No lock is taken while another is held, so there is no order to get wrong. Metrics are
//! atomics and take no lock of ours. A poisoned lock is used anyway: nothing panics while
//! holding one, and the data stays consistent between core calls.

mod alarms;
mod hint;
mod record;
mod replicas;
mod source;

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use kvroute_protocol::bundle::{Catalog, CatalogEntry};

use crate::config::{AlarmConfig, Config};
use crate::core::fleet::{Origin, WorkerId};
use crate::core::load::{parse_vllm_capacity, parse_vllm_metrics, parse_vllm_prefix_cache};
use crate::core::{Core, Happened, Input};
use crate::event_plane::EventPlane;
use crate::explain::ExplainLog;
use crate::metrics::{Metrics, WorkerLabel};
use crate::replication::brain::Brain;
use crate::streaks::Streaks;
use crate::truth_watch::TruthWatch;

pub use replicas::Saved;
pub use source::{Connection, DiscoverySource, Source};

/// Model bundles, serialized once at start.
#[derive(Default)]
pub struct Bundles {
    /// `GET /v1/models` body.
    pub catalog: Vec<u8>,
    /// `GET /v1/models/{name}/bundle` bodies.
    pub by_model: HashMap<String, Vec<u8>>,
}

/// The event source an input came from: its index in the event plane and the subject (NATS)
/// or endpoint (ZMQ) that labels its metrics.
#[derive(Debug, Clone, Copy)]
struct SourceRef<'a> {
    index: usize,
    subject: &'a str,
}

/// Everything the sidecar knows, shared by the API and the sources.
pub struct Sidecar {
    core: Mutex<Core>,
    plane: Mutex<EventPlane>,
    explained: Mutex<ExplainLog>,
    replication: Mutex<Brain>,
    truth: Mutex<TruthWatch>,
    streaks: Mutex<Streaks>,
    /// Tests only (`[replicas] test_drop_events`): this fraction of KV-event messages is
    /// dropped before the core sees it; which ones depends on the replica's id, so two lossy
    /// replicas lose different messages.
    test_drop_events: f64,
    test_drop_seed: u64,
    /// Dynamo KV-event messages seen, for [`Source::dynamo_fields`]'s sampling.
    dynamo_messages: AtomicU64,
    /// With `[replicas]`: how long to wait for a first peer before starting from the events
    /// alone (three intervals), counted from `started`.
    peer_wait: Option<Duration>,
    started: Instant,
    /// Caches read from the disk snapshot whose worker is not in the fleet yet (a Dynamo
    /// instance discovery has not found), and until when they wait for it.
    restoring: Mutex<(Vec<Saved>, Instant)>,
    metrics: Metrics,
    /// Bundles served to filters.
    pub bundles: Bundles,
    /// Alarm thresholds.
    pub alarms: AlarmConfig,
    /// How often engines are scraped.
    pub scrape_interval: Duration,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A secret for this process's tickets: the standard library's hasher keys are random per
/// process (seeded by the OS).
fn random_key() -> u64 {
    use std::hash::BuildHasher as _;
    std::collections::hash_map::RandomState::new().hash_one(std::process::id())
}

impl Sidecar {
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
        let replicas = config.replicas.as_ref();
        let replica_id = replicas.map(|r| r.replica_id());
        // Three intervals without a word: a peer is gone, or none is coming.
        let three_intervals = Duration::from_millis(3 * replicas.map_or(2000, |r| r.interval_ms));
        let sidecar = Sidecar {
            core: Mutex::new(Core::new(config, random_key())),
            plane: Mutex::new(EventPlane::new(Instant::now())),
            explained: Mutex::new(ExplainLog::new(config.explain_bytes)),
            replication: Mutex::new(Brain::new(
                replica_id.clone().unwrap_or_default(),
                three_intervals,
                replicas,
            )),
            truth: Mutex::new(TruthWatch::default()),
            streaks: Mutex::new(Streaks::default()),
            test_drop_events: replicas.map_or(0.0, |r| r.test_drop_events),
            test_drop_seed: replica_id
                .as_ref()
                .map_or(0, |id| xxhash_rust::xxh3::xxh3_64(id.as_bytes())),
            dynamo_messages: AtomicU64::new(0),
            peer_wait: replicas.map(|_| three_intervals),
            started: Instant::now(),
            restoring: Mutex::new((Vec::new(), Instant::now())),
            bundles,
            metrics: Metrics::default(),
            alarms: config.alarms.clone(),
            scrape_interval: Duration::from_millis(config.routing.scrape_interval_ms.max(10)),
        };
        for w in sidecar.core().fleet().iter() {
            let label = WorkerLabel::new(&w.address);
            sidecar.metrics.index_blocks.get_or_create(&label).set(0);
            if let Some(blocks) = w.capacity {
                let blocks = i64::try_from(blocks).unwrap_or(i64::MAX);
                sidecar
                    .metrics
                    .capacity_blocks
                    .get_or_create(&label)
                    .set(blocks);
            }
        }
        Ok(sidecar)
    }

    /// The core (held only for a pure call: see the lock model).
    fn core(&self) -> MutexGuard<'_, Core> {
        lock(&self.core)
    }

    /// The event sources' bookkeeping.
    fn plane(&self) -> MutexGuard<'_, EventPlane> {
        lock(&self.plane)
    }

    /// The replica plane's state: the peers, what was shared, snapshots taken for peers.
    fn replication(&self) -> MutexGuard<'_, Brain> {
        lock(&self.replication)
    }

    /// Whether the test-only event drop takes this message: a fixed hash of what the message
    /// is and of the replica's id, so a run is repeatable.
    fn test_dropped(&self, input: &Input<'_>) -> bool {
        let Input::Message(m) = input else {
            return false;
        };
        if self.test_drop_events <= 0.0 {
            return false;
        }
        let h = xxhash_rust::xxh3::xxh3_64_with_seed(
            &[m.seq.to_le_bytes(), u64::from(m.stream).to_le_bytes()].concat(),
            self.test_drop_seed,
        );
        (h as f64 / u64::MAX as f64) < self.test_drop_events
    }

    /// Apply one input at `now`, count and log what happened, and return it. (An event
    /// source's inputs go through its [`Source::ingest`], which names the source.)
    pub fn ingest(&self, input: Input<'_>, now: Instant) -> Vec<Happened> {
        self.ingest_from(None, input, now)
    }

    fn ingest_from(
        &self,
        source: Option<SourceRef<'_>>,
        input: Input<'_>,
        now: Instant,
    ) -> Vec<Happened> {
        if self.test_dropped(&input) {
            self.metrics.test_dropped_events.inc();
            return Vec::new();
        }
        let happened = self.core().ingest(input, now);
        self.record_applied(source, &happened, now);
        for h in &happened {
            self.record(source, h, now);
        }
        if matches!(input, Input::Discovery { .. } | Input::Tick) {
            self.restore_pending(now);
        }
        if matches!(input, Input::Tick) {
            self.say_ended_streaks(now);
        }
        happened
    }

    /// The configured workers, whose engines are scraped: (id, address).
    pub fn scraped_workers(&self) -> Vec<(WorkerId, Arc<str>)> {
        self.core()
            .fleet()
            .iter()
            // A host that left Envoy's cluster is not asked until it is listed again.
            .filter(|w| !w.pinned() && (w.origin != Origin::Member || w.usable()))
            .map(|w| (w.id, Arc::clone(&w.address)))
            .collect()
    }

    /// Worker `id`'s engine answered a scrape asked at `asked` with `text` (`None`: it did not
    /// answer): its load and capacity to the core, its own prefix-cache counters to the gauges
    /// beside what the hints predicted.
    pub fn scraped(&self, id: WorkerId, address: &str, text: Option<&str>, asked: Instant) {
        let load = text.and_then(parse_vllm_metrics);
        let capacity = text.and_then(parse_vllm_capacity);
        let label = WorkerLabel::new(address);
        let m = &self.metrics;
        if let Some((hits, queries)) = text.and_then(parse_vllm_prefix_cache) {
            m.engine_prefix_cache_hits.get_or_create(&label).set(hits);
            m.engine_prefix_cache_queries
                .get_or_create(&label)
                .set(queries);
        }
        if load.is_none() {
            m.scrape_errors.get_or_create(&label).inc();
        }
        let scrape = Input::Scrape {
            worker: id,
            load,
            capacity,
            asked,
        };
        self.ingest(scrape, Instant::now());
    }

    /// Whether worker `address` is in the fleet (a discovered one may not be yet).
    pub fn serves(&self, address: &str) -> bool {
        self.core().fleet().by_address(address).is_some()
    }

    /// The last message applied to worker `address`'s cache of `rank`, if any.
    pub fn applied(&self, address: &str, rank: u32) -> Option<u64> {
        self.core().cursor_of(address, rank)
    }

    /// The metrics in OpenMetrics text.
    pub fn render_metrics(&self) -> String {
        self.metrics.render()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::core::Delivery;
    use kvroute_protocol::hint::HintRequest;

    /// A sidecar with one model (block size 16) and worker `127.0.0.1:9000`, Dynamo id of the
    /// captured samples.
    pub(crate) fn sidecar() -> Sidecar {
        let model = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/models/tiny-llama");
        let text = format!(
            "[[models]]\nname = \"m\"\ndir = \"{model}\"\nblock_size = 16\n[[workers]]\naddress = \"127.0.0.1:9000\"\nmodel = \"m\"\ndynamo_worker_id = 13140558925506144034\n"
        );
        let config: Config = toml::from_str(&text).unwrap();
        Sidecar::from_config(&config).unwrap()
    }

    /// vLLM events with another block size than the model's are refused, counted per worker,
    /// and do not reach the index.
    #[test]
    fn block_size_mismatch_is_counted_not_indexed() {
        use kvroute_protocol::vllm::{EngineBlockHash, EventBatch, VllmEvent};
        let sidecar = sidecar();
        let batch = EventBatch {
            events: vec![VllmEvent::BlockStored {
                block_hashes: vec![EngineBlockHash(1)].into(),
                parent: None,
                token_ids: (0..32).collect(),
                block_size: 32,
                lora_name: None,
                medium: None,
                has_extra_keys: Default::default(),
                group: None,
                kind: None,
            }],
            ..EventBatch::default()
        };
        let now = Instant::now();
        for seq in 0..2 {
            let message = crate::core::Message::vllm(
                "127.0.0.1:9000",
                seq,
                Delivery::LiveHoldingGaps,
                &batch,
            );
            sidecar.ingest(Input::Message(message), now);
        }
        let text = sidecar.metrics.render();
        assert!(
            text.contains("kvroute_block_size_mismatches_total{worker=\"127.0.0.1:9000\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("kvroute_index_blocks{worker=\"127.0.0.1:9000\"} 0"),
            "{text}"
        );
    }

    /// `/debug/explain` shows decisions, not tickets: a reader could close them on
    /// `/v1/finished` and hide a worker's load.
    #[test]
    fn explained_hints_carry_no_ticket() {
        let sidecar = sidecar();
        let req = HintRequest {
            model: "m".into(),
            hashes: vec![kvroute_protocol::PrefixHash(1)],
            finished: vec![],
        };
        let resp = sidecar.hint(&req, Some("req-1"), Instant::now()).unwrap();
        assert!(resp.ticket.is_some(), "the filter gets its ticket");
        let shown = &sidecar.explained(&Default::default())[0]["decision"]["hint"];
        assert!(shown.get("ticket").is_none(), "{shown}");
        assert_eq!(shown["workers"][0], "127.0.0.1:9000");
        // Each candidate shows its load field by field beside its cost.
        let candidate = &sidecar.explained(&Default::default())[0]["decision"]["candidates"][0];
        for field in [
            "worker",
            "matched_blocks",
            "running",
            "hinted_in_flight",
            "envoy_active",
            "saturated",
            "cost",
        ] {
            assert!(candidate.get(field).is_some(), "{field}: {candidate}");
        }
    }

    /// Publisher names come from the network: past a bound they share one series.
    #[test]
    fn unknown_publishers_fold_into_one_series() {
        let sidecar = sidecar();
        let batch = kvroute_protocol::vllm::EventBatch::default();
        let now = Instant::now();
        let names: Vec<String> = (0..200).map(|i| format!("10.0.0.{i}:8000")).collect();
        for name in &names {
            let message = crate::core::Message::vllm(name, 0, Delivery::LiveHoldingGaps, &batch);
            sidecar.ingest(Input::Message(message), now);
        }
        let text = sidecar.metrics.render();
        let series = text
            .lines()
            .filter(|l| l.starts_with("kvroute_unknown_worker_events_total{"))
            .count();
        assert!(series <= 65, "{series} series");
        assert!(
            text.contains("kvroute_unknown_worker_events_total{worker_id=\"other\"}"),
            "{text}"
        );
    }

    /// Subjects come from the network too: past a bound, events share `subject="other"`.
    #[test]
    fn event_subjects_are_bounded() {
        let sidecar = sidecar();
        let samples = kvroute_protocol::samples_dir().join("dynamo");
        let body = std::fs::read(samples.join("kv-events_stored_prompt_4blocks.msgpack")).unwrap();
        let events = kvroute_protocol::dynamo::decode_message(&body)
            .unwrap()
            .events;
        let subjects: Vec<String> = (0..300)
            .map(|i| format!("namespace.n{i}.kv-events"))
            .collect();
        let now = Instant::now();
        for (i, subject) in subjects.iter().enumerate() {
            let source = SourceRef { index: 0, subject };
            // Each its own event: the same one again would be a duplicate.
            let mut e = events[0].clone();
            e.event.event_id = i as u64 + 1;
            sidecar.ingest_from(
                Some(source),
                Input::Message(crate::core::Message::dynamo(&e, None)),
                now,
            );
        }
        let text = sidecar.metrics.render();
        let series = text
            .lines()
            .filter(|l| l.starts_with("kvroute_events_total{"))
            .count();
        assert_eq!(series, 257, "256 subjects and other");
        assert!(
            text.contains("kvroute_events_total{subject=\"other\",type=\"stored\"}"),
            "{text}"
        );
    }
}
