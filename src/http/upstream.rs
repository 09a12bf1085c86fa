//! The upstream: one or more targets (instances of the same API), each with a lean HTTP/1.1
//! connection pool and a small set of shared HTTP/2 connections on hyper's connection API, over
//! TCP or TLS; balancing, passive ejection, an optional active health check, and the one retry of
//! a failed idempotent request.
//!
//! # Layout
//! - this file: the targets, [`Upstream::send`] with its attempts and retry;
//! - `connect`: a connection under the target's cap (pooled, shared HTTP/2 or new);
//! - `h1`: the HTTP/1.1 pool and handshake;
//! - `h2`: the shared HTTP/2 connections;
//! - `balance`: power of two choices, passive ejection and the health check.
//!
//! # Connection cap
//! Each target has at most `upstream.max_connections_per_target` connections open at once
//! (HTTP/1.1 and HTTP/2 together, upgraded ones included): a connection's socket holds its place
//! (`connect::Capped`) until it closes. A request that needs a new connection while its target is at
//! the cap waits up to `connect_timeout` for a pooled connection to come free or for a place,
//! then fails with [`UpstreamError::Saturated`] (a 503, never counted against the target).
//!
//! # Retries
//! [`Upstream::send`] retries a request once, on another target when one is in, when its
//! attempt failed before any response byte arrived and the caller said it may be replayed
//! ([`Replay`]: idempotent method, empty body). With one target no copy of the request is kept:
//! only an attempt whose request was never written (connect failure) is retried.

use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response, Uri, Version};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::client::conn::http1::SendRequest;
use hyper::client::conn::http2;
use parking_lot::Mutex;
use rustls::pki_types::ServerName;
use tokio::sync::{Notify, Semaphore};
use tokio_rustls::TlsConnector;

use super::ProxyBody;

mod balance;
mod connect;
pub mod settings;
pub use settings::{HealthCheck, UpstreamConfig, UpstreamProtocol};
mod h1;
mod h2;

use balance::seed;
pub use balance::MAX_EJECT_DOUBLINGS;
use connect::Conn;
use h1::{handshake, to_h1};
use h2::{handshake_h2, to_h2, H2Conn, H2Set, StreamGuard};
pub use h2::{H2_MAX_CONNECTIONS, H2_STREAMS_PER_CONNECTION};

