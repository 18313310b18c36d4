//! Parsing OpenAI-style request bodies into what determines the prompt.
//!
//! A chat's messages and tools are parsed straight into the template's values: each string is
//! copied once, and a chat's text prefix shares its messages instead of copying them. Going
//! through JSON values first and converting them for the template was a fifth of preparing
//! the next turn of an 8k-token chat (docs/benchmarks.md, "Request preparation").

use minijinja::value::{Value as TemplateValue, ValueKind};
use serde::de::{Deserializer, MapAccess, Visitor};
use serde_json::{Map, Value};

/// Why a body is not a routable LLM request.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RequestError {
    /// Not JSON, or not a JSON object.
    #[error("body is not a JSON object: {0}")]
    NotJson(String),
    /// No `model` string.
    #[error("no model field")]
    NoModel,
    /// Neither `messages` nor `prompt`, or one of them is empty or of the wrong type.
    #[error("no usable prompt: {0}")]
    NoPrompt(&'static str),
}

/// The fields of a chat request that the chat template sees.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatInput {
    /// `messages`, as sent (each a map).
    pub messages: Vec<TemplateValue>,
    /// `tools`, as sent.
    pub tools: Option<TemplateValue>,
    /// `add_generation_prompt` (default true, as in vLLM).
    pub add_generation_prompt: bool,
    /// `continue_final_message` (default false).
    pub continue_final_message: bool,
    /// `chat_template_kwargs`: extra variables for the template.
    pub template_kwargs: Map<String, Value>,
}

impl ChatInput {
    /// The chat up to its first non-text content part (image, audio, video…), or `None` when
    /// every part is text. Engines expand such parts into tokens the filter cannot reproduce,
    /// so only the text before the first one can be hashed: the messages before it, plus that
    /// message's text parts before it (continued, without a generation prompt).
    pub fn text_prefix(&self) -> Option<ChatInput> {
        for (i, message) in self.messages.iter().enumerate() {
            let Some(parts) = attr(message, "content").filter(|c| c.kind() == ValueKind::Seq)
            else {
                continue;
            };
            let parts: Vec<TemplateValue> = parts.try_iter().ok()?.collect();
            let is_text = |p: &TemplateValue| attr_str(p, "type").as_deref() == Some("text");
            let Some(j) = parts.iter().position(|p| !is_text(p)) else {
                continue;
            };
            let mut messages = self.messages[..i].to_vec();
            if j > 0 {
                messages.push(with_content(message, parts[..j].to_vec()));
            }
            return Some(ChatInput {
                messages,
                add_generation_prompt: false,
                continue_final_message: j > 0,
                ..self.clone()
            });
        }
        None
    }
}

/// `value[key]` when `value` is a map that has it.
pub(crate) fn attr(value: &TemplateValue, key: &str) -> Option<TemplateValue> {
    if value.kind() != ValueKind::Map {
        return None;
    }
    value.get_attr(key).ok().filter(|v| !v.is_undefined())
}

/// `value[key]` when it is a string.
pub(crate) fn attr_str(value: &TemplateValue, key: &str) -> Option<String> {
    attr(value, key).and_then(|v| v.as_str().map(str::to_owned))
}

/// `message` with its `content` replaced by `parts`, its keys in their order.
fn with_content(message: &TemplateValue, parts: Vec<TemplateValue>) -> TemplateValue {
    let content = TemplateValue::from(parts);
    let keys: Vec<TemplateValue> = message
        .try_iter()
        .map(Iterator::collect)
        .unwrap_or_default();
    TemplateValue::from_pairs(keys.into_iter().map(|key| {
        let value = match key.as_str() {
            Some("content") => content.clone(),
            _ => message.get_item(&key).unwrap_or_default(),
        };
        (key, value)
    }))
}

/// What the prompt is made from.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput {
    /// `/v1/chat/completions`: messages rendered through the chat template.
    Chat(ChatInput),
    /// `/v1/completions` with a string prompt (or the first of a batch of strings).
    Text(String),
    /// `/v1/completions` with token ids (or the first of a batch of id lists).
    TokenIds(Vec<u32>),
}

