//! What the filter does with a request: pure decisions, no host calls.

use kvroute_prompt::{LlmRequest, PromptError, PromptInput, SegmentUse};
use kvroute_protocol::hint::{HintRequest, HintResponse};
use xxhash_rust::xxh3::xxh3_64;

use crate::config::FilterConfig;
use crate::metrics::FallbackReason;
use crate::models::ModelRegistry;

/// The request paths kvroute routes; everything else passes through untouched.
pub const ROUTED_PATHS: [&str; 2] = ["/v1/chat/completions", "/v1/completions"];

/// Whether the request headers describe a routable LLM request whose body should be read.
///
/// The content type is not checked: clients (curl -d among them) often send JSON labelled as a
/// form, and engines parse it anyway; a body that is not JSON falls back like any bad body.
pub fn wants_body(method: Option<&str>, path: Option<&str>) -> bool {
    let path = path.unwrap_or_default();
    let path = path.split_once('?').map_or(path, |(p, _)| p);
    method == Some("POST") && ROUTED_PATHS.contains(&path)
}

/// What to do with a complete body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Value for the fallback key header (what ring hash / maglev hash on), if any.
    pub key: Option<String>,
    /// Ask the sidecar, or go on unhinted: always exactly one of them.
    pub next: Next,
    /// Full blocks in the prompt (0 when it was not tokenized).
    pub blocks: usize,
    /// What the token cache did for it.
    pub segments: SegmentUse,
}

/// What a planned request does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// Send this hint request to the sidecar.
    Ask(HintRequest),
    /// Go on unhinted, for this reason.
    Fallback(FallbackReason),
}

impl Plan {
    /// The hint request, when the sidecar is asked.
    pub fn hint(&self) -> Option<&HintRequest> {
        match &self.next {
            Next::Ask(h) => Some(h),
            Next::Fallback(_) => None,
        }
    }

    /// Why no hint is asked for, when it is not.
    pub fn fallback(&self) -> Option<FallbackReason> {
        match self.next {
            Next::Ask(_) => None,
            Next::Fallback(r) => Some(r),
        }
    }
}

/// Decide what to do with a complete request body; `session` is the session header's value.
pub fn plan(
    body: &[u8],
    models: &ModelRegistry,
    cfg: &FilterConfig,
    session: Option<&str>,
) -> Plan {
    let unhinted = |key, reason| Plan {
        key,
        next: Next::Fallback(reason),
        blocks: 0,
        segments: SegmentUse::default(),
    };
    let req = match LlmRequest::parse(body) {
        Ok(r) => r,
        Err(_) => return unhinted(None, FallbackReason::BadRequest),
    };
    let session = session
        .or(req.user.as_deref())
        .filter(|s| !s.is_empty())
        .map(|s| hex(xxh3_64(s.as_bytes())));
    let requested = req.model.clone();
    let Some((base, model, adapter)) = models.resolve(&requested) else {
        return unhinted(
            Some(session.unwrap_or_else(|| text_key(&req))),
            FallbackReason::NoBundle,
        );
    };
    let (base, adapter) = (base.to_owned(), adapter.map(str::to_owned));
    let mut req = req;
    if req.lora.is_none() {
        // vLLM hashes (and names in its events) an adapter's blocks with the adapter.
        req.lora = adapter;
    }
    let hashed = match model.preprocessor.hashes(&req) {
        Ok(h) => h,
        Err(e) => {
            let reason = match e {
                PromptError::Request(_) => FallbackReason::BadRequest,
                PromptError::Template(_) => FallbackReason::Template,
                PromptError::Tokenizer(_) => FallbackReason::Tokenizer,
            };
            return unhinted(Some(session.unwrap_or_else(|| text_key(&req))), reason);
        }
    };
    let blocks = hashed.hashes.len();
    if blocks == 0 {
        let bytes: Vec<u8> = hashed.tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        let key = session.unwrap_or_else(|| hex(xxh3_64(&bytes)));
        return unhinted(Some(key), FallbackReason::NoBlocks);
    }
    // The prefix hash of block K names the first K blocks: stable across the turns of a
    // conversation and shared by requests with the same leading K blocks.
    let key =
        Some(session.unwrap_or_else(|| {
            hex(hashed.hashes[blocks.min(cfg.fallback_key_blocks.max(1)) - 1].0)
        }));
    if !cfg.hints {
        return Plan {
            blocks,
            segments: hashed.segments,
            ..unhinted(key, FallbackReason::HintsDisabled)
        };
    }
    Plan {
        key,
        next: Next::Ask(HintRequest {
            model: base,
            hashes: hashed.hashes,
            finished: Vec::new(),
        }),
        blocks,
        segments: hashed.segments,
    }
}

