//! The hint exchange between the filter and the sidecar: `POST /v1/hint`, and the reports of
//! finished requests that let the sidecar count each worker's requests in flight exactly and
//! compare what it predicted a worker had cached with what the engine said it had.
//!
//! The request is binary because it carries up to thousands of hashes on every LLM request and
//! the filter runs inside Envoy's event loop: JSON would cost more to write than the hashing.
//!
//! ```text
//! hint request  (POST /v1/hint, Content-Type: application/x-kvroute-hint)
//!   "KVH2"                magic + version
//!   u16 LE                length of the model name in bytes
//!   [u8]                  model name (UTF-8)
//!   u32 LE                number of prefix hashes
//!   [u64 LE]              prefix hashes, block 0 first
//!   optional:
//!   u32 LE                number of finished requests
//!   [finished]            hinted requests that finished since the last report
//! finished (17 bytes)
//!   u64 LE ticket, u8 usage kind, u32 LE prompt tokens, u32 LE cached tokens
//!   kinds: 0 unanswered, 1 missing, 2 malformed, 3 prompt tokens only, 4 cached tokens
//! hint response (Content-Type: application/json)
//!   {"workers": ["ip:port", …], "matched_blocks": n, "ticket": t}
//!   or, for a worker behind a Dynamo frontend (pin mode):
//!   {"workers": [], "instance_id": id, "matched_blocks": n, "ticket": t}
//!   or, for the prefill worker of a disaggregated Dynamo fleet:
//!   {"workers": [], "prefill_instance_id": id, "matched_blocks": n, "ticket": t}
//! finished report (POST /v1/finished, same content type; sent when no hint request carries them)
//!   "KVF2" u32 LE count, [finished]
//! ```
//! `workers` is ordered best first and may be empty (no useful match: use the fallback). A hinted
//! request holds its `ticket` until Envoy logs it (finished, failed or reset); then the filter
//! reports it with the usage the engine's response carried, riding on its next hint request, or
//! on its own after a short while.
//!
//! The sidecar also reads version 1 (`KVH1` / `KVF1`: tickets alone, as u64 LE, usage
//! unanswered), so a sidecar can be upgraded before the filter it serves.

use serde::{Deserialize, Serialize};

use crate::hash::PrefixHash;

/// Content type of a binary hint request.
pub const HINT_CONTENT_TYPE: &str = "application/x-kvroute-hint";
/// Path of the hint endpoint on the sidecar.
pub const HINT_PATH: &str = "/v1/hint";
/// Path of the finished-requests endpoint on the sidecar.
pub const FINISHED_PATH: &str = "/v1/finished";
const MAGIC: &[u8; 4] = b"KVH2";
const FINISHED_MAGIC: &[u8; 4] = b"KVF2";
const MAGIC_V1: &[u8; 4] = b"KVH1";
const FINISHED_MAGIC_V1: &[u8; 4] = b"KVF1";
/// Bytes of one [`Finished`] on the wire.
const FINISHED_BYTES: usize = 17;

/// The sidecar's handle on one hinted request, counted against its worker until it finishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Ticket(pub u64);

/// What a finished request's response said about its prompt (OpenAI's `usage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Usage {
    /// No successful response was seen to its end (an error status, a reset, a timeout).
    Unanswered,
    /// A successful response without a usage object (a stream not asked for one).
    Missing,
    /// A usage object that could not be read.
    Malformed,
    /// A usage without `prompt_tokens_details.cached_tokens` (vLLM without
    /// `--enable-prompt-tokens-details`).
    PromptOnly {
        /// `usage.prompt_tokens`.
        prompt_tokens: u32,
    },
    /// The filter did not read the response (`read_usage` off, or a stream outside the
    /// filter's sample: `stream_usage_every`).
    Unread,
    /// The engine said how many prompt tokens it found cached.
    Cached {
        /// `usage.prompt_tokens`.
        prompt_tokens: u32,
        /// `usage.prompt_tokens_details.cached_tokens`.
        cached_tokens: u32,
    },
}

impl Usage {
    /// Every kind, for defining metric label values up front.
    pub const KINDS: [&'static str; 6] = [
        "unanswered",
        "missing",
        "malformed",
        "prompt_only",
        "cached",
        "unread",
    ];

