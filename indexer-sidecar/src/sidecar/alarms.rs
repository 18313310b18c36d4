//! The alarms: the event plane's and those on what the engines reported, checked every few
//! seconds, said when one starts or stops, and shown as gauges.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{lock, Sidecar};
use crate::event_plane::{Activity, Alarm};
use crate::metrics::AlarmLabels;
use crate::truth_watch::Totals;

impl Sidecar {
    fn activity(&self) -> Activity {
        let core = self.core();
        let (last_hint, last_request) = core.last_hints();
        Activity {
            last_hint,
            last_request,
            workers: core
                .fleet()
                .iter()
                .map(|w| (w.address.to_string(), w.hints_since_event, w.last_event))
                .collect(),
        }
    }

    /// The `no_events` condition at `now` (see [`crate::event_plane::EventPlane::silent_while_hinting`]).
    pub fn silent_while_hinting(&self, now: Instant) -> bool {
        let (last_hint, _) = self.core().last_hints();
        self.plane()
            .silent_while_hinting(&self.alarms, last_hint, now)
    }

    /// Every replica's per-worker totals: ours from the core, the peers' as last published.
    pub(super) fn served_totals(&self) -> Totals {
        let mine = self.core().served();
        let brain = self.replication();
        let r = brain.peers();
        let me = r.me().to_owned();
        let mut totals: Totals = mine
            .into_iter()
            .map(|(worker, t)| ((me.clone(), worker), t))
            .collect();
        for (peer, worker, t) in r.served() {
            totals.insert((peer.to_owned(), worker.to_owned()), *t);
        }
        totals
    }

    /// The alarms that are on at `now`: the event plane's, and those on what the engines
    /// reported (weighed over `[alarms] truth_window_s`).
    pub fn alarms_on(&self, now: Instant) -> Vec<Alarm> {
        let activity = self.activity();
        let mut on = self.plane().alarms(&self.alarms, &activity, now);
        let totals = self.served_totals();
        let me = self.replication().peers().me().to_owned();
        let window = Duration::from_secs(self.alarms.truth_window_s);
        {
            let mut watch = lock(&self.truth);
            watch.observe(now, totals, window);
            on.extend(watch.alarms(&me, &self.alarms));
        }
        on.extend(self.divergent_alarms(&me, now));
        on
    }

    /// `replica_divergent`: a cache of ours has disagreed with a peer's after the same message
    /// for `[alarms] divergent_intervals` replica intervals — longer than a repair takes.
    fn divergent_alarms(&self, me: &str, now: Instant) -> Vec<Alarm> {
        let Some(interval) = self.peer_wait.map(|three| three / 3) else {
            return Vec::new();
        };
        let intervals = self.alarms.divergent_intervals;
        let divergent = self
            .replication()
            .peers()
            .divergent_for(now, interval * intervals);
        divergent
            .into_iter()
            .map(|(peer, (worker, rank), long)| Alarm {
                name: "replica_divergent",
                subject: format!("{worker}#{rank}"),
                message: format!(
                    "replica {me}: its copy of worker {worker} (rank {rank}) has disagreed with \
                     replica {peer}'s after the same KV event for {:.1} s, more than \
                     {intervals} intervals: the repair that ends a divergence did not happen — \
                     look for 'replica plane:' WARN lines (a snapshot that failed), compare the \
                     two on /debug/replicas; restarting the replica whose copy is wrong warms it \
                     from its peers",
                    long.as_secs_f64()
                ),
            })
            .collect()
    }

    /// Check the alarms every few seconds, forever: a log line when one starts or stops, and
    /// the `kvroute_alarm{alarm,subject}` gauges.
    pub async fn watch_alarms(self: Arc<Self>) {
        let every = Duration::from_secs((self.alarms.silence_s / 3).clamp(1, 10));
        let mut on: BTreeSet<(&'static str, String)> = BTreeSet::new();
        loop {
            tokio::time::sleep(every).await;
            let alarms = self.alarms_on(Instant::now());
            let now: BTreeSet<_> = alarms.iter().map(|a| (a.name, a.subject.clone())).collect();
            for a in &alarms {
                if !on.contains(&(a.name, a.subject.clone())) {
                    tracing::warn!(alarm = a.name, subject = %a.subject, "{}", a.message);
                }
            }
            for (name, subject) in on.difference(&now) {
                tracing::info!(alarm = name, %subject, "alarm cleared");
            }
            for (name, subject) in on.union(&now) {
                self.metrics
                    .alarm
                    .get_or_create(&AlarmLabels {
                        alarm: name.to_string(),
                        subject: subject.clone(),
                    })
                    .set(i64::from(now.contains(&(name, subject.clone()))));
            }
            on = now;
        }
    }
}
