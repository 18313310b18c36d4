//! vLLM KV events from ZMQ: one SUB socket per configured endpoint, sequence numbers checked
//! per worker, gaps filled from the engine's replay socket, and the replay buffer read at every
//! (re)connection so a sidecar started after its engines is not blind.
//!
//! What a sequence number can say (vLLM numbers its messages 0, 1, 2, … per process):
//! - the next one: apply;
//! - a jump: messages were lost (slow subscriber). Ask the replay socket for them and apply them
//!   in order; if it cannot give them all, the worker's index entries are stale: drop them and
//!   start over from this message (`resync`);
//! - the same or a smaller one: the engine restarted with an empty cache: drop its entries;
//!   right after a warm start, a live copy of a replayed message is skipped instead.
//!
//! What the connection says, when the endpoint has one publisher (connect mode, or a bound
//! socket with `worker` set): it closing means the engine stopped — its cache went with the
//! process — so its entries are dropped at once, with or without traffic (`disconnect`); it
//! (re)opening starts a warm start: the replay buffer from the beginning (`warm_start`).
//!
//! Transport: libzmq (the `zmq` crate, libzmq 4.3 built from source and linked in), the same
//! library vLLM publishes with. It reconnects by itself and reports connection changes on a
//! monitor socket; the pure-Rust `zeromq` crate left a connection to a restarted engine in
//! CLOSE-WAIT and never reported it (docs/architecture.md, "ZMQ"). libzmq's API blocks, so one
//! thread of the sidecar's own polls every endpoint's socket.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use kvroute_protocol::vllm::{decode_batch, decode_seq, EventBatch, GroupFilter, REPLAY_END};

use crate::config::ZmqConfig;
use crate::core::{Delivery, Happened, Input, Message, Publisher};
use crate::metrics::Transport;
use crate::sidecar::{Sidecar, Source};

/// How long a replay may take before it is given up (a gap then resyncs the worker).
const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);
/// Pause before building a new socket after one failed, doubling while it keeps failing.
const RETRY_DELAY: Duration = Duration::from_millis(500);
const RETRY_DELAY_MAX: Duration = Duration::from_secs(10);
/// libzmq's reconnect interval, doubling up to the maximum: a restarted engine is found within
/// a second of listening again.
const RECONNECT_IVL_MS: i32 = 100;
const RECONNECT_IVL_MAX_MS: i32 = 1000;
/// How many messages the SUB socket queues while a replay runs (vLLM's PUB allows 100000).
const RECEIVE_HWM: i32 = 100_000;

/// llm-d names the worker in the topic: `kv@<ip:port>@<model>`.
pub fn worker_in_topic(topic: &str) -> Option<&str> {
    let rest = topic.strip_prefix("kv@")?;
    let (address, _model) = rest.split_once('@')?;
    Some(address)
}

/// One message: (topic, sequence number, payload).
type Frames = (String, u64, Vec<u8>);

/// Split a live message (`[topic, seq, payload]`) or a replayed one (with a leading empty
/// delimiter frame when it came through a DEALER).
fn frames(mut parts: Vec<Vec<u8>>) -> Option<Frames> {
    if parts.len() == 4 && parts[0].is_empty() {
        parts.remove(0);
    }
    let [topic, seq, payload]: [_; 3] = parts.try_into().ok()?;
    Some((
        String::from_utf8_lossy(&topic).into_owned(),
        decode_seq(&seq).ok()?,
        payload,
    ))
}

/// Subscribe to one publisher: handed to the thread that polls every vLLM socket (started
/// with the first). The returned flag closes the subscription (within 100 ms).
pub fn spawn(config: ZmqConfig, state: Arc<Sidecar>) -> std::io::Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    let source = state.source(Transport::Zmq, &config.endpoint, vec![config.topic.clone()]);
    poller()?
        .send(Added {
            config,
            state,
            source,
            stop: Arc::clone(&stop),
        })
        .map_err(|_| std::io::Error::other("the ZMQ subscriber thread has ended"))?;
    Ok(stop)
}

