//! Summaries per routing mode, as a markdown table and JSON.

use std::path::Path;

use anyhow::Result;
use serde::Serialize;
use serde_json::json;

use crate::client::Outcome;

/// What one mode achieved on one workload.
#[derive(Debug, Clone, Serialize)]
pub struct ModeReport {
    /// Mode name.
    pub mode: String,
    /// Requests sent.
    pub requests: usize,
    /// Requests that failed.
    pub errors: usize,
    /// Cached prompt tokens / prompt tokens, as the engines counted them.
    pub hit_rate: f64,
    /// Median time to first token, ms.
    pub ttft_p50_ms: f64,
    /// 95th percentile time to first token, ms.
    pub ttft_p95_ms: f64,
    /// Mean time to first token, ms: where one engine idles while another queues, the median
    /// falls among the idle engine's requests and only the mean shows the fleet's total wait.
    pub ttft_mean_ms: f64,
    /// Requests served by each engine.
    pub requests_per_engine: Vec<usize>,
}

/// Why a mode's JSON says it is unavailable, as one line for a table (its `reason`'s first).
pub fn unavailable_reason(mode: &serde_json::Value) -> &str {
    mode["reason"]
        .as_str()
        .unwrap_or("")
        .lines()
        .next()
        .unwrap_or("")
}

/// The `q` quantile (0..=1) of `values` (nearest rank); 0 for none.
pub fn quantile(values: &[f64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

impl ModeReport {
    /// Summarize the outcomes of one mode over a fleet of `engines`.
    pub fn new(mode: &str, outcomes: &[Outcome], engines: usize) -> Self {
        let ok: Vec<&Outcome> = outcomes.iter().filter(|o| o.ok()).collect();
        let prompt: u64 = ok.iter().map(|o| o.prompt_tokens).sum();
        let cached: u64 = ok.iter().map(|o| o.cached_tokens).sum();
        let ttfts: Vec<f64> = ok.iter().map(|o| o.ttft.as_secs_f64() * 1000.0).collect();
        let mut per_engine = vec![0; engines];
        for o in &ok {
            if let Some(slot) = o.engine.and_then(|e| per_engine.get_mut(e)) {
                *slot += 1;
            }
        }
        ModeReport {
            mode: mode.to_owned(),
            requests: outcomes.len(),
            errors: outcomes.len() - ok.len(),
            hit_rate: if prompt == 0 {
                0.0
            } else {
                cached as f64 / prompt as f64
            },
            ttft_p50_ms: quantile(&ttfts, 0.5),
            ttft_p95_ms: quantile(&ttfts, 0.95),
            ttft_mean_ms: if ttfts.is_empty() {
                0.0
            } else {
                ttfts.iter().sum::<f64>() / ttfts.len() as f64
            },
            requests_per_engine: per_engine,
        }
    }

    /// One line for a benchmark's progress output.
    pub fn line(&self) -> String {
        format!(
            "{}: hit rate {:.3}, TTFT p50 {:.1} ms p95 {:.1} ms mean {:.1} ms, errors {}, per engine {:?}",
            self.mode,
            self.hit_rate,
            self.ttft_p50_ms,
            self.ttft_p95_ms,
            self.ttft_mean_ms,
            self.errors,
            self.requests_per_engine
        )
    }
}

/// A markdown table of the reports.
pub fn markdown(title: &str, reports: &[ModeReport]) -> String {
    let mut out = format!(
        "## {title}\n\n| mode | hit rate | TTFT p50 (ms) | TTFT p95 (ms) | TTFT mean (ms) | requests | errors | requests per engine |\n|---|---|---|---|---|---|---|---|\n"
    );
    for r in reports {
        let per: Vec<String> = r
            .requests_per_engine
            .iter()
            .map(|n| n.to_string())
            .collect();
        out.push_str(&format!(
            "| {} | {:.1}% | {:.1} | {:.1} | {:.1} | {} | {} | {} |\n",
            r.mode,
            r.hit_rate * 100.0,
            r.ttft_p50_ms,
            r.ttft_p95_ms,
            r.ttft_mean_ms,
            r.requests,
            r.errors,
            per.join(" / ")
        ));
    }
    out
}

/// Write `<stem>.md` and `<stem>.json` (`{"title", "modes": {"<mode>": {...}}}`) into `dir`;
/// the markdown.
pub fn write(dir: &Path, stem: &str, title: &str, reports: &[ModeReport]) -> Result<String> {
    let md = markdown(title, reports);
    let modes: serde_json::Map<String, serde_json::Value> = reports
        .iter()
        .map(|r| (r.mode.clone(), serde_json::to_value(r).unwrap_or_default()))
        .collect();
    write_pair(dir, stem, &json!({"title": title, "modes": modes}), &md)?;
    Ok(md)
}

/// A benchmark's report: `<stem>.json` (`doc`) and `<stem>.md` (`md`) in `dir`.
pub fn write_pair(dir: &Path, stem: &str, doc: &serde_json::Value, md: &str) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(
        dir.join(format!("{stem}.json")),
        serde_json::to_string_pretty(doc)?,
    )?;
    std::fs::write(dir.join(format!("{stem}.md")), md)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn quantiles_and_summary() {
        assert_eq!(quantile(&[], 0.5), 0.0);
        assert_eq!(quantile(&[3.0, 1.0, 2.0], 0.5), 2.0);
        assert_eq!(quantile(&[1.0, 2.0, 3.0, 4.0], 0.95), 4.0);
        let o = |cached, engine| Outcome {
            status: 200,
            ttft: Duration::from_millis(10),
            prompt_tokens: 100,
            cached_tokens: cached,
            engine: Some(engine),
            ..Outcome::default()
        };
        let failed = Outcome {
            status: 503,
            ..Outcome::default()
        };
        let r = ModeReport::new("x", &[o(50, 0), o(100, 1), failed], 2);
        assert_eq!((r.requests, r.errors), (3, 1));
        assert!((r.hit_rate - 0.75).abs() < 1e-9);
        assert_eq!(r.requests_per_engine, vec![1, 1]);
        // The failed request's zero TTFT is not averaged in.
        assert!((r.ttft_mean_ms - 10.0).abs() < 1e-9);
        assert!(markdown("t", &[r]).contains("| x | 75.0% |"));
    }
}
