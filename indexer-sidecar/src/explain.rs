//! `GET /debug/explain`: the recent decisions, each joinable to its request and, once the
//! response is in, to what the engine reported. Pure; the sidecar keeps one behind its lock.
//!
//! An entry carries when it was decided (Unix ms), the request's `x-request-id` (the filter
//! sends it with the hint call; Envoy's access log shows the same id), the decision, and its
//! outcome: `pending` while the request runs, `used` once the filter reported it (the filter
//! reports only hints that reached it in time), with the response's usage beside the
//! prediction, or `not_reported` when its ticket was closed without a report (the hint reached
//! the filter too late and the request went on without it, or the report was lost). Entries are
//! kept newest first up to a byte budget (`explain_bytes`): enough for a minute of traffic at a
//! few hundred requests a second.

use std::collections::VecDeque;

use kvroute_protocol::hint::{Ticket, Usage};
use serde_json::{json, Value};

/// One decision.
#[derive(Debug)]
struct Entry {
    ticket: Option<Ticket>,
    /// The decision as JSON (kept as text: a third of a `Value`'s memory).
    decision: String,
    /// What the engine reported, once the filter reported the request.
    served: Option<Value>,
}

impl Entry {
    fn bytes(&self) -> usize {
        // The text, the served fields (small, bounded), and the entry itself.
        self.decision.len() + 160 + std::mem::size_of::<Entry>()
    }
}

/// Which entries `GET /debug/explain` lists (its query string): a tool looking for one
/// decision asks for it, not for a minute of traffic.
#[derive(Debug, Default, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExplainQuery {
    /// At most this many, newest first.
    pub limit: Option<usize>,
    /// Only decisions on prompts whose last block hash is this (16 hex digits, as shown).
    pub last_block: Option<String>,
}

/// The recent decisions within a byte budget.
#[derive(Debug)]
pub struct ExplainLog {
    entries: VecDeque<Entry>,
    bytes: usize,
    budget: usize,
}

impl ExplainLog {
    /// Keep decisions up to `budget` bytes.
    pub fn new(budget: usize) -> Self {
        ExplainLog {
            entries: VecDeque::new(),
            bytes: 0,
            budget,
        }
    }

    /// A new decision as JSON text (`ticket`: the worker's ticket, when one was named; the
    /// caller serializes, outside the lock); the oldest go when the budget is full.
    pub fn push(&mut self, ticket: Option<Ticket>, decision: String) {
        let entry = Entry {
            ticket,
            decision,
            served: None,
        };
        self.bytes += entry.bytes();
        self.entries.push_front(entry);
        while self.bytes > self.budget {
            match self.entries.pop_back() {
                Some(old) => self.bytes -= old.bytes(),
                None => break,
            }
        }
    }

    /// The request holding `ticket` finished with `usage`; its hint predicted `predicted`
    /// cached tokens. Reports arrive soon after their decision: the search starts at the newest.
    pub fn served(&mut self, ticket: Ticket, predicted: u64, usage: Usage) {
        let Some(entry) = self.entries.iter_mut().find(|e| e.ticket == Some(ticket)) else {
            return;
        };
        let mut served = json!({"usage": usage.label(), "predicted_tokens": predicted});
        match usage {
            Usage::Cached {
                prompt_tokens,
                cached_tokens,
            } => {
                served["prompt_tokens"] = prompt_tokens.into();
                served["cached_tokens"] = cached_tokens.into();
            }
            Usage::PromptOnly { prompt_tokens } => served["prompt_tokens"] = prompt_tokens.into(),
            _ => {}
        }
        entry.served = Some(served);
    }

    /// The entries `query` asks for, newest first; `open` says whether a ticket is still
    /// counted against its worker (the request runs).
    pub fn list(&self, query: &ExplainQuery, open: impl Fn(Ticket) -> bool) -> Vec<Value> {
        self.selected(query)
            .map(|e| {
                let mut v: Value = serde_json::from_str(&e.decision).unwrap_or(Value::Null);
                let outcome = match (e.ticket, &e.served) {
                    (None, _) => "no_hint",
                    (Some(_), Some(served)) => {
                        v["served"] = served.clone();
                        "used"
                    }
                    (Some(t), None) if open(t) => "pending",
                    (Some(_), None) => "not_reported",
                };
                v["outcome"] = outcome.into();
                v
            })
            .collect()
    }

