//! OpenAI Responses API ⇄ OpenAI chat completions, sans-IO.
//!
//! Written against the Responses types of the `openai` Python SDK 3.57.0
//! (`openai/types/responses/`: `ResponseCreateParams`, `ResponseInputItem`, `Response`,
//! `ResponseStreamEvent`).
//!
//! **Request ([`responses_to_chat`])** converts:
//! - `instructions` (string) → one leading `system` message;
//! - `input` as a string → one `user` message; as items: messages (`type: message` or an item with
//!   a `role`; `developer` becomes `system`) whose content is a string or parts (`input_text`,
//!   `output_text` and `refusal` → text, `input_image` with an `image_url` → an `image_url` part
//!   on user turns), `function_call` → an assistant `tool_calls` entry (consecutive calls, and
//!   calls right after an assistant message, share one assistant message), `function_call_output`
//!   → a `role: tool` message (string output or `input_text` parts); `reasoning` items are dropped;
//! - `tools` of `type: function` (name, description, parameters, strict) → chat function tools;
//!   `tool_choice` `auto`/`none`/`required`/`{type: function, name}`; `parallel_tool_calls`;
//! - `max_output_tokens` → `max_tokens`; `temperature`, `top_p`, `user` pass through;
//!   `text.format` `json_schema` / `json_object` → `response_format`; `stream: true` → `stream` +
//!   `stream_options.include_usage`.
//!
//! **Dropped**: `metadata` (echoed in the `Response` only), `store`, `include`, `reasoning`,
//! `truncation`, `service_tier`, `prompt_cache_key` and any unknown field. **Refused (400)**:
//! `previous_response_id` and `conversation` (the router keeps no conversation state),
//! `background: true`, non-function tools (`web_search`, `file_search`, …), `input_file` parts,
//! images by `file_id`, item types other than the above, a missing/ill-typed `model` or `input`.
//! Bodies over [`Limits::max_body_bytes`] are refused with 413 before parsing.
//!
//! **Response ([`chat_response_to_response`])**: a `message` output item with one `output_text`
//! part (when the choice has text) and one `function_call` item per tool call; `finish_reason`
//! `length` → `status: incomplete` (`max_output_tokens`), `content_filter` → `incomplete`
//! (`content_filter`), anything else `completed`; usage → `input_tokens` / `output_tokens` /
//! `total_tokens` (`cached_tokens` from `prompt_tokens_details`).
//!
//! **Stream ([`ResponsesStream`])**: `response.created`, `response.in_progress`; per text run
//! `response.output_item.added` (message), `response.content_part.added`,
//! `response.output_text.delta`*, `response.output_text.done`, `response.content_part.done`,
//! `response.output_item.done`; per tool call `response.output_item.added` (function_call),
//! `response.function_call_arguments.delta`*, `response.function_call_arguments.done`,
//! `response.output_item.done`; finally `response.completed` (or `response.incomplete`) with
//! the whole `Response` and its usage. Every event carries a `sequence_number` from 0. A
//! malformed chunk, an upstream error object, a stream ending before a `finish_reason` or a bound
//! exceeded ends the stream with `response.failed` (`error.code: server_error`).
//!
//! **Errors** are OpenAI error objects: [`error_body`]; the direct-mode refusal is the seed's 503
//! `disaggregated_prefill_decode_unavailable` ([`direct_mode_refusal`]).

use serde_json::{Map, Value, json};

use super::anthropic::{
    DIRECT_MODE_REFUSAL_CODE, IngressError, type_name, usage_of, want_arr, want_num, want_obj,
    want_str,
};

/// Bounds applied to untrusted request bodies and upstream answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest request body accepted (413 above).
    pub max_body_bytes: usize,
    /// Largest single upstream SSE `data:` payload (chunk or buffered response).
    pub max_chunk_bytes: usize,
    /// Text and tool-argument bytes one stream may accumulate (they are repeated in the `done`
    /// events and in `response.completed`).
    pub max_output_bytes: usize,
    /// Output items one streamed response may open.
    pub max_items: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_body_bytes: 32 * 1024 * 1024,
            max_chunk_bytes: 4 * 1024 * 1024,
            max_output_bytes: 16 * 1024 * 1024,
            max_items: 1024,
        }
    }
}

/// OpenAI error `type` for an HTTP status.
pub fn error_type_for_status(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        429 => "rate_limit_error",
        500..=599 => "server_error",
        _ => "invalid_request_error",
    }
}

