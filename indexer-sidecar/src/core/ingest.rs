//! KV events in: which worker a message speaks for, its place in the worker's sequence, and
//! the index it changes.

use super::*;

impl Core {
    /// The worker a Dynamo message may speak for: it names a known worker, comes on that
    /// worker's component's subject (binding an unbound worker to it) and on one of its first
    /// `max_ranks_per_worker` ranks.
    pub(super) fn admit(
        &mut self,
        from: Publisher<'_>,
        component: Option<&str>,
        rank: u32,
        out: &mut Vec<Happened>,
    ) -> Option<WorkerId> {
        let Some(id) = self.resolve(from) else {
            let decode = match from {
                Publisher::Instance(i) => self.decode_instances.values().any(|d| d.contains(&i)),
                Publisher::Address(_) => false,
            };
            if !decode {
                out.push(Happened::UnknownPublisher { name: from.name() });
            }
            return None;
        };
        let name = self.name(id);
        let limit = self.limits.max_ranks_per_worker;
        let worker = self.fleet.get_mut(id)?;
        match (&worker.component, component) {
            (Some(expected), Some(got)) if expected != got => {
                out.push(Happened::Rejected {
                    worker: name,
                    why: Rejected::WrongComponent {
                        expected: expected.clone(),
                        got: got.to_owned(),
                    },
                });
                return None;
            }
            (None, Some(got)) => {
                worker.component = Some(got.to_owned());
                out.push(Happened::Bound {
                    worker: name.clone(),
                    component: got.to_owned(),
                });
            }
            _ => {}
        }
        let known = worker.cursors.contains_key(&rank) || worker.load.has_rank(rank);
        if !known && rank >= limit {
            out.push(Happened::Rejected {
                worker: name,
                why: Rejected::TooManyRanks { rank, limit },
            });
            return None;
        }
        Some(id)
    }

    /// A worker's engine said how many blocks a cache holds.
    pub(super) fn learn_capacity(
        &mut self,
        id: WorkerId,
        capacity: Option<u64>,
        out: &mut Vec<Happened>,
    ) {
        let Some(blocks) = capacity.filter(|&b| b > 0) else {
            return;
        };
        let name = self.name(id);
        if let Some(w) = self.fleet.get_mut(id) {
            if w.capacity != Some(blocks) {
                w.capacity = Some(blocks);
                out.push(Happened::Capacity {
                    worker: name,
                    blocks,
                });
            }
        }
    }

