//! Prometheus metrics of the sidecar, served as text on `/metrics`.

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

/// A closed set of label values, each with its text.
macro_rules! label_values {
    ($(#[$doc:meta])* $name:ident { $($(#[$vdoc:meta])* $variant:ident => $text:literal),* $(,)? }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $($(#[$vdoc])* $variant),*
        }

        impl EncodeLabelValue for $name {
            fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
                std::fmt::Write::write_str(encoder, match self {
                    $($name::$variant => $text),*
                })
            }
        }
    };
}

label_values!(
    /// What a hint request came to.
    HintResult {
        /// A match decided.
        Hinted => "hinted",
        /// Nothing matched: the prompt's home or the least loaded.
        NoMatch => "no_match",
        /// No usable worker: no hint.
        NoWorker => "no_worker",
        /// A model without an index.
        UnknownModel => "unknown_model",
        /// The body did not decode.
        BadRequest => "bad_request",
    }
);

label_values!(
    /// Which part of the routing rule decided a hint ([`crate::core::policy::Rule`]).
    HintRule {
        /// The cheapest worker holds the longest match.
        LongestMatch => "longest_match",
        /// Load outweighed the longest match: a less busy worker.
        LeastLoaded => "least_loaded",
        /// Nothing useful matched: the prompt's home or the least loaded.
        NoMatch => "no_match",
        /// A popular prefix spread to one more holder.
        Spread => "spread",
    }
);

label_values!(
    /// A KV event's kind.
    EventType {
        /// Blocks stored.
        Stored => "stored",
        /// Blocks removed.
        Removed => "removed",
        /// A cache cleared.
        Cleared => "cleared",
    }
);

label_values!(
    /// A KV-event transport.
    Transport {
        /// NATS (Dynamo).
        Nats => "nats",
        /// ZMQ (vLLM).
        Zmq => "zmq",
        /// Dynamo's ZMQ event plane (publishers found in discovery).
        DynamoZmq => "dynamo_zmq",
    }
);

label_values!(
    /// Sequence trouble on an event stream.
    SequenceKind {
        /// Messages missing.
        Gap => "gap",
        /// Messages fetched from a replay socket.
        Replayed => "replayed",
        /// A gap not replayable: the worker started over.
        Resync => "resync",
        /// The counter went back: the engine restarted.
        Restart => "restart",
        /// The publisher's connection closed.
        Disconnect => "disconnect",
        /// Rebuilt from a replay buffer at (re)connection.
        WarmStart => "warm_start",
        /// A live copy of a message a warm start applied.
        Duplicate => "duplicate",
    }
);

label_values!(
    /// How a ticket was closed.
    TicketHow {
        /// Reported finished.
        Finished => "finished",
        /// Reported but not open.
        Unknown => "unknown",
        /// A scrape showed fewer requests.
        Reclaimed => "reclaimed",
        /// Past its lifetime.
        Expired => "expired",
    }
);

label_values!(
    /// A Dynamo worker's role.
    RoleValue {
        /// Prefill and decode.
        Aggregated => "aggregated",
        /// Disaggregated prefill.
        Prefill => "prefill",
        /// Disaggregated decode.
        Decode => "decode",
    }
);

label_values!(
    /// Why a message naming a known worker was refused.
    RejectReason {
        /// On another component's subject.
        WrongComponent => "wrong_component",
        /// A data-parallel rank past `[index] max_ranks_per_worker`.
        TooManyRanks => "too_many_ranks",
        /// A Dynamo relay's copy of events read over ZMQ.
        ReadOverZmq => "read_over_zmq",
    }
);

/// `{worker, reason}` of `kvroute_rejected_messages_total`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct RejectLabels {
    /// The worker's address.
    pub worker: String,
    /// Why.
    pub reason: RejectReason,
}

label_values!(
    /// How a cache compares with a peer's.
    AgreementValue {
        /// Same blocks after the same event.
        Agree => "agree",
        /// Different blocks after the same event.
        Divergent => "divergent",
        /// No event both have a checkpoint for.
        Unknown => "unknown",
    }
);