/// Why the upstream could not be asked.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// TCP connect failed or timed out.
    #[error("connect to upstream: {0}")]
    Connect(std::io::Error),
    /// The TLS handshake failed (an untrusted or mismatching certificate, say).
    #[error("TLS handshake with upstream failed: {0}")]
    Tls(std::io::Error),
    /// The HTTP exchange failed.
    #[error("upstream: {0}")]
    Http(#[from] hyper::Error),
    /// The TLS client config could not be built.
    #[error("upstream TLS config: {0}")]
    Config(#[from] super::tls::TlsError),
    /// `upstream.protocol: h2` and the target did not agree to `h2` in ALPN.
    #[error("the upstream did not agree to HTTP/2 in ALPN (upstream.protocol: h2)")]
    NoH2,
    /// The HTTP/2 connection this request waited for (made for several requests) failed.
    #[error("{0}")]
    Shared(Arc<UpstreamError>),
    /// The target had `upstream.max_connections_per_target` connections open and none came
    /// free within `connect_timeout`.
    #[error("upstream connection cap reached (upstream.max_connections_per_target)")]
    Saturated,
}

impl UpstreamError {
    /// Is this the target's connection cap (tollgate's own limit, not the target's fault)?
    pub fn is_saturated(&self) -> bool {
        match self {
            UpstreamError::Saturated => true,
            UpstreamError::Shared(e) => e.is_saturated(),
            _ => false,
        }
    }
}

/// How often a request waiting for a connection at the cap looks at the pool again, besides
/// being woken when a response ends (a connection that just finished a response may need a
/// moment before it takes the next request).
const CAP_RECHECK: Duration = Duration::from_millis(5);

/// Attempts on one target for a request whose pooled connection closed before it was written.
const ATTEMPTS: usize = 3;

/// What a target was found to speak under `upstream.protocol: auto` (by the ALPN of its last
/// new connection).
const ALPN_UNKNOWN: u8 = 0;
/// HTTP/1.1.
const ALPN_H1: u8 = 1;
/// HTTP/2.
const ALPN_H2: u8 = 2;

/// A connection's request handle.
enum Sender {
    /// HTTP/1.1: one exchange at a time.
    H1(SendRequest<ProxyBody>),
    /// HTTP/2: one of the target's shared connections, this request's stream counted.
    H2(http2::SendRequest<ProxyBody>, StreamGuard),
}

/// One instance of the upstream.
struct Target {
    /// `http(s)://host:port`, for logs (shared with every exchange's report).
    label: Arc<str>,
    /// `host:port` to connect to.
    addr: String,
    /// SNI name of a TLS target; `None` for plain HTTP.
    server_name: Option<ServerName<'static>>,
    /// `Host` sent by the health check.
    host_header: HeaderValue,
    /// `http` or `https`, for the `:scheme` of HTTP/2 requests.
    scheme: http::uri::Scheme,
    /// `host:port` as configured: the `:authority` of an HTTP/2 request that had no `Host`.
    authority: http::uri::Authority,
    /// Kept HTTP/1.1 handles; the busy ones (a response body still streaming) are skipped at
    /// checkout.
    idle: Mutex<Vec<SendRequest<ProxyBody>>>,
    /// Shared HTTP/2 connections.
    h2: Mutex<H2Set>,
    /// Under `auto`: what the target's last new connection agreed to in ALPN.
    alpn: std::sync::atomic::AtomicU8,
    /// Requests sent and not finished (until the response body ends).
    in_flight: AtomicUsize,
    /// Places under `upstream.max_connections_per_target`, one held by each open connection.
    conns: Arc<Semaphore>,
    /// Requests waiting for a connection at the cap.
    waiting: AtomicUsize,
    /// Woken when a response ends while requests wait (its connection may be free now).
    freed: Notify,
    /// Consecutive failures.
    fails: AtomicU32,
    /// Out until this many ms after `Upstream::epoch` (0: in).
    out_until_ms: AtomicU64,
    /// Consecutive ejections without a success in between (the doubling).
    ejections: AtomicU32,
    /// This target's answers by status class and its ejections (metrics).
    counters: crate::metrics::TargetCounters,
}

/// Every target of the upstream, with the balancing and ejection state.
pub struct Upstream {
    /// The targets, in config order.
    targets: Vec<Target>,
    /// What the connections speak.
    protocol: UpstreamProtocol,
    /// For `https://` targets.
    tls: Option<TlsConnector>,
    /// TCP (and TLS) connect deadline.
    connect_timeout: Duration,
    /// Handles kept at most per target.
    max_idle: usize,
    /// Failures that eject.
    eject_after: u32,
    /// First ejection period.
    eject_for: Duration,
    /// Origin of the ejection clock.
    epoch: Instant,
    /// State of the balancer's random numbers.
    rng: AtomicU64,
    /// Retries done (an attempt failed and the request was sent again).
    retries: prometheus_client::metrics::counter::Counter,
    /// Ejections done.
    ejected: prometheus_client::metrics::counter::Counter,
    /// The last [`RECENT_EJECTIONS`] ejections, oldest first (for the dashboard). Locked only
    /// to eject or to read it, never across an `.await`.
    recent: Mutex<std::collections::VecDeque<Ejection>>,
}

/// How many ejections [`Upstream::recent_ejections`] remembers.
pub const RECENT_EJECTIONS: usize = 20;

/// One ejection, as the dashboard lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ejection {
    /// The target's label (`scheme://authority`; an upstream URL carries no credentials).
    pub target: Arc<str>,
    /// When, Unix milliseconds.
    pub at_ms: u64,
    /// Out for this long, milliseconds (doubling on consecutive ejections).
    pub out_for_ms: u64,
    /// Why: the failure that ejected it (`health check` for the active check).
    pub why: String,
}

/// May a failed attempt be retried?
pub enum Retry<'a> {
    /// No (not idempotent, or a body that cannot be replayed).
    No,
    /// Only when the request was never written (a connect failure): nothing was copied.
    Unsent,
    /// Yes, also after the request was written: from this copy.
    Copy(&'a Replay),
}

