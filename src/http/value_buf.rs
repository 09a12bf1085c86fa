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

/// Values being written for one header map: see the module documentation.
#[derive(Default)]
pub struct ValueBuf {
    /// Every value's text, one after the other.
    text: SmallVec<[u8; INLINE]>,
    /// Each value: its header and where its text ends (it starts where the previous one ends).
    values: SmallVec<[(HeaderName, usize); 6]>,
}

impl ValueBuf {
    /// Empty.
    pub fn new() -> Self {
        Self::default()
    }

    /// Append `b` to the value being written.
    pub fn put(&mut self, b: &[u8]) {
        self.text.extend_from_slice(b);
    }

    /// Bytes of the value being written so far.
    pub fn current_len(&self) -> usize {
        self.text.len() - self.values.last().map_or(0, |(_, end)| *end)
    }

    /// The value written since the last `end` is header `name`'s.
    pub fn end(&mut self, name: HeaderName) {
        self.values.push((name, self.text.len()));
    }

    /// Insert every value into `h` (each replacing what `h` had for its header); a value that
    /// is not a valid header value is left out.
    pub fn finish(self, h: &mut HeaderMap) {
        if self.values.is_empty() {
            return;
        }
        h.reserve(self.values.len());
        let all = Bytes::from_owner(self.text);
        let mut start = 0;
        for (name, end) in self.values {
            if let Ok(v) = HeaderValue::from_maybe_shared(all.slice(start..end)) {
                h.insert(name, v);
            }
            start = end;
        }
    }
}

impl std::fmt::Write for ValueBuf {
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
        let mut b = ValueBuf::new();
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
    }

    #[test]
    fn text_past_the_inline_room_still_comes_out_whole() {
        let mut b = ValueBuf::new();
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
