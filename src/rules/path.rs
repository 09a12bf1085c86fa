//! Path normalisation and path patterns.
//!
//! A request path is read once, into the one spelling that both the matcher and the upstream
//! see (ARCHITECTURE.md, "What the matcher decides on is what the upstream receives"): every
//! percent-escape is decoded and the bytes that must be escaped are escaped again, in upper
//! case; `;params` are dropped from every segment; empty segments (`//`) collapse; dot-segments
//! resolve. [`canonical`] gives that spelling for forwarding, or refuses a path that some
//! upstream would read as another path (an encoded `/` or `\`, a literal `\`, a control byte,
//! an encoded `;`, a malformed escape, a segment ending in `.` or white space).
//! [`normalize`] is the same reading for matching, without the refusals and without a trailing
//! slash (`/a/` and `/a` are one path to the rules).

use std::borrow::Cow;

/// How request paths that carry an encoded slash are treated (`server.encoded_slashes`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum EncodedSlashes {
    /// `%2F` and `%5C` get a 400: upstreams that decode before routing would read them as `/`.
    #[default]
    Reject,
    /// `%2F` and `%5C` stay encoded, matched and forwarded as data (for APIs that need them,
    /// with upstreams that route on the raw path).
    Keep,
}

/// Why a request path was refused: it spells something an upstream could read as another path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathError {
    /// Not origin-form: it does not start with `/`.
    NotOriginForm,
    /// `%2F` or `%5C` with `encoded_slashes: reject`.
    EncodedSlash,
    /// A literal `\`, which some servers read as `/`.
    Backslash,
    /// A control byte, literal or encoded (`%00`, `%0A`, ...).
    ControlByte,
    /// `%3B`: an upstream that decodes first reads it as a `;params` delimiter.
    EncodedSemicolon,
    /// A `%` not followed by two hex digits.
    MalformedEscape,
    /// A segment ending in `.` or white space, which some servers strip.
    TrailingDotOrSpace,
}

impl PathError {
    /// The 400's message.
    pub fn message(self) -> &'static str {
        match self {
            PathError::NotOriginForm => "the request target is not a path",
            PathError::EncodedSlash => "the path has an encoded '/' or '\\' (server.encoded_slashes: reject)",
            PathError::Backslash => "the path has a '\\'",
            PathError::ControlByte => "the path has a control character",
            PathError::EncodedSemicolon => "the path has an encoded ';'",
            PathError::MalformedEscape => "the path has a '%' that starts no escape",
            PathError::TrailingDotOrSpace => "a path segment ends in '.' or white space",
        }
    }
}

/// The path rules match `path` as: decoded and re-escaped as [`canonical`] does, without its
/// refusals (what it would refuse is kept as data), and without a trailing slash. Borrowed when
/// already normal (the common case); a fixed point.
pub fn normalize(path: &str) -> Cow<'_, str> {
    if is_plain(path, false) {
        return Cow::Borrowed(path);
    }
    match rewrite(path, Mode::Lenient) {
        Ok(s) => Cow::Owned(s),
        // Lenient never refuses.
        Err(_) => Cow::Owned("/".to_owned()),
    }
}

/// The spelling of `path` that is forwarded upstream and matched: [`normalize`]'s, keeping a
/// trailing slash (an upstream may redirect `/a` to `/a/`), or `Err` when some upstream could
/// read it as another path. Borrowed when already canonical (the common case).
pub fn canonical(path: &str, slashes: EncodedSlashes) -> Result<Cow<'_, str>, PathError> {
    if !path.starts_with('/') {
        return Err(PathError::NotOriginForm);
    }
    if is_plain(path, true) {
        return Ok(Cow::Borrowed(path));
    }
    rewrite(path, Mode::Strict(slashes)).map(Cow::Owned)
}

/// How [`rewrite`] treats what an upstream could read differently.
#[derive(Clone, Copy)]
enum Mode {
    /// Keep it as (escaped) data; no trailing slash.
    Lenient,
    /// Refuse it; keep a trailing slash.
    Strict(EncodedSlashes),
}

