//! The upstream: one or more targets (instances of the same API), each with a lean HTTP/1.1
//! connection pool on hyper's connection API, over TCP or TLS; balancing, passive ejection, an
//! optional active health check, and the one retry of a failed idempotent request.
//!
//! # Pool
//! A target's pool is a stack of `SendRequest` handles behind a mutex held for a few
//! instructions (never across an `.await`). A handle goes back on the stack as soon as the
//! response head arrives; it is handed out again only once `is_ready()` (its previous response
//! body has been read). A request that was never written (the pooled connection had closed) is
//! sent again on another connection, so a stale keep-alive connection never fails a request.
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
use http::{HeaderMap, HeaderValue, Method, Request, Response, Uri, Version};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

use super::ProxyBody;
use crate::config::UpstreamConfig;

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
}

/// Attempts on one target for a request whose pooled connection closed before it was written.
const ATTEMPTS: usize = 3;

/// An ejection period is doubled at most this many times (`eject_for` × 32).
pub const MAX_EJECT_DOUBLINGS: u32 = 5;

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
    /// Kept handles; the busy ones (a response body still streaming) are skipped at checkout.
    idle: Mutex<Vec<SendRequest<ProxyBody>>>,
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

/// One request in flight on one target.
struct Flight(Arc<Upstream>, usize);

impl Flight {
    fn enter(up: &Arc<Upstream>, i: usize) -> Self {
        up.targets[i].in_flight.fetch_add(1, Ordering::Relaxed);
        Flight(up.clone(), i)
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
            Some(TlsConnector::from(super::tls::client_config(&cfg.tls)?))
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
                    idle: Mutex::new(Vec::new()),
                    in_flight: AtomicUsize::new(0),
                    fails: AtomicU32::new(0),
                    out_until_ms: AtomicU64::new(0),
                    ejections: AtomicU32::new(0),
                }
            })
            .collect();
        Ok(Arc::new(Upstream {
            targets,
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

    /// One attempt on target `i` (a stale pooled connection is replaced on the way).
    async fn attempt(
        self: &Arc<Self>,
        i: usize,
        mut req: Request<ProxyBody>,
    ) -> Result<(Response<Incoming>, Flight), AttemptError> {
        let flight = Flight::enter(self, i);
        for attempt in 0..ATTEMPTS {
            let pooled = if attempt + 1 < ATTEMPTS { self.checkout(i) } else { None };
            let mut sender = match pooled {
                Some(s) => s,
                None => match self.connect(i).await {
                    Ok(s) => s,
                    Err(error) => {
                        self.failure(i, &error, false);
                        return Err(AttemptError {
                            error,
                            unsent: Some(req),
                        });
                    }
                },
            };
            match sender.try_send_request(req).await {
                Ok(resp) => {
                    self.checkin(i, sender);
                    return Ok((resp, flight));
                }
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

    /// A new connection to target `i` (TCP, then TLS for `https://`).
    async fn connect(&self, i: usize) -> Result<SendRequest<ProxyBody>, UpstreamError> {
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
                handshake(TokioIo::new(tls_stream)).await
            }
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
        req: Request<ProxyBody>,
    ) -> Result<(Response<Incoming>, Flight), UpstreamError> {
        let flight = Flight::enter(self, i);
        let mut sender = self.connect(i).await?;
        let resp = sender.send_request(req).await?;
        Ok((resp, flight))
    }
}

/// HTTP/1.1 on a connected stream; the connection is driven by a spawned task.
async fn handshake<I>(io: I) -> Result<SendRequest<ProxyBody>, UpstreamError>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (sender, conn) = http1::Builder::new().handshake(io).await?;
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(error = %e, "upstream connection ended with error");
        }
    });
    Ok(sender)
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
