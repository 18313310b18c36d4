//! A NATS outage, said and measured by kvroute itself: the real nats-server stops for a while
//! and starts again on the same port; the worker's events published meanwhile are lost (Dynamo
//! replays nothing on NATS).

mod common;

use std::time::Duration;

use common::{
    metric, nats_server, one_dynamo_worker_config, publish_one_block_events, spawn_sidecar,
};
use kvroute_harness::client::get_text;
use kvroute_harness::paths;
use kvroute_harness::process::{free_port, wait_for, wait_log};
use kvroute_harness::stack::SIDECAR_SUBSCRIBED;

const WORKER: u64 = 7_100_001;

/// The sidecar says when the connection went and came back, and how long it was down (its log,
/// `kvroute_source_disconnects_total`, `/debug/sources`); what the worker published meanwhile is
/// counted per worker (`kvroute_lost_events_total`) when the worker's next event arrives, and
/// said in one line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_is_said_and_what_it_cost_is_counted() {
    let dir = paths::run_dir("nats-outage").unwrap();
    let nats_port = free_port().unwrap();
    let nats = nats_server(&dir, nats_port);
    let port = free_port().unwrap();
    let config = one_dynamo_worker_config(port, nats_port, WORKER);
    let mut sidecar = spawn_sidecar(&dir, &config);
    let base = format!("http://127.0.0.1:{port}");
    let log = dir.join("sidecar.log");
    let read_log = || std::fs::read_to_string(&log).unwrap_or_default();
    let said = |text: &'static str| wait_log(&log, text, Duration::from_secs(30));
    said(SIDECAR_SUBSCRIBED).await.unwrap();
    let client = async_nats::connect(format!("nats://127.0.0.1:{nats_port}"))
        .await
        .unwrap();
    let http = reqwest::Client::new();
    let blocks = "kvroute_index_blocks{worker=\"127.0.0.1:9000\"}";
    publish_one_block_events(&client, WORKER, 1, 50).await;
    let (http_ref, base_ref) = (&http, &base);
    let indexed = |n: f64| async move {
        let text = get_text(http_ref, &format!("{base_ref}/metrics")).await?;
        (metric(&text, blocks) == Some(n)).then_some(text)
    };
    wait_for("49 events indexed", Duration::from_secs(10), || {
        indexed(49.0)
    })
    .await
    .unwrap();

    drop(nats);
    said("NATS connection lost").await.unwrap();
    let sources = sidecar_json_at(&http, &base).await;
    assert_eq!(sources[0]["state"], "disconnected", "{sources}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let _nats = nats_server(&dir, nats_port);
    said("NATS connection back after").await.unwrap();
    // Events 50..70 were published while the server was down: lost. The worker goes on at 70
    // (sent until the sidecar's subscription is back; a copy is dropped as a duplicate).
    let client = async_nats::connect(format!("nats://127.0.0.1:{nats_port}"))
        .await
        .unwrap();
    let client_ref = &client;
    wait_for("event 70 indexed", Duration::from_secs(20), || async move {
        publish_one_block_events(client_ref, WORKER, 70, 71).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        indexed(50.0).await
    })
    .await
    .unwrap();
    publish_one_block_events(&client, WORKER, 71, 80).await;
    let text = wait_for("79 - 20 events indexed", Duration::from_secs(10), || {
        indexed(59.0)
    })
    .await
    .unwrap();
    assert_eq!(
        metric(&text, "kvroute_source_disconnects_total{source=\"nats\"}"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        metric(
            &text,
            "kvroute_lost_events_total{worker=\"127.0.0.1:9000\"}"
        ),
        Some(20.0),
        "events 50..70"
    );
    assert_eq!(
        metric(
            &text,
            "kvroute_lost_messages_total{source=\"nats\",topic=\"kv-events\"}"
        ),
        Some(20.0),
        "their messages, by the publisher's numbering"
    );
    let sources = sidecar_json_at(&http, &base).await;
    let nats_source = &sources[0];
    assert_eq!(nats_source["disconnects"], 1, "{sources}");
    let down = nats_source["last_outage_s"].as_f64().unwrap();
    assert!((1.5..30.0).contains(&down), "{sources}");
    // One line when the losses start, one when they end with the count.
    wait_for("the streak's end said", Duration::from_secs(10), || async {
        read_log()
            .lines()
            .any(|l| l.contains("losses ended on KV events") && l.contains("20 lost in 1 gaps"))
            .then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}: {}", read_log()));
    assert!(sidecar.is_running());
}

/// `/debug/sources` of the sidecar at `base`.
async fn sidecar_json_at(http: &reqwest::Client, base: &str) -> serde_json::Value {
    let text = get_text(http, &format!("{base}/debug/sources"))
        .await
        .unwrap();
    serde_json::from_str(&text).unwrap()
}
