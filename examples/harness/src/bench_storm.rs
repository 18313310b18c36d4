//! `kvroute-bench storm`: how many Dynamo KV events per second one sidecar ingests from a real
//! nats-server with nothing lost. A publisher plays a fleet of `workers` Dynamo workers, each
//! storing chains of blocks and removing them again, one event per message or a batch of one
//! worker's (as Dynamo 1.6 sends a step's), at a ladder of rates held for a few seconds each,
//! then one burst as fast as the publisher can send. Each step gets a fresh sidecar.
//!
//! Loss is judged from outside the sidecar's own counters: the publisher knows what every
//! worker's cache holds at the end, and the sidecar's `kvroute_index_blocks` per worker must
//! equal it; the events the sidecar applied (`kvroute_events_total`) are compared with the
//! events published. The sidecar's own loss counters are reported beside, to check that they
//! tell the truth.

use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, Result};
use kvroute_protocol::dynamo::{
    encode_v16, subject_v16, EnvelopeHeader, KvCacheEvent, KvCacheEventData, RemovedBlocks,
    RouterEvent, StoredBlock, StoredBlocks, KV_EVENTS_TOPIC,
};
use serde_json::{json, Value};

use crate::paths;
use crate::process::{free_port, wait_for, wait_log, Process};
use crate::prometheus;
use crate::stack::SIDECAR_SUBSCRIBED;

/// The benchmark's inputs.
#[derive(Debug, Clone)]
pub struct StormBench {
    /// Dynamo workers the publisher plays (each a `[[workers]]` entry of the sidecar).
    pub workers: usize,
    /// Sustained rates to try, events per second.
    pub rates: Vec<u64>,
    /// How long each rate is held.
    pub seconds: f64,
    /// Events in the final burst, sent as fast as the publisher can.
    pub burst: u64,
    /// Blocks each worker stores in one chain before removing it.
    pub chain: u64,
    /// Events in one message (Dynamo 1.6 batches one worker's events of a step).
    pub batch: u64,
    /// Extra sidecar configuration (TOML lines appended to `[nats]`).
    pub nats_toml: String,
}

impl StormBench {
    /// The full ladder: a 256-worker fleet, 50k to 400k events/s for 4 s each, a 200,000-event
    /// burst.
    pub fn full() -> Self {
        StormBench {
            workers: 256,
            rates: vec![50_000, 100_000, 200_000, 250_000, 300_000, 400_000],
            seconds: 4.0,
            burst: 200_000,
            chain: 32,
            batch: 1,
            nats_toml: String::new(),
        }
    }
}

const SUBJECT_NAMESPACE: &str = "dynamo";
const SUBJECT_COMPONENT: &str = "backend";

/// One worker as the publisher plays it: its chain so far and its event ids.
struct Worker {
    id: u64,
    event_id: u64,
    /// Blocks of the current chain (the cache's content).
    chain: Vec<u64>,
    /// A counter making every block hash unique.
    next_block: u64,
    /// Messages published (the envelope's number of the next).
    sent: u64,
}

impl Worker {
    /// The envelope of its next message.
    fn header(&mut self) -> EnvelopeHeader<'static> {
        self.sent += 1;
        EnvelopeHeader {
            publisher_id: self.id,
            sequence: self.sent - 1,
            published_at: 0,
            topic: KV_EVENTS_TOPIC,
        }
    }

    /// The next event: extend the chain by one block, or remove the whole chain once full.
    fn next(&mut self, chain: u64) -> RouterEvent {
        self.event_id += 1;
        let data = if self.chain.len() as u64 >= chain {
            KvCacheEventData::Removed(RemovedBlocks {
                block_hashes: std::mem::take(&mut self.chain),
            })
        } else {
            self.next_block += 1;
            let hash = (self.id << 40) | self.next_block;
            let parent = self.chain.last().copied();
            self.chain.push(hash);
            KvCacheEventData::Stored(StoredBlocks {
                parent_hash: parent,
                start_position: None,
                blocks: vec![StoredBlock {
                    block_hash: hash,
                    tokens_hash: hash ^ 0x5555,
                    mm_extra_info: None,
                }],
            })
        };
        RouterEvent {
            worker_id: self.id,
            storage_tier: "device".into(),
            residency_domain: Some("worker".into()),
            event: KvCacheEvent {
                event_id: self.event_id,
                data,
                dp_rank: 0,
            },
        }
    }
}

