//! Admin API access on the request side: which endpoints are open, and the credential a request
//! presents (`Authorization: Bearer <token>`, or HTTP Basic with the token as the password, so a
//! browser can open protected pages).

use base64::Engine;
use http::{header, HeaderMap, Method};

use crate::config::admin::AdminToken;

/// `/healthz`, `/readyz` and `/metrics` are open to everyone: probes and Prometheus scrape them.
pub fn is_open(method: &Method, path: &str) -> bool {
    (method == Method::GET || method == Method::HEAD) && matches!(path, "/healthz" | "/readyz" | "/metrics")
}

/// The secret a request presents: a Bearer token, or the password of HTTP Basic credentials.
pub fn presented(headers: &HeaderMap) -> Option<Vec<u8>> {
    let v = headers.get(header::AUTHORIZATION)?.as_bytes();
    let (scheme, rest) = match v.iter().position(|&b| b == b' ') {
        Some(i) => (&v[..i], &v[i + 1..]),
        None => return None,
    };
    let rest = rest.trim_ascii();
    if scheme.eq_ignore_ascii_case(b"bearer") {
        return Some(rest.to_vec());
    }
    if scheme.eq_ignore_ascii_case(b"basic") {
        let decoded = base64::engine::general_purpose::STANDARD.decode(rest).ok()?;
        let colon = decoded.iter().position(|&b| b == b':')?;
        return Some(decoded[colon + 1..].to_vec());
    }
    None
}

/// May this request use a protected endpoint? Always, when no token is configured.
pub fn allowed(token: Option<&AdminToken>, headers: &HeaderMap) -> bool {
    match token {
        None => true,
        Some(t) => presented(headers).is_some_and(|p| t.matches(&p)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn with(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, HeaderValue::from_str(v).unwrap()); // allow-panic: test
        h
    }

    #[test]
    fn bearer_and_basic_password_are_read() {
        let t = AdminToken::new("s3cret");
        assert!(allowed(Some(&t), &with("Bearer s3cret")));
        assert!(allowed(Some(&t), &with("bearer s3cret")));
        // base64("admin:s3cret"), and any user name
        assert!(allowed(Some(&t), &with("Basic YWRtaW46czNjcmV0")));
        assert!(allowed(Some(&t), &with("Basic OnMzY3JldA==")));
        assert!(!allowed(Some(&t), &with("Bearer s3cre")));
        assert!(!allowed(Some(&t), &with("Basic czNjcmV0")), "no colon: no password");
        assert!(!allowed(Some(&t), &with("Digest s3cret")));
        assert!(!allowed(Some(&t), &HeaderMap::new()));
        assert!(allowed(None, &HeaderMap::new()));
    }
}
