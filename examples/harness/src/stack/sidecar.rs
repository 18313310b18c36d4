//! The stack's sidecars: each one's configuration, built from the sidecar's own configuration
//! types and written as the TOML it reads, and its process.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::Result;
use kvroute_sidecar::config::Config;

use super::{EngineInfo, StackOptions, MODEL};
use crate::dynamo::Discovery;
use crate::paths;
use crate::process::{wait_for, Process};
use crate::sidecar_toml::{self, typed};

/// Where one sidecar of a stack listens and what it reads.
pub(super) struct SidecarPlace<'a> {
    /// 0: the stack's own; 1…: a replica's.
    pub(super) replica: usize,
    /// Its API port on 127.0.0.1.
    pub(super) port: u16,
    /// Its Unix socket, when it serves one too.
    pub(super) unix_socket: Option<PathBuf>,
    /// The admin port of the Envoy beside it.
    pub(super) admin: u16,
    /// Where it reads KV events: the stack's nats-server, or a lossy proxy in front of it.
    pub(super) events_url: &'a str,
}

/// The configuration of one sidecar of the stack, built from the sidecar's own configuration
/// types: the model, the workers (`[[workers]]` and `[[zmq]]`, Dynamo discovery in pin mode,
/// Envoy's membership with EDS), NATS, Envoy's admin, the replica plane.
fn sidecar_config(
    opts: &StackOptions,
    engines: &[EngineInfo],
    nats_url: &str,
    place: &SidecarPlace<'_>,
    discovery: &Discovery,
) -> Result<Config> {
    let mut nats = serde_json::json!({"url": place.events_url});
    if let Some(subjects) = &opts.nats_subjects {
        nats["subjects"] = serde_json::json!(subjects);
    }
    let mut config: Config = typed(
        "sidecar",
        serde_json::json!({
            "listen": format!("127.0.0.1:{}", place.port),
            "unix_socket": place.unix_socket,
            "nats": nats,
            "models": [{"name": MODEL, "dir": paths::model_dir(), "block_size": opts.block_size()}],
            "envoy": {
                "admin_url": format!("http://127.0.0.1:{}", place.admin),
                "cluster": opts.workers_cluster,
                "poll_interval_ms": 100,
            },
        }),
    )?;
    // In pin mode the engines are found through Dynamo discovery, with EDS through Envoy.
    for e in engines.iter().filter(|_| !opts.eds_membership) {
        if !opts.pin_mode() {
            config.workers.push(typed(
                "worker",
                serde_json::json!({"address": e.address, "model": MODEL, "dynamo_worker_id": e.dynamo_worker_id}),
            )?);
        }
        if let (Some(events), Some(replay)) = (&e.zmq_endpoint, &e.replay_endpoint) {
            // Dynamo's mocker publishes on vLLM's default topic, the empty one.
            let topic = if opts.dynamo.is_some() {
                ""
            } else {
                "kv-events"
            };
            config.zmq.push(typed(
                "zmq",
                serde_json::json!({"endpoint": events, "replay_endpoint": replay, "worker": e.address, "topic": topic}),
            )?);
        }
    }
    if opts.pin_mode() {
        let mut d = discovery.config(MODEL);
        d.poll_interval_ms = 100;
        config.dynamo_discovery.push(d);
    }
    if opts.eds_membership {
        if let Some(envoy) = &mut config.envoy {
            envoy.members.push(typed(
                "members",
                serde_json::json!({"model": MODEL, "events": "tcp://{host}:{port+1}", "replay": "tcp://{host}:{port+2}", "topic": "kv-events"}),
            )?);
        }
    }
    if let Some(r) = &opts.replicas {
        let loss = if r.lossy.is_none_or(|l| l == place.replica) {
            r.loss
        } else {
            0.0
        };
        config.replicas = Some(typed(
            "replicas",
            serde_json::json!({
                "group": "stack",
                "id": format!("r{}", place.replica),
                "interval_ms": r.interval_ms,
                "reconcile": r.reconcile,
                "share_load": r.share_load,
                "load_interval_ms": r.load_interval_ms,
                "test_drop_events": loss,
                // Events through a proxy: the replica plane stays on the real server.
                "nats_url": (place.events_url != nats_url).then_some(nats_url),
            }),
        )?);
    }
    Ok(config)
}

/// [`sidecar_config`] as the TOML the sidecar reads, with [`StackOptions::sidecar_toml`]'s
/// tables merged over it ([`sidecar_toml::text`]).
pub(super) fn sidecar_text(
    opts: &StackOptions,
    engines: &[EngineInfo],
    nats_url: &str,
    place: &SidecarPlace<'_>,
    discovery: &Discovery,
) -> Result<String> {
    let config = sidecar_config(opts, engines, nats_url, place, discovery)?;
    let extra = sidecar_toml::table("StackOptions::sidecar_toml", &opts.sidecar_toml)?;
    sidecar_toml::text(&config, extra)
}