/// `{"error":{"message","type","param":null,"code"}}`; `code` is `request_too_large` for a 413.
pub fn error_body(status: u16, message: &str) -> Value {
    let code = match status {
        413 => json!("request_too_large"),
        503 if message.ends_with(DIRECT_MODE_REFUSAL_CODE) => json!(DIRECT_MODE_REFUSAL_CODE),
        _ => Value::Null,
    };
    json!({ "error": {
        "message": message, "type": error_type_for_status(status), "param": null, "code": code,
    } })
}

/// The seed's 503 for a direct-mode refusal on `/v1/responses`.
pub fn direct_mode_refusal() -> IngressError {
    IngressError::new(
        503,
        format!(
            "prefill/decode worker pair unavailable in direct routing mode: {DIRECT_MODE_REFUSAL_CODE}"
        ),
    )
}

/// `resp_` + 32 hex digits of a caller-supplied id.
pub fn response_id(id: u128) -> String {
    format!("resp_{id:032x}")
}

fn message_item_id(id: u128, n: usize) -> String {
    format!("msg_{id:032x}_{n}")
}

fn call_item_id(id: u128, n: usize) -> String {
    format!("fc_{id:032x}_{n}")
}

/// A converted request: the chat body plus what the response converters echo.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatRequest {
    /// The chat-completions JSON body for the shim.
    pub body: Value,
    /// The model the client named.
    pub model: String,
    /// Whether the client asked for an SSE stream.
    pub stream: bool,
    /// Request fields the `Response` object repeats (`instructions`, `tools`, `tool_choice`,
    /// `parallel_tool_calls`, `temperature`, `top_p`, `max_output_tokens`, `metadata`, `user`,
    /// `text`).
    pub echo: Map<String, Value>,
}

fn invalid(message: impl Into<String>) -> IngressError {
    IngressError::invalid(message)
}

fn field<'a>(o: &'a Map<String, Value>, key: &str) -> &'a Value {
    o.get(key).unwrap_or(&Value::Null)
}

/// Text of a string or of text-like parts (`input_text`, `output_text`, `refusal`).
fn text_parts(v: &Value, what: &str) -> Result<String, IngressError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut out = String::new();
            for (i, p) in parts.iter().enumerate() {
                let what = format!("{what}[{i}]");
                let o = want_obj(p, &what)?;
                let ty = want_str(field(o, "type"), &format!("{what}.type"))?;
                let key = match ty {
                    "input_text" | "output_text" | "text" => "text",
                    "refusal" => "refusal",
                    other => {
                        return Err(invalid(format!(
                            "{what}: content part type `{other}` is not supported here (text only)"
                        )));
                    }
                };
                out.push_str(want_str(field(o, key), &format!("{what}.{key}"))?);
            }
            Ok(out)
        }
        other => Err(invalid(format!(
            "{what}: expected a string or an array of content parts, got {}",
            type_name(other)
        ))),
    }
}

/// User content: a string, or parts with images kept as `image_url` parts.
fn user_content(v: &Value, what: &str) -> Result<Value, IngressError> {
    let Value::Array(parts) = v else {
        return Ok(Value::String(text_parts(v, what)?));
    };
    let mut out = Vec::with_capacity(parts.len());
    for (i, p) in parts.iter().enumerate() {
        let what = format!("{what}[{i}]");
        let o = want_obj(p, &what)?;
        let ty = want_str(field(o, "type"), &format!("{what}.type"))?;
        match ty {
            "input_text" | "output_text" | "text" => {
                let t = want_str(field(o, "text"), &format!("{what}.text"))?;
                out.push(json!({ "type": "text", "text": t }));
            }
            "input_image" => {
                if o.get("image_url").is_none_or(Value::is_null)
                    && o.get("file_id").is_some_and(|f| !f.is_null())
                {
                    return Err(invalid(format!(
                        "{what}: images by file_id are not supported (use image_url)"
                    )));
                }
                let url = want_str(field(o, "image_url"), &format!("{what}.image_url"))?;
                let mut image = Map::new();
                image.insert("url".into(), json!(url));
                if let Some(d) = o.get("detail").and_then(Value::as_str) {
                    image.insert("detail".into(), json!(d));
                }
                out.push(json!({ "type": "image_url", "image_url": image }));
            }
            other => {
                return Err(invalid(format!(
                    "{what}: content part type `{other}` is not supported in a user turn"
                )));
            }
        }
    }
    Ok(Value::Array(out))
}

