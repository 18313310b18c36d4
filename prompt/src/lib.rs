//! kvroute-prompt: request → rendered prompt → token ids → block hashes, exactly as the engine.
//!
//! Plain functions, no I/O on the request path; the filter (in wasm), the sidecar and the
//! simulated engines all run this same code, so they cannot disagree about a prompt's tokens.
//!
//! - [`request`]: parse an OpenAI `/v1/chat/completions` or `/v1/completions` body.
//! - [`template`]: render a chat template the way `transformers` does (Jinja with trim/lstrip).
//! - [`tokenizer`]: HF `tokenizers` 1.0 pipeline.
//! - [`model_dir`]: read an HF-style model directory into a [`kvroute_protocol::bundle::ModelBundle`].
//! - [`Preprocessor`]: the three above bound to one model bundle.

mod clock;
pub mod model_dir;
pub mod request;
pub mod segments;
pub mod template;
pub mod tokenizer;

use kvroute_protocol::bundle::ModelBundle;
use kvroute_protocol::hash::{token_prefix_hashes, HashSeed, PrefixHash};

pub use request::{LlmRequest, PromptInput, RequestError};
pub use segments::{Cut, SegmentUse, Segmenter};
pub use template::{ChatTemplate, TemplateError};
pub use tokenizer::{Tokenizer, TokenizerError};

/// Why a request's tokens could not be computed.
#[derive(Debug, thiserror::Error)]
pub enum PromptError {
    /// The body is not a routable request.
    #[error(transparent)]
    Request(#[from] RequestError),
    /// The chat template failed (or the model has none and the request is a chat).
    #[error(transparent)]
    Template(#[from] TemplateError),
    /// The tokenizer failed.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
}

/// Why a bundle could not be turned into a [`Preprocessor`].
#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    /// The chat template does not compile.
    #[error("chat template: {0}")]
    Template(#[from] TemplateError),
    /// The tokenizer does not load.
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] TokenizerError),
    /// A block size of zero cannot be hashed.
    #[error("block size must be positive")]
    ZeroBlockSize,
}

/// One model's template, tokenizer and block size, ready to process requests.
pub struct Preprocessor {
    template: Option<ChatTemplate>,
    tokenizer: Tokenizer,
    block_size: usize,
    /// Token ids of chat segments seen before ([`Preprocessor::with_token_cache`]).
    segments: Option<Segmenter>,
}

/// A processed request: its tokens and the prefix hash of each full block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptHashes {
    /// Token ids as the engine sees them, but the first `known`.
    pub tokens: Vec<u32>,
    /// Ids at the prompt's start not in `tokens`: a history the token cache found as its
    /// blocks' hashes ([`Segmenter::encode_hashed`]); always a whole number of blocks.
    pub known: usize,
    /// One prefix hash per full block.
    pub hashes: Vec<PrefixHash>,
    /// What the token cache did for it (nothing without one).
    pub segments: SegmentUse,
}

/// A chat the template renders when a token cache is set up: the special tokens it contains
/// are where prompts are cut, and its ids cut and whole must agree.
fn sample_chat() -> Result<request::ChatInput, RequestError> {
    let body = serde_json::json!({"model": "sample", "messages": [
        {"role": "system", "content": "You are a helpful assistant. Answer briefly.\n"},
        {"role": "user", "content": "  Hello,  world! What's 2+2?\n\nAlso: café, naïve, 東京 🙂 "},
        {"role": "assistant", "content": "4.\n\tThat is all."},
        {"role": "user", "content": "Thanks — and the <b>next</b> one?"}
    ]});
    match LlmRequest::parse(body.to_string().as_bytes())?.input {
        PromptInput::Chat(chat) => Ok(chat),
        _ => Err(RequestError::NoPrompt("the sample is a chat")),
    }
}

