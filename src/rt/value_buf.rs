//! Header values written into a per-thread chunk and shared from it.
//!
//! A `String` per value costs an allocation each, and a buffer on the stack moved into its own
//! `Bytes` costs a copy and an allocation per step. [`ValueBuf`] writes every value of one step
//! (the rate-limit headers of a response, the forwarding headers of a request, a 429's body)
//! straight into this thread's current [`CHUNK`]-byte chunk, and [`ValueBuf::finish`] freezes
//! what it wrote: every value is a slice of the chunk (a reference count, no copy). The next
//! step on the thread writes after it, and a chunk with less than [`MIN_ROOM`] bytes left is
//! replaced by a new one: about one allocation per dozen requests. A value keeps its chunk
//! alive, so a long-lived one pins at most [`CHUNK`] bytes; text past the room left still
//! comes out whole (the chunk grows, with a copy).

use std::cell::RefCell;

use bytes::{Bytes, BytesMut};
use http::header::{HeaderMap, HeaderName, HeaderValue};
use smallvec::SmallVec;

/// Bytes of one chunk.
pub const CHUNK: usize = 4096;

/// A step starts a new chunk when the current one has less room than this: more than the
/// largest step (a 429 with its body and headers) takes with rule names of the usual length.
pub const MIN_ROOM: usize = 1024;

