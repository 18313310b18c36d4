//! The pure core: the fleet table, the per-model indexes and the rules that change them. No
//! I/O, no clock, no logs, no metrics: every input comes through [`Core::ingest`] or
//! [`Core::hint`] with the time, and each returns what [`Happened`], which the edges
//! ([`crate::sidecar`]) turn into metrics and log lines. So every store and remove of every
//! source passes one place, and the whole core is unit-tested without sleeping.
//!
//! `Core` itself (its fields, [`Core::ingest`]'s dispatch) is here; its methods live by
//! concern, each file one `impl Core` block: `ingest.rs` (KV events: which worker, its
//! sequence, the index), `membership.rs` (Envoy's view, members, discovery, expiry),
//! `tickets.rs` (load: tickets, Dynamo's load reports, peers' in-flight counts), `hint.rs` (the
//! hint and how it steers). What comes in is in `input.rs` ([`Input`]), what goes out in
//! `happened.rs` ([`Happened`]).
//!
//! - [`fleet`]: one row per worker: id, address, model, origin, role, usability, load, cursors.
//! - [`block_map`]: one cache's blocks, engine hash → node, in the order they were stored.
//! - [`cursor`]: what a message's sequence number says (next, gap, duplicate, restart).
//! - [`digest`]: per cache, its blocks' digest after each message: what replicas compare.
//! - [`event`]: [`event::KvEvent`], an engine's cache event whatever its wire format.
//! - [`holders`]: node → the caches holding it, inline for all but crowded nodes.
//! - [`homes`]: per cache, the prefixes of the home depth it holds (the home balance).
//! - [`index`]: [`index::RadixIndex`], prefix → caches holding it, one per model.
//! - [`load`]: a worker's load (open tickets, scrapes, Dynamo `kv_metrics`, Envoy).
//! - [`policy`]: the routing rule: matches and load → workers, best first.
//! - [`recent`]: a count of recent events that fades (shares of requests and of hints).
//! - [`shared_prefix`]: which matched prefixes requests branch off in different ways (popular).
//! - [`truth`]: what the engines said they had cached, beside what the hints predicted.

pub mod block_map;
pub mod cursor;
pub mod digest;
pub mod event;
pub mod fleet;
pub mod holders;
pub mod homes;
pub mod index;
mod ledger;
pub mod load;
pub mod policy;
pub mod recent;
pub mod shared_prefix;
pub mod truth;

mod happened;
mod hint;
mod ingest;
mod input;
mod membership;
mod tickets;

pub use happened::*;
pub use hint::{Hint, Target, UnknownModel};
pub use input::*;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_protocol::dynamo::{KvMetrics, RouterEvent};
use kvroute_protocol::hint::{Finished, HintRequest, Ticket, Usage};
use kvroute_protocol::vllm::EventBatch;

use crate::config::{Config, IndexConfig, RoutingConfig};
use cursor::Verdict;
use event::{EventProblem, EventTag, KvEvent};
use fleet::{Fleet, Role, TicketKey, WorkerId};
use index::{ApplyOutcome, RadixIndex};
use load::{Closed, Expected, Load, PeerTicket, Reclaimed};
use policy::Decision;
use truth::Prediction;

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
        // The caches count their home prefixes only for the home balance, which reads them.
        let home_depth = if config.routing.home_balance.is_finite() {
            config.routing.home_key_blocks
        } else {
            0
        };
        Core {
            fleet: Fleet::new(&config.workers),
            indexes: config
                .models
                .iter()
                .map(|m| (m.name.clone(), RadixIndex::new(home_depth)))
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
                tickets,
            } => self.peer_load(peer, in_flight, survival, tickets, now, &mut out),
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
}

#[cfg(test)]
mod tests;
