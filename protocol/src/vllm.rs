//! vLLM's native KV-event stream (`--kv-events-config` with the `zmq` publisher).
//!
//! Each message is three ZMQ frames: the topic (UTF-8, may be empty), a sequence number (u64
//! big-endian, per publisher, +1 per message), and a msgpack payload: a batch
//! `[ts, events, data_parallel_rank]` (older vLLM: `[ts, events]`). Events come in two
//! encodings, both accepted:
//! - maps tagged by `"type"` (vLLM ≥ 0.11): `{"type": "BlockStored", "block_hashes": […],
//!   "parent_block_hash": …, "token_ids": […], "block_size": 32, "lora_name": …, "medium": "GPU",
//!   "extra_keys": […], …}`; unknown fields are ignored;
//! - positional arrays (older vLLM, msgspec `array_like`): `["BlockStored", block_hashes,
//!   parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]`, trailing fields
//!   optional; `["BlockRemoved", block_hashes, medium]`; `["AllBlocksCleared"]`.
//!
//! Block hashes are integers (default) or 32-byte strings (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`);
//! both become an [`EngineBlockHash`] (bytes are folded with xxh3). They only name blocks for
//! parents and removals: kvroute never recomputes vLLM's hash, it hashes `token_ids` itself.
//!
//! Replay (the `replay_endpoint`, a ROUTER socket): a DEALER sends `["", seq u64 BE]` and gets
//! every buffered message from `seq` on as `["", topic, seq, payload]`, then the end marker
//! `["", "", u64::MAX, ""]`. A REQ client gets the same without the empty delimiter frame.

use std::borrow::Cow;

use rmpv::Value;
use smallvec::SmallVec;
use xxhash_rust::xxh3::xxh3_64;

mod direct;

use crate::msgpack::Writer;

/// The sequence number vLLM's replay socket sends after the last buffered message.
pub const REPLAY_END: u64 = u64::MAX;

/// vLLM's name for a cached block (opaque; only equality matters).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EngineBlockHash(pub u64);

/// An event's block hashes: a decode step stores one block a request, an eviction a few.
/// Inline up to 4 — like [`TokenIds`] and [`ExtraKeys`], so an event storm's common event
/// allocates nothing of its own (the allocator was a fifth of the sidecar's time in it).
pub type BlockHashes = SmallVec<[EngineBlockHash; 4]>;

/// An event's tokens: one block's at vLLM's default block size inline.
pub type TokenIds = SmallVec<[u32; 16]>;

/// Per block, whether extra keys went into its hash.
pub type ExtraKeys = SmallVec<[bool; 4]>;

/// A storage tier's name; the common ones borrowed ([`medium`]).
pub type Medium = Cow<'static, str>;

/// A storage tier named in an event, without allocating for the tiers vLLM has.
pub fn medium(name: &str) -> Medium {
    match name {
        "GPU" => Cow::Borrowed("GPU"),
        "CPU" => Cow::Borrowed("CPU"),
        "DISK" => Cow::Borrowed("DISK"),
        other => Cow::Owned(other.to_owned()),
    }
}

/// One cache event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VllmEvent {
    /// Blocks stored, in order, after `parent`.
    BlockStored {
        /// The blocks' hashes.
        block_hashes: BlockHashes,
        /// Hash of the block before the first one (`None`: start of a prompt).
        parent: Option<EngineBlockHash>,
        /// Tokens of all the blocks, `block_size` per block.
        token_ids: TokenIds,
        /// Tokens per block.
        block_size: u32,
        /// LoRA adapter the blocks were computed with.
        lora_name: Option<String>,
        /// Storage tier (`GPU`, `CPU`, …; absent in older vLLM: GPU).
        medium: Option<Medium>,
        /// Per block: whether extra keys (multimodal inputs, cache salt) went into its hash.
        has_extra_keys: ExtraKeys,
        /// The engine's KV-cache group (hybrid models have several; absent: one).
        group: Option<u32>,
        /// The group's kind (`full_attention`, `sliding_window`, `mamba`, …; absent in older
        /// vLLM).
        kind: Option<String>,
    },
    /// Blocks evicted.
    BlockRemoved {
        /// Their hashes.
        block_hashes: BlockHashes,
        /// Storage tier.
        medium: Option<Medium>,
        /// The engine's KV-cache group.
        group: Option<u32>,
    },
    /// The whole cache was reset.
    AllBlocksCleared,
}

