//! Dynamo KV events from NATS: subscribe, decode each message, apply its events.

use std::sync::Arc;

use anyhow::Context as _;
use futures::StreamExt;
use kvroute_protocol::dynamo::decode_message;

use crate::config::NatsConfig;
use crate::metrics::label;
use crate::state::AppState;

/// Subscribe to every configured subject and apply events until the connection ends.
///
/// A plain subscription (no queue group): every sidecar replica must see every event.
pub async fn run(config: NatsConfig, state: Arc<AppState>) -> anyhow::Result<()> {
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .name("kvroute-sidecar")
        .connect(config.url.as_str())
        .await
        .with_context(|| format!("connecting to NATS at {}", config.url))?;
    let mut subscriptions = Vec::new();
    for subject in &config.subjects {
        let sub = client
            .subscribe(subject.clone())
            .await
            .with_context(|| format!("subscribing to {subject}"))?;
        subscriptions.push(sub);
    }
    // A round trip to the server: once it returns, the subscriptions are in place.
    client.flush().await.context("flushing subscriptions")?;
    for subject in &config.subjects {
        tracing::info!(%subject, url = %config.url, "subscribed to Dynamo KV events");
    }
    let mut messages = futures::stream::select_all(subscriptions);
    while let Some(msg) = messages.next().await {
        handle(&state, msg.subject.as_str(), &msg.payload);
    }
    anyhow::bail!("NATS subscription to {} ended", config.url)
}

/// Decode and apply one message body.
pub fn handle(state: &AppState, subject: &str, body: &[u8]) {
    match decode_message(body) {
        Ok(decoded) => {
            if decoded.skipped > 0 {
                state
                    .metrics
                    .skipped_events
                    .get_or_create(&label("source", "nats"))
                    .inc_by(decoded.skipped as u64);
            }
            for event in &decoded.events {
                state.apply_dynamo(subject, event);
            }
        }
        Err(e) => {
            tracing::warn!(%subject, error = %e, bytes = body.len(), "undecodable KV event message");
            state
                .metrics
                .decode_errors
                .get_or_create(&label("source", "nats"))
                .inc();
        }
    }
}
