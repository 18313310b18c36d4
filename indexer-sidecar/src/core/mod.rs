//! The pure core: the fleet table, the per-model indexes and the rules that change them. No
//! I/O, no clock, no logs, no metrics: every input comes through [`Core::ingest`] or
//! [`Core::hint`] with the time, and each returns what [`Happened`], which the edges
//! ([`crate::sidecar`]) turn into metrics and log lines. So every store and remove of every
//! source passes one place, and the whole core is unit-tested without sleeping.
//!
//! - [`fleet`]: one row per worker: id, address, model, origin, role, usability, load, cursors.
//! - [`block_map`]: one cache's blocks, engine hash → node, in the order they were stored.
//! - [`cursor`]: what a message's sequence number says (next, gap, duplicate, restart).
//! - [`digest`]: per cache, its blocks' digest after each message: what replicas compare.
//! - [`event`]: [`event::KvEvent`], an engine's cache event whatever its wire format.
//! - [`holders`]: node → the caches holding it, inline for all but crowded nodes.
//! - [`index`]: [`index::RadixIndex`], prefix → caches holding it, one per model.
//! - [`load`]: a worker's load (open tickets, scrapes, Dynamo `kv_metrics`, Envoy).
//! - [`policy`]: the routing rule: matches and load → workers, best first.
//! - [`shared_prefix`]: which matched prefixes requests branch off in different ways (popular).
//! - [`truth`]: what the engines said they had cached, beside what the hints predicted.

pub mod block_map;
pub mod cursor;
pub mod digest;
pub mod event;
pub mod fleet;
pub mod holders;
pub mod index;
mod ledger;
pub mod load;
pub mod policy;
pub mod shared_prefix;
pub mod truth;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_protocol::dynamo::{KvMetrics, RouterEvent};
use kvroute_protocol::hint::{Finished, HintRequest, Ticket, Usage};
use kvroute_protocol::vllm::EventBatch;

use crate::config::{Config, IndexConfig, RoutingConfig};
use cursor::Verdict;
use event::{EventTag, KvEvent, VllmEventProblem};
use fleet::{Fleet, Role, TicketKey, WorkerId};
use index::{ApplyOutcome, RadixIndex};
use load::{Closed, Expected, Load, Reclaimed};
use policy::Decision;
use truth::Prediction;

/// How an event names its publisher.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Publisher<'a> {
    /// A Dynamo instance id (`worker_id` of its events).
    Instance(u64),
    /// A worker address (a `[[zmq]]` entry's `worker`, or the llm-d topic).
    Address(&'a str),
}

impl Publisher<'_> {
    /// The publisher as a label value.
    pub fn name(&self) -> String {
        match self {
            Publisher::Instance(id) => id.to_string(),
            Publisher::Address(a) => (*a).to_owned(),
        }
    }
}

/// How a message arrived, which decides what a sequence number out of order means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// Live, from a plane that cannot replay (Dynamo on NATS core): a gap is counted, the
    /// message applied.
    Live,
    /// Live, from a publisher with a replay socket (vLLM): a gap holds the message
    /// ([`Happened::Held`]); the edge delivers the missing ones as [`Delivery::Replayed`] and
    /// this one again, or reports [`Input::GapUnfilled`] first.
    LiveHoldingGaps,
    /// Filling a gap: checked like a live message.
    Replayed,
    /// From a replay buffer's start at (re)connection: the first message of a run replaces what
    /// the worker's index held; live copies of the run are duplicates afterwards.
    WarmStart,
}

/// The payload of one message, decoded.
#[derive(Debug, Clone, Copy)]
pub enum Body<'a> {
    /// One Dynamo event (its `event_id` and `dp_rank` are the message's sequence and stream).
    Dynamo(&'a RouterEvent),
    /// One vLLM batch.
    Vllm(&'a EventBatch),
}

/// One message from an event source.
#[derive(Debug, Clone, Copy)]
pub struct Message<'a> {
    /// Who published it.
    pub from: Publisher<'a>,
    /// Its stream of that publisher: the data-parallel rank (Dynamo numbers each rank's events,
    /// vLLM publishes each rank on its own socket).
    pub stream: u32,
    /// Its sequence number on that stream.
    pub seq: u64,
    /// How it arrived.
    pub delivery: Delivery,
    /// What it says.
    pub body: Body<'a>,
    /// The Dynamo component (`namespace/component`) whose subject it came on: events naming a
    /// worker bound to another component are refused. `None` where the transport itself names
    /// the publisher (vLLM: the connection).
    pub component: Option<&'a str>,
}

impl<'a> Message<'a> {
    /// A Dynamo event, live from NATS on a subject of `component`.
    pub fn dynamo(event: &'a RouterEvent, component: Option<&'a str>) -> Self {
        Message {
            from: Publisher::Instance(event.worker_id),
            stream: event.event.dp_rank,
            seq: event.event.event_id,
            delivery: Delivery::Live,
            body: Body::Dynamo(event),
            component,
        }
    }

    /// A vLLM batch numbered `seq` by the publisher of `address`. vLLM publishes each
    /// data-parallel rank on its own socket with its own numbering: the rank is the stream.
    pub fn vllm(address: &'a str, seq: u64, delivery: Delivery, batch: &'a EventBatch) -> Self {
        Message {
            from: Publisher::Address(address),
            stream: batch.dp_rank,
            seq,
            delivery,
            body: Body::Vllm(batch),
            component: None,
        }
    }
}

/// One Dynamo instance a discovery scan found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiscoveredInstance {
    /// Its instance id.
    pub instance_id: u64,
    /// Its request-plane `ip:port`.
    pub address: String,
    /// Its role.
    pub role: Role,
    /// `namespace/component` of its record: the subjects its events come on.
    pub component: String,
    /// Blocks its KV cache holds, from its model card.
    pub capacity: Option<u64>,
}

