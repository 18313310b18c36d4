//! Losses said once per streak. The first loss on a stream of events starts a streak and gets a
//! line at once; later losses add to it silently; once the stream has lost nothing for
//! [`QUIET`], one more line says how much was lost, in how many gaps, over how many workers and
//! how long. A storm that loses a hundred thousand messages takes two lines, not one per
//! message; the counters behind them keep counting every loss.

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

/// How long a stream must lose nothing for its streak to end.
pub const QUIET: Duration = Duration::from_secs(2);

/// Distinct workers a streak remembers (beyond, it says "at least").
const WORKERS: usize = 4096;

/// One streak of losses on one stream.
#[derive(Debug, Clone)]
pub struct Streak {
    /// The first loss.
    pub started: Instant,
    /// The latest loss.
    pub last: Instant,
    /// Messages or events lost.
    pub lost: u64,
    /// Separate losses (gaps, drops).
    pub times: u64,
    /// Workers that lost something (up to 4,096).
    pub workers: HashSet<String>,
}

/// The open streaks, by stream (what was lost, and where).
#[derive(Debug, Default)]
pub struct Streaks {
    open: BTreeMap<String, Streak>,
}

impl Streaks {
    /// `lost` more on `stream` (of `worker`, if one is known). True when this starts a streak:
    /// the caller says so.
    pub fn lost(&mut self, stream: &str, worker: Option<&str>, lost: u64, now: Instant) -> bool {
        let mut started = false;
        let streak = self.open.entry(stream.to_owned()).or_insert_with(|| {
            started = true;
            Streak {
                started: now,
                last: now,
                lost: 0,
                times: 0,
                workers: HashSet::new(),
            }
        });
        streak.last = now;
        streak.lost += lost;
        streak.times += 1;
        if let Some(w) = worker {
            if streak.workers.len() < WORKERS && !streak.workers.contains(w) {
                streak.workers.insert(w.to_owned());
            }
        }
        started
    }

    /// The streaks that have been quiet for [`QUIET`] at `now`: closed, for the caller to say.
    pub fn ended(&mut self, now: Instant) -> Vec<(String, Streak)> {
        let done: Vec<String> = self
            .open
            .iter()
            .filter(|(_, s)| now.saturating_duration_since(s.last) >= QUIET)
            .map(|(k, _)| k.clone())
            .collect();
        done.into_iter()
            .filter_map(|k| self.open.remove(&k).map(|s| (k, s)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_streak_is_said_when_it_starts_and_when_it_ends() {
        let t0 = Instant::now();
        let mut s = Streaks::default();
        assert!(
            s.lost("nats", Some("a"), 3, t0),
            "the first loss starts one"
        );
        for i in 1..1000 {
            let at = t0 + Duration::from_millis(i);
            assert!(!s.lost("nats", Some(if i % 2 == 0 { "a" } else { "b" }), 1, at));
        }
        assert!(s.lost("zmq", None, 1, t0), "another stream, another streak");
        assert!(s.ended(t0 + Duration::from_millis(1500)).is_empty());
        let ended = s.ended(t0 + QUIET + Duration::from_millis(1));
        assert_eq!(ended.len(), 1, "only the zmq streak is quiet");
        assert_eq!(ended[0].0, "zmq");
        let ended = s.ended(t0 + Duration::from_millis(999) + QUIET);
        let (_, nats) = &ended[0];
        assert_eq!((nats.lost, nats.times, nats.workers.len()), (1002, 1000, 2));
        assert_eq!(nats.last - nats.started, Duration::from_millis(999));
        assert!(
            s.lost("nats", None, 1, t0 + QUIET * 3),
            "a new streak after the end"
        );
    }
}
