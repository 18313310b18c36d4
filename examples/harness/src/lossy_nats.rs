//! A NATS proxy that loses messages: put between `nats-server` and one sidecar, it drops a
//! seeded fraction of the messages on matching subjects on their way to the client, so a test
//! can see how the sidecar copes with a lossy event transport without changing the product.
//!
//! Client → server bytes pass unchanged. Server → client bytes are parsed as the NATS client
//! protocol (<https://docs.nats.io/reference/reference-protocols/nats-protocol>): `MSG` and
//! `HMSG` frames are cut by their byte counts, never by searching for `\r\n`, since a payload
//! may hold anything; every other operation is one line and passes as it is.

use std::io;
use std::net::SocketAddr;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};

/// A control line longer than this means we are not reading NATS (`nats-server` refuses
/// control lines over 4 KiB by default; INFO with many cluster URLs can be longer).
const MAX_LINE: usize = 1 << 20;

/// A payload longer than this means we are not reading NATS (the server's hard limit is 64 MiB).
const MAX_PAYLOAD: usize = 64 << 20;

/// What to drop: messages whose subject contains `subject_contains`, each with probability `loss`.
#[derive(Debug, Clone, PartialEq)]
pub struct LossSpec {
    /// Probability, 0.0..=1.0, that a matching message is dropped.
    pub loss: f64,
    /// Seed of the generator that decides; the same seed drops the same messages of the same
    /// stream. Each connection through the proxy gets its own generator, seeded from this and the
    /// connection's number, so a reconnecting client does not replay the first connection's losses.
    pub seed: u64,
    /// A message is a candidate for dropping when its subject contains this (empty: every message).
    pub subject_contains: String,
}

/// Candidate messages (matching subject) seen so far, over all connections.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LossCounts {
    /// Passed on to the client.
    pub forwarded: u64,
    /// Dropped.
    pub dropped: u64,
}

/// State shared by the handle and the connection tasks.
struct Shared {
    /// The current loss probability, as `f64` bits, so [`LossyNats::set_loss`] can black out a run.
    loss: AtomicU64,
    forwarded: AtomicU64,
    dropped: AtomicU64,
}

/// A running lossy proxy in front of one NATS server; stops when dropped.
pub struct LossyNats {
    addr: SocketAddr,
    shared: Arc<Shared>,
    /// The accept loop; it owns the connection tasks, so aborting it ends them all.
    task: JoinHandle<()>,
}

impl LossyNats {
    /// Listen on a free loopback port and relay every connection to `upstream`, losing as `spec` says.
    pub async fn start(upstream: SocketAddr, spec: LossSpec) -> io::Result<LossyNats> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            loss: AtomicU64::new(clamp_loss(spec.loss).to_bits()),
            forwarded: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
        });
        let needle: Arc<[u8]> = spec.subject_contains.as_bytes().into();
        let state = Arc::clone(&shared);
        let task = tokio::spawn(async move {
            let mut connections = JoinSet::new();
            for number in 0u64.. {
                let Ok((client, _)) = listener.accept().await else {
                    // Out of file descriptors, say: try again later rather than spin.
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    continue;
                };
                while connections.try_join_next().is_some() {}
                let relay = Relay {
                    shared: Arc::clone(&state),
                    needle: Arc::clone(&needle),
                    rng: SplitMix64(spec.seed.wrapping_add(number)),
                };
                connections.spawn(relay.run(client, upstream));
            }
        });
        Ok(LossyNats { addr, shared, task })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// The URL a NATS client connects to.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port())
    }

    /// Change the loss probability from now on (clamped to 0.0..=1.0), e.g. 1.0 for a blackout.
    pub fn set_loss(&self, loss: f64) {
        self.shared
            .loss
            .store(clamp_loss(loss).to_bits(), Ordering::Relaxed);
    }

    /// Matching messages forwarded and dropped so far.
    pub fn counts(&self) -> LossCounts {
        LossCounts {
            forwarded: self.shared.forwarded.load(Ordering::Relaxed),
            dropped: self.shared.dropped.load(Ordering::Relaxed),
        }
    }

    /// Stop listening and close every relayed connection.
    pub fn stop(self) {
        drop(self);
    }
}

