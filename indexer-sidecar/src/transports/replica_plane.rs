//! The replica plane on NATS: every `interval_ms` this sidecar publishes its caches' digests on
//! `kvroute.replicas.<group>.digests`, and compares every peer's that arrives there. Peers find
//! each other by the subject alone; nothing is configured per peer. A cache of ours that is
//! divergent and unclean is repaired from a clean peer's snapshot, asked for on
//! `kvroute.replicas.<group>.snapshot.<peer>` (NATS request/reply, in chunks of one snapshot).
//! KV-event messages lost on the way here (a gap in a stream) are asked of every peer at once
//! on `kvroute.replicas.<group>.fill`; each peer that applied some of them sends its copies to
//! the asker's `kvroute.replicas.<group>.filled.<asker>`. With every replica losing a few
//! messages of its own, that keeps them all clean: no snapshot is needed. With `share_load`,
//! each replica also shares its requests in flight per worker on
//! `kvroute.replicas.<group>.load` (coalesced: at most every `load_interval_ms`, when they
//! changed), so each weighs the load the whole set of replicas put on a worker.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures::StreamExt;

use crate::config::{NatsConfig, ReplicasConfig};
use crate::core::block_map::Entry;
use crate::core::digest::Snapshot;
use crate::core::Input;
use crate::metrics::{Direction, DirectionLabel};
use crate::replicas::{
    CacheKey, Digests, FillReply, FillRequest, LoadShare, SnapshotChunk, SnapshotRequest, Why,
};
use crate::sidecar::Sidecar;

/// Entries per snapshot chunk: about 40 bytes each as JSON, under NATS's default 1 MiB payload.
const CHUNK: usize = 16_384;
/// How long a snapshot taken for a peer serves its further chunks.
const SNAPSHOT_KEPT: Duration = Duration::from_secs(10);
/// Entries a peer's snapshot may have (the default `[index] max_blocks_per_cache`): a peer
/// claiming more is not believed, and cannot make this replica hold more.
const MAX_SNAPSHOT: usize = 1 << 22;
/// How long one chunk may take to arrive.
const CHUNK_TIMEOUT: Duration = Duration::from_secs(5);
/// Bytes of checkpoints a digests message may carry (about 70 each as JSON): NATS's default
/// `max_payload` is 1 MiB.
const DIGESTS_BUDGET: usize = 512 << 10;

/// Messages a fill reply carries at most (a request asks for at most
/// [`crate::core::digest::RECENT`]; the rest is asked again on the next round).
const FILL_MESSAGES: usize = 64;

/// Keep each cache's newest checkpoints, as many as fit the budget for all of them (at least
/// 4: a peer needs a few to find a message in common).
fn fit(mut caches: Vec<crate::core::digest::CacheReport>) -> Vec<crate::core::digest::CacheReport> {
    let per_cache =
        (DIGESTS_BUDGET / 70 / caches.len().max(1)).clamp(4, crate::core::digest::CHECKPOINTS);
    for c in &mut caches {
        let extra = c.checkpoints.len().saturating_sub(per_cache);
        c.checkpoints.drain(..extra);
    }
    caches
}

/// Largest digests message read: a peer cannot make us decode more (NATS's own `max_payload`
/// is usually 1 MiB).
const MAX_MESSAGE: usize = 8 << 20;

