//! vLLM's own block hash (prefix caching's default `sha256` algorithm), so a simulated engine
//! publishes the `block_hashes` a real vLLM would: each block's full hash is
//! `sha256(pickle((parent_full_hash, tuple(token_ids), extra_keys)))`, the first block's parent
//! is `NONE_HASH = sha256(pickle("vllm-none-hash"))`, and events carry the low 64 bits (bytes
//! 24..32, big-endian). kvroute itself never recomputes this (it keys blocks by its own hash of
//! `token_ids`); peers that route on vLLM's hashes need it. Checked against the golden vectors
//! captured from vLLM 0.32 (`testdata/samples/vllm/golden_block_hash_vectors.json`).

use sha2::{Digest, Sha256};

/// A block's full 32-byte hash.
pub type FullHash = [u8; 32];

/// The parent hash of a request's first block (no `PYTHONHASHSEED`).
pub fn none_hash() -> FullHash {
    let mut body = Vec::new();
    push_str(&mut body, "vllm-none-hash");
    Sha256::digest(framed(&body)).into()
}

/// The full hash of a block of `tokens` after `parent`; `extra_keys` are the block's extra keys
/// (LoRA name, then the cache salt on block 0), `None` in vLLM when there are none.
pub fn block_hash(parent: &FullHash, tokens: &[u32], extra_keys: &[&str]) -> FullHash {
    Sha256::digest(serialize(parent, tokens, extra_keys)).into()
}

/// The value an event carries for a full hash (vLLM's default integer block hashes).
pub fn event_value(full: &FullHash) -> u64 {
    let mut low = [0u8; 8];
    low.copy_from_slice(&full[24..32]);
    u64::from_be_bytes(low)
}

/// `pickle.dumps((parent, tuple(tokens), extra_keys or None), protocol=5)`.
fn serialize(parent: &FullHash, tokens: &[u32], extra_keys: &[&str]) -> Vec<u8> {
    const MEMOIZE: u8 = 0x94;
    let mut body = vec![0x43, 32]; // SHORT_BINBYTES
    body.extend_from_slice(parent);
    body.push(MEMOIZE);
    body.push(0x28); // MARK
    for &t in tokens {
        match t {
            0..=0xff => body.extend_from_slice(&[0x4b, t as u8]), // BININT1
            0x100..=0xffff => {
                body.push(0x4d); // BININT2
                body.extend_from_slice(&(t as u16).to_le_bytes());
            }
            _ => {
                body.push(0x4a); // BININT (signed 32-bit; token ids fit)
                body.extend_from_slice(&(t as i32).to_le_bytes());
            }
        }
    }
    body.extend_from_slice(&[0x74, MEMOIZE]); // TUPLE
    match extra_keys.len() {
        0 => body.push(0x4e), // NONE
        n => {
            if n > 3 {
                body.push(0x28); // MARK
            }
            for key in extra_keys {
                push_str(&mut body, key);
            }
            // TUPLE1/2/3 for short tuples, MARK … TUPLE beyond, as pickle writes them.
            body.push(match n {
                1 => 0x85,
                2 => 0x86,
                3 => 0x87,
                _ => 0x74,
            });
            body.push(MEMOIZE);
        }
    }
    body.extend_from_slice(&[0x87, MEMOIZE]); // TUPLE3
    framed(&body)
}

/// A str as pickle writes it: SHORT_BINUNICODE (or BINUNICODE when long), memoized.
fn push_str(out: &mut Vec<u8>, s: &str) {
    match u8::try_from(s.len()) {
        Ok(n) => out.extend_from_slice(&[0x8c, n]),
        Err(_) => {
            out.push(0x58);
            out.extend_from_slice(&(s.len() as u32).to_le_bytes());
        }
    }
    out.extend_from_slice(s.as_bytes());
    out.push(0x94);
}

/// Protocol 5 header and one frame around `body`, then STOP.
fn framed(body: &[u8]) -> Vec<u8> {
    let mut out = vec![0x80, 5, 0x95];
    out.extend_from_slice(&(body.len() as u64 + 1).to_le_bytes());
    out.extend_from_slice(body);
    out.push(0x2e);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn matches_vllm_golden_vectors() {
        let path = kvroute_protocol::samples_dir().join("vllm/golden_block_hash_vectors.json");
        let golden: serde_json::Value =
            serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        let mut checked = 0;
        for case in golden["cases"].as_array().unwrap() {
            if case["algo"] != "sha256" || case["seed"] != "vllm-none-hash" {
                continue;
            }
            assert_eq!(hex(&none_hash()), case["none_hash_hex"]);
            for block in case["blocks"].as_array().unwrap() {
                let parent_hex = block["parent_hex"].as_str().unwrap();
                let parent: Vec<u8> = (0..32)
                    .map(|i| u8::from_str_radix(&parent_hex[2 * i..2 * i + 2], 16).unwrap())
                    .collect();
                let parent: FullHash = parent.try_into().unwrap();
                let tokens: Vec<u32> = block["token_ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|t| t.as_u64().unwrap() as u32)
                    .collect();
                assert_eq!(
                    hex(&serialize(&parent, &tokens, &[])),
                    block["serialized_hex"]
                );
                let full = block_hash(&parent, &tokens, &[]);
                assert_eq!(hex(&full), block["full_hash_hex"]);
                assert_eq!(event_value(&full), block["event_value"].as_u64().unwrap());
                checked += 1;
            }
        }
        assert!(checked >= 4, "{checked} golden blocks");
    }

    /// Expected bytes from CPython 3.11's `pickle.dumps(…, protocol=5)`.
    #[test]
    fn extra_keys_pickle_as_python_does() {
        assert_eq!(
            hex(&serialize(&[0; 32], &[1, 2, 3, 4], &["sql-lora"])),
            "8005953e000000000000004320000000000000000000000000000000000000000000000000000000000000000094284b014b024b034b0474948c0873716c2d6c6f726194859487942e"
        );
        assert_eq!(
            hex(&serialize(&[0; 32], &[1, 2, 3, 4, 70000, 300], &["sql-lora", "salt"])),
            "8005954d000000000000004320000000000000000000000000000000000000000000000000000000000000000094284b014b024b034b044a701101004d2c0174948c0873716c2d6c6f7261948c0473616c7494869487942e"
        );
        assert_eq!(
            hex(&serialize(&[0; 32], &[1, 2, 3, 4], &["a", "b", "c", "d"])),
            "80059544000000000000004320000000000000000000000000000000000000000000000000000000000000000094284b014b024b034b047494288c0161948c0162948c0163948c016494749487942e"
        );
    }
}
