//! The precision fixtures (`fixtures/precision`, written by its `generate.py` with `transformers`
//! and `tokenizers`): six locally trained tokenizers × six chat-template families, each pair an
//! HF-style model directory, × every request in `requests.json`. Loaded the way the sidecar
//! loads a model, kvroute must render the same prompt and produce the same token ids — or refuse
//! the request when the template refuses it.

use std::collections::BTreeMap;
use std::path::PathBuf;

use kvroute_prompt::model_dir::load_bundle;
use kvroute_prompt::{LlmRequest, Preprocessor};
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
