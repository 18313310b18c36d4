//! kvroute in front of real NVIDIA Dynamo 1.6.1 on Dynamo's **default** event plane: mockers
//! and a `kv` frontend started without `--event-plane` and without `DYN_EVENT_PLANE` (ZMQ since
//! Dynamo 1.4), kvroute in pin mode with nothing but `[[dynamo_discovery]]`. The sidecar finds
//! each worker's `kv-events` and `kv_metrics` publishers in the discovery records and follows
//! them as they come and go (issue 31, item 1); the records are in Dynamo's file store or, as
//! Dynamo defaults to, in etcd (a real etcd 3.5; item 2).

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvroute_harness::client::Outcome;
use kvroute_harness::dynamo::Discovery;
use kvroute_harness::process::{free_port, wait_for, Process};
use kvroute_harness::{DynamoOptions, Mode, Stack, StackOptions};
use serde_json::Value;

/// The instance and event-channel records in the fleet's discovery store (files or etcd), as
/// JSON; a record being rewritten is skipped.
async fn records(discovery: &Discovery) -> (Vec<Value>, Vec<Value>) {
    let records = discovery.records().await.unwrap_or_default();
    let json = |all: &[Vec<u8>]| -> Vec<Value> {
        all.iter()
            .filter_map(|b| serde_json::from_slice(b).ok())
            .collect()
    };
    (json(&records.instances), json(&records.channels))
}

/// The `kv-events` channels registered on ZMQ: (publisher id, the worker whose
/// `worker_kv_query_source_<publisher hex>` record names it).
async fn zmq_kv_channels(discovery: &Discovery) -> Vec<(u64, Option<u64>)> {
    let (instances, channels) = records(discovery).await;
    channels
        .iter()
        .filter(|c| c["topic"] == "kv-events" && c["transport"]["kind"] == "Zmq")
        .filter_map(|c| c["instance_id"].as_u64())
        .map(|publisher| {
            let endpoint = format!("worker_kv_query_source_{publisher:x}");
            let worker = instances
                .iter()
                .find(|r| r["endpoint"] == endpoint.as_str())
                .and_then(|r| r["instance_id"].as_u64());
            (publisher, worker)
        })
        .collect()
}

/// The instance id of the `generate` endpoint whose request plane is `address`.
async fn instance_at(discovery: &Discovery, address: &str) -> Option<u64> {
    records(discovery)
        .await
        .0
        .iter()
        .filter(|r| r["endpoint"] == "generate")
        .find(|r| {
            r["transport"]["tcp"]
                .as_str()
                .is_some_and(|t| t.split('/').next() == Some(address))
        })
        .and_then(|r| r["instance_id"].as_u64())
}

/// The options of a default-plane fleet: two aggregated mockers, a `kv` frontend; discovery in
/// etcd (Dynamo's default too) or its file store.
fn default_plane(etcd: bool) -> DynamoOptions {
    DynamoOptions {
        event_plane: None,
        etcd,
        ..DynamoOptions::default()
    }
}

fn stack_options(name: &str, etcd: bool) -> StackOptions {
    let mut opts = StackOptions::new(name, Mode::Kvroute);
    opts.dynamo = Some(default_plane(etcd));
    // Alarms checked every second.
    opts.sidecar_toml = "[alarms]\nsilence_s = 3\n".into();
    opts
}