/// Appends a tool call to the trailing assistant message (opened by this conversion) or a new one.
fn push_call(out: &mut Vec<Value>, call: Value, last_was_assistant: bool) {
    if last_was_assistant
        && let Some(Value::Object(m)) = out.last_mut()
        && m.get("role").and_then(Value::as_str) == Some("assistant")
    {
        match m.get_mut("tool_calls") {
            Some(Value::Array(calls)) => calls.push(call),
            _ => {
                m.insert("tool_calls".into(), Value::Array(vec![call]));
            }
        }
        return;
    }
    out.push(json!({ "role": "assistant", "content": null, "tool_calls": [call] }));
}

fn convert_items(items: &[Value], out: &mut Vec<Value>) -> Result<(), IngressError> {
    // Whether the previous item produced an assistant message that a function_call may join.
    let mut last_was_assistant = false;
    for (i, item) in items.iter().enumerate() {
        let what = format!("input[{i}]");
        let o = want_obj(item, &what)?;
        let ty = match o.get("type") {
            None | Some(Value::Null) if o.contains_key("role") => "message",
            _ => want_str(field(o, "type"), &format!("{what}.type"))?,
        };
        match ty {
            "message" => {
                let role = want_str(field(o, "role"), &format!("{what}.role"))?;
                let content = field(o, "content");
                let cw = format!("{what}.content");
                last_was_assistant = false;
                match role {
                    "user" => {
                        out.push(json!({ "role": "user", "content": user_content(content, &cw)? }))
                    }
                    "system" | "developer" => {
                        out.push(json!({ "role": "system", "content": text_parts(content, &cw)? }))
                    }
                    "assistant" => {
                        let text = text_parts(content, &cw)?;
                        out.push(json!({ "role": "assistant", "content": text }));
                        last_was_assistant = true;
                    }
                    other => {
                        return Err(invalid(format!(
                            "{what}.role: `{other}` is not user, assistant, system or developer"
                        )));
                    }
                }
            }
            "function_call" => {
                let call_id = want_str(field(o, "call_id"), &format!("{what}.call_id"))?;
                let name = want_str(field(o, "name"), &format!("{what}.name"))?;
                let args = want_str(field(o, "arguments"), &format!("{what}.arguments"))?;
                let call = json!({
                    "id": call_id, "type": "function",
                    "function": { "name": name, "arguments": args },
                });
                push_call(out, call, last_was_assistant);
                last_was_assistant = true;
            }
            "function_call_output" => {
                let call_id = want_str(field(o, "call_id"), &format!("{what}.call_id"))?;
                let output = text_parts(field(o, "output"), &format!("{what}.output"))?;
                out.push(json!({ "role": "tool", "tool_call_id": call_id, "content": output }));
                last_was_assistant = false;
            }
            "reasoning" => {}
            other => {
                return Err(invalid(format!(
                    "{what}.type: input item type `{other}` is not supported"
                )));
            }
        }
    }
    Ok(())
}

fn convert_tools(tools: &Value) -> Result<(Value, Value), IngressError> {
    let tools = want_arr(tools, "tools")?;
    let mut chat = Vec::with_capacity(tools.len());
    let mut echo = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        let what = format!("tools[{i}]");
        let o = want_obj(t, &what)?;
        let ty = want_str(field(o, "type"), &format!("{what}.type"))?;
        if ty != "function" {
            return Err(invalid(format!(
                "{what}.type: tool type `{ty}` is not supported (function only)"
            )));
        }
        let name = want_str(field(o, "name"), &format!("{what}.name"))?;
        let mut f = Map::new();
        f.insert("name".into(), json!(name));
        let description = match o.get("description").filter(|d| !d.is_null()) {
            Some(d) => {
                let d = want_str(d, &format!("{what}.description"))?;
                f.insert("description".into(), json!(d));
                json!(d)
            }
            None => Value::Null,
        };
        let parameters = o.get("parameters").cloned().unwrap_or(Value::Null);
        if !parameters.is_null() {
            want_obj(&parameters, &format!("{what}.parameters"))?;
            f.insert("parameters".into(), parameters.clone());
        }
        let strict = match o.get("strict") {
            None | Some(Value::Null) => Value::Null,
            Some(Value::Bool(b)) => {
                f.insert("strict".into(), json!(b));
                json!(b)
            }
            Some(other) => {
                return Err(invalid(format!(
                    "{what}.strict: expected a boolean, got {}",
                    type_name(other)
                )));
            }
        };
        chat.push(json!({ "type": "function", "function": f }));
        echo.push(json!({
            "type": "function", "name": name, "description": description,
            "parameters": parameters, "strict": strict,
        }));
    }
    Ok((Value::Array(chat), Value::Array(echo)))
}

