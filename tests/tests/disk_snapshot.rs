//! A sidecar with no peer keeps its index on local disk (`[snapshot]`) and starts from it after
//! a restart. Dynamo on NATS keeps no history, so without the file a restarted sidecar knows
//! nothing of what the engines cached before.

mod common;

use std::time::Duration;

use common::{chat, metric, text, via_envoy};
use kvroute_harness::process::wait_for;
use kvroute_harness::prometheus::sorted_series;
use kvroute_harness::{Mode, Stack, StackOptions};

fn blocks(text: &str) -> Vec<(String, f64)> {
    sorted_series(text, "kvroute_index_blocks{")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_sidecar_starts_from_its_disk_snapshot() {
    let mut opts = StackOptions::new("disk-snapshot", Mode::Kvroute);
    opts.sidecar_toml = "[snapshot]\npath = \"index.snap\"\ninterval_ms = 200\n".into();
    let mut stack = Stack::start(opts).await.expect("stack starts");
    let prompts: Vec<_> = (0..16).map(|i| chat(&text(7000 + i, 120), "hi")).collect();
    let mut served = Vec::new();
    for p in &prompts {
        let o = via_envoy(&stack, p).await;
        assert!(o.ok(), "{o:?}");
        served.push(o.engine.expect("the engine names itself"));
    }
    // Every block indexed, and a snapshot written after the last one.
    let stack_ref = &stack;
    let before = wait_for(
        "a snapshot of every block",
        Duration::from_secs(10),
        || async move {
            let first = stack_ref.sidecar_metrics().await.ok()?;
            tokio::time::sleep(Duration::from_millis(500)).await;
            let then = stack_ref.sidecar_metrics().await.ok()?;
            let held = blocks(&then);
            let total: f64 = held.iter().map(|(_, v)| v).sum();
            (held == blocks(&first)
                && total > 0.0
                && metric(&then, "kvroute_disk_snapshot_bytes") > Some(0.0))
            .then_some(held)
        },
    )
    .await
    .unwrap();
    let file = stack.dir.join("index.snap");
    assert!(std::fs::metadata(&file).unwrap().len() > 0);

    stack.restart_sidecar().await.unwrap();
    let after = stack.sidecar_metrics().await.unwrap();
    assert_eq!(blocks(&after), before, "the index as it was: {after}");
    let caches = before.iter().filter(|(_, v)| *v > 0.0).count() as f64;
    assert_eq!(
        metric(
            &after,
            "kvroute_restored_caches_total{outcome=\"restored\"}"
        ),
        Some(caches)
    );
    // Prompts cached before the restart are hinted to the engine that holds them.
    for (p, engine) in prompts.iter().zip(&served).take(4) {
        let req = kvroute_protocol::hint::HintRequest {
            model: kvroute_harness::stack::MODEL.into(),
            hashes: kvroute_harness::bench_replicas::prompt_hashes(p).unwrap(),
            finished: Vec::new(),
        };
        let base = stack.sidecar_url.clone().unwrap();
        let hint = common::ask_hint(&stack.http, &base, &req).await;
        assert!(hint.matched_blocks > 0, "{hint:?}");
        assert_eq!(
            hint.workers.first(),
            Some(&stack.engines[*engine].address),
            "{hint:?}"
        );
    }

    // The premise: without the file, the restarted sidecar knows nothing.
    stack.kill("sidecar");
    std::fs::remove_file(&file).unwrap();
    stack.restart_sidecar().await.unwrap();
    let empty = stack.sidecar_metrics().await.unwrap();
    let total: f64 = blocks(&empty).iter().map(|(_, v)| v).sum();
    assert_eq!(total, 0.0, "{empty}");
}
