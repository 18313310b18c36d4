//! The replica plane on NATS: the loop that reads the group's subjects and the intervals,
//! hands each to the [`super::brain::Brain`] with the facts it needs from the core, and
//! executes what it decides. Nothing is decided here.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures::StreamExt;

use super::brain::{Effect, Event};
use super::peers::Why;
use super::wire::{self, CacheKey, SnapshotChunk, SnapshotRequest};
use crate::config::{NatsConfig, ReplicasConfig};
use crate::core::block_map::Entry;
use crate::core::digest::Snapshot;
use crate::core::Input;
use crate::metrics::Direction;
use crate::sidecar::Sidecar;

/// Entries a peer's snapshot may have (the default `[index] max_blocks_per_cache`): a peer
/// claiming more is not believed, and cannot make this replica hold more.
const MAX_SNAPSHOT: usize = 1 << 22;
/// How long one chunk may take to arrive.
const CHUNK_TIMEOUT: Duration = Duration::from_secs(5);

/// Read and execute until the process ends; a lost connection is the client's to redo.
pub async fn run(
    config: ReplicasConfig,
    nats: Option<NatsConfig>,
    state: Arc<Sidecar>,
) -> anyhow::Result<()> {
    // Our own NATS server when one is named, else the event plane's (with its authentication).
    let (url, options) = match (&config.nats_url, &nats) {
        (Some(url), _) => (
            url.clone(),
            crate::transports::nats::url_credentials(async_nats::ConnectOptions::new(), url),
        ),
        (None, Some(n)) => (
            n.url.clone(),
            crate::transports::nats::connect_options(n).await?,
        ),
        (None, None) => anyhow::bail!("[replicas] has no NATS server"),
    };
    let shown = crate::config::redact_url(&url);
    let client = options
        .retry_on_initial_connect()
        .name("kvroute-replica")
        .connect(crate::config::without_credentials(&url))
        .await
        .with_context(|| format!("replica plane: connecting to NATS at {shown}"))?;
    let (me, subjects) = state.replica_identity();
    let subscribe = |subject: String| {
        let client = client.clone();
        async move {
            client
                .subscribe(subject.clone())
                .await
                .with_context(|| format!("replica plane: subscribing to {subject}"))
        }
    };
    let mut digests = subscribe(subjects.digests.clone()).await?;
    let mut asked = subscribe(format!("{}.{me}", subjects.snapshots)).await?;
    let mut fill_asks = subscribe(subjects.fills.clone()).await?;
    let mut filled = subscribe(subjects.filled.clone()).await?;
    // Without sharing, a subscription that never delivers: one loop either way.
    let mut peer_loads = subscribe(if config.share_load {
        subjects.loads.clone()
    } else {
        format!("{}.off.{me}", subjects.loads)
    })
    .await?;
    let every = |ms: Duration| {
        let mut t = tokio::time::interval(ms);
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        t
    };
    let mut tick = every(Duration::from_millis(config.interval_ms));
    let mut load_tick = every(Duration::from_millis(config.load_interval_ms));
    let mut fill_tick = every(config.fill_interval());
    tracing::info!(replica = %me, subject = %subjects.digests, nats = %shown, "replica plane: publishing and comparing digests");
    loop {
        let effects = tokio::select! {
            _ = tick.tick() => state.replica_tick(Instant::now()),
            _ = load_tick.tick(), if config.share_load => state.replica_load_tick(Instant::now()),
            // Lost a fill interval ago: a peer a little behind has them by now.
            _ = fill_tick.tick(), if config.reconcile => {
                state.replica_fill_tick(config.fill_interval(), Instant::now())
            }
            msg = digests.next() => {
                let msg = msg.context("replica plane: digests subscription ended")?;
                state.replica_digests(&msg.payload, Instant::now())
            }
            msg = peer_loads.next() => {
                let msg = msg.context("replica plane: load subscription ended")?;
                state.replicate(Event::PeerLoad(&msg.payload), Instant::now())
            }
            msg = fill_asks.next() => {
                let msg = msg.context("replica plane: fill subscription ended")?;
                let reply = msg.reply.as_ref().map(|r| r.as_str());
                state.replicate(Event::FillAsked { payload: &msg.payload, reply }, Instant::now())
            }
            msg = filled.next() => {
                let msg = msg.context("replica plane: fill reply subscription ended")?;
                state.replicate(Event::Filled(&msg.payload), Instant::now())
            }
            msg = asked.next() => {
                let msg = msg.context("replica plane: snapshot subscription ended")?;
                let Some(reply) = msg.reply.clone() else { continue };
                match super::brain::Brain::snapshot_request(&msg.payload) {
                    Some(request) => state.replica_snapshot_asked(request, &reply, Instant::now()),
                    None => vec![Effect::Answer { reply: reply.to_string(), body: Vec::new() }],
                }
            }
        };
        execute(effects, &client, &state).await;
    }
}

