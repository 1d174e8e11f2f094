//! Mid-stream continuation of an OpenAI chat-completions stream (issue 31), sans-IO.
//!
//! [`ChatSplice`] watches a relayed chat-completions SSE stream event by event: only complete SSE
//! events leave (a partial event at a cut never reached the client, so it never counts), the
//! text that left is kept (bounded) for a continuation, and each event is classified — content,
//! the `finish_reason` chunk, `[DONE]`, or an upstream error chunk (a cut). After a cut,
//! [`ChatSplice::continuation_body`] builds the continuation request (the original request plus a
//! trailing assistant message with the text so far, `continue_final_message: true`,
//! `add_generation_prompt: false`, the token limits reduced by what was sent), and
//! [`ChatSplice::start_continuation`] switches to rewriting the continuation's chunks to the
//! original stream's `id`, `model`, `created` and choice index, with `usage` merged, so the
//! client sees one stream with one final chunk and one `[DONE]`.
//!
//! The same splice reads a `/v1/completions` stream ([`ChatSplice::completions`]): its text is
//! `choices[].text`, and the continuation request is the original with `prompt` extended by the
//! text so far (a string prompt only; a token-id or batched prompt cannot be continued).
//!
//! A cut inside a tool call or a reasoning block cannot be continued safely:
//! [`ChatSplice::refusal`] says so, and the caller ends the stream with [`error_event`].

use serde_json::{Map, Value, json};

use crate::picker::estimate_text_tokens;

/// Why a stream counts as cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CutReason {
    /// The upstream connection failed or closed before the terminal event.
    Closed,
    /// No event within the inactivity timeout.
    Stalled,
    /// The upstream sent an error chunk instead of content.
    ErrorEvent,
}

impl CutReason {
    /// The metric label.
    pub fn as_label(self) -> &'static str {
        match self {
            Self::Closed => "closed",
            Self::Stalled => "stalled",
            Self::ErrorEvent => "error_event",
        }
    }
}

/// Why a cut stream cannot be continued.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The cut fell inside a tool call's arguments.
    ToolCall,
    /// The cut fell inside a reasoning block.
    Reasoning,
    /// The kept text exceeded its cap (continuation was disarmed).
    OverCap,
    /// More than one choice (`n > 1`) or a chunk this splice cannot read.
    Unsupported,
}

/// What [`ChatSplice::feed`] found besides the bytes to relay.
#[derive(Debug, Default)]
pub struct Fed {
    /// Complete events to hand to the client, in order.
    pub out: Vec<u8>,
    /// The stream was cut by an upstream error chunk (nothing after it is relayed).
    pub cut: Option<CutReason>,
}

/// Which OpenAI stream shape the splice reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpliceWire {
    /// `/v1/chat/completions`: `choices[].delta.content`, continued by a trailing assistant turn.
    Chat,
    /// `/v1/completions`: `choices[].text`, continued by extending `prompt`.
    Completions,
}

/// Which stream the splice is reading.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Original,
    Continuation,
}

/// Per-stream state of an armed chat-completions stream. See the module doc.
#[derive(Debug)]
pub struct ChatSplice {
    wire: SpliceWire,
    phase: Phase,
    /// Bytes after the last complete event (never relayed until the event completes).
    partial: Vec<u8>,
    max_event_bytes: usize,
    max_text_bytes: usize,
    id: Option<Value>,
    model: Option<Value>,
    created: Option<Value>,
    index: Option<Value>,
    text: String,
    /// `usage.completion_tokens` of the last original chunk that carried usage.
    usage_tokens: Option<u64>,
    refusal: Option<Refusal>,
    in_reasoning: bool,
    finished: bool,
    done: bool,
    /// Completion tokens sent before the continuation started.
    sent_tokens: u64,
    error_code: Option<String>,
    /// Read original chunks with the typed reader and by their shape (off only in tests, to
    /// compare the readers).
    fast: bool,
    /// The stream's plain content chunk, once one proved to be (see `shape`).
    shape: Option<Shape>,
    /// The final chunk's shapes the content shape foretells (see `shape`).
    last: Vec<Shape>,
    /// Shapes probed so far (at most [`shape::MAX_SHAPE_TRIES`]).
    shape_tries: u8,
    /// Chunks read by their shape (for the tests: the shape path must be taken).
    shaped: u64,
}

