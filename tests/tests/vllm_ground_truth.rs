//! Ground truth from a real engine: the request bodies sent to vLLM 0.32 in the captured run,
//! prepared by kvroute (template, tokenizer, special tokens) with the model's own tokenizer
//! directory, give exactly the token ids vLLM published for its cached blocks — so kvroute's
//! block hashes of a request equal the ones its index derives from the engine's events.

use std::collections::HashMap;

use kvroute_prompt::model_dir::load_bundle;
use kvroute_prompt::request::LlmRequest;
use kvroute_prompt::Preprocessor;
use kvroute_protocol::hash::{local_block_hash, prefix_hashes, token_prefix_hashes};
use kvroute_protocol::vllm::{decode_batch, EngineBlockHash, VllmEvent};
use kvroute_protocol::{HashSeed, LocalBlockHash};

const BLOCK: usize = 32;

#[test]
fn requests_tokenize_to_the_token_ids_vllm_published() {
    let samples = kvroute_protocol::samples_dir().join("vllm");
    let run = samples.join("run1-sha256-default");
    let bundle = load_bundle(
        &samples.join("tiny-llama-tokenizer"),
        "tiny-llama",
        BLOCK as u32,
    )
    .expect("the captured model's tokenizer directory loads");
    let pre = Preprocessor::from_bundle(&bundle).unwrap();

    // Every stored block of the run: engine hash → (parent, its tokens).
    let mut blocks: HashMap<Option<EngineBlockHash>, Vec<(EngineBlockHash, Vec<u32>)>> =
        HashMap::new();
    let mut raw: Vec<_> = std::fs::read_dir(run.join("raw"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".payload.msgpack"))
        .collect();
    raw.sort();
    for path in raw {
        for event in decode_batch(&std::fs::read(path).unwrap()).unwrap().events {
            if let VllmEvent::BlockStored {
                block_hashes,
                parent,
                token_ids,
                ..
            } = event
            {
                let mut parent = parent;
                for (h, tokens) in block_hashes.iter().zip(token_ids.chunks(BLOCK)) {
                    blocks
                        .entry(parent)
                        .or_default()
                        .push((*h, tokens.to_vec()));
                    parent = Some(*h);
                }
            }
        }
    }

    let requests: Vec<serde_json::Value> =
        serde_json::from_slice(&std::fs::read(run.join("requests.json")).unwrap()).unwrap();
    assert_eq!(requests.len(), 7);
    let mut checked_blocks = 0;
    for r in &requests {
        let name = r["name"].as_str().unwrap();
        let body = serde_json::to_vec(&r["body"]).unwrap();
        let tokens = pre.tokens(&LlmRequest::parse(&body).unwrap()).unwrap();
        assert_eq!(
            tokens.len() as u64,
            r["usage"]["prompt_tokens"].as_u64().unwrap(),
            "{name}: prompt length differs from vLLM's usage"
        );
        // Walk the engine's stored chain block by block with our tokens.
        let mut parent = None;
        let mut locals: Vec<LocalBlockHash> = Vec::new();
        for (i, want) in tokens.chunks_exact(BLOCK).enumerate() {
            let next = blocks
                .get(&parent)
                .and_then(|c| c.iter().find(|(_, t)| t == want))
                .unwrap_or_else(|| {
                    panic!(
                        "{name}: block {i} differs from every block vLLM stored after its parent"
                    )
                });
            locals.push(local_block_hash(&next.1, HashSeed::default()));
            parent = Some(next.0);
        }
        checked_blocks += locals.len();
        assert_eq!(
            prefix_hashes(&locals),
            token_prefix_hashes(&tokens, BLOCK, HashSeed::default()),
            "{name}"
        );
    }
    // Six prompts span 9–12 blocks; the seventh is shorter than one block (length still checked).
    assert!(checked_blocks >= 60, "{checked_blocks}");
}