/// One message's payload.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EventBatch {
    /// Publication time, seconds since the Unix epoch.
    pub ts: f64,
    /// The events in order.
    pub events: Vec<VllmEvent>,
    /// Data-parallel rank (0 when absent).
    pub dp_rank: u32,
    /// Elements of `events` that were not events kvroute knows.
    pub skipped: usize,
    /// Field names of the events that kvroute does not know (distinct, in order seen): newer
    /// engines add fields; the events are applied without them.
    pub unknown_fields: Vec<String>,
}

/// Fields of vLLM's events as of its `kv_events.py` today (`BlockStored`, `BlockRemoved`,
/// `AllBlocksCleared`, tagged by `type`); any other is counted as unknown.
pub const KNOWN_FIELDS: &[&str] = &[
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
];

/// Kinds of KV-cache group whose blocks are a prefix cache as kvroute models it: every block of
/// a prompt kept until evicted. A sliding-window group drops a prompt's early blocks at once and
/// a state-space (mamba) group keeps no per-block prefix: their events say nothing about which
/// prefixes a request can reuse, and applied as if they did they would remove blocks the
/// full-attention group still holds.
pub const PREFIX_CACHE_KINDS: &[&str] = &["full_attention", "mla_attention", "sink_full_attention"];

/// Which events of a hybrid model's engine feed the index: those of its prefix-cache groups
/// ([`PREFIX_CACHE_KINDS`]). A group's kind is learned from its stored events; a group not
/// learned yet counts as a prefix cache when it is group 0 or unnamed (engines before groups
/// were named had one group).
#[derive(Debug, Default, Clone)]
pub struct GroupFilter {
    prefix_cache: std::collections::HashMap<u32, bool>,
}

impl GroupFilter {
    /// Whether `event` feeds the index.
    pub fn keep(&mut self, event: &VllmEvent) -> bool {
        let (group, kind) = match event {
            VllmEvent::BlockStored { group, kind, .. } => (*group, kind.as_deref()),
            VllmEvent::BlockRemoved { group, .. } => (*group, None),
            VllmEvent::AllBlocksCleared => return true,
        };
        let Some(group) = group else {
            return true;
        };
        if let Some(kind) = kind {
            let prefix = PREFIX_CACHE_KINDS.contains(&kind);
            self.prefix_cache.insert(group, prefix);
        }
        self.prefix_cache.get(&group).copied().unwrap_or(group == 0)
    }
}

/// Why a payload could not be decoded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum VllmDecodeError {
    /// Not msgpack.
    #[error("payload is not msgpack: {0}")]
    Msgpack(String),
    /// msgpack, but not an event batch.
    #[error("not an event batch: {0}")]
    Shape(&'static str),
    /// The sequence frame is not 8 bytes.
    #[error("sequence frame has {0} bytes, not 8")]
    SeqFrame(usize),
    /// Bytes follow the batch.
    #[error("{0} trailing bytes after the batch")]
    Trailing(usize),
}

/// Parse the sequence frame.
pub fn decode_seq(frame: &[u8]) -> Result<u64, VllmDecodeError> {
    let bytes: [u8; 8] = frame
        .try_into()
        .map_err(|_| VllmDecodeError::SeqFrame(frame.len()))?;
    Ok(u64::from_be_bytes(bytes))
}

/// Decode a payload frame. Malformed events inside a well-formed batch are skipped and counted.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, VllmDecodeError> {
    if let Some(batch) = direct::decode(payload) {
        return Ok(batch);
    }
    decode_batch_tree(payload)
}