    /// The label value of its kind.
    pub fn label(self) -> &'static str {
        Self::KINDS[self.kind() as usize]
    }

    /// Its kind as the wire writes it, an index into [`Usage::KINDS`].
    pub fn kind(self) -> u8 {
        match self {
            Usage::Unanswered => 0,
            Usage::Missing => 1,
            Usage::Malformed => 2,
            Usage::PromptOnly { .. } => 3,
            Usage::Cached { .. } => 4,
            Usage::Unread => 5,
        }
    }

    fn tokens(self) -> (u32, u32) {
        match self {
            Usage::PromptOnly { prompt_tokens } => (prompt_tokens, 0),
            Usage::Cached {
                prompt_tokens,
                cached_tokens,
            } => (prompt_tokens, cached_tokens),
            _ => (0, 0),
        }
    }

    fn from_wire(kind: u8, prompt_tokens: u32, cached_tokens: u32) -> Option<Usage> {
        Some(match kind {
            0 => Usage::Unanswered,
            1 => Usage::Missing,
            2 => Usage::Malformed,
            3 => Usage::PromptOnly { prompt_tokens },
            4 => Usage::Cached {
                prompt_tokens,
                cached_tokens,
            },
            5 => Usage::Unread,
            _ => return None,
        })
    }
}

/// A hinted request that finished, and what its response said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finished {
    /// The sidecar's ticket for it.
    pub ticket: Ticket,
    /// Its response's usage.
    pub usage: Usage,
}

/// A request for a routing hint: the model and the request's prefix hashes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HintRequest {
    /// Model name as the client sent it.
    pub model: String,
    /// Prefix hashes of the prompt's full blocks, first block first.
    pub hashes: Vec<PrefixHash>,
    /// Earlier hinted requests that have finished since the last report.
    pub finished: Vec<Finished>,
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
    /// A finished request names a usage kind this version does not know.
    #[error("unknown usage kind {0}")]
    UsageKind(u8),
}

impl HintRequest {
    /// Encode as the binary wire format.
    pub fn encode(&self) -> Vec<u8> {
        let name = &self.model.as_bytes()[..self.model.len().min(u16::MAX as usize)];
        let count = self.hashes.len().min(u32::MAX as usize);
        let mut out = Vec::with_capacity(
            4 + 2 + name.len() + 8 + count * 8 + self.finished.len() * FINISHED_BYTES,
        );
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&(name.len() as u16).to_le_bytes());
        out.extend_from_slice(name);
        put_u64s(&mut out, self.hashes[..count].iter().map(|h| h.0));
        if !self.finished.is_empty() {
            put_finished(&mut out, &self.finished);
        }
        out
    }

    /// Decode the binary wire format, rejecting anything malformed.
    pub fn decode(body: &[u8]) -> Result<Self, HintDecodeError> {
        let (v1, rest) = match (body.strip_prefix(MAGIC), body.strip_prefix(MAGIC_V1)) {
            (Some(rest), _) => (false, rest),
            (None, Some(rest)) => (true, rest),
            (None, None) => return Err(HintDecodeError::BadMagic),
        };
        let (len, rest) = split(rest, 2)?;
        let name_len = u16::from_le_bytes([len[0], len[1]]) as usize;
        let (name, rest) = split(rest, name_len)?;
        let model = std::str::from_utf8(name)
            .map_err(|_| HintDecodeError::ModelNotUtf8)?
            .to_owned();
        let (hashes, rest) = take_u64s(rest)?;
        let (finished, rest) = match (rest.is_empty(), v1) {
            (true, _) => (Vec::new(), rest),
            (false, true) => take_tickets_v1(rest)?,
            (false, false) => take_finished(rest)?,
        };
        if !rest.is_empty() {
            return Err(HintDecodeError::Trailing(rest.len()));
        }
        Ok(HintRequest {
            model,
            hashes: hashes.into_iter().map(PrefixHash).collect(),
            finished,
        })
    }
}

/// Encode a finished report (`POST /v1/finished`).
pub fn encode_finished(finished: &[Finished]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + finished.len() * FINISHED_BYTES);
    out.extend_from_slice(FINISHED_MAGIC);
    put_finished(&mut out, finished);
    out
}

/// Decode a finished report (either version).
pub fn decode_finished(body: &[u8]) -> Result<Vec<Finished>, HintDecodeError> {
    let (finished, rest) = match (
        body.strip_prefix(FINISHED_MAGIC),
        body.strip_prefix(FINISHED_MAGIC_V1),
    ) {
        (Some(rest), _) => take_finished(rest)?,
        (None, Some(rest)) => take_tickets_v1(rest)?,
        (None, None) => return Err(HintDecodeError::BadMagic),
    };
    if !rest.is_empty() {
        return Err(HintDecodeError::Trailing(rest.len()));
    }
    Ok(finished)
}

