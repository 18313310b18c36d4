//! NVIDIA Dynamo's KV-event wire format on NATS.
//!
//! A NATS message body is a msgpack map [`Envelope`] whose `payload` (msgpack `bin`) holds either
//! one [`RouterEvent`] (Dynamo 1.2.x) or an array of them (1.6.x). Legacy 1.2.x JetStream mode
//! carries a plain JSON `RouterEvent` with no envelope. Unknown fields are ignored by the decode
//! ([`unknown_fields`] names them); an array element that is not a known event is skipped and
//! counted, not fatal, and keeps its number in its worker's sequence where it can be read.
//!
//! Subjects: 1.2.x `namespace.<ns>.component.<comp>.kv-events`, 1.6.x
//! `namespace.<ns>.component.<comp>.endpoint.<ep>.kv-events` (see [`SubjectInfo`]).

use std::borrow::Cow;

use serde::{de::IgnoredAny, Deserialize, Serialize};

mod direct;

use crate::msgpack::Writer;

/// The `topic` Dynamo writes into envelopes of KV events.
pub const KV_EVENTS_TOPIC: &str = "kv-events";
/// Envelope topic (and last subject segment) of a worker's KV usage messages.
pub const KV_METRICS_TOPIC: &str = "kv_metrics";

/// The msgpack map around every Dynamo NATS message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Envelope {
    /// Random id of the publishing process.
    pub publisher_id: u64,
    /// Per-publisher message counter.
    pub sequence: u64,
    /// Publication time, ms since the Unix epoch.
    pub published_at: u64,
    /// `kv-events`, `kv_metrics`, …
    pub topic: String,
    /// msgpack-encoded body (one event or an array of events).
    #[serde(with = "serde_bytes")]
    pub payload: Vec<u8>,
}

/// One KV-cache event of one worker, as Dynamo's router sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouterEvent {
    /// Dynamo instance id of the worker (u64, often ≥ 2^63).
    pub worker_id: u64,
    /// `device` for GPU memory; other tiers are offload copies.
    #[serde(default = "default_tier")]
    pub storage_tier: Cow<'static, str>,
    /// Present from 1.6 on (`worker`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub residency_domain: Option<Cow<'static, str>>,
    /// The event proper.
    pub event: KvCacheEvent,
}

fn default_tier() -> Cow<'static, str> {
    Cow::Borrowed("device")
}

/// A storage tier's or residency domain's name, borrowed for the ones Dynamo 1.6 writes on
/// every event: a common event's names allocate nothing.
fn tier(name: &str) -> Cow<'static, str> {
    match name {
        "device" => Cow::Borrowed("device"),
        "worker" => Cow::Borrowed("worker"),
        other => Cow::Owned(other.to_owned()),
    }
}

/// The body of a [`RouterEvent`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvCacheEvent {
    /// Per (worker_id, dp_rank) counter: the gap-detection cursor.
    pub event_id: u64,
    /// What happened.
    pub data: KvCacheEventData,
    /// Data-parallel rank inside the worker; each rank has its own cache.
    #[serde(default)]
    pub dp_rank: u32,
}

/// What happened to the cache.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvCacheEventData {
    /// Blocks were stored, in order, after `parent_hash`.
    Stored(StoredBlocks),
    /// Blocks were evicted.
    Removed(RemovedBlocks),
    /// The whole cache was dropped.
    Cleared,
}

/// Payload of a `stored` event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredBlocks {
    /// Engine hash of the block before the first stored one; `None` at the start of a prompt.
    pub parent_hash: Option<u64>,
    /// Position of the first block in the sequence, when the engine reports it (1.6).
    #[serde(default)]
    pub start_position: Option<u64>,
    /// The stored blocks, in sequence order.
    pub blocks: Vec<StoredBlock>,
}

/// One stored block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredBlock {
    /// The engine's hash of the block *with its prefix*; what later events refer to.
    pub block_hash: u64,
    /// Hash of the block's own tokens ([`crate::LocalBlockHash`]).
    pub tokens_hash: u64,
    /// Multimodal details; written as nil, ignored when read.
    #[serde(default, skip_deserializing)]
    pub mm_extra_info: Option<()>,
}

/// Payload of a `removed` event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemovedBlocks {
    /// Engine hashes of the evicted blocks.
    pub block_hashes: Vec<u64>,
}

/// Load report on the `kv_metrics` topic.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvMetrics {
    /// Dynamo instance id.
    pub worker_id: u64,
    /// Data-parallel rank.
    #[serde(default)]
    pub dp_rank: u32,
    /// Blocks held by running decodes.
    #[serde(default)]
    pub active_decode_blocks: Option<u64>,
    /// Prompt tokens waiting for or in prefill.
    #[serde(default)]
    pub active_prefill_tokens: Option<u64>,
    /// KV blocks in use.
    #[serde(default)]
    pub kv_used_blocks: Option<u64>,
}

