//! proxy-wasm glue: a root context (config, metrics, bundle refresh) and one HTTP context per
//! request. All decisions are in [`crate::plan`]; this file only moves bytes to and from Envoy.
//!
//! Host calls go through `hostcalls` with their errors handled: the SDK's convenience wrappers
//! panic when a call fails, and a panic kills the VM (every later request on that worker thread
//! would fail).

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::time::{Duration, SystemTime};

use kvroute_protocol::bundle::{bundle_path, Catalog, CATALOG_PATH};
use kvroute_protocol::hint::{
    encode_finished, HintResponse, HintTarget, Ticket, FINISHED_PATH, HINT_CONTENT_TYPE, HINT_PATH,
};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType};

use crate::config::FilterConfig;
use crate::metrics::{Counter, FallbackReason};
use crate::models::ModelRegistry;
use crate::plan::{plan, wants_body, warm_up};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::default()) });
}}

/// State shared by the root context and the HTTP contexts of one VM (one Envoy worker thread).
/// The configuration is behind an `Rc` so a request takes it with a pointer copy, not a clone
/// of its strings.
#[derive(Default)]
struct Shared {
    config: Rc<FilterConfig>,
    models: ModelRegistry,
    metrics: HashMap<Counter, u32>,
    /// Tickets of hinted requests that finished, not yet reported to the sidecar.
    finished: Vec<Ticket>,
}

/// Reports beyond this wait are dropped (the sidecar reclaims their tickets from its scrapes);
/// it bounds the VM's memory while the sidecar is unreachable.
const MAX_UNREPORTED: usize = 4096;

impl Shared {
    fn bump(&self, counter: Counter, by: u64) {
        if let Some(&id) = self.metrics.get(&counter) {
            let _ = hostcalls::increment_metric(id, by as i64);
        }
    }
}

enum Fetch {
    Catalog,
    Bundle(String),
    Finished,
}

#[derive(Default)]
struct Root {
    shared: Rc<RefCell<Shared>>,
    pending: HashMap<u32, Fetch>,
    last_catalog: Option<SystemTime>,
    catalog_loaded: bool,
}

const FIRST_FETCH: Duration = Duration::from_millis(200);
const RETRY_FETCH: Duration = Duration::from_secs(1);

impl Root {
    fn fetch(&mut self, path: &str, what: Fetch) {
        let config = Rc::clone(&self.shared.borrow().config);
        let cluster = &config.sidecar_cluster;
        let headers = vec![
            (":method", "GET"),
            (":path", path),
            (":authority", config.sidecar_authority.as_str()),
        ];
        let timeout = Duration::from_secs(5);
        match hostcalls::dispatch_http_call(cluster, headers, None, vec![], timeout) {
            Ok(token) => {
                self.pending.insert(token, what);
            }
            Err(status) => {
                log::warn!("kvroute: cannot call sidecar cluster {cluster} for {path}: {status:?}");
                self.shared.borrow().bump(Counter::BundleErrors, 1);
            }
        }
    }

