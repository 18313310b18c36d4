//! Reading the usage of a response as it passes, natively: a whole JSON answer of 256 tokens,
//! and a stream of 256 chunks with its usage chunk, fed in the pieces Envoy hands the filter.

use criterion::{criterion_group, criterion_main, Criterion};
use kvroute_filter::usage::UsageScanner;

fn whole_answer() -> Vec<u8> {
    serde_json::json!({"id": "chatcmpl-1", "object": "chat.completion", "model": "m",
        "choices": [{"index": 0, "finish_reason": "length",
            "message": {"role": "assistant", "content": " token".repeat(256)}}],
        "usage": {"prompt_tokens": 8000, "completion_tokens": 256, "total_tokens": 8256,
            "prompt_tokens_details": {"cached_tokens": 7936}}})
    .to_string()
    .into_bytes()
}

/// One piece per chunk, as an engine flushes them.
fn stream_pieces() -> Vec<Vec<u8>> {
    let mut pieces: Vec<Vec<u8>> = (0..256)
        .map(|i| {
            format!(
                "data: {{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\" token{i}\"}},\"finish_reason\":null}}]}}\n\n"
            )
            .into_bytes()
        })
        .collect();
    pieces.push(
        b"data: {\"id\":\"chatcmpl-1\",\"choices\":[],\"usage\":{\"prompt_tokens\":8000,\"completion_tokens\":256,\"prompt_tokens_details\":{\"cached_tokens\":7936}}}\n\ndata: [DONE]\n\n"
            .to_vec(),
    );
    pieces
}

fn bench(c: &mut Criterion) {
    let answer = whole_answer();
    c.bench_function("usage/whole_answer_256_tokens", |b| {
        b.iter(|| {
            let mut s = UsageScanner::default();
            s.feed(std::hint::black_box(&answer));
            s.finish(true)
        })
    });
    let pieces = stream_pieces();
    c.bench_function("usage/stream_256_chunks", |b| {
        b.iter(|| {
            let mut s = UsageScanner::default();
            for p in &pieces {
                s.feed(std::hint::black_box(p));
            }
            s.finish(true)
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
