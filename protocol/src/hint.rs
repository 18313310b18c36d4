//! The hint exchange between the filter and the sidecar: `POST /v1/hint`, and the reports of
//! finished requests that let the sidecar count each worker's requests in flight exactly.
//!
//! The request is binary because it carries up to thousands of hashes on every LLM request and
//! the filter runs inside Envoy's event loop: JSON would cost more to write than the hashing.
//!
//! ```text
//! hint request  (POST /v1/hint, Content-Type: application/x-kvroute-hint)
//!   "KVH1"                magic + version
//!   u16 LE                length of the model name in bytes
//!   [u8]                  model name (UTF-8)
//!   u32 LE                number of prefix hashes
//!   [u64 LE]              prefix hashes, block 0 first
//!   optional:
//!   u32 LE                number of finished tickets
//!   [u64 LE]              tickets of hinted requests that finished since the last report
//! hint response (Content-Type: application/json)
//!   {"workers": ["ip:port", …], "matched_blocks": n, "ticket": t}
//!   or, for a worker behind a Dynamo frontend (pin mode):
//!   {"workers": [], "instance_id": id, "matched_blocks": n, "ticket": t}
//!   or, for the prefill worker of a disaggregated Dynamo fleet:
//!   {"workers": [], "prefill_instance_id": id, "matched_blocks": n, "ticket": t}
//! finished report (POST /v1/finished, same content type; sent when no hint request carries them)
//!   "KVF1" u32 LE count, [u64 LE] tickets
//! ```
//! `workers` is ordered best first and may be empty (no useful match: use the fallback). A hinted
//! request holds its `ticket` until Envoy logs it (finished, failed or reset); then the filter
//! reports it, riding on its next hint request, or on its own after a short while.

use serde::{Deserialize, Serialize};

use crate::hash::PrefixHash;

/// Content type of a binary hint request.
pub const HINT_CONTENT_TYPE: &str = "application/x-kvroute-hint";
/// Path of the hint endpoint on the sidecar.
pub const HINT_PATH: &str = "/v1/hint";
/// Path of the finished-requests endpoint on the sidecar.
pub const FINISHED_PATH: &str = "/v1/finished";
const MAGIC: &[u8; 4] = b"KVH1";
const FINISHED_MAGIC: &[u8; 4] = b"KVF1";

/// The sidecar's handle on one hinted request, counted against its worker until it finishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Ticket(pub u64);

/// A request for a routing hint: the model and the request's prefix hashes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HintRequest {
    /// Model name as the client sent it.
    pub model: String,
    /// Prefix hashes of the prompt's full blocks, first block first.
    pub hashes: Vec<PrefixHash>,
    /// Tickets of earlier hinted requests that have finished since the last report.
    pub finished: Vec<Ticket>,
}

/// Why a hint request body could not be decoded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HintDecodeError {
    /// The body does not start with the `KVH1` magic.
    #[error("bad magic: not a kvroute hint request")]
    BadMagic,
    /// The body ended before the announced fields.
    #[error("truncated hint request")]
    Truncated,
    /// Bytes follow the announced hashes.
    #[error("{0} trailing bytes after the hashes")]
    Trailing(usize),
    /// The model name is not UTF-8.
    #[error("model name is not UTF-8")]
    ModelNotUtf8,
}

impl HintRequest {
    /// Encode as the binary wire format.
    pub fn encode(&self) -> Vec<u8> {
        let name = &self.model.as_bytes()[..self.model.len().min(u16::MAX as usize)];
        let count = self.hashes.len().min(u32::MAX as usize);
        let mut out =
            Vec::with_capacity(4 + 2 + name.len() + 8 + (count + self.finished.len()) * 8);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&(name.len() as u16).to_le_bytes());
        out.extend_from_slice(name);
        put_u64s(&mut out, self.hashes[..count].iter().map(|h| h.0));
        if !self.finished.is_empty() {
            put_u64s(&mut out, self.finished.iter().map(|t| t.0));
        }
        out
    }

    /// Decode the binary wire format, rejecting anything malformed.
    pub fn decode(body: &[u8]) -> Result<Self, HintDecodeError> {
        let rest = body.strip_prefix(MAGIC).ok_or(HintDecodeError::BadMagic)?;
        let (len, rest) = split(rest, 2)?;
        let name_len = u16::from_le_bytes([len[0], len[1]]) as usize;
        let (name, rest) = split(rest, name_len)?;
        let model = std::str::from_utf8(name)
            .map_err(|_| HintDecodeError::ModelNotUtf8)?
            .to_owned();
        let (hashes, rest) = take_u64s(rest)?;
        let (finished, rest) = if rest.is_empty() {
            (Vec::new(), rest)
        } else {
            take_u64s(rest)?
        };
        if !rest.is_empty() {
            return Err(HintDecodeError::Trailing(rest.len()));
        }
        Ok(HintRequest {
            model,
            hashes: hashes.into_iter().map(PrefixHash).collect(),
            finished: finished.into_iter().map(Ticket).collect(),
        })
    }
}

