//! proxy-wasm glue: a root context (config, metrics, bundle refresh, the hint stream) and one
//! HTTP context per request. The decisions are in [`crate::plan`], [`crate::flow`] and
//! [`crate::stream`]; this file reads what Envoy hands over, calls them, and executes what they
//! return. A request asks on the root's stream; the root, given the answer (or the ask's
//! deadline passing on its tick), acts as that request to set its header and resume it.
//!
//! Host calls go through `hostcalls` with their errors handled: the SDK's convenience wrappers
//! panic when a call fails, and its string forms of headers panic on a value that is not UTF-8
//! (headers are read as bytes here); a panic kills the VM (every later request on that worker
//! thread would fail).

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::time::SystemTime;

use kvroute_protocol::bundle::Catalog;
use kvroute_protocol::headers::REQUEST_ID;
use kvroute_protocol::hint::{encode_finished, Finished, Ticket, Usage};
use kvroute_protocol::hint_stream::{self, Answer, Ask, REPORT_ID};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType};

use crate::config::FilterConfig;
use crate::flow::{self, Call, OnBody, OnHeaders, OnHint, Unreported};
use crate::metrics::{Counter, FallbackReason, Timing};
use crate::models::ModelRegistry;
use crate::plan::{plan, warm_up, Next};
use crate::stream::HintStream;
use crate::usage::{reading, Reading, StreamRule, StreamSample, UsageScanner};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|id| -> Box<dyn RootContext> {
        Box::new(Root {
            id,
            ..Root::default()
        })
    });
}}

/// State shared by the root context and the HTTP contexts of one VM (one Envoy worker thread).
/// The configuration is behind an `Rc` so a request takes it with a pointer copy, not a clone
/// of its strings.
#[derive(Default)]
struct Shared {
    config: Rc<FilterConfig>,
    models: ModelRegistry,
    metrics: HashMap<Counter, u32>,
    timings: HashMap<Timing, u32>,
    /// Hinted requests that finished, not yet reported to the sidecar.
    finished: Unreported,
    /// Hinted responses that streamed so far, and when one was last read.
    streams: StreamSample,
    /// The hint stream and the asks waiting on it.
    hint_stream: HintStream<Waiter>,
}

/// What it takes to resume a request whose hint was asked on the stream.
struct Waiter {
    context_id: u32,
    asked_at: Option<SystemTime>,
    ticket: Rc<Cell<Option<Ticket>>>,
}

impl Shared {
    fn bump(&self, counter: Counter, by: u64) {
        if by == 0 {
            return;
        }
        if let Some(&id) = self.metrics.get(&counter) {
            let _ = hostcalls::increment_metric(id, by as i64);
        }
    }

    /// Record the microseconds since `since` (a clock that went back records nothing).
    fn time(&self, timing: Timing, since: Option<SystemTime>) {
        self.record(timing, since, now());
    }

    /// Record the microseconds from `since` to `until`.
    fn record(&self, timing: Timing, since: Option<SystemTime>, until: Option<SystemTime>) {
        let Some(elapsed) = between(since, until) else {
            return;
        };
        if let Some(&id) = self.timings.get(&timing) {
            let _ = hostcalls::record_metric(id, elapsed.as_micros() as u64);
        }
    }

    /// Set a header of the request in effect (a failure is counted: the request goes on).
    fn set_header(&self, name: &str, value: Option<&str>) {
        if hostcalls::set_map_value(MapType::HttpRequestHeaders, name, value).is_err() {
            self.bump(Counter::HostErrors, 1);
        }
    }

