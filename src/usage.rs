//! Streaming extraction of token counts from JSON and `text/event-stream` bodies.
//!
//! tollgate charges AI API callers by tokens. The upstream reports the count as a number at a
//! dotted path of object keys in the response body (`usage.total_tokens`), either in a plain
//! JSON body or in the late events of a server-sent-events stream (OpenAI's
//! `stream_options.include_usage` final chunk, Anthropic's `message_start` / `message_delta`
//! events). A request body's top-level field (`max_tokens`) is read the same way.
//!
//! A [`Scanner`] reads such a body as it streams through the proxy, in chunks split anywhere
//! (inside a key, a number, an escape, a `data:` prefix or a CRLF pair). It never buffers the
//! body: it is a byte-at-a-time state machine whose memory is fixed when it is created (the
//! paths, one small counter and one result per path, a 64-byte capture buffer) and does not grow
//! with the input. [`Scanner::feed`] never allocates.
//!
//! # What matches
//!
//! A [`JsonPath`] matches a value whose chain of enclosing object keys, from the top-level value
//! (JSON bodies) or from the top of each event's data value (event streams), equals the path's
//! segments exactly. Arrays are walked through but break the chain: nothing inside an array ever
//! matches. Keys are compared after JSON unescaping (`\uXXXX` including surrogate pairs, and the
//! simple escapes; an unpaired surrogate becomes U+FFFD), byte for byte with the segment; a key
//! longer than 64 bytes (unescaped) never matches.
//!
//! # Which values count
//!
//! - A non-negative integer counts exactly, saturating at `u64::MAX`; a negative one counts 0.
//! - A number with a fraction counts its ceiling, computed exactly (`1.5` → 2, `2.0` → 2); one
//!   with an exponent is evaluated through `f64` and ceiled; negative → 0, too large or
//!   non-finite → `u64::MAX`.
//! - A string whose content, trimmed of ASCII whitespace, is such a number counts the same way
//!   (`"4000"` → 4000; a leading `+`, `1.` and `.5` are accepted too, `inf`/`NaN` are not),
//!   because lenient upstream validators coerce strings.
//! - At most 40 bytes of a matched number or (unescaped) string are kept: a longer one counts
//!   `u64::MAX`, whatever it holds. It cannot be read exactly, and a reader may take it for
//!   less (`4000.000…0` is 4000 to Python), so it counts as the most it could be: no spelling
//!   reserves or charges less than the value means.
//! - Anything else (`null`, `true`, `false`, an object, an array, another string) does not
//!   count and leaves the result as it was.
//! - A number counts when its token ends: at the following delimiter, or when the body (or, in
//!   an event stream, the event) ends. So a body truncated right after `"total_tokens":12`
//!   reports 12, with [`Completeness::Truncated`]; a body split as `…:12` + `3}` reports 123
//!   only. A string counts at its closing quote.
//! - When the path matches several times (duplicate keys, several events) the **largest** value
//!   counts, so that a hostile body cannot undercount by exploiting first-wins or last-wins
//!   parsing: `{"max_tokens":1,"max_tokens":4000}` yields 4000.
//! - Values already counted stay counted even if the body later turns out malformed.
//!
//! # Validation
//!
//! JSON bodies are validated as one complete JSON value (RFC 8259 grammar, with optional
//! whitespace around it and an optional leading UTF-8 byte-order mark). The bytes inside strings
//! are not checked to be valid UTF-8, only free of raw control characters. The kind of each open
//! container (object or array) is tracked exactly for the outermost 64 levels; deeper containers
//! are counted and their syntax still checked, but after a nested container closes at a depth
//! beyond 64 the scanner no longer knows whether the enclosing one is an object or an array, so
//! it accepts either closer there and learns the kind again from the next member (`"k":` or a
//! plain element). Nesting deeper than 100 000 levels is rejected as malformed.
//!
//! Event streams follow the WHATWG server-sent-events parsing rules for lines (`\r\n`, `\n` or
//! `\r` line ends, also when a `\r\n` pair is split between chunks; `data` fields, with or
//! without a colon; comments; one optional space after the colon; a leading BOM ignored), and
//! scan each event's data (its `data` lines joined by `\n`, without a final `\n`) as one JSON
//! value, streamed: neither lines nor data are buffered. An event whose data is empty or only
//! whitespace is ignored, like an event without data lines; an event whose data is exactly
//! `[DONE]` (one data line, no surrounding spaces) is the OpenAI end marker and is not JSON.
//! Field names are case-sensitive (`Data:` is not a data line) and other fields (`event`, `id`,
//! `retry`) are ignored: a path is looked for in every event, whatever its type. The end of the
//! stream closes a final event that lacks its blank line, as the WHATWG rules would not (they
//! drop it), so that its usage still counts.

use std::fmt;

