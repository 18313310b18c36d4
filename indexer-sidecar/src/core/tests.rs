//! The core on its own: inputs in, what happened out, time passed in.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use kvroute_protocol::dynamo::RouterEvent;
use kvroute_protocol::hash::token_prefix_hashes;
use kvroute_protocol::hint::{Finished, HintRequest, Ticket, Usage};
use kvroute_protocol::vllm::{EngineBlockHash, EventBatch, VllmEvent};
use kvroute_protocol::{HashSeed, PrefixHash};

use super::*;
use crate::config::{Config, PREFILL_HOME_SLACK_BLOCKS};

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

/// A running request's prompt counts as held by its worker; the engine's reports teach the
/// rule how much of an idle match is still there when a request arrives.
#[test]
fn reports_teach_how_much_of_an_idle_match_survives() {
    let (mut core, evs, req) = pin_fixture();
    let now = Instant::now();
    let publisher = evs[0].worker_id;
    let one = instances(&[(publisher, 40051, Role::Aggregated)]);
    discover(&mut core, &one, &[], now);
    events(&mut core, &evs, now);
    let first = core.hint(&req, now).unwrap();
    let held = |h: &Hint| {
        let c = &h.decision.candidates[0];
        (c.matched_blocks, c.in_flight_blocks, c.survival)
    };
    assert_eq!(held(&first), (4, 0, 1.0), "trusted before any report");
    assert_eq!(first.decision.candidates[0].home_slack_blocks, None);
    let second = core.hint(&req, now).unwrap();
    assert_eq!(
        held(&second),
        (4, 4, 1.0),
        "the first request holds all four"
    );
    // `/debug/explain` shows each of the candidate's fields once, its load's flattened beside.
    let shown = serde_json::to_string(&second.decision.candidates[0]).unwrap();
    assert!(shown.contains("\"in_flight_blocks\":4"), "{shown}");
    assert_eq!(shown.matches("\"in_flight_blocks\"").count(), 1, "{shown}");
    assert!(shown.contains("\"running_prompt_blocks\":"), "{shown}");
    // Both finish; the engine found none of the four blocks cached for the first, which had
    // counted on idle blocks (the second counted on the first's, which says nothing of them).
    let nothing = |h: &Hint| Finished {
        ticket: h.ticket.unwrap(),
        usage: Usage::Cached {
            prompt_tokens: 70,
            cached_tokens: 0,
        },
    };
    core.ingest(Input::Finished(&[nothing(&first), nothing(&second)]), now);
    let third = core.hint(&req, now).unwrap();
    assert_eq!(held(&third), (4, 0, 0.0));
}

/// Instances found through discovery are hinted by instance id, not while their probe fails
/// and not once their record is gone; the captured Dynamo prompt steers to the instance that
/// stored it.
#[test]
fn discovered_instances_are_pinned_until_their_record_goes() {
    let (mut core, evs, req) = pin_fixture();
    let now = Instant::now();
    let publisher = evs[0].worker_id;
    let other = 77;
    let both = instances(&[
        (publisher, 40051, Role::Aggregated),
        (other, 40052, Role::Aggregated),
    ]);
    discover(&mut core, &both, &[], now);
    discover(&mut core, &both, &[], now);
    assert_eq!(core.fleet().len(), 2, "each instance is added once");
    events(&mut core, &evs, now);
    let hint = core.hint(&req, now).unwrap();
    assert_eq!(hint.target, Target::Instance(publisher));
    assert_eq!(hint.decision.matched_blocks, 4);
    assert!(hint.ticket.is_some());

    // Its request plane refuses connections: not pinned until it answers again.
    discover(&mut core, &both, &[publisher], now);
    let elsewhere = core.hint(&req, now).unwrap();
    assert_eq!(elsewhere.target, Target::Instance(other));
    // That request finished (while it ran, `other` held the prompt too).
    let report = Finished {
        ticket: elsewhere.ticket.unwrap(),
        usage: Usage::Unanswered,
    };
    core.ingest(Input::Finished(&[report]), now);
    discover(&mut core, &both, &[], now);
    assert_eq!(
        core.hint(&req, now).unwrap().target,
        Target::Instance(publisher)
    );

    let only_other = instances(&[(other, 40052, Role::Aggregated)]);
    discover(&mut core, &only_other, &[], now);
    for _ in 0..5 {
        assert_eq!(
            core.hint(&req, now).unwrap().target,
            Target::Instance(other),
            "the departed instance is not hinted"
        );
    }
    // Past the grace period its entries go.
    let later = now + Duration::from_secs(31);
    let happened = {
        let unreachable = BTreeSet::new();
        core.ingest(
            Input::Discovery {
                model: "m",
                instances: &only_other,
                unreachable: &unreachable,
            },
            later,
        )
    };
    assert!(
        happened.iter().any(|h| matches!(
            h,
            Happened::Forgot {
                why: Forgot::Unusable,
                blocks: 4,
                ..
            }
        )),
        "{happened:?}"
    );
}