/// Start the sidecar on `dir/sidecar.toml` as process `name` and wait until `url` answers
/// `/healthz`.
pub(super) async fn start_sidecar(
    dir: &Path,
    name: &str,
    url: &str,
    http: &reqwest::Client,
) -> Result<Process> {
    let mut cmd = Command::new(paths::binary("kvroute-sidecar")?);
    cmd.arg("serve")
        .arg("--config")
        .arg(dir.join("sidecar.toml"));
    let process = Process::spawn(name, cmd, dir)?;
    let probe = &format!("{url}/healthz");
    wait_for("sidecar /healthz", Duration::from_secs(30), || async move {
        http.get(probe)
            .send()
            .await
            .ok()
            .filter(|r| r.status().is_success())
    })
    .await?;
    Ok(process)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stack::{Mode, ReplicaOptions};

    fn engines() -> Vec<EngineInfo> {
        (0..2)
            .map(|i| EngineInfo {
                index: i,
                address: format!("127.0.0.1:{}", 9000 + i),
                dynamo_worker_id: 100 + i as u64,
                zmq_endpoint: (i == 1).then(|| "tcp://127.0.0.1:9101".to_owned()),
                replay_endpoint: (i == 1).then(|| "tcp://127.0.0.1:9102".to_owned()),
            })
            .collect()
    }

    fn place(replica: usize, events_url: &str) -> SidecarPlace<'_> {
        SidecarPlace {
            replica,
            port: 7000,
            unix_socket: None,
            admin: 7001,
            events_url,
        }
    }

    /// The text the sidecar reads back is the stack's fleet: both engines as workers, the vLLM
    /// one's sockets, NATS through the proxy, the replica plane on the real server, the lossy
    /// replica losing and the other not.
    #[test]
    fn a_replicas_configuration_reads_back_as_the_stack_built_it() {
        let mut opts = StackOptions::new("t", Mode::Kvroute);
        opts.replicas = Some(ReplicaOptions {
            count: 2,
            interval_ms: 500,
            loss: 0.1,
            lossy: Some(1),
            reconcile: true,
            share_load: false,
            load_interval_ms: 10,
        });
        let discovery = Discovery::File(PathBuf::from("/nowhere"));
        for (replica, loss) in [(0, 0.0), (1, 0.1)] {
            let text = sidecar_text(
                &opts,
                &engines(),
                "nats://127.0.0.1:4222",
                &place(replica, "nats://127.0.0.1:5555"),
                &discovery,
            )
            .unwrap();
            let config: Config = toml::from_str(&text).unwrap();
            assert_eq!(config.listen.port(), 7000);
            assert_eq!(config.workers.len(), 2);
            assert_eq!(config.workers[1].dynamo_worker_id, Some(101));
            assert_eq!(config.zmq.len(), 1, "{text}");
            assert_eq!(config.zmq[0].worker.as_deref(), Some("127.0.0.1:9001"));
            assert_eq!(config.nats.unwrap().url, "nats://127.0.0.1:5555");
            let r = config.replicas.unwrap();
            assert_eq!(r.id.as_deref(), Some(format!("r{replica}").as_str()));
            assert_eq!(r.nats_url.as_deref(), Some("nats://127.0.0.1:4222"));
            assert_eq!(r.test_drop_events, loss);
            assert!(config.dynamo_discovery.is_empty());
        }
    }

    /// A test's extra TOML goes over the stack's: a key replaces, a table it alone names is
    /// added, an array of tables is appended to; a field the sidecar does not know is refused
    /// here, not in a sidecar that fails to start.
    #[test]
    fn extra_toml_merges_over_the_stacks_and_is_checked() {
        let mut opts = StackOptions::new("t", Mode::Kvroute);
        opts.sidecar_toml = "[routing]\nmax_hinted_workers = 1\n[alarms]\nmin_hints = 3\n[[workers]]\naddress = \"127.0.0.1:9999\"\nmodel = \"tiny-llama\"\n".into();
        let discovery = Discovery::File(PathBuf::from("/nowhere"));
        let url = "nats://127.0.0.1:4222";
        let text = sidecar_text(&opts, &engines(), url, &place(0, url), &discovery).unwrap();
        let config: Config = toml::from_str(&text).unwrap();
        assert_eq!(config.routing.max_hinted_workers, 1);
        assert_eq!(config.alarms.min_hints, 3);
        assert_eq!(config.workers.len(), 3);
        assert!(config.replicas.is_none());

        opts.sidecar_toml = "[routing]\nmax_hinted_worker = 1\n".into();
        let err = sidecar_text(&opts, &engines(), url, &place(0, url), &discovery).unwrap_err();
        assert!(format!("{err:#}").contains("max_hinted_worker"), "{err:#}");
    }
}