/// A routable LLM request: the model and everything that decides its tokens and hash seed.
#[derive(Debug, Clone, PartialEq)]
pub struct LlmRequest {
    /// `model`, as sent.
    pub model: String,
    /// The prompt source.
    pub input: PromptInput,
    /// LoRA adapter name, when the request names one (changes the hash seed).
    pub lora: Option<String>,
    /// `cache_salt` (tenant isolation: changes the hash seed).
    pub cache_salt: Option<String>,
    /// `add_special_tokens`: run the tokenizer's post-processor (engine default: true for
    /// completions, false for chats, whose template writes the special tokens).
    pub add_special_tokens: Option<bool>,
    /// OpenAI `user` field.
    pub user: Option<String>,
    /// `stream`.
    pub stream: bool,
}

impl LlmRequest {
    /// Parse a chat or completions body. Batches of prompts are routed on their first prompt.
    pub fn parse(body: &[u8]) -> Result<Self, RequestError> {
        let Body {
            messages,
            tools,
            rest: mut obj,
        } = serde_json::from_slice(body).map_err(|e| RequestError::NotJson(e.to_string()))?;
        let model = match obj.get("model") {
            Some(Value::String(m)) if !m.is_empty() => m.clone(),
            _ => return Err(RequestError::NoModel),
        };
        let input = if let Some(messages) = messages {
            chat_input(messages, tools, &mut obj)?
        } else if let Some(prompt) = obj.remove("prompt") {
            completion_input(prompt)?
        } else {
            return Err(RequestError::NoPrompt("neither messages nor prompt"));
        };
        let string = |key: &str| obj.get(key).and_then(Value::as_str).map(str::to_owned);
        Ok(LlmRequest {
            model,
            input,
            lora: string("lora_name"),
            cache_salt: string("cache_salt"),
            add_special_tokens: obj.get("add_special_tokens").and_then(Value::as_bool),
            user: string("user"),
            stream: obj.get("stream").and_then(Value::as_bool).unwrap_or(false),
        })
    }
}

/// A body's fields: the chat's as the template's values, the rest as JSON. A key given twice
/// keeps its last value, as a JSON map would.
struct Body {
    messages: Option<TemplateValue>,
    tools: Option<TemplateValue>,
    rest: Map<String, Value>,
}

impl<'de> serde::Deserialize<'de> for Body {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Fields;
        impl<'de> Visitor<'de> for Fields {
            type Value = Body;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Body, A::Error> {
                let mut body = Body {
                    messages: None,
                    tools: None,
                    rest: Map::new(),
                };
                while let Some(key) = map.next_key::<String>()? {
                    match key.as_str() {
                        "messages" => body.messages = Some(map.next_value()?),
                        "tools" => body.tools = Some(map.next_value()?),
                        _ => {
                            let value = map.next_value()?;
                            body.rest.insert(key, value);
                        }
                    }
                }
                Ok(body)
            }
        }
        deserializer.deserialize_map(Fields)
    }
}

fn chat_input(
    messages: TemplateValue,
    tools: Option<TemplateValue>,
    obj: &mut Map<String, Value>,
) -> Result<PromptInput, RequestError> {
    if messages.kind() != ValueKind::Seq {
        return Err(RequestError::NoPrompt("messages is not an array"));
    }
    let messages: Vec<TemplateValue> = messages.try_iter().into_iter().flatten().collect();
    if messages.is_empty() {
        return Err(RequestError::NoPrompt("messages is empty"));
    }
    if !messages.iter().all(|m| m.kind() == ValueKind::Map) {
        return Err(RequestError::NoPrompt("a message is not an object"));
    }
    let flag = |obj: &Map<String, Value>, key: &str, default: bool| {
        obj.get(key).and_then(Value::as_bool).unwrap_or(default)
    };
    Ok(PromptInput::Chat(ChatInput {
        messages,
        tools: tools.filter(|t| !t.is_none()),
        add_generation_prompt: flag(obj, "add_generation_prompt", true),
        continue_final_message: flag(obj, "continue_final_message", false),
        template_kwargs: match obj.remove("chat_template_kwargs") {
            Some(Value::Object(kw)) => kw,
            _ => Map::new(),
        },
    }))
}

fn completion_input(prompt: Value) -> Result<PromptInput, RequestError> {
    let unsupported = RequestError::NoPrompt("prompt has an unsupported type");
    match prompt {
        Value::String(s) => Ok(PromptInput::Text(s)),
        // A flat list of numbers is one tokenized prompt; anything else is a batch.
        Value::Array(items) if items.first().is_some_and(Value::is_number) => {
            token_ids(&items).map(PromptInput::TokenIds)
        }
        Value::Array(items) => match items.into_iter().next() {
            None => Err(RequestError::NoPrompt("prompt is an empty array")),
            Some(Value::String(s)) => Ok(PromptInput::Text(s)),
            Some(Value::Array(ids)) => token_ids(&ids).map(PromptInput::TokenIds),
            Some(_) => Err(unsupported),
        },
        _ => Err(unsupported),
    }
}

