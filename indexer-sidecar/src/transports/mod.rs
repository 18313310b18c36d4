//! Where KV events come from: each transport decodes its wire messages and hands them to
//! [`crate::sidecar::Sidecar::ingest`].

pub mod dynamo_zmq;
pub mod nats;
pub mod zmq;
