//! The typed, borrowing reader of an original chunk (issue 31's CPU goal): the fields the splice
//! reads, without a JSON tree, for a chunk the shape reader does not know.

use std::borrow::Cow;

use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::Value;

use super::{ChatSplice, Phase, Refusal, SpliceWire, finder};

static ERROR_KEY: std::sync::OnceLock<memchr::memmem::Finder<'static>> = std::sync::OnceLock::new();

impl ChatSplice {
    /// Whether `data` may be read by [`ChatSplice::read_fast`]: an original chunk after the
    /// identity and choice index are known, not ended, with no `"error"` in it (an error chunk,
    /// and anything the fast reader cannot type, takes the `Value` path).
    pub(super) fn fast_path_applies(&self, data: &[u8]) -> bool {
        self.fast
            && self.phase == Phase::Original
            && !self.done
            && self.id.is_some()
            && self.model.is_some()
            && self.created.is_some()
            && self.index.as_ref().is_some_and(Value::is_u64)
            && finder(&ERROR_KEY, b"\"error\"").find(data).is_none()
    }

    /// [`ChatSplice::read_chunk`] for a typed original chunk (the identity is already known).
    pub(super) fn read_fast(&mut self, chunk: &FastChunk<'_>) {
        let choices = chunk.choices.as_deref().unwrap_or_default();
        if let Some(tokens) = chunk.usage.as_ref().and_then(|u| u.completion_tokens) {
            self.usage_tokens = Some(tokens);
        }
        for choice in choices {
            if self.index.as_ref().and_then(Value::as_u64) != Some(choice.index.unwrap_or(0)) {
                self.refusal = Some(Refusal::Unsupported);
            }
            if choice.finish_reason.is_some() {
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
    }
}

/// The fields of an original chunk the splice reads, borrowed from the event (strings without
/// escapes are not copied); every other field is skipped unparsed into a tree. A chunk these
/// types do not fit (a `content` that is not a string, ...) fails to parse and takes the
/// `Value` path, which decides as before.
#[derive(Deserialize)]
pub(super) struct FastChunk<'a> {
    #[serde(borrow, default)]
    choices: Option<Vec<FastChoice<'a>>>,
    #[serde(default)]
    usage: Option<FastUsage>,
}

#[derive(Deserialize)]
struct FastChoice<'a> {
    #[serde(default)]
    index: Option<u64>,
    /// Non-null: the stream's terminal chunk.
    #[serde(default)]
    finish_reason: Option<IgnoredAny>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    delta: Option<FastDelta<'a>>,
}

#[derive(Deserialize)]
struct FastDelta<'a> {
    #[serde(borrow, default)]
    content: Option<Cow<'a, str>>,
    #[serde(default)]
    tool_calls: Option<IgnoredAny>,
    #[serde(borrow, default)]
    reasoning_content: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    reasoning: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct FastUsage {
    #[serde(default)]
    completion_tokens: Option<u64>,
}
