//! The one place errors become HTTP responses. Every response tollgate produces itself — 429,
//! 503, 502, 504, 4xx for bad input — is built here, with a JSON body.

use http::{header, HeaderValue, Response, StatusCode};
use serde_json::json;

use super::{full, ProxyBody};

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
    /// The upstream is at its adaptive concurrency limit and this request's priority class was
    /// refused (no room came within its queue time, or the queue made room for a higher
    /// class). A 503, not a 429: the client did nothing wrong.
    #[error("overloaded: class {class} refused ({reason})")]
    Overloaded {
        /// The request's priority class.
        class: std::sync::Arc<str>,
        /// `queue_timeout` or `queue_full`.
        reason: &'static str,
    },
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
            GatewayError::LimiterUnavailable { .. }
            | GatewayError::Unavailable(_)
            | GatewayError::Overloaded { .. } => StatusCode::SERVICE_UNAVAILABLE,
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
            GatewayError::Overloaded { class, .. } => LocalAnswer {
                retry_after: Some(1),
                class: Some(class),
                ..LocalAnswer::new(
                    status,
                    "overloaded",
                    "The upstream is at its concurrency limit and requests of this priority class are refused first; retry shortly.",
                )
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
    /// The priority class refused (adaptive concurrency).
    class: Option<std::sync::Arc<str>>,
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
            class: None,
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
        if let Some(class) = &self.class {
            body["class"] = json!(&**class);
        }
        if let (Some(s), true) = (self.retry_after, self.rule.is_some() || self.class.is_some()) {
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
        let message = match (&self.rule, &self.class) {
            (Some(rule), _) => format!("{} (rule {rule})", self.message),
            (None, Some(class)) => format!("{} (class {class})", self.message),
            (None, None) if self.message.is_empty() => self.error.to_owned(),
            (None, None) => self.message.to_string(),
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

mod limited;
#[cfg(test)]
use limited::rate_limited_body;
pub use limited::{rate_limited, rate_limited_grpc};

#[cfg(test)]
mod tests;
