//! Turning index matches into a hint: which workers, in which order.

use kvroute_protocol::hint::HintResponse;

use crate::config::RoutingConfig;
use crate::registry::{WorkerId, WorkerRegistry};

/// Order matched workers best first: longest match; equal matches rotate by `rotation` so that
/// requests sharing only a common prefix (a system prompt every worker holds) spread out.
pub fn choose(
    matches: &[(WorkerId, u32)],
    registry: &WorkerRegistry,
    routing: &RoutingConfig,
    rotation: u64,
) -> HintResponse {
    let n = matches.len().max(1) as u64;
    let mut ranked: Vec<(u32, u64, WorkerId)> = matches
        .iter()
        .filter(|(_, m)| *m >= routing.min_matched_blocks.max(1))
        .map(|&(w, m)| (m, (u64::from(w.0) + rotation) % n, w))
        .collect();
    ranked.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    let workers: Vec<String> = ranked
        .iter()
        .filter_map(|(_, _, w)| registry.get(*w).map(|w| w.address.clone()))
        .take(routing.max_hinted_workers.max(1))
        .collect();
    HintResponse {
        matched_blocks: if workers.is_empty() { 0 } else { ranked[0].0 },
        workers,
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

    #[test]
    fn longest_first_then_next_best() {
        let reg = registry(3);
        let r = choose(
            &[(WorkerId(0), 2), (WorkerId(1), 5), (WorkerId(2), 3)],
            &reg,
            &RoutingConfig::default(),
            0,
        );
        assert_eq!(
            r.workers,
            vec!["127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8000"]
        );
        assert_eq!(r.matched_blocks, 5);
    }

    #[test]
    fn ties_rotate_and_short_matches_are_dropped() {
        let reg = registry(3);
        let ties = [(WorkerId(0), 1), (WorkerId(1), 1), (WorkerId(2), 1)];
        let firsts: std::collections::HashSet<String> = (0..3)
            .map(|r| choose(&ties, &reg, &RoutingConfig::default(), r).workers[0].clone())
            .collect();
        assert_eq!(firsts.len(), 3);
        let strict = RoutingConfig {
            min_matched_blocks: 2,
            max_hinted_workers: 1,
        };
        assert_eq!(choose(&ties, &reg, &strict, 0), HintResponse::default());
        let one = choose(&[(WorkerId(0), 2), (WorkerId(1), 3)], &reg, &strict, 0);
        assert_eq!(one.workers, vec!["127.0.0.1:8001"]);
    }
}
