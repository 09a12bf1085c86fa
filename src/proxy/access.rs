//! The access log (DESIGN.md §11): one structured line per request (or per sampled request),
//! on the tracing target `access`. It names the request id, method, path without its query,
//! status, decision and rule, the caller's identity kind and salted hash, the upstream target
//! and the durations — never a key, a token, a header value or a query string.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::config::AccessLog;

/// What the request path learned about one request, filled only when it is logged.
#[derive(Debug, Default)]
pub struct Note {
    /// `allowed`, `limited`, `unavailable`, `unmatched`, `error`.
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

/// Write the line.
pub fn write(id: &http::HeaderValue, method: &http::Method, path: &str, status: u16, started: Instant, note: &Note) {
    let total_us = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
    tracing::info!(
        target: "access",
        request_id = id.to_str().unwrap_or("-"),
        method = method.as_str(),
        path,
        status,
        decision = note.decision,
        rule = note.rule.as_deref().unwrap_or("-"),
        identity_kind = note.identity_kind,
        identity = note.identity.as_str(),
        upstream = note.target.as_deref().unwrap_or("-"),
        attempts = note.attempts,
        upstream_ms = note.upstream_us as f64 / 1000.0,
        duration_ms = total_us as f64 / 1000.0,
        "access"
    );
}
