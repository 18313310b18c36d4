//! Reading a key prefix from etcd through its JSON gateway (`POST /v3/kv/range`, served on the
//! client URL by default since etcd 3.4): Dynamo's default discovery backend. One request per
//! poll lists every record; no gRPC stack, no watch to keep alive — a poll that fails is said
//! by the caller and the next one tries again.
//!
//! Keys and values travel base64-encoded; counts and revisions as JSON strings.

use anyhow::{bail, Context as _};
use base64::Engine as _;
use serde_json::Value;

/// One key and its value.
pub type Entry = (String, Vec<u8>);

/// The request body for every key starting with `prefix`: `range_end` is the prefix with its
/// last byte plus one (`v1/` → `v10`).
pub fn range_request(prefix: &str) -> Value {
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut end = prefix.as_bytes().to_vec();
    match end.last_mut() {
        Some(last) if *last < 0xff => *last += 1,
        // An empty prefix (or one ending in 0xff) ranges over everything from it: `\0`.
        _ => end = vec![0],
    }
    serde_json::json!({"key": b64.encode(prefix), "range_end": b64.encode(end)})
}

/// The entries of a range response, or why it is not one.
pub fn parse_range(doc: &Value) -> anyhow::Result<Vec<Entry>> {
    if doc.get("header").is_none() {
        bail!("not an etcd range response (no header): {}", truncate(doc));
    }
    let b64 = base64::engine::general_purpose::STANDARD;
    // etcd omits `kvs` when nothing matches.
    let Some(kvs) = doc.get("kvs") else {
        return Ok(Vec::new());
    };
    let kvs = kvs.as_array().context("`kvs` is not an array")?;
    let mut out = Vec::with_capacity(kvs.len());
    for kv in kvs {
        let field = |name: &str| -> anyhow::Result<Vec<u8>> {
            match kv.get(name).and_then(Value::as_str) {
                // An empty value is omitted too.
                None => Ok(Vec::new()),
                Some(text) => b64
                    .decode(text)
                    .with_context(|| format!("`{name}` is not base64")),
            }
        };
        let key = String::from_utf8(field("key")?).context("a key is not UTF-8")?;
        out.push((key, field("value")?));
    }
    Ok(out)
}

fn truncate(doc: &Value) -> String {
    let text = doc.to_string();
    text.chars().take(200).collect()
}

/// Every key under `prefix` from the first of `endpoints` that answers; the errors of all when
/// none does.
pub async fn range_prefix(
    http: &reqwest::Client,
    endpoints: &[String],
    prefix: &str,
) -> anyhow::Result<Vec<Entry>> {
    let body = range_request(prefix);
    let mut errors = Vec::new();
    for endpoint in endpoints {
        let url = format!("{}/v3/kv/range", endpoint.trim_end_matches('/'));
        let answer = async {
            let doc = http
                .post(&url)
                .json(&body)
                .send()
                .await?
                .error_for_status()?
                .json::<Value>()
                .await?;
            parse_range(&doc)
        };
        match answer.await {
            Ok(entries) => return Ok(entries),
            Err(e) => errors.push(format!("{url}: {e:#}")),
        }
    }
    bail!("no etcd endpoint answered: {}", errors.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_ranges_to_its_successor() {
        let r = range_request("v1/");
        assert_eq!(r["key"], "djEv");
        assert_eq!(r["range_end"], "djEw", "v10");
    }

    #[test]
    fn reads_a_range_response() {
        let doc = serde_json::json!({
            "header": {"cluster_id": "1", "revision": "7"},
            "kvs": [
                {"key": "djEvbWRjL2E=", "create_revision": "2", "value": "eyJ4IjoxfQ=="},
                {"key": "djEvZW1wdHk="}
            ],
            "count": "2"
        });
        let entries = parse_range(&doc).unwrap();
        assert_eq!(entries[0], ("v1/mdc/a".to_string(), b"{\"x\":1}".to_vec()));
        assert_eq!(entries[1], ("v1/empty".to_string(), Vec::new()));
        let none = serde_json::json!({"header": {"revision": "7"}});
        assert!(parse_range(&none).unwrap().is_empty());
        assert!(parse_range(&serde_json::json!({"error": "x"})).is_err());
        let bad = serde_json::json!({"header": {}, "kvs": [{"key": "!!"}]});
        assert!(parse_range(&bad).is_err());
    }
}
