//! Forwarding helpers: hop-by-hop header removal (RFC 9110 §7.6.1, including the headers named
//! in `Connection`), `X-Forwarded-*` and `Forwarded`, and the upstream URI.

use std::net::IpAddr;

use crate::rt::value_buf::ValueBuf;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::{PathAndQuery, Uri};

/// The hop-by-hop headers every proxy removes, and last `Upgrade` (hop-by-hop unless an upgrade
/// passes through): [`hop_index`] numbers them in this order.
static HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// The index of `k` in [`HOP_BY_HOP`]. A `match` on the name's text: most names differ in
/// length from all nine, so a field costs a length compare, not nine name compares.
fn hop_index(k: &HeaderName) -> Option<usize> {
    Some(match k.as_str() {
        "connection" => 0,
        "keep-alive" => 1,
        "proxy-connection" => 2,
        "proxy-authenticate" => 3,
        "proxy-authorization" => 4,
        "te" => 5,
        "trailer" => 6,
        "transfer-encoding" => 7,
        "upgrade" => 8,
        _ => return None,
    })
}

/// `X-Forwarded-For`.
pub static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
/// `X-Forwarded-Proto`.
pub static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
/// `X-Forwarded-Host`.
pub static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
/// `Forwarded`.
pub static FORWARDED: HeaderName = HeaderName::from_static("forwarded");

/// Does the comma-separated list value `v` hold `token`, compared without regard to case
/// (`Connection: keep-alive, Upgrade`, `TE: trailers`)?
pub fn lists(v: &HeaderValue, token: &str) -> bool {
    connection_tokens(v).any(|t| t.eq_ignore_ascii_case(token))
}

/// Remove hop-by-hop headers, and every header named in `Connection`. With `keep_upgrade`,
/// `Connection: upgrade` and `Upgrade` are re-added (an upgrade passes through).
pub fn strip_hop_by_hop(h: &mut HeaderMap, keep_upgrade: Option<HeaderValue>) {
    // One pass over the fields; most requests (and many responses) have nothing to remove, and
    // a `Connection` that says only `keep-alive` or `close` (an upstream's usual answer) names no
    // other header, so it is read here rather than looked up again.
    let mut present = 0u16;
    let mut names_others = false;
    for (k, v) in h.iter() {
        if let Some(i) = hop_index(k) {
            if i == 0 && !names_others {
                names_others = connection_tokens(v).any(|t| !is_connection_option(t));
            }
            present |= 1 << i;
        }
    }
    if names_others {
        // Headers named in `Connection` are hop-by-hop too (RFC 9110 §7.6.1).
        let named: Vec<HeaderName> = h
            .get_all(header::CONNECTION)
            .iter()
            .flat_map(connection_tokens)
            .filter(|t| !is_connection_option(t))
            .filter_map(|t| HeaderName::from_bytes(t.as_bytes()).ok())
            .collect();
        for name in named {
            h.remove(name);
        }
    }
    for (i, hop) in HOP_BY_HOP.iter().enumerate() {
        if present & (1 << i) != 0 {
            h.remove(hop);
        }
    }
    if let Some(up) = keep_upgrade {
        h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        h.insert(header::UPGRADE, up);
    }
}

/// The comma-separated tokens of one list value such as `Connection`'s (none when it is not
/// visible ASCII).
fn connection_tokens(v: &HeaderValue) -> impl Iterator<Item = &str> {
    v.to_str().ok().into_iter().flat_map(|v| v.split(',')).map(str::trim)
}