label_values!(
    /// How a cache was repaired.
    RepairKind {
        /// A gap filled from the engine's replay socket (vLLM).
        EngineReplay => "engine_replay",
        /// From a clean peer's snapshot.
        PeerSnapshot => "peer_snapshot",
        /// A snapshot arrived but could not be installed.
        Refused => "refused",
    }
);

label_values!(
    /// What became of a KV-event message this replica lost.
    LostOutcome {
        /// A peer handed it over; applied in its place.
        Filled => "filled",
        /// No peer had it in time: the cache is unclean until a snapshot repairs it.
        Unfilled => "unfilled",
    }
);

/// `{outcome}` of `kvroute_replica_lost_messages_total`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct LostLabel {
    /// What became of them.
    pub outcome: LostOutcome,
}

label_values!(
    /// What became of a cache read from the disk snapshot at start.
    RestoreOutcome {
        /// Put back.
        Restored => "restored",
        /// Refused: events after it arrived first, and this sidecar no longer keeps them all.
        Refused => "refused",
        /// Its worker did not appear within `restore_wait_ms` (gone, or a Dynamo instance that
        /// restarted under a new id).
        NotFound => "not_found",
    }
);

/// `{outcome}` of `kvroute_restored_caches_total`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct RestoreLabel {
    /// What became of it.
    pub outcome: RestoreOutcome,
}

/// `{kind}` of `kvroute_replica_repairs_total`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct RepairLabel {
    /// How.
    pub kind: RepairKind,
}

label_values!(
    /// Which way bytes went.
    Direction {
        /// To a peer.
        Sent => "sent",
        /// From a peer.
        Received => "received",
    }
);

/// `{direction}` of `kvroute_replica_snapshot_bytes_total`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct DirectionLabel {
    /// Which way.
    pub direction: Direction,
}

/// `{state}` of `kvroute_replica_caches`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct AgreementLabel {
    /// How they compare.
    pub state: AgreementValue,
}

/// `{worker}`: a worker's address (from the configuration or discovery, never from an event).
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct WorkerLabel {
    /// The worker's address.
    pub worker: String,
}

impl WorkerLabel {
    /// The label of the worker at `address`.
    pub fn new(address: &str) -> Self {
        WorkerLabel {
            worker: address.to_owned(),
        }
    }
}

/// `{result}` of `kvroute_hints_total`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct HintLabels {
    /// What the request came to.
    pub result: HintResult,
}

/// `{rule}` of `kvroute_hint_rules_total`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct RuleLabel {
    /// Which part of the rule decided.
    pub rule: HintRule,
}

/// `{subject, type}` of `kvroute_events_total`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct EventLabels {
    /// The NATS subject or ZMQ endpoint.
    pub subject: String,
    /// The event's kind.
    pub r#type: EventType,
}

/// `{source,topic}` of `kvroute_lost_messages_total`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct TopicLabel {
    /// The transport.
    pub source: Transport,
    /// `kv-events` or `kv_metrics` (a known topic; others are `other`).
    pub topic: String,
}

/// `{source}`: which transport.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct SourceLabel {
    /// The transport.
    pub source: Transport,
}

/// `{worker_id}` of `kvroute_unknown_worker_events_total`: how an unknown publisher named
/// itself, bounded (see `Sidecar::record`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct PublisherLabel {
    /// The publisher's name, or `other`.
    pub worker_id: String,
}

/// `{worker, kind}` of `kvroute_sequence_total`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct SequenceLabels {
    /// The worker's address.
    pub worker: String,
    /// What happened.
    pub kind: SequenceKind,
}

/// `{alarm, subject}` of `kvroute_alarm`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct AlarmLabels {
    /// The alarm's name.
    pub alarm: String,
    /// What it is about.
    pub subject: String,
}

/// `{how}` of `kvroute_tickets_total`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct TicketLabel {
    /// How the ticket closed.
    pub how: TicketHow,
}