fn convert_tool_choice(tc: &Value) -> Result<Value, IngressError> {
    match tc {
        Value::String(s) if matches!(s.as_str(), "auto" | "none" | "required") => Ok(tc.clone()),
        Value::String(s) => Err(invalid(format!(
            "tool_choice: `{s}` is not auto, none or required"
        ))),
        Value::Object(o) => {
            let ty = want_str(field(o, "type"), "tool_choice.type")?;
            if ty != "function" {
                return Err(invalid(format!(
                    "tool_choice.type: `{ty}` is not supported (function only)"
                )));
            }
            let name = want_str(field(o, "name"), "tool_choice.name")?;
            Ok(json!({ "type": "function", "function": { "name": name } }))
        }
        other => Err(invalid(format!(
            "tool_choice: expected a string or an object, got {}",
            type_name(other)
        ))),
    }
}

fn convert_text_format(text: &Value) -> Result<Option<Value>, IngressError> {
    let o = want_obj(text, "text")?;
    let Some(format) = o.get("format").filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    let f = want_obj(format, "text.format")?;
    match want_str(field(f, "type"), "text.format.type")? {
        "text" => Ok(None),
        "json_object" => Ok(Some(json!({ "type": "json_object" }))),
        "json_schema" => {
            let name = want_str(field(f, "name"), "text.format.name")?;
            let schema = field(f, "schema");
            want_obj(schema, "text.format.schema")?;
            let mut js = Map::new();
            js.insert("name".into(), json!(name));
            js.insert("schema".into(), schema.clone());
            if let Some(d) = f.get("description").and_then(Value::as_str) {
                js.insert("description".into(), json!(d));
            }
            if let Some(s) = f.get("strict").and_then(Value::as_bool) {
                js.insert("strict".into(), json!(s));
            }
            Ok(Some(json!({ "type": "json_schema", "json_schema": js })))
        }
        other => Err(invalid(format!(
            "text.format.type: `{other}` is not text, json_object or json_schema"
        ))),
    }
}

