//! Turning index matches and load into a hint: which workers, in which order, and why.
//!
//! The rule (affinity as a preference): among healthy workers that are not saturated, the one
//! with the lowest cost wins. Cost, in blocks of prefill: the prompt blocks the worker will not
//! hold when the request gets there (blocks its running requests share count in full, the rest
//! of the index's match by the share of idle prefixes that survive there: on a small cache a
//! queued request finds its conversation evicted, not its app's system prompt), plus the
//! prompt blocks already queued for prefill there (when the engine reports them: Dynamo's
//! `kv_metrics`), plus `load_penalty_blocks` × its requests (those the sidecar hinted to it
//! that have not finished, and those its engine reported beyond them at the last scrape; see
//! [`crate::core::load`]). So a long match wins over a short queue, but a two-block match does not pin
//! traffic to a busy worker while another idles, and a burst spreads out at once. A worker is
//! saturated when its queue or its requests (or its KV usage, if configured) reach the thresholds;
//! saturated workers are used only when every worker is. Workers that tie on everything the
//! rule weighs (a prefix every one holds, equal load) are ordered by a rendezvous score of the
//! prompt, not by their ids: the lowest id would take every tie, and every replica the same
//! one at once. When no worker holds a useful match,
//! the prompt goes to its **home**: of the unsaturated workers, the one with the highest
//! rendezvous score for the prompt's first `home_key_blocks` blocks (a saturated home hands
//! over to the next in that order, not to a random one). Cold prompts that share a
//! beginning (one app's system prompt, a conversation's next turn whose events are late) land
//! together and share their prefill instead of being spread by load; every sidecar replica
//! computes the same home; saturation, or being `home_slack` requests busier than the least
//! loaded worker (or running `home_slack_blocks` more prompt blocks: by default, prefill workers
//! of a disaggregated fleet only), is the escape hatch. Measured on real vLLM (multi-turn
//! chat, docs/benchmarks.md): least loaded for cold prompts lost to Envoy's ring hash alone.
//! Envoy's ring hash on the fallback key still decides whenever the sidecar does not answer.

use serde::Serialize;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::config::RoutingConfig;
use crate::core::fleet::WorkerId;
use crate::core::load::Load;
use crate::core::shared_prefix::Popularity;

/// One worker as the rule saw it.
#[derive(Debug, Clone, Serialize)]
pub struct Candidate {
    /// Its id.
    #[serde(skip)]
    pub id: WorkerId,
    /// Its address.
    pub worker: String,
    /// Leading blocks it holds, as the index says.
    pub matched_blocks: u32,
    /// Leading blocks requests hinted to it and still running have too (held while they run,
    /// and possibly not in the index yet).
    pub in_flight_blocks: u32,
    /// The share of its other matched blocks expected to be still cached when the request gets
    /// there ([`crate::core::load::WorkerLoad::survival`]).
    pub survival: f64,
    /// Requests running there whose prompts have the longest match too: the prefix's own
    /// queue there.
    pub prefix_in_flight: u32,
    /// The prefixes it is home to ([`Worker::homes`]), where the home balance weighed it (a
    /// prompt nothing matches).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub homes: Option<f64>,
    /// Its load as the rule weighed it (shown field by field).
    #[serde(flatten)]
    pub load: Load,
    /// Whether it was over a threshold.
    pub saturated: bool,
    /// The `home_slack_blocks` that applied to it (by its role unless configured).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub home_slack_blocks: Option<f64>,
    /// Blocks to prefill + load penalty (lower is better).
    pub cost: f64,
    /// Where it stands among workers that tie on everything else (higher first).
    #[serde(skip)]
    pub tie: u64,
}

/// Which part of the rule decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Rule {
    /// The cheapest unsaturated worker holds the longest match.
    LongestMatch,
    /// Load outweighed the longest match (or it was saturated): a less busy worker instead.
    LeastLoaded,
    /// No useful match anywhere: the prompt's home (or, without a key, the least loaded
    /// worker), which will prefill it all.
    NoMatch,
    /// A prefix several workers hold, whose holders are all `spread_slack` requests busier
    /// than another worker: that worker prefills it and becomes one more holder.
    Spread,
}

/// A hint and the reasons for it.
#[derive(Debug, Clone, Serialize)]
pub struct Decision {
    /// The workers to hint, best first (at most `max_hinted_workers`).
    #[serde(skip)]
    pub workers: Vec<WorkerId>,
    /// Leading prompt blocks the first of them holds.
    #[serde(skip)]
    pub matched_blocks: u32,
    /// The rule that decided.
    pub rule: Rule,
    /// Every worker considered, best first.
    pub candidates: Vec<Candidate>,
}

/// Whether `load` is over any threshold of `routing`. The scraped queue counts only as far as
/// the worker's current requests can hold it: a scrape can be seconds old (seen on real vLLM: an
/// engine the sidecar's tickets showed draining to no request at all stayed "saturated" by its
/// last scraped queue of 4 for a dozen hints), while hinted requests are counted as they end.
/// `max_in_flight` stands in for the queue only where the engine does not report one: an engine
/// batches as many requests as its own limit allows, and one that says nothing waits is not
/// saturated whatever it runs (a cap below its batch sent requests away from their cache near
/// saturation, each paying a prefill that slowed the fleet into more: docs/benchmarks.md, "Under
/// load").
pub fn saturated(load: &Load, routing: &RoutingConfig) -> bool {
    (load.waiting.min(load.busy()) >= routing.max_waiting
        && routing
            .waiting_kv_usage
            .is_none_or(|usage| load.kv_usage >= usage))
        || routing.max_kv_usage.is_some_and(|max| load.kv_usage >= max)
        || (!load.queue_reported && load.busy() >= routing.max_in_flight)
}

/// The mean of the candidates' requests ([`Load::busy`]); 0 for none.
fn mean_busy(candidates: &[Candidate]) -> f64 {
    if candidates.is_empty() {
        return 0.0;
    }
    candidates.iter().map(|c| c.load.busy()).sum::<f64>() / candidates.len() as f64
}

