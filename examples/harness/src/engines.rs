//! What a stack knows of its engines, whichever kind started them (simulated, real Dynamo,
//! real vLLM).

use serde::Deserialize;

/// The model name the demo fleet serves.
pub const MODEL: &str = "tiny-llama";

/// One engine as its fleet reported it.
#[derive(Debug, Clone, Deserialize)]
pub struct EngineInfo {
    /// Position in the fleet.
    pub index: usize,
    /// `127.0.0.1:port`.
    pub address: String,
    /// Dynamo instance id in its events.
    pub dynamo_worker_id: u64,
    /// Its vLLM KV-event PUB socket, when it publishes in vLLM's format.
    #[serde(default)]
    pub zmq_endpoint: Option<String>,
    /// Its vLLM replay socket.
    #[serde(default)]
    pub replay_endpoint: Option<String>,
}
