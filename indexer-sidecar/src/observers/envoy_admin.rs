//! Envoy's own view of the `workers` cluster, polled from its admin `/clusters?format=json`:
//! which hosts exist, which Envoy considers healthy (active health checks, outlier ejection), and
//! how many requests each has in flight. `override_host` does not check health, so the sidecar
//! must never hint a host Envoy would not use. Nor one Envoy would use but that is down: an
//! outlier ejection ends on a timer whether the engine is back or not, so a host Envoy
//! failed is hinted again only once it answers its health check ([`Revivals`], [`answers`]).
//! With `[[envoy.members]]`, the hosts of those clusters are the fleet
//! ([`crate::observers::membership`]).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use crate::config::EnvoyConfig;
use crate::core::{HostView, Input};
use crate::observers::membership::Members;
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

/// Hosts Envoy failed (ejected, failed a health check), until each answers its health check.
#[derive(Debug, Default)]
pub struct Revivals {
    /// Failed by Envoy, not answered since.
    down: HashSet<String>,
    /// Of those, the ones Envoy calls healthy again while they do not answer (said once).
    refusing: HashSet<String>,
}

impl Revivals {
    /// Note Envoy's view; the hosts to probe now: healthy to Envoy again, not answered yet.
    pub fn to_probe(&mut self, hosts: &HashMap<String, HostView>) -> Vec<String> {
        self.down.retain(|h| hosts.contains_key(h));
        self.refusing.retain(|h| self.down.contains(h));
        let mut probe = Vec::new();
        for (host, view) in hosts {
            if !view.healthy {
                self.down.insert(host.clone());
            } else if self.down.contains(host) {
                probe.push(host.clone());
            }
        }
        probe.sort();
        probe
    }

    /// Apply the probes' results (`host`, answered) to `hosts`: a host Envoy calls healthy that
    /// did not answer stays unhealthy. The hosts that started refusing (to say so, once).
    pub fn settle(
        &mut self,
        hosts: &mut HashMap<String, HostView>,
        probes: &[(String, bool)],
    ) -> Vec<String> {
        let mut newly = Vec::new();
        for (host, answered) in probes {
            if *answered {
                self.down.remove(host);
                self.refusing.remove(host);
                continue;
            }
            if let Some(view) = hosts.get_mut(host) {
                view.healthy = false;
            }
            if self.refusing.insert(host.clone()) {
                newly.push(host.clone());
            }
        }
        newly
    }
}

/// Whether the engine at `host` (`ip:port`) answers `GET /health` (vLLM's, SGLang's and
/// Dynamo's frontend's) within `timeout` with anything but a server error: a 404 is a server
/// without that route, alive; a refused connection, a timeout or a 503 is not.
pub async fn answers(http: &reqwest::Client, host: &str, timeout: Duration) -> bool {
    let response = http
        .get(format!("http://{host}/health"))
        .timeout(timeout)
        .send()
        .await;
    matches!(response, Ok(r) if !r.status().is_server_error())
}

/// What one poll of Envoy's admin endpoint shows.
#[derive(Debug)]
pub struct View {
    /// The hosts the sidecar may hint: those of `[envoy] cluster` and of every
    /// `[[envoy.members]]` cluster, by `ip:port`.
    pub hosts: HashMap<String, HostView>,
    /// Per `[[envoy.members]]` entry, every host its cluster lists, healthy or not (sorted).
    pub members: Vec<Vec<String>>,
}

/// The view of `doc`; `None` when the `[envoy]` cluster is not in it (a members cluster not
/// there yet lists no host).
pub fn view(doc: &Value, config: &EnvoyConfig) -> Option<View> {
    let mut hosts = parse_clusters(doc, &config.cluster)?;
    let mut members = Vec::new();
    for m in &config.members {
        let cluster = config.members_cluster(m);
        let listed = parse_clusters(doc, cluster).unwrap_or_default();
        let mut names: Vec<String> = listed.keys().cloned().collect();
        names.sort();
        members.push(names);
        hosts.extend(listed);
    }
    Some(View { hosts, members })
}

