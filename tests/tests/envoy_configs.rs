//! Every Envoy configuration we ship passes `envoy --mode validate` with the pinned Envoy.

use std::process::Command;

use kvroute_harness::stack::{render_envoy, SidecarAddress};
use kvroute_harness::{paths, Fallback, Mode, StackOptions};

/// `envoy --mode validate` on a configuration file: whether it passed, and what Envoy said.
fn validate(file: &std::path::Path) -> (bool, String) {
    let out = Command::new(paths::venv_tool("envoy").unwrap())
        .args(["--mode", "validate", "--disable-hot-restart", "-c"])
        .arg(file)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success() && text.contains("OK"), text)
}

#[test]
fn shipped_envoy_configs_validate() {
    let engines: Vec<String> = (0..3).map(|i| format!("127.0.0.1:{}", 8100 + i)).collect();
    let dir = paths::run_dir("envoy-validate").unwrap();
    let uds = SidecarAddress::Unix(dir.join("sidecar.sock"));
    let tcp = SidecarAddress::Tcp(9100);
    // Envoy validates that the EDS file exists.
    kvroute_harness::stack::write_eds(&dir, 1, &engines).unwrap();
    for (mode, fallback, sidecar, eds) in [
        (Mode::Kvroute, Fallback::RingHash, &tcp, false),
        (Mode::Kvroute, Fallback::RingHash, &uds, false),
        (Mode::Kvroute, Fallback::Maglev, &tcp, false),
        (Mode::Kvroute, Fallback::RingHash, &tcp, true),
        (Mode::RingHash, Fallback::RingHash, &tcp, false),
        (Mode::RoundRobin, Fallback::RingHash, &tcp, false),
    ] {
        let mut opts = StackOptions::new("validate", mode);
        opts.fallback = fallback;
        opts.eds_membership = eds;
        let yaml = render_envoy(&opts, &dir, &engines, 10000, 9901, sidecar).unwrap();
        let file = dir.join(
            format!("{}-{fallback:?}-{sidecar:?}-{eds}.yaml", mode.name())
                .replace(['/', '"', ' '], "_"),
        );
        std::fs::write(&file, yaml).unwrap();
        let (ok, text) = validate(&file);
        assert!(ok, "{}: {text}", mode.name());
        assert!(!text.contains("deprecated"), "{}: {text}", mode.name());
    }
}

/// The maglev variant is the ring-hash config with another fallback policy, nothing else: an
/// edit to one must reach the other.
#[test]
fn maglev_config_differs_only_in_the_fallback_policy() {
    let read =
        |name: &str| std::fs::read_to_string(paths::workspace().join("envoy").join(name)).unwrap();
    // Drop comments and the policy block (from its name to the balance factor).
    let skeleton = |text: String| -> Vec<String> {
        let mut out = Vec::new();
        let mut in_policy = false;
        for line in text.lines().filter(|l| !l.trim_start().starts_with('#')) {
            if line.contains("name: envoy.load_balancing_policies.ring_hash")
                || line.contains("name: envoy.load_balancing_policies.maglev")
            {
                in_policy = true;
            }
            if !in_policy {
                out.push(line.to_owned());
            }
            if line.contains("hash_balance_factor") {
                in_policy = false;
            }
        }
        out
    };
    let ring = read("kvroute.yaml");
    let maglev = read("kvroute-maglev.yaml");
    assert!(maglev.contains("maglev.v3.Maglev") && ring.contains("ring_hash.v3.RingHash"));
    assert_eq!(skeleton(ring), skeleton(maglev));
}

/// `kvroute-sidecar envoy-config`, as a user runs it, prints a configuration Envoy accepts.
#[test]
fn the_envoy_config_command_prints_a_config_that_runs() {
    let dir = paths::run_dir("envoy-config-command").unwrap();
    for template in ["kvroute", "kvroute-maglev", "round-robin"] {
        let out = Command::new(paths::binary("kvroute-sidecar").unwrap())
            .args(["envoy-config", "--template", template])
            .args(["--workers", "127.0.0.1:8001,127.0.0.1:8002"])
            .arg("--wasm")
            .arg(paths::filter_wasm().unwrap())
            .args(["--filter-config", r#"{"hint_timeout_ms": 30}"#])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let file = dir.join(format!("{template}.yaml"));
        std::fs::write(&file, &out.stdout).unwrap();
        let (ok, text) = validate(&file);
        assert!(ok, "{template}: {text}");
    }
    let bad = Command::new(paths::binary("kvroute-sidecar").unwrap())
        .args(["envoy-config", "--workers", "localhost:80"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("not ip:port"));
}
