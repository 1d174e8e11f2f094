//! What both stream converters share: the upstream chat-completions chunk read once, its parts
//! handed to the converter in the order it acts on them, and the event type they write.

use serde_json::Value;

use super::{ChatChunk, parse_chat_chunk};

/// One SSE event a converter writes: `event: <name>\ndata: <json>\n\n`.
#[derive(Clone, Debug, PartialEq)]
pub struct SseEvent {
    pub event: &'static str,
    pub data: Value,
}

impl SseEvent {
    pub(crate) fn new(event: &'static str, data: Value) -> Self {
        Self { event, data }
    }

    /// The wire form of the event.
    pub fn to_bytes(&self) -> Vec<u8> {
        format!("event: {}\ndata: {}\n\n", self.event, self.data).into_bytes()
    }
}

/// One fragment of a streamed tool call (`choices[0].delta.tool_calls[]`).
pub(crate) struct ToolFragment<'a> {
    /// The chat tool-call index (0 when absent).
    pub index: u64,
    /// The call id, when the fragment carries a non-empty one.
    pub id: Option<&'a str>,
    /// The function name (empty when absent).
    pub name: &'a str,
    /// An argument fragment, when non-empty.
    pub arguments: Option<&'a str>,
}

/// A converter from chat-completions chunks to an ingress protocol's events. [`push`] and
/// [`finish`] drive it; each method appends the events it writes to `out`, and an `Err` is the
/// stream's failure message (handed to [`fail`](Self::fail)).
pub(crate) trait ChatStreamConverter {
    fn is_done(&self) -> bool;
    fn max_chunk_bytes(&self) -> usize;
    /// The opening events, once, before anything else.
    fn start(&mut self, out: &mut Vec<SseEvent>);
    /// Ends the stream with the protocol's error event.
    fn fail(&mut self, message: String, out: &mut Vec<SseEvent>);
    /// A chunk's `usage` object.
    fn usage(&mut self, usage: &Value);
    /// A non-empty text fragment.
    fn text(&mut self, text: &str, out: &mut Vec<SseEvent>) -> Result<(), String>;
    fn tool_fragment(
        &mut self,
        fragment: ToolFragment<'_>,
        out: &mut Vec<SseEvent>,
    ) -> Result<(), String>;
    /// The choice that carries a `finish_reason`.
    fn finished(&mut self, finish_reason: &str, choice: &Value);
    /// The closing events after the upstream's end; an error when no `finish_reason` came.
    fn end(&mut self, out: &mut Vec<SseEvent>) -> Result<(), String>;
}

/// Feeds one upstream `data:` payload (a chat chunk, or `[DONE]`).
pub(crate) fn push<C: ChatStreamConverter>(converter: &mut C, data: &[u8]) -> Vec<SseEvent> {
    let mut out = Vec::new();
    if converter.is_done() {
        return out;
    }
    converter.start(&mut out);
    if let Err(e) = push_inner(converter, data, &mut out) {
        converter.fail(e, &mut out);
    }
    out
}

/// End of the upstream stream (with or without `[DONE]`).
pub(crate) fn finish<C: ChatStreamConverter>(converter: &mut C) -> Vec<SseEvent> {
    let mut out = Vec::new();
    if converter.is_done() {
        return out;
    }
    converter.start(&mut out);
    if let Err(e) = converter.end(&mut out) {
        converter.fail(e, &mut out);
    }
    out
}

fn push_inner<C: ChatStreamConverter>(
    converter: &mut C,
    data: &[u8],
    out: &mut Vec<SseEvent>,
) -> Result<(), String> {
    let o = match parse_chat_chunk(data, converter.max_chunk_bytes())? {
        ChatChunk::Done => return converter.end(out),
        ChatChunk::Data(o) => o,
    };
    if let Some(u) = o.get("usage").filter(|u| u.is_object()) {
        converter.usage(u);
    }
    let Some(choice) = o
        .get("choices")
        .and_then(Value::as_array)
        .and_then(|c| c.first())
    else {
        return Ok(());
    };
    let delta = choice.get("delta").unwrap_or(&Value::Null);
    if let Some(t) = delta
        .get("content")
        .and_then(Value::as_str)
        .filter(|t| !t.is_empty())
    {
        converter.text(t, out)?;
    }
    if let Some(calls) = delta.get("tool_calls").and_then(Value::as_array) {
        for c in calls {
            let function = c.get("function").unwrap_or(&Value::Null);
            let fragment = ToolFragment {
                index: c.get("index").and_then(Value::as_u64).unwrap_or(0),
                id: c
                    .get("id")
                    .and_then(Value::as_str)
                    .filter(|s| !s.is_empty()),
                name: function
                    .get("name")
                    .and_then(Value::as_str)
                    .unwrap_or_default(),
                arguments: function
                    .get("arguments")
                    .and_then(Value::as_str)
                    .filter(|a| !a.is_empty()),
            };
            converter.tool_fragment(fragment, out)?;
        }
    }
    if let Some(f) = choice.get("finish_reason").and_then(Value::as_str) {
        converter.finished(f, choice);
    }
    Ok(())
}
