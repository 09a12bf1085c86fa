//! The 429: its JSON body, `Retry-After` and rate-limit headers, written straight into this
//! thread's value chunk; or, for a gRPC client, `RESOURCE_EXHAUSTED` with the same headers as
//! metadata. This is the deny path, the hottest answer tollgate makes itself, so the last 429
//! made on a thread is kept and copied while everything it was made from is equal.

use std::time::{Duration, SystemTime};

use http::{header, HeaderValue, Response, StatusCode};

use super::super::headers::{self, Binding};
use super::super::{full, ProxyBody};
use super::{grpc, GrpcCode};
use crate::http::request_id::X_REQUEST_ID;
use crate::rt::memo::Memo;
use crate::rt::value_buf::{Text, ValueBuf};

/// The 429 JSON body. Written directly (this is the hot deny path): rule names are validated
/// to `[A-Za-z0-9_.-]`, so nothing in it needs escaping.
/// Written on the stack and moved into the body's one allocation.
fn write_rate_limited_body(s: &mut impl std::fmt::Write, rule: &str, inputs: &Inputs429) {
    use std::fmt::Write;
    let (limit, window_us, secs, reset_at_secs) = (inputs.quota, inputs.window_us, inputs.secs, inputs.reset_at);
    let (wn, unit) = headers::WindowText(window_us).parts();
    let mut wbuf = itoa::Buffer::new();
    let mut window = Text::<24>::new();
    let _ = window.write_str(wbuf.format(wn));
    let _ = window.write_str(unit);
    let window = window.as_str();
    let mut lbuf = itoa::Buffer::new();
    let limit = lbuf.format(limit);
    let mut n = itoa::Buffer::new();
    let secs_text = n.format(secs);
    for part in [
        r#"{"error":"rate_limit_exceeded","message":"Rate limit of "#,
        limit,
        " per ",
        window,
        " exceeded for rule ",
        rule,
        "; retry in ",
        secs_text,
        r#" s.","rule":""#,
        rule,
        r#"","limit":"#,
        limit,
        r#","window":""#,
        window,
        r#"","retry_after":"#,
        secs_text,
        r#","reset_at":""#,
    ] {
        let _ = s.write_str(part);
    }
    push_rfc3339(s, SystemTime::UNIX_EPOCH + Duration::from_secs(reset_at_secs));
    let _ = s.write_str("\"}");
}

/// The 429 body alone (tests).
#[cfg(test)]
pub(super) fn rate_limited_body(rule: &str, limit: u64, window_us: u64, secs: u64, reset_at_secs: u64) -> bytes::Bytes {
    let mut s = Text::<512>::new();
    let inputs = Inputs429 {
        secs,
        t: secs,
        remaining: 0,
        quota: limit,
        window_us,
        reset_at: reset_at_secs,
        ietf: false,
        legacy: false,
        concurrency: false,
    };
    write_rate_limited_body(&mut s, rule, &inputs);
    bytes::Bytes::from_owner(s)
}

/// Append `t` as RFC 3339 UTC seconds (`2026-11-30T08:00:00Z`). Denials come in bursts, so the
/// text of the last second formatted is kept per thread and reused while it matches.
fn push_rfc3339(s: &mut impl std::fmt::Write, t: SystemTime) {
    thread_local! {
        static LAST: Memo<(u64, String)> = const { Memo::new() };
    }
    let secs = t.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let _ = LAST.try_with(|last| {
        let reused = last.reuse(|(at, _)| *at == secs, |(_, text)| s.write_str(text));
        if reused.is_none() {
            last.keep(|old| {
                use std::fmt::Write;
                let mut text = old.map(|(_, t)| t).unwrap_or_default();
                text.clear();
                let _ = write!(text, "{}", humantime::format_rfc3339_seconds(t));
                let _ = s.write_str(&text);
                (secs, text)
            });
        }
    });
}

/// `Retry-After`, as a static for [`ValueBuf::end`].
static RETRY_AFTER: http::HeaderName = header::RETRY_AFTER;

/// A 429 for `b`, with the rate-limit headers of the denying limit. `now_us` is the one clock
/// reading the body's `reset_at` and `X-RateLimit-Reset` both derive from.
///
/// Denials come in floods from one caller, and within a second each of its 429s is the same
/// text: the last one made on this thread is kept ([`Last429`]) and copied while every value it
/// was made from is equal (a header map clone shares the values; building one hashes each name).
/// Otherwise the body, `Retry-After` and the rate-limit values are written into this thread's
/// value chunk and shared from it ([`ValueBuf`]). Its `X-Request-Id` is empty, for the caller
/// to set.
pub fn rate_limited(b: &Binding<'_>, ietf: bool, legacy: bool, now_us: u64) -> Response<ProxyBody> {
    let inputs = Inputs429::of(b, ietf, legacy, now_us);
    limited_http(b, &inputs, now_us)
}