fn put_finished(out: &mut Vec<u8>, finished: &[Finished]) {
    let count = finished.len().min(u32::MAX as usize);
    out.extend_from_slice(&(count as u32).to_le_bytes());
    for f in &finished[..count] {
        let (prompt, cached) = f.usage.tokens();
        out.extend_from_slice(&f.ticket.0.to_le_bytes());
        out.push(f.usage.kind());
        out.extend_from_slice(&prompt.to_le_bytes());
        out.extend_from_slice(&cached.to_le_bytes());
    }
}

fn take_finished(bytes: &[u8]) -> Result<(Vec<Finished>, &[u8]), HintDecodeError> {
    let (count, rest) = split(bytes, 4)?;
    let count = u32::from_le_bytes([count[0], count[1], count[2], count[3]]) as usize;
    let need = count
        .checked_mul(FINISHED_BYTES)
        .ok_or(HintDecodeError::Truncated)?;
    let (raw, rest) = split(rest, need)?;
    let u32_at = |c: &[u8], at: usize| u32::from_le_bytes([c[at], c[at + 1], c[at + 2], c[at + 3]]);
    let finished = raw
        .chunks_exact(FINISHED_BYTES)
        .map(|c| {
            let ticket = Ticket(u64::from_le_bytes(c[..8].try_into().expect("8 bytes")));
            let usage = Usage::from_wire(c[8], u32_at(c, 9), u32_at(c, 13))
                .ok_or(HintDecodeError::UsageKind(c[8]))?;
            Ok(Finished { ticket, usage })
        })
        .collect::<Result<_, _>>()?;
    Ok((finished, rest))
}

fn take_tickets_v1(bytes: &[u8]) -> Result<(Vec<Finished>, &[u8]), HintDecodeError> {
    let (tickets, rest) = take_u64s(bytes)?;
    let finished = tickets
        .into_iter()
        .map(|t| Finished {
            ticket: Ticket(t),
            usage: Usage::Unanswered,
        })
        .collect();
    Ok((finished, rest))
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
        let usages = [
            Usage::Unanswered,
            Usage::Missing,
            Usage::Malformed,
            Usage::PromptOnly { prompt_tokens: 9 },
            Usage::Cached {
                prompt_tokens: u32::MAX,
                cached_tokens: 48,
            },
            Usage::Unread,
        ];
        let finished: Vec<Finished> = usages
            .iter()
            .zip([7, u64::MAX, 0, 1, 2, 3])
            .map(|(&usage, t)| Finished {
                ticket: Ticket(t),
                usage,
            })
            .collect();
        let with_finished = HintRequest {
            finished: finished.clone(),
            ..sample()
        };
        let bytes = with_finished.encode();
        assert_eq!(bytes.len(), 4 + 2 + 10 + 4 + 24 + 4 + 6 * 17);
        assert_eq!(HintRequest::decode(&bytes).unwrap(), with_finished);
        let report = encode_finished(&finished);
        assert_eq!(decode_finished(&report).unwrap(), finished);
        assert_eq!(
            decode_finished(&report[..report.len() - 1]),
            Err(HintDecodeError::Truncated)
        );
        assert_eq!(decode_finished(b"KVH2"), Err(HintDecodeError::BadMagic));
        let mut unknown_kind = encode_finished(&finished[..1]);
        unknown_kind[8 + 8] = 6;
        assert_eq!(
            decode_finished(&unknown_kind),
            Err(HintDecodeError::UsageKind(6))
        );
        for (i, u) in usages.iter().enumerate() {
            assert_eq!(u.label(), Usage::KINDS[i]);
        }
    }

    #[test]
    fn reads_version_one() {
        let mut v1 = b"KVF1".to_vec();
        v1.extend_from_slice(&1u32.to_le_bytes());
        v1.extend_from_slice(&7u64.to_le_bytes());
        let unanswered = vec![Finished {
            ticket: Ticket(7),
            usage: Usage::Unanswered,
        }];
        assert_eq!(decode_finished(&v1).unwrap(), unanswered);
        let mut hint = sample().encode();
        hint[..4].copy_from_slice(b"KVH1");
        hint.extend_from_slice(&v1[4..]);
        let decoded = HintRequest::decode(&hint).unwrap();
        assert_eq!(decoded.finished, unanswered);
        assert_eq!(decoded.hashes, sample().hashes);
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
        let mut huge = b"KVH2\x00\x00".to_vec();
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(HintRequest::decode(&huge), Err(HintDecodeError::Truncated));
        let mut bad_utf8 = b"KVH2\x01\x00\xff".to_vec();
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
