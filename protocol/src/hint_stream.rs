//! The hint stream: one long-lived gRPC stream from each Envoy worker thread's filter to the
//! sidecar, carrying the same hint requests and answers as `POST /v1/hint` without an HTTP
//! request each. Envoy sends a message on an open stream for a fraction of what an HTTP call
//! costs it (a new request, its headers, a pooled connection, a response parsed), and the
//! sidecar reads it without an HTTP request to route.
//!
//! ```text
//! gRPC method /kvroute.Hints/Stream (HTTP/2, content-type application/grpc); each message is
//! the bytes below inside gRPC's 5-byte prefix (uncompressed flag, u32 BE length)
//! filter → sidecar ("ask")
//!   u64 LE    id, unique on the stream; 0 for a finished report, which is not answered
//!   u8        length of the request id (at most 128)
//!   [u8]      the request's x-request-id (for /debug/explain), UTF-8, maybe empty
//!   [u8]      a hint request (KVH…) or, with id 0, a finished report (KVF…), as over HTTP
//! sidecar → filter ("answer")
//!   u64 LE    id of the hint request answered
//!   u16 LE    status, as HTTP's: 200 with the hint's JSON, as over HTTP; 400 or 404 with a reason
//!   [u8]      body
//! ```
//! The sidecar answers each ask once, in any order. The filter times asks out itself; an answer
//! to an ask it no longer waits for is dropped.

/// The gRPC service.
pub const SERVICE: &str = "kvroute.Hints";
/// The gRPC method.
pub const METHOD: &str = "Stream";
/// The HTTP/2 path of the method.
pub const PATH: &str = "/kvroute.Hints/Stream";
/// The id of an ask that carries a finished report: no answer.
pub const REPORT_ID: u64 = 0;
/// The longest request id an ask carries; a longer one is left out.
pub const MAX_REQUEST_ID: usize = 128;

/// A message from the filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ask<'a> {
    /// Its id ([`REPORT_ID`]: a finished report).
    pub id: u64,
    /// The request's `x-request-id` (empty: none).
    pub request_id: &'a str,
    /// A hint request or a finished report, as encoded for HTTP.
    pub body: &'a [u8],
}

/// A message from the sidecar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Answer<'a> {
    /// The id of the ask it answers.
    pub id: u64,
    /// HTTP's status for the same answer.
    pub status: u16,
    /// The body HTTP would carry.
    pub body: &'a [u8],
}

/// Why a stream message could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StreamDecodeError {
    /// Shorter than its fixed fields.
    #[error("truncated hint stream message")]
    Truncated,
    /// The request id is not UTF-8.
    #[error("request id is not UTF-8")]
    RequestIdNotUtf8,
}

impl Ask<'_> {
    /// Encode (a request id over [`MAX_REQUEST_ID`] bytes is left out).
    pub fn encode(&self) -> Vec<u8> {
        let request_id = if self.request_id.len() <= MAX_REQUEST_ID {
            self.request_id.as_bytes()
        } else {
            &[]
        };
        let mut out = Vec::with_capacity(9 + request_id.len() + self.body.len());
        out.extend_from_slice(&self.id.to_le_bytes());
        out.push(request_id.len() as u8);
        out.extend_from_slice(request_id);
        out.extend_from_slice(self.body);
        out
    }
}

impl<'a> Ask<'a> {
    /// Decode; the body is not checked here (the hint decoder does that).
    pub fn decode(msg: &'a [u8]) -> Result<Self, StreamDecodeError> {
        let (id, rest) = take_u64(msg)?;
        let (&len, rest) = rest.split_first().ok_or(StreamDecodeError::Truncated)?;
        if rest.len() < usize::from(len) {
            return Err(StreamDecodeError::Truncated);
        }
        let (request_id, body) = rest.split_at(usize::from(len));
        let request_id =
            std::str::from_utf8(request_id).map_err(|_| StreamDecodeError::RequestIdNotUtf8)?;
        Ok(Ask {
            id,
            request_id,
            body,
        })
    }
}

impl Answer<'_> {
    /// Encode.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(10 + self.body.len());
        out.extend_from_slice(&self.id.to_le_bytes());
        out.extend_from_slice(&self.status.to_le_bytes());
        out.extend_from_slice(self.body);
        out
    }
}

impl<'a> Answer<'a> {
    /// Decode.
    pub fn decode(msg: &'a [u8]) -> Result<Self, StreamDecodeError> {
        let (id, rest) = take_u64(msg)?;
        if rest.len() < 2 {
            return Err(StreamDecodeError::Truncated);
        }
        let (status, body) = rest.split_at(2);
        Ok(Answer {
            id,
            status: u16::from_le_bytes([status[0], status[1]]),
            body,
        })
    }
}

fn take_u64(bytes: &[u8]) -> Result<(u64, &[u8]), StreamDecodeError> {
    if bytes.len() < 8 {
        return Err(StreamDecodeError::Truncated);
    }
    let (id, rest) = bytes.split_at(8);
    Ok((u64::from_le_bytes(id.try_into().expect("8 bytes")), rest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn asks_and_answers_round_trip() {
        let ask = Ask {
            id: 7,
            request_id: "7f3c",
            body: b"KVH2\x01\x00m",
        };
        assert_eq!(Ask::decode(&ask.encode()), Ok(ask));
        let report = Ask {
            id: REPORT_ID,
            request_id: "",
            body: b"KVF2",
        };
        assert_eq!(Ask::decode(&report.encode()), Ok(report));
        let answer = Answer {
            id: u64::MAX,
            status: 404,
            body: b"unknown model m",
        };
        assert_eq!(Answer::decode(&answer.encode()), Ok(answer));
    }

    #[test]
    fn a_long_request_id_is_left_out() {
        let long = "x".repeat(MAX_REQUEST_ID + 1);
        let ask = Ask {
            id: 1,
            request_id: &long,
            body: b"KVH2",
        };
        let decoded_bytes = ask.encode();
        let decoded = Ask::decode(&decoded_bytes).unwrap();
        assert_eq!((decoded.request_id, decoded.body), ("", &b"KVH2"[..]));
    }

    #[test]
    fn short_or_bad_messages_are_errors() {
        assert_eq!(Ask::decode(b"1234567"), Err(StreamDecodeError::Truncated));
        assert_eq!(Ask::decode(b"12345678"), Err(StreamDecodeError::Truncated));
        assert_eq!(
            Ask::decode(b"12345678\x05ab"),
            Err(StreamDecodeError::Truncated)
        );
        assert_eq!(
            Ask::decode(b"12345678\x01\xff"),
            Err(StreamDecodeError::RequestIdNotUtf8)
        );
        assert_eq!(
            Answer::decode(b"123456789"),
            Err(StreamDecodeError::Truncated)
        );
        assert!(Answer::decode(b"12345678\xc8\x00").is_ok_and(|a| a.body.is_empty()));
    }
}
