//! [`BlockMap`]: one cache's blocks — engine hash → node and parent — and which of them the
//! engine would evict first.
//!
//! Engines evict the least recently used blocks, leaves first: a request's blocks go back to
//! the free queue tail first, and a prefix many requests share is used by each of them, so it
//! is the last to go. The events say when a block is stored and under which parent, not when a
//! cached block is hit; a store under a parent is the nearest sign that the whole prefix was
//! just used. So the map keeps each block's own last use (stored, or the parent of a store) as
//! its place in a queue — O(1) per event — and only when blocks must go
//! ([`BlockMap::victims`]: removals were lost and the cache is over its engine's capacity) does
//! it work out each block's last use through its descendants, in one pass over the cache.
//!
//! The index needs both a lookup by engine hash (events name parents and removals that way)
//! and that order. A hash map beside a queue of engine hashes would hold each key twice and
//! double both on growth. Here the entries themselves are the queue (20 bytes each: the parent
//! is named by a 4-byte [`Tag`] of its engine hash; grown by a quarter at a time) and the hash table holds only an entry's 4-byte number (5 bytes a bucket
//! with its control byte). A moved or removed entry leaves a dead copy in the queue until the
//! dead are a third of the queue.

use std::collections::VecDeque;
use std::hash::BuildHasher;

use hashbrown::hash_table::Entry as Slot;
use hashbrown::HashTable;
use kvroute_protocol::PrefixHash;

use crate::core::event::EngineHash;

/// A block's parent as an entry names it: 4 bytes of its engine hash. It is only followed to
/// rank blocks for eviction, where two blocks of one cache with the same tag (one chance in
/// 2³² per pair) make one of them look used a little more lately: a worse guess at what the
/// engine evicts, never a wrong match.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tag(pub u32);

impl Tag {
    /// The tag of an engine hash.
    pub fn of(engine: EngineHash) -> Self {
        Tag((engine.0 ^ (engine.0 >> 32)) as u32)
    }
}

/// One block of a cache: its engine hash, its node, and its parent's tag (`None` for a root
/// block).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// The engine's name for the block.
    pub engine: EngineHash,
    /// The block's node in the index (its prefix hash).
    pub node: PrefixHash,
    /// The block before it, if any.
    pub parent: Option<Tag>,
}

impl Entry {
    /// A block of `node` stored as `engine` under `parent`.
    pub fn new(engine: EngineHash, node: PrefixHash, parent: Option<EngineHash>) -> Self {
        Entry {
            engine,
            node,
            parent: parent.map(Tag::of),
        }
    }
}

/// An entry as the queue stores it, 20 bytes: a root block's parent tag is its own (no block
/// is its own parent), which saves `Option`'s bytes.
#[derive(Debug, Clone, Copy)]
#[repr(C, packed(4))]
struct Packed {
    engine: u64,
    node: u64,
    parent: u32,
}

impl Packed {
    fn new(e: Entry) -> Self {
        Packed {
            engine: e.engine.0,
            node: e.node.0,
            parent: e.parent.unwrap_or(Tag::of(e.engine)).0,
        }
    }

    fn engine(&self) -> EngineHash {
        EngineHash(self.engine)
    }

    fn entry(&self) -> Entry {
        let engine = self.engine();
        let parent = Tag(self.parent);
        Entry {
            engine,
            node: PrefixHash(self.node),
            parent: (parent != Tag::of(engine)).then_some(parent),
        }
    }
}

/// The entry numbered `number` of a queue whose first entry is numbered `first`.
fn entry_at(entries: &VecDeque<Packed>, first: u32, number: u32) -> &Packed {
    &entries[number.wrapping_sub(first) as usize]
}

/// One cache's entries, by their own last use.
#[derive(Debug, Default)]
pub struct BlockMap {
    /// Entries, live and dead, by their own last use, oldest first.
    entries: VecDeque<Packed>,
    /// The number of each live entry: `first` plus its place in `entries` (wrapping).
    live: HashTable<u32>,
    /// Number of `entries[0]`.
    first: u32,
    /// Engine hashes are chosen by whoever publishes events: a seeded hasher.
    hasher: foldhash::fast::RandomState,
}

impl BlockMap {
    /// Live entries.
    pub fn len(&self) -> usize {
        self.live.len()
    }

    /// Whether no entry is live.
    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    fn hash(&self, engine: EngineHash) -> u64 {
        self.hasher.hash_one(engine.0)
    }

    fn at(&self, number: u32) -> &Packed {
        entry_at(&self.entries, self.first, number)
    }

    fn number_of(&self, engine: EngineHash) -> Option<u32> {
        self.live
            .find(self.hash(engine), |&n| self.at(n).engine() == engine)
            .copied()
    }

    fn is_live(&self, number: u32, engine: EngineHash) -> bool {
        self.live
            .find(self.hash(engine), |&n| n == number)
            .is_some()
    }

    /// The node an engine hash names in this cache.
    pub fn get(&self, engine: EngineHash) -> Option<PrefixHash> {
        self.number_of(engine).map(|n| PrefixHash(self.at(n).node))
    }

