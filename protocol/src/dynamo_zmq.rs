//! NVIDIA Dynamo's ZMQ event plane (the default since Dynamo 1.4: no `--event-plane` flag).
//!
//! Each publisher (one per worker and topic) binds a ZMQ PUB socket and sends multipart
//! messages of four frames:
//!
//! 1. the topic (`kv-events`, `kv_metrics`, …), for the subscriber's prefix filter;
//! 2. the publisher id, u64 big-endian (random per publisher; the event channel's
//!    `instance_id` in discovery, not the worker's instance id);
//! 3. the sequence number, u64 big-endian, from 0 per publisher;
//! 4. a 5-byte header (version u8 = 1, payload length u32 big-endian) followed by that many
//!    bytes: the msgpack [`Envelope`] the NATS plane carries (`{publisher_id, sequence,
//!    published_at, topic, payload}`), whose `payload` is an array of RouterEvents
//!    (`kv-events`) or one [`KvMetrics`] map (`kv_metrics`).
//!
//! Checked against Dynamo's `lib/runtime/src/transports/event_plane/zmq_transport.rs` and the
//! captures in `testdata/samples/dynamo/zmq-default-plane/`. Like Dynamo's own reader, bytes
//! after the declared payload length are ignored. Nothing here panics on any input: every way a
//! message can be wrong is a named [`ZmqError`].

use crate::dynamo::{
    decode_payload, read_envelope, write_envelope, DecodedEvents, Envelope, EnvelopeHeader,
    KvMetrics,
};
use crate::msgpack::Writer;

/// The only frame-header version Dynamo writes (and accepts).
pub const FRAME_VERSION: u8 = 1;
/// Bytes of the header before the envelope: version and payload length.
pub const FRAME_HEADER_BYTES: usize = 5;

/// One message of the ZMQ event plane, decoded down to its envelope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZmqMessage {
    /// The topic frame.
    pub topic: String,
    /// The publisher id frame (equal to the envelope's).
    pub publisher_id: u64,
    /// The sequence frame (equal to the envelope's).
    pub sequence: u64,
    /// The envelope, its `payload` still msgpack.
    pub envelope: Envelope,
}

/// Why a multipart message is not one of Dynamo's ZMQ event plane.
#[derive(Debug, thiserror::Error)]
pub enum ZmqError {
    /// Not four frames.
    #[error("{0} frames, expected 4 (topic, publisher id, sequence, data)")]
    FrameCount(usize),
    /// The topic frame is not UTF-8.
    #[error("topic frame is not UTF-8")]
    Topic,
    /// The publisher id or sequence frame is not 8 bytes.
    #[error("{what} frame has {len} bytes, expected 8")]
    IdFrame {
        /// `publisher id` or `sequence`.
        what: &'static str,
        /// Its length.
        len: usize,
    },
    /// The data frame is shorter than its 5-byte header.
    #[error("data frame has {0} bytes, shorter than its 5-byte header")]
    ShortHeader(usize),
    /// A header version this decoder does not know.
    #[error("frame header version {0}, expected {FRAME_VERSION}")]
    Version(u8),
    /// The header declares more payload than the frame holds.
    #[error("frame header declares {declared} payload bytes, {available} present")]
    ShortPayload {
        /// Declared length.
        declared: usize,
        /// Bytes after the header.
        available: usize,
    },
    /// The payload is not a msgpack envelope.
    #[error("bad envelope: {0}")]
    Envelope(rmp_serde::decode::Error),
    /// The envelope names another publisher or sequence than the frames.
    #[error("envelope says publisher {envelope_publisher:x} seq {envelope_sequence}, frames say {frame_publisher:x} seq {frame_sequence}")]
    Mismatch {
        /// From frame 2.
        frame_publisher: u64,
        /// From frame 3.
        frame_sequence: u64,
        /// From the envelope.
        envelope_publisher: u64,
        /// From the envelope.
        envelope_sequence: u64,
    },
    /// The envelope's payload did not decode as its topic's body.
    #[error("bad {topic} payload: {error}")]
    Payload {
        /// The envelope's topic.
        topic: String,
        /// What failed.
        error: String,
    },
}