    /// Execute the sidecar's answer to the paused request in effect, whichever transport
    /// brought it (or its absence): set its header, count, resume it.
    fn deliver(&self, answer: OnHint, ticket: &Cell<Option<Ticket>>, asked_at: Option<SystemTime>) {
        self.time(Timing::HintPauseUs, asked_at);
        match answer {
            OnHint::Route {
                header,
                value,
                ticket: t,
                matched_blocks,
            } => {
                ticket.set(t);
                self.set_header(&header, Some(&value));
                self.bump(Counter::Hinted, 1);
                self.bump(Counter::MatchedBlocks, u64::from(matched_blocks));
            }
            OnHint::Fallback { reason, problem } => {
                if let Some(problem) = problem {
                    self.bump(problem, 1);
                }
                self.bump(Counter::Fallback(reason), 1);
            }
        }
        // Envoy resumes it once this callback returns, so no borrow is held across it.
        if hostcalls::resume_http_request().is_err() {
            self.bump(Counter::HostErrors, 1);
        }
    }

    /// Send `call` to the sidecar; its token, or `None` when Envoy refused it.
    fn dispatch(&self, call: &Call) -> Option<u32> {
        let config = &self.config;
        hostcalls::dispatch_http_call(
            &config.sidecar_cluster,
            call.headers(config),
            call.body.as_deref(),
            vec![],
            call.timeout,
        )
        .ok()
    }
}

enum Fetch {
    Catalog,
    Bundle(String),
    Finished,
}

#[derive(Default)]
struct Root {
    /// Its context id: host calls go back to it after acting for a request.
    id: u32,
    shared: Rc<RefCell<Shared>>,
    pending: HashMap<u32, Fetch>,
    last_catalog: Option<SystemTime>,
    catalog_loaded: bool,
    last_report: Option<SystemTime>,
    /// Whether the stream's trouble was logged since it was last up (said once per outage).
    stream_trouble_said: bool,
}

impl Root {
    fn fetch(&mut self, call: Call, what: Fetch) {
        let shared = self.shared.borrow();
        match shared.dispatch(&call) {
            Some(token) => {
                self.pending.insert(token, what);
            }
            None => {
                log::warn!(
                    "kvroute: cannot call sidecar cluster {} for {}",
                    shared.config.sidecar_cluster,
                    call.path
                );
                shared.bump(Counter::BundleErrors, 1);
            }
        }
    }

    /// Report finished requests that no hint request carried (traffic paused, or unhinted):
    /// on the stream when it is up, else as a call.
    fn report_finished(&mut self) {
        let finished = self.shared.borrow_mut().finished.take();
        if finished.is_empty() {
            return;
        }
        let stream = self.shared.borrow().hint_stream.up();
        if let Some(token) = stream {
            let body = encode_finished(&finished);
            let ask = Ask {
                id: REPORT_ID,
                request_id: "",
                body: &body,
            };
            if hostcalls::send_grpc_stream_message(token, Some(&ask.encode()), false).is_ok() {
                return;
            }
        }
        if let Some(call) = Call::finished(&finished) {
            if let Some(token) = self.shared.borrow().dispatch(&call) {
                self.pending.insert(token, Fetch::Finished);
            }
        }
    }

    /// Resume the requests of `waiters` as `answer` says, each in its own context, then act
    /// as the root again.
    fn resume(&self, waiters: Vec<Waiter>, answer: impl Fn() -> OnHint) {
        if waiters.is_empty() {
            return;
        }
        let shared = self.shared.borrow();
        for w in waiters {
            // A request that ended took its waiter out: one still here is paused.
            if hostcalls::set_effective_context(w.context_id).is_ok() {
                shared.deliver(answer(), &w.ticket, w.asked_at);
            }
        }
        if hostcalls::set_effective_context(self.id).is_err() {
            shared.bump(Counter::HostErrors, 1);
        }
    }

