//! The API's connections, bounded. At most `max` are open at once: when one more arrives, the
//! one idle longest is closed to make room, so a flood of idle or half-sent connections cannot
//! lock Envoy out of its hints; and a connection that moves no byte either way for `idle` is
//! closed. The process's descriptor limit is raised to its hard limit at start, and `max` is
//! kept below it, so the listener never fails to accept for want of a descriptor.

use std::collections::HashMap;
use std::future::Future as _;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::serve::Listener;
use futures::task::AtomicWaker;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// Raise the soft limit on open descriptors to the hard one; the soft limit now in force.
pub fn raise_descriptor_limit() -> u64 {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write the struct passed.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        tracing::warn!(error = %io::Error::last_os_error(), "cannot read the open-descriptor limit");
        return 1024;
    }
    let soft = limit.rlim_cur;
    if soft >= limit.rlim_max {
        tracing::info!(
            limit = soft,
            "open-descriptor limit already at its hard limit"
        );
        return soft;
    }
    let raised = libc::rlimit {
        rlim_cur: limit.rlim_max,
        rlim_max: limit.rlim_max,
    };
    // SAFETY: as above.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
        tracing::warn!(soft, hard = limit.rlim_max, error = %io::Error::last_os_error(), "cannot raise the open-descriptor limit to its hard limit");
        return soft;
    }
    tracing::info!(
        from = soft,
        to = limit.rlim_max,
        "open-descriptor limit raised to its hard limit"
    );
    limit.rlim_max
}

/// How many API connections may be open under a descriptor limit of `limit`: `wanted`, or less
/// when the limit leaves too little room beside the event sources, scrapes and files (a quarter
/// of it, at least 64, is kept for them).
pub fn cap(wanted: usize, limit: u64) -> usize {
    let limit = usize::try_from(limit).unwrap_or(usize::MAX);
    let reserve = (limit / 4).max(64);
    wanted.min(limit.saturating_sub(reserve)).max(1)
}

/// The open connections: when each last moved a byte, and how to close it.
#[derive(Default)]
struct Table {
    open: Mutex<HashMap<u64, Arc<Conn>>>,
    next: AtomicU64,
}

struct Conn {
    /// Milliseconds after `Bounded::epoch` of the last byte either way.
    last_ms: AtomicU64,
    /// Set to close it; its next read or write fails.
    closed: AtomicBool,
    /// Wakes a read or write waiting on it.
    waker: AtomicWaker,
}

impl Table {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Conn>>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A listener whose connections are bounded ([module docs](self)).
pub struct Bounded<L> {
    inner: L,
    table: Arc<Table>,
    epoch: Instant,
    max: usize,
    idle: Duration,
}

impl<L> Bounded<L> {
    /// `inner`'s connections, at most `max` open, closed after `idle` without a byte.
    pub fn new(inner: L, max: usize, idle: Duration) -> Self {
        Bounded {
            inner,
            table: Arc::default(),
            epoch: Instant::now(),
            max: max.max(1),
            idle,
        }
    }
}

impl<L: Listener> Listener for Bounded<L> {
    type Io = Guarded<L::Io>;
    type Addr = L::Addr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let (io, addr) = self.inner.accept().await;
        let now_ms = self.epoch.elapsed().as_millis() as u64;
        let mut open = self.table.lock();
        if open.len() >= self.max {
            // Make room: close the connection idle longest (a hint exchange takes
            // microseconds, so it is one that sends nothing, or sends slowly).
            // A closed connection leaves the table as it is closed: every one here is open.
            let oldest = open
                .iter()
                .min_by_key(|(_, c)| c.last_ms.load(Ordering::Relaxed))
                .map(|(id, c)| (*id, Arc::clone(c)));
            if let Some((id, conn)) = oldest {
                conn.closed.store(true, Ordering::Relaxed);
                conn.waker.wake();
                open.remove(&id);
                tracing::debug!(
                    max = self.max,
                    idle_ms = now_ms.saturating_sub(conn.last_ms.load(Ordering::Relaxed)),
                    "API connections at their bound: the one idle longest closed"
                );
            }
        }
        let id = self.table.next.fetch_add(1, Ordering::Relaxed);
        let conn = Arc::new(Conn {
            last_ms: AtomicU64::new(now_ms),
            closed: AtomicBool::new(false),
            waker: AtomicWaker::new(),
        });
        open.insert(id, Arc::clone(&conn));
        drop(open);
        let io = Guarded {
            io,
            id,
            conn,
            table: Arc::clone(&self.table),
            epoch: self.epoch,
            idle: self.idle,
            timer: Box::pin(tokio::time::sleep(self.idle)),
        };
        (io, addr)
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// One connection of a [`Bounded`] listener.
pub struct Guarded<Io> {
    io: Io,
    id: u64,
    conn: Arc<Conn>,
    table: Arc<Table>,
    epoch: Instant,
    idle: Duration,
    timer: Pin<Box<Sleep>>,
}

impl<Io> Guarded<Io> {
    fn touch(&self) {
        let now = self.epoch.elapsed().as_millis() as u64;
        self.conn.last_ms.store(now, Ordering::Relaxed);
    }

