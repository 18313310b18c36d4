//! A filter VM that dies (a bug, an out-of-memory trap) must not take serving or routing with
//! it: the requests it was holding finish, and a fresh VM routes the next ones.

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvroute_harness::client::ENGINE_HEADER;
use kvroute_harness::{Mode, Stack, StackOptions};

const TRAP_HEADER: &str = "x-kvroute-test-trap";

async fn post(stack: &Stack, body: &serde_json::Value, trap: bool) -> (u16, Duration) {
    let start = Instant::now();
    let mut req = stack
        .http
        .post(format!("{}/v1/chat/completions", stack.envoy_url))
        .header("content-type", "application/json")
        .timeout(Duration::from_secs(30))
        .body(body.to_string());
    if trap {
        req = req.header(TRAP_HEADER, "1");
    }
    let status = match req.send().await {
        Ok(r) => {
            let status = r.status().as_u16();
            let _ = r.headers().get(ENGINE_HEADER);
            let _ = r.bytes().await;
            status
        }
        Err(_) => 0,
    };
    (status, start.elapsed())
}

/// Envoy's stream idle timeout here: what ends a request paused on a trapped VM.
const IDLE: Duration = Duration::from_secs(5);

/// One Envoy worker thread, so one VM holds every request. Four requests wait for a hint (the
/// sidecar is stopped) when the VM traps. Envoy never resumes them (envoyproxy/envoy#38801):
/// the stream idle timeout ends them (503; its `request_timeout` does not apply once a body is
/// in, tried); the trapping request gets 503; `FAIL_RELOAD` starts a new VM, which loads the
/// bundles and hints again.
/// With `FAIL_OPEN` (shipped before) no VM ever runs again: nothing is hinted after the trap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trapped_vm_is_replaced_and_its_waiting_requests_end() {
    let mut opts = StackOptions::new("vm-trap", Mode::Kvroute);
    opts.envoy_concurrency = 1;
    opts.hint_timeout_ms = 1000;
    opts.stream_idle_timeout = IDLE;
    opts.filter_extra
        .insert("test_trap_header".into(), TRAP_HEADER.into());
    let stack = Stack::start(opts).await.expect("stack starts");
    let body = |i: u64| chat(&text(1, 100), &text(100 + i, 10));
    assert_eq!(post(&stack, &body(0), false).await.0, 200);
    let hinted = || async {
        stack
            .envoy_stat("wasmcustom.kvroute.hinted")
            .await
            .unwrap_or(0)
    };
    let before = hinted().await;
    assert!(before >= 1, "hinted {before}");

    stack.signal("sidecar", "STOP").unwrap();
    let waiting = futures::future::join_all((1..=4).map(|i| {
        let b = body(i);
        let stack = &stack;
        async move { post(stack, &b, false).await }
    }));
    let trap = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        post(&stack, &body(9), true).await
    };
    let (waited, trapped) = tokio::join!(waiting, trap);
    stack.signal("sidecar", "CONT").unwrap();
    assert_eq!(trapped.0, 503, "the trapping request: {trapped:?}");
    assert!(
        std::fs::read_to_string(stack.dir.join("envoy.log"))
            .unwrap_or_default()
            .contains("test trap requested"),
        "the VM did not trap"
    );
    for (status, took) in &waited {
        // Each had been waiting 300 ms when the VM trapped.
        assert!(
            *status == 503 && *took < IDLE + Duration::from_secs(3),
            "a request waiting on the trapped VM: {waited:?}"
        );
    }

    // A new VM: it loads the bundles again and hints; nothing fails meanwhile.
    let mut later = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while hinted().await <= before {
        assert!(
            Instant::now() < deadline,
            "no hint after the trap: {later:?}"
        );
        later.push(post(&stack, &body(10 + later.len() as u64), false).await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(later.iter().all(|(s, _)| *s == 200), "{later:?}");
    let reloads = stack
        .envoy_stat("wasm.kvroute.vm_reload_success")
        .await
        .unwrap_or(0);
    assert!(reloads >= 1, "vm_reload_success {reloads}");
}
