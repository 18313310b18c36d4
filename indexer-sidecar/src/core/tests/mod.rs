//! The core on its own: inputs in, what happened out, time passed in. The fixtures are here;
//! the tests in one file per concern, named after the file of `core/` it tests: `ingest.rs`,
//! `membership.rs`, `tickets.rs`, `hint.rs`.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use kvroute_protocol::dynamo::RouterEvent;
use kvroute_protocol::hash::token_prefix_hashes;
use kvroute_protocol::hint::{Finished, HintRequest, Ticket, Usage};
use kvroute_protocol::vllm::{EngineBlockHash, EventBatch, VllmEvent};
use kvroute_protocol::{HashSeed, PrefixHash};

use super::*;
use crate::config::{Config, PREFILL_HOME_SLACK_BLOCKS};

mod hint;
mod ingest;
mod membership;
mod tickets;

fn config(extra: &str) -> Config {
    let model = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/models/tiny-llama");
    let text = format!("[[models]]\nname = \"m\"\ndir = \"{model}\"\nblock_size = 16\n{extra}");
    toml::from_str(&text).unwrap()
}

/// A core with model `m` and no configured worker, the captured Dynamo events (of one
/// publisher) and a hint request for the captured prompt.
fn pin_fixture() -> (Core, Vec<RouterEvent>, HintRequest) {
    let samples = kvroute_protocol::samples_dir().join("dynamo");
    let body = std::fs::read(samples.join("kv-events_stored_prompt_4blocks.msgpack")).unwrap();
    let events = kvroute_protocol::dynamo::decode_message(&body)
        .unwrap()
        .events;
    let tokens = kvroute_protocol::golden_dynamo_prompt();
    let req = HintRequest {
        model: "m".into(),
        hashes: token_prefix_hashes(&tokens, 16, HashSeed::default()),
        finished: Vec::new(),
    };
    (Core::new(&config(""), 7), events, req)
}

fn instances(list: &[(u64, u16, Role)]) -> Vec<DiscoveredInstance> {
    list.iter()
        .map(|&(instance_id, port, role)| DiscoveredInstance {
            instance_id,
            address: format!("127.0.0.1:{port}"),
            role,
            component: "dynamo/backend".into(),
            capacity: None,
        })
        .collect()
}

fn discover(core: &mut Core, found: &[DiscoveredInstance], down: &[u64], now: Instant) {
    let unreachable: BTreeSet<u64> = down.iter().copied().collect();
    core.ingest(
        Input::Discovery {
            model: "m",
            instances: found,
            unreachable: &unreachable,
        },
        now,
    );
}

fn events(core: &mut Core, events: &[RouterEvent], now: Instant) -> Vec<Happened> {
    events
        .iter()
        .flat_map(|e| core.ingest(Input::Message(Message::dynamo(e, None)), now))
        .collect()
}

/// A vLLM worker at `127.0.0.1:9000` and a store batch of `blocks` blocks chained after
/// engine hash `parent` (names `first..first+blocks`).
fn vllm_core() -> Core {
    Core::new(
        &config("[[workers]]\naddress = \"127.0.0.1:9000\"\nmodel = \"m\"\n"),
        7,
    )
}

fn store(parent: Option<u64>, first: u64, blocks: u64) -> EventBatch {
    let tokens: Vec<u32> = (0..16 * blocks as u32).collect();
    store_tokens(parent, first, &tokens)
}

/// A store batch of `tokens` (16 a block) chained after engine hash `parent` (names `first..`).
fn store_tokens(parent: Option<u64>, first: u64, tokens: &[u32]) -> EventBatch {
    let blocks = tokens.len() as u64 / 16;
    EventBatch {
        events: vec![VllmEvent::BlockStored {
            block_hashes: (first..first + blocks).map(EngineBlockHash).collect(),
            parent: parent.map(EngineBlockHash),
            token_ids: tokens.iter().copied().collect(),
            block_size: 16,
            lora_name: None,
            medium: None,
            has_extra_keys: Default::default(),
            group: None,
            kind: None,
        }],
        ..EventBatch::default()
    }
}

fn vllm(core: &mut Core, seq: u64, delivery: Delivery, batch: &EventBatch) -> Vec<Happened> {
    vllm_at(core, seq, delivery, batch, Instant::now())
}

/// [`vllm`] at `at`.
fn vllm_at(
    core: &mut Core,
    seq: u64,
    delivery: Delivery,
    batch: &EventBatch,
    at: Instant,
) -> Vec<Happened> {
    let m = Message::vllm("127.0.0.1:9000", seq, delivery, batch);
    core.ingest(Input::Message(m), at)
}

fn held(happened: &[Happened]) -> Option<(u64, u64)> {
    happened.iter().find_map(|h| match h {
        Happened::Held { from, to, .. } => Some((*from, *to)),
        _ => None,
    })
}

fn blocks(core: &Core) -> usize {
    core.index("m").unwrap().blocks_of(WorkerId(0))
}

/// A request for model `m` of one block no worker holds.
fn one_block_request() -> HintRequest {
    HintRequest {
        model: "m".into(),
        hashes: vec![PrefixHash(1)],
        finished: Vec::new(),
    }
}

/// Requests the first worker is busy with.
fn busy(core: &Core) -> f64 {
    core.fleet().get(WorkerId(0)).unwrap().current_load().busy()
}
