//! Tests of the core: The hint: which workers a request names, and how survival and reports weigh them.

use super::*;

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
    let own = |h: &Hint| h.decision.candidates[0].prefix_in_flight;
    assert_eq!(
        (own(&first), own(&second)),
        (0, 1),
        "the prefix's own requests there"
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

/// Four vLLM workers at `127.0.0.1:900{i}`, homes two blocks deep, and `routing`.
fn four_workers(routing: &str) -> Core {
    let four = (0..4)
        .map(|i| format!("[[workers]]\naddress = \"127.0.0.1:900{i}\"\nmodel = \"m\"\n"))
        .collect::<String>();
    Core::new(
        &config(&format!("{four}[routing]\nhome_key_blocks = 2\n{routing}")),
        7,
    )
}

/// A two-block prompt of its own (`k`): its tokens and its hint request.
fn prompt(k: u32) -> (Vec<u32>, HintRequest) {
    let tokens: Vec<u32> = (0..32).map(|t| k * 1000 + t).collect();
    let req = HintRequest {
        model: "m".into(),
        hashes: token_prefix_hashes(&tokens, 16, HashSeed::default()),
        finished: Vec::new(),
    };
    (tokens, req)
}

/// Worker `w`'s engine stores `tokens` as its message `seq` (engine hashes `seq * 10..`).
fn engine_stores(core: &mut Core, w: WorkerId, seq: u64, tokens: &[u32], now: Instant) {
    let batch = store_tokens(None, seq * 10, tokens);
    let address = format!("127.0.0.1:900{}", w.0);
    core.ingest(
        Input::Message(Message::vllm(&address, seq, Delivery::Live, &batch)),
        now,
    );
}

/// Cold prompts whose home is one worker are placed with bounded loads: no worker becomes
/// home to more than the mean of prefixes and half a prefix, counted from the index (what
/// the engines stored) and from the requests still running whose events are yet to come. A
/// replica that only read the same events counts the same and names the same homes; a warm
/// prompt reads no counts, nor does any prompt with the balance off.
#[test]
fn cold_prompts_homes_are_bounded_by_the_prefixes_the_index_holds() {
    let mut unbounded = four_workers("home_balance = inf\n");
    let mut bounded = four_workers("");
    let mut listener = four_workers("");
    let now = Instant::now();
    let first = |hint: &Hint| hint.decision.workers[0];
    // Twelve prompts hashing alone puts on the same worker.
    let home = first(&unbounded.hint(&prompt(1).1, now).unwrap());
    let same_home: Vec<u32> = [1]
        .into_iter()
        .chain((2..).filter(|&k| first(&unbounded.hint(&prompt(k).1, now).unwrap()) == home))
        .take(12)
        .collect();
    let mut seqs = [0u64; 4];
    let mut placed = Vec::new();
    let mut late: Option<(WorkerId, Vec<u32>, Hint)> = None;
    let mut most_ahead: f64 = 0.0;
    let mut expected: Option<(WorkerId, f64)> = None;
    let homes = |hint: &Hint| -> Vec<f64> {
        let mut by_worker: Vec<(WorkerId, f64)> = hint
            .decision
            .candidates
            .iter()
            .map(|c| (c.id, c.homes.unwrap()))
            .collect();
        by_worker.sort_by_key(|c| c.0);
        by_worker.into_iter().map(|c| c.1).collect()
    };
    let finish = |core: &mut Core, hint: &Hint| {
        let done = Finished {
            ticket: hint.ticket.unwrap(),
            usage: Usage::Cached {
                prompt_tokens: 32,
                cached_tokens: 0,
            },
        };
        core.ingest(Input::Finished(&[done]), now);
    };
    for (i, &k) in same_home.iter().enumerate() {
        let (tokens, req) = prompt(k);
        let hint = bounded.hint(&req, now).unwrap();
        let w = first(&hint);
        let before = homes(&hint);
        if let Some((w, n)) = expected.take() {
            assert_eq!(
                before[w.0 as usize], n,
                "prompt {i}: the one before runs there"
            );
        }
        // The engine stores the prompt and it finishes; every third prompt's events come
        // after the next prompt was placed, which counts it as running there meanwhile.
        let mut arrive = |core_w: (WorkerId, Vec<u32>, Hint)| {
            let (w, tokens, hint) = core_w;
            seqs[w.0 as usize] += 1;
            for core in [&mut bounded, &mut listener] {
                engine_stores(core, w, seqs[w.0 as usize], &tokens, now);
            }
            finish(&mut bounded, &hint);
        };
        if let Some(previous) = late.take() {
            arrive(previous);
        }
        if i % 3 == 2 {
            expected = Some((w, before[w.0 as usize] + 1.0));
            late = Some((w, tokens, hint));
        } else {
            arrive((w, tokens, hint));
        }
        // The replica that only listened, asked for the next prompt of the same home, counts
        // what this one counted once the running requests' events are in.
        let next = prompt(same_home.get(i + 1).copied().unwrap_or(500)).1;
        let listened = listener.hint(&next, now).unwrap();
        if late.is_none() {
            let asked = bounded.hint(&next, now).unwrap();
            assert_eq!(homes(&listened), homes(&asked), "prompt {i}");
            assert_eq!(first(&listened), first(&asked), "prompt {i}");
            finish(&mut bounded, &asked);
        }
        finish(&mut listener, &listened);
        let least = before.iter().copied().fold(f64::INFINITY, f64::min);
        let mean = before.iter().sum::<f64>() / 4.0;
        assert!(
            before[w.0 as usize] <= mean + 0.5,
            "prompt {i} went to {w:?} home to {before:?}"
        );
        most_ahead = most_ahead.max(before[w.0 as usize] - least);
        placed.push(w);
    }
    assert_eq!(placed[0], home);
    assert_ne!(
        placed[1], home,
        "the second is passed over: 1 against 0.25 + 0.5"
    );
    let per_worker: Vec<usize> = (0..4)
        .map(|w| placed.iter().filter(|p| p.0 == w).count())
        .collect();
    assert!(
        per_worker.iter().all(|&n| (2..=4).contains(&n)),
        "{per_worker:?}"
    );
    assert!(most_ahead <= 2.0, "a home {most_ahead} ahead of the least");
    // Running there and stored there, a prefix counts once.
    let (tokens, req) = prompt(950);
    let hint = bounded.hint(&req, now).unwrap();
    let w = first(&hint);
    seqs[w.0 as usize] += 1;
    engine_stores(&mut bounded, w, seqs[w.0 as usize], &tokens, now);
    let next = bounded.hint(&prompt(951).1, now).unwrap();
    assert_eq!(homes(&next)[w.0 as usize], homes(&hint)[w.0 as usize] + 1.0);
    // A prompt whose first request is running there matches it: not cold, no counts read.
    let (_, warm) = prompt(900);
    let running = bounded.hint(&warm, now).unwrap();
    assert!(running
        .decision
        .candidates
        .iter()
        .all(|c| c.homes.is_some()));
    let again = bounded.hint(&warm, now).unwrap();
    assert!(
        again.decision.candidates.iter().all(|c| c.homes.is_none()),
        "{:?}",
        again.decision.candidates
    );
    let off = unbounded.hint(&prompt(901).1, now).unwrap();
    assert!(off.decision.candidates.iter().all(|c| c.homes.is_none()));
}
