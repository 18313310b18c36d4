//! Is the event plane what it should be? Per-source counters for `GET /debug/sources`, and the
//! alarms for the classic silent failure: subscriptions that are healthy and receive nothing,
//! so routing quietly degrades to least-loaded.
//!
//! Alarms (each a `kvroute_alarm{alarm,subject}` gauge and one log line when it starts):
//! - `no_events`: no KV event from any source for `silence_s` while hints are being served;
//!   labelled with the subscriptions; with a NATS source it waits (at most [`PROBE_HOLD`]) for
//!   a look at the whole bus, so that its one line starts with where KV events *are* published
//!   (or that none are), then names what is subscribed and what else arrived;
//! - `silent_worker`: a worker was hinted `min_hints` times and has never published an event
//!   (`silence_s` after start): events disabled on that engine, or a wrong `dynamo_worker_id` /
//!   `[[zmq]]` entry;
//! - `no_instances`: a `[[dynamo_discovery]]` entry finds no instance to pin requests to while
//!   hint requests arrive: every request is left to the frontend's own routing;
//! - `no_publishers`: it finds instances but no KV-event publisher this sidecar reads (none
//!   registered: their engines publish no KV events; or only on NATS without a `[nats]`), and
//!   no KV event arrives;
//! - `discovery_unreachable`: its store (etcd, the file store) cannot be read: instances keep
//!   their last state, new ones are not found;
//! - `worker_quiet`: a worker that did publish was hinted `min_hints` times since its last event,
//!   `silence_s` ago, while other workers kept publishing: its event stream stopped.
//!
//! Orphan stores, sequence gaps, restarts and block-size mismatches have their own counters
//! and log lines where they happen.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::config::AlarmConfig;

/// One event source as `/debug/sources` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct SourceStatus {
    /// `nats` or `zmq`.
    pub kind: &'static str,
    /// URL or endpoint.
    pub name: String,
    /// What it subscribes to.
    pub subscriptions: Vec<String>,
    /// `connecting`, `subscribed`, `receiving`, `disconnected` (ZMQ: the publisher went away),
    /// `retrying` (the connection or the subscription keeps failing; see `last_error`),
    /// `closed` (its host left Envoy's cluster).
    pub state: &'static str,
    /// Failures so far (connection attempts, handshakes, sessions).
    pub errors: u64,
    /// What the last failure was.
    pub last_error: Option<String>,
    /// Messages received.
    pub messages: u64,
    /// KV events applied.
    pub events: u64,
    /// Messages that did not decode.
    pub decode_errors: u64,
    /// Messages per subject / topic.
    pub subjects: BTreeMap<String, u64>,
    /// Seconds since the last KV event (`None`: never).
    pub last_event_age_s: Option<f64>,
    /// NATS: messages per subject on the whole Dynamo bus (`namespace.>`) during the last probe,
    /// taken while no KV events arrive (see `sources::nats`).
    pub bus: BTreeMap<String, u64>,
    /// Seconds since that probe (`None`: never probed).
    pub bus_probe_age_s: Option<f64>,
    /// What that probe concluded: where KV events are published, or that none are.
    pub bus_verdict: Option<String>,
    /// Times the connection to the server was lost (NATS).
    pub disconnects: u64,
    /// How long the last outage lasted, or has lasted so far, in seconds.
    pub last_outage_s: Option<f64>,
    /// Messages the client library dropped before the sidecar read them (buffer full).
    pub client_dropped: u64,
    #[serde(skip)]
    down: Option<(Instant, Option<Instant>)>,
    #[serde(skip)]
    last_event: Option<Instant>,
    #[serde(skip)]
    bus_probed: Option<Instant>,
}

/// Every source and discovery entry. What workers published and were hinted is in the fleet
/// table ([`crate::core::fleet::Worker`]); [`Activity`] brings it here for the alarms.
#[derive(Debug)]
pub struct EventPlane {
    started: Instant,
    sources: Vec<SourceStatus>,
    /// Per `[[dynamo_discovery]]` entry: its model, the instances it can pin to and the line
    /// that says what its last scan found.
    discovery: Vec<DiscoveryStatus>,
    /// Dynamo worker ids whose KV events arrived but name no known worker (bounded), with
    /// counts: events that do arrive, so `no_events` must say so rather than "none".
    unknown_workers: BTreeMap<String, u64>,
    /// Subjects (or endpoints) events were applied from, as metrics label them.
    event_subjects: BTreeSet<String>,
    /// Event fields kvroute does not know that were seen (bounded), each said once.
    unknown_fields: BTreeSet<String>,
    /// Per (source, Dynamo publisher): the number its next message should carry.
    stamps: std::collections::HashMap<(usize, u64), u64>,
    /// Since when the `no_events` condition holds (`None`: it does not), as the alarm check
    /// last saw it: a bus probe older than this is of another episode.
    silent_since: Option<Instant>,
}

