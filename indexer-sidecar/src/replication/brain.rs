//! Every decision of the replica plane, pure: [`Brain::on`] takes what happened (an interval
//! came round, a message arrived, a transfer ended) with the time and returns the
//! [`Effect`]s for the plane to execute — publish, ask, fetch, hand to the core. The NATS
//! loop ([`super::plane`]) only reads sockets and executes; the facts it gathers from the core
//! (our reports, what we hold) come in with the event.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::peers::{Change, Replicas, Why};
use super::wire::{
    self, Digests, FillReply, FillRequest, LoadShare, SnapshotChunk, SnapshotRequest, CHUNK,
};
use crate::config::ReplicasConfig;
use crate::core::digest::{CacheKey, CacheReport, Snapshot};
use crate::core::load::PeerTicket;
use crate::core::truth::Truth;

/// How long a snapshot taken for a peer serves its further chunks.
const SNAPSHOT_KEPT: Duration = Duration::from_secs(10);

/// The subjects of one replica group.
#[derive(Debug, Clone)]
pub struct Subjects {
    /// Everyone's digests.
    pub digests: String,
    /// Snapshot requests to a replica: `{snapshots}.{replica}`.
    pub snapshots: String,
    /// Fill requests, to everyone.
    pub fills: String,
    /// Fill replies to this replica.
    pub filled: String,
    /// Everyone's load shares.
    pub loads: String,
}

impl Subjects {
    /// The subjects of `config`'s group, for replica `me`.
    pub fn new(config: &ReplicasConfig, me: &str) -> Self {
        let group = &config.group;
        Subjects {
            digests: config.subject(),
            snapshots: format!("kvroute.replicas.{group}.snapshot"),
            fills: format!("kvroute.replicas.{group}.fill"),
            filled: format!("kvroute.replicas.{group}.filled.{me}"),
            loads: format!("kvroute.replicas.{group}.load"),
        }
    }
}

