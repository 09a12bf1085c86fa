//! W3C Trace Context (`traceparent`, `tracestate`): every request tollgate forwards carries a
//! `traceparent` naming tollgate's own span as its parent, so an upstream's spans join the
//! caller's trace, and the access line carries the trace id.
//!
//! - A valid incoming `traceparent` (version `00`, a non-zero 32-hex-digit trace id and
//!   16-hex-digit parent id, two hex digits of flags; exactly one such field) keeps its trace id
//!   and flags; its parent id becomes tollgate's span's parent.
//! - Otherwise (absent, malformed, repeated, or of a version this module does not know) a new
//!   trace starts at the gateway, and an incoming `tracestate` is dropped with it: it
//!   describes a trace this request no longer belongs to (W3C Trace Context §3.3).
//! - `tracestate` of a kept trace is forwarded untouched.
//!
//! Ids come from [`request_id::random_u64`]-seeded counters mixed like request ids: no system
//! call per request. The one allocation per request is the forwarded `traceparent` value.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use http::{HeaderMap, HeaderName, HeaderValue};

use super::request_id;

/// `traceparent`.
pub static TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
/// `tracestate`.
pub static TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

/// The trace context of one request as it leaves tollgate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceContext {
    /// The trace id, 16 bytes, never all zero.
    pub trace_id: [u8; 16],
    /// Tollgate's span for this request, 8 bytes, never all zero.
    pub span_id: [u8; 8],
    /// The span that called tollgate, when the request carried a valid `traceparent`.
    pub parent_id: Option<[u8; 8]>,
    /// The trace flags (bit 0: sampled).
    pub flags: u8,
}

impl TraceContext {
    /// The trace id as 32 lowercase hex digits (for the access line).
    pub fn trace_id_hex(&self) -> [u8; 32] {
        let mut out = [0u8; 32];
        hex_into(&self.trace_id, &mut out);
        out
    }

    /// `00-<trace id>-<span id>-<flags>`: the `traceparent` tollgate sends upstream.
    pub fn traceparent(&self) -> HeaderValue {
        let mut b = [0u8; 55];
        b[..3].copy_from_slice(b"00-");
        hex_into(&self.trace_id, &mut b[3..35]);
        b[35] = b'-';
        hex_into(&self.span_id, &mut b[36..52]);
        b[52] = b'-';
        hex_into(&[self.flags], &mut b[53..55]);
        HeaderValue::from_maybe_shared(bytes::Bytes::copy_from_slice(&b)).unwrap_or(HeaderValue::from_static(
            "00-00000000000000000000000000000000-0000000000000000-00",
        ))
    }
}

/// Parse one `traceparent` value (version `00` exactly, RFC-shaped): trace id, parent id,
/// flags. `None` for anything else.
pub fn parse(v: &[u8]) -> Option<([u8; 16], [u8; 8], u8)> {
    if v.len() != 55 || &v[..3] != b"00-" || v[35] != b'-' || v[52] != b'-' {
        return None;
    }
    let mut trace = [0u8; 16];
    let mut parent = [0u8; 8];
    let mut flags = [0u8; 1];
    unhex(&v[3..35], &mut trace)?;
    unhex(&v[36..52], &mut parent)?;
    unhex(&v[53..55], &mut flags)?;
    if trace == [0; 16] || parent == [0; 8] {
        return None;
    }
    Some((trace, parent, flags[0]))
}

/// Continue or start the request's trace, and set the `traceparent` it goes upstream with
/// (dropping a `tracestate` that belonged to a refused `traceparent`). `sampled` sets the
/// sampled flag of a trace started here.
pub fn ensure(h: &mut HeaderMap, sampled: bool) -> TraceContext {
    let mut incoming = h.get_all(&TRACEPARENT).iter();
    let kept = match (incoming.next(), incoming.next()) {
        (Some(v), None) => parse(v.as_bytes()),
        _ => None,
    };
    let ctx = match kept {
        Some((trace_id, parent, flags)) => TraceContext {
            trace_id,
            span_id: new_span_id(),
            parent_id: Some(parent),
            flags,
        },
        None => {
            h.remove(&TRACESTATE);
            TraceContext {
                trace_id: new_trace_id(),
                span_id: new_span_id(),
                parent_id: None,
                flags: u8::from(sampled),
            }
        }
    };
    h.insert(TRACEPARENT.clone(), ctx.traceparent());
    ctx
}

