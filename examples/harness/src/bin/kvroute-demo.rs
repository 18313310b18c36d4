//! `make demo`: the same fleet and workload through kvroute, Envoy ring hash and round robin.

use std::path::PathBuf;

use anyhow::Result;
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use kvroute_harness::client::{run_sessions, Target, CLIENT_START_GAP};
use kvroute_harness::report::{self, ModeReport};
use kvroute_harness::stack::MODEL;
use kvroute_harness::workload::{ChatSpec, ChatWorkload};
use kvroute_harness::{paths, Mode, Stack, StackOptions};

#[derive(Parser)]
#[command(about = "Compare kvroute with Envoy's ring hash and round robin on a simulated fleet")]
struct Args {
    /// Conversations (users).
    #[arg(long, default_value_t = 64)]
    conversations: usize,
    /// Turns per conversation.
    #[arg(long, default_value_t = 4)]
    turns: usize,
    /// Conversations in flight at once.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Simulated engines.
    #[arg(long, default_value_t = 4)]
    engines: usize,
    /// KV cache capacity per engine, in blocks.
    #[arg(long, default_value_t = 1024)]
    capacity_blocks: usize,
    /// Where to write report.md and report.json.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let spec = ChatSpec {
        conversations: args.conversations,
        turns: args.turns,
        ..ChatSpec::demo()
    };
    let workload = ChatWorkload::generate(&spec);
    let sessions = workload.sessions(MODEL);
    println!(
        "kvroute demo: {} engines, {} conversations x {} turns = {} requests per mode, {} apps (system prompts of {:?} words)\n",
        args.engines,
        args.conversations,
        args.turns,
        workload.requests(),
        spec.system_prompt_words.len(),
        spec.system_prompt_words
    );
    let mut reports = Vec::new();
    for mode in [Mode::Kvroute, Mode::RingHash, Mode::RoundRobin] {
        let mut opts = StackOptions::new(&format!("demo-{}", mode.name()), mode);
        opts.sim.engines = args.engines;
        opts.sim.capacity_blocks = args.capacity_blocks;
        let mut stack = Stack::start(opts).await?;
        let bar = ProgressBar::new(workload.requests() as u64).with_style(
            ProgressStyle::with_template("{prefix:>12} [{bar:40}] {pos}/{len} {elapsed}")?
                .progress_chars("=> "),
        );
        bar.set_prefix(mode.name());
        let target = Target::Router(stack.envoy_url.clone());
        let outcomes = run_sessions(
            &stack.http,
            &target,
            &sessions,
            args.concurrency,
            CLIENT_START_GAP,
            &bar,
        )
        .await;
        bar.finish();
        stack.check_alive()?;
        reports.push(ModeReport::new(mode.name(), &outcomes, args.engines));
    }
    let out = args
        .out
        .unwrap_or_else(|| paths::workspace().join("target/demo"));
    let table = report::write(
        &out,
        "report",
        "Multi-turn chat behind shared system prompts",
        &reports,
    )?;
    println!("\n{table}");
    println!("written to {}", out.join("report.md").display());
    let failed: usize = reports.iter().map(|r| r.errors).sum();
    anyhow::ensure!(
        failed == 0,
        "{failed} requests failed; the run directories under target/e2e/demo-* hold each process's log"
    );
    Ok(())
}
