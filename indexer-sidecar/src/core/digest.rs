//! What replicas compare and repair with: for each cache (worker × data-parallel rank), its
//! block count and an order-independent digest of its blocks
//! ([`crate::core::index::entry_digest`]) after each message applied, the last few kept as
//! checkpoints; the last messages' events themselves, to re-apply on top of a peer's snapshot
//! and to hand a peer that lost them; the messages this replica lost, until a peer hands them
//! over, with the cache as it was just before the first of them (its *base*: a fill rebuilds
//! the cache from it, so the result is exactly what in-order application would have held,
//! capacity bound included); and whether the cache is *clean* — every event of its stream
//! applied since a known state. Two replicas compare *at the same cursor*, so events still in
//! flight to one of them never read as a divergence; at the same cursor with different digests
//! they disagree whatever each believes, and the copy that lost messages most lately gives way.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::core::block_map::{Entry, Tag};
use crate::core::event::{EngineHash, KvEvent};
use kvroute_protocol::PrefixHash;

/// Messages whose events are kept per cache: a snapshot up to this many messages older than the
/// cache is brought up to date with them.
pub const RECENT: usize = 256;

/// Checkpoints kept per cache: at a few hundred messages per second a peer's digest, published
/// every couple of seconds, is far older than this many messages only when it is stale anyway.
pub const CHECKPOINTS: usize = 64;

/// A cache, as replicas name it: the worker's address and the rank.
pub type CacheKey = (String, u32);

/// A cache's state just after the message numbered `seq` was applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    /// The message's sequence number on the cache's stream.
    pub seq: u64,
    /// Blocks held.
    pub blocks: u64,
    /// Digest of the blocks held.
    pub digest: u64,
}

/// One cache as a replica reports it to its peers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheReport {
    /// The worker's address (ids are per process; addresses are what every replica shares).
    pub worker: String,
    /// The data-parallel rank.
    pub rank: u32,
    /// Whether every event since a known state was applied (a peer repairs from clean ones).
    #[serde(default)]
    pub clean: bool,
    /// Whether lost messages are being asked of peers: not clean, but not lost for good yet.
    #[serde(default)]
    pub filling: bool,
    /// The latest message before which this copy lost some (filled or not; 0: none since it
    /// started): of two copies that disagree, the one that lost longest ago is kept.
    #[serde(default)]
    pub lost_at: u64,
    /// How long before the report this replica last applied a message from the engine's
    /// stream (not a peer's copy), in ms (`None`: none since the cache started here, or an
    /// older sidecar's report). Of two copies, a higher message number is *ahead* only on the
    /// same stream: a peer's copy whose last message came long before ours has not seen the
    /// engine restart ours saw.
    #[serde(default)]
    pub quiet_ms: Option<u64>,
    /// Its recent checkpoints, oldest first.
    pub checkpoints: Vec<Checkpoint>,
}

/// A cache as a peer sends it: its entries, least recently used first, at message `seq`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// The last message applied to it.
    pub seq: u64,
    /// Entries, least recently used first.
    pub entries: Vec<Entry>,
}

/// Entries as snapshots travel to peers and to disk: (engine hash, node) pairs, and beside
/// them each one's parent [`Tag`], a root block's being its own (a snapshot without parents,
/// from an older sidecar, holds roots only: it matches the same, and ranks blocks for eviction
/// by their own last use alone).
pub fn to_wire(entries: &[Entry]) -> (Vec<(u64, u64)>, Vec<u64>) {
    entries
        .iter()
        .map(|e| {
            let parent = e.parent.unwrap_or(Tag::of(e.engine));
            ((e.engine.0, e.node.0), u64::from(parent.0))
        })
        .unzip()
}

/// The entries [`to_wire`] wrote.
pub fn from_wire(pairs: &[(u64, u64)], parents: &[u64]) -> Vec<Entry> {
    pairs
        .iter()
        .enumerate()
        .map(|(i, &(engine, node))| {
            let engine = EngineHash(engine);
            let parent = parents
                .get(i)
                .map(|&p| Tag(p as u32))
                .filter(|&p| p != Tag::of(engine));
            Entry {
                engine,
                node: PrefixHash(node),
                parent,
            }
        })
        .collect()
}

