//! vLLM batches decoded straight from their bytes, for the common case: every event a known
//! type with known fields of the expected types. Anything else (an unknown field or event type,
//! a malformed element, a duplicate key, an extension type) returns `None`, and
//! [`crate::vllm::decode_batch`] decodes the batch through a `rmpv::Value` tree, which counts
//! and skips what it does not know. That tree allocates for every key, string and integer, and
//! was most of the sidecar's time in an event storm on ZMQ; here a batch allocates only the
//! vectors the events keep.
//!
//! The result equals the tree decoder's whenever it is `Some` (held by the tests in
//! `vllm.rs`): same fields read from the same places, same defaults.

use xxhash_rust::xxh3::xxh3_64;

use crate::msgpack::{Head, Reader};

use super::{
    BlockHashes, EngineBlockHash, EventBatch, ExtraKeys, TokenIds, VllmEvent, KNOWN_FIELDS,
};

/// The batch, or `None` when it needs the general decoder.
pub(crate) fn decode(payload: &[u8]) -> Option<EventBatch> {
    let mut r = Reader::new(payload);
    let mut batch = EventBatch::default();
    let mut events = None;
    match r.head()? {
        Head::Array(n) => {
            for i in 0..n {
                match i {
                    0 => batch.ts = r.f64()?,
                    1 => events = Some(r.events()?),
                    2 => batch.dp_rank = r.dp_rank()?,
                    _ => r.skip(0)?,
                }
            }
        }
        Head::Map(n) => {
            let mut seen = [false; 3];
            for _ in 0..n {
                let key = r.str()?;
                let slot = ["ts", "events", "data_parallel_rank"]
                    .iter()
                    .position(|k| *k == key);
                match slot {
                    Some(s) if std::mem::replace(&mut seen[s], true) => return None,
                    Some(0) => batch.ts = r.f64()?,
                    Some(1) => events = Some(r.events()?),
                    Some(_) => batch.dp_rank = r.dp_rank()?,
                    None => r.skip(0)?,
                }
            }
        }
        _ => return None,
    }
    if !r.buf.is_empty() {
        return None;
    }
    batch.events = events?;
    Some(batch)
}

/// The fields of one event, typed as the tree decoder reads them; `None`: absent.
#[derive(Default)]
struct Fields<'a> {
    kind_tag: Option<&'a str>,
    hashes: Option<BlockHashes>,
    parent: Option<Option<EngineBlockHash>>,
    tokens: Option<TokenIds>,
    block_size: Option<u32>,
    lora_name: Option<Option<&'a str>>,
    medium: Option<Option<&'a str>>,
    extra_keys: Option<Option<ExtraKeys>>,
    group: Option<Option<u32>>,
    kind: Option<Option<&'a str>>,
}

impl<'a> Fields<'a> {
    fn event(self) -> Option<VllmEvent> {
        let owned = |s: Option<Option<&str>>| s.flatten().map(str::to_owned);
        match self.kind_tag? {
            "BlockStored" => {
                let block_hashes = self.hashes?;
                let has_extra_keys = match self.extra_keys.flatten() {
                    Some(keys) => keys,
                    None => smallvec::smallvec![false; block_hashes.len()],
                };
                Some(VllmEvent::BlockStored {
                    parent: self.parent.flatten(),
                    token_ids: self.tokens?,
                    block_size: self.block_size?,
                    lora_name: owned(self.lora_name),
                    medium: self.medium.flatten().map(super::medium),
                    has_extra_keys,
                    group: self.group.flatten(),
                    kind: owned(self.kind),
                    block_hashes,
                })
            }
            "BlockRemoved" => Some(VllmEvent::BlockRemoved {
                block_hashes: self.hashes?,
                medium: self.medium.flatten().map(super::medium),
                group: self.group.flatten(),
            }),
            "AllBlocksCleared" => Some(VllmEvent::AllBlocksCleared),
            _ => None,
        }
    }
}

