//! What a running stack says: its processes' logs and CPU, the sidecar's metrics and
//! decisions, Envoy's stats, the lossy proxies' counts.

use anyhow::{Context as _, Result};

use super::Stack;
use crate::lossy_nats::{LossCounts, LossyNats};
use crate::process::Process;

impl Stack {
    /// The last lines of a process's log.
    pub fn log_tail(&self, name: &str) -> String {
        self.processes
            .iter()
            .find(|p| p.name() == name)
            .map(Process::log_tail)
            .unwrap_or_default()
    }

    /// [`super::StackOptions::transport_loss`]: the KV-event messages each sidecar's proxy forwarded and
    /// dropped so far, in sidecar order (empty without it).
    pub fn transport_counts(&self) -> Vec<LossCounts> {
        self.proxies.iter().map(LossyNats::counts).collect()
    }

    /// Write the sidecar's last decisions (`/debug/explain`) into the run directory, to see
    /// why requests went where; nothing without a sidecar.
    pub async fn save_explain(&self) -> Result<()> {
        let Some(url) = &self.sidecar_url else {
            return Ok(());
        };
        if let Ok(r) = self.http.get(format!("{url}/debug/explain")).send().await {
            std::fs::write(
                self.dir.join("explain.json"),
                r.bytes().await.unwrap_or_default(),
            )?;
        }
        Ok(())
    }

    /// Prompt tokens the sidecar's hints said their workers held
    /// (`kvroute_hint_matched_blocks_total` × block size): against the engines' cached tokens,
    /// how much the index over-predicted. `None` without a sidecar.
    pub async fn hinted_match_tokens(&self, block_size: u32) -> Option<u64> {
        self.sidecar_url.as_ref()?;
        let metrics = self.sidecar_metrics().await.ok()?;
        let blocks = crate::prometheus::sum(&metrics, "kvroute_hint_matched_blocks");
        Some(blocks as u64 * u64::from(block_size))
    }

    /// What the sidecar's hints predicted against what the engines reported, over the hinted
    /// requests whose usage gave cached tokens: predictions `exact` (within a block), `over`,
    /// `under`, and the predicted, cached and prompt tokens. `None` without a sidecar.
    pub async fn predictions(&self) -> Option<serde_json::Value> {
        self.sidecar_url.as_ref()?;
        let m = self.sidecar_metrics().await.ok()?;
        let sum = |family: &str| crate::prometheus::sum(&m, family);
        let outcome = |o: &str| {
            crate::prometheus::sum_where(&m, |l| {
                l.starts_with("kvroute_predictions_total{")
                    && l.contains(&format!("outcome=\"{o}\""))
            })
        };
        Some(serde_json::json!({
            "exact": outcome("exact"),
            "over": outcome("over"),
            "under": outcome("under"),
            "predicted_tokens": sum("kvroute_predicted_cached_tokens_total"),
            "cached_tokens": sum("kvroute_actual_cached_tokens_total"),
            "prompt_tokens": sum("kvroute_served_prompt_tokens_total"),
        }))
    }

    /// Envoy's process id (for CPU accounting).
    pub fn envoy_pid(&self) -> Option<u32> {
        self.processes
            .iter()
            .find(|p| p.name() == "envoy")
            .map(Process::pid)
    }

    /// A counter or gauge from Envoy's `/stats`.
    pub async fn envoy_stat(&self, name: &str) -> Option<u64> {
        self.envoy_stat_at(&self.admin_url, name).await
    }

    /// A histogram's cumulative quantiles from Envoy's `/stats` (`P50(interval,cumulative)`
    /// …), as (quantile in percent, value); `None` before anything was recorded and flushed.
    pub async fn envoy_quantiles(&self, name: &str) -> Option<Vec<(f64, f64)>> {
        let escaped = name.replace('.', "\\.");
        let url = format!("{}/stats?filter=^{escaped}$", self.admin_url);
        let text = crate::client::get_text(&self.http, &url).await?;
        let line = text.lines().find(|l| l.starts_with(name))?;
        let quantiles: Vec<(f64, f64)> = line
            .split_whitespace()
            .filter_map(|part| {
                let (q, values) = part.strip_prefix('P')?.split_once('(')?;
                let (_, cumulative) = values.strip_suffix(')')?.split_once(',')?;
                Some((q.parse().ok()?, cumulative.parse().ok()?))
            })
            .filter(|(_, v): &(f64, f64)| v.is_finite())
            .collect();
        (!quantiles.is_empty()).then_some(quantiles)
    }

