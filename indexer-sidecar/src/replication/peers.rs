//! What this replica knows of its peers: their last digests per cache, how each cache compares
//! with ours ([`crate::core::digest::compare`]), and which of ours a peer's copy should
//! replace. Pure: the [`super::brain`] feeds it, time passed in.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use super::wire::Digests;
use crate::core::digest::{compare, Agreement, CacheReport};
use crate::core::truth::Truth;

pub use crate::core::digest::CacheKey;

#[derive(Debug)]
struct Peer {
    last_seen: Instant,
    caches: HashMap<CacheKey, CacheReport>,
    served: Vec<(String, Truth)>,
    states: BTreeMap<CacheKey, Agreement>,
    /// Since when each divergent cache has been divergent.
    divergent_since: HashMap<CacheKey, Instant>,
    /// Caches where the peer has applied a later message than ours: our last one then, and
    /// since when. A message lost at the end of a burst shows as no gap until the next one
    /// arrives, which may be never: staying behind is a divergence of its own.
    behind_since: HashMap<CacheKey, (u64, Instant)>,
}

/// Why a cache of ours is taken from a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// We hold none of it.
    Missing,
    /// Ours stayed behind the peer's.
    Behind,
    /// Ours lost messages for good.
    Unclean,
    /// The copies disagree at the same message; the peer's lost messages less lately (or
    /// neither copy says which is right, and the peer's id is the lower).
    Divergent {
        /// The latest message before which ours lost some.
        ours_lost_at: u64,
        /// The same of the peer's.
        theirs_lost_at: u64,
    },
    /// No peer holds a clean copy, and ours stayed behind the peer's unclean one (`behind`)
    /// or both lost messages for good and disagree: converge on the peer's (ahead, or it lost
    /// messages less lately, or its id is the lower), which stays unclean here too.
    NoCleanCopy {
        /// Ours stayed behind the peer's (else the two disagree).
        behind: bool,
        /// The latest message before which ours lost some.
        ours_lost_at: u64,
        /// The same of the peer's.
        theirs_lost_at: u64,
    },
}

impl Why {
    /// For the repair's log line.
    pub fn describe(&self) -> String {
        match self {
            Why::Missing => "we hold none of it".into(),
            Why::Behind => "ours stayed behind the peer's".into(),
            Why::Unclean => "ours lost messages no peer could hand over".into(),
            Why::Divergent {
                ours_lost_at,
                theirs_lost_at,
            } if ours_lost_at == theirs_lost_at => format!(
                "the copies disagree after the same message and neither lost messages more \
                 lately (both at {ours_lost_at}): taking the lower replica id's copy"
            ),
            Why::Divergent {
                ours_lost_at,
                theirs_lost_at,
            } => format!(
                "the copies disagree after the same message; ours lost messages at \
                 {ours_lost_at}, the peer's {}",
                if *theirs_lost_at == 0 {
                    "never".to_owned()
                } else {
                    format!("at {theirs_lost_at}")
                }
            ),
            Why::NoCleanCopy { behind: true, .. } => "ours stayed behind the peer's, and no \
                 replica has a clean copy: taking the peer's, still unclean"
                .into(),
            Why::NoCleanCopy {
                ours_lost_at,
                theirs_lost_at,
                ..
            } => format!(
                "both copies lost messages for good (ours at {ours_lost_at}, the peer's at \
                 {theirs_lost_at}) and disagree, and no replica has a clean one: converging on \
                 the peer's, still unclean"
            ),
        }
    }

    /// Whether the copy taken is as clean as the peer says its own is: not when no clean
    /// copy existed.
    pub fn takes_clean_copy(&self) -> bool {
        !matches!(self, Why::NoCleanCopy { .. })
    }
}

/// A cache whose agreement with a peer changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// The peer.
    pub peer: String,
    /// The cache.
    pub cache: CacheKey,
    /// How it compares now.
    pub now: Agreement,
    /// Agreeing again: how long it had been divergent.
    pub healed_after: Option<Duration>,
}

