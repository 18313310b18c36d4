//! The benchmark harnesses run end to end on tiny inputs and write their documented files.
//! (The index summary's smoke run is its own bench target, run by `cargo test --all-targets`.)

use kvroute_harness::bench::{self, Scale};
use kvroute_harness::{datapath, paths};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_benchmark_smoke() {
    let out = paths::run_dir("bench-routing-smoke").unwrap();
    let doc = bench::run(
        &bench::RoutingBench {
            engines: 2,
            ..bench::RoutingBench::new(Scale::Smoke)
        },
        &out,
    )
    .await
    .unwrap();
    for w in ["conversation_trace", "multi_turn", "hot_prefix"] {
        let modes = &doc["workloads"][w]["modes"];
        for m in ["round_robin", "ring_hash", "kvroute", "oracle"] {
            let r = &modes[m];
            assert_eq!(r["available"], true, "{w}/{m}: {r}");
            assert_eq!(r["errors"], 0, "{w}/{m}: {r}");
            assert!(r["requests"].as_u64().unwrap() > 0, "{w}/{m}");
            for k in ["hit_rate", "ttft_p50_ms", "ttft_p95_ms", "imbalance"] {
                assert!(r[k].as_f64().is_some(), "{w}/{m}/{k}");
            }
        }
        // What kvroute's hints promised, beside what the engines found.
        let kvroute = &modes["kvroute"];
        assert!(
            kvroute["hinted_match_tokens"].as_u64().is_some(),
            "{w}: {kvroute}"
        );
        assert!(
            kvroute["cached_tokens"].as_u64().is_some(),
            "{w}: {kvroute}"
        );
        // A peer runs if `.venv-peers` has it (make bench-routing), else it is reported
        // unavailable with the reason; either way the run goes on.
        let peer = &modes["vllm-router:kv_aware"];
        if peer["available"] == true {
            assert_eq!(peer["errors"], 0, "{w}: {peer}");
        } else {
            assert!(!peer["reason"].as_str().unwrap().is_empty(), "{w}: {peer}");
        }
    }
    for f in ["routing.json", "routing.md", "routing.png"] {
        assert!(std::fs::metadata(out.join(f)).unwrap().len() > 0, "{f}");
    }
}

/// Two Envoys + two sidecars + four engines, each sidecar losing a tenth of the events, first
/// only comparing, then repairing from each other: the rows carry the documented fields, and
/// with repair both sidecars name the same first worker for at least 99% of the probe prompts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_benchmark_smoke() {
    use kvroute_harness::bench_replicas::{run, ReplicasBench, Scenario};
    let out = paths::run_dir("bench-replicas-smoke").unwrap();
    let lossy = |reconcile| Scenario {
        replicas: 2,
        loss: 0.1,
        reconcile,
    };
    let bench = ReplicasBench {
        engines: 4,
        probes: 100,
        scenarios: vec![lossy(false), lossy(true)],
        workloads: vec!["multi_turn"],
        ..ReplicasBench::new(Scale::Smoke)
    };
    run(&bench, &out).await.unwrap();
    let text = std::fs::read_to_string(out.join("replicas.json")).unwrap();
    let rows: serde_json::Value = serde_json::from_str(&text).unwrap();
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 2, "{text}");
    for r in rows {
        assert_eq!(r["replicas"], 2, "{r}");
        assert_eq!(r["loss"], 0.1, "{r}");
        assert_eq!(r["errors"], 0, "{r}");
        for k in ["hit_rate", "agreement", "events_dropped"] {
            assert!(r[k].as_f64().is_some(), "{k}: {r}");
        }
        assert!(
            r["events_dropped"].as_f64().unwrap() >= 1.0,
            "nothing lost: {r}"
        );
    }
    let repaired = &rows[1];
    assert_eq!(repaired["reconcile"], true);
    assert!(
        repaired["messages_filled"].as_f64().unwrap() >= 1.0,
        "{repaired}"
    );
    assert!(
        repaired["agreement"].as_f64().unwrap() >= 0.99,
        "{repaired}"
    );
    assert!(std::fs::metadata(out.join("replicas.md")).unwrap().len() > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn datapath_benchmark_smoke() {
    let out = paths::run_dir("bench-datapath-smoke").unwrap();
    let doc = datapath::run(Scale::Smoke, &out).await.unwrap();
    for setup in ["plain", "kvroute", "kvroute_uds"] {
        let c = &doc["cases"]["1k"][setup];
        assert_eq!(c["errors"], 0, "{setup}: {c}");
        assert!(c["p50_us"].as_f64().unwrap() > 0.0, "{setup}");
        assert!(c["rps"].as_f64().unwrap() > 0.0, "{setup}");
    }
    assert!(out.join("datapath.json").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamo_benchmark_smoke() {
    use kvroute_harness::bench_dynamo::{self, DynamoBench};
    let out = paths::run_dir("bench-dynamo-smoke").unwrap();
    let bench = DynamoBench {
        fleet: kvroute_harness::DynamoOptions::default(),
        conversations: 2,
        concurrency: 2,
        sidecar_toml: String::new(),
    };
    let md = bench_dynamo::run(&bench, &out).await.unwrap();
    let modes = [
        "dynamo_kv",
        "dynamo_round_robin",
        "kvroute",
        "kvroute_sidecar_killed",
    ];
    for mode in modes {
        assert!(md.contains(&format!("| {mode} |")), "{md}");
    }
    let doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("dynamo.json")).unwrap()).unwrap();
    let modes = doc["modes"].as_object().unwrap();
    assert_eq!(modes.len(), 4, "{doc}");
    for r in modes.values() {
        assert_eq!(r["errors"], 0, "{r}");
        assert_eq!(r["requests"], 8, "{r}");
    }
    assert!(out.join("dynamo.md").exists());
}
