//! [`Source`]: an event source's handle on the sidecar, and [`DiscoverySource`], a discovery
//! entry's. A transport says what it sees — its connection, each message, what it could not
//! read, what a publisher's numbering shows was lost — and hands its inputs over; the event
//! plane's bookkeeping (`/debug/sources`), the metrics and the lines are done here, so a
//! transport cannot forget one.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_protocol::dynamo::{Stamp, KV_EVENTS_TOPIC, KV_METRICS_TOPIC};

use super::{lock, Sidecar, SourceRef};
use crate::config::DiscoveryConfig;
use crate::core::{Happened, Input};
use crate::event_plane::{DiscoveryStatus, SourceStatus};
use crate::metrics::{
    RepairKind, RepairLabel, SequenceKind, SequenceLabels, SourceLabel, TopicLabel, Transport,
};

/// What an event source's client reports about its connection ([`Source::connection`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Connection {
    /// The connection to the server is lost (the client reconnects by itself).
    Lost,
    /// It is back.
    Back,
    /// The client dropped a message before the sidecar read it (its buffer was full).
    Dropped,
}

/// One Dynamo KV-event message in this many is checked for unknown fields.
const FIELD_CHECK_EVERY: u64 = 64;

/// How log lines name a transport.
fn transport_name(transport: Transport) -> &'static str {
    match transport {
        Transport::Nats => "NATS",
        Transport::Zmq => "ZMQ",
        Transport::DynamoZmq => "Dynamo ZMQ",
    }
}

/// Whose events a transport carries, as lines name them.
fn format_name(transport: Transport) -> &'static str {
    match transport {
        Transport::Nats | Transport::DynamoZmq => "Dynamo",
        Transport::Zmq => "vLLM",
    }
}

/// How `/debug/sources` names a transport's kind.
fn kind(transport: Transport) -> &'static str {
    match transport {
        Transport::Nats => "nats",
        Transport::Zmq => "zmq",
        Transport::DynamoZmq => "dynamo-zmq",
    }
}

/// One event source, registered with the event plane ([`Sidecar::source`]).
pub struct Source {
    sidecar: Arc<Sidecar>,
    index: usize,
    transport: Transport,
    /// As lines show it: a URL without credentials, an endpoint.
    name: Arc<str>,
    label: SourceLabel,
}

impl Sidecar {
    /// Register an event source of `transport`, shown as `name`, subscribed to `subscriptions`.
    pub fn source(
        self: &Arc<Self>,
        transport: Transport,
        name: &str,
        subscriptions: Vec<String>,
    ) -> Source {
        let index = self.plane().register(kind(transport), name, subscriptions);
        Source {
            sidecar: Arc::clone(self),
            index,
            transport,
            name: name.into(),
            label: SourceLabel { source: transport },
        }
    }

    /// Every event source's state, for `/debug/sources`.
    pub fn sources(&self, now: Instant) -> Vec<SourceStatus> {
        self.plane().sources(now)
    }

    /// Register a Dynamo discovery entry.
    pub fn discovery_source(self: &Arc<Self>, config: &DiscoveryConfig) -> DiscoverySource {
        let entry = self.plane().register_discovery(config);
        DiscoverySource {
            sidecar: Arc::clone(self),
            entry,
        }
    }

    /// Every discovery entry's state, for `/debug/discovery`.
    pub fn discovery(&self) -> Vec<DiscoveryStatus> {
        self.plane().discovery()
    }

    /// `lost` messages or events on `stream` (of `worker`): the first of a streak is said at
    /// once, the rest when the streak ends ([`crate::streaks`]).
    /// `counter` is the metric that counts every one.
    pub(super) fn lost(
        &self,
        stream: &str,
        counter: &str,
        worker: Option<&str>,
        lost: u64,
        now: Instant,
    ) {
        if lock(&self.streaks).lost(stream, worker, lost, now) {
            tracing::warn!(worker = worker.unwrap_or(""), lost, "losses started on {stream}: {counter} counts every one, one line says how many once none for {} s; peer replicas fill lost KV events when [replicas] is set, else a few index entries may be stale until evicted", crate::streaks::QUIET.as_secs());
        }
    }

    /// Say each streak of losses that ended by `now`, with its count.
    pub(super) fn say_ended_streaks(&self, now: Instant) {
        let ended = lock(&self.streaks).ended(now);
        for (stream, s) in ended {
            let workers = s.workers.len();
            let lasted = (s.last - s.started).as_secs_f64();
            tracing::warn!(lost = s.lost, times = s.times, workers, lasted_s = lasted, "losses ended on {stream}: {} lost in {} gaps or drops over {lasted:.1} s, {workers} workers", s.lost, s.times);
        }
    }
}

