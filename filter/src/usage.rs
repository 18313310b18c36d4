//! What the engine said about a hinted request's prompt, read from its response as it passes:
//! the last `"usage": {…}` object of a JSON body or of a server-sent event stream (an engine
//! sends one in its final chunk when the client asked with `stream_options.include_usage`, or
//! one per chunk with cumulative counts). The response is never buffered nor changed: the
//! scanner sees each piece once and keeps at most one usage object ([`MAX_USAGE_BYTES`]).
//!
//! Only a key can match: inside a JSON string a quote is escaped, so `"usage"` followed by `:`
//! never occurs in generated text.

use kvroute_protocol::hint::Usage;
use serde::Deserialize;

/// A usage object longer than this is not one an engine writes: it counts as malformed.
pub const MAX_USAGE_BYTES: usize = 1024;

const KEY: &[u8] = b"\"usage\"";

/// Reads one response, piece by piece.
#[derive(Debug, Default)]
pub struct UsageScanner {
    state: State,
    found: Option<Usage>,
    /// The last byte of the previous piece: a key's opening quote may end one piece.
    last: u8,
}

#[derive(Debug)]
enum State {
    /// Looking for the key; this many of its bytes matched so far.
    Key(usize),
    /// After the key: whitespace, then a colon.
    Colon,
    /// After the colon: whitespace, then the object (anything else: not a usage object).
    Value,
    /// Inside the object, copied so far.
    Object {
        buf: Vec<u8>,
        depth: u32,
        in_string: bool,
        escaped: bool,
    },
}

impl Default for State {
    fn default() -> Self {
        State::Key(0)
    }
}

#[derive(Deserialize)]
struct RawUsage {
    prompt_tokens: Option<u64>,
    prompt_tokens_details: Option<RawDetails>,
}

#[derive(Deserialize)]
struct RawDetails {
    cached_tokens: Option<u64>,
}

impl UsageScanner {
    /// Read the next piece of the response body.
    pub fn feed(&mut self, piece: &[u8]) {
        let mut i = 0;
        while i < piece.len() {
            let b = piece[i];
            match &mut self.state {
                State::Key(0) => {
                    // Most of a response is text between keys: skip to the next `u` that
                    // follows a quote (rarer than quotes: a stream's chunks have dozens).
                    let Some(at) = piece[i..].iter().position(|&c| c == b'u') else {
                        break;
                    };
                    let u = i + at;
                    let before = if u == 0 { self.last } else { piece[u - 1] };
                    if before == b'"' {
                        self.state = State::Key(2);
                    }
                    i = u + 1;
                    continue;
                }
                State::Key(matched) => {
                    if b == KEY[*matched] {
                        *matched += 1;
                        if *matched == KEY.len() {
                            self.state = State::Colon;
                        }
                    } else {
                        *matched = usize::from(b == b'"');
                    }
                }
                State::Colon => {
                    if b == b':' {
                        self.state = State::Value;
                    } else if !b.is_ascii_whitespace() {
                        // A string value "usage", not a key: read this byte afresh.
                        self.state = State::Key(0);
                        continue;
                    }
                }
                State::Value => {
                    if b == b'{' {
                        self.state = State::Object {
                            buf: vec![b],
                            depth: 1,
                            in_string: false,
                            escaped: false,
                        };
                    } else if !b.is_ascii_whitespace() {
                        // `"usage": null` (an engine's chunk before the last), or not an object.
                        self.state = State::Key(0);
                        continue;
                    }
                }
                State::Object {
                    buf,
                    depth,
                    in_string,
                    escaped,
                } => {
                    if buf.len() >= MAX_USAGE_BYTES {
                        self.found = Some(Usage::Malformed);
                        self.state = State::Key(0);
                        continue;
                    }
                    buf.push(b);
                    if *in_string {
                        if *escaped {
                            *escaped = false;
                        } else if b == b'\\' {
                            *escaped = true;
                        } else if b == b'"' {
                            *in_string = false;
                        }
                    } else if b == b'"' {
                        *in_string = true;
                    } else if b == b'{' {
                        *depth += 1;
                    } else if b == b'}' {
                        *depth -= 1;
                        if *depth == 0 {
                            self.found = Some(read_usage(buf));
                            self.state = State::Key(0);
                        }
                    }
                }
            }
            i += 1;
        }
        if let Some(&b) = piece.last() {
            self.last = b;
        }
    }

