//! [`BlockMap`]: one cache's blocks — engine hash → node — in the order they were stored.
//!
//! The index needs both a lookup by engine hash (events name parents and removals that way)
//! and the store order (a cache over its capacity drops its oldest blocks first). A hash map
//! beside a queue of engine hashes would hold each key twice and double both on growth (42
//! bytes an entry at 10M entries, measured). Here the entries themselves are the queue (16
//! bytes each, grown by a quarter at a time) and the hash table holds only an entry's 4-byte
//! store number (5 bytes a bucket with its control byte). A removed entry stays in the queue,
//! dead, until the oldest blocks are dropped past it or the dead are a third of the queue.

use std::collections::VecDeque;
use std::hash::BuildHasher;

use hashbrown::hash_table::Entry;
use hashbrown::HashTable;
use kvroute_protocol::PrefixHash;

use crate::core::event::EngineHash;

/// The entry with store number `number` of a queue whose first entry is numbered `first`.
fn entry_at(
    entries: &VecDeque<(EngineHash, PrefixHash)>,
    first: u32,
    number: u32,
) -> &(EngineHash, PrefixHash) {
    &entries[number.wrapping_sub(first) as usize]
}

/// One cache's (engine hash, node) entries in store order, oldest first.
#[derive(Debug, Default)]
pub struct BlockMap {
    /// Entries in store order, live and dead.
    entries: VecDeque<(EngineHash, PrefixHash)>,
    /// The store number of each live entry: `first` plus its place in `entries` (wrapping).
    live: HashTable<u32>,
    /// Store number of `entries[0]`.
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

    fn at(&self, number: u32) -> &(EngineHash, PrefixHash) {
        entry_at(&self.entries, self.first, number)
    }

    fn number_of(&self, engine: EngineHash) -> Option<u32> {
        self.live
            .find(self.hash(engine), |&n| self.at(n).0 == engine)
            .copied()
    }

    fn is_live(&self, number: u32, engine: EngineHash) -> bool {
        self.live
            .find(self.hash(engine), |&n| n == number)
            .is_some()
    }

    /// The node an engine hash names in this cache.
    pub fn get(&self, engine: EngineHash) -> Option<PrefixHash> {
        self.number_of(engine).map(|n| self.at(n).1)
    }

    /// Store `engine` → `node` as the newest entry; returns the node it named before. Storing
    /// the same pair again changes nothing, its place in the order included.
    pub fn insert(&mut self, engine: EngineHash, node: PrefixHash) -> Option<PrefixHash> {
        if self.entries.len() == self.entries.capacity() {
            self.entries.reserve_exact((self.entries.len() / 4).max(16));
        }
        let number = self.first.wrapping_add(self.entries.len() as u32);
        let (entries, first, hasher) = (&self.entries, self.first, &self.hasher);
        let at = |n: u32| entry_at(entries, first, n);
        let old = match self.live.entry(
            hasher.hash_one(engine.0),
            |&n| at(n).0 == engine,
            |&n| hasher.hash_one(at(n).0 .0),
        ) {
            Entry::Occupied(found) => {
                let old = at(*found.get()).1;
                if old == node {
                    return Some(node);
                }
                *found.into_mut() = number;
                Some(old)
            }
            Entry::Vacant(vacant) => {
                vacant.insert(number);
                None
            }
        };
        self.entries.push_back((engine, node));
        if old.is_some() {
            self.compact();
        }
        old
    }

    /// Remove an engine hash; returns the node it named.
    pub fn remove(&mut self, engine: EngineHash) -> Option<PrefixHash> {
        let (entries, first) = (&self.entries, self.first);
        let at = |n: u32| entry_at(entries, first, n);
        let found = self
            .live
            .find_entry(self.hasher.hash_one(engine.0), |&n| at(n).0 == engine)
            .ok()?;
        let node = at(*found.get()).1;
        found.remove();
        self.compact();
        Some(node)
    }

    /// Remove and return the oldest live entry.
    pub fn pop_oldest(&mut self) -> Option<(EngineHash, PrefixHash)> {
        while let Some(entry) = self.entries.pop_front() {
            let number = self.first;
            self.first = self.first.wrapping_add(1);
            let hash = self.hash(entry.0);
            if let Ok(found) = self.live.find_entry(hash, |&n| n == number) {
                found.remove();
                return Some(entry);
            }
        }
        None
    }

