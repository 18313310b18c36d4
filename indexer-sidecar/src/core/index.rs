//! [`RadixIndex`]: which cache holds which prefix.
//!
//! A radix tree over blocks, stored flat: every node is named by its [`PrefixHash`] (the hash of
//! the block *and its whole prefix*), so a node's path from the root is implied by its key.
//! Each cache keeps its own map from engine hash to node, because events name parents and
//! evictions by the engine's hash, which only that engine understands.
//!
//! Lookups binary-search the prompt's depth instead of walking it block by block: engines evict
//! a sequence from its tail (vLLM frees a finished request's blocks tail first, and a shared
//! parent is always used at least as recently as its children), so the blocks a cache holds are
//! prefix-closed and "some other cache holds block *d*" is monotone in *d*. A 512-block prompt
//! costs ~10 probes per tier of workers instead of 512. If events were lost and a cache holds a
//! block without its parent, its match can be overestimated: the request then lands on a worker
//! with a shorter prefix than hinted — a weaker hint, never a failure.
//!
//! A cache never holds more blocks than its engine can ([`RadixIndex::apply_within`]): past
//! that, removals were lost (NATS core drops, a publisher's high-water mark) or a publisher
//! lies, and what goes first is what the engine's own policy drops: the least recently used
//! blocks, leaves first ([`BlockMap`]), so a prefix every request extends stays.

use std::collections::HashMap;

use kvroute_protocol::hash::chain;
use kvroute_protocol::PrefixHash;

use crate::core::block_map::{BlockMap, Entry};
use crate::core::event::{EngineHash, KvEvent, KvEventKind};
use crate::core::fleet::WorkerId;
use crate::core::holders::{Holders, Slot};
use crate::core::homes::Homes;

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
    /// The event came from a cache beyond the index's 65,535 caches and was dropped.
    pub too_many_caches: bool,
    /// Blocks dropped, least recently used leaves first, because the cache held more than its
    /// capacity.
    pub evicted: usize,
}

#[derive(Debug)]
struct Cache {
    id: CacheId,
    blocks: BlockMap,
    /// Order-independent digest of `blocks` (a wrapping sum of [`entry_digest`]): two replicas
    /// that applied the same events hold the same digest.
    digest: u64,
    /// The prefixes of the home depth it holds.
    homes: Homes,
}

