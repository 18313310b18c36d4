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
        let mut r = Registry::with_prefix("kvroute");
        Metrics {
            hints: family(&mut r, "hints", "Hint requests by result"),
            hint_matched_blocks: counter(&mut r, "hint_matched_blocks", "Matched blocks summed over hinted requests"),
            index_blocks: family(&mut r, "index_blocks", "Blocks indexed per worker"),
            events: family(&mut r, "events", "KV events applied by subject and type"),
            decode_errors: family(&mut r, "decode_errors", "Messages that did not decode"),
            skipped_events: family(&mut r, "skipped_events", "Elements of a message that were not known events"),
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
            registry: r,
        }
    }
}

/// A labelled family, registered as it is created: a metric cannot exist unregistered.
fn family<M>(r: &mut Registry, name: &str, help: &str) -> Family<Labels, M>
where
    Family<Labels, M>: prometheus_client::registry::Metric + Clone + Default,
{
    let f = Family::default();
    r.register(name, help, f.clone());
    f
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

/// One label pair, for the families above.
pub fn label(key: &'static str, value: impl Into<String>) -> Labels {
    vec![(key, value.into())]
}
