//! A per-host endpoint template (`tcp://{host}:5557`): how `[[envoy.members]]` finds the KV-event
//! endpoints of hosts it learns from Envoy, checked when the configuration loads.

use anyhow::bail;

/// One piece of an endpoint template.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Text(String),
    /// `{host}`: the host's IP (in brackets for IPv6).
    Host,
    /// `{address}`: `ip:port`, as Envoy lists it.
    Address,
    /// `{port}`, `{port+N}`, `{port-N}`: its port, shifted.
    Port(i32),
}

/// A per-host endpoint such as `tcp://{host}:5557`, checked when the configuration loads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointTemplate(Vec<Piece>);

impl EndpointTemplate {
    /// Parse a template; it must be a `tcp://` or `ipc://` endpoint that names the host.
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        if !text.starts_with("tcp://") && !text.starts_with("ipc://") {
            bail!("endpoint template {text:?} is not tcp:// or ipc://");
        }
        let mut pieces = Vec::new();
        let mut rest = text;
        while let Some(open) = rest.find('{') {
            if open > 0 {
                pieces.push(Piece::Text(rest[..open].to_owned()));
            }
            let Some(close) = rest[open..].find('}') else {
                bail!("endpoint template {text:?}: unclosed '{{'");
            };
            let name = &rest[open + 1..open + close];
            pieces.push(match name {
                "host" => Piece::Host,
                "address" => Piece::Address,
                "port" => Piece::Port(0),
                _ => match name.strip_prefix("port").map(|s| s.split_at(1)) {
                    Some(("+", n)) if n.parse::<u16>().is_ok() => Piece::Port(n.parse().unwrap_or(0)),
                    Some(("-", n)) if n.parse::<u16>().is_ok() => {
                        Piece::Port(-n.parse::<i32>().unwrap_or(0))
                    }
                    _ => bail!(
                        "endpoint template {text:?}: unknown placeholder {{{name}}} (known: {{host}}, {{port}}, {{address}}, {{port+N}}, {{port-N}})"
                    ),
                },
            });
            rest = &rest[open + close + 1..];
        }
        if !rest.is_empty() {
            pieces.push(Piece::Text(rest.to_owned()));
        }
        if !pieces
            .iter()
            .any(|p| matches!(p, Piece::Host | Piece::Address))
        {
            bail!("endpoint template {text:?} names no host: every host would share one endpoint ({{host}} or {{address}})");
        }
        Ok(EndpointTemplate(pieces))
    }

    /// The endpoint of the host at `address` (`ip:port`); `None` when it is not `ip:port` or a
    /// shifted port falls outside 1..=65535.
    pub fn expand(&self, address: &str) -> Option<String> {
        let socket: std::net::SocketAddr = address.parse().ok()?;
        let host = match socket.ip() {
            std::net::IpAddr::V4(ip) => ip.to_string(),
            std::net::IpAddr::V6(ip) => format!("[{ip}]"),
        };
        let mut out = String::new();
        for piece in &self.0 {
            match piece {
                Piece::Text(t) => out.push_str(t),
                Piece::Host => out.push_str(&host),
                Piece::Address => out.push_str(&format!("{host}:{}", socket.port())),
                Piece::Port(shift) => {
                    let port = i32::from(socket.port()) + shift;
                    if !(1..=65535).contains(&port) {
                        return None;
                    }
                    out.push_str(&port.to_string());
                }
            }
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_give_each_host_its_endpoints() {
        let t = EndpointTemplate::parse("tcp://{host}:5557").unwrap();
        assert_eq!(t.expand("10.1.2.3:8000").unwrap(), "tcp://10.1.2.3:5557");
        assert_eq!(t.expand("[fd00::7]:8000").unwrap(), "tcp://[fd00::7]:5557");
        let t = EndpointTemplate::parse("tcp://{host}:{port+1}").unwrap();
        assert_eq!(t.expand("127.0.0.1:8000").unwrap(), "tcp://127.0.0.1:8001");
        assert_eq!(t.expand("127.0.0.1:65535"), None, "out of range");
        let t = EndpointTemplate::parse("tcp://{address}").unwrap();
        assert_eq!(t.expand("127.0.0.1:9").unwrap(), "tcp://127.0.0.1:9");
        let t = EndpointTemplate::parse("tcp://{host}:{port-1000}").unwrap();
        assert_eq!(t.expand("127.0.0.1:6557").unwrap(), "tcp://127.0.0.1:5557");
        assert_eq!(t.expand("127.0.0.1:80"), None);
        assert_eq!(t.expand("pod-a:80"), None, "not ip:port");
        for bad in [
            "tcp://10.0.0.1:5557",
            "http://{host}:5557",
            "tcp://{hostname}:5557",
            "tcp://{host}:{port*2}",
            "tcp://{host:5557",
            "tcp://{host}:{port+x}",
        ] {
            assert!(EndpointTemplate::parse(bad).is_err(), "{bad}");
        }
    }
}