/// Publish and compare until the process ends; a lost connection is the client's to redo.
pub async fn run(
    config: ReplicasConfig,
    nats: Option<NatsConfig>,
    state: Arc<Sidecar>,
) -> anyhow::Result<()> {
    // Our own NATS server when one is named, else the event plane's (with its authentication).
    let (url, options) = match (&config.nats_url, &nats) {
        (Some(url), _) => (url.clone(), async_nats::ConnectOptions::new()),
        (None, Some(n)) => (n.url.clone(), super::nats::connect_options(n).await?),
        (None, None) => anyhow::bail!("[replicas] has no NATS server"),
    };
    let shown = crate::config::redact_url(&url);
    let client = options
        .retry_on_initial_connect()
        .name("kvroute-replica")
        .connect(url.as_str())
        .await
        .with_context(|| format!("replica plane: connecting to NATS at {shown}"))?;
    let subject = config.subject();
    let mut sub = client
        .subscribe(subject.clone())
        .await
        .with_context(|| format!("replica plane: subscribing to {subject}"))?;
    let me = state.replicas().me().to_owned();
    let snapshots = format!("kvroute.replicas.{}.snapshot", config.group);
    let mut asked = client
        .subscribe(format!("{snapshots}.{me}"))
        .await
        .context("replica plane: subscribing to snapshot requests")?;
    let fills = format!("kvroute.replicas.{}.fill", config.group);
    let mut fill_asks = client
        .subscribe(fills.clone())
        .await
        .context("replica plane: subscribing to fill requests")?;
    let filled_subject = format!("kvroute.replicas.{}.filled.{me}", config.group);
    let mut filled = client
        .subscribe(filled_subject.clone())
        .await
        .context("replica plane: subscribing to fill replies")?;
    let loads = format!("kvroute.replicas.{}.load", config.group);
    // Without sharing, a subscription that never delivers: one loop either way.
    let mut peer_loads = client
        .subscribe(if config.share_load {
            loads.clone()
        } else {
            format!("{loads}.off.{me}")
        })
        .await
        .context("replica plane: subscribing to shared loads")?;
    let mut load_tick = tokio::time::interval(Duration::from_millis(config.load_interval_ms));
    load_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut shared: (Vec<(String, u32)>, Option<Instant>) = (Vec::new(), None);
    let mut fill_tick = tokio::time::interval(config.fill_interval());
    fill_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut taken: HashMap<CacheKey, (Instant, Arc<Snapshot>)> = HashMap::new();
    tracing::info!(replica = %me, %subject, nats = %shown, "replica plane: publishing and comparing digests");
    let mut tick = tokio::time::interval(Duration::from_millis(config.interval_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                // One look at the core per tick: the repairs below read the same reports.
                let (mine, served) = {
                    let core = state.core();
                    (core.reports(), core.served())
                };
                let digests = Digests { replica: me.clone(), caches: fit(mine.clone()), served };
                match serde_json::to_vec(&digests) {
                    Ok(body) => {
                        if let Err(e) = client.publish(subject.clone(), body.into()).await {
                            tracing::warn!(error = %e, "replica plane: cannot publish digests");
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "replica plane: cannot encode digests"),
                }
                state.replica_gauges(Instant::now());
                if !config.reconcile {
                    continue;
                }
                let repairs = state.replicas().repairs(&mine, Instant::now());
                for (peer, cache, why) in repairs {
                    if state.core().fleet().by_address(&cache.0).is_none() {
                        // A worker of a peer's fleet this replica does not serve.
                        continue;
                    }
                    if matches!(why, Why::Divergent { .. } | Why::Unclean) {
                        tracing::warn!(%peer, worker = %cache.0, rank = cache.1, why = %why.describe(), "replica plane: taking a peer's copy of a cache");
                    }
                    let (client, state, subject) =
                        (client.clone(), state.clone(), format!("{snapshots}.{peer}"));
                    tokio::spawn(async move {
                        let fetched = fetch(&client, &subject, &cache, &state).await;
                        match fetched {
                            Ok(snapshot) => {
                                let input = Input::Snapshot {
                                    worker: &cache.0,
                                    rank: cache.1,
                                    snapshot: &snapshot,
                                };
                                state.ingest(None, input, Instant::now());
                            }
                            Err(e) => tracing::warn!(%peer, worker = %cache.0, rank = cache.1, error = %format!("{e:#}"), "replica plane: snapshot from peer failed; asking again later"),
                        }
                        state.replicas().repaired(&cache);
                    });
                }
            }
            _ = load_tick.tick(), if config.share_load => {
                let now = Instant::now();
                let mine = state.core().own_in_flight();
                let heartbeat = Duration::from_millis(config.interval_ms);
                let due = shared.0 != mine
                    || shared.1.is_none_or(|t| now.saturating_duration_since(t) >= heartbeat);
                if due {
                    let share = LoadShare { replica: me.clone(), in_flight: mine.clone() };
                    if let Ok(body) = serde_json::to_vec(&share) {
                        if let Err(e) = client.publish(loads.clone(), body.into()).await {
                            tracing::warn!(error = %e, "replica plane: cannot share load");
                        }
                    }
                    shared = (mine, Some(now));
                }
            }
            msg = peer_loads.next() => {
                let Some(msg) = msg else {
                    anyhow::bail!("replica plane: subscription to {loads} ended");
                };
                if msg.payload.len() > MAX_MESSAGE {
                    continue;
                }
                match serde_json::from_slice::<LoadShare>(&msg.payload) {
                    Ok(share) if share.replica != me => {
                        let input = Input::PeerLoad { peer: &share.replica, in_flight: &share.in_flight };
                        state.ingest(None, input, Instant::now());
                    }
                    Ok(_) => {}
                    Err(e) => tracing::warn!(error = %e, "replica plane: undecodable load message ignored"),
                }
            }
            _ = fill_tick.tick(), if config.reconcile => {
                // Lost a fill interval ago: a peer a little behind has them by now.
                let wanted = state.core().wanted(Instant::now(), config.fill_interval());
                for ((worker, rank), seqs) in wanted {
                    let ask = FillRequest { replica: me.clone(), worker, rank, seqs };
                    let Ok(body) = serde_json::to_vec(&ask) else { continue };
                    if let Err(e) = client.publish_with_reply(fills.clone(), filled_subject.clone(), body.into()).await {
                        tracing::warn!(error = %e, "replica plane: cannot ask peers for lost messages");
                    }
                }
            }
            ask = fill_asks.next() => {
                let Some(ask) = ask else {
                    anyhow::bail!("replica plane: fill subscription ended");
                };
                let Some(reply) = ask.reply.clone() else {
                    continue;
                };
                if let Some(body) = fill_answer(&ask.payload, &me, &state) {
                    if let Err(e) = client.publish(reply, body.into()).await {
                        tracing::warn!(error = %e, "replica plane: cannot hand lost messages to a peer");
                    }
                }
            }
            reply = filled.next() => {
                let Some(reply) = reply else {
                    anyhow::bail!("replica plane: fill reply subscription ended");
                };
                if reply.payload.len() > MAX_MESSAGE {
                    continue;
                }
                match serde_json::from_slice::<FillReply>(&reply.payload) {
                    Ok(f) => {
                        let input = Input::Fill { worker: &f.worker, rank: f.rank, messages: &f.messages };
                        state.ingest(None, input, Instant::now());
                    }
                    Err(e) => tracing::warn!(error = %e, "replica plane: undecodable fill reply ignored"),
                }
            }
            req = asked.next() => {
                let Some(req) = req else {
                    anyhow::bail!("replica plane: snapshot subscription ended");
                };
                let Some(reply) = req.reply.clone() else {
                    continue;
                };
                let body = answer(&req.payload, &state, &mut taken);
                state
                    .metrics
                    .replica_snapshot_bytes
                    .get_or_create(&DirectionLabel { direction: Direction::Sent })
                    .inc_by(body.len() as u64);
                if let Err(e) = client.publish(reply, body.into()).await {
                    tracing::warn!(error = %e, "replica plane: cannot answer a snapshot request");
                }
            }
            msg = sub.next() => {
                let Some(msg) = msg else {
                    anyhow::bail!("replica plane: subscription to {subject} ended");
                };
                if msg.payload.len() > MAX_MESSAGE {
                    tracing::warn!(bytes = msg.payload.len(), "replica plane: oversized digests message ignored");
                    continue;
                }
                match serde_json::from_slice::<Digests>(&msg.payload) {
                    Ok(theirs) => state.peer_digests(theirs, Instant::now()),
                    Err(e) => tracing::warn!(error = %e, "replica plane: undecodable digests message ignored"),
                }
            }
        }
    }
}