/// Wait until `kvroute_alarm{alarm="<name>",subject="tiny-llama"}` reads `on`.
async fn wait_alarm(stack: &Stack, name: &str, on: f64) {
    let series = format!("kvroute_alarm{{alarm=\"{name}\",subject=\"tiny-llama\"}}");
    let series = &series;
    wait_for(
        &format!("alarm {name} = {on}"),
        Duration::from_secs(20),
        || async move {
            let value = sidecar_metric(stack, series).await.unwrap_or(0.0);
            (value == on).then_some(())
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}: {}", stack.log_tail("sidecar")));
}

/// Pin one chat on instance `id` straight at the frontend, then wait until the sidecar indexed
/// its prompt's blocks for `label` (the worker's pinned label).
async fn warm(stack: &Stack, id: u64, label: &str, system: &str, seed: u64) -> Outcome {
    let frontend = format!("http://{}", stack.frontend.as_ref().expect("a frontend"));
    let body = dynamo_chat(system, &text(seed, 20));
    let o = post_with(
        &frontend,
        &body,
        &[("x-worker-instance-id", id.to_string())],
    )
    .await;
    assert!(o.ok(), "warming request failed: {o:?}");
    assert_eq!(o.dynamo_workers.map(|w| w.0), Some(id), "the pin holds");
    let blocks = (o.prompt_tokens / 16) as f64;
    let series = format!("kvroute_index_blocks{{worker=\"{label}\"}}");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let text = stack.sidecar_metrics().await.unwrap_or_default();
        if metric(&text, &series).is_some_and(|n| n >= blocks) {
            break;
        }
        if Instant::now() > deadline {
            let sources = sidecar_json(stack, "/debug/sources").await;
            panic!(
                "{label}: {blocks} blocks not indexed in 20 s; sources {sources}; metrics {text}; {}",
                stack.log_tail("sidecar")
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    o
}

/// The sidecar's `dynamo-zmq` source, as `/debug/sources` shows it.
async fn zmq_source(stack: &Stack) -> Value {
    let sources = sidecar_json(stack, "/debug/sources").await;
    let all = sources["sources"]
        .as_array()
        .cloned()
        .or_else(|| sources.as_array().cloned());
    all.unwrap_or_default()
        .into_iter()
        .find(|s| s["kind"] == "dynamo-zmq")
        .unwrap_or_else(|| panic!("no dynamo-zmq source: {sources}"))
}

/// Every worker's blocks get indexed from the default plane, and hints pin repeated prompts to
/// the worker that holds them; nothing fails. Discovery in the file store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_zmq_plane_indexes_every_worker_and_pins() {
    indexes_every_worker_and_pins("dynamo-zmq-plane", false).await;
}

/// The same with Dynamo's defaults throughout: discovery in etcd, events on ZMQ.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamo_defaults_etcd_and_zmq_index_every_worker_and_pin() {
    indexes_every_worker_and_pins("dynamo-etcd", true).await;
}

async fn indexes_every_worker_and_pins(name: &str, etcd: bool) {
    let stack = &Stack::start(stack_options(name, etcd))
        .await
        .expect("stack starts");
    // The workers' records list their publishers on ZMQ, none on NATS.
    let kv = zmq_kv_channels(&stack.discovery).await;
    assert_eq!(kv.len(), stack.engines.len(), "{kv:?}");
    for e in &stack.engines {
        assert!(
            kv.iter().any(|(_, w)| *w == Some(e.dynamo_worker_id)),
            "{kv:?}"
        );
    }
    let mut outcomes = Vec::new();
    for (i, engine) in stack.engines.iter().enumerate() {
        let system = text(5000 + 100 * i as u64, 200);
        let label = pinned_label(stack, i);
        let warmed = warm(stack, engine.dynamo_worker_id, &label, &system, 5001).await;
        outcomes.push(warmed);
        // Repeated prompts through Envoy go where their prefix is, with a cache hit.
        for turn in 0..4 {
            let o = via_envoy(stack, &dynamo_chat(&system, &text(5010 + turn, 10))).await;
            assert!(o.ok(), "turn {turn}: {o:?}");
            assert_eq!(
                o.dynamo_workers.map(|w| w.0),
                Some(engine.dynamo_worker_id),
                "worker {i}, turn {turn}: pinned to the holder"
            );
            assert!(
                o.cached_tokens >= 16 * 8,
                "turn {turn} hit the cache: {o:?}"
            );
            outcomes.push(o);
        }
    }
    // Fresh conversations too: load and homes, from the plane's kv_metrics and events.
    outcomes.extend(concurrent_conversations(stack, 4, 3).await);
    let failed = outcomes.iter().filter(|o| !o.ok()).count();
    let metrics = stack.sidecar_metrics().await.unwrap();
    for i in 0..stack.engines.len() {
        let series = format!(
            "kvroute_index_blocks{{worker=\"{}\"}}",
            pinned_label(stack, i)
        );
        let blocks = metric(&metrics, &series).unwrap_or(0.0);
        println!("worker {i}: {blocks} blocks indexed");
        assert!(blocks > 0.0, "{series}: {metrics}");
    }
    let hinted = metric(&metrics, "kvroute_hints_total{result=\"hinted\"}").unwrap_or(0.0);
    let source = zmq_source(stack).await;
    println!(
        "{} requests, {failed} failed; {hinted} hinted with a match; dynamo-zmq source: {source}",
        outcomes.len()
    );
    assert_eq!(failed, 0, "{outcomes:?}");
    assert!(hinted >= 8.0, "hints named workers with matches: {metrics}");
    assert!(source["events"].as_u64().unwrap_or(0) > 0, "{source}");
    assert_eq!(source["decode_errors"], 0, "{source}");
    // The load reports arrived on the plane as well (kv_metrics).
    assert!(metrics.contains("kvroute_kv_used_blocks{"), "{metrics}");
    assert!(
        !metrics.contains("kvroute_decode_errors_total{source=\"dynamo_zmq\"}"),
        "{metrics}"
    );
    assert!(
        !metrics.contains("kvroute_lost_messages_total{source=\"dynamo_zmq\""),
        "nothing lost on loopback: {metrics}"
    );
    if !etcd {
        return;
    }
    // etcd stops answering (briefly: the workers' leases live 10 s): a named alarm, and
    // routing goes on from the last records.
    stack.signal("etcd", "STOP").unwrap();
    wait_alarm(stack, "discovery_unreachable", 1.0).await;
    let system = text(5000, 200);
    let o = via_envoy(stack, &dynamo_chat(&system, &text(5090, 10))).await;
    stack.signal("etcd", "CONT").unwrap();
    assert!(o.ok(), "{o:?}");
    assert_eq!(
        o.dynamo_workers.map(|w| w.0),
        Some(stack.engines[0].dynamo_worker_id),
        "still pinned while etcd is away"
    );
    wait_alarm(stack, "discovery_unreachable", 0.0).await;
    let log = std::fs::read_to_string(stack.dir.join("sidecar.log")).unwrap();
    let (outage, _) = log
        .split_once("reading Dynamo discovery records again")
        .expect("the recovery is said");
    assert_eq!(
        outage
            .matches("cannot read Dynamo's discovery records; instances keep")
            .count(),
        1,
        "the outage is said once"
    );
}

/// A mocker killed mid-run: its publisher's connection closes, the sidecar drops its entries at
/// once; started again it is a new instance with a new publisher, which the sidecar follows
/// from the next scan. The client's requests keep succeeding throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_mocker_is_followed_through_its_new_publisher() {
    let mut stack = Stack::start(stack_options("dynamo-zmq-restart", true))
        .await
        .expect("stack starts");
    let victim = 1;
    let old = stack.engines[victim].clone();
    let old_label = pinned_label(&stack, victim);
    let system = text(6000, 200);
    warm(&stack, old.dynamo_worker_id, &old_label, &system, 6001).await;

    // Traffic through Envoy all along: one new conversation turn after another.
    let envoy = stack.envoy_url.clone();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let traffic = tokio::spawn({
        let stop = stop.clone();
        async move {
            let mut outcomes = Vec::new();
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let body = dynamo_chat(&text(6100 + i % 8, 120), &text(6200 + i, 10));
                let sent = Instant::now();
                let o = post_with(&envoy, &body, &[]).await;
                outcomes.push((sent, Instant::now(), o));
                i += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            outcomes
        }
    });
    tokio::time::sleep(Duration::from_secs(2)).await;

    let killed = Instant::now();
    stack.kill(&format!("dynamo-worker-{victim}"));
    let disconnect =
        format!("kvroute_sequence_total{{worker=\"{old_label}\",kind=\"disconnect\"}}");
    let blocks = format!("kvroute_index_blocks{{worker=\"{old_label}\"}}");
    let usable = format!("kvroute_worker_usable{{worker=\"{old_label}\"}}");
    let (stack_ref, disconnect_ref, blocks_ref, usable_ref) =
        (&stack, &disconnect, &blocks, &usable);
    wait_for(
        "the killed worker's publisher to be seen leaving and the worker no longer pinned",
        Duration::from_secs(5),
        || async move {
            let text = stack_ref.sidecar_metrics().await.ok()?;
            let gone = metric(&text, disconnect_ref)? >= 1.0
                && metric(&text, blocks_ref)? == 0.0
                && metric(&text, usable_ref)? == 0.0;
            gone.then_some(())
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}: {}", stack.log_tail("sidecar")));
    let detected = killed.elapsed();

    // Started again: a new process, a new instance id, a new publisher.
    let port = free_port().unwrap();
    let cmd = kvroute_harness::dynamo::worker_command(
        &default_plane(true),
        "agg",
        port,
        None,
        &stack.nats_url,
        &stack.discovery,
        &stack.dir,
    )
    .unwrap();
    let _restarted = Process::spawn("dynamo-worker-restarted", cmd, &stack.dir).unwrap();
    let address = format!("127.0.0.1:{port}");
    let (discovery_ref, address_ref) = (&stack.discovery, &address);
    let new_id = wait_for(
        "the restarted worker's discovery record",
        Duration::from_secs(120),
        || async move {
            let id = instance_at(discovery_ref, address_ref).await?;
            // Its kv-events publisher is registered too.
            zmq_kv_channels(discovery_ref)
                .await
                .iter()
                .any(|(_, w)| *w == Some(id))
                .then_some(id)
        },
    )
    .await
    .unwrap();
    assert_ne!(new_id, old.dynamo_worker_id, "a restart is a new instance");
    let new_label = format!("{address}/{new_id:x}");
    // Dynamo's ZMQ plane keeps no history: what the new worker publishes before the sidecar's
    // next scan has connected to it is not seen (its stores' children would then be orphans).
    // Nothing is sent to it until then (a few scan intervals).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // The frontend learns the new instance from the same records; give it a moment.
    let frontend = format!("http://{}", stack.frontend.as_ref().unwrap());
    let (frontend_ref, new_id_ref) = (&frontend, new_id);
    wait_for(
        "the frontend to serve the restarted instance",
        Duration::from_secs(60),
        || async move {
            let body = dynamo_chat("ping", "ping");
            let o = post_with(
                frontend_ref,
                &body,
                &[("x-worker-instance-id", new_id_ref.to_string())],
            )
            .await;
            o.ok().then_some(())
        },
    )
    .await
    .unwrap();
    let system2 = text(6300, 200);
    warm(&stack, new_id, &new_label, &system2, 6301).await;
    for turn in 0..4 {
        let o = via_envoy(&stack, &dynamo_chat(&system2, &text(6310 + turn, 10))).await;
        assert!(o.ok(), "turn {turn}: {o:?}");
        assert_eq!(o.dynamo_workers.map(|w| w.0), Some(new_id), "turn {turn}");
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let outcomes = traffic.await.unwrap();
    // A request the killed worker was serving when SIGKILL came cannot be saved by any router
    // (its stream is cut: Dynamo's request migration is off by default), nor can one pinned
    // before the kill was seen: the publisher's socket closes at once, but the dying process's
    // request plane may accept connections for a while longer (up to ~200 ms here), and a
    // worker is unpinned when it refuses them. Every request sent after that must succeed.
    let seen = killed + detected;
    let in_flight = |sent: &Instant, done: &Instant| *sent <= seen && *done >= killed;
    let failures: Vec<(bool, Duration, u16, Option<String>)> = outcomes
        .iter()
        .filter(|(_, _, o)| !o.ok())
        .map(|(sent, done, o)| {
            (
                in_flight(sent, done),
                sent.saturating_duration_since(killed),
                o.status,
                o.error.clone(),
            )
        })
        .collect();
    let after_kill = failures.iter().filter(|f| !f.0).count();
    let source = zmq_source(&stack).await;
    println!(
        "kill detected in {detected:?}; {} requests during the run, {} failed ({after_kill} sent after the kill was seen): {failures:?}; dynamo-zmq source: {source}",
        outcomes.len(),
        failures.len()
    );
    assert!(detected < Duration::from_secs(3), "{detected:?}");
    assert_eq!(after_kill, 0, "failed requests: {failures:?}");
    let text = stack.sidecar_metrics().await.unwrap();
    assert_eq!(
        metric(&text, &blocks),
        Some(0.0),
        "the old worker stays empty"
    );
}
