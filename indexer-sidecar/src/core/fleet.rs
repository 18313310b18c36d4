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
use crate::core::load::{Load, WorkerLoad};

/// Dense index of a worker in the [`Fleet`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerId(pub u32);

/// A ticket is a sequence number above the worker id, so a report names its worker.
const WORKER_BITS: u32 = 16;

/// The ticket for request `seq` hinted to `worker`; `None` for a worker id a ticket cannot
/// carry (more than 65536 workers).
pub fn ticket(worker: WorkerId, seq: u64) -> Option<Ticket> {
    (worker.0 >> WORKER_BITS == 0).then_some(Ticket(seq << WORKER_BITS | u64::from(worker.0)))
}

/// The worker and sequence number a ticket names.
pub fn ticket_parts(ticket: Ticket) -> (WorkerId, u64) {
    (
        WorkerId((ticket.0 & ((1 << WORKER_BITS) - 1)) as u32),
        ticket.0 >> WORKER_BITS,
    )
}

/// Where a worker came from, which decides how a hint names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// `[[workers]]`: an engine in Envoy's cluster, hinted by address (`x-kvroute-worker`).
    Configured,
    /// `[[dynamo_discovery]]`: an instance behind a Dynamo frontend, hinted by instance id.
    Discovered,
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
        }
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
}

impl Fleet {
    /// The configured workers (already validated: addresses and ids are unique).
    pub fn new(configs: &[WorkerConfig]) -> Self {
        let mut fleet = Fleet::default();
        for c in configs {
            fleet.push(
                &c.address,
                &c.model,
                c.dynamo_worker_id,
                Origin::Configured,
                Role::Aggregated,
            );
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
    pub fn add_discovered(
        &mut self,
        instance_id: u64,
        address: &str,
        model: &str,
        role: Role,
    ) -> WorkerId {
        self.push(address, model, Some(instance_id), Origin::Discovered, role)
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

    /// The worker with this address (`ip:port`, as configured).
    pub fn by_address(&self, address: &str) -> Option<&Worker> {
        self.by_address.get(address).and_then(|&id| self.get(id))
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
    fn tickets_name_their_worker() {
        let t = ticket(WorkerId(7), 42).unwrap();
        assert_eq!(ticket_parts(t), (WorkerId(7), 42));
        assert_eq!(ticket(WorkerId(1 << 16), 1), None);
        assert_ne!(ticket(WorkerId(0), 1), ticket(WorkerId(0), 2));
    }

    #[test]
    fn workers_are_found_by_address_and_instance_id() {
        let mut fleet = Fleet::new(&[WorkerConfig {
            address: "127.0.0.1:8000".into(),
            model: "m".into(),
            dynamo_worker_id: Some(7),
        }]);
        let added = fleet.add_discovered(9, "127.0.0.1:9000/9", "m", Role::Prefill);
        assert_eq!(added, WorkerId(1));
        assert_eq!(fleet.by_instance_id(7).unwrap().id, WorkerId(0));
        assert_eq!(fleet.by_address("127.0.0.1:9000/9").unwrap().id, added);
        assert!(fleet.get(added).unwrap().pinned());
        assert!(!fleet.get(WorkerId(0)).unwrap().pinned());
        assert!(fleet.by_instance_id(8).is_none());
        assert_eq!(fleet.len(), 2);
    }
}
