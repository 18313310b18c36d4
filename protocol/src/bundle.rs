//! The model bundle: what the filter needs to turn a request into block hashes.
//!
//! The sidecar reads each served model from a directory (tokenizer.json, tokenizer_config.json,
//! chat template) and serves it as one JSON document; the filter's root context fetches the
//! catalog (`GET /v1/models`) and then each bundle (`GET /v1/models/{name}/bundle`), and fetches
//! a bundle again whenever its `version` changes.

use serde::{Deserialize, Serialize};

/// Path of the catalog of bundles on the sidecar.
pub const CATALOG_PATH: &str = "/v1/models";

/// Path of one model's bundle on the sidecar.
pub fn bundle_path(model: &str) -> String {
    format!("{CATALOG_PATH}/{model}/bundle")
}

/// One entry of the catalog: a model and the version of its bundle.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CatalogEntry {
    /// Served model name (the request's `model` field).
    pub model: String,
    /// Content hash of the bundle: changes whenever any part of it changes.
    pub version: String,
    /// LoRA adapters served on this model under their own names (vLLM `--lora-modules`): a
    /// request naming one uses this bundle, hashed with the adapter's seed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub adapters: Vec<String>,
}

/// The catalog of bundles the sidecar serves.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Catalog {
    /// Every model with a bundle.
    pub models: Vec<CatalogEntry>,
}

/// Everything needed to compute a request's block hashes exactly as the engine sees its tokens.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelBundle {
    /// Served model name.
    pub model: String,
    /// Content hash of this bundle.
    pub version: String,
    /// Tokens per KV block in the engines serving this model.
    pub block_size: u32,
    /// The tokenizer, as canonical `tokenizer.json` text (tokenizers 1.0 form).
    pub tokenizer_json: String,
    /// The chat template (Jinja source), if the model has one.
    #[serde(default)]
    pub chat_template: Option<String>,
    /// Text of the BOS token, passed to the template as `bos_token`.
    #[serde(default)]
    pub bos_token: Option<String>,
    /// Text of the EOS token, passed to the template as `eos_token`.
    #[serde(default)]
    pub eos_token: Option<String>,
}
