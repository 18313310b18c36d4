//! Who is in the fleet and may be hinted: Envoy's view, its cluster's members, Dynamo's
//! discovery, and what expires after the grace period.

use super::*;

impl Core {
    /// Envoy's view: a configured worker Envoy does not list or considers unhealthy is never
    /// hinted; after the grace period its entries are dropped (it may come back with an empty
    /// cache). Discovered workers are not in Envoy's cluster (a Dynamo frontend is).
    pub(super) fn envoy_view(
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
    pub(super) fn members(&mut self, model: &str, hosts: &[String], out: &mut Vec<Happened>) {
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
    pub(super) fn discovery(
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
    pub(super) fn set_usable(
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

    pub(super) fn index_blocks(&self, id: WorkerId) -> usize {
        let Some(w) = self.fleet.get(id) else {
            return 0;
        };
        self.indexes.get(&w.model).map_or(0, |i| i.blocks_of(id))
    }

    pub(super) fn expire(&mut self, now: Instant, out: &mut Vec<Happened>) {
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
}