thread_local! {
    /// This thread's current chunk: the room after what earlier steps wrote.
    static ARENA: RefCell<BytesMut> = RefCell::new(BytesMut::new());
}

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
pub struct ValueBuf {
    /// The thread's chunk while this step writes into it: the text so far, then the room.
    buf: BytesMut,
    /// Each value: its header, the range of its text, and whether it is appended to the
    /// header's existing values (else it replaces them).
    values: SmallVec<[(&'static HeaderName, u32, u32, bool); 6]>,
    /// The range of the body, when one was written ([`ValueBuf::end_body`]).
    body: Option<(u32, u32)>,
    /// Values made beforehand ([`ValueBuf::preset`]), inserted (or appended) with the others.
    presets: SmallVec<[(&'static HeaderName, HeaderValue, bool); 2]>,
}

impl Default for ValueBuf {
    fn default() -> Self {
        let buf = ARENA
            .try_with(|a| {
                a.try_borrow_mut()
                    .map(|mut a| std::mem::take(&mut *a))
                    .unwrap_or_default()
            })
            .unwrap_or_default();
        let buf = if buf.capacity() < MIN_ROOM {
            BytesMut::with_capacity(CHUNK)
        } else {
            buf
        };
        ValueBuf {
            buf,
            values: SmallVec::new(),
            body: None,
            presets: SmallVec::new(),
        }
    }
}

impl Drop for ValueBuf {
    /// Give the chunk's room back to the thread (anything written and not finished is dropped).
    fn drop(&mut self) {
        let mut rest = std::mem::take(&mut self.buf);
        rest.clear();
        let _ = ARENA.try_with(|a| {
            if let Ok(mut a) = a.try_borrow_mut() {
                if rest.capacity() > a.capacity() {
                    *a = rest;
                }
            }
        });
    }
}

impl ValueBuf {
    /// Empty, writing into this thread's chunk.
    pub fn new() -> Self {
        Self::default()
    }

    /// Append `b` to the value being written.
    pub fn put(&mut self, b: &[u8]) {
        self.buf.extend_from_slice(b);
    }

    /// Bytes written so far (offsets fit in `u32`: a step writes a few hundred bytes).
    fn len(&self) -> u32 {
        u32::try_from(self.buf.len()).unwrap_or(u32::MAX)
    }

    /// Where the value being written starts.
    fn start(&self) -> u32 {
        let v = self.values.last().map_or(0, |(_, _, end, _)| *end);
        self.body.map_or(v, |(_, end)| v.max(end))
    }

    /// Bytes of the value being written so far.
    pub fn current_len(&self) -> usize {
        (self.len() - self.start()) as usize
    }

    /// The value written since the last `end` is header `name`'s.
    pub fn end(&mut self, name: &'static HeaderName) {
        let (start, len) = (self.start(), self.len());
        self.values.push((name, start, len, false));
    }

    /// The value written since the last `end` is appended to header `name`'s values (a list
    /// field keeps the members it had: another field line).
    pub fn end_appended(&mut self, name: &'static HeaderName) {
        let (start, len) = (self.start(), self.len());
        self.values.push((name, start, len, true));
    }

    /// Header `name` gets `v`, made beforehand (inserted as it is, with the written values).
    pub fn preset(&mut self, name: &'static HeaderName, v: HeaderValue) {
        self.presets.push((name, v, false));
    }

    /// [`ValueBuf::preset`], appended to header `name`'s values rather than replacing them.
    pub fn preset_appended(&mut self, name: &'static HeaderName, v: HeaderValue) {
        self.presets.push((name, v, true));
    }

    /// The text written since the last `end` is the body [`ValueBuf::finish`] returns.
    pub fn end_body(&mut self) {
        self.body = Some((self.start(), self.len()));
    }

    /// Insert every value into `h` (each replacing what `h` had for its header, or appended to
    /// it when written so), marked never to be HPACK-indexed; a value that is not a valid header
    /// value is left out. Returns the body, if one was written: it shares the values' chunk.
    pub fn finish(mut self, h: &mut HeaderMap) -> Option<Bytes> {
        h.reserve(self.values.len() + self.presets.len());
        for (name, v, append) in self.presets.drain(..) {
            if append {
                h.append(name.clone(), v);
            } else {
                h.insert(name.clone(), v);
            }
        }
        if self.values.is_empty() && self.body.is_none() {
            return None;
        }
        let all = self.buf.split().freeze();
        for &(name, start, end, append) in &self.values {
            if let Ok(mut v) = HeaderValue::from_maybe_shared(all.slice(start as usize..end as usize)) {
                // Never indexed by HTTP/2's HPACK: an indexed value would keep its chunk
                // alive in the connection's header table for the connection's life (most of
                // these values differ from one message to the next anyway).
                v.set_sensitive(true);
                if append {
                    h.append(name.clone(), v);
                } else {
                    h.insert(name.clone(), v);
                }
            }
        }
        self.body.map(|(a, b)| all.slice(a as usize..b as usize))
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
        static POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
        static COUNT: HeaderName = HeaderName::from_static("x-count");
        static BAD: HeaderName = HeaderName::from_static("x-bad");
        let mut b = ValueBuf::new();
        b.put(b"\"api\";q=10");
        b.end(&POLICY);
        write!(b, "{}", 42).unwrap(); // allow-panic: test
        assert_eq!(b.current_len(), 2);
        b.end(&COUNT);
        b.put(b"bad\nvalue");
        b.end(&BAD);
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
    fn appended_values_keep_the_ones_there() {
        static LIST: HeaderName = HeaderName::from_static("ratelimit");
        static POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
        let mut h = HeaderMap::new();
        h.insert("ratelimit", HeaderValue::from_static("\"origin\";r=5"));
        h.insert("ratelimit-policy", HeaderValue::from_static("\"origin\";q=9"));
        let mut b = ValueBuf::new();
        b.put(b"\"gate\";r=1");
        b.end_appended(&LIST);
        b.preset_appended(&POLICY, HeaderValue::from_static("\"gate\";q=2"));
        b.finish(&mut h);
        let all = |n: &str| {
            h.get_all(n)
                .iter()
                .map(|v| v.to_str().unwrap().to_owned()) // allow-panic: test
                .collect::<Vec<_>>()
        };
        assert_eq!(all("ratelimit"), ["\"origin\";r=5", "\"gate\";r=1"]);
        assert_eq!(all("ratelimit-policy"), ["\"origin\";q=9", "\"gate\";q=2"]);
    }

    #[test]
    fn steps_write_one_after_the_other_into_one_chunk() {
        static A: HeaderName = HeaderName::from_static("x-a");
        let mut h1 = HeaderMap::new();
        let mut h2 = HeaderMap::new();
        let mut b = ValueBuf::new();
        b.put(b"first");
        b.end(&A);
        b.finish(&mut h1);
        let mut b = ValueBuf::new();
        b.put(b"second");
        b.end(&A);
        b.finish(&mut h2);
        assert_eq!(
            (h1["x-a"].as_bytes(), h2["x-a"].as_bytes()),
            (&b"first"[..], &b"second"[..])
        );
        // An unfinished step leaves nothing behind.
        let mut b = ValueBuf::new();
        b.put(b"dropped");
        drop(b);
        let mut b = ValueBuf::new();
        b.put(b"third");
        b.end(&A);
        b.finish(&mut h1);
        assert_eq!(h1["x-a"], "third");
        assert_eq!(h2["x-a"], "second", "earlier values are untouched");
    }

    #[test]
    fn a_body_shares_the_buffer_between_values() {
        static RETRY: HeaderName = HeaderName::from_static("retry-after");
        static EMPTY: HeaderName = HeaderName::from_static("x-empty");
        static ONE: HeaderName = HeaderName::from_static("x-one");
        let mut b = ValueBuf::new();
        b.put(b"7");
        b.end(&RETRY);
        b.put(b"{\"error\":\"rate_limit_exceeded\"}");
        b.end_body();
        b.end(&EMPTY);
        b.put(b"1");
        b.end(&ONE);
        let mut h = HeaderMap::new();
        let body = b.finish(&mut h);
        assert_eq!(body.as_deref(), Some(&b"{\"error\":\"rate_limit_exceeded\"}"[..]));
        assert_eq!(h["retry-after"], "7");
        assert_eq!(h["x-empty"], "");
        assert_eq!(h["x-one"], "1");
    }

    #[test]
    fn text_past_the_room_left_still_comes_out_whole() {
        static LONG: HeaderName = HeaderName::from_static("x-long");
        let long = "r".repeat(3 * CHUNK);
        let mut h = HeaderMap::new();
        for _ in 0..3 {
            let mut b = ValueBuf::new();
            b.put(long.as_bytes());
            b.end(&LONG);
            b.finish(&mut h);
            assert_eq!(h["x-long"].as_bytes(), long.as_bytes());
        }

        let mut t = Text::<8>::new();
        write!(t, "2001:db8::{}", 1).unwrap(); // allow-panic: test
        assert_eq!(t.as_str(), "2001:db8::1");
    }
}
