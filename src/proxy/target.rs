//! The request target and host, settled once, so that what the rules decide on is what the
//! upstream receives (ARCHITECTURE.md, "What the matcher decides on is what the upstream
//! receives"): the path in its one canonical spelling, and one host.
//!
//! * The path is rewritten to [`canonical`]'s spelling (percent-escapes decoded, dot-segments
//!   resolved, `;params` dropped), and a path that some upstream would read as another one (an
//!   encoded slash, a backslash, a control byte, ...) gets a 400.
//! * The host is the target's authority when it has one (absolute-form, HTTP/2 `:authority`;
//!   RFC 9112 §3.2.2, RFC 9113 §8.3.1), else `Host`. A `Host` that is no authority (with
//!   userinfo, say) gets a 400, as does an HTTP/2 `Host` that names another host than
//!   `:authority`.

use http::uri::{Authority, PathAndQuery, Uri};
use http::{header, HeaderValue, Method, Request, Version};

use crate::http::respond::GatewayError;
use crate::rules::{canonical, EncodedSlashes};

use super::facts::Facts;

/// Settle `req`'s target: its path rewritten to the canonical spelling when it had another,
/// its host checked and, for an absolute-form HTTP/1 request, `Host` replaced by the target's
/// authority (`facts.host` follows). `Err` is the 400 to answer.
pub(super) fn settle<B>(req: &mut Request<B>, facts: &mut Facts, slashes: EncodedSlashes) -> Result<(), GatewayError> {
    if let Some(h) = &facts.host {
        if !valid_host(h.as_bytes()) {
            return Err(GatewayError::BadRequest("invalid Host header"));
        }
    }
    if let Some(a) = req.uri().authority() {
        if a.as_str().contains('@') {
            return Err(GatewayError::BadRequest("the request target has userinfo"));
        }
        if req.version() == Version::HTTP_2 {
            if let Some(h) = &facts.host {
                if !h.as_bytes().eq_ignore_ascii_case(a.as_str().as_bytes()) {
                    return Err(GatewayError::BadRequest("Host differs from :authority"));
                }
            }
        } else if *req.method() != Method::CONNECT {
            // Absolute-form: the target's authority is the host, and `Host` is replaced.
            let v = HeaderValue::from_str(a.as_str()).map_err(|_| GatewayError::BadRequest("invalid authority"))?;
            req.headers_mut().insert(header::HOST, v.clone());
            facts.host = Some(v);
            facts.hosts = 1;
        }
    }
    path(req, slashes)
}

/// The path step of [`settle`].
fn path<B>(req: &mut Request<B>, slashes: EncodedSlashes) -> Result<(), GatewayError> {
    let method = req.method();
    if *method == Method::CONNECT {
        // Authority-form; refused on its way out.
        return Ok(());
    }
    let raw = req.uri().path();
    if raw == "*" {
        return if *method == Method::OPTIONS {
            Ok(())
        } else {
            Err(GatewayError::BadRequest("the asterisk-form target is only for OPTIONS"))
        };
    }
    let canon = canonical(raw, slashes).map_err(|e| GatewayError::BadRequest(e.message()))?;
    if let std::borrow::Cow::Owned(p) = canon {
        let pq = match req.uri().query() {
            Some(q) => format!("{p}?{q}"),
            None => p,
        };
        let pq = PathAndQuery::try_from(pq).map_err(|_| GatewayError::BadRequest("invalid request target"))?;
        let mut parts = req.uri().clone().into_parts();
        parts.path_and_query = Some(pq);
        *req.uri_mut() = Uri::from_parts(parts).map_err(|_| GatewayError::BadRequest("invalid request target"))?;
    }
    Ok(())
}

/// A `Host` value is `uri-host [":" port]` and nothing else (RFC 9112 §3.2), or empty.
fn valid_host(v: &[u8]) -> bool {
    if v.is_empty() {
        return true;
    }
    if v.contains(&b'@') || !Authority::try_from(v).is_ok_and(|a| a.as_str().len() == v.len()) {
        return false;
    }
    // `Authority` leaves the port unchecked: it is digits, or empty.
    let after_host = match v.iter().rposition(|&b| b == b']') {
        Some(i) => &v[i + 1..],
        None => v,
    };
    match after_host.iter().rposition(|&b| b == b':') {
        Some(i) => after_host[i + 1..].iter().all(u8::is_ascii_digit),
        None => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(version: Version, uri: &str, host: Option<&'static str>) -> (Request<()>, Facts) {
        let mut r = Request::builder().version(version).uri(uri).body(()).unwrap(); // allow-panic: test
        if let Some(h) = host {
            r.headers_mut().insert(header::HOST, HeaderValue::from_static(h));
        }
        let f = Facts::of(r.headers());
        (r, f)
    }

    #[test]
    fn the_forwarded_path_is_the_matched_path() {
        let (mut r, mut f) = req(Version::HTTP_11, "/api/v1/./log%69n?x=%2F", Some("a.example"));
        settle(&mut r, &mut f, EncodedSlashes::Reject).unwrap(); // allow-panic: test
        assert_eq!(r.uri(), "/api/v1/login?x=%2F");
        for bad in ["/api%2Fv1%2Flogin", "/api/v1/login%00", "/api/v1/login.", "*"] {
            let (mut r, mut f) = req(Version::HTTP_11, bad, Some("a.example"));
            assert!(settle(&mut r, &mut f, EncodedSlashes::Reject).is_err(), "{bad}");
        }
        let mut r = Request::builder().method(Method::OPTIONS).uri("*").body(()).unwrap(); // allow-panic: test
        let mut f = Facts::of(r.headers());
        assert!(settle(&mut r, &mut f, EncodedSlashes::Reject).is_ok());
    }

    #[test]
    fn the_host_is_the_targets_authority_and_one_authority() {
        let (mut r, mut f) = req(Version::HTTP_11, "http://a.example/x", Some("b.example"));
        settle(&mut r, &mut f, EncodedSlashes::Reject).unwrap(); // allow-panic: test
        assert_eq!(r.headers()[header::HOST], "a.example");
        assert_eq!(f.host.as_ref().map(|h| h.as_bytes()), Some(&b"a.example"[..]));
        let (mut r, mut f) = req(Version::HTTP_2, "http://a.example/x", Some("b.example"));
        assert!(settle(&mut r, &mut f, EncodedSlashes::Reject).is_err());
        let (mut r, mut f) = req(Version::HTTP_2, "http://a.example/x", Some("A.example"));
        assert!(settle(&mut r, &mut f, EncodedSlashes::Reject).is_ok());
        for bad in ["user@evil.example", "a.example/x", "a b", "a.example:port"] {
            let mut r = Request::builder().uri("/x").body(()).unwrap(); // allow-panic: test
            r.headers_mut()
                .insert(header::HOST, HeaderValue::from_str(bad).unwrap()); // allow-panic: test
            let mut f = Facts::of(r.headers());
            assert!(settle(&mut r, &mut f, EncodedSlashes::Reject).is_err(), "{bad}");
        }
        for good in ["a.example", "a.example:8080", "[::1]:80", "127.0.0.1", ""] {
            let mut r = Request::builder().uri("/x").body(()).unwrap(); // allow-panic: test
            r.headers_mut()
                .insert(header::HOST, HeaderValue::from_str(good).unwrap()); // allow-panic: test
            let mut f = Facts::of(r.headers());
            assert!(settle(&mut r, &mut f, EncodedSlashes::Reject).is_ok(), "{good}");
        }
    }
}