/// The general decoder: through a `rmpv::Value` tree, skipping and counting what it does not
/// know.
fn decode_batch_tree(payload: &[u8]) -> Result<EventBatch, VllmDecodeError> {
    let mut cursor = payload;
    let value = rmpv::decode::read_value_with_max_depth(&mut cursor, MAX_DEPTH)
        .map_err(|e| VllmDecodeError::Msgpack(e.to_string()))?;
    if !cursor.is_empty() {
        return Err(VllmDecodeError::Trailing(cursor.len()));
    }
    let (ts, events, dp_rank) = match &value {
        Value::Array(items) => (items.first(), items.get(1), items.get(2)),
        Value::Map(_) => (
            field(&value, "ts"),
            field(&value, "events"),
            field(&value, "data_parallel_rank"),
        ),
        _ => return Err(VllmDecodeError::Shape("neither an array nor a map")),
    };
    let events = events
        .and_then(Value::as_array)
        .ok_or(VllmDecodeError::Shape("no event list"))?;
    let mut batch = EventBatch {
        ts: ts.and_then(Value::as_f64).unwrap_or(0.0),
        dp_rank: dp_rank
            .and_then(Value::as_u64)
            .and_then(|r| u32::try_from(r).ok())
            .unwrap_or(0),
        ..EventBatch::default()
    };
    for e in events {
        if let Value::Map(fields) = e {
            for (k, _) in fields {
                let name = k.as_str().unwrap_or("?");
                if !KNOWN_FIELDS.contains(&name) && !batch.unknown_fields.iter().any(|f| f == name)
                {
                    batch.unknown_fields.push(name.to_owned());
                }
            }
        }
        match decode_event(e) {
            Some(event) => batch.events.push(event),
            None => batch.skipped += 1,
        }
    }
    Ok(batch)
}

/// Deeper nesting than any batch has is refused rather than recursed into.
const MAX_DEPTH: usize = 16;

fn field<'a>(map: &'a Value, name: &str) -> Option<&'a Value> {
    map.as_map()?
        .iter()
        .find(|(k, _)| k.as_str() == Some(name))
        .map(|(_, v)| v)
}

fn decode_event(value: &Value) -> Option<VllmEvent> {
    match value {
        Value::Map(_) => {
            let get = |name| field(value, name);
            match get("type")?.as_str()? {
                "BlockStored" => stored(StoredFields {
                    hashes: get("block_hashes"),
                    parent: get("parent_block_hash"),
                    tokens: get("token_ids"),
                    block_size: get("block_size"),
                    lora_name: get("lora_name"),
                    medium: get("medium"),
                    extra_keys: get("extra_keys"),
                    group: get("group_idx"),
                    kind: get("kv_cache_spec_kind"),
                }),
                "BlockRemoved" => removed(get("block_hashes"), get("medium"), get("group_idx")),
                "AllBlocksCleared" => Some(VllmEvent::AllBlocksCleared),
                _ => None,
            }
        }
        Value::Array(items) => {
            let at = |i: usize| items.get(i);
            match at(0)?.as_str()? {
                // Declaration order: block_hashes, parent_block_hash, token_ids, block_size,
                // lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, ….
                "BlockStored" => stored(StoredFields {
                    hashes: at(1),
                    parent: at(2),
                    tokens: at(3),
                    block_size: at(4),
                    lora_name: at(7),
                    medium: at(6),
                    extra_keys: at(8),
                    group: at(9),
                    kind: at(10),
                }),
                "BlockRemoved" => removed(at(1), at(2), at(3)),
                "AllBlocksCleared" => Some(VllmEvent::AllBlocksCleared),
                _ => None,
            }
        }
        _ => None,
    }
}

/// A stored event's fields, as either encoding places them.
struct StoredFields<'a> {
    hashes: Option<&'a Value>,
    parent: Option<&'a Value>,
    tokens: Option<&'a Value>,
    block_size: Option<&'a Value>,
    lora_name: Option<&'a Value>,
    medium: Option<&'a Value>,
    extra_keys: Option<&'a Value>,
    group: Option<&'a Value>,
    kind: Option<&'a Value>,
}

fn stored(f: StoredFields<'_>) -> Option<VllmEvent> {
    let StoredFields {
        hashes,
        parent,
        tokens,
        block_size,
        lora_name,
        medium,
        extra_keys,
        group,
        kind,
    } = f;
    let block_hashes = hash_list(hashes?)?;
    let parent = match parent {
        None | Some(Value::Nil) => None,
        Some(v) => Some(block_hash(v)?),
    };
    let token_ids = tokens?
        .as_array()?
        .iter()
        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
        .collect::<Option<TokenIds>>()?;
    let block_size = u32::try_from(block_size?.as_u64()?).ok()?;
    let has_extra_keys = match extra_keys.and_then(Value::as_array) {
        Some(keys) => keys.iter().map(|k| !k.is_nil()).collect(),
        None => smallvec::smallvec![false; block_hashes.len()],
    };
    Some(VllmEvent::BlockStored {
        block_hashes,
        parent,
        token_ids,
        block_size,
        lora_name: lora_name.and_then(Value::as_str).map(str::to_owned),
        medium: medium.and_then(Value::as_str).map(self::medium),
        has_extra_keys,
        group: group_of(group),
        kind: kind.and_then(Value::as_str).map(str::to_owned),
    })
}