/// Run one synthetic chat request for `model` through the whole request path (parse, template,
/// tokenizer, hashes, the hint request, a hint answer) and return its planned block count.
///
/// The first request through a freshly loaded bundle pays first-use costs (allocations, caches)
/// that the first real requests would otherwise pay while a burst queues behind them on the
/// worker thread (docs/benchmarks.md, "A synchronized cold burst").
pub fn warm_up(models: &ModelRegistry, cfg: &FilterConfig, model: &str) -> usize {
    // One user turn: the one conversation shape every chat template accepts.
    let text = "kvroute warm-up: exercise the template and the tokenizer once. ".repeat(32);
    let body = serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": text}],
    });
    let planned = plan(body.to_string().as_bytes(), models, cfg, None);
    if let Some(hint) = planned.hint() {
        let _ = hint.encode();
    }
    let answer = HintResponse {
        workers: vec!["127.0.0.1:1".into()],
        matched_blocks: 1,
        ..HintResponse::default()
    };
    let _ = serde_json::to_vec(&answer)
        .ok()
        .and_then(|b| serde_json::from_slice::<HintResponse>(&b).ok())
        .and_then(|h| h.target());
    planned.blocks
}

/// A fallback key without tokens: the messages up to the first user turn (or the prompt).
fn text_key(req: &LlmRequest) -> String {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(req.model.as_bytes());
    match &req.input {
        PromptInput::Chat(chat) => {
            for m in &chat.messages {
                h.update(m.to_string().as_bytes());
                if m.get_attr("role").is_ok_and(|r| r.as_str() == Some("user")) {
                    break;
                }
            }
        }
        PromptInput::Text(text) => {
            h.update(&text.as_bytes()[..text.len().min(4096)]);
        }
        PromptInput::TokenIds(ids) => {
            for t in ids.iter().take(1024) {
                h.update(&t.to_le_bytes());
            }
        }
    }
    hex(h.digest())
}

