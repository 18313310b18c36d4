//! The alarms on what the engines reported: `stale_index` (a worker's engine had far fewer of
//! the predicted tokens cached than this replica's index said), `index_behind` (this
//! replica's engines had far more cached than its index predicted: it misses events),
//! `replica_prediction_skew` (one replica's prediction error departs from its peers', either
//! way: round robin over replicas dilutes a lossy replica's hit rate, not its error) and
//! `replica_skew` (one replica's engines report a hit rate well below its peers'). Pure: the alarm task hands it
//! every replica's per-worker totals ([`Truth`], ours from the core, the peers' from the
//! replica plane) with the time, and it weighs what was added over the last
//! `[alarms] truth_window_s`.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use crate::config::AlarmConfig;
use crate::core::truth::Truth;
use crate::event_plane::Alarm;

/// Every replica's totals: (replica, worker) → totals since that replica started.
pub type Totals = BTreeMap<(String, String), Truth>;

/// Samples of every replica's totals over the window.
#[derive(Debug, Default)]
pub struct TruthWatch {
    samples: VecDeque<(Instant, Totals)>,
}

impl TruthWatch {
    /// Record the totals as of `now`, keeping what the window reaches back to.
    pub fn observe(&mut self, now: Instant, totals: Totals, window: Duration) {
        self.samples.push_back((now, totals));
        // Keep the newest sample at or before the window's start: it is the base.
        while self
            .samples
            .get(1)
            .is_some_and(|(t, _)| now.saturating_duration_since(*t) >= window)
        {
            self.samples.pop_front();
        }
    }

    /// What each (replica, worker) added within the window (since the oldest sample kept). A
    /// replica whose totals went back restarted: all it has counted since is recent.
    pub fn recent(&self) -> Totals {
        let (Some((_, base)), Some((_, newest))) = (self.samples.front(), self.samples.back())
        else {
            return Totals::new();
        };
        newest
            .iter()
            .map(|(key, t)| {
                let since = match base.get(key) {
                    Some(b) if b.total() <= t.total() => t.since(b),
                    _ => *t,
                };
                (key.clone(), since)
            })
            .collect()
    }

    /// The alarms on at the newest sample, for replica `me`.
    pub fn alarms(&self, me: &str, config: &AlarmConfig) -> Vec<Alarm> {
        let recent = self.recent();
        let window = config.truth_window_s;
        let mut out = Vec::new();
        for ((replica, worker), t) in &recent {
            if replica != me || t.predicted_tokens < config.stale_index_min_tokens {
                continue;
            }
            if (t.cached_tokens as f64) < config.stale_index_ratio * t.predicted_tokens as f64 {
                out.push(Alarm {
                    name: "stale_index",
                    subject: worker.clone(),
                    message: format!(
                        "worker {worker}: its engine reported {} cached prompt tokens where this \
                         replica's hints predicted {} over the last {window} s ({} of {} \
                         predictions over by more than a block): the index holds blocks the \
                         engine does not — lost or unread KV events (see kvroute_sequence_total, \
                         /debug/sources), a diverged replica (/debug/replicas), or eviction \
                         between hint and prefill",
                        t.cached_tokens,
                        t.predicted_tokens,
                        t.over,
                        t.compared()
                    ),
                });
            }
        }
        let mut per_replica: BTreeMap<&str, Truth> = BTreeMap::new();
        for ((replica, _), t) in &recent {
            per_replica.entry(replica).or_default().merge(t);
        }
        out.extend(prediction_alarms(me, &per_replica, config));
        let min = config.replica_skew_min_tokens;
        for (replica, t) in &per_replica {
            let mut others = Truth::default();
            for (_, o) in per_replica.iter().filter(|(r, _)| *r != replica) {
                others.merge(o);
            }
            if t.prompt_tokens < min || others.prompt_tokens < min {
                continue;
            }
            let (Some(mine), Some(theirs)) = (t.actual_rate(), others.actual_rate()) else {
                continue;
            };
            if mine < config.replica_skew_ratio * theirs && mine + 0.05 < theirs {
                out.push(Alarm {
                    name: "replica_skew",
                    subject: (*replica).to_owned(),
                    message: format!(
                        "replica {replica}: its engines reported a hit rate of {:.1}% over the \
                         last {window} s against {:.1}% for its {} peers on the same fleet \
                         (predicted {:.1}%): compare its caches on /debug/replicas; a replica \
                         whose predictions are high and hits low has a stale index, one whose \
                         predictions are low too is missing events",
                        mine * 100.0,
                        theirs * 100.0,
                        per_replica.len() - 1,
                        t.predicted_rate().unwrap_or(0.0) * 100.0,
                    ),
                });
            }
        }
        out
    }
}

