//! Interop with code nobody here wrote: the byte-exact NATS bodies captured from a live NVIDIA
//! Dynamo 1.6.1 are published on their original subjects to a real nats-server; the sidecar
//! must index them and answer hints from them.

mod common;

use std::process::Command;
use std::time::Duration;

use common::{hint_for_tokens, metric, spawn_sidecar};
use kvroute_harness::client::get_text;
use kvroute_harness::paths;
use kvroute_harness::process::{free_port, wait_for, Process};
use kvroute_protocol::dynamo::decode_message;

const BACKEND: &str = "namespace.dynamo.component.backend.endpoint.generate.kv-events";
const PREFILL: &str = "namespace.dynamo.component.prefill.endpoint.generate.kv-events";

/// (capture file, subject it was captured on), in capture order per worker.
const CAPTURES: &[(&str, &str)] = &[
    ("kv-events_stored_prompt_4blocks.msgpack", BACKEND),
    ("kv-events_stored_decode_block_with_parent.msgpack", BACKEND),
    ("kv-events_removed_plus_stored_batch.msgpack", BACKEND),
    ("kv-events_removed6_plus_stored_batch.msgpack", BACKEND),
    ("kv-events_disagg_prefill_component.msgpack", PREFILL),
    // Not KV events: the sidecar must not count them as such (kv_metrics is load).
    (
        "kv_metrics.msgpack",
        "namespace.dynamo.component.backend.endpoint.generate.kv_metrics",
    ),
    (
        "forward-pass-metrics_busy.msgpack",
        "namespace.dynamo.component.backend.endpoint.generate.forward-pass-metrics",
    ),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn captured_dynamo_events_through_real_nats() {
    captures_through_nats(None).await;
}

/// `namespace.>` on top of the default subjects: NATS delivers every KV event twice, once per
/// matching subscription. Each is applied once; nothing is taken for a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_subscriptions_apply_each_event_once() {
    let text = captures_through_nats(Some("namespace.>")).await;
    for kind in ["restart", "duplicate", "gap"] {
        let n = kvroute_harness::prometheus::sum_where(&text, |l| {
            l.starts_with("kvroute_sequence_total{") && l.contains(&format!("kind=\"{kind}\""))
        });
        assert_eq!(n, 0.0, "{kind}: {text}");
    }
}

