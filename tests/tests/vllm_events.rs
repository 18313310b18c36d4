//! vLLM's native KV events over real ZMQ (libzmq on both ends, as vLLM publishes) drive routing
//! through Envoy; gaps are replayed, restarts clear the worker, a restarted sidecar warms up
//! from the replay buffer.

mod common;

use common::*;
use kvroute_harness::{Mode, Stack, StackOptions};

async fn stack(name: &str, formats: &[&str]) -> Stack {
    let mut opts = StackOptions::new(name, Mode::Kvroute);
    opts.sim.event_formats = formats.iter().map(|f| f.to_string()).collect();
    Stack::start(opts).await.expect("stack starts")
}

async fn admin(stack: &Stack, engine: usize, path: &str, body: &str) {
    let url = format!("http://{}/admin/{path}", stack.engines[engine].address);
    let resp = stack.http.post(url).body(body.to_owned()).send().await;
    assert!(resp.unwrap().status().is_success());
}

fn sequence(metrics: &str, engine: &str, kind: &str) -> f64 {
    metric(
        metrics,
        &format!("kvroute_sequence_total{{worker=\"{engine}\",kind=\"{kind}\"}}"),
    )
    .unwrap_or(0.0)
}

/// Both encodings vLLM has used (tagged maps, positional arrays) index and steer requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_events_steer_requests_in_both_encodings() {
    let stack = stack("vllm-steer", &["vllm-map", "vllm-array"]).await;
    for engine in [2, 3] {
        let system = text(800 + engine as u64, 200);
        let user = text(900 + engine as u64, 40);
        let warmed = direct(&stack, engine, &chat(&system, &user)).await;
        wait_indexed(&stack, engine, (warmed.prompt_tokens / 16) as f64).await;
        for i in 0..3 {
            let o = via_envoy(&stack, &chat(&system, &format!("{user} {}", text(i, 5)))).await;
            assert_eq!(served_by(&o), engine, "request {i}");
            assert!(
                o.cached_tokens >= warmed.prompt_tokens / 16 * 16 - 16,
                "{o:?}"
            );
        }
    }
    let metrics = stack.sidecar_metrics().await.unwrap();
    assert!(
        !metrics.contains("kvroute_decode_errors_total{source=\"zmq\"}"),
        "{metrics}"
    );
}

/// Messages the subscriber missed are fetched from the engine's replay socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_is_filled_by_replay() {
    let stack = stack("vllm-gap", &["vllm-map"]).await;
    let address = stack.engines[1].address.clone();
    let first = direct(&stack, 1, &chat(&text(1000, 100), "a")).await;
    wait_indexed(&stack, 1, (first.prompt_tokens / 16) as f64).await;
    // The next store is not sent live; the one after it reveals the gap.
    admin(&stack, 1, "drop_events", "1").await;
    let missed_prompt = chat(&text(1001, 100), "b");
    let missed = direct(&stack, 1, &missed_prompt).await;
    direct(&stack, 1, &chat(&text(1002, 100), "c")).await;
    let replayed = kvroute_harness::process::wait_for(
        "the gap to be replayed",
        std::time::Duration::from_secs(10),
        || async {
            let m = stack.sidecar_metrics().await.ok()?;
            (sequence(&m, &address, "replayed") >= 1.0).then_some(m)
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(sequence(&replayed, &address, "gap"), 1.0, "{replayed}");
    assert_eq!(sequence(&replayed, &address, "resync"), 0.0, "{replayed}");
    assert_eq!(
        common::metric(
            &replayed,
            "kvroute_replica_repairs_total{kind=\"engine_replay\"}"
        ),
        Some(1.0),
        "{replayed}"
    );
    // The missed prompt is known in full: its hint matches every block on engine 1.
    let o = via_envoy(&stack, &missed_prompt).await;
    assert_eq!(served_by(&o), 1);
    let decision = latest_decision(&stack).await;
    assert_eq!(
        decision["hint"]["matched_blocks"].as_u64().unwrap(),
        missed.prompt_tokens / 16,
        "{decision}"
    );
}

/// An engine that restarts comes back empty: its connection closes, its old entries are
/// dropped at once (no traffic needed) and what the new process stores is indexed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restart_clears_its_worker() {
    let stack = stack("vllm-restart", &["vllm-array"]).await;
    let address = stack.engines[0].address.clone();
    let system = text(1100, 200);
    let old = direct(&stack, 0, &chat(&system, "before")).await;
    wait_indexed(&stack, 0, (old.prompt_tokens / 16) as f64).await;
    for _ in 0..2 {
        direct(&stack, 0, &chat(&text(1101, 50), "x")).await;
    }
    admin(&stack, 0, "restart", "").await;
    let cleared = wait_worker_index(
        &stack,
        &address,
        "the closed connection to clear the worker",
        std::time::Duration::from_secs(2),
        |n| n == 0.0,
    )
    .await;
    assert_eq!(sequence(&cleared, &address, "disconnect"), 1.0, "{cleared}");
    let fresh = direct(&stack, 0, &chat(&text(1102, 40), "after")).await;
    wait_indexed(&stack, 0, (fresh.prompt_tokens / 16) as f64).await;
    // The old prompt is not matched on engine 0 any more: nothing holds it.
    let o = via_envoy(&stack, &chat(&system, "before")).await;
    assert!(o.ok());
    let decision = latest_decision(&stack).await;
    assert_eq!(decision["hint"]["matched_blocks"], 0, "{decision}");
}

/// A sidecar started after its engines reads each engine's replay buffer as it connects: the
/// prefixes cached before it started are routed to at once, with no new event needed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_sidecar_warms_up_from_the_replay_buffer() {
    let mut stack = stack("vllm-warm", &["vllm-map"]).await;
    let address = stack.engines[3].address.clone();
    let system = text(1200, 200);
    let warmed = direct(&stack, 3, &chat(&system, "first")).await;
    let blocks = (warmed.prompt_tokens / 16) as f64;
    wait_indexed(&stack, 3, blocks).await;
    stack.restart_sidecar().await.expect("sidecar restarts");
    let warm = wait_worker_index(
        &stack,
        &address,
        "the new sidecar to read the replay buffer",
        std::time::Duration::from_secs(5),
        |n| n >= blocks,
    )
    .await;
    assert_eq!(sequence(&warm, &address, "warm_start"), 1.0, "{warm}");
    let o = via_envoy(&stack, &chat(&system, "second")).await;
    assert_eq!(served_by(&o), 3, "{o:?}");
    assert!(
        o.cached_tokens >= warmed.prompt_tokens / 16 * 16 - 16,
        "{o:?}"
    );
}

/// The sidecar's latest hint decision (`/debug/explain`).
async fn latest_decision(stack: &Stack) -> serde_json::Value {
    sidecar_json(stack, "/debug/explain").await[0]["decision"].clone()
}