/// Publish `total` events round-robin over `workers`, `batch` of one worker's in a message, at
/// `rate` events per second (`None`: as fast as the client sends). Returns the publisher's
/// elapsed time.
async fn publish(
    client: &async_nats::Client,
    workers: &mut [Worker],
    chain: u64,
    batch: u64,
    total: u64,
    rate: Option<u64>,
) -> Result<Duration> {
    let subject = subject_v16(SUBJECT_NAMESPACE, SUBJECT_COMPONENT, "generate");
    let start = Instant::now();
    let published_at = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    let messages = total.div_ceil(batch);
    for n in 0..messages {
        if let Some(rate) = rate {
            // Paced: ahead of the schedule, wait for it.
            if n % 64 == 0 {
                let due = Duration::from_secs_f64((n * batch) as f64 / rate as f64);
                let elapsed = start.elapsed();
                if due > elapsed {
                    tokio::time::sleep(due - elapsed).await;
                }
            }
        }
        let worker = &mut workers[(n % workers.len() as u64) as usize];
        let events: Vec<RouterEvent> = (0..batch.min(total - n * batch))
            .map(|_| worker.next(chain))
            .collect();
        let header = EnvelopeHeader {
            published_at,
            ..worker.header()
        };
        client
            .publish(subject.clone(), encode_v16(header, &events).into())
            .await
            .context("publishing")?;
    }
    client.flush().await.context("flushing")?;
    Ok(start.elapsed())
}

