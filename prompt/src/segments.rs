//! Token ids of text seen before: a multi-turn chat sends its whole history with every turn,
//! and tokenizing it again is most of a request's preparation.
//!
//! The tokenizer cuts its input at special tokens before it normalizes or splits anything, so
//! the text between two special tokens is tokenized on its own either way. A chat template puts
//! special tokens between messages, so a rendered prompt cut before each of them is a run of
//! segments — a message with its header, a turn's end — whose ids, concatenated, are the whole
//! prompt's. A segment seen before (the history, a shared system prompt) is looked up; only new
//! ones are tokenized.
//!
//! Exact by construction only for the special tokens the tokenizer matches verbatim
//! (`normalized: false`, neither `lstrip` nor `single_word`: those depend on the text around
//! them), and only for tokenizers that do cut there first; so a model is checked when it loads
//! (a sample chat, whole against cut), and one cut request in [`CHECK_EVERY`] is tokenized
//! whole as well: a difference turns the cache off for good and says so in that request's
//! [`SegmentUse`].
//!
//! The same holds one step further: a prompt's block hashes up to the end of a segment depend
//! only on the segments so far, so they are kept too, under a key naming those segments (and
//! the block size and hash seed). The next turn of a chat finds its history's hashes and hashes
//! only its new blocks: in Envoy's V8, hashing an 8k-token history's 500 blocks took ~40 µs.
//!
//! And one step further again: a prompt's history — its block hashes up to the end of the
//! segments it shares with prompts seen before — is kept whole under that end's key, and the
//! next prompt that reaches that end finds it in one lookup instead of one per segment, without
//! the history's ids: the next turn of a chat finds the history its last turn found, and looks
//! up only the last turn's segments. Inside Envoy the proxy's neighbours evict the CPU's caches
//! between requests, and each of an 8k history's ~60 segments cost two cold map lookups and a
//! copy of its ids (docs/benchmarks.md, "Request preparation").

use std::sync::Mutex;

use kvroute_protocol::hash::{extend_prefix_hashes, token_prefix_hashes, HashSeed, PrefixHash};
use xxhash_rust::xxh3::xxh3_128;

use crate::clock::ClockMap;
use crate::tokenizer::{Tokenizer, TokenizerError};

/// One request cut into segments in this many is also tokenized whole and compared.
pub const CHECK_EVERY: u64 = 64;

/// Bytes an entry costs beyond its ids or hashes: its key, its place in the clock, the map's
/// slot.
const ENTRY_OVERHEAD: usize = 64;

/// One part in this many of the budget holds segments' block hashes, one histories (a
/// block's hash takes 8 bytes against its ids' 4 a token), the rest ids.
const HASHES_SHARE: usize = 8;

/// A prompt's history is looked for at its last this many segment ends: a next turn adds the
/// last answer, the question and the generation prompt to the history its last turn found, a
/// few segments each, and an agent's turn tool results as well.
const HISTORY_LOOKBACK: usize = 16;

/// What the cache did for one prompt.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SegmentUse {
    /// Segments found.
    pub found: u32,
    /// Of those, segments found at once as a prompt's history.
    pub history: u32,
    /// Segments tokenized (and kept, unless larger than a quarter of the budget).
    pub tokenized: u32,
    /// The prompt was also tokenized whole to check the cut, and the two differed: the cache is
    /// off from now on, and the whole prompt's ids were used.
    pub mismatch: bool,
}

/// A prompt's ids, cut at its segments.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Cut {
    /// Token ids of the prompt but its first [`Cut::known`].
    pub ids: Vec<u32>,
    /// Ids at the prompt's start not in `ids`: a history's, found as its blocks' hashes
    /// ([`Segmenter::encode_hashed`]; 0 otherwise).
    pub known: usize,
    /// What the cache did.
    pub used: SegmentUse,
    /// Where each segment ends, in order; empty when the ids did not come from the cut (the
    /// cache off, or the cut found wrong).
    pub ends: Vec<SegmentEnd>,
}

impl Cut {
    /// The ids of a prompt tokenized whole, without the cache.
    pub(crate) fn whole(ids: Vec<u32>) -> Cut {
        Cut {
            ids,
            ..Cut::default()
        }
    }

    /// The prompt's length in tokens.
    pub fn tokens(&self) -> usize {
        self.known + self.ids.len()
    }
}

