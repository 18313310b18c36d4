//! The simulated engines (`kvroute-sim`), started as the stack's options say.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context as _, Result};
use serde::Deserialize;

use super::{EngineInfo, StackOptions, MODEL};
use crate::paths;
use crate::process::Process;

/// The simulator's `READY` line.
#[derive(Deserialize)]
struct SimReady {
    engines: Vec<EngineInfo>,
    /// The Dynamo-frontend stand-in (`--frontend`).
    #[serde(default)]
    frontend: Option<String>,
}

/// Start the simulated engines (and, in pin mode, their Dynamo-frontend stand-in) as process
/// `name`, numbering them from `first_index`.
pub(super) fn start_sim(
    opts: &StackOptions,
    nats_url: &str,
    dir: &Path,
    discovery: &Path,
    (name, first_index): (&str, usize),
    processes: &mut Vec<Process>,
) -> Result<(Vec<EngineInfo>, Option<String>)> {
    let mut sim = Command::new(paths::binary("kvroute-sim")?);
    sim_args(&mut sim, opts, nats_url, discovery, first_index);
    let (sim, ready) = Process::spawn_until_line(name, sim, dir, "READY", Duration::from_secs(30))?;
    processes.push(sim);
    let ready =
        serde_json::from_str::<SimReady>(&ready).context("parsing the simulator's READY line")?;
    Ok((ready.engines, ready.frontend))
}

/// The simulator's arguments for `opts`.
fn sim_args(
    sim: &mut Command,
    opts: &StackOptions,
    nats_url: &str,
    discovery: &Path,
    first_index: usize,
) {
    let s = &opts.sim;
    sim.arg("--model-dir").arg(paths::model_dir());
    sim.args(["--model", MODEL, "--nats", nats_url]);
    for (flag, value) in [
        ("--engines", s.engines.to_string()),
        ("--first-index", first_index.to_string()),
        ("--block-size", s.block_size.to_string()),
        ("--capacity-blocks", s.capacity_blocks.to_string()),
        ("--max-running", s.max_running.to_string()),
        ("--base-latency-us", s.base_latency_us.to_string()),
        ("--prefill-us-per-token", s.prefill_us_per_token.to_string()),
        ("--decode-us-per-token", s.decode_us_per_token.to_string()),
        ("--output-tokens", s.output_tokens.to_string()),
        ("--event-format", s.event_formats.join(",")),
        ("--component", s.dynamo_component.clone()),
        ("--event-delay-ms", s.event_delay_ms.clone()),
        ("--frontend-delay-ms", s.frontend_delay_ms.to_string()),
        ("--metrics-delay-ms", s.metrics_delay_ms.to_string()),
    ] {
        sim.args([flag, &value]);
    }
    if s.instant {
        sim.arg("--instant");
    }
    if let Some(per_seq) = s.batching {
        sim.args(["--batching", "--decode-us-per-seq", &per_seq.to_string()]);
    }
    if opts.eds_membership {
        sim.arg("--zmq-beside");
    }
    if opts.dynamo_frontend {
        sim.arg("--frontend").arg("--discovery-dir").arg(discovery);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stack::Mode;

    fn args(opts: &StackOptions) -> Vec<String> {
        let mut sim = Command::new("kvroute-sim");
        sim_args(&mut sim, opts, "nats://127.0.0.1:4222", Path::new("/d"), 3);
        sim.get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
    }

    fn value<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
        let at = args.iter().position(|a| a == flag)?;
        args.get(at + 1).map(String::as_str)
    }

    /// Every engine setting reaches its flag; batching, EDS and the frontend only when asked.
    #[test]
    fn the_simulator_is_started_as_the_options_say() {
        let mut opts = StackOptions::new("t", Mode::Kvroute);
        opts.sim.engines = 8;
        opts.sim.capacity_blocks = 640;
        let plain = args(&opts);
        assert_eq!(value(&plain, "--engines"), Some("8"));
        assert_eq!(value(&plain, "--first-index"), Some("3"));
        assert_eq!(value(&plain, "--capacity-blocks"), Some("640"));
        assert_eq!(value(&plain, "--nats"), Some("nats://127.0.0.1:4222"));
        for flag in ["--batching", "--zmq-beside", "--frontend", "--instant"] {
            assert!(!plain.iter().any(|a| a == flag), "{flag}: {plain:?}");
        }
        opts.sim.batching = Some(40);
        opts.eds_membership = true;
        opts.dynamo_frontend = true;
        let all = args(&opts);
        assert_eq!(value(&all, "--decode-us-per-seq"), Some("40"));
        assert_eq!(value(&all, "--discovery-dir"), Some("/d"));
        for flag in ["--batching", "--zmq-beside", "--frontend"] {
            assert!(all.iter().any(|a| a == flag), "{flag}: {all:?}");
        }
    }
}
