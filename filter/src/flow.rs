//! Every decision the proxy-wasm callbacks need, as plain functions: what to do with a
//! request's headers, its body, the sidecar's answer; which calls go to the sidecar, with what
//! timeout; when the catalog is due; how many finished requests wait. The glue (`glue.rs`, wasm
//! only) reads what Envoy hands it, calls these, and executes what they return.

use std::time::Duration;

use kvroute_protocol::bundle::{bundle_path, CATALOG_PATH};
use kvroute_protocol::headers::REQUEST_ID;
use kvroute_protocol::hint::{
    encode_finished, Finished, HintResponse, HintTarget, Ticket, FINISHED_PATH, HINT_CONTENT_TYPE,
    HINT_PATH,
};

use crate::config::FilterConfig;
use crate::metrics::{Counter, FallbackReason};
use crate::plan::wants_body;

/// The root context's tick period until the first catalog arrives, and its first fetch.
pub const FIRST_FETCH: Duration = Duration::from_millis(200);
/// How often waiting finished reports go to the sidecar when no hint request carries them.
pub const REPORT_EVERY: Duration = FIRST_FETCH;
/// How soon a failed catalog fetch is retried.
pub const RETRY_FETCH: Duration = Duration::from_secs(1);
/// Catalog and bundle fetches: large bodies, off the request path.
const FETCH_TIMEOUT: Duration = Duration::from_secs(5);
/// Finished-ticket reports: small, off the request path; a lost one is reclaimed by the sidecar.
const FINISHED_TIMEOUT: Duration = Duration::from_secs(1);
/// Reports beyond this wait are dropped (the sidecar reclaims their tickets from its scrapes);
/// it bounds the VM's memory while the sidecar is unreachable.
pub const MAX_UNREPORTED: usize = 4096;

/// The headers only kvroute decides: a client must not pick a worker, so the filter removes
/// them from every routed request before it sets its own.
pub fn routing_headers(cfg: &FilterConfig) -> [&str; 4] {
    [
        &cfg.worker_header,
        &cfg.key_header,
        &cfg.instance_header,
        &cfg.prefill_instance_header,
    ]
}

/// What to do once a request's headers are in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnHeaders {
    /// Not an LLM request: let it through untouched (no counter, no header removed).
    NotOurs,
    /// Routed, but it goes on now, unhinted.
    Fallback(FallbackReason),
    /// Routed: pause and buffer the body.
    Buffer,
}

/// Decide on a request's headers. A routed request (anything but [`OnHeaders::NotOurs`]) is
/// counted and loses the [`routing_headers`] a client sent.
pub fn on_headers(
    method: Option<&str>,
    path: Option<&str>,
    content_length: Option<&str>,
    end_of_stream: bool,
    cfg: &FilterConfig,
) -> OnHeaders {
    if !wants_body(method, path) {
        return OnHeaders::NotOurs;
    }
    let too_large = content_length
        .and_then(|v| v.trim().parse::<usize>().ok())
        .is_some_and(|len| len > cfg.max_body_bytes);
    if too_large {
        OnHeaders::Fallback(FallbackReason::TooLarge)
    } else if end_of_stream {
        OnHeaders::Fallback(FallbackReason::BadRequest)
    } else {
        OnHeaders::Buffer
    }
}

/// What to do with a piece of a buffered body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnBody {
    /// More is coming: keep buffering.
    Wait,
    /// Over the limit: stream it through unhinted.
    TooLarge,
    /// Complete: read and plan it.
    Read,
}

/// Decide on the body buffered so far (`body_size` bytes).
pub fn on_body(body_size: usize, end_of_stream: bool, cfg: &FilterConfig) -> OnBody {
    if body_size > cfg.max_body_bytes {
        OnBody::TooLarge
    } else if end_of_stream {
        OnBody::Read
    } else {
        OnBody::Wait
    }
}

