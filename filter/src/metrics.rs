//! The filter's counters. Envoy exports each as `wasmcustom.<name>` in `/stats`.

/// A counter the filter increments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Counter {
    /// LLM requests the filter handled (POST to a completions path).
    Requests,
    /// Requests sent on with a worker hint.
    Hinted,
    /// Requests sent on without a hint, by reason.
    Fallback(FallbackReason),
    /// Hint calls that failed: no answer in time, or the sidecar unreachable.
    SidecarTimeouts,
    /// Hint calls answered with an error status or an unreadable body.
    SidecarErrors,
    /// Sum of matched blocks over hinted requests.
    MatchedBlocks,
    /// Sum of full blocks over hashed requests.
    PromptBlocks,
    /// Bundles loaded into this VM.
    BundlesLoaded,
    /// Bundles (or catalogs) that could not be fetched or loaded.
    BundleErrors,
    /// Host calls that failed (header writes, resume); the request still goes on.
    HostErrors,
    /// Chat segments whose token ids the token cache had.
    TokenSegmentsFound,
    /// Chat segments tokenized (not in the token cache).
    TokenSegmentsTokenized,
    /// Prompts whose history the token cache found whole (its segments are among the found).
    TokenHistoriesFound,
    /// Hints asked on the hint stream (the others went as HTTP calls).
    HintStreamAsks,
    /// Times the hint stream could not be opened, was given up unanswered, or closed.
    HintStreamDown,
    /// Checks of the token cache against the whole prompt's ids that differed (the cache is
    /// then off for that model in that VM).
    TokenCacheMismatches,
}

/// A time the filter records per request, in microseconds (Envoy's wasm histograms, exported
/// as `wasmcustom.<name>` with quantiles in `/stats` and buckets in `/stats/prometheus`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Timing {
    /// From the whole body read to the hint request planned: parse, template, tokens, hashes.
    PrepareUs,
    /// From the preparation's end (the hint request then encoded and sent) to the sidecar's
    /// answer, as Envoy delivered it to the VM: the request waits paused meanwhile.
    HintPauseUs,
}

impl Timing {
    /// Every timing, for defining them when a VM starts.
    pub const ALL: [Timing; 2] = [Timing::PrepareUs, Timing::HintPauseUs];

    /// The metric name (Envoy prefixes `wasmcustom.`).
    pub fn name(self) -> &'static str {
        match self {
            Timing::PrepareUs => "kvroute.prepare_us",
            Timing::HintPauseUs => "kvroute.hint_pause_us",
        }
    }
}

/// Why a request went on without a hint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FallbackReason {
    /// Body over `max_body_bytes`.
    TooLarge,
    /// The body is not a routable request (bad JSON, no model, empty messages, …).
    BadRequest,
    /// No bundle loaded (yet) for the request's model.
    NoBundle,
    /// The chat template failed.
    Template,
    /// The tokenizer failed.
    Tokenizer,
    /// The prompt is shorter than one block: nothing any engine could have cached.
    NoBlocks,
    /// Hints are disabled in the configuration.
    HintsDisabled,
    /// The sidecar knows no usable worker (all unhealthy or gone).
    NoWorker,
    /// The sidecar did not answer usefully (timeout, down, error).
    Sidecar,
}

impl FallbackReason {
    /// Every reason, for defining the counters up front.
    pub const ALL: [FallbackReason; 9] = [
        FallbackReason::TooLarge,
        FallbackReason::BadRequest,
        FallbackReason::NoBundle,
        FallbackReason::Template,
        FallbackReason::Tokenizer,
        FallbackReason::NoBlocks,
        FallbackReason::HintsDisabled,
        FallbackReason::NoWorker,
        FallbackReason::Sidecar,
    ];

    /// Stable label used in the metric name.
    pub fn label(self) -> &'static str {
        match self {
            FallbackReason::TooLarge => "too_large",
            FallbackReason::BadRequest => "bad_request",
            FallbackReason::NoBundle => "no_bundle",
            FallbackReason::Template => "template",
            FallbackReason::Tokenizer => "tokenizer",
            FallbackReason::NoBlocks => "no_blocks",
            FallbackReason::HintsDisabled => "hints_disabled",
            FallbackReason::NoWorker => "no_worker",
            FallbackReason::Sidecar => "sidecar",
        }
    }
}

impl Counter {
    /// Every counter, for defining them when a VM starts.
    pub fn all() -> impl Iterator<Item = Counter> {
        [
            Counter::Requests,
            Counter::Hinted,
            Counter::SidecarTimeouts,
            Counter::SidecarErrors,
            Counter::MatchedBlocks,
            Counter::PromptBlocks,
            Counter::BundlesLoaded,
            Counter::BundleErrors,
            Counter::HostErrors,
            Counter::TokenSegmentsFound,
            Counter::TokenSegmentsTokenized,
            Counter::TokenHistoriesFound,
            Counter::TokenCacheMismatches,
            Counter::HintStreamAsks,
            Counter::HintStreamDown,
        ]
        .into_iter()
        .chain(FallbackReason::ALL.into_iter().map(Counter::Fallback))
    }

    /// The metric name (Envoy prefixes `wasmcustom.`).
    pub fn name(self) -> String {
        match self {
            Counter::Requests => "kvroute.requests".into(),
            Counter::Hinted => "kvroute.hinted".into(),
            Counter::Fallback(r) => format!("kvroute.fallback.{}", r.label()),
            Counter::SidecarTimeouts => "kvroute.sidecar.timeouts".into(),
            Counter::SidecarErrors => "kvroute.sidecar.errors".into(),
            Counter::MatchedBlocks => "kvroute.matched_blocks".into(),
            Counter::PromptBlocks => "kvroute.prompt_blocks".into(),
            Counter::BundlesLoaded => "kvroute.bundles.loaded".into(),
            Counter::BundleErrors => "kvroute.bundles.errors".into(),
            Counter::HostErrors => "kvroute.host_errors".into(),
            Counter::TokenSegmentsFound => "kvroute.token_cache.found".into(),
            Counter::TokenSegmentsTokenized => "kvroute.token_cache.tokenized".into(),
            Counter::TokenHistoriesFound => "kvroute.token_cache.histories".into(),
            Counter::TokenCacheMismatches => "kvroute.token_cache.mismatches".into(),
            Counter::HintStreamAsks => "kvroute.hint_stream.asks".into(),
            Counter::HintStreamDown => "kvroute.hint_stream.down".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique() {
        let names: std::collections::HashSet<String> = Counter::all().map(Counter::name).collect();
        assert_eq!(names.len(), Counter::all().count());
        assert!(names.contains("kvroute.fallback.no_bundle"));
    }
}
