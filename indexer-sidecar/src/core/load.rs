//! How busy each worker is: the requests the sidecar sent it that have not finished yet, and
//! its engine's own metrics.
//!
//! Every hint issues a ticket ([`crate::core::fleet::TicketKey::ticket`]) counted against the chosen worker until the filter reports
//! the request finished (Envoy logged it). That count is exact and immediate for the traffic
//! kvroute routes, so a burst spreads out without waiting for a scrape. Engines are also scraped
//! (`/metrics`, vLLM names) every `scrape_interval_ms`: that covers traffic the sidecar does not
//! see (other routers, unhinted requests) and the KV usage. A report can be lost (a VM restart,
//! a hint answered after the filter stopped waiting), so a scrape also reclaims tickets: a
//! ticket older than [`REACHES_ENGINE_WITHIN`] (or a scrape interval, if longer) was at the
//! engine when it was scraped, so if the engine reports fewer requests than such tickets, the
//! oldest surplus ones have finished.
//!
//! A scrape is as old as the moment it was asked for: a busy engine answers `/metrics` hundreds
//! of milliseconds later (seen on CPU vLLM), and requests that finished meanwhile are still in
//! its count. Reports that closed tickets since the scrape was asked are taken off what the
//! engine said before the rest is counted as traffic the sidecar does not see — else every
//! conversation that just finished weighs twice as an unhinted request.
//!
//! A ticket also keeps its prompt's leading block hashes: while the request runs, its engine
//! holds those blocks whatever else it evicts, so a prompt sharing them will find them (and
//! before the engine's events for them arrive). The other blocks the index says a worker holds
//! are idle, evictable; the reports say how many of those predicted survived, which gives the
//! worker's survival rate.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Keyed by block hashes and ticket numbers: foldhash, seeded per process, not SipHash (with
/// it, counting a hinted 8k prompt's 500 blocks in and out was a fifth of the sidecar's CPU
/// per hint).
type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// One worker's load as the router sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Load {
    /// Requests running (`vllm:num_requests_running`).
    pub running: f64,
    /// Requests queued (`vllm:num_requests_waiting`).
    pub waiting: f64,
    /// Whether its engine reports its queue (`waiting`, scraped): then the queue, not a count
    /// of requests, says when it is saturated.
    pub queue_reported: bool,
    /// KV cache usage, 0..1 (`vllm:kv_cache_usage_perc`).
    pub kv_usage: f64,
    /// Requests hinted to it that have not finished.
    pub hinted_in_flight: f64,
    /// Requests it had at the last scrape beyond those hinted by this sidecar (other routers,
    /// unhinted requests).
    pub unhinted: f64,
    /// Requests the other replicas hinted to it that have not finished, as they last shared
    /// them on the replica plane.
    pub peers_in_flight: f64,
    /// Prompt blocks waiting for or in prefill, from Dynamo's `kv_metrics` (summed over data
    /// parallel ranks): work a new request queues behind, in the cost's own unit.
    pub queued_prefill_blocks: f64,
    /// KV blocks in use, from Dynamo's `kv_metrics`. Shown, not weighed: as a saturation signal
    /// (over the model card's capacity) it sent warm prompts away from the worker holding them
    /// and lost hit rate and TTFT on real Dynamo (docs/benchmarks.md, "Against Dynamo's KV router").
    pub kv_used_blocks: f64,
    /// Requests in flight to it from this Envoy (admin `rq_active`), when Envoy is polled.
    pub envoy_active: f64,
    /// Distinct prompt blocks of the hinted requests not finished (the first blocks of each),
    /// this replica's and those its peers shared: the prefixes hot there.
    pub running_prompt_blocks: f64,
}

impl Load {
    /// Requests it has: the hinted ones not finished (exact, current) plus the others — the
    /// ones the other replicas hinted (fresh, shared every few tens of ms) or the unhinted ones
    /// as of the last scrape, whichever is more (the scrape counts the peers' requests too,
    /// but late). Not the scraped total itself: requests finish within milliseconds, so it is
    /// stale long before the next scrape.
    pub fn busy(&self) -> f64 {
        self.hinted_in_flight + self.peers_in_flight.max(self.unhinted)
    }
}

/// Reclaimed tickets remembered per worker, so that a report arriving after its ticket was
/// reclaimed (a response still streaming to a slow client) still says what was cached.
const SETTLED: usize = 256;

/// Tickets never reported nor reclaimed (no scrapes) are dropped after this long: the shipped
/// route timeout, so no request still running is forgotten.
pub const TICKET_LIFETIME: Duration = Duration::from_secs(600);

/// Leading blocks of a hinted prompt kept with its ticket: what it holds in its worker's cache
/// while it runs (4 KiB a ticket at most).
pub const TICKET_BLOCKS: usize = 512;

/// Distinct blocks of open tickets remembered per worker; beyond, new tickets keep none (their
/// requests still count as load).
const IN_FLIGHT_BLOCKS: usize = 1 << 16;

/// Weight of the latest report in [`WorkerLoad::survival`]: about the last 5 reports, so it
/// follows a cache that fills up within a minute.
const SURVIVAL_WEIGHT: f64 = 0.2;

