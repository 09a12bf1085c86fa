//! Rate-limit response headers: IETF `RateLimit-Policy` / `RateLimit`
//! (draft-ietf-httpapi-ratelimit-headers, structured-field syntax) and the legacy
//! `X-RateLimit-Limit` / `-Remaining` / `-Reset`. Both describe the *binding* limit: on a deny
//! the limit that denied, on an allow the one with the least remaining.

use bytes::{BufMut, BytesMut};
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

/// Take what `buf` holds as one header value. Every value of a response is cut from one
/// buffer: `split` shares its allocation and `from_maybe_shared` takes the bytes without a copy.
pub(crate) fn take(buf: &mut BytesMut) -> Option<HeaderValue> {
    HeaderValue::from_maybe_shared(buf.split().freeze()).ok()
}

/// Write the selected header families for `b` into `h`. `now_secs` is Unix time.
pub fn write(h: &mut HeaderMap, b: &Binding<'_>, ietf: bool, legacy: bool, now_secs: u64) {
    let t = b.reset_secs();
    let remaining = if b.outcome.allowed { b.outcome.remaining } else { 0 };
    let mut n = itoa::Buffer::new();
    let mut buf = BytesMut::with_capacity(2 * b.rule.len() + 112);
    h.reserve(usize::from(ietf) * 2 + usize::from(legacy) * 3);
    if ietf {
        buf.put_u8(b'"');
        buf.put_slice(b.rule.as_bytes());
        buf.put_slice(b"\";q=");
        buf.put_slice(n.format(b.quota.limit.get()).as_bytes());
        buf.put_slice(b";w=");
        buf.put_slice(n.format(b.window_secs()).as_bytes());
        if let Some(v) = take(&mut buf) {
            h.insert(RATELIMIT_POLICY.clone(), v);
        }
        buf.put_u8(b'"');
        buf.put_slice(b.rule.as_bytes());
        buf.put_slice(b"\";r=");
        buf.put_slice(n.format(remaining).as_bytes());
        buf.put_slice(b";t=");
        buf.put_slice(n.format(t).as_bytes());
        if let Some(v) = take(&mut buf) {
            h.insert(RATELIMIT.clone(), v);
        }
    }
    if legacy {
        for (name, value) in [
            (&X_LIMIT, b.quota.limit.get()),
            (&X_REMAINING, remaining),
            (&X_RESET, now_secs + t),
        ] {
            buf.put_slice(n.format(value).as_bytes());
            if let Some(v) = take(&mut buf) {
                h.insert(name.clone(), v);
            }
        }
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