impl Source {
    /// Its number in `/debug/sources`, unique in this process.
    pub fn id(&self) -> usize {
        self.index
    }

    /// Apply one input this source delivered (its messages are counted under `subject`).
    pub fn ingest(&self, subject: &str, input: Input<'_>, now: Instant) -> Vec<Happened> {
        let from = SourceRef {
            index: self.index,
            subject,
        };
        self.sidecar.ingest_from(Some(from), input, now)
    }

    /// Its subscriptions are in place (again).
    pub fn subscribed(&self) {
        self.sidecar.plane().subscribed(self.index);
    }

    /// It failed with `error` and is retrying: counted, shown, the first of a streak said
    /// (later ones only count).
    pub fn failed(&self, error: &str) {
        let s = &self.sidecar;
        s.metrics.source_errors.get_or_create(&self.label).inc();
        if s.plane().failed(self.index, error.to_owned()) {
            tracing::warn!(source = %self.name, %error, "event source failing; retrying (hints go on without its events)");
        }
    }

    /// Its one publisher's connection closed (the engine went away).
    pub fn publisher_gone(&self) {
        self.sidecar.plane().disconnected(self.index);
    }

    /// It closed for good (its host left the fleet).
    pub fn retire(self) {
        self.sidecar.plane().retire(self.index);
    }

    /// What its client said about the connection to its server: counted, said in kvroute's
    /// own line, shown in `/debug/sources`.
    pub fn connection(&self, what: Connection, now: Instant) {
        let (s, name) = (&self.sidecar, &self.name);
        let transport = transport_name(self.transport);
        match what {
            Connection::Lost => {
                s.plane().connection_lost(self.index, now);
                s.metrics
                    .source_disconnects
                    .get_or_create(&self.label)
                    .inc();
                tracing::warn!(source = %name, "{transport} connection lost: KV events published until it is back are lost (Dynamo replays nothing on NATS); reconnecting. Each worker's next event shows its loss in kvroute_lost_events_total; peer replicas fill it when [replicas] is set");
            }
            Connection::Back => {
                if let Some(down) = s.plane().connection_back(self.index, now) {
                    tracing::warn!(source = %name, down_s = down.as_secs_f64(), "{transport} connection back after {:.1} s; subscriptions restored. What each worker published meanwhile is counted as lost when its next event arrives", down.as_secs_f64());
                }
            }
            Connection::Dropped => {
                s.plane().client_dropped(self.index);
                s.metrics
                    .source_dropped_messages
                    .get_or_create(&self.label)
                    .inc();
                s.lost(
                    &format!("the {transport} client's buffer at {name}"),
                    "kvroute_source_dropped_messages_total",
                    None,
                    1,
                    now,
                );
            }
        }
    }

    /// Whether its connection is lost and not back yet.
    pub fn connection_down(&self) -> bool {
        self.sidecar.plane().is_down(self.index)
    }

    /// A message arrived on `subject`; whether it decoded.
    pub fn received(&self, subject: &str, decoded: bool) {
        self.sidecar.plane().message(self.index, subject, decoded);
    }

    /// A message, or a payload in one, did not decode: counted, said.
    pub fn undecodable(&self, subject: &str, error: &str, bytes: usize) {
        tracing::warn!(source = %self.name, %subject, %error, bytes, "undecodable {} KV-event message on {}", format_name(self.transport), transport_name(self.transport));
        self.sidecar
            .metrics
            .decode_errors
            .get_or_create(&self.label)
            .inc();
    }

    /// `events` events of a kind kvroute does not index were skipped in a message.
    pub fn skipped(&self, events: usize) {
        if events > 0 {
            self.sidecar
                .metrics
                .skipped_events
                .get_or_create(&self.label)
                .inc_by(events as u64);
        }
    }

    /// A message carried `fields` kvroute does not read (a newer engine's): counted, each
    /// name said once.
    pub fn unknown_fields(&self, fields: &[String]) {
        let s = &self.sidecar;
        for field in fields {
            s.metrics
                .unknown_event_fields
                .get_or_create(&self.label)
                .inc();
            if s.plane().unknown_field(field) {
                tracing::info!(source = %self.name, %field, "{} event field kvroute does not know: the events are applied without it (kvroute_unknown_event_fields_total counts the checked messages carrying one)", format_name(self.transport));
            }
        }
    }