/// The end of a prompt's segment: the ids before it, and a key naming every segment up to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentEnd {
    /// Token ids from the prompt's start to the end of this segment.
    pub tokens: usize,
    /// The segments' texts up to here, hashed in order.
    pub key: u128,
}

/// The special tokens a model's prompts are cut before, and the ids of the segments seen.
pub struct Segmenter {
    /// Special tokens the rendered sample chat contains, matched verbatim by the tokenizer,
    /// longest first.
    cuts: Vec<String>,
    /// The distinct bytes they start with.
    first_bytes: Vec<u8>,
    state: Mutex<State>,
}

struct State {
    /// A segment's ids by the hash of its text.
    ids: ClockMap<Box<[u32]>>,
    /// The hashes of the blocks ending within a segment, by its end's [`SegmentEnd::key`],
    /// the block size and the hash seed.
    hashes: ClockMap<Box<[PrefixHash]>>,
    /// Prompts' histories, by the key of the end they reach, the block size and the hash seed.
    histories: ClockMap<History>,
    requests: u64,
    off: bool,
}

impl State {
    fn new(budget: usize) -> State {
        let part = budget / HASHES_SHARE;
        State {
            ids: ClockMap::new(budget - 2 * part),
            hashes: ClockMap::new(part),
            histories: ClockMap::new(part),
            requests: 0,
            off: false,
        }
    }

    fn clear(&mut self) {
        self.ids.clear();
        self.hashes.clear();
        self.histories.clear();
    }
}

/// A prompt from its start to one of its segment ends: the hashes of its full blocks, the ids
/// after them, and the ids before each segment's end.
struct History {
    hashes: Box<[PrefixHash]>,
    tail: Box<[u32]>,
    ends: Box<[u32]>,
}

/// One segment of a prompt: where it lies in the text, the hash of its text (its ids' key) and
/// the key of the segments up to its end ([`SegmentEnd::key`]).
#[derive(Debug, Clone, Copy)]
struct Segment {
    start: usize,
    end: usize,
    hash: u128,
    key: u128,
}

/// Special tokens of `tokenizer_json` that the tokenizer matches verbatim, wherever they are.
fn verbatim_special_tokens(tokenizer_json: &str) -> Vec<String> {
    let Ok(doc) = serde_json::from_str::<serde_json::Value>(tokenizer_json) else {
        return Vec::new();
    };
    let flag = |t: &serde_json::Value, name: &str| t[name].as_bool().unwrap_or(false);
    doc["added_tokens"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|t| {
            flag(t, "special")
                && !flag(t, "normalized")
                && !flag(t, "lstrip")
                && !flag(t, "single_word")
        })
        .filter_map(|t| t["content"].as_str())
        .filter(|c| !c.is_empty())
        .map(str::to_owned)
        .collect()
}

fn first_bytes(cuts: &[String]) -> Vec<u8> {
    let mut first: Vec<u8> = cuts.iter().filter_map(|c| c.bytes().next()).collect();
    first.sort_unstable();
    first.dedup();
    first
}

impl Segmenter {
    /// A segmenter for the tokenizer of `tokenizer_json`, cutting before the special tokens
    /// `sample` (a rendered chat) contains, holding at most `budget` bytes of ids; `None` when
    /// the sample has none of them or its cut ids differ from its whole ones.
    pub fn new(
        tokenizer_json: &str,
        tokenizer: &Tokenizer,
        sample: &str,
        budget: usize,
    ) -> Option<Segmenter> {
        let mut cuts: Vec<String> = verbatim_special_tokens(tokenizer_json)
            .into_iter()
            .filter(|t| sample.contains(t.as_str()))
            .collect();
        // Longest first: where one special token contains another, the longer one is cut.
        cuts.sort_by_key(|t| std::cmp::Reverse(t.len()));
        if cuts.is_empty() || budget == 0 {
            return None;
        }
        let segmenter = Segmenter {
            first_bytes: first_bytes(&cuts),
            cuts,
            state: Mutex::new(State::new(budget)),
        };
        let whole = tokenizer.encode(sample, false).ok()?;
        let cut = segmenter.cut_ids(sample, tokenizer, false).ok()?;
        (whole == cut.ids).then_some(segmenter)
    }