    /// Store `entry` as the most recently used; returns the node its engine hash named before.
    pub fn insert(&mut self, entry: Entry) -> Option<PrefixHash> {
        if self.entries.len() == self.entries.capacity() {
            self.entries.reserve_exact((self.entries.len() / 4).max(16));
        }
        let number = self.first.wrapping_add(self.entries.len() as u32);
        let (entries, first, hasher) = (&self.entries, self.first, &self.hasher);
        let at = |n: u32| entry_at(entries, first, n);
        let old = match self.live.entry(
            hasher.hash_one(entry.engine.0),
            |&n| at(n).engine() == entry.engine,
            |&n| hasher.hash_one(at(n).engine),
        ) {
            Slot::Occupied(found) => {
                let old = PrefixHash(at(*found.get()).node);
                *found.into_mut() = number;
                Some(old)
            }
            Slot::Vacant(vacant) => {
                vacant.insert(number);
                None
            }
        };
        self.entries.push_back(Packed::new(entry));
        if old.is_some() {
            self.compact();
        }
        old
    }

    /// A block was the parent of a store: it is the most recently used (its ancestors with
    /// it, which [`BlockMap::victims`] works out when it is needed).
    pub fn touch(&mut self, engine: EngineHash) {
        let Some(number) = self.number_of(engine) else {
            return;
        };
        let newest = self.first.wrapping_add(self.entries.len() as u32 - 1);
        if number != newest {
            let entry = self.at(number).entry();
            self.insert(entry);
        }
    }

    /// The `n` blocks the engine would evict first: least recently used, a block used when any
    /// of its descendants was, leaves first among blocks last used together. One pass over the
    /// cache, then a partial sort: O(len) plus O(n log n).
    pub fn victims(&self, n: usize) -> Vec<EngineHash> {
        let live: Vec<Entry> = self.iter().collect();
        if n == 0 || live.is_empty() {
            return Vec::new();
        }
        // A tag two blocks share names the more recently used of them.
        let at: std::collections::HashMap<Tag, usize> = live
            .iter()
            .enumerate()
            .map(|(i, e)| (Tag::of(e.engine), i))
            .collect();
        // (last use through descendants, steps up from the block that used it last).
        let mut used: Vec<(usize, usize)> = (0..live.len()).map(|i| (i, 0)).collect();
        // Newest first: the first descendant to reach an ancestor is its latest use, so each
        // ancestor is raised once and a walk stops where one was (cycles included).
        for i in (0..live.len()).rev() {
            let (when, _) = used[i];
            let mut steps = used[i].1;
            let mut up = live[i].parent.and_then(|p| at.get(&p).copied());
            while let Some(j) = up {
                if used[j].0 >= when {
                    break;
                }
                steps += 1;
                used[j] = (when, steps);
                up = live[j].parent.and_then(|p| at.get(&p).copied());
            }
        }
        let mut order: Vec<usize> = (0..live.len()).collect();
        let n = n.min(order.len());
        let key = |&i: &usize| used[i];
        if n < order.len() {
            order.select_nth_unstable_by_key(n, key);
            order.truncate(n);
        }
        order.sort_unstable_by_key(key);
        order.into_iter().map(|i| live[i].engine).collect()
    }

    /// Remove an engine hash; returns the node it named.
    pub fn remove(&mut self, engine: EngineHash) -> Option<PrefixHash> {
        let (entries, first) = (&self.entries, self.first);
        let at = |n: u32| entry_at(entries, first, n);
        let found = self
            .live
            .find_entry(self.hasher.hash_one(engine.0), |&n| {
                at(n).engine() == engine
            })
            .ok()?;
        let node = PrefixHash(at(*found.get()).node);
        found.remove();
        self.compact();
        Some(node)
    }