fn hex(v: u64) -> String {
    format!("{v:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::tests::tiny_bundle;

    fn registry(block_size: u32) -> ModelRegistry {
        let mut reg = ModelRegistry::default();
        reg.install(
            &serde_json::to_vec(&tiny_bundle(block_size)).unwrap(),
            1 << 20,
        )
        .unwrap();
        reg
    }

    fn chat(text: &str) -> Vec<u8> {
        serde_json::json!({"model": "tiny", "messages": [
            {"role": "system", "content": "You are a careful assistant who answers briefly."},
            {"role": "user", "content": text}
        ]})
        .to_string()
        .into_bytes()
    }

    /// The next turns of a chat find their history in the VM's token cache and plan the same
    /// hint a VM without one does.
    #[test]
    fn a_next_turn_finds_its_history_in_the_token_cache() {
        let (cached, cfg) = (registry(4), FilterConfig::default());
        let mut plain = ModelRegistry::default();
        plain
            .install(&serde_json::to_vec(&tiny_bundle(4)).unwrap(), 0)
            .unwrap();
        let turn = |n: usize| {
            let mut messages = vec![serde_json::json!({"role": "system", "content": "Be brief."})];
            for t in 0..n {
                messages
                    .push(serde_json::json!({"role": "user", "content": format!("question {t}")}));
                messages.push(
                    serde_json::json!({"role": "assistant", "content": format!("answer {t}")}),
                );
            }
            serde_json::json!({"model": "tiny", "messages": messages})
                .to_string()
                .into_bytes()
        };
        let first = plan(&turn(3), &cached, &cfg, None);
        assert!(first.segments.tokenized > 0, "{:?}", first.segments);
        let next = plan(&turn(4), &cached, &cfg, None);
        assert_eq!(next.segments.tokenized, 2, "{:?}", next.segments);
        assert!(next.segments.found > 0);
        let uncached = plan(&turn(4), &plain, &cfg, None);
        assert_eq!(uncached.segments, SegmentUse::default());
        assert_eq!(next.hint(), uncached.hint());
        // The turn after finds the history the last one found, whole.
        let after = plan(&turn(5), &cached, &cfg, None);
        assert!(after.segments.history > 0, "{:?}", after.segments);
        assert_eq!(after.hint(), plan(&turn(5), &plain, &cfg, None).hint());
    }

    /// A LoRA adapter served under its own name uses its base model's bundle and index, with
    /// the adapter's hash seed, as vLLM names its blocks.
    #[test]
    fn lora_adapter_models_use_the_base_bundle_with_the_adapter_seed() {
        let mut reg = registry(4);
        let version = reg.get("tiny").unwrap().version.clone();
        let catalog = kvroute_protocol::bundle::Catalog {
            models: vec![kvroute_protocol::bundle::CatalogEntry {
                model: "tiny".into(),
                version,
                adapters: vec!["tiny-sql".into()],
            }],
        };
        assert!(reg.reconcile(&catalog).is_empty());
        let cfg = FilterConfig::default();
        let body = |model: &str, lora: Option<&str>| {
            let mut v: serde_json::Value = serde_json::from_slice(&chat("select it")).unwrap();
            v["model"] = model.into();
            if let Some(l) = lora {
                v["lora_name"] = l.into();
            }
            v.to_string().into_bytes()
        };
        let adapter = plan(&body("tiny-sql", None), &reg, &cfg, None);
        let explicit = plan(&body("tiny", Some("tiny-sql")), &reg, &cfg, None);
        let base = plan(&body("tiny", None), &reg, &cfg, None);
        let (a, e, b) = (
            adapter.hint().unwrap().clone(),
            explicit.hint().unwrap().clone(),
            base.hint().unwrap().clone(),
        );
        assert_eq!(a.model, "tiny", "the hint asks the base model's index");
        assert_eq!(a.hashes, e.hashes);
        assert_ne!(a.hashes, b.hashes, "the adapter seed separates its blocks");
        assert_eq!(
            plan(&body("other-sql", None), &reg, &cfg, None).fallback(),
            Some(FallbackReason::NoBundle)
        );
    }

    #[test]
    fn warm_up_runs_the_whole_request_path() {
        let cfg = FilterConfig::default();
        let blocks = warm_up(&registry(16), &cfg, "tiny");
        assert!(blocks > 4, "{blocks}");
        assert_eq!(warm_up(&registry(16), &cfg, "unknown"), 0);
    }

    #[test]
    fn headers_select_llm_posts_only() {
        assert!(wants_body(Some("POST"), Some("/v1/chat/completions")));
        assert!(wants_body(Some("POST"), Some("/v1/completions?x=1")));
        assert!(!wants_body(Some("GET"), Some("/v1/chat/completions")));
        assert!(!wants_body(Some("POST"), Some("/v1/embeddings")));
        assert!(!wants_body(
            Some("POST"),
            Some("/v1/chat/completions/extra")
        ));
        assert!(!wants_body(None, None));
    }

    #[test]
    fn hashes_and_asks_for_a_hint() {
        let reg = registry(4);
        let cfg = FilterConfig::default();
        let p = plan(
            &chat("tell me about the weather in the mountains today"),
            &reg,
            &cfg,
            None,
        );
        assert_eq!(p.fallback(), None);
        let hint = p.hint().unwrap().clone();
        assert_eq!(hint.model, "tiny");
        assert_eq!(hint.hashes.len(), p.blocks);
        assert!(p.blocks > cfg.fallback_key_blocks);
        assert_eq!(
            p.key.unwrap(),
            hex(hint.hashes[cfg.fallback_key_blocks - 1].0)
        );
    }

    #[test]
    fn fallback_key_is_stable_across_turns() {
        let reg = registry(4);
        let cfg = FilterConfig::default();
        let turn1 = plan(&chat("first question about routing"), &reg, &cfg, None);
        let turn2 = plan(
            &chat("first question about routing, and a follow-up"),
            &reg,
            &cfg,
            None,
        );
        assert_eq!(turn1.key, turn2.key);
    }

    #[test]
    fn a_session_is_the_fallback_key() {
        let reg = registry(4);
        let cfg = FilterConfig::default();
        let body = chat("a question long enough to fill a few blocks of tokens for hashing");
        let by_header = plan(&body, &reg, &cfg, Some("s-1"));
        assert_eq!(by_header.key, Some(hex(xxh3_64(b"s-1"))));
        assert!(
            by_header.hint().is_some(),
            "the session changes the key, not the hint"
        );
        let mut with_user: serde_json::Value = serde_json::from_slice(&body).unwrap();
        with_user["user"] = "u-7".into();
        let by_user = plan(with_user.to_string().as_bytes(), &reg, &cfg, None);
        assert_eq!(by_user.key, Some(hex(xxh3_64(b"u-7"))));
        let header_wins = plan(with_user.to_string().as_bytes(), &reg, &cfg, Some("s-1"));
        assert_eq!(header_wins.key, by_header.key);
        assert_ne!(plan(&body, &reg, &cfg, None).key, by_header.key);
    }

    #[test]
    fn fallbacks_name_their_reason() {
        let reg = registry(16);
        let cfg = FilterConfig::default();
        assert_eq!(
            plan(b"{oops", &reg, &cfg, None).fallback(),
            Some(FallbackReason::BadRequest)
        );
        assert_eq!(plan(b"{oops", &reg, &cfg, None).key, None);
        let other = br#"{"model":"other","messages":[{"role":"user","content":"x"}]}"#;
        let p = plan(other, &reg, &cfg, None);
        assert_eq!(p.fallback(), Some(FallbackReason::NoBundle));
        assert!(p.key.is_some(), "unknown models still get a stable key");
        let short = br#"{"model":"tiny","prompt":"hi"}"#;
        assert_eq!(
            plan(short, &reg, &cfg, None).fallback(),
            Some(FallbackReason::NoBlocks)
        );
        let no_hints = FilterConfig {
            hints: false,
            ..FilterConfig::default()
        };
        let p = plan(
            &chat("a question that is long enough to fill a block or two of tokens"),
            &reg,
            &no_hints,
            None,
        );
        assert_eq!(p.fallback(), Some(FallbackReason::HintsDisabled));
        assert!(p.hint().is_none() && p.key.is_some());
    }
}
