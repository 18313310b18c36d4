//! Operator commands: `decode` and `tap` show captured or live event payloads as JSON lines, so
//! an operator can check what engines publish without running the sidecar; `tokenize` shows
//! what the filter computes for a request body.

use std::path::Path;

use anyhow::Context as _;
use kvroute_protocol::dynamo::{decode_kv_metrics, decode_message};
use kvroute_protocol::vllm::{decode_batch, decode_seq, VllmEvent};
use serde_json::{json, Value};

/// Which wire format a captured file is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// A Dynamo NATS message body (msgpack envelope, or JetStream JSON).
    DynamoNats,
    /// A vLLM ZMQ payload frame; `NAME.seq` / `NAME.topic` beside `NAME.payload.msgpack` are
    /// read too when present (the layout of the captures in `testdata/samples/vllm`).
    VllmZmq,
}

/// One JSON object per event in `path` (hashes as u64); an undecodable file is one object
/// with an `error`.
pub fn decode_file(format: Format, path: &Path) -> anyhow::Result<Vec<Value>> {
    let body = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let file = path.display().to_string();
    let out = match format {
        Format::DynamoNats => dynamo_lines(&body, json!({"file": file})),
        Format::VllmZmq => {
            let sibling = |ext: &str| {
                let name = path
                    .file_name()?
                    .to_str()?
                    .strip_suffix(".payload.msgpack")?;
                std::fs::read(path.with_file_name(format!("{name}.{ext}"))).ok()
            };
            let seq = sibling("seq").and_then(|s| decode_seq(&s).ok());
            let topic = sibling("topic").map(|t| String::from_utf8_lossy(&t).into_owned());
            vllm_lines(
                topic.as_deref().unwrap_or(""),
                seq,
                &body,
                json!({"file": file}),
            )
        }
    };
    Ok(out)
}

/// One JSON object per event of a Dynamo message body, each starting from `base`.
pub fn dynamo_lines(body: &[u8], base: Value) -> Vec<Value> {
    let with = |extra: Value| {
        let mut v = base.clone();
        if let (Some(v), Value::Object(extra)) = (v.as_object_mut(), extra) {
            v.extend(extra);
        }
        v
    };
    match decode_message(body) {
        Ok(decoded) => decoded
            .events
            .iter()
            .map(|e| with(json!({"topic": decoded.topic, "event": e})))
            .collect(),
        Err(events_error) => match decode_kv_metrics(body) {
            Ok(m) => vec![with(json!({"topic": "kv_metrics", "kv_metrics": {
                "worker_id": m.worker_id, "dp_rank": m.dp_rank,
                "kv_used_blocks": m.kv_used_blocks, "active_prefill_tokens": m.active_prefill_tokens,
                "active_decode_blocks": m.active_decode_blocks}}))],
            Err(_) => vec![with(json!({"error": events_error.to_string()}))],
        },
    }
}

/// One JSON object per event of a vLLM payload frame.
pub fn vllm_lines(topic: &str, seq: Option<u64>, payload: &[u8], base: Value) -> Vec<Value> {
    let mut base = base;
    if let Some(b) = base.as_object_mut() {
        b.insert("topic".into(), topic.into());
        b.insert("seq".into(), seq.into());
    }
    match decode_batch(payload) {
        Ok(batch) => batch
            .events
            .iter()
            .map(|e| {
                let mut line = base.clone();
                if let Some(l) = line.as_object_mut() {
                    l.insert("ts".into(), batch.ts.into());
                    l.insert("dp_rank".into(), batch.dp_rank.into());
                    l.insert("event".into(), vllm_json(e));
                }
                line
            })
            .collect(),
        Err(e) => {
            let mut line = base;
            if let Some(l) = line.as_object_mut() {
                l.insert("error".into(), e.to_string().into());
            }
            vec![line]
        }
    }
}

