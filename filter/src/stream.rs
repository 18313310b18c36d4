//! The hint stream as one VM sees it: whether its gRPC stream to the sidecar is up, the asks
//! waiting for their answers and when each times out, when to (re)open it. Pure: the glue opens,
//! sends and resumes.
//!
//! Invariant: an ask waits here from the moment it is sent until exactly one of its answer, its
//! deadline, the stream's close or its request's end takes it out; whichever comes first resumes
//! the request (or finds it gone), and the others find nothing.
//!
//! While the stream is not up, hints go as HTTP calls (`flow::Call::hint`): a sidecar without
//! the stream (an older one) costs speed, never a hint.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, SystemTime};

/// How soon a stream that failed to open, or closed, is opened again. A stream the sidecar
/// never answers stays opening (hints go as calls meanwhile): the connection's keepalive closes
/// it if the sidecar is gone, and a sidecar stopped answers it when it runs again. Cancelling it
/// instead would leave its token in the SDK's table for good.
pub const REOPEN_AFTER: Duration = Duration::from_secs(1);

/// Where the stream stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Link {
    /// None open; open one once `at` has passed (`None`: now).
    Down {
        /// When to try again.
        at: Option<SystemTime>,
    },
    /// Opened; the sidecar has not answered its headers yet.
    Opening {
        /// The host's token for it.
        token: u32,
    },
    /// The sidecar answered: asks go on it.
    Up {
        /// The host's token for it.
        token: u32,
    },
}

/// The stream and its waiting asks; `W` is what the glue needs to resume a request.
#[derive(Debug)]
pub struct HintStream<W> {
    link: Link,
    next_id: u64,
    waiting: HashMap<u64, W>,
    /// Asks by deadline, which is their order (one timeout for all); an id no longer waiting
    /// is skipped when its deadline comes.
    deadlines: VecDeque<(SystemTime, u64)>,
}

impl<W> Default for HintStream<W> {
    fn default() -> Self {
        HintStream {
            link: Link::Down { at: None },
            next_id: 1,
            waiting: HashMap::new(),
            deadlines: VecDeque::new(),
        }
    }
}

impl<W> HintStream<W> {
    /// The token to ask on, while the stream is up.
    pub fn up(&self) -> Option<u32> {
        match self.link {
            Link::Up { token } => Some(token),
            _ => None,
        }
    }

    /// Whether to open a stream at `now`.
    pub fn due(&self, now: SystemTime) -> bool {
        matches!(self.link, Link::Down { at } if at.is_none_or(|at| now >= at))
    }

    /// A stream was opened as `token`.
    pub fn opened(&mut self, token: u32) {
        self.link = Link::Opening { token };
    }

    /// Opening one failed: try again later.
    pub fn open_failed(&mut self, now: SystemTime) {
        self.link = Link::Down {
            at: Some(now + REOPEN_AFTER),
        };
    }

    /// The sidecar answered stream `token`'s headers; whether that brought it up.
    pub fn answered_headers(&mut self, token: u32) -> bool {
        match self.link {
            Link::Opening { token: t } if t == token => {
                self.link = Link::Up { token };
                true
            }
            _ => false,
        }
    }

    /// Stream `token` closed: the asks it carried, whose requests go on unhinted. `None` when
    /// `token` is not the stream in use.
    pub fn closed(&mut self, token: u32, now: SystemTime) -> Option<Vec<W>> {
        match self.link {
            Link::Opening { token: t } | Link::Up { token: t } if t == token => {
                self.link = Link::Down {
                    at: Some(now + REOPEN_AFTER),
                };
                self.deadlines.clear();
                Some(self.waiting.drain().map(|(_, w)| w).collect())
            }
            _ => None,
        }
    }

    /// An ask is about to be sent, to be answered by `deadline`: its id.
    pub fn ask(&mut self, waiter: W, deadline: SystemTime) -> u64 {
        let id = self.next_id;
        // Ids start at 1: 0 is a finished report's.
        self.next_id = self.next_id.checked_add(1).unwrap_or(1);
        self.waiting.insert(id, waiter);
        self.deadlines.push_back((deadline, id));
        id
    }

    /// The answer to ask `id` arrived, or its request ended: its waiter, if it still waits.
    pub fn take(&mut self, id: u64) -> Option<W> {
        self.waiting.remove(&id)
    }

    /// The asks whose deadline passed by `now`, unanswered.
    pub fn expired(&mut self, now: SystemTime) -> Vec<W> {
        let mut out = Vec::new();
        while let Some(&(deadline, id)) = self.deadlines.front() {
            if deadline > now {
                break;
            }
            self.deadlines.pop_front();
            out.extend(self.waiting.remove(&id));
        }
        out
    }

    /// Asks waiting.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_millis(ms)
    }

    #[test]
    fn a_stream_opens_comes_up_and_reopens_after_closing() {
        let mut s = HintStream::<u32>::default();
        assert!(s.due(at(0)));
        s.opened(5);
        assert_eq!(s.up(), None, "not up before the sidecar answers");
        assert!(
            !s.due(at(10_000)),
            "opening until the sidecar answers or it closes"
        );
        assert!(!s.answered_headers(6), "another stream's headers");
        assert!(s.answered_headers(5));
        assert_eq!(s.up(), Some(5));
        assert_eq!(s.closed(4, at(20)), None, "not the stream in use");
        assert_eq!(s.closed(5, at(20)), Some(vec![]));
        assert_eq!(s.up(), None);
        assert!(!s.due(at(500)));
        assert!(s.due(at(20) + REOPEN_AFTER));
        s.open_failed(at(1100));
        assert!(!s.due(at(1100)));
        assert!(s.due(at(1100) + REOPEN_AFTER));
    }

    #[test]
    fn each_ask_leaves_once_by_answer_deadline_or_close() {
        let mut s = HintStream::default();
        s.opened(1);
        s.answered_headers(1);
        let a = s.ask('a', at(50));
        let b = s.ask('b', at(60));
        s.ask('c', at(70));
        assert_ne!(a, 0, "0 is a report's id");
        assert_eq!(s.take(b), Some('b'), "answered");
        assert_eq!(s.take(b), None, "answered once");
        assert_eq!(s.expired(at(49)), vec![]);
        assert_eq!(s.expired(at(65)), vec!['a'], "b was answered");
        assert_eq!(s.take(a), None, "a late answer finds nothing");
        assert_eq!(s.waiting(), 1);
        assert_eq!(s.closed(1, at(66)), Some(vec!['c']));
        assert_eq!(s.expired(at(100)), vec![], "the close took it");
        assert_eq!(s.waiting(), 0);
    }
}