/// Why a Dynamo message could not be decoded.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// The body is not a msgpack envelope.
    #[error("bad envelope: {0}")]
    Envelope(rmp_serde::decode::Error),
    /// The envelope's payload is neither an event nor an array of events.
    #[error("bad payload: {0}")]
    Payload(rmp_serde::decode::Error),
    /// A JetStream body is not a JSON RouterEvent.
    #[error("bad JSON event: {0}")]
    Json(serde_json::Error),
    /// The envelope carries another topic than the one asked for.
    #[error("envelope topic {0:?} is not {KV_METRICS_TOPIC}")]
    Topic(String),
}

/// The events of one message, plus how many array elements were not events we know.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct DecodedEvents {
    /// Envelope topic (empty for JetStream JSON bodies).
    pub topic: String,
    /// The events, in order.
    pub events: Vec<RouterEvent>,
    /// Array elements that did not decode as a RouterEvent (unknown variants, bad types). One
    /// whose worker and number could be read is among `events` as an empty removal.
    pub skipped: usize,
    /// The envelope's publisher and number (absent for JetStream JSON bodies).
    pub stamp: Option<Stamp>,
}

/// Who published an envelope and its number in that publisher's sequence: a gap is lost
/// messages, whatever they carried (events, load reports, a worker no one knows).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    /// Random id of the publishing process.
    pub publisher_id: u64,
    /// Per-publisher message counter.
    pub sequence: u64,
}

