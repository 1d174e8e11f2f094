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

use std::borrow::Cow;

use serde::Serialize;
use serde_json::{Number, Value, json};

use super::chat::{self, Content, Function, ImageUrl, Part, Tool, ToolCall, ToolChoice};
use super::json::{Json, Obj, Path, want_arr, want_num, want_obj, want_str};
use super::stream::{self, ChatStreamConverter, ToolFragment};

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
    /// The chat-completions JSON body for the shim, serialised (what the chat route receives).
    pub body: Vec<u8>,
    /// The model the client named (echoed in the `Message`).
    pub model: String,
    /// The client's `stop_sequences` (to report `stop_sequence` stop reasons).
    pub stop_sequences: Vec<String>,
    /// Whether the client asked for an SSE stream.
    pub stream: bool,
}

impl ChatRequest {
    /// The chat body parsed back into a `serde_json::Value` (for tests and diagnostics).
    pub fn body_json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
}

/// Text of a string or an array of `text` blocks (`system`, `tool_result.content`).
fn text_of<'j>(v: &'j Json<'_>, what: Path<'_>) -> Result<Cow<'j, str>, IngressError> {
    match v {
        Json::Str(s) => Ok(Cow::Borrowed(s)),
        Json::Arr(blocks) => {
            let mut out = Vec::with_capacity(blocks.len());
            for (i, b) in blocks.iter().enumerate() {
                let what = what.at(i);
                let o = want_obj(b, what)?;
                let ty = want_str(o.field("type"), what.key("type"))?;
                if ty != "text" {
                    return Err(IngressError::invalid(format!(
                        "{what}: block type `{ty}` is not supported here (text only)"
                    )));
                }
                out.push(want_str(o.field("text"), what.key("text"))?);
            }
            Ok(Cow::Owned(out.join("\n")))
        }
        other => Err(IngressError::invalid(format!(
            "{what}: expected a string or an array of text blocks, got {}",
            other.type_name()
        ))),
    }
}

fn image_part<'j>(o: &'j Obj<'_>, what: Path<'_>) -> Result<Part<'j>, IngressError> {
    let src = want_obj(o.field("source"), what.key("source"))?;
    let sty = want_str(src.field("type"), what.key("source").key("type"))?;
    let url = match sty {
        "base64" => {
            let mt = want_str(
                src.field("media_type"),
                what.key("source").key("media_type"),
            )?;
            let data = want_str(src.field("data"), what.key("source").key("data"))?;
            Cow::Owned(format!("data:{mt};base64,{data}"))
        }
        "url" => Cow::Borrowed(want_str(src.field("url"), what.key("source").key("url"))?),
        other => {
            return Err(IngressError::invalid(format!(
                "{what}.source.type: `{other}` is not supported (base64 or url)"
            )));
        }
    };
    Ok(Part::ImageUrl {
        image_url: ImageUrl { url, detail: None },
    })
}

/// A message's `content`: a plain string becomes one chat message of `role` at once (`None`),
/// an array is returned for block-by-block conversion, anything else is refused.
fn content_blocks<'j>(
    content: &'j Json<'_>,
    role: &'static str,
    what: Path<'_>,
    out: &mut Vec<chat::Message<'j>>,
) -> Result<Option<&'j [Json<'j>]>, IngressError> {
    match content {
        Json::Str(s) => {
            out.push(chat::Message::text(role, &**s));
            Ok(None)
        }
        Json::Arr(b) => Ok(Some(b)),
        other => Err(IngressError::invalid(format!(
            "{what}: expected a string or an array of content blocks, got {}",
            other.type_name()
        ))),
    }
}

