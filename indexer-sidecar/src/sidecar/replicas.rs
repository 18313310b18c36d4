//! The replica plane's verbs: what its loop hands the brain (each tick's look at the core, a
//! peer's digests, a snapshot asked for) and what the brain's effects need from the core; the
//! agreement gauges and lines; `/readyz` and `/debug/replicas`; the disk snapshot's caches,
//! taken and put back.

use std::time::{Duration, Instant};

use super::{lock, Sidecar};
use crate::core::digest::{Agreement, CacheKey, Snapshot};
use crate::core::event::KvEvent;
use crate::core::Input;
use crate::metrics::{
    AgreementLabel, AgreementValue, Direction, DirectionLabel, ReplicaWorkerLabels, RestoreLabel,
    RestoreOutcome,
};
use crate::replication::brain::{Effect, Event, Subjects};
use crate::replication::peers::Change;
use crate::replication::wire::SnapshotRequest;

/// A cache read from the disk snapshot: the worker's address, the rank, its entries.
pub type Saved = (String, u32, Snapshot);

impl Sidecar {
    /// This replica's id and the subjects its plane uses.
    pub fn replica_identity(&self) -> (String, Subjects) {
        let brain = self.replication();
        (brain.peers().me().to_owned(), brain.subjects().clone())
    }

    /// The digest interval: our caches, totals and fleet as they are now, to the brain; the
    /// agreement gauges set afresh.
    pub fn replica_tick(&self, now: Instant) -> Vec<Effect> {
        // One look at the core per tick: the repairs read the same reports.
        let (mine, served) = {
            let core = self.core();
            (core.reports(now), core.served())
        };
        let serves = |worker: &str| self.serves(worker);
        let effects = self.replicate(
            Event::Tick {
                mine: &mine,
                served,
                serves: &serves,
            },
            now,
        );
        self.replica_gauges(now);
        effects
    }

    /// The load interval: our own requests in flight (with their prompts' blocks) and
    /// survival estimates, to share.
    pub fn replica_load_tick(&self, now: Instant) -> Vec<Effect> {
        let (in_flight, survival, tickets) = {
            let mut core = self.core();
            (
                core.own_in_flight(),
                core.own_survival(),
                core.own_tickets(),
            )
        };
        self.replicate(
            Event::LoadTick {
                in_flight,
                survival,
                tickets,
            },
            now,
        )
    }

    /// The fill interval: the messages lost at least `age` ago, to ask peers for.
    pub fn replica_fill_tick(&self, age: Duration, now: Instant) -> Vec<Effect> {
        let wanted = self.core().wanted(now, age);
        self.replicate(Event::FillTick { wanted }, now)
    }

    /// A peer's digests arrived: compared with our caches as they are now.
    pub fn replica_digests(&self, payload: &[u8], now: Instant) -> Vec<Effect> {
        let mine = self.core().reports(now);
        self.replicate(
            Event::Digests {
                payload,
                mine: &mine,
            },
            now,
        )
    }

    /// A peer asked for a chunk of our snapshot of a cache.
    pub fn replica_snapshot_asked(
        &self,
        request: SnapshotRequest,
        reply: &str,
        now: Instant,
    ) -> Vec<Effect> {
        let cursor = self.applied(&request.worker, request.rank);
        self.replicate(
            Event::SnapshotAsked {
                request,
                reply,
                cursor,
            },
            now,
        )
    }

    /// The snapshot [`Effect::TakeSnapshot`] asked for, taken now and handed to the brain.
    pub fn replica_take_snapshot(
        &self,
        request: SnapshotRequest,
        reply: &str,
        now: Instant,
    ) -> Vec<Effect> {
        let snapshot = self.core().snapshot(&request.worker, request.rank);
        self.replicate(
            Event::Taken {
                request,
                reply,
                snapshot,
            },
            now,
        )
    }

    /// The messages of `seqs` we still keep of worker `worker`'s cache of `rank`, for a peer that lost them.
    pub fn kept_messages(&self, worker: &str, rank: u32, seqs: &[u64]) -> Vec<(u64, Vec<KvEvent>)> {
        self.core().messages(worker, rank, seqs)
    }

    /// `/debug/replicas`: our caches, what we served, and what the brain knows of the peers.
    pub fn replicas_debug(&self, now: Instant) -> serde_json::Value {
        // Our own caches first (the core's lock), then the peers' (the replicas' lock).
        let (reports, served) = {
            let core = self.core();
            (core.reports(now), core.served())
        };
        let mine: Vec<serde_json::Value> = reports
            .iter()
            .map(|c| {
                serde_json::json!({"worker": c.worker, "rank": c.rank, "clean": c.clean,
                                   "quiet_ms": c.quiet_ms, "latest": c.checkpoints.last()})
            })
            .collect();
        let mut body = self.replication().peers().debug(now);
        body["mine"] = mine.into();
        body["served"] = crate::replication::peers::served_json(&served).into();
        body
    }

    /// Every cache of the index as it is now, for the disk snapshot: one cache per look at
    /// the core (the lock is held for one cache's size at a time).
    pub fn saved_caches(&self) -> Vec<Saved> {
        let caches: Vec<CacheKey> = self
            .core()
            .reports(Instant::now())
            .into_iter()
            .map(|r| (r.worker, r.rank))
            .collect();
        caches
            .into_iter()
            .filter_map(|(worker, rank)| {
                let s = self.core().snapshot(&worker, rank)?;
                Some((worker, rank, s))
            })
            .collect()
    }

