//! Two sidecars of one fleet on a real nats-server, fed the same Dynamo events: on the replica
//! plane they find each other, agree while both see every event, say so within an interval
//! when one of them loses some (`[replicas] test_drop_events`), and the one that lost them
//! repairs its copy from the other's snapshot.

mod common;

use std::time::Duration;

use common::{metric, nats_server, one_block_hash as tokens_hash, spawn_sidecar};
use kvroute_harness::client::get_text;
use kvroute_harness::paths;
use kvroute_harness::process::{free_port, wait_for, Process};
use kvroute_harness::stack::SIDECAR_SUBSCRIBED;
const WORKER: u64 = 7_000_001;
/// Digests are published this often here.
const INTERVAL_MS: u64 = 500;

/// A sidecar named `id` in group `t` on NATS `nats_port`, dropping `drop` of its events.
fn sidecar(dir: &std::path::Path, id: &str, nats_port: u16, drop: f64) -> (Process, String) {
    let port = free_port().unwrap();
    let config = format!(
        "listen = \"127.0.0.1:{port}\"\n\
         [nats]\nurl = \"nats://127.0.0.1:{nats_port}\"\n\
         [replicas]\ngroup = \"t\"\nid = \"{id}\"\ninterval_ms = {INTERVAL_MS}\ntest_drop_events = {drop}\n\
         [[models]]\nname = \"m\"\ndir = \"{}\"\nblock_size = 16\n\
         [[workers]]\naddress = \"127.0.0.1:9000\"\nmodel = \"m\"\ndynamo_worker_id = {WORKER}\n",
        paths::model_dir().display()
    );
    let sub = dir.join(id);
    std::fs::create_dir_all(&sub).unwrap();
    (
        spawn_sidecar(&sub, &config),
        format!("http://127.0.0.1:{port}"),
    )
}

async fn wait_subscribed(dir: &std::path::Path) {
    wait_for(
        "sidecar subscribed",
        Duration::from_secs(20),
        || async move {
            let log = std::fs::read_to_string(dir.join("sidecar.log")).ok()?;
            (log.contains(SIDECAR_SUBSCRIBED) && log.contains("replica plane:")).then_some(())
        },
    )
    .await
    .unwrap();
}

async fn metrics(http: &reqwest::Client, base: &str) -> String {
    get_text(http, &format!("{base}/metrics"))
        .await
        .unwrap_or_default()
}

/// Wait up to `timeout` until the sidecar at `base` shows metrics for which `ok` holds.
async fn wait_metrics(
    http: &reqwest::Client,
    base: &str,
    what: &str,
    timeout: Duration,
    ok: impl Fn(&str) -> bool,
) {
    let ok = &ok;
    let waited = wait_for(what, timeout, || async move {
        let text = metrics(http, base).await;
        ok(&text).then_some(())
    })
    .await;
    if let Err(e) = waited {
        panic!("{base}: {e}: {}", metrics(http, base).await);
    }
}

/// Replicas `a` (lossless) and `b` (dropping `drop` of its events), both subscribed, and a
/// client to publish with.
struct Pair {
    a: (Process, String),
    b: (Process, String),
    client: async_nats::Client,
}

async fn pair(dir: &std::path::Path, nats_port: u16, drop: f64) -> Pair {
    let a = sidecar(dir, "a", nats_port, 0.0);
    let b = sidecar(dir, "b", nats_port, drop);
    wait_subscribed(&dir.join("a")).await;
    wait_subscribed(&dir.join("b")).await;
    let client = async_nats::connect(format!("nats://127.0.0.1:{nats_port}"))
        .await
        .unwrap();
    Pair { a, b, client }
}

/// Publish the worker's events `from..to`, one per message.
async fn publish(client: &async_nats::Client, from: u64, to: u64) {
    common::publish_one_block_events(client, WORKER, from, to).await;
}