/// How long `no_events` waits for a probe of the bus (at most 5 s, `transports::nats`) that
/// started with the condition, so that its first line is the probe's verdict, not a guess.
pub const PROBE_HOLD: Duration = Duration::from_secs(8);

/// Dynamo publishers whose numbering is followed (publisher ids come from the network).
const MAX_STAMPED: usize = 65_536;

/// What a publisher's number for its message says, given the one expected next (Dynamo's
/// envelopes, on NATS and on the ZMQ event plane).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sequence {
    /// Its first message here.
    First,
    /// The one expected.
    Next,
    /// `lost` messages were skipped.
    Gap {
        /// How many.
        lost: u64,
    },
    /// One already received: skipped.
    Duplicate,
    /// Smaller than one already received: the publisher started over under the same id.
    Back,
}

/// Judge sequence number `seq` when `next` was expected.
pub fn judge(next: Option<u64>, seq: u64) -> Sequence {
    match next {
        None => Sequence::First,
        Some(n) if seq == n => Sequence::Next,
        Some(n) if seq > n => Sequence::Gap { lost: seq - n },
        Some(n) if seq.checked_add(1) == Some(n) => Sequence::Duplicate,
        Some(_) => Sequence::Back,
    }
}

/// Distinct subjects `kvroute_events_total` names; events on any further subject share
/// `subject="other"`.
const MAX_EVENT_SUBJECTS: usize = 256;

/// What one `[[dynamo_discovery]]` entry found, for `/debug/sources` and `no_instances`.
#[derive(Debug, Clone, Serialize)]
pub struct DiscoveryStatus {
    /// Where its records are read (`dir …`, `etcd …`).
    pub store: String,
    /// The model.
    pub model: String,
    /// Instances requests can be pinned to (`None`: not scanned yet).
    pub hintable: Option<usize>,
    /// What the last scan found.
    pub summary: String,
    /// `kv-events` publishers the last scan found: (on ZMQ, on NATS).
    pub kv_publishers: (usize, usize),
    /// Why the store cannot be read, while it cannot.
    pub unreachable: Option<String>,
    #[serde(skip)]
    failing_since: Option<Instant>,
}

/// An alarm that is on, and what its log line says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Alarm {
    /// `no_events` or `silent_worker`.
    pub name: &'static str,
    /// What it is about (the subscriptions, a model, a worker address).
    pub subject: String,
    /// The explanation for the log.
    pub message: String,
}

/// What the fleet did that the alarms weigh: from [`crate::core::Core`], at one moment.
#[derive(Debug, Clone, Default)]
pub struct Activity {
    /// When the last hint named a worker.
    pub last_hint: Option<Instant>,
    /// When the last hint request arrived, hinted or not.
    pub last_request: Option<Instant>,
    /// Per worker: its address, the hints it got since its last event (or ever), and when it
    /// last published.
    pub workers: Vec<(String, u64, Option<Instant>)>,
}

impl EventPlane {
    /// Nothing registered yet, as of `now`.
    pub fn new(now: Instant) -> Self {
        EventPlane {
            started: now,
            sources: Vec::new(),
            discovery: Vec::new(),
            unknown_workers: BTreeMap::new(),
            event_subjects: BTreeSet::new(),
            unknown_fields: BTreeSet::new(),
            stamps: std::collections::HashMap::new(),
            silent_since: None,
        }
    }

    /// Register a source; the returned index names it in later calls. A retired source's slot
    /// is taken again: hosts that come and go under Envoy's membership must not grow the list.
    pub fn register(
        &mut self,
        kind: &'static str,
        name: &str,
        subscriptions: Vec<String>,
    ) -> usize {
        let status = SourceStatus {
            kind,
            name: name.to_owned(),
            subscriptions,
            state: "connecting",
            errors: 0,
            last_error: None,
            messages: 0,
            events: 0,
            decode_errors: 0,
            subjects: BTreeMap::new(),
            last_event_age_s: None,
            bus: BTreeMap::new(),
            bus_probe_age_s: None,
            bus_verdict: None,
            disconnects: 0,
            last_outage_s: None,
            client_dropped: 0,
            down: None,
            last_event: None,
            bus_probed: None,
        };
        match self.sources.iter().position(|s| s.state == "closed") {
            Some(slot) => {
                self.sources[slot] = status;
                slot
            }
            None => {
                self.sources.push(status);
                self.sources.len() - 1
            }
        }
    }

    /// The source was closed for good (its host left Envoy's cluster): shown as `closed` until
    /// its slot is taken again.
    pub fn retire(&mut self, source: usize) {
        if let Some(s) = self.sources.get_mut(source) {
            s.state = "closed";
        }
    }

    /// The source's subscriptions are in place.
    pub fn subscribed(&mut self, source: usize) {
        if let Some(s) = self.sources.get_mut(source) {
            s.state = "subscribed";
        }
    }

