//! `kvroute-bench load-pool DIR…`: several runs of the load ladder read as one.
//!
//! On real engines one run's rung is a few hundred requests, and the fleet itself moves: two
//! fleets of one mode on two vLLM engines each, in the same minutes, differed by more than the
//! modes did, and a machine's speed drifts over the hour (docs/benchmarks.md, "Against real
//! vLLM"). So modes are compared over several fleets in alternating order: every request of
//! every run (`requests.jsonl`, written beside `load.json`) pooled per workload, rate and mode,
//! with each fleet's own p90 and the order it ran in beside the pooled quantiles.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context as _, Result};
use serde_json::{json, Value};

use crate::report::quantile;

/// Every run's records: its directory's name and the lines of its `requests.jsonl`.
pub fn read(dirs: &[PathBuf]) -> Result<Vec<(String, Vec<Value>)>> {
    dirs.iter()
        .map(|dir| {
            let path = dir.join("requests.jsonl");
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()))?;
            let records = text
                .lines()
                .filter(|l| !l.trim().is_empty())
                .map(serde_json::from_str)
                .collect::<Result<Vec<Value>, _>>()
                .with_context(|| format!("parsing {}", path.display()))?;
            Ok((dir.display().to_string(), records))
        })
        .collect()
}

/// What one mode saw at one rate, over every run.
#[derive(Default)]
struct Cell {
    ttft: Vec<f64>,
    /// Envoy's split where its access log gave it: held after the last byte, µs; the engine's
    /// time to its first response byte, ms.
    held_us: Vec<f64>,
    upstream_ms: Vec<f64>,
    prompt: u64,
    cached: u64,
    errors: usize,
    /// Per fleet (the run's position, the fleet's name in it).
    runs: BTreeMap<(usize, String), Fleet>,
}

/// One fleet's requests at one rate.
#[derive(Default)]
struct Fleet {
    /// The order it ran in at this rate.
    order: u64,
    /// Its successful TTFTs.
    ttft: Vec<f64>,
    /// Per group of users (`group`), its requests per engine.
    groups: BTreeMap<u64, BTreeMap<u64, usize>>,
}

impl Fleet {
    /// Groups per engine, most first: each group counted at the engine most of its requests
    /// went to (where its prefix lived). Empty without groups.
    fn groups_per_engine(&self) -> Vec<usize> {
        let mut per: BTreeMap<u64, usize> = BTreeMap::new();
        for engines in self.groups.values() {
            if let Some((&engine, _)) = engines
                .iter()
                .max_by_key(|&(e, n)| (*n, std::cmp::Reverse(*e)))
            {
                *per.entry(engine).or_default() += 1;
            }
        }
        let mut counts: Vec<usize> = per.into_values().collect();
        counts.sort_unstable_by(|a, b| b.cmp(a));
        counts
    }
}