fn id_frame(what: &'static str, frame: &[u8]) -> Result<u64, ZmqError> {
    let bytes: [u8; 8] = frame.try_into().map_err(|_| ZmqError::IdFrame {
        what,
        len: frame.len(),
    })?;
    Ok(u64::from_be_bytes(bytes))
}

/// Decode the four frames of one message down to its envelope.
pub fn decode_frames<F: AsRef<[u8]>>(frames: &[F]) -> Result<ZmqMessage, ZmqError> {
    let [topic, publisher, sequence, data] = frames else {
        return Err(ZmqError::FrameCount(frames.len()));
    };
    let topic = std::str::from_utf8(topic.as_ref())
        .map_err(|_| ZmqError::Topic)?
        .to_owned();
    let publisher_id = id_frame("publisher id", publisher.as_ref())?;
    let sequence = id_frame("sequence", sequence.as_ref())?;
    let envelope_bytes = frame_payload(data.as_ref())?;
    let envelope = read_envelope(envelope_bytes).map_err(ZmqError::Envelope)?;
    if envelope.publisher_id != publisher_id || envelope.sequence != sequence {
        return Err(ZmqError::Mismatch {
            frame_publisher: publisher_id,
            frame_sequence: sequence,
            envelope_publisher: envelope.publisher_id,
            envelope_sequence: envelope.sequence,
        });
    }
    Ok(ZmqMessage {
        topic,
        publisher_id,
        sequence,
        envelope,
    })
}

/// The envelope bytes of a data frame (after checking its 5-byte header).
pub fn frame_payload(data: &[u8]) -> Result<&[u8], ZmqError> {
    let Some((header, rest)) = data.split_first_chunk::<FRAME_HEADER_BYTES>() else {
        return Err(ZmqError::ShortHeader(data.len()));
    };
    let [version, l0, l1, l2, l3] = *header;
    if version != FRAME_VERSION {
        return Err(ZmqError::Version(version));
    }
    let declared = u32::from_be_bytes([l0, l1, l2, l3]) as usize;
    rest.get(..declared).ok_or(ZmqError::ShortPayload {
        declared,
        available: rest.len(),
    })
}

impl ZmqMessage {
    /// The KV events of a `kv-events` message (array elements we do not know are counted in
    /// `skipped`, not fatal).
    pub fn kv_events(&self) -> Result<DecodedEvents, ZmqError> {
        let mut out = decode_payload(&self.envelope.payload).map_err(|e| self.payload_error(e))?;
        out.topic = self.envelope.topic.clone();
        Ok(out)
    }

    /// The load report of a `kv_metrics` message.
    pub fn kv_metrics(&self) -> Result<KvMetrics, ZmqError> {
        rmp_serde::from_slice(&self.envelope.payload).map_err(|e| self.payload_error(e))
    }

    fn payload_error(&self, e: impl std::fmt::Display) -> ZmqError {
        ZmqError::Payload {
            topic: self.envelope.topic.clone(),
            error: e.to_string(),
        }
    }
}

/// Encode a message as a Dynamo publisher sends it: the four frames around an envelope.
pub fn encode_frames(envelope: &Envelope, topic: &str) -> Vec<Vec<u8>> {
    let header = EnvelopeHeader {
        publisher_id: envelope.publisher_id,
        sequence: envelope.sequence,
        published_at: envelope.published_at,
        topic: &envelope.topic,
    };
    let mut data = Writer(Vec::with_capacity(
        FRAME_HEADER_BYTES + 80 + envelope.topic.len() + envelope.payload.len(),
    ));
    data.0.extend_from_slice(&[FRAME_VERSION, 0, 0, 0, 0]);
    write_envelope(&mut data, header, &envelope.payload);
    let body = (data.0.len() - FRAME_HEADER_BYTES) as u32;
    data.0[1..FRAME_HEADER_BYTES].copy_from_slice(&body.to_be_bytes());
    vec![
        topic.as_bytes().to_vec(),
        envelope.publisher_id.to_be_bytes().to_vec(),
        envelope.sequence.to_be_bytes().to_vec(),
        data.0,
    ]
}

