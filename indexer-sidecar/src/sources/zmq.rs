//! vLLM KV events from ZMQ: one SUB socket per configured endpoint, sequence numbers checked
//! per worker, gaps filled from the engine's replay socket.
//!
//! What a sequence number can say (vLLM numbers its messages 0, 1, 2, … per process):
//! - the next one: apply;
//! - a jump: messages were lost (slow subscriber, reconnect). Ask the replay socket for them and
//!   apply them in order; if it cannot give them all, the worker's index entries are stale: drop
//!   them and start over from this message (`resync`);
//! - the same or a smaller one: the engine restarted with an empty cache: drop its entries.
//!
//! The pure-Rust `zeromq` crate does not reconnect a dropped connection by itself, so the loop
//! watches the socket's monitor and starts a new socket when the publisher goes away.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use futures::StreamExt;
use kvroute_protocol::vllm::{decode_batch, decode_seq, REPLAY_END};
use zeromq::{DealerSocket, Socket, SocketEvent, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use crate::config::ZmqConfig;
use crate::metrics::label;
use crate::registry::WorkerId;
use crate::sequence::{check_seq, SeqCheck};
use crate::state::AppState;

/// How long a replay may take before the worker is resynced instead.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);
/// Pause before reconnecting to a publisher that went away.
const RECONNECT_DELAY: Duration = Duration::from_millis(500);

/// llm-d names the worker in the topic: `kv@<ip:port>@<model>`.
pub fn worker_in_topic(topic: &str) -> Option<&str> {
    let rest = topic.strip_prefix("kv@")?;
    let (address, _model) = rest.split_once('@')?;
    Some(address)
}

/// One message: (topic, sequence number, payload).
type Frames = (String, u64, Vec<u8>);

/// Split a live message (`[topic, seq, payload]`) or a replayed one (with a leading empty
/// delimiter frame when it came through a DEALER).
fn frames(msg: ZmqMessage) -> Option<Frames> {
    let mut parts = msg.into_vec();
    if parts.len() == 4 && parts[0].is_empty() {
        parts.remove(0);
    }
    let [topic, seq, payload]: [_; 3] = parts.try_into().ok()?;
    Some((
        String::from_utf8_lossy(&topic).into_owned(),
        decode_seq(&seq).ok()?,
        payload.to_vec(),
    ))
}

/// Subscribe to one publisher and apply its events until the process ends.
pub async fn run(config: ZmqConfig, state: Arc<AppState>) -> anyhow::Result<()> {
    let mut last: std::collections::HashMap<WorkerId, u64> = Default::default();
    let source = state
        .plane()
        .register("zmq", &config.endpoint, vec![config.topic.clone()]);
    loop {
        let mut socket = SubSocket::new();
        let mut monitor = socket.monitor();
        if config.bind {
            socket
                .bind(&config.endpoint)
                .await
                .with_context(|| format!("binding {}", config.endpoint))?;
        } else {
            tracing::info!(endpoint = %config.endpoint, "connecting to vLLM KV-event publisher");
            socket
                .connect(&config.endpoint)
                .await
                .with_context(|| format!("connecting to {}", config.endpoint))?;
        }
        socket
            .subscribe(&config.topic)
            .await
            .with_context(|| format!("subscribing to {:?}", config.topic))?;
        tracing::info!(endpoint = %config.endpoint, topic = %config.topic, "subscribed to vLLM KV events");
        state.plane().subscribed(source);
        // A bound socket outlives its peers; a connected one is redone when its publisher goes.
        let mut watching = !config.bind;
        loop {
            tokio::select! {
                msg = socket.recv() => match msg {
                    Ok(msg) => handle(&config, &state, source, &mut last, msg).await,
                    Err(e) => {
                        tracing::warn!(endpoint = %config.endpoint, error = %e, "ZMQ receive failed");
                        break;
                    }
                },
                event = monitor.next(), if watching => match event {
                    Some(SocketEvent::Disconnected(_)) => {
                        tracing::warn!(endpoint = %config.endpoint, "vLLM KV-event publisher went away; reconnecting");
                        break;
                    }
                    Some(_) => {}
                    None => watching = false,
                },
            }
        }
        tokio::time::sleep(RECONNECT_DELAY).await;
    }
}

async fn handle(
    config: &ZmqConfig,
    state: &AppState,
    source: usize,
    last: &mut std::collections::HashMap<WorkerId, u64>,
    msg: ZmqMessage,
) {
    let Some((topic, seq, payload)) = frames(msg) else {
        state.plane().message(source, "", false);
        count_bad(state, "not [topic, seq, payload]", &config.endpoint);
        return;
    };
    state.plane().message(source, &topic, true);
    let address = config.worker.as_deref().or_else(|| worker_in_topic(&topic));
    let registry = state.registry();
    let Some(worker) = address.and_then(|a| registry.by_address(a)) else {
        state
            .metrics
            .unknown_worker_events
            .get_or_create(&label("worker_id", address.unwrap_or(&topic).to_owned()))
            .inc();
        return;
    };
    let (id, name) = (worker.id, worker.address.clone());
    let bump = |kind: &str, by: u64| {
        state
            .metrics
            .sequence
            .get_or_create(&vec![("worker", name.clone()), ("kind", kind.to_owned())])
            .inc_by(by);
    };
    match check_seq(last.get(&id).copied(), seq) {
        SeqCheck::First | SeqCheck::Next => {}
        SeqCheck::Restarted => {
            let dropped = state.forget_worker(id);
            tracing::warn!(worker = %name, seq, dropped, "vLLM event sequence went back: engine restarted, its index entries dropped");
            bump("restart", 1);
        }
        SeqCheck::Gap { from, to } => {
            bump("gap", 1);
            match replay(config, from, to).await {
                Ok(missed) => {
                    tracing::info!(worker = %name, from, to, "filled an event gap from the replay socket");
                    bump("replayed", missed.len() as u64);
                    for (_, _, payload) in &missed {
                        apply(state, source, id, &config.endpoint, payload);
                    }
                }
                Err(e) => {
                    let dropped = state.forget_worker(id);
                    tracing::warn!(worker = %name, from, to, dropped, error = %e, "event gap not replayable: worker resynced (index entries dropped)");
                    bump("resync", 1);
                }
            }
        }
    }
    last.insert(id, seq);
    apply(state, source, id, &config.endpoint, &payload);
}

fn apply(state: &AppState, source: usize, worker: WorkerId, endpoint: &str, payload: &[u8]) {
    match decode_batch(payload) {
        Ok(batch) => state.apply_vllm(source, worker, endpoint, &batch),
        Err(e) => count_bad(state, &e.to_string(), endpoint),
    }
}

fn count_bad(state: &AppState, why: &str, source: &str) {
    tracing::warn!(%source, error = %why, "undecodable vLLM KV-event message");
    state
        .metrics
        .decode_errors
        .get_or_create(&label("source", "zmq"))
        .inc();
}

/// Ask the replay socket for messages `from..to`; all of them, in order, or an error.
async fn replay(config: &ZmqConfig, from: u64, to: u64) -> anyhow::Result<Vec<Frames>> {
    let endpoint = config
        .replay_endpoint
        .as_deref()
        .context("no replay_endpoint configured")?;
    tokio::time::timeout(REPLAY_TIMEOUT, async {
        let mut socket = DealerSocket::new();
        socket.connect(endpoint).await?;
        let mut request = ZmqMessage::from(Vec::new());
        request.push_back(from.to_be_bytes().to_vec().into());
        socket.send(request).await?;
        let mut out: Vec<Frames> = Vec::new();
        loop {
            let msg = socket.recv().await?;
            let (topic, seq, payload) = frames(msg).context("malformed replay reply")?;
            if seq == REPLAY_END {
                break;
            }
            if seq >= to {
                continue;
            }
            let expected = out.last().map_or(from, |m| m.1 + 1);
            anyhow::ensure!(
                seq == expected,
                "replay buffer starts at {seq}, needed {expected}"
            );
            out.push((topic, seq, payload));
        }
        anyhow::ensure!(
            out.last().map_or(from, |m| m.1 + 1) == to,
            "replay ended before {to}"
        );
        Ok(out)
    })
    .await
    .context("replay timed out")?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llm_d_topics_name_the_worker() {
        assert_eq!(
            worker_in_topic("kv@10.0.0.5:8000@meta-llama/Llama-3.1-8B"),
            Some("10.0.0.5:8000")
        );
        assert_eq!(worker_in_topic("kv-events"), None);
        assert_eq!(worker_in_topic("kv@nomodel"), None);
    }
}
