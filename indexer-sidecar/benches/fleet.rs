//! Synthetic fleets for the index benches: workers storing 512-block sequences that share
//! prefixes the way chat traffic does (a common system prefix per group, then unique blocks).

use kvroute_protocol::hash::prefix_hashes;
use kvroute_protocol::{LocalBlockHash, PrefixHash};
use kvroute_sidecar::core::event::{EngineHash, KvEvent, KvEventKind, StoredBlock};
use kvroute_sidecar::WorkerId;

/// Blocks per stored sequence (and per query).
pub const SEQ_BLOCKS: usize = 512;
/// Blocks shared by every sequence of a group.
pub const SHARED_BLOCKS: usize = 64;
/// Sequences per group.
pub const GROUP: u64 = 16;

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Local hashes of sequence `seq`: group prefix, then blocks unique to the sequence.
pub fn sequence(seq: u64) -> Vec<LocalBlockHash> {
    let group = seq / GROUP;
    (0..SEQ_BLOCKS as u64)
        .map(|i| {
            if (i as usize) < SHARED_BLOCKS {
                LocalBlockHash(mix(group << 20 | i))
            } else {
                LocalBlockHash(mix((seq + 1) << 32 | i))
            }
        })
        .collect()
}

/// The query a request for sequence `seq` sends: its prefix hashes.
pub fn query(seq: u64) -> Vec<PrefixHash> {
    prefix_hashes(&sequence(seq))
}

/// A query sharing only the group prefix of `seq`: the rest was never stored anywhere.
pub fn query_new_in_group(seq: u64) -> Vec<PrefixHash> {
    let mut locals = sequence(seq);
    for (i, l) in locals.iter_mut().enumerate().skip(SHARED_BLOCKS) {
        *l = LocalBlockHash(mix(u64::MAX - i as u64 - (seq << 12)));
    }
    prefix_hashes(&locals)
}

/// Stored events for sequence `seq` on `worker`, in chunks of 16 blocks as engines publish them.
/// Engine hashes are salted per worker, as a real engine's would be.
pub fn events(seq: u64, worker: WorkerId) -> Vec<KvEvent> {
    let locals = sequence(seq);
    let engine = |i: usize| EngineHash(mix(locals[i].0 ^ mix(u64::from(worker.0) + 1) ^ i as u64));
    locals
        .chunks(16)
        .enumerate()
        .map(|(c, chunk)| KvEvent {
            dp_rank: 0,
            kind: KvEventKind::Stored {
                parent: (c > 0).then(|| engine(c * 16 - 1)),
                blocks: chunk
                    .iter()
                    .enumerate()
                    .map(|(j, l)| StoredBlock {
                        engine_hash: engine(c * 16 + j),
                        local_hash: *l,
                    })
                    .collect(),
            },
        })
        .collect()
}

/// Which worker stores the `k`-th copy of sequence `seq` (each sequence lives on 2 workers).
pub fn placement(seq: u64, copy: u64, workers: u32) -> WorkerId {
    WorkerId(((mix(seq) + copy * 7) % u64::from(workers)) as u32)
}