    /// Let the asks past their deadline go on unhinted, and open the hint stream when due.
    fn tend_stream(&mut self, now: SystemTime) {
        let (due, expired) = {
            let mut shared = self.shared.borrow_mut();
            if !(shared.config.hints && shared.config.hint_stream) {
                return;
            }
            (shared.hint_stream.due(now), shared.hint_stream.expired(now))
        };
        self.resume(expired, || OnHint::Fallback {
            reason: FallbackReason::Sidecar,
            problem: Some(Counter::SidecarTimeouts),
        });
        if !due {
            return;
        }
        let cluster = self.shared.borrow().config.sidecar_cluster.clone();
        let opened = hostcalls::open_grpc_stream(
            &cluster,
            hint_stream::SERVICE,
            hint_stream::METHOD,
            vec![],
        );
        match opened {
            Ok(token) => self.shared.borrow_mut().hint_stream.opened(token),
            Err(status) => {
                self.shared.borrow_mut().hint_stream.open_failed(now);
                self.stream_trouble(&format!("Envoy refused to open it ({status:?})"));
            }
        }
    }

    /// Say, once per outage, why hints go as HTTP calls.
    fn stream_trouble(&mut self, why: &str) {
        if !self.stream_trouble_said {
            self.stream_trouble_said = true;
            log::warn!(
                "kvroute: hint stream to cluster {} unavailable: {why}; hints go as HTTP calls \
                 until it opens (a sidecar older than the stream never opens it)",
                self.shared.borrow().config.sidecar_cluster
            );
        }
        self.shared.borrow().bump(Counter::HintStreamDown, 1);
    }

    fn on_catalog(&mut self, status: Option<String>, body: Option<Vec<u8>>) {
        let catalog = match (status.as_deref(), body) {
            (Some("200"), Some(body)) => serde_json::from_slice::<Catalog>(&body),
            _ => {
                log::warn!("kvroute: sidecar catalog unavailable (status {status:?}); routing by fallback key");
                self.shared.borrow().bump(Counter::BundleErrors, 1);
                return;
            }
        };
        match catalog {
            Ok(catalog) => {
                self.catalog_loaded = true;
                let wanted = self.shared.borrow_mut().models.reconcile(&catalog);
                for model in wanted {
                    let in_flight = self
                        .pending
                        .values()
                        .any(|f| matches!(f, Fetch::Bundle(m) if *m == model));
                    if !in_flight {
                        self.fetch(Call::bundle(&model), Fetch::Bundle(model));
                    }
                }
            }
            Err(e) => {
                log::warn!("kvroute: sidecar catalog is not valid JSON: {e}");
                self.shared.borrow().bump(Counter::BundleErrors, 1);
            }
        }
    }

    fn on_bundle(&mut self, model: String, status: Option<String>, body: Option<Vec<u8>>) {
        let mut shared = self.shared.borrow_mut();
        let Some(body) = body.filter(|_| status.as_deref() == Some("200")) else {
            log::warn!("kvroute: bundle of model {model} unavailable (status {status:?})");
            shared.bump(Counter::BundleErrors, 1);
            return;
        };
        let started = now();
        let token_cache_bytes = shared.config.token_cache_bytes;
        match shared.models.install(&body, token_cache_bytes) {
            Ok((model, version)) => {
                let blocks = warm_up(&shared.models, &shared.config, &model);
                let took = between(started, now()).unwrap_or_default();
                let cache = match shared
                    .models
                    .get(&model)
                    .map(|m| m.preprocessor.token_cache())
                {
                    Some(Some(c)) => format!("token cache cutting before {:?}", c.cuts()),
                    _ if token_cache_bytes == 0 => "no token cache (token_cache_bytes = 0)".into(),
                    _ => "no token cache (its chats cannot be cut exactly)".into(),
                };
                log::info!(
                    "kvroute: loaded bundle of model {model} version {version} in {} ms \
                     (warm-up request: {blocks} blocks; {cache})",
                    took.as_millis()
                );
                shared.bump(Counter::BundlesLoaded, 1);
            }
            Err(e) => {
                log::error!("kvroute: cannot load {e}; requests for it use fallback routing");
                shared.bump(Counter::BundleErrors, 1);
            }
        }
    }
}