    /// The disk snapshot was written (its bytes) or not (why): counted, a failure said.
    pub fn disk_snapshot_written(&self, written: Result<usize, String>) {
        let m = &self.metrics;
        match written {
            Ok(bytes) => {
                m.disk_snapshot_bytes
                    .set(i64::try_from(bytes).unwrap_or(i64::MAX));
            }
            Err(error) => {
                m.disk_snapshot_failures.inc();
                tracing::warn!(%error, "cannot write the index snapshot; trying again at the next interval");
            }
        }
    }

    /// Put back the caches read from the disk snapshot: now those whose worker is in the
    /// fleet, the others as their worker appears, for up to `wait`.
    pub fn restore(&self, caches: Vec<Saved>, wait: Duration, now: Instant) {
        *lock(&self.restoring) = (caches, now + wait);
        self.restore_pending(now);
    }

    /// Restore what waits for a worker now in the fleet; past the wait, give the rest up.
    pub(super) fn restore_pending(&self, now: Instant) {
        let (waiting, until) = {
            let mut r = lock(&self.restoring);
            (std::mem::take(&mut r.0), r.1)
        };
        if waiting.is_empty() {
            return;
        }
        let mut still = Vec::new();
        for (worker, rank, snapshot) in waiting {
            if self.serves(&worker) {
                let input = Input::Restore {
                    worker: &worker,
                    rank,
                    snapshot: &snapshot,
                };
                self.ingest(input, now);
            } else if now >= until {
                tracing::warn!(%worker, rank, blocks = snapshot.entries.len(), "cache from the disk snapshot not restored: its worker did not appear (gone, or a Dynamo instance that restarted under a new id)");
                self.metrics
                    .restored_caches
                    .get_or_create(&RestoreLabel {
                        outcome: RestoreOutcome::NotFound,
                    })
                    .inc();
            } else {
                still.push((worker, rank, snapshot));
            }
        }
        lock(&self.restoring).0.extend(still);
    }

    /// Hand the replica plane's brain an event; what to do about it.
    pub fn replicate(&self, event: Event<'_>, now: Instant) -> Vec<Effect> {
        self.replication().on(event, now)
    }

    /// Snapshot bytes sent to or received from peers.
    pub fn snapshot_bytes(&self, direction: Direction, bytes: usize) {
        self.metrics
            .replica_snapshot_bytes
            .get_or_create(&DirectionLabel { direction })
            .inc_by(bytes as u64);
    }

    /// Caches whose agreement with a peer changed: counted and logged.
    pub fn replica_changes(&self, changes: &[Change]) {
        for c in changes {
            let (worker, rank) = (&c.cache.0, c.cache.1);
            match &c.now {
                Agreement::Divergent { seq, mine, theirs } => {
                    self.metrics.replica_divergences.inc();
                    tracing::warn!(peer = %c.peer, %worker, rank, seq, blocks = mine.blocks, peer_blocks = theirs.blocks, "replicas disagree on a cache after the same event: one of them lost events");
                }
                Agreement::Agree { seq } => {
                    let after = c.healed_after.map(|d| d.as_secs_f64());
                    if let Some(secs) = after {
                        self.metrics.replica_divergence_seconds.observe(secs);
                    }
                    tracing::info!(peer = %c.peer, %worker, rank, seq, divergent_s = ?after, "replicas agree on a cache");
                }
                Agreement::Unknown => {}
            }
        }
        self.replica_gauges(Instant::now());
    }

    /// Whether this sidecar routes with what its peers know (`/readyz`), and why: warm when it
    /// holds every cache a clean peer can give it, or when no peer answered in time. Hints
    /// are served either way, with whatever is known.
    pub fn ready(&self, now: Instant) -> (bool, String) {
        let Some(wait) = self.peer_wait else {
            return (true, "no [replicas]: the events alone".into());
        };
        let mine = self.core().reports(now);
        let brain = self.replication();
        let r = brain.peers();
        if r.warm(&mine, now) {
            return (
                true,
                "warm: every cache a clean peer holds is held here".into(),
            );
        }
        if !r.has_peers() && now.saturating_duration_since(self.started) >= wait {
            return (true, "no peer heard: started from the events alone".into());
        }
        (false, "warming: taking caches from peers".into())
    }

    /// Forget silent peers and set the replica gauges.
    fn replica_gauges(&self, now: Instant) {
        let totals = self.served_totals();
        let (gone, s) = {
            let mut brain = self.replication();
            let r = brain.peers_mut();
            (r.expire(now), r.summary())
        };
        let m = &self.metrics;
        // Set afresh each time: a peer that is gone takes its series with it.
        let families = [
            &m.replica_predicted_cached_tokens,
            &m.replica_actual_cached_tokens,
            &m.replica_prompt_tokens,
        ];
        for f in families {
            f.clear();
        }
        let clamp = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        for ((replica, worker), t) in totals {
            let label = ReplicaWorkerLabels { replica, worker };
            for (f, v) in
                families
                    .into_iter()
                    .zip([t.predicted_tokens, t.cached_tokens, t.prompt_tokens])
            {
                f.get_or_create(&label).set(clamp(v));
            }
        }
        for peer in gone {
            tracing::warn!(%peer, "replica peer silent for three intervals: forgotten");
        }
        m.replica_peers.set(s.peers as i64);
        for (state, n) in [
            (AgreementValue::Agree, s.agree),
            (AgreementValue::Divergent, s.divergent),
            (AgreementValue::Unknown, s.unknown),
        ] {
            m.replica_caches
                .get_or_create(&AgreementLabel { state })
                .set(n as i64);
        }
    }
}
