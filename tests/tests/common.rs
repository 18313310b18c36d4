//! Helpers shared by the end-to-end tests.

#![allow(dead_code)]

use std::time::Duration;

use kvroute_harness::client::{send_streaming, Outcome};
use kvroute_harness::process::wait_for;
use kvroute_harness::stack::MODEL;
use kvroute_harness::workload::{words, Rng};
use kvroute_harness::Stack;
use serde_json::{json, Value};

/// `n` deterministic words from `seed` (all in the demo tokenizer's vocabulary).
pub fn text(seed: u64, n: usize) -> String {
    words(&mut Rng::new(seed), n)
}

/// A chat request body.
pub fn chat(system: &str, user: &str) -> Value {
    json!({"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": user}
    ]})
}

/// Send through Envoy.
pub async fn via_envoy(stack: &Stack, body: &Value) -> Outcome {
    send_streaming(
        &stack.http,
        &format!("{}/v1/chat/completions", stack.envoy_url),
        body,
    )
    .await
}

/// Send straight to engine `engine`, bypassing Envoy.
pub async fn direct(stack: &Stack, engine: usize, body: &Value) -> Outcome {
    let url = format!(
        "http://{}/v1/chat/completions",
        stack.engines[engine].address
    );
    send_streaming(&stack.http, &url, body).await
}

/// A sample's value from Prometheus text: the first line starting with `series`.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    kvroute_harness::prometheus::value(text, series)
}

/// Wait until the sidecar's index holds at least `blocks` blocks of engine `engine`.
pub async fn wait_indexed(stack: &Stack, engine: usize, blocks: f64) {
    let worker = &stack.engines[engine].address;
    wait_worker_index(
        stack,
        worker,
        "the sidecar to index the warmed blocks",
        Duration::from_secs(10),
        |n| n >= blocks,
    )
    .await;
}

