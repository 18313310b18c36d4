//! The replication ledger of [`Core`]: what replicas compare (each cache's checkpoints), what
//! they hand each other (lost messages, snapshots), and how a cache is rebuilt from them so it
//! is exactly what in-order application would have held ([`digest::CacheLog`] keeps the
//! record; this file applies it to the index).

use std::time::{Duration, Instant};

use super::cursor::Verdict;
use super::digest;
use super::event::KvEvent;
use super::fleet::WorkerId;
use super::index::CacheId;
use super::{Body, Core, Happened, Message, SnapshotFrom};
use crate::core::block_map::Entry;

impl Core {
    /// Book what a message's sequence verdict says about the cache's record, before the
    /// message is applied: clean from a known state on (the stream's first message, or an
    /// engine that restarted, empty); lost messages asked of peers, with the cache as it is now
    /// as the base a fill rebuilds from, or, without peers, unclean.
    pub(super) fn book_loss(
        &mut self,
        id: WorkerId,
        model: &str,
        m: &Message<'_>,
        verdict: Verdict,
        now: Instant,
    ) {
        let (rank, seq) = (m.stream, m.seq);
        // A stream's first message is Dynamo's `event_id` 1, vLLM's `seq` 0: a later first
        // message, of the stream or of a restarted engine's, follows lost ones.
        let start = match m.body {
            Body::Dynamo(_) => 1,
            Body::Vllm(_) => 0,
        };
        let lost = match verdict {
            Verdict::First | Verdict::Restarted if seq > start => Some((start, seq)),
            Verdict::Gap { from, to } => Some((from, to)),
            _ => None,
        };
        let fills = self.fill_timeout.is_some();
        let index = self.indexes.get(model);
        let Some(w) = self.fleet.get_mut(id) else {
            return;
        };
        let log = w.logs.entry(rank).or_default();
        if matches!(verdict, Verdict::First | Verdict::Restarted) {
            log.clean = true;
        }
        let Some((from, to)) = lost else {
            return;
        };
        if fills {
            let current = || {
                index.map_or_else(Vec::new, |i| {
                    i.snapshot(CacheId {
                        worker: id,
                        dp_rank: rank,
                    })
                })
            };
            log.lost(from, to, now, current);
        } else {
            log.lost_at = log.lost_at.max(to);
            log.clean = false;
        }
    }

    /// Every cache's recent checkpoints as of `now`, for the replica plane.
    pub fn reports(&self, now: Instant) -> Vec<digest::CacheReport> {
        self.fleet
            .iter()
            .flat_map(|w| {
                w.logs.iter().map(|(&rank, log)| digest::CacheReport {
                    worker: w.address.to_string(),
                    rank,
                    clean: log.is_clean(),
                    filling: log.filling(),
                    lost_at: log.lost_at,
                    quiet_ms: log.last_live.map(|at| {
                        u64::try_from(now.saturating_duration_since(at).as_millis())
                            .unwrap_or(u64::MAX)
                    }),
                    checkpoints: log.checkpoints(),
                })
            })
            .collect()
    }

    /// The last message applied to a cache of the worker at `address`.
    pub fn cursor_of(&self, address: &str, rank: u32) -> Option<u64> {
        self.fleet.by_address(address)?.cursors.get(&rank)?.last
    }

    /// A cache of the worker at `address` as it is now, for a peer to install; `None` for a
    /// worker or cache not known here.
    pub fn snapshot(&self, address: &str, rank: u32) -> Option<digest::Snapshot> {
        let seq = self.cursor_of(address, rank)?;
        let w = self.fleet.by_address(address)?;
        let index = self.indexes.get(&w.model)?;
        Some(digest::Snapshot {
            seq,
            entries: index.snapshot(CacheId {
                worker: w.id,
                dp_rank: rank,
            }),
        })
    }

