//! How busy each worker is: the requests the sidecar sent it that have not finished yet, and
//! its engine's own metrics.
//!
//! Every hint issues a ticket ([`crate::core::fleet::TicketKey::ticket`]) counted against the chosen worker until the filter reports
//! the request finished (Envoy logged it). That count is exact and immediate for the traffic
//! kvroute routes, so a burst spreads out without waiting for a scrape. Engines are also scraped
//! (`/metrics`, vLLM names) every `scrape_interval_ms`: that covers traffic the sidecar does not
//! see (other routers, unhinted requests) and the KV usage. A report can be lost (a VM restart,
//! a hint answered after the filter stopped waiting), so a scrape also reclaims tickets: a
//! ticket older than one scrape interval was at the engine when it was scraped, so if the engine
//! reports fewer requests than such tickets, the oldest surplus ones have finished.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// One worker's load as the router sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
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
pub const TICKET_LIFETIME: Duration = Duration::from_secs(600);

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
    /// Open tickets: sequence number → when it was issued (sequence order is time order).
    open: BTreeMap<u64, Instant>,
    /// Latest `kv_metrics` per data-parallel rank: (queued prefill blocks, KV blocks used).
    dynamo: BTreeMap<u32, (f64, f64)>,
}

impl WorkerLoad {
    /// The current load.
    pub fn get(&self) -> Load {
        let mut load = self.scraped.unwrap_or_default();
        load.envoy_active = self.envoy_active;
        load.hinted_in_flight = self.open.len() as f64;
        load.queued_prefill_blocks = self.dynamo.values().map(|r| r.0).sum();
        load.kv_used_blocks = self.dynamo.values().map(|r| r.1).sum();
        load
    }

    /// Count hinted request `seq`, issued at `now`, until [`WorkerLoad::close`].
    pub fn open(&mut self, seq: u64, now: Instant) {
        self.open.insert(seq, now);
    }

    /// Request `seq` finished: whether its ticket was open (not reported twice, not already
    /// reclaimed, not issued by an earlier sidecar process).
    pub fn close(&mut self, seq: u64) -> bool {
        self.open.remove(&seq).is_some()
    }

    /// Close the tickets older than their lifetime at `now`; how many.
    pub fn expire(&mut self, now: Instant) -> u64 {
        let mut expired = 0;
        while let Some(entry) = self.open.first_entry() {
            if now.saturating_duration_since(*entry.get()) < TICKET_LIFETIME {
                break;
            }
            entry.remove();
            expired += 1;
        }
        expired
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

    /// Record a scrape (`None`: it failed) taken at `now` of an engine scraped every `settle`,
    /// and close the tickets the scrape shows have finished, and those past their lifetime.
    pub fn scraped(&mut self, load: Option<Load>, now: Instant, settle: Duration) -> Reclaimed {
        let mut out = Reclaimed {
            expired: self.expire(now),
            ..Reclaimed::default()
        };
        self.scraped = load;
        let open = &mut self.open;
        if let (Some(load), Some(slot)) = (load, self.scraped.as_mut()) {
            let reported = (load.running + load.waiting).max(0.0);
            let settled_before = now.checked_sub(settle).unwrap_or(now);
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
    fn parses_vllm_cache_capacity() {
        let text = "# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",engine=\"0\",num_gpu_blocks=\"80\",num_cpu_blocks=\"None\"} 1.0\nvllm:cache_config_info{engine=\"1\",num_gpu_blocks=\"96\"} 1.0\n";
        assert_eq!(parse_vllm_capacity(text), Some(80));
        assert_eq!(
            parse_vllm_capacity("vllm:cache_config_info{num_gpu_blocks=\"None\"} 1\n"),
            None
        );
        assert_eq!(parse_vllm_capacity(""), None);
    }

    #[test]
    fn tickets_count_until_finished() {
        let now = Instant::now();
        let mut w = WorkerLoad::default();
        w.open(1, now);
        w.open(2, now);
        assert_eq!(w.get().hinted_in_flight, 2.0);
        assert_eq!(
            w.get().busy(),
            2.0,
            "hinted requests count before any scrape"
        );
        assert!(w.close(1));
        assert!(!w.close(1), "a second report of one ticket is ignored");
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

    #[test]
    fn scrapes_reclaim_lost_reports_but_not_fresh_hints() {
        let settle = Duration::from_millis(30);
        let start = Instant::now();
        let later = start + Duration::from_millis(40);
        let mut w = WorkerLoad::default();
        for seq in 0..5 {
            w.open(seq, start);
        }
        w.open(5, later);
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
        assert_eq!(w.get().busy(), 4.0);
        w.scraped(None, later, settle);
        assert_eq!(w.get().busy(), 4.0, "a failed scrape keeps the tickets");
        assert!(w.close(5));
        assert_eq!(w.get().hinted_in_flight, 3.0);
        w.scraped(Some(Load::default()), later, settle);
        assert_eq!(w.get().hinted_in_flight, 0.0);
        assert_eq!(w.get().busy(), 0.0);
        // Requests the sidecar did not route count as of the scrape, on top of hinted ones.
        w.open(6, later);
        w.scraped(
            Some(Load {
                running: 4.0,
                waiting: 1.0,
                ..Load::default()
            }),
            later,
            settle,
        );
        assert_eq!(w.get().unhinted, 4.0);
        w.open(7, later);
        assert_eq!(w.get().busy(), 6.0);
        let expired = w.scraped(None, later + TICKET_LIFETIME, settle);
        assert_eq!(expired.expired, 2, "old tickets expire");
    }
}
