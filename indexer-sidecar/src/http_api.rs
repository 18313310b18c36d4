//! The HTTP API (the `axum` router [`router`] serves it): hints for the filter, bundles, metrics and health.
//!
//! - `POST /v1/hint` — binary [`kvroute_protocol::hint::HintRequest`] in, JSON [`kvroute_protocol::hint::HintResponse`] out.
//! - `POST /v1/finished` — tickets of hinted requests that finished (binary, see the protocol).
//! - `POST /kvroute.Hints/Stream` — both on one gRPC stream per Envoy worker (HTTP/2;
//!   [`crate::hint_stream`]).
//! - `GET /v1/models` — the bundle catalog; `GET /v1/models/{name}/bundle` — one bundle.
//! - `GET /metrics` — Prometheus text; `GET /healthz` — `ok`.
//! - `GET /debug/explain` — the recent decisions: candidates, matched blocks, load, rule
//!   (`?limit=N` the newest N, `?last_block=<hex>` those on one prompt).
//! - `GET /debug/sources` — every event source: state, counters, subjects, last event age.
//! - `GET /debug/discovery` — every `[[dynamo_discovery]]` entry: what its last scan found.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvroute_protocol::headers::REQUEST_ID;
use kvroute_protocol::hint::{decode_finished, FINISHED_PATH, HINT_PATH};
use kvroute_protocol::hint_stream::{self, MAX_REQUEST_ID};

use crate::core::Input;
use crate::explain::ExplainQuery;
use crate::sidecar::Sidecar;

/// The API router.
pub fn router(state: Arc<Sidecar>) -> Router {
    Router::new()
        .route(HINT_PATH, post(hint))
        .route(FINISHED_PATH, post(finished))
        .route(hint_stream::PATH, post(crate::hint_stream::serve))
        .route("/v1/models", get(catalog))
        .route("/v1/models/{name}/bundle", get(bundle))
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/debug/explain", get(explain))
        .route("/debug/sources", get(sources))
        .route("/debug/discovery", get(discovery))
        .route("/debug/replicas", get(replicas))
        .with_state(state)
}

async fn hint(State(state): State<Arc<Sidecar>>, headers: HeaderMap, body: Bytes) -> Response {
    let request_id = headers
        .get(REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|id| id.len() <= MAX_REQUEST_ID);
    let (status, body) = state.answer_hint(&body, request_id);
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let content_type = if status == StatusCode::OK {
        "application/json"
    } else {
        "text/plain; charset=utf-8"
    };
    (status, [(header::CONTENT_TYPE, content_type)], body).into_response()
}

async fn finished(State(state): State<Arc<Sidecar>>, body: Bytes) -> Response {
    match decode_finished(&body) {
        Ok(tickets) => {
            state.ingest(Input::Finished(&tickets), std::time::Instant::now());
            StatusCode::NO_CONTENT.into_response()
        }
        Err(e) => (StatusCode::BAD_REQUEST, e.to_string()).into_response(),
    }
}

fn json_bytes(body: Vec<u8>) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

async fn catalog(State(state): State<Arc<Sidecar>>) -> Response {
    json_bytes(state.bundles.catalog.clone())
}

async fn bundle(State(state): State<Arc<Sidecar>>, Path(name): Path<String>) -> Response {
    match state.bundles.by_model.get(&name) {
        Some(b) => json_bytes(b.clone()),
        None => (StatusCode::NOT_FOUND, format!("no bundle for model {name}")).into_response(),
    }
}

async fn metrics(State(state): State<Arc<Sidecar>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.render_metrics(),
    )
        .into_response()
}

async fn explain(
    State(state): State<Arc<Sidecar>>,
    query: Result<Query<ExplainQuery>, QueryRejection>,
) -> Response {
    match query {
        Ok(Query(query)) => Json(state.explained(&query)).into_response(),
        Err(e) => (StatusCode::BAD_REQUEST, e.body_text()).into_response(),
    }
}

async fn sources(State(state): State<Arc<Sidecar>>) -> Response {
    let sources = state.sources(std::time::Instant::now());
    Json(sources).into_response()
}

async fn discovery(State(state): State<Arc<Sidecar>>) -> Response {
    let entries = state.discovery();
    Json(entries).into_response()
}

async fn replicas(State(state): State<Arc<Sidecar>>) -> Response {
    Json(state.replicas_debug(std::time::Instant::now())).into_response()
}

/// 200 once warm (see `Sidecar::ready`), 503 while warming: hints are served either way.
async fn readyz(State(state): State<Arc<Sidecar>>) -> Response {
    let (ready, why) = state.ready(std::time::Instant::now());
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, why).into_response()
}