fn removed(
    hashes: Option<&Value>,
    medium: Option<&Value>,
    group: Option<&Value>,
) -> Option<VllmEvent> {
    Some(VllmEvent::BlockRemoved {
        block_hashes: hash_list(hashes?)?,
        medium: medium.and_then(Value::as_str).map(self::medium),
        group: group_of(group),
    })
}

fn group_of(v: Option<&Value>) -> Option<u32> {
    v.and_then(Value::as_u64)
        .and_then(|g| u32::try_from(g).ok())
}

fn hash_list(v: &Value) -> Option<BlockHashes> {
    v.as_array()?.iter().map(block_hash).collect()
}

/// Integers as they are (negative ones reinterpreted); byte strings folded with xxh3.
fn block_hash(v: &Value) -> Option<EngineBlockHash> {
    match v {
        Value::Integer(i) => i
            .as_u64()
            .or_else(|| i.as_i64().map(|n| n as u64))
            .map(EngineBlockHash),
        Value::Binary(b) => Some(EngineBlockHash(xxh3_64(b))),
        Value::String(s) => Some(EngineBlockHash(xxh3_64(s.as_bytes()))),
        _ => None,
    }
}

/// How the simulated engine encodes events (vLLM's two encodings).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventEncoding {
    /// `"type"`-tagged maps (vLLM ≥ 0.11).
    Map,
    /// Positional arrays (older vLLM).
    Array,
}

/// Encode a batch as vLLM does (integer hashes), for the simulated engines, the storm's
/// publisher and tests. Written straight to bytes: a value tree cost the storm's publisher more
/// CPU than the sidecar reading what it sent.
pub fn encode_batch(batch: &EventBatch, encoding: EventEncoding) -> Vec<u8> {
    let mut out = Writer(Vec::with_capacity(16 + 160 * batch.events.len()));
    out.array(3);
    out.f64(batch.ts);
    out.array(batch.events.len());
    for event in &batch.events {
        encode_event(&mut out, event, encoding);
    }
    out.uint(u64::from(batch.dp_rank));
    out.0
}