/// What the caller keeps of a request so it can be sent again (idempotent, empty body).
pub struct Replay {
    /// The method, to send again (only an idempotent one is replayed).
    pub method: Method,
    /// Origin-form URI.
    pub uri: Uri,
    /// Headers as sent.
    pub headers: HeaderMap,
}

impl Replay {
    fn request(&self) -> Request<ProxyBody> {
        let mut r = Request::new(super::empty());
        *r.method_mut() = self.method.clone();
        *r.uri_mut() = self.uri.clone();
        *r.version_mut() = Version::HTTP_11;
        *r.headers_mut() = self.headers.clone();
        r
    }
}

/// Can a request be replayed: an idempotent method and no body.
pub fn replayable(method: &Method, headers: &HeaderMap, body_is_end: bool) -> bool {
    let idempotent = matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::PUT | Method::DELETE
    );
    let no_body = body_is_end
        || (!headers.contains_key(http::header::TRANSFER_ENCODING)
            && headers
                .get(http::header::CONTENT_LENGTH)
                .is_none_or(|v| v.as_bytes() == b"0"));
    idempotent && no_body
}

/// A response from one target; its body counts as in flight on that target until it ends or
/// is dropped.
pub struct TargetBody {
    /// The upstream's body.
    inner: Incoming,
    /// Decrements the target's in-flight count when dropped.
    _flight: Flight,
}

impl Body for TargetBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// One request in flight on one target (and, over HTTP/2, its open stream).
struct Flight(Arc<Upstream>, usize, Option<StreamGuard>);

impl Flight {
    fn enter(up: &Arc<Upstream>, i: usize) -> Self {
        up.targets[i].in_flight.fetch_add(1, Ordering::Relaxed);
        Flight(up.clone(), i, None)
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        let t = &self.0.targets[self.1];
        t.in_flight.fetch_sub(1, Ordering::Relaxed);
        // A load when nobody waits (the common case).
        if t.waiting.load(Ordering::Relaxed) > 0 {
            t.freed.notify_waiters();
        }
    }
}

/// A finished exchange: the response and which target gave it.
pub struct Exchange {
    /// The response head with its streaming body.
    pub response: Response<TargetBody>,
    /// The target's `http(s)://host:port`.
    pub target: Arc<str>,
    /// Attempts made (2 when retried).
    pub attempts: u8,
}

/// Every attempt failed.
#[derive(Debug)]
pub struct Failed {
    /// The last attempt's error.
    pub error: UpstreamError,
    /// The last target tried.
    pub target: Arc<str>,
    /// Attempts made.
    pub attempts: u8,
}

/// An attempt's failure: the request back when it was never written.
struct AttemptError {
    error: UpstreamError,
    unsent: Option<Request<ProxyBody>>,
}

