//! kvroute-protocol: everything the filter, the sidecar and the simulated engines must agree on.
//!
//! No I/O lives here, and the crate builds for `wasm32-wasip1` as well as natively.
//!
//! - [`hash`]: the Dynamo-compatible per-block hash ([`LocalBlockHash`]) and the prefix
//!   (sequence) hash ([`PrefixHash`]) that identifies a block *and everything before it*.
//! - [`hint`]: the filter ↔ sidecar hint exchange (`POST /v1/hint`).
//! - [`hint_stream`]: the same exchange on one long-lived gRPC stream per Envoy worker.
//! - [`bundle`]: the model bundle the filter fetches from the sidecar (tokenizer, template, block size).
//! - [`dynamo`]: NVIDIA Dynamo's KV-event wire format on NATS (msgpack envelope and `RouterEvent`).
//! - [`dynamo_zmq`]: Dynamo's ZMQ event plane (the default): four-frame messages around the
//!   same envelope.
//! - [`vllm`]: vLLM's native KV-event stream on ZMQ (frames, batches, both event encodings).

pub mod bundle;
pub mod dynamo;
pub mod dynamo_zmq;
pub mod hash;
pub mod headers;
pub mod hint;
pub mod hint_stream;
mod msgpack;
pub mod vllm;

pub use hash::{HashSeed, LocalBlockHash, PrefixHash};

/// Where the captured samples of real engines live (`testdata/samples` in the workspace). Used by
/// golden tests across the workspace.
pub fn samples_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/samples")
}

/// The token ids of the prompt captured from Dynamo (`dynamo/hash_golden.json`, block size 16),
/// whose block hashes the captured KV events carry. Panics if the samples are missing: it is
/// only for golden tests.
pub fn golden_dynamo_prompt() -> Vec<u32> {
    let path = samples_dir().join("dynamo/hash_golden.json");
    let golden: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    golden["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}