    /// Live entries in store order, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = (EngineHash, PrefixHash)> + '_ {
        self.entries
            .iter()
            .zip(0u32..)
            .filter(|(e, i)| self.is_live(self.first.wrapping_add(*i), e.0))
            .map(|(e, _)| *e)
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
        let kept: VecDeque<(EngineHash, PrefixHash)> = self.iter().collect();
        let mut table = HashTable::with_capacity(kept.len());
        for (number, e) in (0u32..).zip(&kept) {
            let hasher = &self.hasher;
            table.insert_unique(self.hash(e.0), number, |&m| {
                hasher.hash_one(entry_at(&kept, 0, m).0 .0)
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

    #[test]
    fn entries_come_out_in_store_order() {
        let mut m = BlockMap::default();
        for i in 0..5 {
            assert_eq!(m.insert(e(i), p(i + 100)), None);
        }
        assert_eq!(m.remove(e(1)), Some(p(101)));
        assert_eq!(m.remove(e(1)), None);
        assert_eq!(m.get(e(3)), Some(p(103)));
        assert_eq!(m.get(e(1)), None);
        let order: Vec<u64> = m.iter().map(|(h, _)| h.0).collect();
        assert_eq!(order, vec![0, 2, 3, 4]);
        assert_eq!(m.pop_oldest(), Some((e(0), p(100))));
        assert_eq!(
            m.pop_oldest(),
            Some((e(2), p(102))),
            "the dead entry is skipped"
        );
        assert_eq!(m.len(), 2);
        // Removed and stored again, a hash goes out at its new place, not its old one.
        m.remove(e(3));
        m.insert(e(3), p(103));
        assert_eq!(m.pop_oldest(), Some((e(4), p(104))));
        assert_eq!(m.pop_oldest(), Some((e(3), p(103))));
    }

    /// A hash stored again for another node is the newest entry; stored again for the same
    /// node it keeps its place.
    #[test]
    fn storing_again_moves_only_a_changed_entry() {
        let mut m = BlockMap::default();
        for i in 0..3 {
            m.insert(e(i), p(i));
        }
        assert_eq!(m.insert(e(0), p(0)), Some(p(0)));
        assert_eq!(m.insert(e(1), p(9)), Some(p(1)));
        assert_eq!(m.len(), 3);
        let order: Vec<(EngineHash, PrefixHash)> = m.iter().collect();
        assert_eq!(order, vec![(e(0), p(0)), (e(2), p(2)), (e(1), p(9))]);
        assert_eq!(m.pop_oldest(), Some((e(0), p(0))));
        assert_eq!(m.pop_oldest(), Some((e(2), p(2))));
        assert_eq!(m.pop_oldest(), Some((e(1), p(9))));
        assert_eq!(m.pop_oldest(), None);
        assert!(m.is_empty());
    }

    /// Removed and re-stored hashes never let the queue grow past half again the live entries,
    /// and what stays live stays findable and in order.
    #[test]
    fn dead_entries_are_compacted_away() {
        let mut m = BlockMap::default();
        for i in 0..100 {
            m.insert(e(i), p(i));
        }
        for round in 0..10_000u64 {
            let h = e(round % 200);
            m.remove(h);
            m.insert(h, p(round));
            assert!(m.held() <= m.len() + m.len() / 2 + 65, "{}", m.held());
        }
        for i in 0..200 {
            assert!(m.get(e(i)).is_some(), "{i}");
        }
        let order: Vec<PrefixHash> = m.iter().map(|(_, n)| n).collect();
        assert!(
            order.windows(2).all(|w| w[0].0 < w[1].0),
            "store order kept"
        );
    }

    /// The store numbers wrap without losing an entry.
    #[test]
    fn store_numbers_wrap() {
        let mut m = BlockMap {
            first: u32::MAX - 2,
            ..BlockMap::default()
        };
        for i in 0..6 {
            m.insert(e(i), p(i));
        }
        assert_eq!(m.get(e(5)), Some(p(5)));
        assert_eq!(m.remove(e(4)), Some(p(4)));
        let order: Vec<u64> = m.iter().map(|(h, _)| h.0).collect();
        assert_eq!(order, vec![0, 1, 2, 3, 5]);
        assert_eq!(m.pop_oldest(), Some((e(0), p(0))));
    }
}
