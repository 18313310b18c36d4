//! The data path end to end: the index steers Envoy, the fallback keeps affinity, counters show it.

mod common;

use common::*;
use kvroute_harness::process::wait_for;
use kvroute_harness::{Fallback, Mode, Stack, StackOptions};

/// Engines as slow at the edges as CPU vLLM was: a request reaches the scheduler 400 ms after
/// it arrives, and `/metrics` answers 300 ms late with the numbers of when it was asked. Every
/// request is hinted, so the load weighed must be the sidecar's own tickets: a request that
/// finished while a scrape was on its way is not unrouted traffic, and one not yet counted by
/// its engine is not finished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_engine_counts_are_not_taken_for_other_traffic() {
    let mut opts = StackOptions::new("late-counts", Mode::Kvroute);
    opts.sim.engines = 2;
    opts.sim.frontend_delay_ms = 400;
    opts.sim.metrics_delay_ms = 300;
    // A hint that timed out would send a request unhinted: real unrouted traffic.
    opts.hint_timeout_ms = 1000;
    let stack = Stack::start(opts).await.expect("stack starts");
    let outcomes = concurrent_conversations(&stack, 8, 4).await;
    assert_load_was_the_hinted_requests(&stack, &outcomes).await;
}

/// A prefix warmed on engine K (sent directly to K) is routed to K through Envoy, although the
/// ring hash picks another engine for that key; with the sidecar killed, the ring's engine
/// serves every request of that prefix and nothing fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn index_steers_envoy_and_fallback_keeps_affinity() {
    let mut stack = Stack::start(StackOptions::new("routing", Mode::Kvroute))
        .await
        .expect("stack starts");
    let n = stack.engines.len();
    // A system prompt longer than the fallback key's 8 blocks: every request below has the same
    // ring-hash key, so the ring alone would send them all to one engine.
    let system = text(1, 200);
    let user = text(2, 20);

    // With the sidecar paused, the request is routed by the ring, to engine `ring`.
    stack.signal("sidecar", "STOP").unwrap();
    let first = via_envoy(&stack, &chat(&system, &user)).await;
    stack.signal("sidecar", "CONT").unwrap();
    let ring = served_by(&first);
    wait_indexed(&stack, ring, 8.0).await;

    // Warm a longer prefix directly on another engine.
    let warm = (ring + 1) % n;
    // Long enough that its cached blocks outweigh the load terms of the rule.
    let longer = format!("{user} {}", text(3, 200));
    let warmed = direct(&stack, warm, &chat(&system, &longer)).await;
    assert_eq!(served_by(&warmed), warm);
    let warmed_blocks = (warmed.prompt_tokens / 16) as f64;
    wait_indexed(&stack, warm, warmed_blocks).await;

    // Requests extending the warmed prompt go where it is cached, and hit.
    for i in 0..5 {
        let body = chat(&system, &format!("{longer} {}", text(10 + i, 5)));
        let o = via_envoy(&stack, &body).await;
        assert_eq!(served_by(&o), warm, "request {i} ignored the index");
        assert!(
            o.cached_tokens as f64 >= (warmed_blocks - 1.0) * 16.0,
            "{o:?}"
        );
    }

    // Envoy's filter counters and the sidecar's event counters saw all of this.
    assert!(
        stack
            .envoy_stat("wasmcustom.kvroute.requests")
            .await
            .unwrap()
            >= 6
    );
    assert!(stack.envoy_stat("wasmcustom.kvroute.hinted").await.unwrap() >= 5);
    assert!(
        stack
            .envoy_stat("wasmcustom.kvroute.matched_blocks")
            .await
            .unwrap()
            >= 5 * 8
    );
    // Where a hinted request's time goes, from both sides: the filter's preparation and its
    // pause for the hint (Envoy's histograms, in /stats once flushed), the sidecar's answer.
    for name in ["prepare_us", "hint_pause_us"] {
        let stack = &stack;
        let recorded = wait_for(name, std::time::Duration::from_secs(15), || async move {
            let url = format!("{}/stats?filter=kvroute\\.{name}$", stack.admin_url);
            let text = kvroute_harness::client::get_text(&stack.http, &url).await?;
            let line = text.lines().find(|l| l.contains(name))?.to_owned();
            // Quantiles as (interval, cumulative): a recorded cumulative P50 is a number.
            line.contains("P50(").then_some(())?;
            (!line.contains("No recorded values") && !line.contains(",nan)")).then_some(line)
        })
        .await;
        assert!(recorded.is_ok(), "{name}: {recorded:?}");
    }
    let answered = sidecar_metric(&stack, "kvroute_hint_seconds_count").await;
    assert!(answered >= Some(5.0), "{answered:?}");
    let metrics = stack.sidecar_metrics().await.unwrap();
    let stored = kvroute_harness::prometheus::sum_where(&metrics, |l| {
        l.starts_with("kvroute_events_total{") && l.contains("type=\"stored\"")
    });
    // At least the ring-routed first request and the warming one stored blocks.
    assert!(stored >= 2.0, "stored events counted: {metrics}");
    assert!(metric(&metrics, "kvroute_hints_total{result=\"hinted\"}").unwrap() >= 5.0);
    // Every hinted request was reported finished by the filter (on its next hint or its tick),
    // so the sidecar counts nothing in flight once traffic stops.
    let finished = "kvroute_tickets_total{how=\"finished\"}";
    wait_for(
        "the filter to report every hinted request finished",
        std::time::Duration::from_secs(5),
        || async {
            let text = stack.sidecar_metrics().await.ok()?;
            let open = kvroute_harness::prometheus::sum(&text, "kvroute_in_flight{");
            (open == 0.0 && metric(&text, finished)? >= 5.0).then_some(())
        },
    )
    .await
    .unwrap_or_else(|e| {
        let text = futures::executor::block_on(stack.sidecar_metrics()).unwrap_or_default();
        panic!("{e}: {text}")
    });

    // Kill the sidecar: every request still succeeds, and the prefix sticks to the ring's engine.
    stack.kill("sidecar");
    for i in 0..20 {
        let body = chat(&system, &format!("{longer} {}", text(100 + i, 5)));
        let o = via_envoy(&stack, &body).await;
        assert_eq!(
            served_by(&o),
            ring,
            "request {i} lost affinity without the sidecar"
        );
    }
    assert!(
        stack
            .envoy_stat("wasmcustom.kvroute.fallback.sidecar")
            .await
            .unwrap()
            >= 20
    );
}

