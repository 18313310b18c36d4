//! Publishing cache events the way vLLM's ZMQ publisher does: a PUB socket sending
//! `[topic, seq u64 BE, msgpack batch]`, and a ROUTER replay socket answering `["", start seq]`
//! with every buffered message from there, then the end marker. Block hashes are vLLM's own
//! ([`crate::vllm_hash`]).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use bytes::Bytes;
use kvroute_protocol::vllm::{
    encode_batch, EngineBlockHash, EventBatch, EventEncoding, VllmEvent, REPLAY_END,
};
use tokio::sync::mpsc;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::publish::CacheChange;
use crate::vllm_hash::{self, FullHash};

/// Messages kept for replay (vLLM's default `buffer_steps` is 10000).
const REPLAY_BUFFER: usize = 10_000;

/// One engine's vLLM-style publisher.
pub struct VllmPublisher {
    socket: PubSocket,
    topic: String,
    encoding: EventEncoding,
    block_size: u32,
    buffer: Arc<Mutex<VecDeque<(u64, Bytes)>>>,
    drop_next: Arc<AtomicU64>,
    /// vLLM's full hash of every cached block, by the cache's own block hash (parents chain
    /// through it; entries go with their block).
    full_hashes: HashMap<u64, FullHash>,
}

/// Where a publisher listens, for the READY line.
pub struct Endpoints {
    /// The PUB socket.
    pub events: String,
    /// The ROUTER replay socket.
    pub replay: String,
}

impl VllmPublisher {
    /// Bind a PUB and a replay socket on loopback, on free ports. While `drop_next` is above
    /// zero, messages are buffered for replay but not sent live (a test hook: a gap).
    pub async fn bind(
        topic: &str,
        encoding: EventEncoding,
        block_size: u32,
        drop_next: Arc<AtomicU64>,
    ) -> anyhow::Result<(Self, Endpoints)> {
        let mut socket = PubSocket::new();
        let events = socket
            .bind("tcp://127.0.0.1:0")
            .await
            .context("binding the PUB socket")?;
        let mut router = RouterSocket::new();
        let replay = router
            .bind("tcp://127.0.0.1:0")
            .await
            .context("binding the replay socket")?;
        let buffer = Arc::new(Mutex::new(VecDeque::new()));
        tokio::spawn(serve_replay(router, topic.to_owned(), buffer.clone()));
        let publisher = VllmPublisher {
            socket,
            topic: topic.to_owned(),
            encoding,
            block_size,
            buffer,
            drop_next,
            full_hashes: HashMap::new(),
        };
        let endpoints = Endpoints {
            events: events.to_string(),
            replay: replay.to_string(),
        };
        Ok((publisher, endpoints))
    }