label_values!(
    /// What a finished request's response said about its prompt.
    UsageKind {
        /// `usage.prompt_tokens_details.cached_tokens`.
        Cached => "cached",
        /// A usage without cached tokens.
        PromptOnly => "prompt_only",
        /// A successful response without a usage.
        Missing => "missing",
        /// A usage that could not be read.
        Malformed => "malformed",
        /// No successful response seen to its end.
        Unanswered => "unanswered",
        /// Not read by the filter (`read_usage` off, or a stream outside its sample).
        Unread => "unread",
    }
);

label_values!(
    /// How a hint's predicted cached tokens compared with the engine's.
    PredictionOutcome {
        /// Within one block.
        Exact => "exact",
        /// More than a block above.
        Over => "over",
        /// More than a block below.
        Under => "under",
    }
);

/// `{worker, usage}` of `kvroute_served_requests_total`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct ServedLabels {
    /// The worker's address.
    pub worker: String,
    /// What the response said.
    pub usage: UsageKind,
}

/// `{worker, outcome}` of `kvroute_predictions_total`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct PredictionLabels {
    /// The worker's address.
    pub worker: String,
    /// How the prediction compared.
    pub outcome: PredictionOutcome,
}

/// `{replica, worker}` of the `kvroute_replica_*_tokens` gauges.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct ReplicaWorkerLabels {
    /// The replica's id (this one's too).
    pub replica: String,
    /// The worker's address.
    pub worker: String,
}

/// `{model, role}` of `kvroute_discovered_instances`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct RoleLabels {
    /// The model.
    pub model: String,
    /// The role.
    pub role: RoleValue,
}