/// What the sidecar's answer to a hint call means for the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OnHint {
    /// Set `header: value` and go on; count `ticket` against the worker until the request ends.
    Route {
        /// The header to set.
        header: String,
        /// Its value.
        value: String,
        /// The sidecar's ticket for this request.
        ticket: Option<Ticket>,
        /// Leading blocks the worker holds.
        matched_blocks: u32,
    },
    /// Go on unhinted; `problem` counts what went wrong with the call, if anything.
    Fallback {
        /// Why.
        reason: FallbackReason,
        /// The call's trouble: a timeout or an error.
        problem: Option<Counter>,
    },
}

/// Read the sidecar's answer: its status (`None`: no headers) and body.
pub fn on_hint(status: Option<u16>, body: &[u8], cfg: &FilterConfig) -> OnHint {
    let failed = |problem| OnHint::Fallback {
        reason: FallbackReason::Sidecar,
        problem: Some(problem),
    };
    let hint = match status {
        // Envoy 1.40 answers a call that ran out of time with a local 504, not with zero
        // headers as older hosts did; both count as timeouts.
        None | Some(504) => return failed(Counter::SidecarTimeouts),
        Some(200) => match serde_json::from_slice::<HintResponse>(body) {
            Ok(hint) => hint,
            Err(_) => return failed(Counter::SidecarErrors),
        },
        Some(_) => return failed(Counter::SidecarErrors),
    };
    let (header, value) = match hint.target() {
        None => {
            return OnHint::Fallback {
                reason: FallbackReason::NoWorker,
                problem: None,
            }
        }
        Some(HintTarget::Instance(id)) => (&cfg.instance_header, id.to_string()),
        Some(HintTarget::PrefillInstance(id)) => (&cfg.prefill_instance_header, id.to_string()),
        Some(HintTarget::Hosts(hosts)) => (&cfg.worker_header, hosts),
    };
    OnHint::Route {
        header: header.clone(),
        value,
        ticket: hint.ticket,
        matched_blocks: hint.matched_blocks,
    }
}

/// One HTTP call to the sidecar.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    /// `GET` or `POST`.
    pub method: &'static str,
    /// The path.
    pub path: String,
    /// The body, for a `POST`.
    pub body: Option<Vec<u8>>,
    /// How long Envoy waits for the answer.
    pub timeout: Duration,
    /// A hint call's request: its `x-request-id`, for `/debug/explain` to show.
    pub request_id: Option<String>,
}

impl Call {
    /// The request headers, `:authority` from the configuration.
    pub fn headers<'a>(&'a self, cfg: &'a FilterConfig) -> Vec<(&'a str, &'a str)> {
        let mut headers = vec![
            (":method", self.method),
            (":path", self.path.as_str()),
            (":authority", cfg.sidecar_authority.as_str()),
        ];
        if self.body.is_some() {
            headers.push(("content-type", HINT_CONTENT_TYPE));
        }
        if let Some(id) = &self.request_id {
            headers.push((REQUEST_ID, id.as_str()));
        }
        headers
    }

    /// The bundle catalog.
    pub fn catalog() -> Self {
        Call {
            method: "GET",
            path: CATALOG_PATH.to_owned(),
            body: None,
            timeout: FETCH_TIMEOUT,
            request_id: None,
        }
    }

    /// One model's bundle.
    pub fn bundle(model: &str) -> Self {
        Call {
            method: "GET",
            path: bundle_path(model),
            body: None,
            timeout: FETCH_TIMEOUT,
            request_id: None,
        }
    }

    /// A hint request (`HintRequest::encode`d) for the request Envoy calls `request_id`,
    /// within the configured hint timeout: the request waits for it.
    pub fn hint(encoded: Vec<u8>, request_id: Option<String>, cfg: &FilterConfig) -> Self {
        Call {
            method: "POST",
            path: HINT_PATH.to_owned(),
            body: Some(encoded),
            timeout: Duration::from_millis(cfg.hint_timeout_ms),
            request_id,
        }
    }

    /// A report of finished requests, when there are any.
    pub fn finished(finished: &[Finished]) -> Option<Self> {
        (!finished.is_empty()).then(|| Call {
            method: "POST",
            path: FINISHED_PATH.to_owned(),
            body: Some(encode_finished(finished)),
            timeout: FINISHED_TIMEOUT,
            request_id: None,
        })
    }
}

