//! JSON answers for the requests hyper's HTTP/1.1 parser refuses.
//!
//! Every answer tollgate makes itself has a JSON body (`respond.rs`). But a request head that
//! hyper's parser cannot read (a malformed request line or header field, a head past hyper's
//! buffer of twice `server.max_header_bytes`, more than `proxy::MAX_HEADERS` fields) never
//! reaches the service: hyper answers it on its own with a bare head (`HTTP/1.1 400 Bad
//! Request` or `HTTP/1.1 431 Request Header Fields Too Large`, `connection: close`,
//! `content-length: 0`, `date`) and closes the connection, and it has no hook to choose that
//! answer. So [`ParseReply`] sits between hyper and the connection's IO (plain HTTP/1.1 in
//! front of `idle::IdleIo`, and TLS), recognises that head when hyper writes it, and writes in
//! its place the JSON answer of the matching local answer ([`GatewayError::BadRequest`] or
//! [`GatewayError::HeadersTooLarge`], rendered once per process by
//! [`GatewayError::into_response`]), with `connection: close`, its `content-length` and hyper's
//! `date`. (hyper's 414, for a URI over 64 KiB, has no local answer and passes as it is.)
//!
//! Only the first write of a hyper connection is looked at. A first write is always a response
//! head, and a head of exactly that shape cannot be the service's: every response
//! `proxy::State::handle` returns carries `X-Request-Id`. So an upstream's own bodiless 400 is
//! never replaced, and no later write (which could be a body chunk of any content) is read;
//! after the first write every call is a plain pass-through (a match on the state, no
//! allocation). hyper also answers a bad request that follows a response on a keep-alive
//! connection; that answer is replaced only when it is the connection's first write again:
//! plain HTTP/1.1 connections get a new hyper connection (and a new [`ParseReply`]) after every
//! idle pause of `idle::PARK_AFTER`, TLS ones keep one hyper connection for their life.

use std::io;
use std::pin::Pin;
use std::sync::OnceLock;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::respond::GatewayError;
use super::ProxyBody;

/// The message of the 400 for a request head hyper's parser refused.
pub const MALFORMED: &str = "malformed request line or header field";

/// The length of an IMF-fixdate (`Thu, 03 Dec 2026 10:00:01 GMT`), hyper's `date` value.
const DATE_LEN: usize = 29;

/// The IO of one hyper HTTP/1.1 connection, with hyper's own parse-error answers replaced by
/// JSON ones: see the module documentation. Reads pass through untouched.
pub struct ParseReply<T> {
    inner: T,
    state: State,
}

/// Where the connection is in its writes.
enum State {
    /// Nothing written yet: the next write is looked at.
    First,
    /// Passing every write through.
    Through,
    /// hyper's answer was taken (hyper was told it was written); this is still to write.
    Replacing(Box<Replacement>),
}

/// A JSON answer being written in place of hyper's.
struct Replacement {
    reply: &'static Rendered,
    /// `date: <hyper's value>\r\n`, or nothing when hyper sent no `date`.
    date: [u8; DATE_LEN + 8],
    date_len: usize,
    /// Bytes of the whole answer written so far.
    at: usize,
}

impl Replacement {
    /// The answer's bytes from `at` on, up to the end of the part `at` falls in.
    fn rest(&self) -> &[u8] {
        let bytes = &self.reply.bytes[..];
        let (head, tail) = bytes.split_at(self.reply.split);
        let date = &self.date[..self.date_len];
        let mut at = self.at;
        for part in [head, date, tail] {
            if at < part.len() {
                return &part[at..];
            }
            at -= part.len();
        }
        &[]
    }
}

/// A local answer as HTTP/1.1 bytes: the status line and headers, the blank line, the body.
struct Rendered {
    bytes: Vec<u8>,
    /// Where the `date` line goes: the end of the header lines.
    split: usize,
}

/// Which local answer replaces a parse-error answer of hyper's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    BadRequest,
    HeadersTooLarge,
}

impl Kind {
    /// hyper's status line for it (`proto::h1::role::Server::on_error`).
    fn hyper_status_line(self) -> &'static [u8] {
        match self {
            Kind::BadRequest => b"HTTP/1.1 400 Bad Request\r\n",
            Kind::HeadersTooLarge => b"HTTP/1.1 431 Request Header Fields Too Large\r\n",
        }
    }

    /// The JSON answer, rendered on first use.
    fn rendered(self) -> &'static Rendered {
        static BAD_REQUEST: OnceLock<Rendered> = OnceLock::new();
        static TOO_LARGE: OnceLock<Rendered> = OnceLock::new();
        match self {
            Kind::BadRequest => BAD_REQUEST.get_or_init(|| render(GatewayError::BadRequest(MALFORMED))),
            Kind::HeadersTooLarge => TOO_LARGE.get_or_init(|| render(GatewayError::HeadersTooLarge)),
        }
    }
}