/// Most segments a [`JsonPath`] may have.
const MAX_SEGMENTS: usize = 16;
/// Longest segment of a [`JsonPath`], in bytes; also the most of a key that is kept.
const MAX_SEGMENT_LEN: usize = 64;
/// Most bytes of a matched number or string value that are kept.
const MAX_VALUE_LEN: usize = 40;
/// Nesting levels whose container kind is tracked exactly (one bit each in a `u64`).
const TRACKED_DEPTH: u32 = 64;
/// Deepest nesting accepted; deeper is malformed.
const MAX_DEPTH: u32 = 100_000;
/// The UTF-8 byte-order mark.
const BOM: [u8; 3] = [0xEF, 0xBB, 0xBF];
/// The `bom` state once the byte-order-mark check is over.
const BOM_DONE: u8 = 3;
/// OpenAI's end-of-stream event data.
const DONE: &[u8] = b"[DONE]";
/// The `done` state once an event's data can no longer be `[DONE]`.
const DONE_MISMATCH: u8 = u8::MAX;
/// The JSON literals, indexed by `JsonScan::lit`.
const LITERALS: [&[u8]; 3] = [b"true", b"false", b"null"];
/// The one field name of an event stream that matters.
const DATA: &[u8] = b"data";

/// Bytes that stop a fast skip through string contents: the quote, the backslash and the raw
/// control characters (which are invalid inside a JSON string).
static STR_STOP: [bool; 256] = {
    let mut table = [false; 256];
    let mut i = 0;
    while i < 0x20 {
        table[i] = true;
        i += 1;
    }
    table[b'"' as usize] = true;
    table[b'\\' as usize] = true;
    table
};

/// JSON whitespace.
fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

/// Advances `i` past JSON whitespace; the byte there, or `None` at the end of the input.
#[inline(always)]
fn skip_ws(input: &[u8], i: &mut usize) -> Option<u8> {
    while let Some(&b) = input.get(*i) {
        if !is_ws(b) {
            return Some(b);
        }
        *i += 1;
    }
    None
}

/// A dotted path of object keys: `usage.total_tokens`. 1..=16 segments, each 1..=64 bytes, no empty segment.
///
/// There is no escape syntax: a segment is compared byte for byte with an unescaped JSON key, so
/// a key that contains a `.` cannot be addressed. Any other character, including spaces, is part
/// of the segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonPath {
    /// The path as given.
    text: String,
    /// Its dot-separated segments, each 1..=64 bytes; 1..=16 of them.
    segments: Vec<String>,
}

impl JsonPath {
    /// Parses a dotted path such as `usage.total_tokens`.
    ///
    /// Errors, with a message naming the problem and the path, when the text is empty, has more
    /// than 16 segments, has an empty segment (a leading, trailing or doubled `.`), or has a
    /// segment longer than 64 bytes.
    pub fn parse(s: &str) -> Result<JsonPath, String> {
        if s.is_empty() {
            return Err("JSON path is empty; expected dot-separated object keys such as `usage.total_tokens`".into());
        }
        let count = s.split('.').count();
        if count > MAX_SEGMENTS {
            return Err(format!(
                "JSON path `{s}` has {count} segments; at most {MAX_SEGMENTS} are allowed"
            ));
        }
        let mut segments = Vec::with_capacity(count);
        for (n, segment) in s.split('.').enumerate() {
            if segment.is_empty() {
                return Err(format!(
                    "JSON path `{s}` has an empty segment (segment {} of {count}); segments are object keys \
                     separated by single dots, with no leading or trailing dot",
                    n + 1
                ));
            }
            if segment.len() > MAX_SEGMENT_LEN {
                return Err(format!(
                    "JSON path `{s}`: segment {} is {} bytes long; at most {MAX_SEGMENT_LEN} bytes are allowed",
                    n + 1,
                    segment.len()
                ));
            }
            segments.push(segment.to_owned());
        }
        Ok(JsonPath {
            text: s.to_owned(),
            segments,
        })
    }

