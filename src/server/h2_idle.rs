//! Idle HTTP/2 connections: one with no open stream for `server.idle_timeout` is asked to finish
//! (GOAWAY, then closed once the client has seen it). PINGs, SETTINGS and WINDOW_UPDATEs do not
//! keep a connection open: only requests do. A stream counts as open from the moment its request
//! reaches the service until its response body is done with (sent, or reset).
//!
//! The cost per request is two atomic updates and, when the last open stream ends, one clock
//! read; the connection's timer fires once per `idle_timeout` at most.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::body::{Body, Frame, SizeHint};
use tokio::time::Instant;

use crate::http::{BoxError, ProxyBody};

/// One HTTP/2 connection's open streams.
pub(super) struct H2Streams {
    /// Streams open now.
    open: AtomicUsize,
    /// When the last stream ended, in ms since `epoch` (0 until one has: the connection's start).
    quiet_since_ms: AtomicU64,
    /// When the connection started.
    epoch: Instant,
}

impl H2Streams {
    /// A new connection's: no stream open, quiet since now.
    pub(super) fn new() -> Arc<Self> {
        Arc::new(H2Streams {
            open: AtomicUsize::new(0),
            quiet_since_ms: AtomicU64::new(0),
            epoch: Instant::now(),
        })
    }

    /// Count a stream open until the returned guard drops.
    pub(super) fn open(self: &Arc<Self>) -> OpenStream {
        self.open.fetch_add(1, Ordering::AcqRel);
        OpenStream(self.clone())
    }

    /// How long the connection has had no open stream at `now`; `None` while one is open.
    fn quiet_for(&self, now: Instant) -> Option<Duration> {
        if self.open.load(Ordering::Acquire) > 0 {
            return None;
        }
        let since = self.epoch + Duration::from_millis(self.quiet_since_ms.load(Ordering::Acquire));
        Some(now.saturating_duration_since(since))
    }

    /// Poll `timer` (armed for `idle` after the connection started): ready once the connection
    /// has been without an open stream for `idle`. Re-arms `timer` for the earliest instant that
    /// could be so otherwise (and registers `cx` with it).
    pub(super) fn poll_idle(
        &self,
        timer: &mut Pin<Box<tokio::time::Sleep>>,
        idle: Duration,
        cx: &mut Context<'_>,
    ) -> bool {
        while timer.as_mut().poll(cx).is_ready() {
            let now = Instant::now();
            match self.quiet_for(now) {
                Some(q) if q >= idle => return true,
                Some(q) => timer.as_mut().reset(now + (idle - q)),
                None => timer.as_mut().reset(now + idle),
            }
        }
        false
    }
}

/// One open stream; dropping it ends it.
pub(super) struct OpenStream(Arc<H2Streams>);

impl Drop for OpenStream {
    fn drop(&mut self) {
        let s = &self.0;
        if s.open.fetch_sub(1, Ordering::AcqRel) == 1 {
            let ms = u64::try_from(s.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
            s.quiet_since_ms.store(ms, Ordering::Release);
        }
    }
}

/// A response body that keeps its stream counted as open until hyper is done with it.
pub(super) struct StreamBody {
    inner: ProxyBody,
    _open: OpenStream,
}

impl StreamBody {
    /// `inner`, counted as the open stream `open`.
    pub(super) fn new(inner: ProxyBody, open: OpenStream) -> Self {
        StreamBody { inner, _open: open }
    }
}

impl Body for StreamBody {
    type Data = bytes::Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quiet_only_while_no_stream_is_open() {
        let s = H2Streams::new();
        let start = s.epoch;
        assert_eq!(
            s.quiet_for(start + Duration::from_secs(3)),
            Some(Duration::from_secs(3))
        );
        let a = s.open();
        let b = s.open();
        assert_eq!(s.quiet_for(start + Duration::from_secs(3)), None);
        drop(a);
        assert_eq!(s.quiet_for(start + Duration::from_secs(3)), None, "one is still open");
        drop(b);
        let q = s.quiet_for(Instant::now() + Duration::from_secs(1));
        assert!(
            q.is_some_and(|q| q >= Duration::from_secs(1) && q < Duration::from_secs(2)),
            "{q:?}"
        );
    }
}
