//! [`Holders`]: node → the caches holding it, the table every hint query reads.
//!
//! Most nodes are held by one to three caches (a conversation's blocks on its worker and
//! perhaps a replica or two); only popular prefixes, system prompts on every worker, are held
//! by more. So a node keeps up to three holders inline in an 8-byte value (16 bytes a table
//! entry with its key), and a crowded one keeps there where its list starts in a packed arena:
//! the index's biggest table costs half what a growable list per node would (24 bytes each),
//! and a query reads a crowded node's list with one memory access more than an inline one.

use std::collections::HashMap;

use kvroute_protocol::PrefixHash;

/// Dense 2-byte name of a cache inside one index; [`Slot::MAX`] is never one.
pub type Slot = u16;

/// Keys are already uniform hashes, but they come from prompts anyone can send: a fast hasher
/// with a per-process random seed keeps lookups cheap without letting crafted prompts collide.
type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

const INLINE: usize = 3;

/// `len` of a node whose holders are in the arena; its slots then say where: the block's
/// start (low half, high half) and its size class.
const CROWDED: u16 = u16::MAX;

/// The size class of a node's first arena block: 8 entries, a length and up to 7 holders.
const FIRST_CLASS: u16 = 3;

/// A node's holders: up to [`INLINE`] sorted, or where its list is.
#[derive(Debug, Clone, Copy, Default)]
struct Inline {
    len: u16,
    slots: [Slot; INLINE],
}

/// Where a crowded node's list is: a block of `1 << class` arena entries from `start`, the
/// first of them its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Block {
    start: usize,
    class: u16,
}

impl Inline {
    fn crowded(block: Block) -> Self {
        Inline {
            len: CROWDED,
            slots: [block.start as u16, (block.start >> 16) as u16, block.class],
        }
    }

    fn block(&self) -> Option<Block> {
        (self.len == CROWDED).then(|| Block {
            start: (usize::from(self.slots[1]) << 16) | usize::from(self.slots[0]),
            class: self.slots[2],
        })
    }
}

/// The list a block of `arena` holds.
fn list(arena: &[Slot], block: Block) -> &[Slot] {
    let len = arena.get(block.start).map_or(0, |&n| usize::from(n));
    arena
        .get(block.start + 1..block.start + 1 + len)
        .unwrap_or_default()
}

/// Node → the caches holding it, sorted, for every node held by at least one cache.
#[derive(Debug, Default)]
pub struct Holders {
    nodes: FastMap<PrefixHash, Inline>,
    /// Crowded nodes' lists, each in a block of a power-of-two size.
    arena: Vec<Slot>,
    /// Free blocks' starts, by size class.
    free: Vec<Vec<usize>>,
}

impl Holders {
    /// The caches holding `node`, sorted; `None` if none does.
    pub fn get(&self, node: PrefixHash) -> Option<&[Slot]> {
        let inline = self.nodes.get(&node)?;
        Some(match inline.block() {
            Some(block) => list(&self.arena, block),
            None => &inline.slots[..usize::from(inline.len)],
        })
    }

    fn alloc(&mut self, class: u16) -> Block {
        let reused = self.free.get_mut(usize::from(class)).and_then(Vec::pop);
        let start = reused.unwrap_or_else(|| {
            let start = self.arena.len();
            self.arena.resize(start + (1 << class), 0);
            start
        });
        Block { start, class }
    }

    fn release(&mut self, block: Block) {
        let class = usize::from(block.class);
        if self.free.len() <= class {
            self.free.resize_with(class + 1, Vec::new);
        }
        self.free[class].push(block.start);
    }

    /// Write `held` into a new block with room for it; returns where it is.
    fn store(&mut self, held: &[Slot]) -> Block {
        let mut class = FIRST_CLASS;
        while (1usize << class) < held.len() + 1 {
            class += 1;
        }
        let block = self.alloc(class);
        self.arena[block.start] = held.len() as u16;
        self.arena[block.start + 1..block.start + 1 + held.len()].copy_from_slice(held);
        block
    }

    /// `slot` holds `node` (again).
    pub fn hold(&mut self, node: PrefixHash, slot: Slot) {
        let inline = self.nodes.entry(node).or_default();
        let held: Vec<Slot> = match inline.block() {
            None => {
                let len = usize::from(inline.len);
                let Err(at) = inline.slots[..len].binary_search(&slot) else {
                    return;
                };
                if len < INLINE {
                    inline.slots.copy_within(at..len, at + 1);
                    inline.slots[at] = slot;
                    inline.len += 1;
                    return;
                }
                let mut held = inline.slots.to_vec();
                held.insert(at, slot);
                held
            }
            Some(block) => {
                let list = list(&self.arena, block);
                let (len, Err(at)) = (list.len(), list.binary_search(&slot)) else {
                    return;
                };
                if len + 1 < 1 << block.class {
                    let from = block.start + 1 + at;
                    self.arena
                        .copy_within(from..block.start + 1 + len, from + 1);
                    self.arena[from] = slot;
                    self.arena[block.start] += 1;
                    return;
                }
                let mut held = list.to_vec();
                held.insert(at, slot);
                self.release(block);
                held
            }
        };
        let block = self.store(&held);
        self.nodes.insert(node, Inline::crowded(block));
    }

