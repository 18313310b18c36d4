//! kvroute in front of real NVIDIA Dynamo 1.6.1: mocker workers publishing real KV events and
//! real discovery records — on Dynamo's defaults (etcd, its ZMQ event plane), or on NATS with
//! the file store where a test loses or compares NATS messages — behind a real Dynamo frontend
//! (`.venv-dynamo`).
//! Each test is a failure the simulator did not show (issue "Against the real engines").

mod common;

use std::time::Duration;

use common::*;
use kvroute_harness::client::Outcome;
use kvroute_harness::stack::MODEL;
use kvroute_harness::{DynamoOptions, Mode, Stack, StackOptions};
use serde_json::Value;

/// Send straight to the Dynamo frontend (not through Envoy) with extra headers.
async fn to_frontend(stack: &Stack, body: &Value, headers: &[(&str, String)]) -> Outcome {
    let frontend = stack.frontend.as_ref().expect("a Dynamo frontend");
    post_with(&format!("http://{frontend}"), body, headers).await
}

/// The (prefill, decode) instances that served a successful request.
fn workers_of(o: &Outcome) -> (u64, u64) {
    assert!(o.ok(), "request failed: {o:?}");
    o.dynamo_workers.expect("nvext.worker_id in the response")
}

/// Cache a 200-word system prompt (from `seed`) on engine `home` by sending one chat straight to
/// the frontend pinned there with `header`, and wait until the sidecar indexed it. Returns the
/// instance id, the system prompt and the warming request's outcome.
async fn warm(stack: &Stack, home: usize, header: &str, seed: u64) -> (u64, String, Outcome) {
    let id = stack.engines[home].dynamo_worker_id;
    let system = text(seed, 200);
    let body = dynamo_chat(&system, &text(seed + 1, 20));
    let warmed = to_frontend(stack, &body, &[(header, id.to_string())]).await;
    wait_pinned_indexed(stack, home, (warmed.prompt_tokens / 16) as f64).await;
    (id, system, warmed)
}

/// A client cannot pin: straight to the frontend, `header` naming no worker fails the request;
/// through Envoy it is stripped before the filter. The sidecar is stopped meanwhile, so no hint
/// overwrites the forged header: only the stripping protects.
async fn client_pins_are_stripped(stack: &Stack, system: &str, header: &'static str) {
    let forged = [(header, "12345".to_string())];
    let body = dynamo_chat(system, "forged");
    let direct = to_frontend(stack, &body, &forged).await;
    assert!(
        !direct.ok(),
        "Dynamo ignored {header} naming no worker: {direct:?}"
    );
    stack.signal("sidecar", "STOP").unwrap();
    let o = post_with(&stack.envoy_url, &body, &forged).await;
    stack.signal("sidecar", "CONT").unwrap();
    assert!(
        o.ok(),
        "a forged {header} reached Dynamo through Envoy: {o:?}"
    );
}

fn dynamo_stack(name: &str, dynamo: DynamoOptions, sidecar_toml: &str) -> StackOptions {
    let mut opts = StackOptions::new(name, Mode::Kvroute);
    opts.dynamo = Some(dynamo);
    opts.sidecar_toml = sidecar_toml.to_owned();
    opts
}