/// Caches by agreement, over every peer (a cache counts once per peer).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Summary {
    /// Peers heard from recently.
    pub peers: usize,
    /// Caches that agree.
    pub agree: usize,
    /// Caches that disagree.
    pub divergent: usize,
    /// Caches not comparable yet.
    pub unknown: usize,
}

/// This replica's view of its peers.
#[derive(Debug)]
pub struct Replicas {
    me: String,
    peers: BTreeMap<String, Peer>,
    /// A peer not heard from for this long is gone.
    timeout: Duration,
    /// Repairs asked for, by cache, and when: one at a time per cache, again after `timeout`.
    asked: HashMap<CacheKey, Instant>,
}

impl Replicas {
    /// No peer yet; peers silent for `timeout` are forgotten.
    pub fn new(me: String, timeout: Duration) -> Self {
        Replicas {
            me,
            peers: BTreeMap::new(),
            timeout,
            asked: HashMap::new(),
        }
    }

    /// Caches of ours a clean peer's copy should replace, each with that peer and why: we have
    /// none (a sidecar that just started, a worker quiet since: the warm start and the repair
    /// are one thing); ours stayed behind the peer's; ours lost messages for good and does not
    /// agree; or the two disagree at the same message for two intervals, whatever each
    /// believes of itself, and the peer's copy lost messages less lately than ours (or, when
    /// that does not tell them apart, the peer's id is the lower: both take the same copy).
    fn wanted(&self, mine: &[CacheReport], now: Instant) -> Vec<(String, CacheKey, Why)> {
        // Behind for an interval: not a message in flight.
        let stuck = self.interval();
        let ours: HashMap<CacheKey, &CacheReport> = mine
            .iter()
            .map(|m| ((m.worker.clone(), m.rank), m))
            .collect();
        let mut out: BTreeMap<CacheKey, (Why, (bool, u64, &str))> = BTreeMap::new();
        for (peer, p) in &self.peers {
            for (key, theirs) in &p.caches {
                let why = match ours.get(key) {
                    None if theirs.clean => {
                        (!theirs.checkpoints.is_empty()).then_some(Why::Missing)
                    }
                    None => None,
                    Some(m) => {
                        let behind = p.behind_since.get(key).is_some_and(|(seq, since)| {
                            m.checkpoints.last().map(|c| c.seq) == Some(*seq)
                                && now.saturating_duration_since(*since) >= stuck
                        });
                        let agree = matches!(p.states.get(key), Some(Agreement::Agree { .. }));
                        let outranked =
                            (theirs.lost_at, peer.as_str()) < (m.lost_at, self.me.as_str());
                        let divergent =
                            matches!(p.states.get(key), Some(Agreement::Divergent { .. }))
                                && p.divergent_since.get(key).is_some_and(|since| {
                                    now.saturating_duration_since(*since) >= 2 * stuck
                                });
                        // Behind for an interval, and the peer's copy the same at our last
                        // message: ours lost the messages after it (none came to show the
                        // gap), unclean whatever it believes. (Not the same there: another
                        // stream, as an engine that restarted, which the peer missed.)
                        let lost_tail = behind
                            && matches!(p.states.get(key), Some(Agreement::Agree { seq })
                                if m.checkpoints.last().map(|c| c.seq) == Some(*seq));
                        let unclean = (!m.clean || lost_tail) && !m.filling;
                        if !theirs.clean {
                            // Only to converge when no peer holds a clean copy, and only once
                            // neither copy waits for a fill (a fill rebuilds from what ours
                            // held when it lost the message).
                            let diverged = divergent && outranked;
                            let none_clean = !self
                                .peers
                                .values()
                                .any(|q| q.caches.get(key).is_some_and(|c| c.clean));
                            ((behind || diverged) && unclean && none_clean && !theirs.filling)
                                .then_some(Why::NoCleanCopy {
                                    behind,
                                    ours_lost_at: m.lost_at,
                                    theirs_lost_at: theirs.lost_at,
                                })
                        } else if behind {
                            Some(Why::Behind)
                        } else if unclean && !agree {
                            Some(Why::Unclean)
                        } else if divergent && outranked {
                            Some(Why::Divergent {
                                ours_lost_at: m.lost_at,
                                theirs_lost_at: theirs.lost_at,
                            })
                        } else {
                            None
                        }
                    }
                };
                let Some(why) = why else {
                    continue;
                };
                // A clean copy first; the one that lost least lately, of every peer that would do.
                let rank = (!theirs.clean, theirs.lost_at, peer.as_str());
                match out.get(key) {
                    Some((_, best)) if *best <= rank => {}
                    _ => {
                        out.insert(key.clone(), (why, rank));
                    }
                }
            }
        }
        out.into_iter()
            .map(|(key, (why, (_, _, peer)))| (peer.to_owned(), key, why))
            .collect()
    }

