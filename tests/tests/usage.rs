//! What the engines said they had cached: the filter reads each hinted response's `usage` as it
//! passes, reports it with the request's ticket, and the sidecar sets it beside its prediction.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::*;
use kvroute_harness::client::{send_streaming, send_whole, Outcome};
use kvroute_harness::process::wait_for;
use kvroute_harness::prometheus::sum_where;
use kvroute_harness::stack::ReplicaOptions;
use kvroute_harness::stack::MODEL;
use kvroute_harness::{Mode, Stack, StackOptions};
use serde_json::{json, Value};

/// Blocks the sidecar's index holds per worker address.
async fn indexed(stack: &Stack) -> HashMap<String, f64> {
    let text = stack.sidecar_metrics().await.unwrap();
    kvroute_harness::prometheus::series(&text, "kvroute_index_blocks{")
        .filter_map(|(series, v)| {
            let worker = series.split("worker=\"").nth(1)?.split('"').next()?;
            Some((worker.to_owned(), v))
        })
        .collect()
}

/// Wait until the sidecar has reported every hinted request finished (the filter reports them
/// on the next hint or on its tick) and return its metrics.
async fn all_reported(stack: &Stack) -> String {
    let hinted = stack
        .envoy_stat("wasmcustom.kvroute.hinted")
        .await
        .unwrap_or(0) as f64;
    wait_for(
        "the filter to report every hinted request with its usage",
        Duration::from_secs(10),
        || async {
            let text = stack.sidecar_metrics().await.ok()?;
            let served = sum_where(&text, |l| l.starts_with("kvroute_served_requests_total{"));
            (served >= hinted && hinted > 0.0).then_some(text)
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}: {}", stack.log_tail("sidecar")))
}

/// Send `body` through the Envoy at `envoy_url` (streaming, or not) and wait until the stack's
/// sidecar indexes the blocks it stored.
async fn send_indexed(stack: &Stack, envoy_url: &str, body: &Value, stream: bool) -> Outcome {
    let url = format!("{envoy_url}/v1/chat/completions");
    let before = indexed(stack).await;
    let o = if stream {
        send_streaming(&stack.http, &url, body).await
    } else {
        send_whole(&stack.http, &url, body).await
    };
    assert!(o.ok(), "{o:?}");
    wait_stored(stack, &before, &o).await;
    o
}

/// Wait until the sidecar's index holds what `o` stored on its engine beyond `before`.
async fn wait_stored(stack: &Stack, before: &HashMap<String, f64>, o: &Outcome) {
    let worker = &stack.engines[served_by(o)].address;
    let new = (o.prompt_tokens / 16).saturating_sub(o.cached_tokens / 16) as f64;
    let had = before.get(worker).copied().unwrap_or(0.0);
    wait_worker_index(
        stack,
        worker,
        "the index to hold the request's blocks",
        Duration::from_secs(10),
        |n| n >= had + new,
    )
    .await;
}

/// Wait until `alarm` is on (`true`) or off for some subject in the metrics at `sidecar_url`;
/// the subjects it is on for.
async fn wait_alarm(stack: &Stack, sidecar_url: &str, alarm: &str, on: bool) -> Vec<String> {
    let prefix = format!("kvroute_alarm{{alarm=\"{alarm}\",subject=\"");
    let (prefix, url) = (&prefix, &format!("{sidecar_url}/metrics"));
    wait_for(
        &format!("alarm {alarm} to be {}", if on { "on" } else { "off" }),
        Duration::from_secs(20),
        || async move {
            let text = kvroute_harness::client::get_text(&stack.http, url).await?;
            let subjects: Vec<String> = kvroute_harness::prometheus::series(&text, prefix)
                .filter(|(_, v)| *v == 1.0)
                .map(|(series, _)| series[prefix.len()..].trim_end_matches("\"}").to_owned())
                .collect();
            (subjects.is_empty() != on).then_some(subjects)
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}: {}", stack.log_tail("sidecar")))
}

fn sum_of(text: &str, family: &str, label: &str) -> f64 {
    sum_where(text, |l| l.starts_with(family) && l.contains(label))
}

/// Three conversations, streamed and not in turn, each turn waiting until the index holds the
/// last: every prediction is within one block of what the engine reports, and the sidecar's
/// totals are exactly what the clients read in the responses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn predictions_match_what_the_engines_report() {
    let stack = Stack::start(StackOptions::new("usage", Mode::Kvroute))
        .await
        .expect("stack starts");
    let mut seen: Vec<Outcome> = Vec::new();
    let mut histories: Vec<String> = (0..3).map(|c| text(100 + c, 60)).collect();
    for turn in 0..4u64 {
        for (c, history) in histories.iter_mut().enumerate() {
            history.push(' ');
            history.push_str(&text(200 + 10 * c as u64 + turn, 40));
            let body = chat(&text(7, 30), history);
            let stream = (turn + c as u64).is_multiple_of(2);
            seen.push(send_indexed(&stack, &stack.envoy_url, &body, stream).await);
        }
    }
    let text = all_reported(&stack).await;
    let n = seen.len() as f64;
    let served = "kvroute_served_requests_total{";
    assert_eq!(sum_of(&text, served, "usage=\"cached\""), n, "{text}");
    assert_eq!(sum_where(&text, |l| l.starts_with(served)), n);
    assert_eq!(
        sum_of(&text, "kvroute_predictions_total{", "outcome=\"exact\""),
        n,
        "every prediction within one block: {text}"
    );
    let total = |family: &str| sum_where(&text, |l| l.starts_with(family));
    let actual = total("kvroute_actual_cached_tokens_total{");
    let prompt = total("kvroute_served_prompt_tokens_total{");
    let predicted = total("kvroute_predicted_cached_tokens_total{");
    assert_eq!(
        actual,
        seen.iter().map(|o| o.cached_tokens).sum::<u64>() as f64,
        "what the clients read"
    );
    assert_eq!(
        prompt,
        seen.iter().map(|o| o.prompt_tokens).sum::<u64>() as f64
    );
    assert!(
        actual > 0.4 * prompt,
        "later turns hit: {actual} of {prompt}"
    );
    assert!(
        (predicted - actual).abs() <= 16.0 * n,
        "predicted {predicted}, actual {actual}"
    );
    // Each decision carries its time and Envoy's request id (the access log's too), was used,
    // and shows what the engine reported beside the prediction.
    let explained = sidecar_json(&stack, "/debug/explain").await;
    let entries = explained.as_array().unwrap();
    assert_eq!(entries.len(), seen.len(), "{explained}");
    let ids: Vec<String> = entries
        .iter()
        .map(|e| {
            assert_eq!(e["outcome"], "used", "{e}");
            assert!(e["at_unix_ms"].as_u64().unwrap() > 1_700_000_000_000, "{e}");
            assert!(e["served"]["cached_tokens"].as_u64().is_some(), "{e}");
            assert!(e["served"]["predicted_tokens"].as_u64().is_some(), "{e}");
            e["request_id"].as_str().unwrap().to_owned()
        })
        .collect();
    let cached: u64 = entries
        .iter()
        .map(|e| e["served"]["cached_tokens"].as_u64().unwrap())
        .sum();
    assert_eq!(cached as f64, actual);
    let log = stack.dir.join("envoy.log");
    // Envoy flushes its access log every 10 s.
    wait_for("the access log", Duration::from_secs(15), || async {
        let text = std::fs::read_to_string(&log).ok()?;
        ids.iter()
            .all(|id| text.contains(&format!("request_id={id} ")))
            .then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}: {}", stack.log_tail("envoy")));
}

/// The raw bytes of a chat answer.
async fn raw(stack: &Stack, base: &str, body: &Value) -> (u16, Vec<u8>) {
    let resp = stack
        .http
        .post(format!("{base}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, resp.bytes().await.unwrap().to_vec())
}

/// Responses without usage, with a malformed one, and a 4 MiB stream reach the client byte for
/// byte as the engine sent them, are counted for what they are, and the VM keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_responses_pass_unchanged_and_are_counted() {
    let stack = Stack::start(StackOptions::new("usage-odd", Mode::Kvroute))
        .await
        .expect("stack starts");
    let user = text(3, 80);
    let with = |extra: Value| {
        let mut body = json!({"model": MODEL, "max_tokens": 4, "messages": [
            {"role": "user", "content": user}
        ]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    let stream = json!({"stream": true, "stream_options": {"include_usage": true}});
    let cases = [
        (
            "a stream without usage",
            with(json!({"stream": true, "sim_usage": "omit"})),
        ),
        (
            "a stream not asked for usage",
            with(json!({"stream": true})),
        ),
        ("a malformed usage", with(json!({"sim_usage": "malformed"}))),
        (
            "a huge stream with a malformed usage",
            with(
                json!({"stream": true, "stream_options": stream["stream_options"],
                "sim_usage": "malformed", "max_tokens": 64, "sim_pad_bytes": 65536}),
            ),
        ),
    ];
    // Warm the prompt so every case is hinted to the engine holding it.
    let first = via_envoy(&stack, &with(json!({}))).await;
    assert!(first.ok(), "{first:?}");
    let engine = served_by(&first);
    wait_indexed(&stack, engine, (first.prompt_tokens / 16) as f64).await;
    let direct_url = format!("http://{}", stack.engines[engine].address);
    for (what, body) in &cases {
        let (status, through) = raw(&stack, &stack.envoy_url, body).await;
        let (direct_status, engine_sent) = raw(&stack, &direct_url, body).await;
        assert_eq!((status, direct_status), (200, 200), "{what}");
        assert_eq!(
            through,
            engine_sent,
            "{what}: the client gets exactly what the engine sent ({} bytes)",
            engine_sent.len()
        );
    }
    assert!(raw(&stack, &stack.envoy_url, &cases[3].1).await.1.len() > 4 << 20);
    let text = all_reported(&stack).await;
    let served = "kvroute_served_requests_total{";
    assert_eq!(sum_of(&text, served, "usage=\"missing\""), 2.0, "{text}");
    assert_eq!(sum_of(&text, served, "usage=\"malformed\""), 3.0, "{text}");
    assert_eq!(sum_of(&text, served, "usage=\"cached\""), 1.0, "{text}");
    assert_eq!(
        stack
            .envoy_stat("wasmcustom.kvroute.host_errors")
            .await
            .unwrap_or(0),
        0
    );
    assert_eq!(
        stack
            .envoy_stat("wasm.kvroute.vm_reload_success")
            .await
            .unwrap_or(0),
        0,
        "no VM failed"
    );
    let after = via_envoy(&stack, &with(json!({}))).await;
    assert!(after.ok() && after.cached_tokens > 0, "{after:?}");
}

/// Engines that lost their caches without a word (every removal lost on the way): the hints
/// still predict the prompts cached, the engines report nothing cached, and `stale_index`
/// names the workers; once the prompts are stored again and hit as predicted, it clears.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_index_is_named_until_the_predictions_hold_again() {
    let mut opts = StackOptions::new("usage-stale", Mode::Kvroute);
    opts.sidecar_toml =
        "[alarms]\nsilence_s = 3\ntruth_window_s = 3\nstale_index_min_tokens = 256\n".into();
    let stack = Stack::start(opts).await.expect("stack starts");
    let sidecar = stack.sidecar_url.clone().unwrap();
    let prompts: Vec<Value> = (0..8)
        .map(|i| chat(&text(500 + i, 90), &text(600 + i, 10)))
        .collect();
    let mut homes = Vec::new();
    for p in &prompts {
        homes.push(served_by(
            &send_indexed(&stack, &stack.envoy_url, p, true).await,
        ));
    }
    assert!(wait_alarm_quiet(&stack, &sidecar).await);
    for e in &stack.engines {
        engine_admin(&stack, &e.address, "evict_silently").await;
    }
    // Each request waits for the one before to be reported: a ticket still open would count
    // as load on its worker and could send the next prompt to a worker its index says lacks
    // it, stored there and never refuted where the index still places it.
    let mut workers = std::collections::BTreeSet::new();
    for (p, &home) in prompts.iter().zip(&homes) {
        let o = via_envoy(&stack, p).await;
        assert!(o.ok() && o.cached_tokens == 0, "the engine forgot: {o:?}");
        assert_eq!(served_by(&o), home, "still sent where the index places it");
        workers.insert(stack.engines[home].address.clone());
        all_reported(&stack).await;
    }
    let stale = wait_alarm(&stack, &sidecar, "stale_index", true).await;
    assert!(
        stale.iter().all(|s| workers.contains(s)) && !stale.is_empty(),
        "{stale:?} of {workers:?}"
    );
    assert!(stack.log_tail("sidecar").contains("stale_index"));
    // Stored again by those misses: the same prompts hit as predicted from now on.
    let clearing = async {
        loop {
            for p in &prompts {
                let o = via_envoy(&stack, p).await;
                if !(o.ok() && o.cached_tokens > 0) {
                    let explained = sidecar_json(&stack, "/debug/explain").await;
                    let newest = explained.as_array().and_then(|a| a.first()).cloned();
                    panic!("{o:?}\nits decision: {newest:#?}");
                }
                all_reported(&stack).await;
            }
        }
    };
    tokio::select! {
        _ = clearing => unreachable!(),
        _ = wait_alarm(&stack, &sidecar, "stale_index", false) => {}
    }
}

/// No alarm on the truth while predictions hold (three checks).
async fn wait_alarm_quiet(stack: &Stack, sidecar: &str) -> bool {
    tokio::time::sleep(Duration::from_millis(3100)).await;
    let text = kvroute_harness::client::get_text(&stack.http, &format!("{sidecar}/metrics"))
        .await
        .unwrap_or_default();
    let on = kvroute_harness::prometheus::series(&text, "kvroute_alarm{")
        .any(|(s, v)| v == 1.0 && (s.contains("stale_index") || s.contains("replica_skew")));
    !on
}

/// Two replicas, reconciliation off, the second losing every KV event: prompts cached where
/// only the first knows are hits through it and mostly misses through the second, and
/// `replica_skew` names the second on both replicas, from the totals they exchange. The second
/// redeployed with its events and reconciliation warms from its peer and hits like it: the
/// alarm clears.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_hitting_less_than_its_peer_is_named_until_repaired() {
    let mut opts = StackOptions::new("usage-skew", Mode::Kvroute);
    opts.replicas = Some(ReplicaOptions {
        count: 2,
        interval_ms: 500,
        loss: 1.0,
        lossy: Some(1),
        reconcile: false,
        share_load: true,
        load_interval_ms: 50,
    });
    opts.sidecar_toml =
        "[alarms]\nsilence_s = 3\ntruth_window_s = 4\nreplica_skew_min_tokens = 512\n".into();
    let mut stack = Stack::start(opts).await.expect("stack starts");
    let n = stack.engines.len();
    let (first, second) = (stack.replicas[0].clone(), stack.replicas[1].clone());
    let prompt = |i: u64, turn: u64| chat(&text(700 + i, 90), &text(800 + 10 * i + turn, 8));
    // Warmed straight on engine i mod n: only the first replica's index learns where.
    const PROMPTS: u64 = 24;
    for i in 0..PROMPTS {
        let before = indexed(&stack).await;
        let o = direct(&stack, i as usize % n, &prompt(i, 0)).await;
        assert!(o.ok(), "{o:?}");
        wait_stored(&stack, &before, &o).await;
    }
    // Every turn through the first before any through the second: with load shared, a request
    // the first still runs would show the second its prefix (a hit the index did not give).
    let (mut hits, mut misses) = (0u64, 0u64);
    for (r, turn) in [(&first, 1), (&second, 2)] {
        let url = format!("{}/v1/chat/completions", r.envoy_url);
        for i in 0..PROMPTS {
            let o = send_streaming(&stack.http, &url, &prompt(i, turn)).await;
            assert!(o.ok(), "{o:?}");
            if turn == 2 {
                hits += u64::from(o.cached_tokens > 0);
                misses += u64::from(o.cached_tokens == 0);
            }
        }
    }
    assert!(
        misses > hits,
        "the second replica routes blind: {hits} hits, {misses} misses"
    );
    for r in [&first, &second] {
        let on = wait_alarm(&stack, &r.sidecar_url, "replica_skew", true).await;
        assert_eq!(on, ["r1"], "named on {}", r.sidecar_url);
    }
    let debug = common::sidecar_json(&stack, "/debug/replicas").await;
    let peer = &debug["peers"][0];
    assert_eq!(peer["replica"], "r1");
    assert!(
        peer["served"][0]["actual_hit_rate"].as_f64().is_some(),
        "{debug}"
    );
    // Redeployed with its events and reconciliation: it warms from its peer and hits.
    stack
        .restart_replica_sidecar(1, |toml| {
            toml.replace("test_drop_events = 1.0", "test_drop_events = 0.0")
                .replace("reconcile = false", "reconcile = true")
        })
        .await
        .unwrap();
    let ready = format!("{}/readyz", second.sidecar_url);
    wait_for(
        "the redeployed replica to warm",
        Duration::from_secs(10),
        || async {
            let r = stack.http.get(&ready).send().await.ok()?;
            r.status().is_success().then_some(())
        },
    )
    .await
    .unwrap();
    let traffic = async {
        for turn in 3.. {
            for i in 0..PROMPTS {
                for r in [&first, &second] {
                    let url = format!("{}/v1/chat/completions", r.envoy_url);
                    let o = send_streaming(&stack.http, &url, &prompt(i, turn)).await;
                    assert!(o.ok(), "{o:?}");
                }
            }
        }
    };
    tokio::select! {
        _ = traffic => unreachable!(),
        _ = wait_alarm(&stack, &first.sidecar_url, "replica_skew", false) => {}
    }
}
