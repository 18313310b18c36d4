//! Tests of the core: KV events in: sequence, gaps, warm starts, restarts, fills, snapshots, capacity;
//! and two replicas converging under the replica plane's rule.

use super::*;

/// A replica's core: model `m`, `[replicas]` on, the worker at 127.0.0.1:9000 (`extra`: more
/// of its keys).
fn replica(extra: &str) -> Core {
    let text = format!(
        "[replicas]\ngroup = \"t\"\n\n[[workers]]\naddress = \"127.0.0.1:9000\"\nmodel = \"m\"\n{extra}"
    );
    Core::new(&config(&text), 7)
}

/// A seeded xorshift generator: which messages a test's replicas lose.
fn xorshift(mut seed: u64) -> impl FnMut() -> u64 {
    move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    }
}

/// Hand `to` what `from` applied of the messages it lost.
fn fill_from(to: &mut Core, from: &Core) {
    for ((worker, rank), seqs) in to.wanted(Instant::now(), Duration::ZERO) {
        let copies = from.messages(&worker, rank, &seqs);
        let fill = Input::Fill {
            worker: &worker,
            rank,
            messages: &copies,
        };
        to.ingest(fill, Instant::now());
    }
}

/// Two replicas read a stream of `n` one-block messages (run `run`'s blocks), each getting
/// those `gets(seq)` says (to `a`, to `b`); they hand each other what they lost every 5
/// messages and at the end, and 30 s later give up what is still missing. Returns that moment.
fn lossy_pair(
    a: &mut Core,
    b: &mut Core,
    n: u64,
    run: u64,
    mut gets: impl FnMut(u64) -> (bool, bool),
) -> Instant {
    for seq in 0..n {
        let batch = store(None, 10_000 * (run + 1) + seq, 1);
        let (to_a, to_b) = gets(seq);
        if to_a {
            vllm(a, seq, Delivery::Live, &batch);
        }
        if to_b {
            vllm(b, seq, Delivery::Live, &batch);
        }
        if seq % 5 == 4 {
            fill_from(a, b);
            fill_from(b, a);
        }
    }
    fill_from(a, b);
    fill_from(b, a);
    let later = Instant::now() + Duration::from_secs(30);
    a.ingest(Input::Tick, later);
    b.ingest(Input::Tick, later);
    later
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
    let report = |core: &Core| core.reports(Instant::now()).pop().unwrap();
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
    let (mut clean, mut lossy, mut alone) = (replica(""), replica(""), vllm_core());
    let removed = EventBatch {
        events: vec![VllmEvent::BlockRemoved {
            block_hashes: vec![EngineBlockHash(10), EngineBlockHash(11)].into(),
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
    let report = |core: &Core| core.reports(Instant::now()).pop().unwrap();
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
    let mut unlucky = replica("");
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
    assert!(!continued.reports(Instant::now()).pop().unwrap().clean);
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

/// The invariant replicas rest on: a replica that lost messages and had them filled by a peer,
/// a few at a time with others still missing, holds exactly what in-order application holds,
/// at every message both recorded — with a capacity bound that evicts meanwhile, which a
/// re-application of late messages on top of the evicted cache would not undo.
#[test]
fn filled_caches_are_what_in_order_application_holds() {
    let mut next = xorshift(0x9e37_79b9_7f4a_7c15u64);
    for run in 0..20 {
        let (mut clean, mut lossy) = (
            replica("capacity_blocks = 24\n"),
            replica("capacity_blocks = 24\n"),
        );
        let mut stored: Vec<u64> = Vec::new();
        let mut name = 1_000 * (run + 1);
        let now = Instant::now();
        let mut lost = 0;
        for seq in 0..300u64 {
            let batch = if next().is_multiple_of(4) && !stored.is_empty() {
                let gone: Vec<EngineBlockHash> = (0..1 + next() % 3)
                    .map(|_| EngineBlockHash(stored[(next() % stored.len() as u64) as usize]))
                    .collect();
                EventBatch {
                    events: vec![VllmEvent::BlockRemoved {
                        block_hashes: gone.into(),
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
            clean.reports(Instant::now()).pop().unwrap(),
            lossy.reports(Instant::now()).pop().unwrap(),
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
    let mut next = xorshift(0x2545_f491_4f6c_dd1du64);
    for run in 0..30 {
        let (mut a, mut b) = (replica(""), replica(""));
        let mut both = 0;
        lossy_pair(&mut a, &mut b, 300, run, |seq| {
            let edge = seq == 0 || seq == 299;
            let (to_a, to_b) = (
                edge || !next().is_multiple_of(10),
                edge || !next().is_multiple_of(10),
            );
            both += usize::from(!to_a && !to_b);
            (to_a, to_b)
        });
        assert_eq!(blocks(&a), 300 - both, "run {run}: a");
        assert_eq!(blocks(&b), 300 - both, "run {run}: b");
    }
}

/// Replicas converge whatever they lost, the last messages included (nothing after those
/// shows the gap): two replicas losing a tenth each fill each other, then the replica plane's
/// rule over their digests ([`Replicas::repairs`], a round an interval) repairs what fills
/// could not. Every other run, `a` loses the last four messages and `b` two of them, which
/// neither can hand over: `b` gives them up (unclean, ahead), `a` believes itself clean, and
/// only staying behind tells it otherwise.
#[test]
fn replicas_converge_when_the_last_messages_are_lost() {
    let mut next = xorshift(0x8c3f_52a1_0e6b_d947u64);
    let n = 60u64;
    let mut believed_clean = 0;
    for run in 0..30 {
        let (mut a, mut b) = (replica(""), replica(""));
        let tail = run % 2 == 0;
        let later = lossy_pair(&mut a, &mut b, n, run, |seq| {
            let (to_a, to_b) = (!next().is_multiple_of(10), !next().is_multiple_of(10));
            if tail && seq >= n - 4 {
                (false, seq >= n - 2)
            } else {
                (to_a || seq == 0, to_b || seq == 0)
            }
        });
        believed_clean += usize::from(tail && a.reports(later)[0].clean);
        replica_rounds(&mut a, &mut b, later, 4);
        let (x, y) = (
            a.snapshot("127.0.0.1:9000", 0).unwrap(),
            b.snapshot("127.0.0.1:9000", 0).unwrap(),
        );
        assert_eq!((x.seq, &x.entries), (y.seq, &y.entries), "run {run}");
        assert_eq!(x.seq, n - 1, "run {run}");
    }
    assert!(believed_clean > 0, "no run left `a` believing itself clean");
}

/// `rounds` rounds of the replica plane's rule between `a` and `b`, an interval apart from
/// `from`: each observes the other's digests ([`Replicas::observe`]) and installs the copies
/// [`Replicas::repairs`] asks for, as the sidecar's brain does.
fn replica_rounds(a: &mut Core, b: &mut Core, from: Instant, rounds: u32) {
    use crate::replication::peers::Replicas;
    use crate::replication::wire::Digests;
    let timeout = Duration::from_secs(6);
    let mut planes = [
        Replicas::new("a".into(), timeout),
        Replicas::new("b".into(), timeout),
    ];
    for round in 0..rounds {
        let at = from + round * timeout / 3;
        for (me, plane) in planes.iter_mut().enumerate() {
            let (ours, theirs) = if me == 0 {
                (&mut *a, &*b)
            } else {
                (&mut *b, &*a)
            };
            let peer = Digests {
                replica: if me == 0 { "b" } else { "a" }.into(),
                caches: theirs.reports(at),
                served: Vec::new(),
            };
            let clean = peer.caches.iter().all(|c| c.clean);
            // One look at our caches a round, as the sidecar's tick takes.
            let mine = ours.reports(at);
            plane.observe(peer, &mine, at);
            for (_, (worker, rank), _) in plane.repairs(&mine, at) {
                let snapshot = theirs.snapshot(&worker, rank).unwrap();
                let install = Input::Snapshot {
                    worker: &worker,
                    rank,
                    snapshot: &snapshot,
                    clean,
                };
                ours.ingest(install, at);
                plane.repaired(&(worker, rank));
            }
        }
    }
}

/// A replica ahead only by numbers is not ahead: the engine restarts and goes quiet after a
/// few messages, which `b` gets and `a` loses, so `a` stays at the old stream's higher number.
/// `b` keeps the new stream's copy (taking `a`'s would put the old blocks back and skip the
/// new stream's messages up to the old number as copies); `a`, at the new stream's next
/// message, learns of the restart and of the messages it lost before it, and fills them from
/// `b` (the lower id, `a`'s copy would win a tie between two copies that lost nothing).
#[test]
fn a_peer_that_missed_a_restart_is_not_ahead() {
    let t0 = Instant::now();
    let (mut missed, mut seen) = (replica(""), replica(""));
    let send = |core: &mut Core, seq: u64, first_block: u64, at: Instant| {
        vllm_at(core, seq, Delivery::Live, &store(None, first_block, 1), at);
    };
    for seq in 0..20 {
        send(&mut missed, seq, 1_000 + seq, t0);
        send(&mut seen, seq, 1_000 + seq, t0);
    }
    let restart = t0 + Duration::from_secs(10);
    for seq in 0..3 {
        send(&mut seen, seq, 2_000 + seq, restart);
    }
    replica_rounds(&mut missed, &mut seen, restart, 4);
    assert_eq!(seen.snapshot("127.0.0.1:9000", 0).unwrap().seq, 2);
    assert_eq!(blocks(&seen), 3, "the stale copy taken");
    let next = restart + Duration::from_secs(10);
    send(&mut seen, 3, 2_003, next);
    send(&mut missed, 3, 2_003, next);
    fill_from(&mut missed, &seen);
    replica_rounds(&mut missed, &mut seen, next, 4);
    let (x, y) = (
        missed.snapshot("127.0.0.1:9000", 0).unwrap(),
        seen.snapshot("127.0.0.1:9000", 0).unwrap(),
    );
    assert_eq!((x.seq, &x.entries), (y.seq, &y.entries));
    assert_eq!((y.seq, blocks(&seen)), (3, 4));
}

/// Dynamo sends events about offloaded copies (KVBM, vLLM's CPU offload, SGLang's host cache)
/// on the same subject as GPU ones: they are refused, the GPU entries stay, and their numbers
/// still count in the worker's sequence (the next GPU event is no gap).
#[test]
fn events_about_offloaded_copies_leave_the_gpu_index_alone() {
    use kvroute_protocol::dynamo::{KvCacheEventData, RemovedBlocks};
    let (mut core, evs, req) = pin_fixture();
    let now = Instant::now();
    let id = evs[0].worker_id;
    discover(
        &mut core,
        &instances(&[(id, 40051, Role::Aggregated)]),
        &[],
        now,
    );
    events(&mut core, &evs, now);
    assert_eq!(core.hint(&req, now).unwrap().decision.matched_blocks, 4);
    let last = evs.last().unwrap().event.event_id;
    let KvCacheEventData::Stored(stored) = &evs[0].event.data else {
        panic!("the capture stores blocks")
    };
    // The blocks copied to host memory, then that copy evicted, then the host tier cleared.
    let mut offloaded = evs[0].clone();
    offloaded.storage_tier = "host_pinned".into();
    offloaded.event.event_id = last + 1;
    let mut evicted = offloaded.clone();
    evicted.event.event_id = last + 2;
    evicted.event.data = KvCacheEventData::Removed(RemovedBlocks {
        block_hashes: stored.blocks.iter().map(|b| b.block_hash).collect(),
    });
    let mut cleared = offloaded.clone();
    cleared.storage_tier = "disk".into();
    cleared.event.event_id = last + 3;
    cleared.event.data = KvCacheEventData::Cleared;
    let happened = events(&mut core, &[offloaded, evicted, cleared], now);
    let refused = happened
        .iter()
        .filter(|h| {
            matches!(
                h,
                Happened::Refused {
                    problem: EventProblem::Offloaded(_),
                    ..
                }
            )
        })
        .count();
    assert_eq!(refused, 3, "{happened:?}");
    assert_eq!(core.hint(&req, now).unwrap().decision.matched_blocks, 4);
    // The GPU copy evicted next: applied, in sequence.
    let mut gpu_evicted = evs[0].clone();
    gpu_evicted.event.event_id = last + 4;
    gpu_evicted.event.data = KvCacheEventData::Removed(RemovedBlocks {
        block_hashes: vec![stored.blocks[0].block_hash],
    });
    let happened = events(&mut core, &[gpu_evicted], now);
    assert!(
        !happened
            .iter()
            .any(|h| matches!(h, Happened::Held { .. } | Happened::Forgot { .. })),
        "{happened:?}"
    );
    assert_eq!(core.hint(&req, now).unwrap().decision.matched_blocks, 0);
}