/// A cold prompt's home score on `address`: rendezvous hashing, the same on every replica.
fn home_score(key: u64, address: &str) -> u64 {
    xxh3_64_with_seed(address.as_bytes(), key)
}

impl Candidate {
    /// Leading blocks it holds, by the index or by a running request.
    fn held(&self) -> u32 {
        self.matched_blocks.max(self.in_flight_blocks)
    }

    /// The prompt blocks it is expected to have cached when the request arrives: those running
    /// requests hold, and of the rest of its match the share that survives there.
    fn expected_blocks(&self) -> f64 {
        let idle = self.matched_blocks.saturating_sub(self.in_flight_blocks);
        f64::from(self.in_flight_blocks) + self.survival * f64::from(idle)
    }
}

/// One usable worker as the rule weighs it.
#[derive(Debug, Clone, Copy)]
pub struct Worker<'a> {
    /// Its id.
    pub id: WorkerId,
    /// Its address.
    pub address: &'a str,
    /// Its load.
    pub load: Load,
    /// The prompt's leading blocks that requests running there have too.
    pub in_flight_blocks: u32,
    /// The share of an idle cached prefix that survives there until a request reaches it.
    pub survival: f64,
    /// Requests running there (hinted by any replica) whose prompts have the request's longest
    /// match too ([`crate::core::load::WorkerLoad::in_flight_sharing`]).
    pub prefix_in_flight: u32,
    /// The prefixes of `home_key_blocks` blocks it is home to: those its caches hold, as the
    /// index says ([`crate::core::homes`]), and those of requests running there whose events
    /// have not said so yet. Every replica counts alike once their indexes agree. Read only for
    /// a prompt nothing matches (the home balance).
    pub homes: Option<f64>,
    /// A disaggregated fleet's prefill worker (which `home_slack_blocks` applies to by default).
    pub prefill: bool,
}

/// What the rule knows of the request's prompt.
#[derive(Debug, Clone, Copy, Default)]
pub struct Prompt {
    /// Its length in blocks.
    pub blocks: u32,
    /// Its first blocks' prefix hash: its home when nothing matches.
    pub home_key: Option<u64>,
    /// The whole prompt's: it orders workers that tie.
    pub tie_key: u64,
    /// Whether it branches off its longest match in a new way where other recent requests
    /// branched off too (a popular prefix), and that match's share of the recent requests
    /// ([`crate::core::shared_prefix`]).
    pub popularity: Popularity,
}

/// Decide where `prompt` goes. `matches` are (worker, matched blocks) from the index;
/// `workers` are the usable workers.
pub fn choose<'a>(
    prompt: Prompt,
    matches: &[(WorkerId, u32)],
    workers: impl IntoIterator<Item = Worker<'a>>,
    routing: &RoutingConfig,
) -> Decision {
    let Prompt {
        blocks: prompt_blocks,
        home_key,
        tie_key,
        popularity,
    } = prompt;
    let min = routing.min_matched_blocks.max(1);
    let matched = |w: WorkerId| matches.iter().find(|(m, _)| *m == w).map_or(0, |&(_, n)| n);
    let mut candidates: Vec<Candidate> = workers
        .into_iter()
        .map(|w| {
            let mut c = Candidate {
                id: w.id,
                worker: w.address.to_owned(),
                matched_blocks: matched(w.id),
                in_flight_blocks: if routing.predict_survival {
                    w.in_flight_blocks.min(prompt_blocks)
                } else {
                    0
                },
                survival: if routing.predict_survival {
                    w.survival.clamp(0.0, 1.0)
                } else {
                    1.0
                },
                prefix_in_flight: w.prefix_in_flight,
                homes: w.homes,
                load: w.load,
                saturated: false,
                home_slack_blocks: routing.home_slack_blocks_for(w.prefill),
                cost: 0.0,
                tie: home_score(tie_key, w.address),
            };
            c.cost = (f64::from(prompt_blocks) - c.expected_blocks()).max(0.0)
                + w.load.queued_prefill_blocks
                + routing.load_penalty_blocks * w.load.busy();
            c
        })
        .collect();
    // Over a threshold counts only on a worker busier than the fleet's mean: where every worker
    // is as busy, a move pays the prompt's prefill (and evicts another's prefix) to save no
    // queue, and a fleet near saturation that moves its requests that way loses its hit rate
    // and collapses (docs/benchmarks.md, "Under load").
    let mean = mean_busy(&candidates);
    for c in &mut candidates {
        c.saturated =
            saturated(&c.load, routing) && c.load.busy() >= mean + routing.saturation_slack;
    }
    // Unsaturated first, then the cheapest, then the fewest hinted requests, the longest match,
    // the prompt's rendezvous order.
    candidates.sort_by(|a, b| {
        a.saturated
            .cmp(&b.saturated)
            .then(a.cost.total_cmp(&b.cost))
            .then(a.load.hinted_in_flight.total_cmp(&b.load.hinted_in_flight))
            .then(b.held().cmp(&a.held()))
            .then(b.tie.cmp(&a.tie))
            .then(a.id.cmp(&b.id))
    });
    let longest = candidates.iter().map(Candidate::held).max().unwrap_or(0);
    let rule = match candidates.first() {
        _ if longest < min => Rule::NoMatch,
        Some(first) if first.held() == longest => Rule::LongestMatch,
        _ => Rule::LeastLoaded,
    };
    let rule = match rule {
        Rule::LongestMatch if spread(&mut candidates, longest, popularity, routing) => Rule::Spread,
        rule => rule,
    };
    if let (Rule::NoMatch, Some(key)) = (rule, home_key) {
        // Saturated workers sort last: when the first is saturated, all are. A home already
        // busier than the least loaded worker by `home_slack` requests hands over too: a burst
        // of one cold prefix spreads instead of queueing on one engine.
        let unsaturated = candidates.iter().take_while(|c| !c.saturated).count();
        let least_busy = candidates[..unsaturated]
            .iter()
            .map(|c| c.load.busy())
            .fold(f64::INFINITY, f64::min);
        let least_blocks = candidates[..unsaturated]
            .iter()
            .map(|c| c.load.running_prompt_blocks)
            .fold(f64::INFINITY, f64::min);
        // Bounded-load rendezvous: a worker is a new prefix's home only while it is home to
        // fewer than `home_balance` × its share of the prefixes counting this one, rounded up
        // (consistent hashing with bounded loads). A prefix's home is where its later requests
        // stay; by hashing alone, 32 prefixes on 8 workers put 6 or 7 on one and 2 on another,
        // for good, and a bound of the mean and half a prefix still let four prefixes on four
        // workers share one while another had none (docs/benchmarks.md, "Homes balanced by the
        // index"). `inf` is off (the capacity is infinite).
        let total_homes: f64 = candidates[..unsaturated]
            .iter()
            .map(|c| c.homes.unwrap_or(0.0))
            .sum();
        let capacity =
            (routing.home_balance * (total_homes + 1.0) / unsaturated.max(1) as f64).ceil();
        let home = (0..unsaturated)
            .filter(|&i| candidates[i].homes.unwrap_or(0.0) < capacity)
            .filter(|&i| candidates[i].load.busy() <= least_busy + routing.home_slack)
            .filter(|&i| {
                let c = &candidates[i];
                c.home_slack_blocks
                    .is_none_or(|slack| c.load.running_prompt_blocks <= least_blocks + slack)
            })
            .max_by_key(|&i| home_score(key, &candidates[i].worker));
        if let Some(home) = home {
            candidates[..=home].rotate_right(1);
        }
    }
    let chosen = &candidates[..candidates.len().min(routing.max_hinted_workers.max(1))];
    Decision {
        workers: chosen.iter().map(|c| c.id).collect(),
        matched_blocks: chosen.first().map_or(0, |c| c.matched_blocks),
        rule,
        candidates,
    }
}

