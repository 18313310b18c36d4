//! Dynamo's ZMQ event plane, the default since Dynamo 1.4 (no `--event-plane` flag): every
//! worker binds one PUB socket per topic and registers it in discovery as an `EventChannel`
//! record (`transport: {kind: Zmq, config: {endpoint}}`). The `[[dynamo_discovery]]` scans hand
//! their entries' channels here ([`Follow::publishers`]); this transport connects one SUB socket
//! to every `kv-events` and `kv_metrics` publisher, disconnects those whose record went away,
//! decodes the four-frame messages ([`kvroute_protocol::dynamo_zmq`]) and feeds the same ingest
//! path as NATS: `Input::Message(Message::dynamo(..))` per event, `Input::DynamoLoad` per load
//! report, the channel's `namespace/component` as the subject's.
//!
//! Sequence numbers: each publisher numbers its messages from 0. The core checks each worker's
//! `event_id`s per rank; here the publisher's own numbers tell messages lost on the way (a
//! slow subscriber past its high-water mark): counted in
//! `kvroute_lost_messages_total{source="dynamo_zmq",topic}`. The first message of a publisher starts
//! where it is (what it sent before the connection was never for us).
//!
//! Publishers that leave: the connection of a `kv-events` publisher closing after its handshake
//! means the worker's process stopped, its cache with it: its workers' entries are dropped at
//! once (`Input::PublisherGone`), before its discovery records go (about 8 s later). A worker
//! started again is a new instance with a new publisher, found at the next scan.
//!
//! libzmq (as `transports/zmq.rs`): it reconnects by itself and reports connection changes on a
//! monitor socket; its API blocks, so the plane runs on a thread of its own.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_protocol::dynamo::{KV_EVENTS_TOPIC, KV_METRICS_TOPIC};
use kvroute_protocol::dynamo_zmq::{decode_frames, frame_payload};

use crate::core::{Input, Message, Publisher};
use crate::event_plane::{judge, Sequence};
use crate::metrics::Transport;
use crate::observers::discovery::{ChannelTransport, EventChannel, Follow};
use crate::sidecar::{Sidecar, Source};

/// The topics followed: KV events for the index, load reports for the routing rule.
pub const TOPICS: [&str; 2] = [KV_EVENTS_TOPIC, KV_METRICS_TOPIC];

/// libzmq's reconnect interval, doubling up to the maximum (as for vLLM).
const RECONNECT_IVL_MS: i32 = 100;
const RECONNECT_IVL_MAX_MS: i32 = 1000;
/// Messages the SUB socket queues (Dynamo's PUB allows 100000 too).
const RECEIVE_HWM: i32 = 100_000;
/// Workers remembered per publisher (from its events' `worker_id`): one in practice.
const WORKERS_PER_PUBLISHER: usize = 16;
/// Publishers remembered that discovery no longer lists (messages of a publisher whose record
/// is gone or not read yet): bounded, oldest forgotten first.
const MAX_PUBLISHERS: usize = 4096;

/// The running plane: hands out one [`Follow`] per discovery entry.
#[derive(Debug)]
pub struct Plane {
    tx: mpsc::Sender<(usize, Vec<EventChannel>)>,
    gone: tokio::sync::watch::Receiver<u64>,
}

impl Plane {
    /// The handle of discovery entry `entry`.
    pub fn entry(&self, entry: usize) -> Follow {
        Follow::new(entry, self.tx.clone(), self.gone.clone())
    }
}

/// Start the plane's thread. `nats` says whether `[nats]` is configured (channels on NATS are
/// then read there; without it, the line says what to add).
pub fn start(state: Arc<Sidecar>, nats: bool) -> anyhow::Result<Plane> {
    let (tx, rx) = mpsc::channel();
    let (gone_tx, gone) = tokio::sync::watch::channel(0);
    std::thread::Builder::new()
        .name("dynamo-zmq".into())
        .spawn(move || run(&rx, &state, nats, &gone_tx))?;
    Ok(Plane { tx, gone })
}

