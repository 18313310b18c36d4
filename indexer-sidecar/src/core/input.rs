//! What comes into the [`Core`]: [`Input`], and the messages and views it carries.

use super::*;

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
        /// Its open tickets per worker (address, tickets): every worker it does not list has
        /// none.
        tickets: &'a [(String, Vec<PeerTicket>)],
    },
    /// Time passed: tickets past their lifetime expire, whether or not their worker is ever
    /// scraped (a lost finished-report must not load a worker forever).
    Tick,
}
