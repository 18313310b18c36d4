//! Envoy's own view of the `workers` cluster, polled from its admin `/clusters?format=json`:
//! which hosts exist, which Envoy considers healthy (active health checks, outlier ejection), and
//! how many requests each has in flight. `override_host` does not check health, so the sidecar
//! must never hint a host Envoy would not use.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use crate::config::EnvoyConfig;
use crate::core::{HostView, Input};
use crate::sidecar::Sidecar;

/// Hosts of `cluster` by `ip:port`, from the admin endpoint's JSON.
pub fn parse_clusters(doc: &Value, cluster: &str) -> Option<HashMap<String, HostView>> {
    let status = doc["cluster_statuses"]
        .as_array()?
        .iter()
        .find(|c| c["name"] == cluster)?;
    let mut hosts = HashMap::new();
    for h in status["host_statuses"].as_array().into_iter().flatten() {
        let sock = &h["address"]["socket_address"];
        let (Some(ip), Some(port)) = (sock["address"].as_str(), sock["port_value"].as_u64()) else {
            continue;
        };
        let health = &h["health_status"];
        let flag = |name: &str| health[name].as_bool().unwrap_or(false);
        let eds = health["eds_health_status"].as_str().unwrap_or("HEALTHY");
        let healthy = matches!(eds, "HEALTHY" | "UNKNOWN")
            && !flag("failed_active_health_check")
            && !flag("failed_outlier_check")
            && !flag("failed_active_degraded_check")
            && !flag("pending_dynamic_removal");
        let rq_active = h["stats"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|s| s["name"] == "rq_active")
            .and_then(|s| match &s["value"] {
                Value::String(v) => v.parse().ok(),
                v => v.as_f64(),
            })
            .unwrap_or(0.0);
        hosts.insert(format!("{ip}:{port}"), HostView { healthy, rq_active });
    }
    Some(hosts)
}

/// Poll Envoy's admin endpoint forever and feed the result to the state.
pub async fn run(config: EnvoyConfig, state: Arc<Sidecar>) {
    let every = Duration::from_millis(config.poll_interval_ms.max(10));
    let Ok(http) = reqwest::Client::builder()
        .timeout(every.max(Duration::from_secs(1)))
        .build()
    else {
        return;
    };
    let url = format!(
        "{}/clusters?format=json",
        config.admin_url.trim_end_matches('/')
    );
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut warned = false;
    loop {
        tick.tick().await;
        let doc = async {
            http.get(&url)
                .send()
                .await?
                .error_for_status()?
                .json::<Value>()
                .await
        };
        let hosts = doc
            .await
            .ok()
            .and_then(|d| parse_clusters(&d, &config.cluster));
        match hosts {
            Some(hosts) => {
                if warned {
                    tracing::info!(%url, cluster = %config.cluster, "reading Envoy's view of the workers cluster again");
                }
                warned = false;
                state.ingest(None, Input::EnvoyView(&hosts), std::time::Instant::now());
            }
            None if !warned => {
                // Keep the last known view: a brief admin hiccup must not stop all hints.
                tracing::warn!(%url, cluster = %config.cluster, "cannot read Envoy's view of the workers cluster");
                warned = true;
            }
            None => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_health_and_active_requests() {
        let doc = serde_json::json!({"cluster_statuses": [
            {"name": "other", "host_statuses": []},
            {"name": "workers", "host_statuses": [
                {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 8001}},
                 "stats": [{"name": "rq_total", "value": "9"}, {"type": "GAUGE", "name": "rq_active", "value": "3"}],
                 "health_status": {"eds_health_status": "HEALTHY"}},
                {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 8002}},
                 "stats": [{"type": "GAUGE", "name": "rq_active"}],
                 "health_status": {"eds_health_status": "HEALTHY", "failed_active_health_check": true}},
                {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 8003}},
                 "health_status": {"eds_health_status": "HEALTHY", "failed_outlier_check": true}},
                {"address": {"pipe": {"path": "/x"}}}
            ]}
        ]});
        let hosts = parse_clusters(&doc, "workers").unwrap();
        assert_eq!(
            hosts["127.0.0.1:8001"],
            HostView {
                healthy: true,
                rq_active: 3.0
            }
        );
        assert!(!hosts["127.0.0.1:8002"].healthy);
        assert!(!hosts["127.0.0.1:8003"].healthy);
        assert_eq!(hosts.len(), 3);
        assert!(parse_clusters(&doc, "missing").is_none());
        assert!(parse_clusters(&serde_json::json!({}), "workers").is_none());
    }
}