/// A cache exactly as it was before message `from`, the first still missing: a fill
/// re-applies every message from there on top of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Base {
    /// The first message to re-apply.
    pub from: u64,
    /// The cache's entries before it.
    pub entries: Vec<Entry>,
}

/// One cache's recent past.
#[derive(Debug, Clone, Default)]
pub struct CacheLog {
    checkpoints: VecDeque<Checkpoint>,
    /// Messages applied, by sequence number (a message a peer filled in goes in its place).
    recent: VecDeque<(u64, Vec<KvEvent>)>,
    /// Messages lost on the way here that a peer may still hand over, and since when.
    missing: BTreeMap<u64, Instant>,
    /// While messages are missing: the cache just before the first of them.
    base: Option<Base>,
    /// See [`CacheReport::lost_at`].
    pub lost_at: u64,
    /// When the last message from the engine's stream was applied ([`CacheReport::quiet_ms`]).
    pub last_live: Option<Instant>,
    /// No event lost for good since a known state: the stream's first message, an engine
    /// restart (an empty cache), a clean peer's snapshot. Clean once `missing` is filled too.
    pub clean: bool,
}

impl CacheLog {
    /// Record message `seq`, its events and the state after it. How many lost messages can
    /// no longer be filled in (the oldest message after them is no longer kept).
    pub fn push(&mut self, seq: u64, events: Vec<KvEvent>, blocks: usize, digest: u64) -> usize {
        if self.checkpoints.len() == CHECKPOINTS {
            self.checkpoints.pop_front();
        }
        self.checkpoints.push_back(Checkpoint {
            seq,
            blocks: blocks as u64,
            digest,
        });
        let mut given_up = 0;
        if self.recent.len() == RECENT {
            // A lost message is filled in by re-applying every message after it: once one of
            // those is no longer kept, it cannot be.
            if let Some((gone, _)) = self.recent.pop_front() {
                if self.missing.keys().next().is_some_and(|&s| s < gone) {
                    // Those before it are lost for good, and the cache can no longer be
                    // rebuilt exactly from before them; later ones are still filled in.
                    let before = self.missing.len();
                    self.missing.retain(|&s, _| s > gone);
                    self.base = None;
                    self.clean = false;
                    given_up = before - self.missing.len();
                }
            }
        }
        self.recent.push_back((seq, events));
        given_up
    }

    /// Whether every event of the stream since a known state is applied.
    pub fn is_clean(&self) -> bool {
        self.clean && self.missing.is_empty()
    }

    /// Messages `from..to` did not arrive: peers are asked for them, and the cache as it is
    /// now (`current`, taken only if needed) is the base a fill rebuilds from. More than the
    /// log could re-apply are lost for good.
    pub fn lost(&mut self, from: u64, to: u64, now: Instant, current: impl FnOnce() -> Vec<Entry>) {
        self.lost_at = self.lost_at.max(to);
        let n = usize::try_from(to.saturating_sub(from)).unwrap_or(usize::MAX);
        if n.saturating_add(self.missing.len()) > RECENT {
            self.lose_for_good();
            return;
        }
        if self.base.is_none() {
            self.base = Some(Base {
                from,
                entries: current(),
            });
        }
        for seq in from..to {
            self.missing.entry(seq).or_insert(now);
        }
    }

    /// Every missing message is lost for good (one is, and the rest cannot be re-applied
    /// exactly without it): unclean until a peer's snapshot. How many were still missing.
    fn lose_for_good(&mut self) -> usize {
        let n = self.missing.len();
        self.missing.clear();
        self.base = None;
        self.clean = false;
        n
    }

    /// Lost messages to ask peers for: those missing for at least `age` (a peer a little
    /// behind has not received them yet).
    pub fn wanted(&self, now: Instant, age: Duration) -> Vec<u64> {
        self.missing
            .iter()
            .filter(|(_, since)| now.saturating_duration_since(**since) >= age)
            .map(|(seq, _)| *seq)
            .collect()
    }

