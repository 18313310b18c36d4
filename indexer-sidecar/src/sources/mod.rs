//! Event sources: transports that deliver engine KV events to [`crate::state::AppState`].

pub mod nats;