/// A byte that stands for itself in a canonical path segment: RFC 3986 `pchar` without `%` and
/// `;` (unreserved, sub-delims but `;`, `:` and `@`).
fn literal_ok(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"-._~!$&'()*+,=:@".contains(&b)
}

/// Already in the output form: starts with '/', only literal bytes, no `//`, no dot-segment, no
/// segment ending in '.', and a trailing slash only if `trailing_slash` (and never `/` alone
/// counts as one).
fn is_plain(path: &str, trailing_slash: bool) -> bool {
    let b = path.as_bytes();
    if b.first() != Some(&b'/') {
        return false;
    }
    if !trailing_slash && b.len() > 1 && b[b.len() - 1] == b'/' {
        return false;
    }
    let mut prev = 0u8;
    for (i, &c) in b.iter().enumerate() {
        match c {
            b'/' if prev == b'/' => return false,
            b'/' => {}
            // A '.' that ends a segment: a dot-segment, or a trailing dot.
            b'.' if matches!(b.get(i + 1), None | Some(b'/')) => return false,
            c if literal_ok(c) => {}
            _ => return false,
        }
        prev = c;
    }
    true
}

fn hexval(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

const HEX: &[u8; 16] = b"0123456789ABCDEF";

fn push_escaped(out: &mut String, b: u8) {
    out.push('%');
    out.push(HEX[usize::from(b >> 4)] as char);
    out.push(HEX[usize::from(b & 15)] as char);
}

/// One segment (its `;params` already cut) decoded and re-escaped onto `out`.
fn segment(seg: &str, mode: Mode, out: &mut String) -> Result<(), PathError> {
    let strict = matches!(mode, Mode::Strict(_));
    let b = seg.as_bytes();
    let mut i = 0;
    let mut last = 0u8;
    while i < b.len() {
        let (v, escaped) = match b[i] {
            b'%' => match (
                b.get(i + 1).copied().and_then(hexval),
                b.get(i + 2).copied().and_then(hexval),
            ) {
                (Some(h), Some(l)) => {
                    i += 3;
                    (h * 16 + l, true)
                }
                _ if strict => return Err(PathError::MalformedEscape),
                _ => {
                    i += 1;
                    (b'%', false)
                }
            },
            c => {
                i += 1;
                (c, false)
            }
        };
        last = v;
        match v {
            b'/' | b'\\' if escaped => match mode {
                Mode::Strict(EncodedSlashes::Reject) => return Err(PathError::EncodedSlash),
                _ => push_escaped(out, v),
            },
            b'\\' if strict => return Err(PathError::Backslash),
            0..=0x1f | 0x7f if strict => return Err(PathError::ControlByte),
            b';' if strict => return Err(PathError::EncodedSemicolon),
            v if literal_ok(v) => out.push(v as char),
            v => push_escaped(out, v),
        }
    }
    if strict && (last == b'.' || last == b' ' || last == b'\t') {
        return Err(PathError::TrailingDotOrSpace);
    }
    Ok(())
}

/// The slow path of [`normalize`] and [`canonical`].
fn rewrite(path: &str, mode: Mode) -> Result<String, PathError> {
    let mut out = String::with_capacity(path.len() + 8);
    // Where each kept segment starts in `out`, for `..`.
    let mut starts: Vec<usize> = Vec::new();
    for raw in path.split('/') {
        let seg = match raw.find(';') {
            Some(i) => &raw[..i],
            None => raw,
        };
        let at = out.len();
        out.push('/');
        let before = out.len();
        segment(seg, Mode::Lenient, &mut out)?;
        match &out[before..] {
            "" | "." => out.truncate(at),
            ".." => {
                out.truncate(at);
                if let Some(s) = starts.pop() {
                    out.truncate(s);
                }
            }
            _ => {
                if let Mode::Strict(_) = mode {
                    // Refusals are judged on the segment alone, dot-segments apart.
                    let mut scratch = String::new();
                    segment(seg, mode, &mut scratch)?;
                }
                starts.push(at);
            }
        }
    }
    // The root, or a trailing slash kept for the upstream.
    let trailing = matches!(mode, Mode::Strict(_)) && path.len() > 1 && path.ends_with('/');
    if out.is_empty() || trailing {
        out.push('/');
    }
    Ok(out)
}

/// One segment of a compiled pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    /// Must equal this text.
    Literal(String),
    /// `{name}` or `*`: any one non-empty segment.
    Any,
}