/// What the plane follows and what it learnt of each publisher: pure, the thread executes it.
#[derive(Debug, Default)]
pub struct Following {
    /// Per discovery entry, its channels on ZMQ with a followed topic.
    entries: BTreeMap<usize, Vec<EventChannel>>,
    /// Endpoints connected, with the publishers registered there.
    connected: BTreeMap<String, BTreeSet<u64>>,
    /// What each publisher's messages said.
    publishers: HashMap<u64, PublisherState>,
    /// Publishers in the order they were first heard of (to forget the oldest unlisted ones).
    order: Vec<u64>,
    /// Entries whose channels are on NATS (`--event-plane nats`).
    on_nats: BTreeSet<usize>,
}

/// One publisher, as far as this plane knows it.
#[derive(Debug, Clone, Default)]
pub struct PublisherState {
    /// Its topic.
    pub topic: String,
    /// `namespace/component` of its channel (`None`: not in discovery).
    pub component: Option<String>,
    /// Its endpoint (`None`: not in discovery).
    pub endpoint: Option<String>,
    /// The sequence number expected next (`None`: nothing received yet).
    pub next: Option<u64>,
    /// Workers its events named, and the one discovery ties it to.
    pub workers: BTreeSet<u64>,
    /// Messages received.
    pub messages: u64,
    /// Messages lost (gaps in its sequence).
    pub lost: u64,
}

/// The endpoints to connect and to disconnect after an update.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// Newly listed.
    pub connect: Vec<String>,
    /// No longer listed.
    pub disconnect: Vec<String>,
}

impl Following {
    /// Entry `entry`'s channels as its last scan found them.
    pub fn update(&mut self, entry: usize, channels: Vec<EventChannel>) -> Changes {
        if channels
            .iter()
            .any(|c| matches!(c.transport, ChannelTransport::Nats(_)) && c.topic == KV_EVENTS_TOPIC)
        {
            self.on_nats.insert(entry);
        } else {
            self.on_nats.remove(&entry);
        }
        let followed: Vec<EventChannel> = channels
            .into_iter()
            .filter(|c| c.zmq_endpoint().is_some() && TOPICS.contains(&c.topic.as_str()))
            .collect();
        self.entries.insert(entry, followed);
        let mut wanted: BTreeMap<String, BTreeSet<u64>> = BTreeMap::new();
        let listed: Vec<EventChannel> = self.entries.values().flatten().cloned().collect();
        for c in &listed {
            let endpoint = c.zmq_endpoint().unwrap_or_default().to_owned();
            wanted
                .entry(endpoint.clone())
                .or_default()
                .insert(c.publisher_id);
            let p = self.publisher(c.publisher_id);
            p.topic = c.topic.clone();
            p.component = Some(c.component_path());
            p.endpoint = Some(endpoint);
            p.workers.extend(c.worker);
        }
        let changes = Changes {
            connect: wanted
                .keys()
                .filter(|e| !self.connected.contains_key(*e))
                .cloned()
                .collect(),
            disconnect: self
                .connected
                .keys()
                .filter(|e| !wanted.contains_key(*e))
                .cloned()
                .collect(),
        };
        self.connected = wanted;
        self.forget_unlisted();
        changes
    }

    /// Whether some entry's `kv-events` channels are on NATS.
    pub fn any_on_nats(&self) -> bool {
        !self.on_nats.is_empty()
    }

    /// How many publishers are followed.
    pub fn followed(&self) -> usize {
        self.connected.values().map(BTreeSet::len).sum()
    }

    /// Publisher `id`'s state, created when first heard of.
    fn publisher(&mut self, id: u64) -> &mut PublisherState {
        if !self.publishers.contains_key(&id) {
            self.order.push(id);
        }
        self.publishers.entry(id).or_default()
    }

