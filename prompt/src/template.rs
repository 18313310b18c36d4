//! Chat templates rendered the way `transformers` renders them.
//!
//! `transformers` (and vLLM, which calls it) compiles templates in a sandboxed Jinja2 environment
//! with `trim_blocks=True`, `lstrip_blocks=True` and loop controls, replaces `tojson` with
//! `json.dumps(x, ensure_ascii=False, …)`, and adds the globals `raise_exception` and
//! `strftime_now`. Anything else changes whitespace, and whitespace changes tokens.

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Serde, Value as JValue, ValueKind};
use minijinja::{Environment, Error, ErrorKind};
use serde_json::Value;

use crate::request::{attr, attr_str, ChatInput};

const TEMPLATE_NAME: &str = "chat";

/// Why a chat template could not be compiled or rendered.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// A chat request for a model without a chat template.
    #[error("the model has no chat template")]
    Missing,
    /// The template does not compile.
    #[error("template does not compile: {0}")]
    Compile(String),
    /// Rendering failed (including the template's own `raise_exception`).
    #[error("template failed: {0}")]
    Render(String),
}

/// A compiled chat template plus the special tokens it is given.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Compile `source` with the transformers-compatible environment.
    pub fn new(source: &str, bos: Option<&str>, eos: Option<&str>) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| TemplateError::Compile(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE_NAME, source.to_owned())
            .map_err(|e| TemplateError::Compile(e.to_string()))?;
        Ok(ChatTemplate {
            env,
            bos_token: bos.unwrap_or_default().to_owned(),
            eos_token: eos.unwrap_or_default().to_owned(),
        })
    }

    /// Render a chat request to the prompt string.
    pub fn render(&self, chat: &ChatInput) -> Result<String, TemplateError> {
        // As transformers layers it: special tokens, then chat_template_kwargs (which may
        // override them), then the request's own fields, which nothing overrides. A key given
        // again keeps its first place with the later value, as a JSON map would. The messages
        // and tools are the template's values already (shared, not copied).
        let mut ctx: Vec<(&str, JValue)> = vec![
            ("bos_token", JValue::from(self.bos_token.as_str())),
            ("eos_token", JValue::from(self.eos_token.as_str())),
        ];
        for (k, v) in &chat.template_kwargs {
            ctx.push((k, JValue::from(Serde(v))));
        }
        ctx.push(("messages", JValue::from(chat.messages.clone())));
        if let Some(tools) = &chat.tools {
            ctx.push(("tools", tools.clone()));
        }
        ctx.push((
            "add_generation_prompt",
            JValue::from(chat.add_generation_prompt),
        ));
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TemplateError::Render(e.to_string()))?;
        let rendered = template
            .render(JValue::from_pairs(ctx))
            .map_err(|e| TemplateError::Render(e.to_string()))?;
        if chat.continue_final_message {
            continue_final_message(rendered, &chat.messages)
        } else {
            Ok(rendered)
        }
    }
}

/// `continue_final_message`: cut the prompt right after the final message's content, as
/// transformers does, so the model continues that message instead of starting a new one.
fn continue_final_message(rendered: String, messages: &[JValue]) -> Result<String, TemplateError> {
    let last = messages
        .last()
        .and_then(|m| attr(m, "content"))
        .and_then(|c| content_text(&c))
        .ok_or_else(|| TemplateError::Render("continue_final_message needs text content".into()))?;
    let trimmed = last.trim();
    let end = rendered
        .rfind(trimmed)
        .ok_or_else(|| TemplateError::Render("final message not found in the prompt".into()))?;
    let mut out = rendered;
    out.truncate(end + trimmed.len());
    Ok(out)
}

/// A message content's text: the string, or the last text part's.
fn content_text(content: &JValue) -> Option<String> {
    if let Some(text) = content.as_str() {
        return Some(text.to_owned());
    }
    if content.kind() != ValueKind::Seq {
        return None;
    }
    let parts: Vec<JValue> = content.try_iter().ok()?.collect();
    parts.iter().rev().find_map(|p| {
        (attr_str(p, "type").as_deref() == Some("text"))
            .then(|| attr_str(p, "text"))
            .flatten()
    })
}