/// [`WorkerLoad::survival`] is a multiple of this: replicas whose estimates differ by a hair
/// (each learns from its own share of the requests) weigh two holders of a prefix alike, and
/// the rendezvous order, the same everywhere, breaks the tie.
const SURVIVAL_STEP: f64 = 1.0 / 32.0;

/// How long after its hint a request is surely counted by its engine. Reclaiming is for lost
/// reports, which are rare, so erring long only keeps a lost ticket a few seconds more; erring
/// short closes the tickets of running requests, whose worker then looks idler than it is and,
/// at the next scrape, busy with traffic the sidecar did not route. On CPU vLLM a request took
/// longer than a 250 ms scrape interval to reach the scheduler: 10–16 of 64 tickets were
/// reclaimed in a run and every one reported finished later.
pub const REACHES_ENGINE_WITHIN: Duration = Duration::from_secs(5);

/// Report times remembered per worker to set against a scrape in flight: more than a scrape
/// interval's worth on any one engine.
const RECENT_CLOSES: usize = 256;

/// Tickets a scrape closed without a report.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Reclaimed {
    /// The engine reported fewer requests than these settled tickets.
    pub surplus: u64,
    /// Older than the ticket lifetime.
    pub expired: u64,
}

/// One worker's load: its open tickets, its last scrape, Dynamo's `kv_metrics` and Envoy's
/// in-flight count.
#[derive(Debug, Default, Clone)]
pub struct WorkerLoad {
    envoy_active: f64,
    scraped: Option<Load>,
    /// Open tickets by sequence number (sequence order is time order).
    open: BTreeMap<u64, Ticket>,
    /// The prompt blocks of the open tickets, this replica's and its peers', each with the
    /// number of tickets that have it: blocks a running request keeps in the cache, so a
    /// request sharing them finds them there.
    in_flight_blocks: FastMap<u64, u32>,
    /// Per peer replica: its open tickets here with their prompt blocks (counted in
    /// `in_flight_blocks`), and when it last said so. A replica that saw only its own
    /// requests running would expect an eighth of what runs on a worker among 8 replicas and
    /// weigh the worker unlike its peers (and unlike one shared index).
    peer_tickets: BTreeMap<String, PeerTickets>,
    /// This replica's estimate for [`WorkerLoad::survival`]; `None` until a report says.
    survival: Option<f64>,
    /// Latest `kv_metrics` per data-parallel rank: (queued prefill blocks, KV blocks used).
    dynamo: BTreeMap<u32, (f64, f64)>,
    /// The last [`SETTLED`] reclaimed or expired tickets: (sequence number, what it expected).
    settled: VecDeque<(u64, Expected)>,
    /// Per peer replica: its requests in flight here, and when it said so.
    peers: BTreeMap<String, (u32, Instant)>,
    /// Per peer replica: its own survival estimate here, and when it said so.
    peer_survival: BTreeMap<String, (f64, Instant)>,
    /// [`WorkerLoad::survival`], pooled again whenever an estimate changes (every hint reads
    /// it); `None` without any estimate.
    pooled: Option<f64>,
    /// When the latest reports closed open tickets, oldest first (at most [`RECENT_CLOSES`],
    /// none older than the last scrape asked for).
    closed_at: VecDeque<Instant>,
}

/// A request a replica hinted that has not finished, as it shares it with its peers on the
/// replica plane.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PeerTicket {
    /// The peer's ticket sequence number.
    pub seq: u64,
    /// Its prompt's leading block hashes; sent with the ticket's first share only.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub blocks: Vec<u64>,
}

/// A peer's open tickets on one worker: each one's prompt blocks, counted in
/// `in_flight_blocks`, and when the peer last listed them.
#[derive(Debug, Clone)]
struct PeerTickets {
    blocks: FastMap<u64, Box<[u64]>>,
    at: Instant,
}

/// One hinted request not finished yet.
#[derive(Debug, Clone)]
struct Ticket {
    issued: Instant,
    expected: Expected,
    /// Its prompt's leading block hashes (at most [`TICKET_BLOCKS`]).
    blocks: Box<[u64]>,
    /// Whether its blocks went to the peers ([`WorkerLoad::own_tickets`] gives them once).
    shared: bool,
}

/// What a hint expected its worker to have of the prompt, in tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Expected {
    /// The leading tokens the index said the worker holds.
    pub predicted: u64,
    /// Of those, the ones requests running there also had (see [`WorkerLoad::in_flight_match`]).
    pub pinned: u64,
}

/// A reported ticket that was issued by this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Closed {
    /// It was open: the request no longer loads the worker.
    Open(Expected),
    /// A scrape or its lifetime had closed it already.
    Late(Expected),
}

impl Closed {
    /// What its hint expected.
    pub fn expected(self) -> Expected {
        match self {
            Closed::Open(p) | Closed::Late(p) => p,
        }
    }
}

