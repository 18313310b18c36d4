//! The fleet: one row per worker the sidecar may hint, holding everything known about it.
//!
//! Configured workers come first; workers found in Dynamo's discovery directory are appended
//! while the sidecar runs. Ids are dense and never reused, so a [`WorkerId`] stays valid (and
//! fits a ticket) for the life of the process.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use kvroute_protocol::hint::Ticket;

use crate::config::WorkerConfig;
use crate::core::cursor::Cursor;
use crate::core::digest::CacheLog;
use crate::core::load::{Load, WorkerLoad};
use crate::core::truth::Truth;
use crate::core::DiscoveredInstance;

/// Dense index of a worker in the [`Fleet`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerId(pub u32);

/// A ticket carries its worker id in the low bits and its sequence number, sealed, above.
const WORKER_BITS: u32 = 16;
const SEQ_BITS: u32 = 64 - WORKER_BITS;
const HALF: u32 = SEQ_BITS / 2;
const HALF_MASK: u64 = (1 << HALF) - 1;

/// The secret that seals tickets. Anyone who reaches the sidecar's API can report tickets
/// finished, and a closed ticket makes its worker look idle; a sealed ticket cannot be
/// guessed (one chance in 2^48 per open ticket), where a plain counter could be swept.
#[derive(Debug, Clone, Copy)]
pub struct TicketKey(pub u64);

impl TicketKey {
    /// Four Feistel rounds over the sequence number's two 24-bit halves: a keyed permutation
    /// of 48-bit values, so every sequence number has one ticket and back.
    fn round(self, half: u64, round: u64) -> u64 {
        let seed = self.0 ^ round.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        xxhash_rust::xxh3::xxh3_64_with_seed(&half.to_le_bytes(), seed) & HALF_MASK
    }

    fn seal(self, seq: u64) -> u64 {
        let (mut l, mut r) = (seq >> HALF & HALF_MASK, seq & HALF_MASK);
        for i in 0..4 {
            (l, r) = (r, l ^ self.round(r, i));
        }
        l << HALF | r
    }

    fn open(self, sealed: u64) -> u64 {
        let (mut l, mut r) = (sealed >> HALF & HALF_MASK, sealed & HALF_MASK);
        for i in (0..4).rev() {
            (l, r) = (r ^ self.round(l, i), l);
        }
        l << HALF | r
    }

    /// The ticket for request `seq` (below 2^48) hinted to `worker`; `None` for a worker id a
    /// ticket cannot carry (more than 65536 workers).
    pub fn ticket(self, worker: WorkerId, seq: u64) -> Option<Ticket> {
        (worker.0 >> WORKER_BITS == 0 && seq >> SEQ_BITS == 0)
            .then(|| Ticket(self.seal(seq) << WORKER_BITS | u64::from(worker.0)))
    }

    /// The worker and sequence number a ticket names (a forged one names a random number).
    pub fn parts(self, ticket: Ticket) -> (WorkerId, u64) {
        (
            WorkerId((ticket.0 & ((1 << WORKER_BITS) - 1)) as u32),
            self.open(ticket.0 >> WORKER_BITS),
        )
    }
}

/// Where a worker came from, which decides how a hint names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// `[[workers]]`: an engine in Envoy's cluster, hinted by address (`x-kvroute-worker`).
    Configured,
    /// `[[dynamo_discovery]]`: an instance behind a Dynamo frontend, hinted by instance id.
    Discovered,
    /// `[[envoy.members]]`: a host Envoy's cluster listed (EDS), hinted by address.
    Member,
}

/// What a Dynamo worker does in the serving pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Prefill and decode on one worker: it holds the prompt's KV blocks and serves the request.
    Aggregated,
    /// Disaggregated prefill: computes (and caches) the prompt's KV blocks, publishes the KV
    /// events; pinned with the frontend's prefill-instance header.
    Prefill,
    /// Disaggregated decode: receives the KV blocks from a prefill worker; publishes no KV
    /// events by design and is chosen by the frontend, never by kvroute.
    Decode,
}