/// What reaches the replica plane.
pub enum Event<'a> {
    /// The digest interval: our caches and per-worker totals as they are now, and which
    /// workers this replica serves (a peer's fleet may hold others).
    Tick {
        /// Our caches.
        mine: &'a [CacheReport],
        /// Our finished requests' totals per worker.
        served: Vec<(String, Truth)>,
        /// Whether this replica serves a worker.
        serves: &'a dyn Fn(&str) -> bool,
    },
    /// The load interval: our hinted requests in flight and survival estimates per worker.
    LoadTick {
        /// (worker address, requests).
        in_flight: Vec<(String, u32)>,
        /// (worker address, our own survival estimate).
        survival: Vec<(String, f64)>,
        /// (worker address, our open tickets there with their prompt blocks).
        tickets: Vec<(String, Vec<PeerTicket>)>,
    },
    /// The fill interval: our messages lost for at least a fill interval, per cache.
    FillTick {
        /// (cache, sequence numbers).
        wanted: Vec<(CacheKey, Vec<u64>)>,
    },
    /// A peer's digests arrived.
    Digests {
        /// The message.
        payload: &'a [u8],
        /// Our caches now, to compare with.
        mine: &'a [CacheReport],
    },
    /// A peer's load share arrived.
    PeerLoad(&'a [u8]),
    /// A peer asked everyone for messages it lost.
    FillAsked {
        /// The message.
        payload: &'a [u8],
        /// Where to answer.
        reply: Option<&'a str>,
    },
    /// A peer handed over messages we lost.
    Filled(&'a [u8]),
    /// A peer asked us for a chunk of a snapshot; `cursor` is our last message of the cache
    /// it names, read by the plane once [`Brain::snapshot_request`] decoded it.
    SnapshotAsked {
        /// The request.
        request: SnapshotRequest,
        /// Where to answer.
        reply: &'a str,
        /// Our last message of that cache (`None`: not known here).
        cursor: Option<u64>,
    },
    /// The snapshot [`Effect::TakeSnapshot`] asked for (`None`: the cache is not known here).
    Taken {
        /// The request it answers.
        request: SnapshotRequest,
        /// Where to answer.
        reply: &'a str,
        /// The cache as it is now.
        snapshot: Option<Snapshot>,
    },
    /// A snapshot transfer from a peer ended, installed or not: another may be asked for.
    Fetched(CacheKey),
}

/// What the plane does.
#[derive(Debug, PartialEq)]
pub enum Effect {
    /// Publish `body` on `subject`, answers to `reply` when given.
    Publish {
        /// The subject.
        subject: String,
        /// Where answers go.
        reply: Option<String>,
        /// JSON.
        body: Vec<u8>,
    },
    /// Fetch a peer's snapshot of a cache (chunk by chunk) and install it.
    Fetch {
        /// The peer.
        peer: String,
        /// Its subject for snapshot requests.
        subject: String,
        /// The cache.
        cache: CacheKey,
        /// Why.
        why: Why,
    },
    /// Answer a snapshot request on `reply` (a chunk, or empty for a cache not known here).
    Answer {
        /// The requester's reply subject.
        reply: String,
        /// The chunk.
        body: Vec<u8>,
    },
    /// Hand the core a peer's requests in flight.
    PeerLoad(LoadShare),
    /// Hand the core messages a peer filled in.
    Fill(FillReply),
    /// Answer a fill request on `reply` with what we hold of those messages
    /// ([`wire::fill_reply`]).
    AnswerFill {
        /// Where.
        reply: String,
        /// The request, its sequence numbers bounded.
        ask: FillRequest,
    },
    /// Take a snapshot of a cache and come back with [`Event::Taken`].
    TakeSnapshot {
        /// The request.
        request: SnapshotRequest,
        /// Where to answer.
        reply: String,
    },
    /// Caches whose agreement with a peer changed: for the metrics and the log.
    Compared(Vec<Change>),
    /// A message that could not be read: for the log.
    Ignored {
        /// Which kind.
        what: &'static str,
        /// Why.
        error: String,
    },
}

/// The replica plane's state: the peers, what was last shared, snapshots taken for peers.
#[derive(Debug)]
pub struct Brain {
    peers: Replicas,
    subjects: Subjects,
    reconcile: bool,
    /// Load shares go out when they change, and at least every `heartbeat`.
    heartbeat: Duration,
    /// The last load share, its tickets without blocks: the next is due when this changes.
    shared: Option<(LoadShare, Instant)>,
    taken: HashMap<CacheKey, (Instant, Arc<Snapshot>)>,
}

impl Brain {
    /// A replica named `me`; peers silent for `timeout` are forgotten.
    pub fn new(me: String, timeout: Duration, config: Option<&ReplicasConfig>) -> Self {
        let subjects = match config {
            Some(c) => Subjects::new(c, &me),
            None => Subjects::new(&ReplicasConfig::default(), &me),
        };
        Brain {
            subjects,
            reconcile: config.is_some_and(|c| c.reconcile),
            heartbeat: Duration::from_millis(config.map_or(2000, |c| c.interval_ms)),
            peers: Replicas::new(me, timeout),
            shared: None,
            taken: HashMap::new(),
        }
    }

    /// What this replica knows of its peers.
    pub fn peers(&self) -> &Replicas {
        &self.peers
    }

    /// The same, to update.
    pub fn peers_mut(&mut self) -> &mut Replicas {
        &mut self.peers
    }

    /// The subjects.
    pub fn subjects(&self) -> &Subjects {
        &self.subjects
    }

    /// A snapshot request's body decoded; `None` for one that is not (it gets an empty
    /// answer).
    pub fn snapshot_request(payload: &[u8]) -> Option<SnapshotRequest> {
        wire::decode(payload).ok()
    }

    /// Decide what to do about `event` at `now`.
    pub fn on(&mut self, event: Event<'_>, now: Instant) -> Vec<Effect> {
        match event {
            Event::Tick {
                mine,
                served,
                serves,
            } => self.tick(mine, served, serves, now),
            Event::LoadTick {
                in_flight,
                survival,
                tickets,
            } => self.share_load(in_flight, survival, tickets, now),
            Event::FillTick { wanted } => wanted
                .into_iter()
                .filter_map(|((worker, rank), seqs)| {
                    let ask = FillRequest {
                        replica: self.peers.me().to_owned(),
                        worker,
                        rank,
                        seqs,
                    };
                    Some(Effect::Publish {
                        subject: self.subjects.fills.clone(),
                        reply: Some(self.subjects.filled.clone()),
                        body: serde_json::to_vec(&ask).ok()?,
                    })
                })
                .collect(),
            Event::Digests { payload, mine } => match wire::decode::<Digests>(payload) {
                Ok(theirs) => vec![Effect::Compared(self.peers.observe(theirs, mine, now))],
                Err(error) => ignored("digests", error),
            },
            Event::PeerLoad(payload) => match wire::decode::<LoadShare>(payload) {
                Ok(share) if share.replica != self.peers.me() => vec![Effect::PeerLoad(share)],
                Ok(_) => Vec::new(),
                Err(error) => ignored("load", error),
            },
            Event::FillAsked { payload, reply } => {
                let (Some(reply), Ok(mut ask)) = (reply, wire::decode::<FillRequest>(payload))
                else {
                    return Vec::new();
                };
                if ask.replica == self.peers.me() {
                    return Vec::new();
                }
                ask.seqs.truncate(wire::bounded(&ask.seqs).len());
                vec![Effect::AnswerFill {
                    reply: reply.to_owned(),
                    ask,
                }]
            }
            Event::Filled(payload) => match wire::decode::<FillReply>(payload) {
                Ok(fill) => vec![Effect::Fill(fill)],
                Err(error) => ignored("fill reply", error),
            },
            Event::SnapshotAsked {
                request,
                reply,
                cursor,
            } => self.snapshot_asked(request, reply, cursor, now),
            Event::Taken {
                request,
                reply,
                snapshot,
            } => {
                let Some(snapshot) = snapshot else {
                    return vec![answer(reply, Vec::new())];
                };
                let key = (request.worker.clone(), request.rank);
                let snapshot = Arc::new(snapshot);
                self.taken.insert(key, (now, Arc::clone(&snapshot)));
                vec![answer(reply, chunk(&snapshot, request.offset))]
            }
            Event::Fetched(cache) => {
                self.peers.repaired(&cache);
                Vec::new()
            }
        }
    }

    /// Publish our digests; with `reconcile`, fetch the peers' copies that should replace ours.
    fn tick(
        &mut self,
        mine: &[CacheReport],
        served: Vec<(String, Truth)>,
        serves: &dyn Fn(&str) -> bool,
        now: Instant,
    ) -> Vec<Effect> {
        let digests = Digests {
            replica: self.peers.me().to_owned(),
            caches: wire::fit(mine.to_vec()),
            served,
        };
        let mut out = Vec::new();
        match serde_json::to_vec(&digests) {
            Ok(body) => out.push(Effect::Publish {
                subject: self.subjects.digests.clone(),
                reply: None,
                body,
            }),
            Err(e) => out.extend(ignored("our digests", e.to_string())),
        }
        if !self.reconcile {
            return out;
        }
        for (peer, cache, why) in self.peers.repairs(mine, now) {
            if !serves(&cache.0) {
                // A worker of a peer's fleet this replica does not serve.
                self.peers.repaired(&cache);
                continue;
            }
            out.push(Effect::Fetch {
                subject: format!("{}.{peer}", self.subjects.snapshots),
                peer,
                cache,
                why,
            });
        }
        out
    }

    /// Share our requests in flight and survival estimates when they changed, and every
    /// interval anyway. Tickets come with blocks the first time only (the core gives them
    /// once); past a message's budget a ticket goes without.
    fn share_load(
        &mut self,
        in_flight: Vec<(String, u32)>,
        survival: Vec<(String, f64)>,
        mut tickets: Vec<(String, Vec<PeerTicket>)>,
        now: Instant,
    ) -> Vec<Effect> {
        let bare = tickets
            .iter()
            .map(|(worker, open)| {
                let seqs = open.iter().map(|t| PeerTicket {
                    seq: t.seq,
                    blocks: Vec::new(),
                });
                (worker.clone(), seqs.collect())
            })
            .collect();
        let share = LoadShare {
            replica: self.peers.me().to_owned(),
            in_flight,
            survival,
            tickets: bare,
        };
        let due = self.shared.as_ref().is_none_or(|(last, at)| {
            *last != share || now.saturating_duration_since(*at) >= self.heartbeat
        });
        if !due {
            return Vec::new();
        }
        let mut budget = wire::TICKET_BLOCKS_SHARED;
        for t in tickets.iter_mut().flat_map(|(_, t)| t) {
            if t.blocks.len() > budget {
                t.blocks = Vec::new();
            }
            budget -= t.blocks.len();
        }
        let sent = LoadShare {
            tickets,
            ..share.clone()
        };
        let Ok(body) = serde_json::to_vec(&sent) else {
            return Vec::new();
        };
        self.shared = Some((share, now));
        vec![Effect::Publish {
            subject: self.subjects.loads.clone(),
            reply: None,
            body,
        }]
    }

    /// A new transfer gets the cache as it is now, unless it has not changed since the last
    /// one was taken (taking one holds the core's lock for the cache's size); further chunks
    /// come from the snapshot their transfer started with.
    fn snapshot_asked(
        &mut self,
        request: SnapshotRequest,
        reply: &str,
        cursor: Option<u64>,
        now: Instant,
    ) -> Vec<Effect> {
        self.taken
            .retain(|_, (at, _)| now.saturating_duration_since(*at) < SNAPSHOT_KEPT);
        let key = (request.worker.clone(), request.rank);
        let kept = self.taken.get(&key).map(|(_, s)| Arc::clone(s));
        match kept {
            Some(s) if cursor == Some(s.seq) || request.offset > 0 => {
                vec![answer(reply, chunk(&s, request.offset))]
            }
            _ => vec![Effect::TakeSnapshot {
                request,
                reply: reply.to_owned(),
            }],
        }
    }
}

fn ignored(what: &'static str, error: String) -> Vec<Effect> {
    vec![Effect::Ignored { what, error }]
}

fn answer(reply: &str, body: Vec<u8>) -> Effect {
    Effect::Answer {
        reply: reply.to_owned(),
        body,
    }
}

/// One chunk of `snapshot` from entry `offset` on.
fn chunk(snapshot: &Snapshot, offset: usize) -> Vec<u8> {
    let from = offset.min(snapshot.entries.len());
    let to = (from + CHUNK).min(snapshot.entries.len());
    let (entries, parents) = crate::core::digest::to_wire(&snapshot.entries[from..to]);
    let chunk = SnapshotChunk {
        seq: snapshot.seq,
        total: snapshot.entries.len(),
        entries,
        parents,
    };
    serde_json::to_vec(&chunk).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::block_map::Entry;
    use crate::core::digest::Checkpoint;
    use crate::core::event::EngineHash;
    use kvroute_protocol::PrefixHash;

    fn config() -> ReplicasConfig {
        toml::from_str("group = \"g\"\nid = \"a\"\ninterval_ms = 1000\n").unwrap()
    }

    fn brain() -> Brain {
        Brain::new("a".into(), Duration::from_secs(3), Some(&config()))
    }

    fn report(worker: &str, seq: u64, digest: u64, clean: bool) -> CacheReport {
        CacheReport {
            worker: worker.into(),
            rank: 0,
            clean,
            filling: false,
            lost_at: 0,
            quiet_ms: None,
            checkpoints: vec![Checkpoint {
                seq,
                blocks: 1,
                digest,
            }],
        }
    }

    fn digests(replica: &str, caches: Vec<CacheReport>) -> Vec<u8> {
        serde_json::to_vec(&Digests {
            replica: replica.into(),
            caches,
            served: Vec::new(),
        })
        .unwrap()
    }

    /// Each tick publishes our digests; an unclean cache a clean peer holds is fetched from
    /// it, once, and only for a worker this replica serves.
    #[test]
    fn ticks_publish_and_repair_from_clean_peers() {
        let (mut b, now) = (brain(), Instant::now());
        let mine = [report("w1", 5, 50, false), report("w2", 5, 50, false)];
        let theirs = digests(
            "b",
            vec![report("w1", 5, 51, true), report("w2", 5, 51, true)],
        );
        let compared = b.on(
            Event::Digests {
                payload: &theirs,
                mine: &mine,
            },
            now,
        );
        assert!(matches!(&compared[..], [Effect::Compared(c)] if c.len() == 2));
        let serves = |w: &str| w == "w1";
        let tick = |b: &mut Brain| {
            b.on(
                Event::Tick {
                    mine: &mine,
                    served: Vec::new(),
                    serves: &serves,
                },
                now,
            )
        };
        let out = tick(&mut b);
        assert!(
            matches!(&out[0], Effect::Publish { subject, .. } if subject == "kvroute.replicas.g.digests")
        );
        let fetches: Vec<_> = out
            .iter()
            .filter_map(|e| match e {
                Effect::Fetch {
                    subject,
                    cache,
                    why,
                    ..
                } => Some((subject.as_str(), cache.0.as_str(), *why)),
                _ => None,
            })
            .collect();
        assert_eq!(
            fetches,
            vec![("kvroute.replicas.g.snapshot.b", "w1", Why::Unclean)]
        );
        assert_eq!(tick(&mut b).len(), 1, "asked already: only the digests");
        b.on(Event::Fetched(("w1".into(), 0)), now);
        assert_eq!(tick(&mut b).len(), 2, "asked again once the transfer ended");
    }

    /// Load shares go out when they change (requests or survival) and on the heartbeat, never
    /// our own back in.
    #[test]
    fn load_is_shared_on_change_and_heartbeat() {
        let (mut b, now) = (brain(), Instant::now());
        let load = |n| vec![("w1".to_owned(), n)];
        let tick = |b: &mut Brain, n, s: f64, at| {
            let survival = vec![("w1".to_owned(), s)];
            b.on(
                Event::LoadTick {
                    in_flight: load(n),
                    survival,
                    tickets: Vec::new(),
                },
                at,
            )
            .len()
        };
        assert_eq!(tick(&mut b, 1, 1.0, now), 1);
        assert_eq!(tick(&mut b, 1, 1.0, now), 0);
        assert_eq!(tick(&mut b, 2, 1.0, now), 1);
        assert_eq!(tick(&mut b, 2, 0.9, now), 1, "survival moved");
        let later = now + Duration::from_secs(1);
        assert_eq!(tick(&mut b, 2, 0.9, later), 1);
        let ours = serde_json::to_vec(&LoadShare {
            replica: "a".into(),
            in_flight: load(3),
            survival: Vec::new(),
            tickets: Vec::new(),
        })
        .unwrap();
        assert!(b.on(Event::PeerLoad(&ours), now).is_empty());
        let theirs = serde_json::to_vec(&LoadShare {
            replica: "b".into(),
            in_flight: load(3),
            survival: Vec::new(),
            tickets: Vec::new(),
        })
        .unwrap();
        assert!(
            matches!(&b.on(Event::PeerLoad(&theirs), now)[..], [Effect::PeerLoad(s)] if s.replica == "b")
        );
        assert!(matches!(
            &b.on(Event::PeerLoad(b"{"), now)[..],
            [Effect::Ignored { what: "load", .. }]
        ));
    }

    /// Tickets go out with the blocks the core gave them (a ticket's first listing only; see
    /// `core/load.rs`); a ticket's arrival or end is a change, and the blocks beyond a message's
    /// budget are dropped.
    #[test]
    fn tickets_share_their_blocks_within_a_budget() {
        let (mut b, now) = (brain(), Instant::now());
        let ticket = |seq, n| PeerTicket {
            seq,
            blocks: (0..n).collect(),
        };
        let share = |b: &mut Brain, tickets: Vec<PeerTicket>| {
            let out = b.on(
                Event::LoadTick {
                    in_flight: vec![("w1".to_owned(), tickets.len() as u32)],
                    survival: Vec::new(),
                    tickets: vec![("w1".to_owned(), tickets)],
                },
                now,
            );
            match &out[..] {
                [Effect::Publish { body, .. }] => {
                    let s: LoadShare = wire::decode(body).unwrap();
                    Some(
                        s.tickets[0]
                            .1
                            .iter()
                            .map(|t| (t.seq, t.blocks.len()))
                            .collect::<Vec<_>>(),
                    )
                }
                [] => None,
                other => panic!("{other:?}"),
            }
        };
        // As the core gives them: blocks with a ticket's first listing only.
        assert_eq!(share(&mut b, vec![ticket(1, 3)]), Some(vec![(1, 3)]));
        assert_eq!(share(&mut b, vec![ticket(1, 0)]), None, "unchanged");
        assert_eq!(
            share(&mut b, vec![ticket(1, 0), ticket(2, 5)]),
            Some(vec![(1, 0), (2, 5)])
        );
        let big = wire::TICKET_BLOCKS_SHARED as u64;
        assert_eq!(
            share(&mut b, vec![ticket(3, big), ticket(4, 1)]),
            Some(vec![(3, big as usize), (4, 0)]),
            "over the budget: without blocks"
        );
    }

    /// Lost messages are asked of everyone with our reply subject; a peer's ask is answered,
    /// bounded, and our own ask (it comes back to us too) is not.
    #[test]
    fn fills_are_asked_and_answered() {
        let (mut b, now) = (brain(), Instant::now());
        let out = b.on(
            Event::FillTick {
                wanted: vec![(("w1".into(), 0), vec![4, 5])],
            },
            now,
        );
        let [Effect::Publish {
            subject,
            reply,
            body,
        }] = &out[..]
        else {
            panic!("{out:?}")
        };
        assert_eq!(subject, "kvroute.replicas.g.fill");
        assert_eq!(reply.as_deref(), Some("kvroute.replicas.g.filled.a"));
        let own = b.on(
            Event::FillAsked {
                payload: body,
                reply: Some("r"),
            },
            now,
        );
        assert!(own.is_empty(), "our own request");
        let theirs = serde_json::to_vec(&FillRequest {
            replica: "b".into(),
            worker: "w1".into(),
            rank: 0,
            seqs: (0..10_000).collect(),
        })
        .unwrap();
        let out = b.on(
            Event::FillAsked {
                payload: &theirs,
                reply: Some("r"),
            },
            now,
        );
        let [Effect::AnswerFill { reply, ask }] = &out[..] else {
            panic!("{out:?}")
        };
        assert_eq!(reply, "r");
        assert_eq!(ask.seqs.len(), crate::core::digest::RECENT);
    }

    /// A transfer is served from the snapshot it started with; a new one takes the cache anew
    /// unless it has not changed since.
    #[test]
    fn snapshot_chunks_come_from_one_snapshot() {
        let (mut b, now) = (brain(), Instant::now());
        let request = |offset| SnapshotRequest {
            worker: "w1".into(),
            rank: 0,
            offset,
        };
        let asked = |b: &mut Brain, offset, cursor| {
            b.on(
                Event::SnapshotAsked {
                    request: request(offset),
                    reply: "r",
                    cursor,
                },
                now,
            )
        };
        assert!(matches!(
            &asked(&mut b, 0, Some(7))[..],
            [Effect::TakeSnapshot { .. }]
        ));
        let entries: Vec<Entry> = (0..CHUNK as u64 + 10)
            .map(|i| Entry::new(EngineHash(i), PrefixHash(i), None))
            .collect();
        let snapshot = Snapshot { seq: 7, entries };
        let out = b.on(
            Event::Taken {
                request: request(0),
                reply: "r",
                snapshot: Some(snapshot),
            },
            now,
        );
        let [Effect::Answer { body, .. }] = &out[..] else {
            panic!()
        };
        let first: SnapshotChunk = wire::decode(body).unwrap();
        assert_eq!(
            (first.seq, first.total, first.entries.len()),
            (7, CHUNK + 10, CHUNK)
        );
        // The cache moved on: the transfer's next chunk still comes from the same snapshot.
        let [Effect::Answer { body, .. }] = &asked(&mut b, CHUNK, Some(8))[..] else {
            panic!()
        };
        let rest: SnapshotChunk = wire::decode(body).unwrap();
        assert_eq!((rest.seq, rest.entries.len()), (7, 10));
        assert!(
            matches!(&asked(&mut b, 0, Some(7))[..], [Effect::Answer { .. }]),
            "unchanged"
        );
        assert!(matches!(
            &asked(&mut b, 0, Some(8))[..],
            [Effect::TakeSnapshot { .. }]
        ));
        let unknown = b.on(
            Event::Taken {
                request: request(0),
                reply: "r",
                snapshot: None,
            },
            now,
        );
        assert_eq!(unknown, vec![answer("r", Vec::new())]);
    }
}
