//! The HTTP headers kvroute routes by, named once: the filter sets them (the names are its
//! configuration's defaults), Envoy or a Dynamo frontend reads them, and the shipped Envoy
//! configurations strip them from what clients send (`kvroute-sidecar envoy-config` renders the
//! names the filter is configured with).

/// Envoy's `override_host` reads the hinted workers from it (`ip:port[,ip:port…]`).
pub const WORKER: &str = "x-kvroute-worker";
/// Envoy's ring hash / maglev hashes on it when there is no hint.
pub const KEY: &str = "x-kvroute-key";
/// A Dynamo frontend serves the request on this instance (pin mode).
pub const INSTANCE: &str = "x-worker-instance-id";
/// A Dynamo frontend prefills the request on this instance (pin mode, disaggregated).
pub const PREFILL_INSTANCE: &str = "x-prefill-instance-id";
/// Envoy's id of a request (set by its connection manager, shown in its access log): the filter
/// sends it with the request's hint call, and `/debug/explain` shows it beside the decision.
pub const REQUEST_ID: &str = "x-request-id";
/// The other headers a Dynamo frontend routes by: no client may set them either.
pub const DYNAMO_ROUTING: [&str; 7] = [
    "x-dynamo-worker-instance-id",
    "x-dynamo-prefill-instance-id",
    "x-dp-rank",
    "x-dynamo-dp-rank",
    "x-prefill-dp-rank",
    "x-dynamo-prefill-dp-rank",
    "x-data-parallel-rank",
];