impl WorkerLoad {
    /// The current load.
    pub fn get(&self) -> Load {
        let mut load = self.scraped.unwrap_or_default();
        load.envoy_active = self.envoy_active;
        load.hinted_in_flight = self.open.len() as f64;
        load.peers_in_flight = self.peers.values().map(|&(n, _)| f64::from(n)).sum();
        load.queued_prefill_blocks = self.dynamo.values().map(|r| r.0).sum();
        load.kv_used_blocks = self.dynamo.values().map(|r| r.1).sum();
        load.running_prompt_blocks = self.in_flight_blocks.len() as f64;
        load
    }

    /// Count hinted request `seq`, issued at `now` with `expected` and a prompt of `blocks`,
    /// until [`WorkerLoad::close`].
    pub fn open(
        &mut self,
        seq: u64,
        now: Instant,
        expected: Expected,
        blocks: impl IntoIterator<Item = u64>,
    ) {
        let blocks = self.hold(blocks);
        let ticket = Ticket {
            issued: now,
            expected,
            blocks,
            shared: false,
        };
        if let Some(old) = self.open.insert(seq, ticket) {
            self.release(&old);
        }
    }

    /// Count a running request's leading `blocks` in the cache; the ones counted.
    fn hold(&mut self, blocks: impl IntoIterator<Item = u64>) -> Box<[u64]> {
        let blocks: Box<[u64]> = if self.in_flight_blocks.len() < IN_FLIGHT_BLOCKS {
            blocks.into_iter().take(TICKET_BLOCKS).collect()
        } else {
            Box::default()
        };
        for &b in &blocks {
            *self.in_flight_blocks.entry(b).or_default() += 1;
        }
        blocks
    }

    fn release(&mut self, ticket: &Ticket) {
        self.let_go(&ticket.blocks);
    }

    /// Stop counting blocks [`WorkerLoad::hold`] counted.
    fn let_go(&mut self, blocks: &[u64]) {
        for b in blocks {
            if let Some(n) = self.in_flight_blocks.get_mut(b) {
                *n -= 1;
                if *n == 0 {
                    self.in_flight_blocks.remove(b);
                }
            }
        }
    }

