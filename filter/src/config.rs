//! The filter's plugin configuration.

use kvroute_protocol::headers;
use serde::Deserialize;

/// Plugin configuration, given as JSON in Envoy's wasm `PluginConfig.configuration`.
/// Every field has a default, so `{}` is a valid configuration.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FilterConfig {
    /// Envoy cluster of the sidecar.
    pub sidecar_cluster: String,
    /// `:authority` sent to the sidecar.
    pub sidecar_authority: String,
    /// How long a request may wait for a hint before it goes on unhinted.
    pub hint_timeout_ms: u64,
    /// Ask the sidecar for hints; `false` leaves only the fallback key (ring-hash-only mode).
    pub hints: bool,
    /// Ask on one long-lived gRPC stream per Envoy worker thread (`/kvroute.Hints/Stream`;
    /// the sidecar cluster is HTTP/2 as shipped) rather than with an HTTP call per request: Envoy
    /// spends a fraction of a call's CPU on a message. While the stream is down (opening, the
    /// sidecar restarting or older than the stream), hints go as HTTP calls.
    pub hint_stream: bool,
    /// Header read by Envoy's override_host policy.
    pub worker_header: String,
    /// Header the route's ring-hash/maglev hash policy reads.
    pub key_header: String,
    /// Header naming the Dynamo instance in pin mode (a Dynamo frontend serves it there).
    pub instance_header: String,
    /// Header naming the prefill instance in pin mode with disaggregated prefill/decode (the
    /// frontend prefills there and picks the decode worker itself).
    pub prefill_instance_header: String,
    /// Bodies larger than this are not buffered or parsed; they go on unhinted.
    pub max_body_bytes: usize,
    /// The fallback key is the prefix hash of this many leading blocks (or fewer, if shorter)…
    pub fallback_key_blocks: usize,
    /// …unless the request names a session: this header (empty: none), else the OpenAI `user`
    /// field. Then the key is the session, so its turns stick together without the sidecar.
    pub session_header: String,
    /// How often each VM checks the sidecar's catalog for new or changed bundles.
    pub bundle_refresh_ms: u64,
    /// Read each hinted response's `usage` as it passes (cached and prompt tokens, reported
    /// to the sidecar beside its prediction); `false` reports finished requests only.
    pub read_usage: bool,
    /// Of the hinted responses that stream (server-sent events), read one in this many (1:
    /// every one). Reading costs a host call per streamed chunk — 3–5 µs of Envoy's CPU in V8,
    /// 0.4–0.6 ms for a 128-token answer (docs/benchmarks.md) — where a JSON answer costs one
    /// or two; the streams not read are reported as `unread`, so the sidecar's comparison of
    /// predicted and reported cached tokens is a sample of them.
    pub stream_usage_every: u32,
    /// …and besides, at least this many streams a second per VM when there are (0: the count
    /// alone): a quiet proxy reads every stream, so the per-replica comparison of predicted
    /// and reported cached tokens has enough of them; the cost is bounded at this many reads
    /// a second (a 128-token stream: ~0.5 ms of CPU each).
    pub stream_usage_min_per_s: u32,
    /// Bytes of token ids each VM keeps per model of the chat segments it has seen (a
    /// conversation's history, a shared system prompt), so a turn tokenizes only what is new
    /// (`kvroute_prompt::segments`); 0: off.
    pub token_cache_bytes: usize,
    /// Tests only: a request carrying this header makes the VM trap, as a bug would, so that
    /// Envoy's handling of a failed VM (`failure_policy`) can be checked. Empty (the default):
    /// off. Never set it in production.
    pub test_trap_header: String,
}

/// The largest body the filter may buffer: the shipped routes' `request_body_buffer_limit`
/// (16 MiB) less one socket read, so a body still being buffered never hits Envoy's 413.
pub const MAX_BODY_BYTES: usize = (16 << 20) - (1 << 20);

