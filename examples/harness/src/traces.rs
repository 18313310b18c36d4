//! Replaying the Mooncake FAST'25 traces (`testdata/traces/`) as token-id completions.
//!
//! Each trace line gives `hash_ids`, one per 512-token block, where equal ids mean equal prefix
//! blocks. Each id becomes a deterministic run of `block_tokens` token ids (scaled down from 512
//! so a 2-core machine can replay it), and the last, partial block keeps its share of the scaled
//! length: the prefix structure is exact, only lengths shrink. Requests carry no session, so
//! each is its own [`Session`], dispatched in timestamp order (closed loop); the load ladder
//! (`crate::bench_load`) replays them at their own timestamps instead, sped up.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, Result};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::workload::{Rng, Session, COMPLETIONS};

/// One request of a trace.
#[derive(Debug, Clone, Deserialize)]
pub struct Line {
    /// Arrival, ms from the trace's start.
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: usize,
    output_length: u32,
    hash_ids: Vec<u64>,
}

/// How to turn a trace into requests.
#[derive(Debug, Clone)]
pub struct TraceSpec {
    /// Requests to take from the start of the trace.
    pub requests: usize,
    /// Tokens per 512-token trace block.
    pub block_tokens: usize,
    /// Cap on `max_tokens` (the trace's output lengths are kept up to this).
    pub max_output: u32,
    /// Token ids are drawn from `100..vocab - 100`.
    pub vocab: u32,
}

/// The token ids standing for trace block `hash_id`.
pub fn block_tokens(hash_id: u64, n: usize, vocab: u32) -> Vec<u32> {
    let mut rng = Rng::new(hash_id.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ 0xa5a5);
    let span = u64::from(vocab.saturating_sub(200).max(1));
    (0..n)
        .map(|_| 100 + (rng.next_u64() % span) as u32)
        .collect()
}

/// Where the trace `file` is (`testdata/traces/`).
pub fn path(file: &str) -> PathBuf {
    crate::paths::workspace().join("testdata/traces").join(file)
}

/// The first `spec.requests` lines of a trace file, in its (timestamp) order.
pub fn lines(path: &Path, spec: &TraceSpec) -> Result<Vec<Line>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    text.lines()
        .take(spec.requests)
        .enumerate()
        .map(|(n, line)| {
            serde_json::from_str(line).with_context(|| format!("{}:{}", path.display(), n + 1))
        })
        .collect()
}

impl Line {
    /// Its arrival from the trace's start.
    pub fn at(&self) -> Duration {
        Duration::from_millis(self.timestamp)
    }

    /// The request as a completion of token ids for `model`.
    pub fn body(&self, model: &str, spec: &TraceSpec) -> Value {
        let mut prompt = Vec::new();
        let last = self.hash_ids.len().saturating_sub(1);
        for (i, &id) in self.hash_ids.iter().enumerate() {
            let full = spec.block_tokens;
            let len = if i == last && !self.input_length.is_multiple_of(512) {
                ((self.input_length % 512) * full).div_ceil(512)
            } else {
                full
            };
            prompt.extend(block_tokens(id, full, spec.vocab).into_iter().take(len));
        }
        json!({
            "model": model,
            "prompt": prompt,
            "max_tokens": self.output_length.clamp(1, spec.max_output),
        })
    }
}

/// Read a trace file into sessions for `model`, one request each.
pub fn load(path: &Path, model: &str, spec: &TraceSpec) -> Result<Vec<Session>> {
    Ok(lines(path, spec)?
        .iter()
        .map(|line| Session {
            path: COMPLETIONS,
            bodies: vec![line.body(model, spec)],
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_structure_is_kept() {
        let dir = std::env::temp_dir().join(format!("trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.jsonl");
        let lines = [
            r#"{"timestamp": 0, "input_length": 1100, "output_length": 3, "hash_ids": [0, 1, 2]}"#,
            r#"{"timestamp": 1, "input_length": 1024, "output_length": 900, "hash_ids": [0, 1]}"#,
        ];
        std::fs::write(&path, lines.join("\n")).unwrap();
        let spec = TraceSpec {
            requests: 10,
            block_tokens: 32,
            max_output: 8,
            vocab: 2000,
        };
        let s = load(&path, "m", &spec).unwrap();
        let a: Vec<u64> = s[0].bodies[0]["prompt"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        let b: Vec<u64> = s[1].bodies[0]["prompt"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        // 1100 = 2 * 512 + 76: two full scaled blocks and ceil(76 * 32 / 512) = 5 tokens.
        assert_eq!(a.len(), 64 + 5);
        assert_eq!(b.len(), 64);
        assert_eq!(a[..64], b[..]);
        assert_eq!(s[1].bodies[0]["max_tokens"], 8);
        assert!(a.iter().all(|&t| (100..1900).contains(&t)));
    }
}
