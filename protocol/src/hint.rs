//! The hint exchange between the filter and the sidecar: `POST /v1/hint`.
//!
//! The request is binary because it carries up to thousands of hashes on every LLM request and
//! the filter runs inside Envoy's event loop: JSON would cost more to write than the hashing.
//!
//! ```text
//! request  (Content-Type: application/x-kvroute-hint)
//!   "KVH1"                magic + version
//!   u16 LE                length of the model name in bytes
//!   [u8]                  model name (UTF-8)
//!   u32 LE                number of prefix hashes
//!   [u64 LE]              prefix hashes, block 0 first
//! response (Content-Type: application/json)
//!   {"workers": ["ip:port", …], "matched_blocks": n}
//! ```
//! `workers` is ordered best first and may be empty (no useful match: use the fallback).

use serde::{Deserialize, Serialize};

use crate::hash::PrefixHash;

/// Content type of a binary hint request.
pub const HINT_CONTENT_TYPE: &str = "application/x-kvroute-hint";
/// Path of the hint endpoint on the sidecar.
pub const HINT_PATH: &str = "/v1/hint";
const MAGIC: &[u8; 4] = b"KVH1";

/// A request for a routing hint: the model and the request's prefix hashes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HintRequest {
    /// Model name as the client sent it.
    pub model: String,
    /// Prefix hashes of the prompt's full blocks, first block first.
    pub hashes: Vec<PrefixHash>,
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
        let mut out = Vec::with_capacity(4 + 2 + name.len() + 4 + count * 8);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&(name.len() as u16).to_le_bytes());
        out.extend_from_slice(name);
        out.extend_from_slice(&(count as u32).to_le_bytes());
        for h in &self.hashes[..count] {
            out.extend_from_slice(&h.0.to_le_bytes());
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
        let (count, rest) = split(rest, 4)?;
        let count = u32::from_le_bytes([count[0], count[1], count[2], count[3]]) as usize;
        let need = count.checked_mul(8).ok_or(HintDecodeError::Truncated)?;
        let (raw, rest) = split(rest, need)?;
        if !rest.is_empty() {
            return Err(HintDecodeError::Trailing(rest.len()));
        }
        let hashes = raw
            .chunks_exact(8)
            .map(|c| PrefixHash(u64::from_le_bytes(c.try_into().expect("8-byte chunk"))))
            .collect();
        Ok(HintRequest { model, hashes })
    }
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
}

impl HintResponse {
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
        }
    }

    #[test]
    fn round_trip() {
        let req = sample();
        let bytes = req.encode();
        assert_eq!(bytes.len(), 4 + 2 + 10 + 4 + 24);
        assert_eq!(HintRequest::decode(&bytes).unwrap(), req);
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
        long.push(0);
        assert_eq!(
            HintRequest::decode(&long),
            Err(HintDecodeError::Trailing(1))
        );
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
        };
        assert_eq!(
            resp.override_host_value().unwrap(),
            "127.0.0.1:1,127.0.0.1:2"
        );
        assert_eq!(HintResponse::default().override_host_value(), None);
        let parsed: HintResponse = serde_json::from_str(r#"{"workers":[],"extra":1}"#).unwrap();
        assert_eq!(parsed, HintResponse::default());
    }
}
