//! What replicas compare and repair with: for each cache (worker × data-parallel rank), its
//! block count and an order-independent digest of its blocks
//! ([`crate::core::index::entry_digest`]) after each message applied, the last few kept as
//! checkpoints; the last messages' events themselves, to re-apply on top of a peer's snapshot
//! and to hand a peer that lost them; the messages this replica lost, until a peer hands them
//! over; and whether the cache is *clean* — every event of its stream applied since a known
//! state. Two replicas compare *at the same cursor*, so events still in flight to one of them
//! never read as a divergence.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

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
    /// Its recent checkpoints, oldest first.
    pub checkpoints: Vec<Checkpoint>,
}

/// A cache as a peer sends it: its entries in store order at message `seq`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// The last message applied to it.
    pub seq: u64,
    /// (engine hash, node) entries, oldest first.
    pub entries: Vec<(EngineHash, PrefixHash)>,
}

/// One cache's recent past.
#[derive(Debug, Clone, Default)]
pub struct CacheLog {
    checkpoints: VecDeque<Checkpoint>,
    /// Messages applied, by sequence number (a message a peer filled in goes in its place).
    recent: VecDeque<(u64, Vec<KvEvent>)>,
    /// Messages lost on the way here that a peer may still hand over, and since when.
    missing: BTreeMap<u64, Instant>,
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
                    let before = self.missing.len();
                    self.missing.retain(|&s, _| s > gone);
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