/// Disaggregated: the prefill worker holding the prefix is pinned with the prefill header;
/// decode workers, which publish no KV events, are never hinted, warm prompt or cold.
#[test]
fn disaggregated_fleets_pin_the_prefill_worker() {
    let (mut core, evs, mut req) = pin_fixture();
    let now = Instant::now();
    let prefill = evs[0].worker_id;
    let (cold_prefill, decode) = (78, 79);
    let fleet = instances(&[
        (prefill, 40051, Role::Prefill),
        (cold_prefill, 40052, Role::Prefill),
        (decode, 40053, Role::Decode),
    ]);
    let unreachable = BTreeSet::new();
    let happened = core.ingest(
        Input::Discovery {
            model: "m",
            instances: &fleet,
            unreachable: &unreachable,
        },
        now,
    );
    assert_eq!(core.fleet().len(), 2, "decode workers are not added");
    assert!(happened.contains(&Happened::Scanned {
        model: "m".into(),
        roles: [(Role::Aggregated, 0), (Role::Prefill, 2), (Role::Decode, 1)],
    }));
    events(&mut core, &evs, now);
    let hint = core.hint(&req, now).unwrap();
    assert_eq!(hint.target, Target::Prefill(prefill), "{hint:?}");
    req.hashes.truncate(0);
    req.hashes.push(PrefixHash(12345));
    for _ in 0..4 {
        let cold = core.hint(&req, now).unwrap();
        assert!(
            cold.target == Target::Prefill(prefill) || cold.target == Target::Prefill(cold_prefill),
            "cold prompts go to a prefill worker: {cold:?}"
        );
        // Prefill workers weigh the prompt blocks in flight by default.
        let slack = Some(PREFILL_HOME_SLACK_BLOCKS);
        let candidates = &cold.decision.candidates;
        assert!(
            candidates.iter().all(|c| c.home_slack_blocks == slack),
            "{cold:?}"
        );
    }
    // The response's usage is the decode worker's cache, not the prefill worker's: counted,
    // never set against the prediction (a stale_index that is not).
    let report = Finished {
        ticket: hint.ticket.unwrap(),
        usage: Usage::Cached {
            prompt_tokens: 70,
            cached_tokens: 0,
        },
    };
    let happened = core.ingest(Input::Finished(&[report]), now);
    assert!(
        happened.iter().any(|h| matches!(
            h,
            Happened::Served {
                prediction: None,
                ..
            }
        )),
        "{happened:?}"
    );
    let w = core
        .fleet()
        .iter()
        .find(|w| w.instance_id == Some(prefill))
        .unwrap();
    assert_eq!((w.truth.requests[4], w.truth.compared()), (1, 0));
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
    EventBatch {
        events: vec![VllmEvent::BlockStored {
            block_hashes: (first..first + blocks).map(EngineBlockHash).collect(),
            parent: parent.map(EngineBlockHash),
            token_ids: (0..16 * blocks as u32).collect(),
            block_size: 16,
            lora_name: None,
            medium: None,
            has_extra_keys: vec![],
            group: None,
            kind: None,
        }],
        ..EventBatch::default()
    }
}

