//! HTTP plumbing: the response body type, the one place errors become responses
//! ([`respond`]), rate-limit headers ([`headers`]), forwarding helpers ([`forward`]) and the
//! upstream targets and their pools ([`upstream`]), TLS ([`tls`]), request ids
//! ([`request_id`]) and idle HTTP/1.1 connections without buffers ([`idle`]).

pub mod forward;
pub mod headers;
pub mod idle;
pub mod request_id;
pub mod respond;
pub mod tls;
pub mod upstream;
pub mod value_buf;

use bytes::Bytes;
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Full};

/// Errors a streamed body may carry.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body of every response tollgate sends: the upstream's stream, or a small local body.
pub type ProxyBody = UnsyncBoxBody<Bytes, BoxError>;

/// A complete in-memory body.
pub fn full(b: impl Into<Bytes>) -> ProxyBody {
    Full::new(b.into()).map_err(|never| match never {}).boxed_unsync()
}

/// An empty body.
pub fn empty() -> ProxyBody {
    full(Bytes::new())
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