/// `close` and `keep-alive`: `Connection` options that name no header.
fn is_connection_option(t: &str) -> bool {
    t.is_empty() || t.eq_ignore_ascii_case("close") || t.eq_ignore_ascii_case("keep-alive")
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
    let ip = ip.as_bytes();
    // Which of the four a client (or a proxy before us) sent: one pass over the names, as a
    // request seldom carries any, so each is then inserted without being looked up first.
    let mut had = [false; 4];
    for k in h.keys() {
        if let Some(i) = FORWARDING.iter().position(|n| *n == k) {
            had[i] = true;
        }
    }
    let mut buf = ValueBuf::new();
    append_list(h, had[0], &X_FORWARDED_FOR, ip, &mut buf);
    if had[1] {
        append_list(h, true, &X_FORWARDED_PROTO, proto.as_bytes(), &mut buf);
    } else {
        h.insert(X_FORWARDED_PROTO.clone(), HeaderValue::from_static(proto));
    }
    if let Some(host) = host {
        if !had[2] {
            h.insert(X_FORWARDED_HOST.clone(), host.clone());
        } else if host.to_str().is_ok() {
            append_list(h, true, &X_FORWARDED_HOST, host.as_bytes(), &mut buf);
        }
    }
    // `Forwarded`: the earlier hops, then this one, written piece by piece (`write!` would run
    // `core::fmt`, the costliest step of this function when it did).
    if had[3] {
        join_existing(h, &FORWARDED, &mut buf);
    }
    let pieces: [&[u8]; 3] = if peer.is_ipv6() {
        [b"for=\"[", ip, b"]\";proto="]
    } else {
        [b"for=", ip, b";proto="]
    };
    for p in pieces.into_iter().chain([proto.as_bytes()]) {
        buf.put(p);
    }
    if let Some(host) = host.map(HeaderValue::as_bytes) {
        if host.iter().all(|&b| b.is_ascii_graphic() && b != b'"' && b != b'\\') {
            for p in [&b";host=\""[..], host, b"\""] {
                buf.put(p);
            }
        }
    }
    buf.end(&FORWARDED);
    let _ = buf.finish(h);
}

/// The four forwarding headers, in the order [`add_forwarded_proto`] looks for them.
static FORWARDING: [&HeaderName; 4] = [&X_FORWARDED_FOR, &X_FORWARDED_PROTO, &X_FORWARDED_HOST, &FORWARDED];

/// Write `name`'s existing values (when `had`), then `item`, as one comma-separated value of
/// `name` into `buf` (it replaces them when `buf` is finished).
fn append_list(h: &HeaderMap, had: bool, name: &'static HeaderName, item: &[u8], buf: &mut ValueBuf) {
    if had {
        join_existing(h, name, buf);
    }
    buf.put(item);
    buf.end(name);
}

/// Write every existing value of `name`, each followed by `, `, into `buf`. Values that are not
/// visible ASCII (obs-text) are dropped, and so are empty ones: the joined header must stay a
/// readable list without empty members that ends with this hop.
fn join_existing(h: &HeaderMap, name: &HeaderName, buf: &mut ValueBuf) {
    for v in h.get_all(name).iter().filter(|v| !v.is_empty() && v.to_str().is_ok()) {
        buf.put(v.as_bytes());
        buf.put(b", ");
    }
}

/// The origin-form request target (`/path?query`) sent to the upstream.
pub fn origin_form(pq: Option<&PathAndQuery>) -> Uri {
    match pq {
        // An absolute-form target with an empty path (`http://h`, `http://h?q`, or a fragment
        // the parser dropped: `http://h#/x`) is `/` (RFC 9112 §3.2.2), never an empty target.
        // `as_str` reads `/` for an empty path too, which would still be written as an empty
        // target: `/` is made afresh (static, no allocation).
        Some(p) if p.as_str() == "/" => Uri::from_static("/"),
        Some(p) if p.as_str().starts_with('/') || p.as_str() == "*" => Uri::from(p.clone()),
        Some(p) => format!("/{}", p.as_str())
            .parse::<PathAndQuery>()
            .map_or_else(|_| Uri::from_static("/"), Uri::from),
        None => Uri::from_static("/"),
    }
}

/// Every protocol an `Upgrade` value offers (`websocket`, `h2c`, `foo/2`: by name, without its
/// version, any case) is in `allowed` (lower case).
pub fn upgrade_allowed(v: &HeaderValue, allowed: &[String]) -> bool {
    let mut any = false;
    for p in v.as_bytes().split(|&b| b == b',') {
        let p = p.trim_ascii();
        let name = p.split(|&b| b == b'/').next().unwrap_or(p);
        if name.is_empty() {
            continue;
        }
        any = true;
        if !allowed.iter().any(|a| a.as_bytes().eq_ignore_ascii_case(name)) {
            return false;
        }
    }
    any
}

#[cfg(test)]
mod tests;
