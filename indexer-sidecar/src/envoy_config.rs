//! The shipped Envoy configurations (`deploy/envoy/*.yaml`, built into the binary) and the one function
//! that fills their placeholders: `kvroute-sidecar envoy-config` prints a configuration that runs
//! as it is, and the test harness renders its fleets' configurations with the same code.
//!
//! Placeholders (`${NAME}` in the templates):
//! - `LISTEN_PORT`, `ADMIN_PORT`: Envoy's listener and admin ports on 127.0.0.1;
//! - `WORKERS_TYPE`, `WORKERS_SOURCE`: where the `workers` cluster's endpoints (engines, or
//!   Dynamo frontends in pin mode) come from: listed (`STATIC`, a `load_assignment`), or an EDS
//!   file Envoy watches (`EDS`, filesystem xDS: what a control plane pushes, see [`eds_file`]);
//! - `SIDECAR_ADDRESS`: the sidecar's address (`socket_address` or `pipe`);
//! - `FILTER_CONFIG`: the filter's JSON configuration (`filter/src/config.rs`);
//! - `WASM_PATH`: the filter module (`kvroute_filter.wasm`);
//! - `STREAM_IDLE_TIMEOUT`: how long a stream may carry no byte (default 300 s);
//! - `WORKER_HEADER`, `KEY_HEADER`: the headers `override_host` and the hash policy read, and
//!   `STRIPPED_HEADERS`: the `remove:` lines that drop every routing header a client sent — all
//!   three from the filter configuration's header names (defaults: `kvroute_protocol::headers`),
//!   so the filter, the router and the stripping cannot disagree.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{bail, Context as _};
use kvroute_protocol::headers;

/// A shipped template.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Template {
    /// `deploy/envoy/kvroute.yaml`: hints, ring-hash fallback.
    Kvroute,
    /// `deploy/envoy/kvroute-maglev.yaml`: hints, maglev fallback.
    KvrouteMaglev,
    /// `deploy/envoy/round-robin.yaml`: the baseline without kvroute.
    RoundRobin,
}

impl Template {
    /// The template text.
    pub fn text(self) -> &'static str {
        match self {
            Template::Kvroute => include_str!("../../deploy/envoy/kvroute.yaml"),
            Template::KvrouteMaglev => include_str!("../../deploy/envoy/kvroute-maglev.yaml"),
            Template::RoundRobin => include_str!("../../deploy/envoy/round-robin.yaml"),
        }
    }
}

/// How Envoy reaches the sidecar.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SidecarAddress {
    /// TCP.
    Tcp(SocketAddr),
    /// A Unix socket (the sidecar's `unix_socket`).
    Unix(PathBuf),
}

/// Where the `workers` cluster's endpoints come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Workers {
    /// Listed in the configuration: `ip:port` of each engine (or Dynamo frontend).
    Listed(Vec<SocketAddr>),
    /// An EDS file (a `DiscoveryResponse`, [`eds_file`]) that Envoy reloads whenever a new
    /// version is moved into place, as a control plane would push it.
    EdsFile(PathBuf),
}

/// The text of an EDS file listing `endpoints` for `cluster`: write it beside the watched path
/// and rename it over it (Envoy reloads on the move, never reads half a file).
pub fn eds_file(cluster: &str, version: u64, endpoints: &[SocketAddr]) -> String {
    let mut out = format!(
        "version_info: \"{version}\"\nresources:\n- \"@type\": type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment\n  cluster_name: {cluster}\n  endpoints:\n  - lb_endpoints:\n"
    );
    for a in endpoints {
        out.push_str(&format!(
            "    - endpoint: {{ address: {{ socket_address: {{ address: {}, port_value: {} }} }} }}\n",
            a.ip(),
            a.port()
        ));
    }
    out
}

/// Everything a template needs.
#[derive(Debug, Clone)]
pub struct EnvoyParams {
    /// Envoy's listener port.
    pub listen_port: u16,
    /// Envoy's admin port.
    pub admin_port: u16,
    /// The `workers` cluster's endpoints.
    pub workers: Workers,
    /// The sidecar.
    pub sidecar: SidecarAddress,
    /// The filter's configuration (JSON object).
    pub filter_config: serde_json::Value,
    /// The filter's wasm module.
    pub wasm: PathBuf,
    /// How long a stream may carry no byte before Envoy ends it.
    pub stream_idle_timeout: std::time::Duration,
}

/// Envoy's own default stream idle timeout, made explicit.
pub const STREAM_IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