/// Every metric the sidecar exports.
pub struct Metrics {
    registry: Registry,
    /// Hint requests by result: `hinted` (a match decided), `no_match` (least loaded, cold),
    /// `no_worker` (none usable: no hint), `unknown_model`, `bad_request`.
    pub hints: Family<HintLabels, Counter>,
    /// Sum of matched blocks over hinted requests.
    pub hint_matched_blocks: Counter,
    /// Hints that named a worker, by the part of the rule that chose it.
    pub hint_rules: Family<RuleLabel, Counter>,
    /// Blocks the index holds per worker.
    pub index_blocks: Family<WorkerLabel, Gauge>,
    /// Events applied, by subject (or endpoint) and type.
    pub events: Family<EventLabels, Counter>,
    /// Messages that did not decode, by source.
    pub decode_errors: Family<SourceLabel, Counter>,
    /// Event-source failures (connection attempts, handshakes, sessions), by transport.
    pub source_errors: Family<SourceLabel, Counter>,
    /// Array elements of a message that were not events we know, by source.
    pub skipped_events: Family<SourceLabel, Counter>,
    /// Dynamo messages lost on the way (gaps in a publisher's own numbering of its messages),
    /// by transport and topic: whatever they carried — events, load reports, or a worker no one
    /// knows.
    pub lost_messages: Family<TopicLabel, Counter>,
    /// Event fields kvroute does not know, by source: one per field per batch.
    pub unknown_event_fields: Family<SourceLabel, Counter>,
    /// Events of an engine's cache group that is not a prefix cache (a hybrid model's
    /// sliding-window or state-space layers): not indexed.
    pub other_group_events: Family<SourceLabel, Counter>,
    /// Events about copies outside GPU memory (offloaded to CPU, disk, a shared store), by
    /// worker: not indexed.
    pub offloaded_events: Family<WorkerLabel, Counter>,
    /// Events missing from a worker's sequence numbers (the sizes of live gaps), by worker: lost
    /// on the way here, whatever lost them.
    pub lost_events: Family<WorkerLabel, Counter>,
    /// Messages a source's client library dropped before the sidecar read them (its buffer was
    /// full: NATS's "slow consumer"), by transport. A lower bound: the library reports drops on
    /// a bounded channel of its own.
    pub source_dropped_messages: Family<SourceLabel, Counter>,
    /// Connections to an event source's server lost, by transport.
    pub source_disconnects: Family<SourceLabel, Counter>,
    /// Events from a worker id that is not configured.
    pub unknown_worker_events: Family<PublisherLabel, Counter>,
    /// Stores whose parent block was unknown, by worker.
    pub orphan_stores: Family<WorkerLabel, Counter>,
    /// Removals of blocks the index did not hold.
    pub unknown_removals: Counter,
    /// Engine `/metrics` scrapes that failed, by worker.
    pub scrape_errors: Family<WorkerLabel, Counter>,
    /// 1 when Envoy lists the worker as healthy (only with `[envoy]` configured).
    pub worker_usable: Family<WorkerLabel, Gauge>,
    /// Stored events whose block size differs from the model's, by worker.
    pub block_size_mismatches: Family<WorkerLabel, Counter>,
    /// Sequence trouble on an event stream, by worker and kind (`gap`, `replayed`, `resync`,
    /// `restart`, `disconnect`, `warm_start`).
    pub sequence: Family<SequenceLabels, Counter>,
    /// 1 while an event-plane alarm is on (`alarm`: `no_events`, `silent_worker`).
    pub alarm: Family<AlarmLabels, Gauge>,
    /// Hinted requests not finished yet, by worker.
    pub in_flight: Family<WorkerLabel, Gauge>,
    /// Prompt blocks queued for prefill, by worker (Dynamo `kv_metrics`).
    pub queued_prefill_blocks: Family<WorkerLabel, Gauge>,
    /// KV blocks in use, by worker (Dynamo `kv_metrics`).
    pub kv_used_blocks: Family<WorkerLabel, Gauge>,
    /// Tickets closed, by how: finished (reported), unknown (reported but not open),
    /// reclaimed (a scrape showed fewer requests), expired.
    pub tickets: Family<TicketLabel, Counter>,
    /// Dynamo instances with a discovery record, by model and role (`aggregated`, `prefill`,
    /// `decode`).
    pub discovered_instances: Family<RoleLabels, Gauge>,
    /// Messages naming a known worker that were refused, by worker and reason.
    pub rejected_messages: Family<RejectLabels, Counter>,
    /// Blocks one cache of the worker holds at most (engine or configuration).
    pub capacity_blocks: Family<WorkerLabel, Gauge>,
    /// Blocks dropped, oldest first, from a cache holding more than its capacity, by worker.
    pub capacity_evictions: Family<WorkerLabel, Counter>,
    /// Peers heard from on the replica plane.
    pub replica_peers: Gauge,
    /// Caches by how they compare with each peer's (a cache counts once per peer).
    pub replica_caches: Family<AgreementLabel, Gauge>,
    /// Divergences found (a cache of a peer going from agree or unknown to divergent).
    pub replica_divergences: Counter,
    /// How long caches stayed divergent before agreeing again.
    pub replica_divergence_seconds: Histogram,
    /// How long answering a hint took, from its decoded request to its answer (the core's
    /// lock waited for included).
    pub hint_seconds: Histogram,
    /// Hint streams open: one per Envoy worker thread whose filter asks on a stream.
    pub hint_streams: Gauge,
    /// Repairs of caches, by kind.
    pub replica_repairs: Family<RepairLabel, Counter>,
    /// KV-event messages lost here, filled in by a peer or not.
    pub replica_lost_messages: Family<LostLabel, Counter>,
    /// Snapshot bytes sent to and received from peers.
    pub replica_snapshot_bytes: Family<DirectionLabel, Counter>,
    /// Caches read from the disk snapshot at start, by outcome.
    pub restored_caches: Family<RestoreLabel, Counter>,
    /// Blocks put back from the disk snapshot.
    pub restored_blocks: Counter,
    /// Bytes of the last disk snapshot written.
    pub disk_snapshot_bytes: Gauge,
    /// Disk snapshots that could not be written.
    pub disk_snapshot_failures: Counter,
    /// Hinted requests finished, by worker and what their response's usage said.
    pub served_requests: Family<ServedLabels, Counter>,
    /// Cached prompt tokens the hints predicted, by worker (requests whose usage said).
    pub predicted_cached_tokens: Family<WorkerLabel, Counter>,
    /// Cached prompt tokens the engines reported, by worker (the same requests).
    pub actual_cached_tokens: Family<WorkerLabel, Counter>,
    /// Prompt tokens the engines reported, by worker (the same requests).
    pub served_prompt_tokens: Family<WorkerLabel, Counter>,
    /// Predictions by worker and how they compared with the engine's count.
    pub predictions: Family<PredictionLabels, Counter>,
    /// The engine's own `vllm:prefix_cache_hits_total` (tokens) as last scraped, by worker.
    pub engine_prefix_cache_hits: Family<WorkerLabel, Gauge<f64, AtomicU64>>,
    /// The engine's own `vllm:prefix_cache_queries_total` (tokens) as last scraped, by worker.
    pub engine_prefix_cache_queries: Family<WorkerLabel, Gauge<f64, AtomicU64>>,
    /// Every replica's predicted cached tokens per worker, as it last published them.
    pub replica_predicted_cached_tokens: Family<ReplicaWorkerLabels, Gauge>,
    /// Every replica's reported cached tokens per worker.
    pub replica_actual_cached_tokens: Family<ReplicaWorkerLabels, Gauge>,
    /// Every replica's reported prompt tokens per worker.
    pub replica_prompt_tokens: Family<ReplicaWorkerLabels, Gauge>,
    /// Tests only: KV-event messages dropped by `[replicas] test_drop_events`.
    pub test_dropped_events: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut r = Registry::with_prefix("kvroute");
        Metrics {
            hints: family(&mut r, "hints", "Hint requests by result"),
            hint_matched_blocks: counter(&mut r, "hint_matched_blocks", "Matched blocks summed over hinted requests"),
            hint_rules: family(&mut r, "hint_rules", "Hints that named a worker, by the part of the routing rule that chose it"),
            index_blocks: family(&mut r, "index_blocks", "Blocks indexed per worker"),
            events: family(&mut r, "events", "KV events applied by subject and type"),
            decode_errors: family(&mut r, "decode_errors", "Messages that did not decode"),
            source_errors: family(
                &mut r,
                "source_errors",
                "Event source failures: connection attempts, handshakes, sessions",
            ),
            skipped_events: family(&mut r, "skipped_events", "Elements of a message that were not known events"),
            lost_messages: family(&mut r, "lost_messages", "Dynamo messages lost on the way here (gaps in a publisher's own numbering), by transport and topic"),
            unknown_event_fields: family(&mut r, "unknown_event_fields", "Event fields kvroute does not know (one per field per vLLM batch or checked Dynamo message)"),
            other_group_events: family(&mut r, "other_group_events", "Events of a cache group that is not a prefix cache (sliding window, state space): not indexed"),
            offloaded_events: family(&mut r, "offloaded_events", "Events about copies outside GPU memory (vLLM medium, Dynamo storage tier): not indexed"),
            lost_events: family(&mut r, "lost_events", "Events missing from a worker's sequence numbers: lost on the way here"),
            source_dropped_messages: family(&mut r, "source_dropped_messages", "Messages an event source's client library dropped before the sidecar read them (buffer full)"),
            source_disconnects: family(&mut r, "source_disconnects", "Connections to an event source's server lost"),
            unknown_worker_events: family(&mut r, "unknown_worker_events", "Events from workers not in the configuration"),
            orphan_stores: family(&mut r, "orphan_stores", "Stored events whose parent block is unknown"),
            unknown_removals: counter(&mut r, "unknown_removals", "Removed blocks the index did not hold"),
            scrape_errors: family(&mut r, "scrape_errors", "Engine /metrics scrapes that failed"),
            worker_usable: family(&mut r, "worker_usable", "1 when Envoy lists the worker as healthy"),
            block_size_mismatches: family(&mut r, "block_size_mismatches", "Stored events whose block size differs from the configured one"),
            sequence: family(&mut r, "sequence", "Event stream sequence trouble: gap, replayed, resync, restart, disconnect, warm_start"),
            alarm: family(&mut r, "alarm", "1 while an event-plane alarm is on"),
            in_flight: family(&mut r, "in_flight", "Hinted requests not finished yet"),
            queued_prefill_blocks: family(&mut r, "queued_prefill_blocks", "Prompt blocks queued for prefill (Dynamo kv_metrics)"),
            kv_used_blocks: family(&mut r, "kv_used_blocks", "KV blocks in use (Dynamo kv_metrics)"),
            tickets: family(&mut r, "tickets", "Hint tickets closed, by how"),
            discovered_instances: family(&mut r, "discovered_instances", "Dynamo instances with a record in the discovery directory"),
            rejected_messages: family(&mut r, "rejected_messages", "Messages naming a known worker refused: wrong_component, too_many_ranks"),
            capacity_blocks: family(&mut r, "capacity_blocks", "Blocks one cache of the worker holds at most"),
            capacity_evictions: family(&mut r, "capacity_evictions", "Blocks dropped oldest first from a cache over its capacity"),
            replica_peers: gauge(&mut r, "replica_peers", "Peers heard from on the replica plane"),
            replica_caches: family(&mut r, "replica_caches", "Caches by how they compare with each peer's: agree, divergent, unknown"),
            replica_divergences: counter(&mut r, "replica_divergences", "Caches found to disagree with a peer's after the same event"),
            replica_divergence_seconds: histogram(
                &mut r,
                "replica_divergence_seconds",
                "How long caches stayed divergent from a peer before agreeing again",
                &[0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0],
            ),
            hint_seconds: histogram(
                &mut r,
                "hint_seconds",
                "How long answering a hint took, from its decoded request to its answer, the wait for the index's lock included",
                &[1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2],
            ),
            hint_streams: gauge(&mut r, "hint_streams", "Hint streams open: one per Envoy worker thread whose filter asks for hints on a gRPC stream rather than with HTTP calls"),
            replica_repairs: family(&mut r, "replica_repairs", "Caches repaired, by kind: engine_replay (a gap filled from the engine's replay socket), peer_snapshot, refused"),
            replica_lost_messages: family(&mut r, "replica_lost_messages", "KV-event messages lost on the way to this replica, by outcome: filled (a peer handed it over), unfilled; a message is one sequence number of its stream (a Dynamo event id, a vLLM batch), so a NATS message carrying several Dynamo events counts each"),
            replica_snapshot_bytes: family(&mut r, "replica_snapshot_bytes", "Snapshot bytes exchanged with peers, by direction"),
            restored_caches: family(&mut r, "restored_caches", "Caches read from the disk snapshot at start, by outcome: restored, refused, not_found"),
            restored_blocks: counter(&mut r, "restored_blocks", "Blocks put back from the disk snapshot at start"),
            disk_snapshot_bytes: gauge(&mut r, "disk_snapshot_bytes", "Bytes of the last disk snapshot written"),
            disk_snapshot_failures: counter(&mut r, "disk_snapshot_failures", "Disk snapshots that could not be written"),
            served_requests: family(&mut r, "served_requests", "Hinted requests finished, by what their response's usage said: cached, prompt_only, missing, malformed, unanswered"),
            predicted_cached_tokens: family(&mut r, "predicted_cached_tokens", "Cached prompt tokens the hints predicted (requests whose usage gave cached_tokens)"),
            actual_cached_tokens: family(&mut r, "actual_cached_tokens", "Cached prompt tokens the engines reported (usage.prompt_tokens_details.cached_tokens)"),
            served_prompt_tokens: family(&mut r, "served_prompt_tokens", "Prompt tokens the engines reported (requests whose usage gave cached_tokens)"),
            predictions: family(&mut r, "predictions", "Predicted against reported cached tokens: exact (within one block), over, under"),
            engine_prefix_cache_hits: family(&mut r, "engine_prefix_cache_hits", "The engine's vllm:prefix_cache_hits_total (tokens) as last scraped"),
            engine_prefix_cache_queries: family(&mut r, "engine_prefix_cache_queries", "The engine's vllm:prefix_cache_queries_total (tokens) as last scraped"),
            replica_predicted_cached_tokens: family(&mut r, "replica_predicted_cached_tokens", "Every replica's predicted cached tokens per worker since it started, as last published on the replica plane"),
            replica_actual_cached_tokens: family(&mut r, "replica_actual_cached_tokens", "Every replica's reported cached tokens per worker since it started"),
            replica_prompt_tokens: family(&mut r, "replica_prompt_tokens", "Every replica's reported prompt tokens per worker since it started (requests whose usage gave cached tokens)"),
            test_dropped_events: counter(&mut r, "test_dropped_events", "Tests only: KV-event messages dropped on purpose"),
            registry: r,
        }
    }
}

