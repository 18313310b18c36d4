//! Publishing cache events in NVIDIA Dynamo's exact NATS wire formats (1.6: an envelope around
//! an array of events per batch; 1.2: one envelope per event).

use std::time::{SystemTime, UNIX_EPOCH};

use kvroute_protocol::dynamo::{
    encode_v12, encode_v16, EnvelopeHeader, KvCacheEvent, KvCacheEventData, RemovedBlocks,
    RouterEvent, StoredBlock, StoredBlocks, KV_EVENTS_TOPIC,
};
use tokio::sync::mpsc;

/// A change to one engine's cache, in the engine's own block hashes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheChange {
    /// Blocks stored after `parent`: (engine hash, tokens hash) each.
    Stored {
        /// Engine hash of the block before the first one.
        parent: Option<u64>,
        /// (engine block hash, tokens hash) in sequence order.
        blocks: Vec<(u64, u64)>,
        /// The stored blocks' tokens (vLLM events carry them).
        tokens: Vec<u32>,
        /// LoRA adapter of the request.
        lora: Option<String>,
        /// The request's `cache_salt` when the run starts at its block 0 (vLLM hashes the salt
        /// into block 0 as an extra key).
        salt_of_first: Option<String>,
    },
    /// Blocks evicted (engine hashes).
    Removed(Vec<u64>),
    /// The engine restarted with an empty cache.
    Restarted,
}

/// Where an engine publishes: the NATS client and the identity it publishes under.
pub struct DynamoPublisher {
    /// Connected NATS client.
    pub client: async_nats::Client,
    /// Subject, e.g. `namespace.dynamo.component.backend.endpoint.generate.kv-events`.
    pub subject: String,
    /// The Dynamo instance id in every event.
    pub worker_id: u64,
    /// Random id of this publisher (envelope field).
    pub publisher_id: u64,
    /// Dynamo 1.2's format: one message per event.
    pub v12: bool,
}

impl DynamoPublisher {
    /// Publish every batch of changes from `rx`, in order, one NATS message per batch (as
    /// Dynamo batches the events of one scheduler step), with a per-worker `event_id` cursor.
    pub async fn run(self, mut rx: mpsc::UnboundedReceiver<Vec<CacheChange>>) {
        let mut sequence = 0u64;
        let mut event_id = 0u64;
        while let Some(batch) = rx.recv().await {
            // A restarted worker is a new process: its event ids start over, unannounced.
            if batch.iter().any(|c| matches!(c, CacheChange::Restarted)) {
                event_id = 0;
            }
            let events: Vec<RouterEvent> = batch
                .into_iter()
                .filter_map(|change| {
                    let event = self.router_event(event_id + 1, change)?;
                    event_id += 1;
                    Some(event)
                })
                .collect();
            if events.is_empty() {
                continue;
            }
            let published_at = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0);
            let header = EnvelopeHeader {
                publisher_id: self.publisher_id,
                sequence,
                published_at,
                topic: KV_EVENTS_TOPIC,
            };
            sequence += 1;
            let bodies = if self.v12 {
                events.iter().map(|e| encode_v12(header, e)).collect()
            } else {
                vec![encode_v16(header, &events)]
            };
            for body in bodies {
                if let Err(e) = self.client.publish(self.subject.clone(), body.into()).await {
                    tracing::warn!(error = %e, subject = %self.subject, "KV event publish failed");
                }
            }
        }
    }

    fn router_event(&self, event_id: u64, change: CacheChange) -> Option<RouterEvent> {
        let data = match change {
            CacheChange::Stored { parent, blocks, .. } => KvCacheEventData::Stored(StoredBlocks {
                parent_hash: parent,
                start_position: None,
                blocks: blocks
                    .into_iter()
                    .map(|(block_hash, tokens_hash)| StoredBlock {
                        block_hash,
                        tokens_hash,
                        mm_extra_info: None,
                    })
                    .collect(),
            }),
            CacheChange::Removed(block_hashes) => {
                KvCacheEventData::Removed(RemovedBlocks { block_hashes })
            }
            CacheChange::Restarted => return None,
        };
        Some(RouterEvent {
            worker_id: self.worker_id,
            storage_tier: "device".into(),
            residency_domain: Some("worker".into()),
            event: KvCacheEvent {
                event_id,
                data,
                dp_rank: 0,
            },
        })
    }
}