/// Poll Envoy's admin endpoint forever and feed the result to the state; with
/// `[[envoy.members]]`, follow the members' hosts (workers and their KV-event subscribers).
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
    let mut revivals = Revivals::default();
    let mut subscribers = Members::default();
    // Per `[[envoy.members]]` entry, the hosts the core was last told of.
    let mut told: Vec<Vec<String>> = vec![Vec::new(); config.members.len()];
    let probe_timeout = Duration::from_millis(250);
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
        let seen = doc.await.ok().and_then(|d| view(&d, &config));
        match seen {
            Some(View { mut hosts, members }) => {
                for (entry, (m, listed)) in config.members.iter().zip(&members).enumerate() {
                    // Workers join before their subscribers start: their first events are known.
                    // An unchanged list has nothing new for the core.
                    if told[entry] != *listed {
                        let joining = Input::Members {
                            model: &m.model,
                            hosts: listed,
                        };
                        state.ingest(joining, std::time::Instant::now());
                        told[entry].clone_from(listed);
                    }
                    subscribers.sync(entry, m, listed, &state);
                }
                let probe = revivals.to_probe(&hosts);
                let results: Vec<(String, bool)> =
                    futures::future::join_all(probe.into_iter().map(|host| {
                        let http = &http;
                        async move {
                            let up = answers(http, &host, probe_timeout).await;
                            (host, up)
                        }
                    }))
                    .await;
                for host in revivals.settle(&mut hosts, &results) {
                    tracing::warn!(worker = %host, "Envoy no longer ejects this worker, but it does not answer GET /health: not hinted until it does");
                }
                if warned {
                    tracing::info!(%url, cluster = %config.cluster, "reading Envoy's view of the workers cluster again");
                }
                warned = false;
                state.ingest(Input::EnvoyView(&hosts), std::time::Instant::now());
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

    #[test]
    fn members_clusters_add_their_hosts_to_the_view() {
        let host = |port: u64, healthy: &str| {
            serde_json::json!({"address": {"socket_address": {"address": "10.0.0.1", "port_value": port}},
                "health_status": {"eds_health_status": healthy}})
        };
        let doc = serde_json::json!({"cluster_statuses": [
            {"name": "workers", "host_statuses": [host(8000, "HEALTHY")]},
            {"name": "llama", "host_statuses": [host(8002, "HEALTHY"), host(8001, "UNHEALTHY")]}
        ]});
        let config: EnvoyConfig = toml::from_str(
            "admin_url = \"http://x\"\n[[members]]\ncluster = \"llama\"\nmodel = \"m\"\nevents = \"tcp://{host}:5557\"\n[[members]]\ncluster = \"absent\"\nmodel = \"n\"\nevents = \"tcp://{host}:5557\"\n",
        )
        .unwrap();
        let seen = view(&doc, &config).unwrap();
        assert_eq!(seen.hosts.len(), 3);
        assert!(!seen.hosts["10.0.0.1:8001"].healthy);
        assert_eq!(
            seen.members,
            vec![
                vec!["10.0.0.1:8001".to_string(), "10.0.0.1:8002".to_string()],
                vec![]
            ],
            "every host listed is a member, healthy or not; a cluster not there yet lists none"
        );
        let no_workers =
            serde_json::json!({"cluster_statuses": [{"name": "llama", "host_statuses": []}]});
        assert!(view(&no_workers, &config).is_none());
    }

    #[test]
    fn a_host_envoy_failed_is_healthy_again_only_once_it_answers() {
        let view = |healthy: bool| {
            HashMap::from([(
                "10.0.0.1:8000".to_string(),
                HostView {
                    healthy,
                    rq_active: 0.0,
                },
            )])
        };
        let host = "10.0.0.1:8000".to_string();
        let mut r = Revivals::default();
        assert!(
            r.to_probe(&view(true)).is_empty(),
            "never failed: not probed"
        );
        assert!(
            r.to_probe(&view(false)).is_empty(),
            "ejected: Envoy says so"
        );
        // The ejection ends; the engine is still down.
        let mut hosts = view(true);
        let probe = r.to_probe(&hosts);
        assert_eq!(probe, vec![host.clone()]);
        assert_eq!(
            r.settle(&mut hosts, &[(host.clone(), false)]),
            vec![host.clone()]
        );
        assert!(!hosts[&host].healthy);
        let mut hosts = view(true);
        r.to_probe(&hosts);
        assert!(
            r.settle(&mut hosts, &[(host.clone(), false)]).is_empty(),
            "said once"
        );
        assert!(!hosts[&host].healthy);
        // It answers: healthy, and no longer probed.
        let mut hosts = view(true);
        r.to_probe(&hosts);
        assert!(r.settle(&mut hosts, &[(host.clone(), true)]).is_empty());
        assert!(hosts[&host].healthy);
        assert!(r.to_probe(&view(true)).is_empty());
        // A host removed from the cluster is forgotten.
        r.to_probe(&view(false));
        assert!(r.to_probe(&HashMap::new()).is_empty());
        assert!(r.to_probe(&view(true)).is_empty());
    }
}