/// On Dynamo 1.6.1's defaults (discovery records in etcd, KV events on its ZMQ plane): the
/// sidecar finds both workers there, and the pin steers every turn to the worker holding the
/// prefix. The frontend routes
/// round robin, so landing on the same worker each time is the pin's doing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pins_aggregated_dynamo_workers_found_in_real_discovery_records() {
    let dynamo = DynamoOptions {
        router_mode: "round-robin".into(),
        ..DynamoOptions::default()
    };
    let stack = &Stack::start(dynamo_stack("dynamo-real-agg", dynamo, ""))
        .await
        .expect("stack starts");
    assert_eq!(
        sidecar_metric(
            stack,
            &format!("kvroute_discovered_instances{{model=\"{MODEL}\",role=\"aggregated\"}}")
        )
        .await,
        Some(2.0)
    );
    // Each worker's cache size, from its model card, bounds its index.
    let capacity = DynamoOptions::default().capacity_blocks as f64;
    let series = format!(
        "kvroute_capacity_blocks{{worker=\"{}\"}}",
        pinned_label(stack, 0)
    );
    assert_eq!(sidecar_metric(stack, &series).await, Some(capacity));
    let (id, system, warmed) = warm(stack, 1, "x-worker-instance-id", 3100).await;
    assert_eq!(workers_of(&warmed).0, id, "the frontend honours the pin");
    for i in 0..6 {
        let o = via_envoy(stack, &dynamo_chat(&system, &text(3110 + i, 10))).await;
        assert_eq!(workers_of(&o).0, id, "turn {i}");
        assert!(o.cached_tokens >= 16 * 8, "turn {i} hit the cache: {o:?}");
    }
    let hinted = stack
        .envoy_stat("wasmcustom.kvroute.hinted")
        .await
        .unwrap_or(0);
    assert!(hinted >= 6, "hinted {hinted}");
    // The frontend's answers carry the workers' cached tokens: the sidecar sets them beside
    // its predictions, per pinned worker.
    let text = served_reports(stack, hinted as f64).await;
    let worker = pinned_label(stack, 1);
    let of =
        |family: &str| metric(&text, &format!("{family}{{worker=\"{worker}\"}}")).unwrap_or(0.0);
    let exact = metric(
        &text,
        &format!("kvroute_predictions_total{{worker=\"{worker}\",outcome=\"exact\"}}"),
    )
    .unwrap_or(0.0);
    println!(
        "Dynamo: predicted {} actual {} of {} prompt tokens, {exact} exact of {hinted}",
        of("kvroute_predicted_cached_tokens_total"),
        of("kvroute_actual_cached_tokens_total"),
        of("kvroute_served_prompt_tokens_total")
    );
    assert!(
        of("kvroute_actual_cached_tokens_total") >= 6.0 * 16.0 * 8.0,
        "{text}"
    );
    assert!(exact >= 6.0, "{text}");

    // A client cannot pin (aggregated: with x-worker-instance-id).
    client_pins_are_stripped(stack, &system, "x-worker-instance-id").await;
}

/// Disaggregated prefill/decode: prefill workers register as `dynamo/prefill/generate` and are
/// the only ones publishing KV events. kvroute pins the prefill worker holding the prefix with
/// `x-prefill-instance-id` (never a decode id, which Dynamo rejects), without configuration, and
/// the alarms stay quiet: events do arrive, and decode workers rightly publish none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_dynamo_pins_the_prefill_worker_and_alarms_stay_quiet() {
    disaggregated("dynamo-real-disagg", false).await;
}

/// The same on Dynamo's defaults: discovery in etcd, KV events and load reports on its ZMQ
/// plane, nothing configured but the etcd URL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_dynamo_on_its_defaults_pins_the_prefill_worker() {
    disaggregated("dynamo-real-disagg-defaults", true).await;
}

async fn disaggregated(name: &str, defaults: bool) {
    let dynamo = DynamoOptions {
        aggregated: 0,
        prefill: 2,
        decode: 1,
        router_mode: "round-robin".into(),
        event_plane: (!defaults).then(|| "nats".to_owned()),
        etcd: defaults,
        ..DynamoOptions::default()
    };
    let stack = &Stack::start(dynamo_stack(
        name,
        dynamo,
        "[alarms]\nsilence_s = 2\nmin_hints = 3\n",
    ))
    .await
    .expect("stack starts");
    assert_eq!(stack.engines.len(), 2, "two prefill workers to pin");
    assert_eq!(stack.decode_ids.len(), 1);
    let decode = stack.decode_ids[0];
    let (id, system, warmed) = warm(stack, 1, "x-prefill-instance-id", 3200).await;
    assert_eq!(workers_of(&warmed), (id, decode));
    for i in 0..8 {
        let o = via_envoy(stack, &dynamo_chat(&system, &text(3210 + i, 10))).await;
        assert_eq!(workers_of(&o), (id, decode), "turn {i}");
    }
    client_pins_are_stripped(stack, &system, "x-prefill-instance-id").await;
    // Cold prompts (which store new blocks: events keep coming) are pinned to prefill workers
    // too, never to the decode worker; the alarms, checked every second at silence_s = 2, get
    // three seconds of this traffic.
    let start = std::time::Instant::now();
    let mut cold = 0;
    while start.elapsed() < Duration::from_secs(3) {
        let o = via_envoy(stack, &dynamo_chat(&text(3300 + cold, 120), "hi")).await;
        assert_ne!(workers_of(&o).0, decode, "cold prompt {cold}");
        cold += 1;
    }
    let text = stack.sidecar_metrics().await.unwrap();
    let on: Vec<&str> = kvroute_harness::prometheus::series(&text, "kvroute_alarm{")
        .filter(|(_, v)| *v == 1.0)
        .map(|(s, _)| s)
        .collect();
    assert!(on.is_empty(), "alarms on: {on:?}");
    // The decode worker's load reports are a known worker's, not an unknown publisher's.
    assert!(
        !text.contains("kvroute_unknown_worker_events_total{"),
        "{text}"
    );
    let log = std::fs::read_to_string(stack.dir.join("sidecar.log")).unwrap();
    assert!(
        !log.contains("neither in [[workers]] nor discovered"),
        "{log}"
    );
}