    /// The usage of a response that `answered` (a success status, seen to its end) or not. A
    /// usage read whole is kept either way: it is the engine's account of the prefill, which
    /// was done, and a client that closes at a stream's `data: [DONE]` ends the response before
    /// Envoy sees the upstream's end (flag `DC`), right after the usage went by.
    pub fn finish(self, answered: bool) -> Usage {
        let whole = |u: &Usage| matches!(u, Usage::Cached { .. } | Usage::PromptOnly { .. });
        if !answered {
            return match (self.found, self.state) {
                (Some(usage), state) if whole(&usage) && !matches!(state, State::Object { .. }) => {
                    usage
                }
                _ => Usage::Unanswered,
            };
        }
        match (self.found, self.state) {
            (_, State::Object { .. }) => Usage::Malformed,
            (Some(usage), _) => usage,
            (None, _) => Usage::Missing,
        }
    }
}

/// What the filter does with a hinted request's response, decided at its headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reading {
    /// Scan the body for its usage.
    Read,
    /// Left unread by choice (reading is off, or a stream outside the sample): `Usage::Unread`.
    Unread,
    /// Not a success, so no usage to read: `Usage::Unanswered`.
    Failed,
}

/// Which of a VM's successful streams are read: one in `every`, and besides, at low traffic,
/// at least one each `1 / min_per_s` seconds. Reading a stream costs a host call per chunk, so
/// a busy VM reads a sample; the alarms that compare each replica's predictions with what its
/// engines report need a few dozen streams a minute, which a quiet VM's sample of one in 32
/// would not give them — and a quiet VM has the CPU to read them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamRule {
    /// One in this many (1: every one).
    pub every: u32,
    /// At least this many a second, when there are (0: the count alone).
    pub min_per_s: u32,
}

/// A VM's successful streams so far, for [`StreamRule`].
#[derive(Debug, Default, Clone, Copy)]
pub struct StreamSample {
    seen: u64,
    last_read_ms: Option<u64>,
}

/// How to read a hinted response. Its `:status` is asked for only when reading is on and its
/// `content_type` only when the answer is a success, as each costs a host call; a successful
/// stream is counted in `sample`, the clock (`now_ms`) asked for it when the rule has a rate,
/// and read as the rule says.
pub fn reading(
    read_usage: bool,
    rule: StreamRule,
    status: impl FnOnce() -> Option<String>,
    content_type: impl FnOnce() -> Option<String>,
    now_ms: impl FnOnce() -> Option<u64>,
    sample: &mut StreamSample,
) -> Reading {
    if !read_usage {
        return Reading::Unread;
    }
    if !worth_scanning(status().as_deref()) {
        return Reading::Failed;
    }
    if !is_stream(content_type().as_deref()) {
        return Reading::Read;
    }
    let nth = sample.seen;
    sample.seen += 1;
    let now = if rule.min_per_s > 0 { now_ms() } else { None };
    let due = |last: Option<u64>| match (now, last) {
        (Some(_), None) => true,
        (Some(now), Some(last)) => {
            now.saturating_sub(last) >= 1000 / u64::from(rule.min_per_s.max(1))
        }
        (None, _) => false,
    };
    if sampled(nth, rule.every) || due(sample.last_read_ms) {
        if now.is_some() {
            sample.last_read_ms = now;
        }
        Reading::Read
    } else {
        Reading::Unread
    }
}

/// Whether a response with this `:status` is read at all: only a success carries a usage.
fn worth_scanning(status: Option<&str>) -> bool {
    status.is_some_and(|s| s.len() == 3 && s.starts_with('2'))
}

/// Whether a response with this `content-type` streams (server-sent events).
fn is_stream(content_type: Option<&str>) -> bool {
    content_type.is_some_and(|c| {
        c.trim_start()
            .get(..17)
            .is_some_and(|t| t.eq_ignore_ascii_case("text/event-stream"))
    })
}

/// Whether to read the usage of a hinted stream, the VM's `streams`-th (from 0): one in
/// `every`, so that the per-chunk cost of reading is spread over that many streams.
fn sampled(streams: u64, every: u32) -> bool {
    streams.is_multiple_of(u64::from(every.max(1)))
}