/// Routing headers sent by a client change nothing. The sidecar is stopped first, so no hint
/// ever overwrites a forged header: only the stripping in front of the filter protects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_sent_routing_headers_are_ignored() {
    let mut stack = Stack::start(StackOptions::new("forged", Mode::Kvroute))
        .await
        .expect("stack starts");
    stack.kill("sidecar");
    let n = stack.engines.len();
    let url = format!("{}/v1/chat/completions", stack.envoy_url);
    let send = |body: serde_json::Value, header: &'static str, value: String| {
        let http = stack.http.clone();
        let url = url.clone();
        async move {
            let resp = http
                .post(url)
                .header(header, value)
                .header("content-type", "application/json")
                .body(body.to_string())
                .send()
                .await
                .expect("response");
            assert!(resp.status().as_u16() < 500, "{}", resp.status());
            let engine = resp.headers()["x-sim-engine"]
                .to_str()
                .unwrap()
                .parse::<usize>()
                .unwrap();
            let _ = resp.bytes().await;
            engine
        }
    };
    // An unseen prompt, with the worker header forged to each engine in turn: one engine serves
    // them all (the ring's pick), so the forged header was dropped.
    let system = text(20, 200);
    let picks: Vec<usize> = {
        let mut v = Vec::new();
        for (i, e) in stack.engines.iter().enumerate() {
            let body = chat(&system, &text(30 + i as u64, 10));
            v.push(send(body, "x-kvroute-worker", e.address.clone()).await);
        }
        v
    };
    assert!(
        picks.iter().all(|&p| p == picks[0]),
        "forged worker header honoured: {picks:?}"
    );
    // On a path the filter does not handle, the header is dropped too (Envoy's header_mutation,
    // not the filter): requests spread instead of all going to the forged worker.
    let mut served = std::collections::HashSet::new();
    for _ in 0..16 {
        let resp = stack
            .http
            .get(format!("{}/health", stack.envoy_url))
            .header("x-kvroute-worker", stack.engines[0].address.clone())
            .send()
            .await
            .expect("response");
        served.insert(resp.headers()["x-sim-engine"].to_str().unwrap().to_owned());
    }
    assert!(
        served.len() > 1,
        "forged worker header honoured off the chat path: {served:?}"
    );
    // A forged fallback key does not move the request either.
    for i in 0..n {
        let body = chat(&system, &text(40 + i as u64, 10));
        let got = send(body, "x-kvroute-key", format!("{:016x}", i * 7919)).await;
        assert_eq!(got, picks[0], "forged key header honoured");
    }
    let body = serde_json::json!({"model": "unknown-model", "messages": [{"role": "user", "content": text(50, 40)}]});
    let first = send(body.clone(), "x-kvroute-key", "1".into()).await;
    for i in 2..6 {
        assert_eq!(
            send(body.clone(), "x-kvroute-key", i.to_string()).await,
            first
        );
    }
    // A session header is the fallback key: one session sticks to one engine whatever its
    // prompts, and different sessions spread over the ring.
    let session_engine = |session: String, seed: u64| {
        let body = chat(&text(seed, 150), &text(seed + 1, 10));
        send(body, "x-session-id", session)
    };
    let home = session_engine("session-a".into(), 300).await;
    for seed in [310, 320, 330, 340] {
        assert_eq!(session_engine("session-a".into(), seed).await, home);
    }
    let mut engines = std::collections::HashSet::new();
    for k in 0..8 {
        engines.insert(session_engine(format!("session-{k}"), 400).await);
    }
    assert!(
        engines.len() > 1,
        "sessions all hashed to one engine: {engines:?}"
    );
}