/// Fill `template`'s placeholders; fails if one is left.
pub fn render(template: &str, p: &EnvoyParams) -> anyhow::Result<String> {
    let (workers_type, workers_source) = match &p.workers {
        Workers::Listed(list) if list.is_empty() => {
            bail!("the workers cluster needs at least one endpoint")
        }
        Workers::Listed(list) => {
            let endpoints: Vec<String> = list
                .iter()
                .map(|a| {
                    format!(
                        "        - endpoint: {{ address: {{ socket_address: {{ address: {}, port_value: {} }} }} }}",
                        a.ip(),
                        a.port()
                    )
                })
                .collect();
            let block = format!(
                "    load_assignment:\n      cluster_name: workers\n      endpoints:\n      - lb_endpoints:\n{}",
                endpoints.join("\n")
            );
            ("STATIC", block)
        }
        Workers::EdsFile(path) => {
            let (Some(dir), Some(_)) = (path.parent(), path.file_name()) else {
                bail!("EDS file {} has no directory", path.display());
            };
            let block = format!(
                "    eds_cluster_config:\n      eds_config:\n        resource_api_version: V3\n        # Reloaded when a new file is moved into place (a rename, never a write in place).\n        path_config_source: {{ path: {}, watched_directory: {{ path: {} }} }}",
                path.display(),
                dir.display()
            );
            ("EDS", block)
        }
    };
    if p.stream_idle_timeout.as_millis() == 0 {
        bail!("the stream idle timeout must be positive (0 is no timeout in Envoy)");
    }
    if !p.filter_config.is_object() {
        bail!("the filter configuration must be a JSON object");
    }
    let sidecar = match &p.sidecar {
        SidecarAddress::Tcp(a) => format!(
            "{{ socket_address: {{ address: {}, port_value: {} }} }}",
            a.ip(),
            a.port()
        ),
        SidecarAddress::Unix(path) => format!("{{ pipe: {{ path: {} }} }}", path.display()),
    };
    // The filter configuration sits in single quotes in YAML: a quote inside is doubled.
    let header = |field: &str, default: &'static str| -> String {
        p.filter_config
            .get(field)
            .and_then(serde_json::Value::as_str)
            .unwrap_or(default)
            .to_owned()
    };
    let worker_header = header("worker_header", headers::WORKER);
    let key_header = header("key_header", headers::KEY);
    let mut stripped = vec![
        worker_header.clone(),
        key_header.clone(),
        header("instance_header", headers::INSTANCE),
        header("prefill_instance_header", headers::PREFILL_INSTANCE),
    ];
    stripped.extend(headers::DYNAMO_ROUTING.map(String::from));
    let mut seen = std::collections::HashSet::new();
    stripped.retain(|h| seen.insert(h.clone()));
    for name in &stripped {
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
            bail!("header name {name:?} in the filter configuration is not a plain header name");
        }
    }
    let stripped: Vec<String> = stripped
        .iter()
        .map(|h| format!("                - remove: {h}"))
        .collect();
    let filter_config = p.filter_config.to_string().replace('\'', "''");
    let out = template
        .replace("${ADMIN_PORT}", &p.admin_port.to_string())
        .replace("${LISTEN_PORT}", &p.listen_port.to_string())
        .replace("${SIDECAR_ADDRESS}", &sidecar)
        .replace("${WORKERS_TYPE}", workers_type)
        .replace("${WORKERS_SOURCE}", &workers_source)
        .replace("${FILTER_CONFIG}", &filter_config)
        .replace("${WASM_PATH}", &p.wasm.display().to_string())
        .replace(
            "${STREAM_IDLE_TIMEOUT}",
            &format!("{}s", p.stream_idle_timeout.as_secs_f64()),
        )
        .replace("${WORKER_HEADER}", &worker_header)
        .replace("${KEY_HEADER}", &key_header)
        .replace("${STRIPPED_HEADERS}", &stripped.join("\n"));
    if let Some(at) = out.find("${") {
        let name: String = out[at..].chars().take_while(|c| *c != '}').collect();
        bail!("the template has a placeholder this version does not fill: {name}}}");
    }
    Ok(out)
}

