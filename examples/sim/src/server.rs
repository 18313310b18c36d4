//! The OpenAI-compatible HTTP face of an engine, with vLLM's metric names.
//!
//! Test hooks in the request body, beside the OpenAI fields (no engine sends these shapes on
//! purpose; tests need them to show that kvroute passes any response through unchanged):
//! `"sim_usage": "omit"` answers without any usage, `"sim_usage": "malformed"` with
//! `"prompt_tokens": "many"`, `"sim_pad_bytes": n` adds an n-byte `sim_pad` string to every
//! streamed chunk (a huge stream), and `"sim_content_type": "not_utf8"` labels a JSON answer
//! with a content type that is not UTF-8 (obs-text, which HTTP allows).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvroute_prompt::LlmRequest;
use serde_json::{json, Value};

use crate::engine::{Engine, Running};

/// A router that answers every completion at once without reading the prompt: the "upstream
/// that answers instantly" of the data-path benchmark, so only the proxy's cost is measured.
/// The answer is shaped like an engine's: 128 tokens of text, then the usage with its details.
pub fn instant_router(index: usize) -> Router {
    let answer = Arc::new(
        json!({"id": "instant", "object": "chat.completion", "model": "instant",
        "choices": [{"index": 0, "finish_reason": "length",
            "message": {"role": "assistant", "content": " token".repeat(128)}}],
        "usage": {"prompt_tokens": 1000, "completion_tokens": 128, "total_tokens": 1128,
            "prompt_tokens_details": {"cached_tokens": 0}}}),
    );
    // The body is read before answering: replying mid-upload would make the proxy see resets.
    let answer = move |_body: Bytes| {
        let answer = Arc::clone(&answer);
        async move { Json((*answer).clone()) }
    };
    Router::new()
        .route("/v1/chat/completions", post(answer.clone()))
        .route("/v1/completions", post(answer))
        .route("/health", get(|| async { "" }))
        .layer(axum::extract::DefaultBodyLimit::max(64 << 20))
        .layer(axum::middleware::map_response(
            move |mut resp: Response| async move {
                resp.headers_mut().insert(
                    header::HeaderName::from_static(ENGINE_HEADER),
                    header::HeaderValue::from(index),
                );
                resp
            },
        ))
}

/// A stand-in for a Dynamo frontend in front of the engines: a request carrying
/// `x-worker-instance-id` (or `x-prefill-instance-id`) is served by that instance, as Dynamo 1.6's
/// frontend does; an id it does
/// not know (an instance that is gone) is a 400 `Invalid request`, as Dynamo answers; others go
/// round robin.
pub fn frontend_router(engines: Vec<(u64, Router)>) -> Router {
    let engines = Arc::new(engines);
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    Router::new().fallback(move |req: axum::extract::Request| {
        let (engines, next) = (engines.clone(), next.clone());
        async move {
            let pinned = [INSTANCE_HEADER, PREFILL_INSTANCE_HEADER]
                .iter()
                .find_map(|h| req.headers().get(*h))
                .and_then(|v| v.to_str().ok())
                .map(|v| v.trim().parse::<u64>());
            let engine = match pinned {
                Some(Ok(id)) => engines.iter().find(|(e, _)| *e == id),
                Some(Err(_)) => None,
                None => engines.get(next.fetch_add(1, Ordering::Relaxed) % engines.len().max(1)),
            };
            match engine {
                Some((_, router)) => match tower::ServiceExt::oneshot(router.clone(), req).await {
                    Ok(resp) => resp,
                    Err(never) => match never {},
                },
                None => error(StatusCode::BAD_REQUEST, "Invalid request".into()),
            }
        }
    })
}

/// The header a Dynamo frontend reads to serve a request on one worker instance.
pub const INSTANCE_HEADER: &str = kvroute_protocol::headers::INSTANCE;
/// The header a Dynamo frontend (router mode `kv`) reads to prefill a request on one prefill
/// instance of a disaggregated fleet (the stand-in serves the whole request there).
pub const PREFILL_INSTANCE_HEADER: &str = kvroute_protocol::headers::PREFILL_INSTANCE;

/// Response header naming the engine that served a request (for tests and the demo).
pub const ENGINE_HEADER: &str = "x-sim-engine";

