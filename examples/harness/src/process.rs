//! Child processes with their output in a log file, killed when dropped; free loopback ports.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};

/// A free TCP port on 127.0.0.1, never one this process was given before, and below the
/// kernel's ephemeral range (`ip_local_port_range`): a port the kernel handed out for `:0` is
/// released at once, and any process's next outgoing connection may take it as its source port
/// before its owner binds it (seen: vLLM's engine core failing with "Address already in use"
/// while the other engine started).
pub fn free_port() -> Result<u16> {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let ephemeral_start = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let (low, high) = (10_000u16, ephemeral_start.max(10_001));
    // Start somewhere that differs between concurrent test processes.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let mut state = u64::from(std::process::id()) << 32 | u64::from(nanos) | 1;
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    for _ in 0..1000 {
        // xorshift64: cheap and good enough to scatter the candidates.
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let port = low + (state % u64::from(high - low)) as u16;
        if given.contains(&port) || TcpListener::bind(("127.0.0.1", port)).is_err() {
            continue;
        }
        given.push(port);
        return Ok(port);
    }
    bail!("no unused free port in {low}..{high} after 1000 tries")
}

/// `<dir>/<name>.log`, its earlier content (a previous process of that name) moved aside.
fn fresh_log(dir: &Path, name: &str) -> Result<PathBuf> {
    let log = dir.join(format!("{name}.log"));
    if log.exists() {
        let kept = (1..)
            .map(|n| dir.join(format!("{name}.{n}.log")))
            .find(|p| !p.exists())
            .expect("an unused log name");
        std::fs::rename(&log, kept)?;
    }
    Ok(log)
}

/// A running child process; stdout and stderr go to `<dir>/<name>.log`. A process started
/// again under the same name keeps its predecessor's log as `<name>.<n>.log` (what a killed
/// engine said while it shut down is what a restart test needs to read).
pub struct Process {
    name: String,
    child: Child,
    log: PathBuf,
}

impl Process {
    /// Start `cmd` in a process group of its own, with its output in `<dir>/<name>.log`.
    pub fn spawn(name: &str, mut cmd: Command, dir: &Path) -> Result<Process> {
        let log = fresh_log(dir, name)?;
        let out = std::fs::File::create(&log)?;
        cmd.stdout(out.try_clone()?)
            .stderr(out)
            .stdin(Stdio::null())
            .process_group(0);
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {name}: {cmd:?}"))?;
        Ok(Process {
            name: name.to_owned(),
            child,
            log,
        })
    }

    /// Start `cmd` and wait (up to `timeout`) for a stdout line starting with `prefix`;
    /// returns the rest of that line. Later stdout is discarded, stderr goes to the log.
    pub fn spawn_until_line(
        name: &str,
        mut cmd: Command,
        dir: &Path,
        prefix: &str,
        timeout: Duration,
    ) -> Result<(Process, String)> {
        let log = fresh_log(dir, name)?;
        cmd.stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log)?)
            .stdin(Stdio::null())
            .process_group(0);
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting {name}: {cmd:?}"))?;
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        let prefix = prefix.to_owned();
        std::thread::spawn(move || {
            let mut sent = false;
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if !sent {
                    if let Some(rest) = line.strip_prefix(&prefix) {
                        let _ = tx.send(rest.trim().to_owned());
                        sent = true;
                    }
                }
            }
        });
        let process = Process {
            name: name.to_owned(),
            child,
            log,
        };
        match rx.recv_timeout(timeout) {
            Ok(line) => Ok((process, line)),
            Err(_) => bail!("{name} did not get ready: {}", process.log_tail()),
        }
    }

    /// The process name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The last lines of its log, for error messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// Whether its log says `text` anywhere.
    pub fn log_contains(&self, text: &str) -> bool {
        std::fs::read_to_string(&self.log).is_ok_and(|log| log.contains(text))
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether it is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Kill it and every process it started (its process group: vLLM's engine core and workers
    /// are children of its API server, as in a container) now, and reap it.
    pub fn kill(&mut self) {
        let group = format!("-{}", self.child.id());
        let killed = Command::new("kill")
            .args(["-KILL", "--", &group])
            .stderr(Stdio::null())
            .status();
        if !killed.is_ok_and(|s| s.success()) {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Poll `check` until it returns `Some`, or fail after `timeout` with `what`.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = check().await {
            return Ok(v);
        }
        if start.elapsed() > timeout {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Wait (up to `timeout`) until the log file at `path` says `text`.
pub async fn wait_log(path: &Path, text: &str, timeout: Duration) -> Result<()> {
    wait_for(
        &format!("`{text}` in {}", path.display()),
        timeout,
        || async move {
            std::fs::read_to_string(path)
                .ok()?
                .contains(text)
                .then_some(())
        },
    )
    .await
}

/// CPU time (user + system) process `pid` has used, in seconds, from `/proc/<pid>/stat`;
/// `None` when it is gone or the file reads otherwise.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the command name's closing parenthesis: state is field 3, utime 14, stime 15.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i - 3)?.parse::<f64>().ok();
    // The kernel's USER_HZ: 100 on every Linux this runs on.
    Some((ticks(14)? + ticks(15)?) / 100.0)
}
