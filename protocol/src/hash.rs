//! Block hashing, bit-compatible with NVIDIA Dynamo's KV router.
//!
//! A prompt's token ids are cut into full blocks of `block_size` tokens (a trailing partial block
//! is never cached by an engine, so it is never hashed). Each block gets a [`LocalBlockHash`]:
//! `xxh3_64_with_seed(u32-LE bytes of its token ids, seed)`. Blocks are chained into
//! [`PrefixHash`]es, which name a block together with the whole prefix before it: the first is the
//! block's local hash, each next one is `xxh3_64_with_seed(parent_le ‖ local_le, 1337)` — the same
//! rule Dynamo uses for its sequence hashes, so the golden values in the Dynamo captures check it.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// The seed Dynamo uses for block hashes when no LoRA or cache salt applies.
pub const BASE_SEED: u64 = 1337;

/// Hash of one block's token ids alone (Dynamo's `LocalBlockHash` / `tokens_hash`).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct LocalBlockHash(pub u64);

/// Hash of a block and every block before it (Dynamo's `SequenceHash`); the index key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PrefixHash(pub u64);

/// The seed for a request's block hashes: base seed, shifted by a LoRA adapter and a cache salt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HashSeed(pub u64);

impl Default for HashSeed {
    fn default() -> Self {
        HashSeed(BASE_SEED)
    }
}

impl HashSeed {
    /// Seed for a request that may name a LoRA adapter and a `cache_salt` (Dynamo 1.6 rules).
    pub fn for_request(lora_name: Option<&str>, cache_salt: Option<&str>) -> Self {
        let mut seed = BASE_SEED;
        if let Some(lora) = lora_name.filter(|s| !s.is_empty()) {
            seed = seed.wrapping_add(xxh3_64(lora.as_bytes()));
        }
        if let Some(salt) = cache_salt.filter(|s| !s.is_empty()) {
            seed = seed.wrapping_add(xxh3_64_with_seed(salt.as_bytes(), 1));
        }
        HashSeed(seed)
    }
}

/// Local hash of one block of token ids.
pub fn local_block_hash(tokens: &[u32], seed: HashSeed) -> LocalBlockHash {
    LocalBlockHash(xxh3_64_with_seed(&le_bytes(tokens), seed.0))
}

/// The little-endian bytes of `tokens`: on a little-endian machine (x86, ARM, wasm) their own
/// memory, neither copied nor allocated — in Envoy's V8 copying them cost as much as hashing.
#[cfg(target_endian = "little")]
fn le_bytes(tokens: &[u32]) -> std::borrow::Cow<'_, [u8]> {
    std::borrow::Cow::Borrowed(bytemuck::cast_slice(tokens))
}

#[cfg(not(target_endian = "little"))]
fn le_bytes(tokens: &[u32]) -> std::borrow::Cow<'_, [u8]> {
    std::borrow::Cow::Owned(tokens.iter().flat_map(|t| t.to_le_bytes()).collect())
}

/// Local hashes of every full block of `tokens`.
pub fn local_block_hashes(
    tokens: &[u32],
    block_size: usize,
    seed: HashSeed,
) -> Vec<LocalBlockHash> {
    if block_size == 0 {
        return Vec::new();
    }
    tokens
        .chunks_exact(block_size)
        .map(|block| local_block_hash(block, seed))
        .collect()
}

/// The prefix hash of `local` when it follows the block whose prefix hash is `parent`.
pub fn chain(parent: Option<PrefixHash>, local: LocalBlockHash) -> PrefixHash {
    match parent {
        None => PrefixHash(local.0),
        Some(p) => {
            let mut bytes = [0u8; 16];
            bytes[..8].copy_from_slice(&p.0.to_le_bytes());
            bytes[8..].copy_from_slice(&local.0.to_le_bytes());
            PrefixHash(xxh3_64_with_seed(&bytes, BASE_SEED))
        }
    }
}

/// Prefix hashes of a sequence of local hashes, starting from the root.
pub fn prefix_hashes(locals: &[LocalBlockHash]) -> Vec<PrefixHash> {
    let mut parent = None;
    locals
        .iter()
        .map(|&local| {
            let p = chain(parent, local);
            parent = Some(p);
            p
        })
        .collect()
}

/// Prefix hashes of every full block of `tokens`: what the filter sends and the index stores.
pub fn token_prefix_hashes(tokens: &[u32], block_size: usize, seed: HashSeed) -> Vec<PrefixHash> {
    let mut hashes = Vec::with_capacity(tokens.len().checked_div(block_size).unwrap_or(0));
    extend_prefix_hashes(&mut hashes, tokens, block_size, seed);
    hashes
}

