//! Rate-limit response headers: IETF `RateLimit-Policy` / `RateLimit`
//! (draft-ietf-httpapi-ratelimit-headers, structured-field syntax) and the legacy
//! `X-RateLimit-Limit` / `-Remaining` / `-Reset`. Both describe the *binding* limit: on a deny
//! the limit that denied, on an allow the one with the least remaining.

use http::header::{HeaderMap, HeaderName, HeaderValue};

use crate::limiter::{Outcome, Quota};

/// `RateLimit-Policy`.
pub static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit`.
pub static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
/// `X-RateLimit-Limit`.
pub static X_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
/// `X-RateLimit-Remaining`.
pub static X_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
/// `X-RateLimit-Reset`.
pub static X_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// The limit that decided a response.
#[derive(Debug, Clone, Copy)]
pub struct Binding<'a> {
    /// Rule name (the policy name).
    pub rule: &'a str,
    /// Its quota.
    pub quota: &'a Quota,
    /// The outcome.
    pub outcome: &'a Outcome,
}

/// Seconds, rounded up, at least 1 — for `Retry-After` and `t` on a denial.
pub fn ceil_secs_min1(us: u64) -> u64 {
    us.div_ceil(1_000_000).max(1)
}

impl Binding<'_> {
    /// The `t` value: on a deny the retry delay (≥ 1 s); on an allow the time to a full reset.
    pub fn reset_secs(&self) -> u64 {
        if self.outcome.allowed {
            self.outcome.reset_us.div_ceil(1_000_000)
        } else {
            ceil_secs_min1(self.outcome.retry_after_us)
        }
    }

    /// Window seconds for `w` (bucket: time to refill from empty), at least 1.
    pub fn window_secs(&self) -> u64 {
        self.quota.window_us.get().div_ceil(1_000_000).max(1)
    }
}

fn push(h: &mut HeaderMap, name: &HeaderName, s: String) {
    // `from_maybe_shared` takes the buffer over instead of copying it.
    if let Ok(v) = HeaderValue::from_maybe_shared(bytes::Bytes::from(s)) {
        h.insert(name.clone(), v);
    }
}

/// Write the selected header families for `b` into `h`. `now_secs` is Unix time.
pub fn write(h: &mut HeaderMap, b: &Binding<'_>, ietf: bool, legacy: bool, now_secs: u64) {
    let t = b.reset_secs();
    let remaining = if b.outcome.allowed { b.outcome.remaining } else { 0 };
    if ietf {
        let mut n = itoa::Buffer::new();
        let mut buf = String::with_capacity(b.rule.len() + 32);
        buf.push('"');
        buf.push_str(b.rule);
        buf.push_str("\";q=");
        buf.push_str(n.format(b.quota.limit.get()));
        buf.push_str(";w=");
        buf.push_str(n.format(b.window_secs()));
        push(h, &RATELIMIT_POLICY, buf);
        let mut buf = String::with_capacity(b.rule.len() + 32);
        buf.push('"');
        buf.push_str(b.rule);
        buf.push_str("\";r=");
        buf.push_str(n.format(remaining));
        buf.push_str(";t=");
        buf.push_str(n.format(t));
        push(h, &RATELIMIT, buf);
    }
    if legacy {
        h.insert(X_LIMIT.clone(), HeaderValue::from(b.quota.limit.get()));
        h.insert(X_REMAINING.clone(), HeaderValue::from(remaining));
        h.insert(X_RESET.clone(), HeaderValue::from(now_secs + t));
    }
}

/// Pick the binding limit: the first denial among non-shadow limits, else the least remaining.
pub fn binding_index(outcomes: impl Iterator<Item = (bool, Outcome)>) -> Option<usize> {
    let mut best: Option<(usize, u64)> = None;
    for (i, (shadow, o)) in outcomes.enumerate() {
        if shadow {
            continue;
        }
        if !o.allowed {
            return Some(i);
        }
        if best.is_none_or(|(_, r)| o.remaining < r) {
            best = Some((i, o.remaining));
        }
    }
    best.map(|(i, _)| i)
}