/// A sidecar outage behind a `kv`-mode frontend fails no request: unpinned requests are the
/// frontend's to route (pin mode's documented requirement; a `direct` frontend rejects them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidecar_killed_mid_run_fails_no_request() {
    let mut stack = Stack::start(dynamo_stack(
        "dynamo-real-outage",
        DynamoOptions::default(),
        "",
    ))
    .await
    .expect("stack starts");
    let system = text(3400, 120);
    let mut failed = Vec::new();
    let mut hinted_before = 0;
    for i in 0..40u64 {
        if i == 15 {
            hinted_before = stack
                .envoy_stat("wasmcustom.kvroute.hinted")
                .await
                .unwrap_or(0);
            stack.kill("sidecar");
        }
        let o = via_envoy(&stack, &dynamo_chat(&system, &text(3410 + i, 10))).await;
        if !o.ok() {
            failed.push((i, o));
        }
    }
    assert!(failed.is_empty(), "failed requests: {failed:?}");
    assert!(
        hinted_before >= 10,
        "hinted before the outage: {hinted_before}"
    );
    let fallbacks = stack
        .envoy_stat("wasmcustom.kvroute.fallback.sidecar")
        .await
        .unwrap_or(0);
    assert!(
        fallbacks >= 20,
        "requests during the outage fell back: {fallbacks}"
    );
}

/// A SIGKILLed worker refuses the sidecar's connects to its request plane; the sidecar stops
/// pinning to it after two failed probes instead of when its discovery record goes (about 8 s
/// later).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_is_not_pinned_for_long() {
    let mut stack = Stack::start(dynamo_stack(
        "dynamo-real-kill",
        DynamoOptions::default(),
        "",
    ))
    .await
    .expect("stack starts");
    let home = 1;
    let (_, system, _) = warm(&stack, home, "x-worker-instance-id", 3500).await;
    stack.kill(&format!("dynamo-worker-{home}"));
    let killed = std::time::Instant::now();
    let mut failures = Vec::new();
    let mut i = 0;
    while killed.elapsed() < Duration::from_secs(12) {
        let o = via_envoy(&stack, &dynamo_chat(&system, &text(3510 + i, 10))).await;
        if !o.ok() {
            failures.push((killed.elapsed(), o.status, o.error.clone()));
        }
        i += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!("{i} requests, {} failed: {failures:?}", failures.len());
    let last = failures.last().map(|f| f.0);
    assert!(
        last.is_none_or(|t| t < Duration::from_millis(1500)),
        "still failing {last:?} after the kill"
    );
}