/// Carry out what the brain decided; what it leads to (a snapshot taken) goes back to it.
async fn execute(mut effects: Vec<Effect>, client: &async_nats::Client, state: &Arc<Sidecar>) {
    while let Some(effect) = effects.pop() {
        match effect {
            Effect::Publish {
                subject,
                reply,
                body,
            } => {
                let sent = match reply {
                    Some(reply) => client.publish_with_reply(subject, reply, body.into()).await,
                    None => client.publish(subject, body.into()).await,
                };
                if let Err(e) = sent {
                    tracing::warn!(error = %e, "replica plane: cannot publish");
                }
            }
            Effect::Answer { reply, body } => {
                state.snapshot_bytes(Direction::Sent, body.len());
                if let Err(e) = client.publish(reply, body.into()).await {
                    tracing::warn!(error = %e, "replica plane: cannot answer a snapshot request");
                }
            }
            Effect::Fetch {
                peer,
                subject,
                cache,
                why,
            } => {
                if matches!(
                    why,
                    Why::Divergent { .. } | Why::Unclean | Why::NoCleanCopy { .. }
                ) {
                    tracing::warn!(%peer, worker = %cache.0, rank = cache.1, why = %why.describe(), "replica plane: taking a peer's copy of a cache");
                }
                let (client, state) = (client.clone(), state.clone());
                tokio::spawn(async move {
                    match fetch(&client, &subject, &cache, &state).await {
                        Ok(snapshot) => {
                            let input = Input::Snapshot {
                                worker: &cache.0,
                                rank: cache.1,
                                snapshot: &snapshot,
                                clean: why.takes_clean_copy(),
                            };
                            state.ingest(input, Instant::now());
                        }
                        Err(e) => {
                            tracing::warn!(%peer, worker = %cache.0, rank = cache.1, error = %format!("{e:#}"), "replica plane: snapshot from peer failed; asking again later")
                        }
                    }
                    state.replicate(Event::Fetched(cache), Instant::now());
                });
            }
            Effect::PeerLoad(share) => {
                let input = Input::PeerLoad {
                    peer: &share.replica,
                    in_flight: &share.in_flight,
                    survival: &share.survival,
                    tickets: &share.tickets,
                };
                state.ingest(input, Instant::now());
            }
            Effect::Fill(fill) => {
                let input = Input::Fill {
                    worker: &fill.worker,
                    rank: fill.rank,
                    messages: &fill.messages,
                };
                state.ingest(input, Instant::now());
            }
            Effect::AnswerFill { reply, ask } => {
                let messages = state.kept_messages(&ask.worker, ask.rank, &ask.seqs);
                if let Some(body) = wire::fill_reply(&ask.worker, ask.rank, messages) {
                    effects.push(Effect::Publish {
                        subject: reply,
                        reply: None,
                        body,
                    });
                }
            }
            Effect::TakeSnapshot { request, reply } => {
                effects.extend(state.replica_take_snapshot(request, &reply, Instant::now()));
            }
            Effect::Compared(changes) => state.replica_changes(&changes),
            Effect::Ignored { what, error } => {
                tracing::warn!(%error, "replica plane: undecodable {what} message ignored");
            }
        }
    }
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
        state.snapshot_bytes(Direction::Received, reply.payload.len());
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
