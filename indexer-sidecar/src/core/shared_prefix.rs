//! Which matched prefixes other requests matched too, lately: what tells a popular prefix (one
//! app's system prompt, every new user ending their match at its last block) from one
//! conversation's history (each turn matches up to a different, longer prefix). The routing
//! rule spreads only the first kind ([`crate::core::policy`], rule `spread`).

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// How long a match is remembered.
const WINDOW: Duration = Duration::from_secs(60);
/// At most this many prefixes are remembered (16 bytes each, plus the map's overhead).
const CAPACITY: usize = 8192;

/// The prefixes hints matched up to, with when they last did.
#[derive(Debug, Default, Clone)]
pub struct SharedPrefixes {
    last_matched: HashMap<u64, Instant>,
}

impl SharedPrefixes {
    /// Record that a request matched up to `prefix` at `now`; whether another one did within
    /// the window before it.
    pub fn matched(&mut self, prefix: u64, now: Instant) -> bool {
        if self.last_matched.len() >= CAPACITY {
            self.last_matched
                .retain(|_, at| now.saturating_duration_since(*at) < WINDOW);
            if self.last_matched.len() >= CAPACITY {
                self.last_matched.clear();
            }
        }
        self.last_matched
            .insert(prefix, now)
            .is_some_and(|before| now.saturating_duration_since(before) < WINDOW)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_is_shared_when_matched_again_within_the_window() {
        let mut s = SharedPrefixes::default();
        let t = Instant::now();
        assert!(!s.matched(1, t), "the first match is nobody else's");
        assert!(s.matched(1, t + Duration::from_secs(1)));
        assert!(!s.matched(2, t + Duration::from_secs(1)));
        assert!(
            !s.matched(2, t + WINDOW + Duration::from_secs(2)),
            "too long ago"
        );
    }

    #[test]
    fn memory_stays_bounded() {
        let mut s = SharedPrefixes::default();
        let t = Instant::now();
        for p in 0..(3 * CAPACITY as u64) {
            s.matched(p, t);
        }
        assert!(s.last_matched.len() <= CAPACITY);
    }
}
