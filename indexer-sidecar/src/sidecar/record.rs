//! What the core says happened ([`Happened`]), turned into metrics and log lines: one
//! function per family, [`Sidecar::record`] dispatching to them.

use std::time::Instant;

use kvroute_protocol::hint::Usage;

use super::{lock, Sidecar, SourceRef};
use crate::core::cursor::Verdict;
use crate::core::event::{EventProblem, EventTag};
use crate::core::fleet::Role;
use crate::core::truth::Prediction;
use crate::core::{Delivery, Forgot, Happened, Name, Rejected, TicketClosed};
use crate::metrics::{
    EventLabels, EventType, LostLabel, LostOutcome, PredictionLabels, PredictionOutcome,
    PublisherLabel, RejectLabels, RejectReason, RepairKind, RepairLabel, RestoreLabel,
    RestoreOutcome, RoleLabels, RoleValue, SequenceKind, SequenceLabels, ServedLabels, SourceLabel,
    TicketHow, TicketLabel, Transport, UsageKind, WorkerLabel,
};

fn worker_label(worker: &Name) -> WorkerLabel {
    WorkerLabel::new(&worker.address)
}

impl Sidecar {
    /// Turn one thing that happened (from `source`, when an event source's input caused it)
    /// into metrics and log lines.
    pub(super) fn record(&self, source: Option<SourceRef<'_>>, h: &Happened, now: Instant) {
        use Happened as H;
        match h {
            H::Applied { .. }
            | H::Holds { .. }
            | H::Sequence { .. }
            | H::Held { .. }
            | H::Forgot { .. }
            | H::Refused { .. }
            | H::Rejected { .. }
            | H::UnknownPublisher { .. } => self.record_event(source, h, now),
            H::Bound { .. }
            | H::Capacity { .. }
            | H::Scanned { .. }
            | H::Joined { .. }
            | H::Added { .. }
            | H::Usable { .. } => self.record_fleet(h),
            H::Repaired { .. } | H::Restored { .. } | H::Filled { .. } | H::Unfilled { .. } => {
                self.record_replica(h)
            }
            H::Served { .. } | H::Tickets { .. } | H::Load { .. } => self.record_served(h),
        }
    }

    /// The events an input applied, counted once per input and kind (a message carries many):
    /// one look at the event plane, one metric write per kind.
    pub(super) fn record_applied(
        &self,
        source: Option<SourceRef<'_>>,
        happened: &[Happened],
        now: Instant,
    ) {
        let of = |tag: EventTag| {
            happened
                .iter()
                .filter(|h| matches!(h, Happened::Applied { kind, .. } if *kind == tag))
                .count() as u64
        };
        let counts = [
            (EventType::Stored, of(EventTag::Stored)),
            (EventType::Removed, of(EventTag::Removed)),
            (EventType::Cleared, of(EventTag::Cleared)),
        ];
        let applied: u64 = counts.iter().map(|(_, n)| n).sum();
        if applied == 0 {
            return;
        }
        let subject = source.map_or("", |s| s.subject);
        let named = source.is_none_or(|s| self.plane().events(s.index, subject, applied, now));
        for (r#type, n) in counts.into_iter().filter(|(_, n)| *n > 0) {
            self.metrics
                .events
                .get_or_create(&EventLabels {
                    subject: if named { subject } else { "other" }.to_owned(),
                    r#type,
                })
                .inc_by(n);
        }
    }