/// Converts a Responses `ResponseCreateParams` body into a chat-completions body.
///
/// 413 above `limits.max_body_bytes` (checked before parsing); 400 for anything malformed or
/// unsupported. Unknown fields are ignored.
pub fn responses_to_chat(body: &[u8], limits: &Limits) -> Result<ChatRequest, IngressError> {
    if body.len() > limits.max_body_bytes {
        return Err(IngressError::new(
            413,
            format!(
                "request body is {} bytes, over the {}-byte limit",
                body.len(),
                limits.max_body_bytes
            ),
        ));
    }
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| invalid(format!("request body is not valid JSON: {e}")))?;
    let req = want_obj(&v, "request body")?;
    let model = want_str(field(req, "model"), "model")?.to_owned();
    for key in ["previous_response_id", "conversation"] {
        if req.get(key).is_some_and(|x| !x.is_null()) {
            return Err(invalid(format!(
                "{key}: not supported; the router keeps no conversation state (send the whole input)"
            )));
        }
    }
    if req.get("background") == Some(&Value::Bool(true)) {
        return Err(invalid(
            "background: background responses are not supported",
        ));
    }
    let mut echo = Map::new();
    let mut messages = Vec::new();
    match req.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => {
            messages.push(json!({ "role": "system", "content": s }));
            echo.insert("instructions".into(), json!(s));
        }
        Some(other) => {
            return Err(invalid(format!(
                "instructions: expected a string, got {}",
                type_name(other)
            )));
        }
    }
    match field(req, "input") {
        Value::String(s) => messages.push(json!({ "role": "user", "content": s })),
        Value::Array(items) => convert_items(items, &mut messages)?,
        other => {
            return Err(invalid(format!(
                "input: expected a string or an array of input items, got {}",
                type_name(other)
            )));
        }
    }
    let mut out = Map::new();
    out.insert("model".into(), json!(model));
    out.insert("messages".into(), Value::Array(messages));
    match req.get("max_output_tokens") {
        None | Some(Value::Null) => {}
        Some(n) if n.as_u64().is_some_and(|n| n > 0) => {
            out.insert("max_tokens".into(), n.clone());
            echo.insert("max_output_tokens".into(), n.clone());
        }
        Some(_) => return Err(invalid("max_output_tokens: expected a positive integer")),
    }
    for key in ["temperature", "top_p"] {
        if let Some(x) = req.get(key).filter(|x| !x.is_null()) {
            out.insert(key.into(), want_num(x, key)?);
            echo.insert(key.into(), x.clone());
        }
    }
    if let Some(u) = req.get("user").filter(|u| !u.is_null()) {
        out.insert("user".into(), json!(want_str(u, "user")?));
        echo.insert("user".into(), u.clone());
    }
    if let Some(md) = req.get("metadata").filter(|m| !m.is_null()) {
        want_obj(md, "metadata")?;
        echo.insert("metadata".into(), md.clone());
    }
    if let Some(t) = req.get("tools").filter(|t| !t.is_null()) {
        let (chat, echoed) = convert_tools(t)?;
        if chat.as_array().is_some_and(|a| !a.is_empty()) {
            out.insert("tools".into(), chat);
        }
        echo.insert("tools".into(), echoed);
    }
    if let Some(tc) = req.get("tool_choice").filter(|t| !t.is_null()) {
        out.insert("tool_choice".into(), convert_tool_choice(tc)?);
        echo.insert("tool_choice".into(), tc.clone());
    }
    match req.get("parallel_tool_calls") {
        None | Some(Value::Null) => {}
        Some(Value::Bool(b)) => {
            out.insert("parallel_tool_calls".into(), json!(b));
            echo.insert("parallel_tool_calls".into(), json!(b));
        }
        Some(other) => {
            return Err(invalid(format!(
                "parallel_tool_calls: expected a boolean, got {}",
                type_name(other)
            )));
        }
    }
    if let Some(text) = req.get("text").filter(|t| !t.is_null()) {
        if let Some(rf) = convert_text_format(text)? {
            out.insert("response_format".into(), rf);
        }
        echo.insert("text".into(), text.clone());
    }
    let stream = match req.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(other) => {
            return Err(invalid(format!(
                "stream: expected a boolean, got {}",
                type_name(other)
            )));
        }
    };
    if stream {
        out.insert("stream".into(), json!(true));
        out.insert("stream_options".into(), json!({ "include_usage": true }));
    }
    Ok(ChatRequest {
        body: Value::Object(out),
        model,
        stream,
        echo,
    })
}

fn upstream(message: impl Into<String>) -> IngressError {
    IngressError::new(502, message)
}

/// `ResponseUsage` from chat usage counts.
fn usage_json((input, output, cached): (u64, u64, Option<u64>)) -> Value {
    json!({
        "input_tokens": input,
        "input_tokens_details": { "cached_tokens": cached.unwrap_or(0), "cache_write_tokens": 0 },
        "output_tokens": output,
        "output_tokens_details": { "reasoning_tokens": 0 },
        "total_tokens": input.saturating_add(output),
    })
}

/// `(status, incomplete_details)` for a chat `finish_reason`.
fn status_of(finish: Option<&str>) -> (&'static str, Value) {
    match finish {
        Some("length") => ("incomplete", json!({ "reason": "max_output_tokens" })),
        Some("content_filter") => ("incomplete", json!({ "reason": "content_filter" })),
        _ => ("completed", Value::Null),
    }
}

/// The `Response` object around `output`.
#[allow(clippy::too_many_arguments)]
fn response_object(
    req: &ChatRequest,
    id: u128,
    created_at: u64,
    status: &str,
    output: Vec<Value>,
    usage: Value,
    incomplete: Value,
    error: Value,
) -> Value {
    let echo = |k: &str, default: Value| req.echo.get(k).cloned().unwrap_or(default);
    json!({
        "id": response_id(id),
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": error,
        "incomplete_details": incomplete,
        "instructions": echo("instructions", Value::Null),
        "max_output_tokens": echo("max_output_tokens", Value::Null),
        "metadata": echo("metadata", json!({})),
        "model": req.model,
        "output": output,
        "parallel_tool_calls": echo("parallel_tool_calls", json!(true)),
        "temperature": echo("temperature", Value::Null),
        "tool_choice": echo("tool_choice", json!("auto")),
        "tools": echo("tools", json!([])),
        "top_p": echo("top_p", Value::Null),
        "text": echo("text", json!({ "format": { "type": "text" } })),
        "user": echo("user", Value::Null),
        "usage": usage,
    })
}

