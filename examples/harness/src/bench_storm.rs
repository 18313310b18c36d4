//! `kvroute-bench storm`: how many KV events per second one sidecar ingests with nothing lost,
//! on each event plane: Dynamo on a real nats-server, vLLM's ZMQ publishers (one PUB socket an
//! engine, the sidecar connecting to each), and Dynamo's default ZMQ plane (one PUB socket a
//! worker, found in discovery records). A publisher plays a fleet of `workers` workers, each
//! storing chains of blocks and removing them again, one event per message or a batch of one
//! worker's (as Dynamo 1.6 sends a step's), at a ladder of rates held for a few seconds each,
//! then one burst as fast as the publisher can send. Each step gets a fresh sidecar.
//!
//! Loss is judged from outside the sidecar's own counters: the publisher knows what every
//! worker's cache holds at the end, and the sidecar's `kvroute_index_blocks` per worker must
//! equal it; the events the sidecar applied (`kvroute_events_total`) are compared with the
//! events published. The sidecar's own loss counters are reported beside, to check that they
//! tell the truth.
//!
//! On ZMQ the publishers' sockets queue at most vLLM's and Dynamo's own high-water mark (100,000
//! messages a subscriber) and drop past it, as the engines do: a sidecar that falls that far
//! behind loses messages at the publisher, where a real fleet would lose them.

use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context as _, Result};
use kvroute_protocol::dynamo::{
    encode_v16, envelope_v16, subject_v16, EnvelopeHeader, KvCacheEvent, KvCacheEventData,
    RemovedBlocks, RouterEvent, StoredBlock, StoredBlocks, KV_EVENTS_TOPIC,
};
use kvroute_protocol::dynamo_zmq::encode_frames;
use kvroute_protocol::vllm::{encode_batch, EngineBlockHash, EventBatch, EventEncoding, VllmEvent};
use kvroute_sidecar::config::Config;
use serde_json::{json, Value};

use crate::paths;
use crate::process::{free_port, wait_log, Process};
use crate::prometheus;
use crate::sidecar_toml::{self, typed};
use crate::stack::{start_nats, SIDECAR_SUBSCRIBED};

/// The event plane the storm comes over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plane {
    /// Dynamo on NATS (`--event-plane nats`): every worker's messages on one subject.
    Nats,
    /// vLLM's publisher: a PUB socket per engine, the sidecar connecting to each (`[[zmq]]`).
    VllmZmq,
    /// Dynamo's default plane: a PUB socket per worker, found in discovery records
    /// (`[[dynamo_discovery]]`).
    DynamoZmq,
}

impl Plane {
    /// `nats`, `vllm-zmq` or `dynamo-zmq`.
    pub fn parse(name: &str) -> Result<Self> {
        Ok(match name {
            "nats" => Plane::Nats,
            "vllm-zmq" => Plane::VllmZmq,
            "dynamo-zmq" => Plane::DynamoZmq,
            other => bail!("no event plane {other:?}: nats, vllm-zmq or dynamo-zmq"),
        })
    }

    /// Its name in reports and file names.
    pub fn name(self) -> &'static str {
        match self {
            Plane::Nats => "nats",
            Plane::VllmZmq => "vllm-zmq",
            Plane::DynamoZmq => "dynamo-zmq",
        }
    }
}

/// The benchmark's inputs.
#[derive(Debug, Clone)]
pub struct StormBench {
    /// The event plane.
    pub plane: Plane,
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
    /// Extra sidecar configuration (TOML lines appended to `[nats]`; NATS only).
    pub nats_toml: String,
}

