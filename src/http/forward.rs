//! Forwarding helpers: hop-by-hop header removal (RFC 9110 §7.6.1, including the headers named
//! in `Connection`), `X-Forwarded-*` and `Forwarded`, and the upstream URI.

use std::net::IpAddr;

use std::fmt::Write;

use super::value_buf::{Text, ValueBuf};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::{PathAndQuery, Uri};

/// The hop-by-hop headers every proxy removes.
static HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
];

/// `Upgrade` (hop-by-hop unless an upgrade passes through).
static UPGRADE: HeaderName = header::UPGRADE;

/// `X-Forwarded-For`.
pub static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
/// `X-Forwarded-Proto`.
pub static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
/// `X-Forwarded-Host`.
pub static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
/// `Forwarded`.
pub static FORWARDED: HeaderName = HeaderName::from_static("forwarded");

/// Does the comma-separated list header `name` (every field of it) hold `token`, compared
/// without regard to case (`Connection: keep-alive, Upgrade`, `TE: trailers`)?
pub fn lists_token(h: &HeaderMap, name: &HeaderName, token: &str) -> bool {
    h.get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case(token))
}

/// Is this an HTTP/1.1 upgrade request (`Connection: upgrade` + `Upgrade`)? Returns the
/// `Upgrade` value to keep.
pub fn upgrade_of(h: &HeaderMap) -> Option<HeaderValue> {
    if lists_token(h, &header::CONNECTION, "upgrade") {
        h.get(header::UPGRADE).cloned()
    } else {
        None
    }
}

/// Remove hop-by-hop headers, and every header named in `Connection`. With `keep_upgrade`,
/// `Connection: upgrade` and `Upgrade` are re-added (an upgrade passes through).
pub fn strip_hop_by_hop(h: &mut HeaderMap, keep_upgrade: Option<HeaderValue>) {
    // One pass over the names; most requests (and many responses) have nothing to remove.
    let mut present: [Option<&'static HeaderName>; 9] = [None; 9];
    let mut n = 0;
    for k in h.keys() {
        if let Some(hop) = HOP_BY_HOP.iter().chain(std::iter::once(&UPGRADE)).find(|x| *x == k) {
            if n < present.len() && !present[..n].contains(&Some(hop)) {
                present[n] = Some(hop);
                n += 1;
            }
        }
    }
    if n > 0 {
        // Headers named in `Connection` are hop-by-hop too (RFC 9110 §7.6.1).
        let named: Vec<HeaderName> = h
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .filter(|t| !t.eq_ignore_ascii_case("close") && !t.eq_ignore_ascii_case("keep-alive"))
            .filter_map(|t| HeaderName::from_bytes(t.as_bytes()).ok())
            .collect();
        for name in named {
            h.remove(name);
        }
        for hop in present[..n].iter().flatten() {
            h.remove(*hop);
        }
    }
    if let Some(up) = keep_upgrade {
        h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        h.insert(header::UPGRADE, up);
    }
}

/// Append this hop to `X-Forwarded-For`, `-Proto`, `-Host` and `Forwarded`, for a client that
/// spoke plain HTTP. The new values are cut from one buffer.
pub fn add_forwarded(h: &mut HeaderMap, peer: IpAddr, host: Option<&HeaderValue>) {
    add_forwarded_proto(h, peer, host, false)
}

/// [`add_forwarded`], with `proto=https` when the client spoke TLS.
pub fn add_forwarded_proto(h: &mut HeaderMap, peer: IpAddr, host: Option<&HeaderValue>, https: bool) {
    let proto = if https { "https" } else { "http" };
    let peer = peer.to_canonical();
    let ip = crate::identity::ip_text(peer);
    let ip = ip.as_str();
    let mut buf: ValueBuf = ValueBuf::new();
    append_list(h, &X_FORWARDED_FOR, ip.as_bytes(), &mut buf);
    append_static(h, &X_FORWARDED_PROTO, proto, &mut buf);
    if let Some(host) = host {
        append_value(h, &X_FORWARDED_HOST, host, &mut buf);
    }
    // Pieces appended one by one: `write!` would run `core::fmt` (≈ 1k instructions a call).
    let mut fwd = Text::<128>::new();
    let pieces: [&str; 3] = if peer.is_ipv6() {
        ["for=\"[", ip, "]\";proto="]
    } else {
        ["for=", ip, ";proto="]
    };
    for p in pieces.into_iter().chain([proto]) {
        let _ = fwd.write_str(p);
    }
    if let Some(host) = host.and_then(|v| v.to_str().ok()) {
        if host.bytes().all(|b| b.is_ascii_graphic() && b != b'"' && b != b'\\') {
            for p in [";host=\"", host, "\""] {
                let _ = fwd.write_str(p);
            }
        }
    }
    append_list(h, &FORWARDED, fwd.as_str().as_bytes(), &mut buf);
    let _ = buf.finish(h);
}

/// [`append_list`] for a static item: no allocation when the header is absent.
fn append_static(h: &mut HeaderMap, name: &HeaderName, item: &'static str, buf: &mut ValueBuf) {
    if h.contains_key(name) {
        append_list(h, name, item.as_bytes(), buf);
    } else {
        h.insert(name.clone(), HeaderValue::from_static(item));
    }
}

/// [`append_list`] for a header value: shared, not copied, when the header is absent.
fn append_value(h: &mut HeaderMap, name: &HeaderName, item: &HeaderValue, buf: &mut ValueBuf) {
    if h.contains_key(name) {
        if item.to_str().is_ok() {
            append_list(h, name, item.as_bytes(), buf);
        }
    } else {
        h.insert(name.clone(), item.clone());
    }
}

/// Join every existing value of `name` and `item` into one comma-separated value of `name`,
/// written into `buf` (it replaces them when `buf` is finished).
fn append_list(h: &HeaderMap, name: &HeaderName, item: &[u8], buf: &mut ValueBuf) {
    // Values that are not visible ASCII (obs-text) are dropped: the joined header must stay
    // readable text that ends with this hop.
    for v in h.get_all(name).iter().filter(|v| v.to_str().is_ok()) {
        if buf.current_len() > 0 {
            buf.put(b", ");
        }
        buf.put(v.as_bytes());
    }
    if buf.current_len() > 0 {
        buf.put(b", ");
    }
    buf.put(item);
    buf.end(name.clone());
}

/// The origin-form request target (`/path?query`) sent to the upstream.
pub fn origin_form(pq: Option<&PathAndQuery>) -> Uri {
    Uri::from(pq.cloned().unwrap_or_else(|| PathAndQuery::from_static("/")))
}

#[cfg(test)]
mod tests;