    /// `slot` no longer holds `node`; a node nobody holds is forgotten.
    pub fn unhold(&mut self, node: PrefixHash, slot: Slot) {
        let Some(inline) = self.nodes.get_mut(&node) else {
            return;
        };
        let Some(block) = inline.block() else {
            let len = usize::from(inline.len);
            if let Ok(at) = inline.slots[..len].binary_search(&slot) {
                inline.slots.copy_within(at + 1..len, at);
                inline.len -= 1;
                if inline.len == 0 {
                    self.nodes.remove(&node);
                }
            }
            return;
        };
        let list = list(&self.arena, block);
        let (len, Ok(at)) = (list.len(), list.binary_search(&slot)) else {
            return;
        };
        let from = block.start + 1 + at;
        self.arena
            .copy_within(from + 1..block.start + 1 + len, from);
        self.arena[block.start] -= 1;
        if len - 1 <= INLINE {
            let mut slots = [0; INLINE];
            slots[..len - 1].copy_from_slice(&self.arena[block.start + 1..block.start + len]);
            *inline = Inline {
                len: (len - 1) as u16,
                slots,
            };
            self.release(block);
        }
    }

    /// Nodes held by at least one cache.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether no node is held.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const N: PrefixHash = PrefixHash(7);

    #[test]
    fn holders_stay_sorted_inline_and_crowded() {
        let mut h = Holders::default();
        assert_eq!(h.get(N), None);
        for slot in [5, 1, 3, 1] {
            h.hold(N, slot);
        }
        assert_eq!(h.get(N), Some(&[1, 3, 5][..]));
        assert!(h.arena.is_empty(), "three fit inline");
        for slot in [0, 9, 4, 9] {
            h.hold(N, slot);
        }
        assert_eq!(h.get(N), Some(&[0, 1, 3, 4, 5, 9][..]));
        for slot in [9, 0, 8] {
            h.unhold(N, slot);
        }
        assert_eq!(h.get(N), Some(&[1, 3, 4, 5][..]));
        h.unhold(N, 4);
        assert_eq!(h.get(N), Some(&[1, 3, 5][..]));
        assert_eq!(h.free[3], vec![0], "back inline, its block free");
        for slot in [3, 1, 5] {
            h.unhold(N, slot);
        }
        assert_eq!(h.get(N), None);
        assert!(h.is_empty());
        h.unhold(N, 1);
        assert_eq!(h.len(), 0);
    }

    /// A list outgrowing its block moves to a bigger one and its old block is reused; every
    /// list reads back whole, past 16 bits of arena too.
    #[test]
    fn crowded_lists_grow_move_and_reuse_blocks() {
        let mut h = Holders::default();
        let (a, b) = (PrefixHash(1), PrefixHash(2));
        for slot in 0..20 {
            h.hold(a, slot * 2);
        }
        assert_eq!(h.get(a).map(<[Slot]>::len), Some(20));
        assert!(h.get(a).unwrap().windows(2).all(|w| w[0] < w[1]));
        for slot in 0..5 {
            h.hold(b, slot);
        }
        assert_eq!(h.get(b), Some(&[0, 1, 2, 3, 4][..]));
        let arena = h.arena.len();
        assert_eq!(
            arena,
            8 + 16 + 32,
            "a's 8- and 16-blocks were freed, b took the 8"
        );
        for slot in 0..20 {
            h.hold(PrefixHash(3), slot);
        }
        assert_eq!(
            h.arena.len(),
            arena + 8 + 32,
            "a new 8-block, then a's old 16-block, then a new 32-block"
        );
        assert_eq!(h.get(PrefixHash(3)).map(<[Slot]>::len), Some(20));
        assert_eq!(h.get(b), Some(&[0, 1, 2, 3, 4][..]), "b untouched");
        let far = Block {
            start: 0x0003_0002,
            class: 5,
        };
        assert_eq!(Inline::crowded(far).block(), Some(far));
    }

    #[test]
    fn an_inline_value_is_small() {
        assert_eq!(std::mem::size_of::<(PrefixHash, Inline)>(), 16);
    }
}