/// A labelled family, registered as it is created: a metric cannot exist unregistered.
fn family<L, M>(r: &mut Registry, name: &str, help: &str) -> Family<L, M>
where
    Family<L, M>: prometheus_client::registry::Metric + Clone + Default,
{
    let f = Family::default();
    r.register(name, help, f.clone());
    f
}

/// A gauge without labels, registered as it is created.
fn gauge(r: &mut Registry, name: &str, help: &str) -> Gauge {
    let g = Gauge::default();
    r.register(name, help, g.clone());
    g
}

/// A histogram without labels, registered as it is created.
fn histogram(r: &mut Registry, name: &str, help: &str, buckets: &[f64]) -> Histogram {
    let h = Histogram::new(buckets.iter().copied());
    r.register(name, help, h.clone());
    h
}

/// A counter without labels, registered as it is created.
fn counter(r: &mut Registry, name: &str, help: &str) -> Counter {
    let c = Counter::default();
    r.register(name, help, c.clone());
    c
}

impl Metrics {
    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    /// Every query of the shipped Grafana dashboard (`dashboards/kvroute.json`) names only
    /// metrics the sidecar exports.
    #[test]
    fn the_dashboard_queries_exported_metrics() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../dashboards/kvroute.json");
        let dashboard: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        // Every family registered in `Metrics::default` (a family without samples yet is not
        // rendered, so the registrations are read from this file).
        let source = include_str!("metrics.rs");
        let registered: std::collections::BTreeSet<String> = source
            .split("&mut r,")
            .skip(1)
            .filter_map(|rest| {
                let name = rest.trim_start().strip_prefix('"')?.split('"').next()?;
                Some(format!("kvroute_{name}"))
            })
            .collect();
        assert!(registered.len() > 40, "{registered:?}");
        let mut exprs = Vec::new();
        for panel in dashboard["panels"].as_array().unwrap() {
            for target in panel["targets"].as_array().into_iter().flatten() {
                exprs.push(target["expr"].as_str().unwrap().to_owned());
            }
        }
        assert!(exprs.len() >= 15, "{} queries", exprs.len());
        let mut names = std::collections::BTreeSet::new();
        for expr in &exprs {
            let mut found = 0;
            for (at, _) in expr.match_indices("kvroute_") {
                let name: String = expr[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                let family = ["_total", "_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|s| name.strip_suffix(s))
                    .unwrap_or(&name);
                assert!(
                    registered.contains(family),
                    "{expr}: {name} is not exported"
                );
                names.insert(family.to_owned());
                found += 1;
            }
            assert!(found > 0, "{expr}: names no kvroute metric");
        }
        for family in [
            "kvroute_actual_cached_tokens",
            "kvroute_predicted_cached_tokens",
            "kvroute_replica_caches",
            "kvroute_replica_repairs",
            "kvroute_alarm",
            "kvroute_in_flight",
        ] {
            assert!(names.contains(family), "the dashboard shows {family}");
        }
    }
}