impl StormBench {
    /// The full ladder: a 256-worker fleet, 50k to 400k events/s for 4 s each, a 200,000-event
    /// burst.
    pub fn full() -> Self {
        StormBench {
            plane: Plane::Nats,
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
const SUBJECT_ENDPOINT: &str = "generate";
/// Messages a ZMQ publisher queues for a subscriber before it drops (vLLM's and Dynamo's).
const PUBLISHER_HWM: i32 = 100_000;
/// Tokens per block.
const BLOCK_SIZE: u32 = 16;

/// Where worker `w` (from 0) serves requests: its `[[workers]]` or discovery address, and the
/// `worker` label of its index series.
fn worker_address(w: u64) -> String {
    format!("127.0.0.1:{}", 20_000 + w)
}

/// The `worker` label of worker `id`'s index series: its address, and a discovered instance's
/// id after it (Dynamo instances share an address per process).
fn worker_label(plane: Plane, id: u64) -> String {
    match plane {
        Plane::DynamoZmq => format!("{}/{id:x}", worker_address(id - 1)),
        _ => worker_address(id - 1),
    }
}

/// One change to a worker's cache.
enum Change {
    /// One block stored after `parent`.
    Stored { parent: Option<u64>, hash: u64 },
    /// The whole chain removed.
    Removed(Vec<u64>),
}

/// One worker as the publisher plays it: its chain so far and its event ids.
struct Worker {
    /// Its Dynamo instance id (from 1); its address is [`worker_address`]`(id - 1)`.
    id: u64,
    event_id: u64,
    /// Blocks of the current chain (the cache's content).
    chain: Vec<u64>,
    /// A counter making every block hash unique.
    next_block: u64,
    /// Messages published (the number of the next).
    sent: u64,
}

impl Worker {
    fn new(id: u64) -> Self {
        Worker {
            id,
            event_id: 0,
            chain: Vec::new(),
            next_block: 0,
            sent: 0,
        }
    }

    /// The next change: extend the chain by one block, or remove the whole chain once full.
    fn change(&mut self, chain: u64) -> Change {
        if self.chain.len() as u64 >= chain {
            return Change::Removed(std::mem::take(&mut self.chain));
        }
        self.next_block += 1;
        let hash = (self.id << 40) | self.next_block;
        let parent = self.chain.last().copied();
        self.chain.push(hash);
        Change::Stored { parent, hash }
    }

    /// The next message of `events` changes, framed for `plane`.
    fn message(&mut self, plane: Plane, chain: u64, events: u64, published_at: u64) -> Outgoing {
        let changes: Vec<Change> = (0..events).map(|_| self.change(chain)).collect();
        let sequence = self.sent;
        self.sent += 1;
        if plane == Plane::VllmZmq {
            let batch = EventBatch {
                ts: published_at as f64 / 1000.0,
                events: changes.into_iter().map(vllm_event).collect(),
                ..EventBatch::default()
            };
            let payload = encode_batch(&batch, EventEncoding::Map);
            return Outgoing::Frames(vec![Vec::new(), sequence.to_be_bytes().to_vec(), payload]);
        }
        let events: Vec<RouterEvent> = changes.into_iter().map(|c| self.router_event(c)).collect();
        let header = EnvelopeHeader {
            publisher_id: publisher_id(plane, self.id),
            sequence,
            published_at,
            topic: KV_EVENTS_TOPIC,
        };
        match plane {
            Plane::Nats => Outgoing::Body(encode_v16(header, &events)),
            _ => Outgoing::Frames(encode_frames(
                &envelope_v16(header, &events),
                KV_EVENTS_TOPIC,
            )),
        }
    }

    fn router_event(&mut self, change: Change) -> RouterEvent {
        self.event_id += 1;
        let data = match change {
            Change::Removed(hashes) => KvCacheEventData::Removed(RemovedBlocks {
                block_hashes: hashes,
            }),
            Change::Stored { parent, hash } => KvCacheEventData::Stored(StoredBlocks {
                parent_hash: parent,
                start_position: None,
                blocks: vec![StoredBlock {
                    block_hash: hash,
                    tokens_hash: hash ^ 0x5555,
                    mm_extra_info: None,
                }],
            }),
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

/// A change as vLLM publishes it: the block's tokens are its hash's, so every block differs.
fn vllm_event(change: Change) -> VllmEvent {
    match change {
        Change::Stored { parent, hash } => VllmEvent::BlockStored {
            block_hashes: std::iter::once(EngineBlockHash(hash)).collect(),
            parent: parent.map(EngineBlockHash),
            token_ids: (0..BLOCK_SIZE)
                .map(|k| (hash as u32) ^ ((hash >> 32) as u32) << 8 ^ k)
                .collect(),
            block_size: BLOCK_SIZE,
            lora_name: None,
            medium: Some("GPU".into()),
            has_extra_keys: std::iter::once(false).collect(),
            group: None,
            kind: None,
        },
        Change::Removed(hashes) => VllmEvent::BlockRemoved {
            block_hashes: hashes.into_iter().map(EngineBlockHash).collect(),
            medium: Some("GPU".into()),
            group: None,
        },
    }
}

/// A worker's publisher id: its instance id on NATS (one publisher a worker), a number of its
/// own on Dynamo's ZMQ plane (the event channel's, tied to the worker by discovery).
fn publisher_id(plane: Plane, worker: u64) -> u64 {
    match plane {
        Plane::DynamoZmq => (1 << 44) | worker,
        _ => worker,
    }
}

/// One message on its way.
enum Outgoing {
    /// A NATS message body.
    Body(Vec<u8>),
    /// A ZMQ multipart message.
    Frames(Vec<Vec<u8>>),
}

/// What the publisher sends on.
enum Sink {
    Nats(async_nats::Client),
    /// One XPUB socket a worker (XPUB: it hears each subscription, so the storm starts only once
    /// the sidecar listens everywhere).
    Zmq {
        _context: zmq::Context,
        sockets: Vec<zmq::Socket>,
    },
}

impl Sink {
    /// A NATS client, or one socket a worker bound on a free port (their endpoints returned).
    async fn open(plane: Plane, nats_port: u16, workers: usize) -> Result<(Sink, Vec<String>)> {
        if plane == Plane::Nats {
            let client = async_nats::connect(format!("nats://127.0.0.1:{nats_port}")).await?;
            return Ok((Sink::Nats(client), Vec::new()));
        }
        let context = zmq::Context::new();
        let mut sockets = Vec::with_capacity(workers);
        let mut endpoints = Vec::with_capacity(workers);
        for _ in 0..workers {
            let socket = context.socket(zmq::XPUB)?;
            socket.set_sndhwm(PUBLISHER_HWM)?;
            socket.set_linger(0)?;
            socket.bind("tcp://127.0.0.1:0")?;
            let endpoint = socket
                .get_last_endpoint()?
                .map_err(|_| anyhow::anyhow!("endpoint not UTF-8"))?;
            endpoints.push(endpoint);
            sockets.push(socket);
        }
        Ok((
            Sink::Zmq {
                _context: context,
                sockets,
            },
            endpoints,
        ))
    }

    /// Until every socket heard a subscription (NATS: the sidecar's line said it subscribed).
    async fn wait_subscribed(&self, log: &std::path::Path) -> Result<()> {
        let Sink::Zmq { sockets, .. } = self else {
            return wait_log(log, SIDECAR_SUBSCRIBED, Duration::from_secs(20)).await;
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        for (w, socket) in sockets.iter().enumerate() {
            loop {
                match socket.recv_bytes(zmq::DONTWAIT) {
                    Ok(m) if m.first() == Some(&1) => break,
                    Ok(_) => continue,
                    Err(zmq::Error::EAGAIN) if Instant::now() < deadline => {
                        tokio::time::sleep(Duration::from_millis(20)).await
                    }
                    Err(e) => bail!("worker {w}'s socket heard no subscription: {e}"),
                }
            }
        }
        Ok(())
    }

    async fn send(&mut self, worker: usize, message: Outgoing) -> Result<()> {
        match (self, message) {
            (Sink::Nats(client), Outgoing::Body(body)) => client
                .publish(
                    subject_v16(SUBJECT_NAMESPACE, SUBJECT_COMPONENT, SUBJECT_ENDPOINT),
                    body.into(),
                )
                .await
                .context("publishing"),
            // A PUB socket never blocks: past its high-water mark it drops, as the engines'.
            (Sink::Zmq { sockets, .. }, Outgoing::Frames(frames)) => sockets[worker]
                .send_multipart(frames, 0)
                .context("publishing"),
            _ => bail!("a message framed for another plane"),
        }
    }

    async fn flush(&self) -> Result<()> {
        match self {
            Sink::Nats(client) => client.flush().await.context("flushing"),
            Sink::Zmq { .. } => Ok(()),
        }
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Publish `total` events round-robin over `workers`, `batch` of one worker's in a message, at
/// `rate` events per second (`None`: as fast as the publisher sends). Returns the publisher's
/// elapsed time.
async fn publish(
    sink: &mut Sink,
    workers: &mut [Worker],
    bench: &StormBench,
    total: u64,
    rate: Option<u64>,
) -> Result<Duration> {
    let start = Instant::now();
    let published_at = now_ms();
    let messages = total.div_ceil(bench.batch);
    for n in 0..messages {
        if let Some(rate) = rate {
            // Paced: ahead of the schedule, wait for it.
            if n % 64 == 0 {
                let due = Duration::from_secs_f64((n * bench.batch) as f64 / rate as f64);
                let elapsed = start.elapsed();
                if due > elapsed {
                    tokio::time::sleep(due - elapsed).await;
                }
            }
        }
        let w = (n % workers.len() as u64) as usize;
        let events = bench.batch.min(total - n * bench.batch);
        let message = workers[w].message(bench.plane, bench.chain, events, published_at);
        sink.send(w, message).await?;
    }
    sink.flush().await?;
    Ok(start.elapsed())
}

/// After a step, one more event from every worker, unhurried, as a live fleet goes on
/// publishing: a loss at the end of a worker's stream then shows as a gap too, so the
/// sidecar's own count of lost events can be held to the outside count exactly.
async fn publish_tail(sink: &mut Sink, workers: &mut [Worker], bench: &StormBench) -> Result<u64> {
    tokio::time::sleep(Duration::from_millis(500)).await;
    for (w, worker) in workers.iter_mut().enumerate() {
        let message = worker.message(bench.plane, bench.chain, 1, now_ms());
        sink.send(w, message).await?;
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    sink.flush().await?;
    Ok(workers.len() as u64)
}

/// The sidecar's configuration, from its own types: the model, then the fleet as each plane
/// names it — NATS and `[[workers]]` with their Dynamo ids, `[[workers]]` and a `[[zmq]]` each,
/// or discovery records under `dir` — as the TOML it reads, [`StormBench::nats_toml`] merged
/// into `[nats]`.
fn sidecar_config(
    port: u16,
    nats_port: u16,
    bench: &StormBench,
    endpoints: &[String],
    dir: &std::path::Path,
) -> Result<String> {
    let mut config: Config = typed(
        "storm sidecar",
        json!({
            "listen": format!("127.0.0.1:{port}"),
            "models": [{"name": "m", "dir": paths::model_dir(), "block_size": BLOCK_SIZE}],
        }),
    )?;
    let mut extra = toml::Table::new();
    match bench.plane {
        Plane::Nats => {
            config.nats = Some(typed(
                "nats",
                json!({"url": format!("nats://127.0.0.1:{nats_port}")}),
            )?);
            let nats = sidecar_toml::table("StormBench::nats_toml", &bench.nats_toml)?;
            extra.insert("nats".into(), toml::Value::Table(nats));
            for w in 0..bench.workers as u64 {
                config.workers.push(typed(
                    "worker",
                    json!({"address": worker_address(w), "model": "m", "dynamo_worker_id": w + 1}),
                )?);
            }
        }
        Plane::VllmZmq => {
            for (w, endpoint) in endpoints.iter().enumerate() {
                let address = worker_address(w as u64);
                config
                    .workers
                    .push(typed("worker", json!({"address": address, "model": "m"}))?);
                config.zmq.push(typed(
                    "zmq",
                    json!({"endpoint": endpoint, "worker": address}),
                )?);
            }
        }
        Plane::DynamoZmq => {
            let root = dir.join("discovery");
            write_discovery(&root, endpoints)?;
            config.dynamo_discovery.push(typed(
                "dynamo_discovery",
                json!({"dir": root, "model": "m", "poll_interval_ms": 100}),
            )?);
        }
    }
    sidecar_toml::text(&config, extra)
}

/// Dynamo's file-store records of the fleet (the layout `observers/discovery.rs` reads): each
/// worker's `generate` endpoint, the helper endpoint tying its publisher to it, and its
/// `kv-events` event channel on ZMQ.
fn write_discovery(root: &std::path::Path, endpoints: &[String]) -> Result<()> {
    let write = |bucket: &str, key: String, record: Value| -> Result<()> {
        let dir = root.join("v1").join(bucket);
        std::fs::create_dir_all(&dir)?;
        let name = key.replace('_', "%5F").replace('/', "%2F");
        Ok(std::fs::write(dir.join(name), record.to_string())?)
    };
    let endpoint_record = |id: u64, endpoint: &str| {
        json!({
            "type": "Endpoint", "namespace": SUBJECT_NAMESPACE, "component": SUBJECT_COMPONENT,
            "endpoint": endpoint, "instance_id": id,
            "transport": {"tcp": format!("{}/{id:x}/{SUBJECT_NAMESPACE}/{SUBJECT_COMPONENT}/{endpoint}", worker_address(id - 1))},
        })
    };
    for (w, endpoint) in endpoints.iter().enumerate() {
        let id = w as u64 + 1;
        let publisher = publisher_id(Plane::DynamoZmq, id);
        let query = format!("worker_kv_query_source_{publisher:x}");
        write(
            "instances",
            format!("{SUBJECT_NAMESPACE}/{SUBJECT_COMPONENT}/{SUBJECT_ENDPOINT}/{id:x}"),
            endpoint_record(id, SUBJECT_ENDPOINT),
        )?;
        write(
            "instances",
            format!("{SUBJECT_NAMESPACE}/{SUBJECT_COMPONENT}/{query}/{id:x}"),
            endpoint_record(id, &query),
        )?;
        write(
            "event_channels",
            format!("namespace/{SUBJECT_NAMESPACE}/component/{SUBJECT_COMPONENT}/endpoint/{SUBJECT_ENDPOINT}/topic/{KV_EVENTS_TOPIC}/{publisher:x}"),
            json!({
                "type": "EventChannel",
                "scope": {"kind": "endpoint", "endpoint": {"namespace": SUBJECT_NAMESPACE, "component": SUBJECT_COMPONENT, "name": SUBJECT_ENDPOINT}},
                "topic": KV_EVENTS_TOPIC, "instance_id": publisher,
                "transport": {"kind": "Zmq", "config": {"endpoint": endpoint}},
            }),
        )?;
    }
    Ok(())
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
    let (mut sink, endpoints) = Sink::open(bench.plane, nats_port, bench.workers).await?;
    let config = dir.join("sidecar.toml");
    std::fs::write(
        &config,
        sidecar_config(port, nats_port, bench, &endpoints, &dir)?,
    )?;
    let mut cmd = Command::new(paths::binary("kvroute-sidecar")?);
    cmd.arg("serve").arg("--config").arg(&config);
    let mut sidecar = Process::spawn("sidecar", cmd, &dir)?;
    let log = dir.join("sidecar.log");
    sink.wait_subscribed(&log).await?;

    let mut workers: Vec<Worker> = (1..=bench.workers as u64).map(Worker::new).collect();
    let took = publish(&mut sink, &mut workers, bench, total, rate).await?;
    let rate_published = total as f64 / took.as_secs_f64();
    let total = total + publish_tail(&mut sink, &mut workers, bench).await?;

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
            "kvroute_index_blocks{{worker=\"{}\"}}",
            worker_label(bench.plane, w.id)
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
        "storm {} {label}: {total} events (the last {} unhurried) in {:.2} s ({:.0}/s): {} applied, {:.2}% lost, {wrong_workers} of {} workers' caches wrong",
        bench.plane.name(),
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
    let _server = match bench.plane {
        Plane::Nats => Some(start_nats(nats_port, &dir).await?),
        _ => None,
    };
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
        "plane": bench.plane.name(),
        "workers": bench.workers,
        "seconds_per_rate": bench.seconds,
        "chain": bench.chain,
        "events_per_message": bench.batch,
        "nats_toml": bench.nats_toml,
        "highest_lossless_rate": lossless,
        "steps": steps,
    });
    let stem = file_stem(bench.plane, bench.batch);
    crate::report::write_pair(out, &stem, &doc, &markdown(&doc))?;
    Ok(doc)
}

/// `storm_batch1` (NATS), `storm_vllm_zmq_batch1`, …: the files of a run on `plane` with
/// `batch` events per message.
pub fn file_stem(plane: Plane, batch: u64) -> String {
    match plane {
        Plane::Nats => format!("storm_batch{batch}"),
        _ => format!("storm_{}_batch{batch}", plane.name().replace('-', "_")),
    }
}

/// The table docs/benchmarks.md quotes.
pub fn markdown(doc: &Value) -> String {
    let mut s = format!(
        "{} workers on {}, {} events per message; highest sustained rate with nothing lost: {}\n\n| step | events | published events/s | applied | lost | caches wrong | sidecar: lost events / client drops / gaps | log lines |\n|---|---|---|---|---|---|---|---|\n",
        doc["workers"],
        doc["plane"].as_str().unwrap_or("nats"),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn read_back(plane: Plane, nats_toml: &str, dir: &std::path::Path) -> Config {
        let bench = StormBench {
            plane,
            workers: 3,
            nats_toml: nats_toml.into(),
            ..StormBench::full()
        };
        let endpoints: Vec<String> = (0..3)
            .map(|i| format!("tcp://127.0.0.1:{}", 9100 + i))
            .collect();
        let text = sidecar_config(7000, 4222, &bench, &endpoints, dir).unwrap();
        toml::from_str(&text).unwrap()
    }

    /// Each plane's fleet reads back as the sidecar will see it; `nats_toml` lands in `[nats]`,
    /// and a field `[nats]` does not have is refused.
    #[test]
    fn each_planes_configuration_reads_back() {
        let dir = std::env::temp_dir().join(format!("kvroute-storm-config-{}", std::process::id()));
        let nats = read_back(Plane::Nats, "buffer_messages = 1024", &dir);
        let n = nats.nats.unwrap();
        assert_eq!(
            (n.url.as_str(), n.buffer_messages),
            ("nats://127.0.0.1:4222", 1024)
        );
        assert_eq!(nats.workers[2].dynamo_worker_id, Some(3));
        let vllm = read_back(Plane::VllmZmq, "", &dir);
        assert!(vllm.nats.is_none());
        assert_eq!(vllm.zmq.len(), 3);
        assert_eq!(
            vllm.zmq[1].worker.as_deref(),
            Some(worker_address(1).as_str())
        );
        let dynamo = read_back(Plane::DynamoZmq, "", &dir);
        assert_eq!(dynamo.dynamo_discovery.len(), 1);
        assert!(dir.join("discovery/v1/event_channels").is_dir());
        let bench = StormBench {
            nats_toml: "buffer_message = 1".into(),
            ..StormBench::full()
        };
        assert!(sidecar_config(7000, 4222, &bench, &[], &dir).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
