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

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use xxhash_rust::xxh3::xxh3_128;

use crate::tokenizer::{Tokenizer, TokenizerError};

/// One request cut into segments in this many is also tokenized whole and compared.
pub const CHECK_EVERY: u64 = 64;

/// Bytes an entry costs beyond its ids: its key, its place in the clock, the map's slot.
const ENTRY_OVERHEAD: usize = 64;

/// What the cache did for one prompt.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SegmentUse {
    /// Segments found.
    pub found: u32,
    /// Segments tokenized (and kept, unless larger than a quarter of the budget).
    pub tokenized: u32,
    /// The prompt was also tokenized whole to check the cut, and the two differed: the cache is
    /// off from now on, and the whole prompt's ids were used.
    pub mismatch: bool,
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
    map: HashMap<u128, Entry>,
    /// Insertion order, for the clock: an entry used since it was last passed gets another
    /// round.
    clock: VecDeque<u128>,
    budget: usize,
    bytes: usize,
    requests: u64,
    off: bool,
}

struct Entry {
    ids: Box<[u32]>,
    used: bool,
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
            state: Mutex::new(State {
                map: HashMap::new(),
                clock: VecDeque::new(),
                budget,
                bytes: 0,
                requests: 0,
                off: false,
            }),
        };
        let whole = tokenizer.encode(sample, false).ok()?;
        let cut = segmenter.cut_ids(sample, tokenizer, None).ok()?;
        (whole == cut).then_some(segmenter)
    }

    /// The special tokens prompts are cut before.
    pub fn cuts(&self) -> &[String] {
        &self.cuts
    }

    /// Token ids of `text` without the post-processor's special tokens, as
    /// `tokenizer.encode(text, false)` would give them, and what the cache did.
    pub fn encode(
        &self,
        text: &str,
        tokenizer: &Tokenizer,
    ) -> Result<(Vec<u32>, SegmentUse), TokenizerError> {
        let mut used = SegmentUse::default();
        let check = {
            let mut state = self.lock();
            if state.off {
                drop(state);
                return Ok((tokenizer.encode(text, false)?, used));
            }
            state.requests += 1;
            state.requests % CHECK_EVERY == 1
        };
        let ids = self.cut_ids(text, tokenizer, Some(&mut used))?;
        if !check {
            return Ok((ids, used));
        }
        let whole = tokenizer.encode(text, false)?;
        if whole != ids {
            used.mismatch = true;
            let mut state = self.lock();
            state.off = true;
            state.map.clear();
            state.clock.clear();
            state.bytes = 0;
        }
        Ok((whole, used))
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

    /// The ids of `text` segment by segment, looked up (and kept) when `used` counts what the
    /// cache did.
    fn cut_ids(
        &self,
        text: &str,
        tokenizer: &Tokenizer,
        mut used: Option<&mut SegmentUse>,
    ) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = Vec::with_capacity(text.len() / 3);
        let mut from = 0;
        let points = self.cut_points(text);
        for to in points.into_iter().chain([text.len()]) {
            let segment = &text[from..to];
            from = to;
            if segment.is_empty() {
                continue;
            }
            let Some(used) = used.as_deref_mut() else {
                ids.extend(tokenizer.encode(segment, false)?);
                continue;
            };
            let key = xxh3_128(segment.as_bytes());
            if self.lock().get(key, &mut ids) {
                used.found += 1;
                continue;
            }
            let new = tokenizer.encode(segment, false)?;
            used.tokenized += 1;
            ids.extend_from_slice(&new);
            self.lock().put(key, new);
        }
        Ok(ids)
    }

    /// The lock is only ever held for a lookup or an insert, never across tokenizing: the
    /// filter's VM is single-threaded, and natively a caller sharing a preprocessor between
    /// threads waits for a map operation at most.
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl State {
    /// Append the ids of segment `key` to `out`, if known.
    fn get(&mut self, key: u128, out: &mut Vec<u32>) -> bool {
        let Some(entry) = self.map.get_mut(&key) else {
            return false;
        };
        entry.used = true;
        out.extend_from_slice(&entry.ids);
        true
    }

    /// Keep the ids of segment `key`, dropping entries not used since the clock last passed
    /// them until it fits.
    fn put(&mut self, key: u128, ids: Vec<u32>) {
        let size = ids.len() * 4 + ENTRY_OVERHEAD;
        if size > self.budget / 4 || self.map.contains_key(&key) {
            return;
        }
        while self.bytes + size > self.budget {
            let Some(old) = self.clock.pop_front() else {
                break;
            };
            match self.map.get_mut(&old) {
                Some(e) if e.used => {
                    e.used = false;
                    self.clock.push_back(old);
                }
                Some(_) => {
                    if let Some(e) = self.map.remove(&old) {
                        self.bytes -= e.ids.len() * 4 + ENTRY_OVERHEAD;
                    }
                }
                None => {}
            }
        }
        self.bytes += size;
        self.clock.push_back(key);
        self.map.insert(
            key,
            Entry {
                ids: ids.into_boxed_slice(),
                used: false,
            },
        );
    }
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
        let (first, used) = s.encode(&chat(3), &tokenizer).unwrap();
        assert_eq!(first, tokenizer.encode(&chat(3), false).unwrap());
        assert!(used.tokenized > 0 && !used.mismatch, "{used:?}");
        let (next, used) = s.encode(&chat(4), &tokenizer).unwrap();
        assert_eq!(next, tokenizer.encode(&chat(4), false).unwrap());
        assert_eq!(used.tokenized, 2, "the new question and answer: {used:?}");
        assert!(used.found >= 10, "{used:?}");
    }

    /// Within its budget: an entry used since the clock last passed stays, one not used goes.
    #[test]
    fn stays_within_its_budget_keeping_what_is_used() {
        let mut state = State {
            map: HashMap::new(),
            clock: VecDeque::new(),
            budget: 4 * (ENTRY_OVERHEAD + 40),
            bytes: 0,
            requests: 0,
            off: false,
        };
        let ids = || vec![7u32; 10];
        for key in 1..=4 {
            state.put(key, ids());
        }
        let mut out = Vec::new();
        assert!(state.get(1, &mut out));
        state.put(5, ids());
        assert!(state.bytes <= state.budget);
        assert!(state.map.contains_key(&1), "used: kept");
        assert!(!state.map.contains_key(&2), "the oldest unused: dropped");
        state.put(6, vec![0; state.budget]);
        assert!(
            !state.map.contains_key(&6),
            "larger than a quarter: not kept"
        );
    }

    /// A cut the tokenizer does not make (here inside a word) is caught by the whole-prompt
    /// check: that request gets the whole prompt's ids and the cache is off from then on.
    #[test]
    fn a_cut_that_changes_the_ids_turns_the_cache_off() {
        let (_, tokenizer) = tiny();
        let s = Segmenter {
            cuts: vec!["ing".into()],
            first_bytes: vec![b'i'],
            state: Mutex::new(State {
                map: HashMap::new(),
                clock: VecDeque::new(),
                budget: 1 << 20,
                bytes: 0,
                requests: 0,
                off: false,
            }),
        };
        let text = "<s>thinking about singing and ringing";
        let whole = tokenizer.encode(text, false).unwrap();
        assert_ne!(s.cut_ids(text, &tokenizer, None).unwrap(), whole);
        let (ids, used) = s.encode(text, &tokenizer).unwrap();
        assert_eq!(ids, whole);
        assert!(used.mismatch);
        let (ids, used) = s.encode(text, &tokenizer).unwrap();
        assert_eq!((ids, used), (whole, SegmentUse::default()), "off");
        let (json, _) = tiny();
        assert!(
            Segmenter::new(&json, &tokenizer, "no special token here", 1 << 20).is_none(),
            "nothing to cut at"
        );
    }
}
