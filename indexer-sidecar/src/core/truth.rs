//! What the engines said they had cached, beside what the index predicted.
//!
//! A hint predicts that its worker holds the prompt's first `matched_blocks` blocks. When the
//! request finishes, the filter reports the response's `usage` (`prompt_tokens`,
//! `prompt_tokens_details.cached_tokens`); [`Truth`] sums both per worker. An index that is
//! right shows actual ≈ predicted; a stale one (lost events, a wrong subject, a diverged
//! replica) shows actual well below predicted long before anyone reads a bill.
//!
//! In a disaggregated fleet the hint names the prefill worker, but the response's usage is the
//! decode worker's (it receives the prefilled blocks, and reports its own cache): those
//! requests are counted, not compared.
//!
//! A prediction is *exact* when it is within one block of the engine's count: an engine that
//! finds a whole prompt cached still computes its last token (vLLM), and so reports a block
//! less for a prompt of whole blocks.

use kvroute_protocol::hint::Usage;
use serde::{Deserialize, Serialize};

/// How a prediction compared with the engine's count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prediction {
    /// Within one block.
    Exact,
    /// The engine had more than one block less: the index was stale, or blocks were evicted
    /// between the hint and the prefill.
    Over,
    /// The engine had more than one block more (events not yet seen, another router's traffic).
    Under,
}

impl Prediction {
    /// The label value.
    pub fn label(self) -> &'static str {
        match self {
            Prediction::Exact => "exact",
            Prediction::Over => "over",
            Prediction::Under => "under",
        }
    }
}

/// Totals over finished hinted requests (of one worker, or of all a replica routed).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Truth {
    /// Requests by usage kind, in [`Usage::KINDS`] order, all but [`Usage::Unread`].
    pub requests: [u64; 5],
    /// Requests whose response the filter did not read (apart, and defaulted, so that totals
    /// of replicas that do not count them still read).
    #[serde(default)]
    pub unread: u64,
    /// Over the requests whose usage said cached tokens: what the hint predicted (at most the
    /// prompt), what the engine had, and the prompt.
    pub predicted_tokens: u64,
    /// The engines' `cached_tokens`.
    pub cached_tokens: u64,
    /// The engines' `prompt_tokens`.
    pub prompt_tokens: u64,
    /// Predictions within one block of the engine's count.
    pub exact: u64,
    /// Predictions more than a block above it.
    pub over: u64,
    /// Predictions more than a block below it.
    pub under: u64,
}

impl Truth {
    /// Add a request hinted with `predicted` tokens (its matched blocks × `block_size`) whose
    /// response said `usage`; how the prediction compared, when the usage says.
    pub fn add(&mut self, predicted: u64, usage: Usage, block_size: u32) -> Option<Prediction> {
        self.count(usage);
        let Usage::Cached {
            prompt_tokens,
            cached_tokens,
        } = usage
        else {
            return None;
        };
        let (prompt, cached) = (u64::from(prompt_tokens), u64::from(cached_tokens));
        let predicted = predicted.min(prompt);
        self.predicted_tokens += predicted;
        self.cached_tokens += cached;
        self.prompt_tokens += prompt;
        let block = u64::from(block_size.max(1));
        let verdict = if predicted > cached + block {
            self.over += 1;
            Prediction::Over
        } else if cached > predicted + block {
            self.under += 1;
            Prediction::Under
        } else {
            self.exact += 1;
            Prediction::Exact
        };
        Some(verdict)
    }

    /// Count a request by what its response said, without comparing it to the prediction
    /// ([`Truth::add`] does both): alone, for a request whose usage does not describe the
    /// hinted worker's cache — a prefill worker's, whose response reports the decode worker's.
    pub fn count(&mut self, usage: Usage) {
        match usage {
            Usage::Unread => self.unread += 1,
            read => self.requests[usize::from(read.kind())] += 1,
        }
    }

    /// Requests counted, read or not.
    pub fn total(&self) -> u64 {
        self.requests.iter().sum::<u64>() + self.unread
    }

    /// Requests whose usage said cached tokens.
    pub fn compared(&self) -> u64 {
        self.exact + self.over + self.under
    }

    /// The engines' hit rate: cached / prompt tokens (`None`: no prompt tokens).
    pub fn actual_rate(&self) -> Option<f64> {
        (self.prompt_tokens > 0).then(|| self.cached_tokens as f64 / self.prompt_tokens as f64)
    }

