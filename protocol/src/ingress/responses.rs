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

use std::borrow::Cow;

use serde::Serialize;
use serde_json::{Map, Number, Value, json};

use super::anthropic::{DIRECT_MODE_REFUSAL_CODE, IngressError, usage_of};
use super::chat::{self, Content, Function, ImageUrl, Part, Tool, ToolCall, ToolChoice};
use super::json::{Json, Path, want_arr, want_num, want_obj, want_str};
use super::stream::{self, ChatStreamConverter, ToolFragment};

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

/// `{"error":{"message","type","param":null,"code"}}`; `code` is `request_too_large` for a 413
/// and `rate_limit_exceeded` for a 429.
pub fn error_body(status: u16, message: &str) -> Value {
    let code = match status {
        413 => json!("request_too_large"),
        429 => json!("rate_limit_exceeded"),
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
    /// The chat-completions JSON body for the shim, serialised (what the chat route receives).
    pub body: Vec<u8>,
    /// The model the client named.
    pub model: String,
    /// Whether the client asked for an SSE stream.
    pub stream: bool,
    /// Request fields the `Response` object repeats (`instructions`, `tools`, `tool_choice`,
    /// `parallel_tool_calls`, `temperature`, `top_p`, `max_output_tokens`, `metadata`, `user`,
    /// `text`).
    pub echo: Map<String, Value>,
}

impl ChatRequest {
    /// The chat body parsed back into a `serde_json::Value` (for tests and diagnostics).
    pub fn body_json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
}

fn invalid(message: impl Into<String>) -> IngressError {
    IngressError::invalid(message)
}

/// Text of a string or of text-like parts (`input_text`, `output_text`, `refusal`).
fn text_parts<'j>(v: &'j Json<'_>, what: Path<'_>) -> Result<Cow<'j, str>, IngressError> {
    match v {
        Json::Str(s) => Ok(Cow::Borrowed(s)),
        Json::Arr(parts) => {
            let mut out = String::new();
            for (i, p) in parts.iter().enumerate() {
                let what = what.at(i);
                let o = want_obj(p, what)?;
                let ty = want_str(o.field("type"), what.key("type"))?;
                let key = match ty {
                    "input_text" | "output_text" | "text" => "text",
                    "refusal" => "refusal",
                    other => {
                        return Err(invalid(format!(
                            "{what}: content part type `{other}` is not supported here (text only)"
                        )));
                    }
                };
                out.push_str(want_str(o.field(key), what.key(key))?);
            }
            Ok(Cow::Owned(out))
        }
        other => Err(invalid(format!(
            "{what}: expected a string or an array of content parts, got {}",
            other.type_name()
        ))),
    }
}

/// User content: a string, or parts with images kept as `image_url` parts.
fn user_content<'j>(v: &'j Json<'_>, what: Path<'_>) -> Result<Content<'j>, IngressError> {
    let Json::Arr(parts) = v else {
        return Ok(Content::Text(text_parts(v, what)?));
    };
    let mut out = Vec::with_capacity(parts.len());
    for (i, p) in parts.iter().enumerate() {
        let what = what.at(i);
        let o = want_obj(p, what)?;
        let ty = want_str(o.field("type"), what.key("type"))?;
        match ty {
            "input_text" | "output_text" | "text" => {
                let text = want_str(o.field("text"), what.key("text"))?;
                out.push(Part::Text { text });
            }
            "input_image" => {
                if o.field("image_url").is_null() && !o.field("file_id").is_null() {
                    return Err(invalid(format!(
                        "{what}: images by file_id are not supported (use image_url)"
                    )));
                }
                let url = want_str(o.field("image_url"), what.key("image_url"))?;
                let detail = o.field("detail").as_str();
                out.push(Part::ImageUrl {
                    image_url: ImageUrl {
                        url: Cow::Borrowed(url),
                        detail,
                    },
                });
            }
            other => {
                return Err(invalid(format!(
                    "{what}: content part type `{other}` is not supported in a user turn"
                )));
            }
        }
    }
    Ok(Content::Parts(out))
}

/// Appends a tool call to the trailing assistant message (opened by this conversion) or a new one.
fn push_call<'j>(out: &mut Vec<chat::Message<'j>>, call: ToolCall<'j>, last_was_assistant: bool) {
    if last_was_assistant
        && let Some(m) = out.last_mut()
        && m.role == "assistant"
    {
        m.tool_calls.push(call);
        return;
    }
    out.push(chat::Message {
        role: "assistant",
        tool_call_id: None,
        content: Content::Null,
        tool_calls: vec![call],
    });
}

