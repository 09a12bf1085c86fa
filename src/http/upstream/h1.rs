//! The HTTP/1.1 pool. A target's pool is a stack of `SendRequest` handles behind a mutex held for a
//! few instructions (never across an `.await`). A handle goes back on the stack as soon as the
//! response head arrives; it is handed out again only once `is_ready()` (its previous response body
//! has been read). A request that was never written (the pooled connection had closed) is sent
//! again on another connection, so a stale keep-alive connection never fails a request.

use http::{HeaderValue, Request, Version};
use hyper::client::conn::http1::{self, SendRequest};

use super::{Conn, ProxyBody, Upstream, UpstreamError};

impl Upstream {
    /// A ready pooled handle of target `i`, dropping closed ones.
    pub(super) fn checkout(&self, i: usize) -> Option<SendRequest<ProxyBody>> {
        let mut idle = self.targets[i].idle.lock();
        let mut k = idle.len();
        while k > 0 {
            k -= 1;
            if idle[k].is_closed() {
                idle.swap_remove(k);
            } else if idle[k].is_ready() {
                return Some(idle.swap_remove(k));
            }
        }
        None
    }

    /// Keep handle `s` of target `i` for later requests, unless the pool is full.
    pub(super) fn checkin(&self, i: usize, s: SendRequest<ProxyBody>) {
        let mut idle = self.targets[i].idle.lock();
        if idle.len() < self.max_idle {
            idle.push(s);
        }
    }
}

/// HTTP/1.1 on a connected stream; the connection is driven by a spawned task.
pub(super) async fn handshake<I>(io: I) -> Result<Conn, UpstreamError>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (sender, conn) = http1::Builder::new().handshake(io).await?;
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(error = %e, "upstream connection ended with error");
        }
    });
    Ok(Conn::H1(sender))
}

/// The request as HTTP/1.1 sends it (undoes [`to_h2`] for a request that came back unsent):
/// origin-form URI, the authority in `Host`; a request that had no host at all (HTTP/1.0
/// without `Host`) gets `target_host`, the target's own, as HTTP/1.1 requires one.
pub(super) fn to_h1(req: &mut Request<ProxyBody>, target_host: &HeaderValue) {
    *req.version_mut() = Version::HTTP_11;
    if req.uri().scheme().is_none() {
        if !req.headers().contains_key(http::header::HOST) {
            req.headers_mut().insert(http::header::HOST, target_host.clone());
        }
        return;
    }
    if !req.headers().contains_key(http::header::HOST) {
        if let Some(host) = req
            .uri()
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        {
            req.headers_mut().insert(http::header::HOST, host);
        }
    }
    *req.uri_mut() = crate::http::forward::origin_form(req.uri().path_and_query());
}
