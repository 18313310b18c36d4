//! Event sources: transports that deliver engine KV events to [`crate::state::AppState`].

pub mod discovery;
pub mod engine_metrics;
pub mod envoy_admin;
pub mod nats;
pub mod zmq;