impl<'a> Reader<'a> {
    /// A string, or `None` for anything else (read past), as `Value::as_str` reads a field.
    fn opt_str(&mut self) -> Option<Option<&'a str>> {
        let before = self.buf;
        match self.head()? {
            Head::Str(b) => Some(std::str::from_utf8(b).ok()),
            _ => {
                self.buf = before;
                self.skip(0).map(|()| None)
            }
        }
    }

    /// A u32, or `None` for anything else (read past), as `as_u64` then `u32::try_from`.
    fn opt_u32(&mut self) -> Option<Option<u32>> {
        let before = self.buf;
        match self.head()? {
            Head::Uint(n) => Some(u32::try_from(n).ok()),
            _ => {
                self.buf = before;
                self.skip(0).map(|()| None)
            }
        }
    }

    fn f64(&mut self) -> Option<f64> {
        match self.head()? {
            Head::Float(f) => Some(f),
            Head::Uint(n) => Some(n as f64),
            Head::Int(n) => Some(n as f64),
            _ => None,
        }
    }

    fn dp_rank(&mut self) -> Option<u32> {
        match self.head()? {
            Head::Uint(n) => Some(u32::try_from(n).unwrap_or(0)),
            Head::Nil => Some(0),
            _ => None,
        }
    }

    fn hash(&mut self) -> Option<EngineBlockHash> {
        Some(EngineBlockHash(match self.head()? {
            Head::Uint(n) => n,
            Head::Int(n) => n as u64,
            Head::Bin(b) | Head::Str(b) => xxh3_64(b),
            _ => return None,
        }))
    }

    fn hashes(&mut self) -> Option<BlockHashes> {
        let n = self.array()?;
        let mut hashes = BlockHashes::with_capacity(self.room(n));
        for _ in 0..n {
            hashes.push(self.hash()?);
        }
        Some(hashes)
    }

    fn parent(&mut self) -> Option<Option<EngineBlockHash>> {
        let before = self.buf;
        if let Head::Nil = self.head()? {
            return Some(None);
        }
        self.buf = before;
        self.hash().map(Some)
    }

    fn tokens(&mut self) -> Option<TokenIds> {
        let n = self.array()?;
        let mut tokens = TokenIds::with_capacity(self.room(n));
        for _ in 0..n {
            match self.head()? {
                Head::Uint(t) => tokens.push(u32::try_from(t).ok()?),
                _ => return None,
            }
        }
        Some(tokens)
    }

    /// An array's elements as "not nil"; anything else: `None` (read past).
    fn extra_keys(&mut self) -> Option<Option<ExtraKeys>> {
        let before = self.buf;
        let Head::Array(n) = self.head()? else {
            self.buf = before;
            return self.skip(0).map(|()| None);
        };
        let mut keys = ExtraKeys::with_capacity(self.room(n));
        for _ in 0..n {
            let at = self.buf;
            let nil = matches!(self.head()?, Head::Nil);
            if !nil {
                self.buf = at;
                self.skip(1)?;
            }
            keys.push(!nil);
        }
        Some(Some(keys))
    }

    fn events(&mut self) -> Option<Vec<VllmEvent>> {
        let n = self.array()?;
        let mut events = Vec::with_capacity(self.room(n));
        for _ in 0..n {
            let fields = match self.head()? {
                Head::Map(len) => self.map_fields(len)?,
                Head::Array(len) => self.array_fields(len)?,
                _ => return None,
            };
            events.push(fields.event()?);
        }
        Some(events)
    }

    /// A `"type"`-tagged map; a field kvroute does not know, or one twice, is the general
    /// decoder's (it counts unknown fields).
    fn map_fields(&mut self, len: usize) -> Option<Fields<'a>> {
        let mut f = Fields::default();
        let mut seen = [false; KNOWN_FIELDS.len()];
        for _ in 0..len {
            let key = self.str()?;
            let slot = KNOWN_FIELDS.iter().position(|k| *k == key)?;
            if std::mem::replace(&mut seen[slot], true) {
                return None;
            }
            match key {
                "type" => f.kind_tag = Some(self.str()?),
                "block_hashes" => f.hashes = Some(self.hashes()?),
                "parent_block_hash" => f.parent = Some(self.parent()?),
                "token_ids" => f.tokens = Some(self.tokens()?),
                "block_size" => f.block_size = Some(self.opt_u32()??),
                "lora_name" => f.lora_name = Some(self.opt_str()?),
                "medium" => f.medium = Some(self.opt_str()?),
                "extra_keys" => f.extra_keys = Some(self.extra_keys()?),
                "group_idx" => f.group = Some(self.opt_u32()?),
                "kv_cache_spec_kind" => f.kind = Some(self.opt_str()?),
                _ => self.skip(0)?,
            }
        }
        Some(f)
    }

    /// A positional array: `[type, block_hashes, parent, token_ids, block_size, lora_id,
    /// medium, lora_name, extra_keys, group_idx, kind, …]` or `["BlockRemoved", block_hashes,
    /// medium, group_idx]`.
    fn array_fields(&mut self, len: usize) -> Option<Fields<'a>> {
        let mut f = Fields::default();
        if len == 0 {
            return None;
        }
        let tag = self.str()?;
        f.kind_tag = Some(tag);
        for i in 1..len {
            match (tag, i) {
                (_, 1) => f.hashes = Some(self.hashes()?),
                ("BlockStored", 2) => f.parent = Some(self.parent()?),
                ("BlockStored", 3) => f.tokens = Some(self.tokens()?),
                ("BlockStored", 4) => f.block_size = Some(self.opt_u32()??),
                ("BlockStored", 6) | ("BlockRemoved", 2) => f.medium = Some(self.opt_str()?),
                ("BlockStored", 7) => f.lora_name = Some(self.opt_str()?),
                ("BlockStored", 8) => f.extra_keys = Some(self.extra_keys()?),
                ("BlockStored", 9) | ("BlockRemoved", 3) => f.group = Some(self.opt_u32()?),
                ("BlockStored", 10) => f.kind = Some(self.opt_str()?),
                _ => self.skip(0)?,
            }
        }
        Some(f)
    }
}
