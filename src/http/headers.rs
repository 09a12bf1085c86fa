//! Rate-limit response headers: IETF `RateLimit-Policy` / `RateLimit`
//! (draft-ietf-httpapi-ratelimit-headers, structured-field syntax) and the legacy
//! `X-RateLimit-Limit` / `-Remaining` / `-Reset`. Both describe the *binding* limit: on a deny
//! the denying limit that stays exhausted the longest, on an allow the one with the fewest
//! requests remaining (the longest reset among equals).
//!
//! **Units.** `q` / `X-RateLimit-Limit` and `r` / `X-RateLimit-Remaining` count *requests of
//! the rule's cost*: a rule of 100 units per minute at `cost: 5` shows `q=20`, and `r=1` means
//! one more such request fits. With the default cost of 1 they are units.
//!
//! **Reset.** `X-RateLimit-Reset` is the Unix second at or after the instant the limit frees up
//! (rounded up from the real instant, never early); `t` is the number of seconds until then.
//!
//! **Policies** (draft-ietf-httpapi-ratelimit-headers-12). `RateLimit-Policy` lists every limit
//! of the binding rule in force for the request, each as its own policy: a String item named
//! for the rule (and for the window, when the rule has several: `"api-10s"`, `"api-1m"`), with
//! `q` and `w` (a window in whole seconds), or `q` and `qu="concurrent-requests"` for a
//! concurrency limit. `RateLimit` names the binding one, with `r` and `t`. Integers are capped
//! at the Structured Fields maximum (15 digits).
//!
//! **Upstream fields.** An upstream's own `RateLimit` and `RateLimit-Policy` are kept: both are
//! lists, and tollgate's members follow the upstream's as further field lines (the draft asks
//! intermediaries not to remove them). The single-valued `X-RateLimit-*` fields are replaced.

use crate::rt::value_buf::ValueBuf;
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
    /// The quota enforced (the local share of it while the store is down and the rule falls
    /// back to this node).
    pub quota: Quota,
    /// Units one request of the rule spends (≥ 1).
    pub cost: u64,
    /// What the store answered for this limit: admitted or not, remaining, reset and retry times.
    pub outcome: &'a Outcome,
    /// The values that do not change from one response to the next (`RateLimit-Policy`,
    /// `X-RateLimit-Limit`), made when the rules loaded, when the binding limit is the rule's
    /// own (not an override's or a local share's).
    pub fixed: Option<&'a FixedValues>,
    /// Without `fixed`: every limit of the rule in force for the request, in the rule's order
    /// (`quota` is `windows[at]`), for `RateLimit-Policy`. Empty: `quota` is the only one.
    pub windows: &'a [Quota],
    /// Where `quota` is in `windows`.
    pub at: usize,
    /// Per limit of the rule, by position: what `q` counts ([`Unit`]). Past its end, or
    /// empty: requests of `cost`.
    pub units: &'a [Unit],
}

/// What a limit's `q` and `r` count: requests of `cost` units (`name` `None`), or units named
/// `name` one by one (`cost` 1, `qu="<name>"`: a limit whose cost the upstream reports, such as
/// tokens).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unit {
    /// Units one counted thing is worth (≥ 1).
    pub cost: u64,
    /// The quota unit's name (`tokens`), a lower-case token.
    pub name: Option<std::sync::Arc<str>>,
}

/// The rate-limit header values of one limit of one rule that are the same on every response:
/// made once when the rules load ([`FixedValues::new`]) and shared by every response they
/// describe (a reference count, no formatting or validation per response).
#[derive(Debug, Clone)]
pub struct FixedValues {
    /// The quota they describe.
    pub quota: Quota,
    /// The rule's cost.
    pub cost: u64,
    /// `RateLimit-Policy`: every limit of the rule.
    pub policy: HeaderValue,
    /// The policy name of this limit, as `RateLimit` names it (without the quotes).
    pub name: Box<str>,
    /// `X-RateLimit-Limit`.
    pub limit: HeaderValue,
}

impl FixedValues {
    /// The values for limit `at` of rule `rule`'s limits `windows`, at `cost`; `None` when `at`
    /// is out of range or the rule name is not header-safe text (never: names are validated to
    /// `[A-Za-z0-9_.-]`).
    pub fn new(rule: &str, windows: &[Quota], at: usize, cost: u64, units: &[Unit]) -> Option<Self> {
        let quota = *windows.get(at)?;
        let cost = units.get(at).map_or(cost, |u| u.cost);
        let mut n = itoa::Buffer::new();
        let mut policy = Vec::with_capacity(windows.len() * (rule.len() + 32));
        write_policy_list(&mut policy, rule, windows, (cost, units), &mut n);
        let mut name = Vec::with_capacity(rule.len() + 12);
        write_name(&mut name, rule, windows, at, &mut n);
        Some(FixedValues {
            quota,
            cost,
            policy: HeaderValue::from_bytes(&policy).ok()?,
            name: String::from_utf8(name).ok()?.into_boxed_str(),
            limit: HeaderValue::from_str(n.format(requests_of(&quota, cost))).ok()?,
        })
    }