    /// The path exactly as it was given to [`JsonPath::parse`] (for logs, metrics and docs).
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

impl fmt::Display for JsonPath {
    /// Writes the path exactly as it was given to [`JsonPath::parse`].
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// How a body is framed, which decides how a [`Scanner`] reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyKind {
    /// One JSON value.
    Json,
    /// A `text/event-stream` (server-sent events) whose events carry JSON data.
    EventStream,
}

impl BodyKind {
    /// From a Content-Type value: `text/event-stream` (case-insensitive, parameters ignored) is EventStream; anything else Json.
    ///
    /// Whitespace around the media type is ignored; a missing header is [`BodyKind::Json`].
    pub fn of_content_type(ct: Option<&[u8]>) -> BodyKind {
        let Some(ct) = ct else { return BodyKind::Json };
        let media = ct.split(|&b| b == b';').next().unwrap_or_default();
        if media.trim_ascii().eq_ignore_ascii_case(b"text/event-stream") {
            BodyKind::EventStream
        } else {
            BodyKind::Json
        }
    }
}

/// Whether a body was well formed, as far as the [`Scanner`] could tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Completeness {
    /// Json: exactly one complete JSON value (whitespace around allowed). EventStream: every event whose data was not `[DONE]` held valid JSON.
    ///
    /// Events without data lines, or whose data is blank, are not judged: an empty stream, or one
    /// of comments only, is complete.
    Complete,
    /// Json: the body ended before the value was complete (or was empty). Never produced for EventStream except an unterminated final event whose JSON was incomplete.
    ///
    /// (An unterminated final event whose data is a strict prefix of `[DONE]` also counts as
    /// incomplete.) Whatever was counted before the end is still reported by [`Scanner::found`].
    Truncated,
    /// A syntax error somewhere (Json: scanning stops at the first error; EventStream: the bad event is skipped, later events still scanned).
    ///
    /// For an event stream this includes an event that was ended by its blank line while its JSON
    /// was still incomplete, and an event holding more than one JSON value. Values counted before
    /// the error still count.
    Malformed,
}

/// Reads a streamed body chunk by chunk and reports the largest number found at each path.
///
/// Memory is fixed at [`Scanner::new`] and independent of the input; [`Scanner::feed`] never
/// allocates and never buffers more than 64 bytes of a key or 40 bytes of a matched value. The
/// results do not depend on how the body is split into chunks. The scanner is `Send` and
/// `'static`: it owns a copy of its paths.
#[derive(Debug)]
pub struct Scanner {
    /// How the body is framed.
    kind: BodyKind,
    /// The JSON scan (of the whole body, or of the current event's data).
    json: JsonScan,
    /// The event-stream line state (unused for JSON bodies).
    sse: Sse,
    /// Bytes of the leading byte-order mark seen so far, or [`BOM_DONE`].
    bom: u8,
    /// Bytes fed so far.
    fed: u64,
    /// The verdict of the first [`Scanner::finish`].
    result: Option<Completeness>,
}

impl Scanner {
    /// A scanner for a body of the given kind, looking for each of `paths` (reported by index).
    pub fn new(paths: &[JsonPath], kind: BodyKind) -> Scanner {
        Scanner {
            kind,
            json: JsonScan::new(paths.to_vec()),
            sse: Sse {
                line: Line::Start,
                data_lines: 0,
                done: 0,
                malformed: false,
            },
            bom: 0,
            fed: 0,
            result: None,
        }
    }

    /// Scans the next chunk of the body. Chunks may be split anywhere and may be empty.
    ///
    /// Never allocates. Input fed after [`Scanner::finish`] is counted by [`Scanner::fed`] but
    /// otherwise ignored; so is the rest of a JSON body after its first syntax error.
    pub fn feed(&mut self, chunk: &[u8]) {
        self.fed = self.fed.saturating_add(chunk.len() as u64);
        if self.result.is_some() {
            return;
        }
        let mut chunk = chunk;
        while self.bom < BOM_DONE {
            let Some((&b, rest)) = chunk.split_first() else { return };
            if BOM.get(usize::from(self.bom)) == Some(&b) {
                self.bom += 1;
                chunk = rest;
            } else {
                if self.bom > 0 {
                    self.partial_bom();
                }
                self.bom = BOM_DONE;
            }
        }
        match self.kind {
            BodyKind::Json => self.json.feed(chunk),
            BodyKind::EventStream => self.sse.feed(chunk, &mut self.json),
        }
    }

    /// The body ended: close a pending event / check the JSON value completed. Idempotent.
    ///
    /// A number still being read counts now (the end of the body ends its token). In an event
    /// stream, a final event without its terminating blank line is closed as if it had one,
    /// except that incomplete JSON there is [`Completeness::Truncated`] rather than malformed.
    /// Later calls return the first verdict and change nothing.
    pub fn finish(&mut self) -> Completeness {
        if let Some(result) = self.result {
            return result;
        }
        if self.bom > 0 && self.bom < BOM_DONE {
            self.partial_bom();
            self.bom = BOM_DONE;
        }
        let result = match self.kind {
            BodyKind::Json => self.json.finish(),
            BodyKind::EventStream => self.sse.finish(&mut self.json),
        };
        self.result = Some(result);
        result
    }

    /// Largest value seen at path `i` anywhere in the body (all duplicates, all events); None if never seen as a usable number.
    ///
    /// `i` indexes the paths given to [`Scanner::new`]; an index out of range is `None`.
    pub fn found(&self, i: usize) -> Option<u64> {
        self.json.found.get(i).copied().flatten()
    }

    /// Bytes fed so far.
    pub fn fed(&self) -> u64 {
        self.fed
    }

