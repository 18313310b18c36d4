//! Tests of the core: Who may be hinted: Envoy's view, its members, Dynamo's discovery, decode workers.

use super::*;

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
