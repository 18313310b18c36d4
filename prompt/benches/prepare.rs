//! Parse + render + tokenize + hash of chat requests of ~1k and ~8k tokens, natively.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvroute_prompt::{model_dir::load_bundle, LlmRequest, Preprocessor};

/// A chat of `words` pseudo-random words (thousands of distinct ones, so the tokenizer's word
/// cache does not make it look cheaper than real text).
fn body(words: usize) -> Vec<u8> {
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
    serde_json::json!({"model": "tiny-llama", "messages": [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": text.join(" ")}
    ]})
    .to_string()
    .into_bytes()
}

fn prepare(c: &mut Criterion) {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/models/tiny-llama");
    let pre = Preprocessor::from_bundle(&load_bundle(&dir, "tiny-llama", 16).unwrap()).unwrap();
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
    }
    group.finish();
}

criterion_group!(benches, prepare);
criterion_main!(benches);
