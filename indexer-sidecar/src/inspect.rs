//! `kvroute-sidecar decode`: captured event payloads as JSON lines, so an operator can check
//! what an engine publishes without running the sidecar.

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
    /// read too when present (the layout of the captures in `shared/data/samples/vllm`).
    VllmZmq,
}

/// One JSON object per event in `path` (hashes as u64); an undecodable file is one object
/// with an `error`.
pub fn decode_file(format: Format, path: &Path) -> anyhow::Result<Vec<Value>> {
    let body = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let file = path.display().to_string();
    let out = match format {
        Format::DynamoNats => match decode_message(&body) {
            Ok(decoded) => decoded
                .events
                .iter()
                .map(|e| json!({"file": file, "topic": decoded.topic, "event": e}))
                .collect(),
            Err(events_error) => match decode_kv_metrics(&body) {
                Ok(m) => vec![json!({"file": file, "topic": "kv_metrics", "kv_metrics": {
                    "worker_id": m.worker_id, "dp_rank": m.dp_rank,
                    "kv_used_blocks": m.kv_used_blocks, "active_prefill_tokens": m.active_prefill_tokens,
                    "active_decode_blocks": m.active_decode_blocks}})],
                Err(_) => vec![json!({"file": file, "error": events_error.to_string()})],
            },
        },
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
            match decode_batch(&body) {
                Ok(batch) => batch
                    .events
                    .iter()
                    .map(|e| {
                        json!({"file": file, "seq": seq, "topic": topic, "ts": batch.ts,
                               "dp_rank": batch.dp_rank, "event": vllm_json(e)})
                    })
                    .collect(),
                Err(e) => vec![json!({"file": file, "seq": seq, "error": e.to_string()})],
            }
        }
    };
    Ok(out)
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
        } => json!({
            "type": "BlockStored",
            "block_hashes": block_hashes.iter().map(|h| h.0).collect::<Vec<_>>(),
            "parent_block_hash": parent.map(|p| p.0),
            "token_ids": token_ids,
            "block_size": block_size,
            "lora_name": lora_name,
            "medium": medium,
            "blocks_with_extra_keys": has_extra_keys.iter().filter(|&&x| x).count(),
        }),
        VllmEvent::BlockRemoved {
            block_hashes,
            medium,
        } => json!({
            "type": "BlockRemoved",
            "block_hashes": block_hashes.iter().map(|h| h.0).collect::<Vec<_>>(),
            "medium": medium,
        }),
        VllmEvent::AllBlocksCleared => json!({"type": "AllBlocksCleared"}),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
