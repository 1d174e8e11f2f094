//! Mid-stream continuation of a native `/v1/responses` stream (issue 31), sans-IO.
//!
//! [`ResponsesSplice`] watches a relayed Responses SSE stream event by event, as
//! [`ChatSplice`](super::ChatSplice) watches a chat stream: only whole events leave (as they
//! came), and it records what a continuation needs: the `response` object of `response.created`,
//! the next `sequence_number`, the finished output items, the open message item (its id, output
//! index, content index and text) and the answer text (bounded). The stream is cut by a close
//! before `response.completed` / `response.incomplete`, by an `error` event, a top-level
//! `{"error": …}` chunk or a `response.failed` event (none of them relayed).
//!
//! The continuation is a chat-completions request ([`ResponsesSplice::continuation_body`]: the
//! Responses request converted to chat, the answer so far as a trailing assistant message,
//! `continue_final_message: true`, `add_generation_prompt: false`, `max_tokens` reduced by what
//! was sent). Its chunks become `response.output_text.delta` events of the open message item (a
//! new one when none is open) under the original ids with the next sequence numbers; its end
//! closes the item (`output_text.done`, `content_part.done`, `output_item.done` with the whole
//! text) and the response: one `response.completed` (`response.incomplete` for `length`) with the
//! original `response` object, the whole output and the merged usage.
//!
//! A cut inside a function call, a reasoning item, or any other output item, or before
//! `response.created` reached the client, cannot be continued ([`ResponsesSplice::refusal`]);
//! the caller ends the stream with [`ResponsesSplice::failure_event`] (`response.failed`).

use std::borrow::Cow;

use serde_json::{Map, Value, json};

use super::{CutReason, Fed, Refusal, feed_events, sse_data};
use crate::ingress::responses::{Limits, responses_to_chat};
use crate::picker::estimate_text_tokens;

/// The message item a continuation writes into.
#[derive(Debug)]
struct OpenItem {
    id: String,
    output_index: u64,
    /// Finished content parts (`output_text` objects).
    parts: Vec<Value>,
    /// The open part.
    part: Option<Part>,
}

/// An `output_text` content part not yet closed by `response.content_part.done`.
#[derive(Debug)]
struct Part {
    index: u64,
    text: String,
    /// `response.output_text.done` reached the client.
    text_done: bool,
}

impl Part {
    fn new(index: u64) -> Self {
        Self {
            index,
            text: String::new(),
            text_done: false,
        }
    }
}

impl OpenItem {
    /// The content index a new part takes.
    fn next_part(&self) -> u64 {
        self.parts.len() as u64
    }
}

/// Per-stream state of an armed native Responses stream. See the module doc.
#[derive(Debug)]
pub struct ResponsesSplice {
    continuing: bool,
    /// Bytes after the last complete event (never relayed until the event completes).
    partial: Vec<u8>,
    max_event_bytes: usize,
    max_text_bytes: usize,
    /// The `response` object of `response.created` (the terminal event's skeleton).
    response: Option<Map<String, Value>>,
    /// The sequence number the next event the splice writes carries.
    next_seq: u64,
    /// Finished output items, in order.
    output: Vec<Value>,
    /// Bytes of finished output items kept (bounded by `max_text_bytes`).
    output_bytes: usize,
    item: Option<OpenItem>,
    /// The output index a new item takes.
    next_index: u64,
    /// The answer text of every message item so far.
    text: String,
    refusal: Option<Refusal>,
    in_reasoning: bool,
    /// The terminal event arrived (or was written).
    ended: bool,
    /// Completion tokens sent before the continuation started.
    sent_tokens: u64,
    /// The continuation's `finish_reason` and `usage` (prompt, completion tokens).
    finish: Option<String>,
    usage: Option<(u64, u64)>,
    error_code: Option<String>,
    /// The open message item's closing events (`output_text.done`, `content_part.done`,
    /// `output_item.done`), held back until the next event shows they are not followed by a cut:
    /// a frontend that closes the item before its error event (Dynamo 1.6.1 does) would
    /// otherwise leave the continuation no item to write into. Each: the event and its data.
    held: Vec<(Vec<u8>, Map<String, Value>)>,
}

/// Most closing events held back at once (an item has three; a hostile upstream repeating them
/// gets them relayed).
const MAX_HELD: usize = 4;

impl ResponsesSplice {
    /// A splice keeping at most `max_text_bytes` of answer text (and as much of finished output
    /// items), refusing events larger than `max_event_bytes` (a cut).
    pub fn new(max_text_bytes: usize, max_event_bytes: usize) -> Self {
        Self {
            continuing: false,
            partial: Vec::new(),
            max_event_bytes,
            max_text_bytes,
            response: None,
            next_seq: 0,
            output: Vec::new(),
            output_bytes: 0,
            item: None,
            next_index: 0,
            text: String::new(),
            refusal: None,
            in_reasoning: false,
            ended: false,
            sent_tokens: 0,
            finish: None,
            usage: None,
            error_code: None,
            held: Vec::new(),
        }
    }

