//! The replica plane's messages on NATS, as JSON: what each replica publishes and asks, and
//! the budgets that keep every message under NATS's default 1 MiB payload.

use serde::{Deserialize, Serialize};

use crate::core::digest::{CacheReport, CHECKPOINTS, RECENT};
use crate::core::event::KvEvent;
use crate::core::load::PeerTicket;
use crate::core::truth::Truth;

pub use crate::core::digest::CacheKey;

/// Bytes of checkpoints a digests message may carry (about 70 each as JSON), and of messages a
/// fill reply may carry: NATS's default `max_payload` is 1 MiB.
pub const BUDGET: usize = 512 << 10;

/// Largest message read: a peer cannot make us decode more (NATS's own `max_payload` is
/// usually 1 MiB).
pub const MAX_MESSAGE: usize = 8 << 20;

/// Entries per snapshot chunk: about 60 bytes each as JSON, under NATS's default 1 MiB payload.
pub const CHUNK: usize = 16_384;

/// Messages a fill reply carries at most (a request asks for at most [`RECENT`]; the rest is
/// asked again on the next round).
pub const FILL_MESSAGES: usize = 64;

/// What a replica publishes every interval.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Digests {
    /// Its id.
    pub replica: String,
    /// Its caches.
    pub caches: Vec<CacheReport>,
    /// Per worker, its finished hinted requests since it started: predicted against reported
    /// cached tokens (a replica that does not send them yet sends none).
    #[serde(default)]
    pub served: Vec<(String, Truth)>,
}

/// A replica's hinted requests in flight and survival estimates per worker
/// (`kvroute.replicas.<group>.load`): sent when they change, at most every `load_interval_ms`,
/// and every interval anyway; a worker not listed has none of its requests (no estimate).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoadShare {
    /// Its id.
    pub replica: String,
    /// (worker address, requests in flight).
    pub in_flight: Vec<(String, u32)>,
    /// (worker address, its own survival estimate): pooled by every replica, so all weigh a
    /// worker alike (a replica that does not send them sends none).
    #[serde(default)]
    pub survival: Vec<(String, f64)>,
    /// (worker address, its requests in flight there): every open ticket, each with its
    /// prompt's leading blocks the first time it is shared (at most [`TICKET_BLOCKS_SHARED`]
    /// blocks a message), so every replica expects what runs on a worker as one index would.
    #[serde(default)]
    pub tickets: Vec<(String, Vec<PeerTicket>)>,
}

/// Prompt blocks a load share carries at most (about 20 bytes each as JSON, so under
/// [`BUDGET`]): tickets beyond go without theirs, and peers count no blocks for them.
pub const TICKET_BLOCKS_SHARED: usize = 16_384;

/// A request for a peer's snapshot of a cache (`kvroute.replicas.<group>.snapshot.<peer>`),
/// from entry `offset` on: a big cache comes in chunks of one snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRequest {
    /// The worker's address.
    pub worker: String,
    /// The rank.
    pub rank: u32,
    /// The first entry wanted.
    pub offset: usize,
}

/// A replica asking its peers for KV-event messages it lost (`kvroute.replicas.<group>.fill`,
/// answered on the request's reply subject by every peer that applied some of them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FillRequest {
    /// The asking replica (its own request comes back to it too).
    pub replica: String,
    /// The worker's address.
    pub worker: String,
    /// The rank.
    pub rank: u32,
    /// The messages' sequence numbers.
    pub seqs: Vec<u64>,
}

/// A peer's copies of lost messages.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FillReply {
    /// The worker's address.
    pub worker: String,
    /// The rank.
    pub rank: u32,
    /// (sequence number, events) of each message the peer has.
    pub messages: Vec<(u64, Vec<crate::core::event::KvEvent>)>,
}