fn convert_items<'j>(
    items: &'j [Json<'_>],
    out: &mut Vec<chat::Message<'j>>,
) -> Result<(), IngressError> {
    // Whether the previous item produced an assistant message that a function_call may join.
    let mut last_was_assistant = false;
    for (i, item) in items.iter().enumerate() {
        let what = Path::Root("input");
        let what = what.at(i);
        let o = want_obj(item, what)?;
        let ty = match o.field("type") {
            Json::Null if o.contains_key("role") => "message",
            other => want_str(other, what.key("type"))?,
        };
        match ty {
            "message" => {
                let role = want_str(o.field("role"), what.key("role"))?;
                let content = o.field("content");
                let cw = what.key("content");
                last_was_assistant = false;
                match role {
                    "user" => out.push(chat::Message {
                        content: user_content(content, cw)?,
                        ..chat::Message::text("user", "")
                    }),
                    "system" | "developer" => {
                        out.push(chat::Message::text("system", text_parts(content, cw)?))
                    }
                    "assistant" => {
                        out.push(chat::Message::text("assistant", text_parts(content, cw)?));
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
                let call_id = want_str(o.field("call_id"), what.key("call_id"))?;
                let name = want_str(o.field("name"), what.key("name"))?;
                let args = want_str(o.field("arguments"), what.key("arguments"))?;
                push_call(
                    out,
                    ToolCall::function(call_id, name, args),
                    last_was_assistant,
                );
                last_was_assistant = true;
            }
            "function_call_output" => {
                let call_id = want_str(o.field("call_id"), what.key("call_id"))?;
                let output = text_parts(o.field("output"), what.key("output"))?;
                out.push(chat::Message::tool(call_id, output));
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

/// The chat tools and the `tools` the `Response` echoes.
fn convert_tools<'j>(tools: &'j Json<'_>) -> Result<(Vec<Tool<'j>>, Value), IngressError> {
    let tools = want_arr(tools, "tools")?;
    let mut chat = Vec::with_capacity(tools.len());
    let mut echo = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        let what = Path::Root("tools");
        let what = what.at(i);
        let o = want_obj(t, what)?;
        let ty = want_str(o.field("type"), what.key("type"))?;
        if ty != "function" {
            return Err(invalid(format!(
                "{what}.type: tool type `{ty}` is not supported (function only)"
            )));
        }
        let name = want_str(o.field("name"), what.key("name"))?;
        let description = match o.field("description").present() {
            Some(d) => Some(want_str(d, what.key("description"))?),
            None => None,
        };
        let parameters = o.field("parameters").present();
        if let Some(p) = parameters {
            want_obj(p, what.key("parameters"))?;
        }
        let strict = match o.field("strict") {
            Json::Null => None,
            Json::Bool(b) => Some(*b),
            other => {
                return Err(invalid(format!(
                    "{what}.strict: expected a boolean, got {}",
                    other.type_name()
                )));
            }
        };
        chat.push(Tool {
            kind: "function",
            function: Function {
                name,
                description,
                parameters,
                strict,
            },
        });
        echo.push(json!({
            "type": "function", "name": name, "description": description,
            "parameters": parameters.map_or(Value::Null, Json::to_value), "strict": strict,
        }));
    }
    Ok((chat, Value::Array(echo)))
}

fn convert_tool_choice<'j>(tc: &'j Json<'_>) -> Result<ToolChoice<'j>, IngressError> {
    match tc {
        Json::Str(s) if matches!(&**s, "auto" | "none" | "required") => Ok(ToolChoice::Mode(s)),
        Json::Str(s) => Err(invalid(format!(
            "tool_choice: `{s}` is not auto, none or required"
        ))),
        Json::Obj(o) => {
            let ty = want_str(o.field("type"), "tool_choice.type")?;
            if ty != "function" {
                return Err(invalid(format!(
                    "tool_choice.type: `{ty}` is not supported (function only)"
                )));
            }
            let name = want_str(o.field("name"), "tool_choice.name")?;
            Ok(ToolChoice::Function(name))
        }
        other => Err(invalid(format!(
            "tool_choice: expected a string or an object, got {}",
            other.type_name()
        ))),
    }
}

/// A chat `response_format`.
#[derive(Serialize)]
#[serde(tag = "type")]
enum ResponseFormat<'a> {
    #[serde(rename = "json_object")]
    JsonObject,
    #[serde(rename = "json_schema")]
    JsonSchema { json_schema: JsonSchema<'a> },
}

#[derive(Serialize)]
struct JsonSchema<'a> {
    name: &'a str,
    schema: &'a Json<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    description: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    strict: Option<bool>,
}

fn convert_text_format<'j>(text: &'j Json<'_>) -> Result<Option<ResponseFormat<'j>>, IngressError> {
    let o = want_obj(text, "text")?;
    let Some(format) = o.field("format").present() else {
        return Ok(None);
    };
    let f = want_obj(format, "text.format")?;
    match want_str(f.field("type"), "text.format.type")? {
        "text" => Ok(None),
        "json_object" => Ok(Some(ResponseFormat::JsonObject)),
        "json_schema" => {
            let name = want_str(f.field("name"), "text.format.name")?;
            let schema = f.field("schema");
            want_obj(schema, "text.format.schema")?;
            let strict = match f.field("strict") {
                Json::Bool(b) => Some(*b),
                _ => None,
            };
            Ok(Some(ResponseFormat::JsonSchema {
                json_schema: JsonSchema {
                    name,
                    schema,
                    description: f.field("description").as_str(),
                    strict,
                },
            }))
        }
        other => Err(invalid(format!(
            "text.format.type: `{other}` is not text, json_object or json_schema"
        ))),
    }
}

/// The chat body [`responses_to_chat`] writes, in its key order.
#[derive(Serialize)]
struct ChatBody<'a> {
    model: &'a str,
    messages: Vec<chat::Message<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_tokens: Option<&'a Number>,
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<&'a Number>,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_p: Option<&'a Number>,
    #[serde(skip_serializing_if = "Option::is_none")]
    user: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tools: Option<Vec<Tool<'a>>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_choice: Option<ToolChoice<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    parallel_tool_calls: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    response_format: Option<ResponseFormat<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream_options: Option<chat::StreamOptions>,
}

/// Converts a Responses `ResponseCreateParams` body into a chat-completions body.
///
/// 413 above `limits.max_body_bytes` (checked before parsing); 400 for anything malformed or
/// unsupported. Unknown fields are ignored. One parse into a borrowed tree, the chat body
/// written straight from it (as [`super::anthropic::messages_to_chat`]).
#[expect(clippy::too_many_lines, reason = "on tests/it/tidy/long_functions.txt")]
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
    let v =
        Json::parse(body).map_err(|e| invalid(format!("request body is not valid JSON: {e}")))?;
    let req = want_obj(&v, "request body")?;
    let model = want_str(req.field("model"), "model")?;
    for key in ["previous_response_id", "conversation"] {
        if !req.field(key).is_null() {
            return Err(invalid(format!(
                "{key}: not supported; the router keeps no conversation state (send the whole input)"
            )));
        }
    }
    if matches!(req.get("background"), Some(Json::Bool(true))) {
        return Err(invalid(
            "background: background responses are not supported",
        ));
    }
    let mut echo = Map::new();
    let mut messages = Vec::new();
    match req.field("instructions") {
        Json::Null => {}
        Json::Str(s) => {
            messages.push(chat::Message::text("system", &**s));
            echo.insert("instructions".into(), json!(s));
        }
        other => {
            return Err(invalid(format!(
                "instructions: expected a string, got {}",
                other.type_name()
            )));
        }
    }
    match req.field("input") {
        Json::Str(s) => messages.push(chat::Message::text("user", &**s)),
        Json::Arr(items) => convert_items(items, &mut messages)?,
        other => {
            return Err(invalid(format!(
                "input: expected a string or an array of input items, got {}",
                other.type_name()
            )));
        }
    }
    let max_tokens = match req.field("max_output_tokens") {
        Json::Null => None,
        Json::Num(n) if n.as_u64().is_some_and(|n| n > 0) => {
            echo.insert("max_output_tokens".into(), Value::Number(n.clone()));
            Some(n)
        }
        _ => return Err(invalid("max_output_tokens: expected a positive integer")),
    };
    let mut number = |key: &str| match req.field(key).present() {
        Some(x) => {
            let n = want_num(x, key)?;
            echo.insert(key.into(), Value::Number(n.clone()));
            Ok::<_, IngressError>(Some(n))
        }
        None => Ok(None),
    };
    let (temperature, top_p) = (number("temperature")?, number("top_p")?);
    let user = match req.field("user").present() {
        Some(u) => {
            let u = want_str(u, "user")?;
            echo.insert("user".into(), json!(u));
            Some(u)
        }
        None => None,
    };
    if let Some(md) = req.field("metadata").present() {
        want_obj(md, "metadata")?;
        echo.insert("metadata".into(), md.to_value());
    }
    let mut tools = None;
    if let Some(t) = req.field("tools").present() {
        let (chat, echoed) = convert_tools(t)?;
        if !chat.is_empty() {
            tools = Some(chat);
        }
        echo.insert("tools".into(), echoed);
    }
    let mut tool_choice = None;
    if let Some(tc) = req.field("tool_choice").present() {
        tool_choice = Some(convert_tool_choice(tc)?);
        echo.insert("tool_choice".into(), tc.to_value());
    }
    let parallel_tool_calls = match req.field("parallel_tool_calls") {
        Json::Null => None,
        Json::Bool(b) => {
            echo.insert("parallel_tool_calls".into(), json!(b));
            Some(*b)
        }
        other => {
            return Err(invalid(format!(
                "parallel_tool_calls: expected a boolean, got {}",
                other.type_name()
            )));
        }
    };
    let mut response_format = None;
    if let Some(text) = req.field("text").present() {
        response_format = convert_text_format(text)?;
        echo.insert("text".into(), text.to_value());
    }
    let stream = match req.field("stream") {
        Json::Null => false,
        Json::Bool(b) => *b,
        other => {
            return Err(invalid(format!(
                "stream: expected a boolean, got {}",
                other.type_name()
            )));
        }
    };
    let (stream_flag, stream_options) = chat::stream_fields(stream);
    let out = chat::to_bytes(
        &ChatBody {
            model,
            messages,
            max_tokens,
            temperature,
            top_p,
            user,
            tools,
            tool_choice,
            parallel_tool_calls,
            response_format,
            stream: stream_flag,
            stream_options,
        },
        body.len() + 256,
    )?;
    Ok(ChatRequest {
        body: out,
        model: model.to_owned(),
        stream,
        echo,
    })
}

/// The `model` a Responses body names, if it is a JSON object with a string `model` (the last
/// one when repeated, as for the conversion); `None` for anything else. Reads the body without
/// building a tree of it (strings and containers other than `model` are skipped).
pub fn requested_model(body: &[u8]) -> Option<String> {
    match Json::parse_field(body, "model")? {
        Json::Str(s) => Some(s.into_owned()),
        _ => None,
    }
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

pub use super::stream::SseEvent;

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

    /// Feeds one upstream `data:` payload (a chat chunk, or `[DONE]`).
    pub fn push(&mut self, data: &[u8]) -> Vec<SseEvent> {
        stream::push(self, data)
    }

    /// End of the upstream stream (with or without `[DONE]`): the closing events if the stream
    /// is still open, `response.failed` when no `finish_reason` was seen.
    pub fn finish(&mut self) -> Vec<SseEvent> {
        stream::finish(self)
    }
}

impl ChatStreamConverter for ResponsesStream {
    fn is_done(&self) -> bool {
        self.done
    }

    fn max_chunk_bytes(&self) -> usize {
        self.limits.max_chunk_bytes
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

    fn fail(&mut self, message: String, out: &mut Vec<SseEvent>) {
        self.done = true;
        let error = json!({ "code": "server_error", "message": message });
        let r = self.snapshot("failed", Value::Null, error, Value::Null);
        self.emit("response.failed", json!({ "response": r }), out);
    }

    fn usage(&mut self, usage: &Value) {
        self.usage = usage_of(Some(usage));
    }

    fn text(&mut self, text: &str, out: &mut Vec<SseEvent>) -> Result<(), String> {
        self.account(text.len())?;
        if self.open != Some(Open::Text) {
            self.open_item(Open::Text, out)?;
        }
        self.text.push_str(text);
        let index = self.output.len();
        self.emit(
            "response.output_text.delta",
            json!({ "item_id": self.item_id, "output_index": index, "content_index": 0,
                    "delta": text, "logprobs": [] }),
            out,
        );
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
                    "upstream interleaved tool call {index} after its item was closed"
                ));
            }
            self.close_item(out);
            self.seen_tools.push(index);
            self.call_id = fragment
                .id
                .map_or_else(|| format!("call_{:032x}_{index}", self.id), str::to_owned);
            self.name = fragment.name.to_owned();
            self.account(self.call_id.len() + self.name.len())?;
            self.open_item(Open::Tool(index), out)?;
        }
        if let Some(args) = fragment.arguments {
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

    fn finished(&mut self, finish_reason: &str, _choice: &Value) {
        self.finish_reason = Some(finish_reason.to_owned());
    }

    fn end(&mut self, out: &mut Vec<SseEvent>) -> Result<(), String> {
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
}

#[cfg(test)]
mod tests;