/// One host of Envoy's `workers` cluster, as its admin endpoint shows it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HostView {
    /// Healthy by EDS, active health checks and outlier detection.
    pub healthy: bool,
    /// Requests in flight to it from this Envoy (`rq_active`).
    pub rq_active: f64,
}

/// Everything that changes the core, whichever edge it comes from.
#[derive(Debug, Clone, Copy)]
pub enum Input<'a> {
    /// A KV-event message.
    Message(Message<'a>),
    /// The publisher's connection closed: the engine stopped, its cache with it.
    PublisherGone(Publisher<'a>),
    /// A held gap could not be filled: the worker's entries are stale; start it over.
    GapUnfilled(Publisher<'a>),
    /// A scrape of a configured worker's engine metrics (`None`: it failed).
    Scrape {
        /// The worker scraped.
        worker: WorkerId,
        /// What it reported.
        load: Option<Load>,
        /// Blocks its KV cache holds, when it says (`vllm:cache_config_info`).
        capacity: Option<u64>,
        /// When it was asked for: the engine's counts are from then or later.
        asked: Instant,
    },
    /// A Dynamo worker's `kv_metrics`, from a subject of `component`.
    DynamoLoad {
        /// The message.
        metrics: &'a KvMetrics,
        /// `namespace/component` of its subject.
        component: Option<&'a str>,
    },
    /// Envoy's view of the `workers` cluster, by `ip:port`.
    EnvoyView(&'a HashMap<String, HostView>),
    /// The hosts an Envoy cluster of `[[envoy.members]]` lists, serving `model`: those not in
    /// the fleet join it (those that left are the Envoy view's to retire).
    Members {
        /// The entry's model.
        model: &'a str,
        /// Every host listed, `ip:port`.
        hosts: &'a [String],
    },
    /// One scan of a `[[dynamo_discovery]]` entry: its model, the instances with a record, and
    /// those whose request plane refuses connections.
    Discovery {
        /// The entry's model.
        model: &'a str,
        /// Every instance with a record.
        instances: &'a [DiscoveredInstance],
        /// Instances whose probes fail.
        unreachable: &'a BTreeSet<u64>,
    },
    /// Hinted requests that finished, with what their responses said.
    Finished(&'a [Finished]),
    /// A peer's snapshot of a cache (the worker's address and rank), to repair ours.
    Snapshot {
        /// The worker's address.
        worker: &'a str,
        /// The rank.
        rank: u32,
        /// The cache.
        snapshot: &'a digest::Snapshot,
        /// Whether the peer's copy was clean (else ours stays unclean: both converged on a
        /// copy that lost messages).
        clean: bool,
    },
    /// A cache as this sidecar saved it on disk before it stopped (the worker's address and
    /// rank): its entries, until the events after it say otherwise. Unclean: events while the
    /// sidecar was down may be missing (a vLLM replay that reaches back to it continues it).
    Restore {
        /// The worker's address.
        worker: &'a str,
        /// The rank.
        rank: u32,
        /// The cache.
        snapshot: &'a digest::Snapshot,
    },
    /// Messages of a cache (the worker's address and rank) that this replica lost, as a peer
    /// applied them: (sequence number, events).
    Fill {
        /// The worker's address.
        worker: &'a str,
        /// The rank.
        rank: u32,
        /// The messages.
        messages: &'a [(u64, Vec<KvEvent>)],
    },
    /// A peer replica's requests in flight per worker (address, count): every worker it does
    /// not list has none of its requests.
    PeerLoad {
        /// The peer's id.
        peer: &'a str,
        /// Its counts.
        in_flight: &'a [(String, u32)],
        /// Its own survival estimates (address, share): every worker it does not list, it has
        /// none for.
        survival: &'a [(String, f64)],
    },
    /// Time passed: tickets past their lifetime expire, whether or not their worker is ever
    /// scraped (a lost finished-report must not load a worker forever).
    Tick,
}

/// Where a snapshot being installed comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SnapshotFrom {
    /// A peer ([`Input::Snapshot`]); `clean`: its copy lost nothing for good.
    Peer {
        /// Whether the copy is clean.
        clean: bool,
    },
    /// This sidecar's disk, before it restarted ([`Input::Restore`]).
    Disk,
}

/// A worker as outcomes name it: cheap to copy around, readable in logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Name {
    /// Its id.
    pub id: WorkerId,
    /// Its address.
    pub address: Arc<str>,
}

/// Why a worker's index entries were dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forgot {
    /// Its sequence went back: the engine restarted with an empty cache.
    Restarted,
    /// Its publisher's connection closed.
    PublisherGone,
    /// Missing events could not be replayed.
    Resync,
    /// A warm start rebuilds it from the replay buffer.
    WarmStart,
    /// Unusable for longer than the grace period.
    Unusable,
}

/// Why a message naming a known worker was not applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rejected {
    /// It came on another component's subject than the worker's: whoever published it may
    /// publish there, not as this worker.
    WrongComponent {
        /// The worker's component.
        expected: String,
        /// The subject's.
        got: String,
    },
    /// A data-parallel rank beyond the worker's first `limit`.
    TooManyRanks {
        /// The rank.
        rank: u32,
        /// `[index] max_ranks_per_worker`.
        limit: u32,
    },
    /// A Dynamo event for a worker whose engine is read over ZMQ (a `[[zmq]]` entry names it):
    /// Dynamo's relay copies those events to NATS under its own numbering, so applying both
    /// would apply each event twice on two cursors.
    ReadOverZmq,
}

/// How a ticket was closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TicketClosed {
    /// Reported finished.
    Finished,
    /// Reported, but not open (twice, reclaimed, or issued by an earlier process).
    Unknown,
    /// A scrape showed fewer requests than tickets.
    Reclaimed,
    /// Past its lifetime.
    Expired,
}

