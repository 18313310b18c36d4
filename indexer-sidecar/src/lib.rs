//! kvroute-sidecar: knows which worker holds which KV blocks, and answers the filter's hints.
//!
//! - [`config`]: the TOML configuration (models, workers, event sources, listen address).
//! - [`registry`]: the workers: dense [`WorkerId`]s, addresses, Dynamo instance ids, models.
//! - [`event`]: [`KvEvent`], the source-independent form of an engine's cache event.
//! - [`index`]: [`RadixIndex`], prefix → workers holding it, fed by events, queried by hints.
//! - [`load`]: each worker's load (hinted requests not finished, scraped vLLM metrics).
//! - [`health`]: per-source counters (`/debug/sources`) and the event-plane alarms.
//! - [`router`]: the rule turning matches and load into an ordered list of workers.
//! - [`sequence`]: message counters checked per publisher (next, gap, restart).
//! - [`sources`]: transports that produce events (NATS for Dynamo).
//! - [`metrics`]: the Prometheus metrics served on `/metrics`.
//! - [`api`]: the HTTP API (`/v1/hint`, bundles, `/metrics`, `/healthz`).
//! - [`state`]: everything above, shared by the API and the sources.
//! - [`inspect`]: the `decode` command (captured payloads as JSON lines).
//! - [`envoy_config`]: the shipped Envoy configurations and the `envoy-config` command.

pub mod api;
pub mod config;
pub mod envoy_config;
pub mod event;
pub mod health;
pub mod index;
pub mod inspect;
pub mod load;
pub mod metrics;
pub mod registry;
pub mod router;
pub mod sequence;
pub mod sources;
pub mod state;

pub use event::KvEvent;
pub use index::RadixIndex;
pub use registry::WorkerId;
