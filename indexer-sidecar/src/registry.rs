//! The workers the sidecar may hint: dense ids, addresses and how events name them.
//!
//! Configured workers come first; workers found in Dynamo's discovery directory are appended
//! while the sidecar runs. Ids are never reused, so every per-worker table stays valid.

use std::collections::HashMap;

use crate::config::WorkerConfig;
use crate::sources::discovery::Role;

/// Dense index of a worker in the [`WorkerRegistry`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerId(pub u32);

/// One worker.
#[derive(Debug, Clone)]
pub struct Worker {
    /// Its dense id.
    pub id: WorkerId,
    /// `ip:port`, as Envoy's override_host expects it.
    pub address: String,
    /// The model it serves.
    pub model: String,
    /// Its Dynamo instance id, if it publishes Dynamo events.
    pub dynamo_worker_id: Option<u64>,
    /// Hinted by its Dynamo instance id (a header to a Dynamo frontend) rather than by address:
    /// a worker found through Dynamo discovery.
    pub pinned: bool,
    /// Aggregated, or the prefill worker of a disaggregated fleet (pinned with the frontend's
    /// prefill header). Decode workers are never registered: the frontend picks them.
    pub role: Role,
}

/// All known workers.
#[derive(Debug, Default, Clone)]
pub struct WorkerRegistry {
    workers: Vec<Worker>,
    by_dynamo_id: HashMap<u64, WorkerId>,
}

impl WorkerRegistry {
    /// Build from the configuration (already validated: addresses and ids are unique).
    pub fn new(configs: &[WorkerConfig]) -> Self {
        let mut reg = WorkerRegistry::default();
        for (i, c) in configs.iter().enumerate() {
            let id = WorkerId(i as u32);
            if let Some(d) = c.dynamo_worker_id {
                reg.by_dynamo_id.insert(d, id);
            }
            reg.workers.push(Worker {
                id,
                address: c.address.clone(),
                model: c.model.clone(),
                dynamo_worker_id: c.dynamo_worker_id,
                pinned: false,
                role: Role::Aggregated,
            });
        }
        reg
    }

    /// Append a Dynamo instance found through discovery (hinted by instance id); its new id.
    pub fn add_pinned(
        &mut self,
        instance_id: u64,
        address: String,
        model: String,
        role: Role,
    ) -> WorkerId {
        let id = WorkerId(self.workers.len() as u32);
        self.by_dynamo_id.insert(instance_id, id);
        self.workers.push(Worker {
            id,
            address,
            model,
            dynamo_worker_id: Some(instance_id),
            pinned: true,
            role,
        });
        id
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

    /// The worker whose Dynamo events carry this `worker_id`.
    pub fn by_dynamo_id(&self, dynamo_id: u64) -> Option<&Worker> {
        self.by_dynamo_id
            .get(&dynamo_id)
            .and_then(|&id| self.get(id))
    }

    /// The worker with this address (`ip:port`, as configured).
    pub fn by_address(&self, address: &str) -> Option<&Worker> {
        self.workers.iter().find(|w| w.address == address)
    }

    /// Every worker.
    pub fn iter(&self) -> impl Iterator<Item = &Worker> {
        self.workers.iter()
    }
}