    /// Report finished tickets that no hint request carried (traffic paused, or unhinted).
    fn report_finished(&mut self) {
        let tickets = std::mem::take(&mut self.shared.borrow_mut().finished);
        if tickets.is_empty() {
            return;
        }
        let config = Rc::clone(&self.shared.borrow().config);
        let headers = vec![
            (":method", "POST"),
            (":path", FINISHED_PATH),
            (":authority", config.sidecar_authority.as_str()),
            ("content-type", HINT_CONTENT_TYPE),
        ];
        let body = encode_finished(&tickets);
        let timeout = Duration::from_secs(1);
        if let Ok(token) = hostcalls::dispatch_http_call(
            &config.sidecar_cluster,
            headers,
            Some(&body),
            vec![],
            timeout,
        ) {
            self.pending.insert(token, Fetch::Finished);
        }
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
                        self.fetch(&bundle_path(&model), Fetch::Bundle(model));
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
        let started = hostcalls::get_current_time().ok();
        match shared.models.install(&body) {
            Ok((model, version)) => {
                let blocks = warm_up(&shared.models, &shared.config, &model);
                let took = started
                    .and_then(|t| hostcalls::get_current_time().ok()?.duration_since(t).ok())
                    .unwrap_or_default();
                log::info!(
                    "kvroute: loaded bundle of model {model} version {version} in {} ms \
                     (warm-up request: {blocks} blocks)",
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
        }
        let _ = hostcalls::set_tick_period(FIRST_FETCH);
        true
    }

    fn on_tick(&mut self) {
        self.report_finished();
        if self.pending.values().any(|f| matches!(f, Fetch::Catalog)) {
            return;
        }
        let Ok(now) = hostcalls::get_current_time() else {
            return;
        };
        let every = if self.catalog_loaded {
            Duration::from_millis(self.shared.borrow().config.bundle_refresh_ms)
        } else {
            RETRY_FETCH
        };
        let due = self
            .last_catalog
            .is_none_or(|t| now.duration_since(t).unwrap_or_default() >= every);
        if due {
            self.last_catalog = Some(now);
            self.fetch(CATALOG_PATH, Fetch::Catalog);
        }
    }

    fn create_http_context(&self, _: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Request {
            shared: self.shared.clone(),
            state: State::Passing,
            session: None,
            ticket: None,
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
    hostcalls::get_map_value(MapType::HttpCallResponseHeaders, ":status")
        .ok()
        .flatten()
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
    shared: Rc<RefCell<Shared>>,
    state: State,
    session: Option<String>,
    /// The sidecar counts this request against its worker until it is reported finished.
    ticket: Option<Ticket>,
}

impl Request {
    fn header(&self, name: &str) -> Option<String> {
        hostcalls::get_map_value(MapType::HttpRequestHeaders, name)
            .ok()
            .flatten()
    }

    fn set_header(&self, name: &str, value: Option<&str>) {
        if hostcalls::set_map_value(MapType::HttpRequestHeaders, name, value).is_err() {
            self.shared.borrow().bump(Counter::HostErrors, 1);
        }
    }

    fn fall_back(&mut self, reason: FallbackReason) -> Action {
        self.shared.borrow().bump(Counter::Fallback(reason), 1);
        self.state = State::Passing;
        Action::Continue
    }

    fn on_hint(&mut self, num_headers: usize, body_size: usize) {
        let status = response_status(num_headers);
        let body = hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
            .ok()
            .flatten()
            .unwrap_or_default();
        // Envoy 1.40 answers a call that ran out of time with a local 504, not with zero
        // headers as older hosts did; both count as timeouts.
        let hint = match status.as_deref() {
            None | Some("504") => {
                self.shared.borrow().bump(Counter::SidecarTimeouts, 1);
                None
            }
            Some("200") => {
                let parsed = serde_json::from_slice::<HintResponse>(&body).ok();
                if parsed.is_none() {
                    self.shared.borrow().bump(Counter::SidecarErrors, 1);
                }
                parsed
            }
            Some(_) => {
                self.shared.borrow().bump(Counter::SidecarErrors, 1);
                None
            }
        };
        match hint {
            None => {
                self.fall_back(FallbackReason::Sidecar);
            }
            Some(hint) => {
                let config = Rc::clone(&self.shared.borrow().config);
                let header = hint.target().map(|target| match target {
                    HintTarget::Instance(id) => (&config.instance_header, id.to_string()),
                    HintTarget::PrefillInstance(id) => {
                        (&config.prefill_instance_header, id.to_string())
                    }
                    HintTarget::Hosts(hosts) => (&config.worker_header, hosts),
                });
                match header {
                    None => {
                        self.fall_back(FallbackReason::NoWorker);
                    }
                    Some((name, value)) => {
                        self.ticket = hint.ticket;
                        self.set_header(name, Some(&value));
                        let shared = self.shared.borrow();
                        shared.bump(Counter::Hinted, 1);
                        shared.bump(Counter::MatchedBlocks, u64::from(hint.matched_blocks));
                    }
                }
            }
        }
        self.state = State::Passing;
        if hostcalls::resume_http_request().is_err() {
            self.shared.borrow().bump(Counter::HostErrors, 1);
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
        let method = self.header(":method");
        let path = self.header(":path");
        if !wants_body(method.as_deref(), path.as_deref()) {
            return Action::Continue;
        }
        let config = {
            let s = self.shared.borrow();
            s.bump(Counter::Requests, 1);
            Rc::clone(&s.config)
        };
        // Only kvroute decides these; a client must not be able to pick a worker.
        self.set_header(&config.worker_header, None);
        self.set_header(&config.key_header, None);
        self.set_header(&config.instance_header, None);
        self.set_header(&config.prefill_instance_header, None);
        if !config.session_header.is_empty() {
            self.session = self.header(&config.session_header);
        }
        let too_large = self
            .header("content-length")
            .and_then(|v| v.trim().parse::<usize>().ok())
            .is_some_and(|len| len > config.max_body_bytes);
        if too_large {
            return self.fall_back(FallbackReason::TooLarge);
        }
        if end_of_stream {
            return self.fall_back(FallbackReason::BadRequest);
        }
        self.state = State::Buffering;
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.state != State::Buffering {
            return Action::Continue;
        }
        if body_size > self.shared.borrow().config.max_body_bytes {
            return self.fall_back(FallbackReason::TooLarge);
        }
        if !end_of_stream {
            return Action::Pause;
        }
        let Ok(Some(body)) = hostcalls::get_buffer(BufferType::HttpRequestBody, 0, body_size)
        else {
            self.shared.borrow().bump(Counter::HostErrors, 1);
            return self.fall_back(FallbackReason::BadRequest);
        };
        let (decision, config) = {
            let s = self.shared.borrow();
            (
                plan(&body, &s.models, &s.config, self.session.as_deref()),
                Rc::clone(&s.config),
            )
        };
        if let Some(key) = &decision.key {
            self.set_header(&config.key_header, Some(key));
        }
        self.shared
            .borrow()
            .bump(Counter::PromptBlocks, decision.blocks as u64);
        if let Some(reason) = decision.fallback {
            return self.fall_back(reason);
        }
        let Some(mut hint) = decision.hint else {
            return self.fall_back(FallbackReason::BadRequest);
        };
        hint.finished = std::mem::take(&mut self.shared.borrow_mut().finished);
        let headers = vec![
            (":method", "POST"),
            (":path", HINT_PATH),
            (":authority", config.sidecar_authority.as_str()),
            ("content-type", HINT_CONTENT_TYPE),
        ];
        let timeout = Duration::from_millis(config.hint_timeout_ms);
        match hostcalls::dispatch_http_call(
            &config.sidecar_cluster,
            headers,
            Some(&hint.encode()),
            vec![],
            timeout,
        ) {
            Ok(_) => {
                self.state = State::AwaitingHint;
                Action::Pause
            }
            Err(_) => {
                self.shared.borrow().bump(Counter::SidecarErrors, 1);
                self.fall_back(FallbackReason::Sidecar)
            }
        }
    }

    /// Envoy logs a stream once it is over (finished, failed or reset): the request no longer
    /// loads its worker.
    fn on_log(&mut self) {
        if let Some(ticket) = self.ticket.take() {
            let mut shared = self.shared.borrow_mut();
            if shared.finished.len() < MAX_UNREPORTED {
                shared.finished.push(ticket);
            }
        }
    }
}
