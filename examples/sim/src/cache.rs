//! A paged prefix cache with a block capacity, like vLLM's block pool.
//!
//! Blocks are named by [`PrefixHash`]. A running request holds a reference on each of its
//! blocks; a block no request holds stays cached but *free*, and only free blocks are evicted,
//! least recently freed first. So a prefix that running requests share is never lost, while
//! an idle conversation is evicted by the requests admitted before its next turn (real vLLM
//! did exactly this in front of kvroute: docs/benchmarks.md, "Against real vLLM"). A finished
//! request frees its blocks tail first, as vLLM does, so under pressure a sequence is evicted
//! from its end and a parent goes no earlier than its children. Blocks several running
//! requests share take memory once.

use std::collections::{BTreeMap, HashMap, HashSet};

use kvroute_protocol::PrefixHash;

/// Result of admitting a request's blocks.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Admission {
    /// Leading blocks that were already cached (at most the `max_hit` asked for).
    pub hit_blocks: usize,
    /// Blocks newly stored, in sequence order (index into the request's blocks).
    pub stored_from: usize,
    /// Blocks evicted to make room, oldest first.
    pub evicted: Vec<PrefixHash>,
}

#[derive(Debug, Clone, Copy)]
struct Block {
    /// Running requests holding it.
    refs: u32,
    /// Its place in the free order (meaningful while `refs` is 0).
    freed_at: u64,
}

/// The cache of one engine.
#[derive(Debug)]
pub struct PrefixCache {
    capacity: usize,
    blocks: HashMap<PrefixHash, Block>,
    /// Cached blocks no request holds, by when they were freed: the first is evicted first.
    free: BTreeMap<u64, PrefixHash>,
    clock: u64,
    /// Blocks running requests use that name no prefix (a prompt's partial last block).
    anonymous: usize,
}