/// The engine's router. Every response names the engine in [`ENGINE_HEADER`].
pub fn router(engine: Arc<Engine>) -> Router {
    let id = header::HeaderValue::from(engine.config.index);
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/admin/health", post(set_health))
        .route("/admin/fail_next", post(set_fail_next))
        .route("/admin/drop_events", post(set_drop_events))
        .route("/admin/restart", post(restart))
        .route("/admin/evict_silently", post(evict_silently))
        .route("/metrics", get(metrics))
        .route("/oracle", post(oracle))
        .route("/tokenize", post(tokenize))
        .route("/v1/chat/completions/render", post(render))
        .route("/v1/completions/render", post(render))
        // vLLM takes bodies of any size and rejects prompts by length, not bytes.
        .layer(axum::extract::DefaultBodyLimit::max(64 << 20))
        .layer(axum::middleware::map_response(move |mut resp: Response| {
            let id = id.clone();
            async move {
                resp.headers_mut()
                    .insert(header::HeaderName::from_static(ENGINE_HEADER), id);
                resp
            }
        }))
        .with_state(engine)
}

fn error(status: StatusCode, message: String) -> Response {
    let body = json!({"object": "error", "message": message, "type": "BadRequestError", "code": status.as_u16()});
    (status, Json(body)).into_response()
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Api {
    Chat,
    Completions,
}

async fn chat(State(engine): State<Arc<Engine>>, body: Bytes) -> Response {
    generate(engine, body, Api::Chat).await
}

async fn completions(State(engine): State<Arc<Engine>>, body: Bytes) -> Response {
    generate(engine, body, Api::Completions).await
}

async fn generate(engine: Arc<Engine>, body: Bytes, api: Api) -> Response {
    let stats = &engine.stats;
    let fail_one = stats
        .fail_next
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
        .is_ok();
    if fail_one {
        stats.failed.fetch_add(1, Ordering::Relaxed);
        return error(StatusCode::SERVICE_UNAVAILABLE, "engine overloaded".into());
    }
    if stats.unhealthy.load(Ordering::Relaxed) {
        // What vLLM 0.32 answers to requests that arrive while it shuts down.
        stats.failed.fetch_add(1, Ordering::Relaxed);
        return error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "cannot schedule new futures after shutdown".into(),
        );
    }
    let req = match LlmRequest::parse(&body) {
        Ok(r) => r,
        Err(e) => return error(StatusCode::BAD_REQUEST, e.to_string()),
    };
    if req.model != engine.config.model {
        return error(
            StatusCode::NOT_FOUND,
            format!("model {} is not served here", req.model),
        );
    }
    let extras: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let max_tokens = extras
        .get("max_tokens")
        .or_else(|| extras.get("max_completion_tokens"))
        .and_then(Value::as_u64)
        .map_or(engine.config.default_output_tokens, |n| {
            n.clamp(1, 4096) as u32
        });
    let include_usage = extras
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let shape = Shape {
        usage: match extras.get("sim_usage").and_then(Value::as_str) {
            Some("omit") => UsageShape::Omit,
            Some("malformed") => UsageShape::Malformed,
            _ => UsageShape::Normal,
        },
        pad: extras
            .get("sim_pad_bytes")
            .and_then(Value::as_u64)
            .map_or(0, |n| n.min(1 << 20) as usize),
    };
    let running = match engine.prefill(&req).await {
        Ok(None) => {
            let limit = engine.config.max_model_len;
            return error(
                StatusCode::BAD_REQUEST,
                format!("This model's maximum context length is {limit} tokens"),
            );
        }
        Ok(Some(r)) => r,
        Err(e) => return error(StatusCode::BAD_REQUEST, e.to_string()),
    };
    if req.stream {
        let stream = token_stream(
            engine.clone(),
            running,
            api,
            req.model,
            max_tokens,
            include_usage,
            shape,
        );
        return (
            [(header::CONTENT_TYPE, "text/event-stream")],
            Body::from_stream(stream),
        )
            .into_response();
    }
    engine.decode_all(max_tokens).await;
    let text = " token".repeat(max_tokens as usize);
    let choice = match api {
        Api::Chat => {
            json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"})
        }
        Api::Completions => json!({"index": 0, "text": text, "finish_reason": "length"}),
    };
    let object = match api {
        Api::Chat => "chat.completion",
        Api::Completions => "text_completion",
    };
    let mut body = json!({
        "id": format!("sim-{}", engine.config.index),
        "object": object,
        "model": req.model,
        "choices": [choice],
    });
    if let Some(u) = shape.usage(&running, max_tokens) {
        body["usage"] = u;
    }
    drop(running);
    let mut response = Json(body).into_response();
    if extras.get("sim_content_type").and_then(Value::as_str) == Some("not_utf8") {
        if let Ok(odd) = header::HeaderValue::from_bytes(b"application/json; note=\xff") {
            response.headers_mut().insert(header::CONTENT_TYPE, odd);
        }
    }
    response
}

