//! Which matched prefixes are popular, and how much: requests that branch off them in different
//! ways lately (one app's system prompt, each new user continuing it with their own words), as
//! opposed to one conversation's history, which its own later turns match again while their
//! events are late — continuing it the same way; and each prefix's share of the recent requests.
//! The routing rule spreads only the first kind, and only while its share outgrows its holders
//! ([`crate::core::policy`], rule `spread`).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::core::recent::Recent;

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
    requests: Recent,
}

/// What a request's matched prefix is to the rule.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Popularity {
    /// The request is a new branch off a prefix others branched off within the window.
    pub shared: bool,
    /// The prefix's share of the recent requests (every request counts, matched or not).
    pub share: f64,
}

/// The prefixes hints matched up to, with how requests went on from them.
#[derive(Debug, Default, Clone)]
pub struct SharedPrefixes {
    prefixes: HashMap<u64, Branches>,
    requests: Recent,
}

impl SharedPrefixes {
    /// Record a request at `now`, which matched up to `prefix` and went on with block `next`
    /// (`None`: it ended there), or matched nothing (`matched` is `None`).
    pub fn request(&mut self, matched: Option<(u64, Option<u64>)>, now: Instant) -> Popularity {
        let all = self.requests.add(now);
        let Some((prefix, next)) = matched else {
            return Popularity::default();
        };
        let (shared, count) = self.matched(prefix, next, now);
        Popularity {
            shared,
            share: (count / all).min(1.0),
        }
    }

    /// Whether a request matching up to `prefix` and going on with `next` is a new branch off a
    /// prefix others branched off within the window, and the prefix's request count.
    fn matched(&mut self, prefix: u64, next: Option<u64>, now: Instant) -> (bool, f64) {
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
            requests: Recent::default(),
        });
        if now.saturating_duration_since(branches.at) >= WINDOW {
            branches.next.clear();
        }
        branches.at = now;
        let count = branches.requests.add(now);
        let Some(next) = next else {
            return (false, count);
        };
        if branches.next.contains(&next) {
            return (false, count);
        }
        let others = !branches.next.is_empty();
        if branches.next.len() == BRANCHES {
            branches.next.remove(0);
        }
        branches.next.push(next);
        (others, count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_branch_off_a_prefix_others_branched_off_is_shared() {
        let mut s = SharedPrefixes::default();
        let t = Instant::now();
        let mut shared = |p, n, at| s.request(Some((p, Some(n))), at).shared;
        assert!(!shared(1, 10, t), "the first branch is nobody else's");
        assert!(shared(1, 11, t + Duration::from_secs(1)));
        assert!(shared(1, 12, t + Duration::from_secs(1)));
        assert!(!shared(2, 10, t + Duration::from_secs(1)));
        let late = t + WINDOW + Duration::from_secs(2);
        assert!(!shared(1, 13, late), "the others were too long ago");
    }

    /// A conversation's next turn arriving before its last turn's events matches the same
    /// prefix and goes on the same way: not a sign of popularity.
    #[test]
    fn the_same_branch_again_is_not_shared() {
        let mut s = SharedPrefixes::default();
        let t = Instant::now();
        let mut shared = |next| s.request(Some((1, next)), t).shared;
        shared(Some(10));
        assert!(!shared(Some(10)));
        shared(Some(11));
        assert!(!shared(Some(10)), "still its own branch");
        assert!(!shared(None), "a prompt that ends at its match");
    }

    /// A prefix behind half the requests has half the share, whichever requests came between
    /// (unmatched ones count too); one that stopped being asked for fades.
    #[test]
    fn a_share_is_of_all_recent_requests() {
        let mut s = SharedPrefixes::default();
        let t = Instant::now();
        let mut last = Popularity::default();
        for i in 0..400u64 {
            let at = t + Duration::from_millis(100 * i);
            last = s.request(Some((1, Some(i))), at);
            s.request(if i % 2 == 0 { None } else { Some((2, Some(i))) }, at);
        }
        assert!((last.share - 0.5).abs() < 0.01, "{last:?}");
        let later = t + Duration::from_secs(40) + 10 * crate::core::recent::TAU;
        for i in 0..20 {
            s.request(None, later + Duration::from_millis(i));
        }
        let faded = s.request(Some((1, Some(1))), later + Duration::from_millis(20));
        assert!(faded.share < 0.1, "{faded:?}");
        assert_eq!(s.request(None, later).share, 0.0);
    }

    #[test]
    fn memory_stays_bounded() {
        let mut s = SharedPrefixes::default();
        let t = Instant::now();
        for p in 0..(3 * CAPACITY as u64) {
            for n in 0..(2 * BRANCHES as u64) {
                s.request(Some((p % 64, Some(n + p))), t);
            }
            s.request(Some((p, Some(p))), t);
        }
        assert!(s.prefixes.len() <= CAPACITY);
        assert!(s.prefixes.values().all(|b| b.next.len() <= BRANCHES));
    }
}