fn message_item(id: String, text: &str, status: &str) -> Value {
    let content = if status == "in_progress" {
        json!([])
    } else {
        json!([output_text(text)])
    };
    json!({ "id": id, "type": "message", "role": "assistant", "status": status, "content": content })
}

fn output_text(text: &str) -> Value {
    json!({ "type": "output_text", "text": text, "annotations": [], "logprobs": [] })
}

fn call_item(id: String, call_id: &str, name: &str, arguments: &str, status: &str) -> Value {
    json!({
        "id": id, "type": "function_call", "status": status,
        "call_id": call_id, "name": name, "arguments": arguments,
    })
}

/// Converts a buffered chat-completions response into a Responses `Response`.
///
/// `id` names the response and its items; `created_at` is the caller's clock (Unix seconds). A
/// body that is not a chat completion or is over `limits.max_chunk_bytes` → 502.
pub fn chat_response_to_response(
    chat: &[u8],
    req: &ChatRequest,
    id: u128,
    created_at: u64,
    limits: &Limits,
) -> Result<Value, IngressError> {
    if chat.len() > limits.max_chunk_bytes {
        return Err(upstream(format!(
            "upstream response is {} bytes, over the {}-byte limit",
            chat.len(),
            limits.max_chunk_bytes
        )));
    }
    let v: Value = serde_json::from_slice(chat)
        .map_err(|e| upstream(format!("upstream response is not valid JSON: {e}")))?;
    let choice = v
        .get("choices")
        .and_then(Value::as_array)
        .and_then(|c| c.first())
        .ok_or_else(|| upstream("upstream response has no choices"))?;
    let msg = choice
        .get("message")
        .and_then(Value::as_object)
        .ok_or_else(|| upstream("upstream response choice has no message"))?;
    let mut output = Vec::new();
    if let Some(t) = msg
        .get("content")
        .and_then(Value::as_str)
        .filter(|t| !t.is_empty())
    {
        output.push(message_item(message_item_id(id, 0), t, "completed"));
    }
    if let Some(calls) = msg.get("tool_calls").and_then(Value::as_array) {
        for (i, c) in calls.iter().enumerate() {
            let f = c.get("function").unwrap_or(&Value::Null);
            let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
            let args = f
                .get("arguments")
                .and_then(Value::as_str)
                .unwrap_or_default();
            let call_id = c
                .get("id")
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .map_or_else(|| format!("call_{id:032x}_{i}"), str::to_owned);
            output.push(call_item(
                call_item_id(id, i),
                &call_id,
                name,
                args,
                "completed",
            ));
        }
    }
    let (status, incomplete) = status_of(choice.get("finish_reason").and_then(Value::as_str));
    Ok(response_object(
        req,
        id,
        created_at,
        status,
        output,
        usage_json(usage_of(v.get("usage"))),
        incomplete,
        Value::Null,
    ))
}

/// One Responses SSE event: `event: <type>\ndata: <json>\n\n`.
#[derive(Clone, Debug, PartialEq)]
pub struct SseEvent {
    pub event: &'static str,
    pub data: Value,
}