fn raise_exception(message: String) -> Result<JValue, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False, indent=…,
/// separators=…, sort_keys=…)`.
fn tojson(value: JValue, kwargs: Kwargs) -> Result<JValue, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut layout = JsonLayout {
        indent,
        // Python's defaults: `", "` between items without indent, `","` with it; `": "` always.
        item: if indent.is_some() { "," } else { ", " }.to_owned(),
        key: ": ".to_owned(),
        sort_keys: sort_keys.unwrap_or(false),
    };
    if let Some(seps) = separators {
        let [item, key] = <[String; 2]>::try_from(seps).map_err(|_| {
            Error::new(
                ErrorKind::InvalidOperation,
                "separators must be (item, key)",
            )
        })?;
        layout.item = item;
        layout.key = key;
    }
    let json = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let mut out = String::new();
    python_json(&json, &layout, 0, &mut out);
    Ok(JValue::from_safe_string(out))
}

/// How `json.dumps` was asked to lay its output out.
struct JsonLayout {
    indent: Option<usize>,
    item: String,
    key: String,
    sort_keys: bool,
}

/// Python `json.dumps` layout; non-ASCII kept as is (serde_json escapes strings the same way
/// Python does then).
fn python_json(v: &Value, layout: &JsonLayout, depth: usize, out: &mut String) {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = layout.indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    };
    match v {
        Value::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&layout.item);
                }
                newline(out, depth + 1);
                python_json(item, layout, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        Value::Object(map) if !map.is_empty() => {
            let mut entries: Vec<_> = map.iter().collect();
            if layout.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(&layout.item);
                }
                newline(out, depth + 1);
                out.push_str(&Value::String(k.clone()).to_string());
                out.push_str(&layout.key);
                python_json(item, layout, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        Value::Number(n) if n.is_f64() => out.push_str(&python_float(n.as_f64().unwrap_or(0.0))),
        other => out.push_str(&other.to_string()),
    }
}

fn python_float(f: f64) -> String {
    if f.is_finite() && f == f.trunc() && f.abs() < 1e16 {
        format!("{f:.1}")
    } else {
        format!("{f}")
    }
}

