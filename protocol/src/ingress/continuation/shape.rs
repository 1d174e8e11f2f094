//! Reading the plain content chunk by its shape (issue 31's CPU goal).
//!
//! A stream's content chunks differ only in their text: `id`, `model`, `created`, the choice
//! index, `"finish_reason":null` and every other field repeat byte for byte. Once a chunk has been
//! read by the full reader as plain content (text, and nothing else: no finish, tool call,
//! reasoning, usage or error), its bytes around the text's string value are kept as the stream's
//! [`Shape`]. A later chunk whose bytes are that shape with another JSON string in the text's
//! place is read without a parse: the text is the string's bytes (decoded only when they hold an
//! escape), and nothing else changes.
//!
//! Why that is exact: the two chunks tokenize alike except for the one string value, so the JSON
//! tree differs in that leaf only, and the full reader is a function of the tree. The shape is
//! kept only when that leaf is the one the reader takes as the text, and the reader reads that
//! leaf only as the text (kept, and, when not empty, ending a reasoning block the chunk does not
//! open). Which leaf it is, is known one of two ways. The typed reader names it: the text of the
//! chunk's one choice, borrowed from the chunk's bytes, is that leaf's value (no extra read).
//! Else (a chunk the `Value` reader read, or a text with an escape) a probe proves it: with the
//! chunk's own string the reader's text was that string, and the same bytes with an `x`
//! appended to the string, and with the string emptied, read as the probe's string with
//! nothing else set. Any other chunk (another shape, a string that is not valid JSON, invalid
//! UTF-8) goes to the full reader, which decides as before.
//!
//! Two more shapes are derived from the typed reader's places, by editing bytes it located:
//! - a chunk with `delta.role` (the first, most often) gives the shape without that member
//!   (and one comma) while the stream has none: the reader takes nothing from a role, so the
//!   chunk without it reads the same, and the other chunks seldom repeat it;
//! - the content shape foretells the final chunk when its finish reason is `null`: the same
//!   bytes with a string for the finish reason and no text (for chat, the `content` member
//!   gone; for either wire, the text emptied). Such a chunk reads as the end of the stream
//!   (`finish_reason` not `null`) and nothing else: the tree is the content chunk's with the
//!   finish leaf a string and the text empty or absent, which the reader takes alike.
//!
//! A derived shape is only a byte pattern to compare with; an edit that would not leave the
//! same object without the member (an escaped key, say) derives nothing.

use std::borrow::Cow;
use std::ops::Range;
use std::sync::OnceLock;

use memchr::memmem::Finder;

use serde_json::Value;

use super::typed::Leaves;
use super::{ChatSplice, Phase, SpliceWire, finder};

/// Where `text` (borrowed from `data`) lies in `data`, as the string value between quotes.
fn place(data: &[u8], text: &str) -> Option<Range<usize>> {
    let at = place_raw(data, text)?;
    let quoted =
        data.get(at.start.checked_sub(1)?) == Some(&b'"') && data.get(at.end) == Some(&b'"');
    quoted.then_some(at)
}

/// Where `raw` (borrowed from `data`) lies in `data`.
fn place_raw(data: &[u8], raw: &str) -> Option<Range<usize>> {
    let start = raw.as_ptr().addr().checked_sub(data.as_ptr().addr())?;
    let at = start..start.checked_add(raw.len())?;
    (data.get(at.clone()) == Some(raw.as_bytes())).then_some(at)
}