    /// The body began with part of a byte-order mark and then something else.
    fn partial_bom(&mut self) {
        match self.kind {
            // 0xEF cannot start a JSON value.
            BodyKind::Json => self.json.fail(),
            // The line begins with a field name that is not `data`: ignore it.
            BodyKind::EventStream => self.sse.line = Line::Skip,
        }
    }
}

/// The kind of the innermost open container.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// None is open: the top-level value.
    Top,
    /// An object.
    Obj,
    /// An array.
    Arr,
    /// Deeper than [`TRACKED_DEPTH`] and not known since a nested container closed.
    Unknown,
}

/// What the string being read is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// An object key.
    Key,
    /// A value.
    Value,
    /// A member of an untracked container: a key if a `:` follows, else a value.
    KeyOrValue,
}

/// What the token being read is kept for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cap {
    /// Nothing: skip it.
    None,
    /// A key some path may match at this depth.
    Key,
    /// A value at a matched path.
    Value,
}

/// Where in a number the scan is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Num {
    /// After `-`.
    Minus,
    /// After a leading `0`.
    Zero,
    /// In the integer digits.
    Int,
    /// After `.`.
    Dot,
    /// In the fraction digits.
    Frac,
    /// After `e` or `E`.
    ExpMark,
    /// After the exponent's sign.
    ExpSign,
    /// In the exponent digits.
    Exp,
}

impl Num {
    /// Whether a number may end here.
    fn can_end(self) -> bool {
        matches!(self, Num::Zero | Num::Int | Num::Frac | Num::Exp)
    }
}

/// The JSON scanner's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum St {
    /// Expecting a value: at the top, after `:`, or after `,` in an array.
    Value,
    /// After `[`: a value or `]`.
    ArrFirst,
    /// After `{`: a key or `}`.
    ObjFirst,
    /// After `,` in an object: a key.
    ObjKey,
    /// After a key: `:`.
    Colon,
    /// After a value: `,` or the container's closer (only whitespace at the top).
    After,
    /// After `,` in an untracked container: a key or a value.
    UnkElem,
    /// After a string that may be a key or a value in an untracked container.
    UnkStrEnd,
    /// Inside a string.
    Str,
    /// After a backslash in a string.
    Esc,
    /// In a `\u` escape, after `uni_n` hex digits.
    Uni,
    /// Inside a number, at `num`.
    Num,
    /// Inside literal `lit` ([`LITERALS`]), `lit_pos` bytes matched.
    Lit,
    /// A syntax error was found; input is ignored.
    Error,
}

/// A streaming JSON validator that records the values at its paths.
#[derive(Debug)]
struct JsonScan {
    st: St,
    /// The innermost open container's kind.
    kind: Kind,
    /// Open containers.
    depth: u32,
    /// Bit `d - 1` is set when the container at depth `d` (1..=64) is an object.
    obj_bits: u64,
    /// What the current string is.
    role: Role,
    /// What the current token is kept for.
    cap: Cap,
    /// The key just read completes some path: the value after it is kept.
    key_hit: bool,
    /// A non-whitespace byte was seen.
    started: bool,
    /// Where in the current number the scan is.
    num: Num,
    /// The current literal ([`LITERALS`] index) and how many of its bytes matched.
    lit: u8,
    lit_pos: u8,
    /// Hex digits of the current `\u` escape read so far.
    uni_n: u8,
    /// The `\u` escape's code unit so far.
    uni: u16,
    /// A high surrogate waiting for its low half (0 if none); only while capturing.
    hi_sur: u16,
    /// Bytes kept in `cap_buf`.
    cap_len: u8,
    /// More bytes came than could be kept.
    cap_over: bool,
    /// Every byte of the token so far was an ASCII digit.
    cap_digits: bool,
    /// The kept bytes of the current key or matched value (unescaped).
    cap_buf: [u8; MAX_SEGMENT_LEN],
    paths: Vec<JsonPath>,
    /// Per path: how many leading segments the open chain of object keys matches. Levels
    /// `1..=matched[i]` are objects whose current keys equal the first segments. Never above 16.
    matched: Vec<u8>,
    /// An upper bound on the largest of `matched`: keys deeper than one level below it cannot
    /// be the next segment of any path, so they are skipped without looking at the paths.
    matched_max: u8,
    /// Per path: the largest usable value seen (kept across events).
    found: Vec<Option<u64>>,
}

impl JsonScan {
    fn new(paths: Vec<JsonPath>) -> JsonScan {
        let n = paths.len();
        JsonScan {
            st: St::Value,
            kind: Kind::Top,
            depth: 0,
            obj_bits: 0,
            role: Role::Value,
            cap: Cap::None,
            key_hit: false,
            started: false,
            num: Num::Int,
            lit: 0,
            lit_pos: 0,
            uni_n: 0,
            uni: 0,
            hi_sur: 0,
            cap_len: 0,
            cap_over: false,
            cap_digits: true,
            cap_buf: [0; MAX_SEGMENT_LEN],
            paths,
            matched: vec![0; n],
            matched_max: 0,
            found: vec![None; n],
        }
    }

