//! Child processes with their output in a log file, killed when dropped; free loopback ports.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};

/// A free TCP port on 127.0.0.1, chosen by the kernel, and never one this process was given
/// before: the port is released at once, so the kernel may offer it again to the next call
/// before anyone binds it (seen: a test's bind port equal to its listen port).
pub fn free_port() -> Result<u16> {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    for _ in 0..100 {
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
        if !given.contains(&port) {
            given.push(port);
            return Ok(port);
        }
    }
    bail!("no unused free port after 100 tries")
}

/// A running child process; stdout and stderr go to `<dir>/<name>.log`.
pub struct Process {
    name: String,
    child: Child,
    log: PathBuf,
}

impl Process {
    /// Start `cmd` in a process group of its own, with its output in `<dir>/<name>.log`.
    pub fn spawn(name: &str, mut cmd: Command, dir: &Path) -> Result<Process> {
        let log = dir.join(format!("{name}.log"));
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
        let log = dir.join(format!("{name}.log"));
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
