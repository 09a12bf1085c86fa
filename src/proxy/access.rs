//! The access log: one structured line per request (or per sampled request), on the tracing
//! target `access`. It names the request id and trace id, the client's address, the protocol
//! and TLS version, host, method and path without its query, the user agent, status, decision and rule, the
//! caller's identity kind and salted hash, the upstream target, the bytes received and sent and
//! the durations — never a key, a token, a credential header or a query string.
//!
//! `decision` is one of `allowed`, `limited`, `unavailable` (a fail-closed rule's store was
//! down), `fail_open` (a rule's store was down and it let the request through unchecked; `rule`
//! names it), `unmatched`, `overloaded` (refused by adaptive concurrency), `error`,
//! `client_aborted`. `bytes_in` is the request's
//! `Content-Length` (absent for a chunked body).
//!
//! The line is written when the response body has ended, so `duration_ms` is the whole
//! exchange. A client that leaves still gets its line: before the response, as status 499 with
//! decision `client_aborted` (nginx's 499, Envoy's `DC`); during the body, with its real status
//! and `client_aborted: true`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::config::AccessLog;

/// What the request path learned about one request, filled only when it is logged or its span
/// may be exported.
#[derive(Debug, Default)]
pub struct Note {
    /// Its access line is written (the caller's hash is worked out only then).
    pub logged: bool,
    /// `allowed`, `limited`, `unavailable`, `fail_open`, `unmatched`, `error` (see the module
    /// docs).
    pub decision: &'static str,
    /// The rule whose limit bound or denied.
    pub rule: Option<Arc<str>>,
    /// `ip`, `api_key`, `jwt`.
    pub identity_kind: &'static str,
    /// The caller's salted hash, as in the store key.
    pub identity: String,
    /// The target that answered (or the last one tried).
    pub target: Option<Arc<str>>,
    /// Upstream attempts (2 when retried).
    pub attempts: u8,
    /// Time spent waiting for the upstream's response head, microseconds.
    pub upstream_us: u64,
    /// The binding limit (the one in the response's headers, or the one that denied).
    pub binding: Option<crate::telemetry::BindingLimit>,
    /// A rule let the request through unchecked: its store was down.
    pub fail_open: bool,
    /// Time waiting for the store, microseconds (`None`: decided locally).
    pub store_us: Option<u64>,
}

/// The start of a request's span, when spans are exported (`crate::telemetry`).
#[derive(Debug)]
pub struct SpanStart {
    /// Where it goes.
    pub exporter: Arc<crate::telemetry::Exporter>,
    /// Its wall-clock start.
    pub wall: std::time::SystemTime,
    /// Its trace context.
    pub trace: crate::http::trace::TraceContext,
    /// The ratio (or the incoming sampled flag) picked it: exported however it ends.
    pub head: bool,
}

/// Continue or start the request's trace (`crate::http::trace::ensure`), and begin its span
/// when `exporter` is on. A trace started here that the ratio picks goes upstream sampled.
pub fn trace(
    h: &mut http::HeaderMap,
    exporter: Option<&Arc<crate::telemetry::Exporter>>,
) -> (crate::http::trace::TraceContext, Option<SpanStart>) {
    let mut trace = crate::http::trace::ensure(h, false);
    let span = exporter.map(|e| {
        let head = e.head_sampled(&trace);
        if head && trace.parent_id.is_none() {
            trace.flags |= 1;
            h.insert(crate::http::trace::TRACEPARENT.clone(), trace.traceparent());
        }
        SpanStart {
            exporter: e.clone(),
            wall: std::time::SystemTime::now(),
            trace,
            head,
        }
    });
    (trace, span)
}

/// Decides which requests are logged.
#[derive(Debug)]
pub struct Sampler {
    /// The configured mode.
    mode: AccessLog,
    /// Requests seen (sampled mode).
    seen: AtomicU64,
}

impl Sampler {
    /// A sampler for `mode`.
    pub fn new(mode: AccessLog) -> Self {
        Sampler {
            mode,
            seen: AtomicU64::new(0),
        }
    }

    /// Is this request logged? (One atomic add in sampled mode; nothing when off.)
    pub fn take(&self) -> bool {
        match self.mode {
            AccessLog::Off => false,
            AccessLog::All => true,
            AccessLog::Sampled { one_in, .. } => self.seen.fetch_add(1, Ordering::Relaxed) % one_in == 0,
        }
    }
}

/// One logged request: what its line needs besides how it ended.
#[derive(Debug)]
pub struct Line {
    /// The request id.
    pub id: http::HeaderValue,
    /// When it arrived.
    pub started: Instant,
    /// Its method.
    pub method: http::Method,
    /// Its URI (a reference count, not a copy): the line and the span show its path, never
    /// its query.
    pub uri: http::Uri,
    /// The client's address (the connection's peer).
    pub client: std::net::SocketAddr,
    /// `HTTP/1.0`, `HTTP/1.1` or `HTTP/2`.
    pub protocol: &'static str,
    /// `TLSv1.2` / `TLSv1.3` on a TLS listener.
    pub tls: Option<&'static str>,
    /// The request's authority, else its `Host` (what `host:` rules match).
    pub host: Option<http::HeaderValue>,
    /// Its `User-Agent`.
    pub user_agent: Option<http::HeaderValue>,
    /// Its `Content-Length`.
    pub bytes_in: Option<u64>,
    /// Its trace id, 32 hex digits.
    pub trace_id: [u8; 32],
    /// What the request path learned.
    pub note: Note,
    /// Its span, when spans are exported.
    pub span: Option<SpanStart>,
}

