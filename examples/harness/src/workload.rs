//! Deterministic workloads as [`Session`]s: requests that run in order, sessions in parallel.
//!
//! [`ChatWorkload`]: multi-turn conversations behind shared system prompts.
//! Several "apps" each have a system prompt; many users hold multi-turn conversations with one
//! app. Each turn re-sends the whole history, so turn k+1 extends turn k's prompt — the prefix an
//! engine can reuse if the turn lands where the previous one ran. System prompts of different
//! lengths matter: a short one leaves the conversation's own text inside the first blocks
//! (a fallback hash key can tell conversations apart), a long one does not.

use serde_json::{json, Value};

/// Requests that must run one after the other (the turns of a conversation, the steps of an
/// agent); different sessions run concurrently.
#[derive(Debug, Clone)]
pub struct Session {
    /// API path, e.g. `/v1/chat/completions`.
    pub path: &'static str,
    /// Request bodies, in order.
    pub bodies: Vec<Value>,
}

/// Path of chat requests.
pub const CHAT: &str = "/v1/chat/completions";
/// Path of completion requests.
pub const COMPLETIONS: &str = "/v1/completions";

/// Short chat requests a fleet serves before it is measured (`n` sessions of one request).
///
/// Every mode then starts warm — client, proxy and engine connections open, every code path
/// run once — as a proxy in service is, and the benchmark compares routing rather than start-up
/// costs. Each prompt is one user turn that starts with its own number, so its first block
/// matches no other warm-up request and no workload prompt (those start with a system turn or
/// token ids); the engines keep at most two blocks per warm-up request.
pub fn warm_up_sessions(model: &str, n: usize) -> Vec<Session> {
    (0..n)
        .map(|i| Session {
            path: CHAT,
            bodies: vec![json!({
                "model": model,
                "messages": [{"role": "user", "content": format!("{i} warm-up request")}],
                "max_tokens": 1,
            })],
        })
        .collect()
}

/// A small deterministic PRNG (SplitMix64): same seed, same workload, on every machine.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// Seeded generator.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next_u64() % (hi - lo + 1) as u64) as usize
    }
}

const WORDS: &[&str] = &[
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "cache",
    "prefix",
    "routing",
    "model",
    "token",
    "block",
    "worker",
    "router",
    "hello",
    "world",
    "please",
    "explain",
    "what",
    "means",
    "in",
    "one",
    "sentence",
    "tell",
    "me",
    "about",
    "kv",
    "blocks",
    "you",
    "are",
    "a",
    "helpful",
    "assistant",
    "system",
    "user",
    "request",
    "latency",
    "memory",
    "engine",
    "prompt",
    "answer",
    "question",
    "data",
    "fleet",
    "replica",
    "load",
    "balance",
    "hash",
    "ring",
    "mesh",
    "proxy",
    "envoy",
    "filter",
    "sidecar",
    "index",
    "event",
    "stream",
    "server",
    "client",
    "time",
    "first",
    "second",
    "third",
    "again",
    "never",
    "always",
    "often",
    "with",
    "without",
    "before",
    "after",
    "under",
    "above",
    "between",
    "simple",
    "careful",
    "short",
    "long",
    "fast",
    "slow",
    "good",
    "better",
    "best",
    "small",
    "large",
    "many",
    "few",
    "every",
    "some",
    "other",
    "same",
    "write",
    "read",
    "send",
    "keep",
    "find",
    "make",
    "take",
    "give",
    "show",
    "use",
    "work",
    "run",
];

/// `n` words from a fixed vocabulary every test tokenizer knows.
pub fn words(rng: &mut Rng, n: usize) -> String {
    let mut out = String::new();
    for i in 0..n {
        if i > 0 {
            out.push(' ');
        }
        out.push_str(WORDS[(rng.next_u64() % WORDS.len() as u64) as usize]);
    }
    out
}

/// Shape of a multi-turn chat workload.
#[derive(Debug, Clone)]
pub struct ChatSpec {
    /// Seed of the generator.
    pub seed: u64,
    /// Length in words of each app's system prompt (one app per entry).
    pub system_prompt_words: Vec<usize>,
    /// Conversations (users); conversation i talks to app i mod apps.
    pub conversations: usize,
    /// Turns per conversation.
    pub turns: usize,
    /// Words per user message, min and max.
    pub user_words: (usize, usize),
    /// Words per assistant reply carried in the history, min and max.
    pub reply_words: (usize, usize),
    /// `max_tokens` of each request.
    pub max_tokens: u32,
    /// When set, this share of conversations uses app 0 (a hot prefix); the rest pick among the
    /// other apps at random. Unset: conversation i uses app i mod apps.
    pub hot_share: Option<f64>,
}

impl ChatSpec {
    /// The demo's workload: four apps (two short system prompts, two long ones), 64 users,
    /// four turns each.
    pub fn demo() -> Self {
        ChatSpec {
            seed: 42,
            system_prompt_words: vec![20, 40, 180, 300],
            conversations: 64,
            turns: 4,
            user_words: (20, 50),
            reply_words: (15, 40),
            max_tokens: 8,
            hot_share: None,
        }
    }

