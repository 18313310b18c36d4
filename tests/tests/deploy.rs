//! What `deploy/` gives a mesh operator, checked without a cluster: every manifest against the
//! published schema of its kind, the sidecar configurations it mounts by the sidecar's own
//! parser, and the raw Envoy configuration inside the Istio and Envoy Gateway objects assembled
//! into a bootstrap the way each control plane applies it (istiod's EnvoyFilter patches and
//! ECDS; Envoy Gateway's translation of its policies and its JSON patches), then served through
//! by the real Envoy: the patched cluster routes by hint, falls back by hash, and a forged
//! routing header is stripped. What istiod and Envoy Gateway themselves do is written down in
//! `docs/deploy.md`; neither runs here.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context as _, Result};
use common::*;
use kvroute_harness::stack::EnvoyInputs;
use kvroute_harness::{paths, Mode, Stack, StackOptions};
use serde_json::{json, Value};

fn deploy() -> PathBuf {
    paths::workspace().join("deploy")
}

fn python() -> PathBuf {
    paths::venv_tool("python").unwrap()
}

/// The documents of a YAML file (or of YAML text with `-`), as JSON.
/// The documents of YAML text, as JSON (PyYAML, through the venv's Python: on stdin, so that
/// tests running at once share nothing).
fn yaml_text(text: &str) -> Result<Vec<Value>> {
    use std::io::Write as _;
    let mut child = Command::new(python())
        .args([
            "-c",
            "import sys, json, yaml; print(json.dumps([d for d in yaml.safe_load_all(sys.stdin) if d]))",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    child
        .stdin
        .take()
        .context("stdin")?
        .write_all(text.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!("{}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// The documents of a YAML file, as JSON.
fn yaml(file: &Path) -> Result<Vec<Value>> {
    yaml_text(&std::fs::read_to_string(file)?).with_context(|| file.display().to_string())
}

/// Every document of every file in `dir`.
fn documents(dir: &Path) -> Result<Vec<Value>> {
    let mut out = Vec::new();
    let mut files: Vec<_> = std::fs::read_dir(dir)?.collect::<Result<_, _>>()?;
    files.sort_by_key(|e| e.path());
    for f in files {
        let path = f.path();
        if path.extension().is_some_and(|e| e == "yaml") && !path.ends_with("kustomization.yaml") {
            out.extend(yaml(&path)?);
        }
    }
    Ok(out)
}

fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

fn validate(dir: &Path) -> (bool, String) {
    let out = Command::new(python())
        .arg(paths::workspace().join("tests/fixtures/validate_manifests.py"))
        .arg(dir)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[test]
fn every_manifest_validates_against_the_schema_of_its_kind() {
    let (ok, text) = validate(&deploy());
    assert!(ok, "{text}");
    let count: usize = text
        .lines()
        .find_map(|l| l.strip_prefix("OK ")?.split(' ').next()?.parse().ok())
        .unwrap();
    assert!(count >= 15, "{text}");
    // The check can fail: a misspelled field and a value its enum does not have.
    let dir = paths::run_dir("deploy-invalid").unwrap();
    for (file, from, to, says) in [
        (
            "istio/gateway/envoyfilter-wasm.yaml",
            "configPatches:",
            "configPatchs:",
            "'configPatchs' was unexpected",
        ),
        (
            "envoy-gateway/backendtrafficpolicy.yaml",
            "type: ConsistentHash",
            "type: Consistent",
            "is not one of",
        ),
    ] {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let text = std::fs::read_to_string(deploy().join(file)).unwrap();
        assert!(text.contains(from), "{file}");
        std::fs::write(dir.join("x.yaml"), text.replacen(from, to, 1)).unwrap();
        let (ok, out) = validate(&dir);
        assert!(!ok && out.contains(says), "{file}: {out}");
    }
}

/// The sidecar configuration each way in mounts loads in the sidecar, and names the cluster
/// that way's control plane builds for the engines.
#[test]
fn the_mounted_sidecar_configurations_load() {
    for (dir, cluster) in [
        ("istio/gateway", "outbound|8000||vllm.llm.svc.cluster.local"),
        ("istio/sidecar", "outbound|8000||vllm.llm.svc.cluster.local"),
        ("envoy-gateway", "httproute/llm/llm/rule/0"),
    ] {
        let docs = documents(&deploy().join(dir)).unwrap();
        let maps = of_kind(&docs, "ConfigMap");
        let toml = maps
            .iter()
            .find_map(|m| m["data"]["sidecar.toml"].as_str())
            .unwrap_or_else(|| panic!("{dir}: no sidecar.toml"));
        let config: kvroute_sidecar::config::Config =
            toml::from_str(toml).unwrap_or_else(|e| panic!("{dir}: {e}"));
        let envoy = config.envoy.as_ref().expect("[envoy]");
        assert_eq!(envoy.cluster, cluster, "{dir}");
        assert_eq!(envoy.members.len(), 1, "{dir}");
        assert_eq!(config.listen.to_string(), "127.0.0.1:9100", "{dir}");
    }
}

/// Protobuf's merge, as istiod's EnvoyFilter MERGE applies it: maps merged, lists appended,
/// anything else replaced.
fn proto_merge(into: &mut Value, from: &Value) {
    match (into, from) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in b {
                match a.get_mut(k) {
                    Some(old) => proto_merge(old, v),
                    None => {
                        a.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (Value::Array(a), Value::Array(b)) => a.extend(b.iter().cloned()),
        (into, from) => *into = from.clone(),
    }
}

fn endpoints(upstreams: &[std::net::SocketAddr]) -> Value {
    let lb: Vec<Value> = upstreams
        .iter()
        .map(|a| {
            json!({"endpoint": {"address": {"socket_address": {
                "address": a.ip().to_string(), "port_value": a.port()}}}})
        })
        .collect();
    json!({"endpoints": [{"lb_endpoints": lb}]})
}

/// The engines' cluster `name` as a control plane builds it for the stack's engines, with the
/// control plane's own fields (`fields`) and outlier detection from a manifest's `outlier`
/// (whose keys `keys` names: consecutive 5xx, interval, base ejection time, max ejection %).
fn engines_cluster(
    name: &str,
    inputs: &EnvoyInputs,
    fields: Value,
    outlier: &Value,
    keys: [&str; 4],
) -> Value {
    let mut cluster = json!({
        "name": name,
        "type": "STATIC",
        "connect_timeout": "10s",
        "outlier_detection": {
            "consecutive_5xx": outlier[keys[0]],
            "interval": outlier[keys[1]],
            "base_ejection_time": outlier[keys[2]],
            "max_ejection_percent": outlier[keys[3]],
        },
        "load_assignment": endpoints(&inputs.upstreams),
    });
    cluster["load_assignment"]["cluster_name"] = name.into();
    proto_merge(&mut cluster, &fields);
    cluster
}

/// The sidecar cluster a manifest adds, pointed at the port the stack's sidecar listens on.
fn at_sidecar(mut cluster: Value, port: u16) -> Value {
    let address = &mut cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
        ["address"]["socket_address"];
    assert_eq!(
        address["port_value"], 9100,
        "the manifests put the sidecar on 9100"
    );
    address["port_value"] = port.into();
    cluster
}

/// The filter's configuration as a manifest writes it, under the test's (hints, timeouts).
fn filter_config(manifest: &Value, test: &Value) -> Value {
    let mut config = manifest.clone();
    proto_merge(&mut config, test);
    config
}

fn listener(port: u16, vhost: &str, http_filters: Vec<Value>, route: Value) -> Value {
    json!({
        "name": "gateway",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "default_filter_chain": {"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": "gateway",
                "route_config": {"name": "gateway", "virtual_hosts": [{
                    "name": vhost, "domains": ["*"], "routes": [route]}]},
                "http_filters": http_filters,
            }
        }]}
    })
}

fn router() -> Value {
    json!({"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}})
}

fn bootstrap(admin: u16, listener: Value, clusters: Vec<Value>) -> String {
    json!({
        "node": {"id": "gateway", "cluster": "gateway"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {"listeners": [listener], "clusters": clusters},
    })
    .to_string()
}

/// Where an Istio variant attaches: its folder, the proxies it selects, the patches' context,
/// and the listener and virtual host istiod names for the engines' Service there.
struct IstioVariant {
    dir: &'static str,
    selector: (&'static str, &'static str),
    context: &'static str,
    listener_port: u16,
    vhost: &'static str,
}

const ISTIO_GATEWAY: IstioVariant = IstioVariant {
    dir: "istio/gateway",
    selector: ("gateway.networking.k8s.io/gateway-name", "llm-gateway"),
    context: "GATEWAY",
    listener_port: 80,
    vhost: "llm",
};

const ISTIO_SIDECAR: IstioVariant = IstioVariant {
    dir: "istio/sidecar",
    selector: ("app", "llm-client"),
    context: "SIDECAR_OUTBOUND",
    listener_port: 8000,
    vhost: "vllm.llm.svc.cluster.local:8000",
};

fn istio_gateway(inputs: &EnvoyInputs) -> Result<String> {
    istio(inputs, &ISTIO_GATEWAY)
}

fn istio_sidecar(inputs: &EnvoyInputs) -> Result<String> {
    istio(inputs, &ISTIO_SIDECAR)
}

/// What istiod and its agent make of an Istio variant of `deploy/` on the proxy it selects, for
/// a Service `vllm.llm` on 8000 whose endpoints are the stack's engines.
fn istio(inputs: &EnvoyInputs, variant: &IstioVariant) -> Result<String> {
    let docs = documents(&deploy().join(variant.dir))?;
    let name = "outbound|8000||vllm.llm.svc.cluster.local";
    // The cluster istiod builds for the Service (trimmed to what bears on routing), with the
    // DestinationRule's outlier detection.
    let dr = &of_kind(&docs, "DestinationRule")[0]["spec"]["trafficPolicy"]["outlierDetection"];
    let fields = json!({
        "lb_policy": "LEAST_REQUEST",
        "common_lb_config": {},
        "circuit_breakers": {"thresholds": [{"max_connections": 4294967295u64,
            "max_pending_requests": 4294967295u64, "max_requests": 4294967295u64,
            "max_retries": 4294967295u64}]},
    });
    let keys = [
        "consecutive5xxErrors",
        "interval",
        "baseEjectionTime",
        "maxEjectionPercent",
    ];
    let mut engines = engines_cluster(name, inputs, fields, dr, keys);
    // The route istiod builds: the HTTPRoute's timeout (a Service's default route: none),
    // Istio's default retries.
    let timeout = of_kind(&docs, "HTTPRoute")
        .first()
        .map_or(json!("0s"), |r| {
            r["spec"]["rules"][0]["timeouts"]["request"].clone()
        });
    let mut route = json!({
        "match": {"prefix": "/"},
        "route": {
            "cluster": name,
            "timeout": timeout,
            "retry_policy": {
                "retry_on": "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes",
                "num_retries": 2,
                "retriable_status_codes": [503],
                "retry_host_predicate": [{"name": "envoy.retry_host_predicates.previous_hosts",
                    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"}}],
                "host_selection_retry_max_attempts": 5,
            },
        },
    });
    let mut clusters = Vec::new();
    let mut extensions = std::collections::BTreeMap::new();
    let mut before_router = Vec::new();
    for filter in of_kind(&docs, "EnvoyFilter") {
        let selector = &filter["spec"]["workloadSelector"]["labels"];
        assert_eq!(selector[variant.selector.0], variant.selector.1, "{filter}");
        for p in filter["spec"]["configPatches"]
            .as_array()
            .context("configPatches")?
        {
            let (apply, op, value) = (
                p["applyTo"].as_str().unwrap_or(""),
                p["patch"]["operation"].as_str().unwrap_or(""),
                &p["patch"]["value"],
            );
            let m = &p["match"];
            if apply != "EXTENSION_CONFIG" {
                assert_eq!(m["context"], variant.context, "{p}");
            }
            // A patch for another listener or virtual host is not applied here.
            let port = m["listener"]["portNumber"]
                .as_u64()
                .or(m["routeConfiguration"]["portNumber"].as_u64());
            let vhost = m["routeConfiguration"]["vhost"]["name"].as_str();
            if port.is_some_and(|p| p != u64::from(variant.listener_port))
                || vhost.is_some_and(|v| v != variant.vhost)
            {
                continue;
            }
            match (apply, op) {
                ("CLUSTER", "ADD") => {
                    clusters.push(at_sidecar(value.clone(), inputs.sidecar_port));
                }
                ("CLUSTER", "MERGE") => {
                    let m = &p["match"]["cluster"];
                    if m["service"] == "vllm.llm.svc.cluster.local" && m["portNumber"] == 8000 {
                        proto_merge(&mut engines, value);
                    }
                }
                ("HTTP_ROUTE", "MERGE") => proto_merge(&mut route, value),
                ("EXTENSION_CONFIG", "ADD") => {
                    extensions.insert(value["name"].as_str().unwrap().to_owned(), value.clone());
                }
                ("HTTP_FILTER", "INSERT_BEFORE") => {
                    let sub = &p["match"]["listener"]["filterChain"]["filter"]["subFilter"];
                    assert_eq!(sub["name"], "envoy.filters.http.router");
                    before_router.push(value.clone());
                }
                other => bail!("a patch this test does not apply: {other:?}"),
            }
        }
    }
    // ECDS: a filter that names an extension config gets its typed_config; the agent has
    // fetched the module to a local file.
    let mut filters = Vec::new();
    for f in before_router {
        let name = f["name"].as_str().unwrap_or("").to_owned();
        if f.get("config_discovery").is_some() {
            let mut ext = extensions
                .remove(&name)
                .context("an ECDS name with no config")?;
            let config = &mut ext["typed_config"]["config"];
            config["vm_config"]["code"] = json!({"local": {"filename": inputs.wasm}});
            let manifest: Value =
                serde_json::from_str(config["configuration"]["value"].as_str().unwrap())?;
            config["configuration"]["value"] = filter_config(&manifest, &inputs.filter_config)
                .to_string()
                .into();
            filters.push(json!({"name": name, "typed_config": ext["typed_config"]}));
        } else {
            filters.push(f);
        }
    }
    filters.push(router());
    clusters.push(engines);
    Ok(bootstrap(
        inputs.admin,
        listener(inputs.listen, variant.vhost, filters, route),
        clusters,
    ))
}

/// What Envoy Gateway makes of `deploy/envoy-gateway` for the llm route on the stack's
/// engines: its translation of the BackendTrafficPolicy and EnvoyExtensionPolicy, the
/// EnvoyProxy's bootstrap merge, then the EnvoyPatchPolicy's JSON patches.
fn envoy_gateway(inputs: &EnvoyInputs) -> Result<String> {
    let docs = documents(&deploy().join("envoy-gateway"))?;
    let name = "httproute/llm/llm/rule/0";
    let btp = &of_kind(&docs, "BackendTrafficPolicy")[0]["spec"];
    let lb = &btp["loadBalancer"];
    assert_eq!(lb["type"], "ConsistentHash");
    let sources: Vec<Value> = lb["endpointOverride"]["extractFrom"]
        .as_array()
        .context("extractFrom")?
        .iter()
        .map(|s| json!({"header": s["header"]}))
        .collect();
    let passive = &btp["healthCheck"]["passive"];
    let fields = json!({
        "lb_policy": "CLUSTER_PROVIDED",
        "load_balancing_policy": {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.override_host",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                "override_host_sources": sources,
                "fallback_policy": {"policies": [{"typed_extension_config": {
                    "name": "envoy.load_balancing_policies.maglev",
                    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.maglev.v3.Maglev"}}}]},
            }}}]},
    });
    let keys = [
        "consecutive5XxErrors",
        "interval",
        "baseEjectionTime",
        "maxEjectionPercent",
    ];
    let engines = engines_cluster(name, inputs, fields, passive, keys);
    let retry = &btp["retry"];
    let mut retry_on: Vec<String> = retry["retryOn"]["triggers"]
        .as_array()
        .context("triggers")?
        .iter()
        .filter_map(|t| t.as_str().map(str::to_owned))
        .collect();
    retry_on.push("retriable-status-codes".into());
    let route = json!({
        "match": {"prefix": "/"},
        "route": {
            "cluster": name,
            "timeout": of_kind(&docs, "HTTPRoute")[0]["spec"]["rules"][0]["timeouts"]["request"],
            "hash_policy": [{"header": {"header_name": lb["consistentHash"]["header"]["name"]}}],
            "retry_policy": {
                "retry_on": retry_on.join(","),
                "num_retries": retry["numRetries"],
                "retriable_status_codes": retry["retryOn"]["httpStatusCodes"],
            },
        },
    });
    // The wasm filter as Envoy Gateway writes it (its controller serves the module).
    let eep = &of_kind(&docs, "EnvoyExtensionPolicy")[0]["spec"]["wasm"][0];
    let filter_name = "envoy.filters.http.wasm/envoyextensionpolicy/llm/kvroute/wasm/0";
    let wasm = json!({"name": filter_name, "typed_config": {
    "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
    "config": {
        "name": eep["name"],
        "root_id": eep["rootID"],
        "vm_config": {"vm_id": eep["name"], "runtime": "envoy.wasm.runtime.v8",
            "code": {"local": {"filename": inputs.wasm}}},
        "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue",
            "value": filter_config(&eep["config"], &inputs.filter_config).to_string()},
        "fail_open": eep["failOpen"].as_bool().unwrap_or(false),
    }}});
    let mut listener = listener(inputs.listen, "llm", vec![wasm, router()], route);
    for patch in of_kind(&docs, "EnvoyPatchPolicy")[0]["spec"]["jsonPatches"]
        .as_array()
        .context("jsonPatches")?
    {
        assert_eq!(patch["name"], "llm/llm-gateway/http");
        let op = &patch["operation"];
        assert_eq!(op["op"], "add");
        match op["jsonPath"].as_str() {
            // `..http_filters[?match(@.name, 'NAME')].typed_config.config`, then `path`.
            Some(path) => {
                let wanted = path.split('\'').nth(1).context("a filter name")?;
                assert!(path.ends_with("].typed_config.config"), "{path}");
                let filters = listener
                    .pointer_mut("/default_filter_chain/filters/0/typed_config/http_filters")
                    .and_then(Value::as_array_mut)
                    .context("http_filters")?;
                let f = filters
                    .iter_mut()
                    .find(|f| f["name"] == wanted)
                    .with_context(|| format!("no filter {wanted}"))?;
                let field = op["path"].as_str().context("path")?;
                f["typed_config"]["config"][field] = op["value"].clone();
            }
            // A JSON pointer whose last token is an array index: insert there.
            None => {
                let pointer = op["path"].as_str().context("path")?;
                let (parent, index) = pointer.rsplit_once('/').context("a pointer")?;
                let list = listener
                    .pointer_mut(parent)
                    .and_then(Value::as_array_mut)
                    .with_context(|| format!("{parent} is no list"))?;
                list.insert(index.parse()?, op["value"].clone());
            }
        }
    }
    // The EnvoyProxy's bootstrap merge adds the sidecar cluster.
    let envoy_proxy = &of_kind(&docs, "EnvoyProxy")[0]["spec"]["bootstrap"];
    assert_eq!(envoy_proxy["type"], "Merge");
    let merged = yaml_text(envoy_proxy["value"].as_str().context("value")?)?
        .into_iter()
        .next()
        .context("an empty bootstrap merge")?;
    let mut clusters: Vec<Value> = merged["static_resources"]["clusters"]
        .as_array()
        .context("clusters")?
        .iter()
        .map(|c| at_sidecar(c.clone(), inputs.sidecar_port))
        .collect();
    clusters.push(engines);
    Ok(bootstrap(inputs.admin, listener, clusters))
}

/// In both assembled gateways the header strip comes before the filter and removes every
/// header a client could route by (the filter strips them too, but not when its VM is down).
#[test]
fn the_header_strip_runs_first_and_covers_every_routing_header() {
    use kvroute_protocol::headers;
    let mut wanted: Vec<String> = [
        headers::WORKER,
        headers::KEY,
        headers::INSTANCE,
        headers::PREFILL_INSTANCE,
    ]
    .iter()
    .chain(headers::DYNAMO_ROUTING.iter())
    .map(|h| h.to_string())
    .collect();
    wanted.sort();
    let inputs = EnvoyInputs {
        listen: 1,
        admin: 2,
        upstreams: vec!["127.0.0.1:8000".parse().unwrap()],
        sidecar_port: 3,
        filter_config: json!({}),
        wasm: "f.wasm".into(),
    };
    for (name, build) in [
        (
            "istio",
            istio_gateway as kvroute_harness::stack::BootstrapFn,
        ),
        ("envoy-gateway", envoy_gateway),
    ] {
        let config: Value = serde_json::from_str(&build(&inputs).unwrap()).unwrap();
        let filters = config
            .pointer("/static_resources/listeners/0/default_filter_chain/filters/0/typed_config/http_filters")
            .and_then(Value::as_array)
            .unwrap();
        let kinds: Vec<&str> = filters
            .iter()
            .map(|f| f["typed_config"]["@type"].as_str().unwrap_or(""))
            .collect();
        let strip = kinds.iter().position(|k| k.ends_with("HeaderMutation"));
        let wasm = kinds.iter().position(|k| k.ends_with("wasm.v3.Wasm"));
        assert!(strip.is_some() && strip < wasm, "{name}: {kinds:?}");
        let mut removed: Vec<String> = filters[strip.unwrap()]["typed_config"]["mutations"]
            ["request_mutations"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|m| m["remove"].as_str().map(str::to_owned))
            .collect();
        removed.sort();
        assert_eq!(removed, wanted, "{name}");
    }
}

/// Through a gateway assembled from `deploy/`: a prompt an engine holds goes there; with the
/// sidecar gone, one prefix goes to one engine (the hash fallback) and a forged hint is
/// stripped before anything reads it.
async fn serves_as_kvroute_does(
    name: &str,
    bootstrap: kvroute_harness::stack::BootstrapFn,
    cluster: &str,
) {
    let mut opts = StackOptions::new(name, Mode::Kvroute);
    opts.envoy_bootstrap = Some(bootstrap);
    opts.workers_cluster = cluster.into();
    let mut stack = Stack::start(opts).await.expect("stack starts");
    // Hinted: the engine holding the prompt serves it.
    for (engine, seed) in [(1, 4100), (3, 4110)] {
        let system = text(seed, 200);
        let warmed = direct(&stack, engine, &chat(&system, "first")).await;
        wait_indexed(&stack, engine, (warmed.prompt_tokens / 16) as f64).await;
        let o = via_envoy(&stack, &chat(&system, "second")).await;
        assert_eq!(
            served_by(&o),
            engine,
            "{name}: hinted to the engine holding it"
        );
    }
    // No sidecar: every request unhinted, its prefix key hashed.
    stack.kill("sidecar");
    let mut homes = std::collections::BTreeSet::new();
    for seed in 0..6u64 {
        let system = text(4200 + seed * 10, 120);
        let first = served_by(&via_envoy(&stack, &chat(&system, "a")).await);
        for user in ["b", "c"] {
            let again = served_by(&via_envoy(&stack, &chat(&system, user)).await);
            assert_eq!(again, first, "{name}: one prefix, one engine, by its key");
        }
        homes.insert(first);
        // A client naming another engine in the routing header is not heard.
        let other = (first + 1) % stack.engines.len();
        let forged = post_with(
            &stack.envoy_url,
            &chat(&system, "d"),
            &[("x-kvroute-worker", stack.engines[other].address.clone())],
        )
        .await;
        assert_eq!(
            served_by(&forged),
            first,
            "{name}: the forged header was stripped"
        );
    }
    assert!(
        homes.len() > 1,
        "{name}: prefixes spread over engines: {homes:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_istio_gateway_from_deploy_routes_by_hint_and_falls_back_by_hash() {
    serves_as_kvroute_does(
        "deploy-istio",
        istio_gateway,
        "outbound|8000||vllm.llm.svc.cluster.local",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_istio_sidecar_proxy_from_deploy_routes_by_hint_and_falls_back_by_hash() {
    serves_as_kvroute_does(
        "deploy-istio-sidecar",
        istio_sidecar,
        "outbound|8000||vllm.llm.svc.cluster.local",
    )
    .await;
}

/// The sidecar-proxy variant is the gateway's, attached elsewhere: an edit to one must reach
/// the other.
#[test]
fn the_istio_sidecar_variant_differs_only_where_it_attaches() {
    let same = |doc: &Value| {
        let mut doc = doc.clone();
        doc["spec"]["workloadSelector"] = Value::Null;
        if let Some(patches) = doc["spec"]["configPatches"].as_array_mut() {
            for p in patches {
                let m = &mut p["match"];
                if m.get("context").is_some() {
                    m["context"] = "X".into();
                }
                for at in ["listener", "routeConfiguration"] {
                    if let Some(o) = m[at].as_object_mut() {
                        o.remove("portNumber");
                    }
                }
                if let Some(v) = m["routeConfiguration"]["vhost"].as_object_mut() {
                    v.remove("name");
                }
            }
        }
        doc
    };
    let gateway = documents(&deploy().join("istio/gateway")).unwrap();
    let sidecar = documents(&deploy().join("istio/sidecar")).unwrap();
    for kind in ["EnvoyFilter", "DestinationRule"] {
        let (g, s) = (of_kind(&gateway, kind), of_kind(&sidecar, kind));
        assert_eq!(g.len(), s.len(), "{kind}");
        for (g, s) in g.iter().zip(&s) {
            assert_eq!(same(g), same(s), "{kind} {}", g["metadata"]["name"]);
        }
    }
    let toml = |docs: &[Value]| {
        of_kind(docs, "ConfigMap")
            .iter()
            .find_map(|m| m["data"]["sidecar.toml"].as_str().map(str::to_owned))
            .unwrap()
            .lines()
            .filter(|l| !l.trim_start().starts_with('#'))
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(toml(&gateway), toml(&sidecar));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_envoy_gateway_from_deploy_routes_by_hint_and_falls_back_by_hash() {
    serves_as_kvroute_does(
        "deploy-envoy-gateway",
        envoy_gateway,
        "httproute/llm/llm/rule/0",
    )
    .await;
}