impl Role {
    /// The label value in metrics and logs.
    pub fn label(self) -> &'static str {
        match self {
            Role::Aggregated => "aggregated",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// One worker: who it is, whether it may be hinted, how busy it is, and how far its event
/// streams have been applied.
#[derive(Debug, Clone)]
pub struct Worker {
    /// Its dense id.
    pub id: WorkerId,
    /// `ip:port` as Envoy's override_host expects it (discovered instances: `ip:port/<id hex>`,
    /// a name only). Shared, so outcomes can carry it without copying.
    pub address: Arc<str>,
    /// The model it serves.
    pub model: String,
    /// Its Dynamo instance id: the `worker_id` of its KV events and the id a frontend pins to.
    pub instance_id: Option<u64>,
    /// Configured or discovered.
    pub origin: Origin,
    /// Aggregated, or the prefill worker of a disaggregated fleet. Decode workers are never
    /// added: the frontend picks them.
    pub role: Role,
    /// Since when it has been unusable (Envoy does not list it or calls it unhealthy, its
    /// discovery record is gone, its probe fails); `None`: usable.
    pub unusable_since: Option<Instant>,
    /// Its load: open tickets, scraped metrics, Envoy's in-flight count.
    pub load: WorkerLoad,
    /// Per event stream (its data-parallel ranks): the last message applied.
    pub cursors: BTreeMap<u32, Cursor>,
    /// When it last published an event that was applied.
    pub last_event: Option<Instant>,
    /// Hints it received since its last applied event (or ever, if none): the `silent_worker`
    /// and `worker_quiet` alarms.
    pub hints_since_event: u64,
    /// The Dynamo component (`namespace/component`) whose subjects carry its events: from its
    /// discovery record, `[[workers]] dynamo_component`, or the first subject it was seen on.
    pub component: Option<String>,
    /// Blocks one of its caches holds at most: what its engine says, else its configuration.
    pub capacity: Option<u64>,
    /// Per data-parallel rank: its cache's recent past ([`CacheLog`]).
    pub logs: BTreeMap<u32, CacheLog>,
    /// Its finished hinted requests: predicted against actual cached tokens.
    pub truth: Truth,
}

impl Worker {
    fn new(
        id: WorkerId,
        address: &str,
        model: &str,
        instance_id: Option<u64>,
        origin: Origin,
        role: Role,
    ) -> Self {
        Worker {
            id,
            address: address.into(),
            model: model.to_owned(),
            instance_id,
            origin,
            role,
            unusable_since: None,
            load: WorkerLoad::default(),
            cursors: BTreeMap::new(),
            last_event: None,
            hints_since_event: 0,
            component: None,
            capacity: None,
            logs: BTreeMap::new(),
            truth: Truth::default(),
        }
    }

    /// Where its engine serves: its address without a discovered instance's `/<id hex>`.
    pub fn plane_address(&self) -> &str {
        self.address.split('/').next().unwrap_or_default()
    }

    /// Hinted by instance id to a Dynamo frontend, not by address to Envoy.
    pub fn pinned(&self) -> bool {
        self.origin == Origin::Discovered
    }

    /// Whether it may be hinted now.
    pub fn usable(&self) -> bool {
        self.unusable_since.is_none()
    }

    /// Its load as the routing rule weighs it.
    pub fn current_load(&self) -> Load {
        self.load.get()
    }
}

/// Every known worker.
#[derive(Debug, Default, Clone)]
pub struct Fleet {
    workers: Vec<Worker>,
    by_instance: HashMap<u64, WorkerId>,
    by_address: HashMap<Arc<str>, WorkerId>,
    /// Discovered instances by their request-plane `ip:port`, the latest one there: what a
    /// `[[zmq]]` entry's `worker` names for a Dynamo worker whose engine publishes over ZMQ.
    by_plane_address: HashMap<String, WorkerId>,
}

impl Fleet {
    /// The configured workers (already validated: addresses and ids are unique).
    pub fn new(configs: &[WorkerConfig]) -> Self {
        let mut fleet = Fleet::default();
        for c in configs {
            let id = fleet.push(
                &c.address,
                &c.model,
                c.dynamo_worker_id,
                Origin::Configured,
                Role::Aggregated,
            );
            let w = &mut fleet.workers[id.0 as usize];
            w.component = c.dynamo_component.clone();
            w.capacity = c.capacity_blocks;
        }
        fleet
    }

    fn push(
        &mut self,
        address: &str,
        model: &str,
        instance_id: Option<u64>,
        origin: Origin,
        role: Role,
    ) -> WorkerId {
        let id = WorkerId(self.workers.len() as u32);
        let worker = Worker::new(id, address, model, instance_id, origin, role);
        if let Some(i) = instance_id {
            self.by_instance.insert(i, id);
        }
        self.by_address.insert(Arc::clone(&worker.address), id);
        self.workers.push(worker);
        id
    }

    /// Append a Dynamo instance found through discovery (hinted by instance id); its new id.
    pub fn add_discovered(&mut self, instance: &DiscoveredInstance, model: &str) -> WorkerId {
        let address = format!("{}/{:x}", instance.address, instance.instance_id);
        let id = self.push(
            &address,
            model,
            Some(instance.instance_id),
            Origin::Discovered,
            instance.role,
        );
        self.by_plane_address.insert(instance.address.clone(), id);
        let w = &mut self.workers[id.0 as usize];
        w.component = Some(instance.component.clone());
        w.capacity = instance.capacity;
        id
    }

    /// Append a host of an Envoy cluster (hinted by address); its new id.
    pub fn add_member(&mut self, address: &str, model: &str) -> WorkerId {
        self.push(address, model, None, Origin::Member, Role::Aggregated)
    }

    /// How many workers there are (ids are `0..len`).
    pub fn len(&self) -> usize {
        self.workers.len()
    }

    /// Whether there is no worker.
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    /// The worker with this id.
    pub fn get(&self, id: WorkerId) -> Option<&Worker> {
        self.workers.get(id.0 as usize)
    }

    /// The worker with this id, to change.
    pub fn get_mut(&mut self, id: WorkerId) -> Option<&mut Worker> {
        self.workers.get_mut(id.0 as usize)
    }

    /// The worker whose Dynamo events carry this `worker_id`.
    pub fn by_instance_id(&self, instance_id: u64) -> Option<&Worker> {
        self.by_instance
            .get(&instance_id)
            .and_then(|&id| self.get(id))
    }

    /// The worker with this address: as configured or discovered (`ip:port/<id hex>`), else
    /// the latest discovered instance whose request plane is at `ip:port`.
    pub fn by_address(&self, address: &str) -> Option<&Worker> {
        self.by_address
            .get(address)
            .or_else(|| self.by_plane_address.get(address))
            .and_then(|&id| self.get(id))
    }

    /// Every worker.
    pub fn iter(&self) -> impl Iterator<Item = &Worker> {
        self.workers.iter()
    }

    /// Every worker, to change.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut Worker> {
        self.workers.iter_mut()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tickets_name_their_worker_and_are_sealed() {
        let key = TicketKey(0x1234_5678_9abc_def0);
        let t = key.ticket(WorkerId(7), 42).unwrap();
        assert_eq!(key.parts(t), (WorkerId(7), 42));
        assert_eq!(key.ticket(WorkerId(1 << 16), 1), None);
        assert_eq!(key.ticket(WorkerId(0), 1 << 48), None);
        // Consecutive requests get unrelated tickets, and another key opens them to other numbers.
        let (a, b) = (
            key.ticket(WorkerId(0), 1).unwrap(),
            key.ticket(WorkerId(0), 2).unwrap(),
        );
        assert!((a.0 >> 16).abs_diff(b.0 >> 16) > 1 << 20, "{a:?} {b:?}");
        assert_ne!(TicketKey(1).parts(t).1, 42);
        for seq in [0, 1, 99, (1 << 48) - 1] {
            assert_eq!(key.parts(key.ticket(WorkerId(3), seq).unwrap()).1, seq);
        }
    }

    #[test]
    fn workers_are_found_by_address_and_instance_id() {
        let mut fleet = Fleet::new(&[WorkerConfig {
            address: "127.0.0.1:8000".into(),
            model: "m".into(),
            dynamo_worker_id: Some(7),
            dynamo_component: None,
            capacity_blocks: Some(80),
        }]);
        let instance = DiscoveredInstance {
            instance_id: 9,
            address: "127.0.0.1:9000".into(),
            role: Role::Prefill,
            component: "dynamo/prefill".into(),
            capacity: None,
        };
        let added = fleet.add_discovered(&instance, "m");
        assert_eq!(fleet.get(WorkerId(0)).unwrap().capacity, Some(80));
        assert_eq!(
            fleet.get(added).unwrap().component.as_deref(),
            Some("dynamo/prefill")
        );
        assert_eq!(added, WorkerId(1));
        assert_eq!(fleet.by_instance_id(7).unwrap().id, WorkerId(0));
        assert_eq!(fleet.by_address("127.0.0.1:9000/9").unwrap().id, added);
        assert!(fleet.get(added).unwrap().pinned());
        assert!(!fleet.get(WorkerId(0)).unwrap().pinned());
        assert!(fleet.by_instance_id(8).is_none());
        assert_eq!(fleet.len(), 2);
        // By its request plane too, where a restarted instance takes over.
        assert_eq!(fleet.by_address("127.0.0.1:9000").unwrap().id, added);
        let restarted = fleet.add_discovered(
            &DiscoveredInstance {
                instance_id: 10,
                ..instance
            },
            "m",
        );
        assert_eq!(fleet.by_address("127.0.0.1:9000").unwrap().id, restarted);
        assert_eq!(fleet.by_address("127.0.0.1:9000/9").unwrap().id, added);
    }
}
