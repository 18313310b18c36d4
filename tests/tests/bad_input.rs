//! Bad input never makes the filter fail a request: every status below comes from the engine.

mod common;

use common::*;
use kvroute_harness::{Mode, Stack, StackOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_served_or_rejected_by_the_engine_never_by_the_filter() {
    let stack = Stack::start(StackOptions::new("bad-input", Mode::Kvroute))
        .await
        .expect("stack starts");
    let base = &stack.envoy_url;
    let chat_url = format!("{base}/v1/chat/completions");
    let ten_mb = {
        let big = "x".repeat(10 << 20);
        serde_json::json!({"model": "tiny-llama", "messages": [{"role": "user", "content": big}]})
            .to_string()
    };
    let mut cases: Vec<(&str, reqwest::RequestBuilder, u16)> = vec![
        (
            "invalid JSON",
            stack.http.post(&chat_url).body("{not json"),
            400,
        ),
        (
            "JSON labelled as text",
            stack
                .http
                .post(&chat_url)
                .header("content-type", "text/plain")
                .body(chat("be brief", "hi").to_string()),
            200,
        ),
        (
            "empty messages",
            stack
                .http
                .post(&chat_url)
                .body(r#"{"model":"tiny-llama","messages":[]}"#),
            400,
        ),
        ("no body", stack.http.post(&chat_url), 400),
        (
            "10 MB body",
            stack.http.post(&chat_url).body(ten_mb.clone()),
            400,
        ),
        (
            "10 MB chunked body",
            stack
                .http
                .post(&chat_url)
                .body(reqwest::Body::wrap_stream(chunked(ten_mb.clone()))),
            400,
        ),
        ("GET", stack.http.get(&chat_url), 405),
        (
            "unknown path",
            stack.http.post(format!("{base}/v1/embeddings")).body("{}"),
            404,
        ),
        (
            "deep JSON",
            stack.http.post(&chat_url).body(format!(
                "{}{}",
                "[".repeat(100_000),
                "]".repeat(100_000)
            )),
            400,
        ),
    ];
    // Header values Envoy passes on that are not UTF-8 (obs-text), on a routed request: one
    // in the session header the filter reads, one in a header it does not. Several times, so
    // every worker's VM sees them.
    let odd = |value: &'static [u8]| reqwest::header::HeaderValue::from_bytes(value).unwrap();
    for _ in 0..4 {
        cases.push((
            "header values that are not UTF-8",
            stack
                .http
                .post(&chat_url)
                .header("x-session-id", odd(b"caf\xe9"))
                .header("x-note", odd(b"\xff\xfe"))
                .body(chat("be brief", "hi").to_string()),
            200,
        ));
    }
    // And an engine's answer whose content type is not UTF-8.
    let mut odd_answer = chat("be brief", "an odd answer");
    odd_answer["sim_content_type"] = "not_utf8".into();
    for _ in 0..4 {
        cases.push((
            "a response header that is not UTF-8",
            stack.http.post(&chat_url).body(odd_answer.to_string()),
            200,
        ));
    }
    for (name, req, want) in cases {
        let resp = req.send().await.unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(resp.status().as_u16(), want, "{name}");
    }
    // The VMs are alive and still route.
    let o = via_envoy(&stack, &chat(&text(60, 50), "still there?")).await;
    assert!(o.ok(), "{o:?}");
    let stat = |name: &'static str| {
        let stack = &stack;
        async move { stack.envoy_stat(name).await.unwrap_or(0) }
    };
    assert!(stat("wasmcustom.kvroute.fallback.bad_request").await >= 4);
    assert!(stat("wasmcustom.kvroute.fallback.too_large").await >= 2);
    assert_eq!(stat("wasmcustom.kvroute.host_errors").await, 0);
    // No request was answered by Envoy itself with a 5xx.
    assert_eq!(
        stack
            .envoy_stat("http.llm.downstream_rq_5xx")
            .await
            .unwrap_or(0),
        0
    );
}

/// A body as a stream of 1 MiB chunks without a length, so Envoy sees a chunked request.
fn chunked(body: String) -> impl futures::Stream<Item = Result<Vec<u8>, std::io::Error>> {
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> = body
        .into_bytes()
        .chunks(1 << 20)
        .map(|c| Ok(c.to_vec()))
        .collect();
    futures::stream::iter(chunks)
}

/// `kvroute-sidecar decode … | head -1`: the reader goes away after one line; the command ends
/// quietly instead of panicking on the closed pipe.
#[test]
fn decode_into_a_closed_pipe_does_not_panic() {
    use std::io::BufRead as _;
    let raw = kvroute_protocol::samples_dir().join("vllm/run1-sha256-default/raw");
    let files: Vec<_> = std::fs::read_dir(&raw)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.to_string_lossy().ends_with(".payload.msgpack"))
        .collect();
    let mut args = vec!["decode".into(), "--format".into(), "vllm-zmq".into()];
    // The same files many times over: far more output than a pipe buffer holds.
    for _ in 0..200 {
        args.extend(files.iter().map(|p| p.clone().into_os_string()));
    }
    let mut child =
        std::process::Command::new(kvroute_harness::paths::binary("kvroute-sidecar").unwrap())
            .args(&args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
    let mut first = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    assert!(first.starts_with('{'), "{first}");
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
}
