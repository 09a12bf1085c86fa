//! Idle HTTP/1.1 keep-alive connections without buffers.
//!
//! hyper's HTTP/1 connection keeps an 8 KiB read buffer, an 8 KiB write buffer and the last
//! request's header map for as long as the connection lives, and it has no way to drop them
//! while the connection waits for the next request. So tollgate drops the whole hyper
//! connection instead: [`IdleIo`] sits between hyper and the socket, and when hyper asks for
//! the next request's first bytes, none have arrived, the last response is written out and
//! hyper holds no unread bytes, it parks the socket in [`ConnShared`] and tells hyper the
//! peer closed. hyper ends the connection cleanly, and the connection task (`server.rs`)
//! waits for the socket to become readable with nothing but the socket, then serves it with a
//! new hyper connection.
//!
//! A connection parks only after [`PARK_AFTER`] (5 ms) without a new request: a busy keep-alive
//! connection (the next request follows within a round trip) keeps its hyper connection, so
//! the parking costs nothing per request under load (building a hyper connection costs more than
//! serving a small request).
//!
//! "hyper holds no unread bytes" is made true by construction: [`IdleIo`] hands hyper a
//! request head only up to its blank line and a body only up to its `Content-Length`, and
//! keeps anything read past that (a pipelined request) for hyper's next read. Whenever the
//! reader and hyper could disagree about where a message ends (chunked or upgraded requests,
//! an unusual head), the connection is marked untracked and served as before, never parked.
//! hyper itself confirms the invariant: a connection that ends with unread bytes ends with an
//! error, and the server then closes the socket instead of serving it again.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::http::{BoxError, ProxyBody};

/// How long a connection waits between requests, with nothing unread or unwritten, before it
/// parks. Long enough for a busy client's next request (it follows within a round trip), short
/// enough that few connections hold hyper's buffers at once: at 100 ms, 10,000 connections
/// opened 64 at a time left the allocator at a high-water mark of 5.1 KiB per idle connection
/// instead of 2.2 (`bench/idle-conns`).
pub const PARK_AFTER: std::time::Duration = std::time::Duration::from_millis(5);

/// No framing published since the reader last looked.
const NO_FRAMING: u64 = u64::MAX;
/// A request whose body the reader cannot delimit (chunked, upgrade, CONNECT, odd length).
const UNTRACKABLE: u64 = u64::MAX - 1;

/// What the connection task, the service and [`IdleIo`] share for one client connection.
#[derive(Debug)]
pub struct ConnShared {
    /// Requests the service was called for.
    started: AtomicU32,
    /// Responses hyper is done with (their [`Tracked`] body was dropped).
    finished: AtomicU32,
    /// The body length of the request the service was called for last, until the reader takes
    /// it: [`NO_FRAMING`], [`UNTRACKABLE`] or a length.
    framing: AtomicU64,
    /// The socket, once [`IdleIo`] has parked it.
    parked: parking_lot::Mutex<Option<TcpStream>>,
}

impl Default for ConnShared {
    fn default() -> Self {
        Self {
            started: AtomicU32::new(0),
            finished: AtomicU32::new(0),
            framing: AtomicU64::new(NO_FRAMING),
            parked: parking_lot::Mutex::new(None),
        }
    }
}

impl ConnShared {
    /// Called by the service for each request, before anything else: counts it and publishes
    /// how its body is delimited (`framing`: its length, `None` when the reader cannot follow it;
    /// see `proxy::facts::Facts::framing`).
    pub fn on_request(&self, framing: Option<u64>) {
        self.started.fetch_add(1, Ordering::Relaxed);
        let framing = framing.filter(|&n| n < UNTRACKABLE).unwrap_or(UNTRACKABLE);
        if self.framing.swap(framing, Ordering::Relaxed) != NO_FRAMING {
            // The reader has not seen the previous request's framing: out of step.
            self.framing.store(UNTRACKABLE, Ordering::Relaxed);
        }
    }

    /// The socket [`IdleIo`] parked, if it did.
    pub fn take_parked(&self) -> Option<TcpStream> {
        self.parked.lock().take()
    }

    fn idle(&self, flushed: u32) -> bool {
        let finished = self.finished.load(Ordering::Relaxed);
        self.started.load(Ordering::Relaxed) == finished && flushed == finished
    }
}

/// A response body that tells [`ConnShared`] when hyper is done with it.
pub struct Tracked {
    inner: ProxyBody,
    shared: Arc<ConnShared>,
}

