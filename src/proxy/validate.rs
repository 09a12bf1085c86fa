//! The validate phase: what a proxy must not pass on is refused before any limit is spent
//! (CONNECT, methods spelled in another case, ambiguous framing, a missing or repeated Host, a
//! body or header section over its cap, a header tollgate reads spelled with `_`). The
//! request's target and host are settled here too (`target`). Each refusal is one local answer
//! (a 4xx).

use http::{header, Request, Version};

use super::ctx::Exchange;
use super::facts::Facts;
use super::target;
use crate::config::ServerConfig;
use crate::http::respond::GatewayError;
use crate::state::{Snapshot, State};

/// Refuse `req` if it breaks any rule of this phase; settle its target and host
/// (`x.facts.host` follows).
pub(super) fn phase<B>(gw: &State, x: &mut Exchange<'_>, req: &mut Request<B>) -> Result<(), GatewayError> {
    let sc = &gw.config().server;
    request(req, &x.facts, sc)?;
    target::settle(req, &mut x.facts, sc.encoded_slashes)?;
    if x.facts.underscored {
        refuse_underscore_spellings(gw, &x.snap, req.headers())?;
    }
    Ok(())
}

/// Refuse `req` (whose fields `f` has read) if it breaks any rule of this phase, under the
/// server's caps in `sc`.
fn request<B>(req: &Request<B>, f: &Facts, sc: &ServerConfig) -> Result<(), GatewayError> {
    framing(req, f, sc.max_body_bytes)?;
    headers_within(req, f, sc.max_header_bytes)
}

/// Refuses requests a proxy must not pass on, and bodies over `max_body_bytes` by their
/// `Content-Length`.
fn framing<B>(req: &Request<B>, f: &Facts, max_body_bytes: u64) -> Result<(), GatewayError> {
    // Before any limit is spent: tollgate forwards no CONNECT.
    if req.method() == http::Method::CONNECT {
        return Err(GatewayError::BadRequest("CONNECT is not supported"));
    }
    if method_case_variant(req.method()) {
        return Err(GatewayError::BadRequest(
            "method names are case-sensitive: a standard method must be upper case",
        ));
    }
    if f.other_coding {
        return Err(GatewayError::NotImplemented("a transfer coding other than chunked"));
    }
    if f.transfer_encoding && f.content_lengths > 0 {
        return Err(GatewayError::BadRequest("both Content-Length and Transfer-Encoding"));
    }
    if f.content_lengths > 1 {
        return Err(GatewayError::BadRequest("more than one Content-Length"));
    }
    if f.hosts > 1 {
        return Err(GatewayError::BadRequest("more than one Host header"));
    }
    if f.hosts == 0 && req.version() == Version::HTTP_11 {
        return Err(GatewayError::BadRequest("HTTP/1.1 request without Host"));
    }
    match f.content_length {
        Some(Err(())) => Err(GatewayError::BadRequest("invalid Content-Length")),
        Some(Ok(len)) if len > max_body_bytes => Err(GatewayError::PayloadTooLarge),
        _ => Ok(()),
    }
}

/// A standard method spelled in another case (`post`, `Get`): the methods are case-sensitive
/// (RFC 9110 §9.1), and an upstream that upper-cases them (Django, Flask) would run the method
/// a `methods` condition names while the rule did not match.
fn method_case_variant(m: &http::Method) -> bool {
    const STANDARD: [&str; 9] = [
        "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH",
    ];
    let m = m.as_str();
    m.bytes().any(|b| b.is_ascii_lowercase()) && STANDARD.iter().any(|s| s.eq_ignore_ascii_case(m))
}

/// Most header fields a request may carry: hyper's own parser's default limit (a request with
/// more gets hyper's 431, made JSON by `http::parse_reply`); within it, and within twice
/// `max_header_bytes`, tollgate checks the limits itself and answers the 431 with a JSON body.
pub const MAX_HEADERS: usize = 100;

/// The header section within `server.max_header_bytes` and [`MAX_HEADERS`] fields.
fn headers_within<B>(req: &Request<B>, f: &Facts, max_bytes: usize) -> Result<(), GatewayError> {
    if f.fields > MAX_HEADERS {
        return Err(GatewayError::HeadersTooLarge);
    }
    let size = req.uri().path_and_query().map_or(1, |p| p.as_str().len()) + 16 + f.bytes;
    if size > max_bytes {
        return Err(GatewayError::HeadersTooLarge);
    }
    Ok(())
}

/// Refuse a request that spells a header tollgate reads (credentials, rule keys and
/// conditions, method overrides) with `_` for `-`: a CGI-style upstream reads the two as one
/// (see `rules::underscore_spelling`).
fn refuse_underscore_spellings(gw: &State, snap: &Snapshot, headers: &http::HeaderMap) -> Result<(), GatewayError> {
    let id = &gw.config().identity;
    let jwt = id.jwt.as_ref().map(|j| j.header());
    let mut reads: Vec<&http::HeaderName> = vec![&header::AUTHORIZATION, &id.api_key_header];
    reads.extend(jwt.as_ref());
    reads.extend(snap.rules.read_headers.iter());
    match crate::rules::underscore_spelling(headers, &reads) {
        Some(_) => Err(GatewayError::BadRequest(
            "a header name spells one tollgate reads with '_' for '-' (an upstream may read it as the other)",
        )),
        None => Ok(()),
    }
}