/// Encode a finished report (`POST /v1/finished`).
pub fn encode_finished(tickets: &[Ticket]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + tickets.len() * 8);
    out.extend_from_slice(FINISHED_MAGIC);
    put_u64s(&mut out, tickets.iter().map(|t| t.0));
    out
}

/// Decode a finished report.
pub fn decode_finished(body: &[u8]) -> Result<Vec<Ticket>, HintDecodeError> {
    let rest = body
        .strip_prefix(FINISHED_MAGIC)
        .ok_or(HintDecodeError::BadMagic)?;
    let (tickets, rest) = take_u64s(rest)?;
    if !rest.is_empty() {
        return Err(HintDecodeError::Trailing(rest.len()));
    }
    Ok(tickets.into_iter().map(Ticket).collect())
}

/// A u32 LE count, then the values as u64 LE (at most u32::MAX of them).
fn put_u64s(out: &mut Vec<u8>, values: impl ExactSizeIterator<Item = u64>) {
    let count = values.len().min(u32::MAX as usize);
    out.extend_from_slice(&(count as u32).to_le_bytes());
    for v in values.take(count) {
        out.extend_from_slice(&v.to_le_bytes());
    }
}

fn take_u64s(bytes: &[u8]) -> Result<(Vec<u64>, &[u8]), HintDecodeError> {
    let (count, rest) = split(bytes, 4)?;
    let count = u32::from_le_bytes([count[0], count[1], count[2], count[3]]) as usize;
    let need = count.checked_mul(8).ok_or(HintDecodeError::Truncated)?;
    let (raw, rest) = split(rest, need)?;
    let values = raw
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8-byte chunk")))
        .collect();
    Ok((values, rest))
}

fn split(bytes: &[u8], n: usize) -> Result<(&[u8], &[u8]), HintDecodeError> {
    if bytes.len() < n {
        Err(HintDecodeError::Truncated)
    } else {
        Ok(bytes.split_at(n))
    }
}

/// The sidecar's answer: where to send the request, best first.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HintResponse {
    /// Worker addresses (`ip:port`), best first; empty means "no useful match, use the fallback".
    #[serde(default)]
    pub workers: Vec<String>,
    /// How many leading blocks the first worker holds.
    #[serde(default)]
    pub matched_blocks: u32,
    /// Report this when the request finishes (present when a worker is named).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ticket: Option<Ticket>,
    /// Pin mode: the Dynamo instance id of the best worker, for the filter to send as
    /// `x-worker-instance-id` to a Dynamo frontend (which then serves the request there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance_id: Option<u64>,
    /// Pin mode, disaggregated: the Dynamo instance id of the prefill worker holding the prefix,
    /// for the filter to send as `x-prefill-instance-id` (the frontend picks the decode worker).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_instance_id: Option<u64>,
}

/// Where a hint sends a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HintTarget {
    /// Pin mode: this Dynamo instance (the value of `x-worker-instance-id`, decimal).
    Instance(u64),
    /// Pin mode, disaggregated: this prefill instance (`x-prefill-instance-id`, decimal).
    PrefillInstance(u64),
    /// Envoy's override_host header value: addresses, best first.
    Hosts(String),
}

impl HintResponse {
    /// Where the hint sends the request (an instance id wins over addresses); `None`: nowhere,
    /// use the fallback.
    pub fn target(&self) -> Option<HintTarget> {
        match (self.instance_id, self.prefill_instance_id) {
            (Some(id), _) => Some(HintTarget::Instance(id)),
            (None, Some(id)) => Some(HintTarget::PrefillInstance(id)),
            (None, None) => self.override_host_value().map(HintTarget::Hosts),
        }
    }

    /// Whether [`HintResponse::target`] is `Some`, without building the header value.
    pub fn has_target(&self) -> bool {
        self.instance_id.is_some() || self.prefill_instance_id.is_some() || !self.workers.is_empty()
    }