fn convert_user<'j>(
    content: &'j Json<'_>,
    what: Path<'_>,
    out: &mut Vec<chat::Message<'j>>,
) -> Result<(), IngressError> {
    let Some(blocks) = content_blocks(content, "user", what, out)? else {
        return Ok(());
    };
    let mut parts = Vec::new();
    for (i, b) in blocks.iter().enumerate() {
        let what = what.at(i);
        let o = want_obj(b, what)?;
        let ty = want_str(o.field("type"), what.key("type"))?;
        match ty {
            "text" => {
                let text = want_str(o.field("text"), what.key("text"))?;
                parts.push(Part::Text { text });
            }
            "image" => parts.push(image_part(o, what)?),
            "tool_result" => {
                let id = want_str(o.field("tool_use_id"), what.key("tool_use_id"))?;
                let mut text = match o.field("content").present() {
                    None => Cow::Borrowed(""),
                    Some(c) => text_of(c, what.key("content"))?,
                };
                if matches!(o.get("is_error"), Some(Json::Bool(true))) {
                    text = Cow::Owned(format!("[tool error] {text}"));
                }
                out.push(chat::Message::tool(id, text));
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
        out.push(chat::Message {
            content: Content::Parts(parts),
            ..chat::Message::text("user", "")
        });
    }
    Ok(())
}

fn convert_assistant<'j>(
    content: &'j Json<'_>,
    what: Path<'_>,
    out: &mut Vec<chat::Message<'j>>,
) -> Result<(), IngressError> {
    let Some(blocks) = content_blocks(content, "assistant", what, out)? else {
        return Ok(());
    };
    let mut texts: Vec<&str> = Vec::new();
    let mut calls = Vec::new();
    for (i, b) in blocks.iter().enumerate() {
        let what = what.at(i);
        let o = want_obj(b, what)?;
        let ty = want_str(o.field("type"), what.key("type"))?;
        match ty {
            "text" => texts.push(want_str(o.field("text"), what.key("text"))?),
            "tool_use" => {
                let id = want_str(o.field("id"), what.key("id"))?;
                let name = want_str(o.field("name"), what.key("name"))?;
                let arguments = match o.get("input") {
                    None => Cow::Borrowed("{}"),
                    Some(input) => {
                        want_obj(input, what.key("input"))?;
                        Cow::Owned(input.to_json_string())
                    }
                };
                calls.push(ToolCall::function(id, name, arguments));
            }
            "thinking" | "redacted_thinking" => {}
            other => {
                return Err(IngressError::invalid(format!(
                    "{what}: content block type `{other}` is not supported in an assistant turn"
                )));
            }
        }
    }
    out.push(chat::Message {
        role: "assistant",
        tool_call_id: None,
        content: match texts.as_slice() {
            [] => Content::Null,
            [one] => Content::Text(Cow::Borrowed(one)),
            many => Content::Text(Cow::Owned(many.concat())),
        },
        tool_calls: calls,
    });
    Ok(())
}

fn convert_tools<'j>(tools: &'j Json<'_>) -> Result<Vec<Tool<'j>>, IngressError> {
    let tools = want_arr(tools, "tools")?;
    let mut out = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        let what = Path::Root("tools");
        let what = what.at(i);
        let o = want_obj(t, what)?;
        match o.field("type") {
            Json::Null => {}
            Json::Str(s) if s == "custom" => {}
            other => {
                return Err(IngressError::invalid(format!(
                    "{what}.type: server tool `{}` is not supported",
                    other.as_str().unwrap_or("?")
                )));
            }
        }
        let name = want_str(o.field("name"), what.key("name"))?;
        let schema = o.field("input_schema");
        want_obj(schema, what.key("input_schema"))?;
        let description = match o.field("description").present() {
            Some(d) => Some(want_str(d, what.key("description"))?),
            None => None,
        };
        out.push(Tool {
            kind: "function",
            function: Function {
                name,
                description,
                parameters: Some(schema),
                strict: None,
            },
        });
    }
    Ok(out)
}