    /// Caches divergent from a peer's for at least `after`: (peer, cache, for how long).
    pub fn divergent_for(
        &self,
        now: Instant,
        after: Duration,
    ) -> Vec<(String, CacheKey, Duration)> {
        self.peers
            .iter()
            .flat_map(|(peer, p)| {
                p.divergent_since.iter().filter_map(move |(key, since)| {
                    let long = now.saturating_duration_since(*since);
                    (long >= after).then(|| (peer.clone(), key.clone(), long))
                })
            })
            .collect()
    }

    /// Caches to repair now (see `wanted`), not asked for recently.
    pub fn repairs(&mut self, mine: &[CacheReport], now: Instant) -> Vec<(String, CacheKey, Why)> {
        let timeout = self.timeout;
        self.asked
            .retain(|_, at| now.saturating_duration_since(*at) < timeout);
        let wanted: Vec<_> = self
            .wanted(mine, now)
            .into_iter()
            .filter(|(_, key, _)| !self.asked.contains_key(key))
            .collect();
        for (_, key, _) in &wanted {
            self.asked.insert(key.clone(), now);
        }
        wanted
    }

    /// Whether this replica holds what its peers can give it: no cache waits for a clean
    /// peer's copy. `false` before any peer was heard (the caller decides how long to wait).
    pub fn warm(&self, mine: &[CacheReport], now: Instant) -> bool {
        !self.peers.is_empty()
            && self
                .wanted(mine, now)
                .iter()
                .all(|(_, _, why)| !why.takes_clean_copy())
    }

    /// Whether any peer was heard.
    pub fn has_peers(&self) -> bool {
        !self.peers.is_empty()
    }

    /// A repair of `cache` ended (installed or not): another may be asked for.
    pub fn repaired(&mut self, cache: &CacheKey) {
        self.asked.remove(cache);
    }

    /// This replica's id.
    pub fn me(&self) -> &str {
        &self.me
    }

    /// The digest interval: a third of the peer timeout.
    fn interval(&self) -> Duration {
        self.timeout / 3
    }

