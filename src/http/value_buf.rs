//! Header values written on the stack and shared from one allocation (issue #15).
//!
//! A `BytesMut` that values are split from costs two allocations (its buffer, then the shared
//! header `split` promotes it to), and a `String` per value costs one each. [`ValueBuf`]
//! writes every value of one step (the rate-limit headers of a response, the forwarding headers
//! of a request) into an inline array, and [`ValueBuf::finish`] moves it into a single
//! `Bytes` (`Bytes::from_owner`: one allocation) that every value points into. Text past the
//! inline room spills to the heap, still correct.

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use smallvec::SmallVec;

/// Inline room: more than the rate-limit or forwarding headers of a request take with rule
/// names and hosts of the usual length.
const INLINE: usize = 320;

/// Text written on the stack (up to `N` bytes inline), readable as `&str`.
#[derive(Default)]
pub struct Text<const N: usize>(SmallVec<[u8; N]>);

impl<const N: usize> Text<N> {
    /// Empty.
    pub fn new() -> Self {
        Text(SmallVec::new())
    }

    /// What was written (always UTF-8: only `&str` is ever appended).
    pub fn as_str(&self) -> &str {
        std::str::from_utf8(&self.0).unwrap_or_default()
    }
}

impl<const N: usize> AsRef<[u8]> for Text<N> {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl<const N: usize> std::fmt::Write for Text<N> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.0.extend_from_slice(s.as_bytes());
        Ok(())
    }
}

/// Values being written for one header map: see the module documentation. `N` bytes of text
/// fit inline; more spill to the heap (still correct, one allocation more).
pub struct ValueBuf<const N: usize = INLINE> {
    /// Every value's text, one after the other, while it fits.
    inline: [u8; N],
    /// Bytes written so far.
    len: usize,
    /// All the text once it outgrew `inline` (empty until then).
    spill: Vec<u8>,
    /// Each value: its header and the range of its text.
    values: SmallVec<[(HeaderName, usize, usize); 6]>,
    /// The range of the body, when one was written ([`ValueBuf::end_body`]).
    body: Option<(usize, usize)>,
}

impl<const N: usize> Default for ValueBuf<N> {
    fn default() -> Self {
        ValueBuf {
            inline: [0; N],
            len: 0,
            spill: Vec::new(),
            values: SmallVec::new(),
            body: None,
        }
    }
}

impl<const N: usize> ValueBuf<N> {
    /// Empty.
    pub fn new() -> Self {
        Self::default()
    }

    /// Append `b` to the value being written. A bounds check and a copy while the text fits
    /// inline (a `SmallVec` insert costs two library calls per append).
    pub fn put(&mut self, b: &[u8]) {
        let end = self.len + b.len();
        match self.inline.get_mut(self.len..end) {
            Some(room) if self.spill.is_empty() => room.copy_from_slice(b),
            _ => {
                if self.spill.is_empty() {
                    self.spill.reserve(end.max(2 * N));
                    self.spill.extend_from_slice(&self.inline[..self.len]);
                }
                self.spill.extend_from_slice(b);
            }
        }
        self.len = end;
    }

    /// Where the value being written starts.
    fn start(&self) -> usize {
        let v = self.values.last().map_or(0, |(_, _, end)| *end);
        self.body.map_or(v, |(_, end)| v.max(end))
    }

    /// Bytes of the value being written so far.
    pub fn current_len(&self) -> usize {
        self.len - self.start()
    }

    /// The value written since the last `end` is header `name`'s.
    pub fn end(&mut self, name: HeaderName) {
        self.values.push((name, self.start(), self.len));
    }

    /// The text written since the last `end` is the body [`ValueBuf::finish`] returns.
    pub fn end_body(&mut self) {
        self.body = Some((self.start(), self.len));
    }

    /// Insert every value into `h` (each replacing what `h` had for its header), marked never
    /// to be HPACK-indexed; a value that is not a valid header value is left out. Returns the
    /// body, if one was written: it shares the values' allocation.
    pub fn finish(self, h: &mut HeaderMap) -> Option<Bytes> {
        if self.values.is_empty() && self.body.is_none() {
            return None;
        }
        h.reserve(self.values.len());
        let all = if self.spill.is_empty() {
            let mut all = Bytes::from_owner(self.inline);
            all.truncate(self.len);
            all
        } else {
            Bytes::from_owner(self.spill)
        };
        for (name, start, end) in self.values {
            if let Ok(mut v) = HeaderValue::from_maybe_shared(all.slice(start..end)) {
                // Never indexed by HTTP/2's HPACK: an indexed value would keep this whole
                // buffer alive in the connection's header table for the connection's life
                // (most of these values differ from one message to the next anyway).
                v.set_sensitive(true);
                h.insert(name, v);
            }
        }
        self.body.map(|(a, b)| all.slice(a..b))
    }
}

impl<const N: usize> std::fmt::Write for ValueBuf<N> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.put(s.as_bytes());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fmt::Write;

    #[test]
    fn values_share_one_buffer_and_land_under_their_headers() {
        let mut b = ValueBuf::<INLINE>::new();
        b.put(b"\"api\";q=10");
        b.end(HeaderName::from_static("ratelimit-policy"));
        write!(b, "{}", 42).unwrap(); // allow-panic: test
        assert_eq!(b.current_len(), 2);
        b.end(HeaderName::from_static("x-count"));
        b.put(b"bad\nvalue");
        b.end(HeaderName::from_static("x-bad"));
        let mut h = HeaderMap::new();
        h.insert("x-count", HeaderValue::from_static("old"));
        b.finish(&mut h);
        assert_eq!(h["ratelimit-policy"], "\"api\";q=10");
        assert_eq!(h["x-count"], "42");
        assert_eq!(h.get_all("x-count").iter().count(), 1, "replaced, not appended");
        assert!(!h.contains_key("x-bad"), "an invalid value is left out");
        assert!(
            h["ratelimit-policy"].is_sensitive() && h["x-count"].is_sensitive(),
            "never HPACK-indexed: an indexed value would pin the shared buffer"
        );
        assert!(!HeaderValue::from_static("old").is_sensitive());
    }

    #[test]
    fn a_body_shares_the_buffer_between_values() {
        let mut b = ValueBuf::<16>::new();
        b.put(b"7");
        b.end(HeaderName::from_static("retry-after"));
        b.put(b"{\"error\":\"rate_limit_exceeded\"}");
        b.end_body();
        b.end(HeaderName::from_static("x-empty"));
        b.put(b"1");
        b.end(HeaderName::from_static("x-one"));
        let mut h = HeaderMap::new();
        let body = b.finish(&mut h);
        assert_eq!(
            body.as_deref(),
            Some(&b"{\"error\":\"rate_limit_exceeded\"}"[..]),
            "spilled past 16 bytes"
        );
        assert_eq!(h["retry-after"], "7");
        assert_eq!(h["x-empty"], "");
        assert_eq!(h["x-one"], "1");
    }

    #[test]
    fn text_past_the_inline_room_still_comes_out_whole() {
        let mut b = ValueBuf::<INLINE>::new();
        let long = "r".repeat(3 * INLINE);
        b.put(long.as_bytes());
        b.end(HeaderName::from_static("x-long"));
        let mut h = HeaderMap::new();
        b.finish(&mut h);
        assert_eq!(h["x-long"].as_bytes(), long.as_bytes());

        let mut t = Text::<8>::new();
        write!(t, "2001:db8::{}", 1).unwrap(); // allow-panic: test
        assert_eq!(t.as_str(), "2001:db8::1");
    }
}