/// Publish the captures to a real nats-server, check what the sidecar made of them, and return
/// its metrics. `extra` is a subject subscribed on top of the defaults.
async fn captures_through_nats(extra: Option<&str>) -> String {
    let samples = kvroute_protocol::samples_dir().join("dynamo");
    let dir = paths::run_dir("dynamo-captures").unwrap();
    let nats_port = free_port().unwrap();
    let mut nats = Command::new(paths::venv_tool("nats-server").unwrap());
    nats.args(["-a", "127.0.0.1", "-p", &nats_port.to_string()]);
    let _nats = Process::spawn("nats", nats, &dir).unwrap();
    let nats_url = format!("nats://127.0.0.1:{nats_port}");

    // One configured worker per worker id found in the KV-event captures.
    let mut worker_ids = Vec::new();
    for (file, subject) in CAPTURES {
        if subject.ends_with("kv-events") {
            let body = std::fs::read(samples.join(file)).unwrap();
            for e in decode_message(&body).unwrap().events {
                if !worker_ids.contains(&e.worker_id) {
                    worker_ids.push(e.worker_id);
                }
            }
        }
    }
    assert_eq!(worker_ids.len(), 3);
    let port = free_port().unwrap();
    let subjects = match extra {
        Some(extra) => {
            let mut all = kvroute_sidecar_subjects();
            all.push(extra.to_owned());
            format!("subjects = {all:?}\n")
        }
        None => String::new(),
    };
    let mut config = format!(
        "listen = \"127.0.0.1:{port}\"\n[nats]\nurl = \"{nats_url}\"\n{subjects}[[models]]\nname = \"m\"\ndir = \"{}\"\nblock_size = 16\n",
        paths::model_dir().display()
    );
    for (i, id) in worker_ids.iter().enumerate() {
        config.push_str(&format!(
            "[[workers]]\naddress = \"127.0.0.1:{}\"\nmodel = \"m\"\ndynamo_worker_id = {id}\n",
            9000 + i
        ));
    }
    let sidecar = spawn_sidecar(&dir, &config);
    let http = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{port}");
    let metrics_url = format!("{base}/metrics");
    let (http_ref, metrics_ref, log) = (&http, &metrics_url, &dir.join("sidecar.log"));
    wait_for(
        "sidecar subscribed",
        Duration::from_secs(20),
        || async move {
            http_ref.get(metrics_ref).send().await.ok()?;
            std::fs::read_to_string(log)
                .ok()?
                .contains("endpoint.*.kv-events")
                .then_some(())
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}: {}", sidecar.log_tail()));

    let client = async_nats::connect(nats_url.as_str()).await.unwrap();
    for (file, subject) in CAPTURES {
        let body = std::fs::read(samples.join(file)).unwrap();
        client.publish(*subject, body.into()).await.unwrap();
    }
    client
        .publish(BACKEND, b"\xc1 not msgpack".to_vec().into())
        .await
        .unwrap();
    client.flush().await.unwrap();

    // 4 + 1 stored on the first worker, 2 batches on the second, 1 prefill store; one bad body.
    let text = wait_for(
        "all events applied",
        Duration::from_secs(10),
        || async move {
            let text = get_text(http_ref, metrics_ref).await?;
            let n = |s: &str| metric(&text, s).unwrap_or(0.0);
            let all = n("kvroute_decode_errors_total{source=\"nats\"}") >= 1.0
                && n(&format!(
                    "kvroute_events_total{{subject=\"{BACKEND}\",type=\"stored\"}}"
                )) >= 4.0
                && n(&format!(
                    "kvroute_events_total{{subject=\"{BACKEND}\",type=\"removed\"}}"
                )) >= 2.0
                && n(&format!(
                    "kvroute_events_total{{subject=\"{PREFILL}\",type=\"stored\"}}"
                )) >= 1.0;
            all.then_some(text)
        },
    )
    .await
    .unwrap();
    let events = |subject: &str, kind: &str| {
        metric(
            &text,
            &format!("kvroute_events_total{{subject=\"{subject}\",type=\"{kind}\"}}"),
        )
        .unwrap_or(0.0)
    };
    assert_eq!(events(BACKEND, "stored"), 4.0, "{text}");
    assert_eq!(events(BACKEND, "removed"), 2.0, "{text}");
    assert_eq!(events(PREFILL, "stored"), 1.0, "{text}");
    assert_eq!(
        metric(&text, "kvroute_decode_errors_total{source=\"nats\"}"),
        Some(1.0),
        "one bad body, and no other subject taken for KV events: {text}"
    );
    assert!(
        !text.contains("kv_metrics\",type") && !text.contains("forward-pass-metrics"),
        "only KV-event subjects count as events: {text}"
    );
    // kv_metrics is load: the first worker's KV blocks in use, as the capture says.
    let (http_ref, metrics_ref) = (&http, &metrics_url);
    wait_for(
        "kv_metrics recorded",
        Duration::from_secs(5),
        || async move {
            let text = get_text(http_ref, metrics_ref).await?;
            (metric(&text, "kvroute_kv_used_blocks{worker=\"127.0.0.1:9000\"}")? == 5.0)
                .then_some(())
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}: {text}"));
    assert_eq!(
        metric(
            &text,
            "kvroute_orphan_stores_total{worker=\"127.0.0.1:9000\"}"
        ),
        None
    );
    assert_eq!(
        metric(&text, "kvroute_index_blocks{worker=\"127.0.0.1:9000\"}"),
        Some(5.0)
    );

    // The golden prompt's prefix hashes match the first worker's 4 stored blocks.
    let tokens = kvroute_protocol::golden_dynamo_prompt();
    let resp = hint_for_tokens(&http, &base, &tokens, 16).await;
    assert_eq!(resp.workers[0], "127.0.0.1:9000");
    assert_eq!(resp.matched_blocks, 4);
    // A malformed hint request is a 400, not a crash.
    let bad = http
        .post(format!("{base}/v1/hint"))
        .body("junk")
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    text
}

/// The sidecar's default NATS subjects, as its configuration documents them.
fn kvroute_sidecar_subjects() -> Vec<String> {
    [
        "namespace.*.component.*.kv-events",
        "namespace.*.component.*.endpoint.*.kv-events",
        "namespace.*.component.*.endpoint.*.kv_metrics",
    ]
    .map(String::from)
    .to_vec()
}
