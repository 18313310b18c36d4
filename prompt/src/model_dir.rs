//! Reading an HF-style model directory into a [`ModelBundle`].
//!
//! Files: `tokenizer.json` (required), `tokenizer_config.json` (special tokens, and the chat
//! template when there is no `chat_template.jinja`), `chat_template.jinja` (optional).

use std::path::{Path, PathBuf};

use kvroute_protocol::bundle::ModelBundle;
use serde_json::Value;

use crate::tokenizer::canonicalize;

/// Why a model directory could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ModelDirError {
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// `tokenizer_config.json` is not JSON.
    #[error("{path}: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The error.
        source: serde_json::Error,
    },
    /// `tokenizer.json` could not be converted to the canonical form.
    #[error("tokenizer.json: {0}")]
    Tokenizer(#[from] crate::TokenizerError),
    /// The bundle does not load in the same code the filter runs.
    #[error("bundle does not load: {0}")]
    Bundle(#[from] crate::BundleError),
}

fn read(path: PathBuf) -> Result<String, ModelDirError> {
    std::fs::read_to_string(&path).map_err(|source| ModelDirError::Io { path, source })
}

/// Load `dir` as the bundle of `model` with `block_size` tokens per KV block.
///
/// The bundle is checked by building a [`crate::Preprocessor`] from it, so a model the filter
/// could not load is reported here, at sidecar start, by name.
pub fn load_bundle(dir: &Path, model: &str, block_size: u32) -> Result<ModelBundle, ModelDirError> {
    let tokenizer_json = canonicalize(&read(dir.join("tokenizer.json"))?)?;
    let config_path = dir.join("tokenizer_config.json");
    let config: Value = if config_path.exists() {
        let text = read(config_path.clone())?;
        serde_json::from_str(&text).map_err(|source| ModelDirError::Json {
            path: config_path,
            source,
        })?
    } else {
        Value::Null
    };
    let template_path = dir.join("chat_template.jinja");
    let chat_template = if template_path.exists() {
        Some(read(template_path)?)
    } else {
        template_from_config(&config)
    };
    let mut bundle = ModelBundle {
        model: model.to_owned(),
        version: String::new(),
        block_size,
        tokenizer_json,
        chat_template,
        bos_token: special_token(&config, "bos_token"),
        eos_token: special_token(&config, "eos_token"),
    };
    bundle.version = version_of(&bundle);
    crate::Preprocessor::from_bundle(&bundle)?;
    Ok(bundle)
}

/// `chat_template` in tokenizer_config.json: a string, or a list of named templates.
fn template_from_config(config: &Value) -> Option<String> {
    match config.get("chat_template")? {
        Value::String(s) => Some(s.clone()),
        Value::Array(named) => named
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(str::to_owned),
        _ => None,
    }
}

/// A special token is a string or an AddedToken object with `content`.
fn special_token(config: &Value, key: &str) -> Option<String> {
    match config.get(key)? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_owned),
        _ => None,
    }
}

/// A content hash over everything that changes tokens or hashes.
fn version_of(b: &ModelBundle) -> String {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for part in [
        b.tokenizer_json.as_str(),
        b.chat_template.as_deref().unwrap_or(""),
        b.bos_token.as_deref().unwrap_or(""),
        b.eos_token.as_deref().unwrap_or(""),
    ] {
        h.update(&(part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    h.update(&b.block_size.to_le_bytes());
    format!("{:016x}", h.digest())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_tiny_llama_dir() {
        let dir = kvroute_protocol::samples_dir().join("vllm/tiny-llama-tokenizer");
        let b = load_bundle(&dir, "tiny", 32).unwrap();
        assert_eq!(b.bos_token.as_deref(), Some("<s>"));
        assert_eq!(b.eos_token.as_deref(), Some("</s>"));
        assert!(b.chat_template.unwrap().starts_with("{{ bos_token }}"));
        assert_eq!(b.version.len(), 16);
        let other = load_bundle(&dir, "tiny", 16).unwrap();
        assert_ne!(
            other.version, b.version,
            "block size is part of the version"
        );
    }

    #[test]
    fn missing_dir_is_an_error() {
        let err = load_bundle(Path::new("/nonexistent"), "x", 16).unwrap_err();
        assert!(err.to_string().contains("tokenizer.json"), "{err}");
    }

    #[test]
    fn config_template_shapes() {
        let named = serde_json::json!({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]});
        assert_eq!(template_from_config(&named).as_deref(), Some("D"));
        let tok = serde_json::json!({"bos_token": {"content": "<|begin|>", "lstrip": false}});
        assert_eq!(
            special_token(&tok, "bos_token").as_deref(),
            Some("<|begin|>")
        );
    }
}
