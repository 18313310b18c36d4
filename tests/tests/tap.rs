//! `kvroute-sidecar tap` shows an operator the event plane live: decoded events as JSON lines
//! and message counts per subject and component, from NATS and from ZMQ.

mod common;

use std::process::Command;
use std::time::Duration;

use kvroute_harness::paths;
use kvroute_harness::process::{free_port, wait_for, Process};

fn tap(dir: &std::path::Path, name: &str, args: &[&str]) -> Process {
    let mut cmd = Command::new(paths::binary("kvroute-sidecar").unwrap());
    cmd.arg("tap").args(args).args(["--summary-s", "1"]);
    Process::spawn(name, cmd, dir).unwrap()
}

async fn log_with(dir: &std::path::Path, name: &str, needles: &[&str]) -> String {
    let path = dir.join(format!("{name}.log"));
    let (path, needles) = (&path, needles);
    wait_for("tap output", Duration::from_secs(15), || async move {
        let text = std::fs::read_to_string(path).ok()?;
        needles.iter().all(|n| text.contains(n)).then_some(text)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}: {}", std::fs::read_to_string(path).unwrap_or_default()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tap_shows_dynamo_and_vllm_events() {
    let samples = kvroute_protocol::samples_dir();
    let dir = paths::run_dir("tap").unwrap();

    let nats_port = free_port().unwrap();
    let mut nats = Command::new(paths::venv_tool("nats-server").unwrap());
    nats.args(["-a", "127.0.0.1", "-p", &nats_port.to_string()]);
    let _nats = Process::spawn("nats", nats, &dir).unwrap();
    let url = format!("nats://127.0.0.1:{nats_port}");
    let client = wait_for("nats-server", Duration::from_secs(10), || async {
        async_nats::connect(url.as_str()).await.ok()
    })
    .await
    .unwrap();
    let _tap = tap(&dir, "tap-nats", &["--nats", &url]);
    // Published until the tap has subscribed and shows them.
    let dynamo = samples.join("dynamo");
    let publish = async {
        loop {
            for (file, subject) in [
                (
                    "kv-events_stored_prompt_4blocks.msgpack",
                    "namespace.dynamo.component.backend.endpoint.generate.kv-events",
                ),
                (
                    "kv-events_disagg_prefill_component.msgpack",
                    "namespace.dynamo.component.prefill.endpoint.generate.kv-events",
                ),
                (
                    "forward-pass-metrics_busy.msgpack",
                    "namespace.dynamo.component.backend.endpoint.generate.forward-pass-metrics",
                ),
            ] {
                let body = std::fs::read(dynamo.join(file)).unwrap();
                client.publish(subject, body.into()).await.unwrap();
            }
            client.flush().await.unwrap();
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    };
    let text = tokio::select! {
        text = log_with(&dir, "tap-nats", &["\"worker_id\":13140558925506144034", "\"dynamo/backend\"", "\"dynamo/prefill\"", "forward-pass-metrics"]) => text,
        _ = publish => unreachable!(),
    };
    assert!(text.contains("per component"), "{text}");

    // ZMQ: libzmq replaying the vLLM capture.
    let (pub_port, replay_port) = (free_port().unwrap(), free_port().unwrap());
    let (pub_port_arg, replay_port_arg) = (pub_port.to_string(), replay_port.to_string());
    let _publisher = common::spawn_vllm_publisher(
        &dir,
        &samples.join("vllm/run2-sha256_cbor-evict-reset/raw"),
        &[
            "--pub-port",
            &pub_port_arg,
            "--replay-port",
            &replay_port_arg,
            "--start-after",
            "2",
        ],
    );
    let endpoint = format!("tcp://127.0.0.1:{pub_port}");
    let _tap_zmq = tap(&dir, "tap-zmq", &["--zmq", &endpoint]);
    let text = log_with(
        &dir,
        "tap-zmq",
        &["\"AllBlocksCleared\"", "\"BlockRemoved\"", "\"seq\":13"],
    )
    .await;
    assert!(!text.contains("\"error\""), "{text}");
}
