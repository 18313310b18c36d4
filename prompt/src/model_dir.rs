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
    let tokenizer_path = dir.join("tokenizer.json");
    let raw: Value = serde_json::from_str(&read(tokenizer_path.clone())?).map_err(|source| {
        ModelDirError::Json {
            path: tokenizer_path,
            source,
        }
    })?;
    let tokenizer_json = canonicalize(&with_config_tokens(raw, &config).to_string())?;
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

/// The special tokens `transformers` reads from `tokenizer_config.json`, in the order it adds them.
const SPECIAL_TOKEN_KEYS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// `tokenizer.json` with the tokens `tokenizer_config.json` declares but it lacks, added the way
/// `transformers` adds them when it loads the tokenizer (and so the way vLLM tokenizes): each
/// `added_tokens_decoder` entry at its id, then every special token (`bos_token`…,
/// `additional_special_tokens`) as a special added token that is matched before normalization —
/// at its vocabulary id if the model has the piece, else at the next free id. Without this a
/// template's `<|im_end|>` would be split into pieces here while the engine sees one token.
fn with_config_tokens(mut tokenizer: Value, config: &Value) -> Value {
    let vocab_id = |tokenizer: &Value, piece: &str| -> Option<u64> {
        match tokenizer.pointer("/model/vocab")? {
            Value::Object(map) => map.get(piece)?.as_u64(),
            Value::Array(pieces) => pieces
                .iter()
                .position(|p| p.get(0).and_then(Value::as_str) == Some(piece))
                .map(|i| i as u64),
            _ => None,
        }
    };
    let vocab_len = |tokenizer: &Value| -> u64 {
        match tokenizer.pointer("/model/vocab") {
            Some(Value::Object(map)) => map
                .values()
                .filter_map(Value::as_u64)
                .max()
                .map_or(0, |m| m + 1),
            Some(Value::Array(pieces)) => pieces.len() as u64,
            _ => 0,
        }
    };
    let mut wanted: Vec<(Option<u64>, Value)> = Vec::new();
    if let Some(Value::Object(decoder)) = config.get("added_tokens_decoder") {
        for (id, token) in decoder {
            if let (Ok(id), Some(content)) = (id.parse::<u64>(), token.get("content")) {
                if content.is_string() {
                    wanted.push((Some(id), token.clone()));
                }
            }
        }
    }
    let as_token = |v: &Value| -> Option<Value> {
        let content = match v {
            Value::String(s) => s.clone(),
            Value::Object(o) => o.get("content")?.as_str()?.to_owned(),
            _ => return None,
        };
        let flag = |key: &str| v.get(key).and_then(Value::as_bool).unwrap_or(false);
        Some(serde_json::json!({
            "content": content,
            "single_word": flag("single_word"),
            "lstrip": flag("lstrip"),
            "rstrip": flag("rstrip"),
            "normalized": false,
            "special": true,
        }))
    };
    let specials = SPECIAL_TOKEN_KEYS
        .iter()
        .filter_map(|k| config.get(*k))
        .chain(
            config
                .get("additional_special_tokens")
                .and_then(Value::as_array)
                .into_iter()
                .flatten(),
        );
    wanted.extend(specials.filter_map(as_token).map(|t| (None, t)));
    for (id, mut token) in wanted {
        let Some(content) = token
            .get("content")
            .and_then(Value::as_str)
            .map(str::to_owned)
        else {
            continue;
        };
        let added = tokenizer
            .get("added_tokens")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        if added
            .iter()
            .any(|t| t.get("content").and_then(Value::as_str) == Some(&content))
        {
            continue;
        }
        let next = added
            .iter()
            .filter_map(|t| t.get("id").and_then(Value::as_u64))
            .map(|i| i + 1)
            .chain([vocab_len(&tokenizer)])
            .max()
            .unwrap_or(0);
        let id = id
            .or_else(|| vocab_id(&tokenizer, &content))
            .unwrap_or(next);
        token["id"] = id.into();
        for (key, default) in [
            ("single_word", false),
            ("lstrip", false),
            ("rstrip", false),
            ("normalized", false),
            ("special", true),
        ] {
            if token.get(key).and_then(Value::as_bool).is_none() {
                token[key] = default.into();
            }
        }
        if let Some(Value::Array(list)) = tokenizer.get_mut("added_tokens") {
            list.push(token);
        } else {
            tokenizer["added_tokens"] = Value::Array(vec![token]);
        }
    }
    tokenizer
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
    fn config_special_tokens_are_added_as_transformers_adds_them() {
        let tokenizer = serde_json::json!({
            "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "<s>": 2}},
            "added_tokens": [{"id": 3, "content": "<pad>", "special": true}],
        });
        let config = serde_json::json!({
            "bos_token": "<s>",
            "eos_token": {"content": "<|im_end|>", "rstrip": true},
            "pad_token": "<pad>",
            "additional_special_tokens": ["<tool>"],
            "added_tokens_decoder": {"9": {"content": "<think>", "special": false}},
        });
        let out = with_config_tokens(tokenizer, &config);
        let added: Vec<(u64, &str, bool)> = out["added_tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                let id = t["id"].as_u64().unwrap();
                (
                    id,
                    t["content"].as_str().unwrap(),
                    t["special"].as_bool().unwrap(),
                )
            })
            .collect();
        // A piece the model has keeps its id; new ones go after every id in use.
        assert_eq!(
            added,
            [
                (3, "<pad>", true),
                (9, "<think>", false),
                (2, "<s>", true),
                (10, "<|im_end|>", true),
                (11, "<tool>", true)
            ]
        );
        assert_eq!(out["added_tokens"][3]["rstrip"], true);
        assert_eq!(out["added_tokens"][3]["normalized"], false);
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