impl SseEvent {
    /// The wire form of the event.
    pub fn to_bytes(&self) -> Vec<u8> {
        format!("event: {}\ndata: {}\n\n", self.event, self.data).into_bytes()
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Open {
    /// A message item with its text so far.
    Text,
    /// A function_call item for the chat tool call with this `index`.
    Tool(u64),
}

/// Converts a chat-completions SSE stream into the Responses event sequence.
///
/// Feed each upstream `data:` payload to [`push`](Self::push) (including `[DONE]`), then call
/// [`finish`](Self::finish) at end of stream. Once [`is_done`](Self::is_done), the stream has
/// ended with `response.completed`, `response.incomplete` or `response.failed`.
#[derive(Debug)]
pub struct ResponsesStream {
    req: ChatRequest,
    id: u128,
    created_at: u64,
    limits: Limits,
    seq: u64,
    started: bool,
    done: bool,
    open: Option<Open>,
    /// Finished output items.
    output: Vec<Value>,
    /// The open item: id, call id, name, accumulated text or arguments.
    item_id: String,
    call_id: String,
    name: String,
    text: String,
    seen_tools: Vec<u64>,
    output_bytes: usize,
    finish_reason: Option<String>,
    usage: (u64, u64, Option<u64>),
}

impl ResponsesStream {
    /// A stream for `req` whose response id is [`response_id`]`(id)`.
    pub fn new(req: &ChatRequest, id: u128, created_at: u64, limits: Limits) -> Self {
        Self {
            req: req.clone(),
            id,
            created_at,
            limits,
            seq: 0,
            started: false,
            done: false,
            open: None,
            output: Vec::new(),
            item_id: String::new(),
            call_id: String::new(),
            name: String::new(),
            text: String::new(),
            seen_tools: Vec::new(),
            output_bytes: 0,
            finish_reason: None,
            usage: (0, 0, None),
        }
    }

    /// Whether the stream has ended.
    pub fn is_done(&self) -> bool {
        self.done
    }

    fn emit(&mut self, event: &'static str, mut data: Value, out: &mut Vec<SseEvent>) {
        data["type"] = json!(event);
        data["sequence_number"] = json!(self.seq);
        self.seq += 1;
        out.push(SseEvent { event, data });
    }

    fn snapshot(&self, status: &str, incomplete: Value, error: Value, usage: Value) -> Value {
        response_object(
            &self.req,
            self.id,
            self.created_at,
            status,
            self.output.clone(),
            usage,
            incomplete,
            error,
        )
    }

    fn start(&mut self, out: &mut Vec<SseEvent>) {
        if self.started {
            return;
        }
        self.started = true;
        let r = self.snapshot("in_progress", Value::Null, Value::Null, Value::Null);
        self.emit("response.created", json!({ "response": r.clone() }), out);
        self.emit("response.in_progress", json!({ "response": r }), out);
    }

    fn close_item(&mut self, out: &mut Vec<SseEvent>) {
        let Some(open) = self.open.take() else {
            return;
        };
        let index = self.output.len();
        let item_id = std::mem::take(&mut self.item_id);
        let text = std::mem::take(&mut self.text);
        let item = match open {
            Open::Text => {
                self.emit(
                    "response.output_text.done",
                    json!({ "item_id": item_id, "output_index": index, "content_index": 0,
                            "text": text, "logprobs": [] }),
                    out,
                );
                self.emit(
                    "response.content_part.done",
                    json!({ "item_id": item_id, "output_index": index, "content_index": 0,
                            "part": output_text(&text) }),
                    out,
                );
                message_item(item_id, &text, "completed")
            }
            Open::Tool(_) => {
                self.emit(
                    "response.function_call_arguments.done",
                    json!({ "item_id": item_id, "output_index": index, "arguments": text }),
                    out,
                );
                call_item(item_id, &self.call_id, &self.name, &text, "completed")
            }
        };
        self.emit(
            "response.output_item.done",
            json!({ "output_index": index, "item": item.clone() }),
            out,
        );
        self.output.push(item);
    }

    fn open_item(&mut self, open: Open, out: &mut Vec<SseEvent>) -> Result<(), String> {
        self.close_item(out);
        let index = self.output.len();
        if index >= self.limits.max_items {
            return Err(format!(
                "upstream stream opened more than {} output items",
                self.limits.max_items
            ));
        }
        match open {
            Open::Text => {
                self.item_id = message_item_id(self.id, index);
                let item = message_item(self.item_id.clone(), "", "in_progress");
                self.emit(
                    "response.output_item.added",
                    json!({ "output_index": index, "item": item }),
                    out,
                );
                self.emit(
                    "response.content_part.added",
                    json!({ "item_id": self.item_id, "output_index": index, "content_index": 0,
                            "part": output_text("") }),
                    out,
                );
            }
            Open::Tool(_) => {
                self.item_id = call_item_id(self.id, index);
                let item = call_item(
                    self.item_id.clone(),
                    &self.call_id,
                    &self.name,
                    "",
                    "in_progress",
                );
                self.emit(
                    "response.output_item.added",
                    json!({ "output_index": index, "item": item }),
                    out,
                );
            }
        }
        self.open = Some(open);
        Ok(())
    }

    fn account(&mut self, bytes: usize) -> Result<(), String> {
        self.output_bytes = self.output_bytes.saturating_add(bytes);
        if self.output_bytes > self.limits.max_output_bytes {
            return Err(format!(
                "upstream output exceeds {} bytes",
                self.limits.max_output_bytes
            ));
        }
        Ok(())
    }

    fn fail(&mut self, message: String, out: &mut Vec<SseEvent>) {
        self.done = true;
        let error = json!({ "code": "server_error", "message": message });
        let r = self.snapshot("failed", Value::Null, error, Value::Null);
        self.emit("response.failed", json!({ "response": r }), out);
    }

    /// Feeds one upstream `data:` payload (a chat chunk, or `[DONE]`).
    pub fn push(&mut self, data: &[u8]) -> Vec<SseEvent> {
        let mut out = Vec::new();
        if self.done {
            return out;
        }
        self.start(&mut out);
        if let Err(e) = self.push_inner(data, &mut out) {
            self.fail(e, &mut out);
        }
        out
    }

    fn push_inner(&mut self, data: &[u8], out: &mut Vec<SseEvent>) -> Result<(), String> {
        let o = match super::parse_chat_chunk(data, self.limits.max_chunk_bytes)? {
            super::ChatChunk::Done => return self.finish_inner(out),
            super::ChatChunk::Data(o) => o,
        };
        if let Some(u) = o.get("usage").filter(|u| u.is_object()) {
            self.usage = usage_of(Some(u));
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
            self.account(t.len())?;
            if self.open != Some(Open::Text) {
                self.open_item(Open::Text, out)?;
            }
            self.text.push_str(t);
            let index = self.output.len();
            self.emit(
                "response.output_text.delta",
                json!({ "item_id": self.item_id, "output_index": index, "content_index": 0,
                        "delta": t, "logprobs": [] }),
                out,
            );
        }
        if let Some(calls) = delta.get("tool_calls").and_then(Value::as_array) {
            for c in calls {
                self.tool_fragment(c, out)?;
            }
        }
        if let Some(f) = choice.get("finish_reason").and_then(Value::as_str) {
            self.finish_reason = Some(f.to_owned());
        }
        Ok(())
    }

    fn tool_fragment(&mut self, c: &Value, out: &mut Vec<SseEvent>) -> Result<(), String> {
        let index = c.get("index").and_then(Value::as_u64).unwrap_or(0);
        let f = c.get("function").unwrap_or(&Value::Null);
        if self.open != Some(Open::Tool(index)) {
            if self.seen_tools.contains(&index) {
                return Err(format!(
                    "upstream interleaved tool call {index} after its item was closed"
                ));
            }
            self.close_item(out);
            self.seen_tools.push(index);
            self.call_id = c
                .get("id")
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .map_or_else(|| format!("call_{:032x}_{index}", self.id), str::to_owned);
            self.name = f
                .get("name")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned();
            self.account(self.call_id.len() + self.name.len())?;
            self.open_item(Open::Tool(index), out)?;
        }
        if let Some(args) = f
            .get("arguments")
            .and_then(Value::as_str)
            .filter(|a| !a.is_empty())
        {
            self.account(args.len())?;
            self.text.push_str(args);
            let index = self.output.len();
            self.emit(
                "response.function_call_arguments.delta",
                json!({ "item_id": self.item_id, "output_index": index, "delta": args }),
                out,
            );
        }
        Ok(())
    }

    fn finish_inner(&mut self, out: &mut Vec<SseEvent>) -> Result<(), String> {
        let Some(finish) = self.finish_reason.clone() else {
            return Err("upstream stream ended before a finish_reason".into());
        };
        self.close_item(out);
        let (status, incomplete) = status_of(Some(&finish));
        let r = self.snapshot(status, incomplete, Value::Null, usage_json(self.usage));
        let event = if status == "completed" {
            "response.completed"
        } else {
            "response.incomplete"
        };
        self.emit(event, json!({ "response": r }), out);
        self.done = true;
        Ok(())
    }

    /// End of the upstream stream (with or without `[DONE]`): the closing events if the stream
    /// is still open, `response.failed` when no `finish_reason` was seen.
    pub fn finish(&mut self) -> Vec<SseEvent> {
        let mut out = Vec::new();
        if self.done {
            return out;
        }
        self.start(&mut out);
        if let Err(e) = self.finish_inner(&mut out) {
            self.fail(e, &mut out);
        }
        out
    }
}

#[cfg(test)]
mod tests;
