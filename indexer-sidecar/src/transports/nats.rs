//! Dynamo KV events from NATS: subscribe, decode each message, apply its events; and each
//! worker's `kv_metrics` (queued prefill, KV blocks used) for the load rule.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures::StreamExt;
use kvroute_protocol::dynamo::{
    decode_kv_metrics_stamped, decode_message, parse_subject, subject_component, KV_METRICS_TOPIC,
};

use crate::config::NatsConfig;
use crate::core::{Input, Message};
use crate::metrics::Transport;
use crate::sidecar::{Connection, Sidecar, Source};

/// Subscribe to every configured subject and apply events until the connection ends.
///
/// A plain subscription (no queue group): every sidecar replica must see every event.
pub async fn run(config: NatsConfig, state: Arc<Sidecar>) -> anyhow::Result<()> {
    let url = config.redacted_url();
    let source = Arc::new(state.source(Transport::Nats, &url, config.subjects.clone()));
    let client = connect_options(&config)
        .await?
        .retry_on_initial_connect()
        .name("kvroute-sidecar")
        .subscription_capacity(config.buffer_messages)
        .event_callback({
            let (source, url) = (source.clone(), url.clone());
            move |event| {
                connection_event(&source, &url, event, Instant::now());
                async {}
            }
        })
        .connect(crate::config::without_credentials(&config.url))
        .await
        .with_context(|| format!("connecting to NATS at {url}"))?;
    let mut subscriptions = Vec::new();
    for subject in &config.subjects {
        let sub = client
            .subscribe(subject.clone())
            .await
            .with_context(|| format!("subscribing to {subject}"))?;
        subscriptions.push(sub);
    }
    // A round trip to the server: once it returns, the subscriptions are in place.
    client.flush().await.context("flushing subscriptions")?;
    for subject in &config.subjects {
        tracing::info!(%subject, %url, "subscribed to Dynamo KV events");
    }
    source.subscribed();
    tokio::spawn(probe_bus(
        client.clone(),
        config.subjects.clone(),
        source.clone(),
    ));
    let overlapping = overlaps(&config.subjects);
    if let Some((a, b)) = &overlapping {
        tracing::info!(%a, %b, "NATS subjects overlap: a message matching both arrives once per subscription; the copies are dropped");
    }
    let mut recent = overlapping.map(|_| Recent::default());
    let mut messages = futures::stream::select_all(subscriptions);
    while let Some(msg) = messages.next().await {
        if let Some(recent) = &mut recent {
            if !recent.first_time(msg.subject.as_str(), &msg.payload) {
                continue;
            }
        }
        handle(&source, msg.subject.as_str(), &msg.payload);
    }
    anyhow::bail!("NATS subscription to {url} ended")
}

/// What the NATS client reports about its connection, handed to the sidecar to count and say.
/// (The library's own line per event is silenced by the default log filter: under a storm it
/// wrote one per dropped message.)
fn connection_event(source: &Source, url: &str, event: async_nats::Event, now: Instant) {
    use async_nats::Event;
    let what = match event {
        Event::Disconnected => Connection::Lost,
        Event::Connected => Connection::Back,
        Event::SlowConsumer(_) => Connection::Dropped,
        Event::ServerError(e) => return tracing::warn!(%url, error = %e, "NATS server error"),
        // While the connection is down every reconnection attempt fails: said once, above.
        Event::ClientError(e) if source.connection_down() => {
            return tracing::debug!(%url, error = %e, "NATS client error while reconnecting")
        }
        Event::ClientError(e) => return tracing::warn!(%url, error = %e, "NATS client error"),
        Event::LameDuckMode => {
            return tracing::warn!(%url, "NATS server entering lame duck mode: it will close this connection soon")
        }
        Event::Draining | Event::Closed => return tracing::info!(%url, "NATS connection {event}"),
    };
    source.connection(what, now);
}

