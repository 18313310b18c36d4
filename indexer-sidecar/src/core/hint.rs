//! The hint: a request's matches and the fleet's load into workers, best first, and how the
//! request is steered to them.

use kvroute_protocol::PrefixHash;

use super::*;

/// A hint, decided.
#[derive(Debug, Clone)]
pub struct Hint {
    /// The decision, with the workers considered.
    pub decision: Decision,
    /// The ticket counted against the first worker.
    pub ticket: Option<Ticket>,
    /// How the request is steered.
    pub target: Target,
    /// What else happened (finished tickets, the in-flight count).
    pub happened: Vec<Happened>,
}

/// How a hint names its workers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// No usable worker: Envoy's fallback decides.
    None,
    /// Envoy's `override_host`: addresses, best first.
    Addresses(Vec<Arc<str>>),
    /// A Dynamo frontend's instance header.
    Instance(u64),
    /// A Dynamo frontend's prefill-instance header (disaggregated).
    Prefill(u64),
}

/// The hint request names a model without an index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnknownModel;

impl Core {
    /// Decide a hint for `req` at `now`; its finished tickets are closed first.
    pub fn hint(&mut self, req: &HintRequest, now: Instant) -> Result<Hint, UnknownModel> {
        let mut happened = Vec::new();
        if !req.finished.is_empty() {
            self.finished(&req.finished, now, &mut happened);
        }
        let index = self.indexes.get(&req.model).ok_or(UnknownModel)?;
        self.last_request = Some(now);
        // A few tiers beyond the hint's length, so saturated leaders have runners-up.
        let matches = index.find_matches(&req.hashes, self.routing.max_hinted_workers * 2);
        let home_key = match self.routing.home_key_blocks.min(req.hashes.len()) {
            0 => None,
            n => Some(req.hashes[n - 1].0),
        };
        // Only workers serving the request's model: the filter names the base model of an
        // adapter, and every worker of a base model serves its adapters.
        let blocks = || req.hashes.iter().map(|h| h.0);
        let predict = self.routing.predict_survival;
        let mut workers = self
            .fleet
            .iter()
            .filter(|w| w.usable() && w.model == req.model)
            .map(|w| policy::Worker {
                id: w.id,
                address: &w.address,
                load: w.current_load(),
                in_flight_blocks: if predict {
                    w.load.in_flight_match(blocks())
                } else {
                    0
                },
                survival: w.load.survival(),
                prefix_in_flight: 0,
                homes: None,
                prefill: w.role == Role::Prefill,
            })
            .collect::<Vec<_>>();
        // Where the prompt branches off what some worker holds, by the index or by a running
        // request (a burst of one new prefix is popular before its first events arrive).
        let longest = matches
            .iter()
            .map(|&(_, n)| n as usize)
            .chain(workers.iter().map(|w| w.in_flight_blocks as usize))
            .max()
            .unwrap_or(0);
        // A prompt nothing matches goes to a home balanced by the prefixes each worker is
        // home to, where the balance is on.
        if self.routing.home_balance.is_finite()
            && home_key.is_some()
            && longest < self.routing.min_matched_blocks.max(1) as usize
        {
            let mut held: HashMap<WorkerId, usize> = HashMap::new();
            for (worker, n) in index.homes() {
                *held.entry(worker).or_default() += n;
            }
            let depth = self.routing.home_key_blocks;
            for w in &mut workers {
                let running = self.fleet.get(w.id).map_or(0, |f| {
                    f.load
                        .in_flight_prefixes(depth)
                        .into_iter()
                        .filter(|&p| !index.holds(w.id, PrefixHash(p)))
                        .count()
                });
                w.homes = Some((held.get(&w.id).copied().unwrap_or(0) + running) as f64);
            }
        }
        // The prefix's own requests on each worker: one lookup each.
        if let Some(key) = load::sharing_block(longest).and_then(|i| req.hashes.get(i)) {
            for w in &mut workers {
                w.prefix_in_flight = self
                    .fleet
                    .get(w.id)
                    .map_or(0, |f| f.load.in_flight_sharing(key.0));
            }
        }
        let matched = longest
            .checked_sub(1)
            .and_then(|i| req.hashes.get(i))
            .map(|prefix| (prefix.0, req.hashes.get(longest).map(|h| h.0)));
        let popularity = self.shared_prefixes.request(matched, now);
        let decision = policy::choose(
            policy::Prompt {
                blocks: req.hashes.len() as u32,
                home_key,
                tie_key: req.hashes.last().map_or(0, |h| h.0),
                popularity,
            },
            &matches,
            workers,
            &self.routing,
        );
        let mut ticket = None;
        let mut target = Target::None;
        if let Some(&first) = decision.workers.first() {
            let seq = self.next_ticket;
            self.next_ticket += 1;
            self.last_hint = Some(now);
            if let Some(w) = self.fleet.get_mut(first) {
                ticket = self.tickets.ticket(first, seq);
                if ticket.is_some() {
                    let block_size =
                        u64::from(self.block_sizes.get(&req.model).copied().unwrap_or(0));
                    let in_flight = decision
                        .candidates
                        .first()
                        .map_or(0, |c| c.in_flight_blocks);
                    let expected = Expected {
                        predicted: u64::from(decision.matched_blocks) * block_size,
                        pinned: u64::from(in_flight.min(decision.matched_blocks)) * block_size,
                    };
                    w.load.open(seq, now, expected, blocks());
                }
                w.hints_since_event += 1;
            }
            if let Some(w) = self.fleet.get(first) {
                target = match (w.pinned(), w.role, w.instance_id) {
                    (true, Role::Prefill, Some(i)) => Target::Prefill(i),
                    (true, _, Some(i)) => Target::Instance(i),
                    _ => Target::Addresses(
                        decision
                            .workers
                            .iter()
                            .filter_map(|&id| self.fleet.get(id))
                            .filter(|w| !w.pinned())
                            .map(|w| Arc::clone(&w.address))
                            .collect(),
                    ),
                };
                happened.push(Happened::Load {
                    worker: self.name(first),
                    load: w.current_load(),
                    from_dynamo: false,
                });
            }
        }
        Ok(Hint {
            decision,
            ticket,
            target,
            happened,
        })
    }
}
