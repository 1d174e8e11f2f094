//! The writing side of [`ResponsesSplice`]: a continuation's chat chunks as Responses events
//! under the original ids and sequence numbers, the closing `done` events, the one terminal
//! event and the merged usage.

use serde_json::{Map, Value, json};

use super::{CutReason, OpenItem, Part, Refusal, ResponsesSplice, output_text};
use crate::picker::estimate_text_tokens;

impl ResponsesSplice {
    /// One continuation chat chunk (an error chunk was taken out already).
    pub(super) fn continuation_chunk(
        &mut self,
        chunk: &Map<String, Value>,
        out: &mut Vec<u8>,
    ) -> Result<(), CutReason> {
        if let Some(usage) = chunk.get("usage").filter(|u| u.is_object()) {
            let count = |key: &str| usage.get(key).and_then(Value::as_u64).unwrap_or(0);
            self.usage = Some((count("prompt_tokens"), count("completion_tokens")));
        }
        let choices = chunk.get("choices").and_then(Value::as_array);
        for choice in choices.into_iter().flatten() {
            let delta = choice.get("delta");
            if delta
                .and_then(|d| d.get("tool_calls"))
                .is_some_and(|t| !t.is_null())
            {
                // A tool call cannot be written into the open message item.
                self.refuse(Refusal::ToolCall);
                return Err(CutReason::Closed);
            }
            let content = delta.and_then(|d| d.get("content")).and_then(Value::as_str);
            if let Some(text) = content.filter(|t| !t.is_empty()) {
                self.text_delta(text, out)?;
            }
            if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str) {
                self.finish = Some(reason.to_owned());
            }
        }
        Ok(())
    }

    /// A continuation's text as a `response.output_text.delta` of the open message item (opened,
    /// with its content part, when none is). The whole text is kept for the `done` events: past
    /// the cap the stream is cut (and that cut is refused).
    pub(super) fn text_delta(&mut self, text: &str, out: &mut Vec<u8>) -> Result<(), CutReason> {
        if self.text.len() + text.len() > self.max_text_bytes {
            self.refuse(Refusal::OverCap);
            return Err(CutReason::Closed);
        }
        if self.item.is_none() {
            let index = self.next_index;
            self.next_index += 1;
            let id = format!("msg_{}_{index}", self.response_id());
            let item = json!({"id": id, "type": "message", "role": "assistant",
                              "status": "in_progress", "content": []});
            self.emit(
                "response.output_item.added",
                json!({"output_index": index, "item": item}),
                out,
            );
            self.item = Some(OpenItem {
                id,
                output_index: index,
                parts: Vec::new(),
                part: None,
            });
        }
        if self
            .item
            .as_ref()
            .is_some_and(|i| i.part.as_ref().is_some_and(|p| p.text_done))
        {
            // The original closed that part's text: the rest goes into a new part.
            self.close_part(out);
        }
        if let Some(item) = &mut self.item
            && item.part.is_none()
        {
            let (id, index, content) = (item.id.clone(), item.output_index, item.next_part());
            item.part = Some(Part::new(content));
            self.emit(
                "response.content_part.added",
                json!({"item_id": id, "output_index": index, "content_index": content,
                       "part": output_text("")}),
                out,
            );
        }
        self.text.push_str(text);
        let Some(item) = &mut self.item else {
            return Ok(());
        };
        let Some(part) = &mut item.part else {
            return Ok(());
        };
        part.text.push_str(text);
        let data = json!({"item_id": item.id, "output_index": item.output_index,
                          "content_index": part.index, "delta": text, "logprobs": []});
        self.emit("response.output_text.delta", data, out);
        Ok(())
    }

    /// The continuation ended: closes the open item and writes the one terminal event.
    pub(super) fn finalize(&mut self, out: &mut Vec<u8>) {
        self.close_part(out);
        if let Some(item) = self.item.take() {
            let (id, index) = (item.id, item.output_index);
            let done = json!({"id": id, "type": "message", "role": "assistant",
                              "status": "completed", "content": item.parts});
            self.emit(
                "response.output_item.done",
                json!({"output_index": index, "item": done.clone()}),
                out,
            );
            self.output.push(done);
        }
        let (status, incomplete) = match self.finish.as_deref() {
            Some("length") => ("incomplete", json!({"reason": "max_output_tokens"})),
            Some("content_filter") => ("incomplete", json!({"reason": "content_filter"})),
            _ => ("completed", Value::Null),
        };
        let usage = self.merged_usage();
        let response = self.snapshot(status, incomplete, Value::Null, usage);
        let event = if status == "completed" {
            "response.completed"
        } else {
            "response.incomplete"
        };
        self.emit(event, json!({"response": response}), out);
        self.ended = true;
    }

    /// Closes the open item's open part: `output_text.done` (unless the original sent it) and
    /// `content_part.done`, with the part's whole text.
    pub(super) fn close_part(&mut self, out: &mut Vec<u8>) {
        let Some(item) = &mut self.item else {
            return;
        };
        let Some(part) = item.part.take() else {
            return;
        };
        item.parts.push(output_text(&part.text));
        let at = json!({"item_id": item.id, "output_index": item.output_index,
                        "content_index": part.index});
        if !part.text_done {
            let mut done = at.clone();
            done["text"] = json!(part.text);
            done["logprobs"] = json!([]);
            self.emit("response.output_text.done", done, out);
        }
        let mut done = at;
        done["part"] = output_text(&part.text);
        self.emit("response.content_part.done", done, out);
    }

    /// `ResponseUsage`: the original's input tokens (the continuation's prompt minus the text
    /// sent), output tokens of both parts.
    pub(super) fn merged_usage(&self) -> Value {
        let sent = self.sent_tokens;
        let (prompt, completion) = self
            .usage
            .unwrap_or_else(|| (sent, estimate_text_tokens(&self.text).saturating_sub(sent)));
        let input = prompt.saturating_sub(sent);
        let output = completion.saturating_add(sent);
        json!({
            "input_tokens": input,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input.saturating_add(output),
        })
    }

    pub(super) fn response_id(&self) -> String {
        let id = self.response.as_ref().and_then(|r| r.get("id"));
        id.and_then(Value::as_str).unwrap_or("resp").to_owned()
    }

    /// The original `response` object with this status, output, error and usage.
    pub(super) fn snapshot(
        &self,
        status: &str,
        incomplete: Value,
        error: Value,
        usage: Value,
    ) -> Value {
        let mut response = self.response.clone().unwrap_or_default();
        response.insert("status".into(), json!(status));
        response.insert("output".into(), Value::Array(self.output.clone()));
        response.insert("error".into(), error);
        response.insert("incomplete_details".into(), incomplete);
        response.insert("usage".into(), usage);
        Value::Object(response)
    }

    /// Writes one event with its `type` and the next sequence number.
    pub(super) fn emit(&mut self, kind: &str, mut data: Value, out: &mut Vec<u8>) {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.next_seq);
        self.next_seq += 1;
        out.extend_from_slice(format!("event: {kind}\ndata: {data}\n\n").as_bytes());
    }
}