/// Our copies of the messages a peer lost, within a message's budget; `None` for our own
/// request, a bad one, or messages we do not have either.
fn fill_answer(payload: &[u8], me: &str, state: &Sidecar) -> Option<Vec<u8>> {
    if payload.len() > MAX_MESSAGE {
        return None;
    }
    let ask: FillRequest = serde_json::from_slice(payload).ok()?;
    if ask.replica == me {
        return None;
    }
    let seqs = &ask.seqs[..ask.seqs.len().min(crate::core::digest::RECENT)];
    let mut messages = state.core().messages(&ask.worker, ask.rank, seqs);
    messages.truncate(FILL_MESSAGES);
    loop {
        if messages.is_empty() {
            return None;
        }
        let reply = FillReply {
            worker: ask.worker.clone(),
            rank: ask.rank,
            messages,
        };
        let body = serde_json::to_vec(&reply).ok()?;
        if body.len() <= DIGESTS_BUDGET {
            return Some(body);
        }
        messages = reply.messages;
        messages.truncate(messages.len() / 2);
    }
}

/// Answer one snapshot request: a chunk of the snapshot taken for this cache (taken now when
/// the request starts at 0 or the last one is too old); an empty body for a cache not known.
fn answer(
    payload: &[u8],
    state: &Sidecar,
    taken: &mut HashMap<CacheKey, (Instant, Arc<Snapshot>)>,
) -> Vec<u8> {
    let Ok(req) = serde_json::from_slice::<SnapshotRequest>(payload) else {
        return Vec::new();
    };
    let now = Instant::now();
    taken.retain(|_, (at, _)| now.saturating_duration_since(*at) < SNAPSHOT_KEPT);
    let key = (req.worker.clone(), req.rank);
    // A new transfer gets the cache as it is now, unless it has not changed since the last
    // one was taken (taking one holds the core's lock for the cache's size); further chunks
    // come from the snapshot their transfer started with.
    let unchanged = taken
        .get(&key)
        .is_some_and(|(_, s)| state.core().cursor_of(&req.worker, req.rank) == Some(s.seq));
    if !(unchanged || req.offset > 0 && taken.contains_key(&key)) {
        match state.core().snapshot(&req.worker, req.rank) {
            Some(s) => taken.insert(key.clone(), (now, Arc::new(s))),
            None => return Vec::new(),
        };
    }
    let Some((_, snapshot)) = taken.get(&key) else {
        return Vec::new();
    };
    let from = req.offset.min(snapshot.entries.len());
    let to = (from + CHUNK).min(snapshot.entries.len());
    let (entries, parents) = crate::core::digest::to_wire(&snapshot.entries[from..to]);
    let chunk = SnapshotChunk {
        seq: snapshot.seq,
        total: snapshot.entries.len(),
        entries,
        parents,
    };
    serde_json::to_vec(&chunk).unwrap_or_default()
}

