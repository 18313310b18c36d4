//! The sidecar's API under a descriptor limit of 1,024 (a common default) with more idle and
//! half-sent connections than that: hints still answered, at once.

mod common;

use std::time::{Duration, Instant};

use common::metric;
use kvroute_harness::client::get_text;
use kvroute_harness::paths;
use kvroute_harness::process::{free_port, wait_for, Process};
use tokio::io::AsyncWriteExt;

/// Start the sidecar under `ulimits` (bash `ulimit` arguments) with one worker and no event
/// source; its base URL.
async fn sidecar(name: &str, ulimits: &str) -> (Process, String, std::path::PathBuf) {
    let dir = paths::run_dir(name).unwrap();
    let port = free_port().unwrap();
    let config = dir.join("sidecar.toml");
    std::fs::write(
        &config,
        format!(
            "listen = \"127.0.0.1:{port}\"\n[[models]]\nname = \"m\"\ndir = \"{}\"\nblock_size = 16\n\
             [[workers]]\naddress = \"127.0.0.1:9000\"\nmodel = \"m\"\n",
            paths::model_dir().display()
        ),
    )
    .unwrap();
    let mut cmd = std::process::Command::new("bash");
    cmd.arg("-c")
        .arg(format!("{ulimits} && exec \"$0\" serve --config \"$1\""))
        .arg(paths::binary("kvroute-sidecar").unwrap())
        .arg(&config);
    let process = Process::spawn("sidecar", cmd, &dir).unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    let (http_ref, base_ref) = (&http, &base);
    wait_for("sidecar up", Duration::from_secs(20), || async move {
        get_text(http_ref, &format!("{base_ref}/healthz")).await
    })
    .await
    .unwrap();
    (process, base, dir)
}

/// The soft and hard `Max open files` of process `pid`.
fn open_file_limits(pid: u32) -> (u64, u64) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    let n: Vec<u64> = line
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    (n[0], n[1])
}

/// Soft and hard limit 1,024: the sidecar cannot raise it, keeps its connections to 768, and
/// with 1,100 idle and 100 half-sent connections open against it every hint is still answered
/// within a second (the connections idle longest make room), the process never holds more
/// descriptors than its limit, and nothing else breaks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hints_are_answered_under_a_flood_of_idle_connections() {
    let (mut process, base, dir) = sidecar("connections-flood", "ulimit -n 1024").await;
    let pid = process.pid();
    assert_eq!(open_file_limits(pid), (1024, 1024));
    let log = std::fs::read_to_string(dir.join("sidecar.log")).unwrap();
    assert!(log.contains("max_connections=768"), "{log}");
    let addr = base.trim_start_matches("http://").to_owned();
    let mut held = Vec::new();
    for _ in 0..1100 {
        held.push(tokio::net::TcpStream::connect(&addr).await.unwrap());
    }
    for _ in 0..100 {
        let mut c = tokio::net::TcpStream::connect(&addr).await.unwrap();
        c.write_all(b"POST /v1/hint HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")
            .await
            .unwrap();
        held.push(c);
    }
    let client = || {
        reqwest::Client::builder()
            .timeout(Duration::from_secs(1))
            .build()
            .unwrap()
    };
    let mut slowest = Duration::ZERO;
    for i in 0..20u32 {
        // A new connection each time, as Envoy's workers open them.
        let started = Instant::now();
        let answer = common::hint_for_tokens(&client(), &base, &[i; 64], 16).await;
        slowest = slowest.max(started.elapsed());
        assert_eq!(answer.workers, vec!["127.0.0.1:9000".to_string()]);
    }
    let http = client();
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count();
    println!("slowest hint {slowest:?}; the sidecar holds {fds} descriptors");
    assert!(fds <= 1024, "{fds}");
    let text = get_text(&http, &format!("{base}/metrics")).await.unwrap();
    assert_eq!(
        metric(&text, "kvroute_hints_total{result=\"no_match\"}"),
        Some(20.0),
        "{text}"
    );
    drop(held);
    assert!(process.is_running(), "the sidecar died");
}

/// A soft limit of 1,024 under a hard one of 4,096: raised at start, and said.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_descriptor_limit_is_raised_to_the_hard_one() {
    let (process, _base, dir) =
        sidecar("connections-raise", "ulimit -Sn 1024 && ulimit -Hn 4096").await;
    assert_eq!(open_file_limits(process.pid()), (4096, 4096));
    let log = std::fs::read_to_string(dir.join("sidecar.log")).unwrap();
    assert!(
        log.contains("open-descriptor limit raised to its hard limit from=1024 to=4096"),
        "{log}"
    );
    assert!(log.contains("max_connections=3072"), "{log}");
}
