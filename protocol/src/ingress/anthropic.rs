//! Anthropic Messages API ⇄ OpenAI chat completions, sans-IO.
//!
//! Written against the Anthropic Messages API (`MessageCreateParams`, `Message`, content blocks,
//! `RawMessageStreamEvent`) as modelled by the `anthropic` Python SDK 2.15.0 (`anthropic/types/`)
//! and the chat types of the `openai` Python SDK 3.57.0 (`openai/types/chat/`), plus vLLM's non-standard `stop_reason` on
//! choices (the matched stop string), which Dynamo's OpenAI frontend relays.
//!
//! **Request (`messages_to_chat`)** converts:
//! - `system` (string, or text blocks joined with `"\n"`) → one leading `system` message;
//! - user content: `text` → text part, `image` (`base64` or `url` source) → `image_url` part (base64
//!   becomes a `data:` URL), `tool_result` → a `role: tool` message with `tool_call_id`, placed in
//!   order before the rest of that user turn (content string or text blocks; `is_error: true`
//!   prefixes the content with `[tool error] `);
//! - assistant content: `text` blocks → `content` string, `tool_use` → `tool_calls` (arguments =
//!   the JSON text of `input`);
//! - `tools` (name, description, input_schema) → function tools (`parameters`); `tool_choice`
//!   auto/any/tool/none → `"auto"`/`"required"`/`{function}`/`"none"`,
//!   `disable_parallel_tool_use: true` → `parallel_tool_calls: false`;
//! - `stop_sequences` → `stop`; `max_tokens`, `temperature`, `top_p` pass through; `top_k` stays a
//!   top-level `top_k` (a vLLM / Dynamo sampling extension); `metadata.user_id` → `user`;
//!   `stream: true` → `stream: true` + `stream_options.include_usage`.
//!
//! **Dropped**: `thinking` / `redacted_thinking` blocks, `cache_control` markers, `citations`, tool
//! `strict` / `input_examples` / `defer_loading`,
//! `thinking` / `service_tier` / `container` / `mcp_servers` request fields and any unknown field
//! (tolerated and ignored). **Refused (400)**: other content block types (`document`,
//! `search_result`, server tool blocks…), server tools (a `type` other than `custom`), images inside
//! `tool_result`, a missing/ill-typed `model`, `max_tokens` or `messages`. Bodies over
//! [`Limits::max_body_bytes`] are refused with 413 before parsing.
//!
//! **Response (`chat_response_to_message`)**: `content` → a `text` block, `tool_calls` → `tool_use`
//! blocks with parsed JSON `input`; `finish_reason` stop → `end_turn` (or `stop_sequence` when the
//! choice names a stop string the client asked for), length → `max_tokens`, tool_calls →
//! `tool_use`, content_filter → `refusal`; usage prompt/completion tokens → input/output tokens
//! (`prompt_tokens_details.cached_tokens` → `cache_read_input_tokens`). `reasoning_content` is
//! dropped.
//!
//! **Stream ([`AnthropicStream`])**: chat SSE `data:` payloads in, Anthropic events out in the
//! order the Anthropic API uses: `message_start`, `ping`, then per text or tool_use block
//! `content_block_start`, `content_block_delta`* (`text_delta` / `input_json_delta`),
//! `content_block_stop`, then `message_delta` (stop_reason, usage) and `message_stop`. Token
//! counts are only known at the end (the upstream's `include_usage` chunk), so `message_start`
//! carries zeros and `message_delta.usage` the final input/output counts. A malformed
//! chunk, an upstream error object, a stream that ends before a `finish_reason`, or a bound
//! exceeded (blocks, tool-argument bytes, chunk bytes) ends the stream with one `error` event.
//!
//! **Errors**: [`error_body`] builds `{"type":"error","error":{"type","message"}}` with the
//! status → type mapping of the Anthropic API; [`direct_mode_refusal`] is the seed's 503
//! `api_error` ending with `disaggregated_prefill_decode_unavailable`.

use serde_json::{Map, Value, json};

/// Bounds applied to untrusted request bodies and upstream streams.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest request body accepted (413 above).
    pub max_body_bytes: usize,
    /// Largest single upstream SSE `data:` payload (chunk or buffered response).
    pub max_chunk_bytes: usize,
    /// Total tool-call argument bytes relayed in one stream.
    pub max_tool_arg_bytes: usize,
    /// Content blocks one streamed message may open.
    pub max_blocks: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_body_bytes: 32 * 1024 * 1024,
            max_chunk_bytes: 4 * 1024 * 1024,
            max_tool_arg_bytes: 4 * 1024 * 1024,
            max_blocks: 1024,
        }
    }
}