/// One (engine hash, node) entry's share of a cache digest.
pub fn entry_digest(engine: EngineHash, node: PrefixHash) -> u64 {
    let mut x = engine.0 ^ node.0.rotate_left(29) ^ 0x9e37_79b9_7f4a_7c15;
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

impl Cache {
    fn new(id: CacheId, home_depth: usize) -> Self {
        Cache {
            id,
            blocks: BlockMap::default(),
            digest: 0,
            homes: Homes::new(home_depth),
        }
    }
}

/// The index of one model.
#[derive(Debug, Default)]
pub struct RadixIndex {
    holders: Holders,
    caches: Vec<Cache>,
    slots: HashMap<CacheId, Slot>,
    /// The depth, in blocks, of the prefixes each cache counts as home to ([`Homes`]).
    home_depth: usize,
}

impl RadixIndex {
    /// An empty index whose caches count the prefixes `home_depth` blocks deep they hold
    /// ([`RadixIndex::homes`]; 0: none).
    pub fn new(home_depth: usize) -> Self {
        RadixIndex {
            home_depth,
            ..RadixIndex::default()
        }
    }

    fn slot(&mut self, id: CacheId) -> Option<Slot> {
        if let Some(&slot) = self.slots.get(&id) {
            return Some(slot);
        }
        let slot = Slot::try_from(self.caches.len())
            .ok()
            .filter(|&s| s < Slot::MAX)?;
        self.caches.push(Cache::new(id, self.home_depth));
        self.slots.insert(id, slot);
        Some(slot)
    }

    /// Apply one event of one worker, without a capacity bound.
    pub fn apply(&mut self, worker: WorkerId, event: &KvEvent) -> ApplyOutcome {
        self.apply_within(worker, event, usize::MAX)
    }

    /// Apply one event of one worker whose caches hold at most `capacity` blocks each: a store
    /// beyond it drops the cache's oldest blocks.
    pub fn apply_within(
        &mut self,
        worker: WorkerId,
        event: &KvEvent,
        capacity: usize,
    ) -> ApplyOutcome {
        let mut out = ApplyOutcome::default();
        let Some(slot) = self.slot(CacheId {
            worker,
            dp_rank: event.dp_rank,
        }) else {
            out.too_many_caches = true;
            return out;
        };
        match &event.kind {
            KvEventKind::Stored { parent, blocks } => {
                let Cache {
                    blocks: cache,
                    digest,
                    homes,
                    ..
                } = &mut self.caches[slot as usize];
                let mut prefix = match parent {
                    None => None,
                    Some(p) => {
                        let Some(prefix) = cache.get(*p) else {
                            out.orphan = true;
                            return out;
                        };
                        Some(prefix)
                    }
                };
                let mut up = *parent;
                let stored: Vec<Entry> = blocks
                    .iter()
                    .map(|b| {
                        let node = chain(prefix, b.local_hash);
                        prefix = Some(node);
                        let entry = Entry::new(b.engine_hash, node, up);
                        up = Some(b.engine_hash);
                        entry
                    })
                    .collect();
                // Deepest first: the leaf is the least recently used of the new blocks.
                for entry in stored.iter().rev() {
                    let (engine, node) = (entry.engine, entry.node);
                    // An engine hash stored again for other tokens (a hash reused after a
                    // removal we missed): the old node is no longer held through it.
                    match cache.insert(*entry) {
                        Some(old) if old == node => {}
                        Some(old) => {
                            self.holders.unhold(old, slot);
                            *digest = digest
                                .wrapping_sub(entry_digest(engine, old))
                                .wrapping_add(entry_digest(engine, node));
                        }
                        None => {
                            *digest = digest.wrapping_add(entry_digest(engine, node));
                        }
                    }
                    self.holders.hold(node, slot);
                    out.stored += 1;
                }
                homes.stored(*parent, blocks.iter().map(|b| b.engine_hash));
                if let Some(p) = parent {
                    cache.touch(*p);
                }
                out.evicted = self.evict(slot, capacity);
            }
            KvEventKind::Removed { blocks } => {
                for h in blocks {
                    let cache = &mut self.caches[slot as usize];
                    match cache.blocks.remove(*h) {
                        Some(node) => {
                            cache.digest = cache.digest.wrapping_sub(entry_digest(*h, node));
                            cache.homes.removed(*h);
                            self.holders.unhold(node, slot);
                            out.removed += 1;
                        }
                        None => out.unknown_removals += 1,
                    }
                }
            }
            KvEventKind::Cleared => out.removed = self.clear_cache(slot),
        }
        out
    }

    /// Drop the blocks its engine would evict first from a cache over `capacity`, down to a
    /// 64th below it: ranking them is a pass over the cache, made once per that many stores
    /// rather than on each one while removals are being lost.
    fn evict(&mut self, slot: Slot, capacity: usize) -> usize {
        let cache = &mut self.caches[slot as usize];
        let Some(over) = cache.blocks.len().checked_sub(capacity).filter(|&n| n > 0) else {
            return 0;
        };
        let victims = cache.blocks.victims(over + capacity / 64);
        for engine in &victims {
            if let Some(node) = cache.blocks.remove(*engine) {
                cache.digest = cache.digest.wrapping_sub(entry_digest(*engine, node));
                cache.homes.removed(*engine);
                self.holders.unhold(node, slot);
            }
        }
        victims.len()
    }

    fn clear_cache(&mut self, slot: Slot) -> usize {
        let cache = &mut self.caches[slot as usize];
        cache.digest = 0;
        cache.homes.clear();
        let blocks = std::mem::take(&mut cache.blocks);
        for Entry { node, .. } in blocks.iter() {
            self.holders.unhold(node, slot);
        }
        blocks.len()
    }

    /// Forget everything a worker holds (all its ranks); returns the blocks dropped.
    pub fn remove_worker(&mut self, worker: WorkerId) -> usize {
        let slots: Vec<Slot> = self
            .slots
            .iter()
            .filter(|(id, _)| id.worker == worker)
            .map(|(_, &s)| s)
            .collect();
        slots.into_iter().map(|s| self.clear_cache(s)).sum()
    }

    /// The workers holding the longest prefixes of `hashes`, best first, in tiers: every worker
    /// at the deepest depth, then every worker at the next depth, … until at least `limit`
    /// workers are found (a tier is never cut). Each with the number of leading blocks it holds.
    pub fn find_matches(&self, hashes: &[PrefixHash], limit: usize) -> Vec<(WorkerId, u32)> {
        let mut found: Vec<(WorkerId, u32)> = Vec::new();
        let is_new = |slot: &Slot, found: &[(WorkerId, u32)]| {
            let w = self.caches[*slot as usize].id.worker;
            !found.iter().any(|(f, _)| *f == w)
        };
        // Depths below `end` may still hold a worker not found yet.
        let mut end = hashes.len();
        while found.len() < limit.max(1) && end > 0 {
            let has_new = |d: usize, found: &[(WorkerId, u32)]| {
                self.holders
                    .get(hashes[d])
                    .is_some_and(|h| h.iter().any(|s| is_new(s, found)))
            };
            if !has_new(0, &found) {
                break;
            }
            // Invariant: has_new(lo) holds, has_new(hi) does not (or hi == end).
            let (mut lo, mut hi) = (0, end);
            while lo + 1 < hi {
                let mid = lo + (hi - lo) / 2;
                if has_new(mid, &found) {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            // The tier is written in place: a worker's second rank is no longer new once
            // its first is in.
            let tier = found.len();
            for s in self.holders.get(hashes[lo]).unwrap_or_default() {
                if is_new(s, &found) {
                    found.push((self.caches[*s as usize].id.worker, lo as u32 + 1));
                }
            }
            found[tier..].sort_unstable();
            end = lo + 1;
        }
        found
    }

    /// A cache's entries, least recently used first: what a peer needs to hold exactly the
    /// same and evict as this one would.
    pub fn snapshot(&self, cache: CacheId) -> Vec<Entry> {
        let Some(&slot) = self.slots.get(&cache) else {
            return Vec::new();
        };
        self.caches[slot as usize].blocks.iter().collect()
    }

    /// Replace a cache's entries with a snapshot (least recently used first), as a peer holds
    /// them; returns the blocks it holds now. `None` past the index's 65,535 caches.
    pub fn install(&mut self, cache: CacheId, entries: &[Entry]) -> Option<usize> {
        let slot = self.slot(cache)?;
        self.clear_cache(slot);
        for &entry in entries {
            let (engine, node) = (entry.engine, entry.node);
            let c = &mut self.caches[slot as usize];
            match c.blocks.insert(entry) {
                Some(old) if old == node => continue,
                Some(old) => {
                    c.digest = c.digest.wrapping_sub(entry_digest(engine, old));
                    self.holders.unhold(old, slot);
                }
                None => {}
            }
            let c = &mut self.caches[slot as usize];
            c.digest = c.digest.wrapping_add(entry_digest(engine, node));
            self.holders.hold(node, slot);
        }
        self.caches[slot as usize].homes.rebuild(entries);
        Some(self.caches[slot as usize].blocks.len())
    }

    /// A cache's block count and digest (`(0, 0)` for a cache never seen).
    pub fn cache_state(&self, cache: CacheId) -> (usize, u64) {
        self.slots.get(&cache).map_or((0, 0), |&s| {
            let c = &self.caches[s as usize];
            (c.blocks.len(), c.digest)
        })
    }

    /// Blocks held by one worker (all ranks).
    pub fn blocks_of(&self, worker: WorkerId) -> usize {
        self.caches
            .iter()
            .filter(|c| c.id.worker == worker)
            .map(|c| c.blocks.len())
            .sum()
    }

    /// Per cache, its worker and the prefixes of the home depth it holds: the cold prompts
    /// it is home to, as every replica's index says once they agree.
    pub fn homes(&self) -> impl Iterator<Item = (WorkerId, usize)> + '_ {
        self.caches.iter().map(|c| (c.id.worker, c.homes.count()))
    }

    /// Whether some cache of `worker` holds `node`.
    pub fn holds(&self, worker: WorkerId, node: PrefixHash) -> bool {
        self.holders.get(node).is_some_and(|slots| {
            slots
                .iter()
                .any(|&s| self.caches[s as usize].id.worker == worker)
        })
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
    use crate::core::event::StoredBlock;
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
        assert_eq!(idx.find_matches(&q, 8), vec![(W0, 6), (W1, 2)]);
        assert_eq!(idx.find_matches(&q[..1], 8), vec![(W0, 1), (W1, 1)]);
        // A different first block matches nothing, even if later tokens agree.
        let mut other = locals(1000, 1);
        other.extend_from_slice(&a[1..]);
        assert!(idx.find_matches(&prefix_hashes(&other), 8).is_empty());
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
        assert_eq!(idx.find_matches(&prefix_hashes(&a), 8), vec![(W0, 4)]);
    }

    /// An engine hash stored again for other tokens leaves no match behind for the old ones.
    #[test]
    fn a_restored_engine_hash_moves_its_holder() {
        let mut idx = RadixIndex::default();
        let (a, b) = (locals(0, 1), locals(100, 1));
        idx.apply(W0, &stored(None, &a, 0));
        let reused = KvEvent {
            dp_rank: 0,
            kind: KvEventKind::Stored {
                parent: None,
                blocks: vec![StoredBlock {
                    engine_hash: EngineHash(a[0].0),
                    local_hash: b[0],
                }],
            },
        };
        idx.apply(W0, &reused);
        assert!(
            idx.find_matches(&prefix_hashes(&a), 8).is_empty(),
            "stale match"
        );
        assert_eq!(idx.find_matches(&prefix_hashes(&b), 8), vec![(W0, 1)]);
        assert_eq!(idx.len(), 1);
        assert_eq!(idx.blocks_of(W0), 1);
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
    fn tail_removal_shortens_the_match() {
        let mut idx = RadixIndex::default();
        let a = locals(0, 4);
        idx.apply(W0, &stored(None, &a, 3));
        let removed = |hashes: Vec<u64>| KvEvent {
            dp_rank: 0,
            kind: KvEventKind::Removed {
                blocks: hashes.into_iter().map(EngineHash).collect(),
            },
        };
        let out = idx.apply(W0, &removed(vec![a[3].0 ^ 3, a[2].0 ^ 3, 999]));
        assert_eq!((out.removed, out.unknown_removals), (2, 1));
        assert_eq!(idx.find_matches(&prefix_hashes(&a), 8), vec![(W0, 2)]);
        assert_eq!(idx.blocks_of(W0), 2);
    }

    #[test]
    fn a_gap_from_lost_events_overestimates_but_never_fails() {
        // Engines evict tail first; a hole in the middle only comes from lost events. The
        // binary search then reports the deepest block held (documented in the module docs).
        let mut idx = RadixIndex::default();
        let a = locals(0, 4);
        idx.apply(W0, &stored(None, &a, 3));
        let hole = KvEvent {
            dp_rank: 0,
            kind: KvEventKind::Removed {
                blocks: vec![EngineHash(a[1].0 ^ 3)],
            },
        };
        idx.apply(W0, &hole);
        assert_eq!(idx.find_matches(&prefix_hashes(&a), 8), vec![(W0, 4)]);
    }

    #[test]
    fn tiers_stop_at_the_limit_but_keep_ties() {
        let mut idx = RadixIndex::default();
        let a = locals(0, 6);
        for (w, n) in [(0, 6), (1, 4), (2, 4), (3, 2), (4, 1)] {
            idx.apply(WorkerId(w), &stored(None, &a[..n], u64::from(w)));
        }
        let q = prefix_hashes(&a);
        let w = WorkerId;
        assert_eq!(idx.find_matches(&q, 1), vec![(w(0), 6)]);
        assert_eq!(
            idx.find_matches(&q, 2),
            vec![(w(0), 6), (w(1), 4), (w(2), 4)]
        );
        assert_eq!(
            idx.find_matches(&q, 8),
            vec![(w(0), 6), (w(1), 4), (w(2), 4), (w(3), 2), (w(4), 1)]
        );
        assert!(idx.find_matches(&[], 8).is_empty());
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
        assert_eq!(idx.find_matches(&prefix_hashes(&a), 8), vec![(W0, 3)]);
        assert_eq!(idx.remove_worker(W0), 6);
        assert!(idx.is_empty());
        assert!(idx.find_matches(&prefix_hashes(&a), 8).is_empty());
    }

    #[test]
    fn ranks_count_separately_but_report_per_worker() {
        let mut idx = RadixIndex::default();
        let a = locals(0, 3);
        idx.apply(W0, &stored(None, &a[..1], 1));
        let mut rank1 = stored(None, &a, 2);
        rank1.dp_rank = 1;
        idx.apply(W0, &rank1);
        assert_eq!(idx.find_matches(&prefix_hashes(&a), 8), vec![(W0, 3)]);
    }

    /// Past its capacity a cache loses its least recently used blocks, leaves first: a prefix
    /// extended since is used, whenever it was stored.
    #[test]
    fn a_cache_over_capacity_drops_its_least_recently_used_leaves() {
        let mut idx = RadixIndex::default();
        let (a, b, c) = (locals(0, 3), locals(100, 3), locals(200, 2));
        idx.apply_within(W0, &stored(None, &a, 1), 6);
        idx.apply_within(W0, &stored(None, &b, 1), 6);
        // a[2] removed and stored again under a[1]: all of a is now used more lately than b.
        let removed = KvEvent {
            dp_rank: 0,
            kind: KvEventKind::Removed {
                blocks: vec![EngineHash(a[2].0 ^ 1)],
            },
        };
        idx.apply_within(W0, &removed, 6);
        let again = stored(Some(a[1].0 ^ 1), &a[2..], 1);
        assert_eq!(idx.apply_within(W0, &again, 6).evicted, 0);
        let out = idx.apply_within(W0, &stored(None, &c, 1), 6);
        assert_eq!(out.evicted, 2, "b's two deepest blocks");
        assert_eq!(idx.blocks_of(W0), 6);
        assert_eq!(idx.find_matches(&prefix_hashes(&a), 8), vec![(W0, 3)]);
        assert_eq!(idx.find_matches(&prefix_hashes(&b), 8), vec![(W0, 1)]);
        assert_eq!(idx.find_matches(&prefix_hashes(&c), 8), vec![(W0, 2)]);
        // Another worker's cache is bounded on its own.
        assert_eq!(idx.apply_within(W1, &stored(None, &c, 2), 1).evicted, 1);
        assert_eq!(idx.blocks_of(W0), 6);
    }

    /// The incident the bound exists for: removals lost, a cache over capacity. A system
    /// prompt that every conversation extends survives; the conversations' tails go.
    #[test]
    fn a_shared_system_prompt_survives_lost_removals() {
        let mut idx = RadixIndex::default();
        let system = locals(0, 4);
        idx.apply_within(W0, &stored(None, &system, 1), 12);
        let top = Some(system[3].0 ^ 1);
        for turn in 0..20u32 {
            let conversation = locals(1000 + 100 * turn, 2);
            idx.apply_within(W0, &stored(top, &conversation, 1), 12);
            assert_eq!(idx.blocks_of(W0), (6 + 2 * turn as usize).min(12));
        }
        assert_eq!(
            idx.find_matches(&prefix_hashes(&system), 8),
            vec![(W0, 4)],
            "the shared prefix is the last to go"
        );
        let mut last = system.clone();
        last.extend(locals(1000 + 100 * 19, 2));
        assert_eq!(idx.find_matches(&prefix_hashes(&last), 8), vec![(W0, 6)]);
    }

    /// The digest depends on what a cache holds, not on the order it was stored in nor on
    /// what came and went.
    #[test]
    fn cache_digests_depend_on_content_only() {
        let (a, b) = (locals(0, 3), locals(100, 2));
        let cache = CacheId {
            worker: W0,
            dp_rank: 0,
        };
        let mut one = RadixIndex::default();
        one.apply(W0, &stored(None, &a, 1));
        one.apply(W0, &stored(None, &b, 1));
        let mut two = RadixIndex::default();
        two.apply(W0, &stored(None, &b, 1));
        two.apply(W0, &stored(None, &a, 1));
        two.apply(W0, &stored(None, &locals(500, 2), 1));
        let gone = KvEvent {
            dp_rank: 0,
            kind: KvEventKind::Removed {
                blocks: locals(500, 2).iter().map(|l| EngineHash(l.0 ^ 1)).collect(),
            },
        };
        two.apply(W0, &gone);
        assert_eq!(one.cache_state(cache), two.cache_state(cache));
        assert_eq!(one.cache_state(cache).0, 5);
        two.apply(W0, &stored(None, &locals(900, 1), 1));
        assert_ne!(one.cache_state(cache).1, two.cache_state(cache).1);
        two.apply(
            W0,
            &KvEvent {
                dp_rank: 0,
                kind: KvEventKind::Cleared,
            },
        );
        assert_eq!(two.cache_state(cache), (0, 0));
    }

    /// A snapshot installed elsewhere holds the same blocks, digest, matches and homes.
    #[test]
    fn a_snapshot_installs_the_same_cache() {
        let cache = CacheId {
            worker: W0,
            dp_rank: 0,
        };
        let (a, b) = (locals(0, 4), locals(100, 2));
        let homes = |idx: &RadixIndex| idx.homes().map(|(_, n)| n).sum::<usize>();
        let mut one = RadixIndex::new(3);
        one.apply(W0, &stored(None, &a, 1));
        one.apply(W0, &stored(Some(a[1].0 ^ 1), &b, 1));
        assert_eq!(homes(&one), 2, "a's third block and b's first, three deep");
        let snap = one.snapshot(cache);
        assert_eq!(snap.len(), 6);
        let mut two = RadixIndex::new(3);
        two.apply(W0, &stored(None, &locals(900, 3), 1));
        assert_eq!(homes(&two), 1);
        assert_eq!(two.install(cache, &snap), Some(6));
        assert_eq!(one.cache_state(cache), two.cache_state(cache));
        assert_eq!(homes(&two), 2);
        let removed = KvEvent {
            dp_rank: 0,
            kind: KvEventKind::Removed {
                blocks: vec![EngineHash(a[3].0 ^ 1), EngineHash(a[2].0 ^ 1)],
            },
        };
        one.apply(W0, &removed);
        assert_eq!(homes(&one), 1);
        assert_eq!(one.remove_worker(W0), 4);
        assert_eq!(homes(&one), 0);
        assert_eq!(two.find_matches(&prefix_hashes(&a), 8), vec![(W0, 4)]);
        assert!(two
            .find_matches(&prefix_hashes(&locals(900, 3)), 8)
            .is_empty());
        // The continuation still finds its parent by engine hash.
        let more = two.apply(W0, &stored(Some(b[1].0 ^ 1), &locals(300, 1), 1));
        assert!(!more.orphan);
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
