//! Scraping each engine's Prometheus `/metrics` for load (vLLM metric names), and its own
//! prefix-cache counters to show beside what the hints predicted.

use std::sync::Arc;
use std::time::Duration;

use crate::sidecar::Sidecar;

/// Scrape every worker every `routing.scrape_interval_ms`, forever.
pub async fn run(state: Arc<Sidecar>) {
    let every = state.scrape_interval;
    // A busy engine answers /metrics late; a late answer still beats none.
    let timeout = every.max(Duration::from_secs(2));
    let Ok(http) = reqwest::Client::builder().timeout(timeout).build() else {
        tracing::error!("cannot build the HTTP client for engine metrics; load is hints only");
        return;
    };
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        // Pinned workers sit behind a Dynamo frontend: their load comes from `kv_metrics`.
        let workers = state.scraped_workers();
        let asked = std::time::Instant::now();
        let scrapes = workers.iter().map(|(id, address)| {
            let http = &http;
            async move {
                let url = format!("http://{address}/metrics");
                let text = async {
                    http.get(&url)
                        .send()
                        .await?
                        .error_for_status()?
                        .text()
                        .await
                };
                (*id, address, text.await.ok())
            }
        });
        for (id, address, text) in futures::future::join_all(scrapes).await {
            state.scraped(id, address, text.as_deref(), asked);
        }
    }
}
