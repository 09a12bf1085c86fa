//! A fast reader for the common layout of `keys.yaml`, used before the YAML parser.
//!
//! The YAML parser reads about 10 MB a second, so a registry of a million keys (a 120 MB file)
//! took 15 s to parse. Registries that big are generated, and generated files have one simple
//! shape: `keys:` and a sequence of maps of plain or simply quoted scalars, one flow map a line
//! (`- { id: a, sha256: …, tier: pro }`) or one block map per entry (`- id: a` and indented
//! `sha256: …` lines). This reader accepts exactly that subset of YAML, and for it gives the
//! same values and the same `line:col` positions the parser would. Anything else — a tab, an
//! escape, a null, an anchor, a key it does not know, a non-ASCII value, a syntax error —
//! makes it answer [`Scan::Other`] and the caller parses the file with the YAML parser, so
//! every file means what YAML says it means and every error is the parser's own.

/// One scalar of an entry: its text (without quotes) and where it starts (1-based line and
/// column, the quote for a quoted scalar, as the YAML parser reports it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Field<'a> {
    /// The value.
    pub(crate) text: &'a str,
    /// Line and column.
    pub(crate) at: (u64, u64),
}

/// One key entry as written.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Entry<'a> {
    /// The `id:` field, with its position (required: names the key in logs and rules).
    pub(crate) id: Option<Field<'a>>,
    /// The `sha256:` field: the hex SHA-256 of the key (the key itself is never stored).
    pub(crate) sha256: Option<Field<'a>>,
    /// The `tier:` field, when written.
    pub(crate) tier: Option<Field<'a>>,
    /// The `org:` field, when written.
    pub(crate) org: Option<Field<'a>>,
}

/// What [`scan`] made of a file.
#[derive(Debug)]
pub(crate) enum Scan<E> {
    /// The whole file is in the simple layout; each entry was handed to the callback until it
    /// returned its first error (kept here).
    Read {
        /// The callback's first error.
        error: Option<E>,
    },
    /// Not the simple layout, or more than `max_entries` entries: use the YAML parser.
    Other,
}

/// Scalar bytes one entry may hold (keys and values). Well inside the YAML parser's per-entry
/// budget, so a file this reader accepts is never one the parser's budget would refuse.
const MAX_ENTRY_BYTES: usize = 400;

