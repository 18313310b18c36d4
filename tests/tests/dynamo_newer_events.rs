//! A newer Dynamo's KV events over real NATS: fields kvroute does not read at every level of
//! the message and an event kind it does not know cost nothing of the batch; both are counted
//! and the fields named once; the unknown event keeps its place in the worker's numbering.

mod common;

use std::time::Duration;

use common::{
    metric, nats_server, one_block_event, one_dynamo_worker_config, spawn_sidecar, DYNAMO_SUBJECT,
};
use kvroute_harness::client::get_text;
use kvroute_harness::paths;
use kvroute_harness::process::{free_port, wait_for, wait_log};
use kvroute_harness::stack::SIDECAR_SUBSCRIBED;
use kvroute_protocol::dynamo::{encode_v16, EnvelopeHeader, KV_EVENTS_TOPIC};
use rmpv::Value;

const WORKER: u64 = 7_200_001;

/// Add `(name, value)` to a msgpack map.
fn with(map: &mut Value, name: &str, value: Value) {
    if let Value::Map(fields) = map {
        fields.push((Value::from(name), value));
    }
}

fn field<'a>(map: &'a mut Value, name: &str) -> &'a mut Value {
    match map {
        Value::Map(fields) => {
            &mut fields
                .iter_mut()
                .find(|(k, _)| k.as_str() == Some(name))
                .unwrap()
                .1
        }
        _ => panic!("not a map"),
    }
}

fn read(bytes: &[u8]) -> Value {
    rmpv::decode::read_value(&mut &bytes[..]).unwrap()
}

fn write(value: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, value).unwrap();
    out
}

/// One message as Dynamo encodes it, then grown as a newer Dynamo might: a field in the
/// envelope, in each event, in a stored block; events 1 and 3 stored, event 2 of a kind
/// kvroute does not know.
fn newer_message(sequence: u64) -> Vec<u8> {
    let header = EnvelopeHeader {
        publisher_id: 9,
        sequence,
        published_at: 0,
        topic: KV_EVENTS_TOPIC,
    };
    let events = [
        one_block_event(WORKER, 1),
        one_block_event(WORKER, 2),
        one_block_event(WORKER, 3),
    ];
    let mut envelope = read(&encode_v16(header, &events));
    let Value::Binary(payload) = field(&mut envelope, "payload").clone() else {
        panic!("payload is bin");
    };
    let mut payload = read(&payload);
    let Value::Array(items) = &mut payload else {
        panic!("an array of events");
    };
    for item in items.iter_mut() {
        with(item, "session_id", Value::from("s-1"));
        let stored = field(field(field(item, "event"), "data"), "stored");
        if let Value::Array(blocks) = field(stored, "blocks") {
            for block in blocks {
                with(block, "lora_id", Value::Nil);
            }
        }
    }
    *field(field(&mut items[1], "event"), "data") =
        Value::Map(vec![(Value::from("inactive"), Value::Map(vec![]))]);
    *field(&mut envelope, "payload") = Value::Binary(write(&payload));
    with(&mut envelope, "trace_id", Value::from("t-1"));
    write(&envelope)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_dynamos_fields_and_kinds_cost_nothing_of_the_batch() {
    let dir = paths::run_dir("dynamo-newer-events").unwrap();
    let nats_port = free_port().unwrap();
    let _nats = nats_server(&dir, nats_port);
    let port = free_port().unwrap();
    let config = one_dynamo_worker_config(port, nats_port, WORKER);
    let _sidecar = spawn_sidecar(&dir, &config);
    let log = dir.join("sidecar.log");
    wait_log(&log, SIDECAR_SUBSCRIBED, Duration::from_secs(30))
        .await
        .unwrap();
    let client = async_nats::connect(format!("nats://127.0.0.1:{nats_port}"))
        .await
        .unwrap();
    client
        .publish(DYNAMO_SUBJECT, newer_message(0).into())
        .await
        .unwrap();
    // The worker goes on with event 4, in Dynamo's own encoding.
    let next = encode_v16(
        EnvelopeHeader {
            publisher_id: 9,
            sequence: 1,
            published_at: 0,
            topic: KV_EVENTS_TOPIC,
        },
        &[one_block_event(WORKER, 4)],
    );
    client.publish(DYNAMO_SUBJECT, next.into()).await.unwrap();
    client.flush().await.unwrap();

    let http = reqwest::Client::new();
    let url = format!("http://127.0.0.1:{port}/metrics");
    let blocks = "kvroute_index_blocks{worker=\"127.0.0.1:9000\"}";
    let text = wait_for("three blocks indexed", Duration::from_secs(10), || async {
        let text = get_text(&http, &url).await?;
        (metric(&text, blocks) == Some(3.0)).then_some(text)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        metric(&text, "kvroute_skipped_events_total{source=\"nats\"}"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        metric(&text, "kvroute_unknown_event_fields_total{source=\"nats\"}"),
        Some(3.0),
        "the first message is checked: 3 fields: {text}"
    );
    let lost = "kvroute_lost_events_total{worker=\"127.0.0.1:9000\"}";
    assert!(
        metric(&text, lost).unwrap_or(0.0) == 0.0,
        "the unknown kind kept its number: no gap: {text}"
    );
    let said = std::fs::read_to_string(&log).unwrap();
    for name in [
        "envelope.trace_id",
        "RouterEvent.session_id",
        "stored.blocks.lora_id",
    ] {
        let lines = said
            .lines()
            .filter(|l| l.contains("Dynamo event field kvroute does not know") && l.contains(name));
        assert_eq!(lines.count(), 1, "{name} named once:\n{said}");
    }
}
