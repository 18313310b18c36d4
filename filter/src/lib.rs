//! kvroute-filter: the proxy-wasm HTTP filter that runs inside Envoy.
//!
//! The request path: buffer an OpenAI body → tokenize and hash it with the model's bundle
//! ([`plan`]) → set the fallback key header → ask the sidecar for a worker (on the hint stream, or `POST /v1/hint`) →
//! set the override-host header → resume; the response passes unchanged while [`usage`] reads
//! what the engine says it had cached, reported with the request's ticket once Envoy logs it.
//! Every failure resumes the request unhinted: routing never breaks serving.
//!
//! - [`config`]: the plugin configuration (JSON in Envoy's `PluginConfig`).
//! - [`plan`]: which requests to handle and what to do with a body — pure, tested natively.
//! - [`flow`]: every other decision of the callbacks (headers, body limits, the sidecar's
//!   answer, calls and their timeouts, polling, the ticket buffer) — pure, tested natively.
//! - [`stream`]: the hint stream (one gRPC stream per VM): up or down, the asks waiting, their
//!   deadlines — pure, tested natively.
//! - [`models`]: the bundles this VM has loaded, refreshed from the sidecar's catalog.
//! - [`usage`]: the response's `usage` (prompt and cached tokens), read as it passes — pure.
//! - [`metrics`]: names of the counters Envoy exports as `wasmcustom.kvroute.*`.
//! - `glue` (wasm32 only): the proxy-wasm context structs: they read what Envoy hands them,
//!   call [`plan`] and [`flow`], and execute what those return.

pub mod config;
pub mod flow;
pub mod metrics;
pub mod models;
pub mod plan;
pub mod stream;
pub mod usage;

#[cfg(target_arch = "wasm32")]
mod glue;
