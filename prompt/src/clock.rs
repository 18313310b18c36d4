//! A map bounded in bytes that keeps what is used: the token cache's tables.
//!
//! Eviction is the clock (second chance): entries sit in insertion order, and one used since
//! the clock last passed it gets another round instead of going. A lookup only sets a flag, so
//! a hit costs no reordering — the cache is read far more often than it is filled.

use std::collections::{HashMap, VecDeque};

/// Values by 128-bit key, at most `budget` bytes of them as their owners count them.
pub(crate) struct ClockMap<V> {
    map: HashMap<u128, Entry<V>>,
    /// Insertion order, for the clock.
    clock: VecDeque<u128>,
    budget: usize,
    bytes: usize,
}

struct Entry<V> {
    value: V,
    bytes: usize,
    used: bool,
}

impl<V> ClockMap<V> {
    pub(crate) fn new(budget: usize) -> Self {
        ClockMap {
            map: HashMap::new(),
            clock: VecDeque::new(),
            budget,
            bytes: 0,
        }
    }

    /// The value of `key`, if kept; it is then used.
    pub(crate) fn get(&mut self, key: u128) -> Option<&V> {
        let entry = self.map.get_mut(&key)?;
        entry.used = true;
        Some(&entry.value)
    }

    /// Whether `key` is kept (it is not thereby used).
    pub(crate) fn contains(&self, key: u128) -> bool {
        self.map.contains_key(&key)
    }

    /// Keep `value` (costing `bytes`) under `key`, dropping entries not used since the clock
    /// last passed them until it fits; nothing if `key` is kept already or the value is larger
    /// than a quarter of the budget (one prompt must not empty the cache).
    pub(crate) fn put(&mut self, key: u128, value: V, bytes: usize) {
        if bytes > self.budget / 4 || self.map.contains_key(&key) {
            return;
        }
        while self.bytes + bytes > self.budget {
            let Some(old) = self.clock.pop_front() else {
                break;
            };
            match self.map.get_mut(&old) {
                Some(e) if e.used => {
                    e.used = false;
                    self.clock.push_back(old);
                }
                Some(_) => {
                    if let Some(e) = self.map.remove(&old) {
                        self.bytes -= e.bytes;
                    }
                }
                None => {}
            }
        }
        self.bytes += bytes;
        self.clock.push_back(key);
        self.map.insert(
            key,
            Entry {
                value,
                bytes,
                used: false,
            },
        );
    }

    /// Drop everything.
    pub(crate) fn clear(&mut self) {
        self.map.clear();
        self.clock.clear();
        self.bytes = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Within its budget: an entry used since the clock last passed stays, one not used goes.
    #[test]
    fn stays_within_its_budget_keeping_what_is_used() {
        let mut map = ClockMap::new(400);
        for key in 1..=4 {
            map.put(key, key, 100);
        }
        assert_eq!(map.get(1), Some(&1));
        map.put(5, 5, 100);
        assert!(map.bytes <= map.budget);
        assert!(map.get(1).is_some(), "used: kept");
        assert!(map.get(2).is_none(), "the oldest unused: dropped");
        assert_eq!(map.get(5), Some(&5));
        map.put(6, 6, 101);
        assert!(map.get(6).is_none(), "larger than a quarter: not kept");
        map.put(5, 50, 10);
        assert_eq!(map.get(5), Some(&5), "a kept key is not replaced");
        assert!(map.contains(5) && !map.contains(2));
        map.clear();
        assert!(map.get(1).is_none() && map.bytes == 0);
    }
}