/// Read `input` line by line (a registry is never held in memory whole); hand each entry, in
/// file order, to `each`. After `each` returns an error the rest of the file is still checked
/// for the layout (the parser reads the whole file before any entry is validated, so a syntax
/// error further down must win), but not handed on. A read error or text that is not UTF-8 is
/// [`Scan::Other`]: the YAML path reads the file again and reports it.
pub(crate) fn scan<E>(
    mut input: impl std::io::BufRead,
    max_entries: usize,
    mut each: impl FnMut(Entry<'_>) -> Result<(), E>,
) -> Scan<E> {
    let mut seen_keys = false;
    // The indentation of the sequence's dashes, fixed by the first entry.
    let mut seq_indent: Option<usize> = None;
    // A block entry being read (its lines are gone once read: its values are copied).
    let mut block: Option<Pending> = None;
    let mut entries = 0usize;
    let mut error: Option<E> = None;
    let mut finish = |e: Entry<'_>, entries: &mut usize, error: &mut Option<E>| -> bool {
        if e.id.is_none() || e.sha256.is_none() {
            return false;
        }
        *entries += 1;
        if *entries > max_entries {
            return false;
        }
        if error.is_none() {
            if let Err(x) = each(e) {
                *error = Some(x);
            }
        }
        true
    };

    let mut buf = String::new();
    let mut line_no: u64 = 0;
    loop {
        buf.clear();
        match input.read_line(&mut buf) {
            Ok(0) => break,
            Ok(_) => {}
            Err(_) => return Scan::Other,
        }
        line_no += 1;
        let line = buf.strip_suffix('\n').unwrap_or(&buf);
        let line = line.strip_suffix('\r').unwrap_or(line);
        let b = line.as_bytes();
        let indent = b.iter().take_while(|&&c| c == b' ').count();
        if indent == b.len() {
            continue; // blank
        }
        if b[indent] == b'#' {
            if !comment_ok(&line[indent..]) {
                return Scan::Other;
            }
            continue;
        }
        if !seen_keys {
            // Only comments and blank lines before `keys:` at the start of a line.
            let Some(after) = line.strip_prefix("keys:") else {
                return Scan::Other;
            };
            if !end_ok(after) {
                return Scan::Other;
            }
            seen_keys = true;
            continue;
        }
        // A key of the block entry being read?
        if let Some(p) = &mut block {
            if indent == p.col {
                let mut one = Entry::default();
                match key_value(line, indent, line_no, &mut one, Ctx::Block) {
                    Some(used) if p.add(&one, used) => continue,
                    _ => return Scan::Other,
                }
            }
        }
        // Otherwise a new entry: `- ` at the sequence's indentation.
        if *seq_indent.get_or_insert(indent) != indent || b.get(indent + 1) != Some(&b' ') || b[indent] != b'-' {
            return Scan::Other;
        }
        if let Some(p) = block.take() {
            if !finish(p.entry(), &mut entries, &mut error) {
                return Scan::Other;
            }
        }
        let start = indent + 1 + b[indent + 1..].iter().take_while(|&&c| c == b' ').count();
        let mut entry = Entry::default();
        if b.get(start) == Some(&b'{') {
            match flow(line, start, line_no, &mut entry) {
                Some(used) if used <= MAX_ENTRY_BYTES => {}
                _ => return Scan::Other,
            }
            if !finish(entry, &mut entries, &mut error) {
                return Scan::Other;
            }
        } else {
            let Some(used) = key_value(line, start, line_no, &mut entry, Ctx::Block) else {
                return Scan::Other;
            };
            let mut p = Pending {
                col: start,
                ..Pending::default()
            };
            if !p.add(&entry, used) {
                return Scan::Other;
            }
            block = Some(p);
        }
    }
    if let Some(p) = block.take() {
        if !finish(p.entry(), &mut entries, &mut error) {
            return Scan::Other;
        }
    }
    if entries == 0 {
        // `keys:` with nothing under it, or no `keys:`: rare and small; the parser says what
        // it means.
        return Scan::Other;
    }
    Scan::Read { error }
}

/// A block entry read so far: its values (copied), the column of its keys, its scalar bytes.
#[derive(Default)]
struct Pending {
    fields: [Option<(String, (u64, u64))>; 4],
    col: usize,
    bytes: usize,
}

impl Pending {
    /// Take the one field `line` has; false if the entry already has it or grows too large.
    fn add(&mut self, line: &Entry<'_>, used: usize) -> bool {
        self.bytes += used;
        let new = [line.id, line.sha256, line.tier, line.org];
        for (slot, f) in self.fields.iter_mut().zip(new) {
            if let Some(f) = f {
                if slot.is_some() {
                    return false;
                }
                *slot = Some((f.text.to_string(), f.at));
            }
        }
        self.bytes <= MAX_ENTRY_BYTES
    }

    fn entry(&self) -> Entry<'_> {
        let f = |i: usize| {
            self.fields[i].as_ref().map(|(text, at)| Field {
                text: text.as_str(),
                at: *at,
            })
        };
        Entry {
            id: f(0),
            sha256: f(1),
            tier: f(2),
            org: f(3),
        }
    }
}

/// Where a scalar is: in a flow map (ends at `,` or `}`) or a block map (ends the line).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Ctx {
    Flow,
    Block,
}

/// `{ key: value, … }` from byte `at` (the brace) to the end of the line. Returns the scalar
/// bytes read.
fn flow<'a>(line: &'a str, at: usize, line_no: u64, entry: &mut Entry<'a>) -> Option<usize> {
    let b = line.as_bytes();
    let mut i = skip_spaces(b, at + 1);
    let mut bytes = 0;
    loop {
        let (used, end) = key_value_at(line, i, line_no, entry, Ctx::Flow)?;
        bytes += used;
        i = skip_spaces(b, end);
        match b.get(i) {
            Some(b',') => i = skip_spaces(b, i + 1),
            Some(b'}') => return end_ok(&line[i + 1..]).then_some(bytes),
            _ => return None,
        }
    }
}