impl Preprocessor {
    /// Load a bundle; this compiles the template and builds the tokenizer (slow: do it once).
    pub fn from_bundle(bundle: &ModelBundle) -> Result<Self, BundleError> {
        if bundle.block_size == 0 {
            return Err(BundleError::ZeroBlockSize);
        }
        let template = bundle
            .chat_template
            .as_deref()
            .map(|src| {
                ChatTemplate::new(
                    src,
                    bundle.bos_token.as_deref(),
                    bundle.eos_token.as_deref(),
                )
            })
            .transpose()?;
        Ok(Preprocessor {
            template,
            tokenizer: Tokenizer::from_json(&bundle.tokenizer_json)?,
            block_size: bundle.block_size as usize,
            segments: None,
        })
    }

    /// Keep the token ids of chat segments seen before, at most `budget_bytes` of them
    /// ([`segments`]); nothing without a template, or where the model's prompts cannot be cut
    /// exactly (say so through [`Preprocessor::token_cache`]).
    pub fn with_token_cache(mut self, bundle: &ModelBundle, budget_bytes: usize) -> Self {
        let sample = match (&self.template, sample_chat()) {
            (Some(template), Ok(chat)) => template.render(&chat).ok(),
            _ => None,
        };
        self.segments = sample.and_then(|sample| {
            Segmenter::new(
                &bundle.tokenizer_json,
                &self.tokenizer,
                &sample,
                budget_bytes,
            )
        });
        self
    }

    /// The token cache, if one is set up and the model's prompts can be cut exactly.
    pub fn token_cache(&self) -> Option<&Segmenter> {
        self.segments.as_ref()
    }

    /// A rendered chat's ids, through the token cache where there is one.
    fn encode_chat(&self, text: &str, add_special_tokens: bool) -> Result<Cut, TokenizerError> {
        match &self.segments {
            Some(segments) if !add_special_tokens => segments.encode(text, &self.tokenizer),
            _ => Ok(Cut::whole(self.tokenizer.encode(text, add_special_tokens)?)),
        }
    }

    /// Tokens per KV block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The prompt text the engine would build (chat: the rendered template).
    pub fn render(&self, req: &LlmRequest) -> Result<Option<String>, PromptError> {
        match &req.input {
            PromptInput::Chat(chat) => Ok(Some(self.rendered(chat)?)),
            PromptInput::Text(text) => Ok(Some(text.clone())),
            PromptInput::TokenIds(_) => Ok(None),
        }
    }

    /// Token ids exactly as the engine sees them.
    pub fn tokens(&self, req: &LlmRequest) -> Result<Vec<u32>, PromptError> {
        Ok(self.tokens_cut(req)?.ids)
    }

    /// The same, with what the token cache did and where its segments end.
    fn tokens_cut(&self, req: &LlmRequest) -> Result<Cut, PromptError> {
        match &req.input {
            PromptInput::Chat(chat) => {
                let text = self.rendered(chat)?;
                // The template already holds BOS and friends: engines encode chat prompts
                // without adding special tokens unless the request asks (vLLM's default: no).
                Ok(self.encode_chat(&text, req.add_special_tokens.unwrap_or(false))?)
            }
            PromptInput::Text(text) => Ok(Cut::whole(
                self.tokenizer
                    .encode(text, req.add_special_tokens.unwrap_or(true))?,
            )),
            PromptInput::TokenIds(ids) => Ok(Cut::whole(ids.clone())),
        }
    }

    /// Tokens and block hashes of a request. A chat with non-text parts (images…) is hashed
    /// only up to the first one ([`request::ChatInput::text_prefix`]), less its last full block: text
    /// tokenized without what follows it may end differently at the cut.
    pub fn hashes(&self, req: &LlmRequest) -> Result<PromptHashes, PromptError> {
        let seed = HashSeed::for_request(req.lora.as_deref(), req.cache_salt.as_deref());
        // As in `tokens_cut`: a chat's template writes its special tokens.
        let special = req.add_special_tokens.unwrap_or(false);
        let (cut, hashes) = match &req.input {
            PromptInput::Chat(chat) => match chat.text_prefix() {
                None => self.hashed_chat(&self.rendered(chat)?, special, seed)?,
                Some(prefix) if prefix.messages.is_empty() => (Cut::default(), Vec::new()),
                Some(prefix) => {
                    let (mut cut, mut hashes) =
                        self.hashed_chat(&self.rendered(&prefix)?, special, seed)?;
                    hashes.truncate(hashes.len().saturating_sub(1));
                    let tokens = hashes.len() * self.block_size;
                    cut.known = cut.known.min(tokens);
                    cut.ids.truncate(tokens - cut.known);
                    cut.ends.retain(|end| end.tokens <= tokens);
                    (cut, hashes)
                }
            },
            _ => {
                let cut = self.tokens_cut(req)?;
                let hashes = token_prefix_hashes(&cut.ids, self.block_size, seed);
                (cut, hashes)
            }
        };
        Ok(PromptHashes {
            tokens: cut.ids,
            known: cut.known,
            hashes,
            segments: cut.used,
        })
    }