impl Upstream {
    /// The targets of `cfg`, with their TLS client config; retries and ejections count in
    /// `metrics`.
    pub fn new(cfg: &UpstreamConfig, metrics: &crate::metrics::Metrics) -> Result<Arc<Self>, UpstreamError> {
        let tls = if cfg.targets.iter().any(|t| t.tls) {
            let alpn: &[&[u8]] = match cfg.protocol {
                UpstreamProtocol::Http1 | UpstreamProtocol::H2c => &[b"http/1.1"],
                UpstreamProtocol::H2 => &[b"h2"],
                UpstreamProtocol::Auto => &[b"h2", b"http/1.1"],
            };
            Some(TlsConnector::from(super::tls::client_config(&cfg.tls, alpn)?))
        } else {
            None
        };
        let targets = cfg
            .targets
            .iter()
            .map(|t| {
                let server_name = if t.tls {
                    ServerName::try_from(cfg.tls.server_name.clone().unwrap_or_else(|| t.host.clone())).ok()
                } else {
                    None
                };
                let authority = t.url.authority().map_or(t.addr.as_str(), |a| a.as_str());
                let label: Arc<str> = format!("{}://{}", if t.tls { "https" } else { "http" }, authority).into();
                Target {
                    counters: metrics.upstream.target_counters(&label),
                    label,
                    addr: t.addr.clone(),
                    server_name,
                    host_header: HeaderValue::from_str(authority).unwrap_or(HeaderValue::from_static("localhost")),
                    scheme: if t.tls {
                        http::uri::Scheme::HTTPS
                    } else {
                        http::uri::Scheme::HTTP
                    },
                    authority: authority
                        .parse()
                        .unwrap_or(http::uri::Authority::from_static("localhost")),
                    idle: Mutex::new(Vec::new()),
                    h2: Mutex::new(H2Set::default()),
                    alpn: std::sync::atomic::AtomicU8::new(ALPN_UNKNOWN),
                    in_flight: AtomicUsize::new(0),
                    conns: Arc::new(Semaphore::new(cfg.max_connections_per_target.max(1))),
                    waiting: AtomicUsize::new(0),
                    freed: Notify::new(),
                    fails: AtomicU32::new(0),
                    out_until_ms: AtomicU64::new(0),
                    ejections: AtomicU32::new(0),
                }
            })
            .collect();
        Ok(Arc::new(Upstream {
            targets,
            protocol: cfg.protocol,
            tls,
            connect_timeout: cfg.connect_timeout,
            max_idle: cfg.pool_max_idle_per_host.max(1),
            eject_after: cfg.eject_after.max(1),
            eject_for: cfg.eject_for,
            epoch: Instant::now(),
            rng: AtomicU64::new(seed()),
            retries: metrics.upstream.retries.clone(),
            ejected: metrics.upstream.ejections.clone(),
            recent: Mutex::new(std::collections::VecDeque::with_capacity(RECENT_EJECTIONS)),
        }))
    }

    /// How many targets.
    pub fn len(&self) -> usize {
        self.targets.len()
    }

    /// Never true: there is at least one target.
    pub fn is_empty(&self) -> bool {
        self.targets.is_empty()
    }

    /// Retries done so far.
    pub fn retries(&self) -> u64 {
        self.retries.get()
    }

    /// Ejections done so far.
    pub fn ejections(&self) -> u64 {
        self.ejected.get()
    }

    /// The last [`RECENT_EJECTIONS`] ejections, newest first.
    pub fn recent_ejections(&self) -> Vec<Ejection> {
        self.recent.lock().iter().rev().cloned().collect()
    }

    /// Each target's answers (1xx..5xx), requests without an answer, and ejections, since start.
    pub fn target_totals(&self) -> Vec<(u64, u64, u64)> {
        self.targets
            .iter()
            .map(|t| {
                let c = &t.counters;
                (
                    c.status[..5].iter().map(|x| x.get()).sum(),
                    c.status[5].get(),
                    c.ejections.get(),
                )
            })
            .collect()
    }

    /// Each target's label and whether it is in now.
    pub fn status(&self) -> Vec<(String, bool)> {
        let now = self.now_ms();
        self.targets
            .iter()
            .map(|t| (t.label.to_string(), self.is_in(t, now)))
            .collect()
    }

    /// Send `req` (origin-form URI) to a target and return the response head with its
    /// streaming body. With `replay`, an attempt that failed before any response byte is
    /// retried once on another target.
    pub async fn send(self: &Arc<Self>, req: Request<ProxyBody>, retry: Retry<'_>) -> Result<Exchange, Failed> {
        let first = self.pick(None);
        let (err, unsent) = match self.attempt(first, req).await {
            Ok(r) => return Ok(self.answered(first, r, 1)),
            Err(e) => (e.error, e.unsent),
        };
        let again = match (unsent, retry) {
            // The wait for a place already took `connect_timeout`: answer now.
            _ if err.is_saturated() => {
                return Err(Failed {
                    error: err,
                    target: self.targets[first].label.clone(),
                    attempts: 1,
                })
            }
            // Never written and idempotent: the same request again.
            (Some(r), Retry::Unsent | Retry::Copy(_)) => r,
            // Written (the connection failed before the status line): a copy.
            (None, Retry::Copy(rp)) => rp.request(),
            _ => {
                self.targets[first].counters.status[5].inc();
                return Err(Failed {
                    error: err,
                    target: self.targets[first].label.clone(),
                    attempts: 1,
                });
            }
        };
        self.retries.inc();
        self.targets[first].counters.status[5].inc();
        let second = self.pick(Some(first));
        tracing::debug!(from = %self.targets[first].label, to = %self.targets[second].label, error = %err, "retrying upstream request");
        match self.attempt(second, again).await {
            Ok(r) => Ok(self.answered(second, r, 2)),
            Err(e) => {
                self.targets[second].counters.status[5].inc();
                Err(Failed {
                    error: e.error,
                    target: self.targets[second].label.clone(),
                    attempts: 2,
                })
            }
        }
    }