/// The bytes to cut from a JSON object member whose value is `data[value]` and whose key is
/// `key` (quoted, as it must appear): the member and one comma beside it, so that what is left
/// is the same object without that member. `None` when the bytes around it are not so (an
/// escaped key, say): nothing is then derived.
fn member_cut(data: &[u8], value: Range<usize>, key: &[u8]) -> Option<Range<usize>> {
    // JSON whitespace (a parsed chunk holds no other control byte between tokens).
    let ws = |b: &u8| matches!(b, b' ' | b'\t' | b'\n' | b'\r');
    let back = |mut i: usize| {
        while i > 0 && ws(&data[i - 1]) {
            i -= 1;
        }
        i
    };
    let colon = back(value.start).checked_sub(1)?;
    (data[colon] == b':').then_some(())?;
    let key_end = back(colon);
    let key_start = key_end.checked_sub(key.len())?;
    (&data[key_start..key_end] == key).then_some(())?;
    let before = back(key_start).checked_sub(1)?;
    match data[before] {
        b',' => Some(before..value.end),
        b'{' => {
            let mut after = value.end;
            while data.get(after).is_some_and(ws) {
                after += 1;
            }
            match data.get(after)? {
                b',' => Some(key_start..after + 1),
                b'}' => Some(key_start..value.end),
                _ => None,
            }
        }
        _ => None,
    }
}

/// Places in a chunk, each maybe none.
type Places<const N: usize> = [Option<Range<usize>>; N];

/// Byte edits of one chunk (ranges replaced), applied at once.
struct Edits<'a> {
    data: &'a [u8],
    edits: Vec<(Range<usize>, &'static [u8])>,
}

impl<'a> Edits<'a> {
    fn new(data: &'a [u8]) -> Self {
        Self {
            data,
            edits: Vec::new(),
        }
    }

    fn push(&mut self, range: Range<usize>, with: &'static [u8]) {
        self.edits.push((range, with));
    }

    /// The edited bytes, and where each of `ranges` lies in them: a range an edit replaced is
    /// its replacement, one no edit touches is moved. `None` when edits overlap, or a range
    /// overlaps an edit it is not.
    fn apply<const N: usize>(mut self, ranges: Places<N>) -> Option<(Vec<u8>, Places<N>)> {
        self.edits.sort_by_key(|(range, _)| range.start);
        let disjoint = self.edits.windows(2).all(|w| w[0].0.end <= w[1].0.start);
        let inside = self
            .edits
            .last()
            .is_none_or(|(r, _)| r.end <= self.data.len());
        (disjoint && inside).then_some(())?;
        // Where `at` (outside every edit, or an edit's start) moves to.
        let moved = |at: usize| {
            let shift = self
                .edits
                .iter()
                .filter(|(r, _)| r.end <= at && r.start < at);
            shift.fold(at, |at, (r, with)| at + with.len() - r.len())
        };
        let mut mapped = [const { None }; N];
        for (range, slot) in ranges.into_iter().zip(&mut mapped) {
            let Some(range) = range else {
                continue;
            };
            *slot = Some(match self.edits.iter().find(|(r, _)| *r == range) {
                Some((_, with)) => moved(range.start)..moved(range.start) + with.len(),
                None if self
                    .edits
                    .iter()
                    .any(|(r, _)| r.start < range.end && range.start < r.end) =>
                {
                    return None;
                }
                None => moved(range.start)..moved(range.end),
            });
        }
        let mut out = Vec::with_capacity(self.data.len());
        let mut at = 0;
        for (range, with) in &self.edits {
            out.extend_from_slice(&self.data[at..range.start]);
            out.extend_from_slice(with);
            at = range.end;
        }
        out.extend_from_slice(&self.data[at..]);
        Some((out, mapped))
    }
}

/// Largest chunk kept as a shape.
const MAX_SHAPE_BYTES: usize = 4096;

/// Shapes probed per stream (each costs two full reads of probe chunks).
pub(super) const MAX_SHAPE_TRIES: u8 = 4;

static ROLE_KEY: OnceLock<Finder<'static>> = OnceLock::new();
static CONTENT_KEY: OnceLock<Finder<'static>> = OnceLock::new();
static TEXT_KEY: OnceLock<Finder<'static>> = OnceLock::new();

/// A chunk's data with a hole: the string value (inside the quotes) at `data[open..close]` (the
/// text of a plain content chunk; the finish reason of a final chunk).
#[derive(Debug)]
pub(super) struct Shape {
    data: Vec<u8>,
    open: usize,
    close: usize,
}