/// `nats://user:password@host` or `nats://token@host`: the credentials as options, since the
/// client is given the URL without them ([`crate::config::without_credentials`]).
pub fn url_credentials(
    options: async_nats::ConnectOptions,
    url: &str,
) -> async_nats::ConnectOptions {
    let Ok(addr) = url.parse::<async_nats::ServerAddr>() else {
        return options;
    };
    match (addr.username(), addr.password()) {
        (Some(user), Some(pass)) => options.user_and_password(user.into(), pass.into()),
        (Some(token), None) => options.token(token.into()),
        _ => options,
    }
}

/// Authentication and TLS as configured; secrets are read from their files, never logged.
pub async fn connect_options(config: &NatsConfig) -> anyhow::Result<async_nats::ConnectOptions> {
    let secret = |path: &std::path::Path, what: &str| -> anyhow::Result<String> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("[nats] {what}: reading {}", path.display()))?;
        Ok(text.trim().to_owned())
    };
    let mut options = async_nats::ConnectOptions::new();
    if let Some(path) = &config.credentials_file {
        options = options
            .credentials_file(path)
            .await
            .with_context(|| format!("[nats] credentials_file {}", path.display()))?;
    }
    if let Some(path) = &config.nkey_seed_file {
        options = options.nkey(secret(path, "nkey_seed_file")?);
    }
    if let (Some(user), Some(path)) = (&config.user, &config.password_file) {
        options = options.user_and_password(user.clone(), secret(path, "password_file")?);
    }
    if let Some(path) = &config.token_file {
        options = options.token(secret(path, "token_file")?);
    }
    let explicit = config.credentials_file.is_some()
        || config.nkey_seed_file.is_some()
        || config.user.is_some()
        || config.token_file.is_some();
    if !explicit {
        options = url_credentials(options, &config.url);
    }
    if let Some(ca) = &config.tls_ca {
        options = options.add_root_certificates(ca.clone());
    }
    if let (Some(cert), Some(key)) = (&config.tls_cert, &config.tls_key) {
        options = options.add_client_certificate(cert.clone(), key.clone());
    }
    Ok(options.require_tls(config.require_tls))
}

/// The first pair of `subjects` that some subject matches both of.
pub fn overlaps(subjects: &[String]) -> Option<(String, String)> {
    subjects.iter().enumerate().find_map(|(i, a)| {
        subjects[i + 1..]
            .iter()
            .find(|b| subjects_overlap(a, b))
            .map(|b| (a.clone(), b.clone()))
    })
}

/// Whether some subject matches both NATS patterns (`*`: one token, `>`: one or more).
pub fn subjects_overlap(a: &str, b: &str) -> bool {
    fn go(a: &[&str], b: &[&str]) -> bool {
        match (a.first(), b.first()) {
            (None, None) => true,
            (Some(&">"), Some(_)) | (Some(_), Some(&">")) => true,
            (Some(x), Some(y)) if x == y || *x == "*" || *y == "*" => go(&a[1..], &b[1..]),
            _ => false,
        }
    }
    let (a, b): (Vec<&str>, Vec<&str>) = (a.split('.').collect(), b.split('.').collect());
    go(&a, &b)
}

/// How many recent messages the copy filter remembers: more than two overlapping
/// subscriptions can deliver out of step.
const RECENT: usize = 4096;

/// The hashes of the last [`RECENT`] messages (subject and body): a copy of one is dropped.
/// Dynamo's bodies carry their `event_id`, so two different events never look alike.
#[derive(Default)]
struct Recent {
    seen: std::collections::HashSet<u64>,
    order: std::collections::VecDeque<u64>,
}

impl Recent {
    fn first_time(&mut self, subject: &str, body: &[u8]) -> bool {
        let h = xxhash_rust::xxh3::xxh3_64_with_seed(
            body,
            xxhash_rust::xxh3::xxh3_64(subject.as_bytes()),
        );
        if !self.seen.insert(h) {
            return false;
        }
        self.order.push_back(h);
        if self.order.len() > RECENT {
            if let Some(old) = self.order.pop_front() {
                self.seen.remove(&old);
            }
        }
        true
    }
}

/// The last token of a KV-event subject, in every Dynamo layout.
const KV_EVENTS_TOPIC: &str = "kv-events";

