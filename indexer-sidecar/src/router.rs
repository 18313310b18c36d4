//! Turning index matches and load into a hint: which workers, in which order, and why.
//!
//! The rule (affinity as a preference): among healthy workers that are not saturated, the
//! longest matched prefix wins, ties go to the least loaded. A worker is saturated when its
//! queue, its KV usage or its in-flight estimate reaches the configured threshold. When every
//! worker holding a useful match is saturated, the request goes to the least-loaded unsaturated
//! worker and accepts a cold prefill; when nothing matches at all, no hint is given and Envoy's
//! ring hash on the fallback key decides (it keeps affinity without the sidecar too).

use kvroute_protocol::hint::HintResponse;
use serde::Serialize;

use crate::config::RoutingConfig;
use crate::load::Load;
use crate::registry::{WorkerId, WorkerRegistry};

/// One worker as the rule saw it.
#[derive(Debug, Clone, Serialize)]
pub struct Candidate {
    /// Its address.
    pub worker: String,
    /// Leading blocks it holds.
    pub matched_blocks: u32,
    /// Running requests (scraped).
    pub running: f64,
    /// Queued requests (scraped).
    pub waiting: f64,
    /// KV cache usage (scraped).
    pub kv_usage: f64,
    /// Hints recently given to it (decayed).
    pub recent_hints: f64,
    /// Whether it was over a threshold.
    pub saturated: bool,
}

/// Which part of the rule decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Rule {
    /// The longest match among unsaturated workers.
    LongestMatch,
    /// Every worker with a useful match was saturated: the least-loaded one instead.
    LeastLoaded,
    /// Nothing matched: no hint, the fallback key decides.
    NoMatch,
}

/// A hint and the reasons for it.
#[derive(Debug, Clone, Serialize)]
pub struct Decision {
    /// What the filter gets.
    pub hint: HintResponse,
    /// The rule that decided.
    pub rule: Rule,
    /// Every worker considered, best first.
    pub candidates: Vec<Candidate>,
}

/// Whether `load` is over any threshold of `routing`. Only the engine's own numbers count here:
/// recent hints include requests that already finished, so they order workers (ties, least
/// loaded) but never declare one saturated.
pub fn saturated(load: &Load, routing: &RoutingConfig) -> bool {
    load.waiting >= routing.max_waiting
        || load.kv_usage >= routing.max_kv_usage
        || load.running + load.waiting >= routing.max_in_flight
}