fn read_usage(object: &[u8]) -> Usage {
    let Ok(raw) = serde_json::from_slice::<RawUsage>(object) else {
        return Usage::Malformed;
    };
    let Some(prompt_tokens) = raw.prompt_tokens.and_then(|p| u32::try_from(p).ok()) else {
        return Usage::Malformed;
    };
    match raw.prompt_tokens_details.and_then(|d| d.cached_tokens) {
        None => Usage::PromptOnly { prompt_tokens },
        Some(cached) if cached <= u64::from(prompt_tokens) => Usage::Cached {
            prompt_tokens,
            cached_tokens: cached as u32,
        },
        Some(_) => Usage::Malformed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan_in_pieces(body: &[u8], piece: usize) -> Usage {
        let mut s = UsageScanner::default();
        for chunk in body.chunks(piece.max(1)) {
            s.feed(chunk);
        }
        s.finish(true)
    }

    fn cached(prompt_tokens: u32, cached_tokens: u32) -> Usage {
        Usage::Cached {
            prompt_tokens,
            cached_tokens,
        }
    }

    #[test]
    fn reads_a_json_body_split_anywhere() {
        let body = br#"{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"the \"usage\": {\"prompt_tokens\": 1} of it"}}],"usage" : {"prompt_tokens":130,"completion_tokens":4,"total_tokens":134,"prompt_tokens_details":{"cached_tokens":112}}}"#;
        for piece in 1..body.len() + 1 {
            assert_eq!(
                scan_in_pieces(body, piece),
                cached(130, 112),
                "pieces of {piece}"
            );
        }
    }

    #[test]
    fn reads_the_last_usage_of_a_stream() {
        let stream = concat!(
            "data: {\"choices\":[{\"delta\":{\"content\":\"usage\"}}],\"usage\":null}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\" x\"}}],\"usage\":{\"prompt_tokens\":40,\"prompt_tokens_details\":{\"cached_tokens\":0}}}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\n",
            "data: [DONE]\n\n"
        );
        for piece in [1, 7, 64, 4096] {
            assert_eq!(scan_in_pieces(stream.as_bytes(), piece), cached(40, 32));
        }
    }

    #[test]
    fn tells_what_is_missing() {
        assert_eq!(
            scan_in_pieces(b"data: {\"choices\":[]}\n\ndata: [DONE]\n\n", 5),
            Usage::Missing
        );
        assert_eq!(scan_in_pieces(b"", 1), Usage::Missing);
        assert_eq!(
            scan_in_pieces(
                br#"{"usage":{"prompt_tokens":9,"prompt_tokens_details":null}}"#,
                3
            ),
            Usage::PromptOnly { prompt_tokens: 9 }
        );
        assert_eq!(
            scan_in_pieces(br#"{"usage":{"prompt_tokens":9}}"#, 3),
            Usage::PromptOnly { prompt_tokens: 9 }
        );
        for malformed in [
            &br#"{"usage":{"completion_tokens":9}}"#[..],
            br#"{"usage":{"prompt_tokens":"many"}}"#,
            br#"{"usage":{"prompt_tokens":4,"prompt_tokens_details":{"cached_tokens":8}}}"#,
            br#"{"usage":{"prompt_tokens":99999999999}}"#,
            br#"{"usage":{"prompt_tokens":4,"#,
        ] {
            assert_eq!(
                scan_in_pieces(malformed, 2),
                Usage::Malformed,
                "{}",
                String::from_utf8_lossy(malformed)
            );
        }
        let mut long = br#"{"usage":{"x":""#.to_vec();
        long.extend(std::iter::repeat_n(b'a', MAX_USAGE_BYTES));
        long.extend_from_slice(br#"","prompt_tokens":1}}"#);
        assert_eq!(scan_in_pieces(&long, 100), Usage::Malformed);
        // A stream the client closed at `[DONE]`: its usage went by, and is kept.
        let mut s = UsageScanner::default();
        s.feed(b"data: {\"usage\":{\"prompt_tokens\":1}}\n\ndata: [DONE]\n\n");
        assert_eq!(
            s.finish(false),
            Usage::PromptOnly { prompt_tokens: 1 },
            "closed at [DONE]"
        );
        // Closed before a whole usage went by: unanswered.
        let mut s = UsageScanner::default();
        s.feed(br#"data: {"usage":{"prompt_tokens":1"#);
        assert_eq!(s.finish(false), Usage::Unanswered, "cut in its usage");
        let s = UsageScanner::default();
        assert_eq!(s.finish(false), Usage::Unanswered, "nothing went by");
    }

    #[test]
    fn a_value_named_usage_is_not_a_key() {
        let body = br#"{"object":"usage","kind": "usage" , "usage":{"prompt_tokens":3,"prompt_tokens_details":{"cached_tokens":0}}}"#;
        assert_eq!(scan_in_pieces(body, 4), cached(3, 0));
        assert_eq!(scan_in_pieces(br#"{"a":"usage"}"#, 1), Usage::Missing);
    }

    #[test]
    fn only_successes_are_read() {
        assert!(worth_scanning(Some("200")));
        assert!(worth_scanning(Some("206")));
        for s in [None, Some("400"), Some("503"), Some("2"), Some("2000")] {
            assert!(!worth_scanning(s), "{s:?}");
        }
    }

    #[test]
    fn one_stream_in_every_is_read() {
        assert!(is_stream(Some("text/event-stream")));
        assert!(is_stream(Some("Text/Event-Stream; charset=utf-8")));
        for c in [None, Some("application/json"), Some("text/event"), Some("")] {
            assert!(!is_stream(c), "{c:?}");
        }
        let read = (0..64).filter(|&n| sampled(n, 32)).count();
        assert_eq!(read, 2);
        assert!(sampled(0, 32), "the first stream is read");
        assert!((0..5).all(|n| sampled(n, 1)));
    }

    #[test]
    fn a_response_is_read_when_it_is_a_success_and_in_the_sample() {
        let sse = || Some("text/event-stream".to_string());
        let json = || Some("application/json".to_string());
        let mut sample = StreamSample::default();
        let rule = StreamRule {
            every: 2,
            min_per_s: 0,
        };
        let mut read = |on, status: &str, content_type: &dyn Fn() -> Option<String>| {
            reading(
                on,
                rule,
                || Some(status.to_string()),
                content_type,
                || unreachable!("no rate: no clock"),
                &mut sample,
            )
        };
        assert_eq!(read(false, "200", &json), Reading::Unread);
        assert_eq!(read(true, "503", &sse), Reading::Failed);
        assert_eq!(read(true, "200", &json), Reading::Read);
        assert_eq!(read(true, "200", &sse), Reading::Read);
        assert_eq!(read(true, "200", &sse), Reading::Unread);
        assert_eq!(
            read(true, "200", &json),
            Reading::Read,
            "JSON is always read"
        );
        assert_eq!(read(true, "200", &sse), Reading::Read);
        assert_eq!(sample.seen, 3, "only successful streams are counted");
        let mut untouched = StreamSample::default();
        let asked = std::cell::Cell::new(false);
        let one = StreamRule {
            every: 1,
            min_per_s: 4,
        };
        let status = reading(
            true,
            one,
            || Some("404".to_string()),
            || {
                asked.set(true);
                None
            },
            || {
                asked.set(true);
                None
            },
            &mut untouched,
        );
        assert_eq!(status, Reading::Failed);
        assert!(
            !asked.get(),
            "a failure's content type and time are not asked for"
        );
        let off = reading(
            false,
            one,
            || {
                asked.set(true);
                None
            },
            || None,
            || None,
            &mut untouched,
        );
        assert_eq!(off, Reading::Unread);
        assert!(!asked.get(), "with reading off, no header is asked for");
    }

    /// One in 32 by count, and at least four a second: a quiet VM reads every stream, a busy
    /// one a little more than one in 32.
    #[test]
    fn a_quiet_vm_reads_every_stream_a_busy_one_a_sample() {
        let rule = StreamRule {
            every: 32,
            min_per_s: 4,
        };
        let run = |gap_ms: u64, streams: u64| {
            let mut sample = StreamSample::default();
            (0..streams)
                .filter(|&i| {
                    let r = reading(
                        true,
                        rule,
                        || Some("200".into()),
                        || Some("text/event-stream".into()),
                        || Some(1_000_000 + i * gap_ms),
                        &mut sample,
                    );
                    r == Reading::Read
                })
                .count()
        };
        assert_eq!(run(1_000, 100), 100, "one a second: every one");
        assert_eq!(run(250, 100), 100, "four a second: every one");
        // 1,000 a second for 3.2 s: 100 by count, 4 a second besides.
        let busy = run(1, 3_200);
        assert!((100..=114).contains(&busy), "{busy}");
    }
}
