//! Client-facing ingress protocols converted to and from the OpenAI chat-completions shape the shim
//! backends speak (seed "Anthropic Messages and Responses ingresses").
//!
//! | module | what it holds |
//! |---|---|
//! | `json` | the borrowed JSON tree both request converters parse a body into (one parse, strings and keys borrowed, `serde_json::Value`'s semantics) |
//! | [`continuation`] | mid-stream continuation of a chat-completions or completions stream: SSE event accounting, the continuation body, chunk rewrite and `usage` merge ([`continuation::ChatSplice`]) |
//! | `chat` | the chat-completions request parts the request converters serialise straight from that tree |
//! | [`anthropic`] | Anthropic Messages API (`POST /v1/messages`, `/anthropic/v1/messages`): request → chat body, buffered chat response → `Message`, chat SSE chunks → Anthropic SSE events ([`anthropic::AnthropicStream`]), Anthropic error objects |
//! | [`native`] | an Anthropic request for a `responses_only` model through a native `/v1/responses`: chat body → Responses request, Responses answer → chat completion, Responses SSE events → chat chunks ([`native::ResponsesToChat`]) |
//! | [`prompts`] | per-backend `global_prompts` / `requires_single_leading_system` rewrites of a chat body, shared by dispatch and KV rendering |
//! | `stream` | what both stream converters share: the upstream chunk read once and handed to a `ChatStreamConverter`, [`SseEvent`] |
//! | [`responses`] | OpenAI Responses API (`POST /v1/responses`): request → chat body, buffered chat response → `Response`, chat SSE chunks → Responses events ([`responses::ResponsesStream`]), OpenAI error objects |
//!
//! Sans-IO like the rest of the crate: bytes or `serde_json::Value`s in, values or bytes out; ids
//! arrive as arguments, nothing reads a clock. Routes are wired elsewhere.

pub mod anthropic;
mod chat;
pub mod continuation;
mod json;
pub mod native;
pub mod prompts;
pub mod responses;
mod stream;

pub use stream::SseEvent;

/// The borrowed JSON tree's reading of `bytes`, as a `serde_json::Value` and as its compact text:
/// for the differential fuzz target against `serde_json` (`fuzz/`) and its corpus replay only.
#[doc(hidden)]
pub fn json_tree_for_fuzzing(bytes: &[u8]) -> Result<(serde_json::Value, String), String> {
    let tree = json::Json::parse(bytes).map_err(|e| e.to_string())?;
    Ok((tree.to_value(), tree.to_json_string()))
}

/// The borrowed JSON tree's member `key` of `bytes` read alone (`Json::parse_field`); as
/// [`json_tree_for_fuzzing`], for the fuzz target only.
#[doc(hidden)]
pub fn json_field_for_fuzzing(bytes: &[u8], key: &str) -> Option<serde_json::Value> {
    json::Json::parse_field(bytes, key).map(|field| field.to_value())
}

/// One upstream chat-completions SSE `data:` payload, as both stream converters read it.
pub(crate) enum ChatChunk {
    /// `[DONE]`.
    Done,
    /// A chunk object (not an upstream error).
    Data(serde_json::Map<String, serde_json::Value>),
}

/// Bounds, parses and classifies one upstream `data:` payload: over `max_chunk_bytes`, not a JSON
/// object, or an upstream `error` object is the stream's failure message.
pub(crate) fn parse_chat_chunk(data: &[u8], max_chunk_bytes: usize) -> Result<ChatChunk, String> {
    use serde_json::Value;
    if data.len() > max_chunk_bytes {
        return Err(format!(
            "upstream chunk is {} bytes, over the {max_chunk_bytes}-byte limit",
            data.len()
        ));
    }
    if data.trim_ascii() == b"[DONE]" {
        return Ok(ChatChunk::Done);
    }
    let v: Value = serde_json::from_slice(data)
        .map_err(|e| format!("upstream chunk is not valid JSON: {e}"))?;
    let Value::Object(o) = v else {
        return Err("upstream chunk is not a JSON object".into());
    };
    if let Some(err) = o.get("error") {
        let msg = err
            .get("message")
            .and_then(Value::as_str)
            .map_or_else(|| err.to_string(), str::to_owned);
        return Err(format!("upstream error: {msg}"));
    }
    Ok(ChatChunk::Data(o))
}