/// The pooled figures: `workloads.<name>.<rate>.<mode>` with `runs` (the mode's fleets: more
/// than one in a run that named the mode twice), `requests`, `errors`, `ttft_p50_ms`,
/// `ttft_p90_ms`, `ttft_p99_ms`, `hit_rate`, Envoy's split (`held_p50_us`, `held_p90_us`,
/// `upstream_p50_ms`, `upstream_p90_ms`; 0 without it), and per fleet, in the order of the runs
/// given, `run_ttft_p90_ms`, `run_order` (0: it ran first at that rate) and
/// `run_groups_per_engine` (records with a `group`: how many groups of users each engine
/// served most of, most first).
pub fn pool(runs: &[(String, Vec<Value>)]) -> Value {
    // Keyed by the rate's bits: the same rate in every run is one cell.
    let mut cells: BTreeMap<(String, u64, String), Cell> = BTreeMap::new();
    for (run, (_, records)) in runs.iter().enumerate() {
        for r in records {
            let key = (
                r["workload"].as_str().unwrap_or_default().to_owned(),
                r["rate"].as_f64().unwrap_or(0.0).to_bits(),
                r["mode"].as_str().unwrap_or_default().to_owned(),
            );
            let cell = cells.entry(key).or_default();
            let order = r["order"].as_u64().unwrap_or(0);
            // A mode run twice in one invocation (`kvroute_2`) is another fleet of that mode;
            // records without a fleet count as one per mode and run.
            let fleet = r["fleet"].as_str().unwrap_or_default().to_owned();
            let this_run = cell.runs.entry((run, fleet)).or_insert_with(|| Fleet {
                order,
                ..Fleet::default()
            });
            if r["ok"] != true {
                cell.errors += 1;
                continue;
            }
            let ttft = r["ttft_ms"].as_f64().unwrap_or(0.0);
            cell.ttft.push(ttft);
            this_run.ttft.push(ttft);
            if let (Some(group), Some(engine)) = (r["group"].as_u64(), r["engine"].as_u64()) {
                *this_run
                    .groups
                    .entry(group)
                    .or_default()
                    .entry(engine)
                    .or_default() += 1;
            }
            cell.held_us.extend(r["held_us"].as_f64());
            cell.upstream_ms
                .extend(r["upstream_us"].as_f64().map(|us| us / 1e3));
            cell.prompt += r["prompt_tokens"].as_u64().unwrap_or(0);
            cell.cached += r["cached_tokens"].as_u64().unwrap_or(0);
        }
    }
    let mut doc = json!({"runs": runs.iter().map(|(name, _)| name).collect::<Vec<_>>(),
                         "workloads": {}});
    for ((workload, rate, mode), cell) in cells {
        let rate = f64::from_bits(rate);
        doc["workloads"][&workload][format!("{rate}")][&mode] = json!({
            "runs": cell.runs.len(),
            "requests": cell.ttft.len() + cell.errors,
            "errors": cell.errors,
            "ttft_p50_ms": quantile(&cell.ttft, 0.5),
            "ttft_p90_ms": quantile(&cell.ttft, 0.9),
            "ttft_p99_ms": quantile(&cell.ttft, 0.99),
            "hit_rate": cell.cached as f64 / cell.prompt.max(1) as f64,
            "held_p50_us": quantile(&cell.held_us, 0.5),
            "held_p90_us": quantile(&cell.held_us, 0.9),
            "upstream_p50_ms": quantile(&cell.upstream_ms, 0.5),
            "upstream_p90_ms": quantile(&cell.upstream_ms, 0.9),
            "run_ttft_p90_ms": cell.runs.values().map(|f| quantile(&f.ttft, 0.9)).collect::<Vec<_>>(),
            "run_order": cell.runs.values().map(|f| f.order).collect::<Vec<_>>(),
            "run_groups_per_engine": cell.runs.values().map(Fleet::groups_per_engine).collect::<Vec<_>>(),
        });
    }
    doc
}