    /// Many users behind one long system prompt, two turns each.
    pub fn system_prompt() -> Self {
        ChatSpec {
            seed: 7,
            system_prompt_words: vec![400],
            conversations: 96,
            turns: 2,
            ..ChatSpec::demo()
        }
    }

    /// Agents re-sending a growing trace: a shared tool preamble, long tool outputs per step.
    pub fn agent_loop() -> Self {
        ChatSpec {
            seed: 11,
            system_prompt_words: vec![150, 150],
            conversations: 24,
            turns: 8,
            user_words: (60, 120),
            reply_words: (10, 20),
            ..ChatSpec::demo()
        }
    }

    /// One prefix behind 85% of single-turn requests, the rest spread over 16 other prefixes.
    pub fn hot_prefix() -> Self {
        ChatSpec {
            seed: 13,
            system_prompt_words: vec![250; 17],
            conversations: 160,
            turns: 1,
            hot_share: Some(0.85),
            ..ChatSpec::demo()
        }
    }
}

/// One user's conversation.
#[derive(Debug, Clone)]
pub struct Conversation {
    /// Which system prompt.
    pub app: usize,
    /// The user's messages, one per turn.
    pub user_turns: Vec<String>,
    /// The assistant's replies, as the client keeps them in the history.
    pub replies: Vec<String>,
}

/// A generated chat workload.
#[derive(Debug, Clone)]
pub struct ChatWorkload {
    /// System prompt of each app.
    pub system_prompts: Vec<String>,
    /// The conversations.
    pub conversations: Vec<Conversation>,
    /// `max_tokens` of each request.
    pub max_tokens: u32,
}

impl ChatWorkload {
    /// Generate from a spec (deterministic).
    pub fn generate(spec: &ChatSpec) -> Self {
        let mut rng = Rng::new(spec.seed);
        let system_prompts = spec
            .system_prompt_words
            .iter()
            .map(|&n| words(&mut rng, n))
            .collect::<Vec<_>>();
        let apps = system_prompts.len().max(1);
        let conversations = (0..spec.conversations)
            .map(|i| {
                let app = match spec.hot_share {
                    Some(p) if apps > 1 => {
                        if (rng.next_u64() % 10_000) as f64 / 10_000.0 < p {
                            0
                        } else {
                            rng.range(1, apps - 1)
                        }
                    }
                    _ => i % apps,
                };
                let mut turn = |(lo, hi): (usize, usize)| {
                    let n = rng.range(lo, hi);
                    words(&mut rng, n)
                };
                let user_turns = (0..spec.turns).map(|_| turn(spec.user_words)).collect();
                let replies = (0..spec.turns).map(|_| turn(spec.reply_words)).collect();
                Conversation {
                    app,
                    user_turns,
                    replies,
                }
            })
            .collect();
        ChatWorkload {
            system_prompts,
            conversations,
            max_tokens: spec.max_tokens,
        }
    }

    /// Total requests (conversations × turns).
    pub fn requests(&self) -> usize {
        self.conversations.iter().map(|c| c.user_turns.len()).sum()
    }

    /// One session per conversation.
    pub fn sessions(&self, model: &str) -> Vec<Session> {
        (0..self.conversations.len())
            .map(|c| Session {
                path: CHAT,
                bodies: (0..self.conversations[c].user_turns.len())
                    .map(|t| self.body(model, c, t))
                    .collect(),
            })
            .collect()
    }

    /// The chat request of conversation `conv` at `turn` (0-based), for `model`.
    pub fn body(&self, model: &str, conv: usize, turn: usize) -> Value {
        let c = &self.conversations[conv];
        let mut messages = vec![json!({"role": "system", "content": self.system_prompts[c.app]})];
        for t in 0..turn {
            messages.push(json!({"role": "user", "content": c.user_turns[t]}));
            messages.push(json!({"role": "assistant", "content": c.replies[t]}));
        }
        messages.push(json!({"role": "user", "content": c.user_turns[turn]}));
        json!({"model": model, "messages": messages, "max_tokens": self.max_tokens})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warm_up_requests_are_distinct_chats() {
        let sessions = warm_up_sessions("m", 3);
        let bodies: Vec<&Value> = sessions.iter().map(|s| &s.bodies[0]).collect();
        assert_eq!(bodies.len(), 3);
        assert_ne!(bodies[0]["messages"], bodies[1]["messages"]);
        assert!(sessions.iter().all(|s| s.path == CHAT));
        assert_eq!(bodies[2]["model"], "m");
    }

    #[test]
    fn deterministic_and_growing() {
        let spec = ChatSpec::demo();
        let a = ChatWorkload::generate(&spec);
        let b = ChatWorkload::generate(&spec);
        assert_eq!(a.body("m", 3, 2), b.body("m", 3, 2));
        assert_eq!(a.requests(), 256);
        let t0 = a.body("m", 5, 0)["messages"].as_array().unwrap().len();
        let t2 = a.body("m", 5, 2)["messages"].as_array().unwrap().len();
        assert_eq!((t0, t2), (2, 6));
        assert_eq!(a.conversations[5].app, 1);
    }
}