fn vllm_json(e: &VllmEvent) -> Value {
    match e {
        VllmEvent::BlockStored {
            block_hashes,
            parent,
            token_ids,
            block_size,
            lora_name,
            medium,
            has_extra_keys,
            group,
            kind,
        } => json!({
            "type": "BlockStored",
            "block_hashes": block_hashes.iter().map(|h| h.0).collect::<Vec<_>>(),
            "parent_block_hash": parent.map(|p| p.0),
            "token_ids": token_ids.as_slice(),
            "block_size": block_size,
            "lora_name": lora_name,
            "medium": medium,
            "blocks_with_extra_keys": has_extra_keys.iter().filter(|&&x| x).count(),
            "group_idx": group,
            "kv_cache_spec_kind": kind,
        }),
        VllmEvent::BlockRemoved {
            block_hashes,
            medium,
            group,
        } => json!({
            "type": "BlockRemoved",
            "block_hashes": block_hashes.iter().map(|h| h.0).collect::<Vec<_>>(),
            "medium": medium,
            "group_idx": group,
        }),
        VllmEvent::AllBlocksCleared => json!({"type": "AllBlocksCleared"}),
    }
}

/// What `tap` listens to.
#[derive(Debug, Clone)]
pub struct TapTargets {
    /// NATS server URL.
    pub nats: Option<String>,
    /// NATS subjects (wildcards allowed).
    pub subjects: Vec<String>,
    /// vLLM PUB endpoints to connect to.
    pub zmq: Vec<String>,
    /// ZMQ topic prefix.
    pub topic: String,
    /// Seconds between count summaries.
    pub summary: std::time::Duration,
}

/// Subscribe like the sidecar would and print every decoded event as a JSON line on stdout,
/// and every `summary` the message counts per subject and per Dynamo component on stderr.
/// NATS messages on subjects that are not KV events (metrics, discovery) are counted only.
pub async fn tap(targets: TapTargets) -> anyhow::Result<()> {
    use futures::StreamExt;
    use std::collections::BTreeMap;

    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(String, Vec<Value>)>();
    if let Some(url) = &targets.nats {
        let options =
            crate::transports::nats::url_credentials(async_nats::ConnectOptions::new(), url);
        let client = options
            .retry_on_initial_connect()
            .name("kvroute-tap")
            .connect(crate::config::without_credentials(url))
            .await
            .with_context(|| format!("connecting to NATS at {url}"))?;
        let mut subs = Vec::new();
        for subject in &targets.subjects {
            subs.push(client.subscribe(subject.clone()).await?);
        }
        eprintln!(
            "tap: NATS {}, subjects {:?}",
            crate::config::redact_url(url),
            targets.subjects
        );
        let tx = tx.clone();
        tokio::spawn(async move {
            let mut messages = futures::stream::select_all(subs);
            while let Some(msg) = messages.next().await {
                let subject = msg.subject.to_string();
                let last = subject.rsplit('.').next().unwrap_or("");
                let lines = if last == "kv-events" || last == "kv_metrics" {
                    dynamo_lines(&msg.payload, json!({"subject": subject}))
                } else {
                    Vec::new()
                };
                if tx.send((subject, lines)).is_err() {
                    break;
                }
            }
        });
    }
    for endpoint in &targets.zmq {
        let socket = zmq::Context::new().socket(zmq::SUB)?;
        socket
            .connect(endpoint)
            .with_context(|| format!("connecting to {endpoint}"))?;
        socket.set_subscribe(targets.topic.as_bytes())?;
        eprintln!("tap: ZMQ {endpoint}, topic {:?}", targets.topic);
        let (tx, endpoint) = (tx.clone(), endpoint.clone());
        // libzmq blocks: one thread per endpoint.
        std::thread::spawn(move || {
            while let Ok(frames) = socket.recv_multipart(0) {
                let lines = match frames.as_slice() {
                    [topic, seq, payload] => vllm_lines(
                        &String::from_utf8_lossy(topic),
                        decode_seq(seq).ok(),
                        payload,
                        json!({"endpoint": endpoint}),
                    ),
                    _ => vec![
                        json!({"endpoint": endpoint, "error": format!("{} frames, not 3", frames.len())}),
                    ],
                };
                if tx.send((endpoint.clone(), lines)).is_err() {
                    break;
                }
            }
        });
    }
    drop(tx);
    let mut per_subject: BTreeMap<String, u64> = BTreeMap::new();
    let mut tick = tokio::time::interval(targets.summary);
    tick.tick().await;
    loop {
        tokio::select! {
            got = rx.recv() => {
                let Some((subject, lines)) = got else { return Ok(()) };
                *per_subject.entry(subject).or_default() += 1;
                let mut out = std::io::stdout().lock();
                for line in lines {
                    // `tap … | head`: the reader went away, so the tap is done.
                    if std::io::Write::write_fmt(&mut out, format_args!("{line}\n")).is_err() {
                        return Ok(());
                    }
                }
            }
            _ = tick.tick() => {
                let mut components: BTreeMap<String, u64> = BTreeMap::new();
                for (subject, n) in &per_subject {
                    let component = kvroute_protocol::dynamo::subject_component(subject)
                        .unwrap_or_else(|| "-".into());
                    *components.entry(component).or_default() += n;
                }
                eprintln!("tap: messages per subject {per_subject:?}; per component {components:?}");
            }
        }
    }
}

