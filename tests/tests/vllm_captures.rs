//! Interop with real vLLM output and real libzmq: the byte-exact ZMQ frames captured from vLLM
//! 0.32 are published by libzmq (pyzmq, as vLLM does) with one message held back; the sidecar
//! subscribes, sees the gap, fetches the message from the libzmq replay socket and indexes
//! every captured store under kvroute's own hash of its tokens.

mod common;

use std::time::Duration;

use common::{hint_for_tokens, metric, spawn_sidecar, spawn_vllm_publisher};
use kvroute_harness::client::get_text;
use kvroute_harness::paths;
use kvroute_harness::process::{free_port, wait_for};
use kvroute_protocol::vllm::{decode_batch, VllmEvent};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn captured_vllm_stream_through_libzmq_with_a_replayed_gap() {
    let raw = kvroute_protocol::samples_dir().join("vllm/run1-sha256-default/raw");
    let dir = paths::run_dir("vllm-captures").unwrap();
    let (pub_port, replay_port, port) = (
        free_port().unwrap(),
        free_port().unwrap(),
        free_port().unwrap(),
    );
    let (pub_port_arg, replay_port_arg) = (pub_port.to_string(), replay_port.to_string());
    let _publisher = spawn_vllm_publisher(
        &dir,
        &raw,
        &[
            "--pub-port",
            &pub_port_arg,
            "--replay-port",
            &replay_port_arg,
            "--skip",
            "1",
            "--start-after",
            "2",
        ],
    );
    let config = format!(
        "listen = \"127.0.0.1:{port}\"\n[[models]]\nname = \"m\"\ndir = \"{}\"\nblock_size = 32\n[[workers]]\naddress = \"127.0.0.1:9000\"\nmodel = \"m\"\n[[zmq]]\nendpoint = \"tcp://127.0.0.1:{pub_port}\"\nreplay_endpoint = \"tcp://127.0.0.1:{replay_port}\"\nworker = \"127.0.0.1:9000\"\ntopic = \"kv-events\"\n",
        paths::model_dir().display()
    );
    let sidecar = spawn_sidecar(&dir, &config);

    let http = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{port}");
    let (http_ref, metrics) = (&http, &format!("{base}/metrics"));
    let text = wait_for("the replayed gap", Duration::from_secs(20), || async move {
        let text = get_text(http_ref, metrics).await?;
        let replayed = "kvroute_sequence_total{worker=\"127.0.0.1:9000\",kind=\"replayed\"}";
        (metric(&text, replayed)? >= 1.0).then_some(text)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}: {}", sidecar.log_tail()));
    let gap = "kvroute_sequence_total{worker=\"127.0.0.1:9000\",kind=\"gap\"}";
    assert_eq!(metric(&text, gap), Some(1.0), "{text}");
    assert!(!text.contains("kvroute_decode_errors_total"), "{text}");

    // Every captured store — including the replayed one — answers a hint for its own tokens
    // with all of its blocks.
    for seq in 0..3 {
        let payload = std::fs::read(raw.join(format!("seq{seq:06}.payload.msgpack"))).unwrap();
        let batch = decode_batch(&payload).unwrap();
        let VllmEvent::BlockStored { token_ids, .. } = &batch.events[0] else {
            panic!("seq {seq} is a store")
        };
        let resp = hint_for_tokens(&http, &base, token_ids, 32).await;
        assert_eq!(resp.workers[0], "127.0.0.1:9000");
        assert_eq!(resp.matched_blocks, 12, "seq {seq}");
    }
}

/// vLLM connects when its endpoint has no `*`: the sidecar binds, and llm-d's topic
/// `kv@<ip:port>@<model>` names the worker (no `worker` in the config).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bound_socket_learns_the_worker_from_llm_d_topics() {
    let raw = kvroute_protocol::samples_dir().join("vllm/run1-sha256-default/raw");
    let dir = paths::run_dir("vllm-bind").unwrap();
    let (bind_port, replay_port, port) = (
        free_port().unwrap(),
        free_port().unwrap(),
        free_port().unwrap(),
    );
    let config = format!(
        "listen = \"127.0.0.1:{port}\"\n[[models]]\nname = \"m\"\ndir = \"{}\"\nblock_size = 32\n[[workers]]\naddress = \"127.0.0.1:9001\"\nmodel = \"m\"\n[[zmq]]\nendpoint = \"tcp://127.0.0.1:{bind_port}\"\nbind = true\ntopic = \"kv@\"\n",
        paths::model_dir().display()
    );
    let sidecar = spawn_sidecar(&dir, &config);
    let (replay_port_arg, connect) = (
        replay_port.to_string(),
        format!("tcp://127.0.0.1:{bind_port}"),
    );
    let _publisher = spawn_vllm_publisher(
        &dir,
        &raw,
        &[
            "--pub-port",
            "0",
            "--replay-port",
            &replay_port_arg,
            "--connect",
            &connect,
            "--topic",
            "kv@127.0.0.1:9001@m",
            "--start-after",
            "2",
        ],
    );
    let http = reqwest::Client::new();
    let metrics = format!("http://127.0.0.1:{port}/metrics");
    let (http_ref, metrics) = (&http, &metrics);
    wait_for(
        "events indexed under the topic's worker",
        Duration::from_secs(20),
        || async move {
            let text = get_text(http_ref, metrics).await?;
            (metric(&text, "kvroute_index_blocks{worker=\"127.0.0.1:9001\"}")? >= 12.0)
                .then_some(())
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}: {}", sidecar.log_tail()));
}
