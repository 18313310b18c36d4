//! How busy each worker is: the requests the sidecar sent it that have not finished yet, and
//! its engine's own metrics.
//!
//! Every hint issues a [`Ticket`] counted against the chosen worker until the filter reports
//! the request finished (Envoy logged it). That count is exact and immediate for the traffic
//! kvroute routes, so a burst spreads out without waiting for a scrape. Engines are also scraped
//! (`/metrics`, vLLM names) every `scrape_interval_ms`: that covers traffic the sidecar does not
//! see (other routers, unhinted requests) and the KV usage. A report can be lost (a VM restart,
//! a hint answered after the filter stopped waiting), so a scrape also reclaims tickets: a
//! ticket older than one scrape interval was at the engine when it was scraped, so if the engine
//! reports fewer requests than such tickets, the oldest surplus ones have finished.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kvroute_protocol::hint::Ticket;

/// One worker's load as the router sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Load {
    /// Requests running (`vllm:num_requests_running`).
    pub running: f64,
    /// Requests queued (`vllm:num_requests_waiting`).
    pub waiting: f64,
    /// KV cache usage, 0..1 (`vllm:kv_cache_usage_perc`).
    pub kv_usage: f64,
    /// Requests hinted to it that have not finished.
    pub hinted_in_flight: f64,
    /// Requests it had at the last scrape beyond those hinted by this sidecar (other routers,
    /// unhinted requests).
    pub unhinted: f64,
    /// Prompt blocks waiting for or in prefill, from Dynamo's `kv_metrics` (summed over data
    /// parallel ranks): work a new request queues behind, in the cost's own unit.
    pub queued_prefill_blocks: f64,
    /// KV blocks in use, from Dynamo's `kv_metrics`. Shown, not weighed: as a saturation signal
    /// (over the model card's capacity) it sent warm prompts away from the worker holding them
    /// and lost hit rate and TTFT on real Dynamo (docs/benchmarks.md, "Against Dynamo's KV router").
    pub kv_used_blocks: f64,
    /// Requests in flight to it from this Envoy (admin `rq_active`), when Envoy is polled.
    pub envoy_active: f64,
}

impl Load {
    /// Requests it has: the hinted ones not finished (exact, current) plus the unhinted ones
    /// as of the last scrape. Not the scraped total itself: requests finish within
    /// milliseconds, so it is stale long before the next scrape.
    pub fn busy(&self) -> f64 {
        self.hinted_in_flight + self.unhinted
    }
}

/// Tickets never reported nor reclaimed (no scrapes) are dropped after this long: the shipped
/// route timeout, so no request still running is forgotten.
const TICKET_LIFETIME: Duration = Duration::from_secs(600);

/// Tickets a scrape closed without a report.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Reclaimed {
    /// The engine reported fewer requests than these settled tickets.
    pub surplus: u64,
    /// Older than the ticket lifetime.
    pub expired: u64,
}

/// Load of every worker, indexed by [`crate::WorkerId`].
#[derive(Debug)]
pub struct LoadTracker {
    envoy_active: Vec<f64>,
    scraped: Vec<Option<Load>>,
    /// Open tickets per worker: sequence number → when it was issued (sequence order is time
    /// order).
    open: Vec<BTreeMap<u64, Instant>>,
    next_seq: u64,
    settle: Duration,
    /// Latest Dynamo `kv_metrics` per worker and data-parallel rank: (queued prefill blocks,
    /// KV blocks used).
    dynamo: Vec<BTreeMap<u32, (f64, f64)>>,
}

/// A ticket is the sequence number above the worker id, so a report names its worker.
const WORKER_BITS: u32 = 16;

impl LoadTracker {
    /// A tracker for `workers` workers scraped every `scrape_interval`.
    pub fn new(workers: usize, scrape_interval: Duration) -> Self {
        LoadTracker {
            envoy_active: vec![0.0; workers],
            scraped: vec![None; workers],
            open: vec![BTreeMap::new(); workers],
            next_seq: 1,
            settle: scrape_interval,
            dynamo: vec![BTreeMap::new(); workers],
        }
    }

