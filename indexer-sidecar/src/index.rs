//! [`RadixIndex`]: which cache holds which prefix.
//!
//! A radix tree over blocks, stored flat: every node is named by its [`PrefixHash`] (the hash of
//! the block *and its whole prefix*), so a node's path from the root is implied by its key and a
//! lookup of a request's n blocks is n hash-map probes, with no pointer chasing. Each cache keeps
//! its own map from engine hash to node, because events name parents and evictions by the
//! engine's hash, which only that engine understands.

use std::collections::HashMap;

use kvroute_protocol::hash::chain;
use kvroute_protocol::PrefixHash;
use smallvec::SmallVec;

use crate::event::{EngineHash, KvEvent, KvEventKind};
use crate::registry::WorkerId;

/// One KV cache: a data-parallel rank of a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CacheId {
    /// The worker.
    pub worker: WorkerId,
    /// Its data-parallel rank.
    pub dp_rank: u32,
}

/// What applying one event did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ApplyOutcome {
    /// Blocks added.
    pub stored: usize,
    /// Blocks removed.
    pub removed: usize,
    /// Removals of blocks the index did not know (already gone, or stored before we listened).
    pub unknown_removals: usize,
    /// A store whose parent block is unknown: it cannot be placed in the tree and is dropped.
    pub orphan: bool,
}

/// The index of one model.
#[derive(Debug, Default)]
pub struct RadixIndex {
    holders: HashMap<PrefixHash, SmallVec<[CacheId; 4]>>,
    caches: HashMap<CacheId, HashMap<EngineHash, PrefixHash>>,
}

impl RadixIndex {
    /// Apply one event of one worker.
    pub fn apply(&mut self, worker: WorkerId, event: &KvEvent) -> ApplyOutcome {
        let cache = CacheId {
            worker,
            dp_rank: event.dp_rank,
        };
        let mut out = ApplyOutcome::default();
        match &event.kind {
            KvEventKind::Stored { parent, blocks } => {
                let blocks_of = self.caches.entry(cache).or_default();
                let mut prefix = match parent {
                    None => None,
                    Some(p) => match blocks_of.get(p) {
                        Some(&prefix) => Some(prefix),
                        None => {
                            out.orphan = true;
                            return out;
                        }
                    },
                };
                for b in blocks {
                    let node = chain(prefix, b.local_hash);
                    blocks_of.insert(b.engine_hash, node);
                    let holders = self.holders.entry(node).or_default();
                    if !holders.contains(&cache) {
                        holders.push(cache);
                    }
                    prefix = Some(node);
                    out.stored += 1;
                }
            }
            KvEventKind::Removed { blocks } => {
                for h in blocks {
                    let node = self.caches.get_mut(&cache).and_then(|m| m.remove(h));
                    match node {
                        Some(node) => {
                            self.drop_holder(node, cache);
                            out.removed += 1;
                        }
                        None => out.unknown_removals += 1,
                    }
                }
            }
            KvEventKind::Cleared => out.removed = self.clear_cache(cache),
        }
        out
    }

    fn drop_holder(&mut self, node: PrefixHash, cache: CacheId) {
        if let Some(holders) = self.holders.get_mut(&node) {
            holders.retain(|c| *c != cache);
            if holders.is_empty() {
                self.holders.remove(&node);
            }
        }
    }

    fn clear_cache(&mut self, cache: CacheId) -> usize {
        let Some(blocks) = self.caches.remove(&cache) else {
            return 0;
        };
        let n = blocks.len();
        for node in blocks.into_values() {
            self.drop_holder(node, cache);
        }
        n
    }

    /// Forget everything a worker holds (all its ranks); returns the blocks dropped.
    pub fn remove_worker(&mut self, worker: WorkerId) -> usize {
        let caches: Vec<CacheId> = self
            .caches
            .keys()
            .filter(|c| c.worker == worker)
            .copied()
            .collect();
        caches.into_iter().map(|c| self.clear_cache(c)).sum()
    }

    /// For each worker holding the first block: how many leading blocks of `hashes` it holds
    /// without a gap (best of its ranks). Sorted by worker id.
    pub fn find_matches(&self, hashes: &[PrefixHash]) -> Vec<(WorkerId, u32)> {
        let mut matched: Vec<(CacheId, u32)> = Vec::new();
        for (depth, h) in hashes.iter().enumerate() {
            let Some(holders) = self.holders.get(h) else {
                break;
            };
            let depth = depth as u32 + 1;
            if depth == 1 {
                matched = holders.iter().map(|&c| (c, 1)).collect();
                continue;
            }
            let mut any = false;
            for (cache, n) in matched.iter_mut() {
                if *n == depth - 1 && holders.contains(cache) {
                    *n = depth;
                    any = true;
                }
            }
            if !any {
                break;
            }
        }
        let mut best: Vec<(WorkerId, u32)> = Vec::new();
        matched.sort_unstable();
        for (cache, n) in matched {
            match best.last_mut() {
                Some((w, m)) if *w == cache.worker => *m = (*m).max(n),
                _ => best.push((cache.worker, n)),
            }
        }
        best
    }

    /// Blocks held by one worker (all ranks).
    pub fn blocks_of(&self, worker: WorkerId) -> usize {
        self.caches
            .iter()
            .filter(|(c, _)| c.worker == worker)
            .map(|(_, m)| m.len())
            .sum()
    }