impl TicketClosed {
    /// The label value.
    pub fn label(self) -> &'static str {
        match self {
            TicketClosed::Finished => "finished",
            TicketClosed::Unknown => "unknown",
            TicketClosed::Reclaimed => "reclaimed",
            TicketClosed::Expired => "expired",
        }
    }
}

/// What an input did, for the edges to count and log.
#[derive(Debug, Clone, PartialEq)]
pub enum Happened {
    /// An event of `worker` was applied to its model's index.
    Applied {
        /// The worker.
        worker: Name,
        /// Stored, removed or cleared.
        kind: EventTag,
        /// What the index did.
        outcome: ApplyOutcome,
    },
    /// The worker's index holds this many blocks now.
    Holds {
        /// The worker.
        worker: Name,
        /// Its blocks (all ranks).
        blocks: usize,
    },
    /// A message's sequence number was not simply the next one.
    Sequence {
        /// The worker.
        worker: Name,
        /// What it said.
        verdict: Verdict,
        /// The message's number.
        seq: u64,
        /// How it arrived.
        delivery: Delivery,
    },
    /// A live message waits for `from..to` ([`Delivery::LiveHoldingGaps`]).
    Held {
        /// The worker.
        worker: Name,
        /// First missing.
        from: u64,
        /// The held message.
        to: u64,
    },
    /// A worker's index entries were dropped.
    Forgot {
        /// The worker.
        worker: Name,
        /// Blocks dropped.
        blocks: usize,
        /// Why.
        why: Forgot,
    },
    /// A vLLM event that is not indexed.
    Refused {
        /// The worker.
        worker: Name,
        /// Why.
        problem: VllmEventProblem,
    },
    /// A message naming a known worker was refused.
    Rejected {
        /// The worker it names.
        worker: Name,
        /// Why.
        why: Rejected,
    },
    /// A worker without a configured component is bound to the first one its events came on.
    Bound {
        /// The worker.
        worker: Name,
        /// `namespace/component`.
        component: String,
    },
    /// What a worker's engine says one of its caches holds at most, first said or changed.
    Capacity {
        /// The worker.
        worker: Name,
        /// Blocks.
        blocks: u64,
    },
    /// A peer's snapshot of a cache arrived.
    Repaired {
        /// The worker's address.
        worker: String,
        /// The rank.
        rank: u32,
        /// Installed (or refused: this replica no longer keeps the events after it).
        installed: bool,
        /// Blocks in the snapshot.
        blocks: usize,
    },
    /// A cache saved on disk was put back (or refused: events since arrived first).
    Restored {
        /// The worker's address.
        worker: String,
        /// The rank.
        rank: u32,
        /// Installed.
        installed: bool,
        /// Blocks in it.
        blocks: usize,
        /// The last message applied to it when it was saved.
        seq: u64,
    },
    /// Messages this replica lost, handed over by a peer and applied in their place.
    Filled {
        /// The worker.
        worker: Name,
        /// The rank.
        rank: u32,
        /// Messages filled in.
        messages: usize,
    },
    /// Lost messages no peer handed over in time: the cache is unclean until a clean peer's
    /// snapshot repairs it.
    Unfilled {
        /// The worker.
        worker: Name,
        /// The rank.
        rank: u32,
        /// Messages given up on.
        messages: usize,
    },
    /// A message from a publisher no configured or discovered worker is.
    UnknownPublisher {
        /// How it named itself.
        name: String,
    },
    /// A discovery scan of `model` found these instances per role.
    Scanned {
        /// The entry's model.
        model: String,
        /// Instances with a record, per role.
        roles: [(Role, usize); 3],
    },
    /// A host of an Envoy cluster joined the fleet.
    Joined {
        /// The new worker.
        worker: Name,
        /// The model it serves.
        model: String,
    },
    /// Discovery added a worker.
    Added {
        /// The new worker.
        worker: Name,
        /// Its instance id.
        instance_id: u64,
        /// Its role.
        role: Role,
    },
    /// Whether a worker is usable, said on every view of it.
    Usable {
        /// The worker.
        worker: Name,
        /// Usable now.
        usable: bool,
        /// Whether that changed with this view.
        changed: bool,
        /// Why not, when not.
        why: &'static str,
    },
    /// A hinted request finished: what its hint predicted the worker held, and what the
    /// engine's response said.
    Served {
        /// Its ticket.
        ticket: Ticket,
        /// The worker it was hinted to.
        worker: Name,
        /// Predicted cached prompt tokens (matched blocks × block size).
        predicted_tokens: u64,
        /// The response's usage.
        usage: Usage,
        /// How the prediction compared, when the usage says.
        prediction: Option<Prediction>,
    },
    /// Tickets were closed.
    Tickets {
        /// How.
        how: TicketClosed,
        /// How many.
        n: u64,
    },
    /// The load of a worker changed.
    Load {
        /// The worker.
        worker: Name,
        /// Its load now.
        load: Load,
        /// Whether Dynamo's `kv_metrics` changed it (queued prefill, KV blocks used).
        from_dynamo: bool,
    },
}

/// A hint, decided.
#[derive(Debug, Clone)]
pub struct Hint {
    /// The decision, with the workers considered.
    pub decision: Decision,
    /// The ticket counted against the first worker.
    pub ticket: Option<Ticket>,
    /// How the request is steered.
    pub target: Target,
    /// What else happened (finished tickets, the in-flight count).
    pub happened: Vec<Happened>,
}

/// How a hint names its workers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// No usable worker: Envoy's fallback decides.
    None,
    /// Envoy's `override_host`: addresses, best first.
    Addresses(Vec<Arc<str>>),
    /// A Dynamo frontend's instance header.
    Instance(u64),
    /// A Dynamo frontend's prefill-instance header (disaggregated).
    Prefill(u64),
}

