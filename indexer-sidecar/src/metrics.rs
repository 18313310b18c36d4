//! Prometheus metrics of the sidecar, served as text on `/metrics`.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

type Labels = Vec<(&'static str, String)>;

/// Every metric the sidecar exports.
pub struct Metrics {
    registry: Registry,
    /// Hint requests by result: `hinted` (a match decided), `no_match` (least loaded, cold),
    /// `no_worker` (none usable: no hint), `unknown_model`, `bad_request`.
    pub hints: Family<Labels, Counter>,
    /// Sum of matched blocks over hinted requests.
    pub hint_matched_blocks: Counter,
    /// Blocks the index holds per worker.
    pub index_blocks: Family<Labels, Gauge>,
    /// Events applied, by subject (or endpoint) and type.
    pub events: Family<Labels, Counter>,
    /// Messages that did not decode, by source.
    pub decode_errors: Family<Labels, Counter>,
    /// Array elements of a message that were not events we know, by source.
    pub skipped_events: Family<Labels, Counter>,
    /// Events from a worker id that is not configured.
    pub unknown_worker_events: Family<Labels, Counter>,
    /// Stores whose parent block was unknown, by worker.
    pub orphan_stores: Family<Labels, Counter>,
    /// Removals of blocks the index did not hold.
    pub unknown_removals: Counter,
    /// Engine `/metrics` scrapes that failed, by worker.
    pub scrape_errors: Family<Labels, Counter>,
    /// 1 when Envoy lists the worker as healthy (only with `[envoy]` configured).
    pub worker_usable: Family<Labels, Gauge>,
    /// Stored events whose block size differs from the model's, by worker.
    pub block_size_mismatches: Family<Labels, Counter>,
    /// Sequence trouble on an event stream, by worker and kind (`gap`, `replayed`, `resync`,
    /// `restart`, `disconnect`, `warm_start`).
    pub sequence: Family<Labels, Counter>,
    /// 1 while an event-plane alarm is on (`alarm`: `no_events`, `silent_worker`).
    pub alarm: Family<Labels, Gauge>,
    /// Hinted requests not finished yet, by worker.
    pub in_flight: Family<Labels, Gauge>,
    /// Prompt blocks queued for prefill, by worker (Dynamo `kv_metrics`).
    pub queued_prefill_blocks: Family<Labels, Gauge>,
    /// KV blocks in use, by worker (Dynamo `kv_metrics`).
    pub kv_used_blocks: Family<Labels, Gauge>,
    /// Tickets closed, by how: finished (reported), unknown (reported but not open),
    /// reclaimed (a scrape showed fewer requests), expired.
    pub tickets: Family<Labels, Counter>,
    /// Dynamo instances with a discovery record, by model and role (`aggregated`, `prefill`,
    /// `decode`).
    pub discovered_instances: Family<Labels, Gauge>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut m = Metrics {
            registry: Registry::with_prefix("kvroute"),
            hints: Family::default(),
            hint_matched_blocks: Counter::default(),
            index_blocks: Family::default(),
            events: Family::default(),
            decode_errors: Family::default(),
            skipped_events: Family::default(),
            unknown_worker_events: Family::default(),
            orphan_stores: Family::default(),
            unknown_removals: Counter::default(),
            scrape_errors: Family::default(),
            worker_usable: Family::default(),
            block_size_mismatches: Family::default(),
            sequence: Family::default(),
            alarm: Family::default(),
            in_flight: Family::default(),
            queued_prefill_blocks: Family::default(),
            kv_used_blocks: Family::default(),
            tickets: Family::default(),
            discovered_instances: Family::default(),
        };
        m.registry
            .register("hints", "Hint requests by result", m.hints.clone());
        m.registry.register(
            "hint_matched_blocks",
            "Matched blocks summed over hinted requests",
            m.hint_matched_blocks.clone(),
        );
        m.registry.register(
            "index_blocks",
            "Blocks indexed per worker",
            m.index_blocks.clone(),
        );
        m.registry.register(
            "events",
            "KV events applied by subject and type",
            m.events.clone(),
        );
        m.registry.register(
            "decode_errors",
            "Messages that did not decode",
            m.decode_errors.clone(),
        );
        m.registry.register(
            "skipped_events",
            "Elements of a message that were not known events",
            m.skipped_events.clone(),
        );
        m.registry.register(
            "unknown_worker_events",
            "Events from workers not in the configuration",
            m.unknown_worker_events.clone(),
        );
        m.registry.register(
            "orphan_stores",
            "Stored events whose parent block is unknown",
            m.orphan_stores.clone(),
        );
        m.registry.register(
            "unknown_removals",
            "Removed blocks the index did not hold",
            m.unknown_removals.clone(),
        );
        m.registry.register(
            "worker_usable",
            "1 when Envoy lists the worker as healthy",
            m.worker_usable.clone(),
        );
        m.registry.register(
            "in_flight",
            "Hinted requests not finished yet",
            m.in_flight.clone(),
        );
        m.registry
            .register("tickets", "Hint tickets closed, by how", m.tickets.clone());
        m.registry.register(
            "alarm",
            "1 while an event-plane alarm is on",
            m.alarm.clone(),
        );
        m.registry.register(
            "block_size_mismatches",
            "Stored events whose block size differs from the configured one",
            m.block_size_mismatches.clone(),
        );
        m.registry.register(
            "sequence",
            "Event stream sequence trouble: gap, replayed, resync, restart, disconnect, warm_start",
            m.sequence.clone(),
        );
        m.registry.register(
            "queued_prefill_blocks",
            "Prompt blocks queued for prefill (Dynamo kv_metrics)",
            m.queued_prefill_blocks.clone(),
        );
        m.registry.register(
            "kv_used_blocks",
            "KV blocks in use (Dynamo kv_metrics)",
            m.kv_used_blocks.clone(),
        );
        m.registry.register(
            "discovered_instances",
            "Dynamo instances with a record in the discovery directory",
            m.discovered_instances.clone(),
        );
        m.registry.register(
            "scrape_errors",
            "Engine /metrics scrapes that failed",
            m.scrape_errors.clone(),
        );
        m
    }
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

/// One label pair, for the families above.
pub fn label(key: &'static str, value: impl Into<String>) -> Labels {
    vec![(key, value.into())]
}
