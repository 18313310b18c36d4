//! msgpack without a data model between bytes and types. [`Reader`] reads borrowed bytes for
//! the decoders of the common case of an engine's events (`vllm/direct.rs`,
//! `dynamo/direct.rs`): headers, strings and bytes are borrowed, nothing is allocated, and every
//! method returns `None` on anything it does not expect (the caller then hands the message to
//! its general decoder). [`Writer`] writes what the encoders of those events put on the wire.
//! Every method is `#[inline]`: the codecs call them once per value from other modules, which
//! a release build may put in other codegen units (not inlined, the sidecar spent 7% more CPU in
//! a vLLM storm).

/// What a msgpack header announces.
pub(crate) enum Head<'a> {
    Nil,
    Bool,
    Uint(u64),
    /// Negative only.
    Int(i64),
    Float(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Array(usize),
    Map(usize),
}

/// A signed integer as msgpack readers see it: one that is not negative is an unsigned one.
#[inline]
fn signed(n: i64) -> Head<'static> {
    match u64::try_from(n) {
        Ok(n) => Head::Uint(n),
        Err(_) => Head::Int(n),
    }
}

/// Deeper nesting than any engine's message has: the general decoders refuse it.
const MAX_SKIP_DEPTH: usize = 16;

pub(crate) struct Reader<'a> {
    /// What is left to read.
    pub buf: &'a [u8],
}

impl<'a> Reader<'a> {
    #[inline]
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf }
    }

    #[inline]
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.buf.len() < n {
            return None;
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Some(head)
    }

    #[inline]
    fn be(&mut self, n: usize) -> Option<u64> {
        Some(
            self.take(n)?
                .iter()
                .fold(0u64, |acc, b| (acc << 8) | u64::from(*b)),
        )
    }

    #[inline]
    fn sized(&mut self, n: usize) -> Option<usize> {
        usize::try_from(self.be(n)?).ok()
    }

    #[inline]
    pub fn head(&mut self) -> Option<Head<'a>> {
        let m = *self.take(1)?.first()?;
        Some(match m {
            0x00..=0x7f => Head::Uint(u64::from(m)),
            0x80..=0x8f => Head::Map(usize::from(m & 0x0f)),
            0x90..=0x9f => Head::Array(usize::from(m & 0x0f)),
            0xa0..=0xbf => Head::Str(self.take(usize::from(m & 0x1f))?),
            0xc0 => Head::Nil,
            0xc2 | 0xc3 => Head::Bool,
            0xc4 => Head::Bin(self.sized_bytes(1)?),
            0xc5 => Head::Bin(self.sized_bytes(2)?),
            0xc6 => Head::Bin(self.sized_bytes(4)?),
            0xca => Head::Float(f64::from(f32::from_bits(self.be(4)? as u32))),
            0xcb => Head::Float(f64::from_bits(self.be(8)?)),
            0xcc => Head::Uint(self.be(1)?),
            0xcd => Head::Uint(self.be(2)?),
            0xce => Head::Uint(self.be(4)?),
            0xcf => Head::Uint(self.be(8)?),
            0xd0 => signed(i64::from(self.be(1)? as u8 as i8)),
            0xd1 => signed(i64::from(self.be(2)? as u16 as i16)),
            0xd2 => signed(i64::from(self.be(4)? as u32 as i32)),
            0xd3 => signed(self.be(8)? as i64),
            0xd9 => Head::Str(self.sized_bytes(1)?),
            0xda => Head::Str(self.sized_bytes(2)?),
            0xdb => Head::Str(self.sized_bytes(4)?),
            0xdc => Head::Array(self.sized(2)?),
            0xdd => Head::Array(self.sized(4)?),
            0xde => Head::Map(self.sized(2)?),
            0xdf => Head::Map(self.sized(4)?),
            0xe0..=0xff => Head::Int(i64::from(m as i8)),
            // Extension types (and the unused 0xc1): the general decoder's business.
            _ => return None,
        })
    }

    #[inline]
    fn sized_bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        let len = self.sized(n)?;
        self.take(len)
    }

    /// Past one value.
    #[inline]
    pub fn skip(&mut self, depth: usize) -> Option<()> {
        if depth > MAX_SKIP_DEPTH {
            return None;
        }
        match self.head()? {
            Head::Array(n) => (0..n).try_for_each(|_| self.skip(depth + 1)),
            Head::Map(n) => (0..2 * n).try_for_each(|_| self.skip(depth + 1)),
            _ => Some(()),
        }
    }

    #[inline]
    pub fn str(&mut self) -> Option<&'a str> {
        match self.head()? {
            Head::Str(b) => std::str::from_utf8(b).ok(),
            _ => None,
        }
    }

    #[inline]
    pub fn uint(&mut self) -> Option<u64> {
        match self.head()? {
            Head::Uint(n) => Some(n),
            _ => None,
        }
    }

    /// A nil (read), or `false` with nothing read.
    #[inline]
    pub fn nil(&mut self) -> Option<bool> {
        match self.buf.first()? {
            0xc0 => {
                self.buf = &self.buf[1..];
                Some(true)
            }
            _ => Some(false),
        }
    }

    /// A u64, or nil as `None`.
    #[inline]
    pub fn opt_uint(&mut self) -> Option<Option<u64>> {
        if self.nil()? {
            return Some(None);
        }
        self.uint().map(Some)
    }

    #[inline]
    pub fn map(&mut self) -> Option<usize> {
        match self.head()? {
            Head::Map(n) => Some(n),
            _ => None,
        }
    }

    #[inline]
    pub fn array(&mut self) -> Option<usize> {
        match self.head()? {
            Head::Array(n) => Some(n),
            _ => None,
        }
    }

    /// Room for `n` elements of at least a byte each: never more than the bytes left, so a
    /// length that lies allocates nothing it cannot fill.
    #[inline]
    pub fn room(&self, n: usize) -> usize {
        n.min(self.buf.len())
    }
}