    /// The code of the error event that cut the stream, when one did.
    pub fn error_code(&self) -> Option<&str> {
        self.error_code.as_deref()
    }

    /// The answer text that reached the client so far.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Whether the stream reached its terminal event.
    pub fn ended(&self) -> bool {
        self.ended
    }

    /// Why a cut now could not be continued (`None`: it can).
    pub fn refusal(&self) -> Option<Refusal> {
        if let Some(refusal) = self.refusal {
            return Some(refusal);
        }
        if self.in_reasoning {
            return Some(Refusal::Reasoning);
        }
        // Nothing to continue: no `response.created` reached the client.
        self.response.is_none().then_some(Refusal::Unsupported)
    }

    /// Completion tokens already sent (the tokenizer-free estimate of the text: a Responses
    /// stream carries usage only in its terminal event).
    pub fn tokens_sent(&self) -> u64 {
        estimate_text_tokens(&self.text)
    }

    /// Reads upstream bytes; returns the complete events to relay and whether the stream was
    /// cut. After a cut the rest of `bytes` is dropped.
    pub fn feed(&mut self, bytes: &[u8]) -> Fed {
        let mut fed = Fed::default();
        let mut partial = std::mem::take(&mut self.partial);
        fed.cut = feed_events(&mut partial, bytes, self.max_event_bytes, |event| {
            self.event(event, &mut fed.out).err()
        });
        self.partial = partial;
        fed
    }

    /// The upstream ended: `None` for an ordinary end (a continuation's closing events in
    /// `out`), else the stream was cut.
    pub fn end(&mut self, out: &mut Vec<u8>) -> Option<CutReason> {
        self.partial.clear();
        if self.continuing && !self.ended && self.finish.is_some() {
            self.finalize(out);
        }
        (!self.ended).then_some(CutReason::Closed)
    }

    /// The continuation request for `original` (the client's Responses body): converted to chat
    /// completions, plus a trailing assistant message with the text so far,
    /// `continue_final_message: true`, `add_generation_prompt: false`, and `max_tokens` reduced
    /// by the tokens sent (at least 1).
    pub fn continuation_body(&self, original: &[u8]) -> Result<Vec<u8>, String> {
        let limits = Limits {
            // The front door bounded the body already.
            max_body_bytes: usize::MAX,
            ..Limits::default()
        };
        let chat = responses_to_chat(original, &limits).map_err(|e| e.message)?;
        let mut body: Map<String, Value> =
            serde_json::from_slice(&chat.body).map_err(|e| e.to_string())?;
        let messages = body
            .get_mut("messages")
            .and_then(Value::as_array_mut)
            .ok_or("the converted body has no messages")?;
        messages.push(json!({"role": "assistant", "content": self.text}));
        body.insert("continue_final_message".into(), Value::Bool(true));
        body.insert("add_generation_prompt".into(), Value::Bool(false));
        body.insert("stream".into(), Value::Bool(true));
        body.insert("stream_options".into(), json!({"include_usage": true}));
        let sent = self.tokens_sent();
        for key in ["max_tokens", "max_completion_tokens"] {
            if let Some(limit) = body.get(key).and_then(Value::as_u64) {
                body.insert(key.into(), json!(limit.saturating_sub(sent).max(1)));
            }
        }
        serde_json::to_vec(&body).map_err(|e| e.to_string())
    }

    /// Switches to the continuation: its chat chunks become Responses events from now on.
    pub fn start_continuation(&mut self) {
        self.held.clear();
        self.sent_tokens = self.tokens_sent();
        self.continuing = true;
        self.partial.clear();
        self.finish = None;
        self.usage = None;
        self.ended = false;
    }

    /// The one event that ends a stream that could not be continued: `response.failed` with the
    /// original `response` object (status `failed`, `error.code` `server_error`), or an `error`
    /// event when no `response.created` reached the client.
    pub fn failure_event(&mut self, message: &str) -> Vec<u8> {
        let mut out = Vec::new();
        self.ended = true;
        if self.response.is_none() {
            let error = json!({"code": "bad_gateway", "message": message, "param": null});
            self.emit("error", error, &mut out);
            return out;
        }
        let error = json!({"code": "server_error", "message": message});
        let response = self.snapshot("failed", Value::Null, error, Value::Null);
        self.emit("response.failed", json!({"response": response}), &mut out);
        out
    }

