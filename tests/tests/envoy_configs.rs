//! Every Envoy configuration we ship passes `envoy --mode validate` with the pinned Envoy.

use std::process::Command;

use kvroute_harness::stack::{render_envoy, EngineInfo, SidecarAddress};
use kvroute_harness::{paths, Mode, StackOptions};

#[test]
fn shipped_envoy_configs_validate() {
    let engines: Vec<EngineInfo> = (0..3)
        .map(|i| EngineInfo {
            index: i,
            address: format!("127.0.0.1:{}", 8100 + i),
            dynamo_worker_id: i as u64,
        })
        .collect();
    let dir = paths::run_dir("envoy-validate").unwrap();
    let uds = SidecarAddress::Unix(dir.join("sidecar.sock"));
    for (mode, sidecar) in [
        (Mode::Kvroute, SidecarAddress::Tcp(9100)),
        (Mode::Kvroute, uds),
        (Mode::RingHash, SidecarAddress::Tcp(9100)),
        (Mode::RoundRobin, SidecarAddress::Tcp(9100)),
    ] {
        let opts = StackOptions::new("validate", mode);
        let yaml = render_envoy(&opts, &engines, 10000, 9901, &sidecar).unwrap();
        let file =
            dir.join(format!("{}-{sidecar:?}.yaml", mode.name()).replace(['/', '"', ' '], "_"));
        std::fs::write(&file, yaml).unwrap();
        let out = Command::new(paths::venv_tool("envoy").unwrap())
            .args(["--mode", "validate", "--disable-hot-restart", "-c"])
            .arg(&file)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && text.contains("OK"),
            "{}: {text}",
            mode.name()
        );
        assert!(!text.contains("deprecated"), "{}: {text}", mode.name());
    }
}
