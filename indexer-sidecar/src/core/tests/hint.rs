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

/// Cold prompts whose home is one worker fill it to `home_balance` × the mean of the recent
/// hints (plus the slack of 2); the next goes to its next home. The hint reads the workers'
/// counts for a cold prompt only: a warm one shows none.
#[test]
fn a_cold_prompts_home_that_took_more_than_its_share_is_passed_over() {
    let four = (0..4)
        .map(|i| format!("[[workers]]\naddress = \"127.0.0.1:900{i}\"\nmodel = \"m\"\n"))
        .collect::<String>();
    let mut unbounded = Core::new(
        &config(&format!("{four}[routing]\nhome_balance = inf\n")),
        7,
    );
    let mut bounded = Core::new(
        &config(&format!("{four}[routing]\nhome_balance = 1.25\n")),
        7,
    );
    let now = Instant::now();
    let request = |k: u64| HintRequest {
        model: "m".into(),
        hashes: vec![PrefixHash(k)],
        finished: Vec::new(),
    };
    // Each request finishes before the next, so no load moves a prompt: only its home does.
    let route = |core: &mut Core, req: &HintRequest| {
        let hint = core.hint(req, now).unwrap();
        let done = Finished {
            ticket: hint.ticket.unwrap(),
            usage: Usage::Cached {
                prompt_tokens: 16,
                cached_tokens: 0,
            },
        };
        core.ingest(Input::Finished(&[done]), now);
        hint
    };
    let first = |hint: &Hint| hint.decision.workers[0];
    // Twelve prompts hashing alone puts on the same worker.
    let home = first(&route(&mut unbounded, &request(1)));
    let same_home: Vec<u64> = (2..)
        .filter(|&k| first(&route(&mut unbounded, &request(k))) == home)
        .take(11)
        .chain([1])
        .collect();
    let hints: Vec<Hint> = same_home
        .iter()
        .map(|&k| route(&mut bounded, &request(k)))
        .collect();
    let at_home: Vec<bool> = hints.iter().map(|h| first(h) == home).collect();
    // The third finds 2 at home against 1.25 × 2/4 + 2 = 2.63: taken. The fourth finds 3
    // against 1.25 × 3/4 + 2 = 2.94: passed over.
    assert_eq!(at_home[..4], [true, true, true, false], "{at_home:?}");
    let weighed = |h: &Hint| {
        h.decision
            .candidates
            .iter()
            .find(|c| c.id == home)
            .and_then(|c| c.recent_hints)
    };
    assert_eq!(weighed(&hints[3]), Some(3.0));
    let taken = at_home.iter().filter(|&&t| t).count() as f64;
    assert!(
        taken <= 1.25 * 12.0 / 4.0 + 2.0 + 1.0,
        "{taken} of 12 at one home"
    );
    // A new prompt's first request is cold and reads the counts; the next matches the first,
    // still running there: not a new prefix, no counts read. With the balance off, none are.
    let mut warm = request(100);
    warm.hashes.push(PrefixHash(101));
    let running = bounded.hint(&warm, now).unwrap();
    assert!(running
        .decision
        .candidates
        .iter()
        .all(|c| c.recent_hints.is_some()));
    let again = bounded.hint(&warm, now).unwrap();
    assert!(
        again
            .decision
            .candidates
            .iter()
            .all(|c| c.recent_hints.is_none()),
        "{:?}",
        again.decision.candidates
    );
    let off = unbounded.hint(&request(200), now).unwrap();
    assert!(off
        .decision
        .candidates
        .iter()
        .all(|c| c.recent_hints.is_none()));
}