    /// The predicted hit rate.
    pub fn predicted_rate(&self) -> Option<f64> {
        (self.prompt_tokens > 0).then(|| self.predicted_tokens as f64 / self.prompt_tokens as f64)
    }

    /// What was added since `earlier` (a copy of these totals taken before).
    pub fn since(&self, earlier: &Truth) -> Truth {
        let mut requests = [0; 5];
        for (i, r) in requests.iter_mut().enumerate() {
            *r = self.requests[i].saturating_sub(earlier.requests[i]);
        }
        Truth {
            requests,
            unread: self.unread.saturating_sub(earlier.unread),
            predicted_tokens: self
                .predicted_tokens
                .saturating_sub(earlier.predicted_tokens),
            cached_tokens: self.cached_tokens.saturating_sub(earlier.cached_tokens),
            prompt_tokens: self.prompt_tokens.saturating_sub(earlier.prompt_tokens),
            exact: self.exact.saturating_sub(earlier.exact),
            over: self.over.saturating_sub(earlier.over),
            under: self.under.saturating_sub(earlier.under),
        }
    }

    /// Add `other`'s totals to these.
    pub fn merge(&mut self, other: &Truth) {
        for (i, r) in self.requests.iter_mut().enumerate() {
            *r += other.requests[i];
        }
        self.unread += other.unread;
        self.predicted_tokens += other.predicted_tokens;
        self.cached_tokens += other.cached_tokens;
        self.prompt_tokens += other.prompt_tokens;
        self.exact += other.exact;
        self.over += other.over;
        self.under += other.under;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cached(prompt_tokens: u32, cached_tokens: u32) -> Usage {
        Usage::Cached {
            prompt_tokens,
            cached_tokens,
        }
    }

    #[test]
    fn predictions_within_a_block_are_exact() {
        let mut t = Truth::default();
        assert_eq!(t.add(64, cached(70, 64), 16), Some(Prediction::Exact));
        // A prompt of whole blocks, all cached: the engine computes the last token again.
        assert_eq!(t.add(64, cached(64, 48), 16), Some(Prediction::Exact));
        assert_eq!(t.add(64, cached(100, 16), 16), Some(Prediction::Over));
        assert_eq!(t.add(0, cached(100, 96), 16), Some(Prediction::Under));
        assert_eq!(
            t.add(1_000, Usage::PromptOnly { prompt_tokens: 100 }, 16),
            None
        );
        assert_eq!(t.add(16, Usage::Missing, 16), None);
        assert_eq!((t.exact, t.over, t.under, t.compared()), (2, 1, 1, 4));
        assert_eq!(t.requests, [0, 1, 0, 1, 4]);
        assert_eq!(t.prompt_tokens, 334);
        assert_eq!(t.cached_tokens, 224);
        assert_eq!(
            t.predicted_tokens, 192,
            "a prediction counts at most the prompt"
        );
        assert_eq!(t.actual_rate(), Some(224.0 / 334.0));
        assert_eq!(Truth::default().actual_rate(), None);
    }

    #[test]
    fn totals_subtract_and_merge() {
        let mut t = Truth::default();
        t.add(32, cached(40, 32), 16);
        let before = t;
        t.add(32, cached(40, 0), 16);
        t.add(0, Usage::Unanswered, 16);
        t.add(48, Usage::Unread, 16);
        let window = t.since(&before);
        assert_eq!(window.requests, [1, 0, 0, 0, 1]);
        assert_eq!((window.unread, window.total()), (1, 3));
        assert_eq!((window.predicted_tokens, window.cached_tokens), (32, 0));
        assert_eq!(window.over, 1);
        let mut sum = before;
        sum.merge(&window);
        assert_eq!(sum, t);
        assert_eq!(before.since(&t), Truth::default(), "never below zero");
    }

    #[test]
    fn a_peer_that_does_not_count_unread_requests_still_reads() {
        let mut t = Truth::default();
        t.add(32, cached(40, 32), 16);
        let mut json = serde_json::to_value(t).unwrap();
        json.as_object_mut().unwrap().remove("unread");
        assert_eq!(serde_json::from_value::<Truth>(json).unwrap(), t);
    }
}