impl PrefixCache {
    /// An empty cache holding at most `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        PrefixCache {
            capacity: capacity.max(1),
            blocks: HashMap::new(),
            free: BTreeMap::new(),
            clock: 0,
            anonymous: 0,
        }
    }

    /// Leading blocks of `blocks` held, without touching anything (the oracle's view).
    pub fn peek(&self, blocks: &[PrefixHash]) -> usize {
        blocks
            .iter()
            .take_while(|b| self.blocks.contains_key(b))
            .count()
    }

    /// The blocks of a request of `total` blocks (its full ones named by `prefixes`) as the
    /// cache keeps them: a request longer than the whole cache keeps its first `capacity`.
    pub fn kept(&self, prefixes: &[PrefixHash], total: usize) -> (usize, usize) {
        let total = total.clamp(1, self.capacity);
        (prefixes.len().min(total), total)
    }

    /// Start a request of `total` blocks whose full blocks are `prefixes`, reusing at most
    /// `max_hit` leading cached ones: take a reference on its blocks, evicting free blocks to
    /// make room. `None` when its new blocks do not fit beside the running requests' (vLLM
    /// counts a reused free block as one it must take from the free pool, too).
    pub fn admit(
        &mut self,
        prefixes: &[PrefixHash],
        total: usize,
        max_hit: usize,
    ) -> Option<Admission> {
        let (named, total) = self.kept(prefixes, total);
        let prefixes = &prefixes[..named];
        let hit = self.peek(prefixes).min(max_hit);
        let own: HashSet<PrefixHash> = prefixes.iter().copied().collect();
        let own_free = own
            .iter()
            .filter(|b| self.blocks.get(b).is_some_and(|b| b.refs == 0))
            .count();
        let empty = self
            .capacity
            .saturating_sub(self.blocks.len() + self.anonymous);
        let evictable = self.free.len() - own_free;
        let new = total
            - hit
            - prefixes[hit..]
                .iter()
                .filter(|b| self.blocks.contains_key(b))
                .count();
        if new > empty + evictable {
            return None;
        }
        let mut evicted = Vec::new();
        while self.blocks.len() + self.anonymous + new > self.capacity {
            let Some((&at, &victim)) = self.free.iter().find(|(_, b)| !own.contains(b)) else {
                break;
            };
            self.free.remove(&at);
            self.blocks.remove(&victim);
            evicted.push(victim);
        }
        for b in prefixes {
            // Free stamps start at 1: a new block's 0 names no free entry.
            let block = self.blocks.entry(*b).or_insert(Block {
                refs: 0,
                freed_at: 0,
            });
            if block.refs == 0 {
                self.free.remove(&block.freed_at);
            }
            block.refs += 1;
        }
        self.anonymous += total - named;
        Some(Admission {
            hit_blocks: hit,
            stored_from: hit,
            evicted,
        })
    }

    /// End a request [`admit`](Self::admit) started with the same arguments: its blocks go
    /// free, tail first, and stay cached until evicted.
    pub fn release(&mut self, prefixes: &[PrefixHash], total: usize) {
        let (named, total) = self.kept(prefixes, total);
        for b in prefixes[..named].iter().rev() {
            let Some(block) = self.blocks.get_mut(b) else {
                continue;
            };
            if block.refs == 0 {
                continue;
            }
            block.refs -= 1;
            if block.refs == 0 {
                self.clock += 1;
                block.freed_at = self.clock;
                self.free.insert(self.clock, *b);
            }
        }
        self.anonymous = self.anonymous.saturating_sub(total - named);
    }

    /// Blocks running requests use (what vLLM's KV usage counts).
    pub fn used(&self) -> usize {
        self.blocks.len() - self.free.len() + self.anonymous
    }

    /// Blocks held, in use or free.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether the cache holds no block.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Capacity in blocks.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Drop every cached block (a cache reset); returns what was held. Running requests keep
    /// their memory until they end; their release finds nothing to free.
    pub fn clear(&mut self) -> Vec<PrefixHash> {
        self.free.clear();
        self.blocks.drain().map(|(b, _)| b).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(ids: &[u64]) -> Vec<PrefixHash> {
        ids.iter().map(|&i| PrefixHash(i)).collect()
    }

    /// Admit and finish at once: the blocks stay cached, free.
    fn run(c: &mut PrefixCache, ids: &[u64]) -> Admission {
        let s = seq(ids);
        let a = c.admit(&s, s.len(), s.len()).expect("fits");
        c.release(&s, s.len());
        a
    }

    #[test]
    fn hits_count_leading_blocks() {
        let mut c = PrefixCache::new(10);
        let a = run(&mut c, &[1, 2, 3]);
        assert_eq!((a.hit_blocks, a.stored_from), (0, 0));
        let b = run(&mut c, &[1, 2, 4]);
        assert_eq!((b.hit_blocks, b.stored_from), (2, 2));
        assert_eq!(c.peek(&seq(&[1, 2, 3, 9])), 3);
        assert_eq!(c.len(), 4);
        assert_eq!(c.used(), 0);
    }

    #[test]
    fn evicts_least_recently_freed_tail_first() {
        let mut c = PrefixCache::new(4);
        run(&mut c, &[1, 2]);
        run(&mut c, &[5, 6]);
        let a = run(&mut c, &[7]);
        // The oldest request's tail goes first, then its head.
        assert_eq!(a.evicted, seq(&[2]));
        let b = run(&mut c, &[8, 9]);
        assert_eq!(b.evicted, seq(&[1, 6]));
        assert_eq!(c.len(), 4);
    }

    #[test]
    fn reused_prefix_survives_eviction() {
        let mut c = PrefixCache::new(3);
        run(&mut c, &[1, 2, 3]);
        let a = run(&mut c, &[1, 4]);
        assert_eq!(a.hit_blocks, 1);
        assert_eq!(a.evicted, seq(&[3]));
        assert_eq!(c.peek(&seq(&[1, 4])), 2);
    }

    /// Only free blocks are evicted: a running request's prefix stays however old, an idle one
    /// goes, and a request that would need the running blocks' room waits.
    #[test]
    fn running_requests_pin_their_blocks() {
        let mut c = PrefixCache::new(4);
        let running = seq(&[1, 2]);
        c.admit(&running, 2, 2).unwrap();
        run(&mut c, &[3, 4]);
        let a = run(&mut c, &[5, 6]);
        assert_eq!(a.evicted, seq(&[4, 3]));
        assert_eq!(c.peek(&running), 2);
        assert!(c.admit(&seq(&[7, 8, 9]), 3, 3).is_none());
        c.release(&running, 2);
        assert!(c.admit(&seq(&[7, 8, 9]), 3, 3).is_some());
    }

    /// Blocks several running requests share take memory once.
    #[test]
    fn shared_blocks_count_once() {
        let mut c = PrefixCache::new(5);
        let (a, b) = (seq(&[1, 2, 3]), seq(&[1, 2, 4]));
        c.admit(&a, 3, 3).unwrap();
        let second = c.admit(&b, 3, 3).unwrap();
        assert_eq!(second.hit_blocks, 2);
        assert_eq!(c.used(), 4);
        c.release(&a, 3);
        assert_eq!(c.used(), 3);
        c.release(&b, 3);
        assert_eq!(c.used(), 0);
    }

    /// A partial last block takes memory but is never cached; `max_hit` leaves blocks to
    /// recompute (vLLM computes at least a prompt's last token).
    #[test]
    fn partial_blocks_and_capped_hits() {
        let mut c = PrefixCache::new(4);
        let p = seq(&[1, 2]);
        c.admit(&p, 3, 2).unwrap();
        assert_eq!((c.used(), c.len()), (3, 2));
        c.release(&p, 3);
        let again = c.admit(&p, 2, 1).unwrap();
        assert_eq!(again.hit_blocks, 1);
        assert_eq!(c.used(), 2);
    }

    #[test]
    fn prompt_longer_than_cache() {
        let mut c = PrefixCache::new(2);
        let a = run(&mut c, &[1, 2, 3, 4]);
        assert_eq!(c.len(), 2);
        assert!(a.evicted.is_empty());
        assert_eq!(c.clear().len(), 2);
        assert!(c.is_empty());
    }
}