    /// Give up on messages missing for `timeout`: the cache is unclean until a snapshot, and
    /// can no longer be rebuilt exactly (its base is dropped); the others are still asked for,
    /// and applied on top when they come. How many.
    pub fn give_up(&mut self, now: Instant, timeout: Duration) -> usize {
        let before = self.missing.len();
        self.missing
            .retain(|_, since| now.saturating_duration_since(*since) < timeout);
        let gone = before - self.missing.len();
        if gone > 0 {
            self.clean = false;
            self.base = None;
        }
        gone
    }

    /// Whether lost messages are still asked of peers.
    pub fn filling(&self) -> bool {
        !self.missing.is_empty()
    }

    /// The events of message `seq`, when it was applied here.
    pub fn message(&self, seq: u64) -> Option<&[KvEvent]> {
        let i = self.recent.binary_search_by_key(&seq, |(s, _)| *s).ok()?;
        Some(&self.recent[i].1)
    }

    /// A peer handed over lost messages: those still missing take their place in the log.
    /// How many were taken (another peer may have handed some over first), the earliest of
    /// them, and the base to rebuild from — `None` once some were lost for good before them
    /// (the cache is unclean then, and is rebuilt from where it stands: the messages from the
    /// earliest one filled on, applied again on top).
    pub fn fill(&mut self, messages: &[(u64, Vec<KvEvent>)]) -> Option<(usize, u64, Option<Base>)> {
        let mut taken = 0;
        let mut earliest = u64::MAX;
        for (seq, events) in messages {
            if self.missing.remove(seq).is_none() {
                continue;
            }
            if let Err(i) = self.recent.binary_search_by_key(seq, |(s, _)| *s) {
                self.recent.insert(i, (*seq, events.clone()));
            }
            taken += 1;
            earliest = earliest.min(*seq);
        }
        if taken == 0 {
            return None;
        }
        // Rebuilt from where it stands, the cache re-applies from the first message still
        // missing too, so that none is dropped from the record.
        let from = self
            .missing
            .keys()
            .next()
            .map_or(earliest, |&m| m.min(earliest));
        Some((taken, from, self.base.take()))
    }

    /// The messages kept from `seq` on, in order, with the first one still missing among
    /// them (`None`: none is). A rebuild applies them on top of the cache as it was before
    /// `seq`, takes that cache as the new base just before the missing one
    /// ([`CacheLog::rebase`]), and records a checkpoint after each ([`CacheLog::checkpoint`]),
    /// from [`CacheLog::restart_before`] on.
    pub fn replay_from(&self, seq: u64) -> (Vec<(u64, Vec<KvEvent>)>, Option<u64>) {
        let messages = self
            .recent
            .iter()
            .filter(|(s, _)| *s >= seq)
            .cloned()
            .collect();
        let first_missing = self.missing.keys().next().copied().filter(|&m| m >= seq);
        (messages, first_missing)
    }

    /// During a rebuild: the cache just before message `from`, which is still missing.
    pub fn rebase(&mut self, from: u64, entries: Vec<Entry>) {
        if self.missing.contains_key(&from) {
            self.base = Some(Base { from, entries });
        }
    }

    /// The cache changed under its checkpoints (messages applied again on top of their own
    /// later effects): they start over at its last message.
    pub fn recheckpoint(&mut self, blocks: usize, digest: u64) {
        let Some(seq) = self.recent.back().map(|(s, _)| *s) else {
            return;
        };
        self.checkpoints.clear();
        self.checkpoint(seq, blocks, digest);
    }

    /// Record the state after message `seq`, in order (a rebuild's own checkpoints).
    pub fn checkpoint(&mut self, seq: u64, blocks: usize, digest: u64) {
        if self.checkpoints.len() == CHECKPOINTS {
            self.checkpoints.pop_front();
        }
        self.checkpoints.push_back(Checkpoint {
            seq,
            blocks: blocks as u64,
            digest,
        });
    }

    /// The checkpoints, oldest first.
    pub fn checkpoints(&self) -> Vec<Checkpoint> {
        self.checkpoints.iter().copied().collect()
    }

