//! The upstream: one or more targets (instances of the same API), each with a lean HTTP/1.1
//! connection pool and a small set of shared HTTP/2 connections on hyper's connection API, over
//! TCP or TLS; balancing, passive ejection, an optional active health check, and the one retry of
//! a failed idempotent request.
//!
//! # HTTP/1.1 pool
//! A target's pool is a stack of `SendRequest` handles behind a mutex held for a few
//! instructions (never across an `.await`). A handle goes back on the stack as soon as the
//! response head arrives; it is handed out again only once `is_ready()` (its previous response
//! body has been read). A request that was never written (the pooled connection had closed) is
//! sent again on another connection, so a stale keep-alive connection never fails a request.
//!
//! # HTTP/2 (`upstream.protocol: h2c | h2 | auto`, DESIGN.md §11)
//! A target keeps at most [`H2_MAX_CONNECTIONS`] HTTP/2 connections, each carrying many
//! concurrent streams. A request takes the connection with the fewest open streams; a new
//! connection is made only when every one carries [`H2_STREAMS_PER_CONNECTION`] streams, and
//! requests that arrive while it is being made wait for that one connection rather than each
//! making its own (streams past a server's own `MAX_CONCURRENT_STREAMS` wait in hyper's
//! queue). A connection that received GOAWAY or closed leaves the set: its streams in flight
//! finish, a request that reached it unwritten is sent on another (a new one if needed).
//! Trailers and streaming bodies pass through in both directions: bodies are relayed frame by
//! frame. Under `auto`, a TLS target's first connections are made the HTTP/2 way (once for all
//! waiting requests) until ALPN says it speaks HTTP/1.1 only.
//!
//! # Balancing and ejection (DESIGN.md §11)
//! Power of two choices: two random targets that are in, the one with fewer requests in flight
//! (counted until the response body ends) wins. `eject_after` consecutive failures (connect
//! errors, TLS failures, exchanges that failed, 5xx answers) take a target out for `eject_for`,
//! doubled each time it fails again after coming back, at most [`MAX_EJECT_DOUBLINGS`] times; a
//! success resets both. The last target in is never ejected. The health check, when
//! configured, takes a target out at its first failed check and brings it back at its first
//! passing one.
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
use futures_util::future::{BoxFuture, FutureExt, Shared};
use http::{HeaderMap, HeaderValue, Method, Request, Response, Uri, Version};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::client::conn::http1::{self, SendRequest};
use hyper::client::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use parking_lot::Mutex;
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

use super::ProxyBody;
use crate::config::{UpstreamConfig, UpstreamProtocol};

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
}

/// Attempts on one target for a request whose pooled connection closed before it was written.
const ATTEMPTS: usize = 3;

/// An ejection period is doubled at most this many times (`eject_for` × 32).
pub const MAX_EJECT_DOUBLINGS: u32 = 5;

/// HTTP/2 connections kept at most per target.
pub const H2_MAX_CONNECTIONS: usize = 4;

/// Open streams that make an HTTP/2 connection busy: past this a new connection is made (while
/// there are fewer than [`H2_MAX_CONNECTIONS`]).
pub const H2_STREAMS_PER_CONNECTION: usize = 100;

/// HTTP/2 keep-alive: a PING after this long without frames...
const H2_PING_INTERVAL: Duration = Duration::from_secs(20);

/// ...that must be answered within this long, or the connection is closed.
const H2_PING_TIMEOUT: Duration = Duration::from_secs(10);

/// What a target was found to speak under `upstream.protocol: auto` (by the ALPN of its last
/// new connection).
const ALPN_UNKNOWN: u8 = 0;
/// HTTP/1.1.
const ALPN_H1: u8 = 1;
/// HTTP/2.
const ALPN_H2: u8 = 2;

/// One shared HTTP/2 connection of a target.
#[derive(Clone)]
struct H2Conn {
    /// Its request handle (a clone per request).
    sender: http2::SendRequest<ProxyBody>,
    /// Streams open on it, each until its response body ends.
    streams: Arc<AtomicUsize>,
}

impl H2Conn {
    /// Busy: new requests should go to another connection if one can be had.
    fn busy(&self) -> bool {
        self.streams.load(Ordering::Relaxed) >= H2_STREAMS_PER_CONNECTION
    }

