//! A model's fleet from Envoy's membership (`[[envoy.members]]`): on Kubernetes the engines are
//! whatever EDS lists, and pods are added, removed and replaced on every rollout. Each host of
//! the cluster is a worker, hinted by its `ip:port`; its KV events are read from endpoints the
//! entry's templates give for it (`tcp://{host}:5557`). A host that appears is added to the fleet
//! and its subscriber started; a host that leaves has its subscriber closed at once, and is not
//! hinted (the core's Envoy view) and loses its index entries after the grace period.
//!
//! [`Members`] decides which subscribers to start and stop from the hosts listed; the caller
//! (the Envoy admin poll) executes that, on threads of their own (libzmq blocks).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::config::{MembersConfig, ZmqConfig};
use crate::endpoint_template::EndpointTemplate;
use crate::sidecar::Sidecar;

/// What to do about one entry's hosts.
#[derive(Debug, Clone)]
pub struct Changes {
    /// Hosts new to the entry, with their source's configuration.
    pub start: Vec<ZmqConfig>,
    /// Hosts that left.
    pub stop: Vec<String>,
    /// Hosts whose endpoints the templates cannot make (not `ip:port`, a port out of range).
    pub unusable: Vec<String>,
}

/// The subscribers of every `[[envoy.members]]` entry, by entry and host.
#[derive(Debug, Default)]
pub struct Members {
    running: BTreeMap<(usize, String), Arc<AtomicBool>>,
    /// Hosts whose endpoints could not be made, said once each.
    unusable: BTreeSet<(usize, String)>,
}

impl Members {
    /// Compare entry `entry`'s listed hosts with its running subscribers.
    pub fn changes(&self, entry: usize, config: &MembersConfig, hosts: &[String]) -> Changes {
        // Both templates were checked when the configuration loaded.
        let events = EndpointTemplate::parse(&config.events).ok();
        let replay = config
            .replay
            .as_deref()
            .map(|t| EndpointTemplate::parse(t).ok());
        // A host's (events, replay) endpoints; `None` when a template cannot make one.
        let endpoints = |host: &str| -> Option<(String, Option<String>)> {
            let events = events.as_ref()?.expand(host)?;
            match &replay {
                None => Some((events, None)),
                Some(r) => Some((events, Some(r.as_ref()?.expand(host)?))),
            }
        };
        let listed: BTreeSet<&String> = hosts.iter().collect();
        let mut changes = Changes {
            start: Vec::new(),
            stop: Vec::new(),
            unusable: Vec::new(),
        };
        for host in &listed {
            let key = (entry, (*host).clone());
            if self.running.contains_key(&key) {
                continue;
            }
            match endpoints(host) {
                Some((endpoint, replay_endpoint)) => changes.start.push(ZmqConfig {
                    endpoint,
                    replay_endpoint,
                    worker: Some((*host).clone()),
                    topic: config.topic.clone(),
                    bind: false,
                    max_message_bytes: config.max_message_bytes,
                }),
                None if !self.unusable.contains(&key) => changes.unusable.push((*host).clone()),
                None => {}
            }
        }
        for (e, host) in self.running.keys() {
            if *e == entry && !listed.contains(host) {
                changes.stop.push(host.clone());
            }
        }
        changes
    }

    /// Follow entry `entry`'s listed hosts: start and stop their KV-event subscribers.
    pub fn sync(
        &mut self,
        entry: usize,
        config: &MembersConfig,
        hosts: &[String],
        state: &Arc<Sidecar>,
    ) {
        let changes = self.changes(entry, config, hosts);
        self.unusable
            .retain(|(e, h)| *e != entry || hosts.contains(h));
        self.apply(entry, changes, state);
    }

    fn apply(&mut self, entry: usize, changes: Changes, state: &Arc<Sidecar>) {
        for host in changes.unusable {
            tracing::warn!(worker = %host, "a host of Envoy's cluster whose KV-event endpoints the [[envoy.members]] templates cannot make: its blocks are not indexed");
            self.unusable.insert((entry, host));
        }
        for host in changes.stop {
            if let Some(stop) = self.running.remove(&(entry, host.clone())) {
                tracing::info!(worker = %host, "a host left Envoy's cluster: its KV-event subscriber is closed");
                stop.store(true, Ordering::Relaxed);
            }
        }
        for config in changes.start {
            let Some(host) = config.worker.clone() else {
                continue;
            };
            match crate::transports::zmq::spawn(config, state.clone()) {
                Ok(stop) => {
                    self.running.insert((entry, host), stop);
                }
                Err(e) => {
                    // Tried again at the next poll.
                    tracing::error!(worker = %host, error = %e, "cannot start a KV-event subscriber");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members(events: &str, replay: Option<&str>) -> MembersConfig {
        MembersConfig {
            cluster: None,
            model: "m".into(),
            events: events.into(),
            replay: replay.map(Into::into),
            topic: "kv-events".into(),
            max_message_bytes: 1 << 20,
        }
    }

    #[test]
    fn hosts_that_come_and_go_start_and_stop_their_subscribers() {
        let config = members("tcp://{host}:{port+1}", Some("tcp://{host}:{port+2}"));
        let mut m = Members::default();
        let hosts = ["127.0.0.1:8000".to_string(), "127.0.0.1:9000".to_string()];
        let c = m.changes(0, &config, &hosts);
        assert_eq!(c.start.len(), 2);
        assert!(c.stop.is_empty());
        let first = &c.start[0];
        assert_eq!(first.endpoint, "tcp://127.0.0.1:8001");
        assert_eq!(
            first.replay_endpoint.as_deref(),
            Some("tcp://127.0.0.1:8002")
        );
        assert_eq!(first.worker.as_deref(), Some("127.0.0.1:8000"));
        assert_eq!(first.topic, "kv-events");
        // As if they were running.
        for h in &hosts {
            m.running
                .insert((0, h.clone()), Arc::new(AtomicBool::new(false)));
        }
        assert!(m.changes(0, &config, &hosts).start.is_empty());
        let c = m.changes(0, &config, &hosts[1..]);
        assert_eq!(c.stop, vec![hosts[0].clone()]);
        // Another entry's hosts are its own.
        assert_eq!(m.changes(1, &config, &hosts[..1]).start.len(), 1);
        assert!(m.changes(1, &config, &[]).stop.is_empty());
        // A host whose replay port would be out of range is said, not subscribed half-way.
        let c = m.changes(0, &config, &["127.0.0.1:65534".to_string()]);
        assert_eq!(c.unusable, vec!["127.0.0.1:65534".to_string()]);
        assert!(c.start.is_empty());
    }
}