    /// The special tokens prompts are cut before.
    pub fn cuts(&self) -> &[String] {
        &self.cuts
    }

    /// Token ids of `text` without the post-processor's special tokens, as
    /// `tokenizer.encode(text, false)` would give them, what the cache did, and where the
    /// segments end.
    pub fn encode(&self, text: &str, tokenizer: &Tokenizer) -> Result<Cut, TokenizerError> {
        let Some(check) = self.begin() else {
            return Ok(Cut::whole(tokenizer.encode(text, false)?));
        };
        let cut = self.cut_ids(text, tokenizer, true)?;
        self.checked(cut, text, tokenizer, check)
    }

    /// [`Segmenter::encode`] and [`Segmenter::prefix_hashes`] in one, the history found whole
    /// where the prompt continues one seen before ([module docs](self)): its ids are then not in
    /// the cut ([`Cut::known`]), only its blocks' hashes. A request checked whole is cut
    /// without a history, all its ids at hand.
    pub fn encode_hashed(
        &self,
        text: &str,
        tokenizer: &Tokenizer,
        block_size: usize,
        seed: HashSeed,
    ) -> Result<(Cut, Vec<PrefixHash>), TokenizerError> {
        if block_size == 0 {
            return Ok((self.encode(text, tokenizer)?, Vec::new()));
        }
        let Some(check) = self.begin() else {
            let cut = Cut::whole(tokenizer.encode(text, false)?);
            let hashes = token_prefix_hashes(&cut.ids, block_size, seed);
            return Ok((cut, hashes));
        };
        let segments = self.segments(text);
        let mut cut = Cut {
            ids: Vec::with_capacity(text.len() / 3),
            ..Cut::default()
        };
        let mut hashes = Vec::with_capacity(text.len() / 3 / block_size);
        let known = if check {
            0
        } else {
            self.find_history(&segments, block_size, seed, &mut cut, &mut hashes)
        };
        let run = self.extend_cut(&mut cut, text, &segments[known..], tokenizer)?;
        if known > 0 {
            extend_prefix_hashes(&mut hashes, &cut.ids, block_size, seed);
        } else {
            hashes = self.prefix_hashes(&cut, block_size, seed);
        }
        if run > 0 {
            self.keep_history(&cut, &hashes, block_size, seed, known + run - 1);
        }
        let cut = self.checked(cut, text, tokenizer, check)?;
        if cut.used.mismatch {
            hashes = token_prefix_hashes(&cut.ids, block_size, seed);
        }
        Ok((cut, hashes))
    }

    /// Count a request; `None` when the cache is off, else whether this one is checked whole.
    fn begin(&self) -> Option<bool> {
        let mut state = self.lock();
        if state.off {
            return None;
        }
        state.requests += 1;
        Some(state.requests % CHECK_EVERY == 1)
    }

    /// `cut`, or with `check` the whole prompt's ids when they differ from it (the cache is
    /// then off for good).
    fn checked(
        &self,
        cut: Cut,
        text: &str,
        tokenizer: &Tokenizer,
        check: bool,
    ) -> Result<Cut, TokenizerError> {
        if !check {
            return Ok(cut);
        }
        let whole = tokenizer.encode(text, false)?;
        if whole == cut.ids {
            return Ok(cut);
        }
        let mut state = self.lock();
        state.off = true;
        state.clear();
        Ok(Cut {
            used: SegmentUse {
                mismatch: true,
                ..cut.used
            },
            ..Cut::whole(whole)
        })
    }

    /// The longest history kept that `segments` start with, looked for at the last
    /// [`HISTORY_LOOKBACK`] ends: its hashes are put in `hashes` and `cut` made its
    /// continuation (the ids after its full blocks), and the number of segments it covers
    /// returned (0: none found).
    fn find_history(
        &self,
        segments: &[Segment],
        block_size: usize,
        seed: HashSeed,
        cut: &mut Cut,
        hashes: &mut Vec<PrefixHash>,
    ) -> usize {
        let n = segments.len();
        let mut state = self.lock();
        for at in (n.saturating_sub(HISTORY_LOOKBACK)..n).rev() {
            let key = end_key(segments[at].key, block_size, seed);
            if let Some(history) = state.histories.get(key) {
                hashes.extend_from_slice(&history.hashes);
                cut.known = hashes.len() * block_size;
                cut.ids.extend_from_slice(&history.tail);
                let ends = segments[..=at].iter().zip(history.ends.iter());
                cut.ends.extend(ends.map(|(segment, &tokens)| SegmentEnd {
                    tokens: tokens as usize,
                    key: segment.key,
                }));
                cut.used.found += at as u32 + 1;
                cut.used.history += at as u32 + 1;
                return at + 1;
            }
        }
        0
    }