/// `strftime_now(format)`: the current UTC time, for templates that print today's date.
fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime(&format, secs)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// The subset of C `strftime` that chat templates use, for a Unix time in UTC.
fn strftime(format: &str, unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday.
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('-') if chars.clone().next() == Some('d') => {
                chars.next();
                out.push_str(&day.to_string());
            }
            Some('B') => out.push_str(MONTHS[month as usize - 1]),
            Some('b') => out.push_str(&MONTHS[month as usize - 1][..3]),
            Some('A') => out.push_str(WEEKDAYS[weekday]),
            Some('a') => out.push_str(&WEEKDAYS[weekday][..3]),
            Some('H') => out.push_str(&format!("{:02}", secs_of_day / 3600)),
            Some('M') => out.push_str(&format!("{:02}", secs_of_day / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", secs_of_day % 60)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 → (year, month, day) in the proleptic Gregorian calendar.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// `v` as a request's body gives it to the template.
    fn value(v: Value) -> JValue {
        serde_json::from_value(v).unwrap()
    }

    fn chat(messages: Value) -> ChatInput {
        ChatInput {
            messages: messages
                .as_array()
                .unwrap()
                .iter()
                .map(|m| value(m.clone()))
                .collect(),
            tools: None,
            add_generation_prompt: true,
            continue_final_message: false,
            template_kwargs: Default::default(),
        }
    }

    const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

    #[test]
    fn trim_and_lstrip_blocks_like_transformers() {
        // Without trim_blocks every tag line leaves a newline; without lstrip_blocks the
        // indentation before the tags stays. Jinja2 in transformers gives exactly this:
        let src = "{% for message in messages %}\n  {% if message.role == 'system' %}\n<<SYS>>{{ message.content }}<</SYS>>\n  {% else %}\n[{{ message.role }}] {{ message.content }}\n  {% endif %}\n{% endfor %}\n";
        let t = ChatTemplate::new(src, None, None).unwrap();
        let out = t
            .render(&chat(json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])))
            .unwrap();
        assert_eq!(out, "<<SYS>>be brief<</SYS>>\n[user] hi\n");
    }

    #[test]
    fn tojson_is_python_json_dumps() {
        let t = ChatTemplate::new(
            "{{ tools | tojson }}|{{ tools[0] | tojson(indent=2) }}",
            None,
            None,
        )
        .unwrap();
        let mut c = chat(json!([{"role": "user", "content": "x"}]));
        c.tools = Some(value(
            json!([{"name": "get_weather", "desc": "天気 <b>", "n": 1.0, "a": [], "o": {}}]),
        ));
        let out = t.render(&c).unwrap();
        assert_eq!(
            out,
            "[{\"name\": \"get_weather\", \"desc\": \"天気 <b>\", \"n\": 1.0, \"a\": [], \"o\": {}}]|{\n  \"name\": \"get_weather\",\n  \"desc\": \"天気 <b>\",\n  \"n\": 1.0,\n  \"a\": [],\n  \"o\": {}\n}"
        );
    }

    #[test]
    fn tojson_separators_and_sort_keys() {
        let t = ChatTemplate::new(
            "{{ tools | tojson(separators=(',', ':'), sort_keys=true) }}|{{ tools | tojson(indent=1, separators=(';', '=')) }}",
            None,
            None,
        )
        .unwrap();
        let mut c = chat(json!([{"role": "user", "content": "x"}]));
        c.tools = Some(value(json!({"b": [1, 2], "a": {"d": 1, "c": 2}})));
        assert_eq!(
            t.render(&c).unwrap(),
            "{\"a\":{\"c\":2,\"d\":1},\"b\":[1,2]}|{\n \"b\"=[\n  1;\n  2\n ];\n \"a\"={\n  \"d\"=1;\n  \"c\"=2\n }\n}"
        );
    }

    #[test]
    fn template_kwargs_override_special_tokens_but_not_the_request() {
        let t = ChatTemplate::new(
            "{{ bos_token }}|{{ add_generation_prompt }}|{{ messages | length }}",
            Some("<s>"),
            None,
        )
        .unwrap();
        let mut c = chat(json!([{"role": "user", "content": "x"}]));
        c.template_kwargs =
            json!({"bos_token": "<B>", "add_generation_prompt": false, "messages": []})
                .as_object()
                .unwrap()
                .clone();
        assert_eq!(
            t.render(&c).unwrap(),
            "<B>|True|1",
            "booleans print as Python prints them"
        );
    }

    #[test]
    fn raise_exception_fails_render() {
        let t =
            ChatTemplate::new("{{ raise_exception('roles must alternate') }}", None, None).unwrap();
        let err = t
            .render(&chat(json!([{"role": "user", "content": "x"}])))
            .unwrap_err();
        assert!(err.to_string().contains("roles must alternate"), "{err}");
        assert!(ChatTemplate::new("{% if %}", None, None).is_err());
    }

    #[test]
    fn python_methods_and_special_tokens() {
        let t = ChatTemplate::new(
            "{{ bos_token }}{% for m in messages %}{{ m.content.strip() }}{% if not loop.last %}{{ eos_token }}{% endif %}{% endfor %}",
            Some("<s>"),
            Some("</s>"),
        )
        .unwrap();
        let out = t
            .render(&chat(json!([{"role": "user", "content": "  a  "}, {"role": "assistant", "content": "b"}])))
            .unwrap();
        assert_eq!(out, "<s>a</s>b");
    }

    #[test]
    fn continue_final_message_cuts_after_content() {
        let t = ChatTemplate::new(CHATML, None, None).unwrap();
        let mut c = chat(
            json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]),
        );
        c.add_generation_prompt = false;
        c.continue_final_message = true;
        let out = t.render(&c).unwrap();
        assert!(out.ends_with("<|im_start|>assistant\nOnce upon"), "{out:?}");
    }

    #[test]
    fn strftime_subset() {
        // 2024-07-23 13:05:09 UTC, a Tuesday.
        let t = 1_721_739_909;
        assert_eq!(strftime("%d %b %Y", t), "23 Jul 2024");
        assert_eq!(
            strftime("%A %B %-d, %y %H:%M:%S %%", t),
            "Tuesday July 23, 24 13:05:09 %"
        );
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
    }
}
