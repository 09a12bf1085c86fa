//! HTTP plumbing: the response body type, the one place errors become responses
//! ([`respond`]), rate-limit headers ([`headers`]), forwarding helpers ([`forward`]) and the
//! upstream targets and their pools ([`upstream`]), TLS ([`tls`]), request ids
//! ([`request_id`]), W3C trace context ([`trace`]), idle HTTP/1.1 connections without
//! buffers ([`idle`]), JSON answers for the request heads hyper's parser refuses
//! ([`parse_reply`]) and the coarse deadlines of the request path ([`coarse_timer`]).

pub mod forward;
pub mod headers;
pub mod parse_reply;
pub mod request_id;
pub mod respond;
pub mod tls;
pub mod trace;
pub mod upstream;

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Limited};
use hyper::body::{Body, Frame, Incoming, SizeHint};

/// Errors a streamed body may carry.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body of every request tollgate sends upstream and of every response it sends. An enum,
/// not a box: boxing cost an allocation per body, two per proxied request.
pub enum ProxyBody {
    /// A complete in-memory body (tollgate's own responses); `None` once it has been sent.
    Full(Option<Bytes>),
    /// An upstream's response, streamed.
    Upstream(upstream::TargetBody),
    /// A client's request body on its way upstream, cut off past `server.max_body_bytes`.
    Request(Limited<Incoming>),
    /// Any other body (bodies that settle a cost, hold concurrency slots, the demo's echo).
    Boxed(UnsyncBoxBody<Bytes, BoxError>),
}

impl ProxyBody {
    /// Box any other body.
    pub fn boxed<B>(b: B) -> Self
    where
        B: Body<Data = Bytes, Error = BoxError> + Send + 'static,
    {
        ProxyBody::Boxed(b.boxed_unsync())
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            ProxyBody::Full(b) => Poll::Ready(b.take().filter(|b| !b.is_empty()).map(|b| Ok(Frame::data(b)))),
            ProxyBody::Upstream(t) => Pin::new(t)
                .poll_frame(cx)
                .map(|f| f.map(|r| r.map_err(|e| -> BoxError { Box::new(e) }))),
            ProxyBody::Request(l) => Pin::new(l).poll_frame(cx),
            ProxyBody::Boxed(b) => Pin::new(b).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ProxyBody::Full(b) => b.as_ref().is_none_or(Bytes::is_empty),
            ProxyBody::Upstream(t) => t.is_end_stream(),
            ProxyBody::Request(l) => l.is_end_stream(),
            ProxyBody::Boxed(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ProxyBody::Full(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
            ProxyBody::Upstream(t) => t.size_hint(),
            ProxyBody::Request(l) => l.size_hint(),
            ProxyBody::Boxed(b) => b.size_hint(),
        }
    }
}

/// A complete in-memory body.
pub fn full(b: impl Into<Bytes>) -> ProxyBody {
    ProxyBody::Full(Some(b.into()))
}

/// An empty body.
pub fn empty() -> ProxyBody {
    ProxyBody::Full(None)
}

/// How long an accept loop waits after `accept` failed (EMFILE, ENFILE, ENOMEM...) before it
/// tries again: the error persists until some connection closes, so retrying at once would
/// spin a core.
pub const ACCEPT_BACKOFF: std::time::Duration = std::time::Duration::from_millis(50);

/// Accept the next connection; on an error, log it, wait [`ACCEPT_BACKOFF`] and try again.
pub async fn accept(listener: &tokio::net::TcpListener) -> (tokio::net::TcpStream, std::net::SocketAddr) {
    loop {
        match listener.accept().await {
            Ok(x) => return x,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed; backing off");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
            }
        }
    }
}