/// A block map's `key: value` line from byte `at`; checks that nothing but a comment follows.
/// Returns the scalar bytes read.
fn key_value<'a>(line: &'a str, at: usize, line_no: u64, entry: &mut Entry<'a>, ctx: Ctx) -> Option<usize> {
    let (used, end) = key_value_at(line, at, line_no, entry, ctx)?;
    end_ok(&line[end..]).then_some(used)
}

/// `key: value` from byte `at`: stores the value in `entry` (a key twice is not simple).
/// Returns the scalar bytes read and the byte after the value.
fn key_value_at<'a>(line: &'a str, at: usize, line_no: u64, entry: &mut Entry<'a>, ctx: Ctx) -> Option<(usize, usize)> {
    let b = line.as_bytes();
    let key_len = b[at..].iter().take_while(|c| c.is_ascii_alphanumeric()).count();
    let key = &line[at..at + key_len];
    let slot = match key {
        "id" => &mut entry.id,
        "sha256" => &mut entry.sha256,
        "tier" => &mut entry.tier,
        "org" => &mut entry.org,
        _ => return None,
    };
    if slot.is_some() || b.get(at + key_len) != Some(&b':') || b.get(at + key_len + 1) != Some(&b' ') {
        return None;
    }
    let v = skip_spaces(b, at + key_len + 1);
    let (text, end) = scalar(line, v, ctx)?;
    *slot = Some(Field {
        text,
        at: (line_no, v as u64 + 1),
    });
    Some((key_len + text.len(), end))
}

/// A scalar from byte `at`: its text and the byte after it. Plain scalars of letters, digits
/// and `_ . / + - @ =` (not starting with `-`, `@` or `=`, and not a null), or a single or
/// double quoted one of printable ASCII without escapes.
fn scalar(line: &str, at: usize, ctx: Ctx) -> Option<(&str, usize)> {
    let b = line.as_bytes();
    match *b.get(at)? {
        q @ (b'"' | b'\'') => {
            let len = b[at + 1..].iter().position(|&c| c == q)?;
            let inner = &b[at + 1..at + 1 + len];
            if inner.iter().any(|&c| !(b' '..=b'~').contains(&c) || c == b'\\') {
                return None;
            }
            let end = at + 2 + len;
            // `'it''s'` is an escaped quote.
            if b.get(end) == Some(&q) {
                return None;
            }
            Some((&line[at + 1..at + 1 + len], end))
        }
        c if c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'/' | b'+') => {
            let len = b[at..]
                .iter()
                .take_while(|&&c| {
                    c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'/' | b'+' | b'-' | b'@' | b'=')
                })
                .count();
            let text = &line[at..at + len];
            if matches!(text, "null" | "Null" | "NULL") {
                return None;
            }
            let end = at + len;
            // The scalar must end where YAML ends it: at a space, the line's end, or (in a flow
            // map) `,` / `}`.
            match (b.get(end), ctx) {
                (None | Some(b' '), _) => Some((text, end)),
                (Some(b',' | b'}'), Ctx::Flow) => Some((text, end)),
                _ => None,
            }
        }
        _ => None,
    }
}

fn skip_spaces(b: &[u8], mut i: usize) -> usize {
    while b.get(i) == Some(&b' ') {
        i += 1;
    }
    i
}

/// What may end a line after a value: spaces, then nothing or a comment (whose `#` needs a
/// space before it: right after a value it would be part of the value).
fn end_ok(rest: &str) -> bool {
    let i = skip_spaces(rest.as_bytes(), 0);
    match rest.as_bytes().get(i) {
        None => true,
        Some(b'#') if i > 0 => comment_ok(&rest[i..]),
        _ => false,
    }
}

/// A comment of characters YAML allows (printable, no byte-order mark).
fn comment_ok(c: &str) -> bool {
    c.chars().all(|c| {
        matches!(c, '\t' | ' '..='~' | '\u{85}' | '\u{A0}'..='\u{D7FF}' | '\u{E000}'..='\u{FFFD}' | '\u{10000}'..)
            && c != '\u{FEFF}'
    })
}

#[cfg(test)]
mod tests;
