//! Dynamo's file discovery: the instances serving a component's endpoint, one JSON record per
//! instance at `<dir>/v1/instances/<namespace>/<component>/<endpoint>/<instance id>`
//! (`{"type": "Endpoint", "instance_id": …, "transport": {"tcp": "ip:port/…"}, …}`). A record
//! appears when the instance starts and goes away when it stops.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use crate::config::DiscoveryConfig;
use crate::metrics::label;
use crate::state::AppState;

/// The directory holding `config`'s instance records.
pub fn instances_dir(config: &DiscoveryConfig) -> PathBuf {
    config
        .dir
        .join("v1/instances")
        .join(&config.namespace)
        .join(&config.component)
        .join(&config.endpoint)
}

/// An instance record: its id and the `ip:port` of its request plane, or why it is not one.
pub fn parse_record(bytes: &[u8]) -> Result<(u64, String), String> {
    let v: Value = serde_json::from_slice(bytes).map_err(|e| format!("not JSON: {e}"))?;
    match v.get("type").and_then(Value::as_str) {
        None | Some("Endpoint") => {}
        Some(other) => return Err(format!("a {other} record, not an Endpoint")),
    }
    let id = v
        .get("instance_id")
        .and_then(Value::as_u64)
        .ok_or("no u64 instance_id")?;
    // "127.0.0.1:40051/bda8d114129d4c8f/dynamo/backend/generate": the address is before the path.
    let tcp = v
        .pointer("/transport/tcp")
        .and_then(Value::as_str)
        .unwrap_or("");
    let address = tcp.split('/').next().unwrap_or("").to_owned();
    Ok((
        id,
        if address.is_empty() {
            "dynamo".into()
        } else {
            address
        },
    ))
}

/// Read every record in `dir`: instance id → address. Files that are not instance records (or
/// are being rewritten) are skipped, with a debug line.
pub fn scan(dir: &Path) -> std::io::Result<BTreeMap<u64, String>> {
    let mut found = BTreeMap::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        // No instance has registered yet.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(found),
        Err(e) => return Err(e),
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if !path.is_file() || entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        // A record being rewritten may be empty or cut: skip it this scan.
        let Ok(bytes) = std::fs::read(&path) else {
            continue;
        };
        match parse_record(&bytes) {
            Ok((id, address)) => {
                found.insert(id, address);
            }
            Err(why) => tracing::debug!(file = %path.display(), %why, "not an instance record"),
        }
    }
    Ok(found)
}

/// Poll the directory forever, applying each scan to the registry.
pub async fn run(config: DiscoveryConfig, state: Arc<AppState>) -> anyhow::Result<()> {
    let dir = instances_dir(&config);
    tracing::info!(dir = %dir.display(), model = %config.model, "reading Dynamo discovery records");
    let mut tick = tokio::time::interval(Duration::from_millis(config.poll_interval_ms.max(50)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tick.tick().await;
        let scanned = {
            let dir = dir.clone();
            tokio::task::spawn_blocking(move || scan(&dir)).await
        };
        match scanned {
            Ok(Ok(instances)) => {
                failing = false;
                state
                    .metrics
                    .discovered_instances
                    .get_or_create(&label("model", config.model.clone()))
                    .set(instances.len() as i64);
                state.record_discovery(&config.model, &instances);
            }
            Ok(Err(e)) if !failing => {
                failing = true;
                tracing::error!(dir = %dir.display(), error = %e, "cannot read the Dynamo discovery directory; instances keep their last state");
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_captured_records() {
        let samples = kvroute_protocol::samples_dir().join("dynamo");
        let instance = std::fs::read(samples.join("discovery_instance_record.json")).unwrap();
        assert_eq!(
            parse_record(&instance).unwrap(),
            (13666402953397619855, "127.0.0.1:40051".into())
        );
        for other in [
            "discovery_event_channel_record.json",
            "discovery_event_source_record.json",
        ] {
            let bytes = std::fs::read(samples.join(other)).unwrap();
            assert!(parse_record(&bytes).is_err(), "{other}");
        }
        assert!(parse_record(b"{").is_err());
        assert!(parse_record(br#"{"type":"Endpoint","instance_id":-1}"#).is_err());
    }

    #[test]
    fn scans_one_endpoint_directory() {
        let root = std::env::temp_dir().join(format!("kvroute-discovery-{}", std::process::id()));
        let config = DiscoveryConfig {
            dir: root.clone(),
            model: "m".into(),
            namespace: "dynamo".into(),
            component: "backend".into(),
            endpoint: "generate".into(),
            poll_interval_ms: 1000,
        };
        let dir = instances_dir(&config);
        assert!(
            scan(&dir).unwrap().is_empty(),
            "no directory yet: no instances"
        );
        std::fs::create_dir_all(&dir).unwrap();
        let samples = kvroute_protocol::samples_dir().join("dynamo");
        std::fs::copy(
            samples.join("discovery_instance_record.json"),
            dir.join("bda8d114129d4c8f"),
        )
        .unwrap();
        std::fs::write(dir.join("partial"), b"{\"type\":").unwrap();
        let found = scan(&dir).unwrap();
        assert_eq!(found.len(), 1);
        assert_eq!(found[&13666402953397619855], "127.0.0.1:40051");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