    /// Live entries, by their own last use, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = Entry> + '_ {
        self.entries
            .iter()
            .zip(0u32..)
            .filter(|(e, i)| self.is_live(self.first.wrapping_add(*i), e.engine()))
            .map(|(e, _)| e.entry())
    }

    /// Entries held, live and dead (what the queue costs).
    #[cfg(test)]
    fn held(&self) -> usize {
        self.entries.len()
    }

    /// Drop the dead entries once they are a third of the queue: amortised O(1) per removal.
    fn compact(&mut self) {
        let live = self.live.len();
        if self.entries.len() <= live + live / 2 + 64 {
            return;
        }
        let kept: VecDeque<Packed> = self
            .entries
            .iter()
            .zip(0u32..)
            .filter(|(e, i)| self.is_live(self.first.wrapping_add(*i), e.engine()))
            .map(|(e, _)| *e)
            .collect();
        let mut table = HashTable::with_capacity(kept.len());
        for (number, e) in (0u32..).zip(&kept) {
            let hasher = &self.hasher;
            table.insert_unique(self.hash(e.engine()), number, |&m| {
                hasher.hash_one(entry_at(&kept, 0, m).engine)
            });
        }
        self.entries = kept;
        self.live = table;
        self.first = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(n: u64) -> EngineHash {
        EngineHash(n)
    }

    fn p(n: u64) -> PrefixHash {
        PrefixHash(n)
    }

    /// A root block `n` (node `n + 100`).
    fn root(n: u64) -> Entry {
        Entry::new(e(n), p(n + 100), None)
    }

    /// Block `n` under `parent`.
    fn child(n: u64, parent: u64) -> Entry {
        Entry::new(e(n), p(n + 100), Some(e(parent)))
    }

    fn order(m: &BlockMap) -> Vec<u64> {
        m.iter().map(|x| x.engine.0).collect()
    }

    fn victims(m: &BlockMap, n: usize) -> Vec<u64> {
        m.victims(n).into_iter().map(|x| x.0).collect()
    }

    #[test]
    fn entries_keep_their_own_last_use() {
        let mut m = BlockMap::default();
        for i in 0..5 {
            assert_eq!(m.insert(root(i)), None);
        }
        assert_eq!(m.remove(e(1)), Some(p(101)));
        assert_eq!(m.remove(e(1)), None);
        assert_eq!(m.get(e(3)), Some(p(103)));
        assert_eq!(m.get(e(1)), None);
        assert_eq!(order(&m), vec![0, 2, 3, 4]);
        m.touch(e(0));
        m.touch(e(77));
        assert_eq!(order(&m), vec![2, 3, 4, 0]);
        // Removed and stored again, a hash is at its new place, not its old one.
        m.remove(e(3));
        m.insert(root(3));
        assert_eq!(order(&m), vec![2, 4, 0, 3]);
        assert_eq!(victims(&m, 2), vec![2, 4]);
        assert_eq!(victims(&m, 9), vec![2, 4, 0, 3]);
    }

    /// A hash stored again is the most recently used, for the same node or another.
    #[test]
    fn storing_again_is_a_use() {
        let mut m = BlockMap::default();
        for i in 0..3 {
            m.insert(root(i));
        }
        assert_eq!(m.insert(root(0)), Some(p(100)));
        assert_eq!(m.insert(Entry::new(e(1), p(9), None)), Some(p(101)));
        assert_eq!(m.len(), 3);
        assert_eq!(order(&m), vec![2, 0, 1]);
        assert_eq!(m.get(e(1)), Some(p(9)));
    }

    /// A store under a prefix uses the whole prefix: the system prompt every conversation
    /// extends goes last, and what goes first is always a leaf.
    #[test]
    fn a_used_prefix_outlives_its_leaves() {
        let mut m = BlockMap::default();
        // A system prompt 0 → 1 → 2 (stored deepest first, as the index does), two
        // conversations under it, one more turn of the first; a stale root 9 from before.
        m.insert(root(9));
        m.insert(child(2, 1));
        m.insert(child(1, 0));
        m.insert(root(0));
        m.insert(child(10, 2));
        m.touch(e(2));
        m.insert(child(20, 2));
        m.touch(e(2));
        m.insert(child(11, 10));
        m.touch(e(10));
        assert_eq!(victims(&m, 7), vec![9, 20, 11, 10, 2, 1, 0]);
        // One more conversation under the prompt's first block only: 0 is used again.
        m.insert(child(30, 0));
        m.touch(e(0));
        assert_eq!(victims(&m, 8), vec![9, 20, 11, 10, 2, 1, 30, 0]);
    }

    /// A publisher whose parents form a cycle cannot hold the ranking.
    #[test]
    fn a_cycle_of_parents_ends() {
        let mut m = BlockMap::default();
        m.insert(child(1, 2));
        m.insert(child(2, 1));
        m.touch(e(1));
        assert_eq!(victims(&m, 2).len(), 2);
    }

    /// Moved and re-stored hashes never let the queue grow past half again the live entries,
    /// and what stays live stays findable.
    #[test]
    fn dead_entries_are_compacted_away() {
        let mut m = BlockMap::default();
        for i in 0..100 {
            m.insert(root(i));
        }
        for round in 0..10_000u64 {
            let h = round % 200;
            m.remove(e(h));
            m.insert(child(h, (h + 1) % 200));
            m.touch(e((h + 7) % 200));
            assert!(m.held() <= m.len() + m.len() / 2 + 65, "{}", m.held());
        }
        for i in 0..200 {
            assert!(m.get(e(i)).is_some(), "{i}");
        }
        assert_eq!(m.iter().count(), 200);
        assert_eq!(m.victims(500).len(), 200);
    }

    /// The numbers wrap without losing an entry.
    #[test]
    fn numbers_wrap() {
        let mut m = BlockMap {
            first: u32::MAX - 2,
            ..BlockMap::default()
        };
        for i in 0..6 {
            m.insert(root(i));
        }
        assert_eq!(m.get(e(5)), Some(p(105)));
        assert_eq!(m.remove(e(4)), Some(p(104)));
        assert_eq!(order(&m), vec![0, 1, 2, 3, 5]);
        m.touch(e(0));
        assert_eq!(order(&m), vec![1, 2, 3, 5, 0]);
    }
}