    /// Whether it must close now: closed to make room, or idle too long. Registers the task
    /// to be woken for either.
    fn must_close(&mut self, cx: &mut Context<'_>) -> Option<io::Error> {
        self.conn.waker.register(cx.waker());
        if self.conn.closed.load(Ordering::Relaxed) {
            return Some(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "closed to make room for a new connection",
            ));
        }
        while self.timer.as_mut().poll(cx).is_ready() {
            let last =
                self.epoch + Duration::from_millis(self.conn.last_ms.load(Ordering::Relaxed));
            let due = last + self.idle;
            if Instant::now() >= due {
                return Some(io::Error::new(io::ErrorKind::TimedOut, "idle"));
            }
            // Bytes moved since the timer was set: wait for the rest of the idle time.
            self.timer.as_mut().reset(due);
        }
        None
    }
}

impl<Io> Drop for Guarded<Io> {
    fn drop(&mut self) {
        self.table.lock().remove(&self.id);
    }
}

impl<Io: AsyncRead + Unpin> AsyncRead for Guarded<Io> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.io).poll_read(cx, buf) {
            Poll::Ready(r) => {
                if buf.filled().len() > before {
                    self.touch();
                }
                Poll::Ready(r)
            }
            Poll::Pending => match self.must_close(cx) {
                Some(e) => Poll::Ready(Err(e)),
                None => Poll::Pending,
            },
        }
    }
}

impl<Io: AsyncWrite + Unpin> AsyncWrite for Guarded<Io> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        if let Some(e) = self.must_close(cx) {
            return Poll::Ready(Err(e));
        }
        let r = Pin::new(&mut self.io).poll_write(cx, data);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.touch();
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn the_cap_leaves_room_beside_the_api() {
        assert_eq!(cap(4096, 1024), 768);
        assert_eq!(cap(4096, 1 << 20), 4096);
        assert_eq!(cap(4096, 100), 36);
        assert_eq!(cap(4096, 10), 1);
    }

    /// A listener of two: the third connection closes the one idle longest; a connection idle
    /// past the timeout is closed; one that keeps talking is not.
    #[tokio::test]
    async fn the_oldest_idle_connection_makes_room_and_idle_ones_close() {
        let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = tcp.local_addr().unwrap();
        let mut listener = Bounded::new(tcp, 2, Duration::from_millis(400));
        let connect = || tokio::net::TcpStream::connect(addr);
        let (_c1, (mut s1, _)) = tokio::join!(connect(), listener.accept());
        tokio::time::sleep(Duration::from_millis(20)).await;
        let (c2, (mut s2, _)) = tokio::join!(connect(), listener.accept());
        let mut c2 = c2.unwrap();
        // s1 is idle longest: a third connection closes it.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let (_c3, (mut s3, _)) = tokio::join!(connect(), listener.accept());
        let mut byte = [0u8; 1];
        let err = s1.read(&mut byte).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::ConnectionAborted);
        // s2 talks every 150 ms for a second and stays; s3 says nothing and goes.
        let start = Instant::now();
        let silent = tokio::spawn(async move { s3.read(&mut [0u8; 1]).await });
        for _ in 0..7 {
            c2.write_all(b"x").await.unwrap();
            assert_eq!(s2.read(&mut byte).await.unwrap(), 1);
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
        let err = silent.await.unwrap().unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(start.elapsed() >= Duration::from_millis(1000));
    }
}