    /// The source failed (`error` says how) and is retrying. Whether it was neither failing nor
    /// disconnected before: the edges log the first failure of a streak, not every retry.
    pub fn failed(&mut self, source: usize, error: String) -> bool {
        let Some(s) = self.sources.get_mut(source) else {
            return false;
        };
        // A publisher that went away stays `disconnected` while reconnecting fails: that was
        // logged when it left.
        let first = !matches!(s.state, "retrying" | "disconnected");
        if s.state != "disconnected" {
            s.state = "retrying";
        }
        s.errors += 1;
        s.last_error = Some(error);
        first
    }

    /// The source's publisher went away (its connection closed); the next one sets it back.
    pub fn disconnected(&mut self, source: usize) {
        if let Some(s) = self.sources.get_mut(source) {
            s.state = "disconnected";
        }
    }

    /// The connection to the source's server was lost at `now` (it reconnects by itself).
    pub fn connection_lost(&mut self, source: usize, now: Instant) {
        if let Some(s) = self.sources.get_mut(source) {
            s.state = "disconnected";
            s.disconnects += 1;
            s.down = Some((now, None));
        }
    }

    /// The connection is back at `now`: how long it was down, if it was.
    pub fn connection_back(&mut self, source: usize, now: Instant) -> Option<Duration> {
        let s = self.sources.get_mut(source)?;
        let (since, None) = s.down? else {
            return None;
        };
        s.down = Some((since, Some(now)));
        s.state = "subscribed";
        Some(now.saturating_duration_since(since))
    }

    /// Whether the source's connection is lost and not back yet.
    pub fn is_down(&self, source: usize) -> bool {
        self.sources
            .get(source)
            .is_some_and(|s| matches!(s.down, Some((_, None))))
    }

    /// The source's client dropped a message before the sidecar read it.
    pub fn client_dropped(&mut self, source: usize) {
        if let Some(s) = self.sources.get_mut(source) {
            s.client_dropped += 1;
        }
    }

    /// A message arrived on `subject`; `decoded` says whether it decoded.
    pub fn message(&mut self, source: usize, subject: &str, decoded: bool) {
        if let Some(s) = self.sources.get_mut(source) {
            s.messages += 1;
            if !decoded {
                s.decode_errors += 1;
            }
            // Bounded: a bus with endless distinct subjects must not grow this map forever.
            if let Some(n) = s.subjects.get_mut(subject) {
                *n += 1;
            } else if s.subjects.len() < 1000 {
                s.subjects.insert(subject.to_owned(), 1);
            }
        }
    }

    /// `n` KV events from `source`, on `subject`, were applied at `now`. Whether `subject` is
    /// one of the (bounded) subjects metrics may name: subjects come from the network.
    pub fn events(&mut self, source: usize, subject: &str, n: u64, now: Instant) -> bool {
        if let Some(s) = self.sources.get_mut(source) {
            s.events += n;
            s.state = "receiving";
            s.last_event = Some(now);
        }
        if self.event_subjects.contains(subject) {
            return true;
        }
        if self.event_subjects.len() < MAX_EVENT_SUBJECTS {
            self.event_subjects.insert(subject.to_owned());
            return true;
        }
        false
    }

    /// A Dynamo publisher's message numbered `sequence` arrived on `source`: how many messages
    /// its numbering skipped since the last one (0 for its first, a copy, or a number that went
    /// back: a new process).
    pub fn stamp(&mut self, source: usize, publisher: u64, sequence: u64) -> u64 {
        let key = (source, publisher);
        let next = self.stamps.get(&key).copied();
        if next.is_none() && self.stamps.len() >= MAX_STAMPED {
            return 0;
        }
        let verdict = judge(next, sequence);
        if verdict != Sequence::Duplicate {
            self.stamps.insert(key, sequence.saturating_add(1));
        }
        match verdict {
            Sequence::Gap { lost } => lost,
            _ => 0,
        }
    }

    /// An event field kvroute does not know was seen: whether for the first time (of the first
    /// 64 names: fields come from the network).
    pub fn unknown_field(&mut self, name: &str) -> bool {
        if self.unknown_fields.len() >= 64 || self.unknown_fields.contains(name) {
            return false;
        }
        self.unknown_fields.insert(name.to_owned())
    }

    /// A KV event arrived from a publisher (Dynamo worker id, vLLM topic) no configured or
    /// discovered worker is. Whether the name is among the (bounded) ones kept.
    pub fn unknown_worker(&mut self, name: &str) -> bool {
        let kept = self.unknown_workers.len() < 64 || self.unknown_workers.contains_key(name);
        if kept {
            *self.unknown_workers.entry(name.to_owned()).or_default() += 1;
        }
        kept
    }