    /// Distinct prefixes (tree nodes) in the index.
    pub fn len(&self) -> usize {
        self.holders.len()
    }

    /// Whether the index is empty.
    pub fn is_empty(&self) -> bool {
        self.holders.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::StoredBlock;
    use kvroute_protocol::hash::{local_block_hashes, prefix_hashes};
    use kvroute_protocol::{HashSeed, LocalBlockHash};

    const W0: WorkerId = WorkerId(0);
    const W1: WorkerId = WorkerId(1);

    /// Local hashes of a prompt made of `n` blocks whose tokens are `base..`.
    fn locals(base: u32, n: usize) -> Vec<LocalBlockHash> {
        let tokens: Vec<u32> = (base..base + 4 * n as u32).collect();
        local_block_hashes(&tokens, 4, HashSeed::default())
    }

    /// A stored event; engine hashes are arbitrary (here: local hash + salt), like a real engine.
    fn stored(parent: Option<u64>, locals: &[LocalBlockHash], salt: u64) -> KvEvent {
        KvEvent {
            dp_rank: 0,
            kind: KvEventKind::Stored {
                parent: parent.map(EngineHash),
                blocks: locals
                    .iter()
                    .map(|l| StoredBlock {
                        engine_hash: EngineHash(l.0 ^ salt),
                        local_hash: *l,
                    })
                    .collect(),
            },
        }
    }

    #[test]
    fn longest_prefix_per_worker() {
        let mut idx = RadixIndex::default();
        let a = locals(0, 6);
        idx.apply(W0, &stored(None, &a[..6], 1));
        idx.apply(W1, &stored(None, &a[..2], 2));
        let q = prefix_hashes(&a);
        assert_eq!(idx.find_matches(&q), vec![(W0, 6), (W1, 2)]);
        assert_eq!(idx.find_matches(&q[..1]), vec![(W0, 1), (W1, 1)]);
        // A different first block matches nothing, even if later tokens agree.
        let mut other = locals(1000, 1);
        other.extend_from_slice(&a[1..]);
        assert!(idx.find_matches(&prefix_hashes(&other)).is_empty());
        assert_eq!(idx.len(), 6);
    }

    #[test]
    fn continuation_through_parent_engine_hash() {
        let mut idx = RadixIndex::default();
        let a = locals(0, 4);
        idx.apply(W0, &stored(None, &a[..2], 7));
        // The engine continues the sequence: its parent is the engine hash of block 1.
        let out = idx.apply(W0, &stored(Some(a[1].0 ^ 7), &a[2..], 7));
        assert_eq!(out.stored, 2);
        assert_eq!(idx.find_matches(&prefix_hashes(&a)), vec![(W0, 4)]);
    }

    #[test]
    fn orphan_store_is_dropped_and_reported() {
        let mut idx = RadixIndex::default();
        let a = locals(0, 2);
        let out = idx.apply(W0, &stored(Some(12345), &a, 0));
        assert!(out.orphan);
        assert_eq!(out.stored, 0);
        assert!(idx.is_empty());
    }

    #[test]
    fn removal_leaves_a_gap_that_stops_the_match() {
        let mut idx = RadixIndex::default();
        let a = locals(0, 4);
        idx.apply(W0, &stored(None, &a, 3));
        let out = idx.apply(
            W0,
            &KvEvent {
                dp_rank: 0,
                kind: KvEventKind::Removed {
                    blocks: vec![EngineHash(a[1].0 ^ 3), EngineHash(999)],
                },
            },
        );
        assert_eq!((out.removed, out.unknown_removals), (1, 1));
        assert_eq!(idx.find_matches(&prefix_hashes(&a)), vec![(W0, 1)]);
        assert_eq!(idx.blocks_of(W0), 3);
    }

    #[test]
    fn cleared_and_worker_removal() {
        let mut idx = RadixIndex::default();
        let a = locals(0, 3);
        idx.apply(W0, &stored(None, &a, 1));
        let mut rank1 = stored(None, &a, 2);
        rank1.dp_rank = 1;
        idx.apply(W0, &rank1);
        idx.apply(W1, &stored(None, &a, 3));
        assert_eq!(idx.blocks_of(W0), 6);
        let cleared = idx.apply(
            W1,
            &KvEvent {
                dp_rank: 0,
                kind: KvEventKind::Cleared,
            },
        );
        assert_eq!(cleared.removed, 3);
        assert_eq!(idx.find_matches(&prefix_hashes(&a)), vec![(W0, 3)]);
        assert_eq!(idx.remove_worker(W0), 6);
        assert!(idx.is_empty());
        assert!(idx.find_matches(&prefix_hashes(&a)).is_empty());
    }

    #[test]
    fn ranks_count_separately_but_report_per_worker() {
        let mut idx = RadixIndex::default();
        let a = locals(0, 3);
        idx.apply(W0, &stored(None, &a[..1], 1));
        let mut rank1 = stored(None, &a, 2);
        rank1.dp_rank = 1;
        idx.apply(W0, &rank1);
        assert_eq!(idx.find_matches(&prefix_hashes(&a)), vec![(W0, 3)]);
    }

    #[test]
    fn restoring_the_same_block_is_idempotent() {
        let mut idx = RadixIndex::default();
        let a = locals(0, 2);
        idx.apply(W0, &stored(None, &a, 1));
        idx.apply(W0, &stored(None, &a, 1));
        assert_eq!(idx.blocks_of(W0), 2);
        assert_eq!(idx.len(), 2);
    }
}
