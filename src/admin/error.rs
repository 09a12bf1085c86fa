//! The admin API's own refusals, each one [`LocalAnswer`] (the one type every answer tollgate
//! makes itself is, rendered once as HTTP).

use http::StatusCode;

use crate::http::respond::{Challenge, LocalAnswer};
use crate::http::ProxyBody;

/// Why the admin API refuses a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdminError {
    /// It has no such endpoint or entry.
    NotFound,
    /// A protected endpoint without the right token.
    Unauthorized,
    /// Refused for where it came from (a foreign Host or Origin), or a read-only token.
    Forbidden(&'static str),
    /// `/keys/{identity}` for a value that is no registered key id, IP or org and has no
    /// counters.
    UnknownIdentity,
    /// A malformed parameter.
    BadRequest(&'static str),
    /// A body larger than the admin API reads.
    PayloadTooLarge,
}

impl From<AdminError> for LocalAnswer {
    fn from(e: AdminError) -> Self {
        match e {
            AdminError::NotFound => LocalAnswer::new(StatusCode::NOT_FOUND, "not_found", ""),
            AdminError::Unauthorized => LocalAnswer::new(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "This admin endpoint needs the admin token: Authorization: Bearer <token>, or HTTP Basic with the token as the password.",
            )
            .with_challenge(Challenge::AdminRealm),
            AdminError::Forbidden(why) => LocalAnswer::new(StatusCode::FORBIDDEN, "forbidden", why),
            AdminError::UnknownIdentity => LocalAnswer::new(
                StatusCode::NOT_FOUND,
                "unknown_identity",
                "Not a registered API key id, an IP address or a registered org, and no counters exist for it: check the spelling.",
            ),
            AdminError::BadRequest(why) => LocalAnswer::new(StatusCode::BAD_REQUEST, "bad_request", why),
            AdminError::PayloadTooLarge => LocalAnswer::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload_too_large",
                "The request body is larger than this gateway accepts.",
            ),
        }
    }
}

impl AdminError {
    /// Its answer, as HTTP (the admin API speaks no gRPC).
    pub fn into_response(self) -> hyper::Response<ProxyBody> {
        LocalAnswer::from(self).http()
    }
}