fn vllm(core: &mut Core, seq: u64, delivery: Delivery, batch: &EventBatch) -> Vec<Happened> {
    let m = Message::vllm("127.0.0.1:9000", seq, delivery, batch);
    core.ingest(Input::Message(m), Instant::now())
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

/// A gap on a replayable stream holds the message; the missing ones and then the held one are
/// applied in order. Without a replay, the worker starts over from the held message.
#[test]
fn gaps_are_held_filled_or_resynced() {
    let mut core = vllm_core();
    let now = Instant::now();
    assert_eq!(
        held(&vllm(
            &mut core,
            0,
            Delivery::LiveHoldingGaps,
            &store(None, 0, 2)
        )),
        None
    );
    let late = store(Some(3), 4, 1);
    assert_eq!(
        held(&vllm(&mut core, 3, Delivery::LiveHoldingGaps, &late)),
        Some((1, 3))
    );
    assert_eq!(blocks(&core), 2, "the held message waits");
    vllm(&mut core, 1, Delivery::Replayed, &store(Some(1), 2, 1));
    vllm(&mut core, 2, Delivery::Replayed, &store(Some(2), 3, 1));
    vllm(&mut core, 3, Delivery::Replayed, &late);
    assert_eq!(blocks(&core), 5);
    assert_eq!(
        held(&vllm(&mut core, 9, Delivery::LiveHoldingGaps, &late)),
        Some((4, 9))
    );
    let happened = core.ingest(
        Input::GapUnfilled(Publisher::Address("127.0.0.1:9000")),
        now,
    );
    assert!(happened.iter().any(|h| matches!(
        h,
        Happened::Forgot {
            why: Forgot::Resync,
            blocks: 5,
            ..
        }
    )));
    let again = vllm(&mut core, 9, Delivery::Replayed, &store(None, 10, 1));
    assert_eq!(held(&again), None);
    assert_eq!(blocks(&core), 1, "started over from the held message");
}

/// A warm start replaces the index with the replay buffer; live copies of replayed messages are
/// duplicates; a counter going back afterwards is a restart.
#[test]
fn warm_starts_replace_and_restarts_forget() {
    let mut core = vllm_core();
    vllm(
        &mut core,
        0,
        Delivery::LiveHoldingGaps,
        &store(None, 100, 3),
    );
    for seq in 0..=2 {
        vllm(
            &mut core,
            seq,
            Delivery::WarmStart,
            &store(None, seq * 10, 1),
        );
    }
    assert_eq!(blocks(&core), 3, "the replay replaced what was indexed");
    let dup = vllm(&mut core, 2, Delivery::LiveHoldingGaps, &store(None, 50, 1));
    assert!(dup.iter().any(|h| matches!(
        h,
        Happened::Sequence {
            verdict: Verdict::Duplicate,
            ..
        }
    )));
    assert_eq!(blocks(&core), 3, "a duplicate is not applied");
    vllm(&mut core, 3, Delivery::LiveHoldingGaps, &store(None, 60, 1));
    assert_eq!(blocks(&core), 4);
    let restart = vllm(&mut core, 0, Delivery::LiveHoldingGaps, &store(None, 70, 1));
    assert!(restart.iter().any(|h| matches!(
        h,
        Happened::Forgot {
            why: Forgot::Restarted,
            blocks: 4,
            ..
        }
    )));
    assert_eq!(blocks(&core), 1);
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

/// Tickets count against the hinted worker until reported; a report is taken once.
#[test]
fn tickets_follow_hints_and_reports() {
    let mut core = vllm_core();
    let now = Instant::now();
    let req = one_block_request();
    let hint = core.hint(&req, now).unwrap();
    assert_eq!(
        hint.target,
        Target::Addresses(vec![std::sync::Arc::from("127.0.0.1:9000")])
    );
    let ticket = hint.ticket.unwrap();
    assert_eq!(busy(&core), 1.0);
    let report = Finished {
        ticket,
        usage: Usage::Missing,
    };
    let done = HintRequest {
        finished: vec![report, report],
        ..req
    };
    let again = core.hint(&done, now).unwrap();
    assert!(again.happened.contains(&Happened::Tickets {
        how: TicketClosed::Finished,
        n: 1
    }));
    assert!(again.happened.contains(&Happened::Tickets {
        how: TicketClosed::Unknown,
        n: 1
    }));
    assert_eq!(busy(&core), 1.0, "one closed, one opened");
    assert!(core
        .hint(
            &HintRequest {
                model: "other".into(),
                hashes: vec![],
                finished: vec![]
            },
            now
        )
        .is_err());
}

/// A scrape that does not count a request yet, a second after its hint (a busy engine's API
/// server still had it), leaves its ticket open; one after the engine surely had it reclaims it.
#[test]
fn tickets_are_reclaimed_only_once_their_requests_surely_reached_the_engine() {
    let mut core = vllm_core();
    let now = Instant::now();
    core.hint(&one_block_request(), now).unwrap();
    let scrape = |asked| Input::Scrape {
        worker: WorkerId(0),
        load: Some(Load::default()),
        capacity: None,
        asked,
    };
    let soon = now + Duration::from_secs(1);
    core.ingest(scrape(soon), soon);
    assert_eq!(busy(&core), 1.0, "not at the engine yet, still running");
    let later = now + load::REACHES_ENGINE_WITHIN + Duration::from_millis(1);
    let happened = core.ingest(scrape(later), later);
    assert!(happened.contains(&Happened::Tickets {
        how: TicketClosed::Reclaimed,
        n: 1
    }));
    assert_eq!(busy(&core), 0.0);
}

/// Envoy's view: a worker it does not list is not hinted; one it lists as healthy is again.
#[test]
fn envoy_decides_who_is_usable() {
    let mut core = vllm_core();
    let now = Instant::now();
    let req = one_block_request();
    let none = std::collections::HashMap::new();
    let happened = core.ingest(Input::EnvoyView(&none), now);
    assert!(matches!(
        happened[0],
        Happened::Usable {
            usable: false,
            changed: true,
            ..
        }
    ));
    assert_eq!(core.hint(&req, now).unwrap().target, Target::None);
    let healthy = [(
        "127.0.0.1:9000".to_owned(),
        HostView {
            healthy: true,
            rq_active: 2.0,
        },
    )]
    .into();
    core.ingest(Input::EnvoyView(&healthy), now);
    assert!(matches!(
        core.hint(&req, now).unwrap().target,
        Target::Addresses(_)
    ));
}

/// Hosts of an Envoy members cluster join as workers hinted by address; one EDS removes is
/// not hinted and, after the grace period, loses its entries; a configured worker stays one.
#[test]
fn envoy_members_join_and_leave() {
    let mut core = vllm_core();
    let now = Instant::now();
    let hosts = ["127.0.0.1:9000".to_string(), "127.0.0.1:9100".to_string()];
    let happened = core.ingest(
        Input::Members {
            model: "m",
            hosts: &hosts,
        },
        now,
    );
    let joined: Vec<_> = happened
        .iter()
        .filter_map(|h| match h {
            Happened::Joined { worker, .. } => Some(worker.address.to_string()),
            _ => None,
        })
        .collect();
    assert_eq!(
        joined,
        vec!["127.0.0.1:9100".to_string()],
        "the configured one stays"
    );
    assert!(core
        .ingest(
            Input::Members {
                model: "m",
                hosts: &hosts
            },
            now
        )
        .is_empty());
    let member = core.fleet().by_address("127.0.0.1:9100").unwrap().id;
    assert_eq!(
        core.fleet().get(member).unwrap().origin,
        fleet::Origin::Member
    );
    let batch = store(None, 1, 1);
    let m = Message::vllm("127.0.0.1:9100", 0, Delivery::LiveHoldingGaps, &batch);
    core.ingest(Input::Message(m), now);
    assert_eq!(core.index("m").unwrap().blocks_of(member), 1);
    let view = |listed: &[String]| -> std::collections::HashMap<String, HostView> {
        listed
            .iter()
            .map(|h| {
                let v = HostView {
                    healthy: true,
                    rq_active: 0.0,
                };
                (h.clone(), v)
            })
            .collect()
    };
    core.ingest(Input::EnvoyView(&view(&hosts)), now);
    let req = HintRequest {
        model: "m".into(),
        hashes: token_prefix_hashes(&(0..16).collect::<Vec<u32>>(), 16, HashSeed::default()),
        finished: Vec::new(),
    };
    match core.hint(&req, now).unwrap().target {
        Target::Addresses(a) => assert_eq!(&*a[0], "127.0.0.1:9100"),
        other => panic!("{other:?}"),
    }
    // EDS removes it: never hinted again; its entries go after the grace period.
    core.ingest(Input::EnvoyView(&view(&hosts[..1])), now);
    match core.hint(&req, now).unwrap().target {
        Target::Addresses(a) => assert!(a.iter().all(|a| &**a != "127.0.0.1:9100")),
        other => panic!("{other:?}"),
    }
    assert_eq!(core.index("m").unwrap().blocks_of(member), 1);
    let later = now + Duration::from_secs(31);
    core.ingest(Input::EnvoyView(&view(&hosts[..1])), later);
    assert_eq!(core.index("m").unwrap().blocks_of(member), 0);
}

/// A hint names only workers of the request's model, cold prompt or warm.
#[test]
fn hints_name_only_workers_of_the_requested_model() {
    let model = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/models/tiny-llama");
    let mut core = Core::new(
        &config(&format!(
            "[[models]]\nname = \"b\"\ndir = \"{model}\"\nblock_size = 16\n\
         [[workers]]\naddress = \"127.0.0.1:9000\"\nmodel = \"m\"\n\
         [[workers]]\naddress = \"127.0.0.1:9001\"\nmodel = \"b\"\n"
        )),
        7,
    );
    let b_worker: std::sync::Arc<str> = "127.0.0.1:9001".into();
    // Model b's worker holds the prompt; model m's request must not go there.
    let batch = store(None, 0, 2);
    let m = Message::vllm("127.0.0.1:9001", 0, Delivery::LiveHoldingGaps, &batch);
    core.ingest(Input::Message(m), Instant::now());
    let warm = token_prefix_hashes(&(0..32).collect::<Vec<u32>>(), 16, HashSeed::default());
    for hashes in [warm.clone(), vec![PrefixHash(7)], vec![PrefixHash(8)]] {
        let req = HintRequest {
            model: "m".into(),
            hashes: hashes.clone(),
            finished: Vec::new(),
        };
        let hint = core.hint(&req, Instant::now()).unwrap();
        assert_eq!(
            hint.target,
            Target::Addresses(vec!["127.0.0.1:9000".into()]),
            "{hashes:?}"
        );
        let for_b = HintRequest {
            model: "b".into(),
            ..req
        };
        let hint = core.hint(&for_b, Instant::now()).unwrap();
        assert_eq!(hint.target, Target::Addresses(vec![b_worker.clone()]));
    }
}

/// A discovered worker is never scraped: its tickets expire on the clock alone.
#[test]
fn tickets_expire_without_scrapes() {
    let (mut core, _, req) = pin_fixture();
    let now = Instant::now();
    discover(
        &mut core,
        &instances(&[(5, 40051, Role::Aggregated)]),
        &[],
        now,
    );
    for _ in 0..3 {
        core.hint(&req, now).unwrap();
    }
    assert_eq!(busy(&core), 3.0);
    assert!(core.ingest(Input::Tick, now).is_empty(), "nothing old yet");
    let later = now + load::TICKET_LIFETIME;
    let happened = core.ingest(Input::Tick, later);
    assert!(happened.contains(&Happened::Tickets {
        how: TicketClosed::Expired,
        n: 3
    }));
    assert_eq!(busy(&core), 0.0);
}

/// The same Dynamo event twice (a redelivery, overlapping subscriptions) is a duplicate:
/// dropped and counted, the worker's entries kept.
#[test]
fn a_repeated_event_is_a_duplicate_not_a_restart() {
    let (mut core, evs, req) = pin_fixture();
    let now = Instant::now();
    discover(
        &mut core,
        &instances(&[(evs[0].worker_id, 40051, Role::Aggregated)]),
        &[],
        now,
    );
    for e in &evs {
        for _ in 0..2 {
            let happened = core.ingest(Input::Message(Message::dynamo(e, None)), now);
            assert!(
                !happened
                    .iter()
                    .any(|h| matches!(h, Happened::Forgot { .. })),
                "{happened:?}"
            );
        }
    }
    assert_eq!(core.hint(&req, now).unwrap().decision.matched_blocks, 4);
}

/// vLLM numbers each data-parallel rank's messages on its own socket: two ranks of one worker
/// both starting at 0 are two streams, not a restart.
#[test]
fn each_vllm_rank_has_its_own_cursor() {
    let mut core = vllm_core();
    let rank = |dp_rank: u32, first: u64| EventBatch {
        dp_rank,
        ..store(None, first, 1)
    };
    for seq in 0..3 {
        for r in 0..2 {
            let batch = rank(r, 100 * u64::from(r) + seq * 10);
            let happened = vllm(&mut core, seq, Delivery::LiveHoldingGaps, &batch);
            assert!(
                !happened
                    .iter()
                    .any(|h| matches!(h, Happened::Sequence { .. } | Happened::Forgot { .. })),
                "rank {r} seq {seq}: {happened:?}"
            );
        }
    }
    assert_eq!(blocks(&core), 6);
}

/// Dynamo events name their worker in the payload, which any publisher can write: a message
/// on another component's subject than the worker's is refused, so it cannot wipe the worker
/// (`event_id` 0 reads as a restart) or fake its prefixes. A configured worker without a
/// component is bound to the first one it is seen on.
#[test]
fn events_on_another_components_subject_are_refused() {
    let (mut core, evs, req) = pin_fixture();
    let now = Instant::now();
    let id = evs[0].worker_id;
    discover(
        &mut core,
        &instances(&[(id, 40051, Role::Aggregated)]),
        &[],
        now,
    );
    let on = |core: &mut Core, e: &RouterEvent, component: &str| {
        core.ingest(Input::Message(Message::dynamo(e, Some(component))), now)
    };
    for e in &evs {
        on(&mut core, e, "dynamo/backend");
    }
    assert_eq!(core.hint(&req, now).unwrap().decision.matched_blocks, 4);
    let mut wipe = evs[0].clone();
    wipe.event.event_id = 0;
    wipe.event.data = kvroute_protocol::dynamo::KvCacheEventData::Cleared;
    let happened = on(&mut core, &wipe, "evil/backend");
    assert!(
        happened.iter().any(|h| matches!(
            h,
            Happened::Rejected { why: Rejected::WrongComponent { expected, got }, .. }
                if expected == "dynamo/backend" && got == "evil/backend"
        )),
        "{happened:?}"
    );
    assert!(!happened
        .iter()
        .any(|h| matches!(h, Happened::Forgot { .. })));
    assert_eq!(core.hint(&req, now).unwrap().decision.matched_blocks, 4);
    let load = kvroute_protocol::dynamo::KvMetrics {
        worker_id: id,
        dp_rank: 0,
        active_decode_blocks: None,
        active_prefill_tokens: Some(1 << 40),
        kv_used_blocks: None,
    };
    let forged = core.ingest(
        Input::DynamoLoad {
            metrics: &load,
            component: Some("evil/backend"),
        },
        now,
    );
    assert!(forged
        .iter()
        .any(|h| matches!(h, Happened::Rejected { .. })));

    // A configured worker: bound to its first component.
    let mut core = Core::new(
        &config(&format!(
            "[[workers]]\naddress = \"127.0.0.1:9000\"\nmodel = \"m\"\ndynamo_worker_id = {id}\n"
        )),
        7,
    );
    let first = on(&mut core, &evs[0], "dynamo/prefill");
    assert!(first
        .iter()
        .any(|h| matches!(h, Happened::Bound { component, .. } if component == "dynamo/prefill")));
    let mut next = evs[0].clone();
    next.event.event_id += 1;
    let later = on(&mut core, &next, "dynamo/backend");
    assert!(later.iter().any(|h| matches!(h, Happened::Rejected { .. })));
}

/// A worker has at most `max_ranks_per_worker` caches: further ranks are refused, in events
/// and in `kv_metrics`.
#[test]
fn ranks_per_worker_are_bounded() {
    let mut core = Core::new(
        &config("[index]\nmax_ranks_per_worker = 2\n[[workers]]\naddress = \"127.0.0.1:9000\"\nmodel = \"m\"\n"),
        7,
    );
    for r in 0..4u32 {
        let batch = EventBatch {
            dp_rank: r,
            ..store(None, u64::from(r) * 10, 1)
        };
        let happened = vllm(&mut core, 0, Delivery::LiveHoldingGaps, &batch);
        let refused = happened.iter().any(|h| {
            matches!(h, Happened::Rejected { why: Rejected::TooManyRanks { rank, limit: 2 }, .. } if *rank == r)
        });
        assert_eq!(refused, r >= 2, "rank {r}: {happened:?}");
    }
    assert_eq!(blocks(&core), 2);
    assert_eq!(core.fleet().get(WorkerId(0)).unwrap().cursors.len(), 2);
}

/// A cache never holds more than its engine's capacity: configured, then what the engine's
/// scrape says (which wins); past it the oldest blocks go.
#[test]
fn caches_hold_at_most_their_capacity() {
    let mut core = Core::new(
        &config("[[workers]]\naddress = \"127.0.0.1:9000\"\nmodel = \"m\"\ncapacity_blocks = 4\n"),
        7,
    );
    let happened = vllm(&mut core, 0, Delivery::LiveHoldingGaps, &store(None, 0, 6));
    let evicted: usize = happened
        .iter()
        .map(|h| match h {
            Happened::Applied { outcome, .. } => outcome.evicted,
            _ => 0,
        })
        .sum();
    assert_eq!((evicted, blocks(&core)), (2, 4));
    let scrape = core.ingest(
        Input::Scrape {
            worker: WorkerId(0),
            load: None,
            capacity: Some(3),
            asked: Instant::now(),
        },
        Instant::now(),
    );
    assert!(scrape.contains(&Happened::Capacity {
        worker: core.name(WorkerId(0)),
        blocks: 3
    }));
    vllm(
        &mut core,
        1,
        Delivery::LiveHoldingGaps,
        &store(None, 100, 1),
    );
    assert_eq!(blocks(&core), 3);
}

/// Tickets cannot be guessed: reporting made-up ones closes nothing.
#[test]
fn forged_tickets_close_nothing() {
    let mut core = vllm_core();
    let now = Instant::now();
    let hint = core.hint(&one_block_request(), now).unwrap();
    let real = hint.ticket.unwrap();
    let finished = |ticket| Finished {
        ticket,
        usage: Usage::Unanswered,
    };
    let forged: Vec<Finished> = (0..10_000u64)
        .flat_map(|seq| [Ticket(seq << 16), Ticket(real.0 ^ (seq + 1) << 16)])
        .map(finished)
        .collect();
    core.ingest(Input::Finished(&forged), now);
    assert_eq!(busy(&core), 1.0);
    core.ingest(Input::Finished(&[finished(real)]), now);
    assert_eq!(busy(&core), 0.0);
}

/// A finished request's usage is set beside what its hint predicted, on the worker it went to.
#[test]
fn finished_requests_compare_predicted_and_cached_tokens() {
    let mut core = vllm_core();
    let now = Instant::now();
    vllm(
        &mut core,
        0,
        Delivery::LiveHoldingGaps,
        &store(None, 100, 3),
    );
    let tokens: Vec<u32> = (0..16 * 4).collect();
    let req = HintRequest {
        model: "m".into(),
        hashes: token_prefix_hashes(&tokens, 16, HashSeed::default()),
        finished: Vec::new(),
    };
    let hint = core.hint(&req, now).unwrap();
    assert_eq!(hint.decision.matched_blocks, 3);
    let usage = Usage::Cached {
        prompt_tokens: 70,
        cached_tokens: 48,
    };
    let report = Finished {
        ticket: hint.ticket.unwrap(),
        usage,
    };
    let happened = core.ingest(Input::Finished(&[report]), now);
    assert!(
        happened.contains(&Happened::Served {
            ticket: report.ticket,
            worker: core.name(WorkerId(0)),
            predicted_tokens: 48,
            usage,
            prediction: Some(Prediction::Exact),
        }),
        "{happened:?}"
    );
    let truth = core.fleet().get(WorkerId(0)).unwrap().truth;
    assert_eq!(
        (
            truth.predicted_tokens,
            truth.cached_tokens,
            truth.prompt_tokens
        ),
        (48, 48, 70)
    );
    // The engine evicted them meanwhile: the index over-predicted.
    let second = core.hint(&req, now).unwrap();
    let evicted = Finished {
        ticket: second.ticket.unwrap(),
        usage: Usage::Cached {
            prompt_tokens: 70,
            cached_tokens: 0,
        },
    };
    core.ingest(Input::Finished(&[evicted]), now);
    let truth = core.fleet().get(WorkerId(0)).unwrap().truth;
    assert_eq!((truth.exact, truth.over, truth.compared()), (1, 1, 2));
}

/// A replica that lost a message takes a clean peer's snapshot: the entries, then its own
/// later messages on top; its cache then equals the peer's and is clean again.
#[test]
fn a_peer_snapshot_repairs_a_cache_that_lost_events() {
    let (mut clean, mut lossy) = (vllm_core(), vllm_core());
    let now = Instant::now();
    let batches: Vec<EventBatch> = (0..6).map(|i| store(None, i * 10, 2)).collect();
    for (seq, b) in batches.iter().enumerate() {
        let m = |core: &mut Core| {
            core.ingest(
                Input::Message(Message::vllm(
                    "127.0.0.1:9000",
                    seq as u64,
                    Delivery::Live,
                    b,
                )),
                now,
            )
        };
        m(&mut clean);
        if seq != 2 {
            m(&mut lossy);
        }
    }
    let report = |core: &Core| core.reports().pop().unwrap();
    assert!(report(&clean).clean);
    assert!(!report(&lossy).clean, "a live gap makes it unclean");
    assert_ne!(
        report(&clean).checkpoints.last(),
        report(&lossy).checkpoints.last()
    );
    // The peer's snapshot is two messages old: the lossy replica re-applies 4 and 5 on top.
    let mut old = vllm_core();
    for (seq, b) in batches.iter().enumerate().take(4) {
        old.ingest(
            Input::Message(Message::vllm(
                "127.0.0.1:9000",
                seq as u64,
                Delivery::Live,
                b,
            )),
            now,
        );
    }
    let snapshot = old.snapshot("127.0.0.1:9000", 0).unwrap();
    assert_eq!(snapshot.seq, 3);
    let happened = lossy.ingest(
        Input::Snapshot {
            worker: "127.0.0.1:9000",
            rank: 0,
            snapshot: &snapshot,
            clean: true,
        },
        now,
    );
    assert!(happened.iter().any(|h| matches!(
        h,
        Happened::Repaired {
            installed: true,
            ..
        }
    )));
    assert_eq!(
        report(&lossy).checkpoints.last(),
        report(&clean).checkpoints.last()
    );
    assert!(report(&lossy).clean);
    assert_eq!(blocks(&lossy), 12);
}

/// A replica that lost a message takes a peer's copy of it: applied in its place, with every
/// later message applied again (the lost message stored blocks a later one removed: applied
/// late alone, they would come back). Nobody handing it over makes the cache unclean.
#[test]
fn a_lost_message_filled_by_a_peer_is_applied_in_its_place() {
    let replica = || {
        Core::new(
            &config("[replicas]\ngroup = \"t\"\n\n[[workers]]\naddress = \"127.0.0.1:9000\"\nmodel = \"m\"\n"),
            7,
        )
    };
    let (mut clean, mut lossy, mut alone) = (replica(), replica(), vllm_core());
    let removed = EventBatch {
        events: vec![VllmEvent::BlockRemoved {
            block_hashes: vec![EngineBlockHash(10), EngineBlockHash(11)],
            medium: None,
            group: None,
        }],
        ..EventBatch::default()
    };
    let stream = [
        store(None, 0, 2),
        store(Some(1), 10, 2),
        removed,
        store(Some(1), 20, 3),
    ];
    for (seq, b) in stream.iter().enumerate() {
        vllm(&mut clean, seq as u64, Delivery::Live, b);
        if seq != 1 {
            vllm(&mut lossy, seq as u64, Delivery::Live, b);
            vllm(&mut alone, seq as u64, Delivery::Live, b);
        }
    }
    let report = |core: &Core| core.reports().pop().unwrap();
    assert!(!report(&lossy).clean, "message 1 is missing");
    let now = Instant::now();
    assert_eq!(
        lossy.wanted(now, Duration::ZERO),
        vec![(("127.0.0.1:9000".to_owned(), 0), vec![1])]
    );
    let copies = clean.messages("127.0.0.1:9000", 0, &[1, 9]);
    assert_eq!(copies.len(), 1, "only message 1 is known to the peer");
    let happened = lossy.ingest(
        Input::Fill {
            worker: "127.0.0.1:9000",
            rank: 0,
            messages: &copies,
        },
        now,
    );
    assert!(happened
        .iter()
        .any(|h| matches!(h, Happened::Filled { messages: 1, .. })));
    assert_eq!(
        report(&lossy).checkpoints.last(),
        report(&clean).checkpoints.last()
    );
    assert!(report(&lossy).clean);
    assert_eq!(blocks(&lossy), blocks(&clean));
    assert!(lossy.wanted(now, Duration::ZERO).is_empty());
    // The filled message is handed on to a third replica that lost it too.
    assert_eq!(lossy.messages("127.0.0.1:9000", 0, &[1]), copies);
    // Without peers to repair from, a loss makes the cache unclean at once: nothing to ask.
    assert!(!report(&alone).clean);
    assert!(alone.wanted(now, Duration::ZERO).is_empty());
    // With peers, a loss nobody hands over is given up on after the fill timeout.
    let mut unlucky = replica();
    for (seq, b) in stream.iter().enumerate().filter(|(s, _)| *s != 1) {
        vllm(&mut unlucky, seq as u64, Delivery::Live, b);
    }
    assert!(unlucky.ingest(Input::Tick, now).is_empty(), "still waiting");
    let later = now + Duration::from_secs(3);
    let happened = unlucky.ingest(Input::Tick, later);
    assert!(happened
        .iter()
        .any(|h| matches!(h, Happened::Unfilled { messages: 1, .. })));
    assert!(unlucky.wanted(later, Duration::ZERO).is_empty());
}

/// A cache saved on disk is put back unclean; a replay that continues it extends it, and an
/// engine numbering from 0 again (it restarted while the sidecar was down) replaces it.
#[test]
fn a_cache_restored_from_disk_is_continued_or_replaced() {
    let address = "127.0.0.1:9000";
    let mut saved = vllm_core();
    vllm(&mut saved, 0, Delivery::Live, &store(None, 0, 2));
    vllm(&mut saved, 1, Delivery::Live, &store(Some(1), 10, 2));
    let snapshot = saved.snapshot(address, 0).unwrap();
    assert_eq!(snapshot.seq, 1);
    let restore = |core: &mut Core| {
        core.ingest(
            Input::Restore {
                worker: address,
                rank: 0,
                snapshot: &snapshot,
            },
            Instant::now(),
        )
    };
    let mut continued = vllm_core();
    let happened = restore(&mut continued);
    assert!(happened.iter().any(|h| matches!(
        h,
        Happened::Restored {
            installed: true,
            blocks: 4,
            seq: 1,
            ..
        }
    )));
    assert_eq!(blocks(&continued), 4);
    assert!(!continued.reports().pop().unwrap().clean);
    vllm(
        &mut continued,
        2,
        Delivery::WarmStart,
        &store(Some(11), 20, 1),
    );
    assert_eq!(
        blocks(&continued),
        5,
        "the replay continued the restored cache"
    );

    let mut restarted = vllm_core();
    restore(&mut restarted);
    let happened = vllm(&mut restarted, 0, Delivery::Live, &store(None, 30, 1));
    assert!(happened.iter().any(|h| matches!(
        h,
        Happened::Forgot {
            why: Forgot::Restarted,
            ..
        }
    )));
    assert_eq!(blocks(&restarted), 1);
}

/// What the other replicas have in flight counts as load: a prompt nothing matches avoids the
/// worker they keep busy, until they say it is free again or fall silent.
#[test]
fn peer_replicas_load_steers_cold_prompts() {
    let mut core = Core::new(
        &config(
            "[[workers]]\naddress = \"127.0.0.1:9000\"\nmodel = \"m\"\n\
             [[workers]]\naddress = \"127.0.0.1:9001\"\nmodel = \"m\"\n\
             [replicas]\nnats_url = \"nats://127.0.0.1:1\"\ninterval_ms = 1000\n",
        ),
        7,
    );
    let now = Instant::now();
    let first = |core: &mut Core, at| {
        let hint = core.hint(&one_block_request(), at).unwrap();
        let report = Finished {
            ticket: hint.ticket.unwrap(),
            usage: Usage::Missing,
        };
        core.ingest(Input::Finished(&[report]), at);
        hint.decision.workers[0]
    };
    let home = first(&mut core, now);
    let other = WorkerId(1 - home.0);
    let busy_home = [(core.name(home).address.to_string(), 8)];
    let happened = core.ingest(
        Input::PeerLoad {
            peer: "b",
            in_flight: &busy_home,
            survival: &[],
        },
        now,
    );
    assert!(happened
        .iter()
        .any(|h| matches!(h, Happened::Load { load, .. } if load.peers_in_flight == 8.0)));
    assert_eq!(
        first(&mut core, now),
        other,
        "away from the peers' busy worker"
    );
    core.ingest(
        Input::PeerLoad {
            peer: "b",
            in_flight: &[],
            survival: &[],
        },
        now,
    );
    assert_eq!(first(&mut core, now), home, "free again");
    core.ingest(
        Input::PeerLoad {
            peer: "b",
            in_flight: &busy_home,
            survival: &[],
        },
        now,
    );
    core.ingest(Input::Tick, now + Duration::from_millis(2500));
    assert_eq!(
        first(&mut core, now + Duration::from_millis(2500)),
        home,
        "a silent peer is forgotten"
    );
}

/// A Dynamo worker whose engine is read over ZMQ (`[[zmq]] worker` = its request-plane
/// address): the ZMQ batches index it, and the copies Dynamo relays to NATS are refused, so no
/// event counts twice on two numberings.
#[test]
fn a_discovered_worker_read_over_zmq_takes_its_events_from_zmq_only() {
    let zmq = "[[zmq]]\nendpoint = \"tcp://127.0.0.1:1\"\nworker = \"127.0.0.1:40051\"\n";
    let mut core = Core::new(&config(zmq), 7);
    let (_, evs, _) = pin_fixture();
    let now = Instant::now();
    let publisher = evs[0].worker_id;
    discover(
        &mut core,
        &instances(&[(publisher, 40051, Role::Aggregated)]),
        &[],
        now,
    );
    let relayed = events(&mut core, &evs, now);
    assert!(
        relayed.iter().all(|h| matches!(
            h,
            Happened::Rejected {
                why: Rejected::ReadOverZmq,
                ..
            }
        )),
        "{relayed:?}"
    );
    // Its load still comes from NATS.
    let metrics = kvroute_protocol::dynamo::KvMetrics {
        worker_id: publisher,
        dp_rank: 0,
        active_decode_blocks: None,
        active_prefill_tokens: Some(32),
        kv_used_blocks: Some(4),
    };
    let load = core.ingest(
        Input::DynamoLoad {
            metrics: &metrics,
            component: None,
        },
        now,
    );
    assert!(
        load.iter().any(|h| matches!(
            h,
            Happened::Load {
                from_dynamo: true,
                ..
            }
        )),
        "{load:?}"
    );
    let batch = store(None, 1, 4);
    let m = Message::vllm("127.0.0.1:40051", 0, Delivery::WarmStart, &batch);
    let applied = core.ingest(Input::Message(m), now);
    assert!(
        !applied
            .iter()
            .any(|h| matches!(h, Happened::UnknownPublisher { .. })),
        "{applied:?}"
    );
    let tokens: Vec<u32> = (0..64).collect();
    let req = HintRequest {
        model: "m".into(),
        hashes: token_prefix_hashes(&tokens, 16, HashSeed::default()),
        finished: Vec::new(),
    };
    let hint = core.hint(&req, now).unwrap();
    assert_eq!(hint.target, Target::Instance(publisher));
    assert_eq!(hint.decision.matched_blocks, 4);
}

/// The invariant replicas rest on: a replica that lost messages and had them filled by a peer,
/// a few at a time with others still missing, holds exactly what in-order application holds,
/// at every message both recorded — with a capacity bound that evicts meanwhile, which a
/// re-application of late messages on top of the evicted cache would not undo.
#[test]
fn filled_caches_are_what_in_order_application_holds() {
    let replica = || {
        Core::new(
            &config(
                "[replicas]\ngroup = \"t\"\n\n[[workers]]\naddress = \"127.0.0.1:9000\"\nmodel = \"m\"\ncapacity_blocks = 24\n",
            ),
            7,
        )
    };
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for run in 0..20 {
        let (mut clean, mut lossy) = (replica(), replica());
        let mut stored: Vec<u64> = Vec::new();
        let mut name = 1_000 * (run + 1);
        let now = Instant::now();
        let mut lost = 0;
        for seq in 0..300u64 {
            let batch = if next() % 4 == 0 && !stored.is_empty() {
                let gone: Vec<EngineBlockHash> = (0..1 + next() % 3)
                    .map(|_| EngineBlockHash(stored[(next() % stored.len() as u64) as usize]))
                    .collect();
                EventBatch {
                    events: vec![VllmEvent::BlockRemoved {
                        block_hashes: gone,
                        medium: None,
                        group: None,
                    }],
                    ..EventBatch::default()
                }
            } else {
                // Mostly under the shared prefix's first blocks, as conversations are.
                let parent = match next() % 3 {
                    0 => None,
                    _ => stored.get((next() % 4) as usize).copied(),
                };
                let n = 1 + next() % 3;
                stored.extend(name..name + n);
                name += n;
                store(parent, name - n, n)
            };
            vllm(&mut clean, seq, Delivery::Live, &batch);
            // The last message arrives: one lost at the very end shows as no gap (the replica
            // plane takes the peer's copy of a cache left behind).
            if seq == 0 || seq == 299 || next() % 100 >= 15 {
                vllm(&mut lossy, seq, Delivery::Live, &batch);
            } else {
                lost += 1;
            }
            // Every few messages a peer hands over some of what is missing, not all of it.
            if seq % 7 == 6 {
                for ((worker, rank), seqs) in lossy.wanted(now, Duration::ZERO) {
                    let some = &seqs[..seqs.len().div_ceil(2)];
                    let copies = clean.messages(&worker, rank, some);
                    let fill = Input::Fill {
                        worker: &worker,
                        rank,
                        messages: &copies,
                    };
                    lossy.ingest(fill, now);
                }
            }
        }
        assert!(lost > 20, "{lost}");
        for ((worker, rank), seqs) in lossy.wanted(now, Duration::ZERO) {
            let copies = clean.messages(&worker, rank, &seqs);
            let fill = Input::Fill {
                worker: &worker,
                rank,
                messages: &copies,
            };
            lossy.ingest(fill, now);
        }
        let (ours, theirs) = (
            clean.reports().pop().unwrap(),
            lossy.reports().pop().unwrap(),
        );
        assert!(theirs.clean && !theirs.filling, "run {run}");
        assert_eq!(
            ours.checkpoints.last(),
            theirs.checkpoints.last(),
            "run {run}"
        );
        for c in &theirs.checkpoints {
            if let Some(o) = ours.checkpoints.iter().find(|o| o.seq == c.seq) {
                assert_eq!(o, c, "run {run}: after message {}", c.seq);
            }
        }
        let probe = |core: &Core| core.snapshot("127.0.0.1:9000", 0).unwrap().entries;
        assert_eq!(
            probe(&clean),
            probe(&lossy),
            "run {run}: the same eviction order too"
        );
        assert!(theirs.lost_at > 0 && ours.lost_at == 0);
    }
}

/// Two replicas each losing a tenth of the messages, different ones, hand each other what they
/// lost: both end with every message but those both lost, which are given up on.
#[test]
fn replicas_that_both_lose_fill_each_other() {
    let replica = || {
        Core::new(
            &config(
                "[replicas]\ngroup = \"t\"\n\n[[workers]]\naddress = \"127.0.0.1:9000\"\nmodel = \"m\"\n",
            ),
            7,
        )
    };
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let exchange = |to: &mut Core, from: &Core| {
        for ((worker, rank), seqs) in to.wanted(Instant::now(), Duration::ZERO) {
            let copies = from.messages(&worker, rank, &seqs);
            let fill = Input::Fill {
                worker: &worker,
                rank,
                messages: &copies,
            };
            to.ingest(fill, Instant::now());
        }
    };
    for run in 0..30 {
        let (mut a, mut b) = (replica(), replica());
        let mut both = 0;
        for seq in 0..300u64 {
            let batch = store(None, 10_000 * (run + 1) + seq, 1);
            let edge = seq == 0 || seq == 299;
            let (to_a, to_b) = (edge || next() % 10 != 0, edge || next() % 10 != 0);
            if to_a {
                vllm(&mut a, seq, Delivery::Live, &batch);
            }
            if to_b {
                vllm(&mut b, seq, Delivery::Live, &batch);
            }
            both += usize::from(!to_a && !to_b);
            if seq % 5 == 4 {
                exchange(&mut a, &b);
                exchange(&mut b, &a);
            }
        }
        exchange(&mut a, &b);
        exchange(&mut b, &a);
        let later = Instant::now() + Duration::from_secs(30);
        a.ingest(Input::Tick, later);
        b.ingest(Input::Tick, later);
        assert_eq!(blocks(&a), 300 - both, "run {run}: a");
        assert_eq!(blocks(&b), 300 - both, "run {run}: b");
    }
}

/// A disaggregated fleet's decode workers are never hinted, but they are known: their load
/// reports (and KV events) are not an unknown publisher's, which the `no_events` alarm would
/// tell the user to add to `[[workers]]`.
#[test]
fn decode_workers_load_reports_are_not_unknown_publishers() {
    let (mut core, _, _) = pin_fixture();
    let now = Instant::now();
    let (prefill, decode) = (11, 12);
    discover(
        &mut core,
        &instances(&[
            (prefill, 40061, Role::Prefill),
            (decode, 40062, Role::Decode),
        ]),
        &[],
        now,
    );
    let report = |worker_id| kvroute_protocol::dynamo::KvMetrics {
        worker_id,
        dp_rank: 0,
        active_decode_blocks: Some(3),
        active_prefill_tokens: None,
        kv_used_blocks: Some(4),
    };
    let unknown = |core: &mut Core, worker_id| {
        let metrics = report(worker_id);
        core.ingest(
            Input::DynamoLoad {
                metrics: &metrics,
                component: None,
            },
            now,
        )
        .iter()
        .any(|h| matches!(h, Happened::UnknownPublisher { .. }))
    };
    assert!(!unknown(&mut core, decode));
    assert!(!unknown(&mut core, prefill));
    assert!(
        unknown(&mut core, 13),
        "an id discovery never listed is unknown"
    );
    assert_eq!(
        core.fleet().len(),
        1,
        "the decode worker is not in the fleet"
    );
}