/// One chunk of a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotChunk {
    /// The last message applied to the cache when the snapshot was taken.
    pub seq: u64,
    /// Entries in the whole snapshot.
    pub total: usize,
    /// (engine hash, node) from the request's offset on, least recently used first.
    pub entries: Vec<(u64, u64)>,
    /// Their parents ([`crate::core::digest::to_wire`]).
    #[serde(default)]
    pub parents: Vec<u64>,
}

/// Keep each cache's newest checkpoints, as many as fit the budget for all of them (at least
/// 4: a peer needs a few to find a message in common).
pub fn fit(mut caches: Vec<CacheReport>) -> Vec<CacheReport> {
    let per_cache = (BUDGET / 70 / caches.len().max(1)).clamp(4, CHECKPOINTS);
    for c in &mut caches {
        let extra = c.checkpoints.len().saturating_sub(per_cache);
        c.checkpoints.drain(..extra);
    }
    caches
}

/// A fill request's sequence numbers, at most what a log keeps.
pub fn bounded(seqs: &[u64]) -> &[u64] {
    &seqs[..seqs.len().min(RECENT)]
}

/// A fill reply with as many of `messages` as fit the budget (at most [`FILL_MESSAGES`]; the
/// rest is asked again); `None` when none is left to send.
pub fn fill_reply(
    worker: &str,
    rank: u32,
    mut messages: Vec<(u64, Vec<KvEvent>)>,
) -> Option<Vec<u8>> {
    messages.truncate(FILL_MESSAGES);
    loop {
        if messages.is_empty() {
            return None;
        }
        let reply = FillReply {
            worker: worker.to_owned(),
            rank,
            messages,
        };
        let body = serde_json::to_vec(&reply).ok()?;
        if body.len() <= BUDGET {
            return Some(body);
        }
        messages = reply.messages;
        messages.truncate(messages.len() / 2);
    }
}

/// A message of at most [`MAX_MESSAGE`] bytes, decoded.
pub fn decode<T: serde::de::DeserializeOwned>(payload: &[u8]) -> Result<T, String> {
    if payload.len() > MAX_MESSAGE {
        return Err(format!("{} bytes, over {MAX_MESSAGE}", payload.len()));
    }
    serde_json::from_slice(payload).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::digest::Checkpoint;

    /// However many caches, a digests message stays within NATS's payload limit.
    #[test]
    fn digests_fit_a_nats_message() {
        let cache = |i: u32| CacheReport {
            worker: format!("10.0.{}.{}:8000", i / 250, i % 250),
            rank: i % 8,
            clean: true,
            filling: false,
            lost_at: u64::MAX,
            quiet_ms: Some(u64::MAX),
            checkpoints: (0..CHECKPOINTS as u64)
                .map(|seq| Checkpoint {
                    seq: u64::MAX - seq,
                    blocks: u64::MAX,
                    digest: u64::MAX,
                })
                .collect(),
        };
        for n in [1, 64, 512] {
            let caches = fit((0..n).map(cache).collect());
            let body = serde_json::to_vec(&Digests {
                replica: "r".into(),
                caches,
                served: Vec::new(),
            })
            .unwrap();
            assert!(body.len() < 1 << 20, "{n} caches: {} bytes", body.len());
        }
    }

    /// A fill reply too big for one message is cut to what fits; an empty one is not sent.
    #[test]
    fn fill_replies_fit_a_nats_message() {
        use crate::core::event::{EngineHash, KvEventKind};
        let big = KvEvent {
            dp_rank: 0,
            kind: KvEventKind::Removed {
                blocks: (0..4_000).map(EngineHash).collect(),
            },
        };
        let messages: Vec<(u64, Vec<KvEvent>)> = (0..64).map(|s| (s, vec![big.clone()])).collect();
        let body = fill_reply("w", 0, messages).unwrap();
        assert!(body.len() <= BUDGET);
        let reply: FillReply = decode(&body).unwrap();
        assert!(!reply.messages.is_empty() && reply.messages.len() < 64);
        assert_eq!(fill_reply("w", 0, Vec::new()), None);
    }
}