impl Default for FilterConfig {
    fn default() -> Self {
        FilterConfig {
            sidecar_cluster: "kvroute_sidecar".into(),
            sidecar_authority: "kvroute-sidecar".into(),
            hint_timeout_ms: 50,
            hints: true,
            hint_stream: true,
            worker_header: headers::WORKER.into(),
            key_header: headers::KEY.into(),
            instance_header: headers::INSTANCE.into(),
            prefill_instance_header: headers::PREFILL_INSTANCE.into(),
            max_body_bytes: 4 << 20,
            fallback_key_blocks: 8,
            session_header: "x-session-id".into(),
            bundle_refresh_ms: 5000,
            read_usage: true,
            stream_usage_every: 32,
            stream_usage_min_per_s: 4,
            token_cache_bytes: 8 << 20,
            test_trap_header: String::new(),
        }
    }
}

impl FilterConfig {
    /// Parse the plugin configuration (empty means all defaults) and refuse values that would
    /// hang or fail requests, naming the field.
    pub fn parse(bytes: &[u8]) -> Result<Self, String> {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(FilterConfig::default());
        }
        let config: FilterConfig = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), String> {
        // Envoy reads a zero call timeout as none: a hung sidecar would hang every request.
        if !(1..=10_000).contains(&self.hint_timeout_ms) {
            return Err(format!(
                "hint_timeout_ms = {}: must be 1..=10000",
                self.hint_timeout_ms
            ));
        }
        if self.max_body_bytes > MAX_BODY_BYTES {
            return Err(format!(
                "max_body_bytes = {}: the shipped routes buffer at most {} bytes \
                 (request_body_buffer_limit, 16 MiB, less a socket read); above it Envoy answers 413",
                self.max_body_bytes, MAX_BODY_BYTES
            ));
        }
        if self.stream_usage_every == 0 {
            return Err(
                "stream_usage_every must be at least 1 (read_usage = false reads none)".into(),
            );
        }
        if self.fallback_key_blocks == 0 {
            return Err("fallback_key_blocks must be at least 1".into());
        }
        if self.bundle_refresh_ms < 100 {
            return Err(format!(
                "bundle_refresh_ms = {}: must be at least 100",
                self.bundle_refresh_ms
            ));
        }
        for (name, header) in [
            ("worker_header", &self.worker_header),
            ("key_header", &self.key_header),
            ("instance_header", &self.instance_header),
            ("prefill_instance_header", &self.prefill_instance_header),
        ] {
            if header.is_empty() || header.chars().any(|c| c.is_ascii_uppercase()) {
                return Err(format!(
                    "{name} = {header:?}: must be a non-empty lowercase header name"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_that_would_hang_or_fail_requests_are_refused() {
        for (json, field) in [
            (r#"{"hint_timeout_ms": 0}"#, "hint_timeout_ms"),
            (r#"{"max_body_bytes": 17000000}"#, "max_body_bytes"),
            (r#"{"fallback_key_blocks": 0}"#, "fallback_key_blocks"),
            (r#"{"bundle_refresh_ms": 0}"#, "bundle_refresh_ms"),
            (r#"{"worker_header": ""}"#, "worker_header"),
            (r#"{"key_header": "X-Key"}"#, "key_header"),
        ] {
            let e = FilterConfig::parse(json.as_bytes()).unwrap_err();
            assert!(e.contains(field), "{json}: {e}");
        }
    }

    #[test]
    fn defaults_and_overrides() {
        assert_eq!(FilterConfig::parse(b"").unwrap(), FilterConfig::default());
        assert_eq!(FilterConfig::parse(b"{}").unwrap(), FilterConfig::default());
        let c =
            FilterConfig::parse(br#"{"hints": false, "hint_timeout_ms": 20, "read_usage": false}"#)
                .unwrap();
        assert!(!c.hints);
        assert!(!c.read_usage && FilterConfig::default().read_usage);
        assert_eq!(c.hint_timeout_ms, 20);
        assert_eq!(c.worker_header, "x-kvroute-worker");
        assert!(
            FilterConfig::parse(br#"{"hint_timeout": 20}"#).is_err(),
            "typos are errors"
        );
    }
}