    /// How many of `blocks`' leading blocks a request hinted here and not finished also has
    /// (hinted by this replica or, as shared, by a peer): the engine holds them while that
    /// request runs, whatever it evicts meanwhile. Prefix
    /// hashes chain, so a block present means the prompt up to it is the same.
    pub fn in_flight_match(&self, blocks: impl IntoIterator<Item = u64>) -> u32 {
        let n = blocks
            .into_iter()
            .take_while(|b| self.in_flight_blocks.contains_key(b))
            .count();
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    /// The prefix `depth` blocks deep of each request running here (hinted by this replica or
    /// a peer), once each: the cold prompts whose home it is becoming before their events say
    /// so.
    pub fn in_flight_prefixes(&self, depth: usize) -> Vec<u64> {
        let Some(i) = depth.checked_sub(1) else {
            return Vec::new();
        };
        let mut prefixes: Vec<u64> = self
            .open
            .values()
            .map(|t| &t.blocks)
            .chain(self.peer_tickets.values().flat_map(|p| p.blocks.values()))
            .filter_map(|blocks| blocks.get(i).copied())
            .collect();
        prefixes.sort_unstable();
        prefixes.dedup();
        prefixes
    }

    /// Requests running here (hinted by this replica or a peer) whose prompts have `block`: with
    /// a prefix's [`sharing_block`], that prefix's own requests here.
    pub fn in_flight_sharing(&self, block: u64) -> u32 {
        self.in_flight_blocks.get(&block).copied().unwrap_or(0)
    }

    /// Of the cached blocks hints predicted here beyond those running requests shared, the
    /// share its engine reported cached, over the last few reports (1 before any): how much of
    /// an idle prefix survives until a request reaches it. Near 1 where the cache is large
    /// against its traffic; low where queued requests find their prefixes evicted.
    ///
    /// Pooled over the replicas that share load: the mean of this replica's estimate and each
    /// peer's latest, in steps of `SURVIVAL_STEP`. Every replica then weighs a worker alike
    /// once the estimates have been shared (at most a load interval after they change), so the
    /// replicas agree on where a prompt goes; each estimate alone comes from a share of the
    /// requests, and a hair between two replicas' estimates sent one prompt two ways.
    pub fn survival(&self) -> f64 {
        self.pooled.unwrap_or(1.0)
    }

    /// Pool the estimates again after one changed.
    fn repool(&mut self) {
        let mut all: Vec<f64> = self
            .survival
            .into_iter()
            .chain(self.peer_survival.values().map(|&(s, _)| s))
            .collect();
        // Summed in value order: the same set gives the same bits on every replica.
        all.sort_by(f64::total_cmp);
        self.pooled = (!all.is_empty()).then(|| {
            let mean = all.iter().sum::<f64>() / all.len() as f64;
            ((mean / SURVIVAL_STEP).round() * SURVIVAL_STEP).clamp(0.0, 1.0)
        });
    }

    /// This replica's own estimate, learnt from the requests it routed (`None` before any):
    /// what it shares with its peers.
    pub fn own_survival(&self) -> Option<f64> {
        self.survival
    }

    /// Peer replica `peer`'s own survival estimate here, as of `now` (`None`: it has none).
    pub fn peer_survival(&mut self, peer: &str, survival: Option<f64>, now: Instant) {
        match survival {
            Some(s) if s.is_finite() => {
                self.peer_survival
                    .insert(peer.to_owned(), (s.clamp(0.0, 1.0), now));
            }
            _ => {
                self.peer_survival.remove(peer);
            }
        }
        self.repool();
    }

    /// The engine reported `cached` tokens for a request hinted with `expected`.
    pub fn observe(&mut self, expected: Expected, cached: u64) {
        let idle = expected.predicted.saturating_sub(expected.pinned);
        if idle == 0 {
            return;
        }
        let survived = cached.saturating_sub(expected.pinned).min(idle) as f64 / idle as f64;
        self.survival = Some(match self.survival {
            None => survived,
            Some(s) => s + SURVIVAL_WEIGHT * (survived - s),
        });
        self.repool();
    }

    /// Request `seq` was reported finished at `now`: how its ticket stood (`None`: reported
    /// twice, or not issued by this process).
    pub fn close(&mut self, seq: u64, now: Instant) -> Option<Closed> {
        if let Some(ticket) = self.open.remove(&seq) {
            self.release(&ticket);
            if self.closed_at.len() == RECENT_CLOSES {
                self.closed_at.pop_front();
            }
            self.closed_at.push_back(now);
            return Some(Closed::Open(ticket.expected));
        }
        let at = self.settled.iter().position(|&(s, _)| s == seq)?;
        let (_, expected) = self.settled.remove(at)?;
        Some(Closed::Late(expected))
    }

    fn settle(&mut self, seq: u64, ticket: Ticket) {
        self.release(&ticket);
        if self.settled.len() == SETTLED {
            self.settled.pop_front();
        }
        self.settled.push_back((seq, ticket.expected));
    }

    /// Close the tickets older than their lifetime at `now`; how many.
    pub fn expire(&mut self, now: Instant) -> u64 {
        let mut expired = 0;
        while let Some(entry) = self.open.first_entry() {
            if now.saturating_duration_since(entry.get().issued) < TICKET_LIFETIME {
                break;
            }
            let (seq, ticket) = entry.remove_entry();
            self.settle(seq, ticket);
            expired += 1;
        }
        expired
    }

    /// Peer replica `peer` has `in_flight` requests here as of `now` (0: none; forgotten).
    /// Whether that changed what it had.
    pub fn peer_in_flight(&mut self, peer: &str, in_flight: u32, now: Instant) -> bool {
        if in_flight == 0 {
            return self.peers.remove(peer).is_some_and(|(n, _)| n > 0);
        }
        let before = self.peers.insert(peer.to_owned(), (in_flight, now));
        before.is_none_or(|(n, _)| n != in_flight)
    }

    /// Peer replica `peer`'s open tickets here as of `now`, all of them: those it shared
    /// before and leaves out have finished. A ticket's blocks come with its first share only;
    /// one first seen without them (its first share lost, or this replica started since)
    /// counts none.
    pub fn peer_tickets(&mut self, peer: &str, tickets: &[PeerTicket], now: Instant) {
        let mut known = self
            .peer_tickets
            .remove(peer)
            .map(|p| p.blocks)
            .unwrap_or_default();
        let mut kept = FastMap::with_capacity_and_hasher(tickets.len(), Default::default());
        for t in tickets {
            let blocks = match known.remove(&t.seq) {
                Some(blocks) => blocks,
                None => self.hold(t.blocks.iter().copied()),
            };
            kept.insert(t.seq, blocks);
        }
        for gone in known.into_values() {
            self.let_go(&gone);
        }
        if !kept.is_empty() {
            let tickets = PeerTickets {
                blocks: kept,
                at: now,
            };
            self.peer_tickets.insert(peer.to_owned(), tickets);
        }
    }

    /// This replica's open tickets here, each with its prompt blocks the first time it is
    /// asked for (peers keep them until the ticket leaves a share): what it shares with its
    /// peers. Only new tickets' blocks are copied, under the core's lock.
    pub fn own_tickets(&mut self) -> Vec<PeerTicket> {
        self.open
            .iter_mut()
            .map(|(&seq, t)| PeerTicket {
                seq,
                blocks: if std::mem::replace(&mut t.shared, true) {
                    Vec::new()
                } else {
                    t.blocks.to_vec()
                },
            })
            .collect()
    }

    /// Forget what peers said longer than `ttl` before `now` (a peer gone, or the plane down);
    /// whether anything was forgotten.
    pub fn expire_peers(&mut self, now: Instant, ttl: Duration) -> bool {
        let before = self.peers.len();
        self.peers
            .retain(|_, (_, at)| now.saturating_duration_since(*at) < ttl);
        let silent: Vec<String> = self
            .peer_tickets
            .iter()
            .filter(|(_, p)| now.saturating_duration_since(p.at) >= ttl)
            .map(|(peer, _)| peer.clone())
            .collect();
        for peer in silent {
            if let Some(tickets) = self.peer_tickets.remove(&peer) {
                for blocks in tickets.blocks.into_values() {
                    self.let_go(&blocks);
                }
            }
        }
        let estimates = self.peer_survival.len();
        self.peer_survival
            .retain(|_, (_, at)| now.saturating_duration_since(*at) < ttl);
        if self.peer_survival.len() != estimates {
            self.repool();
        }
        self.peers.len() != before
    }

    /// Whether ticket `seq` is open.
    pub fn is_open(&self, seq: u64) -> bool {
        self.open.contains_key(&seq)
    }

    /// Requests hinted to it by this sidecar that have not finished.
    pub fn own_in_flight(&self) -> usize {
        self.open.len()
    }

    /// Record a Dynamo `kv_metrics` message of data-parallel rank `dp_rank`.
    pub fn dynamo_metrics(
        &mut self,
        dp_rank: u32,
        queued_prefill_blocks: f64,
        kv_used_blocks: f64,
    ) {
        self.dynamo
            .insert(dp_rank, (queued_prefill_blocks, kv_used_blocks));
    }

    /// Whether a `kv_metrics` message of this rank was recorded.
    pub fn has_rank(&self, dp_rank: u32) -> bool {
        self.dynamo.contains_key(&dp_rank)
    }

    /// Record Envoy's in-flight count.
    pub fn envoy_active(&mut self, active: f64) {
        self.envoy_active = active;
    }

    /// Record a scrape (`None`: it failed) asked for at `asked` of an engine scraped every
    /// `settle`, and close the tickets the scrape shows have finished, and those past their
    /// lifetime.
    pub fn scraped(&mut self, load: Option<Load>, asked: Instant, settle: Duration) -> Reclaimed {
        let mut out = Reclaimed {
            expired: self.expire(asked),
            ..Reclaimed::default()
        };
        // Reported after the scrape was asked for: possibly still in the engine's count.
        let late = self.closed_at.iter().filter(|&&t| t >= asked).count();
        self.closed_at.retain(|&t| t >= asked);
        self.scraped = load;
        let Some(load) = load else {
            return out;
        };
        let reported = (load.running + load.waiting).max(0.0);
        let settled_before = asked.checked_sub(settle).unwrap_or(asked);
        let settled = self
            .open
            .values()
            .take_while(|t| t.issued <= settled_before)
            .count();
        let surplus = settled.saturating_sub(reported as usize);
        for _ in 0..surplus {
            if let Some((seq, ticket)) = self.open.pop_first() {
                self.settle(seq, ticket);
            }
        }
        out.surplus = surplus as u64;
        let hinted = (self.open.len() + late) as f64;
        if let Some(slot) = self.scraped.as_mut() {
            slot.unhinted = (reported - hinted).max(0.0);
        }
        out
    }
}

/// Which of a prefix of `len` blocks tells the requests that share it
/// ([`WorkerLoad::in_flight_sharing`]): prefix hashes chain, so its last — or, past what a ticket
/// keeps ([`TICKET_BLOCKS`]), the last one kept. `None` for an empty prefix.
pub fn sharing_block(len: usize) -> Option<usize> {
    len.min(TICKET_BLOCKS).checked_sub(1)
}

/// Parse vLLM's load gauges out of Prometheus text (summing over label sets, e.g. engines).
pub fn parse_vllm_metrics(text: &str) -> Option<Load> {
    let mut load = Load::default();
    let mut seen = false;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let (series, value) = match line.rsplit_once(' ') {
            Some((s, v)) => (s, v.trim().parse::<f64>().ok()),
            None => continue,
        };
        let Some(value) = value.filter(|v| v.is_finite()) else {
            continue;
        };
        let name = series.split('{').next().unwrap_or(series);
        let slot = match name {
            "vllm:num_requests_running" => &mut load.running,
            "vllm:num_requests_waiting" => {
                load.queue_reported = true;
                &mut load.waiting
            }
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => &mut load.kv_usage,
            _ => continue,
        };
        *slot += value;
        seen = true;
    }
    seen.then_some(load)
}

