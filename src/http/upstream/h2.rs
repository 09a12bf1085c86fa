//! HTTP/2 (`upstream.protocol: h2c | h2 | auto`). A target keeps at most
//! [`H2_MAX_CONNECTIONS`] HTTP/2 connections, each carrying many concurrent streams. A request
//! takes the connection with the fewest open streams; a new connection is made only when every one
//! carries [`H2_STREAMS_PER_CONNECTION`] streams, and requests that arrive while it is being made
//! wait for that one connection rather than each making its own (streams past a server's own
//! `MAX_CONCURRENT_STREAMS` wait in hyper's queue). A connection that received GOAWAY or closed
//! leaves the set: its streams in flight finish, a request that reached it unwritten is sent on
//! another (a new one if needed). Trailers and streaming bodies pass through in both directions:
//! bodies are relayed frame by frame. Under `auto`, a TLS target's first connections are made the
//! HTTP/2 way (once for all waiting requests) until ALPN says it speaks HTTP/1.1 only.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::{BoxFuture, FutureExt, Shared};
use http::{Request, Uri, Version};
use hyper::client::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use super::{Conn, ProxyBody, Sender, Target, Upstream, UpstreamError, ATTEMPTS};

/// HTTP/2 connections kept at most per target.
pub const H2_MAX_CONNECTIONS: usize = 4;

/// Open streams that make an HTTP/2 connection busy: past this a new connection is made (while
/// there are fewer than [`H2_MAX_CONNECTIONS`]).
pub const H2_STREAMS_PER_CONNECTION: usize = 100;

/// HTTP/2 keep-alive: a PING after this long without frames...
const H2_PING_INTERVAL: Duration = Duration::from_secs(20);

/// ...that must be answered within this long, or the connection is closed.
const H2_PING_TIMEOUT: Duration = Duration::from_secs(10);

/// One shared HTTP/2 connection of a target.
#[derive(Clone)]
pub(super) struct H2Conn {
    /// Its request handle (a clone per request).
    pub(super) sender: http2::SendRequest<ProxyBody>,
    /// Streams open on it, each until its response body ends.
    pub(super) streams: Arc<AtomicUsize>,
}

impl H2Conn {
    /// Busy: new requests should go to another connection if one can be had.
    pub(super) fn busy(&self) -> bool {
        self.streams.load(Ordering::Relaxed) >= H2_STREAMS_PER_CONNECTION
    }

    /// A handle for one request, counted as a stream until the guard drops.
    pub(super) fn take(&self) -> (http2::SendRequest<ProxyBody>, StreamGuard) {
        self.streams.fetch_add(1, Ordering::Relaxed);
        (self.sender.clone(), StreamGuard(self.streams.clone()))
    }
}

/// One open stream on an HTTP/2 connection.
pub(super) struct StreamGuard(Arc<AtomicUsize>);

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A new HTTP/2 connection being made, awaited by every request that needs it.
pub(super) type PendingH2 = Shared<BoxFuture<'static, Result<H2Conn, Arc<UpstreamError>>>>;

/// A target's HTTP/2 connections.
#[derive(Default)]
pub(super) struct H2Set {
    /// Open connections.
    pub(super) conns: Vec<H2Conn>,
    /// The connection being made, with a number that tells it from later ones.
    pub(super) pending: Option<(u64, PendingH2)>,
    /// Numbers the pending connections.
    pub(super) next: u64,
}

