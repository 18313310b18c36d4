//! Dynamo envelopes and event arrays decoded straight from their bytes, for the common case:
//! named maps (`rmp_serde::to_vec_named`, as Dynamo writes them) of known kinds with fields of
//! the expected types. Anything else (positional arrays, an event kind kvroute does not know, a
//! duplicate key, a value of another type) returns `None`, and [`crate::dynamo`] decodes the
//! message with serde as before. Through serde, matching field names and allocating every
//! string and vector was most of the sidecar's time on Dynamo's ZMQ plane in an event storm;
//! here an event allocates only its blocks.
//!
//! The result equals serde's whenever it is `Some` (held by the tests in `dynamo.rs`): unknown
//! fields are read past as serde ignores them, absent ones take serde's defaults.

use crate::msgpack::{Head, Reader};

use super::{
    tier, Envelope, KvCacheEvent, KvCacheEventData, RemovedBlocks, RouterEvent, StoredBlock,
    StoredBlocks,
};

/// An envelope (its payload copied out), or `None` when it needs serde.
pub(crate) fn envelope(bytes: &[u8]) -> Option<Envelope> {
    let mut r = Reader::new(bytes);
    let (mut publisher_id, mut sequence, mut published_at) = (None, None, None);
    let (mut topic, mut payload) = (None, None);
    for _ in 0..r.map()? {
        match r.str()? {
            "publisher_id" => once(&mut publisher_id, r.uint()?)?,
            "sequence" => once(&mut sequence, r.uint()?)?,
            "published_at" => once(&mut published_at, r.uint()?)?,
            "topic" => once(&mut topic, r.str()?)?,
            "payload" => match r.head()? {
                Head::Bin(b) => once(&mut payload, b)?,
                _ => return None,
            },
            _ => r.skip(0)?,
        }
    }
    Some(Envelope {
        publisher_id: publisher_id?,
        sequence: sequence?,
        published_at: published_at?,
        topic: topic?.to_owned(),
        payload: payload?.to_vec(),
    })
}

/// A payload's array of events, or `None` when it needs serde.
pub(crate) fn events(payload: &[u8]) -> Option<Vec<RouterEvent>> {
    let mut r = Reader::new(payload);
    let n = r.array()?;
    let mut events = Vec::with_capacity(r.room(n));
    for _ in 0..n {
        events.push(router_event(&mut r)?);
    }
    r.buf.is_empty().then_some(events)
}

/// Fill `slot` with `value`; a key seen twice is serde's (it refuses a duplicate field).
fn once<T>(slot: &mut Option<T>, value: T) -> Option<()> {
    match slot.replace(value) {
        None => Some(()),
        Some(_) => None,
    }
}

fn router_event(r: &mut Reader<'_>) -> Option<RouterEvent> {
    let (mut worker_id, mut storage_tier, mut residency_domain, mut event) =
        (None, None, None, None);
    for _ in 0..r.map()? {
        match r.str()? {
            "worker_id" => once(&mut worker_id, r.uint()?)?,
            "storage_tier" => once(&mut storage_tier, tier(r.str()?))?,
            "residency_domain" => {
                let domain = if r.nil()? { None } else { Some(tier(r.str()?)) };
                once(&mut residency_domain, domain)?
            }
            "event" => once(&mut event, cache_event(r)?)?,
            _ => r.skip(0)?,
        }
    }
    Some(RouterEvent {
        worker_id: worker_id?,
        storage_tier: storage_tier.unwrap_or_else(super::default_tier),
        residency_domain: residency_domain.flatten(),
        event: event?,
    })
}

fn cache_event(r: &mut Reader<'_>) -> Option<KvCacheEvent> {
    let (mut event_id, mut data, mut dp_rank) = (None, None, None);
    for _ in 0..r.map()? {
        match r.str()? {
            "event_id" => once(&mut event_id, r.uint()?)?,
            "data" => once(&mut data, event_data(r)?)?,
            "dp_rank" => once(&mut dp_rank, u32::try_from(r.uint()?).ok()?)?,
            _ => r.skip(0)?,
        }
    }
    Some(KvCacheEvent {
        event_id: event_id?,
        data: data?,
        dp_rank: dp_rank.unwrap_or(0),
    })
}

/// Externally tagged, as serde writes an enum: `"cleared"`, or a one-key map around the
/// variant's fields.
fn event_data(r: &mut Reader<'_>) -> Option<KvCacheEventData> {
    match r.head()? {
        Head::Str(b"cleared") => Some(KvCacheEventData::Cleared),
        Head::Map(1) => match r.str()? {
            "stored" => stored(r).map(KvCacheEventData::Stored),
            "removed" => removed(r).map(KvCacheEventData::Removed),
            _ => None,
        },
        _ => None,
    }
}

fn stored(r: &mut Reader<'_>) -> Option<StoredBlocks> {
    let (mut parent_hash, mut start_position, mut blocks) = (None, None, None);
    for _ in 0..r.map()? {
        match r.str()? {
            "parent_hash" => once(&mut parent_hash, r.opt_uint()?)?,
            "start_position" => once(&mut start_position, r.opt_uint()?)?,
            "blocks" => {
                let n = r.array()?;
                let mut list = Vec::with_capacity(r.room(n));
                for _ in 0..n {
                    list.push(block(r)?);
                }
                once(&mut blocks, list)?
            }
            _ => r.skip(0)?,
        }
    }
    Some(StoredBlocks {
        // Serde takes an absent `Option` field as `None`.
        parent_hash: parent_hash.flatten(),
        start_position: start_position.flatten(),
        blocks: blocks?,
    })
}

fn block(r: &mut Reader<'_>) -> Option<StoredBlock> {
    let (mut block_hash, mut tokens_hash) = (None, None);
    for _ in 0..r.map()? {
        match r.str()? {
            "block_hash" => once(&mut block_hash, r.uint()?)?,
            "tokens_hash" => once(&mut tokens_hash, r.uint()?)?,
            // `mm_extra_info` is not read (serde skips it) and neither is anything unknown.
            _ => r.skip(0)?,
        }
    }
    Some(StoredBlock {
        block_hash: block_hash?,
        tokens_hash: tokens_hash?,
        mm_extra_info: None,
    })
}

fn removed(r: &mut Reader<'_>) -> Option<RemovedBlocks> {
    let mut block_hashes = None;
    for _ in 0..r.map()? {
        match r.str()? {
            "block_hashes" => {
                let n = r.array()?;
                let mut list = Vec::with_capacity(r.room(n));
                for _ in 0..n {
                    list.push(r.uint()?);
                }
                once(&mut block_hashes, list)?
            }
            _ => r.skip(0)?,
        }
    }
    Some(RemovedBlocks {
        block_hashes: block_hashes?,
    })
}