/// What the filter computes for one request body with the model directory `dir`: the rendered
/// prompt, the token ids and the block (prefix) hashes — the same code path (bundle loading as
/// the sidecar serves it, template, tokenizer, hashing) the filter runs in Envoy.
pub fn tokenize(dir: &Path, block_size: u32, body: &[u8]) -> anyhow::Result<Value> {
    use kvroute_prompt::request::LlmRequest;
    use kvroute_protocol::HashSeed;

    let req = LlmRequest::parse(body).context("parsing the request body")?;
    let bundle = kvroute_prompt::model_dir::load_bundle(dir, &req.model, block_size)
        .with_context(|| format!("loading {}", dir.display()))?;
    let pre = kvroute_prompt::Preprocessor::from_bundle(&bundle)?;
    let rendered = pre.render(&req)?;
    let hashed = pre.hashes(&req)?;
    let seed = HashSeed::for_request(req.lora.as_deref(), req.cache_salt.as_deref());
    Ok(json!({
        "model": req.model,
        "block_size": block_size,
        "rendered": rendered,
        "token_ids": hashed.tokens,
        "tokens": hashed.tokens.len(),
        "seed": seed.0,
        "lora": req.lora,
        "cache_salt": req.cache_salt,
        "block_hashes": hashed.hashes.iter().map(|h| h.0).collect::<Vec<_>>(),
        // As `/debug/explain` prints it, to compare with what the filter sent.
        "last_block": hashed.hashes.last().map(|h| format!("{:016x}", h.0)),
        "tail_tokens": hashed.tokens.len() % block_size.max(1) as usize,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenize_shows_prompt_tokens_and_hashes() {
        let dir = kvroute_protocol::samples_dir().join("vllm/tiny-llama-tokenizer");
        let out = tokenize(
            &dir,
            4,
            br#"{"model":"m","messages":[{"role":"user","content":"hello world"}]}"#,
        )
        .unwrap();
        assert_eq!(
            out["rendered"],
            "<s><|user|>\nhello world<|end|>\n<|assistant|>\n"
        );
        let tokens = out["tokens"].as_u64().unwrap();
        assert_eq!(
            out["block_hashes"].as_array().unwrap().len() as u64,
            tokens / 4
        );
        assert_eq!(out["tail_tokens"].as_u64().unwrap(), tokens % 4);
        let last = out["block_hashes"].as_array().unwrap().last().unwrap();
        assert_eq!(
            out["last_block"],
            format!("{:016x}", last.as_u64().unwrap())
        );
        assert!(tokenize(&dir, 4, b"{not json").is_err());
    }

    #[test]
    fn decodes_the_captures_of_both_formats() {
        let samples = kvroute_protocol::samples_dir();
        let lines = decode_file(
            Format::VllmZmq,
            &samples.join("vllm/run1-sha256-default/raw/seq000000.payload.msgpack"),
        )
        .unwrap();
        assert_eq!(lines.len(), 1);
        assert_eq!(lines[0]["seq"], 0);
        assert_eq!(lines[0]["topic"], "kv-events");
        assert_eq!(
            lines[0]["event"]["block_hashes"][0].as_u64(),
            Some(6924434313678776887)
        );
        let lines = decode_file(
            Format::DynamoNats,
            &samples.join("dynamo/kv-events_removed_plus_stored_batch.msgpack"),
        )
        .unwrap();
        assert_eq!(lines.len(), 2);
        let metrics = decode_file(
            Format::DynamoNats,
            &samples.join("dynamo/kv_metrics.msgpack"),
        )
        .unwrap();
        assert_eq!(metrics[0]["kv_metrics"]["kv_used_blocks"], 5);
        let wrong =
            decode_file(Format::VllmZmq, &samples.join("dynamo/kv_metrics.msgpack")).unwrap();
        assert!(wrong[0]["error"].is_string(), "{wrong:?}");
    }
}