    /// Make room for `workers` workers (workers are only ever added).
    pub fn grow(&mut self, workers: usize) {
        if workers > self.scraped.len() {
            self.envoy_active.resize(workers, 0.0);
            self.scraped.resize(workers, None);
            self.open.resize(workers, BTreeMap::new());
            self.dynamo.resize(workers, BTreeMap::new());
        }
    }

    /// The current load of worker `i`.
    pub fn get(&self, i: usize) -> Load {
        let mut load = self.scraped.get(i).copied().flatten().unwrap_or_default();
        load.envoy_active = self.envoy_active.get(i).copied().unwrap_or(0.0);
        load.hinted_in_flight = self.open.get(i).map_or(0, BTreeMap::len) as f64;
        if let Some(ranks) = self.dynamo.get(i) {
            load.queued_prefill_blocks = ranks.values().map(|r| r.0).sum();
            load.kv_used_blocks = ranks.values().map(|r| r.1).sum();
        }
        load
    }

    /// Count a request hinted to worker `i`; the ticket comes back when it finishes. `None`
    /// for a worker id the ticket cannot carry (more than 65536 workers).
    pub fn hinted(&mut self, i: usize) -> Option<Ticket> {
        if i >> WORKER_BITS != 0 {
            return None;
        }
        let open = self.open.get_mut(i)?;
        let seq = self.next_seq;
        self.next_seq += 1;
        open.insert(seq, Instant::now());
        Some(Ticket(seq << WORKER_BITS | i as u64))
    }

    /// A hinted request finished: its worker, or `None` if the ticket was not open (reported
    /// twice, already reclaimed, or issued by an earlier sidecar process).
    pub fn finished(&mut self, ticket: Ticket) -> Option<usize> {
        let worker = (ticket.0 & ((1 << WORKER_BITS) - 1)) as usize;
        self.open
            .get_mut(worker)?
            .remove(&(ticket.0 >> WORKER_BITS))
            .map(|_| worker)
    }

    /// Record a Dynamo `kv_metrics` message of worker `i`, data-parallel rank `dp_rank`.
    pub fn dynamo_metrics(
        &mut self,
        i: usize,
        dp_rank: u32,
        queued_prefill_blocks: f64,
        kv_used_blocks: f64,
    ) {
        if let Some(ranks) = self.dynamo.get_mut(i) {
            ranks.insert(dp_rank, (queued_prefill_blocks, kv_used_blocks));
        }
    }

    /// Record Envoy's in-flight count for worker `i`.
    pub fn envoy_active(&mut self, i: usize, active: f64) {
        if let Some(slot) = self.envoy_active.get_mut(i) {
            *slot = active;
        }
    }

