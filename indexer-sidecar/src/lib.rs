//! kvroute-sidecar: knows which worker holds which KV blocks, and answers the filter's hints.
//!
//! The layout, inside out (docs/architecture.md has the picture):
//! - [`core`]: the pure core — the fleet table, the per-model indexes, the routing rule. No
//!   I/O, no clock, no logs: inputs come in with the time, what happened comes out.
//! - [`sidecar`]: [`sidecar::Sidecar`], the core behind its lock plus what the edges share;
//!   the one place where what happened becomes metrics and log lines. The lock model is there.
//! - [`event_plane`]: per-source counters (`/debug/sources`) and the event-plane alarms.
//! - [`streaks`]: losses said once per streak (a line when one starts, one when it ends).
//! - [`truth_watch`]: the alarms on what the engines reported against what was predicted
//!   (`stale_index`, `replica_skew`).
//! - [`transports`]: where KV events come from: NATS (Dynamo), ZMQ (vLLM).
//! - [`observers`]: what else feeds the fleet: Dynamo discovery, Envoy's admin view (and, with
//!   `[[envoy.members]]`, its cluster membership), engine `/metrics` scrapes.
//! - [`replication`]: replicas that agree — the pure brain deciding every digest, fill,
//!   snapshot and load share, the peers' state, the wire messages, the NATS loop that only
//!   executes, and the index saved on local disk.
//! - [`explain`]: the recent decisions `/debug/explain` shows, joined to their requests.
//! - [`http_api`]: the HTTP API (`/v1/hint`, bundles, `/metrics`, `/debug/*`);
//!   [`hint_stream`]: hints on one gRPC stream per Envoy worker; [`connections`]: the API's
//!   connections, bounded and timed out.
//! - [`metrics`]: the Prometheus metrics served on `/metrics`.
//! - [`config`]: the TOML configuration; [`endpoint_template`]: per-host endpoints in it.
//! - [`inspect`], [`envoy_config`]: the `tap`, `decode`, `tokenize` and `envoy-config` commands.
//!
//! Modules depend inwards only: `config` ← `core` ← `sidecar`, `event_plane` ← edges ← `main`
//! (tested: no module imports one that imports it back).

pub mod config;
pub mod connections;
pub mod core;
pub mod endpoint_template;
pub mod envoy_config;
pub mod event_plane;
pub mod explain;
pub mod hint_stream;
pub mod http_api;
pub mod inspect;
pub mod metrics;
pub mod observers;
pub mod replication;
pub mod sidecar;
pub mod streaks;
pub mod transports;
pub mod truth_watch;

pub use crate::core::event::KvEvent;
pub use crate::core::fleet::WorkerId;
pub use crate::core::index::RadixIndex;