    /// Starts a fresh value (the next event), keeping what was found.
    fn reset(&mut self) {
        self.st = St::Value;
        self.kind = Kind::Top;
        self.depth = 0;
        self.key_hit = false;
        self.started = false;
        self.cap = Cap::None;
        self.hi_sur = 0;
        self.matched.fill(0);
        self.matched_max = 0;
    }

    fn fail(&mut self) {
        self.st = St::Error;
        self.cap = Cap::None;
    }

    fn feed(&mut self, input: &[u8]) {
        let mut i = 0;
        while let Some(&b) = input.get(i) {
            match self.st {
                St::Str => {
                    // Plain content up to the next quote, backslash or control byte, in one scan.
                    let rest = &input[i..];
                    let stop = rest.iter().position(|&b| STR_STOP[usize::from(b)]);
                    if self.cap != Cap::None {
                        let run = &rest[..stop.unwrap_or(rest.len())];
                        if !run.is_empty() {
                            self.flush_surrogate();
                            self.push_bytes(run);
                        }
                    }
                    let Some(k) = stop else { return };
                    i += k;
                    let b = input[i];
                    i += 1;
                    match b {
                        b'"' => {
                            self.end_string();
                            self.after_token(input, &mut i);
                        }
                        b'\\' => self.st = St::Esc,
                        _ => self.fail(),
                    }
                }
                St::Num => loop {
                    // The whole number in this loop, without going back to the dispatch.
                    if self.cap == Cap::None && matches!(self.num, Num::Int | Num::Frac | Num::Exp) {
                        match input[i..].iter().position(|b| !b.is_ascii_digit()) {
                            Some(k) => i += k,
                            None => return,
                        }
                    }
                    let Some(&b) = input.get(i) else { return };
                    if !self.number(b) {
                        self.after_token(input, &mut i);
                        break;
                    }
                    i += 1;
                    if self.st != St::Num {
                        break;
                    }
                },
                St::After => {
                    if skip_ws(input, &mut i).is_none() {
                        return;
                    }
                    let before = i;
                    self.after_token(input, &mut i);
                    if i == before {
                        // Not a byte that may follow a value.
                        self.fail();
                    }
                }
                St::Colon => {
                    let Some(b) = skip_ws(input, &mut i) else { return };
                    i += 1;
                    if b == b':' {
                        self.st = St::Value;
                    } else {
                        self.fail();
                    }
                }
                St::Value => {
                    let Some(b) = skip_ws(input, &mut i) else { return };
                    i += 1;
                    self.value_start(b);
                }
                St::ObjKey => {
                    let Some(b) = skip_ws(input, &mut i) else { return };
                    i += 1;
                    if b == b'"' {
                        self.key_start();
                    } else {
                        self.fail();
                    }
                }
                St::ObjFirst => {
                    let Some(b) = skip_ws(input, &mut i) else { return };
                    i += 1;
                    match b {
                        b'"' => self.key_start(),
                        b'}' => self.pop(),
                        _ => self.fail(),
                    }
                }
                St::ArrFirst => {
                    let Some(b) = skip_ws(input, &mut i) else { return };
                    i += 1;
                    if b == b']' {
                        self.pop();
                    } else {
                        self.value_start(b);
                    }
                }
                St::UnkElem => {
                    let Some(b) = skip_ws(input, &mut i) else { return };
                    if b == b'"' {
                        i += 1;
                        self.role = Role::KeyOrValue;
                        self.cap = Cap::None;
                        self.st = St::Str;
                    } else {
                        // Not a string, so not a key: the container is an array. Read `b` again
                        // as a value.
                        self.kind = Kind::Arr;
                        self.st = St::Value;
                    }
                }
                St::UnkStrEnd => {
                    let Some(b) = skip_ws(input, &mut i) else { return };
                    i += 1;
                    self.unknown_str_end(b);
                }
                St::Esc => {
                    i += 1;
                    self.escape(b);
                }
                St::Uni => {
                    i += 1;
                    self.hex(b);
                }
                St::Lit => {
                    i += 1;
                    self.literal(b);
                    if self.st == St::After {
                        self.after_token(input, &mut i);
                    }
                }
                St::Error => return,
            }
        }
    }

