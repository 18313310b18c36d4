//! The chaos soak's smoke ([`kvroute_harness::soak`]): under steady load over two replicas, an
//! engine restarts, a replica is cut off from KV events, a sidecar is killed — and no request a
//! retry could have saved fails, every fault heals (both indexes agree with what the engines
//! hold, asked of the engines), and at the end the indexes agree with the engines and with each
//! other. `make soak` runs every fault. The Dynamo smoke kills a real Dynamo worker under load
//! and starts it again as a new instance: no request a router could have saved fails, and the
//! index agrees with what the workers report cached.

use kvroute_harness::paths;
use kvroute_harness::soak::{run, SoakBench};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_fail_no_request_and_every_index_heals() {
    let out = paths::run_dir("soak-smoke").unwrap();
    let bench = SoakBench::smoke();
    let doc = run(&bench, &out).await.unwrap();
    assert!(doc["requests"].as_u64().unwrap() > 500, "{doc}");
    assert_eq!(doc["failures_a_retry_could_have_saved"], 0, "{doc}");
    let faults = doc["faults"].as_array().unwrap();
    assert_eq!(faults.len(), bench.faults.len());
    for f in faults {
        assert!(f["healed_after_s"].is_f64(), "not healed: {f}");
    }
    for share in doc["final_agreement_with_engines"].as_array().unwrap() {
        assert!(share.as_f64().is_some_and(|s| s >= 0.95), "{doc}");
    }
    assert!(
        doc["final_agreement_between_replicas"].as_f64().unwrap() >= 0.95,
        "{doc}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_dynamo_worker_fails_no_request_a_router_could_save_and_the_index_heals() {
    let out = paths::run_dir("soak-dynamo-smoke").unwrap();
    let bench = SoakBench::dynamo_smoke();
    let doc = run(&bench, &out).await.unwrap();
    assert!(doc["requests"].as_u64().unwrap() > 300, "{doc}");
    assert_eq!(doc["failures_a_retry_could_have_saved"], 0, "{doc}");
    let faults = doc["faults"].as_array().unwrap();
    assert_eq!(faults.len(), 1);
    assert!(faults[0]["healed_after_s"].is_f64(), "not healed: {doc}");
    assert!(faults[0]["kill_seen_after_ms"].is_f64(), "{doc}");
    for share in doc["final_agreement_with_engines"].as_array().unwrap() {
        assert!(share.as_f64().is_some_and(|s| s >= 0.95), "{doc}");
    }
}
