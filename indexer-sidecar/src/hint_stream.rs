//! The hint stream's server side: `POST /kvroute.Hints/Stream`, one long-lived gRPC stream per
//! Envoy worker thread (the wire is in [`kvroute_protocol::hint_stream`]).
//!
//! The response body *is* the answering: each time hyper polls it for bytes to send, it reads
//! whatever asks have arrived, answers them in order (`Sidecar::answer_hint`, as an HTTP hint
//! call is answered) and hands back their answers as one piece. No task or channel per stream:
//! an ask costs a read, a hint and a write. When Envoy stops reading, hyper stops polling, and
//! asks wait in the connection's window: the stream's own backpressure.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use http_body::Frame;
use kvroute_protocol::hint::decode_finished;
use kvroute_protocol::hint_stream::{Answer, Ask, REPORT_ID};

use crate::core::Input;
use crate::sidecar::Sidecar;

/// The largest ask read; a bigger one ends the stream (a hint request of 8 MiB is a prompt of a
/// million blocks).
const MAX_MESSAGE: usize = 8 << 20;
/// Answers handed to hyper in one piece at most (more wait for the next poll).
const MAX_PIECE: usize = 64 << 10;

/// gRPC's status codes used here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GrpcStatus {
    Ok = 0,
    ResourceExhausted = 8,
    Unimplemented = 12,
}

/// Open a hint stream: answers flow as asks arrive, until Envoy ends its side.
pub async fn serve(State(state): State<Arc<Sidecar>>, request: Request) -> Response {
    let body = Answering::new(state, request.into_body());
    (
        [(header::CONTENT_TYPE, "application/grpc")],
        Body::new(body),
    )
        .into_response()
}

/// The response body of one hint stream ([module docs](self)).
struct Answering {
    state: Arc<Sidecar>,
    asks: Body,
    /// Bytes of asks read, not yet a whole message.
    unread: Vec<u8>,
    /// Set once the asks ended (or could not be read): the trailers are next.
    ending: Option<GrpcStatus>,
    /// Set once the trailers are sent.
    done: bool,
}

impl Answering {
    fn new(state: Arc<Sidecar>, asks: Body) -> Self {
        state.hint_stream_opened();
        Answering {
            state,
            asks,
            unread: Vec::new(),
            ending: None,
            done: false,
        }
    }

    /// Answer every whole message in `unread` into `out` (framed); a message this side cannot
    /// read ends the stream.
    fn answer_unread(&mut self, out: &mut Vec<u8>) -> Result<(), GrpcStatus> {
        let mut at = 0;
        let result = loop {
            let rest = &self.unread[at..];
            let Some(head) = rest.get(..5) else {
                break Ok(());
            };
            if head[0] != 0 {
                tracing::warn!(
                    "hint stream: a compressed message; closing the stream (the filter sends none)"
                );
                break Err(GrpcStatus::Unimplemented);
            }
            let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
            if len > MAX_MESSAGE {
                tracing::warn!(
                    bytes = len,
                    "hint stream: a message over {MAX_MESSAGE} bytes; closing the stream"
                );
                break Err(GrpcStatus::ResourceExhausted);
            }
            let Some(msg) = rest.get(5..5 + len) else {
                break Ok(());
            };
            answer(&self.state, msg, out);
            at += 5 + len;
        };
        self.unread.drain(..at);
        result
    }
}

/// Answer one ask into `out`, framed; a report or an unreadable ask has no answer.
fn answer(state: &Sidecar, msg: &[u8], out: &mut Vec<u8>) {
    let ask = match Ask::decode(msg) {
        Ok(ask) => ask,
        Err(e) => {
            tracing::debug!(error = %e, "hint stream: an unreadable ask");
            state.bad_hint_request();
            return;
        }
    };
    if ask.id == REPORT_ID {
        match decode_finished(ask.body) {
            Ok(finished) => {
                state.ingest(Input::Finished(&finished), std::time::Instant::now());
            }
            Err(e) => tracing::debug!(error = %e, "hint stream: an unreadable finished report"),
        }
        return;
    }
    let request_id = Some(ask.request_id).filter(|id| !id.is_empty());
    let (status, body) = state.answer_hint(ask.body, request_id);
    let answer = Answer {
        id: ask.id,
        status,
        body: &body,
    }
    .encode();
    out.push(0);
    out.extend_from_slice(&(answer.len() as u32).to_be_bytes());
    out.extend_from_slice(&answer);
}

impl Drop for Answering {
    fn drop(&mut self) {
        self.state.hint_stream_closed();
    }
}