/// Append the prefix hashes of every full block of `more`, the tokens that follow the blocks
/// `hashes` already names: a prompt hashed from where a known prefix of it ends.
pub fn extend_prefix_hashes(
    hashes: &mut Vec<PrefixHash>,
    more: &[u32],
    block_size: usize,
    seed: HashSeed,
) {
    if block_size == 0 {
        return;
    }
    let mut parent = hashes.last().copied();
    for block in more.chunks_exact(block_size) {
        let p = chain(parent, local_block_hash(block, seed));
        hashes.push(p);
        parent = Some(p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hashing a prompt from where a known prefix ends gives the whole prompt's hashes.
    #[test]
    fn extending_a_known_prefix_is_hashing_the_whole() {
        let tokens: Vec<u32> = (0..100).map(|t| t * 7919 % 32000).collect();
        let seed = HashSeed::for_request(Some("lora"), None);
        let whole = token_prefix_hashes(&tokens, 16, seed);
        assert_eq!(whole.len(), 6);
        for known in 0..=whole.len() {
            let mut hashes = whole[..known].to_vec();
            extend_prefix_hashes(&mut hashes, &tokens[known * 16..], 16, seed);
            assert_eq!(hashes, whole, "{known}");
        }
        assert_eq!(prefix_hashes(&local_block_hashes(&tokens, 16, seed)), whole);
        assert!(token_prefix_hashes(&tokens, 0, seed).is_empty());
    }

    /// The golden file from a real Dynamo 1.6.1 run: token ids and both hash chains.
    fn golden() -> serde_json::Value {
        let text = std::fs::read_to_string(crate::samples_dir().join("dynamo/hash_golden.json"))
            .expect("testdata/samples is in the workspace");
        serde_json::from_str(&text).expect("golden json")
    }

    fn u64s(v: &serde_json::Value) -> Vec<u64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect()
    }

    #[test]
    fn local_hashes_match_dynamo_golden() {
        let g = golden();
        let tokens = crate::golden_dynamo_prompt();
        let bs = g["block_size"].as_u64().unwrap() as usize;
        let want = u64s(
            &g["tokens_hash (LocalBlockHash) = xxh3_64(u32 LE token ids of block, seed=1337)"],
        );
        let got: Vec<u64> = local_block_hashes(&tokens, bs, HashSeed::default())
            .iter()
            .map(|h| h.0)
            .collect();
        assert_eq!(got, want);
        // 74 tokens at block size 16: the trailing 10 tokens are not a block.
        assert_eq!(got.len(), 4);
    }

    #[test]
    fn prefix_hashes_match_dynamo_sequence_hashes() {
        let g = golden();
        let tokens = crate::golden_dynamo_prompt();
        let key = "block_hash (mocker sequence hash) = first: tokens_hash; next: xxh3_64(parent_u64_le || tokens_hash_u64_le, seed=1337)";
        let want = u64s(&g[key]);
        let got: Vec<u64> = token_prefix_hashes(&tokens, 16, HashSeed::default())
            .iter()
            .map(|h| h.0)
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn seed_changes_with_lora_and_salt() {
        let base = HashSeed::for_request(None, None);
        assert_eq!(base, HashSeed(BASE_SEED));
        assert_eq!(HashSeed::for_request(Some(""), Some("")), base);
        let lora = HashSeed::for_request(Some("adapter-a"), None);
        let salt = HashSeed::for_request(None, Some("tenant-1"));
        let both = HashSeed::for_request(Some("adapter-a"), Some("tenant-1"));
        assert_eq!(lora.0, BASE_SEED.wrapping_add(xxh3_64(b"adapter-a")));
        assert_eq!(
            salt.0,
            BASE_SEED.wrapping_add(xxh3_64_with_seed(b"tenant-1", 1))
        );
        assert_eq!(
            both.0,
            BASE_SEED
                .wrapping_add(xxh3_64(b"adapter-a"))
                .wrapping_add(xxh3_64_with_seed(b"tenant-1", 1))
        );
        let t: Vec<u32> = (0..16).collect();
        assert_ne!(local_block_hash(&t, base), local_block_hash(&t, salt));
    }

    #[test]
    fn long_blocks_hash_like_short_ones() {
        // The heap path (blocks over 64 tokens) must give the same bytes as the stack path.
        let t: Vec<u32> = (0..100).map(|i| i * 7919).collect();
        let bytes: Vec<u8> = t.iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(
            local_block_hash(&t, HashSeed::default()).0,
            xxh3_64_with_seed(&bytes, 1337)
        );
        assert!(local_block_hashes(&t, 0, HashSeed::default()).is_empty());
    }
}