    /// The fast path after a token: consumes the structural bytes that commonly follow one
    /// directly (`:` after a key; `,`, `}` or `]` after a value; then the first byte of the next
    /// key or value), sparing a trip through the state dispatch per byte. Leaves anything else,
    /// whitespace included, to [`JsonScan::feed`].
    #[inline(always)]
    fn after_token(&mut self, input: &[u8], i: &mut usize) {
        loop {
            let Some(&b) = input.get(*i) else { return };
            match (self.st, b) {
                (St::Colon, b':') => {
                    *i += 1;
                    self.st = St::Value;
                }
                (St::After, b',' | b'}' | b']') => {
                    *i += 1;
                    self.after(b);
                    if self.st == St::After {
                        // A container closed: another closer or a comma may follow.
                        continue;
                    }
                }
                _ => return,
            }
            match (self.st, input.get(*i)) {
                (St::Value, Some(&v)) if !is_ws(v) => {
                    *i += 1;
                    self.value_start(v);
                }
                (St::ObjKey, Some(b'"')) => {
                    *i += 1;
                    self.key_start();
                }
                _ => {}
            }
            return;
        }
    }

    /// The input ended: ends a pending number and says whether one complete value was read.
    fn finish(&mut self) -> Completeness {
        if self.st == St::Num {
            if !self.num.can_end() {
                return Completeness::Truncated;
            }
            self.end_number();
        }
        match self.st {
            St::Error => Completeness::Malformed,
            St::After if self.depth == 0 => Completeness::Complete,
            _ => Completeness::Truncated,
        }
    }

    /// A non-whitespace byte after a string that may be a key or a value, in an untracked
    /// container.
    fn unknown_str_end(&mut self, b: u8) {
        match b {
            b':' => {
                self.kind = Kind::Obj;
                self.st = St::Value;
            }
            b',' => {
                self.kind = Kind::Arr;
                self.st = St::Value;
            }
            b']' => self.pop(),
            _ => self.fail(),
        }
    }

    /// The first byte of a value.
    fn value_start(&mut self, b: u8) {
        let hit = std::mem::replace(&mut self.key_hit, false);
        self.started = true;
        self.cap = Cap::None;
        match b {
            b'{' => {
                if self.push(Kind::Obj) {
                    self.st = St::ObjFirst;
                }
            }
            b'[' => {
                if self.push(Kind::Arr) {
                    self.st = St::ArrFirst;
                }
            }
            b'"' => {
                self.role = Role::Value;
                self.st = St::Str;
                if hit {
                    self.begin_capture(Cap::Value);
                }
            }
            b'-' | b'0'..=b'9' => {
                self.st = St::Num;
                self.num = match b {
                    b'-' => Num::Minus,
                    b'0' => Num::Zero,
                    _ => Num::Int,
                };
                if hit {
                    self.begin_capture(Cap::Value);
                    self.push_bytes(&[b]);
                }
            }
            b't' | b'f' | b'n' => {
                self.st = St::Lit;
                self.lit = match b {
                    b't' => 0,
                    b'f' => 1,
                    _ => 2,
                };
                self.lit_pos = 1;
            }
            _ => self.fail(),
        }
    }

    /// A non-whitespace byte after a value.
    fn after(&mut self, b: u8) {
        match (b, self.kind) {
            (b',', Kind::Obj) => self.st = St::ObjKey,
            (b',', Kind::Arr) => self.st = St::Value,
            (b',', Kind::Unknown) => self.st = St::UnkElem,
            (b'}', Kind::Obj | Kind::Unknown) | (b']', Kind::Arr | Kind::Unknown) => self.pop(),
            _ => self.fail(),
        }
    }

    /// Opens a container; false (and malformed) if that is too deep.
    fn push(&mut self, kind: Kind) -> bool {
        if self.depth >= MAX_DEPTH {
            self.fail();
            return false;
        }
        self.depth += 1;
        if self.depth <= TRACKED_DEPTH {
            let bit = 1u64 << (self.depth - 1);
            if kind == Kind::Obj {
                self.obj_bits |= bit;
            } else {
                self.obj_bits &= !bit;
            }
        }
        self.kind = kind;
        true
    }

    /// Closes the innermost container (the caller checked there is one).
    fn pop(&mut self) {
        self.depth = self.depth.saturating_sub(1);
        let d = self.depth;
        self.kind = if d == 0 {
            Kind::Top
        } else if d <= TRACKED_DEPTH {
            if (self.obj_bits >> (d - 1)) & 1 == 1 {
                Kind::Obj
            } else {
                Kind::Arr
            }
        } else {
            Kind::Unknown
        };
        if u32::from(self.matched_max) > d {
            // The keys below this level no longer stand.
            for m in &mut self.matched {
                if u32::from(*m) > d {
                    *m = d as u8;
                }
            }
            self.matched_max = d as u8;
        }
        self.st = St::After;
    }

    /// The opening quote of a key in an object at the current depth.
    fn key_start(&mut self) {
        self.role = Role::Key;
        self.st = St::Str;
        self.cap = Cap::None;
        self.key_hit = false;
        let d = self.depth as usize;
        if d == 0 || d > MAX_SEGMENTS || usize::from(self.matched_max) + 1 < d {
            return;
        }
        let mut candidate = false;
        let mut max = 0;
        for (path, m) in self.paths.iter().zip(self.matched.iter_mut()) {
            // The previous key at this level no longer stands.
            if usize::from(*m) >= d {
                *m = (d - 1) as u8;
            }
            candidate |= usize::from(*m) + 1 == d && path.segments.len() >= d;
            max = max.max(*m);
        }
        self.matched_max = max;
        if candidate {
            self.begin_capture(Cap::Key);
        }
    }