/// (cached − predicted) / prompt tokens: how far a replica's index is behind (positive) or
/// ahead (negative) of what its engines held; `None` below `min` prompt tokens.
fn prediction_error(t: &Truth, min: u64) -> Option<f64> {
    (t.prompt_tokens >= min.max(1))
        .then(|| (t.cached_tokens as f64 - t.predicted_tokens as f64) / t.prompt_tokens as f64)
}

/// `index_behind` for this replica, `replica_prediction_skew` for any replica whose error
/// departs from its peers' together.
fn prediction_alarms(
    me: &str,
    per_replica: &BTreeMap<&str, Truth>,
    config: &AlarmConfig,
) -> Vec<Alarm> {
    let (gap, min, window) = (
        config.prediction_gap,
        config.prediction_min_tokens,
        config.truth_window_s,
    );
    let mut out = Vec::new();
    if let Some(error) = per_replica.get(me).and_then(|t| prediction_error(t, min)) {
        if error > gap {
            out.push(Alarm {
                name: "index_behind",
                subject: me.to_owned(),
                message: format!(
                    "replica {me}: its engines reported {:.1}% of the prompt tokens cached beyond \
                     what its hints predicted over the last {window} s: its index misses blocks \
                     the engines hold — KV events lost or not read (kvroute_replica_lost_messages_total, \
                     kvroute_sequence_total, /debug/sources), or a cache its peers disagree with \
                     (/debug/replicas); with [replicas], a peer's copy repairs it",
                    error * 100.0
                ),
            });
        }
    }
    for (replica, t) in per_replica {
        let mut others = Truth::default();
        for (_, o) in per_replica.iter().filter(|(r, _)| *r != replica) {
            others.merge(o);
        }
        let (Some(mine), Some(theirs)) = (prediction_error(t, min), prediction_error(&others, min))
        else {
            continue;
        };
        // The one further from what its engines reported is the outlier (with two replicas,
        // each departs from the other).
        if (mine - theirs).abs() > gap && mine.abs() > theirs.abs() {
            out.push(Alarm {
                name: "replica_prediction_skew",
                subject: (*replica).to_owned(),
                message: format!(
                    "replica {replica}: its predictions miss what its engines reported by {:+.1}% \
                     of the prompt tokens over the last {window} s, its {} peers' by {:+.1}% \
                     (positive: predicted too little): its index departs from theirs — compare \
                     its caches on /debug/replicas and its kvroute_replica_lost_messages_total; \
                     restarting it warms it from its peers",
                    mine * 100.0,
                    per_replica.len() - 1,
                    theirs * 100.0
                ),
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use kvroute_protocol::hint::Usage;

    use super::*;

    fn config() -> AlarmConfig {
        AlarmConfig {
            truth_window_s: 10,
            stale_index_min_tokens: 100,
            replica_skew_min_tokens: 100,
            ..AlarmConfig::default()
        }
    }

    /// `n` requests of 100 prompt tokens, `predicted` and `cached` of them each.
    fn served(t: &mut Truth, n: usize, predicted: u64, cached: u32) {
        for _ in 0..n {
            t.add(
                predicted,
                Usage::Cached {
                    prompt_tokens: 100,
                    cached_tokens: cached,
                },
                16,
            );
        }
    }

    fn key(replica: &str, worker: &str) -> (String, String) {
        (replica.to_owned(), worker.to_owned())
    }

    #[test]
    fn a_worker_whose_engine_lacks_what_was_predicted_is_stale_until_it_recovers() {
        let (start, window) = (Instant::now(), Duration::from_secs(10));
        let mut watch = TruthWatch::default();
        let (mut w0, mut w1) = (Truth::default(), Truth::default());
        let at = |watch: &mut TruthWatch, secs: u64, w0: &Truth, w1: &Truth| {
            let totals = Totals::from([(key("me", "w0"), *w0), (key("me", "w1"), *w1)]);
            watch.observe(start + Duration::from_secs(secs), totals, window);
            watch.alarms("me", &config())
        };
        assert!(at(&mut watch, 0, &w0, &w1).is_empty());
        served(&mut w0, 4, 80, 80);
        served(&mut w1, 4, 80, 0);
        let on = at(&mut watch, 5, &w0, &w1);
        assert_eq!(on.len(), 1, "{on:?}");
        assert_eq!((on[0].name, on[0].subject.as_str()), ("stale_index", "w1"));
        assert!(on[0].message.contains("predicted 320"), "{}", on[0].message);
        // Repaired: the next window's requests hit as predicted, the old ones leave it.
        served(&mut w1, 2, 80, 80);
        assert_eq!(at(&mut watch, 12, &w0, &w1).len(), 1, "still in the window");
        served(&mut w1, 4, 80, 80);
        assert!(at(&mut watch, 16, &w0, &w1).is_empty());
        // Another replica's stale worker is that replica's alarm, not ours.
        let mut theirs = Truth::default();
        served(&mut theirs, 4, 80, 0);
        let mut other = TruthWatch::default();
        let both = |t: Truth| Totals::from([(key("peer", "w1"), t)]);
        other.observe(start, both(Truth::default()), window);
        other.observe(start + Duration::from_secs(1), both(theirs), window);
        assert!(other.alarms("me", &config()).is_empty());
        assert_eq!(other.alarms("peer", &config()).len(), 1);
    }

    #[test]
    fn a_replica_hitting_far_less_than_its_peers_is_named() {
        let (start, window) = (Instant::now(), Duration::from_secs(10));
        let mut watch = TruthWatch::default();
        let zero = Totals::from([
            (key("a", "w0"), Truth::default()),
            (key("b", "w0"), Truth::default()),
            (key("c", "w0"), Truth::default()),
        ]);
        watch.observe(start, zero, window);
        let (mut a, mut b, mut c) = (Truth::default(), Truth::default(), Truth::default());
        served(&mut a, 5, 80, 80);
        served(&mut b, 5, 80, 75);
        served(&mut c, 5, 0, 20);
        let totals = Totals::from([
            (key("a", "w0"), a),
            (key("b", "w0"), b),
            (key("c", "w0"), c),
        ]);
        watch.observe(start + Duration::from_secs(3), totals, window);
        let on: Vec<_> = watch
            .alarms("a", &config())
            .into_iter()
            .filter(|a| a.name == "replica_skew")
            .collect();
        assert_eq!(on.len(), 1, "{on:?}");
        assert_eq!(on[0].subject, "c");
        assert!(on[0].message.contains("20.0%"), "{}", on[0].message);
        let quiet = AlarmConfig {
            replica_skew_min_tokens: 1_000,
            ..config()
        };
        assert!(
            watch.alarms("a", &quiet).is_empty(),
            "too few tokens to say"
        );
        // Replica c restarts, still missing: what it counted since is its window.
        let mut again = Truth::default();
        served(&mut again, 5, 0, 20);
        let restarted = Totals::from([
            (key("a", "w0"), a),
            (key("b", "w0"), b),
            (key("c", "w0"), again),
        ]);
        watch.observe(start + Duration::from_secs(4), restarted, window);
        assert_eq!(watch.recent()[&key("c", "w0")], again);
        assert_eq!(watch.alarms("a", &config()).len(), 1);
    }

    /// The incident round robin hides: both replicas' engines hit alike (each serves half of
    /// every conversation), but one replica's index predicts a fraction of it. Its own sidecar
    /// says `index_behind`; every sidecar names it in `replica_prediction_skew`; nothing fires
    /// while the two predict alike.
    #[test]
    fn a_replica_predicting_far_less_than_its_engines_hold_is_named() {
        let (start, window) = (Instant::now(), Duration::from_secs(10));
        let config = AlarmConfig {
            prediction_min_tokens: 1_000,
            ..config()
        };
        let names = |watch: &TruthWatch, me: &str| -> Vec<(&'static str, String)> {
            watch
                .alarms(me, &config)
                .into_iter()
                .map(|a| (a.name, a.subject))
                .collect()
        };
        let mut watch = TruthWatch::default();
        let zero = Totals::from([
            (key("clean", "w0"), Truth::default()),
            (key("lossy", "w0"), Truth::default()),
        ]);
        watch.observe(start, zero, window);
        let (mut clean, mut lossy) = (Truth::default(), Truth::default());
        served(&mut clean, 20, 78, 78);
        served(&mut lossy, 20, 21, 78);
        let totals = Totals::from([(key("clean", "w0"), clean), (key("lossy", "w0"), lossy)]);
        watch.observe(start + Duration::from_secs(3), totals, window);
        let skew = ("replica_prediction_skew", "lossy".to_owned());
        assert_eq!(
            names(&watch, "lossy"),
            vec![("index_behind", "lossy".to_owned()), skew.clone()]
        );
        assert_eq!(names(&watch, "clean"), vec![skew]);
        // Repaired: both predict what their engines hold.
        let mut fine = TruthWatch::default();
        let (mut a, mut b) = (Truth::default(), Truth::default());
        served(&mut a, 20, 78, 78);
        served(&mut b, 20, 76, 78);
        fine.observe(
            start,
            Totals::from([
                (key("clean", "w0"), Truth::default()),
                (key("lossy", "w0"), Truth::default()),
            ]),
            window,
        );
        fine.observe(
            start + Duration::from_secs(3),
            Totals::from([(key("clean", "w0"), a), (key("lossy", "w0"), b)]),
            window,
        );
        assert!(names(&fine, "lossy").is_empty());
        assert!(names(&fine, "clean").is_empty());
    }
}