/// The suffix the seed puts on a direct-mode refusal relayed to an Anthropic client.
pub const DIRECT_MODE_REFUSAL_CODE: &str = "disaggregated_prefill_decode_unavailable";

/// A refusal in the Anthropic error shape: an HTTP status and a message; the error `type` follows
/// from the status ([`error_type_for_status`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{status} {}: {message}", error_type_for_status(*status))]
pub struct IngressError {
    pub status: u16,
    pub message: String,
}

impl IngressError {
    pub fn new(status: u16, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Self::new(400, message)
    }

    /// The Anthropic error type of this refusal.
    pub fn error_type(&self) -> &'static str {
        error_type_for_status(self.status)
    }

    /// `{"type":"error","error":{"type":…,"message":…}}`.
    pub fn body(&self) -> Value {
        error_body(self.status, &self.message)
    }
}

/// Anthropic error type for an HTTP status.
pub fn error_type_for_status(status: u16) -> &'static str {
    match status {
        400 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        529 => "overloaded_error",
        500..=599 => "api_error",
        _ => "invalid_request_error",
    }
}

/// `{"type":"error","error":{"type": <mapped from status>, "message": message}}`.
pub fn error_body(status: u16, message: &str) -> Value {
    json!({
        "type": "error",
        "error": { "type": error_type_for_status(status), "message": message },
    })
}

/// The seed's mapping of a direct-mode refusal: 503 `api_error` whose message ends with
/// [`DIRECT_MODE_REFUSAL_CODE`].
pub fn direct_mode_refusal() -> IngressError {
    IngressError::new(
        503,
        format!(
            "prefill/decode worker pair unavailable in direct routing mode: {DIRECT_MODE_REFUSAL_CODE}"
        ),
    )
}

/// `msg_` + 32 hex digits of a caller-supplied id.
pub fn message_id(id: u128) -> String {
    format!("msg_{id:032x}")
}

/// A converted request: the chat-completions body plus what the response converters need.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatRequest {
    /// The chat-completions JSON body for the shim.
    pub body: Value,
    /// The model the client named (echoed in the `Message`).
    pub model: String,
    /// The client's `stop_sequences` (to report `stop_sequence` stop reasons).
    pub stop_sequences: Vec<String>,
    /// Whether the client asked for an SSE stream.
    pub stream: bool,
}

pub(crate) fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

pub(crate) fn want_str<'a>(v: &'a Value, what: &str) -> Result<&'a str, IngressError> {
    v.as_str().ok_or_else(|| {
        IngressError::invalid(format!("{what}: expected a string, got {}", type_name(v)))
    })
}

pub(crate) fn want_obj<'a>(
    v: &'a Value,
    what: &str,
) -> Result<&'a Map<String, Value>, IngressError> {
    v.as_object().ok_or_else(|| {
        IngressError::invalid(format!("{what}: expected an object, got {}", type_name(v)))
    })
}

pub(crate) fn want_arr<'a>(v: &'a Value, what: &str) -> Result<&'a Vec<Value>, IngressError> {
    v.as_array().ok_or_else(|| {
        IngressError::invalid(format!("{what}: expected an array, got {}", type_name(v)))
    })
}

pub(crate) fn want_num(v: &Value, what: &str) -> Result<Value, IngressError> {
    if v.is_number() {
        Ok(v.clone())
    } else {
        Err(IngressError::invalid(format!(
            "{what}: expected a number, got {}",
            type_name(v)
        )))
    }
}

/// Text of a string or an array of `text` blocks (`system`, `tool_result.content`).
fn text_of(v: &Value, what: &str) -> Result<String, IngressError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut out = Vec::with_capacity(blocks.len());
            for (i, b) in blocks.iter().enumerate() {
                let what = format!("{what}[{i}]");
                let o = want_obj(b, &what)?;
                let ty = want_str(
                    o.get("type").unwrap_or(&Value::Null),
                    &format!("{what}.type"),
                )?;
                if ty != "text" {
                    return Err(IngressError::invalid(format!(
                        "{what}: block type `{ty}` is not supported here (text only)"
                    )));
                }
                out.push(want_str(
                    o.get("text").unwrap_or(&Value::Null),
                    &format!("{what}.text"),
                )?);
            }
            Ok(out.join("\n"))
        }
        other => Err(IngressError::invalid(format!(
            "{what}: expected a string or an array of text blocks, got {}",
            type_name(other)
        ))),
    }
}