    /// Install a snapshot of a cache, then re-apply the messages this replica applied after
    /// the snapshot's. A clean peer's leaves the cache clean unless messages are missing among
    /// those (then a fresher snapshot repairs it), and live copies of the messages up to it
    /// are duplicates. One saved on disk leaves it unclean (events while the sidecar was down
    /// may be missing; a peer's clean copy replaces it), and nothing is taken for a copy: a
    /// live message numbered below it is an engine that restarted meanwhile. Refused
    /// (`false`) when this replica no longer keeps those messages, or does not know the worker.
    pub(super) fn install(
        &mut self,
        address: &str,
        rank: u32,
        snapshot: &digest::Snapshot,
        from: SnapshotFrom,
        out: &mut Vec<Happened>,
    ) -> bool {
        let Some(id) = self.fleet.by_address(address).map(|w| w.id) else {
            return false;
        };
        let Some(w) = self.fleet.get_mut(id) else {
            return false;
        };
        let model = w.model.clone();
        let ours = w.cursors.get(&rank).and_then(|c| c.last).unwrap_or(0);
        let Some(contiguous) = w
            .logs
            .entry(rank)
            .or_default()
            .contiguous_after(snapshot.seq)
        else {
            return false;
        };
        if !self.indexes.contains_key(&model) {
            return false;
        }
        let next = snapshot.seq.wrapping_add(1);
        if !self.rebuild(id, rank, &model, &snapshot.entries, next, out) {
            return false;
        }
        if let Some(w) = self.fleet.get_mut(id) {
            if snapshot.seq > ours {
                // A peer's: events up to the snapshot's still on their way here are copies now.
                let cursor = w.cursors.entry(rank).or_default();
                cursor.last = Some(snapshot.seq);
                let peer = matches!(from, SnapshotFrom::Peer { .. });
                cursor.warm_through = peer.then_some(snapshot.seq);
            }
            let log = w.logs.entry(rank).or_default();
            // Clean only if the peer's copy was and nothing is missing since the snapshot:
            // else a fresher one is due.
            log.clean = from == SnapshotFrom::Peer { clean: true } && contiguous;
            // The copy is the peer's now: a peer that lost less lately still outranks it.
            log.lost_at = log.lost_at.max(snapshot.seq);
        }
        true
    }

    /// Put `entries` in as a cache just before message `from`, re-apply every message kept
    /// from `from` on in order (with the capacity bound, as the first time) and record a
    /// checkpoint after each; the cache just before the first message still missing is the
    /// base of the next fill. What in-order application would have held, up to that message.
    /// `false` past the index's 65,535 caches.
    fn rebuild(
        &mut self,
        id: WorkerId,
        rank: u32,
        model: &str,
        entries: &[Entry],
        from: u64,
        out: &mut Vec<Happened>,
    ) -> bool {
        let name = self.name(id);
        let cache = CacheId {
            worker: id,
            dp_rank: rank,
        };
        let Some(index) = self.indexes.get_mut(model) else {
            return false;
        };
        if index.install(cache, entries).is_none() {
            return false;
        }
        let (held, digest) = index.cache_state(cache);
        let Some(log) = self
            .fleet
            .get_mut(id)
            .map(|w| w.logs.entry(rank).or_default())
        else {
            return false;
        };
        log.restart_before(from, held, digest);
        let (messages, first_missing) = log.replay_from(from);
        let mut rebased = false;
        for (seq, events) in messages {
            self.rebase_before(id, rank, model, first_missing, seq, &mut rebased);
            for kv in &events {
                self.apply(&name, model, kv, out);
            }
            let (held, digest) = self.cache_state(model, cache);
            if let Some(log) = self.fleet.get_mut(id).and_then(|w| w.logs.get_mut(&rank)) {
                log.checkpoint(seq, held, digest);
            }
        }
        self.rebase_before(id, rank, model, first_missing, u64::MAX, &mut rebased);
        let blocks = self.indexes.get(model).map_or(0, |i| i.blocks_of(id));
        out.push(Happened::Holds {
            worker: name,
            blocks,
        });
        true
    }

    /// During a rebuild, before message `next` is applied: the cache is the base of the next
    /// fill if the first still-missing message comes before `next`.
    fn rebase_before(
        &mut self,
        id: WorkerId,
        rank: u32,
        model: &str,
        first_missing: Option<u64>,
        next: u64,
        rebased: &mut bool,
    ) {
        let Some(missing) = first_missing.filter(|&m| !*rebased && m < next) else {
            return;
        };
        *rebased = true;
        let entries = self.indexes.get(model).map_or_else(Vec::new, |i| {
            i.snapshot(CacheId {
                worker: id,
                dp_rank: rank,
            })
        });
        if let Some(log) = self.fleet.get_mut(id).and_then(|w| w.logs.get_mut(&rank)) {
            log.rebase(missing, entries);
        }
    }