    /// What an event source's message did to the index and its sequence.
    fn record_event(&self, source: Option<SourceRef<'_>>, h: &Happened, now: Instant) {
        let m = &self.metrics;
        let subject = source.map_or("", |s| s.subject);
        let sequence = |worker: &str, kind: SequenceKind| {
            m.sequence
                .get_or_create(&SequenceLabels {
                    worker: worker.to_owned(),
                    kind,
                })
                .inc();
        };
        const ZMQ: SourceLabel = SourceLabel {
            source: Transport::Zmq,
        };
        match h {
            // The events themselves are counted per input, in `record_applied`.
            Happened::Applied {
                worker, outcome, ..
            } => {
                if outcome.too_many_caches {
                    tracing::warn!(worker = %worker.address, "index full: more than 65535 caches; event dropped");
                }
                if outcome.orphan {
                    m.orphan_stores.get_or_create(&worker_label(worker)).inc();
                    self.lost(
                        "stored events whose parent block is unknown here (events lost before them, or stored before this sidecar listened)",
                        "kvroute_orphan_stores_total",
                        Some(&worker.address),
                        1,
                        now,
                    );
                }
                if outcome.unknown_removals > 0 {
                    m.unknown_removals.inc_by(outcome.unknown_removals as u64);
                }
                if outcome.evicted > 0 {
                    let counter = m.capacity_evictions.get_or_create(&worker_label(worker));
                    if counter.get() == 0 {
                        tracing::warn!(worker = %worker.address, evicted = outcome.evicted, "the index holds more blocks for this worker than its cache can: removals were lost (or a publisher lies); the oldest entries are dropped, kvroute_capacity_evictions_total counts them");
                    }
                    counter.inc_by(outcome.evicted as u64);
                }
            }
            Happened::Holds { worker, blocks } => {
                m.index_blocks
                    .get_or_create(&worker_label(worker))
                    .set(*blocks as i64);
            }
            Happened::Sequence {
                worker,
                verdict,
                seq,
                delivery,
            } => match verdict {
                Verdict::Gap { from, to } => {
                    sequence(&worker.address, SequenceKind::Gap);
                    if *delivery == Delivery::Live {
                        let lost = to - from;
                        m.lost_events
                            .get_or_create(&worker_label(worker))
                            .inc_by(lost);
                        self.lost(
                            &format!("KV events on {subject}"),
                            "kvroute_lost_events_total",
                            Some(&worker.address),
                            lost,
                            now,
                        );
                    }
                }
                Verdict::Restarted => {
                    sequence(&worker.address, SequenceKind::Restart);
                    tracing::warn!(worker = %worker.address, %subject, seq, "event sequence went back: the engine restarted with an empty cache");
                }
                Verdict::Duplicate => sequence(&worker.address, SequenceKind::Duplicate),
                Verdict::First | Verdict::Next => {}
            },
            Happened::Held { .. } => {}
            Happened::Forgot {
                worker,
                blocks,
                why,
            } => match why {
                Forgot::Restarted => {
                    tracing::warn!(worker = %worker.address, dropped = blocks, "restarted engine: its index entries dropped");
                }
                Forgot::PublisherGone => {
                    sequence(&worker.address, SequenceKind::Disconnect);
                    tracing::warn!(worker = %worker.address, endpoint = %subject, dropped = blocks, "KV-event publisher went away (engine stopped or restarted): its index entries dropped; reconnecting");
                }
                Forgot::Resync => {
                    sequence(&worker.address, SequenceKind::Resync);
                    tracing::warn!(worker = %worker.address, endpoint = %subject, dropped = blocks, "event gap not replayable: worker resynced (index entries dropped)");
                }
                Forgot::WarmStart => sequence(&worker.address, SequenceKind::WarmStart),
                Forgot::Unusable => {
                    tracing::warn!(worker = %worker.address, blocks, "unusable past the grace period: index entries dropped");
                }
            },
            Happened::Refused { worker, problem } => match problem {
                EventProblem::BlockSize { .. } => {
                    let counter = m.block_size_mismatches.get_or_create(&worker_label(worker));
                    if counter.get() == 0 {
                        tracing::error!(worker = %worker.address, %problem, "block-size mismatch: this worker's KV events can never match a request; fix [[models]] block_size or the engine's --block-size");
                    }
                    counter.inc();
                }
                EventProblem::Offloaded(tier) => {
                    let counter = m.offloaded_events.get_or_create(&worker_label(worker));
                    if counter.get() == 0 {
                        tracing::info!(worker = %worker.address, %tier, "this engine publishes events about offloaded copies of blocks: not indexed (kvroute routes on GPU memory); kvroute_offloaded_events_total counts them");
                    }
                    counter.inc();
                }
                EventProblem::Tokens { .. } => {
                    tracing::warn!(worker = %worker.address, %problem, "malformed vLLM store event");
                    m.decode_errors.get_or_create(&ZMQ).inc();
                }
            },
            Happened::Rejected { worker, why } => {
                let reason = match why {
                    Rejected::WrongComponent { .. } => RejectReason::WrongComponent,
                    Rejected::TooManyRanks { .. } => RejectReason::TooManyRanks,
                    Rejected::ReadOverZmq => RejectReason::ReadOverZmq,
                };
                let counter = m.rejected_messages.get_or_create(&RejectLabels {
                    worker: worker.address.to_string(),
                    reason,
                });
                if counter.get() == 0 {
                    match why {
                        Rejected::WrongComponent { expected, got } => {
                            tracing::warn!(worker = %worker.address, %subject, %expected, %got, "message naming this worker on another component's subject refused (a misconfigured or hostile publisher); kvroute_rejected_messages_total counts the rest")
                        }
                        Rejected::TooManyRanks { rank, limit } => {
                            tracing::warn!(worker = %worker.address, rank, limit, "message of a data-parallel rank beyond [index] max_ranks_per_worker refused; kvroute_rejected_messages_total counts the rest")
                        }
                        Rejected::ReadOverZmq => {
                            tracing::info!(worker = %worker.address, "this worker's engine is read over ZMQ ([[zmq]] names it): the copies of its events Dynamo relays to NATS are not applied; kvroute_rejected_messages_total{{reason=\"read_over_zmq\"}} counts them")
                        }
                    }
                }
                counter.inc();
            }
            Happened::UnknownPublisher { name } => {
                // Names come from the network: past the plane's bound they fold into one series.
                let known = self.plane().unknown_worker(name);
                let counter = m.unknown_worker_events.get_or_create(&PublisherLabel {
                    worker_id: if known { name.clone() } else { "other".into() },
                });
                if counter.get() == 0 {
                    tracing::warn!(publisher = %name, %subject, "KV events from a worker that is neither in [[workers]] nor discovered (yet), or of another model/component: ignored");
                }
                counter.inc();
            }
            // The other families: see `record`.
            _ => {}
        }
    }

