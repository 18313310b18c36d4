//! Sending requests the way a client would, and measuring what it sees.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures::StreamExt;
use indicatif::ProgressBar;
use serde_json::Value;

use crate::workload::Session;

/// The body of `GET url` as text; `None` when the request or reading it fails (a process not
/// up yet, a connection reset): what polling loops want.
pub async fn get_text(http: &reqwest::Client, url: &str) -> Option<String> {
    http.get(url).send().await.ok()?.text().await.ok()
}

/// The JSON body of `GET url` (`Value::Null` when the request or its body fails).
pub async fn get_json(http: &reqwest::Client, url: &str) -> Value {
    match http.get(url).send().await {
        Ok(r) => r.json().await.unwrap_or(Value::Null),
        Err(_) => Value::Null,
    }
}

/// Response header naming the simulated engine that served a request.
pub const ENGINE_HEADER: &str = "x-sim-engine";

/// What one request saw.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// HTTP status (0: no response).
    pub status: u16,
    /// Transport or protocol error, if any.
    pub error: Option<String>,
    /// Time to the first streamed chunk.
    pub ttft: Duration,
    /// Time to the last byte of the answer (streamed requests).
    pub latency: Duration,
    /// Prompt tokens, as the engine counted them.
    pub prompt_tokens: u64,
    /// Prompt tokens served from the engine's prefix cache.
    pub cached_tokens: u64,
    /// Index of the engine that served it.
    pub engine: Option<usize>,
    /// How long it waited at the engine for a free slot (the simulator reports it).
    pub slot_wait_us: u64,
    /// Dynamo: the (prefill, decode) worker instance ids that served it, when the request asked
    /// for them (`"nvext": {"extra_fields": ["worker_id"]}`).
    pub dynamo_workers: Option<(u64, u64)>,
    /// [`Target::Spread`]: which of the routers it was sent to.
    pub router: Option<usize>,
    /// [`run_sessions`]: the session it belongs to and its turn there.
    pub session: usize,
    /// See `session`.
    pub turn: usize,
}

impl Outcome {
    /// Whether the request succeeded.
    pub fn ok(&self) -> bool {
        self.status == 200 && self.error.is_none()
    }

    /// Take the prompt and cached tokens from an OpenAI `usage` object.
    fn read_usage(&mut self, usage: &Value) {
        self.prompt_tokens = usage["prompt_tokens"].as_u64().unwrap_or(0);
        self.cached_tokens = usage
            .pointer("/prompt_tokens_details/cached_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(0);
    }
}

/// POST `body` as JSON: the response with an outcome holding its status, or an outcome saying
/// why there is none.
async fn post_json(
    http: &reqwest::Client,
    url: &str,
    body: &Value,
    request_id: Option<&str>,
) -> Result<(reqwest::Response, Outcome), Outcome> {
    let mut post = http
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_string());
    if let Some(id) = request_id {
        post = post.header("x-request-id", id);
    }
    match post.send().await {
        Ok(resp) => {
            let out = Outcome {
                status: resp.status().as_u16(),
                ..Outcome::default()
            };
            Ok((resp, out))
        }
        Err(e) => Err(Outcome {
            error: Some(e.to_string()),
            ..Outcome::default()
        }),
    }
}

/// Send one request without streaming (`stream: false`): the whole answer in one JSON body.
pub async fn send_whole(http: &reqwest::Client, url: &str, body: &Value) -> Outcome {
    let mut body = body.clone();
    body["stream"] = Value::Bool(false);
    let start = Instant::now();
    let (resp, mut out) = match post_json(http, url, &body, None).await {
        Ok(r) => r,
        Err(out) => return out,
    };
    out.engine = resp
        .headers()
        .get(ENGINE_HEADER)
        .and_then(|v| v.to_str().ok()?.parse().ok());
    let answer: Value = match resp.json().await {
        Ok(v) => v,
        Err(e) => {
            out.error = Some(e.to_string());
            return out;
        }
    };
    out.ttft = start.elapsed();
    match answer.get("usage").filter(|u| !u.is_null()) {
        Some(usage) => out.read_usage(usage),
        None if out.status == 200 => out.error = Some("no usage in the answer".into()),
        None => {}
    }
    out
}

/// Send one request streaming (`stream: true` with usage) and measure it.
pub async fn send_streaming(http: &reqwest::Client, url: &str, body: &Value) -> Outcome {
    send_streaming_as(http, url, body, None).await
}