fn token_ids(values: &[Value]) -> Result<Vec<u32>, RequestError> {
    values
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or(RequestError::NoPrompt("token ids must be u32"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(body: &str) -> Result<LlmRequest, RequestError> {
        LlmRequest::parse(body.as_bytes())
    }

    #[test]
    fn chat_fields() {
        let r = parse(
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,
               "user":"u1","cache_salt":"t","add_generation_prompt":false,
               "chat_template_kwargs":{"enable_thinking":false},"tools":null,"unknown":{"x":1}}"#,
        )
        .unwrap();
        assert_eq!(r.model, "m");
        assert!(r.stream);
        assert_eq!(r.user.as_deref(), Some("u1"));
        assert_eq!(r.cache_salt.as_deref(), Some("t"));
        let PromptInput::Chat(chat) = r.input else {
            panic!("chat expected")
        };
        assert!(!chat.add_generation_prompt);
        assert_eq!(chat.tools, None);
        assert_eq!(chat.template_kwargs["enable_thinking"], Value::Bool(false));
    }

    #[test]
    fn a_key_given_twice_keeps_its_last_value() {
        let r = parse(
            r#"{"model":"a","messages":[{"role":"user","content":"first"}],"tools":[1],
               "model":"b","messages":[{"role":"user","content":"second"}],"tools":null}"#,
        )
        .unwrap();
        assert_eq!(r.model, "b");
        let PromptInput::Chat(chat) = r.input else {
            panic!("chat expected")
        };
        assert_eq!(chat.messages.len(), 1);
        assert_eq!(
            attr_str(&chat.messages[0], "content").as_deref(),
            Some("second")
        );
        assert_eq!(chat.tools, None, "null tools are no tools");
    }

    #[test]
    fn a_text_prefix_keeps_the_cut_message_as_sent() {
        let r = parse(
            r#"{"model":"m","messages":[{"role":"system","content":"s"},
               {"name":"n","content":[{"type":"text","text":"look"},{"type":"image_url"}],"role":"user"}]}"#,
        )
        .unwrap();
        let PromptInput::Chat(chat) = r.input else {
            panic!("chat expected")
        };
        let prefix = chat.text_prefix().unwrap();
        assert!(prefix.continue_final_message && !prefix.add_generation_prompt);
        assert_eq!(prefix.messages[0], chat.messages[0]);
        assert_eq!(
            prefix.messages[1].to_string(),
            "{'name': 'n', 'content': [{'type': 'text', 'text': 'look'}], 'role': 'user'}",
            "its keys in their order, its content up to the image"
        );
    }

    #[test]
    fn completion_prompt_shapes() {
        let text = parse(r#"{"model":"m","prompt":"abc"}"#).unwrap();
        assert_eq!(text.input, PromptInput::Text("abc".into()));
        let batch = parse(r#"{"model":"m","prompt":["first","second"]}"#).unwrap();
        assert_eq!(batch.input, PromptInput::Text("first".into()));
        let ids = parse(r#"{"model":"m","prompt":[1,2,3]}"#).unwrap();
        assert_eq!(ids.input, PromptInput::TokenIds(vec![1, 2, 3]));
        let id_batch = parse(r#"{"model":"m","prompt":[[4,5],[6]]}"#).unwrap();
        assert_eq!(id_batch.input, PromptInput::TokenIds(vec![4, 5]));
    }

    #[test]
    fn rejects_what_cannot_be_routed() {
        for body in [
            "",
            "not json",
            "[1,2]",
            r#"{"messages":[{"role":"user","content":"x"}]}"#,
            r#"{"model":"","prompt":"x"}"#,
            r#"{"model":"m"}"#,
            r#"{"model":"m","messages":[]}"#,
            r#"{"model":"m","messages":"hi"}"#,
            r#"{"model":"m","messages":[1]}"#,
            r#"{"model":"m","prompt":[]}"#,
            r#"{"model":"m","prompt":[1,-2]}"#,
            r#"{"model":"m","prompt":[1, 4294967296]}"#,
            r#"{"model":"m","prompt":{"a":1}}"#,
            r#"{"model":"m","prompt":[{"a":1}]}"#,
        ] {
            assert!(parse(body).is_err(), "{body}");
        }
    }
}