impl http_body::Body for Answering {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        let mut out = Vec::new();
        while this.ending.is_none() && out.len() < MAX_PIECE {
            match Pin::new(&mut this.asks).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    // Envoy's trailers, if any, carry nothing for us.
                    if let Ok(data) = frame.into_data() {
                        this.unread.extend_from_slice(&data);
                        if let Err(status) = this.answer_unread(&mut out) {
                            this.ending = Some(status);
                        }
                    }
                }
                Poll::Ready(None) | Poll::Ready(Some(Err(_))) => this.ending = Some(GrpcStatus::Ok),
                Poll::Pending => break,
            }
        }
        if !out.is_empty() {
            return Poll::Ready(Some(Ok(Frame::data(Bytes::from(out)))));
        }
        match this.ending {
            Some(status) => {
                this.done = true;
                let mut trailers = HeaderMap::new();
                trailers.insert("grpc-status", HeaderValue::from(status as u16));
                Poll::Ready(Some(Ok(Frame::trailers(trailers))))
            }
            None => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use kvroute_protocol::hint::{
        encode_finished, Finished, HintRequest, HintResponse, Ticket, Usage,
    };
    use kvroute_protocol::PrefixHash;

    fn framed(msg: &[u8]) -> Vec<u8> {
        let mut out = vec![0];
        out.extend_from_slice(&(msg.len() as u32).to_be_bytes());
        out.extend_from_slice(msg);
        out
    }

    fn ask(id: u64, model: &str) -> Vec<u8> {
        let hint = HintRequest {
            model: model.into(),
            hashes: vec![PrefixHash(1), PrefixHash(2)],
            finished: vec![],
        }
        .encode();
        framed(
            &Ask {
                id,
                request_id: "r",
                body: &hint,
            }
            .encode(),
        )
    }

    /// Sends `pieces` as the asks' body; the answers (id, status, body) and the trailers'
    /// grpc-status.
    async fn exchange(
        state: &Arc<Sidecar>,
        pieces: Vec<Vec<u8>>,
    ) -> (Vec<(u64, u16, Vec<u8>)>, String) {
        let asks = Body::from_stream(futures::stream::iter(
            pieces
                .into_iter()
                .map(|p| Ok::<_, Infallible>(Bytes::from(p))),
        ));
        let collected = Answering::new(Arc::clone(state), asks)
            .collect()
            .await
            .unwrap();
        let status = collected.trailers().unwrap()["grpc-status"]
            .to_str()
            .unwrap()
            .to_owned();
        let bytes = collected.to_bytes();
        let mut answers = Vec::new();
        let mut rest = &bytes[..];
        while !rest.is_empty() {
            assert_eq!(rest[0], 0, "uncompressed");
            let len = u32::from_be_bytes(rest[1..5].try_into().unwrap()) as usize;
            let a = Answer::decode(&rest[5..5 + len]).unwrap();
            answers.push((a.id, a.status, a.body.to_vec()));
            rest = &rest[5 + len..];
        }
        (answers, status)
    }

    /// Asks cut anywhere across the body's pieces are answered in order, each with its id;
    /// a report is read and not answered; the stream ends with grpc-status 0.
    #[tokio::test]
    async fn asks_cut_anywhere_are_answered_in_order() {
        let state = Arc::new(crate::sidecar::tests::sidecar());
        let report = Ask {
            id: REPORT_ID,
            request_id: "",
            body: &encode_finished(&[Finished {
                ticket: Ticket(1),
                usage: Usage::Unanswered,
            }]),
        }
        .encode();
        let mut all = ask(7, "m");
        all.extend(framed(&report));
        all.extend(ask(8, "nope"));
        all.extend(ask(9, "m"));
        let pieces = vec![all[..3].to_vec(), all[3..40].to_vec(), all[40..].to_vec()];
        let (answers, status) = exchange(&state, pieces).await;
        assert_eq!(status, "0");
        let ids: Vec<_> = answers.iter().map(|a| (a.0, a.1)).collect();
        assert_eq!(ids, [(7, 200), (8, 404), (9, 200)]);
        let hint: HintResponse = serde_json::from_slice(&answers[0].2).unwrap();
        assert_eq!(hint.workers, ["127.0.0.1:9000"]);
        assert!(hint.ticket.is_some());
        assert!(state.render_metrics().contains("kvroute_hint_streams 0"));
    }

    /// What this side cannot read ends the stream with gRPC's status for it; an unreadable
    /// ask is skipped and counted, the stream goes on.
    #[tokio::test]
    async fn unreadable_messages_skip_or_end() {
        let state = Arc::new(crate::sidecar::tests::sidecar());
        let mut pieces = framed(b"short");
        pieces.extend(ask(3, "m"));
        let (answers, status) = exchange(&state, vec![pieces]).await;
        assert_eq!((answers.len(), status.as_str()), (1, "0"));
        assert!(state
            .render_metrics()
            .contains("kvroute_hints_total{result=\"bad_request\"} 1"));

        let mut compressed = ask(4, "m");
        compressed[0] = 1;
        let (answers, status) = exchange(&state, vec![compressed]).await;
        assert_eq!((answers.len(), status.as_str()), (0, "12"));

        let huge = (MAX_MESSAGE as u32 + 1).to_be_bytes();
        let (_, status) = exchange(&state, vec![vec![0, huge[0], huge[1], huge[2], huge[3]]]).await;
        assert_eq!(status, "8");
    }
}
