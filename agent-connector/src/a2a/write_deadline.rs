//! A connection whose writes must make progress: the facade's sockets to
//! its local clients are wrapped in [`WriteDeadline`], so a client that
//! stops reading (a stalled SSE subscriber, a process stopped under a
//! debugger) is cut once one write has waited [`FACADE_WRITE_TIMEOUT`],
//! instead of holding its task, its socket and the facade's shutdown for as
//! long as the client likes.
//!
//! Never: counts time while writes complete: the clock starts when a write
//! or flush first finds the socket full, and any progress stops it.

use std::future::Future as _;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// How long one write to a facade client may wait for the client to read
/// (the CP endpoint's writes to runtimes have the same bound).
pub const FACADE_WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// `inner` with a deadline on every write, flush and shutdown: one that
/// stays pending for `limit` fails with [`io::ErrorKind::TimedOut`]. Reads
/// pass through.
#[derive(Debug)]
pub struct WriteDeadline<T> {
    inner: T,
    limit: Duration,
    /// Running while a write waits for room; `None` after progress.
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<T> WriteDeadline<T> {
    /// Wraps `inner`.
    pub fn new(inner: T, limit: Duration) -> Self {
        WriteDeadline {
            inner,
            limit,
            stalled: None,
        }
    }

    /// Passes a ready result through (and stops the clock); for a pending
    /// one, starts or checks the clock.
    fn progress<R>(&mut self, cx: &mut Context<'_>, r: Poll<io::Result<R>>) -> Poll<io::Result<R>> {
        if r.is_ready() {
            self.stalled = None;
            return r;
        }
        let limit = self.limit;
        let clock = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        if clock.as_mut().poll(cx).is_ready() {
            self.stalled = None;
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the client read nothing for {} ms", limit.as_millis()),
            )));
        }
        Poll::Pending
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for WriteDeadline<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for WriteDeadline<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.progress(cx, r)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.progress(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_flush(cx);
        self.progress(cx, r)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.progress(cx, r)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    /// A peer that reads nothing: the write that finds the pipe full fails
    /// `TimedOut` once the limit has passed, not before.
    #[tokio::test(start_paused = true)]
    async fn a_write_the_peer_does_not_read_fails_at_the_limit() {
        let (near, _far) = tokio::io::duplex(64);
        let mut w = WriteDeadline::new(near, Duration::from_secs(10));
        let started = tokio::time::Instant::now();
        let e = w.write_all(&[7u8; 1024]).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), Duration::from_secs(10));
    }

    /// A peer that reads slowly but keeps reading: every pause is shorter
    /// than the limit, so however long the whole write takes it succeeds.
    #[tokio::test(start_paused = true)]
    async fn a_slow_reader_that_keeps_reading_is_never_cut() {
        let (near, mut far) = tokio::io::duplex(64);
        let mut w = WriteDeadline::new(near, Duration::from_secs(10));
        let reader = tokio::spawn(async move {
            let mut got = 0;
            let mut buf = [0u8; 64];
            while got < 4096 {
                tokio::time::sleep(Duration::from_secs(6)).await;
                got += far.read(&mut buf).await.unwrap();
            }
            got
        });
        let started = tokio::time::Instant::now();
        w.write_all(&[7u8; 4096]).await.unwrap();
        w.flush().await.unwrap();
        assert!(started.elapsed() > Duration::from_secs(60));
        assert_eq!(reader.await.unwrap(), 4096);
    }
}
