//! The hint stream through real Envoy: hints ride one gRPC stream per VM (over HTTP/2 as
//! shipped, or an HTTP/1.1 cluster), a restarted sidecar gets it back, a sidecar dying under
//! waiting asks sends them on at once, and switched off every hint is a call. A sidecar stopped
//! (asks time out on the tick): `routing.rs`.

mod common;

use std::time::Duration;

use common::*;
use kvroute_harness::process::wait_for;
use kvroute_harness::{Mode, Stack, StackOptions};

/// Every hint the sidecar answers while traffic flows came on the stream: the filter's count of
/// asks on it moves exactly as the sidecar's count of hints answered. After the sidecar is
/// restarted, the VMs open the stream again and the hints go back on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hints_ride_the_stream_and_it_comes_back_after_a_restart() {
    let mut stack = Stack::start(StackOptions::new("hint-stream", Mode::Kvroute))
        .await
        .expect("stack starts");
    wait_streams(&stack).await;

    let sent = send_turns(&stack, 1, 10).await;
    assert_eq!(sent, 10);
    assert_eq!(
        (asks(&stack).await, hints_answered(&stack).await),
        (10, 10.0),
        "every hint on the stream: {}",
        stack.log_tail("envoy")
    );
    // The finished reports rode the stream too (on later asks, or alone on the tick).
    wait_for(
        "every hinted request reported finished",
        Duration::from_secs(5),
        || async {
            let text = stack.sidecar_metrics().await.ok()?;
            let open = kvroute_harness::prometheus::sum(&text, "kvroute_in_flight{");
            (open == 0.0 && metric(&text, "kvroute_tickets_total{how=\"finished\"}")? >= 10.0)
                .then_some(())
        },
    )
    .await
    .expect("reports arrive");

    stack.restart_sidecar().await.expect("sidecar restarts");
    wait_streams(&stack).await;
    let before = asks(&stack).await;
    assert_eq!(send_turns(&stack, 2, 5).await, 5);
    assert_eq!(asks(&stack).await - before, 5, "back on the stream");
    assert_eq!(
        hints_answered(&stack).await,
        5.0,
        "the new sidecar answered them"
    );
    let down = stack
        .envoy_stat("wasmcustom.kvroute.hint_stream.down")
        .await
        .unwrap_or(0);
    assert!(down >= 1, "the restart closed the streams: {down}");
}

/// A sidecar that dies while requests wait on the stream for their hints: the stream's close
/// sends them on at once, unhinted, not at their deadline (5 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_waiting_on_a_stream_that_closes_go_on_at_once() {
    let mut opts = StackOptions::new("hint-stream-close", Mode::Kvroute);
    opts.hint_timeout_ms = 5000;
    let stack = Stack::start(opts).await.expect("stack starts");
    wait_streams(&stack).await;
    // Stopped, it leaves the asks unread on its connection; killed, its connection closes.
    stack.signal("sidecar", "STOP").unwrap();
    let system = text(5000, 120);
    let started = std::time::Instant::now();
    let bodies: Vec<_> = (0..4).map(|i| chat(&system, &text(5001 + i, 20))).collect();
    let requests = futures::future::join_all(bodies.iter().map(|b| via_envoy(&stack, b)));
    let kill = async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        stack.signal("sidecar", "KILL").unwrap();
    };
    let (outcomes, ()) = tokio::join!(requests, kill);
    let took = started.elapsed();
    assert!(
        outcomes
            .iter()
            .all(|o| o.status == 200 && o.error.is_none()),
        "{outcomes:?}"
    );
    assert!(took < Duration::from_millis(2500), "{took:?}");
    let stat = |name: &'static str| {
        let stack = &stack;
        async move { stack.envoy_stat(name).await.unwrap_or(0) }
    };
    let asked = asks(&stack).await;
    let errors = stat("wasmcustom.kvroute.sidecar.errors").await;
    let fallbacks = stat("wasmcustom.kvroute.fallback.sidecar").await;
    assert!(
        asked >= 4 && errors >= 4 && fallbacks >= 4,
        "asks {asked}, errors {errors}, fallbacks {fallbacks}"
    );
    assert_eq!(stat("wasmcustom.kvroute.sidecar.timeouts").await, 0);
    assert!(stat("wasmcustom.kvroute.hint_stream.down").await >= 1);
}

/// An Envoy whose sidecar cluster speaks HTTP/1.1 (a configuration from before the stream):
/// Envoy's gRPC client carries the stream over it all the same (chunked both ways, trailers),
/// so every hint rides it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidecar_cluster_on_http1_carries_the_stream_too() {
    let mut opts = StackOptions::new("hint-stream-http1", Mode::Kvroute);
    opts.sidecar_http1 = true;
    let stack = Stack::start(opts).await.expect("stack starts");
    wait_streams(&stack).await;
    assert_eq!(send_turns(&stack, 3, 6).await, 6);
    assert_eq!(hints_answered(&stack).await, 6.0);
    assert_eq!(asks(&stack).await, 6, "{}", stack.log_tail("envoy"));
}

/// With `hint_stream: false` no stream is opened and every hint is a call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_stream_every_hint_is_a_call() {
    let mut opts = StackOptions::new("hint-calls", Mode::Kvroute);
    opts.filter_extra
        .insert("hint_stream".into(), serde_json::Value::Bool(false));
    let stack = Stack::start(opts).await.expect("stack starts");
    assert_eq!(send_turns(&stack, 4, 6).await, 6);
    assert_eq!(stack.envoy_stat("wasmcustom.kvroute.hinted").await, Some(6));
    assert_eq!(hints_answered(&stack).await, 6.0);
    assert_eq!(asks(&stack).await, 0);
    assert_eq!(
        sidecar_metric(&stack, "kvroute_hint_streams").await,
        Some(0.0)
    );
}

/// Send `n` requests, each a new prompt long enough to hint; how many succeeded.
async fn send_turns(stack: &Stack, seed: u64, n: u64) -> u64 {
    let system = text(seed * 1000, 120);
    let mut ok = 0;
    for i in 0..n {
        let o = via_envoy(stack, &chat(&system, &text(seed * 1000 + 1 + i, 20))).await;
        ok += u64::from(o.error.is_none() && o.status == 200);
    }
    ok
}

async fn asks(stack: &Stack) -> u64 {
    stack
        .envoy_stat("wasmcustom.kvroute.hint_stream.asks")
        .await
        .unwrap_or(0)
}

/// Hints the sidecar answered, whatever their result.
async fn hints_answered(stack: &Stack) -> f64 {
    let text = stack.sidecar_metrics().await.unwrap_or_default();
    kvroute_harness::prometheus::sum(&text, "kvroute_hints_total{")
}

/// Wait for the sidecar to count every VM's hint stream open: one per Envoy worker thread (the
/// stacks run 2) and the main thread's. A VM whose stream is not up yet hints by call.
async fn wait_streams(stack: &Stack) {
    let vms = StackOptions::new("", Mode::Kvroute).envoy_concurrency as f64 + 1.0;
    wait_for(
        "every VM's hint stream open",
        Duration::from_secs(10),
        || async {
            let open = sidecar_metric(stack, "kvroute_hint_streams").await?;
            (open == vms).then_some(())
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}: {}", stack.log_tail("envoy")))
}