/// Wait up to `timeout` until the blocks the sidecar's index holds of the worker it names
/// `worker` satisfy `ok` (panicking with `what` and the sidecar's log if they never do); the
/// sidecar's metrics at that moment.
pub async fn wait_worker_index(
    stack: &Stack,
    worker: &str,
    what: &str,
    timeout: Duration,
    ok: impl Fn(f64) -> bool,
) -> String {
    let series = format!("kvroute_index_blocks{{worker=\"{worker}\"}}");
    let (series, ok) = (&series, &ok);
    wait_for(what, timeout, || async move {
        let text = stack.sidecar_metrics().await.ok()?;
        ok(metric(&text, series)?).then_some(text)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}: {}", stack.log_tail("sidecar")))
}

/// The sidecar's name for a worker found through Dynamo discovery (pin mode): its request-plane
/// address and instance id.
pub fn pinned_label(stack: &Stack, engine: usize) -> String {
    let e = &stack.engines[engine];
    format!("{}/{:x}", e.address, e.dynamo_worker_id)
}

/// A sample's value from the sidecar's `/metrics`.
pub async fn sidecar_metric(stack: &Stack, series: &str) -> Option<f64> {
    metric(&stack.sidecar_metrics().await.ok()?, series)
}

/// Wait until the sidecar's index holds at least `blocks` blocks of pinned engine `engine`
/// (a real Dynamo worker's events may take longer than the simulator's).
pub async fn wait_pinned_indexed(stack: &Stack, engine: usize, blocks: f64) {
    let worker = pinned_label(stack, engine);
    wait_worker_index(
        stack,
        &worker,
        "the sidecar to index the warmed blocks",
        Duration::from_secs(20),
        |n| n >= blocks,
    )
    .await;
}

/// Assert a request succeeded and return the engine that served it.
pub fn served_by(o: &Outcome) -> usize {
    assert!(o.ok(), "request failed: {o:?}");
    o.engine.expect("engine header")
}

/// A series summed over its labels, from engine `engine`'s own `/metrics` (0 if absent).
pub async fn engine_metric(stack: &Stack, engine: usize, name: &str) -> f64 {
    let url = format!("http://{}/metrics", stack.engines[engine].address);
    let text = kvroute_harness::client::get_text(&stack.http, &url)
        .await
        .unwrap();
    kvroute_harness::prometheus::sum(&text, &format!("{name}{{"))
}

/// A JSON document from the sidecar's API (`/debug/sources`, `/debug/explain`, …).
pub async fn sidecar_json(stack: &Stack, path: &str) -> Value {
    let url = format!("{}{path}", stack.sidecar_url.as_ref().expect("a sidecar"));
    kvroute_harness::client::get_json(&stack.http, &url).await
}

/// Start `kvroute-sidecar serve` on `config` (TOML), written to `dir/sidecar.toml`; its log is
/// `dir/sidecar.log`.
pub fn spawn_sidecar(dir: &std::path::Path, config: &str) -> kvroute_harness::process::Process {
    spawn_sidecar_with(dir, config, &[])
}

/// [`spawn_sidecar`] with environment variables.
pub fn spawn_sidecar_with(
    dir: &std::path::Path,
    config: &str,
    env: &[(&str, &str)],
) -> kvroute_harness::process::Process {
    use kvroute_harness::{paths, process::Process};
    let path = dir.join("sidecar.toml");
    std::fs::write(&path, config).unwrap();
    let mut cmd = std::process::Command::new(paths::binary("kvroute-sidecar").unwrap());
    cmd.arg("serve")
        .arg("--config")
        .arg(path)
        .envs(env.iter().copied());
    Process::spawn("sidecar", cmd, dir).unwrap()
}

/// Ask the sidecar at `base` for a hint for model `m`'s prompt `tokens` (no seed).
pub async fn hint_for_tokens(
    http: &reqwest::Client,
    base: &str,
    tokens: &[u32],
    block_size: usize,
) -> kvroute_protocol::hint::HintResponse {
    let req = kvroute_protocol::hint::HintRequest {
        model: "m".into(),
        hashes: kvroute_protocol::hash::token_prefix_hashes(
            tokens,
            block_size,
            kvroute_protocol::HashSeed::default(),
        ),
        finished: Vec::new(),
    };
    ask_hint(http, base, &req).await
}

/// Whether the sidecar whose `/metrics` is `text` was repaired from a peer: from its snapshot,
/// or its copies of the messages lost here.
pub fn repaired_from_peer(text: &str) -> bool {
    metric(
        text,
        "kvroute_replica_repairs_total{kind=\"peer_snapshot\"}",
    ) >= Some(1.0)
        || metric(
            text,
            "kvroute_replica_lost_messages_total{outcome=\"filled\"}",
        ) >= Some(1.0)
}

/// Ask the sidecar at `base` for a hint, as the filter does.
pub async fn ask_hint(
    http: &reqwest::Client,
    base: &str,
    req: &kvroute_protocol::hint::HintRequest,
) -> kvroute_protocol::hint::HintResponse {
    kvroute_harness::bench_replicas::ask_hint(http, base, req)
        .await
        .expect("the sidecar answers a hint")
}

/// Start `tests/fixtures/vllm_publisher.py` (libzmq via pyzmq, as vLLM publishes) replaying the
/// captured frames in `raw` with `args`, and wait for its READY line; its log is `dir/publisher.log`.
pub fn spawn_vllm_publisher(
    dir: &std::path::Path,
    raw: &std::path::Path,
    args: &[&str],
) -> kvroute_harness::process::Process {
    use kvroute_harness::{paths, process::Process};
    let mut publisher = std::process::Command::new(paths::venv_tool("python").unwrap());
    publisher
        .arg(paths::workspace().join("tests/fixtures/vllm_publisher.py"))
        .arg("--raw")
        .arg(raw)
        .args(args);
    Process::spawn_until_line(
        "publisher",
        publisher,
        dir,
        "READY",
        Duration::from_secs(20),
    )
    .unwrap()
    .0
}

/// A second replica beside `stack`'s sidecar (whose `[replicas]` has `id = "a"`): the same
/// configuration on another port, named `b`, dropping `drop` of its KV-event messages
/// (`[replicas] test_drop_events`). Its process and its URL.
pub fn spawn_lossy_replica(
    stack: &kvroute_harness::Stack,
    drop: f64,
) -> (kvroute_harness::process::Process, String) {
    let config = std::fs::read_to_string(stack.dir.join("sidecar.toml")).unwrap();
    let port = kvroute_harness::process::free_port().unwrap();
    let listen = config.lines().find(|l| l.starts_with("listen")).unwrap();
    let lossy = config
        .replace(listen, &format!("listen = \"127.0.0.1:{port}\""))
        .replace(
            "id = \"a\"",
            &format!("id = \"b\"\ntest_drop_events = {drop}"),
        );
    let dir = stack.dir.join("b");
    std::fs::create_dir_all(&dir).unwrap();
    (
        spawn_sidecar(&dir, &lossy),
        format!("http://127.0.0.1:{port}"),
    )
}

/// Wait until the sidecar has `n` finished hinted requests with their usage reported (the
/// filter reports them on its next hint or its tick) and return its metrics.
pub async fn served_reports(stack: &Stack, n: f64) -> String {
    wait_for(
        "the filter to report the hinted requests with their usage",
        Duration::from_secs(10),
        || async {
            let text = stack.sidecar_metrics().await.ok()?;
            let served = kvroute_harness::prometheus::sum_where(&text, |l| {
                l.starts_with("kvroute_served_requests_total{") && l.contains("usage=\"cached\"")
            });
            (served >= n).then_some(text)
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}: {}", stack.log_tail("sidecar")))
}

/// `POST /admin/<action>` on the simulated engine at `address` (a test hook: `restart`,
/// `evict_silently`, …); panics unless it succeeds.
pub async fn engine_admin(stack: &Stack, address: &str, action: &str) {
    let url = format!("http://{address}/admin/{action}");
    let resp = stack.http.post(&url).send().await.unwrap();
    assert!(resp.status().is_success(), "{url}: {}", resp.status());
}

/// `POST /admin/<action>` with `body` on the simulated engine at `address` (`health`: `up`
/// or `down`); panics unless it succeeds.
pub async fn engine_admin_body(stack: &Stack, address: &str, action: &str, body: &str) {
    let url = format!("http://{address}/admin/{action}");
    let resp = stack
        .http
        .post(&url)
        .body(body.to_owned())
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success(), "{url}: {}", resp.status());
}

/// `users` conversations of `turns` turns each, all at once, through Envoy; every outcome.
pub async fn concurrent_conversations(stack: &Stack, users: u64, turns: u64) -> Vec<Outcome> {
    let conversations = (0..users).map(|u| async move {
        let mut history = text(4000 + u, 120);
        let mut outcomes = Vec::new();
        for turn in 0..turns {
            history.push(' ');
            history.push_str(&text(4100 + u * 10 + turn, 20));
            outcomes.push(via_envoy(stack, &chat(&text(4000, 40), &history)).await);
        }
        outcomes
    });
    futures::future::join_all(conversations).await.concat()
}

/// After `outcomes`, every request of which was hinted: the sidecar weighed no traffic it did
/// not route (`unhinted` in every decision is 0) and closed no running request's ticket (all
/// reported finished, none reclaimed by a scrape).
pub async fn assert_load_was_the_hinted_requests(stack: &Stack, outcomes: &[Outcome]) {
    assert!(outcomes.iter().all(Outcome::ok), "{outcomes:?}");
    let n = outcomes.len() as f64;
    let text = served_reports(stack, n).await;
    let tickets = |how: &str| {
        metric(&text, &format!("kvroute_tickets_total{{how=\"{how}\"}}")).unwrap_or(0.0)
    };
    assert_eq!(tickets("finished"), n, "{text}");
    assert_eq!(
        tickets("reclaimed"),
        0.0,
        "running requests' tickets closed"
    );
    let explained = sidecar_json(stack, "/debug/explain").await;
    let decisions = explained.as_array().unwrap();
    assert_eq!(decisions.len(), outcomes.len());
    for d in decisions {
        for c in d["decision"]["candidates"].as_array().unwrap() {
            assert_eq!(c["unhinted"], 0.0, "traffic the sidecar did not route: {d}");
        }
    }
}

/// A chat body that asks Dynamo which workers served it.
pub fn dynamo_chat(system: &str, user: &str) -> Value {
    let mut body = chat(system, user);
    body["nvext"] = json!({"extra_fields": ["worker_id"]});
    body
}

// Not every test that includes this module sends pinned chats.
#[allow(unused_imports)]
pub use kvroute_harness::client::post_with;

/// Dynamo 1.6's KV-event subject of component `backend`, endpoint `generate`.
pub const DYNAMO_SUBJECT: &str = "namespace.dynamo.component.backend.endpoint.generate.kv-events";

/// A sidecar on `port` reading Dynamo KV events from the nats-server on `nats_port`, for one
/// configured worker `127.0.0.1:9000` (model `m`) whose Dynamo id is `worker`.
pub fn one_dynamo_worker_config(port: u16, nats_port: u16, worker: u64) -> String {
    format!(
        "listen = \"127.0.0.1:{port}\"\n[nats]\nurl = \"nats://127.0.0.1:{nats_port}\"\n\
         [[models]]\nname = \"m\"\ndir = \"{}\"\nblock_size = 16\n\
         [[workers]]\naddress = \"127.0.0.1:9000\"\nmodel = \"m\"\ndynamo_worker_id = {worker}\n",
        kvroute_harness::paths::model_dir().display()
    )
}

/// A nats-server on `port`, its log in `dir`.
pub fn nats_server(dir: &std::path::Path, port: u16) -> kvroute_harness::process::Process {
    use kvroute_harness::{paths, process::Process};
    let mut server = std::process::Command::new(paths::venv_tool("nats-server").unwrap());
    server.args(["-a", "127.0.0.1", "-p", &port.to_string()]);
    Process::spawn("nats", server, dir).unwrap()
}

/// The own hash of event `id`'s block in [`one_block_event`]: its node in the index.
pub fn one_block_hash(id: u64) -> u64 {
    id.wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// Event `id` of Dynamo worker `worker`: one root block.
pub fn one_block_event(worker: u64, id: u64) -> kvroute_protocol::dynamo::RouterEvent {
    use kvroute_protocol::dynamo::{
        KvCacheEvent, KvCacheEventData, RouterEvent, StoredBlock, StoredBlocks,
    };
    RouterEvent {
        worker_id: worker,
        storage_tier: "device".into(),
        residency_domain: None,
        event: KvCacheEvent {
            event_id: id,
            data: KvCacheEventData::Stored(StoredBlocks {
                parent_hash: None,
                start_position: None,
                blocks: vec![StoredBlock {
                    block_hash: 1_000_000 + id,
                    tokens_hash: one_block_hash(id),
                    mm_extra_info: None,
                }],
            }),
            dp_rank: 0,
        },
    }
}

/// Publish `worker`'s [`one_block_event`]s `from..to` on [`DYNAMO_SUBJECT`], one per message.
pub async fn publish_one_block_events(
    client: &async_nats::Client,
    worker: u64,
    from: u64,
    to: u64,
) {
    use kvroute_protocol::dynamo::{encode_v16, EnvelopeHeader, KV_EVENTS_TOPIC};
    for id in from..to {
        let header = EnvelopeHeader {
            publisher_id: 1,
            sequence: id,
            published_at: 0,
            topic: KV_EVENTS_TOPIC,
        };
        let body = encode_v16(header, &[one_block_event(worker, id)]);
        client.publish(DYNAMO_SUBJECT, body.into()).await.unwrap();
    }
    client.flush().await.unwrap();
}