impl Shape {
    /// A whole event at the start of `frame`: `data: `, this shape with a valid JSON string in
    /// its place, and a blank line `\n\n`: its length with the blank line, and the string.
    fn event<'a>(&self, frame: &'a [u8]) -> Option<(usize, Cow<'a, str>)> {
        let (head, tail) = (&self.data[..self.open], &self.data[self.close..]);
        let rest = frame.strip_prefix(b"data: ")?.strip_prefix(head)?;
        let (close, text) = string_body(rest)?;
        let after = rest[close..].strip_prefix(tail)?;
        if !after.starts_with(b"\n\n") || tail.ends_with(b"\r") {
            return None;
        }
        Some((frame.len() - after.len() + 2, text))
    }

    /// The string value's raw bytes when `data` is this shape with another string there.
    fn raw_text<'a>(&self, data: &'a [u8]) -> Option<&'a [u8]> {
        let (head, tail) = (&self.data[..self.open], &self.data[self.close..]);
        let middle = data.len().checked_sub(head.len() + tail.len())?;
        let (front, rest) = data.split_at(head.len());
        let (raw, back) = rest.split_at(middle);
        (front == head && back == tail).then_some(raw)
    }
}

/// The decoded value of a JSON string's raw bytes (between its quotes), or `None` when they are
/// not a valid JSON string body.
pub(super) fn decode(raw: &[u8]) -> Option<Cow<'_, str>> {
    if raw.iter().all(|&b| b >= 0x20 && b != b'"' && b != b'\\') {
        return std::str::from_utf8(raw).ok().map(Cow::Borrowed);
    }
    // An escape: serde_json's own string reading (a stray quote leaves trailing characters).
    let mut quoted = Vec::with_capacity(raw.len() + 2);
    quoted.push(b'"');
    quoted.extend_from_slice(raw);
    quoted.push(b'"');
    serde_json::from_slice::<String>(&quoted)
        .ok()
        .map(Cow::Owned)
}

/// The string values of `key` in `data`: (start, end) of each value's raw bytes. A candidate
/// only; [`ChatSplice::learn_shape`] proves the one it keeps.
fn string_values<'a>(
    data: &'a [u8],
    key: &'a memchr::memmem::Finder<'static>,
) -> impl Iterator<Item = (usize, usize)> + 'a {
    key.find_iter(data).filter_map(move |at| {
        let key = key.needle();
        let mut i = at + key.len();
        let skip = |i: &mut usize| {
            while data.get(*i).is_some_and(u8::is_ascii_whitespace) {
                *i += 1;
            }
        };
        skip(&mut i);
        (data.get(i) == Some(&b':')).then_some(())?;
        i += 1;
        skip(&mut i);
        (data.get(i) == Some(&b'"')).then_some(())?;
        let open = i + 1;
        let mut j = open;
        loop {
            j += memchr::memchr2(b'"', b'\\', data.get(j..)?)?;
            if data[j] == b'"' {
                return Some((open, j));
            }
            j += 2;
        }
    })
}

/// The JSON string body at the start of `s` (up to its closing quote), found and decoded in one
/// pass: (its length, its value), or `None` when it has no closing quote or is not a valid JSON
/// string body (what [`decode`] says of the bytes up to the first unescaped quote).
fn string_body(s: &[u8]) -> Option<(usize, Cow<'_, str>)> {
    let (mut i, mut escaped) = (0, false);
    loop {
        match *s.get(i)? {
            b'"' => break,
            b'\\' => {
                escaped = true;
                i += 2;
            }
            // A raw control character: never in a valid body.
            0..0x20 => return None,
            _ => i += 1,
        }
    }
    let raw = &s[..i];
    let text = if escaped {
        decode(raw)?
    } else {
        Cow::Borrowed(std::str::from_utf8(raw).ok()?)
    };
    Some((i, text))
}