fn index_blocks(text: &str) -> Option<f64> {
    metric(text, "kvroute_index_blocks{worker=\"127.0.0.1:9000\"}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_find_lost_events_within_an_interval_and_repair_them() {
    let dir = paths::run_dir("replicas").unwrap();
    let nats_port = free_port().unwrap();
    let _nats = nats_server(&dir, nats_port);
    let Pair {
        a: (_a, a),
        b: (_b, b),
        client,
    } = pair(&dir, nats_port, 0.1).await;
    let http = reqwest::Client::new();
    let publish = |from: u64, to: u64| publish(&client, from, to);

    // Events 1..=5: the drop takes none of them (a fixed hash of the message), so both hold
    // the same cache and agree.
    publish(1, 6).await;
    for base in [&a, &b] {
        wait_metrics(
            &http,
            base,
            "replicas agree",
            Duration::from_secs(10),
            |text| {
                metric(text, "kvroute_replica_peers") == Some(1.0)
                    && metric(text, "kvroute_replica_caches{state=\"agree\"}") == Some(1.0)
            },
        )
        .await;
    }

    // 300 more: replica b drops a tenth of them. Both say so within an interval of the last.
    publish(6, 306).await;
    let start = std::time::Instant::now();
    for base in [&a, &b] {
        wait_metrics(
            &http,
            base,
            "the divergence found",
            Duration::from_millis(3 * INTERVAL_MS),
            |text| {
                metric(text, "kvroute_replica_caches{state=\"divergent\"}") == Some(1.0)
                    && metric(text, "kvroute_replica_divergences_total") >= Some(1.0)
            },
        )
        .await;
    }
    let found = start.elapsed();
    let dropped = metric(
        &metrics(&http, &b).await,
        "kvroute_test_dropped_events_total",
    );
    assert!(
        dropped.is_some_and(|d| (10.0..=60.0).contains(&d)),
        "dropped {dropped:?}"
    );
    let debug = kvroute_harness::client::get_json(&http, &format!("{a}/debug/replicas")).await;
    assert_eq!(debug["peers"][0]["replica"], "b", "{debug}");
    assert_eq!(debug["mine"][0]["clean"], true, "a lost nothing: {debug}");
    assert_eq!(
        debug["peers"][0]["caches"][0]["agreement"]["state"], "divergent",
        "{debug}"
    );
    let log = std::fs::read_to_string(dir.join("a/sidecar.log")).unwrap();
    assert!(log.contains("replicas disagree on a cache"), "{log}");

    // b's copy is unclean (it saw the gaps), a's is clean: b takes a's snapshot, and both
    // agree again within two intervals of the divergence.
    let repaired_in = std::time::Instant::now();
    wait_metrics(
        &http,
        &b,
        "b repaired from a",
        Duration::from_millis(3 * INTERVAL_MS) + Duration::from_secs(1),
        |text| {
            metric(
                text,
                "kvroute_replica_repairs_total{kind=\"peer_snapshot\"}",
            ) >= Some(1.0)
                && metric(text, "kvroute_replica_caches{state=\"agree\"}") == Some(1.0)
                && metric(text, "kvroute_replica_divergence_seconds_count") >= Some(1.0)
        },
    )
    .await;
    let repaired = repaired_in.elapsed() + found;
    wait_metrics(
        &http,
        &a,
        "a sees agreement",
        Duration::from_millis(3 * INTERVAL_MS),
        |text| metric(text, "kvroute_replica_caches{state=\"agree\"}") == Some(1.0),
    )
    .await;
    let blocks = |text: &str| metric(text, "kvroute_index_blocks{worker=\"127.0.0.1:9000\"}");
    assert_eq!(blocks(&metrics(&http, &a).await), Some(305.0));
    assert_eq!(blocks(&metrics(&http, &b).await), Some(305.0));
    eprintln!("divergence found {found:?} after the last event, repaired {repaired:?} after it; b dropped {dropped:?}");

    // A new replica (a restarted pod) warms from its peer: within 2 s of subscribing it holds
    // what a holds, says so on /readyz, and hints a prompt cached long before it started.
    drop(_b);
    let (_c, c) = sidecar(&dir, "c", nats_port, 0.0);
    wait_subscribed(&dir.join("c")).await;
    let subscribed = std::time::Instant::now();
    wait_metrics(&http, &c, "c warm from a", Duration::from_secs(2), |text| {
        blocks(text) == Some(305.0)
    })
    .await;
    let warmed = subscribed.elapsed();
    let ready = http.get(format!("{c}/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 200, "{}", ready.text().await.unwrap());
    let hint = kvroute_protocol::hint::HintRequest {
        model: "m".into(),
        hashes: vec![kvroute_protocol::PrefixHash(tokens_hash(3))],
        finished: vec![],
    };
    let answer = common::ask_hint(&http, &c, &hint).await;
    assert_eq!(answer.workers, vec!["127.0.0.1:9000".to_string()]);
    assert_eq!(answer.matched_blocks, 1, "{answer:?}");
    eprintln!("a new replica held its peer's 305 blocks {warmed:?} after subscribing");
}

/// Both replicas lose a tenth of the events, different ones: each hands the other what it
/// lost (`kvroute.replicas.<group>.fill`), so both end with every event, clean and agreeing,
/// without a lossless peer to take a snapshot from.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_that_all_lose_events_fill_each_others_gaps() {
    let dir = paths::run_dir("replicas-all-lossy").unwrap();
    let nats_port = free_port().unwrap();
    let _nats = nats_server(&dir, nats_port);
    let (_a, a) = sidecar(&dir, "a", nats_port, 0.1);
    let (_b, b) = sidecar(&dir, "b", nats_port, 0.1);
    wait_subscribed(&dir.join("a")).await;
    wait_subscribed(&dir.join("b")).await;
    let client = async_nats::connect(format!("nats://127.0.0.1:{nats_port}"))
        .await
        .unwrap();
    let http = reqwest::Client::new();
    // As an engine publishes: bursts, not one block of 300.
    for from in (1..301).step_by(10) {
        publish(&client, from, from + 10).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // One last event after a pause, so that a loss among the last ones shows as a gap.
    tokio::time::sleep(Duration::from_millis(200)).await;
    publish(&client, 301, 302).await;
    let lost = |text: &str, outcome: &str| {
        metric(
            text,
            &format!("kvroute_replica_lost_messages_total{{outcome=\"{outcome}\"}}"),
        )
        .unwrap_or(0.0)
    };
    // Every message lost is accounted for: filled in by the peer, or (lost by both, which a
    // tenth each makes about 3 of 301) given up on after the fill timeout.
    let settled = |text: &str| {
        let dropped = metric(text, "kvroute_test_dropped_events_total").unwrap_or(0.0);
        dropped >= 10.0
            && lost(text, "filled") + lost(text, "unfilled") == dropped
            && metric(text, "kvroute_replica_caches{state=\"agree\"}") == Some(1.0)
    };
    for base in [&a, &b] {
        wait_metrics(
            &http,
            base,
            "every lost event filled in or given up on, the replicas agreeing",
            Duration::from_millis(6 * INTERVAL_MS),
            settled,
        )
        .await;
    }
    let (ta, tb) = (metrics(&http, &a).await, metrics(&http, &b).await);
    let (unfilled_a, unfilled_b) = (lost(&ta, "unfilled"), lost(&tb, "unfilled"));
    assert_eq!(unfilled_a, unfilled_b, "only messages both lost stay lost");
    assert!(
        lost(&ta, "filled") >= 10.0 && lost(&tb, "filled") >= 10.0,
        "{ta}\n{tb}"
    );
    let snapshots = |text: &str| {
        metric(
            text,
            "kvroute_replica_repairs_total{kind=\"peer_snapshot\"}",
        )
        .unwrap_or(0.0)
    };
    assert_eq!(index_blocks(&ta), index_blocks(&tb), "the replicas agree");
    if snapshots(&ta) + snapshots(&tb) == 0.0 {
        // Filled in alone: every message but those given up on.
        assert_eq!(index_blocks(&ta), Some(301.0 - unfilled_a), "{ta}");
    } else {
        // Two unclean copies that disagreed converged on one (a replica sometimes misses a
        // message it neither filled nor counted: see issue 30's note); never more missing
        // than both gave up on and one more.
        let held = index_blocks(&ta).unwrap_or(0.0);
        assert!(held >= 301.0 - unfilled_a - unfilled_b - 1.0, "{ta}");
        eprintln!("converged on one copy of {held} blocks after a snapshot");
    }
    eprintln!(
        "filled {} and {}, lost by both {unfilled_a}",
        lost(&ta, "filled"),
        lost(&tb, "filled")
    );
}

/// The NATS server restarts: both replicas reconnect, resubscribe to the events and to each
/// other, and agree again on what arrives after; neither process dies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_agree_again_after_nats_restarts() {
    let dir = paths::run_dir("replicas-nats-restart").unwrap();
    let nats_port = free_port().unwrap();
    let nats = nats_server(&dir, nats_port);
    let Pair {
        a: (mut a_proc, a),
        b: (mut b_proc, b),
        client,
    } = pair(&dir, nats_port, 0.0).await;
    let http = reqwest::Client::new();
    publish(&client, 1, 50).await;
    let agree = |target: f64| {
        move |text: &str| {
            index_blocks(text) == Some(target)
                && metric(text, "kvroute_replica_caches{state=\"agree\"}") == Some(1.0)
        }
    };
    for base in [&a, &b] {
        wait_metrics(
            &http,
            base,
            "agreed before",
            Duration::from_secs(10),
            agree(49.0),
        )
        .await;
    }

    drop(nats);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let _nats = nats_server(&dir, nats_port);
    // Until both have reconnected, event 50 is sent again (a copy is dropped as a duplicate).
    let both_have_it = wait_for("both reconnected", Duration::from_secs(20), || {
        let (client, http, a, b) = (&client, &http, &a, &b);
        async move {
            publish(client, 50, 51).await;
            tokio::time::sleep(Duration::from_millis(200)).await;
            let (ta, tb) = (metrics(http, a).await, metrics(http, b).await);
            (index_blocks(&ta) == Some(50.0) && index_blocks(&tb) == Some(50.0)).then_some(())
        }
    })
    .await;
    both_have_it.unwrap();
    publish(&client, 51, 100).await;
    for base in [&a, &b] {
        wait_metrics(
            &http,
            base,
            "agreed after",
            Duration::from_secs(10),
            agree(99.0),
        )
        .await;
    }
    assert!(a_proc.is_running() && b_proc.is_running(), "a sidecar died");
}

/// vLLM engines (simulated, over real ZMQ with replay sockets): a second sidecar that loses a
/// tenth of the messages, replayed copies included (what its engines' replay cannot give it,
/// as with a replay buffer too short), is repaired from its peer (its copies of the lost
/// messages, or its snapshots): both end with the
/// same blocks per worker and name the same first worker for the prompts sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_losing_vllm_messages_is_repaired_from_its_peer() {
    use kvroute_harness::{Mode, Stack, StackOptions};
    let mut opts = StackOptions::new("replicas-vllm", Mode::Kvroute);
    opts.sim.event_formats = vec!["vllm-map".into()];
    opts.sidecar_toml =
        format!("[replicas]\ngroup = \"v\"\nid = \"a\"\ninterval_ms = {INTERVAL_MS}\n");
    let stack = Stack::start(opts).await.expect("stack starts");
    let (_b, b) = common::spawn_lossy_replica(&stack, 0.1);
    let a = stack.sidecar_url.clone().unwrap();
    wait_metrics(&stack.http, &b, "b hears a", Duration::from_secs(20), |t| {
        metric(t, "kvroute_replica_peers") == Some(1.0)
    })
    .await;
    for i in 0..60 {
        let o = common::via_envoy(&stack, &common::chat(&common::text(5000 + i, 80), "hi")).await;
        assert!(o.ok(), "request {i}: {o:?}");
    }
    let blocks =
        |text: &str| kvroute_harness::prometheus::sorted_series(text, "kvroute_index_blocks{");
    let (http, a_ref, b_ref) = (&stack.http, &a, &b);
    let settled = wait_for(
        "b repaired and both agree",
        Duration::from_secs(20),
        || async move {
            let (ta, tb) = (metrics(http, a_ref).await, metrics(http, b_ref).await);
            let repaired = common::repaired_from_peer(&tb);
            let agree = [&ta, &tb]
                .iter()
                .all(|t| metric(t, "kvroute_replica_caches{state=\"divergent\"}") == Some(0.0));
            (repaired && agree && blocks(&ta) == blocks(&tb)).then_some(tb)
        },
    )
    .await;
    let tb = match settled {
        Ok(tb) => tb,
        Err(e) => panic!(
            "{e}\na: {}\nb: {}",
            metrics(http, a_ref).await,
            metrics(http, b_ref).await
        ),
    };
    // Both name the same first worker, with the same matched blocks, for the prompts sent
    // (asked directly).
    let probes: Vec<_> = (0..60)
        .map(|i| common::chat(&common::text(5000 + i, 80), "hi"))
        .collect();
    let agreement =
        kvroute_harness::bench_replicas::agreement(http, &[a.clone(), b.clone()], &probes)
            .await
            .unwrap();
    assert!(
        agreement >= 0.99,
        "replicas agree on {agreement:.3} of the prompts"
    );
    let gaps = kvroute_harness::prometheus::sum_where(&tb, |l| {
        l.starts_with("kvroute_sequence_total{") && l.contains("kind=\"gap\"")
    });
    // The premise: b lost messages (how many show as gaps depends on where they fall: a lost
    // last message of a stream shows none, and is repaired as "behind").
    let dropped = metric(&tb, "kvroute_test_dropped_events_total").unwrap_or(0.0);
    assert!(dropped >= 1.0, "b lost nothing: {tb}");
    eprintln!(
        "b dropped {dropped} messages, saw {} gaps its replays did not fill, repaired {:?} times; same first worker and match for {agreement:.3} of the prompts",
        gaps as u64,
        metric(&tb, "kvroute_replica_repairs_total{kind=\"peer_snapshot\"}")
    );
}

/// The leading blocks of each candidate in the sidecar's latest decision that requests running
/// there hold (`/debug/explain`).
async fn running_blocks(http: &reqwest::Client, base: &str) -> Vec<(String, u64)> {
    let explain = kvroute_harness::client::get_json(http, &format!("{base}/debug/explain")).await;
    explain[0]["decision"]["candidates"]
        .as_array()
        .map(|c| {
            c.iter()
                .map(|c| {
                    let worker = c["worker"].as_str().unwrap_or_default().to_owned();
                    (worker, c["in_flight_blocks"].as_u64().unwrap_or(0))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// A prompt running through one replica is held on its worker for the other too: replica b,
/// which never routed it, counts its blocks as running there (as one shared index would) until
/// a's report that it finished reaches b on the next share.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_running_through_one_replica_counts_on_every_replica() {
    let dir = paths::run_dir("replicas-running").unwrap();
    let nats_port = free_port().unwrap();
    let _nats = nats_server(&dir, nats_port);
    let Pair {
        a: (_a, a),
        b: (_b, b),
        client: _client,
    } = pair(&dir, nats_port, 0.0).await;
    let http = reqwest::Client::new();
    let hashes = |n: u64| {
        (1..=n)
            .map(|i| kvroute_protocol::PrefixHash(tokens_hash(9_000 + i)))
            .collect::<Vec<_>>()
    };
    let ask = |base: &str, n: u64, finished| {
        let req = kvroute_protocol::hint::HintRequest {
            model: "m".into(),
            hashes: hashes(n),
            finished,
        };
        let (http, base) = (&http, base.to_owned());
        async move { common::ask_hint(http, &base, &req).await }
    };
    let running = ask(&a, 6, Vec::new()).await;
    let ticket = running.ticket.expect("a ticket for the running request");
    let finished = |ticket| kvroute_protocol::hint::Finished {
        ticket,
        usage: kvroute_protocol::hint::Usage::Missing,
    };
    // b asks for a prompt sharing the running one's first 4 blocks, each probe reporting the
    // previous one finished (so only a's request runs there), and reads what it counted.
    let last_probe = std::sync::Mutex::new(None);
    let probe_b = || async {
        let done = last_probe.lock().unwrap().take().map(finished);
        let answer = ask(&b, 4, done.into_iter().collect()).await;
        *last_probe.lock().unwrap() = answer.ticket;
        running_blocks(&http, &b).await
    };
    let worker = "127.0.0.1:9000".to_owned();
    let shared = wait_for(
        "a's running prompt on b",
        Duration::from_secs(5),
        || async {
            let held = probe_b().await;
            held.contains(&(worker.clone(), 4)).then_some(())
        },
    )
    .await;
    assert!(shared.is_ok(), "{:?}", running_blocks(&http, &b).await);

    // a's request finishes: within a share b counts nothing running there.
    let _ = ask(&a, 0, vec![finished(ticket)]).await;
    let gone = wait_for(
        "a's finished prompt gone from b",
        Duration::from_secs(5),
        || async {
            let held = probe_b().await;
            held.iter().all(|(_, n)| *n == 0).then_some(())
        },
    )
    .await;
    assert!(gone.is_ok(), "{:?}", running_blocks(&http, &b).await);
}