    /// A peer's digests arrived at `now`; `mine` are this replica's caches now. Returns the
    /// caches whose agreement changed (our own messages are ignored).
    pub fn observe(&mut self, theirs: Digests, mine: &[CacheReport], now: Instant) -> Vec<Change> {
        if theirs.replica == self.me {
            return Vec::new();
        }
        let interval = self.interval();
        let peer = self.peers.entry(theirs.replica.clone()).or_insert(Peer {
            last_seen: now,
            caches: HashMap::new(),
            served: Vec::new(),
            states: BTreeMap::new(),
            divergent_since: HashMap::new(),
            behind_since: HashMap::new(),
        });
        peer.last_seen = now;
        peer.served = theirs.served;
        peer.caches = theirs
            .caches
            .into_iter()
            .map(|c| ((c.worker.clone(), c.rank), c))
            .collect();
        let mut changes = Vec::new();
        let mut states = BTreeMap::new();
        for m in mine {
            let key = (m.worker.clone(), m.rank);
            let Some(t) = peer.caches.get(&key) else {
                continue;
            };
            // A copy on the stream before a restart ours saw: its numbers say nothing of ours.
            let stale = older_stream(m, t, interval);
            let last = |c: &CacheReport| c.checkpoints.last().map(|c| c.seq);
            match (last(m), last(t)) {
                (Some(ours), Some(theirs)) if theirs > ours && !stale => {
                    let entry = peer.behind_since.entry(key.clone()).or_insert((ours, now));
                    if entry.0 != ours {
                        *entry = (ours, now);
                    }
                }
                _ => {
                    peer.behind_since.remove(&key);
                }
            }
            let now_state = if stale {
                Agreement::Unknown
            } else {
                compare(&m.checkpoints, &t.checkpoints)
            };
            let kind = |a: &Agreement| std::mem::discriminant(a);
            let before = peer.states.get(&key);
            // Unknown says nothing new: a divergence stays one until the digests agree.
            let state = match (before, now_state) {
                (Some(b @ Agreement::Divergent { .. }), Agreement::Unknown) if !stale => *b,
                _ => now_state,
            };
            if before.is_none_or(|b| kind(b) != kind(&state)) {
                let healed_after = match state {
                    Agreement::Divergent { .. } => {
                        peer.divergent_since.insert(key.clone(), now);
                        None
                    }
                    _ => peer
                        .divergent_since
                        .remove(&key)
                        .map(|since| now.saturating_duration_since(since)),
                };
                changes.push(Change {
                    peer: theirs.replica.clone(),
                    cache: key.clone(),
                    now: state,
                    healed_after,
                });
            }
            states.insert(key, state);
        }
        peer.states = states;
        changes
    }

    /// Every peer's per-worker totals, as last published: (peer, worker, totals).
    pub fn served(&self) -> impl Iterator<Item = (&str, &str, &Truth)> {
        self.peers.iter().flat_map(|(id, p)| {
            p.served
                .iter()
                .map(move |(worker, t)| (id.as_str(), worker.as_str(), t))
        })
    }

    /// Forget peers silent past the timeout; their ids.
    pub fn expire(&mut self, now: Instant) -> Vec<String> {
        let timeout = self.timeout;
        let gone: Vec<String> = self
            .peers
            .iter()
            .filter(|(_, p)| now.saturating_duration_since(p.last_seen) > timeout)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &gone {
            self.peers.remove(id);
        }
        gone
    }

    /// Caches by agreement.
    pub fn summary(&self) -> Summary {
        let mut s = Summary {
            peers: self.peers.len(),
            ..Summary::default()
        };
        for state in self.peers.values().flat_map(|p| p.states.values()) {
            match state {
                Agreement::Agree { .. } => s.agree += 1,
                Agreement::Divergent { .. } => s.divergent += 1,
                Agreement::Unknown => s.unknown += 1,
            }
        }
        s
    }

    /// `GET /debug/replicas`: every peer, when it was last heard, its caches' latest
    /// checkpoint and how each compares with ours.
    pub fn debug(&self, now: Instant) -> serde_json::Value {
        let peers: Vec<serde_json::Value> = self
            .peers
            .iter()
            .map(|(id, p)| {
                let caches: Vec<serde_json::Value> = p
                    .caches
                    .values()
                    .map(|c| {
                        let key = (c.worker.clone(), c.rank);
                        serde_json::json!({
                            "worker": c.worker,
                            "rank": c.rank,
                            "latest": c.checkpoints.last(),
                            "clean": c.clean,
                            "filling": c.filling,
                            "lost_at": c.lost_at,
                            "quiet_ms": c.quiet_ms,
                            "agreement": p.states.get(&key),
                        })
                    })
                    .collect();
                serde_json::json!({
                    "replica": id,
                    "last_seen_ms_ago": now.saturating_duration_since(p.last_seen).as_millis() as u64,
                    "caches": caches,
                    "served": served_json(&p.served),
                })
            })
            .collect();
        let s = self.summary();
        serde_json::json!({
            "replica": self.me,
            "peers": peers,
            "caches": {"agree": s.agree, "divergent": s.divergent, "unknown": s.unknown},
        })
    }
}