    /// Messages `from..to` did not arrive: peers are asked for them. More than the log could
    /// re-apply are lost for good.
    pub fn lost(&mut self, from: u64, to: u64, now: Instant) {
        let n = usize::try_from(to.saturating_sub(from)).unwrap_or(usize::MAX);
        if n.saturating_add(self.missing.len()) > RECENT {
            self.missing.clear();
            self.clean = false;
            return;
        }
        for seq in from..to {
            self.missing.entry(seq).or_insert(now);
        }
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

    /// Give up on messages missing for `timeout`: the cache is unclean until a snapshot.
    /// How many.
    pub fn give_up(&mut self, now: Instant, timeout: Duration) -> usize {
        let before = self.missing.len();
        self.missing
            .retain(|_, since| now.saturating_duration_since(*since) < timeout);
        let gone = before - self.missing.len();
        if gone > 0 {
            self.clean = false;
        }
        gone
    }

    /// The events of message `seq`, when it was applied here.
    pub fn message(&self, seq: u64) -> Option<&[KvEvent]> {
        let i = self.recent.binary_search_by_key(&seq, |(s, _)| *s).ok()?;
        Some(&self.recent[i].1)
    }

    /// A peer handed over lost messages: those still missing take their place in the log.
    /// The earliest taken, from which the caller re-applies ([`CacheLog::events_from`]), and
    /// how many were taken (another peer may have handed some over first).
    pub fn fill(&mut self, messages: &[(u64, Vec<KvEvent>)]) -> Option<(u64, usize)> {
        let mut earliest = None;
        let mut taken = 0;
        for (seq, events) in messages {
            if self.missing.remove(seq).is_none() {
                continue;
            }
            if let Err(i) = self.recent.binary_search_by_key(seq, |(s, _)| *s) {
                self.recent.insert(i, (*seq, events.clone()));
            }
            taken += 1;
            earliest = Some(earliest.map_or(*seq, |e: u64| e.min(*seq)));
        }
        Some((earliest?, taken))
    }

    /// The events of the messages from `seq` on, in order. Applying them again on top of the
    /// cache gives the state of having applied them in order: each event sets a block's
    /// presence (or clears all), so the last one touching a block decides it either way.
    pub fn events_from(&self, seq: u64) -> Vec<KvEvent> {
        self.recent
            .iter()
            .filter(|(s, _)| *s >= seq)
            .flat_map(|(_, events)| events.iter().cloned())
            .collect()
    }

    /// The cache changed under its checkpoints (lost messages filled in): they start over at
    /// its last message.
    pub fn recheckpoint(&mut self, blocks: usize, digest: u64) {
        let Some(seq) = self.recent.back().map(|(s, _)| *s) else {
            return;
        };
        self.checkpoints.clear();
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

    /// The events of the messages after `seq`, in order, and whether those messages follow
    /// each other from `seq + 1` without a gap other than messages still asked of peers;
    /// `None` when the log does not reach back to `seq` (some were applied but are no longer
    /// kept).
    pub fn after(&self, seq: u64) -> Option<(Vec<KvEvent>, bool)> {
        let last = self.recent.back().map_or(seq, |(s, _)| *s);
        if last <= seq {
            return Some((Vec::new(), true));
        }
        let first = self.recent.front().map(|(s, _)| *s)?;
        if first > seq.wrapping_add(1) {
            return None;
        }
        let mut expected = seq.wrapping_add(1);
        let mut contiguous = true;
        let mut events = Vec::new();
        for (s, batch) in self.recent.iter().filter(|(s, _)| *s > seq) {
            contiguous &= (expected..*s).all(|m| self.missing.contains_key(&m));
            expected = s.wrapping_add(1);
            events.extend(batch.iter().cloned());
        }
        Some((events, contiguous))
    }

    /// Start over from a snapshot at `seq` (the events after it are re-applied by the caller):
    /// messages lost up to it are in it. The messages kept stay, to hand to peers.
    pub fn restart_at(&mut self, seq: u64, blocks: usize, digest: u64) {
        self.checkpoints.clear();
        self.missing.retain(|&s, _| s > seq);
        self.checkpoints.push_back(Checkpoint {
            seq,
            blocks: blocks as u64,
            digest,
        });
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
        assert_eq!(log.after(RECENT as u64 + 10), Some((vec![], true)));
        assert!(
            log.after(3).is_none(),
            "messages 4 and on are no longer all kept"
        );
        assert_eq!(log.after(4).map(|(_, c)| c), Some(true));
        let mut gappy = CacheLog::default();
        for seq in [1, 2, 4] {
            gappy.push(seq, vec![], 1, seq);
        }
        assert_eq!(gappy.after(1).map(|(_, c)| c), Some(false), "3 is missing");
        assert_eq!(gappy.after(3).map(|(_, c)| c), Some(true));
    }

    #[test]
    fn lost_messages_wait_for_peers_within_bounds() {
        let t0 = Instant::now();
        let later = t0 + Duration::from_secs(1);
        let mut log = CacheLog {
            clean: true,
            ..CacheLog::default()
        };
        log.push(0, vec![], 0, 0);
        log.lost(1, 3, t0);
        log.push(3, vec![], 0, 0);
        assert!(!log.is_clean() && log.clean);
        assert_eq!(
            log.wanted(t0, Duration::from_millis(100)),
            Vec::<u64>::new()
        );
        assert_eq!(log.wanted(later, Duration::from_millis(100)), vec![1, 2]);
        assert_eq!(log.after(0).map(|(_, c)| c), Some(true), "asked of peers");
        assert_eq!(
            log.fill(&[(2, vec![]), (7, vec![])]),
            Some((2, 1)),
            "7 was not lost"
        );
        assert_eq!(log.fill(&[(2, vec![])]), None, "2 is filled already");
        assert_eq!(log.message(2), Some(&[][..]));
        assert_eq!(log.give_up(later, Duration::from_secs(1)), 1);
        assert!(!log.clean, "message 1 is lost for good");
        // More than the log could re-apply is lost at once.
        let mut big = CacheLog {
            clean: true,
            ..CacheLog::default()
        };
        big.lost(1, 2 + RECENT as u64, t0);
        assert!(big.wanted(later, Duration::ZERO).is_empty() && !big.clean);
        // A lost message is given up once a message after it is no longer kept.
        let mut old = CacheLog {
            clean: true,
            ..CacheLog::default()
        };
        old.lost(0, 1, t0);
        let given_up: usize = (1..=RECENT as u64 + 1)
            .map(|seq| old.push(seq, vec![], 0, 0))
            .sum();
        assert_eq!(given_up, 1);
        assert!(!old.clean);
    }
}
