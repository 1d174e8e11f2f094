//! An Anthropic Messages request for a `responses_only` model, served through the backend's
//! native `/v1/responses` (seed "Native /v1/responses passthrough"): the chat-completions body the
//! Anthropic converter built becomes a Responses request ([`chat_to_responses`]), and the
//! Responses answer comes back as a chat completion ([`responses_to_chat_answer`]) or, streamed,
//! as chat chunks ([`ResponsesToChat`]), which the Anthropic converters turn into the client's
//! `Message` or events as for any other model.
//!
//! What maps: system messages → `instructions`; user text and images → `input_text` /
//! `input_image`; assistant text → an assistant message; assistant tool calls →
//! `function_call` items; tool results → `function_call_output` items; function tools and
//! `tool_choice`; `max_tokens` → `max_output_tokens`, `temperature`, `top_p`, `stream`. Stop
//! sequences have no Responses equivalent and are refused (400). Back: `output_text` (and
//! `refusal`) parts → content, `function_call` items → tool calls, `reasoning` items dropped,
//! `incomplete` (`max_output_tokens` → `length`, `content_filter`), usage with cached tokens. A
//! failed response or an `error` event is the upstream's error.

use serde_json::{Map, Value, json};

use super::anthropic::IngressError;

fn invalid(message: impl Into<String>) -> IngressError {
    IngressError::new(400, message)
}

fn upstream(message: impl Into<String>) -> IngressError {
    IngressError::new(502, message)
}

/// The text of a chat message's `content` (a string, or the `text` of its text parts).
fn text_of(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// A user message's content as Responses input parts.
fn user_parts(content: Option<&Value>) -> Value {
    match content {
        Some(Value::Array(parts)) => Value::Array(
            parts
                .iter()
                .filter_map(|p| match p.get("type").and_then(Value::as_str) {
                    Some("text") => Some(json!({"type": "input_text", "text": p.get("text")?})),
                    Some("image_url") => {
                        let url = p.get("image_url")?.get("url")?;
                        Some(json!({"type": "input_image", "image_url": url}))
                    }
                    _ => None,
                })
                .collect(),
        ),
        other => json!([{"type": "input_text", "text": text_of(other)}]),
    }
}

/// Converts the chat-completions body the Anthropic converter built into a Responses request for
/// the same model. A body that is not a chat request → 400; stop sequences → 400.
pub fn chat_to_responses(chat: &[u8]) -> Result<Vec<u8>, IngressError> {
    let v: Value = serde_json::from_slice(chat)
        .map_err(|e| invalid(format!("the converted body is not JSON: {e}")))?;
    let o = v
        .as_object()
        .ok_or_else(|| invalid("the converted body is not a JSON object"))?;
    if o.get("stop").is_some_and(|s| !s.is_null()) {
        return Err(invalid(
            "stop_sequences are not supported for a model served through /v1/responses",
        ));
    }
    let messages = o
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| invalid("the converted body has no messages"))?;
    let mut instructions: Vec<String> = Vec::new();
    let mut input: Vec<Value> = Vec::with_capacity(messages.len());
    for m in messages {
        match m.get("role").and_then(Value::as_str) {
            Some("system" | "developer") => instructions.push(text_of(m.get("content"))),
            Some("user") => {
                input.push(json!({"role": "user", "content": user_parts(m.get("content"))}));
            }
            Some("assistant") => {
                let text = text_of(m.get("content"));
                if !text.is_empty() {
                    input.push(json!({"role": "assistant", "content": text}));
                }
                for call in m
                    .get("tool_calls")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    let f = call.get("function").unwrap_or(&Value::Null);
                    input.push(json!({
                        "type": "function_call",
                        "call_id": call.get("id").cloned().unwrap_or(Value::Null),
                        "name": f.get("name").cloned().unwrap_or(Value::Null),
                        "arguments": f.get("arguments").cloned().unwrap_or(json!("{}")),
                    }));
                }
            }
            Some("tool") => input.push(json!({
                "type": "function_call_output",
                "call_id": m.get("tool_call_id").cloned().unwrap_or(Value::Null),
                "output": text_of(m.get("content")),
            })),
            other => return Err(invalid(format!("unsupported message role {other:?}"))),
        }
    }
    let mut out = Map::new();
    out.insert(
        "model".into(),
        o.get("model").cloned().unwrap_or(Value::Null),
    );
    if !instructions.is_empty() {
        out.insert("instructions".into(), json!(instructions.join("\n\n")));
    }
    out.insert("input".into(), Value::Array(input));
    if let Some(tools) = o.get("tools").and_then(Value::as_array) {
        let tools: Vec<Value> = tools
            .iter()
            .filter_map(|t| {
                let f = t.get("function")?;
                let mut tool = json!({"type": "function", "name": f.get("name")?});
                for key in ["description", "parameters"] {
                    if let Some(value) = f.get(key) {
                        tool[key] = value.clone();
                    }
                }
                Some(tool)
            })
            .collect();
        out.insert("tools".into(), Value::Array(tools));
    }
    if let Some(choice) = o.get("tool_choice") {
        let choice = match choice {
            Value::Object(c) => match c.get("function").and_then(|f| f.get("name")) {
                Some(name) => json!({"type": "function", "name": name}),
                None => choice.clone(),
            },
            other => other.clone(),
        };
        out.insert("tool_choice".into(), choice);
    }
    if let Some(max) = o
        .get("max_completion_tokens")
        .or_else(|| o.get("max_tokens"))
    {
        out.insert("max_output_tokens".into(), max.clone());
    }
    for key in ["temperature", "top_p", "stream"] {
        if let Some(value) = o.get(key) {
            out.insert(key.into(), value.clone());
        }
    }
    serde_json::to_vec(&Value::Object(out)).map_err(|e| invalid(e.to_string()))
}