/// A header value for a log field: `-` when absent or not printable text.
fn text(v: Option<&http::HeaderValue>) -> &str {
    v.and_then(|v| v.to_str().ok()).unwrap_or("-")
}

impl Line {
    /// The request has ended with `status`, `bytes_out` body bytes sent, and the client gone
    /// before the end or not: write its line (when logged), export its span (when sampled).
    pub fn finish(self, status: u16, bytes_out: u64, client_aborted: bool) {
        if self.note.logged {
            self.write(status, bytes_out, client_aborted);
        }
        let Some(s) = self.span else { return };
        let n = self.note;
        if !(s.head || crate::telemetry::Exporter::always(n.decision, status, n.fail_open, client_aborted)) {
            return;
        }
        s.exporter.offer(crate::telemetry::Finished {
            trace: s.trace,
            start: s.wall,
            end: s.wall + self.started.elapsed(),
            method: self.method,
            path: self.uri.path().to_owned(),
            status,
            decision: n.decision,
            rule: n.rule,
            binding: n.binding,
            fail_open: n.fail_open,
            store_us: n.store_us,
            target: n.target,
            attempts: n.attempts,
            upstream_us: n.upstream_us,
            client_aborted,
        });
    }

    /// Write the line: the response's `status`, the body bytes sent, and whether the client
    /// left before the end.
    fn write(&self, status: u16, bytes_out: u64, client_aborted: bool) {
        let total_us = u64::try_from(self.started.elapsed().as_micros()).unwrap_or(u64::MAX);
        let note = &self.note;
        tracing::info!(
            target: "access",
            request_id = self.id.to_str().unwrap_or("-"),
            trace_id = std::str::from_utf8(&self.trace_id).unwrap_or("-"),
            client = %self.client,
            protocol = self.protocol,
            tls = self.tls.unwrap_or("-"),
            host = text(self.host.as_ref()),
            method = self.method.as_str(),
            path = self.uri.path(),
            user_agent = text(self.user_agent.as_ref()),
            status,
            decision = note.decision,
            rule = note.rule.as_deref().unwrap_or("-"),
            identity_kind = note.identity_kind,
            identity = note.identity.as_str(),
            upstream = note.target.as_deref().unwrap_or("-"),
            attempts = note.attempts,
            upstream_ms = note.upstream_us as f64 / 1000.0,
            duration_ms = total_us as f64 / 1000.0,
            bytes_in = self.bytes_in,
            bytes_out,
            client_aborted,
            "access"
        );
    }
}

/// A request on its way to a response. Dropped before [`Pending::answered`] — the client left
/// while tollgate was still deciding or waiting for the upstream — it counts the request as
/// `client_abort` and writes its line as status 499, decision `client_aborted`.
pub struct Pending<'a> {
    /// Where the abort is counted.
    pub metrics: &'a crate::metrics::Metrics,
    /// The line, when this request is logged.
    pub line: Option<Line>,
    /// The response was made.
    answered: bool,
}

impl<'a> Pending<'a> {
    /// A request that is not answered yet.
    pub fn new(metrics: &'a crate::metrics::Metrics, line: Option<Line>) -> Self {
        Pending {
            metrics,
            line,
            answered: false,
        }
    }

    /// The response is made: hand over the line (to [`LoggedBody`]). Dropped after this, it
    /// counts and logs nothing.
    pub fn answered(&mut self) -> Option<Line> {
        self.answered = true;
        self.line.take()
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if self.answered {
            return;
        }
        self.metrics.traffic.client_abort();
        if let Some(mut l) = self.line.take() {
            l.note.decision = "client_aborted";
            l.finish(499, 0, true);
        }
    }
}

/// A response body that writes its request's access line when it ends, fails, or is dropped
/// by a client that left mid-body.
pub struct LoggedBody {
    /// The response body.
    inner: crate::http::ProxyBody,
    /// `None` once written.
    line: Option<Line>,
    /// The response's status.
    status: u16,
    /// Body bytes passed on so far.
    bytes: u64,
}

impl LoggedBody {
    /// `inner`, logging `line` at its end.
    pub fn new(inner: crate::http::ProxyBody, line: Line, status: u16) -> Self {
        LoggedBody {
            inner,
            line: Some(line),
            status,
            bytes: 0,
        }
    }

    fn finish(&mut self, aborted: bool) {
        if let Some(l) = self.line.take() {
            l.finish(self.status, self.bytes, aborted);
        }
    }
}

impl hyper::body::Body for LoggedBody {
    type Data = bytes::Bytes;
    type Error = crate::http::BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, Self::Error>>> {
        let r = std::pin::Pin::new(&mut self.inner).poll_frame(cx);
        match &r {
            std::task::Poll::Ready(Some(Ok(f))) => {
                if let Some(d) = f.data_ref() {
                    self.bytes += d.len() as u64;
                }
                if self.inner.is_end_stream() {
                    self.finish(false);
                }
            }
            std::task::Poll::Ready(None) => self.finish(false),
            std::task::Poll::Ready(Some(Err(_))) => self.finish(true),
            std::task::Poll::Pending => {}
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for LoggedBody {
    fn drop(&mut self) {
        // Ended without being read to the end: an empty body (hyper never polls it) ended
        // complete; any other, the client left.
        let aborted = !hyper::body::Body::is_end_stream(&self.inner);
        self.finish(aborted);
    }
}
