//! Load: the tickets of hinted requests, Dynamo's load reports and the peers' in-flight counts.

use super::*;

impl Core {
    pub(super) fn dynamo_load(
        &mut self,
        m: &KvMetrics,
        component: Option<&str>,
        out: &mut Vec<Happened>,
    ) {
        let Some(id) = self.admit(Publisher::Instance(m.worker_id), component, m.dp_rank, out)
        else {
            return;
        };
        let Some(worker) = self.fleet.get_mut(id) else {
            return;
        };
        let block_size = self.block_sizes.get(&worker.model).copied().unwrap_or(1);
        let queued = m.active_prefill_tokens.unwrap_or(0) as f64 / f64::from(block_size.max(1));
        let used = m.kv_used_blocks.unwrap_or(0) as f64;
        worker.load.dynamo_metrics(m.dp_rank, queued, used);
        let load = worker.current_load();
        out.push(Happened::Load {
            worker: self.name(id),
            load,
            from_dynamo: true,
        });
    }

    pub(super) fn peer_load(
        &mut self,
        peer: &str,
        in_flight: &[(String, u32)],
        survival: &[(String, f64)],
        tickets: &[(String, Vec<PeerTicket>)],
        now: Instant,
        out: &mut Vec<Happened>,
    ) {
        let counts: HashMap<&str, u32> = in_flight.iter().map(|(w, n)| (w.as_str(), *n)).collect();
        let tickets: HashMap<&str, &[PeerTicket]> = tickets
            .iter()
            .map(|(w, t)| (w.as_str(), t.as_slice()))
            .collect();
        let survival: HashMap<&str, f64> = survival.iter().map(|(w, s)| (w.as_str(), *s)).collect();
        let ttl = self.peer_load_ttl;
        let mut changed = Vec::new();
        for w in self.fleet.iter_mut() {
            let n = counts.get(&*w.address).copied().unwrap_or(0);
            let expired = w.load.expire_peers(now, ttl);
            w.load
                .peer_survival(peer, survival.get(&*w.address).copied(), now);
            let theirs = tickets.get(&*w.address).copied().unwrap_or_default();
            w.load.peer_tickets(peer, theirs, now);
            if w.load.peer_in_flight(peer, n, now) || expired {
                changed.push(w.id);
            }
        }
        self.loads_of(changed, out);
    }

    /// The load of each of `workers`, now.
    pub(super) fn loads_of(
        &self,
        workers: impl IntoIterator<Item = WorkerId>,
        out: &mut Vec<Happened>,
    ) {
        for id in workers {
            if let Some(w) = self.fleet.get(id) {
                out.push(Happened::Load {
                    worker: self.name(id),
                    load: w.current_load(),
                    from_dynamo: false,
                });
            }
        }
    }

    /// Which of `tickets` are still counted against their worker (their request runs).
    pub fn open_tickets(&self, tickets: &[Ticket]) -> BTreeSet<Ticket> {
        tickets
            .iter()
            .copied()
            .filter(|&t| {
                let (id, seq) = self.tickets.parts(t);
                self.fleet.get(id).is_some_and(|w| w.load.is_open(seq))
            })
            .collect()
    }

    /// Requests this sidecar hinted that have not finished, per worker with any: what it
    /// shares with its peers.
    pub fn own_in_flight(&self) -> Vec<(String, u32)> {
        self.fleet
            .iter()
            .filter(|w| w.load.own_in_flight() > 0)
            .map(|w| {
                let n = u32::try_from(w.load.own_in_flight()).unwrap_or(u32::MAX);
                (w.address.to_string(), n)
            })
            .collect()
    }

    /// Per worker with any, this replica's open tickets, new ones with their prompt blocks:
    /// what it shares with its peers so they expect what runs there as it does.
    pub fn own_tickets(&mut self) -> Vec<(String, Vec<PeerTicket>)> {
        self.fleet
            .iter_mut()
            .filter(|w| w.load.own_in_flight() > 0)
            .map(|w| (w.address.to_string(), w.load.own_tickets()))
            .collect()
    }

    /// Per worker, this replica's own survival estimate, for those it has one of: what it
    /// shares with its peers ([`load::WorkerLoad::survival`]).
    pub fn own_survival(&self) -> Vec<(String, f64)> {
        self.fleet
            .iter()
            .filter_map(|w| Some((w.address.to_string(), w.load.own_survival()?)))
            .collect()
    }

    pub(super) fn finished(&mut self, reports: &[Finished], now: Instant, out: &mut Vec<Happened>) {
        let (mut finished, mut unknown) = (0, 0);
        let mut changed = BTreeSet::new();
        for report in reports {
            let (id, seq) = self.tickets.parts(report.ticket);
            let Some(w) = self.fleet.get_mut(id) else {
                unknown += 1;
                continue;
            };
            let Some(closed) = w.load.close(seq, now) else {
                unknown += 1;
                continue;
            };
            if let Closed::Open(_) = closed {
                finished += 1;
                changed.insert(id);
            } else {
                unknown += 1;
            }
            let predicted_tokens = closed.expected().predicted;
            let block_size = self.block_sizes.get(&w.model).copied().unwrap_or(1);
            // A prefill worker's report is its decode worker's cache: counted, nothing learnt.
            let prediction = if w.role == Role::Prefill {
                w.truth.count(report.usage);
                None
            } else {
                if let Usage::Cached { cached_tokens, .. } = report.usage {
                    w.load.observe(closed.expected(), u64::from(cached_tokens));
                }
                w.truth.add(predicted_tokens, report.usage, block_size)
            };
            out.push(Happened::Served {
                ticket: report.ticket,
                worker: self.name(id),
                predicted_tokens,
                usage: report.usage,
                prediction,
            });
        }
        for (how, n) in [
            (TicketClosed::Finished, finished),
            (TicketClosed::Unknown, unknown),
        ] {
            if n > 0 {
                out.push(Happened::Tickets { how, n });
            }
        }
        self.loads_of(changed, out);
    }
}
