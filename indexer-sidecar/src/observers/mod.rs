//! What else feeds the fleet: Dynamo's discovery records (which workers exist), Envoy's admin
//! view (which are healthy, how busy; with `[[envoy.members]]`, which exist), engine `/metrics` scrapes (load). Each polls, then hands
//! what it saw to [`crate::sidecar::Sidecar::ingest`].

pub mod discovery;
pub mod engine_metrics;
pub mod envoy_admin;
pub mod etcd;
pub mod membership;