impl Envelope {
    /// Its publisher and number.
    pub fn stamp(&self) -> Stamp {
        Stamp {
            publisher_id: self.publisher_id,
            sequence: self.sequence,
        }
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum MaybeEvent {
    Known(RouterEvent),
    /// A kind we do not know, of a worker and number we can read.
    Numbered(NumberedEvent),
    Unknown(IgnoredAny),
}

/// What any event carries whatever its kind: its worker and its number.
#[derive(Deserialize)]
struct NumberedEvent {
    worker_id: u64,
    event: Number,
}

#[derive(Deserialize)]
struct Number {
    event_id: u64,
    #[serde(default)]
    dp_rank: u32,
}

impl NumberedEvent {
    /// An event of a kind kvroute does not know still takes its number in its worker's
    /// sequence: kept as an empty removal (nothing kvroute knows of changed), so that the next
    /// event is not taken for a gap.
    fn placeholder(self) -> RouterEvent {
        RouterEvent {
            worker_id: self.worker_id,
            storage_tier: default_tier(),
            residency_domain: None,
            event: KvCacheEvent {
                event_id: self.event.event_id,
                data: KvCacheEventData::Removed(RemovedBlocks {
                    block_hashes: Vec::new(),
                }),
                dp_rank: self.event.dp_rank,
            },
        }
    }
}

/// Decode a NATS message body from any Dynamo version: msgpack envelope, or JetStream JSON.
pub fn decode_message(body: &[u8]) -> Result<DecodedEvents, DecodeError> {
    if body.first() == Some(&b'{') {
        let event: RouterEvent = serde_json::from_slice(body).map_err(DecodeError::Json)?;
        return Ok(DecodedEvents {
            topic: String::new(),
            events: vec![event],
            skipped: 0,
            stamp: None,
        });
    }
    let envelope = read_envelope(body).map_err(DecodeError::Envelope)?;
    let mut out = decode_payload(&envelope.payload)?;
    out.stamp = Some(envelope.stamp());
    out.topic = envelope.topic;
    Ok(out)
}

/// Decode an envelope: straight from its bytes in the common case, else with serde.
pub fn read_envelope(bytes: &[u8]) -> Result<Envelope, rmp_serde::decode::Error> {
    match direct::envelope(bytes) {
        Some(envelope) => Ok(envelope),
        None => rmp_serde::from_slice(bytes),
    }
}

/// Decode an envelope's payload: one event (1.2.x) or an array of events (1.6.x).
pub fn decode_payload(payload: &[u8]) -> Result<DecodedEvents, DecodeError> {
    let is_array = matches!(payload.first(), Some(0x90..=0x9f | 0xdc | 0xdd));
    if is_array {
        // Every element known: read straight from the bytes in the common case (named maps),
        // else with serde. Only a batch with an element of a kind we do not know pays for the
        // untagged decode, which buffers each element first.
        let known = direct::events(payload)
            .or_else(|| rmp_serde::from_slice::<Vec<RouterEvent>>(payload).ok());
        if let Some(events) = known {
            return Ok(DecodedEvents {
                topic: String::new(),
                events,
                skipped: 0,
                stamp: None,
            });
        }
        let items: Vec<MaybeEvent> =
            rmp_serde::from_slice(payload).map_err(DecodeError::Payload)?;
        let mut out = DecodedEvents::default();
        for item in items {
            match item {
                MaybeEvent::Known(e) => out.events.push(e),
                MaybeEvent::Numbered(e) => {
                    out.events.push(e.placeholder());
                    out.skipped += 1;
                }
                MaybeEvent::Unknown(_) => out.skipped += 1,
            }
        }
        Ok(out)
    } else {
        let event: RouterEvent = rmp_serde::from_slice(payload).map_err(DecodeError::Payload)?;
        Ok(DecodedEvents {
            topic: String::new(),
            events: vec![event],
            skipped: 0,
            stamp: None,
        })
    }
}

/// The fields kvroute reads at each level of a KV-event message, by the name
/// [`unknown_fields`] gives the level.
const KNOWN_FIELDS: &[(&str, &[&str])] = &[
    (
        "envelope",
        &[
            "publisher_id",
            "sequence",
            "published_at",
            "topic",
            "payload",
        ],
    ),
    (
        "RouterEvent",
        &["worker_id", "storage_tier", "residency_domain", "event"],
    ),
    ("KvCacheEvent", &["event_id", "data", "dp_rank"]),
    ("stored", &["parent_hash", "start_position", "blocks"]),
    (
        "stored.blocks",
        &["block_hash", "tokens_hash", "mm_extra_info"],
    ),
    ("removed", &["block_hashes"]),
];

/// Nesting deeper than a KV-event message has is not walked (rmpv counts about two per level;
/// a stored block is seven levels down).
const FIELDS_MAX_DEPTH: usize = 32;

/// The fields of a KV-event envelope (msgpack, as on NATS or in a ZMQ data frame) that kvroute
/// does not read, as `level.name` (e.g. `RouterEvent.session_id`), each once. Decoding ignores
/// them; this says they exist, so that a newer engine's fields are seen, not silently dropped.
/// A body that does not walk (JSON, garbage) has none: decoding reports it.
pub fn unknown_fields(envelope: &[u8]) -> Vec<String> {
    use rmpv::ValueRef;
    fn map<'a>(v: &'a ValueRef<'a>) -> &'a [(ValueRef<'a>, ValueRef<'a>)] {
        match v {
            ValueRef::Map(fields) => fields,
            _ => &[],
        }
    }
    fn get<'a>(v: &'a ValueRef<'a>, name: &str) -> Option<&'a ValueRef<'a>> {
        map(v)
            .iter()
            .find(|(k, _)| matches!(k, ValueRef::String(s) if s.as_str() == Some(name)))
            .map(|(_, v)| v)
    }
    fn check(level: &str, v: &ValueRef<'_>, out: &mut Vec<String>) {
        let known = KNOWN_FIELDS
            .iter()
            .find(|(l, _)| *l == level)
            .map_or(&[][..], |(_, f)| *f);
        for (k, _) in map(v) {
            let name = match k {
                ValueRef::String(s) => s.as_str().unwrap_or("?"),
                _ => "?",
            };
            if known.contains(&name) {
                continue;
            }
            let full = format!("{level}.{name}");
            if !out.contains(&full) {
                out.push(full);
            }
        }
    }
    let mut out = Vec::new();
    fn read(mut bytes: &[u8]) -> Option<ValueRef<'_>> {
        rmpv::decode::read_value_ref_with_max_depth(&mut bytes, FIELDS_MAX_DEPTH).ok()
    }
    let Some(env) = read(envelope) else {
        return out;
    };
    check("envelope", &env, &mut out);
    let Some(ValueRef::Binary(payload)) = get(&env, "payload") else {
        return out;
    };
    let Some(payload) = read(payload) else {
        return out;
    };
    let events = match &payload {
        ValueRef::Array(items) => items.as_slice(),
        single => std::slice::from_ref(single),
    };
    for e in events {
        check("RouterEvent", e, &mut out);
        let Some(event) = get(e, "event") else {
            continue;
        };
        check("KvCacheEvent", event, &mut out);
        let Some(data) = get(event, "data") else {
            continue;
        };
        if let Some(stored) = get(data, "stored") {
            check("stored", stored, &mut out);
            if let Some(ValueRef::Array(blocks)) = get(stored, "blocks") {
                for b in blocks {
                    check("stored.blocks", b, &mut out);
                }
            }
        }
        if let Some(removed) = get(data, "removed") {
            check("removed", removed, &mut out);
        }
    }
    out
}

/// Decode a worker's `kv_metrics` message (msgpack envelope around one [`KvMetrics`] map).
pub fn decode_kv_metrics(body: &[u8]) -> Result<KvMetrics, DecodeError> {
    decode_kv_metrics_stamped(body).map(|(m, _)| m)
}

/// [`decode_kv_metrics`], with the envelope's [`Stamp`].
pub fn decode_kv_metrics_stamped(body: &[u8]) -> Result<(KvMetrics, Stamp), DecodeError> {
    let envelope = read_envelope(body).map_err(DecodeError::Envelope)?;
    if envelope.topic != KV_METRICS_TOPIC {
        return Err(DecodeError::Topic(envelope.topic));
    }
    let metrics = rmp_serde::from_slice(&envelope.payload).map_err(DecodeError::Payload)?;
    Ok((metrics, envelope.stamp()))
}