    pub(super) fn message(&mut self, m: Message<'_>, now: Instant, out: &mut Vec<Happened>) {
        let Some(id) = self.admit(m.from, m.component, m.stream, out) else {
            return;
        };
        let Some(worker) = self.fleet.get_mut(id) else {
            return;
        };
        // Only its KV events: its `kv_metrics` (load) come from NATS alone.
        if matches!(m.body, Body::Dynamo(_)) && self.read_over_zmq.contains(worker.plane_address())
        {
            out.push(Happened::Rejected {
                worker: self.name(id),
                why: Rejected::ReadOverZmq,
            });
            return;
        }
        let model = worker.model.clone();
        let cursor = worker.cursors.entry(m.stream).or_default();
        let verdict = match m.delivery {
            Delivery::WarmStart => {
                // A replay continuing what is applied (the edge skips what it already has, as
                // after a restore from disk) extends it; any other replaces it.
                let continues = cursor.last.is_some_and(|l| m.seq == l.wrapping_add(1));
                cursor.warm_applied(m.seq);
                if continues {
                    Verdict::Next
                } else {
                    self.forget(id, Forgot::WarmStart, out);
                    Verdict::First
                }
            }
            _ => cursor.check(m.seq),
        };
        let name = self.name(id);
        if !verdict.in_order() {
            out.push(Happened::Sequence {
                worker: name.clone(),
                verdict,
                seq: m.seq,
                delivery: m.delivery,
            });
        }
        match verdict {
            Verdict::Duplicate => return,
            Verdict::Gap { from, to } if m.delivery == Delivery::LiveHoldingGaps => {
                out.push(Happened::Held {
                    worker: name,
                    from,
                    to,
                });
                return;
            }
            Verdict::Restarted => self.forget(id, Forgot::Restarted, out),
            _ => {}
        }
        if let Some(worker) = self.fleet.get_mut(id) {
            let cursor = worker.cursors.entry(m.stream).or_default();
            if m.delivery != Delivery::WarmStart {
                cursor.applied(m.seq);
            }
            worker.last_event = Some(now);
            worker.hints_since_event = 0;
        }
        // An event not indexed still took its number in the sequence (the cursor above).
        let mut refused = |converted: Result<KvEvent, EventProblem>| match converted {
            Ok(kv) => Some(kv),
            Err(problem) => {
                out.push(Happened::Refused {
                    worker: name.clone(),
                    problem,
                });
                None
            }
        };
        let events: Vec<KvEvent> = match m.body {
            Body::Dynamo(e) => refused(KvEvent::from_dynamo(e)).into_iter().collect(),
            Body::Vllm(batch) => {
                let block_size = self.block_sizes.get(&model).copied().unwrap_or(0);
                batch
                    .events
                    .iter()
                    .filter_map(|e| refused(KvEvent::from_vllm(e, batch.dp_rank, block_size)))
                    .collect()
            }
        };
        // The loss is booked before the message is applied: a fill rebuilds from the cache as
        // it was just before the first lost message.
        self.book_loss(id, &model, &m, verdict, now);
        for kv in &events {
            self.apply(&name, &model, kv, out);
        }
        let index = self.indexes.get(&model);
        let (held, digest) = index.map_or((0, 0), |i| {
            i.cache_state(index::CacheId {
                worker: id,
                dp_rank: m.stream,
            })
        });
        if let Some(w) = self.fleet.get_mut(id) {
            let log = w.logs.entry(m.stream).or_default();
            let given_up = log.push(m.seq, events, held, digest);
            log.last_live = Some(now);
            if given_up > 0 {
                out.push(Happened::Unfilled {
                    worker: name.clone(),
                    rank: m.stream,
                    messages: given_up,
                });
            }
        }
        let blocks = index.map_or(0, |i| i.blocks_of(id));
        out.push(Happened::Holds {
            worker: name,
            blocks,
        });
    }

    /// Per worker that finished hinted requests: predicted against reported cached tokens.
    pub fn served(&self) -> Vec<(String, truth::Truth)> {
        self.fleet
            .iter()
            .filter(|w| w.truth.total() > 0)
            .map(|w| (w.address.to_string(), w.truth))
            .collect()
    }

    pub(super) fn apply(
        &mut self,
        worker: &Name,
        model: &str,
        event: &KvEvent,
        out: &mut Vec<Happened>,
    ) {
        let capacity = self
            .fleet
            .get(worker.id)
            .and_then(|w| w.capacity)
            .unwrap_or(self.limits.max_blocks_per_cache);
        let Some(index) = self.indexes.get_mut(model) else {
            return;
        };
        let capacity = usize::try_from(capacity).unwrap_or(usize::MAX);
        out.push(Happened::Applied {
            worker: worker.clone(),
            kind: event.kind.tag(),
            outcome: index.apply_within(worker.id, event, capacity),
        });
    }

    /// Drop every index entry of a worker (all its ranks) and its cursors.
    pub(super) fn forget(&mut self, id: WorkerId, why: Forgot, out: &mut Vec<Happened>) {
        let Some(worker) = self.fleet.get_mut(id) else {
            return;
        };
        if why != Forgot::WarmStart {
            worker.cursors.clear();
        }
        worker.logs.clear();
        let model = worker.model.clone();
        let blocks = self
            .indexes
            .get_mut(&model)
            .map_or(0, |i| i.remove_worker(id));
        let worker = self.name(id);
        out.push(Happened::Forgot {
            worker: worker.clone(),
            blocks,
            why,
        });
        out.push(Happened::Holds { worker, blocks: 0 });
    }

    pub(super) fn reclaimed(r: Reclaimed, out: &mut Vec<Happened>) {
        for (how, n) in [
            (TicketClosed::Reclaimed, r.surplus),
            (TicketClosed::Expired, r.expired),
        ] {
            if n > 0 {
                out.push(Happened::Tickets { how, n });
            }
        }
    }
}