/// The chat body [`messages_to_chat`] writes, in its key order.
#[derive(Serialize)]
struct ChatBody<'a> {
    model: &'a str,
    messages: Vec<chat::Message<'a>>,
    max_tokens: &'a Number,
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<&'a Number>,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_p: Option<&'a Number>,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_k: Option<&'a Number>,
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    stop: &'a [String],
    #[serde(skip_serializing_if = "Option::is_none")]
    tools: Option<Vec<Tool<'a>>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_choice: Option<ToolChoice<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    parallel_tool_calls: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    user: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream_options: Option<chat::StreamOptions>,
}

/// Converts an Anthropic `MessageCreateParams` body into a chat-completions body.
///
/// 413 `request_too_large` above `limits.max_body_bytes` (checked before parsing); 400
/// `invalid_request_error` for anything malformed. Unknown fields are ignored.
///
/// The body is parsed once into a borrowed tree ([`super::json`]) and the chat body written
/// straight from it: the cost is about that of one `serde_json` parse and one write of the body
/// (docs/performance.md, "Ingress conversion").
#[expect(clippy::too_many_lines, reason = "on tests/it/tidy/long_functions.txt")]
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
    let v = Json::parse(body)
        .map_err(|e| IngressError::invalid(format!("request body is not valid JSON: {e}")))?;
    let req = want_obj(&v, "request body")?;
    let model = want_str(req.field("model"), "model")?;
    let max_tokens = match req.field("max_tokens") {
        Json::Num(n) if n.as_u64().is_some_and(|n| n > 0) => n,
        _ => {
            return Err(IngressError::invalid(
                "max_tokens: expected a positive integer",
            ));
        }
    };
    let messages = want_arr(req.field("messages"), "messages")?;

    let mut chat_msgs = Vec::with_capacity(messages.len() + 1);
    if let Some(system) = req.field("system").present() {
        chat_msgs.push(chat::Message::text(
            "system",
            text_of(system, Path::Root("system"))?,
        ));
    }
    for (i, m) in messages.iter().enumerate() {
        let what = Path::Root("messages");
        let what = what.at(i);
        let o = want_obj(m, what)?;
        let role = want_str(o.field("role"), what.key("role"))?;
        let content = o.field("content");
        let what = what.key("content");
        match role {
            "user" => convert_user(content, what, &mut chat_msgs)?,
            "assistant" => convert_assistant(content, what, &mut chat_msgs)?,
            other => {
                return Err(IngressError::invalid(format!(
                    "messages[{i}].role: `{other}` is not user or assistant"
                )));
            }
        }
    }

    let number = |key: &str| match req.field(key).present() {
        Some(x) => want_num(x, key).map(Some),
        None => Ok(None),
    };
    let (temperature, top_p, top_k) = (number("temperature")?, number("top_p")?, number("top_k")?);
    let mut stop_sequences = Vec::new();
    if let Some(s) = req.field("stop_sequences").present() {
        for (i, x) in want_arr(s, "stop_sequences")?.iter().enumerate() {
            stop_sequences.push(want_str(x, Path::Root("stop_sequences").at(i))?.to_owned());
        }
    }
    let tools = match req.field("tools").present() {
        Some(t) => Some(convert_tools(t)?),
        None => None,
    };
    let (mut tool_choice, mut parallel_tool_calls) = (None, None);
    if let Some(tc) = req.field("tool_choice").present() {
        let o = want_obj(tc, "tool_choice")?;
        let ty = want_str(o.field("type"), "tool_choice.type")?;
        tool_choice = Some(match ty {
            "auto" => ToolChoice::Mode("auto"),
            "any" => ToolChoice::Mode("required"),
            "none" => ToolChoice::Mode("none"),
            "tool" => ToolChoice::Function(want_str(o.field("name"), "tool_choice.name")?),
            other => {
                return Err(IngressError::invalid(format!(
                    "tool_choice.type: `{other}` is not auto, any, tool or none"
                )));
            }
        });
        if matches!(o.get("disable_parallel_tool_use"), Some(Json::Bool(true))) {
            parallel_tool_calls = Some(false);
        }
    }
    let mut user = None;
    if let Some(md) = req.field("metadata").present() {
        let md = want_obj(md, "metadata")?;
        if let Some(u) = md.field("user_id").present() {
            user = Some(want_str(u, "metadata.user_id")?);
        }
    }
    let stream = match req.field("stream") {
        Json::Null => false,
        Json::Bool(b) => *b,
        other => {
            return Err(IngressError::invalid(format!(
                "stream: expected a boolean, got {}",
                other.type_name()
            )));
        }
    };
    let (stream_flag, stream_options) = chat::stream_fields(stream);
    let out = chat::to_bytes(
        &ChatBody {
            model,
            messages: chat_msgs,
            max_tokens,
            temperature,
            top_p,
            top_k,
            stop: &stop_sequences,
            tools,
            tool_choice,
            parallel_tool_calls,
            user,
            stream: stream_flag,
            stream_options,
        },
        body.len() + 256,
    )?;
    Ok(ChatRequest {
        body: out,
        model: model.to_owned(),
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

pub use super::stream::SseEvent;

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

    fn start_message(&mut self, out: &mut Vec<SseEvent>) {
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

    fn end_message(&mut self, out: &mut Vec<SseEvent>) {
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
        stream::push(self, data)
    }

    /// End of the upstream stream (with or without `[DONE]`). Emits the closing events if the
    /// stream is still open: `message_delta` + `message_stop` when a `finish_reason` was seen, an
    /// `error` event otherwise.
    pub fn finish(&mut self) -> Vec<SseEvent> {
        stream::finish(self)
    }
}

impl ChatStreamConverter for AnthropicStream {
    fn is_done(&self) -> bool {
        self.done
    }

    fn max_chunk_bytes(&self) -> usize {
        self.limits.max_chunk_bytes
    }

    fn start(&mut self, out: &mut Vec<SseEvent>) {
        self.start_message(out);
    }

    fn fail(&mut self, message: String, out: &mut Vec<SseEvent>) {
        self.done = true;
        out.push(SseEvent::new("error", error_body(502, &message)));
    }

    fn usage(&mut self, usage: &Value) {
        self.usage = usage_of(Some(usage));
    }

    fn text(&mut self, text: &str, out: &mut Vec<SseEvent>) -> Result<(), String> {
        if self.open != Some(Open::Text) {
            self.open_block(Open::Text, json!({ "type": "text", "text": "" }), out)?;
        }
        self.delta(json!({ "type": "text_delta", "text": text }), out);
        Ok(())
    }

    fn tool_fragment(
        &mut self,
        fragment: ToolFragment<'_>,
        out: &mut Vec<SseEvent>,
    ) -> Result<(), String> {
        let index = fragment.index;
        if self.open != Some(Open::Tool(index)) {
            if self.seen_tools.contains(&index) {
                return Err(format!(
                    "upstream interleaved tool call {index} after its block was closed"
                ));
            }
            self.seen_tools.push(index);
            let id = fragment
                .id
                .map_or_else(|| format!("toolu_{:032x}_{index}", self.id), str::to_owned);
            self.open_block(
                Open::Tool(index),
                json!({ "type": "tool_use", "id": id, "name": fragment.name, "input": {} }),
                out,
            )?;
        }
        if let Some(args) = fragment.arguments {
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

    fn finished(&mut self, finish_reason: &str, choice: &Value) {
        self.finish_reason = Some(finish_reason.to_owned());
        self.matched_stop = choice
            .get("stop_reason")
            .and_then(Value::as_str)
            .map(str::to_owned);
    }

    fn end(&mut self, out: &mut Vec<SseEvent>) -> Result<(), String> {
        if self.finish_reason.is_none() {
            return Err("upstream stream ended before a finish_reason".into());
        }
        self.end_message(out);
        Ok(())
    }
}

#[cfg(test)]
mod tests;