/// The hint request names a model without an index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnknownModel;

/// The fleet and its indexes.
#[derive(Debug)]
pub struct Core {
    fleet: Fleet,
    indexes: HashMap<String, RadixIndex>,
    block_sizes: HashMap<String, u32>,
    routing: RoutingConfig,
    limits: IndexConfig,
    tickets: TicketKey,
    grace_period: Duration,
    /// A ticket this old was at the engine when it was scraped: the scrape interval, at least
    /// [`load::REACHES_ENGINE_WITHIN`].
    settle: Duration,
    next_ticket: u64,
    /// When the last hint named a worker.
    last_hint: Option<Instant>,
    /// When the last hint request arrived, hinted or not.
    last_request: Option<Instant>,
    /// How long a lost message is waited for from peers ([`crate::config::ReplicasConfig`]);
    /// `None` without peers to repair from: a loss makes the cache unclean at once.
    fill_timeout: Option<Duration>,
    /// How long a peer's shared in-flight counts are believed without news.
    peer_load_ttl: Duration,
    /// The workers `[[zmq]]` entries name: their events come from ZMQ only.
    read_over_zmq: HashSet<String>,
    /// The prefixes recent hints matched up to, and how their requests went on.
    shared_prefixes: shared_prefix::SharedPrefixes,
    /// Decode instances discovery found, per model: never hinted, but known — their load
    /// reports and KV events are theirs, not an unknown publisher's.
    decode_instances: HashMap<String, HashSet<u64>>,
}

impl Core {
    /// The configured workers and an empty index per model; tickets sealed with `ticket_key`
    /// (random per process).
    pub fn new(config: &Config, ticket_key: u64) -> Self {
        Core {
            fleet: Fleet::new(&config.workers),
            indexes: config
                .models
                .iter()
                .map(|m| (m.name.clone(), RadixIndex::default()))
                .collect(),
            block_sizes: config
                .models
                .iter()
                .map(|m| (m.name.clone(), m.block_size))
                .collect(),
            routing: config.routing.clone(),
            limits: config.index.clone(),
            tickets: TicketKey(ticket_key),
            grace_period: Duration::from_millis(
                config.envoy.as_ref().map_or(30_000, |e| e.grace_period_ms),
            ),
            settle: Duration::from_millis(config.routing.scrape_interval_ms)
                .max(load::REACHES_ENGINE_WITHIN),
            next_ticket: 1,
            last_hint: None,
            last_request: None,
            fill_timeout: config
                .replicas
                .as_ref()
                .filter(|r| r.reconcile)
                .map(|r| r.fill_timeout()),
            peer_load_ttl: config
                .replicas
                .as_ref()
                .map_or(Duration::ZERO, |r| r.peer_load_ttl()),
            read_over_zmq: config.zmq.iter().filter_map(|z| z.worker.clone()).collect(),
            shared_prefixes: shared_prefix::SharedPrefixes::default(),
            decode_instances: HashMap::new(),
        }
    }

    /// The workers.
    pub fn fleet(&self) -> &Fleet {
        &self.fleet
    }

    /// The index of `model`.
    pub fn index(&self, model: &str) -> Option<&RadixIndex> {
        self.indexes.get(model)
    }

    /// When the last hint named a worker, and when the last hint request arrived.
    pub fn last_hints(&self) -> (Option<Instant>, Option<Instant>) {
        (self.last_hint, self.last_request)
    }

    fn name(&self, id: WorkerId) -> Name {
        Name {
            id,
            address: self
                .fleet
                .get(id)
                .map_or_else(|| Arc::from(""), |w| Arc::clone(&w.address)),
        }
    }

    fn resolve(&self, from: Publisher<'_>) -> Option<WorkerId> {
        match from {
            Publisher::Instance(id) => self.fleet.by_instance_id(id),
            Publisher::Address(a) => self.fleet.by_address(a),
        }
        .map(|w| w.id)
    }

    /// Apply one input at `now`.
    pub fn ingest(&mut self, input: Input<'_>, now: Instant) -> Vec<Happened> {
        let mut out = Vec::new();
        match input {
            Input::Message(m) => self.message(m, now, &mut out),
            Input::PublisherGone(from) | Input::GapUnfilled(from) => {
                let Some(id) = self.resolve(from) else {
                    return out;
                };
                let why = match input {
                    Input::PublisherGone(_) => Forgot::PublisherGone,
                    _ => Forgot::Resync,
                };
                self.forget(id, why, &mut out);
            }
            Input::Scrape {
                worker,
                load,
                capacity,
                asked,
            } => {
                let settle = self.settle;
                self.learn_capacity(worker, capacity, &mut out);
                let Some(w) = self.fleet.get_mut(worker) else {
                    return out;
                };
                let reclaimed = w.load.scraped(load, asked, settle);
                Self::reclaimed(reclaimed, &mut out);
                let load = w.current_load();
                out.push(Happened::Load {
                    worker: self.name(worker),
                    load,
                    from_dynamo: false,
                });
            }
            Input::DynamoLoad { metrics, component } => {
                self.dynamo_load(metrics, component, &mut out)
            }
            Input::EnvoyView(hosts) => self.envoy_view(hosts, now, &mut out),
            Input::Members { model, hosts } => self.members(model, hosts, &mut out),
            Input::Discovery {
                model,
                instances,
                unreachable,
            } => self.discovery(model, instances, unreachable, now, &mut out),
            Input::Finished(tickets) => self.finished(tickets, now, &mut out),
            Input::Snapshot {
                worker,
                rank,
                snapshot,
                clean,
            } => {
                let from = SnapshotFrom::Peer { clean };
                let installed = self.install(worker, rank, snapshot, from, &mut out);
                out.push(Happened::Repaired {
                    worker: worker.to_owned(),
                    rank,
                    installed,
                    blocks: snapshot.entries.len(),
                });
            }
            Input::Restore {
                worker,
                rank,
                snapshot,
            } => {
                let installed = self.install(worker, rank, snapshot, SnapshotFrom::Disk, &mut out);
                out.push(Happened::Restored {
                    worker: worker.to_owned(),
                    rank,
                    installed,
                    blocks: snapshot.entries.len(),
                    seq: snapshot.seq,
                });
            }
            Input::Fill {
                worker,
                rank,
                messages,
            } => self.fill(worker, rank, messages, &mut out),
            Input::PeerLoad {
                peer,
                in_flight,
                survival,
            } => self.peer_load(peer, in_flight, survival, now, &mut out),
            Input::Tick => {
                self.expire(now, &mut out);
                self.give_up(now, &mut out);
                let ttl = self.peer_load_ttl;
                for w in self.fleet.iter_mut() {
                    w.load.expire_peers(now, ttl);
                }
            }
        }
        out
    }

