//! Affinity with an escape hatch: under a hot prefix, kvroute keeps the queues short and the hit
//! rate close to the oracle's.

use std::time::Duration;

use indicatif::ProgressBar;
use kvroute_harness::bench::{fleet, CHAT_CAPACITY};
use kvroute_harness::client::{run_sessions, Target};
use kvroute_harness::queue::QueueWatch;
use kvroute_harness::report::ModeReport;
use kvroute_harness::stack::MODEL;
use kvroute_harness::workload::{ChatSpec, ChatWorkload};
use kvroute_harness::{Mode, Stack, StackOptions};

/// The longest queue allowed: half the sidecar's default saturation threshold (`[routing]
/// max_waiting` = 8), since the load penalty and the spread rule should keep queues short long
/// before a worker counts as saturated.
const MAX_WAITING: f64 = 4.0;
/// "Not for long": the longest any engine's queue may stay above the threshold.
const LONGEST_OVER: Duration = Duration::from_millis(500);

/// 85% of requests share one system prompt. Pure affinity would queue them all on one engine;
/// kvroute spreads the overflow (cold prefills) so no queue stays above `MAX_WAITING`, and
/// still hits within 10% of the oracle, which knows every cache exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_prefix_keeps_queues_bounded_near_the_oracle_hit_rate() {
    let sessions = ChatWorkload::generate(&ChatSpec {
        conversations: 240,
        ..ChatSpec::hot_prefix()
    })
    .sessions(MODEL);
    let engines = 4;
    let run = |mode: Mode, name: &'static str| {
        let sessions = &sessions;
        async move {
            let mut opts = StackOptions::new(name, mode);
            opts.sim = fleet(engines, CHAT_CAPACITY);
            let stack = Stack::start(opts).await.expect("stack starts");
            let addresses: Vec<String> = stack.engines.iter().map(|e| e.address.clone()).collect();
            let target = match name {
                "load-oracle" => Target::Oracle(addresses.clone()),
                _ => Target::Router(stack.envoy_url.clone()),
            };
            let watch = QueueWatch::start(stack.http.clone(), addresses, Duration::from_millis(10));
            let outcomes = run_sessions(
                &stack.http,
                &target,
                sessions,
                24,
                Duration::ZERO,
                &ProgressBar::hidden(),
            )
            .await;
            let queues = watch.stop(MAX_WAITING);
            (ModeReport::new(name, &outcomes, engines), queues)
        }
    };
    let (kvroute, queues) = run(Mode::Kvroute, "load-kvroute").await;
    let (oracle, _) = run(Mode::RoundRobin, "load-oracle").await;
    eprintln!(
        "kvroute hit {:.3} per engine {:?} queues {queues:?}; oracle hit {:.3}",
        kvroute.hit_rate, kvroute.requests_per_engine, oracle.hit_rate
    );
    assert_eq!(kvroute.errors, 0);
    assert_eq!(oracle.errors, 0);
    for (i, q) in queues.iter().enumerate() {
        assert!(q.samples > 10, "engine {i} was not watched: {q:?}");
        assert!(
            q.longest_over <= LONGEST_OVER,
            "engine {i}'s queue stayed above {MAX_WAITING} for {:?}: {q:?}",
            q.longest_over
        );
    }
    assert!(
        kvroute.hit_rate >= 0.9 * oracle.hit_rate,
        "kvroute {:.3} vs oracle {:.3}",
        kvroute.hit_rate,
        oracle.hit_rate
    );
}
