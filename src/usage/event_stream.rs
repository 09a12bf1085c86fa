//! The event-stream (`text/event-stream`) side of the usage scanner: the WHATWG line rules,
//! each event's `data` fed to the JSON scan as it arrives (never buffered), `[DONE]` told
//! apart incrementally.

use super::{Completeness, JsonScan, DATA, DONE, DONE_MISMATCH};

/// Where in a line of an event stream the scan is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Line {
    /// At the start of a line.
    Start,
    /// At the start of a line that follows a `\r`: a `\n` here belongs to that line end.
    StartCr,
    /// This many bytes (1..=4) of the field name `data` matched.
    Name(u8),
    /// After `data:`: one optional space.
    Space,
    /// In a data value, streamed to the JSON scan.
    Data,
    /// In a line that is ignored (comment, other field), up to its end.
    Skip,
}

/// The event-stream layer: splits lines, streams data values into the JSON scan and judges
/// events.
#[derive(Debug)]
pub(super) struct Sse {
    pub(super) line: Line,
    /// Data lines in the current event: 0, 1, or 2 for two or more.
    pub(super) data_lines: u8,
    /// Bytes of `[DONE]` the first data line matched so far, or [`DONE_MISMATCH`].
    pub(super) done: u8,
    /// Some closed event's data was not valid JSON.
    pub(super) malformed: bool,
}

/// The line state after a line ended with `b`.
fn line_end(b: u8) -> Line {
    if b == b'\r' {
        Line::StartCr
    } else {
        Line::Start
    }
}

impl Sse {
    pub(super) fn feed(&mut self, input: &[u8], json: &mut JsonScan) {
        let mut i = 0;
        while i < input.len() {
            let b = input[i];
            match self.line {
                Line::StartCr if b == b'\n' => {
                    i += 1;
                    self.line = Line::Start;
                }
                Line::Start | Line::StartCr => {
                    i += 1;
                    self.line = match b {
                        b'\r' | b'\n' => {
                            // A blank line: dispatch the event.
                            if self.close_event(json).is_some_and(|c| c != Completeness::Complete) {
                                self.malformed = true;
                            }
                            line_end(b)
                        }
                        b'd' => Line::Name(1),
                        _ => Line::Skip,
                    };
                }
                Line::Name(n) => {
                    i += 1;
                    self.line = match b {
                        b'\r' | b'\n' => {
                            if n == 4 {
                                // `data` without a colon: a data line with an empty value.
                                self.begin_data(json);
                            }
                            line_end(b)
                        }
                        b':' if n == 4 => Line::Space,
                        _ if DATA.get(usize::from(n)) == Some(&b) => Line::Name(n + 1),
                        _ => Line::Skip,
                    };
                }
                Line::Space => {
                    if b == b' ' {
                        i += 1;
                    }
                    self.begin_data(json);
                    self.line = Line::Data;
                }
                Line::Data => {
                    let rest = &input[i..];
                    let len = rest
                        .iter()
                        .position(|&c| c == b'\r' || c == b'\n')
                        .unwrap_or(rest.len());
                    if len > 0 {
                        let value = &rest[..len];
                        self.track_done(value);
                        json.feed(value);
                        i += len;
                    }
                    if let Some(&c) = input.get(i) {
                        i += 1;
                        self.line = line_end(c);
                    }
                }
                Line::Skip => match input[i..].iter().position(|&c| c == b'\r' || c == b'\n') {
                    Some(k) => {
                        self.line = line_end(input[i + k]);
                        i += k + 1;
                    }
                    None => return,
                },
            }
        }
    }

    /// A data line begins.
    fn begin_data(&mut self, json: &mut JsonScan) {
        if self.data_lines > 0 {
            // Data lines are joined with `\n` (JSON whitespace, or a raw control character
            // inside a string). It is fed only between lines, as the data ends without one.
            json.feed(b"\n");
            self.done = DONE_MISMATCH;
        }
        self.data_lines = (self.data_lines + 1).min(2);
    }

    /// Compares more of a data value against `[DONE]`, without keeping it.
    fn track_done(&mut self, value: &[u8]) {
        match DONE.get(usize::from(self.done)..) {
            Some(rest) if value.len() <= rest.len() && rest.starts_with(value) => self.done += value.len() as u8,
            _ => self.done = DONE_MISMATCH,
        }
    }

    /// Ends the current event and starts a fresh JSON scan. Returns the verdict on its data:
    /// `None` if it had none that is JSON (no data lines, blank data, `[DONE]`).
    fn close_event(&mut self, json: &mut JsonScan) -> Option<Completeness> {
        if self.data_lines == 0 {
            return None;
        }
        let verdict = if self.data_lines == 1 && usize::from(self.done) == DONE.len() || !json.started {
            None
        } else {
            Some(json.finish())
        };
        json.reset();
        self.data_lines = 0;
        self.done = 0;
        verdict
    }

    /// The stream ended: close a pending event and judge the stream.
    pub(super) fn finish(&mut self, json: &mut JsonScan) -> Completeness {
        if matches!(self.line, Line::Name(4) | Line::Space) {
            // A final `data` / `data:` line without a line end.
            self.begin_data(json);
        }
        self.line = Line::Start;
        // A final event cut inside `[DONE]` is cut short, not malformed.
        let done_prefix = self.data_lines == 1 && (1..DONE.len()).contains(&usize::from(self.done));
        let verdict = self.close_event(json);
        if self.malformed {
            return Completeness::Malformed;
        }
        match verdict {
            Some(Completeness::Malformed) if done_prefix => Completeness::Truncated,
            Some(verdict) => verdict,
            None => Completeness::Complete,
        }
    }
}