/// The replica plane against real Dynamo: a second sidecar beside the stack's, fed the same
/// mocker events over NATS but losing a fifth of them, is found divergent and repaired from
/// the first one's snapshots while traffic flows; when it stops, both hold the same blocks for
/// every worker and agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_lost_real_dynamo_events_is_repaired_from_its_peer() {
    let replicas = "[replicas]\ngroup = \"dynamo\"\nid = \"a\"\ninterval_ms = 500\n";
    let dynamo = DynamoOptions {
        router_mode: "round-robin".into(),
        ..DynamoOptions::on_nats()
    };
    let stack = &Stack::start(dynamo_stack("dynamo-real-replicas", dynamo, replicas))
        .await
        .expect("stack starts");
    let (_b, b) = spawn_lossy_replica(stack, 0.2);
    let a = stack.sidecar_url.clone().unwrap();
    let dir = stack.dir.join("b");
    let metrics = |base: String| async move {
        kvroute_harness::client::get_text(&stack.http, &format!("{base}/metrics"))
            .await
            .unwrap_or_default()
    };
    kvroute_harness::process::wait_for("b serves", Duration::from_secs(20), || async {
        let text = metrics(b.clone()).await;
        (metric(&text, "kvroute_replica_peers") == Some(1.0)).then_some(())
    })
    .await
    .unwrap();

    for i in 0..40 {
        let o = via_envoy(stack, &dynamo_chat(&text(4000 + i, 60), "hello")).await;
        assert!(o.ok(), "request {i}: {o:?}");
    }
    let blocks =
        |text: &str| kvroute_harness::prometheus::sorted_series(text, "kvroute_index_blocks{");
    let settled = kvroute_harness::process::wait_for(
        "b repaired and both agree",
        Duration::from_secs(15),
        || async {
            let (ta, tb) = (metrics(a.clone()).await, metrics(b.clone()).await);
            let repaired = common::repaired_from_peer(&tb);
            let agree = [&ta, &tb].iter().all(|t| {
                metric(t, "kvroute_replica_caches{state=\"divergent\"}") == Some(0.0)
                    && metric(t, "kvroute_replica_caches{state=\"agree\"}") >= Some(1.0)
            });
            (repaired && agree && blocks(&ta) == blocks(&tb)).then_some((ta, tb))
        },
    )
    .await;
    let (ta, tb) = settled.unwrap_or_else(|e| {
        let log = std::fs::read_to_string(dir.join("sidecar.log")).unwrap_or_default();
        panic!("{e}\n{}", &log[log.len().saturating_sub(3000)..])
    });
    let dropped = metric(&tb, "kvroute_test_dropped_events_total").unwrap_or(0.0);
    assert!(dropped > 0.0, "b lost no event: {tb}");
    eprintln!(
        "b dropped {dropped} events; snapshots {:?}, messages filled {:?}; blocks {:?}",
        metric(&tb, "kvroute_replica_repairs_total{kind=\"peer_snapshot\"}"),
        metric(
            &tb,
            "kvroute_replica_lost_messages_total{outcome=\"filled\"}"
        ),
        blocks(&ta)
    );
}

/// A sidecar restarted while Dynamo's workers hold prefixes asks the engines: each worker's
/// engine publishes vLLM's ZMQ format with a replay socket (Dynamo's vLLM backend with
/// `--kv-events-config`; here the mocker's `--zmq-kv-events-ports` and `--zmq-replay-ports`,
/// which Dynamo's relay also copies to NATS), the sidecar reads each one with `[[zmq]] worker`
/// set to the instance's request-plane address, and a new sidecar indexes what the engines
/// hold before anything is stored again. The relay's NATS copies are refused, not applied
/// twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_sidecar_warms_from_the_dynamo_workers_engines() {
    let dynamo = DynamoOptions {
        router_mode: "round-robin".into(),
        zmq_events: true,
        ..DynamoOptions::on_nats()
    };
    let mut stack = Stack::start(dynamo_stack("dynamo-real-warm", dynamo, ""))
        .await
        .expect("stack starts");
    let (id, system, warmed) = warm(&stack, 1, "x-worker-instance-id", 3300).await;
    assert_eq!(workers_of(&warmed).0, id);
    let blocks = (warmed.prompt_tokens / 16) as f64;
    let relayed = format!(
        "kvroute_rejected_messages_total{{worker=\"{}\",reason=\"read_over_zmq\"}}",
        pinned_label(&stack, 1)
    );
    // The relay's copy travels through NATS and may land after the ZMQ original indexed.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while sidecar_metric(&stack, &relayed).await < Some(1.0) && std::time::Instant::now() < deadline
    {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(
        sidecar_metric(&stack, &relayed).await >= Some(1.0),
        "the relay's NATS copies are refused: {}",
        stack.sidecar_metrics().await.unwrap_or_default()
    );

    let restarted = std::time::Instant::now();
    stack.restart_sidecar().await.expect("sidecar restarts");
    wait_pinned_indexed(&stack, 1, blocks).await;
    let warm_after = restarted.elapsed();
    let o = via_envoy(&stack, &dynamo_chat(&system, &text(3310, 10))).await;
    assert_eq!(workers_of(&o).0, id, "the first turn after the restart");
    assert!(o.cached_tokens >= 16 * 8, "it hit the cache: {o:?}");
    eprintln!("restarted sidecar indexed {blocks} warmed blocks within {warm_after:?}");
}