impl Drop for LossyNats {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// NaN counts as no loss; anything else is clamped to a probability.
fn clamp_loss(loss: f64) -> f64 {
    if loss.is_nan() {
        0.0
    } else {
        loss.clamp(0.0, 1.0)
    }
}

/// One client connection's relay.
struct Relay {
    shared: Arc<Shared>,
    needle: Arc<[u8]>,
    rng: SplitMix64,
}

impl Relay {
    /// Relay until the server closes or either side fails. When the client stops sending, the
    /// server is told so and its remaining output still reaches the client.
    async fn run(mut self, mut client: TcpStream, upstream: SocketAddr) {
        let Ok(mut server) = TcpStream::connect(upstream).await else {
            return;
        };
        let _ = client.set_nodelay(true);
        let _ = server.set_nodelay(true);
        let (mut client_read, mut client_write) = client.split();
        let (mut server_read, mut server_write) = server.split();
        let to_server = async {
            let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
            let _ = server_write.shutdown().await;
            std::future::pending::<()>().await;
        };
        tokio::select! {
            _ = self.relay_to_client(&mut server_read, &mut client_write) => {}
            () = to_server => {}
        }
        let _ = client_write.shutdown().await;
    }

    /// Forward whole frames, leaving out the dropped messages. A partial frame waits in `buf`
    /// for the rest; on anything that is not NATS, the rest of the stream passes unparsed.
    async fn relay_to_client(
        &mut self,
        from: &mut (impl AsyncRead + Unpin),
        to: &mut (impl AsyncWrite + Unpin),
    ) -> io::Result<()> {
        let mut buf: Vec<u8> = Vec::with_capacity(64 * 1024);
        let mut out: Vec<u8> = Vec::with_capacity(64 * 1024);
        loop {
            buf.reserve(64 * 1024);
            if from.read_buf(&mut buf).await? == 0 {
                // A frame cut short by the server closing: pass on what there is.
                return to.write_all(&buf).await;
            }
            let mut start = 0;
            let garbage = loop {
                match next_frame(&buf[start..]) {
                    Ok(Some(frame)) => {
                        let bytes = &buf[start..start + frame.len];
                        if !frame.subject.is_some_and(|s| self.drops(&bytes[s])) {
                            out.extend_from_slice(bytes);
                        }
                        start += frame.len;
                    }
                    Ok(None) => break false,
                    Err(NotNats) => break true,
                }
            };
            if garbage {
                eprintln!(
                    "lossy_nats: the server sent something not NATS; relaying the rest unfiltered"
                );
                out.extend_from_slice(&buf[start..]);
                to.write_all(&out).await?;
                tokio::io::copy(from, to).await?;
                return Ok(());
            }
            buf.drain(..start);
            if !out.is_empty() {
                to.write_all(&out).await?;
                out.clear();
            }
        }
    }

    /// Whether to drop a message on `subject`; counts the candidates.
    fn drops(&mut self, subject: &[u8]) -> bool {
        if !contains(subject, &self.needle) {
            return false;
        }
        // Drawn for every candidate, whatever the loss, so a blackout does not shift which
        // messages a later phase drops.
        let roll = self.rng.next_f64();
        let loss = f64::from_bits(self.shared.loss.load(Ordering::Relaxed));
        let lost = roll < loss;
        let counter = if lost {
            &self.shared.dropped
        } else {
            &self.shared.forwarded
        };
        counter.fetch_add(1, Ordering::Relaxed);
        lost
    }
}

/// `haystack` contains `needle` (everything contains the empty needle).
fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    needle.is_empty() || haystack.windows(needle.len()).any(|w| w == needle)
}

