//! The event plane says when it is not what it should be: a subscription that receives nothing
//! while requests are routed raises an alarm naming the subjects; a healthy one stays quiet.

mod common;

use std::time::Duration;

use common::*;
use kvroute_harness::process::wait_for;
use kvroute_harness::prometheus::series;
use kvroute_harness::{Mode, Stack, StackOptions};

const FAST_ALARMS: &str = "[alarms]\nsilence_s = 1\nmin_hints = 3\n";

async fn traffic(stack: &Stack, seed: u64) {
    for i in 0..6 {
        let o = via_envoy(stack, &chat(&text(seed, 60), &text(seed + i, 5))).await;
        assert!(o.ok(), "{o:?}");
    }
}

/// After a move to disaggregated serving the KV events come from another component: the
/// sidecar still listens to the old one. Hints go on (load only) and the alarm names what is
/// subscribed and what arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_subject_raises_no_events_and_silent_workers() {
    let mut opts = StackOptions::new("alarm-wrong-subject", Mode::Kvroute);
    opts.nats_subjects = Some(vec![
        "namespace.*.component.prefill.endpoint.*.kv-events".into()
    ]);
    opts.sidecar_toml = FAST_ALARMS.into();
    let stack = Stack::start(opts).await.expect("stack starts");
    traffic(&stack, 1300).await;
    // Every worker served hinted requests and none was ever heard from: the ones hinted
    // `min_hints` times are named. The alarm is labelled with what is subscribed.
    let subscribed = "nats:namespace.*.component.prefill.endpoint.*.kv-events";
    let on = format!("kvroute_alarm{{alarm=\"no_events\",subject=\"{subscribed}\"}}");
    // New prompts all along: engines publish KV events only when they store blocks.
    let seed = std::sync::atomic::AtomicU64::new(1310);
    wait_for("both alarms", Duration::from_secs(20), || async {
        traffic(
            &stack,
            seed.fetch_add(10, std::sync::atomic::Ordering::Relaxed),
        )
        .await;
        let m = stack.sidecar_metrics().await.ok()?;
        let silent = series(&m, "kvroute_alarm{alarm=\"silent_worker\"").any(|(_, v)| v == 1.0);
        (metric(&m, &on)? == 1.0 && silent).then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    // Its first line is the right one: a look at the whole bus, taken before the line was
    // written, says where the events actually are.
    let published = "namespace.dynamo.component.backend.endpoint.generate.kv-events";
    let log = std::fs::read_to_string(stack.dir.join("sidecar.log")).unwrap();
    let line = log
        .lines()
        .find(|l| l.contains("alarm=\"no_events\"") || l.contains("alarm=no_events"))
        .unwrap_or_else(|| panic!("no alarm line in the log:\n{log}"));
    assert!(line.contains("KV events are published on ["), "{line}");
    assert!(line.contains(published), "{line}");
    assert!(line.contains(subscribed), "{line}");
    // Still routed, by load: nothing failed above.
    let sources = sidecar_json(&stack, "/debug/sources").await;
    assert_eq!(sources[0]["kind"], "nats");
    assert_eq!(sources[0]["events"], 0, "{sources}");
    assert_eq!(sources[0]["state"], "subscribed", "{sources}");
    assert!(sources[0]["bus"][published].as_u64() > Some(0), "{sources}");
}

/// A correctly subscribed fleet under the same traffic raises nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthy_event_plane_stays_quiet() {
    let mut opts = StackOptions::new("alarm-quiet", Mode::Kvroute);
    opts.sidecar_toml = FAST_ALARMS.into();
    let stack = Stack::start(opts).await.expect("stack starts");
    traffic(&stack, 1400).await;
    // Three alarm checks (one per second with silence_s = 1) while events keep arriving.
    for round in 0..3 {
        traffic(&stack, 1500 + round * 10).await;
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
    let m = stack.sidecar_metrics().await.unwrap();
    assert!(!series(&m, "kvroute_alarm{").any(|(_, v)| v == 1.0), "{m}");
    let sources = sidecar_json(&stack, "/debug/sources").await;
    assert_eq!(sources[0]["state"], "receiving", "{sources}");
    assert!(sources[0]["last_event_age_s"].as_f64().unwrap() < 5.0);
}
