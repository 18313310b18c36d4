//! `make demo`: one step of the load ladder near saturation — the same fleet and the same
//! request stream through kvroute, Envoy's ring hash and round robin.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use clap::Parser;
use kvroute_harness::bench::Scale;
use kvroute_harness::bench_load::{self, LoadBench, LoadMode, LoadWorkload, Source};
use kvroute_harness::{paths, Mode};
use serde_json::Value;

#[derive(Parser)]
#[command(
    about = "Compare kvroute with Envoy's ring hash and round robin on a simulated fleet near saturation"
)]
struct Args {
    /// Simulated engines.
    #[arg(long, default_value_t = 8)]
    engines: usize,
    /// Requests per second arriving (Poisson), the same stream for every mode.
    #[arg(long, default_value_t = 16.0)]
    rate: f64,
    /// Seconds requests keep arriving (after as long a warm-up at the same rate).
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Where to write load.md, load.json and load.png.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let workload = LoadWorkload::shared_prefix();
    let mut bench = LoadBench::new(Scale::Quick, args.engines);
    bench.rates = vec![args.rate];
    bench.step = Duration::from_secs(args.seconds);
    bench.workloads = vec![workload.clone()];
    bench.modes = [Mode::Kvroute, Mode::RingHash, Mode::RoundRobin]
        .map(LoadMode::Sim)
        .to_vec();
    let Source::Chat { spec, .. } = &workload.source else {
        anyhow::bail!("the demo runs a chat workload");
    };
    let groups = spec.system_prompt_words.len();
    println!(
        "kvroute demo: {} simulated engines with {}-block caches (the prompts outgrow one, fit the fleet), \
         {} groups of users behind their own ~870-token prefix, {} req/s arriving for {} s after a warm-up, \
         TTFT target 2x a cold prompt's. Progress:\n",
        args.engines,
        bench.capacity(&workload),
        groups,
        args.rate,
        args.seconds
    );
    let out = args
        .out
        .unwrap_or_else(|| paths::workspace().join("target/demo"));
    let doc = bench_load::run(&bench, &out).await?;
    let w = &doc["workloads"][workload.name];
    println!("\n{}", table(w));
    println!(
        "written to {} (and load.json, load.png)",
        out.join("load.md").display()
    );
    let failed: u64 = w["modes"]
        .as_object()
        .into_iter()
        .flatten()
        .flat_map(|(_, m)| m["points"].as_array().into_iter().flatten())
        .filter_map(|p| p["errors"].as_u64())
        .sum();
    anyhow::ensure!(
        failed == 0,
        "{failed} requests failed; the run directories under target/e2e/load-* hold each process's log"
    );
    Ok(())
}

/// Per mode: hit rate, TTFT p50/p90 against the target, requests per engine.
fn table(w: &Value) -> String {
    let target = w["target_ttft_ms"].as_f64().unwrap_or(0.0);
    let mut s = format!(
        "| mode | hit rate | TTFT p50 (ms) | TTFT p90 (ms) | within the {target:.0} ms target | requests per engine | errors |\n|---|---|---|---|---|---|---|\n"
    );
    for (mode, m) in w["modes"].as_object().into_iter().flatten() {
        let Some(p) = m["points"].as_array().and_then(|p| p.first()) else {
            continue;
        };
        let f = |k: &str| p[k].as_f64().unwrap_or(0.0);
        let per_engine: Vec<String> = p["requests_per_engine"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|n| n.to_string())
            .collect();
        s.push_str(&format!(
            "| {mode} | {:.1}% | {:.0} | {:.0} | {} | {} | {} |\n",
            100.0 * f("hit_rate"),
            f("ttft_p50_ms"),
            f("ttft_p90_ms"),
            if f("ttft_p90_ms") <= target {
                "yes"
            } else {
                "no"
            },
            per_engine.join(" / "),
            p["errors"],
        ));
    }
    s
}