    /// What changed in the fleet: members, instances, capacities, usability.
    fn record_fleet(&self, h: &Happened) {
        let m = &self.metrics;
        match h {
            Happened::Bound { worker, component } => {
                tracing::info!(worker = %worker.address, %component, "worker bound to the Dynamo component its first events came on: messages naming it on other components are refused (set [[workers]] dynamo_component to choose)");
            }
            Happened::Capacity { worker, blocks } => {
                m.capacity_blocks
                    .get_or_create(&worker_label(worker))
                    .set(i64::try_from(*blocks).unwrap_or(i64::MAX));
                tracing::info!(worker = %worker.address, blocks, "engine cache capacity learned: the index holds at most this many blocks per cache of it");
            }
            Happened::Scanned { model, roles } => {
                for (role, n) in roles {
                    m.discovered_instances
                        .get_or_create(&RoleLabels {
                            model: model.clone(),
                            role: match role {
                                Role::Aggregated => RoleValue::Aggregated,
                                Role::Prefill => RoleValue::Prefill,
                                Role::Decode => RoleValue::Decode,
                            },
                        })
                        .set(*n as i64);
                }
            }
            Happened::Joined { worker, model } => {
                tracing::info!(worker = %worker.address, %model, "a host of Envoy's cluster joined the fleet: hinted by address once its KV events arrive");
            }
            Happened::Added {
                worker,
                instance_id,
                role,
            } => {
                tracing::info!(instance_id, worker = %worker.address, role = role.label(), "Dynamo instance discovered: hinted by instance id");
            }
            Happened::Usable {
                worker,
                usable,
                changed,
                why,
            } => {
                m.worker_usable
                    .get_or_create(&worker_label(worker))
                    .set(i64::from(*usable));
                match (changed, usable) {
                    (true, true) => tracing::info!(worker = %worker.address, "worker usable again"),
                    (true, false) => {
                        tracing::warn!(worker = %worker.address, "{why}: no more hints to it")
                    }
                    _ => {}
                }
            }
            // The other families: see `record`.
            _ => {}
        }
    }