/// Hinted requests that ended, waiting to ride on the next hint call or a report.
#[derive(Debug, Default)]
pub struct Unreported {
    finished: Vec<Finished>,
}

impl Unreported {
    /// A hinted request ended; beyond [`MAX_UNREPORTED`] waiting, it is dropped.
    pub fn push(&mut self, finished: Finished) {
        if self.finished.len() < MAX_UNREPORTED {
            self.finished.push(finished);
        }
    }

    /// Everything waiting, now on its way.
    pub fn take(&mut self) -> Vec<Finished> {
        std::mem::take(&mut self.finished)
    }

    /// How many wait.
    pub fn len(&self) -> usize {
        self.finished.len()
    }

    /// Whether none wait.
    pub fn is_empty(&self) -> bool {
        self.finished.is_empty()
    }
}

/// The root context's tick period: the catalog's first fetch and the finished reports need no
/// more than [`FIRST_FETCH`], but hints asked on the stream time out on the tick, so it comes
/// every quarter of `hint_timeout_ms` (an ask waits at most 1.25× it).
pub fn tick_period(cfg: &FilterConfig) -> Duration {
    if cfg.hints && cfg.hint_stream {
        (Duration::from_millis(cfg.hint_timeout_ms) / 4)
            .clamp(Duration::from_millis(1), FIRST_FETCH)
    } else {
        FIRST_FETCH
    }
}