    /// Past [`MAX_PUBLISHERS`], forget the oldest publishers no endpoint lists.
    fn forget_unlisted(&mut self) {
        if self.publishers.len() <= MAX_PUBLISHERS {
            return;
        }
        let listed: BTreeSet<u64> = self.connected.values().flatten().copied().collect();
        let mut excess = self.publishers.len() - MAX_PUBLISHERS;
        let publishers = &mut self.publishers;
        self.order.retain(|id| {
            if excess > 0 && !listed.contains(id) {
                publishers.remove(id);
                excess -= 1;
                false
            } else {
                true
            }
        });
    }

    /// A message from publisher `id` numbered `seq` on `topic`: what its number says.
    pub fn message(&mut self, id: u64, topic: &str, seq: u64) -> Sequence {
        let p = self.publisher(id);
        if p.topic.is_empty() {
            p.topic = topic.to_owned();
        }
        let verdict = judge(p.next, seq);
        p.messages += 1;
        match verdict {
            Sequence::Duplicate => {}
            Sequence::Gap { lost } => {
                p.lost += lost;
                p.next = Some(seq.saturating_add(1));
            }
            _ => p.next = Some(seq.saturating_add(1)),
        }
        verdict
    }

    /// Publisher `id`'s events named worker `worker`.
    pub fn named(&mut self, id: u64, worker: u64) {
        let p = self.publisher(id);
        if p.workers.len() < WORKERS_PER_PUBLISHER {
            p.workers.insert(worker);
        }
    }

    /// A publisher's `namespace/component`, when discovery lists it.
    pub fn component(&self, id: u64) -> Option<&str> {
        self.publishers.get(&id)?.component.as_deref()
    }

    /// The connection to `endpoint` closed after its handshake: the `kv-events` publishers
    /// there stopped. Their workers, whose entries are to be dropped; they start over.
    pub fn closed(&mut self, endpoint: &str) -> Vec<u64> {
        let ids = self.connected.get(endpoint).cloned().unwrap_or_default();
        let mut workers = BTreeSet::new();
        for id in ids {
            if let Some(p) = self.publishers.get_mut(&id) {
                p.next = None;
                if p.topic == KV_EVENTS_TOPIC {
                    workers.extend(p.workers.iter().copied());
                }
            }
        }
        workers.into_iter().collect()
    }

    /// Publisher `id`'s state.
    pub fn state(&self, id: u64) -> Option<&PublisherState> {
        self.publishers.get(&id)
    }
}

/// The plane's loop: follow the discovered publishers forever.
fn run(
    rx: &mpsc::Receiver<(usize, Vec<EventChannel>)>,
    state: &Arc<Sidecar>,
    nats: bool,
    gone: &tokio::sync::watch::Sender<u64>,
) {
    let mut plane = Subscriber {
        state,
        gone,
        nats,
        source: None,
        context: zmq::Context::new(),
        sockets: None,
        following: Following::default(),
        handshaken: BTreeSet::new(),
        nats_said: false,
    };
    loop {
        // Without a socket, wait for the first channels; with one, poll it and look for
        // updates between polls.
        if plane.sockets.is_none() {
            match rx.recv_timeout(Duration::from_secs(1)) {
                Ok((entry, channels)) => plane.update(entry, channels),
                Err(mpsc::RecvTimeoutError::Timeout) => continue,
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            }
        }
        while let Ok((entry, channels)) = rx.try_recv() {
            plane.update(entry, channels);
        }
        if let Err(e) = plane.poll() {
            let error = format!("{e:#}; building the socket again in 1 s");
            plane.failed(&error);
            plane.sockets = None;
            plane.following.connected.clear();
            std::thread::sleep(Duration::from_secs(1));
        }
    }
}

/// The SUB socket and its monitor.
struct Sockets {
    sub: zmq::Socket,
    monitor: zmq::Socket,
}

struct Subscriber<'a> {
    state: &'a Arc<Sidecar>,
    /// Bumped when a `kv-events` publisher leaves: discovery probes its workers at once.
    gone: &'a tokio::sync::watch::Sender<u64>,
    nats: bool,
    /// Registered with the event plane once there is a publisher to follow.
    source: Option<Arc<Source>>,
    context: zmq::Context,
    sockets: Option<Sockets>,
    following: Following,
    /// Endpoints whose current connection completed its handshake.
    handshaken: BTreeSet<String>,
    /// Whether the line about channels on NATS without `[nats]` was logged.
    nats_said: bool,
}