/// The continuation's first content may arrive with `role`: the client already has one.
const STRIPPED_DELTA_KEYS: [&str; 1] = ["role"];

impl ChatSplice {
    /// A splice keeping at most `max_text_bytes` of answer text, refusing events larger than
    /// `max_event_bytes` (a cut).
    pub fn new(max_text_bytes: usize, max_event_bytes: usize) -> Self {
        Self::for_wire(SpliceWire::Chat, max_text_bytes, max_event_bytes)
    }

    /// The same for a `/v1/completions` stream.
    pub fn completions(max_text_bytes: usize, max_event_bytes: usize) -> Self {
        Self::for_wire(SpliceWire::Completions, max_text_bytes, max_event_bytes)
    }

    fn for_wire(wire: SpliceWire, max_text_bytes: usize, max_event_bytes: usize) -> Self {
        Self {
            wire,
            phase: Phase::Original,
            partial: Vec::new(),
            max_event_bytes,
            max_text_bytes,
            id: None,
            model: None,
            created: None,
            index: None,
            text: String::new(),
            usage_tokens: None,
            refusal: None,
            in_reasoning: false,
            finished: false,
            done: false,
            sent_tokens: 0,
            error_code: None,
            fast: true,
            shape: None,
            last: Vec::new(),
            shape_tries: 0,
            shaped: 0,
        }
    }

    /// The code of the error chunk that cut the stream, when one did.
    pub fn error_code(&self) -> Option<&str> {
        self.error_code.as_deref()
    }

    /// The answer text that reached the client so far.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Whether the stream reached its terminal event (`finish_reason` or `[DONE]`).
    pub fn ended(&self) -> bool {
        self.finished || self.done
    }

    /// Why a cut now could not be continued (`None`: it can).
    pub fn refusal(&self) -> Option<Refusal> {
        if self.in_reasoning && self.refusal.is_none() {
            return Some(Refusal::Reasoning);
        }
        self.refusal
    }

    /// Completion tokens already sent: the last `usage.completion_tokens` seen, else the
    /// tokenizer-free estimate of the text.
    pub fn tokens_sent(&self) -> u64 {
        self.usage_tokens
            .unwrap_or_else(|| estimate_text_tokens(&self.text))
    }

    /// Reads upstream bytes; returns the complete events to relay and whether an error chunk cut
    /// the stream. After a cut the rest of `bytes` is dropped.
    pub fn feed(&mut self, bytes: &[u8]) -> Fed {
        let mut fed = Fed::default();
        let mut partial = std::mem::take(&mut self.partial);
        fed.cut = feed_events(&mut partial, bytes, self.max_event_bytes, |event| {
            self.event(event, &mut fed.out)
        });
        self.partial = partial;
        fed
    }

    /// Whether the upstream ending now would be an ordinary end with nothing more to relay (what
    /// [`ChatSplice::end`] would say with nothing in `out`): the relay may then tell the client's
    /// connection that the body ends with its last frame.
    pub fn ends_here(&self) -> bool {
        self.ended() && (self.phase == Phase::Original || self.done)
    }

    /// The upstream ended: `None` for an ordinary end (bytes to relay, maybe a closing `[DONE]`
    /// in `out`), else the stream was cut.
    pub fn end(&mut self, out: &mut Vec<u8>) -> Option<CutReason> {
        self.partial.clear();
        if !self.ended() {
            return Some(CutReason::Closed);
        }
        if self.phase == Phase::Continuation && !self.done {
            out.extend_from_slice(b"data: [DONE]\n\n");
            self.done = true;
        }
        None
    }

