//! What a stack starts, and how: the routing mode and fallback, the engines (simulated, real
//! Dynamo or vLLM), the sidecar replicas, a lossy transport, Envoy's membership.

use std::time::Duration;

use super::envoy::BootstrapFn;
use crate::dynamo::DynamoOptions;
use crate::lossy_nats::LossSpec;
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
    /// Every sidecar reads its KV events through its own [`crate::lossy_nats::LossyNats`] proxy in front of the
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
    /// Envoy's `stats_flush_interval` in milliseconds, in place of its 5 s: histograms reach
    /// `/stats` only when flushed, so a benchmark reading them per step waits one interval.
    pub envoy_stats_flush_ms: Option<u64>,
    /// Envoy's `--file-flush-interval-msec` in place of its 10 s: the access log (one line per
    /// request, naming the engine it went to) reaches the log file within this.
    pub envoy_log_flush_ms: Option<u64>,
    /// A fleet under a control plane: Envoy's `workers` cluster reads an EDS file
    /// ([`super::Stack::set_members`]), and the sidecar takes its workers from Envoy's membership
    /// (`[[envoy.members]]`, events at `{port+1}`, replay at `{port+2}`) instead of
    /// `[[workers]]` and `[[zmq]]`. Engines publishing vLLM's format: simulated, or real vLLM
    /// with [`crate::vllm::VllmOptions::zmq_beside`].
    pub eds_membership: bool,
    /// Envoy's configuration built by this function instead of from a shipped template: a
    /// bootstrap assembled the way a control plane would apply `deploy/`'s patches.
    pub envoy_bootstrap: Option<BootstrapFn>,
    /// The name of Envoy's cluster of engines (`workers` in the shipped templates).
    pub workers_cluster: String,
    /// The sidecar cluster speaks HTTP/1.1, as an Envoy configuration from before the hint
    /// stream did: the filter cannot open its stream and asks with HTTP calls.
    pub sidecar_http1: bool,
    /// This wasm module in Envoy in place of the filter's (a benchmark's reference module).
    pub filter_wasm: Option<std::path::PathBuf>,
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
    pub(super) fn spec(&self, replica: usize) -> LossSpec {
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
            envoy_stats_flush_ms: None,
            envoy_log_flush_ms: None,
            eds_membership: false,
            envoy_bootstrap: None,
            workers_cluster: "workers".into(),
            sidecar_http1: false,
            filter_wasm: None,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The block size and the way workers are found follow the engines started.
    #[test]
    fn the_engines_decide_block_size_and_pin_mode() {
        let mut opts = StackOptions::new("t", Mode::Kvroute);
        opts.sim.block_size = 32;
        assert_eq!(opts.block_size(), 32);
        assert!(!opts.pin_mode());
        opts.vllm = Some(VllmOptions::default());
        assert_eq!(opts.block_size(), crate::vllm::BLOCK_SIZE);
        opts.vllm = None;
        opts.dynamo_frontend = true;
        assert!(opts.pin_mode(), "the simulator's frontend stand-in");
        assert_eq!(opts.block_size(), 32);
    }

    /// Each sidecar's proxy loses other messages: seeds differ per replica, the KV events only.
    #[test]
    fn each_replica_loses_other_messages() {
        let loss = TransportLoss { loss: 0.2, seed: 7 };
        let (a, b) = (loss.spec(0), loss.spec(1));
        assert_eq!(a.seed, 7);
        assert_ne!(a.seed, b.seed);
        assert_eq!(a.loss, 0.2);
        assert_eq!(a.subject_contains, "kv-events");
    }
}
