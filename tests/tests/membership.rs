//! A fleet under a control plane: Envoy reads its `workers` cluster from EDS (a file, replaced
//! as a control plane pushes it) and the sidecar takes its workers from Envoy's membership
//! (`[[envoy.members]]`, each host's KV-event endpoints from templates). Engines are added and
//! removed mid-run; nothing is restarted.

mod common;

use std::time::Duration;

use common::*;
use kvroute_harness::process::wait_for;
use kvroute_harness::{Mode, Stack, StackOptions};

/// Wait until the sidecar's `kvroute_worker_usable` for `worker` is `usable`.
async fn wait_usable(stack: &Stack, worker: &str, usable: f64, what: &str) {
    let series = format!("kvroute_worker_usable{{worker=\"{worker}\"}}");
    let series = &series;
    wait_for(what, Duration::from_secs(20), || async move {
        (sidecar_metric(stack, series).await? == usable).then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}: {}", stack.log_tail("sidecar")));
}

/// A new engine EDS adds is indexed from its own endpoints and hinted once it holds blocks; one
/// EDS removes is never hinted after Envoy drops it, and its subscriber is closed; no request
/// fails and the sidecar is the one process throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_eds_adds_and_removes_are_followed_without_a_restart() {
    let mut opts = StackOptions::new("membership", Mode::Kvroute);
    opts.eds_membership = true;
    opts.sim.engines = 2;
    opts.sim.event_formats = vec!["vllm-map".into()];
    let mut stack = Stack::start(opts).await.expect("stack starts");
    let mut failed = 0;

    // Both engines joined from Envoy's membership; engine 1's blocks steer a later turn.
    let (system, user) = (text(300, 200), text(301, 40));
    let warmed = direct(&stack, 1, &chat(&system, &user)).await;
    wait_indexed(&stack, 1, (warmed.prompt_tokens / 16) as f64).await;
    let o = via_envoy(&stack, &chat(&system, &format!("{user} again"))).await;
    assert_eq!(served_by(&o), 1, "hinted to the engine holding the prefix");

    // A new engine starts; the control plane adds it.
    let new = stack.add_sim_engine().expect("a new engine starts");
    let new_address = stack.engines[new].address.clone();
    stack.set_members(&[0, 1, new]).unwrap();
    wait_usable(&stack, &new_address, 1.0, "the new engine to join").await;
    let (system2, user2) = (text(310, 200), text(311, 40));
    let warmed = direct(&stack, new, &chat(&system2, &user2)).await;
    wait_indexed(&stack, new, (warmed.prompt_tokens / 16) as f64).await;
    for i in 0..4 {
        let o = via_envoy(
            &stack,
            &chat(&system2, &format!("{user2} {}", text(320 + i, 4))),
        )
        .await;
        failed += usize::from(!o.ok());
        assert_eq!(served_by(&o), new, "request {i}: hinted to the new engine");
    }

    // The control plane removes engine 1 (still running, as a pod being drained).
    let gone = stack.engines[1].address.clone();
    stack.set_members(&[0, new]).unwrap();
    let envoy = &stack;
    wait_for(
        "Envoy to drop engine 1",
        Duration::from_secs(20),
        || async move {
            (envoy.envoy_stat("cluster.workers.membership_total").await? == 2).then_some(())
        },
    )
    .await
    .unwrap();
    wait_usable(&stack, &gone, 0.0, "the sidecar to stop hinting engine 1").await;
    for i in 0..10 {
        let o = via_envoy(
            &stack,
            &chat(&system, &format!("{user} {}", text(330 + i, 4))),
        )
        .await;
        failed += usize::from(!o.ok());
        assert_ne!(served_by(&o), 1, "request {i} went to the removed engine");
    }
    let explain = sidecar_json(&stack, "/debug/explain").await;
    let candidates = explain[0]["decision"]["candidates"].as_array().unwrap();
    assert!(
        candidates.iter().all(|c| c["worker"] != gone.as_str()),
        "{candidates:?}"
    );
    // Its subscriber is closed; the others receive.
    let gone_endpoint = stack.engines[1].zmq_endpoint.clone().unwrap();
    let stack_ref = &stack;
    let gone_endpoint = &gone_endpoint;
    wait_for(
        "engine 1's source to close",
        Duration::from_secs(10),
        || async move {
            let sources = sidecar_json(stack_ref, "/debug/sources").await;
            let closed = sources
                .as_array()?
                .iter()
                .any(|s| s["name"] == gone_endpoint.as_str() && s["state"] == "closed");
            closed.then_some(())
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}: {}", stack.log_tail("sidecar")));

    assert_eq!(failed, 0, "a request failed while the fleet changed");
    stack
        .check_alive()
        .expect("every process runs, the sidecar never restarted");
    let log = std::fs::read_to_string(stack.dir.join("sidecar.log")).unwrap();
    assert_eq!(
        log.matches("joined the fleet").count(),
        3,
        "each engine joined once: {log}"
    );
}