    fn answered(self: &Arc<Self>, i: usize, (resp, flight): (Response<Incoming>, Flight), attempts: u8) -> Exchange {
        if resp.status().is_server_error() {
            self.failure(i, &resp.status(), false);
        } else {
            self.success(i);
        }
        let class = usize::from((resp.status().as_u16() / 100).clamp(1, 5)) - 1;
        self.targets[i].counters.status[class].inc();
        Exchange {
            response: resp.map(|inner| TargetBody { inner, _flight: flight }),
            target: self.targets[i].label.clone(),
            attempts,
        }
    }

    /// One attempt on target `i` (a stale pooled connection, or an HTTP/2 connection that
    /// received GOAWAY, is replaced on the way).
    async fn attempt(
        self: &Arc<Self>,
        i: usize,
        mut req: Request<ProxyBody>,
    ) -> Result<(Response<Incoming>, Flight), AttemptError> {
        let mut flight = Flight::enter(self, i);
        for attempt in 0..ATTEMPTS {
            // The last try gets a connection of its own: the kept ones kept closing.
            let fresh = attempt + 1 == ATTEMPTS;
            let sender = match self.sender(i, fresh).await {
                Ok(s) => s,
                Err(error) => {
                    if !error.is_saturated() {
                        self.failure(i, &error, false);
                    }
                    return Err(AttemptError {
                        error,
                        unsent: Some(req),
                    });
                }
            };
            let result = match sender {
                Sender::H1(mut s) => {
                    to_h1(&mut req, &self.targets[i].host_header);
                    let r = s.try_send_request(req).await;
                    if r.is_ok() {
                        self.checkin(i, s);
                    }
                    r
                }
                Sender::H2(mut s, stream) => {
                    to_h2(&mut req, &self.targets[i]);
                    let r = s.try_send_request(req).await;
                    if r.is_ok() {
                        flight.2 = Some(stream);
                    }
                    r
                }
            };
            match result {
                Ok(resp) => return Ok((resp, flight)),
                Err(mut e) => match e.take_message() {
                    // Never written: safe to send again on another connection.
                    Some(r) => req = r,
                    None => {
                        let error = UpstreamError::Http(e.into_error());
                        // A body the client cut or made too large is not the target's fault.
                        if !is_body_error(&error) {
                            self.failure(i, &error, false);
                        }
                        return Err(AttemptError { error, unsent: None });
                    }
                },
            }
        }
        Err(AttemptError {
            error: UpstreamError::Connect(std::io::Error::other("upstream connections kept closing")),
            unsent: Some(req),
        })
    }

    /// An exchange on a fresh connection to target `i`, outside the failure accounting (the
    /// health check decides on its result itself).
    async fn attempt_quiet(
        self: &Arc<Self>,
        i: usize,
        mut req: Request<ProxyBody>,
    ) -> Result<(Response<Incoming>, Flight), UpstreamError> {
        let flight = Flight::enter(self, i);
        let place = self.place(i).await?;
        let resp = match self.connect(i, place).await? {
            Conn::H1(mut sender) => sender.send_request(req).await?,
            Conn::H2(c) => {
                let (mut sender, _stream) = c.take();
                to_h2(&mut req, &self.targets[i]);
                sender.send_request(req).await?
            }
        };
        Ok((resp, flight))
    }
}

/// Did the exchange fail because of the client's request body (too large, cut)?
fn is_body_error(e: &UpstreamError) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if err.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        cur = err.source();
    }
    matches!(e, UpstreamError::Http(h) if h.is_user())
}

#[cfg(test)]
mod tests;
