//! [`Homes`]: how many distinct prefixes of the home depth one cache holds — the cold prompts
//! it became home to, counted from the KV events every replica reads.
//!
//! The home balance ([`crate::core::policy`]) passes over a worker that is home to more
//! prefixes than its share. Counted from each replica's own hints, replicas near the bound
//! named different homes for one prompt; counted from the index, they agree once their indexes
//! do. A block's depth is its parent's plus one, so only blocks down to the home depth are
//! kept (a few per prefix, not the cache): a store under a deeper or unknown parent is deeper.

use std::collections::{HashMap, HashSet};

use crate::core::block_map::{Entry, Tag};
use crate::core::event::EngineHash;

/// One cache's blocks down to the home depth, with their depth, and how many are at it.
#[derive(Debug, Default)]
pub struct Homes {
    /// The home depth (`home_key_blocks`); 0 counts nothing.
    depth: u8,
    /// Depth of each block held at most `depth` deep. Engine hashes are chosen by whoever
    /// publishes events: foldhash seeded per process, as the cache's own map.
    shallow: HashMap<EngineHash, u8, foldhash::fast::RandomState>,
    /// Blocks held exactly `depth` deep: the prefixes this cache is home to.
    at_depth: usize,
}

impl Homes {
    /// Counting prefixes `depth` blocks deep (at most 255; 0: none).
    pub fn new(depth: usize) -> Self {
        Homes {
            depth: u8::try_from(depth).unwrap_or(u8::MAX),
            ..Homes::default()
        }
    }

    /// Prefixes of the home depth held.
    pub fn count(&self) -> usize {
        self.at_depth
    }

    /// `blocks` were stored in order under `parent`.
    pub fn stored(
        &mut self,
        parent: Option<EngineHash>,
        blocks: impl IntoIterator<Item = EngineHash>,
    ) {
        if self.depth == 0 {
            return;
        }
        let mut depth = match parent {
            None => 0,
            Some(p) => match self.shallow.get(&p) {
                Some(&d) if d < self.depth => d,
                _ => return,
            },
        };
        for engine in blocks {
            depth += 1;
            self.set(engine, depth);
            if depth == self.depth {
                return;
            }
        }
    }

    fn set(&mut self, engine: EngineHash, depth: u8) {
        if let Some(old) = self.shallow.insert(engine, depth) {
            self.at_depth -= usize::from(old == self.depth);
        }
        self.at_depth += usize::from(depth == self.depth);
    }

    /// `engine` is no longer held.
    pub fn removed(&mut self, engine: EngineHash) {
        if let Some(old) = self.shallow.remove(&engine) {
            self.at_depth -= usize::from(old == self.depth);
        }
    }

    /// The cache was emptied.
    pub fn clear(&mut self) {
        self.shallow.clear();
        self.at_depth = 0;
    }

    /// Count again from a whole cache's entries (a peer's snapshot), which name parents by
    /// [`Tag`]: roots first, then their children, down to the home depth.
    pub fn rebuild(&mut self, entries: &[Entry]) {
        self.clear();
        if self.depth == 0 {
            return;
        }
        let mut level: HashSet<Tag> = HashSet::new();
        for e in entries.iter().filter(|e| e.parent.is_none()) {
            self.set(e.engine, 1);
            level.insert(Tag::of(e.engine));
        }
        for depth in 2..=self.depth {
            if level.is_empty() {
                break;
            }
            let mut next = HashSet::new();
            for e in entries {
                if e.parent.is_some_and(|p| level.contains(&p)) {
                    self.set(e.engine, depth);
                    next.insert(Tag::of(e.engine));
                }
            }
            level = next;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_protocol::PrefixHash;

    fn e(n: u64) -> EngineHash {
        EngineHash(n)
    }

    #[test]
    fn counts_prefixes_of_the_home_depth_from_stores_and_removals() {
        let mut h = Homes::new(3);
        // One sequence of 5 blocks: its third is the prefix.
        h.stored(None, (1..=5).map(e));
        assert_eq!(h.count(), 1);
        // A branch under block 2 reaches depth 3 again; one under block 4 is deeper.
        h.stored(Some(e(2)), [e(20), e(21)]);
        h.stored(Some(e(4)), [e(40)]);
        assert_eq!(h.count(), 2);
        // Under an unknown parent nothing is counted.
        h.stored(Some(e(99)), [e(100), e(101), e(102)]);
        assert_eq!(h.count(), 2);
        // A second store of one block is not a second prefix.
        h.stored(Some(e(2)), [e(20)]);
        assert_eq!(h.count(), 2);
        h.removed(e(3));
        h.removed(e(5));
        assert_eq!(h.count(), 1);
        h.clear();
        assert_eq!(h.count(), 0);
        let mut off = Homes::new(0);
        off.stored(None, (1..=5).map(e));
        assert_eq!(off.count(), 0);
    }

    #[test]
    fn a_snapshot_counts_what_its_events_counted() {
        let entry =
            |n: u64, parent: Option<u64>| Entry::new(e(n), PrefixHash(n * 7), parent.map(e));
        // Two sequences sharing their first block, one short of the depth.
        let entries = [
            entry(1, None),
            entry(2, Some(1)),
            entry(3, Some(2)),
            entry(4, Some(3)),
            entry(12, Some(1)),
            entry(13, Some(12)),
            entry(50, None),
            entry(51, Some(50)),
        ];
        let mut by_events = Homes::new(3);
        by_events.stored(None, [e(1), e(2), e(3), e(4)]);
        by_events.stored(Some(e(1)), [e(12), e(13)]);
        by_events.stored(None, [e(50), e(51)]);
        let mut by_snapshot = Homes::new(3);
        by_snapshot.rebuild(&entries);
        assert_eq!(by_snapshot.count(), 2);
        assert_eq!(by_snapshot.count(), by_events.count());
        assert_eq!(by_snapshot.shallow, by_events.shallow);
    }
}
