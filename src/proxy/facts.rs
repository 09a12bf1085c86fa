//! What the request path needs to know about a request's header section, read in one pass.
//!
//! Validation, the request id, the body limit, the gRPC check and the forwarding step each
//! looked up their own fields: a dozen hash lookups per request, most of them for fields the
//! request does not have. [`Facts::of`] walks the fields once, matching each name by
//! its text (a length compare for most), and the steps read the facts.

use http::header::{self, HeaderMap, HeaderValue};
use http::Method;

use crate::http::{forward, request_id, respond};

/// The facts of one request's header section.
#[derive(Debug, Default, Clone)]
pub(super) struct Facts {
    /// Fields (a name with several values counts once per value).
    pub(super) fields: usize,
    /// Bytes of the names and values, with 4 per field for `: ` and the line end.
    pub(super) bytes: usize,
    /// `Host` fields, and the first one's value.
    pub(super) hosts: usize,
    /// See `hosts`.
    pub(super) host: Option<HeaderValue>,
    /// `Content-Length` fields.
    pub(super) content_lengths: usize,
    /// The first `Content-Length`, `Err` when it is not a number.
    pub(super) content_length: Option<Result<u64, ()>>,
    /// A `Transfer-Encoding` field is present.
    pub(super) transfer_encoding: bool,
    /// A `Transfer-Encoding` names a coding other than `chunked` (which tollgate cannot pass on
    /// without decoding it: a 501).
    pub(super) other_coding: bool,
    /// `Content-Type` says gRPC (`application/grpc`, `application/grpc+proto`, …).
    pub(super) grpc: bool,
    /// `X-Request-Id` fields, and whether the first one is an id worth keeping.
    pub(super) request_ids: usize,
    /// See `request_ids`.
    pub(super) request_id_valid: bool,
    /// `Connection` lists `upgrade`.
    pub(super) connection_upgrade: bool,
    /// `TE` lists `trailers`.
    pub(super) te_trailers: bool,
    /// Some field name has a `_` (see `rules::underscore_spelling`).
    pub(super) underscored: bool,
    /// The trace context is already in the headers (set for the access line).
    pub(super) traced: bool,
}

impl Facts {
    /// Read `h` once.
    pub(super) fn of(h: &HeaderMap) -> Facts {
        let mut f = Facts::default();
        for (name, value) in h {
            f.fields += 1;
            let name = name.as_str();
            f.underscored |= name.as_bytes().contains(&b'_');
            f.bytes += name.len() + value.len() + 4;
            match name {
                "host" => {
                    if f.hosts == 0 {
                        f.host = Some(value.clone());
                    }
                    f.hosts += 1;
                }
                "content-length" => {
                    if f.content_lengths == 0 {
                        // Digits only (hyper's own parser refuses anything else).
                        f.content_length = Some(digits(value).ok_or(()));
                    }
                    f.content_lengths += 1;
                }
                "transfer-encoding" => {
                    f.transfer_encoding = true;
                    f.other_coding |= value
                        .as_bytes()
                        .split(|&b| b == b',')
                        .any(|c| !c.trim_ascii().eq_ignore_ascii_case(b"chunked"));
                }
                "content-type" => f.grpc |= respond::is_grpc(value),
                "x-request-id" => {
                    if f.request_ids == 0 {
                        f.request_id_valid = request_id::is_valid(value);
                    }
                    f.request_ids += 1;
                }
                "connection" => f.connection_upgrade |= forward::lists(value, "upgrade"),
                "te" => f.te_trailers |= forward::lists(value, "trailers"),
                _ => {}
            }
        }
        f
    }
}

/// The request body's length as [`crate::rt::idle::IdleIo`] follows it: `0` for none, `n`
/// for `Content-Length: n`; `None` for chunked bodies, upgrades, `CONNECT` and anything odd (the
/// connection is then never parked). One pass over the fields, like [`Facts::of`] (which runs
/// later, inside the request's future: carrying its facts from here cost more in moves).
pub(crate) fn framing(method: &Method, h: &HeaderMap) -> Option<u64> {
    if method == Method::CONNECT {
        return None;
    }
    let mut length = None;
    for (name, value) in h {
        match name.as_str() {
            "upgrade" | "transfer-encoding" => return None,
            "content-length" if length.is_some() => return None,
            "content-length" => length = Some(digits(value)?),
            _ => {}
        }
    }
    Some(length.unwrap_or(0))
}

/// A `Content-Length` value: digits only (hyper's own parser refuses anything else).
fn digits(v: &HeaderValue) -> Option<u64> {
    std::str::from_utf8(v.as_bytes())
        .ok()
        .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|s| s.parse::<u64>().ok())
}

/// `X-Request-Id` as [`Facts`] saw it: the request's own id when it sent exactly one valid one
/// (kept), otherwise a new one written into `h`; the field is not looked up when the request has
/// none.
pub(super) fn ensure_request_id(h: &mut HeaderMap, f: &Facts) -> HeaderValue {
    if f.request_ids == 1 && f.request_id_valid {
        if let Some(v) = h.get(&request_id::X_REQUEST_ID) {
            let mut v = v.clone();
            v.set_sensitive(true);
            return v;
        }
    }
    let id = request_id::generate();
    h.insert(request_id::X_REQUEST_ID.clone(), id.clone());
    id
}