    /// The continuation request for `original` (the client's body). Chat: a trailing assistant
    /// message with the text so far, `continue_final_message: true`, `add_generation_prompt:
    /// false`; completions: the string `prompt` followed by the text so far. Either way
    /// `max_tokens` / `max_completion_tokens` are reduced by the tokens sent (at least 1).
    pub fn continuation_body(&self, original: &[u8]) -> Result<Vec<u8>, String> {
        let mut body: Map<String, Value> =
            serde_json::from_slice(original).map_err(|e| format!("not a JSON object: {e}"))?;
        match self.wire {
            SpliceWire::Chat => {
                let messages = body
                    .get_mut("messages")
                    .and_then(Value::as_array_mut)
                    .ok_or("the chat body has no messages")?;
                messages.push(json!({"role": "assistant", "content": self.text}));
                body.insert("continue_final_message".into(), Value::Bool(true));
                body.insert("add_generation_prompt".into(), Value::Bool(false));
            }
            SpliceWire::Completions => {
                let prompt = body
                    .get("prompt")
                    .and_then(Value::as_str)
                    .ok_or("the completions prompt is not one string")?;
                let continued = format!("{prompt}{}", self.text);
                body.insert("prompt".into(), Value::String(continued));
            }
        }
        let sent = self.tokens_sent();
        for key in ["max_tokens", "max_completion_tokens"] {
            if let Some(limit) = body.get(key).and_then(Value::as_u64) {
                body.insert(key.into(), json!(limit.saturating_sub(sent).max(1)));
            }
        }
        serde_json::to_vec(&body).map_err(|e| e.to_string())
    }

    /// Switches to the continuation: its chunks are rewritten from now on.
    pub fn start_continuation(&mut self) {
        self.sent_tokens = self.tokens_sent();
        // A later continuation estimates from the whole text kept (the usage seen is stale).
        self.usage_tokens = None;
        self.phase = Phase::Continuation;
        self.shape = None;
        self.last.clear();
        self.partial.clear();
        self.finished = false;
        self.done = false;
    }

    /// One complete event (without its blank line); appends what to relay to `out`.
    fn event(&mut self, event: &[u8], out: &mut Vec<u8>) -> Option<CutReason> {
        match self.relay(event) {
            Ok(relay) => {
                relay.write(event, out);
                None
            }
            Err(reason) => Some(reason),
        }
    }

    /// Reads one complete event (without its blank line): what to relay for it, or the cut.
    fn relay(&mut self, event: &[u8]) -> Result<Relay, CutReason> {
        let Some(data) = sse_data(event) else {
            // Comments and non-data fields pass through on the original stream only.
            return Ok(match self.phase {
                Phase::Original => Relay::Event,
                Phase::Continuation => Relay::Nothing,
            });
        };
        if data.trim_ascii() == b"[DONE]" {
            if self.done {
                return Ok(Relay::Nothing);
            }
            self.done = true;
            return Ok(Relay::Done);
        }
        // The common case, read without a parse: a plain content chunk of the stream's shape.
        if self.fast
            && self.phase == Phase::Original
            && !self.done
            && self.read_shaped(data).is_some()
        {
            self.shaped += 1;
            return Ok(Relay::Event);
        }
        let before = self.text.len();
        // Else without building a tree: an original chunk with no `error` key anywhere (the
        // first one gives the stream its identity).
        if self.fast_path_applies(data)
            && let Ok(chunk) = serde_json::from_slice::<FastChunk<'_>>(data)
        {
            let leaves = self.read_fast(&chunk);
            self.learn_shape(data, before, leaves);
            return Ok(Relay::Event);
        }
        // Not a JSON object: a partial event the relay's failure event was glued to (a closed
        // upstream), or garbage; either way the stream cannot go on from it.
        let Ok(Value::Object(mut chunk)) = serde_json::from_slice::<Value>(data) else {
            return Err(CutReason::Closed);
        };
        if self.done {
            return Ok(Relay::Nothing);
        }
        if let Some(error) = chunk.get("error") {
            let code = error.get("code").or_else(|| error.get("type"));
            self.error_code = code.map(|c| c.as_str().map_or_else(|| c.to_string(), str::to_owned));
            return Err(CutReason::ErrorEvent);
        }
        self.read_chunk(&chunk);
        match self.phase {
            Phase::Original => {
                self.learn_shape(data, before, None);
                Ok(Relay::Event)
            }
            Phase::Continuation => {
                self.rewrite(&mut chunk);
                Ok(Relay::Rewritten(Value::Object(chunk).to_string()))
            }
        }
    }

