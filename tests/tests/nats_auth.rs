//! kvroute on an authenticated NATS: a real nats-server that requires a user and password (and
//! another a token); the sidecar connects with secrets read from files — or, less wisely, put in
//! its URL — indexes the events published there, and no secret appears in its log (at
//! `RUST_LOG=trace`), its metrics or its debug output.

mod common;

use std::process::Command;
use std::time::Duration;

use common::metric;
use kvroute_harness::client::get_text;
use kvroute_harness::paths;
use kvroute_harness::process::{free_port, wait_for, wait_log, Process};
use kvroute_harness::stack::SIDECAR_SUBSCRIBED;

const SECRET: &str = "s3cret-Pa55-kvroute";
const SUBJECT: &str = "namespace.dynamo.component.backend.endpoint.generate.kv-events";

/// Start a nats-server with `auth` arguments, a sidecar with `nats` (the `[nats]` lines after
/// `url`), publish the captured prompt with `publisher`, and check the sidecar indexed it without
/// showing `SECRET` anywhere.
async fn check(
    name: &str,
    auth: &[&str],
    nats: impl Fn(u16, &std::path::Path) -> String,
    publisher: async_nats::ConnectOptions,
) {
    let samples = kvroute_protocol::samples_dir().join("dynamo");
    let body = std::fs::read(samples.join("kv-events_stored_prompt_4blocks.msgpack")).unwrap();
    let worker = kvroute_protocol::dynamo::decode_message(&body)
        .unwrap()
        .events[0]
        .worker_id;
    let dir = paths::run_dir(name).unwrap();
    let nats_port = free_port().unwrap();
    let mut server = Command::new(paths::venv_tool("nats-server").unwrap());
    server.args(["-a", "127.0.0.1", "-p", &nats_port.to_string()]);
    server.args(auth);
    let _server = Process::spawn("nats", server, &dir).unwrap();
    let port = free_port().unwrap();
    let config = format!(
        "listen = \"127.0.0.1:{port}\"\n[nats]\n{}[[models]]\nname = \"m\"\ndir = \"{}\"\nblock_size = 16\n[[workers]]\naddress = \"127.0.0.1:9000\"\nmodel = \"m\"\ndynamo_worker_id = {worker}\n",
        nats(nats_port, &dir),
        paths::model_dir().display()
    );
    // At the most verbose level: the client library prints its URL on every attempt.
    let sidecar = common::spawn_sidecar_with(&dir, &config, &[("RUST_LOG", "trace")]);
    let log = dir.join("sidecar.log");
    wait_log(&log, SIDECAR_SUBSCRIBED, Duration::from_secs(20))
        .await
        .unwrap_or_else(|e| panic!("{e}: {}", sidecar.log_tail()));

    let client = publisher
        .connect(format!("nats://127.0.0.1:{nats_port}"))
        .await
        .unwrap();
    client.publish(SUBJECT, body.into()).await.unwrap();
    client.flush().await.unwrap();

    let http = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{port}");
    let (http_ref, metrics_url) = (&http, &format!("{base}/metrics"));
    let text = wait_for(
        "the event indexed",
        Duration::from_secs(10),
        || async move {
            let text = get_text(http_ref, metrics_url).await?;
            (metric(&text, "kvroute_index_blocks{worker=\"127.0.0.1:9000\"}")? == 4.0)
                .then_some(text)
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}: {}", sidecar.log_tail()));
    let sources = get_text(&http, &format!("{base}/debug/sources"))
        .await
        .unwrap();
    let log_text = std::fs::read_to_string(&log).unwrap();
    for (what, shown) in [
        ("metrics", &text),
        ("/debug/sources", &sources),
        ("log", &log_text),
    ] {
        assert!(
            !shown.contains(SECRET),
            "{name}: the secret is in the {what}: {shown}"
        );
    }
    assert!(sources.contains("127.0.0.1"), "{sources}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_and_password_from_a_file() {
    check(
        "nats-auth-user",
        &["--user", "kvroute", "--pass", SECRET],
        |port, dir| {
            let path = dir.join("nats-password");
            std::fs::write(&path, format!("{SECRET}\n")).unwrap();
            format!(
                "url = \"nats://127.0.0.1:{port}\"\nuser = \"kvroute\"\npassword_file = \"{}\"\n",
                path.display()
            )
        },
        async_nats::ConnectOptions::with_user_and_password("kvroute".into(), SECRET.into()),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_from_a_file() {
    check(
        "nats-auth-token",
        &["--auth", SECRET],
        |port, dir| {
            let path = dir.join("nats-token");
            std::fs::write(&path, SECRET).unwrap();
            format!(
                "url = \"nats://127.0.0.1:{port}\"\ntoken_file = \"{}\"\n",
                path.display()
            )
        },
        async_nats::ConnectOptions::with_token(SECRET.into()),
    )
    .await;
}

/// Credentials in the URL work, and are masked wherever the URL is shown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_in_the_url_are_masked() {
    check(
        "nats-auth-url",
        &["--user", "kvroute", "--pass", SECRET],
        |port, _| format!("url = \"nats://kvroute:{SECRET}@127.0.0.1:{port}\"\n"),
        async_nats::ConnectOptions::with_user_and_password("kvroute".into(), SECRET.into()),
    )
    .await;
}