/// Parse `ip:port,ip:port,…`.
pub fn parse_workers(list: &str) -> anyhow::Result<Vec<SocketAddr>> {
    list.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse()
                .with_context(|| format!("worker {s:?} is not ip:port"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> EnvoyParams {
        EnvoyParams {
            listen_port: 10000,
            admin_port: 9901,
            workers: Workers::Listed(parse_workers("127.0.0.1:8001, 10.0.0.7:8000").unwrap()),
            sidecar: SidecarAddress::Tcp("127.0.0.1:9100".parse().unwrap()),
            filter_config: serde_json::json!({"hint_timeout_ms": 50, "x": "it's"}),
            wasm: "/opt/kvroute/kvroute_filter.wasm".into(),
            stream_idle_timeout: STREAM_IDLE_TIMEOUT,
        }
    }

    /// The filter's header names are the ones the router reads and the stripping drops.
    #[test]
    fn header_names_come_from_the_filter_configuration() {
        let p = EnvoyParams {
            filter_config: serde_json::json!({"worker_header": "x-my-worker", "key_header": "x-my-key"}),
            ..params()
        };
        let yaml = render(Template::Kvroute.text(), &p).unwrap();
        assert!(yaml.contains("- header: x-my-worker"), "{yaml}");
        assert!(yaml.contains("header_name: x-my-key"), "{yaml}");
        for h in [
            "x-my-worker",
            "x-my-key",
            headers::INSTANCE,
            headers::PREFILL_INSTANCE,
            "x-dp-rank",
        ] {
            assert!(yaml.contains(&format!("- remove: {h}\n")), "{h}: {yaml}");
        }
        assert!(
            yaml.lines()
                .filter(|l| !l.trim_start().starts_with('#'))
                .all(|l| !l.contains(headers::WORKER)),
            "only comments name the default: {yaml}"
        );
        let bad = EnvoyParams {
            filter_config: serde_json::json!({"worker_header": "x: y"}),
            ..params()
        };
        assert!(render(Template::Kvroute.text(), &bad).is_err());
    }

    #[test]
    fn every_shipped_template_renders_completely() {
        for t in [
            Template::Kvroute,
            Template::KvrouteMaglev,
            Template::RoundRobin,
        ] {
            let yaml = render(t.text(), &params()).unwrap();
            assert!(!yaml.contains("${"), "{t:?}");
            assert!(yaml.contains("port_value: 10000"), "{t:?}");
            assert!(
                yaml.contains("address: 10.0.0.7, port_value: 8000"),
                "{t:?}"
            );
            if t != Template::RoundRobin {
                assert!(yaml.contains("/opt/kvroute/kvroute_filter.wasm"), "{t:?}");
                assert!(yaml.contains("stream_idle_timeout: 300s"), "{t:?}");
                assert!(
                    yaml.contains(r#"'{"hint_timeout_ms":50,"x":"it''s"}'"#),
                    "{t:?}"
                );
            }
        }
        let mut uds = params();
        uds.sidecar = SidecarAddress::Unix("/run/kvroute.sock".into());
        assert!(render(Template::Kvroute.text(), &uds)
            .unwrap()
            .contains("{ pipe: { path: /run/kvroute.sock } }"));
    }

    #[test]
    fn workers_from_an_eds_file() {
        let mut p = params();
        p.workers = Workers::EdsFile("/run/kvroute/eds/workers.yaml".into());
        for t in [
            Template::Kvroute,
            Template::KvrouteMaglev,
            Template::RoundRobin,
        ] {
            let yaml = render(t.text(), &p).unwrap();
            assert!(yaml.contains("type: EDS"), "{t:?}");
            assert!(!yaml.contains("cluster_name: workers"), "{t:?}");
            assert!(
                yaml.contains("path_config_source: { path: /run/kvroute/eds/workers.yaml, watched_directory: { path: /run/kvroute/eds } }"),
                "{t:?}"
            );
        }
        let eds = eds_file("workers", 3, &parse_workers("10.0.0.7:8000").unwrap());
        assert!(eds.starts_with("version_info: \"3\"\n"), "{eds}");
        assert!(eds.contains("cluster_name: workers"), "{eds}");
        assert!(eds.contains("address: 10.0.0.7, port_value: 8000"), "{eds}");
    }

    #[test]
    fn refuses_what_cannot_run() {
        let mut none = params();
        none.workers = Workers::Listed(Vec::new());
        assert!(render(Template::Kvroute.text(), &none).is_err());
        let mut forever = params();
        forever.stream_idle_timeout = std::time::Duration::ZERO;
        assert!(render(Template::Kvroute.text(), &forever).is_err());
        let err = render("a: ${NEW_THING}", &params()).unwrap_err();
        assert!(err.to_string().contains("${NEW_THING}"), "{err}");
        assert!(parse_workers("localhost:80").is_err());
    }
}