/// Encode events the way Dynamo 1.6 publishes them: envelope around an array.
pub fn encode_v16(envelope: EnvelopeHeader<'_>, events: &[RouterEvent]) -> Vec<u8> {
    encode_envelope(envelope, &encode_events(events))
}

/// The envelope Dynamo 1.6 wraps events in, before it is encoded (its ZMQ plane frames it,
/// [`crate::dynamo_zmq::encode_frames`]).
pub fn envelope_v16(h: EnvelopeHeader<'_>, events: &[RouterEvent]) -> Envelope {
    Envelope {
        publisher_id: h.publisher_id,
        sequence: h.sequence,
        published_at: h.published_at,
        topic: h.topic.to_owned(),
        payload: encode_events(events),
    }
}

/// Encode one event the way Dynamo 1.2 publishes it: envelope around a single event.
pub fn encode_v12(envelope: EnvelopeHeader<'_>, event: &RouterEvent) -> Vec<u8> {
    let mut payload = Writer(Vec::with_capacity(size_hint(event)));
    write_event(&mut payload, event);
    encode_envelope(envelope, &payload.0)
}

/// A 1.6 payload: the events as an array, written as Dynamo writes them
/// (`rmp_serde::to_vec_named`: named maps, every number in its shortest form; the captures in
/// `testdata/samples/dynamo` pin it byte for byte).
pub fn encode_events(events: &[RouterEvent]) -> Vec<u8> {
    let room = events.iter().map(size_hint).sum::<usize>();
    let mut out = Writer(Vec::with_capacity(5 + room));
    out.array(events.len());
    for event in events {
        write_event(&mut out, event);
    }
    out.0
}

/// About the bytes an event takes: ~100 around its data, ~60 a stored block, ≤ 9 a hash.
fn size_hint(event: &RouterEvent) -> usize {
    100 + match &event.event.data {
        KvCacheEventData::Stored(s) => 60 * s.blocks.len(),
        KvCacheEventData::Removed(r) => 9 * r.block_hashes.len(),
        KvCacheEventData::Cleared => 0,
    }
}

/// One [`RouterEvent`], its fields in their declaration order (serde's).
fn write_event(out: &mut Writer, e: &RouterEvent) {
    out.map(3 + usize::from(e.residency_domain.is_some()));
    out.text("worker_id");
    out.uint(e.worker_id);
    out.text("storage_tier");
    out.text(&e.storage_tier);
    if let Some(domain) = &e.residency_domain {
        out.text("residency_domain");
        out.text(domain);
    }
    out.text("event");
    out.map(3);
    out.text("event_id");
    out.uint(e.event.event_id);
    out.text("data");
    match &e.event.data {
        KvCacheEventData::Stored(s) => {
            out.map(1);
            out.text("stored");
            out.map(3);
            out.text("parent_hash");
            out.opt_uint(s.parent_hash);
            out.text("start_position");
            out.opt_uint(s.start_position);
            out.text("blocks");
            out.array(s.blocks.len());
            for b in &s.blocks {
                out.map(3);
                out.text("block_hash");
                out.uint(b.block_hash);
                out.text("tokens_hash");
                out.uint(b.tokens_hash);
                out.text("mm_extra_info");
                out.nil();
            }
        }
        KvCacheEventData::Removed(r) => {
            out.map(1);
            out.text("removed");
            out.map(1);
            out.text("block_hashes");
            out.array(r.block_hashes.len());
            for &h in &r.block_hashes {
                out.uint(h);
            }
        }
        // A unit variant: its name alone.
        KvCacheEventData::Cleared => out.text("cleared"),
    }
    out.text("dp_rank");
    out.uint(u64::from(e.event.dp_rank));
}

/// The envelope fields other than the payload.
#[derive(Debug, Clone, Copy)]
pub struct EnvelopeHeader<'a> {
    /// Random id of the publishing process.
    pub publisher_id: u64,
    /// Per-publisher message counter.
    pub sequence: u64,
    /// Publication time, ms since the Unix epoch.
    pub published_at: u64,
    /// Envelope topic.
    pub topic: &'a str,
}

/// An envelope around `payload`, as Dynamo writes it.
fn encode_envelope(h: EnvelopeHeader<'_>, payload: &[u8]) -> Vec<u8> {
    let mut out = Writer(Vec::with_capacity(80 + h.topic.len() + payload.len()));
    write_envelope(&mut out, h, payload);
    out.0
}