    /// A histogram's recorded values as Envoy last flushed them (`histogram_buckets=detailed`:
    /// every bucket's lower bound, width and count since Envoy started), for quantiles of what
    /// one step recorded: the counts after it less those before.
    pub async fn envoy_histogram(&self, name: &str) -> Option<Vec<Bucket>> {
        let escaped = name.replace('.', "\\.");
        let url = format!(
            "{}/stats?filter=^{escaped}$&histogram_buckets=detailed",
            self.admin_url
        );
        let text = crate::client::get_text(&self.http, &url).await?;
        let totals = text
            .lines()
            .find_map(|l| l.trim().strip_prefix("totals="))?;
        Some(parse_buckets(totals))
    }

    /// A counter or gauge from the `/stats` of the Envoy at `admin_url`.
    pub async fn envoy_stat_at(&self, admin_url: &str, name: &str) -> Option<u64> {
        let escaped = name.replace('.', "\\.").replace('|', "\\|");
        let url = format!("{admin_url}/stats?filter=^{escaped}$");
        let text = crate::client::get_text(&self.http, &url).await?;
        text.lines().find_map(|l| {
            l.strip_prefix(name)?
                .strip_prefix(": ")?
                .trim()
                .parse()
                .ok()
        })
    }

    /// CPU time (user + system) each of the stack's processes has used so far, by name, in
    /// seconds: where a load step's CPU went.
    pub fn cpu_seconds(&self) -> Vec<(String, f64)> {
        self.processes
            .iter()
            .filter_map(|p| Some((p.name().to_owned(), crate::process::cpu_seconds(p.pid())?)))
            .collect()
    }

    /// The sidecar's `/metrics` text.
    pub async fn sidecar_metrics(&self) -> Result<String> {
        let url = self
            .sidecar_url
            .as_ref()
            .context("no sidecar in this mode")?;
        Ok(self
            .http
            .get(format!("{url}/metrics"))
            .send()
            .await?
            .text()
            .await?)
    }
}

/// One bucket of an Envoy histogram: values from `lower` to `lower + width`, `count` of them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bucket {
    /// The smallest value it holds.
    pub lower: f64,
    /// Its width: it holds values below `lower + width`.
    pub width: f64,
    /// Values recorded in it.
    pub count: u64,
}

/// `lower,width:count, …` as Envoy writes a detailed histogram's buckets.
fn parse_buckets(text: &str) -> Vec<Bucket> {
    text.split(", ")
        .filter_map(|b| {
            let (range, count) = b.trim().split_once(':')?;
            let (lower, width) = range.split_once(',')?;
            Some(Bucket {
                lower: lower.parse().ok()?,
                width: width.parse().ok()?,
                count: count.parse().ok()?,
            })
        })
        .collect()
}

/// The `q` quantile (0..=1) of what was recorded between `before` and `after` (two reads of
/// one histogram), at its bucket's middle; `None` if nothing was.
pub fn quantile_between(before: &[Bucket], after: &[Bucket], q: f64) -> Option<f64> {
    let earlier = |b: &Bucket| {
        before
            .iter()
            .find(|x| x.lower == b.lower && x.width == b.width)
            .map_or(0, |x| x.count)
    };
    let mut step: Vec<(f64, u64)> = after
        .iter()
        .map(|b| (b.lower + b.width / 2.0, b.count.saturating_sub(earlier(b))))
        .filter(|&(_, n)| n > 0)
        .collect();
    step.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total: u64 = step.iter().map(|s| s.1).sum();
    let rank = (q * total as f64).ceil().max(1.0) as u64;
    let mut seen = 0;
    step.into_iter().find_map(|(value, n)| {
        seen += n;
        (total > 0 && seen >= rank).then_some(value)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Buckets as Envoy 1.40 writes them; the step's quantile ignores what came before it.
    #[test]
    fn a_quantile_of_one_step() {
        let before = parse_buckets("59,1:1, 60,1:4, 100,10:6");
        assert_eq!(
            before[2],
            Bucket {
                lower: 100.0,
                width: 10.0,
                count: 6
            }
        );
        let after = parse_buckets("59,1:1, 60,1:4, 100,10:9, 3400,100:1");
        assert_eq!(quantile_between(&before, &after, 0.5), Some(105.0));
        assert_eq!(quantile_between(&before, &after, 1.0), Some(3450.0));
        assert_eq!(quantile_between(&after, &after, 0.5), None);
        assert_eq!(quantile_between(&[], &before, 0.4), Some(60.5));
        assert_eq!(quantile_between(&[], &before, 0.5), Some(105.0));
    }
}
