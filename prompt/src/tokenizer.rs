//! The model's tokenizer, via HF `tokenizers` 1.0 (pure Rust, builds for wasm).

use tokenizers::pipeline::{EncodeOptions, PipelineToken, PipelineTokenizer};

/// Why a tokenizer could not be loaded or run.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// `tokenizer.json` did not load (unsupported component, not canonical, not JSON).
    #[error("tokenizer does not load: {0}")]
    Load(String),
    /// Encoding failed.
    #[error("encoding failed: {0}")]
    Encode(String),
}

/// A loaded tokenizer.
pub struct Tokenizer {
    inner: PipelineTokenizer,
}

impl Tokenizer {
    /// Load a canonical (tokenizers 1.0) `tokenizer.json`.
    pub fn from_json(json: &str) -> Result<Self, TokenizerError> {
        let inner = tokenizers::from_json(json).map_err(|e| TokenizerError::Load(e.to_string()))?;
        Ok(Tokenizer { inner })
    }

    /// Token ids of `text`; `add_special_tokens` runs the post-processor (BOS and the like).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        let options = EncodeOptions {
            add_special_tokens,
            ..Default::default()
        };
        let mut encodings = self
            .inner
            .encode(text, &options)
            .wait()
            .map_err(|e| TokenizerError::Encode(e.to_string()))?;
        let encoding = encodings
            .pop()
            .ok_or_else(|| TokenizerError::Encode("no encoding returned".into()))?;
        Ok(PipelineToken::cast_slice(encoding.ids()).to_vec())
    }
}

/// Rewrite a `tokenizer.json` written by older `tokenizers` into the canonical 1.0 form.
pub fn canonicalize(json: &str) -> Result<String, TokenizerError> {
    tokenizers::canonicalize_str(json).map_err(|e| TokenizerError::Load(e.to_string()))
}