    /// Whether the messages after `seq` follow each other from `seq + 1` without a gap other
    /// than messages still asked of peers; `None` when the log does not reach back to `seq`
    /// (some were applied but are no longer kept).
    pub fn contiguous_after(&self, seq: u64) -> Option<bool> {
        let last = self.recent.back().map_or(seq, |(s, _)| *s);
        if last <= seq {
            return Some(true);
        }
        let first = self.recent.front().map(|(s, _)| *s)?;
        if first > seq.wrapping_add(1) {
            return None;
        }
        let mut expected = seq.wrapping_add(1);
        let mut contiguous = true;
        for (s, _) in self.recent.iter().filter(|(s, _)| *s > seq) {
            contiguous &= (expected..*s).all(|m| self.missing.contains_key(&m));
            expected = s.wrapping_add(1);
        }
        Some(contiguous)
    }

    /// Start over from a state just before message `from` (a snapshot, or a rebuild's base):
    /// messages lost before it are in it, and checkpoints from it on are recorded again.
    pub fn restart_before(&mut self, from: u64, blocks: usize, digest: u64) {
        self.missing.retain(|&s, _| s >= from);
        self.base = None;
        self.checkpoints.retain(|c| c.seq.wrapping_add(1) < from);
        if let Some(seq) = from.checked_sub(1) {
            self.checkpoint(seq, blocks, digest);
        }
    }
}

/// How one cache of this replica compares with a peer's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum Agreement {
    /// Same blocks after the same message.
    Agree {
        /// The latest message both applied.
        seq: u64,
    },
    /// Different blocks after the same message: one replica lost events (or applied some the
    /// other did not).
    Divergent {
        /// The message.
        seq: u64,
        /// This replica's state then.
        mine: Checkpoint,
        /// The peer's.
        theirs: Checkpoint,
    },
    /// No message both have a checkpoint for (one is far ahead, or just started).
    Unknown,
}