fn image_part(o: &Map<String, Value>, what: &str) -> Result<Value, IngressError> {
    let src = want_obj(
        o.get("source").unwrap_or(&Value::Null),
        &format!("{what}.source"),
    )?;
    let sty = want_str(
        src.get("type").unwrap_or(&Value::Null),
        &format!("{what}.source.type"),
    )?;
    let url = match sty {
        "base64" => {
            let mt = want_str(
                src.get("media_type").unwrap_or(&Value::Null),
                &format!("{what}.source.media_type"),
            )?;
            let data = want_str(
                src.get("data").unwrap_or(&Value::Null),
                &format!("{what}.source.data"),
            )?;
            format!("data:{mt};base64,{data}")
        }
        "url" => want_str(
            src.get("url").unwrap_or(&Value::Null),
            &format!("{what}.source.url"),
        )?
        .to_owned(),
        other => {
            return Err(IngressError::invalid(format!(
                "{what}.source.type: `{other}` is not supported (base64 or url)"
            )));
        }
    };
    Ok(json!({ "type": "image_url", "image_url": { "url": url } }))
}

/// A message's `content`: a plain string becomes one chat message of `role` at once (`None`),
/// an array is returned for block-by-block conversion, anything else is refused.
fn content_blocks<'a>(
    content: &'a Value,
    role: &str,
    what: &str,
    out: &mut Vec<Value>,
) -> Result<Option<&'a Vec<Value>>, IngressError> {
    match content {
        Value::String(s) => {
            out.push(json!({ "role": role, "content": s }));
            Ok(None)
        }
        Value::Array(b) => Ok(Some(b)),
        other => Err(IngressError::invalid(format!(
            "{what}: expected a string or an array of content blocks, got {}",
            type_name(other)
        ))),
    }
}

fn convert_user(content: &Value, what: &str, out: &mut Vec<Value>) -> Result<(), IngressError> {
    let Some(blocks) = content_blocks(content, "user", what, out)? else {
        return Ok(());
    };
    let mut parts = Vec::new();
    for (i, b) in blocks.iter().enumerate() {
        let what = format!("{what}[{i}]");
        let o = want_obj(b, &what)?;
        let ty = want_str(
            o.get("type").unwrap_or(&Value::Null),
            &format!("{what}.type"),
        )?;
        match ty {
            "text" => {
                let t = want_str(
                    o.get("text").unwrap_or(&Value::Null),
                    &format!("{what}.text"),
                )?;
                parts.push(json!({ "type": "text", "text": t }));
            }
            "image" => parts.push(image_part(o, &what)?),
            "tool_result" => {
                let id = want_str(
                    o.get("tool_use_id").unwrap_or(&Value::Null),
                    &format!("{what}.tool_use_id"),
                )?;
                let mut text = match o.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(c) => text_of(c, &format!("{what}.content"))?,
                };
                if o.get("is_error") == Some(&Value::Bool(true)) {
                    text.insert_str(0, "[tool error] ");
                }
                out.push(json!({ "role": "tool", "tool_call_id": id, "content": text }));
            }
            "thinking" | "redacted_thinking" => {}
            other => {
                return Err(IngressError::invalid(format!(
                    "{what}: content block type `{other}` is not supported in a user turn"
                )));
            }
        }
    }
    if !parts.is_empty() {
        out.push(json!({ "role": "user", "content": parts }));
    }
    Ok(())
}

