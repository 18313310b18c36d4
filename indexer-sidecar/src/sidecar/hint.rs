//! Hints: the core's answer turned into the filter's response, counted, and recorded for
//! `/debug/explain`.

use std::time::Instant;

use kvroute_protocol::hint::{HintRequest, HintResponse};

use super::{lock, Sidecar};
use crate::core::policy::{Candidate, Decision, Rule};
use crate::core::Target;
use crate::metrics::{HintLabels, HintResult, HintRule, RuleLabel};

impl Sidecar {
    /// Answer an encoded hint request as HTTP would: its status and body (the hint's JSON, or
    /// the reason it has none). Both transports, HTTP calls and the hint stream, answer here.
    pub fn answer_hint(&self, body: &[u8], request_id: Option<&str>) -> (u16, Vec<u8>) {
        let req = match HintRequest::decode(body) {
            Ok(r) => r,
            Err(e) => {
                self.bad_hint_request();
                return (400, e.to_string().into_bytes());
            }
        };
        match self.hint(&req, request_id, Instant::now()) {
            Some(resp) => match serde_json::to_vec(&resp) {
                Ok(json) => (200, json),
                Err(e) => (500, e.to_string().into_bytes()),
            },
            None => (404, format!("unknown model {}", req.model).into_bytes()),
        }
    }

    /// Answer a hint request at `now` for the request Envoy calls `request_id` (`None`:
    /// unknown model).
    pub fn hint(
        &self,
        req: &HintRequest,
        request_id: Option<&str>,
        now: Instant,
    ) -> Option<HintResponse> {
        let hint = self.core().hint(req, now);
        let Ok(hint) = hint else {
            self.metrics
                .hints
                .get_or_create(&HintLabels {
                    result: HintResult::UnknownModel,
                })
                .inc();
            return None;
        };
        for h in &hint.happened {
            self.record(None, h, now);
        }
        let mut resp = HintResponse {
            matched_blocks: hint.decision.matched_blocks,
            ticket: hint.ticket,
            ..HintResponse::default()
        };
        match &hint.target {
            Target::None => {}
            Target::Addresses(a) => resp.workers = a.iter().map(|a| a.to_string()).collect(),
            Target::Instance(i) => resp.instance_id = Some(*i),
            Target::Prefill(i) => resp.prefill_instance_id = Some(*i),
        }
        let result = match hint.decision.rule {
            _ if !resp.has_target() => HintResult::NoWorker,
            Rule::NoMatch => HintResult::NoMatch,
            Rule::LongestMatch | Rule::LeastLoaded | Rule::Spread => {
                self.metrics
                    .hint_matched_blocks
                    .inc_by(u64::from(resp.matched_blocks));
                HintResult::Hinted
            }
        };
        self.metrics
            .hints
            .get_or_create(&HintLabels { result })
            .inc();
        if resp.has_target() {
            let rule = match hint.decision.rule {
                Rule::LongestMatch => HintRule::LongestMatch,
                Rule::LeastLoaded => HintRule::LeastLoaded,
                Rule::NoMatch => HintRule::NoMatch,
                Rule::Spread => HintRule::Spread,
            };
            self.metrics
                .hint_rules
                .get_or_create(&RuleLabel { rule })
                .inc();
        }
        self.explain(req, request_id, &resp, &hint.decision);
        self.metrics
            .hint_seconds
            .observe(now.elapsed().as_secs_f64());
        Some(resp)
    }

    fn explain(
        &self,
        req: &HintRequest,
        request_id: Option<&str>,
        resp: &HintResponse,
        decision: &Decision,
    ) {
        let at_unix_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        // Written straight to text: through a `serde_json::Value` first, the candidates' maps
        // were most of a hint's time at 256 workers.
        let shown = explained_candidates(&decision.candidates);
        let entry = serde_json::to_string(&ExplainEntry {
            at_unix_ms,
            request_id,
            model: &req.model,
            prompt_blocks: req.hashes.len(),
            first_block: req.hashes.first().map(|h| format!("{:016x}", h.0)),
            last_block: req.hashes.last().map(|h| format!("{:016x}", h.0)),
            decision: ExplainDecision {
                hint: HintResponse {
                    ticket: None,
                    ..resp.clone()
                },
                rule: decision.rule,
                candidates_not_shown: decision.candidates.len() - shown.len(),
                candidates: shown,
            },
        })
        .unwrap_or_default();
        lock(&self.explained).push(resp.ticket, entry);
    }

    /// A filter opened a hint stream (`crate::hint_stream`).
    pub fn hint_stream_opened(&self) {
        self.metrics.hint_streams.inc();
        tracing::debug!("hint stream opened");
    }

    /// A hint stream ended.
    pub fn hint_stream_closed(&self) {
        self.metrics.hint_streams.dec();
        tracing::debug!("hint stream closed");
    }

    /// A hint request that did not decode: counted (the API answers 400).
    pub fn bad_hint_request(&self) {
        self.metrics
            .hints
            .get_or_create(&HintLabels {
                result: HintResult::BadRequest,
            })
            .inc();
    }

    /// The recent decisions `query` asks for, newest first, with their outcomes.
    pub fn explained(&self, query: &crate::explain::ExplainQuery) -> Vec<serde_json::Value> {
        // Only the listed entries' tickets: the core is asked under its lock, which hints take.
        let tickets = lock(&self.explained).tickets(query);
        let open = self.core().open_tickets(&tickets);
        lock(&self.explained).list(query, |t| open.contains(&t))
    }
}

/// One decision as `/debug/explain` shows it.
#[derive(serde::Serialize)]
struct ExplainEntry<'a> {
    at_unix_ms: u64,
    request_id: Option<&'a str>,
    model: &'a str,
    prompt_blocks: usize,
    first_block: Option<String>,
    /// The prefix hash of the whole hashed prompt: equal to `kvroute-sidecar tokenize`'s
    /// `last_block` exactly when the filter saw the same tokens.
    last_block: Option<String>,
    decision: ExplainDecision<'a>,
}

#[derive(serde::Serialize)]
struct ExplainDecision<'a> {
    /// Without the ticket: whoever reads this must not be able to close it.
    hint: HintResponse,
    rule: crate::core::policy::Rule,
    candidates: Vec<&'a Candidate>,
    /// Candidates left out: neither among the first nor holding any of the prompt.
    candidates_not_shown: usize,
}

/// The first candidates shown whatever they hold: the hinted workers and their runners-up.
const EXPLAINED_FIRST: usize = 8;

/// The candidates a decision's record shows, in the rule's order: the first
/// [`EXPLAINED_FIRST`] and every other that holds some of the prompt (so a worker not shown
/// matched nothing). At 256 workers, recording every candidate was most of a hint's time.
fn explained_candidates(candidates: &[Candidate]) -> Vec<&Candidate> {
    candidates
        .iter()
        .enumerate()
        .filter(|(i, c)| *i < EXPLAINED_FIRST || c.matched_blocks > 0 || c.in_flight_blocks > 0)
        .map(|(_, c)| c)
        .collect()
}