/// The per-process key and counter ids are mixed from.
fn ids() -> &'static (u64, AtomicU64) {
    static G: OnceLock<(u64, AtomicU64)> = OnceLock::new();
    G.get_or_init(|| (request_id::random_u64(), AtomicU64::new(request_id::random_u64())))
}

/// A bijection on u64 (splitmix64's finaliser): distinct counters give distinct ids.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A new 64-bit id, never 0.
fn next_id() -> u64 {
    let (key, n) = ids();
    mix(n.fetch_add(1, Ordering::Relaxed) ^ key).max(1)
}

fn new_span_id() -> [u8; 8] {
    next_id().to_be_bytes()
}

fn new_trace_id() -> [u8; 16] {
    let mut t = [0u8; 16];
    t[..8].copy_from_slice(&next_id().to_be_bytes());
    t[8..].copy_from_slice(&next_id().to_be_bytes());
    t
}

fn hex_into(src: &[u8], out: &mut [u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for (i, b) in src.iter().enumerate() {
        out[2 * i] = HEX[usize::from(b >> 4)];
        out[2 * i + 1] = HEX[usize::from(b & 0xf)];
    }
}

/// Lowercase hex only, as W3C Trace Context requires.
fn unhex(src: &[u8], out: &mut [u8]) -> Option<()> {
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    for (i, o) in out.iter_mut().enumerate() {
        *o = (digit(*src.get(2 * i)?)? << 4) | digit(*src.get(2 * i + 1)?)?;
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_traceparent_keeps_its_trace_and_flags_with_a_new_parent() {
        let mut h = HeaderMap::new();
        h.insert(&TRACEPARENT, HeaderValue::from_static(VALID));
        h.insert(&TRACESTATE, HeaderValue::from_static("congo=t61rcWkgMzE"));
        let ctx = ensure(&mut h, false);
        assert_eq!(&ctx.trace_id_hex(), b"4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(ctx.parent_id, Some([0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7]));
        assert_eq!(ctx.flags, 1);
        let sent = h[&TRACEPARENT].to_str().unwrap_or_default().to_owned();
        assert!(sent.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"), "{sent}");
        assert!(sent.ends_with("-01"));
        assert_ne!(
            &sent[36..52],
            "00f067aa0ba902b7",
            "tollgate's own span is the parent upstream"
        );
        assert_eq!(parse(sent.as_bytes()).map(|p| p.1), Some(ctx.span_id));
        assert_eq!(
            h[&TRACESTATE], "congo=t61rcWkgMzE",
            "tracestate of a kept trace is forwarded"
        );
    }

    #[test]
    fn a_bad_or_missing_traceparent_starts_a_new_trace_and_drops_tracestate() {
        for bad in [
            None,
            Some("00-00000000000000000000000000000000-00f067aa0ba902b7-01"),
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01"),
            Some("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01"),
            Some("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7"),
            Some("garbage"),
        ] {
            let mut h = HeaderMap::new();
            if let Some(b) = bad {
                h.insert(&TRACEPARENT, HeaderValue::from_static(b));
            }
            h.insert(&TRACESTATE, HeaderValue::from_static("congo=t61rcWkgMzE"));
            let ctx = ensure(&mut h, true);
            assert_eq!(ctx.parent_id, None, "{bad:?}");
            assert_ne!(&ctx.trace_id_hex(), b"4bf92f3577b34da6a3ce929d0e0e4736", "{bad:?}");
            assert_eq!(ctx.flags, 1);
            assert!(h.get(&TRACESTATE).is_none(), "{bad:?}");
            let sent = parse(h[&TRACEPARENT].as_bytes());
            assert_eq!(sent, Some((ctx.trace_id, ctx.span_id, 1)), "{bad:?}");
        }
    }

    #[test]
    fn two_traceparent_fields_start_a_new_trace() {
        let mut h = HeaderMap::new();
        h.append(&TRACEPARENT, HeaderValue::from_static(VALID));
        h.append(&TRACEPARENT, HeaderValue::from_static(VALID));
        let ctx = ensure(&mut h, false);
        assert_eq!(ctx.parent_id, None);
        assert_eq!(h.get_all(&TRACEPARENT).iter().count(), 1);
    }

    #[test]
    fn new_ids_are_distinct() {
        let mut seen = std::collections::HashSet::new();
        for _ in 0..10_000 {
            assert!(seen.insert(new_trace_id()));
        }
    }
}