/// The engine's own prefix-cache counters, in tokens: (`vllm:prefix_cache_hits_total`,
/// `vllm:prefix_cache_queries_total`), summed over label sets; `None` when it has neither.
pub fn parse_vllm_prefix_cache(text: &str) -> Option<(f64, f64)> {
    let (mut hits, mut queries, mut seen) = (0.0, 0.0, false);
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Some(value) = value.trim().parse::<f64>().ok().filter(|v| v.is_finite()) else {
            continue;
        };
        match series.split('{').next().unwrap_or(series) {
            "vllm:prefix_cache_hits_total" => hits += value,
            "vllm:prefix_cache_queries_total" => queries += value,
            _ => continue,
        }
        seen = true;
    }
    seen.then_some((hits, queries))
}

/// Blocks one KV cache of a vLLM engine holds: `num_gpu_blocks` of `vllm:cache_config_info`
/// (the smallest, when several engines — data-parallel ranks — share one endpoint).
pub fn parse_vllm_capacity(text: &str) -> Option<u64> {
    text.lines()
        .filter(|l| l.starts_with("vllm:cache_config_info{"))
        .filter_map(|l| {
            let (_, rest) = l.split_once("num_gpu_blocks=\"")?;
            rest.split('"').next()?.parse::<u64>().ok()
        })
        .filter(|&n| n > 0)
        .min()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn predicted(tokens: u64) -> Expected {
        Expected {
            predicted: tokens,
            pinned: 0,
        }
    }

    #[test]
    fn parses_vllm_prefix_cache_counters() {
        let text = "# TYPE vllm:prefix_cache_hits_total counter\nvllm:prefix_cache_hits_total{engine=\"0\"} 480.0\nvllm:prefix_cache_queries_total{engine=\"0\"} 1000.0\nvllm:prefix_cache_hits_total{engine=\"1\"} 20\nvllm:prefix_cache_hits_created{engine=\"0\"} 1.7e9\n";
        assert_eq!(parse_vllm_prefix_cache(text), Some((500.0, 1000.0)));
        assert_eq!(
            parse_vllm_prefix_cache("vllm:num_requests_running 1\n"),
            None
        );
    }

    #[test]
    fn parses_vllm_gauges() {
        let text = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"m\",engine=\"0\"} 3\nvllm:num_requests_waiting{model_name=\"m\",engine=\"0\"} 2\nvllm:kv_cache_usage_perc{model_name=\"m\",engine=\"0\"} 0.25\nvllm:num_requests_running{model_name=\"m\",engine=\"1\"} 1\nother 5\nbroken\nvllm:num_requests_waiting{} NaN\n";
        let load = parse_vllm_metrics(text).unwrap();
        assert_eq!(
            (load.running, load.waiting, load.kv_usage),
            (4.0, 2.0, 0.25)
        );
        assert!(load.queue_reported);
        let running_only = parse_vllm_metrics("vllm:num_requests_running 3\n").unwrap();
        assert!(
            !running_only.queue_reported,
            "no queue reported, none assumed"
        );
        assert_eq!(parse_vllm_metrics("no metrics here 1\n"), None);
    }

    #[test]
    fn parses_vllm_cache_capacity() {
        let text = "# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",engine=\"0\",num_gpu_blocks=\"80\",num_cpu_blocks=\"None\"} 1.0\nvllm:cache_config_info{engine=\"1\",num_gpu_blocks=\"96\"} 1.0\n";
        assert_eq!(parse_vllm_capacity(text), Some(80));
        assert_eq!(
            parse_vllm_capacity("vllm:cache_config_info{num_gpu_blocks=\"None\"} 1\n"),
            None
        );
        assert_eq!(parse_vllm_capacity(""), None);
    }

    /// A peer's shared tickets count their blocks as running here until its next share
    /// leaves them out or it falls silent; one first seen without blocks counts none.
    #[test]
    fn peers_tickets_hold_their_blocks() {
        let (mut w, now) = (WorkerLoad::default(), Instant::now());
        let t = |seq, blocks: &[u64]| PeerTicket {
            seq,
            blocks: blocks.to_vec(),
        };
        w.open(1, now, Expected::default(), [10, 11]);
        w.peer_tickets("b", &[t(7, &[10, 11, 12, 13]), t(8, &[])], now);
        assert_eq!(w.in_flight_match([10, 11, 12, 13, 14]), 4);
        assert_eq!(w.get().running_prompt_blocks, 4.0);
        w.peer_tickets("b", &[t(7, &[]), t(8, &[20])], now);
        assert_eq!(w.in_flight_match([10, 11, 12]), 3, "known: kept");
        assert_eq!(w.in_flight_match([20]), 0, "first seen without blocks");
        w.peer_tickets("b", &[], now);
        assert_eq!(w.in_flight_match([10, 11, 12]), 2, "ours alone");
        w.peer_tickets("c", &[t(9, &[30])], now);
        assert_eq!(w.in_flight_match([30]), 1);
        assert!(!w.expire_peers(now + Duration::from_millis(500), Duration::from_secs(1)));
        assert_eq!(w.in_flight_match([30]), 1);
        w.expire_peers(now + Duration::from_secs(1), Duration::from_secs(1));
        assert_eq!(w.in_flight_match([30]), 0, "silent: forgotten");
        assert_eq!(w.in_flight_match([10, 11]), 2);
        let _ = w.close(1, now);
        assert!(w.in_flight_blocks.is_empty());
    }

    /// Our tickets go to the peers with their blocks once, then by sequence number alone.
    #[test]
    fn own_tickets_give_their_blocks_once() {
        let (mut w, now) = (WorkerLoad::default(), Instant::now());
        let listed = |w: &mut WorkerLoad| -> Vec<(u64, usize)> {
            w.own_tickets()
                .iter()
                .map(|t| (t.seq, t.blocks.len()))
                .collect()
        };
        w.open(1, now, Expected::default(), [10, 11]);
        assert_eq!(listed(&mut w), [(1, 2)]);
        assert_eq!(listed(&mut w), [(1, 0)]);
        w.open(2, now, Expected::default(), [12]);
        assert_eq!(listed(&mut w), [(1, 0), (2, 1)]);
        let _ = w.close(1, now);
        assert_eq!(listed(&mut w), [(2, 0)]);
    }

    /// The other replicas' requests count beside ours, fresher than a scrape; a scrape that
    /// shows more (other routers too) counts instead; silent peers are forgotten.
    #[test]
    fn peers_requests_in_flight_count_as_load() {
        let now = Instant::now();
        let mut w = WorkerLoad::default();
        w.open(1, now, predicted(0), []);
        assert!(w.peer_in_flight("b", 3, now));
        assert!(!w.peer_in_flight("b", 3, now), "unchanged");
        assert!(w.peer_in_flight("c", 2, now + Duration::from_millis(500)));
        assert_eq!(w.get().peers_in_flight, 5.0);
        assert_eq!(w.get().busy(), 6.0);
        w.scraped(
            Some(Load {
                running: 9.0,
                ..Load::default()
            }),
            now,
            Duration::from_secs(1),
        );
        assert_eq!(
            w.get().busy(),
            1.0 + 8.0,
            "the scrape saw more than the peers said"
        );
        w.scraped(Some(Load::default()), now, Duration::from_secs(1));
        assert!(w.expire_peers(now + Duration::from_millis(1200), Duration::from_secs(1)));
        assert_eq!(w.get().peers_in_flight, 2.0, "b forgotten, c kept");
        assert!(w.peer_in_flight("c", 0, now));
        assert_eq!(w.get().peers_in_flight, 0.0);
        assert_eq!(w.own_in_flight(), 1);
    }

    /// A running request's prompt blocks count as held until its ticket closes, however it
    /// closes; a prompt shares them only as a prefix.
    #[test]
    fn running_requests_hold_their_prompt_blocks() {
        let now = Instant::now();
        let mut w = WorkerLoad::default();
        w.open(1, now, predicted(0), [10, 11, 12]);
        w.open(2, now, predicted(0), [10, 11, 20]);
        assert_eq!(w.in_flight_match([10, 11, 12, 13]), 3);
        assert_eq!(w.in_flight_match([10, 11, 20]), 3);
        assert_eq!(
            w.in_flight_match([30, 11]),
            0,
            "its first block is held by none"
        );
        assert!(w.close(1, now).is_some());
        assert_eq!(
            w.in_flight_match([10, 11, 12, 13]),
            2,
            "10, 11 still held by 2"
        );
        // A scrape showing no request reclaims ticket 2: nothing is held.
        let later = now + Duration::from_secs(2);
        w.scraped(Some(Load::default()), later, Duration::from_secs(1));
        assert_eq!(w.in_flight_match([10]), 0);
        assert!(w.in_flight_blocks.is_empty());
        // Expired tickets let go too; a long prompt keeps its first blocks only.
        w.open(3, now, predicted(0), 0..10_000);
        assert_eq!(w.in_flight_match(0..10_000), TICKET_BLOCKS as u32);
        w.open(4, now, predicted(0), 0..3);
        let sharing = |len| sharing_block(len).map_or(0, |b| w.in_flight_sharing(b as u64));
        assert_eq!(sharing(600), 1, "by its first blocks");
        assert_eq!(sharing(3), 2);
        assert_eq!(sharing(0), 0);
        assert_eq!(w.in_flight_sharing(20_000), 0);
        w.expire(now + TICKET_LIFETIME);
        assert_eq!(w.in_flight_match(0..10), 0);
    }

    /// Survival learns, from the engine's reports, the share of the idle matched blocks (those
    /// no running request held) that were still cached.
    #[test]
    fn survival_is_learnt_from_the_reports() {
        let mut w = WorkerLoad::default();
        assert_eq!(w.survival(), 1.0, "trusted until a report says otherwise");
        let own = |w: &WorkerLoad| w.own_survival().unwrap();
        let hinted = |predicted, pinned| Expected { predicted, pinned };
        // 100 of 500 idle tokens were found: 0.2.
        w.observe(hinted(600, 100), 200);
        assert!((own(&w) - 0.2).abs() < 1e-9);
        assert_eq!(w.survival(), 6.0 / 32.0, "used in steps");
        // Reports that say nothing of idle blocks change nothing.
        w.observe(hinted(100, 100), 0);
        w.observe(hinted(0, 0), 0);
        assert!((own(&w) - 0.2).abs() < 1e-9);
        // Full survival from then on moves it up by steps.
        for _ in 0..60 {
            w.observe(hinted(320, 0), 320);
        }
        assert!(own(&w) > 0.95, "{}", own(&w));
        // More found than predicted counts as all of it.
        w.observe(hinted(320, 0), 1000);
        assert!(own(&w) <= 1.0);
    }

    /// Two replicas that learnt a hair apart weigh the worker alike once they shared their
    /// estimates; a peer's estimate goes with its load when it falls silent.
    #[test]
    fn replicas_pool_their_survival() {
        let now = Instant::now();
        let hinted = Expected {
            predicted: 1000,
            pinned: 0,
        };
        let (mut a, mut b) = (WorkerLoad::default(), WorkerLoad::default());
        a.observe(hinted, 989);
        b.observe(hinted, 1000);
        b.observe(hinted, 700);
        assert_ne!(a.survival(), b.survival());
        a.peer_survival("b", b.own_survival(), now);
        b.peer_survival("a", a.own_survival(), now);
        assert_eq!(a.survival(), b.survival());
        // (0.989 + 0.94) / 2 = 0.9645: in steps of 1/32.
        assert_eq!(a.survival(), 31.0 / 32.0);
        // A peer with none yet, or gone quiet, counts for nothing.
        b.peer_survival("a", None, now);
        assert_eq!(b.survival(), 30.0 / 32.0);
        a.expire_peers(now + Duration::from_secs(60), Duration::from_secs(5));
        assert_eq!(a.survival(), 32.0 / 32.0);
    }

    #[test]
    fn tickets_count_until_finished() {
        let now = Instant::now();
        let mut w = WorkerLoad::default();
        w.open(1, now, predicted(48), []);
        w.open(2, now, predicted(0), []);
        assert_eq!(w.get().hinted_in_flight, 2.0);
        assert_eq!(
            w.get().busy(),
            2.0,
            "hinted requests count before any scrape"
        );
        assert_eq!(
            w.close(1, now),
            Some(Closed::Open(predicted(48))),
            "with what its hint predicted"
        );
        assert_eq!(
            w.close(1, now),
            None,
            "a second report of one ticket is ignored"
        );
        assert_eq!(w.get().hinted_in_flight, 1.0);
        w.envoy_active(5.0);
        assert_eq!(w.get().envoy_active, 5.0);
        assert_eq!(w.get().busy(), 1.0, "Envoy's count is shown, not weighed");
        let mut d = WorkerLoad::default();
        d.dynamo_metrics(0, 3.0, 10.0);
        d.dynamo_metrics(1, 2.0, 5.0);
        d.dynamo_metrics(0, 1.0, 12.0);
        assert_eq!(
            d.get().queued_prefill_blocks,
            3.0,
            "latest per rank, summed"
        );
        assert_eq!(d.get().kv_used_blocks, 17.0);
    }

    /// An engine answering `/metrics` late still counts the requests that finished while the
    /// scrape was on its way; their reports came in meanwhile, so they are not traffic the
    /// sidecar missed. Reports from before the scrape was asked for take nothing off.
    #[test]
    fn requests_finished_while_a_scrape_was_on_its_way_are_not_unhinted() {
        let settle = Duration::from_millis(30);
        let start = Instant::now();
        let asked = start + Duration::from_secs(1);
        let mut w = WorkerLoad::default();
        for seq in 0..9 {
            w.open(seq, start, predicted(0), []);
        }
        assert!(w.close(0, asked - Duration::from_millis(1)).is_some());
        for seq in 1..7 {
            assert!(w.close(seq, asked + Duration::from_millis(300)).is_some());
        }
        let engine_saw = Load {
            running: 9.0,
            ..Load::default()
        };
        w.scraped(Some(engine_saw), asked, settle);
        assert_eq!(w.get().hinted_in_flight, 2.0);
        assert_eq!(
            w.get().unhinted,
            1.0,
            "9 running = 2 open + 6 reported since + 1 the sidecar did not route"
        );
        // The next scrape, asked after those reports, counts them no more.
        let next = asked + Duration::from_secs(1);
        w.scraped(Some(engine_saw), next, settle);
        assert_eq!(w.get().unhinted, 7.0);
    }

    #[test]
    fn scrapes_reclaim_lost_reports_but_not_fresh_hints() {
        let settle = Duration::from_millis(30);
        let start = Instant::now();
        let later = start + Duration::from_millis(40);
        let mut w = WorkerLoad::default();
        for seq in 0..5 {
            w.open(seq, start, predicted(10 * seq), []);
        }
        w.open(5, later, predicted(0), []);
        let scraped = Load {
            running: 2.0,
            waiting: 1.0,
            ..Load::default()
        };
        let r = w.scraped(Some(scraped), later, settle);
        // Five settled tickets but the engine has three requests: two reports were lost.
        assert_eq!(
            r,
            Reclaimed {
                surplus: 2,
                expired: 0
            }
        );
        assert_eq!(w.get().hinted_in_flight, 4.0, "3 settled + 1 fresh");
        // A reclaimed ticket's report still comes with its prediction, once.
        assert_eq!(w.close(1, later), Some(Closed::Late(predicted(10))));
        assert_eq!(w.close(1, later), None);
        assert_eq!(w.get().busy(), 4.0);
        w.scraped(None, later, settle);
        assert_eq!(w.get().busy(), 4.0, "a failed scrape keeps the tickets");
        assert!(w.close(5, later).is_some());
        assert_eq!(w.get().hinted_in_flight, 3.0);
        w.scraped(Some(Load::default()), later, settle);
        assert_eq!(w.get().hinted_in_flight, 0.0);
        assert_eq!(w.get().busy(), 0.0);
        // Requests the sidecar did not route count as of the scrape, on top of hinted ones.
        w.open(6, later, predicted(0), []);
        w.scraped(
            Some(Load {
                running: 4.0,
                waiting: 1.0,
                ..Load::default()
            }),
            later + settle,
            settle,
        );
        assert_eq!(w.get().unhinted, 4.0);
        w.open(7, later, predicted(0), []);
        assert_eq!(w.get().busy(), 6.0);
        let expired = w.scraped(None, later + TICKET_LIFETIME, settle);
        assert_eq!(expired.expired, 2, "old tickets expire");
    }
}
