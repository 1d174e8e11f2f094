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
//! kept only when that leaf is the one the reader takes as the text: with the chunk's own string
//! the reader's text was that string, and a probe (the same bytes with an `x` appended to the
//! string) reads as the probe's string with nothing else set. Any other chunk (another shape, a
//! string that is not valid JSON, invalid UTF-8) goes to the full reader, which decides as
//! before.

use std::borrow::Cow;
use std::sync::OnceLock;

use memchr::memmem::Finder;

use serde_json::Value;

use super::{ChatSplice, Phase, SpliceWire, finder};

/// Largest chunk kept as a shape.
const MAX_SHAPE_BYTES: usize = 4096;

/// Shapes tried per stream (each costs one full read of a probe chunk).
pub(super) const MAX_SHAPE_TRIES: u8 = 4;

static ROLE_KEY: OnceLock<Finder<'static>> = OnceLock::new();
static CONTENT_KEY: OnceLock<Finder<'static>> = OnceLock::new();
static TEXT_KEY: OnceLock<Finder<'static>> = OnceLock::new();

/// A plain chunk's data: its text's string value (inside the quotes) is `data[open..close]`.
#[derive(Debug)]
pub(super) struct Shape {
    data: Box<[u8]>,
    open: usize,
    close: usize,
}

impl Shape {
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

/// Where the JSON string body at the start of `s` ends (its closing quote), escapes skipped.
fn string_end(s: &[u8]) -> Option<usize> {
    let mut j = 0;
    loop {
        j += memchr::memchr2(b'"', b'\\', s.get(j..)?)?;
        if s[j] == b'"' {
            return Some(j);
        }
        j += 2;
    }
}

impl ChatSplice {
    /// Reads `data` by the stream's shape: `None` when it is not the shape (the full reader then
    /// reads it). Only for an original chunk once the shape is known.
    pub(super) fn read_shaped(&mut self, data: &[u8]) -> Option<()> {
        let raw = self.shape.as_ref()?.raw_text(data)?;
        let text = decode(raw)?;
        // What the full reader does with a plain chunk of this text.
        if !text.is_empty() {
            self.in_reasoning = false;
        }
        self.keep_text(&text);
        Some(())
    }

    /// A whole event at the start of `frame` that is `data: `, the stream's shape with a string
    /// in the text's place, and a blank line `\n\n`: read as [`ChatSplice::relay`] reads it (a
    /// plain content chunk relayed as it is), and its length with the blank line returned.
    /// `None` (nothing read) for anything else: the general path reads it. The event's end is
    /// where [`super::event_end`] finds it: the shape is one data line (no line feed), a valid
    /// string body holds no control byte, and a tail ending in `\r` is left to the general path
    /// (which strips it).
    pub(super) fn read_shaped_event(&mut self, frame: &[u8]) -> Option<usize> {
        if !self.fast || self.phase != Phase::Original || self.done {
            return None;
        }
        let shape = self.shape.as_ref()?;
        let (head, tail) = (&shape.data[..shape.open], &shape.data[shape.close..]);
        let rest = frame.strip_prefix(b"data: ")?.strip_prefix(head)?;
        let close = string_end(rest)?;
        let after = rest[close..].strip_prefix(tail)?;
        if !after.starts_with(b"\n\n") || tail.ends_with(b"\r") {
            return None;
        }
        let text = decode(&rest[..close])?;
        if !text.is_empty() {
            self.in_reasoning = false;
        }
        self.keep_text(&text);
        self.shaped += 1;
        Some(frame.len() - after.len() + 2)
    }

    /// After the full reader read `data` (an original chunk relayed as it is) and appended the
    /// text from `before` on: keeps its shape when it proves to be a plain content chunk.
    pub(super) fn learn_shape(&mut self, data: &[u8], before: usize) {
        if !self.fast
            || self.shape.is_some()
            || self.shape_tries >= MAX_SHAPE_TRIES
            || data.len() > MAX_SHAPE_BYTES
            || self.refusal.is_some()
            || self.in_reasoning
            || self.finished
            || self.done
            || self.usage_tokens.is_some()
            || self.text.len() == before
        {
            return;
        }
        self.shape_tries += 1;
        // The first chunk's `role` is seldom repeated, nor then its shape: no probe for it.
        if self.shape_tries == 1 && finder(&ROLE_KEY, b"\"role\"").find(data).is_some() {
            return;
        }
        let key = match self.wire {
            SpliceWire::Chat => finder(&CONTENT_KEY, b"\"content\""),
            SpliceWire::Completions => finder(&TEXT_KEY, b"\"text\""),
        };
        let text = &self.text[before..];
        let found = string_values(data, key).take(4).find(|&(open, close)| {
            decode(&data[open..close]).is_some_and(|t| t == text) && self.probe(data, open, close)
        });
        if let Some((open, close)) = found {
            self.shape = Some(Shape {
                data: data.into(),
                open,
                close,
            });
        }
    }

    /// Whether `data` with an `x` appended to its string value at `open..close` reads, in a
    /// fresh splice at this one's identity, as that string's text and nothing else.
    fn probe(&self, data: &[u8], open: usize, close: usize) -> bool {
        let mut event = Vec::with_capacity(data.len() + 7);
        event.extend_from_slice(b"data: ");
        event.extend_from_slice(&data[..close]);
        event.push(b'x');
        event.extend_from_slice(&data[close..]);
        let Some(expected) = decode(&event[6 + open..6 + close + 1]) else {
            return false;
        };
        let mut scratch = ChatSplice::for_wire(self.wire, usize::MAX, self.max_event_bytes);
        // The reader only asks whether the identity is known (and compares the choice index).
        let known = |slot: &Option<Value>| slot.as_ref().map(|_| Value::Null);
        scratch.id = known(&self.id);
        scratch.model = known(&self.model);
        scratch.created = known(&self.created);
        scratch.index.clone_from(&self.index);
        scratch.shape_tries = MAX_SHAPE_TRIES;
        let relayed = scratch.relay(&event);
        matches!(relayed, Ok(super::Relay::Event))
            && scratch.text == *expected
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
