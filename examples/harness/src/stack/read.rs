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