/// A msgpack writer, each value in its shortest form (as `rmp_serde` and Python's msgpack
/// write them): what the encoders of engines' messages build on.
pub(crate) struct Writer(pub Vec<u8>);

impl Writer {
    #[inline]
    pub fn array(&mut self, len: usize) {
        let _ = rmp::encode::write_array_len(&mut self.0, len as u32);
    }

    #[inline]
    pub fn map(&mut self, len: usize) {
        let _ = rmp::encode::write_map_len(&mut self.0, len as u32);
    }

    #[inline]
    pub fn uint(&mut self, v: u64) {
        let _ = rmp::encode::write_uint(&mut self.0, v);
    }

    #[inline]
    pub fn f64(&mut self, v: f64) {
        let _ = rmp::encode::write_f64(&mut self.0, v);
    }

    #[inline]
    pub fn text(&mut self, s: &str) {
        let _ = rmp::encode::write_str(&mut self.0, s);
    }

    #[inline]
    pub fn nil(&mut self) {
        let _ = rmp::encode::write_nil(&mut self.0);
    }

    #[inline]
    pub fn opt_uint(&mut self, v: Option<u64>) {
        match v {
            Some(v) => self.uint(v),
            None => self.nil(),
        }
    }

    #[inline]
    pub fn bin(&mut self, b: &[u8]) {
        let _ = rmp::encode::write_bin(&mut self.0, b);
    }
}

/// `bytes` damaged every way the decoders' tests try: cut at every length, and each byte
/// replaced in turn by markers that change what follows (a map, an array, a string, nil, the
/// unused 0xc1, a u8, an i8, a long array, a negative fixint).
#[cfg(test)]
pub(crate) fn damaged(bytes: &[u8]) -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = (0..bytes.len()).map(|n| bytes[..n].to_vec()).collect();
    for i in 0..bytes.len() {
        for b in [
            0x00, 0x7f, 0x81, 0x91, 0xa1, 0xc0, 0xc1, 0xcc, 0xd0, 0xdc, 0xff,
        ] {
            let mut d = bytes.to_vec();
            d[i] = b;
            out.push(d);
        }
    }
    out
}
