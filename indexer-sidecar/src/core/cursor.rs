//! Event-stream cursors: per publisher, the last message applied (vLLM's ZMQ `seq`, Dynamo's
//! `event_id`), and what a new message's number says — the next one, missing ones, a copy of
//! one already applied, or a publisher that started over.

/// What a message's sequence number means, given the stream's cursor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The first message seen on this stream.
    First,
    /// The next message.
    Next,
    /// Messages `from..to` are missing (`to` is this message).
    Gap {
        /// First missing sequence number.
        from: u64,
        /// This message's.
        to: u64,
    },
    /// A message already applied: the last one again (a redelivery, or two subscriptions
    /// matching one subject), or a live copy of one a warm start applied.
    Duplicate,
    /// The counter went back: the publisher restarted, with an empty cache.
    Restarted,
}

impl Verdict {
    /// Whether the message is applied as it is.
    pub fn in_order(self) -> bool {
        matches!(self, Verdict::First | Verdict::Next)
    }
}

/// One stream's position.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Cursor {
    /// The last sequence number applied.
    pub last: Option<u64>,
    /// How far the last warm start replayed: live copies up to here are duplicates.
    pub warm_through: Option<u64>,
}

impl Cursor {
    /// What `seq` means for a live message.
    pub fn check(&self, seq: u64) -> Verdict {
        if self.warm_through.is_some_and(|through| seq <= through) {
            return Verdict::Duplicate;
        }
        match self.last {
            None => Verdict::First,
            Some(last) if seq == last.wrapping_add(1) => Verdict::Next,
            Some(last) if seq == last => Verdict::Duplicate,
            Some(last) if seq > last => Verdict::Gap {
                from: last + 1,
                to: seq,
            },
            Some(_) => Verdict::Restarted,
        }
    }

    /// `seq` was applied live.
    pub fn applied(&mut self, seq: u64) {
        self.last = Some(seq);
        if self.warm_through.is_some_and(|through| seq > through) {
            self.warm_through = None;
        }
    }

    /// `seq` was applied from a warm start's replay.
    pub fn warm_applied(&mut self, seq: u64) {
        self.last = Some(seq);
        self.warm_through = Some(seq);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(last: u64) -> Cursor {
        Cursor {
            last: Some(last),
            warm_through: None,
        }
    }

    #[test]
    fn sequence_checks() {
        assert_eq!(Cursor::default().check(5), Verdict::First);
        assert_eq!(at(5).check(6), Verdict::Next);
        assert_eq!(at(5).check(9), Verdict::Gap { from: 6, to: 9 });
        assert_eq!(at(5).check(0), Verdict::Restarted);
        assert_eq!(
            at(5).check(5),
            Verdict::Duplicate,
            "a repeat is not a restart"
        );
        assert_eq!(at(5).check(4), Verdict::Restarted);
        assert_eq!(at(u64::MAX - 1).check(u64::MAX), Verdict::Next);
    }

    #[test]
    fn live_copies_of_a_warm_start_are_duplicates_not_a_restart() {
        let mut c = Cursor::default();
        for seq in 0..=5 {
            c.warm_applied(seq);
        }
        // Queued live while the replay ran: already applied.
        assert_eq!(c.check(4), Verdict::Duplicate);
        assert_eq!(c.check(5), Verdict::Duplicate);
        assert_eq!(c.check(6), Verdict::Next);
        c.applied(6);
        // Past the warm start, going back is a restart again.
        assert_eq!(c.check(0), Verdict::Restarted);
    }
}
