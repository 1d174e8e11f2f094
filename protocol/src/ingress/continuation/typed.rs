//! The typed, borrowing reader of an original chunk (issue 31's CPU goal): the fields the splice
//! reads, without a JSON tree, for a chunk the shape reader does not know.

use std::borrow::Cow;

use serde::de::IgnoredAny;
use serde::{Deserialize, Deserializer};
use serde_json::Value;
use serde_json::value::RawValue;

use super::{ChatSplice, Phase, Refusal, SpliceWire, finder};

static ERROR_KEY: std::sync::OnceLock<memchr::memmem::Finder<'static>> = std::sync::OnceLock::new();

impl ChatSplice {
    /// Whether `data` may be read by [`ChatSplice::read_fast`]: an original JSON object (the
    /// typed reader would take an array as a struct's fields) before the end, while the choice
    /// index is unknown or a number, with no `"error"` in it (an error chunk, and anything the
    /// fast reader cannot type, takes the `Value` path).
    pub(super) fn fast_path_applies(&self, data: &[u8]) -> bool {
        self.fast
            && self.phase == Phase::Original
            && !self.done
            && self.index.as_ref().is_none_or(Value::is_u64)
            && data.trim_ascii_start().starts_with(b"{")
            && finder(&ERROR_KEY, b"\"error\"").find(data).is_none()
    }

    /// [`ChatSplice::read_chunk`] for a typed original chunk: the identity it does not know yet
    /// is taken from this one (the first chunk's, as a whole value: `null` included). Returns
    /// the chunk's leaves when it held one choice whose text (maybe empty) was borrowed from the
    /// chunk's bytes (a string value without escapes): [`ChatSplice::learn_shape`] keeps the
    /// stream's shapes around them.
    pub(super) fn read_fast<'a>(&mut self, chunk: &FastChunk<'a>) -> Option<Leaves<'a>> {
        for (slot, raw) in [
            (&mut self.id, chunk.id),
            (&mut self.model, chunk.model),
            (&mut self.created, chunk.created),
        ] {
            if slot.is_none() {
                *slot = raw.and_then(|raw| serde_json::from_str(raw.get()).ok());
            }
        }
        let choices = chunk.choices.as_deref().unwrap_or_default();
        if let Some(tokens) = chunk.usage.as_ref().and_then(|u| u.completion_tokens) {
            self.usage_tokens = Some(tokens);
        }
        for choice in choices {
            let index = choice.index.unwrap_or(0);
            let seen = self.index.get_or_insert_with(|| Value::from(index));
            if seen.as_u64() != Some(index) {
                self.refusal = Some(Refusal::Unsupported);
            }
            if choice.finish_reason.is_some_and(|r| r.get() != "null") {
                self.finished = true;
            }
            if self.wire == SpliceWire::Completions {
                self.keep_text(choice.text.as_deref().unwrap_or(""));
                continue;
            }
            let Some(delta) = &choice.delta else {
                continue;
            };
            let reasoning = [&delta.reasoning_content, &delta.reasoning]
                .iter()
                .any(|r| r.as_deref().is_some_and(|s| !s.is_empty()));
            if delta.tool_calls.is_some() {
                self.refusal.get_or_insert(Refusal::ToolCall);
            }
            let content = delta.content.as_deref().unwrap_or("");
            if reasoning {
                self.in_reasoning = true;
            } else if !content.is_empty() {
                self.in_reasoning = false;
            }
            self.keep_text(content);
        }
        // One choice only: another choice of the same index could open a reasoning block the
        // text's emptiness decides on.
        let [choice] = choices else {
            return None;
        };
        let (text, role) = match (self.wire, &choice.delta) {
            (SpliceWire::Completions, _) => (choice.text.as_ref()?, None),
            (SpliceWire::Chat, Some(delta)) => (delta.content.as_ref()?, delta.role),
            (SpliceWire::Chat, None) => return None,
        };
        let &Cow::Borrowed(text) = text else {
            return None;
        };
        Some(Leaves {
            text,
            role,
            finish: choice.finish_reason,
        })
    }
}

/// Where a typed chunk's one choice keeps its text, role and finish reason: slices of the
/// chunk's bytes.
pub(super) struct Leaves<'a> {
    /// The text's string value (between its quotes).
    pub(super) text: &'a str,
    /// `delta.role`'s value, when present.
    pub(super) role: Option<&'a RawValue>,
    /// `finish_reason`'s value, when present (`null` too).
    pub(super) finish: Option<&'a RawValue>,
}

/// The fields of an original chunk the splice reads, borrowed from the event (strings without
/// escapes are not copied); every other field is skipped unparsed into a tree. A chunk these
/// types do not fit (a `content` that is not a string, ...) fails to parse and takes the
/// `Value` path, which decides as before.
#[derive(Deserialize)]
pub(super) struct FastChunk<'a> {
    #[serde(borrow, default, deserialize_with = "present")]
    id: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present")]
    model: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present")]
    created: Option<&'a RawValue>,
    #[serde(borrow, default)]
    choices: Option<Vec<FastChoice<'a>>>,
    #[serde(default)]
    usage: Option<FastUsage>,
}

#[derive(Deserialize)]
struct FastChoice<'a> {
    /// A number (`null` is not the default index to the `Value` reader: no typed read then).
    #[serde(default, deserialize_with = "some_u64")]
    index: Option<u64>,
    /// Not `null`: the stream's terminal chunk.
    #[serde(borrow, default, deserialize_with = "present")]
    finish_reason: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "borrowed")]
    text: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    delta: Option<FastDelta<'a>>,
}

#[derive(Deserialize)]
struct FastDelta<'a> {
    #[serde(borrow, default, deserialize_with = "borrowed")]
    content: Option<Cow<'a, str>>,
    /// Read only for its place (a shape is the role chunk without it).
    #[serde(borrow, default, deserialize_with = "present")]
    role: Option<&'a RawValue>,
    #[serde(default)]
    tool_calls: Option<IgnoredAny>,
    #[serde(borrow, default, deserialize_with = "borrowed")]
    reasoning_content: Option<Cow<'a, str>>,
    #[serde(borrow, default, deserialize_with = "borrowed")]
    reasoning: Option<Cow<'a, str>>,
}

/// An optional string, borrowed from the chunk when it holds no escape (serde borrows a
/// `Cow<str>` only as a field of its own, not inside an `Option`).
fn borrowed<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Cow<'de, str>>, D::Error> {
    Option::<Borrowed<'de>>::deserialize(d).map(|s| s.map(|s| s.0))
}

#[derive(Deserialize)]
struct Borrowed<'a>(#[serde(borrow)] Cow<'a, str>);

/// A field that is present, whatever its value (`null` too), unparsed.
fn present<'de, D: Deserializer<'de>>(d: D) -> Result<Option<&'de RawValue>, D::Error> {
    <&RawValue>::deserialize(d).map(Some)
}

/// A field that is present and a `u64` (not `null`).
fn some_u64<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    u64::deserialize(d).map(Some)
}

#[derive(Deserialize)]
struct FastUsage {
    #[serde(default)]
    completion_tokens: Option<u64>,
}