/// `e`'s response as HTTP/1.1 bytes, with `connection: close` and its `content-length`.
fn render(e: GatewayError) -> Rendered {
    let resp = e.into_response();
    let status = resp.status();
    let mut bytes = Vec::with_capacity(512);
    bytes.extend_from_slice(b"HTTP/1.1 ");
    bytes.extend_from_slice(status.as_str().as_bytes());
    bytes.push(b' ');
    bytes.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    bytes.extend_from_slice(b"\r\n");
    for (name, value) in resp.headers() {
        bytes.extend_from_slice(name.as_str().as_bytes());
        bytes.extend_from_slice(b": ");
        bytes.extend_from_slice(value.as_bytes());
        bytes.extend_from_slice(b"\r\n");
    }
    let body = match resp.into_body() {
        ProxyBody::Full(Some(b)) => b,
        _ => bytes::Bytes::new(),
    };
    bytes.extend_from_slice(b"connection: close\r\ncontent-length: ");
    bytes.extend_from_slice(itoa::Buffer::new().format(body.len()).as_bytes());
    bytes.extend_from_slice(b"\r\n");
    let split = bytes.len();
    bytes.extend_from_slice(b"\r\n");
    bytes.extend_from_slice(&body);
    Rendered { bytes, split }
}

/// If `data` is exactly hyper's answer to a request head it could not parse (its status line,
/// optionally `connection: close`, `content-length: 0`, optionally `date`, the blank line):
/// which one, and its `date` value.
fn hyper_answer(data: &[u8]) -> Option<(Kind, Option<&[u8]>)> {
    // The quick test every first write pays: a service response head is never this short
    // with this start (it carries `X-Request-Id`), and most start `HTTP/1.1 2`.
    if data.len() > 128 || !data.starts_with(b"HTTP/1.1 4") {
        return None;
    }
    let kind = [Kind::BadRequest, Kind::HeadersTooLarge]
        .into_iter()
        .find(|k| data.starts_with(k.hyper_status_line()))?;
    let rest = &data[kind.hyper_status_line().len()..];
    // hyper has turned keep-alive off for the connection by the time it answers.
    let rest = rest.strip_prefix(b"connection: close\r\n".as_slice()).unwrap_or(rest);
    let rest = rest.strip_prefix(b"content-length: 0\r\n".as_slice())?;
    if rest == b"\r\n" {
        return Some((kind, None));
    }
    let date = rest
        .strip_prefix(b"date: ".as_slice())?
        .strip_suffix(b"\r\n\r\n".as_slice())?;
    (date.len() == DATE_LEN && !date.contains(&b'\n')).then_some((kind, Some(date)))
}

impl<T> ParseReply<T> {
    /// Wrap a new hyper connection's IO.
    pub fn new(inner: T) -> Self {
        Self {
            inner,
            state: State::First,
        }
    }

    /// The first write is `data`: take it if it is hyper's parse-error answer (true).
    fn take_first(&mut self, data: &[u8]) -> bool {
        if data.is_empty() {
            return false;
        }
        let Some((kind, date)) = hyper_answer(data) else {
            self.state = State::Through;
            return false;
        };
        let mut r = Replacement {
            reply: kind.rendered(),
            date: [0; DATE_LEN + 8],
            date_len: 0,
            at: 0,
        };
        if let Some(d) = date {
            let line = [b"date: ".as_slice(), d, b"\r\n"];
            for part in line {
                r.date[r.date_len..r.date_len + part.len()].copy_from_slice(part);
                r.date_len += part.len();
            }
        }
        tracing::debug!(
            status = if kind == Kind::BadRequest { 400 } else { 431 },
            "request head refused by the HTTP/1.1 parser; answering with JSON"
        );
        self.state = State::Replacing(Box::new(r));
        true
    }
}