/// A sidecar that accepts connections but never answers (stopped with SIGSTOP): every request
/// waits at most the hint timeout, then goes on by the ring hash; nothing fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hung_sidecar_costs_at_most_the_hint_timeout() {
    let mut opts = StackOptions::new("hung-sidecar", Mode::Kvroute);
    opts.hint_timeout_ms = 100;
    let stack = Stack::start(opts).await.expect("stack starts");
    let system = text(70, 200);
    stack.signal("sidecar", "STOP").unwrap();
    let mut engines = Vec::new();
    for i in 0..6 {
        let started = std::time::Instant::now();
        let o = via_envoy(&stack, &chat(&system, &text(80 + i, 10))).await;
        engines.push(served_by(&o));
        // The hint timeout plus the engine's own time, with slack for a loaded CI machine.
        assert!(
            started.elapsed() < std::time::Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
    }
    stack.signal("sidecar", "CONT").unwrap();
    assert!(engines.iter().all(|&e| e == engines[0]), "{engines:?}");
    let stat = |name: &'static str| {
        let stack = &stack;
        async move { stack.envoy_stat(name).await.unwrap_or(0) }
    };
    let timeouts = stat("wasmcustom.kvroute.sidecar.timeouts").await;
    let errors = stat("wasmcustom.kvroute.sidecar.errors").await;
    let fallbacks = stat("wasmcustom.kvroute.fallback.sidecar").await;
    assert!(
        timeouts >= 6 && fallbacks >= 6,
        "timeouts {timeouts}, errors {errors}, fallbacks {fallbacks}"
    );
    // The sidecar answered the calls Envoy had given up on once it ran again: those decisions
    // were never used, and say so once their tickets are reclaimed.
    let waited = wait_for(
        "the late decisions to show as not reported",
        std::time::Duration::from_secs(20),
        || async {
            let explained = sidecar_json(&stack, "/debug/explain").await;
            let entries = explained.as_array()?.clone();
            (!entries.is_empty() && entries.iter().all(|e| e["outcome"] == "not_reported"))
                .then_some(())
        },
    )
    .await;
    if let Err(e) = waited {
        let explained = sidecar_json(&stack, "/debug/explain").await;
        let outcomes: Vec<_> = explained
            .as_array()
            .into_iter()
            .flatten()
            .map(|e| (e["outcome"].clone(), e["request_id"].clone()))
            .collect();
        let metrics = stack.sidecar_metrics().await.unwrap_or_default();
        let tickets: Vec<_> =
            kvroute_harness::prometheus::series(&metrics, "kvroute_tickets").collect();
        panic!(
            "{e}: decisions (outcome, request id) {outcomes:?}; tickets {tickets:?}; {}",
            stack.log_tail("sidecar")
        );
    }
}