    /// The tickets of the entries `query` asks for that have no report yet (to ask which are
    /// still open).
    pub fn tickets(&self, query: &ExplainQuery) -> Vec<Ticket> {
        self.selected(query)
            .filter(|e| e.served.is_none())
            .filter_map(|e| e.ticket)
            .collect()
    }

    /// The entries `query` asks for, newest first.
    fn selected<'a>(&'a self, query: &ExplainQuery) -> impl Iterator<Item = &'a Entry> + 'a {
        // Matched in the stored text: parsing every entry to compare one field would cost as
        // much as listing them all.
        let block = query
            .last_block
            .as_ref()
            .map(|b| format!("\"last_block\":\"{}\"", b.to_ascii_lowercase()));
        self.entries
            .iter()
            .filter(move |e| {
                block
                    .as_ref()
                    .is_none_or(|b| e.decision.contains(b.as_str()))
            })
            .take(query.limit.unwrap_or(usize::MAX))
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether none are held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_follow_their_request_to_the_end() {
        let mut log = ExplainLog::new(1 << 20);
        log.push(Some(Ticket(1)), json!({"request_id": "a"}).to_string());
        log.push(Some(Ticket(2)), json!({"request_id": "b"}).to_string());
        log.push(Some(Ticket(3)), json!({"request_id": "c"}).to_string());
        log.push(None, json!({"request_id": "d"}).to_string());
        let usage = Usage::Cached {
            prompt_tokens: 100,
            cached_tokens: 64,
        };
        log.served(Ticket(1), 64, usage);
        let list = log.list(&ExplainQuery::default(), |t| t == Ticket(2));
        let outcomes: Vec<&str> = list
            .iter()
            .map(|v| v["outcome"].as_str().unwrap())
            .collect();
        assert_eq!(outcomes, ["no_hint", "not_reported", "pending", "used"]);
        assert_eq!(list[3]["request_id"], "a");
        assert_eq!(list[3]["served"]["cached_tokens"], 64);
        assert_eq!(list[3]["served"]["predicted_tokens"], 64);
        log.served(Ticket(99), 0, Usage::Missing);
    }

    #[test]
    fn the_oldest_go_when_the_budget_is_full() {
        let decision = json!({"candidates": "x".repeat(1000)});
        let mut log = ExplainLog::new(10_000);
        for t in 0..100 {
            log.push(Some(Ticket(t)), decision.to_string());
            assert!(log.bytes() <= 10_000);
        }
        assert!(log.len() >= 7 && log.len() < 10, "{}", log.len());
        let newest = log.list(&ExplainQuery::default(), |_| true);
        assert_eq!(newest.len(), log.len());
        log.served(Ticket(0), 0, Usage::Missing);
        assert!(log
            .list(&ExplainQuery::default(), |_| true)
            .iter()
            .all(|v| v["outcome"] == "pending"));
    }

    /// A tool asks for the decision on one prompt, or the newest few.
    #[test]
    fn the_query_picks_entries() {
        let mut log = ExplainLog::new(1 << 20);
        for (t, block) in [
            (1, "00000000000000aa"),
            (2, "00000000000000bb"),
            (3, "00000000000000aa"),
        ] {
            let entry = json!({"last_block": block, "request_id": t.to_string()});
            log.push(Some(Ticket(t)), entry.to_string());
        }
        let ids = |q: ExplainQuery| -> Vec<String> {
            log.list(&q, |_| true)
                .iter()
                .map(|v| v["request_id"].as_str().unwrap().to_owned())
                .collect()
        };
        let block = |b: &str| Some(b.to_owned());
        assert_eq!(
            ids(ExplainQuery {
                limit: None,
                last_block: block("00000000000000AA")
            }),
            ["3", "1"]
        );
        assert_eq!(
            ids(ExplainQuery {
                limit: Some(1),
                last_block: block("00000000000000aa")
            }),
            ["3"]
        );
        assert_eq!(
            ids(ExplainQuery {
                limit: Some(2),
                last_block: None
            }),
            ["3", "2"]
        );
        assert!(ids(ExplainQuery {
            limit: None,
            last_block: block("ff")
        })
        .is_empty());
    }
}