/// How a pattern matches, for specificity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum PatternClass {
    /// `/a/**`.
    Prefix = 1,
    /// `/users/{id}` or `/a/*`.
    Template = 2,
    /// `/a/b`.
    Exact = 3,
}

/// A compiled path pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pattern {
    /// The source text.
    pub source: String,
    /// Segments before a trailing `**`.
    pub segments: Vec<Segment>,
    /// Ends in `/**`: matches the prefix and everything below it.
    pub subtree: bool,
    /// Exact, template or prefix.
    pub class: PatternClass,
    /// Literal bytes in the pattern: longer is more specific.
    pub literal_len: usize,
}

impl Pattern {
    /// Compile a pattern; `Err` says what is wrong.
    pub fn parse(src: &str) -> Result<Self, String> {
        if !src.starts_with('/') {
            return Err(format!("path {src:?} must start with '/'"));
        }
        let norm = normalize(src);
        if norm != src && !src.contains('{') && !src.ends_with("/**") && src != "/" {
            return Err(format!("path {src:?} is not normalised; write {norm:?}"));
        }
        let mut segments = Vec::new();
        let mut subtree = false;
        let parts: Vec<&str> = src.split('/').skip(1).filter(|s| !s.is_empty()).collect();
        for (i, p) in parts.iter().enumerate() {
            if *p == "**" {
                if i + 1 != parts.len() {
                    return Err(format!("path {src:?}: '**' is only allowed as the last segment"));
                }
                subtree = true;
            } else if *p == "*" || (p.starts_with('{') && p.ends_with('}') && p.len() > 2) {
                segments.push(Segment::Any);
            } else if p.contains(['*', '{', '}']) {
                return Err(format!("path {src:?}: segment {p:?} mixes text and wildcards"));
            } else {
                segments.push(Segment::Literal(p.to_string()));
            }
        }
        let literal_len = segments
            .iter()
            .map(|s| match s {
                Segment::Literal(l) => l.len() + 1,
                Segment::Any => 0,
            })
            .sum();
        let class = if subtree {
            PatternClass::Prefix
        } else if segments.contains(&Segment::Any) {
            PatternClass::Template
        } else {
            PatternClass::Exact
        };
        Ok(Pattern {
            source: src.to_string(),
            segments,
            subtree,
            class,
            literal_len,
        })
    }

    /// Lower-case its literal segments (an `ignore_case` rule matches the lower-cased path).
    pub fn lowercase(&mut self) {
        for s in &mut self.segments {
            if let Segment::Literal(l) = s {
                l.make_ascii_lowercase();
            }
        }
    }

    /// The first literal segment, if the pattern starts with one (for indexing).
    pub fn first_literal(&self) -> Option<&str> {
        match self.segments.first() {
            Some(Segment::Literal(l)) => Some(l),
            _ => None,
        }
    }

    /// Does the normalised `path` match?
    pub fn matches(&self, path: &str) -> bool {
        let mut it = path.split('/').skip(1).filter(|s| !s.is_empty());
        for seg in &self.segments {
            match (seg, it.next()) {
                (Segment::Literal(l), Some(p)) if l == p => {}
                (Segment::Any, Some(_)) => {}
                _ => return false,
            }
        }
        self.subtree || it.next().is_none()
    }
}

#[cfg(test)]
mod tests;
