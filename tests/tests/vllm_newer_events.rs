//! vLLM's events as its `kv_events.py` encodes them today, for a hybrid model (a full-attention
//! cache group and a sliding-window one), with fields and an event type kvroute does not know,
//! published over real ZMQ (libzmq via pyzmq, `tests/fixtures/vllm_publisher.py`).

mod common;

use std::time::Duration;

use common::{hint_for_tokens, metric, spawn_sidecar, spawn_vllm_publisher};
use kvroute_harness::client::get_text;
use kvroute_harness::paths;
use kvroute_harness::process::{free_port, wait_for};
use rmpv::Value;

fn map(fields: Vec<(&str, Value)>) -> Value {
    Value::Map(
        fields
            .into_iter()
            .map(|(k, v)| (Value::from(k), v))
            .collect(),
    )
}

/// One message: the prompt's 4 blocks stored in group 0 (full attention) and group 1 (sliding
/// window), an event type from a later vLLM, then group 1 dropping the blocks its window left.
fn hybrid_batch(tokens: &[u32]) -> Vec<u8> {
    let hashes = || Value::Array((1..=4u64).map(Value::from).collect());
    let stored = |group: u32, kind: &str| {
        map(vec![
            ("type", Value::from("BlockStored")),
            ("block_hashes", hashes()),
            ("parent_block_hash", Value::Nil),
            (
                "token_ids",
                Value::Array(tokens.iter().map(|&t| Value::from(t)).collect()),
            ),
            ("block_size", Value::from(16)),
            ("lora_id", Value::Nil),
            ("medium", Value::from("GPU")),
            ("lora_name", Value::Nil),
            ("extra_keys", Value::Nil),
            ("group_idx", Value::from(group)),
            ("kv_cache_spec_kind", Value::from(kind)),
            ("kv_cache_spec_sliding_window", Value::Nil),
            ("session_id", Value::from("s-1")),
            ("block_offsets", Value::Array(vec![Value::from(0)])),
        ])
    };
    let batch = map(vec![
        ("ts", Value::F64(1.0)),
        (
            "events",
            Value::Array(vec![
                stored(0, "full_attention"),
                stored(1, "sliding_window"),
                map(vec![
                    ("type", Value::from("BlockInactive")),
                    ("block_hashes", hashes()),
                ]),
                map(vec![
                    ("type", Value::from("BlockRemoved")),
                    ("block_hashes", hashes()),
                    ("medium", Value::from("GPU")),
                    ("group_idx", Value::from(1)),
                ]),
            ]),
        ),
        ("data_parallel_rank", Value::from(0)),
    ]);
    let mut bytes = Vec::new();
    rmpv::encode::write_value(&mut bytes, &batch).unwrap();
    bytes
}

/// The full-attention group's blocks are indexed and hinted; the sliding-window group's store
/// and removal are not applied (applied, the removal would have emptied the index), the unknown
/// event type is skipped and the unknown fields are counted, the rest of the batch applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hybrid_models_newer_events_index_its_full_attention_blocks() {
    let dir = paths::run_dir("vllm-newer-events").unwrap();
    let raw = dir.join("raw");
    std::fs::create_dir_all(&raw).unwrap();
    let tokens: Vec<u32> = (100..164).collect();
    std::fs::write(raw.join("seq000000.seq"), 0u64.to_be_bytes()).unwrap();
    std::fs::write(raw.join("seq000000.topic"), b"kv-events").unwrap();
    std::fs::write(raw.join("seq000000.payload.msgpack"), hybrid_batch(&tokens)).unwrap();
    let (port, pub_port, replay_port) = (
        free_port().unwrap(),
        free_port().unwrap(),
        free_port().unwrap(),
    );
    let config = format!(
        "listen = \"127.0.0.1:{port}\"\n[[models]]\nname = \"m\"\ndir = \"{}\"\nblock_size = 16\n\
         [[workers]]\naddress = \"127.0.0.1:9000\"\nmodel = \"m\"\n\
         [[zmq]]\nendpoint = \"tcp://127.0.0.1:{pub_port}\"\nreplay_endpoint = \"tcp://127.0.0.1:{replay_port}\"\nworker = \"127.0.0.1:9000\"\n",
        paths::model_dir().display()
    );
    let _publisher = spawn_vllm_publisher(
        &dir,
        &raw,
        &[
            "--pub-port",
            &pub_port.to_string(),
            "--replay-port",
            &replay_port.to_string(),
        ],
    );
    let sidecar = spawn_sidecar(&dir, &config);
    let http = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{port}");
    let (http_ref, base_ref) = (&http, &base);
    let text = wait_for(
        "the batch applied",
        Duration::from_secs(30),
        || async move {
            let text = get_text(http_ref, &format!("{base_ref}/metrics")).await?;
            (metric(&text, "kvroute_other_group_events_total{source=\"zmq\"}")? >= 2.0)
                .then_some(text)
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}: {}", sidecar.log_tail()));
    assert_eq!(
        metric(&text, "kvroute_index_blocks{worker=\"127.0.0.1:9000\"}"),
        Some(4.0),
        "{text}"
    );
    assert_eq!(
        metric(&text, "kvroute_skipped_events_total{source=\"zmq\"}"),
        Some(1.0),
        "BlockInactive: {text}"
    );
    assert_eq!(
        metric(&text, "kvroute_unknown_event_fields_total{source=\"zmq\"}"),
        Some(2.0),
        "session_id and block_offsets, once per batch: {text}"
    );
    let hint = hint_for_tokens(&http, &base, &tokens, 16).await;
    assert_eq!(hint.workers, vec!["127.0.0.1:9000".to_string()]);
    assert_eq!(hint.matched_blocks, 4, "{hint:?}");
    let log = std::fs::read_to_string(dir.join("sidecar.log")).unwrap();
    assert!(log.contains("field=session_id"), "{log}");
}