    /// The worker a Dynamo message may speak for: it names a known worker, comes on that
    /// worker's component's subject (binding an unbound worker to it) and on one of its first
    /// `max_ranks_per_worker` ranks.
    fn admit(
        &mut self,
        from: Publisher<'_>,
        component: Option<&str>,
        rank: u32,
        out: &mut Vec<Happened>,
    ) -> Option<WorkerId> {
        let Some(id) = self.resolve(from) else {
            let decode = match from {
                Publisher::Instance(i) => self.decode_instances.values().any(|d| d.contains(&i)),
                Publisher::Address(_) => false,
            };
            if !decode {
                out.push(Happened::UnknownPublisher { name: from.name() });
            }
            return None;
        };
        let name = self.name(id);
        let limit = self.limits.max_ranks_per_worker;
        let worker = self.fleet.get_mut(id)?;
        match (&worker.component, component) {
            (Some(expected), Some(got)) if expected != got => {
                out.push(Happened::Rejected {
                    worker: name,
                    why: Rejected::WrongComponent {
                        expected: expected.clone(),
                        got: got.to_owned(),
                    },
                });
                return None;
            }
            (None, Some(got)) => {
                worker.component = Some(got.to_owned());
                out.push(Happened::Bound {
                    worker: name.clone(),
                    component: got.to_owned(),
                });
            }
            _ => {}
        }
        let known = worker.cursors.contains_key(&rank) || worker.load.has_rank(rank);
        if !known && rank >= limit {
            out.push(Happened::Rejected {
                worker: name,
                why: Rejected::TooManyRanks { rank, limit },
            });
            return None;
        }
        Some(id)
    }

    /// A worker's engine said how many blocks a cache holds.
    fn learn_capacity(&mut self, id: WorkerId, capacity: Option<u64>, out: &mut Vec<Happened>) {
        let Some(blocks) = capacity.filter(|&b| b > 0) else {
            return;
        };
        let name = self.name(id);
        if let Some(w) = self.fleet.get_mut(id) {
            if w.capacity != Some(blocks) {
                w.capacity = Some(blocks);
                out.push(Happened::Capacity {
                    worker: name,
                    blocks,
                });
            }
        }
    }

    fn message(&mut self, m: Message<'_>, now: Instant, out: &mut Vec<Happened>) {
        let Some(id) = self.admit(m.from, m.component, m.stream, out) else {
            return;
        };
        let Some(worker) = self.fleet.get_mut(id) else {
            return;
        };
        // Only its KV events: its `kv_metrics` (load) come from NATS alone.
        if matches!(m.body, Body::Dynamo(_)) && self.read_over_zmq.contains(worker.plane_address())
        {
            out.push(Happened::Rejected {
                worker: self.name(id),
                why: Rejected::ReadOverZmq,
            });
            return;
        }
        let model = worker.model.clone();
        let cursor = worker.cursors.entry(m.stream).or_default();
        let verdict = match m.delivery {
            Delivery::WarmStart => {
                // A replay continuing what is applied (the edge skips what it already has, as
                // after a restore from disk) extends it; any other replaces it.
                let continues = cursor.last.is_some_and(|l| m.seq == l.wrapping_add(1));
                cursor.warm_applied(m.seq);
                if continues {
                    Verdict::Next
                } else {
                    self.forget(id, Forgot::WarmStart, out);
                    Verdict::First
                }
            }
            _ => cursor.check(m.seq),
        };
        let name = self.name(id);
        if !verdict.in_order() {
            out.push(Happened::Sequence {
                worker: name.clone(),
                verdict,
                seq: m.seq,
                delivery: m.delivery,
            });
        }
        match verdict {
            Verdict::Duplicate => return,
            Verdict::Gap { from, to } if m.delivery == Delivery::LiveHoldingGaps => {
                out.push(Happened::Held {
                    worker: name,
                    from,
                    to,
                });
                return;
            }
            Verdict::Restarted => self.forget(id, Forgot::Restarted, out),
            _ => {}
        }
        if let Some(worker) = self.fleet.get_mut(id) {
            let cursor = worker.cursors.entry(m.stream).or_default();
            if m.delivery != Delivery::WarmStart {
                cursor.applied(m.seq);
            }
            worker.last_event = Some(now);
            worker.hints_since_event = 0;
        }
        let events: Vec<KvEvent> = match m.body {
            Body::Dynamo(e) => vec![KvEvent::from_dynamo(e)],
            Body::Vllm(batch) => {
                let block_size = self.block_sizes.get(&model).copied().unwrap_or(0);
                batch
                    .events
                    .iter()
                    .filter_map(|e| match KvEvent::from_vllm(e, batch.dp_rank, block_size) {
                        Ok(kv) => Some(kv),
                        Err(problem) => {
                            out.push(Happened::Refused {
                                worker: name.clone(),
                                problem,
                            });
                            None
                        }
                    })
                    .collect()
            }
        };
        // The loss is booked before the message is applied: a fill rebuilds from the cache as
        // it was just before the first lost message.
        self.book_loss(id, &model, &m, verdict, now);
        for kv in &events {
            self.apply(&name, &model, kv, out);
        }
        let index = self.indexes.get(&model);
        let (held, digest) = index.map_or((0, 0), |i| {
            i.cache_state(index::CacheId {
                worker: id,
                dp_rank: m.stream,
            })
        });
        if let Some(w) = self.fleet.get_mut(id) {
            let log = w.logs.entry(m.stream).or_default();
            let given_up = log.push(m.seq, events, held, digest);
            if given_up > 0 {
                out.push(Happened::Unfilled {
                    worker: name.clone(),
                    rank: m.stream,
                    messages: given_up,
                });
            }
        }
        let blocks = index.map_or(0, |i| i.blocks_of(id));
        out.push(Happened::Holds {
            worker: name,
            blocks,
        });
    }

