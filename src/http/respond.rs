//! The one place errors become HTTP responses. Every response tollgate produces itself — 429,
//! 503, 502, 504, 4xx for bad input — is built here, with a JSON body.

use std::time::{Duration, SystemTime};

use http::{header, HeaderValue, Response, StatusCode};
use serde_json::json;

use super::headers::{self, Binding};
use super::{full, ProxyBody};
use crate::rt::value_buf::{Text, ValueBuf};

/// Why the proxy ends a request without (or instead of) the upstream's response. Each becomes
/// one [`LocalAnswer`]; the admin API's own reasons are `admin::AdminError`.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// The store failed and a `failure: closed` rule applies.
    #[error("rate limiter unavailable (rule {rule})")]
    LimiterUnavailable {
        /// Rule name.
        rule: String,
        /// Seconds the client should wait.
        retry_after_secs: u64,
    },
    /// The upstream refused or could not be reached.
    #[error("upstream unreachable: {0}")]
    BadGateway(String),
    /// The upstream did not answer within `request_timeout`.
    #[error("upstream timed out")]
    GatewayTimeout,
    /// A malformed request.
    #[error("bad request: {0}")]
    BadRequest(&'static str),
    /// The request uses something tollgate does not implement (a transfer coding other than
    /// `chunked`).
    #[error("not implemented: {0}")]
    NotImplemented(&'static str),
    /// The body is larger than `max_body_bytes`.
    #[error("request body too large")]
    PayloadTooLarge,
    /// The gateway is shutting down or at its connection cap.
    #[error("service unavailable: {0}")]
    Unavailable(&'static str),
    /// The request's header section is larger than `max_header_bytes`, or has too many fields.
    #[error("request header fields too large")]
    HeadersTooLarge,
    /// A credential that is present but identifies no one (`identity.invalid_credentials:
    /// reject`). The body never echoes the credential.
    #[error("invalid credentials")]
    InvalidCredentials,
}

impl From<crate::identity::CredentialProblem> for GatewayError {
    fn from(p: crate::identity::CredentialProblem) -> Self {
        match p {
            crate::identity::CredentialProblem::Ambiguous(why) => GatewayError::BadRequest(why),
            crate::identity::CredentialProblem::Invalid => GatewayError::InvalidCredentials,
        }
    }
}

impl GatewayError {
    /// The HTTP status of its answer.
    pub fn status(&self) -> StatusCode {
        match self {
            GatewayError::LimiterUnavailable { .. } | GatewayError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            GatewayError::BadGateway(_) => StatusCode::BAD_GATEWAY,
            GatewayError::GatewayTimeout => StatusCode::GATEWAY_TIMEOUT,
            GatewayError::BadRequest(_) => StatusCode::BAD_REQUEST,
            GatewayError::NotImplemented(_) => StatusCode::NOT_IMPLEMENTED,
            GatewayError::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            GatewayError::HeadersTooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            GatewayError::InvalidCredentials => StatusCode::UNAUTHORIZED,
        }
    }

    /// Its answer rendered as HTTP (see [`LocalAnswer::http`]).
    pub fn into_response(self) -> Response<ProxyBody> {
        LocalAnswer::from(self).http()
    }
}

impl From<GatewayError> for LocalAnswer {
    fn from(e: GatewayError) -> Self {
        let status = e.status();
        match e {
            GatewayError::LimiterUnavailable { rule, retry_after_secs } => LocalAnswer {
                retry_after: Some(retry_after_secs),
                rule: Some(rule),
                ..LocalAnswer::new(
                    status,
                    "rate_limiter_unavailable",
                    "The rate limiter's store is unavailable and this endpoint fails closed; retry shortly.",
                )
            },
            GatewayError::BadGateway(_) => {
                LocalAnswer::new(status, "bad_gateway", "The upstream could not be reached.")
            }
            GatewayError::GatewayTimeout => {
                LocalAnswer::new(status, "gateway_timeout", "The upstream did not answer in time.")
            }
            GatewayError::BadRequest(why) => LocalAnswer::new(status, "bad_request", why),
            GatewayError::NotImplemented(why) => LocalAnswer::new(status, "not_implemented", why),
            GatewayError::PayloadTooLarge => LocalAnswer::new(
                status,
                "payload_too_large",
                "The request body is larger than this gateway accepts.",
            ),
            GatewayError::Unavailable(why) => LocalAnswer {
                retry_after: Some(1),
                ..LocalAnswer::new(status, "unavailable", why)
            },
            GatewayError::HeadersTooLarge => LocalAnswer::new(
                status,
                "request_header_fields_too_large",
                "The request's headers are larger than this gateway accepts.",
            ),
            GatewayError::InvalidCredentials => LocalAnswer {
                challenge: Challenge::InvalidToken,
                ..LocalAnswer::new(
                    status,
                    "invalid_credentials",
                    "The API key or bearer token was not accepted: it is unknown, expired or does not verify.",
                )
            },
        }
    }
}

/// A `WWW-Authenticate` challenge a local answer carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Challenge {
    /// None.
    None,
    /// `Bearer error="invalid_token"`: a credential was refused.
    InvalidToken,
    /// The admin API's `Bearer` and `Basic` realms: it needs the admin token.
    AdminRealm,
}

/// Every answer tollgate makes itself, the proxy's and the admin API's alike: one value that
/// knows its HTTP status and its gRPC code, rendered once, as HTTP ([`LocalAnswer::http`], a
/// JSON body) or as gRPC ([`LocalAnswer::grpc`], `grpc-status` and `grpc-message`). The 429,
/// made on the hot deny path from the binding limit, is [`rate_limited`], in either form.
#[derive(Debug, Clone)]
pub struct LocalAnswer {
    status: StatusCode,
    code: GrpcCode,
    /// The body's machine-readable `error`.
    error: &'static str,
    /// The body's `message` (omitted when empty).
    message: std::borrow::Cow<'static, str>,
    /// The rule it is about (a fail-closed outage).
    rule: Option<String>,
    /// `Retry-After` and the body's `retry_after`, seconds.
    retry_after: Option<u64>,
    challenge: Challenge,
}

impl LocalAnswer {
    /// An answer with `status` (its gRPC code follows from it, see [`GrpcCode::for_status`]),
    /// the body's `error` and `message`.
    pub fn new(status: StatusCode, error: &'static str, message: impl Into<std::borrow::Cow<'static, str>>) -> Self {
        LocalAnswer {
            status,
            code: GrpcCode::for_status(status),
            error,
            message: message.into(),
            rule: None,
            retry_after: None,
            challenge: Challenge::None,
        }
    }

    /// The same answer with a `WWW-Authenticate` challenge.
    pub fn with_challenge(mut self, challenge: Challenge) -> Self {
        self.challenge = challenge;
        self
    }

    /// Its HTTP status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// Its gRPC status code.
    pub fn grpc_code(&self) -> GrpcCode {
        self.code
    }

    /// As a gRPC client needs it when `grpc`, else as HTTP.
    pub fn render(self, grpc: bool) -> Response<ProxyBody> {
        if grpc {
            self.grpc()
        } else {
            self.http()
        }
    }

    /// As HTTP: its status, a JSON body (`error`, `message`, and `rule` / `retry_after` where
    /// they apply), `Cache-Control: no-store`, `Retry-After` where it applies, its challenge.
    pub fn http(self) -> Response<ProxyBody> {
        let mut body = json!({"error": self.error});
        if !self.message.is_empty() {
            body["message"] = json!(self.message);
        }
        if let Some(rule) = &self.rule {
            body["rule"] = json!(rule);
        }
        if let (Some(s), Some(_)) = (self.retry_after, &self.rule) {
            body["retry_after"] = json!(s);
        }
        let mut resp = Response::new(full(body.to_string()));
        *resp.status_mut() = self.status;
        let h = resp.headers_mut();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        self.finish(h);
        resp
    }

    /// As gRPC: HTTP 200, `grpc-status` its code, `grpc-message` what it says (see [`grpc`]).
    pub fn grpc(self) -> Response<ProxyBody> {
        let mut resp = Response::new(super::empty());
        self.finish(resp.headers_mut());
        let message = match &self.rule {
            Some(rule) => format!("{} (rule {rule})", self.message),
            None if self.message.is_empty() => self.error.to_owned(),
            None => self.message.to_string(),
        };
        grpc(resp, self.code, &message)
    }

    /// `Retry-After` and the challenge, both renderings.
    fn finish(&self, h: &mut http::HeaderMap) {
        if let Some(s) = self.retry_after {
            h.insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        match self.challenge {
            Challenge::None => {}
            Challenge::InvalidToken => {
                h.insert(
                    header::WWW_AUTHENTICATE,
                    HeaderValue::from_static("Bearer error=\"invalid_token\""),
                );
            }
            Challenge::AdminRealm => {
                h.append(
                    header::WWW_AUTHENTICATE,
                    HeaderValue::from_static("Bearer realm=\"tollgate admin\""),
                );
                h.append(
                    header::WWW_AUTHENTICATE,
                    HeaderValue::from_static("Basic realm=\"tollgate admin\", charset=\"UTF-8\""),
                );
            }
        }
    }
}

/// The 429 JSON body. Written directly (this is the hot deny path): rule names are validated
/// to `[A-Za-z0-9_.-]`, so nothing in it needs escaping.
/// Written on the stack and moved into the body's one allocation.
fn write_rate_limited_body(
    s: &mut impl std::fmt::Write,
    rule: &str,
    limit: u64,
    window_us: u64,
    secs: u64,
    reset_at_secs: u64,
) {
    use std::fmt::Write;
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
fn rate_limited_body(rule: &str, limit: u64, window_us: u64, secs: u64, reset_at_secs: u64) -> bytes::Bytes {
    let mut s = Text::<512>::new();
    write_rate_limited_body(&mut s, rule, limit, window_us, secs, reset_at_secs);
    bytes::Bytes::from_owner(s)
}

/// Append `t` as RFC 3339 UTC seconds (`2026-11-30T08:00:00Z`). Denials come in bursts, so the
/// text of the last second formatted is kept per thread and reused while it matches.
fn push_rfc3339(s: &mut impl std::fmt::Write, t: SystemTime) {
    use std::cell::RefCell;
    thread_local! {
        static LAST: RefCell<(u64, String)> = const { RefCell::new((u64::MAX, String::new())) };
    }
    let secs = t.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    LAST.with(|last| {
        let mut last = last.borrow_mut();
        if last.0 != secs {
            use std::fmt::Write;
            last.1.clear();
            let _ = write!(last.1, "{}", humantime::format_rfc3339_seconds(t));
            last.0 = secs;
        }
        let _ = s.write_str(&last.1);
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
/// value chunk and shared from it ([`ValueBuf`]).
pub fn rate_limited(b: &Binding<'_>, ietf: bool, legacy: bool, now_us: u64) -> Response<ProxyBody> {
    let inputs = Inputs429::of(b, ietf, legacy, now_us);
    limited_http(b, &inputs, now_us)
}

/// The same 429 as a gRPC client needs it: `grpc-status: 8` (RESOURCE_EXHAUSTED), a
/// `grpc-message` naming the rule and the wait, and the rate-limit headers and `Retry-After`
/// as metadata; no JSON body is written.
pub fn rate_limited_grpc(b: &Binding<'_>, ietf: bool, legacy: bool, now_us: u64) -> Response<ProxyBody> {
    let inputs = Inputs429::of(b, ietf, legacy, now_us);
    let mut resp = Response::new(super::empty());
    headers::write(resp.headers_mut(), b, ietf, legacy, now_us);
    resp.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(inputs.secs));
    let message = format!("rate limit {:?} exceeded; retry in {} s", b.rule, inputs.secs);
    grpc(resp, GrpcCode::ResourceExhausted, &message)
}

/// [`rate_limited`] once its inputs are known.
fn limited_http(b: &Binding<'_>, inputs: &Inputs429, now_us: u64) -> Response<ProxyBody> {
    let inputs = *inputs;
    let mut resp = Response::new(super::empty());
    *resp.status_mut() = StatusCode::TOO_MANY_REQUESTS;
    let reused = LAST_429
        .try_with(|last| {
            let last = last.try_borrow().ok()?;
            let last = last.as_ref().filter(|l| l.inputs == inputs && &*l.rule == b.rule)?;
            *resp.headers_mut() = last.headers.clone();
            *resp.body_mut() = full(last.body.clone());
            Some(())
        })
        .ok()
        .flatten();
    if reused.is_some() {
        return resp;
    }
    let body = build_429(resp.headers_mut(), b, &inputs, now_us).unwrap_or_default();
    let _ = LAST_429.try_with(|last| {
        if let Ok(mut last) = last.try_borrow_mut() {
            let mut rule = last.take().map(|l| l.rule).unwrap_or_default();
            rule.clear();
            rule.push_str(b.rule);
            *last = Some(Last429 {
                inputs,
                rule,
                headers: resp.headers().clone(),
                body: body.clone(),
            });
        }
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
    static LAST_429: std::cell::RefCell<Option<Last429>> = const { std::cell::RefCell::new(None) };
}

/// Write the 429 of `b` (its values already worked out in `inputs`) into `h` and return its
/// body: the body and the values share this thread's value chunk.
fn build_429(h: &mut http::HeaderMap, b: &Binding<'_>, inputs: &Inputs429, now_us: u64) -> Option<bytes::Bytes> {
    let mut buf = ValueBuf::new();
    write_rate_limited_body(
        &mut buf,
        b.rule,
        inputs.quota,
        inputs.window_us,
        inputs.secs,
        inputs.reset_at,
    );
    buf.end_body();
    buf.put(itoa::Buffer::new().format(inputs.secs).as_bytes());
    buf.end(&RETRY_AFTER);
    headers::write_values(&mut buf, b, inputs.ietf, inputs.legacy, now_us);
    // Room for these, the rate-limit headers and `X-Request-Id`, so a built map never regrows
    // (a reused one is a clone, sized to what it holds: `X-Request-Id` grows it once).
    h.reserve(12);
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    buf.finish(h)
}

/// gRPC status codes tollgate answers with itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrpcCode {
    /// 3: a malformed request (HTTP 400).
    InvalidArgument = 3,
    /// 5: the admin API has no such thing (HTTP 404).
    NotFound = 5,
    /// 7: refused for where it came from, or a read-only token (HTTP 403).
    PermissionDenied = 7,
    /// 8: over a limit, or a request or header section too large (HTTP 429, 413, 431).
    ResourceExhausted = 8,
    /// 12: something tollgate does not implement (HTTP 501).
    Unimplemented = 12,
    /// 14: the limiter's store is down and the rule fails closed, the upstream is unreachable
    /// or late, or the gateway is draining (HTTP 502, 503, 504).
    Unavailable = 14,
    /// 16: no credential, or one refused (HTTP 401).
    Unauthenticated = 16,
}

impl GrpcCode {
    /// The code of a local answer with HTTP `status`.
    pub fn for_status(status: StatusCode) -> Self {
        match status.as_u16() {
            400 => GrpcCode::InvalidArgument,
            401 => GrpcCode::Unauthenticated,
            403 => GrpcCode::PermissionDenied,
            404 => GrpcCode::NotFound,
            413 | 429 | 431 => GrpcCode::ResourceExhausted,
            501 => GrpcCode::Unimplemented,
            _ => GrpcCode::Unavailable,
        }
    }
}

/// True for a gRPC request's `Content-Type` (`application/grpc`, `application/grpc+proto`, …):
/// its client reads the outcome from `grpc-status`, not from the HTTP status.
pub fn is_grpc(content_type: &http::HeaderValue) -> bool {
    content_type.as_bytes().starts_with(b"application/grpc")
}

/// Turn a locally made response into what a gRPC client understands: HTTP 200, an empty body,
/// `content-type: application/grpc`, and `grpc-status` / `grpc-message` (a "trailers-only"
/// response: over HTTP/2 the status travels in the one header block that ends the stream).
/// The rate-limit headers and `Retry-After` stay, as metadata.
pub fn grpc(mut resp: Response<ProxyBody>, code: GrpcCode, message: &str) -> Response<ProxyBody> {
    *resp.status_mut() = StatusCode::OK;
    *resp.body_mut() = full("");
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    h.remove(header::CONTENT_LENGTH);
    h.insert("grpc-status", HeaderValue::from(code as i32));
    // grpc-message is percent-encoded (gRPC over HTTP/2, "Responses").
    let encoded = percent_encoding::utf8_percent_encode(message, percent_encoding::CONTROLS).to_string();
    if let Ok(v) = HeaderValue::from_str(&encoded) {
        h.insert("grpc-message", v);
    }
    resp
}

/// A JSON answer with `status` (admin API: a refused reload, a store error).
pub fn json(status: StatusCode, v: &serde_json::Value) -> Response<ProxyBody> {
    let mut resp = json_ok(v);
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

/// A JSON 200 (admin API).
pub fn json_ok(v: &serde_json::Value) -> Response<ProxyBody> {
    let mut resp = Response::new(full(v.to_string()));
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

/// The admin dashboard page: HTML whose CSS and JS are inline, allowed by its Content Security
/// Policy, which forbids every other source (no CDN, no frames) except requests to the admin
/// port itself.
pub fn page(html: &'static str) -> Response<ProxyBody> {
    let mut resp = Response::new(full(html));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
        ),
    );
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    resp
}

/// A plain-text response (admin API).
pub fn text(status: StatusCode, body: impl Into<bytes::Bytes>, content_type: &'static str) -> Response<ProxyBody> {
    let mut resp = Response::new(full(body));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    resp
}

#[cfg(test)]
mod tests;