fn convert_assistant(
    content: &Value,
    what: &str,
    out: &mut Vec<Value>,
) -> Result<(), IngressError> {
    let Some(blocks) = content_blocks(content, "assistant", what, out)? else {
        return Ok(());
    };
    let mut texts: Vec<&str> = Vec::new();
    let mut calls = Vec::new();
    for (i, b) in blocks.iter().enumerate() {
        let what = format!("{what}[{i}]");
        let o = want_obj(b, &what)?;
        let ty = want_str(
            o.get("type").unwrap_or(&Value::Null),
            &format!("{what}.type"),
        )?;
        match ty {
            "text" => texts.push(want_str(
                o.get("text").unwrap_or(&Value::Null),
                &format!("{what}.text"),
            )?),
            "tool_use" => {
                let id = want_str(o.get("id").unwrap_or(&Value::Null), &format!("{what}.id"))?;
                let name = want_str(
                    o.get("name").unwrap_or(&Value::Null),
                    &format!("{what}.name"),
                )?;
                let input = o.get("input").cloned().unwrap_or_else(|| json!({}));
                want_obj(&input, &format!("{what}.input"))?;
                calls.push(json!({
                    "id": id,
                    "type": "function",
                    "function": { "name": name, "arguments": input.to_string() },
                }));
            }
            "thinking" | "redacted_thinking" => {}
            other => {
                return Err(IngressError::invalid(format!(
                    "{what}: content block type `{other}` is not supported in an assistant turn"
                )));
            }
        }
    }
    let mut msg = Map::new();
    msg.insert("role".into(), json!("assistant"));
    msg.insert(
        "content".into(),
        if texts.is_empty() {
            Value::Null
        } else {
            Value::String(texts.concat())
        },
    );
    if !calls.is_empty() {
        msg.insert("tool_calls".into(), Value::Array(calls));
    }
    out.push(Value::Object(msg));
    Ok(())
}

fn convert_tools(tools: &Value) -> Result<Value, IngressError> {
    let tools = want_arr(tools, "tools")?;
    let mut out = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        let what = format!("tools[{i}]");
        let o = want_obj(t, &what)?;
        match o.get("type") {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if s == "custom" => {}
            Some(other) => {
                return Err(IngressError::invalid(format!(
                    "{what}.type: server tool `{}` is not supported",
                    other.as_str().unwrap_or("?")
                )));
            }
        }
        let name = want_str(
            o.get("name").unwrap_or(&Value::Null),
            &format!("{what}.name"),
        )?;
        let schema = o.get("input_schema").unwrap_or(&Value::Null);
        want_obj(schema, &format!("{what}.input_schema"))?;
        let mut f = Map::new();
        f.insert("name".into(), json!(name));
        if let Some(d) = o.get("description").filter(|d| !d.is_null()) {
            f.insert(
                "description".into(),
                json!(want_str(d, &format!("{what}.description"))?),
            );
        }
        f.insert("parameters".into(), schema.clone());
        out.push(json!({ "type": "function", "function": f }));
    }
    Ok(Value::Array(out))
}