impl Context for Root {
    fn on_http_call_response(
        &mut self,
        token: u32,
        num_headers: usize,
        body_size: usize,
        _: usize,
    ) {
        let Some(fetch) = self.pending.remove(&token) else {
            return;
        };
        let status = response_status(num_headers);
        let body = hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
            .ok()
            .flatten();
        match fetch {
            Fetch::Catalog => self.on_catalog(status, body),
            Fetch::Bundle(model) => self.on_bundle(model, status, body),
            Fetch::Finished => {}
        }
    }

    fn on_grpc_stream_initial_metadata(&mut self, token: u32, _: u32) {
        if self.shared.borrow_mut().hint_stream.answered_headers(token) {
            self.stream_trouble_said = false;
            log::info!("kvroute: hint stream open: hints go on it");
        }
    }

    fn on_grpc_stream_message(&mut self, _: u32, size: usize) {
        let Ok(Some(msg)) = hostcalls::get_buffer(BufferType::GrpcReceiveBuffer, 0, size) else {
            return;
        };
        let Ok(answer) = Answer::decode(&msg) else {
            self.shared.borrow().bump(Counter::SidecarErrors, 1);
            return;
        };
        // An answer after its deadline finds no waiter: that request went on unhinted.
        let waiter = self.shared.borrow_mut().hint_stream.take(answer.id);
        if let Some(waiter) = waiter {
            let config = Rc::clone(&self.shared.borrow().config);
            let hint = flow::on_hint(Some(answer.status), answer.body, &config);
            self.resume(vec![waiter], || hint.clone());
        }
    }