impl ChatSplice {
    /// Reads `data` by the stream's shapes: `None` when it is none of them (the full reader then
    /// reads it). Only for an original chunk once a shape is known.
    pub(super) fn read_shaped(&mut self, data: &[u8]) -> Option<()> {
        let shape = self.shape.as_ref();
        if let Some(text) = shape.and_then(|shape| decode(shape.raw_text(data)?)) {
            self.shaped_text(&text);
            return Some(());
        }
        // As [`ChatSplice::read_shaped_event`] reads it: the final chunk's shapes next.
        let last = |shape: &Shape| decode(shape.raw_text(data)?).map(drop);
        self.last.iter().find_map(last)?;
        self.finished = true;
        Some(())
    }

    /// What the full reader does with a plain chunk of this text.
    fn shaped_text(&mut self, text: &str) {
        if !text.is_empty() {
            self.in_reasoning = false;
        }
        self.keep_text(text);
    }

    /// A whole event at the start of `frame` that is `data: `, one of the stream's shapes with a
    /// string in its place, and a blank line `\n\n`: read as [`ChatSplice::relay`] reads it (a
    /// chunk relayed as it is), and its length with the blank line returned. `None` (nothing
    /// read) for anything else: the general path reads it. The event's end is where
    /// [`super::event_end`] finds it: a shape is one data line (no line feed), a valid string
    /// body holds no control byte, and a tail ending in `\r` is left to the general path (which
    /// strips it).
    pub(super) fn read_shaped_event(&mut self, frame: &[u8]) -> Option<usize> {
        if !self.fast || self.phase != Phase::Original || self.done {
            return None;
        }
        if let Some((len, text)) = self.shape.as_ref().and_then(|shape| shape.event(frame)) {
            self.shaped_text(&text);
            self.shaped += 1;
            return Some(len);
        }
        // The final chunk as the content shape foretold it: the string is the finish reason.
        let (len, _) = self.last.iter().find_map(|shape| shape.event(frame))?;
        self.finished = true;
        self.shaped += 1;
        Some(len)
    }

    /// After the full reader read `data` (an original chunk relayed as it is) and appended the
    /// text from `before` on: keeps its shape when it proves to be a plain content chunk.
    /// `leaves` is where the typed reader took the chunk's one choice's text (and role and
    /// finish reason) from, when it did: the shape is then kept (or replaces the one that did not
    /// match) without a probe, and the final chunk's shapes are foretold from it.
    pub(super) fn learn_shape(&mut self, data: &[u8], before: usize, leaves: Option<Leaves<'_>>) {
        if !self.fast
            || data.len() > MAX_SHAPE_BYTES
            || self.refusal.is_some()
            || self.in_reasoning
            || self.finished
            || self.done
            || self.usage_tokens.is_some()
        {
            return;
        }
        if let Some(leaves) = leaves {
            self.learn_leaves(data, &leaves);
            return;
        }
        if self.text.len() == before
            || self.shape.is_some()
            || self.shape_tries >= MAX_SHAPE_TRIES
            // The first chunk's `role` is seldom repeated, nor then its shape.
            || (before == 0 && finder(&ROLE_KEY, b"\"role\"").find(data).is_some())
        {
            return;
        }
        self.shape_tries += 1;
        let key = match self.wire {
            SpliceWire::Chat => finder(&CONTENT_KEY, b"\"content\""),
            SpliceWire::Completions => finder(&TEXT_KEY, b"\"text\""),
        };
        let text = &self.text[before..];
        let found = string_values(data, key).take(4).find(|&(open, close)| {
            decode(&data[open..close]).is_some_and(|t| t == text) && self.probe(data, open, close)
        });
        if let Some((open, close)) = found {
            self.keep_shape(data.to_vec(), open..close, None);
        }
    }