/// The chat `usage` of a Responses `usage`.
fn chat_usage(usage: Option<&Value>) -> Value {
    let get = |k: &str| usage.and_then(|u| u.get(k)).and_then(Value::as_u64);
    let mut out = json!({
        "prompt_tokens": get("input_tokens").unwrap_or(0),
        "completion_tokens": get("output_tokens").unwrap_or(0),
    });
    if let Some(cached) = usage
        .and_then(|u| u.get("input_tokens_details"))
        .and_then(|d| d.get("cached_tokens"))
        .and_then(Value::as_u64)
    {
        out["prompt_tokens_details"] = json!({"cached_tokens": cached});
    }
    out
}

/// The chat finish reason of a finished Responses object (`tools`: it called a function).
fn finish_reason(response: &Value, tools: bool) -> Result<&'static str, IngressError> {
    match response.get("status").and_then(Value::as_str) {
        Some("incomplete") => Ok(
            match response
                .get("incomplete_details")
                .and_then(|d| d.get("reason"))
                .and_then(Value::as_str)
            {
                Some("content_filter") => "content_filter",
                _ => "length",
            },
        ),
        Some("failed" | "cancelled") => {
            let message = response
                .get("error")
                .and_then(|e| e.get("message"))
                .and_then(Value::as_str)
                .unwrap_or("the response failed");
            Err(upstream(format!("upstream error: {message}")))
        }
        _ if tools => Ok("tool_calls"),
        _ => Ok("stop"),
    }
}

/// Converts a buffered Responses object into a chat completion (what
/// `anthropic::chat_response_to_message` reads). Over `max_bytes`, not a Responses object, or a
/// failed response → 502.
pub fn responses_to_chat_answer(body: &[u8], max_bytes: usize) -> Result<Vec<u8>, IngressError> {
    if body.len() > max_bytes {
        return Err(upstream(format!(
            "upstream response is {} bytes, over the {max_bytes}-byte limit",
            body.len()
        )));
    }
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| upstream(format!("upstream response is not valid JSON: {e}")))?;
    let output = v
        .get("output")
        .and_then(Value::as_array)
        .ok_or_else(|| upstream("upstream response has no output"))?;
    let mut text = String::new();
    let mut calls = Vec::new();
    for item in output {
        match item.get("type").and_then(Value::as_str) {
            Some("message") => {
                for part in item
                    .get("content")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    let piece = match part.get("type").and_then(Value::as_str) {
                        Some("output_text") => part.get("text"),
                        Some("refusal") => part.get("refusal"),
                        _ => None,
                    };
                    if let Some(piece) = piece.and_then(Value::as_str) {
                        text.push_str(piece);
                    }
                }
            }
            Some("function_call") => calls.push(json!({
                "id": item.get("call_id").cloned().unwrap_or(Value::Null),
                "type": "function",
                "function": {
                    "name": item.get("name").cloned().unwrap_or(Value::Null),
                    "arguments": item.get("arguments").cloned().unwrap_or(json!("")),
                },
            })),
            _ => {}
        }
    }
    let finish = finish_reason(&v, !calls.is_empty())?;
    let mut message = json!({"role": "assistant", "content": text});
    if !calls.is_empty() {
        message["tool_calls"] = Value::Array(calls);
    }
    let chat = json!({
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": chat_usage(v.get("usage")),
    });
    serde_json::to_vec(&chat).map_err(|e| upstream(e.to_string()))
}

