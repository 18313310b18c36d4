//! kvroute-sim: simulated LLM engines that behave, on the wire, like vLLM.
//!
//! Only the GPU is fake. Each engine tokenizes with the model's real tokenizer and template (the
//! same [`kvroute_prompt`] code as the filter), keeps a paged prefix cache with a capacity where,
//! as in vLLM's block pool, running requests pin their blocks and only idle ones are evicted
//! ([`cache`]), admits waiting requests first come first served when their new blocks fit,
//! charges latency per *uncached* prompt token and per output token ([`engine`]), answers the
//! OpenAI API with `usage.prompt_tokens_details.cached_tokens` and vLLM-named metrics
//! ([`server`]), and publishes
//! its cache events in Dynamo's exact NATS format ([`publish`]) or vLLM's ZMQ format, with a
//! working replay socket and vLLM's own block hashes ([`zmq`], [`vllm_hash`]), as late as real
//! engines publish them when asked to ([`delay`]).
//!
//! It also answers an oracle query (`POST /oracle`: how many leading blocks of this request do
//! you hold?) so benchmarks can compare routing against perfect knowledge.

pub mod cache;
pub mod delay;
pub mod engine;
pub mod gpu;
pub mod publish;
pub mod server;
pub mod vllm_hash;
pub mod zmq;

pub use engine::{Engine, EngineConfig};