    /// Per worker that finished hinted requests: predicted against reported cached tokens.
    pub fn served(&self) -> Vec<(String, truth::Truth)> {
        self.fleet
            .iter()
            .filter(|w| w.truth.total() > 0)
            .map(|w| (w.address.to_string(), w.truth))
            .collect()
    }

    fn apply(&mut self, worker: &Name, model: &str, event: &KvEvent, out: &mut Vec<Happened>) {
        let capacity = self
            .fleet
            .get(worker.id)
            .and_then(|w| w.capacity)
            .unwrap_or(self.limits.max_blocks_per_cache);
        let Some(index) = self.indexes.get_mut(model) else {
            return;
        };
        let capacity = usize::try_from(capacity).unwrap_or(usize::MAX);
        out.push(Happened::Applied {
            worker: worker.clone(),
            kind: event.kind.tag(),
            outcome: index.apply_within(worker.id, event, capacity),
        });
    }

    /// Drop every index entry of a worker (all its ranks) and its cursors.
    fn forget(&mut self, id: WorkerId, why: Forgot, out: &mut Vec<Happened>) {
        let Some(worker) = self.fleet.get_mut(id) else {
            return;
        };
        if why != Forgot::WarmStart {
            worker.cursors.clear();
        }
        worker.logs.clear();
        let model = worker.model.clone();
        let blocks = self
            .indexes
            .get_mut(&model)
            .map_or(0, |i| i.remove_worker(id));
        let worker = self.name(id);
        out.push(Happened::Forgot {
            worker: worker.clone(),
            blocks,
            why,
        });
        out.push(Happened::Holds { worker, blocks: 0 });
    }

    fn reclaimed(r: Reclaimed, out: &mut Vec<Happened>) {
        for (how, n) in [
            (TicketClosed::Reclaimed, r.surplus),
            (TicketClosed::Expired, r.expired),
        ] {
            if n > 0 {
                out.push(Happened::Tickets { how, n });
            }
        }
    }

    fn dynamo_load(&mut self, m: &KvMetrics, component: Option<&str>, out: &mut Vec<Happened>) {
        let Some(id) = self.admit(Publisher::Instance(m.worker_id), component, m.dp_rank, out)
        else {
            return;
        };
        let Some(worker) = self.fleet.get_mut(id) else {
            return;
        };
        let block_size = self.block_sizes.get(&worker.model).copied().unwrap_or(1);
        let queued = m.active_prefill_tokens.unwrap_or(0) as f64 / f64::from(block_size.max(1));
        let used = m.kv_used_blocks.unwrap_or(0) as f64;
        worker.load.dynamo_metrics(m.dp_rank, queued, used);
        let load = worker.current_load();
        out.push(Happened::Load {
            worker: self.name(id),
            load,
            from_dynamo: true,
        });
    }

    /// Envoy's view: a configured worker Envoy does not list or considers unhealthy is never
    /// hinted; after the grace period its entries are dropped (it may come back with an empty
    /// cache). Discovered workers are not in Envoy's cluster (a Dynamo frontend is).
    fn envoy_view(
        &mut self,
        hosts: &HashMap<String, HostView>,
        now: Instant,
        out: &mut Vec<Happened>,
    ) {
        let mut seen = Vec::new();
        for w in self.fleet.iter_mut().filter(|w| !w.pinned()) {
            let view = hosts.get(&*w.address);
            w.load.envoy_active(view.map_or(0.0, |v| v.rq_active));
            let why = if view.is_some() {
                "Envoy does not consider this worker healthy"
            } else {
                "Envoy does not list this worker"
            };
            seen.push((w.id, view.is_some_and(|v| v.healthy), why));
        }
        self.set_usable(&seen, now, out);
    }

    /// Hosts of an Envoy cluster join the fleet the first time it lists them (an address that
    /// is already a worker, configured or not, stays what it is).
    fn members(&mut self, model: &str, hosts: &[String], out: &mut Vec<Happened>) {
        for host in hosts {
            if self.fleet.by_address(host).is_some() {
                continue;
            }
            let id = self.fleet.add_member(host, model);
            out.push(Happened::Joined {
                worker: self.name(id),
                model: model.to_owned(),
            });
            out.push(Happened::Holds {
                worker: self.name(id),
                blocks: 0,
            });
        }
    }