/// The test hooks' answer shape.
#[derive(Clone, Copy)]
struct Shape {
    usage: UsageShape,
    pad: usize,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum UsageShape {
    Normal,
    Omit,
    Malformed,
}

impl Shape {
    fn usage(self, running: &Running, completion_tokens: u32) -> Option<Value> {
        match self.usage {
            UsageShape::Normal => Some(usage(running, completion_tokens)),
            UsageShape::Omit => None,
            UsageShape::Malformed => Some(json!({"prompt_tokens": "many"})),
        }
    }
}

fn usage(running: &Running, completion_tokens: u32) -> Value {
    let p = running.prefilled;
    json!({
        "prompt_tokens": p.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": p.prompt_tokens + completion_tokens as usize,
        "prompt_tokens_details": {"cached_tokens": p.cached_tokens},
        // Not OpenAI's: how long the request queued for a slot (the benchmark records it).
        "sim_slot_wait_us": p.slot_wait.as_micros() as u64,
    })
}

/// Server-sent events: the first token right after prefill (that is the TTFT), then one per
/// decode step, then the usage chunk (when asked for) and `[DONE]`.
fn token_stream(
    engine: Arc<Engine>,
    running: Running,
    api: Api,
    model: String,
    max_tokens: u32,
    include_usage: bool,
    shape: Shape,
) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> {
    let object = match api {
        Api::Chat => "chat.completion.chunk",
        Api::Completions => "text_completion",
    };
    let pad = "p".repeat(shape.pad);
    let chunk = move |choices: Value, usage: Option<Value>| {
        let mut v = json!({"id": "sim", "object": object, "model": model, "choices": choices});
        if let Some(u) = usage {
            v["usage"] = u;
        }
        if !pad.is_empty() {
            v["sim_pad"] = Value::String(pad.clone());
        }
        Bytes::from(format!("data: {v}\n\n"))
    };
    let delta = move |last: bool| {
        let finish = if last { json!("length") } else { Value::Null };
        match api {
            Api::Chat => {
                json!([{"index": 0, "delta": {"content": " token"}, "finish_reason": finish}])
            }
            Api::Completions => json!([{"index": 0, "text": " token", "finish_reason": finish}]),
        }
    };
    let decode = engine.decode(max_tokens.saturating_sub(1));
    futures::stream::unfold((0u32, Some((running, decode))), move |(sent, state)| {
        let chunk = chunk.clone();
        async move {
            let (running, mut decode) = state?;
            if sent > 0 && sent < max_tokens {
                decode.next().await;
            }
            if sent < max_tokens {
                let out = chunk(delta(sent + 1 == max_tokens), None);
                return Some((Ok(out), (sent + 1, Some((running, decode)))));
            }
            let mut tail = Vec::new();
            if let Some(u) = shape.usage(&running, max_tokens).filter(|_| include_usage) {
                tail.extend_from_slice(&chunk(json!([]), Some(u)));
            }
            tail.extend_from_slice(b"data: [DONE]\n\n");
            drop(running);
            Some((Ok(Bytes::from(tail)), (sent + 1, None)))
        }
    })
}

async fn health(State(engine): State<Arc<Engine>>) -> StatusCode {
    if engine.stats.unhealthy.load(Ordering::Relaxed) {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    }
}

/// `POST /admin/health` with `up` or `down`: the test hook that makes `/health` fail with 503
/// and every completion with 500, as vLLM does while it shuts down.
async fn set_health(State(engine): State<Arc<Engine>>, body: String) -> StatusCode {
    let down = match body.trim() {
        "down" => true,
        "up" => false,
        _ => return StatusCode::BAD_REQUEST,
    };
    engine.stats.unhealthy.store(down, Ordering::Relaxed);
    StatusCode::OK
}

/// `POST /admin/fail_next` with a count: the next that many completions fail with 503.
async fn set_fail_next(State(engine): State<Arc<Engine>>, body: String) -> StatusCode {
    match body.trim().parse::<u64>() {
        Ok(n) => {
            engine.stats.fail_next.store(n, Ordering::Relaxed);
            StatusCode::OK
        }
        Err(_) => StatusCode::BAD_REQUEST,
    }
}

/// `POST /admin/drop_events` with a count: that many next KV-event messages are left out of
/// the live stream (still in the replay buffer), as a slow subscriber would miss them.
async fn set_drop_events(State(engine): State<Arc<Engine>>, body: String) -> StatusCode {
    match body.trim().parse::<u64>() {
        Ok(n) => {
            engine.stats.drop_events.store(n, Ordering::Relaxed);
            StatusCode::OK
        }
        Err(_) => StatusCode::BAD_REQUEST,
    }
}

/// `POST /admin/restart`: the engine comes back with an empty cache and its event sequence
/// starts over, as a restarted vLLM process would.
async fn restart(State(engine): State<Arc<Engine>>) -> StatusCode {
    engine.restart();
    StatusCode::OK
}

/// `POST /admin/evict_silently`: the cache is emptied and no event says so, as if every
/// removal were lost on its way to the routers.
async fn evict_silently(State(engine): State<Arc<Engine>>) -> StatusCode {
    engine.evict_silently();
    StatusCode::OK
}

async fn models(State(engine): State<Arc<Engine>>) -> Json<Value> {
    Json(
        json!({"object": "list", "data": [{"id": engine.config.model, "object": "model", "owned_by": "kvroute-sim"}]}),
    )
}

async fn metrics(State(engine): State<Arc<Engine>>) -> Response {
    let s = &engine.stats;
    let labels = format!(
        "model_name=\"{}\",engine=\"{}\"",
        engine.config.model, engine.config.index
    );
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, value: String| {
        out.push_str(&format!(
            "# TYPE {name} {kind}\n{name}{{{labels}}} {value}\n"
        ));
    };
    metric(
        "vllm:num_requests_running",
        "gauge",
        s.running.load(Ordering::Relaxed).to_string(),
    );
    metric(
        "vllm:num_requests_waiting",
        "gauge",
        s.waiting.load(Ordering::Relaxed).to_string(),
    );
    metric(
        "vllm:kv_cache_usage_perc",
        "gauge",
        format!("{:.6}", engine.kv_usage()),
    );
    metric(
        "vllm:prefix_cache_queries_total",
        "counter",
        s.prefix_queries.load(Ordering::Relaxed).to_string(),
    );
    metric(
        "vllm:prefix_cache_hits_total",
        "counter",
        s.prefix_hits.load(Ordering::Relaxed).to_string(),
    );
    metric(
        "kvroute_sim:evicted_blocks_total",
        "counter",
        s.evicted_blocks.load(Ordering::Relaxed).to_string(),
    );
    metric(
        "kvroute_sim:requests_failed_total",
        "counter",
        s.failed.load(Ordering::Relaxed).to_string(),
    );
    metric(
        "vllm:request_success_total",
        "counter",
        s.requests.load(Ordering::Relaxed).to_string(),
    );
    if !engine.config.metrics_delay.is_zero() {
        tokio::time::sleep(engine.config.metrics_delay).await;
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}

/// vLLM's `POST /tokenize`: `{"count", "max_model_len", "tokens"}` for a prompt or messages.
async fn tokenize(State(engine): State<Arc<Engine>>, body: Bytes) -> Response {
    match LlmRequest::parse(&body).map_err(kvroute_prompt::PromptError::from).and_then(|r| engine.tokens(&r)) {
        Ok(tokens) => Json(json!({"count": tokens.len(), "max_model_len": engine.config.max_model_len, "tokens": tokens}))
            .into_response(),
        Err(e) => error(StatusCode::BAD_REQUEST, e.to_string()),
    }
}

/// vLLM's render endpoints (what a router calls to learn a request's tokens without running
/// it): the prompt text and its token ids.
async fn render(State(engine): State<Arc<Engine>>, body: Bytes) -> Response {
    let result = LlmRequest::parse(&body)
        .map_err(kvroute_prompt::PromptError::from)
        .and_then(|r| Ok((engine.render(&r)?, engine.tokens(&r)?)));
    match result {
        Ok((prompt, tokens)) => {
            Json(json!({"prompt": prompt, "token_ids": tokens, "prompt_token_ids": tokens}))
                .into_response()
        }
        Err(e) => error(StatusCode::BAD_REQUEST, e.to_string()),
    }
}

/// `POST /oracle` with a request body: `{"cached_blocks": n, "prompt_blocks": m}` right now.
async fn oracle(State(engine): State<Arc<Engine>>, body: Bytes) -> Response {
    let result = LlmRequest::parse(&body)
        .map_err(kvroute_prompt::PromptError::from)
        .and_then(|req| engine.cached_blocks(&req));
    match result {
        Ok((cached, total)) => {
            Json(json!({"cached_blocks": cached, "prompt_blocks": total})).into_response()
        }
        Err(e) => error(StatusCode::BAD_REQUEST, e.to_string()),
    }
}
