//! Publishing cache events the way vLLM's ZMQ publisher does: a PUB socket sending
//! `[topic, seq u64 BE, msgpack batch]`, and a ROUTER replay socket answering `["", start seq]`
//! with every buffered message from there, then the end marker. Block hashes are vLLM's own
//! ([`crate::vllm_hash`]). libzmq, as vLLM (pyzmq) uses; a restart closes the PUB socket and
//! binds a new one on the same port, so subscribers see the connection of a new process.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use bytes::Bytes;
use kvroute_protocol::vllm::{
    encode_batch, BlockHashes, EngineBlockHash, EventBatch, EventEncoding, ExtraKeys, VllmEvent,
    REPLAY_END,
};
use tokio::sync::mpsc;

use crate::publish::CacheChange;
use crate::vllm_hash::{self, FullHash};

/// Messages kept for replay (vLLM's default `buffer_steps` is 10000).
const REPLAY_BUFFER: usize = 10_000;

/// One engine's vLLM-style publisher.
pub struct VllmPublisher {
    context: zmq::Context,
    socket: zmq::Socket,
    /// Where `socket` is bound (`tcp://127.0.0.1:<port>`), for the rebind at a restart.
    endpoint: String,
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
    /// Bind a PUB and a replay socket on loopback, on `ports` (events, replay) or on free ones.
    /// While `drop_next` is above zero, messages are buffered for replay but not sent live (a
    /// test hook: a gap).
    pub fn bind(
        topic: &str,
        encoding: EventEncoding,
        block_size: u32,
        drop_next: Arc<AtomicU64>,
        ports: Option<(u16, u16)>,
    ) -> anyhow::Result<(Self, Endpoints)> {
        let (events_port, replay_port) = ports.unwrap_or((0, 0));
        let context = zmq::Context::new();
        let socket = context.socket(zmq::PUB)?;
        socket
            .bind(&format!("tcp://127.0.0.1:{events_port}"))
            .context("binding the PUB socket")?;
        let events = bound(&socket)?;
        let router = context.socket(zmq::ROUTER)?;
        router
            .bind(&format!("tcp://127.0.0.1:{replay_port}"))
            .context("binding the replay socket")?;
        let replay = bound(&router)?;
        let buffer = Arc::new(Mutex::new(VecDeque::new()));
        let (topic_name, replay_buffer) = (topic.to_owned(), buffer.clone());
        std::thread::Builder::new()
            .name("sim-replay".into())
            .spawn(move || serve_replay(router, topic_name, replay_buffer))?;
        let publisher = VllmPublisher {
            context,
            socket,
            endpoint: events.clone(),
            topic: topic.to_owned(),
            encoding,
            block_size,
            buffer,
            drop_next,
            full_hashes: HashMap::new(),
        };
        Ok((publisher, Endpoints { events, replay }))
    }

    /// A new process's PUB socket: the old one closes (subscribers see it go), a new one binds
    /// the same port (the kernel may hold it for a moment after the close).
    fn rebind(&mut self) {
        let _ = self.socket.unbind(&self.endpoint);
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            match self.context.socket(zmq::PUB).and_then(|s| {
                s.bind(&self.endpoint)?;
                Ok(s)
            }) {
                Ok(socket) => {
                    self.socket = socket;
                    return;
                }
                Err(e) if Instant::now() > deadline => {
                    tracing::warn!(endpoint = %self.endpoint, error = %e, "PUB socket not rebound after a restart");
                    return;
                }
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
    }

    /// Publish every batch from `rx`, one message per batch, numbered from 0; a restart numbers
    /// from 0 again, as a new vLLM process would.
    pub async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Vec<CacheChange>>) {
        let mut seq = 0u64;
        while let Some(changes) = rx.recv().await {
            if changes.iter().any(|c| matches!(c, CacheChange::Restarted)) {
                seq = 0;
                self.rebind();
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
                ..EventBatch::default()
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
                let frames = [self.topic.as_bytes(), &seq.to_be_bytes(), &payload];
                // PUB never blocks: with no subscriber, or one too slow, messages are dropped.
                if let Err(e) = self.socket.send_multipart(frames, zmq::DONTWAIT) {
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
                let mut block_hashes = BlockHashes::with_capacity(blocks.len());
                let mut has_extra_keys = ExtraKeys::with_capacity(blocks.len());
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
                    token_ids: tokens.into(),
                    block_size: self.block_size,
                    lora_name: lora,
                    medium: Some("GPU".into()),
                    has_extra_keys,
                    group: None,
                    kind: None,
                }
            }
            CacheChange::Removed(hashes) => VllmEvent::BlockRemoved {
                block_hashes: hashes
                    .into_iter()
                    .filter_map(|own| self.full_hashes.remove(&own))
                    .map(|full| EngineBlockHash(vllm_hash::event_value(&full)))
                    .collect(),
                medium: Some("GPU".into()),
                group: None,
            },
            // A new process does not announce itself: its sequence restarts at 0.
            CacheChange::Restarted => return None,
        })
    }
}

/// The endpoint a socket bound to port 0 got.
fn bound(socket: &zmq::Socket) -> anyhow::Result<String> {
    socket
        .get_last_endpoint()?
        .map_err(|_| anyhow::anyhow!("bound endpoint is not UTF-8"))
}

/// Answer replay requests: `[identity, "", seq]` → every buffered message from `seq` as
/// `[identity, "", topic, seq, payload]`, then `[identity, "", "", u64::MAX, ""]`.
fn serve_replay(router: zmq::Socket, topic: String, buffer: Arc<Mutex<VecDeque<(u64, Bytes)>>>) {
    while let Ok(frames) = router.recv_multipart(0) {
        let (Some(identity), Some(start)) = (frames.first(), frames.last()) else {
            continue;
        };
        let Ok(start) = <[u8; 8]>::try_from(start.as_slice()).map(u64::from_be_bytes) else {
            continue;
        };
        let wanted: Vec<(u64, Bytes)> = buffer
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .cloned()
            .collect();
        for (seq, payload) in wanted {
            let reply: [&[u8]; 5] = [
                identity,
                b"",
                topic.as_bytes(),
                &seq.to_be_bytes(),
                &payload,
            ];
            if router.send_multipart(reply, 0).is_err() {
                break;
            }
        }
        let end: [&[u8]; 5] = [identity, b"", b"", &REPLAY_END.to_be_bytes(), b""];
        let _ = router.send_multipart(end, 0);
    }
}