/// A worker Envoy ejects (outlier detection after consecutive 5xx) is never hinted again,
/// although it holds the longest prefix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ejected_worker_is_never_hinted() {
    let stack = Stack::start(StackOptions::new("ejected", Mode::Kvroute))
        .await
        .expect("stack starts");
    // Prompts only engine 1 holds, each sent once through Envoy below: every one is hinted to
    // engine 1 first (a retry stores it elsewhere, so a prompt cannot be reused).
    let prompts: Vec<(String, String)> = (0..8)
        .map(|i| (text(90 + i, 200), text(190 + i, 60)))
        .collect();
    for (system, user) in &prompts {
        let warmed = direct(&stack, 1, &chat(system, user)).await;
        wait_indexed(&stack, 1, (warmed.prompt_tokens / 16) as f64).await;
    }
    let (system, user) = &prompts[0];
    let o = via_envoy(&stack, &chat(system, &format!("{user} more"))).await;
    assert_eq!(served_by(&o), 1);
    // Engine 1 shuts down (500s, as vLLM's); Envoy retries each and ejects it after three.
    let addr = stack.engines[1].address.clone();
    let down = stack
        .http
        .post(format!("http://{addr}/admin/health"))
        .body("down");
    assert!(down.send().await.unwrap().status().is_success());
    let series = format!("kvroute_worker_usable{{worker=\"{addr}\"}}");
    let mut failed = 0;
    for (system, user) in &prompts[1..] {
        let o = via_envoy(&stack, &chat(system, &format!("{user} more"))).await;
        failed += usize::from(!o.ok());
        tokio::time::sleep(std::time::Duration::from_millis(150)).await;
        let metrics = stack.sidecar_metrics().await.unwrap();
        if metric(&metrics, &series) == Some(0.0) {
            break;
        }
    }
    // Envoy retries each 500 on the next hinted worker, so clients see none of them.
    assert_eq!(failed, 0, "a shutdown 500 reached the client");
    assert!(
        engine_metric(&stack, 1, "kvroute_sim:requests_failed_total").await >= 3.0,
        "Envoy ejects after 3 consecutive 5xx"
    );
    let metrics = stack.sidecar_metrics().await.unwrap();
    assert_eq!(
        metric(&metrics, &series),
        Some(0.0),
        "the sidecar saw the ejection"
    );
    for i in 0..10 {
        let o = via_envoy(
            &stack,
            &chat(system, &format!("{user} {}", text(100 + i, 4))),
        )
        .await;
        assert_ne!(served_by(&o), 1, "request {i} went to the ejected engine");
    }
    let explain = sidecar_json(&stack, "/debug/explain").await;
    let latest = &explain[0]["decision"];
    let candidates = latest["candidates"].as_array().unwrap();
    assert!(
        candidates.iter().all(|c| c["worker"] != addr.as_str()),
        "{latest}"
    );
}

