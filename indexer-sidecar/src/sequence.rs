//! Per-publisher message counters (vLLM's ZMQ `seq`, Dynamo's `event_id`): is this the next
//! message, did some go missing, or did the publisher start over?

/// What a message's sequence number means, given the previous one of the same worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqCheck {
    /// The first message seen from this worker.
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
    /// The counter went back: the engine restarted.
    Restarted,
}

/// Check `seq` against the last one seen (`None`: nothing seen yet).
pub fn check_seq(last: Option<u64>, seq: u64) -> SeqCheck {
    match last {
        None => SeqCheck::First,
        Some(last) if seq == last.wrapping_add(1) => SeqCheck::Next,
        Some(last) if seq > last => SeqCheck::Gap {
            from: last + 1,
            to: seq,
        },
        Some(_) => SeqCheck::Restarted,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequence_checks() {
        assert_eq!(check_seq(None, 5), SeqCheck::First);
        assert_eq!(check_seq(Some(5), 6), SeqCheck::Next);
        assert_eq!(check_seq(Some(5), 9), SeqCheck::Gap { from: 6, to: 9 });
        assert_eq!(check_seq(Some(5), 0), SeqCheck::Restarted);
        assert_eq!(check_seq(Some(5), 5), SeqCheck::Restarted);
        assert_eq!(check_seq(Some(u64::MAX - 1), u64::MAX), SeqCheck::Next);
    }
}