    /// A handle for one request, counted as a stream until the guard drops.
    fn take(&self) -> (http2::SendRequest<ProxyBody>, StreamGuard) {
        self.streams.fetch_add(1, Ordering::Relaxed);
        (self.sender.clone(), StreamGuard(self.streams.clone()))
    }
}

/// One open stream on an HTTP/2 connection.
struct StreamGuard(Arc<AtomicUsize>);

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A new HTTP/2 connection being made, awaited by every request that needs it.
type PendingH2 = Shared<BoxFuture<'static, Result<H2Conn, Arc<UpstreamError>>>>;

/// A target's HTTP/2 connections.
#[derive(Default)]
struct H2Set {
    /// Open connections.
    conns: Vec<H2Conn>,
    /// The connection being made, with a number that tells it from later ones.
    pending: Option<(u64, PendingH2)>,
    /// Numbers the pending connections.
    next: u64,
}

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
    /// Consecutive failures.
    fails: AtomicU32,
    /// Out until this many ms after `Upstream::epoch` (0: in).
    out_until_ms: AtomicU64,
    /// Consecutive ejections without a success in between (the doubling).
    ejections: AtomicU32,
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
    /// Method.
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

/// Can a request be replayed (DESIGN.md §11): an idempotent method and no body.
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
        self.0.targets[self.1].in_flight.fetch_sub(1, Ordering::Relaxed);
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
                    ServerName::try_from(t.host.clone()).ok()
                } else {
                    None
                };
                let authority = t.url.authority().map_or(t.addr.as_str(), |a| a.as_str());
                Target {
                    label: format!("{}://{}", if t.tls { "https" } else { "http" }, authority).into(),
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
            retries: metrics.upstream_retries.clone(),
            ejected: metrics.upstream_ejections.clone(),
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

    /// Each target's label and whether it is in now.
    pub fn status(&self) -> Vec<(String, bool)> {
        let now = self.now_ms();
        self.targets
            .iter()
            .map(|t| (t.label.to_string(), self.is_in(t, now)))
            .collect()
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis())
            .unwrap_or(u64::MAX)
            .max(1)
    }

    fn is_in(&self, t: &Target, now: u64) -> bool {
        t.out_until_ms.load(Ordering::Relaxed) <= now
    }

    /// A random number (splitmix64 over a shared Weyl sequence; no lock).
    fn random(&self) -> u64 {
        let mut z = self
            .rng
            .fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed)
            .wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Power of two choices among the targets that are in, other than `avoid`; when none is,
    /// `avoid` itself (or, with nothing in at all, any target: one always stays in).
    fn pick(&self, avoid: Option<usize>) -> usize {
        let n = self.targets.len();
        if n == 1 {
            return 0;
        }
        let now = self.now_ms();
        let eligible = |i: usize| Some(i) != avoid && self.is_in(&self.targets[i], now);
        let count = (0..n).filter(|&i| eligible(i)).count();
        if count == 0 {
            return match avoid {
                Some(a) if self.is_in(&self.targets[a], now) => a,
                // Nothing is in (a race between two ejections): the one back soonest.
                _ => (0..n)
                    .min_by_key(|&i| self.targets[i].out_until_ms.load(Ordering::Relaxed))
                    .unwrap_or(0),
            };
        }
        let nth = |k: usize| (0..n).filter(|&i| eligible(i)).nth(k).unwrap_or(0);
        let r = self.random();
        let ka = (r % count as u64) as usize;
        let a = nth(ka);
        if count == 1 {
            return a;
        }
        // A second, different eligible target: `ka` plus 1..count, wrapped.
        let kb = (ka + 1 + ((r >> 32) % (count as u64 - 1)) as usize) % count;
        let b = nth(kb);
        let (fa, fb) = (
            self.targets[a].in_flight.load(Ordering::Relaxed),
            self.targets[b].in_flight.load(Ordering::Relaxed),
        );
        if fb < fa {
            b
        } else {
            a
        }
    }

    /// A success on target `i`: its failure count and its ejection doubling reset.
    fn success(&self, i: usize) {
        let t = &self.targets[i];
        if t.fails.load(Ordering::Relaxed) != 0 {
            t.fails.store(0, Ordering::Relaxed);
        }
        if t.ejections.load(Ordering::Relaxed) != 0 && self.is_in(t, self.now_ms()) {
            t.ejections.store(0, Ordering::Relaxed);
            tracing::info!(target_url = %t.label, "upstream target answering again");
        }
    }

    /// A failure on target `i`; the `eject_after`-th in a row (or any, with `now`) ejects it.
    fn failure(&self, i: usize, why: &dyn std::fmt::Display, now_eject: bool) {
        let t = &self.targets[i];
        let fails = t.fails.fetch_add(1, Ordering::Relaxed) + 1;
        if fails < self.eject_after && !now_eject {
            return;
        }
        let now = self.now_ms();
        if !self.is_in(t, now) {
            return;
        }
        // The last target in stays in.
        let others_in = self
            .targets
            .iter()
            .enumerate()
            .any(|(j, o)| j != i && self.is_in(o, now));
        if !others_in {
            return;
        }
        let doublings = t.ejections.fetch_add(1, Ordering::Relaxed).min(MAX_EJECT_DOUBLINGS);
        let period = self.eject_for.saturating_mul(1 << doublings);
        let until = now.saturating_add(u64::try_from(period.as_millis()).unwrap_or(u64::MAX));
        t.out_until_ms.store(until, Ordering::Relaxed);
        t.fails.store(0, Ordering::Relaxed);
        self.ejected.inc();
        tracing::warn!(target_url = %t.label, failures = fails, out_for_ms = period.as_millis() as u64, error = %why, "upstream target ejected");
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
            // Never written and idempotent: the same request again.
            (Some(r), Retry::Unsent | Retry::Copy(_)) => r,
            // Written (the connection failed before the status line): a copy.
            (None, Retry::Copy(rp)) => rp.request(),
            _ => {
                return Err(Failed {
                    error: err,
                    target: self.targets[first].label.clone(),
                    attempts: 1,
                })
            }
        };
        self.retries.inc();
        let second = self.pick(Some(first));
        tracing::debug!(from = %self.targets[first].label, to = %self.targets[second].label, error = %err, "retrying upstream request");
        match self.attempt(second, again).await {
            Ok(r) => Ok(self.answered(second, r, 2)),
            Err(e) => Err(Failed {
                error: e.error,
                target: self.targets[second].label.clone(),
                attempts: 2,
            }),
        }
    }

    fn answered(self: &Arc<Self>, i: usize, (resp, flight): (Response<Incoming>, Flight), attempts: u8) -> Exchange {
        if resp.status().is_server_error() {
            self.failure(i, &resp.status(), false);
        } else {
            self.success(i);
        }
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
                    self.failure(i, &error, false);
                    return Err(AttemptError {
                        error,
                        unsent: Some(req),
                    });
                }
            };
            let result = match sender {
                Sender::H1(mut s) => {
                    to_h1(&mut req);
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

    /// A connection for one request to target `i`: a pooled HTTP/1.1 one or a new one, or a
    /// stream on a shared HTTP/2 one, as `upstream.protocol` (and, under `auto`, ALPN) says.
    /// With `fresh`, never a kept HTTP/1.1 connection nor an existing HTTP/2 one.
    async fn sender(self: &Arc<Self>, i: usize, fresh: bool) -> Result<Sender, UpstreamError> {
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
        Ok(match self.connect(i).await? {
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

    /// A stream on one of target `i`'s HTTP/2 connections: the least busy one, or a new one
    /// when all are busy and there is room (made once for every request that waits for it).
    async fn h2_sender(self: &Arc<Self>, i: usize, fresh: bool) -> Result<Sender, UpstreamError> {
        let t = &self.targets[i];
        if fresh {
            let c = self.h2_conn(i).await?;
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
    async fn h2_conn(&self, i: usize) -> Result<H2Conn, UpstreamError> {
        match self.connect(i).await? {
            Conn::H2(c) => Ok(c),
            Conn::H1(s) => {
                self.checkin(i, s);
                Err(UpstreamError::NoH2)
            }
        }
    }

    /// A ready pooled handle of target `i`, dropping closed ones.
    fn checkout(&self, i: usize) -> Option<SendRequest<ProxyBody>> {
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

    fn checkin(&self, i: usize, s: SendRequest<ProxyBody>) {
        let mut idle = self.targets[i].idle.lock();
        if idle.len() < self.max_idle {
            idle.push(s);
        }
    }

    /// A new connection to target `i` (TCP, then TLS for `https://`), speaking HTTP/1.1 or
    /// HTTP/2 as `upstream.protocol` and ALPN say.
    async fn connect(&self, i: usize) -> Result<Conn, UpstreamError> {
        let t = &self.targets[i];
        let stream = match tokio::time::timeout(self.connect_timeout, TcpStream::connect(&t.addr)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(UpstreamError::Connect(e)),
            Err(_) => return Err(UpstreamError::Connect(std::io::ErrorKind::TimedOut.into())),
        };
        let _ = stream.set_nodelay(true);
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

    /// Ask every target `GET path` once; a failing one goes out at once (unless it is the last
    /// one in), a passing one that was out comes back.
    pub async fn health_check(self: &Arc<Self>, path: &http::uri::PathAndQuery, timeout: Duration) {
        let checks = (0..self.targets.len()).map(|i| {
            let up = self.clone();
            let uri = Uri::from(path.clone());
            async move {
                let t = &up.targets[i];
                let mut req = Request::new(super::empty());
                *req.uri_mut() = uri;
                req.headers_mut().insert(http::header::HOST, t.host_header.clone());
                let result = tokio::time::timeout(timeout, async {
                    let (resp, flight) = up.attempt_quiet(i, req).await?;
                    let status = resp.status();
                    drop(flight);
                    Ok::<_, UpstreamError>(status)
                })
                .await;
                match result {
                    Ok(Ok(s)) if s.is_success() || s.is_redirection() => {
                        if !up.is_in(t, up.now_ms()) {
                            t.out_until_ms.store(0, Ordering::Relaxed);
                            t.fails.store(0, Ordering::Relaxed);
                            tracing::info!(target_url = %t.label, "upstream target passed its health check: back in");
                        }
                    }
                    Ok(Ok(s)) => up.failure(i, &format!("health check answered {s}"), true),
                    Ok(Err(e)) => up.failure(i, &format!("health check failed: {e}"), true),
                    Err(_) => up.failure(i, &"health check timed out", true),
                }
            }
        });
        futures_util::future::join_all(checks).await;
    }

    /// An exchange on a fresh connection to target `i`, outside the failure accounting (the
    /// health check decides on its result itself).
    async fn attempt_quiet(
        self: &Arc<Self>,
        i: usize,
        mut req: Request<ProxyBody>,
    ) -> Result<(Response<Incoming>, Flight), UpstreamError> {
        let flight = Flight::enter(self, i);
        let resp = match self.connect(i).await? {
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

/// A new connection.
enum Conn {
    /// HTTP/1.1.
    H1(SendRequest<ProxyBody>),
    /// HTTP/2, to be shared.
    H2(H2Conn),
}

/// HTTP/1.1 on a connected stream; the connection is driven by a spawned task.
async fn handshake<I>(io: I) -> Result<Conn, UpstreamError>
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

/// HTTP/2 on a connected stream (prior knowledge, or agreed by ALPN); the connection is driven
/// by a spawned task, and pinged when quiet so that a dead peer is noticed.
async fn handshake_h2<I>(io: I) -> Result<Conn, UpstreamError>
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
fn to_h2(req: &mut Request<ProxyBody>, t: &Target) {
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

/// The request as HTTP/1.1 sends it (undoes [`to_h2`] for a request that came back unsent):
/// origin-form URI, the authority in `Host`.
fn to_h1(req: &mut Request<ProxyBody>) {
    *req.version_mut() = Version::HTTP_11;
    if req.uri().scheme().is_none() {
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
    *req.uri_mut() = super::forward::origin_form(req.uri().path_and_query());
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

/// A seed for the balancer.
fn seed() -> u64 {
    super::request_id::random_u64()
}

#[cfg(test)]
mod tests;