/// Decide where a request goes. `matches` are (worker, matched blocks); `load_of` and
/// `healthy` describe every registered worker.
pub fn choose(
    matches: &[(WorkerId, u32)],
    registry: &WorkerRegistry,
    routing: &RoutingConfig,
    load_of: impl Fn(WorkerId) -> Load,
    healthy: impl Fn(WorkerId) -> bool,
) -> Decision {
    let min = routing.min_matched_blocks.max(1);
    let matched = |w: WorkerId| matches.iter().find(|(m, _)| *m == w).map_or(0, |&(_, n)| n);
    let mut candidates: Vec<(WorkerId, u32, Load, bool)> = registry
        .iter()
        .filter(|w| healthy(w.id))
        .map(|w| {
            let load = load_of(w.id);
            (w.id, matched(w.id), load, saturated(&load, routing))
        })
        .collect();
    let useful = |n: u32| n >= min;
    // Unsaturated first, then the longest match, then the least in flight.
    candidates.sort_by(|a, b| {
        a.3.cmp(&b.3)
            .then(b.1.cmp(&a.1))
            .then(a.2.in_flight().total_cmp(&b.2.in_flight()))
            .then(a.0.cmp(&b.0))
    });
    let any_useful = candidates.iter().any(|c| useful(c.1));
    let best_unsaturated_useful = candidates.iter().any(|c| !c.3 && useful(c.1));
    let rule = if !any_useful {
        Rule::NoMatch
    } else if best_unsaturated_useful {
        Rule::LongestMatch
    } else {
        // Every useful match is saturated: least loaded first, whatever it holds.
        candidates.sort_by(|a, b| {
            a.3.cmp(&b.3)
                .then(a.2.in_flight().total_cmp(&b.2.in_flight()))
                .then(b.1.cmp(&a.1))
                .then(a.0.cmp(&b.0))
        });
        Rule::LeastLoaded
    };
    let address = |w: WorkerId| {
        registry
            .get(w)
            .map(|w| w.address.clone())
            .unwrap_or_default()
    };
    let hint = if rule == Rule::NoMatch {
        HintResponse::default()
    } else {
        let chosen: Vec<&(WorkerId, u32, Load, bool)> = candidates
            .iter()
            .take(routing.max_hinted_workers.max(1))
            .collect();
        HintResponse {
            matched_blocks: chosen.first().map_or(0, |c| c.1),
            workers: chosen.iter().map(|c| address(c.0)).collect(),
        }
    };
    Decision {
        hint,
        rule,
        candidates: candidates
            .iter()
            .map(|&(w, n, load, sat)| Candidate {
                worker: address(w),
                matched_blocks: n,
                running: load.running,
                waiting: load.waiting,
                kv_usage: load.kv_usage,
                recent_hints: load.recent_hints,
                saturated: sat,
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::WorkerConfig;

    fn registry(n: usize) -> WorkerRegistry {
        let configs: Vec<WorkerConfig> = (0..n)
            .map(|i| WorkerConfig {
                address: format!("127.0.0.1:{}", 8000 + i),
                model: "m".into(),
                dynamo_worker_id: None,
            })
            .collect();
        WorkerRegistry::new(&configs)
    }

    fn idle(_: WorkerId) -> Load {
        Load::default()
    }

    fn all(_: WorkerId) -> bool {
        true
    }

    fn busy(w: WorkerId, busy: &[u32], waiting: f64) -> Load {
        if busy.contains(&w.0) {
            Load {
                waiting,
                running: 4.0,
                ..Load::default()
            }
        } else {
            Load::default()
        }
    }

    #[test]
    fn longest_match_then_next_best() {
        let reg = registry(3);
        let d = choose(
            &[(WorkerId(0), 2), (WorkerId(1), 5), (WorkerId(2), 3)],
            &reg,
            &RoutingConfig::default(),
            idle,
            all,
        );
        assert_eq!(d.rule, Rule::LongestMatch);
        assert_eq!(
            d.hint.workers,
            vec!["127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8000"]
        );
        assert_eq!(d.hint.matched_blocks, 5);
    }

    #[test]
    fn ties_go_to_the_least_loaded() {
        let reg = registry(3);
        let ties = [(WorkerId(0), 4), (WorkerId(1), 4), (WorkerId(2), 4)];
        let load = |w: WorkerId| Load {
            running: [3.0, 1.0, 2.0][w.0 as usize],
            ..Load::default()
        };
        let d = choose(&ties, &reg, &RoutingConfig::default(), load, all);
        assert_eq!(
            d.hint.workers,
            vec!["127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8000"]
        );
    }

    #[test]
    fn saturated_affinity_spills_to_the_least_loaded() {
        let reg = registry(3);
        let routing = RoutingConfig::default();
        // Worker 0 holds the prefix but its queue is over the threshold.
        let d = choose(
            &[(WorkerId(0), 9)],
            &reg,
            &routing,
            |w| busy(w, &[0], routing.max_waiting),
            all,
        );
        assert_eq!(d.rule, Rule::LeastLoaded);
        assert_ne!(d.hint.workers[0], "127.0.0.1:8000");
        assert_eq!(
            d.hint.workers.last().unwrap(),
            "127.0.0.1:8000",
            "the affine worker stays last"
        );
        // A partial match on an unsaturated worker beats a saturated full match.
        let d = choose(
            &[(WorkerId(0), 9), (WorkerId(2), 3)],
            &reg,
            &routing,
            |w| busy(w, &[0], 9.0),
            all,
        );
        assert_eq!(d.rule, Rule::LongestMatch);
        assert_eq!(d.hint.workers[0], "127.0.0.1:8002");
    }

    #[test]
    fn unhealthy_workers_are_never_hinted() {
        let reg = registry(3);
        let d = choose(
            &[(WorkerId(1), 9), (WorkerId(2), 1)],
            &reg,
            &RoutingConfig::default(),
            idle,
            |w| w.0 != 1,
        );
        assert!(!d.hint.workers.contains(&"127.0.0.1:8001".to_string()));
        assert_eq!(d.hint.workers[0], "127.0.0.1:8002");
        assert_eq!(d.candidates.len(), 2);
    }

    #[test]
    fn no_useful_match_gives_no_hint() {
        let reg = registry(2);
        let strict = RoutingConfig {
            min_matched_blocks: 2,
            ..RoutingConfig::default()
        };
        let d = choose(&[(WorkerId(0), 1)], &reg, &strict, idle, all);
        assert_eq!(d.rule, Rule::NoMatch);
        assert_eq!(d.hint, HintResponse::default());
        let d = choose(&[], &reg, &RoutingConfig::default(), idle, all);
        assert_eq!(d.rule, Rule::NoMatch);
    }
}
