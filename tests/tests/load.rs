//! The load ladder's smoke ([`kvroute_harness::bench_load`]): a shared-prefix stream arriving
//! open-loop at two rates on engines that share their GPU and evict, through round robin and
//! through kvroute. Every request is answered, the report has the shape `make bench-load`
//! writes, and at the same rates kvroute finds more of the prompts cached than round robin (the
//! groups' prefixes outgrow one engine's cache, so spreading them evicts), and so does the
//! oracle; a peer router that cannot start is reported unavailable and the ladder goes on. What
//! the engines held just before each request is probed for every mode: the oracle, which sends
//! each request where the most is held, sent where the probe saw the most. The modes run
//! interleaved (each rate on every fleet in turn, the order reversed at the next rate), and every
//! request is in `requests.jsonl` with Envoy's split of its time where kvroute held it.
//! `make bench-load` runs the whole ladder. The conversation trace replays through kvroute at
//! its own timestamps, the modes one after the other.

use kvroute_harness::bench::Scale;
use kvroute_harness::bench_load::{run, LoadBench, LoadMode, LoadWorkload, Source};
use kvroute_harness::paths;
use kvroute_harness::stack::Mode;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ladder_runs_and_kvroute_keeps_prefixes_round_robin_evicts() {
    let out = paths::run_dir("load-smoke").unwrap();
    let mut bench = LoadBench::new(Scale::Smoke, 4);
    bench.modes.push(LoadMode::Oracle);
    bench.modes.push(LoadMode::Peer("no-such-router"));
    bench.interleave = true;
    let doc = run(&bench, &out).await.unwrap();
    let w = &doc["workloads"]["shared_prefix"];
    assert!(w["target_ttft_ms"].as_f64().unwrap() > 0.0, "{w}");
    let hit = |mode: &str| -> Vec<f64> {
        let m = &w["modes"][mode];
        assert_eq!(m["available"], true, "{m}");
        let sidecar = m["sidecar_hint_p50_us_bucket_bound"].as_f64();
        assert_eq!(sidecar.is_some(), mode == "kvroute", "{m}");
        assert!(m["max_rate_within_target"].is_f64(), "{m}");
        let points = m["points"].as_array().unwrap();
        assert_eq!(points.len(), bench.rates.len(), "{m}");
        points
            .iter()
            .map(|p| {
                for field in [
                    "ttft_p50_ms",
                    "ttft_p90_ms",
                    "ttft_p99_ms",
                    "throughput",
                    "imbalance",
                ] {
                    assert!(p[field].is_f64(), "{field} missing: {p}");
                }
                assert_eq!(p["errors"], 0, "{p}");
                let (best, sent) = (p["held_best"].as_f64(), p["held_sent"].as_f64());
                let (best, sent) = (best.expect("held_best"), sent.expect("held_sent"));
                assert!(best > 0.0 && sent <= best + 1e-9, "{p}");
                if mode == "oracle" {
                    assert!(
                        sent >= best - 1e-9,
                        "the oracle sent where less was held: {p}"
                    );
                }
                assert!(p["requests"].as_u64().unwrap() > 0, "{p}");
                // The filter's own timings, where it runs: kvroute asks for hints.
                let pause = p["hint_pause_p50_us"].as_f64();
                match mode {
                    "kvroute" => assert!(pause.is_some_and(|us| us > 0.0), "{p}"),
                    _ => assert!(pause.is_none(), "{p}"),
                }
                p["hit_rate"].as_f64().unwrap()
            })
            .collect()
    };
    let (kvroute, round_robin) = (hit("kvroute"), hit("round_robin"));
    let oracle = hit("oracle");
    for ((k, r), o) in kvroute.iter().zip(&round_robin).zip(&oracle) {
        assert!(
            k > r && o > r,
            "kvroute {kvroute:?}, the oracle {oracle:?} against round robin {round_robin:?}"
        );
    }
    let missing = &w["modes"]["no-such-router"];
    assert_eq!(missing["available"], false, "{missing}");
    assert!(out.join("load.png").exists() && out.join("load.md").exists());
    the_requests_are_recorded(&w["modes"], &out.join("requests.jsonl"), &bench.rates);
}

/// `requests.jsonl` holds every request each mode's points count, each with its engine;
/// kvroute's with how long Envoy held it and the engine's time to answer (its access log); the
/// modes took turns, the first at one rate last at the next.
fn the_requests_are_recorded(modes: &serde_json::Value, path: &std::path::Path, rates: &[f64]) {
    let text = std::fs::read_to_string(path).unwrap();
    let records: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for mode in ["round_robin", "kvroute", "oracle"] {
        let mine: Vec<&serde_json::Value> = records.iter().filter(|r| r["mode"] == mode).collect();
        let counted: u64 = modes[mode]["points"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["requests"].as_u64().unwrap())
            .sum();
        assert_eq!(mine.len() as u64, counted, "{mode}");
        for r in &mine {
            assert!(
                r["engine"].is_u64() && r["ttft_ms"].as_f64() > Some(0.0),
                "{r}"
            );
            if mode == "kvroute" {
                assert!(r["held_us"].as_i64() >= Some(0), "{r}");
                assert!(r["upstream_us"].as_i64() > Some(0), "{r}");
            }
        }
    }
    let order = |rate: f64| {
        let r = records
            .iter()
            .find(|r| r["mode"] == "round_robin" && r["rate"] == rate)
            .unwrap();
        r["order"].as_u64().unwrap()
    };
    assert_eq!((order(rates[0]), order(rates[1])), (0, 2));
}

/// The Mooncake conversation trace on the ladder through kvroute: its requests (completions of
/// token ids) arrive at the trace's own timestamps, sped up to each rate, and every one is
/// answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_conversation_trace_replays_at_each_rate() {
    let out = paths::run_dir("load-trace-smoke").unwrap();
    let mut bench = LoadBench::new(Scale::Smoke, 4);
    let mut trace = LoadWorkload::conversation_trace();
    if let Source::Trace { warm_up, .. } = &mut trace.source {
        *warm_up = 20;
    }
    bench.workloads = vec![trace];
    bench.modes = vec![LoadMode::Sim(Mode::Kvroute)];
    let doc = run(&bench, &out).await.unwrap();
    let w = &doc["workloads"]["conversation_trace"];
    assert_eq!(w["trace"], "conversation_trace.jsonl", "{w}");
    assert!(w["trace_rate"].as_f64().unwrap() > 1.0, "{w}");
    let m = &w["modes"]["kvroute"];
    let points = m["points"].as_array().unwrap();
    assert_eq!(points.len(), bench.rates.len(), "{m}");
    for (p, rate) in points.iter().zip(&bench.rates) {
        let expected = (rate * bench.step.as_secs_f64()).round() as u64;
        assert_eq!(p["requests"], expected, "{p}");
        assert_eq!(p["errors"], 0, "{p}");
        assert!(p["ttft_p90_ms"].as_f64().unwrap() > 0.0, "{p}");
    }
}