/// [`send_streaming`] with an `x-request-id`, which Envoy's access log then names.
pub async fn send_streaming_as(
    http: &reqwest::Client,
    url: &str,
    body: &Value,
    request_id: Option<&str>,
) -> Outcome {
    let mut body = body.clone();
    body["stream"] = Value::Bool(true);
    body["stream_options"] = serde_json::json!({"include_usage": true});
    let start = Instant::now();
    let (resp, mut out) = match post_json(http, url, &body, request_id).await {
        Ok(r) => r,
        Err(out) => return out,
    };
    if out.status != 200 {
        let text = resp.text().await.unwrap_or_default();
        out.error = Some(text.chars().take(200).collect());
        return out;
    }
    out.engine = resp
        .headers()
        .get(ENGINE_HEADER)
        .and_then(|v| v.to_str().ok()?.parse().ok());
    let mut text = Vec::new();
    let mut stream = resp.bytes_stream();
    let mut first = true;
    while let Some(chunk) = stream.next().await {
        match chunk {
            Ok(bytes) => {
                if first {
                    out.ttft = start.elapsed();
                    first = false;
                }
                text.extend_from_slice(&bytes);
            }
            Err(e) => {
                out.error = Some(e.to_string());
                return out;
            }
        }
    }
    out.latency = start.elapsed();
    let text = String::from_utf8_lossy(&text);
    for line in text.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        let Ok(v) = serde_json::from_str::<Value>(data) else {
            continue;
        };
        if let Some(ids) = v.pointer("/nvext/worker_id") {
            if let (Some(p), Some(d)) = (
                ids["prefill_worker_id"].as_u64(),
                ids["decode_worker_id"].as_u64(),
            ) {
                out.dynamo_workers = Some((p, d));
            }
        }
        if let Some(usage) = v.get("usage").filter(|u| !u.is_null()) {
            out.read_usage(usage);
            out.slot_wait_us = usage["sim_slot_wait_us"].as_u64().unwrap_or(0);
        }
    }
    if out.status == 200 && out.prompt_tokens == 0 {
        out.error = Some("no usage in the stream".into());
    }
    out
}

/// Send a streamed chat to `base` (Envoy or a Dynamo frontend) with extra headers, e.g. a pin.
pub async fn post_with(base: &str, body: &Value, headers: &[(&str, String)]) -> Outcome {
    let url = format!("{base}/v1/chat/completions");
    let mut map = reqwest::header::HeaderMap::new();
    for (k, v) in headers {
        let (Ok(k), Ok(v)) = (
            reqwest::header::HeaderName::from_bytes(k.as_bytes()),
            reqwest::header::HeaderValue::from_str(v),
        ) else {
            return Outcome {
                error: Some(format!("not a header: {k}: {v}")),
                ..Outcome::default()
            };
        };
        map.insert(k, v);
    }
    let client = reqwest::Client::builder()
        .default_headers(map)
        .timeout(Duration::from_secs(30))
        .build();
    match client {
        Ok(client) => send_streaming(&client, &url, body).await,
        Err(e) => Outcome {
            error: Some(e.to_string()),
            ..Outcome::default()
        },
    }
}

/// How far apart the benchmark's concurrent clients start: the 16 clients of a workload open
/// within 40 ms, as independent users would, instead of at one instant. Starting them together
/// (a gap of zero) sends 16 cold prompts through the proxy in the same microsecond; every proxy
/// that prepares requests then queues them behind each other on its worker threads, which is a
/// thundering-herd measurement, not a routing one (docs/benchmarks.md measures both).
pub const CLIENT_START_GAP: Duration = Duration::from_micros(2500);

/// Where requests go.
#[derive(Debug, Clone)]
pub enum Target {
    /// Through a router at this base URL (Envoy, or a peer router).
    Router(String),
    /// Through several routers, each request to the next one in turn, as a Kubernetes Service
    /// without session affinity spreads requests over an ingress's pods: the turns of one
    /// conversation land on different routers.
    Spread(Vec<String>),
    /// Straight to the engine that holds the longest prefix, asked of every engine's `/oracle`
    /// (perfect knowledge); ties rotate, as kvroute's do. The oracle's questions are not timed.
    Oracle(Vec<String>),
}

/// What the simulated engine at `engine` holds of `body`'s prompt, in blocks (its `/oracle`);
/// 0 when it does not answer.
pub async fn oracle_cached(http: &reqwest::Client, engine: &str, body: &Value) -> u64 {
    let answer = async {
        let r = http
            .post(format!("http://{engine}/oracle"))
            .json(body)
            .send()
            .await
            .ok()?;
        r.json::<Value>().await.ok()?["cached_blocks"].as_u64()
    };
    answer.await.unwrap_or(0)
}

/// What every engine holds of `body`'s prompt ([`oracle_cached`]), asked at once, in order.
pub async fn oracle_cached_all(
    http: &reqwest::Client,
    engines: &[String],
    body: &Value,
) -> Vec<u64> {
    let asks = engines.iter().map(|e| oracle_cached(http, e, body));
    futures::future::join_all(asks).await
}

async fn oracle_pick(
    http: &reqwest::Client,
    engines: &[String],
    body: &Value,
    turn: usize,
) -> usize {
    let cached = oracle_cached_all(http, engines, body).await;
    let best = cached.iter().copied().max().unwrap_or(0);
    let tied: Vec<usize> = (0..engines.len()).filter(|&i| cached[i] == best).collect();
    tied[turn % tied.len()]
}