impl Subscriber<'_> {
    fn source(&mut self) -> Arc<Source> {
        let state = self.state;
        Arc::clone(self.source.get_or_insert_with(|| {
            Arc::new(state.source(
                Transport::DynamoZmq,
                "Dynamo ZMQ event plane (publishers from discovery)",
                TOPICS.iter().map(|t| (*t).to_owned()).collect(),
            ))
        }))
    }

    fn failed(&mut self, error: &str) {
        self.source().failed(error);
    }

    fn sockets(&mut self) -> anyhow::Result<&Sockets> {
        if self.sockets.is_none() {
            let sub = self.context.socket(zmq::SUB)?;
            sub.set_rcvhwm(RECEIVE_HWM)?;
            sub.set_maxmsgsize(
                i64::try_from(crate::config::default_max_message_bytes()).unwrap_or(i64::MAX),
            )?;
            sub.set_reconnect_ivl(RECONNECT_IVL_MS)?;
            sub.set_reconnect_ivl_max(RECONNECT_IVL_MAX_MS)?;
            sub.set_tcp_keepalive(1)?;
            sub.set_tcp_keepalive_idle(10)?;
            sub.set_tcp_keepalive_intvl(2)?;
            sub.set_tcp_keepalive_cnt(3)?;
            for topic in TOPICS {
                sub.set_subscribe(topic.as_bytes())?;
            }
            let address = "inproc://kvroute-dynamo-zmq-monitor";
            let events = [
                zmq::SocketEvent::HANDSHAKE_SUCCEEDED,
                zmq::SocketEvent::DISCONNECTED,
                zmq::SocketEvent::HANDSHAKE_FAILED_NO_DETAIL,
                zmq::SocketEvent::HANDSHAKE_FAILED_PROTOCOL,
                zmq::SocketEvent::HANDSHAKE_FAILED_AUTH,
            ];
            let mask = events.iter().fold(0u16, |m, e| m | *e as u16);
            sub.monitor(address, mask.into())?;
            let monitor = self.context.socket(zmq::PAIR)?;
            monitor.connect(address)?;
            self.sockets = Some(Sockets { sub, monitor });
            self.source().subscribed();
        }
        Ok(self.sockets.as_ref().expect("just built"))
    }

    /// A discovery entry's channels: connect to new publishers, close removed ones.
    fn update(&mut self, entry: usize, channels: Vec<EventChannel>) {
        let changes = self.following.update(entry, channels);
        if self.following.any_on_nats() && !self.nats && !self.nats_said {
            self.nats_said = true;
            tracing::warn!("Dynamo's discovery records list KV-event channels on NATS (workers started with --event-plane nats) but [nats] is not configured: add [nats] url = the workers' NATS_SERVER, or start them without --event-plane (ZMQ, read from discovery)");
        }
        if changes.connect.is_empty() && changes.disconnect.is_empty() {
            return;
        }
        let followed = self.following.followed();
        let sockets = match self.sockets() {
            Ok(s) => s,
            Err(e) => {
                self.failed(&format!("building the SUB socket: {e:#}"));
                // Connected again with the next update.
                self.following.connected.clear();
                return;
            }
        };
        for endpoint in &changes.disconnect {
            // Not connected (a failed connect) is fine: nothing to close.
            let _ = sockets.sub.disconnect(endpoint);
            tracing::info!(%endpoint, "Dynamo event publisher's record is gone: disconnected");
        }
        let mut refused = Vec::new();
        for endpoint in &changes.connect {
            match sockets.sub.connect(endpoint) {
                Ok(()) => {
                    tracing::info!(%endpoint, followed, "following a Dynamo event publisher found in discovery (ZMQ event plane)")
                }
                Err(e) => refused.push(format!("{endpoint}: {e}")),
            }
        }
        for endpoint in &changes.disconnect {
            self.handshaken.remove(endpoint);
        }
        for error in refused {
            self.failed(&format!("connecting to {error}"));
        }
    }

    /// Wait up to 100 ms for messages or connection changes and handle them.
    fn poll(&mut self) -> anyhow::Result<()> {
        let Some(sockets) = self.sockets.take() else {
            return Ok(());
        };
        let result = self.poll_on(&sockets);
        self.sockets = Some(sockets);
        result
    }

    fn poll_on(&mut self, sockets: &Sockets) -> anyhow::Result<()> {
        let mut items = [
            sockets.sub.as_poll_item(zmq::POLLIN),
            sockets.monitor.as_poll_item(zmq::POLLIN),
        ];
        zmq::poll(&mut items, 100)?;
        let (messages, events) = (items[0].is_readable(), items[1].is_readable());
        if events {
            while let Some(event) = receive(&sockets.monitor)? {
                self.connection_event(&event);
            }
        }
        if messages {
            // Bounded per poll so updates and connection changes are not starved.
            for _ in 0..10_000 {
                let Some(parts) = receive(&sockets.sub)? else {
                    break;
                };
                self.message(&parts, Instant::now());
            }
        }
        Ok(())
    }

    /// A monitor message: `[event u16 LE + value u32 LE, endpoint]`.
    fn connection_event(&mut self, parts: &[Vec<u8>]) {
        let Some(&[lo, hi, ..]) = parts.first().map(Vec::as_slice) else {
            return;
        };
        let event = zmq::SocketEvent::from_raw(u16::from_le_bytes([lo, hi]));
        let endpoint = parts
            .get(1)
            .map(|p| String::from_utf8_lossy(p).into_owned())
            .unwrap_or_default();
        match event {
            zmq::SocketEvent::HANDSHAKE_SUCCEEDED => {
                tracing::info!(%endpoint, "Dynamo event publisher connected");
                self.handshaken.insert(endpoint);
            }
            zmq::SocketEvent::DISCONNECTED if self.handshaken.remove(&endpoint) => {
                self.publisher_gone(&endpoint);
            }
            zmq::SocketEvent::HANDSHAKE_FAILED_NO_DETAIL
            | zmq::SocketEvent::HANDSHAKE_FAILED_PROTOCOL
            | zmq::SocketEvent::HANDSHAKE_FAILED_AUTH => {
                self.failed(&format!(
                    "{endpoint}: ZMTP handshake failed ({event:?}): not a ZMQ publisher, or a hostile or oversized frame"
                ));
            }
            _ => {}
        }
    }

    /// The connection to a publisher closed: its worker stopped, its cache with it.
    fn publisher_gone(&mut self, endpoint: &str) {
        let workers = self.following.closed(endpoint);
        tracing::info!(%endpoint, ?workers, "Dynamo event publisher disconnected (worker stopped); libzmq reconnects while its record stays");
        if !workers.is_empty() {
            self.gone.send_modify(|n| *n += 1);
        }
        let source = self.source();
        for worker in workers {
            let input = Input::PublisherGone(Publisher::Instance(worker));
            source.ingest(endpoint, input, Instant::now());
        }
    }

    /// One multipart message.
    fn message(&mut self, parts: &[Vec<u8>], now: Instant) {
        let source = self.source();
        let message = match decode_frames(parts) {
            Ok(m) => m,
            Err(e) => {
                source.received("", false);
                let bytes = parts.iter().map(Vec::len).sum();
                return source.undecodable("", &e.to_string(), bytes);
            }
        };
        let id = message.publisher_id;
        let payload_bytes = parts.get(3).map_or(0, Vec::len);
        match self.following.message(id, &message.topic, message.sequence) {
            Sequence::Duplicate => return,
            Sequence::Gap { lost } => source.messages_lost(&message.topic, lost, now),
            Sequence::First => {
                tracing::info!(publisher = format!("{id:x}"), topic = %message.topic, seq = message.sequence, "first message from a Dynamo event publisher");
            }
            Sequence::Back => {
                tracing::info!(publisher = format!("{id:x}"), topic = %message.topic, seq = message.sequence, "Dynamo ZMQ publisher started over under the same id");
            }
            Sequence::Next => {}
        }
        let component = self.following.component(id).map(str::to_owned);
        let subject = match &component {
            Some(c) => format!("{c}/{}", message.topic),
            None => message.topic.clone(),
        };
        match message.topic.as_str() {
            KV_EVENTS_TOPIC => {
                let decoded = message.kv_events();
                source.received(&subject, decoded.is_ok());
                let decoded = match decoded {
                    Ok(d) => d,
                    Err(e) => return source.undecodable(&subject, &e.to_string(), payload_bytes),
                };
                if let Some(Ok(envelope)) = parts.get(3).map(|data| frame_payload(data)) {
                    source.dynamo_fields(envelope);
                }
                source.skipped(decoded.skipped);
                for event in &decoded.events {
                    self.following.named(id, event.worker_id);
                    let m = Message::dynamo(event, component.as_deref());
                    source.ingest(&subject, Input::Message(m), now);
                }
            }
            KV_METRICS_TOPIC => {
                let decoded = message.kv_metrics();
                source.received(&subject, decoded.is_ok());
                match decoded {
                    Ok(m) => {
                        let input = Input::DynamoLoad {
                            metrics: &m,
                            component: component.as_deref(),
                        };
                        source.ingest(&subject, input, now);
                    }
                    Err(e) => source.undecodable(&subject, &e.to_string(), payload_bytes),
                }
            }
            // Subscribed by prefix: a longer topic is not ours.
            _ => source.received(&subject, true),
        }
    }
}