impl Upstream {
    /// A stream on one of target `i`'s HTTP/2 connections: the least busy one, or a new one
    /// when all are busy and there is room (made once for every request that waits for it).
    pub(super) async fn h2_sender(self: &Arc<Self>, i: usize, fresh: bool) -> Result<Sender, UpstreamError> {
        let t = &self.targets[i];
        if fresh {
            // Boxed, like the HTTP/1.1 connect: rare, and a large state machine.
            let c = Box::pin(self.h2_conn(i)).await?;
            let (s, stream) = c.take();
            let mut set = t.h2.lock();
            set.conns.retain(|c| !c.sender.is_closed());
            if set.conns.len() < H2_MAX_CONNECTIONS {
                set.conns.push(c);
            }
            return Ok(Sender::H2(s, stream));
        }
        for _ in 0..ATTEMPTS {
            let (id, pending) = {
                let mut set = t.h2.lock();
                set.conns.retain(|c| !c.sender.is_closed());
                let full = set.conns.len() >= H2_MAX_CONNECTIONS;
                if let Some(c) = set
                    .conns
                    .iter()
                    .min_by_key(|c| c.streams.load(Ordering::Relaxed))
                    .filter(|c| full || !c.busy())
                {
                    let (s, stream) = c.take();
                    return Ok(Sender::H2(s, stream));
                }
                match &set.pending {
                    Some((id, p)) => (*id, p.clone()),
                    None => {
                        set.next += 1;
                        let id = set.next;
                        let up = self.clone();
                        // A task of its own: the connection is made even if the request that
                        // asked for it goes away.
                        let task = tokio::spawn(async move { up.h2_conn(i).await.map_err(Arc::new) });
                        let p = async move {
                            task.await.unwrap_or_else(|e| {
                                Err(Arc::new(UpstreamError::Connect(std::io::Error::other(e.to_string()))))
                            })
                        }
                        .boxed()
                        .shared();
                        set.pending = Some((id, p.clone()));
                        (id, p)
                    }
                }
            };
            let made = pending.await;
            {
                let mut set = t.h2.lock();
                if set.pending.as_ref().is_some_and(|(p, _)| *p == id) {
                    set.pending = None;
                    if let Ok(c) = &made {
                        set.conns.push(c.clone());
                    }
                }
            }
            match made {
                Err(e) => return Err(UpstreamError::Shared(e)),
                Ok(c) if !c.sender.is_closed() && !c.busy() => {
                    let (s, stream) = c.take();
                    return Ok(Sender::H2(s, stream));
                }
                // Closed already, or others took its streams: look again.
                Ok(_) => {}
            }
        }
        Err(UpstreamError::Connect(std::io::Error::other(
            "upstream HTTP/2 connections kept closing",
        )))
    }

    /// A new HTTP/2 connection to target `i`. Under `auto`, a target that agreed to HTTP/1.1
    /// instead gets the connection pooled as such, and this fails with [`UpstreamError::NoH2`].
    pub(super) async fn h2_conn(&self, i: usize) -> Result<H2Conn, UpstreamError> {
        let place = self.place(i).await?;
        match self.connect(i, place).await? {
            Conn::H2(c) => Ok(c),
            Conn::H1(s) => {
                self.checkin(i, s);
                Err(UpstreamError::NoH2)
            }
        }
    }
}

/// HTTP/2 on a connected stream (prior knowledge, or agreed by ALPN); the connection is driven
/// by a spawned task, and pinged when quiet so that a dead peer is noticed.
pub(super) async fn handshake_h2<I>(io: I) -> Result<Conn, UpstreamError>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (sender, conn) = http2::Builder::new(TokioExecutor::new())
        .timer(TokioTimer::new())
        .adaptive_window(true)
        .keep_alive_interval(H2_PING_INTERVAL)
        .keep_alive_timeout(H2_PING_TIMEOUT)
        .handshake(io)
        .await?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "upstream HTTP/2 connection ended with error");
        }
    });
    Ok(Conn::H2(H2Conn {
        sender,
        streams: Arc::new(AtomicUsize::new(0)),
    }))
}

/// The request as HTTP/2 sends it: `:scheme` and `:authority` in the URI, the authority taken
/// from `Host` (which HTTP/2 replaces with it), else the target's.
pub(super) fn to_h2(req: &mut Request<ProxyBody>, t: &Target) {
    *req.version_mut() = Version::HTTP_2;
    if req.uri().scheme().is_some() {
        return;
    }
    let from_host = req
        .headers()
        .get(http::header::HOST)
        .and_then(|h| http::uri::Authority::try_from(h.as_bytes()).ok());
    let authority = match from_host {
        Some(a) => {
            req.headers_mut().remove(http::header::HOST);
            a
        }
        None => t.authority.clone(),
    };
    let mut parts = http::uri::Parts::default();
    parts.scheme = Some(t.scheme.clone());
    parts.authority = Some(authority);
    parts.path_and_query = Some(
        req.uri()
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/")),
    );
    if let Ok(uri) = Uri::from_parts(parts) {
        *req.uri_mut() = uri;
    }
}