    /// Keep `cut`'s history up to its segment end `at`, if it holds a full block and is not
    /// kept already.
    fn keep_history(
        &self,
        cut: &Cut,
        hashes: &[PrefixHash],
        block_size: usize,
        seed: HashSeed,
        at: usize,
    ) {
        let end = cut.ends[at];
        let blocks = end.tokens / block_size;
        let key = end_key(end.key, block_size, seed);
        // Kept already when it ends earlier than the ends a history is looked for at (a shared
        // system prompt before a long new question): not built again to be refused.
        if blocks == 0 || self.lock().histories.contains(key) {
            return;
        }
        // `at` is past the history the cut was found with, if any: its ids are at hand.
        let tail = blocks * block_size - cut.known..end.tokens - cut.known;
        let bytes = (tail.len() + at + 1) * 4 + blocks * 8 + ENTRY_OVERHEAD;
        let history = History {
            hashes: hashes[..blocks].into(),
            tail: cut.ids[tail].into(),
            ends: cut.ends[..=at].iter().map(|e| e.tokens as u32).collect(),
        };
        self.lock().histories.put(key, history, bytes);
    }

    /// The prefix hashes of `cut`'s full blocks of `block_size` under `seed`, as
    /// [`kvroute_protocol::hash::token_prefix_hashes`] gives them. Each segment end keeps the
    /// hashes of the blocks that end within its segment: segment by segment from the start,
    /// those kept are looked up until one is missing, the rest hashed and kept.
    pub fn prefix_hashes(&self, cut: &Cut, block_size: usize, seed: HashSeed) -> Vec<PrefixHash> {
        if block_size == 0 {
            return Vec::new();
        }
        let mut hashes = Vec::with_capacity(cut.ids.len() / block_size);
        // The blocks ending within each segment: from the last end's to this end's.
        let mut ranges = cut.ends.iter().scan(0, |before, end| {
            let range = *before..end.tokens / block_size;
            *before = range.end;
            Some((end_key(end.key, block_size, seed), range))
        });
        let mut missing = None;
        {
            let mut state = self.lock();
            for (key, range) in ranges.by_ref().filter(|(_, r)| !r.is_empty()) {
                match state.hashes.get(key) {
                    Some(known) => hashes.extend_from_slice(known),
                    None => {
                        missing = Some((key, range));
                        break;
                    }
                }
            }
        }
        let from = hashes.len() * block_size;
        extend_prefix_hashes(&mut hashes, &cut.ids[from..], block_size, seed);
        let mut state = self.lock();
        for (key, range) in missing.into_iter().chain(ranges) {
            if !range.is_empty() {
                let bytes = range.len() * 8 + ENTRY_OVERHEAD;
                state.hashes.put(key, hashes[range].into(), bytes);
            }
        }
        hashes
    }

    /// The byte offsets `text` is cut at: before every cut token, in order (0 not included).
    fn cut_points(&self, text: &str) -> Vec<usize> {
        let bytes = text.as_bytes();
        let mut points = Vec::new();
        let mut at = 0;
        while let Some(next) = self.next_candidate(&bytes[at..]) {
            let start = at + next;
            match self
                .cuts
                .iter()
                .find(|c| bytes[start..].starts_with(c.as_bytes()))
            {
                Some(c) => {
                    if start > 0 {
                        points.push(start);
                    }
                    at = start + c.len();
                }
                None => at = start + 1,
            }
        }
        points
    }

    /// Where in `bytes` a cut token may start: at a byte some cut token starts with. Templates'
    /// special tokens mostly start alike (`<`), so this is usually one SIMD search.
    fn next_candidate(&self, bytes: &[u8]) -> Option<usize> {
        match self.first_bytes[..] {
            [a] => memchr::memchr(a, bytes),
            [a, b] => memchr::memchr2(a, b, bytes),
            [a, b, c] => memchr::memchr3(a, b, c, bytes),
            _ => bytes.iter().position(|b| self.first_bytes.contains(b)),
        }
    }