/// How long one look at the whole bus lasts at most: engines publish KV events only while
/// they store or evict blocks, so a quiet moment of a lightly loaded fleet must not pass for
/// "no KV events anywhere".
const PROBE_WINDOW: Duration = Duration::from_secs(5);
/// A look ends this early once KV events were seen on some subject.
const PROBE_ENOUGH: Duration = Duration::from_secs(1);
/// Distinct subjects a probe keeps (a bus with endless subjects must not grow it forever).
const PROBE_SUBJECTS: usize = 200;

/// While no KV event arrives and hints are served (the `no_events` condition), look at the whole
/// Dynamo bus (`namespace.>`) for a moment (up to 5 s, 1 s once KV events show) — at once when
/// the condition begins, then once per `silence_s` — and say where KV events *are* published (the classic cause is a component
/// renamed by a move to disaggregated serving) or that none are. The verdict opens the alarm's
/// line (which waits for it) and shows in `/debug/sources`; a later change of verdict during
/// the same episode gets a line of its own.
async fn probe_bus(client: async_nats::Client, subscribed: Vec<String>, source: Arc<Source>) {
    let every = Duration::from_secs(source.alarms().silence_s.clamp(1, 300));
    // `None`: no verdict yet in this episode (the alarm's line will carry the first).
    let mut last_verdict: Option<String> = None;
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        if !source.silent_while_hinting(Instant::now()) {
            last_verdict = None;
            continue;
        }
        if !source.bus_probe_due(every, Instant::now()) {
            continue;
        }
        let Ok(mut sub) = client.subscribe("namespace.>").await else {
            continue;
        };
        let mut seen: BTreeMap<String, u64> = BTreeMap::new();
        let started = Instant::now();
        let window = tokio::time::sleep(PROBE_WINDOW);
        tokio::pin!(window);
        let mut kv_seen = false;
        loop {
            tokio::select! {
                msg = sub.next() => match msg {
                    Some(m) => {
                        let subject = m.subject.to_string();
                        kv_seen |= parse_subject(&subject).is_some();
                        if seen.len() < PROBE_SUBJECTS || seen.contains_key(&subject) {
                            *seen.entry(subject).or_default() += 1;
                        }
                        if kv_seen && started.elapsed() >= PROBE_ENOUGH {
                            break;
                        }
                    }
                    None => break,
                },
                _ = &mut window => break,
            }
        }
        let _ = sub.unsubscribe().await;
        let verdict = bus_verdict(&seen, &subscribed);
        if last_verdict.as_ref().is_some_and(|last| *last != verdict) {
            tracing::warn!(alarm = "no_events", "{verdict}");
        }
        last_verdict = Some(verdict.clone());
        source.bus_looked(seen, verdict, Instant::now());
    }
}

/// What a look at the whole bus says: where KV events are published that `subscribed` does not
/// match, or that none are (with the components seen). Without counts, so that it changes only
/// when the picture does.
fn bus_verdict(seen: &BTreeMap<String, u64>, subscribed: &[String]) -> String {
    let kv: Vec<&str> = seen
        .keys()
        .filter(|subject| parse_subject(subject).is_some())
        .map(String::as_str)
        .collect();
    if kv.is_empty() {
        let components: BTreeSet<String> =
            seen.keys().filter_map(|s| subject_component(s)).collect();
        format!(
            "No KV events on the whole bus during a {} s look (components seen: [{}]): are the engines started with KV events on?",
            PROBE_WINDOW.as_secs(),
            components.into_iter().collect::<Vec<_>>().join(", ")
        )
    } else {
        format!(
            "KV events are published on [{}], which the subscriptions [{}] do not match: add them to [nats] subjects",
            kv.join(", "),
            subscribed.join(", ")
        )
    }
}