/// Put first a worker without the longest match when the match is a popular prefix — recent
/// requests branched off it in other ways (`shared`), or several workers hold it — with more
/// requests per holder than `spread_demand` of a worker's share, that queues on its holders:
/// the cheapest holder (first) is `spread_slack` requests busier than that worker and than the
/// workers without it on average, and runs at least `spread_slack` requests of this prefix
/// (`spread_idle_slack` when that worker runs nothing). The one-request rule never pays a long
/// prefix's prefill to make another holder, so a hot prefix stays on the workers that happened
/// to take it first and queues there while another worker idles (docs/benchmarks.md,
/// "Spreading a popular prefix"). Whether the prefill is worth it is the next requests'
/// question, which a prefix with its own queue answers yes; one whose holder is busy with other
/// prefixes' requests answers no — the move only pays a prefill, and near saturation each one
/// slows the fleet into more (docs/benchmarks.md, "Under load"). One conversation's history,
/// which only its own turns continue, is neither. Whether a move happened.
fn spread(
    candidates: &mut [Candidate],
    longest: u32,
    popularity: Popularity,
    routing: &RoutingConfig,
) -> bool {
    let holders = candidates.iter().filter(|c| c.held() == longest).count();
    let Some(first) = candidates.first().filter(|c| !c.saturated) else {
        return false;
    };
    if holders < 2 && !popularity.shared {
        return false;
    }
    // Only a prefix worth a good part of a worker per holder: a queue on the one holder of a
    // prefix that is one of many is a burst the holder clears in a few hundred ms, cheaper
    // than the copy's cold prefill, which lands in the slowest tenth (docs/benchmarks.md,
    // "Spreading by demand, homes by bounded load").
    let per_holder = popularity.share * candidates.len() as f64 / holders.max(1) as f64;
    if per_holder <= routing.spread_demand {
        return false;
    }
    // Only from a holder busier than the other workers are on average — by the slack and twice
    // over —, not merely than the least busy of them: under even load every prefix is
    // "popular", some worker is a few requests below any holder by chance, and each copy made
    // evicts another prefix for no queue saved.
    let (others, others_busy) = candidates
        .iter()
        .filter(|c| c.held() < longest)
        .fold((0usize, 0.0), |(n, sum), c| (n + 1, sum + c.load.busy()));
    let others_mean = others_busy / others.max(1) as f64;
    let outlier = (others_mean + routing.spread_slack).max(2.0 * others_mean);
    if others == 0 || first.load.busy() < outlier {
        return false;
    }
    let busiest_allowed = first.load.busy() - routing.spread_slack;
    let target = candidates
        .iter()
        .enumerate()
        .filter(|(_, c)| !c.saturated && c.held() < longest)
        .filter(|(_, c)| c.load.busy() <= busiest_allowed)
        .min_by(|(_, a), (_, b)| a.load.busy().total_cmp(&b.load.busy()));
    // The copy's prefill slows the requests batched with it on a busy worker, which pays only
    // for a prefix with its own queue at the holder; on a worker running nothing it slows no
    // one, and pays for a prefix with a shorter one.
    let own = f64::from(first.prefix_in_flight);
    match target {
        Some((i, c))
            if own >= routing.spread_slack
                || (c.load.busy() < 1.0 && own >= routing.spread_idle_slack) =>
        {
            candidates[..=i].rotate_right(1);
            true
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` workers, `127.0.0.1:8000` on.
    fn registry(n: usize) -> Vec<String> {
        (0..n).map(addr).collect()
    }

    /// [`super::choose`] over the workers of `reg` that are `healthy`, with loads from `load_of`.
    fn choose(
        prompt_blocks: u32,
        home_key: Option<u64>,
        matches: &[(WorkerId, u32)],
        reg: &[String],
        routing: &RoutingConfig,
        load_of: impl Fn(WorkerId) -> Load,
        healthy: impl Fn(WorkerId) -> bool,
    ) -> Decision {
        let workers = reg
            .iter()
            .enumerate()
            .map(|(i, a)| (WorkerId(i as u32), a.as_str()))
            .filter(|(w, _)| healthy(*w))
            .map(|(id, address)| worker(id.0 as usize, address, load_of(id)));
        let prompt = Prompt {
            blocks: prompt_blocks,
            home_key,
            ..Prompt::default()
        };
        super::choose(prompt, matches, workers, routing)
    }

    /// Worker `i` at `address` with `load`, no running request sharing the prompt, every idle
    /// prefix surviving.
    fn worker(i: usize, address: &str, load: Load) -> Worker<'_> {
        Worker {
            id: WorkerId(i as u32),
            address,
            load,
            in_flight_blocks: 0,
            survival: 1.0,
            prefix_in_flight: 0,
            homes: None,
            prefill: false,
        }
    }

    /// The hinted workers' addresses.
    fn order(d: &Decision) -> Vec<String> {
        d.workers.iter().map(|w| addr(w.0 as usize)).collect()
    }

    fn idle(_: WorkerId) -> Load {
        Load::default()
    }

    fn all(_: WorkerId) -> bool {
        true
    }

    /// Workers with this many requests the sidecar did not hint (as a scrape shows them).
    fn running(per_worker: &'static [f64]) -> impl Fn(WorkerId) -> Load {
        move |w| Load {
            running: per_worker[w.0 as usize],
            unhinted: per_worker[w.0 as usize],
            ..Load::default()
        }
    }

    /// The decision on a 23-block prompt over `reg` with `matches`, whether it branches off its
    /// match where others did (`shared`), each worker running `requests` as a scrape shows them,
    /// of which each holder's are requests of the matched prefix up to `own`.
    fn decide_23_blocks(
        reg: &[String],
        matches: &[(WorkerId, u32)],
        popularity: Popularity,
        own: u32,
        requests: &'static [f64],
        routing: &RoutingConfig,
    ) -> Decision {
        let load = running(requests);
        let workers = reg.iter().enumerate().map(|(i, a)| {
            let holder = matches.iter().any(|(w, _)| w.0 as usize == i);
            Worker {
                prefix_in_flight: if holder {
                    (requests[i] as u32).min(own)
                } else {
                    0
                },
                ..worker(i, a, load(WorkerId(i as u32)))
            }
        });
        let prompt = Prompt {
            blocks: 23,
            popularity,
            ..Prompt::default()
        };
        super::choose(prompt, matches, workers, routing)
    }

    /// A prefix behind every recent request, branched off in other ways (`shared`) or not.
    fn popular(shared: bool) -> Popularity {
        Popularity { shared, share: 1.0 }
    }

    fn addr(i: usize) -> String {
        format!("127.0.0.1:{}", 8000 + i)
    }

    #[test]
    fn longest_match_then_next_best() {
        let reg = registry(3);
        let m = [(WorkerId(0), 2), (WorkerId(1), 5), (WorkerId(2), 3)];
        let d = choose(10, None, &m, &reg, &RoutingConfig::default(), idle, all);
        assert_eq!(d.rule, Rule::LongestMatch);
        assert_eq!(order(&d), vec![addr(1), addr(2), addr(0)]);
        assert_eq!(d.matched_blocks, 5);
    }

    #[test]
    fn ties_go_to_the_least_loaded() {
        let reg = registry(3);
        let m = [(WorkerId(0), 4), (WorkerId(1), 4), (WorkerId(2), 4)];
        let d = choose(
            10,
            None,
            &m,
            &reg,
            &RoutingConfig::default(),
            running(&[3.0, 1.0, 2.0]),
            all,
        );
        assert_eq!(order(&d), vec![addr(1), addr(2), addr(0)]);
    }

    #[test]
    fn hinted_requests_count_before_the_engine_reports_them() {
        let reg = registry(2);
        let routing = RoutingConfig::default();
        // The last scrape says worker 0 is idle, but three hinted requests have not finished.
        let hinted = |w: WorkerId| Load {
            hinted_in_flight: if w.0 == 0 { 3.0 } else { 0.0 },
            ..Load::default()
        };
        let tie = [(WorkerId(0), 4), (WorkerId(1), 4)];
        let d = choose(10, None, &tie, &reg, &routing, hinted, all);
        assert_eq!(order(&d)[0], addr(1));
        // Three requests (6 blocks at the default penalty of 2) outweigh 5 more cached blocks,
        // not 7.
        assert_eq!(routing.load_penalty_blocks, 2.0);
        let d = choose(
            40,
            None,
            &[(WorkerId(0), 9), (WorkerId(1), 4)],
            &reg,
            &routing,
            hinted,
            all,
        );
        assert_eq!(order(&d)[0], addr(1));
        let d = choose(
            40,
            None,
            &[(WorkerId(0), 11), (WorkerId(1), 4)],
            &reg,
            &routing,
            hinted,
            all,
        );
        assert_eq!(order(&d)[0], addr(0));
        // Requests other routers sent count too.
        let others = |w: WorkerId| Load {
            hinted_in_flight: if w.0 == 0 { 3.0 } else { 0.0 },
            unhinted: if w.0 == 1 { 4.0 } else { 0.0 },
            ..Load::default()
        };
        let d = choose(10, None, &tie, &reg, &routing, others, all);
        assert_eq!(order(&d)[0], addr(0));
    }

    #[test]
    fn queued_prefill_counts_as_blocks_to_wait_for() {
        let reg = registry(2);
        let backlog = |w: WorkerId| Load {
            queued_prefill_blocks: if w.0 == 0 { 30.0 } else { 0.0 },
            ..Load::default()
        };
        // 20 cached blocks do not beat 30 blocks of other prompts' prefill queued ahead.
        let m = [(WorkerId(0), 20), (WorkerId(1), 0)];
        let d = choose(40, None, &m, &reg, &RoutingConfig::default(), backlog, all);
        assert_eq!(order(&d)[0], addr(1));
        assert_eq!(d.candidates[1].cost, 50.0);
    }

    #[test]
    fn load_outweighs_a_short_match_but_not_a_long_one() {
        let reg = registry(2);
        let routing = RoutingConfig::default();
        // Two shared blocks on a busy worker are not worth its queue.
        let d = choose(
            20,
            None,
            &[(WorkerId(0), 2)],
            &reg,
            &routing,
            running(&[3.0, 0.0]),
            all,
        );
        assert_eq!(d.rule, Rule::LeastLoaded);
        assert_eq!(order(&d), vec![addr(1), addr(0)]);
        // Ninety cached blocks are worth waiting behind two requests.
        let d = choose(
            100,
            None,
            &[(WorkerId(0), 90)],
            &reg,
            &routing,
            running(&[2.0, 0.0]),
            all,
        );
        assert_eq!(d.rule, Rule::LongestMatch);
        assert_eq!(order(&d)[0], addr(0));
    }

    #[test]
    fn ties_spread_by_prompt_the_same_on_every_replica() {
        let reg = registry(4);
        let routing = RoutingConfig::default();
        let every = [
            (WorkerId(0), 5),
            (WorkerId(1), 5),
            (WorkerId(2), 5),
            (WorkerId(3), 5),
        ];
        let first = |tie_key: u64| {
            let workers = reg
                .iter()
                .enumerate()
                .map(|(i, a)| worker(i, a, Load::default()));
            let prompt = Prompt {
                blocks: 10,
                tie_key,
                ..Prompt::default()
            };
            super::choose(prompt, &every, workers, &routing).workers[0]
        };
        let mut chosen = [0; 4];
        for key in 0..400u64 {
            let w = first(key);
            assert_eq!(first(key), w, "the same prompt, the same worker");
            chosen[w.0 as usize] += 1;
        }
        // 100 each if even; the lowest id took all 400 before.
        assert!(
            chosen.iter().all(|&n| (60..=140).contains(&n)),
            "{chosen:?}"
        );
    }

    #[test]
    fn a_stale_scraped_queue_does_not_outlive_the_requests() {
        let routing = RoutingConfig::default();
        let scraped = |hinted, unhinted| Load {
            waiting: routing.max_waiting,
            hinted_in_flight: hinted,
            unhinted,
            ..Load::default()
        };
        let half = routing.max_waiting / 2.0;
        assert!(
            saturated(&scraped(half, half), &routing),
            "a queue it can hold"
        );
        assert!(saturated(
            &scraped(routing.max_waiting + 2.0, 0.0),
            &routing
        ));
        assert!(
            !saturated(&scraped(1.0, 0.0), &routing),
            "one request left: no queue of max_waiting"
        );
        assert!(!saturated(&scraped(0.0, 0.0), &routing), "drained");
    }

    /// A full cache is how a busy engine with a small cache runs: only a configured threshold
    /// makes KV usage alone a reason to pass a worker over.
    #[test]
    fn kv_usage_saturates_only_when_configured() {
        let full = Load {
            kv_usage: 1.0,
            running: 3.0,
            ..Load::default()
        };
        assert!(!saturated(&full, &RoutingConfig::default()));
        let configured = RoutingConfig {
            max_kv_usage: Some(0.95),
            ..RoutingConfig::default()
        };
        assert!(saturated(&full, &configured));
    }

    /// With `waiting_kv_usage`, a queue saturates only an engine whose requests wait for cache
    /// blocks, not one queueing for compute with its cache to spare.
    #[test]
    fn a_queue_saturates_at_the_kv_usage_set() {
        let queued = |kv_usage: f64| Load {
            waiting: 8.0,
            unhinted: 8.0,
            kv_usage,
            queue_reported: true,
            ..Load::default()
        };
        let routing = RoutingConfig::default();
        assert!(saturated(&queued(0.5), &routing), "any queue by default");
        let set = RoutingConfig {
            waiting_kv_usage: Some(0.9),
            ..RoutingConfig::default()
        };
        assert!(!saturated(&queued(0.5), &set));
        assert!(!saturated(&queued(0.0), &set), "usage not read");
        assert!(saturated(&queued(0.95), &set));
        assert!(!saturated(
            &Load {
                waiting: 7.0,
                ..queued(1.0)
            },
            &set
        ));
    }

    #[test]
    fn saturated_workers_come_last() {
        let reg = registry(3);
        let routing = RoutingConfig::default();
        // As a scrape shows a queue: its requests are counted too.
        let queue = |w: WorkerId| Load {
            waiting: if w.0 == 0 { routing.max_waiting } else { 0.0 },
            unhinted: if w.0 == 0 { routing.max_waiting } else { 0.0 },
            ..Load::default()
        };
        let d = choose(
            100,
            None,
            &[(WorkerId(0), 99), (WorkerId(2), 3)],
            &reg,
            &routing,
            queue,
            all,
        );
        assert_eq!(d.rule, Rule::LeastLoaded);
        assert_eq!(order(&d), vec![addr(2), addr(1), addr(0)]);
        assert!(d.candidates[2].saturated);
    }

    #[test]
    fn unhealthy_workers_are_never_hinted() {
        let reg = registry(3);
        let m = [(WorkerId(1), 9), (WorkerId(2), 1)];
        let d = choose(10, None, &m, &reg, &RoutingConfig::default(), idle, |w| {
            w.0 != 1
        });
        assert!(!order(&d).contains(&addr(1)));
        assert_eq!(order(&d)[0], addr(2));
        assert_eq!(d.candidates.len(), 2);
    }

    /// A worker home to its share of the prefixes (counting the new one, rounded up) is passed
    /// over for the key's next home: prefixes are placed by hashing with bounded loads.
    #[test]
    fn a_home_to_its_share_is_passed_over() {
        let reg = registry(4);
        let routing = RoutingConfig::default();
        assert_eq!(routing.home_balance, 1.0);
        let decide = |key: u64, homes: [f64; 4], routing: &RoutingConfig| {
            let workers = reg.iter().enumerate().map(|(i, a)| Worker {
                homes: Some(homes[i]),
                ..worker(i, a, Load::default())
            });
            let prompt = Prompt {
                blocks: 10,
                home_key: Some(key),
                ..Prompt::default()
            };
            let d = super::choose(prompt, &[], workers, routing);
            assert_eq!(d.rule, Rule::NoMatch);
            order(&d)[0].clone()
        };
        let key = (0..64u64)
            .find(|&k| decide(k, [2.0; 4], &routing) == addr(1))
            .unwrap();
        // Four prefixes on four workers: the fourth goes where there is none (seen on Dynamo's
        // mockers: two apps shared a worker while another had no home).
        assert_eq!(decide(key, [1.0, 1.0, 1.0, 0.0], &routing), addr(3));
        assert_eq!(decide(key, [3.0, 3.0, 3.0, 2.0], &routing), addr(3));
        // 10 counting this one: up to 3 each, so the key's home with 3 is passed over.
        let next = decide(key, [2.0, 3.0, 2.0, 2.0], &routing);
        assert_ne!(next, addr(1));
        let without = choose(10, Some(key), &[], &reg, &routing, idle, |w| w.0 != 1);
        assert_eq!(next, order(&without)[0], "the key's next home");
        let off = RoutingConfig {
            home_balance: f64::INFINITY,
            ..RoutingConfig::default()
        };
        assert_eq!(decide(key, [0.0, 40.0, 0.0, 0.0], &off), addr(1));
    }

    #[test]
    fn cold_prompts_go_to_their_home_unless_it_is_saturated() {
        let reg = registry(4);
        let routing = RoutingConfig::default();
        let load = running(&[0.0, 3.0, 1.0, 2.0]);
        let homes: Vec<String> = (0..64u64)
            .map(|key| order(&choose(10, Some(key), &[], &reg, &routing, &load, all))[0].clone())
            .collect();
        // Load does not move a home; keys spread over every worker.
        for (key, home) in homes.iter().enumerate() {
            let d = choose(10, Some(key as u64), &[], &reg, &routing, idle, all);
            assert_eq!(d.rule, Rule::NoMatch);
            assert_eq!(&order(&d)[0], home);
        }
        for w in 0..4 {
            assert!(homes.contains(&addr(w)), "worker {w} is no key's home");
        }
        // A saturated home gives way to the key's next home (what it would be without that
        // worker), whatever the load; without a key, the least loaded worker wins.
        let key = (0..64u64).find(|&k| homes[k as usize] == addr(1)).unwrap();
        let full = |w: WorkerId| {
            let n = if w.0 == 1 { 99.0 } else { f64::from(w.0) };
            Load {
                running: n,
                unhinted: n,
                ..Load::default()
            }
        };
        let d = choose(10, Some(key), &[], &reg, &routing, full, all);
        let next = choose(10, Some(key), &[], &reg, &routing, idle, |w| w.0 != 1);
        assert_eq!(order(&d)[0], order(&next)[0]);
        assert_ne!(order(&d)[0], addr(1));
        let d = choose(10, None, &[], &reg, &routing, &load, all);
        assert_eq!(order(&d)[0], addr(0));
        // A home busier than the least loaded worker by more than `home_slack` hands over.
        let busy = |extra: f64| {
            move |w: WorkerId| {
                let n = if w.0 == 1 { extra } else { 0.0 };
                Load {
                    running: n,
                    unhinted: n,
                    ..Load::default()
                }
            }
        };
        let at_slack = choose(
            10,
            Some(key),
            &[],
            &reg,
            &routing,
            busy(routing.home_slack),
            all,
        );
        assert_eq!(order(&at_slack)[0], addr(1));
        let over = choose(
            10,
            Some(key),
            &[],
            &reg,
            &routing,
            busy(routing.home_slack + 1.0),
            all,
        );
        assert_eq!(order(&over)[0], order(&next)[0]);
        // With `home_slack_blocks`, a home running more distinct prompt blocks than the
        // fewest by more than that hands over too. Unset, it applies to prefill workers only:
        // blocks in flight do not move an aggregated worker's home.
        let by_blocks = RoutingConfig {
            home_slack_blocks: Some(16.0),
            ..RoutingConfig::default()
        };
        let first = |routing: &RoutingConfig, prefill: bool, extra: f64| {
            let workers = reg.iter().enumerate().map(|(i, a)| Worker {
                prefill,
                ..worker(
                    i,
                    a,
                    Load {
                        running_prompt_blocks: if i == 1 { extra } else { 0.0 },
                        ..Load::default()
                    },
                )
            });
            let prompt = Prompt {
                blocks: 10,
                home_key: Some(key),
                ..Prompt::default()
            };
            order(&super::choose(prompt, &[], workers, routing))[0].clone()
        };
        for prefill in [false, true] {
            assert_eq!(first(&by_blocks, prefill, 16.0), addr(1));
            assert_eq!(first(&by_blocks, prefill, 17.0), order(&next)[0]);
        }
        let slack = crate::config::PREFILL_HOME_SLACK_BLOCKS;
        assert_eq!(first(&routing, true, slack), addr(1));
        assert_eq!(first(&routing, true, slack + 1.0), order(&next)[0]);
        assert_eq!(first(&routing, false, 99.0), addr(1));
    }

    #[test]
    fn no_useful_match_goes_to_the_least_loaded() {
        let reg = registry(3);
        let strict = RoutingConfig {
            min_matched_blocks: 2,
            ..RoutingConfig::default()
        };
        let load = running(&[2.0, 0.0, 1.0]);
        let d = choose(10, None, &[(WorkerId(0), 1)], &reg, &strict, load, all);
        assert_eq!(d.rule, Rule::NoMatch);
        assert_eq!(order(&d), vec![addr(1), addr(2), addr(0)]);
        assert_eq!(d.matched_blocks, 0);
        let d = choose(
            10,
            None,
            &[],
            &reg,
            &RoutingConfig::default(),
            running(&[2.0, 0.0, 1.0]),
            all,
        );
        assert_eq!(d.rule, Rule::NoMatch);
        assert_eq!(order(&d)[0], addr(1));
        // Nobody healthy: no hint, Envoy's fallback decides.
        let d = choose(10, None, &[], &reg, &RoutingConfig::default(), idle, |_| {
            false
        });
        assert!(d.workers.is_empty());
        assert_eq!(d.matched_blocks, 0);
    }

    /// What a worker will still hold decides, not what the index last heard: blocks running
    /// requests share count in full, an idle match by the share that survives there.
    #[test]
    fn an_evicted_match_weighs_less_than_a_running_prefix() {
        let reg = registry(2);
        let routing = RoutingConfig::default();
        let decide = |in_flight: [u32; 2], survival: [f64; 2], requests: &'static [f64]| {
            let load = running(requests);
            let workers = reg.iter().enumerate().map(|(i, a)| Worker {
                in_flight_blocks: in_flight[i],
                survival: survival[i],
                ..worker(i, a, load(WorkerId(i as u32)))
            });
            let prompt = Prompt {
                blocks: 30,
                ..Prompt::default()
            };
            // Worker 0's index holds 24 blocks of the conversation, worker 1 none.
            super::choose(prompt, &[(WorkerId(0), 24)], workers, &routing)
        };
        // Trusted index: 24 cached blocks outweigh 3 more requests.
        let d = decide([0, 0], [1.0, 1.0], &[4.0, 1.0]);
        assert_eq!(
            (d.rule, order(&d)[0].clone()),
            (Rule::LongestMatch, addr(0))
        );
        // On a worker where idle prefixes are mostly evicted before a request reaches them, the
        // same match is worth less than the queue.
        let d = decide([0, 0], [0.2, 1.0], &[4.0, 1.0]);
        assert_eq!((d.rule, order(&d)[0].clone()), (Rule::LeastLoaded, addr(1)));
        // Unless a running request shares the match's first 16 blocks: those stay.
        let d = decide([16, 0], [0.2, 1.0], &[4.0, 1.0]);
        assert_eq!(order(&d)[0], addr(0));
        assert_eq!(d.candidates[0].cost, 30.0 - (16.0 + 0.2 * 8.0) + 8.0);
        // A prompt running requests hold where the index knows nothing yet (their events not
        // in) is held there too.
        let d = decide([0, 20], [1.0, 1.0], &[0.0, 1.0]);
        assert_eq!(
            (d.rule, order(&d)[0].clone()),
            (Rule::LongestMatch, addr(0))
        );
        let d = decide([0, 28], [1.0, 1.0], &[0.0, 1.0]);
        assert_eq!(
            (d.rule, order(&d)[0].clone()),
            (Rule::LongestMatch, addr(1))
        );
        // Off, the index alone counts.
        let off = RoutingConfig {
            predict_survival: false,
            ..RoutingConfig::default()
        };
        let workers = reg.iter().enumerate().map(|(i, a)| Worker {
            in_flight_blocks: 28 * i as u32,
            survival: 0.2,
            ..worker(i, a, Load::default())
        });
        let prompt = Prompt {
            blocks: 30,
            ..Prompt::default()
        };
        let d = super::choose(prompt, &[(WorkerId(0), 24)], workers, &off);
        assert_eq!(order(&d)[0], addr(0));
        assert_eq!(d.candidates[0].cost, 6.0);
    }

    /// A prefix three of four workers hold spreads to the fourth once each holder is
    /// `spread_slack` requests busier; a prefix one worker holds spreads only if other requests
    /// branched off it in other ways too (not one conversation's own turns).
    #[test]
    fn a_popular_prefix_spreads_to_an_idle_worker() {
        let reg = registry(4);
        assert_eq!(RoutingConfig::default().spread_slack, 4.0);
        // A 23-block prompt, whether it branches off its match where others did, the workers'
        // requests, the routing knobs.
        let decide = |matches: &[(WorkerId, u32)],
                      shared: bool,
                      requests: &'static [f64],
                      routing: &RoutingConfig| {
            decide_23_blocks(&reg, matches, popular(shared), u32::MAX, requests, routing)
        };
        let routing = RoutingConfig::default();
        let three = [(WorkerId(0), 20), (WorkerId(1), 20), (WorkerId(2), 20)];
        let d = decide(&three, false, &[5.0, 5.0, 5.0, 1.0], &routing);
        assert_eq!(d.rule, Rule::Spread);
        assert_eq!(order(&d)[0], addr(3));
        // Short of the slack, the cheapest holder keeps it.
        let d = decide(&three, false, &[5.0, 5.0, 5.0, 2.0], &routing);
        assert_eq!(d.rule, Rule::LongestMatch);
        assert_ne!(order(&d)[0], addr(3));
        // One holder: the match is one conversation's, worth its queue.
        let one = [(WorkerId(0), 20)];
        let d = decide(&one, false, &[5.0, 1.0, 1.0, 1.0], &routing);
        assert_eq!(d.rule, Rule::LongestMatch);
        assert_eq!(order(&d)[0], addr(0));
        // One holder of a prefix other requests branched off too (an app's system prompt).
        let d = decide(&one, true, &[5.0, 1.0, 1.0, 1.0], &routing);
        assert_eq!(d.rule, Rule::Spread);
        assert_ne!(order(&d)[0], addr(0));
        // Off when the slack is out of reach.
        let off = RoutingConfig {
            spread_slack: f64::INFINITY,
            ..RoutingConfig::default()
        };
        let d = decide(&three, false, &[5.0, 5.0, 5.0, 1.0], &off);
        assert_eq!(d.rule, Rule::LongestMatch);
    }

    /// A prefix spreads only while its requests per holder are more than half a worker's
    /// share: one of 32 groups, queueing on its one holder of 8 in a burst, stays; a prefix
    /// behind a quarter of the requests spreads to a second holder, not a fifth.
    #[test]
    fn a_prefix_spreads_only_past_half_a_worker_per_holder() {
        let reg = registry(8);
        let routing = RoutingConfig::default();
        assert_eq!(routing.spread_demand, 0.5);
        // The holders are among the busy workers; 1, 2 and 3 run nothing.
        let requests: &[f64] = &[8.0, 0.0, 0.0, 0.0, 8.0, 8.0, 8.0, 4.0];
        let holding = |ids: &[u32]| ids.iter().map(|&i| (WorkerId(i), 20)).collect::<Vec<_>>();
        let (one, three, four) = (holding(&[0]), holding(&[0, 4, 5]), holding(&[0, 4, 5, 6]));
        let decide = |holders: &[(WorkerId, u32)], share, routing: &RoutingConfig| {
            let popularity = Popularity {
                shared: true,
                share,
            };
            decide_23_blocks(&reg, holders, popularity, u32::MAX, requests, routing).rule
        };
        assert_eq!(decide(&one, 1.0 / 32.0, &routing), Rule::LongestMatch);
        assert_eq!(decide(&one, 1.0 / 16.0, &routing), Rule::LongestMatch);
        assert_eq!(decide(&one, 0.25, &routing), Rule::Spread);
        assert_eq!(decide(&three, 0.25, &routing), Rule::Spread);
        assert_eq!(decide(&four, 0.25, &routing), Rule::LongestMatch);
        assert_eq!(decide(&four, 0.3, &routing), Rule::Spread);
        let off = RoutingConfig {
            spread_demand: 0.0,
            ..RoutingConfig::default()
        };
        assert_eq!(decide(&one, 1.0 / 32.0, &off), Rule::Spread);
    }

    /// A popular prefix whose holders are busy with other prefixes' requests stays: a copy on a
    /// busy worker would pay its prefill, slowing the requests there, while the holders'
    /// queues, not this prefix's, stay where they are. On a worker running nothing, a smaller
    /// own queue (`spread_idle_slack`) is enough.
    #[test]
    fn a_prefix_without_its_own_queue_does_not_spread() {
        let reg = registry(4);
        let routing = RoutingConfig::default();
        let three = [(WorkerId(0), 20), (WorkerId(1), 20), (WorkerId(2), 20)];
        let decide =
            |own, requests| decide_23_blocks(&reg, &three, popular(true), own, requests, &routing);
        let (busy, idle) = (&[5.0, 5.0, 5.0, 1.0], &[5.0, 5.0, 5.0, 0.0]);
        assert_eq!(decide(4, busy).rule, Rule::Spread);
        let d = decide(3, busy);
        assert_eq!(d.rule, Rule::LongestMatch);
        assert_ne!(order(&d)[0], addr(3));
        assert_eq!(d.candidates[0].prefix_in_flight, 3);
        let d = decide(2, idle);
        assert_eq!((d.rule, order(&d)[0].clone()), (Rule::Spread, addr(3)));
        assert_eq!(decide(1, idle).rule, Rule::LongestMatch);
        let higher = RoutingConfig {
            spread_idle_slack: 4.0,
            ..RoutingConfig::default()
        };
        let decide =
            |own, requests| decide_23_blocks(&reg, &three, popular(true), own, requests, &higher);
        assert_eq!(decide(3, idle).rule, Rule::LongestMatch);
        assert_eq!(decide(4, idle).rule, Rule::Spread);
    }

    /// A fleet busy all over keeps each prompt where its prefix is: a holder over
    /// `max_in_flight`, but no busier than the rest, is not passed over for a worker a couple
    /// of requests less busy (that move would pay 20 blocks of prefill to save no queue); an
    /// outlier still is.
    #[test]
    fn an_evenly_busy_fleet_keeps_prompts_on_their_holders() {
        let reg = registry(4);
        let routing = RoutingConfig::default();
        let matches = [(WorkerId(0), 20)];
        let d = choose(
            23,
            None,
            &matches,
            &reg,
            &routing,
            running(&[16.0, 14.0, 15.0, 14.0]),
            all,
        );
        assert_eq!(d.rule, Rule::LongestMatch);
        assert_eq!(order(&d)[0], addr(0));
        assert!(d.candidates.iter().all(|c| !c.saturated));
        let d = choose(
            23,
            None,
            &matches,
            &reg,
            &routing,
            running(&[22.0, 14.0, 15.0, 14.0]),
            all,
        );
        assert_eq!(d.rule, Rule::LeastLoaded, "well above the fleet's mean");
        assert_ne!(order(&d)[0], addr(0));
    }

    /// An engine that reports its queue is saturated by its queue, not by its requests: one
    /// running past `max_in_flight` with nothing waiting keeps the prompt its cache holds.
    #[test]
    fn a_reported_queue_decides_saturation_not_a_request_count() {
        let routing = RoutingConfig::default();
        let load = |requests: f64, waiting: f64, queue_reported: bool| Load {
            running: requests,
            unhinted: requests,
            waiting,
            queue_reported,
            ..Load::default()
        };
        let busy = routing.max_in_flight + 4.0;
        assert!(saturated(&load(busy, 0.0, false), &routing));
        assert!(!saturated(&load(busy, 0.0, true), &routing));
        assert!(saturated(&load(busy, routing.max_waiting, true), &routing));
        // In a decision: the holder runs 22 where the others run 14, nothing waits anywhere.
        let reg = registry(4);
        let workers = reg.iter().enumerate().map(|(i, a)| {
            let requests = if i == 0 { 22.0 } else { 14.0 };
            worker(i, a, load(requests, 0.0, true))
        });
        let prompt = Prompt {
            blocks: 23,
            ..Prompt::default()
        };
        let d = super::choose(prompt, &[(WorkerId(0), 20)], workers, &routing);
        assert_eq!(
            (d.rule, order(&d)[0].clone()),
            (Rule::LongestMatch, addr(0))
        );
    }

    /// Under even load a popular prefix stays where it is: its holders are busier than the
    /// least busy worker by the slack, but not than the other workers on average.
    #[test]
    fn a_popular_prefix_does_not_spread_under_even_load() {
        let reg = registry(6);
        let routing = RoutingConfig::default();
        let matches = [(WorkerId(0), 20), (WorkerId(1), 20)];
        let decide = |requests| {
            decide_23_blocks(&reg, &matches, popular(true), u32::MAX, requests, &routing)
        };
        let d = decide(&[10.0, 10.0, 6.0, 12.0, 11.0, 11.0]);
        assert_eq!(d.rule, Rule::LongestMatch);
        let d = decide(&[10.0, 10.0, 6.0, 2.0, 3.0, 5.0]);
        assert_eq!(d.rule, Rule::Spread);
        assert_eq!(order(&d)[0], addr(3));
    }
}