/// The `Upgrade` value of an HTTP/1.1 upgrade request (`Connection: upgrade` and `Upgrade`).
pub(super) fn upgrade_of(h: &HeaderMap, f: &Facts) -> Option<HeaderValue> {
    if f.connection_upgrade {
        h.get(header::UPGRADE).cloned()
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(fields: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in fields {
            h.append(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn one_pass_finds_what_the_lookups_did() {
        let h = map(&[
            ("host", "api.example"),
            ("host", "other"),
            ("content-length", "12"),
            ("content-length", "12"),
            ("content-type", "application/grpc+proto"),
            ("connection", "keep-alive, Upgrade"),
            ("upgrade", "websocket"),
            ("te", "trailers"),
            ("x-request-id", "abc-1"),
            ("x-other", "1"),
        ]);
        let f = Facts::of(&h);
        assert_eq!((f.fields, f.hosts, f.content_lengths), (10, 2, 2));
        assert_eq!(f.host.as_ref().map(|v| v.as_bytes()), Some(&b"api.example"[..]));
        assert_eq!(f.content_length, Some(Ok(12)));
        assert!(f.grpc && f.connection_upgrade && f.te_trailers && !f.transfer_encoding);
        assert_eq!((f.request_ids, f.request_id_valid), (1, true));
        let size: usize = h.iter().map(|(k, v)| k.as_str().len() + v.len() + 4).sum();
        assert_eq!(f.bytes, size);
        assert_eq!(
            upgrade_of(&h, &f).as_ref().map(|v| v.as_bytes()),
            Some(&b"websocket"[..])
        );

        let h = map(&[
            ("content-length", "x1"),
            ("transfer-encoding", "chunked"),
            ("te", "gzip"),
        ]);
        let f = Facts::of(&h);
        assert_eq!(f.content_length, Some(Err(())));
        assert!(f.transfer_encoding && !f.other_coding && !f.te_trailers && !f.grpc && !f.connection_upgrade);
        assert!(Facts::of(&map(&[("transfer-encoding", "gzip, chunked")])).other_coding);
        assert!(Facts::of(&map(&[("transfer-encoding", "Chunked")])).transfer_encoding);
        assert!(!Facts::of(&map(&[("transfer-encoding", "Chunked")])).other_coding);
        assert!(upgrade_of(&h, &f).is_none());
    }

    #[test]
    fn the_framing_follows_only_what_idle_parking_can_delimit() {
        let framing = |method: Method, fields: &[(&'static str, &'static str)]| framing(&method, &map(fields));
        assert_eq!(framing(Method::GET, &[]), Some(0));
        assert_eq!(framing(Method::POST, &[("content-length", "12")]), Some(12));
        assert_eq!(framing(Method::POST, &[("content-length", "+12")]), None);
        assert_eq!(
            framing(Method::POST, &[("content-length", "1"), ("content-length", "1")]),
            None
        );
        assert_eq!(framing(Method::POST, &[("transfer-encoding", "chunked")]), None);
        assert_eq!(framing(Method::GET, &[("upgrade", "websocket")]), None);
        assert_eq!(framing(Method::CONNECT, &[]), None);
    }

    #[test]
    fn the_request_id_is_kept_only_when_it_is_one_valid_id() {
        for (fields, kept) in [
            (&[("x-request-id", "abc-123")][..], true),
            (&[("x-request-id", "has space")][..], false),
            (&[("x-request-id", "a"), ("x-request-id", "b")][..], false),
            (&[][..], false),
        ] {
            let mut h = map(fields);
            let f = Facts::of(&h);
            let id = ensure_request_id(&mut h, &f);
            assert!(id.is_sensitive());
            if kept {
                assert_eq!(id, "abc-123");
            } else {
                assert_eq!(id.len(), 32, "{fields:?}");
                assert_eq!(h.get_all(&request_id::X_REQUEST_ID).iter().count(), 1);
                assert_eq!(h[&request_id::X_REQUEST_ID], id);
            }
        }
    }

    /// The request path's id step, as `handle` runs it: the facts first, then the id.
    fn ensure(h: &mut HeaderMap) -> HeaderValue {
        let f = Facts::of(h);
        ensure_request_id(h, &f)
    }

    #[test]
    fn a_valid_id_is_kept_and_a_bad_one_replaced() {
        let mut h = HeaderMap::new();
        h.insert(request_id::X_REQUEST_ID.clone(), HeaderValue::from_static("abc-123"));
        let kept = ensure(&mut h);
        assert_eq!(kept, "abc-123");
        assert!(kept.is_sensitive(), "a kept id is never HPACK-indexed either");
        let mut h = HeaderMap::new();
        h.insert(request_id::X_REQUEST_ID.clone(), HeaderValue::from_static("has space"));
        let id = ensure(&mut h);
        assert_eq!(id.len(), 32);
        assert_eq!(h.get(&request_id::X_REQUEST_ID), Some(&id));
        let long = "a".repeat(request_id::MAX_LEN + 1);
        let mut h = HeaderMap::new();
        h.insert(request_id::X_REQUEST_ID.clone(), HeaderValue::from_str(&long).unwrap()); // allow-panic: test
        assert_ne!(ensure(&mut h), long.as_str());
        let mut h = HeaderMap::new();
        assert_eq!(ensure(&mut h).len(), 32);
    }
}