    /// One complete event (without its blank line); appends what to relay to `out`.
    fn event(&mut self, event: &[u8], out: &mut Vec<u8>) -> Result<(), CutReason> {
        let Some(data) = sse_data(event) else {
            // Comments and non-data fields pass through on the original stream only.
            if !self.continuing {
                self.release(out)?;
                out.extend_from_slice(event);
                out.extend_from_slice(b"\n\n");
            }
            return Ok(());
        };
        if data.trim_ascii() == b"[DONE]" {
            return match (self.continuing, self.ended) {
                (true, false) => {
                    self.finalize(out);
                    Ok(())
                }
                (false, false) => Err(CutReason::Closed),
                (_, true) => {
                    if !self.continuing {
                        out.extend_from_slice(b"data: [DONE]\n\n");
                    }
                    Ok(())
                }
            };
        }
        if self.fast_delta(data) {
            out.extend_from_slice(event);
            out.extend_from_slice(b"\n\n");
            return Ok(());
        }
        // Not a JSON object: a partial event the relay's failure event was glued to (a closed
        // upstream), or garbage; either way the stream cannot go on from it.
        let Ok(Value::Object(chunk)) = serde_json::from_slice::<Value>(data) else {
            return Err(CutReason::Closed);
        };
        if self.ended {
            return Ok(());
        }
        if let Some(error) = chunk.get("error").filter(|e| !e.is_null()) {
            self.error_code = code_of(error);
            return Err(CutReason::ErrorEvent);
        }
        if self.continuing {
            return self.continuation_chunk(&chunk, out);
        }
        let kind = chunk.get("type").and_then(Value::as_str).unwrap_or("");
        if matches!(kind, "error" | "response.failed") {
            // The held closing events never reach the client: the continuation reopens nothing.
            return self.original(&chunk, data.len());
        }
        if self.closes_open_item(&chunk) && self.held.len() < MAX_HELD {
            self.held.push((event.to_vec(), chunk));
            return Ok(());
        }
        self.release(out)?;
        self.original(&chunk, data.len())?;
        out.extend_from_slice(event);
        out.extend_from_slice(b"\n\n");
        Ok(())
    }