/// After a step, one more event from every worker, unhurried, as a live fleet goes on
/// publishing: a loss at the end of a worker's stream then shows as a gap too, so the
/// sidecar's own count of lost events can be held to the outside count exactly.
async fn publish_tail(
    client: &async_nats::Client,
    workers: &mut [Worker],
    chain: u64,
) -> Result<u64> {
    tokio::time::sleep(Duration::from_millis(500)).await;
    let subject = subject_v16(SUBJECT_NAMESPACE, SUBJECT_COMPONENT, "generate");
    for worker in workers.iter_mut() {
        let event = worker.next(chain);
        let header = worker.header();
        client
            .publish(subject.clone(), encode_v16(header, &[event]).into())
            .await
            .context("publishing")?;
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    client.flush().await.context("flushing")?;
    Ok(workers.len() as u64)
}

/// The sidecar's configuration: the fleet, NATS, and the bench's extra `[nats]` lines.
fn sidecar_config(port: u16, nats_port: u16, bench: &StormBench) -> String {
    let mut toml = format!(
        "listen = \"127.0.0.1:{port}\"\n[nats]\nurl = \"nats://127.0.0.1:{nats_port}\"\n{}\n[[models]]\nname = \"m\"\ndir = \"{}\"\nblock_size = 16\n",
        bench.nats_toml,
        paths::model_dir().display()
    );
    for w in 0..bench.workers {
        toml.push_str(&format!(
            "[[workers]]\naddress = \"127.0.0.1:{}\"\nmodel = \"m\"\ndynamo_worker_id = {}\n",
            20_000 + w,
            w + 1
        ));
    }
    toml
}

/// KV events the sidecar applied.
fn applied_of(metrics: &str) -> f64 {
    prometheus::sum(metrics, "kvroute_events_total{")
}

/// One step: a fresh sidecar, `total` events at `rate`, then what it indexed.
async fn step(
    bench: &StormBench,
    dir: &std::path::Path,
    nats_port: u16,
    label: &str,
    total: u64,
    rate: Option<u64>,
) -> Result<Value> {
    let dir = dir.join(label);
    std::fs::create_dir_all(&dir)?;
    let port = free_port()?;
    let config = dir.join("sidecar.toml");
    std::fs::write(&config, sidecar_config(port, nats_port, bench))?;
    let mut cmd = Command::new(paths::binary("kvroute-sidecar")?);
    cmd.arg("serve").arg("--config").arg(&config);
    let mut sidecar = Process::spawn("sidecar", cmd, &dir)?;
    let log = dir.join("sidecar.log");
    wait_log(&log, SIDECAR_SUBSCRIBED, Duration::from_secs(20)).await?;

    let client = async_nats::connect(format!("nats://127.0.0.1:{nats_port}")).await?;
    let mut workers: Vec<Worker> = (0..bench.workers as u64)
        .map(|i| Worker {
            id: i + 1,
            event_id: 0,
            chain: Vec::new(),
            next_block: 0,
            sent: 0,
        })
        .collect();
    let took = publish(&client, &mut workers, bench.chain, bench.batch, total, rate).await?;
    let rate_published = total as f64 / took.as_secs_f64();
    let total = total + publish_tail(&client, &mut workers, bench.chain).await?;

    // Drained when the applied count reaches the total or stops moving for two seconds.
    let url = format!("http://127.0.0.1:{port}/metrics");
    let http = reqwest::Client::new();
    let mut last = (-1.0, Instant::now());
    let deadline = Instant::now() + Duration::from_secs(60);
    let text = loop {
        let text = http.get(&url).send().await?.text().await?;
        let applied = applied_of(&text);
        if applied >= total as f64
            || last.1.elapsed() > Duration::from_secs(2)
            || Instant::now() > deadline
        {
            break text;
        }
        if applied != last.0 {
            last = (applied, Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let drained = took + last.1.elapsed().min(Duration::from_secs(2));
    if applied_of(&text) < total as f64 {
        // Long enough for the sidecar to say the streak of losses ended.
        tokio::time::sleep(Duration::from_secs(4)).await;
    }
    let applied = applied_of(&text);
    // What each worker's cache holds, beside what the index says it holds.
    let mut wrong_workers = 0;
    let mut expected_blocks = 0u64;
    let mut indexed_blocks = 0.0;
    for w in &workers {
        let series = format!(
            "kvroute_index_blocks{{worker=\"127.0.0.1:{}\"}}",
            20_000 + w.id - 1
        );
        let held = prometheus::value(&text, &series).unwrap_or(0.0);
        expected_blocks += w.chain.len() as u64;
        indexed_blocks += held;
        if held != w.chain.len() as f64 {
            wrong_workers += 1;
        }
    }
    let own = |prefix: &str| prometheus::sum(&text, prefix);
    let report = json!({
        "step": label,
        "target_rate": rate,
        "events": total,
        "publish_s": took.as_secs_f64(),
        "published_rate": rate_published.round(),
        "applied": applied,
        "lost": total as f64 - applied,
        "lost_pct": 100.0 * (total as f64 - applied) / total as f64,
        "workers_wrong": wrong_workers,
        "expected_blocks": expected_blocks,
        "indexed_blocks": indexed_blocks,
        "drain_s": drained.as_secs_f64(),
        "sidecar_says": {
            "lost_events": own("kvroute_lost_events_total{"),
            "client_dropped": own("kvroute_source_dropped_messages_total{"),
            "lost_messages": own("kvroute_lost_messages_total{"),
            "gaps": prometheus::sum_where(&text, |l| l.starts_with("kvroute_sequence_total{") && l.contains("kind=\"gap\"")),
        },
        "sidecar_log_lines": std::fs::read_to_string(&log).map(|s| s.lines().count()).unwrap_or(0),
        "sidecar_loss_lines": std::fs::read_to_string(&log).map(|s| s.lines().filter(|l| l.contains("losses started") || l.contains("losses ended")).count()).unwrap_or(0),
    });
    println!(
        "storm {label}: {total} events (the last {} unhurried) in {:.2} s ({:.0}/s): {} applied, {:.2}% lost, {wrong_workers} of {} workers' caches wrong",
        bench.workers,
        took.as_secs_f64(),
        rate_published,
        applied,
        100.0 * (total as f64 - applied) / total as f64,
        bench.workers
    );
    sidecar.kill();
    Ok(report)
}

/// Run every step; writes `storm_batchN.json` and `.md` into `out` ([`file_stem`]).
pub async fn run(bench: &StormBench, out: &std::path::Path) -> Result<Value> {
    let dir = paths::run_dir("bench-storm")?;
    let nats_port = free_port()?;
    let mut server = Command::new(paths::venv_tool("nats-server")?);
    server.args(["-a", "127.0.0.1", "-p", &nats_port.to_string()]);
    let _server = Process::spawn("nats", server, &dir)?;
    wait_for("nats-server", Duration::from_secs(10), || async move {
        tokio::net::TcpStream::connect(("127.0.0.1", nats_port))
            .await
            .ok()
    })
    .await?;
    let mut steps = Vec::new();
    for &rate in &bench.rates {
        let total = (rate as f64 * bench.seconds) as u64;
        steps.push(
            step(
                bench,
                &dir,
                nats_port,
                &format!("{rate}/s"),
                total,
                Some(rate),
            )
            .await?,
        );
    }
    steps.push(step(bench, &dir, nats_port, "burst", bench.burst, None).await?);
    let lossless: Option<u64> = steps
        .iter()
        .filter(|s| s["target_rate"].is_u64() && s["lost"] == 0.0 && s["workers_wrong"] == 0)
        .filter_map(|s| s["published_rate"].as_f64().map(|r| r as u64))
        .max();
    let doc = json!({
        "workers": bench.workers,
        "seconds_per_rate": bench.seconds,
        "chain": bench.chain,
        "events_per_message": bench.batch,
        "nats_toml": bench.nats_toml,
        "highest_lossless_rate": lossless,
        "steps": steps,
    });
    std::fs::create_dir_all(out)?;
    let stem = file_stem(bench.batch);
    std::fs::write(
        out.join(format!("{stem}.json")),
        serde_json::to_string_pretty(&doc)?,
    )?;
    std::fs::write(out.join(format!("{stem}.md")), markdown(&doc))?;
    Ok(doc)
}

/// `storm_batch1`: the files of a run with `batch` events per message.
pub fn file_stem(batch: u64) -> String {
    format!("storm_batch{batch}")
}

/// The table docs/benchmarks.md quotes.
pub fn markdown(doc: &Value) -> String {
    let mut s = format!(
        "{} workers, {} events per message; highest sustained rate with nothing lost: {}\n\n| step | events | published events/s | applied | lost | caches wrong | sidecar: lost events / client drops / gaps | log lines |\n|---|---|---|---|---|---|---|---|\n",
        doc["workers"],
        doc["events_per_message"],
        doc["highest_lossless_rate"]
            .as_u64()
            .map_or("none".to_owned(), |r| format!("{r}/s")),
    );
    for st in doc["steps"].as_array().into_iter().flatten() {
        let says = &st["sidecar_says"];
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} ({:.2}%) | {} | {} / {} / {} | {} |\n",
            st["step"].as_str().unwrap_or(""),
            st["events"],
            st["published_rate"],
            st["applied"],
            st["lost"],
            st["lost_pct"].as_f64().unwrap_or(0.0),
            st["workers_wrong"],
            says["lost_events"],
            says["client_dropped"],
            says["gaps"],
            st["sidecar_log_lines"],
        ));
    }
    s
}