    /// A discovery scan: new aggregated and prefill instances are added (decode workers are the
    /// frontend's choice, never hinted); instances whose record is gone or that are unreachable
    /// are not hinted and, after the grace period, lose their entries.
    fn discovery(
        &mut self,
        model: &str,
        instances: &[DiscoveredInstance],
        unreachable: &BTreeSet<u64>,
        now: Instant,
        out: &mut Vec<Happened>,
    ) {
        let count = |role| instances.iter().filter(|i| i.role == role).count();
        self.decode_instances.insert(
            model.to_owned(),
            instances
                .iter()
                .filter(|i| i.role == Role::Decode)
                .map(|i| i.instance_id)
                .collect(),
        );
        out.push(Happened::Scanned {
            model: model.to_owned(),
            roles: [Role::Aggregated, Role::Prefill, Role::Decode].map(|r| (r, count(r))),
        });
        for i in instances {
            if i.role == Role::Decode || self.fleet.by_instance_id(i.instance_id).is_some() {
                continue;
            }
            let id = self.fleet.add_discovered(i, model);
            out.push(Happened::Added {
                worker: self.name(id),
                instance_id: i.instance_id,
                role: i.role,
            });
            if let Some(blocks) = i.capacity {
                out.push(Happened::Capacity {
                    worker: self.name(id),
                    blocks,
                });
            }
            out.push(Happened::Holds {
                worker: self.name(id),
                blocks: 0,
            });
        }
        let seen: Vec<_> = self
            .fleet
            .iter()
            .filter(|w| w.pinned() && w.model == model)
            .map(|w| {
                let id = w.instance_id.unwrap_or_default();
                let listed = instances.iter().any(|i| i.instance_id == id);
                match (listed, unreachable.contains(&id)) {
                    (false, _) => (w.id, false, "its Dynamo discovery record is gone"),
                    (true, true) => (
                        w.id,
                        false,
                        "its request plane refuses connections (probe): the worker is down",
                    ),
                    (true, false) => (w.id, true, ""),
                }
            })
            .collect();
        self.set_usable(&seen, now, out);
    }

