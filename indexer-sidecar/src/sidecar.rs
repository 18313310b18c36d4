//! [`Sidecar`]: the [`Core`] behind its lock, and what the edges share: the event plane's
//! bookkeeping, the recent decisions, the bundles and the metrics. Every edge — the HTTP API,
//! the event transports, the observers — calls [`Sidecar::ingest`] or [`Sidecar::hint`]; what
//! the core says happened is turned into metrics and log lines in one place,
//! `Sidecar::record`.
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

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use kvroute_protocol::bundle::{Catalog, CatalogEntry};
use kvroute_protocol::hint::{HintRequest, HintResponse};

use crate::config::{AlarmConfig, Config};
use crate::core::cursor::Verdict;
use crate::core::digest::Agreement;
use crate::core::event::EventTag;
use crate::core::event::VllmEventProblem;
use crate::core::fleet::WorkerId;
use crate::core::fleet::{Origin, Role};
use crate::core::policy::{Decision, Rule};
use crate::core::truth::Prediction;
use crate::core::{Core, Delivery, Forgot, Happened, Input, Rejected, Target, TicketClosed};
use crate::event_plane::{Activity, Alarm, EventPlane};
use crate::explain::ExplainLog;
use crate::metrics::{
    AgreementLabel, AgreementValue, AlarmLabels, Direction, DirectionLabel, EventLabels, EventType,
    HintLabels, HintResult, HintRule, LostLabel, LostOutcome, Metrics, PredictionLabels,
    PredictionOutcome, PublisherLabel, RejectLabels, RejectReason, RepairKind, RepairLabel,
    ReplicaWorkerLabels, RestoreLabel, RestoreOutcome, RoleLabels, RoleValue, RuleLabel,
    SequenceKind, SequenceLabels, ServedLabels, SourceLabel, TicketHow, TicketLabel, TopicLabel,
    Transport, UsageKind, WorkerLabel,
};
use crate::replication::brain::{Brain, Effect, Event};
use crate::replication::peers::Change;
use crate::streaks::Streaks;
use crate::truth_watch::{Totals, TruthWatch};
use kvroute_protocol::dynamo::{KV_EVENTS_TOPIC, KV_METRICS_TOPIC};
use kvroute_protocol::hint::Usage;

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
pub struct SourceRef<'a> {
    /// From [`EventPlane::register`].
    pub index: usize,
    /// Subject or endpoint.
    pub subject: &'a str,
}

/// How log lines name a transport.
fn transport_name(transport: Transport) -> &'static str {
    match transport {
        Transport::Nats => "NATS",
        Transport::Zmq => "ZMQ",
        Transport::DynamoZmq => "Dynamo ZMQ",
    }
}

/// What an event source's client reports about its connection ([`Sidecar::connection`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Connection {
    /// The connection to the server is lost (the client reconnects by itself).
    Lost,
    /// It is back.
    Back,
    /// The client dropped a message before the sidecar read it (its buffer was full).
    Dropped,
}

/// A cache read from the disk snapshot: the worker's address, the rank, its entries.
pub type Saved = (String, u32, crate::core::digest::Snapshot);

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
    /// Dynamo KV-event messages seen, for [`Sidecar::dynamo_fields`]'s sampling.
    dynamo_messages: AtomicU64,
    /// With `[replicas]`: how long to wait for a first peer before starting from the events
    /// alone (three intervals), counted from `started`.
    peer_wait: Option<Duration>,
    started: Instant,
    /// Caches read from the disk snapshot whose worker is not in the fleet yet (a Dynamo
    /// instance discovery has not found), and until when they wait for it.
    restoring: Mutex<(Vec<Saved>, Instant)>,
    /// Bundles served to filters.
    pub bundles: Bundles,
    /// Metrics.
    pub metrics: Metrics,
    /// Alarm thresholds.
    pub alarms: AlarmConfig,
    /// How often engines are scraped.
    pub scrape_interval: Duration,
}