    /// These values, if they describe `quota` at `cost`.
    pub fn describing(&self, quota: &Quota, cost: u64) -> Option<&Self> {
        (self.quota == *quota && self.cost == cost).then_some(self)
    }
}

/// Anything [`write_policy`] can write into.
trait Put {
    fn put(&mut self, b: &[u8]);
}

impl Put for Vec<u8> {
    fn put(&mut self, b: &[u8]) {
        self.extend_from_slice(b);
    }
}

impl Put for ValueBuf {
    fn put(&mut self, b: &[u8]) {
        ValueBuf::put(self, b);
    }
}

/// The largest Integer a Structured Field may carry (RFC 9651 §3.3.1: 15 digits).
const SF_INT_MAX: u64 = 999_999_999_999_999;

/// Write `v` as a Structured Field Integer (capped at [`SF_INT_MAX`]).
fn put_int(buf: &mut impl Put, v: u64, n: &mut itoa::Buffer) {
    buf.put(n.format(v.min(SF_INT_MAX)).as_bytes());
}

/// What tells limit `q` from the rule's other limits in its policy name: its window
/// (`(10, "s")`), or `concurrent` for a concurrency limit.
fn name_suffix(q: &Quota) -> (u64, &'static str) {
    if q.algorithm == crate::limiter::Algorithm::Concurrency {
        (0, "concurrent")
    } else {
        WindowText(q.window_us.get()).parts()
    }
}

/// The policy name of limit `at` of `windows` (the rule's limits in force): the rule's name
/// alone when it is the only one; else the rule's name and the window (`api-10s`, `api-1m`,
/// `api-concurrent`), or its position (`api-2`) when another of the rule's limits has the same
/// window. Every limit of a rule thus has a name of its own.
fn write_name(buf: &mut impl Put, rule: &str, windows: &[Quota], at: usize, n: &mut itoa::Buffer) {
    buf.put(rule.as_bytes());
    let Some(q) = windows.get(at).filter(|_| windows.len() > 1) else {
        return;
    };
    let suffix = name_suffix(q);
    buf.put(b"-");
    if windows
        .iter()
        .enumerate()
        .any(|(j, w)| j != at && name_suffix(w) == suffix)
    {
        buf.put(n.format(at + 1).as_bytes());
    } else {
        if suffix.0 > 0 {
            buf.put(n.format(suffix.0).as_bytes());
        }
        buf.put(suffix.1.as_bytes());
    }
}

/// Every limit of `windows` as a policy, comma-separated: `"name";q=Q;w=W` for a rate limit,
/// `"name";q=Q;qu="concurrent-requests"` for a concurrency limit (no window: `q` requests in
/// flight at once).
///
/// A limit with a named unit ([`Unit`]) counts those units: `"name";q=Q;w=W;qu="tokens"`.
fn write_policy_list(
    buf: &mut impl Put,
    rule: &str,
    windows: &[Quota],
    (cost, units): (u64, &[Unit]),
    n: &mut itoa::Buffer,
) {
    for (k, q) in windows.iter().enumerate() {
        if k > 0 {
            buf.put(b", ");
        }
        let unit = units.get(k);
        buf.put(b"\"");
        write_name(buf, rule, windows, k, n);
        buf.put(b"\";q=");
        put_int(buf, requests_of(q, unit.map_or(cost, |u| u.cost)), n);
        if q.algorithm == crate::limiter::Algorithm::Concurrency {
            buf.put(b";qu=\"concurrent-requests\"");
        } else {
            buf.put(b";w=");
            put_int(buf, window_secs_of(q), n);
            if let Some(name) = unit.and_then(|u| u.name.as_deref()) {
                buf.put(b";qu=\"");
                buf.put(name.as_bytes());
                buf.put(b"\"");
            }
        }
    }
}

/// `q`: the limit `q` in requests of `cost` (at least 1).
fn requests_of(q: &Quota, cost: u64) -> u64 {
    (q.limit.get() / cost.max(1)).max(1)
}

/// `w`: the window of `q` in whole seconds (bucket: time to refill from empty), at least 1.
fn window_secs_of(q: &Quota) -> u64 {
    q.window_us.get().div_ceil(1_000_000).max(1)
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
        window_secs_of(&self.quota)
    }

    /// `q`: the limit in requests of this rule's cost (at least 1).
    pub fn quota_requests(&self) -> u64 {
        requests_of(&self.quota, self.cost)
    }

    /// `r`: requests of this rule's cost that still fit (0 on a denial).
    pub fn remaining_requests(&self) -> u64 {
        if self.outcome.allowed {
            self.outcome.remaining / self.cost.max(1)
        } else {
            0
        }
    }

    /// The Unix second at or after which the limit frees up: a denial's retry instant, or an
    /// admission's full reset, rounded **up** from the instant the store decided at (its own
    /// clock; `now_us` when it did not say), so a client that waits until then is never early.
    pub fn reset_at_secs(&self, now_us: u64) -> u64 {
        let at = if self.outcome.at_us > 0 {
            self.outcome.at_us
        } else {
            now_us
        };
        let wait = if self.outcome.allowed {
            self.outcome.reset_us
        } else {
            self.outcome.retry_after_us.max(1)
        };
        at.saturating_add(wait).div_ceil(1_000_000)
    }
}