impl<T: AsyncWrite + Unpin> ParseReply<T> {
    /// Write out the rest of a replacement, if one is under way; then every write passes
    /// through.
    fn poll_replace(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let State::Replacing(r) = &mut self.state else {
            return Poll::Ready(Ok(()));
        };
        loop {
            let rest = r.rest();
            if rest.is_empty() {
                self.state = State::Through;
                return Poll::Ready(Ok(()));
            }
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, rest))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            r.at += n;
        }
    }

    /// hyper was told `n` bytes (its answer) were written: start writing the replacement.
    fn start_replacing(&mut self, cx: &mut Context<'_>, n: usize) -> Poll<io::Result<usize>> {
        match self.poll_replace(cx) {
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            // The rest goes out on hyper's flush (or its next write, or shutdown).
            _ => Poll::Ready(Ok(n)),
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for ParseReply<T> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for ParseReply<T> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        match this.state {
            State::Through => {}
            State::First => {
                if this.take_first(data) {
                    return this.start_replacing(cx, data.len());
                }
            }
            State::Replacing(_) => ready!(this.poll_replace(cx))?,
        }
        Pin::new(&mut this.inner).poll_write(cx, data)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        match this.state {
            State::Through => {}
            State::First => {
                // hyper's answer is one buffer (its head; there is no body).
                let mut full = bufs.iter().filter(|b| !b.is_empty());
                if let (Some(first), None) = (full.next(), full.next()) {
                    if this.take_first(first) {
                        return this.start_replacing(cx, first.len());
                    }
                } else if bufs.iter().any(|b| !b.is_empty()) {
                    this.state = State::Through;
                }
            }
            State::Replacing(_) => ready!(this.poll_replace(cx))?,
        }
        Pin::new(&mut this.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_replace(cx))?;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_replace(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    const DATE: &[u8] = b"Thu, 03 Dec 2026 10:00:01 GMT";

    #[test]
    fn only_hypers_exact_bare_answers_are_recognised() {
        let with_date = [
            &b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\ndate: "[..],
            DATE,
            b"\r\n\r\n",
        ]
        .concat();
        assert_eq!(hyper_answer(&with_date), Some((Kind::HeadersTooLarge, Some(DATE))));
        // What hyper 1.12 writes.
        let closing = [
            &b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\ncontent-length: 0\r\ndate: "[..],
            DATE,
            b"\r\n\r\n",
        ]
        .concat();
        assert_eq!(hyper_answer(&closing), Some((Kind::BadRequest, Some(DATE))));
        assert_eq!(
            hyper_answer(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n"),
            Some((Kind::BadRequest, None))
        );
        // A service response carries X-Request-Id, or a body: never replaced.
        for other in [
            &b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nx-request-id: a\r\n\r\n"[..],
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: 2\r\n\r\n{}",
            b"HTTP/1.1 414 URI Too Long\r\ncontent-length: 0\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\ndate: short\r\n\r\n",
            b"HTTP/1.1 400 Bad Request\r\n",
        ] {
            assert_eq!(hyper_answer(other), None, "{}", String::from_utf8_lossy(other));
        }
    }

    #[test]
    fn rendered_answers_are_tollgates_json_with_a_correct_length() {
        for (kind, status, code) in [
            (Kind::BadRequest, "400", "bad_request"),
            (Kind::HeadersTooLarge, "431", "request_header_fields_too_large"),
        ] {
            let r = kind.rendered();
            let text = std::str::from_utf8(&r.bytes).unwrap_or_default();
            let (head, body) = text.split_once("\r\n\r\n").unwrap_or_default();
            assert!(head.starts_with(&format!("HTTP/1.1 {status} ")), "{head}");
            assert!(head.contains("\r\ncontent-type: application/json\r\n"), "{head}");
            assert!(head.contains("\r\nconnection: close\r\n"), "{head}");
            assert!(head.contains(&format!("\r\ncontent-length: {}", body.len())), "{head}");
            let v: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
            assert_eq!(v["error"], code, "{body}");
            assert_eq!(r.split, head.len() + 2);
        }
    }

    #[tokio::test]
    async fn the_first_write_is_swapped_and_later_ones_pass_through() {
        let answer = [
            &b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\ndate: "[..],
            DATE,
            b"\r\n\r\n",
        ]
        .concat();
        // Swapped, even when the socket takes a few bytes at a time.
        let (client, server) = tokio::io::duplex(7);
        let mut w = ParseReply::new(server);
        let reader = tokio::spawn(async move {
            let mut client = client;
            let mut out = Vec::new();
            let _ = tokio::io::AsyncReadExt::read_to_end(&mut client, &mut out).await;
            out
        });
        let n = w.write(&answer).await.unwrap_or_default();
        assert_eq!(n, answer.len());
        w.flush().await.unwrap_or_default();
        w.shutdown().await.unwrap_or_default();
        drop(w);
        let out = reader.await.unwrap_or_default();
        let text = String::from_utf8_lossy(&out);
        assert!(text.starts_with("HTTP/1.1 400 Bad Request\r\n"), "{text}");
        assert!(
            text.contains("\r\ndate: Thu, 03 Dec 2026 10:00:01 GMT\r\n\r\n{"),
            "{text}"
        );
        assert!(text.contains("\"error\":\"bad_request\""), "{text}");

        // Not first: passed through as it is.
        let (client, server) = tokio::io::duplex(1024);
        let mut w = ParseReply::new(server);
        let first = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nx-request-id: a\r\n\r\n";
        w.write_all(first).await.unwrap_or_default();
        w.write_all(&answer).await.unwrap_or_default();
        w.shutdown().await.unwrap_or_default();
        drop(w);
        let mut client = client;
        let mut out = Vec::new();
        let _ = tokio::io::AsyncReadExt::read_to_end(&mut client, &mut out).await;
        assert_eq!(out, [&first[..], &answer].concat());
    }
}
