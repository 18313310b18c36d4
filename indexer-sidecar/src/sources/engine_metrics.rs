//! Scraping each engine's Prometheus `/metrics` for load (vLLM metric names).

use std::sync::Arc;
use std::time::Duration;

use crate::load::parse_vllm_metrics;
use crate::metrics::label;
use crate::state::AppState;

/// Scrape every worker every `routing.scrape_interval_ms`, forever.
pub async fn run(state: Arc<AppState>) {
    let every = Duration::from_millis(state.routing.scrape_interval_ms.max(10));
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
        let registry = state.registry();
        let scrapes = registry.iter().filter(|w| !w.pinned).map(|w| {
            let http = &http;
            async move {
                let url = format!("http://{}/metrics", w.address);
                let text = async {
                    http.get(&url)
                        .send()
                        .await?
                        .error_for_status()?
                        .text()
                        .await
                };
                (w.id, w.address.clone(), text.await.ok())
            }
        });
        for (id, address, text) in futures::future::join_all(scrapes).await {
            let load = text.as_deref().and_then(parse_vllm_metrics);
            if load.is_none() {
                state
                    .metrics
                    .scrape_errors
                    .get_or_create(&label("worker", address))
                    .inc();
            }
            state.record_load(id, load);
        }
    }
}
