//! [`KvEvent`]: one engine cache event, whatever transport and format it came in.

use kvroute_protocol::dynamo::{KvCacheEventData, RouterEvent};
use kvroute_protocol::LocalBlockHash;

/// The engine's own hash of a block (with its prefix); only meaningful to that engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EngineHash(pub u64);

/// A stored block: the engine's name for it and the hash of its tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoredBlock {
    /// What later events call this block.
    pub engine_hash: EngineHash,
    /// Hash of the block's tokens, as the filter computes it.
    pub local_hash: LocalBlockHash,
}

/// What happened to one cache (one worker's one data-parallel rank).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEventKind {
    /// Blocks stored in sequence order after `parent`.
    Stored {
        /// Engine hash of the block before the first one; `None` at the start of a prompt.
        parent: Option<EngineHash>,
        /// The blocks.
        blocks: Vec<StoredBlock>,
    },
    /// Blocks evicted.
    Removed {
        /// Engine hashes of the evicted blocks.
        blocks: Vec<EngineHash>,
    },
    /// Everything evicted.
    Cleared,
}

impl KvEventKind {
    /// Label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            KvEventKind::Stored { .. } => "stored",
            KvEventKind::Removed { .. } => "removed",
            KvEventKind::Cleared => "cleared",
        }
    }
}

/// A cache event attributed to a data-parallel rank of a worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEvent {
    /// Data-parallel rank: each rank has its own cache.
    pub dp_rank: u32,
    /// What happened.
    pub kind: KvEventKind,
}

impl KvEvent {
    /// Convert a Dynamo event. Dynamo carries our local hash as `tokens_hash`, so nothing is
    /// recomputed; the engine's `block_hash` names blocks for parents and removals.
    pub fn from_dynamo(event: &RouterEvent) -> KvEvent {
        let kind = match &event.event.data {
            KvCacheEventData::Stored(s) => KvEventKind::Stored {
                parent: s.parent_hash.map(EngineHash),
                blocks: s
                    .blocks
                    .iter()
                    .map(|b| StoredBlock {
                        engine_hash: EngineHash(b.block_hash),
                        local_hash: LocalBlockHash(b.tokens_hash),
                    })
                    .collect(),
            },
            KvCacheEventData::Removed(r) => KvEventKind::Removed {
                blocks: r.block_hashes.iter().copied().map(EngineHash).collect(),
            },
            KvCacheEventData::Cleared => KvEventKind::Cleared,
        };
        KvEvent {
            dp_rank: event.event.dp_rank,
            kind,
        }
    }
}
