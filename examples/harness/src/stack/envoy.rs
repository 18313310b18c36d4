//! The stack's Envoys: the shipped configuration filled for the stack (or a bootstrap a test
//! assembles), the EDS file a control plane would push, and the process.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, Result};
use kvroute_sidecar::envoy_config::{self, EnvoyParams, Template, Workers};

use super::{Fallback, Mode, StackOptions};
use crate::paths;
use crate::process::Process;

/// Builds an Envoy bootstrap (YAML or JSON text) from what the stack started.
pub type BootstrapFn = fn(&EnvoyInputs) -> Result<String>;

/// What the stack gives a [`BootstrapFn`].
#[derive(Debug, Clone)]
pub struct EnvoyInputs {
    /// The listener's port, on 127.0.0.1.
    pub listen: u16,
    /// The admin port, on 127.0.0.1.
    pub admin: u16,
    /// The engines (or frontends): `ip:port`.
    pub upstreams: Vec<std::net::SocketAddr>,
    /// The sidecar's port on 127.0.0.1 (TCP only).
    pub sidecar_port: u16,
    /// The filter's configuration as the stack would pass it.
    pub filter_config: serde_json::Value,
    /// The filter module.
    pub wasm: PathBuf,
}

/// How Envoy reaches the sidecar.
#[derive(Debug, Clone)]
pub enum SidecarAddress {
    /// TCP on 127.0.0.1.
    Tcp(u16),
    /// A Unix socket (Envoy `pipe` address).
    Unix(PathBuf),
}

/// The EDS file of a stack in `dir` ([`StackOptions::eds_membership`]).
pub(super) fn eds_path(dir: &Path) -> PathBuf {
    dir.join("eds").join("workers.yaml")
}

pub(super) fn parse_upstreams(upstreams: &[String]) -> Result<Vec<std::net::SocketAddr>> {
    upstreams
        .iter()
        .map(|a| {
            a.parse()
                .with_context(|| format!("upstream {a} is not ip:port"))
        })
        .collect()
}

/// Write the EDS file of a stack in `dir` as a control plane's push: beside it, then renamed
/// over it (Envoy reloads on the move).
pub fn write_eds(dir: &Path, version: u64, upstreams: &[String]) -> Result<()> {
    let text =
        kvroute_sidecar::envoy_config::eds_file("workers", version, &parse_upstreams(upstreams)?);
    let path = eds_path(dir);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let staged = dir.join("eds.staged.yaml");
    std::fs::write(&staged, text)?;
    std::fs::rename(&staged, &path)?;
    Ok(())
}

/// The shipped Envoy configuration for `opts` (`deploy/envoy/kvroute.yaml`, `kvroute-maglev.yaml` or
/// `round-robin.yaml`), filled as `kvroute-sidecar envoy-config` fills it, or the bootstrap
/// [`StackOptions::envoy_bootstrap`] assembles.
pub fn render_envoy(
    opts: &StackOptions,
    dir: &Path,
    upstreams: &[String],
    listen: u16,
    admin: u16,
    sidecar: &SidecarAddress,
) -> Result<String> {
    let wasm = match &opts.filter_wasm {
        Some(path) => path.clone(),
        None => paths::filter_wasm()?,
    };
    let params = envoy_params(opts, dir, upstreams, (listen, admin), sidecar, wasm)?;
    if let Some(bootstrap) = opts.envoy_bootstrap {
        let (Workers::Listed(upstreams), SidecarAddress::Tcp(sidecar_port)) =
            (params.workers, sidecar)
        else {
            anyhow::bail!("an assembled bootstrap takes listed workers and a TCP sidecar");
        };
        return bootstrap(&EnvoyInputs {
            listen,
            admin,
            upstreams,
            sidecar_port: *sidecar_port,
            filter_config: params.filter_config,
            wasm: params.wasm,
        });
    }
    let mut text = envoy_config::render(template(opts).text(), &params)?;
    if opts.sidecar_http1 {
        text = sidecar_http1(&text)?;
    }
    if let Some(ms) = opts.envoy_stats_flush_ms {
        text += &format!("\nstats_flush_interval: {}s\n", ms as f64 / 1000.0);
    }
    with_ejection(text, opts.ejection_s)
}

/// `text` with the sidecar cluster's HTTP/2 options (the only ones in the shipped templates,
/// their keepalive on the next line) turned into HTTP/1.1's.
fn sidecar_http1(text: &str) -> Result<String> {
    let at = text
        .find("http2_protocol_options:")
        .context("no http2_protocol_options in the template")?;
    let end = text[at..]
        .find("}\n")
        .map(|e| at + e + 2)
        .context("http2_protocol_options ends in no one-line map")?;
    Ok(format!(
        "{}http_protocol_options: {{}}\n{}",
        &text[..at],
        &text[end..]
    ))
}

/// The shipped template for `opts`'s mode and fallback.
fn template(opts: &StackOptions) -> Template {
    match (opts.mode, opts.fallback) {
        (Mode::RoundRobin, _) => Template::RoundRobin,
        (_, Fallback::RingHash) => Template::Kvroute,
        (_, Fallback::Maglev) => Template::KvrouteMaglev,
    }
}