    /// The value for Envoy's override_host header: a comma-separated list, best first.
    pub fn override_host_value(&self) -> Option<String> {
        if self.workers.is_empty() {
            None
        } else {
            Some(self.workers.join(","))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> HintRequest {
        HintRequest {
            model: "tiny-llama".into(),
            hashes: vec![PrefixHash(1), PrefixHash(u64::MAX), PrefixHash(1 << 63)],
            finished: Vec::new(),
        }
    }

    #[test]
    fn round_trip() {
        let req = sample();
        let bytes = req.encode();
        assert_eq!(bytes.len(), 4 + 2 + 10 + 4 + 24);
        assert_eq!(HintRequest::decode(&bytes).unwrap(), req);
        let with_finished = HintRequest {
            finished: vec![Ticket(7), Ticket(u64::MAX)],
            ..sample()
        };
        let bytes = with_finished.encode();
        assert_eq!(bytes.len(), 4 + 2 + 10 + 4 + 24 + 4 + 16);
        assert_eq!(HintRequest::decode(&bytes).unwrap(), with_finished);
        let report = encode_finished(&[Ticket(1), Ticket(2)]);
        assert_eq!(
            decode_finished(&report).unwrap(),
            vec![Ticket(1), Ticket(2)]
        );
        assert_eq!(
            decode_finished(&report[..report.len() - 1]),
            Err(HintDecodeError::Truncated)
        );
        assert_eq!(decode_finished(b"KVH1"), Err(HintDecodeError::BadMagic));
    }

    #[test]
    fn rejects_malformed() {
        let bytes = sample().encode();
        assert_eq!(HintRequest::decode(b"nope"), Err(HintDecodeError::BadMagic));
        for cut in 0..bytes.len() {
            let err = HintRequest::decode(&bytes[..cut]).unwrap_err();
            assert!(
                matches!(err, HintDecodeError::Truncated | HintDecodeError::BadMagic),
                "{cut}: {err:?}"
            );
        }
        let mut long = bytes.clone();
        long.extend_from_slice(&[0, 0, 0, 0, 9]);
        assert_eq!(
            HintRequest::decode(&long),
            Err(HintDecodeError::Trailing(1))
        );
        long.truncate(bytes.len() + 1);
        assert_eq!(HintRequest::decode(&long), Err(HintDecodeError::Truncated));
        // A count that would overflow must not allocate or panic.
        let mut huge = b"KVH1\x00\x00".to_vec();
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(HintRequest::decode(&huge), Err(HintDecodeError::Truncated));
        let mut bad_utf8 = b"KVH1\x01\x00\xff".to_vec();
        bad_utf8.extend_from_slice(&0u32.to_le_bytes());
        assert_eq!(
            HintRequest::decode(&bad_utf8),
            Err(HintDecodeError::ModelNotUtf8)
        );
    }

    #[test]
    fn override_host_value_joins_best_first() {
        let resp = HintResponse {
            workers: vec!["127.0.0.1:1".into(), "127.0.0.1:2".into()],
            matched_blocks: 3,
            ticket: Some(Ticket(5)),
            instance_id: None,
            prefill_instance_id: None,
        };
        let json = serde_json::to_string(&resp).unwrap();
        assert!(json.contains(r#""ticket":5"#), "{json}");
        assert!(!json.contains("instance_id"), "{json}");
        // Dynamo instance ids use all 64 bits.
        let pinned: HintResponse =
            serde_json::from_str(r#"{"workers":[],"instance_id":13666402953397619855}"#).unwrap();
        assert_eq!(
            pinned.target(),
            Some(HintTarget::Instance(13666402953397619855))
        );
        let prefill: HintResponse =
            serde_json::from_str(r#"{"workers":[],"prefill_instance_id":18446744073709551615}"#)
                .unwrap();
        assert_eq!(
            prefill.target(),
            Some(HintTarget::PrefillInstance(u64::MAX))
        );
        assert_eq!(
            resp.target(),
            Some(HintTarget::Hosts("127.0.0.1:1,127.0.0.1:2".into()))
        );
        assert_eq!(HintResponse::default().target(), None);
        for r in [&resp, &pinned, &prefill, &HintResponse::default()] {
            assert_eq!(r.has_target(), r.target().is_some(), "{r:?}");
        }
        assert!(!serde_json::to_string(&HintResponse::default())
            .unwrap()
            .contains("ticket"));
        assert_eq!(
            resp.override_host_value().unwrap(),
            "127.0.0.1:1,127.0.0.1:2"
        );
        assert_eq!(HintResponse::default().override_host_value(), None);
        let parsed: HintResponse = serde_json::from_str(r#"{"workers":[],"extra":1}"#).unwrap();
        assert_eq!(parsed, HintResponse::default());
    }
}
