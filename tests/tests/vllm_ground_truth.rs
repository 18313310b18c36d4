//! Ground truth from a real engine: the request bodies sent to vLLM 0.32 in the captured run,
//! prepared by kvroute (template, tokenizer, special tokens) with the model's own tokenizer
//! directory, give exactly the token ids vLLM published for its cached blocks — so kvroute's
//! block hashes of a request equal the ones its index derives from the engine's events. And the
//! simulated engine, sent the same requests, publishes the block hashes vLLM published.

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

/// Every block hash the simulator publishes over ZMQ for run1's requests is one vLLM published
/// in that run (same tokens, same chain from vLLM's `NONE_HASH`): peers that route on vLLM's own
/// hashes see what a real vLLM would send them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_simulator_publishes_vllms_own_block_hashes() {
    use std::collections::HashSet;
    use std::time::Duration;

    use kvroute_harness::process::{wait_for, Process};
    use kvroute_harness::{paths, Mode, Stack, StackOptions};

    let run = kvroute_protocol::samples_dir().join("vllm/run1-sha256-default");
    let mut published_by_vllm = HashSet::new();
    for entry in std::fs::read_dir(run.join("raw")).unwrap() {
        let path = entry.unwrap().path();
        if !path.to_string_lossy().ends_with(".payload.msgpack") {
            continue;
        }
        for event in decode_batch(&std::fs::read(path).unwrap()).unwrap().events {
            if let VllmEvent::BlockStored { block_hashes, .. } = event {
                published_by_vllm.extend(block_hashes);
            }
        }
    }

    let mut opts = StackOptions::new("sim-vllm-hashes", Mode::RoundRobin);
    opts.sim.engines = 1;
    opts.sim.block_size = BLOCK as u32;
    opts.sim.event_formats = vec!["vllm-map".into()];
    let stack = Stack::start(opts).await.expect("stack starts");
    let endpoint = stack.engines[0].zmq_endpoint.clone().unwrap();
    let mut tap = std::process::Command::new(paths::binary("kvroute-sidecar").unwrap());
    tap.args(["tap", "--zmq", &endpoint]);
    let _tap = Process::spawn("tap", tap, &stack.dir).unwrap();
    let log = stack.dir.join("tap.log");
    let published = |log: std::path::PathBuf| -> Vec<EngineBlockHash> {
        std::fs::read_to_string(log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["event"]["type"] == "BlockStored")
            .flat_map(|v| {
                v["event"]["block_hashes"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
                    .into_iter()
                    .filter_map(|h| h.as_u64().map(EngineBlockHash))
            })
            .collect()
    };
    // A subscriber misses what is published before it joins: warm up with throwaway prompts
    // until the tap shows events.
    let url = format!("http://{}", stack.engines[0].address);
    let (http, url_ref, log_ref) = (&stack.http, &url, &log);
    let mut n = 0u32;
    wait_for("the tap to receive events", Duration::from_secs(20), || {
        n += 1;
        let prompt = format!("warm-up {n} ").repeat(40);
        async move {
            http.post(format!("{url_ref}/v1/completions"))
                .json(
                    &serde_json::json!({"model": "tiny-llama", "prompt": prompt, "max_tokens": 1}),
                )
                .send()
                .await
                .ok()?;
            tokio::time::sleep(Duration::from_millis(200)).await;
            (!published(log_ref.clone()).is_empty()).then_some(())
        }
    })
    .await
    .expect("the simulator publishes on ZMQ");
    let before: HashSet<_> = published(log.clone()).into_iter().collect();

    let requests: Vec<serde_json::Value> =
        serde_json::from_slice(&std::fs::read(run.join("requests.json")).unwrap()).unwrap();
    for r in &requests {
        let resp = stack
            .http
            .post(format!("{url}{}", r["path"].as_str().unwrap()))
            .json(&r["body"])
            .send()
            .await
            .unwrap();
        assert!(resp.status().is_success(), "{}", r["name"]);
    }
    // The responses are back, so the events are on their way; vLLM stored 26 distinct blocks
    // for these prompts (later prompts share earlier ones' prefixes).
    let log_ref = &log;
    let before_ref = &before;
    let ours = wait_for(
        "run1's blocks published",
        Duration::from_secs(10),
        || async move {
            let new: Vec<_> = published(log_ref.clone())
                .into_iter()
                .filter(|h| !before_ref.contains(h))
                .collect();
            (new.len() >= 20).then_some(new)
        },
    )
    .await
    .expect("the simulator publishes run1's blocks");
    let foreign: Vec<_> = ours
        .iter()
        .filter(|h| !published_by_vllm.contains(h))
        .collect();
    assert!(
        foreign.is_empty(),
        "{} of {} block hashes were never published by vLLM: {foreign:?}",
        foreign.len(),
        ours.len()
    );
}