    /// The common event, read without building a tree: an original `response.output_text.delta`
    /// with no `"error"` anywhere and nothing held back. Records it as [`Self::original`] does
    /// and says whether it did (anything else takes the `Value` path).
    fn fast_delta(&mut self, data: &[u8]) -> bool {
        if self.continuing
            || self.ended
            || !self.held.is_empty()
            || memchr::memmem::find(data, b"\"response.output_text.delta\"").is_none()
            || memchr::memmem::find(data, b"\"error\"").is_some()
        {
            return false;
        }
        let Ok(delta) = serde_json::from_slice::<FastDelta<'_>>(data) else {
            return false;
        };
        if delta.kind != "response.output_text.delta" {
            return false;
        }
        self.keep_text(delta.delta.as_deref().unwrap_or(""));
        self.next_seq = self.next_seq.max(
            delta
                .sequence_number
                .map_or(self.next_seq + 1, |s| s.saturating_add(1)),
        );
        true
    }

    /// Whether `event` closes (part of) the open message item.
    fn closes_open_item(&self, event: &Map<String, Value>) -> bool {
        let Some(item) = &self.item else {
            return false;
        };
        match event.get("type").and_then(Value::as_str) {
            Some("response.output_text.done" | "response.content_part.done") => {
                item_id(event) == item.id
            }
            Some("response.output_item.done") => {
                let id = event.get("item").and_then(|i| i.get("id"));
                id.and_then(Value::as_str) == Some(item.id.as_str())
            }
            _ => false,
        }
    }

    /// Relays (and records) the held closing events: what followed them was no cut.
    fn release(&mut self, out: &mut Vec<u8>) -> Result<(), CutReason> {
        for (event, data) in std::mem::take(&mut self.held) {
            self.original(&data, event.len())?;
            out.extend_from_slice(&event);
            out.extend_from_slice(b"\n\n");
        }
        Ok(())
    }

    /// Records one original event (relayed as it came unless it cuts the stream).
    fn original(&mut self, event: &Map<String, Value>, size: usize) -> Result<(), CutReason> {
        let kind = event.get("type").and_then(Value::as_str).unwrap_or("");
        let index = event.get("output_index").and_then(Value::as_u64);
        match kind {
            "error" => {
                self.error_code = code_of(&Value::Object(event.clone()));
                return Err(CutReason::ErrorEvent);
            }
            "response.failed" => {
                let error = event.get("response").and_then(|r| r.get("error"));
                self.error_code = error.and_then(code_of);
                return Err(CutReason::ErrorEvent);
            }
            "response.completed" | "response.incomplete" => self.ended = true,
            "response.created" | "response.queued" | "response.in_progress" => {
                if let Some(Value::Object(response)) = event.get("response")
                    && self.response.is_none()
                {
                    self.response = Some(response.clone());
                }
            }
            "response.output_item.added" => self.item_added(event.get("item"), index),
            "response.content_part.added" => {
                let part = event.get("part").and_then(|p| p.get("type"));
                let content = event.get("content_index").and_then(Value::as_u64);
                // Parts of other items (a reasoning item's text) are not the answer's.
                let item = self.item.as_mut().filter(|i| i.id == item_id(event));
                match (item, part.and_then(Value::as_str)) {
                    (None, _) => {}
                    (Some(item), Some("output_text")) if item.part.is_none() => {
                        item.part = Some(Part::new(content.unwrap_or(item.next_part())));
                    }
                    (Some(_), _) => self.refuse(Refusal::Unsupported),
                }
            }
            "response.output_text.delta" => {
                let delta = event.get("delta").and_then(Value::as_str).unwrap_or("");
                self.keep_text(delta);
            }
            "response.output_text.done" | "response.content_part.done" => {
                if let Some(item) = self.item.as_mut().filter(|i| i.id == item_id(event))
                    && let Some(mut part) = item.part.take()
                {
                    if kind == "response.content_part.done" {
                        item.parts.push(output_text(&part.text));
                    } else {
                        part.text_done = true;
                        item.part = Some(part);
                    }
                }
            }
            "response.output_item.done" => self.item_done(event.get("item"), size),
            _ => {}
        }
        // Only relayed events count: the cut's own event leaves a gap the client never sees.
        let seq = event.get("sequence_number").and_then(Value::as_u64);
        self.next_seq = self
            .next_seq
            .max(seq.map_or(self.next_seq + 1, |s| s.saturating_add(1)));
        Ok(())
    }

    fn item_added(&mut self, item: Option<&Value>, index: Option<u64>) {
        let index = index.unwrap_or(self.next_index);
        self.next_index = self.next_index.max(index.saturating_add(1));
        let kind = item.and_then(|i| i.get("type")).and_then(Value::as_str);
        let id = item.and_then(|i| i.get("id")).and_then(Value::as_str);
        match (kind, id) {
            (Some("message"), Some(id)) => {
                self.item = Some(OpenItem {
                    id: id.to_owned(),
                    output_index: index,
                    parts: Vec::new(),
                    part: None,
                });
            }
            (Some("reasoning"), _) => self.in_reasoning = true,
            (Some("function_call"), _) => self.refuse(Refusal::ToolCall),
            _ => self.refuse(Refusal::Unsupported),
        }
    }

    fn item_done(&mut self, item: Option<&Value>, size: usize) {
        let id = item.and_then(|i| i.get("id")).and_then(Value::as_str);
        if self
            .item
            .as_ref()
            .is_some_and(|open| Some(open.id.as_str()) == id)
        {
            self.item = None;
        }
        let Some(item) = item else {
            return;
        };
        self.output_bytes = self.output_bytes.saturating_add(size);
        if self.output_bytes > self.max_text_bytes {
            self.refuse(Refusal::OverCap);
            return;
        }
        self.output.push(item.clone());
    }

    fn refuse(&mut self, refusal: Refusal) {
        self.refusal.get_or_insert(refusal);
    }

    /// Keeps answer text for a continuation, up to the cap (past it, continuation is refused).
    fn keep_text(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        self.in_reasoning = false;
        if self.text.len() + text.len() > self.max_text_bytes {
            self.refuse(Refusal::OverCap);
            return;
        }
        self.text.push_str(text);
        if let Some(part) = self.item.as_mut().and_then(|i| i.part.as_mut()) {
            part.text.push_str(text);
        }
    }
}

/// The fields of a text delta [`ResponsesSplice::fast_delta`] reads, borrowed from the event.
#[derive(serde::Deserialize)]
struct FastDelta<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(default)]
    sequence_number: Option<u64>,
    #[serde(borrow, default)]
    delta: Option<Cow<'a, str>>,
}

/// The `item_id` of an event (empty when it has none).
fn item_id(event: &Map<String, Value>) -> &str {
    event.get("item_id").and_then(Value::as_str).unwrap_or("")
}

fn output_text(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

/// The `code` (else `type`) of an error object, as a string.
fn code_of(error: &Value) -> Option<String> {
    let code = error
        .get("code")
        .filter(|c| !c.is_null())
        .or_else(|| error.get("type"))?;
    Some(
        code.as_str()
            .map_or_else(|| code.to_string(), str::to_owned),
    )
}

mod write;

#[cfg(test)]
mod tests;