/// Write the selected header families for `b` into `h`. `now_us` is the gateway's clock.
/// Every value is a slice of this thread's value chunk ([`ValueBuf`]). `RateLimit` and
/// `RateLimit-Policy` are appended to any `h` has (an upstream's); `X-RateLimit-*` replace.
pub fn write(h: &mut HeaderMap, b: &Binding<'_>, ietf: bool, legacy: bool, now_us: u64) {
    let mut buf = ValueBuf::new();
    write_values(&mut buf, b, ietf, legacy, now_us);
    buf.finish(h);
}

/// [`write`] into `buf`, beside whatever else it holds (the 429 writes its body and
/// `Retry-After` into the same buffer).
pub fn write_values(buf: &mut ValueBuf, b: &Binding<'_>, ietf: bool, legacy: bool, now_us: u64) {
    let t = b.reset_secs();
    let remaining = b.remaining_requests();
    let quota = b.quota_requests();
    let mut n = itoa::Buffer::new();
    if ietf {
        let (windows, at) = if b.windows.is_empty() {
            (std::slice::from_ref(&b.quota), 0)
        } else {
            (b.windows, b.at)
        };
        match b.fixed {
            Some(f) => buf.preset_appended(&RATELIMIT_POLICY, f.policy.clone()),
            None => {
                write_policy_list(buf, b.rule, windows, (b.cost, b.units), &mut n);
                buf.end_appended(&RATELIMIT_POLICY);
            }
        }
        buf.put(b"\"");
        match b.fixed {
            Some(f) => buf.put(f.name.as_bytes()),
            None => write_name(buf, b.rule, windows, at, &mut n),
        }
        buf.put(b"\";r=");
        put_int(buf, remaining, &mut n);
        buf.put(b";t=");
        put_int(buf, t, &mut n);
        buf.end_appended(&RATELIMIT);
    }
    if legacy {
        match b.fixed {
            Some(f) => buf.preset(&X_LIMIT, f.limit.clone()),
            None => {
                buf.put(n.format(quota).as_bytes());
                buf.end(&X_LIMIT);
            }
        }
        for (name, value) in [(&X_REMAINING, remaining), (&X_RESET, b.reset_at_secs(now_us))] {
            buf.put(n.format(value).as_bytes());
            buf.end(name);
        }
    }
}

/// Pick the binding limit among `(skip, outcome, cost)`: of the denials, the one that stays
/// exhausted the longest; with none, the fewest requests remaining, and among those the longest
/// reset. Skipped entries (shadow, unchecked) never bind.
pub fn binding_index(outcomes: impl Iterator<Item = (bool, Outcome, u64)>) -> Option<usize> {
    let mut denied: Option<(usize, u64)> = None;
    let mut allowed: Option<(usize, u64, u64)> = None;
    for (i, (skip, o, cost)) in outcomes.enumerate() {
        if skip {
            continue;
        }
        if !o.allowed {
            if denied.is_none_or(|(_, r)| o.retry_after_us > r) {
                denied = Some((i, o.retry_after_us));
            }
            continue;
        }
        let left = o.remaining / cost.max(1);
        if allowed.is_none_or(|(_, l, reset)| left < l || (left == l && o.reset_us > reset)) {
            allowed = Some((i, left, o.reset_us));
        }
    }
    denied.map(|(i, _)| i).or(allowed.map(|(i, _, _)| i))
}

/// Humantime-ish rendering of a window for headers and bodies (`1m`, `15m`, `1s`, `250ms`).
pub fn window_text(us: u64) -> String {
    WindowText(us).to_string()
}

/// [`window_text`] without the allocation, for writing into a buffer.
#[derive(Debug, Clone, Copy)]
pub struct WindowText(pub u64);

impl WindowText {
    /// The number and unit of the text: `(90, "s")` for 90 seconds. The largest unit that
    /// divides the window evenly (d, h, m, s, else ms).
    pub fn parts(&self) -> (u64, &'static str) {
        let ms = self.0 / 1000;
        if ms != 0 && ms % 86_400_000 == 0 {
            (ms / 86_400_000, "d")
        } else if ms != 0 && ms % 3_600_000 == 0 {
            (ms / 3_600_000, "h")
        } else if ms != 0 && ms % 60_000 == 0 {
            (ms / 60_000, "m")
        } else if ms != 0 && ms % 1000 == 0 {
            (ms / 1000, "s")
        } else {
            (ms, "ms")
        }
    }
}

impl std::fmt::Display for WindowText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (n, unit) = self.parts();
        write!(f, "{n}{unit}")
    }
}

#[cfg(test)]
mod tests;