/// Envoy's outlier ejection ends on a timer (2 s here) whether the engine is back or not. A
/// worker whose engine still fails its health check when the ejection ends is not hinted
/// again (the sidecar asks it `GET /health` and says why in a line); once it answers, it is
/// usable and hinted again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_envoy_stops_ejecting_is_hinted_only_once_it_answers() {
    let mut opts = StackOptions::new("revived", Mode::Kvroute);
    opts.ejection_s = Some(2);
    let stack = Stack::start(opts).await.expect("stack starts");
    // Prompts only engine 1 holds: each is hinted to it first (a retry stores it elsewhere, so
    // each is sent once while the engine fails).
    let prompts: Vec<String> = (0..9).map(|i| text(700 + i, 200)).collect();
    let kept = text(799, 200);
    for system in prompts.iter().chain([&kept]) {
        let warmed = direct(&stack, 1, &chat(system, "warm")).await;
        wait_indexed(&stack, 1, (warmed.prompt_tokens / 16) as f64).await;
    }
    let addr = stack.engines[1].address.clone();
    let series = format!("kvroute_worker_usable{{worker=\"{addr}\"}}");
    let usable = || async { metric(&stack.sidecar_metrics().await.unwrap(), &series) };
    engine_admin_body(&stack, &addr, "health", "down").await;
    for system in &prompts[1..] {
        let o = via_envoy(&stack, &chat(system, "more")).await;
        assert!(
            o.ok(),
            "Envoy retries a failed engine's 500s elsewhere: {o:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(150)).await;
        if usable().await == Some(0.0) {
            break;
        }
    }
    assert_eq!(usable().await, Some(0.0), "the sidecar saw the ejection");
    // The ejection ends (2 s, checked every 1 s); the engine still fails its health check.
    tokio::time::sleep(std::time::Duration::from_secs(5)).await;
    assert_eq!(usable().await, Some(0.0), "hinted again while down");
    let line = "Envoy no longer ejects this worker, but it does not answer GET /health";
    let log = std::fs::read_to_string(stack.dir.join("sidecar.log")).unwrap();
    assert!(log.contains(line), "{log}");
    for i in 0..4 {
        let o = via_envoy(&stack, &chat(&prompts[0], &text(720 + i, 5))).await;
        assert_ne!(
            served_by(&o),
            1,
            "request {i} went to the engine that is down"
        );
    }
    // It answers again: usable and hinted again.
    engine_admin_body(&stack, &addr, "health", "up").await;
    wait_for(
        "usable again",
        std::time::Duration::from_secs(5),
        || async { (usable().await == Some(1.0)).then_some(()) },
    )
    .await
    .unwrap();
    let o = via_envoy(&stack, &chat(&kept, "again")).await;
    assert_eq!(served_by(&o), 1, "its cache is the only one: {o:?}");
}

/// When the best worker fails a request, Envoy's retry goes to the second-best cache, not to a
/// random host: the hint is an ordered list and override_host walks it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_goes_to_the_second_best_worker() {
    let stack = Stack::start(StackOptions::new("retry", Mode::Kvroute))
        .await
        .expect("stack starts");
    let system = text(500, 120);
    let user = text(501, 120);
    // Engine 2 holds the whole prompt, engine 0 its system part only, engines 1 and 3 nothing.
    let (best, second) = (2, 0);
    let full = direct(&stack, best, &chat(&system, &user)).await;
    let part = direct(&stack, second, &chat(&system, &text(502, 3))).await;
    wait_indexed(&stack, best, (full.prompt_tokens / 16) as f64).await;
    wait_indexed(&stack, second, (part.prompt_tokens / 16 - 1) as f64).await;

    let fail_once = stack
        .http
        .post(format!(
            "http://{}/admin/fail_next",
            stack.engines[best].address
        ))
        .body("1");
    assert!(fail_once.send().await.unwrap().status().is_success());
    let o = via_envoy(&stack, &chat(&system, &format!("{user} again"))).await;
    assert_eq!(served_by(&o), second, "the retry left the hint list");
    assert!(
        o.cached_tokens >= part.prompt_tokens / 16 * 16 - 16,
        "the retry missed the second-best cache: {o:?}"
    );
    assert_eq!(
        engine_metric(&stack, best, "kvroute_sim:requests_failed_total").await,
        1.0,
        "the best worker was tried first"
    );
    assert!(
        stack
            .envoy_stat("cluster.workers.upstream_rq_retry")
            .await
            .unwrap()
            >= 1
    );
}

/// The shipped maglev variant keeps affinity without the sidecar too: one prefix, one engine;
/// sessions spread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maglev_fallback_keeps_affinity() {
    let mut opts = StackOptions::new("maglev", Mode::Kvroute);
    opts.fallback = Fallback::Maglev;
    let mut stack = Stack::start(opts).await.expect("stack starts");
    stack.kill("sidecar");
    let system = text(600, 200);
    let mut engines = Vec::new();
    for i in 0..8 {
        engines.push(served_by(
            &via_envoy(&stack, &chat(&system, &text(610 + i, 10))).await,
        ));
    }
    assert!(engines.iter().all(|&e| e == engines[0]), "{engines:?}");
    let mut spread = std::collections::HashSet::new();
    for i in 0..12 {
        let o = via_envoy(&stack, &chat(&text(700 + i, 200), "hi")).await;
        spread.insert(served_by(&o));
    }
    assert!(spread.len() > 1, "maglev sent every prefix to one engine");
}