/// What the template is filled with: the ports, the engines (listed, or the EDS file), the
/// sidecar, and the filter's configuration (hints only in kvroute mode).
fn envoy_params(
    opts: &StackOptions,
    dir: &Path,
    upstreams: &[String],
    (listen, admin): (u16, u16),
    sidecar: &SidecarAddress,
    wasm: PathBuf,
) -> Result<EnvoyParams> {
    Ok(EnvoyParams {
        listen_port: listen,
        admin_port: admin,
        workers: match opts.eds_membership {
            true => Workers::EdsFile(eds_path(dir)),
            false => Workers::Listed(parse_upstreams(upstreams)?),
        },
        sidecar: match sidecar {
            SidecarAddress::Tcp(port) => {
                envoy_config::SidecarAddress::Tcp(([127, 0, 0, 1], *port).into())
            }
            SidecarAddress::Unix(path) => envoy_config::SidecarAddress::Unix(path.clone()),
        },
        filter_config: {
            let mut config = opts.filter_extra.clone();
            // Tests and benchmarks compare every hinted response with its prediction.
            config
                .entry("stream_usage_every")
                .or_insert_with(|| 1.into());
            config.insert("hints".into(), (opts.mode == Mode::Kvroute).into());
            config.insert("hint_timeout_ms".into(), opts.hint_timeout_ms.into());
            serde_json::Value::Object(config)
        },
        wasm,
        stream_idle_timeout: opts.stream_idle_timeout,
    })
}

/// The shipped configuration with outlier ejections lasting `seconds` instead of 30.
fn with_ejection(text: String, seconds: Option<u64>) -> Result<String> {
    const SHIPPED: &str = "base_ejection_time: 30s";
    let Some(s) = seconds else {
        return Ok(text);
    };
    anyhow::ensure!(
        text.contains(SHIPPED),
        "the Envoy config has no `{SHIPPED}`"
    );
    Ok(text.replace(SHIPPED, &format!("base_ejection_time: {s}s")))
}

/// Start Envoy on `config` as process `name`.
pub(super) fn spawn_envoy(
    opts: &StackOptions,
    config: &Path,
    dir: &Path,
    name: &str,
) -> Result<Process> {
    let mut envoy = Command::new(paths::venv_tool("envoy")?);
    envoy
        .arg("-c")
        .arg(config)
        .args(["--concurrency", &opts.envoy_concurrency.to_string()])
        .args(["--disable-hot-restart", "-l", "info"]);
    if let Some(ms) = opts.envoy_log_flush_ms {
        envoy.args(["--file-flush-interval-msec", &ms.to_string()]);
    }
    Process::spawn(name, envoy, dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(opts: &StackOptions, sidecar: &SidecarAddress) -> EnvoyParams {
        let upstreams = ["127.0.0.1:9000".to_owned(), "127.0.0.1:9001".to_owned()];
        let wasm = PathBuf::from("/m/kvroute_filter.wasm");
        envoy_params(
            opts,
            Path::new("/run"),
            &upstreams,
            (8000, 8001),
            sidecar,
            wasm,
        )
        .unwrap()
    }

    /// Hints only in kvroute mode; the stack's timeout; a test's own filter fields kept, the
    /// usage report of every response unless a test says otherwise.
    #[test]
    fn the_filter_hints_only_in_kvroute_mode() {
        let tcp = SidecarAddress::Tcp(7000);
        let mut opts = StackOptions::new("t", Mode::Kvroute);
        opts.hint_timeout_ms = 75;
        opts.filter_extra
            .insert("stream_usage_every".into(), 4.into());
        let config = params(&opts, &tcp).filter_config;
        assert_eq!(config["hints"], true);
        assert_eq!(config["hint_timeout_ms"], 75);
        assert_eq!(config["stream_usage_every"], 4);
        let ring = params(&StackOptions::new("t", Mode::RingHash), &tcp).filter_config;
        assert_eq!(ring["hints"], false);
        assert_eq!(ring["stream_usage_every"], 1);
    }

    /// Each mode and fallback has its shipped template; the rendered one carries the ports, both
    /// engines and the ejection time a test asked for.
    #[test]
    fn the_shipped_template_is_filled_for_the_stack() {
        let mut opts = StackOptions::new("t", Mode::RoundRobin);
        assert!(matches!(template(&opts), Template::RoundRobin));
        opts.mode = Mode::RingHash;
        assert!(matches!(template(&opts), Template::Kvroute));
        opts.fallback = Fallback::Maglev;
        assert!(matches!(template(&opts), Template::KvrouteMaglev));
        opts.fallback = Fallback::RingHash;
        let p = params(&opts, &SidecarAddress::Tcp(7000));
        let text = envoy_config::render(template(&opts).text(), &p).unwrap();
        for expected in ["8000", "8001", "9000", "9001", "7000"] {
            assert!(text.contains(expected), "{expected}:\n{text}");
        }
        let shorter = with_ejection(text.clone(), Some(2)).unwrap();
        assert!(shorter.contains("base_ejection_time: 2s"), "{shorter}");
        assert_eq!(with_ejection(text.clone(), None).unwrap(), text);
        assert!(with_ejection("no ejection".into(), Some(2)).is_err());
    }

    /// With EDS the cluster reads the stack's file; the file lists what it was given, under its
    /// version; an upstream that is no `ip:port` is refused.
    #[test]
    fn eds_members_are_written_as_a_control_plane_would() {
        let mut opts = StackOptions::new("t", Mode::Kvroute);
        opts.eds_membership = true;
        let p = params(&opts, &SidecarAddress::Tcp(7000));
        assert!(
            matches!(&p.workers, Workers::EdsFile(path) if path == &eds_path(Path::new("/run")))
        );
        let dir = std::env::temp_dir().join(format!("kvroute-stack-eds-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        write_eds(&dir, 3, &["127.0.0.1:9000".into()]).unwrap();
        let text = std::fs::read_to_string(eds_path(&dir)).unwrap();
        assert!(text.contains("version_info: \"3\""), "{text}");
        assert!(text.contains("port_value: 9000"), "{text}");
        assert!(!dir.join("eds.staged.yaml").exists(), "staged, then moved");
        assert!(write_eds(&dir, 4, &["engine-0:9000".into()]).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