/// Split a capture file (`*.frames`: each frame as a u32 big-endian length and its bytes) into
/// its frames; `None` when the file is cut or a length runs past its end.
pub fn split_capture(mut bytes: &[u8]) -> Option<Vec<&[u8]>> {
    let mut frames = Vec::new();
    while !bytes.is_empty() {
        let (len, rest) = bytes.split_first_chunk::<4>()?;
        let len = u32::from_be_bytes(*len) as usize;
        if rest.len() < len {
            return None;
        }
        let (frame, rest) = rest.split_at(len);
        frames.push(frame);
        bytes = rest;
    }
    Some(frames)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dynamo::{KvCacheEventData, KV_EVENTS_TOPIC, KV_METRICS_TOPIC};
    use std::path::PathBuf;

    fn plane_dir() -> PathBuf {
        crate::samples_dir().join("dynamo/zmq-default-plane")
    }

    /// Every capture: (file name, its bytes).
    fn captures() -> Vec<(String, Vec<u8>)> {
        let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(plane_dir())
            .expect("testdata/samples/dynamo/zmq-default-plane is in the workspace")
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "frames"))
            .map(|p| {
                let name = p.file_name().unwrap().to_string_lossy().into_owned();
                (name, std::fs::read(&p).unwrap())
            })
            .collect();
        out.sort();
        out
    }

    /// The publisher id a capture's name gives (`<topic>_<publisher hex>_<nn>.frames`).
    fn named_publisher(name: &str) -> u64 {
        let hex = name.rsplit('_').nth(1).unwrap();
        u64::from_str_radix(hex, 16).unwrap()
    }

    #[test]
    fn decodes_every_captured_message() {
        let (mut events, mut metrics) = (0, 0);
        // Per publisher, the sequence numbers seen: consecutive from where the capture started.
        let mut sequences: std::collections::BTreeMap<u64, Vec<u64>> = Default::default();
        for (name, bytes) in captures() {
            let frames = split_capture(&bytes).unwrap_or_else(|| panic!("{name}: cut"));
            assert_eq!(frames.len(), 4, "{name}");
            let m = decode_frames(&frames).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(m.publisher_id, named_publisher(&name), "{name}");
            assert_eq!(m.envelope.topic, m.topic, "{name}");
            assert!(m.envelope.published_at > 1_700_000_000_000, "{name}");
            sequences
                .entry(m.publisher_id)
                .or_default()
                .push(m.sequence);
            match m.topic.as_str() {
                KV_EVENTS_TOPIC => {
                    let out = m.kv_events().unwrap_or_else(|e| panic!("{name}: {e}"));
                    assert_eq!(out.skipped, 0, "{name}");
                    assert!(!out.events.is_empty(), "{name}");
                    assert!(
                        m.kv_metrics().is_err(),
                        "{name}: an array is no kv_metrics map"
                    );
                    events += out.events.len();
                }
                KV_METRICS_TOPIC => {
                    let load = m.kv_metrics().unwrap_or_else(|e| panic!("{name}: {e}"));
                    assert!(load.kv_used_blocks.is_some(), "{name}");
                    metrics += 1;
                }
                other => panic!("{name}: topic {other}"),
            }
        }
        assert_eq!(metrics, 12);
        assert!(events >= 12, "{events}");
        assert_eq!(sequences.len(), 4, "two workers, two topics each");
        for (publisher, seqs) in sequences {
            assert!(
                seqs.windows(2).all(|w| w[0] < w[1]),
                "{publisher:x}: {seqs:?}"
            );
        }
    }

    /// The captured events name the workers whose `worker_kv_query_source_<publisher hex>`
    /// records name the same instance: that is how a publisher maps to its worker.
    #[test]
    fn events_name_the_worker_of_their_channel() {
        let instances: serde_json::Value = serde_json::from_slice(
            &std::fs::read(plane_dir().join("instances_records.json")).unwrap(),
        )
        .unwrap();
        let worker_of = |publisher: u64| -> u64 {
            let endpoint = format!("worker_kv_query_source_{publisher:x}");
            instances
                .as_object()
                .unwrap()
                .values()
                .find(|r| r["endpoint"] == endpoint.as_str())
                .and_then(|r| r["instance_id"].as_u64())
                .unwrap_or_else(|| panic!("no {endpoint}"))
        };
        let mut checked = 0;
        for (name, bytes) in captures() {
            if !name.starts_with("kv-events") {
                continue;
            }
            let m = decode_frames(&split_capture(&bytes).unwrap()).unwrap();
            for e in m.kv_events().unwrap().events {
                assert_eq!(e.worker_id, worker_of(m.publisher_id), "{name}");
                assert_ne!(
                    e.worker_id, m.publisher_id,
                    "the publisher is not the worker"
                );
                if let KvCacheEventData::Stored(s) = &e.event.data {
                    assert!(!s.blocks.is_empty());
                }
                checked += 1;
            }
        }
        assert!(checked > 0);
    }

    #[test]
    fn encoding_is_byte_exact_with_the_captures() {
        for (name, bytes) in captures() {
            let frames = split_capture(&bytes).unwrap();
            let m = decode_frames(&frames).unwrap();
            let again = encode_frames(&m.envelope, &m.topic);
            assert_eq!(again, frames, "{name}");
        }
    }

    #[test]
    fn every_malformation_is_a_named_error() {
        let (_, bytes) = captures().into_iter().next().unwrap();
        let frames: Vec<Vec<u8>> = split_capture(&bytes)
            .unwrap()
            .into_iter()
            .map(<[u8]>::to_vec)
            .collect();
        let with = |i: usize, f: &dyn Fn(&mut Vec<u8>)| {
            let mut v = frames.clone();
            f(&mut v[i]);
            decode_frames(&v).unwrap_err()
        };
        assert!(matches!(
            decode_frames(&frames[..3]),
            Err(ZmqError::FrameCount(3))
        ));
        assert!(matches!(with(0, &|t| *t = vec![0xff]), ZmqError::Topic));
        assert!(matches!(
            with(1, &|p| p.truncate(7)),
            ZmqError::IdFrame { len: 7, .. }
        ));
        assert!(matches!(
            with(2, &|s| s.push(0)),
            ZmqError::IdFrame {
                what: "sequence",
                len: 9
            }
        ));
        assert!(matches!(
            with(3, &|d| d.truncate(4)),
            ZmqError::ShortHeader(4)
        ));
        assert!(matches!(with(3, &|d| d[0] = 2), ZmqError::Version(2)));
        assert!(matches!(
            with(3, &|d| {
                d.pop();
            }),
            ZmqError::ShortPayload { .. }
        ));
        assert!(matches!(with(3, &|d| d[5] = 0xc1), ZmqError::Envelope(_)));
        assert!(matches!(with(2, &|s| s[7] ^= 1), ZmqError::Mismatch { .. }));
        // Bytes after the declared payload are ignored, as Dynamo's reader does.
        let mut trailing = frames.clone();
        trailing[3].extend_from_slice(b"junk");
        assert!(decode_frames(&trailing).is_ok());
        // A kv-events envelope whose payload is not events.
        let mut m = decode_frames(&frames).unwrap();
        m.envelope.payload = vec![0xc1];
        assert!(matches!(m.kv_events(), Err(ZmqError::Payload { .. })));
        assert!(matches!(m.kv_metrics(), Err(ZmqError::Payload { .. })));
    }

    #[test]
    fn capture_files_that_are_cut_are_refused() {
        assert_eq!(split_capture(b""), Some(vec![]));
        assert_eq!(split_capture(b"\0\0\0\x01a"), Some(vec![&b"a"[..]]));
        assert_eq!(split_capture(b"\0\0\0\x02a"), None);
        assert_eq!(split_capture(b"\0\0\0"), None);
        assert_eq!(split_capture(b"\xff\xff\xff\xff"), None);
    }

    /// Fuzz-style: every prefix and a sample of byte flips of every capture decode or fail,
    /// never panic.
    #[test]
    fn never_panics_on_damaged_input() {
        for (_, bytes) in captures() {
            for cut in 0..bytes.len() {
                if let Some(frames) = split_capture(&bytes[..cut]) {
                    if let Ok(m) = decode_frames(&frames) {
                        let _ = (m.kv_events(), m.kv_metrics());
                    }
                }
            }
            let frames: Vec<Vec<u8>> = split_capture(&bytes)
                .unwrap()
                .into_iter()
                .map(<[u8]>::to_vec)
                .collect();
            for i in (0..frames[3].len()).step_by(7) {
                let mut v = frames.clone();
                v[3][i] ^= 0x5a;
                if let Ok(m) = decode_frames(&v) {
                    let _ = (m.kv_events(), m.kv_metrics());
                }
            }
        }
    }
}
