//! A lean HTTP/1.1 connection pool to the one upstream, on hyper's connection API.
//!
//! The gateway talks to exactly one origin, so the pool is a stack of `SendRequest` handles
//! behind a mutex held for a few instructions (never across an `.await`), instead of a general
//! client keyed by scheme and authority. A handle goes back on the stack as soon as the
//! response head arrives; it is handed out again only once `is_ready()` (its previous response
//! body has been read). A request that was never written (the pooled connection had closed) is
//! retried on another connection, so a stale keep-alive connection never fails a request.

use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use tokio::net::TcpStream;

use super::ProxyBody;

/// Why the upstream could not be asked.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// TCP connect failed or timed out.
    #[error("connect to upstream: {0}")]
    Connect(std::io::Error),
    /// The HTTP exchange failed.
    #[error("upstream: {0}")]
    Http(#[from] hyper::Error),
}

/// Pooled connections to one `host:port`.
pub struct Upstream {
    /// `host:port`.
    addr: String,
    /// TCP connect deadline.
    connect_timeout: Duration,
    /// Handles kept at most.
    max_idle: usize,
    /// Kept handles; the busy ones (a response body still streaming) are skipped at checkout.
    idle: Mutex<Vec<SendRequest<ProxyBody>>>,
}

/// Attempts for a request whose connection closed before it was written.
const ATTEMPTS: usize = 3;

impl Upstream {
    /// A pool for `addr` (`host:port`).
    pub fn new(addr: String, connect_timeout: Duration, max_idle: usize) -> Self {
        Upstream {
            addr,
            connect_timeout,
            max_idle: max_idle.max(1),
            idle: Mutex::new(Vec::new()),
        }
    }

    /// A ready pooled handle, dropping closed ones.
    fn checkout(&self) -> Option<SendRequest<ProxyBody>> {
        let mut idle = self.idle.lock();
        let mut i = idle.len();
        while i > 0 {
            i -= 1;
            if idle[i].is_closed() {
                idle.swap_remove(i);
            } else if idle[i].is_ready() {
                return Some(idle.swap_remove(i));
            }
        }
        None
    }

    fn checkin(&self, s: SendRequest<ProxyBody>) {
        let mut idle = self.idle.lock();
        if idle.len() < self.max_idle {
            idle.push(s);
        }
    }

    async fn connect(&self) -> Result<SendRequest<ProxyBody>, UpstreamError> {
        let stream = match tokio::time::timeout(self.connect_timeout, TcpStream::connect(&self.addr)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(UpstreamError::Connect(e)),
            Err(_) => return Err(UpstreamError::Connect(std::io::ErrorKind::TimedOut.into())),
        };
        let _ = stream.set_nodelay(true);
        let (sender, conn) = http1::Builder::new().handshake(TokioIo::new(stream)).await?;
        tokio::spawn(async move {
            if let Err(e) = conn.with_upgrades().await {
                tracing::debug!(error = %e, "upstream connection ended with error");
            }
        });
        Ok(sender)
    }

    /// Send `req` (origin-form URI) and return the response head with its streaming body.
    pub async fn send(&self, mut req: Request<ProxyBody>) -> Result<Response<Incoming>, UpstreamError> {
        for attempt in 0..ATTEMPTS {
            let pooled = if attempt + 1 < ATTEMPTS { self.checkout() } else { None };
            let mut sender = match pooled {
                Some(s) => s,
                None => self.connect().await?,
            };
            match sender.try_send_request(req).await {
                Ok(resp) => {
                    self.checkin(sender);
                    return Ok(resp);
                }
                Err(mut e) => match e.take_message() {
                    // Never written: safe to send again on another connection.
                    Some(r) => req = r,
                    None => return Err(UpstreamError::Http(e.into_error())),
                },
            }
        }
        Err(UpstreamError::Connect(std::io::Error::other(
            "upstream connections kept closing",
        )))
    }
}
