//! Pin mode, for fleets where Envoy sits in front of Dynamo frontends: the sidecar learns the
//! workers from Dynamo's file discovery records (not from its configuration), answers hints with
//! an instance id, the filter sends it as `x-worker-instance-id`, and the frontend serves the
//! request on that instance. An instance whose record goes away is no longer hinted.

mod common;

use std::time::Duration;

use common::*;
use kvroute_harness::process::wait_for;
use kvroute_harness::{Mode, Stack, StackOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hints_pin_requests_to_discovered_dynamo_instances() {
    let mut opts = StackOptions::new("dynamo-pin", Mode::Kvroute);
    opts.dynamo_frontend = true;
    let stack = &Stack::start(opts).await.expect("stack starts");
    let engines = stack.engines.len();
    assert_eq!(
        sidecar_metric(
            stack,
            "kvroute_discovered_instances{model=\"tiny-llama\",role=\"aggregated\"}"
        )
        .await,
        Some(engines as f64),
        "every instance found through its discovery record"
    );

    // Cache a prompt on engine 2 behind the frontend's back; Envoy only knows the frontend, which
    // round-robins what is not pinned, so landing on engine 2 every time is the pin's doing.
    let (home, system) = (2, text(2100, 200));
    let warmed = direct(stack, home, &chat(&system, &text(2101, 30))).await;
    wait_pinned_indexed(stack, home, (warmed.prompt_tokens / 16) as f64).await;
    for i in 0..6 {
        let o = via_envoy(stack, &chat(&system, &text(2110 + i, 10))).await;
        assert_eq!(served_by(&o), home, "request {i}");
    }
    let hinted = stack
        .envoy_stat("wasmcustom.kvroute.hinted")
        .await
        .unwrap_or(0);
    assert!(hinted >= 6, "hinted {hinted}");

    // The instance stops: Dynamo removes its record. It is never hinted again, and the requests
    // that would have gone there are served elsewhere without an error.
    let record = stack.dir.join(format!(
        "discovery/v1/instances/dynamo%2Fbackend%2Fgenerate%2F{:x}",
        stack.engines[home].dynamo_worker_id
    ));
    std::fs::remove_file(&record).expect("the simulator wrote the discovery record");
    let usable = format!(
        "kvroute_worker_usable{{worker=\"{}\"}}",
        pinned_label(stack, home)
    );
    let usable_ref = &usable;
    wait_for(
        "the instance to be dropped",
        Duration::from_secs(10),
        || async move { (sidecar_metric(stack, usable_ref).await? == 0.0).then_some(()) },
    )
    .await
    .expect("a removed record makes the instance unusable");
    for i in 0..6 {
        let o = via_envoy(stack, &chat(&system, &text(2120 + i, 10))).await;
        assert_ne!(
            served_by(&o),
            home,
            "request {i} went to the departed instance"
        );
    }
}