    /// Record a scrape of worker `i` (`None`: the scrape failed) and close the tickets the
    /// scrape shows have finished, and those past their lifetime.
    pub fn scraped(&mut self, i: usize, load: Option<Load>) -> Reclaimed {
        let mut out = Reclaimed::default();
        let (Some(slot), Some(open)) = (self.scraped.get_mut(i), self.open.get_mut(i)) else {
            return out;
        };
        *slot = load;
        let now = Instant::now();
        while let Some(entry) = open.first_entry() {
            if now.saturating_duration_since(*entry.get()) < TICKET_LIFETIME {
                break;
            }
            entry.remove();
            out.expired += 1;
        }
        if let (Some(load), Some(slot)) = (load, slot.as_mut()) {
            let reported = (load.running + load.waiting).max(0.0);
            let settled_before = now - self.settle;
            let settled = open.values().take_while(|&&t| t <= settled_before).count();
            let surplus = settled.saturating_sub(reported as usize);
            for _ in 0..surplus {
                open.pop_first();
            }
            out.surplus = surplus as u64;
            slot.unhinted = (reported - open.len() as f64).max(0.0);
        }
        out
    }
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
            "vllm:num_requests_waiting" => &mut load.waiting,
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => &mut load.kv_usage,
            _ => continue,
        };
        *slot += value;
        seen = true;
    }
    seen.then_some(load)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_vllm_gauges() {
        let text = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"m\",engine=\"0\"} 3\nvllm:num_requests_waiting{model_name=\"m\",engine=\"0\"} 2\nvllm:kv_cache_usage_perc{model_name=\"m\",engine=\"0\"} 0.25\nvllm:num_requests_running{model_name=\"m\",engine=\"1\"} 1\nother 5\nbroken\nvllm:num_requests_waiting{} NaN\n";
        let load = parse_vllm_metrics(text).unwrap();
        assert_eq!(
            (load.running, load.waiting, load.kv_usage),
            (4.0, 2.0, 0.25)
        );
        assert_eq!(parse_vllm_metrics("no metrics here 1\n"), None);
    }

    #[test]
    fn tickets_count_until_finished() {
        let mut t = LoadTracker::new(2, Duration::from_millis(50));
        let a = t.hinted(0).unwrap();
        let b = t.hinted(0).unwrap();
        assert_ne!(a, b);
        assert_eq!(t.get(0).hinted_in_flight, 2.0);
        assert_eq!(
            t.get(0).busy(),
            2.0,
            "hinted requests count before any scrape"
        );
        assert_eq!(t.get(1).hinted_in_flight, 0.0);
        assert_eq!(t.finished(a), Some(0));
        assert_eq!(
            t.finished(a),
            None,
            "a second report of one ticket is ignored"
        );
        assert_eq!(t.get(0).hinted_in_flight, 1.0);
        assert_eq!(t.finished(Ticket(u64::MAX)), None);
        assert_eq!(t.hinted(1 << 16), None);
        assert_eq!(t.hinted(7), None, "out of range: ignored");
        t.envoy_active(0, 5.0);
        assert_eq!(t.get(0).envoy_active, 5.0);
        assert_eq!(t.get(0).busy(), 1.0, "Envoy's count is shown, not weighed");
        t.dynamo_metrics(1, 0, 3.0, 10.0);
        t.dynamo_metrics(1, 1, 2.0, 5.0);
        t.dynamo_metrics(1, 0, 1.0, 12.0);
        assert_eq!(
            t.get(1).queued_prefill_blocks,
            3.0,
            "latest per rank, summed"
        );
        assert_eq!(t.get(1).kv_used_blocks, 17.0);
        t.dynamo_metrics(9, 0, 1.0, 1.0);
        assert_eq!(t.finished(b), Some(0));
    }

    #[test]
    fn scrapes_reclaim_lost_reports_but_not_fresh_hints() {
        let mut t = LoadTracker::new(1, Duration::from_millis(30));
        for _ in 0..5 {
            t.hinted(0);
        }
        std::thread::sleep(Duration::from_millis(40));
        let fresh = t.hinted(0).unwrap();
        let scraped = Load {
            running: 2.0,
            waiting: 1.0,
            ..Load::default()
        };
        let r = t.scraped(0, Some(scraped));
        // Five settled tickets but the engine has three requests: two reports were lost.
        assert_eq!(
            r,
            Reclaimed {
                surplus: 2,
                expired: 0
            }
        );
        assert_eq!(t.get(0).hinted_in_flight, 4.0, "3 settled + 1 fresh");
        assert_eq!(t.get(0).busy(), 4.0);
        t.scraped(0, None);
        assert_eq!(t.get(0).busy(), 4.0, "a failed scrape keeps the tickets");
        assert_eq!(t.finished(fresh), Some(0));
        assert_eq!(t.get(0).hinted_in_flight, 3.0);
        let idle = Load::default();
        t.scraped(0, Some(idle));
        assert_eq!(t.get(0).hinted_in_flight, 0.0);
        assert_eq!(t.get(0).busy(), 0.0);
        // Requests the sidecar did not route count as of the scrape, on top of hinted ones.
        t.hinted(0);
        t.scraped(
            0,
            Some(Load {
                running: 4.0,
                waiting: 1.0,
                ..Load::default()
            }),
        );
        assert_eq!(t.get(0).unhinted, 4.0);
        t.hinted(0);
        assert_eq!(t.get(0).busy(), 6.0);
    }
}
