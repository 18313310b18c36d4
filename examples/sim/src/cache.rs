//! A paged prefix cache with a block capacity and LRU eviction, like vLLM's.
//!
//! Blocks are named by [`PrefixHash`]. When a request's blocks are used they are stamped so that
//! the *last* block is the oldest: vLLM frees a finished request's blocks tail first, so under
//! pressure a sequence is evicted from its end, and a parent never goes before its children.

use std::collections::{BTreeMap, HashMap};

use kvroute_protocol::PrefixHash;

/// Result of caching a request's blocks.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Admission {
    /// Leading blocks that were already cached.
    pub hit_blocks: usize,
    /// Blocks newly stored, in sequence order (index into the request's blocks).
    pub stored_from: usize,
    /// Blocks evicted to make room, oldest first.
    pub evicted: Vec<PrefixHash>,
}

/// The cache of one engine.
#[derive(Debug)]
pub struct PrefixCache {
    capacity: usize,
    stamp_of: HashMap<PrefixHash, u64>,
    by_stamp: BTreeMap<u64, PrefixHash>,
    clock: u64,
}

impl PrefixCache {
    /// An empty cache holding at most `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        PrefixCache {
            capacity: capacity.max(1),
            stamp_of: HashMap::new(),
            by_stamp: BTreeMap::new(),
            clock: 0,
        }
    }

    /// Leading blocks of `blocks` held, without touching anything (the oracle's view).
    pub fn peek(&self, blocks: &[PrefixHash]) -> usize {
        blocks
            .iter()
            .take_while(|b| self.stamp_of.contains_key(b))
            .count()
    }

    /// Use a request's blocks: count the hit, store the rest, evict what no longer fits.
    /// A prompt longer than the whole cache keeps only its first `capacity` blocks.
    pub fn admit(&mut self, blocks: &[PrefixHash]) -> Admission {
        let hit_blocks = self.peek(blocks);
        let blocks = &blocks[..blocks.len().min(self.capacity)];
        let mut evicted = Vec::new();
        let new = blocks.len().saturating_sub(hit_blocks);
        // Make room first, without evicting the blocks this request is about to reuse.
        while self.stamp_of.len() + new > self.capacity {
            let Some((&stamp, &victim)) = self
                .by_stamp
                .iter()
                .find(|(_, b)| !blocks[..hit_blocks.min(blocks.len())].contains(b))
            else {
                break;
            };
            self.by_stamp.remove(&stamp);
            self.stamp_of.remove(&victim);
            evicted.push(victim);
        }
        // Stamp tail first so the tail is the oldest.
        for b in blocks.iter().rev() {
            self.clock += 1;
            if let Some(old) = self.stamp_of.insert(*b, self.clock) {
                self.by_stamp.remove(&old);
            }
            self.by_stamp.insert(self.clock, *b);
        }
        Admission {
            hit_blocks,
            stored_from: hit_blocks.min(blocks.len()),
            evicted,
        }
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.stamp_of.len()
    }

    /// Whether the cache is empty.
    pub fn is_empty(&self) -> bool {
        self.stamp_of.is_empty()
    }

    /// Capacity in blocks.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Drop everything (a cache reset); returns what was held.
    pub fn clear(&mut self) -> Vec<PrefixHash> {
        self.by_stamp.clear();
        self.stamp_of.drain().map(|(b, _)| b).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(ids: &[u64]) -> Vec<PrefixHash> {
        ids.iter().map(|&i| PrefixHash(i)).collect()
    }

    #[test]
    fn hits_count_leading_blocks() {
        let mut c = PrefixCache::new(10);
        let a = c.admit(&seq(&[1, 2, 3]));
        assert_eq!((a.hit_blocks, a.stored_from), (0, 0));
        let b = c.admit(&seq(&[1, 2, 4]));
        assert_eq!((b.hit_blocks, b.stored_from), (2, 2));
        assert_eq!(c.peek(&seq(&[1, 2, 3, 9])), 3);
        assert_eq!(c.len(), 4);
    }

    #[test]
    fn evicts_least_recent_tail_first() {
        let mut c = PrefixCache::new(4);
        c.admit(&seq(&[1, 2]));
        c.admit(&seq(&[5, 6]));
        let a = c.admit(&seq(&[7]));
        // The oldest request's tail goes first, then its head.
        assert_eq!(a.evicted, seq(&[2]));
        let b = c.admit(&seq(&[8, 9]));
        assert_eq!(b.evicted, seq(&[1, 6]));
        assert_eq!(c.len(), 4);
    }

    #[test]
    fn reused_prefix_survives_eviction() {
        let mut c = PrefixCache::new(3);
        c.admit(&seq(&[1, 2, 3]));
        let a = c.admit(&seq(&[1, 4]));
        assert_eq!(a.hit_blocks, 1);
        assert_eq!(a.evicted, seq(&[3]));
        assert_eq!(c.peek(&seq(&[1, 4])), 2);
    }

    #[test]
    fn prompt_longer_than_cache() {
        let mut c = PrefixCache::new(2);
        let a = c.admit(&seq(&[1, 2, 3, 4]));
        assert_eq!(c.len(), 2);
        assert!(a.evicted.is_empty());
        assert_eq!(c.clear().len(), 2);
        assert!(c.is_empty());
    }
}