    /// What a peer's snapshot, a fill or the disk snapshot did to a cache.
    fn record_replica(&self, h: &Happened) {
        let m = &self.metrics;
        match h {
            Happened::Repaired {
                worker,
                rank,
                installed,
                blocks,
            } => {
                let kind = if *installed {
                    RepairKind::PeerSnapshot
                } else {
                    RepairKind::Refused
                };
                m.replica_repairs.get_or_create(&RepairLabel { kind }).inc();
                if *installed {
                    tracing::warn!(%worker, rank, blocks, "cache repaired from a peer's snapshot");
                } else {
                    tracing::warn!(%worker, rank, blocks, "peer snapshot refused: the events since it are no longer kept here (or the worker is unknown); asking again later");
                }
            }
            Happened::Restored {
                worker,
                rank,
                installed,
                blocks,
                seq,
            } => {
                let outcome = if *installed {
                    m.restored_blocks.inc_by(*blocks as u64);
                    tracing::info!(%worker, rank, blocks, seq, "cache restored from the disk snapshot; unclean until the events since it are known (a vLLM replay reaching back to it, or a clean peer)");
                    RestoreOutcome::Restored
                } else {
                    tracing::warn!(%worker, rank, blocks, seq, "cache from the disk snapshot not restored: events since it arrived first and are no longer all kept");
                    RestoreOutcome::Refused
                };
                m.restored_caches
                    .get_or_create(&RestoreLabel { outcome })
                    .inc();
            }
            Happened::Filled {
                worker,
                rank,
                messages,
            } => {
                m.replica_lost_messages
                    .get_or_create(&LostLabel {
                        outcome: LostOutcome::Filled,
                    })
                    .inc_by(*messages as u64);
                tracing::debug!(worker = %worker.address, rank, messages, "lost messages filled in from a peer");
            }
            Happened::Unfilled {
                worker,
                rank,
                messages,
            } => {
                m.replica_lost_messages
                    .get_or_create(&LostLabel {
                        outcome: LostOutcome::Unfilled,
                    })
                    .inc_by(*messages as u64);
                tracing::warn!(worker = %worker.address, rank, messages, "lost KV-event messages no peer handed over in time: the cache is unclean until a clean peer's snapshot repairs it");
            }
            // The other families: see `record`.
            _ => {}
        }
    }

    /// What a finished request reported, tickets closed, and the load.
    fn record_served(&self, h: &Happened) {
        let m = &self.metrics;
        match h {
            Happened::Served {
                ticket,
                worker,
                predicted_tokens,
                usage,
                prediction,
            } => {
                lock(&self.explained).served(*ticket, *predicted_tokens, *usage);
                let kind = match usage {
                    Usage::Cached { .. } => UsageKind::Cached,
                    Usage::PromptOnly { .. } => UsageKind::PromptOnly,
                    Usage::Missing => UsageKind::Missing,
                    Usage::Malformed => UsageKind::Malformed,
                    Usage::Unanswered => UsageKind::Unanswered,
                    Usage::Unread => UsageKind::Unread,
                };
                m.served_requests
                    .get_or_create(&ServedLabels {
                        worker: worker.address.to_string(),
                        usage: kind,
                    })
                    .inc();
                if let (
                    Usage::Cached {
                        prompt_tokens,
                        cached_tokens,
                    },
                    Some(prediction),
                ) = (usage, prediction)
                {
                    let label = worker_label(worker);
                    let prompt = u64::from(*prompt_tokens);
                    m.predicted_cached_tokens
                        .get_or_create(&label)
                        .inc_by((*predicted_tokens).min(prompt));
                    m.actual_cached_tokens
                        .get_or_create(&label)
                        .inc_by(u64::from(*cached_tokens));
                    m.served_prompt_tokens.get_or_create(&label).inc_by(prompt);
                    let outcome = match prediction {
                        Prediction::Exact => PredictionOutcome::Exact,
                        Prediction::Over => PredictionOutcome::Over,
                        Prediction::Under => PredictionOutcome::Under,
                    };
                    m.predictions
                        .get_or_create(&PredictionLabels {
                            worker: label.worker,
                            outcome,
                        })
                        .inc();
                }
            }
            Happened::Tickets { how, n } => {
                let how = match how {
                    TicketClosed::Finished => TicketHow::Finished,
                    TicketClosed::Unknown => TicketHow::Unknown,
                    TicketClosed::Reclaimed => TicketHow::Reclaimed,
                    TicketClosed::Expired => TicketHow::Expired,
                };
                m.tickets.get_or_create(&TicketLabel { how }).inc_by(*n);
            }
            Happened::Load {
                worker,
                load,
                from_dynamo,
            } => {
                let labels = worker_label(worker);
                m.in_flight
                    .get_or_create(&labels)
                    .set(load.hinted_in_flight as i64);
                if *from_dynamo {
                    m.queued_prefill_blocks
                        .get_or_create(&labels)
                        .set(load.queued_prefill_blocks as i64);
                    m.kv_used_blocks
                        .get_or_create(&labels)
                        .set(load.kv_used_blocks as i64);
                }
            }
            // The other families: see `record`.
            _ => {}
        }
    }
}
