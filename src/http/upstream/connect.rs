//! Connections to one target under its cap (`upstream.max_connections_per_target`): a pooled
//! HTTP/1.1 connection, a stream on a shared HTTP/2 one, or a new connection (TCP, then TLS,
//! then the handshake ALPN picks) that holds its place under the cap for as long as it is open.

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::OwnedSemaphorePermit;

use super::*;

impl Upstream {
    /// A connection for one request to target `i`: a pooled HTTP/1.1 one or a new one, or a
    /// stream on a shared HTTP/2 one, as `upstream.protocol` (and, under `auto`, ALPN) says.
    /// With `fresh`, never a kept HTTP/1.1 connection nor an existing HTTP/2 one.
    pub(super) async fn sender(self: &Arc<Self>, i: usize, fresh: bool) -> Result<Sender, UpstreamError> {
        let t = &self.targets[i];
        let h2 = match self.protocol {
            UpstreamProtocol::Http1 => false,
            UpstreamProtocol::H2c | UpstreamProtocol::H2 => true,
            // A TLS target not known to speak HTTP/1.1 only: the first connections are made
            // once for all waiting requests, as HTTP/2 ones are, and ALPN decides.
            UpstreamProtocol::Auto => t.server_name.is_some() && t.alpn.load(Ordering::Relaxed) != ALPN_H1,
        };
        if h2 {
            match self.h2_sender(i, fresh).await {
                // `auto`, and the target now agreed to HTTP/1.1 only: use that.
                Err(_) if self.protocol == UpstreamProtocol::Auto && t.alpn.load(Ordering::Relaxed) == ALPN_H1 => {}
                r => return r,
            }
        }
        if !fresh {
            if let Some(s) = self.checkout(i) {
                return Ok(Sender::H1(s));
            }
        }
        let place = match t.conns.clone().try_acquire_owned() {
            Ok(p) => p,
            // At the cap: a pooled connection that comes free will do as well as a new one.
            Err(_) => match Box::pin(self.wait_for_place(i, !fresh)).await? {
                Place::Pooled(s) => return Ok(Sender::H1(s)),
                Place::New(p) => p,
            },
        };
        // Boxed: connecting (TCP, TLS, the handshake) is a large state machine that a request
        // on a pooled connection never enters; inline, every request's future would carry it.
        Ok(match Box::pin(self.connect(i, place)).await? {
            Conn::H1(s) => Sender::H1(s),
            // `auto`, and ALPN agreed to h2: the connection joins the shared ones.
            Conn::H2(c) => {
                let (s, stream) = c.take();
                let mut set = t.h2.lock();
                if set.conns.len() < H2_MAX_CONNECTIONS {
                    set.conns.push(c);
                }
                Sender::H2(s, stream)
            }
        })
    }

    /// A place under target `i`'s connection cap: at once if one is free, else within
    /// `connect_timeout` (with `pooled`, a pooled HTTP/1.1 connection that comes free meanwhile
    /// is taken instead), else [`UpstreamError::Saturated`].
    async fn wait_for_place(&self, i: usize, pooled: bool) -> Result<Place, UpstreamError> {
        let t = &self.targets[i];
        t.waiting.fetch_add(1, Ordering::Relaxed);
        let _waiting = Waiting(&t.waiting);
        let deadline = tokio::time::Instant::now() + self.connect_timeout;
        loop {
            let freed = t.freed.notified();
            tokio::pin!(freed);
            // Registered before the pool is looked at: a response that ends after the look
            // wakes this wait.
            freed.as_mut().enable();
            if pooled {
                if let Some(s) = self.checkout(i) {
                    return Ok(Place::Pooled(s));
                }
            }
            tokio::select! {
                p = t.conns.clone().acquire_owned() => {
                    return p.map(Place::New).map_err(|_| UpstreamError::Saturated);
                }
                _ = &mut freed, if pooled => {}
                _ = tokio::time::sleep(CAP_RECHECK), if pooled => {}
                _ = tokio::time::sleep_until(deadline) => return Err(UpstreamError::Saturated),
            }
        }
    }

    /// A place under target `i`'s connection cap, waiting up to `connect_timeout` for one.
    pub(super) async fn place(&self, i: usize) -> Result<OwnedSemaphorePermit, UpstreamError> {
        match self.targets[i].conns.clone().try_acquire_owned() {
            Ok(p) => Ok(p),
            Err(_) => match self.wait_for_place(i, false).await? {
                Place::New(p) => Ok(p),
                Place::Pooled(_) => Err(UpstreamError::Saturated),
            },
        }
    }

    /// A new connection to target `i` (TCP, then TLS for `https://`), speaking HTTP/1.1 or
    /// HTTP/2 as `upstream.protocol` and ALPN say; it holds `place` under the target's
    /// connection cap until it closes.
    pub(super) async fn connect(&self, i: usize, place: OwnedSemaphorePermit) -> Result<Conn, UpstreamError> {
        let t = &self.targets[i];
        let stream = match tokio::time::timeout(self.connect_timeout, TcpStream::connect(&t.addr)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(UpstreamError::Connect(e)),
            Err(_) => return Err(UpstreamError::Connect(std::io::ErrorKind::TimedOut.into())),
        };
        let _ = stream.set_nodelay(true);
        let stream = Capped { stream, _place: place };
        match (&t.server_name, &self.tls) {
            (Some(name), Some(tls)) => {
                let tls_stream =
                    match tokio::time::timeout(self.connect_timeout, tls.connect(name.clone(), stream)).await {
                        Ok(Ok(s)) => s,
                        Ok(Err(e)) => return Err(UpstreamError::Tls(e)),
                        Err(_) => return Err(UpstreamError::Tls(std::io::ErrorKind::TimedOut.into())),
                    };
                let h2 = tls_stream.get_ref().1.alpn_protocol() == Some(b"h2");
                if self.protocol == UpstreamProtocol::Auto {
                    t.alpn.store(if h2 { ALPN_H2 } else { ALPN_H1 }, Ordering::Relaxed);
                }
                match (h2, self.protocol) {
                    (true, _) => handshake_h2(TokioIo::new(tls_stream)).await,
                    (false, UpstreamProtocol::H2) => Err(UpstreamError::NoH2),
                    (false, _) => handshake(TokioIo::new(tls_stream)).await,
                }
            }
            _ if self.protocol == UpstreamProtocol::H2c => handshake_h2(TokioIo::new(stream)).await,
            _ => handshake(TokioIo::new(stream)).await,
        }
    }
}

/// What a request waiting at the connection cap got.
enum Place {
    /// A pooled HTTP/1.1 connection that came free.
    Pooled(SendRequest<ProxyBody>),
    /// A place for a new connection.
    New(OwnedSemaphorePermit),
}

/// Counts a request waiting at the cap until dropped.
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// An upstream connection's socket, holding its place under the target's connection cap for as
/// long as it is open (through an upgrade too: the upgraded stream is this socket).
struct Capped {
    stream: TcpStream,
    _place: OwnedSemaphorePermit,
}

impl AsyncRead for Capped {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Capped {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, data)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

/// A new connection.
pub(super) enum Conn {
    /// HTTP/1.1.
    H1(SendRequest<ProxyBody>),
    /// HTTP/2, to be shared.
    H2(H2Conn),
}