/// Ask a peer for its snapshot of `cache`, chunk by chunk, all of one snapshot.
async fn fetch(
    client: &async_nats::Client,
    subject: &str,
    cache: &CacheKey,
    state: &Sidecar,
) -> anyhow::Result<Snapshot> {
    let mut entries: Vec<Entry> = Vec::new();
    let mut seq = None;
    loop {
        let req = SnapshotRequest {
            worker: cache.0.clone(),
            rank: cache.1,
            offset: entries.len(),
        };
        let body = serde_json::to_vec(&req)?;
        let reply = tokio::time::timeout(
            CHUNK_TIMEOUT,
            client.request(subject.to_owned(), body.into()),
        )
        .await
        .context("no answer in time")?
        .context("request failed")?;
        state
            .metrics
            .replica_snapshot_bytes
            .get_or_create(&DirectionLabel {
                direction: Direction::Received,
            })
            .inc_by(reply.payload.len() as u64);
        anyhow::ensure!(
            !reply.payload.is_empty(),
            "the peer does not know this cache"
        );
        let chunk: SnapshotChunk = serde_json::from_slice(&reply.payload).context("bad chunk")?;
        anyhow::ensure!(
            chunk.total <= MAX_SNAPSHOT,
            "the peer's snapshot claims {} entries, more than any cache holds",
            chunk.total
        );
        anyhow::ensure!(
            seq.is_none_or(|s| s == chunk.seq),
            "the peer's snapshot changed during the transfer"
        );
        seq = Some(chunk.seq);
        let got = chunk.entries.len();
        entries.extend(crate::core::digest::from_wire(
            &chunk.entries,
            &chunk.parents,
        ));
        if entries.len() >= chunk.total || got == 0 {
            anyhow::ensure!(entries.len() == chunk.total, "short snapshot");
            return Ok(Snapshot {
                seq: chunk.seq,
                entries,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::digest::{CacheReport, Checkpoint, CHECKPOINTS};

    /// However many caches, a digests message stays within NATS's payload limit.
    #[test]
    fn digests_fit_a_nats_message() {
        let cache = |i: u32| CacheReport {
            worker: format!("10.0.{}.{}:8000", i / 250, i % 250),
            rank: i % 8,
            clean: true,
            filling: false,
            lost_at: u64::MAX,
            checkpoints: (0..CHECKPOINTS as u64)
                .map(|seq| Checkpoint {
                    seq: u64::MAX - seq,
                    blocks: u64::MAX,
                    digest: u64::MAX,
                })
                .collect(),
        };
        for n in [1, 64, 512] {
            let caches = fit((0..n).map(cache).collect());
            let body = serde_json::to_vec(&Digests {
                replica: "r".into(),
                caches,
                served: Vec::new(),
            })
            .unwrap();
            assert!(body.len() < 1 << 20, "{n} caches: {} bytes", body.len());
        }
    }
}