/// The next multipart message, if one is waiting.
fn receive(socket: &zmq::Socket) -> anyhow::Result<Option<Vec<Vec<u8>>>> {
    match socket.recv_multipart(zmq::DONTWAIT) {
        Ok(parts) => Ok(Some(parts)),
        Err(zmq::Error::EAGAIN) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observers::discovery::parse_event_channel;
    use kvroute_protocol::dynamo::{
        Envelope, KvCacheEvent, KvCacheEventData, KvMetrics, RouterEvent, StoredBlock, StoredBlocks,
    };
    use kvroute_protocol::dynamo_zmq::encode_frames;

    /// The worker `crate::sidecar::tests::sidecar` configures.
    const WORKER: u64 = 13140558925506144034;

    fn channel(id: u64, topic: &str, endpoint: &str) -> EventChannel {
        EventChannel {
            namespace: "dynamo".into(),
            component: "backend".into(),
            topic: topic.into(),
            publisher_id: id,
            transport: ChannelTransport::Zmq(endpoint.into()),
            worker: None,
        }
    }

    #[test]
    fn sequence_numbers_per_publisher() {
        assert_eq!(judge(None, 7), Sequence::First);
        assert_eq!(judge(Some(3), 3), Sequence::Next);
        assert_eq!(judge(Some(3), 5), Sequence::Gap { lost: 2 });
        assert_eq!(judge(Some(3), 2), Sequence::Duplicate);
        assert_eq!(judge(Some(3), 0), Sequence::Back);
        let mut f = Following::default();
        assert_eq!(f.message(1, "kv-events", 4), Sequence::First);
        assert_eq!(f.message(1, "kv-events", 5), Sequence::Next);
        assert_eq!(f.message(1, "kv-events", 9), Sequence::Gap { lost: 3 });
        assert_eq!(f.message(1, "kv-events", 9), Sequence::Duplicate);
        assert_eq!(
            f.message(2, "kv-events", 0),
            Sequence::First,
            "per publisher"
        );
        assert_eq!(f.state(1).unwrap().lost, 3);
        assert_eq!(f.state(1).unwrap().messages, 4);
    }

    #[test]
    fn publishers_are_followed_as_discovery_lists_them() {
        let mut f = Following::default();
        let a = channel(1, "kv-events", "tcp://127.0.0.1:1");
        let a_load = channel(2, "kv_metrics", "tcp://127.0.0.1:2");
        let other = channel(3, "forward-pass-metrics", "tcp://127.0.0.1:3");
        let mut nats = channel(4, "kv-events", "");
        nats.transport = ChannelTransport::Nats("namespace.dynamo".into());
        let changes = f.update(0, vec![a.clone(), a_load.clone(), other, nats.clone()]);
        assert_eq!(
            changes.connect,
            vec!["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"],
            "only the followed topics, only on ZMQ"
        );
        assert!(f.any_on_nats());
        assert_eq!(f.component(1), Some("dynamo/backend"));
        // The same scan again changes nothing; a second entry listing the same publisher
        // does not connect twice.
        assert_eq!(
            f.update(0, vec![a.clone(), a_load.clone()]),
            Changes::default()
        );
        assert!(!f.any_on_nats());
        assert_eq!(f.update(1, vec![a.clone()]), Changes::default());
        // The worker restarts: a new publisher appears, the old one's record goes.
        let b = channel(5, "kv-events", "tcp://127.0.0.1:5");
        let changes = f.update(0, vec![b.clone(), a_load.clone()]);
        assert_eq!(changes.connect, vec!["tcp://127.0.0.1:5"]);
        assert!(changes.disconnect.is_empty(), "entry 1 still lists it");
        let changes = f.update(1, vec![]);
        assert_eq!(changes.disconnect, vec!["tcp://127.0.0.1:1"]);
        assert_eq!(f.followed(), 2);
    }

    #[test]
    fn a_closed_connection_names_the_workers_of_its_kv_events_publishers() {
        let mut f = Following::default();
        let mut a = channel(1, "kv-events", "tcp://127.0.0.1:1");
        a.worker = Some(77);
        f.update(0, vec![a, channel(2, "kv_metrics", "tcp://127.0.0.1:2")]);
        f.message(1, "kv-events", 0);
        f.named(1, 78);
        f.named(2, 79);
        assert_eq!(f.closed("tcp://127.0.0.1:1"), vec![77, 78]);
        assert!(
            f.closed("tcp://127.0.0.1:2").is_empty(),
            "a load publisher holds no cache"
        );
        assert_eq!(f.state(1).unwrap().next, None, "it starts over");
        assert!(f.closed("tcp://elsewhere:1").is_empty());
    }

    #[test]
    fn publishers_nobody_lists_are_forgotten_past_the_bound() {
        let mut f = Following::default();
        for id in 0..(MAX_PUBLISHERS as u64 + 10) {
            f.message(id, "kv-events", 0);
        }
        f.update(0, vec![channel(0, "kv-events", "tcp://127.0.0.1:1")]);
        assert!(f.publishers.len() <= MAX_PUBLISHERS);
        assert!(f.state(0).is_some(), "a listed publisher is kept");
    }

    fn stored(event_id: u64, hashes: &[u64]) -> RouterEvent {
        RouterEvent {
            worker_id: WORKER,
            storage_tier: "device".into(),
            residency_domain: Some("worker".into()),
            event: KvCacheEvent {
                event_id,
                data: KvCacheEventData::Stored(StoredBlocks {
                    parent_hash: None,
                    start_position: None,
                    blocks: hashes
                        .iter()
                        .map(|&h| StoredBlock {
                            block_hash: h,
                            tokens_hash: h + 1000,
                            mm_extra_info: None,
                        })
                        .collect(),
                }),
                dp_rank: 0,
            },
        }
    }

    fn frames(publisher: u64, sequence: u64, topic: &str, payload: Vec<u8>) -> Vec<Vec<u8>> {
        let envelope = Envelope {
            publisher_id: publisher,
            sequence,
            published_at: 1,
            topic: topic.into(),
            payload,
        };
        encode_frames(&envelope, topic)
    }

    /// A real PUB socket publishing Dynamo's frames: the plane connects to it from a discovery
    /// record, indexes its events, takes its load reports, counts a lost message, and drops the
    /// worker's entries when the publisher goes away.
    #[test]
    fn follows_a_publisher_over_a_real_socket() {
        let state = Arc::new(crate::sidecar::tests::sidecar());
        let context = zmq::Context::new();
        let publisher = context.socket(zmq::PUB).unwrap();
        publisher.bind("tcp://127.0.0.1:*").unwrap();
        let endpoint = publisher.get_last_endpoint().unwrap().unwrap();
        let record = serde_json::json!({"type": "EventChannel",
            "scope": {"kind": "endpoint", "endpoint": {"namespace": "dynamo", "component": "backend", "name": "generate"}},
            "topic": "kv-events", "instance_id": 0xabcu64,
            "transport": {"kind": "Zmq", "config": {"endpoint": endpoint}}});
        let mut record = parse_event_channel(record.to_string().as_bytes()).unwrap();
        let mut load = record.clone();
        load.topic = "kv_metrics".into();
        load.publisher_id = 0xdef;
        record.worker = Some(WORKER);
        let plane = start(state.clone(), false).unwrap();
        plane.entry(0).publishers(vec![record, load]);

        let render = || state.render_metrics();
        let wait = |what: &str, ok: &dyn Fn(&str) -> bool, send: &dyn Fn()| {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                send();
                std::thread::sleep(Duration::from_millis(50));
                let text = render();
                if ok(&text) {
                    return;
                }
                assert!(Instant::now() < deadline, "{what}: {text}");
            }
        };
        let events = rmp_serde::to_vec_named(&vec![stored(1, &[1, 2, 3])]).unwrap();
        // Sent until the subscription is through (a PUB drops what nobody subscribed to yet);
        // the duplicates are skipped by their sequence number.
        wait(
            "indexed",
            &|t| t.contains("kvroute_index_blocks{worker=\"127.0.0.1:9000\"} 3"),
            &|| {
                publisher
                    .send_multipart(frames(0xabc, 5, "kv-events", events.clone()), 0)
                    .unwrap()
            },
        );
        let metrics = KvMetrics {
            worker_id: WORKER,
            dp_rank: 0,
            active_decode_blocks: None,
            active_prefill_tokens: None,
            kv_used_blocks: Some(42),
        };
        let body = rmp_serde::to_vec_named(&metrics).unwrap();
        wait(
            "load",
            &|t| t.contains("kvroute_kv_used_blocks{worker=\"127.0.0.1:9000\"} 42"),
            &|| {
                publisher
                    .send_multipart(frames(0xdef, 0, "kv_metrics", body.clone()), 0)
                    .unwrap()
            },
        );
        // Seq 6 and 7 lost: 8 arrives.
        let more = rmp_serde::to_vec_named(&vec![stored(2, &[4])]).unwrap();
        publisher
            .send_multipart(frames(0xabc, 8, "kv-events", more), 0)
            .unwrap();
        wait(
            "lost counted",
            &|t| {
                t.contains(
                    "kvroute_lost_messages_total{source=\"dynamo_zmq\",topic=\"kv-events\"} 2",
                )
            },
            &|| {},
        );
        publisher
            .send_multipart([b"kv-events".to_vec()], 0)
            .unwrap();
        wait(
            "decode error counted",
            &|t| t.contains("kvroute_decode_errors_total{source=\"dynamo_zmq\"} 1"),
            &|| {},
        );
        let sources = state.sources(Instant::now());
        let source = sources.iter().find(|s| s.kind == "dynamo-zmq").unwrap();
        assert!(source.events >= 2, "{source:?}");
        // The publisher goes away: the worker's entries are dropped.
        drop(publisher);
        wait(
            "entries dropped",
            &|t| t.contains("kvroute_index_blocks{worker=\"127.0.0.1:9000\"} 0"),
            &|| {},
        );
        assert!(render().contains("kind=\"disconnect\""), "{}", render());
    }
}