/// Whether the catalog is due `since_last` after the last fetch (`None`: never fetched, or the
/// clock went back since — fetch rather than stall): every `bundle_refresh_ms` once one
/// arrived, every [`RETRY_FETCH`] until then.
pub fn catalog_due(since_last: Option<Duration>, loaded: bool, cfg: &FilterConfig) -> bool {
    let every = if loaded {
        Duration::from_millis(cfg.bundle_refresh_ms)
    } else {
        RETRY_FETCH
    };
    since_last.is_none_or(|t| t >= every)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_protocol::hint::{HintRequest, Usage};

    fn cfg() -> FilterConfig {
        FilterConfig::default()
    }

    #[test]
    fn headers_decide_buffering() {
        let c = cfg();
        let post = Some("POST");
        let chat = Some("/v1/chat/completions");
        assert_eq!(
            on_headers(Some("GET"), chat, None, false, &c),
            OnHeaders::NotOurs
        );
        assert_eq!(
            on_headers(post, Some("/health"), None, false, &c),
            OnHeaders::NotOurs
        );
        assert_eq!(
            on_headers(post, chat, Some("100"), false, &c),
            OnHeaders::Buffer
        );
        assert_eq!(
            on_headers(post, chat, Some(" 99999999 "), false, &c),
            OnHeaders::Fallback(FallbackReason::TooLarge)
        );
        assert_eq!(
            on_headers(post, chat, Some("junk"), false, &c),
            OnHeaders::Buffer,
            "an unreadable length is checked on the body instead"
        );
        assert_eq!(
            on_headers(post, chat, None, true, &c),
            OnHeaders::Fallback(FallbackReason::BadRequest),
            "no body"
        );
        assert_eq!(
            routing_headers(&c),
            [
                "x-kvroute-worker",
                "x-kvroute-key",
                "x-worker-instance-id",
                "x-prefill-instance-id"
            ]
        );
    }

    #[test]
    fn bodies_are_buffered_up_to_the_limit() {
        let c = cfg();
        assert_eq!(on_body(10, false, &c), OnBody::Wait);
        assert_eq!(on_body(10, true, &c), OnBody::Read);
        assert_eq!(on_body(c.max_body_bytes + 1, false, &c), OnBody::TooLarge);
        assert_eq!(on_body(c.max_body_bytes + 1, true, &c), OnBody::TooLarge);
    }

    #[test]
    fn hint_answers_route_or_fall_back() {
        let c = cfg();
        let timeout = OnHint::Fallback {
            reason: FallbackReason::Sidecar,
            problem: Some(Counter::SidecarTimeouts),
        };
        assert_eq!(on_hint(None, b"", &c), timeout);
        assert_eq!(on_hint(Some(504), b"upstream timeout", &c), timeout);
        let error = OnHint::Fallback {
            reason: FallbackReason::Sidecar,
            problem: Some(Counter::SidecarErrors),
        };
        assert_eq!(on_hint(Some(500), b"", &c), error);
        assert_eq!(on_hint(Some(200), b"{not json", &c), error);
        assert_eq!(
            on_hint(Some(200), br#"{"workers": []}"#, &c),
            OnHint::Fallback {
                reason: FallbackReason::NoWorker,
                problem: None
            }
        );
        let hosts =
            br#"{"workers": ["10.0.0.1:8000", "10.0.0.2:8000"], "matched_blocks": 3, "ticket": 9}"#;
        assert_eq!(
            on_hint(Some(200), hosts, &c),
            OnHint::Route {
                header: "x-kvroute-worker".into(),
                value: "10.0.0.1:8000,10.0.0.2:8000".into(),
                ticket: Some(Ticket(9)),
                matched_blocks: 3,
            }
        );
        let pinned = br#"{"workers": [], "prefill_instance_id": 77}"#;
        assert!(matches!(
            on_hint(Some(200), pinned, &c),
            OnHint::Route { header, value, .. } if header == "x-prefill-instance-id" && value == "77"
        ));
    }

    #[test]
    fn calls_carry_their_timeouts() {
        let c = FilterConfig {
            hint_timeout_ms: 25,
            ..cfg()
        };
        let req = HintRequest {
            model: "m".into(),
            hashes: vec![],
            finished: vec![],
        };
        let hint = Call::hint(req.encode(), Some("7f3c".into()), &c);
        assert_eq!(hint.timeout, Duration::from_millis(25));
        assert!(hint
            .headers(&c)
            .contains(&("content-type", HINT_CONTENT_TYPE)));
        assert!(hint.headers(&c).contains(&("x-request-id", "7f3c")));
        assert_eq!(Call::catalog().timeout, FETCH_TIMEOUT);
        assert!(!Call::catalog()
            .headers(&c)
            .iter()
            .any(|(k, _)| *k == "content-type"));
        assert_eq!(Call::finished(&[]), None, "nothing to report, no call");
        let one = Finished {
            ticket: Ticket(1),
            usage: Usage::Missing,
        };
        assert_eq!(Call::finished(&[one]).unwrap().timeout, FINISHED_TIMEOUT);
    }

    #[test]
    fn the_tick_comes_often_enough_to_time_out_streamed_asks() {
        let c = cfg();
        assert_eq!(tick_period(&c), Duration::from_micros(12_500));
        let calls = FilterConfig {
            hint_stream: false,
            ..cfg()
        };
        assert_eq!(tick_period(&calls), FIRST_FETCH);
        let quick = FilterConfig {
            hint_timeout_ms: 2,
            ..cfg()
        };
        assert_eq!(
            tick_period(&quick),
            Duration::from_millis(1),
            "1 ms at least"
        );
        let slow = FilterConfig {
            hint_timeout_ms: 5000,
            ..cfg()
        };
        assert_eq!(tick_period(&slow), FIRST_FETCH);
    }

    #[test]
    fn unreported_tickets_are_bounded() {
        let mut u = Unreported::default();
        for i in 0..MAX_UNREPORTED as u64 + 10 {
            u.push(Finished {
                ticket: Ticket(i),
                usage: Usage::Unanswered,
            });
        }
        assert_eq!(u.len(), MAX_UNREPORTED);
        assert_eq!(u.take().len(), MAX_UNREPORTED);
        assert!(u.is_empty());
    }

    #[test]
    fn the_catalog_is_polled_faster_until_it_arrives() {
        let c = cfg();
        assert!(catalog_due(None, false, &c));
        assert!(!catalog_due(Some(Duration::from_millis(500)), false, &c));
        assert!(catalog_due(Some(RETRY_FETCH), false, &c));
        assert!(!catalog_due(Some(RETRY_FETCH), true, &c));
        assert!(catalog_due(
            Some(Duration::from_millis(c.bundle_refresh_ms)),
            true,
            &c
        ));
    }
}
