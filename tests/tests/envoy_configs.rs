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
    let read = |name: &str| {
        std::fs::read_to_string(paths::workspace().join("deploy/envoy").join(name)).unwrap()
    };
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

/// The documented command runs beside another Envoy on the host (one started with Envoy's
/// defaults, hot restart on at base id 0), where Envoy's defaults would not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_command_runs_beside_another_envoy() {
    use kvroute_harness::process::{free_port, wait_for};
    let dir = paths::run_dir("envoy-beside").unwrap();
    let engines = vec!["127.0.0.1:8100".to_owned()];
    let config = |name: &str| {
        let opts = StackOptions::new("beside", Mode::RoundRobin);
        let (listen, admin) = (free_port().unwrap(), free_port().unwrap());
        let yaml = render_envoy(
            &opts,
            &dir,
            &engines,
            listen,
            admin,
            &SidecarAddress::Tcp(9100),
        )
        .unwrap();
        let file = dir.join(format!("{name}.yaml"));
        std::fs::write(&file, yaml).unwrap();
        (file, admin)
    };
    let envoy = |file: &std::path::Path, flags: &[&str], log: &str| {
        let log = std::fs::File::create(dir.join(log)).unwrap();
        Command::new(paths::venv_tool("envoy").unwrap())
            .arg("-c")
            .arg(file)
            .args(flags)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap()
    };
    let ready = |admin: u16| async move {
        let url = format!("http://127.0.0.1:{admin}/ready");
        wait_for(
            "Envoy ready",
            std::time::Duration::from_secs(20),
            || async {
                let r = reqwest::get(&url).await.ok()?;
                r.status().is_success().then_some(())
            },
        )
        .await
    };
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let (a, admin_a) = config("a");
    let _first = Kill(envoy(&a, &[], "a.log"));
    ready(admin_a).await.unwrap();
    // Envoy's defaults, a second time: refused.
    let (b, _) = config("b");
    let mut second = envoy(&b, &[], "b.log");
    let status = second.wait().unwrap();
    let said = std::fs::read_to_string(dir.join("b.log")).unwrap();
    assert!(!status.success(), "{said}");
    assert!(said.contains("unable to bind domain socket"), "{said}");
    // The two documented ways.
    let base_id = dir.join("base-id");
    for (name, flags) in [
        ("c", vec!["--disable-hot-restart"]),
        (
            "d",
            vec![
                "--use-dynamic-base-id",
                "--base-id-path",
                base_id.to_str().unwrap(),
            ],
        ),
    ] {
        let (file, admin) = config(name);
        let _beside = Kill(envoy(&file, &flags, &format!("{name}.log")));
        ready(admin).await.unwrap_or_else(|e| {
            panic!(
                "{name}: {e}: {}",
                std::fs::read_to_string(dir.join(format!("{name}.log"))).unwrap()
            )
        });
    }
    let id = std::fs::read_to_string(&base_id).unwrap();
    assert!(id.trim().parse::<u32>().is_ok_and(|id| id != 0), "{id}");
}
