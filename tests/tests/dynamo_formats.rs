//! Dynamo's event plane as fleets run it: 1.2's subject layout and one-event messages, a
//! disaggregated fleet whose KV events come from the `prefill` component, and a worker
//! restart — all with the sidecar's default configuration.

mod common;

use std::time::Duration;

use common::*;
use kvroute_harness::process::wait_for;
use kvroute_harness::{Mode, Stack, StackOptions};

async fn steers(stack: &Stack, engine: usize, seed: u64) {
    let system = text(seed, 200);
    let user = text(seed + 1, 40);
    let warmed = direct(stack, engine, &chat(&system, &user)).await;
    wait_indexed(stack, engine, (warmed.prompt_tokens / 16) as f64).await;
    let o = via_envoy(stack, &chat(&system, &format!("{user} more"))).await;
    assert_eq!(served_by(&o), engine);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamo_1_2_events_steer_requests() {
    let mut opts = StackOptions::new("dynamo-v12", Mode::Kvroute);
    opts.sim.event_formats = vec!["dynamo-v12".into()];
    let stack = Stack::start(opts).await.expect("stack starts");
    steers(&stack, 2, 1600).await;
    let metrics = stack.sidecar_metrics().await.unwrap();
    assert!(
        metrics.contains("subject=\"namespace.dynamo.component.backend.kv-events\""),
        "{metrics}"
    );
}

/// Disaggregated prefill/decode: the prefill workers publish the KV events, on their own
/// component. The default subscription covers every component; nothing is configured.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_prefill_events_work_without_config_changes() {
    let mut opts = StackOptions::new("dynamo-prefill", Mode::Kvroute);
    opts.sim.dynamo_component = "prefill".into();
    let stack = Stack::start(opts).await.expect("stack starts");
    steers(&stack, 1, 1700).await;
    let metrics = stack.sidecar_metrics().await.unwrap();
    assert!(
        metrics.contains("component.prefill.endpoint.generate.kv-events"),
        "events are counted per subject, naming the component: {metrics}"
    );
}

/// A restarted worker's event ids start over: its old entries are dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamo_worker_restart_clears_its_entries() {
    let stack = Stack::start(StackOptions::new("dynamo-restart", Mode::Kvroute))
        .await
        .expect("stack starts");
    let address = stack.engines[3].address.clone();
    for seed in [1800, 1810] {
        let o = direct(&stack, 3, &chat(&text(seed, 150), "x")).await;
        assert!(o.ok());
    }
    wait_indexed(&stack, 3, 10.0).await;
    engine_admin(&stack, &address, "restart").await;
    let fresh = direct(&stack, 3, &chat(&text(1820, 40), "y")).await;
    let fresh_blocks = (fresh.prompt_tokens / 16) as f64;
    let series = format!("kvroute_index_blocks{{worker=\"{address}\"}}");
    let restart = format!("kvroute_sequence_total{{worker=\"{address}\",kind=\"restart\"}}");
    wait_for(
        "the restart to clear the worker",
        Duration::from_secs(10),
        || async {
            let m = stack.sidecar_metrics().await.ok()?;
            (metric(&m, &series)? == fresh_blocks && metric(&m, &restart)? == 1.0).then_some(())
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}