    /// `chat` through the template.
    fn rendered(&self, chat: &request::ChatInput) -> Result<String, PromptError> {
        let template = self.template.as_ref().ok_or(TemplateError::Missing)?;
        Ok(template.render(chat)?)
    }

    /// A rendered chat's ids and block hashes, through the token cache where there is one.
    fn hashed_chat(
        &self,
        text: &str,
        add_special_tokens: bool,
        seed: HashSeed,
    ) -> Result<(Cut, Vec<PrefixHash>), TokenizerError> {
        match &self.segments {
            Some(segments) if !add_special_tokens => {
                segments.encode_hashed(text, &self.tokenizer, self.block_size, seed)
            }
            _ => {
                let cut = Cut::whole(self.tokenizer.encode(text, add_special_tokens)?);
                let hashes = token_prefix_hashes(&cut.ids, self.block_size, seed);
                Ok((cut, hashes))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multimodal_chats_hash_the_text_before_the_first_non_text_part() {
        let dir = kvroute_protocol::samples_dir().join("vllm/tiny-llama-tokenizer");
        let pre =
            Preprocessor::from_bundle(&model_dir::load_bundle(&dir, "tiny", 4).unwrap()).unwrap();
        let system = "You are a careful assistant who reads the whole document first. ".repeat(4);
        let parse =
            |body: serde_json::Value| LlmRequest::parse(body.to_string().as_bytes()).unwrap();
        let image = serde_json::json!({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}});
        let with_image = parse(serde_json::json!({"model": "tiny", "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": [image, {"type": "text", "text": "what is this?"}]}]}));
        let text_only = parse(serde_json::json!({"model": "tiny", "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "what is this?"}]}));
        let mm = pre.hashes(&with_image).unwrap();
        let text = pre.hashes(&text_only).unwrap();
        assert!(mm.hashes.len() >= 4, "{}", mm.hashes.len());
        assert!(mm.hashes.len() < text.hashes.len());
        assert_eq!(
            mm.hashes[..],
            text.hashes[..mm.hashes.len()],
            "the system prompt's blocks match what a text-only request cached"
        );
        // An image first: nothing before it to hash.
        let image_first = parse(serde_json::json!({"model": "tiny", "messages": [
            {"role": "user", "content": [image]}]}));
        assert!(pre.hashes(&image_first).unwrap().hashes.is_empty());
    }

    #[test]
    fn tiny_llama_bundle_hashes_chat_and_completion() {
        let dir = kvroute_protocol::samples_dir().join("vllm/tiny-llama-tokenizer");
        let bundle = model_dir::load_bundle(&dir, "tiny", 32).unwrap();
        let pre = Preprocessor::from_bundle(&bundle).unwrap();
        let chat = LlmRequest::parse(
            br#"{"model":"tiny","messages":[{"role":"user","content":"hello world"}]}"#,
        )
        .unwrap();
        let rendered = pre.render(&chat).unwrap().unwrap();
        assert_eq!(rendered, "<s><|user|>\nhello world<|end|>\n<|assistant|>\n");
        let out = pre.hashes(&chat).unwrap();
        // BOS comes from the template, not from the tokenizer's post-processor.
        assert_eq!(out.tokens.iter().filter(|&&t| t == 1).count(), 1);
        assert_eq!(out.hashes.len(), out.tokens.len() / 32);
        let completion = LlmRequest::parse(br#"{"model":"tiny","prompt":"hello world"}"#).unwrap();
        let toks = pre.tokens(&completion).unwrap();
        assert_eq!(toks[0], 1, "completions add BOS via the tokenizer");
    }
}
