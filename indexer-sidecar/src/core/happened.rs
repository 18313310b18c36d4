//! What goes out of the [`Core`]: [`Happened`], for the edges to turn into metrics and lines.

use super::*;

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
        problem: EventProblem,
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