    fn cache_state(&self, model: &str, cache: CacheId) -> (usize, u64) {
        self.indexes
            .get(model)
            .map_or((0, 0), |i| i.cache_state(cache))
    }

    /// Lost messages of every cache to ask peers for: missing for at least `age`.
    pub fn wanted(&self, now: Instant, age: Duration) -> Vec<(digest::CacheKey, Vec<u64>)> {
        self.fleet
            .iter()
            .flat_map(|w| {
                w.logs.iter().filter_map(move |(&rank, log)| {
                    let seqs = log.wanted(now, age);
                    (!seqs.is_empty()).then(|| ((w.address.to_string(), rank), seqs))
                })
            })
            .collect()
    }

    /// The messages among `seqs` this replica applied to a cache, for a peer that lost them.
    pub fn messages(&self, address: &str, rank: u32, seqs: &[u64]) -> Vec<(u64, Vec<KvEvent>)> {
        let Some(log) = self
            .fleet
            .by_address(address)
            .and_then(|w| w.logs.get(&rank))
        else {
            return Vec::new();
        };
        seqs.iter()
            .filter_map(|&seq| Some((seq, log.message(seq)?.to_vec())))
            .collect()
    }

    /// A peer's copies of messages this replica lost: put in their place, and the cache
    /// rebuilt from its base, so it is as if none had been lost (up to any still missing).
    pub(super) fn fill(
        &mut self,
        address: &str,
        rank: u32,
        messages: &[(u64, Vec<KvEvent>)],
        out: &mut Vec<Happened>,
    ) {
        let Some(id) = self.fleet.by_address(address).map(|w| w.id) else {
            return;
        };
        let name = self.name(id);
        let Some(w) = self.fleet.get_mut(id) else {
            return;
        };
        let model = w.model.clone();
        let Some(log) = w.logs.get_mut(&rank) else {
            return;
        };
        // Events of another rank would change another cache under this one's sequence.
        let sound: Vec<(u64, Vec<KvEvent>)> = messages
            .iter()
            .filter(|(_, events)| events.iter().all(|e| e.dp_rank == rank))
            .cloned()
            .collect();
        let Some((filled, earliest, base)) = log.fill(&sound) else {
            return;
        };
        match base {
            Some(base) => {
                self.rebuild(id, rank, &model, &base.entries, base.from, out);
            }
            None => {
                // Lost for good before these (the cache is unclean): no exact state to start
                // from. The messages from the earliest one filled on are applied again on top,
                // which leaves each block as the last of them to touch it says.
                let (messages, _) = log.replay_from(earliest);
                for (_, events) in &messages {
                    for kv in events {
                        self.apply(&name, &model, kv, out);
                    }
                }
                let cache = CacheId {
                    worker: id,
                    dp_rank: rank,
                };
                let (held, digest) = self.cache_state(&model, cache);
                if let Some(log) = self.fleet.get_mut(id).and_then(|w| w.logs.get_mut(&rank)) {
                    log.recheckpoint(held, digest);
                }
            }
        }
        out.push(Happened::Filled {
            worker: name,
            rank,
            messages: filled,
        });
    }

    /// Lost messages no peer handed over within the fill timeout are lost for good.
    pub(super) fn give_up(&mut self, now: Instant, out: &mut Vec<Happened>) {
        let Some(timeout) = self.fill_timeout else {
            return;
        };
        let mut gone = Vec::new();
        for w in self.fleet.iter_mut() {
            for (&rank, log) in &mut w.logs {
                let n = log.give_up(now, timeout);
                if n > 0 {
                    gone.push((w.id, rank, n));
                }
            }
        }
        for (id, rank, messages) in gone {
            out.push(Happened::Unfilled {
                worker: self.name(id),
                rank,
                messages,
            });
        }
    }
}