    /// `text`'s segments, in order.
    fn segments(&self, text: &str) -> Vec<Segment> {
        let mut key = 0u128;
        let mut start = 0;
        let points = self.cut_points(text);
        let mut segments = Vec::with_capacity(points.len() + 1);
        for end in points.into_iter().chain([text.len()]) {
            if end > start {
                let hash = xxh3_128(&text.as_bytes()[start..end]);
                key = chained(key, hash);
                segments.push(Segment {
                    start,
                    end,
                    hash,
                    key,
                });
            }
            start = end;
        }
        segments
    }

    /// The ids of `text` segment by segment; with `cached`, each segment looked up (and kept),
    /// what the cache did counted, and the segment ends named.
    fn cut_ids(
        &self,
        text: &str,
        tokenizer: &Tokenizer,
        cached: bool,
    ) -> Result<Cut, TokenizerError> {
        let mut cut = Cut {
            ids: Vec::with_capacity(text.len() / 3),
            ..Cut::default()
        };
        if cached {
            self.extend_cut(&mut cut, text, &self.segments(text), tokenizer)?;
            return Ok(cut);
        }
        let mut from = 0;
        for to in self.cut_points(text).into_iter().chain([text.len()]) {
            cut.ids.extend(tokenizer.encode(&text[from..to], false)?);
            from = to;
        }
        Ok(cut)
    }

    /// Append the ids of `segments` of `text` to `cut`: each looked up, or tokenized and kept.
    /// Returns how many of them, from the first, were found.
    fn extend_cut(
        &self,
        cut: &mut Cut,
        text: &str,
        segments: &[Segment],
        tokenizer: &Tokenizer,
    ) -> Result<usize, TokenizerError> {
        let mut run = None;
        for (i, segment) in segments.iter().enumerate() {
            let found = match self.lock().ids.get(segment.hash) {
                Some(known) => {
                    cut.ids.extend_from_slice(known);
                    true
                }
                None => false,
            };
            if found {
                cut.used.found += 1;
            } else {
                run.get_or_insert(i);
                let new = tokenizer.encode(&text[segment.start..segment.end], false)?;
                cut.used.tokenized += 1;
                cut.ids.extend_from_slice(&new);
                let bytes = new.len() * 4 + ENTRY_OVERHEAD;
                self.lock()
                    .ids
                    .put(segment.hash, new.into_boxed_slice(), bytes);
            }
            cut.ends.push(SegmentEnd {
                tokens: cut.tokens(),
                key: segment.key,
            });
        }
        Ok(run.unwrap_or(segments.len()))
    }

