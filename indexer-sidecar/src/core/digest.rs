//! What replicas compare and repair with: for each cache (worker × data-parallel rank), its
//! block count and an order-independent digest of its blocks
//! ([`crate::core::index::entry_digest`]) after each message applied, the last few kept as
//! checkpoints; the last messages' events themselves, to re-apply on top of a peer's snapshot;
//! and whether the cache is *clean* — every event of its stream applied since a known state.
//! Two replicas compare *at the same cursor*, so events still in flight to one of them never
//! read as a divergence.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use crate::core::event::{EngineHash, KvEvent};
use kvroute_protocol::PrefixHash;

/// Messages whose events are kept per cache: a snapshot up to this many messages older than the
/// cache is brought up to date with them.
pub const RECENT: usize = 256;

/// Checkpoints kept per cache: at a few hundred messages per second a peer's digest, published
/// every couple of seconds, is far older than this many messages only when it is stale anyway.
pub const CHECKPOINTS: usize = 64;

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
    recent: VecDeque<(u64, Vec<KvEvent>)>,
    /// Every event of its stream applied since a known state: the stream's first message, an
    /// engine restart (an empty cache), a filled gap, a clean peer's snapshot.
    pub clean: bool,
}

impl CacheLog {
    /// Record message `seq`, its events and the state after it.
    pub fn push(&mut self, seq: u64, events: Vec<KvEvent>, blocks: usize, digest: u64) {
        if self.checkpoints.len() == CHECKPOINTS {
            self.checkpoints.pop_front();
        }
        self.checkpoints.push_back(Checkpoint {
            seq,
            blocks: blocks as u64,
            digest,
        });
        if self.recent.len() == RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back((seq, events));
    }

    /// The checkpoints, oldest first.
    pub fn checkpoints(&self) -> Vec<Checkpoint> {
        self.checkpoints.iter().copied().collect()
    }

    /// The events of the messages after `seq`, in order, and whether those messages follow
    /// each other from `seq + 1` without a gap; `None` when the log does not reach back to
    /// `seq` (some were applied but are no longer kept).
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
            contiguous &= *s == expected;
            expected = s.wrapping_add(1);
            events.extend(batch.iter().cloned());
        }
        Some((events, contiguous))
    }

    /// Start over from a snapshot at `seq` (the events after it are re-applied by the caller).
    pub fn restart_at(&mut self, seq: u64, blocks: usize, digest: u64) {
        self.checkpoints.clear();
        self.recent.clear();
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
}
