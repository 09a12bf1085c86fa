//! Path normalisation and path patterns.
//!
//! Normalisation runs before matching so that spellings of one path cannot dodge its rule:
//! percent-encoded unreserved characters are decoded, `;params` are dropped from every segment,
//! empty segments (`//`) collapse, dot-segments resolve, and a trailing slash goes. Encoded
//! reserved characters (`%2F`) stay encoded: they are data, not structure.

use std::borrow::Cow;

/// Normalise a request path (no query). Borrowed when already normal (the common case).
pub fn normalize(path: &str) -> Cow<'_, str> {
    if is_normal(path) {
        return Cow::Borrowed(path);
    }
    let mut out: Vec<String> = Vec::new();
    for raw in path.split('/') {
        let seg = match raw.find(';') {
            Some(i) => &raw[..i],
            None => raw,
        };
        let seg = decode_unreserved(seg);
        match seg.as_str() {
            "" | "." => {}
            ".." => {
                out.pop();
            }
            _ => out.push(seg),
        }
    }
    let mut s = String::with_capacity(path.len());
    for seg in &out {
        s.push('/');
        s.push_str(seg);
    }
    if s.is_empty() {
        s.push('/');
    }
    Cow::Owned(s)
}

fn is_normal(path: &str) -> bool {
    let b = path.as_bytes();
    if b.first() != Some(&b'/') {
        return false;
    }
    if b.len() > 1 && b[b.len() - 1] == b'/' {
        return false;
    }
    let mut prev = 0u8;
    for (i, &c) in b.iter().enumerate() {
        match c {
            b'%' | b';' => return false,
            b'/' if prev == b'/' => return false,
            b'.' if prev == b'/' => {
                // "/." followed by end, "/" or "." is a dot-segment.
                match b.get(i + 1) {
                    None | Some(b'/') | Some(b'.') => return false,
                    _ => {}
                }
            }
            _ => {}
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

/// Decode `%XX` where XX is an unreserved character (RFC 3986 §2.3); uppercase other escapes.
fn decode_unreserved(seg: &str) -> String {
    let b = seg.as_bytes();
    let mut out = String::with_capacity(seg.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hexval(b[i + 1]), hexval(b[i + 2])) {
                let v = h * 16 + l;
                if v.is_ascii_alphanumeric() || matches!(v, b'-' | b'.' | b'_' | b'~') {
                    out.push(v as char);
                } else {
                    out.push('%');
                    out.push(b[i + 1].to_ascii_uppercase() as char);
                    out.push(b[i + 2].to_ascii_uppercase() as char);
                }
                i += 3;
                continue;
            }
        }
        if b[i] == b'%' {
            // A '%' that starts no escape is data: spell it `%25`, so that the output is a fixed
            // point (else "%%361" -> "%61" -> "a" on a second pass). Found by fuzz/path.
            out.push_str("%25");
            i += 1;
            continue;
        }
        // Safe: we only split at ASCII bytes, so `seg[i..]` starts on a char boundary.
        let ch = seg[i..].chars().next().unwrap_or('\u{fffd}');
        out.push(ch);
        i += ch.len_utf8();
    }
    out
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
