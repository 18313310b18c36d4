//! [`KvEvent`]: one engine cache event, whatever transport and format it came in.

use kvroute_protocol::dynamo::{KvCacheEventData, RouterEvent};
use kvroute_protocol::hash::local_block_hash;
use kvroute_protocol::vllm::{Medium, VllmEvent};
use kvroute_protocol::{HashSeed, LocalBlockHash};
use serde::{Deserialize, Serialize};

/// The engine's own hash of a block (with its prefix); only meaningful to that engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct EngineHash(pub u64);

/// A stored block: the engine's name for it and the hash of its tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredBlock {
    /// What later events call this block.
    pub engine_hash: EngineHash,
    /// Hash of the block's tokens, as the filter computes it.
    pub local_hash: LocalBlockHash,
}

/// What happened to one cache (one worker's one data-parallel rank). Replicas hand each other
/// lost messages as these (serialized).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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

/// Which kind of event, without its blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventTag {
    /// [`KvEventKind::Stored`].
    Stored,
    /// [`KvEventKind::Removed`].
    Removed,
    /// [`KvEventKind::Cleared`].
    Cleared,
}

impl KvEventKind {
    /// Which kind it is.
    pub fn tag(&self) -> EventTag {
        match self {
            KvEventKind::Stored { .. } => EventTag::Stored,
            KvEventKind::Removed { .. } => EventTag::Removed,
            KvEventKind::Cleared => EventTag::Cleared,
        }
    }
}

/// A cache event attributed to a data-parallel rank of a worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvEvent {
    /// Data-parallel rank: each rank has its own cache.
    pub dp_rank: u32,
    /// What happened.
    pub kind: KvEventKind,
}

impl KvEvent {
    /// Convert a Dynamo event. Dynamo carries our local hash as `tokens_hash`, so nothing is
    /// recomputed; the engine's `block_hash` names blocks for parents and removals. Dynamo
    /// sends events about offloaded copies on the same subject, told apart by their tier.
    pub fn from_dynamo(event: &RouterEvent) -> Result<KvEvent, EventProblem> {
        if event.storage_tier != "device" {
            return Err(EventProblem::Offloaded(event.storage_tier.to_string()));
        }
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
        Ok(KvEvent {
            dp_rank: event.event.dp_rank,
            kind,
        })
    }
}

/// Why an engine's event is not indexed as it came.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EventProblem {
    /// The engine's block size differs from the model's configured one: no hash could match.
    #[error("engine block size {engine} differs from the configured {configured}")]
    BlockSize {
        /// In the event.
        engine: u32,
        /// In the sidecar's `[[models]]`.
        configured: u32,
    },
    /// A copy in another tier than GPU memory (vLLM's `medium` CPU or disk, Dynamo's
    /// `storage_tier` host_pinned, disk, external): a request routed for it still computes
    /// its prefill on the GPU unless the engine loads it back, so kvroute indexes GPU memory
    /// only (Dynamo's router keeps such copies in indexes of their own, weighted lower).
    #[error("blocks in {0}, not GPU memory: an offloaded copy")]
    Offloaded(String),
    /// `token_ids` does not cover the announced blocks.
    #[error("{tokens} token ids for {blocks} blocks of {block_size}")]
    Tokens {
        /// Token ids in the event.
        tokens: usize,
        /// Blocks announced.
        blocks: usize,
        /// Tokens per block.
        block_size: u32,
    },
}

