//! The precision fixtures (`prompt/fixtures/precision`: six locally trained tokenizers × six
//! chat-template families × every request, token ids from `transformers`) through the real wasm
//! filter in Envoy's V8. The sidecar serves every fixture model directory with one token per
//! block, so the hint's last prefix hash (shown by `/debug/explain`) covers every token id the
//! filter computed: it equals the hash of transformers' ids exactly when the filter matched them.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use common::sidecar_json;
use kvroute_harness::stack::{Mode, Stack, StackOptions};
use kvroute_protocol::hash::token_prefix_hashes;
use kvroute_protocol::HashSeed;
use serde::Deserialize;
use serde_json::Value;

/// One model directory's expected token ids (`None`: the template refuses the request).
#[derive(Deserialize)]
struct ModelCases {
    ids: Vec<Option<Vec<u32>>>,
}

/// The part of `expected.json` this test needs.
#[derive(Deserialize)]
struct Expected {
    models: BTreeMap<String, ModelCases>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_filter_in_envoy_tokenizes_every_fixture_like_transformers() {
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../prompt/fixtures/precision");
    let read = |name: &str| std::fs::read_to_string(fixtures.join(name)).unwrap();
    let expected: Expected = serde_json::from_str(&read("expected.json")).unwrap();
    let requests: Vec<Value> = serde_json::from_str(&read("requests.json")).unwrap();

    let mut opts = StackOptions::new("precision", Mode::Kvroute);
    for model in expected.models.keys() {
        let dir = fixtures.join("models").join(model);
        opts.sidecar_toml.push_str(&format!(
            "[[models]]\nname = \"{model}\"\ndir = \"{}\"\nblock_size = 1\n\n",
            dir.display()
        ));
    }
    let stack = Stack::start(opts).await.expect("stack starts");
    // The stack waits for the simulator's model; wait for every fixture bundle in every VM too.
    let wanted = (expected.models.len() as u64 + 1) * 3;
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while stack
        .envoy_stat("wasmcustom.kvroute.bundles.loaded")
        .await
        .unwrap_or(0)
        < wanted
    {
        assert!(
            std::time::Instant::now() < deadline,
            "bundles not loaded in time"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let template_fallbacks = || async {
        stack
            .envoy_stat("wasmcustom.kvroute.fallback.template")
            .await
            .unwrap_or(0)
    };
    let refused_before = template_fallbacks().await;
    let (mut checked, mut refused, mut failures) = (0, 0, Vec::new());
    // The `bpe-special` models (every template family's special tokens, so chats are cut
    // between messages) go three times: the second time the filter's token cache holds every
    // segment, the third every chat's history whole.
    let cut = || {
        expected
            .models
            .iter()
            .filter(|(m, _)| m.starts_with("bpe-special"))
    };
    let passes = expected.models.iter().chain(cut()).chain(cut());
    for (model, cases) in passes {
        for (i, body) in requests.iter().enumerate() {
            let mut body = body.clone();
            body["model"] = model.as_str().into();
            let path = if body.get("messages").is_some() {
                "/v1/chat/completions"
            } else {
                "/v1/completions"
            };
            // The engines do not serve the fixture models (they answer 404); only the hint the
            // filter computed on the way matters here.
            stack
                .http
                .post(format!("{}{path}", stack.envoy_url))
                .json(&body)
                .send()
                .await
                .unwrap();
            let Some(ids) = &cases.ids[i] else {
                refused += 1;
                continue;
            };
            checked += 1;
            let want = token_prefix_hashes(ids, 1, HashSeed::for_request(None, None))
                .last()
                .map(|h| format!("{:016x}", h.0));
            let recent = sidecar_json(&stack, "/debug/explain").await;
            let seen = recent.as_array().unwrap().iter().any(|d| {
                d["model"] == model.as_str()
                    && d["prompt_blocks"] == ids.len()
                    && d["last_block"].as_str() == want.as_deref()
            });
            if !seen {
                failures.push(format!("{model} #{i}"));
            }
        }
    }
    assert!(checked >= 36 * 30, "only {checked} cases");
    let found = stack
        .envoy_stat("wasmcustom.kvroute.token_cache.found")
        .await
        .unwrap_or(0);
    assert!(
        found >= 6 * 30,
        "segments found in the token cache: {found}"
    );
    let histories = stack
        .envoy_stat("wasmcustom.kvroute.token_cache.histories")
        .await
        .unwrap_or(0);
    assert!(
        histories >= 6 * 10,
        "prompts whose history the token cache found: {histories}"
    );
    assert_eq!(
        stack
            .envoy_stat("wasmcustom.kvroute.token_cache.mismatches")
            .await,
        Some(0)
    );
    assert!(
        failures.is_empty(),
        "{} of {checked} requests hashed differently in Envoy: {}",
        failures.len(),
        failures.join(", ")
    );
    assert_eq!(
        template_fallbacks().await - refused_before,
        refused,
        "every request the template refuses is routed by fallback"
    );
}