/// Converts an Anthropic `MessageCreateParams` body into a chat-completions body.
///
/// 413 `request_too_large` above `limits.max_body_bytes` (checked before parsing); 400
/// `invalid_request_error` for anything malformed. Unknown fields are ignored.
pub fn messages_to_chat(body: &[u8], limits: &Limits) -> Result<ChatRequest, IngressError> {
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
        .map_err(|e| IngressError::invalid(format!("request body is not valid JSON: {e}")))?;
    let req = want_obj(&v, "request body")?;
    let model = want_str(req.get("model").unwrap_or(&Value::Null), "model")?.to_owned();
    let max_tokens = req.get("max_tokens").unwrap_or(&Value::Null);
    if max_tokens.as_u64().is_none_or(|n| n == 0) {
        return Err(IngressError::invalid(
            "max_tokens: expected a positive integer",
        ));
    }
    let messages = want_arr(req.get("messages").unwrap_or(&Value::Null), "messages")?;

    let mut chat_msgs = Vec::with_capacity(messages.len() + 1);
    if let Some(system) = req.get("system").filter(|s| !s.is_null()) {
        chat_msgs.push(json!({ "role": "system", "content": text_of(system, "system")? }));
    }
    for (i, m) in messages.iter().enumerate() {
        let what = format!("messages[{i}]");
        let o = want_obj(m, &what)?;
        let role = want_str(
            o.get("role").unwrap_or(&Value::Null),
            &format!("{what}.role"),
        )?;
        let content = o.get("content").unwrap_or(&Value::Null);
        let what = format!("{what}.content");
        match role {
            "user" => convert_user(content, &what, &mut chat_msgs)?,
            "assistant" => convert_assistant(content, &what, &mut chat_msgs)?,
            other => {
                return Err(IngressError::invalid(format!(
                    "messages[{i}].role: `{other}` is not user or assistant"
                )));
            }
        }
    }

    let mut out = Map::new();
    out.insert("model".into(), json!(model));
    out.insert("messages".into(), Value::Array(chat_msgs));
    out.insert("max_tokens".into(), max_tokens.clone());
    for key in ["temperature", "top_p", "top_k"] {
        if let Some(x) = req.get(key).filter(|x| !x.is_null()) {
            out.insert(key.into(), want_num(x, key)?);
        }
    }
    let mut stop_sequences = Vec::new();
    if let Some(s) = req.get("stop_sequences").filter(|s| !s.is_null()) {
        for (i, x) in want_arr(s, "stop_sequences")?.iter().enumerate() {
            stop_sequences.push(want_str(x, &format!("stop_sequences[{i}]"))?.to_owned());
        }
        if !stop_sequences.is_empty() {
            out.insert("stop".into(), json!(stop_sequences));
        }
    }
    if let Some(t) = req.get("tools").filter(|t| !t.is_null()) {
        out.insert("tools".into(), convert_tools(t)?);
    }
    if let Some(tc) = req.get("tool_choice").filter(|t| !t.is_null()) {
        let o = want_obj(tc, "tool_choice")?;
        let ty = want_str(o.get("type").unwrap_or(&Value::Null), "tool_choice.type")?;
        let choice = match ty {
            "auto" => json!("auto"),
            "any" => json!("required"),
            "none" => json!("none"),
            "tool" => {
                let name = want_str(o.get("name").unwrap_or(&Value::Null), "tool_choice.name")?;
                json!({ "type": "function", "function": { "name": name } })
            }
            other => {
                return Err(IngressError::invalid(format!(
                    "tool_choice.type: `{other}` is not auto, any, tool or none"
                )));
            }
        };
        out.insert("tool_choice".into(), choice);
        if o.get("disable_parallel_tool_use") == Some(&Value::Bool(true)) {
            out.insert("parallel_tool_calls".into(), json!(false));
        }
    }
    if let Some(md) = req.get("metadata").filter(|m| !m.is_null()) {
        let md = want_obj(md, "metadata")?;
        if let Some(u) = md.get("user_id").filter(|u| !u.is_null()) {
            out.insert("user".into(), json!(want_str(u, "metadata.user_id")?));
        }
    }
    let stream = match req.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(other) => {
            return Err(IngressError::invalid(format!(
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
        stop_sequences,
        stream,
    })
}

/// Anthropic `stop_reason` for a chat `finish_reason`; `matched` is the choice's vLLM
/// `stop_reason` (the stop string that ended generation), if any.
fn map_stop_reason(
    finish: Option<&str>,
    matched: Option<&str>,
    stop_sequences: &[String],
) -> (&'static str, Option<String>) {
    match finish {
        Some("length") => ("max_tokens", None),
        Some("tool_calls") | Some("function_call") => ("tool_use", None),
        Some("content_filter") => ("refusal", None),
        _ => match matched.filter(|m| stop_sequences.iter().any(|s| s == m)) {
            Some(m) => ("stop_sequence", Some(m.to_owned())),
            None => ("end_turn", None),
        },
    }
}

fn upstream(message: impl Into<String>) -> IngressError {
    IngressError::new(502, message)
}

pub(crate) fn usage_of(u: Option<&Value>) -> (u64, u64, Option<u64>) {
    let get = |k: &str| {
        u.and_then(|u| u.get(k))
            .and_then(Value::as_u64)
            .unwrap_or(0)
    };
    let cached = u
        .and_then(|u| u.get("prompt_tokens_details"))
        .and_then(|d| d.get("cached_tokens"))
        .and_then(Value::as_u64);
    (get("prompt_tokens"), get("completion_tokens"), cached)
}

fn usage_json(input: u64, output: u64, cached: Option<u64>) -> Value {
    let mut u = json!({ "input_tokens": input, "output_tokens": output });
    if let Some(c) = cached {
        u["cache_read_input_tokens"] = json!(c);
    }
    u
}

/// Converts a buffered chat-completions response into an Anthropic `Message`.
///
/// `id` becomes the message id ([`message_id`]) and names tool_use blocks whose call has no id.
/// A body that is not a chat completion (no `choices[0].message`), tool arguments that are not a
/// JSON object, or a body over `limits.max_chunk_bytes` → 502 `api_error`.
pub fn chat_response_to_message(
    chat: &[u8],
    req: &ChatRequest,
    id: u128,
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
    let mut content = Vec::new();
    if let Some(t) = msg
        .get("content")
        .and_then(Value::as_str)
        .filter(|t| !t.is_empty())
    {
        content.push(json!({ "type": "text", "text": t }));
    }
    if let Some(calls) = msg.get("tool_calls").and_then(Value::as_array) {
        for (i, c) in calls.iter().enumerate() {
            let f = c.get("function").unwrap_or(&Value::Null);
            let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
            let args = f
                .get("arguments")
                .and_then(Value::as_str)
                .unwrap_or_default();
            let input: Value = if args.trim().is_empty() {
                json!({})
            } else {
                serde_json::from_str(args).map_err(|e| {
                    upstream(format!("tool call `{name}` arguments are not JSON: {e}"))
                })?
            };
            if !input.is_object() {
                return Err(upstream(format!(
                    "tool call `{name}` arguments are not a JSON object"
                )));
            }
            let call_id = c
                .get("id")
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .map_or_else(|| format!("toolu_{id:032x}_{i}"), str::to_owned);
            content
                .push(json!({ "type": "tool_use", "id": call_id, "name": name, "input": input }));
        }
    }
    let (stop_reason, stop_sequence) = map_stop_reason(
        choice.get("finish_reason").and_then(Value::as_str),
        choice.get("stop_reason").and_then(Value::as_str),
        &req.stop_sequences,
    );
    let (input, output, cached) = usage_of(v.get("usage"));
    Ok(json!({
        "id": message_id(id),
        "type": "message",
        "role": "assistant",
        "model": req.model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage_json(input, output, cached),
    }))
}

/// One Anthropic SSE event: `event: <name>\ndata: <json>\n\n`.
#[derive(Clone, Debug, PartialEq)]
pub struct SseEvent {
    pub event: &'static str,
    pub data: Value,
}

impl SseEvent {
    fn new(event: &'static str, data: Value) -> Self {
        Self { event, data }
    }

    /// The wire form of the event.
    pub fn to_bytes(&self) -> Vec<u8> {
        format!("event: {}\ndata: {}\n\n", self.event, self.data).into_bytes()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Open {
    Text,
    /// A tool_use block for the chat tool call with this `index`.
    Tool(u64),
}

/// Converts a chat-completions SSE stream into the Anthropic Messages event sequence.
///
/// Feed each upstream `data:` payload to [`push`](Self::push) (including `[DONE]`), then call
/// [`finish`](Self::finish) at end of stream. Every call returns the events to write, in order.
/// Once [`is_done`](Self::is_done), the stream has ended with `message_stop` or `error` and
/// further input is ignored.
#[derive(Debug)]
pub struct AnthropicStream {
    id: u128,
    model: String,
    stop_sequences: Vec<String>,
    limits: Limits,
    started: bool,
    done: bool,
    open: Option<Open>,
    /// Index of the next content block.
    blocks: usize,
    /// Chat tool-call indexes already given a block (a later fragment for one is refused).
    seen_tools: Vec<u64>,
    tool_arg_bytes: usize,
    finish_reason: Option<String>,
    matched_stop: Option<String>,
    usage: (u64, u64, Option<u64>),
}

impl AnthropicStream {
    /// A stream for `req` whose message id is [`message_id`]`(id)`.
    pub fn new(req: &ChatRequest, id: u128, limits: Limits) -> Self {
        Self {
            id,
            model: req.model.clone(),
            stop_sequences: req.stop_sequences.clone(),
            limits,
            started: false,
            done: false,
            open: None,
            blocks: 0,
            seen_tools: Vec::new(),
            tool_arg_bytes: 0,
            finish_reason: None,
            matched_stop: None,
            usage: (0, 0, None),
        }
    }

    /// Whether the stream has ended (`message_stop` or `error` emitted).
    pub fn is_done(&self) -> bool {
        self.done
    }

    fn start(&mut self, out: &mut Vec<SseEvent>) {
        if self.started {
            return;
        }
        self.started = true;
        out.push(SseEvent::new(
            "message_start",
            json!({
                "type": "message_start",
                "message": {
                    "id": message_id(self.id),
                    "type": "message",
                    "role": "assistant",
                    "model": self.model,
                    "content": [],
                    "stop_reason": null,
                    "stop_sequence": null,
                    "usage": { "input_tokens": 0, "output_tokens": 0 },
                },
            }),
        ));
        out.push(SseEvent::new("ping", json!({ "type": "ping" })));
    }

    fn fail(&mut self, message: String, out: &mut Vec<SseEvent>) {
        self.done = true;
        out.push(SseEvent::new("error", error_body(502, &message)));
    }

    fn close_block(&mut self, out: &mut Vec<SseEvent>) {
        if self.open.take().is_some() {
            out.push(SseEvent::new(
                "content_block_stop",
                json!({ "type": "content_block_stop", "index": self.blocks - 1 }),
            ));
        }
    }

    fn open_block(
        &mut self,
        kind: Open,
        block: Value,
        out: &mut Vec<SseEvent>,
    ) -> Result<(), String> {
        self.close_block(out);
        if self.blocks >= self.limits.max_blocks {
            return Err(format!(
                "upstream stream opened more than {} content blocks",
                self.limits.max_blocks
            ));
        }
        out.push(SseEvent::new(
            "content_block_start",
            json!({ "type": "content_block_start", "index": self.blocks, "content_block": block }),
        ));
        self.blocks += 1;
        self.open = Some(kind);
        Ok(())
    }

    fn delta(&self, delta: Value, out: &mut Vec<SseEvent>) {
        out.push(SseEvent::new(
            "content_block_delta",
            json!({ "type": "content_block_delta", "index": self.blocks - 1, "delta": delta }),
        ));
    }

    fn end(&mut self, out: &mut Vec<SseEvent>) {
        self.close_block(out);
        let (stop_reason, stop_sequence) = map_stop_reason(
            self.finish_reason.as_deref(),
            self.matched_stop.as_deref(),
            &self.stop_sequences,
        );
        let (input, output, cached) = self.usage;
        out.push(SseEvent::new(
            "message_delta",
            json!({
                "type": "message_delta",
                "delta": { "stop_reason": stop_reason, "stop_sequence": stop_sequence },
                "usage": usage_json(input, output, cached),
            }),
        ));
        out.push(SseEvent::new(
            "message_stop",
            json!({ "type": "message_stop" }),
        ));
        self.done = true;
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
            if self.open != Some(Open::Text) {
                self.open_block(Open::Text, json!({ "type": "text", "text": "" }), out)?;
            }
            self.delta(json!({ "type": "text_delta", "text": t }), out);
        }
        if let Some(calls) = delta.get("tool_calls").and_then(Value::as_array) {
            for c in calls {
                self.tool_fragment(c, out)?;
            }
        }
        if let Some(f) = choice.get("finish_reason").and_then(Value::as_str) {
            self.finish_reason = Some(f.to_owned());
            self.matched_stop = choice
                .get("stop_reason")
                .and_then(Value::as_str)
                .map(str::to_owned);
        }
        Ok(())
    }

    fn tool_fragment(&mut self, c: &Value, out: &mut Vec<SseEvent>) -> Result<(), String> {
        let index = c.get("index").and_then(Value::as_u64).unwrap_or(0);
        let f = c.get("function").unwrap_or(&Value::Null);
        if self.open != Some(Open::Tool(index)) {
            if self.seen_tools.contains(&index) {
                return Err(format!(
                    "upstream interleaved tool call {index} after its block was closed"
                ));
            }
            self.seen_tools.push(index);
            let id = c
                .get("id")
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .map_or_else(|| format!("toolu_{:032x}_{index}", self.id), str::to_owned);
            let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
            self.open_block(
                Open::Tool(index),
                json!({ "type": "tool_use", "id": id, "name": name, "input": {} }),
                out,
            )?;
        }
        if let Some(args) = f
            .get("arguments")
            .and_then(Value::as_str)
            .filter(|a| !a.is_empty())
        {
            self.tool_arg_bytes = self.tool_arg_bytes.saturating_add(args.len());
            if self.tool_arg_bytes > self.limits.max_tool_arg_bytes {
                return Err(format!(
                    "upstream tool arguments exceed {} bytes",
                    self.limits.max_tool_arg_bytes
                ));
            }
            self.delta(
                json!({ "type": "input_json_delta", "partial_json": args }),
                out,
            );
        }
        Ok(())
    }

    fn finish_inner(&mut self, out: &mut Vec<SseEvent>) -> Result<(), String> {
        if self.finish_reason.is_none() {
            return Err("upstream stream ended before a finish_reason".into());
        }
        self.end(out);
        Ok(())
    }

    /// End of the upstream stream (with or without `[DONE]`). Emits the closing events if the
    /// stream is still open: `message_delta` + `message_stop` when a `finish_reason` was seen, an
    /// `error` event otherwise.
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