    /// Publish every batch from `rx`, one message per batch, numbered from 0; a restart numbers
    /// from 0 again, as a new vLLM process would.
    pub async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Vec<CacheChange>>) {
        let mut seq = 0u64;
        while let Some(changes) = rx.recv().await {
            if changes.iter().any(|c| matches!(c, CacheChange::Restarted)) {
                seq = 0;
                self.full_hashes.clear();
                self.buffer
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clear();
            }
            let events: Vec<VllmEvent> =
                changes.into_iter().filter_map(|c| self.event(c)).collect();
            if events.is_empty() {
                continue;
            }
            let ts = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            let batch = EventBatch {
                ts,
                events,
                dp_rank: 0,
                skipped: 0,
            };
            let payload = Bytes::from(encode_batch(&batch, self.encoding));
            {
                let mut buffer = self.buffer.lock().unwrap_or_else(|e| e.into_inner());
                if buffer.len() == REPLAY_BUFFER {
                    buffer.pop_front();
                }
                buffer.push_back((seq, payload.clone()));
            }
            let dropped = self
                .drop_next
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                .is_ok();
            if !dropped {
                let msg = message(&[
                    Bytes::from(self.topic.clone()),
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    payload,
                ]);
                if let Err(e) = self.socket.send(msg).await {
                    tracing::warn!(error = %e, "vLLM event publish failed");
                }
            }
            seq += 1;
        }
    }

    /// The event for a cache change, with the block hashes vLLM would publish.
    fn event(&mut self, change: CacheChange) -> Option<VllmEvent> {
        Some(match change {
            CacheChange::Stored {
                parent,
                blocks,
                tokens,
                lora,
                salt_of_first,
            } => {
                let size = self.block_size as usize;
                let parent_full = parent.and_then(|p| self.full_hashes.get(&p).copied());
                let mut chain = parent_full.unwrap_or_else(vllm_hash::none_hash);
                let mut block_hashes = Vec::with_capacity(blocks.len());
                let mut has_extra_keys = Vec::with_capacity(blocks.len());
                for (i, &(own, _)) in blocks.iter().enumerate() {
                    // vLLM's extra keys: the LoRA name on every block, the salt on block 0.
                    let salt = salt_of_first.as_deref().filter(|_| i == 0);
                    let extra: Vec<&str> = lora.as_deref().into_iter().chain(salt).collect();
                    let block_tokens = tokens.get(i * size..(i + 1) * size).unwrap_or(&[]);
                    chain = vllm_hash::block_hash(&chain, block_tokens, &extra);
                    self.full_hashes.insert(own, chain);
                    block_hashes.push(EngineBlockHash(vllm_hash::event_value(&chain)));
                    has_extra_keys.push(salt.is_some());
                }
                VllmEvent::BlockStored {
                    block_hashes,
                    parent: parent_full.map(|full| EngineBlockHash(vllm_hash::event_value(&full))),
                    token_ids: tokens,
                    block_size: self.block_size,
                    lora_name: lora,
                    medium: Some("GPU".into()),
                    has_extra_keys,
                }
            }
            CacheChange::Removed(hashes) => VllmEvent::BlockRemoved {
                block_hashes: hashes
                    .into_iter()
                    .filter_map(|own| self.full_hashes.remove(&own))
                    .map(|full| EngineBlockHash(vllm_hash::event_value(&full)))
                    .collect(),
                medium: Some("GPU".into()),
            },
            // A new process does not announce itself: its sequence restarts at 0.
            CacheChange::Restarted => return None,
        })
    }
}

fn message(frames: &[Bytes]) -> ZmqMessage {
    let mut msg = ZmqMessage::from(frames[0].clone());
    for f in &frames[1..] {
        msg.push_back(f.clone());
    }
    msg
}

/// Answer replay requests: `[identity, "", seq]` → every buffered message from `seq` as
/// `[identity, "", topic, seq, payload]`, then `[identity, "", "", u64::MAX, ""]`.
async fn serve_replay(
    mut router: RouterSocket,
    topic: String,
    buffer: Arc<Mutex<VecDeque<(u64, Bytes)>>>,
) {
    while let Ok(request) = router.recv().await {
        let frames = request.into_vec();
        let (Some(identity), Some(start)) = (frames.first(), frames.last()) else {
            continue;
        };
        let Ok(start) = <[u8; 8]>::try_from(start.as_ref()).map(u64::from_be_bytes) else {
            continue;
        };
        let wanted: Vec<(u64, Bytes)> = buffer
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .cloned()
            .collect();
        let empty = Bytes::new();
        for (seq, payload) in wanted {
            let reply = message(&[
                identity.clone(),
                empty.clone(),
                Bytes::from(topic.clone()),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload,
            ]);
            if router.send(reply).await.is_err() {
                break;
            }
        }
        let end = message(&[
            identity.clone(),
            empty.clone(),
            empty.clone(),
            Bytes::copy_from_slice(&REPLAY_END.to_be_bytes()),
            empty,
        ]);
        let _ = router.send(end).await;
    }
}