/// Whether the peer's copy last took a message from the engine more than `interval` before
/// ours did: then it is on the stream before an engine restart that ours saw and it has not
/// yet (the old stream's last message long before the new one's), and its numbers say nothing
/// of ours. Taking it as ahead (a higher number) or as the winner of a divergence (at a number
/// both streams used) would put the old stream's blocks back and skip the new stream's
/// messages as copies. Not the other way round: a copy of ours that stopped long before the
/// peer's (our subscription down while the engine went on) is behind it, and is repaired. An
/// engine back within an interval is not told apart here (its next message shows a restart).
fn older_stream(ours: &CacheReport, theirs: &CacheReport, interval: Duration) -> bool {
    let interval = u64::try_from(interval.as_millis()).unwrap_or(u64::MAX);
    matches!((ours.quiet_ms, theirs.quiet_ms),
        (Some(ours), Some(theirs)) if theirs > ours.saturating_add(interval))
}

/// Per worker: predicted and reported cached tokens, prompt tokens and the two hit rates.
pub fn served_json(served: &[(String, Truth)]) -> Vec<serde_json::Value> {
    served
        .iter()
        .map(|(worker, t)| {
            serde_json::json!({
                "worker": worker,
                "requests": t.compared(),
                "predicted_tokens": t.predicted_tokens,
                "cached_tokens": t.cached_tokens,
                "prompt_tokens": t.prompt_tokens,
                "predicted_hit_rate": t.predicted_rate(),
                "actual_hit_rate": t.actual_rate(),
                "exact": t.exact,
                "over": t.over,
                "under": t.under,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::digest::Checkpoint;

    fn report(worker: &str, points: &[(u64, u64)]) -> CacheReport {
        CacheReport {
            worker: worker.into(),
            rank: 0,
            clean: true,
            filling: false,
            lost_at: 0,
            quiet_ms: None,
            checkpoints: points
                .iter()
                .map(|&(seq, digest)| Checkpoint {
                    seq,
                    blocks: 1,
                    digest,
                })
                .collect(),
        }
    }

    fn from(replica: &str, caches: Vec<CacheReport>) -> Digests {
        Digests {
            replica: replica.into(),
            caches,
            served: Vec::new(),
        }
    }

    /// A divergence is found, kept while the peer's digest is not comparable, and cleared when
    /// the digests agree again; our own messages and silent peers do not count.
    #[test]
    fn peers_are_compared_cache_by_cache() {
        let now = Instant::now();
        let mut r = Replicas::new("a".into(), Duration::from_secs(6));
        let mine = [report("w1", &[(1, 10), (2, 20)]), report("w2", &[(5, 50)])];
        assert!(r
            .observe(from("a", vec![report("w1", &[(2, 99)])]), &mine, now)
            .is_empty());
        let changes = r.observe(
            from(
                "b",
                vec![report("w1", &[(2, 21)]), report("w2", &[(5, 50)])],
            ),
            &mine,
            now,
        );
        assert_eq!(changes.len(), 2);
        assert_eq!(
            r.summary(),
            Summary {
                peers: 1,
                agree: 1,
                divergent: 1,
                unknown: 0
            }
        );
        // Not comparable: still divergent, no change reported.
        let later = r.observe(from("b", vec![report("w1", &[(9, 1)])]), &mine, now);
        assert!(later.is_empty(), "{later:?}");
        assert_eq!(r.summary().divergent, 1);
        let later = now + Duration::from_secs(2);
        let healed = r.observe(from("b", vec![report("w1", &[(2, 20)])]), &mine, later);
        assert!(matches!(healed[0].now, Agreement::Agree { seq: 2 }));
        assert_eq!(healed[0].healed_after, Some(Duration::from_secs(2)));
        assert_eq!(
            r.expire(later + Duration::from_secs(7)),
            vec!["b".to_string()]
        );
        assert_eq!(r.summary(), Summary::default());
    }

    /// Only an unclean cache is repaired, only from a clean peer, and one request at a time.
    #[test]
    fn unclean_caches_are_repaired_from_clean_peers() {
        let now = Instant::now();
        let mut r = Replicas::new("a".into(), Duration::from_secs(6));
        let mut mine = report("w1", &[(2, 20)]);
        r.observe(
            from("b", vec![report("w1", &[(2, 21)])]),
            &[mine.clone()],
            now,
        );
        assert!(r.repairs(&[mine.clone()], now).is_empty(), "ours is clean");
        mine.clean = false;
        let asked = r.repairs(&[mine.clone()], now);
        assert_eq!(
            asked,
            vec![("b".to_string(), ("w1".to_string(), 0), Why::Unclean)]
        );
        assert!(r.repairs(&[mine.clone()], now).is_empty(), "already asked");
        r.repaired(&("w1".to_string(), 0));
        let mut theirs = report("w1", &[(2, 21)]);
        theirs.clean = false;
        r.observe(from("b", vec![theirs]), &[mine.clone()], now);
        assert!(r.repairs(&[mine], now).is_empty(), "no clean peer");
    }

    /// Two copies that both lost messages for good and disagree (both replicas lost the same
    /// message): after two intervals the one outranked (lost more lately, or the higher id)
    /// takes the other's, which stays unclean; the other takes nothing. Neither takes an
    /// unclean copy while a fill may still come, nor when they agree.
    #[test]
    fn unclean_copies_that_disagree_converge_on_one() {
        let now = Instant::now();
        let later = now + Duration::from_secs(4);
        let unclean = |lost_at: u64, digest: u64| CacheReport {
            lost_at,
            clean: false,
            ..report("w1", &[(5, digest)])
        };
        let mut a = Replicas::new("a".into(), Duration::from_secs(6));
        let mut b = Replicas::new("b".into(), Duration::from_secs(6));
        let (ours, theirs) = ([unclean(4, 50)], [unclean(4, 51)]);
        for at in [now, later] {
            a.observe(from("b", theirs.to_vec()), &ours, at);
            b.observe(from("a", ours.to_vec()), &theirs, at);
        }
        assert!(a.repairs(&ours, later).is_empty(), "a's id is the lower");
        let asked = b.repairs(&theirs, later);
        assert_eq!(asked.len(), 1, "{asked:?}");
        let why = asked[0].2;
        assert!(
            matches!(why, Why::NoCleanCopy { behind: false, .. }),
            "{why:?}"
        );
        assert!(!why.takes_clean_copy());
        // Not before two intervals; not while ours is still filling.
        let mut c = Replicas::new("c".into(), Duration::from_secs(6));
        c.observe(from("a", ours.to_vec()), &theirs, now);
        assert!(c.repairs(&theirs, now).is_empty());
        let filling = [CacheReport {
            filling: true,
            ..unclean(4, 51)
        }];
        c.observe(from("a", ours.to_vec()), &filling, later);
        assert!(c.repairs(&filling, later).is_empty());
        // Behind an unclean peer (our last message lost, none after it), ours unclean too: its
        // copy, after an interval.
        let mine = [CacheReport {
            lost_at: 3,
            clean: false,
            ..report("w1", &[(8, 80)])
        }];
        let ahead = || {
            let t = CacheReport {
                lost_at: 4,
                clean: false,
                ..report("w1", &[(8, 80), (9, 90)])
            };
            from("a", vec![t])
        };
        // The peer seen ahead now and an interval later: what is asked each time.
        let behind = |id: &str, mine: &[CacheReport]| {
            let mut r = Replicas::new(id.into(), Duration::from_secs(6));
            r.observe(ahead(), mine, now);
            let at_once = r.repairs(mine, now);
            r.observe(ahead(), mine, later);
            (at_once, r.repairs(mine, later))
        };
        let (at_once, asked) = behind("d", &mine);
        assert!(at_once.is_empty(), "a message may be in flight");
        assert!(
            matches!(&asked[..], [(_, _, Why::NoCleanCopy { behind: true, .. })]),
            "{asked:?}"
        );
        // The same with ours believing itself clean: it lost only its last messages (the peer
        // lost two of them for good, we the rest, so no fill could tell us).
        let (at_once, asked) = behind("g", &[report("w1", &[(8, 80)])]);
        assert!(at_once.is_empty(), "a message may be in flight");
        assert!(
            matches!(&asked[..], [(_, _, Why::NoCleanCopy { behind: true, .. })]),
            "{asked:?}"
        );
        // Not when the copies differ at our last message: ours is another stream (its engine
        // restarted; the unclean peer missed it), not one that lost its tail.
        let mut h = Replicas::new("h".into(), Duration::from_secs(6));
        let restarted = [report("w1", &[(2, 20)])];
        let stale = || {
            let t = CacheReport {
                lost_at: 4,
                clean: false,
                ..report("w1", &[(2, 7), (3, 8), (9, 90)])
            };
            from("a", vec![t])
        };
        h.observe(stale(), &restarted, now);
        h.observe(stale(), &restarted, later);
        assert!(h.repairs(&restarted, later).is_empty());
        // Not while a peer holds a clean copy (here one that agrees with ours).
        let mut e = Replicas::new("e".into(), Duration::from_secs(6));
        for at in [now, later] {
            e.observe(from("a", ours.to_vec()), &theirs, at);
            e.observe(from("f", vec![report("w1", &[(5, 51)])]), &theirs, at);
        }
        assert!(e.repairs(&theirs, later).is_empty());
    }

    /// A cache a clean peer holds and we do not is wanted (the warm start); once ours agrees
    /// the replica is warm.
    #[test]
    fn missing_caches_are_taken_from_clean_peers() {
        let now = Instant::now();
        let mut r = Replicas::new("a".into(), Duration::from_secs(6));
        assert!(!r.warm(&[], now), "no peer heard yet");
        r.observe(from("b", vec![report("w1", &[(9, 90)])]), &[], now);
        assert!(!r.warm(&[], now));
        assert_eq!(
            r.repairs(&[], now),
            vec![("b".to_string(), ("w1".to_string(), 0), Why::Missing)]
        );
        let mine = [report("w1", &[(9, 90)])];
        r.observe(from("b", vec![report("w1", &[(9, 90)])]), &mine, now);
        assert!(r.warm(&mine, now));
    }

    /// A cache that stays behind its peer's (our last message lost, none after it to show the
    /// gap) is taken from the peer after an interval, even though ours says clean.
    #[test]
    fn a_cache_left_behind_is_repaired() {
        let now = Instant::now();
        let mut r = Replicas::new("a".into(), Duration::from_secs(6));
        let mine = [report("w1", &[(8, 80), (9, 90)])];
        let theirs = || from("b", vec![report("w1", &[(9, 90), (10, 100)])]);
        r.observe(theirs(), &mine, now);
        assert!(
            r.repairs(&mine, now).is_empty(),
            "a message may be in flight"
        );
        let later = now + Duration::from_secs(2);
        r.observe(theirs(), &mine, later);
        assert_eq!(r.repairs(&mine, later).len(), 1);
    }

    /// A copy whose last message came over an interval before ours is another stream's (the
    /// engine restarted; ours saw it, the peer not yet): ours is not behind its higher number,
    /// and the two do not diverge at a number both used. One that came later, or within an
    /// interval, is the same stream's: ahead, or divergent, however long ours has been quiet.
    #[test]
    fn a_copy_older_than_ours_is_another_stream() {
        let now = Instant::now();
        let later = now + Duration::from_secs(4);
        let at = |quiet_ms: u64, points: &[(u64, u64)]| CacheReport {
            quiet_ms: Some(quiet_ms),
            ..report("w1", points)
        };
        let mine = [at(300, &[(0, 1), (1, 2), (2, 3)])];
        let asked = |theirs: CacheReport| {
            let mut r = Replicas::new("b".into(), Duration::from_secs(6));
            r.observe(from("a", vec![theirs.clone()]), &mine, now);
            r.observe(from("a", vec![theirs]), &mine, later);
            (r.repairs(&mine, later), r.summary())
        };
        let ahead = |quiet_ms| at(quiet_ms, &[(40, 9), (41, 10)]);
        assert!(
            asked(ahead(10_000)).0.is_empty(),
            "the peer missed the restart"
        );
        assert!(
            asked(ahead(2_301)).0.is_empty(),
            "over an interval before ours"
        );
        assert_eq!(asked(ahead(2_300)).0.len(), 1, "within an interval: ahead");
        assert_eq!(
            asked(ahead(5)).0[0].2,
            Why::Behind,
            "later than ours: ahead"
        );
        let overlapping = |quiet_ms| at(quiet_ms, &[(2, 7), (3, 8), (19, 9)]);
        let (repairs, summary) = asked(overlapping(10_000));
        assert!(repairs.is_empty(), "{repairs:?}");
        assert_eq!((summary.divergent, summary.unknown), (0, 1));
        let (repairs, summary) = asked(overlapping(100));
        assert_eq!((repairs.len(), summary.divergent), (1, 1), "{repairs:?}");
        // Ours stopped long before the peer's (our subscription was down while the engine
        // went on): behind it, repaired.
        let mut r = Replicas::new("b".into(), Duration::from_secs(6));
        let stalled = [at(60_000, &[(0, 1), (1, 2), (2, 3)])];
        for t in [now, later] {
            r.observe(from("a", vec![ahead(5)]), &stalled, t);
        }
        assert_eq!(r.repairs(&stalled, later)[0].2, Why::Behind);
    }

    /// Two clean copies that disagree after the same message: the one that lost messages more
    /// lately gives way after two intervals; when neither tells, the higher id does, so both
    /// end with one copy. A cache divergent that long is listed for the alarm.
    #[test]
    fn clean_copies_that_disagree_converge_on_one() {
        let now = Instant::now();
        let later = now + Duration::from_secs(4);
        let with = |lost_at: u64, digest: u64| CacheReport {
            lost_at,
            ..report("w1", &[(5, digest)])
        };
        // We lost at 3, the peer never: ours gives way, but not at once.
        let mut a = Replicas::new("a".into(), Duration::from_secs(6));
        let mine = [with(3, 50)];
        a.observe(from("b", vec![with(0, 51)]), &mine, now);
        assert!(a.repairs(&mine, now).is_empty(), "a fill may be on its way");
        assert!(a.divergent_for(now, Duration::from_secs(4)).is_empty());
        a.observe(from("b", vec![with(0, 51)]), &mine, later);
        let asked = a.repairs(&mine, later);
        assert_eq!(asked.len(), 1);
        assert_eq!(
            asked[0].2,
            Why::Divergent {
                ours_lost_at: 3,
                theirs_lost_at: 0
            }
        );
        assert_eq!(a.divergent_for(later, Duration::from_secs(4)).len(), 1);
        // The peer's side of the same: it keeps its copy.
        let mut b = Replicas::new("b".into(), Duration::from_secs(6));
        let theirs = [with(0, 51)];
        b.observe(from("a", vec![with(3, 50)]), &theirs, now);
        b.observe(from("a", vec![with(3, 50)]), &theirs, later);
        assert!(b.repairs(&theirs, later).is_empty());
        // Neither lost more lately: the lower id's copy is taken, by "b" only.
        let mut b = Replicas::new("b".into(), Duration::from_secs(6));
        let tie = [with(0, 51)];
        b.observe(from("a", vec![with(0, 50)]), &tie, now);
        b.observe(from("a", vec![with(0, 50)]), &tie, later);
        assert_eq!(b.repairs(&tie, later).len(), 1);
        let mut a = Replicas::new("a".into(), Duration::from_secs(6));
        let tie = [with(0, 50)];
        a.observe(from("b", vec![with(0, 51)]), &tie, now);
        a.observe(from("b", vec![with(0, 51)]), &tie, later);
        assert!(a.repairs(&tie, later).is_empty());
    }
}