/// [`encode_envelope`], appended to `out`.
pub(crate) fn write_envelope(out: &mut Writer, h: EnvelopeHeader<'_>, payload: &[u8]) {
    out.map(5);
    out.text("publisher_id");
    out.uint(h.publisher_id);
    out.text("sequence");
    out.uint(h.sequence);
    out.text("published_at");
    out.uint(h.published_at);
    out.text("topic");
    out.text(h.topic);
    out.text("payload");
    out.bin(payload);
}

/// What a KV-events subject says about its publisher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubjectInfo {
    /// Dynamo namespace.
    pub namespace: String,
    /// Component (`backend`, `prefill`, …).
    pub component: String,
    /// Endpoint (1.6.x subjects only).
    pub endpoint: Option<String>,
}

/// Parse a KV-events subject of either version; segments are percent-decoded.
pub fn parse_subject(subject: &str) -> Option<SubjectInfo> {
    let parts: Vec<&str> = subject.split('.').collect();
    match parts.as_slice() {
        ["namespace", ns, "component", comp, "kv-events"] => Some(SubjectInfo {
            namespace: percent_decode(ns),
            component: percent_decode(comp),
            endpoint: None,
        }),
        ["namespace", ns, "component", comp, "endpoint", ep, "kv-events"] => Some(SubjectInfo {
            namespace: percent_decode(ns),
            component: percent_decode(comp),
            endpoint: Some(percent_decode(ep)),
        }),
        _ => None,
    }
}

/// The Dynamo component any subject of the form `namespace.N.component.C.…` belongs to, as
/// `N/C` (percent-decoded).
pub fn subject_component(subject: &str) -> Option<String> {
    let mut parts = subject.split('.');
    match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some("namespace"), Some(ns), Some("component"), Some(comp)) => {
            Some(format!("{}/{}", percent_decode(ns), percent_decode(comp)))
        }
        _ => None,
    }
}

/// The 1.2.x subject a worker publishes KV events on (no endpoint segment).
pub fn subject_v12(namespace: &str, component: &str) -> String {
    format!(
        "namespace.{}.component.{}.kv-events",
        percent_encode(namespace),
        percent_encode(component)
    )
}

/// The 1.6.x subject a worker publishes KV events on.
pub fn subject_v16(namespace: &str, component: &str, endpoint: &str) -> String {
    format!(
        "namespace.{}.component.{}.endpoint.{}.kv-events",
        percent_encode(namespace),
        percent_encode(component),
        percent_encode(endpoint)
    )
}

fn percent_encode(segment: &str) -> String {
    let mut out = String::with_capacity(segment.len());
    for b in segment.bytes() {
        match b {
            b'.' | b'%' | b'*' | b'>' | b' ' => out.push_str(&format!("%{b:02X}")),
            _ => out.push(b as char),
        }
    }
    out
}