/// The same 429 as a gRPC client needs it: `grpc-status: 8` (RESOURCE_EXHAUSTED), a
/// `grpc-message` naming the rule and the wait, and the rate-limit headers and `Retry-After`
/// as metadata; no JSON body is written.
pub fn rate_limited_grpc(b: &Binding<'_>, ietf: bool, legacy: bool, now_us: u64) -> Response<ProxyBody> {
    let inputs = Inputs429::of(b, ietf, legacy, now_us);
    let mut resp = Response::new(super::super::empty());
    headers::write(resp.headers_mut(), b, ietf, legacy, now_us);
    resp.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(inputs.secs));
    let message = format!("rate limit {:?} exceeded; retry in {} s", b.rule, inputs.secs);
    grpc(resp, GrpcCode::ResourceExhausted, &message)
}

/// [`rate_limited`] once its inputs are known.
fn limited_http(b: &Binding<'_>, inputs: &Inputs429, now_us: u64) -> Response<ProxyBody> {
    let inputs = *inputs;
    let mut resp = Response::new(super::super::empty());
    *resp.status_mut() = StatusCode::TOO_MANY_REQUESTS;
    let reused = LAST_429
        .try_with(|last| {
            last.reuse(
                |l| l.inputs == inputs && &*l.rule == b.rule,
                |l| (l.headers.clone(), l.body.clone()),
            )
        })
        .ok()
        .flatten();
    if let Some((headers, body)) = reused {
        *resp.headers_mut() = headers;
        *resp.body_mut() = full(body);
        return resp;
    }
    let body = build_429(resp.headers_mut(), b, &inputs, now_us).unwrap_or_default();
    let _ = LAST_429.try_with(|last| {
        last.keep(|old| {
            let mut rule = old.map(|l| l.rule).unwrap_or_default();
            rule.clear();
            rule.push_str(b.rule);
            Last429 {
                inputs,
                rule,
                headers: resp.headers().clone(),
                body: body.clone(),
            }
        })
    });
    *resp.body_mut() = full(body);
    resp
}

/// Every value a 429's text depends on besides the rule name (see [`rate_limited`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Inputs429 {
    /// `Retry-After`: whole seconds, at least 1.
    secs: u64,
    /// `t`: seconds until the limit frees up.
    t: u64,
    /// `r`: requests still fitting (0 on a denial).
    remaining: u64,
    /// `q` and the body's limit.
    quota: u64,
    /// The window, for the body's text and `w`.
    window_us: u64,
    /// `X-RateLimit-Reset` and the body's `reset_at`.
    reset_at: u64,
    /// The header families, and whether the limit is a concurrency one (no `w`).
    ietf: bool,
    /// See `ietf`.
    legacy: bool,
    /// See `ietf`.
    concurrency: bool,
}

impl Inputs429 {
    fn of(b: &Binding<'_>, ietf: bool, legacy: bool, now_us: u64) -> Self {
        Inputs429 {
            secs: headers::ceil_secs_min1(b.outcome.retry_after_us),
            t: b.reset_secs(),
            remaining: b.remaining_requests(),
            quota: b.quota_requests(),
            window_us: b.quota.window_us.get(),
            reset_at: b.reset_at_secs(now_us),
            ietf,
            legacy,
            concurrency: b.quota.algorithm == crate::limiter::Algorithm::Concurrency,
        }
    }
}

/// The last 429 made on a thread, with what it was made from.
struct Last429 {
    /// The values it was made from.
    inputs: Inputs429,
    /// The rule it named (its text reused from one 429 to the next).
    rule: String,
    /// Its headers (values share `body`'s allocation).
    headers: http::HeaderMap,
    /// Its JSON body.
    body: bytes::Bytes,
}

thread_local! {
    /// The last 429 made on this thread (one per worker under `thread_per_core`).
    static LAST_429: Memo<Last429> = const { Memo::new() };
}

/// Write the 429 of `b` (its values already worked out in `inputs`) into `h` and return its
/// body: the body and the values share this thread's value chunk.
fn build_429(h: &mut http::HeaderMap, b: &Binding<'_>, inputs: &Inputs429, now_us: u64) -> Option<bytes::Bytes> {
    let mut buf = ValueBuf::new();
    write_rate_limited_body(&mut buf, b.rule, inputs);
    buf.end_body();
    buf.put(itoa::Buffer::new().format(inputs.secs).as_bytes());
    buf.end(&RETRY_AFTER);
    headers::write_values(&mut buf, b, inputs.ietf, inputs.legacy, now_us);
    // Room for these and the rate-limit headers, so a built map never regrows.
    h.reserve(12);
    // The request id's place, which the caller fills (the proxy's log phase does on every
    // answer): a reused 429 is a clone, sized to what it holds, and a new name would regrow
    // it (one reallocation per denial).
    h.insert(X_REQUEST_ID.clone(), HeaderValue::from_static(""));
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    buf.finish(h)
}