impl Tracked {
    /// Wrap `inner`; dropping the result counts the response as finished.
    pub fn new(inner: ProxyBody, shared: Arc<ConnShared>) -> Self {
        Self { inner, shared }
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.shared.finished.fetch_add(1, Ordering::Relaxed);
    }
}

impl hyper::body::Body for Tracked {
    type Data = bytes::Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// Where the reader is in the request stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Reading a request head. `matched`: how many bytes of the blank line (`\r\n\r\n`) end
    /// what hyper has got so far; `seen`: whether hyper has got any byte of this head.
    Head { matched: u8, seen: bool },
    /// The head went to hyper; the service has not said yet how its body is delimited.
    Framing,
    /// `left` bytes of the request body still to hand over.
    Body { left: u64 },
    /// Out of step with hyper, or a body it cannot follow: pass everything through, never
    /// park.
    Untracked,
}

/// The HTTP/1.1 socket as hyper sees it: see the module documentation.
pub struct IdleIo {
    stream: Option<TcpStream>,
    shared: Arc<ConnShared>,
    phase: Phase,
    /// Bytes read past the end of the current message; hyper gets them before the socket's.
    stash: BytesMut,
    /// `shared.finished` when hyper last flushed with nothing left in its write buffer.
    flushed: u32,
    /// Fires [`PARK_AFTER`] into a wait between requests (made at the first such wait, kept
    /// for the next ones).
    park_timer: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Whether `park_timer` counts down the current wait.
    park_armed: bool,
}

impl IdleIo {
    /// Wrap `stream`, at the start of a request.
    pub fn new(stream: TcpStream, shared: Arc<ConnShared>) -> Self {
        let flushed = shared.finished.load(Ordering::Relaxed);
        Self {
            stream: Some(stream),
            shared,
            phase: Phase::Head {
                matched: 0,
                seen: false,
            },
            stash: BytesMut::new(),
            flushed,
            park_timer: None,
            park_armed: false,
        }
    }

    /// Between requests with the socket not readable: has the connection waited
    /// [`PARK_AFTER`] (the timer wakes `cx` when it has)?
    fn waited_enough(&mut self, cx: &mut Context<'_>) -> bool {
        if !self.park_armed {
            let deadline = tokio::time::Instant::now() + PARK_AFTER;
            match self.park_timer.as_mut() {
                Some(t) => t.as_mut().reset(deadline),
                None => self.park_timer = Some(Box::pin(tokio::time::sleep_until(deadline))),
            }
            self.park_armed = true;
        }
        self.park_timer.as_mut().is_some_and(|t| t.as_mut().poll(cx).is_ready())
    }

    /// Take the framing the service published, if any.
    fn learn_framing(&mut self) {
        let f = self.shared.framing.swap(NO_FRAMING, Ordering::Relaxed);
        if f == NO_FRAMING {
            return;
        }
        self.phase = match (self.phase, f) {
            (Phase::Framing, 0) => Phase::Head {
                matched: 0,
                seen: false,
            },
            (Phase::Framing, n) if n != UNTRACKABLE => Phase::Body { left: n },
            _ => Phase::Untracked,
        };
    }

    /// Between requests, with nothing unread on either side and the last response written.
    fn can_park(&self) -> bool {
        self.phase
            == Phase::Head {
                matched: 0,
                seen: false,
            }
            && self.stash.is_empty()
            && self.shared.idle(self.flushed)
    }

    /// How many of `data` (the next bytes of the stream) hyper may have now; advances the phase
    /// past them. Never 0 for non-empty `data`.
    fn take(&mut self, data: &[u8]) -> usize {
        match self.phase {
            Phase::Head { matched, .. } => match head_end(matched, data) {
                Ok(end) => {
                    self.phase = Phase::Framing;
                    end
                }
                Err(matched) => {
                    self.phase = Phase::Head { matched, seen: true };
                    data.len()
                }
            },
            Phase::Body { left } => {
                if (data.len() as u64) < left {
                    self.phase = Phase::Body {
                        left: left - data.len() as u64,
                    };
                    data.len()
                } else {
                    self.phase = Phase::Head {
                        matched: 0,
                        seen: false,
                    };
                    // `left` < data.len() here, so it fits.
                    usize::try_from(left).unwrap_or(data.len())
                }
            }
            // hyper read before the service was called: it and the reader disagree.
            Phase::Framing | Phase::Untracked => {
                self.phase = Phase::Untracked;
                data.len()
            }
        }
    }
}