    /// Keeps the shape around the typed reader's leaves. A chunk with a `role` (the first, most
    /// often) gives the shape without it while the stream has none yet: the reader takes
    /// nothing from a role, and the other chunks seldom repeat it.
    fn learn_leaves(&mut self, data: &[u8], leaves: &Leaves<'_>) {
        let Some(text) = place(data, leaves.text) else {
            return;
        };
        let finish = leaves.finish.and_then(|raw| place_raw(data, raw.get()));
        let mut edits = Edits::new(data);
        if let Some(role) = leaves.role.filter(|_| self.shape.is_none()) {
            let Some(value) = place_raw(data, role.get()) else {
                return;
            };
            let Some(cut) = member_cut(data, value, b"\"role\"") else {
                return;
            };
            edits.push(cut, b"");
        }
        let Some((data, [Some(text), finish])) = edits.apply([Some(text), finish]) else {
            return;
        };
        self.keep_shape(data, text, finish);
    }

    /// Keeps `data` (the text's string value at `text`) as the stream's shape, and, when its
    /// finish reason is `null` at `finish`, the final chunk's shapes it foretells: the same bytes
    /// with a string for the finish reason and no text (the text member gone, for chat; the text
    /// emptied).
    fn keep_shape(&mut self, data: Vec<u8>, text: Range<usize>, finish: Option<Range<usize>>) {
        self.last.clear();
        if let Some(finish) = finish.filter(|f| data.get(f.clone()) == Some(b"null".as_slice())) {
            let quoted = text.start - 1..text.end + 1;
            let member = match self.wire {
                SpliceWire::Chat => member_cut(&data, quoted, b"\"content\""),
                SpliceWire::Completions => None,
            };
            for empty in [
                member.map(|cut| (cut, b"".as_slice())),
                Some((text.clone(), b"")),
            ] {
                let Some((cut, with)) = empty else {
                    continue;
                };
                let mut edits = Edits::new(&data);
                edits.push(cut, with);
                edits.push(finish.clone(), b"\"\"");
                if let Some((last, [_, Some(hole)])) = edits.apply([None, Some(finish.clone())]) {
                    // The hole is the finish reason's string value, inside the quotes.
                    let (open, close) = (hole.start + 1, hole.end - 1);
                    self.last.push(Shape {
                        data: last,
                        open,
                        close,
                    });
                }
            }
        }
        self.shape = Some(Shape {
            data,
            open: text.start,
            close: text.end,
        });
    }

    /// Whether `data` with an `x` appended to its string value at `open..close`, and with that
    /// value emptied, read, in a fresh splice at this one's identity, as that string's text and
    /// nothing else (the reader's only other use of the text is whether it is empty).
    fn probe(&self, data: &[u8], open: usize, close: usize) -> bool {
        let mut event = Vec::with_capacity(data.len() + 7);
        event.extend_from_slice(b"data: ");
        event.extend_from_slice(&data[..close]);
        event.push(b'x');
        event.extend_from_slice(&data[close..]);
        let Some(expected) = decode(&event[6 + open..6 + close + 1]) else {
            return false;
        };
        if !self.probe_reads(&event, &expected) {
            return false;
        }
        event.clear();
        event.extend_from_slice(b"data: ");
        event.extend_from_slice(&data[..open]);
        event.extend_from_slice(&data[close..]);
        self.probe_reads(&event, "")
    }

    /// Whether `event` reads, in a fresh splice at this one's identity, as the text `expected`
    /// and nothing else.
    fn probe_reads(&self, event: &[u8], expected: &str) -> bool {
        let mut scratch = ChatSplice::for_wire(self.wire, usize::MAX, self.max_event_bytes);
        // The reader only asks whether the identity is known (and compares the choice index).
        let known = |slot: &Option<Value>| slot.as_ref().map(|_| Value::Null);
        scratch.id = known(&self.id);
        scratch.model = known(&self.model);
        scratch.created = known(&self.created);
        scratch.index.clone_from(&self.index);
        scratch.shape_tries = MAX_SHAPE_TRIES;
        let relayed = scratch.relay(event);
        matches!(relayed, Ok(super::Relay::Event))
            && scratch.text == expected
            && scratch.refusal.is_none()
            && !scratch.in_reasoning
            && !scratch.finished
            && !scratch.done
            && scratch.usage_tokens.is_none()
            && scratch.error_code.is_none()
    }
}

#[cfg(test)]
mod tests;
