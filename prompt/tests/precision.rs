//! The precision fixtures (`fixtures/precision`, written by its `generate.py` with `transformers`
//! and `tokenizers`): six locally trained tokenizers × six chat-template families, each pair an
//! HF-style model directory, × every request in `requests.json`. Loaded the way the sidecar
//! loads a model, kvroute must render the same prompt and produce the same token ids — or refuse
//! the request when the template refuses it.

use std::collections::BTreeMap;
use std::path::PathBuf;

use kvroute_prompt::model_dir::load_bundle;
use kvroute_prompt::{LlmRequest, Preprocessor, PromptHashes};
use serde::Deserialize;
use serde_json::Value;

/// One model directory's expectations.
#[derive(Deserialize)]
struct ModelCases {
    family: String,
    ids: Vec<Option<Vec<u32>>>,
}

/// `expected.json`.
#[derive(Deserialize)]
struct Expected {
    prompts: BTreeMap<String, Vec<Value>>,
    models: BTreeMap<String, ModelCases>,
}

#[test]
fn every_fixture_renders_and_tokenizes_like_transformers() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/precision");
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap();
    let expected: Expected = serde_json::from_str(&read("expected.json")).unwrap();
    let requests: Vec<Value> = serde_json::from_str(&read("requests.json")).unwrap();
    let mut failures = Vec::new();
    let mut checked = 0;
    for (model, cases) in &expected.models {
        let loaded = load_bundle(&dir.join("models").join(model), model, 16)
            .map_err(|e| e.to_string())
            .and_then(|b| Preprocessor::from_bundle(&b).map_err(|e| e.to_string()));
        let pre = match loaded {
            Ok(p) => p,
            Err(e) => {
                failures.push(format!("{model}: does not load: {e}"));
                continue;
            }
        };
        for (i, body) in requests.iter().enumerate() {
            checked += 1;
            let req = LlmRequest::parse(body.to_string().as_bytes()).unwrap();
            let rendered = pre.render(&req);
            match (&expected.prompts[&cases.family][i], &rendered) {
                (Value::Object(refused), Ok(got)) => {
                    let why = &refused["error"];
                    failures.push(format!(
                        "{model} #{i}: transformers refused ({why}), we rendered {got:?}"
                    ));
                    continue;
                }
                (Value::Object(_), Err(_)) => continue,
                (_, Err(e)) => {
                    failures.push(format!("{model} #{i}: we refused: {e}"));
                    continue;
                }
                (Value::String(want), Ok(Some(got))) if want != got => {
                    failures.push(format!(
                        "{model} #{i}: prompt differs\n  want {want:?}\n  got  {got:?}"
                    ));
                    continue;
                }
                _ => {}
            }
            let want = cases.ids[i].as_ref().expect("ids of a rendered prompt");
            match pre.tokens(&req) {
                Ok(got) if &got == want => {}
                Ok(got) => failures.push(format!(
                    "{model} #{i}: ids differ\n  want {want:?}\n  got  {got:?}"
                )),
                Err(e) => failures.push(format!("{model} #{i}: tokenizing failed: {e}")),
            }
        }
    }
    assert!(checked >= 36 * 30, "only {checked} cases");
    assert!(
        failures.is_empty(),
        "{} of {checked} cases differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// With the token cache ([`Preprocessor::with_token_cache`]) every fixture's ids are still
/// transformers' own: each request cold, then again with every segment of every request seen
/// (the warm pass finds them in the cache), then conversations that grow turn by turn. The
/// `bpe-special` tokenizer has every template family's special tokens (`</think>` with
/// `rstrip`, `<tool_call>` with `lstrip` among them), so its six models are cut between
/// messages; the other tokenizers know few of them, and a model whose sample chat holds none
/// has no cache.
#[test]
fn the_token_cache_gives_every_fixture_transformers_ids() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/precision");
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap();
    let expected: Expected = serde_json::from_str(&read("expected.json")).unwrap();
    let requests: Vec<Value> = serde_json::from_str(&read("requests.json")).unwrap();
    let (mut failures, mut checked, mut found, mut histories) = (Vec::new(), 0, 0u64, 0);
    let mut uncut = Vec::new();
    for (model, cases) in &expected.models {
        let bundle = load_bundle(&dir.join("models").join(model), model, 16).unwrap();
        let plain = Preprocessor::from_bundle(&bundle).unwrap();
        let pre = Preprocessor::from_bundle(&bundle)
            .unwrap()
            .with_token_cache(&bundle, 1 << 20);
        if pre.token_cache().is_none() {
            uncut.push(model.clone());
        }
        for pass in ["cold", "warm"] {
            for (i, body) in requests.iter().enumerate() {
                let Some(want) = &cases.ids[i] else { continue };
                let req = LlmRequest::parse(body.to_string().as_bytes()).unwrap();
                checked += 1;
                // Block hashes through the cache are the plain preprocessor's.
                let hashes = plain.hashes(&req).map(|h| h.hashes).ok();
                // A history found whole leaves its ids out: they are checked by its hashes.
                let is_want = |got: &PromptHashes| want.get(got.known..) == Some(&got.tokens[..]);
                match pre.hashes(&req) {
                    Ok(got) if is_want(&got) && Some(&got.hashes) != hashes.as_ref() => {
                        failures.push(format!("{model} #{i} ({pass}): block hashes differ"))
                    }
                    Ok(got) if is_want(&got) => found += u64::from(got.segments.found),
                    Ok(got) => failures.push(format!(
                        "{model} #{i} ({pass}): ids differ\n  want {want:?}\n  got  {:?}",
                        got.tokens
                    )),
                    Err(e) => failures.push(format!("{model} #{i} ({pass}): {e}")),
                }
            }
        }
        // A conversation growing turn by turn, against the same model without a cache.
        let mut messages = vec![serde_json::json!({"role": "system", "content": "Be brief."})];
        for turn in 0..6 {
            messages.push(serde_json::json!({"role": "user", "content": format!("Question {turn}: why   is\tthe sky blue? ")}));
            let body = serde_json::json!({"model": model, "messages": messages});
            let req = LlmRequest::parse(body.to_string().as_bytes()).unwrap();
            checked += 1;
            match (plain.hashes(&req), pre.hashes(&req)) {
                (Ok(want), Ok(got))
                    if (&want.tokens[got.known..], &want.hashes)
                        == (&got.tokens[..], &got.hashes) =>
                {
                    histories += u32::from(got.segments.history > 0);
                }
                (Err(_), Err(_)) => {}
                (want, got) => failures.push(format!(
                    "{model} turn {turn}: {:?} against {:?}",
                    want.map(|w| (w.tokens, w.hashes)),
                    got.map(|g| (g.tokens, g.hashes))
                )),
            }
            messages.push(
                serde_json::json!({"role": "assistant", "content": format!(" Answer {turn}.\n")}),
            );
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {checked} cases differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert!(
        uncut.iter().all(|m| !m.starts_with("bpe-special")),
        "no token cache for {uncut:?}"
    );
    assert!(
        found > checked as u64,
        "segments found: {found} in {checked} cases"
    );
    // Every cut model's growing conversation found its history whole from its third turn on
    // (the first two hold less than a block before their last segment).
    assert!(
        histories >= 6 * 3,
        "turns that found their history: {histories}"
    );
}