/// Where the head ends in `data`, given that the bytes before it ended with `matched` bytes of
/// `\r\n\r\n`: `Ok(end)` (exclusive), or `Err(matched)` for the next call.
fn head_end(matched: u8, data: &[u8]) -> Result<usize, u8> {
    const BLANK: &[u8; 4] = b"\r\n\r\n";
    let mut m = usize::from(matched.min(3));
    let mut i = 0;
    if m > 0 {
        while m < 4 && i < data.len() && data[i] == BLANK[m] {
            m += 1;
            i += 1;
        }
        if m == 4 {
            return Ok(i);
        }
        if i == data.len() {
            return Err(m as u8);
        }
        // No terminator straddles the boundary: `\r\n\r\n` only overlaps itself by `\r\n`,
        // which the loop above has already tried.
    }
    // At every `\n`, look back for the rest of the blank line: a request head has a dozen
    // line ends, and `memchr` finds each with SIMD (`memmem::find` built a searcher per call).
    for p in memchr::memchr_iter(b'\n', data) {
        if p >= 3 && &data[p - 3..=p] == BLANK {
            return Ok(p + 1);
        }
    }
    let tail = if data.ends_with(b"\r\n\r") {
        3
    } else if data.ends_with(b"\r\n") {
        2
    } else if data.ends_with(b"\r") {
        1
    } else {
        0
    };
    Err(tail)
}

impl AsyncRead for IdleIo {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.learn_framing();
        if !this.stash.is_empty() {
            let n = buf.remaining().min(this.stash.len());
            let stash = std::mem::take(&mut this.stash);
            let n = this.take(&stash[..n]);
            buf.put_slice(&stash[..n]);
            this.stash = stash;
            this.stash.advance(n);
            return Poll::Ready(Ok(()));
        }
        let Some(stream) = this.stream.as_mut() else {
            return Poll::Ready(Ok(())); // parked: end of stream, as far as hyper knows
        };
        let start = buf.filled().len();
        match Pin::new(stream).poll_read(cx, buf) {
            Poll::Pending => {
                if this.can_park() && this.waited_enough(cx) {
                    *this.shared.parked.lock() = this.stream.take();
                    return Poll::Ready(Ok(()));
                }
                Poll::Pending
            }
            Poll::Ready(Ok(())) => {
                this.park_armed = false;
                let filled = buf.filled();
                if filled.len() > start {
                    let n = this.take(&filled[start..]);
                    if start + n < filled.len() {
                        this.stash.extend_from_slice(&filled[start + n..]);
                        buf.set_filled(start + n);
                    }
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
        }
    }
}

impl AsyncWrite for IdleIo {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut().stream.as_mut() {
            Some(s) => Pin::new(s).poll_write(cx, data),
            None => Poll::Ready(Err(io::ErrorKind::NotConnected.into())),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut().stream.as_mut() {
            Some(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            None => Poll::Ready(Err(io::ErrorKind::NotConnected.into())),
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.as_ref().is_some_and(|s| s.is_write_vectored())
    }

    /// hyper flushes the socket only once its own write buffer is empty: from then on,
    /// everything of the responses counted so far is out.
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let finished = this.shared.finished.load(Ordering::Relaxed);
        match this.stream.as_mut() {
            Some(s) => {
                let r = Pin::new(s).poll_flush(cx);
                if let Poll::Ready(Ok(())) = r {
                    this.flushed = finished;
                }
                r
            }
            None => Poll::Ready(Ok(())),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut().stream.as_mut() {
            Some(s) => Pin::new(s).poll_shutdown(cx),
            None => Poll::Ready(Ok(())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_end_finds_the_blank_line_across_reads() {
        assert_eq!(head_end(0, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"), Ok(27));
        assert_eq!(head_end(0, b"GET / HTTP/1.1\r\n\r\nGET"), Ok(18));
        assert_eq!(head_end(0, b"GET / HTTP/1.1\r\nHost: x\r\n"), Err(2));
        assert_eq!(head_end(2, b"\r\nGET"), Ok(2));
        assert_eq!(head_end(3, b"\n"), Ok(1));
        assert_eq!(head_end(1, b"\n\r"), Err(3));
        assert_eq!(head_end(3, b"\rX\r\n\r\n"), Ok(6));
        assert_eq!(head_end(2, b"X"), Err(0));
        assert_eq!(head_end(0, b"abc\r"), Err(1));
        assert_eq!(head_end(0, b""), Err(0));
    }
}