/// splitmix64: a seeded generator, small and good enough to pick which messages are lost.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// One complete server → client frame at the start of a buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Frame {
    /// Its length in bytes, including the trailing `\r\n` (of the payload, for a message).
    len: usize,
    /// For `MSG` and `HMSG`, where the subject is within the frame; other operations have none.
    subject: Option<Range<usize>>,
}

/// The stream is not the NATS protocol (or not a version of it we know).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct NotNats;

/// The first frame of `buf`: `Ok(None)` if it is not all there yet.
fn next_frame(buf: &[u8]) -> Result<Option<Frame>, NotNats> {
    let Some(newline) = buf.iter().position(|&b| b == b'\n') else {
        return if buf.len() > MAX_LINE {
            Err(NotNats)
        } else {
            Ok(None)
        };
    };
    let line_len = newline + 1;
    if line_len > MAX_LINE {
        return Err(NotNats);
    }
    let line = &buf[..newline];
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    // Fields with their offsets; NATS separates them by spaces or tabs, possibly several.
    let mut fields = Vec::with_capacity(6);
    let mut i = 0;
    while i < line.len() {
        if line[i] == b' ' || line[i] == b'\t' {
            i += 1;
            continue;
        }
        let begin = i;
        while i < line.len() && line[i] != b' ' && line[i] != b'\t' {
            i += 1;
        }
        fields.push(begin..i);
        if fields.len() > 6 {
            break;
        }
    }
    let op = fields.first().map_or(&b""[..], |f| &line[f.clone()]);
    // Operations are case-insensitive; the server sends upper case.
    let payload = if op.eq_ignore_ascii_case(b"MSG") {
        // MSG <subject> <sid> [reply-to] <#bytes>
        if !(4..=5).contains(&fields.len()) {
            return Err(NotNats);
        }
        size(&line[fields[fields.len() - 1].clone()])?
    } else if op.eq_ignore_ascii_case(b"HMSG") {
        // HMSG <subject> <sid> [reply-to] <#header bytes> <#total bytes>
        if !(5..=6).contains(&fields.len()) {
            return Err(NotNats);
        }
        let headers = size(&line[fields[fields.len() - 2].clone()])?;
        let total = size(&line[fields[fields.len() - 1].clone()])?;
        if headers > total {
            return Err(NotNats);
        }
        total
    } else {
        return Ok(Some(Frame {
            len: line_len,
            subject: None,
        }));
    };
    let len = line_len + payload + 2;
    if buf.len() < len {
        return Ok(None);
    }
    if buf[len - 2..len] != b"\r\n"[..] {
        return Err(NotNats);
    }
    Ok(Some(Frame {
        len,
        subject: Some(fields[1].clone()),
    }))
}