    /// Records identity, text, usage and the tool-call / reasoning state of one chunk.
    fn read_chunk(&mut self, chunk: &Map<String, Value>) {
        // A continuation whose original sent no chunk gives the stream its identity.
        if self.phase == Phase::Original || self.index.is_none() {
            for (slot, key) in [
                (&mut self.id, "id"),
                (&mut self.model, "model"),
                (&mut self.created, "created"),
            ] {
                if slot.is_none() {
                    *slot = chunk.get(key).cloned();
                }
            }
        }
        if self.phase == Phase::Original
            && let Some(tokens) = usage_tokens(chunk)
        {
            self.usage_tokens = Some(tokens);
        }
        let choices = chunk.get("choices").and_then(Value::as_array);
        for choice in choices.into_iter().flatten() {
            self.read_choice(choice);
        }
    }

    fn read_choice(&mut self, choice: &Value) {
        if self.phase == Phase::Original || self.index.is_none() {
            let index = choice.get("index").cloned().unwrap_or(json!(0));
            match &self.index {
                None => self.index = Some(index),
                Some(seen) if *seen != index => self.refusal = Some(Refusal::Unsupported),
                Some(_) => {}
            }
        }
        if choice.get("finish_reason").is_some_and(|r| !r.is_null()) {
            self.finished = true;
        }
        if self.wire == SpliceWire::Completions {
            let text = choice.get("text").and_then(Value::as_str).unwrap_or("");
            self.keep_text(text);
            return;
        }
        let Some(delta) = choice.get("delta") else {
            return;
        };
        let reasoning = ["reasoning_content", "reasoning"].iter().any(|k| {
            delta
                .get(k)
                .and_then(Value::as_str)
                .is_some_and(|s| !s.is_empty())
        });
        if delta.get("tool_calls").is_some_and(|t| !t.is_null()) {
            self.refusal.get_or_insert(Refusal::ToolCall);
        }
        let content = delta.get("content").and_then(Value::as_str).unwrap_or("");
        if reasoning {
            self.in_reasoning = true;
        } else if !content.is_empty() {
            self.in_reasoning = false;
        }
        self.keep_text(content);
    }

    /// Keeps answer text for a continuation, up to the cap (past it, continuation is refused).
    fn keep_text(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        if self.text.len() + text.len() > self.max_text_bytes {
            self.refusal.get_or_insert(Refusal::OverCap);
        } else {
            self.text.push_str(text);
        }
    }