/// A field's value as vLLM writes it.
enum Field<'a> {
    Nil,
    Uint(u64),
    Text(&'a str),
    Hashes(&'a [EngineBlockHash]),
    Tokens(&'a [u32]),
    /// Per block: a placeholder key where it had extra keys, else nil.
    ExtraKeys(&'a [bool]),
}

fn text<S: std::ops::Deref<Target = str>>(s: &Option<S>) -> Field<'_> {
    s.as_deref().map_or(Field::Nil, Field::Text)
}

fn encode_event(out: &mut Writer, event: &VllmEvent, encoding: EventEncoding) {
    let (kind, fields): (&str, Vec<(&str, Field<'_>)>) = match event {
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
        } => {
            let mut fields = vec![
                ("block_hashes", Field::Hashes(block_hashes)),
                (
                    "parent_block_hash",
                    parent.map_or(Field::Nil, |p| Field::Uint(p.0)),
                ),
                ("token_ids", Field::Tokens(token_ids)),
                ("block_size", Field::Uint(u64::from(*block_size))),
                ("lora_id", Field::Nil),
                ("medium", text(medium)),
                ("lora_name", text(lora_name)),
                ("extra_keys", Field::ExtraKeys(has_extra_keys)),
            ];
            // Newer vLLM's fields, only when set: older consumers see older shapes.
            if let Some(g) = group {
                fields.push(("group_idx", Field::Uint(u64::from(*g))));
                fields.push(("kv_cache_spec_kind", text(kind)));
            }
            ("BlockStored", fields)
        }
        VllmEvent::BlockRemoved {
            block_hashes,
            medium,
            group,
        } => {
            let mut fields = vec![
                ("block_hashes", Field::Hashes(block_hashes)),
                ("medium", text(medium)),
            ];
            if let Some(g) = group {
                fields.push(("group_idx", Field::Uint(u64::from(*g))));
            }
            ("BlockRemoved", fields)
        }
        VllmEvent::AllBlocksCleared => ("AllBlocksCleared", Vec::new()),
    };
    match encoding {
        EventEncoding::Map => {
            out.map(1 + fields.len());
            out.text("type");
            out.text(kind);
            for (name, value) in &fields {
                out.text(name);
                out.field(value);
            }
        }
        // The positional form is older vLLM's: fields up to `lora_name`.
        EventEncoding::Array => {
            let older =
                |name: &&str| !["extra_keys", "group_idx", "kv_cache_spec_kind"].contains(name);
            let kept: Vec<&Field<'_>> = fields
                .iter()
                .filter(|(name, _)| older(name))
                .map(|(_, v)| v)
                .collect();
            out.array(1 + kept.len());
            out.text(kind);
            for value in kept {
                out.field(value);
            }
        }
    }
}

/// MessagePack into a `Vec`, each value in its shortest form (as vLLM's msgspec writes).
/// Writing to a `Vec` cannot fail, so the writers' results carry nothing.
impl Writer {
    fn field(&mut self, value: &Field<'_>) {
        match value {
            Field::Nil => self.nil(),
            Field::Uint(v) => self.uint(*v),
            Field::Text(s) => self.text(s),
            Field::Hashes(hashes) => {
                self.array(hashes.len());
                for h in *hashes {
                    self.uint(h.0);
                }
            }
            Field::Tokens(tokens) => {
                self.array(tokens.len());
                for &t in *tokens {
                    self.uint(u64::from(t));
                }
            }
            Field::ExtraKeys(keys) => {
                self.array(keys.len());
                for &k in *keys {
                    if k {
                        self.text("extra");
                    } else {
                        self.nil();
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runs() -> Vec<std::path::PathBuf> {
        let dir = crate::samples_dir().join("vllm");
        let mut runs: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| Some(e.ok()?.path()))
            .filter(|p| p.join("raw").is_dir())
            .collect();
        runs.sort();
        runs
    }

    /// Every captured message decodes, with as many events of each type as the reference
    /// decoding (Python msgpack) shows, and nothing skipped.
    #[test]
    fn every_capture_decodes() {
        let runs = runs();
        assert_eq!(runs.len(), 4);
        let mut total = 0;
        for run in runs {
            let reference: Vec<serde_json::Value> =
                std::fs::read_to_string(run.join("events.jsonl"))
                    .unwrap()
                    .lines()
                    .map(|l| serde_json::from_str(l).unwrap())
                    .collect();
            for r in &reference {
                let seq = r["seq"].as_u64().unwrap();
                let base = run.join("raw").join(format!("seq{seq:06}"));
                let payload = std::fs::read(base.with_extension("payload.msgpack")).unwrap();
                let seq_frame = std::fs::read(base.with_extension("seq")).unwrap();
                let topic = std::fs::read(base.with_extension("topic")).unwrap();
                assert_eq!(decode_seq(&seq_frame).unwrap(), seq);
                assert_eq!(topic, r["topic"].as_str().unwrap().as_bytes());
                let batch = decode_batch(&payload).unwrap();
                let want = r["decoded"][1].as_array().unwrap();
                assert_eq!(batch.skipped, 0, "{}", base.display());
                assert_eq!(batch.events.len(), want.len(), "{}", base.display());
                assert_eq!(batch.dp_rank, r["decoded"][2].as_u64().unwrap() as u32);
                for (got, want) in batch.events.iter().zip(want) {
                    let kind = want["type"].as_str().unwrap();
                    match got {
                        VllmEvent::BlockStored {
                            block_hashes,
                            token_ids,
                            block_size,
                            medium,
                            ..
                        } => {
                            assert_eq!(kind, "BlockStored");
                            assert_eq!(token_ids.len(), block_hashes.len() * *block_size as usize);
                            assert_eq!(medium.as_deref(), Some("GPU"));
                            if let Some(first) = want["block_hashes"][0].as_u64() {
                                assert_eq!(block_hashes[0], EngineBlockHash(first));
                            }
                        }
                        VllmEvent::BlockRemoved { .. } => assert_eq!(kind, "BlockRemoved"),
                        VllmEvent::AllBlocksCleared => assert_eq!(kind, "AllBlocksCleared"),
                    }
                    total += 1;
                }
            }
        }
        assert_eq!(total, 5 + 13 + 35 + 1 + 6 + 14);
    }

    #[test]
    fn byte_hashes_are_folded_consistently() {
        let run = crate::samples_dir().join("vllm/run3-sha256-seed0-bytes-hashes/raw");
        let first =
            decode_batch(&std::fs::read(run.join("seq000003.payload.msgpack")).unwrap()).unwrap();
        let second =
            decode_batch(&std::fs::read(run.join("seq000004.payload.msgpack")).unwrap()).unwrap();
        let (
            VllmEvent::BlockStored { block_hashes, .. },
            VllmEvent::BlockStored {
                parent: Some(parent),
                ..
            },
        ) = (&first.events[0], &second.events[0])
        else {
            panic!("unexpected events {first:?} {second:?}");
        };
        assert!(
            block_hashes.contains(parent),
            "a later store's parent names an earlier block"
        );
    }

    /// Every kind of event, with and without each optional field.
    /// The bytes of every shape, pinned (they were rmpv's, from a value tree; each value in its
    /// shortest form, as msgspec writes): the direct writer changes nothing on the wire.
    #[test]
    fn encodes_every_shape_byte_for_byte() {
        let hex = |bytes: Vec<u8>| -> String { bytes.iter().map(|b| format!("{b:02x}")).collect() };
        assert_eq!(
            hex(encode_batch(&mixed_batch(), EventEncoding::Map)),
            "93cb3ff80000000000009589a474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739207cfffffffffffffffffb1706172656e745f626c6f636b5f6861736803a9746f6b656e5f696473980001020304050607aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65a761646170746572aa65787472615f6b65797392c0a565787472618ba474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739108b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739400010203aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756dc0a96c6f72615f6e616d65c0aa65787472615f6b65797391c0a967726f75705f69647801b26b765f63616368655f737065635f6b696e64ae736c6964696e675f77696e646f7783a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739107a66d656469756dc084a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739108a66d656469756dc0a967726f75705f6964780181a474797065b0416c6c426c6f636b73436c656172656402"
        );
        assert_eq!(
            hex(encode_batch(&mixed_batch(), EventEncoding::Array)),
            "93cb3ff80000000000009598ab426c6f636b53746f7265649207cfffffffffffffffff0398000102030405060704c0a3475055a76164617074657298ab426c6f636b53746f7265649108c0940001020304c0c0c093ac426c6f636b52656d6f7665649107c093ac426c6f636b52656d6f7665649108c091b0416c6c426c6f636b73436c656172656402"
        );
    }

    fn mixed_batch() -> EventBatch {
        EventBatch {
            ts: 1.5,
            dp_rank: 2,
            events: vec![
                VllmEvent::BlockStored {
                    block_hashes: vec![EngineBlockHash(7), EngineBlockHash(u64::MAX)].into(),
                    parent: Some(EngineBlockHash(3)),
                    token_ids: (0..8).collect(),
                    block_size: 4,
                    lora_name: Some("adapter".into()),
                    medium: Some("GPU".into()),
                    has_extra_keys: vec![false, true].into(),
                    group: None,
                    kind: None,
                },
                VllmEvent::BlockStored {
                    block_hashes: vec![EngineBlockHash(8)].into(),
                    parent: None,
                    token_ids: (0..4).collect(),
                    block_size: 4,
                    lora_name: None,
                    medium: None,
                    has_extra_keys: vec![false].into(),
                    group: Some(1),
                    kind: Some("sliding_window".into()),
                },
                VllmEvent::BlockRemoved {
                    block_hashes: vec![EngineBlockHash(7)].into(),
                    medium: None,
                    group: None,
                },
                VllmEvent::BlockRemoved {
                    block_hashes: vec![EngineBlockHash(8)].into(),
                    medium: None,
                    group: Some(1),
                },
                VllmEvent::AllBlocksCleared,
            ],
            ..EventBatch::default()
        }
    }

    #[test]
    fn both_encodings_round_trip() {
        let batch = mixed_batch();
        assert_eq!(
            decode_batch(&encode_batch(&batch, EventEncoding::Map)).unwrap(),
            batch
        );
        // The positional form is older vLLM's: no extra keys, no groups.
        let mut legacy = batch.clone();
        for e in &mut legacy.events {
            match e {
                VllmEvent::BlockStored {
                    has_extra_keys,
                    group,
                    kind,
                    ..
                } => {
                    has_extra_keys.iter_mut().for_each(|x| *x = false);
                    (*group, *kind) = (None, None);
                }
                VllmEvent::BlockRemoved { group, .. } => *group = None,
                VllmEvent::AllBlocksCleared => {}
            }
        }
        assert_eq!(
            decode_batch(&encode_batch(&batch, EventEncoding::Array)).unwrap(),
            legacy
        );
    }

    /// A batch as vLLM's `kv_events.py` encodes it today (msgspec: the batch and each event a
    /// map, events tagged by `type`) for a hybrid model — group 0 full attention, group 1 a
    /// sliding window — with fields and an event type kvroute does not know (as forks and
    /// later versions add them): every known event is decoded with its group, the unknown type
    /// is skipped and counted, the unknown fields are named; the group filter keeps group 0's
    /// events and drops group 1's, removals included.
    #[test]
    fn newer_vllm_events_decode_and_hybrid_groups_are_told_apart() {
        let map = |fields: Vec<(&str, Value)>| {
            Value::Map(
                fields
                    .into_iter()
                    .map(|(k, v)| (Value::from(k), v))
                    .collect(),
            )
        };
        let stored = |hash: u64, group: u32, kind: &str| {
            map(vec![
                ("type", Value::from("BlockStored")),
                ("block_hashes", Value::Array(vec![Value::from(hash)])),
                ("parent_block_hash", Value::Nil),
                ("token_ids", Value::Array((0..4).map(Value::from).collect())),
                ("block_size", Value::from(4)),
                ("lora_id", Value::Nil),
                ("medium", Value::from("GPU")),
                ("lora_name", Value::Nil),
                ("extra_keys", Value::Array(vec![Value::Nil])),
                ("group_idx", Value::from(group)),
                ("kv_cache_spec_kind", Value::from(kind)),
                ("kv_cache_spec_sliding_window", Value::Nil),
                ("component_id", Value::from("attn")),
                ("snapshot_version", Value::from(3)),
            ])
        };
        let removed = |hash: u64, group: u32| {
            map(vec![
                ("type", Value::from("BlockRemoved")),
                ("block_hashes", Value::Array(vec![Value::from(hash)])),
                ("medium", Value::from("GPU")),
                ("group_idx", Value::from(group)),
                ("remaining_copy_counts", Value::Nil),
            ])
        };
        let batch = map(vec![
            ("ts", Value::F64(2.0)),
            (
                "events",
                Value::Array(vec![
                    stored(10, 0, "full_attention"),
                    stored(10, 1, "sliding_window"),
                    map(vec![
                        ("type", Value::from("BlockInactive")),
                        ("block_hashes", Value::Array(vec![Value::from(10)])),
                    ]),
                    removed(10, 1),
                    removed(11, 2),
                ]),
            ),
            ("data_parallel_rank", Value::from(1)),
        ]);
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, &batch).unwrap();
        let decoded = decode_batch(&bytes).unwrap();
        assert_eq!(decoded.dp_rank, 1);
        assert_eq!(decoded.skipped, 1, "BlockInactive");
        assert_eq!(decoded.events.len(), 4);
        assert_eq!(
            decoded.unknown_fields,
            ["component_id", "snapshot_version", "remaining_copy_counts"]
        );
        assert!(matches!(
            &decoded.events[1],
            VllmEvent::BlockStored { group: Some(1), kind: Some(k), .. } if k == "sliding_window"
        ));
        let mut filter = GroupFilter::default();
        let kept: Vec<bool> = decoded.events.iter().map(|e| filter.keep(e)).collect();
        assert_eq!(
            kept,
            [true, false, false, false],
            "group 2 was never named: not group 0, not kept"
        );
        assert!(filter.keep(&VllmEvent::AllBlocksCleared));
    }

    /// Every payload the tests know: the captures of real vLLM and both encodings of
    /// [`mixed_batch`].
    fn known_payloads() -> Vec<Vec<u8>> {
        let mut payloads: Vec<Vec<u8>> = runs()
            .iter()
            .flat_map(|run| std::fs::read_dir(run.join("raw")).unwrap())
            .map(|e| e.unwrap().path())
            .filter(|p| p.to_string_lossy().ends_with(".payload.msgpack"))
            .map(|p| std::fs::read(p).unwrap())
            .collect();
        payloads.sort();
        payloads.push(encode_batch(&mixed_batch(), EventEncoding::Map));
        payloads.push(encode_batch(&mixed_batch(), EventEncoding::Array));
        payloads
    }

    /// The direct decoder takes every payload of real vLLM and of both encodings, and reads
    /// each exactly as the tree decoder does.
    #[test]
    fn the_direct_decoder_reads_what_the_tree_reads() {
        let payloads = known_payloads();
        assert!(payloads.len() > 10, "{}", payloads.len());
        for p in &payloads {
            let direct = direct::decode(p).expect("the common case decodes directly");
            assert_eq!(direct, decode_batch_tree(p).unwrap());
        }
    }

    /// On damaged payloads (each byte replaced in turn by a few values, cut at every length)
    /// the direct decoder either steps aside or agrees with the tree decoder.
    #[test]
    fn the_direct_decoder_agrees_or_steps_aside_on_damaged_input() {
        let (mut direct, mut checked) = (0, 0);
        for p in known_payloads().iter().step_by(7) {
            for d in crate::msgpack::damaged(&p[..p.len().min(600)]) {
                checked += 1;
                if let Some(batch) = direct::decode(&d) {
                    direct += 1;
                    assert_eq!(Ok(batch), decode_batch_tree(&d), "{d:?}");
                }
            }
        }
        assert!(direct > 100 && checked > 1000, "{direct} of {checked}");
    }

    /// A length that lies (4 billion events, or tokens, in a few bytes) allocates nothing it
    /// cannot fill: an error, not an abort.
    #[test]
    fn a_lying_length_is_an_error_not_an_allocation() {
        let mut batch = vec![0x92, 0xcb];
        batch.extend_from_slice(&1.5f64.to_bits().to_be_bytes());
        let mut events = batch.clone();
        events.extend_from_slice(&[0xdd, 0xff, 0xff, 0xff, 0xff]);
        let mut tokens = batch;
        // [["BlockStored", [7], nil, <4 billion tokens>: 1]]
        tokens.extend_from_slice(&[0x91, 0x94, 0xab]);
        tokens.extend_from_slice(b"BlockStored");
        tokens.extend_from_slice(&[0x91, 0x07, 0xc0, 0xdd, 0xff, 0xff, 0xff, 0xff, 0x01]);
        for payload in [events, tokens] {
            assert!(direct::decode(&payload).is_none());
            assert!(decode_batch(&payload).is_err());
        }
    }

    #[test]
    fn malformed_input_is_an_error_or_skipped_never_a_panic() {
        assert!(decode_batch(b"").is_err());
        assert!(decode_batch(b"\xc1").is_err());
        assert!(decode_batch(&[0x91; 4096]).is_err(), "deep nesting refused");
        assert_eq!(decode_seq(b"123"), Err(VllmDecodeError::SeqFrame(3)));
        // An array claiming 2^32-1 elements with none present.
        assert!(decode_batch(b"\xdd\xff\xff\xff\xff").is_err());
        let mut trailing = encode_batch(&EventBatch::default(), EventEncoding::Map);
        trailing.push(0);
        assert_eq!(decode_batch(&trailing), Err(VllmDecodeError::Trailing(1)));
        // Unknown event types and broken events are skipped, the rest kept.
        let value = Value::Array(vec![
            Value::F64(0.0),
            Value::Array(vec![
                Value::Map(vec![(Value::from("type"), Value::from("BlockMoved"))]),
                Value::Array(vec![Value::from("BlockStored"), Value::from("not a list")]),
                Value::from(5),
                Value::Array(vec![Value::from("AllBlocksCleared")]),
            ]),
        ]);
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, &value).unwrap();
        let batch = decode_batch(&bytes).unwrap();
        assert_eq!(batch.events, vec![VllmEvent::AllBlocksCleared]);
        assert_eq!((batch.skipped, batch.dp_rank), (3, 0));
        // Every prefix of a real capture fails cleanly.
        let real = std::fs::read(
            crate::samples_dir()
                .join("vllm/run2-sha256_cbor-evict-reset/raw/seq000005.payload.msgpack"),
        )
        .unwrap();
        for cut in 0..real.len() {
            let _ = decode_batch(&real[..cut]);
        }
    }
}
