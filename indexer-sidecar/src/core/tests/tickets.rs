//! Tests of the core: Load: tickets of hinted requests, scrapes, reports, peers' in-flight counts.

use super::*;

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
            tickets: &[],
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
            tickets: &[],
        },
        now,
    );
    assert_eq!(first(&mut core, now), home, "free again");
    core.ingest(
        Input::PeerLoad {
            peer: "b",
            in_flight: &busy_home,
            survival: &[],
            tickets: &[],
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