    /// The closing quote of a captured key: advance the paths whose next segment it is.
    fn key_end(&mut self) {
        if self.cap != Cap::Key {
            return;
        }
        let d = self.depth as usize;
        let key = &self.cap_buf[..usize::from(self.cap_len)];
        let mut hit = false;
        for (path, m) in self.paths.iter().zip(self.matched.iter_mut()) {
            if usize::from(*m) + 1 == d
                && d.checked_sub(1)
                    .and_then(|s| path.segments.get(s))
                    .is_some_and(|s| s.as_bytes() == key)
            {
                *m = d as u8;
                self.matched_max = self.matched_max.max(*m);
                hit |= path.segments.len() == d;
            }
        }
        self.key_hit = hit;
    }

    fn end_string(&mut self) {
        if self.cap != Cap::None {
            self.flush_surrogate();
        }
        match self.role {
            Role::Key => {
                self.key_end();
                self.st = St::Colon;
            }
            Role::Value => {
                if self.cap == Cap::Value {
                    self.record();
                }
                self.st = St::After;
            }
            Role::KeyOrValue => self.st = St::UnkStrEnd,
        }
        self.cap = Cap::None;
    }

    /// The byte after a backslash.
    fn escape(&mut self, b: u8) {
        let out = match b {
            b'"' | b'\\' | b'/' => b,
            b'b' => 0x08,
            b'f' => 0x0C,
            b'n' => b'\n',
            b'r' => b'\r',
            b't' => b'\t',
            b'u' => {
                self.uni = 0;
                self.uni_n = 0;
                self.st = St::Uni;
                return;
            }
            _ => return self.fail(),
        };
        self.st = St::Str;
        self.cap_byte(out);
    }

    /// The next hex digit of a `\u` escape.
    fn hex(&mut self, b: u8) {
        let v = match b {
            b'0'..=b'9' => b - b'0',
            b'a'..=b'f' => b - b'a' + 10,
            b'A'..=b'F' => b - b'A' + 10,
            _ => return self.fail(),
        };
        self.uni = (self.uni << 4) | u16::from(v);
        self.uni_n += 1;
        if self.uni_n == 4 {
            self.st = St::Str;
            if self.cap != Cap::None {
                self.code_unit(self.uni);
            }
        }
    }

    /// A UTF-16 code unit from a `\u` escape, while capturing.
    fn code_unit(&mut self, unit: u16) {
        if self.hi_sur != 0 {
            let hi = std::mem::replace(&mut self.hi_sur, 0);
            if (0xDC00..=0xDFFF).contains(&unit) {
                let c = 0x10000 + ((u32::from(hi) - 0xD800) << 10) + (u32::from(unit) - 0xDC00);
                self.push_char(c);
                return;
            }
            self.push_char(0xFFFD);
        }
        match unit {
            0xD800..=0xDBFF => self.hi_sur = unit,
            0xDC00..=0xDFFF => self.push_char(0xFFFD),
            _ => self.push_char(u32::from(unit)),
        }
    }

    /// A pending high surrogate is not followed by its low half: it becomes U+FFFD.
    fn flush_surrogate(&mut self) {
        if self.hi_sur != 0 {
            self.hi_sur = 0;
            self.push_char(0xFFFD);
        }
    }

    /// One byte of string content from a simple escape.
    fn cap_byte(&mut self, b: u8) {
        if self.cap != Cap::None {
            self.flush_surrogate();
            self.push_bytes(&[b]);
        }
    }

    fn push_char(&mut self, c: u32) {
        let c = char::from_u32(c).unwrap_or(char::REPLACEMENT_CHARACTER);
        let mut utf8 = [0; 4];
        self.push_bytes(c.encode_utf8(&mut utf8).as_bytes());
    }

    fn begin_capture(&mut self, cap: Cap) {
        self.cap = cap;
        self.cap_len = 0;
        self.cap_over = false;
        self.cap_digits = true;
        self.hi_sur = 0;
    }

    /// Keeps bytes of the captured token, up to its limit; gives up on a key too long to
    /// match (a value too long to keep still counts, as the most it could be).
    fn push_bytes(&mut self, bytes: &[u8]) {
        let limit = if self.cap == Cap::Key {
            MAX_SEGMENT_LEN
        } else {
            MAX_VALUE_LEN
        };
        for &b in bytes {
            self.cap_digits &= b.is_ascii_digit();
            let len = usize::from(self.cap_len);
            if len < limit {
                self.cap_buf[len] = b;
                self.cap_len += 1;
            } else {
                self.cap_over = true;
            }
        }
        if self.cap_over && self.cap == Cap::Key {
            self.cap = Cap::None;
            self.hi_sur = 0;
        }
    }

