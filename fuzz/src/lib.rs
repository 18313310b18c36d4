//! The fuzz targets, as plain functions: each takes any bytes and must return without panicking.
//!
//! cargo-fuzz runs them under libFuzzer (`fuzz_targets/*.rs`, `make fuzz`, nightly); on stable,
//! `tests/replay.rs` replays the seed corpus (`corpus/<target>/`) and a bounded run of mutations
//! of it in `make test`. [`TARGETS`] lists them for both.

use std::sync::OnceLock;

use kvroute_filter::config::FilterConfig;
use kvroute_filter::models::ModelRegistry;
use kvroute_prompt::request::LlmRequest;
use kvroute_prompt::Preprocessor;

/// A fuzz target: any bytes in, no panic out.
pub type Target = fn(&[u8]);

/// Every target, by the name of its corpus directory and cargo-fuzz binary.
pub const TARGETS: &[(&str, Target)] = &[
    ("vllm_batch", vllm_batch),
    ("dynamo_message", dynamo_message),
    ("dynamo_zmq_message", dynamo_zmq_message),
    ("hint_request", hint_request),
    ("llm_request", llm_request),
    ("chat_template", chat_template),
    ("filter_plan", filter_plan),
    ("response_usage", response_usage),
];

/// vLLM ZMQ payload and sequence frames.
pub fn vllm_batch(data: &[u8]) {
    let _ = kvroute_protocol::vllm::decode_seq(data);
    let _ = kvroute_protocol::vllm::decode_batch(data);
}

/// Dynamo NATS bodies: event envelopes (1.2, 1.6), JetStream JSON, `kv_metrics`.
pub fn dynamo_message(data: &[u8]) {
    let _ = kvroute_protocol::dynamo::decode_message(data);
    let _ = kvroute_protocol::dynamo::decode_kv_metrics(data);
}

/// Dynamo ZMQ event-plane messages, as capture files hold them (each frame a u32 big-endian
/// length and its bytes): the four frames, the envelope, and both payload kinds.
pub fn dynamo_zmq_message(data: &[u8]) {
    use kvroute_protocol::dynamo_zmq::{decode_frames, frame_payload, split_capture};
    let _ = frame_payload(data);
    if let Some(frames) = split_capture(data) {
        if let Ok(m) = decode_frames(&frames) {
            let _ = m.kv_events();
            let _ = m.kv_metrics();
        }
    }
}

/// What the sidecar reads from the filter: hint requests and finished reports.
pub fn hint_request(data: &[u8]) {
    let _ = kvroute_protocol::hint::HintRequest::decode(data);
    let _ = kvroute_protocol::hint::decode_finished(data);
}

/// What the filter reads from an engine's response: the input as one body, and cut into pieces
/// whose sizes come from its first byte (a key or an object split across pieces).
pub fn response_usage(data: &[u8]) {
    use kvroute_filter::usage::UsageScanner;
    let mut whole = UsageScanner::default();
    whole.feed(data);
    let _ = whole.finish(true);
    let piece = usize::from(data.first().copied().unwrap_or(1)).max(1);
    let mut pieces = UsageScanner::default();
    for chunk in data.chunks(piece) {
        pieces.feed(chunk);
    }
    let _ = pieces.finish(true);
}

/// An OpenAI request body (chat or completion), and the text prefix of its chat.
pub fn llm_request(data: &[u8]) {
    if let Ok(req) = LlmRequest::parse(data) {
        if let kvroute_prompt::request::PromptInput::Chat(chat) = &req.input {
            let _ = chat.text_prefix();
        }
    }
}

/// The model's chat template and tokenizer on any request, and on a chat whose message is
/// the input as text.
pub fn chat_template(data: &[u8]) {
    let pre = preprocessor();
    if let Ok(req) = LlmRequest::parse(data) {
        let _ = pre.render(&req);
        let _ = pre.hashes(&req);
    }
    if let Ok(req) = LlmRequest::parse(&chat_of(data)) {
        let _ = pre.hashes(&req);
    }
}

/// The filter's whole prepare path (parse, model lookup, template, tokenizer, hashes, fallback
/// key) on the input as a body, with and without a session, and on a chat of the input's text.
pub fn filter_plan(data: &[u8]) {
    let (models, config) = registry();
    let _ = kvroute_filter::plan::plan(data, models, config, None);
    let session = String::from_utf8_lossy(&data[..data.len().min(32)]);
    let _ = kvroute_filter::plan::plan(data, models, config, Some(&session));
    let _ = kvroute_filter::plan::plan(&chat_of(data), models, config, None);
}

/// A chat request for the test model whose one user message is `data` as text.
fn chat_of(data: &[u8]) -> Vec<u8> {
    serde_json::json!({
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": String::from_utf8_lossy(data)}],
    })
    .to_string()
    .into_bytes()
}

fn bundle() -> kvroute_protocol::bundle::ModelBundle {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/models/tiny-llama");
    kvroute_prompt::model_dir::load_bundle(std::path::Path::new(dir), "tiny-llama", 16)
        .expect("the example model loads")
}

/// The example model's preprocessor, built once.
fn preprocessor() -> &'static Preprocessor {
    static PRE: OnceLock<Preprocessor> = OnceLock::new();
    PRE.get_or_init(|| Preprocessor::from_bundle(&bundle()).expect("the example bundle builds"))
}

/// A filter registry holding the example model, and the default configuration.
fn registry() -> &'static (ModelRegistry, FilterConfig) {
    static REG: OnceLock<(ModelRegistry, FilterConfig)> = OnceLock::new();
    REG.get_or_init(|| {
        let (mut models, config) = (ModelRegistry::default(), FilterConfig::default());
        let body = serde_json::to_vec(&bundle()).expect("a bundle serializes");
        models
            .install(&body, config.token_cache_bytes)
            .expect("the example bundle installs");
        (models, config)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plan target reaches the end of the path (a hint to ask for), not just the parser.
    #[test]
    fn a_seed_chat_is_planned_to_the_end() {
        let seed = include_bytes!("../corpus/filter_plan/chat0.json");
        let (models, config) = registry();
        let planned = kvroute_filter::plan::plan(seed, models, config, None);
        assert!(
            planned.blocks > 0 && planned.fallback().is_none(),
            "{planned:?}"
        );
        let text = kvroute_filter::plan::plan(&chat_of(b"hello world"), models, config, None);
        assert!(text.key.is_some(), "{text:?}");
    }
}