/// One Dynamo KV-event message in this many is checked for unknown fields.
const FIELD_CHECK_EVERY: u64 = 64;

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

    /// Put back the caches read from the disk snapshot: now those whose worker is in the
    /// fleet, the others as their worker appears, for up to `wait`.
    pub fn restore(&self, caches: Vec<Saved>, wait: Duration, now: Instant) {
        *lock(&self.restoring) = (caches, now + wait);
        self.restore_pending(now);
    }

    /// Restore what waits for a worker now in the fleet; past the wait, give the rest up.
    fn restore_pending(&self, now: Instant) {
        let (waiting, until) = {
            let mut r = lock(&self.restoring);
            (std::mem::take(&mut r.0), r.1)
        };
        if waiting.is_empty() {
            return;
        }
        let mut still = Vec::new();
        for (worker, rank, snapshot) in waiting {
            if self.core().fleet().by_address(&worker).is_some() {
                let input = Input::Restore {
                    worker: &worker,
                    rank,
                    snapshot: &snapshot,
                };
                self.ingest(None, input, now);
            } else if now >= until {
                tracing::warn!(%worker, rank, blocks = snapshot.entries.len(), "cache from the disk snapshot not restored: its worker did not appear (gone, or a Dynamo instance that restarted under a new id)");
                self.metrics
                    .restored_caches
                    .get_or_create(&RestoreLabel {
                        outcome: RestoreOutcome::NotFound,
                    })
                    .inc();
            } else {
                still.push((worker, rank, snapshot));
            }
        }
        lock(&self.restoring).0.extend(still);
    }

    /// The core (held only for a pure call: see the lock model).
    pub fn core(&self) -> MutexGuard<'_, Core> {
        lock(&self.core)
    }

    /// The event sources' bookkeeping.
    pub fn plane(&self) -> MutexGuard<'_, EventPlane> {
        lock(&self.plane)
    }

    /// The replica plane's state: the peers, what was shared, snapshots taken for peers.
    pub fn replication(&self) -> MutexGuard<'_, Brain> {
        lock(&self.replication)
    }

    /// Hand the replica plane's brain an event; what to do about it.
    pub fn replicate(&self, event: Event<'_>, now: Instant) -> Vec<Effect> {
        self.replication().on(event, now)
    }

    /// Snapshot bytes sent to or received from peers.
    pub fn snapshot_bytes(&self, direction: Direction, bytes: usize) {
        self.metrics
            .replica_snapshot_bytes
            .get_or_create(&DirectionLabel { direction })
            .inc_by(bytes as u64);
    }

    /// Caches whose agreement with a peer changed: counted and logged.
    pub fn replica_changes(&self, changes: &[Change]) {
        for c in changes {
            let (worker, rank) = (&c.cache.0, c.cache.1);
            match &c.now {
                Agreement::Divergent { seq, mine, theirs } => {
                    self.metrics.replica_divergences.inc();
                    tracing::warn!(peer = %c.peer, %worker, rank, seq, blocks = mine.blocks, peer_blocks = theirs.blocks, "replicas disagree on a cache after the same event: one of them lost events");
                }
                Agreement::Agree { seq } => {
                    let after = c.healed_after.map(|d| d.as_secs_f64());
                    if let Some(secs) = after {
                        self.metrics.replica_divergence_seconds.observe(secs);
                    }
                    tracing::info!(peer = %c.peer, %worker, rank, seq, divergent_s = ?after, "replicas agree on a cache");
                }
                Agreement::Unknown => {}
            }
        }
        self.replica_gauges(Instant::now());
    }

    /// Whether this sidecar routes with what its peers know (`/readyz`), and why: warm when it
    /// holds every cache a clean peer can give it, or when no peer answered in time. Hints
    /// are served either way, with whatever is known.
    pub fn ready(&self, now: Instant) -> (bool, String) {
        let Some(wait) = self.peer_wait else {
            return (true, "no [replicas]: the events alone".into());
        };
        let mine = self.core().reports();
        let brain = self.replication();
        let r = brain.peers();
        if r.warm(&mine, now) {
            return (
                true,
                "warm: every cache a clean peer holds is held here".into(),
            );
        }
        if !r.has_peers() && now.saturating_duration_since(self.started) >= wait {
            return (true, "no peer heard: started from the events alone".into());
        }
        (false, "warming: taking caches from peers".into())
    }

    /// Forget silent peers and set the replica gauges.
    pub fn replica_gauges(&self, now: Instant) {
        let totals = self.served_totals();
        let (gone, s) = {
            let mut brain = self.replication();
            let r = brain.peers_mut();
            (r.expire(now), r.summary())
        };
        let m = &self.metrics;
        // Set afresh each time: a peer that is gone takes its series with it.
        let families = [
            &m.replica_predicted_cached_tokens,
            &m.replica_actual_cached_tokens,
            &m.replica_prompt_tokens,
        ];
        for f in families {
            f.clear();
        }
        let clamp = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        for ((replica, worker), t) in totals {
            let label = ReplicaWorkerLabels { replica, worker };
            for (f, v) in
                families
                    .into_iter()
                    .zip([t.predicted_tokens, t.cached_tokens, t.prompt_tokens])
            {
                f.get_or_create(&label).set(clamp(v));
            }
        }
        for peer in gone {
            tracing::warn!(%peer, "replica peer silent for three intervals: forgotten");
        }
        m.replica_peers.set(s.peers as i64);
        for (state, n) in [
            (AgreementValue::Agree, s.agree),
            (AgreementValue::Divergent, s.divergent),
            (AgreementValue::Unknown, s.unknown),
        ] {
            m.replica_caches
                .get_or_create(&AgreementLabel { state })
                .set(n as i64);
        }
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

    /// Apply one input at `now` (from `source`, when an event source sent it), count and log
    /// what happened, and return it.
    pub fn ingest(
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

    /// `lost` messages or events on `stream` (of `worker`): the first of a streak is said at
    /// once, the rest when the streak ends ([`crate::streaks`]).
    /// `counter` is the metric that counts every one.
    pub fn lost(&self, stream: &str, counter: &str, worker: Option<&str>, lost: u64, now: Instant) {
        if lock(&self.streaks).lost(stream, worker, lost, now) {
            tracing::warn!(worker = worker.unwrap_or(""), lost, "losses started on {stream}: {counter} counts every one, one line says how many once none for {} s; peer replicas fill lost KV events when [replicas] is set, else a few index entries may be stale until evicted", crate::streaks::QUIET.as_secs());
        }
    }

    /// What an event source's client said about its connection to its server (`name`, as
    /// shown): counted, said in kvroute's own line, shown in `/debug/sources`.
    pub fn connection(
        &self,
        source: usize,
        transport: Transport,
        name: &str,
        what: Connection,
        now: Instant,
    ) {
        let label = SourceLabel { source: transport };
        let transport = transport_name(transport);
        match what {
            Connection::Lost => {
                self.plane().connection_lost(source, now);
                self.metrics.source_disconnects.get_or_create(&label).inc();
                tracing::warn!(source = %name, "{transport} connection lost: KV events published until it is back are lost (Dynamo replays nothing on NATS); reconnecting. Each worker's next event shows its loss in kvroute_lost_events_total; peer replicas fill it when [replicas] is set");
            }
            Connection::Back => {
                if let Some(down) = self.plane().connection_back(source, now) {
                    tracing::warn!(source = %name, down_s = down.as_secs_f64(), "{transport} connection back after {:.1} s; subscriptions restored. What each worker published meanwhile is counted as lost when its next event arrives", down.as_secs_f64());
                }
            }
            Connection::Dropped => {
                self.plane().client_dropped(source);
                self.metrics
                    .source_dropped_messages
                    .get_or_create(&label)
                    .inc();
                self.lost(
                    &format!("the {transport} client's buffer at {name}"),
                    "kvroute_source_dropped_messages_total",
                    None,
                    1,
                    now,
                );
            }
        }
    }

    /// A Dynamo publisher's numbering skipped `lost` messages on `topic`: counted, said once
    /// per streak. (The events among them show again, per worker, in the events' own gaps.)
    pub fn messages_lost(&self, transport: Transport, topic: &str, lost: u64, now: Instant) {
        let topic = if [KV_EVENTS_TOPIC, KV_METRICS_TOPIC].contains(&topic) {
            topic
        } else {
            "other"
        };
        self.metrics
            .lost_messages
            .get_or_create(&TopicLabel {
                source: transport,
                topic: topic.to_owned(),
            })
            .inc_by(lost);
        self.lost(
            &format!(
                "Dynamo messages on {} topic {topic}",
                transport_name(transport)
            ),
            "kvroute_lost_messages_total",
            None,
            lost,
            now,
        );
    }

    /// A Dynamo message stamped `stamp` arrived from `source`: what its publisher's numbering
    /// says was lost before it is counted ([`Sidecar::messages_lost`]).
    pub fn stamped(
        &self,
        source: usize,
        transport: Transport,
        topic: &str,
        stamp: kvroute_protocol::dynamo::Stamp,
        now: Instant,
    ) {
        let lost = self
            .plane()
            .stamp(source, stamp.publisher_id, stamp.sequence);
        if lost > 0 {
            self.messages_lost(transport, topic, lost, now);
        }
    }

    /// A Dynamo KV-event envelope (msgpack, from NATS or a ZMQ data frame) arrived: the first
    /// and then one in `FIELD_CHECK_EVERY` (64) are walked for fields kvroute does not read (the
    /// decode ignores them). A newer engine's fields are on every message it sends; walking
    /// each one twice would cost an event storm a share of its rate.
    pub fn dynamo_fields(&self, transport: Transport, envelope: &[u8]) {
        if !self
            .dynamo_messages
            .fetch_add(1, Ordering::Relaxed)
            .is_multiple_of(FIELD_CHECK_EVERY)
        {
            return;
        }
        for field in kvroute_protocol::dynamo::unknown_fields(envelope) {
            let label = SourceLabel { source: transport };
            self.metrics
                .unknown_event_fields
                .get_or_create(&label)
                .inc();
            if self.plane().unknown_field(&field) {
                tracing::info!(%field, "Dynamo event field kvroute does not know: the events are applied without it (kvroute_unknown_event_fields_total counts the checked messages carrying one)");
            }
        }
    }

    /// Whether `source`'s connection is lost and not back yet.
    pub fn connection_down(&self, source: usize) -> bool {
        self.plane().is_down(source)
    }

    fn say_ended_streaks(&self, now: Instant) {
        let ended = lock(&self.streaks).ended(now);
        for (stream, s) in ended {
            let workers = s.workers.len();
            let lasted = (s.last - s.started).as_secs_f64();
            tracing::warn!(lost = s.lost, times = s.times, workers, lasted_s = lasted, "losses ended on {stream}: {} lost in {} gaps or drops over {lasted:.1} s, {workers} workers", s.lost, s.times);
        }
    }

    /// Turn one thing that happened into metrics and log lines.
    fn record(&self, source: Option<SourceRef<'_>>, h: &Happened, now: Instant) {
        let m = &self.metrics;
        let subject = source.map_or("", |s| s.subject);
        let sequence = |worker: &str, kind: SequenceKind| {
            m.sequence
                .get_or_create(&SequenceLabels {
                    worker: worker.to_owned(),
                    kind,
                })
                .inc();
        };
        let worker_label = |worker: &crate::core::Name| WorkerLabel::new(&worker.address);
        const ZMQ: SourceLabel = SourceLabel {
            source: Transport::Zmq,
        };
        match h {
            Happened::Applied {
                worker,
                kind,
                outcome,
            } => {
                let named = source.is_none_or(|s| self.plane().event(s.index, subject, now));
                m.events
                    .get_or_create(&EventLabels {
                        subject: if named { subject } else { "other" }.to_owned(),
                        r#type: match kind {
                            EventTag::Stored => EventType::Stored,
                            EventTag::Removed => EventType::Removed,
                            EventTag::Cleared => EventType::Cleared,
                        },
                    })
                    .inc();
                if outcome.too_many_caches {
                    tracing::warn!(worker = %worker.address, "index full: more than 65535 caches; event dropped");
                }
                if outcome.orphan {
                    m.orphan_stores.get_or_create(&worker_label(worker)).inc();
                    self.lost(
                        "stored events whose parent block is unknown here (events lost before them, or stored before this sidecar listened)",
                        "kvroute_orphan_stores_total",
                        Some(&worker.address),
                        1,
                        now,
                    );
                }
                if outcome.unknown_removals > 0 {
                    m.unknown_removals.inc_by(outcome.unknown_removals as u64);
                }
                if outcome.evicted > 0 {
                    let counter = m.capacity_evictions.get_or_create(&worker_label(worker));
                    if counter.get() == 0 {
                        tracing::warn!(worker = %worker.address, evicted = outcome.evicted, "the index holds more blocks for this worker than its cache can: removals were lost (or a publisher lies); the oldest entries are dropped, kvroute_capacity_evictions_total counts them");
                    }
                    counter.inc_by(outcome.evicted as u64);
                }
            }
            Happened::Holds { worker, blocks } => {
                m.index_blocks
                    .get_or_create(&worker_label(worker))
                    .set(*blocks as i64);
            }
            Happened::Sequence {
                worker,
                verdict,
                seq,
                delivery,
            } => match verdict {
                Verdict::Gap { from, to } => {
                    sequence(&worker.address, SequenceKind::Gap);
                    if *delivery == Delivery::Live {
                        let lost = to - from;
                        m.lost_events
                            .get_or_create(&worker_label(worker))
                            .inc_by(lost);
                        self.lost(
                            &format!("KV events on {subject}"),
                            "kvroute_lost_events_total",
                            Some(&worker.address),
                            lost,
                            now,
                        );
                    }
                }
                Verdict::Restarted => {
                    sequence(&worker.address, SequenceKind::Restart);
                    tracing::warn!(worker = %worker.address, %subject, seq, "event sequence went back: the engine restarted with an empty cache");
                }
                Verdict::Duplicate => sequence(&worker.address, SequenceKind::Duplicate),
                Verdict::First | Verdict::Next => {}
            },
            Happened::Held { .. } => {}
            Happened::Forgot {
                worker,
                blocks,
                why,
            } => match why {
                Forgot::Restarted => {
                    tracing::warn!(worker = %worker.address, dropped = blocks, "restarted engine: its index entries dropped");
                }
                Forgot::PublisherGone => {
                    sequence(&worker.address, SequenceKind::Disconnect);
                    tracing::warn!(worker = %worker.address, endpoint = %subject, dropped = blocks, "KV-event publisher went away (engine stopped or restarted): its index entries dropped; reconnecting");
                }
                Forgot::Resync => {
                    sequence(&worker.address, SequenceKind::Resync);
                    tracing::warn!(worker = %worker.address, endpoint = %subject, dropped = blocks, "event gap not replayable: worker resynced (index entries dropped)");
                }
                Forgot::WarmStart => sequence(&worker.address, SequenceKind::WarmStart),
                Forgot::Unusable => {
                    tracing::warn!(worker = %worker.address, blocks, "unusable past the grace period: index entries dropped");
                }
            },
            Happened::Refused { worker, problem } => match problem {
                VllmEventProblem::BlockSize { .. } => {
                    let counter = m.block_size_mismatches.get_or_create(&worker_label(worker));
                    if counter.get() == 0 {
                        tracing::error!(worker = %worker.address, %problem, "block-size mismatch: this worker's KV events can never match a request; fix [[models]] block_size or the engine's --block-size");
                    }
                    counter.inc();
                }
                VllmEventProblem::Medium(_) => {
                    m.skipped_events.get_or_create(&ZMQ).inc();
                }
                VllmEventProblem::Tokens { .. } => {
                    tracing::warn!(worker = %worker.address, %problem, "malformed vLLM store event");
                    m.decode_errors.get_or_create(&ZMQ).inc();
                }
            },
            Happened::Rejected { worker, why } => {
                let reason = match why {
                    Rejected::WrongComponent { .. } => RejectReason::WrongComponent,
                    Rejected::TooManyRanks { .. } => RejectReason::TooManyRanks,
                    Rejected::ReadOverZmq => RejectReason::ReadOverZmq,
                };
                let counter = m.rejected_messages.get_or_create(&RejectLabels {
                    worker: worker.address.to_string(),
                    reason,
                });
                if counter.get() == 0 {
                    match why {
                        Rejected::WrongComponent { expected, got } => {
                            tracing::warn!(worker = %worker.address, %subject, %expected, %got, "message naming this worker on another component's subject refused (a misconfigured or hostile publisher); kvroute_rejected_messages_total counts the rest")
                        }
                        Rejected::TooManyRanks { rank, limit } => {
                            tracing::warn!(worker = %worker.address, rank, limit, "message of a data-parallel rank beyond [index] max_ranks_per_worker refused; kvroute_rejected_messages_total counts the rest")
                        }
                        Rejected::ReadOverZmq => {
                            tracing::info!(worker = %worker.address, "this worker's engine is read over ZMQ ([[zmq]] names it): the copies of its events Dynamo relays to NATS are not applied; kvroute_rejected_messages_total{{reason=\"read_over_zmq\"}} counts them")
                        }
                    }
                }
                counter.inc();
            }
            Happened::Bound { worker, component } => {
                tracing::info!(worker = %worker.address, %component, "worker bound to the Dynamo component its first events came on: messages naming it on other components are refused (set [[workers]] dynamo_component to choose)");
            }
            Happened::Capacity { worker, blocks } => {
                m.capacity_blocks
                    .get_or_create(&worker_label(worker))
                    .set(i64::try_from(*blocks).unwrap_or(i64::MAX));
                tracing::info!(worker = %worker.address, blocks, "engine cache capacity learned: the index holds at most this many blocks per cache of it");
            }
            Happened::Repaired {
                worker,
                rank,
                installed,
                blocks,
            } => {
                let kind = if *installed {
                    RepairKind::PeerSnapshot
                } else {
                    RepairKind::Refused
                };
                m.replica_repairs.get_or_create(&RepairLabel { kind }).inc();
                if *installed {
                    tracing::warn!(%worker, rank, blocks, "cache repaired from a peer's snapshot");
                } else {
                    tracing::warn!(%worker, rank, blocks, "peer snapshot refused: the events since it are no longer kept here (or the worker is unknown); asking again later");
                }
            }
            Happened::Restored {
                worker,
                rank,
                installed,
                blocks,
                seq,
            } => {
                let outcome = if *installed {
                    m.restored_blocks.inc_by(*blocks as u64);
                    tracing::info!(%worker, rank, blocks, seq, "cache restored from the disk snapshot; unclean until the events since it are known (a vLLM replay reaching back to it, or a clean peer)");
                    RestoreOutcome::Restored
                } else {
                    tracing::warn!(%worker, rank, blocks, seq, "cache from the disk snapshot not restored: events since it arrived first and are no longer all kept");
                    RestoreOutcome::Refused
                };
                m.restored_caches
                    .get_or_create(&RestoreLabel { outcome })
                    .inc();
            }
            Happened::Filled {
                worker,
                rank,
                messages,
            } => {
                m.replica_lost_messages
                    .get_or_create(&LostLabel {
                        outcome: LostOutcome::Filled,
                    })
                    .inc_by(*messages as u64);
                tracing::debug!(worker = %worker.address, rank, messages, "lost messages filled in from a peer");
            }
            Happened::Unfilled {
                worker,
                rank,
                messages,
            } => {
                m.replica_lost_messages
                    .get_or_create(&LostLabel {
                        outcome: LostOutcome::Unfilled,
                    })
                    .inc_by(*messages as u64);
                tracing::warn!(worker = %worker.address, rank, messages, "lost KV-event messages no peer handed over in time: the cache is unclean until a clean peer's snapshot repairs it");
            }
            Happened::UnknownPublisher { name } => {
                // Names come from the network: past the plane's bound they fold into one series.
                let known = self.plane().unknown_worker(name);
                let counter = m.unknown_worker_events.get_or_create(&PublisherLabel {
                    worker_id: if known { name.clone() } else { "other".into() },
                });
                if counter.get() == 0 {
                    tracing::warn!(publisher = %name, %subject, "KV events from a worker that is neither in [[workers]] nor discovered (yet), or of another model/component: ignored");
                }
                counter.inc();
            }
            Happened::Scanned { model, roles } => {
                for (role, n) in roles {
                    m.discovered_instances
                        .get_or_create(&RoleLabels {
                            model: model.clone(),
                            role: match role {
                                Role::Aggregated => RoleValue::Aggregated,
                                Role::Prefill => RoleValue::Prefill,
                                Role::Decode => RoleValue::Decode,
                            },
                        })
                        .set(*n as i64);
                }
            }
            Happened::Joined { worker, model } => {
                tracing::info!(worker = %worker.address, %model, "a host of Envoy's cluster joined the fleet: hinted by address once its KV events arrive");
            }
            Happened::Added {
                worker,
                instance_id,
                role,
            } => {
                tracing::info!(instance_id, worker = %worker.address, role = role.label(), "Dynamo instance discovered: hinted by instance id");
            }
            Happened::Usable {
                worker,
                usable,
                changed,
                why,
            } => {
                m.worker_usable
                    .get_or_create(&worker_label(worker))
                    .set(i64::from(*usable));
                match (changed, usable) {
                    (true, true) => tracing::info!(worker = %worker.address, "worker usable again"),
                    (true, false) => {
                        tracing::warn!(worker = %worker.address, "{why}: no more hints to it")
                    }
                    _ => {}
                }
            }
            Happened::Served {
                ticket,
                worker,
                predicted_tokens,
                usage,
                prediction,
            } => {
                lock(&self.explained).served(*ticket, *predicted_tokens, *usage);
                let kind = match usage {
                    Usage::Cached { .. } => UsageKind::Cached,
                    Usage::PromptOnly { .. } => UsageKind::PromptOnly,
                    Usage::Missing => UsageKind::Missing,
                    Usage::Malformed => UsageKind::Malformed,
                    Usage::Unanswered => UsageKind::Unanswered,
                    Usage::Unread => UsageKind::Unread,
                };
                m.served_requests
                    .get_or_create(&ServedLabels {
                        worker: worker.address.to_string(),
                        usage: kind,
                    })
                    .inc();
                if let (
                    Usage::Cached {
                        prompt_tokens,
                        cached_tokens,
                    },
                    Some(prediction),
                ) = (usage, prediction)
                {
                    let label = worker_label(worker);
                    let prompt = u64::from(*prompt_tokens);
                    m.predicted_cached_tokens
                        .get_or_create(&label)
                        .inc_by((*predicted_tokens).min(prompt));
                    m.actual_cached_tokens
                        .get_or_create(&label)
                        .inc_by(u64::from(*cached_tokens));
                    m.served_prompt_tokens.get_or_create(&label).inc_by(prompt);
                    let outcome = match prediction {
                        Prediction::Exact => PredictionOutcome::Exact,
                        Prediction::Over => PredictionOutcome::Over,
                        Prediction::Under => PredictionOutcome::Under,
                    };
                    m.predictions
                        .get_or_create(&PredictionLabels {
                            worker: label.worker,
                            outcome,
                        })
                        .inc();
                }
            }
            Happened::Tickets { how, n } => {
                let how = match how {
                    TicketClosed::Finished => TicketHow::Finished,
                    TicketClosed::Unknown => TicketHow::Unknown,
                    TicketClosed::Reclaimed => TicketHow::Reclaimed,
                    TicketClosed::Expired => TicketHow::Expired,
                };
                m.tickets.get_or_create(&TicketLabel { how }).inc_by(*n);
            }
            Happened::Load {
                worker,
                load,
                from_dynamo,
            } => {
                let labels = worker_label(worker);
                m.in_flight
                    .get_or_create(&labels)
                    .set(load.hinted_in_flight as i64);
                if *from_dynamo {
                    m.queued_prefill_blocks
                        .get_or_create(&labels)
                        .set(load.queued_prefill_blocks as i64);
                    m.kv_used_blocks
                        .get_or_create(&labels)
                        .set(load.kv_used_blocks as i64);
                }
            }
        }
    }

    /// Answer a hint request at `now` for the request Envoy calls `request_id` (`None`:
    /// unknown model).
    pub fn hint(
        &self,
        req: &HintRequest,
        request_id: Option<&str>,
        now: Instant,
    ) -> Option<HintResponse> {
        let hint = self.core().hint(req, now);
        let Ok(hint) = hint else {
            self.metrics
                .hints
                .get_or_create(&HintLabels {
                    result: HintResult::UnknownModel,
                })
                .inc();
            return None;
        };
        for h in &hint.happened {
            self.record(None, h, now);
        }
        let mut resp = HintResponse {
            matched_blocks: hint.decision.matched_blocks,
            ticket: hint.ticket,
            ..HintResponse::default()
        };
        match &hint.target {
            Target::None => {}
            Target::Addresses(a) => resp.workers = a.iter().map(|a| a.to_string()).collect(),
            Target::Instance(i) => resp.instance_id = Some(*i),
            Target::Prefill(i) => resp.prefill_instance_id = Some(*i),
        }
        let result = match hint.decision.rule {
            _ if !resp.has_target() => HintResult::NoWorker,
            Rule::NoMatch => HintResult::NoMatch,
            Rule::LongestMatch | Rule::LeastLoaded | Rule::Spread => {
                self.metrics
                    .hint_matched_blocks
                    .inc_by(u64::from(resp.matched_blocks));
                HintResult::Hinted
            }
        };
        self.metrics
            .hints
            .get_or_create(&HintLabels { result })
            .inc();
        if resp.has_target() {
            let rule = match hint.decision.rule {
                Rule::LongestMatch => HintRule::LongestMatch,
                Rule::LeastLoaded => HintRule::LeastLoaded,
                Rule::NoMatch => HintRule::NoMatch,
                Rule::Spread => HintRule::Spread,
            };
            self.metrics
                .hint_rules
                .get_or_create(&RuleLabel { rule })
                .inc();
        }
        self.explain(req, request_id, &resp, &hint.decision);
        Some(resp)
    }

    fn explain(
        &self,
        req: &HintRequest,
        request_id: Option<&str>,
        resp: &HintResponse,
        decision: &Decision,
    ) {
        let at_unix_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        // Written straight to text: through a `serde_json::Value` first, the candidates' maps
        // were most of a hint's time at 256 workers.
        let shown = explained_candidates(&decision.candidates);
        let entry = serde_json::to_string(&ExplainEntry {
            at_unix_ms,
            request_id,
            model: &req.model,
            prompt_blocks: req.hashes.len(),
            first_block: req.hashes.first().map(|h| format!("{:016x}", h.0)),
            last_block: req.hashes.last().map(|h| format!("{:016x}", h.0)),
            decision: ExplainDecision {
                hint: HintResponse {
                    ticket: None,
                    ..resp.clone()
                },
                rule: decision.rule,
                candidates_not_shown: decision.candidates.len() - shown.len(),
                candidates: shown,
            },
        })
        .unwrap_or_default();
        lock(&self.explained).push(resp.ticket, entry);
    }

    /// The recent decisions `query` asks for, newest first, with their outcomes.
    pub fn explained(&self, query: &crate::explain::ExplainQuery) -> Vec<serde_json::Value> {
        // Only the listed entries' tickets: the core is asked under its lock, which hints take.
        let tickets = lock(&self.explained).tickets(query);
        let open = self.core().open_tickets(&tickets);
        lock(&self.explained).list(query, |t| open.contains(&t))
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

    fn activity(&self) -> Activity {
        let core = self.core();
        let (last_hint, last_request) = core.last_hints();
        Activity {
            last_hint,
            last_request,
            workers: core
                .fleet()
                .iter()
                .map(|w| (w.address.to_string(), w.hints_since_event, w.last_event))
                .collect(),
        }
    }

    /// Event source `index` (of `transport`) failed: count it, mark it `retrying` with `error`,
    /// and log the first failure of a streak (later ones only count).
    pub fn source_failed(&self, index: usize, name: &str, transport: Transport, error: &str) {
        self.metrics
            .source_errors
            .get_or_create(&SourceLabel { source: transport })
            .inc();
        if self.plane().failed(index, error.to_owned()) {
            tracing::warn!(source = %name, %error, "event source failing; retrying (hints go on without its events)");
        }
    }

    /// The `no_events` condition at `now` (see [`EventPlane::silent_while_hinting`]).
    pub fn silent_while_hinting(&self, now: Instant) -> bool {
        let (last_hint, _) = self.core().last_hints();
        self.plane()
            .silent_while_hinting(&self.alarms, last_hint, now)
    }

    /// Every replica's per-worker totals: ours from the core, the peers' as last published.
    fn served_totals(&self) -> Totals {
        let mine = self.core().served();
        let brain = self.replication();
        let r = brain.peers();
        let me = r.me().to_owned();
        let mut totals: Totals = mine
            .into_iter()
            .map(|(worker, t)| ((me.clone(), worker), t))
            .collect();
        for (peer, worker, t) in r.served() {
            totals.insert((peer.to_owned(), worker.to_owned()), *t);
        }
        totals
    }

    /// The alarms that are on at `now`: the event plane's, and those on what the engines
    /// reported (weighed over `[alarms] truth_window_s`).
    pub fn alarms_on(&self, now: Instant) -> Vec<Alarm> {
        let activity = self.activity();
        let mut on = self.plane().alarms(&self.alarms, &activity, now);
        let totals = self.served_totals();
        let me = self.replication().peers().me().to_owned();
        let window = Duration::from_secs(self.alarms.truth_window_s);
        {
            let mut watch = lock(&self.truth);
            watch.observe(now, totals, window);
            on.extend(watch.alarms(&me, &self.alarms));
        }
        on.extend(self.divergent_alarms(&me, now));
        on
    }

    /// `replica_divergent`: a cache of ours has disagreed with a peer's after the same message
    /// for `[alarms] divergent_intervals` replica intervals — longer than a repair takes.
    fn divergent_alarms(&self, me: &str, now: Instant) -> Vec<Alarm> {
        let Some(interval) = self.peer_wait.map(|three| three / 3) else {
            return Vec::new();
        };
        let intervals = self.alarms.divergent_intervals;
        let divergent = self
            .replication()
            .peers()
            .divergent_for(now, interval * intervals);
        divergent
            .into_iter()
            .map(|(peer, (worker, rank), long)| Alarm {
                name: "replica_divergent",
                subject: format!("{worker}#{rank}"),
                message: format!(
                    "replica {me}: its copy of worker {worker} (rank {rank}) has disagreed with \
                     replica {peer}'s after the same KV event for {:.1} s, more than \
                     {intervals} intervals: the repair that ends a divergence did not happen — \
                     look for 'replica plane:' WARN lines (a snapshot that failed), compare the \
                     two on /debug/replicas; restarting the replica whose copy is wrong warms it \
                     from its peers",
                    long.as_secs_f64()
                ),
            })
            .collect()
    }

    /// Check the alarms every few seconds, forever: a log line when one starts or stops, and
    /// the `kvroute_alarm{alarm,subject}` gauges.
    pub async fn watch_alarms(self: Arc<Self>) {
        let every = Duration::from_secs((self.alarms.silence_s / 3).clamp(1, 10));
        let mut on: BTreeSet<(&'static str, String)> = BTreeSet::new();
        loop {
            tokio::time::sleep(every).await;
            let alarms = self.alarms_on(Instant::now());
            let now: BTreeSet<_> = alarms.iter().map(|a| (a.name, a.subject.clone())).collect();
            for a in &alarms {
                if !on.contains(&(a.name, a.subject.clone())) {
                    tracing::warn!(alarm = a.name, subject = %a.subject, "{}", a.message);
                }
            }
            for (name, subject) in on.difference(&now) {
                tracing::info!(alarm = name, %subject, "alarm cleared");
            }
            for (name, subject) in on.union(&now) {
                self.metrics
                    .alarm
                    .get_or_create(&AlarmLabels {
                        alarm: name.to_string(),
                        subject: subject.clone(),
                    })
                    .set(i64::from(now.contains(&(name, subject.clone()))));
            }
            on = now;
        }
    }
}

/// One decision as `/debug/explain` shows it.
#[derive(serde::Serialize)]
struct ExplainEntry<'a> {
    at_unix_ms: u64,
    request_id: Option<&'a str>,
    model: &'a str,
    prompt_blocks: usize,
    first_block: Option<String>,
    /// The prefix hash of the whole hashed prompt: equal to `kvroute-sidecar tokenize`'s
    /// `last_block` exactly when the filter saw the same tokens.
    last_block: Option<String>,
    decision: ExplainDecision<'a>,
}

#[derive(serde::Serialize)]
struct ExplainDecision<'a> {
    /// Without the ticket: whoever reads this must not be able to close it.
    hint: HintResponse,
    rule: crate::core::policy::Rule,
    candidates: Vec<&'a crate::core::policy::Candidate>,
    /// Candidates left out: neither among the first nor holding any of the prompt.
    candidates_not_shown: usize,
}

/// The first candidates shown whatever they hold: the hinted workers and their runners-up.
const EXPLAINED_FIRST: usize = 8;

/// The candidates a decision's record shows, in the rule's order: the first
/// [`EXPLAINED_FIRST`] and every other that holds some of the prompt (so a worker not shown
/// matched nothing). At 256 workers, recording every candidate was most of a hint's time.
fn explained_candidates(
    candidates: &[crate::core::policy::Candidate],
) -> Vec<&crate::core::policy::Candidate> {
    candidates
        .iter()
        .enumerate()
        .filter(|(i, c)| *i < EXPLAINED_FIRST || c.matched_blocks > 0 || c.in_flight_blocks > 0)
        .map(|(_, c)| c)
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

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
                block_hashes: vec![EngineBlockHash(1)],
                parent: None,
                token_ids: (0..32).collect(),
                block_size: 32,
                lora_name: None,
                medium: None,
                has_extra_keys: vec![],
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
            sidecar.ingest(None, Input::Message(message), now);
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
            sidecar.ingest(None, Input::Message(message), now);
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
            sidecar.ingest(
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
