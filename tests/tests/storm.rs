//! An event storm on a real nats-server ([`kvroute_harness::bench_storm`]): 200,000 Dynamo KV
//! events from 64 workers, sent as fast as one publisher can, one event per message.

use kvroute_harness::bench_storm::{run, Plane, StormBench};
use kvroute_harness::paths;

fn burst(nats_toml: &str) -> StormBench {
    StormBench {
        plane: Plane::Nats,
        workers: 64,
        rates: Vec::new(),
        seconds: 0.0,
        burst: 200_000,
        chain: 16,
        batch: 1,
        nats_toml: nats_toml.to_owned(),
    }
}

/// With the default buffer the burst is kept whole: every event applied and every worker's
/// index equal to what its cache holds, as the publisher knows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_is_kept_whole() {
    let out = paths::run_dir("storm-whole").unwrap();
    let doc = run(&burst(""), &out).await.unwrap();
    let step = &doc["steps"][0];
    assert_eq!(step["lost"], 0.0, "{step}");
    assert_eq!(step["workers_wrong"], 0, "{step}");
    assert_eq!(step["sidecar_says"]["lost_events"], 0.0, "{step}");
    assert_eq!(step["sidecar_says"]["lost_messages"], 0.0, "{step}");
}

/// With a buffer far too small for it the NATS client drops messages. The sidecar's own counts
/// of lost events and of lost messages equal what the outside sees lost (published minus applied: every loss shows
/// as a gap, since each worker publishes once more afterwards), it counts the client's drops,
/// and it says so in a line where a streak of losses starts and one where it ends, per kind of
/// loss — not one per message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loss_is_counted_as_the_outside_sees_it_and_said_once() {
    let out = paths::run_dir("storm-lossy").unwrap();
    let doc = run(&burst("buffer_messages = 1024"), &out).await.unwrap();
    let step = &doc["steps"][0];
    let lost = step["lost"].as_f64().unwrap();
    assert!(
        lost > 1000.0,
        "a 1024-message buffer holds a 200,000-message burst only if the sidecar keeps up with the publisher: {step}"
    );
    let says = &step["sidecar_says"];
    assert_eq!(says["lost_events"].as_f64(), Some(lost), "{step}");
    assert!(says["client_dropped"].as_f64().unwrap() > 0.0, "{step}");
    // One event a message: the publishers' own numbering says the same.
    assert_eq!(says["lost_messages"].as_f64(), Some(lost), "{step}");
    // Client buffer, messages, KV-event gaps, stores whose parent was lost: a start and an end
    // each.
    assert!(step["sidecar_loss_lines"].as_u64().unwrap() <= 8, "{step}");
    let lines = step["sidecar_log_lines"].as_u64().unwrap();
    assert!(
        lines < 200,
        "{lines} log lines for {lost} lost events: {step}"
    );
}