/// Compare at the latest message both sides have a checkpoint for.
pub fn compare(mine: &[Checkpoint], theirs: &[Checkpoint]) -> Agreement {
    let common = mine
        .iter()
        .rev()
        .find_map(|m| theirs.iter().find(|t| t.seq == m.seq).map(|t| (*m, *t)));
    match common {
        None => Agreement::Unknown,
        Some((m, t)) if m.blocks == t.blocks && m.digest == t.digest => {
            Agreement::Agree { seq: m.seq }
        }
        Some((m, t)) => Agreement::Divergent {
            seq: m.seq,
            mine: m,
            theirs: t,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cp(seq: u64, digest: u64) -> Checkpoint {
        Checkpoint {
            seq,
            blocks: 1,
            digest,
        }
    }

    fn root(n: u64) -> Entry {
        Entry::new(EngineHash(n), PrefixHash(n), None)
    }

    #[test]
    fn replicas_compare_at_the_latest_common_message() {
        // The peer is two messages behind: compared at 8, where both agree.
        let mine = [cp(7, 70), cp(8, 80), cp(9, 90), cp(10, 100)];
        assert_eq!(
            compare(&mine, &[cp(7, 70), cp(8, 80)]),
            Agreement::Agree { seq: 8 }
        );
        assert!(matches!(
            compare(&mine, &[cp(8, 80), cp(9, 91)]),
            Agreement::Divergent { seq: 9, .. }
        ));
        assert_eq!(compare(&mine, &[cp(11, 110)]), Agreement::Unknown);
        let mut log = CacheLog::default();
        for seq in 0..RECENT as u64 + 5 {
            log.push(seq, vec![], 1, seq);
        }
        assert_eq!(log.checkpoints().len(), CHECKPOINTS);
        assert_eq!(
            log.checkpoints()[0].seq,
            RECENT as u64 + 5 - CHECKPOINTS as u64
        );
        assert_eq!(log.contiguous_after(RECENT as u64 + 10), Some(true));
        assert!(
            log.contiguous_after(3).is_none(),
            "messages 4 and on are no longer all kept"
        );
        assert_eq!(log.contiguous_after(4), Some(true));
        let mut gappy = CacheLog::default();
        for seq in [1, 2, 4] {
            gappy.push(seq, vec![], 1, seq);
        }
        assert_eq!(gappy.contiguous_after(1), Some(false), "3 is missing");
        assert_eq!(gappy.contiguous_after(3), Some(true));
    }

    /// A loss keeps the cache as it was before it; a fill hands that base back with the first
    /// message to re-apply, and a rebuild that still misses one takes a new base there.
    #[test]
    fn lost_messages_wait_for_peers_with_their_base() {
        let t0 = Instant::now();
        let later = t0 + Duration::from_secs(1);
        let mut log = CacheLog {
            clean: true,
            ..CacheLog::default()
        };
        log.push(0, vec![], 0, 0);
        log.lost(1, 3, t0, || vec![root(7)]);
        log.lost(5, 6, t0, || unreachable!("the first base stays"));
        assert_eq!(log.lost_at, 6);
        log.push(3, vec![], 0, 0);
        assert!(!log.is_clean() && log.clean && log.filling());
        assert_eq!(
            log.wanted(t0, Duration::from_millis(100)),
            Vec::<u64>::new()
        );
        assert_eq!(log.wanted(later, Duration::from_millis(100)), vec![1, 2, 5]);
        assert_eq!(log.contiguous_after(0), Some(true), "asked of peers");
        let (taken, earliest, base) = log.fill(&[(2, vec![]), (7, vec![])]).unwrap();
        assert_eq!(
            (taken, earliest),
            (1, 1),
            "7 was not lost; 1 is still missing"
        );
        let base_at = |from, entries| Some(Base { from, entries });
        assert_eq!(base, base_at(1, vec![root(7)]));
        assert_eq!(log.fill(&[(2, vec![])]), None, "2 is filled already");
        assert_eq!(log.message(2), Some(&[][..]));
        // The rebuild: from before 1, still missing 1 and 5.
        let (messages, first_missing) = log.replay_from(1);
        assert_eq!(
            messages.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
            vec![2, 3]
        );
        assert_eq!(first_missing, Some(1));
        log.restart_before(1, 1, 11);
        log.rebase(1, vec![root(8)]);
        assert_eq!(log.checkpoints().last().map(|c| c.seq), Some(0));
        let (_, _, base) = log.fill(&[(1, vec![])]).unwrap();
        assert_eq!(base, base_at(1, vec![root(8)]));
        // Given up once it has waited the timeout; one lost later is still asked for, and
        // filled in on top (no exact base any more).
        log.lost(9, 10, later, Vec::new);
        assert_eq!(log.give_up(later, Duration::from_secs(1)), 1);
        assert_eq!(log.fill(&[(9, vec![])]), Some((1, 9, None)));
        log.lost(11, 12, later, Vec::new);
        assert!(
            !log.clean && log.filling(),
            "5 is lost for good, 11 still asked for"
        );
        assert_eq!(log.wanted(later, Duration::ZERO), vec![11]);
        // More than the log could re-apply is lost at once.
        let mut big = CacheLog {
            clean: true,
            ..CacheLog::default()
        };
        big.lost(1, 2 + RECENT as u64, t0, Vec::new);
        assert!(big.wanted(later, Duration::ZERO).is_empty() && !big.clean);
        // A lost message is given up once a message after it is no longer kept.
        let mut old = CacheLog {
            clean: true,
            ..CacheLog::default()
        };
        old.lost(0, 1, t0, Vec::new);
        let given_up: usize = (1..=RECENT as u64 + 1)
            .map(|seq| old.push(seq, vec![], 0, 0))
            .sum();
        assert_eq!(given_up, 1);
        assert!(!old.clean);
    }

    #[test]
    fn entries_travel_with_their_parents() {
        let entries = vec![
            root(1),
            Entry::new(EngineHash(2), PrefixHash(20), Some(EngineHash(1))),
        ];
        let (pairs, parents) = to_wire(&entries);
        assert_eq!(from_wire(&pairs, &parents), entries);
        assert_eq!(entries[1].parent, Some(Tag::of(EngineHash(1))));
        assert_eq!(
            from_wire(&pairs, &[]),
            vec![root(1), Entry::new(EngineHash(2), PrefixHash(20), None)],
            "an older peer's snapshot: roots"
        );
    }
}