    /// The lock is only ever held for a lookup or an insert, never across tokenizing: the
    /// filter's VM is single-threaded, and natively a caller sharing a preprocessor between
    /// threads waits for a map operation at most.
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The key of the segments up to `key`'s end followed by the segment hashed `next`.
fn chained(key: u128, next: u128) -> u128 {
    let mut bytes = [0u8; 32];
    bytes[..16].copy_from_slice(&key.to_le_bytes());
    bytes[16..].copy_from_slice(&next.to_le_bytes());
    xxh3_128(&bytes)
}

/// The key of a segment end's hashes of blocks of `block_size` under `seed`.
fn end_key(key: u128, block_size: usize, seed: HashSeed) -> u128 {
    chained(key, u128::from(seed.0) | (block_size as u128) << 64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model_dir::load_bundle;

    fn tiny() -> (String, Tokenizer) {
        let dir = kvroute_protocol::samples_dir().join("vllm/tiny-llama-tokenizer");
        let bundle = load_bundle(&dir, "tiny", 16).unwrap();
        let tokenizer = Tokenizer::from_json(&bundle.tokenizer_json).unwrap();
        (bundle.tokenizer_json, tokenizer)
    }

    fn chat(turns: usize) -> String {
        let mut text = "<s><|system|>\nBe brief.<|end|>\n".to_owned();
        for t in 0..turns {
            text += &format!(
                "<|user|>\nQuestion {t}: why?<|end|>\n<|assistant|>\nBecause {t}.<|end|>\n"
            );
        }
        text + "<|assistant|>\n"
    }

    fn segmenter(budget: usize) -> (Segmenter, Tokenizer) {
        let (json, tokenizer) = tiny();
        let s = Segmenter::new(&json, &tokenizer, &chat(2), budget).expect("a segmenter");
        (s, tokenizer)
    }

    /// Prompts are cut before each special token the sample holds (the longest where two
    /// start alike), never at 0.
    #[test]
    fn cuts_before_the_special_tokens() {
        let (s, _) = segmenter(1 << 20);
        let mut cuts = s.cuts().to_vec();
        cuts.sort();
        assert_eq!(
            cuts,
            ["<s>", "<|assistant|>", "<|end|>", "<|system|>", "<|user|>"]
        );
        let text = "<s><|user|>\nhi <b><|end|>";
        assert_eq!(s.cut_points(text), [3, 18]);
        assert_eq!(s.cut_points("plain"), Vec::<usize>::new());
    }

    /// The next turn finds its history; the ids are the whole prompt's.
    #[test]
    fn a_growing_chat_finds_its_history() {
        let (s, tokenizer) = segmenter(1 << 20);
        let first = s.encode(&chat(3), &tokenizer).unwrap();
        assert_eq!(first.ids, tokenizer.encode(&chat(3), false).unwrap());
        assert!(
            first.used.tokenized > 0 && !first.used.mismatch,
            "{first:?}"
        );
        let next = s.encode(&chat(4), &tokenizer).unwrap();
        assert_eq!(next.ids, tokenizer.encode(&chat(4), false).unwrap());
        let used = next.used;
        assert_eq!(used.tokenized, 2, "the new question and answer: {used:?}");
        assert!(used.found >= 10, "{used:?}");
    }

    /// The segment ends name the texts before them: two prompts share the keys of the
    /// segments they share and no other, and each end counts the ids before it.
    #[test]
    fn segment_ends_name_what_precedes_them() {
        let (s, tokenizer) = segmenter(1 << 20);
        let three = s.encode(&chat(3), &tokenizer).unwrap();
        let four = s.encode(&chat(4), &tokenizer).unwrap();
        let last = three.ends.last().unwrap();
        assert_eq!(last.tokens, three.ids.len());
        let shared = three
            .ends
            .iter()
            .zip(&four.ends)
            .take_while(|(a, b)| a == b)
            .count();
        // Every segment but the generation prompt `<|assistant|>\n`, answered in the next turn.
        assert_eq!(shared, three.ends.len() - 1, "{:?}", three.ends);
        let end = three.ends[shared - 1];
        assert_eq!(three.ids[..end.tokens], four.ids[..end.tokens]);
    }

    /// Block hashes through the cache are the hashes of the ids, turn after turn, under each
    /// seed; the next turn finds its history's.
    #[test]
    fn cached_block_hashes_are_the_ids_hashes() {
        use kvroute_protocol::hash::token_prefix_hashes;
        let (s, tokenizer) = segmenter(1 << 20);
        let lora = HashSeed::for_request(Some("adapter"), None);
        for turns in 1..12 {
            for seed in [HashSeed::default(), lora] {
                for block_size in [4, 16] {
                    let cut = s.encode(&chat(turns), &tokenizer).unwrap();
                    let want = token_prefix_hashes(&cut.ids, block_size, seed);
                    assert_eq!(s.prefix_hashes(&cut, block_size, seed), want, "{turns}");
                }
            }
        }
        // The next turn: the blocks of its history are kept (up to the generation prompt the
        // last turn ended with), those of its new turn only once it is hashed.
        let cut = s.encode(&chat(12), &tokenizer).unwrap();
        let seed = HashSeed::default();
        let want = token_prefix_hashes(&cut.ids, 4, seed);
        let kept = |end: &SegmentEnd| s.lock().hashes.get(end_key(end.key, 4, seed)).cloned();
        let (history, new) = cut.ends.split_at(cut.ends.len() - 5);
        let found: Vec<PrefixHash> = history.iter().filter_map(kept).flatten().collect();
        assert_eq!(found, want[..history[history.len() - 1].tokens / 4]);
        assert!(new.iter().all(|end| kept(end).is_none()));
        assert_eq!(s.prefix_hashes(&cut, 4, seed), want);
        assert_eq!(
            new.iter().filter_map(kept).flatten().count(),
            want.len() - found.len()
        );
    }

    /// A chat's turns find their history whole, as prompts sharing a history and asking
    /// different questions do: the ids, hashes and segment ends are the ones the prompt has
    /// without it, under each seed and block size, and only the last turn's segments are
    /// looked up one by one.
    #[test]
    fn prompts_find_their_history_whole() {
        use kvroute_protocol::hash::token_prefix_hashes;
        let lora = HashSeed::for_request(Some("adapter"), None);
        for (seed, block_size) in [(HashSeed::default(), 4), (lora, 4), (lora, 16)] {
            let (s, tokenizer) = segmenter(1 << 20);
            let encode = |text: &str| s.encode_hashed(text, &tokenizer, block_size, seed).unwrap();
            let check = |text: &str, (cut, hashes): &(Cut, Vec<PrefixHash>)| {
                let whole = tokenizer.encode(text, false).unwrap();
                assert_eq!(cut.ids, whole[cut.known..]);
                assert_eq!(*hashes, token_prefix_hashes(&whole, block_size, seed));
                assert_eq!(cut.known % block_size, 0);
                assert_eq!(cut.ends, s.encode(text, &tokenizer).unwrap().ends, "ends");
            };
            // The first turn finds no history; the second its first turn's segments one by one
            // and keeps them as a history, which the third finds.
            let turns: Vec<_> = (2..7).map(chat).collect();
            let used: Vec<SegmentUse> = turns
                .iter()
                .map(|text| {
                    let got = encode(text);
                    check(text, &got);
                    got.0.used
                })
                .collect();
            assert_eq!((used[0].history, used[1].history), (0, 0), "{used:?}");
            for (t, used) in used.iter().enumerate().skip(2) {
                // The history: the turn two before, less its generation prompt.
                let history = s.encode(&turns[t - 2], &tokenizer).unwrap().ends.len() - 1;
                assert_eq!(used.history as usize, history, "turn {t}: {used:?}");
                // The question and its answer are new; the history's ids are not at hand.
                assert_eq!(used.tokenized, 2, "turn {t}: {used:?}");
                assert!(encode(&turns[t]).0.known > 0, "turn {t}");
            }
            // One history, a new question each time: the first question keeps the history up to
            // itself, and every later one finds it whole.
            let asked = |q: usize| chat(5) + &format!("<|user|>\nAnd {q}?<|end|>\n<|assistant|>\n");
            let used: Vec<SegmentUse> = (0..3).map(|q| encode(&asked(q)).0.used).collect();
            let segments = s.encode(&asked(0), &tokenizer).unwrap().ends.len() as u32;
            assert!(
                used[1..].iter().all(|u| u.history == segments - 3),
                "{used:?}"
            );
            check(&asked(3), &encode(&asked(3)));
            // Under another block size or seed the history is not found.
            assert_eq!(
                s.encode_hashed(&asked(4), &tokenizer, 8, seed)
                    .unwrap()
                    .0
                    .used
                    .history,
                0
            );
        }
    }

    /// A cut the tokenizer does not make (here inside a word) is caught by the whole-prompt
    /// check: that request gets the whole prompt's ids and the cache is off from then on.
    #[test]
    fn a_cut_that_changes_the_ids_turns_the_cache_off() {
        let (_, tokenizer) = tiny();
        let s = Segmenter {
            cuts: vec!["ing".into()],
            first_bytes: vec![b'i'],
            state: Mutex::new(State::new(1 << 20)),
        };
        let text = "<s>thinking about singing and ringing";
        let whole = tokenizer.encode(text, false).unwrap();
        assert_ne!(s.cut_ids(text, &tokenizer, false).unwrap().ids, whole);
        let cut = s.encode(text, &tokenizer).unwrap();
        assert_eq!(cut.ids, whole);
        assert!(cut.used.mismatch && cut.ends.is_empty(), "{cut:?}");
        let cut = s.encode(text, &tokenizer).unwrap();
        let off = Cut {
            ids: whole,
            ..Cut::default()
        };
        assert_eq!(cut, off, "off");
        let (json, _) = tiny();
        assert!(
            Segmenter::new(&json, &tokenizer, "no special token here", 1 << 20).is_none(),
            "nothing to cut at"
        );
    }
}