    /// A continuation chunk as the original stream's: identity, choice index, no second `role`,
    /// and `usage` merged.
    fn rewrite(&self, chunk: &mut Map<String, Value>) {
        for (key, value) in [
            ("id", &self.id),
            ("model", &self.model),
            ("created", &self.created),
        ] {
            if let Some(value) = value {
                chunk.insert(key.into(), value.clone());
            }
        }
        if let Some(choices) = chunk.get_mut("choices").and_then(Value::as_array_mut) {
            for choice in choices {
                if let Some(index) = &self.index {
                    choice["index"] = index.clone();
                }
                if let Some(delta) = choice.get_mut("delta").and_then(Value::as_object_mut) {
                    for key in STRIPPED_DELTA_KEYS {
                        delta.remove(key);
                    }
                }
            }
        }
        if let Some(usage) = chunk.get_mut("usage").and_then(Value::as_object_mut) {
            let sent = self.sent_tokens;
            let completion = usage
                .get("completion_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(0)
                .saturating_add(sent);
            // The continuation's prompt is the original prompt plus the text sent.
            let prompt = usage
                .get("prompt_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(0)
                .saturating_sub(sent);
            usage.insert("completion_tokens".into(), json!(completion));
            usage.insert("prompt_tokens".into(), json!(prompt));
            usage.insert("total_tokens".into(), json!(prompt + completion));
        }
    }
}

/// `usage.completion_tokens` of a chunk, when it carries usage.
fn usage_tokens(chunk: &Map<String, Value>) -> Option<u64> {
    chunk.get("usage")?.get("completion_tokens")?.as_u64()
}

/// A memmem searcher built once (building one per search costs more than the search).
fn finder<'a>(
    cell: &'a std::sync::OnceLock<memchr::memmem::Finder<'static>>,
    needle: &'static [u8],
) -> &'a memchr::memmem::Finder<'static> {
    cell.get_or_init(|| memchr::memmem::Finder::new(needle))
}

/// Appends `bytes` to the held `partial` event and hands each complete SSE event to `event`, in
/// order, borrowed from the buffer; stops at the first cut `event` returns (the rest is dropped).
/// An incomplete event held past `max_event_bytes` is a cut too ([`CutReason::Closed`]). The one
/// bounded accumulator of both splices ([`ChatSplice::feed`], `ResponsesSplice::feed`).
fn feed_events(
    partial: &mut Vec<u8>,
    bytes: &[u8],
    max_event_bytes: usize,
    mut event: impl FnMut(&[u8]) -> Option<CutReason>,
) -> Option<CutReason> {
    partial.extend_from_slice(bytes);
    let mut start = 0;
    while let Some((end, next)) = event_end(&partial[start..]) {
        let cut = event(&partial[start..start + end]);
        start += next;
        if cut.is_some() {
            partial.clear();
            return cut;
        }
    }
    partial.drain(..start);
    if partial.len() > max_event_bytes {
        partial.clear();
        return Some(CutReason::Closed);
    }
    None
}

/// The end of the first complete SSE event in `buf`: (event length, bytes to skip past its
/// blank line). Accepts `\n\n` and `\r\n\r\n`.
fn event_end(buf: &[u8]) -> Option<(usize, usize)> {
    memchr::memchr_iter(b'\n', buf).find_map(|i| match buf.get(i + 1..) {
        Some([b'\n', ..]) => Some((i, i + 2)),
        Some([b'\r', b'\n', ..]) => {
            let end = if i > 0 && buf[i - 1] == b'\r' {
                i - 1
            } else {
                i
            };
            Some((end, i + 3))
        }
        _ => None,
    })
}

/// The `data:` payload of one event (its first `data:` line; chat chunks have one).
fn sse_data(event: &[u8]) -> Option<&[u8]> {
    let mut rest = event;
    loop {
        let (line, next) = match memchr::memchr(b'\n', rest) {
            Some(at) => (&rest[..at], Some(&rest[at + 1..])),
            None => (rest, None),
        };
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if let Some(data) = line.strip_prefix(b"data:") {
            return Some(data.strip_prefix(b" ").unwrap_or(data));
        }
        rest = next?;
    }
}

/// The one well-formed error event that ends a stream that could not be continued.
pub fn error_event(message: &str, code: &str) -> Vec<u8> {
    let body = json!({"error": {"message": message, "type": code, "code": code}});
    format!("data: {body}\n\n").into_bytes()
}

mod frame;
use frame::Relay;
pub use frame::Relayed;
mod shape;
use shape::Shape;
mod typed;
use typed::FastChunk;

#[cfg(test)]
mod tests;

mod responses;
pub use responses::ResponsesSplice;