    /// Mark workers usable or not; drop the entries of those unusable for longer than the grace
    /// period.
    fn set_usable(
        &mut self,
        workers: &[(WorkerId, bool, &'static str)],
        now: Instant,
        out: &mut Vec<Happened>,
    ) {
        let mut expired = Vec::new();
        for &(id, usable, why) in workers {
            let grace = self.grace_period;
            let name = self.name(id);
            let Some(w) = self.fleet.get_mut(id) else {
                continue;
            };
            let changed = usable != w.usable();
            match (usable, w.unusable_since) {
                (true, Some(_)) => w.unusable_since = None,
                (false, None) => w.unusable_since = Some(now),
                (false, Some(since)) if now.saturating_duration_since(since) >= grace => {
                    expired.push(id);
                }
                _ => {}
            }
            out.push(Happened::Usable {
                worker: name,
                usable,
                changed,
                why,
            });
        }
        for id in expired {
            if self.index_blocks(id) > 0 {
                self.forget(id, Forgot::Unusable, out);
            }
        }
    }

    fn index_blocks(&self, id: WorkerId) -> usize {
        let Some(w) = self.fleet.get(id) else {
            return 0;
        };
        self.indexes.get(&w.model).map_or(0, |i| i.blocks_of(id))
    }

    fn expire(&mut self, now: Instant, out: &mut Vec<Happened>) {
        let mut expired = 0;
        let mut changed = Vec::new();
        for w in self.fleet.iter_mut() {
            let n = w.load.expire(now);
            if n > 0 {
                expired += n;
                changed.push((w.id, w.current_load()));
            }
        }
        if expired > 0 {
            out.push(Happened::Tickets {
                how: TicketClosed::Expired,
                n: expired,
            });
        }
        for (id, load) in changed {
            out.push(Happened::Load {
                worker: self.name(id),
                load,
                from_dynamo: false,
            });
        }
    }

    fn peer_load(
        &mut self,
        peer: &str,
        in_flight: &[(String, u32)],
        survival: &[(String, f64)],
        now: Instant,
        out: &mut Vec<Happened>,
    ) {
        let counts: HashMap<&str, u32> = in_flight.iter().map(|(w, n)| (w.as_str(), *n)).collect();
        let survival: HashMap<&str, f64> = survival.iter().map(|(w, s)| (w.as_str(), *s)).collect();
        let ttl = self.peer_load_ttl;
        let mut changed = Vec::new();
        for w in self.fleet.iter_mut() {
            let n = counts.get(&*w.address).copied().unwrap_or(0);
            let expired = w.load.expire_peers(now, ttl);
            w.load
                .peer_survival(peer, survival.get(&*w.address).copied(), now);
            if w.load.peer_in_flight(peer, n, now) || expired {
                changed.push(w.id);
            }
        }
        self.loads_of(changed, out);
    }

    /// The load of each of `workers`, now.
    fn loads_of(&self, workers: impl IntoIterator<Item = WorkerId>, out: &mut Vec<Happened>) {
        for id in workers {
            if let Some(w) = self.fleet.get(id) {
                out.push(Happened::Load {
                    worker: self.name(id),
                    load: w.current_load(),
                    from_dynamo: false,
                });
            }
        }
    }

    /// Which of `tickets` are still counted against their worker (their request runs).
    pub fn open_tickets(&self, tickets: &[Ticket]) -> BTreeSet<Ticket> {
        tickets
            .iter()
            .copied()
            .filter(|&t| {
                let (id, seq) = self.tickets.parts(t);
                self.fleet.get(id).is_some_and(|w| w.load.is_open(seq))
            })
            .collect()
    }

    /// Requests this sidecar hinted that have not finished, per worker with any: what it
    /// shares with its peers.
    pub fn own_in_flight(&self) -> Vec<(String, u32)> {
        self.fleet
            .iter()
            .filter(|w| w.load.own_in_flight() > 0)
            .map(|w| {
                let n = u32::try_from(w.load.own_in_flight()).unwrap_or(u32::MAX);
                (w.address.to_string(), n)
            })
            .collect()
    }

    /// Per worker, this replica's own survival estimate, for those it has one of: what it
    /// shares with its peers ([`load::WorkerLoad::survival`]).
    pub fn own_survival(&self) -> Vec<(String, f64)> {
        self.fleet
            .iter()
            .filter_map(|w| Some((w.address.to_string(), w.load.own_survival()?)))
            .collect()
    }

    fn finished(&mut self, reports: &[Finished], now: Instant, out: &mut Vec<Happened>) {
        let (mut finished, mut unknown) = (0, 0);
        let mut changed = BTreeSet::new();
        for report in reports {
            let (id, seq) = self.tickets.parts(report.ticket);
            let Some(w) = self.fleet.get_mut(id) else {
                unknown += 1;
                continue;
            };
            let Some(closed) = w.load.close(seq, now) else {
                unknown += 1;
                continue;
            };
            if let Closed::Open(_) = closed {
                finished += 1;
                changed.insert(id);
            } else {
                unknown += 1;
            }
            let predicted_tokens = closed.expected().predicted;
            let block_size = self.block_sizes.get(&w.model).copied().unwrap_or(1);
            // A prefill worker's report is its decode worker's cache: counted, nothing learnt.
            let prediction = if w.role == Role::Prefill {
                w.truth.count(report.usage);
                None
            } else {
                if let Usage::Cached { cached_tokens, .. } = report.usage {
                    w.load.observe(closed.expected(), u64::from(cached_tokens));
                }
                w.truth.add(predicted_tokens, report.usage, block_size)
            };
            out.push(Happened::Served {
                ticket: report.ticket,
                worker: self.name(id),
                predicted_tokens,
                usage: report.usage,
                prediction,
            });
        }
        for (how, n) in [
            (TicketClosed::Finished, finished),
            (TicketClosed::Unknown, unknown),
        ] {
            if n > 0 {
                out.push(Happened::Tickets { how, n });
            }
        }
        self.loads_of(changed, out);
    }

    /// Decide a hint for `req` at `now`; its finished tickets are closed first.
    pub fn hint(&mut self, req: &HintRequest, now: Instant) -> Result<Hint, UnknownModel> {
        let mut happened = Vec::new();
        if !req.finished.is_empty() {
            self.finished(&req.finished, now, &mut happened);
        }
        let index = self.indexes.get(&req.model).ok_or(UnknownModel)?;
        self.last_request = Some(now);
        // A few tiers beyond the hint's length, so saturated leaders have runners-up.
        let matches = index.find_matches(&req.hashes, self.routing.max_hinted_workers * 2);
        let home_key = match self.routing.home_key_blocks.min(req.hashes.len()) {
            0 => None,
            n => Some(req.hashes[n - 1].0),
        };
        // Only workers serving the request's model: the filter names the base model of an
        // adapter, and every worker of a base model serves its adapters.
        let blocks = || req.hashes.iter().map(|h| h.0);
        let predict = self.routing.predict_survival;
        let workers = self
            .fleet
            .iter()
            .filter(|w| w.usable() && w.model == req.model)
            .map(|w| policy::Worker {
                id: w.id,
                address: &w.address,
                load: w.current_load(),
                in_flight_blocks: if predict {
                    w.load.in_flight_match(blocks())
                } else {
                    0
                },
                survival: w.load.survival(),
                prefill: w.role == Role::Prefill,
            })
            .collect::<Vec<_>>();
        // Where the prompt branches off what some worker holds, by the index or by a running
        // request (a burst of one new prefix is popular before its first events arrive).
        let longest = matches
            .iter()
            .map(|&(_, n)| n as usize)
            .chain(workers.iter().map(|w| w.in_flight_blocks as usize))
            .max()
            .unwrap_or(0);
        let shared = match longest.checked_sub(1).and_then(|i| req.hashes.get(i)) {
            Some(prefix) => {
                let next = req.hashes.get(longest).map(|h| h.0);
                self.shared_prefixes.matched(prefix.0, next, now)
            }
            None => false,
        };
        let decision = policy::choose(
            policy::Prompt {
                blocks: req.hashes.len() as u32,
                home_key,
                tie_key: req.hashes.last().map_or(0, |h| h.0),
                shared,
            },
            &matches,
            workers,
            &self.routing,
        );
        let mut ticket = None;
        let mut target = Target::None;
        if let Some(&first) = decision.workers.first() {
            let seq = self.next_ticket;
            self.next_ticket += 1;
            self.last_hint = Some(now);
            if let Some(w) = self.fleet.get_mut(first) {
                ticket = self.tickets.ticket(first, seq);
                if ticket.is_some() {
                    let block_size =
                        u64::from(self.block_sizes.get(&req.model).copied().unwrap_or(0));
                    let in_flight = decision
                        .candidates
                        .first()
                        .map_or(0, |c| c.in_flight_blocks);
                    let expected = Expected {
                        predicted: u64::from(decision.matched_blocks) * block_size,
                        pinned: u64::from(in_flight.min(decision.matched_blocks)) * block_size,
                    };
                    w.load.open(seq, now, expected, blocks());
                }
                w.hints_since_event += 1;
            }
            if let Some(w) = self.fleet.get(first) {
                target = match (w.pinned(), w.role, w.instance_id) {
                    (true, Role::Prefill, Some(i)) => Target::Prefill(i),
                    (true, _, Some(i)) => Target::Instance(i),
                    _ => Target::Addresses(
                        decision
                            .workers
                            .iter()
                            .filter_map(|&id| self.fleet.get(id))
                            .filter(|w| !w.pinned())
                            .map(|w| Arc::clone(&w.address))
                            .collect(),
                    ),
                };
                happened.push(Happened::Load {
                    worker: self.name(first),
                    load: w.current_load(),
                    from_dynamo: false,
                });
            }
        }
        Ok(Hint {
            decision,
            ticket,
            target,
            happened,
        })
    }
}

#[cfg(test)]
mod tests;