/// Decode and apply one message body. Dynamo publishes each kind on its own subject, whose last
/// segment names it.
pub fn handle(source: &Source, subject: &str, body: &[u8]) {
    let now = Instant::now();
    if subject.rsplit('.').next() == Some(KV_METRICS_TOPIC) {
        let decoded = decode_kv_metrics_stamped(body);
        source.received(subject, decoded.is_ok());
        match decoded {
            Ok((m, stamp)) => {
                source.stamped(KV_METRICS_TOPIC, stamp, now);
                let component = subject_component(subject);
                let input = Input::DynamoLoad {
                    metrics: &m,
                    component: component.as_deref(),
                };
                source.ingest(subject, input, now);
            }
            Err(e) => source.undecodable(subject, &e.to_string(), body.len()),
        }
        return;
    }
    if subject.rsplit('.').next() != Some(KV_EVENTS_TOPIC) {
        // A broad subscription (`namespace.>`) sees the whole bus: only KV events are ours.
        source.received(subject, true);
        return;
    }
    let decoded = decode_message(body);
    source.received(subject, decoded.is_ok());
    match decoded {
        Ok(decoded) => {
            if let Some(stamp) = decoded.stamp {
                source.dynamo_fields(body);
                source.stamped(KV_EVENTS_TOPIC, stamp, now);
            }
            source.skipped(decoded.skipped);
            let component = subject_component(subject);
            for event in &decoded.events {
                let message = Message::dynamo(event, component.as_deref());
                source.ingest(subject, Input::Message(message), now);
            }
        }
        Err(e) => source.undecodable(subject, &e.to_string(), body.len()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sidecar::tests::sidecar as state;

    #[test]
    fn overlapping_subjects_are_found() {
        assert!(subjects_overlap(
            "namespace.>",
            "namespace.*.component.*.kv-events"
        ));
        assert!(subjects_overlap("a.*.c", "a.b.*"));
        assert!(!subjects_overlap(
            "namespace.*.component.*.kv-events",
            "namespace.*.component.*.endpoint.*.kv-events"
        ));
        assert!(!subjects_overlap("a.>", "a"), "> needs a token");
        assert!(!subjects_overlap("a.b", "a.c"));
        assert_eq!(overlaps(&crate::config::default_subjects()), None);
        let mut r = Recent::default();
        assert!(r.first_time("s", b"x"));
        assert!(!r.first_time("s", b"x"));
        assert!(
            r.first_time("t", b"x"),
            "another subject is another message"
        );
    }

    #[test]
    fn the_bus_verdict_names_the_subjects_that_carry_events() {
        let subscribed = vec!["namespace.*.component.prefill.endpoint.*.kv-events".to_owned()];
        let published = "namespace.dynamo.component.backend.endpoint.generate.kv-events";
        let seen = BTreeMap::from([
            (published.to_owned(), 9),
            (
                "namespace.dynamo.component.backend.endpoint.generate.kv_metrics".to_owned(),
                3,
            ),
        ]);
        let verdict = bus_verdict(&seen, &subscribed);
        assert!(
            verdict.starts_with(&format!("KV events are published on [{published}]")),
            "{verdict}"
        );
        assert!(verdict.contains("add them to [nats] subjects"), "{verdict}");
        let load_only = BTreeMap::from([(
            "namespace.dynamo.component.backend.endpoint.generate.kv_metrics".to_owned(),
            3,
        )]);
        let verdict = bus_verdict(&load_only, &subscribed);
        assert!(
            verdict.starts_with("No KV events on the whole bus"),
            "{verdict}"
        );
        assert!(
            verdict.contains("components seen: [dynamo/backend]"),
            "{verdict}"
        );
    }

    #[test]
    fn kv_metrics_feed_the_load_not_the_index() {
        let state = Arc::new(state());
        let source = state.source(Transport::Nats, "nats://test", vec![]);
        let dir = kvroute_protocol::samples_dir().join("dynamo");
        let body = std::fs::read(dir.join("kv_metrics.msgpack")).unwrap();
        handle(
            &source,
            "namespace.dynamo.component.backend.endpoint.generate.kv_metrics",
            &body,
        );
        let text = state.render_metrics();
        assert!(
            text.contains("kvroute_kv_used_blocks{worker=\"127.0.0.1:9000\"} 5"),
            "{text}"
        );
        assert!(!text.contains("kvroute_decode_errors_total"), "{text}");
        // A kv_metrics subject carrying something else is a decode error, not a panic.
        handle(
            &source,
            "namespace.a.component.b.endpoint.c.kv_metrics",
            b"\x01",
        );
        assert!(state
            .render_metrics()
            .contains("kvroute_decode_errors_total{source=\"nats\"} 1"));
    }
}