    /// Register a `[[dynamo_discovery]]` entry; the returned index names it in later calls.
    pub fn register_discovery(&mut self, config: &crate::config::DiscoveryConfig) -> usize {
        self.discovery.push(DiscoveryStatus {
            store: config.store(),
            model: config.model.clone(),
            hintable: None,
            summary: "not scanned yet".into(),
            kv_publishers: (0, 0),
            unreachable: None,
            failing_since: None,
        });
        self.discovery.len() - 1
    }

    /// What a scan of discovery entry `entry` found.
    pub fn discovered(
        &mut self,
        entry: usize,
        hintable: usize,
        summary: String,
        kv_publishers: (usize, usize),
    ) {
        if let Some(d) = self.discovery.get_mut(entry) {
            d.hintable = Some(hintable);
            d.summary = summary;
            d.kv_publishers = kv_publishers;
            d.unreachable = None;
            d.failing_since = None;
        }
    }

    /// Discovery entry `entry` could not read its store at `now` (`error` says why).
    pub fn discovery_failed(&mut self, entry: usize, error: String, now: Instant) {
        if let Some(d) = self.discovery.get_mut(entry) {
            d.unreachable = Some(error);
            d.failing_since.get_or_insert(now);
        }
    }

    /// Every discovery entry's status.
    pub fn discovery(&self) -> Vec<DiscoveryStatus> {
        self.discovery.clone()
    }

    /// Every source's status, ages as of `now`.
    pub fn sources(&self, now: Instant) -> Vec<SourceStatus> {
        self.sources
            .iter()
            .map(|s| SourceStatus {
                last_event_age_s: s.last_event.map(|t| (now - t).as_secs_f64()),
                bus_probe_age_s: s.bus_probed.map(|t| (now - t).as_secs_f64()),
                last_outage_s: s
                    .down
                    .map(|(from, to)| (to.unwrap_or(now) - from).as_secs_f64()),
                ..s.clone()
            })
            .collect()
    }

    /// Record what a probe of the whole bus saw on behalf of `source`, and its verdict.
    pub fn record_bus(
        &mut self,
        source: usize,
        seen: BTreeMap<String, u64>,
        verdict: String,
        now: Instant,
    ) {
        if let Some(s) = self.sources.get_mut(source) {
            s.bus = seen;
            s.bus_verdict = Some(verdict);
            s.bus_probed = Some(now);
        }
    }

    /// Whether `source` should look at the whole bus at `now`: the `no_events` condition holds
    /// and its last look is older than `every` or than the condition (another episode's).
    pub fn bus_probe_due(&self, source: usize, every: Duration, now: Instant) -> bool {
        let Some(since) = self.silent_since else {
            return false;
        };
        match self.sources.get(source).and_then(|s| s.bus_probed) {
            None => true,
            Some(t) => t < since || now.saturating_duration_since(t) >= every,
        }
    }

    /// The `no_events` condition: no KV event on any source for `silence_s` (or since start)
    /// while hints were served recently.
    pub fn silent_while_hinting(
        &self,
        config: &AlarmConfig,
        last_hint: Option<Instant>,
        now: Instant,
    ) -> bool {
        let silence = Duration::from_secs(config.silence_s);
        let last_event = self.sources.iter().filter_map(|s| s.last_event).max();
        // "While hints are served": one in the silence window (at least the last 10 s).
        let hints_recently = last_hint.is_some_and(|t| {
            now.saturating_duration_since(t) < silence.max(Duration::from_secs(10))
        });
        self.quiet_since(last_event, now, silence) && hints_recently
    }

    /// Whether `no_events` waits for the bus probe of this episode: a NATS source that has
    /// not looked since the condition began, for at most [`PROBE_HOLD`].
    fn waiting_for_probe(&self, now: Instant) -> bool {
        let Some(since) = self.silent_since else {
            return false;
        };
        let nats = self.sources.iter().filter(|s| s.kind == "nats");
        let probed = nats
            .clone()
            .any(|s| s.bus_probed.is_some_and(|t| t >= since));
        nats.count() > 0 && !probed && now.saturating_duration_since(since) < PROBE_HOLD
    }

    /// Whether nothing happened for `silence` since `t` (`None`: since start).
    fn quiet_since(&self, t: Option<Instant>, now: Instant, silence: Duration) -> bool {
        now.saturating_duration_since(t.unwrap_or(self.started)) >= silence
    }