/// Converts a Responses SSE stream into chat-completions chunk payloads, one upstream `data:`
/// payload at a time ([`push`](Self::push)); the Anthropic stream converter reads them as it
/// reads a chat stream. A finished response ends with a finish chunk and `[DONE]`; a failed one
/// or an `error` event with a chat `error` payload (the converter's stream error).
#[derive(Debug)]
pub struct ResponsesToChat {
    max_chunk_bytes: usize,
    /// The Responses `output_index` of each function call, in the order they began (the chat
    /// tool-call index is the position).
    calls: Vec<u64>,
    done: bool,
}

impl ResponsesToChat {
    pub fn new(max_chunk_bytes: usize) -> Self {
        Self {
            max_chunk_bytes,
            calls: Vec::new(),
            done: false,
        }
    }

    /// The chat chunk payloads one upstream event becomes (none for events without a chat
    /// counterpart).
    pub fn push(&mut self, data: &[u8]) -> Vec<Vec<u8>> {
        if self.done {
            return Vec::new();
        }
        match self.convert(data) {
            Ok(chunks) => chunks,
            Err(message) => {
                self.done = true;
                vec![
                    json!({"error": {"message": message}})
                        .to_string()
                        .into_bytes(),
                ]
            }
        }
    }

    fn delta(delta: Value) -> Vec<u8> {
        json!({"object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": null}]})
        .to_string()
        .into_bytes()
    }

    fn convert(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>, String> {
        if data.len() > self.max_chunk_bytes {
            return Err(format!(
                "upstream event is {} bytes, over the {}-byte limit",
                data.len(),
                self.max_chunk_bytes
            ));
        }
        if data.trim_ascii() == b"[DONE]" {
            return Ok(Vec::new());
        }
        let v: Value = serde_json::from_slice(data)
            .map_err(|e| format!("upstream event is not valid JSON: {e}"))?;
        let index_of = |calls: &[u64], v: &Value| {
            let at = v.get("output_index").and_then(Value::as_u64)?;
            calls.iter().position(|&c| c == at)
        };
        Ok(match v.get("type").and_then(Value::as_str) {
            Some("response.output_text.delta") => match v.get("delta") {
                Some(Value::String(d)) if !d.is_empty() => {
                    vec![Self::delta(json!({"content": d}))]
                }
                _ => Vec::new(),
            },
            Some("response.output_item.added")
                if v.get("item")
                    .and_then(|i| i.get("type"))
                    .and_then(Value::as_str)
                    == Some("function_call") =>
            {
                let item = &v["item"];
                let at = v.get("output_index").and_then(Value::as_u64).unwrap_or(0);
                let index = self.calls.len();
                self.calls.push(at);
                vec![Self::delta(json!({"tool_calls": [{
                    "index": index,
                    "id": item.get("call_id").cloned().unwrap_or(Value::Null),
                    "type": "function",
                    "function": {"name": item.get("name").cloned().unwrap_or(Value::Null),
                        "arguments": ""},
                }]}))]
            }
            Some("response.function_call_arguments.delta") => {
                match (index_of(&self.calls, &v), v.get("delta")) {
                    (Some(index), Some(Value::String(d))) if !d.is_empty() => {
                        vec![Self::delta(json!({"tool_calls": [{
                            "index": index, "function": {"arguments": d},
                        }]}))]
                    }
                    _ => Vec::new(),
                }
            }
            Some("response.completed" | "response.incomplete" | "response.failed") => {
                let response = v.get("response").unwrap_or(&Value::Null);
                let finish = finish_reason(response, !self.calls.is_empty())
                    .map_err(|e| e.message.clone())?;
                self.done = true;
                let last = json!({"object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": {}, "finish_reason": finish}],
                    "usage": chat_usage(response.get("usage"))});
                vec![last.to_string().into_bytes(), b"[DONE]".to_vec()]
            }
            Some("error") => {
                let message = v
                    .get("message")
                    .or_else(|| v.get("error").and_then(|e| e.get("message")))
                    .and_then(Value::as_str)
                    .unwrap_or("the upstream stream failed");
                return Err(format!("upstream error: {message}"));
            }
            _ => Vec::new(),
        })
    }
}

#[cfg(test)]
mod tests;
