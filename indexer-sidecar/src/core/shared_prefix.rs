//! Which matched prefixes are popular: requests that branch off them in different ways lately
//! (one app's system prompt, each new user continuing it with their own words), as opposed to
//! one conversation's history, which its own later turns match again while their events are late
//! — continuing it the same way. The routing rule spreads only the first kind
//! ([`crate::core::policy`], rule `spread`).

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// How long a branch is remembered.
const WINDOW: Duration = Duration::from_secs(60);
/// At most this many prefixes are remembered.
const CAPACITY: usize = 8192;
/// Branches remembered per prefix (the oldest go first): a conversation's own branch is known
/// again as long as fewer than this many others came since.
const BRANCHES: usize = 16;

/// A matched prefix's recent branches: the first block after it in each request.
#[derive(Debug, Clone)]
struct Branches {
    next: Vec<u64>,
    at: Instant,
}

/// The prefixes hints matched up to, with how requests went on from them.
#[derive(Debug, Default, Clone)]
pub struct SharedPrefixes {
    prefixes: HashMap<u64, Branches>,
}

impl SharedPrefixes {
    /// Record that a request matched up to `prefix` at `now` and went on with block `next`
    /// (`None`: it ended there); whether that is a new branch off a prefix others branched off
    /// within the window.
    pub fn matched(&mut self, prefix: u64, next: Option<u64>, now: Instant) -> bool {
        if self.prefixes.len() >= CAPACITY && !self.prefixes.contains_key(&prefix) {
            self.prefixes
                .retain(|_, b| now.saturating_duration_since(b.at) < WINDOW);
            if self.prefixes.len() >= CAPACITY {
                self.prefixes.clear();
            }
        }
        let branches = self.prefixes.entry(prefix).or_insert(Branches {
            next: Vec::new(),
            at: now,
        });
        if now.saturating_duration_since(branches.at) >= WINDOW {
            branches.next.clear();
        }
        branches.at = now;
        let Some(next) = next else {
            return false;
        };
        if branches.next.contains(&next) {
            return false;
        }
        let others = !branches.next.is_empty();
        if branches.next.len() == BRANCHES {
            branches.next.remove(0);
        }
        branches.next.push(next);
        others
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_branch_off_a_prefix_others_branched_off_is_shared() {
        let mut s = SharedPrefixes::default();
        let t = Instant::now();
        assert!(
            !s.matched(1, Some(10), t),
            "the first branch is nobody else's"
        );
        assert!(s.matched(1, Some(11), t + Duration::from_secs(1)));
        assert!(s.matched(1, Some(12), t + Duration::from_secs(1)));
        assert!(!s.matched(2, Some(10), t + Duration::from_secs(1)));
        let late = t + WINDOW + Duration::from_secs(2);
        assert!(
            !s.matched(1, Some(13), late),
            "the others were too long ago"
        );
    }

    /// A conversation's next turn arriving before its last turn's events matches the same
    /// prefix and goes on the same way: not a sign of popularity.
    #[test]
    fn the_same_branch_again_is_not_shared() {
        let mut s = SharedPrefixes::default();
        let t = Instant::now();
        s.matched(1, Some(10), t);
        assert!(!s.matched(1, Some(10), t));
        s.matched(1, Some(11), t);
        assert!(!s.matched(1, Some(10), t), "still its own branch");
        assert!(!s.matched(1, None, t), "a prompt that ends at its match");
    }

    #[test]
    fn memory_stays_bounded() {
        let mut s = SharedPrefixes::default();
        let t = Instant::now();
        for p in 0..(3 * CAPACITY as u64) {
            for n in 0..(2 * BRANCHES as u64) {
                s.matched(p % 64, Some(n + p), t);
            }
            s.matched(p, Some(p), t);
        }
        assert!(s.prefixes.len() <= CAPACITY);
        assert!(s.prefixes.values().all(|b| b.next.len() <= BRANCHES));
    }
}