    /// The next byte of a number; false if it ended the number (the byte belongs to what
    /// follows).
    fn number(&mut self, b: u8) -> bool {
        let n = self.num;
        let next = match (n, b) {
            (Num::Minus, b'0') => Num::Zero,
            (Num::Minus | Num::Int, b'0'..=b'9') => Num::Int,
            (Num::Zero | Num::Int, b'.') => Num::Dot,
            (Num::Dot | Num::Frac, b'0'..=b'9') => Num::Frac,
            (Num::Zero | Num::Int | Num::Frac, b'e' | b'E') => Num::ExpMark,
            (Num::ExpMark, b'+' | b'-') => Num::ExpSign,
            (Num::ExpMark | Num::ExpSign | Num::Exp, b'0'..=b'9') => Num::Exp,
            _ if n.can_end() => {
                self.end_number();
                return false;
            }
            _ => {
                self.fail();
                return true;
            }
        };
        self.num = next;
        if self.cap == Cap::Value {
            self.push_bytes(&[b]);
        }
        true
    }

    fn end_number(&mut self) {
        if self.cap == Cap::Value {
            self.record();
        }
        self.cap = Cap::None;
        self.st = St::After;
    }

    /// The next byte of a literal.
    fn literal(&mut self, b: u8) {
        let Some(lit) = LITERALS.get(usize::from(self.lit)) else {
            return self.fail();
        };
        if lit.get(usize::from(self.lit_pos)) != Some(&b) {
            return self.fail();
        }
        self.lit_pos += 1;
        if usize::from(self.lit_pos) == lit.len() {
            self.st = St::After;
        }
    }

    /// The captured value ended: count it for every path it completes.
    fn record(&mut self) {
        // Too long to read exactly (`4000.000…0`, which a JSON reader takes for 4000): counted
        // as the most it could be, so a spelling never reserves or charges less.
        let value = if self.cap_over {
            Some(u64::MAX)
        } else {
            usable_number(&self.cap_buf[..usize::from(self.cap_len)])
        };
        let Some(v) = value else { return };
        let d = self.depth as usize;
        for ((path, m), found) in self.paths.iter().zip(&self.matched).zip(self.found.iter_mut()) {
            if usize::from(*m) == d && path.segments.len() == d {
                *found = Some(found.map_or(v, |old| old.max(v)));
            }
        }
    }
}

/// The value of a number token or of a string's content, if it is a usable count (see the
/// module docs).
fn usable_number(text: &[u8]) -> Option<u64> {
    let text = text.trim_ascii();
    let (negative, body) = match text.split_first() {
        Some((b'-', rest)) => (true, rest),
        Some((b'+', rest)) => (false, rest),
        _ => (false, text),
    };
    let int_len = body.iter().take_while(|b| b.is_ascii_digit()).count();
    let (int, rest) = body.split_at(int_len);
    let (frac, rest) = match rest.split_first() {
        Some((b'.', rest)) => {
            let n = rest.iter().take_while(|b| b.is_ascii_digit()).count();
            rest.split_at(n)
        }
        _ => (&rest[..0], rest),
    };
    if int.is_empty() && frac.is_empty() {
        return None;
    }
    let exponent = match rest.split_first() {
        None => false,
        Some((b'e' | b'E', exp)) => {
            let digits = match exp.split_first() {
                Some((b'+' | b'-', digits)) => digits,
                _ => exp,
            };
            if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
                return None;
            }
            true
        }
        Some(_) => return None,
    };
    if negative {
        // Every negative number's ceiling is at most 0.
        return Some(0);
    }
    if exponent {
        let f: f64 = std::str::from_utf8(text).ok()?.parse().ok()?;
        return Some(ceil_to_u64(f));
    }
    let mut v: u64 = 0;
    for &d in int {
        match v.checked_mul(10).and_then(|v| v.checked_add(u64::from(d - b'0'))) {
            Some(next) => v = next,
            None => return Some(u64::MAX),
        }
    }
    if frac.iter().any(|&d| d != b'0') {
        v = v.saturating_add(1);
    }
    Some(v)
}

/// The ceiling of `f` as a count: negative → 0, too large or non-finite → `u64::MAX`.
fn ceil_to_u64(f: f64) -> u64 {
    if f.is_nan() {
        u64::MAX
    } else if f <= 0.0 {
        0
    } else {
        let c = f.ceil();
        // 2^64 is exactly representable; anything at or above it saturates.
        if c >= 18_446_744_073_709_551_616.0 {
            u64::MAX
        } else {
            c as u64
        }
    }
}

mod event_stream;
use event_stream::{Line, Sse};

#[cfg(test)]
mod tests;