fn percent_decode(segment: &str) -> String {
    let bytes = segment.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(v)) => {
                out.push(v);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn components_of_any_dynamo_subject() {
        assert_eq!(
            subject_component("namespace.dynamo.component.prefill.endpoint.generate.kv-events")
                .as_deref(),
            Some("dynamo/prefill")
        );
        assert_eq!(
            subject_component("namespace.dynamo.component.backend.forward-pass-metrics").as_deref(),
            Some("dynamo/backend")
        );
        assert_eq!(subject_component("_INBOX.abc"), None);
    }
    use std::path::PathBuf;

    fn dynamo(name: &str) -> PathBuf {
        crate::samples_dir().join("dynamo").join(name)
    }

    fn read(name: &str) -> Vec<u8> {
        std::fs::read(dynamo(name)).expect("testdata/samples is in the workspace")
    }

    #[test]
    fn decodes_every_captured_kv_event_message() {
        let mut decoded = 0;
        for entry in std::fs::read_dir(dynamo("")).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if !(name.starts_with("kv-events") && name.ends_with(".msgpack")) {
                continue;
            }
            let body = std::fs::read(&path).unwrap();
            let out = decode_message(&body).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(out.topic, KV_EVENTS_TOPIC, "{name}");
            assert_eq!(out.skipped, 0, "{name}");
            assert!(!out.events.is_empty(), "{name}");
            decoded += 1;
        }
        assert_eq!(decoded, 5);
    }

    #[test]
    fn stored_prompt_matches_golden_hashes() {
        let out = decode_message(&read("kv-events_stored_prompt_4blocks.msgpack")).unwrap();
        let [event] = out.events.as_slice() else {
            panic!("one event expected")
        };
        assert_eq!(event.worker_id, 13140558925506144034);
        assert_eq!(event.event.event_id, 1);
        let KvCacheEventData::Stored(stored) = &event.event.data else {
            panic!("stored expected")
        };
        assert_eq!(stored.parent_hash, None);
        let tokens = crate::golden_dynamo_prompt();
        let locals = crate::hash::local_block_hashes(&tokens, 16, crate::HashSeed::default());
        let prefixes = crate::hash::prefix_hashes(&locals);
        for (i, b) in stored.blocks.iter().enumerate() {
            assert_eq!(b.tokens_hash, locals[i].0);
            assert_eq!(b.block_hash, prefixes[i].0);
        }
    }

    #[test]
    fn encoding_is_byte_exact_with_dynamo_1_6() {
        for name in [
            "kv-events_stored_prompt_4blocks.msgpack",
            "kv-events_removed_plus_stored_batch.msgpack",
            "kv-events_stored_decode_block_with_parent.msgpack",
        ] {
            let body = read(name);
            let env: Envelope = rmp_serde::from_slice(&body).unwrap();
            let out = decode_payload(&env.payload).unwrap();
            let header = EnvelopeHeader {
                publisher_id: env.publisher_id,
                sequence: env.sequence,
                published_at: env.published_at,
                topic: &env.topic,
            };
            assert_eq!(encode_v16(header, &out.events), body, "{name}");
        }
    }

    /// One event of each kind and shape kvroute knows: cleared, a removal, a stored run with
    /// and without a parent, position and residency domain, another rank and tier.
    fn shapes() -> Vec<RouterEvent> {
        let event = |event_id, data, tier: &str, domain: Option<&str>| RouterEvent {
            worker_id: u64::MAX - event_id,
            storage_tier: tier.to_owned().into(),
            residency_domain: domain.map(|d| d.to_owned().into()),
            event: KvCacheEvent {
                event_id,
                data,
                dp_rank: event_id as u32 % 3,
            },
        };
        let stored = |parent_hash, start_position| {
            KvCacheEventData::Stored(StoredBlocks {
                parent_hash,
                start_position,
                blocks: (0..3)
                    .map(|b| StoredBlock {
                        block_hash: b << 60,
                        tokens_hash: b,
                        mm_extra_info: None,
                    })
                    .collect(),
            })
        };
        vec![
            event(1, KvCacheEventData::Cleared, "device", None),
            event(
                2,
                KvCacheEventData::Removed(RemovedBlocks {
                    block_hashes: vec![0, 1 << 63, 300],
                }),
                "device",
                Some("worker"),
            ),
            event(3, stored(None, None), "device", Some("worker")),
            event(4, stored(Some(9), Some(32)), "host_pinned", Some("node")),
        ]
    }

    /// Every captured envelope, and [`shapes`] in both versions' envelopes.
    fn known_envelopes() -> Vec<Vec<u8>> {
        let mut bodies: Vec<Vec<u8>> = std::fs::read_dir(dynamo(""))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| {
                let name = p.file_name().unwrap().to_string_lossy();
                name.starts_with("kv") && name.ends_with(".msgpack")
            })
            .map(|p| std::fs::read(p).unwrap())
            .collect();
        bodies.sort();
        let events = shapes();
        let header = EnvelopeHeader {
            publisher_id: 1 << 50,
            sequence: 70_000,
            published_at: 1_796_026_194_128,
            topic: KV_EVENTS_TOPIC,
        };
        bodies.push(encode_v16(header, &events));
        bodies.push(encode_v12(header, &events[3]));
        bodies
    }

    /// The encoder writes what serde writes, for every shape, in both versions' envelopes.
    #[test]
    fn the_encoder_writes_what_serde_writes() {
        let events = shapes();
        let header = EnvelopeHeader {
            publisher_id: 3,
            sequence: 1 << 40,
            published_at: 255,
            topic: KV_EVENTS_TOPIC,
        };
        let serde = |payload: Vec<u8>| {
            rmp_serde::to_vec_named(&Envelope {
                publisher_id: 3,
                sequence: 1 << 40,
                published_at: 255,
                topic: KV_EVENTS_TOPIC.into(),
                payload,
            })
            .unwrap()
        };
        for n in 0..=events.len() {
            let payload = rmp_serde::to_vec_named(&events[..n]).unwrap();
            assert_eq!(encode_events(&events[..n]), payload, "{n} events");
            assert_eq!(encode_v16(header, &events[..n]), serde(payload));
        }
        for event in &events {
            let payload = rmp_serde::to_vec_named(event).unwrap();
            assert_eq!(encode_v12(header, event), serde(payload), "{event:?}");
        }
    }

    /// The direct decoder takes every captured message and every shape kvroute writes, and
    /// reads each exactly as serde does.
    #[test]
    fn the_direct_decoder_reads_what_serde_reads() {
        let (mut envelopes, mut arrays) = (0, 0);
        for body in known_envelopes() {
            let envelope = direct::envelope(&body).expect("an envelope decodes directly");
            assert_eq!(envelope, rmp_serde::from_slice::<Envelope>(&body).unwrap());
            envelopes += 1;
            let array = matches!(envelope.payload.first(), Some(0x90..=0x9f | 0xdc | 0xdd));
            if envelope.topic == KV_EVENTS_TOPIC && array {
                let events = direct::events(&envelope.payload)
                    .unwrap_or_else(|| panic!("not read directly: {:x?}", envelope.payload));
                let serde: Vec<RouterEvent> = rmp_serde::from_slice(&envelope.payload).unwrap();
                assert_eq!(events, serde);
                arrays += 1;
            }
        }
        assert!(envelopes >= 8 && arrays >= 6, "{envelopes} {arrays}");
    }

    /// On damaged messages (each byte replaced in turn by a few values, cut at every length)
    /// the direct decoder either steps aside or agrees with serde.
    #[test]
    fn the_direct_decoder_agrees_or_steps_aside_on_damaged_input() {
        let (mut direct_reads, mut checked) = (0, 0);
        for body in known_envelopes() {
            let payload = rmp_serde::from_slice::<Envelope>(&body).unwrap().payload;
            for bytes in [
                &body[..body.len().min(400)],
                &payload[..payload.len().min(400)],
            ] {
                for d in crate::msgpack::damaged(bytes) {
                    checked += 1;
                    if let Some(envelope) = direct::envelope(&d) {
                        direct_reads += 1;
                        assert_eq!(envelope, rmp_serde::from_slice(&d).unwrap(), "{d:?}");
                    }
                    if let Some(events) = direct::events(&d) {
                        direct_reads += 1;
                        let serde: Vec<RouterEvent> = rmp_serde::from_slice(&d).unwrap();
                        assert_eq!(events, serde, "{d:?}");
                    }
                }
            }
        }
        assert!(
            direct_reads > 100 && checked > 10_000,
            "{direct_reads} of {checked}"
        );
    }

    /// A length that lies (4 billion events or blocks in a few bytes) allocates nothing it
    /// cannot fill: serde's turn, and its error.
    #[test]
    fn a_lying_length_is_an_error_not_an_allocation() {
        let events = [0xdd, 0xff, 0xff, 0xff, 0xff, 0x80];
        assert!(direct::events(&events).is_none());
        assert!(decode_payload(&events).is_err());
    }

    #[test]
    fn decodes_dynamo_1_2_single_event_and_jetstream_json() {
        let json = read("v1.2.1/jetstream_kv-events_removed.json");
        let out = decode_message(&json).unwrap();
        assert!(
            matches!(out.events[0].event.data, KvCacheEventData::Removed(ref r) if r.block_hashes.len() == 6)
        );
        let event = out.events[0].clone();
        let header = EnvelopeHeader {
            publisher_id: 1,
            sequence: 2,
            published_at: 3,
            topic: KV_EVENTS_TOPIC,
        };
        let again = decode_message(&encode_v12(header, &event)).unwrap();
        assert_eq!(again.events, vec![event]);
    }

    #[test]
    fn cleared_and_unknown_variants() {
        let cleared = RouterEvent {
            worker_id: 7,
            storage_tier: "device".into(),
            residency_domain: None,
            event: KvCacheEvent {
                event_id: 9,
                data: KvCacheEventData::Cleared,
                dp_rank: 1,
            },
        };
        let header = EnvelopeHeader {
            publisher_id: 1,
            sequence: 0,
            published_at: 0,
            topic: KV_EVENTS_TOPIC,
        };
        let mut items = rmp_serde::to_vec_named(&vec![cleared.clone()]).unwrap();
        // Append an element of a kind we do not know by rewriting the array header to 2.
        assert_eq!(items[0], 0x91);
        items[0] = 0x92;
        items.extend(rmp_serde::to_vec_named(&serde_json::json!({"worker_id": 1, "event": {"event_id": 1, "data": {"moved": {}}}})).unwrap());
        items[0] = 0x93;
        items.extend(rmp_serde::to_vec_named(&serde_json::json!({"what": 1})).unwrap());
        let out = decode_payload(&items).unwrap();
        assert_eq!(out.events.len(), 2, "{:?}", out.events);
        assert_eq!(out.events[0], cleared);
        assert_eq!(
            (out.events[1].worker_id, out.events[1].event.event_id),
            (1, 1)
        );
        assert_eq!(
            out.skipped, 2,
            "the unknown kind and the element that is no event"
        );
        assert!(decode_message(&encode_v16(header, &[cleared])).is_ok());
    }

    /// A newer Dynamo's fields, at every level, cost nothing of the batch and are named; an
    /// event kind not known is skipped, the rest applied. (Dynamo writes named maps:
    /// `rmp_serde::to_vec_named`.)
    #[test]
    fn newer_fields_are_named_and_cost_nothing() {
        use rmpv::Value;
        let s = |x: &str| Value::from(x);
        let block = Value::Map(vec![
            (s("block_hash"), Value::from(7u64)),
            (s("tokens_hash"), Value::from(8u64)),
            (s("lora_id"), Value::from(1u64)),
        ]);
        let stored = Value::Map(vec![(
            s("stored"),
            Value::Map(vec![
                (s("parent_hash"), Value::Nil),
                (s("blocks"), Value::Array(vec![block])),
                (s("num_tokens"), Value::from(16u64)),
            ]),
        )]);
        let event = |data: Value, id: u64| {
            Value::Map(vec![
                (s("worker_id"), Value::from(42u64)),
                (s("session_id"), s("abc")),
                (
                    s("event"),
                    Value::Map(vec![
                        (s("event_id"), Value::from(id)),
                        (s("data"), data),
                        (s("dp_rank"), Value::from(0u64)),
                        (s("medium"), s("GPU")),
                    ]),
                ),
            ])
        };
        let inactive = Value::Map(vec![(s("inactive"), Value::Map(vec![]))]);
        let removed = Value::Map(vec![(
            s("removed"),
            Value::Map(vec![(
                s("block_hashes"),
                Value::Array(vec![Value::from(7u64)]),
            )]),
        )]);
        let payload = Value::Array(vec![
            event(stored, 0),
            event(inactive, 1),
            event(removed, 2),
        ]);
        let mut payload_bytes = Vec::new();
        rmpv::encode::write_value(&mut payload_bytes, &payload).unwrap();
        let envelope = Value::Map(vec![
            (s("publisher_id"), Value::from(1u64)),
            (s("sequence"), Value::from(0u64)),
            (s("published_at"), Value::from(0u64)),
            (s("topic"), s(KV_EVENTS_TOPIC)),
            (s("payload"), Value::Binary(payload_bytes)),
            (s("trace_id"), s("t")),
        ]);
        let mut body = Vec::new();
        rmpv::encode::write_value(&mut body, &envelope).unwrap();
        let decoded = decode_message(&body).unwrap();
        assert_eq!(decoded.skipped, 1, "the unknown kind skipped");
        let ids: Vec<u64> = decoded.events.iter().map(|e| e.event.event_id).collect();
        assert_eq!(ids, [0, 1, 2], "every number kept: no gap");
        assert_eq!(
            decoded.events[1].event.data,
            KvCacheEventData::Removed(RemovedBlocks {
                block_hashes: vec![]
            }),
            "the unknown kind changes nothing kvroute knows"
        );
        assert!(matches!(
            &decoded.events[0].event.data,
            KvCacheEventData::Stored(b) if b.blocks[0].block_hash == 7
        ));
        assert_eq!(
            unknown_fields(&body),
            vec![
                "envelope.trace_id",
                "RouterEvent.session_id",
                "KvCacheEvent.medium",
                "stored.num_tokens",
                "stored.blocks.lora_id",
            ]
        );
        // Dynamo 1.6.1's own messages have none.
        let dir = dynamo("");
        let mut captures = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let name = entry.unwrap().file_name().into_string().unwrap();
            if name.starts_with("kv-events") && name.ends_with(".msgpack") {
                assert_eq!(unknown_fields(&read(&name)), Vec::<String>::new(), "{name}");
                captures += 1;
            }
        }
        assert!(captures >= 5, "{captures} captures in {dir:?}");
        assert!(unknown_fields(b"{\"x\":1}").is_empty());
        assert!(unknown_fields(&[0xc1]).is_empty());
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for body in [
            &b""[..],
            b"\xc1",
            b"\x85\xa1",
            b"{not json",
            b"\x91\x01",
            b"\xdd\xff\xff\xff\xff",
        ] {
            assert!(decode_message(body).is_err() || decode_payload(body).is_err());
        }
    }

    #[test]
    fn subjects_of_both_versions() {
        let v16 = parse_subject("namespace.dynamo.component.prefill.endpoint.generate.kv-events")
            .unwrap();
        assert_eq!(v16.component, "prefill");
        assert_eq!(v16.endpoint.as_deref(), Some("generate"));
        let v12 = parse_subject("namespace.dynamo.component.backend.kv-events").unwrap();
        assert_eq!(v12.component, "backend");
        assert_eq!(v12.endpoint, None);
        assert!(
            parse_subject("namespace.dynamo.component.backend.endpoint.generate.kv_metrics")
                .is_none()
        );
        let s = subject_v16("my.ns", "backend", "generate");
        assert_eq!(
            s,
            "namespace.my%2Ens.component.backend.endpoint.generate.kv-events"
        );
        assert_eq!(parse_subject(&s).unwrap().namespace, "my.ns");
    }

    #[test]
    fn kv_metrics_decode() {
        let m = decode_kv_metrics(&read("kv_metrics.msgpack")).unwrap();
        assert_eq!(m.worker_id, 13140558925506144034);
        assert_eq!(m.kv_used_blocks, Some(5));
        assert_eq!(m.active_prefill_tokens, None);
        let events = read("kv-events_stored_prompt_4blocks.msgpack");
        assert!(matches!(
            decode_kv_metrics(&events),
            Err(DecodeError::Topic(t)) if t == "kv-events"
        ));
        assert!(decode_kv_metrics(b"\x93garbage").is_err());
    }
}