/// The pooled figures as a table per workload, rates in increasing order.
pub fn markdown(pooled: &Value) -> String {
    let mut s = String::new();
    for (workload, rates) in pooled["workloads"].as_object().into_iter().flatten() {
        s += &format!(
            "### {workload}\n\n| rate (req/s) | mode | runs | requests | TTFT p50 / p90 / p99 (ms) | hit rate | held in Envoy p50 / p90 (µs) | engine to first byte p50 / p90 (ms) | p90 per fleet (ms; ¹ it ran first) | groups per engine per fleet, most first |\n|---|---|---|---|---|---|---|---|---|---|\n"
        );
        let mut by_rate: Vec<(f64, &Value)> = rates
            .as_object()
            .into_iter()
            .flatten()
            .map(|(r, modes)| (r.parse().unwrap_or(0.0), modes))
            .collect();
        by_rate.sort_by(|a, b| a.0.total_cmp(&b.0));
        for (rate, modes) in by_rate {
            for (mode, c) in modes.as_object().into_iter().flatten() {
                let f = |k: &str| c[k].as_f64().unwrap_or(0.0);
                let per_run: Vec<String> = c["run_ttft_p90_ms"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .zip(c["run_order"].as_array().into_iter().flatten())
                    .map(|(p90, order)| {
                        let first = if order == 0 { "¹" } else { "" };
                        format!("{:.1}{first}", p90.as_f64().unwrap_or(0.0))
                    })
                    .collect();
                let groups: Vec<String> = c["run_groups_per_engine"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_array)
                    .filter(|g| !g.is_empty())
                    .map(|g| {
                        let n: Vec<String> = g.iter().map(Value::to_string).collect();
                        n.join(" ")
                    })
                    .collect();
                s += &format!(
                    "| {rate} | {mode} | {} | {} | {:.1} / {:.1} / {:.1} | {:.1}% | {:.0} / {:.0} | {:.1} / {:.1} | {} | {} |\n",
                    c["runs"],
                    c["requests"],
                    f("ttft_p50_ms"),
                    f("ttft_p90_ms"),
                    f("ttft_p99_ms"),
                    100.0 * f("hit_rate"),
                    f("held_p50_us"),
                    f("held_p90_us"),
                    f("upstream_p50_ms"),
                    f("upstream_p90_ms"),
                    per_run.join(", "),
                    groups.join("; ")
                );
            }
        }
        s += "\n";
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(mode: &str, rate: f64, order: u64, ttft: f64, cached: u64) -> Value {
        json!({"workload": "chat", "mode": mode, "fleet": mode, "rate": rate, "order": order, "ok": true,
               "ttft_ms": ttft, "prompt_tokens": 100, "cached_tokens": cached,
               "held_us": 10.0 * ttft, "upstream_us": 500.0 * ttft})
    }

    /// Requests pool per workload, rate and mode across runs, a mode run twice in one run
    /// counting as two fleets; each fleet keeps its own p90 and the order it ran in; a failed
    /// request counts as an error, not a TTFT.
    #[test]
    fn runs_pool_per_rate_and_mode_and_each_fleet_keeps_its_own_p90() {
        let mut a: Vec<Value> = (1..=10)
            .map(|t| record("kvroute", 4.0, 0, f64::from(t), 50))
            .collect();
        let mut failed = record("kvroute", 4.0, 0, 0.0, 0);
        failed["ok"] = json!(false);
        a.push(failed);
        let b: Vec<Value> = (11..=20)
            .map(|t| record("kvroute", 4.0, 1, f64::from(t), 100))
            .collect();
        let ring = vec![record("ring_hash", 4.0, 1, 7.0, 0)];
        let mut again = record("kvroute", 4.0, 2, 30.0, 100);
        again["fleet"] = json!("kvroute_2");
        let runs = vec![
            ("one".to_owned(), [a, ring].concat()),
            ("two".to_owned(), [b, vec![again]].concat()),
        ];
        let doc = pool(&runs);
        let k = &doc["workloads"]["chat"]["4"]["kvroute"];
        assert_eq!(
            (k["runs"].clone(), k["requests"].clone()),
            (json!(3), json!(22))
        );
        assert_eq!(k["errors"], 1);
        assert_eq!(
            (k["ttft_p50_ms"].as_f64(), k["ttft_p90_ms"].as_f64()),
            (Some(11.0), Some(19.0))
        );
        assert_eq!(k["hit_rate"].as_f64(), Some(1600.0 / 2100.0));
        assert_eq!(
            (k["held_p50_us"].as_f64(), k["upstream_p90_ms"].as_f64()),
            (Some(110.0), Some(9.5))
        );
        assert_eq!(k["run_ttft_p90_ms"], json!([9.0, 19.0, 30.0]));
        assert_eq!(k["run_order"], json!([0, 1, 2]));
        assert_eq!(doc["workloads"]["chat"]["4"]["ring_hash"]["runs"], 1);
        let md = markdown(&doc);
        let row = "| 4 | kvroute | 3 | 22 | 11.0 / 19.0 / 30.0 | 76.2% | 110 / 190 | 5.5 / 9.5 | 9.0¹, 19.0, 30.0 |  |";
        assert!(md.contains(row), "{md}");
    }

    /// A group of users counts at the engine most of its requests went to; each fleet's groups
    /// per engine are listed most first.
    #[test]
    fn groups_count_where_most_of_their_requests_went() {
        let sent = |group: u64, engine: u64| {
            let mut r = record("kvroute", 4.0, 0, 1.0, 0);
            r["group"] = json!(group);
            r["engine"] = json!(engine);
            r
        };
        // Groups 0 and 1 on engine 2 (one of group 1's requests moved to engine 0), group 2 on
        // engine 0.
        let records = vec![sent(0, 2), sent(1, 2), sent(1, 2), sent(1, 0), sent(2, 0)];
        let doc = pool(&[("one".to_owned(), records)]);
        let k = &doc["workloads"]["chat"]["4"]["kvroute"];
        assert_eq!(k["run_groups_per_engine"], json!([[2, 1]]));
        assert!(markdown(&doc).contains("| 2 1 |"), "{}", markdown(&doc));
    }
}
