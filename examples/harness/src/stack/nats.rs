//! The stack's nats-server, and the lossy proxies its sidecars may read KV events through.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context as _, Result};

use super::StackOptions;
use crate::lossy_nats::LossyNats;
use crate::paths;
use crate::process::{wait_for, Process};

/// Sidecar `replica`'s proxy in front of the server at `nats_url`
/// ([`StackOptions::transport_loss`]; `None` without it).
pub(super) async fn event_proxy(
    opts: &StackOptions,
    nats_url: &str,
    replica: usize,
) -> Result<Option<LossyNats>> {
    let Some(loss) = &opts.transport_loss else {
        return Ok(None);
    };
    let upstream: std::net::SocketAddr = nats_url
        .strip_prefix("nats://")
        .and_then(|a| a.parse().ok())
        .with_context(|| format!("nats url {nats_url} is not nats://ip:port"))?;
    let proxy = LossyNats::start(upstream, loss.spec(replica))
        .await
        .context("starting a lossy NATS proxy")?;
    Ok(Some(proxy))
}

/// nats-server on `port`, once it greets with its INFO line: a bare connect can succeed before
/// it listens (a loopback socket that happens to get the port as its source connects to itself).
pub(crate) async fn start_nats(port: u16, dir: &Path) -> Result<Process> {
    let mut nats = Command::new(paths::venv_tool("nats-server")?);
    nats.args(["-a", "127.0.0.1", "-p", &port.to_string()]);
    let process = Process::spawn("nats", nats, dir)?;
    wait_for("nats-server", Duration::from_secs(10), || async move {
        use tokio::io::AsyncReadExt as _;
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        let mut greeting = [0u8; 4];
        let read = stream.read_exact(&mut greeting);
        tokio::time::timeout(Duration::from_millis(500), read)
            .await
            .ok()?
            .ok()?;
        (&greeting == b"INFO").then_some(())
    })
    .await?;
    Ok(process)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stack::{Mode, TransportLoss};

    /// Without a transport loss a sidecar reads the server itself; with one, a URL that names
    /// no `ip:port` is refused before any proxy starts.
    #[tokio::test]
    async fn a_proxy_only_with_a_transport_loss_and_a_usable_url() {
        let mut opts = StackOptions::new("t", Mode::Kvroute);
        let none = event_proxy(&opts, "nats://127.0.0.1:4222", 0)
            .await
            .unwrap();
        assert!(none.is_none());
        opts.transport_loss = Some(TransportLoss { loss: 0.1, seed: 1 });
        let Err(err) = event_proxy(&opts, "nats://nats.example:4222", 0).await else {
            panic!("a host name is not an ip:port");
        };
        assert!(err.to_string().contains("not nats://ip:port"), "{err:#}");
    }
}
