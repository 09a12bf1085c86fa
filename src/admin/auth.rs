//! Admin API access on the request side: which endpoints are open, and the credential a request
//! presents (`Authorization: Bearer <token>`, or HTTP Basic with the token as the password, so a
//! browser can open protected pages), and where a request comes from ([`from_allowed`]): a
//! tokenless admin API answers only loopback `Host` values, and no mutation is taken from a
//! foreign `Origin`, so a DNS-rebinding or cross-site page cannot drive it.

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

/// May a request with this method, path and headers be served, given where it comes from?
/// `Err` names why not (answered 403):
///
/// * a mutation (`POST`, `PUT`, `DELETE`, `PATCH`) carrying an `Origin` that is not a loopback
///   origin (`http://127.0.0.1:*`, `http://localhost:*`, `http://[::1]:*`; `null` is foreign),
///   with or without a token: a browser sends `Origin` on every cross-site form or `fetch`;
/// * without a token, a protected endpoint asked for under a `Host` that is not `localhost` or a
///   loopback address (any port). A DNS-rebinding page can only send its own name. When the
///   listener itself is not on loopback (`admin.insecure: true`), an IP-address `Host` is
///   accepted too, since no page can rebind an address literal. The open endpoints
///   (`/healthz`, `/readyz`, `/metrics`) answer any `Host`, as they do without a token.
pub fn from_allowed(
    has_token: bool,
    listener_loopback: bool,
    method: &Method,
    path: &str,
    headers: &HeaderMap,
) -> Result<(), &'static str> {
    let mutation = matches!(*method, Method::POST | Method::PUT | Method::DELETE | Method::PATCH);
    if mutation {
        if let Some(o) = headers.get(header::ORIGIN) {
            if !loopback_origin(o.as_bytes()) {
                return Err("admin changes are not accepted from a page of another origin");
            }
        }
    }
    if has_token || is_open(method, path) {
        return Ok(());
    }
    let host = headers.get(header::HOST).map(|h| host_of(h.as_bytes()));
    match host {
        Some(h) if loopback_host(h) => Ok(()),
        Some(h) if !listener_loopback && ip_literal(h).is_some() => Ok(()),
        _ => Err("the admin API without a token answers only a loopback Host (127.0.0.1, localhost, [::1])"),
    }
}

/// The host of an authority (`host`, `host:port`, `[v6]`, `[v6]:port`), brackets kept.
fn host_of(authority: &[u8]) -> &[u8] {
    let a = authority.trim_ascii();
    if a.first() == Some(&b'[') {
        return match a.iter().position(|&b| b == b']') {
            Some(end) => &a[..=end],
            None => a,
        };
    }
    match a.iter().rposition(|&b| b == b':') {
        Some(i) if a[i + 1..].iter().all(u8::is_ascii_digit) => &a[..i],
        _ => a,
    }
}

/// An IP address literal (IPv6 in brackets).
fn ip_literal(host: &[u8]) -> Option<std::net::IpAddr> {
    let text = std::str::from_utf8(host).ok()?;
    let inner = text.strip_prefix('[').and_then(|t| t.strip_suffix(']'));
    match inner {
        Some(v6) => v6.parse::<std::net::Ipv6Addr>().ok().map(std::net::IpAddr::V6),
        None => text.parse::<std::net::Ipv4Addr>().ok().map(std::net::IpAddr::V4),
    }
}

/// `localhost` or a loopback address.
fn loopback_host(host: &[u8]) -> bool {
    host.eq_ignore_ascii_case(b"localhost") || ip_literal(host).is_some_and(|ip| ip.is_loopback())
}

/// `http(s)://` and a loopback host, any port, nothing after it.
fn loopback_origin(origin: &[u8]) -> bool {
    let o = origin.trim_ascii();
    let lower = o.to_ascii_lowercase();
    let rest = if lower.starts_with(b"http://") {
        &o[7..]
    } else if lower.starts_with(b"https://") {
        &o[8..]
    } else {
        return false;
    };
    !rest.contains(&b'/') && !rest.contains(&b'@') && loopback_host(host_of(rest))
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

    #[test]
    fn hosts_and_origins() {
        let req = |host: Option<&str>, origin: Option<&str>| {
            let mut h = HeaderMap::new();
            if let Some(v) = host {
                h.insert(header::HOST, HeaderValue::from_str(v).unwrap()); // allow-panic: test
            }
            if let Some(v) = origin {
                h.insert(header::ORIGIN, HeaderValue::from_str(v).unwrap()); // allow-panic: test
            }
            h
        };
        for host in [
            "127.0.0.1",
            "127.0.0.1:9090",
            "localhost",
            "LocalHost:1",
            "[::1]",
            "[::1]:9090",
            "127.9.9.9:80",
        ] {
            assert!(
                from_allowed(false, true, &Method::GET, "/status", &req(Some(host), None)).is_ok(),
                "{host}"
            );
        }
        for host in [
            "evil.example",
            "evil.example:9090",
            "localhost.evil.example",
            "10.0.0.5:9090",
            "[::2]",
        ] {
            assert!(
                from_allowed(false, true, &Method::GET, "/status", &req(Some(host), None)).is_err(),
                "{host}"
            );
        }
        assert!(from_allowed(false, true, &Method::GET, "/status", &req(None, None)).is_err());
        // Open endpoints, a token, or a non-loopback listener with an address literal.
        assert!(from_allowed(false, true, &Method::GET, "/healthz", &req(Some("evil.example"), None)).is_ok());
        assert!(from_allowed(true, true, &Method::GET, "/status", &req(Some("evil.example"), None)).is_ok());
        assert!(from_allowed(false, false, &Method::GET, "/status", &req(Some("10.0.0.5:9090"), None)).is_ok());
        assert!(from_allowed(false, false, &Method::GET, "/status", &req(Some("evil.example"), None)).is_err());
        let lo = Some("127.0.0.1:9090");
        for origin in ["http://127.0.0.1:9090", "http://localhost", "https://[::1]:1"] {
            assert!(
                from_allowed(false, true, &Method::POST, "/reload", &req(lo, Some(origin))).is_ok(),
                "{origin}"
            );
        }
        for origin in [
            "http://evil.example",
            "null",
            "http://127.0.0.1.evil.example",
            "http://127.0.0.1@evil.example",
            "file://",
        ] {
            for token in [false, true] {
                let r = from_allowed(
                    token,
                    true,
                    &Method::PUT,
                    "/overrides/ip/1.2.3.4",
                    &req(lo, Some(origin)),
                );
                assert!(r.is_err(), "{origin} token={token}");
            }
        }
        // Reads are not refused for their Origin.
        assert!(from_allowed(
            false,
            true,
            &Method::GET,
            "/status",
            &req(lo, Some("http://evil.example"))
        )
        .is_ok());
    }
}
