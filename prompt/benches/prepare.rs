//! Parse + render + tokenize + hash of chat requests of ~1k and ~8k tokens, natively: without
//! the token cache, with it on prompts never seen, and the next turn of an ~8k-token
//! conversation whose history it holds.

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion};
use kvroute_prompt::{model_dir::load_bundle, LlmRequest, Preprocessor};

/// A chat of `words` pseudo-random words (thousands of distinct ones, so the tokenizer's word
/// cache does not make it look cheaper than real text).
fn body(words: usize) -> Vec<u8> {
    serde_json::json!({"model": "tiny-llama", "messages": [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": text(words)}
    ]})
    .to_string()
    .into_bytes()
}

/// A conversation of turns of 300 words each, `words` in all, then a new question numbered `n`.
fn turn(words: usize, n: usize) -> Vec<u8> {
    let history = text(words);
    let history: Vec<&str> = history.split(' ').collect();
    let mut messages =
        vec![serde_json::json!({"role": "system", "content": "You are a careful assistant."})];
    for (i, t) in history.chunks(300).enumerate() {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        messages.push(serde_json::json!({"role": role, "content": t.join(" ")}));
    }
    if messages.len() % 2 == 0 {
        messages.push(serde_json::json!({"role": "assistant", "content": "Understood."}));
    }
    messages
        .push(serde_json::json!({"role": "user", "content": format!("question {n}: and then?")}));
    serde_json::json!({"model": "tiny-llama", "messages": messages})
        .to_string()
        .into_bytes()
}

fn text(words: usize) -> String {
    let (onsets, vowels) = (
        ["b", "c", "d", "f", "g", "l", "m", "n", "p", "r", "s", "t"],
        ["a", "e", "i", "o", "u"],
    );
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = |n: usize| {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) as usize % n
    };
    let text: Vec<String> = (0..words)
        .map(|_| {
            (0..1 + next(3))
                .map(|_| {
                    format!(
                        "{}{}",
                        onsets[next(onsets.len())],
                        vowels[next(vowels.len())]
                    )
                })
                .collect()
        })
        .collect();
    text.join(" ")
}

fn prepare(c: &mut Criterion) {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/models/tiny-llama");
    let bundle = load_bundle(&dir, "tiny-llama", 16).unwrap();
    let pre = Preprocessor::from_bundle(&bundle).unwrap();
    let cached = Preprocessor::from_bundle(&bundle)
        .unwrap()
        .with_token_cache(&bundle, 8 << 20);
    let mut group = c.benchmark_group("prepare");
    for words in [340usize, 2_800] {
        let body = body(words);
        let tokens = pre
            .hashes(&LlmRequest::parse(&body).unwrap())
            .unwrap()
            .tokens
            .len();
        group.bench_with_input(BenchmarkId::new("chat_tokens", tokens), &body, |b, body| {
            b.iter(|| pre.hashes(&LlmRequest::parse(body).unwrap()).unwrap())
        });
        // Every iteration a prompt never seen (its number first), without and with the cache.
        for (name, p) in [("never_seen", &pre), ("never_seen_cached", &cached)] {
            let mut n = 0;
            group.bench_function(BenchmarkId::new(name, tokens), |b| {
                b.iter_batched(
                    || {
                        n += 1;
                        let mut v: serde_json::Value = serde_json::from_slice(&body).unwrap();
                        let text = v["messages"][1]["content"].as_str().unwrap().to_owned();
                        v["messages"][1]["content"] = format!("{n} {text}").into();
                        v.to_string().into_bytes()
                    },
                    |body| p.hashes(&LlmRequest::parse(&body).unwrap()).unwrap(),
                    BatchSize::SmallInput,
                )
            });
        }
    }
    // The next turn of an ~8k-token conversation: the history is in the cache, the question
    // is new every iteration.
    let words = 2_800;
    let tokens = pre
        .hashes(&LlmRequest::parse(&turn(words, 0)).unwrap())
        .unwrap()
        .tokens
        .len();
    // Where the cached turn's time goes: parsing the body, then rendering the template too.
    let body = turn(words, 1);
    group.bench_function(BenchmarkId::new("next_turn_parse", tokens), |b| {
        b.iter(|| LlmRequest::parse(&body).unwrap())
    });
    group.bench_function(BenchmarkId::new("next_turn_parse_render", tokens), |b| {
        b.iter(|| pre.render(&LlmRequest::parse(&body).unwrap()).unwrap())
    });
    for (name, p) in [("next_turn", &pre), ("next_turn_cached", &cached)] {
        let mut n = 0;
        group.bench_function(BenchmarkId::new(name, tokens), |b| {
            b.iter_batched(
                || {
                    n += 1;
                    turn(words, n)
                },
                |body| p.hashes(&LlmRequest::parse(&body).unwrap()).unwrap(),
                BatchSize::SmallInput,
            )
        });
    }
    group.finish();
}

criterion_group!(benches, prepare);
criterion_main!(benches);