    /// A Dynamo KV-event envelope (msgpack, from NATS or a ZMQ data frame) arrived: the first
    /// and then one in `FIELD_CHECK_EVERY` (64) are walked for fields kvroute does not read
    /// (the decode ignores them). A newer engine's fields are on every message it sends;
    /// walking each one twice would cost an event storm a share of its rate.
    pub fn dynamo_fields(&self, envelope: &[u8]) {
        let checked = self.sidecar.dynamo_messages.fetch_add(1, Ordering::Relaxed);
        if checked.is_multiple_of(FIELD_CHECK_EVERY) {
            self.unknown_fields(&kvroute_protocol::dynamo::unknown_fields(envelope));
        }
    }

    /// `events` events of a cache group that is not a prefix cache (a hybrid model's
    /// sliding-window or state-space layers) were left out.
    pub fn other_groups(&self, events: u64) {
        if events == 0 {
            return;
        }
        let counter = self
            .sidecar
            .metrics
            .other_group_events
            .get_or_create(&self.label);
        if counter.get() == 0 {
            tracing::info!(source = %self.name, "events of a cache group that is not a prefix cache (a hybrid model's sliding-window or state-space layers): not indexed; kvroute_other_group_events_total counts them");
        }
        counter.inc_by(events);
    }

    /// A Dynamo message on `topic` stamped `stamp` arrived: what its publisher's numbering says
    /// was lost before it is counted ([`Source::messages_lost`]).
    pub fn stamped(&self, topic: &str, stamp: Stamp, now: Instant) {
        let lost = self
            .sidecar
            .plane()
            .stamp(self.index, stamp.publisher_id, stamp.sequence);
        if lost > 0 {
            self.messages_lost(topic, lost, now);
        }
    }

    /// A Dynamo publisher's numbering skipped `lost` messages on `topic`: counted, said once
    /// per streak. (The events among them show again, per worker, in the events' own gaps.)
    pub fn messages_lost(&self, topic: &str, lost: u64, now: Instant) {
        let topic = if [KV_EVENTS_TOPIC, KV_METRICS_TOPIC].contains(&topic) {
            topic
        } else {
            "other"
        };
        self.sidecar
            .metrics
            .lost_messages
            .get_or_create(&TopicLabel {
                source: self.transport,
                topic: topic.to_owned(),
            })
            .inc_by(lost);
        self.sidecar.lost(
            &format!(
                "Dynamo messages on {} topic {topic}",
                transport_name(self.transport)
            ),
            "kvroute_lost_messages_total",
            None,
            lost,
            now,
        );
    }

    /// `messages` of worker `worker` were read again from its engine's replay buffer.
    pub fn replayed(&self, worker: &str, messages: u64) {
        self.sidecar
            .metrics
            .sequence
            .get_or_create(&SequenceLabels {
                worker: worker.to_owned(),
                kind: SequenceKind::Replayed,
            })
            .inc_by(messages);
    }

    /// A gap of worker `worker`'s was filled with `messages` from its engine's replay buffer: a
    /// replay, and a repair.
    pub fn gap_filled(&self, worker: &str, messages: u64) {
        self.replayed(worker, messages);
        self.sidecar
            .metrics
            .replica_repairs
            .get_or_create(&RepairLabel {
                kind: RepairKind::EngineReplay,
            })
            .inc();
    }

    /// The thresholds its alarm uses ([`crate::config::AlarmConfig`]).
    pub fn alarms(&self) -> &crate::config::AlarmConfig {
        &self.sidecar.alarms
    }

    /// The `no_events` condition at `now`: no KV event arrives while hints are served.
    pub fn silent_while_hinting(&self, now: Instant) -> bool {
        self.sidecar.silent_while_hinting(now)
    }

    /// Whether a look at the whole bus is due (one per `every` while the condition lasts).
    pub fn bus_probe_due(&self, every: Duration, now: Instant) -> bool {
        self.sidecar.plane().bus_probe_due(self.index, every, now)
    }

    /// What a look at the whole bus saw: messages per subject, and the verdict.
    pub fn bus_looked(&self, seen: BTreeMap<String, u64>, verdict: String, now: Instant) {
        self.sidecar
            .plane()
            .record_bus(self.index, seen, verdict, now);
    }
}

/// One Dynamo discovery entry, registered with the event plane
/// ([`Sidecar::discovery_source`]).
pub struct DiscoverySource {
    sidecar: Arc<Sidecar>,
    entry: usize,
}

impl DiscoverySource {
    /// A scan found `hintable` instances and `kv_publishers` (with, of all) KV-event publishers.
    pub fn found(&self, hintable: usize, summary: String, kv_publishers: (usize, usize)) {
        self.sidecar
            .plane()
            .discovered(self.entry, hintable, summary, kv_publishers);
    }

    /// Reading the records failed with `error`.
    pub fn failed(&self, error: String, now: Instant) {
        self.sidecar
            .plane()
            .discovery_failed(self.entry, error, now);
    }
}