/// A subscription for the polling thread.
struct Added {
    config: ZmqConfig,
    state: Arc<Sidecar>,
    source: Source,
    stop: Arc<AtomicBool>,
}

/// The polling thread's mailbox, the thread started on first use. One thread for every vLLM
/// socket, as the Dynamo ZMQ plane: a thread per socket, each woken per message, spent the
/// two cores on task switches and the core's lock under an event storm.
fn poller() -> std::io::Result<&'static mpsc::Sender<Added>> {
    static POLLER: OnceLock<mpsc::Sender<Added>> = OnceLock::new();
    if let Some(tx) = POLLER.get() {
        return Ok(tx);
    }
    let (tx, rx) = mpsc::channel();
    // Two first callers at once: the loser's thread ends with its channel.
    std::thread::Builder::new()
        .name("zmq-subscribers".into())
        .spawn(move || poll_all(&rx))?;
    Ok(POLLER.get_or_init(|| tx))
}

/// Messages one socket hands over before the others get their turn.
const FAIR_SHARE: usize = 256;

/// Poll every subscription's sockets and serve what is ready, forever. A replay (a gap filled,
/// a warm start) holds the thread for as long as it takes (`REPLAY_TIMEOUT` at most); the
/// other sockets queue meanwhile (`RECEIVE_HWM` messages each).
fn poll_all(rx: &mpsc::Receiver<Added>) {
    let context = zmq::Context::new();
    let mut subscribers: Vec<Subscriber> = Vec::new();
    loop {
        if subscribers.is_empty() {
            match rx.recv() {
                Ok(added) => subscribers.push(Subscriber::new(added, &context)),
                Err(_) => return,
            }
        }
        while let Ok(added) = rx.try_recv() {
            subscribers.push(Subscriber::new(added, &context));
        }
        for closed in subscribers.extract_if(.., |s| s.stopped()) {
            closed.close();
        }
        let now = Instant::now();
        for s in subscribers.iter_mut() {
            if s.sockets.is_none() && now >= s.retry_at {
                if let Err(e) = s.open() {
                    s.broken(&e, now);
                }
            }
        }
        let ready = match ready(&subscribers) {
            Ok(ready) => ready,
            Err(e) => {
                tracing::error!(error = %e, "polling the vLLM KV-event sockets failed; trying again");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        for (s, (messages, events)) in subscribers.iter_mut().zip(ready) {
            if let Err(e) = s.serve(messages, events) {
                s.broken(&e, Instant::now());
            }
            if s.warm_start_waits && s.sockets.is_some() && s.worker_known() {
                s.warm_start();
            }
        }
    }
}

/// Which subscriptions' SUB socket (messages) and monitor (connection events) are readable,
/// within 100 ms.
fn ready(subscribers: &[Subscriber]) -> zmq::Result<Vec<(bool, bool)>> {
    let mut items = Vec::with_capacity(subscribers.len() * 2);
    for s in subscribers {
        if let Some(sockets) = &s.sockets {
            items.push(sockets.sub.as_poll_item(zmq::POLLIN));
            items.push(sockets.monitor.as_poll_item(zmq::POLLIN));
        }
    }
    if items.is_empty() {
        // Nothing open yet (every one waiting to retry): no socket to wait on.
        std::thread::sleep(Duration::from_millis(100));
    } else {
        zmq::poll(&mut items, 100)?;
    }
    let mut readable = items.iter().map(|i| i.is_readable());
    Ok(subscribers
        .iter()
        .map(|s| match s.sockets {
            Some(_) => (
                readable.next().unwrap_or(false),
                readable.next().unwrap_or(false),
            ),
            None => (false, false),
        })
        .collect())
}

/// A subscription's SUB socket and the monitor of its connections.
struct Sockets {
    sub: zmq::Socket,
    monitor: zmq::Socket,
}

/// One publisher's subscription.
struct Subscriber {
    config: Arc<ZmqConfig>,
    state: Arc<Sidecar>,
    source: Source,
    /// The polling thread's libzmq context (one I/O thread), shared by every SUB socket and
    /// replay request.
    context: zmq::Context,
    /// Open while it works; rebuilt at `retry_at` after it failed, the delay doubling while it
    /// keeps failing.
    sockets: Option<Sockets>,
    opened: Instant,
    retry_at: Instant,
    delay: Duration,
    /// Publishers (worker addresses) whose events arrived here.
    seen: BTreeSet<String>,
    /// Whether the current connection completed its handshake: only such a connection closing
    /// means an engine went away (one reset mid-handshake is a failed attempt, not a restart).
    handshaken: bool,
    /// The last warm start named a worker not known yet (a Dynamo instance whose discovery
    /// record has not been read): it runs again once the worker is known.
    warm_start_waits: bool,
    /// A hybrid model's cache groups: only its prefix-cache groups' events are indexed.
    groups: GroupFilter,
    /// Set when the subscription is to close (its host left Envoy's cluster).
    stop: Arc<AtomicBool>,
}

/// Monitor addresses are unique in the process: a closed socket's may not be free yet.
static MONITORS: AtomicUsize = AtomicUsize::new(0);

impl Subscriber {
    fn new(added: Added, context: &zmq::Context) -> Self {
        let now = Instant::now();
        Subscriber {
            config: Arc::new(added.config),
            state: added.state,
            source: added.source,
            context: context.clone(),
            sockets: None,
            opened: now,
            retry_at: now,
            delay: RETRY_DELAY,
            seen: BTreeSet::new(),
            handshaken: false,
            warm_start_waits: false,
            groups: GroupFilter::default(),
            stop: added.stop,
        }
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    fn close(self) {
        tracing::info!(endpoint = %self.config.endpoint, worker = ?self.config.worker, "KV-event subscriber closed");
        self.source.retire();
    }

    /// The SUB socket and its monitor, connected (or bound) and subscribed.
    fn open(&mut self) -> anyhow::Result<()> {
        let config = Arc::clone(&self.config);
        let socket = self.context.socket(zmq::SUB)?;
        socket.set_rcvhwm(RECEIVE_HWM)?;
        socket.set_maxmsgsize(i64::try_from(config.max_message_bytes).unwrap_or(i64::MAX))?;
        socket.set_reconnect_ivl(RECONNECT_IVL_MS)?;
        socket.set_reconnect_ivl_max(RECONNECT_IVL_MAX_MS)?;
        // A publisher whose host vanished sends no FIN; keepalive finds it within ~16 s.
        socket.set_tcp_keepalive(1)?;
        socket.set_tcp_keepalive_idle(10)?;
        socket.set_tcp_keepalive_intvl(2)?;
        socket.set_tcp_keepalive_cnt(3)?;
        let monitor_address = format!(
            "inproc://kvroute-zmq-monitor-{}",
            MONITORS.fetch_add(1, Ordering::Relaxed)
        );
        let events = [
            zmq::SocketEvent::HANDSHAKE_SUCCEEDED,
            zmq::SocketEvent::DISCONNECTED,
            zmq::SocketEvent::CONNECT_RETRIED,
            zmq::SocketEvent::HANDSHAKE_FAILED_NO_DETAIL,
            zmq::SocketEvent::HANDSHAKE_FAILED_PROTOCOL,
            zmq::SocketEvent::HANDSHAKE_FAILED_AUTH,
        ];
        let mask = events.iter().fold(0u16, |m, e| m | *e as u16);
        socket.monitor(&monitor_address, mask.into())?;
        let monitor = self.context.socket(zmq::PAIR)?;
        monitor.connect(&monitor_address)?;
        if config.bind {
            socket
                .bind(&config.endpoint)
                .with_context(|| format!("binding {}", config.endpoint))?;
        } else {
            tracing::info!(endpoint = %config.endpoint, "connecting to vLLM KV-event publisher");
            socket
                .connect(&config.endpoint)
                .with_context(|| format!("connecting to {}", config.endpoint))?;
        }
        socket
            .set_subscribe(config.topic.as_bytes())
            .with_context(|| format!("subscribing to {:?}", config.topic))?;
        tracing::info!(endpoint = %config.endpoint, topic = %config.topic, "subscribed to vLLM KV events");
        self.source.subscribed();
        self.sockets = Some(Sockets {
            sub: socket,
            monitor,
        });
        self.opened = Instant::now();
        Ok(())
    }

    /// The sockets failed at `now`: said, closed, built again after the backoff (which starts
    /// over after a session that worked for a while).
    fn broken(&mut self, error: &anyhow::Error, now: Instant) {
        self.sockets = None;
        self.handshaken = false;
        if now.saturating_duration_since(self.opened) > RETRY_DELAY_MAX {
            self.delay = RETRY_DELAY;
        }
        self.failed(&format!("{error:#}; starting over in {:?}", self.delay));
        self.retry_at = now + self.delay;
        self.delay = (self.delay * 2).min(RETRY_DELAY_MAX);
    }

    /// What the poll found ready: connection events first, then up to a fair share of
    /// messages.
    fn serve(&mut self, messages: bool, events: bool) -> anyhow::Result<()> {
        if events {
            while let Some(event) = self.next_on(true)? {
                self.connection_event(&event);
            }
        }
        if messages {
            for _ in 0..FAIR_SHARE {
                let Some(parts) = self.next_on(false)? else {
                    break;
                };
                self.live(parts);
            }
        }
        Ok(())
    }

    /// The next message waiting on the monitor or the SUB socket, if any.
    fn next_on(&self, monitor: bool) -> anyhow::Result<Option<Vec<Vec<u8>>>> {
        let Some(s) = &self.sockets else {
            return Ok(None);
        };
        receive(if monitor { &s.monitor } else { &s.sub })
    }

    /// Whether the configured worker is in the fleet (a discovered one may not be yet).
    fn worker_known(&self) -> bool {
        let Some(worker) = self.config.worker.as_deref() else {
            return true;
        };
        self.state.serves(worker)
    }

    /// Does this endpoint's connection belong to one engine? Then its changes are that engine's.
    fn one_publisher(&self) -> bool {
        !self.config.bind || self.config.worker.is_some()
    }

    /// A monitor message: `[event u16 LE + value u32 LE, endpoint]`.
    fn connection_event(&mut self, parts: &[Vec<u8>]) {
        let Some(&[lo, hi, ..]) = parts.first().map(Vec::as_slice) else {
            return;
        };
        let event = zmq::SocketEvent::from_raw(u16::from_le_bytes([lo, hi]));
        let peer = parts
            .get(1)
            .map(|p| String::from_utf8_lossy(p).into_owned())
            .unwrap_or_default();
        match event {
            zmq::SocketEvent::DISCONNECTED if !self.handshaken => {
                self.failed(&format!(
                    "{peer}: connection closed before its ZMTP handshake completed"
                ));
            }
            zmq::SocketEvent::DISCONNECTED if self.one_publisher() => {
                self.handshaken = false;
                self.publisher_gone(&peer);
            }
            zmq::SocketEvent::DISCONNECTED => {
                self.handshaken = false;
                tracing::info!(endpoint = %self.config.endpoint, "a vLLM publisher disconnected from the bound socket; a restart shows when its sequence starts over");
            }
            zmq::SocketEvent::CONNECT_RETRIED => {
                self.failed("connection attempt failed (name not resolved, refused, or reset); libzmq retries every <= 1 s");
            }
            zmq::SocketEvent::HANDSHAKE_FAILED_NO_DETAIL
            | zmq::SocketEvent::HANDSHAKE_FAILED_PROTOCOL
            | zmq::SocketEvent::HANDSHAKE_FAILED_AUTH => {
                self.failed(&format!(
                    "{peer}: ZMTP handshake failed ({event:?}): not a ZMQ publisher, or a hostile or oversized frame"
                ));
            }
            zmq::SocketEvent::HANDSHAKE_SUCCEEDED => {
                self.handshaken = true;
                tracing::info!(endpoint = %self.config.endpoint, %peer, "vLLM KV-event publisher connected");
                self.source.subscribed();
                if self.one_publisher() {
                    self.warm_start();
                }
            }
            _ => {}
        }
    }

    fn failed(&self, error: &str) {
        self.source.failed(error);
    }

    /// The engine's connection closed: it stopped, and its cache with it.
    fn publisher_gone(&mut self, peer: &str) {
        tracing::info!(endpoint = %self.config.endpoint, %peer, "vLLM KV-event publisher disconnected");
        self.source.publisher_gone();
        for address in self.publishers() {
            self.ingest(Input::PublisherGone(Publisher::Address(&address)));
        }
    }

    /// The workers this endpoint publishes for: the configured one and every one seen.
    fn publishers(&self) -> BTreeSet<String> {
        let mut all = self.seen.clone();
        all.extend(self.config.worker.clone());
        all
    }

    fn ingest(&self, input: Input<'_>) -> Vec<Happened> {
        self.source
            .ingest(&self.config.endpoint, input, Instant::now())
    }

    /// Read the engine's replay buffer from its beginning and rebuild its workers from it: what
    /// the engine stored before the subscriber connected (a sidecar started after its engines,
    /// or a reconnect), in order. Live copies of replayed messages are skipped afterwards.
    fn warm_start(&mut self) {
        self.warm_start_waits = !self.worker_known();
        if self.warm_start_waits {
            tracing::info!(endpoint = %self.config.endpoint, worker = ?self.config.worker, "warm start waits until this worker is discovered");
            return;
        }
        let Some(replay_endpoint) = self.config.replay_endpoint.as_deref() else {
            tracing::info!(endpoint = %self.config.endpoint, "no replay_endpoint: no warm start; blocks the engine stored before now are unknown here, and their children are dropped as orphans until stored again");
            return;
        };
        let messages = match replay(&self.context, replay_endpoint, 0, None) {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(endpoint = %self.config.endpoint, replay = %replay_endpoint, error = format!("{e:#}"), "warm start failed; blocks the engine stored before now are unknown here until stored again");
                return;
            }
        };
        let Some((first, last)) = messages
            .first()
            .zip(messages.last())
            .map(|(f, l)| (f.1, l.1))
        else {
            tracing::info!(endpoint = %self.config.endpoint, "warm start: the engine's replay buffer is empty");
            return;
        };
        let mut replayed = BTreeSet::new();
        // Per stream: the message after which the replay continues what is applied already.
        let mut resume: HashMap<(String, u32), Option<u64>> = HashMap::new();
        for (topic, seq, payload) in &messages {
            let address = publisher_of(&self.config, topic).to_owned();
            let batch = self.decode(payload);
            let after = *resume
                .entry((address.clone(), batch.dp_rank))
                .or_insert_with(|| {
                    let applied = self.state.applied(&address, batch.dp_rank);
                    let after = resume_after(applied, first, last);
                    if let Some(a) = after {
                        tracing::info!(endpoint = %self.config.endpoint, worker = %address, after = a, "warm start continues what is indexed (restored from disk, or kept across the reconnect)");
                    }
                    after
                });
            if after.is_none_or(|a| *seq > a) {
                self.ingest(Input::Message(Message::vllm(
                    &address,
                    *seq,
                    Delivery::WarmStart,
                    &batch,
                )));
            }
            replayed.insert(address);
        }
        let lost = if first == 0 {
            "nothing lost".to_owned()
        } else {
            format!("seq 0..{first} no longer buffered: blocks stored then are unknown here until stored again (their children are dropped as orphans)")
        };
        tracing::info!(endpoint = %self.config.endpoint, messages = messages.len(), first, last, "warm start from the replay buffer: {lost}");
        for address in replayed {
            self.source.replayed(&address, messages.len() as u64);
            self.seen.insert(address);
        }
    }

    /// A payload's batch; one that does not decode is counted and applied as empty, so its
    /// sequence number still counts.
    fn decode(&mut self, payload: &[u8]) -> EventBatch {
        match decode_batch(payload) {
            Ok(mut batch) => {
                self.source.skipped(batch.skipped);
                self.source.unknown_fields(&batch.unknown_fields);
                let before = batch.events.len();
                batch.events.retain(|e| self.groups.keep(e));
                self.source
                    .other_groups((before - batch.events.len()) as u64);
                batch
            }
            Err(e) => {
                self.source
                    .undecodable(&self.config.endpoint, &e.to_string(), payload.len());
                EventBatch::default()
            }
        }
    }

    fn live(&mut self, parts: Vec<Vec<u8>>) {
        let bytes = parts.iter().map(Vec::len).sum();
        let Some((topic, seq, payload)) = frames(parts) else {
            self.source.received("", false);
            self.source
                .undecodable(&self.config.endpoint, "not [topic, seq, payload]", bytes);
            return;
        };
        self.source.received(&topic, true);
        let config = Arc::clone(&self.config);
        let address = publisher_of(&config, &topic);
        let batch = self.decode(&payload);
        let live = Message::vllm(address, seq, Delivery::LiveHoldingGaps, &batch);
        let happened = self.ingest(Input::Message(live));
        // Only publishers of known workers are remembered: topics come from the network.
        if !self.seen.contains(address)
            && !happened
                .iter()
                .any(|h| matches!(h, Happened::UnknownPublisher { .. }))
        {
            self.seen.insert(address.to_owned());
        }
        let held = happened.into_iter().find_map(|h| match h {
            Happened::Held { from, to, .. } => Some((from, to)),
            _ => None,
        });
        let Some((from, to)) = held else {
            return;
        };
        let missed = self
            .config
            .replay_endpoint
            .as_deref()
            .context("no replay_endpoint configured")
            .and_then(|endpoint| replay(&self.context, endpoint, from, Some(to)));
        match missed {
            Ok(missed) => {
                tracing::info!(worker = %address, from, to, "filled an event gap from the replay socket");
                self.source.gap_filled(address, missed.len() as u64);
                for (_, seq, payload) in &missed {
                    let batch = self.decode(payload);
                    let message = Message::vllm(address, *seq, Delivery::Replayed, &batch);
                    self.ingest(Input::Message(message));
                }
            }
            Err(e) => {
                tracing::warn!(worker = %address, from, to, error = format!("{e:#}"), "event gap not replayable");
                self.ingest(Input::GapUnfilled(Publisher::Address(address)));
            }
        }
        self.ingest(Input::Message(Message::vllm(
            address,
            seq,
            Delivery::Replayed,
            &batch,
        )));
    }
}

/// The publisher (worker address) a message belongs to: the configured one, or the one its
/// llm-d topic names, or else the topic itself (which names no worker).
fn publisher_of<'a>(config: &'a ZmqConfig, topic: &'a str) -> &'a str {
    config
        .worker
        .as_deref()
        .or_else(|| worker_in_topic(topic))
        .unwrap_or(topic)
}

/// The next multipart message, if one is waiting.
fn receive(socket: &zmq::Socket) -> anyhow::Result<Option<Vec<Vec<u8>>>> {
    match socket.recv_multipart(zmq::DONTWAIT) {
        Ok(parts) => Ok(Some(parts)),
        Err(zmq::Error::EAGAIN) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Where a warm start picks up a stream whose last applied message is `applied`, the replay
/// buffer holding `first..=last`: after `applied` when the buffer reaches back to it and the
/// engine got that far (the same engine, continued: nothing lost); `None` when the whole
/// buffer replaces the stream (nothing applied, messages lost in between, or an engine that
/// restarted and numbers from 0 again).
fn resume_after(applied: Option<u64>, first: u64, last: u64) -> Option<u64> {
    let a = applied?;
    (first <= a.saturating_add(1) && a <= last).then_some(a)
}

/// Ask a replay socket for its buffered messages from `from` (up to `to`, exclusive, when
/// given): consecutive, in order. A gap fill (`to` given) needs all of `from..to`; a warm start
/// takes whatever the buffer still holds.
fn replay(
    context: &zmq::Context,
    endpoint: &str,
    from: u64,
    to: Option<u64>,
) -> anyhow::Result<Vec<Frames>> {
    let socket = context.socket(zmq::DEALER)?;
    socket.set_linger(0)?;
    socket.connect(endpoint)?;
    socket.send_multipart([Vec::new(), from.to_be_bytes().to_vec()], 0)?;
    let deadline = Instant::now() + REPLAY_TIMEOUT;
    let mut out: Vec<Frames> = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        anyhow::ensure!(
            socket.poll(zmq::POLLIN, left.as_millis() as i64)? > 0,
            "replay timed out after {REPLAY_TIMEOUT:?}"
        );
        let parts = socket.recv_multipart(0)?;
        let (topic, seq, payload) = frames(parts).context("malformed replay reply")?;
        if seq == REPLAY_END {
            break;
        }
        if to.is_some_and(|to| seq >= to) {
            continue;
        }
        if let Some(previous) = out.last() {
            anyhow::ensure!(
                seq == previous.1 + 1,
                "replay skipped from {} to {seq}",
                previous.1
            );
        } else if to.is_some() {
            anyhow::ensure!(seq == from, "replay buffer starts at {seq}, needed {from}");
        }
        out.push((topic, seq, payload));
    }
    if let Some(to) = to {
        anyhow::ensure!(
            out.last().map_or(from, |m| m.1 + 1) == to,
            "replay ended before {to}"
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_warm_start_continues_a_stream_only_where_the_buffer_reaches_back() {
        assert_eq!(resume_after(None, 0, 9), None, "nothing applied: replace");
        assert_eq!(
            resume_after(Some(5), 0, 9),
            Some(5),
            "buffer covers 6..: continue"
        );
        assert_eq!(resume_after(Some(5), 6, 9), Some(5));
        assert_eq!(resume_after(Some(9), 3, 9), Some(9), "nothing new");
        assert_eq!(
            resume_after(Some(5), 7, 9),
            None,
            "6 no longer buffered: replace"
        );
        assert_eq!(
            resume_after(Some(50), 0, 9),
            None,
            "the engine restarted: replace"
        );
    }

    #[test]
    fn llm_d_topics_name_the_worker() {
        assert_eq!(
            worker_in_topic("kv@10.0.0.5:8000@meta-llama/Llama-3.1-8B"),
            Some("10.0.0.5:8000")
        );
        assert_eq!(worker_in_topic("kv-events"), None);
        assert_eq!(worker_in_topic("kv@nomodel"), None);
    }

    #[test]
    fn frames_of_live_and_replayed_messages() {
        let seq = 7u64.to_be_bytes().to_vec();
        let live = vec![b"kv-events".to_vec(), seq.clone(), b"x".to_vec()];
        assert_eq!(frames(live), Some(("kv-events".into(), 7, b"x".to_vec())));
        let replayed = vec![Vec::new(), b"t".to_vec(), seq, b"y".to_vec()];
        assert_eq!(frames(replayed), Some(("t".into(), 7, b"y".to_vec())));
        assert_eq!(
            frames(vec![b"t".to_vec(), b"short".to_vec(), Vec::new()]),
            None
        );
        assert_eq!(frames(vec![b"only".to_vec()]), None);
    }
}