/// A byte count: ASCII digits, at most [`MAX_PAYLOAD`].
fn size(field: &[u8]) -> Result<usize, NotNats> {
    if field.is_empty() || field.len() > 9 || !field.iter().all(u8::is_ascii_digit) {
        return Err(NotNats);
    }
    let n = field
        .iter()
        .fold(0usize, |n, &d| n * 10 + usize::from(d - b'0'));
    if n > MAX_PAYLOAD {
        return Err(NotNats);
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn msg(subject: &str, reply: Option<&str>, payload: &str) -> Vec<u8> {
        let reply = reply.map(|r| format!(" {r}")).unwrap_or_default();
        format!("MSG {subject} 7{reply} {}\r\n{payload}\r\n", payload.len()).into_bytes()
    }

    fn hmsg(subject: &str, reply: Option<&str>, headers: &str, payload: &str) -> Vec<u8> {
        let reply = reply.map(|r| format!(" {r}")).unwrap_or_default();
        let (h, t) = (headers.len(), headers.len() + payload.len());
        format!("HMSG {subject} 9{reply} {h} {t}\r\n{headers}{payload}\r\n").into_bytes()
    }

    #[test]
    fn next_frame_cuts_by_byte_count() {
        let m = msg(
            "kv-events.a",
            Some("_INBOX.x"),
            "ab\r\nMSG kv-events.b 1 2\r\nxy",
        );
        let mut buf = m.clone();
        buf.extend_from_slice(b"PING\r\n");
        let frame = next_frame(&buf).unwrap().unwrap();
        assert_eq!(frame.len, m.len());
        assert_eq!(&buf[frame.subject.unwrap()], b"kv-events.a");
        assert_eq!(
            next_frame(&buf[m.len()..]),
            Ok(Some(Frame {
                len: 6,
                subject: None
            }))
        );
        // Every proper prefix is incomplete, never a shorter frame.
        for cut in 0..m.len() {
            assert_eq!(next_frame(&m[..cut]), Ok(None), "cut at {cut}");
        }

        let h = hmsg("kv_events.b", None, "NATS/1.0\r\nA: b\r\n\r\n", "x\r\ny");
        let frame = next_frame(&h).unwrap().unwrap();
        assert_eq!(frame.len, h.len());
        assert_eq!(&h[frame.subject.unwrap()], b"kv_events.b");
        let h = hmsg("s", Some("r"), "NATS/1.0\r\n\r\n", "");
        assert_eq!(next_frame(&h).unwrap().unwrap().len, h.len());

        let lower = b"msg\tsub  1 3\r\nabc\r\n";
        let frame = next_frame(lower).unwrap().unwrap();
        assert_eq!((frame.len, frame.subject), (lower.len(), Some(4..7)));
        for line in [
            &b"INFO {\"a\":1}\r\n"[..],
            b"+OK\r\n",
            b"-ERR 'x'\r\n",
            b"\r\n",
        ] {
            assert_eq!(
                next_frame(line),
                Ok(Some(Frame {
                    len: line.len(),
                    subject: None
                }))
            );
        }
    }

    #[test]
    fn next_frame_rejects_what_is_not_nats() {
        for bad in [
            &b"MSG a 1 x\r\nabc\r\n"[..],
            b"MSG a 1\r\n",
            b"MSG a 1 b c 3\r\nabc\r\n",
            b"MSG a 1 3\r\nabcXY",
            b"HMSG a 1 5 3\r\nabc\r\n",
            b"HMSG a 1 3\r\nabc\r\n",
            b"MSG a 1 -3\r\n",
            b"MSG a 1 99999999999999999999\r\n",
        ] {
            assert_eq!(
                next_frame(bad),
                Err(NotNats),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        assert_eq!(next_frame(&vec![b'x'; MAX_LINE + 1]), Err(NotNats));
    }

    /// One frame of the script, and whether its subject matches the filter.
    struct Scripted {
        bytes: Vec<u8>,
        candidate: bool,
    }

    fn script() -> Vec<Scripted> {
        let plain = |b: &[u8]| Scripted {
            bytes: b.to_vec(),
            candidate: false,
        };
        let mut frames = vec![
            plain(b"INFO {\"server_id\":\"x\",\"headers\":true,\"max_payload\":1048576}\r\n"),
            plain(b"PING\r\n"),
            Scripted {
                bytes: msg("kv-events.w1", None, "first event"),
                candidate: true,
            },
            plain(&msg("other.subject", None, "not an event")),
            Scripted {
                bytes: msg("kv-events.w2", Some("_INBOX.abc.1"), "with reply"),
                candidate: true,
            },
            Scripted {
                bytes: msg(
                    "kv-events.w3",
                    None,
                    "tricky\r\nMSG kv-events.w9 1 3\r\nabc\r\n",
                ),
                candidate: true,
            },
            plain(&msg(
                "ctl.tricky",
                None,
                "x\r\nHMSG kv-events.w9 1 2 3\r\nab",
            )),
            Scripted {
                bytes: hmsg(
                    "kv-events.w4",
                    None,
                    "NATS/1.0\r\nK: v\r\n\r\n",
                    "hdr event",
                ),
                candidate: true,
            },
            Scripted {
                bytes: hmsg(
                    "kv-events.w5",
                    Some("_INBOX.r"),
                    "NATS/1.0\r\n\r\n",
                    "hdr reply",
                ),
                candidate: true,
            },
            plain(&hmsg("other.h", Some("_INBOX.q"), "NATS/1.0\r\n\r\n", "h")),
            plain(b"+OK\r\n"),
            plain(b"PONG\r\n"),
            plain(b"-ERR 'Unknown Protocol Operation'\r\n"),
            Scripted {
                bytes: msg("kv-events.empty", None, ""),
                candidate: true,
            },
        ];
        for i in 0..400 {
            let payload = format!("event {i}\r\nMSG x 1 2\r\n");
            let bytes = match i % 5 {
                0 => msg(&format!("kv-events.e{i}"), None, &payload),
                1 => msg(&format!("kv-events.e{i}"), Some("_INBOX.z"), &payload),
                2 => hmsg(
                    &format!("kv-events.e{i}"),
                    None,
                    "NATS/1.0\r\n\r\n",
                    &payload,
                ),
                3 => hmsg(
                    &format!("kv-events.e{i}"),
                    Some("r"),
                    "NATS/1.0\r\n\r\n",
                    &payload,
                ),
                _ => msg(&format!("metrics.e{i}"), None, &payload),
            };
            frames.push(Scripted {
                bytes,
                candidate: i % 5 != 4,
            });
            if i % 50 == 0 {
                frames.push(plain(b"PING\r\n"));
            }
        }
        frames
    }

    /// A fake NATS server: sends `stream` to every client in small, spaced writes for the first
    /// `slow` bytes and bigger ones after; reports what each client sent.
    async fn upstream(
        stream: Vec<u8>,
        slow: usize,
    ) -> (SocketAddr, tokio::sync::mpsc::UnboundedReceiver<Vec<u8>>) {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            loop {
                let (mut socket, _) = listener.accept().await.unwrap();
                socket.set_nodelay(true).unwrap();
                let stream = stream.clone();
                let tx = tx.clone();
                tokio::spawn(async move {
                    let (mut read, mut write) = socket.split();
                    let send = async {
                        let (mut at, mut step) = (0, 0);
                        while at < stream.len() {
                            let n = if at < slow { 1 + step % 7 } else { 997 };
                            let end = (at + n).min(stream.len());
                            write.write_all(&stream[at..end]).await.unwrap();
                            if at < slow {
                                tokio::time::sleep(Duration::from_millis(1)).await;
                            }
                            (at, step) = (end, step + 1);
                        }
                        write.shutdown().await.unwrap();
                    };
                    let receive = async {
                        let mut got = Vec::new();
                        read.read_to_end(&mut got).await.unwrap();
                        got
                    };
                    let ((), got) = tokio::join!(send, receive);
                    let _ = tx.send(got);
                });
            }
        });
        (addr, rx)
    }

    /// Connect through the proxy, say something, and read until the server closes.
    async fn client(proxy: &LossyNats) -> Vec<u8> {
        let mut socket = TcpStream::connect(proxy.addr()).await.unwrap();
        socket
            .write_all(b"CONNECT {\"headers\":true}\r\nSUB kv-events.> 1\r\nPONG\r\n")
            .await
            .unwrap();
        socket.shutdown().await.unwrap();
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(30), socket.read_to_end(&mut got))
            .await
            .expect("the proxy relays to the end")
            .unwrap();
        got
    }

    /// Which frames of `frames` are in `got`, in order, none changed; panics on anything else.
    fn which_kept(frames: &[Scripted], got: &[u8]) -> Vec<bool> {
        let mut at = 0;
        let kept = frames
            .iter()
            .map(|f| {
                let here = got[at..].starts_with(&f.bytes);
                if here {
                    at += f.bytes.len();
                }
                here
            })
            .collect();
        assert_eq!(
            at,
            got.len(),
            "bytes left over that are no frame of the script"
        );
        kept
    }

    #[tokio::test]
    async fn drops_matching_messages_and_nothing_else() {
        let frames = script();
        let stream: Vec<u8> = frames.iter().flat_map(|f| f.bytes.clone()).collect();
        let candidates = frames.iter().filter(|f| f.candidate).count() as u64;
        let slow = frames[..16].iter().map(|f| f.bytes.len()).sum();
        let (addr, mut sent) = upstream(stream.clone(), slow).await;
        let spec = |loss| LossSpec {
            loss,
            seed: 42,
            subject_contains: "kv-events".into(),
        };
        let said = b"CONNECT {\"headers\":true}\r\nSUB kv-events.> 1\r\nPONG\r\n";

        let proxy = LossyNats::start(addr, spec(0.0)).await.unwrap();
        assert_eq!(proxy.url(), format!("nats://127.0.0.1:{}", proxy.port()));
        assert_eq!(client(&proxy).await, stream, "no loss: the very same bytes");
        assert_eq!(
            sent.recv().await.unwrap(),
            said,
            "client to server unchanged"
        );
        assert_eq!(
            proxy.counts(),
            LossCounts {
                forwarded: candidates,
                dropped: 0
            }
        );

        // A blackout on the same proxy: every candidate goes, everything else stays.
        proxy.set_loss(1.0);
        let got = client(&proxy).await;
        assert_eq!(sent.recv().await.unwrap(), said);
        let kept = which_kept(&frames, &got);
        for (frame, kept) in frames.iter().zip(&kept) {
            assert_eq!(
                *kept,
                !frame.candidate,
                "{}",
                String::from_utf8_lossy(&frame.bytes)
            );
        }
        assert_eq!(
            proxy.counts(),
            LossCounts {
                forwarded: candidates,
                dropped: candidates
            }
        );
        proxy.stop();

        // Half, seeded: about half of the candidates, the same ones for the same seed.
        let mut runs = Vec::new();
        for _ in 0..2 {
            let proxy = LossyNats::start(addr, spec(0.5)).await.unwrap();
            let got = client(&proxy).await;
            sent.recv().await.unwrap();
            let kept = which_kept(&frames, &got);
            let dropped = frames
                .iter()
                .zip(&kept)
                .filter(|(f, k)| {
                    assert!(f.candidate || **k, "only candidates are dropped");
                    !**k
                })
                .count() as u64;
            let counts = proxy.counts();
            assert_eq!(counts.dropped, dropped);
            assert_eq!(counts.forwarded + counts.dropped, candidates);
            let share = dropped as f64 / candidates as f64;
            assert!(
                (0.4..=0.6).contains(&share),
                "dropped {dropped} of {candidates}"
            );
            runs.push(got);
        }
        assert_eq!(runs[0], runs[1], "same seed, same losses");
    }

    #[tokio::test]
    async fn passes_the_rest_unparsed_after_garbage() {
        let good = msg("kv-events.a", None, "dropped");
        let mut stream = good.clone();
        stream.extend_from_slice(b"MSG kv-events.b 1 nonsense\r\n");
        let after = msg(
            "kv-events.c",
            None,
            "kept, since nothing is parsed any more",
        );
        stream.extend_from_slice(&after);
        let (addr, _sent) = upstream(stream.clone(), 0).await;
        let spec = LossSpec {
            loss: 1.0,
            seed: 1,
            subject_contains: "kv-events".into(),
        };
        let proxy = LossyNats::start(addr, spec).await.unwrap();
        let got = client(&proxy).await;
        assert_eq!(got, stream[good.len()..]);
        assert_eq!(
            proxy.counts(),
            LossCounts {
                forwarded: 0,
                dropped: 1
            }
        );
    }
}