    /// The alarms that are on at `now`, given what the fleet did.
    pub fn alarms(
        &mut self,
        config: &AlarmConfig,
        activity: &Activity,
        now: Instant,
    ) -> Vec<Alarm> {
        let silence = Duration::from_secs(config.silence_s);
        let mut out = Vec::new();
        let last_event = self.sources.iter().filter_map(|s| s.last_event).max();
        let silent = self.silent_while_hinting(config, activity.last_hint, now);
        self.silent_since = match (silent, self.silent_since) {
            (false, _) => None,
            (true, None) => Some(now),
            (true, since) => since,
        };
        if silent && !self.waiting_for_probe(now) {
            let subscribed: Vec<String> = self
                .sources
                .iter()
                .flat_map(|s| {
                    // A NATS subject names itself; a ZMQ topic needs its endpoint.
                    s.subscriptions.iter().map(move |x| match s.kind {
                        "zmq" => format!("zmq:{} topic {x:?}", s.name),
                        kind => format!("{kind}:{x}"),
                    })
                })
                .collect();
            let has = |kind: &str| self.sources.iter().any(|s| s.kind == kind);
            let mut check = Vec::new();
            if has("nats") {
                check.push("the NATS subjects (component names change with disaggregated prefill/decode); `kvroute-sidecar tap --nats URL` lists every subject and component on the bus");
            }
            if has("zmq") {
                check.push("the ZMQ endpoints and topics (`/debug/sources` says whether each is connected); `kvroute-sidecar tap --zmq ENDPOINT` prints what one publishes");
            }
            if check.is_empty() {
                check.push("the configuration: no [nats] or [[zmq]] source is set up");
            }
            let seen: Vec<String> = self
                .sources
                .iter()
                .flat_map(|s| s.subjects.iter().map(|(k, n)| format!("{k} ({n})")))
                .collect();
            let on_bus: Vec<String> = self
                .sources
                .iter()
                .flat_map(|s| s.bus.iter().map(|(k, n)| format!("{k} ({n})")))
                .collect();
            let bus = if on_bus.is_empty() {
                String::new()
            } else {
                format!(
                    " On the whole bus at the last probe: [{}].",
                    on_bus.join(", ")
                )
            };
            let when = match last_event {
                Some(t) => format!("for {:.0} s", (now - t).as_secs_f64()),
                None => "since start".to_owned(),
            };
            let unknown = if self.unknown_workers.is_empty() {
                String::new()
            } else {
                let ids: Vec<String> = self
                    .unknown_workers
                    .iter()
                    .map(|(id, n)| format!("{id} ({n})"))
                    .collect();
                format!(
                    " KV events did arrive, from publishers kvroute does not know: [{}] — add them to [[workers]] (dynamo_worker_id) or find them with [[dynamo_discovery]].",
                    ids.join(", ")
                )
            };
            // This episode's probe verdict first: it says where the events are, or that none
            // are (an earlier episode's may no longer hold).
            let since = self.silent_since;
            let verdict: String = self
                .sources
                .iter()
                .filter(|s| s.bus_probed.is_some_and(|t| since.is_some_and(|x| t >= x)))
                .filter_map(|s| s.bus_verdict.as_deref())
                .map(|v| format!(" {v}."))
                .collect();
            out.push(Alarm {
                name: "no_events",
                subject: if subscribed.is_empty() {
                    "none".to_owned()
                } else {
                    subscribed.join(",")
                },
                message: format!(
                    "no KV events {when} while hints are being served: routing is load-only.{verdict} Subscribed: [{}]. Messages seen: [{}].{unknown}{bus} Check the engines publish KV events, and {}.",
                    subscribed.join(", "),
                    if seen.is_empty() { "none".to_owned() } else { seen.join(", ") },
                    check.join("; and "),
                ),
            });
        }
        let requests_recently = activity.last_request.is_some_and(|t| {
            now.saturating_duration_since(t) < silence.max(Duration::from_secs(10))
        });
        let reads_nats = self.sources.iter().any(|s| s.kind == "nats");
        // Dynamo before 1.4 registers no event channels and publishes on NATS all the same:
        // no publisher found is a fault only while no KV event arrives either.
        let no_events = self.quiet_since(last_event, now, silence);
        for d in &self.discovery {
            if let (Some(since), Some(error)) = (d.failing_since, &d.unreachable) {
                out.push(Alarm {
                    name: "discovery_unreachable",
                    subject: d.model.clone(),
                    message: format!(
                        "cannot read Dynamo's discovery records for model {} from {} for {:.0} s ({error}): pinned instances keep their last state (a dead one is still caught by its probe), new ones are not found. Check the store is reachable from the sidecar: etcd's client URL (the workers' ETCD_ENDPOINTS), or the file store's volume (DYN_FILE_KV).",
                        d.model,
                        d.store,
                        now.saturating_duration_since(since).as_secs_f64(),
                    ),
                });
                continue;
            }
            if d.hintable == Some(0) && requests_recently {
                out.push(Alarm {
                    name: "no_instances",
                    subject: d.model.clone(),
                    message: d.summary.clone(),
                });
            }
            let (zmq, nats) = d.kv_publishers;
            let unread = zmq == 0 && (nats == 0 || !reads_nats);
            if d.hintable.is_some_and(|n| n > 0) && unread && no_events && requests_recently {
                let why = match nats {
                    0 => "no worker registers a `kv-events` publisher: their engines publish no KV events (a worker started without them, or an engine without prefix caching), so the index stays empty and routing is load-only. Check the workers' KV-event settings".to_owned(),
                    n => format!("{n} workers publish their KV events on NATS (--event-plane nats) and this sidecar has no [nats] section: add one with the workers' NATS_SERVER"),
                };
                out.push(Alarm {
                    name: "no_publishers",
                    subject: d.model.clone(),
                    message: format!(
                        "Dynamo discovery for model {} ({}) finds {} instances to pin to but no KV-event publisher this sidecar reads: {why}.",
                        d.model,
                        d.store,
                        d.hintable.unwrap_or(0),
                    ),
                });
            }
        }
        // Only "never": a worker serving prompts it fully holds rightly publishes nothing.
        // The newest event of any worker: a worker gone quiet while others publish.
        let fleet_event = activity.workers.iter().filter_map(|w| w.2).max();
        for (worker, hints, last) in &activity.workers {
            let quiet = last.is_some_and(|t| now.saturating_duration_since(t) >= silence);
            let others_publish =
                fleet_event.is_some_and(|t| now.saturating_duration_since(t) < silence);
            if *hints >= config.min_hints && quiet && others_publish {
                out.push(Alarm {
                    name: "worker_quiet",
                    subject: worker.clone(),
                    message: format!(
                        "worker {worker} was hinted {hints} times since its last KV event {:.0} s ago while other workers keep publishing: its events stopped (engine restarted with events off, its publisher or subscription broke, or it serves only prompts it fully holds)",
                        last.map_or(0.0, |t| now.saturating_duration_since(t).as_secs_f64()),
                    ),
                });
            }
            if *hints >= config.min_hints && last.is_none() && self.quiet_since(None, now, silence)
            {
                out.push(Alarm {
                    name: "silent_worker",
                    subject: worker.clone(),
                    message: format!(
                        "worker {worker} was hinted {hints} times and never published a KV event: its engine has KV events off, or its dynamo_worker_id / [[zmq]] entry is wrong",
                    ),
                });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> AlarmConfig {
        AlarmConfig {
            silence_s: 0,
            min_hints: 2,
            ..AlarmConfig::default()
        }
    }

    /// A hint to nobody in particular at `now`.
    fn hinting(now: Instant) -> Activity {
        Activity {
            last_hint: Some(now),
            last_request: Some(now),
            workers: Vec::new(),
        }
    }

    #[test]
    fn a_publishers_skipped_numbers_are_its_lost_messages() {
        let mut plane = EventPlane::new(Instant::now());
        assert_eq!(plane.stamp(0, 7, 0), 0, "its first");
        assert_eq!(plane.stamp(0, 7, 1), 0);
        assert_eq!(plane.stamp(0, 7, 5), 3, "2, 3, 4 lost");
        assert_eq!(plane.stamp(0, 7, 5), 0, "a copy");
        assert_eq!(plane.stamp(0, 8, 9), 0, "another publisher's first");
        assert_eq!(plane.stamp(1, 7, 9), 0, "the same id on another source");
        assert_eq!(plane.stamp(0, 7, 0), 0, "went back: a new process");
        assert_eq!(plane.stamp(0, 7, 2), 1);
    }

    #[test]
    fn no_events_fires_only_while_hints_are_served() {
        let now = Instant::now();
        let mut plane = EventPlane::new(now);
        let src = plane.register("nats", "nats://x", vec!["a.kv-events".into()]);
        plane.subscribed(src);
        assert!(
            plane
                .alarms(&config(), &Activity::default(), now)
                .is_empty(),
            "no traffic, no alarm"
        );
        plane.message(src, "b.kv-events", true);
        // With NATS, the alarm waits for this episode's look at the bus...
        assert!(plane.alarms(&config(), &hinting(now), now).is_empty());
        assert!(plane.bus_probe_due(src, Duration::from_secs(30), now));
        let later = now + Duration::from_secs(2);
        let seen = BTreeMap::from([("b.kv-events".to_owned(), 4)]);
        let verdict = "KV events are published on [b.kv-events]".to_owned();
        plane.record_bus(src, seen, verdict, later);
        assert!(!plane.bus_probe_due(src, Duration::from_secs(30), later));
        // ...and its line opens with the verdict; the label is what is subscribed.
        let alarms = plane.alarms(&config(), &hinting(later), later);
        assert_eq!(alarms.len(), 1);
        assert_eq!(alarms[0].name, "no_events");
        assert_eq!(alarms[0].subject, "nats:a.kv-events");
        let line = &alarms[0].message;
        let (first, rest) = line.split_once(". ").unwrap();
        assert!(first.contains("routing is load-only"), "{line}");
        assert!(
            rest.starts_with("KV events are published on [b.kv-events]."),
            "{line}"
        );
        assert!(line.contains("nats:a.kv-events"), "{line}");
        assert!(line.contains("b.kv-events (1)"), "{line}");
        let quiet = AlarmConfig {
            silence_s: 3600,
            ..config()
        };
        plane.unknown_worker("77");
        let alarms = plane.alarms(&config(), &hinting(later), later);
        assert!(
            alarms[0].message.contains("does not know: [77 (1)]"),
            "events from unknown workers are named: {}",
            alarms[0].message
        );
        plane.events(src, "a.kv-events", 1, later);
        assert!(plane.alarms(&quiet, &hinting(later), later).is_empty());
        assert_eq!(plane.sources(later)[0].state, "receiving");
    }

    /// A probe that never comes (the NATS client is down) delays the alarm, never hides it; a
    /// probe of an earlier episode does not count.
    #[test]
    fn no_events_waits_for_a_probe_at_most_probe_hold() {
        let now = Instant::now();
        let mut plane = EventPlane::new(now);
        let src = plane.register("nats", "nats://x", vec!["a.kv-events".into()]);
        plane.record_bus(src, BTreeMap::new(), "old".into(), now);
        let t = now + Duration::from_secs(1);
        assert!(plane.alarms(&config(), &hinting(t), t).is_empty());
        assert!(plane.bus_probe_due(src, Duration::from_secs(30), t));
        let t = t + PROBE_HOLD;
        let alarms = plane.alarms(&config(), &hinting(t), t);
        assert_eq!(alarms.len(), 1, "{alarms:?}");
        assert!(
            !alarms[0].message.contains(" old."),
            "another episode's verdict is not repeated: {}",
            alarms[0].message
        );
        // The condition ends; a new episode waits again.
        assert!(plane.alarms(&config(), &Activity::default(), t).is_empty());
        assert!(!plane.bus_probe_due(src, Duration::from_secs(30), t));
        let t = t + Duration::from_secs(1);
        assert!(plane.alarms(&config(), &hinting(t), t).is_empty());
    }

    /// Hosts that come and go under Envoy's membership take the slots of those that left.
    #[test]
    fn closed_sources_give_their_slot_to_new_ones() {
        let now = Instant::now();
        let mut plane = EventPlane::new(now);
        let a = plane.register("zmq", "tcp://10.0.0.5:5557", vec![]);
        let b = plane.register("zmq", "tcp://10.0.0.6:5557", vec![]);
        plane.retire(a);
        assert_eq!(plane.sources(now)[a].state, "closed");
        let c = plane.register("zmq", "tcp://10.0.0.7:5557", vec![]);
        assert_eq!(c, a);
        assert_ne!(c, b);
        let sources = plane.sources(now);
        assert_eq!(sources.len(), 2);
        assert_eq!(sources[c].name, "tcp://10.0.0.7:5557");
        assert_eq!(sources[c].state, "connecting");
    }

    /// A ZMQ-only sidecar's line names each endpoint and suggests the ZMQ tap, not the NATS one.
    #[test]
    fn no_events_names_zmq_endpoints() {
        let now = Instant::now();
        let mut plane = EventPlane::new(now);
        plane.register("zmq", "tcp://10.0.0.5:5557", vec!["kv-events".into()]);
        plane.register("zmq", "tcp://10.0.0.6:5557", vec!["kv-events".into()]);
        let line = &plane.alarms(&config(), &hinting(now), now)[0].message;
        assert!(
            line.contains("zmq:tcp://10.0.0.5:5557 topic \"kv-events\""),
            "{line}"
        );
        assert!(line.contains("zmq:tcp://10.0.0.6:5557"), "{line}");
        assert!(
            line.contains("tap --zmq") && !line.contains("tap --nats"),
            "{line}"
        );
    }

    #[test]
    fn a_hinted_worker_that_never_publishes_is_named() {
        let now = Instant::now();
        let mut plane = EventPlane::new(now);
        let activity = Activity {
            workers: vec![("w0".into(), 0, Some(now)), ("w1".into(), 3, None)],
            ..hinting(now)
        };
        let slow = AlarmConfig {
            silence_s: 3600,
            min_hints: 2,
            ..AlarmConfig::default()
        };
        assert!(
            plane.alarms(&slow, &activity, now).is_empty(),
            "not long enough"
        );
        assert!(
            !plane
                .alarms(&slow, &activity, now + Duration::from_secs(3600))
                .is_empty(),
            "long enough"
        );
        let alarms = plane.alarms(&config(), &activity, now);
        let silent: Vec<_> = alarms
            .iter()
            .filter(|a| a.name == "silent_worker")
            .collect();
        assert_eq!(
            silent.len(),
            1,
            "only the one that never published: {alarms:?}"
        );
        assert_eq!(silent[0].subject, "w1");
        let few = Activity {
            workers: vec![("w1".into(), 1, None)],
            ..hinting(now)
        };
        let alarms = plane.alarms(&config(), &few, now);
        assert!(alarms.iter().all(|a| a.subject != "w1"), "{alarms:?}");
    }

    #[test]
    fn a_worker_that_stops_publishing_while_others_go_on_is_named() {
        let start = Instant::now();
        let mut plane = EventPlane::new(start);
        let config = AlarmConfig {
            silence_s: 30,
            min_hints: 2,
            ..AlarmConfig::default()
        };
        let now = start + Duration::from_secs(100);
        let quiet = |hints, others: Instant| Activity {
            workers: vec![
                ("w0".into(), 0, Some(others)),
                ("w1".into(), hints, Some(start + Duration::from_secs(10))),
            ],
            ..hinting(now)
        };
        let mut named = |a: &Activity| {
            plane
                .alarms(&config, a, now)
                .into_iter()
                .filter(|a| a.name == "worker_quiet")
                .map(|a| a.subject)
                .collect::<Vec<_>>()
        };
        assert_eq!(named(&quiet(5, now)), vec!["w1".to_owned()]);
        assert!(named(&quiet(1, now)).is_empty(), "too few hints since");
        assert!(
            named(&quiet(5, start + Duration::from_secs(20))).is_empty(),
            "everyone is quiet: that is no_events' business"
        );
    }

    #[test]
    fn discovery_without_instances_alarms_while_requests_arrive() {
        let now = Instant::now();
        let mut plane = EventPlane::new(now);
        let config = crate::config::DiscoveryConfig::new("/d", "m");
        let entry = plane.register_discovery(&config);
        plane.discovered(entry, 0, "found nothing under /d".into(), (0, 0));
        let on = |plane: &mut EventPlane, activity: &Activity| {
            plane
                .alarms(&AlarmConfig::default(), activity, now)
                .into_iter()
                .filter(|a| a.name == "no_instances")
                .collect::<Vec<_>>()
        };
        assert!(
            on(&mut plane, &Activity::default()).is_empty(),
            "no requests, no alarm"
        );
        let requested = Activity {
            last_request: Some(now),
            ..Activity::default()
        };
        let alarms = on(&mut plane, &requested);
        assert_eq!(alarms.len(), 1);
        assert_eq!(alarms[0].subject, "m");
        assert_eq!(alarms[0].message, "found nothing under /d");
        plane.discovered(entry, 2, "two".into(), (2, 0));
        assert!(on(&mut plane, &requested).is_empty());
    }

    /// Instances but no publisher this sidecar reads, and a store that cannot be read: each
    /// its own alarm, with the advice that fits first.
    #[test]
    fn discovery_plumbing_alarms_say_which_plumbing() {
        let now = Instant::now();
        let mut plane = EventPlane::new(now - Duration::from_secs(60));
        let config = crate::config::DiscoveryConfig::etcd(vec!["http://etcd:2379".into()], "m");
        let entry = plane.register_discovery(&config);
        let requested = Activity {
            last_request: Some(now),
            ..Activity::default()
        };
        let on = |plane: &mut EventPlane| {
            plane
                .alarms(
                    &AlarmConfig {
                        silence_s: 5,
                        ..AlarmConfig::default()
                    },
                    &requested,
                    now,
                )
                .into_iter()
                .filter(|a| a.name != "no_events")
                .map(|a| (a.name, a.message))
                .collect::<Vec<_>>()
        };
        plane.discovered(entry, 2, "two".into(), (0, 0));
        let alarms = on(&mut plane);
        assert_eq!(alarms.len(), 1, "{alarms:?}");
        assert_eq!(alarms[0].0, "no_publishers");
        assert!(alarms[0].1.contains("publish no KV events"), "{alarms:?}");
        plane.discovered(entry, 2, "two".into(), (0, 2));
        let alarms = on(&mut plane);
        assert!(alarms[0].1.contains("no [nats] section"), "{alarms:?}");
        let nats = plane.register("nats", "nats://x", vec![]);
        assert!(on(&mut plane).is_empty(), "NATS is read");
        plane.discovered(entry, 2, "two".into(), (0, 0));
        assert_eq!(on(&mut plane).len(), 1, "none registered");
        plane.events(nats, "a.kv-events", 1, now);
        assert!(
            on(&mut plane).is_empty(),
            "events arrive all the same (Dynamo before 1.4)"
        );
        plane.discovery_failed(
            entry,
            "connection refused".into(),
            now - Duration::from_secs(7),
        );
        let alarms = on(&mut plane);
        assert_eq!(alarms.len(), 1, "{alarms:?}");
        assert_eq!(alarms[0].0, "discovery_unreachable");
        assert!(
            alarms[0]
                .1
                .contains("etcd http://etcd:2379 for 7 s (connection refused)"),
            "{alarms:?}"
        );
        plane.discovered(entry, 2, "two".into(), (2, 0));
        assert!(on(&mut plane).is_empty(), "read again");
    }
}