impl KvEvent {
    /// Convert a vLLM event. vLLM's own block hash is kept only as the block's name; the
    /// index key is kvroute's hash of the block's `token_ids` (with the LoRA seed), exactly what
    /// the filter computes. A stored run stops at the first block whose hash included extra
    /// keys (multimodal inputs, cache salt): the filter cannot reproduce those.
    pub fn from_vllm(
        event: &VllmEvent,
        dp_rank: u32,
        block_size: u32,
    ) -> Result<KvEvent, EventProblem> {
        let gpu = |medium: &Option<Medium>| match medium.as_deref() {
            None | Some("GPU") | Some("gpu") => Ok(()),
            Some(other) => Err(EventProblem::Offloaded(other.to_owned())),
        };
        let kind = match event {
            VllmEvent::BlockStored {
                block_hashes,
                parent,
                token_ids,
                block_size: engine,
                lora_name,
                medium,
                has_extra_keys,
                ..
            } => {
                gpu(medium)?;
                if *engine != block_size {
                    return Err(EventProblem::BlockSize {
                        engine: *engine,
                        configured: block_size,
                    });
                }
                let size = block_size.max(1) as usize;
                if token_ids.len() != block_hashes.len() * size {
                    return Err(EventProblem::Tokens {
                        tokens: token_ids.len(),
                        blocks: block_hashes.len(),
                        block_size,
                    });
                }
                let seed = HashSeed::for_request(lora_name.as_deref(), None);
                KvEventKind::Stored {
                    parent: parent.map(|p| EngineHash(p.0)),
                    blocks: block_hashes
                        .iter()
                        .zip(token_ids.chunks_exact(size))
                        .zip(has_extra_keys.iter().chain(std::iter::repeat(&false)))
                        .take_while(|(_, &extra)| !extra)
                        .map(|((h, tokens), _)| StoredBlock {
                            engine_hash: EngineHash(h.0),
                            local_hash: local_block_hash(tokens, seed),
                        })
                        .collect(),
                }
            }
            VllmEvent::BlockRemoved {
                block_hashes,
                medium,
                ..
            } => {
                gpu(medium)?;
                KvEventKind::Removed {
                    blocks: block_hashes.iter().map(|h| EngineHash(h.0)).collect(),
                }
            }
            VllmEvent::AllBlocksCleared => KvEventKind::Cleared,
        };
        Ok(KvEvent { dp_rank, kind })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_protocol::hash::{local_block_hashes, token_prefix_hashes};
    use kvroute_protocol::vllm::{decode_batch, EngineBlockHash};

    fn stored(tokens: Vec<u32>, extra: Vec<bool>) -> VllmEvent {
        VllmEvent::BlockStored {
            block_hashes: (0..tokens.len() as u64 / 4).map(EngineBlockHash).collect(),
            parent: None,
            token_ids: tokens.into(),
            block_size: 4,
            lora_name: None,
            medium: Some("GPU".into()),
            has_extra_keys: extra.into(),
            group: None,
            kind: None,
        }
    }

    #[test]
    fn vllm_blocks_are_keyed_by_our_hash_of_their_tokens() {
        let tokens: Vec<u32> = (0..12).collect();
        let e = KvEvent::from_vllm(&stored(tokens.clone(), vec![false; 3]), 1, 4).unwrap();
        let want = local_block_hashes(&tokens, 4, HashSeed::default());
        let KvEventKind::Stored { blocks, parent } = &e.kind else {
            panic!("{e:?}")
        };
        assert_eq!(*parent, None);
        assert_eq!(e.dp_rank, 1);
        assert_eq!(
            blocks.iter().map(|b| b.local_hash).collect::<Vec<_>>(),
            want
        );
        assert_eq!(blocks[2].engine_hash, EngineHash(2));
        // A block with extra keys ends the run.
        let e = KvEvent::from_vllm(&stored(tokens, vec![false, true, false]), 0, 4).unwrap();
        assert!(matches!(e.kind, KvEventKind::Stored { ref blocks, .. } if blocks.len() == 1));
    }

    #[test]
    fn vllm_problems_are_named() {
        let tokens: Vec<u32> = (0..8).collect();
        assert_eq!(
            KvEvent::from_vllm(&stored(tokens.clone(), vec![]), 0, 16),
            Err(EventProblem::BlockSize {
                engine: 4,
                configured: 16
            })
        );
        let mut host = RouterEvent {
            worker_id: 1,
            storage_tier: "host_pinned".into(),
            residency_domain: None,
            event: kvroute_protocol::dynamo::KvCacheEvent {
                event_id: 1,
                data: KvCacheEventData::Cleared,
                dp_rank: 0,
            },
        };
        assert_eq!(
            KvEvent::from_dynamo(&host),
            Err(EventProblem::Offloaded("host_pinned".into()))
        );
        host.storage_tier = "device".into();
        assert!(KvEvent::from_dynamo(&host).is_ok());
        let cpu = VllmEvent::BlockRemoved {
            block_hashes: Default::default(),
            medium: Some("CPU".into()),
            group: None,
        };
        assert!(matches!(
            KvEvent::from_vllm(&cpu, 0, 4),
            Err(EventProblem::Offloaded(_))
        ));
        let mut short = stored(tokens, vec![]);
        if let VllmEvent::BlockStored { token_ids, .. } = &mut short {
            token_ids.pop();
        }
        assert!(matches!(
            KvEvent::from_vllm(&short, 0, 4),
            Err(EventProblem::Tokens { .. })
        ));
    }

    /// The real vLLM capture: the prefix hashes of the stored token ids are the ones the filter
    /// computes for the same tokens.
    #[test]
    fn real_vllm_store_chains_like_the_filter() {
        let raw = kvroute_protocol::samples_dir().join("vllm/run1-sha256-default/raw");
        let batch =
            decode_batch(&std::fs::read(raw.join("seq000000.payload.msgpack")).unwrap()).unwrap();
        let VllmEvent::BlockStored { token_ids, .. } = &batch.events[0] else {
            panic!("first capture is a store")
        };
        let e = KvEvent::from_vllm(&batch.events[0], 0, 32).unwrap();
        let KvEventKind::Stored { blocks, .. } = &e.kind else {
            panic!("{e:?}")
        };
        let locals: Vec<LocalBlockHash> = blocks.iter().map(|b| b.local_hash).collect();
        assert_eq!(
            kvroute_protocol::hash::prefix_hashes(&locals),
            token_prefix_hashes(token_ids, 32, HashSeed::default())
        );
        assert_eq!(blocks.len(), 12);
    }
}
