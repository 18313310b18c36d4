//! Replicas that behave as one. Every sidecar of a fleet keeps its own index from the same
//! engines' events; on NATS they publish each cache's checkpoints (the digest after each
//! message) and compare them at the same message, hand each other the messages each lost
//! (a fill rebuilds the cache from the state before the first lost one: exactly what
//! in-order application holds), take a peer's snapshot of a cache that lost messages for
//! good, stayed behind, or disagrees at the same message with a copy that lost messages less
//! lately, warm a new replica from its peers, and share their requests in flight.
//!
//! - [`brain`]: every decision, pure: `Brain::on(event, now) -> effects`.
//! - [`peers`]: what this replica knows of its peers, how each cache compares, which copy to
//!   take (pure).
//! - [`wire`]: the messages on NATS and their budgets.
//! - [`plane`]: the NATS loop — reads, hands the brain what happened, executes.
//! - [`disk`]: the index saved on local disk every interval, and read back at start.
//!
//! The record each cache's replication rests on (checkpoints, the last messages, the lost
//! ones and their base) is the core's: `core/digest.rs`, applied in `core/ledger.rs`.

pub mod brain;
pub mod disk;
pub mod peers;
pub mod plane;
pub mod wire;