    fn on_grpc_stream_close(&mut self, token: u32, status: u32) {
        let Ok(now) = hostcalls::get_current_time() else {
            return;
        };
        let carried = self.shared.borrow_mut().hint_stream.closed(token, now);
        if let Some(waiters) = carried {
            self.resume(waiters, || OnHint::Fallback {
                reason: FallbackReason::Sidecar,
                problem: Some(Counter::SidecarErrors),
            });
            self.stream_trouble(&format!("it closed (gRPC status {status})"));
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _: usize) -> bool {
        let raw = hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
            .ok()
            .flatten()
            .unwrap_or_default();
        let config = match FilterConfig::parse(&raw) {
            Ok(c) => c,
            Err(e) => {
                log::error!("kvroute: invalid plugin configuration: {e}");
                return false;
            }
        };
        let mut shared = self.shared.borrow_mut();
        shared.config = Rc::new(config);
        if shared.metrics.is_empty() {
            for counter in Counter::all() {
                if let Ok(id) = hostcalls::define_metric(MetricType::Counter, &counter.name()) {
                    shared.metrics.insert(counter, id);
                }
            }
            for timing in Timing::ALL {
                if let Ok(id) = hostcalls::define_metric(MetricType::Histogram, timing.name()) {
                    shared.timings.insert(timing, id);
                }
            }
        }
        let _ = hostcalls::set_tick_period(flow::tick_period(&shared.config));
        true
    }

    fn on_tick(&mut self) {
        let Ok(now) = hostcalls::get_current_time() else {
            return;
        };
        self.tend_stream(now);
        let report_due = self
            .last_report
            .and_then(|t| now.duration_since(t).ok())
            .is_none_or(|t| t >= flow::REPORT_EVERY);
        if report_due {
            self.last_report = Some(now);
            self.report_finished();
        }
        if self.pending.values().any(|f| matches!(f, Fetch::Catalog)) {
            return;
        }
        let since_last = self.last_catalog.and_then(|t| now.duration_since(t).ok());
        let due = flow::catalog_due(
            since_last,
            self.catalog_loaded,
            &self.shared.borrow().config,
        );
        if due {
            self.last_catalog = Some(now);
            self.fetch(Call::catalog(), Fetch::Catalog);
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Request {
            context_id,
            shared: self.shared.clone(),
            state: State::Passing,
            session: None,
            request_id: None,
            ticket: Rc::default(),
            asked_on_stream: None,
            response: None,
            answered: false,
            unread: false,
            asked_at: None,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

fn response_status(num_headers: usize) -> Option<String> {
    if num_headers == 0 {
        return None;
    }
    header_text(MapType::HttpCallResponseHeaders, ":status")
}

/// A header's first value if it is there and is text. Through the SDK's bytes form: its string
/// forms panic on a value that is not UTF-8, which Envoy passes on (obs-text) from clients and
/// engines alike.
fn header_text(map: MapType, name: &str) -> Option<String> {
    let value = hostcalls::get_map_value_bytes(map, name).ok()??;
    String::from_utf8(value).ok()
}

/// Envoy's clock (`None` when the host does not answer).
fn now() -> Option<SystemTime> {
    hostcalls::get_current_time().ok()
}

/// The time from `since` to `until` on Envoy's clock (`None` without either, or if the clock
/// went back).
fn between(since: Option<SystemTime>, until: Option<SystemTime>) -> Option<std::time::Duration> {
    until?.duration_since(since?).ok()
}

#[derive(PartialEq, Eq)]
enum State {
    /// Not ours, or already decided: let everything through.
    Passing,
    /// A routable request whose body is being buffered.
    Buffering,
    /// Waiting for the sidecar's hint.
    AwaitingHint,
}

struct Request {
    context_id: u32,
    shared: Rc<RefCell<Shared>>,
    state: State,
    session: Option<String>,
    /// Its `x-request-id`, sent with its hint (the sidecar's `/debug/explain` shows it).
    request_id: Option<String>,
    /// The sidecar counts this request against its worker until it is reported finished
    /// (shared with its waiter when the hint is asked on the stream).
    ticket: Rc<Cell<Option<Ticket>>>,
    /// The id of its ask on the hint stream, while it may wait there.
    asked_on_stream: Option<u64>,
    /// A hinted request's successful response, read for its usage as it passes.
    response: Option<UsageScanner>,
    /// Whether that response was seen to its end.
    answered: bool,
    /// A hinted request's response the filter chose not to read.
    unread: bool,
    /// When its hint request was ready to send (its preparation's end: the hint pause starts
    /// there).
    asked_at: Option<SystemTime>,
}

/// A request's headers as one host call hands them over, values as bytes (see
/// [`header_text`]).
struct Headers(Vec<(String, Vec<u8>)>);

impl Headers {
    /// The first value of `name` (Envoy's names are lower case; a configured name may not be).
    fn value(&self, name: &str) -> Option<&[u8]> {
        let (_, value) = self.0.iter().find(|(n, _)| n.eq_ignore_ascii_case(name))?;
        Some(value)
    }

    /// Whether `name` is there.
    fn has(&self, name: &str) -> bool {
        self.value(name).is_some()
    }

    /// The first value of `name`, if it is text.
    fn get(&self, name: &str) -> Option<&str> {
        std::str::from_utf8(self.value(name)?).ok()
    }
}

impl Request {
    fn set_header(&self, name: &str, value: Option<&str>) {
        self.shared.borrow().set_header(name, value);
    }

    fn fall_back(&mut self, reason: FallbackReason) -> Action {
        self.shared.borrow().bump(Counter::Fallback(reason), 1);
        self.state = State::Passing;
        Action::Continue
    }

    fn on_hint(&mut self, num_headers: usize, body_size: usize) {
        let status = response_status(num_headers).and_then(|s| s.parse().ok());
        let body = hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
            .ok()
            .flatten()
            .unwrap_or_default();
        let config = Rc::clone(&self.shared.borrow().config);
        let answer = flow::on_hint(status, &body, &config);
        self.state = State::Passing;
        self.shared
            .borrow()
            .deliver(answer, &self.ticket, self.asked_at);
    }

    /// Ask for the hint on the stream if it is up: whether it was sent.
    fn ask_on_stream(&mut self, hint: &[u8], config: &FilterConfig) -> bool {
        let mut shared = self.shared.borrow_mut();
        let (Some(token), Some(now)) = (shared.hint_stream.up(), self.asked_at) else {
            return false;
        };
        let deadline = now + std::time::Duration::from_millis(config.hint_timeout_ms);
        let waiter = Waiter {
            context_id: self.context_id,
            asked_at: self.asked_at,
            ticket: Rc::clone(&self.ticket),
        };
        let id = shared.hint_stream.ask(waiter, deadline);
        let ask = Ask {
            id,
            request_id: self.request_id.as_deref().unwrap_or_default(),
            body: hint,
        };
        if hostcalls::send_grpc_stream_message(token, Some(&ask.encode()), false).is_ok() {
            self.asked_on_stream = Some(id);
            shared.bump(Counter::HintStreamAsks, 1);
            return true;
        }
        // Envoy forgets a stream only after telling us it closed, so this is not expected; the
        // hint goes as a call.
        shared.hint_stream.take(id);
        false
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        if let (Some(id), Ok(mut shared)) = (self.asked_on_stream, self.shared.try_borrow_mut()) {
            shared.hint_stream.take(id);
        }
    }
}

impl Context for Request {
    fn on_http_call_response(&mut self, _: u32, num_headers: usize, body_size: usize, _: usize) {
        if self.state == State::AwaitingHint {
            self.on_hint(num_headers, body_size);
        }
    }
}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _: usize, end_of_stream: bool) -> Action {
        let config = Rc::clone(&self.shared.borrow().config);
        // All of them in one host call: each is a trip across the VM's boundary, ~0.75 µs of
        // Envoy's CPU (docs/benchmarks.md, "Data path cost"), and a request needs five or more.
        let headers = match hostcalls::get_map_bytes(MapType::HttpRequestHeaders) {
            Ok(headers) => Headers(headers),
            Err(_) => {
                self.shared.borrow().bump(Counter::HostErrors, 1);
                Headers(Vec::new())
            }
        };
        let step = flow::on_headers(
            headers.get(":method"),
            headers.get(":path"),
            headers.get("content-length"),
            end_of_stream,
            &config,
        );
        if step == OnHeaders::NotOurs {
            return Action::Continue;
        }
        self.shared.borrow().bump(Counter::Requests, 1);
        for name in flow::routing_headers(&config) {
            if headers.has(name) {
                self.set_header(name, None);
            }
        }
        if !config.session_header.is_empty() {
            self.session = headers.get(&config.session_header).map(str::to_owned);
        }
        self.request_id = headers.get(REQUEST_ID).map(str::to_owned);
        match step {
            OnHeaders::Fallback(reason) => self.fall_back(reason),
            OnHeaders::NotOurs | OnHeaders::Buffer => {
                self.state = State::Buffering;
                Action::Pause
            }
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.state != State::Buffering {
            return Action::Continue;
        }
        let config = Rc::clone(&self.shared.borrow().config);
        match flow::on_body(body_size, end_of_stream, &config) {
            OnBody::Wait => return Action::Pause,
            OnBody::TooLarge => return self.fall_back(FallbackReason::TooLarge),
            OnBody::Read => {}
        }
        let Ok(Some(body)) = hostcalls::get_buffer(BufferType::HttpRequestBody, 0, body_size)
        else {
            self.shared.borrow().bump(Counter::HostErrors, 1);
            return self.fall_back(FallbackReason::BadRequest);
        };
        if !config.test_trap_header.is_empty()
            && header_text(MapType::HttpRequestHeaders, &config.test_trap_header).is_some()
        {
            // Tests only (see `FilterConfig::test_trap_header`): the VM dies here.
            panic!("kvroute: test trap requested");
        }
        let started = now();
        let planned = {
            let s = self.shared.borrow();
            plan(&body, &s.models, &config, self.session.as_deref())
        };
        let prepared = now();
        if planned.blocks > 0 {
            self.shared
                .borrow()
                .record(Timing::PrepareUs, started, prepared);
        }
        if let Some(key) = &planned.key {
            self.set_header(&config.key_header, Some(key));
        }
        {
            let shared = self.shared.borrow();
            shared.bump(Counter::PromptBlocks, planned.blocks as u64);
            let used = planned.segments;
            shared.bump(Counter::TokenSegmentsFound, u64::from(used.found));
            shared.bump(Counter::TokenSegmentsTokenized, u64::from(used.tokenized));
            shared.bump(Counter::TokenHistoriesFound, u64::from(used.history > 0));
            if used.mismatch {
                log::error!(
                    "kvroute: a prompt cut at special tokens tokenized differently from the whole \
                     prompt; this VM's token cache for its model is off (the request used the \
                     whole prompt's ids)"
                );
                shared.bump(Counter::TokenCacheMismatches, 1);
            }
        }
        let mut hint = match planned.next {
            Next::Fallback(reason) => return self.fall_back(reason),
            Next::Ask(hint) => hint,
        };
        hint.finished = self.shared.borrow_mut().finished.take();
        self.asked_at = prepared;
        self.state = State::AwaitingHint;
        let encoded = hint.encode();
        if config.hint_stream && self.ask_on_stream(&encoded, &config) {
            return Action::Pause;
        }
        let call = Call::hint(encoded, self.request_id.take(), &config);
        let sent = self.shared.borrow().dispatch(&call);
        if sent.is_some() {
            Action::Pause
        } else {
            self.shared.borrow().bump(Counter::SidecarErrors, 1);
            self.fall_back(FallbackReason::Sidecar)
        }
    }

    fn on_http_response_headers(&mut self, _: usize, end_of_stream: bool) -> Action {
        if self.ticket.get().is_none() {
            return Action::Continue;
        }
        let header = |name| header_text(MapType::HttpResponseHeaders, name);
        let decided = {
            let mut shared = self.shared.borrow_mut();
            let shared = &mut *shared;
            let rule = StreamRule {
                every: shared.config.stream_usage_every,
                min_per_s: shared.config.stream_usage_min_per_s,
            };
            let now_ms = || {
                let now = hostcalls::get_current_time().ok()?;
                let since = now.duration_since(std::time::UNIX_EPOCH).ok()?;
                u64::try_from(since.as_millis()).ok()
            };
            reading(
                shared.config.read_usage,
                rule,
                || header(":status"),
                || header("content-type"),
                now_ms,
                &mut shared.streams,
            )
        };
        match decided {
            Reading::Read => {
                self.response = Some(UsageScanner::default());
                self.answered = end_of_stream;
            }
            Reading::Unread => self.unread = true,
            Reading::Failed => {}
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if let Some(scanner) = self.response.as_mut() {
            // Returning Continue each time, the buffer holds only this piece.
            if body_size > 0 {
                match hostcalls::get_buffer(BufferType::HttpResponseBody, 0, body_size) {
                    Ok(Some(piece)) => scanner.feed(&piece),
                    Ok(None) => {}
                    Err(_) => self.shared.borrow().bump(Counter::HostErrors, 1),
                }
            }
            self.answered |= end_of_stream;
        }
        Action::Continue
    }

    fn on_http_response_trailers(&mut self, _: usize) -> Action {
        self.answered = self.response.is_some();
        Action::Continue
    }

    /// Envoy logs a stream once it is over (finished, failed or reset): the request no longer
    /// loads its worker, and its response said what the worker had cached.
    fn on_log(&mut self) {
        if let Some(ticket) = self.ticket.take() {
            let usage = match self.response.take() {
                Some(scanner) => scanner.finish(self.answered),
                None if self.unread => Usage::Unread,
                None => Usage::Unanswered,
            };
            self.shared
                .borrow_mut()
                .finished
                .push(Finished { ticket, usage });
        }
    }
}
