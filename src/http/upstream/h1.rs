//! HTTP/1.1 upstream connections driven by the request that uses them (issue #15).
//!
//! hyper's client connection is a future that has to be polled for its exchanges to progress.
//! Spawned as a task of its own, it made every request cross two tasks: the request went over
//! a channel, and the response head and each body chunk woke the request's task from the
//! connection's. Here a connection is owned by whoever uses it:
//! - the request's task polls it while it waits for the response head ([`H1Conn::send`]);
//! - the response body polls it while the body streams (`TargetBody`), and hands it back to its
//!   target's pool when the body has ended ([`H1Conn::release`]).
//!
//! An idle pooled connection is polled by nobody. At checkout one poll with a no-op waker
//! ([`H1Conn::ready`]) notices a close by the upstream (the connection future is done) and lets
//! the connection ask for its next request; nothing is lost by the no-op waker, because tokio
//! keeps the socket's readiness until the next poll, made with the request's own waker.
//!
//! A connection that is still busy when its response body ends (the upstream answered before
//! it had read the whole request body), or that switched protocols (101), gets a task of its
//! own, as every connection used to.

use std::future::Future;
use std::io::IoSlice;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper::client::conn::TrySendError;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use super::super::ProxyBody;

/// A connection's byte stream: plain TCP or TLS over TCP (one type, so that the pool holds one
/// kind of connection).
pub(super) enum UpIo {
    /// `http://` targets.
    Plain(TcpStream),
    /// `https://` targets (boxed: the TLS state is large and would size every plain one too).
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

impl AsyncRead for UpIo {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            UpIo::Plain(s) => Pin::new(s).poll_read(cx, buf),
            UpIo::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for UpIo {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            UpIo::Plain(s) => Pin::new(s).poll_write(cx, buf),
            UpIo::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            UpIo::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            UpIo::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            UpIo::Plain(s) => s.is_write_vectored(),
            UpIo::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            UpIo::Plain(s) => Pin::new(s).poll_flush(cx),
            UpIo::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            UpIo::Plain(s) => Pin::new(s).poll_shutdown(cx),
            UpIo::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// hyper's connection future, with upgrades so that a 101 can hand its socket over (the type
/// is unnameable, hence `dyn`; it is boxed once per connection anyway).
type Driver = dyn Future<Output = hyper::Result<()>> + Send;

/// One HTTP/1.1 connection to a target: its request handle and the future that drives it.
pub(super) struct H1Conn {
    /// Hands a request to the connection.
    sender: SendRequest<ProxyBody>,
    /// Reads and writes the socket when polled (boxed once per connection, so moving the
    /// connection in and out of the pool copies two pointers, not hyper's state); `None` once
    /// it has finished, so that it is never polled again (hyper panics on that after an
    /// upgrade).
    driver: Option<Pin<Box<Driver>>>,
}

impl H1Conn {
    /// HTTP/1.1 on a connected stream; nothing is spawned.
    pub(super) async fn handshake(io: UpIo) -> Result<Self, hyper::Error> {
        let (sender, conn) = http1::Builder::new().handshake(TokioIo::new(io)).await?;
        Ok(H1Conn {
            sender,
            driver: Some(Box::pin(conn.with_upgrades())),
        })
    }

    /// Drive the connection once with `cx`; `Ready` once it is finished (closed by either
    /// side, failed, or upgraded).
    pub(super) fn poll_driver(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        poll_once(&mut self.driver, cx)
    }

    /// Can this (pooled) connection take a request now? One poll lets hyper notice a close by
    /// the upstream and ask for its next message.
    pub(super) fn ready(&mut self) -> bool {
        let mut cx = Context::from_waker(Waker::noop());
        self.poll_driver(&mut cx).is_pending() && self.sender.is_ready()
    }

    /// Send `req` and drive the connection until the response head arrives. A request that
    /// was never written comes back in the error (the connection had closed).
    pub(super) async fn send(
        &mut self,
        req: Request<ProxyBody>,
    ) -> Result<Response<Incoming>, TrySendError<Request<ProxyBody>>> {
        let mut answer = std::pin::pin!(self.sender.try_send_request(req));
        let driver = &mut self.driver;
        std::future::poll_fn(|cx| {
            // Finished (closed, failed, upgraded): hyper has answered or cancelled the request
            // by then, so the answer is ready.
            let _ = poll_once(driver, cx);
            answer.as_mut().poll(cx)
        })
        .await
    }

    /// The exchange is over (the response body ended): back to target `i`'s pool when the
    /// connection can take another request, else given a task of its own to finish what it
    /// is doing (the upstream answered before reading the whole request body) and close.
    pub(super) fn release(mut self, up: &super::Upstream, i: usize) {
        if self.ready() {
            up.checkin(i, self);
        } else {
            self.detach();
        }
    }

    /// Run the connection in a task of its own until it ends (a 101's upgrade completes
    /// there; a busy connection finishes its exchange). The request handle is dropped, so hyper
    /// closes the connection once it is idle.
    pub(super) fn detach(self) {
        let Some(driver) = self.driver else { return };
        tokio::spawn(async move {
            if let Err(e) = driver.await {
                tracing::debug!(error = %e, "upstream connection ended with error");
            }
        });
    }
}

/// Poll `driver` unless it has finished; `Ready` (and `None` from then on) once it has.
fn poll_once(driver: &mut Option<Pin<Box<Driver>>>, cx: &mut Context<'_>) -> Poll<()> {
    let Some(d) = driver.as_mut() else {
        return Poll::Ready(());
    };
    match d.as_mut().poll(cx) {
        Poll::Pending => Poll::Pending,
        Poll::Ready(r) => {
            if let Err(e) = r {
                tracing::debug!(error = %e, "upstream connection ended with error");
            }
            *driver = None;
            Poll::Ready(())
        }
    }
}