/// Run `sessions` against `target`, `concurrency` sessions at a time, each session's requests in
/// order; the k-th of the concurrent clients starts `start_gap` × k after the first. Outcomes
/// come back in completion order.
pub async fn run_sessions(
    http: &reqwest::Client,
    target: &Target,
    sessions: &[Session],
    concurrency: usize,
    start_gap: Duration,
    progress: &ProgressBar,
) -> Vec<Outcome> {
    let pace = Pace {
        start_gap,
        think_max: Duration::ZERO,
    };
    run_sessions_paced(http, target, sessions, concurrency, pace, progress).await
}

/// When the clients of [`run_sessions_paced`] send.
#[derive(Debug, Clone, Copy)]
pub struct Pace {
    /// The k-th concurrent client starts this × k after the first.
    pub start_gap: Duration,
    /// Before each turn after a session's first, the user thinks for a time spread evenly over
    /// [0, think_max), the same for the same session and turn in every mode. Without it a
    /// closed loop sends each turn the instant the last answer ends, in lockstep with an engine
    /// that steps on a clock, so a fraction of a step added on the path costs either nothing
    /// or a whole step depending on phase; users' turns arrive at any phase.
    pub think_max: Duration,
}

impl Pace {
    /// How long the user of `session` thinks before `turn`.
    pub fn think(&self, session: usize, turn: usize) -> Duration {
        if turn == 0 || self.think_max.is_zero() {
            return Duration::ZERO;
        }
        // A fixed, evenly spread fraction per (session, turn).
        let draw = crate::workload::Rng::new((session as u64) << 32 | turn as u64).next_u64();
        self.think_max
            .mul_f64((draw >> 11) as f64 / (1u64 << 53) as f64)
    }
}

/// [`run_sessions`] with users who think between turns.
pub async fn run_sessions_paced(
    http: &reqwest::Client,
    target: &Target,
    sessions: &[Session],
    concurrency: usize,
    pace: Pace,
    progress: &ProgressBar,
) -> Vec<Outcome> {
    let next = Mutex::new(0usize);
    let sent = std::sync::atomic::AtomicUsize::new(0);
    let sent = &sent;
    let total: usize = sessions.iter().map(|s| s.bodies.len()).sum();
    let outcomes = Mutex::new(Vec::with_capacity(total));
    let (next, outcomes_ref) = (&next, &outcomes);
    let worker = |k: u32| async move {
        tokio::time::sleep(pace.start_gap * k).await;
        loop {
            let index = {
                let mut n = next.lock().unwrap_or_else(|e| e.into_inner());
                if *n >= sessions.len() {
                    return;
                }
                *n += 1;
                *n - 1
            };
            let session = &sessions[index];
            for (turn, body) in session.bodies.iter().enumerate() {
                tokio::time::sleep(pace.think(index, turn)).await;
                let mut router = None;
                let url = match target {
                    Target::Router(base) => format!("{base}{}", session.path),
                    Target::Spread(bases) => {
                        let i = sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                            % bases.len().max(1);
                        router = Some(i);
                        format!("{}{}", bases[i], session.path)
                    }
                    Target::Oracle(engines) => {
                        let pick = oracle_pick(http, engines, body, index).await;
                        format!("http://{}{}", engines[pick], session.path)
                    }
                };
                let mut o = send_streaming(http, &url, body).await;
                o.router = router;
                o.session = index;
                o.turn = turn;
                outcomes_ref
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(o);
                progress.inc(1);
            }
        }
    };
    let clients = u32::try_from(concurrency.max(1)).unwrap_or(u32::MAX);
    futures::future::join_all((0..clients).map(worker)).await;
    outcomes.into_inner().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Think times are the same for the same turn, none before a first turn, and spread over
    /// the whole range.
    #[test]
    fn users_think_evenly_and_repeatably() {
        let pace = Pace {
            start_gap: Duration::ZERO,
            think_max: Duration::from_millis(20),
        };
        assert_eq!(pace.think(3, 0), Duration::ZERO);
        assert_eq!(pace.think(3, 2), pace.think(3, 2));
        let times: Vec<f64> = (0..200)
            .flat_map(|s| (1..5).map(move |t| (s, t)))
            .map(|(s, t)| pace.think(s, t).as_secs_f64() * 1e3)
            .collect();
        assert!(times.iter().all(|&t| (0.0..20.0).contains(&t)));
        for quarter in 0..4 {
            let lo = f64::from(quarter) * 5.0;
            let n = times.iter().filter(|&&t| t >= lo && t < lo + 5.0).count();
            assert!(
                (150..250).contains(&n),
                "{n} of 800 in [{lo}, {}) ms",
                lo + 5.0
            );
        }
        let still = Pace {
            think_max: Duration::ZERO,
            ..pace
        };
        assert_eq!(still.think(3, 2), Duration::ZERO);
    }
}
